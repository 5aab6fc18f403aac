//! One file, one truth: what a call through one mount changed — a file's size, its times and
//! mode, the names in a directory — is what the other mount of the same cluster shows the
//! moment the call has returned, `stat`, `fstat`, `lseek(SEEK_END)`, lookups and listings
//! included, on shm and on tcp. Each mount is its own client process; the test process only
//! makes system calls on the two mount points.
//!
//! Each check first makes the observing mount look (so that its kernel holds the old answer in
//! whatever cache it keeps), then changes the file through the other mount, then looks again.

use fs_client::LockScheme;
use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, SystemTime};
use testkit::{skip_without_fuse, Backend, ChildMount, Cluster, ClusterSpec};

/// The client processes run this test (see `Cluster::spawn_mount_process`); run normally it
/// does nothing.
#[test]
fn child_mount() {
    testkit::child_mount_main();
}

fn two_mounts(fabric: Backend) -> (Cluster, ChildMount, ChildMount) {
    let cluster = Cluster::start(ClusterSpec {
        fabric,
        ..ClusterSpec::default()
    })
    .unwrap();
    let a = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    (cluster, a, b)
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

/// Sizes after truncates and writes, seen through the other mount by path, by handle and by
/// `lseek(SEEK_END)`.
fn sizes(a: &Path, b: &Path) {
    std::fs::write(a.join("s"), vec![7u8; 100_000]).unwrap();
    let mut fb = File::open(b.join("s")).unwrap();
    assert_eq!(size(&b.join("s")), 100_000);
    assert_eq!(fb.metadata().unwrap().len(), 100_000);

    // A truncate through A, the file closed there.
    OpenOptions::new()
        .write(true)
        .open(a.join("s"))
        .unwrap()
        .set_len(0)
        .unwrap();
    assert_eq!(size(&b.join("s")), 0, "stat on B after a truncate on A");
    assert_eq!(
        fb.metadata().unwrap().len(),
        0,
        "fstat on B after a truncate on A"
    );

    // Writes through A, the file kept open there: each new end is seen on B at once.
    let fa = OpenOptions::new().write(true).open(a.join("s")).unwrap();
    let mut end = 0u64;
    for (round, (at, len)) in [(0u64, 5_000usize), (1_000_000, 3), (1_000_003, 70_001)]
        .into_iter()
        .enumerate()
    {
        assert_eq!(size(&b.join("s")), end);
        fa.write_all_at(&vec![round as u8 + 1; len], at).unwrap();
        end = at + len as u64;
        assert_eq!(
            size(&b.join("s")),
            end,
            "stat on B after write {round} on A"
        );
        assert_eq!(
            fb.metadata().unwrap().len(),
            end,
            "fstat on B after write {round} on A"
        );
        assert_eq!(
            fb.seek(SeekFrom::End(0)).unwrap(),
            end,
            "lseek(SEEK_END) on B after write {round} on A"
        );
    }
    // A truncate through A with the file open on both.
    fa.set_len(4_096).unwrap();
    assert_eq!(size(&b.join("s")), 4_096);
    assert_eq!(fb.metadata().unwrap().len(), 4_096);
    assert_eq!(fb.seek(SeekFrom::End(0)).unwrap(), 4_096);
    // And the other way round.
    let fb_w = OpenOptions::new().write(true).open(b.join("s")).unwrap();
    let fa_r = File::open(a.join("s")).unwrap();
    assert_eq!(fa_r.metadata().unwrap().len(), 4_096);
    fb_w.write_all_at(b"tail", 9_000).unwrap();
    assert_eq!(fa_r.metadata().unwrap().len(), 9_004);
    assert_eq!(size(&a.join("s")), 9_004);
}

/// Mode and times set through A, and a write's new mtime, seen on B.
fn modes_and_times(a: &Path, b: &Path) {
    std::fs::write(a.join("t"), b"times").unwrap();
    let fb = File::open(b.join("t")).unwrap();
    assert_eq!(fb.metadata().unwrap().mode() & 0o7777, 0o644);
    std::fs::set_permissions(a.join("t"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        std::fs::metadata(b.join("t")).unwrap().mode() & 0o7777,
        0o600,
        "chmod on A, stat on B"
    );
    assert_eq!(
        fb.metadata().unwrap().mode() & 0o7777,
        0o600,
        "chmod on A, fstat on B"
    );

    let then = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    let times = std::fs::FileTimes::new()
        .set_modified(then)
        .set_accessed(then);
    OpenOptions::new()
        .write(true)
        .open(a.join("t"))
        .unwrap()
        .set_times(times)
        .unwrap();
    assert_eq!(
        std::fs::metadata(b.join("t")).unwrap().modified().unwrap(),
        then,
        "utimensat on A, stat on B"
    );
    assert_eq!(fb.metadata().unwrap().modified().unwrap(), then);
    // A write through A moves mtime past the time set.
    OpenOptions::new()
        .write(true)
        .open(a.join("t"))
        .unwrap()
        .write_all_at(b"T", 0)
        .unwrap();
    let after = std::fs::metadata(b.join("t")).unwrap().modified().unwrap();
    assert!(after > then, "a write on A left mtime at {after:?} on B");
}

/// The names of `dir` as `readdir` lists them.
fn listing(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

fn exists(path: &Path) -> bool {
    match std::fs::symlink_metadata(path) {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => panic!("stat {}: {e}", path.display()),
    }
}

/// Names created, renamed and removed through A, seen (or not) on B by lookup and listing.
fn names(a: &Path, b: &Path) {
    std::fs::create_dir(a.join("d")).unwrap();
    assert!(listing(&b.join("d")).is_empty());
    assert!(!exists(&b.join("d/n")), "B looks n up: not there yet");
    std::fs::write(a.join("d/n"), b"n").unwrap();
    assert!(exists(&b.join("d/n")), "created on A, looked up on B");
    assert_eq!(listing(&b.join("d")), BTreeSet::from(["n".to_string()]));

    std::fs::rename(a.join("d/n"), a.join("d/m")).unwrap();
    assert!(
        !exists(&b.join("d/n")),
        "renamed away on A, still there on B"
    );
    assert!(exists(&b.join("d/m")), "renamed to on A, not there on B");
    assert_eq!(listing(&b.join("d")), BTreeSet::from(["m".to_string()]));

    // A name replaced by a directory of the same name.
    std::fs::remove_file(a.join("d/m")).unwrap();
    assert!(!exists(&b.join("d/m")), "removed on A, still there on B");
    std::fs::create_dir(a.join("d/m")).unwrap();
    assert!(std::fs::metadata(b.join("d/m")).unwrap().is_dir());
    for i in 0..20 {
        std::fs::write(a.join(format!("d/m/{i}")), b"x").unwrap();
    }
    assert_eq!(
        listing(&b.join("d/m")).len(),
        20,
        "entries made on A, listed on B"
    );
    for i in 0..10 {
        std::fs::remove_file(a.join(format!("d/m/{i}"))).unwrap();
    }
    assert_eq!(
        listing(&b.join("d/m")).len(),
        10,
        "entries removed on A, listed on B"
    );
}

/// `O_APPEND` writers on both mounts at once, two per mount: no record lost or overwritten, and
/// the file exactly as long as all of them.
fn appends(a: &Path, b: &Path) {
    const RECORD: usize = 1_000;
    const PER_WRITER: usize = 60;
    std::fs::write(a.join("log"), b"").unwrap();
    std::thread::scope(|s| {
        for (w, dir) in [a, a, b, b].into_iter().enumerate() {
            s.spawn(move || {
                let mut f = OpenOptions::new()
                    .append(true)
                    .open(dir.join("log"))
                    .unwrap();
                for seq in 0..PER_WRITER {
                    let tag = format!("{w}:{seq:04}|");
                    let mut rec = tag.clone().into_bytes();
                    rec.resize(RECORD - 1, b'.');
                    rec.push(b'\n');
                    f.write_all(&rec).unwrap();
                }
            });
        }
    });
    let all = std::fs::read(b.join("log")).unwrap();
    assert_eq!(
        all.len(),
        4 * PER_WRITER * RECORD,
        "appends lost or overwritten"
    );
    assert_eq!(size(&a.join("log")), all.len() as u64);
    let mut seen = BTreeSet::new();
    for (i, rec) in all.chunks(RECORD).enumerate() {
        let text = std::str::from_utf8(rec).unwrap_or_else(|_| panic!("record {i} torn"));
        let tag = text.split('|').next().unwrap();
        assert!(
            text.ends_with('\n') && text[tag.len() + 1..RECORD - 1].bytes().all(|c| c == b'.'),
            "record {i} is not one whole record: {text:?}"
        );
        assert!(seen.insert(tag.to_string()), "record {tag} twice");
    }
    assert_eq!(seen.len(), 4 * PER_WRITER);
}

fn attributes_and_names_across_mounts(fabric: Backend) {
    skip_without_fuse!();
    testkit::init_logging();
    let (_cluster, a, b) = two_mounts(fabric);
    sizes(a.path(), b.path());
    modes_and_times(a.path(), b.path());
    names(a.path(), b.path());
    appends(a.path(), b.path());
}

#[test]
fn attributes_and_names_are_one_truth_across_mounts_on_shm() {
    attributes_and_names_across_mounts(Backend::Shm);
}

#[test]
fn attributes_and_names_are_one_truth_across_mounts_on_tcp() {
    attributes_and_names_across_mounts(Backend::Tcp);
}
