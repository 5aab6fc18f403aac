//! The `server` baseline: a CPU-based lock server (seed 000 §2.2, Table 1 "IT").
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
//! # Failure
//!
//! When a connection closes (the client exited or crashed), the server releases every lock that
//! connection held and withdraws its waiting request.

use crate::scheme::{check_range, LockError, LockId, RangeLock};
use crate::schemes::LockScheme;
use crate::stats::LockStats;
use fabric::frame::{read_frame, write_frame, FrameError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
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
    owners: HashMap<u64, u64>,
    waiting: BTreeMap<u64, Range<u64>>,
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

    /// Whether the request that arrived as `arrival` may be granted now.
    fn grantable(&self, arrival: u64, range: &Range<u64>) -> bool {
        !self.overlaps_held(range)
            && !self
                .waiting
                .range(..arrival)
                .any(|(_, w)| w.start < range.end && range.start < w.end)
    }

    fn grant(&mut self, range: Range<u64>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.held.insert(range.start, (range.end, id));
        self.owners.insert(id, range.start);
        id
    }

    fn release(&mut self, id: u64) -> bool {
        match self.owners.remove(&id) {
            Some(start) => {
                self.held.remove(&start);
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
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl LockServer {
    /// Binds to `addr` (e.g. `127.0.0.1:0`) and starts serving on a background thread.
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            table: Mutex::new(Table::default()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let acceptor = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("lock-server".into())
                .spawn(move || accept_loop(listener, shared))?
        };
        Ok(Self {
            addr,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
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

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
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
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("lock-server-conn".into())
            .spawn(move || {
                if let Err(error) = serve(stream, &shared) {
                    tracing::debug!(%error, "lock server: connection ended");
                }
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "lock server: cannot spawn a connection thread");
        }
    }
}

/// Serves one connection until it closes, then releases what it still holds.
fn serve(stream: TcpStream, shared: &Shared) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream);
    let mut mine: HashSet<u64> = HashSet::new();
    let mut body = Vec::new();
    let result = loop {
        match read_frame(&mut reader, MAX_FRAME, &mut body) {
            Ok(()) => {}
            Err(FrameError::Io(error)) if error.kind() == io::ErrorKind::UnexpectedEof => {
                break Ok(())
            }
            Err(FrameError::Io(error)) => break Err(error),
            Err(error) => break Err(io::Error::new(io::ErrorKind::InvalidData, error)),
        }
        let response = match postcard::from_bytes::<Request>(&body) {
            Ok(Request::Acquire { start, end }) if start < end => {
                let id = acquire(shared, start..end);
                mine.insert(id);
                Response::Granted { id }
            }
            Ok(Request::Acquire { start, end }) => {
                Response::Error(format!("empty range {start}..{end}"))
            }
            Ok(Request::Release { id }) => {
                if mine.remove(&id) && shared.table().release(id) {
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
        if let Err(error) = write_frame(&mut writer, &encoded).and_then(|()| writer.flush()) {
            break Err(error);
        }
    };
    if !mine.is_empty() {
        let mut table = shared.table();
        for id in mine {
            table.release(id);
        }
        drop(table);
        shared.changed.notify_all();
    }
    result
}

/// Blocks until `range` can be granted, then grants it.
fn acquire(shared: &Shared, range: Range<u64>) -> u64 {
    let mut table = shared.table();
    let arrival = table.next_arrival;
    table.next_arrival += 1;
    if table.grantable(arrival, &range) {
        return table.grant(range);
    }
    table.waiting.insert(arrival, range.clone());
    loop {
        table = shared
            .changed
            .wait(table)
            .expect("lock server table poisoned");
        if table.grantable(arrival, &range) {
            table.waiting.remove(&arrival);
            let id = table.grant(range);
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
    /// Connects to the server at `addr`.
    pub fn connect(addr: impl ToSocketAddrs) -> Result<Self, LockError> {
        let connect = || -> io::Result<Self> {
            let stream = TcpStream::connect(addr)?;
            stream.set_nodelay(true)?;
            Ok(Self {
                reader: BufReader::new(stream.try_clone()?),
                writer: BufWriter::new(stream),
                body: Vec::new(),
                stats: LockStats::default(),
            })
        };
        connect().map_err(|e| LockError::Server(format!("connect: {e}")))
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
        check_range(&range)?;
        let started = Instant::now();
        let response = self.call(&Request::Acquire {
            start: range.start,
            end: range.end,
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

/// `server` for [`crate::schemes::create`]: its lock state is the server's table, so creating it
/// means having a server. Returns where it listens — `at` when the creator runs one already
/// (the meta server's), else a server started here on loopback, returned too so that the
/// caller keeps it running.
pub(crate) fn create_state(
    at: Option<SocketAddr>,
) -> Result<(SocketAddr, Option<Arc<LockServer>>), LockError> {
    if let Some(addr) = at {
        return Ok((addr, None));
    }
    let server = LockServer::bind("127.0.0.1:0")
        .map_err(|e| LockError::Server(format!("cannot start lock server: {e}")))?;
    Ok((server.addr(), Some(Arc::new(server))))
}

/// `server` for [`crate::schemes::open`]: a connection to the server at `at`.
pub(crate) fn open_handle(at: Option<SocketAddr>) -> Result<LockServerClient, LockError> {
    let addr =
        at.ok_or_else(|| LockError::Config("server: the lock server's address is needed".into()))?;
    LockServerClient::connect(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_set_finds_overlaps() {
        let mut table = Table::default();
        table.grant(10..20);
        table.grant(30..40);
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
        table.grant(0..10);
        table.waiting.insert(0, 5..50);
        // Arrived later, overlaps the waiting 5..50 but no held range: must queue behind it.
        assert!(!table.grantable(1, &(40..45)));
        assert!(table.grantable(1, &(50..60)));
    }

    #[test]
    fn dropping_a_connection_releases_its_locks() {
        let server = LockServer::bind("127.0.0.1:0").unwrap();
        let mut a = LockServerClient::connect(server.addr()).unwrap();
        a.acquire(0..100).unwrap();
        drop(a);
        let mut b = LockServerClient::connect(server.addr()).unwrap();
        let id = b.acquire(50..60).unwrap();
        b.release(id).unwrap();
        assert!(matches!(b.release(id), Err(LockError::NotHeld(_))));
    }
}
