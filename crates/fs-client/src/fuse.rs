//! The FUSE adapter: a thin layer that turns kernel requests into [`CitronFs`] calls.
//!
//! - Multi-threaded: fuser runs `threads` event loops, each with its own cloned `/dev/fuse`
//!   descriptor; the library gives each concurrent call its own endpoints and lock handles.
//! - Every open file gets `FOPEN_DIRECT_IO`: no page cache, so every read and write reaches the
//!   library and takes its range lock, and all clients see one coherent file.
//! - ... and `FOPEN_PARALLEL_DIRECT_WRITES`: without it the kernel serializes all direct writes
//!   to one file on the inode lock, which would defeat the range lock on exactly the workload
//!   CitronFS is for (many writers of one shared file). Concurrent writes are safe because each
//!   takes its own range lock; the kernel still serializes writes that extend the file.
//! - Attribute and entry replies carry a short TTL ([`FuseOptions::attr_ttl`]) so sizes and
//!   names changed by other clients show up quickly.
//! - Mounted with `default_permissions` (the kernel checks mode bits, so EACCES/EPERM come from
//!   it) and fsname `citronfs`; `allow_other` only on request.
//! - Every failure is answered with [`FsError::errno`].
//!
//! [`mount`] returns a [`MountHandle`] that unmounts on drop; [`wait_for_signal`] blocks until
//! SIGINT or SIGTERM (or an external unmount), for command-line use.

use crate::client::{CitronFs, FileHandle as Fh};
use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
    Request, SessionACL, TimeOrNow, WriteFlags,
};
use proto::rpc::XattrMode;
use proto::{Attr, Caller, FileKind, FsError, SetAttr, SetTime, Timestamp};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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

/// The flags of every opened file (see the module docs).
const OPEN_FLAGS: FopenFlags =
    FopenFlags::FOPEN_DIRECT_IO.union(FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES);

/// How to mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FuseOptions {
    /// Let users other than the mounting one use the mount (`allow_other`; needs
    /// `user_allow_other` in /etc/fuse.conf when not root).
    pub allow_other: bool,
    /// Kernel request threads.
    pub threads: usize,
    /// How long the kernel may cache attributes and entries.
    pub attr_ttl: Duration,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions {
            allow_other: false,
            threads: 8,
            attr_ttl: Duration::from_millis(100),
        }
    }
}

/// A mounted CitronFS; unmounts (and waits for the request threads) on drop or
/// [`MountHandle::unmount`].
pub struct MountHandle {
    session: Option<fuser::BackgroundSession>,
    mountpoint: PathBuf,
}

impl MountHandle {
    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
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
        match self.session.take() {
            Some(session) => session.umount_and_join(),
            None => Ok(()),
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

/// Mounts `fs` at `mountpoint` and serves it from background threads.
pub fn mount(
    fs: Arc<CitronFs>,
    mountpoint: impl AsRef<Path>,
    opts: &FuseOptions,
) -> std::io::Result<MountHandle> {
    let mountpoint = mountpoint.as_ref().to_path_buf();
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("citronfs".into()),
        MountOption::Subtype("citronfs".into()),
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
    let adapter = CitronFuse {
        fs,
        ttl: opts.attr_ttl,
    };
    let session = fuser::spawn_mount(adapter, &mountpoint, &config)?;
    Ok(MountHandle {
        session: Some(session),
        mountpoint,
    })
}

/// Blocks until SIGINT or SIGTERM arrives or the mount ends by itself, then unmounts. Installs
/// the signal handlers on first call; a second signal while unmounting is ignored.
pub fn wait_for_signal(handle: MountHandle) -> std::io::Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone())?;
    }
    while !stop.load(Ordering::Relaxed) && !handle.is_finished() {
        std::thread::sleep(Duration::from_millis(100));
    }
    handle.unmount()
}

/// The adapter fuser calls.
struct CitronFuse {
    fs: Arc<CitronFs>,
    ttl: Duration,
}

fn errno(e: &FsError) -> Errno {
    Errno::from_i32(e.errno())
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
    }
}

fn name_str(name: &OsStr) -> Result<&str, FsError> {
    std::str::from_utf8(name.as_bytes())
        .map_err(|_| FsError::Invalid("file names must be UTF-8".into()))
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
        blocks: a.size.div_ceil(512),
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

impl CitronFuse {
    fn blksize(&self) -> u64 {
        // Large enough that tools issue big I/Os, small enough for a page-sized sanity.
        self.fs.cluster().chunk_size.min(1 << 20)
    }

    fn entry(&self, reply: ReplyEntry, result: Result<Attr, FsError>) {
        match result {
            Ok(attr) => reply.entry(&self.ttl, &file_attr(&attr, self.blksize()), Generation(0)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn empty(reply: ReplyEmpty, result: Result<(), FsError>) {
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }
}

impl Filesystem for CitronFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Large writes reach the library whole (one lock, one batch per server).
        let _ = config.set_max_write(4 << 20);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let result = name_str(name).and_then(|n| self.fs.lookup(parent.0, n));
        self.entry(reply, result)
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(ino.0) {
            Ok(attr) => reply.attr(&self.ttl, &file_attr(&attr, self.blksize())),
            Err(e) => reply.error(errno(&e)),
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
        let set = SetAttr {
            perm: mode.map(|m| (m & 0o7777) as u16),
            uid,
            gid,
            size,
            atime: atime.map(set_time),
            mtime: mtime.map(set_time),
        };
        match self.fs.setattr(caller(req), ino.0, set) {
            Ok(attr) => reply.attr(&self.ttl, &file_attr(&attr, self.blksize())),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.fs.readlink(ino.0) {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(errno(&e)),
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
        let result = name_str(name).and_then(|n| {
            let kind = FileKind::from_mode(mode)
                .ok_or_else(|| FsError::Invalid(format!("mode {mode:o} has no file type")))?;
            let perm = (mode & !umask & 0o7777) as u16;
            self.fs.mknod(caller(req), parent.0, n, kind, perm, rdev)
        });
        self.entry(reply, result)
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
        let perm = (mode & !umask & 0o7777) as u16;
        let result = name_str(name).and_then(|n| self.fs.mkdir(caller(req), parent.0, n, perm));
        self.entry(reply, result)
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        Self::empty(
            reply,
            name_str(name).and_then(|n| self.fs.unlink(parent.0, n)),
        )
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        Self::empty(
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
        let result = name_str(link_name).and_then(|n| {
            let target = name_str(target.as_os_str())?;
            self.fs.symlink(caller(req), parent.0, n, target)
        });
        self.entry(reply, result)
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
        let no_replace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        if !(flags - RenameFlags::RENAME_NOREPLACE).is_empty() {
            // RENAME_EXCHANGE and RENAME_WHITEOUT have no counterpart in the protocol.
            return reply.error(Errno::from_i32(libc::EINVAL));
        }
        let result = name_str(name).and_then(|n| {
            let nn = name_str(newname)?;
            self.fs.rename(parent.0, n, newparent.0, nn, no_replace)
        });
        Self::empty(reply, result)
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let result = name_str(newname).and_then(|n| self.fs.link(ino.0, newparent.0, n));
        self.entry(reply, result)
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self.fs.open(caller(req), ino.0, flags.0) {
            Ok(fh) => reply.opened(FileHandle(fh.0), OPEN_FLAGS),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        match self.fs.read(Fh(fh.0), offset, size as usize) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.fs.write(Fh(fh.0), offset, data) {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        // Writes are complete when they return: nothing is buffered.
        reply.ok()
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        Self::empty(reply, self.fs.release(Fh(fh.0)))
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        Self::empty(reply, self.fs.fsync(Fh(fh.0)))
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.fs.getattr(ino.0) {
            Ok(attr) if attr.kind == FileKind::Dir => {
                reply.opened(FileHandle(0), FopenFlags::empty())
            }
            Ok(_) => reply.error(Errno::from_i32(libc::ENOTDIR)),
            Err(e) => reply.error(errno(&e)),
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
        let mut cookie = offset;
        loop {
            let entries = match self.fs.readdir(ino.0, cookie, 128) {
                Ok(entries) => entries,
                Err(e) => return reply.error(errno(&e)),
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

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Every namespace change is a committed sled transaction when its reply arrives.
        reply.ok()
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.fs.statfs() {
            Ok(s) => {
                let bsize = s.chunk_size.min(u32::MAX as u64) as u32;
                reply.statfs(
                    s.total_chunks,
                    s.free_chunks,
                    s.free_chunks,
                    s.inodes,
                    u64::from(u32::MAX).saturating_sub(s.inodes),
                    bsize,
                    proto::NAME_MAX as u32,
                    bsize,
                )
            }
            Err(e) => reply.error(errno(&e)),
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
        let mode = if flags & libc::XATTR_CREATE != 0 {
            XattrMode::Create
        } else if flags & libc::XATTR_REPLACE != 0 {
            XattrMode::Replace
        } else {
            XattrMode::Either
        };
        if is_posix_acl(name) {
            return reply.error(Errno::from_i32(libc::EOPNOTSUPP));
        }
        let result = name_str(name).and_then(|n| self.fs.setxattr(ino.0, n, value, mode));
        Self::empty(reply, result)
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if is_posix_acl(name) {
            return reply.error(Errno::from_i32(libc::EOPNOTSUPP));
        }
        match name_str(name).and_then(|n| self.fs.getxattr(ino.0, n)) {
            Ok(value) => xattr_reply(reply, size, &value),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.fs.listxattr(ino.0) {
            Ok(names) => {
                let mut list = Vec::new();
                for n in names {
                    list.extend_from_slice(n.as_bytes());
                    list.push(0);
                }
                xattr_reply(reply, size, &list)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        if is_posix_acl(name) {
            return reply.error(Errno::from_i32(libc::EOPNOTSUPP));
        }
        let result = name_str(name).and_then(|n| self.fs.removexattr(ino.0, n));
        Self::empty(reply, result)
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
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
        let perm = (mode & !umask & 0o7777) as u16;
        let result =
            name_str(name).and_then(|n| self.fs.create(caller(req), parent.0, n, perm, flags));
        match result {
            Ok((attr, fh)) => reply.created(
                &self.ttl,
                &file_attr(&attr, self.blksize()),
                Generation(0),
                FileHandle(fh.0),
                OPEN_FLAGS,
            ),
            Err(e) => reply.error(errno(&e)),
        }
    }
}

/// Answers an xattr query: the size when asked for 0 bytes, ERANGE when the buffer is too small.
fn xattr_reply(reply: ReplyXattr, size: u32, value: &[u8]) {
    if size == 0 {
        reply.size(value.len() as u32)
    } else if value.len() > size as usize {
        reply.error(Errno::from_i32(libc::ERANGE))
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
    fn errnos_pass_through() {
        assert_eq!(errno(&FsError::NotEmpty), Errno::from_i32(libc::ENOTEMPTY));
        assert_eq!(errno(&FsError::NoSpace), Errno::from_i32(libc::ENOSPC));
    }
}
