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
use fabric::{Credentials, FabricServer, RegionId, ServeAt};
use proto::rpc::{Client, Request, Response, Role, RpcError, Welcome};
use proto::{FabricAddr, INCARNATION_REGION};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The id of the chunk region on a data server.
pub const DATA_REGION: RegionId = RegionId(1);

/// How often the data server tries to register again while the meta server is away.
const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);

/// What holds the region's memory (the fabric's [`fabric::Backing`]).
pub use fabric::Backing;

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
    /// Where the region is served (with [`Backing::File`] on shm, from the backing directory:
    /// clients map the region file where it is, see [`fabric::ServeAt::for_backing`]).
    pub fabric: ServeAt,
    /// What holds the region.
    pub backing: Backing,
    /// Its failure domain (a rack, a host, a power feed), if it names one: the meta server
    /// places the replicas of a chunk in distinct zones where it can (docs/REPLICAS.md).
    pub zone: Option<String>,
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
        let at = config.fabric.clone().for_backing(&config.backing);
        // Whether the region's contents survive from an earlier run decides the incarnation;
        // look before registering creates the file.
        let kept = match &config.backing {
            Backing::File { dir } => fabric::shm::region_path(dir, DATA_REGION).exists(),
            Backing::Memory => false,
        };
        let server = fabric::serve(
            &at,
            &Credentials::new(config.cluster.clone(), config.token.clone()),
        )
        .with_context(|| format!("serving the data region at {at:?}"))?;
        // A meta server that restarted fences the clients of its earlier run here before it
        // zeroes or hands out a chunk of this server (`Service::register_data_server`).
        server
            .accept_session_floors()
            .context("offering the session floor procedure")?;
        let incarnation = incarnation(&config.backing, kept)?;
        // The word clients check after their data verbs (proto::INCARNATION_REGION): memory
        // only, written anew at every start — and registered before the data region, because
        // registering a memory region empties the file a crashed run left (`fabric::shm`):
        // a client still mapping that run's files must find its incarnation word zero before
        // it can find its data zero, or it would take the zeros for data.
        let word = server
            .register(INCARNATION_REGION, 8, &Backing::Memory)
            .context("registering the incarnation region")?;
        fabric::region::store_word(
            &word,
            fabric::RemoteAddr::new(INCARNATION_REGION, 0),
            incarnation,
        )
        .context("writing the incarnation word")?;
        let region = server
            .register(DATA_REGION, config.capacity_bytes, &config.backing)
            .with_context(|| format!("registering the data region ({:?})", config.backing))?;
        let fabric = server.addr();
        let server = Arc::new(server);
        let role = Role::DataServer {
            fabric: fabric.clone(),
            region: DATA_REGION,
            region_bytes: region.len(),
            name: config.name.clone(),
            incarnation,
            zone: config.zone.clone(),
        };
        let (client, id) = register_waiting(&config, &role, REGISTER_WAIT).with_context(|| {
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
        let keeper = {
            let fence = server.clone();
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
            server: Some(server),
            incarnation_word: word,
        })
    }
}

/// The name of the file, next to a file-backed region, that holds the region's incarnation.
const INCARNATION_FILE: &str = "incarnation";

/// Which life of the region this is (`Role::DataServer::incarnation`): the one recorded next to
/// a file-backed region whose file was `kept` from an earlier run, else a new random one
/// (recorded for the next run where the region is file-backed). Never 0 (the meta server's
/// "unknown").
///
/// Invariant: the same incarnation is presented only for the same contents. A region file
/// created now gets a new incarnation even if an old incarnation file is there; a crash between
/// creating the region and recording its incarnation makes the next run present a new one,
/// which at worst marks chunks lost that were never written.
fn incarnation(backing: &Backing, kept: bool) -> anyhow::Result<u64> {
    let fresh = || loop {
        let n: u64 = rand::random();
        if n != 0 {
            return n;
        }
    };
    let Backing::File { dir } = backing else {
        return Ok(fresh());
    };
    let path = dir.join(INCARNATION_FILE);
    if kept {
        if let Some(n) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .filter(|&n| n != 0)
        {
            return Ok(n);
        }
        tracing::warn!(
            path = %path.display(),
            "the region file has no readable incarnation record: presenting a new incarnation \
             (its chunks will be marked lost)"
        );
    }
    let n = fresh();
    // Written before the region file is made (the incarnation word is registered first): the
    // directory may not exist yet.
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the region directory {}", dir.display()))?;
    let tmp = dir.join(format!("{INCARNATION_FILE}.tmp"));
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        writeln!(f, "{n}")?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().with_context(|| format!("recording the region's incarnation in {}", path.display()))?;
    Ok(n)
}

/// How long a starting data server keeps trying to register while the meta server is away
/// (not started yet, restarting, or gone during the registration): a data server started
/// beside a meta server that is (re)starting waits for it rather than exiting.
pub const REGISTER_WAIT: Duration = Duration::from_secs(60);

/// Connects and registers; the meta server's answer gives the id.
fn register(config: &DataConfig, role: &Role) -> Result<(Client, u32), RpcError> {
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
        other => Err(RpcError::Protocol(format!(
            "unexpected answer to registration: {other:?}"
        ))),
    }
}

/// [`register`], trying again for up to `wait` while the meta server cannot be reached or
/// drops the connection (a meta server killed during the registration, which may take
/// seconds while it zeroes the server's free chunks after a crash). A refusal (wrong token or
/// cluster, a registration the meta server rejects) is final at once.
fn register_waiting(
    config: &DataConfig,
    role: &Role,
    wait: Duration,
) -> Result<(Client, u32), RpcError> {
    let deadline = Instant::now() + wait;
    let mut pause = Duration::from_millis(20);
    loop {
        match register(config, role) {
            Ok(registered) => return Ok(registered),
            Err(e) if e.is_refusal() => return Err(e),
            Err(e) if Instant::now() + pause > deadline => return Err(e),
            Err(error) => {
                tracing::warn!(
                    name = config.name,
                    %error,
                    "cannot register with the meta server yet; trying again"
                );
                std::thread::sleep(pause);
                pause = (pause * 2).min(HEARTBEAT_EVERY);
            }
        }
    }
}

/// Long-polls the meta server for revoked sessions on the registration connection (the poll
/// is also the heartbeat) and fences them on `fence` (where its backend can: on shm clients map
/// the region themselves and nothing can be refused, docs/ARCHITECTURE.md "Fencing"); on failure,
/// registers again until
/// stopped. Each poll names the epoch applied so far, which is how the meta server knows that
/// a `Fence` has taken effect here.
fn keep_registered(
    client: Client,
    config: DataConfig,
    role: Role,
    stop: Arc<AtomicBool>,
    fence: Arc<FabricServer>,
) {
    let mut client = Some(client);
    let mut applied = 0u64;
    let mut last_attempt: Option<Instant> = None;
    // Between registration attempts while the meta server is away: short at first (a restart
    // takes a fraction of a second, and clients wait for data servers to allocate on), up to
    // the heartbeat period.
    let mut retry_after = Duration::from_millis(20);
    while !stop.load(Ordering::SeqCst) {
        match client.as_mut() {
            Some(c) => match c.call(Request::AwaitRevocations { known: applied }) {
                Ok(Ok(Response::Revocations { epoch, sessions })) => {
                    if epoch != applied {
                        fence.revoke(&sessions);
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
                // A clean stop, said so: no cause for alarm (`citronfs up` stops the meta
                // server first); the next one is waited for all the same.
                Err(e) if e.is_server_stopping() => {
                    tracing::info!(
                        name = config.name,
                        "the meta server is shutting down; registering with the next one"
                    );
                    client = None;
                }
                Err(error) => {
                    tracing::warn!(name = config.name, %error, "lost the meta server");
                    client = None;
                }
            },
            None => {
                if last_attempt.is_some_and(|t| t.elapsed() < retry_after) {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                last_attempt = Some(Instant::now());
                match register(&config, &role) {
                    Ok((c, id)) => {
                        tracing::info!(name = config.name, id, "registered again");
                        // A new meta server numbers its epochs afresh.
                        applied = 0;
                        client = Some(c);
                        retry_after = Duration::from_millis(20);
                    }
                    Err(error) => {
                        tracing::debug!(name = config.name, %error, "meta server away");
                        retry_after = (retry_after * 2).min(HEARTBEAT_EVERY);
                    }
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
    /// Serves the region; dropped at shutdown.
    server: Option<Arc<FabricServer>>,
    /// The incarnation word's region, zeroed first at shutdown.
    incarnation_word: Arc<fabric::Region>,
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
        if self.server.is_some() {
            // Before the regions go (on shm, emptied in no particular order): a client still
            // reading through a mapping of them must find the word zero — and discard what it
            // read — before it can find the data zero.
            let _ = fabric::region::store_word(
                &self.incarnation_word,
                fabric::RemoteAddr::new(INCARNATION_REGION, 0),
                0,
            );
        }
        self.server = None;
    }
}

impl Drop for DataHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}
