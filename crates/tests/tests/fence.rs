//! Clients that fell behind the cluster join it again without breaking its locks, in a test
//! binary of its own: these tests arm failpoints that every in-process client would meet (the
//! heartbeat's, the data path's), so no other test may share the process, and they run one at
//! a time.
//!
//! - A client fenced while it held a lock (tcp; with the `rdma` feature, rdma too, its provider
//!   from `CITRONFS_RDMA_PROVIDER`, `soft` in CI): its write in flight fails, its later calls
//!   work. On rdma the fence reaches the data server through its revocation poll and moves the
//!   session's queue pairs to the error state; the client's next verbs fail and its reconnect
//!   in the old session is refused, so it joins again in a new one.
//! - A client that has not heard of a meta server crash and restart takes no range lock in the
//!   old server's region (shm, tcp): its I/O catches up first, and then excludes the I/O of
//!   the clients that did. On shm a client's mapping of the meta region outlives the server
//!   that made it: a restarted server makes a new region file, and the old mapping names
//!   memory nobody else locks in. A clean stop ends every session first, which clears the
//!   control blocks of their open files, and a client behind it finds its file's block
//!   foreign. A crash clears nothing: a client whose heartbeat had not yet found it took its
//!   range lock in the old region — granted at once, its file's control block there still its
//!   own — and wrote under a lock no client of the new server could see. On tcp the crash
//!   ended the meta stream mid-read, which the client took for a protocol error: its write
//!   failed.

use fs_client::{CitronFs, LockScheme};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::ClusterExt;
use testkit::{Backend, Cluster, ClusterSpec};

// The tests of this binary run one at a time: they arm the same failpoints.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Two CITRON clients of `cluster`, A having created file "f" and written 4 KiB of ones to
/// it: A, B, the file's inode and A's handle of it.
fn two_clients(cluster: &Cluster) -> (CitronFs, CitronFs, proto::Ino, fs_client::FileHandle) {
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let (attr, fa) = a
        .create(
            CitronFs::process_caller(),
            proto::ROOT_INO,
            "f",
            0o644,
            libc::O_RDWR,
        )
        .unwrap();
    a.write(fa, 0, &[1u8; 4096]).unwrap();
    (a, b, attr.ino, fa)
}

/// Arms `failpoint` so that every thread reaching it waits there while `held` is set.
fn hold_every(failpoint: &str, held: &Arc<AtomicBool>) {
    let held = held.clone();
    fail::cfg_callback(failpoint, move || {
        while held.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
    })
    .unwrap();
}

/// A cluster on `fabric` with one data server.
fn one_data_server(fabric: Backend) -> Cluster {
    testkit::init_logging();
    Cluster::start(ClusterSpec {
        fabric,
        data_servers: 1,
        ..ClusterSpec::default()
    })
    .unwrap()
}

/// Holds every heartbeat (while the flag returned is set; the caller clears it and removes
/// the failpoint) and crashes and restarts the meta server: a client that makes no call of
/// its own meanwhile has not heard of the restart, as if it had been stopped through it.
fn crash_and_restart_unheard(cluster: &mut Cluster) -> Arc<AtomicBool> {
    let stale = Arc::new(AtomicBool::new(true));
    hold_every("fs_client::meta::sending::Heartbeat", &stale);
    cluster.crash_meta_and_restart().unwrap();
    stale
}

/// Arms `failpoint` so that the first thread reaching it waits there while `held` is set and
/// the others pass; returns how many threads reached it.
fn hold_first(failpoint: &str, held: &Arc<AtomicBool>) -> Arc<AtomicU64> {
    let (held, hits) = (held.clone(), Arc::new(AtomicU64::new(0)));
    let count = hits.clone();
    fail::cfg_callback(failpoint, move || {
        if count.fetch_add(1, Ordering::SeqCst) == 0 {
            while held.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    })
    .unwrap();
    hits
}

/// A stops holding the range lock of its write, its heartbeat with it (a stopped process, as
/// failpoints make it); B's write breaks the lock after A's lease, and B's fence revokes A's
/// session on every fabric server. A, going on, joins again in a new session: its next write
/// lands, and B reads it. Before, every later call of A failed until a remount (the fabric
/// servers refused its session for good).
fn a_fenced_client_joins_again_in_a_new_session(fabric: Backend) {
    testkit::init_logging();
    let cluster = Cluster::start(ClusterSpec {
        fabric,
        data_servers: 1,
        // Short, so that B's break-in is quick: the lease must exceed 4 × fence_after.
        fence_after: Duration::from_millis(50),
        lock_lease: Duration::from_millis(250),
        ..ClusterSpec::default()
    })
    .unwrap();
    let (a, b, ino, fa) = two_clients(&cluster);
    let me = CitronFs::process_caller();
    let fb = b.open(me, ino, libc::O_RDWR).unwrap();

    // The first write to reach its lock's failpoint (A's, below) waits there while `stopped`,
    // and so does every heartbeat (A's and B's: B makes calls meanwhile, so it is not silent).
    let stopped = Arc::new(AtomicBool::new(true));
    let hits = hold_first("fs_client::io::locked", &stopped);
    std::thread::scope(|s| {
        let a_write = s.spawn(|| a.write(fa, 0, &[2u8; 4096]));
        testkit::wait_until(Duration::from_secs(10), "A to hold its lock", || {
            hits.load(Ordering::SeqCst) > 0
        });
        hold_every("fs_client::meta::sending::Heartbeat", &stopped);
        // B breaks A's lock (after A's lease) and fences A.
        let started = Instant::now();
        b.write(fb, 0, &[3u8; 4096]).unwrap();
        eprintln!("B wrote over A's lock after {:?}", started.elapsed());
        stopped.store(false, Ordering::SeqCst);
        fail::remove("fs_client::meta::sending::Heartbeat");
        // A's write in flight had posted nothing (it stopped right after its lock was
        // granted), and finds its lease run out: it is redone under a new lock. In the fenced
        // session that is refused (EIO); if A's heartbeat found the session ended first and A
        // joined again, the redo lands, after B's write — either is right.
        let in_flight = a_write.join().unwrap();
        assert!(
            matches!(&in_flight, Ok(4096))
                || in_flight.as_ref().is_err_and(|e| e.errno() == libc::EIO),
            "A's write in flight at the fence: {in_flight:?}"
        );
    });
    fail::remove("fs_client::io::locked");
    // A joins again, and writes.
    testkit::wait_until(Duration::from_secs(30), "A to write again", || {
        a.write(fa, 0, &[4u8; 4096]).is_ok()
    });
    assert_eq!(b.read(fb, 0, 4096).unwrap(), vec![4u8; 4096]);
    assert_eq!(a.read(fa, 0, 4096).unwrap(), vec![4u8; 4096]);
}

#[test]
fn a_fenced_client_joins_again_in_a_new_session_on_tcp() {
    let _one = one_at_a_time();
    a_fenced_client_joins_again_in_a_new_session(Backend::Tcp);
}

/// On the rdma fabric (the soft NIC in CI). Skipped, and recorded, where no device opens.
#[cfg(feature = "rdma")]
#[test]
fn a_fenced_client_joins_again_in_a_new_session_on_rdma() {
    let _one = one_at_a_time();
    if let Err(e) = fabric::rdma::open_device() {
        testkit::skip(testkit::Need::Rdma, &e.to_string());
        return;
    }
    a_fenced_client_joins_again_in_a_new_session(Backend::Rdma);
}

/// A's heartbeat stops (as a stopped process's would) while the meta server crashes and
/// starts again. B, in a new session, holds the range lock of its write to A's file. A's write to the same bytes
/// must wait for B's: it may not land while B holds its lock, and B's data is then overwritten
/// by A's, whole.
fn a_stale_client_waits_for_a_lock_taken_after_the_restart(fabric: Backend) {
    let mut cluster = one_data_server(fabric);
    let (a, b, ino, fa) = two_clients(&cluster);
    let me = CitronFs::process_caller();

    // A's heartbeat stays silent across the restart. B's does too, but B makes calls of its
    // own.
    let stale = crash_and_restart_unheard(&mut cluster);

    // B joins the restarted server (its first call reconnects), opens the file, and writes;
    // the first I/O to hold its lock (B's) waits there while `held`.
    let mut opened = None;
    testkit::wait_until(Duration::from_secs(30), "B to open the file again", || {
        opened = b.open(me, ino, libc::O_RDWR).ok();
        opened.is_some()
    });
    let fb = opened.unwrap();
    // On shm the restarted meta server makes the data server live only once the earlier run's
    // lock leases have run out (`Service::register_data_server`). B's write must not meet
    // that wait while it holds its lock: it would give the lock up, wait and redo, and A's
    // write could then land first and be overwritten by B's redo (both orders are
    // linearizable; this test is about the lock B holds).
    cluster.wait_for_live_data_servers();
    let held = Arc::new(AtomicBool::new(true));
    let hits = hold_first("fs_client::io::locked", &held);
    let a_done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let b_write = s.spawn(|| b.write(fb, 0, &[2u8; 4096]));
        testkit::wait_until(Duration::from_secs(30), "B to hold its lock", || {
            hits.load(Ordering::SeqCst) > 0
        });
        let a_write = s.spawn(|| {
            let r = a.write(fa, 0, &[3u8; 4096]);
            a_done.store(true, Ordering::SeqCst);
            r
        });
        // Long enough for a write under a lock nobody else sees to land many times over
        // (a few milliseconds); a correct A is still waiting for B's lock.
        std::thread::sleep(Duration::from_millis(500));
        let landed_under_b = a_done.load(Ordering::SeqCst);
        held.store(false, Ordering::SeqCst);
        stale.store(false, Ordering::SeqCst);
        assert_eq!(b_write.join().unwrap().unwrap(), 4096);
        let a_result = a_write.join().unwrap();
        assert!(
            !landed_under_b,
            "A's write ({a_result:?}) returned while B held the range lock of the same bytes"
        );
        assert_eq!(a_result.unwrap(), 4096);
    });
    fail::remove("fs_client::io::locked");
    fail::remove("fs_client::meta::sending::Heartbeat");
    assert_eq!(b.read(fb, 0, 4096).unwrap(), vec![3u8; 4096]);
    assert_eq!(a.read(fa, 0, 4096).unwrap(), vec![3u8; 4096]);
}

#[test]
fn a_stale_client_waits_for_a_lock_taken_after_the_restart_on_shm() {
    let _one = one_at_a_time();
    a_stale_client_waits_for_a_lock_taken_after_the_restart(Backend::Shm);
}

#[test]
fn a_stale_client_waits_for_a_lock_taken_after_the_restart_on_tcp() {
    let _one = one_at_a_time();
    a_stale_client_waits_for_a_lock_taken_after_the_restart(Backend::Tcp);
}

/// A client that did no I/O before a meta server crash and restart it has not heard of
/// (its heartbeat silent, as a stopped process's) makes its first write then: its worker pool
/// is empty, so the write opens a new endpoint to the meta region under the client's old view,
/// in its old session. On tcp the restarted server refuses that session (it numbers sessions
/// from its start). The client must take that for what it is — it is behind the cluster, not
/// fenced — catch up and redo the write, which then lands whole; on shm it finds the old
/// region emptied and catches up as well. Before, on tcp, the write failed with EIO (the
/// refusal was taken for a fence).
fn a_client_behind_a_restart_writes_through_a_new_endpoint(fabric: Backend) {
    let mut cluster = one_data_server(fabric);
    let (_a, b, ino, _fa) = two_clients(&cluster);
    let me = CitronFs::process_caller();
    // C opens the file and does no I/O: no worker of its own yet.
    let c = cluster.connect(LockScheme::CITRON).unwrap();
    let fc = c.open(me, ino, libc::O_RDWR).unwrap();

    let stale = crash_and_restart_unheard(&mut cluster);
    let written = c.write(fc, 0, &[5u8; 4096]);
    stale.store(false, Ordering::SeqCst);
    fail::remove("fs_client::meta::sending::Heartbeat");
    assert_eq!(
        written.map_err(|e| format!("{e} (errno {})", e.errno())),
        Ok(4096),
        "C's first write after the restart"
    );
    let mut opened = None;
    testkit::wait_until(Duration::from_secs(30), "B to open the file again", || {
        opened = b.open(me, ino, libc::O_RDWR).ok();
        opened.is_some()
    });
    assert_eq!(b.read(opened.unwrap(), 0, 4096).unwrap(), vec![5u8; 4096]);
    assert_eq!(c.read(fc, 0, 4096).unwrap(), vec![5u8; 4096]);
}

#[test]
fn a_client_behind_a_restart_writes_through_a_new_endpoint_on_shm() {
    let _one = one_at_a_time();
    a_client_behind_a_restart_writes_through_a_new_endpoint(Backend::Shm);
}

#[test]
fn a_client_behind_a_restart_writes_through_a_new_endpoint_on_tcp() {
    let _one = one_at_a_time();
    a_client_behind_a_restart_writes_through_a_new_endpoint(Backend::Tcp);
}

/// Clears its flag when dropped (a held thread goes on even when a check fails).
struct Release(Arc<AtomicBool>);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Where chunk 0 of `ino` lives, asked of the meta server.
fn chunk_zero(cluster: &Cluster, ino: proto::Ino) -> proto::ChunkLoc {
    let answer = cluster
        .rpc_client()
        .unwrap()
        .call(proto::rpc::Request::ChunkMap {
            ino,
            first: 0,
            count: 1,
        })
        .unwrap();
    match answer {
        Ok(proto::rpc::Response::Chunks(locs)) => locs[0].expect("chunk 0 is allocated").first(),
        other => panic!("ChunkMap answered {other:?}"),
    }
}

/// A's write took its range lock before a meta server crash and posts its data only after the
/// restart (its thread held in between, as a preempted or stopped one is), through the chunk
/// location it learnt in the crashed run. Meanwhile B, a client of the new run, unlinked A's
/// file and was given the freed chunk for a file of its own. A's bytes must not land in B's
/// file: on tcp the data server, registered with the restarted meta server, refuses A's session
/// of the earlier run; on shm, where nothing can be refused, the data server is not live (B
/// cannot write) before A's lease has run out, and A checks its lease before it posts. Before
/// either, A's write landed in B's file: on tcp "A's write (Err(Fs(NotFound))) landed in B's
/// file" (its data verbs went through, its raise found the file gone), on shm "A's write
/// (Ok(4096)) landed in B's file".
fn a_write_held_across_a_restart_lands_in_no_other_file(fabric: Backend, lock_lease: Duration) {
    testkit::init_logging();
    let mut cluster = Cluster::start(ClusterSpec {
        fabric,
        data_servers: 1,
        lock_lease,
        ..ClusterSpec::default()
    })
    .unwrap();
    let me = CitronFs::process_caller();
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let (attr, fa) = a
        .create(me, proto::ROOT_INO, "a", 0o644, libc::O_RDWR)
        .unwrap();
    a.write(fa, 0, &[1u8; 4096]).unwrap();
    a.fsync(fa).unwrap();
    let at = chunk_zero(&cluster, attr.ino);

    let held = Arc::new(AtomicBool::new(true));
    let hits = hold_first("fs_client::io::locked", &held);
    std::thread::scope(|s| {
        // Lets A go on however this scope ends: a failed check below must not leave A held
        // and the scope waiting for it for ever.
        let _release = Release(held.clone());
        let a_write = s.spawn(|| a.write(fa, 0, &[7u8; 4096]));
        testkit::wait_until(Duration::from_secs(30), "A to hold its lock", || {
            hits.load(Ordering::SeqCst) > 0
        });
        fail::remove("fs_client::io::locked");
        cluster.crash_meta_and_restart().unwrap();
        // Before B frees A's chunk: a freed chunk whose server is not live yet stays dirty,
        // and B's file would be given another one.
        cluster.wait_for_live_data_servers();

        // B, in the new run, unlinks A's file and writes a file of its own into the chunk
        // that freed.
        let b = cluster.connect(LockScheme::CITRON).unwrap();
        b.unlink(proto::ROOT_INO, "a").unwrap();
        assert!(cluster.meta().wait_reclaimed(Duration::from_secs(30)));
        let (battr, fb) = b
            .create(me, proto::ROOT_INO, "b", 0o644, libc::O_RDWR)
            .unwrap();
        b.write(fb, 0, &[2u8; 4096]).unwrap();
        assert_eq!(
            chunk_zero(&cluster, battr.ino),
            at,
            "precondition: B's file was given A's freed chunk"
        );

        held.store(false, Ordering::SeqCst);
        let a_result = a_write.join().unwrap();
        assert!(
            b.read(fb, 0, 4096).unwrap() == vec![2u8; 4096],
            "A's write ({a_result:?}) landed in B's file"
        );
    });
}

#[test]
fn a_write_held_across_a_restart_lands_in_no_other_file_on_tcp() {
    let _one = one_at_a_time();
    // A lease long enough to be still running when A posts its data: what refuses A's verbs
    // must be the floor, not the lease.
    a_write_held_across_a_restart_lands_in_no_other_file(Backend::Tcp, Duration::from_secs(20));
}

#[test]
fn a_write_held_across_a_restart_lands_in_no_other_file_on_shm() {
    let _one = one_at_a_time();
    a_write_held_across_a_restart_lands_in_no_other_file(
        Backend::Shm,
        meta_server::DEFAULT_LOCK_LEASE,
    );
}
