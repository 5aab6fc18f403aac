//! The CitronFS data server: one region of memory holding file chunks, served through the
//! fabric, and registered with the meta server.
//!
//! The data server's CPU is not on the data path: clients read and write chunks with one-sided
//! verbs, and the meta server allocates chunks (and zeroes freed ones) with its own bookkeeping
//! and one-sided writes. What this process does is keep the region registered and served, and
//! keep a connection to the meta server open (re-registering after the meta server restarts),
//! so that the meta server knows the server is there.
//!
//! Backing:
//! - [`Backing::Memory`]: the region is anonymous (tcp) or a file in the shm directory (shm,
//!   which should be under `/dev/shm`); it is gone when the server stops;
//! - [`Backing::File`]: the region is a file in a directory on disk, mapped shared (memmap2,
//!   through `fabric::ShmServer`), kept at shutdown and reopened with its contents at the next
//!   start, so that chunks survive a restart.

use anyhow::Context;
use fabric::{Credentials, Region, RegionId, ShmServer, TcpServer};
use proto::rpc::{Client, Request, Response, Role, Welcome};
use proto::FabricAddr;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The id of the chunk region on a data server.
pub const DATA_REGION: RegionId = RegionId(1);

/// How often the data server tries to register again while the meta server is away.
const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);

/// How clients (and the meta server) reach the region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataFabric {
    /// Shared memory on this host, in this directory (with [`Backing::File`], the backing
    /// directory is used instead: the region file must be where clients attach).
    Shm {
        /// The server directory.
        dir: PathBuf,
    },
    /// The tcp software NIC, listening here (port 0: any).
    Tcp {
        /// Where to listen.
        listen: SocketAddr,
    },
}

/// What holds the region's memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Memory only: the contents are lost when the server stops.
    Memory,
    /// A file in `dir`, kept across restarts (same name and capacity to get the data back).
    File {
        /// The directory of the region file.
        dir: PathBuf,
    },
}

/// Everything a data server needs.
#[derive(Clone, Debug)]
pub struct DataConfig {
    /// A stable name: a restarted server with the same name gets its old id (and its chunks).
    pub name: String,
    /// The meta server's RPC address (`host:port`).
    pub meta_addr: String,
    /// The cluster's name.
    pub cluster: String,
    /// The cluster's shared secret.
    pub token: String,
    /// Bytes of the region (the meta server divides it into chunks).
    pub capacity_bytes: u64,
    /// How the region is served.
    pub fabric: DataFabric,
    /// What holds the region.
    pub backing: Backing,
}

/// The entry point.
pub struct DataServer;

impl DataServer {
    /// Registers the region, serves it, and registers with the meta server (failing if the
    /// meta server refuses, e.g. a wrong token). Keeps the registration alive on a background
    /// thread, re-registering if the meta server goes away and comes back.
    pub fn start(config: DataConfig) -> anyhow::Result<DataHandle> {
        anyhow::ensure!(!config.name.is_empty(), "a data server needs a name");
        anyhow::ensure!(
            config.capacity_bytes >= 8,
            "capacity must be at least 8 bytes"
        );
        let (region, fabric, servers) = serve_region(&config)?;
        let role = Role::DataServer {
            fabric: fabric.clone(),
            region: DATA_REGION,
            region_bytes: region.len(),
            name: config.name.clone(),
        };
        let (client, id) = register(&config, &role).with_context(|| {
            format!(
                "data server {:?}: registering with the meta server at {}",
                config.name, config.meta_addr
            )
        })?;
        tracing::info!(
            name = config.name,
            id,
            ?fabric,
            bytes = region.len(),
            "data server up"
        );
        let stop = Arc::new(AtomicBool::new(false));
        // Revocations apply to the tcp fabric server; on shm clients map the region themselves
        // and nothing can be refused (DESIGN.md "Fencing").
        let fence: Option<Arc<TcpServer>> = servers
            .iter()
            .find_map(|s| s.downcast_ref::<Arc<TcpServer>>())
            .cloned();
        let keeper = {
            let stop = stop.clone();
            let config = config.clone();
            std::thread::Builder::new()
                .name(format!("data-server-{}", config.name))
                .spawn(move || keep_registered(client, config, role, stop, fence))?
        };
        Ok(DataHandle {
            id,
            fabric,
            region_bytes: region.len(),
            stop,
            keeper: Some(keeper),
            _servers: servers,
        })
    }
}

/// What keeps the region served; held for its `Drop` (a `ShmServer`, a `TcpServer`, or both).
type Servers = Vec<Box<dyn std::any::Any + Send>>;

fn open_or_register(shm: &ShmServer, bytes: u64, keep: bool) -> anyhow::Result<Arc<Region>> {
    let want = bytes.div_ceil(8) * 8;
    if keep {
        if let Ok(region) = shm.open_region(DATA_REGION) {
            anyhow::ensure!(
                region.len() == want,
                "the region file in {} has {} bytes, but the capacity is {want}; start with the \
                 same capacity or remove the file",
                shm.dir().display(),
                region.len()
            );
            return Ok(region);
        }
    } else {
        // A file left by a run that did not stop cleanly: memory backing keeps nothing.
        let _ = shm.deregister(DATA_REGION);
    }
    Ok(shm.register(DATA_REGION, bytes)?)
}

fn serve_region(config: &DataConfig) -> anyhow::Result<(Arc<Region>, FabricAddr, Servers)> {
    let mut servers: Servers = Vec::new();
    let bytes = config.capacity_bytes;
    let file_backed = |dir: &PathBuf| -> anyhow::Result<(ShmServer, Arc<Region>)> {
        let mut shm = ShmServer::create(dir.clone())
            .with_context(|| format!("region directory {}", dir.display()))?;
        shm.persist();
        let region = open_or_register(&shm, bytes, true)?;
        Ok((shm, region))
    };
    let (region, fabric) = match (&config.fabric, &config.backing) {
        (DataFabric::Shm { dir }, Backing::Memory) => {
            let shm = ShmServer::create(dir.clone())
                .with_context(|| format!("region directory {}", dir.display()))?;
            let region = open_or_register(&shm, bytes, false)?;
            servers.push(Box::new(shm));
            (region, FabricAddr::Shm { dir: dir.clone() })
        }
        (DataFabric::Shm { dir }, Backing::File { dir: file_dir }) => {
            if dir != file_dir {
                tracing::warn!(
                    shm = %dir.display(),
                    file = %file_dir.display(),
                    "file-backed shm region: clients attach to the backing directory"
                );
            }
            let (shm, region) = file_backed(file_dir)?;
            servers.push(Box::new(shm));
            (
                region,
                FabricAddr::Shm {
                    dir: file_dir.clone(),
                },
            )
        }
        (DataFabric::Tcp { listen }, backing) => {
            let tcp = TcpServer::bind(
                listen,
                Credentials::new(config.cluster.clone(), config.token.clone()),
            )
            .with_context(|| format!("data fabric on {listen}"))?;
            let region = match backing {
                Backing::Memory => tcp.register(DATA_REGION, bytes)?,
                Backing::File { dir } => {
                    let (shm, region) = file_backed(dir)?;
                    tcp.add_region(region.clone())?;
                    servers.push(Box::new(shm));
                    region
                }
            };
            let addr = tcp.local_addr().to_string();
            // The tcp server goes first so that it stops serving before the mapping goes.
            servers.insert(0, Box::new(Arc::new(tcp)));
            (region, FabricAddr::Tcp { addr })
        }
    };
    Ok((region, fabric, servers))
}

/// Connects and registers; the meta server's answer gives the id.
fn register(config: &DataConfig, role: &Role) -> anyhow::Result<(Client, u32)> {
    let client = Client::connect(
        config.meta_addr.as_str(),
        &Credentials::new(config.cluster.clone(), config.token.clone()),
        role.clone(),
    )?;
    match client.welcome() {
        Welcome::DataServer { id } => {
            let id = *id;
            client.set_timeout(Some(Duration::from_secs(5)))?;
            Ok((client, id))
        }
        other => anyhow::bail!("unexpected answer to registration: {other:?}"),
    }
}

/// Long-polls the meta server for revoked sessions on the registration connection (the poll
/// is also the heartbeat) and fences them on `fence`; on failure, registers again until
/// stopped. Each poll names the epoch applied so far, which is how the meta server knows that
/// a `Fence` has taken effect here.
fn keep_registered(
    client: Client,
    config: DataConfig,
    role: Role,
    stop: Arc<AtomicBool>,
    fence: Option<Arc<TcpServer>>,
) {
    let mut client = Some(client);
    let mut applied = 0u64;
    let mut last_attempt: Option<Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        match client.as_mut() {
            Some(c) => match c.call(Request::AwaitRevocations { known: applied }) {
                Ok(Ok(Response::Revocations { epoch, sessions })) => {
                    if epoch != applied {
                        if let Some(tcp) = &fence {
                            tcp.revoke(&sessions);
                        }
                        if !sessions.is_empty() {
                            tracing::info!(name = config.name, epoch, ?sessions, "sessions fenced");
                        }
                        applied = epoch;
                    }
                }
                Ok(other) => {
                    tracing::warn!(
                        name = config.name,
                        ?other,
                        "unexpected answer to a revocation poll"
                    );
                    std::thread::sleep(HEARTBEAT_EVERY);
                }
                Err(error) => {
                    tracing::warn!(name = config.name, %error, "lost the meta server");
                    client = None;
                }
            },
            None => {
                // At most one registration attempt per heartbeat period.
                if last_attempt.is_some_and(|t| t.elapsed() < HEARTBEAT_EVERY) {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                last_attempt = Some(Instant::now());
                match register(&config, &role) {
                    Ok((c, id)) => {
                        tracing::info!(name = config.name, id, "registered again");
                        // A new meta server numbers its epochs afresh.
                        applied = 0;
                        client = Some(c);
                    }
                    Err(error) => tracing::debug!(name = config.name, %error, "meta server away"),
                }
            }
        }
    }
    // Dropping the client closes the connection: the meta server marks us gone.
}

/// A running data server.
pub struct DataHandle {
    id: u32,
    fabric: FabricAddr,
    region_bytes: u64,
    stop: Arc<AtomicBool>,
    keeper: Option<JoinHandle<()>>,
    _servers: Servers,
}

impl DataHandle {
    /// The id the meta server gave it.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// How its region is reached.
    pub fn fabric(&self) -> &FabricAddr {
        &self.fabric
    }

    /// Bytes of its region.
    pub fn region_bytes(&self) -> u64 {
        self.region_bytes
    }

    /// Disconnects from the meta server and stops serving the region (a file-backed region's
    /// file stays for the next start). Idempotent.
    pub fn shutdown(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.join();
        }
        self._servers.clear();
    }
}

impl Drop for DataHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}
