//! The connection to the meta server: calls, reconnection, and the heartbeat that keeps the
//! session alive.
//!
//! Reconnection: a call that finds the connection broken connects again — a new session,
//! since the meta server ties sessions to connections and forgets them when it restarts —
//! retrying while the meta server is away (a restart) until [`RECONNECT_WAIT`] after the
//! outage's first failed attempt, then fails: one bound per outage, however many waits a call
//! makes.
//! Each new session bumps [`Meta::generation`] and keeps what the meta server said
//! ([`Meta::latest`]); the client's view (`view`) notices and reopens what it had open. The
//! heartbeat also brings the layout epoch ([`Meta::layout_epoch`]), so a change of the data
//! servers reaches the view within a heartbeat period.
//!
//! One connection serves the whole client, shared by its threads: a call is sent at once and
//! waits for its own answer ([`rpc::SharedClient`]), and the meta server runs a connection's
//! requests concurrently, so threads never queue behind each other's round trips (a mutex
//! around the connection made every create of a client wait for the one before). Only
//! namespace operations, opens and chunk allocations use it; reads and writes of allocated
//! chunks never do. It is one connection (one session) rather than a pool because the meta
//! server ties open files to the session that opened them: a pool of sessions would have to
//! send each `Release` down the connection that sent the matching `Open`.

use crate::error::Error;
use proto::rpc::{self, Request, Response, Role, Welcome};
use proto::{ClusterInfo, FsError, Ino};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long one call may wait for its answer before the connection is declared dead: the
/// meta server's default session lease (10 s), since a session unanswered for that long is
/// gone on the server anyway. The slowest legitimate call, a `Fence`, waits at most 3 s for
/// the data servers; a cut link must not block a caller (and the heartbeat) for minutes.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a call keeps trying to reach a meta server that is away (restarting) before it
/// fails: long enough for a restart, short enough that nothing hangs.
pub(crate) const RECONNECT_WAIT: Duration = Duration::from_secs(10);

/// The meta server connection (reconnected on demand after a failure).
pub(crate) struct Meta {
    addr: String,
    cluster: String,
    token: String,
    host: String,
    /// The current connection (None: broken, the next call reconnects). Held only to clone
    /// or replace it, never across a call.
    conn: Mutex<Option<Arc<rpc::SharedClient>>>,
    /// Bumped by every new session (the first is 1).
    generation: AtomicU64,
    /// What the meta server said when the latest session opened.
    latest: Mutex<ClusterInfo>,
    /// The newest layout epoch a heartbeat brought.
    layout_epoch: AtomicU64,
    /// Whether the connection is up, as the last call found it: read on every I/O without
    /// taking `conn`'s mutex.
    up: AtomicBool,
    /// What rides on every call (releases of closed files, `handles`); set once, after the
    /// connection (the handle table is made after it).
    riders: OnceLock<Arc<dyn Riders>>,
    /// The oldest generation in which this client changed something (a namespace change, a
    /// chunk allocation, a file's size) that no fsync has made durable yet; 0: none. See
    /// [`Meta::take_unsynced`].
    unsynced: AtomicU64,
    /// The client is going away ([`Meta::close`]): a lost connection is tried once more, not
    /// waited for.
    closing: AtomicBool,
    /// Run by the heartbeat thread once it finds a new session ([`Meta::on_new_session`]).
    on_new_session: OnceLock<Arc<dyn NewSession>>,
    /// When a connection attempt of this client first failed in the current outage of the
    /// meta server (`None`: none failed since the last success): every wait for it, in every
    /// call and every thread, ends [`RECONNECT_WAIT`] after this ([`Meta::reconnect`]).
    away_since: Mutex<Option<Instant>>,
}

impl Meta {
    /// Connects and opens the session.
    pub(crate) fn connect(
        addr: &str,
        cluster: &str,
        token: &str,
        host: &str,
    ) -> Result<(Meta, ClusterInfo), Error> {
        let (client, info) = Meta::open(addr, None, cluster, token, host)?;
        let meta = Meta {
            addr: addr.into(),
            cluster: cluster.into(),
            token: token.into(),
            host: host.into(),
            conn: Mutex::new(Some(Arc::new(client))),
            generation: AtomicU64::new(1),
            latest: Mutex::new(info.clone()),
            layout_epoch: AtomicU64::new(info.layout_epoch),
            up: AtomicBool::new(true),
            closing: AtomicBool::new(false),
            unsynced: AtomicU64::new(0),
            riders: OnceLock::new(),
            on_new_session: OnceLock::new(),
            away_since: Mutex::new(None),
        };
        Ok((meta, info))
    }

    /// Which session this is: bumped by every reconnection.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// What the meta server said when the latest session opened, with its generation.
    pub(crate) fn latest(&self) -> (u64, ClusterInfo) {
        let latest = self.latest.lock().unwrap_or_else(PoisonError::into_inner);
        (self.generation(), latest.clone())
    }

    /// The latest session's id: what [`Meta::latest`] says, without copying the cluster's
    /// description (closes and creates ask for it on every call).
    pub(crate) fn session(&self) -> u64 {
        self.latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .session
    }

    /// Sets what rides on every call from now on (once; later calls are ignored).
    pub(crate) fn set_riders(&self, riders: Arc<dyn Riders>) {
        let _ = self.riders.set(riders);
    }

    /// Sets what the heartbeat thread runs when it finds a new session (`records`: taking
    /// back the record locks of the session that ended); set once.
    pub(crate) fn on_new_session(&self, hook: Arc<dyn NewSession>) {
        let _ = self.on_new_session.set(hook);
    }

    /// The newest layout epoch heard of (at connect, or in a heartbeat).
    pub(crate) fn layout_epoch(&self) -> u64 {
        self.layout_epoch.load(Ordering::SeqCst)
    }

    /// Notes a layout epoch heard of.
    pub(crate) fn note_layout_epoch(&self, epoch: u64) {
        self.layout_epoch.fetch_max(epoch, Ordering::SeqCst);
    }

    /// Notes a change made in session generation `generation` that only an fsync makes
    /// durable: the meta server's database reaches the disk in the background, so a crash may
    /// lose what it acknowledged but no fsync covered.
    pub(crate) fn note_unsynced(&self, generation: u64) {
        let _ = self
            .unsynced
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |old| {
                (old == 0 || generation < old).then_some(generation)
            });
    }

    /// Takes the oldest generation with changes no fsync covered yet (0: none), before an
    /// fsync; an fsync answered in a later generation cannot vouch for them (the session that
    /// made them ended: the meta server restarted, and may have lost them).
    pub(crate) fn take_unsynced(&self) -> u64 {
        self.unsynced.swap(0, Ordering::SeqCst)
    }

    /// Whether the connection is up, as far as the last call knows.
    pub(crate) fn is_up(&self) -> bool {
        self.up.load(Ordering::SeqCst)
    }

    /// Opens a session: over the meta server's local socket `local` when it is given and
    /// works, else over tcp at `addr` — and then over the local socket the welcome offers
    /// (`ClusterInfo::local_rpc`), when it is of the same server (the same meta region) and
    /// can be opened: the tcp session is closed, unused. A client on another host, or one
    /// that may not open the socket, stays on tcp.
    fn open(
        addr: &str,
        local: Option<&Path>,
        cluster: &str,
        token: &str,
        host: &str,
    ) -> Result<(rpc::SharedClient, ClusterInfo), Error> {
        let role = Role::Client {
            host: host.to_owned(),
            pid: std::process::id(),
        };
        let credentials = fabric::Credentials::new(cluster.to_owned(), token.to_owned());
        let rpc_error = |at: String| move |source| Error::Rpc { addr: at, source };
        let local_session = |path: &Path| {
            rpc::SharedClient::connect_local(path, &credentials, role.clone(), Some(CALL_TIMEOUT))
                .map_err(rpc_error(path.display().to_string()))
                .and_then(|client| welcomed(client, addr))
        };
        if let Some(path) = local {
            match local_session(path) {
                Ok(opened) => return Ok(opened),
                Err(error) => {
                    tracing::debug!(%error, "the meta server's local socket failed; using tcp")
                }
            }
        }
        let client =
            rpc::SharedClient::connect(addr, &credentials, role.clone(), Some(CALL_TIMEOUT))
                .map_err(rpc_error(addr.to_owned()))?;
        let (client, info) = welcomed(client, addr)?;
        let offered = match (&info.local_rpc, local) {
            (Some(path), None) => Path::new(path),
            _ => return Ok((client, info)),
        };
        match local_session(offered) {
            Ok((moved, moved_info)) if moved_info.meta_fabric == info.meta_fabric => {
                tracing::debug!(path = %offered.display(), "using the meta server's local socket");
                Ok((moved, moved_info))
            }
            Ok(_) => {
                tracing::debug!(path = %offered.display(), "the local socket is another server's; using tcp");
                Ok((client, info))
            }
            Err(error) => {
                tracing::debug!(%error, "cannot use the meta server's local socket; using tcp");
                Ok((client, info))
            }
        }
    }

    /// Opens a new session (the connection `conn` is `None`), retrying while the meta server
    /// is away, until [`RECONNECT_WAIT`] after the outage's first failed attempt
    /// ([`Meta::away_since`]) — one bound for the whole outage, not one per wait: a call that
    /// waits in several places (a view's refresh, then the RPC it falls back to, then the data
    /// path's recovery) fails within it, and a call made later in the same outage tries once
    /// and fails at once. A refusal (wrong token, another cluster) is final. Holds the
    /// connection's mutex only for each attempt, not across the waits.
    fn reconnect<'a>(
        &'a self,
        mut conn: std::sync::MutexGuard<'a, Option<Arc<rpc::SharedClient>>>,
    ) -> Result<std::sync::MutexGuard<'a, Option<Arc<rpc::SharedClient>>>, Error> {
        let mut pause = Duration::from_millis(20);
        loop {
            if conn.is_some() {
                // Another thread reconnected while this one waited.
                return Ok(conn);
            }
            // The socket the last session's server offered is tried first (a restart keeps
            // it where it was); one this client could not open fails at once.
            let local = self
                .latest
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .local_rpc
                .clone()
                .map(PathBuf::from);
            match Meta::open(
                &self.addr,
                local.as_deref(),
                &self.cluster,
                &self.token,
                &self.host,
            ) {
                Ok((client, info)) => {
                    *self
                        .away_since
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = None;
                    tracing::warn!(
                        session = info.session,
                        "reconnected to the meta server: a new session; open files are \
                         reopened on their next use"
                    );
                    self.note_layout_epoch(info.layout_epoch);
                    *self.latest.lock().unwrap_or_else(PoisonError::into_inner) = info;
                    self.generation.fetch_add(1, Ordering::SeqCst);
                    *conn = Some(Arc::new(client));
                    self.up.store(true, Ordering::SeqCst);
                    return Ok(conn);
                }
                Err(e)
                    if is_refusal(&e)
                        || self.closing.load(Ordering::SeqCst)
                        || Instant::now() + pause > self.outage_deadline() =>
                {
                    return Err(e)
                }
                Err(e) => tracing::debug!(error = %e, "meta server away; retrying"),
            }
            drop(conn);
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(500));
            conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// When waiting for the meta server ends in the outage that a connection attempt has just
    /// found ([`Meta::away_since`], set by the first failure).
    fn outage_deadline(&self) -> Instant {
        let mut since = self
            .away_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *since.get_or_insert_with(Instant::now) + RECONNECT_WAIT
    }

    fn rpc_error(&self, source: rpc::RpcError) -> Error {
        Error::Rpc {
            addr: self.addr.clone(),
            source,
        }
    }

    /// The meta server ended this client's session while its connection stayed up (its
    /// heartbeat answered `Stale`), or a fence revoked it on the fabric servers (the data path
    /// found its verbs refused: `Error::is_fenced`): the connection is dropped — which ends the
    /// session at the meta server, if it had not — so that the next call —
    /// the heartbeat's, at the latest — opens a new session, and the client carries on in it
    /// as after a meta server restart (files reopened on their next use, record locks taken
    /// back or lost, a new view with connectors of the new session). What was in flight in
    /// the old session failed: the fabric servers refuse its verbs (tcp), and its calls were
    /// answered `Stale`.
    ///
    /// Only while the connection is still that of `generation` ([`Meta::generation`], read
    /// before the call that found the session ended): another thread may have joined again
    /// meanwhile, and that session stays. (Each new session bumps the generation under the
    /// connection's mutex, which this holds.)
    pub(crate) fn session_ended(&self, generation: u64) {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        if self.generation() != generation {
            return;
        }
        if conn.take().is_some() {
            self.up.store(false, Ordering::SeqCst);
            tracing::warn!(
                session = self.session(),
                "this client's session was ended (stopped or cut off past its lease, or \
                 fenced): joining again in a new one"
            );
        }
    }

    /// The client is going away: from now on a lost connection is tried once more, not waited
    /// for ([`RECONNECT_WAIT`]), so that a client whose meta server died (the process of an
    /// embedded cluster, killed) stops within moments, heartbeat included.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }

    /// Whether the client is going away ([`Meta::close`]): servers that are away are then not
    /// waited for, by the meta calls nor by the data path's recovery.
    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// Makes one call: the meta server's answer, or `Error::Fs` with the error it answered.
    /// A broken connection is dropped and the call fails with `Error::Rpc`; the next call
    /// reconnects (as a new session: files opened before must be reopened). The releases
    /// queued by closes ride ahead of it ([`Riders`]).
    pub(crate) fn call(&self, request: Request) -> Result<Response, Error> {
        self.call_by(request, None)
    }

    /// [`Meta::call`] of a change made under a range lock whose lease ends at `expires`: the
    /// meta server applies it only before then (`proto::rpc::RequestFrame::expires`), and
    /// answers `FsError::Expired` otherwise.
    ///
    /// A call that fails because the server went away under the connection (it stopped, or
    /// closed or reset the connection: `RpcError::server_went_away`; not a timeout or an
    /// unreachable host, where a second try would only wait again) is made once more, on a
    /// new connection (a new session), when that cannot do it twice: the server never executed it (it was
    /// not sent, or the server said it was stopping before answering:
    /// `proto::rpc::RpcError::maybe_executed`), or a second try does no harm
    /// (`Request::may_repeat`: reads, and the session state the break ended). So a meta server restart under a live mount
    /// fails no call that reached it during the stop, nor one sent into the closing
    /// connection. Never a call under a range lock (`expires`): the lock belongs to the
    /// session that ended, and its caller redoes the whole change under a new one.
    pub(crate) fn call_by(
        &self,
        request: Request,
        expires: Option<Instant>,
    ) -> Result<Response, Error> {
        let again =
            (expires.is_none() && !self.closing.load(Ordering::SeqCst)).then(|| request.clone());
        match (self.call_on(self.connection()?, request, expires), again) {
            (Err(Error::Rpc { source, .. }), Some(request))
                if source.server_went_away()
                    && (!source.maybe_executed() || request.may_repeat()) =>
            {
                tracing::info!(
                    error = %source,
                    "the meta connection broke under a call; making it again on a new one"
                );
                self.call_on(self.connection()?, request, None)
            }
            (answer, _) => answer,
        }
    }
    /// A call answered with attributes.
    pub(crate) fn attr_call(
        &self,
        what: &'static str,
        request: Request,
    ) -> Result<proto::Attr, Error> {
        match self.call(request)? {
            Response::Attr(attr) => Ok(attr),
            other => Err(unexpected(what, other)),
        }
    }

    /// A call answered with `Ok`.
    pub(crate) fn ok_call(&self, what: &'static str, request: Request) -> Result<(), Error> {
        match self.call(request)? {
            Response::Ok => Ok(()),
            other => Err(unexpected(what, other)),
        }
    }

    /// A call answered with bytes.
    pub(crate) fn data_call(&self, what: &'static str, request: Request) -> Result<Vec<u8>, Error> {
        match self.call(request)? {
            Response::Data(data) => Ok(data),
            other => Err(unexpected(what, other)),
        }
    }

    /// Whether the current connection runs over the meta server's local socket (false when
    /// it is over tcp, or broken).
    pub(crate) fn is_local(&self) -> bool {
        self.conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|c| c.is_local())
    }

    /// The current connection, or a new one (a new session) if it broke.
    fn connection(&self) -> Result<Arc<rpc::SharedClient>, Error> {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        if conn.is_none() {
            conn = self.reconnect(conn)?;
        }
        Ok(conn.clone().expect("connected above"))
    }

    /// [`Meta::call`] in the current session only: `None`, and nothing sent, when the
    /// connection is broken (the session ended with it, and whatever the call would have
    /// ended there, such as an open, ended with it).
    pub(crate) fn call_connected(&self, request: Request) -> Option<Result<Response, Error>> {
        let client = self
            .conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()?;
        Some(self.call_on(client, request, None))
    }

    /// Makes `request` on `client` (see [`Meta::call`]).
    fn call_on(
        &self,
        client: Arc<rpc::SharedClient>,
        request: Request,
        expires: Option<Instant>,
    ) -> Result<Response, Error> {
        let riders = self.riders.get();
        // Releases ride only in the session that holds their opens (a reconnection ended the
        // others, and a release in the new session could end a reopen there).
        let session = match client.welcome() {
            Welcome::Client(info) => info.session,
            _ => 0,
        };
        let release_first = riders.map(|r| r.take(session)).unwrap_or_default();
        let changes = request.changes_namespace() || !release_first.is_empty();
        #[cfg(feature = "failpoints")]
        let call = format!("{request:?}");
        let released = (!release_first.is_empty()).then(|| release_first.clone());
        // Tests: a call held up between its caller's lease check and its sending (a thread
        // descheduled there, or a slow connection). Named by kind: `...::sending::FreeChunks`.
        #[cfg(feature = "failpoints")]
        {
            let kind = call.split([' ', '(', '{']).next().unwrap_or_default();
            failpoint!(&format!("fs_client::meta::sending::{kind}"));
        }
        let answer = client.call_by(release_first, request, expires);
        if let (Some(riders), Some(released)) = (riders, released) {
            // Answered or failed, the server holds these opens no longer: it released them
            // before the request, or the session ended with the connection.
            riders.done(&released);
        }
        // Crash tests: the meta server has answered (and done what was asked); the client
        // dies before it learns. Named by the request's kind: `...::answered::Mknod`.
        #[cfg(feature = "failpoints")]
        if answer.is_ok() {
            let kind = call.split([' ', '(', '{']).next().unwrap_or_default();
            failpoint!(&format!("fs_client::meta::answered::{kind}"));
        }
        match answer {
            Ok(answer) => {
                if changes {
                    self.note_unsynced(self.generation());
                }
                Ok(answer?)
            }
            Err(e) => {
                // The stream may be mid-frame: never reuse it. Another thread may have
                // replaced it already; a newer connection stays.
                let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
                if conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, &client)) {
                    *conn = None;
                    self.up.store(false, Ordering::SeqCst);
                }
                Err(self.rpc_error(e))
            }
        }
    }
}

/// What a client does when its heartbeat finds it in a new meta session (`records`: taking
/// back the record locks of the session that ended). Run on a thread of its own.
pub(crate) trait NewSession: Send + Sync {
    /// The session changed; `meta` is the connection, now of the new session.
    fn new_session(&self, meta: &Meta);
}

/// What rides on the next call to the meta server: the releases of files this client closed
/// (`handles`, "lingering opens"), so that a close costs no round trip of its own — the next
/// call of any thread carries them (`RequestFrame::release_first`), the heartbeat at the
/// latest.
pub(crate) trait Riders: Send + Sync {
    /// Hands over the releases for one call in meta session `session` (those of other
    /// sessions are dropped: their opens ended with their session). Never blocks: the
    /// calling thread may hold what the riders are kept under.
    fn take(&self, session: u64) -> Vec<Ino>;
    /// The call that carried `inos` returned, answered or failed: either way the meta server
    /// holds those opens no longer (it ran the releases first, or the session ended with the
    /// connection).
    fn done(&self, inos: &[Ino]);
}

/// The heartbeat thread: renews the session every `period` until stopped.
pub(crate) struct Heartbeat {
    stop: mpsc::Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    /// Starts heartbeats on `meta` every `period` (at least every 5 ms).
    pub(crate) fn start(meta: Arc<Meta>, period: Duration) -> Result<Heartbeat, Error> {
        let period = period.max(Duration::from_millis(5));
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("citronfs-heartbeat".into())
            .spawn(move || {
                let mut session = meta.generation();
                loop {
                    match stopped.recv_timeout(period) {
                        Err(RecvTimeoutError::Timeout) => {
                            let asked_in = meta.generation();
                            match meta.call(Request::Heartbeat) {
                                Ok(Response::Heartbeat { layout_epoch }) => {
                                    meta.note_layout_epoch(layout_epoch)
                                }
                                Ok(_) => {}
                                // The meta server ended the session (its lease ran out while
                                // this client was stopped or cut off): join again, in a new
                                // session, as after a meta server restart.
                                Err(Error::Fs(FsError::Stale)) => meta.session_ended(asked_in),
                                Err(error) => tracing::warn!(%error, "session heartbeat failed"),
                            }
                        }
                        // Stopped, or the owner is gone.
                        _ => return,
                    }
                    // A new session (this heartbeat's, or any call's reconnection): what the
                    // ended one held goes back to the meta server, within its grace. On a
                    // thread of its own: it waits for the record-lock calls in flight (up to a
                    // wait's slice), and heartbeats must go on meanwhile, or a fence would
                    // take this live client for a stopped one.
                    let now = meta.generation();
                    if now != session {
                        session = now;
                        if let Some(hook) = meta.on_new_session.get().cloned() {
                            let meta = meta.clone();
                            let spawned = std::thread::Builder::new()
                                .name("citronfs-reclaim".into())
                                .spawn(move || hook.new_session(&meta));
                            if let Err(error) = spawned {
                                tracing::error!(%error, "cannot start taking record locks back");
                            }
                        }
                    }
                }
            })
            .map_err(Error::Heartbeat)?;
        Ok(Heartbeat {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        let _ = self.stop.send(());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The session `client`'s handshake opened, with what the server said; `addr` names the server
/// in errors.
fn welcomed(
    client: rpc::SharedClient,
    addr: &str,
) -> Result<(rpc::SharedClient, ClusterInfo), Error> {
    match client.welcome() {
        Welcome::Client(info) => {
            let info = info.clone();
            Ok((client, info))
        }
        other => Err(Error::Protocol(format!(
            "meta server {addr} answered the client handshake with {other:?}"
        ))),
    }
}

/// Whether `e` is the meta server refusing this client (which retrying cannot change).
fn is_refusal(e: &Error) -> bool {
    matches!(e, Error::Rpc { source, .. } if source.is_refusal())
}

/// A response of the wrong kind: the meta server broke the protocol.
pub(crate) fn unexpected(call: &'static str, response: Response) -> Error {
    Error::UnexpectedResponse {
        call,
        got: short(&response),
    }
}

fn short(response: &Response) -> &'static str {
    match response {
        Response::Ok => "Ok",
        Response::Attr(_) => "Attr",
        Response::Entries(_) => "Entries",
        Response::EntriesPlus(_) => "EntriesPlus",
        Response::Data(_) => "Data",
        Response::Names(_) => "Names",
        Response::Stats(_) => "Stats",
        Response::Open(_) => "Open",
        Response::Chunks(_) => "Chunks",
        Response::RecordLock(_) => "RecordLock",
        Response::Addr(_) => "Addr",
        Response::Revocations { .. } => "Revocations",
        Response::Heartbeat { .. } => "Heartbeat",
        Response::Cluster(_) => "Cluster",
        Response::Fsck(_) => "Fsck",
        Response::Status(_) => "Status",
        Response::Gone(_) => "Gone",
    }
}
