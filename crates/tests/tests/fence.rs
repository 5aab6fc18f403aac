//! A client fenced while it held a lock joins the cluster again (tcp): its write in flight
//! fails, its later calls work. In a test binary of its own: it arms failpoints that every
//! in-process client would meet (the heartbeat's), so no other test may share the process.

use fs_client::{CitronFs, LockScheme};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::{Backend, Cluster, ClusterSpec};

/// A stops holding the range lock of its write, its heartbeat with it (a stopped process, as
/// failpoints make it); B's write breaks the lock after A's lease, and B's fence revokes A's
/// session on every fabric server. A, going on, joins again in a new session: its next write
/// lands, and B reads it. Before, every later call of A failed until a remount (the fabric
/// servers refused its session for good).
#[test]
fn a_fenced_client_joins_again_in_a_new_session() {
    testkit::init_logging();
    let cluster = Cluster::start(ClusterSpec {
        fabric: Backend::Tcp,
        data_servers: 1,
        // Short, so that B's break-in is quick: the lease must exceed 4 × fence_after.
        fence_after: Duration::from_millis(50),
        lock_lease: Duration::from_millis(250),
        ..ClusterSpec::default()
    })
    .unwrap();
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let me = CitronFs::process_caller();
    let (attr, fa) = a
        .create(me, proto::ROOT_INO, "f", 0o644, libc::O_RDWR)
        .unwrap();
    a.write(fa, 0, &[1u8; 4096]).unwrap();
    let fb = b.open(me, attr.ino, libc::O_RDWR).unwrap();

    // The first write to reach its lock's failpoint (A's, below) waits there while `stopped`,
    // and so does every heartbeat (A's and B's: B makes calls meanwhile, so it is not silent).
    let stopped = Arc::new(AtomicBool::new(true));
    let hits = Arc::new(AtomicU64::new(0));
    {
        let (stopped, hits) = (stopped.clone(), hits.clone());
        fail::cfg_callback("fs_client::io::locked", move || {
            if hits.fetch_add(1, Ordering::SeqCst) == 0 {
                while stopped.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
        .unwrap();
    }
    std::thread::scope(|s| {
        let a_write = s.spawn(|| a.write(fa, 0, &[2u8; 4096]));
        testkit::wait_until(Duration::from_secs(10), "A to hold its lock", || {
            hits.load(Ordering::SeqCst) > 0
        });
        {
            let stopped = stopped.clone();
            fail::cfg_callback("fs_client::meta::sending::Heartbeat", move || {
                while stopped.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
            .unwrap();
        }
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
