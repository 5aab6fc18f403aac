//! Recovery by identity (CITRON §3.10 plus owner records; `citron::acquire`'s module docs): a
//! waiter behind a holder that its fence calls gone breaks in within about a quarter of
//! `T_lease`, not after the lease rule's `(Δ + H + 2)·T_lease`; a holder the fence does not call
//! gone keeps the lease rule; and an owner record left by an earlier turn is never taken for the
//! current holder's. On the `mem` backend, in one process: a "dead" holder is a handle that
//! acquired and is never used again.

use fabric::{MemServer, RegionId, RemoteAddr};
use lockmgr::citron::{BumpAllocator, Citron, CitronConfig, ClientOptions};
use lockmgr::{Fence, LockError, RangeLock};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const T_LEASE: Duration = Duration::from_millis(400);
/// A 256-unit node over leaves (height 1): ticket, `Occ` and its four leaves.
const NODE: std::ops::Range<u64> = 0..256;
/// What the lease rule waits at that node for the first waiter: `(Δ + H + 2)·T_lease`, Δ = 1,
/// H = 1.
const LEASE_RULE: Duration = Duration::from_millis(4 * 400);

/// A fence that answers from a set of gone identities and records every question.
#[derive(Default)]
struct Oracle {
    gone: Mutex<HashSet<u64>>,
    asked: Mutex<Vec<(u64, bool)>>,
}

impl Fence for Oracle {
    fn fence(&self) -> Result<(), LockError> {
        Ok(())
    }

    fn holder_gone(&self, owner: u64, stopped: bool) -> Result<bool, LockError> {
        self.asked.lock().unwrap().push((owner, stopped));
        Ok(self.gone.lock().unwrap().contains(&owner))
    }
}

struct Setup {
    server: MemServer,
    base: RemoteAddr,
    oracle: Arc<Oracle>,
}

impl Setup {
    fn new() -> Self {
        let server = MemServer::new();
        let config = CitronConfig {
            unit_count: 1 << 16,
            t_lease: T_LEASE,
            t_wait: Some(Duration::from_millis(5)),
            ..CitronConfig::default()
        };
        server
            .register(
                RegionId(1),
                Citron::bytes_needed(config.unit_count).unwrap(),
            )
            .unwrap();
        server.register(RegionId(2), 1 << 20).unwrap();
        let base = RemoteAddr::new(RegionId(1), 0);
        Citron::create(&mut server.endpoint(), base, config).unwrap();
        Self {
            server,
            base,
            oracle: Arc::new(Oracle::default()),
        }
    }

    /// A handle with identity `owner` (none: writes no owner record).
    fn client(&self, owner: Option<u64>) -> Box<dyn RangeLock> {
        let options = ClientOptions {
            fence: Some(self.oracle.clone()),
            owner,
            ..ClientOptions::default()
        };
        let alloc = Arc::new(BumpAllocator::new(RemoteAddr::new(RegionId(2), 0), 1 << 20));
        Citron::new(Arc::new(self.server.clone()), self.base, alloc, options)
            .boxed()
            .unwrap()
    }
}

/// How long `lock` takes to be granted `NODE` (released at once).
fn timed_acquire(lock: &mut dyn RangeLock) -> Duration {
    let began = Instant::now();
    let id = lock.acquire(NODE).unwrap();
    let took = began.elapsed();
    lock.release(id).unwrap();
    took
}

#[test]
fn a_gone_holder_is_broken_within_about_a_quarter_lease() {
    let s = Setup::new();
    let mut dead = s.client(Some(7));
    let _held = dead.acquire(NODE).unwrap();
    s.oracle.gone.lock().unwrap().insert(7);
    let mut waiter = s.client(Some(8));
    let took = timed_acquire(&mut *waiter);
    assert!(
        took < T_LEASE,
        "a waiter behind a gone holder took {took:?} (lease rule: {LEASE_RULE:?})"
    );
    let asked = s.oracle.asked.lock().unwrap().clone();
    assert_eq!(asked.first(), Some(&(7, false)), "asked about {asked:?}");
    assert_eq!(waiter.stats().recoveries, 1);
}

/// A request *below* the gone holder's node (a leaf of it) waits in phase (b) on an occupied
/// ancestor, not in its ticket queue: it learns the holder is gone there, escalates, and breaks
/// in at once.
#[test]
fn a_request_below_a_gone_holder_is_granted_within_about_a_quarter_lease() {
    let s = Setup::new();
    let mut dead = s.client(Some(7));
    let _held = dead.acquire(NODE).unwrap();
    s.oracle.gone.lock().unwrap().insert(7);
    let mut waiter = s.client(Some(8));
    let began = Instant::now();
    let id = waiter.acquire(10..20).unwrap();
    let took = began.elapsed();
    waiter.release(id).unwrap();
    assert!(
        took < T_LEASE,
        "a request under a gone holder's node took {took:?} (the ancestor rule alone: {T_LEASE:?}, then the ticket)"
    );
}

/// A request below a holder that is silent (stopped) but not known gone: phase (b) escalates
/// after a lease, and the ticket wait there counts the stand-still phase (b) already saw, so it
/// asks at once whether the holder is stopped — and, fenced, it is broken within about one
/// lease in all, not two.
#[test]
fn a_request_below_a_stopped_holder_is_granted_within_about_a_lease() {
    let s = Setup::new();
    let mut stopped = s.client(Some(7));
    let _held = stopped.acquire(NODE).unwrap();
    // Gone only to a question asked after a whole lease of stand-still (`stopped`).
    struct StoppedOracle;
    impl Fence for StoppedOracle {
        fn fence(&self) -> Result<(), LockError> {
            Ok(())
        }
        fn holder_gone(&self, owner: u64, stopped: bool) -> Result<bool, LockError> {
            Ok(owner == 7 && stopped)
        }
    }
    let options = ClientOptions {
        fence: Some(Arc::new(StoppedOracle)),
        owner: Some(8),
        ..ClientOptions::default()
    };
    let alloc = Arc::new(BumpAllocator::new(RemoteAddr::new(RegionId(2), 0), 1 << 20));
    let mut waiter = Citron::new(Arc::new(s.server.clone()), s.base, alloc, options)
        .boxed()
        .unwrap();
    let began = Instant::now();
    let id = waiter.acquire(10..20).unwrap();
    let took = began.elapsed();
    waiter.release(id).unwrap();
    assert!(
        took < T_LEASE.mul_f64(1.5),
        "a request under a stopped holder's node took {took:?} (T_lease {T_LEASE:?})"
    );
}

#[test]
fn a_holder_not_known_gone_keeps_the_lease_rule() {
    let s = Setup::new();
    let mut live = s.client(Some(7));
    let _held = live.acquire(NODE).unwrap();
    let mut waiter = s.client(Some(8));
    let took = timed_acquire(&mut *waiter);
    assert!(
        took >= LEASE_RULE.mul_f64(0.99),
        "a waiter broke a live holder's turn after {took:?} (lease rule: {LEASE_RULE:?})"
    );
    let asked = s.oracle.asked.lock().unwrap().clone();
    assert!(asked.iter().all(|&(o, _)| o == 7), "asked about {asked:?}");
    assert!(
        asked.contains(&(7, false)) && asked.contains(&(7, true)),
        "first asked whether it ended, then (after a whole lease) whether it is stopped: {asked:?}"
    );
}

#[test]
fn an_earlier_turns_record_is_not_the_holders() {
    let s = Setup::new();
    // Owner 7 takes and leaves its record on the node, then goes.
    let mut earlier = s.client(Some(7));
    let id = earlier.acquire(NODE).unwrap();
    earlier.release(id).unwrap();
    s.oracle.gone.lock().unwrap().insert(7);
    // A holder without an identity takes the next turn and holds on.
    let mut anonymous = s.client(None);
    let _held = anonymous.acquire(NODE).unwrap();
    let mut waiter = s.client(Some(8));
    let took = timed_acquire(&mut *waiter);
    assert!(
        took >= LEASE_RULE.mul_f64(0.99),
        "a record of an earlier turn broke the current holder after {took:?}"
    );
    assert!(
        s.oracle.asked.lock().unwrap().is_empty(),
        "no record names the current turn, so nobody is asked about"
    );
}

#[test]
fn the_owner_record_costs_no_round_trip() {
    let s = Setup::new();
    for owner in [None, Some(9)] {
        let mut c = Citron::new(
            Arc::new(s.server.clone()),
            s.base,
            Arc::new(BumpAllocator::new(RemoteAddr::new(RegionId(2), 0), 1 << 20)),
            ClientOptions {
                owner,
                ..ClientOptions::default()
            },
        )
        .client()
        .unwrap();
        let before = c.endpoint_stats();
        let id = c.acquire(NODE).unwrap();
        let rtts = c.endpoint_stats().since(&before).round_trips;
        c.release(id).unwrap();
        assert_eq!(rtts, 2, "owner {owner:?}: ticket, then occupy");
    }
}
