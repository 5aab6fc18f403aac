//! `citronfs bench locks`: the range-lock microbenchmark of CITRON §4.2 (Figures 6 and 7).
//!
//! Every selected scheme runs in the same process, one after the other, on the same fabric
//! backend: threads acquire and release in a closed loop, each request a range of `L` units
//! whose left border is Zipf(α)-distributed over `[0, N − L]` (the hot spots are the low
//! addresses, as in the paper; α = 0 is uniform). With `--mixed`, the threads are split evenly
//! over `L ∈ {1, 16, 256}`. The acquire latency goes into an HDR histogram; the lock statistics
//! give the abort rate and the round trips per acquire and per release; `getrusage` gives the CPU
//! time the whole process spent per operation, so that waiting which burns cores shows up.
//!
//! With `--read-ratio R`, a fraction `R` of the acquisitions are reads, taken in shared mode
//! (`lockmgr::LockMode::Shared`) by the schemes that have it (CITRON, `server`) and exclusively
//! by the others. A scheme name may carry a suffix: `-shared` (the same, named so in the
//! results) or `-exclusive` (reads taken exclusively: the scheme as it was without a shared
//! mode), so `--scheme citron-shared,citron-exclusive,server-shared` compares them in one run.
//! Which acquisitions are reads is drawn from each thread's own stream, the same for every
//! scheme; `--read-ratio 0` (the default) draws nothing and runs what it always ran. The
//! acquisitions drawn as reads and those drawn as writes get a p99 each (`read p99`,
//! `write p99`; `read_p99_us`, `write_p99_us` in `--json`): what sharing costs the writers.
//!
//! The `server` scheme's lock server runs in this process on TCP loopback (its own threads),
//! whatever the backend: its CPU time is in the per-operation figure too. With `--backend tcp`
//! the fabric's software NIC also runs in this process.

use super::runner::Run;
use anyhow::{anyhow, bail, Context, Result};
use fabric::{Backend, Backing, Connector, Credentials, FabricServer, RegionId, RemoteAddr};
use hdrhistogram::Histogram;
use lockmgr::baselines::SegSpec;
use lockmgr::citron::{hosted, CitronConfig, CitronHost, CitronSpec, Hosting};
use lockmgr::schemes::{self, CreateOptions, FixedMemory};
use lockmgr::{AbortCounts, LockMode, LockScheme, LockStats, RangeLock};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// The schemes this benchmark can run, in the order it runs them by default: every scheme
/// ([`LockScheme::PLAIN`]), by name.
pub fn available_schemes() -> Vec<&'static str> {
    LockScheme::PLAIN.iter().map(LockScheme::name).collect()
}

/// Range sizes of the mixed workload (CITRON §4.2, Figure 7): a third of the threads each.
const MIXED_SIZES: [u64; 3] = [1, 16, 256];

/// Most lock words a `seg` instance gets (32 MiB); segments beyond wrap onto them.
pub(crate) const MAX_SEGMENTS: u64 = 1 << 22;

/// The region holding the scheme's shared state.
pub(crate) const LOCK_REGION: RegionId = RegionId(1);

/// Options of `citronfs bench locks`.
#[derive(clap::Args, Clone, Debug)]
pub struct LocksArgs {
    /// Schemes to compare (comma-separated): citron, citron-nofastpath, mutex, seg, server.
    /// Default: every scheme available in this build.
    #[arg(long, value_delimiter = ',')]
    pub scheme: Vec<String>,
    /// Range size L, in lock units.
    #[arg(long, default_value_t = 16, conflicts_with = "mixed")]
    pub range: u64,
    /// Mixed range sizes: the threads are split evenly over L = 1, 16 and 256.
    #[arg(long)]
    pub mixed: bool,
    /// Zipf exponent of the left borders (0: uniform).
    #[arg(long, default_value_t = 0.9)]
    pub alpha: f64,
    /// Size N of the locked address space, in units.
    #[arg(long, default_value_t = 1 << 28)]
    pub units: u64,
    /// Thread counts to run (comma-separated); each is one result per scheme.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub threads: Vec<usize>,
    /// Seconds each (scheme, thread count) runs.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Fabric backend.
    #[arg(long, value_enum, default_value_t = Backend::Mem)]
    pub backend: Backend,
    /// Segment size of the `seg` scheme, in units. Default: the range size ("SS-Exact"), or 16
    /// with --mixed.
    #[arg(long)]
    pub seg_size: Option<u64>,
    /// CITRON's `T_wait` in µs (CITRON §3.5.5); by default it is derived from the
    /// 90th-percentile round trip measured under load (2 threads per core) before the run,
    /// along the clients' path: the fabric's, or the host's own memory when they acquire at
    /// the host (`--citron-hosting`). A
    /// smaller `T_wait` makes inequality (1) abort more; a larger one makes non-leaf requests
    /// wait longer in phase (d).
    #[arg(long)]
    pub t_wait_us: Option<u64>,
    /// Where CITRON clients acquire: `auto` at the lock tree's host when the fabric's server
    /// executes every verb anyway (tcp: one round trip per acquire, the release posted
    /// without one, the host running the same protocol on the same words; `T_wait` then comes
    /// from the host's own memory), one-sided otherwise; `never`: always one-sided;
    /// `always`: always at the host (fails where the fabric cannot).
    #[arg(long, value_enum, default_value_t = CitronHostingArg::Auto)]
    pub citron_hosting: CitronHostingArg,
    /// Fraction of acquisitions that are reads (shared where the scheme has a shared mode,
    /// see the module docs), 0 to 1.
    #[arg(long, default_value_t = 0.0)]
    pub read_ratio: f64,
    /// Print one JSON object per result instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// How a scheme name's suffix says reads are taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reads {
    /// Shared where the scheme has a shared mode (no suffix, or `-shared`).
    Shared,
    /// Exclusive (`-exclusive`).
    Exclusive,
}

/// A scheme name split into the plain scheme and how it takes reads.
fn split_name(name: &str) -> (&str, Reads) {
    if let Some(base) = name.strip_suffix("-exclusive") {
        (base, Reads::Exclusive)
    } else if let Some(base) = name.strip_suffix("-shared") {
        (base, Reads::Shared)
    } else {
        (name, Reads::Shared)
    }
}

/// `--citron-hosting` ([`lockmgr::citron::Hosting`]).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CitronHostingArg {
    /// At the host where it pays (tcp), one-sided elsewhere.
    Auto,
    /// Always one-sided.
    Never,
    /// Always at the host.
    Always,
}

impl CitronHostingArg {
    fn hosting(self) -> Hosting {
        match self {
            CitronHostingArg::Auto => Hosting::Auto,
            CitronHostingArg::Never => Hosting::Never,
            CitronHostingArg::Always => Hosting::Always,
        }
    }
}

/// One benchmark result: a scheme at a thread count.
#[derive(Clone, Debug, Serialize)]
pub struct LocksResult {
    /// The scheme's name.
    pub scheme: String,
    /// The fabric backend.
    pub backend: &'static str,
    /// Client threads.
    pub threads: usize,
    /// The range size, or `mixed`.
    pub range: String,
    /// The address space, in units.
    pub units: u64,
    /// The Zipf exponent.
    pub alpha: f64,
    /// The `seg` segment size, for `seg`.
    pub seg_size: Option<u64>,
    /// Seconds measured.
    pub seconds: f64,
    /// Locks granted (and released).
    pub ops: u64,
    /// Locks granted per second.
    pub ops_per_s: f64,
    /// Median acquire latency, µs.
    pub p50_us: f64,
    /// 99th-percentile acquire latency, µs.
    pub p99_us: f64,
    /// Longest acquire, µs.
    pub max_us: f64,
    /// 99th-percentile acquire latency of the acquisitions drawn as reads, µs (none at
    /// `--read-ratio 0`).
    pub read_p99_us: Option<f64>,
    /// 99th-percentile acquire latency of the acquisitions drawn as writes, µs (none at
    /// `--read-ratio 1`): what readers cost the writers that wait for them.
    pub write_p99_us: Option<f64>,
    /// Aborted attempts per acquisition.
    pub abort_rate: f64,
    /// Round trips per acquisition.
    pub rtts_per_acquire: f64,
    /// Round trips per release.
    pub rtts_per_release: f64,
    /// Verbs per acquisition.
    pub verbs_per_acquire: f64,
    /// CPU time (user + system, the whole process) per lock, µs.
    pub cpu_us_per_op: f64,
    /// CITRON's `T_wait`, µs (given with `--t-wait-us`, or derived from the round trip under
    /// load); none for the baselines.
    pub t_wait_us: Option<f64>,
    /// Aborted attempts by cause (CITRON; zero for the baselines).
    pub aborts: AbortCounts,
    /// Share of acquisitions that completed on the fast path without waiting (CITRON).
    pub fast_path_rate: f64,
    /// Leaf requests escalated to the parent to avoid starvation (CITRON, §3.5.4).
    pub starvation_escalations: u64,
    /// CITRON: every acquisition ran at the lock tree's host (`--citron-hosting`).
    pub hosted: bool,
    /// Fraction of acquisitions that were reads (`--read-ratio`).
    pub read_ratio: f64,
    /// How reads were taken: `shared` or `exclusive` (the scheme's modes and the name's
    /// suffix).
    pub reads: &'static str,
}

/// Runs the benchmark and prints its results.
pub fn run(args: &LocksArgs) -> Result<()> {
    let schemes = select_schemes(args)?;
    if args.threads.is_empty() || args.threads.contains(&0) {
        bail!("--threads needs positive thread counts");
    }
    let max_range = if args.mixed {
        *MIXED_SIZES.iter().max().expect("non-empty")
    } else {
        args.range
    };
    if args.range == 0 {
        bail!("--range must be at least 1");
    }
    if args.units < max_range {
        bail!(
            "--units ({}) must be at least the range size ({max_range})",
            args.units
        );
    }
    if !(args.alpha >= 0.0 && args.alpha.is_finite()) {
        bail!("--alpha must be a finite number >= 0");
    }
    if !(args.duration > 0.0 && args.duration.is_finite()) {
        bail!("--duration must be positive");
    }
    if !(0.0..=1.0).contains(&args.read_ratio) {
        bail!("--read-ratio must be between 0 and 1");
    }

    let total = (schemes.len() * args.threads.len()) as u64;
    let run = Run::in_process(args.json, total);
    let mut results = Vec::new();
    for name in &schemes {
        for &threads in &args.threads {
            run.say(format!("{name}, {threads} threads"));
            let result = run_one(args, name, threads)
                .with_context(|| format!("{name} with {threads} threads"))?;
            if args.json {
                println!("{}", serde_json::to_string(&result)?);
            }
            results.push(result);
            run.advance();
        }
    }
    run.finish();
    if !args.json {
        print_table(&results);
    }
    Ok(())
}

fn select_schemes(args: &LocksArgs) -> Result<Vec<String>> {
    let available = available_schemes();
    if args.scheme.is_empty() {
        return Ok(available.iter().map(|s| s.to_string()).collect());
    }
    for name in &args.scheme {
        if !available.contains(&split_name(name).0) {
            bail!("unknown scheme {name:?} (available: {available:?}, each optionally with -shared or -exclusive)");
        }
    }
    Ok(args.scheme.clone())
}

fn seg_size(args: &LocksArgs) -> u64 {
    args.seg_size
        .unwrap_or(if args.mixed { 16 } else { args.range })
        .max(1)
}

fn scheme_kind(args: &LocksArgs, name: &str) -> Result<LockScheme> {
    let name = split_name(name).0;
    let plain: LockScheme = name.parse()?;
    Ok(match plain {
        LockScheme::Mutex | LockScheme::Server => plain,
        // T_wait given, or (0) measured once the fabric is up (`run_one`).
        LockScheme::Citron(_) => citron_kind(args, name, args.t_wait_us.unwrap_or(0)),
        LockScheme::Seg(_) => {
            let segment_units = seg_size(args);
            LockScheme::Seg(SegSpec {
                segment_units,
                segments: args.units.div_ceil(segment_units).clamp(1, MAX_SEGMENTS),
            })
        }
    })
}

/// CITRON with `T_wait` given (0: measured by `create`). The tree covers N from the start
/// (CITRON §4.1: N = 2^28), so no scale-up happens.
fn citron_kind(args: &LocksArgs, name: &str, t_wait_us: u64) -> LockScheme {
    LockScheme::Citron(CitronSpec {
        unit_count: args.units,
        max_unit_count: args.units,
        t_wait_us,
        ..CitronSpec::plain(name == "citron")
    })
}

/// The fabric a run uses; kept alive until the run ends.
pub(crate) struct Fabric {
    connector: Arc<dyn Connector>,
    /// The server's memory as a procedure at the server reaches it.
    host_connector: Arc<dyn Connector>,
    /// Whether the server runs procedures: CITRON clients may then acquire at the host.
    runs_procedures: bool,
    _server: FabricServer,
    /// The shm backend's region directory, removed after the server.
    _dir: tempfile::TempDir,
}

impl Fabric {
    pub(crate) fn start(backend: Backend, region_bytes: u64) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("citronfs-bench-locks-")
            .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() {
                "/dev/shm"
            } else {
                "/tmp"
            })
            .context("create the shm directory")?;
        let token = format!("{:016x}", rand::rng().random::<u64>());
        let at = backend.serve_at(
            dir.path().join("server"),
            SocketAddr::from(([127, 0, 0, 1], 0)),
        );
        let server = fabric::serve(&at, &Credentials::new("bench", token))?;
        server.register(LOCK_REGION, region_bytes.max(8), &Backing::Memory)?;
        if server.runs_procedures() {
            // CITRON clients may acquire at the host (`--citron-hosting`).
            server.register_procedure(hosted::PROCEDURE, Arc::new(CitronHost::new()))?;
        }
        Ok(Fabric {
            connector: server.connector()?,
            host_connector: server.host_connector()?,
            runs_procedures: server.runs_procedures(),
            _server: server,
            _dir: dir,
        })
    }

    pub(crate) fn connector(&self) -> &dyn Connector {
        &*self.connector
    }

    /// CITRON's `T_wait` for the lock at [`LOCK_REGION`] when its clients acquire as `hosting`
    /// says: from round trips under load (`lockmgr::citron::t_wait_under_load`) along the path
    /// their conflicting phases take — the host's own memory when they acquire at the host
    /// (a fabric that runs procedures, tcp, where `start` offers the procedure), the fabric
    /// otherwise.
    ///
    /// Why not always the fabric's: inequality (1) (§3.5.5) bounds the time between a
    /// client's phase-(b) read and its leaf lock, and a hosted client makes both at the host.
    /// Sized for the tcp round trip instead (827 µs measured on the 2-core machine), every
    /// non-leaf grant waited that long in phase (d) for nothing: `bench locks --backend tcp
    /// --mixed` ran at 0.8–1.1× the lock server against 1.3–1.5× with 15–50 µs, at the same
    /// abort rate.
    ///
    /// Only for a tree every client of which acquires as `hosting` says (a benchmark's): a
    /// one-sided client on a tree sized for the host aborts every attempt that is not a fast
    /// path, for ever — which is why the file system's meta server sizes its trees for the
    /// fabric (`meta-server`'s `measure_t_wait`). `shape`: the tree's (its tallest height and
    /// `m` count where masked atomics are emulated: `CitronConfig::t_wait_round_trips`).
    pub(crate) fn t_wait(&self, hosting: Hosting, shape: &CitronConfig) -> Result<Duration> {
        let hosted = match hosting {
            Hosting::Never => false,
            Hosting::Auto => self.runs_procedures,
            Hosting::Always => true,
        };
        let connector = if hosted {
            &*self.host_connector
        } else {
            &*self.connector
        };
        let (t_wait, rtt) =
            lockmgr::citron::t_wait_under_load(connector, RemoteAddr::new(LOCK_REGION, 0), shape)?;
        tracing::info!(
            ?rtt,
            ?t_wait,
            hosted,
            "CITRON T_wait from the round trip under load"
        );
        Ok(t_wait)
    }
}

/// What one client thread measured.
struct ThreadResult {
    /// Acquire latencies of the acquisitions drawn as reads, and of those drawn as writes.
    by_kind: [Histogram<u64>; 2],
    stats: LockStats,
    ops: u64,
}

/// Draws left borders: Zipf(α) over `[0, units − range]`, or uniform for α = 0.
struct Borders {
    max_start: u64,
    zipf: Option<Zipf<f64>>,
}

impl Borders {
    fn new(units: u64, range: u64, alpha: f64) -> Result<Self> {
        let max_start = units - range;
        let zipf = if alpha > 0.0 {
            Some(
                Zipf::new(max_start as f64 + 1.0, alpha)
                    .map_err(|e| anyhow!("Zipf({alpha}) over {} borders: {e}", max_start + 1))?,
            )
        } else {
            None
        };
        Ok(Self { max_start, zipf })
    }

    fn sample(&self, rng: &mut SmallRng) -> u64 {
        match &self.zipf {
            // Zipf draws are ranks in [1, n]; rank 1 is the hottest border, 0.
            Some(zipf) => (zipf.sample(rng) as u64)
                .saturating_sub(1)
                .min(self.max_start),
            None => rng.random_range(0..=self.max_start),
        }
    }
}

fn run_one(args: &LocksArgs, name: &str, threads: usize) -> Result<LocksResult> {
    let (plain, reads) = split_name(name);
    let mut kind = scheme_kind(args, name)?;
    let read_mode = if reads == Reads::Shared && kind.modes().contains(&LockMode::Shared) {
        LockMode::Shared
    } else {
        LockMode::Exclusive
    };
    let options = CreateOptions::default();
    let region_bytes = kind.resolve(&options)?.region_bytes()?;
    let fabric = Fabric::start(args.backend, region_bytes)?;
    // CITRON's T_wait: given, or derived from this fabric's round trip under load.
    let t_wait = match (kind.is_citron(), args.t_wait_us) {
        (false, _) => None,
        (true, Some(us)) => Some(Duration::from_micros(us)),
        (true, None) => {
            let LockScheme::Citron(spec) = kind.resolve(&options)? else {
                bail!("{name}: not a CITRON scheme")
            };
            let t_wait = fabric.t_wait(args.citron_hosting.hosting(), &spec.config())?;
            kind = citron_kind(args, plain, t_wait.as_micros().max(1) as u64);
            Some(t_wait)
        }
    };
    let created = schemes::create(
        &kind,
        &options,
        &mut FixedMemory::new(
            &mut *fabric.connector().connect()?,
            RemoteAddr::new(LOCK_REGION, 0),
            region_bytes,
        ),
    )?;
    let mut open_options = created.open_options();
    open_options.citron.hosting = args.citron_hosting.hosting();

    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(threads + 1));
    let mut workers = Vec::with_capacity(threads);
    for t in 0..threads {
        let range = if args.mixed {
            MIXED_SIZES[t % MIXED_SIZES.len()]
        } else {
            args.range
        };
        let borders = Borders::new(args.units, range, args.alpha)?;
        let lock = schemes::open(&created.lock, fabric.connector(), &open_options)?;
        let (stop, start) = (stop.clone(), start.clone());
        let reads = (args.read_ratio, read_mode);
        workers.push(
            std::thread::Builder::new()
                .name(format!("bench-locks-{t}"))
                .spawn(move || client(lock, borders, range, reads, t as u64, &stop, &start))?,
        );
    }

    start.wait();
    let cpu_before = cpu_time();
    let began = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(args.duration));
    stop.store(true, Ordering::Relaxed);
    let mut by_kind = [new_histogram(), new_histogram()];
    let mut stats = LockStats::default();
    let mut ops = 0;
    let mut failure = None;
    for worker in workers {
        match worker.join() {
            Ok(Ok(result)) => {
                for (into, from) in by_kind.iter_mut().zip(&result.by_kind) {
                    into.add(from)
                        .map_err(|e| anyhow!("merge histograms: {e:?}"))?;
                }
                stats.merge(&result.stats);
                ops += result.ops;
            }
            Ok(Err(error)) => failure = Some(error),
            Err(_) => failure = Some(anyhow!("a client thread panicked")),
        }
    }
    let seconds = began.elapsed().as_secs_f64();
    let cpu = cpu_time().saturating_sub(cpu_before);
    if let Some(error) = failure {
        return Err(error);
    }
    let mut latencies = by_kind[0].clone();
    latencies
        .add(&by_kind[1])
        .map_err(|e| anyhow!("merge histograms: {e:?}"))?;
    let us = |ns: u64| ns as f64 / 1000.0;
    Ok(LocksResult {
        scheme: name.to_string(),
        backend: args.backend.name(),
        threads,
        range: if args.mixed {
            "mixed".into()
        } else {
            args.range.to_string()
        },
        units: args.units,
        alpha: args.alpha,
        seg_size: matches!(kind, LockScheme::Seg(_)).then(|| seg_size(args)),
        seconds,
        ops,
        ops_per_s: ops as f64 / seconds,
        p50_us: us(latencies.value_at_quantile(0.5)),
        p99_us: us(latencies.value_at_quantile(0.99)),
        max_us: us(latencies.max()),
        read_p99_us: (!by_kind[0].is_empty()).then(|| us(by_kind[0].value_at_quantile(0.99))),
        write_p99_us: (!by_kind[1].is_empty()).then(|| us(by_kind[1].value_at_quantile(0.99))),
        abort_rate: stats.abort_rate(),
        rtts_per_acquire: stats.rtts_per_acquire(),
        rtts_per_release: stats.rtts_per_release(),
        verbs_per_acquire: stats.verbs_per_acquire(),
        cpu_us_per_op: if ops == 0 {
            0.0
        } else {
            cpu.as_secs_f64() * 1e6 / ops as f64
        },
        t_wait_us: t_wait.map(|t| t.as_secs_f64() * 1e6),
        aborts: stats.aborts,
        fast_path_rate: if stats.acquisitions == 0 {
            0.0
        } else {
            stats.fast_path as f64 / stats.acquisitions as f64
        },
        starvation_escalations: stats.starvation_escalations,
        // A hosted acquisition posts no verbs of its own: one call, the steps at the host.
        hosted: kind.is_citron() && stats.acquisitions > 0 && stats.acquire.verbs == 0,
        read_ratio: args.read_ratio,
        reads: read_mode.name(),
    })
}

fn new_histogram() -> Histogram<u64> {
    // 1 ns to 100 s, 3 significant digits.
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid histogram bounds")
}

/// One client thread's closed loop: acquire, release, until told to stop. `reads`: the
/// fraction of acquisitions that are reads, and the mode they are taken in.
fn client(
    mut lock: Box<dyn RangeLock>,
    borders: Borders,
    range: u64,
    reads: (f64, LockMode),
    seed: u64,
    stop: &AtomicBool,
    start: &Barrier,
) -> Result<ThreadResult> {
    let mut rng = SmallRng::seed_from_u64(0xB17_C0DE ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut by_kind = [new_histogram(), new_histogram()];
    let mut ops = 0;
    start.wait();
    // The statistics of the measured loop only (opening may have cost traffic).
    let before = lock.stats();
    while !stop.load(Ordering::Relaxed) {
        let left = borders.sample(&mut rng);
        let read = reads.0 > 0.0 && rng.random_bool(reads.0);
        let mode = if read { reads.1 } else { LockMode::Exclusive };
        let began = Instant::now();
        let id = lock.acquire_mode(left..left + range, mode)?;
        by_kind[usize::from(!read)].saturating_record(began.elapsed().as_nanos() as u64);
        lock.release(id)?;
        ops += 1;
    }
    Ok(ThreadResult {
        by_kind,
        stats: lock.stats().since(&before),
        ops,
    })
}

/// User + system CPU time of the whole process so far.
fn cpu_time() -> Duration {
    // SAFETY: `getrusage` only writes the struct we pass, which is a plain C struct for which
    // all-zero bytes are a valid value.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return Duration::ZERO;
        }
        usage
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

fn print_table(results: &[LocksResult]) {
    println!(
        "{:<22} {:<7} {:>7} {:>6} {:>5} {:>12} {:>9} {:>9} {:>11} {:>11} {:>10} {:>8} {:>8} {:>10}",
        "scheme",
        "backend",
        "threads",
        "range",
        "reads",
        "ops/s",
        "p50 µs",
        "p99 µs",
        "read p99",
        "write p99",
        "abort rate",
        "RTT/acq",
        "RTT/rel",
        "CPU µs/op"
    );
    let p99 = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |us| format!("{us:.1}"));
    for r in results {
        let scheme = match r.seg_size {
            Some(size) => format!("{} ({size})", r.scheme),
            None if r.hosted => format!("{} (host)", r.scheme),
            None => r.scheme.clone(),
        };
        println!(
            "{:<22} {:<7} {:>7} {:>6} {:>5.2} {:>12.0} {:>9.1} {:>9.1} {:>11} {:>11} {:>10.4} {:>8.2} {:>8.2} {:>10.2}",
            scheme,
            r.backend,
            r.threads,
            r.range,
            r.read_ratio,
            r.ops_per_s,
            r.p50_us,
            r.p99_us,
            p99(r.read_p99_us),
            p99(r.write_p99_us),
            r.abort_rate,
            r.rtts_per_acquire,
            r.rtts_per_release,
            r.cpu_us_per_op
        );
    }
}
