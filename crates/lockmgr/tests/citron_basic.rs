//! CITRON on the `mem` backend: round trips per operation (fast path and not), scale-up with
//! locks held across it, scale-down, and lease recovery after dead clients (CITRON §3.8-3.10).

use fabric::{MemServer, RegionId, RemoteAddr};
use lockmgr::citron::{BumpAllocator, Citron, CitronClient, CitronConfig, ClientOptions};
use lockmgr::RangeLock;
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
        // Generous T_wait: scheduling noise on a loaded test machine must not trip inequality
        // (1) here, where round trips are counted exactly.
        t_wait: Some(Duration::from_millis(5)),
        // A lease far above these tests' critical sections: under load, a debug build's
        // scale-up and audit while a lock is held took past the 500 ms default, and the late
        // release then (correctly) left the lock's words to lazy recovery.
        t_lease: Duration::from_secs(30),
        ..Default::default()
    }
}

fn assert_rest(c: &mut CitronClient) {
    let audit = c.audit().unwrap();
    assert!(audit.at_rest(), "not at rest: {audit:?}");
}

/// (range, acquire round trips with fast path, without).
const CASES: &[(u64, u64, u64, u64)] = &[
    // One leaf: (b) reads, (c)+(d) CAS, notify, root read, all in one batch (the one-batch
    // leaf). Without: reads; CAS; notify+root.
    (10, 20, 1, 3),
    // A node over leaves: ticket+reads; occupy+children+notify+root. Without: ticket, reads,
    // occupy, notify+root, window.
    (256, 512, 2, 5),
    // Two leaves, one after the other.
    (60, 70, 2, 6),
    // A node two levels up: the wait of phase (d) and one window read are needed.
    (0, 1024, 3, 5),
];

#[test]
fn uncontended_round_trips() {
    for fast_path in [true, false] {
        let citron = setup(
            calm(1 << 16),
            ClientOptions {
                fast_path,
                ..Default::default()
            },
        );
        let mut c = citron.client().unwrap();
        assert_eq!(
            c.scheme(),
            if fast_path {
                "citron"
            } else {
                "citron-nofastpath"
            }
        );
        for &(l, r, fast, slow) in CASES {
            let before = c.endpoint_stats();
            let id = c.acquire(l..r).unwrap();
            let mid = c.endpoint_stats();
            c.release(id).unwrap();
            let after = c.endpoint_stats();
            let want = if fast_path { fast } else { slow };
            assert_eq!(
                mid.since(&before).round_trips,
                want,
                "acquire {l}..{r} fast_path={fast_path}"
            );
            assert_eq!(after.since(&mid).round_trips, 1, "release {l}..{r}");
        }
        let stats = c.stats();
        assert_eq!(stats.acquisitions, CASES.len() as u64);
        assert_eq!(stats.aborts.total(), 0);
        assert_eq!(stats.rtts_per_release(), 1.0);
        if fast_path {
            // The leaf, the node over leaves and the two leaves never waited.
            assert_eq!(stats.fast_path, 3);
        }
        assert_rest(&mut c);
    }
}

#[test]
fn spillover_and_scale_up() {
    let citron = setup(calm(256), ClientOptions::default());
    let mut c = citron.client().unwrap();
    assert_eq!(c.unit_count(), 256);
    let id = c.acquire(1000..1010).unwrap();
    assert!(c.unit_count() >= 1024, "scaled to {}", c.unit_count());
    assert_eq!(c.stats().scale_ups, 1);
    c.release(id).unwrap();
    // Far beyond the scale-up limit: the spillover mutex, no growth.
    let id = c.acquire(5 << 30..(5 << 30) + 7).unwrap();
    c.release(id).unwrap();
    let audit = c.audit().unwrap();
    assert!(audit.at_rest(), "{audit:?}");
    assert_eq!(audit.maximizer, 0);
    assert!(c.stats().spillover >= 1);
}

#[test]
fn locks_held_across_a_scale_up_release_their_copies() {
    // Height 5 (16384 units): a leaf lock notifies level 3 (top m levels, copied by a scale-up),
    // a root lock is the old root's Occ (copied to the new parent).
    let citron = setup(calm(16384), ClientOptions::default());
    let mut a = citron.client().unwrap();
    let mut b = citron.client().unwrap();
    let leaf = a.acquire(0..1).unwrap();
    let mut a2 = citron.client().unwrap();
    // Level 3 and level 2 nodes (notifying the root and level 3 of the old tree).
    let mid = a2.acquire(4096..4352).unwrap();
    // Grow to 2^22 units (height 9, four levels up).
    let far = b.acquire((1 << 20)..(1 << 20) + 1).unwrap();
    assert_eq!(b.unit_count(), 1 << 22);
    b.release(far).unwrap();
    // The notifications of the held locks were copied above the old root (Alg. 4 l. 8).
    let audit = b.audit().unwrap();
    assert!(
        audit.busy_nodes.iter().any(|(n, _)| n.hgt >= 5),
        "no copies in the new part: {audit:?}"
    );
    a.release(leaf).unwrap();
    a2.release(mid).unwrap();
    assert_rest(&mut b);

    // Now the old root occupied across a scale-up, and a new-tree client at the top must wait.
    let citron = setup(calm(16384), ClientOptions::default());
    let mut a = citron.client().unwrap();
    let mut b = citron.client().unwrap();
    let root = a.acquire(0..16384).unwrap();
    let far = b.acquire((1 << 20)..(1 << 20) + 1).unwrap();
    b.release(far).unwrap();
    let audit = b.audit().unwrap();
    assert!(
        audit.busy_nodes.iter().any(|(n, _)| n.hgt == 5),
        "the old root's Occ was not copied to its new parent: {audit:?}"
    );
    let c = citron.clone();
    let waiter = std::thread::spawn(move || {
        let mut c = c.client().unwrap();
        let id = c.acquire(0..1 << 22).unwrap();
        let at = Instant::now();
        c.release(id).unwrap();
        at
    });
    std::thread::sleep(Duration::from_millis(100));
    let released = Instant::now();
    a.release(root).unwrap();
    let got = waiter.join().unwrap();
    assert!(
        got >= released,
        "the whole new tree was granted while the old root was held"
    );
    assert_rest(&mut b);
}

#[test]
fn scale_down_under_a_whole_range_lock() {
    let citron = setup(calm(1 << 16), ClientOptions::default());
    let mut a = citron.client().unwrap();
    let mut stale = citron.client().unwrap();
    let id = stale.acquire(70000..70001).unwrap(); // spillover only
    stale.release(id).unwrap();
    let whole = a.acquire(0..u64::MAX).unwrap();
    assert_eq!(a.scale_down(whole, 300).unwrap(), 1024);
    a.release(whole).unwrap();
    assert_eq!(a.unit_count(), 1024);
    // A client with the old configuration finds out through Exp and carries on.
    let id = stale.acquire(10..20).unwrap();
    assert_eq!(stale.unit_count(), 1024);
    stale.release(id).unwrap();
    let id = stale.acquire(900..5000).unwrap(); // partly beyond the new N
    stale.release(id).unwrap();
    assert_rest(&mut a);
    // Scale-down needs the whole range.
    let part = a.acquire(0..10).unwrap();
    assert!(a.scale_down(part, 256).is_err());
    a.release(part).unwrap();
}

fn lease_config(units: u64, lease: Duration) -> CitronConfig {
    CitronConfig {
        unit_count: units,
        t_lease: lease,
        ..Default::default()
    }
}

const LEASE: Duration = Duration::from_millis(30);

fn timed(c: &mut CitronClient, l: u64, r: u64) -> Duration {
    let start = Instant::now();
    let id = c.acquire(l..r).unwrap();
    let spent = start.elapsed();
    c.release(id).unwrap();
    spent
}

#[test]
fn recovery_dead_leaf_holder() {
    let citron = setup(lease_config(1 << 16, LEASE), ClientOptions::default());
    let mut dead = citron.client().unwrap();
    let id = dead.acquire(100..110).unwrap();
    dead.forget(id).unwrap();
    drop(dead);
    let mut b = citron.client().unwrap();
    let spent = timed(&mut b, 105, 106);
    assert!(spent < LEASE * 10, "took {spent:?}");
    assert!(b.stats().recoveries >= 1);
    assert!(b.stats().starvation_escalations >= 1);
    // The dead client's notification higher up is repaired by the next lock that looks there.
    let spent = timed(&mut b, 0, 1 << 16);
    assert!(spent < LEASE * 10, "took {spent:?}");
    assert_rest(&mut b);
}

#[test]
fn recovery_dead_internal_holder() {
    let citron = setup(lease_config(1 << 16, LEASE), ClientOptions::default());
    let mut dead = citron.client().unwrap();
    // A node over leaves (its four leaves locked whole by the fast path).
    let id = dead.acquire(256..512).unwrap();
    dead.forget(id).unwrap();
    let mut b = citron.client().unwrap();
    assert!(timed(&mut b, 256, 512) < LEASE * 10);
    // Its leaves are repaired by whoever needs them.
    for l in [300, 340, 400, 500] {
        assert!(timed(&mut b, l, l + 1) < LEASE * 10);
    }
    // A node two levels up, found occupied from below (Alg. 2 l. 18).
    let id = dead.acquire(1024..2048).unwrap();
    dead.forget(id).unwrap();
    assert!(timed(&mut b, 1030, 1031) < LEASE * 10);
    assert!(b.stats().aborts.suspected_failure >= 1);
    assert!(timed(&mut b, 0, 1 << 16) < LEASE * 10);
    assert_rest(&mut b);
}

#[test]
fn recovery_dead_spillover_holder() {
    let options = ClientOptions {
        auto_scale_up: false,
        ..Default::default()
    };
    let citron = setup(lease_config(256, LEASE), options);
    let mut dead = citron.client().unwrap();
    let id = dead.acquire(1000..1010).unwrap();
    dead.forget(id).unwrap();
    let mut b = citron.client().unwrap();
    let spent = timed(&mut b, 1005, 1006);
    assert!(spent >= LEASE && spent < LEASE * 10, "took {spent:?}");
    assert!(b.stats().recoveries >= 1);
    assert_rest(&mut b);
}

/// The one-batch leaf (`citron::acquire`): a leaf request whose batched phase-(b) reads find an
/// occupied ancestor undoes its CAS and notifications, waits in phase (b), and gets the leaf
/// only once the ancestor is released; nothing of the undone attempt stays behind.
#[test]
fn one_batch_leaf_waits_for_an_occupied_ancestor() {
    let citron = setup(calm(1 << 16), ClientOptions::default());
    let mut a = citron.client().unwrap();
    // Two levels above the leaves: its leaves stay free, so the speculative CAS succeeds.
    let wide = a.acquire(0..1024).unwrap();
    let mut b = citron.client().unwrap();
    let progress = b.progress();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let id = b.acquire(300..301).unwrap();
        tx.send(()).unwrap();
        b.release(id).unwrap();
        b
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while progress.snapshot().last_abort != lockmgr::citron::progress::WHY[6] {
        assert!(Instant::now() < deadline, "{:?}", progress.snapshot());
        std::thread::yield_now();
    }
    // Undone and waiting: not granted while the ancestor is held.
    assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
    a.release(wide).unwrap();
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let mut b = waiter.join().unwrap();
    let stats = b.stats();
    assert_eq!(stats.aborts.occupied_ancestor, 1, "{stats:?}");
    assert_eq!(stats.fast_path, 0);
    assert_rest(&mut b);
}

/// A lock made over memory that held something else (the meta server reuses freed lock
/// memory) starts at rest: `Citron::create` zeroes all of it, however many batches that takes
/// (a small tree in one, with its record; a large one in several), and writes the record.
#[test]
fn a_lock_made_over_dirty_memory_starts_at_rest() {
    use fabric::EndpointExt;
    // A first tree of a few hundred bytes; one of some MiB (several zeroing batches).
    for units in [1 << 10, 1 << 24] {
        let config = calm(units);
        let server = MemServer::new();
        let bytes = Citron::bytes_needed(config.unit_count).unwrap();
        assert!(
            units < 1 << 20 || bytes > 2 << 20,
            "{bytes} bytes: one batch"
        );
        server.register(RegionId(1), bytes).unwrap();
        server.register(RegionId(2), POOL).unwrap();
        let base = RemoteAddr::new(RegionId(1), 0);
        let mut ep = server.endpoint();
        let garbage = vec![0xA5u8; bytes as usize];
        for at in (0..bytes).step_by(1 << 20) {
            let n = (bytes - at).min(1 << 20) as usize;
            ep.write(base.add(at), &garbage[..n]).unwrap();
        }
        Citron::create(&mut ep, base, config).unwrap();
        // Past the record (whose sealed bytes end in zeros), every byte is zero.
        let tail = ep.read(base.add(2048), (bytes - 2048) as usize).unwrap();
        assert!(
            tail.iter().all(|&b| b == 0),
            "{units} units: memory left dirty"
        );
        let alloc = Arc::new(BumpAllocator::new(RemoteAddr::new(RegionId(2), 0), POOL));
        let citron = Citron::new(Arc::new(server), base, alloc, ClientOptions::default());
        let mut c = citron.client().unwrap();
        assert_rest(&mut c);
        let id = c.acquire(0..units.min(512)).unwrap();
        c.release(id).unwrap();
        assert_rest(&mut c);
    }
}
