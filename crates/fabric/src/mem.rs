//! The `mem` backend: regions of atomics in this process. For unit tests and the single-process
//! mode; its endpoints are as real as any other (same executor, same checks), minus the distance.

use crate::addr::RegionId;
use crate::endpoint::{Connector, Endpoint};
use crate::error::{FabricError, Result};
use crate::local::{LocalEndpoint, RegionSource};
use crate::region::{Region, RegionTable};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// An in-process "server": a table of registered regions that endpoints reach directly.
#[derive(Clone, Default)]
pub struct MemServer {
    inner: Arc<MemRegions>,
}

#[derive(Default)]
struct MemRegions {
    table: RwLock<RegionTable>,
    generation: AtomicU64,
}

impl MemServer {
    /// A server with no regions.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a zeroed region of `len` bytes under `id`.
    pub fn register(&self, id: RegionId, len: u64) -> Result<Arc<Region>> {
        let mut table = self.inner.table.write().expect("region table poisoned");
        if table.get(id).is_some() {
            return Err(FabricError::Config(format!("{id} is already registered")));
        }
        let region = Arc::new(Region::anonymous(id, len));
        table.insert(region.clone());
        Ok(region)
    }

    /// Registers an existing region (e.g. one mapped from a file) under its id.
    pub fn add_region(&self, region: Arc<Region>) -> Result<()> {
        let mut table = self.inner.table.write().expect("region table poisoned");
        if table.get(region.id()).is_some() {
            return Err(FabricError::Config(format!(
                "{} is already registered",
                region.id()
            )));
        }
        table.insert(region);
        Ok(())
    }

    /// Deregisters a region; endpoints stop reaching it before their next batch.
    pub fn deregister(&self, id: RegionId) -> Option<Arc<Region>> {
        let removed = self
            .inner
            .table
            .write()
            .expect("region table poisoned")
            .remove(id);
        self.inner.generation.fetch_add(1, Ordering::SeqCst);
        removed
    }

    /// A new endpoint to this server.
    pub fn endpoint(&self) -> LocalEndpoint<impl RegionSource> {
        LocalEndpoint::new(self.inner.clone())
    }
}

impl RegionSource for MemRegions {
    fn resolve(&self, id: RegionId) -> Option<Arc<Region>> {
        self.table
            .read()
            .expect("region table poisoned")
            .get(id)
            .cloned()
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    fn backend(&self) -> &'static str {
        "mem"
    }
}

impl Connector for MemServer {
    fn connect(&self) -> Result<Box<dyn Endpoint>> {
        Ok(Box::new(self.endpoint()))
    }
}
