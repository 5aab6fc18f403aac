//! FUSE over io_uring: with the kernel offering it (Linux 6.14 and later, the fuse module's
//! `enable_uring` parameter on), a mount serves the kernel's requests from per-CPU rings
//! instead of `/dev/fuse` (vendor/fuser `ring.rs`). Only the transport changes, so what is
//! checked is what a transport can get wrong: requests and answers of every size up to the
//! atomic bound at every buffer alignment (the request's headers are copied in front of its
//! payload, the answer's body into the entry's buffer), many requests at once on one CPU's
//! entries, errors, an answer sent later from another thread (a blocking `F_SETLKW`, and its
//! end by a signal through `/dev/fuse`'s INTERRUPT), an unmount that ends the rings, and ring
//! threads that fail to start (the `fuser::ring::register` failpoint).
//!
//! One test, in a binary of its own: the parameter is machine-wide, so the test turns it on
//! for its run only and puts it back afterwards, with no other mount of this binary alive.
//! Without root or without the parameter (a kernel without FUSE over io_uring) it says so and
//! checks nothing.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::{open_rw, pattern, skip_without_fuse, Cluster, ClusterSpec, Mount, UserBuf};

const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";
const PAGE: usize = 4096;
const MIB: usize = 1 << 20;

/// Turns `enable_uring` on, and back to what it was when dropped.
struct UringEnabled {
    was: String,
}

impl UringEnabled {
    fn turn_on() -> Option<UringEnabled> {
        let was = match std::fs::read_to_string(ENABLE_URING) {
            Ok(v) => v.trim().to_string(),
            Err(e) => {
                testkit::skip(
                    testkit::Need::Other,
                    &format!("{ENABLE_URING}: {e}: this kernel has no FUSE over io_uring"),
                );
                return None;
            }
        };
        if let Err(e) = std::fs::write(ENABLE_URING, "Y") {
            testkit::skip(
                testkit::Need::Root,
                &format!("cannot turn on {ENABLE_URING} ({e})"),
            );
            return None;
        }
        Some(UringEnabled { was })
    }
}

impl Drop for UringEnabled {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(ENABLE_URING, &self.was) {
            eprintln!("could not put {ENABLE_URING} back to {}: {e}", self.was);
        }
    }
}

/// The number of queues the kernel makes: one per possible CPU.
fn possible_cpus() -> usize {
    let list = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    let highest = list
        .trim()
        .split(',')
        .filter_map(|r| r.rsplit('-').next()?.parse::<usize>().ok())
        .max()
        .unwrap();
    highest + 1
}

fn errno<T>(r: std::io::Result<T>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

/// `fcntl(f, cmd, F_WRLCK or F_UNLCK over [0, 100))`.
fn lock(f: &File, cmd: i32, typ: i32) -> std::io::Result<()> {
    // SAFETY: `flock` is plain data; all zeros is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = typ as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_len = 100;
    // SAFETY: `fl` outlives the call, which only reads it.
    match unsafe { libc::fcntl(f.as_raw_fd(), cmd, &fl) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Every size up to the bound at every alignment, written through one mount and read back
/// through the other, whole.
fn round_trips(a: &Mount, b: &Mount, bound: usize) -> u64 {
    let mut sizes = vec![
        1,
        100,
        PAGE - 1,
        PAGE,
        PAGE + 1,
        128 << 10,
        MIB + 4095,
        4 * MIB + 1,
    ];
    sizes.push(bound);
    let offsets = [0, 1, 511, 2048, PAGE - 1];
    File::create(a.path().join("sizes")).unwrap();
    let (wa, rb) = (
        open_rw(&a.path().join("sizes")),
        open_rw(&b.path().join("sizes")),
    );
    let mut calls = 0;
    for (i, &size) in sizes.iter().enumerate() {
        for (j, &offset) in offsets.iter().enumerate() {
            let seed = (i * 16 + j) as u64;
            let at = (seed * 7919) % (3 * PAGE as u64);
            let mut out = UserBuf::new(size, offset);
            out.get_mut().copy_from_slice(&pattern(seed, at, size));
            wa.write_all_at(out.get(), at).unwrap();
            let mut back = UserBuf::new(size, (offset + 1) % PAGE);
            rb.read_exact_at(back.get_mut(), at).unwrap();
            assert!(
                back.get() == out.get(),
                "{size} bytes at file offset {at}, buffer offsets {offset}/{}: read back \
                 differently",
                (offset + 1) % PAGE
            );
            calls += 2;
        }
    }
    calls
}

/// Threads writing and checking regions of their own through both mounts at once: many
/// requests in flight on every CPU's entries, none answered with another's data.
fn many_at_once(a: &Mount, b: &Mount) -> u64 {
    const THREADS: usize = 8;
    const ROUNDS: usize = 200;
    let size = 3 * PAGE + 17;
    File::create(a.path().join("shared")).unwrap();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let dir = if t % 2 == 0 { a.path() } else { b.path() };
            let other = if t % 2 == 0 { b.path() } else { a.path() };
            s.spawn(move || {
                let f = open_rw(&dir.join("shared"));
                let g = open_rw(&other.join("shared"));
                let at = (t * size) as u64;
                for r in 0..ROUNDS {
                    let data = pattern((t * ROUNDS + r) as u64, at, size);
                    f.write_all_at(&data, at).unwrap();
                    let mut back = vec![0u8; size];
                    g.read_exact_at(&mut back, at).unwrap();
                    assert!(back == data, "thread {t} round {r}: read back differently");
                }
            });
        }
    });
    (THREADS * ROUNDS * 2) as u64
}

/// Namespace calls and their errors come back as the kernel expects them.
fn namespace(a: &Mount, b: &Mount) -> u64 {
    let d = a.path().join("dir");
    std::fs::create_dir(&d).unwrap();
    assert_eq!(errno(std::fs::create_dir(&d)), Some(libc::EEXIST));
    for i in 0..50 {
        std::fs::write(d.join(format!("f{i}")), format!("file {i}")).unwrap();
    }
    let mut names: Vec<String> = std::fs::read_dir(b.path().join("dir"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 50);
    assert_eq!(
        std::fs::read_to_string(b.path().join("dir/f7")).unwrap(),
        "file 7"
    );
    std::fs::rename(d.join("f7"), d.join("seven")).unwrap();
    assert_eq!(errno(std::fs::metadata(d.join("f7"))), Some(libc::ENOENT));
    assert_eq!(
        errno(std::fs::write(d.join("x".repeat(300)), b"")),
        Some(libc::ENAMETOOLONG)
    );
    assert_eq!(errno(std::fs::remove_dir(&d)), Some(libc::ENOTEMPTY));
    std::fs::remove_dir_all(&d).unwrap();
    // Fewer requests than were made: 50 files each created, written, released and unlinked.
    200
}

/// Waits until the client's `F_SETLKW` threads (which answer late) have ended: io_uring cancels
/// what an ending thread submitted, so this is when an answer committed from such a thread,
/// not from its ring's own, would lose its entry.
fn answering_threads_ended() {
    testkit::wait_until(
        Duration::from_secs(10),
        "the F_SETLKW threads to end",
        || setlkw_threads() == 0,
    );
}

/// A blocking `F_SETLKW` is answered later, from the adapter's own thread: once when the lock
/// is given back, once with EINTR when the waiter gets a signal (an INTERRUPT, which comes
/// over `/dev/fuse` while the request came over a ring).
fn late_answers(a: &Mount, b: &Mount) {
    std::fs::write(a.path().join("locked"), b"x").unwrap();
    let holder = open_rw(&a.path().join("locked"));
    lock(&holder, libc::F_SETLK, libc::F_WRLCK).unwrap();

    let waiter_path = b.path().join("locked");
    let (tx, rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let waiter = std::thread::spawn(move || {
        let f = open_rw(&waiter_path);
        let started = Instant::now();
        let r = lock(&f, libc::F_SETLKW, libc::F_WRLCK);
        tx.send((r.map_err(|e| e.raw_os_error()), started.elapsed()))
            .unwrap();
        // The next call on this CPU only once the thread that answered has ended (below).
        go_rx.recv().unwrap();
        // Given back at once (a close gives it back only at the release, which the kernel
        // sends in the background).
        lock(&f, libc::F_SETLK, libc::F_UNLCK).unwrap();
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "F_SETLKW through the other mount returned while the lock was held"
    );
    lock(&holder, libc::F_SETLK, libc::F_UNLCK).unwrap();
    let (r, _) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("F_SETLKW not answered after the lock was given back");
    assert_eq!(r, Ok(()));
    answering_threads_ended();
    go_tx.send(()).unwrap();
    waiter.join().unwrap();

    // Now held by nobody: hold it again and interrupt a waiter with a signal.
    lock(&holder, libc::F_SETLK, libc::F_WRLCK).unwrap();
    // SAFETY: an empty handler for SIGUSR1, so that the signal interrupts without killing.
    unsafe {
        extern "C" fn nothing(_: libc::c_int) {}
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = nothing as *const () as usize;
        libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
    }
    let waiter_path = b.path().join("locked");
    let (tx, rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        // SAFETY: pthread_self is always safe.
        tx.send(unsafe { libc::pthread_self() }).unwrap();
        let f = open_rw(&waiter_path);
        lock(&f, libc::F_SETLKW, libc::F_WRLCK).map_err(|e| e.raw_os_error())
    });
    let thread = rx.recv().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: the thread is alive until joined below.
    unsafe { libc::pthread_kill(thread, libc::SIGUSR1) };
    assert_eq!(waiter.join().unwrap(), Err(Some(libc::EINTR)));
    answering_threads_ended();
    lock(&holder, libc::F_SETLK, libc::F_UNLCK).unwrap();
}

/// Pins the calling thread to `cpu`.
fn pin(cpu: usize) {
    assert!(run_on(std::iter::once(cpu)), "pin to CPU {cpu}");
}

/// Lets the calling thread run on `cpus` only; whether the kernel agreed (a CPU that is
/// possible but offline, or outside this process's cpuset, is refused).
fn run_on(cpus: impl IntoIterator<Item = usize>) -> bool {
    // SAFETY: plain libc calls on a zeroed cpu_set_t owned here.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// The client's threads waiting out an `F_SETLKW` (the mounts run in this process).
fn setlkw_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter(|t| {
            let comm = t.as_ref().unwrap().path().join("comm");
            std::fs::read_to_string(comm).is_ok_and(|c| c.trim() == "citronfs-setlkw")
        })
        .count()
}

/// Requests answered late keep their ring entry until then, and a request that finds every
/// entry of its CPU's queue taken waits for one of them: a dozen blocked `F_SETLKW`s from one
/// CPU must leave entries for a read from that CPU.
fn late_answers_leave_room(a: &Mount, b: &Mount) -> u64 {
    const WAITERS: usize = 12;
    let holder = open_rw(&a.path().join("locked"));
    lock(&holder, libc::F_SETLK, libc::F_WRLCK).unwrap();
    let path = b.path().join("locked");
    std::thread::scope(|s| {
        for _ in 0..WAITERS {
            let path = path.clone();
            s.spawn(move || {
                pin(0);
                let f = open_rw(&path);
                lock(&f, libc::F_SETLKW, libc::F_WRLCK).unwrap();
                lock(&f, libc::F_SETLK, libc::F_UNLCK).unwrap();
            });
        }
        // Most of them waiting in the client (the rest may wait in the kernel for an entry).
        // No panic before the unlock below: the scope would wait for the waiters forever.
        let deadline = Instant::now() + Duration::from_secs(10);
        while setlkw_threads() < WAITERS / 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let waiting = setlkw_threads();
        let (tx, rx) = mpsc::channel();
        let read_path = path.clone();
        s.spawn(move || {
            pin(0);
            let mut buf = [0u8; 8];
            let r = open_rw(&read_path).read_at(&mut buf, 0).map(|_| ());
            let _ = tx.send(r.map_err(|e| e.raw_os_error()));
        });
        let read = rx.recv_timeout(Duration::from_secs(10));
        // Let the waiters (and a read stuck behind them) through whatever happened.
        lock(&holder, libc::F_SETLK, libc::F_UNLCK).unwrap();
        assert!(
            waiting >= WAITERS / 2,
            "only {waiting} of {WAITERS} F_SETLKWs from one CPU reached the client: the rest \
             found no ring entry"
        );
        assert_eq!(
            read,
            Ok(Ok(())),
            "a read from the CPU of {WAITERS} waiting F_SETLKWs was not answered while they \
             waited"
        );
    });
    answering_threads_ended();
    (WAITERS * 3 + 2) as u64
}

/// Calls through both mounts from every CPU in turn, so that every CPU's queue is used: an
/// entry that an earlier call broke fails one of them, or has ended its thread.
fn from_every_cpu(a: &Mount, b: &Mount) -> u64 {
    let mut calls = 0;
    for cpu in 0..possible_cpus() {
        // A CPU this thread may not run on sends no request to its queue either.
        if !run_on(std::iter::once(cpu)) {
            continue;
        }
        for m in [a, b] {
            let f = open_rw(&m.path().join("locked"));
            for i in 0..50u64 {
                f.write_all_at(&i.to_le_bytes(), 8 * i).unwrap();
                lock(&f, libc::F_SETLK, libc::F_WRLCK).unwrap();
                lock(&f, libc::F_SETLK, libc::F_UNLCK).unwrap();
                calls += 3;
            }
        }
    }
    assert!(calls > 0, "this thread could run on none of the CPUs");
    run_on(0..possible_cpus());
    calls
}

/// A mount whose ring threads do not all start (the `fuser::ring::register` failpoint):
/// - 2 per CPU, the first to register fails: every queue still has one, so the rings serve,
///   with one thread fewer;
/// - 1 per CPU, the first fails: its queue would have none, so it gets another thread, and
///   every queue is served;
/// - 1 per CPU, every registration fails: the kernel, told FUSE_OVER_IO_URING at INIT, would
///   hold every request until each queue had an entry (it never falls back to `/dev/fuse`), so
///   that session ends at once and the mount is made again without rings: it serves over
///   `/dev/fuse` (before, it hung every call).
///
/// Where the mount works, every call from every CPU is answered whole through the rings.
fn some_ring_threads_fail_to_start(cluster: &Cluster) {
    let cpus = possible_cpus();
    for (per_cpu, fails, serving) in [(2, "1*return", 2 * cpus - 1), (1, "1*return", cpus)] {
        fail::cfg("fuser::ring::register", fails).unwrap();
        let options = fs_client::fuse::FuseOptions {
            ring_threads_per_cpu: per_cpu,
            ..testkit::fuse_options()
        };
        let mounted = Mount::in_temp_dir(Arc::new(cluster.client().unwrap()), &options);
        fail::remove("fuser::ring::register");
        let m = mounted.unwrap();
        assert_eq!(
            m.fuse_rings().threads,
            serving,
            "{per_cpu} ring threads per CPU over {cpus} CPUs, registrations failing {fails}: {}",
            m.fuse_rings()
        );
        let before = m.fuse_rings().requests;
        let path = m.path().join(format!("partial-{per_cpu}"));
        File::create(&path).unwrap();
        let f = open_rw(&path);
        let mut calls = 0;
        for cpu in 0..cpus {
            if !run_on(std::iter::once(cpu)) {
                continue;
            }
            for i in 0..20u64 {
                let data = pattern(cpu as u64 * 100 + i, 0, 3 * PAGE + 5);
                f.write_all_at(&data, 0).unwrap();
                let mut back = vec![0u8; data.len()];
                f.read_exact_at(&mut back, 0).unwrap();
                assert!(back == data, "CPU {cpu}, call {i}: read back differently");
                calls += 2;
            }
        }
        run_on(0..cpus);
        let served = m.fuse_rings().requests - before;
        assert!(
            served >= calls,
            "only {served} of {calls} requests came through the rings"
        );
        drop(f);
        m.unmount().unwrap();
    }

    fail::cfg("fuser::ring::register", "return").unwrap();
    let options = fs_client::fuse::FuseOptions {
        ring_threads_per_cpu: 1,
        ..testkit::fuse_options()
    };
    let started = Instant::now();
    let mounted = Mount::in_temp_dir(Arc::new(cluster.client().unwrap()), &options);
    fail::remove("fuser::ring::register");
    let m = mounted.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the mount took {:?}",
        started.elapsed()
    );
    assert_eq!(
        m.fuse_rings().threads,
        0,
        "no ring thread could start, yet the mount reports {}",
        m.fuse_rings()
    );
    let path = m.path().join("over-dev-fuse");
    let data = pattern(7, 0, 5 * PAGE + 3);
    // On a connection left waiting for rings the call would never return: it runs on a
    // thread of its own, and a test that gives up on it drops the mount, whose connection is
    // then aborted, which ends the call.
    let (done, result) = mpsc::channel();
    let (p, d) = (path.clone(), data.clone());
    std::thread::spawn(move || {
        let _ = done.send(std::fs::write(&p, &d).and_then(|()| std::fs::read(&p)));
    });
    let back = result
        .recv_timeout(Duration::from_secs(20))
        .expect("a call on the mount whose rings could not start is held by the kernel")
        .unwrap();
    assert!(back == data, "read back differently");
    assert_eq!(m.fuse_rings().requests, 0);
    m.unmount().unwrap();
}

#[test]
fn requests_over_io_uring_rings_reach_the_file_system_whole() {
    skip_without_fuse!();
    // Declared first, dropped last: the mounts are gone before the parameter is put back.
    let Some(_uring) = UringEnabled::turn_on() else {
        return;
    };
    let cluster = Cluster::start(ClusterSpec {
        data_servers: 2,
        capacity: 96 << 20,
        chunk_size: 64 << 10,
        ..ClusterSpec::default()
    })
    .unwrap();
    let (a, b) = (cluster.mount().unwrap(), cluster.mount().unwrap());
    let per_cpu = testkit::fuse_options().ring_threads_per_cpu;
    for m in [&a, &b] {
        assert_eq!(
            m.fuse_rings().threads,
            per_cpu * possible_cpus(),
            "with {ENABLE_URING} on, every mount serves {per_cpu} ring threads per CPU"
        );
    }
    let bound = usize::try_from(a.atomic_bound().min(b.atomic_bound())).unwrap();
    eprintln!("atomic bound {bound} bytes; rings: {}", a.fuse_rings());
    let before = a.fuse_rings().requests + b.fuse_rings().requests;

    let mut calls = round_trips(&a, &b, bound);
    calls += many_at_once(&a, &b);
    calls += namespace(&a, &b);
    late_answers(&a, &b);
    calls += late_answers_leave_room(&a, &b);
    // The threads that answered late have ended: the rings they answered on must not have
    // lost their entries with them.
    calls += from_every_cpu(&a, &b);
    for m in [&a, &b] {
        assert_eq!(
            m.fuse_rings().threads,
            per_cpu * possible_cpus(),
            "a ring thread stopped serving (its entry ended): see the log above"
        );
    }

    let served = a.fuse_rings().requests + b.fuse_rings().requests - before;
    eprintln!("{calls} calls made, {served} requests served by the rings");
    assert!(
        served >= calls,
        "only {served} of at least {calls} requests came through the rings"
    );
    for m in [a, b] {
        let at = m.path().to_path_buf();
        m.unmount()
            .unwrap_or_else(|e| panic!("unmount {}: {e}", at.display()));
    }
    some_ring_threads_fail_to_start(&cluster);
    cluster.shutdown().unwrap();
}
