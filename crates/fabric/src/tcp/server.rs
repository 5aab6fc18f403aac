//! The `tcp` server: a software NIC that executes the verbs it receives against its regions.
//!
//! One accept thread, and one thread per connection with blocking I/O: a connection carries one
//! outstanding batch at a time (an endpoint is one client thread), so a blocked `read` that wakes
//! straight into the executor is the shortest path from the wire to memory.
//!
//! A connection may also call the procedures registered on the server ([`crate::procedure`]);
//! a call runs on the connection's thread, and each batch it executes on the server's memory
//! passes the connection's fencing gate ([`Gate`]) as the connection's own batches do.

use super::wire::{
    self, begin_frame, seal_frame, HelloAnswer, Refusal, RegionInfo, RemoteError, Reply, Welcome,
    MAX_HELLO_FRAME, MAX_REQUEST_FRAME, PROTOCOL_VERSION,
};
use crate::addr::RegionId;
use crate::batch::{Batch, Completions, Verb};
use crate::endpoint::{Capabilities, Connector, Endpoint, EndpointStats};
use crate::error::{FabricError, Result, VerbError};
use crate::frame::{self, FrameError};
use crate::handshake::{
    self, Admission, Admitted, ChallengeAnswer, Challenged, ConnectionLimits, Credentials, Nonce,
    Protocol, HANDSHAKE_TIMEOUT,
};
use crate::procedure::{Procedure, ProcedureId, ProcedureSession, Procedures, MAX_CALL_BYTES};
use crate::region::{Region, RegionTable};
use std::collections::{HashMap, HashSet};
use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long the server keeps reading (and discarding) after it has sent a final error and is
/// about to close: long enough for the peer to receive the error before the close, short enough
/// that a hostile peer cannot hold a thread.
const LINGER: Duration = Duration::from_millis(500);

/// Recovers the data of a poisoned lock: every critical section here leaves its data consistent
/// (single inserts and removals), so a panic elsewhere must not take the server down with it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What every connection of one server shares.
pub(crate) struct Shared {
    credentials: Credentials,
    regions: RwLock<RegionTable>,
    /// Bumped after every deregistration, so that connections drop cached regions that are gone.
    generation: AtomicU64,
    /// Client sessions the cluster has fenced: their connections are refused and cut off.
    revoked: RwLock<HashSet<u64>>,
    /// Client sessions below this (0 excepted) are refused as if revoked: those of an earlier
    /// run of the server that numbers the sessions ([`Shared::refuse_sessions_before`]).
    session_floor: AtomicU64,
    /// Bumped after every revocation, so that a connection looks at `revoked` only when it
    /// changed (the hot path reads one atomic).
    revocations: AtomicU64,
    /// Every connection's execution state ([`IDLE`], or [`BUSY`] with the revocation count it
    /// checked its session against): a revocation waits for the batches that passed their
    /// check before it (see [`Shared::revoke`]).
    executing: Mutex<Vec<std::sync::Weak<AtomicU64>>>,
    /// The procedures this server runs for its clients ([`crate::procedure`]).
    procedures: Procedures,
}

/// A connection's execution state when it executes nothing.
const IDLE: u64 = 0;
/// Set in a connection's execution state while it checks and executes a batch; the other bits
/// hold the revocation count it checked against.
const BUSY: u64 = 1 << 63;

impl Shared {
    pub(crate) fn new(credentials: Credentials) -> Self {
        Self {
            credentials,
            regions: RwLock::new(RegionTable::new()),
            generation: AtomicU64::new(0),
            revoked: RwLock::new(HashSet::new()),
            session_floor: AtomicU64::new(0),
            revocations: AtomicU64::new(0),
            executing: Mutex::new(Vec::new()),
            procedures: Procedures::default(),
        }
    }

    /// Offers `procedure` under `id` to every connection.
    pub(crate) fn add_procedure(
        &self,
        id: ProcedureId,
        procedure: Arc<dyn Procedure>,
    ) -> Result<()> {
        self.procedures.add(id, procedure)
    }

    /// A new connection's execution state, registered for revocations to wait on.
    fn register(&self) -> Arc<AtomicU64> {
        let state = Arc::new(AtomicU64::new(IDLE));
        lock(&self.executing).push(Arc::downgrade(&state));
        state
    }

    /// Whether `session`'s verbs are refused: revoked, or below the floor (an established
    /// connection of such a session executes nothing more, whichever it is).
    fn is_revoked(&self, session: u64) -> bool {
        self.is_behind(session)
            || (session != 0
                && self
                    .revoked
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .contains(&session))
    }

    /// Whether `session` belongs to an earlier run of the server that numbers the sessions:
    /// below the floor, 0 (no session) excepted.
    fn is_behind(&self, session: u64) -> bool {
        session != 0 && session < self.session_floor.load(Ordering::SeqCst)
    }

    /// Refuses every session below `floor` (0 excepted), as [`Shared::revoke`] does a list,
    /// and returns once no batch of theirs can execute any more.
    fn refuse_sessions_before(&self, floor: u64) {
        self.session_floor.fetch_max(floor, Ordering::SeqCst);
        self.wait_out_revoked();
    }

    /// Revokes `sessions` and returns only when no batch of theirs can execute any more: a
    /// batch that passed its session check before the revocation is waited for.
    ///
    /// Without the wait, a connection thread preempted between its check and its execution
    /// (a loaded host) would land a revoked client's write after the fence that revoked it had
    /// been acknowledged — after the breaker took the lock (seen as a torn record in the pause
    /// test under load). The handshake with [`Session::request`] is Dekker's: the connection
    /// publishes `BUSY | count` and then re-reads the count; the revoker bumps the count and
    /// then reads every state (all `SeqCst`). Either the connection sees the new count and
    /// checks again, or the revoker sees it busy with an older count and waits for `IDLE`.
    fn revoke(&self, sessions: &[u64]) {
        {
            let mut set = self.revoked.write().unwrap_or_else(PoisonError::into_inner);
            set.extend(sessions.iter().copied().filter(|&s| s != 0));
        }
        self.wait_out_revoked();
    }

    /// The second half of a revocation, once the sessions are marked: bumps the revocation
    /// count and waits for every batch that passed its session check before it.
    fn wait_out_revoked(&self) {
        // After the marking: a connection that sees the new count finds its session revoked.
        let count = self.revocations.fetch_add(1, Ordering::SeqCst) + 1;
        let states: Vec<Arc<AtomicU64>> = {
            let mut all = lock(&self.executing);
            all.retain(|s| s.strong_count() > 0);
            all.iter().filter_map(std::sync::Weak::upgrade).collect()
        };
        for state in states {
            let mut pause = std::time::Duration::from_micros(10);
            loop {
                let s = state.load(Ordering::SeqCst);
                if s & BUSY == 0 || s & !BUSY >= count {
                    break;
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(1));
            }
        }
    }

    fn resolve(&self, id: RegionId) -> Option<Arc<Region>> {
        self.regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    pub(crate) fn add(&self, region: Arc<Region>) -> Result<()> {
        let mut table = self.regions.write().unwrap_or_else(PoisonError::into_inner);
        if table.get(region.id()).is_some() {
            return Err(FabricError::Config(format!(
                "{} is already registered",
                region.id()
            )));
        }
        table.insert(region);
        Ok(())
    }

    fn remove(&self, id: RegionId) -> Option<Arc<Region>> {
        let removed = self
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
        // After the removal: a connection that sees the new generation cannot find the region.
        self.generation.fetch_add(1, Ordering::SeqCst);
        removed
    }

    fn list(&self) -> Vec<RegionInfo> {
        self.regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|r| RegionInfo {
                id: r.id(),
                len: r.len(),
            })
            .collect()
    }
}

/// One connection's admission of executions against the revocations (see [`Shared::revoke`]):
/// every batch of the connection, and every batch a procedure runs for it, passes through
/// [`Gate::run`].
struct Gate {
    shared: Arc<Shared>,
    /// The connection's execution state, registered with `shared` (shared by the gates of the
    /// host endpoints its procedures open: they run on the connection's thread, never at once).
    state: Arc<AtomicU64>,
    /// The client session named in the handshake (0: none).
    session: u64,
    /// The value of `Shared::revocations` when this gate last checked its session.
    checked: u64,
    /// The session was found revoked: nothing runs through this gate any more.
    revoked: bool,
}

impl Gate {
    fn new(shared: Arc<Shared>, state: Arc<AtomicU64>, session: u64) -> Self {
        Self {
            shared,
            state,
            session,
            checked: 0,
            revoked: false,
        }
    }

    /// Runs `f` as one execution of the connection, unless its session has been revoked
    /// (`None`). Busy from before the check until after `f` (see `Shared::revoke`).
    fn run<T>(&mut self, f: impl FnOnce(&Shared) -> T) -> Option<T> {
        let mut revocations = self.shared.revocations.load(Ordering::SeqCst);
        loop {
            self.state.store(BUSY | revocations, Ordering::SeqCst);
            let now = self.shared.revocations.load(Ordering::SeqCst);
            if now == revocations {
                break;
            }
            revocations = now;
        }
        if revocations != self.checked {
            self.checked = revocations;
            self.revoked |= self.shared.is_revoked(self.session);
        }
        let out = (!self.revoked).then(|| f(&self.shared));
        self.state.store(IDLE, Ordering::SeqCst);
        out
    }
}

/// Executes `batch` against `shared`'s regions through a connection's region cache (dropped
/// when a region was deregistered since `generation`).
fn execute_cached(
    shared: &Shared,
    cache: &mut RegionTable,
    generation: &mut u64,
    batch: &Batch,
    out: &mut Completions,
) -> Result<(), VerbError> {
    let now = shared.generation.load(Ordering::SeqCst);
    if now != *generation {
        *cache = RegionTable::new();
        *generation = now;
    }
    cache.fill_from(batch, |id| shared.resolve(id));
    cache.execute(batch, out)
}

/// Opens [`HostEndpoint`]s for one connection's procedures.
struct HostConnector {
    shared: Arc<Shared>,
    state: Arc<AtomicU64>,
    session: u64,
}

impl Connector for HostConnector {
    fn connect(&self) -> Result<Box<dyn Endpoint>> {
        Ok(Box::new(HostEndpoint {
            generation: self.shared.generation.load(Ordering::SeqCst),
            gate: Gate::new(self.shared.clone(), self.state.clone(), self.session),
            cache: RegionTable::new(),
            stats: EndpointStats::default(),
        }))
    }
}

/// An endpoint on the server's own memory, for a procedure running on a connection's behalf:
/// the connection's executor, region checks and fencing, without the network. A batch of a
/// revoked session fails with [`FabricError::Refused`] and executes nothing.
struct HostEndpoint {
    gate: Gate,
    cache: RegionTable,
    generation: u64,
    stats: EndpointStats,
}

impl Endpoint for HostEndpoint {
    fn execute(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        let Self {
            gate,
            cache,
            generation,
            ..
        } = self;
        match gate.run(|shared| execute_cached(shared, cache, generation, batch, out)) {
            Some(Ok(())) => {
                self.stats.record(batch);
                Ok(())
            }
            Some(Err(e)) => Err(FabricError::Verb(e)),
            None => Err(FabricError::Refused(format!(
                "session {} was revoked by the cluster",
                self.gate.session
            ))),
        }
    }

    fn stats(&self) -> EndpointStats {
        self.stats
    }

    fn capabilities(&self) -> Capabilities {
        // The server's CPU on its own memory: what `mem` and `shm` clients have.
        Capabilities::local("tcp-host")
    }
}

/// What a connection does after a frame has been handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Read the next frame.
    Continue,
    /// Send the reply (if any), then close: the peer is unauthenticated or the stream is out of
    /// sync.
    Close,
}

/// The server side of one connection, without the socket: the handshake state, the
/// connection's region cache and its reusable buffers.
///
/// Everything the server does with untrusted bytes goes through [`Session::handle`], which is
/// what the fuzz target drives.
pub(crate) struct Session {
    /// The server's shared state, the client session and the execution state (see
    /// [`Shared::revoke`]).
    gate: Gate,
    pub(crate) authenticated: bool,
    /// The accepted hello whose challenge was sent, while the client's proof is awaited.
    challenged: Option<Challenged<()>>,
    /// The server's nonce for the challenge, if given (fuzzing only); else a fresh one.
    pub(crate) fixed_nonce: Option<Nonce>,
    /// Regions this connection has used; filled from `shared` on a miss, so the hot path takes no
    /// lock (SMART: nothing shared on the post path).
    cache: RegionTable,
    generation: u64,
    /// The procedures this connection has called, each with its state.
    calls: HashMap<ProcedureId, Box<dyn ProcedureSession>>,
    /// A call's result, before it is framed.
    result: Vec<u8>,
    scratch: Vec<Verb>,
    batch: Batch,
    completions: Completions,
    /// The body of the frame being handled.
    pub(crate) rx: Vec<u8>,
    /// The reply frame, header included; empty when there is nothing to send.
    tx: Vec<u8>,
}

impl Session {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        let generation = shared.generation.load(Ordering::SeqCst);
        let state = shared.register();
        Self {
            gate: Gate::new(shared, state, 0),
            authenticated: false,
            challenged: None,
            fixed_nonce: None,
            cache: RegionTable::new(),
            generation,
            calls: HashMap::new(),
            result: Vec::new(),
            scratch: Vec::new(),
            batch: Batch::new(),
            completions: Completions::new(),
            rx: Vec::new(),
            tx: Vec::new(),
        }
    }

    /// The largest frame body this connection accepts now.
    pub(crate) fn frame_limit(&self) -> usize {
        if self.authenticated {
            MAX_REQUEST_FRAME
        } else {
            MAX_HELLO_FRAME
        }
    }

    /// The reply frame to send for the last handled frame (empty: send nothing).
    pub(crate) fn reply(&self) -> &[u8] {
        &self.tx
    }

    /// Handles the outcome of reading one frame into `self.rx` and leaves the reply in
    /// `self.tx`.
    pub(crate) fn handle(&mut self, read: Result<(), FrameError>) -> Next {
        self.tx.clear();
        match read {
            // Closed, reset or timed out: nothing to answer.
            Err(FrameError::Io(_)) => Next::Close,
            Err(FrameError::TooLarge { len, max }) => {
                tracing::warn!(
                    len,
                    max,
                    authenticated = self.authenticated,
                    "fabric tcp: frame over the limit, closing the connection"
                );
                if self.authenticated {
                    self.send(&Reply::Error(RemoteError::FrameTooLarge {
                        len: len as u64,
                        max: max as u64,
                    }));
                } else {
                    self.answer(Err(Refusal::BadHello(format!(
                        "first frame of {len} bytes exceeds the handshake limit of {max}"
                    ))));
                }
                // The body was not read: the stream cannot be resynchronised.
                Next::Close
            }
            Err(FrameError::BadChecksum { expected, actual }) => {
                if self.authenticated {
                    // The body was consumed, so the stream is still in sync.
                    self.send(&Reply::Error(RemoteError::BadChecksum { expected, actual }));
                    Next::Continue
                } else {
                    self.answer(Err(Refusal::BadHello(format!(
                        "handshake frame checksum mismatch ({expected:#010x} != {actual:#010x})"
                    ))));
                    Next::Close
                }
            }
            Ok(()) if !self.authenticated => match self.challenged.take() {
                None => {
                    // The hello: answered with the server's challenge.
                    let shared = &self.gate.shared;
                    let nonce = self.fixed_nonce.unwrap_or_else(handshake::fresh_nonce);
                    match handshake::accept_with_nonce::<()>(
                        &self.rx,
                        Protocol::Verbs,
                        &shared.credentials,
                        nonce,
                    ) {
                        Ok(challenged) => {
                            self.answer_challenge(Ok(challenged.challenge().clone()));
                            self.challenged = Some(challenged);
                            Next::Continue
                        }
                        Err(refusal) => {
                            self.answer_challenge(Err(refusal));
                            Next::Close
                        }
                    }
                }
                Some(challenged) => {
                    // The client's proof: answered with the welcome.
                    let answer = self.handshake(challenged);
                    self.authenticated = answer.is_ok();
                    self.answer(answer);
                    if self.authenticated {
                        Next::Continue
                    } else {
                        Next::Close
                    }
                }
            },
            Ok(()) => self.request(),
        }
    }

    /// Encodes `reply` as the frame to send.
    fn send(&mut self, reply: &Reply) {
        frame_reply(&mut self.tx, reply);
    }

    /// Encodes the answer to the hello as the frame to send.
    fn answer_challenge(&mut self, answer: ChallengeAnswer) {
        begin_frame(&mut self.tx);
        wire::encode_message(&mut self.tx, &answer);
        seal_frame(&mut self.tx);
    }

    /// Encodes the answer to the client's proof (or a refusal at any step) as the frame to
    /// send.
    fn answer(&mut self, answer: HelloAnswer) {
        begin_frame(&mut self.tx);
        wire::encode_message(&mut self.tx, &answer);
        seal_frame(&mut self.tx);
    }

    /// Checks the client's proof in `self.rx` with the handshake every protocol shares, then
    /// the session against the revoked ones.
    fn handshake(&mut self, challenged: Challenged<()>) -> HelloAnswer {
        let shared = &self.gate.shared;
        let hello = challenged.verify(&self.rx, &shared.credentials)?;
        // Read the count before the set: a revocation after this check bumps it again.
        self.gate.checked = shared.revocations.load(Ordering::SeqCst);
        // A session below the floor is told so apart from a revoked one: its client is behind
        // a restart (it catches up and joins again), not fenced. The meta server sets its floor
        // before its region exists, so only new connections meet it there.
        if shared.is_behind(hello.session) {
            return Err(Refusal::SessionBehind {
                session: hello.session,
                floor: shared.session_floor.load(Ordering::SeqCst),
            });
        }
        if shared.is_revoked(hello.session) {
            return Err(Refusal::Revoked {
                session: hello.session,
            });
        }
        self.gate.session = hello.session;
        Ok(Welcome {
            version: PROTOCOL_VERSION,
            regions: shared.list(),
            clock: crate::clock::now_micros(),
        })
    }

    /// Decodes, checks and executes the request in `self.rx`; a connection whose session has
    /// been revoked executes nothing more and is closed.
    fn request(&mut self) -> Next {
        if wire::is_call(&self.rx) {
            return self.call();
        }
        let Self {
            gate,
            cache,
            generation,
            scratch,
            batch,
            completions,
            rx,
            tx,
            ..
        } = self;
        let ran = gate.run(|shared| match wire::decode_request(rx, scratch, batch) {
            Ok(()) => match execute_cached(shared, cache, generation, batch, completions) {
                Ok(()) => {
                    begin_frame(tx);
                    wire::encode_completions(tx, completions);
                    seal_frame(tx);
                }
                Err(e) => frame_reply(tx, &Reply::Error(RemoteError::Verb(e))),
            },
            Err(e) => frame_reply(tx, &Reply::Error(e.into())),
        });
        match ran {
            Some(()) => Next::Continue,
            None => self.refuse_revoked(),
        }
    }

    /// Answers that the connection's session was revoked; the connection is then closed.
    fn refuse_revoked(&mut self) -> Next {
        let session = self.gate.session;
        let shared = &self.gate.shared;
        if shared.is_behind(session) {
            let floor = shared.session_floor.load(Ordering::SeqCst);
            tracing::info!(
                session,
                floor,
                "fabric tcp: a request of an earlier run's session refused; closing its connection"
            );
            self.send(&Reply::Error(RemoteError::SessionBehind { session, floor }));
            return Next::Close;
        }
        tracing::info!(
            session,
            "fabric tcp: a request of a revoked session refused; closing its connection"
        );
        self.send(&Reply::Error(RemoteError::Revoked { session }));
        Next::Close
    }

    /// Runs the procedure call in `self.rx` ([`crate::procedure`]). Not busy for the whole
    /// call: a procedure may wait (for a lock, say), and a revocation must not wait for it;
    /// each of its batches passes the gate instead, so nothing of a revoked session's runs.
    fn call(&mut self) -> Next {
        let rx = std::mem::take(&mut self.rx);
        let next = self.call_with(&rx);
        self.rx = rx;
        next
    }

    fn call_with(&mut self, body: &[u8]) -> Next {
        let wire::DecodedCall {
            procedure: id,
            args,
            posted,
        } = match wire::decode_call(body) {
            Ok(call) => call,
            Err(e) => {
                self.send(&Reply::Error(e.into()));
                return Next::Continue;
            }
        };
        if self.gate.run(|_| ()).is_none() {
            return self.refuse_revoked();
        }
        let outcome = self.run_call(id, args);
        match outcome {
            // Nobody waits for a posted call's result: nothing is sent.
            Ok(()) if posted => Next::Continue,
            Ok(()) => {
                begin_frame(&mut self.tx);
                wire::encode_returned(&mut self.tx, &self.result);
                seal_frame(&mut self.tx);
                Next::Continue
            }
            // A host endpoint's gate found the session revoked (its own gate: the session's
            // is not consulted by the procedure's batches).
            Err(RemoteError::Revoked { .. }) => {
                self.gate.revoked = true;
                self.refuse_revoked()
            }
            // A failed posted call: the client went on as if it had run, so nothing it sent
            // after it may run now (see `Request::PostedCall`).
            Err(e) if posted => {
                tracing::warn!(
                    session = self.gate.session,
                    procedure = id,
                    "fabric tcp: a posted call failed ({e}); closing the connection"
                );
                self.send(&Reply::Error(RemoteError::PostedCallFailed {
                    procedure: id,
                    why: e.to_string(),
                }));
                Next::Close
            }
            Err(e) => {
                self.send(&Reply::Error(e));
                Next::Continue
            }
        }
    }

    /// Runs procedure `id` with `args` (opening it for this connection at its first call),
    /// leaving its result in `self.result`.
    fn run_call(&mut self, id: ProcedureId, args: &[u8]) -> std::result::Result<(), RemoteError> {
        if !self.calls.contains_key(&id) {
            let Some(procedure) = self.gate.shared.procedures.get(id) else {
                return Err(RemoteError::UnknownProcedure { procedure: id });
            };
            let host = Arc::new(HostConnector {
                shared: self.gate.shared.clone(),
                state: self.gate.state.clone(),
                session: self.gate.session,
            });
            let session = procedure
                .open(host, self.gate.session)
                .map_err(|e| RemoteError::Procedure(e.to_string()))?;
            self.calls.insert(id, session);
        }
        self.result.clear();
        let outcome = match self.calls.get_mut(&id) {
            Some(session) => session.call(args, &mut self.result),
            None => unreachable!("opened above"),
        };
        match outcome {
            Ok(()) if self.result.len() <= MAX_CALL_BYTES => Ok(()),
            Ok(()) => Err(RemoteError::Procedure(format!(
                "procedure {id} returned {} bytes, over the limit of {MAX_CALL_BYTES}",
                self.result.len()
            ))),
            Err(FabricError::Refused(_)) if self.gate.shared.is_revoked(self.gate.session) => {
                Err(RemoteError::Revoked {
                    session: self.gate.session,
                })
            }
            Err(e) => Err(RemoteError::Procedure(e.to_string())),
        }
    }
}

/// [`TcpServer::accept_session_floors`]'s procedure, and the state of each connection's calls
/// of it (none beyond the server). Holds the server weakly: the procedure table is part of
/// what it points to.
#[derive(Clone)]
struct FloorProcedure {
    shared: std::sync::Weak<Shared>,
}

impl Procedure for FloorProcedure {
    fn open(&self, _host: Arc<dyn Connector>, session: u64) -> Result<Box<dyn ProcedureSession>> {
        if session != 0 {
            return Err(FabricError::Refused(format!(
                "session {session} may not set the session floor: only a sessionless peer (the \
                 meta server) may"
            )));
        }
        Ok(Box::new(self.clone()))
    }
}

impl ProcedureSession for FloorProcedure {
    fn call(&mut self, args: &[u8], _reply: &mut Vec<u8>) -> Result<()> {
        let floor = <[u8; 8]>::try_from(args)
            .map(u64::from_le_bytes)
            .map_err(|_| {
                FabricError::Protocol(format!(
                    "a session floor is 8 bytes, not {} bytes",
                    args.len()
                ))
            })?;
        let shared = self
            .shared
            .upgrade()
            .ok_or_else(|| FabricError::Disconnected("the server is stopping".into()))?;
        // Runs on the caller's connection thread, which is not executing a batch (its gate is
        // idle during a call), so the wait for the fenced sessions' batches cannot wait on it.
        shared.refuse_sessions_before(floor);
        Ok(())
    }
}

/// Encodes `reply` as one frame in `tx`.
fn frame_reply(tx: &mut Vec<u8>, reply: &Reply) {
    begin_frame(tx);
    wire::encode_message(tx, reply);
    seal_frame(tx);
}

/// Runs one connection's protocol over `r` and `w` until the peer closes or must be dropped.
/// `on_hello` runs when each frame of the handshake (the hello, the proof) has arrived, before
/// it is handled: if it says no (the connection was evicted meanwhile, `Admitted::claim`),
/// nothing is answered and the connection ends. `on_wait` runs after the server answered a
/// frame of the handshake and waits for the next (the proof, after the challenge:
/// `Admitted::unclaim`). `on_auth` runs once, after the handshake succeeded. Returns whether the
/// server chose to close (as opposed to the peer going away, a write failing or an eviction).
pub(crate) fn serve<R: Read, W: Write>(
    session: &mut Session,
    r: &mut R,
    w: &mut W,
    mut on_hello: impl FnMut() -> bool,
    mut on_wait: impl FnMut(),
    mut on_auth: impl FnMut(),
) -> bool {
    loop {
        let was_authenticated = session.authenticated;
        let read = frame::read_frame(r, session.frame_limit(), &mut session.rx);
        let peer_gone = matches!(read, Err(FrameError::Io(_)));
        if !was_authenticated && !peer_gone && !on_hello() {
            return false;
        }
        let next = session.handle(read);
        let reply = session.reply();
        // One write per reply: the header and body are contiguous in `tx`.
        if !reply.is_empty() && w.write_all(reply).is_err() {
            return false;
        }
        if next == Next::Close {
            return !peer_gone;
        }
        if !was_authenticated && session.authenticated {
            on_auth();
        } else if !session.authenticated {
            on_wait();
        }
    }
}

/// One accepted connection, from its thread's point of view.
fn run_connection(shared: Arc<Shared>, stream: TcpStream, peer: SocketAddr, admitted: Admitted) {
    // Small frames must leave at once: Nagle would hold a reply back for the peer's delayed ACK.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, "set_nodelay: {e}");
    }
    // A peer that vanishes (cut link, dead host) must not hold a thread for ever.
    super::watch_peer(&stream);
    // An unauthenticated peer may not hold a thread for long: the whole handshake is bounded.
    let handshake_by = Instant::now() + HANDSHAKE_TIMEOUT;
    if let Err(e) = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)) {
        tracing::debug!(%peer, "set_read_timeout: {e}");
    }
    let mut session = Session::new(shared);
    let mut reader = BufReader::with_capacity(64 << 10, &stream);
    let mut writer = &stream;
    // Both hooks change the admission; they never run at once.
    let admitted = std::cell::RefCell::new(admitted);
    let server_closed = serve(
        &mut session,
        &mut reader,
        &mut writer,
        || {
            // The proof must arrive within what is left of the bound.
            let left = handshake_by.saturating_duration_since(Instant::now());
            if let Err(e) = stream.set_read_timeout(Some(left.max(Duration::from_millis(1)))) {
                tracing::debug!(%peer, "set_read_timeout: {e}");
            }
            admitted.borrow_mut().claim()
        },
        // Until its proof arrives, a peer is as evictable as one that sent nothing yet.
        || admitted.borrow_mut().unclaim(),
        || {
            admitted.borrow_mut().authenticated();
            // A batch may legitimately wait for a long time between batches.
            if let Err(e) = stream.set_read_timeout(None) {
                tracing::debug!(%peer, "clear read timeout: {e}");
            }
        },
    );
    if admitted.borrow().is_evicted() {
        tracing::debug!(%peer, "fabric connection evicted before its hello");
        return;
    }
    if server_closed {
        linger(&stream, &mut reader);
    }
    tracing::debug!(%peer, "fabric connection closed");
}

/// Closes a connection the server gave up on so that the peer receives the final reply.
///
/// Closing a socket with unread input makes the kernel send a reset, which can destroy the reply
/// still in flight. So: send FIN after the reply, then read and discard for a short while (until
/// the peer closes, the time is up, or a frame's worth has been discarded).
fn linger(stream: &TcpStream, reader: &mut impl Read) {
    let _ = stream.shutdown(Shutdown::Write);
    let deadline = Instant::now() + LINGER;
    let mut discarded = 0usize;
    let mut sink = [0u8; 16 << 10];
    while discarded < MAX_REQUEST_FRAME {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match reader.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => discarded += n,
        }
    }
}

/// Live connections: a handle to shut each socket down and its thread to join.
#[derive(Default)]
struct Connections {
    next_id: u64,
    live: HashMap<u64, (TcpStream, JoinHandle<()>)>,
}

/// A `tcp` fabric server: registered regions, served to authenticated clients over TCP.
///
/// ```no_run
/// use fabric::{tcp::{TcpServer, TcpConnector}, Credentials, RegionId, Connector, EndpointExt, RemoteAddr};
/// let server = TcpServer::bind("127.0.0.1:0", Credentials::new("cluster-a", "secret"))?;
/// server.register(RegionId(1), 4096)?;
/// let connector = TcpConnector::connect(server.local_addr(), Credentials::new("cluster-a", "secret"))?;
/// let mut endpoint = connector.endpoint()?;
/// endpoint.faa(RemoteAddr::new(RegionId(1), 0), 1)?;
/// # Ok::<(), fabric::FabricError>(())
/// ```
///
/// Dropping the server (or [`TcpServer::shutdown`]) stops accepting, closes every connection and
/// joins every thread it started.
pub struct TcpServer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    listener: TcpListener,
    stopping: Arc<AtomicBool>,
    accept: Mutex<Option<JoinHandle<()>>>,
    connections: Arc<Mutex<Connections>>,
    admission: Arc<Admission>,
}

impl std::fmt::Debug for TcpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpServer")
            .field("local_addr", &self.local_addr)
            .field("credentials", &self.shared.credentials)
            .finish()
    }
}

impl TcpServer {
    /// Binds `addr` (use port 0 for any free port, then [`TcpServer::local_addr`]) and starts
    /// accepting connections that present `credentials`. The server starts with no regions.
    pub fn bind(addr: impl ToSocketAddrs, credentials: Credentials) -> Result<Self> {
        Self::bind_with_limits(addr, credentials, ConnectionLimits::default())
    }

    /// [`TcpServer::bind`] with the given limits on connections instead of the defaults: a
    /// connection beyond them is refused ([`Refusal::Limit`](crate::handshake::Refusal::Limit))
    /// before any of its bytes are read.
    pub fn bind_with_limits(
        addr: impl ToSocketAddrs,
        credentials: Credentials,
        limits: ConnectionLimits,
    ) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| FabricError::io("bind", e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| FabricError::io("local_addr", e))?;
        let accept_listener = listener
            .try_clone()
            .map_err(|e| FabricError::io("clone listener", e))?;
        let shared = Arc::new(Shared::new(credentials));
        let stopping = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(Mutex::new(Connections::default()));
        let admission = Admission::new(limits);
        let accept = {
            let (shared, stopping, connections, admission) = (
                shared.clone(),
                stopping.clone(),
                connections.clone(),
                admission.clone(),
            );
            thread::Builder::new()
                .name(format!("fabric-tcp-accept-{}", local_addr.port()))
                .spawn(move || {
                    accept_loop(accept_listener, shared, stopping, connections, admission)
                })
                .map_err(|e| FabricError::io("spawn accept thread", e))?
        };
        tracing::debug!(%local_addr, "fabric tcp server listening");
        Ok(Self {
            shared,
            local_addr,
            listener,
            stopping,
            accept: Mutex::new(Some(accept)),
            connections,
            admission,
        })
    }

    /// A connector whose endpoints execute on this server's memory in this process, as a
    /// procedure's host endpoints do ([`crate::procedure`]): the same executor and region
    /// checks, no socket, no session. For measuring what a procedure's own verbs cost (a
    /// hosted CITRON acquisition's round trips, for its `T_wait`).
    pub fn host_connector(&self) -> Arc<dyn Connector> {
        Arc::new(HostConnector {
            shared: self.shared.clone(),
            state: self.shared.register(),
            session: 0,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The cluster this server belongs to.
    pub fn cluster(&self) -> &str {
        &self.shared.credentials.cluster
    }

    /// Registers a zeroed anonymous region of `len` bytes (rounded up to whole words) under `id`.
    pub fn register(&self, id: RegionId, len: u64) -> Result<Arc<Region>> {
        let region = Arc::new(Region::anonymous(id, len));
        self.shared.add(region.clone())?;
        Ok(region)
    }

    /// Serves an existing region (e.g. a file-backed shared mapping) under its own id.
    pub fn add_region(&self, region: Arc<Region>) -> Result<()> {
        self.shared.add(region)
    }

    /// Offers `procedure` to this server's clients under number `id` ([`crate::procedure`]);
    /// a number already taken is refused.
    pub fn register_procedure(&self, id: ProcedureId, procedure: Arc<dyn Procedure>) -> Result<()> {
        self.shared.add_procedure(id, procedure)
    }

    /// Stops serving a region; connections stop reaching it before their next batch.
    pub fn deregister(&self, id: RegionId) -> Option<Arc<Region>> {
        self.shared.remove(id)
    }

    /// The region registered under `id`, if any.
    pub fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        self.shared.resolve(id)
    }

    /// The registered regions, as announced to connecting clients.
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.shared.list()
    }

    /// Fences client sessions `sessions`: their open connections execute nothing more (the
    /// next request is answered [`RemoteError::Revoked`](super::wire::RemoteError::Revoked) and
    /// the connection closed) and new connections naming them are refused. A revoked session
    /// stays revoked for the life of the server; session ids are never reused by a meta server.
    ///
    /// This is the tcp fabric's version of what CITRON §3.10 has the cluster manager do on
    /// RDMA (destroy the failed client's queue pairs). A batch already executing finishes, and
    /// this returns only after it did: from then on nothing of theirs executes.
    pub fn revoke(&self, sessions: &[u64]) {
        self.shared.revoke(sessions);
    }

    /// Fences every client session numbered below `floor` (0, no session, excepted): the
    /// sessions of an earlier run of a server that numbers them upwards from its start (the
    /// meta server). Their open connections execute nothing more, as a revoked session's (the
    /// next request is answered [`RemoteError::SessionBehind`](super::wire::RemoteError) and
    /// the connection closed); a new connection is refused with
    /// [`Refusal::SessionBehind`](crate::handshake::Refusal). Either is the client's
    /// [`FabricError::SessionBehind`], which tells a client behind a restart from a fenced
    /// one. Returns once no batch of theirs can execute any more.
    pub fn refuse_sessions_before(&self, floor: u64) {
        self.shared.refuse_sessions_before(floor);
    }

    /// Lets a sessionless peer (the meta server, which connects with session 0) raise this
    /// server's session floor with the [`SESSION_FLOOR`](crate::procedure::SESSION_FLOOR)
    /// procedure, as [`TcpServer::refuse_sessions_before`] does here: a data server offers it
    /// so that a restarted meta server fences every client session of its earlier run before
    /// it zeroes or hands out any of the server's chunks (see
    /// [`crate::procedure::raise_session_floor`]). Client sessions (non-zero) may not call it.
    pub fn accept_session_floors(&self) -> Result<()> {
        self.shared.add_procedure(
            crate::procedure::SESSION_FLOOR,
            Arc::new(FloorProcedure {
                shared: Arc::downgrade(&self.shared),
            }),
        )
    }

    /// The number of open connections (authenticated or not).
    pub fn connection_count(&self) -> usize {
        lock(&self.connections).live.len()
    }

    /// The limits on connections this server enforces.
    pub fn limits(&self) -> ConnectionLimits {
        self.admission.limits()
    }

    /// Stops accepting, closes every connection and joins every server thread. Idempotent;
    /// clients see [`FabricError::Disconnected`] on their next batch (or the one in flight).
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the accept loop: on Linux, shutting a listening socket down makes a blocked
        // `accept` return EINVAL, and every later one fail at once.
        // SAFETY: the descriptor belongs to `self.listener`, which is open for the duration of
        // the call; shutdown(2) does not touch memory.
        unsafe {
            libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR);
        }
        if let Some(accept) = lock(&self.accept).take() {
            let _ = accept.join();
        }
        // The accept thread is gone, so no connection is added after this.
        let live = std::mem::take(&mut lock(&self.connections).live);
        for (stream, _) in live.values() {
            // Wakes the connection's blocked read (or write) with EOF or an error.
            let _ = stream.shutdown(Shutdown::Both);
        }
        for (_, (_, thread)) in live {
            let _ = thread.join();
        }
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    stopping: Arc<AtomicBool>,
    connections: Arc<Mutex<Connections>>,
    admission: Arc<Admission>,
) {
    let refuser = match handshake::Refuser::start("fabric-tcp-refuse") {
        Ok(refuser) => Some(refuser),
        Err(e) => {
            tracing::warn!("fabric tcp: cannot start the refusing thread: {e}");
            None
        }
    };
    loop {
        let accepted = listener.accept();
        if stopping.load(Ordering::SeqCst) {
            // A connection accepted during shutdown is dropped, i.e. closed.
            return;
        }
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, a peer that reset before accept, ...: transient. Pause so
                // that a persistent error does not spin a core.
                tracing::warn!("fabric tcp accept: {e}");
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        // What evicts the connection while it has not sent its hello, to make room for a
        // newer one (`Admission::admit_evicting`): answers it with the refusal and shuts it
        // down, which wakes its thread's read. Without a handle to do so it is not evictable.
        let evict: Option<handshake::Evict> = match stream.try_clone() {
            Ok(handle) => Some(Box::new(move |refusal: handshake::Refusal| {
                tracing::debug!(%peer, %refusal, "fabric tcp: evicted a connection pending its hello");
                handshake::refuse_at_accept(&handle, &refusal);
                let _ = handle.shutdown(Shutdown::Both);
            })),
            Err(e) => {
                tracing::warn!(%peer, "fabric tcp: cannot clone accepted socket: {e}");
                None
            }
        };
        // Counted before a thread is spent on it: a flood of connections costs an accept and a
        // refusal (or an eviction) each, not a thread and a buffer. Connections that never
        // send their hello make room for newer ones, so a flood of them cannot keep out a peer
        // that presents its credentials at once.
        let admitted = match evict {
            Some(evict) => admission.admit_evicting(peer.ip(), evict),
            None => admission.admit(peer.ip()),
        };
        let admitted = match admitted {
            Ok(admitted) => admitted,
            Err(refusal) => {
                tracing::warn!(%peer, %refusal, "fabric tcp: refused a connection");
                match &refuser {
                    Some(refuser) => refuser.refuse(stream, refusal),
                    None => handshake::refuse_at_accept(&stream, &refusal),
                }
                continue;
            }
        };
        let handle = match stream.try_clone() {
            Ok(handle) => handle,
            Err(e) => {
                tracing::warn!(%peer, "fabric tcp: cannot clone accepted socket: {e}");
                continue;
            }
        };
        // Holding the registry lock across spawn and insert: the thread removes its own entry
        // when it ends, and must not be able to do so before the entry exists.
        let mut registry = lock(&connections);
        let id = registry.next_id;
        registry.next_id += 1;
        let (shared, connections) = (shared.clone(), connections.clone());
        let spawned = thread::Builder::new()
            .name(format!("fabric-tcp-conn-{id}"))
            .spawn(move || {
                run_connection(shared, stream, peer, admitted);
                // Dropping our own JoinHandle detaches the (ending) thread; shutdown may already
                // have taken it, in which case it joins us.
                lock(&connections).live.remove(&id);
            });
        match spawned {
            Ok(thread) => {
                registry.live.insert(id, (handle, thread));
            }
            Err(e) => tracing::warn!(%peer, "fabric tcp: cannot spawn connection thread: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn a_revocation_waits_for_a_batch_that_passed_its_check_before_it() {
        let shared = Arc::new(Shared::new(Credentials::default()));
        let busy = shared.register();
        let idle = shared.register();
        // A connection that checked against count 0 and is executing (its thread preempted).
        busy.store(BUSY, Ordering::SeqCst);
        let (done_tx, done) = mpsc::channel();
        let revoker = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                shared.revoke(&[7]);
                done_tx.send(()).unwrap();
            })
        };
        assert!(
            done.recv_timeout(Duration::from_millis(200)).is_err(),
            "the revocation returned while a batch checked before it was executing"
        );
        assert!(shared.is_revoked(7));
        busy.store(IDLE, Ordering::SeqCst);
        done.recv_timeout(Duration::from_secs(5))
            .expect("the revocation returns once the batch is done");
        revoker.join().unwrap();
        drop(idle);
        // A connection busy with the count the next revocation makes (it checked after that
        // revocation's bump, so it saw it) is not waited for.
        let next = shared.revocations.load(Ordering::SeqCst) + 1;
        busy.store(BUSY | next, Ordering::SeqCst);
        let start = std::time::Instant::now();
        shared.revoke(&[8]);
        assert!(start.elapsed() < Duration::from_secs(1));
    }
}
