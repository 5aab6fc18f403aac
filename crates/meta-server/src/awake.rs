//! Serving a client connection awake between its requests (`MetaConfig::idle_poll`).
//!
//! A client making metadata calls one after another (a thread creating files, the kernel's
//! FUSE requests in between) sends its next request 50–150 µs after an answer. By then the
//! runtime's async worker that would read it is asleep in `epoll_wait` or on a condition
//! variable, and waking it costs the call the wake-up of an idle CPU. So after an inline
//! answer, a connection hands itself to a blocking-pool thread that watches the socket without
//! sleeping for up to the budget, and runs the quick requests that come meanwhile itself: it
//! reads each whole frame straight from the socket, runs it as the async worker would have
//! (`rpc::run_request`) and writes the answer straight to the socket, under the connection's
//! writer lock. Everything else goes back to the async loop: a frame it does not run (not
//! inline, undecodable, too large, or only partly arrived: the async reader takes it from
//! there), the end of the connection, a stopping server, or the budget spent with nothing
//! sent.
//!
//! Why a thread of its own: the async worker must not spin itself. A spin that blocked the
//! worker starved the runtime (with one worker spinning and the other asleep on a condition
//! variable, nobody polled the I/O driver: another connection's request waited out the whole
//! spin, `tests/awake.rs`); a poll that yielded to the runtime between looks at the socket
//! kept none of the gain, and neither did a spin inside `block_in_place` (16-core machine,
//! `bench meta`, creates with 4 threads: 7.6–8.1k/s and 7.6–7.8k/s, against 8.2–9.0k/s
//! without a poll and 9.4k/s with the blocking spin).
//!
//! Invariants:
//! - at most one connection of the server is served awake at a time (`AwakeServe::busy`),
//!   which bounds the CPU the spinning takes to one core;
//! - a connection is served awake only when nothing of it is in flight and nothing is buffered
//!   in its async reader: the awake thread is its only reader and writer, its requests run one
//!   at a time in order, and the async reader's next read starts at a frame boundary;
//! - the async writer's buffer is empty whenever the writer lock is free (every answer is
//!   flushed before the lock is let go), so bytes written straight to the socket under that
//!   lock never overtake buffered ones.

use crate::rpc::run_request;
use crate::service::Service;
use fabric::frame::{check_body, header_for, parse_header, FrameError, FrameHeader, HEADER_LEN};
use proto::rpc::{RequestFrame, MAX_FRAME};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::BufReader;
use tokio::sync::watch;

/// The server's awake serving: its budget and who has it (see the module docs).
pub(crate) struct AwakeServe {
    budget: Duration,
    busy: AtomicBool,
    /// Requests answered by awake threads, heartbeats excepted (as `Service::request_count`).
    served: AtomicU64,
}

/// How an awake spell ended ([`AwakeServe::serve`]).
pub(crate) enum Handback {
    /// Nothing more to do here: read the connection as usual.
    Idle,
    /// A frame the awake thread read but did not run: the body buffer holds it (or the read's
    /// error); the async loop takes it as if it had read it.
    Frame(Result<(), FrameError>),
    /// Writing an answer failed, or the awake thread did: the connection ends.
    Failed(String),
}

/// Holds [`AwakeServe::busy`] for one connection's spell; gives it back when dropped.
struct Busy(Arc<AwakeServe>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

/// What one frame at the head of the socket looks like ([`head_of`]).
enum Head {
    /// Not (wholly) there yet.
    Waiting,
    /// The peer closed the connection, or the socket failed: the async reader sees which.
    Ended,
    /// A whole frame with this header is in the socket.
    Whole(FrameHeader),
    /// The header declares a frame the server does not take: the async reader refuses it.
    Refused,
}

impl AwakeServe {
    /// Serves connections awake for at most `budget` of silence (zero: never).
    pub(crate) fn new(budget: Duration) -> Arc<Self> {
        Arc::new(AwakeServe {
            budget,
            busy: AtomicBool::new(false),
            served: AtomicU64::new(0),
        })
    }

    /// Requests answered by awake threads so far.
    pub(crate) fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// Serves the connection of `reader` and `writer` awake (see the module docs), unless the
    /// budget is zero, another connection has it, or bytes are buffered in `reader` already.
    /// `body` is the async loop's frame buffer, which a handed-back frame is left in.
    pub(crate) async fn serve<R: crate::rpc::ReadHalf, W: Send + 'static>(
        self: &Arc<Self>,
        reader: &BufReader<R>,
        writer: &Arc<tokio::sync::Mutex<W>>,
        service: &Arc<Service>,
        session: u64,
        stop: &watch::Receiver<bool>,
        body: &mut Vec<u8>,
    ) -> Handback {
        if self.budget.is_zero() || !reader.buffer().is_empty() {
            return Handback::Idle;
        }
        if self
            .busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return Handback::Idle;
        }
        let busy = Busy(self.clone());
        // The thread gets a descriptor of its own, so that the socket outlives it even if the
        // connection's task is dropped meanwhile (a server shutting down).
        let fd = match reader.get_ref().fd().try_clone_to_owned() {
            Ok(fd) => fd,
            Err(error) => {
                tracing::debug!(%error, "cannot serve a connection awake");
                return Handback::Idle;
            }
        };
        let spell = Spell {
            busy,
            fd,
            writer: writer.clone(),
            service: service.clone(),
            session,
            stop: stop.clone(),
            body: std::mem::take(body),
        };
        match tokio::task::spawn_blocking(move || spell.run()).await {
            Ok((buffer, handback)) => {
                *body = buffer;
                handback
            }
            Err(e) => Handback::Failed(format!("the awake thread failed: {e}")),
        }
    }
}

/// One awake spell on a blocking-pool thread; the server's turn ([`Busy`]) is given back when
/// it ends.
struct Spell<W> {
    busy: Busy,
    fd: OwnedFd,
    writer: Arc<tokio::sync::Mutex<W>>,
    service: Arc<Service>,
    session: u64,
    stop: watch::Receiver<bool>,
    body: Vec<u8>,
}

impl<W> Spell<W> {
    fn run(mut self) -> (Vec<u8>, Handback) {
        let handback = self.serve();
        (self.body, handback)
    }

    fn serve(&mut self) -> Handback {
        let awake = &*self.busy.0;
        let fd = self.fd.as_fd();
        let mut quiet_since = Instant::now();
        loop {
            if *self.stop.borrow() {
                return Handback::Idle;
            }
            let header = match head_of(fd) {
                Head::Whole(header) => header,
                Head::Waiting if quiet_since.elapsed() < awake.budget => {
                    std::hint::spin_loop();
                    continue;
                }
                Head::Waiting | Head::Ended | Head::Refused => return Handback::Idle,
            };
            let read = take_frame(fd, &header, &mut self.body);
            if read.is_err() {
                return Handback::Frame(read);
            }
            let frame = match postcard::from_bytes::<RequestFrame>(&self.body) {
                Ok(frame) if crate::requests::inline(&frame.request) => frame,
                // Undecodable (the async loop refuses it) or not quick (it goes to the pool).
                _ => return Handback::Frame(Ok(())),
            };
            let counted = crate::requests::counted(&frame.request, &frame.release_first);
            let answer = run_request(&self.service, self.session, frame);
            // Counted before the answer leaves, so that a caller who has the answer sees it.
            if counted {
                awake.served.fetch_add(1, Ordering::Relaxed);
            }
            let bytes = match postcard::to_stdvec(&answer) {
                Ok(bytes) if bytes.len() <= MAX_FRAME => bytes,
                Ok(bytes) => {
                    return Handback::Failed(format!(
                        "response of {} bytes exceeds the frame limit",
                        bytes.len()
                    ))
                }
                Err(e) => return Handback::Failed(e.to_string()),
            };
            let mut out = Vec::with_capacity(HEADER_LEN + bytes.len());
            out.extend_from_slice(&header_for(&bytes));
            out.extend_from_slice(&bytes);
            let written = {
                let _writer = self.writer.blocking_lock();
                send_all(fd, &out, &self.stop)
            };
            if let Err(e) = written {
                return Handback::Failed(format!("writing an answer: {e}"));
            }
            quiet_since = Instant::now();
        }
    }
}

/// Looks at the head of the socket without consuming anything.
fn head_of(fd: BorrowedFd<'_>) -> Head {
    let mut header = [0u8; HEADER_LEN];
    // SAFETY: the descriptor is open while `fd` is borrowed; the buffer is ours.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            header.as_mut_ptr().cast(),
            HEADER_LEN,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n == 0 {
        return Head::Ended;
    }
    if n < 0 {
        let kind = io::Error::last_os_error().kind();
        return if matches!(kind, io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) {
            Head::Waiting
        } else {
            Head::Ended
        };
    }
    if (n as usize) < HEADER_LEN {
        return Head::Waiting;
    }
    let Ok(parsed) = parse_header(&header, MAX_FRAME) else {
        return Head::Refused;
    };
    let mut available: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int, ours.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut available) } < 0 {
        return Head::Ended;
    }
    if (available as usize) < HEADER_LEN + parsed.len {
        Head::Waiting
    } else {
        Head::Whole(parsed)
    }
}

/// Reads the whole frame that [`head_of`] found, with `header`, into `body`, and checks it.
/// Its bytes are all in the socket and this thread is the connection's only reader, so nothing
/// here waits, and the header consumed is the one peeked.
fn take_frame(
    fd: BorrowedFd<'_>,
    header: &FrameHeader,
    body: &mut Vec<u8>,
) -> Result<(), FrameError> {
    recv_exact(fd, &mut [0u8; HEADER_LEN])?;
    body.clear();
    body.resize(header.len, 0);
    recv_exact(fd, body)?;
    check_body(header, body)
}

fn recv_exact(fd: BorrowedFd<'_>, mut buf: &mut [u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: the descriptor is open while `fd` is borrowed; `buf` is ours.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n if n > 0 => buf = &mut buf[n as usize..],
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Writes all of `bytes`, waiting (in `poll`, a tenth of a second at a time, until the server
/// stops) while the socket's send buffer is full: a client that stops reading holds this
/// thread as it would hold the async writer.
fn send_all(fd: BorrowedFd<'_>, mut bytes: &[u8], stop: &watch::Receiver<bool>) -> io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: the descriptor is open while `fd` is borrowed; `bytes` is ours.
        let n = unsafe {
            libc::send(
                fd.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n >= 0 {
            bytes = &bytes[n as usize..];
            continue;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => {}
            io::ErrorKind::WouldBlock => {
                if *stop.borrow() {
                    return Err(io::Error::other("the server stops"));
                }
                let mut pollfd = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one pollfd of ours.
                unsafe { libc::poll(&mut pollfd, 1, 100) };
            }
            _ => return Err(e),
        }
    }
    Ok(())
}
