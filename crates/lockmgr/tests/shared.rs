//! CITRON's shared mode on the `mem` backend (`docs/SHARED_LOCKS.md`): round trips of the
//! uncontended paths, readers granted together, writers excluded by readers and readers by
//! writers, writers that wait only for the readers of their groups of units, a waiting writer
//! not starved by a stream of readers, dead readers recovered.

use fabric::{MemServer, RegionId, RemoteAddr};
use lockmgr::citron::{BumpAllocator, Citron, CitronClient, CitronConfig, ClientOptions};
use lockmgr::{LockMode, RangeLock};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const POOL: u64 = 16 << 20;

fn setup(config: CitronConfig, options: ClientOptions) -> Citron {
    let server = MemServer::new();
    let bytes = Citron::bytes_needed(config.unit_count).unwrap();
    server.register(RegionId(1), bytes).unwrap();
    server.register(RegionId(2), POOL).unwrap();
    let base = RemoteAddr::new(RegionId(1), 0);
    let mut ep = server.endpoint();
    Citron::create(&mut ep, base, config).unwrap();
    let alloc = Arc::new(BumpAllocator::new(RemoteAddr::new(RegionId(2), 0), POOL));
    Citron::new(Arc::new(server), base, alloc, options)
}

fn calm(units: u64) -> CitronConfig {
    CitronConfig {
        unit_count: units,
        // Generous T_wait: scheduling noise must not trip inequality (1) where round trips
        // are counted exactly.
        t_wait: Some(Duration::from_millis(5)),
        ..Default::default()
    }
}

fn assert_rest(c: &mut CitronClient) {
    let audit = c.audit().unwrap();
    assert!(audit.at_rest(), "not at rest: {audit:?}");
}

/// (range, shared acquire round trips with fast path, without, exclusive with fast path).
const CASES: &[(u64, u64, u64, u64, u64)] = &[
    // One leaf: (b) reads, registration, bits read, notification, root read: one batch.
    // Without: reads; registration + bits; notify + root.
    (10, 20, 1, 3, 1),
    // A node over leaves, nobody in its bakery: (b) reads, registration without a ticket and
    // the node word read, the four children registered and their bits read, notify + root:
    // one batch (exclusive: ticket + reads; Occ + children + notify). Without the fast path:
    // ticket, reads, register+pass, notify+root, window.
    (256, 512, 1, 5, 2),
    // Two leaves, one after the other.
    (60, 70, 2, 6, 2),
    // A node two levels up: one batch as above, then the wait of phase (d) and one window
    // read (exclusive: the ticket's round trip first).
    (0, 1024, 2, 5, 3),
];

/// Acquires and releases `range` in `mode`; returns (acquire RTTs, verbs), (release RTTs, verbs).
fn measure(c: &mut CitronClient, l: u64, r: u64, mode: LockMode) -> ((u64, u64), (u64, u64)) {
    let before = c.endpoint_stats();
    let id = c.acquire_mode(l..r, mode).unwrap();
    let mid = c.endpoint_stats();
    c.release(id).unwrap();
    let after = c.endpoint_stats();
    let (a, b) = (mid.since(&before), after.since(&mid));
    ((a.round_trips, a.verbs), (b.round_trips, b.verbs))
}

/// An acquisition made in a thread of its own, released as soon as granted.
struct Pending {
    granted: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(CitronClient, u64)>,
}

impl Pending {
    /// `c` acquires `range` in `mode` in a new thread, then releases it.
    fn start(mut c: CitronClient, range: std::ops::Range<u64>, mode: LockMode) -> Pending {
        let granted = Arc::new(AtomicBool::new(false));
        let g = granted.clone();
        let thread = std::thread::spawn(move || {
            let before = c.endpoint_stats();
            let id = c.acquire_mode(range, mode).unwrap();
            g.store(true, Ordering::SeqCst);
            let rtts = c.endpoint_stats().since(&before).round_trips;
            c.release(id).unwrap();
            (c, rtts)
        });
        Pending { granted, thread }
    }

    fn granted(&self) -> bool {
        self.granted.load(Ordering::SeqCst)
    }

    /// Whether it was granted within `bound`.
    fn granted_within(&self, bound: Duration) -> bool {
        let start = Instant::now();
        while !self.granted() && start.elapsed() < bound {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.granted()
    }

    /// The client back, and the round trips of its acquisition.
    fn join(self) -> (CitronClient, u64) {
        self.thread.join().unwrap()
    }
}

#[test]
fn uncontended_shared_round_trips() {
    for fast_path in [true, false] {
        let citron = setup(
            calm(1 << 16),
            ClientOptions {
                fast_path,
                ..Default::default()
            },
        );
        let mut c = citron.client().unwrap();
        assert!(c.modes().contains(&LockMode::Shared));
        // Exclusive on a lock never used in shared mode: what every lock pays today.
        for &(l, r, ..) in CASES {
            let (acq, rel) = measure(&mut c, l, r, LockMode::Exclusive);
            eprintln!("exclusive (no readers ever) {l}..{r} fast_path={fast_path}: acquire {acq:?}, release {rel:?} (RTTs, verbs)");
        }
        for &(l, r, fast, slow, _) in CASES {
            let (acq, rel) = measure(&mut c, l, r, LockMode::Shared);
            let want = if fast_path { fast } else { slow };
            assert_eq!(acq.0, want, "shared acquire {l}..{r} fast_path={fast_path}");
            assert_eq!(rel.0, 1, "shared release {l}..{r}");
            eprintln!("shared {l}..{r} fast_path={fast_path}: acquire {acq:?}, release {rel:?} (RTTs, verbs)");
        }
        let stats = c.stats();
        assert_eq!(stats.aborts.total(), 0, "{stats:?}");
        // Exclusive once readers are in use: the first acquisition learns it (one more round
        // trip, once per client), then the same round trips as before, more verbs.
        let _ = measure(&mut c, 10, 20, LockMode::Exclusive);
        for &(l, r, _, slow, fast) in CASES {
            let (acq, rel) = measure(&mut c, l, r, LockMode::Exclusive);
            let want = if fast_path { fast } else { slow };
            assert_eq!(
                acq.0, want,
                "exclusive acquire {l}..{r} fast_path={fast_path}"
            );
            assert_eq!(rel.0, 1, "exclusive release {l}..{r}");
            eprintln!("exclusive (readers in use) {l}..{r} fast_path={fast_path}: acquire {acq:?}, release {rel:?} (RTTs, verbs)");
        }
        assert_rest(&mut c);
    }
}

/// Readers of overlapping ranges (a leaf, a node over leaves, a wide node, the root) are all
/// granted while the others hold, from one client and from several.
#[test]
fn overlapping_readers_are_granted_together() {
    let citron = setup(calm(1 << 12), ClientOptions::default());
    let mut a = citron.client().unwrap();
    let mut b = citron.client().unwrap();
    let ranges = [0..4096, 0..1024, 256..512, 300..310, 305..400, 10..20];
    let mut held = Vec::new();
    for (i, r) in ranges.iter().enumerate() {
        let c = if i % 2 == 0 { &mut a } else { &mut b };
        let start = Instant::now();
        let id = c.acquire_mode(r.clone(), LockMode::Shared).unwrap();
        assert!(start.elapsed() < Duration::from_secs(2), "{r:?} waited");
        held.push((i % 2, id));
    }
    for (who, id) in held {
        if who == 0 {
            a.release(id).unwrap()
        } else {
            b.release(id).unwrap()
        }
    }
    assert_rest(&mut a);
}

/// A writer waits for the readers of its range, at every height; readers wait for a writer.
#[test]
fn writers_and_readers_exclude_each_other() {
    let citron = setup(calm(1 << 12), ClientOptions::default());
    // (reader's range, writer's range)
    let pairs = [
        (10..20, 15..16),     // same leaf
        (0..1024, 300..301),  // reader above the writer
        (300..301, 0..1024),  // reader below the writer
        (256..512, 256..512), // same node over leaves
        (0..4096, 4000..4096),
    ];
    for (rr, wr) in pairs {
        for reader_first in [true, false] {
            let mut first = citron.client().unwrap();
            let (first_range, first_mode, second_range, second_mode) = if reader_first {
                (
                    rr.clone(),
                    LockMode::Shared,
                    wr.clone(),
                    LockMode::Exclusive,
                )
            } else {
                (
                    wr.clone(),
                    LockMode::Exclusive,
                    rr.clone(),
                    LockMode::Shared,
                )
            };
            let id = first.acquire_mode(first_range.clone(), first_mode).unwrap();
            let second = Pending::start(citron.client().unwrap(), second_range, second_mode);
            std::thread::sleep(Duration::from_millis(100));
            assert!(
                !second.granted(),
                "{first_mode:?} {first_range:?} held, yet the other was granted"
            );
            first.release(id).unwrap();
            let (mut second, _) = second.join();
            assert_rest(&mut second);
        }
    }
}

/// A writer waits for the readers of the groups of 8 units its bits touch, not for readers of
/// other units of its leaf (`docs/SHARED_LOCKS.md`, "Encoding"): with a reader holding units
/// 3..5, writers of every other group of the leaf are granted at once, in the one round trip
/// of an uncontended leaf, while a writer of units 6..8 — the reader's group, none of its
/// units — waits for it, the false conflict that is left.
#[test]
fn a_writer_waits_only_for_the_readers_of_its_groups() {
    let citron = setup(calm(1 << 12), ClientOptions::default());
    let mut reader = citron.client().unwrap();
    let held = reader.acquire_mode(3..5, LockMode::Shared).unwrap();
    let mut writer = citron.client().unwrap();
    // The writer learns that readers are in use on this lock (one more round trip, once).
    let id = writer.acquire(1000..1001).unwrap();
    writer.release(id).unwrap();
    for range in [8..9, 15..17, 24..32, 32..40, 40..48, 56..64, 63..65] {
        let pending = Pending::start(writer, range.clone(), LockMode::Exclusive);
        assert!(
            pending.granted_within(Duration::from_secs(2)),
            "a writer of {range:?} waited for a reader of 3..5"
        );
        let (w, rtts) = pending.join();
        writer = w;
        let expected = if range.end > 64 { 2 } else { 1 };
        assert_eq!(
            rtts, expected,
            "{range:?}: round trips of an uncontended acquire"
        );
    }
    // The reader's own group: the writer of 6..8 waits for it.
    let pending = Pending::start(writer, 6..8, LockMode::Exclusive);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!pending.granted(), "6..8 shares a group with 3..5");
    reader.release(held).unwrap();
    let (mut writer, _) = pending.join();
    assert_rest(&mut writer);
}

/// A stream of overlapping readers (always one holding) does not starve a writer: it gets the
/// range within a bound, after which the readers still get theirs.
#[test]
fn a_waiting_writer_is_not_starved_by_readers() {
    let citron = setup(
        calm(1 << 12),
        ClientOptions {
            starvation_after: Duration::from_millis(20),
            ..Default::default()
        },
    );
    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for i in 0..3u64 {
        let mut c = citron.client().unwrap();
        let stop = stop.clone();
        readers.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                // Overlapping readers on a wide node and leaves under it.
                let r = if i == 0 { 0..1024 } else { 100 + i..200 + i };
                let id = c.acquire_mode(r, LockMode::Shared).unwrap();
                std::thread::sleep(Duration::from_millis(2));
                c.release(id).unwrap();
                n += 1;
            }
            n
        }));
    }
    std::thread::sleep(Duration::from_millis(50));
    let mut w = citron.client().unwrap();
    for r in [150..151, 0..1024, 120..130] {
        let start = Instant::now();
        let id = w.acquire(r.clone()).unwrap();
        let took = start.elapsed();
        w.release(id).unwrap();
        assert!(
            took < Duration::from_secs(3),
            "writer {r:?} waited {took:?}"
        );
        eprintln!("writer {r:?} waited {took:?} beside a stream of readers");
    }
    stop.store(true, Ordering::SeqCst);
    for t in readers {
        assert!(t.join().unwrap() > 0);
    }
    assert_rest(&mut w);
}

fn lease_config(units: u64, lease: Duration) -> CitronConfig {
    CitronConfig {
        unit_count: units,
        t_wait: Some(Duration::from_millis(2)),
        t_lease: lease,
        ..Default::default()
    }
}

const LEASE: Duration = Duration::from_millis(100);

/// §3.10 for readers: a client killed while holding shared locks (a leaf, a node over leaves,
/// a wider node, the root) blocks a writer for a bounded time only, and the tree comes back
/// to rest.
#[test]
fn dead_readers_are_recovered() {
    let citron = setup(lease_config(1 << 12, LEASE), ClientOptions::default());
    for (dead, writer) in [
        (10..20, 12..13),
        (256..512, 300..301),
        (0..1024, 0..1024),
        (300..301, 0..4096),
        (0..4096, 17..18),
    ] {
        let mut a = citron.client().unwrap();
        let id = a.acquire_mode(dead.clone(), LockMode::Shared).unwrap();
        a.forget(id).unwrap();
        let mut b = citron.client().unwrap();
        let start = Instant::now();
        let id = b.acquire(writer.clone()).unwrap();
        let took = start.elapsed();
        b.release(id).unwrap();
        assert!(
            took < LEASE * 12,
            "writer {writer:?} after dead reader {dead:?}: {took:?}"
        );
        assert!(b.stats().recoveries >= 1, "{dead:?}: {:?}", b.stats());
        eprintln!("writer {writer:?} after a dead reader of {dead:?}: {took:?}");
        // What the dead reader left where this writer did not need it (a leaf's registration
        // under a wider writer, a notification above a leaf writer) is repaired lazily by the
        // next writer that waits for it: writers on each leaf, then on everything, bring the
        // tree back to rest.
        let leaves = (dead.start / 64..dead.end.div_ceil(64)).map(|p| p * 64..p * 64 + 64);
        for sweep in leaves.chain(std::iter::once(0..4096)) {
            let id = b.acquire(sweep).unwrap();
            b.release(id).unwrap();
        }
        assert_rest(&mut b);
    }
}

/// Scale-up (Alg. 4) carries shared holders: readers held across a scale-up still exclude a
/// writer above the old root, and their release gives the copies back.
#[test]
fn readers_held_across_a_scale_up() {
    let citron = setup(calm(256), ClientOptions::default());
    let mut a = citron.client().unwrap();
    // A reader at the old root and one at a leaf.
    let root = a.acquire_mode(0..256, LockMode::Shared).unwrap();
    let leaf = a.acquire_mode(10..11, LockMode::Shared).unwrap();
    let mut b = citron.client().unwrap();
    // Out of bound: scales the tree up (4x or more).
    let id = b.acquire(1000..1001).unwrap();
    b.release(id).unwrap();
    assert!(b.unit_count() >= 1024, "scaled to {}", b.unit_count());
    let granted = Arc::new(AtomicBool::new(false));
    let g = granted.clone();
    let t = std::thread::spawn(move || {
        // A writer at the new root covers the readers.
        let id = b.acquire(0..1024).unwrap();
        g.store(true, Ordering::SeqCst);
        b.release(id).unwrap();
        b
    });
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !granted.load(Ordering::SeqCst),
        "writer granted beside readers"
    );
    a.release(root).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !granted.load(Ordering::SeqCst),
        "writer granted beside a reader"
    );
    a.release(leaf).unwrap();
    let mut b = t.join().unwrap();
    assert_rest(&mut b);
}

/// A writer killed holding a leaf (it forgets its lock) leaves bits that only a writer's path
/// may clear. Readers of that leaf, and no writer, must get their locks within the bound of
/// `docs/SHARED_LOCKS.md` ("Readers repair a dead writer's leaf": `max(starvation_after,
/// T_lease / 2) + 2·T_lease` per dead leaf for the reads that find the bits, here within
/// `starvation_after + 3·T_lease`; no starvation wait once they are repaired) and leave the
/// tree at rest. Dead writers of a leaf, of two leaves, of a node over leaves (whose
/// fast path locked its four children whole); readers of part of the leaf, of all of it, of
/// more; three reader threads at once; with and without the fast path.
#[test]
fn readers_repair_a_dead_writers_leaf() {
    const STARVE: Duration = Duration::from_millis(40);
    const THREADS: usize = 3;
    const READS: usize = 8;
    for fast_path in [true, false] {
        // (dead writer's range, readers' range, leases more for a dead internal node: its
        // `Occ` is broken as for writers, `docs/SHARED_LOCKS.md` "Lease recovery").
        for (dead, read, extra) in [
            (10..20, 12..13, 0),
            (10..20, 0..64, 0),
            (60..70, 60..70, 0),
            (256..512, 300..301, 4),
            (100..101, 90..130, 0),
        ] {
            let citron = setup(
                lease_config(1 << 12, LEASE),
                ClientOptions {
                    starvation_after: STARVE,
                    fast_path,
                    ..Default::default()
                },
            );
            let mut w = citron.client().unwrap();
            let id = w.acquire(dead.clone()).unwrap();
            w.forget(id).unwrap();
            let readers: Vec<_> = (0..THREADS)
                .map(|_| {
                    let mut c = citron.client().unwrap();
                    let read = read.clone();
                    std::thread::spawn(move || {
                        let mut took = Vec::new();
                        for _ in 0..READS {
                            let start = Instant::now();
                            let id = c.acquire_mode(read.clone(), LockMode::Shared).unwrap();
                            took.push(start.elapsed());
                            c.release(id).unwrap();
                        }
                        (took, c.stats().recoveries)
                    })
                })
                .collect();
            let mut slow = 0;
            let mut recoveries = 0;
            for t in readers {
                let (took, rec) = t.join().unwrap();
                recoveries += rec;
                // Each dead leaf in the read's way is repaired on its own.
                let leaves = (dead.start.max(read.start) / 64..dead.end.min(read.end).div_ceil(64))
                    .count() as u32;
                for d in &took {
                    assert!(
                        *d < (STARVE + LEASE * 3) * leaves.max(1) + LEASE * extra,
                        "fast_path={fast_path}: read {read:?} after dead writer {dead:?} took {d:?}"
                    );
                }
                slow += took.iter().filter(|d| **d >= STARVE).count();
                eprintln!(
                    "fast_path={fast_path} dead {dead:?} read {read:?}: {:?}",
                    took.iter().map(|d| d.as_millis()).collect::<Vec<_>>()
                );
            }
            // The reads that found the bits (at most one per thread, and a few for a dead
            // writer of two leaves) waited; the rest took no starvation wait.
            assert!(
                slow <= 2 * THREADS,
                "fast_path={fast_path}: {slow} of {} reads of {read:?} waited out the starvation bound after dead writer {dead:?}",
                THREADS * READS
            );
            assert!(recoveries >= 1, "no reader repaired the leaf of {dead:?}");
            // No writer came: readers alone bring the tree back to rest. What the dead writer
            // left where these readers did not need it is repaired lazily by the next reader
            // that does, as by writers: readers of each leaf of its range (the other children
            // its fast path locked whole), then of everything (its notifications above the
            // leaves' parents, which only a wider lock's window holds).
            let mut c = citron.client().unwrap();
            let leaves = (dead.start / 64..dead.end.div_ceil(64)).map(|p| p * 64..p * 64 + 64);
            for sweep in leaves.chain(std::iter::once(0..4096)) {
                let id = c.acquire_mode(sweep, LockMode::Shared).unwrap();
                c.release(id).unwrap();
            }
            assert_rest(&mut c);
        }
    }
}
