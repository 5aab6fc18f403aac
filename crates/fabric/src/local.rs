//! The endpoint shared by the backends whose verbs run on the client's own CPU against memory it
//! can address directly (`mem`, `shm`): no server thread is involved on the data path.

use crate::addr::RegionId;
use crate::batch::{Batch, Completions};
use crate::endpoint::{Capabilities, Endpoint, EndpointStats};
use crate::error::Result;
use crate::region::{Region, RegionTable};
use std::sync::Arc;

/// Where a local endpoint finds regions it has not seen yet.
pub trait RegionSource: Send + Sync {
    /// The region with this id, if registered.
    fn resolve(&self, id: RegionId) -> Option<Arc<Region>>;

    /// A number that changes whenever a region is deregistered, so that endpoints drop cached
    /// regions that are gone. Sources that never deregister return a constant.
    fn generation(&self) -> u64;

    /// The backend's name.
    fn backend(&self) -> &'static str;
}

/// An endpoint that executes verbs directly on shared memory.
pub struct LocalEndpoint<S: RegionSource> {
    source: Arc<S>,
    cache: RegionTable,
    generation: u64,
    stats: EndpointStats,
}

impl<S: RegionSource> LocalEndpoint<S> {
    /// An endpoint over `source`'s regions.
    pub fn new(source: Arc<S>) -> Self {
        let generation = source.generation();
        Self {
            source,
            cache: RegionTable::new(),
            generation,
            stats: EndpointStats::default(),
        }
    }
}

impl<S: RegionSource> Endpoint for LocalEndpoint<S> {
    fn execute(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        let generation = self.source.generation();
        if generation != self.generation {
            self.cache = RegionTable::new();
            self.generation = generation;
        }
        let source = &self.source;
        self.cache.fill_from(batch, |id| source.resolve(id));
        self.cache.execute(batch, out)?;
        self.stats.record(batch);
        Ok(())
    }

    fn stats(&self) -> EndpointStats {
        self.stats
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::local(self.source.backend())
    }
}
