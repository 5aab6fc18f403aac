//! `citronfs bench meta`: metadata operations per second through a real mount, against tmpfs
//! in the same run.
//!
//! The run starts an embedded CitronFS cluster in this process (shm fabric by default), mounts
//! it through FUSE in a temporary directory, and runs four phases, mdtest-style, in one shared
//! directory per thread count, on that mount and on a directory under /dev/shm (tmpfs):
//! - `create`: `open(O_CREAT|O_EXCL|O_WRONLY)` + `close` of a new, empty file;
//! - `stat`: `stat` of each file by path;
//! - `open-close`: `open(O_RDONLY)` + `close` of each file;
//! - `unlink`: `unlink` of each file.
//!
//! With `--fs ...,library` the phases also run as the client library's own calls on the same
//! cluster (`CitronFs::create` + `release`, `lookup`, `lookup` + `open` + `release`, `unlink`),
//! without FUSE: a CitronFS row minus its library row is what FUSE and the kernel add.
//!
//! For CitronFS a fifth row, `rpc`, times `--files` calls per thread of the meta server's
//! cheapest request straight from the client library (`CitronFs::meta_round_trip`), with the
//! same threads: what the RPC transport alone costs, to tell it from FUSE and the handlers.
//!
//! Each of `n` threads handles its own `--files` names; a phase starts when every thread is
//! ready (a barrier) and ends when the last thread is done, so ops/s is the whole phase's
//! throughput. For CitronFS the meta server's request counter (`MetaHandle::request_count`,
//! heartbeats excepted) is read before and after each phase: `RPCs/op` shows which operations
//! still cost the meta server a request, and `server µs/op` how long its handlers ran for them
//! (`MetaHandle::request_nanos`; the rest of an operation's time is FUSE, the client and the
//! RPC transport), and `awake/op` how many of them the thread watching a connection after an
//! answer read and answered itself (`MetaHandle::awake_count`, machines of 4+ CPUs).
//!
//! The mount's attribute and entry TTL is `--attr-ttl-ms` (0 by default), so that every stat and
//! every path walk reaches CitronFS instead of the kernel's cache: the figures are the file
//! system's, not the dentry cache's. tmpfs has no such cache to bypass: its dentries are the
//! file system.
//!
//! With `--fs ...,null` the same phases run, with the same FUSE adapter and mount options (the
//! TTL included), over `fs_client::null::NullFs`, a backend that keeps names in memory and
//! answers at once: the ceiling of the FUSE path for metadata on this machine. CitronFS rows
//! then carry their ratio to it (`vs null`, throughput; `p50/null`, latency): what is left
//! to CitronFS's client, its RPC transport and its meta server.

use super::runner::{interrupted, Run};
use crate::bench::fs::{check_fuse, is_tmpfs, mount_null};
use crate::report::{fmt_f, fmt_opt, fmt_ratio, ratio, Report};
use anyhow::{Context, Result};
use clap::Args;
use cluster::{Cluster, ClusterSpec, Mount};
use fabric::Backend;
use hdrhistogram::Histogram;
use lockmgr::LockScheme;
use serde::Serialize;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// One phase of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Create (O_CREAT|O_EXCL) and close a new empty file.
    Create,
    /// stat(2) a file by path.
    Stat,
    /// Open an existing file read-only and close it.
    OpenClose,
    /// Unlink a file.
    Unlink,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Create => "create",
            Phase::Stat => "stat",
            Phase::OpenClose => "open-close",
            Phase::Unlink => "unlink",
        }
    }

    /// Runs the phase's operation on `path`.
    fn run(self, path: &Path) -> std::io::Result<()> {
        match self {
            Phase::Create => std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .open(path)
                .map(drop),
            Phase::Stat => std::fs::metadata(path).map(drop),
            Phase::OpenClose => std::fs::File::open(path).map(drop),
            Phase::Unlink => std::fs::remove_file(path),
        }
    }
}

/// Every phase, in the order they must run (each needs the files the one before left).
const PHASES: [Phase; 4] = [Phase::Create, Phase::Stat, Phase::OpenClose, Phase::Unlink];

/// What is measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MetaTarget {
    /// The CitronFS FUSE mount.
    Citronfs,
    /// A directory on tmpfs (the reference).
    Tmpfs,
    /// The same FUSE adapter and options over a backend that stores nothing and answers at
    /// once: the FUSE path's ceiling.
    Null,
    /// The client library's own calls (`CitronFs::create`, `lookup`, `open`, `release`,
    /// `unlink`) on the same cluster, without FUSE: the client, RPC and server share of each
    /// operation.
    Library,
}

/// Where a target's phases run.
#[derive(Clone, Copy)]
enum Subject<'a> {
    /// Paths in a directory made under this one (tmpfs, a FUSE mount).
    Dir(&'a Path),
    /// The client library's calls, in a directory made under the root.
    Library(&'a fs_client::CitronFs),
}

impl<'a> Subject<'a> {
    /// A fresh directory `name` for one thread count's phases.
    fn make_dir(self, name: &str) -> Result<PhaseDir<'a>> {
        Ok(match self {
            Subject::Dir(root) => {
                let dir = root.join(name);
                std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
                PhaseDir::Path(dir)
            }
            Subject::Library(client) => {
                let caller = fs_client::CitronFs::process_caller();
                let ino = client
                    .mkdir(caller, proto::ROOT_INO, name, 0o755)
                    .map_err(|e| anyhow::anyhow!("mkdir {name}: {e}"))?
                    .ino;
                PhaseDir::Library {
                    client,
                    ino,
                    name: name.to_owned(),
                }
            }
        })
    }
}

/// The directory one thread count's phases run in ([`Subject::make_dir`]).
enum PhaseDir<'a> {
    /// A path (tmpfs, a FUSE mount).
    Path(PathBuf),
    /// Directory `name` under the root, through the client library.
    Library {
        client: &'a fs_client::CitronFs,
        ino: proto::Ino,
        name: String,
    },
}

impl PhaseDir<'_> {
    /// Runs `phase` here ([`run_phase`] or [`run_library_phase`]).
    fn run(
        &self,
        phase: Phase,
        threads: usize,
        files: usize,
        stop: &AtomicBool,
    ) -> Result<Measured> {
        match self {
            PhaseDir::Path(dir) => run_phase(dir, phase, threads, files, stop),
            PhaseDir::Library { client, ino, .. } => {
                run_library_phase(client, *ino, phase, threads, files, stop)
            }
        }
    }

    /// Removes the directory (its files are gone after the unlink phase).
    fn remove(self) -> Result<()> {
        match self {
            PhaseDir::Path(dir) => {
                std::fs::remove_dir(&dir).with_context(|| format!("remove {}", dir.display()))
            }
            PhaseDir::Library { client, name, .. } => client
                .rmdir(proto::ROOT_INO, &name)
                .map_err(|e| anyhow::anyhow!("rmdir {name}: {e}")),
        }
    }
}

/// Options of `citronfs bench meta`.
#[derive(Args, Debug)]
pub struct MetaArgs {
    /// Thread counts to run (comma-separated); the threads of a run share one directory.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    threads: Vec<usize>,
    /// Files each thread creates, stats, opens and unlinks.
    #[arg(long, default_value_t = 2000)]
    files: usize,
    /// What to measure (comma-separated): citronfs (the FUSE mount), tmpfs, null (the same
    /// FUSE adapter over a backend that answers at once: the FUSE ceiling), library (the
    /// client library's calls without FUSE, on CitronFS's cluster).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "tmpfs,null,citronfs"
    )]
    fs: Vec<MetaTarget>,
    /// The fabric between the client and the servers.
    #[arg(long, value_enum, default_value = "shm")]
    fabric: Backend,
    /// Range-lock scheme of the mount (files are opened, so their lock state is created).
    #[arg(long, default_value = "citron")]
    scheme: LockScheme,
    /// How long the kernel may cache CitronFS attributes and entries, in milliseconds; 0 (the
    /// default) sends every stat and path lookup to CitronFS.
    #[arg(long, default_value_t = 0)]
    attr_ttl_ms: u64,
    /// Directory for the tmpfs runs [default: a fresh directory under /dev/shm].
    #[arg(long)]
    tmpfs_dir: Option<PathBuf>,
    /// Print one JSON object per result instead of a table.
    #[arg(long)]
    json: bool,
}

/// One result: a file system, a phase, a thread count.
#[derive(Clone, Debug, Serialize)]
struct MetaResult {
    /// `tmpfs`, `null` or `citronfs`.
    fs: &'static str,
    /// The fabric (`null` for tmpfs).
    fabric: Option<&'static str>,
    phase: &'static str,
    threads: usize,
    /// Operations of the phase, all threads together.
    ops: u64,
    seconds: f64,
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    /// `ops_per_s` over tmpfs's for the same phase and threads (when tmpfs ran).
    ratio_vs_tmpfs: Option<f64>,
    /// CitronFS: `ops_per_s` over the null FUSE backend's (when it ran).
    ratio_vs_null: Option<f64>,
    /// CitronFS: `p50_us` over the null FUSE backend's (when it ran).
    p50_vs_null: Option<f64>,
    /// CitronFS: meta-server requests per operation during the phase (heartbeats excepted).
    rpcs_per_op: Option<f64>,
    /// CitronFS: microseconds the meta server spent handling those requests, per operation
    /// (`MetaHandle::request_nanos`: handler start to answer, state-lock waits included, the
    /// RPC transport not). Handlers of concurrent requests overlap, so with several threads
    /// this can exceed the phase's time per operation.
    server_us_per_op: Option<f64>,
    /// CitronFS: of `rpcs_per_op`, the requests per operation that the thread watching the
    /// connection after an answer read and answered itself (`MetaHandle::awake_count`; none
    /// on machines of fewer than 4 CPUs, where the meta server does not watch).
    awake_per_op: Option<f64>,
}

/// Runs `citronfs bench meta`.
pub fn run(args: &MetaArgs) -> Result<()> {
    anyhow::ensure!(
        !args.threads.is_empty() && args.threads.iter().all(|&t| t >= 1),
        "--threads needs thread counts of at least 1"
    );
    anyhow::ensure!(args.files >= 1, "--files must be at least 1");
    anyhow::ensure!(!args.fs.is_empty(), "--fs is empty");
    if args.fs.contains(&MetaTarget::Citronfs) || args.fs.contains(&MetaTarget::Null) {
        check_fuse(Path::new("/dev/fuse"))?;
    }
    // Ctrl-C and SIGTERM end the run between phases, so that the mount is unmounted and the
    // servers stopped; a second signal exits at once.
    // Four phases per thread count and file system, and CitronFS's `rpc` row.
    let rows = args.threads.len()
        * (args.fs.len() * PHASES.len() + usize::from(args.fs.contains(&MetaTarget::Citronfs)));
    let runner = Run::start(args.json, rows as u64)?;
    let mut report = Report::new(
        args.json,
        &[
            "fs",
            "phase",
            "threads",
            "ops/s",
            "p50 µs",
            "p99 µs",
            "vs tmpfs",
            "vs null",
            "p50/null",
            "RPCs/op",
            "server µs/op",
            "awake/op",
        ],
    );
    // Rows of the references, to compare the later ones with.
    let mut tmpfs_results: Vec<MetaResult> = Vec::new();
    let mut null_results: Vec<MetaResult> = Vec::new();
    let mut emit = |mut r: MetaResult, tmpfs: &[MetaResult], null: &[MetaResult]| {
        let same = |t: &&MetaResult| t.phase == r.phase && t.threads == r.threads;
        r.ratio_vs_tmpfs = ratio(r.ops_per_s, tmpfs.iter().find(same).map(|t| t.ops_per_s));
        if r.fs == "citronfs" {
            let null = null.iter().find(same);
            r.ratio_vs_null = ratio(r.ops_per_s, null.map(|t| t.ops_per_s));
            r.p50_vs_null = ratio(r.p50_us, null.map(|t| t.p50_us));
        }
        report.add(
            vec![
                r.fs.to_string(),
                r.phase.to_string(),
                r.threads.to_string(),
                format!("{:.0}", r.ops_per_s),
                fmt_f(r.p50_us, 1),
                fmt_f(r.p99_us, 1),
                fmt_ratio(r.ratio_vs_tmpfs),
                fmt_ratio(r.ratio_vs_null),
                fmt_ratio(r.p50_vs_null),
                fmt_opt(r.rpcs_per_op, 2),
                fmt_opt(r.server_us_per_op, 1),
                fmt_opt(r.awake_per_op, 2),
            ],
            &r,
        );
        r
    };

    let mut tmpfs_note = None;
    if args.fs.contains(&MetaTarget::Tmpfs) {
        let (dir, _temp) = match &args.tmpfs_dir {
            Some(dir) => (dir.clone(), None),
            None => {
                let temp = tempfile::Builder::new()
                    .prefix("citronfs-bench-meta-")
                    .tempdir_in("/dev/shm")
                    .context("create a directory under /dev/shm (give --tmpfs-dir)")?;
                (temp.path().to_path_buf(), Some(temp))
            }
        };
        if !is_tmpfs(&dir) {
            tmpfs_note = Some(format!(
                "{} is NOT on tmpfs: the `tmpfs` rows measure whatever file system it is on",
                dir.display()
            ));
        }
        for r in run_target(args, &Target::plain("tmpfs", &dir), &runner)? {
            tmpfs_results.push(emit(r, &[], &[]));
        }
    }
    let options = fs_client::fuse::FuseOptions {
        attr_ttl: Duration::from_millis(args.attr_ttl_ms),
        ..Default::default()
    };
    if args.fs.contains(&MetaTarget::Null) {
        runner.say("mounting the null backend");
        let (handle, dir) = mount_null(&options)?;
        let results = run_target(args, &Target::plain("null", dir.path()), &runner);
        handle
            .unmount()
            .with_context(|| format!("unmount {}", dir.path().display()))?;
        for r in results? {
            null_results.push(emit(r, &tmpfs_results, &[]));
        }
    }
    let citronfs = args.fs.contains(&MetaTarget::Citronfs);
    let library = args.fs.contains(&MetaTarget::Library);
    // How CitronFS's client reached the meta server (`proto::stream`).
    let mut transport = None;
    if citronfs || library {
        runner.say("starting the cluster");
        let cluster = Cluster::start(ClusterSpec {
            name: "citronfs-bench-meta".into(),
            fabric: args.fabric,
            lock_server: args.scheme.uses_service(),
            ..ClusterSpec::server_defaults()
        })?;
        let fs = Arc::new(cluster.connect(args.scheme)?);
        transport = Some(if fs.meta_is_local() {
            "the meta server's local Unix socket"
        } else {
            "tcp"
        });
        // Rows of the mount, then of the library; a failure stops the run after the mount is
        // unmounted and the cluster stopped.
        let mut rows = Vec::new();
        let mut measured = Ok(());
        if citronfs {
            let mount = Mount::in_temp_dir(fs.clone(), &options)?;
            let target = Target {
                name: "citronfs",
                fabric: Some(args.fabric.name()),
                subject: Subject::Dir(mount.path()),
                cluster: Some(&cluster),
                rpc: Some(&fs),
            };
            measured = run_target(args, &target, &runner).map(|r| rows.extend(r));
            let mountpoint = mount.path().to_path_buf();
            mount
                .unmount()
                .with_context(|| format!("unmount {}", mountpoint.display()))?;
        }
        if library && measured.is_ok() {
            let target = Target {
                name: "library",
                fabric: Some(args.fabric.name()),
                subject: Subject::Library(&fs),
                cluster: Some(&cluster),
                rpc: None,
            };
            measured = run_target(args, &target, &runner).map(|r| rows.extend(r));
        }
        drop(fs);
        runner.say("stopping the cluster");
        cluster.shutdown()?;
        measured?;
        for r in rows {
            emit(r, &tmpfs_results, &null_results);
        }
    }
    runner.finish();
    report.finish();
    if !args.json {
        println!();
        println!(
            "{} files per thread, all threads of a run in one directory; ops/s is the phase's \
             throughput (all threads), latency is per call. CitronFS: FUSE mount with attribute/\
             entry TTL {} ms over the {} fabric; RPCs/op: meta-server requests per operation \
             (heartbeats excepted); server µs/op: time in the meta server's handlers per \
             operation (the rest is FUSE, the client and the RPC transport); awake/op: of those \
             requests, the ones the thread watching a connection after an answer read and \
             answered itself, without waking an async worker (machines of 4+ CPUs). null: the same \
             FUSE adapter and options over a backend that answers at once, the FUSE path's \
             ceiling; vs null: ops/s over null's; p50/null: p50 latency over null's. rpc: the \
             meta server's cheapest request (cluster settings) from the client library, no \
             FUSE: the RPC transport's round trip. library: the same phases as client library \
             calls on the same cluster, no FUSE (stat is a lookup; open+close a lookup, an \
             open and a release).",
            args.files,
            args.attr_ttl_ms,
            args.fabric.name()
        );
        if let Some(transport) = transport {
            println!("CitronFS's client made its RPCs over {transport}.");
        }
        if let Some(note) = tmpfs_note {
            println!("warning: {note}");
        }
    }
    Ok(())
}

/// One file system a run measures.
struct Target<'a> {
    /// Its name in the rows.
    name: &'static str,
    /// The fabric of CitronFS's cluster (None for the others).
    fabric: Option<&'static str>,
    subject: Subject<'a>,
    /// The cluster whose meta-server counters each row reads.
    cluster: Option<&'a Cluster>,
    /// The client whose `rpc` row follows each thread count's phases.
    rpc: Option<&'a fs_client::CitronFs>,
}

impl<'a> Target<'a> {
    /// A directory of a file system that is not CitronFS.
    fn plain(name: &'static str, dir: &'a Path) -> Self {
        Self {
            name,
            fabric: None,
            subject: Subject::Dir(dir),
            cluster: None,
            rpc: None,
        }
    }
}

/// Runs every thread count's four phases in a fresh directory of `target`; with `target.rpc`,
/// then the `rpc` row: `--files` meta-server round trips per thread straight from the client
/// library (`CitronFs::meta_round_trip`), the RPC transport's share of an operation.
fn run_target(args: &MetaArgs, target: &Target<'_>, runner: &Run) -> Result<Vec<MetaResult>> {
    let stop = runner.stop();
    let Target {
        name: fs,
        fabric,
        subject,
        cluster,
        rpc: client,
    } = *target;
    // Measures one row, with the meta server's requests, handler time and requests answered
    // awake during it.
    let counters = |c: &Cluster| {
        let meta = c.meta();
        [
            meta.request_count(),
            meta.request_nanos(),
            meta.awake_count(),
        ]
    };
    let row = |phase: &'static str, threads: usize, run: &dyn Fn() -> Result<Measured>| {
        let before = cluster.map(counters);
        let m = run().with_context(|| format!("{fs} {phase} with {threads} threads"))?;
        let after = cluster.map(counters);
        let per_op = |i: usize| {
            before
                .zip(after)
                .map(|(b, a)| a[i].saturating_sub(b[i]) as f64 / m.ops.max(1) as f64)
        };
        let rpcs = per_op(0);
        let server_us = per_op(1).map(|ns| ns / 1000.0);
        let awake = per_op(2);
        interrupted(stop)?;
        let us = |q: f64| m.histogram.value_at_quantile(q) as f64 / 1000.0;
        runner.advance();
        Ok::<_, anyhow::Error>(MetaResult {
            fs,
            fabric,
            phase,
            threads,
            ops: m.ops,
            seconds: m.seconds,
            ops_per_s: m.ops as f64 / m.seconds,
            p50_us: us(0.5),
            p99_us: us(0.99),
            max_us: m.histogram.max() as f64 / 1000.0,
            ratio_vs_tmpfs: None,
            ratio_vs_null: None,
            p50_vs_null: None,
            rpcs_per_op: rpcs,
            server_us_per_op: server_us,
            awake_per_op: awake,
        })
    };
    let mut results = Vec::new();
    for &threads in &args.threads {
        let dir = subject.make_dir(&format!("bench-meta-{}-{threads}", std::process::id()))?;
        for phase in PHASES {
            runner.say(format!("{fs}: {}, {threads} threads", phase.name()));
            results.push(row(phase.name(), threads, &|| {
                dir.run(phase, threads, args.files, stop)
            })?);
        }
        dir.remove()?;
        if let Some(client) = client {
            runner.say(format!("{fs}: rpc, {threads} threads"));
            results.push(row(RPC_ROW, threads, &|| {
                run_threads(
                    threads,
                    stop,
                    |_| vec![(); args.files],
                    |()| {
                        client
                            .meta_round_trip()
                            .map_err(|e| anyhow::anyhow!("meta round trip: {e}"))
                    },
                )
            })?);
        }
    }
    Ok(results)
}

/// The `phase` of the row that measures the RPC transport alone.
const RPC_ROW: &str = "rpc";

/// What one phase measured.
struct Measured {
    ops: u64,
    seconds: f64,
    histogram: Histogram<u64>,
}

/// The name of thread `t`'s file `i`.
fn file_name(dir: &Path, t: usize, i: usize) -> PathBuf {
    dir.join(format!("f{t}.{i}"))
}

/// Runs `phase` on `files` names per thread with `threads` threads; the clock runs from the
/// barrier every thread passed to the end of the last thread.
fn run_phase(
    dir: &Path,
    phase: Phase,
    threads: usize,
    files: usize,
    stop: &AtomicBool,
) -> Result<Measured> {
    run_threads(
        threads,
        stop,
        |t| (0..files).map(|i| file_name(dir, t, i)).collect(),
        |path: &PathBuf| {
            phase
                .run(path)
                .with_context(|| format!("{} {}", phase.name(), path.display()))
        },
    )
}

/// Runs `phase` through the client library in directory `dir`, as [`run_phase`] does through
/// paths: create is `create(O_EXCL)` + `release`, stat a `lookup` (what the kernel's path walk
/// asks), open+close `lookup` + `open` + `release`, unlink `unlink`.
fn run_library_phase(
    client: &fs_client::CitronFs,
    dir: proto::Ino,
    phase: Phase,
    threads: usize,
    files: usize,
    stop: &AtomicBool,
) -> Result<Measured> {
    let caller = fs_client::CitronFs::process_caller();
    run_threads(
        threads,
        stop,
        |t| (0..files).map(|i| format!("f{t}.{i}")).collect(),
        |name: &String| {
            let done = match phase {
                Phase::Create => client
                    .create(caller, dir, name, 0o644, libc::O_WRONLY | libc::O_EXCL)
                    .and_then(|(_, fh)| client.release(fh)),
                Phase::Stat => client.lookup(dir, name).map(drop),
                Phase::OpenClose => client
                    .lookup(dir, name)
                    .and_then(|attr| client.open(caller, attr.ino, libc::O_RDONLY))
                    .and_then(|fh| client.release(fh)),
                Phase::Unlink => client.unlink(dir, name),
            };
            done.map_err(|e| anyhow::anyhow!("{} {name}: {e}", phase.name()))
        },
    )
}

/// Runs `op` on each of thread `t`'s items (`items(t)`, made before the clock starts) with
/// `threads` threads, timing each call; the clock runs from the barrier every thread passed
/// to the end of the last thread.
fn run_threads<T>(
    threads: usize,
    stop: &AtomicBool,
    items: impl Fn(usize) -> Vec<T> + Sync,
    op: impl Fn(&T) -> Result<()> + Sync,
) -> Result<Measured> {
    let barrier = Barrier::new(threads + 1);
    let (start, outcomes) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, items, op) = (&barrier, &items, &op);
                s.spawn(move || -> Result<Histogram<u64>> {
                    let mut histogram = new_histogram();
                    let mine = items(t);
                    barrier.wait();
                    for item in &mine {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let begin = Instant::now();
                        op(item)?;
                        histogram.saturating_record(begin.elapsed().as_nanos() as u64);
                    }
                    Ok(histogram)
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let outcomes: Vec<_> = workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a benchmark thread panicked")))
            })
            .collect();
        (start, outcomes)
    });
    let seconds = start.elapsed().as_secs_f64();
    let mut histogram = new_histogram();
    for outcome in outcomes {
        histogram
            .add(outcome?)
            .context("merge latency histograms")?;
    }
    Ok(Measured {
        ops: histogram.len(),
        seconds,
        histogram,
    })
}

/// Nanoseconds from 1 ns to 60 s, 3 significant digits.
fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_run_on_a_plain_directory_and_leave_it_empty() {
        let dir = tempfile::tempdir().unwrap();
        let stop = AtomicBool::new(false);
        for phase in PHASES {
            let m = run_phase(dir.path(), phase, 2, 5, &stop).unwrap();
            assert_eq!(m.ops, 10, "{phase:?}");
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_failing_operation_fails_the_phase_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let stop = AtomicBool::new(false);
        // Nothing to stat yet.
        let Err(err) = run_phase(dir.path(), Phase::Stat, 1, 1, &stop) else {
            panic!("a stat of a missing file succeeded");
        };
        assert!(format!("{err:#}").contains("f0.0"), "{err:#}");
    }
}
