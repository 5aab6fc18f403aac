//! The fabric servers the lock tests run on: one in this process, reachable by child processes
//! through its address ([`fabric::FabricAddr`] written as text).

use fabric::{Backend, Backing, Connector, Credentials, FabricAddr, FabricServer, RegionId};
use std::sync::Arc;

/// The tcp test cluster's credentials.
pub const TCP_CLUSTER: &str = "lockmgr-tests";
/// The tcp test cluster's token.
pub const TCP_TOKEN: &str = "lockmgr-tests-token";

fn credentials() -> Credentials {
    Credentials::new(TCP_CLUSTER, TCP_TOKEN)
}

/// A running fabric server holding the tests' regions.
pub struct Fabric {
    server: FabricServer,
    /// Holds an shm server's directory; removed when the fabric is dropped (after the server).
    _dir: tempfile::TempDir,
}

impl Fabric {
    /// Starts a server of `backend` with these regions (id, bytes).
    pub fn start(backend: Backend, regions: &[(RegionId, u64)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let at = backend.serve_at(dir.path().join("server"), "127.0.0.1:0".parse().unwrap());
        let server = fabric::serve(&at, &credentials()).unwrap();
        for &(id, len) in regions {
            server.register(id, len, &Backing::Memory).unwrap();
        }
        Fabric { server, _dir: dir }
    }

    /// Where a child process finds this fabric (see [`connect_to`]); mem regions cannot be
    /// shared with another process.
    pub fn location(&self) -> String {
        assert_ne!(
            self.server.backend(),
            Backend::Mem,
            "mem regions cannot be shared with another process"
        );
        self.server.addr().to_string()
    }

    /// The server itself (to offer procedures on it).
    pub fn server(&self) -> &FabricServer {
        &self.server
    }

    /// A connector to this fabric, from this process.
    pub fn connector(&self) -> Arc<dyn Connector> {
        self.server.connector().unwrap()
    }

    /// A connector to this fabric presenting client session `session` (the one a fence
    /// revokes and a host fences as).
    #[allow(dead_code)] // Used by some test binaries only.
    pub fn connector_for(&self, session: u64) -> Arc<dyn Connector> {
        fabric::connect(&self.server.addr(), &credentials(), session).unwrap()
    }
}

/// Opens a connector to the fabric at `location` (see [`Fabric::location`]).
pub fn connect_to(location: &str) -> Result<Arc<dyn Connector>, String> {
    let addr: FabricAddr = location.parse()?;
    fabric::connect(&addr, &credentials(), 0).map_err(|e| e.to_string())
}
