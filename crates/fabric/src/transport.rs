//! The one seam where a fabric backend is chosen: serve regions ([`serve`]) and reach them
//! ([`connect`]), whatever the backend.
//!
//! Servers, clients, tests and benchmarks name a backend only as a value — a [`Backend`] (the
//! `--fabric` choice), a [`ServeAt`] (where a server serves) or a [`FabricAddr`] (how its
//! clients reach it) — and go through this module for everything else. What differs between
//! backends is asked as a capability, never by matching on the backend: whether a server can
//! fence sessions ([`FabricServer::can_fence`]), runs procedures
//! ([`FabricServer::runs_procedures`]), whether its regions outlive its process
//! ([`FabricServer::keeps_regions_on_crash`]), where its peers on this host meet
//! ([`ServeAt::host_dir`]) and where it serves again after a restart ([`ServeAt::again_at`]). Adding a backend (RDMA is
//! next) means a variant in each of the three types and an arm in each function here, and
//! nothing outside this crate but a command-line value.
//!
//! | backend | serves at | reached at | fences sessions | runs procedures | outlives its process |
//! | --- | --- | --- | --- | --- | --- |
//! | `mem` | this process | [`FabricAddr::Mem`], from this process only | no | no | nothing |
//! | `shm` | a directory (under `/dev/shm`) | the directory, from this host | no | no | region files |
//! | `tcp` | a socket address | `host:port`, from anywhere, with the cluster's credentials | yes | yes | nothing |
//! | `rdma` (feature `rdma`) | an RDMA device, and a socket address for connection setup | `host:port` of the setup, from anywhere with the device's fabric, with the cluster's credentials | yes (queue pairs to the error state) | no | nothing |

use crate::addr::RegionId;
use crate::endpoint::Connector;
use crate::error::{FabricError, Result};
use crate::handshake::Credentials;
use crate::mem::MemServer;
use crate::region::Region;
use crate::shm::{ShmConnector, ShmServer};
use crate::tcp::{TcpConnector, TcpServer, TcpTimeouts};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// A fabric backend: the choice a user makes with `--fabric`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In this process only (tests, benchmarks, a single-process cluster).
    Mem,
    /// Shared memory on this host: regions are files every process maps.
    Shm,
    /// The tcp software NIC: several hosts.
    Tcp,
    /// An RDMA NIC (cargo feature `rdma`): several hosts, no server CPU on the data path.
    #[cfg(feature = "rdma")]
    Rdma,
}

impl Backend {
    /// Every backend, in the order the benchmarks report them.
    pub const ALL: [Backend; 3] = [Backend::Mem, Backend::Shm, Backend::Tcp];

    /// The backend's name, as `--fabric` spells it.
    pub const fn name(self) -> &'static str {
        match self {
            Backend::Mem => "mem",
            Backend::Shm => "shm",
            Backend::Tcp => "tcp",
            #[cfg(feature = "rdma")]
            Backend::Rdma => "rdma",
        }
    }

    /// Where a server of this backend serves by default: the shm directory `shm_dir` or the tcp
    /// address `tcp_listen` (port 0: any); `mem` needs neither.
    pub fn serve_at(self, shm_dir: impl Into<PathBuf>, tcp_listen: SocketAddr) -> ServeAt {
        match self {
            Backend::Mem => ServeAt::Mem,
            Backend::Shm => ServeAt::Shm {
                dir: shm_dir.into(),
            },
            Backend::Tcp => ServeAt::Tcp { listen: tcp_listen },
            #[cfg(feature = "rdma")]
            Backend::Rdma => ServeAt::Rdma { listen: tcp_listen },
        }
    }
}

/// `shm`: a cluster on one host, the clients' verbs never waking a server CPU (what
/// `citronfs up` and the test clusters start unless told otherwise).
impl Default for Backend {
    fn default() -> Self {
        Backend::Shm
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        #[cfg(feature = "rdma")]
        if s == Backend::Rdma.name() {
            return Ok(Backend::Rdma);
        }
        Backend::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                if cfg!(feature = "rdma") {
                    format!("unknown fabric {s:?} (mem, shm, tcp, rdma)")
                } else {
                    format!("unknown fabric {s:?} (mem, shm, tcp; rdma needs a build with fabric's `rdma` feature)")
                }
            })
    }
}

/// Where a server serves its regions.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ServeAt {
    /// In this process.
    Mem,
    /// Shared memory on this host: region files in this directory (use one under `/dev/shm`).
    Shm {
        /// The server directory clients attach to.
        dir: PathBuf,
    },
    /// The tcp software NIC, listening here (port 0: any). Clients are told the bound address,
    /// so listen on an address they can reach.
    Tcp {
        /// Where to listen.
        listen: SocketAddr,
    },
    /// An RDMA device (the environment names it: `crate::rdma`), with its connection setup
    /// (the authenticated handshake) listening here (port 0: any).
    #[cfg(feature = "rdma")]
    Rdma {
        /// Where the setup port listens.
        listen: SocketAddr,
    },
}

impl ServeAt {
    /// The backend this serves with.
    pub fn backend(&self) -> Backend {
        match self {
            ServeAt::Mem => Backend::Mem,
            ServeAt::Shm { .. } => Backend::Shm,
            ServeAt::Tcp { .. } => Backend::Tcp,
            #[cfg(feature = "rdma")]
            ServeAt::Rdma { .. } => Backend::Rdma,
        }
    }

    /// The directory on this host where this server's peers on the same host find it (shm),
    /// and where other meeting points of the server's (a local socket) belong; `None` for a
    /// backend that is not reached through the file system.
    pub fn host_dir(&self) -> Option<&Path> {
        match self {
            ServeAt::Shm { dir } => Some(dir),
            _ => None,
        }
    }

    /// Where to serve again after a restart, so that clients find the new run at `bound`, the
    /// address the first run told them ([`FabricServer::addr`]): tcp on that port, as a
    /// deployment with fixed ports does; the others where this says (shm's directory is its
    /// address already, mem is per run).
    pub fn again_at(&self, bound: &FabricAddr) -> Result<ServeAt> {
        Ok(match (self, bound) {
            (ServeAt::Tcp { .. }, FabricAddr::Tcp { addr }) => ServeAt::Tcp {
                listen: addr
                    .parse()
                    .map_err(|e| FabricError::Config(format!("the bound address {addr:?}: {e}")))?,
            },
            #[cfg(feature = "rdma")]
            (ServeAt::Rdma { .. }, FabricAddr::Rdma { addr }) => ServeAt::Rdma {
                listen: addr
                    .parse()
                    .map_err(|e| FabricError::Config(format!("the bound address {addr:?}: {e}")))?,
            },
            (at, _) => at.clone(),
        })
    }

    /// Where to serve regions backed by files in `dir` ([`Backing::File`]): backends that
    /// serve from a directory (`shm`) serve from that one, since clients map the region files
    /// where they are; the others are unchanged.
    pub fn for_backing(self, backing: &Backing) -> ServeAt {
        match (self, backing) {
            (ServeAt::Shm { dir }, Backing::File { dir: file_dir }) => {
                if &dir != file_dir {
                    tracing::warn!(
                        shm = %dir.display(),
                        file = %file_dir.display(),
                        "file-backed shm regions are served from their backing directory"
                    );
                }
                ServeAt::Shm {
                    dir: file_dir.clone(),
                }
            }
            (at, _) => at,
        }
    }
}

/// How to reach a server's registered regions (what a server tells its clients).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FabricAddr {
    /// A `mem` server of this process, by the name [`serve`] gave it.
    Mem {
        /// The server's name in this process.
        name: String,
    },
    /// Shared memory on this host: the server's region directory.
    Shm {
        /// The directory (see [`crate::shm`]).
        dir: PathBuf,
    },
    /// The tcp software NIC at `addr` (`host:port`).
    Tcp {
        /// The server's address.
        addr: String,
    },
    /// An RDMA server whose setup port is `addr` (`host:port`).
    #[cfg(feature = "rdma")]
    Rdma {
        /// The server's setup address.
        addr: String,
    },
}

impl FabricAddr {
    /// The backend that serves at this address.
    pub fn backend(&self) -> Backend {
        match self {
            FabricAddr::Mem { .. } => Backend::Mem,
            FabricAddr::Shm { .. } => Backend::Shm,
            FabricAddr::Tcp { .. } => Backend::Tcp,
            #[cfg(feature = "rdma")]
            FabricAddr::Rdma { .. } => Backend::Rdma,
        }
    }
}

impl fmt::Display for FabricAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FabricAddr::Mem { name } => write!(f, "mem:{name}"),
            FabricAddr::Shm { dir } => write!(f, "shm:{}", dir.display()),
            FabricAddr::Tcp { addr } => write!(f, "tcp:{addr}"),
            #[cfg(feature = "rdma")]
            FabricAddr::Rdma { addr } => write!(f, "rdma:{addr}"),
        }
    }
}

/// Parses what [`FabricAddr`]'s `Display` writes (`mem:NAME`, `shm:DIR`, `tcp:HOST:PORT`), so
/// that an address can cross a command line or a child process's environment.
impl std::str::FromStr for FabricAddr {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (backend, rest) = s.split_once(':').ok_or_else(|| {
            format!("bad fabric address {s:?} (mem:NAME, shm:DIR, tcp:HOST:PORT)")
        })?;
        Ok(match backend.parse::<Backend>()? {
            Backend::Mem => FabricAddr::Mem { name: rest.into() },
            Backend::Shm => FabricAddr::Shm { dir: rest.into() },
            Backend::Tcp => FabricAddr::Tcp { addr: rest.into() },
            #[cfg(feature = "rdma")]
            Backend::Rdma => FabricAddr::Rdma { addr: rest.into() },
        })
    }
}

/// What holds a region's memory.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backing {
    /// Memory only: the contents are gone when the server stops (a stale region of the same id
    /// left by an earlier run is replaced).
    Memory,
    /// A file in `dir`, mapped shared, kept when the server stops and reopened with its
    /// contents by the next server registering the same id and size.
    File {
        /// The directory of the region file.
        dir: PathBuf,
    },
}

/// A server of registered regions, of any backend ([`serve`]).
///
/// Dropping it stops serving (tcp: closes every connection), then unmaps the regions (shm and
/// memory-backed: removes their files; file-backed: keeps them).
pub struct FabricServer {
    // Field order is drop order: stop serving before the file mappings go.
    served: Served,
    /// Servers that only map file-backed regions for a backend that does not serve from files.
    mappers: Mutex<Vec<ShmServer>>,
    credentials: Credentials,
}

enum Served {
    Mem {
        server: MemServer,
        name: String,
    },
    Shm(ShmServer),
    Tcp(TcpServer),
    #[cfg(feature = "rdma")]
    Rdma(crate::rdma::RdmaServer),
}

impl fmt::Debug for FabricServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FabricServer")
            .field("addr", &self.addr())
            .finish()
    }
}

/// Starts a server of regions at `at`. Peers of a backend that authenticates (tcp) must
/// present `credentials`; the others cannot check anyone (shm: whoever may open the files).
pub fn serve(at: &ServeAt, credentials: &Credentials) -> Result<FabricServer> {
    let served = match at {
        ServeAt::Mem => {
            let server = MemServer::new();
            let name = mem_registry::add(&server);
            Served::Mem { server, name }
        }
        ServeAt::Shm { dir } => Served::Shm(ShmServer::create(dir.clone())?),
        ServeAt::Tcp { listen } => Served::Tcp(TcpServer::bind(listen, credentials.clone())?),
        #[cfg(feature = "rdma")]
        ServeAt::Rdma { listen } => {
            Served::Rdma(crate::rdma::RdmaServer::bind(listen, credentials.clone())?)
        }
    };
    Ok(FabricServer {
        served,
        mappers: Mutex::new(Vec::new()),
        credentials: credentials.clone(),
    })
}

/// Opens a connector to the server at `addr`, presenting `credentials` and client session
/// `session` (0: none) where the backend authenticates; a tcp server can later fence the
/// session ([`FabricServer::revoke`]).
///
/// tcp endpoints get the default time bounds ([`TcpTimeouts::DEFAULT`]); see [`connect_with`].
pub fn connect(
    addr: &FabricAddr,
    credentials: &Credentials,
    session: u64,
) -> Result<Arc<dyn Connector>> {
    connect_with(addr, credentials, session, TcpTimeouts::DEFAULT)
}

/// [`connect`] with the time bounds of a networked backend's endpoints: how long connecting
/// and one batch may take before a silent server (a cut link, a frozen host) fails the call
/// instead of blocking it. `mem` and `shm` verbs run on this host's CPU and cannot be kept
/// waiting by a network, so they ignore `timeouts`.
pub fn connect_with(
    addr: &FabricAddr,
    credentials: &Credentials,
    session: u64,
    timeouts: TcpTimeouts,
) -> Result<Arc<dyn Connector>> {
    Ok(match addr {
        FabricAddr::Mem { name } => Arc::new(mem_registry::find(name)?),
        FabricAddr::Shm { dir } => Arc::new(ShmConnector::attach(dir.clone())?),
        FabricAddr::Tcp { addr } => Arc::new(TcpConnector::connect_with(
            addr.as_str(),
            credentials.clone(),
            session,
            timeouts,
        )?),
        #[cfg(feature = "rdma")]
        FabricAddr::Rdma { addr } => Arc::new(crate::rdma::RdmaConnector::connect_with(
            addr.as_str(),
            credentials.clone(),
            session,
            timeouts,
        )?),
    })
}

impl FabricServer {
    /// Registers a zeroed region of `len` bytes (rounded up to whole words) under `id`, held by
    /// `backing`. A file-backed region whose file exists is reopened with its contents; its size
    /// must then be `len` (rounded), or registration fails saying so.
    pub fn register(&self, id: RegionId, len: u64, backing: &Backing) -> Result<Arc<Region>> {
        match backing {
            Backing::Memory => match &self.served {
                Served::Mem { server, .. } => server.register(id, len),
                Served::Shm(shm) => {
                    // A file left by a run that did not stop cleanly holds nothing of value.
                    let _ = shm.deregister(id);
                    shm.register(id, len)
                }
                Served::Tcp(tcp) => tcp.register(id, len),
                #[cfg(feature = "rdma")]
                Served::Rdma(rdma) => rdma.register(id, len),
            },
            Backing::File { dir } => match &self.served {
                Served::Shm(shm) if shm.dir() == dir => open_or_create(shm, id, len),
                served => {
                    let mapper = ShmServer::create(dir.clone())?;
                    let region = open_or_create(&mapper, id, len)?;
                    match served {
                        Served::Mem { server, .. } => server.add_region(region.clone())?,
                        Served::Tcp(tcp) => tcp.add_region(region.clone())?,
                        #[cfg(feature = "rdma")]
                        Served::Rdma(rdma) => rdma.add_region(region.clone())?,
                        Served::Shm(shm) => {
                            return Err(FabricError::Config(format!(
                                "an shm server in {} cannot serve a region file in {}: serve \
                                 at ServeAt::for_backing",
                                shm.dir().display(),
                                dir.display()
                            )))
                        }
                    }
                    self.mappers
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(mapper);
                    Ok(region)
                }
            },
        }
    }

    /// Where clients reach this server. A tcp server listening on an unspecified address
    /// (`0.0.0.0`) names loopback, which only clients on this host can use: listen on a
    /// reachable address for a cluster of several hosts.
    pub fn addr(&self) -> FabricAddr {
        match &self.served {
            Served::Mem { name, .. } => FabricAddr::Mem { name: name.clone() },
            Served::Shm(shm) => FabricAddr::Shm {
                dir: shm.dir().to_path_buf(),
            },
            Served::Tcp(tcp) => FabricAddr::Tcp {
                addr: reachable(tcp.local_addr()).to_string(),
            },
            #[cfg(feature = "rdma")]
            Served::Rdma(rdma) => FabricAddr::Rdma {
                addr: reachable(rdma.local_addr()).to_string(),
            },
        }
    }

    /// The backend serving.
    pub fn backend(&self) -> Backend {
        match &self.served {
            Served::Mem { .. } => Backend::Mem,
            Served::Shm(_) => Backend::Shm,
            Served::Tcp(_) => Backend::Tcp,
            #[cfg(feature = "rdma")]
            Served::Rdma(_) => Backend::Rdma,
        }
    }

    /// A connector to this server from this process, as its clients reach it (over the
    /// network for tcp), for the server's own verbs and measurements.
    pub fn connector(&self) -> Result<Arc<dyn Connector>> {
        connect(&self.addr(), &self.credentials, 0)
    }

    /// A connector to this server's memory as a procedure running at the server reaches it
    /// (tcp: [`TcpServer::host_connector`], no network); for mem and shm, whose clients
    /// reach the memory directly anyway, the same as [`FabricServer::connector`].
    pub fn host_connector(&self) -> Result<Arc<dyn Connector>> {
        match &self.served {
            Served::Tcp(tcp) => Ok(tcp.host_connector()),
            // rdma: a loopback queue pair unless the device's atomics are IBV_ATOMIC_GLOB (the
            // rule is written down and enforced in `RdmaServer::host_connector`).
            #[cfg(feature = "rdma")]
            Served::Rdma(rdma) => Ok(rdma.host_connector(self.connector()?)),
            _ => self.connector(),
        }
    }

    /// Offers `procedure` under number `id` to this server's clients ([`crate::procedure`]).
    /// Only a backend whose verbs a server CPU executes runs procedures (tcp); the others
    /// refuse with [`crate::FabricError::Unsupported`], and their
    /// clients run the steps themselves.
    pub fn register_procedure(
        &self,
        id: crate::procedure::ProcedureId,
        procedure: Arc<dyn crate::procedure::Procedure>,
    ) -> Result<()> {
        match &self.served {
            Served::Tcp(tcp) => tcp.register_procedure(id, procedure),
            _ => Err(crate::FabricError::Unsupported(format!(
                "{} servers run no procedures",
                self.backend()
            ))),
        }
    }

    /// Fences every client session numbered below `floor` (0 excepted), as
    /// [`FabricServer::revoke`] does a list: a server that numbers its sessions upwards from its
    /// start (the meta server) refuses those of its earlier runs, whose clients have not yet
    /// noticed the restart — their verbs would name places in a region that now holds other
    /// things. Returns whether the backend could (tcp, rdma; see [`FabricServer::revoke`]).
    pub fn refuse_sessions_before(&self, floor: u64) -> bool {
        match &self.served {
            Served::Tcp(tcp) => {
                tcp.refuse_sessions_before(floor);
                true
            }
            #[cfg(feature = "rdma")]
            Served::Rdma(rdma) => {
                rdma.refuse_sessions_before(floor);
                true
            }
            _ => false,
        }
    }

    /// Lets a sessionless peer raise the session floor of this server
    /// ([`TcpServer::accept_session_floors`], [`crate::procedure::raise_session_floor`]).
    /// Returns whether the backend can (tcp); elsewhere there is nothing to refuse with.
    pub fn accept_session_floors(&self) -> Result<bool> {
        match &self.served {
            Served::Tcp(tcp) => tcp.accept_session_floors().map(|()| true),
            _ => Ok(false),
        }
    }

    /// Whether this backend runs procedures ([`FabricServer::register_procedure`]): only one
    /// whose verbs a server CPU executes (tcp).
    pub fn runs_procedures(&self) -> bool {
        matches!(self.served, Served::Tcp(_))
    }

    /// Whether this backend keeps its regions outside the serving process (shm's region files,
    /// mapped by every client), so that a killed server leaves them behind for a next run to
    /// find. Dropping the server removes them, as a stop does: a test that stands in for a
    /// kill must then not drop it (`std::mem::forget`); the other backends' sockets close and
    /// memory goes with the process, as a drop does.
    pub fn keeps_regions_on_crash(&self) -> bool {
        matches!(self.served, Served::Shm(_))
    }

    /// Whether this backend can fence client sessions ([`FabricServer::revoke`]).
    pub fn can_fence(&self) -> bool {
        match &self.served {
            Served::Tcp(_) => true,
            #[cfg(feature = "rdma")]
            Served::Rdma(_) => true,
            _ => false,
        }
    }

    /// Fences client sessions: their open connections execute nothing more and new ones are
    /// refused. Returns whether the backend could: tcp can (its server refuses their batches),
    /// rdma can (its server moves their queue pairs to the error state,
    /// [`crate::rdma::RdmaServer::revoke`]); mem and shm cannot refuse a process that maps the
    /// memory, see docs/ARCHITECTURE.md "Fencing".
    pub fn revoke(&self, sessions: &[u64]) -> bool {
        match &self.served {
            Served::Tcp(tcp) => {
                tcp.revoke(sessions);
                true
            }
            #[cfg(feature = "rdma")]
            Served::Rdma(rdma) => {
                rdma.revoke(sessions);
                true
            }
            _ => false,
        }
    }
}

/// Registers region `id` from its file in `shm`'s directory if there is one (keeping its
/// contents), else creates it; the file is kept when `shm` is dropped.
fn open_or_create(shm: &ShmServer, id: RegionId, len: u64) -> Result<Arc<Region>> {
    let want = len.div_ceil(8).max(1) * 8;
    shm.keep(id);
    match shm.open_region(id) {
        Ok(region) if region.len() == want => Ok(region),
        Ok(region) => Err(FabricError::Config(format!(
            "the region file of {id} in {} has {} bytes, but {want} were asked for; use the same \
             capacity or remove the file",
            shm.dir().display(),
            region.len()
        ))),
        Err(_) => shm.register(id, len),
    }
}

/// The address a client on this host dials for a server bound to `addr`.
fn reachable(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        let loopback: std::net::IpAddr = if addr.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        };
        SocketAddr::new(loopback, addr.port())
    } else {
        addr
    }
}

impl Drop for FabricServer {
    fn drop(&mut self) {
        if let Served::Mem { name, .. } = &self.served {
            mem_registry::remove(name);
        }
    }
}

/// The `mem` servers of this process, by name, so that a [`FabricAddr::Mem`] can be connected
/// like any other address. Entries are removed when their server is dropped.
mod mem_registry {
    use super::*;

    static NEXT: AtomicU64 = AtomicU64::new(0);

    fn servers() -> &'static Mutex<HashMap<String, MemServer>> {
        static SERVERS: std::sync::OnceLock<Mutex<HashMap<String, MemServer>>> =
            std::sync::OnceLock::new();
        SERVERS.get_or_init(Default::default)
    }

    pub(super) fn add(server: &MemServer) -> String {
        let name = format!(
            "{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        servers()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.clone(), server.clone());
        name
    }

    pub(super) fn find(name: &str) -> Result<MemServer> {
        servers()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
            .ok_or_else(|| {
                FabricError::Config(format!(
                    "no mem fabric server {name:?} in this process (mem regions are reachable \
                     only from the process serving them)"
                ))
            })
    }

    pub(super) fn remove(name: &str) {
        servers()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
    }
}

/// The default shm directory of server `server` of cluster `cluster`.
pub fn default_shm_dir(cluster: &str, server: &str) -> PathBuf {
    crate::shm::server_dir(Path::new(crate::shm::DEFAULT_ROOT), cluster, server)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::RemoteAddr;
    use crate::endpoint::EndpointExt;

    fn creds() -> Credentials {
        Credentials::new("c", "t")
    }

    /// Every backend serves a region that its address reaches, through the same two calls.
    #[test]
    fn serve_then_connect_on_every_backend() {
        let dir = tempfile::tempdir().unwrap();
        for backend in Backend::ALL {
            let at = backend.serve_at(dir.path().join("shm"), "127.0.0.1:0".parse().unwrap());
            let server = serve(&at, &creds()).unwrap();
            assert_eq!(server.backend(), backend);
            assert_eq!(server.addr().backend(), backend);
            let region = server.register(RegionId(3), 64, &Backing::Memory).unwrap();
            assert_eq!(region.len(), 64);
            let connector = connect(&server.addr(), &creds(), 0).unwrap();
            let mut ep = connector.connect().unwrap();
            ep.write_u64(RemoteAddr::new(RegionId(3), 8), 42).unwrap();
            let mut own = server.connector().unwrap().connect().unwrap();
            assert_eq!(own.read_u64(RemoteAddr::new(RegionId(3), 8)).unwrap(), 42);
            assert_eq!(server.can_fence(), backend == Backend::Tcp);
            assert_eq!(server.runs_procedures(), backend == Backend::Tcp);
            assert_eq!(at.host_dir().is_some(), backend == Backend::Shm);
            // Served again at the address the first run was told: the same address.
            let first = server.addr();
            let again = at.again_at(&first).unwrap();
            if backend != Backend::Mem {
                drop(server);
                let server = serve(&again, &creds()).unwrap();
                assert_eq!(server.addr(), first, "{backend}");
            }
        }
    }

    /// A server that goes as by a crash (never dropped) leaves shm's region files behind.
    #[test]
    fn what_outlives_a_crashed_server() {
        let dir = tempfile::tempdir().unwrap();
        for backend in Backend::ALL {
            let shm = dir.path().join(backend.name());
            let at = backend.serve_at(&shm, "127.0.0.1:0".parse().unwrap());
            let server = serve(&at, &creds()).unwrap();
            server.register(RegionId(3), 64, &Backing::Memory).unwrap();
            let keeps = server.keeps_regions_on_crash();
            assert_eq!(keeps, backend == Backend::Shm, "{backend}");
            if keeps {
                std::mem::forget(server);
                assert!(std::fs::read_dir(&shm).unwrap().count() > 0);
            }
        }
    }

    /// A file-backed region keeps its contents across servers, on a backend that serves from
    /// files (shm) and on one that does not (tcp); a different size is refused clearly.
    #[test]
    fn file_backed_regions_survive_their_server() {
        let dir = tempfile::tempdir().unwrap();
        let backing = Backing::File {
            dir: dir.path().join("data"),
        };
        for backend in [Backend::Shm, Backend::Tcp, Backend::Mem] {
            let at = backend
                .serve_at(dir.path().join("elsewhere"), "127.0.0.1:0".parse().unwrap())
                .for_backing(&backing);
            let word = RemoteAddr::new(RegionId(1), 16);
            {
                let server = serve(&at, &creds()).unwrap();
                server.register(RegionId(1), 4096, &backing).unwrap();
                let mut ep = server.connector().unwrap().connect().unwrap();
                ep.write_u64(word, 7 + backend as u64).unwrap();
            }
            let server = serve(&at, &creds()).unwrap();
            server.register(RegionId(1), 4096, &backing).unwrap();
            let mut ep = server.connector().unwrap().connect().unwrap();
            assert_eq!(ep.read_u64(word).unwrap(), 7 + backend as u64, "{backend}");
            drop(server);
            let server = serve(&at, &creds()).unwrap();
            let err = server.register(RegionId(1), 8192, &backing).unwrap_err();
            assert!(err.to_string().contains("same capacity"), "{err}");
        }
    }

    #[test]
    fn a_mem_address_is_reachable_only_while_its_server_lives() {
        let server = serve(&ServeAt::Mem, &creds()).unwrap();
        let addr = server.addr();
        assert!(connect(&addr, &creds(), 0).is_ok());
        drop(server);
        let err = connect(&addr, &creds(), 0).err().expect("server gone");
        assert!(err.to_string().contains("only from the process"), "{err}");
    }

    #[test]
    fn backend_names_round_trip() {
        for backend in Backend::ALL {
            assert_eq!(backend.name().parse::<Backend>(), Ok(backend));
        }
        assert_eq!("rdma".parse::<Backend>().is_ok(), cfg!(feature = "rdma"));
        for addr in [
            FabricAddr::Mem { name: "1-2".into() },
            FabricAddr::Shm {
                dir: "/dev/shm/a:b".into(),
            },
            FabricAddr::Tcp {
                addr: "[::1]:80".into(),
            },
        ] {
            assert_eq!(addr.to_string().parse::<FabricAddr>(), Ok(addr));
        }
        assert!("nothing".parse::<FabricAddr>().is_err());
    }
}
