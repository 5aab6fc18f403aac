//! The server side of the `rdma` backend: registrations, and the setup connections that
//! create and connect a queue pair for every client endpoint.

use super::verbs::{Access, AtomicCap, Device, MemoryRegion, ProtectionDomain, QueuePair};
use super::{RegionKey, SetupRequest, SetupRole, SetupWelcome, MAX_SETUP_FRAME, QP_DEPTH};
use crate::addr::RegionId;
use crate::endpoint::Connector;
use crate::error::{FabricError, Result};
use crate::frame::{read_frame, write_frame};
use crate::handshake::{self, Credentials, Protocol, Refusal};
use crate::region::Region;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A region and its one registration.
struct Served {
    // Field order is drop order: deregister before the memory can go.
    mr: Box<dyn MemoryRegion>,
    region: Arc<Region>,
}

struct Shared {
    device: Arc<dyn Device>,
    pd: Arc<dyn ProtectionDomain>,
    credentials: Credentials,
    regions: RwLock<HashMap<RegionId, Served>>,
    stopping: AtomicBool,
    next_conn: AtomicU64,
    /// Open setup connections (to wake them at shutdown), by number.
    connections: Mutex<HashMap<u64, (TcpStream, JoinHandle<()>)>>,
    /// Which client sessions are fenced, and every client's queue pair by session.
    fencing: Mutex<Fencing>,
}

/// A queue pair the server made for a client endpoint, shared by its setup connection (which
/// destroys it when it closes) and the fencing (which moves it to the error state).
type SharedQp = Arc<Mutex<Box<dyn QueuePair>>>;

/// The sessions the cluster fenced on this server, and the live queue pairs of every session.
/// One lock over both: a queue pair is created and recorded under it after its session is
/// checked, and a revocation marks the sessions and moves their queue pairs to the error state
/// under it, so no queue pair of a fenced session escapes either way.
#[derive(Default)]
struct Fencing {
    /// Revoked sessions (0, no session, is never revoked).
    revoked: HashSet<u64>,
    /// Sessions below this (0 excepted) are refused too: those of an earlier run of a server
    /// that numbers the sessions ([`RdmaServer::refuse_sessions_before`]).
    floor: u64,
    /// Live client queue pairs by setup connection number: the session and the queue pair.
    qps: HashMap<u64, (u64, SharedQp)>,
}

impl Fencing {
    /// Why `session` may not connect, if it may not.
    fn refusal(&self, session: u64) -> Option<Refusal> {
        if session != 0 && session < self.floor {
            return Some(Refusal::SessionBehind {
                session,
                floor: self.floor,
            });
        }
        self.revoked
            .contains(&session)
            .then_some(Refusal::Revoked { session })
    }

    /// Moves every live queue pair of a refused session to the error state; the numbers of
    /// their setup connections.
    fn cut_off(&self) -> Vec<u64> {
        let mut cut = Vec::new();
        for (&conn, (session, qp)) in &self.qps {
            if self.refusal(*session).is_some() {
                // `ibv_modify_qp` to IBV_QPS_ERR: when it returns, the responder executes no
                // request of this queue pair any more (it neither executes nor answers what
                // arrives; the client's requests end in retries exceeded or flushed).
                if let Err(e) = lock(qp).to_error() {
                    tracing::warn!(%e, session, "fabric rdma: moving a fenced queue pair to error");
                }
                cut.push(conn);
            }
        }
        cut
    }
}

impl Shared {
    fn keys(&self) -> Vec<RegionKey> {
        let regions = self.regions.read().unwrap_or_else(PoisonError::into_inner);
        let mut keys: Vec<RegionKey> = regions
            .values()
            .map(|s| RegionKey {
                id: s.region.id(),
                addr: s.mr.addr(),
                len: s.region.len(),
                rkey: s.mr.rkey(),
            })
            .collect();
        keys.sort_by_key(|k| k.id);
        keys
    }
}

/// A server of regions registered with an RDMA device; clients connect their queue pairs to
/// it over an authenticated tcp connection (the module's documentation).
pub struct RdmaServer {
    shared: Arc<Shared>,
    listener: TcpListener,
    local: SocketAddr,
    accept: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for RdmaServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaServer")
            .field("setup", &self.local)
            .field("device", &self.shared.device.attrs().name)
            .finish()
    }
}

impl RdmaServer {
    /// Opens the device the environment names ([`super::open_device`]) and listens for setup
    /// connections at `listen`, admitting peers that prove `credentials`.
    pub fn bind(listen: impl ToSocketAddrs, credentials: Credentials) -> Result<Self> {
        let device = super::open_device()?;
        Self::bind_on(device, listen, credentials)
    }

    /// [`RdmaServer::bind`] on an open device.
    pub fn bind_on(
        device: Arc<dyn Device>,
        listen: impl ToSocketAddrs,
        credentials: Credentials,
    ) -> Result<Self> {
        let pd = device.alloc_pd()?;
        let listener =
            TcpListener::bind(listen).map_err(|e| FabricError::io("rdma: bind setup port", e))?;
        let local = listener
            .local_addr()
            .map_err(|e| FabricError::io("rdma: setup port address", e))?;
        let shared = Arc::new(Shared {
            device,
            pd,
            credentials,
            regions: RwLock::default(),
            stopping: AtomicBool::new(false),
            next_conn: AtomicU64::new(0),
            connections: Mutex::default(),
            fencing: Mutex::default(),
        });
        let accepting = listener
            .try_clone()
            .map_err(|e| FabricError::io("rdma: setup port", e))?;
        let for_loop = shared.clone();
        let accept = std::thread::Builder::new()
            .name("fabric-rdma-setup".into())
            .spawn(move || accept_loop(for_loop, accepting))
            .map_err(|e| FabricError::io("rdma: start the setup thread", e))?;
        Ok(Self {
            shared,
            listener,
            local,
            accept: Mutex::new(Some(accept)),
        })
    }

    /// Where clients connect (the setup port).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The device's atomic capability.
    pub fn atomic_cap(&self) -> AtomicCap {
        self.shared.device.attrs().atomic_cap
    }

    /// Registers a zeroed region of `len` bytes (rounded up to whole words) under `id`.
    pub fn register(&self, id: RegionId, len: u64) -> Result<Arc<Region>> {
        let region = Arc::new(Region::anonymous(id, len));
        self.add_region(region.clone())?;
        Ok(region)
    }

    /// Registers an existing region (e.g. one mapped from a file) with the device, once.
    pub fn add_region(&self, region: Arc<Region>) -> Result<()> {
        let mut regions = self
            .shared
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if regions.contains_key(&region.id()) {
            return Err(FabricError::Config(format!(
                "{} is already registered",
                region.id()
            )));
        }
        // SAFETY: the region's memory lives as long as `region`, which `Served` holds and drops
        // after the registration (field order); every access to it is atomic (`Region`).
        let mr = unsafe {
            self.shared.pd.register(
                region.as_ptr(),
                region.len().max(8) as usize,
                Access::SERVED,
            )
        }
        .map_err(|e| {
            FabricError::Config(format!(
                "rdma: registering {} ({} bytes) failed: {e}",
                region.id(),
                region.len()
            ))
        })?;
        regions.insert(region.id(), Served { mr, region });
        Ok(())
    }

    /// Deregisters a region: clients' verbs on it fail with a remote access error.
    pub fn deregister(&self, id: RegionId) -> Option<Arc<Region>> {
        self.shared
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id)
            .map(|s| s.region)
    }

    /// The regions served, with their keys.
    pub fn regions(&self) -> Vec<RegionKey> {
        self.shared.keys()
    }

    /// A connector to this server for its own CPU's work on its regions (hosted lock
    /// acquisitions, lease recovery, fsck repair).
    ///
    /// **The rule**: CPU atomics and the NIC's atomics on one word are atomic with each other
    /// only where the device reports `IBV_ATOMIC_GLOB`. Otherwise (`IBV_ATOMIC_HCA`, most
    /// devices) this is a loopback queue pair, and every such access goes through the NIC like
    /// a client's; with `IBV_ATOMIC_GLOB` the CPU executes the verbs on the memory directly.
    pub fn host_connector(&self, loopback: Arc<dyn Connector>) -> Arc<dyn Connector> {
        match self.atomic_cap() {
            AtomicCap::Glob => Arc::new(HostRegions(self.shared.clone())),
            AtomicCap::Hca | AtomicCap::None => loopback,
        }
    }

    /// Fences client sessions `sessions`: every queue pair this server made for them is moved to
    /// the error state, so that their NIC requests execute nothing more (a request in
    /// execution when the move is made finishes first; the clients' requests end in errors),
    /// their setup connections are closed (which destroys those queue pairs), and new setup
    /// connections naming them are refused. A revoked session stays revoked for the life of
    /// the server. This is CITRON §3.10's fence on RDMA ("destroy the QPs of the failed
    /// clients"), and what `TcpServer::revoke` does on tcp: when this returns, nothing of theirs
    /// executes here any more.
    pub fn revoke(&self, sessions: &[u64]) {
        self.fence(|f| {
            f.revoked
                .extend(sessions.iter().copied().filter(|&s| s != 0))
        });
    }

    /// Fences every client session numbered below `floor` (0 excepted), as
    /// [`RdmaServer::revoke`] does a list: the sessions of an earlier run of a server that
    /// numbers them upwards from its start (the meta server). New setup connections of theirs
    /// are refused as behind ([`Refusal::SessionBehind`]), not as revoked.
    pub fn refuse_sessions_before(&self, floor: u64) {
        self.fence(|f| f.floor = f.floor.max(floor));
    }

    /// Marks sessions refused with `mark`, moves their queue pairs to the error state and
    /// closes their setup connections.
    fn fence(&self, mark: impl FnOnce(&mut Fencing)) {
        let cut = {
            let mut fencing = lock(&self.shared.fencing);
            mark(&mut fencing);
            fencing.cut_off()
        };
        let connections = lock(&self.shared.connections);
        for conn in cut {
            if let Some((stream, _)) = connections.get(&conn) {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
    }

    /// Number of open setup connections (one per client endpoint).
    pub fn connection_count(&self) -> usize {
        lock(&self.shared.connections).len()
    }

    /// Stops accepting, closes every setup connection and destroys its queue pair.
    pub fn shutdown(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // SAFETY: the descriptor belongs to `self.listener`, open for the call; shutdown(2)
        // touches no memory. It wakes the blocked accept.
        unsafe {
            libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR);
        }
        if let Some(accept) = lock(&self.accept).take() {
            let _ = accept.join();
        }
        let live = std::mem::take(&mut *lock(&self.shared.connections));
        for (stream, _) in live.values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for (_, (_, thread)) in live {
            let _ = thread.join();
        }
    }
}

impl Drop for RdmaServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The server's regions executed on by its CPU: only for a device with `IBV_ATOMIC_GLOB`
/// ([`RdmaServer::host_connector`]).
struct HostRegions(Arc<Shared>);

impl crate::local::RegionSource for HostRegions {
    fn resolve(&self, id: RegionId) -> Option<Arc<Region>> {
        self.0
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .map(|s| s.region.clone())
    }
    fn generation(&self) -> u64 {
        0
    }
    fn backend(&self) -> &'static str {
        "rdma"
    }
}

impl Connector for HostRegions {
    fn connect(&self) -> Result<Box<dyn crate::Endpoint>> {
        Ok(Box::new(crate::local::LocalEndpoint::new(Arc::new(
            HostRegions(self.0.clone()),
        ))))
    }
}

fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let Ok(handle) = stream.try_clone() else {
            continue;
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let for_conn = shared.clone();
        let thread = std::thread::Builder::new()
            .name("fabric-rdma-conn".into())
            .spawn(move || {
                serve_connection(&for_conn, stream, id);
                lock(&for_conn.connections).remove(&id);
            });
        if let Ok(thread) = thread {
            let mut live = lock(&shared.connections);
            if thread.is_finished() {
                continue;
            }
            live.insert(id, (handle, thread));
        }
    }
}

/// One client endpoint: the handshake creating its queue pair (unless its session is fenced),
/// then region requests until the connection closes, which destroys the queue pair.
fn serve_connection(shared: &Shared, mut stream: TcpStream, id: u64) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(handshake::HANDSHAKE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(handshake::HANDSHAKE_TIMEOUT));
    let mut qp: Option<SharedQp> = None;
    let result = handshake::server_handshake::<SetupRole, SetupWelcome>(
        &mut stream,
        Protocol::RdmaSetup,
        &shared.credentials,
        |hello| {
            // Checked and recorded under the fencing lock: a revocation either comes first
            // and is seen here, or comes after and finds this queue pair to cut off.
            let mut fencing = lock(&shared.fencing);
            if let Some(refusal) = fencing.refusal(hello.session) {
                return Err(refusal);
            }
            let created = shared
                .pd
                .create_qp(QP_DEPTH)
                .and_then(|mut q| {
                    q.to_init(Access::SERVED)?;
                    q.to_rtr(&hello.role.qp)?;
                    q.to_rts()?;
                    Ok(q)
                })
                .map_err(|e| Refusal::BadHello(format!("rdma: no queue pair for you: {e}")))?;
            let welcome = SetupWelcome {
                qp: created.address(),
                regions: shared.keys(),
            };
            // Kept until the connection closes.
            let created: SharedQp = Arc::new(Mutex::new(created));
            fencing.qps.insert(id, (hello.session, created.clone()));
            qp = Some(created);
            Ok(welcome)
        },
    );
    if let Err(refusal) = result {
        tracing::debug!(%refusal, "fabric rdma: setup refused");
        lock(&shared.fencing).qps.remove(&id);
        return;
    }
    // The lifeline: region lists on request; no timeout while the client lives.
    let _ = stream.set_read_timeout(None);
    crate::tcp::watch_peer(&stream);
    let mut body = Vec::new();
    while read_frame(&mut stream, MAX_SETUP_FRAME, &mut body).is_ok() {
        let answer = match postcard::from_bytes::<SetupRequest>(&body) {
            Ok(SetupRequest::Regions) => postcard::to_stdvec(&shared.keys()),
            Err(_) => break,
        };
        let Ok(answer) = answer else { break };
        if write_frame(&mut stream, &answer)
            .and_then(|()| stream.flush())
            .is_err()
        {
            break;
        }
    }
    lock(&shared.fencing).qps.remove(&id);
    drop(qp);
}
