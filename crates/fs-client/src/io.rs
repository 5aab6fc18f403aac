//! The data path (docs/ARCHITECTURE.md "fs-client"): [`CitronFs::read`], [`CitronFs::write`],
//! [`CitronFs::fsync`], and truncation under the whole-file lock. Read top-down, one locked I/O
//! is:
//!
//! 1. check out a worker (`workers`): its own endpoints and lock handles;
//! 2. **lock** `[off, off+len)` rounded outward to lock units ([`Inner::locked`]; an `O_APPEND`
//!    write locks the whole file) and note the lock's lease deadline. SIZE, GENERATION, MTIME
//!    and MODE of the file control block (`fcb`) ride in the lock's granting batch
//!    (`lockmgr::RangeLock::acquire_with`): no round trip of their own;
//! 3. find the chunks (`chunks`; a write allocates the missing run with one RPC);
//! 4. **post the data verbs**, one batch per data server ([`Inner::transfer_read`],
//!    [`Inner::transfer_write`]), **checking the lease**: a write's verbs are posted only while
//!    the lease has more than `lease_guard` left, a read's are checked after they completed;
//! 5. (writes) **raise the FCB words** in one batch on the meta endpoint posted beside the data
//!    batches and awaited with them (`fcb`'s `FcbRaises`): SIZE with a CAS when the write
//!    extends the file, and MTIME where the release cannot carry it (step 6). Under the lock
//!    their order does not matter: no reader of the range gets the lock before the release.
//!    A SIZE CAS that lost to another writer's smaller raise is redone before the release, so
//!    a reader that locks after it finds the new size;
//! 6. **release**, only after the data verbs and the raises completed (or failed); where the
//!    release is one-sided verbs, a write's MTIME raise rides at the head of its batch (`fcb`'s
//!    `MtimeRaise`).
//!
//! So a 4 KiB read or write on one data server takes three round trips in sequence
//! (acquire, data with the raises beside it, release; uncontended, with a fabric lock scheme).
//! Where the lock is acquired at the meta server (tcp, `lockmgr::citron::hosted`), the release
//! is posted and a read or write waits for two.
//!
//! A write that fails after its raises landed (a data server died, the lease ran out) is redone
//! like any other; if it ends in EIO, the file may keep the size it raised, and the bytes it
//! did not land read zeros (chunks are zeroed before they are handed out).
//!
//! When the lease ran out mid-I/O (`Error::LeaseLost`), the whole read or write is redone
//! under a new lock ([`Inner::retry`], [`LEASE_RETRIES`] times, then EIO), so a client
//! that was merely slow never lands a write outside its lock (docs/ARCHITECTURE.md "Fencing") — but only
//! while nothing of it was sent: a write that lost its lease after one data server's batch
//! went out fails with EIO (`Error::LeaseLostPartway`, [`Inner::locked`]), since the release
//! hands the next holder a range with that part in it, and a redo reported done would make
//! the next holder's read of it a torn read of a successful write.
//!
//! When it failed below the file system (`Error::is_transient`: a server restarted, a
//! connection broke, a chunk on a data server this client did not know yet), the client
//! catches up with the cluster (`view`'s `recover`: reconnects, fetches the layout, waits for
//! the data server) and redoes the whole I/O, with growing pauses, until the call's bound runs
//! out — `view::DATA_SERVER_WAIT` after the call began, or after the client first found the
//! data server away in this outage, whichever is earlier (`Inner::data_deadline`, the one
//! place it is decided) — then EIO. No attempt starts past it, so a call ends within it plus
//! at most the attempt in flight (a silent server: the fabric's batch or connect bound). (The
//! meta server may learn of a data server's death a moment after its clients, so the layout
//! can still name the dead address for a while.) A request that never left because the
//! connection was already dead (the kernel gave it up during a cut that has healed since) is
//! such a failure: it is redone on a fresh connection.
//! Redoing is safe: a read has no effect, and a write writes the same bytes at the same offsets
//! under a new lock (an `O_APPEND` write, whose offset is the size it found, is not redone: its
//! first attempt may have raised the size already). Every attempt starts from a worker and an
//! open of the current view (`view`'s `live_inode`).
//!
//! Invariants: the lock is held from the batch that read the FCB (its granting batch) until
//! after the last data verb and the SIZE raise completed; a worker whose verbs or lock release failed is marked broken and
//! never reused; no shared lock is held while verbs are in flight.

use crate::chunks::ChunkRun;
use crate::client::{CitronFs, FileHandle, Inner};
use crate::error::{Error, Peer};
use crate::fcb::{check_owner, Fcb, FcbRaises, FcbReads, MtimeRaise};
use crate::handles::{Handle, OpenInode};
use crate::locks::{file_range, WHOLE_FILE};
use crate::meta::unexpected;
use crate::plan::{plan, Limits, Op, ServerPlan};
use crate::workers::Worker;
use fabric::{Batch, RemoteAddr};
use lockmgr::LockStats;
use proto::rpc::{Request, Response};
use proto::{Attr, Caller, FsError, SetAttr, Timestamp, INCARNATION_REGION};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// The fabric traffic of the data path: what [`CitronFs::io_stats`] reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Locked I/Os done (each read, write, fallocate step and truncate takes one range lock;
    /// one redone after a lost lease or a failure counts again).
    pub locked_ios: u64,
    /// Fabric round trips they took, all endpoints together: the lock's, the meta region's
    /// (FCB, chunk tables) and the data servers'. RPCs to the meta server (allocating chunks)
    /// are not fabric round trips and are not counted.
    pub round_trips: u64,
    /// Those of them spent acquiring and releasing the range lock (FCB words carried in them
    /// included).
    pub lock_round_trips: u64,
    /// Nanoseconds they took, each from the start of its acquire to the end of its release:
    /// the library's own time of a read or write, wherever it is called from (a FUSE request
    /// thread, or a caller of the library), apart from looking up its handle.
    pub locked_nanos: u64,
}

impl IoStats {
    /// The counts accumulated since `earlier` was taken.
    pub fn since(&self, earlier: &IoStats) -> IoStats {
        IoStats {
            locked_ios: self.locked_ios - earlier.locked_ios,
            round_trips: self.round_trips - earlier.round_trips,
            lock_round_trips: self.lock_round_trips - earlier.lock_round_trips,
            locked_nanos: self.locked_nanos - earlier.locked_nanos,
        }
    }

    /// Mean microseconds per locked I/O (`None` when there was none).
    pub fn mean_locked_us(&self) -> Option<f64> {
        (self.locked_ios > 0).then(|| self.locked_nanos as f64 / 1e3 / self.locked_ios as f64)
    }
}

/// The client's [`IoStats`], summed by every call as it finishes its locked I/O.
#[derive(Default)]
pub(crate) struct IoCounters {
    locked_ios: AtomicU64,
    round_trips: AtomicU64,
    lock_round_trips: AtomicU64,
    locked_nanos: AtomicU64,
}

/// Where a locked I/O's counting started ([`IoCounters::start`]).
struct IoStart {
    /// The round trips of the worker's own endpoints (meta region, data servers) then.
    round_trips: u64,
    at: Instant,
}

impl IoCounters {
    /// Starts counting a locked I/O on `w`.
    fn start(&self, w: &Worker) -> IoStart {
        IoStart {
            round_trips: Self::own_round_trips(w),
            at: Instant::now(),
        }
    }

    /// The round trips `w`'s own endpoints (meta region, data servers) have taken so far.
    fn own_round_trips(w: &Worker) -> u64 {
        w.meta_ep.stats().round_trips + w.data_round_trips()
    }

    /// Counts one locked I/O on `w` started at `start`, whose lock handle took `lock_rtts`.
    fn finish(&self, w: &Worker, start: IoStart, lock_rtts: u64) {
        let own = Self::own_round_trips(w).saturating_sub(start.round_trips);
        let nanos = u64::try_from(start.at.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.locked_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.locked_ios.fetch_add(1, Ordering::Relaxed);
        self.round_trips
            .fetch_add(own + lock_rtts, Ordering::Relaxed);
        self.lock_round_trips
            .fetch_add(lock_rtts, Ordering::Relaxed);
    }

    /// The counts so far.
    pub(crate) fn snapshot(&self) -> IoStats {
        IoStats {
            locked_ios: self.locked_ios.load(Ordering::Relaxed),
            round_trips: self.round_trips.load(Ordering::Relaxed),
            lock_round_trips: self.lock_round_trips.load(Ordering::Relaxed),
            locked_nanos: self.locked_nanos.load(Ordering::Relaxed),
        }
    }
}

/// The round trips a lock handle has spent acquiring and releasing.
fn lock_round_trips(stats: &LockStats) -> u64 {
    stats.acquire.round_trips + stats.release.round_trips
}

/// Bytes of a data server's incarnation word, read at the end of every data batch
/// ([`Inner::exec_data_round`]).
const CHECK_BYTES: usize = 8;

/// Where a read's bytes go ([`Inner::transfer_read`]).
enum ReadDest<'a> {
    /// A buffer grown (never shrunk) to what the read needs: its bytes and check words.
    Grow(&'a mut Vec<u8>),
    /// A slice of the caller's, at least as long as the read: the read lands in it where it
    /// also has room for the check words.
    Slice(&'a mut [u8]),
}

impl ReadDest<'_> {
    /// The same destination, for one more try of a read.
    fn reborrow(&mut self) -> ReadDest<'_> {
        match self {
            ReadDest::Grow(buf) => ReadDest::Grow(buf),
            ReadDest::Slice(buf) => ReadDest::Slice(buf),
        }
    }
}

/// How many bytes of zeros one batch of a hole punch writes.
const ZERO_WINDOW: usize = 1 << 20;

/// The bytes of a fallocate done under one range lock; a larger range is done in steps, each
/// atomic by itself (as a write beyond the atomic bound is).
const FALLOCATE_STEP: u64 = 16 << 20;

/// How often one read or write is retried under a new lock after its lease ran out.
const LEASE_RETRIES: u32 = 3;

/// The pause before the first redo after a failure below the file system; the pauses double
/// up to half a second, within the call's bound (`view::DATA_SERVER_WAIT`).
const FIRST_PAUSE: Duration = Duration::from_millis(20);

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
        let handle = self.inner.handle(fh)?;
        self.inner.check_handle_records(fh, handle.inode.ino)?;
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
            inner.locked(&mut w, inode, units.clone(), None, |w, found, _| {
                let (size, generation) = (found.size, found.generation);
                if offset >= size {
                    return Ok(0);
                }
                let n = len.min((size - offset).min(usize::MAX as u64) as usize);
                let locs = inner.chunk_locations(&w.view, inode, generation, offset, n, false)?;
                inner.transfer_read(w, offset, n, &locs, dest.reborrow())?;
                Ok(n)
            })
        })
    }

    /// Writes `data` at `offset` (or at the end of the file for an `O_APPEND` handle) and
    /// returns the bytes written (all of them). Atomic with respect to every read and write of
    /// every client that overlaps it. A handle opened by a caller other than root clears the
    /// file's set-ID bits as Linux does ([`CitronFs::write_as`]).
    pub fn write(&self, fh: FileHandle, offset: u64, data: &[u8]) -> Result<usize, Error> {
        let handle = self.inner.handle(fh)?;
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
        let handle = self.inner.handle(fh)?;
        self.inner.check_handle_records(fh, handle.inode.ino)?;
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
            inner.locked_change(
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
                    inner.transfer_write(w, offset, data, &locs, !raises.is_empty())?;
                    inner.finish_fcb_raises(w, inode, &raises)
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
        let handle = self.inner.handle(fh)?;
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
                inner.locked_change(
                    &handle,
                    units.clone(),
                    kill_suidgid,
                    |w, inode, found, mtime| {
                        inner.fallocate_step(w, inode, found, mtime, at..step_end, mode)
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
        let handle = self.inner.handle(fh)?;
        let inner = &*self.inner;
        inner.retry(started, true, || {
            let mut w = inner.checkout()?;
            let inode = inner.live_inode(&handle.inode, &w.view)?;
            let found = inner.read_fcb(&mut w, &inode)?;
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
        let handle = self.inner.handle(fh)?;
        let inner = &*self.inner;
        // Taken before: a change made while this fsync runs is left for the next one.
        let unsynced = inner.meta.take_unsynced();
        let synced = inner
            .retry(started, true, || {
                let mut w = inner.checkout()?;
                let inode = inner.live_inode(&handle.inode, &w.view)?;
                inner.flush_data(&mut w, &inode)
            })
            .and_then(|()| {
                inner.ok_call(
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

/// What a round of data batches does ([`Inner::exec_plans`], [`Inner::exec_data_round`]).
#[derive(Clone, Copy)]
pub(crate) enum Transfer {
    /// Read (or flush): checked against the lease after they completed.
    Read,
    /// Write: each batch posted only within the lease; with `raises`, the worker's FCB raises
    /// (`Worker::raises`, [`FcbRaises`]) go beside them on the meta endpoint.
    Write {
        /// Whether the worker's raise batch is to be sent.
        raises: bool,
    },
}

/// A data batch's failure as the I/O sees it, and whether the endpoint is broken by it. A
/// batch refused for its expiry (the lock's lease deadline, `fabric::Batch::expire_at`) is
/// `LeaseLost` — the I/O is redone under a new lock — and leaves the endpoint fine; any other
/// failure leaves the endpoint's state unknown.
fn data_failure(e: Error) -> (Error, bool) {
    match e {
        Error::Fabric {
            source: fabric::FabricError::Verb(fabric::VerbError::Expired { .. }),
            ..
        } => (Error::LeaseLost, false),
        e => (e, true),
    }
}

impl Inner {
    /// Runs `op` (one whole locked read or write) again when its lock's lease ran out before
    /// its verbs were done, up to [`LEASE_RETRIES`] times: a stalled client gets a fresh lock
    /// rather than an error, and only one that keeps stalling sees EIO. With `redo`, also after
    /// a failure below the file system, once the client has caught up with the cluster, until
    /// the call's bound runs out (`view`'s [`Inner::data_deadline`]: `DATA_SERVER_WAIT` after
    /// `started`, when the call began; see the module docs). No attempt starts after it; one
    /// that finds a data server still away in an outage older than the bound fails once the
    /// client has caught up (`recover`), without waiting.
    pub(crate) fn retry<T>(
        &self,
        started: Instant,
        redo: bool,
        mut op: impl FnMut() -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut lease_retries = 0;
        let mut recoveries = 0;
        let mut pause = FIRST_PAUSE;
        loop {
            // An atomic load: the session's id sits behind a mutex, and this runs every I/O.
            let generation = self.meta.generation();
            match op() {
                // Fenced: the fabric servers refuse this session's verbs for good (a lock it
                // held was broken while it was stopped or cut off). This I/O fails — its verbs
                // may have landed in part before the fence — and the client joins again in a
                // new session for the next ones, unless it has already.
                Err(e) if e.is_fenced() => {
                    self.meta.session_ended(generation);
                    return Err(e);
                }
                Err(Error::LeaseLost) if lease_retries < LEASE_RETRIES => {
                    lease_retries += 1;
                    tracing::warn!(
                        attempt = lease_retries,
                        "range lock lease ran out mid-I/O; retrying under a new lock"
                    );
                }
                // Not once the client is going away (`CitronFs::shutting_down`): a cluster
                // that died with the process that started it would hold every request in
                // flight at the unmount for the whole budget, one after another per worker.
                Err(e)
                    if redo
                        && e.is_transient()
                        && !self.meta.is_closing()
                        && Instant::now() < self.data_deadline(started, None) =>
                {
                    recoveries += 1;
                    tracing::warn!(
                        attempt = recoveries,
                        error = %crate::error::Chain(&e),
                        "I/O failed below the file system; catching up with the cluster and \
                         redoing it"
                    );
                    if recoveries > 1 {
                        let left = self
                            .data_deadline(started, None)
                            .saturating_duration_since(Instant::now());
                        std::thread::sleep(pause.min(left));
                        pause = (pause * 2).min(Duration::from_millis(500));
                    }
                    self.recover(e, started)?;
                }
                other => return other,
            }
        }
    }

    /// One attempt of a change to `handle`'s file under the range lock of `units` (a write, a
    /// fallocate step): a worker, the current open of the file, the start time — mtime and
    /// ctime move to it; like Linux, it is taken before the data lands — and the lock
    /// ([`Inner::locked`]); the set-ID bits are cleared first when `kill_suidgid`
    /// ([`Inner::kill_suidgid`]). Then `body` runs with the worker, the open inode, the FCB
    /// words the acquisition found, and the MTIME raise it must post itself, if any.
    fn locked_change<T>(
        &self,
        handle: &Handle,
        units: Range<u64>,
        kill_suidgid: bool,
        body: impl FnOnce(&mut Worker, &Arc<OpenInode>, Fcb, Option<u64>) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut w = self.checkout()?;
        let inode = self.live_inode(&handle.inode, &w.view)?;
        let now = Timestamp::now().as_nanos();
        self.locked(&mut w, &inode, units, Some(now), |w, found, mtime| {
            if kill_suidgid {
                self.kill_suidgid(w, &inode, found.mode, handle.caller)?;
            }
            body(w, &inode, found, mtime)
        })
    }

    /// Runs `body` holding units `units` of `inode` locked, with the file's FCB words as the
    /// acquisition found them; releases after it, whatever it returned. A failed acquisition
    /// or release marks the worker broken (its lock handle is in doubt).
    ///
    /// `touch` (a write's start time) asks for MTIME to be raised to it ([`MtimeRaise`]): at
    /// the head of the release batch where the release is one-sided verbs that carry it for
    /// free (`lockmgr::RangeLock::release_carries_verbs`), else by `body`, which is then given
    /// the time as its third argument and posts the raise beside its data ([`FcbRaises`]).
    ///
    /// Round trips: the FCB reads ride in the lock's granting batch ([`FcbReads`]; the lock
    /// handle's endpoint reaches the meta region, where the lock words and the FCB live), and
    /// the MTIME raise in a batch waited for anyway, so a locked I/O costs the lock's own round
    /// trips plus its data batches: three in sequence for a 4 KiB read or overwrite on one data
    /// server, two where the release is posted (CITRON at the host). A scheme that cannot carry
    /// verbs in its acquisition (a lock service) reads the FCB on the worker's meta endpoint, one
    /// round trip more, after the grant.
    pub(crate) fn locked<T>(
        &self,
        w: &mut Worker,
        inode: &Arc<OpenInode>,
        units: Range<u64>,
        touch: Option<u64>,
        body: impl FnOnce(&mut Worker, Fcb, Option<u64>) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let range = file_range(&self.scheme, inode.ino, units)?;
        let before = self.io.start(w);
        let mut extra = std::mem::take(&mut w.batch);
        let mut out = std::mem::take(&mut w.out);
        extra.clear();
        let reads = FcbReads::post(&mut extra, inode);
        let lock = w.locks.handle(self, &w.view, inode)?;
        let lock_before = lock.stats();
        let (touch_at_release, touch_in_body) = match lock.release_carries_verbs() {
            true => (touch, None),
            false => (None, touch),
        };
        let acquired = lock
            .acquire_with(range, &extra, &mut out, &mut *w.meta_ep)
            .map(|id| (id, lock.lease_deadline(id)));
        let (id, lease) = match acquired {
            Ok(held) => held,
            Err(e) => {
                w.batch = extra;
                w.out = out;
                w.broken = true;
                return Err(Error::lock(inode.ino)(e));
            }
        };
        let found = reads.decode(&out);
        w.batch = extra;
        w.out = out;
        self.hold_lease(w, lease);
        w.changed = false;
        failpoint!("fs_client::io::locked");
        // An FCB that is not this file's is refused before any data verb or raise touches it
        // (the lock is released all the same).
        let (result, owned) = match check_owner(inode, found.ino) {
            Ok(()) => (body(w, found, touch_in_body), true),
            Err(e) => (Err(e), false),
        };
        // A lease lost partway through a change: the release below hands the range to the
        // next holder with that part in it, so the change must not be redone and reported
        // done — another client may read the part in between, a torn read of a write that
        // then succeeded. It fails instead, as a write cut by a crash does.
        let result = match result {
            Err(Error::LeaseLost) if w.changed => Err(Error::LeaseLostPartway),
            other => other,
        };
        self.hold_lease(w, None);
        w.changed = false;
        let mut extra = std::mem::take(&mut w.batch);
        let mut out = std::mem::take(&mut w.out);
        extra.clear();
        let raise = touch_at_release
            .filter(|_| owned)
            .and_then(|now| MtimeRaise::post(&mut extra, inode, found.mtime, now));
        let meta_ep = &mut *w.meta_ep;
        let mut lock_rtts = 0;
        let released = w.locks.handle(self, &w.view, inode).and_then(|l| {
            let released = l
                .release_with(id, &extra, &mut out, meta_ep)
                .map_err(Error::lock(inode.ino));
            lock_rtts = lock_round_trips(&l.stats()) - lock_round_trips(&lock_before);
            released
        });
        w.batch = extra;
        let released = released.and_then(|()| match &raise {
            Some(raise) => self.finish_mtime_raise(w, inode, raise, &out),
            None => Ok(()),
        });
        w.out = out;
        if released.is_err() {
            w.broken = true;
        }
        self.io.finish(w, before, lock_rtts);
        let value = result?;
        released?;
        Ok(value)
    }

    /// Records in `w` the lease deadline of the lock it now holds (`None`: none, or one never
    /// broken) and when its batches expire: `lease_guard / 2` before the deadline.
    ///
    /// Why earlier than the deadline: past its expiry no verb of a batch starts at the server,
    /// and an endpoint waits for the reply only [`fabric::REPLY_AFTER_EXPIRY`] longer. So a
    /// holder whose data server went silent (a cut link, a stopped host) gets its call back
    /// while the lease still runs and releases the lock in time: the next holder finds the
    /// range free instead of starving on bits left for lazy recovery (one `T_lease` or more).
    /// A batch expiring at the deadline itself would be given up only at it, and released
    /// late. Posts need `lease_guard` left ([`Inner::check_lease_before_post`]), so a batch
    /// always has at least `lease_guard / 2` to execute in.
    fn hold_lease(&self, w: &mut Worker, lease: Option<Instant>) {
        w.lease = lease;
        w.expires = lease.map(|d| d.checked_sub(self.lease_guard / 2).unwrap_or(d));
    }

    /// Fencing, client side (docs/ARCHITECTURE.md "Fencing"): data verbs that change the file are posted
    /// only while the guarding lock's lease has more than `lease_guard` left, so that they
    /// execute before any other client can break the lock. The guard is twice the cluster's
    /// `fence_after`: a client stopped between this check and its post for long enough to
    /// land late is silent that long, and the breaker's `Fence` revokes it first (tcp).
    pub(crate) fn check_lease_before_post(&self, w: &Worker) -> Result<(), Error> {
        match w.lease {
            Some(deadline) if Instant::now() + self.lease_guard > deadline => Err(Error::LeaseLost),
            _ => Ok(()),
        }
    }

    /// Reads are validated after the fact: data read before the lease deadline was read under
    /// the lock; data read later may mix in another client's write.
    fn check_lease_after_read(&self, w: &Worker) -> Result<(), Error> {
        match w.lease {
            Some(deadline) if Instant::now() >= deadline => Err(Error::LeaseLost),
            _ => Ok(()),
        }
    }

    /// Reads bytes `[off, off + n)` into the first `n` bytes of `dest` (holes read zeros),
    /// growing a `Vec` when it is shorter than the read needs (see [`CitronFs::read_into`]).
    ///
    /// No second copy: the fabric's reads land in `dest`, each at its place
    /// (`fabric::Batch::read_to`): a memcpy straight from the region on `shm` and `mem`, one
    /// from the reply frame on `tcp`. The batches of every data server are in flight together
    /// ([`Inner::exec_data_round`]).
    fn transfer_read(
        &self,
        w: &mut Worker,
        off: u64,
        n: usize,
        run: &ChunkRun,
        dest: ReadDest<'_>,
    ) -> Result<(), Error> {
        let plans = plan(&self.geometry, off, n, |c| run.get(c), Limits::FABRIC)?;
        // The file's bytes, then one incarnation word per batch of a round (see
        // `exec_data_round`).
        let need = n + CHECK_BYTES * plans.len();
        let buf = match dest {
            ReadDest::Grow(buf) => {
                if buf.len() < need {
                    buf.resize(need, 0);
                }
                &mut buf[..need]
            }
            ReadDest::Slice(buf) if buf.len() >= need => &mut buf[..need],
            ReadDest::Slice(buf) => {
                // No room for the check words after the bytes: read into a buffer of our
                // own and copy the bytes out.
                let mut own = Vec::new();
                self.transfer_read(w, off, n, run, ReadDest::Grow(&mut own))?;
                buf[..n].copy_from_slice(&own[..n]);
                return Ok(());
            }
        };
        // A reused buffer holds an earlier read's bytes: the verbs overwrite the allocated
        // chunks' bytes, holes are zeroed here.
        for piece in self.geometry.pieces(off, n) {
            if run.get(piece.chunk).is_none() {
                buf[piece.buf_off..piece.buf_off + piece.len].fill(0);
            }
        }
        self.exec_plans(w, &plans, buf, n, Transfer::Read, |batch, at, op| {
            batch.read_to(at, op.len, op.buf_off);
        })?;
        self.check_lease_after_read(w)
    }

    /// One step of [`CitronFs::fallocate`] on `range`, holding its range lock; `found` is what
    /// the FCB held at its start, `mtime` the time to raise MTIME to when the release does not
    /// (see [`Inner::locked`]).
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
                self.chunk_locations(&view, inode, found.generation, range.start, n, true)?;
            }
        }
        // SIZE (mode 0) and MTIME in one batch, after the step's work.
        let end = match mode {
            Fallocate::Allocate => range.end,
            Fallocate::KeepSize | Fallocate::PunchHole => size,
        };
        let raises = FcbRaises::post(w, inode, &found, end, mtime);
        if !raises.is_empty() {
            self.check_lease_before_post(w)?;
            w.exec_raises()?;
        }
        self.finish_fcb_raises(w, inode, &raises)
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
    /// posted: only with the lease well ahead ([`Inner::check_lease_before_post`]), and held
    /// to the lease's deadline at the meta server, which refuses to apply it later
    /// (`FsError::Expired`, here [`Error::LeaseLost`]: redone under a new lock). Without the
    /// deadline a call delayed on its way past the lease could truncate or free what the
    /// lock's next holder wrote.
    fn locked_call(&self, w: &Worker, request: Request) -> Result<Response, Error> {
        self.check_lease_before_post(w)?;
        match self.meta.call_by(request, w.lease) {
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
        let layout = &self.geometry.layout;
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
            let locs = self.chunk_locations(&view, inode, generation, part.start, n, false)?;
            self.zero_allocated(w, part.start, n, &locs)?;
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

    /// Overwrites with zeros the allocated bytes of `[off, off + len)` (holes already read
    /// zeros), in windows of [`ZERO_WINDOW`] bytes, each batch posted within the lease.
    fn zero_allocated(
        &self,
        w: &mut Worker,
        off: u64,
        len: usize,
        run: &ChunkRun,
    ) -> Result<(), Error> {
        let zeros = vec![0u8; ZERO_WINDOW.min(len)];
        let mut done = 0usize;
        while done < len {
            let n = (len - done).min(ZERO_WINDOW);
            self.transfer_write(w, off + done as u64, &zeros[..n], run, false)?;
            done += n;
        }
        Ok(())
    }

    /// Writes `data` at file offset `off`; chunks `run` does not have allocated are skipped
    /// (holes: what `zero_allocated` relies on; a write allocates its chunks first). The
    /// batches of every data server are in flight together, each posted within the lease
    /// ([`Inner::exec_data_round`]); with `raises`, the worker's FCB raises go beside the first
    /// round.
    fn transfer_write(
        &self,
        w: &mut Worker,
        off: u64,
        data: &[u8],
        run: &ChunkRun,
        raises: bool,
    ) -> Result<(), Error> {
        let plans = plan(
            &self.geometry,
            off,
            data.len(),
            |c| run.get(c),
            Limits::FABRIC,
        )?;
        let mut checks = vec![0u8; CHECK_BYTES * plans.len()];
        self.exec_plans(
            w,
            &plans,
            &mut checks,
            0,
            Transfer::Write { raises },
            |batch, at, op| {
                batch.write(at, &data[op.buf_off..op.buf_off + op.len]);
            },
        )
    }

    /// Executes `plans` in rounds of one batch per data server ([`Inner::exec_data_round`]),
    /// each batch filled by `fill` with the verbs of its ops (given the op's remote address).
    /// A write's FCB raises (if any) go with the first round.
    fn exec_plans(
        &self,
        w: &mut Worker,
        plans: &[ServerPlan],
        data: &mut [u8],
        checks_at: usize,
        mut transfer: Transfer,
        mut fill: impl FnMut(&mut Batch, RemoteAddr, &Op),
    ) -> Result<(), Error> {
        let rounds = plans.iter().map(|sp| sp.batches.len()).max().unwrap_or(0);
        for r in 0..rounds {
            let mut round = Vec::with_capacity(plans.len());
            for sp in plans {
                let Some(pb) = sp.batches.get(r) else {
                    continue;
                };
                let region = w.view.servers.region_of(sp.server)?;
                let mut batch = self.round_batch(w, round.len());
                for op in &pb.ops {
                    fill(&mut batch, RemoteAddr::new(region, op.remote_off), op);
                }
                round.push((sp.server, batch));
            }
            self.exec_data_round(w, &mut round, data, checks_at, transfer)?;
            // The raises went with the first round.
            if let Transfer::Write { raises } = &mut transfer {
                *raises = false;
            }
        }
        // No round to go beside (nothing allocated to write): the raises go alone.
        if let Transfer::Write { raises: true } = transfer {
            self.check_lease_before_post(w)?;
            w.exec_raises()?;
        }
        Ok(())
    }

    /// An empty batch for the `i`-th data server of a round: the worker's own for the first
    /// (a round on one server allocates nothing), a new one for the others.
    fn round_batch(&self, w: &mut Worker, i: usize) -> Batch {
        let mut batch = match i {
            0 => std::mem::take(&mut w.batch),
            _ => Batch::new(),
        };
        batch.clear();
        batch
    }

    /// Executes one round of data batches, at most one per data server, all posted before any
    /// is awaited (`fabric::Endpoint::post`, then `complete`), so their round trips overlap.
    /// Their reads land in `data` at their places (`fabric::Batch::read_to`); `data` is the
    /// caller's buffer, lent to the worker's completions and taken back, never copied. With
    /// `write`, each batch is posted only while the lock's lease has `lease_guard` left
    /// ([`Inner::check_lease_before_post`]). A failure marks the worker broken: the endpoints'
    /// state is unknown, so they must not be reused.
    ///
    /// Every batch posted is completed before this returns, whatever failed: the caller
    /// releases its lock next, and no verb of its may be in flight then.
    ///
    /// Each batch ends with a read of its server's incarnation word (`proto::INCARNATION_REGION`)
    /// after the data verbs, placed at `data[checks_at + 8 i..]` for the round's `i`-th batch:
    /// if it is not the incarnation of this worker's view, the verbs reached memory other than
    /// the one the view describes (the server restarted, and this client has not caught up
    /// yet), so their outcome is discarded with `Error::StaleDataServer` (transient: the I/O is
    /// redone once the view is fresh). A read therefore never returns a new incarnation's zeros
    /// for chunks the meta server now calls lost; a write that landed there only wrote into
    /// chunks of the same file (lost chunks stay allocated to their file until it frees them)
    /// and is redone, failing with `Lost`.
    ///
    /// A write's FCB raises (`Transfer::Write { raises: true }`: the worker's raise batch) are
    /// posted on the meta endpoint after the data batches, within the lease and expiring with
    /// it like them, and completed with them into their own completions: their round trip
    /// overlaps the data's.
    pub(crate) fn exec_data_round(
        &self,
        w: &mut Worker,
        round: &mut [(u32, Batch)],
        data: &mut [u8],
        checks_at: usize,
        transfer: Transfer,
    ) -> Result<(), Error> {
        let mut out = std::mem::take(&mut w.out);
        // The reads land in the caller's buffer, lent for the round: no copy.
        let failure = out.lend(data, |out| {
            self.post_and_complete(w, round, out, checks_at, transfer)
        });
        w.out = out;
        if let Some((_, first)) = round.iter_mut().next() {
            w.batch = std::mem::take(first);
        }
        failure.map_or(Ok(()), Err)
    }

    /// [`Inner::exec_data_round`]'s work, with the caller's buffer lent to `out`: posts the
    /// round's batches (and the raises), completes every one posted, and checks the
    /// incarnation words; the first failure, if any.
    fn post_and_complete(
        &self,
        w: &mut Worker,
        round: &mut [(u32, Batch)],
        out: &mut fabric::Completions,
        checks_at: usize,
        transfer: Transfer,
    ) -> Option<Error> {
        let (write, raises) = match transfer {
            Transfer::Read => (false, false),
            Transfer::Write { raises } => (true, raises),
        };
        let incarnation = RemoteAddr::new(INCARNATION_REGION, 0);
        let mut posted = 0;
        let mut failure = None;
        let batches = round.len();
        for (i, (server, batch)) in round.iter_mut().enumerate() {
            batch.read_to(incarnation, CHECK_BYTES, checks_at + CHECK_BYTES * i);
            // No verb of it may execute after the lease: the endpoint (or the server, on tcp)
            // checks before each verb, so a batch posted in time but delayed past the deadline
            // stops there (`LeaseLost`, the I/O is redone) instead of landing after a waiter
            // broke the lock.
            batch.expire_at(w.expires);
            if write {
                // A lease that ran out is not a fault of the endpoints: not broken.
                if let Err(e) = self.check_lease_before_post(w) {
                    failure = Some(e);
                    break;
                }
            }
            let post = w.data_ep(*server).and_then(|ep| {
                ep.post(batch, out)
                    .map_err(Error::fabric(Peer::Data(*server)))
            });
            if let Err(e) = post {
                let (e, broken) = data_failure(e);
                w.broken |= broken;
                failure = Some(e);
                break;
            }
            posted += 1;
            w.changed |= write;
            if write && i + 1 < batches {
                failpoint!("fs_client::io::between_servers");
            }
        }
        let mut raises_posted = false;
        if raises && failure.is_none() {
            w.raises.expire_at(w.expires);
            let post = match self.check_lease_before_post(w) {
                // A lease that ran out is not a fault of the endpoint: not broken.
                Err(e) => Err((e, false)),
                Ok(()) => w
                    .meta_ep
                    .post(&w.raises, &mut w.raises_out)
                    .map_err(|e| data_failure(Error::fabric(Peer::Meta)(e))),
            };
            match post {
                Ok(()) => {
                    raises_posted = true;
                    w.changed = true;
                }
                Err((e, broken)) => {
                    w.broken |= broken;
                    failure = Some(e);
                }
            }
        }
        for (server, batch) in round[..posted].iter() {
            let done = w.data_ep(*server).and_then(|ep| {
                ep.complete(batch, out)
                    .map_err(Error::fabric(Peer::Data(*server)))
            });
            if let Err(e) = done {
                let (e, broken) = data_failure(e);
                w.broken |= broken;
                failure.get_or_insert(e);
            }
        }
        if raises_posted {
            if let Err(e) = w.meta_ep.complete(&w.raises, &mut w.raises_out) {
                let (e, broken) = data_failure(Error::fabric(Peer::Meta)(e));
                w.broken |= broken;
                failure.get_or_insert(e);
            }
        }
        if failure.is_none() {
            for (i, (server, _)) in round.iter().enumerate() {
                let at = checks_at + CHECK_BYTES * i;
                let found = u64::from_le_bytes(
                    out.data()[at..at + CHECK_BYTES]
                        .try_into()
                        .expect("8 bytes"),
                );
                let expected = w.view.servers.data(*server).map(|ds| ds.info.incarnation);
                if expected != Some(found) {
                    w.broken = true;
                    failure = Some(Error::StaleDataServer {
                        server: *server,
                        expected: expected.unwrap_or(0),
                        found,
                    });
                    break;
                }
            }
        }
        failure
    }

    /// Makes the file's data durable where its data servers are file-backed (the data half of
    /// `fsync`; docs/ARCHITECTURE.md "fs-client"): one batch of flush verbs per data server, covering every
    /// allocated chunk below the size, with runs of adjacent chunks merged into one verb. Every
    /// write this client acknowledged had completed its data verbs before returning, so the
    /// flushes cover it.
    fn flush_data(&self, w: &mut Worker, inode: &OpenInode) -> Result<(), Error> {
        let Fcb {
            size, generation, ..
        } = self.read_fcb(w, inode)?;
        if size == 0 {
            return Ok(());
        }
        let len = usize::try_from(size).map_err(|_| FsError::Invalid("file too large".into()))?;
        let run = self.chunk_locations(&w.view.clone(), inode, generation, 0, len, false)?;
        // Byte ranges of the chunks in each server's region.
        let mut per_server: std::collections::BTreeMap<u32, Vec<Range<u64>>> = Default::default();
        for (i, loc) in run.locs.iter().enumerate() {
            let Some(loc) = loc else { continue };
            let chunk = run.first + i as u64;
            let range = self
                .geometry
                .region_range(chunk, *loc)
                .ok_or_else(|| Error::Protocol(format!("chunk {chunk} lies beyond any address")))?;
            per_server.entry(loc.server).or_default().push(range);
        }
        for (server, mut ranges) in per_server {
            ranges.sort_unstable_by_key(|r| r.start);
            let region = w.view.servers.region_of(server)?;
            // One range per run of adjacent chunks.
            let mut runs: Vec<Range<u64>> = Vec::new();
            for r in ranges {
                match runs.last_mut() {
                    Some(last) if last.end == r.start => last.end = r.end,
                    _ => runs.push(r),
                }
            }
            // A batch carries at most MAX_BATCH_VERBS verbs; stay well below.
            for group in runs.chunks(1024) {
                let mut batch = self.round_batch(w, 0);
                for r in group {
                    batch.flush(RemoteAddr::new(region, r.start), r.end - r.start);
                }
                let mut check = vec![0u8; CHECK_BYTES];
                self.exec_data_round(w, &mut [(server, batch)], &mut check, 0, Transfer::Read)?;
            }
        }
        Ok(())
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
        self.retry(started, true, || {
            let mut w = self.checkout()?;
            let inode = &self.live_inode(inode, &w.view)?;
            let ino = inode.ino;
            let set = set.clone();
            self.locked(&mut w, inode, WHOLE_FILE, None, |w, _, _| {
                match self.locked_call(w, Request::SetAttr { ino, set, caller })? {
                    Response::Attr(attr) => Ok(attr),
                    other => Err(unexpected("SetAttr", other)),
                }
            })
        })
    }
}
