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

/// Removes a region file that no server will serve again, after punching out its contents
/// (`fallocate(FALLOC_FL_PUNCH_HOLE)`, the size kept): a process that still maps it — a client
/// that has not yet noticed its server stop or restart — reads zeros there from now on, not the
/// gone server's state, and its stores land in memory nobody reads. Unlinking alone left such
/// a client the old contents, which still looked live: after a meta server restart, a client
/// behind it took range locks in the old region, found its file's control block there as it
/// had left it, and wrote under a lock no client of the new server could see
/// (`tests/fence.rs`). Zeros are what every reader of a region checks against: a file
/// control block whose INO word is not its file's (`fs_client`'s `ForeignFcb`), a data
/// server's incarnation word that is not the one registered (`StaleDataServer`). The pages
/// are also freed at once, not when the last mapping goes.
fn retire_region_file(path: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let io = |what: &str, e| FabricError::io(format!("{what} {}", path.display()), e);
    match OpenOptions::new().write(true).open(path) {
        Ok(file) => {
            let len = file.metadata().map_err(|e| io("stat", e))?.len();
            // SAFETY: fallocate(2) on a descriptor this function owns; no memory is passed.
            let punched = unsafe {
                libc::fallocate(
                    file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    0,
                    len as libc::off_t,
                )
            };
            if punched != 0 {
                // A file system without hole punching (tmpfs has it): zeros written over it
                // do the same, at the cost of writing them.
                let error = std::io::Error::last_os_error();
                tracing::debug!(%error, path = %path.display(), "cannot punch a region file; zeroing it");
                let zeros = vec![0u8; 1 << 20];
                let mut at = 0;
                while at < len {
                    let n = (len - at).min(zeros.len() as u64) as usize;
                    std::os::unix::fs::FileExt::write_all_at(&file, &zeros[..n], at)
                        .map_err(|e| io("zero", e))?;
                    at += n as u64;
                }
            }
        }
        Err(e) => return Err(io("open", e)),
    }
    fs::remove_file(path).map_err(|e| io("remove", e))
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

    /// Deregisters a region and removes its file, emptied first ([`retire_region_file`]):
    /// clients that mapped it keep a mapping of zeros until they drop it; new clients can no
    /// longer attach it.
    pub fn deregister(&self, id: RegionId) -> Result<()> {
        self.regions.lock().expect("poisoned").remove(&id);
        retire_region_file(&region_path(&self.dir, id))
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
                    let _ = retire_region_file(&region_path(&self.dir, id));
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

/// A file's device and inode numbers: which file a path named when it was mapped.
type FileId = (u64, u64);

struct ShmRegions {
    dir: PathBuf,
    /// Each region mapped, with the file mapped.
    mapped: Mutex<HashMap<RegionId, (Arc<Region>, FileId)>>,
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
    /// The region's mapping, made the first time, and made again when its file was replaced
    /// since (its server restarted: the old file was emptied and removed, see
    /// [`retire_region_file`]). While there is no file (the server stopped and has not come
    /// back), the old mapping, if any: its zeros tell the reader it is behind, as an unknown
    /// region would not for every reader. Endpoints call this once per region and keep what it
    /// gives (`LocalEndpoint`'s cache), so the `stat` here is paid per new endpoint, not per
    /// verb — and a client catching up with a restart, which opens new endpoints, maps the new
    /// file instead of reading the old one's zeros for ever.
    fn resolve(&self, id: RegionId) -> Option<Arc<Region>> {
        use std::os::unix::fs::MetadataExt;
        let path = region_path(&self.dir, id);
        let now = fs::metadata(&path).ok().map(|m| (m.dev(), m.ino()));
        let mut mapped = self.mapped.lock().expect("poisoned");
        if let Some((region, file)) = mapped.get(&id) {
            if now.is_none_or(|now| *file == now) {
                return Some(region.clone());
            }
        }
        let file = OpenOptions::new().read(true).write(true).open(&path).ok()?;
        let opened = file.metadata().ok().map(|m| (m.dev(), m.ino()))?;
        match map_region(id, &file, &path) {
            Ok(region) => {
                mapped.insert(id, (region.clone(), opened));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::RemoteAddr;
    use crate::endpoint::EndpointExt;

    /// A client that mapped a region before its server removed it (a stop, or a restart that
    /// found the file of a run that crashed) reads zeros there afterwards, not the gone
    /// server's state; the file is gone for new clients.
    #[test]
    fn a_removed_region_reads_zeros_through_an_earlier_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let server_dir = dir.path().join("server");
        let id = RegionId(3);
        let word = RemoteAddr::new(id, 4096 + 8);
        let server = ShmServer::create(&server_dir).unwrap();
        server.register(id, 1 << 20).unwrap();
        let client = ShmConnector::attach(&server_dir).unwrap();
        let mut ep = client.endpoint();
        ep.write_u64(word, 0xfeed).unwrap();

        // What a restart does with the file of a run that did not stop cleanly.
        ShmServer::create(&server_dir)
            .unwrap()
            .deregister(id)
            .unwrap();
        assert!(!region_path(&server_dir, id).exists());
        assert_eq!(ep.read_u64(word).unwrap(), 0, "the old contents still read");

        // And what a stop does.
        drop(server);
        let server_dir = dir.path().join("stopping");
        let server = ShmServer::create(&server_dir).unwrap();
        let id = RegionId(4);
        let word = RemoteAddr::new(id, 8);
        server.register(id, 4096).unwrap();
        let mut ep = ShmConnector::attach(&server_dir).unwrap().endpoint();
        ep.write_u64(word, 7).unwrap();
        drop(server);
        assert!(!region_path(&server_dir, id).exists());
        assert_eq!(ep.read_u64(word).unwrap(), 0, "the old contents still read");
    }
}
