//! The FUSE adapter: a thin layer that turns kernel requests into calls of an [`FsBackend`]
//! — [`CitronFs`], the file system, or [`NullFs`], which stores nothing and answers at once and
//! so measures what this adapter, fuser and the kernel cost by themselves. Both are served by
//! the same code here (one generic adapter, the same mount options and negotiation); only the
//! backend differs.
//!
//! - Multi-threaded: fuser runs `threads` event loops, each with its own cloned `/dev/fuse`
//!   descriptor; the library gives each concurrent call its own endpoints and lock handles.
//! - Every open file gets `FOPEN_DIRECT_IO`: no page cache, so every read and write reaches the
//!   library and takes its range lock, and all clients see one coherent file.
//! - ... and `FOPEN_PARALLEL_DIRECT_WRITES`: without it the kernel serializes all direct writes
//!   to one file on the inode lock, which would defeat the range lock on exactly the workload
//!   CitronFS is for (many writers of one shared file). Concurrent writes are safe because each
//!   takes its own range lock; the kernel still serializes writes that extend the file.
//! - ... and `FOPEN_NOFLUSH`: a close(2) sends no FLUSH request (Linux 5.16 and later; older
//!   kernels ignore the flag and send it, answered at once). Nothing is buffered — a write is
//!   complete when it returns — so FLUSH would have nothing to do but cost every close a round
//!   trip through the kernel and a fuser thread; RELEASE still comes after the last close. The
//!   exception: a file opened while its client holds `fcntl` record locks of it (CitronFS keeps
//!   them for the whole cluster, `FUSE_POSIX_LOCKS`), whose closes must give the closing
//!   owner's locks back (POSIX), which only FLUSH tells (`fs-client` `records` has the rules).
//! - Record locks, `fcntl` and `flock` (`FUSE_POSIX_LOCKS`, `FUSE_FLOCK_LOCKS`), kept by the
//!   backend for every client: `F_SETLKW` waits on a thread of its own, and `FUSE_INTERRUPT`
//!   (a signal to the waiting process) ends it with EINTR (see `setlk`).
//! - **Atomic I/O bound** ([`MountHandle::atomic_bound`], 16 MiB where the machine allows
//!   it): a read or write call up to the bound reaches the library as *one* FUSE request, so
//!   it takes one range lock and is atomic against every other read and write of the file on
//!   every client, whatever the alignment of the user's buffer. In direct I/O the kernel cuts a
//!   call into requests of at most `max_write` bytes (reads: `max_read`, unlimited as CitronFS
//!   passes no `max_read=`) and at most `max_pages` pages of the user's buffer; a buffer of
//!   `L` bytes at page offset `o` spans `ceil((o + L) / page)` pages, up to
//!   `ceil((L + page - 1) / page)` — 4097 pages for 16 MiB. So `init` asks for `max_write` =
//!   16 MiB and `max_pages` = 4097 (through the vendored fuser's `KernelConfig::set_max_pages`,
//!   vendor/fuser/CITRONFS.md), and [`mount`] first raises `/proc/sys/fs/fuse/max_pages_limit`
//!   (the kernel grants `min(limit, asked)`, the limit read when the connection is created,
//!   256 by default) when it is lower and the process may write it. The bound obtained is
//!   `min(max_write, (pages - 1) · page + 1)`; a larger call is cut into requests at that many
//!   bytes (or fewer, at page boundaries of the buffer), each atomic by itself.
//! - **Memory mappings.** `MAP_PRIVATE` mappings work on every kernel; `MAP_SHARED` ones where
//!   the kernel offers `FUSE_DIRECT_IO_ALLOW_MMAP` (Linux 6.6 and later, negotiated in
//!   `init`; [`MountHandle::shared_mmap`]), so that programs that map their files — sqlite's
//!   WAL mode, numpy's `memmap`, LMDB, indexes read with `mmap` — run here (without the flag
//!   the kernel refuses with ENODEV). A shared mapping goes through the page cache, not the
//!   range lock, so it is coherent the way NFS is, not the way `read`/`write` are:
//!   - on one client, the kernel keeps it coherent with `read` and `write`: a direct read or
//!     write of a range first writes the range's dirty mapped pages back, and a direct write
//!     drops the cached pages it covers;
//!   - a mapping's stores reach the file when the kernel writes the dirty pages back (`msync`,
//!     `munmap`, `fsync`, or writeback on its own), each page as one FUSE write under its
//!     range lock; only then do other clients see them;
//!   - `mmap` drops the client's cached pages of the file, so a new mapping sees every write
//!     completed on any client before it; an existing mapping does *not* see later writes of
//!     other clients, and pages it dirties are written back whole, over whatever other clients
//!     wrote to the rest of those pages meanwhile. Processes that share a file through
//!     mappings across clients must coordinate (msync and remap) as they would on NFS.
//!
//!   While a file is mapped shared, the kernel also serializes direct writes to it on the
//!   inode lock (parallel direct writes resume when the last such open is released).
//! - **Nothing stale from the kernel's caches.** Attribute and entry replies carry a TTL of
//!   zero by default ([`FuseOptions::attr_ttl`]): every `stat`, `fstat`, `lseek(SEEK_END)` and
//!   path walk reaches the library, which answers from where the truth is (the file control
//!   block's size and time words for a file open anywhere, the one-sided attribute and entry
//!   tables otherwise), so a size, a time, a mode or a name changed through another mount is
//!   seen the moment the call that changed it has returned. Negative entries are never cached
//!   (a lookup that finds nothing is answered ENOENT, not an entry of inode 0), directory
//!   listings are not cached (no `FOPEN_CACHE_DIR`, no `FOPEN_KEEP_CACHE`), and file data goes
//!   around the page cache (`FOPEN_DIRECT_IO`; mappings excepted, below). The price: a path
//!   walk costs one LOOKUP per component and a `stat` one GETATTR, each answered one-sidedly
//!   where the tables hold the answer (docs/ARCHITECTURE.md gives the figures).
//!   A GETATTR, SETATTR, OPEN, OPENDIR or READLINK of an inode
//!   another client removed meanwhile is answered ESTALE (`gone_or_failed`), so that the
//!   kernel looks the name up again instead of failing with ENOENT or opening the removed file.
//! - **Shared by default**: mounted with `allow_other` and `default_permissions`, so every
//!   local user can use the mount and the kernel checks mode bits, ownership and sticky
//!   directories against each caller (EACCES/EPERM come from it); the meta server records each
//!   caller as owner of what it creates (and the group of a set-group-ID directory).
//!   [`FuseOptions::allow_other`] `false` restricts the mount to the mounting user. A non-root
//!   mounter needs `user_allow_other` in /etc/fuse.conf for a shared mount ([`mount`] says so).
//! - **Set-ID bits** are cleared as Linux clears them: on truncate and chown the kernel sends
//!   the new mode itself (CitronFS does not negotiate `FUSE_HANDLE_KILLPRIV(_V2)`); on a direct
//!   write the kernel clears nothing but sets `FUSE_WRITE_KILL_SUIDGID` when the writer lacks
//!   `CAP_FSETID`, and the write clears them first (`CitronFs::write_as`).
//! - Every failure is answered with [`Error::errno`], through one helper that also logs it
//!   (`failed`, `refused`): a failure that is not an ordinary outcome (EIO, ESTALE,
//!   ENOSPC, ...: see `loudness`) at warn, naming the request and the error's whole cause
//!   chain; an ordinary outcome (ENOENT, EEXIST, ...) at debug only, so that an `ls` of missing
//!   files does not flood the log.
//!
//! [`CitronFs`]: crate::CitronFs
//! [`NullFs`]: crate::null::NullFs
//!
//! [`mount`] returns a [`MountHandle`] that unmounts on drop; [`wait_for_signal`] blocks until
//! SIGINT or SIGTERM (or an external unmount), for command-line use.

use crate::backend::FsBackend;
use crate::error::{Chain, Error};
use crate::handles::FileHandle as Fh;
use crate::io::{Fallocate, SeekTo};
use crate::metrics::{FuseMetrics, FuseOp, OpTimer};
use fuser::{
    Config, CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, IoctlFlags, KernelConfig, MountOption, OpenFlags, PollEvents, PollFlags,
    PollNotifier, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLock, ReplyLseek, ReplyOpen,
    ReplyPoll, ReplyStatfs, ReplyWrite, ReplyXattr, Request, SessionACL, TimeOrNow, WriteFlags,
};
use proto::records::{RecordClaim, RecordKind};
use proto::rpc::XattrMode;
use proto::{Attr, Caller, FileKind, FsError, SetAttr, SetTime, Timestamp};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The FUSE device.
pub const FUSE_DEVICE: &str = "/dev/fuse";

/// Whether this machine can mount a FUSE file system through `device` (normally
/// [`FUSE_DEVICE`]): the device must open read-write, and a non-root user needs `fusermount3`
/// (Debian package `fuse3`) on `PATH`. `Err` says why not, for a skip message or an error.
pub fn check_mountable(device: &Path) -> Result<(), String> {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(device)
    {
        return Err(format!("cannot open {} ({e})", device.display()));
    }
    // SAFETY: geteuid has no preconditions and touches no memory.
    let root = unsafe { libc::geteuid() } == 0;
    let on_path = |program: &str| {
        std::env::var_os("PATH").is_some_and(|paths| {
            std::env::split_paths(&paths).any(|dir| dir.join(program).is_file())
        })
    };
    if !root && !on_path("fusermount3") && !on_path("fusermount") {
        return Err("not root and no fusermount3 on PATH (Debian package fuse3)".into());
    }
    Ok(())
}

/// Where fusermount3 reads whether non-root users may mount with `allow_other`.
pub const FUSE_CONF: &str = "/etc/fuse.conf";

/// Whether this process may mount with `allow_other`: root may, another user only when
/// [`FUSE_CONF`] has a `user_allow_other` line. `Err` says why not and what to do.
pub fn other_users_allowed() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } == 0 {
        return Ok(());
    }
    let conf = std::fs::read_to_string(FUSE_CONF).unwrap_or_default();
    if conf
        .lines()
        .any(|line| line.split('#').next().unwrap_or("").trim() == "user_allow_other")
    {
        return Ok(());
    }
    Err(format!(
        "a mount that other users may use (allow_other) needs root or a `user_allow_other` \
         line in {FUSE_CONF}; add it, or mount for yourself only (citronfs: --private)"
    ))
}

/// The size up to which every read and write call should be one FUSE request (and so atomic),
/// for every alignment of the user's buffer: the promise is 16 MiB.
pub const ATOMIC_IO_TARGET: u64 = 16 << 20;

/// The largest `max_write` asked for: [`ATOMIC_IO_TARGET`] (also fuser's own limit, the size
/// its request buffer is made for).
const MAX_WRITE: u32 = ATOMIC_IO_TARGET as u32;

/// Where the kernel's cap on `max_pages` is set (Linux 6.13+; before, a fixed 256).
pub const MAX_PAGES_LIMIT_SYSCTL: &str = "/proc/sys/fs/fuse/max_pages_limit";

/// The kernel's cap on `max_pages` where [`MAX_PAGES_LIMIT_SYSCTL`] does not exist
/// (`FUSE_MAX_MAX_PAGES`).
const OLD_MAX_PAGES_LIMIT: u32 = 256;

/// Pages per request without `FUSE_MAX_PAGES` (`FUSE_DEFAULT_MAX_PAGES_PER_REQ`).
const DEFAULT_MAX_PAGES: u32 = 32;

/// The machine's page size.
fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions and touches no memory.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Pages of the user's buffer one request must be allowed so that a call of `bytes` bytes is one
/// request at every buffer alignment: the worst buffer starts one byte before a page boundary.
pub fn pages_for_atomic(bytes: u64, page: u64) -> u64 {
    (bytes + page - 1).div_ceil(page)
}

/// The largest call that is one request at every buffer alignment, given `max_write` bytes and
/// `pages` pages per request (the inverse of [`pages_for_atomic`], capped by `max_write`).
pub fn atomic_bound_for(max_write: u64, pages: u64, page: u64) -> u64 {
    match pages {
        0 => 0,
        _ => max_write.min((pages - 1) * page + 1),
    }
}

/// What a mount negotiated with the kernel about request sizes, and the atomic I/O bound that
/// follows (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoLimits {
    /// `max_write` granted: the most bytes of one write request.
    pub max_write: u32,
    /// `max_pages` asked for in the INIT reply.
    pub max_pages_asked: u16,
    /// `/proc/sys/fs/fuse/max_pages_limit` when the connection was made (`None`: no such
    /// sysctl, the kernel's fixed 256 applies).
    pub max_pages_limit: Option<u32>,
    /// Whether the kernel offered `FUSE_MAX_PAGES` (without it, 32 pages per request).
    pub max_pages_supported: bool,
    /// Pages of the user's buffer per request the kernel granted.
    pub max_pages: u32,
    /// The page size.
    pub page_size: u64,
    /// The largest read or write call that is one FUSE request — so atomic against every
    /// other read and write — for every alignment of the user's buffer.
    pub atomic_bound: u64,
}

/// What `init` asked for and learnt, read by [`mount`] once the handshake is done.
#[derive(Clone, Copy, Debug, Default)]
struct Negotiated {
    max_write: u32,
    max_pages_asked: u16,
    max_pages_supported: bool,
    shared_mmap: bool,
}

/// Raises `/proc/sys/fs/fuse/max_pages_limit` to `pages` when it is lower and the process may
/// write it. Returns the limit now in force (`None`: no such sysctl).
fn raise_max_pages_limit(pages: u32) -> Option<u32> {
    let read = || -> Option<u32> {
        std::fs::read_to_string(MAX_PAGES_LIMIT_SYSCTL)
            .ok()
            .and_then(|s| s.trim().parse().ok())
    };
    let before = read()?;
    if before >= pages {
        return Some(before);
    }
    match std::fs::write(MAX_PAGES_LIMIT_SYSCTL, format!("{pages}\n")) {
        Ok(()) => {
            let now = read().unwrap_or(before);
            tracing::info!(
                "raised {MAX_PAGES_LIMIT_SYSCTL} from {before} to {now} pages, so that reads \
                 and writes up to {ATOMIC_IO_TARGET} bytes reach CitronFS as one FUSE request"
            );
            Some(now)
        }
        Err(error) => {
            tracing::debug!(%error, "cannot raise {MAX_PAGES_LIMIT_SYSCTL} (needs root)");
            Some(before)
        }
    }
}

/// The flags of every opened file (see the module docs), but `FOPEN_NOFLUSH` only where the
/// backend does not want to hear of closes ([`FuseAdapter::open_flags`]).
const OPEN_FLAGS: FopenFlags = FopenFlags::FOPEN_DIRECT_IO
    .union(FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES)
    .union(FopenFlags::FOPEN_NOFLUSH);

/// How to mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FuseOptions {
    /// Let users other than the mounting one use the mount (`allow_other`, with the kernel
    /// checking permissions); needs `user_allow_other` in /etc/fuse.conf when not root
    /// ([`other_users_allowed`]). On by default; `false` restricts the mount to its owner.
    pub allow_other: bool,
    /// Kernel request threads.
    pub threads: usize,
    /// How long the kernel may cache attributes and entries. Zero by default, so that nothing
    /// another client changed is served stale (see the module docs); a longer TTL trades that
    /// for fewer requests, and is for measurements.
    pub attr_ttl: Duration,
    /// Threads per CPU serving FUSE over io_uring (Linux 6.14 and later, with the fuse
    /// module's `enable_uring` parameter on): the kernel then hands each request to a thread
    /// on the caller's CPU. A CPU's queue serves as many requests at once as it has threads
    /// (8 by default, as many as `threads`: a call that waits for a server away holds one),
    /// and an idle thread costs nothing. 0 keeps `/dev/fuse` only; so does a kernel that
    /// does not offer it (logged). The `threads` above keep serving what io_uring does not
    /// carry (FORGET, INTERRUPT).
    pub ring_threads_per_cpu: usize,
    /// What the mount table shows as the mount's source (`fsname`, the first field of
    /// /proc/mounts, findmnt's SOURCE); `None` shows the file system's name. The mount(8)
    /// helper gives the `HOST:PORT` it mounted, so that `mount -a` sees an fstab line as
    /// mounted. The type is always `fuse.` and the file system's name (`fuse.citronfs`).
    pub source: Option<String>,
    /// Where to count every request (by operation, with its latency and its errno if it
    /// failed) and the bytes read and written ([`crate::metrics::FuseMetrics`]); `None`
    /// (the default) counts nothing.
    pub metrics: Option<FuseMetrics>,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions {
            allow_other: true,
            threads: 8,
            attr_ttl: Duration::ZERO,
            ring_threads_per_cpu: 8,
            source: None,
            metrics: None,
        }
    }
}

/// What [`MountHandle::fuse_rings`] reports; the default is `/dev/fuse` only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FuseRings {
    /// Threads serving FUSE-over-io_uring rings; 0 when requests come over `/dev/fuse` only.
    pub threads: usize,
    /// Requests the rings have taken since the mount.
    pub requests: u64,
}

impl std::fmt::Display for FuseRings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.threads == 0 {
            write!(f, "/dev/fuse")
        } else {
            write!(f, "io_uring ({} threads, per CPU queues)", self.threads)
        }
    }
}

/// A mounted CitronFS; unmounts (and waits for the request threads) on drop or
/// [`MountHandle::unmount`].
pub struct MountHandle {
    session: Option<fuser::BackgroundSession>,
    /// Tells the backend, if it is still there, that the unmount begins
    /// ([`FsBackend::shutting_down`]). Weak: the handle does not keep the backend alive.
    shutting_down: Box<dyn Fn() + Send + Sync>,
    mountpoint: PathBuf,
    limits: IoLimits,
    shared_mmap: bool,
}

impl MountHandle {
    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The largest read or write call, in bytes, that is atomic against every other read and
    /// write of the file on every client, for every alignment of the user's buffer: 16 MiB
    /// ([`ATOMIC_IO_TARGET`]) where the machine allows it. A larger call is cut into requests
    /// of at most this many bytes, each atomic by itself.
    pub fn atomic_bound(&self) -> u64 {
        self.limits.atomic_bound
    }

    /// What the mount negotiated with the kernel about request sizes.
    pub fn io_limits(&self) -> IoLimits {
        self.limits
    }

    /// Whether files of this mount can be mapped `MAP_SHARED` (the kernel offered
    /// `FUSE_DIRECT_IO_ALLOW_MMAP`, Linux 6.6 and later; see the module docs). Without it such
    /// an `mmap(2)` fails with ENODEV; `MAP_PRIVATE` mappings work on every kernel.
    pub fn shared_mmap(&self) -> bool {
        self.shared_mmap
    }

    /// How the kernel's requests reach this process: over FUSE-over-io_uring rings (how many
    /// threads serve them, and how many requests they have taken so far), or over `/dev/fuse`
    /// only (0 threads: not asked for, or not offered by the kernel).
    pub fn fuse_rings(&self) -> FuseRings {
        let (threads, requests) = self.session.as_ref().map_or((0, 0), |s| s.ring_requests());
        FuseRings { threads, requests }
    }

    /// Whether the session has ended (for example unmounted with `fusermount3 -u`).
    pub fn is_finished(&self) -> bool {
        self.session.as_ref().is_none_or(|s| s.guard.is_finished())
    }

    /// Unmounts and waits for the request threads to finish.
    pub fn unmount(mut self) -> std::io::Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> std::io::Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        (self.shutting_down)();
        let ended = session.guard.is_finished();
        match session.umount_and_join() {
            // Unmounted from outside (`fusermount3 -u`, `umount`): the session ended with the
            // kernel's connection, and unmounting again can only fail (EINVAL, or fusermount3
            // finding no such mount). Nothing is left to do.
            // (A table that cannot be read counts as mounted: the error stands.)
            Err(error) if ended && !is_mount_point(&self.mountpoint).unwrap_or(true) => {
                tracing::debug!(%error, mountpoint = %self.mountpoint.display(), "already unmounted");
                Ok(())
            }
            result => result,
        }
    }
}

impl Drop for MountHandle {
    fn drop(&mut self) {
        if let Err(error) = self.unmount_inner() {
            tracing::warn!(%error, mountpoint = %self.mountpoint.display(), "unmount failed");
        }
    }
}

/// Whether `path` is a mount point now: a line of `/proc/self/mountinfo` names it (its fifth
/// field, octal escapes such as `\040` undone). The path is compared with its directory
/// resolved ([`resolve_mount_point`]). Fails only when the table cannot be read; each caller
/// decides what that means. The one reading of the table (the test kit's mounts use it too).
pub fn is_mount_point(path: &Path) -> std::io::Result<bool> {
    let path = resolve_mount_point(path);
    Ok(mounts()?
        .iter()
        .any(|(point, _)| point == path.as_os_str().as_bytes()))
}

/// `path` with its directory resolved (symbolic links, `..`) but not its last component, or
/// as given where that fails. Never a lookup of the mount point itself: that would ask the
/// file system mounted there, which may be dead (ENOTCONN) — or be served by the very process
/// asking, which then waits on itself if its request threads are gone, in an uninterruptible
/// wait no signal ends: a `citronfs mount` killed while it stat'ed its new mount stayed so,
/// in state D, with its mount (a CI run of 2026-11-27).
pub fn resolve_mount_point(path: &Path) -> PathBuf {
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) if !dir.as_os_str().is_empty() => std::fs::canonicalize(dir)
            .map(|d| d.join(name))
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
    }
}

/// The device (`major`, `minor`) of what is mounted at `path` (its directory resolved:
/// [`resolve_mount_point`]), the topmost mount if several; `None` when nothing is. A FUSE
/// mount's minor names its connection in `/sys/fs/fuse/connections`.
pub fn mounted_device(path: &Path) -> std::io::Result<Option<(u32, u32)>> {
    let path = resolve_mount_point(path);
    Ok(mounts()?
        .into_iter()
        .rev()
        .find(|(point, _)| point == path.as_os_str().as_bytes())
        .map(|(_, dev)| dev))
}

/// A line of `/proc/self/mountinfo`: the mount point (unescaped) and the device.
type MountEntry = (Vec<u8>, (u32, u32));

/// Every line of `/proc/self/mountinfo`, in its order (later mounts on top).
fn mounts() -> std::io::Result<Vec<MountEntry>> {
    let table = std::fs::read_to_string("/proc/self/mountinfo")?;
    let unescape = |field: &str| -> Vec<u8> {
        let b = field.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            let octal = b.get(i + 1..i + 4).and_then(|d| {
                std::str::from_utf8(d)
                    .ok()
                    .and_then(|d| u8::from_str_radix(d, 8).ok())
            });
            match (b[i], octal) {
                (b'\\', Some(byte)) => {
                    out.push(byte);
                    i += 4;
                }
                (c, _) => {
                    out.push(c);
                    i += 1;
                }
            }
        }
        out
    };
    Ok(table
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let dev = fields.nth(2)?.split_once(':')?;
            let dev = (dev.0.parse().ok()?, dev.1.parse().ok()?);
            Some((unescape(fields.nth(1)?), dev))
        })
        .collect())
}

/// Mounts `fs` — [`crate::CitronFs`], or [`crate::null::NullFs`] to measure the FUSE path
/// itself — at `mountpoint` and serves it from background threads.
///
/// Before mounting, raises `/proc/sys/fs/fuse/max_pages_limit` if it is too low for the atomic
/// I/O bound of [`ATOMIC_IO_TARGET`] and the process may write it (see the module docs); logs
/// the bound obtained at info, and at warn when it is below [`ATOMIC_IO_TARGET`].
pub fn mount<B: FsBackend>(
    fs: Arc<B>,
    mountpoint: impl AsRef<Path>,
    opts: &FuseOptions,
) -> std::io::Result<MountHandle> {
    let mountpoint = mountpoint.as_ref().to_path_buf();
    if opts.allow_other {
        other_users_allowed().map_err(std::io::Error::other)?;
    }
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(opts.source.clone().unwrap_or_else(|| fs.fs_name().into())),
        MountOption::Subtype(fs.fs_name().into()),
        MountOption::DefaultPermissions,
        MountOption::RW,
        MountOption::NoAtime,
    ];
    config.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(opts.threads.max(1));
    config.clone_fd = true;
    config.uring_threads_per_cpu = opts.ring_threads_per_cpu;
    let page = page_size();
    let pages_asked = pages_for_atomic(ATOMIC_IO_TARGET, page).min(u64::from(u16::MAX)) as u16;
    // The kernel copies the limit into the connection when it is made, at mount(2).
    let limit = raise_max_pages_limit(u32::from(pages_asked));
    let negotiated = Arc::new(Mutex::new(None));
    let backend = Arc::downgrade(&fs);
    let adapter = |rings_asked| FuseAdapter {
        fs: fs.clone(),
        ttl: opts.attr_ttl,
        pages_asked,
        rings_asked,
        negotiated: negotiated.clone(),
        waits: Arc::default(),
        metrics: opts.metrics.clone(),
    };
    // The INIT handshake (and so `init`) is done when spawn_mount returns.
    let session =
        match fuser::spawn_mount(adapter(opts.ring_threads_per_cpu > 0), &mountpoint, &config) {
            // The kernel took FUSE over io_uring but the rings could not start (memory, threads):
            // that session has ended and unmounted. Mounted again without rings, the mount serves
            // over /dev/fuse: slower, not broken.
            Err(e) if fuser::RingStartError::is(&e) => {
                tracing::warn!(
                    mountpoint = %mountpoint.display(),
                    "{e}; mounting again with requests over /dev/fuse"
                );
                config.uring_threads_per_cpu = 0;
                fuser::spawn_mount(adapter(false), &mountpoint, &config)?
            }
            spawned => spawned?,
        };
    let negotiated = negotiated
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or_default();
    let limits = io_limits(negotiated, limit, page);
    log_limits(&limits, &mountpoint);
    if !negotiated.shared_mmap {
        tracing::warn!(
            mountpoint = %mountpoint.display(),
            "this kernel does not offer FUSE_DIRECT_IO_ALLOW_MMAP (Linux 6.6 and later): \
             mmap(MAP_SHARED) of a file here fails with ENODEV (sqlite's WAL mode, for one, \
             cannot work); MAP_PRIVATE mappings work"
        );
    }
    Ok(MountHandle {
        session: Some(session),
        shutting_down: Box::new(move || {
            if let Some(fs) = backend.upgrade() {
                fs.shutting_down();
            }
        }),
        mountpoint,
        limits,
        shared_mmap: negotiated.shared_mmap,
    })
}

/// What the kernel grants for what `init` asked, under the limit `limit` (as `process_init_reply`
/// in fs/fuse/inode.c does).
fn io_limits(n: Negotiated, limit: Option<u32>, page: u64) -> IoLimits {
    let max_pages = if n.max_pages_supported {
        limit
            .unwrap_or(OLD_MAX_PAGES_LIMIT)
            .min(u32::from(n.max_pages_asked.max(1)))
    } else {
        DEFAULT_MAX_PAGES
    };
    // The kernel raises a max_write below one page to one page.
    let max_write = n.max_write.max(4096);
    IoLimits {
        max_write,
        max_pages_asked: n.max_pages_asked,
        max_pages_limit: limit,
        max_pages_supported: n.max_pages_supported,
        max_pages,
        page_size: page,
        atomic_bound: atomic_bound_for(u64::from(max_write), u64::from(max_pages), page),
    }
}

fn log_limits(l: &IoLimits, mountpoint: &Path) {
    tracing::info!(
        mountpoint = %mountpoint.display(),
        max_write = l.max_write,
        max_pages = l.max_pages,
        "atomic I/O bound: {} bytes for any buffer alignment",
        l.atomic_bound
    );
    if l.atomic_bound < ATOMIC_IO_TARGET {
        let why = if !l.max_pages_supported {
            "the kernel does not offer FUSE_MAX_PAGES".to_string()
        } else {
            match l.max_pages_limit {
                None => format!(
                    "this kernel has no {MAX_PAGES_LIMIT_SYSCTL} and caps a request at \
                     {OLD_MAX_PAGES_LIMIT} pages"
                ),
                Some(limit) => format!(
                    "{MAX_PAGES_LIMIT_SYSCTL} is {limit} and this process cannot raise it to {} \
                     (that needs root and a writable /proc/sys; or set it to {} beforehand)",
                    l.max_pages_asked, l.max_pages_asked
                ),
            }
        };
        tracing::warn!(
            mountpoint = %mountpoint.display(),
            "reads and writes are atomic only up to {} bytes for any buffer alignment, not \
             {ATOMIC_IO_TARGET}: {why}; a larger call is cut into FUSE requests of at most {} \
             bytes, each atomic by itself",
            l.atomic_bound,
            l.atomic_bound
        );
    }
}

/// Blocks until `stop` is set or the mount ends by itself, then unmounts. `stop` is the flag
/// of a SIGINT and SIGTERM handler that the caller registered before it mounted: one
/// registered only here would leave a window in which the signal's default action kills the
/// process, and its mount stays behind, dead. A second signal while unmounting is ignored.
pub fn wait_for_signal(handle: MountHandle, stop: &AtomicBool) -> std::io::Result<()> {
    while !stop.load(Ordering::Relaxed) && !handle.is_finished() {
        std::thread::sleep(Duration::from_millis(100));
    }
    handle.unmount()
}

/// The adapter fuser calls: the same code for every backend (see the module docs).
struct FuseAdapter<B> {
    fs: Arc<B>,
    ttl: Duration,
    /// `max_pages` to ask for (see the module docs).
    pages_asked: u16,
    /// Whether the mount asked for FUSE over io_uring ([`FuseOptions::ring_threads_per_cpu`]).
    rings_asked: bool,
    /// What `init` asked for, for [`mount`].
    negotiated: Arc<Mutex<Option<Negotiated>>>,
    /// The `F_SETLKW` waits in progress, by the kernel's request id: an interrupt of one
    /// (its caller got a signal) sets its flag, and the wait ends with EINTR.
    waits: Arc<Mutex<HashMap<u64, Arc<AtomicBool>>>>,
    /// Where requests are counted ([`FuseOptions::metrics`]).
    metrics: Option<FuseMetrics>,
}

thread_local! {
    /// The errno the request being answered on this thread got (0: none yet), set where
    /// every error reply is logged ([`log_reply`]) and read when the request's [`Timing`]
    /// ends. A request is answered on the thread it arrived on, but for the record-lock waits
    /// answered from threads of their own, whose errors are not counted.
    static ANSWERED_ERRNO: std::cell::Cell<i32> = const { std::cell::Cell::new(0) };
}

/// One request being answered, counted with its latency and errno when dropped (nothing
/// without metrics).
struct Timing<'m>(Option<OpTimer<'m>>);

impl Drop for Timing<'_> {
    fn drop(&mut self) {
        let errno = ANSWERED_ERRNO.with(|e| e.replace(0));
        if let Some(t) = &mut self.0 {
            t.fail(errno);
        }
    }
}

/// The `F_SETLKW` waits in progress ([`FuseAdapter::waits`]), locked.
/// [`failed`] for a call that names an inode the kernel found through a cached name (GETATTR,
/// SETATTR, OPEN, OPENDIR, READLINK): an inode that no longer exists (`NotFound`), or has no name left and is not
/// open here (the library's `Stale`), is ESTALE, as on NFS — another client removed the file
/// within the entry TTL — and the kernel then looks the name up again (`LOOKUP_REVAL`) and acts
/// on what it names now: ENOENT if nothing, the new file if it was replaced, a new file for an
/// `O_CREAT` open. An ordinary race between clients, logged quietly.
fn gone_or_failed(req: &Req<'_>, err: &Error) -> Errno {
    match err {
        Error::Fs(proto::FsError::NotFound | proto::FsError::Stale) => {
            tracing::debug!(
                op = req.op,
                ino = req.ino,
                request = %req,
                error = %Chain(err),
                "the inode has no name any more: ESTALE, and the kernel looks the name up again"
            );
            ANSWERED_ERRNO.with(|e| e.set(libc::ESTALE));
            Errno::from_i32(libc::ESTALE)
        }
        _ => failed(req, err),
    }
}

/// Whether `e` is the meta server's grace after a restart, which a record-lock call waits out.
fn in_grace(e: &Error) -> bool {
    matches!(e, Error::Fs(proto::FsError::InGrace))
}

/// Runs `work` — a wait that could hold a request thread for long, and the reply at its end —
/// on a thread of its own; whether the thread started. If it did not, `work` (and the reply it
/// owns) is dropped unsent, which answers EIO (fuser's `ReplyRaw` does so on drop).
fn on_own_thread(name: &str, work: impl FnOnce() + Send + 'static) -> bool {
    match std::thread::Builder::new().name(name.into()).spawn(work) {
        Ok(_) => true,
        Err(error) => {
            tracing::warn!(%error, thread = name, "cannot start a thread to wait on");
            false
        }
    }
}

fn waits_of(
    waits: &Mutex<HashMap<u64, Arc<AtomicBool>>>,
) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<AtomicBool>>> {
    waits.lock().unwrap_or_else(|e| e.into_inner())
}

fn errno(e: &Error) -> Errno {
    Errno::from_i32(e.errno())
}

/// A kernel request, as the log names it when its reply is an error.
#[derive(Clone, Copy, Debug)]
struct Req<'a> {
    /// The operation (fuser's method name).
    op: &'static str,
    /// The inode; for an operation on a name, the directory.
    ino: u64,
    /// The name operated on.
    name: Option<&'a OsStr>,
    /// The file handle.
    fh: Option<u64>,
    /// Offset and length of a read or write.
    range: Option<(u64, u64)>,
}

impl<'a> Req<'a> {
    fn ino(op: &'static str, ino: INodeNo) -> Req<'a> {
        Req {
            op,
            ino: ino.0,
            name: None,
            fh: None,
            range: None,
        }
    }

    fn name(op: &'static str, parent: INodeNo, name: &'a OsStr) -> Req<'a> {
        Req {
            name: Some(name),
            ..Req::ino(op, parent)
        }
    }

    fn fh(op: &'static str, ino: INodeNo, fh: FileHandle) -> Req<'a> {
        Req {
            fh: Some(fh.0),
            ..Req::ino(op, ino)
        }
    }

    fn io(op: &'static str, ino: INodeNo, fh: FileHandle, offset: u64, len: u64) -> Req<'a> {
        Req {
            range: Some((offset, len)),
            ..Req::fh(op, ino, fh)
        }
    }
}

impl fmt::Display for Req<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ino {}", self.op, self.ino)?;
        if let Some(name) = self.name {
            write!(f, " name {:?}", name.to_string_lossy())?;
        }
        if let Some(fh) = self.fh {
            write!(f, " fh {fh}")?;
        }
        if let Some((offset, len)) = self.range {
            write!(f, " {len} bytes at {offset}")?;
        }
        Ok(())
    }
}

/// How a failed reply is logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loudness {
    /// An ordinary outcome the caller asked for and expects to handle (a missing name, an
    /// existing one, a permission check): debug only.
    Quiet,
    /// Something went wrong that an operator must be able to trace (EIO, EPROTO, ENOTCONN,
    /// ETIMEDOUT, ENOSPC, ESTALE, ...): warn, with the cause chain.
    Loud,
}

/// Which failures are ordinary outcomes. Every errno not listed is loud, so that an
/// unexpected errno is never silent.
fn loudness(errno: i32) -> Loudness {
    match errno {
        libc::ENOENT
        | libc::EEXIST
        | libc::ENOTEMPTY
        | libc::ENOTDIR
        | libc::EISDIR
        | libc::EACCES
        | libc::EPERM
        | libc::ENAMETOOLONG
        | libc::EINVAL
        | libc::ENODATA
        | libc::ERANGE
        | libc::EOPNOTSUPP
        | libc::ENOTTY
        | libc::ENOSYS
        // A record lock held by someone else (F_SETLK), a wait ended by a signal.
        | libc::EAGAIN
        | libc::EINTR => Loudness::Quiet,
        _ => Loudness::Loud,
    }
}

/// The errno answering `req`'s failure `err`, logged as [`loudness`] says. Every reply of a
/// library error goes through here.
fn failed(req: &Req<'_>, err: &Error) -> Errno {
    log_reply(req, err.errno(), Some(err));
    errno(err)
}

/// The errno `errno` the adapter answers `req` with by itself (no library call failed),
/// logged like [`failed`].
fn refused(req: &Req<'_>, errno: i32) -> Errno {
    log_reply(req, errno, None);
    Errno::from_i32(errno)
}

fn log_reply(req: &Req<'_>, errno: i32, cause: Option<&Error>) {
    ANSWERED_ERRNO.with(|e| e.set(errno));
    // Field values are formatted only when the level is enabled: a quiet reply costs nothing
    // at the default level.
    let reply = std::io::Error::from_raw_os_error(errno);
    match (loudness(errno), cause) {
        (Loudness::Loud, Some(err)) => tracing::warn!(
            op = req.op,
            ino = req.ino,
            request = %req,
            %reply,
            error = %Chain(err),
            "request failed"
        ),
        (Loudness::Loud, None) => {
            tracing::warn!(op = req.op, ino = req.ino, request = %req, %reply, "request failed")
        }
        (Loudness::Quiet, Some(err)) => tracing::debug!(
            op = req.op,
            ino = req.ino,
            request = %req,
            %reply,
            error = %Chain(err),
            "request answered with an error"
        ),
        (Loudness::Quiet, None) => tracing::debug!(
            op = req.op,
            ino = req.ino,
            request = %req,
            %reply,
            "request answered with an error"
        ),
    }
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
    }
}

fn name_str(name: &OsStr) -> Result<&str, Error> {
    std::str::from_utf8(name.as_bytes())
        .map_err(|_| FsError::Invalid("file names must be UTF-8".into()).into())
}

fn system_time(t: Timestamp) -> SystemTime {
    if t.secs >= 0 {
        UNIX_EPOCH + Duration::new(t.secs as u64, t.nanos)
    } else {
        UNIX_EPOCH - Duration::from_secs(t.secs.unsigned_abs())
            + Duration::from_nanos(t.nanos.into())
    }
}

fn timestamp(t: SystemTime) -> Timestamp {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timestamp {
            secs: d.as_secs() as i64,
            nanos: d.subsec_nanos(),
        },
        Err(e) => {
            let d = e.duration();
            let (mut secs, mut nanos) = (-(d.as_secs() as i64), d.subsec_nanos());
            if nanos > 0 {
                secs -= 1;
                nanos = 1_000_000_000 - nanos;
            }
            Timestamp { secs, nanos }
        }
    }
}

fn set_time(t: TimeOrNow) -> SetTime {
    match t {
        TimeOrNow::Now => SetTime::Now,
        TimeOrNow::SpecificTime(t) => SetTime::At(timestamp(t)),
    }
}

fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::File => FileType::RegularFile,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
        FileKind::Socket => FileType::Socket,
    }
}

fn file_attr(a: &Attr, blksize: u64) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        // The memory the file's chunks take, as `du` and `cp --sparse` expect (holes take none).
        blocks: a.allocated.div_ceil(512),
        atime: system_time(a.atime),
        mtime: system_time(a.mtime),
        ctime: system_time(a.ctime),
        crtime: system_time(a.crtime),
        kind: file_type(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: blksize.min(u32::MAX as u64) as u32,
        flags: 0,
    }
}

impl<B: FsBackend> FuseAdapter<B> {
    /// Starts timing a request of `op` ([`FuseOptions::metrics`]).
    fn op(&self, op: FuseOp) -> Timing<'_> {
        ANSWERED_ERRNO.with(|e| e.set(0));
        Timing(self.metrics.as_ref().map(|m| m.start(op)))
    }

    fn blksize(&self) -> u64 {
        self.fs.blksize()
    }

    fn entry(&self, req: Req<'_>, reply: ReplyEntry, result: Result<Attr, Error>) {
        match result {
            Ok(attr) => reply.entry(&self.ttl, &file_attr(&attr, self.blksize()), Generation(0)),
            Err(e) => reply.error(failed(&req, &e)),
        }
    }

    fn empty(req: Req<'_>, reply: ReplyEmpty, result: Result<(), Error>) {
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(failed(&req, &e)),
        }
    }

    /// The flags file `ino` gets, opened now: without `FOPEN_NOFLUSH` where the backend wants
    /// to hear of its closes ([`FsBackend::wants_flush`]: POSIX gives a process's record locks
    /// back at each close, and FLUSH is the request that says which owner closed; the kernel
    /// sends no unlock of its own for remote locks).
    fn open_flags(&self, ino: u64) -> FopenFlags {
        if self.fs.wants_flush(ino) {
            OPEN_FLAGS.difference(FopenFlags::FOPEN_NOFLUSH)
        } else {
            OPEN_FLAGS
        }
    }
}

impl<B: FsBackend> Filesystem for FuseAdapter<B> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Reads and writes up to the atomic bound reach the library whole: one request, one
        // range lock (see the module docs). fuser refuses more than its buffer holds.
        let max_write = match config.set_max_write(MAX_WRITE) {
            Ok(_) => MAX_WRITE,
            Err(nearest) => {
                let _ = config.set_max_write(nearest);
                nearest
            }
        };
        let max_pages_supported = config
            .capabilities()
            .contains(fuser::InitFlags::FUSE_MAX_PAGES);
        let _ = config.set_max_pages(self.pages_asked);
        // `ls -l` lists a directory with its attributes in one request per batch of entries
        // (`readdirplus`); AUTO lets the kernel use it only where stats follow a listing.
        // Kernels without it keep plain `readdir`.
        let _ = config.add_capabilities(
            fuser::InitFlags::FUSE_DO_READDIRPLUS | fuser::InitFlags::FUSE_READDIRPLUS_AUTO,
        );
        // Shared mappings of direct-I/O files (see the module docs); refused by kernels
        // before 6.6, where such an mmap fails with ENODEV.
        let shared_mmap = config
            .add_capabilities(fuser::InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP)
            .is_ok();
        // fcntl record locks kept by the backend for every client, not by this kernel alone;
        // and flock locks as record locks of the whole file, owned by the open file (as NFS
        // does), given back at its release (`records`).
        if self.fs.record_locks() {
            for (flag, what) in [
                (fuser::InitFlags::FUSE_POSIX_LOCKS, "fcntl record locks"),
                (fuser::InitFlags::FUSE_FLOCK_LOCKS, "flock locks"),
            ] {
                if config.add_capabilities(flag).is_err() {
                    tracing::warn!(
                        ?flag,
                        "the kernel does not offer it: {what} stay per client"
                    );
                }
            }
        }
        // FUSE over io_uring is asked for by fuser (`Config::uring_threads_per_cpu`); say
        // why it will not be used when the kernel does not offer it.
        if self.rings_asked
            && !config
                .capabilities()
                .contains(fuser::InitFlags::FUSE_OVER_IO_URING)
        {
            tracing::info!(
                "this kernel does not offer FUSE over io_uring (Linux 6.14 and later, with \
                 /sys/module/fuse/parameters/enable_uring set to Y): requests come over /dev/fuse"
            );
        }
        *self.negotiated.lock().unwrap_or_else(|e| e.into_inner()) = Some(Negotiated {
            max_write,
            max_pages_asked: self.pages_asked,
            max_pages_supported,
            shared_mmap,
        });
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _op = self.op(FuseOp::Lookup);
        let result = name_str(name).and_then(|n| self.fs.lookup(parent.0, n));
        self.entry(Req::name("lookup", parent, name), reply, result)
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _op = self.op(FuseOp::Getattr);
        match self.fs.getattr(ino.0) {
            Ok(attr) => reply.attr(&self.ttl, &file_attr(&attr, self.blksize())),
            Err(e) => reply.error(gone_or_failed(&Req::ino("getattr", ino), &e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _op = self.op(FuseOp::Setattr);
        let set = SetAttr {
            perm: mode.map(|m| (m & 0o7777) as u16),
            uid,
            gid,
            size,
            atime: atime.map(set_time),
            mtime: mtime.map(set_time),
            // Without FUSE_HANDLE_KILLPRIV the kernel clears set-ID bits on truncate and chown
            // itself, sending the new mode along (with the caller's credentials: the meta
            // server lets anyone clear set-ID bits).
            kill_suidgid: false,
        };
        match self.fs.setattr(caller(req), ino.0, set) {
            Ok(attr) => reply.attr(&self.ttl, &file_attr(&attr, self.blksize())),
            Err(e) => reply.error(gone_or_failed(&Req::ino("setattr", ino), &e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let _op = self.op(FuseOp::Readlink);
        match self.fs.readlink(ino.0) {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(gone_or_failed(&Req::ino("readlink", ino), &e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let _op = self.op(FuseOp::Mknod);
        let result = name_str(name).and_then(|n| {
            let kind = FileKind::from_mode(mode)
                .ok_or_else(|| FsError::Invalid(format!("mode {mode:o} has no file type")))?;
            let perm = (mode & !umask & 0o7777) as u16;
            self.fs.mknod(caller(req), parent.0, n, kind, perm, rdev)
        });
        self.entry(Req::name("mknod", parent, name), reply, result)
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let _op = self.op(FuseOp::Mkdir);
        let perm = (mode & !umask & 0o7777) as u16;
        let result = name_str(name).and_then(|n| self.fs.mkdir(caller(req), parent.0, n, perm));
        self.entry(Req::name("mkdir", parent, name), reply, result)
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _op = self.op(FuseOp::Unlink);
        Self::empty(
            Req::name("unlink", parent, name),
            reply,
            name_str(name).and_then(|n| self.fs.unlink(parent.0, n)),
        )
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _op = self.op(FuseOp::Rmdir);
        Self::empty(
            Req::name("rmdir", parent, name),
            reply,
            name_str(name).and_then(|n| self.fs.rmdir(parent.0, n)),
        )
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let _op = self.op(FuseOp::Symlink);
        let result = name_str(link_name).and_then(|n| {
            let target = name_str(target.as_os_str())?;
            self.fs.symlink(caller(req), parent.0, n, target)
        });
        self.entry(Req::name("symlink", parent, link_name), reply, result)
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _op = self.op(FuseOp::Rename);
        let no_replace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
        let known = RenameFlags::RENAME_NOREPLACE | RenameFlags::RENAME_EXCHANGE;
        if !(flags - known).is_empty() {
            // RENAME_WHITEOUT is for overlay file systems; CitronFS has no whiteouts.
            return reply.error(refused(&Req::name("rename", parent, name), libc::EINVAL));
        }
        let result = name_str(name).and_then(|n| {
            let nn = name_str(newname)?;
            if exchange {
                // The kernel refuses RENAME_EXCHANGE together with RENAME_NOREPLACE.
                self.fs.exchange(parent.0, n, newparent.0, nn)
            } else {
                self.fs.rename(parent.0, n, newparent.0, nn, no_replace)
            }
        });
        Self::empty(Req::name("rename", parent, name), reply, result)
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let _op = self.op(FuseOp::Link);
        let result = name_str(newname).and_then(|n| self.fs.link(ino.0, newparent.0, n));
        self.entry(Req::name("link", newparent, newname), reply, result)
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _op = self.op(FuseOp::Open);
        match self.fs.open(caller(req), ino.0, flags.0) {
            Ok(fh) => reply.opened(FileHandle(fh.0), self.open_flags(ino.0)),
            Err(e) => reply.error(gone_or_failed(&Req::ino("open", ino), &e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        lock_owner: Option<fuser::LockOwner>,
        mut reply: ReplyData,
    ) {
        let _op = self.op(FuseOp::Read);
        // Direct I/O names the reading process's lock owner: one that lost a record lock of
        // the file reads nothing more of it until it unlocks or closes it.
        let owner_ok = |o: fuser::LockOwner| self.fs.check_record_locks(Fh(fh.0), o.0);
        let fail = |e| failed(&Req::io("read", ino, fh, offset, size.into()), &e);
        if let Err(e) = lock_owner.map_or(Ok(()), owner_ok) {
            return reply.error(fail(e));
        }
        // Over FUSE's io_uring the answer's bytes are read straight into the buffer the
        // kernel copies them from; over /dev/fuse they are read into a buffer of ours and
        // written to the device.
        let len = size as usize;
        if let Some(buf) = reply.buffer().filter(|buf| buf.len() >= len) {
            return match self.fs.read_in_place(Fh(fh.0), offset, len, buf) {
                Ok(n) => {
                    if let Some(m) = &self.metrics {
                        m.read_bytes(n);
                    }
                    reply.data_in_place(n)
                }
                Err(e) => reply.error(fail(e)),
            };
        }
        match self.fs.read(Fh(fh.0), offset, len) {
            Ok(data) => {
                if let Some(m) = &self.metrics {
                    m.read_bytes(data.as_ref().len());
                }
                reply.data(data.as_ref())
            }
            Err(e) => reply.error(fail(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        lock_owner: Option<fuser::LockOwner>,
        reply: ReplyWrite,
    ) {
        let _op = self.op(FuseOp::Write);
        // Direct I/O: the kernel clears no set-ID bits itself; it flags every write by a
        // caller without CAP_FSETID, whatever was negotiated (see the module docs).
        let kill = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        // As for a read: an owner that lost a record lock of the file writes nothing to it.
        let owner_ok = |o: fuser::LockOwner| self.fs.check_record_locks(Fh(fh.0), o.0);
        match lock_owner
            .map_or(Ok(()), owner_ok)
            .and_then(|()| self.fs.write_as(Fh(fh.0), offset, data, kill))
        {
            Ok(n) => {
                if let Some(m) = &self.metrics {
                    m.written_bytes(n);
                }
                reply.written(n as u32)
            }
            Err(e) => {
                let req = Req::io("write", ino, fh, offset, data.len() as u64);
                reply.error(failed(&req, &e))
            }
        }
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let _op = self.op(FuseOp::Fallocate);
        let r = Req::io("fallocate", ino, fh, offset, length);
        let Some(how) = Fallocate::from_mode(mode) else {
            return reply.error(refused(&r, libc::EOPNOTSUPP));
        };
        // Clear set-ID bits as a write does (Linux's file systems do, through file_modified),
        // for a caller other than root: the request carries no capability.
        let kill = req.uid() != 0;
        Self::empty(
            r,
            reply,
            self.fs.fallocate(Fh(fh.0), offset, length, how, kill),
        )
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        let _op = self.op(FuseOp::Flush);
        // Every close where the backend keeps record locks; else only where the kernel
        // ignores FOPEN_NOFLUSH (see the module docs). The closing owner's locks go (POSIX).
        let result = self
            .fs
            .flush(Fh(fh.0))
            .and_then(|()| self.fs.release_records(Fh(fh.0), lock_owner.0));
        Self::empty(Req::fh("flush", ino, fh), reply, result)
    }

    fn getlk(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: fuser::LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        _pid: u32,
        reply: ReplyLock,
    ) {
        let _op = self.op(FuseOp::Getlk);
        let r = Req::fh("getlk", ino, fh);
        let kind = match RecordKind::from_fcntl(typ) {
            Ok(Some(kind)) => kind,
            Ok(None) => return reply.error(refused(&r, libc::EINVAL)),
            Err(e) => return reply.error(failed(&r, &e.into())),
        };
        let answer =
            move |reply: ReplyLock, result: Result<Option<proto::records::RecordLock>, Error>| {
                match result {
                    Ok(Some(held)) => {
                        reply.locked(held.start, held.end, held.kind.fcntl(), held.pid)
                    }
                    // Nothing in the way: the range asked, unlocked.
                    Ok(None) => reply.locked(start, end, libc::F_UNLCK, 0),
                    Err(e) => reply.error(failed(&Req::fh("getlk", ino, fh), &e)),
                }
            };
        let (handle, owner) = (Fh(fh.0), lock_owner.0);
        match self.fs.try_getlk(handle, owner, start, end, kind) {
            // The grace after a meta restart (up to seconds): waited out on a thread of its
            // own, not a request thread.
            Err(e) if in_grace(&e) => {
                let backend = self.fs.clone();
                on_own_thread("citronfs-getlk", move || {
                    answer(reply, backend.getlk(handle, owner, start, end, kind))
                });
            }
            result => answer(reply, result),
        }
    }

    /// `F_SETLK` at once; `F_SETLKW` first tried at once too, and when it must wait, waited for
    /// on a thread of its own, so that no request thread is held: the reply is sent from
    /// there, and an interrupt of the request (a signal to the waiting process) ends the wait
    /// with EINTR.
    fn setlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: fuser::LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        let _op = self.op(FuseOp::Setlk);
        let r = Req::fh("setlk", ino, fh);
        let kind = match RecordKind::from_fcntl(typ) {
            Ok(kind) => kind,
            Err(e) => return reply.error(failed(&r, &e.into())),
        };
        let claim = RecordClaim {
            owner: lock_owner.0,
            start,
            end,
            kind,
            pid,
        };
        let handle = Fh(fh.0);
        if !sleep {
            return match self.fs.try_setlk(handle, claim) {
                // The grace after a meta restart: waited out off the request threads.
                Err(e) if in_grace(&e) => {
                    let backend = self.fs.clone();
                    on_own_thread("citronfs-setlk", move || {
                        let result = backend.setlk(handle, claim, None);
                        Self::empty(Req::fh("setlk", ino, fh), reply, result)
                    });
                }
                result => Self::empty(r, reply, result),
            };
        }
        // Registered before the first try, so that an interrupt arriving meanwhile is kept.
        let unique = req.unique().0;
        let stop = Arc::new(AtomicBool::new(false));
        waits_of(&self.waits).insert(unique, stop.clone());
        match self.fs.try_setlk(handle, claim) {
            // A lock in the way, or the grace after a meta restart.
            Err(e) if e.errno() == libc::EAGAIN => {}
            result => {
                waits_of(&self.waits).remove(&unique);
                return Self::empty(r, reply, result);
            }
        }
        let (backend, waits) = (self.fs.clone(), self.waits.clone());
        let started = on_own_thread("citronfs-setlkw", move || {
            let stopped = || stop.load(Ordering::SeqCst);
            let result = backend.setlk(handle, claim, Some(&stopped));
            waits_of(&waits).remove(&unique);
            Self::empty(Req::fh("setlk", ino, fh), reply, result)
        });
        if !started {
            waits_of(&self.waits).remove(&unique);
        }
    }

    fn interrupt(&self, _req: &Request, unique: u64) {
        if let Some(stop) = waits_of(&self.waits).get(&unique) {
            stop.store(true, Ordering::SeqCst);
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _op = self.op(FuseOp::Release);
        Self::empty(
            Req::fh("release", ino, fh),
            reply,
            self.fs.release(Fh(fh.0)),
        )
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _op = self.op(FuseOp::Fsync);
        Self::empty(Req::fh("fsync", ino, fh), reply, self.fs.fsync(Fh(fh.0)))
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _op = self.op(FuseOp::Opendir);
        match self.fs.getattr(ino.0) {
            Ok(attr) if attr.kind == FileKind::Dir => {
                reply.opened(FileHandle(0), FopenFlags::empty())
            }
            Ok(_) => reply.error(refused(&Req::ino("opendir", ino), libc::ENOTDIR)),
            Err(e) => reply.error(gone_or_failed(&Req::ino("opendir", ino), &e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let _op = self.op(FuseOp::Readdir);
        let mut cookie = offset;
        loop {
            let entries = match self.fs.readdir(ino.0, cookie, 128) {
                Ok(entries) => entries,
                Err(e) => return reply.error(failed(&Req::ino("readdir", ino), &e)),
            };
            if entries.is_empty() {
                return reply.ok();
            }
            for entry in entries {
                if reply.add(
                    INodeNo(entry.ino),
                    entry.cookie,
                    file_type(entry.kind),
                    &entry.name,
                ) {
                    // The kernel's buffer is full; it asks again from the last cookie added.
                    return reply.ok();
                }
                cookie = entry.cookie;
            }
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let _op = self.op(FuseOp::Readdirplus);
        let mut cookie = offset;
        loop {
            let entries = match self.fs.readdirplus(ino.0, cookie, 128) {
                Ok(entries) => entries,
                Err(e) => return reply.error(failed(&Req::ino("readdirplus", ino), &e)),
            };
            if entries.is_empty() {
                return reply.ok();
            }
            for (entry, attr) in entries {
                if reply.add(
                    INodeNo(entry.ino),
                    entry.cookie,
                    &entry.name,
                    &self.ttl,
                    &file_attr(&attr, self.blksize()),
                    Generation(0),
                ) {
                    // The kernel's buffer is full; it asks again from the last cookie added.
                    return reply.ok();
                }
                cookie = entry.cookie;
            }
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _op = self.op(FuseOp::Fsyncdir);
        // Every namespace change is a committed sled transaction when its reply arrives.
        reply.ok()
    }

    // Requests CitronFS has nothing of its own for. Each answer lets the kernel do what a local
    // file system does, and none is logged above debug: they are ordinary (every isatty(3) of a
    // file here is an ioctl), and fuser's defaults warned on each one.

    fn ioctl(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        let _op = self.op(FuseOp::Ioctl);
        // No ioctl is defined on CitronFS files: ENOTTY, as a local file system answers one it
        // does not know (Python's open() asks TCGETS of every file, through isatty).
        reply.error(refused(&Req::fh("ioctl", ino, fh), libc::ENOTTY))
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let _op = self.op(FuseOp::Lseek);
        let r = Req::fh("lseek", ino, fh);
        // Only SEEK_DATA and SEEK_HOLE come here: the kernel answers the others itself.
        let (Some(to), Ok(from)) = (SeekTo::from_whence(whence), u64::try_from(offset)) else {
            return reply.error(refused(&r, libc::EINVAL));
        };
        match self.fs.seek(Fh(fh.0), from, to) {
            Ok(Some(at)) => reply.offset(at as i64),
            Ok(None) => reply.error(refused(&r, libc::ENXIO)),
            // A backend without holes: the kernel then answers SEEK_DATA and SEEK_HOLE itself
            // (the whole file is data) and asks this mount no more.
            Err(Error::Fs(FsError::NotSupported)) => reply.error(refused(&r, libc::ENOSYS)),
            Err(e) => reply.error(failed(&r, &e)),
        }
    }

    fn poll(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _ph: PollNotifier,
        _events: PollEvents,
        _flags: PollFlags,
        reply: ReplyPoll,
    ) {
        let _op = self.op(FuseOp::Poll);
        // The kernel then reports a file here always ready, as for a regular file anywhere,
        // and asks this mount no more.
        reply.error(refused(&Req::fh("poll", ino, fh), libc::ENOSYS))
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        ino_in: INodeNo,
        fh_in: FileHandle,
        _offset_in: u64,
        _ino_out: INodeNo,
        _fh_out: FileHandle,
        _offset_out: u64,
        _len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let _op = self.op(FuseOp::CopyFileRange);
        // The kernel then copies through reads and writes (each a locked I/O of its own) and
        // asks this mount no more.
        reply.error(refused(
            &Req::fh("copy_file_range", ino_in, fh_in),
            libc::ENOSYS,
        ))
    }

    fn statfs(&self, _req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        let _op = self.op(FuseOp::Statfs);
        match self.fs.statfs() {
            Ok(s) => {
                let bsize = s.block_size.min(u32::MAX as u64) as u32;
                // Inodes: those in use plus those that can still be made, so that `df -i`'s
                // used column (total − free) is the inodes in use.
                reply.statfs(
                    s.total_blocks,
                    s.free_blocks,
                    s.free_blocks,
                    s.inodes.saturating_add(s.free_inodes),
                    s.free_inodes,
                    bsize,
                    proto::NAME_MAX as u32,
                    bsize,
                )
            }
            Err(e) => reply.error(failed(&Req::ino("statfs", ino), &e)),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _op = self.op(FuseOp::Setxattr);
        let mode = if flags & libc::XATTR_CREATE != 0 {
            XattrMode::Create
        } else if flags & libc::XATTR_REPLACE != 0 {
            XattrMode::Replace
        } else {
            XattrMode::Either
        };
        let req = Req::name("setxattr", ino, name);
        if is_posix_acl(name) {
            return reply.error(refused(&req, libc::EOPNOTSUPP));
        }
        let result = name_str(name).and_then(|n| self.fs.setxattr(ino.0, n, value, mode));
        Self::empty(req, reply, result)
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let _op = self.op(FuseOp::Getxattr);
        let req = Req::name("getxattr", ino, name);
        if is_posix_acl(name) {
            return reply.error(refused(&req, libc::EOPNOTSUPP));
        }
        match name_str(name).and_then(|n| self.fs.getxattr(ino.0, n)) {
            Ok(value) => xattr_reply(&req, reply, size, &value),
            Err(e) => reply.error(failed(&req, &e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _op = self.op(FuseOp::Listxattr);
        match self.fs.listxattr(ino.0) {
            Ok(names) => {
                let mut list = Vec::new();
                for n in names {
                    list.extend_from_slice(n.as_bytes());
                    list.push(0);
                }
                xattr_reply(&Req::ino("listxattr", ino), reply, size, &list)
            }
            Err(e) => reply.error(failed(&Req::ino("listxattr", ino), &e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _op = self.op(FuseOp::Removexattr);
        let req = Req::name("removexattr", ino, name);
        if is_posix_acl(name) {
            return reply.error(refused(&req, libc::EOPNOTSUPP));
        }
        let result = name_str(name).and_then(|n| self.fs.removexattr(ino.0, n));
        Self::empty(req, reply, result)
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        let _op = self.op(FuseOp::Access);
        // default_permissions: the kernel checks mode bits itself.
        reply.ok()
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _op = self.op(FuseOp::Create);
        let perm = (mode & !umask & 0o7777) as u16;
        let result =
            name_str(name).and_then(|n| self.fs.create(caller(req), parent.0, n, perm, flags));
        match result {
            Ok((attr, fh)) => reply.created(
                &self.ttl,
                &file_attr(&attr, self.blksize()),
                Generation(0),
                FileHandle(fh.0),
                self.open_flags(attr.ino),
            ),
            Err(e) => reply.error(failed(&Req::name("create", parent, name), &e)),
        }
    }
}

/// Answers an xattr query: the size when asked for 0 bytes, ERANGE when the buffer is too small.
fn xattr_reply(req: &Req<'_>, reply: ReplyXattr, size: u32, value: &[u8]) {
    if size == 0 {
        reply.size(value.len() as u32)
    } else if value.len() > size as usize {
        reply.error(refused(req, libc::ERANGE))
    } else {
        reply.data(value)
    }
}

/// Whether `name` is a POSIX ACL attribute. Without `FUSE_POSIX_ACL` the kernel hands these to
/// the daemon as ordinary xattrs and leaves the mode alone, so storing them would make `cp -a`
/// (which sets the mode through a minimal `system.posix_acl_access`) lose permissions. CitronFS
/// has no ACLs: answering EOPNOTSUPP makes tools fall back to chmod.
fn is_posix_acl(name: &OsStr) -> bool {
    matches!(
        name.as_bytes(),
        b"system.posix_acl_access" | b"system.posix_acl_default"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mount table's device of a mount point is what stat says of it; a directory that is
    /// no mount point has none.
    #[test]
    fn mounted_device_is_the_device_of_the_mount_point() {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata("/proc").unwrap().dev();
        assert_eq!(
            mounted_device(Path::new("/proc")).unwrap(),
            Some((libc::major(dev), libc::minor(dev)))
        );
        assert!(is_mount_point(Path::new("/proc")).unwrap());
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(mounted_device(dir.path()).unwrap(), None);
        assert!(!is_mount_point(dir.path()).unwrap());
    }

    #[test]
    fn times_round_trip() {
        for t in [
            Timestamp { secs: 0, nanos: 0 },
            Timestamp {
                secs: 1_700_000_000,
                nanos: 123_456_789,
            },
            Timestamp {
                secs: -5,
                nanos: 250_000_000,
            },
        ] {
            assert_eq!(timestamp(system_time(t)), t);
        }
    }

    #[test]
    fn atomic_bound_arithmetic() {
        let page = 4096;
        // 16 MiB at page offset 4095 spans 4097 pages.
        assert_eq!(pages_for_atomic(16 << 20, page), 4097);
        assert_eq!(pages_for_atomic(1, page), 1);
        assert_eq!(pages_for_atomic(2, page), 2);
        assert_eq!(pages_for_atomic(page, page), 2);
        assert_eq!(atomic_bound_for(16 << 20, 4097, page), 16 << 20);
        // 4096 pages (what fuser asks for by itself): 4095 bytes short of 16 MiB.
        assert_eq!(atomic_bound_for(16 << 20, 4096, page), (16 << 20) - 4095);
        // The kernel's default limit: an unaligned 1 MiB buffer spans 257 pages.
        assert_eq!(atomic_bound_for(16 << 20, 256, page), 255 * 4096 + 1);
        assert_eq!(atomic_bound_for(4 << 20, 4097, page), 4 << 20);
        for bytes in [1, 4095, 4096, 4097, 1 << 20, (1 << 20) + 1, 16 << 20] {
            let pages = pages_for_atomic(bytes, page);
            assert_eq!(atomic_bound_for(u64::MAX, pages, page).min(bytes), bytes);
            assert!(atomic_bound_for(u64::MAX, pages - 1, page) < bytes);
        }
    }

    #[test]
    fn mount_points_are_found_in_mountinfo() {
        assert!(is_mount_point(Path::new("/")).unwrap());
        assert!(is_mount_point(Path::new("/proc")).unwrap());
        // Resolved before it is compared.
        assert!(is_mount_point(Path::new("/proc/../proc")).unwrap());
        let dir = tempfile::tempdir().unwrap();
        assert!(!is_mount_point(dir.path()).unwrap());
        assert!(!is_mount_point(&dir.path().join("missing")).unwrap());
    }

    #[test]
    fn limits_follow_the_kernel() {
        let asked = Negotiated {
            max_write: 16 << 20,
            max_pages_asked: 4097,
            max_pages_supported: true,
            shared_mmap: true,
        };
        let l = io_limits(asked, Some(4097), 4096);
        assert_eq!((l.max_pages, l.atomic_bound), (4097, 16 << 20));
        let l = io_limits(asked, Some(65535), 4096);
        assert_eq!((l.max_pages, l.atomic_bound), (4097, 16 << 20));
        let l = io_limits(asked, Some(256), 4096);
        assert_eq!((l.max_pages, l.atomic_bound), (256, 1_044_481));
        let l = io_limits(asked, None, 4096);
        assert_eq!(l.max_pages, 256);
        let old = Negotiated {
            max_pages_supported: false,
            ..asked
        };
        assert_eq!(io_limits(old, Some(4097), 4096).max_pages, 32);
    }

    #[test]
    fn errnos_pass_through() {
        assert_eq!(
            errno(&FsError::NotEmpty.into()),
            Errno::from_i32(libc::ENOTEMPTY)
        );
        assert_eq!(
            errno(&FsError::NoSpace.into()),
            Errno::from_i32(libc::ENOSPC)
        );
    }

    #[test]
    fn ordinary_outcomes_are_quiet_failures_loud() {
        for quiet in [
            libc::ENOENT,
            libc::EEXIST,
            libc::ENOTEMPTY,
            libc::EACCES,
            libc::ENOTDIR,
            libc::EISDIR,
            libc::ENODATA,
        ] {
            assert_eq!(loudness(quiet), Loudness::Quiet, "errno {quiet}");
        }
        for loud in [
            libc::EIO,
            libc::EPROTO,
            libc::ENOTCONN,
            libc::ETIMEDOUT,
            libc::ENOSPC,
            libc::ESTALE,
        ] {
            assert_eq!(loudness(loud), Loudness::Loud, "errno {loud}");
        }
    }

    /// Everything a test subscriber writes.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What `f` logs at `level` and above, as text.
    fn logged(level: tracing::Level, f: impl FnOnce()) -> String {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = out.0.lock().unwrap().clone();
        String::from_utf8(text).unwrap()
    }

    #[test]
    fn eio_is_logged_with_request_and_cause_chain() {
        let err = Error::Fabric {
            peer: crate::error::Peer::Data(3),
            source: fabric::FabricError::Disconnected("peer closed the connection".into()),
        };
        let req = Req::io("write", INodeNo(42), FileHandle(7), 8192, 4096);
        let mut answer = None;
        let log = logged(tracing::Level::INFO, || answer = Some(failed(&req, &err)));
        assert_eq!(answer, Some(Errno::from_i32(libc::EIO)));
        assert!(log.contains("WARN"), "{log}");
        assert!(log.contains("op=\"write\""), "{log}");
        assert!(log.contains("ino=42"), "{log}");
        assert!(
            log.contains("write ino 42 fh 7 4096 bytes at 8192"),
            "{log}"
        );
        assert!(
            log.contains(
                "fabric to data server 3: connection to server lost: peer closed the connection"
            ),
            "{log}"
        );
    }

    #[test]
    fn enoent_is_quiet() {
        let err = Error::from(FsError::NotFound);
        let name = OsStr::new("missing");
        let req = Req::name("lookup", INodeNo(1), name);
        // Not at the default levels: an `ls` of missing files does not flood the log.
        let log = logged(tracing::Level::INFO, || {
            failed(&req, &err);
        });
        assert_eq!(log, "");
        // At debug, with the request named.
        let log = logged(tracing::Level::DEBUG, || {
            failed(&req, &err);
        });
        assert!(log.contains("DEBUG"), "{log}");
        assert!(!log.contains("WARN"), "{log}");
        assert!(log.contains("lookup ino 1 name \"missing\""), "{log}");
    }

    #[test]
    fn errnos_the_adapter_answers_itself_are_classified_too() {
        let req = Req::ino("opendir", INodeNo(5));
        let log = logged(tracing::Level::INFO, || {
            assert_eq!(refused(&req, libc::ENOTDIR), Errno::from_i32(libc::ENOTDIR));
        });
        assert_eq!(log, "");
        // What the adapter answers requests it has nothing for (ioctl, lseek, poll, ...).
        let log = logged(tracing::Level::INFO, || {
            refused(&Req::fh("ioctl", INodeNo(5), FileHandle(1)), libc::ENOTTY);
            refused(&Req::fh("lseek", INodeNo(5), FileHandle(1)), libc::ENOSYS);
        });
        assert_eq!(log, "");
        let log = logged(tracing::Level::INFO, || {
            refused(&req, libc::EIO);
        });
        assert!(
            log.contains("WARN") && log.contains("opendir ino 5"),
            "{log}"
        );
    }
}
