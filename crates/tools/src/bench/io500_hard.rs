//! `citronfs bench io500-hard`: the IOR hard-write pattern of IO500 (CITRON §4.5, Fig. 10),
//! lock-only, every lock scheme in one run — CITRON from a small tree that scales up as the
//! offsets grow, against CITRON with the whole tree preallocated and the baselines.
//!
//! The trace: P ranks write 47008-byte records into one shared file, interleaved by rank (rank r
//! writes records r, r+P, r+2P, ..., offsets always growing). `--trace-out FILE` writes it (one
//! line per write: `rank offset length`), `--trace FILE` replays a recorded one instead. Each
//! rank is a thread with its own lock handle; every write becomes an acquire and a release of
//! its byte range in lock units (4 KiB, the file system's default), as §4.5 replays its trace.
//! Reported per scheme: locks per second over the whole run, the throughput in time buckets, and
//! for CITRON with scale-ups, each scale-up (when, and how long the acquire that performed it
//! took — an upper bound of the scale-up itself).

use super::clients::{Clients, SharedFile, Via};
use super::locks::{Fabric, LOCK_REGION, MAX_SEGMENTS};
use super::runner::{interrupted, Run};
use crate::report::{fmt_opt, Report};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use cluster::{Cluster, ClusterSpec};
use fabric::{Backend, RemoteAddr};
use lockmgr::baselines::SegSpec;
use lockmgr::citron::{CitronGrowth, CitronSpec, Hosting};
use lockmgr::schemes::{self, CreateOptions, FixedMemory};
use lockmgr::{LockScheme, RangeLock};
use serde::Serialize;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// IOR hard's record size.
pub const RECORD: u64 = 47008;
/// Bytes per lock unit (the file system's default).
const UNIT: u64 = 4096;

/// Options of `citronfs bench io500-hard`.
#[derive(Args, Debug)]
pub struct Io500HardArgs {
    /// Ranks (threads, each with its own lock handle).
    #[arg(long, default_value_t = 16)]
    procs: u64,
    /// Records written by all ranks together (the generated trace).
    #[arg(long, default_value_t = 200_000)]
    records: u64,
    /// Replay this trace (lines `rank offset length`) instead of generating one.
    #[arg(long, conflicts_with = "records")]
    trace: Option<PathBuf>,
    /// Write the trace replayed to this file.
    #[arg(long)]
    trace_out: Option<PathBuf>,
    /// Lock units of CITRON's first tree when it scales up (the file system starts at 256: 1 MiB).
    #[arg(long, default_value_t = 256)]
    initial_units: u64,
    /// Width of the throughput-over-time buckets, in milliseconds.
    #[arg(long, default_value_t = 100)]
    bucket_ms: u64,
    /// The fabric.
    #[arg(long, value_enum, default_value = "shm")]
    fabric: Backend,
    /// Replay with I/O instead of lock-only: the ranks write their records into one file of an
    /// embedded cluster through --clients clients (the file system's own locks, which scale up
    /// as the file grows), and read them back to verify.
    #[arg(long)]
    io: bool,
    /// With --io: clients, separate `citronfs mount` processes (or library instances).
    #[arg(long, default_value_t = 2)]
    clients: usize,
    /// With --io: through FUSE mounts (client processes) or the client library.
    #[arg(long, value_enum, default_value = "fuse")]
    via: Via,
    /// Also draw the results into this SVG file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// One JSON object per result instead of the table.
    #[arg(long)]
    json: bool,
}

/// One write of the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceWrite {
    /// The rank that writes it.
    pub rank: u64,
    /// File offset.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The IOR hard-write trace: `records` records of `procs` ranks, interleaved by rank.
pub fn trace(procs: u64, records: u64) -> Vec<TraceWrite> {
    (0..records)
        .map(|i| TraceWrite {
            rank: i % procs,
            offset: i * RECORD,
            len: RECORD,
        })
        .collect()
}

/// Parses a trace file (lines `rank offset length`; `#` comments and blank lines skipped).
fn read_trace(path: &std::path::Path) -> Result<Vec<TraceWrite>> {
    let file = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line?;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<u64> = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("{}:{}: not three numbers", path.display(), n + 1))?;
        let [rank, offset, len] = fields[..] else {
            bail!(
                "{}:{}: expected `rank offset length`",
                path.display(),
                n + 1
            );
        };
        anyhow::ensure!(len > 0, "{}:{}: a write of 0 bytes", path.display(), n + 1);
        offset
            .checked_add(len)
            .with_context(|| format!("{}:{}: offset + length overflows", path.display(), n + 1))?;
        out.push(TraceWrite { rank, offset, len });
    }
    Ok(out)
}

fn write_trace(path: &std::path::Path, trace: &[TraceWrite]) -> Result<()> {
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?,
    );
    writeln!(
        f,
        "# rank offset length (IOR hard-write, citronfs bench io500-hard)"
    )?;
    for w in trace {
        writeln!(f, "{} {} {}", w.rank, w.offset, w.len)?;
    }
    f.flush()?;
    Ok(())
}

/// A scale-up seen by the rank that performed it.
#[derive(Clone, Copy, Debug, Serialize)]
struct ScaleUp {
    /// Since the start of the run.
    at_ms: f64,
    /// Records written (locks released) by then, all ranks together.
    at_records: u64,
    /// The acquire that scaled up, whole (an upper bound of the scale-up).
    acquire_us: f64,
}

/// The result of one scheme.
#[derive(Debug, Serialize)]
struct HardResult {
    scheme: String,
    fabric: &'static str,
    procs: u64,
    writes: u64,
    seconds: f64,
    locks_per_s: f64,
    /// Units the tree covered at first (CITRON).
    initial_units: Option<u64>,
    scale_ups: Vec<ScaleUp>,
    /// Locks (with --io: writes) per second in each bucket of `bucket_ms`.
    series: Vec<f64>,
    /// With --io: MiB written per second over the run.
    mib_per_s: Option<f64>,
    /// (records written, records per second while writing the last of them), for the plot.
    #[serde(skip)]
    progress: Vec<(f64, f64)>,
    bucket_ms: u64,
    vs_citron: Option<f64>,
}

/// Runs the benchmark.
pub fn run(args: &Io500HardArgs) -> Result<()> {
    anyhow::ensure!(args.bucket_ms >= 1, "--bucket-ms must be at least 1");
    let trace = match &args.trace {
        Some(path) => read_trace(path)?,
        None => {
            anyhow::ensure!(args.procs >= 1, "--procs must be at least 1");
            anyhow::ensure!(args.records >= 1, "--records must be at least 1");
            trace(args.procs, args.records)
        }
    };
    anyhow::ensure!(!trace.is_empty(), "the trace is empty");
    if let Some(out) = &args.trace_out {
        write_trace(out, &trace)?;
    }
    let procs = trace.iter().map(|w| w.rank).max().unwrap_or(0) + 1;
    let end = trace.iter().map(|w| w.offset + w.len).max().unwrap_or(0);
    // Whole trees (64·4^k units): a growth limit below the next whole tree would stop the
    // scale-ups short of the trace's end and leave the rest to the spillover mutex.
    let units = whole_tree(end.div_ceil(UNIT));
    anyhow::ensure!(
        args.initial_units >= 1 && args.initial_units <= units,
        "--initial-units must be between 1 and the trace's {units} units"
    );

    let kinds: Vec<(&str, LockScheme, Option<u64>)> = vec![
        (
            "citron",
            citron(args.initial_units, units),
            Some(args.initial_units),
        ),
        ("citron-prealloc", citron(units, units), Some(units)),
        ("mutex", LockScheme::Mutex, None),
        (
            "seg",
            LockScheme::Seg(SegSpec {
                segment_units: 16,
                segments: units.div_ceil(16).clamp(1, MAX_SEGMENTS),
            }),
            None,
        ),
        ("server", LockScheme::Server, None),
    ];
    let steps = if args.io { 4 } else { kinds.len() as u64 };
    // With I/O the run has client processes and mounts: a signal ends it in order. (Lock-only
    // runs start nothing outside this process, and end at once.)
    let run = match args.io {
        true => Run::start(args.json, steps)?,
        false => Run::in_process(args.json, steps),
    };
    let mut results = Vec::new();
    if args.io {
        results = replay_io(args, &trace, procs, end, &run)?;
    } else {
        for (name, kind, initial) in kinds {
            run.say(name);
            let r = replay(args, &trace, procs, name, kind, initial)
                .with_context(|| format!("scheme {name}"))?;
            results.push(r);
            run.advance();
        }
    }
    run.finish();
    let citron_rate = results
        .iter()
        .find(|r| r.scheme == "citron")
        .map(|r| r.locks_per_s);
    if let Some(path) = &args.plot {
        plot(path, args, procs, trace.len(), &results)?;
    }
    let mut report = Report::new(
        args.json,
        &[
            "scheme",
            if args.io { "writes/s" } else { "locks/s" },
            "MiB/s",
            "vs citron",
            "scale-ups",
            "slowest scale-up µs",
        ],
    );
    for mut r in results {
        r.vs_citron = citron_rate.filter(|&c| c > 0.0).map(|c| r.locks_per_s / c);
        let slowest = r
            .scale_ups
            .iter()
            .map(|s| s.acquire_us)
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
        report.add(
            vec![
                r.scheme.clone(),
                format!("{:.0}", r.locks_per_s),
                fmt_opt(r.mib_per_s, 1),
                fmt_opt(r.vs_citron, 2),
                if args.io {
                    "-".to_string()
                } else {
                    r.scale_ups.len().to_string()
                },
                fmt_opt(slowest, 1),
            ],
            &r,
        );
        if !args.json && r.scheme == "citron" {
            print_series(&r);
        }
    }
    report.finish();
    if !args.json && args.io {
        println!();
        println!(
            "IOR hard-write with I/O: {} writes of {RECORD} B by {procs} ranks into one file, \
             through {} client(s) via {:?} on the {} fabric; the file system's own locks (CITRON's \
             tree scales up as the file grows; its scale-ups happen in the client processes and \
             are not counted here); every record read back by its writer and compared.",
            trace.len(),
            args.clients,
            args.via,
            args.fabric.name()
        );
    } else if !args.json {
        println!();
        println!(
            "IOR hard-write, lock-only (CITRON §4.5): {} writes of {RECORD} B by {procs} ranks, \
             one thread and lock handle each, a tree of {units} lock units of {UNIT} B at the \
             end; {} \
             fabric. citron starts from a tree of {} units and scales up as the offsets grow; \
             citron-prealloc has the whole tree from the start. A scale-up's time is the whole \
             acquire that performed it.",
            trace.len(),
            args.fabric.name(),
            args.initial_units
        );
    }
    Ok(())
}

/// The smallest whole tree (64·4^k units, CITRON §3.2) covering `units`.
fn whole_tree(units: u64) -> u64 {
    let mut n = 64;
    while n < units {
        n *= 4;
    }
    n
}

/// CITRON covering `initial` units at first, growing (room set aside after the tree) to `max`,
/// with the file system's `T_lease` (a shorter one mistakes a thread descheduled on a loaded
/// host for a dead holder, and the run measures recoveries instead of locks).
fn citron(initial: u64, max: u64) -> LockScheme {
    LockScheme::Citron(CitronSpec {
        unit_count: initial,
        max_unit_count: max,
        growth: Some(CitronGrowth::Room),
        lease_ms: meta_server::DEFAULT_LOCK_LEASE.as_millis() as u64,
        ..CitronSpec::plain(true)
    })
}

/// Prints citron's throughput over time, a line per bucket, with the scale-ups marked.
fn print_series(r: &HardResult) {
    println!(
        "citron, locks (with --io: writes) per second in buckets of {} ms (* = a scale-up in the bucket):",
        r.bucket_ms
    );
    for (i, v) in r.series.iter().enumerate() {
        let from = (i as u64 * r.bucket_ms) as f64;
        let to = from + r.bucket_ms as f64;
        let ups: Vec<String> = r
            .scale_ups
            .iter()
            .filter(|s| s.at_ms >= from && s.at_ms < to)
            .map(|s| format!("{:.0} µs", s.acquire_us))
            .collect();
        println!(
            "  {:>7.0} ms {:>10.0}{}",
            from,
            v,
            if ups.is_empty() {
                String::new()
            } else {
                format!("  * scale-up ({})", ups.join(", "))
            }
        );
    }
    println!();
}

/// Replays `trace` on a fresh lock of `kind`.
fn replay(
    args: &Io500HardArgs,
    trace: &[TraceWrite],
    procs: u64,
    name: &str,
    mut kind: LockScheme,
    initial: Option<u64>,
) -> Result<HardResult> {
    let options = CreateOptions::default();
    let region_bytes = kind.resolve(&options)?.region_bytes()?;
    let fabric = Fabric::start(args.fabric, region_bytes)?;
    if let LockScheme::Citron(spec) = &mut kind {
        // Replayed with the default options: hosted where the fabric offers it.
        let shape = spec.resolve(&options.citron)?.config();
        let t_wait = fabric.t_wait(Hosting::Auto, &shape)?;
        spec.t_wait_us = t_wait.as_micros().max(1) as u64;
    }
    let created = schemes::create(
        &kind,
        &options,
        &mut FixedMemory::new(
            &mut *fabric.connector().connect()?,
            RemoteAddr::new(LOCK_REGION, 0),
            region_bytes,
        ),
    )?;
    let open_options = created.open_options();
    let per_rank: Vec<Vec<(u64, u64)>> = (0..procs)
        .map(|r| {
            trace
                .iter()
                .filter(|w| w.rank == r)
                .map(|w| (w.offset / UNIT, (w.offset + w.len).div_ceil(UNIT)))
                .collect()
        })
        .collect();
    let start = Arc::new(Barrier::new(procs as usize + 1));
    let mut workers = Vec::new();
    for ranges in per_rank {
        let lock = schemes::open(&created.lock, fabric.connector(), &open_options)?;
        let start = start.clone();
        workers.push(std::thread::spawn(move || rank(lock, ranges, &start)));
    }
    start.wait();
    let began = Instant::now();
    let mut done: Vec<Duration> = Vec::with_capacity(trace.len());
    let mut scale_ups = Vec::new();
    for w in workers {
        let (times, ups) = w.join().map_err(|_| anyhow!("a rank panicked"))??;
        done.extend(times);
        scale_ups.extend(ups);
    }
    let seconds = began.elapsed().as_secs_f64();
    done.sort_unstable();
    let series = buckets(&done, seconds, Duration::from_millis(args.bucket_ms));
    let mut scale_ups: Vec<ScaleUp> = scale_ups
        .into_iter()
        .map(|(at, took)| ScaleUp {
            at_ms: at.as_secs_f64() * 1000.0,
            at_records: done.partition_point(|&t| t <= at) as u64,
            acquire_us: took.as_secs_f64() * 1e6,
        })
        .collect();
    scale_ups.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    Ok(HardResult {
        scheme: name.to_string(),
        fabric: args.fabric.name(),
        procs,
        writes: done.len() as u64,
        seconds,
        locks_per_s: done.len() as f64 / seconds,
        initial_units: initial,
        scale_ups,
        series,
        mib_per_s: None,
        progress: rate_points(&done, procs),
        bucket_ms: args.bucket_ms,
        vs_citron: None,
    })
}

/// Locks (or writes) per second per bucket of `bucket`, from completion times.
fn buckets(done: &[Duration], seconds: f64, bucket: Duration) -> Vec<f64> {
    let n = (seconds / bucket.as_secs_f64()).ceil().max(1.0) as usize;
    let mut series = vec![0f64; n];
    for t in done {
        let i = ((t.as_nanos() / bucket.as_nanos()) as usize).min(n - 1);
        series[i] += 1.0;
    }
    for v in &mut series {
        *v /= bucket.as_secs_f64();
    }
    series
}

/// Points of the plot: how fast the records were written as the run went, from completion times
/// (sorted). Each point is (records written, records per second since the previous point); the
/// points are spaced geometrically (about 60, none closer than a record per rank), so a log x axis
/// shows the start of the run as well as its end, where CITRON's scale-ups happen (each at 4×
/// the records of the one before).
fn rate_points(done: &[Duration], procs: u64) -> Vec<(f64, f64)> {
    let n = done.len();
    let step = (procs.max(1) as usize).min(n.max(1));
    let factor = (n as f64 / step as f64).powf(1.0 / 60.0).max(1.0);
    let mut points: Vec<(f64, f64)> = Vec::new();
    // Where the piece being measured starts, and where the last point's piece started.
    let (mut from, mut since) = (0usize, Duration::ZERO);
    let mut last = (0usize, Duration::ZERO);
    let mut to = step;
    while to <= n && to > from {
        let at = done[to - 1];
        if at > since {
            points.push((to as f64, (to - from) as f64 / (at - since).as_secs_f64()));
            last = (from, since);
            (from, since) = (to, at);
        } else if to == n {
            // The last records finished with the last point's: they join its piece.
            if let Some(p) = points.last_mut() {
                *p = (
                    n as f64,
                    (n - last.0) as f64 / (since - last.1).as_secs_f64(),
                );
            }
        }
        if to == n {
            break;
        }
        to = (((to as f64) * factor).round() as usize)
            .max(to + step)
            .min(n);
    }
    points
}

/// Draws the records-written plot: every scheme's run across the whole width, its rate on a
/// log scale where the schemes are orders of magnitude apart, CITRON's scale-ups marked where
/// they happened with the time of the acquire that performed each.
fn plot(
    path: &std::path::Path,
    args: &Io500HardArgs,
    procs: u64,
    records: usize,
    results: &[HardResult],
) -> Result<()> {
    use crate::plot::Unit;
    let series: Vec<(String, Vec<(f64, f64)>)> = results
        .iter()
        .map(|r| {
            let name = format!("{} ({})", r.scheme, Unit::Micros.fmt(r.seconds * 1e6));
            (name, r.progress.clone())
        })
        .collect();
    let marks: Vec<(f64, String)> = results
        .iter()
        .filter(|r| r.scheme == "citron")
        .flat_map(|r| r.scale_ups.iter())
        .map(|s| (s.at_records.max(1) as f64, Unit::Micros.fmt(s.acquire_us)))
        .collect();
    let what = if args.io { "with I/O" } else { "lock-only" };
    crate::plot::lines(
        path,
        &crate::plot::Lines {
            title: &format!(
                "IOR hard-write {what}: {} records by {procs} ranks ({}), each scheme's whole run",
                Unit::Count.fmt(records as f64),
                args.fabric.name()
            ),
            x_desc: "records written",
            x_unit: Unit::Count,
            y_desc: if args.io { "writes/s" } else { "locks/s" },
            y_unit: Unit::Count,
            series: &series,
            marks: &marks,
            marks_desc: "citron scale-up (acquire)",
        },
    )
}

/// Replays `trace` with I/O: every scheme on one embedded cluster, the ranks writing through
/// their clients, then every record read back by its writer.
fn replay_io(
    args: &Io500HardArgs,
    trace: &[TraceWrite],
    procs: u64,
    end: u64,
    run: &Run,
) -> Result<Vec<HardResult>> {
    let schemes = [
        LockScheme::CITRON,
        LockScheme::Mutex,
        LockScheme::SEG,
        LockScheme::Server,
    ];
    let cluster = Cluster::start(ClusterSpec {
        name: "citronfs-io500-hard".into(),
        data_servers: 2,
        capacity: end / 2 + (64 << 20),
        fabric: args.fabric,
        lock_server: true,
        ..ClusterSpec::server_defaults()
    })?;
    let mut results = Vec::new();
    for scheme in schemes {
        run.check()?;
        run.say(scheme.to_string());
        let clients = Clients::start(
            &cluster,
            scheme,
            fs_client::LockMode::Shared,
            args.clients,
            args.via,
        )?;
        let name = format!("io500-hard-{}.dat", scheme.name());
        let seed = 0x10500 + results.len() as u64;
        let files: Vec<Arc<dyn SharedFile>> = (0..procs)
            .map(|r| {
                clients
                    .open(r as usize % clients.len(), &name)
                    .map(Arc::from)
            })
            .collect::<Result<_>>()?;
        let start = Arc::new(Barrier::new(procs as usize + 1));
        let began = std::thread::scope(|s| -> Result<(Instant, Vec<Duration>)> {
            let handles: Vec<_> = files
                .iter()
                .enumerate()
                .map(|(r, file)| {
                    let (start, stop) = (start.clone(), run.stop());
                    let mine: Vec<TraceWrite> = trace
                        .iter()
                        .filter(|w| w.rank == r as u64)
                        .copied()
                        .collect();
                    s.spawn(move || -> Result<Vec<Duration>> {
                        start.wait();
                        let began = Instant::now();
                        let mut done = Vec::with_capacity(mine.len());
                        for w in mine {
                            interrupted(stop)?;
                            let buf = cluster::pattern(seed, w.offset, w.len as usize);
                            file.write_at(&buf, w.offset)
                                .with_context(|| format!("rank {r}: write at {}", w.offset))?;
                            done.push(began.elapsed());
                        }
                        Ok(done)
                    })
                })
                .collect();
            start.wait();
            let began = Instant::now();
            let mut done = Vec::new();
            for h in handles {
                done.extend(h.join().map_err(|_| anyhow!("a rank panicked"))??);
            }
            Ok((began, done))
        });
        let (began, mut done) = began.with_context(|| format!("scheme {scheme}"))?;
        done.sort_unstable();
        let seconds = began.elapsed().as_secs_f64();
        // Every record, read back through its writer's client.
        for (r, file) in files.iter().enumerate() {
            run.check()?;
            for w in trace.iter().filter(|w| w.rank == r as u64) {
                let mut buf = vec![0u8; w.len as usize];
                file.read_at(&mut buf, w.offset)?;
                if buf != cluster::pattern(seed, w.offset, w.len as usize) {
                    bail!(
                        "scheme {scheme}: the record at {} does not hold what rank {r} wrote",
                        w.offset
                    );
                }
            }
        }
        drop(files);
        clients.remove(&name)?;
        drop(clients);
        let bytes: u64 = trace.iter().map(|w| w.len).sum();
        results.push(HardResult {
            scheme: scheme.to_string(),
            fabric: args.fabric.name(),
            procs,
            writes: done.len() as u64,
            seconds,
            locks_per_s: done.len() as f64 / seconds,
            initial_units: None,
            scale_ups: Vec::new(),
            series: buckets(&done, seconds, Duration::from_millis(args.bucket_ms)),
            mib_per_s: Some(bytes as f64 / (1u64 << 20) as f64 / seconds),
            progress: rate_points(&done, procs),
            bucket_ms: args.bucket_ms,
            vs_citron: None,
        });
        run.advance();
    }
    cluster.shutdown()?;
    Ok(results)
}

/// What one rank saw: when each of its locks was released (since the start), and its
/// scale-ups (when, and how long that acquire took).
type RankOutcome = (Vec<Duration>, Vec<(Duration, Duration)>);

/// One rank: acquires and releases its ranges in order.
fn rank(
    mut lock: Box<dyn RangeLock>,
    ranges: Vec<(u64, u64)>,
    start: &Barrier,
) -> Result<RankOutcome> {
    let mut done = Vec::with_capacity(ranges.len());
    let mut ups = Vec::new();
    start.wait();
    let began = Instant::now();
    for (l, r) in ranges {
        let before = lock.stats().scale_ups;
        let t = Instant::now();
        let id = lock.acquire(l..r)?;
        let took = t.elapsed();
        if lock.stats().scale_ups > before {
            ups.push((t.duration_since(began), took));
        }
        lock.release(id)?;
        done.push(began.elapsed());
    }
    Ok((done, ups))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_points_cover_every_record_at_growing_steps() {
        // 1,000 records, one a millisecond: 1,000 records/s throughout.
        let done: Vec<Duration> = (1..=1000).map(Duration::from_millis).collect();
        let p = rate_points(&done, 4);
        assert_eq!(p.first().unwrap().0, 4.0);
        assert_eq!(p.last().unwrap().0, 1000.0);
        assert!(p.windows(2).all(|w| w[1].0 - w[0].0 >= 4.0), "{p:?}");
        for &(_, rate) in &p[1..] {
            assert!((rate - 1000.0).abs() < 1.0, "{p:?}");
        }
        // Records finishing at the same instant are counted with the next point, or the last.
        let done = vec![Duration::from_millis(1); 3];
        assert_eq!(rate_points(&done, 1), vec![(3.0, 3000.0)]);
        let done: Vec<Duration> = [1, 1, 2, 2].map(Duration::from_millis).to_vec();
        assert_eq!(rate_points(&done, 1), vec![(1.0, 1000.0), (4.0, 3000.0)]);
        assert!(rate_points(&[], 16).is_empty());
        let one = rate_points(&[Duration::from_millis(2)], 16);
        assert_eq!(one, vec![(1.0, 500.0)]);
    }

    #[test]
    fn whole_trees_are_64_times_powers_of_4() {
        assert_eq!(whole_tree(1), 64);
        assert_eq!(whole_tree(64), 64);
        assert_eq!(whole_tree(65), 256);
        assert_eq!(whole_tree(229_532), 262_144);
    }

    #[test]
    fn the_trace_interleaves_ranks_with_growing_offsets() {
        let t = trace(4, 10);
        assert_eq!(
            t[5],
            TraceWrite {
                rank: 1,
                offset: 5 * RECORD,
                len: RECORD
            }
        );
        for r in 0..4 {
            let mine: Vec<u64> = t.iter().filter(|w| w.rank == r).map(|w| w.offset).collect();
            assert!(mine.windows(2).all(|w| w[1] > w[0]), "rank {r}");
        }
    }

    #[test]
    fn a_written_trace_reads_back_and_bad_lines_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        let t = trace(3, 7);
        write_trace(&path, &t).unwrap();
        assert_eq!(read_trace(&path).unwrap(), t);
        std::fs::write(&path, "0 1\n").unwrap();
        assert!(read_trace(&path).unwrap_err().to_string().contains(":1:"));
        std::fs::write(&path, "0 18446744073709551615 2\n").unwrap();
        assert!(read_trace(&path).is_err());
        std::fs::write(&path, "0 x 2\n").unwrap();
        assert!(read_trace(&path).is_err());
    }
}
