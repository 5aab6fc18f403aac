//! FUSE over io_uring (Linux 6.14 and later; CitronFS's addition, see `CITRONFS.md`).
//!
//! Why: on `/dev/fuse` the kernel hands each request to whichever reader thread has waited
//! longest, on whatever CPU it sleeps, so a small request costs two cross-CPU wake-ups (to the
//! reader, and back to the caller). Over io_uring the kernel keeps one queue per CPU and
//! hands a request to an entry registered on the queue of the CPU the caller runs on; our
//! threads for that queue are pinned to that CPU, so both wake-ups stay on one CPU, and the
//! entry committed last is the one used next (the kernel keeps available entries LIFO), so
//! the thread that serves it has a warm cache.
//!
//! The protocol (kernel `fs/fuse/dev_uring.c`, uapi `fuse.h` 7.42):
//! - the INIT reply carries `FUSE_OVER_IO_URING`; then, for every queue (`qid` = CPU number,
//!   one per possible CPU), userspace submits `IORING_OP_URING_CMD` SQE128s with
//!   `FUSE_IO_URING_CMD_REGISTER`, each naming two buffers: a [`HEADER_SIZE`] header
//!   (`fuse_uring_req_header`) and a payload of at least the connection's largest payload;
//! - the kernel switches from `/dev/fuse` to the rings once every queue has an entry, and
//!   until then holds every request (`fuse_block_alloc`): a connection that took
//!   `FUSE_OVER_IO_URING` at INIT never falls back to `/dev/fuse`, so a queue left without a
//!   thread is retried and, failing that, ends the session ([`RingStartError`]);
//!   FORGET, INTERRUPT and notifications keep going through `/dev/fuse`, whose reader threads
//!   therefore stay;
//! - a request arrives as the completion of an entry's last command: the `fuse_in_header` in
//!   the header's `in_out`, the opcode's fixed argument (`in_args[0]`) in `op_in`, the other
//!   arguments in the payload, and `payload_sz` and `commit_id` in `ring_ent_in_out`;
//! - the answer goes back in the same buffers (`fuse_out_header` in `in_out`, the body in the
//!   payload) with `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`, which also offers the entry again.
//!
//! Invariants:
//! - each thread owns one io_uring and serves its entries' requests one at a time, and has
//!   one entry free while it is idle and none while it is busy (after a late answer, see
//!   [`serve`], at most one more): the kernel gives a request only to a free entry, so a
//!   request waits behind a handler that blocks (a server away: seconds) only when every
//!   thread of its CPU's queue is busy. Hence several threads per CPU: a queue serves as many
//!   blocking requests at once as it has threads;
//! - an entry is written by userspace only between the completion that delivered a request
//!   and the commit of its answer, and by exactly one answer: [`RingEntry::answer`] is called
//!   once per request (fuser's `Reply` types send at most once), and when dispatch returns
//!   with no reply outstanding and none sent, the thread answers EIO itself, so no request
//!   can stay without an answer and no entry can be lost;
//! - only the ring's own thread enters the kernel for its ring. io_uring ties a command to the
//!   task that submitted it and cancels it when that task exits, so a commit submitted by a
//!   thread that answers late and then ends (the adapter's `F_SETLKW` waiters) would take the
//!   entry, and the request the kernel gives it next, down with it (ECANCELED to the caller).
//!   An answer from another thread is queued in the submission ring under
//!   `RingEntry::submit_lock` and the ring's thread is woken through its [`Doorbell`] to
//!   submit it.

use std::io;
use std::io::IoSlice;
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::thread;
use std::thread::JoinHandle;
use std::time::Duration;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::debug;
use log::error;
use log::warn;

use crate::Filesystem;
use crate::channel::Channel;
use crate::channel::ChannelSender;
use crate::reply::ReplySender;
use crate::request::RequestWithSender;
use crate::session::FilesystemHolder;
use crate::session::SessionACL;
use crate::session::SessionEventLoop;
use nix::unistd::Uid;

/// `FUSE_IO_URING_CMD_REGISTER`: offer an entry's buffers and wait for a request.
const CMD_REGISTER: u32 = 1;
/// `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`: answer the entry's request and wait for the next.
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// `fuse_in_header`: len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding.
const IN_HEADER_SIZE: usize = 40;
/// `fuse_out_header`: len, error, unique.
const OUT_HEADER_SIZE: usize = 16;
/// `fuse_uring_req_header.op_in` starts here; `in_out` is the 128 bytes before it.
const OP_IN_OFFSET: usize = 128;
/// Size of `op_in`: the largest fixed argument the kernel puts there.
const OP_IN_SIZE: usize = 128;
/// `fuse_uring_req_header.ring_ent_in_out`: flags (u64), commit_id (u64), payload_sz (u32),
/// padding (u32), reserved (u64).
const ENT_IN_OUT_OFFSET: usize = 256;
/// `fuse_uring_ent_in_out.commit_id` (u64) in the header buffer.
const COMMIT_ID_OFFSET: usize = ENT_IN_OUT_OFFSET + 8;
/// `fuse_uring_ent_in_out.payload_sz` (u32): the request's payload bytes, then the answer's.
const PAYLOAD_SZ_OFFSET: usize = ENT_IN_OUT_OFFSET + 16;
/// `sizeof(struct fuse_uring_req_header)`.
const HEADER_SIZE: usize = ENT_IN_OUT_OFFSET + 32;
/// Room kept in front of the payload buffer, where a request's headers are copied so that
/// the request reads as one contiguous `/dev/fuse` message without moving its payload.
const HEADROOM: usize = 4096;

/// `user_data` of the poll of the thread's doorbell (an entry's commands carry its index).
const TAG_DOORBELL: u64 = u64::MAX;
/// Why FUSE over io_uring could not start on a connection that took it at INIT (CitronFS
/// patch): the session ended, since the kernel would hold every request (see
/// [`RingPool::start`]). `Session::spawn` returns it inside an `io::Error`; find it with
/// [`RingStartError::is`]. Mounting again with no ring threads serves over `/dev/fuse`.
#[derive(Debug)]
pub struct RingStartError(pub String);

impl std::fmt::Display for RingStartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FUSE over io_uring could not start: {}", self.0)
    }
}

impl std::error::Error for RingStartError {}

impl RingStartError {
    /// Whether `e` says that the rings could not start.
    pub fn is(e: &io::Error) -> bool {
        e.get_ref()
            .is_some_and(|inner| inner.is::<RingStartError>())
    }

    /// The `io::Error` carrying it.
    pub(crate) fn io(why: &str) -> io::Error {
        io::Error::other(RingStartError(why.to_string()))
    }
}

/// A starting ring thread's report to [`RingPool::start`]: sent once, by `send` or, if the
/// thread unwinds first, by the drop (so that the start never waits for a thread that died).
struct StartReport {
    qid: usize,
    ready: Option<std::sync::mpsc::Sender<(usize, io::Result<()>)>>,
}

impl StartReport {
    fn send(&mut self, result: io::Result<()>) {
        if let Some(ready) = self.ready.take() {
            let _ = ready.send((self.qid, result));
        }
    }
}

impl Drop for StartReport {
    fn drop(&mut self) {
        self.send(Err(io::Error::other("a ring thread died while starting")));
    }
}

/// How many more times a queue left without a ring thread gets one ([`RingPool::start`]).
const START_RETRIES: usize = 2;
/// The most entries a ring thread registers (see [`serve`]).
const MAX_ENTRIES: usize = 64;

/// Wakes a ring's thread: to submit an answer another thread queued, or to stop.
#[derive(Debug)]
struct Doorbell {
    /// An eventfd (non-blocking) the ring's thread polls through its ring.
    fd: OwnedFd,
    /// Set before the bell rings to stop the thread.
    stopping: AtomicBool,
}

impl Doorbell {
    fn new() -> io::Result<Doorbell> {
        // SAFETY: eventfd returns a new descriptor we own, or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Doorbell {
            // SAFETY: `fd` is a fresh descriptor nobody else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            stopping: AtomicBool::new(false),
        })
    }

    fn ring(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own.
        unsafe {
            libc::write(self.fd.as_raw_fd(), (&raw const one).cast(), 8);
        }
    }

    /// Resets the eventfd, so that the next poll waits for the next ring.
    fn quiet(&self) {
        let mut count = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd we own (non-blocking).
        unsafe {
            libc::read(self.fd.as_raw_fd(), (&raw mut count).cast(), 8);
        }
    }

    fn poll(&self) -> squeue::Entry128 {
        opcode::PollAdd::new(types::Fd(self.fd.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(TAG_DOORBELL)
            .into()
    }
}

/// What the session learnt at INIT that the rings need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingSetup {
    /// The connection's largest payload: `max(8192, max_write, max_pages * page size)`, the
    /// least a payload buffer may hold (the kernel refuses smaller ones).
    pub(crate) max_payload: usize,
    /// Threads (each with one entry) per queue.
    pub(crate) threads_per_queue: usize,
}

/// What a session keeps of its rings (its one field for them, `Session::rings`).
#[derive(Debug, Default)]
pub(crate) struct SessionRings {
    /// Set at INIT when FUSE over io_uring was negotiated.
    pub(crate) setup: Option<RingSetup>,
    /// What the rings have served, shared with the `BackgroundSession`.
    pub(crate) counters: Arc<RingCounters>,
    /// Told when the rings have started, or why they could not (the session then ends):
    /// `Session::spawn` returns only then.
    pub(crate) started: Option<std::sync::mpsc::Sender<io::Result<()>>>,
}

/// Requests answered through rings, one counter per ring thread (each written by its thread
/// only, on a cache line of its own), for [`crate::BackgroundSession::ring_requests`].
#[derive(Debug, Default)]
pub(crate) struct RingCounters {
    threads: Mutex<Vec<Arc<Counter>>>,
}

#[derive(Debug, Default)]
#[repr(align(64))]
struct Counter {
    served: std::sync::atomic::AtomicU64,
    /// Cleared when the thread stops serving (its entry ended).
    alive: AtomicBool,
}

impl RingCounters {
    /// Ring threads still serving, and the requests all of them have taken so far.
    pub(crate) fn read(&self) -> (usize, u64) {
        let threads = self.threads.lock().unwrap_or_else(|e| e.into_inner());
        let served = threads
            .iter()
            .map(|c| c.served.load(Ordering::Relaxed))
            .sum();
        let alive = threads
            .iter()
            .filter(|c| c.alive.load(Ordering::Relaxed))
            .count();
        (alive, served)
    }
}

/// The rings' threads, stopped and joined by [`RingPool::stop`].
pub(crate) struct RingPool {
    threads: Vec<(JoinHandle<()>, Arc<Doorbell>)>,
}

/// An anonymous private mapping (page aligned, as the kernel wants the buffers it pins).
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory; who writes it when is ruled by the protocol (module docs).
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped; the ring (and so the kernel's use of the
        // buffers) is gone before the entry that owns this mapping is dropped.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// A ring thread's io_uring, shared by its entries and by whoever answers through them.
pub(crate) struct RingThread {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    /// Serialises pushes to the submission queue (the ring thread's and an answering thread's).
    submit_lock: Mutex<()>,
    owner: thread::ThreadId,
    fuse_fd: i32,
    qid: u16,
    max_payload: usize,
    /// For the answers that are not FUSE answers (passthrough backing ids).
    channel: ChannelSender,
    /// Wakes the ring's thread to submit what another thread queued.
    doorbell: Arc<Doorbell>,
}

impl std::fmt::Debug for RingThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingThread")
            .field("qid", &self.qid)
            .finish()
    }
}

impl RingThread {
    /// Queues `sqe` for the ring's own thread to submit (module docs: only it may), which it
    /// does each time it waits; from another thread, wakes it for that.
    fn push(&self, sqe: &squeue::Entry128) -> io::Result<()> {
        {
            let _guard = self.submit_lock.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: `submit_lock` makes this the only submission queue handle in use.
            let mut sq = unsafe { self.ring.submission_shared() };
            // SAFETY: the command's buffers (its entry's iovecs and mappings) outlive it: an
            // entry lives as long as its thread, which drops the ring first.
            unsafe { sq.push(sqe) }
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        if thread::current().id() != self.owner {
            self.doorbell.ring();
        }
        Ok(())
    }
}

/// One ring entry: its buffers and the request it holds.
pub(crate) struct RingEntry {
    thread: Arc<RingThread>,
    /// Its index in its thread's entries: the `user_data` of its commands.
    index: u64,
    header: Mapping,
    /// `HEADROOM` bytes, then the payload buffer the kernel knows.
    payload: Mapping,
    /// `commit_id` of the request the entry holds, to echo in the commit.
    commit_id: std::sync::atomic::AtomicU64,
    /// Set when the request's answer has been committed (cleared at each new request).
    answered: AtomicBool,
    /// The two buffers named by the register command; must stay put while it is in flight.
    iov: [libc::iovec; 2],
}

// SAFETY: the raw pointers in `iov` and the mappings point into memory the entry owns; the
// protocol (module docs) decides who touches it when.
unsafe impl Send for RingEntry {}
unsafe impl Sync for RingEntry {}

impl std::fmt::Debug for RingEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingEntry")
            .field("qid", &self.thread.qid)
            .field("index", &self.index)
            .finish()
    }
}

impl RingEntry {
    /// Maps an entry's buffers for `thread` (registered by [`RingEntry::register`]).
    fn new(thread: &Arc<RingThread>, index: u64) -> io::Result<RingEntry> {
        let header = Mapping::new(4096)?;
        let payload = Mapping::new(HEADROOM + thread.max_payload)?;
        let iov = [
            libc::iovec {
                iov_base: header.ptr.cast(),
                iov_len: HEADER_SIZE,
            },
            libc::iovec {
                // SAFETY: HEADROOM is inside the mapping.
                iov_base: unsafe { payload.ptr.add(HEADROOM) }.cast(),
                iov_len: thread.max_payload,
            },
        ];
        Ok(RingEntry {
            thread: thread.clone(),
            index,
            header,
            payload,
            commit_id: Default::default(),
            answered: AtomicBool::new(true),
            iov,
        })
    }

    fn payload_ptr(&self) -> *mut u8 {
        // SAFETY: HEADROOM < payload.len by construction.
        unsafe { self.payload.ptr.add(HEADROOM) }
    }

    /// Builds the uring command for `cmd_op`, carrying `fuse_uring_cmd_req`.
    fn command(&self, cmd_op: u32) -> squeue::Entry128 {
        let mut cmd = [0u8; 80];
        // fuse_uring_cmd_req: flags (u64) = 0, commit_id (u64), qid (u16), padding.
        let commit_id = if cmd_op == CMD_COMMIT_AND_FETCH {
            self.commit_id.load(Ordering::Acquire)
        } else {
            0
        };
        cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        cmd[16..18].copy_from_slice(&self.thread.qid.to_ne_bytes());
        let mut builder = opcode::UringCmd80::new(types::Fd(self.thread.fuse_fd), cmd_op).cmd(cmd);
        if cmd_op == CMD_REGISTER {
            builder = builder.addr(Some(self.iov.as_ptr() as u64));
        }
        let sqe = builder.build().user_data(self.index);
        if cmd_op == CMD_REGISTER {
            with_sqe_len(sqe, self.iov.len() as u32)
        } else {
            sqe
        }
    }

    /// Offers the entry to the kernel (queued; the thread's next wait submits it).
    fn register(&self) -> io::Result<()> {
        self.thread.push(&self.command(CMD_REGISTER))
    }

    /// Whether the entry holds a request not yet answered.
    fn holding(&self) -> bool {
        !self.answered.load(Ordering::Acquire)
    }

    /// Writes the answer `data` (a `fuse_out_header`, then the body) into the entry and
    /// commits it: `ReplySender::send` for a request that came through a ring.
    pub(crate) fn answer(&self, data: &[IoSlice<'_>]) -> io::Result<()> {
        let Some((head, body)) = data.split_first() else {
            return Err(io::Error::other("empty FUSE answer"));
        };
        if head.len() != OUT_HEADER_SIZE {
            return Err(io::Error::other("FUSE answer without its header"));
        }
        let max_payload = self.thread.max_payload;
        let body_len: usize = body.iter().map(|s| s.len()).sum();
        let mut out = [0u8; OUT_HEADER_SIZE];
        out.copy_from_slice(head);
        let payload_sz = if body_len > max_payload {
            // Cannot happen for a well-formed answer (bodies are at most what was asked for,
            // and the buffer holds the largest request); answer EIO rather than overflow.
            error!("FUSE answer of {body_len} bytes exceeds the ring's payload buffer");
            out[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            0
        } else {
            let mut at = self.payload_ptr();
            for slice in body {
                // SAFETY: the body fits the payload buffer (checked above), and the entry is
                // ours until the commit below.
                unsafe {
                    std::ptr::copy_nonoverlapping(slice.as_ptr(), at, slice.len());
                    at = at.add(slice.len());
                }
            }
            body_len
        };
        out[0..4].copy_from_slice(&((OUT_HEADER_SIZE + payload_sz) as u32).to_ne_bytes());
        self.commit(&out, payload_sz)
    }

    /// Writes the answer's header `out` and its payload size into the entry's header buffer
    /// and commits the entry (its payload is in place).
    fn commit(&self, out: &[u8; OUT_HEADER_SIZE], payload_sz: usize) -> io::Result<()> {
        // SAFETY: the header mapping is HEADER_SIZE bytes or more and ours until the commit.
        unsafe {
            std::ptr::copy_nonoverlapping(out.as_ptr(), self.header.ptr, OUT_HEADER_SIZE);
            self.header
                .ptr
                .add(PAYLOAD_SZ_OFFSET)
                .cast::<u32>()
                .write_unaligned(payload_sz as u32);
        }
        self.answered.store(true, Ordering::Release);
        self.thread.push(&self.command(CMD_COMMIT_AND_FETCH))
    }

    /// The entry's payload buffer, for an answer written in place
    /// ([`RingEntry::answer_in_place`]), or `None` while it holds the request's own payload
    /// (a request with arguments beyond its first: a WRITE's data, a LOOKUP's name), which
    /// the request being served still reads. A READ's only argument is in the header, so its
    /// answer can be built where the kernel copies it from, with no copy of ours.
    ///
    /// # Safety
    /// The caller must hold the entry's unanswered request (its reply), use the slice only
    /// until it answers, and take no second slice meanwhile.
    // The slice is of the entry's mapped buffer, not of `self`: that it is the only one is
    // the caller's part of the contract above.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn payload_buffer(&self) -> Option<&mut [u8]> {
        if !self.holding() {
            return None;
        }
        // SAFETY: the kernel filled the header before completing the command; it is ours
        // until the commit.
        let payload_sz = unsafe {
            self.header
                .ptr
                .add(PAYLOAD_SZ_OFFSET)
                .cast::<u32>()
                .read_unaligned()
        };
        if payload_sz != 0 {
            return None;
        }
        // SAFETY: the payload buffer is max_payload bytes after HEADROOM; the request's own
        // bytes (`request`) lie before HEADROOM and are not covered; the kernel does not
        // touch the entry until the commit, and the caller takes no other slice of it.
        Some(unsafe { std::slice::from_raw_parts_mut(self.payload_ptr(), self.thread.max_payload) })
    }

    /// Commits an answer whose `len` data bytes the file system wrote at the start of
    /// [`RingEntry::payload_buffer`]: only the header is written here.
    /// A `len` beyond the buffer (a file system's error) is answered `EIO`, as
    /// [`RingEntry::answer`] does, so that the entry is committed whatever it was given.
    pub(crate) fn answer_in_place(&self, unique: u64, len: usize) -> io::Result<()> {
        let mut out = [0u8; OUT_HEADER_SIZE];
        out[8..16].copy_from_slice(&unique.to_ne_bytes());
        let len = if len > self.thread.max_payload {
            error!("FUSE answer of {len} bytes exceeds the ring's payload buffer");
            out[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            0
        } else {
            len
        };
        out[0..4].copy_from_slice(&((OUT_HEADER_SIZE + len) as u32).to_ne_bytes());
        self.commit(&out, len)
    }

    /// Passthrough backing files go through `/dev/fuse` (an ioctl), as without rings.
    pub(crate) fn channel(&self) -> &ChannelSender {
        &self.thread.channel
    }

    /// The request the entry holds, as one contiguous `/dev/fuse` message (headers copied in
    /// front of the payload), or why it cannot be read.
    fn request(&self) -> Result<(&[u8], u64), String> {
        // SAFETY: the kernel filled the header before completing the command; it is ours
        // until the commit.
        let header = unsafe { std::slice::from_raw_parts(self.header.ptr, HEADER_SIZE) };
        let word32 = |at: usize| u32::from_ne_bytes(header[at..at + 4].try_into().unwrap());
        let word64 = |at: usize| u64::from_ne_bytes(header[at..at + 8].try_into().unwrap());
        let len = word32(0) as usize;
        let unique = word64(8);
        let payload_sz = word32(PAYLOAD_SZ_OFFSET) as usize;
        self.commit_id
            .store(word64(COMMIT_ID_OFFSET), Ordering::Release);
        // in.len counts the header and every argument; the payload holds all but the first.
        let op_size = len
            .checked_sub(IN_HEADER_SIZE + payload_sz)
            .filter(|&n| n <= OP_IN_SIZE && payload_sz <= self.thread.max_payload)
            .ok_or_else(|| {
                format!("ring request of {len} bytes with a payload of {payload_sz} bytes")
            })?;
        let start = HEADROOM - op_size - IN_HEADER_SIZE;
        // SAFETY: start..HEADROOM + payload_sz lies in the payload mapping (op_size <=
        // OP_IN_SIZE < HEADROOM - IN_HEADER_SIZE, payload_sz <= max_payload), which the
        // kernel does not touch until the commit.
        let message = unsafe {
            let base = self.payload.ptr;
            std::ptr::copy_nonoverlapping(header.as_ptr(), base.add(start), IN_HEADER_SIZE);
            std::ptr::copy_nonoverlapping(
                header.as_ptr().add(OP_IN_OFFSET),
                base.add(start + IN_HEADER_SIZE),
                op_size,
            );
            std::slice::from_raw_parts(base.add(start), IN_HEADER_SIZE + op_size + payload_sz)
        };
        Ok((message, unique))
    }
}

/// Sets the SQE's `len` (the register command's iovec count), which `UringCmd80` leaves 0.
fn with_sqe_len(entry: squeue::Entry128, len: u32) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: `Entry128` is `repr(C)`: a 64-byte `io_uring_sqe` and 64 more bytes; `len` is
    // the u32 at offset 24 of `io_uring_sqe`. Every bit pattern is a valid `Entry128`.
    unsafe {
        let mut bytes: [u8; 128] = std::mem::transmute(entry);
        bytes[24..28].copy_from_slice(&len.to_ne_bytes());
        std::mem::transmute::<[u8; 128], squeue::Entry128>(bytes)
    }
}

/// Number of queues the kernel makes: one per possible CPU, numbered by CPU id.
fn queue_count() -> io::Result<usize> {
    let possible = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    let highest = possible
        .trim()
        .split(',')
        .filter_map(|range| range.rsplit('-').next()?.parse::<usize>().ok())
        .max()
        .ok_or_else(|| io::Error::other(format!("unreadable CPU list {possible:?}")))?;
    Ok(highest + 1)
}

/// Pins the calling thread to `cpu`, best effort: a CPU outside our affinity (a cgroup's
/// cpuset) still gets its queue served, from wherever the thread runs.
fn pin_to(cpu: usize) {
    // SAFETY: plain libc calls on a zeroed cpu_set_t owned here.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            debug!(
                "fuse ring thread for CPU {cpu} not pinned: {}",
                io::Error::last_os_error()
            );
        }
    }
}

impl RingPool {
    /// Starts `setup.threads_per_queue` threads for every queue, each registering its first
    /// entry, and returns once each has registered it or failed to. Threads that failed are
    /// gone; a queue left with none gets another thread, up to [`START_RETRIES`] times. The
    /// others stay if every queue has one (logged).
    ///
    /// Otherwise they are stopped and the error returned, and the connection cannot serve:
    /// once the INIT answer took `FUSE_OVER_IO_URING`, the kernel holds every request until
    /// each queue has an entry, and does not fall back to `/dev/fuse` (`fuse_block_alloc`), so
    /// the session must end rather than wait (see `Session::run`).
    pub(crate) fn start<FS: Filesystem + 'static>(
        setup: RingSetup,
        ch: &Channel,
        filesystem: Arc<FilesystemHolder<FS>>,
        allowed: SessionACL,
        session_owner: Uid,
        counters: &RingCounters,
    ) -> io::Result<RingPool> {
        let queues = queue_count()?;
        let mut pool = RingPool {
            threads: Vec::new(),
        };
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<(usize, io::Result<()>)>();
        let mut served = Vec::new();
        let mut failed: Option<io::Error> = None;
        // Starts the `n`-th thread of queue `qid` (an error: it could not even be spawned).
        let mut spawn_one = |pool: &mut RingPool, qid: usize, n: usize| -> io::Result<()> {
            let doorbell = Arc::new(Doorbell::new()?);
            let bell = doorbell.clone();
            let ch = ch.clone();
            let filesystem = filesystem.clone();
            let ready = ready_tx.clone();
            let counter = Arc::new(Counter::default());
            let serving = counter.clone();
            let name = format!("fuser-ring-{qid}.{n}");
            let handle = thread::Builder::new().name(name.clone()).spawn(move || {
                pin_to(qid);
                let event_loop = SessionEventLoop {
                    thread_name: name,
                    filesystem,
                    ch,
                    allowed,
                    session_owner,
                };
                // Says how the start went exactly once, also if `register` panics.
                let mut report = StartReport {
                    qid,
                    ready: Some(ready),
                };
                let (thread, entries, early) =
                    match register(&event_loop.ch, qid as u16, setup, bell) {
                        Ok(registered) => {
                            serving.alive.store(true, Ordering::Relaxed);
                            report.send(Ok(()));
                            registered
                        }
                        Err(e) => {
                            report.send(Err(e));
                            return;
                        }
                    };
                serve(&thread, entries, early, &event_loop, &serving);
                serving.alive.store(false, Ordering::Relaxed);
            })?;
            pool.threads.push((handle, doorbell));
            served.push(counter);
            Ok(())
        };
        let mut registered = vec![0usize; queues];
        let per_queue = setup.threads_per_queue.max(1);
        // The threads to start: `per_queue` for every queue, then, for up to START_RETRIES
        // more rounds, one for each queue still without a thread (a queue without one leaves
        // the whole connection waiting). Each round is started, then waited for.
        let mut round: Vec<(usize, usize)> = (0..queues)
            .flat_map(|qid| (0..per_queue).map(move |n| (qid, n)))
            .collect();
        for attempt in 0..=START_RETRIES {
            let mut spawned = 0;
            for &(qid, n) in &round {
                match spawn_one(&mut pool, qid, n) {
                    Ok(()) => spawned += 1,
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
            }
            for _ in 0..spawned {
                match ready_rx.recv() {
                    Ok((qid, Ok(()))) => registered[qid] += 1,
                    Ok((_, Err(e))) => {
                        failed.get_or_insert(e);
                    }
                    // Unreachable while `ready_tx` lives; counted as a failure all the same.
                    Err(_) => {
                        failed.get_or_insert(io::Error::other("a ring thread died while starting"));
                    }
                }
            }
            round = (0..queues)
                .filter(|&qid| registered[qid] == 0)
                .map(|qid| (qid, per_queue + attempt))
                .collect();
            if round.is_empty() {
                break;
            }
        }
        *counters.threads.lock().unwrap_or_else(|e| e.into_inner()) = served;
        match failed {
            None => Ok(pool),
            Some(e) => match registered.iter().position(|&n| n == 0) {
                Some(qid) => {
                    pool.stop();
                    Err(io::Error::other(format!(
                        "no ring thread could serve CPU {qid}'s queue ({e}), and the kernel \
                         holds every request of a connection that took FUSE over io_uring \
                         until each queue has one"
                    )))
                }
                None => {
                    warn!(
                        "FUSE over io_uring: some ring threads did not start ({e}); every CPU's queue has at least one"
                    );
                    Ok(pool)
                }
            },
        }
    }

    /// Tells every ring thread to stop and joins them. Entries still registered are cancelled
    /// by the kernel when their ring closes.
    pub(crate) fn stop(&mut self) {
        for (_, doorbell) in &self.threads {
            doorbell.stopping.store(true, Ordering::Release);
            doorbell.ring();
        }
        for (handle, _) in self.threads.drain(..) {
            if handle.join().is_err() {
                error!("a fuse ring thread panicked");
            }
        }
    }
}

impl Drop for RingPool {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A registered ring: its thread's state, its entries, and the completions seen while
/// registering (user data, result) that the serving loop still has to handle.
type Registered = (Arc<RingThread>, Vec<Arc<RingEntry>>, Vec<(u64, i32)>);

/// Makes the calling thread's ring and first entry, and registers it with the kernel.
fn register(
    ch: &Channel,
    qid: u16,
    setup: RingSetup,
    doorbell: Arc<Doorbell>,
) -> io::Result<Registered> {
    // A test's way to make a ring thread fail to start (CitronFS's `fuse_ring.rs`; the
    // `failpoints` feature only).
    #[cfg(feature = "failpoints")]
    fail::fail_point!("fuser::ring::register", |_| Err(io::Error::other(
        "failpoint fuser::ring::register"
    )));
    // Room for every entry's command and the doorbell's poll between two waits.
    let ring =
        IoUring::<squeue::Entry128, cqueue::Entry>::builder().build((2 * MAX_ENTRIES) as u32)?;
    let thread = Arc::new(RingThread {
        ring,
        submit_lock: Mutex::new(()),
        owner: thread::current().id(),
        // The channel outlives the ring: the session joins the ring threads before it drops
        // its channels.
        fuse_fd: ch.as_fd().as_raw_fd(),
        qid,
        max_payload: setup.max_payload,
        channel: ch.sender(),
        doorbell,
    });
    thread.push(&thread.doorbell.poll())?;
    // One entry: a free entry is then an idle thread (module docs); `serve` adds more only
    // for late answers.
    let entry = Arc::new(RingEntry::new(&thread, 0)?);
    entry.register()?;
    // A register that the kernel refuses completes at once; one it accepts completes only
    // when a request arrives. So: wait briefly, and keep whatever came for `serve`.
    let wait = types::Timespec::from(Duration::from_millis(20));
    match thread
        .ring
        .submitter()
        .submit_with_args(1, &types::SubmitArgs::new().timespec(&wait))
    {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::ETIME) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
        Err(e) => return Err(e),
    }
    let mut early = Vec::new();
    completions(&thread, &mut early);
    if let Some(&(_, res)) = early
        .iter()
        .find(|&&(tag, res)| tag != TAG_DOORBELL && res < 0)
    {
        return Err(io::Error::from_raw_os_error(-res));
    }
    Ok((thread, vec![entry], early))
}

/// Takes every completion the ring holds into `done`, as (tag, result); `done` is the
/// thread's one buffer, kept from wait to wait so that a request allocates nothing here.
fn completions(thread: &RingThread, done: &mut Vec<(u64, i32)>) {
    done.clear();
    // SAFETY: only the ring's own thread reads its completion queue.
    done.extend(unsafe { thread.ring.completion_shared() }.map(|c| (c.user_data(), c.result())));
}

/// Serves the thread's entries until the connection ends or the pool stops.
///
/// A request whose answer comes later, from another thread (the file system kept its reply:
/// a blocking record lock), keeps its entry until then. A request that finds every entry of
/// its queue taken waits in the kernel until one of them commits (registering a new entry
/// does not serve it), so late answers must not keep a thread without a free entry: when
/// every entry of the thread holds a request, it registers one more, up to [`MAX_ENTRIES`].
/// The cost: once the late answer commits, the thread has two free entries, and a request
/// given to one while it serves the other waits for it.
fn serve<FS: Filesystem>(
    thread: &Arc<RingThread>,
    mut entries: Vec<Arc<RingEntry>>,
    mut done: Vec<(u64, i32)>,
    event_loop: &SessionEventLoop<FS>,
    served: &Counter,
) {
    loop {
        for &(tag, res) in &done {
            if tag == TAG_DOORBELL {
                if thread.doorbell.stopping.load(Ordering::Acquire) {
                    return;
                }
                // Another thread queued an answer: the wait below submits it. Listen again.
                thread.doorbell.quiet();
                if let Err(e) = thread.push(&thread.doorbell.poll()) {
                    error!("fuse ring doorbell: {e}");
                    return;
                }
                continue;
            }
            let Some(entry) = entries.get(tag as usize).cloned() else {
                error!("fuse ring completion for an unknown entry {tag}");
                continue;
            };
            match res {
                0 => {
                    served.served.fetch_add(1, Ordering::Relaxed);
                    handle(&entry, event_loop);
                    if entries.iter().all(|e| e.holding()) && entries.len() < MAX_ENTRIES {
                        match RingEntry::new(thread, entries.len() as u64) {
                            Ok(more) => {
                                let more = Arc::new(more);
                                match more.register() {
                                    Ok(()) => entries.push(more),
                                    Err(e) => warn!("fuse ring: no entry added: {e}"),
                                }
                            }
                            Err(e) => warn!("fuse ring: no entry added: {e}"),
                        }
                    }
                }
                e if e == -libc::ENOTCONN || e == -libc::ECONNABORTED || e == -libc::ENODEV => {
                    // The connection ended (unmount or abort): its entries are gone.
                    return;
                }
                e => {
                    error!(
                        "fuse ring entry {tag} of queue {} failed: {}",
                        thread.qid,
                        io::Error::from_raw_os_error(-e)
                    );
                    return;
                }
            }
        }
        // Submits what is queued (commits, registers) and sleeps until the next request.
        match thread.ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => {
                error!("fuse ring wait failed: {e}");
                return;
            }
        }
        completions(thread, &mut done);
    }
}

/// Dispatches the request the entry holds; answers EIO if nobody will.
fn handle<FS: Filesystem>(entry: &Arc<RingEntry>, event_loop: &SessionEventLoop<FS>) {
    entry.answered.store(false, Ordering::Release);
    let (message, unique) = match entry.request() {
        Ok(request) => request,
        Err(why) => {
            warn!("{why}");
            return answer_error(entry, 0);
        }
    };
    match RequestWithSender::new(ReplySender::Ring(entry.clone()), message) {
        Some(req) => {
            if let Ok(crate::ll::Operation::Destroy(_)) = req.request.operation() {
                req.reply::<crate::ReplyEmpty>().ok();
            } else {
                req.dispatch(event_loop);
            }
        }
        None => return answer_error(entry, unique),
    }
    // Every reply holds a clone of the entry until it has answered (the thread's list holds
    // one more); with none left and no answer given, nobody will answer (fuser made no reply
    // for this opcode).
    if Arc::strong_count(entry) == 2 {
        std::sync::atomic::fence(Ordering::Acquire);
        if entry.holding() {
            answer_error(entry, unique);
        }
    }
}

fn answer_error(entry: &RingEntry, unique: u64) {
    let mut out = [0u8; OUT_HEADER_SIZE];
    out[0..4].copy_from_slice(&(OUT_HEADER_SIZE as u32).to_ne_bytes());
    out[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
    out[8..16].copy_from_slice(&unique.to_ne_bytes());
    if let Err(e) = entry.answer(&[IoSlice::new(&out)]) {
        error!("fuse ring answer failed: {e}");
    }
}
