//! Space in proportion to size, seen through a mount: small files take small
//! allocations, `statfs` (`df`) charges a file less than twice its size above 4 KiB, and its
//! inode figures (`df -i`) count one inode per file.

use proto::fsck::FsckOptions;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use testkit::{skip_without_fuse, Cluster, ClusterSpec};

/// `statvfs(2)` of a mounted path.
fn statvfs(path: &Path) -> libc::statvfs {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a NUL-terminated path; `st` is written whole by a successful call.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(c.as_ptr(), &mut st), 0, "statvfs {path:?}");
        st
    }
}

/// Bytes in use as `df` computes them.
fn used_bytes(st: &libc::statvfs) -> u64 {
    (st.f_blocks - st.f_bfree) * st.f_frsize
}

/// A deterministic size in `lo..hi` (a small LCG: the test needs no randomness crate).
fn sizes(n: usize, lo: u64, hi: u64, mut seed: u64) -> Vec<u64> {
    (0..n)
        .map(|_| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (seed >> 33) % (hi - lo)
        })
        .collect()
}

#[test]
fn many_small_files_fit_and_are_charged_under_twice_their_size() {
    skip_without_fuse!();
    // One data server of 4 chunks of 1 MiB: with a whole chunk per file, 4 files fit.
    let cluster = Cluster::start(ClusterSpec::server_defaults().with_data_servers(1, 4)).unwrap();
    let mount = cluster.mount().unwrap();
    let empty = statvfs(mount.path());
    assert_eq!(empty.f_blocks * empty.f_frsize, 4 << 20);
    assert_eq!(empty.f_bfree, empty.f_blocks);
    // 512 files of 4 KiB (half the space).
    let small = 512u64;
    for i in 0..small {
        std::fs::write(mount.path().join(format!("s{i}")), vec![i as u8; 4096])
            .unwrap_or_else(|e| panic!("file {i} of 4 KiB: {e}"));
    }
    let st = statvfs(mount.path());
    assert_eq!(used_bytes(&st), small * 4096, "one 4 KiB block each");
    // Files of 5 to 300 KiB in the rest, until the next would not fit by `df`'s count.
    let mut data = small * 4096;
    let mut stored = 0;
    for (i, size) in sizes(64, 5 << 10, 300 << 10, 7).into_iter().enumerate() {
        let st = statvfs(mount.path());
        if 2 * size > st.f_bfree * st.f_frsize {
            break;
        }
        std::fs::write(
            mount.path().join(format!("m{i}")),
            vec![0xA5; size as usize],
        )
        .unwrap_or_else(|e| panic!("file {i} of {size} bytes: {e}"));
        data += size;
        stored += 1;
    }
    assert!(stored >= 3, "only {stored} files of 5-300 KiB fit");
    let st = statvfs(mount.path());
    let used = used_bytes(&st);
    assert!(
        used >= data && used < 2 * data,
        "{used} bytes charged for {data} bytes of data"
    );
    // Every file reads back.
    for i in 0..small {
        let got = std::fs::read(mount.path().join(format!("s{i}"))).unwrap();
        assert_eq!(got, vec![i as u8; 4096]);
    }
    // Removing the files gives every block back (zeroed, merged), and the books balance.
    for i in 0..small {
        std::fs::remove_file(mount.path().join(format!("s{i}"))).unwrap();
    }
    for i in 0..stored {
        std::fs::remove_file(mount.path().join(format!("m{i}"))).unwrap();
    }
    testkit::wait_until(
        std::time::Duration::from_secs(10),
        "every block to be free again",
        || statvfs(mount.path()).f_bfree == empty.f_blocks,
    );
    let report = cluster
        .fsck(FsckOptions {
            repair: false,
            at_rest: false,
        })
        .unwrap();
    assert!(report.findings.is_empty(), "{:#?}", report.findings);
    // A whole-chunk file fits again: the small blocks merged back.
    std::fs::write(mount.path().join("big"), vec![1u8; 3 << 20]).unwrap();
}

#[test]
fn df_i_counts_one_inode_per_create_and_unlink() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::default().with_data_servers(1, 16)).unwrap();
    let mount = cluster.mount().unwrap();
    let in_use = |st: &libc::statvfs| {
        assert!(
            st.f_files >= st.f_ffree,
            "more free inodes ({}) than inodes ({})",
            st.f_ffree,
            st.f_files
        );
        // Every further file with data takes at least a block.
        assert_eq!(st.f_ffree, st.f_bfree);
        st.f_files - st.f_ffree
    };
    let before = in_use(&statvfs(mount.path()));
    assert_eq!(before, 1, "the root directory");
    for i in 1..=3u64 {
        std::fs::File::create(mount.path().join(format!("f{i}"))).unwrap();
        assert_eq!(in_use(&statvfs(mount.path())), before + i);
    }
    std::fs::create_dir(mount.path().join("d")).unwrap();
    assert_eq!(in_use(&statvfs(mount.path())), before + 4);
    std::fs::remove_file(mount.path().join("f1")).unwrap();
    assert_eq!(in_use(&statvfs(mount.path())), before + 3);
    // A hard link is no new inode.
    std::fs::hard_link(mount.path().join("f2"), mount.path().join("f2b")).unwrap();
    assert_eq!(in_use(&statvfs(mount.path())), before + 3);
}

/// `st_blocks` is what a file's chunks take (what `du` adds up, and what `cp --sparse` looks
/// at to find holes): a sparse file is charged its written chunks only, a dense one its size
/// rounded to its chunks, a punched hole gives its chunks back, and the files' blocks add up
/// to what `df` says is used. Before, `st_blocks` was the size over 512, holes included.
#[test]
fn st_blocks_counts_the_chunks_a_file_holds() {
    use std::os::unix::fs::MetadataExt;
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::server_defaults().with_data_servers(1, 16)).unwrap();
    let mount = cluster.mount().unwrap();
    let mib = 1u64 << 20;
    let charged = |path: &Path| std::fs::metadata(path).unwrap().blocks() * 512;
    // Sparse: 64 MiB long (more than the cluster holds), one 4 KiB write at 32 MiB.
    let sparse = mount.path().join("sparse");
    let f = std::fs::File::create(&sparse).unwrap();
    f.set_len(64 * mib).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[7u8; 4096], 32 * mib).unwrap();
    drop(f);
    assert_eq!(std::fs::metadata(&sparse).unwrap().len(), 64 * mib);
    assert_eq!(charged(&sparse), mib, "one whole chunk");
    // SEEK_DATA and SEEK_HOLE find it (cp, tar --sparse and backup tools skip the holes).
    let f = std::fs::File::open(&sparse).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: a valid descriptor; lseek touches no memory.
    let seek = |at: u64, whence: i32| unsafe { libc::lseek(fd, at as i64, whence) };
    assert_eq!(seek(0, libc::SEEK_DATA), (32 * mib) as i64);
    assert_eq!(seek(32 * mib, libc::SEEK_HOLE), (33 * mib) as i64);
    assert_eq!(seek(0, libc::SEEK_HOLE), 0);
    assert_eq!(seek(33 * mib, libc::SEEK_DATA), -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENXIO)
    );
    drop(f);
    // Dense: 3 MiB (the first MiB in growing chunks, then two whole ones).
    let dense = mount.path().join("dense");
    std::fs::write(&dense, vec![0x5A; 3 * mib as usize]).unwrap();
    assert_eq!(charged(&dense), 3 * mib);
    // A punched hole over [1 MiB, 2 MiB): one chunk back.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&dense)
        .unwrap();
    // SAFETY: a valid descriptor; fallocate touches no memory of ours.
    let r = unsafe {
        libc::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            mib as i64,
            mib as i64,
        )
    };
    assert_eq!(r, 0, "punch: {}", std::io::Error::last_os_error());
    drop(f);
    assert_eq!(charged(&dense), 2 * mib);
    assert_eq!(std::fs::metadata(&dense).unwrap().len(), 3 * mib);
    let small = mount.path().join("small");
    std::fs::write(&small, b"tiny").unwrap();
    assert_eq!(charged(&small), 4096, "the smallest chunk");
    // What the files hold is what the file system has in use.
    assert!(cluster
        .meta()
        .wait_reclaimed(std::time::Duration::from_secs(10)));
    let st = statvfs(mount.path());
    assert_eq!(
        used_bytes(&st),
        charged(&sparse) + charged(&dense) + charged(&small)
    );
}
