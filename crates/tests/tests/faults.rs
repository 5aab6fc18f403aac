//! Faults through a real mount: a restart of the servers keeps namespace and data, a full data
//! server gives ENOSPC and corrupts nothing, a wrong token is refused with a clear message, and
//! over-long names give ENAMETOOLONG.

use fs_client::{CitronFs, MountOptions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use testkit::{pattern, skip_without_fuse, BackingKind, Cluster, ClusterSpec};

#[test]
fn restart_keeps_namespace_and_data() {
    skip_without_fuse!();
    // Warnings, fuser's included: see `fs-client/tests/null_mount.rs` on the ECONNABORTED this
    // test once failed with.
    testkit::init_logging();
    let mut cluster = Cluster::start(ClusterSpec {
        backing: BackingKind::File,
        ..ClusterSpec::default()
    })
    .unwrap();
    let big = pattern(7, 0, (3 << 20) + 12_345);
    {
        let mnt = cluster.mount().unwrap();
        let root = mnt.path();
        std::fs::create_dir_all(root.join("d/e")).unwrap();
        std::fs::write(root.join("d/e/big"), &big).unwrap();
        // fsync: flush verbs msync the file-backed data servers' regions, then the size is
        // persisted. (That the pages reached the disk is not observable short of a power cut.)
        std::fs::File::options()
            .write(true)
            .open(root.join("d/e/big"))
            .unwrap()
            .sync_all()
            .unwrap();
        std::fs::write(root.join("small"), b"hello").unwrap();
        std::fs::set_permissions(root.join("small"), std::fs::Permissions::from_mode(0o640))
            .unwrap();
        std::fs::hard_link(root.join("small"), root.join("d/hard")).unwrap();
        std::os::unix::fs::symlink("d/e/big", root.join("sym")).unwrap();
        // A file still open (and grown) when the servers stop: its size comes from the FCB.
        let mut open = std::fs::File::create(root.join("open")).unwrap();
        open.write_all(&big[..100_000]).unwrap();
        drop(open);
        mnt.unmount().unwrap();
    }
    cluster.restart().unwrap();
    let mnt = cluster.mount().unwrap();
    let root = mnt.path();
    assert_eq!(std::fs::read(root.join("d/e/big")).unwrap(), big);
    assert_eq!(std::fs::read(root.join("sym")).unwrap(), big);
    assert_eq!(std::fs::read(root.join("open")).unwrap(), &big[..100_000]);
    assert_eq!(std::fs::read(root.join("d/hard")).unwrap(), b"hello");
    let meta = std::fs::metadata(root.join("small")).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o640);
    assert_eq!(meta.nlink(), 2);
    assert_eq!(
        std::fs::read_link(root.join("sym")).unwrap().to_str(),
        Some("d/e/big")
    );
    let mut names: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["d", "open", "small", "sym"]);
    // Still writable after the restart.
    std::fs::write(root.join("d/after"), b"after").unwrap();
    assert_eq!(std::fs::read(root.join("d/after")).unwrap(), b"after");
}

#[test]
fn full_data_server_gives_enospc_and_corrupts_nothing() {
    skip_without_fuse!();
    // One data server of 8 chunks of 64 KiB.
    let cluster = Cluster::start(ClusterSpec {
        data_servers: 1,
        capacity: 8 << 16,
        ..ClusterSpec::default()
    })
    .unwrap();
    let mnt = cluster.mount().unwrap();
    let root = mnt.path();
    let keep = pattern(3, 0, 3 << 16);
    std::fs::write(root.join("keep"), &keep).unwrap();

    let err = std::fs::write(root.join("big"), vec![9u8; 8 << 16]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    // Growing the kept file fails the same way through an open handle.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(root.join("keep"))
        .unwrap();
    let err = f.write_all(&vec![9u8; 8 << 16]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    drop(f);
    // Nothing already written is touched.
    assert_eq!(
        std::fs::metadata(root.join("keep")).unwrap().len(),
        keep.len() as u64
    );
    assert_eq!(std::fs::read(root.join("keep")).unwrap(), keep);
    // Freeing space makes writes succeed again.
    std::fs::remove_file(root.join("big")).unwrap();
    std::fs::write(root.join("small"), b"fits").unwrap();
    assert_eq!(std::fs::read(root.join("small")).unwrap(), b"fits");
    assert_eq!(std::fs::read(root.join("keep")).unwrap(), keep);
}

#[test]
fn wrong_token_is_refused_clearly() {
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let opts = MountOptions::new(
        cluster.meta_addr().to_string(),
        cluster.name(),
        "not-the-token",
    );
    let err = match CitronFs::connect(opts) {
        Ok(_) => panic!("a client with a wrong token was let in"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.to_lowercase().contains("token"),
        "the refusal should say the token is wrong: {err:?}"
    );
    let opts = MountOptions::new(
        cluster.meta_addr().to_string(),
        "other-cluster",
        cluster.token(),
    );
    let err = match CitronFs::connect(opts) {
        Ok(_) => panic!("a client of another cluster was let in"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("other-cluster") || err.to_lowercase().contains("cluster"),
        "the refusal should name the cluster: {err:?}"
    );
}

#[test]
fn names_longer_than_255_bytes_give_enametoolong() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let mnt = cluster.mount().unwrap();
    let root = mnt.path();
    let long = "n".repeat(256);
    let ok = "n".repeat(255);
    let errno = |r: std::io::Result<()>| r.unwrap_err().raw_os_error();
    let enametoolong = Some(libc::ENAMETOOLONG);
    assert_eq!(errno(std::fs::write(root.join(&long), b"x")), enametoolong);
    assert_eq!(errno(std::fs::create_dir(root.join(&long))), enametoolong);
    assert_eq!(
        errno(std::os::unix::fs::symlink("t", root.join(&long))),
        enametoolong
    );
    std::fs::write(root.join(&ok), b"x").unwrap();
    assert_eq!(
        errno(std::fs::rename(root.join(&ok), root.join(&long))),
        enametoolong
    );
    assert_eq!(
        errno(std::fs::hard_link(root.join(&ok), root.join(&long))),
        enametoolong
    );
    assert_eq!(
        errno(std::fs::metadata(root.join(&long)).map(drop)),
        enametoolong
    );
    // 255 bytes is allowed, and nothing of the failures is left behind.
    assert_eq!(std::fs::read(root.join(&ok)).unwrap(), b"x");
    assert_eq!(std::fs::read_dir(root).unwrap().count(), 1);
}

/// An open file whose control block stops carrying its inode number (a bug, a stray write in
/// the meta region) is refused at its next read and write, before any data verb: the write
/// changes nothing, and once the word is right again the file reads as it was. The INO word is
/// read in the verb that reads SIZE for every I/O (before, only once, at open: a damaged FCB
/// after that was written through).
#[test]
fn a_control_block_of_another_inode_is_refused_before_any_data_moves() {
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let fs = cluster.client().unwrap();
    let caller = CitronFs::process_caller();
    let (attr, fh) = fs
        .create(caller, proto::ROOT_INO, "f", 0o644, libc::O_RDWR)
        .unwrap();
    fs.write(fh, 0, b"hello").unwrap();
    let held = cluster
        .meta()
        .damage_fcb_word(attr.ino, proto::fcb::INO, attr.ino + 1000)
        .expect("the file is open");
    assert_eq!(held, attr.ino);
    for (what, result) in [
        ("write", fs.write(fh, 0, b"HELLO").map(drop)),
        ("read", fs.read(fh, 0, 5).map(drop)),
    ] {
        match result {
            Err(fs_client::Error::ForeignFcb { ino, found, .. }) => {
                assert_eq!((ino, found), (attr.ino, attr.ino + 1000), "{what}")
            }
            other => panic!("{what} through another inode's control block: {other:?}"),
        }
    }
    cluster
        .meta()
        .damage_fcb_word(attr.ino, proto::fcb::INO, attr.ino)
        .unwrap();
    assert_eq!(fs.read(fh, 0, 5).unwrap(), b"hello");
    fs.release(fh).unwrap();
}
