//! A holder that is *paused* past its lease, not killed (a mount stopped with SIGSTOP
//! for 3 s while another mount wrote the same file, then continued).
//!
//! Lease recovery (CITRON §3.10) presumes a holder that is silent for long enough dead and
//! breaks its hold. A paused client is not dead: it resumes where it was, with the words it had
//! read and the verbs it meant to post. These tests pause one client (the *victim*) in-process
//! with a [`StallSwitch`] — its thread sleeps before its next batch — at chosen points:
//!
//! - `ticket`: while it waits for its turn in a ticket queue (CITRON phase (a), Alg. 2 l. 11; the
//!   baselines' ticket lock);
//! - `descendants`: while it waits for its descendants' notifications (CITRON phase (d),
//!   l. 35-36), its own notifications and `Occ` outstanding;
//! - `holding`: inside its critical section;
//! - `before_release`: after its critical section, before it releases.
//!
//! Meanwhile other clients contend for conflicting ranges, and one of them typically breaks the
//! victim's hold. Asserted, on `mem`, `shm` and `tcp`:
//!
//! (a) every acquisition of every client returns within [`LIVENESS`] ([`LIVENESS_TCP`] on
//!     tcp; a watchdog reports the clients' progress and fails the test instead of hanging);
//! (b) a lease-aware shadow map never sees two holders of one unit at once, where a holder whose
//!     lease deadline ([`RangeLock::lease_deadline`]) has passed is no longer a holder (its
//!     units may be taken over, and it does not claim units with a deadline already past, as the
//!     file system refuses to post data verbs then);
//! (c) after the victim resumes, everyone keeps acquiring (the loops go on after it), so the
//!     lock's state stays usable.

mod common;

use common::servers::Fabric;
use fabric::Backend;
use fabric::{Connector, RegionId, RemoteAddr};
use lockmgr::baselines::{MutexScheme, SegConfig, SegScheme, TicketConfig};
use lockmgr::citron::{
    t_wait_under_load, Citron, CitronClient, CitronConfig, ClientOptions, NoAllocator, Phase,
};
use lockmgr::{LockStats, RangeLock, StallEndpoint, StallSwitch};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// The lease of every scenario: short, to keep the tests fast.
const T_LEASE: Duration = Duration::from_millis(100);
/// How long the victim is paused: past every recovery rule's patience here (the longest is a
/// ticket break-in at a height-2 node with up to three tickets ahead, `(3 + 2 + 2)·T_lease`).
const PAUSE: Duration = Duration::from_millis(800);
/// Every acquisition must return within this (20·T_lease; the victim's includes its pause).
const LIVENESS: Duration = Duration::from_millis(2000);
/// The same on tcp, where every verb is a round trip through the fabric server's threads,
/// which compete for the test machine's 2 cores with the clients' threads and every other test
/// binary's: waits of 4.2 s and 5.4 s were seen in fresh-clone CI runs (two sessions, one run
/// each in about ten; every rerun clean), with nothing hung. A hang is unbounded, so this still
/// catches one.
const LIVENESS_TCP: Duration = Duration::from_millis(8000);

/// The liveness bound on `backend` (see [`LIVENESS`], [`LIVENESS_TCP`]).
fn liveness(backend: Backend) -> Duration {
    match backend {
        Backend::Tcp => LIVENESS_TCP,
        _ => LIVENESS,
    }
}
/// Units of the address space (a CITRON tree of height 4).
const UNITS: u64 = 4096;
const REGION: RegionId = RegionId(1);
const BASE: RemoteAddr = RemoteAddr::new(REGION, 0);

/// The scenarios share two cores: run them one at a time so their timing stays meaningful.
static SERIAL: Mutex<()> = Mutex::new(());

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scheme {
    Citron,
    Mutex,
    Seg,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Point {
    Ticket,
    Descendants,
    Holding,
    BeforeRelease,
}

fn ticket_config() -> TicketConfig {
    TicketConfig {
        lease: Some(T_LEASE),
        ..TicketConfig::default()
    }
}

fn seg_config() -> SegConfig {
    SegConfig {
        segment_units: 64,
        segments: 64,
        ticket: ticket_config(),
    }
}

/// Creates the lock of `scheme` on `connector`.
///
/// CITRON's `T_wait` is measured as the file system measures it: the 90th-percentile round trip
/// under load (`t_wait_under_load`). The idle median `Citron::create` measures by default
/// undercounts what these scenarios' contending threads see on tcp: with `T_wait` near 150 µs
/// the victim's height-2 node (two round trips of 85 µs between `t1` and `t2`) failed
/// inequality (1) on nearly every attempt and took up to 8 s to be granted.
fn create(scheme: Scheme, connector: &dyn Connector) {
    let mut ep = connector.connect().unwrap();
    match scheme {
        Scheme::Citron => {
            let config = CitronConfig {
                unit_count: UNITS,
                t_lease: T_LEASE,
                ..CitronConfig::default()
            };
            let (t_wait, _) = t_wait_under_load(connector, BASE, &config).unwrap();
            Citron::create(
                &mut *ep,
                BASE,
                CitronConfig {
                    t_wait: Some(t_wait),
                    ..config
                },
            )
            .unwrap();
        }
        Scheme::Mutex => {
            MutexScheme::create(&mut *ep, BASE, ticket_config()).unwrap();
        }
        Scheme::Seg => {
            SegScheme::create(&mut *ep, BASE, seg_config()).unwrap();
        }
    }
}

fn region_bytes(scheme: Scheme) -> u64 {
    match scheme {
        Scheme::Citron => Citron::bytes_needed(UNITS).unwrap(),
        Scheme::Mutex => MutexScheme::REGION_BYTES,
        Scheme::Seg => SegScheme::region_bytes(&seg_config()),
    }
}

/// A client handle whose endpoint stalls when `switch` says so; for CITRON, also its phase.
fn open(
    scheme: Scheme,
    connector: &dyn Connector,
    switch: Arc<StallSwitch>,
) -> (Box<dyn RangeLock>, Option<Arc<lockmgr::citron::Progress>>) {
    let ep = Box::new(StallEndpoint::new(connector.connect().unwrap(), switch));
    match scheme {
        Scheme::Citron => {
            let client = CitronClient::open(
                ep,
                BASE,
                Arc::new(NoAllocator),
                ClientOptions {
                    auto_scale_up: false,
                    ..ClientOptions::default()
                },
            )
            .unwrap();
            let progress = client.progress();
            (Box::new(client), Some(progress))
        }
        Scheme::Mutex => (
            Box::new(MutexScheme::attach(BASE, ticket_config()).open_with(ep)),
            None,
        ),
        Scheme::Seg => (
            Box::new(SegScheme::attach(BASE, seg_config()).unwrap().open_with(ep)),
            None,
        ),
    }
}

// ---- the lease-aware shadow ----

/// Per-unit owner slots, and per holder its current range and lease deadline (ns since `epoch`,
/// `u64::MAX`: never expires).
struct LeaseShadow {
    epoch: Instant,
    slots: Vec<AtomicU64>,
    deadlines: Vec<AtomicU64>,
    ranges: Vec<(AtomicU64, AtomicU64)>,
}

impl LeaseShadow {
    fn new(units: u64, holders: usize) -> Self {
        Self {
            epoch: Instant::now(),
            slots: (0..units).map(|_| AtomicU64::new(0)).collect(),
            deadlines: (0..=holders).map(|_| AtomicU64::new(0)).collect(),
            ranges: (0..=holders)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
        }
    }

    fn ns(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    fn expired(&self, holder: u64) -> bool {
        self.deadlines[holder as usize].load(Ordering::SeqCst) <= self.ns(Instant::now())
    }

    /// Claims `range` for `holder`, whose lock's lease ends at `deadline`. `Ok(false)`: the
    /// deadline has already passed, nothing claimed (the file system would not write).
    fn claim(
        &self,
        holder: u64,
        range: &Range<u64>,
        deadline: Option<Instant>,
    ) -> Result<bool, String> {
        let dl = deadline.map_or(u64::MAX, |d| self.ns(d));
        if dl <= self.ns(Instant::now()) {
            return Ok(false);
        }
        self.deadlines[holder as usize].store(dl, Ordering::SeqCst);
        let (s, e) = &self.ranges[holder as usize];
        s.store(range.start, Ordering::SeqCst);
        e.store(range.end, Ordering::SeqCst);
        for unit in range.clone() {
            let slot = &self.slots[unit as usize];
            let mut expect = 0;
            loop {
                match slot.compare_exchange(expect, holder, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(_) => break,
                    // A holder past its lease is no longer a holder: take its unit over.
                    Err(other) if self.expired(other) => expect = other,
                    Err(other) => {
                        let (s, e) = &self.ranges[other as usize];
                        return Err(format!(
                            "OVERLAP: holder {holder} was granted {range:?} but unit {unit} is held by holder {other} ([{}, {}), lease deadline in {:?})",
                            s.load(Ordering::SeqCst),
                            e.load(Ordering::SeqCst),
                            Duration::from_nanos(
                                self.deadlines[other as usize]
                                    .load(Ordering::SeqCst)
                                    .saturating_sub(self.ns(Instant::now()))
                            )
                        ));
                    }
                }
            }
        }
        Ok(true)
    }

    /// Frees `range` from `holder`: a unit that is no longer its own is an overlap, unless its
    /// lease has expired (then it was taken over).
    fn unclaim(&self, holder: u64, range: &Range<u64>) -> Result<(), String> {
        for unit in range.clone() {
            if let Err(other) = self.slots[unit as usize].compare_exchange(
                holder,
                0,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                if !self.expired(holder) {
                    return Err(format!(
                        "OVERLAP: holder {holder} held {range:?} within its lease, but at release unit {unit} belonged to holder {other}"
                    ));
                }
            }
        }
        Ok(())
    }
}

// ---- the scenario ----

/// Liveness slot of one client: when its current acquisition began (ns since the run's start,
/// 0: not acquiring) and what it asked for.
#[derive(Default)]
struct Watch {
    since: AtomicU64,
    start: AtomicU64,
    end: AtomicU64,
}

struct Ctx {
    shadow: LeaseShadow,
    watches: Vec<Watch>,
    epoch: Instant,
    /// [`liveness`] of the scenario's backend.
    liveness: Duration,
}

impl Ctx {
    /// Acquires `range` as `holder`, watched, then claims it in the shadow.
    fn acquire(
        &self,
        lock: &mut dyn RangeLock,
        holder: u64,
        range: &Range<u64>,
    ) -> Result<(lockmgr::LockId, bool), String> {
        let w = &self.watches[holder as usize];
        w.start.store(range.start, Ordering::SeqCst);
        w.end.store(range.end, Ordering::SeqCst);
        w.since
            .store(self.epoch.elapsed().as_nanos() as u64 + 1, Ordering::SeqCst);
        let started = Instant::now();
        let id = lock
            .acquire(range.clone())
            .map_err(|e| format!("holder {holder}: acquire {range:?}: {e}"))?;
        w.since.store(0, Ordering::SeqCst);
        let took = started.elapsed();
        if took > self.liveness {
            return Err(format!(
                "LIVENESS: holder {holder} waited {took:?} (> {:?}) for {range:?}",
                self.liveness
            ));
        }
        let claimed = self
            .shadow
            .claim(holder, range, lock.lease_deadline(id))
            .map_err(|e| format!("{e} (stats of holder {holder}: {:?})", lock.stats()))?;
        Ok((id, claimed))
    }

    fn release(
        &self,
        lock: &mut dyn RangeLock,
        holder: u64,
        range: &Range<u64>,
        id: lockmgr::LockId,
        claimed: bool,
    ) -> Result<(), String> {
        if claimed {
            self.shadow.unclaim(holder, range)?;
        }
        lock.release(id)
            .map_err(|e| format!("holder {holder}: release {range:?}: {e}"))
    }
}

/// What a scenario does: the victim's range, the range held when it starts (so that it waits),
/// and the ranges the other clients keep taking.
struct Plan {
    victim: Range<u64>,
    blocker: Range<u64>,
    others: [Range<u64>; 2],
}

fn plan(scheme: Scheme, point: Point) -> Plan {
    match (scheme, point) {
        // Phase (d): the victim takes a height-2 node while a leaf under it is held.
        (Scheme::Citron, Point::Descendants) => Plan {
            victim: 0..1024,
            blocker: 300..301,
            others: [0..1024, 256..512],
        },
        // A height-1 node; the others take it, a leaf under it, and its parent.
        (Scheme::Citron, _) => Plan {
            victim: 256..512,
            blocker: 256..512,
            others: [256..512, 0..1024],
        },
        _ => Plan {
            victim: 0..10,
            blocker: 0..10,
            others: [5..6, 0..100],
        },
    }
}

/// Collects `clients` results from `rx`, merging their statistics, and fails the test with
/// every client's progress when one has waited longer than `LIVENESS` for its lock.
fn watchdog(
    what: &str,
    ctx: &Ctx,
    progress: &[(u64, Option<lockmgr::ProgressFn>)],
    rx: &mpsc::Receiver<(u64, Result<LockStats, String>)>,
    clients: usize,
) -> LockStats {
    let mut stats = LockStats::default();
    let mut finished = 0;
    while finished < clients {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok((holder, result)) => {
                stats.merge(&result.unwrap_or_else(|e| panic!("{what}: holder {holder}: {e}")));
                finished += 1;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let now = ctx.epoch.elapsed().as_nanos() as u64;
                for (holder, w) in ctx.watches.iter().enumerate() {
                    let since = w.since.load(Ordering::SeqCst);
                    if since != 0 && Duration::from_nanos(now.saturating_sub(since)) > ctx.liveness
                    {
                        let states: Vec<String> = progress
                            .iter()
                            .map(|(h, p)| {
                                format!(
                                    "holder {h}: {}",
                                    p.as_ref().map(|f| f()).unwrap_or_default()
                                )
                            })
                            .collect();
                        panic!(
                            "{what}: LIVENESS: holder {holder} has waited more than {:?} for [{}, {}); {}",
                            ctx.liveness,
                            w.start.load(Ordering::SeqCst),
                            w.end.load(Ordering::SeqCst),
                            states.join("; ")
                        );
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                panic!("{what}: a client thread died without reporting")
            }
        }
    }
    stats
}

fn run(backend: Backend, scheme: Scheme, point: Point) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fabric = Fabric::start(backend, &[(REGION, region_bytes(scheme))]);
    let connector: Arc<dyn Connector> = fabric.connector();
    create(scheme, connector.as_ref());
    let what = format!("{scheme:?} on {backend:?}, victim paused at {point:?}");
    let plan = plan(scheme, point);
    // Holders: 1 victim, 2 blocker, 3 and 4 the others.
    let ctx = Arc::new(Ctx {
        shadow: LeaseShadow::new(UNITS, 4),
        watches: (0..=4).map(|_| Watch::default()).collect(),
        epoch: Instant::now(),
        liveness: liveness(backend),
    });
    let victim_done = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel::<(u64, Result<LockStats, String>)>();
    let mut progress = Vec::new();

    // The blocker holds its range until the victim waits (or is stalled), then lets go.
    let switch = StallSwitch::new();
    let (mut blocker, _) = open(scheme, connector.as_ref(), StallSwitch::new());
    let (bid, bclaimed) = ctx.acquire(blocker.as_mut(), 2, &plan.blocker).unwrap();

    // The victim.
    let (mut victim, victim_progress) = open(scheme, connector.as_ref(), switch.clone());
    progress.push((1, victim.progress()));
    match (point, victim_progress) {
        (Point::Ticket, Some(p)) => {
            switch.arm(PAUSE, 0, move || p.snapshot().phase == Phase::Ticket)
        }
        (Point::Descendants, Some(p)) => {
            switch.arm(PAUSE, 0, move || p.snapshot().phase == Phase::Descendants)
        }
        // The baselines: the batch after the ticket's, i.e. the first poll for the turn.
        (Point::Ticket, None) => switch.arm(PAUSE, 1, || true),
        _ => {}
    }
    {
        let (ctx, tx, done, range) = (
            ctx.clone(),
            tx.clone(),
            victim_done.clone(),
            plan.victim.clone(),
        );
        std::thread::spawn(move || {
            let result = (|| {
                let (id, claimed) = ctx.acquire(victim.as_mut(), 1, &range)?;
                if point == Point::Holding {
                    std::thread::sleep(PAUSE);
                }
                if claimed {
                    ctx.shadow.unclaim(1, &range)?;
                }
                if point == Point::BeforeRelease {
                    std::thread::sleep(PAUSE);
                }
                victim
                    .release(id)
                    .map_err(|e| format!("victim: release: {e}"))?;
                done.store(true, Ordering::SeqCst);
                // (c): the victim keeps working normally afterwards.
                for _ in 0..5 {
                    let (id, claimed) = ctx.acquire(victim.as_mut(), 1, &range)?;
                    ctx.release(victim.as_mut(), 1, &range, id, claimed)?;
                }
                Ok(victim.stats())
            })();
            done.store(true, Ordering::SeqCst);
            let _ = tx.send((1, result));
        });
    }

    // Let the victim queue up behind the blocker (and, where armed, stall), then let go.
    let waited = Instant::now();
    while switch.is_armed() && waited.elapsed() < ctx.liveness {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        !switch.is_armed(),
        "{what}: the victim never reached its pause point"
    );
    std::thread::sleep(Duration::from_millis(5));
    ctx.release(blocker.as_mut(), 2, &plan.blocker, bid, bclaimed)
        .unwrap();

    // The others: keep taking conflicting ranges while the victim is paused, and after.
    for (i, range) in plan.others.iter().enumerate() {
        let holder = 3 + i as u64;
        let (mut lock, _) = open(scheme, connector.as_ref(), StallSwitch::new());
        progress.push((holder, lock.progress()));
        let (ctx, tx, done, range) = (ctx.clone(), tx.clone(), victim_done.clone(), range.clone());
        std::thread::spawn(move || {
            let result = (|| {
                let mut after = 0;
                while after < 5 {
                    if done.load(Ordering::SeqCst) {
                        after += 1;
                    }
                    let (id, claimed) = ctx.acquire(lock.as_mut(), holder, &range)?;
                    std::thread::sleep(Duration::from_millis(2));
                    ctx.release(lock.as_mut(), holder, &range, id, claimed)?;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Ok(lock.stats())
            })();
            let _ = tx.send((holder, result));
        });
    }
    drop(tx);
    progress.push((2, blocker.progress()));

    let stats = watchdog(&what, &ctx, &progress, &rx, 3);
    eprintln!(
        "{what}: stalls {}, recoveries {}, late releases {}, passed over {}",
        switch.fired(),
        stats.recoveries,
        stats.late_releases,
        stats.passed_over
    );
}

macro_rules! pause_tests {
    ($($name:ident => ($scheme:expr, $point:expr);)*) => {$(
        mod $name {
            use super::*;

            #[test]
            fn on_mem() {
                run(Backend::Mem, $scheme, $point);
            }

            #[test]
            fn on_shm() {
                run(Backend::Shm, $scheme, $point);
            }

            #[test]
            fn on_tcp() {
                run(Backend::Tcp, $scheme, $point);
            }
        }
    )*};
}

pause_tests! {
    citron_ticket => (Scheme::Citron, Point::Ticket);
    citron_descendants => (Scheme::Citron, Point::Descendants);
    citron_holding => (Scheme::Citron, Point::Holding);
    citron_before_release => (Scheme::Citron, Point::BeforeRelease);
    mutex_ticket => (Scheme::Mutex, Point::Ticket);
    mutex_holding => (Scheme::Mutex, Point::Holding);
    seg_ticket => (Scheme::Seg, Point::Ticket);
    seg_holding => (Scheme::Seg, Point::Holding);
}

// ---- the fence and the deadline API ----

/// A fence that refuses its first `refuse` calls.
struct TestFence {
    calls: AtomicU64,
    refuse: u64,
}

impl lockmgr::Fence for TestFence {
    fn fence(&self) -> Result<(), lockmgr::LockError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.refuse {
            Err(lockmgr::LockError::Config("fence refused (test)".into()))
        } else {
            Ok(())
        }
    }
}

/// CITRON calls the fence before it breaks a dead holder's ticket, and a refused fence keeps the
/// hold unbroken for another patience.
#[test]
fn citron_fence_runs_before_the_break_in() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fabric = Fabric::start(Backend::Mem, &[(REGION, region_bytes(Scheme::Citron))]);
    let connector: Arc<dyn Connector> = fabric.connector();
    create(Scheme::Citron, connector.as_ref());
    let fence = Arc::new(TestFence {
        calls: AtomicU64::new(0),
        refuse: 1,
    });
    let options = ClientOptions {
        auto_scale_up: false,
        fence: Some(fence.clone()),
        ..ClientOptions::default()
    };
    let citron = Citron::new(connector.clone(), BASE, Arc::new(NoAllocator), options);
    // A holder of the height-1 node 256..512 dies.
    let mut dead = citron.client().unwrap();
    let id = dead.acquire(256..512).unwrap();
    dead.forget(id).unwrap();
    let mut waiter = citron.client().unwrap();
    let started = Instant::now();
    let id = waiter.acquire(256..512).unwrap();
    let took = started.elapsed();
    // Break-in patience at height 1, one ticket ahead: (1 + 1 + 2)·T_lease; twice, as the
    // first fence was refused.
    assert!(took >= T_LEASE * 8, "granted after {took:?}");
    assert_eq!(fence.calls.load(Ordering::SeqCst), 2);
    assert_eq!(waiter.stats().recoveries, 1);
    let deadline = waiter
        .lease_deadline(id)
        .expect("a CITRON lock has a deadline");
    assert!(deadline > Instant::now());
    waiter.release(id).unwrap();
    assert_eq!(waiter.lease_deadline(id), None);
}

/// `lease_deadline`: CITRON's is ahead after a grant and at most the shortest recovery patience
/// away (a leaf: `T_lease`); a ticket lock without a lease has none.
#[test]
fn lease_deadlines() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fabric = Fabric::start(Backend::Mem, &[(REGION, region_bytes(Scheme::Citron))]);
    let connector: Arc<dyn Connector> = fabric.connector();
    create(Scheme::Citron, connector.as_ref());
    let (mut lock, _) = open(Scheme::Citron, connector.as_ref(), StallSwitch::new());
    for (range, leases) in [(100..101, 1), (256..512, 2), (0..UNITS, 6)] {
        let before = Instant::now();
        let id = lock.acquire(range.clone()).unwrap();
        let d = lock.lease_deadline(id).unwrap();
        assert!(d > Instant::now(), "{range:?}");
        // The earliest part: the notification at the node's parent (height + 1), or for a
        // leaf its bits; the root (height 3) notifies nobody: its ticket, height + 3.
        assert!(
            d <= before + T_LEASE * leases + Duration::from_millis(5),
            "{range:?}: {:?}",
            d - before
        );
        lock.release(id).unwrap();
    }
    let mut ep = connector.connect().unwrap();
    let mutex = MutexScheme::create(&mut *ep, BASE, TicketConfig::default()).unwrap();
    let mut m = mutex.open(connector.as_ref()).unwrap();
    let id = m.acquire(0..1).unwrap();
    assert_eq!(m.lease_deadline(id), None);
    m.release(id).unwrap();
}

// ---- a storm: random pauses at random points amid mixed contention ----

/// Four clients take random mixed-size ranges; one of them (holder 1) is paused again and again
/// for 1 to 8 leases, before a random one of its next batches (inside an acquisition, between
/// its verbs, at its release) or inside its critical section. Same assertions as above.
fn storm(backend: Backend, scheme: Scheme, seed: u64) {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fabric = Fabric::start(backend, &[(REGION, region_bytes(scheme))]);
    let connector: Arc<dyn Connector> = fabric.connector();
    create(scheme, connector.as_ref());
    let what = format!("storm: {scheme:?} on {backend:?}, seed {seed}");
    let ctx = Arc::new(Ctx {
        shadow: LeaseShadow::new(UNITS, 4),
        watches: (0..=4).map(|_| Watch::default()).collect(),
        epoch: Instant::now(),
        liveness: liveness(backend),
    });
    let (tx, rx) = mpsc::channel::<(u64, Result<LockStats, String>)>();
    let mut progress = Vec::new();
    let mut switches = Vec::new();
    for holder in 1..=4u64 {
        let switch = StallSwitch::new();
        switches.push(switch.clone());
        let (mut lock, _) = open(scheme, connector.as_ref(), switch.clone());
        progress.push((holder, lock.progress()));
        let (ctx, tx) = (ctx.clone(), tx.clone());
        std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(seed ^ holder.wrapping_mul(0x9E37_79B9));
            let result = (|| {
                for _ in 0..40 {
                    let size = 1u64 << rng.random_range(0..=10);
                    let start = rng.random_range(0..=UNITS - size);
                    let range = start..start + size;
                    let mut pause_inside = false;
                    if holder == 1 && rng.random_bool(0.4) {
                        let length = T_LEASE * rng.random_range(1..=8);
                        if rng.random_bool(0.7) {
                            switch.arm(length, rng.random_range(0..6), || true);
                        } else {
                            pause_inside = true;
                        }
                    }
                    let (id, claimed) = ctx.acquire(lock.as_mut(), holder, &range)?;
                    if pause_inside {
                        std::thread::sleep(T_LEASE * rng.random_range(1..=8));
                    } else {
                        std::thread::sleep(Duration::from_micros(rng.random_range(0..2000)));
                    }
                    ctx.release(lock.as_mut(), holder, &range, id, claimed)?;
                    switch.disarm();
                }
                Ok(lock.stats())
            })();
            let _ = tx.send((holder, result));
        });
    }
    drop(tx);
    let stats = watchdog(&what, &ctx, &progress, &rx, 4);
    eprintln!(
        "{what}: {} acquisitions, stalls {}, recoveries {}, late releases {}, passed over {}",
        stats.acquisitions,
        switches[0].fired(),
        stats.recoveries,
        stats.late_releases,
        stats.passed_over
    );
}

mod storm {
    use super::*;

    #[test]
    fn citron_on_mem() {
        storm(Backend::Mem, Scheme::Citron, 1);
    }

    #[test]
    fn citron_on_shm() {
        storm(Backend::Shm, Scheme::Citron, 2);
    }

    #[test]
    fn citron_on_tcp() {
        storm(Backend::Tcp, Scheme::Citron, 3);
    }

    #[test]
    fn seg_on_mem() {
        storm(Backend::Mem, Scheme::Seg, 4);
    }

    #[test]
    fn mutex_on_tcp() {
        storm(Backend::Tcp, Scheme::Mutex, 5);
    }
}
