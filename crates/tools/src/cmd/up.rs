//! `citronfs up`: an embedded cluster on this machine — a meta server and N data servers in this
//! process, on the shm fabric by default — mounted through FUSE until Ctrl-C.

use super::config::{parse_size, random_token, FabricKind};
use super::roles::{mount_at, parse_scheme};
use anyhow::{Context, Result};
use clap::Args;
use data_server::{Backing, DataConfig, DataFabric, DataHandle, DataServer};
use fs_client::{CitronFs, MountOptions};
use meta_server::{MetaConfig, MetaFabric, MetaServer};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Options of `citronfs up`.
#[derive(Args, Debug)]
pub struct UpArgs {
    /// Where to mount (created if missing; must be empty).
    mountpoint: PathBuf,
    /// Data servers to start.
    #[arg(long, default_value_t = 2)]
    data_servers: usize,
    /// Memory for file data, shared evenly by the data servers (e.g. 512M, 4G).
    #[arg(long, default_value = "1G")]
    memory: String,
    /// The fabric between clients and servers.
    #[arg(long, value_enum, default_value = "shm")]
    fabric: FabricKind,
    /// The range-lock scheme of every read and write: citron, mutex, seg, server.
    #[arg(long, default_value = "citron")]
    scheme: String,
    /// Keep the namespace and the data in this directory, so that the next `up` with the same
    /// directory finds them again. Without it everything lives in memory and is gone on exit.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// The cluster's name.
    #[arg(long, default_value = "citronfs")]
    cluster: String,
}

/// Removes the run's shared-memory directory on exit, whatever happens.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Starts the cluster, mounts it, waits for SIGINT or SIGTERM, then unmounts and stops.
pub fn up(args: UpArgs) -> Result<()> {
    anyhow::ensure!(args.data_servers >= 1, "at least one data server is needed");
    let memory = parse_size(&args.memory)?;
    let per_server = memory / args.data_servers as u64;
    anyhow::ensure!(
        per_server >= 4 << 20,
        "--memory {} split over {} data servers leaves less than 4 MiB each",
        args.memory,
        args.data_servers
    );
    let scheme = parse_scheme(Some(&args.scheme))?;
    prepare_mountpoint(&args.mountpoint)?;

    let run = format!("{}-{}", args.cluster, std::process::id());
    let shm_root = PathBuf::from(fabric::shm::DEFAULT_ROOT).join(&run);
    let _shm_cleanup = RemoveOnDrop(shm_root.clone());
    let temp_state;
    let state = match &args.state_dir {
        Some(dir) => dir.clone(),
        None => {
            temp_state = tempfile::Builder::new().prefix("citronfs-up-").tempdir()?;
            temp_state.path().to_path_buf()
        }
    };
    let token = random_token()?;
    let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));

    let mut meta_config = MetaConfig::new(
        state.join("meta-db"),
        match args.fabric {
            FabricKind::Shm => MetaFabric::Shm {
                dir: shm_root.join("meta"),
            },
            FabricKind::Tcp => MetaFabric::Tcp {
                listen: loopback(0),
            },
        },
    );
    meta_config.cluster = args.cluster.clone();
    meta_config.token = token.clone();
    let mut meta = MetaServer::start(meta_config).context("start the meta server")?;

    let mut data: Vec<DataHandle> = Vec::new();
    for i in 0..args.data_servers {
        let name = format!("ds-{i}");
        let config = DataConfig {
            name: name.clone(),
            meta_addr: meta.addr().to_string(),
            cluster: args.cluster.clone(),
            token: token.clone(),
            capacity_bytes: per_server,
            fabric: match args.fabric {
                FabricKind::Shm => DataFabric::Shm {
                    dir: shm_root.join(&name),
                },
                FabricKind::Tcp => DataFabric::Tcp {
                    listen: loopback(0),
                },
            },
            backing: match &args.state_dir {
                Some(dir) => Backing::File {
                    dir: dir.join(&name),
                },
                None => Backing::Memory,
            },
        };
        data.push(DataServer::start(config).with_context(|| format!("start data server {name}"))?);
    }

    let mut options = MountOptions::new(meta.addr().to_string(), args.cluster.clone(), token);
    options.scheme = scheme;
    let fs =
        CitronFs::connect(options).map_err(|e| anyhow::anyhow!("cannot open a session: {e}"))?;
    let handle = mount_at(
        Arc::new(fs),
        &args.mountpoint,
        &fs_client::fuse::FuseOptions::default(),
    )?;

    println!("CitronFS is up:");
    println!(
        "  meta server   {} (fabric {:?}, cluster {:?})",
        meta.addr(),
        args.fabric,
        args.cluster
    );
    for d in &data {
        println!(
            "  data server   id {} with {} MiB",
            d.id(),
            d.region_bytes() >> 20
        );
    }
    println!("  lock scheme   {}", scheme.name());
    match &args.state_dir {
        Some(dir) => println!("  state         kept in {}", dir.display()),
        None => {
            println!("  state         in memory only (gone when stopped; --state-dir keeps it)")
        }
    }
    println!("  mounted at    {}", args.mountpoint.display());
    println!(
        "Stop with Ctrl-C (or `kill {}`): it unmounts and stops every server.",
        std::process::id()
    );

    let unmounted = fs_client::fuse::wait_for_signal(handle);
    println!(
        "unmounted {}; stopping the servers",
        args.mountpoint.display()
    );
    for mut d in data {
        d.shutdown();
    }
    meta.shutdown()?;
    unmounted.context("unmount")
}

/// Creates the mount point if missing and refuses a non-empty one (mounting over files hides
/// them, which is rarely what a newcomer wants).
fn prepare_mountpoint(path: &Path) -> Result<()> {
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
