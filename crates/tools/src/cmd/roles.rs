//! `citronfs meta-server`, `citronfs data-server`, `citronfs mount`: each role on its own, for a
//! real cluster over the tcp fabric (or shm on one host).
//!
//! Each role has its flags (a clap struct: `MetaArgs`, ...) and its settings (a serde struct:
//! [`MetaServerConfig`], ...), layered from defaults, the `--config` file, the environment and
//! the flags by `config::load` (see the `config` module). The settings structs repeat the
//! shared keys (`cluster`, `token`, `token_file`, `log`, the fabric's) instead of flattening a shared struct:
//! serde cannot flatten into a struct that denies unknown fields, and an unknown key in a file
//! must stay an error.

use super::config::{
    init_logging, require_token, show_defaults, CommonArgs, FabricArgs, RoleArgs, Size,
    DEFAULT_CLUSTER, DEFAULT_LOG, DEFAULT_META_ADDR, DEFAULT_ROLE_FABRIC,
};
use anyhow::{Context, Result};
use clap::{value_parser, Args};
use cluster::Mount;
use data_server::{Backing, DataConfig, DataServer};
use fabric::handshake::ConnectionLimits;
use fabric::Backend;
use fs_client::metrics::FuseMetrics;
use fs_client::{CitronFs, MountOptions};
use lockmgr::{LockMode, LockScheme};
use meta_server::{MetaConfig, MetaServer};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What `--help` of every role says after the flags.
pub const SETTINGS_HELP: &str = "Settings: a flag wins over the environment (CITRONFS_ and the \
setting's name in capitals: CITRONFS_TOKEN, CITRONFS_CHUNK_SIZE=4M), which wins over the \
--config TOML file (keys are the flag names with _ for -), which wins over the defaults shown.";

/// The default capacity of a data server: 1 GiB.
pub const DEFAULT_DATA_CAPACITY: Size = Size(1 << 30);

/// Shows each role's defaults, from its settings struct, in its `--help` (see
/// `config::show_defaults`).
pub fn show_role_defaults(cli: clap::Command) -> clap::Command {
    cli.mut_subcommand("meta-server", show_defaults::<MetaServerConfig>)
        .mut_subcommand("data-server", show_defaults::<DataServerConfig>)
        .mut_subcommand("mount", show_defaults::<MountConfig>)
        .mut_subcommand("fsck", show_defaults::<super::config::AskConfig>)
}

/// The shm directory of a role's region when none is given: `<shm root>/CLUSTER/NAME`.
fn default_region_dir(cluster: &str, name: &str) -> PathBuf {
    PathBuf::from(fabric::shm::DEFAULT_ROOT)
        .join(cluster)
        .join(name)
}

/// Flags of `citronfs meta-server`.
#[derive(Args, Debug, Default, Serialize)]
pub struct MetaArgs {
    #[command(flatten)]
    #[serde(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    #[serde(flatten)]
    fabric: FabricArgs,
    /// Where the RPC service listens.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// The namespace database directory (created if missing, kept across restarts); required.
    #[arg(long)]
    db: Option<PathBuf>,
    /// Size of the meta region (file control blocks and lock trees).
    #[arg(long)]
    region_size: Option<Size>,
    /// Bytes per chunk of file data, fixed for the life of the database.
    #[arg(long)]
    chunk_size: Option<Size>,
    /// Bytes per lock unit.
    #[arg(long)]
    lock_unit: Option<Size>,
    /// Seconds a client session lives without a request.
    #[arg(long)]
    session_lease: Option<u64>,
    /// Run the lock server of the `server` lock scheme (a baseline, off by default): `true` or
    /// `false`.
    #[arg(long)]
    lock_server: Option<bool>,
    /// Concurrent connections from one IP address to the RPC port (and the lock server); more
    /// are refused before any of their bytes are read.
    #[arg(long)]
    max_connections_per_peer: Option<usize>,
    /// Connections, from all peers, that may wait for their handshake at once (each may be
    /// buffering an unauthenticated hello); more are refused.
    #[arg(long)]
    max_pending_handshakes: Option<usize>,
    /// Connections from one IP address that may wait for their handshake at once; more are
    /// refused.
    #[arg(long)]
    max_pending_handshakes_per_peer: Option<usize>,
    /// Client sessions open at once; more clients are refused at the handshake.
    #[arg(long)]
    max_sessions: Option<usize>,
    /// Files one client session may have open at once; an open beyond fails with EMFILE.
    #[arg(long)]
    max_open_per_session: Option<usize>,
    /// Replicas of every chunk of file data, each on another data server, so that a file's
    /// data outlives data servers that die (1 to 4). The default, 1, keeps one copy: a cluster
    /// of one data server can keep no more, and each replica adds the file's size in memory
    /// and its bytes to every write. A directory's `citronfs.replicas` xattr sets it for what
    /// is created below it from then on.
    #[arg(long)]
    replicas: Option<usize>,
    /// Re-replication's rate limit, in MiB/s (0: none): when a data server is down (or came
    /// back with new memory) for longer than --rereplicate-after, the meta server gives every
    /// chunk short of its file's replicas a new replica on another live data server, copying
    /// its bytes from a live replica at most this fast, a chunk at a time, under the file's
    /// range lock. `citronfs status` shows its progress.
    #[arg(long)]
    rereplicate_rate: Option<u64>,
    /// Seconds a data server may be down (or back with new memory) before the chunks it held
    /// replicas of are re-replicated: a server that restarts within it with its memory (a file-
    /// or shm-backed region) costs no copy. `citronfs fsck --repair` re-replicates at once.
    #[arg(long)]
    rereplicate_after: Option<u64>,
    /// A Unix socket where the server also takes client connections, for clients on this
    /// host: their metadata calls cost less than over loopback tcp, and they move there on
    /// their own [default: meta.sock in the region's directory with --fabric shm; none with
    /// tcp].
    #[arg(long)]
    local_rpc: Option<PathBuf>,
    /// Serve Prometheus metrics over HTTP at this address (`GET /metrics`; port 0: any free
    /// port, printed at start) [default: none, no metrics].
    #[arg(long)]
    metrics: Option<SocketAddr>,
}

impl RoleArgs for MetaArgs {
    type Config = MetaServerConfig;
    fn common(&self) -> &CommonArgs {
        &self.common
    }
}

/// Settings of `citronfs meta-server`; each field is a flag, a TOML key and a `CITRONFS_*`
/// variable of the same name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetaServerConfig {
    /// The cluster's name ([`DEFAULT_CLUSTER`]).
    pub cluster: String,
    /// The cluster's shared secret; this or `token_file` is required.
    pub token: Option<String>,
    /// A file holding the cluster's shared secret, private to its owner.
    pub token_file: Option<PathBuf>,
    /// The log filter ([`DEFAULT_LOG`]).
    pub log: String,
    /// How clients reach the meta region ([`DEFAULT_ROLE_FABRIC`]).
    pub fabric: Backend,
    /// shm: the meta region's directory (`None`: `<shm root>/CLUSTER/meta`).
    pub region_dir: Option<PathBuf>,
    /// tcp: where the meta region's fabric server listens (`None`: the `listen` host, any
    /// port).
    pub fabric_listen: Option<SocketAddr>,
    /// Where the RPC service listens ([`DEFAULT_META_ADDR`]).
    pub listen: SocketAddr,
    /// The namespace database directory; required.
    pub db: Option<PathBuf>,
    /// Bytes of the meta region (`meta_server::DEFAULT_REGION_BYTES`).
    pub region_size: Size,
    /// Bytes per chunk (`meta_server::DEFAULT_CHUNK_SIZE`).
    pub chunk_size: Size,
    /// Bytes per lock unit (`meta_server::DEFAULT_LOCK_UNIT`).
    pub lock_unit: Size,
    /// Seconds of a session's lease (`meta_server::DEFAULT_SESSION_LEASE`).
    pub session_lease: u64,
    /// Run the lock server of the `server` scheme (off: mounts asking for it are refused).
    pub lock_server: bool,
    /// Connections from one IP address
    /// (`fabric::handshake::ConnectionLimits::DEFAULT_MAX_PER_PEER`).
    pub max_connections_per_peer: usize,
    /// Connections waiting for their handshake, in total
    /// (`fabric::handshake::ConnectionLimits::DEFAULT_MAX_PENDING`).
    pub max_pending_handshakes: usize,
    /// Connections from one IP address waiting for their handshake
    /// (`fabric::handshake::ConnectionLimits::DEFAULT_MAX_PENDING_PER_PEER`).
    pub max_pending_handshakes_per_peer: usize,
    /// Client sessions (`meta_server::DEFAULT_MAX_SESSIONS`).
    pub max_sessions: usize,
    /// Open files per session (`meta_server::DEFAULT_MAX_OPEN_PER_SESSION`).
    pub max_open_per_session: usize,
    /// Replicas of every chunk (`meta_server::DEFAULT_REPLICAS`).
    pub replicas: usize,
    /// Re-replication's rate limit in MiB/s, 0 for none
    /// (`meta_server::DEFAULT_REREPLICATE_MIB_S`).
    pub rereplicate_rate: u64,
    /// Seconds a data server may be down before its chunks are re-replicated
    /// (`meta_server::DEFAULT_REREPLICATE_AFTER`).
    pub rereplicate_after: u64,
    /// A Unix socket for clients on this host (`None`: `meta_server::MetaConfig::new`'s
    /// choice, in the region's directory on shm, none on tcp).
    pub local_rpc: Option<PathBuf>,
    /// Where Prometheus metrics are served over HTTP (`None`: nowhere).
    pub metrics: Option<SocketAddr>,
}

impl Default for MetaServerConfig {
    fn default() -> Self {
        MetaServerConfig {
            cluster: DEFAULT_CLUSTER.into(),
            token: None,
            token_file: None,
            log: DEFAULT_LOG.into(),
            fabric: DEFAULT_ROLE_FABRIC,
            region_dir: None,
            fabric_listen: None,
            listen: DEFAULT_META_ADDR,
            db: None,
            region_size: Size(meta_server::DEFAULT_REGION_BYTES),
            chunk_size: Size(meta_server::DEFAULT_CHUNK_SIZE),
            lock_unit: Size(meta_server::DEFAULT_LOCK_UNIT),
            session_lease: meta_server::DEFAULT_SESSION_LEASE.as_secs(),
            lock_server: false,
            max_connections_per_peer: ConnectionLimits::DEFAULT_MAX_PER_PEER,
            max_pending_handshakes: ConnectionLimits::DEFAULT_MAX_PENDING,
            max_pending_handshakes_per_peer: ConnectionLimits::DEFAULT_MAX_PENDING_PER_PEER,
            max_sessions: meta_server::DEFAULT_MAX_SESSIONS,
            max_open_per_session: meta_server::DEFAULT_MAX_OPEN_PER_SESSION,
            replicas: meta_server::DEFAULT_REPLICAS,
            rereplicate_rate: meta_server::DEFAULT_REREPLICATE_MIB_S,
            rereplicate_after: meta_server::DEFAULT_REREPLICATE_AFTER.as_secs(),
            local_rpc: None,
            metrics: None,
        }
    }
}

impl MetaServerConfig {
    /// The meta server's configuration, failing clearly on a missing database or token.
    pub fn server_config(self) -> Result<MetaConfig> {
        let db = self
            .db
            .context("the namespace database directory is missing: give --db DIR")?;
        let fabric = self.fabric.serve_at(
            self.region_dir
                .unwrap_or_else(|| default_region_dir(&self.cluster, "meta")),
            self.fabric_listen
                .unwrap_or_else(|| SocketAddr::new(self.listen.ip(), 0)),
        );
        let mut config = MetaConfig::new(db, fabric);
        config.token = require_token(self.token, self.token_file.as_deref())?;
        config.cluster = self.cluster;
        config.listen = self.listen;
        config.region_bytes = self.region_size.0;
        config.chunk_size = self.chunk_size.0;
        config.lock_unit = self.lock_unit.0;
        config.session_lease = Duration::from_secs(self.session_lease);
        config.lock_server = self.lock_server;
        config.connection_limits = ConnectionLimits {
            max_per_peer: self.max_connections_per_peer,
            max_pending: self.max_pending_handshakes,
            max_pending_per_peer: self.max_pending_handshakes_per_peer,
        };
        config.max_sessions = self.max_sessions;
        config.max_open_per_session = self.max_open_per_session;
        config.replicas = self.replicas;
        config.rereplicate_mib_s = self.rereplicate_rate;
        config.rereplicate_after = Duration::from_secs(self.rereplicate_after);
        if let Some(path) = self.local_rpc {
            config.local_rpc = Some(path);
        }
        Ok(config)
    }
}

/// Fuzz entry of the roles' settings files: the first byte selects the role (meta server,
/// data server, mount), the rest is its `--config` file (as UTF-8, invalid sequences
/// replaced); see `config::fuzz_settings_file` for what is checked. Settings that load are
/// also turned into the role's configuration, which must end in a value or an error.
#[cfg(any(test, feature = "fuzzing"))]
pub fn fuzz_config_file(data: &[u8]) {
    use super::config::fuzz_settings_file;
    let Some((&role, text)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(text);
    match role % 3 {
        0 => {
            fuzz_settings_file::<MetaServerConfig>(&text);
            if let Ok(settings) = super::config::load_str::<MetaServerConfig>(&text) {
                let _ = settings.server_config();
            }
        }
        1 => {
            fuzz_settings_file::<DataServerConfig>(&text);
            if let Ok(settings) = super::config::load_str::<DataServerConfig>(&text) {
                let _ = settings.server_config();
            }
        }
        _ => fuzz_settings_file::<MountConfig>(&text),
    }
}

/// Seeds for [`fuzz_config_file`]: each role's file with every setting, and with an unknown
/// key, a size in each notation, and a bad value.
#[cfg(test)]
pub fn fuzz_config_seeds() -> Vec<Vec<u8>> {
    use super::config::settings_file_seed;
    let files = [
        settings_file_seed::<MetaServerConfig>(),
        settings_file_seed::<DataServerConfig>(),
        settings_file_seed::<MountConfig>(),
    ];
    let mut seeds = Vec::new();
    for (role, file) in files.iter().enumerate() {
        for extra in [
            "",
            "no_such_key = 1\n",
            "chunk_size = \"4M\"\n",
            "chunk_size = 4096\n",
            "capacity = \"-1\"\n",
            "listen = \"not an address\"\n",
            "[table]\nx = 1\n",
        ] {
            let mut seed = vec![role as u8];
            seed.extend_from_slice(file.as_bytes());
            seed.extend_from_slice(extra.as_bytes());
            seeds.push(seed);
        }
    }
    seeds
}

/// Runs a meta server until SIGINT or SIGTERM.
pub fn meta_server(args: MetaArgs) -> Result<()> {
    let settings = args.load()?;
    init_logging(&settings.log)?;
    let metrics = settings.metrics;
    let config = settings.server_config()?;
    eprintln!(
        "citronfs meta-server: cluster {:?}, RPC on {}",
        config.cluster, config.listen
    );
    let handle = MetaServer::start(config)?;
    if let Some(addr) = metrics {
        let mut registry = super::metrics::registry();
        handle.register_metrics(&mut registry);
        let bound = super::metrics::serve(addr, registry)?;
        eprintln!("metrics: http://{bound}{}", super::metrics::METRICS_PATH);
    }
    MetaServer::serve_until_signal(handle)
}

/// Flags of `citronfs data-server`.
#[derive(Args, Debug, Default, Serialize)]
pub struct DataArgs {
    #[command(flatten)]
    #[serde(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    #[serde(flatten)]
    fabric: FabricArgs,
    /// A stable name: restarted with the same name, the server gets its chunks back; required.
    #[arg(long)]
    name: Option<String>,
    /// The meta server's RPC address.
    #[arg(long)]
    meta: Option<String>,
    /// Bytes of memory to serve.
    #[arg(long)]
    capacity: Option<Size>,
    /// Keep the data in a file in this directory, so that it survives a restart.
    #[arg(long)]
    backing_dir: Option<PathBuf>,
    /// The failure domain this server is in (a rack, a host, a power feed; any label): the
    /// replicas of a chunk go to data servers of distinct zones where there are enough, else to
    /// distinct servers [default: none, a zone of its own].
    #[arg(long)]
    zone: Option<String>,
    /// Serve Prometheus metrics over HTTP at this address (`GET /metrics`; port 0: any free
    /// port, printed at start) [default: none, no metrics].
    #[arg(long)]
    metrics: Option<SocketAddr>,
}

impl RoleArgs for DataArgs {
    type Config = DataServerConfig;
    fn common(&self) -> &CommonArgs {
        &self.common
    }
}

/// Settings of `citronfs data-server`; each field is a flag, a TOML key and a `CITRONFS_*`
/// variable of the same name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataServerConfig {
    /// The cluster's name ([`DEFAULT_CLUSTER`]).
    pub cluster: String,
    /// The cluster's shared secret; this or `token_file` is required.
    pub token: Option<String>,
    /// A file holding the cluster's shared secret, private to its owner.
    pub token_file: Option<PathBuf>,
    /// The log filter ([`DEFAULT_LOG`]).
    pub log: String,
    /// How clients reach the region ([`DEFAULT_ROLE_FABRIC`]).
    pub fabric: Backend,
    /// shm: the region's directory (`None`: `<shm root>/CLUSTER/NAME`).
    pub region_dir: Option<PathBuf>,
    /// tcp: where the fabric server listens (`None`: 127.0.0.1, any port).
    pub fabric_listen: Option<SocketAddr>,
    /// The server's stable name; required.
    pub name: Option<String>,
    /// The meta server's RPC address ([`DEFAULT_META_ADDR`]).
    pub meta: String,
    /// Bytes of memory to serve ([`DEFAULT_DATA_CAPACITY`]).
    pub capacity: Size,
    /// Keep the data in a file in this directory (`None`: memory only).
    pub backing_dir: Option<PathBuf>,
    /// The failure domain replicas are spread over (`None`: a zone of its own).
    pub zone: Option<String>,
    /// Where Prometheus metrics are served over HTTP (`None`: nowhere).
    pub metrics: Option<SocketAddr>,
}

impl Default for DataServerConfig {
    fn default() -> Self {
        DataServerConfig {
            cluster: DEFAULT_CLUSTER.into(),
            token: None,
            token_file: None,
            log: DEFAULT_LOG.into(),
            fabric: DEFAULT_ROLE_FABRIC,
            region_dir: None,
            fabric_listen: None,
            name: None,
            meta: DEFAULT_META_ADDR.to_string(),
            capacity: DEFAULT_DATA_CAPACITY,
            backing_dir: None,
            zone: None,
            metrics: None,
        }
    }
}

impl DataServerConfig {
    /// The data server's configuration, failing clearly on a missing name or token.
    pub fn server_config(self) -> Result<DataConfig> {
        let name = self.name.context("a data server needs a stable --name")?;
        if self.zone.as_deref().is_some_and(|z| z.trim().is_empty()) {
            anyhow::bail!("--zone must not be empty (leave it out for a zone of its own)");
        }
        let fabric = self.fabric.serve_at(
            self.region_dir
                .unwrap_or_else(|| default_region_dir(&self.cluster, &name)),
            self.fabric_listen
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0))),
        );
        Ok(DataConfig {
            token: require_token(self.token, self.token_file.as_deref())?,
            name,
            meta_addr: self.meta,
            cluster: self.cluster,
            capacity_bytes: self.capacity.0,
            fabric,
            backing: match self.backing_dir {
                Some(dir) => Backing::File { dir },
                None => Backing::Memory,
            },
            zone: self.zone,
        })
    }
}

/// Runs a data server until SIGINT or SIGTERM.
pub fn data_server(args: DataArgs) -> Result<()> {
    let mut signals = super::StopSignals::catch()?;
    // Nothing here is left broken by an exit at once but a server stopped without its goodbye.
    signals.orderly_from_now();
    let settings = args.load()?;
    init_logging(&settings.log)?;
    let metrics = settings.metrics;
    let mut handle = DataServer::start(settings.server_config()?)?;
    if let Some(addr) = metrics {
        // What the cluster's use of this server is, the meta server's metrics say
        // (`citronfs_meta_*`); here, that it is up and what it serves.
        let mut registry = super::metrics::registry();
        let region = prometheus_client::metrics::gauge::Gauge::<i64>::default();
        region.set(i64::try_from(handle.region_bytes()).unwrap_or(i64::MAX));
        registry.register(
            "data_region_bytes",
            "Bytes of memory this data server serves",
            region,
        );
        let bound = super::metrics::serve(addr, registry)?;
        eprintln!("metrics: http://{bound}{}", super::metrics::METRICS_PATH);
    }
    eprintln!(
        "citronfs data-server: id {}, serving {} bytes",
        handle.id(),
        handle.region_bytes()
    );
    super::wait_for_stop(&signals);
    handle.shutdown();
    Ok(())
}

/// Flags of `citronfs mount`.
#[derive(Args, Debug, Default, Serialize)]
pub struct MountArgs {
    /// Where to mount (an existing, empty directory).
    #[serde(skip)]
    mountpoint: PathBuf,
    #[command(flatten)]
    #[serde(flatten)]
    common: CommonArgs,
    /// The meta server's RPC address.
    #[arg(long)]
    meta: Option<String>,
    /// The range-lock scheme of every read and write: citron, mutex, seg, server, or a spec with
    /// parameters (e.g. seg:4:4096).
    #[arg(long, value_parser = value_parser!(LockScheme))]
    scheme: Option<LockScheme>,
    /// How reads lock their byte ranges: shared (overlapping reads run together; writes still
    /// exclude them) or exclusive (as writes: for comparison).
    #[arg(long, value_parser = value_parser!(LockMode))]
    read_locks: Option<LockMode>,
    /// Restrict the mount to the mounting user. Without it every local user may use the mount,
    /// with the kernel checking permissions (allow_other + default_permissions), which needs
    /// root or `user_allow_other` in /etc/fuse.conf.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    private: Option<bool>,
    /// Milliseconds connecting to a tcp fabric server may take before it is declared
    /// unreachable.
    #[arg(long)]
    connect_timeout_ms: Option<u64>,
    /// Milliseconds one batch of verbs to a tcp fabric server may take before the call fails
    /// with EIO (a cut link or a frozen host).
    #[arg(long)]
    batch_timeout_ms: Option<u64>,
    /// Threads per CPU serving the kernel's requests over FUSE-over-io_uring rings, where the
    /// kernel offers them (Linux 6.14+ with /sys/module/fuse/parameters/enable_uring = Y);
    /// 0 keeps /dev/fuse only.
    #[arg(long)]
    fuse_ring_threads: Option<usize>,
    /// Serve Prometheus metrics over HTTP at this address (`GET /metrics`; port 0: any free
    /// port, printed at start) [default: none, no metrics].
    #[arg(long)]
    metrics: Option<SocketAddr>,
}

impl RoleArgs for MountArgs {
    type Config = MountConfig;
    fn common(&self) -> &CommonArgs {
        &self.common
    }
}

/// Settings of `citronfs mount`; each field is a flag, a TOML key and a `CITRONFS_*` variable
/// of the same name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountConfig {
    /// The cluster's name ([`DEFAULT_CLUSTER`]).
    pub cluster: String,
    /// The cluster's shared secret; this or `token_file` is required.
    pub token: Option<String>,
    /// A file holding the cluster's shared secret, private to its owner.
    pub token_file: Option<PathBuf>,
    /// The log filter ([`DEFAULT_LOG`]).
    pub log: String,
    /// The meta server's RPC address ([`DEFAULT_META_ADDR`]).
    pub meta: String,
    /// The lock scheme (`LockScheme::CITRON`).
    pub scheme: LockScheme,
    /// The mode of a read's range lock (`MountOptions::read_locks`: shared).
    pub read_locks: LockMode,
    /// Restrict the mount to the mounting user (else shared: `FuseOptions::allow_other`).
    pub private: bool,
    /// Milliseconds a tcp fabric connect may take (`fabric::tcp::CONNECT_TIMEOUT`).
    pub connect_timeout_ms: u64,
    /// Milliseconds one tcp batch may take (`fabric::tcp::BATCH_TIMEOUT`).
    pub batch_timeout_ms: u64,
    /// FUSE-over-io_uring threads per CPU (`FuseOptions::ring_threads_per_cpu`).
    pub fuse_ring_threads: usize,
    /// Where Prometheus metrics are served over HTTP (`None`: nowhere).
    pub metrics: Option<SocketAddr>,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            cluster: DEFAULT_CLUSTER.into(),
            token: None,
            token_file: None,
            log: DEFAULT_LOG.into(),
            meta: DEFAULT_META_ADDR.to_string(),
            scheme: LockScheme::CITRON,
            read_locks: LockMode::Shared,
            private: false,
            connect_timeout_ms: fabric::tcp::CONNECT_TIMEOUT.as_millis() as u64,
            batch_timeout_ms: fabric::tcp::BATCH_TIMEOUT.as_millis() as u64,
            fuse_ring_threads: fs_client::fuse::FuseOptions::default().ring_threads_per_cpu,
            metrics: None,
        }
    }
}

/// Mounts a cluster and serves the mount until SIGINT or SIGTERM, then unmounts.
pub fn mount(args: MountArgs) -> Result<()> {
    mount_with(args, None, |mount| {
        eprintln!(
            "citronfs mounted at {}; Ctrl-C (or fusermount3 -u) unmounts",
            mount.path().display()
        );
        eprintln!("atomic I/O: {}", atomic_bound_line(mount.io_limits()));
        eprintln!("FUSE requests over: {}", mount.fuse_rings());
    })
}

/// The settings of `citronfs mount` checked as far as they can be without connecting: loaded,
/// the token read (from its file), a shared mount allowed to this user.
pub fn check_mount_settings(args: &MountArgs) -> Result<MountConfig> {
    let settings = args.load()?;
    require_token(settings.token.clone(), settings.token_file.as_deref())?;
    if !settings.private {
        fs_client::fuse::other_users_allowed().map_err(anyhow::Error::msg)?;
    }
    Ok(settings)
}

/// [`mount`], the mount table showing `source` as the mount's source (`None`: the file
/// system's name), and `mounted` called once the mount is up, before serving it until SIGINT
/// or SIGTERM or an unmount from outside (`umount DIR`).
pub fn mount_with(
    args: MountArgs,
    source: Option<String>,
    mounted: impl FnOnce(&Mount),
) -> Result<()> {
    let mut signals = super::StopSignals::catch()?;
    let settings = args.load()?;
    init_logging(&settings.log)?;
    if !settings.private {
        // Said before connecting: a shared mount this user may not make is a usage error.
        fs_client::fuse::other_users_allowed().map_err(anyhow::Error::msg)?;
    }
    let mut options = MountOptions::new(
        settings.meta,
        settings.cluster,
        require_token(settings.token, settings.token_file.as_deref())?,
    );
    options.scheme = settings.scheme;
    options.read_locks = settings.read_locks;
    options.fabric_timeouts = fabric::TcpTimeouts {
        connect: Duration::from_millis(settings.connect_timeout_ms),
        batch: Duration::from_millis(settings.batch_timeout_ms),
        ..fabric::TcpTimeouts::DEFAULT
    };
    let fs =
        CitronFs::connect(options).map_err(|e| anyhow::anyhow!("cannot reach the cluster: {e}"))?;
    signals.orderly_from_now();
    if signals.received() {
        eprintln!("citronfs mount: told to stop while connecting; not mounted");
        return Ok(());
    }
    let fs = Arc::new(fs);
    let fuse = fs_client::fuse::FuseOptions {
        allow_other: !settings.private,
        ring_threads_per_cpu: settings.fuse_ring_threads,
        source,
        metrics: settings.metrics.map(|_| FuseMetrics::new()),
        ..Default::default()
    };
    if let (Some(addr), Some(fuse_metrics)) = (settings.metrics, &fuse.metrics) {
        let mut registry = super::metrics::registry();
        fuse_metrics.register(&mut registry);
        fs_client::metrics::register_client(&mut registry, &fs);
        let bound = super::metrics::serve(addr, registry)?;
        eprintln!("metrics: http://{bound}{}", super::metrics::METRICS_PATH);
    }
    let mount = Mount::at(fs, &args.mountpoint, &fuse)?;
    mounted(&mount);
    mount.wait_for_signal(signals.flag()).context("unmount")
}

/// What `citronfs mount` and `citronfs up` say about the mount's atomic I/O bound: the size up
/// to which every read and write call is atomic, for any alignment of the user's buffer, and,
/// when it falls short of 16 MiB, why and what to do.
pub fn atomic_bound_line(l: fs_client::fuse::IoLimits) -> String {
    use fs_client::fuse::{ATOMIC_IO_TARGET, MAX_PAGES_LIMIT_SYSCTL};
    let mut line = format!(
        "reads and writes up to {} bytes{} are atomic, for any buffer alignment \
         (max_write {}, max_pages {}); larger ones are cut into atomic pieces",
        l.atomic_bound,
        if l.atomic_bound % (1 << 20) == 0 {
            format!(" ({} MiB)", l.atomic_bound >> 20)
        } else {
            String::new()
        },
        l.max_write,
        l.max_pages,
    );
    if l.atomic_bound < ATOMIC_IO_TARGET {
        line.push_str(&format!(
            "; NOT {} MiB: {}",
            ATOMIC_IO_TARGET >> 20,
            if !l.max_pages_supported {
                "the kernel lacks FUSE_MAX_PAGES".to_string()
            } else if l.max_pages_limit.is_none() {
                format!("this kernel has no {MAX_PAGES_LIMIT_SYSCTL} (Linux 6.13+)")
            } else {
                format!(
                    "mount as root (with /proc/sys writable), or set {MAX_PAGES_LIMIT_SYSCTL} \
                     to {} beforehand",
                    l.max_pages_asked
                )
            }
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::config::ENV_PREFIX;
    use clap::FromArgMatches;
    use figment::Jail;

    /// The subcommand `role` parsed from `args`, through the real command line.
    fn parse(role: &str, args: &[&str]) -> crate::Command {
        let argv = ["citronfs", role].into_iter().chain(args.iter().copied());
        let matches = crate::command()
            .try_get_matches_from(argv)
            .unwrap_or_else(|e| panic!("{e}"));
        crate::Cli::from_arg_matches(&matches).unwrap().command
    }

    fn meta_args(args: &[&str]) -> MetaArgs {
        match parse("meta-server", args) {
            crate::Command::MetaServer(a) => a,
            _ => unreachable!(),
        }
    }

    fn data_args(args: &[&str]) -> DataArgs {
        match parse("data-server", args) {
            crate::Command::DataServer(a) => a,
            _ => unreachable!(),
        }
    }

    fn mount_args(args: &[&str]) -> MountArgs {
        match parse("mount", args) {
            crate::Command::Mount(a) => a,
            _ => unreachable!(),
        }
    }

    /// Runs `f` in a figment jail (its own directory, environment restored afterwards, one jail
    /// at a time) with no `CITRONFS_*` variable from outside.
    fn jailed(f: impl FnOnce(&mut Jail) -> Result<()>) {
        // The closure's error type is figment's, which Jail asks for.
        #[allow(clippy::result_large_err)]
        Jail::expect_with(|jail| {
            jail.clear_env();
            f(jail).map_err(|e| figment::Error::from(format!("{e:#}")))
        });
    }

    /// The roles' settings files under the stable fuzzer (see `fabric::fuzz`).
    #[test]
    fn fuzz_config_files() {
        let seeds = fuzz_config_seeds();
        let report = fabric::fuzz::run(
            "config files",
            &seeds,
            fabric::fuzz::DEFAULT_BUDGET,
            fuzz_config_file,
        );
        assert!(report.execs > seeds.len() as u64);
    }

    #[test]
    fn a_flag_overrides_the_file() {
        jailed(|jail| {
            jail.create_file(
                "meta.toml",
                "chunk_size = \"2M\"\ncluster = \"from-file\"\ntoken = \"t\"\nsession_lease = 3",
            )?;
            let args = meta_args(&["--config", "meta.toml", "--chunk-size", "4M"]);
            let config = args.load()?;
            assert_eq!(config.chunk_size, Size(4 << 20), "the flag wins");
            assert_eq!(config.cluster, "from-file", "no flag: the file's value");
            assert_eq!(config.session_lease, 3);
            assert_eq!(config.lock_unit, MetaServerConfig::default().lock_unit);
            Ok(())
        });
    }

    #[test]
    fn the_environment_overrides_the_file_and_a_flag_overrides_the_environment() {
        jailed(|jail| {
            jail.create_file(
                "data.toml",
                "capacity = \"64M\"\nmeta = \"file:1\"\nname = \"from-file\"\ncluster = \"file\"",
            )?;
            jail.set_env(format!("{ENV_PREFIX}CAPACITY"), "128M");
            jail.set_env(format!("{ENV_PREFIX}META"), "env:2");
            jail.set_env(format!("{ENV_PREFIX}NAME"), "from-env");
            let args = data_args(&["--config", "data.toml", "--meta", "flag:3"]);
            let config = args.load()?;
            assert_eq!(config.capacity, Size(128 << 20), "env over file");
            assert_eq!(config.name.as_deref(), Some("from-env"), "env over file");
            assert_eq!(config.meta, "flag:3", "flag over env");
            assert_eq!(config.cluster, "file", "file over default");
            Ok(())
        });
    }

    #[test]
    fn an_unknown_key_in_the_file_is_an_error_naming_it() {
        jailed(|jail| {
            jail.create_file("meta.toml", "chunk_sise = \"2M\"\n")?;
            let err = meta_args(&["--config", "meta.toml"]).load().unwrap_err();
            let text = format!("{err:#}");
            assert!(text.contains("chunk_sise"), "{text}");
            assert!(text.contains("meta.toml"), "names the file: {text}");
            // A key of another role is unknown here too.
            jail.create_file("mount.toml", "private = true\n")?;
            let err = meta_args(&["--config", "mount.toml"]).load().unwrap_err();
            assert!(format!("{err:#}").contains("private"), "{err:#}");
            Ok(())
        });
    }

    #[test]
    fn a_missing_config_file_is_an_error() {
        jailed(|_| {
            let err = mount_args(&["/mnt", "--config", "nowhere.toml"])
                .load()
                .unwrap_err();
            assert!(format!("{err:#}").contains("nowhere.toml"), "{err:#}");
            Ok(())
        });
    }

    #[test]
    fn other_roles_variables_are_ignored_and_values_stay_strings() {
        jailed(|jail| {
            // `name` is a data server's setting, not the meta server's: ignored here, not an
            // unknown key. A numeric token stays a string.
            jail.set_env(format!("{ENV_PREFIX}NAME"), "ds-9");
            jail.set_env(format!("{ENV_PREFIX}TOKEN"), "0123456789");
            jail.set_env(format!("{ENV_PREFIX}SESSION_LEASE"), "7");
            jail.set_env(format!("{ENV_PREFIX}FABRIC"), "shm");
            let config = meta_args(&[]).load()?;
            assert_eq!(config.token.as_deref(), Some("0123456789"));
            assert_eq!(config.session_lease, 7);
            assert_eq!(config.fabric, Backend::Shm);
            assert!(!mount_args(&["/mnt"]).load()?.private, "shared by default");
            jail.set_env(format!("{ENV_PREFIX}PRIVATE"), "true");
            assert!(mount_args(&["/mnt"]).load()?.private);
            Ok(())
        });
    }

    #[test]
    fn the_token_comes_from_a_flag_the_environment_or_the_file_or_is_missing_clearly() {
        jailed(|jail| {
            let missing = meta_args(&["--db", "db"])
                .load()?
                .server_config()
                .unwrap_err();
            assert_eq!(
                missing.to_string(),
                require_token(None, None).unwrap_err().to_string()
            );
            assert!(missing.to_string().contains("--token"), "{missing}");
            jail.create_file("meta.toml", "token = \"file\"\n")?;
            let token = |args: &[&str]| -> Result<String> {
                Ok(meta_args(args).load()?.server_config()?.token)
            };
            assert_eq!(token(&["--db", "db", "--config", "meta.toml"])?, "file");
            jail.set_env(format!("{ENV_PREFIX}TOKEN"), "env");
            assert_eq!(token(&["--db", "db", "--config", "meta.toml"])?, "env");
            assert_eq!(
                token(&["--db", "db", "--config", "meta.toml", "--token", "flag"])?,
                "flag"
            );
            Ok(())
        });
    }

    #[test]
    fn the_token_comes_from_a_private_token_file() {
        use std::os::unix::fs::PermissionsExt;
        jailed(|jail| {
            let dir = jail.directory().to_path_buf();
            let file = dir.join("token");
            std::fs::write(&file, "s3cret\n")?;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))?;
            let token = |args: &[&str]| -> Result<String> {
                Ok(meta_args(args).load()?.server_config()?.token)
            };
            let path = file.to_str().unwrap();
            assert_eq!(token(&["--db", "db", "--token-file", path])?, "s3cret");
            // As a key of the --config file, and of the environment.
            jail.create_file("meta.toml", &format!("token_file = {path:?}\n"))?;
            assert_eq!(token(&["--db", "db", "--config", "meta.toml"])?, "s3cret");
            // Given twice: refused, naming both.
            let twice = token(&["--db", "db", "--token-file", path, "--token", "t"]).unwrap_err();
            assert!(format!("{twice:#}").contains("given twice"), "{twice:#}");
            // Readable by others: refused, saying how to fix it.
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644))?;
            let open = token(&["--db", "db", "--token-file", path]).unwrap_err();
            let text = format!("{open:#}");
            assert!(
                text.contains("mode 0644") && text.contains("chmod 600"),
                "{text}"
            );
            // Empty, or missing: refused.
            std::fs::write(&file, "\n")?;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o400))?;
            let empty = token(&["--db", "db", "--token-file", path]).unwrap_err();
            assert!(format!("{empty:#}").contains("empty"), "{empty:#}");
            let none = token(&["--db", "db", "--token-file", "nowhere"]).unwrap_err();
            assert!(format!("{none:#}").contains("nowhere"), "{none:#}");
            Ok(())
        });
    }

    #[test]
    fn defaults_come_from_one_place() {
        jailed(|_| {
            // Nothing given: exactly each struct's `Default`...
            assert_eq!(meta_args(&[]).load()?, MetaServerConfig::default());
            assert_eq!(data_args(&[]).load()?, DataServerConfig::default());
            assert_eq!(mount_args(&["/mnt"]).load()?, MountConfig::default());
            Ok(())
        });
        // ... whose values are the servers' own constants ...
        let meta = MetaServerConfig::default();
        assert_eq!(meta.chunk_size.0, meta_server::DEFAULT_CHUNK_SIZE);
        assert_eq!(meta.lock_unit.0, meta_server::DEFAULT_LOCK_UNIT);
        assert_eq!(meta.region_size.0, meta_server::DEFAULT_REGION_BYTES);
        assert_eq!(
            Duration::from_secs(meta.session_lease),
            meta_server::DEFAULT_SESSION_LEASE
        );
        // ... which the server configuration keeps ...
        let mut with_db = meta.clone();
        with_db.db = Some("db".into());
        with_db.token = Some("t".into());
        let server = with_db.server_config().unwrap();
        let library = MetaConfig::new("db", server.fabric.clone());
        assert_eq!(
            (server.chunk_size, server.lock_unit, server.region_bytes),
            (library.chunk_size, library.lock_unit, library.region_bytes)
        );
        assert_eq!(server.session_lease, library.session_lease);
        // ... and which `--help` shows, rendered from the structs, not from the doc strings.
        let help = |role: &str| {
            crate::command()
                .find_subcommand_mut(role)
                .expect("the role exists")
                .render_long_help()
                .to_string()
        };
        let meta_help = help("meta-server");
        for shown in [
            meta.chunk_size.to_string(),
            meta.lock_unit.to_string(),
            meta.region_size.to_string(),
            meta.session_lease.to_string(),
            meta.listen.to_string(),
            meta.cluster.clone(),
            meta.log.clone(),
        ] {
            assert!(
                meta_help.contains(&format!("[default: {shown}]")),
                "{shown} missing from:\n{meta_help}"
            );
        }
        let data_help = help("data-server");
        assert!(data_help.contains(&format!("[default: {}]", DEFAULT_DATA_CAPACITY)));
        assert!(help("mount").contains(&format!("[default: {}]", DEFAULT_META_ADDR)));
    }

    /// Every flag of a role is a key of its settings and every key has a flag: a flag whose
    /// value would be dropped, or a setting that no flag can give, fails here.
    #[test]
    fn flags_and_settings_name_the_same_keys() {
        fn keys<C: Serialize + Default>() -> Vec<String> {
            let mut keys: Vec<String> = figment::value::Value::serialize(C::default())
                .unwrap()
                .into_dict()
                .unwrap()
                .into_keys()
                .collect();
            keys.sort();
            keys
        }
        let flags = |role: &str| {
            let mut cli = crate::command();
            let sub = cli.find_subcommand_mut(role).expect("the role exists");
            let mut ids: Vec<String> = sub
                .get_arguments()
                .filter(|a| a.get_long().is_some())
                .map(|a| a.get_id().to_string())
                .filter(|id| !["config", "help", "version"].contains(&id.as_str()))
                .collect();
            ids.sort();
            ids
        };
        assert_eq!(flags("meta-server"), keys::<MetaServerConfig>());
        assert_eq!(flags("data-server"), keys::<DataServerConfig>());
        assert_eq!(flags("mount"), keys::<MountConfig>());
    }

    #[test]
    fn every_existing_flag_name_still_parses() {
        jailed(|_| {
            let meta = meta_args(&[
                "--cluster",
                "c",
                "--token",
                "t",
                "--listen",
                "127.0.0.1:7701",
                "--db",
                "db",
                "--fabric",
                "shm",
                "--region-dir",
                "r",
                "--fabric-listen",
                "127.0.0.1:0",
                "--region-size",
                "2M",
                "--chunk-size",
                "64K",
                "--lock-unit",
                "512",
                "--session-lease",
                "5",
                "--log",
                "info",
            ])
            .load()?;
            let server = meta.server_config()?;
            assert_eq!(server.cluster, "c");
            assert_eq!(server.listen, "127.0.0.1:7701".parse()?);
            assert_eq!(server.fabric, fabric::ServeAt::Shm { dir: "r".into() });
            assert_eq!(
                (server.region_bytes, server.chunk_size, server.lock_unit),
                (2 << 20, 64 << 10, 512)
            );
            assert_eq!(server.session_lease, Duration::from_secs(5));
            let data = data_args(&[
                "--name",
                "ds",
                "--meta",
                "m:1",
                "--cluster",
                "c",
                "--token",
                "t",
                "--capacity",
                "8M",
                "--fabric",
                "tcp",
                "--fabric-listen",
                "127.0.0.1:9",
                "--backing-dir",
                "b",
                "--region-dir",
                "r",
            ])
            .load()?
            .server_config()?;
            assert_eq!(
                data.fabric,
                fabric::ServeAt::Tcp {
                    listen: "127.0.0.1:9".parse()?
                }
            );
            assert_eq!(data.backing, Backing::File { dir: "b".into() });
            assert_eq!(
                (data.capacity_bytes, data.meta_addr.as_str()),
                (8 << 20, "m:1")
            );
            let mount = mount_args(&[
                "/mnt",
                "--meta",
                "m:1",
                "--cluster",
                "c",
                "--token",
                "t",
                "--scheme",
                "mutex",
                "--read-locks",
                "exclusive",
                "--private",
            ])
            .load()?;
            assert_eq!(mount.scheme, LockScheme::MUTEX);
            assert_eq!(mount.read_locks, LockMode::Exclusive);
            assert!(mount.private);
            Ok(())
        });
    }

    #[test]
    fn region_directories_and_listen_addresses_default_from_the_other_settings() {
        let meta = MetaServerConfig {
            db: Some("db".into()),
            token: Some("t".into()),
            cluster: "prod".into(),
            listen: "10.1.2.3:7700".parse().unwrap(),
            ..MetaServerConfig::default()
        };
        let tcp = meta.clone().server_config().unwrap();
        assert_eq!(
            tcp.fabric,
            fabric::ServeAt::Tcp {
                listen: "10.1.2.3:0".parse().unwrap()
            }
        );
        assert_eq!(tcp.local_rpc, None, "no local socket on tcp by default");
        let shm = MetaServerConfig {
            fabric: Backend::Shm,
            ..meta.clone()
        };
        let shm = shm.server_config().unwrap();
        assert_eq!(
            shm.fabric,
            fabric::ServeAt::Shm {
                dir: default_region_dir("prod", "meta")
            }
        );
        assert_eq!(
            shm.local_rpc,
            Some(default_region_dir("prod", "meta").join(meta_server::LOCAL_RPC_SOCKET)),
            "the local socket in the shm region's directory"
        );
        let chosen = MetaServerConfig {
            local_rpc: Some("/run/citronfs/meta.sock".into()),
            ..meta
        };
        assert_eq!(
            chosen.server_config().unwrap().local_rpc,
            Some("/run/citronfs/meta.sock".into()),
            "--local-rpc on tcp"
        );
        let data = DataServerConfig {
            name: Some("ds-1".into()),
            token: Some("t".into()),
            fabric: Backend::Shm,
            ..DataServerConfig::default()
        };
        assert_eq!(
            data.server_config().unwrap().fabric,
            fabric::ServeAt::Shm {
                dir: default_region_dir(DEFAULT_CLUSTER, "ds-1")
            }
        );
        let nameless = DataServerConfig {
            token: Some("t".into()),
            ..DataServerConfig::default()
        };
        assert!(nameless
            .server_config()
            .unwrap_err()
            .to_string()
            .contains("--name"));
    }
}
