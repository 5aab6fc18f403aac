//! The `tcp` client: one endpoint is one TCP connection, one batch is one frame each way.

use super::wire::{
    self, begin_frame, seal_frame, DecodedReply, DecodedReturn, Hello, RegionInfo, RemoteError,
    Welcome, MAX_REPLY_FRAME, PROTOCOL_VERSION,
};
use crate::batch::{Batch, Completions, MAX_BATCH_BYTES, MAX_BATCH_VERBS, MAX_IO_BYTES};
use crate::clock::PeerClock;
use crate::endpoint::{Capabilities, Connector, Endpoint, EndpointStats, MaskedAtomics};
use crate::error::{BatchError, FabricError, Result};
use crate::frame::{self, FrameError, HEADER_LEN};
use crate::handshake::{self, Credentials, HandshakeError, Protocol, Refusal};
use std::io::{BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The first pause before a connection refused for a server's limit on connections is tried
/// again ([`TcpEndpoint::connect_with`]).
pub const LIMIT_FIRST_PAUSE: Duration = Duration::from_millis(5);

/// The longest pause between tries of a connection refused for a server's limit on
/// connections ([`TcpEndpoint::connect_with`]).
pub const LIMIT_MAX_PAUSE: Duration = Duration::from_millis(200);

/// How long connecting and the handshake may take by default before the server is declared
/// unreachable ([`TcpTimeouts::connect`]).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one batch may take by default, from the first byte sent to the last byte of its
/// reply, before the connection is given up ([`TcpTimeouts::batch`]).
///
/// A server that dies closes its sockets and fails a batch at once; this bound is for the
/// silent failures — a cut link, a host that froze or lost power — where nothing is ever
/// answered and a blocking read would otherwise wait for TCP to give up (about 15 minutes with
/// Linux's default `tcp_retries2`). The server runs a batch as soon as it arrives (it never
/// waits on a lock: waiting is the client's, in separate batches), so a live server answers
/// within a round trip plus its scheduling delay. (A procedure call may wait at the server:
/// [`CALL_TIMEOUT`].) 5 s is more than twice the range locks' lease (`T_lease`, 2 s): a client
/// whose batch took that long has lost its lock anyway, so the bound never fails an I/O that
/// could still have succeeded.
pub const BATCH_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a procedure call ([`Endpoint::call`](crate::Endpoint::call)) may wait for the
/// first byte of its answer by default ([`TcpTimeouts::call`]); the rest of the exchange is
/// held to the batch bound.
///
/// Unlike a batch, a call may legitimately wait at the server: a lock acquired at the host
/// waits there for the lock, as a one-sided client would poll for it. The longest such wait
/// CitronFS's defaults allow is a dead holder's lease recovery — up to `(H + 1)·T_lease` of
/// the tree's height `H` (2 s leases) plus a fence (at most 3 s) — about 10 s on the trees
/// files get; 30 s leaves room for queueing behind other waiters. A dead or unreachable server
/// host is still found within about the batch bound by the kernel (`watch_peer_within`).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The time bounds of a tcp endpoint: how long a silent peer can keep a caller waiting.
///
/// After either runs out the caller gets [`FabricError::TimedOut`] (for a batch: its outcome
/// is then unknown, and the endpoint is dead) instead of waiting for TCP's own timeouts, which
/// on a cut link take minutes. A server that restarted or died closes or refuses connections
/// and gives `Disconnected` or `Io` at once instead: callers can tell "gone" from "silent".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpTimeouts {
    /// Connecting and the handshake ([`CONNECT_TIMEOUT`] by default).
    pub connect: Duration,
    /// One batch: sending its request and reading its reply ([`BATCH_TIMEOUT`] by default).
    pub batch: Duration,
    /// A procedure call's wait for its answer to begin ([`CALL_TIMEOUT`] by default).
    pub call: Duration,
}

impl TcpTimeouts {
    /// The defaults: [`CONNECT_TIMEOUT`], [`BATCH_TIMEOUT`] and [`CALL_TIMEOUT`].
    pub const DEFAULT: TcpTimeouts = TcpTimeouts {
        connect: CONNECT_TIMEOUT,
        batch: BATCH_TIMEOUT,
        call: CALL_TIMEOUT,
    };

    /// These bounds with every zero duration replaced by its default: a zero socket timeout
    /// is refused by the standard library, and "no time at all" is never meant.
    fn or_default(self) -> TcpTimeouts {
        let pick = |d: Duration, default| if d.is_zero() { default } else { d };
        TcpTimeouts {
            connect: pick(self.connect, CONNECT_TIMEOUT),
            batch: pick(self.batch, BATCH_TIMEOUT),
            call: pick(self.call, CALL_TIMEOUT),
        }
    }
}

impl Default for TcpTimeouts {
    fn default() -> Self {
        TcpTimeouts::DEFAULT
    }
}

/// The capabilities of every `tcp` endpoint.
pub const CAPABILITIES: Capabilities = Capabilities {
    backend: "tcp",
    masked_atomics: MaskedAtomics::CpuCasLoop,
    max_batch_verbs: MAX_BATCH_VERBS,
    max_io_bytes: MAX_IO_BYTES,
    max_batch_bytes: MAX_BATCH_BYTES,
    server_cpu_on_data_path: true,
};

/// One connection to a [`TcpServer`](super::TcpServer), used by one thread.
///
/// After [`FabricError::Disconnected`] the endpoint is dead (every later batch fails the same
/// way); open a new one. Any other error leaves it usable.
pub struct TcpEndpoint {
    /// Reads go through a buffer (a small reply is one `read`); writes go straight to the socket
    /// through `get_ref()`, one `write` per batch.
    stream: BufReader<TcpStream>,
    peer: SocketAddr,
    /// The request frame being sent, reused across batches.
    tx: Vec<u8>,
    /// The reply frame being read, reused across batches.
    rx: Vec<u8>,
    stats: EndpointStats,
    welcome: Welcome,
    /// The time bounds this endpoint was opened with.
    timeouts: TcpTimeouts,
    /// Why the connection was given up, once it has been.
    broken: Option<String>,
    /// A batch was posted and its reply not read yet ([`Endpoint::post`]).
    in_flight: bool,
    /// When the request sent last must have been answered: its batch bound counts from the
    /// send, so that batches posted together to several servers time out together (their
    /// replies awaited one after another must not add up their bounds).
    answer_by: Instant,
    /// `answer_by` is the expiry of the batch sent last (plus [`crate::REPLY_AFTER_EXPIRY`]),
    /// which came before its batch bound.
    expiry_first: bool,
    /// What the server's answers told of its clock: batch expiries are sent in it
    /// ([`crate::clock`]).
    clock: PeerClock,
}

impl std::fmt::Debug for TcpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpEndpoint")
            .field("peer", &self.peer)
            .field("stats", &self.stats)
            .field("broken", &self.broken)
            .finish()
    }
}

/// Opens a TCP connection to the first address of `addr` that answers within `timeout`.
fn open(addr: impl ToSocketAddrs, timeout: Duration) -> Result<(TcpStream, SocketAddr)> {
    let addrs = addr
        .to_socket_addrs()
        .map_err(|e| FabricError::io("resolve server address", e))?;
    let mut last = None;
    for candidate in addrs {
        match TcpStream::connect_timeout(&candidate, timeout) {
            Ok(stream) => return Ok((stream, candidate)),
            Err(e) => last = Some((candidate, e)),
        }
    }
    Err(match last {
        Some((candidate, e)) if is_timeout(&e) => FabricError::TimedOut(format!(
            "connect to {candidate}: no answer within {timeout:?} (link down or host gone?)"
        )),
        Some((candidate, e)) => FabricError::io(format!("connect to {candidate}"), e),
        None => FabricError::Config("server address resolved to nothing".into()),
    })
}

impl TcpEndpoint {
    /// Connects to the server at `addr` and performs the handshake presenting `credentials`.
    ///
    /// Fails with [`FabricError::Refused`] if the server refuses (wrong cluster, token or
    /// protocol version), [`FabricError::Io`] if it cannot be reached, and
    /// [`FabricError::Protocol`] if what answers does not speak the protocol.
    pub fn connect(addr: impl ToSocketAddrs, credentials: &Credentials) -> Result<Self> {
        Self::connect_session(addr, credentials, 0)
    }

    /// [`TcpEndpoint::connect`] on behalf of client session `session` (0: none), which the
    /// server can revoke ([`TcpServer::revoke`](super::TcpServer::revoke)); a revoked session
    /// is refused with [`FabricError::Refused`].
    pub fn connect_session(
        addr: impl ToSocketAddrs,
        credentials: &Credentials,
        session: u64,
    ) -> Result<Self> {
        Self::connect_with(addr, credentials, session, TcpTimeouts::DEFAULT)
    }

    /// [`TcpEndpoint::connect_session`] with the time bounds `timeouts` (a zero bound means
    /// its default).
    ///
    /// A server that refuses the connection for one of its limits on connections
    /// ([`Refusal::Limit`]: too many pending their handshake, say, during a flood) is tried
    /// again after a pause that doubles from [`LIMIT_FIRST_PAUSE`] to [`LIMIT_MAX_PAUSE`], for
    /// up to the connect bound in all; then the refusal is reported as
    /// [`FabricError::Limited`] — never as [`FabricError::Refused`], which would say that the
    /// client or its session is refused for good.
    pub fn connect_with(
        addr: impl ToSocketAddrs,
        credentials: &Credentials,
        session: u64,
        timeouts: TcpTimeouts,
    ) -> Result<Self> {
        let timeouts = timeouts.or_default();
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| FabricError::io("resolve server address", e))?
            .collect();
        let deadline = Instant::now() + timeouts.connect;
        let mut pause = LIMIT_FIRST_PAUSE;
        loop {
            match Self::connect_once(&addrs[..], credentials, session, timeouts) {
                Err(FabricError::Limited(why)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(FabricError::Limited(why));
                    }
                    tracing::debug!(%why, "fabric tcp: connection refused for a limit; trying again");
                    std::thread::sleep(pause.min(left));
                    pause = (pause * 2).min(LIMIT_MAX_PAUSE);
                }
                other => return other,
            }
        }
    }

    /// One try of [`TcpEndpoint::connect_with`], with `timeouts` already defaulted.
    fn connect_once(
        addr: &[SocketAddr],
        credentials: &Credentials,
        session: u64,
        timeouts: TcpTimeouts,
    ) -> Result<Self> {
        let connect_timeout = timeouts.connect;
        let (stream, peer) = open(addr, connect_timeout)?;
        let setup = |e| FabricError::io(format!("configure connection to {peer}"), e);
        stream.set_nodelay(true).map_err(setup)?;
        // A call may wait for its answer far longer than a batch (`CALL_TIMEOUT`): a dead or
        // unreachable server must still be found within about the batch bound, as a batch
        // finds it (a cut client's I/O fails as fast whether it waits for a lock or for data).
        super::watch_peer_within(&stream, timeouts.batch);
        stream
            .set_read_timeout(Some(connect_timeout))
            .map_err(setup)?;
        stream
            .set_write_timeout(Some(connect_timeout))
            .map_err(setup)?;

        let mut tx = Vec::new();
        begin_frame(&mut tx);
        wire::encode_message(
            &mut tx,
            &Hello::new(Protocol::Verbs, credentials, session, ()),
        );
        seal_frame(&mut tx);
        let hello = tx[HEADER_LEN..].to_vec();
        (&stream)
            .write_all(&tx)
            .map_err(|e| FabricError::io(format!("send handshake to {peer}"), e))?;

        let mut stream = BufReader::with_capacity(64 << 10, stream);
        let mut rx = Vec::new();
        read_handshake_answer(&mut stream, &mut rx, peer, connect_timeout)?;
        let proof = match handshake::answer_challenge(credentials, &hello, &rx) {
            Ok(proof) => proof,
            Err(HandshakeError::Refused(refusal)) => return Err(refused(peer, refusal)),
            Err(e @ HandshakeError::ServerUnverified { .. }) => {
                // Nothing more is sent to a server that could not prove the secret.
                return Err(FabricError::Unverified(format!("{peer}: {e}")));
            }
            Err(e) => {
                return Err(FabricError::Protocol(format!(
                    "bad handshake reply from {peer}: {e}"
                )))
            }
        };
        begin_frame(&mut tx);
        tx.extend_from_slice(&proof);
        seal_frame(&mut tx);
        stream
            .get_ref()
            .write_all(&tx)
            .map_err(|e| FabricError::io(format!("send handshake to {peer}"), e))?;

        read_handshake_answer(&mut stream, &mut rx, peer, connect_timeout)?;
        let welcomed_at = Instant::now();
        let welcome = match wire::decode_welcome(&rx) {
            Ok(Ok(welcome)) => welcome,
            Ok(Err(refusal)) => return Err(refused(peer, refusal)),
            Err(why) => {
                return Err(FabricError::Protocol(format!(
                    "bad handshake reply from {peer}: {why}"
                )))
            }
        };
        if welcome.version != PROTOCOL_VERSION {
            return Err(FabricError::Protocol(format!(
                "{peer} welcomed us with protocol version {} instead of {PROTOCOL_VERSION}",
                welcome.version
            )));
        }
        // From now on each socket operation of a batch is bounded by the batch's bound; the
        // whole batch is held to it too (see `execute`).
        let socket = stream.get_ref();
        socket
            .set_read_timeout(Some(timeouts.batch))
            .map_err(setup)?;
        socket
            .set_write_timeout(Some(timeouts.batch))
            .map_err(setup)?;
        Ok(Self {
            stream,
            peer,
            tx,
            rx,
            stats: EndpointStats::default(),
            timeouts,
            broken: None,
            in_flight: false,
            answer_by: Instant::now(),
            expiry_first: false,
            clock: PeerClock::from_answer(welcome.clock, welcomed_at),
            welcome,
        })
    }

    /// The server's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The regions the server had registered when this endpoint connected.
    pub fn regions(&self) -> &[RegionInfo] {
        &self.welcome.regions
    }

    /// The time bounds of this endpoint.
    pub fn timeouts(&self) -> TcpTimeouts {
        self.timeouts
    }

    /// Whether the connection has been given up (every batch now fails with `Disconnected`).
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// Gives the connection up: after this, the stream may be out of sync or gone.
    ///
    /// The close is made abortive (`SO_LINGER` 0): when the endpoint is dropped the kernel
    /// discards whatever of the request it still holds and resets the connection, instead of
    /// retransmitting it. On a cut link a timed-out batch sits in the send queue; without
    /// this it would reach the server once the link came back — a write the caller was told
    /// had failed landing seconds later, after its lock was gone. (Bytes already on the wire
    /// can still arrive; that window is the network's own delay.)
    fn fail(&mut self, why: String) -> FabricError {
        self.give_up(why.clone());
        FabricError::Disconnected(why)
    }

    /// [`TcpEndpoint::fail`] for a peer that did not answer within the batch's bound.
    fn fail_timed_out(&mut self, why: String) -> FabricError {
        self.give_up(why.clone());
        FabricError::TimedOut(why)
    }

    fn give_up(&mut self, why: String) {
        abortive_close_on_drop(self.stream.get_ref());
        let _ = self.stream.get_ref().shutdown(Shutdown::Both);
        self.broken = Some(why);
    }

    /// Refuses batches no server would accept, before sending them: the server would have to
    /// drop the connection over an oversized frame.
    fn check_limits(batch: &Batch) -> Result<(), BatchError> {
        if batch.len() > MAX_BATCH_VERBS {
            return Err(BatchError::TooManyVerbs {
                count: batch.len(),
                max: MAX_BATCH_VERBS,
            });
        }
        let bytes = batch.payload().len().max(batch.read_bytes());
        if bytes > MAX_BATCH_BYTES {
            return Err(BatchError::BatchTooLarge {
                bytes: bytes as u64,
                max: MAX_BATCH_BYTES,
            });
        }
        Ok(())
    }
}

/// Sets `SO_LINGER` to 0 on `stream`, so that closing it resets the connection and discards
/// unsent data (see `TcpEndpoint::fail`). Best effort: a failure only loses that guarantee.
fn abortive_close_on_drop(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket descriptor owned by `stream`, and a pointer to a `linger` of the
    // size given, which the kernel only reads.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        tracing::debug!(
            "SO_LINGER on a failed connection: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Whether a failed `write` says that the connection itself is gone — the kernel gave it up
/// (`ETIMEDOUT`: its keepalive probes or data went unanswered past `TCP_USER_TIMEOUT`), the
/// peer reset it, or the route to it failed — as opposed to our own deadline or the socket's
/// send timeout running out (the request may still be on its way then).
fn is_lost_connection(e: &std::io::Error) -> bool {
    e.raw_os_error().is_some() && e.kind() != ErrorKind::WouldBlock
}

/// Whether a socket error is a timeout (`SO_RCVTIMEO`/`SO_SNDTIMEO` ran out: Linux reports
/// `EAGAIN`, i.e. `WouldBlock`) or our own deadline ran out (`TimedOut`).
fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// One batch's socket I/O, held to the batch's deadline as a whole.
///
/// The socket's own timeouts (`SO_SNDTIMEO`/`SO_RCVTIMEO`, set to the batch bound) limit each
/// `write` or `read` call, not the batch: a peer that takes a few bytes at a time, or trickles
/// its reply, could stretch a batch over many calls. So before each call the time left is
/// checked (`TimedOut` once it is gone), and when less than 7/8 of the bound is left the
/// socket's timeout is narrowed to it, so that no call overshoots the deadline by more than an
/// eighth of the bound. A batch on a healthy link is done long before that and never pays the
/// extra system call. Dropping it restores the socket's timeouts if they were narrowed.
///
/// Past the deadline, what has already arrived is still taken, for an eighth of the bound
/// more, with calls that wait at most a millisecond: a process stopped (SIGSTOP, a frozen VM)
/// through its deadline finds its reply waiting when it resumes, and that reply is good.
struct Deadline<'a> {
    stream: &'a mut BufReader<TcpStream>,
    deadline: Instant,
    bound: Duration,
    narrowed: bool,
    /// When taking what has already arrived after the deadline stops (set at the first call
    /// past the deadline).
    grace_end: Option<Instant>,
    /// Bytes `write_all` has handed to the socket so far.
    sent: usize,
}

impl<'a> Deadline<'a> {
    /// A deadline set earlier (`bound` is the length it was set for, which sizes the grace).
    fn until(stream: &'a mut BufReader<TcpStream>, deadline: Instant, bound: Duration) -> Self {
        Deadline {
            stream,
            deadline,
            bound,
            narrowed: false,
            grace_end: None,
            sent: 0,
        }
    }

    /// Fails once the deadline (and the grace after it) has passed; narrows the socket's
    /// timeouts when needed.
    fn before_call(&mut self) -> std::io::Result<()> {
        let now = Instant::now();
        let left = self.deadline.saturating_duration_since(now);
        if left.is_zero() {
            let grace_end = *self.grace_end.get_or_insert(now + self.bound / 8);
            if now >= grace_end {
                return Err(std::io::Error::new(
                    ErrorKind::TimedOut,
                    "the batch's time bound ran out",
                ));
            }
            // Only what is already here: a call that would wait fails (as a timeout) at once.
            let socket = self.stream.get_ref();
            socket.set_read_timeout(Some(Duration::from_millis(1)))?;
            socket.set_write_timeout(Some(Duration::from_millis(1)))?;
            self.narrowed = true;
            return Ok(());
        }
        if left < self.bound.mul_f64(0.875) {
            let socket = self.stream.get_ref();
            socket.set_read_timeout(Some(left))?;
            socket.set_write_timeout(Some(left))?;
            self.narrowed = true;
        }
        Ok(())
    }

    /// Writes all of `buf` to the socket (unbuffered: one `write` per batch when it fits).
    fn write_all(&mut self, mut buf: &[u8]) -> std::io::Result<()> {
        while !buf.is_empty() {
            self.before_call()?;
            match self.stream.get_ref().write(buf) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => {
                    buf = &buf[n..];
                    self.sent += n;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.before_call()?;
        self.stream.read(buf)
    }
}

impl Drop for Deadline<'_> {
    fn drop(&mut self) {
        if self.narrowed {
            let socket = self.stream.get_ref();
            let _ = socket.set_read_timeout(Some(self.bound));
            let _ = socket.set_write_timeout(Some(self.bound));
        }
    }
}

impl Endpoint for TcpEndpoint {
    fn execute(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        self.post(batch, out)?;
        self.complete(batch, out)
    }

    /// Sends the request; the reply is read by `complete`. The batch's time bound counts from
    /// here and covers the sending and the waiting for the reply, so batches posted together to
    /// several servers over dead links fail together, one bound after their posts.
    fn post(&mut self, batch: &Batch, _out: &mut Completions) -> Result<()> {
        if self.in_flight {
            return Err(FabricError::Protocol(format!(
                "a second batch posted to {} before the first was completed",
                self.peer
            )));
        }
        self.check_open()?;
        Self::check_limits(batch)?;
        // The server's clock as it stands now, for the expiry (none to read without one).
        let clock = match batch.expires() {
            Some(_) => {
                let now = Instant::now();
                if self.clock.is_stale(now) {
                    self.resync_clock()?;
                }
                self.clock.at(now)
            }
            None => PeerClock::SAME_PROCESS,
        };

        begin_frame(&mut self.tx);
        wire::encode_batch_for(&mut self.tx, batch, &clock);
        seal_frame(&mut self.tx);
        self.send(batch.expires())?;
        self.in_flight = true;
        Ok(())
    }

    /// Reads the reply of the batch `post` sent, straight into `out` (a placed batch's reads
    /// into the caller's buffer, see `Completions::fill_reads`).
    fn complete(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        if !std::mem::take(&mut self.in_flight) {
            return Err(FabricError::Protocol(format!(
                "no batch in flight to {} to complete",
                self.peer
            )));
        }
        self.receive()?;
        let received = Instant::now();
        match wire::decode_reply(&self.rx, batch, out) {
            Ok(DecodedReply::Completions { clock }) => {
                self.clock.answer(clock, received);
                self.stats.record(batch);
                Ok(())
            }
            Ok(DecodedReply::Error(e)) => Err(self.remote_error(e)),
            Err(why) => {
                let why = format!(
                    "bad reply from {} (batch outcome unknown): {why}",
                    self.peer
                );
                Err(self.fail(why))
            }
        }
    }

    fn call(
        &mut self,
        procedure: crate::procedure::ProcedureId,
        args: &[u8],
        result: &mut Vec<u8>,
    ) -> Result<()> {
        self.send_call(procedure, args, false)?;
        self.await_answer()?;
        self.receive()?;
        match wire::decode_returned(&self.rx) {
            Ok(DecodedReturn::Returned(bytes)) => {
                result.extend_from_slice(bytes);
                self.stats.round_trips += 1;
                Ok(())
            }
            // A server that predates procedures does not know the request.
            Ok(DecodedReturn::Error(RemoteError::UnknownProcedure { .. }))
            | Ok(DecodedReturn::Error(RemoteError::Malformed(_))) => Err(FabricError::Unsupported(
                format!("{} offers no procedure {procedure}", self.peer),
            )),
            Ok(DecodedReturn::Error(RemoteError::Procedure(why))) => {
                Err(FabricError::Procedure(why))
            }
            Ok(DecodedReturn::Error(e)) => Err(self.remote_error(e)),
            Err(why) => {
                let why = format!("bad reply from {} (call outcome unknown): {why}", self.peer);
                Err(self.fail(why))
            }
        }
    }

    /// Sends the call and returns: the server answers it only if it fails, in place of the
    /// next request's answer (see `Request::PostedCall`), which `remote_error` turns into this
    /// endpoint's closing.
    fn post_call(&mut self, procedure: crate::procedure::ProcedureId, args: &[u8]) -> Result<()> {
        self.send_call(procedure, args, true)?;
        self.stats.posted_calls += 1;
        Ok(())
    }

    fn stats(&self) -> EndpointStats {
        self.stats
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }
}

impl TcpEndpoint {
    /// Checks and sends a call (posted or not) of `procedure` with `args`.
    fn send_call(
        &mut self,
        procedure: crate::procedure::ProcedureId,
        args: &[u8],
        posted: bool,
    ) -> Result<()> {
        if self.in_flight {
            return Err(FabricError::Protocol(format!(
                "a procedure called on {} while a batch is in flight",
                self.peer
            )));
        }
        self.check_open()?;
        if args.len() > crate::procedure::MAX_CALL_BYTES {
            return Err(FabricError::Config(format!(
                "{} bytes of arguments exceed the limit of {}",
                args.len(),
                crate::procedure::MAX_CALL_BYTES
            )));
        }
        begin_frame(&mut self.tx);
        wire::encode_call(&mut self.tx, procedure, args, posted);
        seal_frame(&mut self.tx);
        self.send(None)
    }

    /// Waits, at most the call bound ([`TcpTimeouts::call`]), until the answer to the call just
    /// sent begins to arrive, consuming nothing; then the batch bound applies to reading it
    /// (`receive`). Each wait on the socket is bounded by its read timeout (the batch bound),
    /// so a wait that outlasts one only peeks again.
    fn await_answer(&mut self) -> Result<()> {
        let until = Instant::now() + self.timeouts.call;
        let mut byte = [0u8; 1];
        while self.stream.buffer().is_empty() {
            match self.stream.get_ref().peek(&mut byte) {
                // Data, or the end of the stream: `receive` reads (or reports) it.
                Ok(_) => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // The socket's read timeout (EAGAIN): the server is still working on the call.
                // (`TimedOut`, ETIMEDOUT, is the kernel giving the connection up: `watch_peer`.)
                Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < until => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let why = format!(
                        "no answer from {} to a procedure call within {:?} (link down or host \
                         frozen?); the call's outcome is unknown",
                        self.peer, self.timeouts.call
                    );
                    return Err(self.fail_timed_out(why));
                }
                // The kernel gave the connection up: the server did not acknowledge its probes.
                Err(e) if e.kind() == ErrorKind::TimedOut => {
                    let why = format!(
                        "{} stopped answering while a procedure call waited (link down or host \
                         frozen?); the call's outcome is unknown",
                        self.peer
                    );
                    return Err(self.fail_timed_out(why));
                }
                Err(e) => {
                    let why = format!("waiting for {}'s answer to a call: {e}", self.peer);
                    return Err(self.fail(why));
                }
            }
        }
        // The answer's bytes are held to the batch bound from here.
        self.answer_by = Instant::now() + self.timeouts.batch;
        self.expiry_first = false;
        Ok(())
    }

    /// Refreshes what this endpoint knows of the server's clock with an empty batch (one round
    /// trip), when its last answer is too old for a deadline to be sent in it
    /// ([`crate::clock::RESYNC_AFTER`]: an idle connection).
    fn resync_clock(&mut self) -> Result<()> {
        let empty = Batch::new();
        self.post(&empty, &mut Completions::new())?;
        self.complete(&empty, &mut Completions::new())
    }

    /// `Disconnected` when an earlier failure closed this endpoint.
    fn check_open(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(FabricError::Disconnected(format!(
                "endpoint to {} is closed after an earlier failure: {why}",
                self.peer
            ))),
            None => Ok(()),
        }
    }

    /// Sends the request frame in `self.tx`, held to the batch's time bound. Any failure gives
    /// the connection up: from the first byte sent, the request may have executed, so the
    /// outcome is unknown (`Disconnected` or `TimedOut`, as the `Endpoint` contract requires).
    ///
    /// A request that `expires` is answered by its expiry plus [`crate::REPLY_AFTER_EXPIRY`] at
    /// the latest (see [`Batch::expire_at`]), when that comes before the batch bound.
    fn send(&mut self, expires: Option<Instant>) -> Result<()> {
        // The socket timeouts bound each `write` and `read` call; `Deadline` holds the request
        // and its reply as a whole to its bound too, however the bytes trickle (see its docs).
        let now = Instant::now();
        self.answer_by = now + self.timeouts.batch;
        self.expiry_first = false;
        if let Some(expires) = expires {
            let by = expires + crate::REPLY_AFTER_EXPIRY;
            if by < self.answer_by {
                self.answer_by = by;
                self.expiry_first = true;
            }
        }
        let mut io = Deadline::until(&mut self.stream, self.answer_by, self.timeouts.batch);
        if let Err(e) = io.write_all(&self.tx) {
            let sent = io.sent;
            drop(io);
            return Err(if sent == 0 && is_lost_connection(&e) {
                // The kernel had already given the connection up — most often while it sat
                // idle through a cut link (`watch_peer_within`), and the link is back now — or
                // the peer reset it: not one byte of this request left, so it did not run and
                // redoing it on a new connection is safe.
                let why = format!(
                    "the connection to {} was lost before the request was sent ({e}); the \
                     request did not run",
                    self.peer
                );
                self.fail(why)
            } else if is_timeout(&e) {
                let within = match self.expiry_first {
                    true => "by the batch's expiry".to_string(),
                    false => format!("within {:?}", self.timeouts.batch),
                };
                let why = format!(
                    "{} did not take the request {within} (link down or host frozen?); the \
                     batch's outcome is unknown",
                    self.peer
                );
                self.fail_timed_out(why)
            } else {
                let why = format!("sending a batch to {}: {e}", self.peer);
                self.fail(why)
            });
        }
        Ok(())
    }

    /// Reads the reply frame of the request sent last into `self.rx`, held to the batch's time
    /// bound. The request may have executed: any failure to read a trustworthy reply is
    /// `Disconnected` or `TimedOut` (outcome unknown).
    fn receive(&mut self) -> Result<()> {
        let mut io = Deadline::until(&mut self.stream, self.answer_by, self.timeouts.batch);
        let read = frame::read_frame(&mut io, MAX_REPLY_FRAME, &mut self.rx);
        drop(io);
        match read {
            Ok(()) => Ok(()),
            Err(FrameError::Io(e)) if e.kind() == ErrorKind::UnexpectedEof => {
                let why = format!("{} closed the connection", self.peer);
                Err(self.fail(why))
            }
            Err(FrameError::Io(e)) if is_timeout(&e) && self.expiry_first => {
                let why = format!(
                    "no reply from {} by the batch's expiry (a lock holder's lease about to \
                     run out; link down, host frozen or overloaded?); the batch's outcome is \
                     unknown",
                    self.peer
                );
                Err(self.fail_timed_out(why))
            }
            Err(FrameError::Io(e)) if is_timeout(&e) => {
                let why = format!(
                    "no reply from {} within {:?} (link down or host frozen?); the batch's \
                     outcome is unknown",
                    self.peer, self.timeouts.batch
                );
                Err(self.fail_timed_out(why))
            }
            Err(e) => {
                let why = format!("reading the reply from {}: {e}", self.peer);
                Err(self.fail(why))
            }
        }
    }

    /// What a refusal from the server means for this endpoint (see [`RemoteError`]).
    fn remote_error(&mut self, e: RemoteError) -> FabricError {
        match e {
            RemoteError::Verb(e) => FabricError::Verb(e),
            RemoteError::Batch(e) => FabricError::Batch(e),
            RemoteError::Revoked { session } => {
                // The server closes the connection after this one; nothing executed.
                let why = format!(
                    "{}: session {session} was revoked by the cluster (this client was fenced \
                     after its lease ran out; its locks were broken)",
                    self.peer
                );
                self.broken = Some(why.clone());
                FabricError::Refused(why)
            }
            e @ RemoteError::SessionBehind { .. } => {
                // The server closes the connection after this one; nothing executed. Not a
                // fence: the client catches up with the restarted meta server and joins again.
                let why = format!("{}: {e}", self.peer);
                self.broken = Some(why.clone());
                FabricError::SessionBehind(why)
            }
            e @ RemoteError::FrameTooLarge { .. } => {
                // The server closes the connection after this one.
                let why = format!("{} refused a request: {e}", self.peer);
                self.fail(why)
            }
            e @ RemoteError::PostedCallFailed { .. } => {
                // In place of this request's answer: the server closed the connection, and this
                // request did not run.
                let why = format!("{}: {e}", self.peer);
                self.fail(why)
            }
            e => FabricError::Protocol(format!("{} refused a request: {e}", self.peer)),
        }
    }
}

/// Opens endpoints to one [`TcpServer`](super::TcpServer): one connection per endpoint.
///
/// [`TcpConnector::connect`] checks the address and credentials with a real handshake; that
/// first connection is kept and handed out by the first [`Connector::connect`].
pub struct TcpConnector {
    addr: SocketAddr,
    credentials: Credentials,
    session: u64,
    timeouts: TcpTimeouts,
    regions: Vec<RegionInfo>,
    spare: Mutex<Option<TcpEndpoint>>,
}

impl std::fmt::Debug for TcpConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `Credentials` never prints the token.
        f.debug_struct("TcpConnector")
            .field("addr", &self.addr)
            .field("credentials", &self.credentials)
            .field("session", &self.session)
            .field("timeouts", &self.timeouts)
            .finish()
    }
}

impl TcpConnector {
    /// A connector to the server at `addr` presenting `credentials`, validated by a handshake.
    pub fn connect(addr: impl ToSocketAddrs, credentials: Credentials) -> Result<Self> {
        Self::connect_session(addr, credentials, 0)
    }

    /// [`TcpConnector::connect`] for client session `session`: every endpoint it opens
    /// presents it, so the server can fence the session ([`TcpServer::revoke`]).
    ///
    /// [`TcpServer::revoke`]: super::TcpServer::revoke
    pub fn connect_session(
        addr: impl ToSocketAddrs,
        credentials: Credentials,
        session: u64,
    ) -> Result<Self> {
        Self::connect_with(addr, credentials, session, TcpTimeouts::DEFAULT)
    }

    /// [`TcpConnector::connect_session`] whose endpoints have the time bounds `timeouts`.
    pub fn connect_with(
        addr: impl ToSocketAddrs,
        credentials: Credentials,
        session: u64,
        timeouts: TcpTimeouts,
    ) -> Result<Self> {
        let first = TcpEndpoint::connect_with(addr, &credentials, session, timeouts)?;
        Ok(Self {
            addr: first.peer_addr(),
            credentials,
            session,
            timeouts: first.timeouts(),
            regions: first.regions().to_vec(),
            spare: Mutex::new(Some(first)),
        })
    }

    /// Opens a new endpoint (a new connection), or hands out the one opened by `connect`.
    pub fn endpoint(&self) -> Result<TcpEndpoint> {
        self.endpoint_by(None)
    }

    /// [`TcpConnector::endpoint`], its connection and handshake given up at `deadline` when
    /// that comes before the connect bound (see [`Connector::connect_by`]).
    pub fn endpoint_by(&self, deadline: Option<Instant>) -> Result<TcpEndpoint> {
        let spare = self
            .spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match spare {
            Some(endpoint) => Ok(endpoint),
            None => {
                let mut timeouts = self.timeouts;
                if let Some(deadline) = deadline {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(FabricError::TimedOut(format!(
                            "no time left to connect to {} before the caller's deadline",
                            self.addr
                        )));
                    }
                    timeouts.connect = timeouts.connect.min(left);
                }
                TcpEndpoint::connect_with(self.addr, &self.credentials, self.session, timeouts)
            }
        }
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The regions the server had registered when the connector was created.
    pub fn regions(&self) -> &[RegionInfo] {
        &self.regions
    }
}

impl Connector for TcpConnector {
    fn connect(&self) -> Result<Box<dyn Endpoint>> {
        Ok(Box::new(self.endpoint()?))
    }
    fn connect_by(&self, deadline: Option<Instant>) -> Result<Box<dyn Endpoint>> {
        Ok(Box::new(self.endpoint_by(deadline)?))
    }
}

/// Reads one answer of the server's handshake into `rx`.
fn read_handshake_answer(
    stream: &mut BufReader<TcpStream>,
    rx: &mut Vec<u8>,
    peer: SocketAddr,
    connect_timeout: Duration,
) -> Result<()> {
    match frame::read_frame(stream, MAX_REPLY_FRAME, rx) {
        Ok(()) => Ok(()),
        // A silence, like a connect that gets no answer: `TimedOut` (what a caller bounding the
        // connect by a deadline, `Connector::connect_by`, is promised).
        Err(FrameError::Io(e))
            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
        {
            Err(FabricError::TimedOut(format!(
                "{peer} did not answer the handshake within {connect_timeout:?} (link down, \
                 host frozen, or not a CitronFS tcp fabric server?)"
            )))
        }
        Err(FrameError::Io(e)) => Err(FabricError::Disconnected(format!(
            "{peer} closed the connection during the handshake: {e}"
        ))),
        Err(e) => Err(FabricError::Protocol(format!(
            "bad handshake reply from {peer}: {e}"
        ))),
    }
}

/// The error of a handshake the server at `peer` refused with `refusal`.
fn refused(peer: SocketAddr, refusal: Refusal) -> FabricError {
    match refusal {
        refusal @ Refusal::SessionBehind { .. } => FabricError::SessionBehind(refusal.to_string()),
        refusal @ Refusal::Limit { .. } => FabricError::Limited(format!("{peer}: {refusal}")),
        refusal => FabricError::Refused(refusal.to_string()),
    }
}
