//! `citronfs bench fabric`: what one verb costs on each backend.
//!
//! For every backend and thread count it measures, in one run:
//! - the round-trip time of an 8-byte read (p50, p99 from an HDR histogram), every thread posting
//!   one read at a time;
//! - batched throughput: every thread posts batches of `--batch` 8-byte reads, verbs per second;
//! - connect time (p50, p99): one thread opens `--connects` endpoints one after another, each
//!   until it is ready for its first verb (for `tcp`: TCP connect and the handshake), and closes
//!   each before the next.
//!
//! As the reference for `tcp`, the same run measures a bare TCP ping-pong on loopback that sends
//! and receives messages of exactly the sizes the tcp backend's frames have for those batches.

use crate::report::{fmt_f, Report};
use anyhow::{anyhow, Context, Result};
use clap::Args;
use fabric::{Batch, Completions, Connector, Endpoint, RegionId, RemoteAddr};
use hdrhistogram::Histogram;
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

const REGION: RegionId = RegionId(1);
const REGION_LEN: u64 = 1 << 20;
const CLUSTER: &str = "bench";
const TOKEN: &str = "bench-token";

/// Options of `citronfs bench fabric`.
#[derive(Args, Debug)]
pub struct FabricArgs {
    /// Backends to measure (comma-separated): mem, shm, tcp, tcp-bare.
    #[arg(long, value_delimiter = ',', default_value = "mem,shm,tcp,tcp-bare")]
    backends: Vec<String>,
    /// Thread counts to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    threads: Vec<usize>,
    /// 8-byte reads per thread for the round-trip histogram.
    #[arg(long, default_value_t = 20_000)]
    samples: u64,
    /// Verbs per batch for the throughput measurement.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Seconds of batched traffic per throughput measurement.
    #[arg(long, default_value_t = 1.0)]
    duration: f64,
    /// Endpoints opened one after another for the connect-time histogram.
    #[arg(long, default_value_t = 200)]
    connects: u64,
    /// Print one JSON object per result instead of a table.
    #[arg(long)]
    json: bool,
}

/// One result line.
#[derive(Serialize)]
struct FabricResult {
    backend: String,
    threads: usize,
    rtt_p50_us: f64,
    rtt_p99_us: f64,
    verbs_per_s: f64,
    batch: usize,
    round_trips_per_s: f64,
    connect_p50_us: f64,
    connect_p99_us: f64,
    masked_atomics: String,
}

/// Runs the benchmark.
pub fn run(args: &FabricArgs) -> Result<()> {
    let mut report = Report::new(
        args.json,
        &[
            "backend",
            "threads",
            "rtt p50 µs",
            "rtt p99 µs",
            "verbs/s",
            "batch",
            "connect p50 µs",
            "connect p99 µs",
            "masked atomics",
        ],
    );
    for backend in &args.backends {
        for &threads in &args.threads {
            let result = match backend.as_str() {
                "tcp-bare" => bare_tcp(args, threads)?,
                name => {
                    let served = start(name)?;
                    measure(name, &*served.connector, args, threads)?
                }
            };
            report.add(
                vec![
                    result.backend.clone(),
                    result.threads.to_string(),
                    fmt_f(result.rtt_p50_us, 2),
                    fmt_f(result.rtt_p99_us, 2),
                    format!("{:.0}", result.verbs_per_s),
                    result.batch.to_string(),
                    fmt_f(result.connect_p50_us, 1),
                    fmt_f(result.connect_p99_us, 1),
                    result.masked_atomics.clone(),
                ],
                &result,
            );
        }
    }
    report.finish();
    Ok(())
}

/// A server of one backend holding the benchmark region, a connector to it, and its private
/// shm directory (removed after the server).
struct Served {
    connector: std::sync::Arc<dyn Connector>,
    _server: fabric::FabricServer,
    _dir: tempfile::TempDir,
}

/// Starts a server of backend `name` holding the benchmark region, through the fabric's one
/// seam ([`fabric::serve`]).
fn start(name: &str) -> Result<Served> {
    let backend: fabric::Backend = name.parse().map_err(|e| anyhow!("{e} (or tcp-bare)"))?;
    let dir = tempfile::Builder::new()
        .prefix("citronfs-bench-fabric-")
        .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm"
        } else {
            "/tmp"
        })
        .context("create the shm directory")?;
    let at = backend.serve_at(
        dir.path().join("server"),
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let server = fabric::serve(&at, &fabric::Credentials::new(CLUSTER, TOKEN))?;
    server.register(REGION, REGION_LEN, &fabric::Backing::Memory)?;
    Ok(Served {
        connector: server.connector()?,
        _server: server,
        _dir: dir,
    })
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// Each thread reads its own word, so threads contend for the server, not for a word.
fn thread_addr(thread: usize, i: usize) -> RemoteAddr {
    RemoteAddr::new(REGION, ((thread * 4096 + i * 8) as u64) % REGION_LEN)
}

/// The time `connect` takes, `count` times one after another (each result dropped before the
/// next): p50 and p99 in µs.
fn connect_time<T>(count: u64, mut connect: impl FnMut() -> Result<T>) -> Result<(f64, f64)> {
    let mut hist = new_histogram();
    for _ in 0..count.max(1) {
        let start = Instant::now();
        let connected = connect()?;
        hist.record(start.elapsed().as_nanos().max(1) as u64)?;
        drop(connected);
    }
    Ok((
        hist.value_at_quantile(0.5) as f64 / 1000.0,
        hist.value_at_quantile(0.99) as f64 / 1000.0,
    ))
}

fn measure(
    name: &str,
    connector: &dyn Connector,
    args: &FabricArgs,
    threads: usize,
) -> Result<FabricResult> {
    let (connect_p50_us, connect_p99_us) =
        connect_time(args.connects, || Ok(connector.connect()?))?;
    let mut endpoints: Vec<Box<dyn Endpoint>> = (0..threads)
        .map(|_| connector.connect())
        .collect::<Result<_, _>>()?;
    let masked = format!("{:?}", endpoints[0].capabilities().masked_atomics);

    // Round-trip time: one 8-byte read at a time, all threads at once.
    let rtt = fabric::measure_rtt_under_load(
        connector,
        thread_addr(0, 0),
        threads,
        args.samples as usize,
    )?;

    // Batched throughput.
    let duration = Duration::from_secs_f64(args.duration);
    let batch_len = args.batch;
    let verbs = thread::scope(|s| {
        let handles: Vec<_> = endpoints
            .iter_mut()
            .enumerate()
            .map(|(t, ep)| {
                s.spawn(move || -> Result<u64> {
                    let mut batch = Batch::new();
                    for i in 0..batch_len {
                        batch.read(thread_addr(t, i), 8);
                    }
                    let mut out = Completions::new();
                    let start = Instant::now();
                    let mut done = 0u64;
                    while start.elapsed() < duration {
                        for _ in 0..16 {
                            ep.execute(&batch, &mut out)?;
                        }
                        done += 16 * batch_len as u64;
                    }
                    Ok(done)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .sum::<Result<u64>>()
    })?;
    let verbs_per_s = verbs as f64 / duration.as_secs_f64();
    Ok(FabricResult {
        backend: name.to_string(),
        threads,
        rtt_p50_us: rtt.p50.as_secs_f64() * 1e6,
        rtt_p99_us: rtt.p99.as_secs_f64() * 1e6,
        verbs_per_s,
        batch: args.batch,
        round_trips_per_s: verbs_per_s / args.batch as f64,
        connect_p50_us,
        connect_p99_us,
        masked_atomics: masked,
    })
}

/// The reference: a bare TCP ping-pong on loopback (blocking sockets, TCP_NODELAY, one thread per
/// connection on the server) whose messages have the tcp backend's frame sizes for the same
/// batches, so the difference to `tcp` is what the verb protocol itself costs.
fn bare_tcp(args: &FabricArgs, threads: usize) -> Result<FabricResult> {
    let mut one = Batch::new();
    one.read(thread_addr(0, 0), 8);
    let mut many = Batch::new();
    for i in 0..args.batch {
        many.read(thread_addr(0, i), 8);
    }
    let sizes = [tcp_frame_sizes(&one), tcp_frame_sizes(&many)];

    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let acceptor = {
        let stop = stop.clone();
        thread::spawn(move || {
            for stream in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(mut stream) = stream else { continue };
                thread::spawn(move || {
                    let _ = stream.set_nodelay(true);
                    let mut buf = vec![0u8; 1 << 16];
                    // The client announces each message's sizes in its first 8 bytes.
                    loop {
                        let mut head = [0u8; 8];
                        if stream.read_exact(&mut head).is_err() {
                            return;
                        }
                        let req = u32::from_le_bytes(head[..4].try_into().expect("4")) as usize;
                        let rep = u32::from_le_bytes(head[4..].try_into().expect("4")) as usize;
                        buf.resize(req.max(rep).max(8), 0);
                        if stream.read_exact(&mut buf[..req - 8]).is_err()
                            || stream.write_all(&buf[..rep]).is_err()
                        {
                            return;
                        }
                    }
                });
            }
        })
    };

    let ping =
        |stream: &mut TcpStream, (req, rep): (usize, usize), buf: &mut Vec<u8>| -> Result<()> {
            buf.resize(req.max(rep).max(8), 0);
            buf[..4].copy_from_slice(&(req as u32).to_le_bytes());
            buf[4..8].copy_from_slice(&(rep as u32).to_le_bytes());
            stream.write_all(&buf[..req])?;
            stream.read_exact(&mut buf[..rep])?;
            Ok(())
        };
    // Connect time: a TCP connect and the first (smallest) message's round trip, the bare
    // counterpart of a connect and its handshake.
    let (connect_p50_us, connect_p99_us) = connect_time(args.connects, || {
        let mut stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        ping(&mut stream, sizes[0], &mut Vec::new())?;
        Ok(stream)
    })?;
    let duration = Duration::from_secs_f64(args.duration);
    let samples = args.samples;
    let per_thread = thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || -> Result<(Histogram<u64>, u64)> {
                    let mut stream = TcpStream::connect(addr)?;
                    stream.set_nodelay(true)?;
                    let mut buf = Vec::new();
                    let mut hist = new_histogram();
                    for _ in 0..samples / 10 {
                        ping(&mut stream, sizes[0], &mut buf)?;
                    }
                    for _ in 0..samples {
                        let start = Instant::now();
                        ping(&mut stream, sizes[0], &mut buf)?;
                        hist.record(start.elapsed().as_nanos().max(1) as u64)?;
                    }
                    let start = Instant::now();
                    let mut messages = 0u64;
                    while start.elapsed() < duration {
                        ping(&mut stream, sizes[1], &mut buf)?;
                        messages += 1;
                    }
                    Ok((hist, messages))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .collect::<Result<Vec<_>>>()
    })?;
    stop.store(true, Ordering::SeqCst);
    let _ = TcpStream::connect(addr); // wake the acceptor so it sees `stop`
    let _ = acceptor.join();

    let mut rtt = new_histogram();
    let mut messages = 0;
    for (h, m) in &per_thread {
        rtt.add(h)?;
        messages += m;
    }
    let verbs_per_s = (messages * args.batch as u64) as f64 / duration.as_secs_f64();
    Ok(FabricResult {
        backend: "tcp-bare".into(),
        threads,
        rtt_p50_us: rtt.value_at_quantile(0.5) as f64 / 1000.0,
        rtt_p99_us: rtt.value_at_quantile(0.99) as f64 / 1000.0,
        verbs_per_s,
        batch: args.batch,
        round_trips_per_s: messages as f64 / duration.as_secs_f64(),
        connect_p50_us,
        connect_p99_us,
        masked_atomics: "-".into(),
    })
}

/// The sizes in bytes of the tcp backend's request and reply frames for `batch`.
fn tcp_frame_sizes(batch: &Batch) -> (usize, usize) {
    let mut request = Vec::new();
    fabric::tcp::wire::encode_batch(&mut request, batch);
    let mut out = Completions::new();
    out.reset_for(batch);
    for verb in batch.verbs() {
        match verb {
            fabric::Verb::Read { len, .. } => {
                out.push_read(*len as usize);
            }
            fabric::Verb::Write { .. } | fabric::Verb::Flush { .. } => {}
            _ => out.push_old(0),
        }
    }
    let mut reply = Vec::new();
    fabric::tcp::wire::encode_completions(&mut reply, &out);
    let header = fabric::frame::HEADER_LEN;
    (header + request.len(), header + reply.len())
}
