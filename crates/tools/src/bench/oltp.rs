//! `citronfs bench oltp`: the distributed Filebench OLTP workload of CITRON §4.3.2 (Table 2)
//! on CitronFS, every lock scheme in one run (and, with `--read-locks shared,exclusive`, each
//! with reads taking shared range locks and exclusive ones).
//!
//! Ten data files and one log file of 10 MB, shared by every client. Each client runs one log
//! writer, ten data writers and fifty readers (threads of this process, each using its client's
//! mount — a separate `citronfs mount` process — or library instance). Readers read 8 KiB at
//! random 8 KiB-aligned offsets of a random data file; data writers write 8 KiB the same way,
//! paced at 100 writes per 1000 reads; the log writer writes 256 KiB at the log's next offset
//! (wrapping), paced at one per 3200 reads. Every 8 KiB block written carries its own checksum
//! (a header naming the writer's sequence and a crc32 of the body), and every read checks that
//! the block it got is whole: a torn read fails the run.
//!
//! The measured window starts once every thread has made one read (not counted; up to
//! `WARM_UP_TRIES` tries): the first calls of a fresh client open its connections to the data
//! servers, which a hundred threads starting together would otherwise charge to whichever
//! scheme or read-lock mode runs first.

use super::clients::{Clients, SharedFile, Via, WorkloadArgs};
use super::runner::{interrupted, Run};
use crate::report::{fmt_f, fmt_opt, Report};
use anyhow::{bail, Context, Result};
use clap::Args;
use fabric::Backend;
use hdrhistogram::Histogram;
use lockmgr::{LockMode, LockScheme};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Bytes of each data file and of the log file.
const FILE_BYTES: u64 = 10 << 20;
/// Tries of each thread's warm-up read before the measured window.
const WARM_UP_TRIES: usize = 5;
/// Data files.
const DATA_FILES: usize = 10;
/// Bytes of one read or data write.
const BLOCK: usize = 8 << 10;
/// Bytes of one log write.
const LOG_WRITE: usize = 256 << 10;
/// Threads of one client.
const READERS: usize = 50;
const DATA_WRITERS: usize = 10;
/// Data writes per 1000 reads, and reads per log write.
const WRITES_PER_1000_READS: u64 = 100;
const READS_PER_LOG_WRITE: u64 = 3200;

/// Options of `citronfs bench oltp`.
#[derive(Args, Debug)]
pub struct OltpArgs {
    /// Seconds each scheme runs.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// The fabric of the embedded cluster.
    #[arg(long, value_enum, default_value = "tcp")]
    fabric: Backend,
    #[command(flatten)]
    common: WorkloadArgs,
}

/// The result of one scheme and read-lock mode.
#[derive(Debug, Serialize)]
struct OltpResult {
    scheme: String,
    /// How reads locked their ranges (`MountOptions::read_locks`).
    read_locks: LockMode,
    /// The run's name in the table and the plot.
    #[serde(skip)]
    label: String,
    clients: usize,
    via: Via,
    fabric: &'static str,
    seconds: f64,
    reads: u64,
    data_writes: u64,
    log_writes: u64,
    /// Operations (reads, data writes and log writes) per second.
    ops_per_s: f64,
    reader_p50_us: f64,
    reader_p99_us: f64,
    writer_p99_us: f64,
    log_p99_us: f64,
    /// Throughput over citron's (with the first read-lock mode asked for).
    ops_vs_citron: Option<f64>,
    /// Reader p99 over citron's (with the first read-lock mode asked for).
    reader_p99_vs_citron: Option<f64>,
}

/// A block as a writer fills it: 8 bytes of sequence, 4 of crc32 over the rest, then bytes
/// that follow from the sequence.
fn block(seq: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    b[..8].copy_from_slice(&seq.to_le_bytes());
    let body = cluster::pattern(seq, 0, BLOCK - 12);
    b[12..].copy_from_slice(&body);
    let crc = crc32fast::hash(&b[12..]);
    b[8..12].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Whether `b` is one whole block as [`block`] makes them, or never written (zeros).
fn is_whole(b: &[u8]) -> bool {
    if b.iter().all(|&x| x == 0) {
        return true;
    }
    let crc = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
    crc == crc32fast::hash(&b[12..])
        && b[12..]
            == cluster::pattern(
                u64::from_le_bytes(b[..8].try_into().expect("8")),
                0,
                BLOCK - 12,
            )[..]
}

/// Runs the benchmark.
pub fn run(args: &OltpArgs) -> Result<()> {
    anyhow::ensure!(
        args.duration > 0.0 && args.duration.is_finite(),
        "--duration must be positive"
    );
    let per_server =
        (FILE_BYTES * (DATA_FILES as u64 + 1) * 2) / args.common.data_servers as u64 + (64 << 20);
    let cluster = args
        .common
        .start_cluster("citronfs-oltp", args.fabric, per_server)?;
    let runs = args.common.runs();
    let run = Run::start(args.common.json, runs.len() as u64)?;
    let mut results = Vec::new();
    for (scheme, reads) in runs {
        let (label, clients) = args.common.start_clients(&cluster, scheme, reads, &run)?;
        run.say(format!("{label}: running"));
        let mut r = run_scheme(args, &clients, scheme, run.stop())
            .with_context(|| format!("scheme {label}"))?;
        r.read_locks = reads;
        r.label = label;
        for f in file_names(scheme) {
            clients.remove(&f)?;
        }
        drop(clients);
        results.push(r);
        run.advance();
    }
    run.finish();
    let citron = results
        .iter()
        .find(|r| {
            r.scheme == LockScheme::CITRON.to_string() && r.read_locks == args.common.read_locks[0]
        })
        .map(|r| (r.ops_per_s, r.reader_p99_us));
    if let Some(path) = &args.common.plot {
        let groups: Vec<(String, Vec<Option<f64>>)> = results
            .iter()
            .map(|r| {
                (
                    r.label.clone(),
                    vec![Some(r.reader_p99_us), Some(r.writer_p99_us)],
                )
            })
            .collect();
        crate::plot::bars(
            path,
            &crate::plot::Bars {
                title: &format!(
                    "Filebench OLTP, {} clients ({}): p99 latency per scheme (lower is better)",
                    args.common.clients,
                    args.fabric.name()
                ),
                y_desc: "p99 latency",
                unit: crate::plot::Unit::Micros,
                series: &["reader p99".to_string(), "writer p99".to_string()],
                groups: &groups,
                base: None,
            },
        )?;
    }
    let mut report = Report::new(
        args.common.json,
        &[
            "scheme",
            "reads",
            "ops/s",
            "vs citron",
            "reader p50 µs",
            "reader p99 µs",
            "p99 vs citron",
            "writer p99 µs",
            "log p99 µs",
        ],
    );
    for mut r in results {
        if let Some((ops, p99)) = citron {
            r.ops_vs_citron = (ops > 0.0).then(|| r.ops_per_s / ops);
            r.reader_p99_vs_citron = (p99 > 0.0).then(|| r.reader_p99_us / p99);
        }
        let ratio = |x: Option<f64>| fmt_opt(x, 2);
        report.add(
            vec![
                r.scheme.clone(),
                r.read_locks.to_string(),
                format!("{:.0}", r.ops_per_s),
                ratio(r.ops_vs_citron),
                fmt_f(r.reader_p50_us, 1),
                fmt_f(r.reader_p99_us, 1),
                ratio(r.reader_p99_vs_citron),
                fmt_f(r.writer_p99_us, 1),
                fmt_f(r.log_p99_us, 1),
            ],
            &r,
        );
    }
    report.finish();
    if !args.common.json {
        println!();
        println!(
            "Filebench OLTP (CITRON §4.3.2): {} clients via {:?} on the {} fabric, each with 1 \
             log writer, {DATA_WRITERS} data writers and {READERS} readers; 10 data files and 1 \
             log file of 10 MB; 8 KiB random reads and writes ({WRITES_PER_1000_READS} writes per \
             1000 reads), a 256 KiB log write per {READS_PER_LOG_WRITE} reads; {} s per scheme. \
             Every read was checked to be a whole block. Reads locked their ranges {}{}.",
            args.common.clients,
            args.common.via,
            args.fabric.name(),
            args.duration,
            args.common
                .read_locks
                .iter()
                .map(|m| m.name())
                .collect::<Vec<_>>()
                .join(", then "),
            READS_NOTE,
        );
    }
    cluster.shutdown()
}

/// Where a shared read is not shared (`docs/SHARED_LOCKS.md`, "Through the file system").
pub(crate) const READS_NOTE: &str = " (shared where the scheme shares: CITRON, acquired \
     one-sidedly as on shm or at the meta server as on tcp; mutex, seg and server take a shared \
     read exclusively)";

fn file_names(scheme: LockScheme) -> Vec<String> {
    let mut names: Vec<String> = (0..DATA_FILES)
        .map(|i| format!("oltp-{}-data{i}", scheme.name()))
        .collect();
    names.push(format!("oltp-{}-log", scheme.name()));
    names
}

/// What one thread measured.
struct ThreadOutcome {
    role: Role,
    hist: Histogram<u64>,
    ops: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Reader,
    DataWriter,
    LogWriter,
}

/// Runs one scheme for `--duration`, or until `interrupt` is set (then fails with
/// "interrupted").
fn run_scheme(
    args: &OltpArgs,
    clients: &Clients,
    scheme: LockScheme,
    interrupt: &AtomicBool,
) -> Result<OltpResult> {
    let names = file_names(scheme);
    // The files' full size, through client 0, before anyone reads.
    {
        let zero = vec![0u8; 1 << 20];
        for name in &names {
            let f = clients.open(0, name)?;
            for off in (0..FILE_BYTES).step_by(zero.len()) {
                interrupted(interrupt)?;
                f.write_at(&zero, off)?;
            }
        }
    }
    // Each client opens every file once; its threads share the handles.
    let files: Vec<Vec<Arc<dyn SharedFile>>> = (0..clients.len())
        .map(|c| {
            names
                .iter()
                .map(|n| clients.open(c, n).map(Arc::from))
                .collect::<Result<_>>()
        })
        .collect::<Result<_>>()?;
    let reads = Arc::new(AtomicU64::new(0));
    let data_writes = Arc::new(AtomicU64::new(0));
    let log_writes = Arc::new(AtomicU64::new(0));
    let seq = Arc::new(AtomicU64::new(1));
    let stop = Arc::new(AtomicBool::new(false));
    let blocks = FILE_BYTES / BLOCK as u64;
    let log_slots = FILE_BYTES / LOG_WRITE as u64;
    let threads = files.len() * (1 + DATA_WRITERS + READERS);
    // Every thread, its warm-up read made, and this one.
    let warm = Barrier::new(threads + 1);
    let warm = &warm;
    let mut started = Instant::now();
    let outcomes: Vec<Result<ThreadOutcome>> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (c, client_files) in files.iter().enumerate() {
            let roles = std::iter::once(Role::LogWriter)
                .chain(std::iter::repeat_n(Role::DataWriter, DATA_WRITERS))
                .chain(std::iter::repeat_n(Role::Reader, READERS));
            for (t, role) in roles.enumerate() {
                let (reads, data_writes, log_writes, seq, stop) = (
                    reads.clone(),
                    data_writes.clone(),
                    log_writes.clone(),
                    seq.clone(),
                    stop.clone(),
                );
                handles.push(s.spawn(move || -> Result<ThreadOutcome> {
                    let mut rng = rand::rngs::StdRng::seed_from_u64((c * 1000 + t) as u64);
                    let mut hist = Histogram::<u64>::new(3)?;
                    let mut ops = 0;
                    let mut buf = vec![0u8; BLOCK];
                    let log = &client_files[DATA_FILES];
                    // One read outside the measurement, then wait for the others (even after
                    // a failed read: the main thread waits for everyone). A few tries: the
                    // first calls of a hundred threads connect to the data servers at once,
                    // and on tcp a connect made under a range lock fails (EIO) when the lock's
                    // lease runs out before the server answered.
                    let mut warmed = Ok(());
                    for _ in 0..WARM_UP_TRIES {
                        let file = &client_files[rng.random_range(0..DATA_FILES)];
                        let off = rng.random_range(0..blocks) * BLOCK as u64;
                        warmed = file.read_at(&mut buf, off);
                        if warmed.is_ok() {
                            break;
                        }
                    }
                    warm.wait();
                    warmed.context("the warm-up read")?;
                    while !stop.load(Ordering::Relaxed) {
                        let file = &client_files[rng.random_range(0..DATA_FILES)];
                        let off = rng.random_range(0..blocks) * BLOCK as u64;
                        let t0 = Instant::now();
                        match role {
                            Role::Reader => {
                                file.read_at(&mut buf, off)?;
                                if !is_whole(&buf) {
                                    bail!("a torn 8 KiB block read at offset {off}");
                                }
                                reads.fetch_add(1, Ordering::Relaxed);
                            }
                            Role::DataWriter => {
                                let due =
                                    reads.load(Ordering::Relaxed) * WRITES_PER_1000_READS / 1000;
                                if data_writes.load(Ordering::Relaxed) >= due {
                                    std::thread::sleep(Duration::from_micros(200));
                                    continue;
                                }
                                data_writes.fetch_add(1, Ordering::Relaxed);
                                let b = block(seq.fetch_add(1, Ordering::Relaxed));
                                file.write_at(&b, off)?;
                            }
                            Role::LogWriter => {
                                let due = reads.load(Ordering::Relaxed) / READS_PER_LOG_WRITE;
                                let n = log_writes.load(Ordering::Relaxed);
                                if n >= due {
                                    std::thread::sleep(Duration::from_micros(500));
                                    continue;
                                }
                                log_writes.fetch_add(1, Ordering::Relaxed);
                                let record = vec![(n % 251) as u8; LOG_WRITE];
                                log.write_at(&record, (n % log_slots) * LOG_WRITE as u64)?;
                            }
                        }
                        hist.record(t0.elapsed().as_nanos() as u64)?;
                        ops += 1;
                    }
                    Ok(ThreadOutcome { role, hist, ops })
                }));
            }
        }
        warm.wait();
        started = Instant::now();
        let deadline = started + Duration::from_secs_f64(args.duration);
        while Instant::now() < deadline
            && !interrupt.load(Ordering::Relaxed)
            && !handles.iter().any(|h| h.is_finished())
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a workload thread panicked"))
            })
            .collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    interrupted(interrupt)?;
    let mut hists = [
        Histogram::<u64>::new(3)?,
        Histogram::<u64>::new(3)?,
        Histogram::<u64>::new(3)?,
    ];
    let mut counts = [0u64; 3];
    for o in outcomes {
        let o = o?;
        let i = match o.role {
            Role::Reader => 0,
            Role::DataWriter => 1,
            Role::LogWriter => 2,
        };
        hists[i].add(&o.hist)?;
        counts[i] += o.ops;
    }
    let us = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    Ok(OltpResult {
        scheme: scheme.to_string(),
        read_locks: LockMode::Shared,
        label: scheme.to_string(),
        clients: args.common.clients,
        via: args.common.via,
        fabric: args.fabric.name(),
        seconds,
        reads: counts[0],
        data_writes: counts[1],
        log_writes: counts[2],
        ops_per_s: counts.iter().sum::<u64>() as f64 / seconds,
        reader_p50_us: us(&hists[0], 0.5),
        reader_p99_us: us(&hists[0], 0.99),
        writer_p99_us: us(&hists[1], 0.99),
        log_p99_us: us(&hists[2], 0.99),
        ops_vs_citron: None,
        reader_p99_vs_citron: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_whole_and_a_mixed_one_is_not() {
        let (a, b) = (block(7), block(8));
        assert!(is_whole(&a));
        assert!(is_whole(&vec![0u8; BLOCK]), "never written");
        let mut torn = a.clone();
        torn[BLOCK / 2..].copy_from_slice(&b[BLOCK / 2..]);
        assert!(!is_whole(&torn));
        let mut half_zero = a.clone();
        half_zero[4096..].fill(0);
        assert!(!is_whole(&half_zero));
    }
}
