//! CITRON acquired at the lock tree's host (`lockmgr::citron::hosted`): one round trip per
//! acquire and a posted release, carried verbs in the same calls, a lease deadline no later
//! than the host's, the choice of where to acquire per endpoint, a host that fences for its
//! clients, shared requests held shared at the host, and a dead host connection leaving its
//! locks, exclusive and shared, to lease recovery.

mod common;

use common::servers::Fabric;
use fabric::{Backend, Batch, Completions, Connector, EndpointExt, RegionId, RemoteAddr};
use lockmgr::chaos::DelayMode;
use lockmgr::citron::{hosted, CitronClient, CitronHost, CitronSpec, Hosting, NoAllocator};
use lockmgr::schemes::{self, CreateOptions, Created, FixedMemory, OpenOptions};
use lockmgr::{ChaosConfig, ChaosConnector, Fence, LockError, LockMode, LockScheme, RangeLock};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

const REGION: RegionId = RegionId(1);
/// A region of plain words beside the lock, for carried verbs.
const DATA: RegionId = RegionId(2);
const BASE: RemoteAddr = RemoteAddr::new(REGION, 0);
const LEASE: Duration = Duration::from_secs(3);

fn kind() -> LockScheme {
    LockScheme::Citron(CitronSpec {
        unit_count: 1 << 12,
        lease_ms: LEASE.as_millis() as u64,
        t_wait_us: 2_000,
        ..CitronSpec::plain(true)
    })
}

/// A fabric of `backend` holding one CITRON lock, the host procedure offered where it can be.
fn start(backend: Backend, offer: bool) -> (Fabric, Arc<dyn Connector>, Created) {
    start_with(backend, offer.then(CitronHost::new))
}

/// [`start`] offering `host`, if any.
fn start_with(backend: Backend, host: Option<CitronHost>) -> (Fabric, Arc<dyn Connector>, Created) {
    let kind = kind();
    let bytes = kind
        .resolve(&CreateOptions::default())
        .unwrap()
        .region_bytes()
        .unwrap();
    let fabric = Fabric::start(backend, &[(REGION, bytes), (DATA, 64)]);
    if let Some(host) = host {
        fabric
            .server()
            .register_procedure(hosted::PROCEDURE, Arc::new(host))
            .unwrap();
    }
    let connector = fabric.connector();
    let mut ep = connector.connect().unwrap();
    let created = schemes::create(
        &kind,
        &CreateOptions::default(),
        &mut FixedMemory::new(&mut *ep, BASE, bytes),
    )
    .unwrap();
    (fabric, connector, created)
}

fn open(
    connector: &Arc<dyn Connector>,
    created: &Created,
    hosting: Hosting,
    fence: Option<Arc<dyn Fence>>,
) -> Result<Box<dyn RangeLock>, LockError> {
    let mut options: OpenOptions = created.open_options();
    options.citron.hosting = hosting;
    options.citron.fence = fence;
    schemes::open(&created.lock, connector, &options)
}

/// Whether `lock` acquired at the host: one round trip, no verbs of its own.
fn was_hosted(lock: &mut dyn RangeLock) -> bool {
    let id = lock.acquire(100..300).unwrap();
    lock.release(id).unwrap();
    let stats = lock.stats();
    stats.acquire.verbs == 0
}

fn audit(connector: &Arc<dyn Connector>) -> lockmgr::citron::Audit {
    CitronClient::open(
        connector.connect().unwrap(),
        BASE,
        Arc::new(NoAllocator),
        Default::default(),
    )
    .unwrap()
    .audit()
    .unwrap()
}

struct NoFence;

impl Fence for NoFence {
    fn fence(&self) -> Result<(), LockError> {
        Ok(())
    }
}

/// A fence that records who called it.
#[derive(Default)]
struct Recorded {
    calls: Mutex<Vec<u64>>,
}

/// The fence of one session, recording into a shared [`Recorded`].
struct RecordingFence {
    record: Arc<Recorded>,
    session: u64,
}

impl Fence for RecordingFence {
    fn fence(&self) -> Result<(), LockError> {
        self.record.calls.lock().unwrap().push(self.session);
        Ok(())
    }
}

/// Waits (at most 5 s) until the tree is at rest: a posted release lands after `release`
/// returned.
fn wait_at_rest(connector: &Arc<dyn Connector>, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !audit(connector).at_rest() {
        assert!(Instant::now() < deadline, "{what}: not given back");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// An acquisition is one round trip; a release is posted (no round trip), lands after
/// `release` returns, and before the client's next call.
#[test]
fn a_hosted_lock_is_one_round_trip_and_a_posted_release_with_a_conservative_lease() {
    let (_fabric, connector, created) = start(Backend::Tcp, true);
    // Every call of the hosted client is delayed before it is sent and after its answer came
    // (up to 40 ms): a deadline counted from the answer instead of the send would be late by
    // the delay after.
    let delayed: Arc<dyn Connector> = Arc::new(ChaosConnector::new(
        connector.clone(),
        ChaosConfig {
            before: 1.0,
            after: 1.0,
            max_delay: Duration::from_millis(40),
            mode: DelayMode::Sleep,
            seed: Some(5),
        },
    ));
    let mut lock = open(&delayed, &created, Hosting::Always, None).unwrap();
    let mut reference = open(&connector, &created, Hosting::Never, None).unwrap();
    const SLACK: Duration = Duration::from_millis(5);
    for range in [10..20, 256..512, 0..1024, 60..70, 0..4096] {
        // The deadline a one-sided client gets for the range, uncontended, counted from the
        // call: the host's is the same protocol's, counted from the send, before the host
        // began. Both carry their client's time between the call and the protocol's anchor —
        // a few µs, but a descheduled thread on a loaded 2-core machine has shown 1.35 ms —
        // hence 5 ms of slack, well below the 0–40 ms delay after each answer that a count
        // from the answer would add (with this seed, such a count fails the test).
        let sent = Instant::now();
        let id = reference.acquire(range.clone()).unwrap();
        let one_sided = reference.lease_deadline(id).unwrap() - sent;
        reference.release(id).unwrap();
        let sent = Instant::now();
        let id = lock.acquire(range.clone()).unwrap();
        let deadline = lock
            .lease_deadline(id)
            .expect("a CITRON lock has a deadline");
        assert!(
            deadline > Instant::now() && deadline - sent <= one_sided + SLACK,
            "{range:?}: hosted deadline {:?} after the send, one-sided {one_sided:?}",
            deadline - sent
        );
        // The tree holds it, as one-sided clients see it.
        assert!(!audit(&connector).at_rest(), "{range:?}: nothing held");
        lock.release(id).unwrap();
        assert!(lock.lease_deadline(id).is_none());
        wait_at_rest(&connector, &format!("{range:?}"));
    }
    let stats = lock.stats();
    assert_eq!((stats.acquisitions, stats.releases), (5, 5));
    assert_eq!(stats.rtts_per_acquire(), 1.0);
    assert_eq!(stats.rtts_per_release(), 0.0);
    assert_eq!(stats.release.posted_calls, 5);
    assert!(matches!(
        lock.release(lockmgr::LockId(12345)),
        Err(LockError::NotHeld(_))
    ));
    // A one-sided client on the same tree waits for a hosted holder, and the other way round.
    let mut one_sided = open(&connector, &created, Hosting::Never, None).unwrap();
    let held = lock.acquire(0..64).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let id = one_sided.acquire(10..11).unwrap();
        tx.send(()).unwrap();
        one_sided.release(id).unwrap();
    });
    assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
    lock.release(held).unwrap();
    rx.recv_timeout(Duration::from_secs(5)).unwrap();
    waiter.join().unwrap();
}

#[test]
fn where_a_client_acquires_is_chosen_per_endpoint() {
    // tcp with the procedure: Auto hosts.
    let (_fabric, connector, created) = start(Backend::Tcp, true);
    assert!(was_hosted(
        &mut *open(&connector, &created, Hosting::Auto, None).unwrap()
    ));
    assert!(!was_hosted(
        &mut *open(&connector, &created, Hosting::Never, None).unwrap()
    ));
    // A host that cannot fence for a client with a fence: Auto stays one-sided, Always is
    // refused.
    let fence: Arc<dyn Fence> = Arc::new(NoFence);
    assert!(!was_hosted(
        &mut *open(&connector, &created, Hosting::Auto, Some(fence.clone())).unwrap()
    ));
    assert!(open(&connector, &created, Hosting::Always, Some(fence)).is_err());

    // tcp without the procedure: Auto falls back, Always fails.
    let (_fabric, connector, created) = start(Backend::Tcp, false);
    assert!(!was_hosted(
        &mut *open(&connector, &created, Hosting::Auto, None).unwrap()
    ));
    assert!(open(&connector, &created, Hosting::Always, None).is_err());

    // shm: the client's CPU is next to the memory already.
    let (_fabric, connector, created) = start(Backend::Shm, false);
    assert!(!was_hosted(
        &mut *open(&connector, &created, Hosting::Auto, None).unwrap()
    ));
    assert!(open(&connector, &created, Hosting::Always, None).is_err());
}

/// A client whose host connection goes away holding a lock is a dead client to the others: the
/// lock stays held (its holder may still be in its critical section) until lease recovery
/// (a leaf's bits or a leaf's reader registration: after `T_lease`, CITRON §3.10) — in either
/// mode, for one-sided and hosted waiters.
#[test]
fn a_lost_host_connection_leaves_its_lock_to_lease_recovery() {
    for (mode, waiter) in [
        (LockMode::Exclusive, Hosting::Never),
        (LockMode::Shared, Hosting::Never),
        (LockMode::Shared, Hosting::Always),
    ] {
        let (_fabric, connector, created) = start(Backend::Tcp, true);
        let mut lock = open(&connector, &created, Hosting::Always, None).unwrap();
        let _held = lock.acquire_mode(0..16, mode).unwrap();
        drop(lock);
        let mut other = open(&connector, &created, waiter, None).unwrap();
        let start = Instant::now();
        let id = other.acquire(8..9).unwrap();
        let waited = start.elapsed();
        assert!(
            waited >= LEASE / 2,
            "{mode} hold, {waiter:?} waiter: granted after {waited:?}: the lost connection's \
             lock was given back early"
        );
        assert!(waited < LEASE * 10, "{mode}, {waiter:?}: never recovered");
        other.release(id).unwrap();
    }
}

/// A lock acquiring on a thread of its own ([`acquire_aside`]): the lock and its id come back
/// when the thread is joined.
type Aside = std::thread::JoinHandle<(Box<dyn RangeLock>, lockmgr::LockId)>;

/// Acquires `range` in `mode` on `lock` on a thread of its own; a message on the returned
/// channel says it was granted.
fn acquire_aside(
    mut lock: Box<dyn RangeLock>,
    range: std::ops::Range<u64>,
    mode: LockMode,
) -> (Aside, mpsc::Receiver<()>) {
    let (granted, grants) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let id = lock.acquire_mode(range, mode).unwrap();
        let _ = granted.send(());
        (lock, id)
    });
    (thread, grants)
}

/// Two hosted clients (two host connections) ask for overlapping ranges shared: both are
/// granted at once, the host running the shared protocol for each; a writer of the overlap,
/// hosted or one-sided, waits until both are released. Ranges: on one leaf, over leaf
/// children (§3.8), and split in two nodes (`k = 2`).
#[test]
fn hosted_shared_acquisitions_overlap_and_an_exclusive_one_waits_for_both() {
    /// How long an acquisition that is not blocked may take (a loaded machine).
    const PATIENCE: Duration = Duration::from_secs(5);
    /// How long a blocked writer is watched for not being granted.
    const WATCH: Duration = Duration::from_millis(300);
    let (_fabric, connector, created) = start(Backend::Tcp, true);
    let mut a = open(&connector, &created, Hosting::Always, None).unwrap();
    let mut b = open(&connector, &created, Hosting::Always, None).unwrap();
    // The writers, by whether they acquire at the host.
    let mut writers = [Hosting::Always, Hosting::Never]
        .map(|hosting| Some(open(&connector, &created, hosting, None).unwrap()));
    const HOSTED: usize = 0;
    const ONE_SIDED: usize = 1;
    for (ra, rb, overlap, w) in [
        (10..20, 15..30, 16..18, HOSTED),
        (0..256, 64..512, 100..101, ONE_SIDED),
        (0..1024, 256..2048, 300..900, HOSTED),
        (100..3000, 0..4096, 2000..2001, ONE_SIDED),
    ] {
        let what = format!("{ra:?} and {rb:?}, writer of {overlap:?}");
        let ia = a.acquire_mode(ra.clone(), LockMode::Shared).unwrap();
        let (b_thread, b_granted) = acquire_aside(b, rb.clone(), LockMode::Shared);
        let together = b_granted.recv_timeout(PATIENCE).is_ok();
        if !together {
            // Let B through, so that the test fails instead of hanging.
            a.release(ia).unwrap();
        }
        let (b_back, ib) = b_thread.join().unwrap();
        b = b_back;
        assert!(
            together,
            "{what}: the second hosted shared request waited for the first"
        );
        let writer = writers[w].take().expect("put back after each round");
        let (w_thread, w_granted) = acquire_aside(writer, overlap.clone(), LockMode::Exclusive);
        let beside_both = w_granted.recv_timeout(WATCH).is_ok();
        a.release(ia).unwrap();
        let beside_one = beside_both || w_granted.recv_timeout(WATCH).is_ok();
        b.release(ib).unwrap();
        w_granted
            .recv_timeout(PATIENCE * 2)
            .unwrap_or_else(|_| panic!("{what}: the writer was never granted"));
        let (mut writer, iw) = w_thread.join().unwrap();
        writer.release(iw).unwrap();
        assert!(
            !beside_both,
            "{what}: the writer was granted beside two readers"
        );
        assert!(
            !beside_one,
            "{what}: the writer was granted beside B's read"
        );
        writers[w] = Some(writer);
        wait_at_rest(&connector, &what);
    }
    let hosted_writer = writers[HOSTED].take().expect("put back");
    for (name, lock) in [("A", &a), ("B", &b), ("the hosted writer", &hosted_writer)] {
        let stats = lock.stats();
        assert_eq!(stats.acquire.verbs, 0, "{name} acquired one-sided");
        assert_eq!(
            stats.rtts_per_acquire(),
            1.0,
            "{name}: one call per acquire"
        );
    }
}

/// The caller's carried verbs: read under the lock in the acquire call's one round trip,
/// written before the release in a batch of their own, the release posted.
#[test]
fn carried_verbs_travel_in_the_host_calls() {
    let (_fabric, connector, created) = start(Backend::Tcp, true);
    let mut other = connector.connect().unwrap();
    other.write_u64(RemoteAddr::new(DATA, 8), 41).unwrap();
    let mut lock = open(&connector, &created, Hosting::Always, None).unwrap();
    let mut fallback = connector.connect().unwrap();
    let mut extra = Batch::new();
    let read = extra.read(RemoteAddr::new(DATA, 8), 8);
    let mut out = Completions::new();
    let id = lock
        .acquire_with(0..64, &extra, &mut out, &mut *fallback)
        .unwrap();
    assert_eq!(out.word(read, 0), 41);
    let mut extra = Batch::new();
    extra.write_u64(RemoteAddr::new(DATA, 8), 42);
    lock.release_with(id, &extra, &mut Completions::new(), &mut *fallback)
        .unwrap();
    // Written in a batch before the release, done when `release_with` returned; the release
    // itself is posted and lands after.
    assert_eq!(other.read_u64(RemoteAddr::new(DATA, 8)).unwrap(), 42);
    wait_at_rest(&connector, "the carrying release");
    let stats = lock.stats();
    assert_eq!(
        (stats.acquire.round_trips, stats.release.round_trips),
        (1, 1),
        "one call to acquire, the carried reads in it; one batch to release, the release posted"
    );
    assert_eq!(fallback.stats().round_trips, 0, "nothing went another way");
}

/// Verbs whose results nobody reads ride in the posted release at the host
/// (`RangeLock::release_forgetting`): no round trip at all, executed before the release. And an
/// acquisition's carried verbs run at the host once, after its grant
/// (`RangeLock::extra_runs_once_granted`): a CAS may claim something there.
#[test]
fn a_hosted_release_posts_verbs_it_forgets_and_a_grant_runs_carried_changes_once() {
    let (_fabric, connector, created) = start(Backend::Tcp, true);
    let word = RemoteAddr::new(DATA, 16);
    let mut other = connector.connect().unwrap();
    let mut lock = open(&connector, &created, Hosting::Always, None).unwrap();
    assert!(lock.extra_runs_once_granted());
    let mut fallback = connector.connect().unwrap();
    let mut extra = Batch::new();
    let claim = extra.cas(word, 0, 7);
    let mut out = Completions::new();
    let id = lock
        .acquire_with(0..64, &extra, &mut out, &mut *fallback)
        .unwrap();
    assert_eq!(out.old(claim), 0, "the claim ran once, with the grant");
    assert_eq!(other.read_u64(word).unwrap(), 7);
    let mut undo = Batch::new();
    undo.cas(word, 7, 0);
    lock.release_forgetting(id, &undo, &mut *fallback).unwrap();
    // The release and its verbs are posted together; the verbs ran first, and the lock is
    // free once the release landed.
    wait_at_rest(&connector, "the posted release with verbs");
    assert_eq!(other.read_u64(word).unwrap(), 0, "the carried CAS ran");
    let stats = lock.stats();
    assert_eq!(
        (stats.acquire.round_trips, stats.release.round_trips),
        (1, 0),
        "one call to acquire and claim; the release and its verbs posted"
    );
    assert_eq!(fallback.stats().round_trips, 0, "nothing went another way");
    // One-sided, carried verbs ride in every batch of an acquisition, granting or not: a
    // caller must not put a change there.
    let one_sided = open(&connector, &created, Hosting::Never, None).unwrap();
    assert!(!one_sided.extra_runs_once_granted());
}

/// A host that can fence hosts clients that have a fence, and fences as the waiting client
/// (its connection's session), never calling the client's own fence, before it breaks the hold
/// of a holder whose connection went away: an exclusive hold (the leaf's bits) or a shared one
/// (its reader registration).
#[test]
fn a_fencing_host_hosts_fenced_clients_and_fences_as_them() {
    for mode in [LockMode::Exclusive, LockMode::Shared] {
        let at_host = Arc::new(Recorded::default());
        let record = at_host.clone();
        let host = CitronHost::new().fencing(Arc::new(move |session| {
            Arc::new(RecordingFence {
                record: record.clone(),
                session,
            }) as Arc<dyn Fence>
        }));
        let (fabric, _connector, created) = start_with(Backend::Tcp, Some(host));
        let own = Arc::new(Recorded::default());
        // A client of session `session` with its own (recording) fence, Auto hosting.
        let client = |session| {
            let fence: Arc<dyn Fence> = Arc::new(RecordingFence {
                record: own.clone(),
                session,
            });
            open(
                &fabric.connector_for(session),
                &created,
                Hosting::Auto,
                Some(fence),
            )
            .unwrap()
        };
        let mut holder = client(11);
        assert!(was_hosted(&mut *holder), "a client with a fence is hosted");
        let _held = holder.acquire_mode(0..16, mode).unwrap();
        drop(holder);
        let mut waiter = client(22);
        let start = Instant::now();
        let id = waiter.acquire(8..9).unwrap();
        assert!(
            start.elapsed() >= LEASE / 2,
            "{mode} hold: granted before the lease ran out"
        );
        waiter.release(id).unwrap();
        let fenced = at_host.calls.lock().unwrap().clone();
        assert!(
            !fenced.is_empty() && fenced.iter().all(|&s| s == 22),
            "{mode} hold: the host fences as the waiter before breaking in: {fenced:?}"
        );
        assert!(
            own.calls.lock().unwrap().is_empty(),
            "{mode} hold: the client's own fence is not called when the host fences"
        );
    }
}
