//! The lock safety checker (docs/ARCHITECTURE.md, "lockmgr"): threads and processes take random ranges —
//! unaligned, 1 to 2^16 units, uniform and Zipf placement, some whole-space locks — through a
//! scheme, with delays injected into every endpoint ([`ChaosConnector`]), and record ownership in
//! a shadow map; any overlap or any acquisition slower than the liveness bound fails.
//!
//! Every scheme runs the same matrix: threads on `mem`, `shm` and `tcp`; processes on `shm` and
//! `tcp` (this test binary re-executes itself as the child workers). Adding a scheme is one line
//! in the `schemes!` list below.
//!
//! The checker's self-tests prove it can fail: a lock that locks nothing, a lock that leaves out
//! the last unit of every range, and a lock that never grants must all be caught.
//!
//! Shared mode (`docs/SHARED_LOCKS.md`): the `*_shared` lines of the matrix ask for half of
//! their locks shared; the shadow lets readers overlap readers and nothing else. Its self-tests:
//! readers of a lock that locks nothing pass (readers may overlap), and CITRON with a
//! deliberately wrong grant — every exclusive request taken shared — is caught, on every
//! backend, threads and processes.

mod common;

use common::servers::{connect_to, Fabric};
use common::{AtomicShadow, FabricShadow, Report, Workload};
use fabric::Backend;
use fabric::{Connector, MemServer, RegionId, RemoteAddr};
use lockmgr::baselines::{LockServerAt, SegSpec};
use lockmgr::chaos::DelayMode;
use lockmgr::citron::{CitronSpec, ClientOptions, NoAllocator};
use lockmgr::schemes::{self, CreateOptions, Created, FixedMemory, OpenOptions};
use lockmgr::{
    ChaosConfig, ChaosConnector, CitronClient, LockError, LockId, LockMode, LockRef, LockScheme,
    LockStats, RangeLock,
};
use std::io::{BufRead, BufReader};
use std::ops::Range;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The region holding the scheme's lock words.
const REGION_LOCK: RegionId = RegionId(1);
/// The region holding the cross-process shadow map.
const REGION_SHADOW: RegionId = RegionId(2);
/// Where the scheme's words start.
const LOCK_BASE: RemoteAddr = RemoteAddr::new(REGION_LOCK, 0);
/// The environment variable that turns this binary into a child worker.
const CHILD_ENV: &str = "CITRONFS_SAFETY_CHILD";

fn chaos(seed: u64) -> ChaosConfig {
    ChaosConfig {
        before: 0.1,
        after: 0.1,
        max_delay: Duration::from_micros(100),
        mode: DelayMode::Auto,
        seed: Some(seed),
    }
}

/// The thread runs' workload: `Workload::default()` (150 acquisitions per worker), or for
/// CITRON [`citron_workload`].
fn workload(kind: &LockScheme) -> Workload {
    if is_citron(kind) {
        citron_workload()
    } else {
        Workload::default()
    }
}

/// The process runs' workload: fewer acquisitions per worker, because the cross-process shadow
/// claims go through fabric verbs (thousands per large range) and three processes start.
fn process_workload(kind: &LockScheme) -> Workload {
    Workload {
        iterations: 50,
        ..workload(kind)
    }
}

fn is_citron(kind: &LockScheme) -> bool {
    kind.is_citron()
}

/// CITRON's tree at first, in units: far below the workload's space, so that out-of-bound
/// requests (the spillover mutex, the maximizer) and concurrent scale-ups (Alg. 4, through the
/// fabric allocator) happen early in every run while others hold and wait.
const CITRON_UNITS: u64 = 1024;

/// CITRON's address space: the tree grows from [`CITRON_UNITS`] to cover it.
const CITRON_SPACE: u64 = 1 << 14;

/// CITRON's workload: a 2^14-unit space (the tree grows 1024 -> 16384 units), ranges up to
/// 2^11 units, half of them Zipf-placed (exponent 1.2) on the low addresses, so that several
/// workers meet on the same few leaves; half the critical sections linger up to 5 ms. A
/// leaf held longer than `ClientOptions::starvation_after` (2 ms) by one worker while another's
/// masked CAS on it keeps failing is what starvation avoidance (§3.5.4, Alg. 2 l. 23-24) is
/// for: the checker requires that it happened. The space is smaller than the baselines' (2^20)
/// so that the cross-process shadow claim of a whole-space lock stays short.
fn citron_workload() -> Workload {
    Workload {
        units: CITRON_SPACE,
        max_size_log2: 10,
        zipf_alpha: 1.2,
        hold_probability: 0.5,
        max_hold: Duration::from_millis(5),
        ..Workload::default()
    }
}

/// `T_lease` for the checker's CITRON locks (§3.10: a lock must be released within it, or its
/// holder is presumed dead). It must exceed the longest critical section by far — under load in
/// a debug build, a whole-space claim in the fabric shadow took 1.5 s — otherwise a live holder
/// is broken into and the checker reports the overlap that follows (seen with the 500 ms
/// default: every overlap was with a whole-space holder, the grantee had suspected a failure).
/// Longer than the liveness bound, a false recovery cannot hide a stall either.
const CITRON_LEASE_MS: u64 = 60_000;

/// Scheme-specific expectations on what happened under chaos.
fn check_stats(kind: &LockScheme, report: &Report, workers: usize, w: &Workload) {
    let stats = &report.stats;
    let expected = (workers * w.iterations) as u64;
    assert_eq!(stats.acquisitions, expected, "{kind}: acquisitions");
    assert_eq!(stats.releases, expected, "{kind}: releases");
    if is_citron(kind) {
        // CITRON's timing-dependent paths must really have run under injected delays.
        let missing = untaken_paths(kind, stats);
        assert!(
            missing.is_empty(),
            "{kind}: under chaos, never took: {missing:?}: {stats:?}"
        );
        // Nobody died: a repair means a live holder was presumed dead (lease too short).
        assert_eq!(stats.recoveries, 0, "{kind}: recoveries: {stats:?}");
    }
    eprintln!(
        "{kind}: {} acquisitions, {:.2} RTTs/acquire, {:.2} RTTs/release, abort rate {:.3}, starvation escalations {}, scale-ups {}, max acquire {:?}",
        stats.acquisitions,
        stats.rtts_per_acquire(),
        stats.rtts_per_release(),
        stats.abort_rate(),
        stats.starvation_escalations,
        stats.scale_ups,
        report.max_acquire
    );
}

/// Bytes of the scheme's lock state, as the creator's defaults resolve it.
fn lock_region_bytes(kind: &LockScheme) -> u64 {
    kind.resolve(&CreateOptions::default())
        .and_then(|resolved| resolved.region_bytes())
        .unwrap_or_else(|e| panic!("{kind}: {e}"))
}

/// Creates the scheme's lock at [`LOCK_BASE`] through the one create function, with the
/// default creator's choices.
fn create_lock(kind: &LockScheme, connector: &dyn Connector) -> Created {
    let mut endpoint = connector.connect().unwrap();
    let mut memory = FixedMemory::new(&mut *endpoint, LOCK_BASE, lock_region_bytes(kind));
    schemes::create(kind, &CreateOptions::default(), &mut memory)
        .unwrap_or_else(|e| panic!("create {kind}: {e}"))
}

/// After a CITRON run: every lock word must be back at rest (tickets passed on, notifications
/// and their scale-up copies given back, the spillover mutex free).
fn check_at_rest(kind: &LockScheme, connector: &dyn Connector) {
    if !is_citron(kind) {
        return;
    }
    let mut client = CitronClient::open(
        connector.connect().unwrap(),
        LOCK_BASE,
        std::sync::Arc::new(NoAllocator),
        ClientOptions::default(),
    )
    .unwrap();
    let audit = client.audit().unwrap();
    assert!(
        audit.at_rest(),
        "{kind}: not at rest after the run: {audit:?}"
    );
    eprintln!("{kind}: N = {} after the run", client.unit_count());
}

/// Safety-checks `kind` with `threads` threads of this process on `backend`, sharing an
/// in-memory shadow; like [`processes_on`], a run that did not take every path
/// [`check_stats`] requires is followed by another, up to three.
fn threads_on(backend: Backend, kind: LockScheme, threads: usize, read_ratio: f64) {
    let w = Workload {
        read_ratio,
        ..workload(&kind)
    };
    run_until_exercised(&kind, threads, &w, |run| {
        threads_run(backend, kind, threads, run, &w)
    });
}

/// Runs `run(0)`, `run(1)`, ... (each safety-checked by itself) until together they took every
/// path [`check_stats`] requires, at most three times, then checks their merged statistics
/// (`workers` workers each doing `w.iterations` per run).
fn run_until_exercised(
    kind: &LockScheme,
    workers: usize,
    w: &Workload,
    mut run: impl FnMut(u64) -> Report,
) {
    let mut report = Report::default();
    let mut runs = 0;
    while runs < 3 {
        report.merge(&run(runs as u64));
        runs += 1;
        if untaken_paths(kind, &report.stats).is_empty() {
            break;
        }
    }
    let all = Workload {
        iterations: w.iterations * runs,
        ..*w
    };
    check_stats(kind, &report, workers, &all);
}

/// One run of [`threads_on`] (`run` varies the injected delays), checked at rest.
fn threads_run(
    backend: Backend,
    kind: LockScheme,
    threads: usize,
    run: u64,
    w: &Workload,
) -> Report {
    threads_run_checked(backend, kind, threads, run, w, false)
        .unwrap_or_else(|violation| panic!("{kind} on {backend:?}: {violation}"))
}

/// [`threads_run`], its violation returned (`broken`: every lock wrapped in [`WriterAsReader`]).
fn threads_run_checked(
    backend: Backend,
    kind: LockScheme,
    threads: usize,
    run: u64,
    w: &Workload,
    broken: bool,
) -> Result<Report, String> {
    let fabric = Fabric::start(backend, &[(REGION_LOCK, lock_region_bytes(&kind).max(8))]);
    let connector = fabric.connector();
    let created = create_lock(&kind, &*connector);
    let options = created.open_options();
    let connector = ChaosConnector::new(connector, chaos(backend as u64 + 1 + 16 * run));
    let shadow = AtomicShadow::new(w.units, threads);
    let report = common::run_threads(threads, 0, *w, |_| {
        let lock = schemes::open(&created.lock, &connector, &options)
            .map_err(|e| format!("open {kind}: {e}"))?;
        Ok((wrap(lock, broken), shadow.clone()))
    })?;
    check_at_rest(&kind, &connector);
    Ok(report)
}

/// CITRON on `tcp` with half the threads acquiring at the host ([`lockmgr::citron::hosted`]:
/// the server runs their acquire and release next to memory) and half one-sided, on one tree.
/// Delays are injected into the one-sided clients' verbs, the hosted clients' calls, and the
/// host's own steps (the procedure's host endpoints are wrapped in a [`ChaosConnector`] too).
fn hosted_and_one_sided_on_tcp(kind: LockScheme, threads: usize, read_ratio: f64) {
    use lockmgr::citron::{hosted, CitronHost, Hosting};
    let fabric = Fabric::start(
        Backend::Tcp,
        &[(REGION_LOCK, lock_region_bytes(&kind).max(8))],
    );
    let host_chaos = chaos(11);
    let host = CitronHost::wrapped(std::sync::Arc::new(move |host| {
        std::sync::Arc::new(ChaosConnector::new(host, host_chaos)) as std::sync::Arc<dyn Connector>
    }));
    fabric
        .server()
        .register_procedure(hosted::PROCEDURE, std::sync::Arc::new(host))
        .unwrap();
    let connector = fabric.connector();
    let created = create_lock(&kind, &*connector);
    let connector = ChaosConnector::new(connector, chaos(12));
    let w = Workload {
        read_ratio,
        ..workload(&kind)
    };
    let shadow = AtomicShadow::new(w.units, threads);
    let report = common::run_threads(threads, 0, w, |worker| {
        let mut options = created.open_options();
        // `Always`: opening fails unless the host really runs this worker's acquisitions.
        options.citron.hosting = if worker % 2 == 0 {
            Hosting::Always
        } else {
            Hosting::Never
        };
        let lock = schemes::open(&created.lock, &connector, &options)
            .map_err(|e| format!("open {kind}: {e}"))?;
        Ok((lock, shadow.clone()))
    })
    .unwrap_or_else(|violation| panic!("{kind}, hosted and one-sided on tcp: {violation}"));
    check_stats(&kind, &report, threads, &w);
    check_at_rest(&kind, &connector);
}

/// The timing-dependent paths [`check_stats`] requires of a CITRON run that `stats` shows it
/// never took (none for the baselines).
fn untaken_paths(kind: &LockScheme, stats: &lockmgr::LockStats) -> Vec<&'static str> {
    if !is_citron(kind) {
        return Vec::new();
    }
    let required = [
        ("an abort", stats.aborts.total() > 0),
        ("a starvation escalation", stats.starvation_escalations > 0),
        // Ranges reach beyond N.
        ("a scale-up", stats.scale_ups > 0),
        // The one-batch leaf's speculative CAS met an occupied ancestor and was undone.
        (
            "a one-batch leaf undone",
            kind.name() != "citron" || stats.aborts.occupied_ancestor > 0,
        ),
    ];
    required
        .into_iter()
        .filter(|&(_, taken)| !taken)
        .map(|(path, _)| path)
        .collect()
}

/// Safety-checks `kind` with `children` processes (this binary, re-executed) of `threads`
/// workers each, locking on one `shm` or `tcp` fabric.
///
/// The shadow map always lives in a separate `shm` fabric: the children are on one host, and
/// checking ownership through tcp verbs (thousands per large range) would only slow the run
/// down without testing the lock any harder.
///
/// A process run is
/// short (its shadow claims cross processes through fabric verbs), and one run in a CI job took
/// no starvation escalation at all (300 acquisitions): a run that did not take every path
/// [`check_stats`] requires is followed by another, up to three, each checked for safety, and
/// the paths are required of them together.
fn processes_on(
    backend: Backend,
    kind: LockScheme,
    children: usize,
    threads: usize,
    read_ratio: f64,
) {
    let w = Workload {
        read_ratio,
        ..process_workload(&kind)
    };
    run_until_exercised(&kind, children * threads, &w, |_| {
        processes_run(backend, &kind, children, threads, &w, false)
            .unwrap_or_else(|violation| panic!("{kind} on {backend:?}: {violation}"))
    });
}

/// One run of [`processes_on`]: the children's merged report, checked at rest.
fn processes_run(
    backend: Backend,
    kind: &LockScheme,
    children: usize,
    threads: usize,
    w: &Workload,
    broken: bool,
) -> Result<Report, String> {
    let kind = *kind;
    let holders = (children * threads) as u64;
    let fabric = Fabric::start(backend, &[(REGION_LOCK, lock_region_bytes(&kind).max(8))]);
    let shadow = Fabric::start(
        Backend::Shm,
        &[(REGION_SHADOW, common::fabric_shadow_bytes(w.units, holders))],
    );
    let created = create_lock(&kind, &*fabric.connector());
    // The lock server's address and token travel to the children in their spec.
    let server_addr = created.server.as_ref().map_or_else(
        || "-".to_string(),
        |at| {
            format!(
                "{},{},{}",
                at.addr, at.credentials.cluster, at.credentials.token
            )
        },
    );

    let (done, results) = mpsc::channel();
    let mut pids = Vec::new();
    for child in 0..children {
        // The children open exactly what was created: the description as `create` returned it.
        let spec = format!(
            "{}|{}|{}|{server_addr}|{child}|{threads}|{}|{}",
            fabric.location(),
            shadow.location(),
            created.lock.scheme,
            w.read_ratio,
            u8::from(broken),
        );
        let mut process = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_worker",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_ENV, spec)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        pids.push(process.id());
        let stdout = process.stdout.take().unwrap();
        let done = done.clone();
        std::thread::spawn(move || {
            let mut result = Err(format!("child {child} reported nothing"));
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest may print "test child_worker ... " on the same line first.
                if let Some(rest) = after(&line, "SAFETY-CHILD-OK ") {
                    result = decode_report(rest)
                        .ok_or_else(|| format!("child {child}: bad report {rest:?}"));
                } else if let Some(rest) = after(&line, "SAFETY-CHILD-FAIL ") {
                    result = Err(format!("child {child}: {rest}"));
                }
            }
            let status = process.wait();
            if result.is_ok() && !status.as_ref().is_ok_and(|s| s.success()) {
                result = Err(format!("child {child} exited with {status:?}"));
            }
            let _ = done.send(result);
        });
    }
    drop(done);
    // Children enforce the per-acquisition liveness bound themselves; this only catches a child
    // that hangs outside an acquisition.
    let deadline = Duration::from_secs(120);
    let mut report = Report::default();
    for _ in 0..children {
        match results.recv_timeout(deadline) {
            Ok(Ok(child)) => report.merge(&child),
            Ok(Err(violation)) => {
                // The other children may still run: stop them (ours, by pid) and report.
                for pid in &pids {
                    let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
                }
                return Err(violation);
            }
            Err(_) => {
                for pid in &pids {
                    // Only our own children, by pid.
                    let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
                }
                panic!("{kind} on {backend:?}: child processes did not finish within {deadline:?}");
            }
        }
    }
    check_at_rest(&kind, &*fabric.connector());
    Ok(report)
}

/// The text after `marker` in `line`.
fn after<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    line.find(marker).map(|at| &line[at + marker.len()..])
}

/// The child side of [`processes_on`]: a no-op unless started by it.
#[test]
fn child_worker() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    match child_main(&spec) {
        Ok(report) => println!("SAFETY-CHILD-OK {}", encode_report(&report)),
        Err(violation) => {
            println!("SAFETY-CHILD-FAIL {}", violation.replace('\n', " "));
            std::process::exit(1);
        }
    }
}

fn child_main(spec: &str) -> Result<Report, String> {
    let fields: Vec<&str> = spec.split('|').collect();
    let [location, shadow_location, kind, server, child, threads, read_ratio, broken] = fields[..]
    else {
        return Err(format!("bad child spec {spec:?}"));
    };
    let kind: LockScheme = kind.parse().map_err(|e: LockError| e.to_string())?;
    let server = match server.split(',').collect::<Vec<_>>()[..] {
        [addr, cluster, token] => Some(LockServerAt {
            addr: addr.parse().map_err(|_| "bad lock server address")?,
            credentials: fabric::Credentials::new(cluster, token),
        }),
        _ => None,
    };
    let child: u64 = child.parse().map_err(|_| "bad child index")?;
    let threads: usize = threads.parse().map_err(|_| "bad thread count")?;
    let broken = broken == "1";
    // The broken-variant runs use their own workload (the parent's shadow is sized for it).
    let base = if broken {
        broken_process_workload()
    } else {
        process_workload(&kind)
    };
    let w = Workload {
        read_ratio: read_ratio.parse().map_err(|_| "bad read ratio")?,
        ..base
    };
    let lock = LockRef {
        scheme: kind,
        base: LOCK_BASE,
    };
    let options = OpenOptions {
        server,
        ..OpenOptions::default()
    };
    let shadow_fabric = connect_to(shadow_location)?;
    let connector = ChaosConnector::new(connect_to(location)?, chaos(100 + child));
    let holder_base = child * threads as u64;
    let w = Workload {
        seed: w.seed ^ (child + 1),
        ..w
    };
    common::run_threads(threads, holder_base, w, |_| {
        let lock =
            schemes::open(&lock, &connector, &options).map_err(|e| format!("open {kind}: {e}"))?;
        let shadow = FabricShadow::new(
            shadow_fabric.connect().map_err(|e| e.to_string())?,
            REGION_SHADOW,
            w.units,
        );
        Ok((wrap(lock, broken), shadow))
    })
}

/// The statistics a child reports, as space-separated numbers.
fn encode_report(report: &Report) -> String {
    let s = &report.stats;
    [
        s.acquisitions,
        s.releases,
        s.aborts.time_limit,
        s.aborts.scale_up,
        s.aborts.leaf_conflict,
        s.aborts.suspected_failure,
        s.aborts.restart,
        s.aborts.occupied_ancestor,
        s.retries,
        s.fast_path,
        s.starvation_escalations,
        s.spillover,
        s.scale_ups,
        s.recoveries,
        s.acquire.round_trips,
        s.release.round_trips,
        report.max_acquire.as_nanos() as u64,
    ]
    .map(|n| n.to_string())
    .join(" ")
}

fn decode_report(line: &str) -> Option<Report> {
    let n: Vec<u64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let [acquisitions, releases, time_limit, scale_up, leaf_conflict, suspected_failure, restart, occupied_ancestor, retries, fast_path, starvation_escalations, spillover, scale_ups, recoveries, acquire_rtts, release_rtts, max_ns] =
        n[..]
    else {
        return None;
    };
    let mut stats = LockStats {
        acquisitions,
        releases,
        retries,
        fast_path,
        starvation_escalations,
        spillover,
        scale_ups,
        recoveries,
        ..LockStats::default()
    };
    stats.aborts.time_limit = time_limit;
    stats.aborts.scale_up = scale_up;
    stats.aborts.leaf_conflict = leaf_conflict;
    stats.aborts.suspected_failure = suspected_failure;
    stats.aborts.restart = restart;
    stats.aborts.occupied_ancestor = occupied_ancestor;
    stats.acquire.round_trips = acquire_rtts;
    stats.release.round_trips = release_rtts;
    Some(Report {
        stats,
        max_acquire: Duration::from_nanos(max_ns),
    })
}

/// The matrix: each line is one scheme, run with threads on mem, shm and tcp and processes on
/// shm and tcp. A line may carry `ignore = "why"` for a scheme that is known to fail the checker,
/// so the failure stays visible (`cargo test -- --ignored`) without blocking everyone else.
macro_rules! schemes {
    ($($name:ident => $kind:expr, reads $reads:expr $(, ignore = $why:literal)?;)*) => {$(
        mod $name {
            use super::*;

            #[test]
            $(#[ignore = $why])?
            fn threads_on_mem() {
                threads_on(Backend::Mem, $kind, 4, $reads);
            }

            #[test]
            $(#[ignore = $why])?
            fn threads_on_shm() {
                threads_on(Backend::Shm, $kind, 4, $reads);
            }

            #[test]
            $(#[ignore = $why])?
            fn threads_on_tcp() {
                threads_on(Backend::Tcp, $kind, 4, $reads);
            }

            /// `rdma` on its `soft` provider: a NIC's semantics (atomics atomic among
            /// themselves only, RC ordering), masked atomics emulated by the client's CAS loops
            /// (CITRON's `T_wait` as the creator measures it, counting the emulation's round
            /// trips: `lockmgr::citron::t_wait_round_trips`).
            #[cfg(feature = "rdma")]
            #[test]
            $(#[ignore = $why])?
            fn threads_on_rdma_soft() {
                std::env::set_var(fabric::rdma::ENV_PROVIDER, "soft");
                threads_on(Backend::Rdma, $kind, 4, $reads);
            }

            #[test]
            $(#[ignore = $why])?
            fn processes_on_shm() {
                processes_on(Backend::Shm, $kind, 3, 2, $reads);
            }

            #[test]
            $(#[ignore = $why])?
            fn processes_on_tcp() {
                processes_on(Backend::Tcp, $kind, 3, 2, $reads);
            }
        }
    )*};
}

#[test]
fn citron_hosted_and_one_sided_on_tcp() {
    hosted_and_one_sided_on_tcp(LockScheme::Citron(citron(true)), 4, 0.0);
}

/// Readers and writers at the host (which runs each request in its mode) beside readers and
/// writers acquiring one-sided, on one tree.
#[test]
fn citron_shared_hosted_and_one_sided_on_tcp() {
    hosted_and_one_sided_on_tcp(LockScheme::Citron(citron(true)), 4, 0.5);
}

#[test]
fn citron_nofastpath_hosted_and_one_sided_on_tcp() {
    hosted_and_one_sided_on_tcp(LockScheme::Citron(citron(false)), 4, 0.0);
}

schemes! {
    mutex => LockScheme::MUTEX, reads 0.0;
    // Segments wrap: 2^20 units / 256 = 4096 segments onto 1024 lock words.
    seg => LockScheme::Seg(SegSpec { segment_units: 256, segments: 1024 }), reads 0.0;
    server => LockScheme::SERVER, reads 0.0;
    // Scale-ups from CITRON_UNITS through the fabric allocator over the lock's growth room (the
    // default creator's growth); a lease far above the critical sections (see CITRON_LEASE_MS).
    citron => LockScheme::Citron(citron(true)), reads 0.0;
    citron_nofastpath => LockScheme::Citron(citron(false)), reads 0.0;
    // Shared mode: half of the acquisitions are readers (`docs/SHARED_LOCKS.md`).
    citron_shared => LockScheme::Citron(citron(true)), reads 0.5;
    citron_nofastpath_shared => LockScheme::Citron(citron(false)), reads 0.5;
    server_shared => LockScheme::SERVER, reads 0.5;
    // A scheme without a shared mode grants shared requests exclusively: still safe.
    mutex_shared => LockScheme::MUTEX, reads 0.5;
}

/// The checker's CITRON: [`CITRON_UNITS`] growing to [`CITRON_SPACE`], [`CITRON_LEASE_MS`],
/// `T_wait` measured by the creator.
fn citron(fast_path: bool) -> CitronSpec {
    CitronSpec {
        unit_count: CITRON_UNITS,
        max_unit_count: CITRON_SPACE,
        lease_ms: CITRON_LEASE_MS,
        ..CitronSpec::plain(fast_path)
    }
}

// ---- The checker's self-tests: broken locks must be caught. ----

/// Locks nothing.
struct NoopLock(u64);

impl RangeLock for NoopLock {
    fn acquire(&mut self, _range: Range<u64>) -> Result<LockId, LockError> {
        self.0 += 1;
        Ok(LockId(self.0))
    }
    fn release(&mut self, _id: LockId) -> Result<(), LockError> {
        Ok(())
    }
    fn stats(&self) -> LockStats {
        LockStats::default()
    }
    fn scheme(&self) -> &'static str {
        "noop"
    }
}

/// A correct lock asked for one unit less than requested: only unit-exact checking sees it.
struct OffByOne(Box<dyn RangeLock>);

impl RangeLock for OffByOne {
    fn acquire(&mut self, range: Range<u64>) -> Result<LockId, LockError> {
        let end = (range.end - 1).max(range.start + 1);
        self.0.acquire(range.start..end)
    }
    fn release(&mut self, id: LockId) -> Result<(), LockError> {
        self.0.release(id)
    }
    fn stats(&self) -> LockStats {
        self.0.stats()
    }
    fn scheme(&self) -> &'static str {
        "off-by-one"
    }
}

/// Never grants.
struct StuckLock;

impl RangeLock for StuckLock {
    fn acquire(&mut self, _range: Range<u64>) -> Result<LockId, LockError> {
        loop {
            std::thread::park();
        }
    }
    fn release(&mut self, _id: LockId) -> Result<(), LockError> {
        Ok(())
    }
    fn stats(&self) -> LockStats {
        LockStats::default()
    }
    fn scheme(&self) -> &'static str {
        "stuck"
    }
}

/// A small, crowded space where broken locks collide quickly.
fn crowded() -> Workload {
    Workload {
        units: 64,
        max_size_log2: 3,
        whole: 0.0,
        iterations: 5000,
        hold_probability: 1.0,
        max_hold: Duration::from_micros(20),
        ..Workload::default()
    }
}

#[test]
fn checker_catches_a_lock_that_locks_nothing() {
    let w = crowded();
    let shadow = AtomicShadow::new(w.units, 4);
    let result = common::run_threads(4, 0, w, |_| {
        Ok((Box::new(NoopLock(0)) as Box<dyn RangeLock>, shadow.clone()))
    });
    let violation = result.expect_err("the checker missed a lock that locks nothing");
    assert!(violation.contains("OVERLAP"), "{violation}");
}

#[test]
fn checker_catches_a_lock_that_drops_the_last_unit() {
    let w = crowded();
    let shadow = AtomicShadow::new(w.units, 4);
    let created = create_lock(&LockScheme::SERVER, &MemServer::new());
    let result = common::run_threads(4, 0, w, |_| {
        let inner = schemes::open(&created.lock, &MemServer::new(), &created.open_options())
            .map_err(|e| e.to_string())?;
        Ok((
            Box::new(OffByOne(inner)) as Box<dyn RangeLock>,
            shadow.clone(),
        ))
    });
    let violation = result.expect_err("the checker missed a lock that leaves out one unit");
    assert!(violation.contains("OVERLAP"), "{violation}");
}

#[test]
fn checker_catches_a_lock_that_never_grants() {
    let w = Workload {
        liveness: Duration::from_millis(200),
        ..crowded()
    };
    let shadow = AtomicShadow::new(w.units, 1);
    let result = common::run_threads(1, 0, w, |_| {
        Ok((Box::new(StuckLock) as Box<dyn RangeLock>, shadow.clone()))
    });
    let violation = result.expect_err("the checker missed a lock that never grants");
    assert!(violation.contains("LIVENESS"), "{violation}");
}

// ---- Shared mode: readers may overlap readers; a wrong grant must be caught. ----

/// A deliberately wrong grant: every exclusive request is taken in shared mode, so a writer is
/// admitted beside readers and other writers of its range.
struct WriterAsReader(Box<dyn RangeLock>);

impl RangeLock for WriterAsReader {
    fn acquire(&mut self, range: Range<u64>) -> Result<LockId, LockError> {
        self.0.acquire_mode(range, LockMode::Shared)
    }
    fn acquire_mode(&mut self, range: Range<u64>, _mode: LockMode) -> Result<LockId, LockError> {
        self.0.acquire_mode(range, LockMode::Shared)
    }
    fn release(&mut self, id: LockId) -> Result<(), LockError> {
        self.0.release(id)
    }
    fn stats(&self) -> LockStats {
        self.0.stats()
    }
    fn scheme(&self) -> &'static str {
        "writer-as-reader"
    }
}

/// The lock itself, or (`broken`) wrapped in [`WriterAsReader`].
fn wrap(lock: Box<dyn RangeLock>, broken: bool) -> Box<dyn RangeLock> {
    if broken {
        Box::new(WriterAsReader(lock))
    } else {
        lock
    }
}

#[test]
fn checker_lets_readers_overlap() {
    let w = Workload {
        read_ratio: 1.0,
        ..crowded()
    };
    let shadow = AtomicShadow::new(w.units, 4);
    common::run_threads(4, 0, w, |_| {
        Ok((Box::new(NoopLock(0)) as Box<dyn RangeLock>, shadow.clone()))
    })
    .expect("readers may overlap readers");
}

#[test]
fn checker_catches_a_reader_beside_a_writer() {
    let w = Workload {
        read_ratio: 0.5,
        ..crowded()
    };
    let shadow = AtomicShadow::new(w.units, 4);
    let result = common::run_threads(4, 0, w, |_| {
        Ok((Box::new(NoopLock(0)) as Box<dyn RangeLock>, shadow.clone()))
    });
    let violation = result.expect_err("the checker missed readers beside writers");
    assert!(violation.contains("OVERLAP"), "{violation}");
}

/// The crowded CITRON workload of the broken-variant runs: a small space, so that a writer
/// taken as a reader meets another holder soon; mostly writers.
fn broken_workload() -> Workload {
    Workload {
        units: 4096,
        max_size_log2: 6,
        whole: 0.0,
        iterations: 400,
        hold_probability: 1.0,
        max_hold: Duration::from_micros(200),
        read_ratio: 0.2,
        ..citron_workload()
    }
}

/// [`broken_workload`] for the process runs (the children build the same).
fn broken_process_workload() -> Workload {
    Workload {
        iterations: 100,
        ..broken_workload()
    }
}

fn caught(kind: &LockScheme, result: Result<Report, String>) {
    let violation = result.expect_err("the checker missed CITRON granting writers as readers");
    assert!(violation.contains("OVERLAP"), "{kind}: {violation}");
    eprintln!("{kind}: caught: {violation}");
}

macro_rules! broken_citron {
    ($($name:ident => $fast:expr;)*) => {$(
        mod $name {
            use super::*;

            #[test]
            fn caught_threads_on_mem() {
                let kind = LockScheme::Citron(citron($fast));
                caught(&kind, threads_run_checked(Backend::Mem, kind, 4, 0, &broken_workload(), true));
            }

            #[test]
            fn caught_threads_on_shm() {
                let kind = LockScheme::Citron(citron($fast));
                caught(&kind, threads_run_checked(Backend::Shm, kind, 4, 0, &broken_workload(), true));
            }

            #[test]
            fn caught_threads_on_tcp() {
                let kind = LockScheme::Citron(citron($fast));
                caught(&kind, threads_run_checked(Backend::Tcp, kind, 4, 0, &broken_workload(), true));
            }

            #[test]
            fn caught_processes_on_shm() {
                let kind = LockScheme::Citron(citron($fast));
                let w = broken_process_workload();
                caught(&kind, processes_run(Backend::Shm, &kind, 3, 2, &w, true));
            }

            #[test]
            fn caught_processes_on_tcp() {
                let kind = LockScheme::Citron(citron($fast));
                let w = broken_process_workload();
                caught(&kind, processes_run(Backend::Tcp, &kind, 3, 2, &w, true));
            }
        }
    )*};
}

broken_citron! {
    citron_writer_as_reader => true;
}
