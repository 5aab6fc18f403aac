//! The `shm` backend: regions are files in a shared-memory directory, mapped `MAP_SHARED` by the
//! owning server and by every client on the host.
//!
//! Layout: one directory per server, `ROOT/CLUSTER/SERVER/`, holding one file per region named
//! `region-ID`; a region's size is its file's size. Clients attach to a server by its directory and
//! map each region the first time a verb names it. Verbs are the client's own CPU atomics and
//! copies on the mapping, so the owning process is never involved: a stopped (SIGSTOPped) server
//! does not stop lock or data traffic.

use crate::addr::RegionId;
use crate::endpoint::{Connector, Endpoint};
use crate::error::{FabricError, Result};
use crate::local::{LocalEndpoint, RegionSource};
use crate::region::Region;
use memmap2::MmapMut;
use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The default root of shared-memory clusters.
pub const DEFAULT_ROOT: &str = "/dev/shm/citronfs";

/// The directory of one server's regions: `root/cluster/server`.
pub fn server_dir(root: &Path, cluster: &str, server: &str) -> PathBuf {
    root.join(cluster).join(server)
}

/// The file of region `id` in server directory `dir` (whether a region file of an earlier run
/// is there tells a server if [`ShmServer::open_region`] would find contents to keep).
pub fn region_path(dir: &Path, id: RegionId) -> PathBuf {
    dir.join(format!("region-{}", id.0))
}

/// Maps a region file, which must already have its final size.
fn map_region(id: RegionId, file: &File, path: &Path) -> Result<Arc<Region>> {
    let len = file
        .metadata()
        .map_err(|e| FabricError::io(format!("stat {}", path.display()), e))?
        .len();
    if len == 0 || len % 8 != 0 {
        return Err(FabricError::Config(format!(
            "{} has size {len}, not a positive multiple of 8",
            path.display()
        )));
    }
    // SAFETY: the file is a region file of this cluster; every process maps it MAP_SHARED and only
    // ever accesses it through `Region`, i.e. atomically. Nobody truncates a registered region.
    let mut map = unsafe { MmapMut::map_mut(file) }
        .map_err(|e| FabricError::io(format!("mmap {}", path.display()), e))?;
    let ptr = map.as_mut_ptr();
    // SAFETY: the mapping is page-aligned, `len` bytes long, and lives in the owner box.
    Ok(Arc::new(unsafe {
        Region::from_raw(id, ptr, len, Box::new(map))
    }))
}

/// The owning side: creates a server's directory and registers regions in it.
pub struct ShmServer {
    dir: PathBuf,
    regions: Mutex<HashMap<RegionId, Arc<Region>>>,
    remove_on_drop: bool,
    /// Regions whose files are kept at drop even when the others are removed.
    kept: Mutex<HashSet<RegionId>>,
}

impl ShmServer {
    /// Creates (or reuses) the server directory `dir`. Region files already in it are left alone
    /// and may be re-registered with [`ShmServer::open_region`].
    pub fn create(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        fs::create_dir_all(&dir)
            .map_err(|e| FabricError::io(format!("create {}", dir.display()), e))?;
        Ok(Self {
            dir,
            regions: Mutex::new(HashMap::new()),
            remove_on_drop: true,
            kept: Mutex::new(HashSet::new()),
        })
    }

    /// Keeps the region files when the server is dropped (they are removed by default).
    pub fn persist(&mut self) {
        self.remove_on_drop = false;
    }

    /// Keeps region `id`'s file when the server is dropped (a file-backed region), whatever
    /// happens to the others.
    pub fn keep(&self, id: RegionId) {
        self.kept.lock().expect("poisoned").insert(id);
    }

    /// The server directory clients attach to.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Registers a new zeroed region of `len` bytes (rounded up to whole words) under `id`.
    pub fn register(&self, id: RegionId, len: u64) -> Result<Arc<Region>> {
        let path = region_path(&self.dir, id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| FabricError::io(format!("create {}", path.display()), e))?;
        file.set_len(len.div_ceil(8).max(1) * 8)
            .map_err(|e| FabricError::io(format!("size {}", path.display()), e))?;
        let region = map_region(id, &file, &path)?;
        self.regions
            .lock()
            .expect("poisoned")
            .insert(id, region.clone());
        Ok(region)
    }

    /// Registers an existing region file (after a restart), keeping its contents.
    pub fn open_region(&self, id: RegionId) -> Result<Arc<Region>> {
        let path = region_path(&self.dir, id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| FabricError::io(format!("open {}", path.display()), e))?;
        let region = map_region(id, &file, &path)?;
        self.regions
            .lock()
            .expect("poisoned")
            .insert(id, region.clone());
        Ok(region)
    }

    /// Deregisters a region and removes its file. Clients that mapped it keep the memory until
    /// they drop it (as with any unlinked mapping); new clients can no longer attach it.
    pub fn deregister(&self, id: RegionId) -> Result<()> {
        self.regions.lock().expect("poisoned").remove(&id);
        let path = region_path(&self.dir, id);
        fs::remove_file(&path).map_err(|e| FabricError::io(format!("remove {}", path.display()), e))
    }

    /// The region registered under `id`, for the server's own direct use.
    pub fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        self.regions.lock().expect("poisoned").get(&id).cloned()
    }
}

impl Drop for ShmServer {
    fn drop(&mut self) {
        if self.remove_on_drop {
            let kept = self.kept.lock().map(|k| k.clone()).unwrap_or_default();
            for id in self
                .regions
                .lock()
                .map(|r| r.keys().copied().collect::<Vec<_>>())
                .unwrap_or_default()
            {
                if !kept.contains(&id) {
                    let _ = fs::remove_file(region_path(&self.dir, id));
                }
            }
            // Fails, as it should, while kept files remain.
            let _ = fs::remove_dir(&self.dir);
        }
    }
}

/// The client side: attaches to a server's directory and opens endpoints on it.
#[derive(Clone)]
pub struct ShmConnector {
    inner: Arc<ShmRegions>,
}

struct ShmRegions {
    dir: PathBuf,
    mapped: Mutex<HashMap<RegionId, Arc<Region>>>,
}

impl ShmConnector {
    /// Attaches to the server whose region directory is `dir`.
    pub fn attach(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        if !dir.is_dir() {
            return Err(FabricError::Config(format!(
                "{} is not a shared-memory server directory (is the server running?)",
                dir.display()
            )));
        }
        Ok(Self {
            inner: Arc::new(ShmRegions {
                dir,
                mapped: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// A new endpoint to this server.
    pub fn endpoint(&self) -> LocalEndpoint<impl RegionSource> {
        LocalEndpoint::new(self.inner.clone())
    }
}

impl RegionSource for ShmRegions {
    fn resolve(&self, id: RegionId) -> Option<Arc<Region>> {
        let mut mapped = self.mapped.lock().expect("poisoned");
        if let Some(region) = mapped.get(&id) {
            return Some(region.clone());
        }
        let path = region_path(&self.dir, id);
        let file = OpenOptions::new().read(true).write(true).open(&path).ok()?;
        match map_region(id, &file, &path) {
            Ok(region) => {
                mapped.insert(id, region.clone());
                Some(region)
            }
            Err(error) => {
                tracing::warn!(%error, "cannot map shared-memory region");
                None
            }
        }
    }

    fn generation(&self) -> u64 {
        0
    }

    fn backend(&self) -> &'static str {
        "shm"
    }
}

impl Connector for ShmConnector {
    fn connect(&self) -> Result<Box<dyn Endpoint>> {
        Ok(Box::new(self.endpoint()))
    }
}
