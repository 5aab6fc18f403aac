//! The null backend (`fs_client::null::NullFs`) through a real FUSE mount: the same adapter as
//! CitronFS's answers every call the benchmarks make. Skipped, with the reason printed, where
//! /dev/fuse or the rights to mount are missing.
#![cfg(feature = "fuse")]

use fs_client::fuse::{mount, ATOMIC_IO_TARGET};
use fs_client::null::NullFs;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::{mpsc, Arc};
use std::time::Duration;
use testkit::skip_without_fuse;

#[test]
fn the_null_backend_mounts_and_answers() {
    skip_without_fuse!();
    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(
        Arc::new(NullFs::new()),
        mnt.path(),
        &testkit::fuse_options(),
    )
    .unwrap();
    // The same negotiation as a CitronFS mount: one request per call up to the atomic bound.
    let limits = handle.io_limits();
    assert_eq!(u64::from(limits.max_write), ATOMIC_IO_TARGET);
    let root = mnt.path();
    let path = root.join("f.dat");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    // Writes return their length and keep nothing; the size follows them.
    file.write_all_at(&[0x5a; 1 << 20], 0).unwrap();
    file.write_all_at(&[0x5a; 4096], 3 << 20).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), (3 << 20) + 4096);
    // Reads return zeros of the length asked, whole up to the size, short at its end.
    let mut buf = vec![1u8; 1 << 20];
    file.read_exact_at(&mut buf, 1 << 20).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "reads are zeros");
    let mut small = [1u8; 4096];
    assert_eq!(file.read_at(&mut small, (3 << 20) + 2048).unwrap(), 2048);
    assert_eq!(file.read_at(&mut small, 4 << 20).unwrap(), 0);
    // A truncate sets the size.
    file.set_len(10).unwrap();
    assert_eq!(file.metadata().unwrap().len(), 10);
    drop(file);
    let names: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["f.dat"]);
    // Directories, as `bench meta` makes them: files inside, removed when empty.
    let dir = root.join("d");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("g"), b"").unwrap();
    assert_eq!(std::fs::metadata(dir.join("g")).unwrap().len(), 0);
    let err = std::fs::remove_dir(&dir).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTEMPTY), "{err}");
    std::fs::remove_file(dir.join("g")).unwrap();
    std::fs::remove_dir(&dir).unwrap();
    // What it does not keep, it refuses plainly.
    let err = std::os::unix::fs::symlink("f.dat", root.join("s")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EOPNOTSUPP), "{err}");
    std::fs::remove_file(&path).unwrap();
    assert!(std::fs::read_dir(root).unwrap().next().is_none());
    handle.unmount().unwrap();
}

/// Every file is opened with `FOPEN_NOFLUSH`: closes send no FLUSH request (Linux 5.16 and
/// later; nothing is buffered, so a FLUSH would only cost a round trip through the kernel).
#[test]
fn closes_send_no_flush() {
    skip_without_fuse!();
    let mnt = tempfile::tempdir().unwrap();
    let null = Arc::new(NullFs::new());
    let handle = mount(null.clone(), mnt.path(), &testkit::fuse_options()).unwrap();
    let path = mnt.path().join("f");
    for round in 0..5u8 {
        let file = std::fs::File::create(&path).unwrap();
        file.write_all_at(&[round; 512], 0).unwrap();
        drop(file);
        drop(std::fs::File::open(&path).unwrap());
    }
    assert_eq!(null.flush_requests(), 0, "10 closes, no FLUSH");
    handle.unmount().unwrap();
}

/// Many callers at once: requests back up, idle request threads are woken to take them (the
/// vendored fuser's parked threads), and every request is answered. A reply sent through the
/// wrong descriptor would leave its caller waiting forever, so the test's body runs in a thread
/// of its own and the test gives up after two minutes, aborting the connection to free it.
#[test]
fn concurrent_callers_are_all_answered() {
    skip_without_fuse!();
    // Warnings, fuser's included: a fresh-clone CI run once failed here with ECONNABORTED
    // (errno 103) on a pread, as `faults.rs` once did, and nothing said why. The kernel answers
    // so when the descriptor a request was read through is closed before its reply — a
    // request thread of fuser's that ended (an error, a request it could not parse, which it
    // logs) — or when the connection is aborted.
    testkit::init_logging();
    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(
        Arc::new(NullFs::new()),
        mnt.path(),
        &testkit::fuse_options(),
    )
    .unwrap();
    // The connection's number in /sys/fs/fuse/connections is the mount's device minor.
    let dev = std::fs::metadata(mnt.path()).unwrap().dev();
    let minor = (dev & 0xff) | ((dev >> 12) & 0xfff00);
    let path = mnt.path().join("shared.dat");
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.write_all_at(&[1; 4096], (1 << 20) - 4096).unwrap();
        std::thread::scope(|s| {
            for t in 0..12u64 {
                let file = &file;
                s.spawn(move || {
                    let mut buf = [0u8; 4096];
                    for i in 0..1500u64 {
                        let offset = ((i * 7 + t) % 256) * 4096;
                        if i % 2 == 0 {
                            file.read_exact_at(&mut buf, offset).unwrap();
                        } else {
                            file.write_all_at(&buf, offset).unwrap();
                        }
                    }
                });
            }
        });
        // Closed before the unmount below.
        drop(file);
        done.send(()).unwrap();
    });
    if finished.recv_timeout(Duration::from_secs(120)).is_err() {
        let _ = std::fs::write(format!("/sys/fs/fuse/connections/{minor}/abort"), "1");
        panic!("a request through the mount was never answered");
    }
    handle.unmount().unwrap();
}
