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
use std::collections::HashMap;
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
                serve_connection(&for_conn, stream);
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

/// One client endpoint: the handshake creating its queue pair, then region requests until the
/// connection closes, which destroys the queue pair.
fn serve_connection(shared: &Shared, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(handshake::HANDSHAKE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(handshake::HANDSHAKE_TIMEOUT));
    let mut qp: Option<Box<dyn QueuePair>> = None;
    let result = handshake::server_handshake::<SetupRole, SetupWelcome>(
        &mut stream,
        Protocol::RdmaSetup,
        &shared.credentials,
        |hello| {
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
            qp = Some(created);
            Ok(welcome)
        },
    );
    if let Err(refusal) = result {
        tracing::debug!(%refusal, "fabric rdma: setup refused");
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
    drop(qp);
}
