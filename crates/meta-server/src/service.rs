//! The meta server's logic, independent of the transport: the dispatcher of every request over
//! the parts that own the server's state — the sessions ([`crate::sessions`]), fencing
//! ([`crate::fences`]), the data servers ([`crate::registry`]), the open files
//! ([`crate::open_files`]), the published tables ([`crate::published`]), record locks
//! ([`crate::record_locks`]) and the namespace ([`Store`]).
//!
//! # Locking
//! One mutex, `Service::state`, serializes every namespace mutation together with the open-file
//! table, the sessions, the meta region's allocator and the live data servers. That makes the
//! pre-transaction scans in [`Store`] exact and keeps "is this inode open?" consistent with
//! unlink. Reads of the namespace (lookup, readdir, xattrs, chunk maps) do not take it. Long
//! fabric work (zeroing freed chunks) runs after the state lock is released, on the server's own
//! endpoint mutex. The fence table, the record locks and the lock-call counts have mutexes of
//! their own, taken after the state lock where both are held.

use crate::fences::{FenceTable, RevokeFn};
use crate::meta_region::{MetaRegion, OwnRegion, META_REGION};
use crate::open_files::{Left, LockCalls, LockPolicy, OpenFiles};
use crate::published::PublishedTables;
use crate::record_locks::RecordLocks;
use crate::registry::{LiveServers, Registry, RegistrySettings};
use crate::sessions::SessionTable;
use crate::store::{Effects, Store};
use crate::sync::lock;
use fabric::local::LocalEndpoint;
use fabric::{Region, RegionId, RemoteAddr};
use lockmgr::schemes::{self, LockServer};
use lockmgr::LockScheme;
use proto::fcb;
use proto::fsck::{Finding, FsckOptions, FsckReport, Repair, MAX_FINDINGS};
use proto::rpc::{Group, Request, Response};
use proto::{
    Attr, ChunkLoc, ClusterInfo, DataServerInfo, FabricAddr, FileKind, FsError, FsStats, Ino,
    OpenFile, SetAttr,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

mod rereplicate;

/// Settings the service needs (a digest of `MetaConfig`).
pub(crate) struct Settings {
    pub credentials: fabric::Credentials,
    pub chunk_size: u64,
    pub lock_unit: u64,
    pub session_lease: Duration,
    /// A session silent for longer is revoked by a `Fence` (see [`Service::fence`]).
    pub fence_after: Duration,
    /// `T_lease` of the CITRON lock of every file.
    pub lock_lease: Duration,
    pub meta_fabric: FabricAddr,
    /// The Unix socket clients on this host may connect to instead of tcp
    /// (`MetaConfig::local_rpc`), as it is bound; `None`: none.
    pub local_rpc: Option<String>,
    /// `T_wait` for CITRON trees, measured as clients reach the region (through the fabric,
    /// not the server's local memory).
    pub t_wait: Duration,
    /// Limits on the RPC port's connections (checked in `rpc` before a byte is read).
    pub connection_limits: fabric::handshake::ConnectionLimits,
    /// Client sessions open at once.
    pub max_sessions: usize,
    /// Files one session may have open at once (distinct inodes; EMFILE beyond).
    pub max_open_per_session: usize,
    /// Until then only reclaimed record locks are granted (`MetaConfig::record_lock_grace`).
    pub record_lock_grace_until: Instant,
    /// Record locks one session may hold (ENOLCK beyond).
    pub max_record_locks_per_session: usize,
    /// Replicas of a chunk of a file that names none ([`MetaConfig::replicas`]).
    pub replicas: usize,
    /// The database's directory (`MetaConfig::db_dir`), for a status report.
    pub state_dir: std::path::PathBuf,
    /// The first session id of this run ([`first_session_id`]): every session of this run is
    /// numbered from it, and the meta region's fabric server refuses those below it.
    pub first_session: u64,
    /// When this run is a restart: when every lock lease of the earlier run has run out (its
    /// start plus `lock_lease`). A data server whose backend cannot refuse the earlier run's
    /// sessions (shm, mem) is made live no sooner ([`Service::register_data_server`]).
    pub earlier_leases_until: Option<Instant>,
    /// Re-replication's rate limit and grace (`crate::rereplicate`).
    pub rereplicate: crate::rereplicate::Settings,
}

/// The first session id of this run: the clock in microseconds, so that ids of an earlier run
/// (which data servers may still hold revoked) are never handed out again, and so that the
/// meta region's fabric server can refuse every session of an earlier run
/// (`FabricServer::refuse_sessions_before`).
pub(crate) fn first_session_id() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(1)
        .max(1)
}

/// What the replica checks of one `fsck` found, and the files they did not compare.
struct ReplicaChecks {
    outcome: crate::replica_check::Outcome,
    not_compared: Vec<(Ino, String)>,
}

/// What the state lock guards (see the module docs).
struct State {
    sessions: SessionTable,
    open: OpenFiles,
    /// The meta region's allocator and the server's own endpoint on it.
    region: MetaRegion,
    live: LiveServers,
    published: PublishedTables,
}

impl AsMut<LiveServers> for State {
    fn as_mut(&mut self) -> &mut LiveServers {
        &mut self.live
    }
}

impl State {
    /// Publishes the attributes of `inos` (see [`PublishedTables::publish`]).
    fn publish(&mut self, store: &Store, inos: impl IntoIterator<Item = Ino>) {
        self.published
            .publish(&mut self.region, store, &self.open, inos)
    }

    /// Publishes everything committed transactions touched since the last call.
    fn publish_touched(&mut self, store: &Store) {
        self.published
            .publish_touched(&mut self.region, store, &self.open)
    }

    /// `attr` as the FCB of its file, if open, corrects it.
    fn live_attr(&mut self, attr: Attr) -> Attr {
        self.open.live_attr(&mut self.region, attr)
    }

    /// Persists what open file `ino`'s FCB holds (size, data-change time) into the database.
    fn persist_fcb(&mut self, store: &Store, ino: Ino) -> Result<(), FsError> {
        if let Some((size, mtime)) = self.open.size_and_mtime(&mut self.region, ino) {
            store.persist_live(ino, size, mtime)?;
        }
        Ok(())
    }
}

/// The meta server's state and request handlers.
pub(crate) struct Service {
    pub settings: Settings,
    store: Store,
    /// The meta region, for the consistency checker's own endpoint on the lock words.
    region: Arc<Region>,
    state: Mutex<State>,
    /// Sessions fenced so far, and which data servers apply them.
    fences: FenceTable,
    /// The data servers, their zeroing and the reclaimer.
    registry: Registry,
    /// POSIX record locks (`fcntl`), cluster-wide.
    records: RecordLocks,
    /// Per open file, the lock requests about it that came as RPCs.
    lock_calls: LockCalls,
    /// Client requests handled since start, heartbeats excepted (they come by the clock, not
    /// by the file system's work): what `citronfs bench meta` divides by its operations to
    /// show RPCs per operation.
    requests: AtomicU64,
    /// Nanoseconds spent handling those requests (from the handler's start to its answer, the
    /// state lock's waits included; not the transport's): what `citronfs bench meta` shows as
    /// the server's share of an operation.
    request_ns: AtomicU64,
    /// Per request kind metrics, once registered (`MetaHandle::register_metrics`).
    metrics: OnceLock<crate::metrics::RequestMetrics>,
    /// When the service started, for a status report.
    started: Instant,
    /// Held shared by every `ChunkMap` answer, and exclusively while a down data server's
    /// replicas are dropped and the files' new generations published
    /// ([`Service::drop_replicas_on`]): no chunk map without a dropped replica is answered
    /// before the generation that makes cached maps stale is in the files' control blocks.
    chunk_gate: std::sync::RwLock<()>,
    /// Re-replication's schedule and progress (`rereplicate`).
    rereplicator: crate::rereplicate::Rereplicator,
    /// The service's own stalls ([`crate::stall`]), noted by [`Service::pulse`].
    stall: crate::stall::StallWatch,
    /// Tests: how many more allocations of each file find its generation moved just before
    /// them (`MetaHandle::churn_generation`).
    #[cfg(feature = "test-hooks")]
    generation_churn: Mutex<HashMap<Ino, u32>>,
    /// The connector of the meta server's own lock handles (`rereplicate`).
    lock_connector: OnceLock<Arc<dyn fabric::Connector>>,
    /// The service as shared, for callbacks of its own lock handles (`rereplicate`).
    me: OnceLock<std::sync::Weak<Service>>,
}

impl Service {
    /// The service over `store` and the meta region `region`; deletes the orphans the last
    /// run left and fills the published tables.
    pub fn new(
        settings: Settings,
        store: Store,
        region: Arc<Region>,
        lock_server: Option<Arc<LockServer>>,
    ) -> anyhow::Result<Self> {
        let mut meta_region = MetaRegion::new(region.clone())?;
        let published = PublishedTables::new(&mut meta_region, settings.first_session);
        let policy = LockPolicy {
            lock_unit: settings.lock_unit,
            lock_lease: settings.lock_lease,
            t_wait: settings.t_wait,
            fence_after: settings.fence_after,
            lock_server,
        };
        let registry = Registry::new(RegistrySettings {
            credentials: settings.credentials.clone(),
            chunk_size: settings.chunk_size,
            first_session: settings.first_session,
            earlier_leases_until: settings.earlier_leases_until,
        });
        let records = RecordLocks::new(
            settings.record_lock_grace_until,
            settings.max_record_locks_per_session,
        );
        let rereplicator = crate::rereplicate::Rereplicator::new(settings.rereplicate);
        let service = Service {
            state: Mutex::new(State {
                sessions: SessionTable::new(settings.first_session),
                open: OpenFiles::new(policy),
                region: meta_region,
                live: LiveServers::default(),
                published,
            }),
            settings,
            store,
            region,
            fences: FenceTable::default(),
            registry,
            records,
            lock_calls: LockCalls::default(),
            requests: AtomicU64::new(0),
            request_ns: AtomicU64::new(0),
            metrics: OnceLock::new(),
            started: Instant::now(),
            chunk_gate: std::sync::RwLock::new(()),
            rereplicator,
            stall: crate::stall::StallWatch::new(Instant::now()),
            #[cfg(feature = "test-hooks")]
            generation_churn: Mutex::new(HashMap::new()),
            lock_connector: OnceLock::new(),
            me: OnceLock::new(),
        };
        // Orphans were open when the last run ended; no session survives a restart.
        for ino in service.store.orphans()? {
            let effects = service.store.delete_orphan(ino)?;
            tracing::info!(ino, chunks = effects.freed.len(), "deleted orphan inode");
        }
        // The table starts empty (every slot falls back to the RPC until published).
        service.store.take_touched();
        // The entry table starts whole: every entry of the database, before any client is
        // told where it is.
        {
            let mut st = lock(&service.state);
            let st = &mut *st;
            st.published.fill_entries(&mut st.region, &service.store)?;
        }
        Ok(service)
    }

    // ---- sessions ---------------------------------------------------------------------------

    /// Opens a client session from `origin` and describes the cluster to it.
    pub fn open_session(&self, origin: crate::status::Origin) -> Result<ClusterInfo, FsError> {
        let session = lock(&self.state)
            .sessions
            .open(origin, self.settings.max_sessions)?;
        self.cluster_info(session)
    }

    /// The cluster as session `session` sees it now.
    ///
    /// The epoch is read before the layout, so a change racing with this call moves the epoch
    /// past the one returned and the client asks again.
    fn cluster_info(&self, session: u64) -> Result<ClusterInfo, FsError> {
        let layout_epoch = self.registry.layout_epoch();
        let (live, attr_table, dentry_table, lock_server) = {
            let st = lock(&self.state);
            (
                st.live.id_set(),
                st.published.attr_table(),
                st.published.dentry_table(),
                st.open.policy().lock_server_addr(),
            )
        };
        let mut data_servers = Vec::new();
        for r in self.store.servers()? {
            data_servers.push(DataServerInfo {
                id: r.id,
                incarnation: self.store.incarnation(r.id)?,
                live: live.contains(&r.id),
                fabric: r.fabric,
                region: r.region,
                chunks: r.chunks,
            });
        }
        Ok(ClusterInfo {
            session,
            meta_fabric: self.settings.meta_fabric.clone(),
            meta_region: META_REGION,
            data_servers,
            chunk_size: self.settings.chunk_size,
            lock_unit: self.settings.lock_unit,
            session_lease_ms: self.settings.session_lease.as_millis() as u64,
            fence_after_ms: self.settings.fence_after.as_millis() as u64,
            lock_server,
            layout_epoch,
            attr_table,
            dentry_table,
            local_rpc: self.settings.local_rpc.clone(),
        })
    }

    /// Ends a session (its connection closed, or its lease ran out): releases its open files.
    ///
    /// The session is revoked on every fabric server too, whatever ended it (its lease ran out,
    /// its connection closed, a fence): its client may still be alive — stopped, or reconnected
    /// as a new session — with batches of the old one on their way, and a later fence revokes
    /// only sessions it still knows.
    pub fn end_session(&self, session: u64) {
        let mut st = lock(&self.state);
        let Some(ended) = st.sessions.end(session) else {
            return;
        };
        let mut freed = Vec::new();
        for ino in ended.open {
            match self.release_locked(&mut st, session, ino) {
                Ok(effects) => freed.extend(effects.freed),
                Err(error) => tracing::warn!(session, ino, %error, "release at session end"),
            }
        }
        st.publish_touched(&self.store);
        drop(st);
        // Its record locks go too; the `SetLk`s waiting for them are woken.
        self.records.drop_session(session);
        self.fences.revoke_ended(session, ended.peer_pid);
        self.registry.zero_and_recycle(freed);
    }

    /// One pulse of the stall watch ([`crate::stall`]): takes the state lock and notes when
    /// it got it. The pulse thread (`MetaServer::start`) calls it every
    /// [`crate::stall::PULSE_EVERY`].
    pub fn pulse(&self) {
        self.stall.pulse_waits(Instant::now());
        drop(lock(&self.state));
        self.stall.pulse_got(Instant::now());
    }

    /// `MetaHandle::churn_generation`.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn churn_generation(&self, ino: Ino, allocations: u32) {
        lock(&self.generation_churn).insert(ino, allocations);
    }

    /// Tests: moves `ino`'s generation on (in the database and its control block) when
    /// `MetaHandle::churn_generation` asked for it, as a re-replication commit would just
    /// before the allocation.
    #[cfg(feature = "test-hooks")]
    fn churn_before_allocation(&self, ino: Ino) {
        let due = match lock(&self.generation_churn).get_mut(&ino) {
            Some(left) if *left > 0 => {
                *left -= 1;
                true
            }
            _ => false,
        };
        if !due {
            return;
        }
        let mut st = lock(&self.state);
        if let Ok(attr) = self.store.bump_generation(ino) {
            let st = &mut *st;
            let _ = st.open.publish_generation(&mut st.region, &attr);
            st.publish_touched(&self.store);
        }
    }

    /// `MetaHandle::layout_epoch`.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn layout_epoch(&self) -> u64 {
        self.registry.layout_epoch()
    }

    /// `MetaHandle::hold_state_lock`.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn hold_state_lock(&self, hold: Duration) {
        let _st = lock(&self.state);
        std::thread::sleep(hold);
    }

    /// Ends every session whose lease ran out; returns how many. Silence while the meta server
    /// itself was stalled does not count ([`crate::stall`]): the sessions' heartbeats were
    /// waiting for it.
    pub fn expire_sessions(&self) -> usize {
        let expired = {
            let st = lock(&self.state);
            // Taken under the lock: a stall that held it until now is seen (the pulse waits).
            let awake_since = self.stall.awake_since(Instant::now());
            st.sessions.silent(self.settings.session_lease, awake_since)
        };
        for &session in &expired {
            tracing::info!(session, "session lease expired");
            self.end_session(session);
        }
        expired.len()
    }

    /// Renews a session's lease; `Stale` if it is gone (see [`SessionTable::touch`]).
    fn touch(&self, session: u64, arrival: bool) -> Result<(), FsError> {
        lock(&self.state)
            .sessions
            .touch(session, arrival, self.settings.fence_after)
    }

    // ---- fencing ---------------------------------------------------------------------------

    /// Installs the function that revokes sessions on the meta server's own fabric server.
    pub fn set_local_revoke(&self, revoke: RevokeFn) {
        self.fences.set_local_revoke(revoke);
    }

    /// Revokes every session a fence must ([`SessionTable::fence_targets`]: silent for longer
    /// than `fence_after`, or recently back from such a silence; never `caller`) and returns
    /// once no fabric server executes their batches any more (the [`FenceTable`] invariant),
    /// or fails after `wait` if a data server does not acknowledge.
    ///
    /// Why silence is the right test: a client posts data verbs only while its lock's lease has
    /// more than `2·fence_after` left (fs-client's guard), and a lock is broken only after its
    /// lease ran out. So a holder that can still land a write after the break must have
    /// stopped between its check and its post for at least `2·fence_after`, its heartbeat
    /// thread with it (a stopped or frozen process): it is silent here, or has just come back
    /// from such a silence. A live client that is merely slow keeps heartbeating and is
    /// protected by its own lease check instead.
    pub fn fence(&self, caller: u64, wait: Duration) -> Result<(), FsError> {
        let silent = lock(&self.state).sessions.fence_targets(
            caller,
            self.settings.fence_after,
            Instant::now(),
        );
        let epoch = self.fences.revoke_all_of(&silent);
        if !silent.is_empty() {
            tracing::warn!(sessions = ?silent, epoch, "fencing silent sessions: a lock they may hold is being broken");
        } else {
            tracing::info!(
                "fence: no session silent for {:?} or just back from such a silence; nothing to revoke",
                self.settings.fence_after
            );
        }
        for &session in &silent {
            self.end_session(session);
        }
        self.fences.await_epoch(epoch, wait)
    }

    /// Whether the lock holder whose session ends in `owner` (its low 48 bits, as a lock
    /// tree's owner record keeps it) is out for good: it can land no verb on any fabric server
    /// any more (`lockmgr::Fence::holder_gone`).
    ///
    /// Where the fabric cannot fence (shm), a process that maps the memory cannot be kept out:
    /// a holder is gone only when its session ended and its process is gone too, as the
    /// kernel names it (a client of the local socket); otherwise the lease rule decides.
    /// Where it can (tcp):
    ///
    /// - A session that ended (its connection closed, its lease ran out, a fence) was revoked
    ///   then ([`Service::end_session`]): `true` once every data server applied that
    ///   revocation.
    /// - A live session: `false`, unless `stopped` (the waiter saw the node stand still for a
    ///   whole `T_lease`) and it has been silent for longer than `fence_after` — then it is
    ///   revoked and ended here, as [`Service::fence`] does with every silent session, and
    ///   `true` once the data servers applied it.
    ///
    /// Never `caller` itself. Fails if a data server does not acknowledge within `wait`.
    pub fn holder_gone(
        &self,
        caller: u64,
        owner: u64,
        stopped: bool,
        wait: Duration,
    ) -> Result<bool, FsError> {
        let named = |session: u64| lockmgr::holder_identity(session) == owner;
        if named(caller) {
            return Ok(false);
        }
        if !self.fences.can_fence() {
            return Ok(self.fences.ended_process_gone(named));
        }
        let live = lock(&self.state).sessions.find(named);
        let epoch = match live {
            Some((id, silent)) => {
                if !stopped || silent <= self.settings.fence_after {
                    return Ok(false);
                }
                let epoch = self.fences.revoke(&[id]);
                tracing::warn!(
                    session = id,
                    epoch,
                    ?silent,
                    "fencing a silent session: a lock-tree node it holds is being broken"
                );
                self.end_session(id);
                epoch
            }
            // Not a session of this run's: nothing known, the lease decides.
            None => match self.fences.revoked_epoch(named) {
                Some(epoch) => epoch,
                None => return Ok(false),
            },
        };
        self.fences.await_epoch(epoch, wait)?;
        Ok(true)
    }

    /// The data server registered as `id` on connection `conn` has applied fence epochs up to
    /// `known`.
    pub fn fence_applied(&self, id: u32, conn: u64, known: u64) {
        self.fences.applied(id, conn, known);
    }

    /// The revocation epoch to watch, for a data server's long poll.
    pub fn fence_watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.fences.watch()
    }

    /// The current fence epoch, and the sessions revoked after epoch `known`.
    pub fn revocations_since(&self, known: u64) -> (u64, Vec<u64>) {
        self.fences.revocations_since(known)
    }

    // ---- data servers -----------------------------------------------------------------------

    /// Registers a data server (by its stable name) and connects to its region; returns its id
    /// and the connection epoch to pass to [`Service::data_server_gone`] (see
    /// [`Registry::register`]), in failure domain `zone` if it names one.
    #[allow(clippy::too_many_arguments)]
    pub fn register_data_server(
        &self,
        name: &str,
        fabric: FabricAddr,
        region: RegionId,
        region_bytes: u64,
        incarnation: u64,
        zone: Option<&str>,
    ) -> Result<(u32, u64), FsError> {
        let registered = self.registry.register(
            &self.state,
            &self.store,
            &self.fences,
            name,
            fabric,
            region,
            region_bytes,
            incarnation,
            zone,
        );
        // A server back with new memory has lost replicas; a new one is room for replicas
        // that had none.
        self.replicas_may_be_short();
        registered
    }

    /// Marks the service as stopping: connections closed from now on are expected.
    pub fn begin_shutdown(&self) {
        self.registry.begin_shutdown();
    }

    /// A data server's registration connection closed: it is down, and its replicas of chunks
    /// with another live replica are dropped ([`Service::drop_replicas_on`]).
    pub fn data_server_gone(&self, id: u32, epoch: u64) {
        self.registry
            .gone(&self.state, &self.fences, id, epoch, |st| {
                self.drop_replicas_on(st, id)
            });
        self.replicas_may_be_short();
    }

    /// Drops data server `id`'s replicas, the server just marked down (the state lock held
    /// since): every replica there of a chunk with another live replica is marked lost
    /// ([`Store::drop_replicas_on`]), so that writes go on with the others, and the new
    /// generation of each file touched is published in its control block if it is open —
    /// with no chunk map answered in between (`chunk_gate`), so that no client can learn a
    /// chunk map without the replica, write the chunk without it, and release its lock before
    /// the generation that makes every other client's cached map stale is there to be read
    /// under the next lock (docs/REPLICAS.md "A dead data server").
    ///
    /// Not while the meta server itself is stalled or has just been ([`crate::stall`]): then
    /// the silence that marked the server down may be the meta server's own, every server may
    /// be marked down in turn, and dropping would leave a single copy of chunks whose replicas
    /// never missed a write. The replicas stay; writes to the chunks wait for the server to
    /// register again (as it does at once when it is alive), and re-replication's pass, due
    /// after the server went down, drops and replaces them if it does not.
    fn drop_replicas_on(&self, st: &mut State, id: u32) {
        if self
            .stall
            .stalled_within(Instant::now(), crate::stall::DROP_GRACE)
        {
            tracing::warn!(
                id,
                "data server marked down while the meta server itself stalled or just after: \
                 its replicas are kept (writes to them wait for it to register again; \
                 re-replication replaces them if it does not)"
            );
            return;
        }
        let _gate = self
            .chunk_gate
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let dropped = match self.store.drop_replicas_on(id, |s| st.live.is_live(s)) {
            Ok(dropped) => dropped,
            Err(error) => {
                tracing::error!(
                    id,
                    %error,
                    "cannot drop the replicas of a data server that went down: writes to its \
                     chunks wait for it"
                );
                return;
            }
        };
        for attr in &dropped.files {
            if let Err(error) = st.open.publish_generation(&mut st.region, attr) {
                tracing::error!(ino = attr.ino, %error, "cannot publish a file's generation");
            }
        }
        st.publish_touched(&self.store);
        if dropped.replicas > 0 {
            tracing::warn!(
                id,
                replicas = dropped.replicas,
                files = dropped.files.len(),
                "dropped the replicas of a data server that went down from chunks with another \
                 live replica: writes go on without them, and they are never read again"
            );
        }
    }

    /// The reclaimer thread's loop (started by `MetaServer::start`); returns once stopped and
    /// drained.
    pub fn run_reclaimer(&self) {
        self.registry.run_reclaimer(&self.state, &self.store);
    }

    /// Stops the reclaimer thread once it has drained its queue.
    pub fn stop_reclaimer(&self) {
        self.registry.stop_reclaimer();
    }

    /// Waits up to `timeout` for the reclaimer to have nothing queued; whether it is idle.
    pub fn reclaimer_idle(&self, timeout: Duration) -> bool {
        self.registry.reclaimer_idle(timeout)
    }

    /// Tests: runs inside a scrub, after the free chunks were listed and before they are zeroed.
    #[cfg(test)]
    pub(crate) fn scrub_hook(&self) -> &Mutex<Option<Arc<dyn Fn() + Send + Sync>>> {
        &self.registry.scrub_hook
    }

    // ---- open files -------------------------------------------------------------------------

    /// `MetaHandle::session_count`.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn session_count(&self) -> usize {
        lock(&self.state).sessions.len()
    }

    /// `MetaHandle::record_lock_waiters`.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn record_lock_waiters(&self) -> usize {
        self.records.waiters()
    }

    /// `MetaHandle::release_in_every_session`.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn release_in_every_session(&self, ino: Ino) -> usize {
        let sessions = lock(&self.state).open.sessions_of(ino);
        for &session in &sessions {
            let _ = self.handle_by(session, vec![ino], Request::Cluster, None);
        }
        sessions.len()
    }

    /// `MetaHandle::damage_fcb_word`.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn damage_fcb_word(&self, ino: Ino, word: u64, value: u64) -> Option<u64> {
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.open.damage_fcb_word(&mut st.region, ino, word, value)
    }

    /// The attributes of an open file as its FCB corrects them; others' as they are.
    fn live_attr(&self, attr: Attr) -> Attr {
        lock(&self.state).live_attr(attr)
    }

    /// Session `session` opens `ino` for I/O under a lock of `scheme`: the file's first open
    /// makes its FCB and lock, every later one (under the same scheme) shares them.
    fn open(&self, session: u64, ino: Ino, scheme: LockScheme) -> Result<OpenFile, FsError> {
        let mut st = lock(&self.state);
        let attr = self.store.getattr(ino)?;
        match attr.kind {
            FileKind::File => {}
            FileKind::Dir => return Err(FsError::IsDir),
            _ => {
                return Err(FsError::Invalid(
                    "only regular files are opened for I/O".into(),
                ))
            }
        }
        let st = &mut *st;
        st.open.policy().check_available(&scheme)?;
        st.open.check_scheme(session, ino, &scheme)?;
        // Checked before anything is allocated for the file.
        st.sessions
            .check_open_limit(session, ino, self.settings.max_open_per_session)?;
        if st.open.ensure_open(&mut st.region, ino, &attr, &scheme)? {
            self.lock_calls.opened(ino);
            // Readers of the table now take the size from the FCB.
            st.publish(&self.store, [ino]);
        }
        let opened = st.open.join(&mut st.region, session, ino, attr)?;
        st.sessions.note_open(session, ino);
        Ok(opened)
    }

    /// `session` drops `ino`: persists its size; the last opener frees the FCB and lock state
    /// (and deletes the inode if it was unlinked meanwhile).
    fn release_locked(&self, st: &mut State, session: u64, ino: Ino) -> Result<Effects, FsError> {
        st.sessions.note_closed(session, ino);
        let left = st.open.leave(session, ino);
        if left == Left::NotOpen {
            return Ok(Effects::default());
        }
        st.persist_fcb(&self.store, ino)?;
        if left == Left::Others {
            return Ok(Effects::default());
        }
        self.repair_cut_write(st, ino);
        st.open.close(&mut st.region, ino);
        self.lock_calls.closed(ino);
        st.publish(&self.store, [ino]);
        let mut effects = self.store.delete_orphan(ino)?;
        // Nobody has it open now: chunks beyond its size can only be a dead writer's, which
        // allocated them but never raised the size (`Store::free_beyond_size`).
        if effects.freed.is_empty() {
            effects = self.store.free_beyond_size(ino)?;
        }
        Ok(effects)
    }

    /// Before the last opener's release frees `ino`'s FCB: where its BEGUN and ENDED words
    /// differ or a slot is set, a replicated write was cut and no client repaired it (docs/REPLICAS.md, "A write
    /// cut between replicas"); the record goes with the FCB, so the replicas of its chunks below
    /// the size are made to agree now, copying each chunk's first live replica over the others.
    /// Nobody has the file open, so no range lock of it can be held, and none can be taken
    /// while the state lock (`st`) is held. A failure is logged, not returned: the release goes
    /// on, and `fsck` reports what still differs.
    fn repair_cut_write(&self, st: &mut State, ino: Ino) {
        let begun = st.open.fcb_word(&mut st.region, ino, fcb::BEGUN);
        let ended = st.open.fcb_word(&mut st.region, ino, fcb::ENDED);
        let slots: Vec<u64> = (0..fcb::SLOT_COUNT)
            .filter_map(|i| {
                st.open
                    .fcb_word(&mut st.region, ino, fcb::SLOTS + 8 * i as u64)
            })
            .filter(|&v| v != 0)
            .collect();
        if begun == ended && slots.is_empty() {
            return;
        }
        let layout = self.store.layout();
        let repaired = self.store.getattr(ino).and_then(|attr| {
            let count = layout.chunks_below(attr.size);
            let map = self.store.chunk_map(ino, 0, count)?;
            let chunks: Vec<(u64, Vec<ChunkLoc>)> = map
                .into_iter()
                .enumerate()
                .filter_map(|(i, r)| r.map(|r| (i as u64, r.as_slice().to_vec())))
                .filter(|(_, r)| r.len() > 1)
                .collect();
            let mut io = st.live.replica_io(layout.unit());
            crate::replica_check::copy_from_first(layout, &chunks, |s| st.live.is_live(s), &mut io)
        });
        match repaired {
            Ok(copied) => tracing::warn!(
                ino,
                ?begun,
                ?ended,
                ?slots,
                copied,
                "closed with a replicated write cut: copied each chunk's first live replica over the others"
            ),
            Err(e) => tracing::error!(
                ino,
                error = %e,
                "closed with a replicated write cut, and its replicas could not be repaired (fsck --repair can)"
            ),
        }
    }

    /// Persists every open file's size (clean shutdown) and flushes the database.
    pub fn persist_all(&self) -> Result<(), FsError> {
        let mut st = lock(&self.state);
        for ino in st.open.inos() {
            st.persist_fcb(&self.store, ino)?;
        }
        drop(st);
        self.store.mark_clean()
    }

    /// Allocates `words` zeroed lock words for the lock tree of open file `ino` (a CITRON
    /// scale-up, Alg. 4 l. 3), freed with the file's other lock state when it is no longer
    /// open: `AllocateLockWords`, and the allocator of the scale-ups a hosted acquisition runs
    /// here (`offer_hosted_citron`).
    pub fn allocate_lock_words(&self, ino: Ino, words: u64) -> Result<RemoteAddr, FsError> {
        let mut st = lock(&self.state);
        if !st.open.is_open(ino) {
            return Err(FsError::Stale);
        }
        self.lock_calls.count(ino);
        let st = &mut *st;
        st.open.add_lock_words(&mut st.region, ino, words)
    }

    // ---- requests ---------------------------------------------------------------------------

    /// Handles one request of client session `session`: releases `release_first` (files the
    /// client closed since its last call, riding in the request's frame:
    /// `RequestFrame::release_first`), each as `Release` would, then handles `request`. A
    /// release that fails (the file is not open in this session: the client reconnected
    /// meanwhile) is logged and skipped; it never fails the request. Counted as one request,
    /// its releases' time included.
    ///
    /// A request with `expires` (`RequestFrame::expires`, a range lock's lease deadline) must
    /// not change anything at or past it: it is refused with [`FsError::Expired`] on arrival,
    /// and again where its change would become visible ([`Service::check_expiry`]), when less
    /// than the margin is left.
    pub fn handle_by(
        &self,
        session: u64,
        release_first: Vec<Ino>,
        request: Request,
        expires: Option<Instant>,
    ) -> Result<Response, FsError> {
        let counted = crate::requests::counted(&request, &release_first);
        let kind = request.kind();
        let start = Instant::now();
        for ino in release_first {
            if let Err(error) = self.handle_timed(session, Request::Release { ino }, None) {
                tracing::debug!(session, ino, %error, "a release riding on a request failed");
            }
        }
        let result = self.handle_timed(session, request, expires);
        if let Some(metrics) = self.metrics.get() {
            let errno = result.as_ref().err().map(FsError::errno);
            metrics.record(kind, start.elapsed().as_secs_f64(), errno);
        }
        if counted {
            self.requests.fetch_add(1, Ordering::Relaxed);
            self.request_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        result
    }

    /// Handles `request` within session `session`'s lease, publishing what it changed before
    /// the answer.
    fn handle_timed(
        &self,
        session: u64,
        request: Request,
        expires: Option<Instant>,
    ) -> Result<Response, FsError> {
        self.touch(session, true)?;
        self.check_expiry(expires)?;
        let changes = crate::requests::changes_inodes(&request);
        let result = self.dispatch(session, request, expires);
        if changes {
            // Before the answer: a client that saw it reads the change one-sidedly.
            lock(&self.state).publish_touched(&self.store);
        }
        // A session is not silent while its request runs: its heartbeat waits behind it.
        let _ = self.touch(session, false);
        result
    }

    /// Refuses a change whose range lock's lease ends at `expires` once less than
    /// `fence_after` of it is left ([`FsError::Expired`]; nothing to refuse without one).
    ///
    /// Why here and not only in the client: the client sends such a change only with
    /// `2·fence_after` of its lease left (fs-client's guard), but nothing bounds how long the
    /// request then takes to reach the point where its change is applied — on its way, queued
    /// for a worker, waiting for the state lock behind a slow transaction. Past the deadline
    /// another client may have broken in on the lock and written the range: a truncate or punch
    /// applied then would free or cut off that write. So the requests made under a range lock
    /// (`SetAttr` of a size or set-ID bits, `FreeChunks`) check again holding the state lock,
    /// right before their change, which is published (the FCB's generation and size, read by
    /// the next lock holder's acquisition) before the state lock is let go: what remains of
    /// the margin covers that transaction. The invariant: a change made under a range lock
    /// becomes visible before the lock's lease ends, or not at all.
    fn check_expiry(&self, expires: Option<Instant>) -> Result<(), FsError> {
        match expires {
            Some(at) if Instant::now() + self.settings.fence_after >= at => {
                tracing::warn!(
                    late_by = ?Instant::now().saturating_duration_since(at),
                    "refusing a change made under a range lock whose lease has (all but) run out"
                );
                Err(FsError::Expired)
            }
            _ => Ok(()),
        }
    }

    /// Hands `request` to the handler of its group (its row in proto's request table,
    /// `RequestClass::group`).
    fn dispatch(
        &self,
        session: u64,
        request: Request,
        expires: Option<Instant>,
    ) -> Result<Response, FsError> {
        match request.class().group {
            Group::Cluster => self.handle_cluster(session, request),
            Group::Read => self.handle_read(request),
            Group::Change => self.handle_change(request),
            Group::File => self.handle_file(session, request, expires),
            Group::Chunks => self.handle_chunks(request, expires),
        }
    }

    /// The answer to a request handed to a group it is not of ([`Service::dispatch`]).
    fn misrouted(request: &Request) -> FsError {
        FsError::Invalid(format!("{} is not handled here", request.kind().name()))
    }

    /// Requests about the cluster and the session itself.
    fn handle_cluster(&self, session: u64, request: Request) -> Result<Response, FsError> {
        Ok(match request {
            Request::Heartbeat => Response::Heartbeat {
                layout_epoch: self.registry.layout_epoch(),
            },
            Request::Cluster => Response::Cluster(Box::new(self.cluster_info(session)?)),
            Request::Fence => {
                self.fence(session, crate::fences::FENCE_WAIT)?;
                Response::Ok
            }
            Request::HolderGone { owner, stopped } => Response::Gone(self.holder_gone(
                session,
                owner,
                stopped,
                crate::fences::FENCE_WAIT,
            )?),
            Request::Fsck(options) => Response::Fsck(self.fsck(session, options)?),
            Request::Status => Response::Status(Box::new(crate::status::report(
                self.status_facts()?,
                session,
                Instant::now(),
            ))),
            Request::Statfs => Response::Stats(self.statfs()?),
            Request::AwaitRevocations { .. } => {
                return Err(FsError::Invalid(
                    "AwaitRevocations is for data servers' registration connections".into(),
                ))
            }
            other => return Err(Self::misrouted(&other)),
        })
    }

    /// Reads of the namespace (no state lock but to fill the published tables and correct
    /// open files' attributes).
    fn handle_read(&self, request: Request) -> Result<Response, FsError> {
        Ok(match request {
            Request::Lookup { parent, name } => {
                let attr = self.store.lookup(parent, &name)?;
                self.fill(attr.ino);
                self.fill_entry(parent, &name);
                Response::Attr(self.live_attr(attr))
            }
            Request::GetAttr { ino } => {
                let attr = self.store.getattr(ino)?;
                self.fill(ino);
                Response::Attr(self.live_attr(attr))
            }
            Request::Readlink { ino } => Response::Data(self.store.readlink(ino)?),
            Request::ReadDir { ino, cookie, max } => {
                Response::Entries(self.store.readdir(ino, cookie, max)?)
            }
            Request::ReadDirPlus { ino, cookie, max } => self.readdir_plus(ino, cookie, max)?,
            Request::GetXattr { ino, name } => Response::Data(self.store.getxattr(ino, &name)?),
            Request::ListXattr { ino } => Response::Names(self.store.listxattr(ino)?),
            other => return Err(Self::misrouted(&other)),
        })
    }

    /// Publishes `ino` unless its slot holds it already.
    fn fill(&self, ino: Ino) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.published
            .fill(&mut st.region, &self.store, &st.open, ino);
    }

    /// Holds `parent/name` in the entry table if it was only counted there.
    fn fill_entry(&self, parent: Ino, name: &str) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.published
            .fill_entry(&mut st.region, &self.store, &st.open, parent, name);
    }

    /// `ReadDirPlus`: a page of entries with their attributes, open files' as their FCBs
    /// correct them.
    fn readdir_plus(&self, ino: Ino, cookie: u64, max: u32) -> Result<Response, FsError> {
        let entries = self.store.readdir(ino, cookie, max)?;
        let mut plus = Vec::with_capacity(entries.len());
        for entry in entries {
            // An entry removed since the scan is left out, as if listed after it.
            match self.store.getattr(entry.ino) {
                Ok(attr) => plus.push((entry, attr)),
                Err(FsError::NotFound) => {}
                Err(e) => return Err(e),
            }
        }
        let mut st = lock(&self.state);
        for (_, attr) in &mut plus {
            *attr = st.live_attr(attr.clone());
        }
        Ok(Response::EntriesPlus(plus))
    }

    /// Changes of the namespace, under the state lock.
    fn handle_change(&self, request: Request) -> Result<Response, FsError> {
        let st = lock(&self.state);
        let link = matches!(request, Request::Link { .. });
        if let Request::SetXattr { name, value, .. } = &request {
            if name == proto::REPLICAS_XATTR {
                let want = proto::parse_replicas(value)?;
                let live = st.live.ids().len();
                if want > live {
                    return Err(FsError::Invalid(format!(
                        "{} {want} needs {want} data servers, but {live} are live",
                        proto::REPLICAS_XATTR
                    )));
                }
            }
        }
        let (response, effects) =
            change_namespace(&self.store, request, |ino: Ino| st.open.is_open(ino))?;
        drop(st);
        self.registry.zero_and_recycle(effects.freed);
        Ok(match response {
            // The linked inode may be open: its size is its control block's.
            Response::Attr(attr) if link => Response::Attr(self.live_attr(attr)),
            response => response,
        })
    }

    /// Requests about one file: its attributes, opening and releasing it, its lock state and
    /// record locks.
    fn handle_file(
        &self,
        session: u64,
        request: Request,
        expires: Option<Instant>,
    ) -> Result<Response, FsError> {
        Ok(match request {
            Request::SetAttr { ino, set, caller } => {
                Response::Attr(self.set_attr(ino, &set, caller, expires)?)
            }
            Request::Open { ino, scheme } => Response::Open(self.open(session, ino, scheme)?),
            Request::Create {
                parent,
                name,
                perm,
                caller,
                scheme,
            } => {
                let attr = {
                    let _st = lock(&self.state);
                    self.store
                        .mknod(parent, &name, FileKind::File, perm, 0, caller)?
                };
                Response::Open(self.open(session, attr.ino, scheme)?)
            }
            Request::Release { ino } => {
                let mut st = lock(&self.state);
                let effects = self.release_locked(&mut st, session, ino)?;
                drop(st);
                // Record locks stay: the client gives them back itself (at the closes, and
                // keeps the same account to take them back after a restart), and the session's
                // end gives back whatever is left.
                self.registry.zero_and_recycle(effects.freed);
                Response::Ok
            }
            Request::Fsync { ino } => {
                lock(&self.state).persist_fcb(&self.store, ino)?;
                self.store.flush()?;
                Response::Ok
            }
            Request::AllocateLockWords { ino, words } => {
                Response::Addr(self.allocate_lock_words(ino, words)?)
            }
            Request::GetLk {
                ino,
                owner,
                start,
                end,
                kind,
            } => {
                self.lock_calls.count(ino);
                let who = proto::records::Owner { session, owner };
                Response::RecordLock(self.records.conflict(ino, who, start, end, kind)?)
            }
            Request::SetLk {
                ino,
                claim,
                wait_ms,
                reclaim,
            } => {
                self.lock_calls.count(ino);
                let wait = Duration::from_millis(u64::from(wait_ms));
                self.records.set(session, ino, &claim, wait, reclaim)?;
                Response::Ok
            }
            other => return Err(Self::misrouted(&other)),
        })
    }

    /// `SetAttr`: changes the attributes of `ino` and publishes them (and a new size in its
    /// FCB) before the answer; a shrink's tail is zeroed once durable, its chunks recycled.
    fn set_attr(
        &self,
        ino: Ino,
        set: &SetAttr,
        caller: proto::Caller,
        expires: Option<Instant>,
    ) -> Result<Attr, FsError> {
        let mut guard = lock(&self.state);
        self.check_expiry(expires)?;
        let st = &mut *guard;
        let old_size = st.open.fcb_word(&mut st.region, ino, fcb::SIZE);
        let previous = match old_size {
            Some(size) => size,
            None => self.store.getattr(ino)?.size,
        };
        if let Some(size) = set.size.filter(|&size| size < previous) {
            st.live.check_tail_reachable(&self.store, ino, size)?;
        }
        let (attr, effects) = self.store.setattr(ino, set, caller, old_size)?;
        if let Some(size) = set.size {
            // Published first (generation, then size), then the bytes a growth exposes zeroed.
            st.open.publish_size(&mut st.region, &attr, size)?;
            st.live.zero_grown(&self.store, attr.ino, previous, size)?;
        }
        let attr = st.open.publish_setattr(&mut st.region, attr, set)?;
        drop(guard);
        // The client holds the whole-file lock until this answer: nobody writes the tail
        // meanwhile.
        for tail in effects.tails {
            if let Err(error) = self.registry.zero_tail(&self.state, &self.store, tail) {
                tracing::warn!(?tail, %error, "truncated chunk's tail not zeroed yet");
            }
        }
        self.registry.zero_and_recycle(effects.freed);
        Ok(attr)
    }

    /// Requests about a file's chunks.
    fn handle_chunks(
        &self,
        request: Request,
        expires: Option<Instant>,
    ) -> Result<Response, FsError> {
        Ok(match request {
            Request::ChunkMap { ino, first, count } => {
                // Not while replicas are being dropped (`drop_replicas_on`).
                let _gate = self
                    .chunk_gate
                    .read()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                Response::Chunks(self.store.chunk_map(ino, first, count)?)
            }
            Request::AllocateChunks {
                ino,
                generation,
                first,
                count,
            } => {
                #[cfg(feature = "test-hooks")]
                self.churn_before_allocation(ino);
                let replicas = self.store.replicas_of(ino, self.settings.replicas)?;
                let locs = self.registry.allocate_waiting(|| {
                    let st = lock(&self.state);
                    let servers = st.live.ids();
                    if servers.is_empty() && count > 0 {
                        return Err(FsError::Unavailable(
                            "no data server is connected to allocate chunks on".into(),
                        ));
                    }
                    if replicas > 1 {
                        // A server that is away only makes new chunks short of a replica
                        // (docs/REPLICAS.md); a cluster that never had enough is an error.
                        let known = self.store.servers()?.len();
                        if replicas > known {
                            return Err(FsError::Invalid(format!(
                                "inode {ino} wants {replicas} replicas of each chunk, but the \
                                 cluster has {known} data servers"
                            )));
                        }
                    }
                    self.store
                        .allocate_chunks(ino, generation, first, count, &servers, replicas)
                })?;
                Response::Chunks(locs.into_iter().map(Some).collect())
            }
            Request::FreeChunks { ino, first, count } => {
                let mut st = lock(&self.state);
                self.check_expiry(expires)?;
                let (attr, effects) = self.store.free_chunks_in(ino, first, count)?;
                if !effects.freed.is_empty() {
                    // While the caller still holds the range lock over the freed chunks.
                    let st = &mut *st;
                    st.open.publish_generation(&mut st.region, &attr)?;
                }
                drop(st);
                // Zeroed and recycled once the free is durable, as a truncate's chunks are.
                self.registry.zero_and_recycle(effects.freed);
                Response::Ok
            }
            other => return Err(Self::misrouted(&other)),
        })
    }

    // ---- checks and reports -----------------------------------------------------------------

    /// Runs the consistency checker ([`crate::fsck`]) holding the state lock, so that no
    /// namespace change, chunk allocation or recycling runs between its scans. Locks are
    /// inspected when the caller says nothing is in flight (`at_rest`) or no session but the
    /// caller's is connected. Chunks freed by repairs are zeroed and recycled afterwards.
    /// Replicas are compared (and with `repair` made to agree) first, by
    /// [`Self::check_replicas`], mostly without the state lock.
    fn fsck(&self, session: u64, options: FsckOptions) -> Result<FsckReport, FsError> {
        // Replicas first, on their own reads of the database: what the namespace repairs
        // below free is not compared.
        let replicas = self.check_replicas(session, options)?;
        let mut st = lock(&self.state);
        let others = st.sessions.others_than(session);
        let at_rest = options.at_rest || others == 0;
        let state = std::cell::RefCell::new(&mut *st);
        let live = || {
            let mut st = state.borrow_mut();
            let st = &mut **st;
            let open = st
                .open
                .inos()
                .into_iter()
                .map(|ino| (ino, st.open.fcb_word(&mut st.region, ino, fcb::SIZE)))
                .collect();
            crate::fsck::Live { open, at_rest }
        };
        let locks = |reset: bool| {
            if !at_rest {
                return (Vec::new(), 0, Vec::new());
            }
            self.check_locks(&state.borrow().open, reset)
        };
        let (mut report, freed) = crate::fsck::run(&self.store, options, live, locks)?;
        report.counts.replicated_chunks = replicas.outcome.compared;
        report.counts.under_replicated = replicas.outcome.under_replicated;
        report.replicas_not_compared = replicas.not_compared;
        let outcome = replicas.outcome;
        if options.repair && !outcome.findings.is_empty() {
            report.repairs.extend(outcome.repairs);
            let remaining = report.remaining.get_or_insert_with(Vec::new);
            remaining.extend(outcome.remaining);
            remaining.truncate(MAX_FINDINGS);
        }
        let room = MAX_FINDINGS.saturating_sub(report.findings.len());
        report.truncated += outcome.findings.len().saturating_sub(room) as u64;
        report
            .findings
            .extend(outcome.findings.into_iter().take(room));
        report.counts.sessions = others as u64;
        report.counts.open_files = st.open.len() as u64;
        if !report.repairs.is_empty() {
            // Repairs may change entries the table holds: take it afresh from the database.
            let st = &mut *st;
            st.published.fill_entries(&mut st.region, &self.store)?;
        }
        drop(st);
        if !report.repairs.is_empty() {
            tracing::warn!(
                repairs = report.repairs.len(),
                "fsck repaired the namespace"
            );
        }
        self.registry.zero_and_recycle(freed);
        if options.repair && report.counts.under_replicated > 0 {
            if let Err(error) = self.rereplicate_for_fsck(&mut report) {
                // What it did not do stays in `remaining`.
                tracing::warn!(%error, "fsck --repair: re-replication failed");
            }
        }
        Ok(report)
    }

    /// The consistency checker's replica checks ([`crate::replica_check`]): files open
    /// nowhere are compared; open files only `at_rest` and where their lock inspects at rest;
    /// the others are listed as not compared.
    ///
    /// In two passes, so that reading every replica of a large namespace does not hold the
    /// state lock (every metadata call, and the data servers' registrations, wait for it; a
    /// check that held it for 15 s once made the meta server believe every data server gone):
    /// 1. without the state lock, on a snapshot of the database taken under it, every chunk
    ///    is compared (never repaired). Meanwhile a file may be opened and written, or a chunk
    ///    freed and its block given to another file, so a difference found here is only a
    ///    candidate;
    /// 2. under the state lock, on a fresh snapshot, the candidates alone are compared again
    ///    (and with `repair` made to agree) where their files are still at rest, and the
    ///    under-replicated chunks counted. No file can be opened meanwhile.
    fn check_replicas(&self, session: u64, options: FsckOptions) -> Result<ReplicaChecks, FsError> {
        let layout = self.store.layout();
        let factor = |ino| self.store.replicas_of(ino, self.settings.replicas);
        let (image, live, skip) = {
            let st = lock(&self.state);
            let at_rest = options.at_rest || st.sessions.others_than(session) == 0;
            (
                self.store.image()?,
                st.live.id_set(),
                self.replica_skip(&st, at_rest),
            )
        };
        let mut io = crate::registry::ReplicaEndpoints::looked_up(&self.state, layout.unit());
        let first = crate::replica_check::check(
            &image,
            layout,
            &crate::replica_check::Scope {
                live: &live,
                skip: &skip,
                only: None,
                piece: crate::replica_check::PIECE,
                repair: false,
            },
            factor,
            &mut io,
        )?;
        drop(io);
        let candidates: HashSet<(Ino, u64)> = first
            .findings
            .iter()
            .filter_map(|f| match *f {
                Finding::ReplicasDiffer { ino, chunk, .. } => Some((ino, chunk)),
                _ => None,
            })
            .collect();
        let st = lock(&self.state);
        let at_rest = options.at_rest || st.sessions.others_than(session) == 0;
        let image = self.store.image()?;
        let live = st.live.id_set();
        let skip_now = self.replica_skip(&st, at_rest);
        let mut io = st.live.replica_io(layout.unit());
        let mut outcome = crate::replica_check::check(
            &image,
            layout,
            &crate::replica_check::Scope {
                live: &live,
                skip: &skip_now,
                only: Some(&candidates),
                piece: crate::replica_check::PIECE,
                repair: options.repair,
            },
            factor,
            &mut io,
        )?;
        drop(io);
        drop(st);
        outcome.compared = first.compared;
        let mut failed = first.failed;
        failed.append(&mut outcome.failed);
        outcome.failed = failed;
        // Only the files that have chunks of several replicas are worth saying.
        let mut per_chunk: HashMap<(Ino, u64), usize> = HashMap::new();
        for &(ino, chunk, _) in &image.chunks {
            *per_chunk.entry((ino, chunk)).or_default() += 1;
        }
        let replicated: HashSet<Ino> = per_chunk
            .into_iter()
            .filter(|&(_, n)| n > 1)
            .map(|((ino, _), _)| ino)
            .collect();
        let candidate_files: HashSet<Ino> = candidates.iter().map(|&(ino, _)| ino).collect();
        let mut not_compared = skip;
        for (ino, why) in skip_now {
            if candidate_files.contains(&ino) {
                not_compared.entry(ino).or_insert(why);
            }
        }
        let not_compared = not_compared
            .into_iter()
            .filter(|(ino, _)| replicated.contains(ino))
            .chain(
                outcome
                    .failed
                    .iter()
                    .map(|(ino, why)| (*ino, format!("a replica could not be read: {why}"))),
            )
            .take(MAX_FINDINGS)
            .collect();
        Ok(ReplicaChecks {
            outcome,
            not_compared,
        })
    }

    /// The files whose replicas the checker must not compare now, and why: with `at_rest`,
    /// those whose lock is held (or cannot be inspected); otherwise every open file.
    fn replica_skip(&self, st: &State, at_rest: bool) -> BTreeMap<Ino, String> {
        let mut skip: BTreeMap<Ino, String> = BTreeMap::new();
        if at_rest {
            let (findings, _, _) = self.check_locks(&st.open, false);
            for finding in findings {
                if let Some(ino) = finding.ino() {
                    skip.insert(
                        ino,
                        "its range lock is held (or cannot be inspected)".into(),
                    );
                }
            }
        } else {
            for ino in st.open.inos() {
                skip.insert(
                    ino,
                    "it is open and clients are active (no --at-rest): its lock may be held".into(),
                );
            }
        }
        skip
    }

    /// Inspects the lock of every open file, at rest (no client holds or waits): what is busy
    /// is a dead client's. With `reset`, resets such locks to rest instead. The findings, the
    /// locks looked at, and the repairs made.
    fn check_locks(&self, open: &OpenFiles, reset: bool) -> (Vec<Finding>, u64, Vec<Repair>) {
        let (mut findings, mut inspected, mut repairs) = (Vec::new(), 0, Vec::new());
        for (ino, lock) in open.locks() {
            inspected += 1;
            let endpoint = Box::new(LocalEndpoint::new(Arc::new(OwnRegion(self.region.clone()))));
            let scheme = lock.scheme.to_string();
            if reset {
                match schemes::reset_to_rest(lock, endpoint) {
                    Ok(Some(words)) if !words.is_empty() => repairs.push(Repair::ResetLock {
                        ino,
                        scheme,
                        words: words.iter().map(|b| b.to_string()).collect(),
                    }),
                    Ok(_) => {}
                    Err(error) => tracing::warn!(ino, %error, "fsck could not reset a lock"),
                }
                continue;
            }
            match schemes::inspect(lock, endpoint) {
                Ok(Some(busy)) if !busy.is_empty() => findings.push(Finding::LockNotAtRest {
                    ino,
                    scheme,
                    busy: busy.iter().take(16).map(|b| b.to_string()).collect(),
                }),
                Ok(_) => {}
                Err(e) => findings.push(Finding::LockUnreadable {
                    ino,
                    scheme,
                    error: e.to_string(),
                }),
            }
        }
        (findings, inspected, repairs)
    }

    /// What a status report is made of ([`crate::status`]), taken under the state lock, so
    /// that sessions, open files and data servers are of one moment.
    fn status_facts(&self) -> Result<crate::status::Facts, FsError> {
        use crate::status::{Facts, ServerFacts};
        let st = lock(&self.state);
        let dirty = crate::registry::dirty_units(&self.store)?;
        let mut servers = Vec::new();
        for record in self.store.servers()? {
            servers.push(ServerFacts {
                incarnation: self.store.incarnation(record.id)?,
                live: st.live.is_live(record.id),
                dirty_units: dirty.get(&record.id).copied().unwrap_or(0),
                record,
            });
        }
        let sessions = st.sessions.facts();
        let open = st.open.facts(&self.lock_calls);
        drop(st);
        Ok(Facts {
            cluster: self.settings.credentials.cluster.clone(),
            started: self.started,
            state_dir: self.settings.state_dir.display().to_string(),
            fabric: self.settings.meta_fabric.to_string(),
            requests: self.request_count(),
            inodes: self.store.inode_count()?,
            chunk_size: self.settings.chunk_size,
            session_lease: self.settings.session_lease,
            fence_after: self.settings.fence_after,
            layout: self.store.layout(),
            database: self.store.progress(),
            servers,
            sessions,
            fenced: self.fences.revoked_count(),
            open,
            rereplication: self.rereplication_status(),
        })
    }

    /// Space and inodes in layout units (`df`'s blocks): every registered server's region,
    /// and what no file holds (free, never used, or freed and being zeroed). Read under the
    /// state lock, so that no allocation runs between the scans and the figures add up.
    fn statfs(&self) -> Result<FsStats, FsError> {
        let _st = lock(&self.state);
        let layout = self.store.layout();
        let max = layout.max_order();
        let dirty = crate::registry::dirty_units(&self.store)?;
        let servers = self.store.servers()?;
        let free_blocks: u64 = servers
            .iter()
            .map(|s| s.unallocated_units(max, dirty.get(&s.id).copied().unwrap_or(0)))
            .sum();
        Ok(FsStats {
            block_size: layout.unit(),
            total_blocks: servers.iter().map(|s| s.chunks << max).sum(),
            free_blocks,
            inodes: self.store.inode_count()?,
            free_inodes: free_blocks,
        })
    }

    /// Counts every request from now on in `metrics` (the first call wins).
    pub(crate) fn set_metrics(&self, metrics: crate::metrics::RequestMetrics) {
        let _ = self.metrics.set(metrics);
    }

    /// The cluster's status now, as `citronfs status` gets it (for the metrics' collector).
    pub(crate) fn status_now(&self) -> Result<proto::status::ClusterStatus, FsError> {
        Ok(crate::status::report(
            self.status_facts()?,
            0,
            Instant::now(),
        ))
    }

    /// Client requests handled since start, heartbeats excepted.
    pub fn request_count(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Nanoseconds spent handling those requests.
    pub fn request_nanos(&self) -> u64 {
        self.request_ns.load(Ordering::Relaxed)
    }

    /// Bytes of the meta region not in use (for tests and reports).
    pub fn meta_free_bytes(&self) -> u64 {
        lock(&self.state).region.free_bytes()
    }
}

/// Runs a change of the namespace ([`Group::Change`](proto::rpc::Group::Change)) on `store`,
/// `is_open` saying which inodes are open: what the service runs under its state lock
/// (`Service::handle_change`), and the fuzzer (`rpc::fuzz_entry`) against a store alone.
pub(crate) fn change_namespace(
    store: &Store,
    request: Request,
    is_open: impl Fn(Ino) -> bool,
) -> Result<(Response, Effects), FsError> {
    let attr = |attr: Result<Attr, FsError>| Ok((Response::Attr(attr?), Effects::default()));
    let done = |r: Result<(), FsError>| r.map(|()| (Response::Ok, Effects::default()));
    match request {
        Request::Mknod {
            parent,
            name,
            kind,
            perm,
            rdev,
            caller,
        } => attr(store.mknod(parent, &name, kind, perm, rdev, caller)),
        Request::Mkdir {
            parent,
            name,
            perm,
            caller,
        } => attr(store.mkdir(parent, &name, perm, caller)),
        Request::Symlink {
            parent,
            name,
            target,
            caller,
        } => attr(store.symlink(parent, &name, &target, caller)),
        Request::Link {
            ino,
            new_parent,
            new_name,
        } => attr(store.link(ino, new_parent, &new_name)),
        Request::Unlink { parent, name } => {
            Ok((Response::Ok, store.unlink(parent, &name, is_open)?))
        }
        Request::Rmdir { parent, name } => done(store.rmdir(parent, &name)),
        Request::Rename {
            parent,
            name,
            new_parent,
            new_name,
            no_replace,
            exchange,
        } => {
            let effects = match (exchange, no_replace) {
                (false, _) => {
                    store.rename(parent, &name, new_parent, &new_name, no_replace, is_open)?
                }
                (true, true) => {
                    return Err(FsError::Invalid(
                        "RENAME_EXCHANGE and RENAME_NOREPLACE exclude each other".into(),
                    ))
                }
                (true, false) => store.exchange(parent, &name, new_parent, &new_name)?,
            };
            Ok((Response::Ok, effects))
        }
        Request::SetXattr {
            ino,
            name,
            value,
            mode,
        } => done(store.setxattr(ino, &name, &value, mode)),
        Request::RemoveXattr { ino, name } => done(store.removexattr(ino, &name)),
        other => Err(Service::misrouted(&other)),
    }
}
