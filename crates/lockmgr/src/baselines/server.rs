//! The `server` baseline: a CPU-based lock server (CITRON §2.2, Table 1 "IT").
//!
//! The server keeps the held ranges in an interval set and serves clients over TCP: one thread
//! per connection, one request frame ([`fabric::frame`], postcard body) per operation, one
//! response frame back. An `Acquire` blocks server-side until the range is granted, so every
//! acquisition and every release is exactly one round trip for the client; the cost is the
//! server's CPU and its queueing, which is what this baseline is there to show.
//!
//! # Fairness
//!
//! Requests are numbered on arrival. A request is granted when its range overlaps no held range
//! *and no earlier waiting request*: conflicting requests are served first-come first-served, so
//! a large range cannot be starved by a stream of small ones that keep some of its units busy
//! (non-conflicting requests still pass each other freely).
//!
//! # Shared mode
//!
//! A reader–writer range lock, the fair comparison for CITRON's shared mode
//! (`docs/SHARED_LOCKS.md`): `AcquireShared` ranges may overlap each other and are kept in a
//! second set; an exclusive request conflicts with every held range, a shared one only with
//! held exclusive ones. Among waiting requests the same first-come first-served rule holds for
//! conflicting ones — a shared request never passes an earlier waiting exclusive one that
//! overlaps it, so a writer is not starved by a stream of readers; readers pass earlier
//! waiting readers freely. A connection's request that overlaps a lock the connection holds
//! is refused in either mode (a reader's second read could wait behind a writer that waits
//! for its first).
//!
//! # Authentication
//!
//! A connection opens with the handshake every CitronFS protocol shares
//! ([`fabric::handshake`], [`Protocol::LockServer`]): the cluster id and token must be the
//! server's, or the peer is refused (told why) and disconnected before it can take a lock.
//!
//! # Failure
//!
//! When a connection closes (the client exited or crashed), the server releases every lock that
//! connection held and withdraws its waiting request.

use crate::scheme::{check_range, LockError, LockId, LockMode, RangeLock};
use crate::schemes::LockScheme;
use crate::stats::LockStats;
use fabric::frame::{read_frame, write_frame, FrameError};
use fabric::handshake::{
    self, Admission, Admitted, ConnectionLimits, Credentials, HandshakeError, Protocol,
    HANDSHAKE_TIMEOUT,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufReader, BufWriter, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

/// Largest request or response frame either side accepts.
const MAX_FRAME: usize = 4096;

/// A client's request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Lock `[start, end)`; answered once granted.
    Acquire {
        /// First unit.
        start: u64,
        /// One past the last unit.
        end: u64,
    },
    /// Release a lock this connection holds.
    Release {
        /// The id the server granted it under.
        id: u64,
    },
    /// Lock `[start, end)` shared (readers overlap readers); answered once granted.
    AcquireShared {
        /// First unit.
        start: u64,
        /// One past the last unit.
        end: u64,
    },
}

/// The server's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// The range is held under this id.
    Granted {
        /// The lock id.
        id: u64,
    },
    /// The lock was released.
    Released,
    /// The request was refused.
    Error(String),
}

/// The interval set of held ranges and the queue of waiting requests.
///
/// Invariants: `held` ranges are pairwise disjoint (keyed by start, value `(end, id)`); every id
/// in `owners` is in `held`; `waiting` holds the ranges of blocked requests, by arrival number.
#[derive(Default)]
struct Table {
    held: BTreeMap<u64, (u64, u64)>,
    /// Shared ranges, which may overlap: keyed by `(start, id)`, value the end.
    shared: BTreeMap<(u64, u64), u64>,
    /// The longest shared range ever granted: only shared ranges starting less than this
    /// before a range can reach into it.
    shared_span: u64,
    /// Lock id -> its start, and whether it is shared.
    owners: HashMap<u64, (u64, bool)>,
    /// Blocked requests by arrival number: range and whether shared.
    waiting: BTreeMap<u64, (Range<u64>, bool)>,
    next_arrival: u64,
    next_id: u64,
}

impl Table {
    /// Whether `range` overlaps a held range. Held ranges are disjoint, so sorted by start they
    /// are sorted by end too: only the last one starting before `range.end` can reach into it.
    fn overlaps_held(&self, range: &Range<u64>) -> bool {
        self.held
            .range(..range.end)
            .next_back()
            .is_some_and(|(_, &(end, _))| end > range.start)
    }

    /// Whether `range` overlaps a held shared range.
    fn overlaps_shared(&self, range: &Range<u64>) -> bool {
        let from = range.start.saturating_sub(self.shared_span);
        self.shared
            .range((from, 0)..(range.end, 0))
            .any(|(_, &end)| end > range.start)
    }

    /// Whether the request that arrived as `arrival` (shared or not) may be granted now: it
    /// overlaps no held range it conflicts with and no earlier waiting request it conflicts
    /// with (two shared requests never conflict).
    fn grantable(&self, arrival: u64, range: &Range<u64>, shared: bool) -> bool {
        !self.overlaps_held(range)
            && (shared || !self.overlaps_shared(range))
            && !self.waiting.range(..arrival).any(|(_, (w, w_shared))| {
                !(shared && *w_shared) && w.start < range.end && range.start < w.end
            })
    }

    fn grant(&mut self, range: Range<u64>, shared: bool) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        if shared {
            self.shared_span = self.shared_span.max(range.end - range.start);
            self.shared.insert((range.start, id), range.end);
        } else {
            self.held.insert(range.start, (range.end, id));
        }
        self.owners.insert(id, (range.start, shared));
        id
    }

    fn release(&mut self, id: u64) -> bool {
        match self.owners.remove(&id) {
            Some((start, false)) => {
                self.held.remove(&start);
                true
            }
            Some((start, true)) => {
                self.shared.remove(&(start, id));
                true
            }
            None => false,
        }
    }
}

struct Shared {
    table: Mutex<Table>,
    changed: Condvar,
    stopping: AtomicBool,
}

impl Shared {
    fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the table would leave it inconsistent; there is no recovery from
        // that, and the table code does not panic.
        self.table.lock().expect("lock server table poisoned")
    }
}

/// A lock server: an interval set behind a TCP listener. Dropping it stops accepting; open
/// connections end when their clients close them.
pub struct LockServer {
    addr: SocketAddr,
    credentials: Credentials,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl LockServer {
    /// Binds to `addr` (e.g. `127.0.0.1:0`) and starts serving, on a background thread, the
    /// peers that present `credentials` in the handshake.
    pub fn bind(addr: impl ToSocketAddrs, credentials: Credentials) -> io::Result<Self> {
        Self::bind_with_limits(addr, credentials, ConnectionLimits::default())
    }

    /// [`LockServer::bind`] with the given limits on connections instead of the defaults: a
    /// connection beyond them is refused with
    /// [`Refusal::Limit`](fabric::handshake::Refusal::Limit) before any of its bytes are read.
    pub fn bind_with_limits(
        addr: impl ToSocketAddrs,
        credentials: Credentials,
        limits: ConnectionLimits,
    ) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            table: Mutex::new(Table::default()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let acceptor = {
            let shared = shared.clone();
            let credentials = credentials.clone();
            let admission = Admission::new(limits);
            std::thread::Builder::new()
                .name("lock-server".into())
                .spawn(move || accept_loop(listener, shared, credentials, admission))?
        };
        Ok(Self {
            addr,
            credentials,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The credentials a client must present.
    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// How many ranges are held right now.
    pub fn held(&self) -> usize {
        self.shared.table().held.len()
    }
}

impl Drop for LockServer {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // Wake the acceptor with a connection of our own.
        let _ = TcpStream::connect(self.addr);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    credentials: Credentials,
    admission: Arc<Admission>,
) {
    let refuser = match handshake::Refuser::start("lock-server-refuse") {
        Ok(refuser) => Some(refuser),
        Err(error) => {
            tracing::warn!(%error, "lock server: cannot start the refusing thread");
            None
        }
    };
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match stream {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!(%error, "lock server: accept failed");
                continue;
            }
        };
        // Counted before a thread is spent on it.
        let admitted = match stream
            .peer_addr()
            .map(|peer| (peer, admission.admit(peer.ip())))
        {
            Ok((_, Ok(admitted))) => admitted,
            Ok((peer, Err(refusal))) => {
                tracing::warn!(%peer, %refusal, "lock server: refused a connection");
                match &refuser {
                    Some(refuser) => refuser.refuse(stream, refusal),
                    None => handshake::refuse_at_accept(&stream, &refusal),
                }
                continue;
            }
            // The peer is gone already.
            Err(_) => continue,
        };
        let shared = shared.clone();
        let credentials = credentials.clone();
        let spawned = std::thread::Builder::new()
            .name("lock-server-conn".into())
            .spawn(move || {
                if let Err(error) = serve(stream, &shared, &credentials, admitted) {
                    tracing::debug!(%error, "lock server: connection ended");
                }
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "lock server: cannot spawn a connection thread");
        }
    }
}

/// Serves one connection until it closes, then releases what it still holds. Nothing is served
/// before the peer has passed the handshake.
fn serve(
    mut stream: TcpStream,
    shared: &Shared,
    credentials: &Credentials,
    mut admitted: Admitted,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    if let Err(refusal) = handshake::server_handshake::<(), ()>(
        &mut stream,
        Protocol::LockServer,
        credentials,
        |_| Ok(()),
    ) {
        tracing::warn!(%refusal, "lock server: refused a connection");
        return Ok(());
    }
    admitted.authenticated();
    stream.set_read_timeout(None)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream);
    serve_requests(&mut reader, &mut writer, shared)
}

/// Most locks one connection may hold at once: a hostile (authenticated) client cannot grow
/// the server's table without bound, and the check for a connection's own overlapping lock
/// stays cheap.
pub const MAX_HELD_PER_CONNECTION: usize = 4096;

/// Answers an authenticated connection's requests until it closes, then releases every lock
/// it still holds.
fn serve_requests(
    reader: &mut impl io::Read,
    writer: &mut impl Write,
    shared: &Shared,
) -> io::Result<()> {
    // The ranges this connection holds, by lock id.
    let mut mine: HashMap<u64, Range<u64>> = HashMap::new();
    let mut body = Vec::new();
    let result = loop {
        match read_frame(reader, MAX_FRAME, &mut body) {
            Ok(()) => {}
            Err(FrameError::Io(error)) if error.kind() == io::ErrorKind::UnexpectedEof => {
                break Ok(())
            }
            Err(FrameError::Io(error)) => break Err(error),
            Err(error) => {
                // Too large (the stream cannot be resynchronised) or corrupt: say why, then
                // close.
                tracing::warn!(%error, "lock server: closing a connection");
                let answer = Response::Error(format!("{error} (lock server frames)"));
                if let Ok(encoded) = postcard::to_stdvec(&answer) {
                    let _ = write_frame(writer, &encoded).and_then(|()| writer.flush());
                }
                break Err(io::Error::new(io::ErrorKind::InvalidData, error));
            }
        }
        let response = match postcard::from_bytes::<Request>(&body) {
            Ok(
                ref request @ (Request::Acquire { start, end }
                | Request::AcquireShared { start, end }),
            ) if start < end => {
                let shared_mode = matches!(request, Request::AcquireShared { .. });
                let range = start..end;
                if mine.len() >= MAX_HELD_PER_CONNECTION {
                    Response::Error(format!(
                        "this connection holds {} locks, the most it may \
                         (MAX_HELD_PER_CONNECTION)",
                        mine.len()
                    ))
                } else if let Some((id, held)) = mine
                    .iter()
                    .find(|(_, held)| held.start < range.end && range.start < held.end)
                {
                    // Waiting would never end: the request waits for this connection, which
                    // waits for the answer.
                    Response::Error(format!(
                        "{start}..{end} overlaps {}..{} that this connection holds (lock {id}): \
                         it would wait for itself",
                        held.start, held.end
                    ))
                } else {
                    let id = acquire(shared, range.clone(), shared_mode);
                    mine.insert(id, range);
                    Response::Granted { id }
                }
            }
            Ok(Request::Acquire { start, end } | Request::AcquireShared { start, end }) => {
                Response::Error(format!("empty range {start}..{end}"))
            }
            Ok(Request::Release { id }) => {
                if mine.remove(&id).is_some() && shared.table().release(id) {
                    shared.changed.notify_all();
                    Response::Released
                } else {
                    Response::Error(format!("lock {id} is not held by this connection"))
                }
            }
            Err(error) => Response::Error(format!("bad request: {error}")),
        };
        let encoded = postcard::to_stdvec(&response)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if let Err(error) = write_frame(writer, &encoded).and_then(|()| writer.flush()) {
            break Err(error);
        }
    };
    if !mine.is_empty() {
        let mut table = shared.table();
        for id in mine.into_keys() {
            table.release(id);
        }
        drop(table);
        shared.changed.notify_all();
    }
    result
}

#[cfg(any(test, feature = "fuzzing"))]
/// Fuzz entry: `input` is what a peer sends the lock server. The first byte selects whether
/// the connection starts authenticated (bit 0 set) or must pass the handshake first; the rest
/// is the byte stream, served exactly as a connection is (handshake, then requests, against a
/// fresh table). Checks, panicking on a finding: nothing blocks (a connection's request never
/// waits on its own lock); every answer is a well-formed frame holding a decodable answer; and
/// when the stream ends, the connection's locks are all released and nothing waits.
pub fn fuzz_entry(data: &[u8]) {
    let Some((&mode, input)) = data.split_first() else {
        return;
    };
    let shared = Shared {
        table: Mutex::new(Table::default()),
        changed: Condvar::new(),
        stopping: AtomicBool::new(false),
    };
    let mut pipe = fabric::fuzz::Pipe::new(input);
    let authenticated = mode & 1 != 0
        || handshake::server_handshake_with_nonce::<(), ()>(
            &mut pipe,
            Protocol::LockServer,
            &handshake::fuzz_credentials(),
            handshake::FUZZ_NONCE,
            |_| Ok(()),
        )
        .is_ok();
    if authenticated {
        let mut reader = pipe.input;
        let mut writer = Vec::new();
        let _ = serve_requests(&mut reader, &mut writer, &shared);
        pipe.output.extend_from_slice(&writer);
    }
    let mut out = &pipe.output[..];
    let mut body = Vec::new();
    // The answers to the hello and to the proof come first, unless it started authenticated.
    let mut handshake: u8 = if mode & 1 == 0 { 2 } else { 0 };
    while !out.is_empty() {
        if let Err(e) = read_frame(&mut out, MAX_FRAME, &mut body) {
            panic!("the lock server wrote a bad frame: {e}");
        }
        let decoded = match handshake {
            2 => postcard::from_bytes::<handshake::ChallengeAnswer>(&body).map(drop),
            1 => postcard::from_bytes::<Result<(), handshake::Refusal>>(&body).map(drop),
            _ => postcard::from_bytes::<Response>(&body).map(drop),
        };
        handshake = handshake.saturating_sub(1);
        if let Err(e) = decoded {
            panic!("the lock server wrote an undecodable answer: {e}");
        }
    }
    let table = shared.table();
    assert!(
        table.held.is_empty() && table.owners.is_empty() && table.waiting.is_empty(),
        "a closed connection left locks behind"
    );
}

#[cfg(any(test, feature = "fuzzing"))]
/// Seeds for [`fuzz_entry`]: a handshake then requests of every kind (acquire, overlapping
/// acquire, release of a held and of an unknown lock, an empty range), and the same requests
/// on a connection that starts authenticated.
pub fn fuzz_seeds() -> Vec<Vec<u8>> {
    let frame = |r: &Request| fabric::fuzz::frame(&postcard::to_stdvec(r).expect("encodes"));
    let requests: Vec<u8> = [
        Request::Acquire { start: 0, end: 10 },
        Request::Acquire { start: 5, end: 20 },
        Request::AcquireShared { start: 3, end: 8 },
        Request::AcquireShared { start: 4, end: 30 },
        Request::Acquire {
            start: 10,
            end: u64::MAX,
        },
        Request::Release { id: 0 },
        Request::Release { id: 99 },
        Request::Acquire { start: 7, end: 7 },
        Request::Acquire { start: 0, end: 1 },
    ]
    .iter()
    .flat_map(frame)
    .collect();
    let mut hello =
        handshake::Hello::new(Protocol::LockServer, &handshake::fuzz_credentials(), 0, ());
    hello.nonce = handshake::FUZZ_NONCE;
    // The hello and the client's proof for a server drawing `FUZZ_NONCE`.
    let hello = handshake::fuzz_handshake(&hello);
    vec![
        [&[0u8][..], &hello, &requests].concat(),
        [&[1u8][..], &requests].concat(),
        [&[0u8][..], &requests].concat(),
    ]
}

/// Blocks until `range` can be granted, then grants it.
fn acquire(shared: &Shared, range: Range<u64>, mode_shared: bool) -> u64 {
    let mut table = shared.table();
    let arrival = table.next_arrival;
    table.next_arrival += 1;
    if table.grantable(arrival, &range, mode_shared) {
        return table.grant(range, mode_shared);
    }
    table.waiting.insert(arrival, (range.clone(), mode_shared));
    loop {
        table = shared
            .changed
            .wait(table)
            .expect("lock server table poisoned");
        if table.grantable(arrival, &range, mode_shared) {
            table.waiting.remove(&arrival);
            let id = table.grant(range, mode_shared);
            // Leaving the queue may unblock later requests that only conflicted with us.
            shared.changed.notify_all();
            return id;
        }
    }
}

/// One thread's connection to a [`LockServer`].
pub struct LockServerClient {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
    body: Vec<u8>,
    stats: LockStats,
}

impl LockServerClient {
    /// Connects to the server at `addr`, presenting `credentials` in the handshake; a server
    /// of another cluster, or one holding another token, refuses with the reason.
    pub fn connect(addr: impl ToSocketAddrs, credentials: &Credentials) -> Result<Self, LockError> {
        let mut stream = TcpStream::connect(addr)
            .and_then(|s| s.set_nodelay(true).map(|()| s))
            .map_err(|e| LockError::Server(format!("connect: {e}")))?;
        let hello = handshake::Hello::new(Protocol::LockServer, credentials, 0, ());
        let setup = |s: &TcpStream, timeout| {
            s.set_read_timeout(timeout)
                .map_err(|e| LockError::Server(format!("connect: {e}")))
        };
        setup(&stream, Some(HANDSHAKE_TIMEOUT))?;
        handshake::client_handshake::<(), ()>(&mut stream, &hello, credentials, MAX_FRAME)
            .map_err(|e| match e {
                HandshakeError::Refused(refusal) => {
                    LockError::Server(format!("refused: {refusal}"))
                }
                other => LockError::Server(other.to_string()),
            })?;
        setup(&stream, None)?;
        let reader = stream
            .try_clone()
            .map_err(|e| LockError::Server(format!("connect: {e}")))?;
        Ok(Self {
            reader: BufReader::new(reader),
            writer: BufWriter::new(stream),
            body: Vec::new(),
            stats: LockStats::default(),
        })
    }

    fn call(&mut self, request: &Request) -> Result<Response, LockError> {
        let encoded = postcard::to_stdvec(request)
            .map_err(|e| LockError::Server(format!("encode request: {e}")))?;
        write_frame(&mut self.writer, &encoded)
            .and_then(|()| self.writer.flush())
            .map_err(|e| LockError::Server(format!("send: {e}")))?;
        read_frame(&mut self.reader, MAX_FRAME, &mut self.body)
            .map_err(|e| LockError::Server(format!("receive: {e}")))?;
        postcard::from_bytes(&self.body)
            .map_err(|e| LockError::Server(format!("bad response: {e}")))
    }
}

impl Drop for LockServerClient {
    fn drop(&mut self) {
        let _ = self.writer.get_ref().shutdown(Shutdown::Both);
    }
}

impl RangeLock for LockServerClient {
    fn acquire(&mut self, range: Range<u64>) -> Result<LockId, LockError> {
        self.acquire_mode(range, LockMode::Exclusive)
    }

    fn modes(&self) -> &'static [LockMode] {
        crate::scheme::EXCLUSIVE_AND_SHARED
    }

    /// The trait's `acquire_with` executes `extra` on its fallback after the grant, once.
    fn extra_runs_once_granted(&self) -> bool {
        true
    }

    fn acquire_mode(&mut self, range: Range<u64>, mode: LockMode) -> Result<LockId, LockError> {
        check_range(&range)?;
        let started = Instant::now();
        let (start, end) = (range.start, range.end);
        let response = self.call(&match mode {
            LockMode::Exclusive => Request::Acquire { start, end },
            LockMode::Shared => Request::AcquireShared { start, end },
        });
        self.stats.acquire_time += started.elapsed();
        self.stats.acquire.round_trips += 1;
        self.stats.acquire.verbs += 1;
        match response? {
            Response::Granted { id } => {
                self.stats.acquisitions += 1;
                Ok(LockId(id))
            }
            Response::Error(why) => Err(LockError::Server(why)),
            other => Err(LockError::Server(format!(
                "unexpected answer to acquire: {other:?}"
            ))),
        }
    }

    fn release(&mut self, id: LockId) -> Result<(), LockError> {
        let response = self.call(&Request::Release { id: id.0 });
        self.stats.release.round_trips += 1;
        self.stats.release.verbs += 1;
        match response? {
            Response::Released => {
                self.stats.releases += 1;
                Ok(())
            }
            Response::Error(_) => Err(LockError::NotHeld(id)),
            other => Err(LockError::Server(format!(
                "unexpected answer to release: {other:?}"
            ))),
        }
    }

    fn stats(&self) -> LockStats {
        self.stats
    }

    fn scheme(&self) -> &'static str {
        LockScheme::SERVER.name()
    }
}

/// Where a lock server listens, and the credentials it checks in the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockServerAt {
    /// Its address.
    pub addr: SocketAddr,
    /// What a client presents.
    pub credentials: Credentials,
}

/// `server` for [`crate::schemes::create`]: the lock server at `at`, or a new one on loopback
/// in this process, with a fresh token only this process (and whoever it hands `LockServerAt`
/// to) knows.
pub(crate) fn create_state(
    at: Option<&LockServerAt>,
) -> Result<(LockServerAt, Option<Arc<LockServer>>), LockError> {
    if let Some(at) = at {
        return Ok((at.clone(), None));
    }
    let token = handshake::random_token()
        .map_err(|e| LockError::Server(format!("cannot make a token: {e}")))?;
    let credentials = Credentials::new("lockmgr", token);
    let server = LockServer::bind("127.0.0.1:0", credentials.clone())
        .map_err(|e| LockError::Server(format!("cannot start lock server: {e}")))?;
    let at = LockServerAt {
        addr: server.addr(),
        credentials,
    };
    Ok((at, Some(Arc::new(server))))
}

/// `server` for [`crate::schemes::open`]: a connection to the server at `at`.
pub(crate) fn open_handle(at: Option<&LockServerAt>) -> Result<LockServerClient, LockError> {
    let at =
        at.ok_or_else(|| LockError::Config("server: the lock server's address is needed".into()))?;
    LockServerClient::connect(at.addr, &at.credentials)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lock server's protocol under the stable fuzzer (see `fabric::fuzz`).
    #[test]
    fn fuzz_lock_server() {
        let seeds = fuzz_seeds();
        let report = fabric::fuzz::run_framed(
            "lock server",
            &seeds,
            fabric::fuzz::DEFAULT_BUDGET,
            Some(1),
            fuzz_entry,
        );
        assert!(report.execs > seeds.len() as u64);
    }

    /// A connection asking again for a range it holds is told so instead of waiting for
    /// itself forever; other ranges are still granted, and its locks are freed when it closes.
    #[test]
    fn an_overlapping_request_of_the_holder_is_refused_not_hung() {
        let server = LockServer::bind("127.0.0.1:0", creds()).unwrap();
        let mut a = LockServerClient::connect(server.addr(), &creds()).unwrap();
        let id = a.acquire(0..10).unwrap();
        match a.acquire(5..6) {
            Err(LockError::Server(why)) => assert!(why.contains("wait for itself"), "{why}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        let other = a.acquire(10..20).unwrap();
        a.release(id).unwrap();
        a.release(other).unwrap();
        assert_eq!(server.held(), 0);
    }

    /// Polls `done` until it holds, failing after 10 s (the server counts a connection when
    /// its accept thread gets to it, and uncounts it when its thread sees the close).
    fn wait_for(mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Beyond its connection limits the lock server refuses a peer, naming the limit, before
    /// reading it; the place frees when the silent peer goes.
    #[test]
    fn connections_are_limited() {
        let limits = ConnectionLimits {
            max_per_peer: 2,
            max_pending: 1,
            max_pending_per_peer: 2,
        };
        let server = LockServer::bind_with_limits("127.0.0.1:0", creds(), limits).unwrap();
        let silent = TcpStream::connect(server.addr()).unwrap();
        let refused = |result: Result<LockServerClient, LockError>, setting: &str| match result {
            Err(LockError::Server(why)) => why.contains(setting),
            _ => false,
        };
        wait_for(|| {
            refused(
                LockServerClient::connect(server.addr(), &creds()),
                "max_pending_handshakes = 1",
            )
        });
        drop(silent);
        let mut clients = Vec::new();
        wait_for(|| {
            if let Ok(c) = LockServerClient::connect(server.addr(), &creds()) {
                clients.push(c);
            }
            clients.len() == 2
        });
        assert!(refused(
            LockServerClient::connect(server.addr(), &creds()),
            "max_connections_per_peer = 2"
        ));
    }

    #[test]
    fn interval_set_finds_overlaps() {
        let mut table = Table::default();
        table.grant(10..20, false);
        table.grant(30..40, false);
        assert!(!table.overlaps_held(&(0..10)));
        assert!(!table.overlaps_held(&(20..30)));
        assert!(table.overlaps_held(&(19..21)));
        assert!(table.overlaps_held(&(0..100)));
        assert!(table.overlaps_held(&(35..36)));
        assert!(!table.overlaps_held(&(40..u64::MAX)));
    }

    #[test]
    fn waiting_request_blocks_later_conflicting_ones() {
        let mut table = Table::default();
        table.grant(0..10, false);
        table.waiting.insert(0, (5..50, false));
        // Arrived later, overlaps the waiting 5..50 but no held range: must queue behind it.
        assert!(!table.grantable(1, &(40..45), false));
        assert!(!table.grantable(1, &(40..45), true));
        assert!(table.grantable(1, &(50..60), false));
    }

    #[test]
    fn readers_share_and_writers_wait() {
        let mut table = Table::default();
        let a = table.grant(0..100, true);
        // Readers overlap readers.
        assert!(table.grantable(0, &(50..60), true));
        let b = table.grant(50..60, true);
        // A writer overlapping either reader waits; one beside them does not.
        assert!(!table.grantable(1, &(99..200), false));
        assert!(!table.grantable(1, &(55..56), false));
        assert!(table.grantable(1, &(100..200), false));
        // A waiting writer bars later overlapping readers (no writer starvation), not others.
        table.waiting.insert(2, (90..95, false));
        assert!(!table.grantable(3, &(0..91), true));
        assert!(table.grantable(3, &(0..90), true));
        // Readers waiting do not hold back later readers.
        table.waiting.insert(4, (200..300, true));
        assert!(table.grantable(5, &(250..260), true));
        assert!(table.release(a));
        assert!(table.release(b));
        assert!(!table.overlaps_shared(&(0..1000)));
        table.waiting.clear();
        assert!(table.grantable(6, &(0..1000), false));
    }

    fn creds() -> Credentials {
        Credentials::new("c", "secret")
    }

    #[test]
    fn dropping_a_connection_releases_its_locks() {
        let server = LockServer::bind("127.0.0.1:0", creds()).unwrap();
        let mut a = LockServerClient::connect(server.addr(), &creds()).unwrap();
        a.acquire(0..100).unwrap();
        drop(a);
        let mut b = LockServerClient::connect(server.addr(), &creds()).unwrap();
        let id = b.acquire(50..60).unwrap();
        b.release(id).unwrap();
        assert!(matches!(b.release(id), Err(LockError::NotHeld(_))));
    }

    /// The lock server takes no request from a peer without the cluster's token: a client with
    /// a wrong or empty token refuses the server (which proves another secret) and says why, one
    /// of another cluster is refused with the reason, and a raw peer that skips the
    /// handshake and sends an `Acquire` gets no lock (the range stays free for others).
    #[test]
    fn refuses_a_peer_without_the_token() {
        let server = LockServer::bind("127.0.0.1:0", creds()).unwrap();
        for (bad, expected) in [
            // A wrong secret: the client cannot verify the server, and says so.
            (
                Credentials::new("c", "wrong"),
                "could not verify the server",
            ),
            (Credentials::new("c", ""), "could not verify the server"),
            (
                Credentials::new("other", "secret"),
                "refused: wrong cluster",
            ),
        ] {
            match LockServerClient::connect(server.addr(), &bad) {
                Err(LockError::Server(why)) => assert!(why.contains(expected), "{why}"),
                Err(other) => panic!("expected a refusal, got {other}"),
                Ok(_) => panic!("a peer with {bad:?} was let in"),
            }
        }

        // A raw peer skipping the handshake: its Acquire is read as a hello and refused.
        let mut raw = TcpStream::connect(server.addr()).unwrap();
        raw.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let acquire = postcard::to_stdvec(&Request::Acquire { start: 0, end: 10 }).unwrap();
        write_frame(&mut raw, &acquire).unwrap();
        let mut answer = Vec::new();
        read_frame(&mut raw, MAX_FRAME, &mut answer).unwrap();
        let answer: Result<(), handshake::Refusal> = postcard::from_bytes(&answer).unwrap();
        assert!(answer.is_err(), "a peer without a hello must be refused");
        let mut rest = Vec::new();
        assert_eq!(
            std::io::Read::read_to_end(&mut raw, &mut rest).unwrap(),
            0,
            "the server closes the refused connection"
        );
        assert_eq!(server.held(), 0, "a refused peer holds nothing");

        let mut good = LockServerClient::connect(server.addr(), &creds()).unwrap();
        let id = good.acquire(0..10).unwrap();
        good.release(id).unwrap();
    }
}
