//! The fabric servers the lock tests run on: one in this process, reachable by child processes
//! through a location string (`shm=DIR` or `tcp=ADDR`).

use fabric::{Connector, MemServer, RegionId, ShmConnector, ShmServer, TcpConnector, TcpServer};

/// The tcp test cluster's credentials.
pub const TCP_CLUSTER: &str = "lockmgr-tests";
/// The tcp test cluster's token.
pub const TCP_TOKEN: &str = "lockmgr-tests-token";

/// The fabric backends the lock tests run on.
#[derive(Clone, Copy, Debug)]
pub enum Backend {
    /// In-process regions (threads only).
    Mem,
    /// Shared-memory files (threads and processes).
    Shm,
    /// The tcp software NIC (threads and processes).
    Tcp,
}

/// A running fabric server holding the tests' regions.
pub enum Fabric {
    /// In-process regions.
    Mem(MemServer),
    /// A shared-memory server directory in a temporary directory.
    Shm {
        /// The server.
        server: ShmServer,
        /// Removed when the fabric is dropped.
        _dir: tempfile::TempDir,
    },
    /// A tcp server on loopback.
    Tcp(TcpServer),
}

impl Fabric {
    /// Starts a server of `backend` with these regions (id, bytes).
    pub fn start(backend: Backend, regions: &[(RegionId, u64)]) -> Self {
        let fabric = match backend {
            Backend::Mem => Fabric::Mem(MemServer::new()),
            Backend::Shm => {
                let dir = tempfile::tempdir().unwrap();
                Fabric::Shm {
                    server: ShmServer::create(dir.path().join("server")).unwrap(),
                    _dir: dir,
                }
            }
            Backend::Tcp => Fabric::Tcp(
                TcpServer::bind(
                    "127.0.0.1:0",
                    fabric::Credentials::new(TCP_CLUSTER, TCP_TOKEN),
                )
                .unwrap(),
            ),
        };
        for &(id, len) in regions {
            match &fabric {
                Fabric::Mem(server) => server.register(id, len).map(drop),
                Fabric::Shm { server, .. } => server.register(id, len).map(drop),
                Fabric::Tcp(server) => server.register(id, len).map(drop),
            }
            .unwrap();
        }
        fabric
    }

    /// Where a child process finds this fabric (see [`connect_to`]).
    pub fn location(&self) -> String {
        match self {
            Fabric::Mem(_) => unreachable!("mem regions cannot be shared with another process"),
            Fabric::Shm { server, .. } => format!("shm={}", server.dir().display()),
            Fabric::Tcp(server) => format!("tcp={}", server.local_addr()),
        }
    }

    /// A connector to this fabric, from this process.
    pub fn connector(&self) -> Box<dyn Connector> {
        match self {
            Fabric::Mem(server) => Box::new(server.clone()),
            other => connect_to(&other.location()).unwrap(),
        }
    }
}

/// Opens a connector to the fabric at `location` (see [`Fabric::location`]).
pub fn connect_to(location: &str) -> Result<Box<dyn Connector>, String> {
    if let Some(dir) = location.strip_prefix("shm=") {
        Ok(Box::new(
            ShmConnector::attach(dir).map_err(|e| e.to_string())?,
        ))
    } else if let Some(addr) = location.strip_prefix("tcp=") {
        Ok(Box::new(
            TcpConnector::connect(addr, fabric::Credentials::new(TCP_CLUSTER, TCP_TOKEN))
                .map_err(|e| e.to_string())?,
        ))
    } else {
        Err(format!("bad fabric location {location:?}"))
    }
}
