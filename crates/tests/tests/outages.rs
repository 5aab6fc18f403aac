//! Calls made while a server is down end within the bound docs/RELIABILITY.md states for that
//! kind of outage, and work again once it is back:
//!
//! - the meta server: every call — a stat, a lookup, a create, a write through an open handle —
//!   ends within `RECONNECT_WAIT` (10 s, plus the time of one last attempt) of the client's
//!   first failed attempt to reach it. Every wait of a call for the meta server counts against
//!   one bound, however many places inside the call wait (the view's refresh, the RPC's
//!   reconnection, the data path's recovery): before, a stat waited once in its one-sided
//!   read's refresh and once more in the RPC it fell back to, 20 s in all.
//! - a data server: a read or write on its chunks ends within `DATA_SERVER_WAIT` (10 s) of the
//!   call's start, and a call made later in the same outage within that bound of the outage's
//!   first failure (it tries once, then fails at once): one bound per outage, as for the meta
//!   server. Before, each call waited its own 10 s from its first failure.

use fs_client::{CitronFs, LockScheme};
use proto::ROOT_INO;
use std::time::{Duration, Instant};
use testkit::ClusterExt;
use testkit::{pattern, Backend, BackingKind, Cluster, ClusterSpec, TEST_CHUNK_SIZE};

/// The documented wait (for the meta server and for a data server alike), and what one last
/// attempt may add to it.
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

/// A file-backed cluster of two data servers; data server 1 is stopped under a client that
/// has a file open with chunks on both. A read of the whole file, then a write of it, each
/// fail with EIO, the first within the bound of its start and the second within the bound of
/// the outage's first failure; a read of a range on the other server works meanwhile. Once
/// the server is back every chunk reads back what it held, and writes land.
fn calls_while_a_data_server_is_down(fabric: Backend) {
    testkit::init_logging();
    let mut cluster = Cluster::start(ClusterSpec {
        fabric,
        backing: BackingKind::File,
        ..ClusterSpec::default()
    })
    .unwrap();
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let me = CitronFs::process_caller();
    let (_, fh) = fs.create(me, ROOT_INO, "f", 0o644, libc::O_RDWR).unwrap();
    // Past the small first chunks (striped over both servers), each chunk is on one server,
    // alternately: chunks 1 and 2 are on different ones.
    let len = 3 * TEST_CHUNK_SIZE as usize;
    let data = pattern(1, 0, len);
    fs.write(fh, 0, &data).unwrap();
    fs.fsync(fh).unwrap();

    let stopped = cluster.data_servers()[1].id();
    cluster.data_servers_mut()[1].shutdown();
    let down = Instant::now();
    let read = fs.read(fh, 0, len);
    let read_took = down.elapsed();
    let write_at = Instant::now();
    let write = fs.write(fh, 0, &data);
    let write_took = write_at.elapsed();
    let outage_took = down.elapsed();
    eprintln!(
        "{fabric:?}: data server {stopped} down: a read {:?} after {read_took:?}, then a write \
         {:?} after {write_took:?} ({outage_took:?} into the outage)",
        read.as_ref().map(Vec::len),
        write
    );
    assert_eq!(
        read.as_ref().map_err(|e| e.errno()).err(),
        Some(libc::EIO),
        "{fabric:?}: a read of chunks on a stopped data server"
    );
    assert_eq!(
        write.as_ref().map_err(|e| e.errno()).err(),
        Some(libc::EIO),
        "{fabric:?}: a write of chunks on a stopped data server"
    );
    assert!(
        read_took <= BOUND + SLACK,
        "{fabric:?}: a read waited {read_took:?} for a stopped data server (bound {BOUND:?})"
    );
    assert!(
        outage_took <= BOUND + SLACK,
        "{fabric:?}: a write made {:?} into the outage ended {outage_took:?} into it (bound \
         {BOUND:?} of the outage's first failure)",
        write_at - down
    );
    // The chunk on the other server reads meanwhile (which of chunks 1 and 2 it is).
    let chunk = TEST_CHUNK_SIZE as usize;
    let other: Vec<_> = [1, 2]
        .into_iter()
        .filter_map(|c| fs.read(fh, (c * chunk) as u64, chunk).ok().map(|r| (c, r)))
        .collect();
    assert!(
        matches!(other.as_slice(), [(c, r)] if *r == data[c * chunk..(c + 1) * chunk]),
        "{fabric:?}: exactly one of chunks 1 and 2 reads while its server runs"
    );

    // Back, with its region file: the data is there, and writes land.
    let config = cluster.data_config(1);
    cluster.data_servers_mut()[1] = data_server::DataServer::start(config).unwrap();
    cluster.wait_for_live_data_servers();
    assert!(
        fs.read(fh, 0, len).unwrap() == data,
        "{fabric:?}: data after the restart"
    );
    let more = pattern(2, 0, len);
    fs.write(fh, 0, &more).unwrap();
    assert!(
        fs.read(fh, 0, len).unwrap() == more,
        "{fabric:?}: a write after the restart"
    );
    fs.release(fh).unwrap();
}

#[test]
fn calls_while_a_data_server_is_down_end_within_the_bound_on_tcp() {
    calls_while_a_data_server_is_down(Backend::Tcp);
}

#[test]
fn calls_while_a_data_server_is_down_end_within_the_bound_on_shm() {
    calls_while_a_data_server_is_down(Backend::Shm);
}
