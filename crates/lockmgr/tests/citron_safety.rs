//! Mutual exclusion of CITRON under concurrency, on the `mem` backend: threads take random
//! ranges (unaligned, 1..2^16 units, some whole-range, some beyond `N`) while the tree scales up
//! from 256 units; every grant is checked against a shadow of the ranges held. At the end every
//! lock word must be at rest (all notifications, tickets and copies given back).
//!
//! Liveness: a watchdog fails the run when any acquisition takes longer than [`LIVENESS`],
//! printing every worker's phase, node and attempt count and the lock words not at rest.

use fabric::{MemServer, RegionId, RemoteAddr};
use lockmgr::citron::layout::NodeWord;
use lockmgr::citron::{BumpAllocator, Citron, CitronConfig, ClientOptions};
use lockmgr::{ChaosConfig, ChaosConnector, RangeLock};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// No acquisition may take longer (the workload's critical sections are microseconds).
const LIVENESS: Duration = Duration::from_secs(10);

const POOL: u64 = 32 << 20;

fn run(fast_path: bool, chaos: bool, threads: usize, ops: usize, seed: u64) {
    let threads = std::env::var("CITRON_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(threads);
    let server = MemServer::new();
    let units: u64 = std::env::var("CITRON_UNITS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let config = CitronConfig {
        unit_count: units,
        max_unit_count: 1 << 20,
        // No false recoveries: holders here are slow only because the machine is busy.
        t_lease: Duration::from_secs(30),
        ..Default::default()
    };
    server
        .register(RegionId(1), Citron::bytes_needed(units).unwrap())
        .unwrap();
    server.register(RegionId(2), POOL).unwrap();
    let base = RemoteAddr::new(RegionId(1), 0);
    Citron::create(&mut server.endpoint(), base, config).unwrap();
    let alloc = Arc::new(BumpAllocator::new(RemoteAddr::new(RegionId(2), 0), POOL));
    // With chaos, batches are delayed by up to 100 µs, far beyond T_wait: inequality (1) and the
    // phase-(d) timing are exercised for real.
    let connector: Arc<dyn fabric::Connector> = if chaos {
        Arc::new(ChaosConnector::new(
            server,
            ChaosConfig {
                seed: Some(seed),
                ..Default::default()
            },
        ))
    } else {
        Arc::new(server)
    };
    let citron = Citron::new(
        connector,
        base,
        alloc,
        ClientOptions {
            fast_path,
            ..Default::default()
        },
    );
    let shadow: Arc<Mutex<Vec<(u64, u64, usize)>>> = Arc::default();
    let epoch = Instant::now();
    // Per worker: when its current acquisition began (ns since `epoch` + 1; 0: none) and what
    // it asked for.
    let watch: Arc<Vec<[AtomicU64; 3]>> = Arc::new(
        (0..threads)
            .map(|_| [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)])
            .collect(),
    );
    let (done, results) = mpsc::channel();
    let mut progress = Vec::new();
    for t in 0..threads {
        let mut lock = citron.client().unwrap();
        progress.push(lock.progress());
        let shadow = shadow.clone();
        let watch = watch.clone();
        let done = done.clone();
        // Not joined directly: a worker stuck in `acquire` must not keep the watchdog from
        // reporting it.
        std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(seed * 1000 + t as u64);
            for i in 0..ops {
                // The address space in use grows over the run, so the tree scales up
                // several times while others hold and wait.
                let reach = (1u64 << 10) << (2 * (i * 5 / ops)).min(10);
                let kind = rng.random_range(0..100);
                let range = if kind < 4 {
                    0..u64::MAX
                } else {
                    let bits = rng.random_range(0..=16);
                    let len = 1 + rng.random_range(0..1u64 << bits);
                    let start = rng.random_range(0..reach);
                    start..start + len
                };
                if std::env::var("CITRON_TRACE").is_ok() {
                    eprintln!("t{t} op{i} acquire {range:?}");
                }
                watch[t][1].store(range.start, Ordering::Relaxed);
                watch[t][2].store(range.end, Ordering::Relaxed);
                watch[t][0].store(epoch.elapsed().as_nanos() as u64 + 1, Ordering::SeqCst);
                let id = lock.acquire(range.clone()).unwrap();
                watch[t][0].store(0, Ordering::SeqCst);
                if std::env::var("CITRON_TRACE").is_ok() {
                    eprintln!("t{t} op{i} got {range:?}");
                }
                {
                    let mut held = shadow.lock().unwrap();
                    if let Some(other) = held
                        .iter()
                        .find(|(l, r, _)| *l < range.end && range.start < *r)
                    {
                        panic!(
                            "thread {t} got {range:?} while thread {} holds {}..{}",
                            other.2, other.0, other.1
                        );
                    }
                    held.push((range.start, range.end, t));
                }
                for _ in 0..rng.random_range(0..3) {
                    std::thread::yield_now();
                }
                shadow
                    .lock()
                    .unwrap()
                    .retain(|(l, r, o)| !(*o == t && *l == range.start && *r == range.end));
                lock.release(id).unwrap();
            }
            let _ = done.send(lock.stats());
        });
    }
    drop(done);
    let mut total = lockmgr::LockStats::default();
    let mut finished = 0;
    let mut checker = citron.client().unwrap();
    while finished < threads {
        match results.recv_timeout(Duration::from_millis(100)) {
            Ok(stats) => {
                total.merge(&stats);
                finished += 1;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let now = epoch.elapsed().as_nanos() as u64;
                let stuck = watch.iter().position(|w| {
                    let since = w[0].load(Ordering::SeqCst);
                    since != 0 && Duration::from_nanos(now.saturating_sub(since)) > LIVENESS
                });
                if let Some(t) = stuck {
                    let mut dump = String::new();
                    for (i, (w, p)) in watch.iter().zip(&progress).enumerate() {
                        let since = w[0].load(Ordering::SeqCst);
                        dump += &format!(
                            "\n  thread {i}: {} [{}, {}) {:?}",
                            if since == 0 {
                                "not acquiring".to_string()
                            } else {
                                format!(
                                    "acquiring for {:?}",
                                    Duration::from_nanos(now.saturating_sub(since))
                                )
                            },
                            w[1].load(Ordering::Relaxed),
                            w[2].load(Ordering::Relaxed),
                            p.snapshot()
                        );
                    }
                    let words = match checker.audit() {
                        Ok(audit) => {
                            let mut out = format!(
                                "spillover busy {}, maximizer {}",
                                audit.spillover_busy, audit.maximizer
                            );
                            for (node, w) in &audit.busy_nodes {
                                out += &if node.is_leaf() {
                                    format!("\n  {node:?}: bits {w:#018x}")
                                } else {
                                    format!("\n  {node:?}: {:?}", NodeWord::decode(*w))
                                };
                            }
                            out
                        }
                        Err(e) => format!("audit failed: {e}"),
                    };
                    panic!(
                        "LIVENESS: thread {t} acquiring for more than {LIVENESS:?}; threads:{dump}\n  record: {:?}\n  lock words not at rest: {words}",
                        checker.record()
                    );
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("a worker panicked"),
        }
    }
    let audit = checker.audit().unwrap();
    assert!(audit.at_rest(), "not at rest after the run: {audit:?}");
    assert_eq!(total.acquisitions, (threads * ops) as u64);
    let _ = &mut checker;
    assert!(total.scale_ups >= 2, "scale-ups: {}", total.scale_ups);
    eprintln!(
        "fast_path={fast_path}: N={} (scale_ups, spillover, fast_path, recoveries, escalations) {:?} rtt/acq {:.2} rtt/rel {:.2} aborts {:?}",
        checker.unit_count(),
        (total.scale_ups, total.spillover, total.fast_path, total.recoveries, total.starvation_escalations),
        total.rtts_per_acquire(),
        total.rtts_per_release(),
        total.aborts
    );
}

#[test]
fn concurrent_ranges_with_scale_ups() {
    run(true, false, 4, 300, 1);
}

#[test]
fn concurrent_ranges_with_scale_ups_under_chaos() {
    run(true, true, 4, 150, 3);
}

#[test]
fn concurrent_ranges_with_scale_ups_no_fast_path() {
    run(false, false, 4, 200, 2);
}
