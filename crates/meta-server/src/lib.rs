//! The CitronFS meta server.
//!
//! - the namespace in sled ([`store`]): inodes, directory entries, xattrs, symlink targets, chunk
//!   maps and the data servers' chunk allocation state, each mutating operation one transaction;
//! - the RPC service over TCP ([`rpc`], tokio), speaking `proto::rpc`;
//! - the cluster manager: data servers register with their region (and get a stable id by
//!   name), client sessions hold a lease renewed by every request (heartbeats included) and end
//!   when it runs out or their connection closes;
//! - the meta region, a registered fabric region holding each open file's control block
//!   (`proto::fcb`) and lock state (CITRON trees, `mutex`/`seg` words), with the allocator that
//!   CITRON scale-ups call through `AllocateLockWords`;
//! - POSIX record locks (`fcntl`) for the whole cluster, in memory (`proto::records::Table`).
//!
//! - the consistency checker ([`fsck`]): `citronfs fsck`, over the `Fsck` request or on a
//!   stopped server's database.
//!
//! Start it with [`MetaServer::start`]; it runs on its own threads until
//! [`MetaHandle::shutdown`] (or drop), which persists open files' sizes and flushes sled.

pub mod alloc;
mod awake;
mod dentries;
mod fences;
pub mod fsck;
mod meta_region;
pub mod metrics;
mod open_files;
mod published;
mod reclaim;
mod record_locks;
mod registry;
mod replica_check;
mod requests;
mod rereplicate;
pub mod rpc;
mod service;
mod sessions;
mod staged;
mod stall;
mod status;
pub mod store;
mod sync;

use anyhow::Context;
use fabric::{Backing, Credentials, FabricServer, ServeAt};
use lockmgr::schemes::LockServer;
use meta_region::META_REGION;
use proto::Caller;
pub use rereplicate::{DEFAULT_REREPLICATE_AFTER, DEFAULT_REREPLICATE_MIB_S};
use service::{Service, Settings};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Default chunk size: 1 MiB.
pub const DEFAULT_CHUNK_SIZE: u64 = 1 << 20;

/// Default lock unit: 4096 bytes, chosen by measuring false conflicts
/// (`citronfs bench false-conflicts --pattern btio|io500-hard`, k = 2): neither pattern's records
/// are aligned to any unit of 512 B or more, so some false conflict is unavoidable, and per
/// request it stays flat from 512 B to 4 KiB (IO500 hard: 0.94 → 0.98; BT-IO, 64 processes:
/// 0.88 → 1.25) but grows beyond (BT-IO at 16 KiB: 2.6, at 64 KiB: 3.3). 4 KiB is the largest
/// unit that does not add false conflicts, and a larger unit means a smaller lock tree.
pub const DEFAULT_LOCK_UNIT: u64 = 4096;

/// Default meta region size: 64 MiB (a million FCBs, or many lock trees).
pub const DEFAULT_REGION_BYTES: u64 = 64 << 20;

/// Default session lease.
pub const DEFAULT_SESSION_LEASE: Duration = Duration::from_secs(10);

/// Default `T_lease` of CITRON file locks (CITRON §3.10): a holder must be done within it,
/// and a holder silent for a few of it is presumed dead. It must cover the slowest locked I/O
/// (a 16 MiB read or write on a loaded machine) plus fs-client's guard of `2·fence_after`;
/// recovery of a dead holder takes between one and a few of it.
pub const DEFAULT_LOCK_LEASE: Duration = Duration::from_secs(2);

/// Default silence after which a `Fence` revokes a session (clients heartbeat at a quarter of
/// it). CITRON's `T_lease` on file locks ([`DEFAULT_LOCK_LEASE`]) must exceed twice this plus the
/// time a locked I/O takes: fs-client posts data verbs only while `2·fence_after` of the lease is
/// left.
pub const DEFAULT_FENCE_AFTER: Duration = Duration::from_millis(100);

/// Default of [`MetaConfig::max_sessions`].
pub const DEFAULT_MAX_SESSIONS: usize = 4096;

/// How long a clean shutdown lets connection tasks end (telling their peers the server is
/// stopping, answering what they started) before the runtime drops them: they end in
/// milliseconds unless a request on the blocking pool is slow.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Default of [`MetaConfig::record_lock_grace`]: clients heartbeat every 25 ms and reconnect as
/// soon as the server answers, so their locks are back within a fraction of it.
pub const DEFAULT_RECORD_LOCK_GRACE: Duration = Duration::from_secs(2);

/// Default of [`MetaConfig::max_record_locks_per_session`]: far more than programs take (ROMIO
/// holds one at a time), short of letting one client fill the meta server's memory (each lock
/// is a few dozen bytes there).
pub const DEFAULT_MAX_RECORD_LOCKS_PER_SESSION: usize = 1 << 16;

/// Default of [`MetaConfig::max_open_per_session`]: as many as a process may open by default
/// (`ulimit -n` hard limit on most distributions).
pub const DEFAULT_MAX_OPEN_PER_SESSION: usize = 1 << 20;

/// Everything a meta server needs.
#[derive(Clone, Debug)]
pub struct MetaConfig {
    /// The sled database directory (created if missing; reused across restarts).
    pub db_dir: PathBuf,
    /// Where the RPC service listens (port 0: any; see [`MetaHandle::addr`]).
    pub listen: SocketAddr,
    /// The cluster's name; clients and data servers must name it.
    pub cluster: String,
    /// The cluster's shared secret.
    pub token: String,
    /// Where the meta region is served (shm: use a directory under `/dev/shm`; a stale region
    /// file from an earlier run is replaced. tcp: clients are told the bound address, so listen
    /// on an address they can reach).
    pub fabric: ServeAt,
    /// Bytes of the meta region (FCBs and lock state of open files).
    pub region_bytes: u64,
    /// Bytes per chunk (a power of two); fixed for the life of a database.
    pub chunk_size: u64,
    /// Bytes per lock unit (a power of two).
    pub lock_unit: u64,
    /// How long a client session lives without a request.
    pub session_lease: Duration,
    /// How long a session may be silent before a `Fence` (sent by a client that breaks a
    /// lock) revokes it on every fabric server.
    pub fence_after: Duration,
    /// `T_lease` of the CITRON lock of every file.
    pub lock_lease: Duration,
    /// Run the CPU lock server that schemes keeping their locks at a lock service use
    /// (`lockmgr::schemes::Placement::Service`; off by default: it is a baseline for
    /// comparison, and mounts asking for such a scheme fail with a clear error without it).
    /// It listens on the RPC address's host, on a port of its own, and authenticates peers
    /// with the cluster's credentials like every other server.
    pub lock_server: bool,
    /// Limits on connections to the RPC port and the lock server: per peer address, and
    /// pending their handshake in total. A connection beyond them is refused
    /// (`Refusal::Limit`, naming the setting) before any of its bytes are read.
    pub connection_limits: fabric::handshake::ConnectionLimits,
    /// Client sessions open at once; a client beyond is refused at the handshake
    /// (`Refusal::Limit`).
    pub max_sessions: usize,
    /// Files one client session may have open at once; an open beyond fails with EMFILE
    /// (`FsError::TooManyOpen`).
    pub max_open_per_session: usize,
    /// How long the server watches a client connection for its next request after answering
    /// one, awake, instead of sleeping until it arrives (one connection at a time; the module
    /// `awake`). Zero: never. Default [`default_idle_poll`].
    pub idle_poll: Duration,
    /// How long after a restart (a start on a state directory that holds a database) the server
    /// grants record locks (`fcntl`) only to clients taking back those they held before
    /// (`Request::SetLk::reclaim`); other new locks wait for its end. Default
    /// [`DEFAULT_RECORD_LOCK_GRACE`].
    pub record_lock_grace: Duration,
    /// Record locks (`fcntl`, `flock`) one client session may hold at once; a lock beyond
    /// fails with ENOLCK (`FsError::NoLocks`). Default [`DEFAULT_MAX_RECORD_LOCKS_PER_SESSION`].
    pub max_record_locks_per_session: usize,
    /// A Unix socket where the server also takes client connections, for clients on its host
    /// (`proto::stream`: a metadata call costs less than over loopback tcp); clients learn it
    /// in their welcome (`ClusterInfo::local_rpc`) and move there when they can open it. A
    /// stale socket file at the path is replaced; the server removes it when it stops. By
    /// default [`MetaConfig::new`] sets `meta.sock` in the fabric's directory on this host
    /// (`ServeAt::host_dir`: shm's, where every client is on this host anyway), and nothing
    /// for a fabric without one (tcp, mem). A path the socket cannot be bound at (too long,
    /// not writable) is logged and left out: clients stay on tcp.
    pub local_rpc: Option<PathBuf>,
    /// The cluster's replication factor: how many replicas, on distinct data servers, each
    /// chunk of a file gets unless the file inherited another from its directory
    /// (`proto::REPLICAS_XATTR`; docs/REPLICAS.md). 1 to `proto::MAX_REPLICAS`; the default,
    /// [`DEFAULT_REPLICAS`], keeps one copy.
    pub replicas: usize,
    /// Re-replication's rate limit: bytes copied per second at most, in MiB/s (0: none).
    /// Default [`DEFAULT_REREPLICATE_MIB_S`].
    pub rereplicate_mib_s: u64,
    /// How long after a data server is marked down (or comes back with new memory) the chunks
    /// short of live replicas are re-replicated. Default [`DEFAULT_REREPLICATE_AFTER`].
    pub rereplicate_after: Duration,
}

/// The default of [`MetaConfig::replicas`]: one copy of every chunk. A cluster of one data
/// server (the common test and laptop set-up) could not place a second, and a second doubles
/// the memory of every file and the bytes of every write; a cluster that wants data to
/// outlive a data server asks for 2 or more.
pub const DEFAULT_REPLICAS: usize = 1;

/// The default of [`MetaConfig::idle_poll`]: [`IDLE_POLL`] on a machine of at least 4 CPUs,
/// nothing on a smaller one (`proto::rpc::poll_budget`).
pub fn default_idle_poll() -> Duration {
    proto::rpc::poll_budget(IDLE_POLL)
}

/// How long a connection is watched for its next request ([`MetaConfig::idle_poll`]). A
/// client making metadata calls one after the other (a thread creating files, the kernel's
/// requests in between) sends the next 50–150 µs after an answer (16-core machine, `bench
/// meta`); an async worker asleep by then costs the call a wake-up of an idle CPU. With a
/// 200 µs watch there, creates through the mount with 4 threads went 1.02–1.09× faster and the
/// cheapest call's round trip from 20–23 to 12–19 µs (docs/BENCHMARKS.md).
pub const IDLE_POLL: Duration = Duration::from_micros(200);

/// The name of the Unix socket [`MetaConfig::new`] puts in the shm fabric's directory.
pub const LOCAL_RPC_SOCKET: &str = "meta.sock";

impl MetaConfig {
    /// A configuration with the defaults: listen on `127.0.0.1:0`, cluster `citronfs`, an empty
    /// token, 64 MiB meta region, 1 MiB chunks, 4 KiB lock units, a 10 s lease, no lock server.
    pub fn new(db_dir: impl Into<PathBuf>, fabric: ServeAt) -> Self {
        Self {
            db_dir: db_dir.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            cluster: "citronfs".into(),
            token: String::new(),
            region_bytes: DEFAULT_REGION_BYTES,
            chunk_size: DEFAULT_CHUNK_SIZE,
            lock_unit: DEFAULT_LOCK_UNIT,
            session_lease: DEFAULT_SESSION_LEASE,
            fence_after: DEFAULT_FENCE_AFTER,
            lock_lease: DEFAULT_LOCK_LEASE,
            lock_server: false,
            connection_limits: fabric::handshake::ConnectionLimits::default(),
            max_sessions: DEFAULT_MAX_SESSIONS,
            max_open_per_session: DEFAULT_MAX_OPEN_PER_SESSION,
            idle_poll: default_idle_poll(),
            record_lock_grace: DEFAULT_RECORD_LOCK_GRACE,
            max_record_locks_per_session: DEFAULT_MAX_RECORD_LOCKS_PER_SESSION,
            local_rpc: fabric.host_dir().map(|dir| dir.join(LOCAL_RPC_SOCKET)),
            replicas: DEFAULT_REPLICAS,
            rereplicate_mib_s: DEFAULT_REREPLICATE_MIB_S,
            rereplicate_after: DEFAULT_REREPLICATE_AFTER,
            fabric,
        }
    }

    /// The cluster's credentials, which every server of the cluster checks in the handshake.
    pub fn credentials(&self) -> Credentials {
        Credentials::new(self.cluster.clone(), self.token.clone())
    }

    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            (1..=proto::MAX_REPLICAS).contains(&self.replicas),
            "--replicas {} must be from 1 to {}",
            self.replicas,
            proto::MAX_REPLICAS
        );
        anyhow::ensure!(
            self.chunk_size.is_power_of_two() && self.chunk_size >= 4096,
            "chunk size {} must be a power of two of at least 4096",
            self.chunk_size
        );
        anyhow::ensure!(
            self.lock_unit.is_power_of_two(),
            "lock unit {} must be a power of two",
            self.lock_unit
        );
        anyhow::ensure!(
            self.region_bytes >= 64 << 10,
            "meta region of {} bytes is too small (at least 64 KiB)",
            self.region_bytes
        );
        anyhow::ensure!(
            self.session_lease >= Duration::from_millis(10),
            "session lease {:?} is too short",
            self.session_lease
        );
        anyhow::ensure!(
            self.lock_lease > 4 * self.fence_after,
            "lock lease {:?} must exceed 4 × fence_after ({:?}): clients keep 2 × fence_after \
             of every lease as a guard",
            self.lock_lease,
            self.fence_after
        );
        anyhow::ensure!(!self.cluster.is_empty(), "the cluster needs a name");
        anyhow::ensure!(
            self.connection_limits.max_per_peer > 0
                && self.connection_limits.max_pending > 0
                && self.connection_limits.max_pending_per_peer > 0,
            "connection limits must be at least 1: {:?}",
            self.connection_limits
        );
        anyhow::ensure!(self.max_sessions > 0, "max_sessions must be at least 1");
        anyhow::ensure!(
            self.max_open_per_session > 0,
            "max_open_per_session must be at least 1"
        );
        Ok(())
    }
}

/// The entry point.
pub struct MetaServer;

impl MetaServer {
    /// Opens the database, registers the meta region, starts the lock server if asked, and
    /// starts serving RPCs on background threads (its own tokio runtime).
    pub fn start(config: MetaConfig) -> anyhow::Result<MetaHandle> {
        config.validate()?;
        // SAFETY: geteuid and getegid cannot fail and touch no memory.
        let owner = unsafe {
            Caller {
                uid: libc::geteuid(),
                gid: libc::getegid(),
            }
        };
        // A state directory with something in it held a database: this is a restart, and
        // clients may have record locks to take back (`MetaConfig::record_lock_grace`).
        let restarted = std::fs::read_dir(&config.db_dir).is_ok_and(|mut d| d.next().is_some());
        let store = store::Store::open(&config.db_dir, config.chunk_size, owner)?;

        let region_server = fabric::serve(&config.fabric, &config.credentials())
            .with_context(|| format!("serving the meta region at {:?}", config.fabric))?;
        // Before the region exists: a client of an earlier run that has not noticed the
        // restart may not run its verbs here (tcp). Its file control blocks and lock trees were
        // at places that now hold other files' or nothing, and its lock verbs would write into
        // them. It joins again in a session of this run. (On shm it maps the old region, which
        // its server emptied: `fabric::shm`.)
        let first_session = service::first_session_id();
        region_server.refuse_sessions_before(first_session);
        let region = region_server.register(META_REGION, config.region_bytes, &Backing::Memory)?;
        let meta_fabric = region_server.addr();
        let meta_fabric_addr = meta_fabric.clone();
        let t_wait = measure_t_wait(&region_server)?;

        let lock_server = start_lock_server(&config)?;

        let local_socket = config.local_rpc.as_deref().and_then(LocalSocket::bind);
        let local_rpc = local_socket
            .as_ref()
            .map(|s| s.path.to_string_lossy().into_owned());
        let settings = service_settings(
            &config,
            local_rpc,
            meta_fabric,
            t_wait,
            first_session,
            restarted,
        );
        let service = Arc::new(Service::new(settings, store, region, lock_server)?);
        let region_server = serve_for(region_server, &service)?;
        service.set_self();
        service.set_lock_connector(
            region_server
                .host_connector()
                .context("the meta server's own connector to its region")?,
        );
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("meta-server")
            .enable_all()
            .build()
            .context("starting the tokio runtime")?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(config.listen))
            .with_context(|| format!("listening on {}", config.listen))?;
        let addr = listener.local_addr()?;
        let reclaimer = {
            let service = service.clone();
            let thread = std::thread::Builder::new().name("meta-reclaimer".into());
            (thread.spawn(move || service.run_reclaimer()))
                .context("starting the reclaimer thread")?
        };
        let rereplicator = {
            let service = service.clone();
            let thread = std::thread::Builder::new().name("meta-rereplicate".into());
            (thread.spawn(move || service.run_rereplicator()))
                .context("starting the re-replication thread")?
        };
        let pulse = Pulse::start(service.clone())?;
        // Data servers that do not come back after a restart of this server never go down
        // in this run: a pass after the grace finds their chunks short.
        service.replicas_may_be_short();
        let (stop_tx, stop_rx) = watch::channel(false);
        let awake = awake::AwakeServe::new(config.idle_poll);
        let connections = fabric::handshake::Admission::new(service.settings.connection_limits);
        // Both listeners are served alike: the same service, stop signal, limits and awake
        // serving.
        let serve = |listener: rpc::Listener| {
            runtime.spawn(rpc::accept_loop(
                listener,
                service.clone(),
                stop_rx.clone(),
                connections.clone(),
                awake.clone(),
            ));
        };
        serve(rpc::Listener::Tcp(listener));
        // The local socket is served by the runtime; if it cannot be, its file goes (dropped
        // here), so that clients told of it fail to connect at once and stay on tcp.
        let local_socket = local_socket.and_then(|socket| socket.serve(&runtime, serve));
        runtime.spawn(reaper(service.clone(), config.session_lease, stop_rx));
        tracing::info!(%addr, cluster = config.cluster, "meta server listening");
        Ok(MetaHandle {
            addr,
            fabric_addr: meta_fabric_addr,
            inner: Some(Running {
                runtime,
                stop: stop_tx,
                connections,
                service,
                awake,
                reclaimer: Some(reclaimer),
                rereplicator: Some(rereplicator),
                pulse,
                local_socket,
                region_server,
            }),
        })
    }

    /// Runs a meta server until SIGINT or SIGTERM, then shuts it down cleanly (the
    /// `citronfs meta-server` role).
    pub fn run_forever(config: MetaConfig) -> anyhow::Result<()> {
        Self::serve_until_signal(Self::start(config)?)
    }

    /// Serves with `handle` (a server [`MetaServer::start`] started) until SIGINT or SIGTERM,
    /// then shuts it down cleanly.
    pub fn serve_until_signal(mut handle: MetaHandle) -> anyhow::Result<()> {
        let waiter = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        waiter.block_on(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                r = tokio::signal::ctrl_c() => r,
                _ = term.recv() => Ok(()),
            }
        })?;
        tracing::info!("stopping the meta server");
        handle.shutdown()
    }
}

/// The wait of file locks (CITRON's `T_wait`): derived from round trips to the meta region
/// under load (`lockmgr::schemes::wait_under_load`) as one-sided clients make them — through
/// the fabric, from another connection — not from the server's own local memory access.
///
/// Also where clients acquire at this host ([`offer_hosted_locks`], tcp): a client may still
/// acquire one-sided (its host refused it, or it was told to), and inequality (1) (CITRON
/// §3.5.5) then needs its phases, a round trip each, to fit in `T_wait`. Sized for the host's
/// own memory (15 µs), such a client aborted every attempt that was not a fast path, for ever
/// (seen: a 4 KiB write hung). Hosted grants pay for it in phase (d) waits instead.
fn measure_t_wait(server: &FabricServer) -> anyhow::Result<Duration> {
    let connector = server
        .connector()
        .context("measuring the fabric's round trip")?;
    let (t_wait, rtt) =
        lockmgr::schemes::wait_under_load(&*connector, fabric::RemoteAddr::new(META_REGION, 0))
            .context("measuring the fabric's round trip")?;
    tracing::info!(
        ?rtt,
        ?t_wait,
        backend = %server.backend(),
        "lock wait (CITRON's T_wait) from the round trip under load"
    );
    Ok(t_wait)
}

/// Lets file-system clients acquire their range locks at this host (`lockmgr::schemes::LockHost`:
/// the schemes that can, CITRON) on a fabric that runs procedures (`FabricServer::runs_procedures`: tcp): a lock tree
/// lives in the meta region, and on such a fabric this server's CPU executes every one-sided
/// verb of an acquisition anyway, one wake-up per round trip and per poll. Clients have a
/// fence (`fs-client`'s `MetaFence`), so the host fences for them: before a break-in on behalf
/// of the client of session `s`, the same revocation of silent sessions its `Fence` request
/// would run, with `s` as the caller.
fn offer_hosted_locks(server: &FabricServer, service: &Arc<Service>) -> anyhow::Result<()> {
    let weak = Arc::downgrade(service);
    let service = weak.clone();
    let host = lockmgr::schemes::LockHost::new()
        .fencing(Arc::new(move |session| {
            Arc::new(HostFence {
                service: service.clone(),
                session,
            }) as Arc<dyn lockmgr::Fence>
        }))
        .allocating(Arc::new(move |ino| {
            Arc::new(HostAllocator {
                service: weak.clone(),
                ino,
            }) as Arc<dyn lockmgr::schemes::LockWordAllocator>
        }));
    for (id, procedure) in host.procedures() {
        server
            .register_procedure(id, procedure)
            .context("offering hosted lock acquisitions")?;
    }
    Ok(())
}

/// The fence a hosted acquisition of session `session` runs ([`offer_hosted_locks`]).
struct HostFence {
    service: std::sync::Weak<Service>,
    session: u64,
}

impl lockmgr::Fence for HostFence {
    fn fence(&self) -> Result<(), lockmgr::LockError> {
        on_service(
            &self.service,
            "fence before a lease recovery (at the host)",
            |service| service.fence(self.session, fences::FENCE_WAIT),
        )
    }

    fn holder_gone(&self, owner: u64, stopped: bool) -> Result<bool, lockmgr::LockError> {
        on_service(
            &self.service,
            "asking whether a lock holder is gone (at the host)",
            |service| service.holder_gone(self.session, owner, stopped, fences::FENCE_WAIT),
        )
    }
}

/// Runs `f` on the service a hosted acquisition's hook (`what`) calls, as a lock error.
fn on_service<T>(
    service: &std::sync::Weak<Service>,
    what: &'static str,
    f: impl FnOnce(&Service) -> Result<T, proto::FsError>,
) -> Result<T, lockmgr::LockError> {
    let hook = |source: Box<dyn std::error::Error + Send + Sync>| lockmgr::LockError::Hook {
        what,
        source,
    };
    let service = service
        .upgrade()
        .ok_or_else(|| hook("the meta server is stopping".into()))?;
    f(&service).map_err(|e| hook(Box::new(e)))
}

/// The allocator of the growth a hosted acquisition of file `ino`'s lock runs here
/// ([`offer_hosted_locks`]): the same lock words `AllocateLockWords` would give its client.
struct HostAllocator {
    service: std::sync::Weak<Service>,
    ino: proto::Ino,
}

impl lockmgr::schemes::LockWordAllocator for HostAllocator {
    fn allocate(&self, words: u64) -> Result<fabric::RemoteAddr, lockmgr::LockError> {
        on_service(
            &self.service,
            "lock tree allocation (at the host)",
            |service| service.allocate_lock_words(self.ino, words),
        )
    }
}

/// Makes the meta region's fabric server serve `service`: hosted lock acquisitions where the
/// fabric runs procedures, and the service's revocations where it can fence.
fn serve_for(
    region_server: FabricServer,
    service: &Arc<Service>,
) -> anyhow::Result<Arc<FabricServer>> {
    if region_server.runs_procedures() {
        offer_hosted_locks(&region_server, service)?;
    }
    let region_server = Arc::new(region_server);
    if region_server.can_fence() {
        let server = region_server.clone();
        service.set_local_revoke(Box::new(move |sessions| {
            server.revoke(sessions);
        }));
    }
    Ok(region_server)
}

/// The lock server for schemes that keep their locks at a lock service, if `config` asks for
/// one: on the listening address's interface, any port.
fn start_lock_server(config: &MetaConfig) -> anyhow::Result<Option<Arc<LockServer>>> {
    let lock_server = if config.lock_server {
        let server = LockServer::bind_with_limits(
            SocketAddr::new(config.listen.ip(), 0),
            config.credentials(),
            config.connection_limits,
        )
        .context("starting the lock server")?;
        Some(Arc::new(server))
    } else {
        None
    };
    Ok(lock_server)
}

/// What the service needs of `config`, with what starting found: the local socket as bound,
/// the meta region's address, the measured `T_wait`, this run's first session id, and whether
/// this is a restart.
fn service_settings(
    config: &MetaConfig,
    local_rpc: Option<String>,
    meta_fabric: fabric::FabricAddr,
    t_wait: Duration,
    first_session: u64,
    restarted: bool,
) -> Settings {
    Settings {
        local_rpc,
        credentials: config.credentials(),
        chunk_size: config.chunk_size,
        lock_unit: config.lock_unit,
        session_lease: config.session_lease,
        fence_after: config.fence_after,
        lock_lease: config.lock_lease,
        meta_fabric,
        t_wait,
        connection_limits: config.connection_limits,
        max_sessions: config.max_sessions,
        max_open_per_session: config.max_open_per_session,
        max_record_locks_per_session: config.max_record_locks_per_session,
        replicas: config.replicas,
        rereplicate: rereplicate::Settings {
            rate: config.rereplicate_mib_s.saturating_mul(1 << 20),
            after: config.rereplicate_after,
        },
        state_dir: config.db_dir.clone(),
        first_session,
        earlier_leases_until: restarted.then(|| std::time::Instant::now() + config.lock_lease),
        record_lock_grace_until: std::time::Instant::now()
            + if restarted {
                config.record_lock_grace
            } else {
                Duration::ZERO
            },
    }
}

/// Expires sessions whose lease ran out.
async fn reaper(service: Arc<Service>, lease: Duration, mut stop: watch::Receiver<bool>) {
    let period = (lease / 4).max(Duration::from_millis(5));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(period) => {
                let svc = service.clone();
                let _ = tokio::task::spawn_blocking(move || svc.expire_sessions()).await;
            }
            _ = stop.changed() => break,
        }
    }
}

struct Running {
    runtime: tokio::runtime::Runtime,
    stop: watch::Sender<bool>,
    /// The open connections (counted against the limits), waited for at shutdown.
    connections: Arc<fabric::handshake::Admission>,
    service: Arc<Service>,
    /// Serves client connections awake between requests ([`awake`]).
    awake: Arc<awake::AwakeServe>,
    /// Zeroes and recycles freed chunks ([`reclaim`]); drained and joined at shutdown.
    reclaimer: Option<std::thread::JoinHandle<()>>,
    /// Re-replicates under-replicated chunks ([`rereplicate`]); stopped and joined first at
    /// shutdown.
    rereplicator: Option<std::thread::JoinHandle<()>>,
    /// Notes the service's own stalls ([`stall`]); stopped before the service is dropped.
    pulse: Pulse,
    /// The local socket's file, removed when this is dropped — before the region server, whose
    /// shm directory it may be in. Read only by the test hook `MetaHandle::crash`.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    local_socket: Option<LocalSocket>,
    /// Serves the meta region; dropped at shutdown (removing an shm region file, stopping the
    /// tcp fabric). Held for that drop: read only by the test hook `MetaHandle::crash`.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    region_server: Arc<FabricServer>,
}

impl Running {
    /// Stops the re-replication thread (it ends at its next chunk) and waits for it, and the
    /// pulse thread.
    fn stop_rereplicator(&mut self) {
        self.service.stop_rereplicator();
        if let Some(thread) = self.rereplicator.take() {
            let _ = thread.join();
        }
        self.pulse.stop();
    }
}

/// The thread that calls [`Service::pulse`] every [`stall::PULSE_EVERY`] ([`stall`]).
struct Pulse {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Pulse {
    fn start(service: Arc<Service>) -> anyhow::Result<Pulse> {
        use std::sync::atomic::Ordering;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("meta-pulse".into())
            .spawn(move || {
                while !stopped.load(Ordering::Acquire) {
                    service.pulse();
                    std::thread::sleep(stall::PULSE_EVERY);
                }
            })
            .context("starting the pulse thread")?;
        Ok(Pulse {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread (after its current pulse) and waits for it: it holds the service.
    fn stop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The Unix socket clients on this host may connect to ([`MetaConfig::local_rpc`]): bound at
/// start, its file removed when this is dropped.
struct LocalSocket {
    path: PathBuf,
    /// Until the runtime takes it.
    listener: Option<std::os::unix::net::UnixListener>,
}

impl LocalSocket {
    /// Serves the socket on `runtime` with `serve`; if it cannot be, the socket (and its file)
    /// goes, so that clients told of it fail to connect at once and stay on tcp.
    fn serve(
        mut self,
        runtime: &tokio::runtime::Runtime,
        serve: impl Fn(rpc::Listener),
    ) -> Option<Self> {
        let _runtime = runtime.enter();
        match tokio::net::UnixListener::from_std(self.listener.take()?) {
            Ok(listener) => {
                serve(rpc::Listener::Local(listener));
                tracing::info!(
                    path = %self.path.display(),
                    "meta server listening on a local socket too"
                );
                Some(self)
            }
            Err(error) => {
                tracing::warn!(%error, "cannot serve the local socket: clients use tcp");
                None
            }
        }
    }

    /// Binds the socket at `path`, replacing the file of a server that is gone (a crash leaves
    /// it); `None`, logged, when the path cannot be bound, or a live server answers there.
    fn bind(path: &std::path::Path) -> Option<LocalSocket> {
        use std::os::unix::net::{UnixListener, UnixStream};
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                tracing::warn!(
                    path = %path.display(),
                    "another server listens on the local socket: clients use tcp"
                );
                return None;
            }
            let _ = std::fs::remove_file(path);
        }
        let bound = UnixListener::bind(path).and_then(|listener| {
            listener.set_nonblocking(true)?;
            Ok(listener)
        });
        match bound {
            Ok(listener) => Some(LocalSocket {
                path: path.to_owned(),
                listener: Some(listener),
            }),
            Err(error) => {
                tracing::warn!(
                    path = %path.display(),
                    %error,
                    "cannot bind the local socket: clients use tcp"
                );
                None
            }
        }
    }
}

impl Drop for LocalSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A running meta server.
pub struct MetaHandle {
    addr: SocketAddr,
    /// Where the meta region is served (the fabric server's address as clients are told it).
    fabric_addr: fabric::FabricAddr,
    inner: Option<Running>,
}

impl MetaHandle {
    /// Where the RPC service listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the meta region is served: the fabric server's bound address, which a restart
    /// served again there (`fabric::ServeAt::again_at`) keeps for clients.
    pub fn fabric_addr(&self) -> &fabric::FabricAddr {
        &self.fabric_addr
    }

    /// Bytes of the meta region not allocated to FCBs or lock state (0 once shut down).
    pub fn meta_free_bytes(&self) -> u64 {
        self.inner
            .as_ref()
            .map_or(0, |r| r.service.meta_free_bytes())
    }

    /// Waits up to `timeout` until every chunk freed so far is zeroed and back on a free stack
    /// (or left dirty because its server is away); whether the reclaimer is idle.
    pub fn wait_reclaimed(&self, timeout: Duration) -> bool {
        self.inner
            .as_ref()
            .is_none_or(|r| r.service.reclaimer_idle(timeout))
    }

    /// Registers the server's metrics in `registry` (see [`metrics`]): requests by kind, with
    /// their latency and errors, counted from now on, and the cluster's state (sessions, open
    /// files, data servers, capacity) read at each scrape. Call it once per server.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        let Some(running) = &self.inner else {
            return;
        };
        running
            .service
            .set_metrics(metrics::RequestMetrics::register(registry));
        registry.register_collector(Box::new(metrics::StateCollector {
            service: Arc::downgrade(&running.service),
        }));
    }

    /// Client requests (RPCs) the server has handled since it started, heartbeats excepted
    /// (0 once shut down): what `citronfs bench meta` divides by its operations.
    pub fn request_count(&self) -> u64 {
        self.inner.as_ref().map_or(0, |r| r.service.request_count())
    }

    /// Nanoseconds the server spent handling those requests, from a handler's start to its
    /// answer (waits for the state lock included, the transport not): with `request_count`,
    /// the server's share of an operation's time (0 once shut down).
    pub fn request_nanos(&self) -> u64 {
        self.inner.as_ref().map_or(0, |r| r.service.request_nanos())
    }

    /// How many client sessions are open. For tests that must act once one has ended.
    #[cfg(feature = "test-hooks")]
    pub fn session_count(&self) -> usize {
        self.inner.as_ref().map_or(0, |r| r.service.session_count())
    }

    /// How many record-lock owners have waited at this server for a lock (`SetLk` with a
    /// wait), their waits not yet forgotten. For tests that must act while a call waits.
    #[cfg(feature = "test-hooks")]
    pub fn record_lock_waiters(&self) -> usize {
        self.inner
            .as_ref()
            .map_or(0, |r| r.service.record_lock_waiters())
    }

    /// Stops as a killed process would, as far as its clients can tell: its connections are
    /// cut without a goodbye, no session is ended (the files they had open keep their control
    /// blocks in the region, as they were), and the region is left as it is — on shm its file
    /// stays, mapped by the clients, for the next run to find. What a restart then does about
    /// a region of a run that did not stop cleanly is what tests of this want to see. (Unlike
    /// a kill, sled is closed properly, so that the next run in this process can open it.)
    #[cfg(feature = "test-hooks")]
    pub fn crash(&mut self) {
        let Some(mut running) = self.inner.take() else {
            return;
        };
        running.stop_rereplicator();
        // Cancels every connection task where it waits: no goodbye, no `end_session`.
        running.runtime.shutdown_background();
        running.service.stop_reclaimer();
        if let Some(reclaimer) = running.reclaimer.take() {
            let _ = reclaimer.join();
        }
        // A killed process's sockets close and its memory goes; regions the backend keeps
        // outside the process (a region file in shared memory) stay: never dropped, which
        // would remove them, as a stop does.
        if running.region_server.keeps_regions_on_crash() {
            std::mem::forget(running.region_server);
        }
        // So does the local socket's file, which the next run replaces.
        std::mem::forget(running.local_socket);
    }

    /// Releases open file `ino` in every session that has it open, as a release riding on a
    /// call of each would (its control block freed, for another file to take), while the
    /// clients still count their opens — what a client bug that let a release go too early
    /// does. Returns how many sessions had it open. For tests of the clients' recovery.
    #[cfg(feature = "test-hooks")]
    pub fn release_in_every_session(&self, ino: proto::Ino) -> usize {
        self.inner
            .as_ref()
            .map_or(0, |r| r.service.release_in_every_session(ino))
    }

    /// Overwrites word `word` (`proto::fcb::INO`, `SIZE`, ...) of open file `ino`'s control
    /// block with `value`, as a bug or a stray write could, and returns what it held (`None`:
    /// the file is not open). For tests of the clients' checks.
    #[cfg(feature = "test-hooks")]
    pub fn damage_fcb_word(&self, ino: proto::Ino, word: u64, value: u64) -> Option<u64> {
        self.inner
            .as_ref()
            .and_then(|r| r.service.damage_fcb_word(ino, word, value))
    }

    /// The data-server layout's epoch: it moves at every registration and every server
    /// marked down. For tests that wait for those.
    #[cfg(feature = "test-hooks")]
    pub fn layout_epoch(&self) -> u64 {
        self.inner.as_ref().map_or(0, |r| r.service.layout_epoch())
    }

    /// Makes the next `allocations` chunk allocations of file `ino` each find its generation
    /// moved just before them, as a re-replication pass committing chunk after chunk does. For
    /// tests of the clients' allocations.
    #[cfg(feature = "test-hooks")]
    pub fn churn_generation(&self, ino: proto::Ino, allocations: u32) {
        if let Some(running) = self.inner.as_ref() {
            running.service.churn_generation(ino, allocations);
        }
    }

    /// Holds the service's state lock for `hold`, as a long check or a stalled thread would:
    /// every request that needs it waits, and so does the stall watch's pulse. For tests of
    /// what the server does about its own stall (`stall`).
    #[cfg(feature = "test-hooks")]
    pub fn hold_state_lock(&self, hold: Duration) {
        if let Some(running) = self.inner.as_ref() {
            running.service.hold_state_lock(hold);
        }
    }

    /// Of those requests (heartbeats excepted), how many a connection's awake thread read and
    /// answered itself ([`MetaConfig::idle_poll`]; 0 once shut down).
    pub fn awake_count(&self) -> u64 {
        self.inner.as_ref().map_or(0, |r| r.awake.served())
    }

    /// Stops accepting, closes every connection, persists the sizes of open files and flushes
    /// the database. Idempotent.
    pub fn shutdown(&mut self) -> anyhow::Result<()> {
        let Some(mut running) = self.inner.take() else {
            return Ok(());
        };
        running.service.begin_shutdown();
        running.stop_rereplicator();
        let _ = running.stop.send(true);
        // Connection tasks see `stop`, tell their peers the server is stopping and end
        // (dropping the runtime would cancel them mid-way: peers would see a crash); requests
        // already on the blocking pool finish.
        if !running.connections.wait_all_closed(SHUTDOWN_GRACE) {
            tracing::info!(
                "connections still busy {SHUTDOWN_GRACE:?} after the stop; closing them anyway"
            );
        }
        running.runtime.shutdown_timeout(Duration::from_secs(5));
        // Chunks freed by the last requests are zeroed (after one flush) before the clean
        // shutdown mark.
        running.service.stop_reclaimer();
        if let Some(reclaimer) = running.reclaimer.take() {
            let _ = reclaimer.join();
        }
        let result = running.service.persist_all();
        // Dropping the service closes sled (releasing its directory lock) and the lock server;
        // dropping the region server removes the shm region file or stops the tcp fabric.
        drop(running.service);
        result.context("persisting state at shutdown")
    }
}

impl Drop for MetaHandle {
    fn drop(&mut self) {
        if let Err(error) = self.shutdown() {
            tracing::warn!(%error, "meta server shutdown");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;
    use fabric::{Backing, EndpointExt, RegionId, RemoteAddr};
    use proto::rpc::{Request, Response};
    use proto::{Caller, ROOT_INO};
    use std::sync::{mpsc, Mutex};

    /// Where these tests serve: in this process (the `mem` fabric).
    fn in_process() -> ServeAt {
        let mem: fabric::Backend = "mem".parse().unwrap();
        mem.serve_at("", "127.0.0.1:0".parse().unwrap())
    }

    /// A data server killed while its registration scrubs (seconds, for a large region) and
    /// started again registers a second time while the first registration still runs. The
    /// second must not scrub from its own list of free chunks after the first made the server
    /// live: that zeroed a chunk a client had been allocated and written meanwhile (seen in a
    /// soak as acknowledged files whose first chunks read zeros). Seen failing before the
    /// registrations of one server were serialized.
    #[test]
    fn a_second_registration_during_a_scrub_zeroes_no_file_data() {
        let db = tempfile::tempdir().unwrap();
        let chunk = 64 << 10;
        let chunks = 16;
        let region_id = RegionId(7);
        let credentials = Credentials::new("citronfs", "");
        let data = fabric::serve(&in_process(), &credentials).unwrap();
        let _region = data
            .register(region_id, chunks * chunk, &Backing::Memory)
            .unwrap();
        // A database that knows the server and did not shut down cleanly: it is scrubbed at
        // its next registration.
        {
            let store = Store::open(db.path(), chunk, Caller { uid: 0, gid: 0 }).unwrap();
            store
                .register_server("ds", &data.addr(), region_id, chunks, 1)
                .unwrap();
            store.flush().unwrap();
        }
        let mut config = MetaConfig::new(db.path(), in_process());
        config.chunk_size = chunk;
        let meta = MetaServer::start(config).unwrap();
        let svc = meta.inner.as_ref().unwrap().service.clone();

        // Every scrub says so and waits for a go (or for the test to stop giving any).
        let (entered_tx, entered) = mpsc::channel::<()>();
        let (go, go_rx) = mpsc::channel::<()>();
        let (entered_tx, go_rx) = (Mutex::new(entered_tx), Mutex::new(go_rx));
        *svc.scrub_hook().lock().unwrap() = Some(Arc::new(move || {
            entered_tx.lock().unwrap().send(()).unwrap();
            let _ = go_rx.lock().unwrap().recv();
        }));
        let register = |svc: Arc<Service>, addr: fabric::FabricAddr| {
            std::thread::spawn(move || {
                svc.register_data_server("ds", addr, region_id, chunks * chunk, 1, None)
            })
        };
        let first = register(svc.clone(), data.addr());
        entered
            .recv_timeout(Duration::from_secs(10))
            .expect("the first registration scrubs");
        let second = register(svc.clone(), data.addr());
        let second_scrubs = entered.recv_timeout(Duration::from_millis(300)).is_ok();
        go.send(()).unwrap();
        first.join().unwrap().expect("the first registration");

        // The server is live: a client's file gets a chunk there and writes it.
        let session = svc.open_session(Default::default()).unwrap().session;
        let opened = match svc
            .handle_by(
                session,
                Vec::new(),
                Request::Create {
                    parent: ROOT_INO,
                    name: "f".into(),
                    perm: 0o644,
                    caller: Caller { uid: 0, gid: 0 },
                    scheme: "mutex".parse().unwrap(),
                },
                None,
            )
            .unwrap()
        {
            Response::Open(opened) => opened,
            other => panic!("create answered {other:?}"),
        };
        let loc = match svc
            .handle_by(
                session,
                Vec::new(),
                Request::AllocateChunks {
                    ino: opened.attr.ino,
                    generation: opened.attr.generation,
                    first: 0,
                    count: 1,
                },
                None,
            )
            .unwrap()
        {
            Response::Chunks(locs) => locs[0].expect("allocated").first(),
            other => panic!("allocation answered {other:?}"),
        };
        let unit = proto::layout::MIN_CHUNK;
        let at = RemoteAddr::new(region_id, loc.index * unit);
        let mut ep = fabric::connect(&data.addr(), &credentials, 0)
            .unwrap()
            .connect()
            .unwrap();
        ep.write(at, &vec![0xAB; unit as usize]).unwrap();

        if second_scrubs {
            go.send(()).unwrap();
        }
        drop(go);
        second.join().unwrap().expect("the second registration");
        let found = ep.read(at, unit as usize).unwrap();
        assert!(
            found.iter().all(|&b| b == 0xAB),
            "the file's chunk was zeroed by a registration (second registration scrubbed: \
             {second_scrubs})"
        );
    }
}
