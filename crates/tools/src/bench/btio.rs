//! `citronfs bench btio`: the NPB BT-IO output pattern (CITRON §4.3.1) on CitronFS, every
//! lock scheme in one run.
//!
//! The solution array of a class (S, W, A, B, C, D: an N×N×N grid, 5 doubles per point) is
//! written to one shared file at every output step, one step after the other. P processes sit
//! on a √P×√P grid over x and y; each owns an x-range and a y-range of every z-plane, and writes
//! each of its rows (its x-range of one (z, y) line, (N/√P)·40 bytes: 2040 to 16320 B for class
//! D) as one `pwrite` at the row's place in the array. Rows of different processes interleave in
//! the file and never overlap, so every write takes a range lock that conflicts with nobody's,
//! except where a scheme's granularity makes it (the false conflicts CITRON avoids). After the
//! last step every process reads its rows back through its own client and checks them.

use super::clients::{Clients, SharedFile, Via, WorkloadArgs};
use super::runner::Run;
use crate::report::{fmt_f, fmt_opt, Report};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use fabric::Backend;
use hdrhistogram::Histogram;
use lockmgr::{LockMode, LockScheme};
use serde::Serialize;
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// Bytes per grid point: 5 doubles.
pub const POINT: u64 = 40;

/// An NPB problem class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
pub enum Class {
    /// 12³.
    S,
    /// 24³.
    W,
    /// 64³.
    A,
    /// 102³.
    B,
    /// 162³.
    C,
    /// 408³.
    D,
}

impl Class {
    /// Grid points along each axis.
    pub const fn n(self) -> u64 {
        match self {
            Class::S => 12,
            Class::W => 24,
            Class::A => 64,
            Class::B => 102,
            Class::C => 162,
            Class::D => 408,
        }
    }
}

/// Options of `citronfs bench btio`.
#[derive(Args, Debug)]
pub struct BtioArgs {
    /// The problem class: its grid size sets the rows' length and a step's size.
    #[arg(long, value_enum, ignore_case = true, default_value = "a")]
    class: Class,
    /// Workload processes in all (threads of this process, spread round-robin over the
    /// clients); a square: 1, 4, 9, 16, ...
    #[arg(long, default_value_t = 4)]
    procs: u64,
    /// Output steps written.
    #[arg(long, default_value_t = 4)]
    steps: u64,
    /// The fabric of the embedded cluster.
    #[arg(long, value_enum, default_value = "shm")]
    fabric: Backend,
    #[command(flatten)]
    common: WorkloadArgs,
}

/// The result of one scheme and read-lock mode.
#[derive(Debug, Serialize)]
struct BtioResult {
    scheme: String,
    /// How reads (the verification's) locked their ranges (`MountOptions::read_locks`).
    read_locks: LockMode,
    /// The run's name in the table and the plot.
    #[serde(skip)]
    label: String,
    class: Class,
    procs: u64,
    clients: usize,
    via: Via,
    fabric: &'static str,
    steps: u64,
    /// Bytes written in all (every step).
    bytes: u64,
    /// Row writes in all.
    writes: u64,
    /// Bytes of every row (one write).
    row_bytes: u64,
    seconds: f64,
    mib_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    /// This run's bandwidth over citron's with the first read-lock mode asked for (that one: 1).
    vs_citron: Option<f64>,
}

/// Process `p`'s rows of output step `step`, in the order it writes them: (file offset,
/// length).
///
/// BT's multipartition decomposition (as in `false_conflicts`, CITRON §4.3.1): with `P = q²`
/// processes each axis is cut into `q` pieces of `g = n/q` points, and process `(i, j)` owns the
/// cell `((i + c) mod q, (j + c) mod q, c)` of every z-slab `c`. The array is stored x-fastest,
/// 40 bytes a point, one step after the other, so each (z, y) line of a cell is one row of
/// `g·40` bytes; a process writes its rows slab by slab, then z, then y. `q` must divide `n`.
pub fn rows_of(n: u64, q: u64, p: u64, step: u64) -> Vec<(u64, u64)> {
    debug_assert!(q >= 1 && n % q == 0 && p < q * q);
    let g = n / q;
    let (pi, pj) = (p / q, p % q);
    let base = step * n * n * n * POINT;
    let mut rows = Vec::with_capacity((q * g * g) as usize);
    for c in 0..q {
        let (ci, cj) = ((pi + c) % q, (pj + c) % q);
        for z in c * g..(c + 1) * g {
            for y in cj * g..(cj + 1) * g {
                rows.push((base + ((z * n + y) * n + ci * g) * POINT, g * POINT));
            }
        }
    }
    rows
}

/// Runs the benchmark.
pub fn run(args: &BtioArgs) -> Result<()> {
    let side = (args.procs as f64).sqrt().round() as u64;
    anyhow::ensure!(
        side >= 1 && side * side == args.procs,
        "--procs must be a square (1, 4, 9, 16, ...): BT-IO's processes sit on a square grid"
    );
    anyhow::ensure!(
        args.class.n() % side == 0,
        "class {:?}'s grid of {} points cannot be cut into √{} = {side} pieces: choose --procs \
         whose square root divides it",
        args.class,
        args.class.n(),
        args.procs
    );
    anyhow::ensure!(args.steps >= 1, "--steps must be at least 1");
    let n = args.class.n();
    let step_bytes = n * n * n * POINT;
    let file_bytes = step_bytes * args.steps;
    let per_server = (file_bytes + (64 << 20)) / args.common.data_servers as u64 + (64 << 20);
    let cluster = args
        .common
        .start_cluster("citronfs-btio", args.fabric, per_server)?;

    let runs = args.common.runs();
    let run = Run::start(args.common.json, runs.len() as u64 * args.steps)?;
    let mut results: Vec<BtioResult> = Vec::new();
    for (scheme, reads) in runs {
        let (label, clients) = args.common.start_clients(&cluster, scheme, reads, &run)?;
        let name = format!("btio-{}.dat", scheme.name());
        let mut r = run_scheme(args, &clients, &name, scheme, &run)
            .with_context(|| format!("scheme {label}"))?;
        r.read_locks = reads;
        r.label = label;
        clients.remove(&name)?;
        drop(clients);
        results.push(r);
    }
    run.finish();
    let citron = results
        .iter()
        .find(|r| {
            r.scheme == LockScheme::CITRON.to_string() && r.read_locks == args.common.read_locks[0]
        })
        .map(|r| r.mib_per_s);
    if let Some(path) = &args.common.plot {
        let groups: Vec<(String, Vec<Option<f64>>)> = results
            .iter()
            .map(|r| (r.label.clone(), vec![Some(r.mib_per_s)]))
            .collect();
        crate::plot::bars(
            path,
            &crate::plot::Bars {
                title: &format!(
                    "BT-IO class {:?}, {} processes over {} clients ({}): throughput per scheme",
                    args.class,
                    args.procs,
                    args.common.clients,
                    args.fabric.name()
                ),
                y_desc: "MiB/s",
                unit: crate::plot::Unit::Count,
                series: &["MiB/s".to_string()],
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
            "MiB/s",
            "vs citron",
            "p50 µs",
            "p99 µs",
            "writes",
        ],
    );
    for mut r in results {
        r.vs_citron = citron.filter(|&c| c > 0.0).map(|c| r.mib_per_s / c);
        report.add(
            vec![
                r.scheme.clone(),
                r.read_locks.to_string(),
                fmt_f(r.mib_per_s, 1),
                fmt_opt(r.vs_citron, 2),
                fmt_f(r.p50_us, 1),
                fmt_f(r.p99_us, 1),
                r.writes.to_string(),
            ],
            &r,
        );
    }
    report.finish();
    if !args.common.json {
        println!();
        println!(
            "BT-IO class {:?} ({n}³ points, {} KiB per step), {} steps, {} processes on a {side}x{side} \
             grid over {} client(s) via {:?}, {} fabric, {} data servers. Each row of a process \
             is one pwrite of {} B (BT's multipartition: cells of {} points a side); MiB/s counts the write phase of every step; every row was \
             read back by its writer and compared, outside the MiB/s: the run's only reads, \
             which locked their ranges {}{}.",
            args.class,
            step_bytes >> 10,
            args.steps,
            args.procs,
            args.common.clients,
            args.common.via,
            args.fabric.name(),
            args.common.data_servers,
            n / side * POINT,
            n / side,
            args.common.read_locks.iter().map(|m| m.name()).collect::<Vec<_>>().join(", then "),
            super::oltp::READS_NOTE,
        );
    }
    cluster.shutdown()
}

/// Runs every step with one scheme's clients, then verifies.
fn run_scheme(
    args: &BtioArgs,
    clients: &Clients,
    name: &str,
    scheme: LockScheme,
    run: &Run,
) -> Result<BtioResult> {
    let n = args.class.n();
    let side = (args.procs as f64).sqrt().round() as u64;
    // Each scheme's file holds its own bytes.
    let seed = scheme
        .name()
        .bytes()
        .fold(0xB710u64, |h, b| h.wrapping_mul(31) ^ u64::from(b));
    // Every process opens the file through its own client before the first step.
    let files: Vec<Arc<dyn SharedFile>> = (0..args.procs)
        .map(|p| {
            clients
                .open(p as usize % clients.len(), name)
                .map(Arc::from)
        })
        .collect::<Result<_>>()?;
    let barrier = Arc::new(Barrier::new(args.procs as usize));
    let mut hist = Histogram::<u64>::new(3)?;
    let mut writes = 0u64;
    let mut bytes = 0u64;
    let mut write_seconds = 0.0;
    for step in 0..args.steps {
        run.check()?;
        run.say(format!("{scheme}: step {}", step + 1));
        let t = Instant::now();
        let outcomes: Vec<Result<(Histogram<u64>, u64, u64)>> = std::thread::scope(|s| {
            let handles: Vec<_> = files
                .iter()
                .enumerate()
                .map(|(p, file)| {
                    let barrier = barrier.clone();
                    s.spawn(move || -> Result<(Histogram<u64>, u64, u64)> {
                        let rows = rows_of(n, side, p as u64, step);
                        let mut h = Histogram::<u64>::new(3)?;
                        let mut total = 0;
                        barrier.wait();
                        for &(off, len) in &rows {
                            run.check()?;
                            let buf = cluster::pattern(seed, off, len as usize);
                            let t = Instant::now();
                            file.write_at(&buf, off)
                                .with_context(|| format!("process {p}: row at {off}"))?;
                            h.record(t.elapsed().as_nanos() as u64)?;
                            total += len;
                        }
                        Ok((h, rows.len() as u64, total))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| bail!("a workload thread panicked"))
                })
                .collect()
        });
        write_seconds += t.elapsed().as_secs_f64();
        for o in outcomes {
            let (h, w, b) = o?;
            hist.add(&h)?;
            writes += w;
            bytes += b;
        }
        run.advance();
    }

    run.check()?;
    run.say(format!("{scheme}: verifying"));
    let verified: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(p, file)| {
                s.spawn(move || -> Result<()> {
                    for step in 0..args.steps {
                        run.check()?;
                        verify_rows(file.as_ref(), &rows_of(n, side, p as u64, step), seed)
                            .with_context(|| format!("process {p}, step {step}"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a verifying thread panicked"))
            })
            .collect()
    });
    for v in verified {
        v?;
    }
    drop(files);
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    Ok(BtioResult {
        scheme: scheme.to_string(),
        read_locks: LockMode::Shared,
        label: scheme.to_string(),
        class: args.class,
        procs: args.procs,
        clients: args.common.clients,
        via: args.common.via,
        fabric: args.fabric.name(),
        steps: args.steps,
        bytes,
        writes,
        row_bytes: n / side * POINT,
        seconds: write_seconds,
        mib_per_s: bytes as f64 / (1u64 << 20) as f64 / write_seconds,
        p50_us: us(0.5),
        p99_us: us(0.99),
        vs_citron: None,
    })
}

/// Reads `rows` back through `file` and checks that each holds what the writer wrote.
fn verify_rows(file: &dyn SharedFile, rows: &[(u64, u64)], seed: u64) -> Result<()> {
    for &(off, len) in rows {
        let mut buf = vec![0u8; len as usize];
        file.read_at(&mut buf, off)?;
        if buf != cluster::pattern(seed, off, len as usize) {
            bail!("the row at {off} ({len} B) does not hold what was written");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A file in memory.
    struct MemFile(Mutex<Vec<u8>>);

    impl SharedFile for MemFile {
        fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
            let mut v = self.0.lock().unwrap();
            let end = offset as usize + buf.len();
            if v.len() < end {
                v.resize(end, 0);
            }
            v[offset as usize..end].copy_from_slice(buf);
            Ok(())
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            let v = self.0.lock().unwrap();
            buf.copy_from_slice(&v[offset as usize..offset as usize + buf.len()]);
            Ok(())
        }
    }

    #[test]
    fn verification_catches_a_row_that_does_not_hold_its_bytes() {
        let file = MemFile(Mutex::new(Vec::new()));
        let rows = rows_of(12, 2, 3, 0);
        for &(off, len) in &rows {
            file.write_at(&cluster::pattern(9, off, len as usize), off)
                .unwrap();
        }
        verify_rows(&file, &rows, 9).unwrap();
        assert!(
            verify_rows(&file, &rows, 10).is_err(),
            "another seed's bytes"
        );
        let (off, _) = rows[5];
        file.0.lock().unwrap()[off as usize + 7] ^= 1;
        let err = verify_rows(&file, &rows, 9).unwrap_err().to_string();
        assert!(err.contains(&format!("at {off}")), "{err}");
    }

    #[test]
    fn the_processes_rows_tile_every_step_exactly_once() {
        for (n, procs) in [
            (12u64, 4u64),
            (12, 9),
            (24, 16),
            (12, 1),
            (102, 4),
            (408, 64),
        ] {
            let side = (procs as f64).sqrt() as u64;
            for step in 0..2 {
                let mut rows: Vec<(u64, u64)> =
                    (0..procs).flat_map(|p| rows_of(n, side, p, step)).collect();
                rows.sort();
                let base = step * n * n * n * POINT;
                let mut at = base;
                for (off, len) in rows {
                    assert_eq!(off, at, "n {n}, {procs} procs: a gap or an overlap");
                    at += len;
                }
                assert_eq!(at, base + n * n * n * POINT);
            }
        }
    }

    #[test]
    fn class_d_rows_span_the_papers_range() {
        // The CITRON paper, §4.3.1: 2040 B to 16320 B for class D.
        let len = |procs: u64| {
            let side = (procs as f64).sqrt() as u64;
            rows_of(Class::D.n(), side, 0, 0)[0].1
        };
        assert_eq!(len(1), 16320);
        assert_eq!(len(64), 2040);
    }
}
