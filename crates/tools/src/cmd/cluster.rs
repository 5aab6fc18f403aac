//! An embedded cluster: a meta server and N data servers in this process, on the shm fabric (or
//! tcp on loopback), as `citronfs up` and `citronfs bench fs` start it.

use super::config::{random_token, FabricKind};
use anyhow::{Context, Result};
use data_server::{Backing, DataConfig, DataFabric, DataHandle, DataServer};
use fs_client::{CitronFs, MountOptions};
use lockmgr::LockScheme;
use meta_server::{MetaConfig, MetaFabric, MetaHandle, MetaServer};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// What to start.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// The cluster's name (also the prefix of the run's shm directory).
    pub cluster: String,
    /// Data servers to start (at least one).
    pub data_servers: usize,
    /// Bytes of file data each data server serves.
    pub per_server_bytes: u64,
    /// The fabric between clients and servers.
    pub fabric: FabricKind,
    /// Keep namespace and data here (file-backed data servers); `None`: memory only, in a
    /// temporary directory removed on drop.
    pub state_dir: Option<PathBuf>,
}

/// A running embedded cluster. Dropping it stops the servers and removes the run's shm
/// directory and temporary state, whatever happened before.
pub struct EmbeddedCluster {
    // Field order is drop order: servers first, then the directories they live in.
    meta: MetaHandle,
    data: Vec<DataHandle>,
    cluster: String,
    token: String,
    _temp_state: Option<tempfile::TempDir>,
    _shm_cleanup: RemoveOnDrop,
}

/// Removes a directory on drop.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        // The shared root (/dev/shm/citronfs) too, if no other cluster uses it: `remove_dir`
        // only removes an empty directory.
        if let Some(root) = self.0.parent() {
            let _ = std::fs::remove_dir(root);
        }
    }
}

impl EmbeddedCluster {
    /// Starts the meta server and the data servers with a fresh random token.
    pub fn start(opts: &ClusterOptions) -> Result<EmbeddedCluster> {
        anyhow::ensure!(opts.data_servers >= 1, "at least one data server is needed");
        // The pid keeps two runs on one host (or a stale one) out of each other's regions.
        let run = format!("{}-{}", opts.cluster, std::process::id());
        let shm_root = PathBuf::from(fabric::shm::DEFAULT_ROOT).join(&run);
        let shm_cleanup = RemoveOnDrop(shm_root.clone());
        let (state, temp_state) = match &opts.state_dir {
            Some(dir) => (dir.clone(), None),
            None => {
                let temp = tempfile::Builder::new().prefix("citronfs-up-").tempdir()?;
                (temp.path().to_path_buf(), Some(temp))
            }
        };
        let token = random_token()?;
        let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));

        let mut meta_config = MetaConfig::new(
            state.join("meta-db"),
            match opts.fabric {
                FabricKind::Shm => MetaFabric::Shm {
                    dir: shm_root.join("meta"),
                },
                FabricKind::Tcp => MetaFabric::Tcp {
                    listen: loopback(0),
                },
            },
        );
        meta_config.cluster = opts.cluster.clone();
        meta_config.token = token.clone();
        let meta = MetaServer::start(meta_config).context("start the meta server")?;

        let mut data: Vec<DataHandle> = Vec::new();
        for i in 0..opts.data_servers {
            let name = format!("ds-{i}");
            let config = DataConfig {
                name: name.clone(),
                meta_addr: meta.addr().to_string(),
                cluster: opts.cluster.clone(),
                token: token.clone(),
                capacity_bytes: opts.per_server_bytes,
                fabric: match opts.fabric {
                    FabricKind::Shm => DataFabric::Shm {
                        dir: shm_root.join(&name),
                    },
                    FabricKind::Tcp => DataFabric::Tcp {
                        listen: loopback(0),
                    },
                },
                backing: match &opts.state_dir {
                    Some(dir) => Backing::File {
                        dir: dir.join(&name),
                    },
                    None => Backing::Memory,
                },
            };
            data.push(
                DataServer::start(config).with_context(|| format!("start data server {name}"))?,
            );
        }
        Ok(EmbeddedCluster {
            meta,
            data,
            cluster: opts.cluster.clone(),
            token,
            _temp_state: temp_state,
            _shm_cleanup: shm_cleanup,
        })
    }

    /// Opens a client session whose reads and writes lock with `scheme`.
    pub fn connect(&self, scheme: LockScheme) -> Result<CitronFs> {
        let mut options = MountOptions::new(
            self.meta.addr().to_string(),
            self.cluster.clone(),
            self.token.clone(),
        );
        options.scheme = scheme;
        CitronFs::connect(options).map_err(|e| anyhow::anyhow!("cannot open a session: {e}"))
    }

    /// The meta server's RPC address.
    pub fn meta_addr(&self) -> SocketAddr {
        self.meta.addr()
    }

    /// The data servers.
    pub fn data_servers(&self) -> &[DataHandle] {
        &self.data
    }

    /// Stops the data servers, then the meta server (dropping does the same, without the error).
    pub fn shutdown(mut self) -> Result<()> {
        // The meta server first: its shutdown persists open files' sizes and flushes the
        // namespace, which needs no data server; stopping the data servers first would make it
        // log every one of them as lost.
        let meta = self.meta.shutdown();
        for d in &mut self.data {
            d.shutdown();
        }
        meta
    }
}

/// Creates the mount point if missing and refuses a non-empty one (mounting over files hides
/// them, which is rarely what a newcomer wants).
pub fn prepare_mountpoint(path: &Path) -> Result<()> {
    if !path.exists() {
        std::fs::create_dir_all(path).with_context(|| format!("create {}", path.display()))?;
    }
    anyhow::ensure!(path.is_dir(), "{} is not a directory", path.display());
    let mut entries =
        std::fs::read_dir(path).with_context(|| format!("read {}", path.display()))?;
    anyhow::ensure!(
        entries.next().is_none(),
        "{} is not empty; choose an empty directory to mount on",
        path.display()
    );
    Ok(())
}
