//! Lingering opens (`handles`): a last close sends no request of its own; its release rides
//! ahead of the client's next call to the meta server (any thread's, or the heartbeat's), and
//! a file reopened before then is taken back without an `Open`.

use fs_client::{CitronFs, FsError, LockScheme, ROOT_INO};
use std::sync::{Arc, Barrier};
use std::time::Duration;
use testkit::{wait_until, Cluster, ClusterSpec};

fn me() -> fs_client::Caller {
    CitronFs::process_caller()
}

/// Requests the meta server handles while `f` runs (heartbeats excepted, unless they carry
/// releases).
fn requests_during<T>(cluster: &Cluster, f: impl FnOnce() -> T) -> (T, u64) {
    let before = cluster.meta().request_count();
    let out = f();
    (out, cluster.meta().request_count() - before)
}

/// A cluster whose clients heartbeat rarely (every 500 ms): a heartbeat can carry a release
/// out of a measured window, so the counting test retries, but rarely needs to.
fn slow_heartbeats() -> Cluster {
    Cluster::start(ClusterSpec {
        session_lease: Duration::from_secs(30),
        fence_after: Duration::from_secs(2),
        lock_lease: Duration::from_secs(10),
        ..ClusterSpec::default().with_data_servers(1, 64)
    })
    .unwrap()
}

#[test]
fn a_close_costs_no_request_and_a_reopen_before_the_next_call_no_open() {
    let cluster = slow_heartbeats();
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    // (requests of create + write + close — `Create` and the write's `AllocateChunks`, the
    // close none —, of reopen + read + close, of the next call, of the open after it)
    let mut seen = Vec::new();
    for attempt in 0..5 {
        let name = format!("f{attempt}");
        let ((), create_close) = requests_during(&cluster, || {
            let (_, fh) = fs
                .create(me(), ROOT_INO, &name, 0o644, libc::O_RDWR)
                .unwrap();
            fs.write(fh, 0, b"lingering").unwrap();
            fs.release(fh).unwrap();
        });
        let ino = fs.lookup(ROOT_INO, &name).unwrap().ino;
        let ((), reopen) = requests_during(&cluster, || {
            let fh = fs.open(me(), ino, libc::O_RDONLY).unwrap();
            assert_eq!(fs.read(fh, 0, 64).unwrap(), b"lingering");
            fs.release(fh).unwrap();
        });
        // The next call carries the release: one request for both.
        let (_, next_call) = requests_during(&cluster, || fs.statfs().unwrap());
        let ((), open_after) = requests_during(&cluster, || {
            let fh = fs.open(me(), ino, libc::O_RDONLY).unwrap();
            fs.release(fh).unwrap();
        });
        seen.push((create_close, reopen, next_call, open_after));
        if (create_close, reopen, next_call, open_after) == (2, 0, 1, 1) {
            return;
        }
    }
    panic!(
        "expected (create+write+close, reopen+close, next call, open after it) = (2, 0, 1, 1) \
         requests in some attempt; saw {seen:?}"
    );
}

#[test]
fn an_idle_clients_releases_ride_on_its_heartbeat() {
    let cluster = Cluster::start(ClusterSpec::default().with_data_servers(1, 64)).unwrap();
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let empty = b.statfs().unwrap().free_blocks;
    let (_, fh) = a.create(me(), ROOT_INO, "f", 0o644, libc::O_RDWR).unwrap();
    a.write(fh, 0, &vec![5u8; 256 << 10]).unwrap();
    a.release(fh).unwrap();
    // Unlinked by another client while a's release may still linger: an orphan until it is
    // released. a makes no further call; its heartbeat carries the release, and the space
    // comes back.
    b.unlink(ROOT_INO, "f").unwrap();
    wait_until(
        Duration::from_secs(10),
        "the unlinked file's blocks to be free again",
        || {
            cluster.meta().wait_reclaimed(Duration::from_secs(1))
                && b.statfs().unwrap().free_blocks == empty
        },
    );
}

#[test]
fn opens_and_closes_racing_with_other_threads_calls_lose_no_release() {
    let cluster = Cluster::start(ClusterSpec::default().with_data_servers(1, 256)).unwrap();
    let fs = Arc::new(cluster.connect(LockScheme::CITRON).unwrap());
    let empty = fs.statfs().unwrap().free_blocks;
    const FILES: usize = 3;
    const THREADS: usize = 4;
    let inos: Vec<u64> = (0..FILES)
        .map(|i| {
            let (attr, fh) = fs
                .create(me(), ROOT_INO, &format!("f{i}"), 0o644, libc::O_RDWR)
                .unwrap();
            fs.release(fh).unwrap();
            attr.ino
        })
        .collect();
    let start = Arc::new(Barrier::new(THREADS + 2));
    let mut threads = Vec::new();
    for t in 0..THREADS {
        let (fs, inos, start) = (fs.clone(), inos.clone(), start.clone());
        threads.push(std::thread::spawn(move || {
            start.wait();
            for round in 0..200u64 {
                let ino = inos[(t + round as usize) % FILES];
                let fh = fs.open(me(), ino, libc::O_RDWR).unwrap();
                let at = (t as u64) * 4096;
                let word = (round << 8 | t as u64).to_le_bytes();
                fs.write(fh, at, &word).unwrap();
                assert_eq!(
                    fs.read(fh, at, 8).unwrap(),
                    word,
                    "thread {t} round {round}"
                );
                fs.release(fh).unwrap();
            }
        }));
    }
    // Calls of another thread take the queued releases while the others open and close.
    let caller = {
        let (fs, start) = (fs.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            for i in 0..100 {
                fs.mkdir(me(), ROOT_INO, &format!("d{i}"), 0o755).unwrap();
                fs.rmdir(ROOT_INO, &format!("d{i}")).unwrap();
            }
        })
    };
    start.wait();
    for t in threads {
        t.join().unwrap();
    }
    caller.join().unwrap();
    // Every open was released: unlinked now, no file is an orphan, so every block comes back
    // at once (a lost release would keep its file's blocks until the session ends).
    for i in 0..FILES {
        fs.unlink(ROOT_INO, &format!("f{i}")).unwrap();
    }
    assert!(cluster.meta().wait_reclaimed(Duration::from_secs(10)));
    assert_eq!(fs.statfs().unwrap().free_blocks, empty);
    for ino in inos {
        assert!(matches!(
            fs.getattr(ino),
            Err(fs_client::Error::Fs(FsError::NotFound))
        ));
    }
}
