//! `citronfs up`: an embedded cluster on this machine — a meta server and N data servers in this
//! process, on the shm fabric by default — mounted through FUSE until Ctrl-C.

use super::config::{parse_size, DEFAULT_CLUSTER};
use super::roles::atomic_bound_line;
use anyhow::{Context, Result};
use clap::{value_parser, Args};
use cluster::{BackingKind, Cluster, ClusterSpec, Mount};
use fabric::Backend;
use fs_client::metrics::FuseMetrics;
use lockmgr::{LockMode, LockScheme};
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
    /// Replicas of every chunk of file data, each on another data server (at most
    /// --data-servers): with 2 or more, a file's data outlives a data server that dies. The
    /// default, 1, keeps one copy: every replica adds the file's size in memory and its bytes
    /// to every write. A directory's `citronfs.replicas` xattr sets it for what is created
    /// below it.
    #[arg(long, default_value_t = meta_server::DEFAULT_REPLICAS)]
    replicas: usize,
    /// The failure domain of each data server, in order, comma-separated (e.g. a,a,b,b): the
    /// replicas of a chunk go to distinct zones where there are enough, else to distinct
    /// servers. Servers beyond the list name none (a zone of their own each).
    #[arg(long, value_delimiter = ',')]
    zones: Vec<String>,
    /// Memory for file data, shared evenly by the data servers (e.g. 512M, 4G). Default: what
    /// fits this machine — a quarter of the memory available now (MemAvailable), no more than
    /// half the free space where the regions live (/dev/shm or $CITRONFS_RUN_DIR, or the
    /// --state-dir file system), in whole chunks, at least 4 MiB per data server.
    #[arg(long)]
    memory: Option<String>,
    /// The fabric between clients and servers.
    #[arg(long, value_enum, default_value = "shm")]
    fabric: Backend,
    /// The range-lock scheme of every read and write: citron, mutex, seg, server, or a spec with
    /// parameters (e.g. seg:4:4096).
    #[arg(long, default_value = "citron", value_parser = value_parser!(LockScheme))]
    scheme: LockScheme,
    /// How reads lock their byte ranges: shared (overlapping reads run together; writes still
    /// exclude them) or exclusive (as writes: for comparison).
    #[arg(long, default_value = "shared", value_parser = value_parser!(LockMode))]
    read_locks: LockMode,
    /// Keep the namespace and the data in this directory, so that the next `up` with the same
    /// directory finds them again. Without it everything lives in memory and is gone on exit.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// The cluster's name.
    #[arg(long, default_value = DEFAULT_CLUSTER)]
    cluster: String,
    /// Restrict the mount to the user running `up`. Without it every local user may use the
    /// mount, with the kernel checking permissions (allow_other + default_permissions), which
    /// needs root or `user_allow_other` in /etc/fuse.conf.
    #[arg(long)]
    private: bool,
    /// Threads per CPU serving the kernel's requests over FUSE-over-io_uring rings, where the
    /// kernel offers them (Linux 6.14+ with /sys/module/fuse/parameters/enable_uring = Y): a
    /// request is then served on the caller's CPU, about twice as fast for small I/O as over
    /// /dev/fuse. 0 keeps /dev/fuse only.
    #[arg(long, default_value_t = fs_client::fuse::FuseOptions::default().ring_threads_per_cpu)]
    fuse_ring_threads: usize,
    /// Serve Prometheus metrics of the whole embedded cluster and its mount over HTTP at this
    /// address (`GET /metrics`; port 0: any free port, printed at start).
    #[arg(long)]
    metrics: Option<SocketAddr>,
}

/// The default `--memory` (see its help): a quarter of `MemAvailable`, at most half the free
/// space of the file system the regions live on (the run directory's, `/dev/shm` unless
/// `CITRONFS_RUN_DIR` says otherwise, or the state directory), rounded
/// down to whole chunks per data server and raised to the 4 MiB minimum per server.
fn default_memory(state_dir: Option<&Path>, servers: u64) -> Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let available = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|kib| kib << 10)
        .context("no MemAvailable in /proc/meminfo: give --memory")?;
    let mut memory = available / 4;
    let regions = match state_dir {
        Some(dir) => dir.to_path_buf(),
        None => cluster::run_dir_parent(),
    };
    if let Some(free) = free_space(&regions) {
        memory = memory.min(free / 2);
    }
    let quantum = meta_server::DEFAULT_CHUNK_SIZE * servers;
    Ok((memory / quantum * quantum).max((4 << 20) * servers))
}

/// Bytes free to an unprivileged user on the file system holding `path` (its nearest existing
/// ancestor), if it can be asked.
fn free_space(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let existing = path.ancestors().find(|p| p.exists())?;
    let c = std::ffi::CString::new(existing.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a NUL-terminated path and `st` is written whole by a successful call.
    let st = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return None;
        }
        st
    };
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Starts the cluster, mounts it, waits for SIGINT or SIGTERM, then unmounts and stops.
pub fn up(args: UpArgs) -> Result<()> {
    let mut signals = super::StopSignals::catch()?;
    anyhow::ensure!(args.data_servers >= 1, "at least one data server is needed");
    anyhow::ensure!(
        (1..=proto::MAX_REPLICAS).contains(&args.replicas),
        "--replicas {} must be from 1 to {}",
        args.replicas,
        proto::MAX_REPLICAS
    );
    anyhow::ensure!(
        args.replicas <= args.data_servers,
        "--replicas {} needs at least {} data servers (--data-servers {}): each replica of a \
         chunk is on another one",
        args.replicas,
        args.replicas,
        args.data_servers
    );
    anyhow::ensure!(
        args.zones.len() <= args.data_servers,
        "--zones names {} zones for {} data servers (--data-servers)",
        args.zones.len(),
        args.data_servers
    );
    anyhow::ensure!(
        args.zones.iter().all(|z| !z.trim().is_empty()),
        "--zones {:?}: a zone must not be empty",
        args.zones.join(",")
    );
    let servers = args.data_servers as u64;
    let memory = match &args.memory {
        Some(text) => parse_size(text)?,
        None => default_memory(args.state_dir.as_deref(), servers)?,
    };
    let per_server = memory / servers;
    anyhow::ensure!(
        per_server >= 4 << 20,
        "--memory {} split over {} data servers leaves less than 4 MiB each",
        memory,
        args.data_servers
    );
    let scheme = args.scheme;
    let fuse = fs_client::fuse::FuseOptions {
        allow_other: !args.private,
        ring_threads_per_cpu: args.fuse_ring_threads,
        metrics: args.metrics.map(|_| FuseMetrics::new()),
        ..Default::default()
    };
    // Before anything starts: a shared mount this user may not make is a usage error.
    if fuse.allow_other {
        fs_client::fuse::other_users_allowed().map_err(anyhow::Error::msg)?;
    }
    prepare_mountpoint(&args.mountpoint)?;

    let cluster = Cluster::start(ClusterSpec {
        name: args.cluster.clone(),
        data_servers: args.data_servers,
        capacity: per_server,
        fabric: args.fabric,
        // A kept state directory keeps the data too: file-backed regions in it.
        backing: match args.state_dir {
            Some(_) => BackingKind::File,
            None => BackingKind::Memory,
        },
        state_dir: args.state_dir.clone(),
        scheme,
        replicas: args.replicas,
        zones: args.zones.clone(),
        ..ClusterSpec::server_defaults()
    })?;
    // A signal that came while the cluster started ends the run once mounted (in order).
    signals.orderly_from_now();
    let mut options = cluster.options(scheme);
    options.read_locks = args.read_locks;
    let fs = Arc::new(
        fs_client::CitronFs::connect(options)
            .map_err(|e| anyhow::anyhow!("cannot open a session with the cluster: {e}"))?,
    );
    let metrics = match (args.metrics, &fuse.metrics) {
        (Some(addr), Some(fuse_metrics)) => {
            let mut registry = super::metrics::registry();
            fuse_metrics.register(&mut registry);
            fs_client::metrics::register_client(&mut registry, &fs);
            cluster.meta().register_metrics(&mut registry);
            Some(super::metrics::serve(addr, registry)?)
        }
        _ => None,
    };
    let mount = Mount::at(fs, &args.mountpoint, &fuse)?;

    println!("CitronFS is up:");
    println!(
        "  meta server   {} (fabric {}, cluster {:?})",
        cluster.meta_addr(),
        args.fabric.name(),
        args.cluster
    );
    for d in cluster.data_servers() {
        println!(
            "  data server   id {} with {} MiB",
            d.id(),
            d.region_bytes() >> 20
        );
    }
    println!("  lock scheme   {scheme} (reads {})", args.read_locks);
    match &args.state_dir {
        Some(dir) => println!("  state         kept in {}", dir.display()),
        None => {
            println!("  state         in memory only (gone when stopped; --state-dir keeps it)")
        }
    }
    println!(
        "  mounted at    {} ({})",
        args.mountpoint.display(),
        if fuse.allow_other {
            "shared: every local user, permissions checked by the kernel"
        } else {
            "private: this user only"
        }
    );
    println!("  atomic I/O    {}", atomic_bound_line(mount.io_limits()));
    println!("  FUSE requests over {}", mount.fuse_rings());
    if let Some(bound) = metrics {
        println!(
            "  metrics       http://{bound}{}",
            super::metrics::METRICS_PATH
        );
    }
    // Another client of this cluster, for this machine's other users or a second mount: it
    // needs the token, printed here only (the cluster's secret, made fresh for this run). The
    // executable by its path, so that the line works as printed after `cargo run` too.
    let me = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "citronfs".into());
    println!(
        "  more clients  CITRONFS_TOKEN={} {me} mount --meta {} --cluster {} --scheme {scheme}{} DIR",
        cluster.token(),
        cluster.meta_addr(),
        args.cluster,
        match args.read_locks {
            LockMode::Shared => String::new(),
            mode => format!(" --read-locks {mode}"),
        }
    );
    println!(
        "Stop with Ctrl-C (or `kill {}`): it unmounts and stops every server.",
        std::process::id()
    );

    let unmounted = mount.wait_for_signal(signals.flag());
    println!(
        "unmounted {}; stopping the servers",
        args.mountpoint.display()
    );
    cluster.shutdown()?;
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
