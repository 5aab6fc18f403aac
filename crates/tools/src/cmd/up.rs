//! `citronfs up`: an embedded cluster on this machine — a meta server and N data servers in this
//! process, on the shm fabric by default — mounted through FUSE until Ctrl-C.

use super::cluster::{prepare_mountpoint, ClusterOptions, EmbeddedCluster};
use super::config::{parse_size, FabricKind};
use super::roles::{atomic_bound_line, mount_at};
use anyhow::{Context, Result};
use clap::{value_parser, Args};
use lockmgr::LockScheme;
use std::path::PathBuf;
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
    /// The range-lock scheme of every read and write: citron, mutex, seg, server, or a spec with
    /// parameters (e.g. seg:4:4096).
    #[arg(long, default_value = "citron", value_parser = value_parser!(LockScheme))]
    scheme: LockScheme,
    /// Keep the namespace and the data in this directory, so that the next `up` with the same
    /// directory finds them again. Without it everything lives in memory and is gone on exit.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// The cluster's name.
    #[arg(long, default_value = "citronfs")]
    cluster: String,
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
    let scheme = args.scheme;
    prepare_mountpoint(&args.mountpoint)?;

    let cluster = EmbeddedCluster::start(&ClusterOptions {
        cluster: args.cluster.clone(),
        data_servers: args.data_servers,
        per_server_bytes: per_server,
        fabric: args.fabric,
        state_dir: args.state_dir.clone(),
    })?;
    let fs = cluster.connect(scheme)?;
    let handle = mount_at(
        Arc::new(fs),
        &args.mountpoint,
        &fs_client::fuse::FuseOptions::default(),
    )?;

    println!("CitronFS is up:");
    println!(
        "  meta server   {} (fabric {:?}, cluster {:?})",
        cluster.meta_addr(),
        args.fabric,
        args.cluster
    );
    for d in cluster.data_servers() {
        println!(
            "  data server   id {} with {} MiB",
            d.id(),
            d.region_bytes() >> 20
        );
    }
    println!("  lock scheme   {scheme}");
    match &args.state_dir {
        Some(dir) => println!("  state         kept in {}", dir.display()),
        None => {
            println!("  state         in memory only (gone when stopped; --state-dir keeps it)")
        }
    }
    println!("  mounted at    {}", args.mountpoint.display());
    println!("  atomic I/O    {}", atomic_bound_line(&handle));
    println!(
        "Stop with Ctrl-C (or `kill {}`): it unmounts and stops every server.",
        std::process::id()
    );

    let unmounted = fs_client::fuse::wait_for_signal(handle);
    println!(
        "unmounted {}; stopping the servers",
        args.mountpoint.display()
    );
    cluster.shutdown()?;
    unmounted.context("unmount")
}
