//! `citronfs bench fs`: the file system against tmpfs, in one run.
//!
//! The run starts an embedded CitronFS cluster in this process (meta server and data servers on
//! the shm fabric by default), mounts it through FUSE in a temporary directory, and measures the
//! same workloads on that mount and on a file under /dev/shm (tmpfs):
//! - `seq-write`, `seq-read`: 1 MiB writes and reads, each thread walking its region in order;
//! - `rand-write`, `rand-read`: 4 KiB writes and reads at uniform, 4 KiB-aligned offsets within
//!   the thread's region;
//! - `rand-write-shared`, `rand-read-shared` (on request): 4 KiB at uniform offsets anywhere in
//!   the file, so threads' ranges can overlap and their locks can conflict.
//!
//! All threads of a case share one file (a shared file is what CITRON's range locks are for); in
//! the disjoint patterns thread `t` of `n` works only in the `t`-th `1/n` of it. Every file is
//! filled once before the cases (untimed), so reads return data and writes overwrite allocated
//! chunks: no chunk allocation happens in a timed loop. Every file system is set up and filled
//! first; then each case (pattern, threads) runs on all of them back to back, so that the
//! ratios compare measurements seconds apart even on a loaded machine. I/O is `pread`/`pwrite`
//! (`FileExt::read_at`/`write_at`). The CitronFS mount uses direct I/O, so every call is a FUSE
//! request that takes a range lock and moves data with one-sided verbs; on tmpfs the page cache
//! *is* the storage, so a call there is a memory copy behind a syscall.
//!
//! With `--fs ...,library` the run also calls the CitronFS client library directly on the same
//! cluster (no kernel, no FUSE), which separates what FUSE costs from what the lock and the
//! fabric cost. With `--fs ...,null` it measures the ceiling of the FUSE path on this machine:
//! the same FUSE adapter, with the same mount options, over `fs_client::null::NullFs`, a
//! backend that stores nothing and answers at once (reads return zeros, writes their length).
//! Every CitronFS row then carries its ratio to the null mount's: throughput (`vs null`) and
//! p50 latency (`p50/null`).
//!
//! The mount is unmounted and the cluster stopped at the end, on an error, and on Ctrl-C
//! (SIGINT or SIGTERM end the run after the current case; a second Ctrl-C exits at once).

use super::clients::{LibraryFile, SharedFile};
use super::runner::{interrupted, Run};
use crate::cmd::config::parse_size;
use crate::report::{fmt_f, fmt_opt, fmt_ratio, ratio, Report};
use anyhow::{bail, Context, Result};
use clap::{value_parser, Args};
use cluster::{Cluster, ClusterSpec, Mount};
use fabric::Backend;
use fs_client::CitronFs;
use hdrhistogram::Histogram;
use lockmgr::{LockScheme, LockStats};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Bytes per sequential operation.
const SEQ_BLOCK: u64 = 1 << 20;
/// Bytes per random operation.
const RAND_BLOCK: u64 = 4 << 10;
/// tmpfs's `f_type` in `statfs`.
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// A workload: what each thread does in a closed loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pattern {
    /// 1 MiB writes in order through the thread's region.
    SeqWrite,
    /// 1 MiB reads in order through the thread's region.
    SeqRead,
    /// 4 KiB writes at random aligned offsets in the thread's region.
    RandWrite,
    /// 4 KiB reads at random aligned offsets in the thread's region.
    RandRead,
    /// 4 KiB writes at random aligned offsets anywhere in the file (threads overlap).
    RandWriteShared,
    /// 4 KiB reads at random aligned offsets anywhere in the file (threads overlap).
    RandReadShared,
}

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::SeqWrite => "seq-write",
            Pattern::SeqRead => "seq-read",
            Pattern::RandWrite => "rand-write",
            Pattern::RandRead => "rand-read",
            Pattern::RandWriteShared => "rand-write-shared",
            Pattern::RandReadShared => "rand-read-shared",
        }
    }

    /// Bytes per operation.
    fn block(self) -> u64 {
        match self {
            Pattern::SeqWrite | Pattern::SeqRead => SEQ_BLOCK,
            _ => RAND_BLOCK,
        }
    }

    fn is_write(self) -> bool {
        matches!(
            self,
            Pattern::SeqWrite | Pattern::RandWrite | Pattern::RandWriteShared
        )
    }

    fn is_random(self) -> bool {
        !matches!(self, Pattern::SeqWrite | Pattern::SeqRead)
    }

    /// Whether every thread works over the whole file instead of its own part.
    fn is_shared(self) -> bool {
        matches!(self, Pattern::RandWriteShared | Pattern::RandReadShared)
    }
}

/// What is measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// A file on the CitronFS FUSE mount.
    Citronfs,
    /// A file under the tmpfs directory (the reference).
    Tmpfs,
    /// A file on a FUSE mount of the null backend (stores nothing, answers at once) through
    /// the same adapter and mount options: the ceiling of the FUSE path.
    Null,
    /// The CitronFS client library called directly, without the kernel and FUSE.
    Library,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Citronfs => "citronfs",
            Target::Tmpfs => "tmpfs",
            Target::Null => "null",
            Target::Library => "citronfs-lib",
        }
    }
}

/// Options of `citronfs bench fs`.
#[derive(Args, Debug)]
pub struct FsArgs {
    /// Thread counts to run (comma-separated); the threads of a case share one file.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    threads: Vec<usize>,
    /// Size of the shared file, all threads together (each thread of the disjoint patterns gets
    /// 1/threads of it).
    #[arg(long, default_value = "256M")]
    size: String,
    /// Seconds each case is measured (after a short untimed warm-up).
    #[arg(long, default_value_t = 1.5)]
    duration: f64,
    /// Workloads (comma-separated): seq-write, seq-read, rand-write, rand-read,
    /// rand-write-shared, rand-read-shared.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "seq-write,seq-read,rand-write,rand-read"
    )]
    patterns: Vec<Pattern>,
    /// What to measure (comma-separated): citronfs (the FUSE mount), tmpfs, library (the client
    /// library without FUSE), null (the same FUSE mount over a backend that stores nothing:
    /// the FUSE path's ceiling).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "tmpfs,citronfs"
    )]
    fs: Vec<Target>,
    /// Range-lock schemes of CitronFS (comma-separated): citron, mutex, seg, server, or a spec
    /// with parameters (e.g. seg:4:4096); each one is mounted and measured in turn.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "citron",
        value_parser = value_parser!(LockScheme)
    )]
    scheme: Vec<LockScheme>,
    /// The fabric between the client and the servers.
    #[arg(long, value_enum, default_value = "shm")]
    fabric: Backend,
    /// Request threads of the FUSE mounts (CitronFS's and the null backend's alike)
    /// [default: the mount's default].
    #[arg(long)]
    fuse_threads: Option<usize>,
    /// Threads per CPU serving FUSE over io_uring on the FUSE mounts (CitronFS's and the null
    /// backend's alike), where the kernel offers it (fuse's enable_uring parameter); 0:
    /// /dev/fuse only [default: the mount's default].
    #[arg(long)]
    fuse_ring_threads: Option<usize>,
    /// How long the kernel may cache attributes and entries on the FUSE mounts, in
    /// milliseconds [default: the mount's default, 0: every stat reaches the file system].
    #[arg(long)]
    attr_ttl_ms: Option<u64>,
    /// Count every FUSE request on the FUSE mounts as `--metrics` does (by operation, with its
    /// latency), to measure what counting costs; nothing is served.
    #[arg(long)]
    fuse_metrics: bool,
    /// Data servers of the embedded cluster (files are striped over them).
    #[arg(long, default_value_t = 2)]
    data_servers: usize,
    /// Replicas of every chunk of the CitronFS files (comma-separated: each count gets a file
    /// of its own, in a directory whose `citronfs.replicas` is that count; at most
    /// --data-servers): a write goes to every replica, a read to one (docs/REPLICAS.md).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    replicas: Vec<usize>,
    /// Directory for the tmpfs file [default: a fresh directory under /dev/shm].
    #[arg(long)]
    tmpfs_dir: Option<PathBuf>,
    /// Print one JSON object per result instead of a table.
    #[arg(long)]
    json: bool,
}

/// One result: a file system, a pattern, a thread count.
#[derive(Clone, Debug, Serialize)]
struct FsResult {
    /// `tmpfs`, `null` (the null FUSE backend), `citronfs` (the FUSE mount) or `citronfs-lib`
    /// (the library without FUSE).
    fs: &'static str,
    /// The lock scheme (`null` for tmpfs and the null backend).
    scheme: Option<String>,
    /// Replicas of every chunk of the file (CitronFS only).
    replicas: Option<usize>,
    /// The fabric (`null` for tmpfs).
    fabric: Option<&'static str>,
    pattern: &'static str,
    threads: usize,
    /// Bytes per operation.
    block_bytes: u64,
    /// Size of the shared file.
    file_bytes: u64,
    seconds: f64,
    ops: u64,
    mib_per_s: f64,
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    /// `mib_per_s` over tmpfs's for the same pattern and threads (when tmpfs ran).
    ratio_vs_tmpfs: Option<f64>,
    /// CitronFS: fabric round trips per operation, all of them: the range lock's (the file
    /// control block's words carried in them), the meta region's, the data servers'
    /// (`CitronFs::io_stats`; warm-up included).
    rtts_per_op: Option<f64>,
    /// `mib_per_s` over the null FUSE backend's for the same pattern and threads (when it ran):
    /// the share of the FUSE path's ceiling reached.
    ratio_vs_null: Option<f64>,
    /// `p50_us` over the null FUSE backend's (when it ran): how many times the FUSE path's
    /// own latency a call takes.
    p50_vs_null: Option<f64>,
    /// CitronFS: fabric round trips per operation spent acquiring and releasing its range lock
    /// (warm-up included).
    lock_rtts_per_op: Option<f64>,
    /// CitronFS: mean time per operation inside the lock's acquire, in µs.
    lock_acquire_us: Option<f64>,
    /// CitronFS: mean time per operation in the library's locked I/O, from the start of its
    /// acquire to the end of its release, in µs (`CitronFs::io_stats`): through a mount, the
    /// share of a call's latency that is the client's own; the rest is the FUSE path's.
    locked_us: Option<f64>,
    /// CitronFS: aborted lock attempts during the case.
    lock_aborts: Option<u64>,
}

/// The part of the file one thread works in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// First byte.
    pub start: u64,
    /// Length in bytes (a multiple of [`SEQ_BLOCK`], hence of every block size).
    pub len: u64,
}

/// Thread `t`'s region of a file of `file_size` bytes shared by `threads` threads: the whole
/// file when `shared`, else its own `1/threads`, cut to whole 1 MiB blocks so that regions are
/// disjoint and every operation stays inside one.
pub fn thread_region(file_size: u64, threads: usize, t: usize, shared: bool) -> Region {
    let whole = file_size / SEQ_BLOCK * SEQ_BLOCK;
    if shared {
        return Region {
            start: 0,
            len: whole,
        };
    }
    let len = whole / threads as u64 / SEQ_BLOCK * SEQ_BLOCK;
    Region {
        start: t as u64 * len,
        len,
    }
}

/// The offsets one thread visits: in order through its region (wrapping), or uniformly random
/// block-aligned ones.
pub struct Offsets {
    region: Region,
    block: u64,
    next: u64,
    rng: Option<SmallRng>,
}

impl Offsets {
    /// Offsets of `block`-byte operations in `region`; random ones are drawn from `seed`.
    pub fn new(region: Region, block: u64, random: bool, seed: u64) -> Offsets {
        assert!(
            block > 0 && region.len >= block,
            "a region must hold a block"
        );
        Offsets {
            region,
            block,
            next: 0,
            rng: random.then(|| SmallRng::seed_from_u64(seed)),
        }
    }

    /// The next offset; `[offset, offset + block)` lies inside the region.
    pub fn next_offset(&mut self) -> u64 {
        match &mut self.rng {
            Some(rng) => {
                let slots = self.region.len / self.block;
                self.region.start + rng.random_range(0..slots) * self.block
            }
            None => {
                let offset = self.region.start + self.next;
                self.next += self.block;
                if self.next + self.block > self.region.len {
                    self.next = 0;
                }
                offset
            }
        }
    }
}

/// Settings shared by every case of a run.
struct Plan<'a> {
    file_size: u64,
    duration: Duration,
    warmup: Duration,
    patterns: &'a [Pattern],
    threads: &'a [usize],
    stop: &'a AtomicBool,
    run: &'a Run,
}

/// What one case measured.
struct Measured {
    ops: u64,
    bytes: u64,
    seconds: f64,
    histogram: Histogram<u64>,
}

/// Runs the benchmark.
pub fn run(args: &FsArgs) -> Result<()> {
    let file_size = parse_size(&args.size)?;
    let max_threads = args.threads.iter().copied().max().unwrap_or(0);
    anyhow::ensure!(
        !args.threads.is_empty() && args.threads.iter().all(|&t| t >= 1),
        "--threads needs thread counts of at least 1"
    );
    anyhow::ensure!(
        file_size >= max_threads as u64 * SEQ_BLOCK,
        "--size {} is too small: every one of {max_threads} threads needs at least 1 MiB",
        args.size
    );
    anyhow::ensure!(
        args.duration > 0.0 && args.duration.is_finite(),
        "--duration must be positive"
    );
    anyhow::ensure!(!args.patterns.is_empty(), "--patterns is empty");
    anyhow::ensure!(!args.fs.is_empty(), "--fs is empty");
    anyhow::ensure!(args.data_servers >= 1, "at least one data server is needed");
    anyhow::ensure!(
        !args.replicas.is_empty()
            && args
                .replicas
                .iter()
                .all(|&r| (1..=proto::MAX_REPLICAS).contains(&r) && r <= args.data_servers),
        "--replicas needs counts from 1 to {} and at most --data-servers ({})",
        proto::MAX_REPLICAS,
        args.data_servers
    );
    anyhow::ensure!(
        args.fuse_threads != Some(0),
        "--fuse-threads needs at least 1 thread"
    );
    let fuse_options = fs_client::fuse::FuseOptions {
        threads: args.fuse_threads.unwrap_or(cluster::fuse_options().threads),
        ring_threads_per_cpu: args
            .fuse_ring_threads
            .unwrap_or(cluster::fuse_options().ring_threads_per_cpu),
        attr_ttl: args
            .attr_ttl_ms
            .map_or(cluster::fuse_options().attr_ttl, Duration::from_millis),
        metrics: args.fuse_metrics.then(fs_client::metrics::FuseMetrics::new),
        ..cluster::fuse_options()
    };
    let schemes: Vec<LockScheme> = args.scheme.clone();
    let citron_targets: Vec<Target> = [Target::Citronfs, Target::Library]
        .into_iter()
        .filter(|t| args.fs.contains(t))
        .collect();
    if args.fs.contains(&Target::Citronfs) || args.fs.contains(&Target::Null) {
        // Before anything starts, so that a machine without FUSE gets one clear message.
        check_fuse(Path::new("/dev/fuse"))?;
    }

    let cases_per_fs = (args.patterns.len() * args.threads.len()) as u64;
    let fs_runs = u64::from(args.fs.contains(&Target::Tmpfs))
        + u64::from(args.fs.contains(&Target::Null))
        + (citron_targets.len() * schemes.len() * args.replicas.len()) as u64;
    // Ctrl-C and SIGTERM end the run between cases, so that the mount is unmounted and the
    // servers stopped; a second signal exits at once (leaving the mount to `fusermount3 -u`).
    let run = Run::start(args.json, cases_per_fs * fs_runs)?;
    let duration = Duration::from_secs_f64(args.duration);
    let plan = Plan {
        file_size,
        duration,
        // Long enough for FUSE threads, endpoints and chunk-map caches to be set up.
        warmup: (duration / 10).min(Duration::from_millis(200)),
        patterns: &args.patterns,
        threads: &args.threads,
        stop: run.stop(),
        run: &run,
    };

    let mut report = Report::new(
        args.json,
        &[
            "fs",
            "scheme",
            "replicas",
            "pattern",
            "threads",
            "MiB/s",
            "ops/s",
            "p50 µs",
            "p99 µs",
            "vs tmpfs",
            "vs null",
            "p50/null",
            "RTTs/op",
            "lock RTTs/op",
            "acquire µs",
            "locked µs",
        ],
    );
    let mut emit = |mut r: FsResult, case: &[FsResult]| {
        let of = |fs: &str| case.iter().find(|t| t.fs == fs);
        r.ratio_vs_tmpfs = ratio(r.mib_per_s, of(Target::Tmpfs.name()).map(|t| t.mib_per_s));
        let null = of(Target::Null.name());
        r.ratio_vs_null = ratio(r.mib_per_s, null.map(|t| t.mib_per_s));
        r.p50_vs_null = ratio(r.p50_us, null.map(|t| t.p50_us));
        report.add(
            vec![
                r.fs.to_string(),
                r.scheme.clone().unwrap_or_else(|| "-".into()),
                r.replicas.map_or_else(|| "-".into(), |n| n.to_string()),
                r.pattern.to_string(),
                r.threads.to_string(),
                fmt_f(r.mib_per_s, 1),
                format!("{:.0}", r.ops_per_s),
                fmt_f(r.p50_us, 1),
                fmt_f(r.p99_us, 1),
                fmt_ratio(r.ratio_vs_tmpfs),
                fmt_ratio(r.ratio_vs_null),
                fmt_ratio(r.p50_vs_null),
                fmt_opt(r.rtts_per_op, 2),
                fmt_opt(r.lock_rtts_per_op, 2),
                fmt_opt(r.lock_acquire_us, 1),
                fmt_opt(r.locked_us, 1),
            ],
            &r,
        );
        r
    };

    // Everything measured is opened and filled first; then each case runs on every subject in
    // turn, back to back (tmpfs, null, then CitronFS), so that a ratio compares runs seconds
    // apart: on a loaded machine, runs minutes apart would compare the load as much as the
    // file systems. Locals drop in reverse order: the files close (`subjects`) and are removed
    // before their mounts go and the cluster stops.
    let mut cluster: Option<Cluster> = None;
    let mut null_mount: Option<(fs_client::fuse::MountHandle, tempfile::TempDir)> = None;
    // How each FUSE mount gets its requests (io_uring or /dev/fuse), for the notes.
    let mut transports: Vec<String> = Vec::new();
    let mut mounts: Vec<Mount> = Vec::new();
    let mut tmpfs_temp: Option<tempfile::TempDir> = None;
    let mut removals: Vec<RemoveOnDrop> = Vec::new();
    let mut subjects: Vec<Subject> = Vec::new();
    let mut tmpfs_note = None;
    if args.fs.contains(&Target::Tmpfs) {
        let dir = match &args.tmpfs_dir {
            Some(dir) => dir.clone(),
            None => {
                let temp = tempfile::Builder::new()
                    .prefix("citronfs-bench-fs-")
                    .tempdir_in("/dev/shm")
                    .context("create a directory under /dev/shm (give --tmpfs-dir)")?;
                tmpfs_temp.insert(temp).path().to_path_buf()
            }
        };
        if !is_tmpfs(&dir) {
            tmpfs_note = Some(format!(
                "{} is NOT on tmpfs: the `tmpfs` rows measure whatever file system it is on",
                dir.display()
            ));
        }
        let path = dir.join(format!("bench-{}.dat", std::process::id()));
        removals.push(RemoveOnDrop::Path(path.clone()));
        subjects.push(Subject::new(
            Target::Tmpfs,
            None,
            None,
            open_rw(&path)?,
            None,
        ));
    }
    if args.fs.contains(&Target::Null) {
        run.say("mounting the null backend");
        let (handle, dir) = mount_null(&fuse_options)?;
        let path = dir
            .path()
            .join(format!("bench-null-{}.dat", std::process::id()));
        transports.push(format!("null mount: {}", handle.fuse_rings()));
        null_mount = Some((handle, dir));
        subjects.push(Subject::new(
            Target::Null,
            None,
            None,
            open_rw(&path)?,
            None,
        ));
    }
    if !citron_targets.is_empty() {
        run.say("starting the cluster");
        // Each scheme's files (each replica of them), with room to spare for chunk rounding and
        // the stripes.
        let files = (citron_targets.len() * schemes.len()) as u64
            * args.replicas.iter().sum::<usize>() as u64;
        let memory = (file_size + SEQ_BLOCK * args.data_servers as u64) * files + (256 << 20);
        let per_server = (memory / args.data_servers as u64).max(64 << 20);
        let cluster = cluster.insert(Cluster::start(ClusterSpec {
            name: "citronfs-bench".into(),
            data_servers: args.data_servers,
            capacity: per_server,
            fabric: args.fabric,
            lock_server: schemes.iter().any(LockScheme::uses_service),
            ..ClusterSpec::server_defaults()
        })?);
        let fabric_name = Some(args.fabric.name());
        for &scheme in &schemes {
            let fs = Arc::new(cluster.connect(scheme)?);
            let caller = CitronFs::process_caller();
            for &replicas in &args.replicas {
                // A directory of this replica count for the scheme's files.
                let dir = format!("bench-r{replicas}-{}-{}", scheme.name(), std::process::id());
                let dir_ino = fs
                    .mkdir(caller, proto::ROOT_INO, &dir, 0o755)
                    .map_err(|e| anyhow::anyhow!("mkdir {dir}: {e}"))?
                    .ino;
                fs.setxattr(
                    dir_ino,
                    proto::REPLICAS_XATTR,
                    replicas.to_string().as_bytes(),
                    proto::rpc::XattrMode::Either,
                )
                .map_err(|e| anyhow::anyhow!("setxattr {dir}: {e}"))?;
                let name = format!("bench-{}-{}.dat", scheme.name(), std::process::id());
                let scheme_name = Some(scheme.name());
                if args.fs.contains(&Target::Citronfs) {
                    let mount = Mount::in_temp_dir(fs.clone(), &fuse_options)?;
                    transports.push(format!(
                        "CitronFS mount ({}, {replicas} replicas): {}",
                        scheme.name(),
                        mount.fuse_rings()
                    ));
                    let path = mount.path().join(&dir).join(&name);
                    mounts.push(mount);
                    // Frees the chunks; the run's result matters more than a failed cleanup.
                    removals.push(RemoveOnDrop::Path(path.clone()));
                    let file = open_rw(&path)?;
                    subjects.push(
                        Subject::new(
                            Target::Citronfs,
                            scheme_name,
                            fabric_name,
                            file,
                            Some(fs.clone()),
                        )
                        .with_replicas(replicas),
                    );
                }
                if args.fs.contains(&Target::Library) {
                    let name = format!("lib-{name}");
                    let (_, fh) = fs
                        .create(caller, dir_ino, &name, 0o644, libc::O_RDWR)
                        .map_err(|e| anyhow::anyhow!("create {name}: {e}"))?;
                    removals.push(RemoveOnDrop::Library(fs.clone(), dir_ino, name));
                    // Dropping the file releases its handle.
                    let file = LibraryFile::new(fs.clone(), fh);
                    subjects.push(
                        Subject::new(
                            Target::Library,
                            scheme_name,
                            fabric_name,
                            file,
                            Some(fs.clone()),
                        )
                        .with_replicas(replicas),
                    );
                }
            }
        }
    }
    run.set_steps(cases_per_fs * subjects.len() as u64);

    for s in &subjects {
        run.say(format!("{}: filling the file", s.label()));
        fill(s.io.as_ref(), plan.file_size, plan.stop)?;
    }
    for &threads in plan.threads {
        for &pattern in plan.patterns {
            let mut case = Vec::with_capacity(subjects.len());
            for s in &subjects {
                let r = measure(&plan, s, pattern, threads)?;
                case.push(emit(r, &case));
                run.advance();
            }
        }
    }

    // Close, remove, unmount, stop — in that order, reporting what fails.
    drop(subjects);
    drop(removals);
    drop(tmpfs_temp);
    for mount in mounts {
        let at = mount.path().to_path_buf();
        mount
            .unmount()
            .with_context(|| format!("unmount {}", at.display()))?;
    }
    if let Some((handle, dir)) = null_mount {
        handle
            .unmount()
            .with_context(|| format!("unmount {}", dir.path().display()))?;
    }
    if let Some(cluster) = cluster {
        run.say("stopping the cluster");
        cluster.shutdown()?;
    }
    run.finish();
    report.finish();
    if !args.json {
        print_notes(args, file_size, tmpfs_note, &transports);
    }
    Ok(())
}

/// One thing measured: a file on tmpfs, on a FUSE mount (CitronFS's, the null backend's), or
/// opened through the client library.
struct Subject {
    target: Target,
    /// The lock scheme (CitronFS only).
    scheme: Option<&'static str>,
    /// Replicas of every chunk of the file (CitronFS only).
    replicas: Option<usize>,
    /// The fabric (CitronFS only).
    fabric: Option<&'static str>,
    io: Box<dyn SharedFile>,
    /// The CitronFS client behind `io`, for its lock statistics.
    client: Option<Arc<CitronFs>>,
}

impl Subject {
    fn new(
        target: Target,
        scheme: Option<&'static str>,
        fabric: Option<&'static str>,
        io: impl SharedFile + 'static,
        client: Option<Arc<CitronFs>>,
    ) -> Subject {
        Subject {
            target,
            scheme,
            replicas: None,
            fabric,
            io: Box::new(io),
            client,
        }
    }

    /// The subject, its file of `replicas` replicas.
    fn with_replicas(self, replicas: usize) -> Subject {
        Subject {
            replicas: Some(replicas),
            ..self
        }
    }

    fn label(&self) -> String {
        match (self.scheme, self.replicas) {
            (Some(scheme), Some(r)) => format!("{} ({scheme}, {r} replicas)", self.target.name()),
            (Some(scheme), None) => format!("{} ({scheme})", self.target.name()),
            _ => self.target.name().to_string(),
        }
    }
}

/// A file removed on drop: by path, or through the client library that created it (in the
/// directory of that inode).
enum RemoveOnDrop {
    Path(PathBuf),
    Library(Arc<CitronFs>, proto::Ino, String),
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        match self {
            RemoveOnDrop::Path(path) => {
                let _ = std::fs::remove_file(path);
            }
            RemoveOnDrop::Library(fs, dir, name) => {
                let _ = fs.unlink(*dir, name);
            }
        }
    }
}

/// Runs one case (`pattern`, `threads`) on `subject`'s file, already filled.
fn measure(plan: &Plan, subject: &Subject, pattern: Pattern, threads: usize) -> Result<FsResult> {
    plan.run.say(format!(
        "{}: {}, {threads} threads",
        subject.label(),
        pattern.name()
    ));
    let client = subject.client.as_deref();
    let before = client.map(CitronFs::lock_stats);
    let io_before = client.map(CitronFs::io_stats);
    let m = run_case(plan, subject.io.as_ref(), pattern, threads).with_context(|| {
        format!(
            "{} {} with {threads} threads",
            subject.label(),
            pattern.name()
        )
    })?;
    // Every call has returned, so every worker's lock handle is counted.
    let lock = before
        .zip(client.map(CitronFs::lock_stats))
        .and_then(|(b, a)| LockDelta::between(&b, &a));
    let io = io_before
        .zip(client.map(CitronFs::io_stats))
        .map(|(b, a)| a.since(&b))
        .filter(|d| d.locked_ios > 0);
    let rtts_per_op = io.map(|d| d.round_trips as f64 / d.locked_ios as f64);
    interrupted(plan.stop)?;
    let us = |q: f64| m.histogram.value_at_quantile(q) as f64 / 1000.0;
    Ok(FsResult {
        fs: subject.target.name(),
        scheme: subject.scheme.map(str::to_string),
        replicas: subject.replicas,
        fabric: subject.fabric,
        pattern: pattern.name(),
        threads,
        block_bytes: pattern.block(),
        file_bytes: plan.file_size,
        seconds: m.seconds,
        ops: m.ops,
        mib_per_s: m.bytes as f64 / (1 << 20) as f64 / m.seconds,
        ops_per_s: m.ops as f64 / m.seconds,
        p50_us: us(0.5),
        p99_us: us(0.99),
        max_us: m.histogram.max() as f64 / 1000.0,
        ratio_vs_tmpfs: None,
        rtts_per_op,
        ratio_vs_null: None,
        p50_vs_null: None,
        lock_rtts_per_op: lock.map(|l| l.rtts_per_op),
        lock_acquire_us: lock.map(|l| l.acquire_us),
        locked_us: io.and_then(|d| d.mean_locked_us()),
        lock_aborts: lock.map(|l| l.aborts),
    })
}

/// What the range locks did during one case.
#[derive(Clone, Copy, Debug)]
struct LockDelta {
    rtts_per_op: f64,
    acquire_us: f64,
    aborts: u64,
}

impl LockDelta {
    /// The difference of two snapshots of one client's statistics (`None`: no lock taken).
    fn between(before: &LockStats, after: &LockStats) -> Option<LockDelta> {
        let ops = after.acquisitions.checked_sub(before.acquisitions)?;
        if ops == 0 {
            return None;
        }
        let rtts = (after.acquire.round_trips + after.release.round_trips)
            .saturating_sub(before.acquire.round_trips + before.release.round_trips);
        let time = after.acquire_time.saturating_sub(before.acquire_time);
        Some(LockDelta {
            rtts_per_op: rtts as f64 / ops as f64,
            acquire_us: time.as_secs_f64() * 1e6 / ops as f64,
            aborts: after.aborts.total().saturating_sub(before.aborts.total()),
        })
    }
}

/// Writes the whole file once with a non-zero pattern, 1 MiB at a time.
fn fill(io: &dyn SharedFile, file_size: u64, stop: &AtomicBool) -> Result<()> {
    let buf = pattern_buffer(SEQ_BLOCK as usize, 0x5a);
    let whole = file_size / SEQ_BLOCK * SEQ_BLOCK;
    let mut offset = 0;
    while offset < whole {
        interrupted(stop)?;
        io.write_at(&buf, offset).context("fill the file")?;
        offset += SEQ_BLOCK;
    }
    Ok(())
}

/// A buffer of `len` bytes that is not all zeros (no file system gets to skip it).
fn pattern_buffer(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// `threads` threads run `pattern` on `io` for the warm-up, then for the measured duration.
fn run_case(
    plan: &Plan,
    io: &dyn SharedFile,
    pattern: Pattern,
    threads: usize,
) -> Result<Measured> {
    let barrier = Barrier::new(threads);
    let per_thread = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || -> Result<Measured> {
                    let region = thread_region(plan.file_size, threads, t, pattern.is_shared());
                    let block = pattern.block();
                    let mut offsets =
                        Offsets::new(region, block, pattern.is_random(), 0x5eed + t as u64);
                    let mut buf = pattern_buffer(block as usize, t as u8);
                    let mut histogram = new_histogram();
                    let op = |offsets: &mut Offsets, buf: &mut Vec<u8>| -> Result<()> {
                        let offset = offsets.next_offset();
                        if pattern.is_write() {
                            io.write_at(buf, offset)
                        } else {
                            io.read_at(buf, offset)
                        }
                    };
                    barrier.wait();
                    let warm = Instant::now();
                    while warm.elapsed() < plan.warmup && !plan.stop.load(Ordering::Relaxed) {
                        op(&mut offsets, &mut buf)?;
                    }
                    // The warm-up ends for every thread together, so that the measured window
                    // has all threads running.
                    barrier.wait();
                    let start = Instant::now();
                    let mut ops = 0u64;
                    loop {
                        let t0 = Instant::now();
                        if t0.duration_since(start) >= plan.duration
                            || plan.stop.load(Ordering::Relaxed)
                        {
                            break;
                        }
                        op(&mut offsets, &mut buf)?;
                        histogram.record(t0.elapsed().as_nanos().max(1) as u64)?;
                        ops += 1;
                    }
                    Ok(Measured {
                        ops,
                        bytes: ops * block,
                        seconds: start.elapsed().as_secs_f64(),
                        histogram,
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("benchmark thread panicked"))
            .collect::<Vec<_>>()
    });
    let mut total = Measured {
        ops: 0,
        bytes: 0,
        seconds: 0.0,
        histogram: new_histogram(),
    };
    for m in per_thread {
        let m = m?;
        total.ops += m.ops;
        total.bytes += m.bytes;
        // The case lasts until its slowest thread is done.
        total.seconds = total.seconds.max(m.seconds);
        total.histogram.add(&m.histogram)?;
    }
    Ok(total)
}

/// Nanoseconds from 1 ns to 60 s, 3 significant digits.
fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

fn open_rw(path: &Path) -> Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("open {}", path.display()))
}

/// Mounts a fresh null backend (`fs_client::null::NullFs`) with `options` in a new temporary
/// directory: the FUSE ceiling `bench fs` and `bench meta` measure beside CitronFS.
pub(crate) fn mount_null(
    options: &fs_client::fuse::FuseOptions,
) -> Result<(fs_client::fuse::MountHandle, tempfile::TempDir)> {
    let dir = tempfile::Builder::new()
        .prefix("citronfs-bench-null-")
        .tempdir()
        .context("create a mount point")?;
    let null = Arc::new(fs_client::null::NullFs::new());
    let handle = fs_client::fuse::mount(null, dir.path(), options)
        .with_context(|| format!("mount the null backend at {}", dir.path().display()))?;
    Ok((handle, dir))
}

/// Fails with a clear message when this machine cannot mount FUSE file systems: `fuse_dev`
/// (normally /dev/fuse) must open read-write, and a non-root user needs fusermount3.
pub(crate) fn check_fuse(fuse_dev: &Path) -> Result<()> {
    if let Err(why) = fs_client::fuse::check_mountable(fuse_dev) {
        bail!(
            "FUSE is not available here: {why}. `citronfs bench fs` measures a FUSE mount of \
             CitronFS (as does `bench meta`): load the fuse module (`modprobe fuse`), or start the container with \
             `--device /dev/fuse --cap-add SYS_ADMIN`; `--fs tmpfs,library` runs without FUSE"
        );
    }
    Ok(())
}

/// Whether `dir` is on tmpfs.
pub(crate) fn is_tmpfs(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c_path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `statfs` is plain old data, and the call only writes into it; `c_path` is a valid
    // NUL-terminated string for the duration of the call.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c_path.as_ptr(), &mut st) == 0 && st.f_type as i64 == TMPFS_MAGIC
    }
}

fn print_notes(args: &FsArgs, file_size: u64, tmpfs_note: Option<String>, transports: &[String]) {
    println!();
    println!(
        "One shared file of {} MiB per file system; with n threads, thread t works in the t-th \
         1/n of it (disjoint regions){}.",
        file_size >> 20,
        if args.patterns.iter().any(|p| p.is_shared()) {
            ", except the *-shared patterns, where every thread covers the whole file"
        } else {
            ""
        }
    );
    println!(
        "seq: 1 MiB pread/pwrite in order; rand: 4 KiB at uniform 4 KiB-aligned offsets. The file \
         is filled first, so writes overwrite allocated data. Latency is per call."
    );
    println!(
        "tmpfs: the page cache IS the storage, so a call is a memory copy behind a syscall. \
         CitronFS is mounted with direct_io (no page cache): every call is a FUSE request to this \
         process, a range lock, and one-sided verbs to {} data server(s) over the {} fabric.",
        args.data_servers,
        args.fabric.name()
    );
    if args.replicas.iter().any(|&r| r > 1) {
        println!(
            "replicas: every chunk of the file kept on that many data servers (docs/REPLICAS.md): \
             a write posts its data to each replica's server in the same round and returns when \
             every replica has it; a read takes one replica."
        );
    }
    if args.fs.contains(&Target::Null) {
        println!(
            "null: the same FUSE adapter and mount options over a backend that stores nothing \
             and answers at once (reads return zeros, writes their length): the FUSE path's \
             ceiling here. vs null: MiB/s over null's; p50/null: p50 latency over null's."
        );
    }
    println!(
        "RTTs/op: fabric round trips per call, all endpoints (lock, meta region, data servers); \
         lock RTTs/op: those spent acquiring and releasing its range lock (the file's size and \
         times ride in them); acquire µs: mean time per call inside the acquire (the client's \
         lock statistics, warm-up included); locked µs: mean time per call in the client \
         library's locked I/O, acquire to release (through a mount: the client's share of the \
         call, the rest is FUSE's)."
    );
    if !transports.is_empty() {
        println!(
            "FUSE requests reach the mounts over: {} (io_uring needs Linux 6.14+ with \
             /sys/module/fuse/parameters/enable_uring = Y; --fuse-ring-threads 0 keeps /dev/fuse).",
            transports.join("; ")
        );
    }
    if let Some(note) = tmpfs_note {
        println!("warning: {note}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_disjoint_whole_blocks_inside_the_file() {
        for size in [1 << 20, 5 << 20, (256 << 20) + 4096, 3 << 30] {
            for threads in [1, 2, 3, 4, 5] {
                if size < threads as u64 * SEQ_BLOCK {
                    continue;
                }
                let regions: Vec<Region> = (0..threads)
                    .map(|t| thread_region(size, threads, t, false))
                    .collect();
                for (t, r) in regions.iter().enumerate() {
                    assert!(r.len >= SEQ_BLOCK && r.len % SEQ_BLOCK == 0, "{r:?}");
                    assert!(r.start + r.len <= size, "{r:?} past {size}");
                    if t > 0 {
                        let prev = regions[t - 1];
                        assert!(prev.start + prev.len <= r.start, "{prev:?} overlaps {r:?}");
                    }
                }
                let shared = thread_region(size, threads, threads - 1, true);
                assert_eq!(shared.start, 0);
                assert!(shared.len <= size && size - shared.len < SEQ_BLOCK);
            }
        }
    }

    #[test]
    fn offsets_stay_in_the_region_and_are_aligned() {
        let region = Region {
            start: 3 << 20,
            len: 2 << 20,
        };
        for (block, random) in [(SEQ_BLOCK, false), (RAND_BLOCK, false), (RAND_BLOCK, true)] {
            let mut offsets = Offsets::new(region, block, random, 7);
            for _ in 0..10_000 {
                let o = offsets.next_offset();
                assert!(o >= region.start && o + block <= region.start + region.len);
                assert_eq!(o % block, 0);
            }
        }
    }

    #[test]
    fn sequential_offsets_cover_the_region_in_order_then_wrap() {
        let region = Region {
            start: 4 << 20,
            len: 3 << 20,
        };
        let mut offsets = Offsets::new(region, SEQ_BLOCK, false, 0);
        let seen: Vec<u64> = (0..7).map(|_| offsets.next_offset()).collect();
        let m = SEQ_BLOCK;
        assert_eq!(
            seen,
            [4 * m, 5 * m, 6 * m, 4 * m, 5 * m, 6 * m, 4 * m],
            "in order, then back to the start"
        );
    }

    #[test]
    fn random_offsets_reach_both_ends() {
        let region = Region {
            start: 1 << 20,
            len: 64 << 10,
        };
        let mut offsets = Offsets::new(region, RAND_BLOCK, true, 1);
        let seen: std::collections::HashSet<u64> =
            (0..2_000).map(|_| offsets.next_offset()).collect();
        assert_eq!(seen.len(), 16, "every 4 KiB slot of 64 KiB is drawn");
    }

    #[test]
    fn missing_fuse_device_is_a_clear_error() {
        let error = check_fuse(Path::new("/nonexistent/dev/fuse"))
            .expect_err("no such device")
            .to_string();
        assert!(error.contains("FUSE is not available"), "{error}");
        assert!(error.contains("/nonexistent/dev/fuse"), "{error}");
    }
}
