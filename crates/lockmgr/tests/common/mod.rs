//! The lock safety checker, shared by the lock tests.
//!
//! Workers take random ranges through a [`RangeLock`] and, while holding each, claim every unit
//! of it in a *shadow map*: one owner slot per unit, claimed with CAS `0 -> holder` and freed
//! with CAS `holder -> 0`. A correct lock never lets two holders claim one unit; any failed claim
//! is an overlap, reported with both holders and their ranges. The shadow lives either in this
//! process ([`AtomicShadow`], for threads) or in a fabric region ([`FabricShadow`], for several
//! processes on `shm`, using the fabric's own CAS verbs).
//!
//! Shared mode: a worker asks for a shared lock with the workload's `read_ratio`. A slot then
//! counts its readers: a shared claim adds one to every slot of its range (and fails if an
//! exclusive holder is there), an exclusive claim needs every slot empty. So readers may
//! overlap readers, and at no instant does an exclusive holder overlap any other holder.
//!
//! Liveness: a watchdog fails the run if any acquisition takes longer than the workload's bound.
//! Workloads are bounded by iteration counts, never by durations, so runs take the same work on
//! any machine.

#![allow(dead_code)] // Each test binary uses its own part of this module.

pub mod servers;

use fabric::batch::MAX_BATCH_VERBS;
use fabric::{Batch, Completions, Endpoint, EndpointExt, RegionId, RemoteAddr};
use lockmgr::{LockMode, LockStats, RangeLock};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the workers do.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// The address space the ranges are drawn from: `[0, units)`.
    pub units: u64,
    /// Range sizes are log-uniform in `[1, 2^max_size_log2]`.
    pub max_size_log2: u32,
    /// Zipf exponent of the placement of half of the ranges (the other half are uniform).
    pub zipf_alpha: f64,
    /// Probability that a request is the whole space `[0, units)`.
    pub whole: f64,
    /// Acquisitions per worker.
    pub iterations: usize,
    /// Probability of lingering inside the critical section (widens race windows).
    pub hold_probability: f64,
    /// Longest linger.
    pub max_hold: Duration,
    /// Every acquisition must complete within this.
    pub liveness: Duration,
    /// Seed of the workers' random streams.
    pub seed: u64,
    /// Fraction of acquisitions in shared mode (0: all exclusive).
    pub read_ratio: f64,
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            units: 1 << 20,
            max_size_log2: 16,
            zipf_alpha: 0.9,
            whole: 0.01,
            iterations: 150,
            hold_probability: 0.2,
            max_hold: Duration::from_micros(200),
            liveness: Duration::from_secs(5),
            seed: 0xC17_0000,
            read_ratio: 0.0,
        }
    }
}

/// Draws the workers' ranges.
pub struct RangeGen {
    workload: Workload,
    rng: SmallRng,
    zipf: Zipf<f64>,
}

impl RangeGen {
    /// The range stream of worker `worker`.
    pub fn new(workload: Workload, worker: u64) -> Self {
        Self {
            workload,
            rng: SmallRng::seed_from_u64(
                workload.seed ^ worker.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            ),
            zipf: Zipf::new(workload.units as f64, workload.zipf_alpha.max(0.0))
                .expect("valid Zipf parameters"),
        }
    }

    /// The next range: unaligned, within `[0, units)`.
    pub fn next_range(&mut self) -> Range<u64> {
        let units = self.workload.units;
        if self.rng.random_bool(self.workload.whole) {
            return 0..units;
        }
        let log = self.rng.random_range(0..=self.workload.max_size_log2);
        let size = (1u64 << log) + self.rng.random_range(0..(1u64 << log));
        let size = size.clamp(1, units);
        let max_start = units - size;
        let start = if self.rng.random_bool(0.5) {
            self.rng.random_range(0..=max_start)
        } else {
            // Zipf draws are in [1, units]; the hot spots are the low addresses.
            (self.zipf.sample(&mut self.rng) as u64 - 1).min(max_start)
        };
        start..start + size
    }

    /// The mode of the next acquisition (draws nothing when the workload has no readers, so
    /// exclusive-only streams stay what they were).
    pub fn next_mode(&mut self) -> LockMode {
        if self.workload.read_ratio > 0.0 && self.rng.random_bool(self.workload.read_ratio.min(1.0))
        {
            LockMode::Shared
        } else {
            LockMode::Exclusive
        }
    }

    /// Lingers inside the critical section with the workload's probability.
    pub fn maybe_hold(&mut self) {
        if self.rng.random_bool(self.workload.hold_probability) {
            let max = self.workload.max_hold.as_nanos() as u64;
            let until = Instant::now() + Duration::from_nanos(self.rng.random_range(0..=max));
            while Instant::now() < until {
                std::thread::yield_now();
            }
        }
    }
}

/// A slot held exclusively holds `EXCL | holder`; a slot held shared holds its reader count.
pub const EXCL: u64 = 1 << 63;

/// A shadow map: per-unit owner slots, plus each holder's current range (for messages).
pub trait Shadow {
    /// Claims every unit of `range` for `holder` (shared: as one more reader); `Err` describes
    /// the first overlap found.
    fn claim(&mut self, holder: u64, range: &Range<u64>, mode: LockMode) -> Result<(), String>;
    /// Frees every unit of `range` from `holder` (shared: one reader less); `Err` if some unit
    /// was not `holder`'s (or not shared).
    fn unclaim(&mut self, holder: u64, range: &Range<u64>, mode: LockMode) -> Result<(), String>;
}

/// Who holds a slot of value `v`, for messages.
fn slot_holder(v: u64) -> String {
    if v & EXCL != 0 {
        format!("holder {} (exclusive)", v & !EXCL)
    } else {
        format!("{v} reader(s)")
    }
}

fn fmt_range(start: u64, end: u64) -> String {
    if start == 0 && end == 0 {
        "(no range recorded)".into()
    } else {
        format!("[{start}, {end})")
    }
}

/// The shadow of one process's threads: atomics in memory.
pub struct AtomicShadow {
    slots: Vec<AtomicU64>,
    /// Per holder id: start and end of its current range.
    ranges: Vec<(AtomicU64, AtomicU64)>,
}

impl AtomicShadow {
    /// A shadow of `units` units for holder ids `1..=holders`.
    pub fn new(units: u64, holders: usize) -> Arc<Self> {
        Arc::new(Self {
            slots: (0..units).map(|_| AtomicU64::new(0)).collect(),
            ranges: (0..=holders)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
        })
    }
}

impl Shadow for Arc<AtomicShadow> {
    fn claim(&mut self, holder: u64, range: &Range<u64>, mode: LockMode) -> Result<(), String> {
        let (start, end) = &self.ranges[holder as usize];
        start.store(range.start, Ordering::SeqCst);
        end.store(range.end, Ordering::SeqCst);
        for unit in range.clone() {
            let slot = &self.slots[unit as usize];
            let clash = match mode {
                LockMode::Exclusive => slot
                    .compare_exchange(0, EXCL | holder, Ordering::SeqCst, Ordering::SeqCst)
                    .err(),
                LockMode::Shared => {
                    let old = slot.fetch_add(1, Ordering::SeqCst);
                    (old & EXCL != 0).then_some(old)
                }
            };
            if let Some(other) = clash {
                let whose = if other & EXCL != 0 {
                    let (s, e) = &self.ranges[(other & !EXCL) as usize];
                    format!(
                        ", which holds {}",
                        fmt_range(s.load(Ordering::SeqCst), e.load(Ordering::SeqCst))
                    )
                } else {
                    String::new()
                };
                return Err(format!(
                    "OVERLAP: holder {holder} was granted [{}, {}) {} but unit {unit} is held by {}{whose}",
                    range.start,
                    range.end,
                    mode.name(),
                    slot_holder(other),
                ));
            }
        }
        Ok(())
    }

    fn unclaim(&mut self, holder: u64, range: &Range<u64>, mode: LockMode) -> Result<(), String> {
        for unit in range.clone() {
            let slot = &self.slots[unit as usize];
            let bad = match mode {
                LockMode::Exclusive => slot
                    .compare_exchange(EXCL | holder, 0, Ordering::SeqCst, Ordering::SeqCst)
                    .err(),
                LockMode::Shared => {
                    let old = slot.fetch_sub(1, Ordering::SeqCst);
                    (old & EXCL != 0 || old == 0).then_some(old)
                }
            };
            if let Some(other) = bad {
                return Err(format!(
                    "OVERLAP: holder {holder} held [{}, {}) {} but at release unit {unit} was held by {}",
                    range.start,
                    range.end,
                    mode.name(),
                    slot_holder(other)
                ));
            }
        }
        Ok(())
    }
}

/// Bytes a [`FabricShadow`] region needs: one word per unit, two per holder.
pub fn fabric_shadow_bytes(units: u64, holders: u64) -> u64 {
    (units + 2 * (holders + 1)) * 8
}

/// The shadow of several processes: owner slots in a fabric region, claimed with CAS verbs in
/// batches (up to one batch per [`MAX_BATCH_VERBS`] units).
pub struct FabricShadow {
    endpoint: Box<dyn Endpoint>,
    region: RegionId,
    units: u64,
    batch: Batch,
    out: Completions,
}

impl FabricShadow {
    /// A shadow in `region` (of [`fabric_shadow_bytes`] bytes, zeroed), over `endpoint`.
    pub fn new(endpoint: Box<dyn Endpoint>, region: RegionId, units: u64) -> Self {
        Self {
            endpoint,
            region,
            units,
            batch: Batch::new(),
            out: Completions::new(),
        }
    }

    fn slot(&self, unit: u64) -> RemoteAddr {
        RemoteAddr::new(self.region, unit * 8)
    }

    fn holder_range(&self, holder: u64) -> RemoteAddr {
        RemoteAddr::new(self.region, (self.units + 2 * holder) * 8)
    }

    /// CASes every slot of `range` from `from` to `to` (exclusive), or adds `add` to every
    /// slot (shared: `from == to == 0`); returns the first unit whose old value was wrong, with
    /// what it held.
    fn swap_all(
        &mut self,
        range: &Range<u64>,
        from: u64,
        to: u64,
        add: Option<u64>,
    ) -> Result<Option<(u64, u64)>, String> {
        let mut unit = range.start;
        while unit < range.end {
            let n = (range.end - unit).min(MAX_BATCH_VERBS as u64);
            self.batch.clear();
            for u in unit..unit + n {
                match add {
                    None => {
                        self.batch.cas(self.slot(u), from, to);
                    }
                    Some(a) => {
                        self.batch.faa(self.slot(u), a);
                    }
                }
            }
            self.endpoint
                .execute(&self.batch, &mut self.out)
                .map_err(|e| format!("shadow fabric: {e}"))?;
            let wrong = |old: u64| match add {
                None => old != from,
                // Adding a reader: no exclusive holder; removing one: a reader was there.
                Some(1) => old & EXCL != 0,
                Some(_) => old & EXCL != 0 || old == 0,
            };
            if let Some(i) = self.out.olds().iter().position(|&old| wrong(old)) {
                return Ok(Some((unit + i as u64, self.out.olds()[i])));
            }
            unit += n;
        }
        Ok(None)
    }
}

impl Shadow for FabricShadow {
    fn claim(&mut self, holder: u64, range: &Range<u64>, mode: LockMode) -> Result<(), String> {
        let mut batch = Batch::new();
        batch.write_u64(self.holder_range(holder), range.start);
        batch.write_u64(self.holder_range(holder).word(1), range.end);
        self.endpoint
            .execute(&batch, &mut Completions::new())
            .map_err(|e| format!("shadow fabric: {e}"))?;
        let clash = match mode {
            LockMode::Exclusive => self.swap_all(range, 0, EXCL | holder, None)?,
            LockMode::Shared => self.swap_all(range, 0, 0, Some(1))?,
        };
        if let Some((unit, other)) = clash {
            let whose = if other & EXCL != 0 {
                let at = self.holder_range(other & !EXCL);
                let (s, e) = (
                    self.endpoint.read_u64(at).unwrap_or(0),
                    self.endpoint.read_u64(at.word(1)).unwrap_or(0),
                );
                format!(", which holds {}", fmt_range(s, e))
            } else {
                String::new()
            };
            return Err(format!(
                "OVERLAP: holder {holder} was granted [{}, {}) {} but unit {unit} is held by {}{whose}",
                range.start,
                range.end,
                mode.name(),
                slot_holder(other)
            ));
        }
        Ok(())
    }

    fn unclaim(&mut self, holder: u64, range: &Range<u64>, mode: LockMode) -> Result<(), String> {
        let bad = match mode {
            LockMode::Exclusive => self.swap_all(range, EXCL | holder, 0, None)?,
            LockMode::Shared => self.swap_all(range, 0, 0, Some(u64::MAX))?,
        };
        if let Some((unit, other)) = bad {
            return Err(format!(
                "OVERLAP: holder {holder} held [{}, {}) {} but at release unit {unit} was held by {}",
                range.start,
                range.end,
                mode.name(),
                slot_holder(other)
            ));
        }
        Ok(())
    }
}

/// What a checker run observed.
#[derive(Debug, Default)]
pub struct Report {
    /// All workers' lock statistics, merged.
    pub stats: LockStats,
    /// The longest single acquisition.
    pub max_acquire: Duration,
}

impl Report {
    /// Adds another run's (a child process's) report.
    pub fn merge(&mut self, other: &Report) {
        self.stats.merge(&other.stats);
        self.max_acquire = self.max_acquire.max(other.max_acquire);
    }
}

/// Per-worker liveness slot: when the current acquisition began (ns since the run's epoch, 0:
/// not acquiring) and what it asked for.
#[derive(Default)]
struct Watch {
    since: AtomicU64,
    start: AtomicU64,
    end: AtomicU64,
}

/// One worker: `iterations` acquire → claim → linger → unclaim → release cycles.
fn work(
    mut lock: Box<dyn RangeLock>,
    mut shadow: impl Shadow,
    holder: u64,
    mut gen: RangeGen,
    workload: Workload,
    watch: &Watch,
    epoch: Instant,
) -> Result<Report, String> {
    let mut max_acquire = Duration::ZERO;
    for i in 0..workload.iterations {
        let range = gen.next_range();
        let mode = gen.next_mode();
        watch.start.store(range.start, Ordering::Relaxed);
        watch.end.store(range.end, Ordering::Relaxed);
        watch
            .since
            .store(epoch.elapsed().as_nanos() as u64 + 1, Ordering::SeqCst);
        let started = Instant::now();
        let id = lock
            .acquire_mode(range.clone(), mode)
            .map_err(|e| format!("holder {holder}: acquire {range:?} failed: {e}"))?;
        let took = started.elapsed();
        watch.since.store(0, Ordering::SeqCst);
        max_acquire = max_acquire.max(took);
        if took > workload.liveness {
            return Err(format!(
                "LIVENESS: holder {holder} waited {took:?} (> {:?}) for {range:?} (iteration {i})",
                workload.liveness
            ));
        }
        // A lock that presumed a live holder dead (lease recovery, CITRON §3.10) says so in its
        // statistics: show them with an overlap, to tell a lease too short from a real bug.
        shadow.claim(holder, &range, mode).map_err(|e| {
            format!(
                "{e} (acquisition took {took:?}; this holder's lock statistics: {:?})",
                lock.stats()
            )
        })?;
        gen.maybe_hold();
        shadow.unclaim(holder, &range, mode)?;
        lock.release(id)
            .map_err(|e| format!("holder {holder}: release {range:?} failed: {e}"))?;
    }
    Ok(Report {
        stats: lock.stats(),
        max_acquire,
    })
}

/// Runs `threads` workers in this process. `open(worker)` gives each its lock handle and its
/// shadow; holder ids are `holder_base + worker + 1`. Returns the merged report, or the first
/// violation (overlap, liveness, lock error).
pub fn run_threads<S, F>(
    threads: usize,
    holder_base: u64,
    workload: Workload,
    open: F,
) -> Result<Report, String>
where
    S: Shadow + Send + 'static,
    F: Fn(usize) -> Result<(Box<dyn RangeLock>, S), String>,
{
    let epoch = Instant::now();
    let watches: Arc<Vec<Watch>> = Arc::new((0..threads).map(|_| Watch::default()).collect());
    let (done, results) = mpsc::channel();
    // What each worker's scheme says about its current acquisition (for liveness reports).
    let mut progress: Vec<Option<lockmgr::ProgressFn>> = Vec::with_capacity(threads);
    for worker in 0..threads {
        let (lock, shadow) = open(worker)?;
        progress.push(lock.progress());
        let holder = holder_base + worker as u64 + 1;
        let gen = RangeGen::new(workload, holder);
        let watches = watches.clone();
        let done = done.clone();
        // Not scoped: a worker stuck in `acquire` must not keep the checker from reporting it.
        std::thread::Builder::new()
            .name(format!("safety-{holder}"))
            .spawn(move || {
                let result = work(lock, shadow, holder, gen, workload, &watches[worker], epoch);
                let _ = done.send(result);
            })
            .map_err(|e| format!("spawn: {e}"))?;
    }
    drop(done);
    let mut report = Report::default();
    let mut finished = 0;
    while finished < threads {
        match results.recv_timeout(Duration::from_millis(100)) {
            Ok(result) => {
                report.merge(&result?);
                finished += 1;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let now = epoch.elapsed().as_nanos() as u64;
                for (worker, watch) in watches.iter().enumerate() {
                    let since = watch.since.load(Ordering::SeqCst);
                    if since != 0
                        && Duration::from_nanos(now.saturating_sub(since)) > workload.liveness
                    {
                        let mut workers = String::new();
                        for (i, (w, p)) in watches.iter().zip(&progress).enumerate() {
                            let since = w.since.load(Ordering::SeqCst);
                            workers += &format!(
                                "; holder {}: {} [{}, {}) {}",
                                holder_base + i as u64 + 1,
                                if since == 0 {
                                    "not acquiring".to_string()
                                } else {
                                    format!(
                                        "acquiring for {:?}",
                                        Duration::from_nanos(now.saturating_sub(since))
                                    )
                                },
                                w.start.load(Ordering::Relaxed),
                                w.end.load(Ordering::Relaxed),
                                p.as_ref().map(|f| f()).unwrap_or_default()
                            );
                        }
                        return Err(format!(
                            "LIVENESS: holder {} has waited more than {:?} for [{}, {}){workers}",
                            holder_base + worker as u64 + 1,
                            workload.liveness,
                            watch.start.load(Ordering::Relaxed),
                            watch.end.load(Ordering::Relaxed)
                        ));
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err("a worker thread died without reporting (panicked?)".into())
            }
        }
    }
    Ok(report)
}
