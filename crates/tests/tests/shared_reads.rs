//! Reads share their range lock, writes do not (docs/SHARED_LOCKS.md "Through the file
//! system"): with CITRON acquired one-sidedly (shm) and at the meta server (tcp, where clients
//! acquire their file locks at the lock trees' host), a read through one client that holds its
//! range (stopped inside its lock at the failpoint `fs_client::io::locked`) does not hold up a
//! read of the same range through another client, while a write of that range waits until
//! every read holding it is done, so that neither read sees any of it. Mounted with
//! `read_locks: Exclusive` (`--read-locks exclusive`), a read waits for the held one.
//!
//! Library clients of one cluster (`Cluster::connect`), in one process; the failpoint is the
//! process's, so the tests here take turns ([`FAILPOINTS`]) and tell the clients' hits apart by
//! their order.

use fs_client::{CitronFs, LockMode, LockScheme};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use testkit::{Backend, Cluster, ClusterSpec};

/// Where a read or write holds its range lock, after the grant and before its data verbs.
const FAILPOINT: &str = "fs_client::io::locked";

/// The bytes read and written: across both data servers' chunks, at an unaligned offset.
const OFFSET: u64 = 3_001;
const LEN: usize = 300_000;

/// How long a held read waits for the others before it goes on regardless: well below the
/// lock's lease ([`cluster`]), so that no other client breaks the held lock meanwhile.
const HOLD: Duration = Duration::from_secs(10);

/// How long a read beside a held one may take: a waiting one takes [`HOLD`].
const PATIENCE: Duration = Duration::from_secs(5);

/// One test at a time: the failpoint is the process's.
static FAILPOINTS: Mutex<()> = Mutex::new(());

/// A cluster on `fabric` whose file locks have a lease far beyond [`HOLD`] (a held lock is
/// never broken here), and `clients` library clients of it locking with CITRON, their reads in
/// mode `reads`, each with the same file open: `LEN` bytes of 0xAA at `OFFSET`.
fn cluster(
    fabric: Backend,
    clients: usize,
    reads: LockMode,
) -> (Cluster, Vec<(CitronFs, fs_client::FileHandle)>) {
    testkit::init_logging();
    let cluster = Cluster::start(ClusterSpec {
        fabric,
        lock_lease: Duration::from_secs(60),
        ..ClusterSpec::default()
    })
    .unwrap();
    let me = CitronFs::process_caller();
    let connect = || {
        let mut options = cluster.options(LockScheme::CITRON);
        options.read_locks = reads;
        CitronFs::connect(options).unwrap()
    };
    let first = connect();
    let (attr, fh) = first
        .create(me, proto::ROOT_INO, "shared", 0o644, libc::O_RDWR)
        .unwrap();
    first.write(fh, OFFSET, &vec![0xAA; LEN]).unwrap();
    let mut all = vec![(first, fh)];
    for _ in 1..clients {
        let c = connect();
        let fh = c.open(me, attr.ino, libc::O_RDWR).unwrap();
        all.push((c, fh));
    }
    (cluster, all)
}

/// Holds the first `holds` I/Os that reach [`FAILPOINT`] there until `release` is set (or
/// [`HOLD`] passed), announcing each on the returned channel; later ones pass.
fn hold_first(holds: usize, release: Arc<AtomicBool>) -> mpsc::Receiver<usize> {
    let (hit, hits) = mpsc::channel();
    let seen = AtomicUsize::new(0);
    let hit = Mutex::new(hit);
    fail::cfg_callback(FAILPOINT, move || {
        let n = seen.fetch_add(1, Ordering::SeqCst);
        if n >= holds {
            return;
        }
        let _ = hit.lock().unwrap().send(n);
        let held = Instant::now();
        while !release.load(Ordering::SeqCst) && held.elapsed() < HOLD {
            std::thread::sleep(Duration::from_millis(2));
        }
    })
    .unwrap();
    hits
}

/// Checks that every client of `clients` acquired its range locks where `fabric` has them
/// acquired: at the meta server on tcp (no atomic verb of its own, releases posted to the
/// host), one-sided elsewhere.
fn check_where_locks_were_acquired(fabric: Backend, clients: &[(CitronFs, fs_client::FileHandle)]) {
    for (i, (client, _)) in clients.iter().enumerate() {
        let stats = client.lock_stats();
        assert!(stats.acquisitions > 0, "client {i} took no lock");
        let hosted = stats.acquire.atomics == 0 && stats.release.posted_calls > 0;
        assert_eq!(
            hosted,
            fabric == Backend::Tcp,
            "client {i} on {fabric:?}: locks acquired at the host: {hosted} ({stats:?})"
        );
    }
}

/// Client A's read holds its range; client B's read of the same range completes meanwhile.
/// With an exclusive lock for reads, B waits until A's hold ends ([`HOLD`]).
#[test]
fn reads_of_one_range_through_two_clients_run_together() {
    reads_run_together(Backend::Shm);
}

/// [`reads_of_one_range_through_two_clients_run_together`] where the clients acquire their
/// locks at the meta server (tcp).
#[test]
fn reads_of_one_range_through_two_clients_run_together_on_tcp() {
    reads_run_together(Backend::Tcp);
}

fn reads_run_together(fabric: Backend) {
    let b_read = read_beside_a_held_read(fabric, LockMode::Shared, PATIENCE);
    let b_read = b_read.expect(
        "B's read of the range did not complete while A's read held it: reads do not share",
    );
    assert_eq!(b_read.unwrap(), vec![0xAA; LEN], "B's read");
}

/// Mounted with exclusive read locks (`MountOptions::read_locks`), B's read waits for A's
/// held one, as a write would.
#[test]
fn with_exclusive_read_locks_a_read_waits_for_a_held_read() {
    exclusive_reads_wait(Backend::Shm);
}

/// [`with_exclusive_read_locks_a_read_waits_for_a_held_read`] where the clients acquire their
/// locks at the meta server (tcp).
#[test]
fn with_exclusive_read_locks_a_read_waits_for_a_held_read_on_tcp() {
    exclusive_reads_wait(Backend::Tcp);
}

fn exclusive_reads_wait(fabric: Backend) {
    let b_read = read_beside_a_held_read(fabric, LockMode::Exclusive, Duration::from_secs(1));
    assert!(
        b_read.is_none(),
        "B's read completed while A's read held the range, with exclusive read locks"
    );
}

/// Client A's read holds its range (at [`FAILPOINT`]) while client B reads the same range:
/// B's result if it came within `patience`. Both reads are checked to see the file's bytes,
/// and both clients to have acquired where `fabric` has them acquire.
fn read_beside_a_held_read(
    fabric: Backend,
    reads: LockMode,
    patience: Duration,
) -> Option<Result<Vec<u8>, fs_client::Error>> {
    let _turn = FAILPOINTS.lock().unwrap_or_else(|e| e.into_inner());
    let (_cluster, clients) = cluster(fabric, 2, reads);
    let [(a, fa), (b, fb)] = &clients[..] else {
        unreachable!()
    };
    let release = Arc::new(AtomicBool::new(false));
    let hits = hold_first(1, release.clone());
    let (b_read, a_read) = std::thread::scope(|s| {
        let a_read = s.spawn(|| a.read(*fa, OFFSET, LEN));
        let held = hits.recv_timeout(HOLD);
        let (done, finished) = mpsc::channel();
        let b_thread = s.spawn(move || {
            let _ = done.send(b.read(*fb, OFFSET, LEN));
        });
        let b_read = held.ok().and_then(|_| finished.recv_timeout(patience).ok());
        release.store(true, Ordering::SeqCst);
        let late = match b_read {
            Some(_) => None,
            None => finished.recv_timeout(HOLD * 2).ok(),
        };
        b_thread.join().unwrap();
        if let Some(late) = late {
            assert_eq!(late.unwrap(), vec![0xAA; LEN], "B's read, after A's");
        }
        (b_read, a_read.join().unwrap())
    });
    fail::remove(FAILPOINT);
    assert_eq!(a_read.unwrap(), vec![0xAA; LEN], "A's read");
    check_where_locks_were_acquired(fabric, &clients);
    b_read
}

/// Clients A and B both hold the range in reads at once; client C's write of it waits until
/// both are done, and neither read sees any of it.
#[test]
fn a_write_waits_for_every_read_holding_its_range() {
    a_write_waits_for_every_read(Backend::Shm);
}

/// [`a_write_waits_for_every_read_holding_its_range`] where the clients acquire their locks at
/// the meta server (tcp).
#[test]
fn a_write_waits_for_every_read_holding_its_range_on_tcp() {
    a_write_waits_for_every_read(Backend::Tcp);
}

fn a_write_waits_for_every_read(fabric: Backend) {
    let _turn = FAILPOINTS.lock().unwrap_or_else(|e| e.into_inner());
    let (_cluster, clients) = cluster(fabric, 3, LockMode::Shared);
    let [(a, fa), (b, fb), (c, fc)] = &clients[..] else {
        unreachable!()
    };
    let release = Arc::new(AtomicBool::new(false));
    let hits = hold_first(2, release.clone());
    let (both_held, written_early, a_read, b_read, written) = std::thread::scope(|s| {
        let a_read = s.spawn(|| a.read(*fa, OFFSET, LEN));
        let a_held = hits.recv_timeout(HOLD).is_ok();
        let b_read = s.spawn(|| b.read(*fb, OFFSET, LEN));
        let both_held = a_held && hits.recv_timeout(PATIENCE).is_ok();
        let (done, finished) = mpsc::channel();
        let write = s.spawn(move || {
            let _ = done.send(c.write(*fc, OFFSET, &vec![0xCC; LEN]));
        });
        // Long enough for an uncontended write many times over.
        let written_early = both_held && finished.recv_timeout(Duration::from_secs(1)).is_ok();
        release.store(true, Ordering::SeqCst);
        let written = finished.recv_timeout(HOLD * 2);
        write.join().unwrap();
        let (a_read, b_read) = (a_read.join().unwrap(), b_read.join().unwrap());
        (both_held, written_early, a_read, b_read, written)
    });
    fail::remove(FAILPOINT);
    assert!(
        both_held,
        "B's read never held the range beside A's: reads do not share"
    );
    assert!(
        !written_early,
        "C's write completed while two reads held its range"
    );
    assert_eq!(written.expect("C's write never completed").unwrap(), LEN);
    assert_eq!(a_read.unwrap(), vec![0xAA; LEN], "A's read saw C's write");
    assert_eq!(b_read.unwrap(), vec![0xAA; LEN], "B's read saw C's write");
    assert_eq!(a.read(*fa, OFFSET, LEN).unwrap(), vec![0xCC; LEN]);
    check_where_locks_were_acquired(fabric, &clients);
}
