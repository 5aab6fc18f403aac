//! `citronfs bench compare`: CitronFS against the file systems a user would mount instead, in
//! one run, driven by fio with the same job files (kept in `bench/fio/`), plus a metadata pass.
//!
//! The file systems: CitronFS on the shm and on the tcp fabric (an embedded cluster each, FUSE
//! mounted in this process), tmpfs (a directory under /dev/shm), a one-brick GlusterFS volume and
//! a MooseFS cluster (a master and one chunkserver). `--replicas N` keeps N copies of the data
//! on each distributed file system alike: CitronFS's cluster gets `replicas: N` (and max(2, N)
//! data servers), GlusterFS a `replica N` volume of N bricks, MooseFS N chunkservers and goal N
//! (the scripts read the count from `CFSB_REPLICAS`). The peers are set up by the scripts in
//! `bench/peers/` from Debian's packages, their servers inside a network namespace of their own
//! (reached over a veth pair; the MooseFS chunkserver refuses a loopback master), their data
//! under `--work-dir` (tmpfs by default, so that every file system keeps its data in memory), and
//! torn down afterwards — also when a job fails or the run is interrupted.
//!
//! Every job uses `direct=1` (no client page cache: CitronFS is mounted with direct I/O anyway,
//! and the peers' FUSE clients would otherwise serve reads and absorb writes in the local page
//! cache) except on tmpfs, which has no O_DIRECT and whose page cache is its storage.

use super::runner::Run;
use crate::report::{fmt_f, fmt_opt, Report};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use cluster::{Cluster, ClusterSpec, Mount};
use fabric::Backend;
use lockmgr::LockScheme;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The fio job files, compiled in so that the binary runs anywhere (the repository keeps them in
/// `bench/fio/`, where a user can run them by hand with the same `CFSB_*` variables).
const JOBS: &[(Job, &str)] = &[
    (
        Job::Io500Hard,
        include_str!("../../../../bench/fio/io500-hard.fio"),
    ),
    (Job::Btio, include_str!("../../../../bench/fio/btio.fio")),
    (Job::Oltp, include_str!("../../../../bench/fio/oltp.fio")),
    (
        Job::SeqWrite,
        include_str!("../../../../bench/fio/seq-write.fio"),
    ),
    (
        Job::SeqRead,
        include_str!("../../../../bench/fio/seq-read.fio"),
    ),
];

/// The peers' set-up scripts (`bench/peers/`), compiled in for the same reason.
const PEER_SCRIPTS: &[(&str, &str)] = &[
    ("netns.sh", include_str!("../../../../bench/peers/netns.sh")),
    (
        "glusterfs.sh",
        include_str!("../../../../bench/peers/glusterfs.sh"),
    ),
    (
        "moosefs.sh",
        include_str!("../../../../bench/peers/moosefs.sh"),
    ),
];

/// A file system to compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fs {
    /// CitronFS, embedded cluster on the shm fabric.
    CitronfsShm,
    /// CitronFS, embedded cluster on the tcp fabric (loopback).
    CitronfsTcp,
    /// A directory under /dev/shm.
    Tmpfs,
    /// A one-brick GlusterFS volume (glusterfs-server; --replicas N: a replica volume of N
    /// bricks), mounted with mount.glusterfs.
    Glusterfs,
    /// A MooseFS master and chunkserver (moosefs-master, moosefs-chunkserver; --replicas N: N
    /// chunkservers, goal N), mounted with mfsmount.
    Moosefs,
}

impl Fs {
    fn name(self) -> &'static str {
        match self {
            Fs::CitronfsShm => "citronfs-shm",
            Fs::CitronfsTcp => "citronfs-tcp",
            Fs::Tmpfs => "tmpfs",
            Fs::Glusterfs => "glusterfs",
            Fs::Moosefs => "moosefs",
        }
    }
}

/// A fio job of `bench/fio/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Job {
    /// IO500 ior-hard write: 47008 B records into one shared file, interleaved by rank.
    Io500Hard,
    /// BT-IO-like: 8160 B non-conflicting interleaved records into one shared file.
    Btio,
    /// OLTP-like: 8 KiB random reads and writes (91% reads) over one shared 64 MiB file.
    Oltp,
    /// 1 MiB sequential writes, one process.
    SeqWrite,
    /// 1 MiB sequential reads, one process.
    SeqRead,
}

impl Job {
    fn name(self) -> &'static str {
        match self {
            Job::Io500Hard => "io500-hard",
            Job::Btio => "btio",
            Job::Oltp => "oltp",
            Job::SeqWrite => "seq-write",
            Job::SeqRead => "seq-read",
        }
    }
}

/// Options of `citronfs bench compare`.
#[derive(Args, Debug)]
pub struct CompareArgs {
    /// File systems to compare, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "citronfs-shm,citronfs-tcp,tmpfs,glusterfs,moosefs"
    )]
    fs: Vec<Fs>,
    /// fio jobs to run, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "io500-hard,btio,oltp,seq-write,seq-read"
    )]
    jobs: Vec<Job>,
    /// Seconds each fio job measures (after a ramp of a tenth of it, at most 2 s).
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Processes (fio jobs, the ranks) of the shared-file jobs: io500-hard, btio, oltp.
    #[arg(long, default_value_t = 4)]
    procs: u32,
    /// Files of the metadata pass (create, stat, unlink, one thread, one directory); 0 skips it.
    #[arg(long, default_value_t = 10_000)]
    files: u32,
    /// The range-lock scheme of the CitronFS mounts.
    #[arg(long, default_value = "citron", value_parser = clap::value_parser!(LockScheme))]
    scheme: LockScheme,
    /// Where the peers keep their servers' data and logs (a fresh directory is made inside);
    /// tmpfs by default, so that every file system compared keeps its data in memory.
    #[arg(long, default_value = "/dev/shm")]
    work_dir: PathBuf,
    /// Copies of every file's data on each distributed file system: CitronFS's replicas (on
    /// max(2, N) data servers), a GlusterFS `replica N` volume of N bricks, N MooseFS
    /// chunkservers with goal N. tmpfs keeps one.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_REPLICAS))]
    replicas: u32,
    /// Also draw the results into this SVG file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Run nothing: draw --plot from the results of an earlier run, its `--json` output saved in
    /// this file (one object a line with at least `job`, `fs` and `value`).
    #[arg(long, requires = "plot")]
    from: Option<PathBuf>,
    /// One JSON object per result instead of the table.
    #[arg(long)]
    json: bool,
}

/// The most replicas `--replicas` takes (each is a server process of every peer).
const MAX_REPLICAS: i64 = 8;

/// One measured result.
#[derive(Debug, Serialize)]
struct Row {
    job: &'static str,
    fs: &'static str,
    /// Copies of the data the file system kept (`None` on tmpfs, which is not distributed).
    replicas: Option<u32>,
    /// MiB/s for fio jobs (reads and writes together), operations per second for the metadata
    /// pass.
    value: f64,
    unit: &'static str,
    /// Operations per second (fio: IOPS).
    ops_per_s: f64,
    /// 99th percentile completion latency in µs (fio jobs; the larger of read and write).
    p99_us: Option<f64>,
    /// citronfs-shm's value divided by this one (same job), when both ran.
    shm_ratio: Option<f64>,
    /// citronfs-tcp's value divided by this one.
    tcp_ratio: Option<f64>,
}

/// Runs the comparison.
pub fn run(args: &CompareArgs) -> Result<()> {
    if let (Some(from), Some(path)) = (&args.from, &args.plot) {
        return plot(path, &read_results(from)?);
    }
    anyhow::ensure!(!args.fs.is_empty(), "--fs is empty");
    anyhow::ensure!(args.duration >= 1, "--duration must be at least 1 s");
    anyhow::ensure!(args.procs >= 1, "--procs must be at least 1");
    let fio_version = Command::new("fio").arg("--version").output();
    match fio_version {
        Ok(out) if out.status.success() => {}
        _ => bail!("fio not found: `apt-get install fio` (bench compare drives every file system with fio)"),
    }
    let needs_peers = args
        .fs
        .iter()
        .any(|f| matches!(f, Fs::Glusterfs | Fs::Moosefs));
    if needs_peers {
        // SAFETY: geteuid has no preconditions and touches no memory of ours.
        let euid = unsafe { libc::geteuid() };
        anyhow::ensure!(
            euid == 0,
            "GlusterFS and MooseFS are set up as root (network namespaces, mounts): run as root or \
             leave them out with --fs"
        );
    }

    let work = tempfile::Builder::new()
        .prefix("citronfs-compare-")
        .tempdir_in(&args.work_dir)
        .with_context(|| format!("make a directory in {}", args.work_dir.display()))?;
    let scripts = work.path().join("scripts");
    std::fs::create_dir_all(&scripts)?;
    for (name, text) in PEER_SCRIPTS {
        std::fs::write(scripts.join(name), text)?;
    }

    let steps = args.fs.len() as u64 * (args.jobs.len() as u64 + u64::from(args.files > 0));
    // A signal ends the run between jobs; the target's guard tears it down on the way out.
    let run = Run::start(args.json, steps)?;
    let mut rows: Vec<Row> = Vec::new();
    for &fs in &args.fs {
        run.check()?;
        run.say(format!("{}: setting up", fs.name()));
        let target = Target::up(fs, args, work.path(), &scripts)
            .with_context(|| format!("set up {}", fs.name()))?;
        for &job in &args.jobs {
            run.check()?;
            run.say(format!("{}: {}", fs.name(), job.name()));
            let row = run_fio(job, fs, &target, args, work.path())
                .with_context(|| format!("{} on {}", job.name(), fs.name()))?;
            rows.push(row);
            run.advance();
        }
        if args.files > 0 {
            run.check()?;
            run.say(format!("{}: metadata", fs.name()));
            rows.extend(
                metadata_pass(fs, replicas_of(fs, args), &target.dir, args.files)
                    .with_context(|| format!("metadata pass on {}", fs.name()))?,
            );
            run.advance();
        }
        run.say(format!("{}: tearing down", fs.name()));
        target
            .down()
            .with_context(|| format!("tear down {}", fs.name()))?;
    }
    run.finish();

    fill_ratios(&mut rows);
    if let Some(path) = &args.plot {
        let results: Vec<(String, String, f64)> = rows
            .iter()
            .map(|r| (r.job.to_string(), r.fs.to_string(), r.value))
            .collect();
        plot(path, &results)?;
    }
    let mut report = Report::new(
        args.json,
        &[
            "job",
            "fs",
            "replicas",
            "value",
            "unit",
            "ops/s",
            "p99 µs",
            "shm ÷ this",
            "tcp ÷ this",
        ],
    );
    for r in &rows {
        let ratio = |x: Option<f64>| fmt_opt(x, 2);
        report.add(
            vec![
                r.job.to_string(),
                r.fs.to_string(),
                r.replicas.map_or_else(|| "-".into(), |n| n.to_string()),
                fmt_f(r.value, 1),
                r.unit.to_string(),
                format!("{:.0}", r.ops_per_s),
                fmt_opt(r.p99_us, 0),
                ratio(r.shm_ratio),
                ratio(r.tcp_ratio),
            ],
            r,
        );
    }
    report.finish();
    if !args.json {
        print_notes(args, &rows);
    }
    Ok(())
}

/// The distributed peers, which CitronFS is measured against.
const PEERS: [Fs; 2] = [Fs::Glusterfs, Fs::Moosefs];

/// (job, file system, value) of an earlier run's `--json` output.
fn read_results(path: &Path) -> Result<Vec<(String, String, f64)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), n + 1))?;
        let field = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
        match (
            field("job"),
            field("fs"),
            v.get("value").and_then(|x| x.as_f64()),
        ) {
            (Some(job), Some(fs), Some(value)) => out.push((job, fs, value)),
            _ => bail!(
                "{}:{}: expected an object with job, fs and value",
                path.display(),
                n + 1
            ),
        }
    }
    anyhow::ensure!(!out.is_empty(), "{}: no results", path.display());
    Ok(out)
}

/// What the plot shows: each job (in the order of the results) with every file system's value
/// over the reference's in that job, the file systems in the order of the results. The
/// reference is the best distributed peer (GlusterFS, MooseFS) of each job; without peers,
/// tmpfs; without either, the best of all. Returns the reference's name too.
#[allow(clippy::type_complexity)]
fn ratios(
    results: &[(String, String, f64)],
) -> (String, Vec<String>, Vec<(String, Vec<Option<f64>>)>) {
    let mut jobs: Vec<&str> = Vec::new();
    let mut fss: Vec<&str> = Vec::new();
    for (job, fs, _) in results {
        if !jobs.contains(&job.as_str()) {
            jobs.push(job);
        }
        if !fss.contains(&fs.as_str()) {
            fss.push(fs);
        }
    }
    let peers: Vec<&str> = PEERS.iter().map(|f| f.name()).collect();
    let (reference, among): (String, Vec<&str>) = if fss.iter().any(|f| peers.contains(f)) {
        ("the better of GlusterFS and MooseFS".into(), peers)
    } else if fss.contains(&Fs::Tmpfs.name()) {
        ("tmpfs".into(), vec![Fs::Tmpfs.name()])
    } else {
        ("the best".into(), fss.clone())
    };
    let value = |job: &str, fs: &str| {
        results
            .iter()
            .find(|(j, f, _)| j == job && f == fs)
            .map(|r| r.2)
    };
    let groups = jobs
        .iter()
        .map(|&job| {
            let best = among
                .iter()
                .filter_map(|fs| value(job, fs))
                .fold(0f64, f64::max);
            let values = fss
                .iter()
                .map(|fs| value(job, fs).filter(|_| best > 0.0).map(|v| v / best))
                .collect();
            (job.to_string(), values)
        })
        .collect();
    (
        reference,
        fss.iter().map(|f| f.to_string()).collect(),
        groups,
    )
}

/// Draws the comparison: every file system over the best distributed peer, per job, on a log
/// scale where the ratios span orders of magnitude (tmpfs is tens to hundreds of times any
/// distributed file system on metadata).
fn plot(path: &Path, results: &[(String, String, f64)]) -> Result<()> {
    let (reference, series, groups) = ratios(results);
    crate::plot::bars(
        path,
        &crate::plot::Bars {
            title: &format!(
                "bench compare: each file system ÷ {reference}, per job (above 1×: faster)"
            ),
            y_desc: "ratio of MiB/s (create, stat, unlink: of ops/s)",
            unit: crate::plot::Unit::Ratio,
            series: &series,
            groups: &groups,
            base: Some(1.0),
        },
    )
}

/// Sets every row's ratios: CitronFS's value (per fabric) over this row's, same job.
fn fill_ratios(rows: &mut [Row]) {
    let value_of = |rows: &[Row], job: &str, fs: &str| {
        rows.iter()
            .find(|r| r.job == job && r.fs == fs)
            .map(|r| r.value)
    };
    let ratios: Vec<(Option<f64>, Option<f64>)> = rows
        .iter()
        .map(|r| {
            let over = |fs: &str| {
                value_of(rows, r.job, fs)
                    .filter(|_| r.value > 0.0)
                    .map(|v| v / r.value)
            };
            (over(Fs::CitronfsShm.name()), over(Fs::CitronfsTcp.name()))
        })
        .collect();
    for (r, (shm, tcp)) in rows.iter_mut().zip(ratios) {
        r.shm_ratio = shm;
        r.tcp_ratio = tcp;
    }
}

/// A file system set up for the run: where to work, and what to tear down.
struct Target {
    /// The directory the jobs work in (on the file system compared).
    dir: PathBuf,
    /// `direct=` for fio: 0 only on tmpfs.
    direct: bool,
    /// What to tear down; `None` once torn down. A peer still here when the target is dropped
    /// (an error, a panic, Ctrl-C between steps) is torn down then.
    kind: Option<TargetKind>,
}

enum TargetKind {
    Citronfs { mount: Mount, cluster: Box<Cluster> },
    Tmpfs(tempfile::TempDir),
    Peer(Peer),
}

/// A peer file system set up by its script.
struct Peer {
    script: PathBuf,
    state: PathBuf,
    mountpoint: PathBuf,
    /// Copies of the data (bricks of the GlusterFS volume; MooseFS chunkservers and goal),
    /// passed to the script as `CFSB_REPLICAS`.
    replicas: u32,
}

impl Peer {
    /// Runs the script with `action` (`up` or `down`).
    fn script(&self, action: &str) -> Result<()> {
        let out = Command::new("bash")
            .arg(&self.script)
            .arg(action)
            .arg(&self.state)
            .arg(&self.mountpoint)
            .env("CFSB_REPLICAS", self.replicas.to_string())
            .output()
            .with_context(|| format!("run {}", self.script.display()))?;
        if !out.status.success() {
            bail!(
                "{} {action} failed ({}): {}",
                self.script.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

/// The embedded CitronFS cluster of a run on `fabric`: `--replicas` copies of every chunk on
/// max(2, replicas) data servers.
fn cluster_spec(fabric: Backend, args: &CompareArgs) -> ClusterSpec {
    let replicas = args.replicas as usize;
    // Room for the largest job's files (each job's files are removed after it), per replica.
    ClusterSpec {
        name: "citronfs-compare".into(),
        data_servers: replicas.max(2),
        capacity: 1 << 30,
        fabric,
        lock_server: args.scheme.uses_service(),
        scheme: args.scheme,
        replicas,
        ..ClusterSpec::server_defaults()
    }
}

/// The replica count a row of `fs` reports: `--replicas` on the distributed file systems, none
/// on tmpfs.
fn replicas_of(fs: Fs, args: &CompareArgs) -> Option<u32> {
    (fs != Fs::Tmpfs).then_some(args.replicas)
}

impl Target {
    fn up(fs: Fs, args: &CompareArgs, work: &Path, scripts: &Path) -> Result<Target> {
        match fs {
            Fs::CitronfsShm | Fs::CitronfsTcp => {
                fs_client::fuse::check_mountable(Path::new("/dev/fuse"))
                    .map_err(|why| anyhow::anyhow!("FUSE is not available here: {why}"))?;
                let fabric = if fs == Fs::CitronfsShm {
                    Backend::Shm
                } else {
                    Backend::Tcp
                };
                let cluster = Cluster::start(cluster_spec(fabric, args))?;
                let client = Arc::new(cluster.connect(args.scheme)?);
                let mount = Mount::in_temp_dir(client, &fs_client::fuse::FuseOptions::default())?;
                Ok(Target {
                    dir: mount.path().to_path_buf(),
                    direct: true,
                    kind: Some(TargetKind::Citronfs {
                        mount,
                        cluster: Box::new(cluster),
                    }),
                })
            }
            Fs::Tmpfs => {
                let dir = tempfile::Builder::new()
                    .prefix("citronfs-compare-tmpfs-")
                    .tempdir_in("/dev/shm")
                    .context("make a directory under /dev/shm")?;
                Ok(Target {
                    dir: dir.path().to_path_buf(),
                    direct: false,
                    kind: Some(TargetKind::Tmpfs(dir)),
                })
            }
            Fs::Glusterfs | Fs::Moosefs => {
                let peer = Peer {
                    script: scripts.join(format!("{}.sh", fs.name())),
                    state: work.join(fs.name()),
                    mountpoint: work.join(format!("{}-mnt", fs.name())),
                    replicas: args.replicas,
                };
                std::fs::create_dir_all(&peer.state)?;
                let dir = peer.mountpoint.clone();
                // The script cleans up after a failed `up` itself.
                peer.script("up")?;
                Ok(Target {
                    dir,
                    direct: true,
                    kind: Some(TargetKind::Peer(peer)),
                })
            }
        }
    }

    /// Unmounts and stops everything this target started.
    fn down(mut self) -> Result<()> {
        match self.kind.take() {
            Some(TargetKind::Citronfs { mount, cluster }) => {
                let path = mount.path().to_path_buf();
                mount
                    .unmount()
                    .with_context(|| format!("unmount {}", path.display()))?;
                cluster.shutdown()?;
            }
            Some(TargetKind::Tmpfs(dir)) => dir.close()?,
            Some(TargetKind::Peer(peer)) => peer.script("down")?,
            None => {}
        }
        Ok(())
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(TargetKind::Peer(peer)) = &self.kind {
            if let Err(e) = peer.script("down") {
                eprintln!("warning: tearing the peer down failed: {e:#}");
            }
        }
    }
}

/// Runs one fio job on `target` and returns its result.
fn run_fio(job: Job, fs: Fs, target: &Target, args: &CompareArgs, work: &Path) -> Result<Row> {
    let text = JOBS
        .iter()
        .find(|(j, _)| *j == job)
        .map(|(_, t)| *t)
        .expect("every job has a file");
    let dir = target.dir.join(format!("fio-{}", job.name()));
    std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
    let job_file = work.join(format!("{}.fio", job.name()));
    std::fs::write(&job_file, text)?;
    let ramp = (args.duration / 10).clamp(0, 2);
    let procs = u64::from(args.procs);
    // Interleaved records: rank r writes records r, r+P, r+2P, ... (a hole of P-1 records
    // after each of its own), over 256 MiB of file.
    let span = 256u64 << 20;
    let mut fio = Command::new("fio");
    // Stopped if this benchmark dies (it runs from the main thread).
    cluster::die_with_parent(&mut fio);
    let out = fio
        .arg("--output-format=json")
        .arg(&job_file)
        .env("CFSB_DIR", &dir)
        .env("CFSB_DIRECT", if target.direct { "1" } else { "0" })
        .env("CFSB_RUNTIME", args.duration.to_string())
        .env("CFSB_RAMP", ramp.to_string())
        .env("CFSB_JOBS", procs.to_string())
        .env("CFSB_HARD_SKIP", ((procs - 1) * 47008).to_string())
        .env("CFSB_HARD_SPAN", (span / procs).to_string())
        .env("CFSB_BTIO_SKIP", ((procs - 1) * 8160).to_string())
        .env("CFSB_BTIO_SPAN", (span / procs).to_string())
        .output()
        .context("run fio")?;
    // The job's files go, so that the next job has the space (CitronFS's cluster is sized for
    // one job at a time).
    let _ = std::fs::remove_dir_all(&dir);
    if !out.status.success() {
        bail!(
            "fio failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    // fio may print notes before the JSON document.
    let start = stdout.find('{').context("no JSON in fio's output")?;
    let parsed: FioOutput =
        serde_json::from_str(&stdout[start..]).context("parse fio's JSON output")?;
    let m = parsed.measure().context("fio's output has no job")?;
    Ok(Row {
        job: job.name(),
        fs: fs.name(),
        replicas: replicas_of(fs, args),
        value: m.bytes_per_s / (1u64 << 20) as f64,
        unit: "MiB/s",
        ops_per_s: m.iops,
        p99_us: m.p99_ns.map(|ns| ns / 1000.0),
        shm_ratio: None,
        tcp_ratio: None,
    })
}

/// The parts of fio's JSON output used here.
#[derive(serde::Deserialize)]
struct FioOutput {
    jobs: Vec<FioJob>,
}

#[derive(serde::Deserialize)]
struct FioJob {
    read: FioDir,
    write: FioDir,
}

#[derive(serde::Deserialize)]
struct FioDir {
    bw_bytes: f64,
    iops: f64,
    clat_ns: FioLat,
}

#[derive(serde::Deserialize)]
struct FioLat {
    #[serde(default)]
    percentile: std::collections::BTreeMap<String, f64>,
}

struct Measured {
    bytes_per_s: f64,
    iops: f64,
    p99_ns: Option<f64>,
}

impl FioOutput {
    /// Reads and writes of every job summed (the job files report one group), with the worse
    /// p99 of the two directions that did any I/O.
    fn measure(&self) -> Option<Measured> {
        if self.jobs.is_empty() {
            return None;
        }
        let mut m = Measured {
            bytes_per_s: 0.0,
            iops: 0.0,
            p99_ns: None,
        };
        for j in &self.jobs {
            for d in [&j.read, &j.write] {
                m.bytes_per_s += d.bw_bytes;
                m.iops += d.iops;
                if d.iops > 0.0 {
                    if let Some(&p) = d.clat_ns.percentile.get("99.000000") {
                        m.p99_ns = Some(m.p99_ns.map_or(p, |q: f64| q.max(p)));
                    }
                }
            }
        }
        Some(m)
    }
}

/// Creates, stats and unlinks `files` files in a fresh directory, one thread; one row per phase
/// (operations per second).
fn metadata_pass(fs: Fs, replicas: Option<u32>, dir: &Path, files: u32) -> Result<Vec<Row>> {
    let dir = dir.join("metadata-pass");
    std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
    let names: Vec<PathBuf> = (0..files).map(|i| dir.join(format!("f{i:06}"))).collect();
    let mut rows = Vec::new();
    let mut phase = |name: &'static str, op: &dyn Fn(&Path) -> std::io::Result<()>| -> Result<()> {
        let t = Instant::now();
        for path in &names {
            op(path).with_context(|| format!("{name} {}", path.display()))?;
        }
        let per_s = f64::from(files) / t.elapsed().max(Duration::from_nanos(1)).as_secs_f64();
        rows.push(Row {
            job: name,
            fs: fs.name(),
            replicas,
            value: per_s,
            unit: "ops/s",
            ops_per_s: per_s,
            p99_us: None,
            shm_ratio: None,
            tcp_ratio: None,
        });
        Ok(())
    };
    phase("create", &|p| std::fs::File::create(p).map(drop))?;
    phase("stat", &|p| std::fs::metadata(p).map(drop))?;
    phase("unlink", &|p| std::fs::remove_file(p))?;
    std::fs::remove_dir(&dir).with_context(|| format!("rmdir {}", dir.display()))?;
    Ok(rows)
}

fn print_notes(args: &CompareArgs, rows: &[Row]) {
    println!();
    println!(
        "fio jobs of bench/fio/, {} s each after a ramp, {} processes on the shared-file jobs \
         (io500-hard, btio, oltp); direct=1 everywhere but tmpfs. value: MiB/s (fio jobs, reads \
         and writes together) or operations per second (create, stat, unlink: {} files, one \
         thread). shm ÷ this, tcp ÷ this: CitronFS on that fabric over this row (> 1: CitronFS \
         is faster). CitronFS: scheme {}, {} data servers. replicas: copies of the data on each \
         distributed file system, {} (CitronFS's replicas; GlusterFS bricks, a replica volume \
         from 2; MooseFS chunkservers and goal). Peers' data in {}.",
        args.duration,
        args.procs,
        args.files,
        args.scheme,
        args.replicas.max(2),
        args.replicas,
        args.work_dir.display()
    );
    for job in [
        "io500-hard",
        "btio",
        "oltp",
        "seq-write",
        "seq-read",
        "create",
        "stat",
        "unlink",
    ] {
        let value = |fs: Fs| {
            rows.iter()
                .find(|r| r.job == job && r.fs == fs.name())
                .map(|r| r.value)
        };
        let best_peer = [value(Fs::Glusterfs), value(Fs::Moosefs)]
            .into_iter()
            .flatten()
            .fold(None, |best: Option<f64>, v| {
                Some(best.map_or(v, |b| b.max(v)))
            });
        if let Some(peer) = best_peer.filter(|&p| p > 0.0) {
            let ratio = |fs: Fs| {
                value(fs)
                    .map(|v| format!("{:.2}x", v / peer))
                    .unwrap_or_else(|| "-".into())
            };
            println!(
                "{job}: CitronFS over the better of GlusterFS and MooseFS: shm {}, tcp {}",
                ratio(Fs::CitronfsShm),
                ratio(Fs::CitronfsTcp)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_divide_by_the_best_peer_and_read_saved_results() {
        let results: Vec<(String, String, f64)> = [
            ("create", "citronfs-shm", 2204.0),
            ("create", "tmpfs", 144_323.0),
            ("create", "glusterfs", 679.0),
            ("create", "moosefs", 1551.0),
            ("btio", "citronfs-shm", 433.0),
            ("btio", "glusterfs", 34.0),
        ]
        .iter()
        .map(|&(j, f, v)| (j.to_string(), f.to_string(), v))
        .collect();
        let (reference, series, groups) = ratios(&results);
        assert_eq!(reference, "the better of GlusterFS and MooseFS");
        assert_eq!(series, ["citronfs-shm", "tmpfs", "glusterfs", "moosefs"]);
        assert_eq!(groups[0].0, "create");
        let create = &groups[0].1;
        assert!((create[0].unwrap() - 2204.0 / 1551.0).abs() < 1e-9);
        assert_eq!(create[3], Some(1.0));
        assert_eq!(groups[1].1, vec![Some(433.0 / 34.0), None, Some(1.0), None]);
        let only_tmpfs = &results[..2];
        assert_eq!(ratios(only_tmpfs).0, "tmpfs");

        let dir = tempfile::tempdir().unwrap();
        let saved = dir.path().join("r.json");
        std::fs::write(
            &saved,
            "{\"job\":\"btio\",\"fs\":\"tmpfs\",\"value\":2.5,\"unit\":\"MiB/s\"}\n\n",
        )
        .unwrap();
        assert_eq!(
            read_results(&saved).unwrap(),
            [("btio".into(), "tmpfs".into(), 2.5)]
        );
        std::fs::write(&saved, "{\"job\":\"btio\"}\n").unwrap();
        assert!(read_results(&saved)
            .unwrap_err()
            .to_string()
            .contains(":1:"));
        plot(&dir.path().join("c.svg"), &results).unwrap();
    }

    #[test]
    fn fio_output_sums_directions_and_takes_the_worse_p99() {
        let json = r#"{"fio version": "fio-3.33", "jobs": [{"jobname": "oltp",
            "read": {"bw_bytes": 1048576, "iops": 128.0,
                     "clat_ns": {"percentile": {"99.000000": 5000.0}}},
            "write": {"bw_bytes": 524288, "iops": 64.0,
                      "clat_ns": {"percentile": {"99.000000": 9000.0}}}}]}"#;
        let out: FioOutput = serde_json::from_str(json).unwrap();
        let m = out.measure().unwrap();
        assert_eq!(m.bytes_per_s, 1572864.0);
        assert_eq!(m.iops, 192.0);
        assert_eq!(m.p99_ns, Some(9000.0));
        let idle_write = r#"{"jobs": [{"read": {"bw_bytes": 10, "iops": 1.0,
            "clat_ns": {"percentile": {"99.000000": 7.0}}},
            "write": {"bw_bytes": 0, "iops": 0.0, "clat_ns": {}}}]}"#;
        let out: FioOutput = serde_json::from_str(idle_write).unwrap();
        assert_eq!(out.measure().unwrap().p99_ns, Some(7.0));
        let none: FioOutput = serde_json::from_str(r#"{"jobs": []}"#).unwrap();
        assert!(none.measure().is_none());
    }

    #[test]
    fn ratios_are_citronfs_over_each_row_of_the_same_job() {
        let row = |job, fs: Fs, value| Row {
            job,
            fs: fs.name(),
            replicas: None,
            value,
            unit: "MiB/s",
            ops_per_s: 0.0,
            p99_us: None,
            shm_ratio: None,
            tcp_ratio: None,
        };
        let mut rows = vec![
            row("io500-hard", Fs::CitronfsShm, 300.0),
            row("io500-hard", Fs::CitronfsTcp, 150.0),
            row("io500-hard", Fs::Moosefs, 50.0),
            row("oltp", Fs::Moosefs, 10.0),
        ];
        fill_ratios(&mut rows);
        assert_eq!(rows[2].shm_ratio, Some(6.0));
        assert_eq!(rows[2].tcp_ratio, Some(3.0));
        assert_eq!(rows[0].shm_ratio, Some(1.0));
        assert_eq!(rows[3].shm_ratio, None, "no CitronFS row for oltp");
    }

    /// `bench compare` with these arguments, as the command line parses them.
    fn parse(args: &[&str]) -> Result<CompareArgs, clap::Error> {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: CompareArgs,
        }
        Cli::try_parse_from(std::iter::once("compare").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn replicas_reach_the_cluster_the_peers_and_the_rows() {
        // The default run is today's: one copy, two data servers.
        let default = parse(&[]).unwrap();
        assert_eq!(default.replicas, 1);
        let spec = cluster_spec(Backend::Tcp, &default);
        assert_eq!((spec.replicas, spec.data_servers), (1, 2));
        assert_eq!(spec.capacity, 1 << 30);
        assert_eq!(replicas_of(Fs::CitronfsShm, &default), Some(1));

        let two = parse(&["--replicas", "2"]).unwrap();
        let spec = cluster_spec(Backend::Shm, &two);
        assert_eq!((spec.replicas, spec.data_servers), (2, 2));
        let three = parse(&["--replicas", "3", "--fs", "citronfs-tcp,tmpfs,glusterfs"]).unwrap();
        let spec = cluster_spec(Backend::Tcp, &three);
        assert_eq!((spec.replicas, spec.data_servers), (3, 3));
        for fs in [Fs::CitronfsShm, Fs::CitronfsTcp, Fs::Glusterfs, Fs::Moosefs] {
            assert_eq!(replicas_of(fs, &three), Some(3), "{}", fs.name());
        }
        assert_eq!(replicas_of(Fs::Tmpfs, &three), None);

        for bad in ["0", "9", "-1", "two"] {
            assert!(parse(&["--replicas", bad]).is_err(), "--replicas {bad}");
        }
    }

    #[test]
    fn peer_scripts_get_the_replica_count_in_their_environment() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("peer.sh");
        std::fs::write(
            &script,
            "echo \"$1 ${CFSB_REPLICAS:-unset} $(basename \"$3\")\" >> \"$2/seen\"\n",
        )
        .unwrap();
        for replicas in [1, 3] {
            let peer = Peer {
                script: script.clone(),
                state: dir.path().to_path_buf(),
                mountpoint: dir.path().join("mnt"),
                replicas,
            };
            peer.script("up").unwrap();
            peer.script("down").unwrap();
        }
        let seen = std::fs::read_to_string(dir.path().join("seen")).unwrap();
        assert_eq!(seen, "up 1 mnt\ndown 1 mnt\nup 3 mnt\ndown 3 mnt\n");

        // A failing script's error carries its stderr.
        std::fs::write(&script, "echo \"no bricks\" >&2; exit 2\n").unwrap();
        let peer = Peer {
            script,
            state: dir.path().to_path_buf(),
            mountpoint: dir.path().join("mnt"),
            replicas: 2,
        };
        let err = peer.script("up").unwrap_err().to_string();
        assert!(err.contains("no bricks"), "{err}");
    }

    #[test]
    fn the_peer_scripts_read_the_replica_count() {
        for (name, text) in PEER_SCRIPTS {
            if *name != "netns.sh" {
                assert!(text.contains("CFSB_REPLICAS"), "{name} ignores --replicas");
            }
        }
    }

    #[test]
    fn every_job_file_reads_its_settings_from_the_environment() {
        for (job, text) in JOBS {
            for var in ["${CFSB_DIR}", "${CFSB_DIRECT}", "${CFSB_RUNTIME}"] {
                assert!(text.contains(var), "{} lacks {var}", job.name());
            }
            assert!(
                text.contains(&format!("[{}]", job.name())),
                "{}",
                job.name()
            );
        }
    }
}
