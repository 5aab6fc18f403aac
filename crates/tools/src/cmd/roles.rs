//! `citronfs meta-server`, `citronfs data-server`, `citronfs mount`: each role on its own, for a
//! real cluster over the tcp fabric (or shm on one host).

use super::config::{load, parse_size, require_token};
use crate::merge;
use anyhow::{Context, Result};
use clap::{value_parser, Args};
use data_server::{Backing, DataConfig, DataServer};
use fabric::Backend;
use fs_client::{CitronFs, MountOptions};
use lockmgr::LockScheme;
use meta_server::{MetaConfig, MetaServer};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use testkit::Mount;

/// Options of `citronfs meta-server`.
#[derive(Args, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetaArgs {
    /// A TOML file with any of these options (keys are the long names with `_`).
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// The cluster's name.
    #[arg(long)]
    cluster: Option<String>,
    /// The cluster's shared secret.
    #[arg(long, env = "CITRONFS_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Where the RPC service listens [default: 127.0.0.1:7700].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// The namespace database directory (created if missing, kept across restarts).
    #[arg(long)]
    db: Option<PathBuf>,
    /// How clients reach the meta region [default: tcp].
    #[arg(long, value_enum)]
    fabric: Option<Backend>,
    /// shm: the meta region's directory [default: /dev/shm/citronfs/CLUSTER/meta].
    #[arg(long)]
    region_dir: Option<PathBuf>,
    /// tcp: where the meta region's fabric server listens [default: the --listen host, any port].
    #[arg(long)]
    fabric_listen: Option<SocketAddr>,
    /// Size of the meta region (file control blocks and lock trees) [default: 64M].
    #[arg(long)]
    region_size: Option<String>,
    /// Bytes per chunk of file data, fixed for the life of the database [default: 1M].
    #[arg(long)]
    chunk_size: Option<String>,
    /// Bytes per lock unit [default: 4K].
    #[arg(long)]
    lock_unit: Option<String>,
    /// Seconds a client session lives without a request [default: 10].
    #[arg(long)]
    session_lease: Option<u64>,
}

/// Runs a meta server until SIGINT or SIGTERM.
pub fn meta_server(mut args: MetaArgs) -> Result<()> {
    let mut file: MetaArgs = load(args.config.as_deref())?;
    merge!(args, file; cluster, token, listen, db, fabric, region_dir, fabric_listen, region_size, chunk_size, lock_unit, session_lease);
    let cluster = args.cluster.unwrap_or_else(|| "citronfs".into());
    let listen = args
        .listen
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 7700)));
    let db = args
        .db
        .context("the namespace database directory is missing: give --db DIR")?;
    let fabric = args.fabric.unwrap_or(Backend::Tcp).serve_at(
        args.region_dir
            .unwrap_or_else(|| fabric::transport::default_shm_dir(&cluster, "meta")),
        args.fabric_listen
            .unwrap_or_else(|| SocketAddr::new(listen.ip(), 0)),
    );
    let mut config = MetaConfig::new(db, fabric);
    config.cluster = cluster;
    config.token = require_token(args.token)?;
    config.listen = listen;
    if let Some(s) = &args.region_size {
        config.region_bytes = parse_size(s)?;
    }
    if let Some(s) = &args.chunk_size {
        config.chunk_size = parse_size(s)?;
    }
    if let Some(s) = &args.lock_unit {
        config.lock_unit = parse_size(s)?;
    }
    if let Some(secs) = args.session_lease {
        config.session_lease = Duration::from_secs(secs);
    }
    eprintln!(
        "citronfs meta-server: cluster {:?}, RPC on {}",
        config.cluster, config.listen
    );
    MetaServer::run_forever(config)
}

/// Options of `citronfs data-server`.
#[derive(Args, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataArgs {
    /// A TOML file with any of these options (keys are the long names with `_`).
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// A stable name: restarted with the same name, the server gets its chunks back.
    #[arg(long)]
    name: Option<String>,
    /// The meta server's RPC address [default: 127.0.0.1:7700].
    #[arg(long)]
    meta: Option<String>,
    /// The cluster's name.
    #[arg(long)]
    cluster: Option<String>,
    /// The cluster's shared secret.
    #[arg(long, env = "CITRONFS_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Bytes of memory to serve [default: 1G].
    #[arg(long)]
    capacity: Option<String>,
    /// How clients reach the region [default: tcp].
    #[arg(long, value_enum)]
    fabric: Option<Backend>,
    /// shm: the region's directory [default: /dev/shm/citronfs/CLUSTER/NAME].
    #[arg(long)]
    region_dir: Option<PathBuf>,
    /// tcp: where the fabric server listens [default: 127.0.0.1:0].
    #[arg(long)]
    fabric_listen: Option<SocketAddr>,
    /// Keep the data in a file in this directory, so that it survives a restart.
    #[arg(long)]
    backing_dir: Option<PathBuf>,
}

/// Runs a data server until SIGINT or SIGTERM.
pub fn data_server(mut args: DataArgs) -> Result<()> {
    let mut file: DataArgs = load(args.config.as_deref())?;
    merge!(args, file; name, meta, cluster, token, capacity, fabric, region_dir, fabric_listen, backing_dir);
    let cluster = args.cluster.unwrap_or_else(|| "citronfs".into());
    let name = args.name.context("a data server needs a stable --name")?;
    let fabric = args.fabric.unwrap_or(Backend::Tcp).serve_at(
        args.region_dir
            .unwrap_or_else(|| fabric::transport::default_shm_dir(&cluster, &name)),
        args.fabric_listen
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0))),
    );
    let config = DataConfig {
        name,
        meta_addr: args.meta.unwrap_or_else(|| "127.0.0.1:7700".into()),
        cluster,
        token: require_token(args.token)?,
        capacity_bytes: parse_size(args.capacity.as_deref().unwrap_or("1G"))?,
        fabric,
        backing: match args.backing_dir {
            Some(dir) => Backing::File { dir },
            None => Backing::Memory,
        },
    };
    let mut handle = DataServer::start(config)?;
    eprintln!(
        "citronfs data-server: id {}, serving {} bytes",
        handle.id(),
        handle.region_bytes()
    );
    wait_for_stop_signal()?;
    handle.shutdown();
    Ok(())
}

/// Options of `citronfs mount`.
#[derive(Args, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MountArgs {
    /// Where to mount (an existing, empty directory).
    #[serde(skip)]
    mountpoint: PathBuf,
    /// A TOML file with any of these options (keys are the long names with `_`).
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// The meta server's RPC address [default: 127.0.0.1:7700].
    #[arg(long)]
    meta: Option<String>,
    /// The cluster's name.
    #[arg(long)]
    cluster: Option<String>,
    /// The cluster's shared secret.
    #[arg(long, env = "CITRONFS_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The range-lock scheme of every read and write: citron, mutex, seg, server, or a spec with
    /// parameters (e.g. seg:4:4096) [default: citron].
    #[arg(long, value_parser = value_parser!(LockScheme))]
    scheme: Option<LockScheme>,
    /// Let other users use the mount.
    #[arg(long)]
    allow_other: Option<bool>,
}

/// Mounts a cluster and serves the mount until SIGINT or SIGTERM, then unmounts.
pub fn mount(mut args: MountArgs) -> Result<()> {
    let mut file: MountArgs = load(args.config.as_deref())?;
    merge!(args, file; meta, cluster, token, scheme, allow_other);
    let mut options = MountOptions::new(
        args.meta.unwrap_or_else(|| "127.0.0.1:7700".into()),
        args.cluster.unwrap_or_else(|| "citronfs".into()),
        require_token(args.token)?,
    );
    options.scheme = args.scheme.unwrap_or(LockScheme::CITRON);
    let fs =
        CitronFs::connect(options).map_err(|e| anyhow::anyhow!("cannot reach the cluster: {e}"))?;
    let fuse = fs_client::fuse::FuseOptions {
        allow_other: args.allow_other.unwrap_or(false),
        ..Default::default()
    };
    let mount = Mount::at(Arc::new(fs), &args.mountpoint, &fuse)?;
    eprintln!(
        "citronfs mounted at {}; Ctrl-C (or fusermount3 -u) unmounts",
        args.mountpoint.display()
    );
    eprintln!("atomic I/O: {}", atomic_bound_line(mount.io_limits()));
    mount.wait_for_signal().context("unmount")
}

/// What `citronfs mount` and `citronfs up` say about the mount's atomic I/O bound: the size up
/// to which every read and write call is atomic, for any alignment of the user's buffer, and,
/// when it falls short of 16 MiB, why and what to do.
pub fn atomic_bound_line(l: fs_client::fuse::IoLimits) -> String {
    use fs_client::fuse::{ATOMIC_IO_TARGET, MAX_PAGES_LIMIT_SYSCTL};
    let mut line = format!(
        "reads and writes up to {} bytes{} are atomic, for any buffer alignment \
         (max_write {}, max_pages {}); larger ones are cut into atomic pieces",
        l.atomic_bound,
        if l.atomic_bound % (1 << 20) == 0 {
            format!(" ({} MiB)", l.atomic_bound >> 20)
        } else {
            String::new()
        },
        l.max_write,
        l.max_pages,
    );
    if l.atomic_bound < ATOMIC_IO_TARGET {
        line.push_str(&format!(
            "; NOT {} MiB: {}",
            ATOMIC_IO_TARGET >> 20,
            if !l.max_pages_supported {
                "the kernel lacks FUSE_MAX_PAGES".to_string()
            } else if l.max_pages_limit.is_none() {
                format!("this kernel has no {MAX_PAGES_LIMIT_SYSCTL} (Linux 6.13+)")
            } else {
                format!(
                    "mount as root (with /proc/sys writable), or set {MAX_PAGES_LIMIT_SYSCTL} \
                     to {} beforehand",
                    l.max_pages_asked
                )
            }
        ));
    }
    line
}

/// Blocks until SIGINT or SIGTERM.
pub fn wait_for_stop_signal() -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone())?;
    }
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}
