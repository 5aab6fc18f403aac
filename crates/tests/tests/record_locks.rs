//! POSIX record locks (`fcntl`) through two mounts of one cluster, each served by its own client
//! process: a lock taken through one mount excludes conflicting locks through the other
//! (`F_SETLK` fails with EAGAIN, `F_GETLK` reports it, `F_SETLKW` waits), a close gives the
//! closing process's locks back (the release of the descriptor they were taken through, or
//! FUSE's FLUSH for a descriptor opened while they were held), a signal ends a wait with EINTR
//! (FUSE's INTERRUPT), and a client that dies gives its locks back (its session ends). Before the meta
//! server kept them, each client's kernel did, and two mounts never saw each other's locks.
//!
//! The test process locks through both mounts; its kernel names it one lock owner per mount,
//! and the meta server tells the two apart by the mounts' sessions.

use fs_client::LockScheme;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use testkit::ClusterExt;
use testkit::{open_rw, skip_without_fuse, ChildMount, Cluster, ClusterSpec};

/// The client processes run this test (see `ClusterExt::spawn_mount_process`); run normally it
/// does nothing.
#[test]
fn child_mount() {
    testkit::child_mount_main();
}

/// A `struct flock` for bytes `[start, start + len)` (`len` 0: to the end of any file).
fn flock(typ: i32, start: i64, len: i64) -> libc::flock {
    // SAFETY: `flock` is plain data; all zeros is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = typ as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = start;
    fl.l_len = len;
    fl
}

/// `fcntl(f, cmd, flock(typ, start, len))`.
fn lock(f: &File, cmd: i32, typ: i32, start: i64, len: i64) -> std::io::Result<()> {
    let fl = flock(typ, start, len);
    // SAFETY: `fl` outlives the call, which only reads it.
    match unsafe { libc::fcntl(f.as_raw_fd(), cmd, &fl) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// `F_GETLK` for a lock of `typ` over `[start, start + len)`.
fn getlk(f: &File, typ: i32, start: i64, len: i64) -> libc::flock {
    let mut fl = flock(typ, start, len);
    // SAFETY: `fl` outlives the call, which writes it.
    let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETLK, &mut fl) };
    assert_eq!(rc, 0, "F_GETLK: {}", std::io::Error::last_os_error());
    fl
}

/// The errno of a failed lock call.
fn errno(result: std::io::Result<()>) -> Option<i32> {
    result.err().and_then(|e| e.raw_os_error())
}

/// Waits up to `bound` for `rx`'s next message; `None` if none came.
fn within<T>(rx: &mpsc::Receiver<T>, bound: Duration) -> Option<T> {
    rx.recv_timeout(bound).ok()
}

/// A cluster, two client processes with mounts of it, and file `f` opened through each.
fn two_clients_on_one_file() -> (Cluster, ChildMount, ChildMount, File, File) {
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let a = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    File::create(a.path().join("f")).unwrap();
    let fa = open_rw(&a.path().join("f"));
    let fb = open_rw(&b.path().join("f"));
    (cluster, a, b, fa, fb)
}

extern "C" fn on_usr1(_: libc::c_int) {}

/// SIGUSR1 with a handler that does nothing and without `SA_RESTART`: a blocking call the
/// signal reaches fails with EINTR instead of being restarted.
fn interrupting_usr1() {
    // SAFETY: the handler is async-signal-safe (it does nothing); `sa` is plain data set up
    // before the call, which only reads it.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as usize;
        sa.sa_flags = 0;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
    }
}

#[test]
fn record_locks_exclude_across_clients_and_go_with_close_signal_and_death() {
    skip_without_fuse!();
    interrupting_usr1();
    let (_cluster, a, b, fa, fb) = two_clients_on_one_file();

    // A holds bytes [0, 100) for writing.
    lock(&fa, libc::F_SETLK, libc::F_WRLCK, 0, 100).unwrap();
    assert_eq!(
        errno(lock(&fb, libc::F_SETLK, libc::F_WRLCK, 50, 10)),
        Some(libc::EAGAIN),
        "B took a lock over bytes A holds"
    );
    assert_eq!(
        errno(lock(&fb, libc::F_SETLK, libc::F_RDLCK, 99, 1)),
        Some(libc::EAGAIN),
        "a read lock over A's write lock"
    );
    // Elsewhere in the file B may lock; and B sees A's lock (its pid is another client's: 0).
    lock(&fb, libc::F_SETLK, libc::F_RDLCK, 100, 0).unwrap();
    let seen = getlk(&fb, libc::F_WRLCK, 10, 1);
    assert_eq!(
        (seen.l_type as i32, seen.l_start, seen.l_len, seen.l_pid),
        (libc::F_WRLCK, 0, 100, 0)
    );
    assert_eq!(
        getlk(&fb, libc::F_RDLCK, 100, 0).l_type as i32,
        libc::F_UNLCK
    );
    // A's read over B's read lock is fine; a write is not.
    lock(&fa, libc::F_SETLK, libc::F_RDLCK, 200, 10).unwrap();
    assert_eq!(
        errno(lock(&fa, libc::F_SETLK, libc::F_WRLCK, 150, 1)),
        Some(libc::EAGAIN)
    );

    // B waits for [0, 100); A's close (not an unlock) gives it: the release of A's descriptor,
    // through which the lock was taken.
    let (tx, rx) = mpsc::channel();
    // (The waiter's descriptor is kept open: closing it would give B's locks back, POSIX.)
    let waiter = {
        let fb = fb.try_clone().unwrap();
        std::thread::spawn(move || {
            let took = Instant::now();
            let result = lock(&fb, libc::F_SETLKW, libc::F_WRLCK, 0, 100);
            let _ = tx.send((result.map_err(|e| e.to_string()), took.elapsed()));
            fb
        })
    };
    assert!(
        within(&rx, Duration::from_millis(500)).is_none(),
        "F_SETLKW did not wait for A's lock"
    );
    drop(fa);
    let (granted, waited) =
        within(&rx, Duration::from_secs(10)).expect("A's close did not give its lock back");
    granted.unwrap();
    let fb_dup = waiter.join().unwrap();
    eprintln!("B's F_SETLKW was granted after {waited:?}");

    // Now A waits for B's lock, and a signal ends the wait with EINTR.
    let fa = open_rw(&a.path().join("f"));
    let (tx, rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let result = lock(&fa, libc::F_SETLKW, libc::F_WRLCK, 0, 10);
        let _ = tx.send(errno(result));
        fa
    });
    assert!(within(&rx, Duration::from_millis(300)).is_none());
    let started = Instant::now();
    let mut ended = None;
    while ended.is_none() && started.elapsed() < Duration::from_secs(10) {
        // SAFETY: the thread is alive (it has not sent yet, and sends before it ends).
        unsafe {
            libc::pthread_kill(
                std::os::unix::thread::JoinHandleExt::as_pthread_t(&waiter),
                libc::SIGUSR1,
            );
        }
        ended = within(&rx, Duration::from_millis(100));
    }
    assert_eq!(
        ended,
        Some(Some(libc::EINTR)),
        "a signal did not end the wait"
    );
    let fa = waiter.join().unwrap();

    // A locks, then opens the file again: closing that second descriptor gives A's locks back
    // before close returns (POSIX: any close of the file), so B's lock right after is granted.
    // (A read lock: B reads from byte 100 on.)
    lock(&fa, libc::F_SETLK, libc::F_RDLCK, 5000, 10).unwrap();
    assert_eq!(
        errno(lock(&fb, libc::F_SETLK, libc::F_WRLCK, 5000, 1)),
        Some(libc::EAGAIN)
    );
    drop(open_rw(&a.path().join("f")));
    lock(&fb, libc::F_SETLK, libc::F_WRLCK, 5000, 10).unwrap();
    lock(&fb, libc::F_SETLK, libc::F_UNLCK, 5000, 10).unwrap();

    // B's client dies: its session ends, and its locks with it.
    drop(fb_dup);
    drop(fb);
    let fb = open_rw(&b.path().join("f"));
    lock(&fb, libc::F_SETLK, libc::F_WRLCK, 0, 10).unwrap();
    assert_eq!(
        errno(lock(&fa, libc::F_SETLK, libc::F_WRLCK, 0, 10)),
        Some(libc::EAGAIN)
    );
    // SAFETY: kill(2) of the child client process, which is ours and alive.
    assert_eq!(unsafe { libc::kill(b.pid() as i32, libc::SIGKILL) }, 0);
    let started = Instant::now();
    loop {
        match lock(&fa, libc::F_SETLK, libc::F_WRLCK, 0, 10) {
            Ok(()) => break,
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "a dead client's lock was never given back"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("{e}"),
        }
    }
    eprintln!(
        "the dead client's lock was given back {:?} after its death",
        started.elapsed()
    );
    drop(b);
    drop(fb);
}

/// A client stopped (SIGSTOP) across a meta server restart and past the restart's grace cannot
/// take its lock back: another client took the bytes meanwhile. The lock is lost, and, as on
/// NFS, the process that held it can read and write the file through that client no more — by
/// any descriptor — until it unlocks; another process can, and so can the new holder's
/// client. Before, the loss was only logged, and the process went on writing as if it held
/// the lock.
#[test]
fn a_lock_lost_over_a_meta_restart_fails_its_owners_io_until_it_unlocks() {
    skip_without_fuse!();
    let mut cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let a = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let path_a = a.path().join("f");
    File::create(&path_a)
        .unwrap()
        .write_all_at(b"written before", 0)
        .unwrap();
    let fa = open_rw(&path_a);
    let fb = open_rw(&b.path().join("f"));
    lock(&fa, libc::F_SETLK, libc::F_WRLCK, 0, 100).unwrap();

    {
        let _stopped = a.stop();
        cluster.restart_meta().unwrap();
        // B's wait ends with the grace, A not having taken its lock back.
        let waited = Instant::now();
        lock(&fb, libc::F_SETLKW, libc::F_WRLCK, 0, 100).unwrap();
        eprintln!("B took A's bytes {:?} after the restart", waited.elapsed());
    }

    // A, going on, finds a new session and cannot take its lock back.
    let mut buf = [0u8; 14];
    let eio = |r: std::io::Result<()>| r.err().and_then(|e| e.raw_os_error()) == Some(libc::EIO);
    testkit::wait_until(
        Duration::from_secs(30),
        "the lock's owner to be refused reads through A",
        || eio(fa.read_exact_at(&mut buf, 0)),
    );
    assert!(eio(fa.write_all_at(b"late", 0)), "the owner wrote on");
    assert!(
        eio(open_rw(&path_a).read_exact_at(&mut buf, 0)),
        "the owner read on through another descriptor"
    );
    // Another process (another lock owner) reads through A; B's I/O goes on.
    let other = Command::new("cat").arg(&path_a).output().unwrap();
    assert!(other.status.success(), "{other:?}");
    assert_eq!(other.stdout, b"written before");
    fb.write_all_at(b"W", 0).unwrap();

    // The owner's unlock ends it.
    lock(&fa, libc::F_SETLK, libc::F_UNLCK, 0, 0).unwrap();
    fa.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(&buf, b"Written before");
    assert_eq!(
        errno(lock(&fa, libc::F_SETLK, libc::F_WRLCK, 0, 100)),
        Some(libc::EAGAIN),
        "B's lock stands"
    );
}

/// `F_SETLK` and `F_GETLK` asked during the meta server's grace after a restart (2 s, while
/// clients take their locks back) wait it out on threads of their own, and the mount's request
/// threads go on serving metadata calls. Before, each held a request thread for the whole
/// grace: a dozen of them (the mount has 8) stalled every other call of the mount until the
/// grace ended.
#[test]
fn record_lock_calls_in_a_restarts_grace_hold_no_request_thread() {
    skip_without_fuse!();
    let mut cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let a = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let path = a.path().join("f");
    std::fs::write(&path, b"data").unwrap();
    let f = open_rw(&path);
    cluster.restart_meta().unwrap();
    let answered = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for i in 0..12 {
            let (f, answered) = (&f, &answered);
            s.spawn(move || {
                // Disjoint bytes: one process is one lock owner, in its own way nowhere.
                if i % 2 == 0 {
                    lock(f, libc::F_SETLK, libc::F_WRLCK, i * 10, 10).unwrap();
                } else {
                    getlk(f, libc::F_WRLCK, i * 10, 10);
                }
                answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
        // Give the calls time to reach the mount (they are answered only once the grace
        // ends), then use it: a lookup, a stat, a listing, an open and a close. No data: on
        // shm a restarted meta server makes the data servers live again only once the earlier
        // run's leases have run out (its clients' stores cannot be refused), about as long as
        // the grace, and a read waits for that whatever the request threads do.
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 4);
        assert!(std::fs::read_dir(a.path()).unwrap().count() >= 1);
        drop(open_rw(&path));
        assert_eq!(
            answered.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "the read was served only after the grace: the lock calls held the request threads"
        );
    });
}

/// What a counting process is told: the counter file and how many increments to make.
const ENV_COUNTER: &str = "CITRONFS_TEST_COUNTER";
const ENV_INCREMENTS: &str = "CITRONFS_TEST_INCREMENTS";

/// The counting processes run this test (see [`count_under_lock`]); run normally it does
/// nothing. Each increment reads the 8-byte counter, sleeps, and writes it back plus one, all
/// under an `F_SETLKW` write lock of those bytes, given back after.
#[test]
fn child_counter() {
    let (Ok(path), Ok(n)) = (std::env::var(ENV_COUNTER), std::env::var(ENV_INCREMENTS)) else {
        return;
    };
    let n: u32 = n.parse().unwrap();
    let f = open_rw(std::path::Path::new(&path));
    for _ in 0..n {
        lock(&f, libc::F_SETLKW, libc::F_WRLCK, 0, 8).unwrap();
        let mut bytes = [0u8; 8];
        f.read_exact_at(&mut bytes, 0).unwrap();
        // Widen the read-modify-write window: an exclusion that failed shows as lost updates.
        std::thread::sleep(Duration::from_micros(500));
        f.write_all_at(&(u64::from_le_bytes(bytes) + 1).to_le_bytes(), 0)
            .unwrap();
        lock(&f, libc::F_SETLK, libc::F_UNLCK, 0, 8).unwrap();
    }
}

/// Two counting processes on each of two mounts (four lock owners, two clients) increment one
/// counter under `fcntl` locks: no increment is lost. With each client's kernel keeping its own
/// locks (before), the two mounts' processes overwrote each other's increments.
#[test]
fn read_modify_writes_under_record_locks_lose_nothing_across_clients() {
    skip_without_fuse!();
    const PER_PROCESS: u32 = 60;
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let a = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    File::create(a.path().join("counter"))
        .unwrap()
        .write_all_at(&0u64.to_le_bytes(), 0)
        .unwrap();
    let exe = std::env::current_exe().unwrap();
    let started = Instant::now();
    let counters: Vec<_> = [a.path(), a.path(), b.path(), b.path()]
        .iter()
        .map(|mount| {
            Command::new(&exe)
                .args([
                    "child_counter",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(ENV_COUNTER, mount.join("counter"))
                .env(ENV_INCREMENTS, PER_PROCESS.to_string())
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut counter in counters {
        assert!(
            counter.wait().unwrap().success(),
            "a counting process failed"
        );
    }
    let mut bytes = [0u8; 8];
    open_rw(&b.path().join("counter"))
        .read_exact_at(&mut bytes, 0)
        .unwrap();
    let total = u64::from_le_bytes(bytes);
    eprintln!(
        "{total} increments by 4 processes on 2 clients in {:?}",
        started.elapsed()
    );
    assert_eq!(total, 4 * u64::from(PER_PROCESS), "increments were lost");
}

/// `flock(2)` through two mounts: the kernel hands it over as a lock of the whole file owned by
/// the open file (`FUSE_FLOCK_LOCKS`), so an exclusive `flock` through one client keeps out
/// both kinds through the other, and the last close of the open file gives it back. Before,
/// each client's kernel kept its own.
#[test]
fn flock_excludes_across_clients_until_the_open_file_is_closed() {
    skip_without_fuse!();
    // The mounts live as long as their handles here.
    let (_cluster, _a, _b, fa, fb) = two_clients_on_one_file();
    let bsd_lock = |f: &File, how: i32| -> std::io::Result<()> {
        // SAFETY: flock(2) on a descriptor `f` owns.
        match unsafe { libc::flock(f.as_raw_fd(), how) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    };
    bsd_lock(&fa, libc::LOCK_EX).unwrap();
    for how in [libc::LOCK_EX, libc::LOCK_SH] {
        assert_eq!(
            errno(bsd_lock(&fb, how | libc::LOCK_NB)),
            Some(libc::EWOULDBLOCK),
            "B's flock({how}) over A's exclusive one"
        );
    }
    // Shared with shared is fine.
    bsd_lock(&fa, libc::LOCK_SH).unwrap();
    bsd_lock(&fb, libc::LOCK_SH | libc::LOCK_NB).unwrap();
    bsd_lock(&fb, libc::LOCK_UN).unwrap();
    bsd_lock(&fa, libc::LOCK_EX).unwrap();
    // A blocked flock through B is granted once A's open file is closed (a duplicate kept
    // open keeps it: the lock belongs to the open file).
    let dup = fa.try_clone().unwrap();
    let (tx, rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let result = bsd_lock(&fb, libc::LOCK_EX);
        let _ = tx.send(errno(result));
        fb
    });
    drop(fa);
    assert!(
        within(&rx, Duration::from_millis(500)).is_none(),
        "the open file is still open through its duplicate"
    );
    drop(dup);
    assert_eq!(
        within(&rx, Duration::from_secs(10)),
        Some(None),
        "B's flock was not granted after A's open file was closed"
    );
    drop(waiter.join().unwrap());
}
