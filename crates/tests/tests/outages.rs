//! Calls made while the meta server is down end within the bound docs/RELIABILITY.md states
//! (`RECONNECT_WAIT`, 10 s, plus the time of one last attempt), whatever they are — a stat, a
//! lookup, a create, a write through an open handle — and the same calls work again once it is
//! back. Every wait of a call for the meta server counts against one bound, however many
//! places inside the call wait (the view's refresh, the RPC's reconnection, the data path's
//! recovery): before, a stat waited once in its one-sided read's refresh and once more in the
//! RPC it fell back to, 20 s in all.

use fs_client::{CitronFs, LockScheme};
use proto::ROOT_INO;
use std::time::{Duration, Instant};
use testkit::ClusterExt;
use testkit::{Backend, Cluster, ClusterSpec};

/// The documented wait, and what one last connection attempt may add to it.
const BOUND: Duration = Duration::from_secs(10);
const SLACK: Duration = Duration::from_millis(1_500);

fn calls_while_the_meta_server_is_down(fabric: Backend) {
    testkit::init_logging();
    let mut cluster = Cluster::start(ClusterSpec {
        fabric,
        ..ClusterSpec::default()
    })
    .unwrap();
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let me = CitronFs::process_caller();
    let (attr, fh) = fs.create(me, ROOT_INO, "f", 0o644, libc::O_RDWR).unwrap();
    fs.write(fh, 0, &[1u8; 4096]).unwrap();
    let mut took = Vec::new();
    cluster
        .restart_meta_after(|meta| {
            meta.shutdown()?;
            let down = Instant::now();
            std::thread::scope(|s| {
                let calls: Vec<(&str, std::thread::ScopedJoinHandle<'_, String>)> = vec![
                    (
                        "stat",
                        s.spawn(|| format!("{:?}", fs.getattr(attr.ino).map(|a| a.size))),
                    ),
                    (
                        "lookup",
                        s.spawn(|| format!("{:?}", fs.lookup(ROOT_INO, "f").map(drop))),
                    ),
                    (
                        "create",
                        s.spawn(|| {
                            format!(
                                "{:?}",
                                fs.create(me, ROOT_INO, "g", 0o644, libc::O_RDWR).map(drop)
                            )
                        }),
                    ),
                    (
                        "write",
                        s.spawn(|| format!("{:?}", fs.write(fh, 0, &[2u8; 4096]))),
                    ),
                ];
                for (what, call) in calls {
                    let result = call.join().unwrap();
                    took.push((what, down.elapsed(), result));
                }
            });
            Ok(())
        })
        .unwrap();
    for (what, elapsed, result) in &took {
        eprintln!("{fabric:?}: {what} with the meta server down: {result} after {elapsed:?}");
    }
    for (what, elapsed, result) in &took {
        assert!(
            *elapsed <= BOUND + SLACK,
            "{fabric:?}: a {what} waited {elapsed:?} for the meta server (bound {BOUND:?}): {result}"
        );
    }
    // Back: every kind of call works again.
    cluster.wait_for_live_data_servers();
    assert_eq!(fs.getattr(attr.ino).unwrap().ino, attr.ino);
    fs.lookup(ROOT_INO, "f").unwrap();
    fs.write(fh, 0, &[3u8; 4096]).unwrap();
    assert_eq!(fs.read(fh, 0, 4096).unwrap(), vec![3u8; 4096]);
    let (_, fg) = fs.create(me, ROOT_INO, "h", 0o644, libc::O_RDWR).unwrap();
    fs.release(fg).unwrap();
    fs.release(fh).unwrap();
}

#[test]
fn calls_while_the_meta_server_is_down_end_within_the_bound_on_tcp() {
    calls_while_the_meta_server_is_down(Backend::Tcp);
}

#[test]
fn calls_while_the_meta_server_is_down_end_within_the_bound_on_shm() {
    calls_while_the_meta_server_is_down(Backend::Shm);
}
