//! One smoke test through a real FUSE mount (the full suite lives in the `tests` crate). Skipped,
//! with the reason printed, where /dev/fuse or the rights to mount are missing.
#![cfg(feature = "fuse")]

use fs_client::LockScheme;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::Arc;
use testkit::{pattern, skip_without_fuse, Cluster, ClusterSpec, Mount, TEST_CHUNK_SIZE as CHUNK};

#[test]
fn mount_write_read_stat_unmount() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::default().with_data_servers(2, 64)).unwrap();
    let fs = Arc::new(cluster.connect(LockScheme::CITRON).unwrap());
    // A directory of the test's own, so that it can be checked empty after the unmount.
    let mnt = tempfile::tempdir().unwrap();
    let handle = match Mount::at(fs.clone(), mnt.path(), &testkit::fuse_options()) {
        Ok(h) => h,
        Err(e) => {
            testkit::skip(testkit::Need::Fuse, &format!("mount failed: {e:#}"));
            return;
        }
    };
    let root = mnt.path();

    // Files: write across chunks, read back, size, overwrite in the middle, truncate.
    let data = pattern(5, 0, (2 * CHUNK + 777) as usize);
    std::fs::write(root.join("a.bin"), &data).unwrap();
    assert_eq!(std::fs::read(root.join("a.bin")).unwrap(), data);
    assert_eq!(
        std::fs::metadata(root.join("a.bin")).unwrap().len(),
        data.len() as u64
    );
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(root.join("a.bin"))
        .unwrap();
    f.seek(SeekFrom::Start(CHUNK - 3)).unwrap();
    f.write_all(b"XYZXYZ").unwrap();
    f.seek(SeekFrom::Start(CHUNK - 3)).unwrap();
    let mut six = [0u8; 6];
    f.read_exact(&mut six).unwrap();
    assert_eq!(&six, b"XYZXYZ");
    f.set_len(10).unwrap();
    drop(f);
    assert_eq!(std::fs::read(root.join("a.bin")).unwrap(), &data[..10]);
    // The library (another view of the same cluster) sees what the mount wrote.
    let attr = fs.lookup(fs_client::ROOT_INO, "a.bin").unwrap();
    assert_eq!(attr.size, 10);

    // Namespace: directories, rename, links, permissions, errors with their errno.
    std::fs::create_dir(root.join("d")).unwrap();
    std::fs::rename(root.join("a.bin"), root.join("d/b.bin")).unwrap();
    std::fs::hard_link(root.join("d/b.bin"), root.join("hard")).unwrap();
    std::os::unix::fs::symlink("d/b.bin", root.join("sym")).unwrap();
    assert_eq!(std::fs::read(root.join("sym")).unwrap(), &data[..10]);
    assert_eq!(std::fs::metadata(root.join("hard")).unwrap().nlink(), 2);
    std::fs::set_permissions(root.join("hard"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        std::fs::metadata(root.join("d/b.bin")).unwrap().mode() & 0o777,
        0o600
    );
    let mut names: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["d", "hard", "sym"]);
    let err = std::fs::remove_dir(root.join("d")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTEMPTY));
    let err = std::fs::read(root.join("missing")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    std::fs::remove_file(root.join("d/b.bin")).unwrap();
    std::fs::remove_dir(root.join("d")).unwrap();

    println!("checked through a FUSE mount at {}", root.display());
    handle.unmount().unwrap();
    // Unmounted: the directory is empty again.
    assert_eq!(std::fs::read_dir(mnt.path()).unwrap().count(), 0);
}
