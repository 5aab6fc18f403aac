//! Space in proportion to size (issue 12, part 4), seen through a mount: small files take small
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
