//! [`FsBackend`]: what the FUSE adapter ([`crate::fuse`]) serves — the file system's core,
//! kept apart from the fuser glue (as mountpoint-s3 keeps its `S3Filesystem` apart from its
//! `fuse` module).
//!
//! Two backends implement it:
//! - [`CitronFs`], the file system: each operation is the library call of the same name,
//!   listed once (name, arguments, answer) through a macro rather than forwarded by hand;
//! - [`crate::null::NullFs`], a measuring tool that stores nothing and answers at once, so
//!   that the same adapter over it shows what the FUSE path itself costs on a machine
//!   (`citronfs bench fs --fs null`).
//!
//! The trait speaks the library's types (inode numbers, [`Attr`], [`FileHandle`], [`Error`]),
//! never fuser's: the adapter alone converts between the two. Errors become errnos through
//! [`Error::errno`] there, for every backend alike.
//!
//! Operations a backend may lack have default bodies that answer as a file system without the
//! feature does (`EOPNOTSUPP`, or "no extended attributes"); [`CitronFs`] overrides them all.

use crate::client::CitronFs;
use crate::error::Error;
use crate::handles::FileHandle;
use crate::io::{Fallocate, SeekTo};
use proto::records::{RecordClaim, RecordKind, RecordLock};
use proto::rpc::XattrMode;
use proto::{Attr, Caller, DirEntry, FileKind, FsError, FsStats, Ino, SetAttr};

/// A file system the FUSE adapter can mount (see the module docs). `Send + Sync`: the
/// adapter calls it from all its request threads at once.
pub trait FsBackend: Send + Sync + 'static {
    /// What [`FsBackend::read`] returns: owned bytes, or bytes the backend lends for as long
    /// as the reply is being sent (the adapter only reads them, once).
    type ReadData<'a>: AsRef<[u8]>
    where
        Self: 'a;

    /// The file system's name in the mount table (`fsname` and `subtype`).
    fn fs_name(&self) -> &'static str;

    /// The block size reported in attributes (`st_blksize`).
    fn blksize(&self) -> u64;

    /// The mount is being unmounted: calls still in flight, and those the unmount makes,
    /// should not wait for servers that are away ([`CitronFs::shutting_down`]).
    fn shutting_down(&self) {}

    /// The entry `name` of directory `parent`.
    fn lookup(&self, parent: Ino, name: &str) -> Result<Attr, Error>;

    /// An inode's attributes.
    fn getattr(&self, ino: Ino) -> Result<Attr, Error>;

    /// Changes attributes; returns them as they are after the change.
    fn setattr(&self, caller: Caller, ino: Ino, set: SetAttr) -> Result<Attr, Error>;

    /// Opens a file (`flags` as open(2)'s).
    fn open(&self, caller: Caller, ino: Ino, flags: i32) -> Result<FileHandle, Error>;

    /// Creates a regular file and opens it.
    fn create(
        &self,
        caller: Caller,
        parent: Ino,
        name: &str,
        perm: u16,
        flags: i32,
    ) -> Result<(Attr, FileHandle), Error>;

    /// Closes a handle.
    fn release(&self, fh: FileHandle) -> Result<(), Error>;

    /// Reads up to `len` bytes at `offset`; fewer at the end of the file.
    fn read(&self, fh: FileHandle, offset: u64, len: usize) -> Result<Self::ReadData<'_>, Error>;

    /// [`FsBackend::read`] into `buf` (at most `buf.len()` bytes; what follows the bytes read
    /// is scratch), returning how many bytes were read: the adapter's read when the reply
    /// offers the kernel's own answer buffer (FUSE over io_uring), so that the bytes are
    /// written once, where the kernel copies them from.
    fn read_in_place(
        &self,
        fh: FileHandle,
        offset: u64,
        len: usize,
        buf: &mut [u8],
    ) -> Result<usize, Error>;

    /// Writes all of `data` at `offset` and returns its length; `kill_suidgid`: the writer
    /// lacks `CAP_FSETID` (see [`CitronFs::write_as`]).
    fn write_as(
        &self,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        kill_suidgid: bool,
    ) -> Result<usize, Error>;

    /// Makes the file's writes durable as far as the file system can.
    fn fsync(&self, fh: FileHandle) -> Result<(), Error>;

    /// What a close(2) of a descriptor asks before the release (FUSE's FLUSH). Nothing is
    /// buffered, so by default nothing is done. Files are opened with `FOPEN_NOFLUSH` unless
    /// [`FsBackend::wants_flush`] says otherwise, and a kernel that honours it (Linux 5.16 and
    /// later) then never sends it; where it is sent, the adapter also gives back the closing
    /// owner's record locks ([`FsBackend::release_records`]).
    fn flush(&self, _fh: FileHandle) -> Result<(), Error> {
        Ok(())
    }

    /// Whether closes of `ino`, opened now, must be told to [`FsBackend::flush`] (no
    /// `FOPEN_NOFLUSH`): where the backend must learn which lock owner closed (see
    /// [`CitronFs::wants_flush`]). Default: no.
    fn wants_flush(&self, _ino: Ino) -> bool {
        false
    }

    /// Whether the backend keeps POSIX record locks (`fcntl`) itself, for every client of the
    /// file system: the adapter then negotiates `FUSE_POSIX_LOCKS` and hands `F_GETLK`,
    /// `F_SETLK` and `F_SETLKW` to it. Default: no, and the kernel keeps them for this mount
    /// alone.
    fn record_locks(&self) -> bool {
        false
    }

    /// `F_GETLK` (see [`CitronFs::getlk`]).
    fn getlk(
        &self,
        _fh: FileHandle,
        _owner: u64,
        _start: u64,
        _end: u64,
        _kind: RecordKind,
    ) -> Result<Option<RecordLock>, Error> {
        Err(FsError::NotSupported.into())
    }

    /// `F_GETLK` asked once (see [`CitronFs::try_getlk`]). Default: [`FsBackend::getlk`].
    fn try_getlk(
        &self,
        fh: FileHandle,
        owner: u64,
        start: u64,
        end: u64,
        kind: RecordKind,
    ) -> Result<Option<RecordLock>, Error> {
        self.getlk(fh, owner, start, end, kind)
    }

    /// `F_SETLK` tried once (see [`CitronFs::try_setlk`]). Default: [`FsBackend::setlk`]
    /// without a wait.
    fn try_setlk(&self, fh: FileHandle, claim: RecordClaim) -> Result<(), Error> {
        self.setlk(fh, claim, None)
    }

    /// `F_SETLK` and `F_SETLKW` (see [`CitronFs::setlk`]).
    fn setlk(
        &self,
        _fh: FileHandle,
        _claim: RecordClaim,
        _wait: Option<&dyn Fn() -> bool>,
    ) -> Result<(), Error> {
        Err(FsError::NotSupported.into())
    }

    /// Gives back `owner`'s record locks of `fh`'s file at a close (see
    /// [`CitronFs::release_records`]).
    fn release_records(&self, _fh: FileHandle, _owner: u64) -> Result<(), Error> {
        Ok(())
    }

    /// Whether lock owner `owner` may read and write `fh`'s file: not after it lost a record
    /// lock of it (see [`CitronFs::check_record_locks`]). Default: yes.
    fn check_record_locks(&self, _fh: FileHandle, _owner: u64) -> Result<(), Error> {
        Ok(())
    }

    /// Up to `max` entries of directory `ino` after `cookie` (0: from the start).
    fn readdir(&self, ino: Ino, cookie: u64, max: u32) -> Result<Vec<DirEntry>, Error>;

    /// [`FsBackend::readdir`] with each entry's attributes (FUSE's readdirplus). By default the
    /// listing and then a `getattr` of each entry.
    fn readdirplus(&self, ino: Ino, cookie: u64, max: u32) -> Result<Vec<(DirEntry, Attr)>, Error> {
        self.readdir(ino, cookie, max)?
            .into_iter()
            .map(|entry| {
                let attr = self.getattr(entry.ino)?;
                Ok((entry, attr))
            })
            .collect()
    }

    /// File-system totals.
    fn statfs(&self) -> Result<FsStats, Error>;

    /// Removes a name (not a directory).
    fn unlink(&self, parent: Ino, name: &str) -> Result<(), Error>;

    /// Creates a file, device node, fifo or socket.
    fn mknod(
        &self,
        _caller: Caller,
        _parent: Ino,
        _name: &str,
        _kind: FileKind,
        _perm: u16,
        _rdev: u32,
    ) -> Result<Attr, Error> {
        Err(FsError::NotSupported.into())
    }

    /// Creates a directory.
    fn mkdir(&self, _caller: Caller, _parent: Ino, _name: &str, _perm: u16) -> Result<Attr, Error> {
        Err(FsError::NotSupported.into())
    }

    /// Removes an empty directory.
    fn rmdir(&self, _parent: Ino, _name: &str) -> Result<(), Error> {
        Err(FsError::NotSupported.into())
    }

    /// Creates a symbolic link.
    fn symlink(
        &self,
        _caller: Caller,
        _parent: Ino,
        _name: &str,
        _target: &str,
    ) -> Result<Attr, Error> {
        Err(FsError::NotSupported.into())
    }

    /// A symbolic link's target.
    fn readlink(&self, _ino: Ino) -> Result<Vec<u8>, Error> {
        Err(FsError::NotSupported.into())
    }

    /// Renames `parent/name` to `new_parent/new_name` (`no_replace`: `RENAME_NOREPLACE`).
    fn rename(
        &self,
        _parent: Ino,
        _name: &str,
        _new_parent: Ino,
        _new_name: &str,
        _no_replace: bool,
    ) -> Result<(), Error> {
        Err(FsError::NotSupported.into())
    }

    /// Swaps two names (`RENAME_EXCHANGE`).
    fn exchange(
        &self,
        _parent: Ino,
        _name: &str,
        _new_parent: Ino,
        _new_name: &str,
    ) -> Result<(), Error> {
        Err(FsError::NotSupported.into())
    }

    /// Adds a hard link.
    fn link(&self, _ino: Ino, _new_parent: Ino, _new_name: &str) -> Result<Attr, Error> {
        Err(FsError::NotSupported.into())
    }

    /// fallocate(2) on an open file (`kill_suidgid` as for [`FsBackend::write_as`]).
    fn fallocate(
        &self,
        _fh: FileHandle,
        _offset: u64,
        _len: u64,
        _how: Fallocate,
        _kill_suidgid: bool,
    ) -> Result<(), Error> {
        Err(FsError::NotSupported.into())
    }

    /// lseek(2)'s `SEEK_DATA` or `SEEK_HOLE` from `offset` ([`CitronFs::seek`]): `Ok(None)` is
    /// ENXIO. `NotSupported` (the default) makes the adapter answer ENOSYS, after which the
    /// kernel treats every file of the mount as data and asks no more.
    fn seek(&self, _fh: FileHandle, _offset: u64, _to: SeekTo) -> Result<Option<u64>, Error> {
        Err(FsError::NotSupported.into())
    }

    /// Sets an extended attribute.
    fn setxattr(
        &self,
        _ino: Ino,
        _name: &str,
        _value: &[u8],
        _mode: XattrMode,
    ) -> Result<(), Error> {
        Err(FsError::NotSupported.into())
    }

    /// An extended attribute's value (default: there are none).
    fn getxattr(&self, _ino: Ino, _name: &str) -> Result<Vec<u8>, Error> {
        Err(FsError::NoAttr.into())
    }

    /// The names of an inode's extended attributes (default: none).
    fn listxattr(&self, _ino: Ino) -> Result<Vec<String>, Error> {
        Ok(Vec::new())
    }

    /// Removes an extended attribute (default: there are none).
    fn removexattr(&self, _ino: Ino, _name: &str) -> Result<(), Error> {
        Err(FsError::NoAttr.into())
    }
}

/// Implements the listed [`FsBackend`] operations with [`CitronFs`]'s library call of the same
/// name and arguments. Each signature is written once, here; the compiler checks it against
/// the trait and against the call.
macro_rules! library_calls {
    ($(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)*) => {
        $(
            fn $name(&self, $($arg: $ty),*) -> $ret {
                CitronFs::$name(self, $($arg),*)
            }
        )*
    };
}

/// The file system: each operation is the library call of the same name — listed through
/// `library_calls` — except the few that are not a call as they stand (the name, the block
/// size, the read into a thread's spare buffer).
impl FsBackend for CitronFs {
    type ReadData<'a> = ReadBuf;

    fn fs_name(&self) -> &'static str {
        "citronfs"
    }

    fn blksize(&self) -> u64 {
        // Large enough that tools issue big I/Os, small enough for a page-sized sanity.
        self.cluster().chunk_size.min(1 << 20)
    }

    fn shutting_down(&self) {
        CitronFs::shutting_down(self)
    }

    fn record_locks(&self) -> bool {
        true
    }

    fn read(&self, fh: FileHandle, offset: u64, len: usize) -> Result<ReadBuf, Error> {
        let mut buf = ReadBuf::take();
        buf.len = CitronFs::read_into(self, fh, offset, len, &mut buf.bytes)?;
        Ok(buf)
    }

    library_calls! {
        fn lookup(parent: Ino, name: &str) -> Result<Attr, Error>;
        fn getattr(ino: Ino) -> Result<Attr, Error>;
        fn setattr(caller: Caller, ino: Ino, set: SetAttr) -> Result<Attr, Error>;
        fn open(caller: Caller, ino: Ino, flags: i32) -> Result<FileHandle, Error>;
        fn create(caller: Caller, parent: Ino, name: &str, perm: u16, flags: i32)
            -> Result<(Attr, FileHandle), Error>;
        fn release(fh: FileHandle) -> Result<(), Error>;
        fn wants_flush(ino: Ino) -> bool;
        fn getlk(fh: FileHandle, owner: u64, start: u64, end: u64, kind: RecordKind)
            -> Result<Option<RecordLock>, Error>;
        fn setlk(fh: FileHandle, claim: RecordClaim, wait: Option<&dyn Fn() -> bool>)
            -> Result<(), Error>;
        fn try_getlk(fh: FileHandle, owner: u64, start: u64, end: u64, kind: RecordKind)
            -> Result<Option<RecordLock>, Error>;
        fn try_setlk(fh: FileHandle, claim: RecordClaim) -> Result<(), Error>;
        fn release_records(fh: FileHandle, owner: u64) -> Result<(), Error>;
        fn check_record_locks(fh: FileHandle, owner: u64) -> Result<(), Error>;
        fn read_in_place(fh: FileHandle, offset: u64, len: usize, buf: &mut [u8])
            -> Result<usize, Error>;
        fn write_as(fh: FileHandle, offset: u64, data: &[u8], kill_suidgid: bool)
            -> Result<usize, Error>;
        fn fsync(fh: FileHandle) -> Result<(), Error>;
        fn readdir(ino: Ino, cookie: u64, max: u32) -> Result<Vec<DirEntry>, Error>;
        fn readdirplus(ino: Ino, cookie: u64, max: u32) -> Result<Vec<(DirEntry, Attr)>, Error>;
        fn statfs() -> Result<FsStats, Error>;
        fn unlink(parent: Ino, name: &str) -> Result<(), Error>;
        fn mknod(caller: Caller, parent: Ino, name: &str, kind: FileKind, perm: u16, rdev: u32)
            -> Result<Attr, Error>;
        fn mkdir(caller: Caller, parent: Ino, name: &str, perm: u16) -> Result<Attr, Error>;
        fn rmdir(parent: Ino, name: &str) -> Result<(), Error>;
        fn symlink(caller: Caller, parent: Ino, name: &str, target: &str) -> Result<Attr, Error>;
        fn readlink(ino: Ino) -> Result<Vec<u8>, Error>;
        fn rename(parent: Ino, name: &str, new_parent: Ino, new_name: &str, no_replace: bool)
            -> Result<(), Error>;
        fn exchange(parent: Ino, name: &str, new_parent: Ino, new_name: &str) -> Result<(), Error>;
        fn link(ino: Ino, new_parent: Ino, new_name: &str) -> Result<Attr, Error>;
        fn fallocate(fh: FileHandle, offset: u64, len: u64, how: Fallocate, kill_suidgid: bool)
            -> Result<(), Error>;
        fn seek(fh: FileHandle, offset: u64, to: SeekTo) -> Result<Option<u64>, Error>;
        fn setxattr(ino: Ino, name: &str, value: &[u8], mode: XattrMode) -> Result<(), Error>;
        fn getxattr(ino: Ino, name: &str) -> Result<Vec<u8>, Error>;
        fn listxattr(ino: Ino) -> Result<Vec<String>, Error>;
        fn removexattr(ino: Ino, name: &str) -> Result<(), Error>;
    }
}

thread_local! {
    /// The buffer of this thread's last [`ReadBuf`], when it is not lent out.
    static SPARE: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The bytes of one [`CitronFs`] read served to FUSE: a buffer its request thread keeps from
/// request to request ([`CitronFs::read_into`]), lent for the reply and given back when
/// dropped, so that a read allocates, zeroes and faults in no memory of its own.
pub struct ReadBuf {
    bytes: Vec<u8>,
    len: usize,
}

impl ReadBuf {
    /// A buffer larger than this is freed after its reply rather than kept by the thread: a
    /// request may read up to the mount's 16 MiB atomic bound (`fuse::ATOMIC_IO_TARGET`), but
    /// keeping that much per request thread is not worth the rare read that large, whose copy
    /// costs far more than its allocation anyway.
    const KEEP: usize = 2 << 20;

    /// This thread's buffer (empty at the first read).
    fn take() -> Self {
        ReadBuf {
            bytes: SPARE.take(),
            len: 0,
        }
    }
}

impl AsRef<[u8]> for ReadBuf {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl Drop for ReadBuf {
    fn drop(&mut self) {
        if self.bytes.capacity() <= Self::KEEP {
            let bytes = std::mem::take(&mut self.bytes);
            // A thread being torn down has no spare left to fill: the buffer is freed.
            let _ = SPARE.try_with(|spare| spare.set(bytes));
        }
    }
}
