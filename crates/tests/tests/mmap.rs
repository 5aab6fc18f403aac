//! Memory mappings of files on a mount (`fs_client::fuse`'s module docs, "Memory mappings"):
//! shared mappings work, the kernel keeps one client's mappings coherent with its `read` and
//! `write` calls, stores reach other clients at `msync`, and a new mapping sees what other
//! clients wrote before it. Two client processes of one cluster, as in `coherence.rs`.
//!
//! Before the mount negotiated `FUSE_DIRECT_IO_ALLOW_MMAP`, every `mmap(MAP_SHARED)` here
//! failed with ENODEV (sqlite's WAL mode failed with "disk I/O error").

use fs_client::LockScheme;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use testkit::ClusterExt;
use testkit::{open_rw, pattern, skip_without_fuse, Cluster, ClusterSpec};

/// The client processes run this test (see `ClusterExt::spawn_mount_process`); run normally it
/// does nothing.
#[test]
fn child_mount() {
    testkit::child_mount_main();
}

const PAGE: usize = 4096;
/// The file: three pages and a partial fourth.
const LEN: usize = 3 * PAGE + 1_000;

/// A shared mapping of a whole file, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes of `file` `MAP_SHARED`, writable when `write`.
    fn shared(file: &File, len: usize, write: bool) -> std::io::Result<Mapping> {
        let prot = if write {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh mapping of an open file; only this struct uses it, and it is unmapped
        // once, on drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped readable at `ptr` for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`; callers map writable before they store.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// `msync(MS_SYNC)`: the dirty pages are written back (through the file system) before it
    /// returns.
    fn sync(&self) {
        // SAFETY: the mapping is live.
        let rc = unsafe { libc::msync(self.ptr.cast(), self.len, libc::MS_SYNC) };
        assert_eq!(rc, 0, "msync: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `shared`, unmapped only here.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn read_at(file: &File, at: usize, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, at as u64).unwrap();
    buf
}

/// Linux before 6.6 has no `FUSE_DIRECT_IO_ALLOW_MMAP`: shared mappings of a direct-I/O mount
/// are refused there, and the mount says so in its log.
fn kernel_allows_shared_mmap() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release.trim().split(['.', '-']);
    let major: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    (major, minor) >= (6, 6)
}

#[test]
fn shared_mappings_work_and_follow_the_coherence_rules() {
    skip_without_fuse!();
    if !kernel_allows_shared_mmap() {
        testkit::skip(
            testkit::Need::Other,
            "this kernel offers no FUSE_DIRECT_IO_ALLOW_MMAP (Linux < 6.6)",
        );
        return;
    }
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let a = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let (pa, pb) = (a.path().join("mapped"), b.path().join("mapped"));

    let original = pattern(1, 0, LEN);
    std::fs::write(&pa, &original).unwrap();
    let fa = open_rw(&pa);

    // A read-only shared mapping shows the file.
    {
        let ro = Mapping::shared(&fa, LEN, false).expect("mmap(PROT_READ, MAP_SHARED)");
        assert_eq!(ro.bytes(), &original[..]);
    }

    let mut map = Mapping::shared(&fa, LEN, true).expect("mmap(PROT_WRITE, MAP_SHARED)");
    assert_eq!(map.bytes(), &original[..]);

    // One client: a store is seen by a read(2) of the same client before any msync ...
    let stored = pattern(2, 0, 300);
    map.bytes_mut()[PAGE + 100..PAGE + 400].copy_from_slice(&stored);
    assert_eq!(read_at(&fa, PAGE + 100, 300), stored, "read after a store");
    // ... and a write(2) is seen by the mapping.
    let written = pattern(3, 0, 500);
    fa.write_all_at(&written, (2 * PAGE + 7) as u64).unwrap();
    assert_eq!(
        &map.bytes()[2 * PAGE + 7..2 * PAGE + 507],
        &written[..],
        "mapping after a write"
    );

    // Another client sees the stores once they are synced (it may see them earlier).
    let more = pattern(4, 0, 64);
    map.bytes_mut()[3 * PAGE + 900..3 * PAGE + 964].copy_from_slice(&more);
    map.sync();
    let mut expected = original.clone();
    expected[PAGE + 100..PAGE + 400].copy_from_slice(&stored);
    expected[2 * PAGE + 7..2 * PAGE + 507].copy_from_slice(&written);
    expected[3 * PAGE + 900..3 * PAGE + 964].copy_from_slice(&more);
    assert_eq!(std::fs::read(&pb).unwrap(), expected, "the other client");
    drop(map);

    // A new mapping sees what another client wrote before it, even over pages this client
    // had cached.
    let fb = open_rw(&pb);
    let theirs = pattern(5, 0, 2 * PAGE);
    fb.write_all_at(&theirs, 10).unwrap();
    expected[10..10 + 2 * PAGE].copy_from_slice(&theirs);
    let map = Mapping::shared(&fa, LEN, true).unwrap();
    assert_eq!(
        map.bytes(),
        &expected[..],
        "a new mapping after the other client's write"
    );
    drop(map);

    // The size did not move, and everything is in the file for a fresh open.
    assert_eq!(std::fs::metadata(&pb).unwrap().len(), LEN as u64);
    assert_eq!(std::fs::read(&pa).unwrap(), expected);
}
