//! The null backend (`fs_client::null::NullFs`) through a real FUSE mount: the same adapter as
//! CitronFS's answers every call the benchmarks make. Skipped, with the reason printed, where
//! /dev/fuse or the rights to mount are missing.
#![cfg(feature = "fuse")]

use fs_client::fuse::{mount, ATOMIC_IO_TARGET};
use fs_client::null::NullFs;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
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
    // What it does not keep, it refuses plainly.
    let err = std::fs::create_dir(root.join("d")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EOPNOTSUPP), "{err}");
    std::fs::remove_file(&path).unwrap();
    assert!(std::fs::read_dir(root).unwrap().next().is_none());
    handle.unmount().unwrap();
}
