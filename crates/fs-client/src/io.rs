//! The data path (docs/ARCHITECTURE.md "fs-client"): [`CitronFs::read`], [`CitronFs::write`],
//! [`CitronFs::fsync`], and truncation under the whole-file lock. Read top-down, one locked I/O
//! is:
//!
//! 1. check out a worker (`workers`): its own endpoints and lock handles;
//! 2. **lock** `[off, off+len)` rounded outward to lock units ([`locked`]; an `O_APPEND`
//!    write locks the whole file) — **shared for a read** (by default:
//!    [`crate::MountOptions::read_locks`]), **exclusive for anything that changes the file**
//!    (write, truncate, fallocate), so overlapping reads hold the range together where the
//!    scheme shares (CITRON acquired one-sidedly) and no read overlaps a write —
//!    and note the lock's lease deadline. The file control block's words (`fcb`: SIZE,
//!    GENERATION, MTIME, MODE, and the records of replicated writes in flight) ride in the
//!    lock's granting batch (`lockmgr::RangeLock::acquire_mode_with`): no round trip of their
//!    own. A record over the locked units (a replicated write cut, `cut_repair`): the lock is
//!    traded for an exclusive one over the cut range, and its replicas are made to agree
//!    before anything else;
//! 3. find the chunks (`chunks`; a write allocates the missing run with one RPC);
//! 4. **post the data verbs**, one batch per data server ([`transfer::read`],
//!    [`transfer::write`]; a write to chunks of two or more replicas first records itself in
//!    the FCB and waits for it, `cut_repair`), **checking the lease**: a write's verbs are
//!    posted only while the lease has more than `lease_guard` left, a read's are checked
//!    after they completed;
//! 5. (writes) **raise the FCB words** in one batch on the meta endpoint posted beside the data
//!    batches and awaited with them (`fcb`'s `FcbRaises`): SIZE with a CAS when the write
//!    extends the file, and MTIME where the release cannot carry it (step 6). Under the lock
//!    their order does not matter: no reader of the range gets the lock before the release.
//!    A SIZE CAS that lost to another writer's smaller raise is redone before the release, so
//!    a reader that locks after it finds the new size;
//! 6. **release**, only after the data verbs and the raises completed (or failed); where the
//!    release is one-sided verbs, a write's MTIME raise rides at the head of its batch (`fcb`'s
//!    `MtimeRaise`), and so does the end of a replicated write's record (`cut_repair`).
//!
//! So a 4 KiB read or write on one data server takes three round trips in sequence
//! (acquire, data with the raises beside it, release; uncontended, with a fabric lock scheme);
//! a write to a chunk of several replicas one more (its record).
//! Where the lock is acquired at the meta server (tcp, `lockmgr::schemes::Hosting`), the release
//! is posted and a read or write waits for two.
//!
//! A write that fails after its raises landed (a data server died, the lease ran out) is redone
//! like any other; if it ends in EIO, the file may keep the size it raised, and the bytes it
//! did not land read zeros (chunks are zeroed before they are handed out).
//!
//! When the lease ran out mid-I/O (`Error::LeaseLost`), the whole read or write is redone
//! under a new lock (`Inner::retry`, `LEASE_RETRIES` times, then EIO), so a client
//! that was merely slow never lands a write outside its lock (docs/ARCHITECTURE.md "Fencing") — but only
//! while nothing of it was sent: a write that lost its lease after one data server's batch
//! went out fails with EIO (`Error::LeaseLostPartway`, [`locked`]), since the release
//! hands the next holder a range with that part in it, and a redo reported done would make
//! the next holder's read of it a torn read of a successful write.
//!
//! When it failed below the file system (`Error::is_transient`: a server restarted, a
//! connection broke, a chunk on a data server this client did not know yet), the client
//! catches up with the cluster (`view`'s `recover`: reconnects, fetches the layout, waits for
//! the data server) and redoes the whole I/O, with growing pauses, until the call's bound runs
//! out — `view::DATA_SERVER_WAIT` after the call began, or after the client first found the
//! data server away in this outage, whichever is earlier (`Views::data_deadline`, the one
//! place it is decided) — then EIO. No attempt starts past it, so a call ends within it plus
//! at most the attempt in flight (a silent server: the fabric's batch or connect bound). (The
//! meta server may learn of a data server's death a moment after its clients, so the layout
//! can still name the dead address for a while.) A request that never left because the
//! connection was already dead (the kernel gave it up during a cut that has healed since) is
//! such a failure: it is redone on a fresh connection.
//! Redoing is safe: a read has no effect, and a write writes the same bytes at the same offsets
//! under a new lock (an `O_APPEND` write, whose offset is the size it found, is not redone: its
//! first attempt may have raised the size already). Every attempt starts from a worker and an
//! open of the current view (`Inner::live_inode`).
//!
//! Invariants: the lock is held from the batch that read the FCB (its granting batch) until
//! after the last data verb and the SIZE raise completed; a worker whose verbs or lock release failed is marked broken and
//! never reused; no lock shared between the client's threads (a mutex) is held while verbs
//! are in flight. Under a shared range lock a read only reads: its body posts no write verb,
//! raises nothing in the FCB and sends no RPC that changes the file.

use crate::client::CitronFs;
use crate::error::Error;
use crate::fcb::{finish_fcb_raises, read_fcb, Fcb, FcbRaises};
use crate::handles::{FileHandle, Handle, OpenInode};
use crate::locked_io::locked;
use crate::locks::WHOLE_FILE;
use crate::meta::unexpected;
use crate::transfer::{self, ReadDest};
use crate::workers::Worker;
use lockmgr::LockMode;
use proto::rpc::{Request, Response};
use proto::{Attr, Caller, FsError, SetAttr, Timestamp};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// What [`CitronFs::fallocate`] does (fallocate(2)'s modes that CitronFS supports; the FUSE
/// adapter answers EOPNOTSUPP to the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallocate {
    /// Mode 0: allocate the range, extending the file to its end.
    Allocate,
    /// `FALLOC_FL_KEEP_SIZE`: allocate the range without changing the size.
    KeepSize,
    /// `FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`: make the range read zeros.
    PunchHole,
}

impl Fallocate {
    /// The mode fallocate(2) was called with, or `None` for one CitronFS does not support
    /// (EOPNOTSUPP).
    pub fn from_mode(mode: i32) -> Option<Fallocate> {
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        match mode {
            0 => Some(Fallocate::Allocate),
            libc::FALLOC_FL_KEEP_SIZE => Some(Fallocate::KeepSize),
            PUNCH => Some(Fallocate::PunchHole),
            _ => None,
        }
    }
}

/// Where [`CitronFs::seek`] looks: lseek(2)'s `SEEK_DATA` or `SEEK_HOLE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeekTo {
    /// `SEEK_DATA`: the next byte that is data.
    Data,
    /// `SEEK_HOLE`: the next byte in a hole (the end of the file counts as one).
    Hole,
}

impl SeekTo {
    /// The `whence` lseek(2) was called with, or `None` for one the kernel answers itself
    /// (`SEEK_SET`, `SEEK_CUR`, `SEEK_END`).
    pub fn from_whence(whence: i32) -> Option<SeekTo> {
        match whence {
            libc::SEEK_DATA => Some(SeekTo::Data),
            libc::SEEK_HOLE => Some(SeekTo::Hole),
            _ => None,
        }
    }
}

/// Chunks whose locations one step of [`CitronFs::seek`] asks for.
const SEEK_WINDOW: u64 = 1024;

/// The bytes of a fallocate done under one range lock; a larger range is done in steps, each
/// atomic by itself (as a write beyond the atomic bound is).
const FALLOCATE_STEP: u64 = 16 << 20;

impl CitronFs {
    /// Reads up to `len` bytes at `offset`; fewer at the end of the file. Atomic with respect
    /// to every write of every client that overlaps it.
    pub fn read(&self, fh: FileHandle, offset: u64, len: usize) -> Result<Vec<u8>, Error> {
        let mut buf = Vec::new();
        let n = self.read_into(fh, offset, len, &mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }

    /// [`CitronFs::read`] into a buffer the caller keeps from call to call: the bytes read are
    /// `buf[..n]`, `n` returned; what lies beyond them is unspecified. `buf` is grown (with
    /// zeros) when it is shorter than the read needs and never shrunk, so a reused buffer is
    /// neither allocated nor zeroed again: the fabric's reads land in it directly, and holes
    /// are zeroed where they are. The FUSE adapter reads this way (one buffer per request
    /// thread), which spares a 1 MiB read a megabyte of zeroing and the page faults of a fresh
    /// allocation.
    pub fn read_into(
        &self,
        fh: FileHandle,
        offset: u64,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> Result<usize, Error> {
        self.read_to(fh, offset, len, ReadDest::Grow(buf))
    }

    /// [`CitronFs::read`] into `buf`, a slice the caller owns (the FUSE adapter: the buffer
    /// the kernel copies a FUSE-over-io_uring answer from): the bytes read are `buf[..n]`,
    /// `n` returned, at most `buf.len()`; the bytes after them are scratch. The fabric's reads
    /// land in `buf` itself when it has room for the read and a word per data server beyond
    /// it (a buffer as long as the largest read always has), else in a buffer of their own,
    /// copied from.
    pub fn read_in_place(
        &self,
        fh: FileHandle,
        offset: u64,
        len: usize,
        buf: &mut [u8],
    ) -> Result<usize, Error> {
        let len = len.min(buf.len());
        self.read_to(fh, offset, len, ReadDest::Slice(buf))
    }

    /// [`CitronFs::read_into`] and [`CitronFs::read_in_place`]: the read, into `dest`.
    fn read_to(
        &self,
        fh: FileHandle,
        offset: u64,
        len: usize,
        mut dest: ReadDest<'_>,
    ) -> Result<usize, Error> {
        let started = Instant::now();
        let handle = self.inner.files.handle(fh)?;
        self.inner.records.check_handle(fh, handle.inode.ino)?;
        let max = self.inner.geometry.max_file_size();
        if len == 0 || offset >= max {
            return Ok(0);
        }
        let len = len.min((max - offset).min(usize::MAX as u64) as usize);
        let units = self.inner.geometry.lock_range(offset, len as u64)?;
        let inner = &*self.inner;
        inner.retry(started, true, || {
            let mut w = inner.checkout()?;
            let inode = &inner.live_inode(&handle.inode, &w.view)?;
            locked(
                inner,
                &mut w,
                inode,
                units.clone(),
                inner.read_locks,
                None,
                |w, found, _| {
                    let (size, generation) = (found.size, found.generation);
                    if offset >= size {
                        return Ok(0);
                    }
                    let n = len.min((size - offset).min(usize::MAX as u64) as usize);
                    let locs =
                        inner.chunk_locations(&w.view, inode, generation, offset, n, false)?;
                    transfer::read(w, &inner.geometry, offset, n, &locs, dest.reborrow())?;
                    Ok(n)
                },
            )
        })
    }

    /// Writes `data` at `offset` (or at the end of the file for an `O_APPEND` handle) and
    /// returns the bytes written (all of them). Atomic with respect to every read and write of
    /// every client that overlaps it. A handle opened by a caller other than root clears the
    /// file's set-ID bits as Linux does ([`CitronFs::write_as`]).
    pub fn write(&self, fh: FileHandle, offset: u64, data: &[u8]) -> Result<usize, Error> {
        let handle = self.inner.files.handle(fh)?;
        self.write_as(fh, offset, data, handle.caller.uid != 0)
    }

    /// [`CitronFs::write`], saying whether the writer lacks `CAP_FSETID` (`kill_suidgid`, FUSE's
    /// `FUSE_WRITE_KILL_SUIDGID`): then the write first clears the file's set-user-ID bit, and
    /// its set-group-ID bit when group-execute is set (`proto::fcb::setid_to_clear`). The
    /// permission bits come from the file control block, read in the lock's granting batch, so
    /// a write costs an RPC for this only when there is a bit to clear.
    ///
    /// Every write moves the file's mtime and ctime to its start time (MTIME in the file control
    /// block, `proto::fcb`), one-sidedly.
    pub fn write_as(
        &self,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        kill_suidgid: bool,
    ) -> Result<usize, Error> {
        let started = Instant::now();
        let handle = self.inner.files.handle(fh)?;
        self.inner.records.check_handle(fh, handle.inode.ino)?;
        if data.is_empty() {
            return Ok(0);
        }
        let inner = &*self.inner;
        let append = handle.flags & libc::O_APPEND != 0;
        let units = if append {
            WHOLE_FILE
        } else {
            inner.geometry.lock_range(offset, data.len() as u64)?
        };
        inner.retry(started, !append, || {
            self.locked_change(
                &handle,
                units.clone(),
                kill_suidgid,
                |w, inode, found, mtime| {
                    let offset = if append { found.size } else { offset };
                    let end = inner.geometry.checked_end(offset, data.len() as u64)?;
                    let locs = inner.chunk_locations(
                        &w.view,
                        inode,
                        found.generation,
                        offset,
                        data.len(),
                        true,
                    )?;
                    // SIZE (and MTIME, where the release cannot carry it) go beside the data.
                    let raises = FcbRaises::post(w, inode, &found, end, mtime);
                    transfer::write(w, &inner.geometry, offset, data, &locs, !raises.is_empty())?;
                    finish_fcb_raises(&inner.meta, w, inode, &raises)
                },
            )
        })?;
        Ok(data.len())
    }

    /// fallocate(2) on an open file, under the range lock of `[offset, offset + len)` like a
    /// write, so it is atomic against every read and write that overlaps it (a range over
    /// `FALLOCATE_STEP`, 16 MiB, is done in steps of that size, each atomic by itself):
    ///
    /// - [`Fallocate::Allocate`] (mode 0): allocates the chunks of the range and raises the
    ///   size to its end when it is beyond; reads of the range give what was there, or zeros.
    /// - [`Fallocate::KeepSize`] (`FALLOC_FL_KEEP_SIZE`): allocates the chunks of the range
    ///   below the size; past the size nothing is reserved, because no chunk outlives the size
    ///   at rest (docs/ARCHITECTURE.md): a later write there may still fail with ENOSPC.
    /// - [`Fallocate::PunchHole`] (`FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`): the range reads
    ///   zeros afterwards; the chunks wholly inside it are freed (their memory is the data
    ///   servers' again, as after a truncate), the allocated bytes of the chunks it only partly
    ///   covers are overwritten with zeros; the size does not change.
    ///
    /// Each moves mtime and ctime like a write (and clears set-ID bits when `kill_suidgid`).
    /// `len` 0 is EINVAL, and so is a range past the largest file (as for a write there).
    pub fn fallocate(
        &self,
        fh: FileHandle,
        offset: u64,
        len: u64,
        mode: Fallocate,
        kill_suidgid: bool,
    ) -> Result<(), Error> {
        let started = Instant::now();
        let handle = self.inner.files.handle(fh)?;
        if len == 0 {
            return Err(FsError::Invalid("fallocate of 0 bytes".into()).into());
        }
        let inner = &*self.inner;
        let end = inner.geometry.checked_end(offset, len)?;
        // One step at a time, each under its own range lock, so that no lock is held for
        // longer than a write of the atomic bound takes (a hole punch moves bytes).
        let mut at = offset;
        while at < end {
            let step_end = end.min(at.saturating_add(FALLOCATE_STEP));
            let units = inner.geometry.lock_range(at, step_end - at)?;
            inner.retry(started, true, || {
                self.locked_change(
                    &handle,
                    units.clone(),
                    kill_suidgid,
                    |w, inode, found, mtime| {
                        self.fallocate_step(w, inode, found, mtime, at..step_end, mode)
                    },
                )
            })?;
            at = step_end;
        }
        Ok(())
    }

    /// lseek(2)'s `SEEK_DATA` and `SEEK_HOLE` on an open file: the first offset at or after
    /// `offset` that is data, or that is in a hole (the end of the file counts as one); `None`
    /// (ENXIO) when `offset` is at or past the end, or when no data follows it.
    ///
    /// By chunk: an allocated chunk is data (whatever zeros it holds, as POSIX allows), one
    /// never written or punched out is a hole. No range lock is taken: like every file
    /// system's, the answer is of a moment, not atomic with the I/O that follows it.
    pub fn seek(&self, fh: FileHandle, offset: u64, to: SeekTo) -> Result<Option<u64>, Error> {
        let started = Instant::now();
        let handle = self.inner.files.handle(fh)?;
        let inner = &*self.inner;
        inner.retry(started, true, || {
            let mut w = inner.checkout()?;
            let inode = inner.live_inode(&handle.inode, &w.view)?;
            let found = read_fcb(&mut w, &inode)?;
            let size = found.size;
            if offset >= size {
                return Ok(None);
            }
            let layout = &inner.geometry.layout;
            let end = layout.chunks_below(size);
            let view = w.view.clone();
            let mut first = layout.locate(offset).0;
            while first < end {
                let last = end.min(first + SEEK_WINDOW);
                let from = layout.start(first);
                let len = usize::try_from(layout.start(last) - from)
                    .map_err(|_| FsError::Invalid("seek window too large".into()))?;
                let run =
                    inner.chunk_locations(&view, &inode, found.generation, from, len, false)?;
                for chunk in first..last {
                    if run.get(chunk).is_some() == (to == SeekTo::Data) {
                        return Ok(Some(layout.start(chunk).max(offset)));
                    }
                }
                first = last;
            }
            Ok(match to {
                SeekTo::Data => None,
                SeekTo::Hole => Some(size),
            })
        })
    }

    /// Makes the file's size durable on the meta server (and its data, where the data servers
    /// are file-backed: their regions are the files).
    pub fn fsync(&self, fh: FileHandle) -> Result<(), Error> {
        let started = Instant::now();
        let handle = self.inner.files.handle(fh)?;
        let inner = &*self.inner;
        // Taken before: a change made while this fsync runs is left for the next one.
        let unsynced = inner.meta.take_unsynced();
        let synced = inner
            .retry(started, true, || {
                let mut w = inner.checkout()?;
                let inode = inner.live_inode(&handle.inode, &w.view)?;
                self.flush_data(&mut w, &inode)
            })
            .and_then(|()| {
                inner.meta.ok_call(
                    "Fsync",
                    Request::Fsync {
                        ino: handle.inode.ino,
                    },
                )
            });
        if let Err(e) = synced {
            if unsynced != 0 {
                inner.meta.note_unsynced(unsynced);
            }
            return Err(e);
        }
        // Changes made in a session that ended before this fsync was answered may be gone
        // with the meta server that acknowledged them: say so (once), as a local file system
        // reports a write-back error at the next fsync.
        let now = inner.meta.generation();
        if unsynced != 0 && unsynced < now {
            return Err(Error::ChangesMaybeLost);
        }
        Ok(())
    }
}

impl CitronFs {
    /// One attempt of a change to `handle`'s file under the range lock of `units` (a write, a
    /// fallocate step): a worker, the current open of the file, the start time — mtime and
    /// ctime move to it; like Linux, it is taken before the data lands — and the lock
    /// ([`locked`]); the set-ID bits are cleared first when `kill_suidgid`
    /// ([`CitronFs::kill_suidgid`]). Then `body` runs with the worker, the open inode, the FCB
    /// words the acquisition found, and the MTIME raise it must post itself, if any.
    fn locked_change<T>(
        &self,
        handle: &Handle,
        units: Range<u64>,
        kill_suidgid: bool,
        body: impl FnOnce(&mut Worker, &Arc<OpenInode>, Fcb, Option<u64>) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let inner = &*self.inner;
        let mut w = inner.checkout()?;
        let inode = inner.live_inode(&handle.inode, &w.view)?;
        let now = Timestamp::now().as_nanos();
        locked(
            inner,
            &mut w,
            &inode,
            units,
            LockMode::Exclusive,
            Some(now),
            |w, found, mtime| {
                if kill_suidgid {
                    self.kill_suidgid(w, &inode, found.mode, handle.caller)?;
                }
                body(w, &inode, found, mtime)
            },
        )
    }

    /// One step of [`CitronFs::fallocate`] on `range`, holding its range lock; `found` is what
    /// the FCB held at its start, `mtime` the time to raise MTIME to when the release does not
    /// (see [`locked`]).
    fn fallocate_step(
        &self,
        w: &mut Worker,
        inode: &Arc<OpenInode>,
        found: Fcb,
        mtime: Option<u64>,
        range: Range<u64>,
        mode: Fallocate,
    ) -> Result<(), Error> {
        let size = found.size;
        // The bytes of the range that get chunks: all of it, or what lies below SIZE.
        let alloc_end = match mode {
            Fallocate::Allocate => range.end,
            Fallocate::KeepSize | Fallocate::PunchHole => range.end.min(size),
        };
        if alloc_end > range.start {
            if mode == Fallocate::PunchHole {
                self.punch(w, inode, found.generation, range.start..alloc_end)?;
            } else {
                let n = usize::try_from(alloc_end - range.start)
                    .map_err(|_| FsError::Invalid("fallocate range too large".into()))?;
                let view = w.view.clone();
                self.inner
                    .chunk_locations(&view, inode, found.generation, range.start, n, true)?;
            }
        }
        // SIZE (mode 0) and MTIME in one batch, after the step's work.
        let end = match mode {
            Fallocate::Allocate => range.end,
            Fallocate::KeepSize | Fallocate::PunchHole => size,
        };
        let raises = FcbRaises::post(w, inode, &found, end, mtime);
        if !raises.is_empty() {
            w.check_lease_before_post()?;
            w.exec_raises()?;
        }
        finish_fcb_raises(&self.inner.meta, w, inode, &raises)
    }

    /// Asks the meta server to clear the set-ID bits a write by a caller without `CAP_FSETID`
    /// clears, when `mode` (the FCB's MODE) has one; nothing otherwise. Under the write's lock.
    fn kill_suidgid(
        &self,
        w: &Worker,
        inode: &OpenInode,
        mode: u16,
        caller: Caller,
    ) -> Result<(), Error> {
        if proto::fcb::setid_to_clear(mode) == 0 {
            return Ok(());
        }
        let set = SetAttr {
            kill_suidgid: true,
            ..SetAttr::default()
        };
        let request = Request::SetAttr {
            ino: inode.ino,
            set,
            caller,
        };
        match self.locked_call(w, request)? {
            Response::Attr(_) => Ok(()),
            other => Err(unexpected("SetAttr", other)),
        }
    }

    /// Makes a call that changes the file under the range lock `w` holds, as a data batch is
    /// posted: only with the lease well ahead ([`Worker::check_lease_before_post`]), and held
    /// to the lease's deadline at the meta server, which refuses to apply it later
    /// (`FsError::Expired`, here [`Error::LeaseLost`]: redone under a new lock). Without the
    /// deadline a call delayed on its way past the lease could truncate or free what the
    /// lock's next holder wrote.
    fn locked_call(&self, w: &Worker, request: Request) -> Result<Response, Error> {
        w.check_lease_before_post()?;
        match self.inner.meta.call_by(request, w.lease) {
            Err(Error::Fs(FsError::Expired)) => Err(Error::LeaseLost),
            other => other,
        }
    }

    /// Makes bytes `[bytes.start, bytes.end)` (not empty) of a file read zeros, under the range
    /// lock covering them: the chunks wholly inside are freed (`Request::FreeChunks`, which
    /// gives their memory back and bumps the file's generation), and the allocated bytes of
    /// the chunks the range only partly covers are overwritten with zeros.
    fn punch(
        &self,
        w: &mut Worker,
        inode: &OpenInode,
        generation: u64,
        bytes: Range<u64>,
    ) -> Result<(), Error> {
        let layout = &self.inner.geometry.layout;
        let whole = layout.chunks_within(bytes.start, bytes.end);
        let zeroed = if whole.is_empty() {
            vec![bytes.clone()]
        } else {
            vec![
                bytes.start..layout.start(whole.start),
                layout.start(whole.end)..bytes.end,
            ]
        };
        let view = w.view.clone();
        for part in zeroed.into_iter().filter(|part| !part.is_empty()) {
            let n = usize::try_from(part.end - part.start)
                .map_err(|_| FsError::Invalid("fallocate range too large".into()))?;
            let locs = self
                .inner
                .chunk_locations(&view, inode, generation, part.start, n, false)?;
            transfer::zero_allocated(w, &self.inner.geometry, part.start, n, &locs)?;
        }
        if !whole.is_empty() {
            let request = Request::FreeChunks {
                ino: inode.ino,
                first: whole.start,
                count: whole.end - whole.start,
            };
            // Refused for the lease, it changed nothing (the meta server applies it in time
            // or not at all); any other outcome may have freed them.
            let answer = self.locked_call(w, request);
            w.changed |= !matches!(answer, Err(Error::LeaseLost));
            match answer? {
                Response::Ok => {}
                other => return Err(unexpected("FreeChunks", other)),
            }
        }
        Ok(())
    }

    /// Makes the file's data durable where its data servers are file-backed (the data half of
    /// `fsync`; docs/ARCHITECTURE.md "fs-client"): flushes every allocated chunk below the size
    /// ([`transfer::flush`]). Every
    /// write this client acknowledged had completed its data verbs before returning, so the
    /// flushes cover it.
    fn flush_data(&self, w: &mut Worker, inode: &OpenInode) -> Result<(), Error> {
        let Fcb {
            size, generation, ..
        } = read_fcb(w, inode)?;
        if size == 0 {
            return Ok(());
        }
        let len = usize::try_from(size).map_err(|_| FsError::Invalid("file too large".into()))?;
        let run = self
            .inner
            .chunk_locations(&w.view.clone(), inode, generation, 0, len, false)?;
        transfer::flush(w, &self.inner.geometry, &run)
    }

    /// Truncates (or extends) under the whole-file lock, so that no read or write of any client
    /// overlaps the `SetAttr`.
    pub(crate) fn truncate(
        &self,
        inode: &Arc<OpenInode>,
        caller: Caller,
        set: SetAttr,
    ) -> Result<Attr, Error> {
        let started = Instant::now();
        // Redone like a write when it failed below the file system, and while the data server
        // holding the new last chunk is away (the meta server refuses a shrink whose tail it
        // cannot zero then): the same size set again is the same change.
        let inner = &*self.inner;
        inner.retry(started, true, || {
            let mut w = inner.checkout()?;
            let inode = &inner.live_inode(inode, &w.view)?;
            let ino = inode.ino;
            let set = set.clone();
            locked(
                inner,
                &mut w,
                inode,
                WHOLE_FILE,
                LockMode::Exclusive,
                None,
                |w, _, _| match self.locked_call(w, Request::SetAttr { ino, set, caller })? {
                    Response::Attr(attr) => Ok(attr),
                    other => Err(unexpected("SetAttr", other)),
                },
            )
        })
    }
}
