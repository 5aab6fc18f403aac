//! [`Cluster`]: a meta server and data servers in this process, started as a [`ClusterSpec`]
//! says.
//!
//! Layout of a cluster's directories (the same for `citronfs up`, the benchmarks and the tests, so that a
//! `--state-dir` written by one run is read by the next):
//! - the *state directory* (the spec's `state_dir`, else the run directory): `meta-db/` (the
//!   namespace, sled) and, for file-backed data servers, `ds-N/` (data server N's region file);
//! - the *run directory*, always fresh and removed on drop, under [`run_dir_parent`]:
//!   the shm regions of the meta server (`meta/`) and of memory-backed data servers (`ds-N/`).
//!   It is named `CLUSTER-PID-XXXXXX` after the process that made it, so that what a process
//!   killed outright (SIGKILL) could not remove is found and removed when this user next
//!   starts a cluster of that name ([`sweep_stale_run_dirs`]).

use crate::mount::{fuse_options, Mount};
use crate::util::random_token;
use anyhow::{Context, Result};
use data_server::{Backing, DataConfig, DataHandle, DataServer};
use fabric::{Backend, ServeAt};
use fs_client::{CitronFs, LockScheme, MountOptions};
use meta_server::{MetaConfig, MetaHandle, MetaServer};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Where a server of this cluster serves: shm from `shm_dir`; tcp on loopback, any port
/// (servers tell clients the bound address); mem in this process.
fn serve_at(backend: Backend, shm_dir: PathBuf) -> ServeAt {
    backend.serve_at(shm_dir, LOOPBACK_ANY_PORT)
}

/// Where a [`Cluster`]'s tcp servers listen: loopback, any port.
const LOOPBACK_ANY_PORT: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::LOCALHOST,
    0,
));

/// What holds the data servers' regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackingKind {
    /// Memory only: lost when a data server stops.
    Memory,
    /// A region file in the state directory: kept across [`Cluster::restart`] (and, with a
    /// given `state_dir`, across processes).
    File,
}

/// The chunk size of [`ClusterSpec::default`]: small, so that modest files in tests cross
/// chunk and server boundaries.
pub const TEST_CHUNK_SIZE: u64 = 64 << 10;

/// What [`Cluster::start`] starts. [`ClusterSpec::default`] is test-sized; `citronfs up`
/// starts from [`ClusterSpec::server_defaults`].
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// The cluster's name (clients and data servers must name it; also the prefix of the run
    /// directory).
    pub name: String,
    /// The cluster's shared secret; `None`: a fresh random one (see [`Cluster::token`]).
    pub token: Option<String>,
    /// How many data servers (0 is allowed: a namespace-only cluster).
    pub data_servers: usize,
    /// Bytes of each data server's region (the meta server divides it into chunks).
    pub capacity: u64,
    /// Bytes per chunk (a power of two of at least 4096).
    pub chunk_size: u64,
    /// Bytes of the meta region (file control blocks and lock state of open files).
    pub meta_region_bytes: u64,
    /// The fabric of the meta region and the data servers.
    pub fabric: Backend,
    /// What holds the data servers' regions.
    pub backing: BackingKind,
    /// Keep the namespace (and file-backed regions) in this directory; `None`: in the run
    /// directory, removed on drop.
    pub state_dir: Option<PathBuf>,
    /// The lock scheme of [`Cluster::client`] and [`Cluster::mount`].
    pub scheme: LockScheme,
    /// How long a client session lives without a request.
    pub session_lease: Duration,
    /// Silence after which a `Fence` revokes a session.
    pub fence_after: Duration,
    /// `T_lease` of every file's CITRON lock (must exceed 4 × `fence_after`).
    pub lock_lease: Duration,
    /// Run the lock server of the schemes that keep their locks at a lock service (a baseline;
    /// on anyway when `scheme` is one; off unless a client will lock with one).
    pub lock_server: bool,
    /// Files one client session may have open at once (beyond: EMFILE).
    pub max_open_per_session: usize,
    /// Record locks one client session may hold at once (beyond: ENOLCK).
    pub max_record_locks_per_session: usize,
    /// How long the meta server polls a connection for its next request
    /// (`MetaConfig::idle_poll`).
    pub meta_idle_poll: Duration,
    /// Replicas of every chunk (`MetaConfig::replicas`).
    pub replicas: usize,
    /// The failure domain of each data server, by index (`DataConfig::zone`); data servers
    /// beyond the list name none.
    pub zones: Vec<String>,
    /// Re-replication's rate limit in MiB/s, 0 for none (`MetaConfig::rereplicate_mib_s`).
    pub rereplicate_mib_s: u64,
    /// How long after a data server is marked down its chunks are re-replicated
    /// (`MetaConfig::rereplicate_after`).
    pub rereplicate_after: Duration,
}

impl Default for ClusterSpec {
    /// Test-sized: two memory-backed data servers of 16 MiB on the default fabric
    /// ([`Backend::default`]), [`TEST_CHUNK_SIZE`] chunks, a 16 MiB meta region, the default
    /// lock scheme ([`LockScheme::default`]), a random token, a temporary state directory, and
    /// the meta server's leases.
    fn default() -> Self {
        ClusterSpec {
            name: "citronfs-test".into(),
            token: None,
            data_servers: 2,
            capacity: 16 << 20,
            chunk_size: TEST_CHUNK_SIZE,
            meta_region_bytes: 16 << 20,
            fabric: Backend::default(),
            backing: BackingKind::Memory,
            state_dir: None,
            scheme: LockScheme::default(),
            session_lease: meta_server::DEFAULT_SESSION_LEASE,
            fence_after: meta_server::DEFAULT_FENCE_AFTER,
            lock_lease: meta_server::DEFAULT_LOCK_LEASE,
            lock_server: false,
            max_open_per_session: meta_server::DEFAULT_MAX_OPEN_PER_SESSION,
            max_record_locks_per_session: meta_server::DEFAULT_MAX_RECORD_LOCKS_PER_SESSION,
            meta_idle_poll: meta_server::default_idle_poll(),
            replicas: meta_server::DEFAULT_REPLICAS,
            zones: Vec::new(),
            rereplicate_mib_s: meta_server::DEFAULT_REREPLICATE_MIB_S,
            rereplicate_after: meta_server::DEFAULT_REREPLICATE_AFTER,
        }
    }
}

impl ClusterSpec {
    /// [`ClusterSpec::default`] with the meta server's own chunk size and meta region size
    /// (`meta_server::DEFAULT_CHUNK_SIZE`, `DEFAULT_REGION_BYTES`): what a user's cluster runs
    /// with, for `citronfs up` and the benchmarks.
    pub fn server_defaults() -> Self {
        ClusterSpec {
            chunk_size: meta_server::DEFAULT_CHUNK_SIZE,
            meta_region_bytes: meta_server::DEFAULT_REGION_BYTES,
            ..ClusterSpec::default()
        }
    }

    /// This spec with `servers` data servers of `chunks` chunks each (of the spec's chunk
    /// size, so set that first).
    pub fn with_data_servers(self, servers: usize, chunks: u64) -> Self {
        ClusterSpec {
            data_servers: servers,
            capacity: chunks * self.chunk_size,
            ..self
        }
    }
}

/// A meta server and data servers running in this process. Dropping it stops the servers
/// (the meta server first) and removes the run directory, whatever happened before.
pub struct Cluster {
    // Field order is drop order: the meta server first (its shutdown persists open files' sizes
    // and flushes the namespace, which needs no data server), then the data servers, then the
    // directory they live in.
    meta: MetaHandle,
    data: Vec<DataHandle>,
    /// What the meta server was started with; a restart reuses it (`listen` pinned to the
    /// first run's address, so that data servers and tests need not learn a new one).
    meta_config: MetaConfig,
    spec: ClusterSpec,
    token: String,
    /// The state directory (see the module docs).
    state: PathBuf,
    /// The run directory (see the module docs).
    run: tempfile::TempDir,
}

impl Cluster {
    /// Starts the meta server, then the data servers (which register with it), as `spec`
    /// says.
    pub fn start(spec: ClusterSpec) -> Result<Cluster> {
        let parent = run_dir_parent();
        sweep_stale_run_dirs(&parent, &spec.name);
        let run = tempfile::Builder::new()
            .prefix(&format!("{}-{}-", spec.name, std::process::id()))
            .tempdir_in(&parent)
            .context("create the cluster's run directory")?;
        let state = match &spec.state_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("create the state directory {}", dir.display()))?;
                dir.clone()
            }
            None => run.path().to_path_buf(),
        };
        let token = match &spec.token {
            Some(token) => token.clone(),
            None => random_token()?,
        };

        let mut config = MetaConfig::new(
            state.join("meta-db"),
            serve_at(spec.fabric, run.path().join("meta")),
        );
        config.cluster = spec.name.clone();
        config.token = token.clone();
        config.chunk_size = spec.chunk_size;
        config.region_bytes = spec.meta_region_bytes;
        config.session_lease = spec.session_lease;
        config.fence_after = spec.fence_after;
        config.lock_lease = spec.lock_lease;
        config.lock_server = spec.lock_server || spec.scheme.uses_service();
        config.max_open_per_session = spec.max_open_per_session;
        config.max_record_locks_per_session = spec.max_record_locks_per_session;
        config.replicas = spec.replicas;
        config.rereplicate_mib_s = spec.rereplicate_mib_s;
        config.rereplicate_after = spec.rereplicate_after;
        config.idle_poll = spec.meta_idle_poll;
        let meta = MetaServer::start(config.clone()).context("start the meta server")?;
        // A restart comes back where clients knew it, as a deployment with fixed ports does:
        // the RPC service at its address, and the meta region where the fabric serves it again
        // (`ServeAt::again_at`: tcp at its port) — so that a client behind a restart meets the
        // new run there, not a refused connection.
        config.listen = meta.addr();
        config.fabric = config
            .fabric
            .again_at(meta.fabric_addr())
            .context("where the meta region serves again")?;
        let mut cluster = Cluster {
            meta,
            data: Vec::new(),
            meta_config: config,
            spec,
            token,
            state,
            run,
        };
        cluster.start_data_servers()?;
        Ok(cluster)
    }

    fn start_data_servers(&mut self) -> Result<()> {
        for i in 0..self.spec.data_servers {
            let config = self.data_config(i);
            let handle = DataServer::start(config)
                .with_context(|| format!("start data server {}", data_server_name(i)))?;
            self.data.push(handle);
        }
        Ok(())
    }

    /// The configuration data server `i` is (or would be) started with: named `ds-i` (a
    /// restart with the same name gets the same id and chunks back), in zone `zones[i]` if the
    /// spec names one. For a test that starts one more, changed.
    pub fn data_config(&self, i: usize) -> DataConfig {
        let name = data_server_name(i);
        let backing = match self.spec.backing {
            BackingKind::Memory => Backing::Memory,
            BackingKind::File => Backing::File {
                dir: self.state.join(&name),
            },
        };
        // A file-backed shm region is served from its backing directory (clients attach where
        // the file is); naming that directory as the shm directory too keeps the data server
        // from warning about a mismatch.
        let shm_dir = match &backing {
            Backing::File { dir } => dir.clone(),
            Backing::Memory => self.run.path().join(&name),
        };
        DataConfig {
            name,
            meta_addr: self.meta.addr().to_string(),
            cluster: self.spec.name.clone(),
            token: self.token.clone(),
            capacity_bytes: self.spec.capacity,
            fabric: serve_at(self.spec.fabric, shm_dir),
            backing,
            zone: self.spec.zones.get(i).cloned(),
        }
    }

    /// What the cluster was started with.
    pub fn spec(&self) -> &ClusterSpec {
        &self.spec
    }

    /// The cluster's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The cluster's shared secret (the spec's, or the random one it was given).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The cluster's credentials, as every server checks them in the handshake.
    pub fn credentials(&self) -> fabric::Credentials {
        fabric::Credentials::new(self.spec.name.clone(), self.token.clone())
    }

    /// A raw client session with the meta server on one connection that many threads share
    /// (`proto::rpc::SharedClient`, as `fs-client` uses it), each call bounded by 10 s: to ask
    /// the meta server directly (the cluster's state), or to test the RPC protocol itself.
    pub fn rpc_client(&self) -> Result<proto::rpc::SharedClient> {
        Ok(proto::rpc::SharedClient::connect(
            self.meta_addr(),
            &self.credentials(),
            proto::rpc::Role::Client {
                host: "cluster".into(),
                pid: std::process::id(),
            },
            Some(Duration::from_secs(10)),
        )?)
    }

    /// The meta server.
    pub fn meta(&self) -> &MetaHandle {
        &self.meta
    }

    /// The meta server's RPC address (the same after a restart).
    pub fn meta_addr(&self) -> SocketAddr {
        self.meta.addr()
    }

    /// The running data servers, in start order (`ds-0` first).
    pub fn data_servers(&self) -> &[DataHandle] {
        &self.data
    }

    /// The running data servers, to stop one (`DataHandle::shutdown`) while the rest run.
    pub fn data_servers_mut(&mut self) -> &mut [DataHandle] {
        &mut self.data
    }

    /// The state directory: the namespace database and file-backed regions.
    pub fn state_dir(&self) -> &Path {
        &self.state
    }

    /// The run directory: shm regions, and the state when no state directory was given;
    /// removed when the cluster is dropped.
    pub fn run_dir(&self) -> &Path {
        self.run.path()
    }

    /// Client options for this cluster whose reads and writes lock with `scheme`.
    pub fn options(&self, scheme: LockScheme) -> MountOptions {
        let mut options = MountOptions::new(
            self.meta_addr().to_string(),
            self.spec.name.clone(),
            self.token.clone(),
        );
        options.scheme = scheme;
        options
    }

    /// Opens a client session (a library client) whose reads and writes lock with `scheme`.
    pub fn connect(&self, scheme: LockScheme) -> Result<CitronFs> {
        CitronFs::connect(self.options(scheme))
            .map_err(|e| anyhow::anyhow!("cannot open a session with the cluster: {e}"))
    }

    /// Opens a client session with the spec's scheme.
    pub fn client(&self) -> Result<CitronFs> {
        self.connect(self.spec.scheme)
    }

    /// Mounts a new client with the spec's scheme in a fresh directory.
    pub fn mount(&self) -> Result<Mount> {
        self.mount_with(self.spec.scheme)
    }

    /// Mounts a new client with `scheme` in a fresh directory.
    pub fn mount_with(&self, scheme: LockScheme) -> Result<Mount> {
        Mount::in_temp_dir(Arc::new(self.connect(scheme)?), &fuse_options())
    }

    /// Stops every server and starts them again on the same state, names and meta address.
    /// Unmount first: client sessions do not survive it. Memory-backed data is lost; the
    /// namespace and file-backed data are kept.
    pub fn restart(&mut self) -> Result<()> {
        self.stop_servers()?;
        self.meta =
            MetaServer::start(self.meta_config.clone()).context("restart the meta server")?;
        self.start_data_servers()
    }

    /// Asks the meta server to check itself (`citronfs fsck`, through a connection of its own,
    /// which the report does not count among the sessions).
    pub fn fsck(&self, options: proto::fsck::FsckOptions) -> Result<proto::fsck::FsckReport> {
        meta_server::fsck::request(
            &self.meta_addr().to_string(),
            &self.credentials(),
            options,
            "cluster-fsck",
        )
    }

    /// Stops the meta server and starts it again on the same state and RPC address (and on tcp
    /// its region on the same port), while the data servers and clients run on: the data
    /// servers register again and clients reconnect (new sessions) on their own.
    pub fn restart_meta(&mut self) -> Result<()> {
        self.restart_meta_after(|meta| meta.shutdown().context("stop the meta server"))
    }

    /// [`Cluster::restart_meta`], the meta server stopped by `stop` instead of a clean
    /// shutdown (a test's `MetaHandle::crash`, say).
    pub fn restart_meta_after(
        &mut self,
        stop: impl FnOnce(&mut MetaHandle) -> Result<()>,
    ) -> Result<()> {
        stop(&mut self.meta)?;
        self.meta =
            MetaServer::start(self.meta_config.clone()).context("restart the meta server")?;
        Ok(())
    }

    /// Stops data server `i` (`ds-i`) and starts it again with the same name, while everything
    /// else runs on. Memory-backed, it comes back with new memory (a new incarnation, whose
    /// chunks the meta server marks lost); file-backed, with its region file.
    pub fn restart_data_server(&mut self, i: usize) -> Result<()> {
        anyhow::ensure!(i < self.data.len(), "no data server {i}");
        self.data[i].shutdown();
        self.data[i] = DataServer::start(self.data_config(i))
            .with_context(|| format!("restart data server {}", data_server_name(i)))?;
        Ok(())
    }

    /// Starts one more data server (`ds-N`, N the count so far) of the spec's capacity.
    pub fn add_data_server(&mut self) -> Result<&DataHandle> {
        let i = self.data.len();
        let handle = DataServer::start(self.data_config(i))
            .with_context(|| format!("start data server {}", data_server_name(i)))?;
        self.data.push(handle);
        Ok(&self.data[i])
    }

    /// Stops the meta server (persisting open files' sizes and flushing the namespace; no data
    /// server is needed for that), then the data servers. Dropping does the same, logging the
    /// error instead.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop_servers()
    }

    fn stop_servers(&mut self) -> Result<()> {
        let meta = self.meta.shutdown().context("stop the meta server");
        for d in &mut self.data {
            d.shutdown();
        }
        self.data.clear();
        meta
    }
}

/// Where clusters make their run directories: the directory `CITRONFS_RUN_DIR` names when it
/// is set (it should be a tmpfs: shm regions live there), else `/dev/shm` where it exists, else
/// `/tmp`.
pub fn run_dir_parent() -> PathBuf {
    if let Some(dir) = std::env::var_os("CITRONFS_RUN_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        PathBuf::from("/tmp")
    }
}

/// Removes the run directories of clusters named `name` in `parent` that this user's processes
/// left when they were killed outright (a SIGKILLed `citronfs up` or benchmark cannot remove its
/// own): directories `NAME-PID-*` owned by this user whose PID names no process. One whose PID
/// is alive — its maker, or a process that reused the number — is left alone.
pub fn sweep_stale_run_dirs(parent: &Path, name: &str) {
    use std::os::unix::fs::MetadataExt;
    let prefix = format!("{name}-");
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    // SAFETY: geteuid has no preconditions and touches no memory.
    let me = unsafe { libc::geteuid() };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        let ours = entry.metadata().is_ok_and(|m| m.is_dir() && m.uid() == me);
        if pid <= 0 || !ours || process_exists(pid) {
            continue;
        }
        match std::fs::remove_dir_all(entry.path()) {
            Ok(()) => tracing::info!(
                dir = %entry.path().display(),
                pid,
                "removed the run directory of a cluster whose process is gone"
            ),
            Err(error) => tracing::debug!(
                %error,
                dir = %entry.path().display(),
                "could not remove a stale run directory"
            ),
        }
    }
}

/// Whether a process `pid` exists (signal 0: ESRCH when none; EPERM is someone else's).
fn process_exists(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let sent = unsafe { libc::kill(pid, 0) } == 0;
    sent || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The stable name of data server `i`.
fn data_server_name(i: usize) -> String {
    format!("ds-{i}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_directories_of_dead_processes_are_swept_and_others_kept() {
        let parent = tempfile::tempdir().unwrap();
        // A process that has exited and been reaped: its pid names no process now (unless
        // reused this instant, which would only keep its directory).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = parent.path().join(format!("sweep-test-{dead}-abc123"));
        let live = parent
            .path()
            .join(format!("sweep-test-{}-def456", std::process::id()));
        let other_name = parent.path().join(format!("other-{dead}-ghi789"));
        let not_a_pid = parent.path().join("sweep-test-data-jkl012");
        for dir in [&stale, &live, &other_name, &not_a_pid] {
            std::fs::create_dir_all(dir.join("meta-db")).unwrap();
        }
        sweep_stale_run_dirs(parent.path(), "sweep-test");
        assert_eq!(stale.exists(), process_exists(dead as libc::pid_t));
        assert!(live.exists() && other_name.exists() && not_a_pid.exists());
    }
}
