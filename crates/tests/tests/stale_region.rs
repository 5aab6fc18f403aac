//! A client that has not heard of a meta server crash and restart takes no range lock in the
//! old server's region: its I/O catches up first, and then excludes the I/O of the clients that
//! did. In a test binary of its own: it arms failpoints that every in-process client would
//! meet (the heartbeat's, the data path's), so no other test may share the process.
//!
//! On shm a client's mapping of the meta region outlives the server that made it: a restarted
//! server makes a new region file, and the old mapping names memory nobody else locks in. A
//! clean stop ends every session first, which clears the control blocks of their open files,
//! and a client behind it finds its file's block foreign. A crash clears nothing: a client
//! whose heartbeat had not yet found it took its range lock in the old region — granted at
//! once, its file's control block there still its own — and wrote under a lock no client of
//! the new server could see. On tcp its old connections are gone with the crash.

use fs_client::{CitronFs, LockScheme};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use testkit::{Backend, Cluster, ClusterSpec};

/// A's heartbeat stops (as a stopped process's would) while the meta server crashes and
/// starts again. B, in a
/// new session, holds the range lock of its write to A's file. A's write to the same bytes
/// must wait for B's: it may not land while B holds its lock, and B's data is then overwritten
/// by A's, whole.
fn a_stale_client_waits_for_a_lock_taken_after_the_restart(fabric: Backend) {
    testkit::init_logging();
    let mut cluster = Cluster::start(ClusterSpec {
        fabric,
        data_servers: 1,
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

    // Every heartbeat waits while `stale`: A's stays silent across the restart. B's does too,
    // but B makes calls of its own.
    let stale = Arc::new(AtomicBool::new(true));
    {
        let stale = stale.clone();
        fail::cfg_callback("fs_client::meta::sending::Heartbeat", move || {
            while stale.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        })
        .unwrap();
    }
    cluster
        .restart_meta_after(|meta| {
            meta.crash();
            Ok(())
        })
        .unwrap();

    // B joins the restarted server (its first call reconnects), opens the file, and writes;
    // the first I/O to hold its lock (B's) waits there while `held`.
    let mut opened = None;
    testkit::wait_until(Duration::from_secs(30), "B to open the file again", || {
        opened = b.open(me, attr.ino, libc::O_RDWR).ok();
        opened.is_some()
    });
    let fb = opened.unwrap();
    let held = Arc::new(AtomicBool::new(true));
    let hits = Arc::new(AtomicU64::new(0));
    {
        let (held, hits) = (held.clone(), hits.clone());
        fail::cfg_callback("fs_client::io::locked", move || {
            if hits.fetch_add(1, Ordering::SeqCst) == 0 {
                while held.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
        .unwrap();
    }
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

// One test per binary run at a time: both arm the same failpoints.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_stale_client_waits_for_a_lock_taken_after_the_restart_on_shm() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    a_stale_client_waits_for_a_lock_taken_after_the_restart(Backend::Shm);
}

#[test]
fn a_stale_client_waits_for_a_lock_taken_after_the_restart_on_tcp() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    a_stale_client_waits_for_a_lock_taken_after_the_restart(Backend::Tcp);
}
