//! The meta server's logic, independent of the transport: sessions, data servers, open files
//! (file control blocks and lock state in the meta region), and every request.
//!
//! # Locking
//! One mutex, [`Service::state`], serializes every namespace mutation together with the open-file
//! table, the sessions and the live data servers. That makes the pre-transaction scans in
//! [`Store`] exact and keeps "is this inode open?" consistent with unlink. Reads of the namespace
//! (lookup, readdir, xattrs, chunk maps) do not take it. Long fabric work (zeroing freed chunks)
//! runs after the state lock is released, on the server's own endpoint mutex.

use crate::alloc::RegionAlloc;
use crate::store::{Block, Effects, Store, Tail};
use fabric::local::{LocalEndpoint, RegionSource};
use fabric::{Connector, Endpoint, EndpointExt, Region, RegionId, RemoteAddr};
use lockmgr::baselines::SegSpec;
use lockmgr::citron::scheme::{duration_ms, duration_us};
use lockmgr::citron::{CitronDefaults, CitronGrowth};
use lockmgr::schemes::{self, CreateOptions, LockMemory, LockServer, LockServerAt};
use lockmgr::{CitronConfig, LockError, LockRef, LockScheme};
use proto::attrs::{AttrSlot, AttrTableRef};
use proto::fcb;
use proto::fsck::{Finding, FsckOptions, FsckReport, Repair};
use proto::rpc::{Request, Response};
use proto::{
    Attr, ChunkLoc, ClusterInfo, DataServerInfo, FabricAddr, FileKind, FsError, FsStats, Ino,
    OpenFile, SetAttr,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The meta region's id on the meta server.
pub const META_REGION: RegionId = RegionId(0);

/// Bytes at the start of the meta region never handed out (a null address stays invalid).
const RESERVED: u64 = 64;

/// A lock tree covers at least this many bytes of a file when it is created (it scales up).
const MIN_LOCK_COVER: u64 = 1 << 20;

/// The meta server's own access to its region, without going through any fabric.
pub(crate) struct OwnRegion(pub Arc<Region>);

impl RegionSource for OwnRegion {
    fn resolve(&self, id: RegionId) -> Option<Arc<Region>> {
        (id == self.0.id()).then(|| self.0.clone())
    }
    fn generation(&self) -> u64 {
        0
    }
    fn backend(&self) -> &'static str {
        "meta-local"
    }
}

/// The meta region as memory for a lock's state: allocations come from the region's allocator
/// and are remembered, so that a creation that fails gives them back.
struct MetaLockMemory<'a> {
    st: &'a mut State,
    taken: Option<LockAlloc>,
}

impl LockMemory for MetaLockMemory<'_> {
    fn endpoint(&mut self) -> &mut dyn Endpoint {
        &mut self.st.endpoint
    }

    fn allocate(&mut self, bytes: u64) -> Result<RemoteAddr, LockError> {
        let offset = self
            .st
            .alloc
            .alloc(bytes)
            .ok_or(LockError::NoSpace { bytes })?;
        self.taken = Some(LockAlloc { offset, bytes });
        Ok(Service::meta_addr(offset))
    }
}

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
    /// The database's directory (`MetaConfig::db_dir`), for a status report.
    pub state_dir: std::path::PathBuf,
    /// The first session id of this run ([`first_session_id`]): every session of this run is
    /// numbered from it, and the meta region's fabric server refuses those below it.
    pub first_session: u64,
    /// When this run is a restart: when every lock lease of the earlier run has run out (its
    /// start plus `lock_lease`). A data server whose backend cannot refuse the earlier run's
    /// sessions (shm, mem) is made live no sooner ([`Service::register_data_server`]).
    pub earlier_leases_until: Option<Instant>,
}

struct Session {
    /// Where it comes from, for a status report.
    origin: crate::status::Origin,
    /// When it opened.
    opened: Instant,
    last_seen: Instant,
    /// Until when a `Fence` revokes this session even though it speaks again: it was silent
    /// for longer than `fence_after` before it last spoke (see [`Service::fence_targets`]).
    resumed_until: Option<Instant>,
    open: HashSet<Ino>,
}

/// One lock-state allocation in the meta region.
#[derive(Clone, Copy)]
struct LockAlloc {
    offset: u64,
    bytes: u64,
}

/// One open file's lock of one scheme: what clients open, and the memory it holds.
#[derive(Clone, Copy)]
struct FileLock {
    lock: LockRef,
    /// Bytes from `lock.base` (0: none, e.g. a lock at a lock service).
    bytes: u64,
}

struct OpenState {
    /// The FCB's offset in the meta region.
    fcb: u64,
    /// The file's lock, made by its first open. Invariant: every open of the file, by every
    /// session, is under this lock's scheme name (`Service::open` refuses another while it is
    /// open), so that every read and write of the file takes this lock: locks of two schemes
    /// would not exclude each other. By name rather than by the requested description: an
    /// opener asking other parameters of the same scheme gets this lock, as created.
    lock: FileLock,
    /// Memory handed out for CITRON scale-ups.
    extra: Vec<LockAlloc>,
    /// Sessions that have it open.
    sessions: HashSet<u64>,
}

struct LiveServer {
    /// Which connection registered it; a stale connection closing does not unregister it.
    epoch: u64,
    region: RegionId,
    endpoint: Arc<Mutex<Box<dyn Endpoint>>>,
}

struct State {
    sessions: HashMap<u64, Session>,
    next_session: u64,
    next_epoch: u64,
    open: HashMap<Ino, OpenState>,
    alloc: RegionAlloc,
    live: BTreeMap<u32, LiveServer>,
    /// The meta server's endpoint on its own region.
    endpoint: LocalEndpoint<OwnRegion>,
    /// The attribute table in the meta region ([`proto::attrs`]); `None` when the region had
    /// no room for it.
    attrs: Option<AttrTable>,
    /// The directory-entry table in the meta region ([`proto::dentries`]); `None` when the
    /// region had no room for it.
    dentries: Option<crate::dentries::DentryTable>,
}

/// How long after a silence longer than `fence_after` a session that speaks again stays a
/// fence's target ([`Service::fence_targets`]): twice fs-client's lease guard of
/// `2·fence_after`, i.e. `4·fence_after` (400 ms by default; `T_lease` must exceed it).
fn resumed_window(fence_after: Duration) -> Duration {
    4 * fence_after
}

/// The attribute table and the next version to publish (see [`proto::attrs`]).
struct AttrTable {
    table: AttrTableRef,
    next_version: u64,
}

/// Most slots of the attribute table: 12 MiB of 192-byte slots; never more than an eighth of
/// the meta region (FCBs and lock trees need the rest).
const MAX_ATTR_SLOTS: u64 = 1 << 16;

/// Most slots of the directory-entry table: 8 MiB of 256-byte slots (about 400,000 short names
/// held); never more than an eighth of the meta region.
const MAX_DENTRY_SLOTS: u64 = 1 << 15;

/// How long an allocation that found no free chunk waits for the reclaimer to recycle the
/// chunks freed before it.
const RECLAIM_WAIT: Duration = Duration::from_secs(5);

/// How long a `Fence` waits for the data servers to apply a revocation (their long poll
/// answers at once; this covers a data server that is slow or going away).
pub(crate) const FENCE_WAIT: Duration = Duration::from_secs(3);

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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves the state as consistent as sled left it; keep
    // serving rather than poisoning every later request.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The meta server's state and request handlers.
pub(crate) struct Service {
    pub settings: Settings,
    store: Store,
    /// The meta region, for the consistency checker's own endpoint on the lock words.
    region: Arc<Region>,
    state: Mutex<State>,
    lock_server: Option<Arc<LockServer>>,
    /// Set when the meta server itself is stopping: connections it closes are then expected,
    /// not news worth a warning.
    stopping: std::sync::atomic::AtomicBool,
    /// Sessions fenced so far, and which data servers apply them.
    fences: Mutex<Fences>,
    /// Signalled when a data server applies an epoch or goes away (a `Fence` waits on it).
    fence_acked: Condvar,
    /// `Fences::epoch`, watched by the data servers' long polls (sent under the `fences` lock,
    /// so it never goes backwards).
    fence_epoch: tokio::sync::watch::Sender<u64>,
    /// Revokes sessions on the meta server's own fabric server (tcp); unset on shm.
    local_revoke: std::sync::OnceLock<RevokeFn>,
    /// [`ClusterInfo::layout_epoch`]: bumped by every registration and disconnection of a data
    /// server.
    layout_epoch: std::sync::atomic::AtomicU64,
    /// Client requests handled since start, heartbeats excepted (they come by the clock, not
    /// by the file system's work): what
    /// `citronfs bench meta` divides by its operations to show RPCs per operation.
    requests: std::sync::atomic::AtomicU64,
    /// Nanoseconds spent handling those requests (from the handler's start to its answer, the
    /// state lock's waits included; not the transport's): what `citronfs bench meta` shows as
    /// the server's share of an operation.
    request_ns: std::sync::atomic::AtomicU64,
    /// Per request kind metrics, once registered (`MetaHandle::register_metrics`).
    metrics: std::sync::OnceLock<crate::metrics::RequestMetrics>,
    /// Freed chunks on their way to being zeroed and recycled ([`crate::reclaim`]).
    reclaimer: crate::reclaim::Reclaimer,
    /// One mutex per data server name, held across each registration of that server
    /// ([`Service::register_data_server`]): see "Registrations of one server never overlap"
    /// there.
    registering: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// POSIX record locks (`fcntl`), cluster-wide (`proto::records::Table`).
    records: Mutex<proto::records::Table>,
    /// Signalled whenever record locks are given back or cut back (an `SetLk` waiting for a
    /// conflicting lock waits on it).
    records_changed: Condvar,
    /// When the service started, for a status report.
    started: Instant,
    /// Per open file, the lock requests about it that came as RPCs (`GetLk`, `SetLk`,
    /// `AllocateLockWords`, hosted scale-ups), for a status report: an entry is made when the
    /// file is first opened and goes when it is no longer open (under the state lock both).
    /// Under a mutex of its own, so that counting takes no state lock; taken after the state
    /// lock where both are held.
    lock_calls: Mutex<HashMap<Ino, u64>>,
    /// Tests: runs inside a scrub, after the free chunks were listed and before they are zeroed.
    #[cfg(test)]
    pub(crate) scrub_hook: Mutex<Option<Arc<dyn Fn() + Send + Sync>>>,
}

/// Revokes client sessions on one fabric server.
pub(crate) type RevokeFn = Box<dyn Fn(&[u64]) + Send + Sync>;

/// The fencing state (CITRON §3.10, "the CM notifies the lock server to destroy the QPs
/// of the failed clients"; docs/ARCHITECTURE.md "Fencing").
///
/// Invariant: a `Fence` is answered only after every data server registered now has applied an
/// epoch at least as new as the fence's, so from then on no fabric server that holds file data
/// or lock words executes a batch of a revoked session.
#[derive(Default)]
struct Fences {
    /// Bumped by every fence that revokes something.
    epoch: u64,
    /// Every session revoked since this meta server started, with the epoch that revoked it.
    revoked: Vec<(u64, u64)>,
    /// Per registered data server (by id): its registration's connection epoch, and the fence
    /// epoch it has applied. Entries come and go with registrations.
    applied: HashMap<u32, (u64, u64)>,
    /// The latest sessions that ended whose client process the kernel named (the local
    /// socket's peer credentials), at most [`ENDED_PIDS_KEPT`]: where the fabric cannot fence
    /// (shm), a lock waiter may break a holder of one of them once that process is gone
    /// ([`Service::holder_gone`]).
    ended_pids: std::collections::VecDeque<(u64, u32)>,
}

/// How many ended sessions' process ids [`Fences::ended_pids`] keeps.
const ENDED_PIDS_KEPT: usize = 4096;

/// Whether process `pid` (of this server's pid namespace) has exited: no such process, or a
/// zombie waiting to be reaped. A process that is still there, or whose state cannot be read,
/// is not gone. A pid reused by another process since reads as not gone: the lease decides.
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "pid (comm) S ...": the state follows the last ')' (comm may hold one).
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| matches!(state, 'Z' | 'X')),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

impl Fences {
    /// The data servers that have not applied `epoch` yet.
    fn behind(&self, epoch: u64) -> Vec<u32> {
        self.applied
            .iter()
            .filter(|(_, &(_, applied))| applied < epoch)
            .map(|(&id, _)| id)
            .collect()
    }
}

impl Service {
    pub fn new(
        settings: Settings,
        store: Store,
        region: Arc<Region>,
        lock_server: Option<Arc<LockServer>>,
    ) -> anyhow::Result<Self> {
        let first_session = settings.first_session;
        let len = region.len();
        anyhow::ensure!(
            len >= RESERVED + 4 * fcb::FCB_BYTES,
            "meta region of {len} bytes is too small"
        );
        let mut alloc = RegionAlloc::new(RESERVED, len);
        let slots = (len / 8 / proto::attrs::SLOT_BYTES).min(MAX_ATTR_SLOTS);
        let attrs = (slots > 0)
            .then(|| alloc.alloc(slots * proto::attrs::SLOT_BYTES))
            .flatten()
            .map(|offset| AttrTable {
                table: AttrTableRef {
                    base: Self::meta_addr(offset),
                    slots,
                },
                // Above every version of an earlier run (see `proto::attrs`).
                next_version: first_session.saturating_mul(1024),
            });
        let dentry_slots = (len / 8 / proto::dentries::SLOT_BYTES).min(MAX_DENTRY_SLOTS);
        let dentry_table = (dentry_slots > 0)
            .then(|| alloc.alloc(dentry_slots * proto::dentries::SLOT_BYTES))
            .flatten()
            .map(|offset| proto::dentries::DentryTableRef {
                base: Self::meta_addr(offset),
                slots: dentry_slots,
            });
        let service = Service {
            settings,
            store,
            region: region.clone(),
            state: Mutex::new(State {
                sessions: HashMap::new(),
                // Session ids never repeat across restarts: the data servers' fabric servers
                // remember revoked sessions for their own lifetime.
                next_session: first_session,
                next_epoch: 1,
                open: HashMap::new(),
                alloc,
                live: BTreeMap::new(),
                endpoint: LocalEndpoint::new(Arc::new(OwnRegion(region))),
                attrs,
                dentries: None,
            }),
            lock_server,
            stopping: std::sync::atomic::AtomicBool::new(false),
            fences: Mutex::new(Fences::default()),
            fence_acked: Condvar::new(),
            fence_epoch: tokio::sync::watch::channel(0).0,
            local_revoke: std::sync::OnceLock::new(),
            layout_epoch: std::sync::atomic::AtomicU64::new(1),
            requests: std::sync::atomic::AtomicU64::new(0),
            request_ns: std::sync::atomic::AtomicU64::new(0),
            metrics: std::sync::OnceLock::new(),
            reclaimer: crate::reclaim::Reclaimer::default(),
            registering: Mutex::new(HashMap::new()),
            records: Mutex::new(proto::records::Table::default()),
            records_changed: Condvar::new(),
            started: Instant::now(),
            lock_calls: Mutex::new(HashMap::new()),
            #[cfg(test)]
            scrub_hook: Mutex::new(None),
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
        service.store.take_entry_changes();
        if let Some(table) = dentry_table {
            let mut st = lock(&service.state);
            let entries = service.store.all_entries()?;
            let filled = crate::dentries::DentryTable::new(table, entries, &mut st.endpoint)?;
            st.dentries = Some(filled);
        }
        Ok(service)
    }

    fn meta_addr(offset: u64) -> RemoteAddr {
        RemoteAddr::new(META_REGION, offset)
    }

    // ---- sessions ---------------------------------------------------------------------------

    /// Opens a client session from `origin` and describes the cluster to it.
    pub fn open_session(&self, origin: crate::status::Origin) -> Result<ClusterInfo, FsError> {
        let mut st = lock(&self.state);
        if st.sessions.len() >= self.settings.max_sessions {
            return Err(FsError::TooManySessions {
                limit: self.settings.max_sessions as u64,
            });
        }
        let session = st.next_session;
        st.next_session += 1;
        st.sessions.insert(
            session,
            Session {
                origin,
                opened: Instant::now(),
                last_seen: Instant::now(),
                resumed_until: None,
                open: HashSet::new(),
            },
        );
        drop(st);
        self.cluster_info(session)
    }

    /// The layout epoch ([`ClusterInfo::layout_epoch`]).
    pub fn layout_epoch(&self) -> u64 {
        self.layout_epoch.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Says that the data servers' layout changed: clients fetch it again at their next
    /// heartbeat.
    fn layout_changed(&self) {
        self.layout_epoch
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// The cluster as session `session` sees it now.
    ///
    /// The epoch is read before the layout, so a change racing with this call moves the epoch
    /// past the one returned and the client asks again.
    fn cluster_info(&self, session: u64) -> Result<ClusterInfo, FsError> {
        let layout_epoch = self.layout_epoch();
        let (live, attr_table, dentry_table) = {
            let st = lock(&self.state);
            let live: HashSet<u32> = st.live.keys().copied().collect();
            (
                live,
                st.attrs.as_ref().map(|a| a.table),
                st.dentries.as_ref().map(|d| d.table),
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
            lock_server: self.lock_server.as_ref().map(|s| s.addr().to_string()),
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
        let Some(s) = st.sessions.remove(&session) else {
            return;
        };
        let mut freed = Vec::new();
        for ino in s.open {
            match self.release_locked(&mut st, session, ino) {
                Ok(effects) => freed.extend(effects.freed),
                Err(error) => tracing::warn!(session, ino, %error, "release at session end"),
            }
        }
        self.publish_touched(&mut st);
        drop(st);
        // Its record locks go too; the `SetLk`s waiting for them are woken.
        if lock(&self.records).drop_session(session) {
            self.records_changed.notify_all();
        }
        self.revoke_ended(session, s.origin.peer_pid);
        self.zero_and_recycle(freed);
    }

    /// Longest an `SetLk` waits here for a conflicting lock before it answers `WouldBlock`,
    /// whatever it asked: its client calls again, so that a waiter's signal reaches it (and a
    /// blocking-pool thread is not held) for longer than this.
    const SETLK_WAIT_MOST: Duration = Duration::from_secs(1);

    /// How long a waiter's wait still counts for deadlock detection after its call answered
    /// (`proto::records::Table::wait`): it calls again at once, so this only bridges the gap;
    /// a waiter that stopped (a signal) may cause a false EDEADLK within it.
    const SETLK_WAIT_GAP: Duration = Duration::from_millis(500);

    /// `SetLk` (see `proto::rpc::Request::SetLk`). A new lock asked during the grace period
    /// after a restart is answered `InGrace` (the client asks again a little later, so that it
    /// holds nothing of its own meanwhile while taking its locks back), so that no lock is
    /// granted over one its holder is still to take back.
    fn set_record_lock(
        &self,
        session: u64,
        ino: Ino,
        claim: &proto::records::RecordClaim,
        wait: Duration,
        reclaim: bool,
    ) -> Result<(), FsError> {
        if !reclaim
            && claim.kind.is_some()
            && Instant::now() < self.settings.record_lock_grace_until
        {
            return Err(FsError::InGrace);
        }
        let mut table = lock(&self.records);
        // A client's locks take the meta server's memory: bounded, as its open files are.
        let limit = self.settings.max_record_locks_per_session;
        if claim.kind.is_some() && table.held_by(session) >= limit {
            return Err(FsError::NoLocks {
                limit: limit as u64,
            });
        }
        let until = Instant::now() + wait.min(Self::SETLK_WAIT_MOST);
        let mut waiting = false;
        loop {
            let frees = table.frees(ino, session, claim);
            match table.set(ino, session, claim) {
                Ok(()) => {
                    drop(table);
                    // Only an unlock or a write lock turned read may free bytes someone waits
                    // for; waking every waiter at every grant was a herd of wake-ups.
                    if frees {
                        self.records_changed.notify_all();
                    }
                    return Ok(());
                }
                Err(_) => {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(FsError::WouldBlock);
                    }
                    if !std::mem::replace(&mut waiting, true) {
                        // A waiter calls again as soon as this answers: its wait counts
                        // across the gap.
                        let lasts = until + Self::SETLK_WAIT_GAP;
                        if table.wait(ino, session, claim, lasts).is_err() {
                            return Err(FsError::Deadlock);
                        }
                    }
                    table = self
                        .records_changed
                        .wait_timeout(table, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }

    /// Revokes an ended session on the meta server's fabric server and, through the next
    /// revocation poll, on every data server; a later fence waits for its epoch like its own.
    ///
    /// `pid`: the ended client's process as the kernel named it (`Origin::peer_pid`), kept in
    /// [`Fences::ended_pids`] for [`Service::holder_gone`].
    fn revoke_ended(&self, session: u64, pid: Option<u32>) {
        let mut f = lock(&self.fences);
        if let Some(pid) = pid {
            if f.ended_pids.len() >= ENDED_PIDS_KEPT {
                f.ended_pids.pop_front();
            }
            f.ended_pids.push_back((session, pid));
        }
        if f.revoked.iter().any(|&(_, s)| s == session) {
            return;
        }
        self.revoke(&mut f, &[session]);
    }

    /// Revokes `sessions` under a new fence epoch, which it returns: on this server's own
    /// fabric server at once, on the data servers through their revocation poll (a caller that
    /// must know they refuse them waits with [`Service::await_fence_epoch`]).
    fn revoke(&self, f: &mut Fences, sessions: &[u64]) -> u64 {
        f.epoch += 1;
        let epoch = f.epoch;
        f.revoked
            .extend(sessions.iter().map(|&session| (epoch, session)));
        if let Some(revoke) = self.local_revoke.get() {
            revoke(sessions);
        }
        self.fence_epoch.send_replace(epoch);
        epoch
    }

    /// Ends every session whose lease ran out; returns how many.
    pub fn expire_sessions(&self) -> usize {
        let expired = self.silent_sessions(self.settings.session_lease);
        for &session in &expired {
            tracing::info!(session, "session lease expired");
            self.end_session(session);
        }
        expired.len()
    }

    // ---- fencing ---------------------------------------------------------------------------

    /// Installs the function that revokes sessions on the meta server's own fabric server.
    pub fn set_local_revoke(&self, revoke: RevokeFn) {
        let _ = self.local_revoke.set(revoke);
    }

    /// The sessions not heard from for longer than `silence`.
    fn silent_sessions(&self, silence: Duration) -> Vec<u64> {
        lock(&self.state)
            .sessions
            .iter()
            .filter(|(_, s)| s.last_seen.elapsed() > silence)
            .map(|(&id, _)| id)
            .collect()
    }

    /// The sessions a `Fence` revokes now: those silent for longer than `fence_after`, and
    /// those that spoke again after such a silence less than [`resumed_window`] ago.
    ///
    /// Why the second set: a client stopped past its lease (SIGSTOP, a frozen VM) between its
    /// lease check and its post resumes with both threads runnable at once — its heartbeat and
    /// the stale post. When the heartbeat reaches us first, the client is no longer silent, yet
    /// the post is still on its way; a breaker fencing at that moment (its patience ran out
    /// just after the resume) would revoke nothing and then take the lock, and the stale post
    /// would land after the breaker's write. (Seen as a torn record in
    /// `crates/tests/tests/pause.rs`, about two runs in three of the full suite.) A live
    /// thread's check-to-post takes less than fs-client's guard of `2·fence_after` (the
    /// assumption the guard rests on); right after a resume every thread of the process
    /// competes for the CPU, so the window is twice that: [`resumed_window`]. The cost: a client
    /// whose heartbeat stalled for `fence_after` (a starved host) is fenced by a fence within
    /// that window — and fences happen only when some holder's lease ran out.
    /// The fencing session itself (`caller`, just heard from) is never a target: it breaks a
    /// lock of someone else's.
    fn fence_targets(&self, caller: u64) -> Vec<u64> {
        let now = Instant::now();
        lock(&self.state)
            .sessions
            .iter()
            .filter(|&(&id, s)| {
                id != caller
                    && (now.saturating_duration_since(s.last_seen) > self.settings.fence_after
                        || s.resumed_until.is_some_and(|until| now < until))
            })
            .map(|(&id, _)| id)
            .collect()
    }

    /// Revokes every session a fence must ([`Service::fence_targets`]: silent for longer than
    /// `fence_after`, or recently back from such a silence; never `caller`) and returns once no fabric server
    /// executes their batches any more (the [`Fences`] invariant), or fails after `wait` if a
    /// data server does not acknowledge.
    ///
    /// Why silence is the right test: a client posts data verbs only while its lock's lease has
    /// more than `2·fence_after` left (fs-client's guard), and a lock is broken only after its
    /// lease ran out. So a holder that can still land a write after the break must have
    /// stopped between its check and its post for at least `2·fence_after`, its heartbeat
    /// thread with it (a stopped or frozen process): it is silent here, or has just come back
    /// from such a silence. A live client that is merely slow keeps heartbeating and is
    /// protected by its own lease check instead.
    pub fn fence(&self, caller: u64, wait: Duration) -> Result<(), FsError> {
        let silent = self.fence_targets(caller);
        let mut f = lock(&self.fences);
        if !silent.is_empty() {
            let epoch = self.revoke(&mut f, &silent);
            tracing::warn!(sessions = ?silent, epoch, "fencing silent sessions: a lock they may hold is being broken");
        } else {
            tracing::info!(
                "fence: no session silent for {:?} or just back from such a silence; nothing to revoke",
                self.settings.fence_after
            );
        }
        let epoch = f.epoch;
        drop(f);
        for &session in &silent {
            self.end_session(session);
        }
        self.await_fence_epoch(epoch, wait)
    }

    /// Whether the lock holder whose session ends in `owner` (its low 48 bits, as a lock
    /// tree's owner record keeps it) is out for good: it can land no verb on any fabric server
    /// any more (`lockmgr::Fence::holder_gone`).
    ///
    /// Where the fabric cannot fence (shm), a process that maps the memory cannot be kept out:
    /// a holder is gone only when its session ended and its process is gone too, as the
    /// kernel names it (a client of the local socket, [`Fences::ended_pids`]); otherwise the
    /// lease rule decides. Where it can (tcp):
    ///
    /// - A session that ended (its connection closed, its lease ran out, a fence) was revoked
    ///   then ([`Service::revoke_ended`]): `true` once every data server applied that
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
        let named = |session: u64| session & lockmgr::citron::layout::OWNER_ID == owner;
        if named(caller) {
            return Ok(false);
        }
        if self.local_revoke.get().is_none() {
            let pid = lock(&self.fences)
                .ended_pids
                .iter()
                .rev()
                .find(|&&(session, _)| named(session))
                .map(|&(_, pid)| pid);
            return Ok(pid.is_some_and(process_gone));
        }
        let live = {
            let st = lock(&self.state);
            st.sessions
                .iter()
                .find(|(&id, _)| named(id))
                .map(|(&id, s)| (id, s.last_seen.elapsed()))
        };
        let epoch = match live {
            Some((id, silent)) => {
                if !stopped || silent <= self.settings.fence_after {
                    return Ok(false);
                }
                let epoch = self.revoke(&mut lock(&self.fences), &[id]);
                tracing::warn!(
                    session = id,
                    epoch,
                    ?silent,
                    "fencing a silent session: a lock-tree node it holds is being broken"
                );
                self.end_session(id);
                epoch
            }
            None => {
                let f = lock(&self.fences);
                match f.revoked.iter().find(|&&(_, s)| named(s)) {
                    Some(&(epoch, _)) => epoch,
                    // Not a session of this run's: nothing known, the lease decides.
                    None => return Ok(false),
                }
            }
        };
        self.await_fence_epoch(epoch, wait)?;
        Ok(true)
    }

    /// Waits until every registered data server has applied fence epoch `epoch` (the
    /// [`Fences`] invariant), or fails after `wait`.
    fn await_fence_epoch(&self, epoch: u64, wait: Duration) -> Result<(), FsError> {
        let deadline = Instant::now() + wait;
        let mut f = lock(&self.fences);
        loop {
            let behind = f.behind(epoch);
            if behind.is_empty() {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FsError::Io(format!(
                    "fence epoch {epoch}: data servers {behind:?} did not acknowledge within {wait:?}"
                )));
            }
            f = self
                .fence_acked
                .wait_timeout(f, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The data server registered as `id` on connection `conn` has applied fence epochs up to
    /// `known`.
    pub fn fence_applied(&self, id: u32, conn: u64, known: u64) {
        let mut f = lock(&self.fences);
        if let Some(entry) = f.applied.get_mut(&id).filter(|(c, _)| *c == conn) {
            entry.1 = known;
            self.fence_acked.notify_all();
        }
    }

    /// The revocation epoch to watch, for a data server's long poll.
    pub fn fence_watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.fence_epoch.subscribe()
    }

    /// The current fence epoch, and the sessions revoked after epoch `known`.
    pub fn revocations_since(&self, known: u64) -> (u64, Vec<u64>) {
        let f = lock(&self.fences);
        let sessions = f
            .revoked
            .iter()
            .filter(|&&(epoch, _)| epoch > known)
            .map(|&(_, session)| session)
            .collect();
        (f.epoch, sessions)
    }

    /// Renews a session's lease; `Stale` if it is gone (expired). A session heard from after a
    /// silence longer than `fence_after` stays a fence's target for [`resumed_window`]
    /// ([`Service::fence_targets`]). Only a request's arrival (`arrival`) can end a silence:
    /// the renewal after a request that ran long (its own `Fence` waits for the data servers)
    /// is no sign of a stopped client.
    fn touch(&self, session: u64, arrival: bool) -> Result<(), FsError> {
        match lock(&self.state).sessions.get_mut(&session) {
            Some(s) => {
                let now = Instant::now();
                let silence = now.saturating_duration_since(s.last_seen);
                if arrival && silence > self.settings.fence_after {
                    tracing::info!(
                        session,
                        ?silence,
                        "session heard from again after a silence: still fenceable for a while"
                    );
                    s.resumed_until = Some(now + resumed_window(self.settings.fence_after));
                }
                s.last_seen = now;
                Ok(())
            }
            None => Err(FsError::Stale),
        }
    }

    // ---- data servers -----------------------------------------------------------------------

    /// Registers a data server (by its stable name) and connects to its region; returns its id
    /// and the connection epoch to pass to [`Service::data_server_gone`].
    ///
    /// # Nothing is zeroed under a live server's clients
    /// Every zeroing a registration does to chunks that may hold file data — the scrub of free
    /// chunks after an unclean shutdown, the tails of truncates left unzeroed — happens
    /// *before* the server is live (in `State::live`, so in the layout clients see and among
    /// the servers chunks are allocated on), so no client write to the server can land before
    /// it and be zeroed by it. (Dirty chunks are no file's: they go to the reclaimer.)
    ///
    /// # Registrations of one server never overlap
    /// A data server killed during its registration (a scrub takes seconds for a large
    /// region) and started again registers again while the first registration still runs. The
    /// two are serialized by the server's name: otherwise the second, finding the scrub not
    /// done yet, scrubs from its own list of free chunks while the first one makes the server
    /// live — zeroing chunks that clients were meanwhile allocated and wrote (a soak lost
    /// acknowledged data this way).
    pub fn register_data_server(
        &self,
        name: &str,
        fabric: FabricAddr,
        region: RegionId,
        region_bytes: u64,
        incarnation: u64,
    ) -> Result<(u32, u64), FsError> {
        if name.is_empty() {
            return Err(FsError::Invalid("a data server needs a name".into()));
        }
        let chunks = region_bytes / self.settings.chunk_size;
        if chunks == 0 {
            return Err(FsError::Invalid(format!(
                "a region of {region_bytes} bytes holds no chunk of {} bytes",
                self.settings.chunk_size
            )));
        }
        let one_at_a_time = lock(&self.registering)
            .entry(name.to_owned())
            .or_default()
            .clone();
        let _registering = lock(&one_at_a_time);
        let mut endpoint = self.connect_fabric(&fabric)?;
        // Before anything is zeroed or allocated there: clients of an earlier run of this
        // server that have not noticed the restart may still hold chunk locations the crash
        // forgot (allocations it rolled back), and their writes would land in chunks that the
        // scrub below zeroes and this run hands to other files (a soak found a record slot
        // holding another file's bytes); and a write of theirs still under a lock of the
        // earlier run would meet writers under this run's locks. From now on the data server
        // refuses their sessions, and no batch of theirs is still executing (tcp); where it
        // cannot refuse, the earlier run's leases are waited out instead.
        let fenced =
            fabric::procedure::raise_session_floor(&mut *endpoint, self.settings.first_session)?;
        if !fenced {
            // Nothing can be refused here (shm: clients map the region themselves), so time
            // does it: an earlier run's client posts a write's verbs only while its lock's lease
            // has some time left (fs-client's `io`), and every such lease ran out by then.
            if let Some(wait) = self
                .settings
                .earlier_leases_until
                .and_then(|until| until.checked_duration_since(Instant::now()))
            {
                tracing::info!(
                    name,
                    ?wait,
                    "waiting out the earlier run's lock leases before the data server is used"
                );
                std::thread::sleep(wait);
            }
        }
        let (record, lost) = {
            // Serialized with allocations (the lost-chunk scan must be exact).
            let _st = lock(&self.state);
            self.store
                .register_server(name, &fabric, region, chunks, incarnation)?
        };
        if self.store.needs_scrub(record.id)? {
            // Before it is live, so nothing is allocated on it meanwhile.
            self.scrub(&mut *endpoint, region, record.id)?;
        }
        // Tails of truncates a crash (or this server's absence) left unzeroed: before it is
        // live, so no write extending such a file lands there first.
        let tails: Vec<Tail> = self
            .store
            .tails()?
            .into_iter()
            .filter(|tail| tail.block.loc.server == record.id)
            .collect();
        // After one flush: the truncates that left them are durable.
        let flushed = if tails.is_empty() {
            Ok(())
        } else {
            self.store.flush()
        };
        for tail in tails {
            let (loc, from, to) = self.tail_bytes(&tail);
            let zeroed = flushed.clone().and_then(|()| {
                self.zero_in_block(&mut *endpoint, region, loc, from, to)?;
                self.store.tail_zeroed(loc)
            });
            if let Err(error) = zeroed {
                tracing::warn!(?tail, %error, "cannot zero a truncated chunk's tail yet");
            }
        }
        let mut st = lock(&self.state);
        if lost > 0 {
            tracing::error!(
                name,
                id = record.id,
                lost,
                "data server came back with new memory (a new incarnation): its chunks are \
                 lost; reads of them fail with EIO, `citronfs fsck` lists the files"
            );
        }
        let epoch = st.next_epoch;
        st.next_epoch += 1;
        st.live.insert(
            record.id,
            LiveServer {
                epoch,
                region,
                endpoint: Arc::new(Mutex::new(endpoint)),
            },
        );
        drop(st);
        // From now on a fence waits for this server too; it has applied no epoch yet.
        lock(&self.fences).applied.insert(record.id, (epoch, 0));
        self.layout_changed();
        tracing::info!(
            name,
            id = record.id,
            chunks,
            ?fabric,
            "data server registered"
        );
        // Chunks freed while it was away are zeroed now that it is reachable.
        let dirty: Vec<Block> = self
            .store
            .dirty_chunks()?
            .into_iter()
            .filter(|b| b.loc.server == record.id)
            .collect();
        self.zero_and_recycle(dirty);
        Ok((record.id, epoch))
    }

    /// Zeroes every free block of data server `id` (after an unclean shutdown, see `store`):
    /// allocations the crash rolled back left data in blocks now free again.
    fn scrub(&self, ep: &mut dyn Endpoint, region: RegionId, id: u32) -> Result<(), FsError> {
        let mut free = self.store.free_chunks_of(id)?;
        free.sort_unstable();
        #[cfg(test)]
        {
            let hook = lock(&self.scrub_hook).clone();
            if let Some(hook) = hook {
                hook();
            }
        }
        let unit = self.store.layout().unit();
        let started = Instant::now();
        let mut i = 0;
        while i < free.len() {
            // One range per run of adjacent blocks.
            let (start, mut end) = (free[i].0, free[i].0 + free[i].1);
            let mut j = i + 1;
            while j < free.len() && free[j].0 == end {
                end += free[j].1;
                j += 1;
            }
            zero_range(ep, region, start * unit, end * unit)?;
            i = j;
        }
        self.store.scrubbed(id)?;
        tracing::info!(
            id,
            chunks = free.len(),
            elapsed = ?started.elapsed(),
            "zeroed the free chunks of a data server after an unclean shutdown"
        );
        Ok(())
    }

    /// Marks the service as stopping: connections closed from now on are expected.
    pub fn begin_shutdown(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// A data server's registration connection closed.
    pub fn data_server_gone(&self, id: u32, epoch: u64) {
        {
            // A fence no longer waits for it (its fabric server is gone with it, or it will
            // register again and be sent every revocation from epoch 0).
            let mut f = lock(&self.fences);
            if f.applied.get(&id).is_some_and(|(conn, _)| *conn == epoch) {
                f.applied.remove(&id);
                self.fence_acked.notify_all();
            }
        }
        let mut st = lock(&self.state);
        if st.live.get(&id).is_some_and(|s| s.epoch == epoch) {
            st.live.remove(&id);
            self.layout_changed();
            if self.stopping.load(std::sync::atomic::Ordering::Relaxed) {
                tracing::info!(id, "data server connection closed at shutdown");
            } else {
                tracing::warn!(id, "data server disconnected");
            }
        }
    }

    fn connect_fabric(&self, fabric: &FabricAddr) -> Result<Box<dyn Endpoint>, FsError> {
        Ok(fabric::connect(fabric, &self.settings.credentials, 0)?.connect()?)
    }

    /// Zeroes bytes `from..to` of the block at `loc` with one-sided writes, through the live
    /// server's endpoint.
    fn zero_chunk(&self, loc: ChunkLoc, from: u64, to: u64) -> Result<(), FsError> {
        self.with_live_endpoint(loc.server, |ep, region| {
            self.zero_in_block(ep, region, loc, from, to)
        })
    }

    /// Runs `f` with live data server `server`'s endpoint (locked) and region.
    fn with_live_endpoint<T>(
        &self,
        server: u32,
        f: impl FnOnce(&mut dyn Endpoint, RegionId) -> Result<T, FsError>,
    ) -> Result<T, FsError> {
        let (endpoint, region) = {
            let st = lock(&self.state);
            let live = st
                .live
                .get(&server)
                .ok_or_else(|| FsError::Io(format!("data server {server} is not connected")))?;
            (live.endpoint.clone(), live.region)
        };
        let mut ep = lock(&endpoint);
        f(&mut **ep, region)
    }

    /// Zeroes bytes `from..to` of the block at `loc` through `ep` to `region`.
    fn zero_in_block(
        &self,
        ep: &mut dyn Endpoint,
        region: RegionId,
        loc: ChunkLoc,
        from: u64,
        to: u64,
    ) -> Result<(), FsError> {
        let base = loc.index * self.store.layout().unit();
        zero_range(ep, region, base + from, base + to)
    }

    /// A shrink of `ino` to `size` leaves bytes of its last chunk to zero (a tail); refuses it
    /// (`Unavailable`, which the client retries) while that chunk's data server is away. A
    /// tail left to zero later would be zeroed when the server registers again, and on shm a
    /// client that has not noticed the server's absence yet can still write to its region:
    /// data written past the new size meanwhile would be zeroed then. Called under the state
    /// lock, which registrations and departures take too.
    fn check_tail_reachable(&self, st: &State, ino: Ino, size: u64) -> Result<(), FsError> {
        let (chunk, from) = self.store.layout().locate(size);
        if from == 0 {
            return Ok(());
        }
        match self.store.chunk_at(ino, chunk)? {
            Some(loc) if !st.live.contains_key(&loc.server) => Err(FsError::Unavailable(format!(
                "data server {} holds the last chunk of the truncated file and is away",
                loc.server
            ))),
            _ => Ok(()),
        }
    }

    /// Hands freed blocks (their free has committed) to the reclaimer thread, which zeroes
    /// them once the free is durable and returns them to their servers' free stacks
    /// ([`crate::reclaim`]); a block whose server is away stays dirty until it registers again.
    fn zero_and_recycle(&self, freed: Vec<Block>) {
        self.reclaimer.push(freed);
    }

    /// The reclaimer thread's loop (started by `MetaServer::start`): one flush, then zeroing
    /// and recycling, per batch; returns once stopped and drained.
    pub fn run_reclaimer(&self) {
        let unit = self.store.layout().unit();
        while let Some(batch) = self.reclaimer.next_batch() {
            crate::reclaim::reclaim_batch(
                &batch,
                || self.store.flush(),
                |Block { loc, .. }| {
                    // A block queued twice (freed, and listed again by its server's
                    // registration while still dirty) was recycled by the first pass and may
                    // be a file's again: zero only what is still dirty. This thread is the
                    // only one that takes blocks out of the dirty set, so a block dirty here
                    // stays dirty (no file's) until it recycles it below.
                    let Some(order) = self.store.dirty_order(loc)? else {
                        return Ok(());
                    };
                    self.zero_chunk(loc, 0, unit << order)?;
                    // Under the state lock like every other allocation change, so that the
                    // consistency checker never sees a chunk between the dirty set and the
                    // free stack.
                    let _st = lock(&self.state);
                    self.store.recycle(loc)
                },
            );
            self.reclaimer.done();
        }
    }

    /// Stops the reclaimer thread once it has drained its queue.
    pub fn stop_reclaimer(&self) {
        self.reclaimer.stop();
    }

    /// Waits up to `timeout` for the reclaimer to have nothing queued; whether it is idle.
    pub fn reclaimer_idle(&self, timeout: Duration) -> bool {
        self.reclaimer.wait_idle(timeout)
    }

    /// Zeroes the tail of a chunk a shrinking truncate left (`Effects::tail`), once the
    /// truncate is durable; a tail whose server is away is zeroed when it registers again.
    fn zero_tail(&self, tail: Tail) -> Result<(), FsError> {
        self.store.flush()?;
        let (loc, from, to) = self.tail_bytes(&tail);
        self.zero_chunk(loc, from, to)?;
        self.store.tail_zeroed(loc)
    }

    /// The block of `tail` and the bytes of it to zero.
    fn tail_bytes(&self, tail: &Tail) -> (ChunkLoc, u64, u64) {
        let Block { loc, order } = tail.block;
        (loc, tail.from, self.store.layout().unit() << order)
    }

    // ---- the attribute table -----------------------------------------------------------------

    /// Rewrites the slots of `inos` from the database (clearing those of deleted inodes),
    /// with the FCB of open files. Called with the state lock held, after the change is
    /// committed and before it is answered (the invariants of [`proto::attrs`]).
    fn publish(&self, st: &mut State, inos: impl IntoIterator<Item = Ino>) {
        let State {
            attrs,
            open,
            endpoint,
            ..
        } = st;
        let Some(attrs) = attrs.as_mut() else {
            return;
        };
        for ino in inos {
            let addr = attrs.table.slot_addr(ino);
            let bytes = match self.store.getattr(ino) {
                Ok(attr) => {
                    attrs.next_version += 1;
                    let slot = AttrSlot {
                        version: attrs.next_version,
                        fcb: open.get(&ino).map_or(0, |o| o.fcb),
                        attr,
                    };
                    proto::attrs::encode(&slot)
                }
                Err(_) => None,
            };
            let bytes = match bytes {
                Some(bytes) => bytes,
                None => {
                    // Deleted (or unencodable): clear the slot if it is this inode's, so that
                    // readers fall back; a colliding inode's slot stays.
                    let mine = endpoint
                        .read(addr, proto::attrs::SLOT_BYTES as usize)
                        .is_ok_and(|held| proto::attrs::decode(&held, ino).is_some());
                    if !mine {
                        continue;
                    }
                    vec![0u8; proto::attrs::SLOT_BYTES as usize]
                }
            };
            if let Err(error) = endpoint.write(addr, &bytes) {
                tracing::warn!(ino, %error, "cannot publish attributes");
            }
        }
    }

    /// Publishes every inode and directory entry committed transactions touched since the
    /// last call.
    fn publish_touched(&self, st: &mut State) {
        let touched = self.store.take_touched();
        self.publish(st, touched);
        let changes = self.store.take_entry_changes();
        if let Some(table) = st.dentries.as_mut() {
            if !changes.is_empty() {
                table.apply(changes, &mut st.endpoint);
            }
        }
    }

    /// Holds `parent/name` in the entry table if it was only counted there (a lookup by RPC
    /// found it, so that the next one is one-sided); checked against the database under the
    /// state lock, after every committed change is applied.
    fn fill_entry(&self, parent: Ino, name: &str) {
        let mut st = lock(&self.state);
        if st.dentries.is_none() || proto::rpc::is_dot(name) {
            return;
        }
        self.publish_touched(&mut st);
        if let Ok(Some(ino)) = self.store.entry_ino(parent, name) {
            let State {
                dentries, endpoint, ..
            } = &mut *st;
            if let Some(table) = dentries.as_mut() {
                table.fill(parent, name, ino, endpoint);
            }
        }
    }

    /// Rebuilds the entry table from the database (after repairs).
    fn refill_entries(&self, st: &mut State) -> Result<(), FsError> {
        let Some(table) = st.dentries.as_ref().map(|d| d.table) else {
            return Ok(());
        };
        self.store.take_entry_changes();
        let entries = self.store.all_entries()?;
        st.dentries = Some(crate::dentries::DentryTable::new(
            table,
            entries,
            &mut st.endpoint,
        )?);
        Ok(())
    }

    /// Publishes `ino` unless its slot holds it already (a stat or lookup by RPC fills the
    /// table, so the next one is one-sided).
    fn fill(&self, ino: Ino) {
        let mut st = lock(&self.state);
        let Some(attrs) = st.attrs.as_ref() else {
            return;
        };
        let addr = attrs.table.slot_addr(ino);
        if st
            .endpoint
            .read(addr, proto::attrs::SLOT_BYTES as usize)
            .is_ok_and(|held| proto::attrs::decode(&held, ino).is_some())
        {
            return;
        }
        self.publish(&mut st, [ino]);
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
        lock(&self.records).waiters()
    }

    /// `MetaHandle::release_in_every_session`.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn release_in_every_session(&self, ino: Ino) -> usize {
        let sessions: Vec<u64> = lock(&self.state)
            .open
            .get(&ino)
            .map(|open| open.sessions.iter().copied().collect())
            .unwrap_or_default();
        for &session in &sessions {
            let _ = self.handle_by(session, vec![ino], Request::Cluster, None);
        }
        sessions.len()
    }

    /// `MetaHandle::damage_fcb_word`.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn damage_fcb_word(&self, ino: Ino, word: u64, value: u64) -> Option<u64> {
        let mut st = lock(&self.state);
        let addr = Self::meta_addr(st.open.get(&ino)?.fcb + word);
        let old = st.endpoint.read_u64(addr).ok()?;
        st.endpoint.write_u64(addr, value).ok()?;
        Some(old)
    }

    fn fcb_word(st: &mut State, ino: Ino, word: u64) -> Option<u64> {
        let off = st.open.get(&ino)?.fcb;
        st.endpoint.read_u64(Self::meta_addr(off + word)).ok()
    }

    /// SIZE and MTIME of open file `ino`'s FCB, in one read of the words from SIZE to MTIME
    /// (each word atomic; every release and live attribute reads both); `None` when it is not
    /// open here or the read failed.
    fn fcb_size_and_mtime(st: &mut State, ino: Ino) -> Option<(u64, u64)> {
        const _: () = assert!(fcb::MTIME > fcb::SIZE);
        let off = st.open.get(&ino)?.fcb;
        let len = (fcb::MTIME + 8 - fcb::SIZE) as usize;
        let words = st
            .endpoint
            .read(Self::meta_addr(off + fcb::SIZE), len)
            .ok()?;
        let word = |at: u64| {
            let i = (at - fcb::SIZE) as usize;
            u64::from_le_bytes(words[i..i + 8].try_into().expect("8 bytes"))
        };
        Some((word(fcb::SIZE), word(fcb::MTIME)))
    }

    /// The attributes of an open file as its FCB corrects them (`fcb::live`: size, data
    /// times); others' as they are.
    fn live_attr(&self, attr: Attr) -> Attr {
        let mut st = lock(&self.state);
        Self::live_locked(&mut st, attr)
    }

    fn live_locked(st: &mut State, attr: Attr) -> Attr {
        match Self::fcb_size_and_mtime(st, attr.ino) {
            Some((size, mtime)) => fcb::live(attr, size, mtime),
            None => attr,
        }
    }

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
        if scheme.uses_service() && self.lock_server.is_none() {
            return Err(FsError::NotSupported);
        }
        let st = &mut *st;
        if let Some(open) = st.open.get(&ino) {
            let open_with = open.lock.lock.scheme.name();
            if open_with != scheme.name() {
                tracing::warn!(
                    session,
                    ino,
                    open_with,
                    asked = scheme.name(),
                    "open refused: the file is open under another lock scheme"
                );
                return Err(FsError::SchemeInUse {
                    open_with: open_with.to_string(),
                    asked: scheme.name().to_string(),
                });
            }
        }
        // Checked before anything is allocated for the file; a file the session has open
        // already does not count again.
        if let Some(s) = st.sessions.get(&session) {
            if !s.open.contains(&ino) && s.open.len() >= self.settings.max_open_per_session {
                tracing::warn!(
                    session,
                    limit = self.settings.max_open_per_session,
                    "open refused: the session has too many files open"
                );
                return Err(FsError::TooManyOpen {
                    limit: self.settings.max_open_per_session as u64,
                });
            }
        }
        if !st.open.contains_key(&ino) {
            let off = st.alloc.alloc(fcb::FCB_BYTES).ok_or(FsError::NoSpace)?;
            let mut block = [0u8; fcb::FCB_BYTES as usize];
            block[fcb::INO as usize..][..8].copy_from_slice(&ino.to_le_bytes());
            block[fcb::SIZE as usize..][..8].copy_from_slice(&attr.size.to_le_bytes());
            block[fcb::GENERATION as usize..][..8].copy_from_slice(&attr.generation.to_le_bytes());
            // MTIME starts at 0: the database's times are the truth until a write.
            block[fcb::MODE as usize..][..8].copy_from_slice(&u64::from(attr.perm).to_le_bytes());
            if let Err(e) = st.endpoint.write(Self::meta_addr(off), &block) {
                st.alloc.free(off, fcb::FCB_BYTES);
                return Err(e.into());
            }
            // No FCB is left behind for a file nobody managed to open: freed as
            // `free_open_state` frees one, INO cleared.
            let lock = self.create_lock(st, &scheme, attr.size).inspect_err(|_| {
                let _ = st.endpoint.write_u64(Self::meta_addr(off + fcb::INO), 0);
                st.alloc.free(off, fcb::FCB_BYTES);
            })?;
            st.open.insert(
                ino,
                OpenState {
                    fcb: off,
                    lock,
                    extra: Vec::new(),
                    sessions: HashSet::new(),
                },
            );
            self::lock(&self.lock_calls).insert(ino, 0);
            // Readers of the table now take the size from the FCB.
            self.publish(st, [ino]);
        }
        let fcb_off = st.open[&ino].fcb;
        let size = Self::fcb_word(st, ino, fcb::SIZE).unwrap_or(attr.size);
        let open = st.open.get_mut(&ino).expect("present");
        open.sessions.insert(session);
        let lock = open.lock.lock;
        if let Some(s) = st.sessions.get_mut(&session) {
            s.open.insert(ino);
        }
        let mut attr = attr;
        attr.size = size;
        Ok(OpenFile {
            attr,
            fcb: Self::meta_addr(fcb_off),
            lock,
        })
    }

    /// Creates the lock of `scheme` for a file of `size` bytes in the meta region, with what
    /// `scheme` leaves open decided here ([`Service::lock_defaults`]).
    fn create_lock(
        &self,
        st: &mut State,
        scheme: &LockScheme,
        size: u64,
    ) -> Result<FileLock, FsError> {
        // Clients keep 2 × fence_after of every lease as a guard before posting data verbs
        // (`MetaConfig::validate` holds our own lease to the same bound).
        if scheme
            .lease()
            .is_some_and(|lease| lease <= 4 * self.settings.fence_after)
        {
            return Err(FsError::Invalid(format!(
                "lock scheme {scheme}: the lease must exceed 4 × fence_after ({:?})",
                self.settings.fence_after
            )));
        }
        let options = self.lock_defaults(size);
        let mut memory = MetaLockMemory { st, taken: None };
        match schemes::create(scheme, &options, &mut memory) {
            Ok(created) => Ok(FileLock {
                lock: created.lock,
                bytes: created.bytes,
            }),
            Err(e) => {
                if let Some(taken) = memory.taken {
                    memory.st.alloc.free(taken.offset, taken.bytes);
                }
                Err(match e {
                    LockError::NoSpace { .. } => FsError::NoSpace,
                    LockError::Fabric(e) => {
                        FsError::Io(format!("cannot create {scheme} lock: {e}"))
                    }
                    e => FsError::Invalid(format!("lock scheme {scheme}: {e}")),
                })
            }
        }
    }

    /// What the meta server decides for a file's lock where the opener's description leaves it
    /// open: a CITRON tree covering the file (at least [`MIN_LOCK_COVER`]), growing as far as
    /// [`CitronConfig::default`] allows from scale-up memory this server hands out
    /// (`AllocateLockWords`), with the cluster's `T_lease` and `T_wait`; `seg` as lockmgr cuts it;
    /// a scheme that keeps its locks at a lock service on this server's lock server.
    fn lock_defaults(&self, size: u64) -> CreateOptions {
        CreateOptions {
            citron: CitronDefaults {
                unit_count: size.max(MIN_LOCK_COVER).div_ceil(self.settings.lock_unit),
                max_unit_count: CitronConfig::default().max_unit_count,
                growth: CitronGrowth::Allocator,
                lease_ms: duration_ms(self.settings.lock_lease),
                t_wait_us: duration_us(self.settings.t_wait),
            },
            seg: SegSpec::DEFAULT,
            lock_server: self.lock_server.as_ref().map(|server| LockServerAt {
                addr: server.addr(),
                credentials: server.credentials().clone(),
            }),
        }
    }

    fn free_open_state(st: &mut State, open: OpenState) {
        // Clear the INO word so that a client holding a stale FCB address notices.
        let _ = st
            .endpoint
            .write_u64(Self::meta_addr(open.fcb + fcb::INO), 0);
        st.alloc.free(open.fcb, fcb::FCB_BYTES);
        let lock = LockAlloc {
            offset: open.lock.lock.base.offset,
            bytes: open.lock.bytes,
        };
        for lock in std::iter::once(lock).chain(open.extra) {
            if lock.bytes > 0 {
                st.alloc.free(lock.offset, lock.bytes);
            }
        }
    }

    /// Persists what an open file's FCB holds (size, data-change time) into the database.
    fn persist_fcb_size(&self, st: &mut State, ino: Ino) -> Result<(), FsError> {
        if let Some((size, mtime)) = Self::fcb_size_and_mtime(st, ino) {
            self.store.persist_live(ino, size, mtime)?;
        }
        Ok(())
    }

    /// `session` drops `ino`: persists its size; the last opener frees the FCB and lock state
    /// (and deletes the inode if it was unlinked meanwhile).
    fn release_locked(&self, st: &mut State, session: u64, ino: Ino) -> Result<Effects, FsError> {
        if let Some(s) = st.sessions.get_mut(&session) {
            s.open.remove(&ino);
        }
        let Some(open) = st.open.get_mut(&ino) else {
            return Ok(Effects::default());
        };
        if !open.sessions.remove(&session) {
            return Ok(Effects::default());
        }
        let last = open.sessions.is_empty();
        self.persist_fcb_size(st, ino)?;
        if !last {
            return Ok(Effects::default());
        }
        let open = st.open.remove(&ino).expect("present");
        lock(&self.lock_calls).remove(&ino);
        Self::free_open_state(st, open);
        self.publish(st, [ino]);
        let mut effects = self.store.delete_orphan(ino)?;
        // Nobody has it open now: chunks beyond its size can only be a dead writer's, which
        // allocated them but never raised the size (`Store::free_beyond_size`).
        if effects.freed.is_empty() {
            effects = self.store.free_beyond_size(ino)?;
        }
        Ok(effects)
    }

    /// Persists every open file's size (clean shutdown) and flushes the database.
    pub fn persist_all(&self) -> Result<(), FsError> {
        let mut st = lock(&self.state);
        let inos: Vec<Ino> = st.open.keys().copied().collect();
        for ino in inos {
            self.persist_fcb_size(&mut st, ino)?;
        }
        drop(st);
        self.store.mark_clean()
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
        let kind = crate::requests::kind(&request);
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
            self.requests
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.request_ns.fetch_add(
                start.elapsed().as_nanos() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        result
    }

    fn handle_timed(
        &self,
        session: u64,
        request: Request,
        expires: Option<Instant>,
    ) -> Result<Response, FsError> {
        self.touch(session, true)?;
        self.check_expiry(expires)?;
        let changes = crate::requests::traits(&request).changes_inodes;
        let result = self.handle_touched(session, request, expires);
        if changes {
            // Before the answer: a client that saw it reads the change one-sidedly.
            let mut st = lock(&self.state);
            self.publish_touched(&mut st);
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

    fn handle_touched(
        &self,
        session: u64,
        request: Request,
        expires: Option<Instant>,
    ) -> Result<Response, FsError> {
        let is_open = |st: &State, ino: Ino| st.open.contains_key(&ino);
        Ok(match request {
            Request::Heartbeat => Response::Heartbeat {
                layout_epoch: self.layout_epoch(),
            },
            Request::Cluster => Response::Cluster(Box::new(self.cluster_info(session)?)),
            Request::Fence => {
                self.fence(session, FENCE_WAIT)?;
                Response::Ok
            }
            Request::HolderGone { owner, stopped } => {
                Response::Gone(self.holder_gone(session, owner, stopped, FENCE_WAIT)?)
            }
            Request::Fsck(options) => Response::Fsck(self.fsck(session, options)?),
            Request::Status => Response::Status(Box::new(crate::status::report(
                self.status_facts()?,
                session,
                Instant::now(),
            ))),
            Request::AwaitRevocations { .. } => {
                return Err(FsError::Invalid(
                    "AwaitRevocations is for data servers' registration connections".into(),
                ))
            }
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
            Request::SetAttr { ino, set, caller } => {
                let mut st = lock(&self.state);
                self.check_expiry(expires)?;
                let old_size = Self::fcb_word(&mut st, ino, fcb::SIZE);
                let previous = match old_size {
                    Some(size) => size,
                    None => self.store.getattr(ino)?.size,
                };
                if let Some(size) = set.size.filter(|&size| size < previous) {
                    self.check_tail_reachable(&st, ino, size)?;
                }
                let (attr, effects) = self.store.setattr(ino, &set, caller, old_size)?;
                if let Some(size) = set.size {
                    self.apply_size(&mut st, &attr, previous, size)?;
                }
                let attr = self.publish_setattr(&mut st, attr, &set)?;
                drop(st);
                // The client holds the whole-file lock until this answer: nobody writes the
                // tail meanwhile.
                if let Some(tail) = effects.tail {
                    if let Err(error) = self.zero_tail(tail) {
                        tracing::warn!(?tail, %error, "truncated chunk's tail not zeroed yet");
                    }
                }
                self.zero_and_recycle(effects.freed);
                Response::Attr(attr)
            }
            Request::Mknod {
                parent,
                name,
                kind,
                perm,
                rdev,
                caller,
            } => {
                let _st = lock(&self.state);
                Response::Attr(self.store.mknod(parent, &name, kind, perm, rdev, caller)?)
            }
            Request::Mkdir {
                parent,
                name,
                perm,
                caller,
            } => {
                let _st = lock(&self.state);
                Response::Attr(self.store.mkdir(parent, &name, perm, caller)?)
            }
            Request::Symlink {
                parent,
                name,
                target,
                caller,
            } => {
                let _st = lock(&self.state);
                Response::Attr(self.store.symlink(parent, &name, &target, caller)?)
            }
            Request::Link {
                ino,
                new_parent,
                new_name,
            } => {
                let _st = lock(&self.state);
                let attr = self.store.link(ino, new_parent, &new_name)?;
                drop(_st);
                Response::Attr(self.live_attr(attr))
            }
            Request::Unlink { parent, name } => {
                let st = lock(&self.state);
                let effects = self.store.unlink(parent, &name, |ino| is_open(&st, ino))?;
                drop(st);
                self.zero_and_recycle(effects.freed);
                Response::Ok
            }
            Request::Rmdir { parent, name } => {
                let _st = lock(&self.state);
                self.store.rmdir(parent, &name)?;
                Response::Ok
            }
            Request::Rename {
                parent,
                name,
                new_parent,
                new_name,
                no_replace,
                exchange,
            } => {
                let st = lock(&self.state);
                let effects = if exchange {
                    if no_replace {
                        return Err(FsError::Invalid(
                            "RENAME_EXCHANGE and RENAME_NOREPLACE exclude each other".into(),
                        ));
                    }
                    self.store.exchange(parent, &name, new_parent, &new_name)?
                } else {
                    self.store
                        .rename(parent, &name, new_parent, &new_name, no_replace, |ino| {
                            is_open(&st, ino)
                        })?
                };
                drop(st);
                self.zero_and_recycle(effects.freed);
                Response::Ok
            }
            Request::Readlink { ino } => Response::Data(self.store.readlink(ino)?),
            Request::ReadDir { ino, cookie, max } => {
                Response::Entries(self.store.readdir(ino, cookie, max)?)
            }
            Request::ReadDirPlus { ino, cookie, max } => {
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
                    *attr = Self::live_locked(&mut st, attr.clone());
                }
                Response::EntriesPlus(plus)
            }
            Request::Statfs => Response::Stats(self.statfs()?),
            Request::SetXattr {
                ino,
                name,
                value,
                mode,
            } => {
                let _st = lock(&self.state);
                self.store.setxattr(ino, &name, &value, mode)?;
                Response::Ok
            }
            Request::GetXattr { ino, name } => Response::Data(self.store.getxattr(ino, &name)?),
            Request::ListXattr { ino } => Response::Names(self.store.listxattr(ino)?),
            Request::RemoveXattr { ino, name } => {
                let _st = lock(&self.state);
                self.store.removexattr(ino, &name)?;
                Response::Ok
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
                self.zero_and_recycle(effects.freed);
                Response::Ok
            }
            Request::GetLk {
                ino,
                owner,
                start,
                end,
                kind,
            } => {
                self.count_lock_call(ino);
                // During a restart's grace the table lacks the locks not taken back yet.
                if Instant::now() < self.settings.record_lock_grace_until {
                    return Err(FsError::InGrace);
                }
                Response::RecordLock(lock(&self.records).conflict(
                    ino,
                    proto::records::Owner { session, owner },
                    start,
                    end,
                    kind,
                ))
            }
            Request::SetLk {
                ino,
                claim,
                wait_ms,
                reclaim,
            } => {
                self.count_lock_call(ino);
                let wait = Duration::from_millis(u64::from(wait_ms));
                self.set_record_lock(session, ino, &claim, wait, reclaim)?;
                Response::Ok
            }
            Request::ChunkMap { ino, first, count } => {
                Response::Chunks(self.store.chunk_map(ino, first, count)?)
            }
            Request::AllocateChunks {
                ino,
                generation,
                first,
                count,
            } => {
                let allocate = || {
                    let st = lock(&self.state);
                    let servers: Vec<u32> = st.live.keys().copied().collect();
                    if servers.is_empty() && count > 0 {
                        return Err(FsError::Unavailable(
                            "no data server is connected to allocate chunks on".into(),
                        ));
                    }
                    self.store
                        .allocate_chunks(ino, generation, first, count, &servers)
                };
                let locs = match allocate() {
                    // Freed chunks may still be on their way to the free stacks: a write
                    // after an unlink on a full file system waits for them, not ENOSPC.
                    Err(FsError::NoSpace) if !self.reclaimer.wait_idle(Duration::ZERO) => {
                        self.reclaimer.wait_idle(RECLAIM_WAIT);
                        allocate()?
                    }
                    other => other?,
                };
                Response::Chunks(locs.into_iter().map(Some).collect())
            }
            Request::FreeChunks { ino, first, count } => {
                let mut st = lock(&self.state);
                self.check_expiry(expires)?;
                let (attr, effects) = self.store.free_chunks_in(ino, first, count)?;
                if !effects.freed.is_empty() {
                    // While the caller still holds the range lock over the freed chunks.
                    Self::publish_generation(&mut st, &attr)?;
                }
                drop(st);
                // Zeroed and recycled once the free is durable, as a truncate's chunks are.
                self.zero_and_recycle(effects.freed);
                Response::Ok
            }
            Request::Fsync { ino } => {
                let mut st = lock(&self.state);
                self.persist_fcb_size(&mut st, ino)?;
                drop(st);
                self.store.flush()?;
                Response::Ok
            }
            Request::AllocateLockWords { ino, words } => {
                Response::Addr(self.allocate_lock_words(ino, words)?)
            }
        })
    }

    /// Allocates `words` zeroed lock words for the lock tree of open file `ino` (a CITRON
    /// scale-up, Alg. 4 l. 3), freed with the file's other lock state when it is no longer
    /// open: `AllocateLockWords`, and the allocator of the scale-ups a hosted acquisition runs
    /// here (`offer_hosted_citron`).
    pub fn allocate_lock_words(&self, ino: Ino, words: u64) -> Result<RemoteAddr, FsError> {
        let mut st = lock(&self.state);
        if !st.open.contains_key(&ino) {
            return Err(FsError::Stale);
        }
        self.count_lock_call(ino);
        let bytes = words
            .checked_mul(8)
            .filter(|&b| b > 0)
            .ok_or_else(|| FsError::Invalid(format!("{words} lock words")))?;
        let offset = st.alloc.alloc(bytes).ok_or(FsError::NoSpace)?;
        let zeros = vec![0u8; bytes.min(1 << 20) as usize];
        let mut at = 0;
        while at < bytes {
            let n = (bytes - at).min(zeros.len() as u64);
            if let Err(e) = st
                .endpoint
                .write(Self::meta_addr(offset + at), &zeros[..n as usize])
            {
                st.alloc.free(offset, bytes);
                return Err(e.into());
            }
            at += n;
        }
        st.open
            .get_mut(&ino)
            .expect("checked")
            .extra
            .push(LockAlloc { offset, bytes });
        Ok(Self::meta_addr(offset))
    }

    /// After a `SetAttr` of an open file: publishes its permission bits in the FCB (writers
    /// read them to decide whether to clear set-ID bits), and, when the caller set mtime, clears
    /// the FCB's MTIME (so that the time set is not hidden by an earlier write's); returns the attributes as the FCB corrects them.
    fn publish_setattr(&self, st: &mut State, attr: Attr, set: &SetAttr) -> Result<Attr, FsError> {
        let Some(base) = st.open.get(&attr.ino).map(|o| o.fcb) else {
            return Ok(attr);
        };
        st.endpoint
            .write_u64(Self::meta_addr(base + fcb::MODE), u64::from(attr.perm))?;
        if set.mtime.is_some() {
            st.endpoint
                .write_u64(Self::meta_addr(base + fcb::MTIME), 0)?;
        }
        Ok(Self::live_locked(st, attr))
    }

    /// Writes `attr`'s generation into its file's FCB, if the file is open (returning the
    /// FCB's offset): a client's next I/O reads it in its lock's batch and drops the chunk
    /// locations it cached under an older one. Called before the change that bumped it is
    /// answered, so while its caller still holds the lock that covers the change.
    fn publish_generation(st: &mut State, attr: &Attr) -> Result<Option<u64>, FsError> {
        let Some(open) = st.open.get(&attr.ino) else {
            return Ok(None);
        };
        let base = open.fcb;
        st.endpoint
            .write_u64(Self::meta_addr(base + fcb::GENERATION), attr.generation)?;
        Ok(Some(base))
    }

    /// After a size change: publishes it in the FCB (generation first, so a client that sees the
    /// smaller size also sees that its chunk map is stale) and zeroes the bytes past the new end
    /// in its last chunk (past the old end when growing), so that they read as zeros.
    fn apply_size(&self, st: &mut State, attr: &Attr, old: u64, new: u64) -> Result<(), FsError> {
        if let Some(base) = Self::publish_generation(st, attr)? {
            st.endpoint
                .write_u64(Self::meta_addr(base + fcb::SIZE), new)?;
        }
        // Growing: the bytes from the old size to the end of its chunk become part of the file
        // and must read zeros (they should be; a write that failed after its data verbs may
        // have left some). Shrinking zeroes the tail once durable (`Effects::tail`).
        let layout = self.store.layout();
        let (chunk, from) = layout.locate(old);
        if new > old && from != 0 {
            if let Some(Some(loc)) = self.store.chunk_map(attr.ino, chunk, 1)?.first() {
                let loc = *loc;
                // The state lock is held: zero through the server's endpoint directly.
                let (endpoint, region) = match st.live.get(&loc.server) {
                    Some(l) => (l.endpoint.clone(), l.region),
                    None => {
                        return Err(FsError::Io(format!(
                            "data server {} is not connected",
                            loc.server
                        )))
                    }
                };
                let base = loc.index * layout.unit();
                let mut ep = lock(&endpoint);
                zero_range(&mut **ep, region, base + from, base + layout.len(chunk))?;
            }
        }
        Ok(())
    }

    /// Runs the consistency checker ([`crate::fsck`]) holding the state lock, so that no
    /// namespace change, chunk allocation or recycling runs between its scans. Locks are
    /// inspected when the caller says nothing is in flight (`at_rest`) or no session but the
    /// caller's is connected. Chunks freed by repairs are zeroed and recycled afterwards.
    fn fsck(&self, session: u64, options: FsckOptions) -> Result<FsckReport, FsError> {
        let mut st = lock(&self.state);
        let others = st.sessions.keys().filter(|&&s| s != session).count();
        let at_rest = options.at_rest || others == 0;
        let state = std::cell::RefCell::new(&mut *st);
        let live = || {
            let mut st = state.borrow_mut();
            let inos: Vec<Ino> = st.open.keys().copied().collect();
            let open = inos
                .into_iter()
                .map(|ino| (ino, Self::fcb_word(&mut st, ino, fcb::SIZE)))
                .collect();
            crate::fsck::Live { open, at_rest }
        };
        let locks = |reset: bool| {
            let mut repairs = Vec::new();
            if !at_rest {
                return (Vec::new(), 0, repairs);
            }
            let st = state.borrow();
            let mut findings = Vec::new();
            let mut inspected = 0;
            for (&ino, open) in &st.open {
                let file = &open.lock;
                inspected += 1;
                let endpoint =
                    Box::new(LocalEndpoint::new(Arc::new(OwnRegion(self.region.clone()))));
                let scheme = file.lock.scheme.to_string();
                if reset {
                    // At rest no client holds or waits: what is busy is a dead client's.
                    match schemes::reset_to_rest(&file.lock, endpoint) {
                        Ok(Some(words)) if !words.is_empty() => repairs.push(Repair::ResetLock {
                            ino,
                            scheme,
                            words: words.iter().map(|b| b.to_string()).collect(),
                        }),
                        Ok(_) => {}
                        Err(error) => {
                            tracing::warn!(ino, %error, "fsck could not reset a lock")
                        }
                    }
                    continue;
                }
                match schemes::inspect(&file.lock, endpoint) {
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
        };
        let (mut report, freed) = crate::fsck::run(&self.store, options, live, locks)?;
        report.counts.sessions = others as u64;
        report.counts.open_files = st.open.len() as u64;
        if !report.repairs.is_empty() {
            // Repairs may change entries the table holds: take it afresh from the database.
            self.refill_entries(&mut st)?;
        }
        drop(st);
        if !report.repairs.is_empty() {
            tracing::warn!(
                repairs = report.repairs.len(),
                "fsck repaired the namespace"
            );
        }
        self.zero_and_recycle(freed);
        Ok(report)
    }

    /// Counts a lock request about `ino` that came as an RPC (see [`Service::lock_calls`]): only
    /// while the file is open, its entry made by its first open and removed with its open state.
    fn count_lock_call(&self, ino: Ino) {
        if let Some(calls) = lock(&self.lock_calls).get_mut(&ino) {
            *calls += 1;
        }
    }

    /// What a status report is made of ([`crate::status`]), taken under the state lock, so
    /// that sessions, open files and data servers are of one moment.
    fn status_facts(&self) -> Result<crate::status::Facts, FsError> {
        use crate::status::{Facts, OpenFacts, ServerFacts, SessionFacts};
        let st = lock(&self.state);
        let mut dirty: HashMap<u32, u64> = HashMap::new();
        for b in self.store.dirty_chunks()? {
            *dirty.entry(b.loc.server).or_default() += proto::layout::Layout::units_of(b.order);
        }
        let mut servers = Vec::new();
        for record in self.store.servers()? {
            servers.push(ServerFacts {
                incarnation: self.store.incarnation(record.id)?,
                live: st.live.contains_key(&record.id),
                dirty_units: dirty.get(&record.id).copied().unwrap_or(0),
                record,
            });
        }
        let sessions = st
            .sessions
            .iter()
            .map(|(&id, s)| SessionFacts {
                id,
                origin: s.origin.clone(),
                opened: s.opened,
                last_seen: s.last_seen,
                resumed_until: s.resumed_until,
                open_files: s.open.len(),
            })
            .collect();
        let calls = lock(&self.lock_calls);
        let open = st
            .open
            .iter()
            .map(|(&ino, o)| OpenFacts {
                ino,
                sessions: o.sessions.len(),
                scheme: o.lock.lock.scheme.to_string(),
                lock_calls: calls.get(&ino).copied().unwrap_or(0),
            })
            .collect();
        drop(calls);
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
            fenced: lock(&self.fences).revoked.len() as u64,
            open,
        })
    }

    /// Space and inodes in layout units (`df`'s blocks): every registered server's region,
    /// and what no file holds (free, never used, or freed and being zeroed). Read under the
    /// state lock, so that no allocation runs between the scans and the figures add up.
    fn statfs(&self) -> Result<FsStats, FsError> {
        let _st = lock(&self.state);
        let layout = self.store.layout();
        let max = layout.max_order();
        let mut dirty: HashMap<u32, u64> = HashMap::new();
        for b in self.store.dirty_chunks()? {
            *dirty.entry(b.loc.server).or_default() += proto::layout::Layout::units_of(b.order);
        }
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
        self.requests.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Nanoseconds spent handling those requests.
    pub fn request_nanos(&self) -> u64 {
        self.request_ns.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes of the meta region not in use (for tests and reports).
    pub fn meta_free_bytes(&self) -> u64 {
        lock(&self.state).alloc.free_bytes()
    }
}

/// Zeroes bytes `start..end` of `region` with one-sided writes no larger than the endpoint takes.
fn zero_range(
    ep: &mut dyn Endpoint,
    region: RegionId,
    start: u64,
    end: u64,
) -> Result<(), FsError> {
    let piece = ep.capabilities().max_io_bytes.clamp(8, 1 << 20) as u64;
    let zeros = vec![0u8; piece as usize];
    let mut at = start;
    while at < end {
        let n = (end - at).min(piece);
        ep.write(RemoteAddr::new(region, at), &zeros[..n as usize])?;
        at += n;
    }
    Ok(())
}
