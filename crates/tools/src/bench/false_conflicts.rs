//! `citronfs bench false-conflicts`: how many conflicts CITRON's range split (CITRON §3.5.1)
//! and the file system's lock unit add on top of the real ones. No fabric is involved: the
//! conflicts follow from the split alone ([`lockmgr::citron::split::split`]).
//!
//! # Which units a request holds
//!
//! A request `[l, r)` locks at most `k` tree nodes. An internal node holds its whole range; a leaf
//! holds exactly the requested bits (masked CAS, Alg. 2 l. 21). Two requests conflict on the
//! tree iff one holds a node that is, or is an ancestor of, a node the other holds (phases (b) and
//! (d)), or both hold overlapping bits of one leaf — which is the same as: the sets of units they
//! *hold* intersect. Since the chosen nodes each intersect `[l, r)` and together cover it, that
//! set is one interval, the *held interval*: from `l` (or the first node's start, if that node is
//! internal) to `r` (or the last node's end, if internal).
//!
//! # Fig. 11 mode (default)
//!
//! As in §4.6: for each `k` and range length `L`, two requests with independent uniform left
//! borders on `[0, N − L]` form a *false conflict* when their held intervals intersect but the
//! requests do not. The reported `pair_rate` is the probability of that per pair of requests
//! (the paper divides "false conflicts" by "all lock requests"; per request it would be half).
//!
//! With `N = 2^28` (the paper's tree) the pair rate is around `L/N`, far too small to hit by
//! drawing both borders uniformly. So the second border is drawn by importance sampling: from a
//! window of half-width `2^s` around the first border, the scale `s` uniform over
//! `0..=⌈log2 M⌉` (`M = N − L + 1`, the last window covers everything), and each draw is
//! weighted by `(1/M) / q(b)` with `q` the exact mixture density. The first border is drawn half
//! the time straddling a node boundary of a uniformly chosen level (those requests lock the big
//! nodes that dominate the mean, but a uniform draw rarely makes one), also weighted. The
//! estimate is unbiased, the weights are bounded, and false conflicts — which need the two
//! requests close relative to the nodes they lock — are drawn often at every distance and node
//! size. The standard error is reported with it. Also reported per request (same weights): the
//! mean number of nodes locked and `excess`, the covered-but-unrequested units (leaves waste
//! nothing) per requested unit.
//!
//! # Pattern mode (`--pattern`)
//!
//! For choosing the file system's lock unit: the byte ranges of an application's writes are
//! mapped to lock units of each `--unit-sizes` (a request holds every unit it touches), and the
//! concurrently issued requests of different ranks are checked pairwise. A pair is a false
//! conflict when their byte ranges are disjoint but their unit ranges intersect (`unit` columns),
//! or their CITRON held intervals (after the `k`-split on a tree covering the file) intersect
//! (`citron` columns). Reported per request, as the paper does: false conflicts per request and
//! the share of requests in at least one.
//!
//! Assumptions (state of the seeds, not measured traces):
//! - `io500-hard` (CITRON §4.5): `P` ranks (default 64, the paper's thread count) write
//!   47008-byte records into one shared file, record `i·P + r` by rank `r` in round `i`; the `P`
//!   writes of a round are concurrent (IOR ranks are not synchronised per write; a round is the
//!   natural window).
//! - `btio` (CITRON §4.3.1, NPB BT class D): a 408³ grid of 5 doubles (40 bytes) per point,
//!   stored x-fastest, one full dump (2.72 GB; the paper's 135.8 GB is 50 dumps) written without
//!   collective buffering. `P = q²` processes; the multipartition decomposition cuts each axis
//!   into `q` pieces, process `(i, j)` owns the cell `((i + c) mod q, (j + c) mod q, c)` of every
//!   z-slab `c`, and writes one x-run of `408/q` points (`16320/q` bytes: 2040 B at `P = 64` to
//!   8160 B at `P = 4`, the paper's range) per step, slab by slab, z then y. The `P` writes of a
//!   step are concurrent. At most `--max-steps` steps, evenly spaced, are examined.

use crate::report::{fmt_f, Report};
use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use lockmgr::citron::layout::{height_for, tree_units, Node};
use lockmgr::citron::split::{split, waste};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// The IO500 hard-write record size (CITRON §4.5).
pub const IO500_HARD_RECORD: u64 = 47008;
/// Grid points per axis of NPB BT class D.
pub const BT_CLASS_D_GRID: u64 = super::btio::Class::D.n();
/// Bytes per BT grid point: 5 doubles.
pub const BT_POINT_BYTES: u64 = super::btio::POINT;

/// Access patterns of pattern mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pattern {
    /// NPB BT-IO class D: strided x-runs of 16320/√P bytes per process.
    Btio,
    /// IO500 ior-hard write: interleaved 47008-byte records.
    Io500Hard,
}

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::Btio => "btio",
            Pattern::Io500Hard => "io500-hard",
        }
    }
}

/// Options of `citronfs bench false-conflicts`.
#[derive(Args, Debug)]
pub struct FalseConflictsArgs {
    /// Most nodes a range is split into (comma-separated list).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    k: Vec<usize>,
    /// Fig. 11 mode: range lengths in units (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
    )]
    lengths: Vec<u64>,
    /// Fig. 11 mode: log2 of the units the tree covers (rounded up to a tree size, 64·4^j).
    #[arg(long, default_value_t = 28)]
    units_log2: u32,
    /// Fig. 11 mode: request pairs drawn per (k, L).
    #[arg(long, default_value_t = 20_000)]
    samples: u64,
    /// Seed of the random draws.
    #[arg(long, default_value_t = 11)]
    seed: u64,
    /// Pattern mode: map this application's writes to lock units instead of Fig. 11.
    #[arg(long, value_enum)]
    pattern: Option<Pattern>,
    /// Pattern mode: lock unit sizes in bytes (suffixes K, M).
    #[arg(long, value_delimiter = ',', default_value = "512,1K,4K,16K,64K", value_parser = parse_size)]
    unit_sizes: Vec<u64>,
    /// Pattern mode: process counts (btio: squares; default 4,9,16,36,64; io500-hard: 64).
    #[arg(long, value_delimiter = ',')]
    procs: Vec<u64>,
    /// Pattern mode, io500-hard: rounds of `procs` concurrent writes.
    #[arg(long, default_value_t = 2000)]
    rounds: u64,
    /// Pattern mode, btio: most steps examined per process count (evenly spaced).
    #[arg(long, default_value_t = 2000)]
    max_steps: u64,
    /// Print one JSON object per result instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let (digits, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    let n: u64 = digits.parse().map_err(|_| format!("bad size {s:?}"))?;
    match n.checked_mul(mult) {
        Some(v) if v > 0 => Ok(v),
        _ => Err(format!("bad size {s:?}")),
    }
}

/// Runs the benchmark.
pub fn run(args: &FalseConflictsArgs) -> Result<()> {
    if args.k.contains(&0) {
        bail!("k must be at least 1");
    }
    match args.pattern {
        None => fig11(args),
        Some(p) => pattern(args, p),
    }
}

// ---- held intervals ----

/// What one request holds on the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    /// First unit held.
    pub lo: u64,
    /// One past the last unit held.
    pub hi: u64,
    /// Nodes locked.
    pub nodes: usize,
    /// Covered-but-unrequested units (internal nodes only; leaves hold exact bits).
    pub waste: u64,
}

/// The units `[l, r)` holds on the tree under `root` when split into at most `k` nodes (see the
/// module docs: one interval).
pub fn held(root: Node, l: u64, r: u64, k: usize) -> Held {
    let nodes = split(root, l, r, k);
    let first = nodes.first().expect("a split is never empty");
    let last = nodes.last().expect("a split is never empty");
    Held {
        lo: if first.is_leaf() { l } else { first.start() },
        hi: if last.is_leaf() { r } else { last.end() },
        nodes: nodes.len(),
        waste: waste(&nodes, l, r),
    }
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

// ---- Fig. 11 ----

/// One (k, L) result of Fig. 11 mode.
#[derive(Serialize, Debug)]
struct Fig11Result {
    mode: &'static str,
    k: usize,
    length: u64,
    units: u64,
    samples: u64,
    /// Mean nodes locked per request.
    nodes: f64,
    /// Mean covered-but-unrequested units per requested unit.
    excess: f64,
    /// Probability that two requests with uniform left borders falsely conflict.
    pair_rate: f64,
    /// Standard error of `pair_rate`.
    pair_rate_stderr: f64,
}

/// The second border's proposal: a window of half-width `2^s` around `center`, `s` uniform over
/// `0..=scales-1`, clipped to `[0, m)`; the last window covers `[0, m)`.
struct Proposal {
    m: u64,
    scales: u32,
}

impl Proposal {
    fn new(m: u64) -> Self {
        // 2^(scales-1) >= m, so the widest window holds every border.
        let scales = 64 - (m.max(1) - 1).leading_zeros() + 1;
        Self { m, scales }
    }

    fn window(&self, center: u64, s: u32) -> (u64, u64) {
        let half = 1u64 << s;
        (
            center.saturating_sub(half),
            (center.saturating_add(half)).min(self.m - 1),
        )
    }

    fn draw(&self, center: u64, rng: &mut SmallRng) -> u64 {
        let s = rng.random_range(0..self.scales);
        let (lo, hi) = self.window(center, s);
        rng.random_range(lo..=hi)
    }

    /// `(1/m) / q(b)`: the importance weight of border `b`.
    fn weight(&self, center: u64, b: u64) -> f64 {
        let mut q = 0.0;
        for s in 0..self.scales {
            let (lo, hi) = self.window(center, s);
            if (lo..=hi).contains(&b) {
                q += 1.0 / (hi - lo + 1) as f64;
            }
        }
        q /= f64::from(self.scales);
        (1.0 / self.m as f64) / q
    }
}

/// The first border's proposal: half the draws uniform over `[0, m)`, half a range that
/// straddles a node boundary of a level chosen uniformly (an interior multiple of that level's
/// node size). Requests that straddle a high boundary lock huge nodes (with small `k`) and
/// dominate both the mean waste and the pair rate, yet a uniform draw makes one with probability
/// about `L / (node size)`: this gives every level its share, and the weights `(1/m) / q(a)`
/// (at most 2) keep the estimate unbiased.
struct FirstProposal {
    m: u64,
    length: u64,
    /// Node sizes with interior boundaries: `64·4^j` below the root.
    sizes: Vec<u64>,
    units: u64,
}

impl FirstProposal {
    fn new(root: Node, length: u64) -> Self {
        let units = root.end();
        // A range of one unit straddles nothing.
        let sizes = if length < 2 {
            Vec::new()
        } else {
            (0..root.hgt).map(|h| Node::new(h, 0).span()).collect()
        };
        Self {
            m: units - length + 1,
            length,
            sizes,
            units,
        }
    }

    /// Borders `a` with `a < c < a + L`, inside `[0, m)`.
    fn straddling(&self, c: u64) -> (u64, u64) {
        ((c + 1).saturating_sub(self.length), (c - 1).min(self.m - 1))
    }

    fn draw(&self, rng: &mut SmallRng) -> u64 {
        if self.sizes.is_empty() || rng.random_bool(0.5) {
            return rng.random_range(0..self.m);
        }
        let size = self.sizes[rng.random_range(0..self.sizes.len())];
        let c = size * rng.random_range(1..self.units / size);
        let (lo, hi) = self.straddling(c);
        rng.random_range(lo..=hi)
    }

    /// `(1/m) / q(a)`.
    fn weight(&self, a: u64) -> f64 {
        if self.sizes.is_empty() {
            return 1.0;
        }
        let uniform = 1.0 / self.m as f64;
        let mut q = 0.0;
        for &size in &self.sizes {
            let boundaries = (self.units / size - 1) as f64;
            // Interior multiples of `size` in (a, a + L).
            let mut c = (a / size + 1) * size;
            while c < a + self.length && c < self.units {
                let (lo, hi) = self.straddling(c);
                q += 1.0 / (boundaries * (hi - lo + 1) as f64);
                c += size;
            }
        }
        q /= self.sizes.len() as f64;
        uniform / (0.5 * uniform + 0.5 * q)
    }
}

/// Fig. 11 statistics for one (k, L): (mean nodes, mean excess, pair rate, its standard error).
pub fn fig11_point(
    root: Node,
    k: usize,
    length: u64,
    samples: u64,
    rng: &mut SmallRng,
) -> (f64, f64, f64, f64) {
    let units = root.end();
    let m = units - length + 1;
    let first = FirstProposal::new(root, length);
    let proposal = Proposal::new(m);
    // Per-request means are self-normalised (divided by the sum of the weights, not by the
    // count), so a constant stays exact: k = 1 gives exactly one node per request.
    let (mut nodes, mut excess, mut weights) = (0.0, 0.0, 0.0);
    let (mut sum, mut sum2) = (0.0, 0.0);
    for _ in 0..samples {
        let a = first.draw(rng);
        let wa = first.weight(a);
        weights += wa;
        let ha = held(root, a, a + length, k);
        nodes += wa * ha.nodes as f64;
        excess += wa * ha.waste as f64 / length as f64;
        let b = proposal.draw(a, rng);
        let hb = held(root, b, b + length, k);
        let real = overlap((a, a + length), (b, b + length));
        let x = if !real && overlap((ha.lo, ha.hi), (hb.lo, hb.hi)) {
            wa * proposal.weight(a, b)
        } else {
            0.0
        };
        sum += x;
        sum2 += x * x;
    }
    let n = samples.max(1) as f64;
    let mean = sum / n;
    let var = (sum2 / n - mean * mean).max(0.0);
    let weights = if weights > 0.0 { weights } else { 1.0 };
    (nodes / weights, excess / weights, mean, (var / n).sqrt())
}

fn fig11(args: &FalseConflictsArgs) -> Result<()> {
    let Some(h) = 1u64
        .checked_shl(args.units_log2)
        .and_then(height_for)
        .filter(|_| args.units_log2 < 63)
    else {
        bail!("2^{} units: no tree that large", args.units_log2);
    };
    let root = Node::root(h);
    let units = tree_units(h);
    if let Some(l) = args.lengths.iter().find(|&&l| l == 0 || l > units) {
        bail!("range length {l} outside 1..={units}");
    }
    let mut report = Report::new(
        args.json,
        &[
            "k",
            "L",
            "N",
            "pairs",
            "nodes/req",
            "excess",
            "false-conflict rate",
            "± stderr",
        ],
    );
    let mut rng = SmallRng::seed_from_u64(args.seed);
    for &k in &args.k {
        for &length in &args.lengths {
            let (nodes, excess, rate, stderr) =
                fig11_point(root, k, length, args.samples, &mut rng);
            let result = Fig11Result {
                mode: "fig11",
                k,
                length,
                units,
                samples: args.samples,
                nodes,
                excess,
                pair_rate: rate,
                pair_rate_stderr: stderr,
            };
            report.add(
                vec![
                    k.to_string(),
                    length.to_string(),
                    format!("2^{}", units.trailing_zeros()),
                    args.samples.to_string(),
                    fmt_f(nodes, 2),
                    fmt_f(excess, 3),
                    format!("{rate:.3e}"),
                    format!("{stderr:.1e}"),
                ],
                &result,
            );
        }
    }
    report.finish();
    Ok(())
}

// ---- access patterns ----

/// One write: its rank and byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Write {
    /// Issuing rank.
    pub rank: u64,
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

/// The concurrent writes of a pattern, one step at a time, and the file size.
pub struct Steps {
    /// Record (I/O) size in bytes.
    pub record: u64,
    /// Bytes of the file the steps write into.
    pub file_bytes: u64,
    /// The steps examined, each the writes issued together.
    pub steps: Vec<Vec<Write>>,
}

/// IO500 ior-hard: `procs` ranks, `rounds` rounds (module docs).
pub fn io500_hard(procs: u64, rounds: u64) -> Steps {
    let steps = (0..rounds)
        .map(|i| {
            (0..procs)
                .map(|r| {
                    let start = (i * procs + r) * IO500_HARD_RECORD;
                    Write {
                        rank: r,
                        start,
                        end: start + IO500_HARD_RECORD,
                    }
                })
                .collect()
        })
        .collect();
    Steps {
        record: IO500_HARD_RECORD,
        file_bytes: rounds * procs * IO500_HARD_RECORD,
        steps,
    }
}

/// NPB BT-IO class D with `q²` processes, at most `max_steps` steps (module docs): the `t`-th
/// row of every process, for evenly spaced `t`, as `bench btio` writes them
/// ([`super::btio::rows_of`]).
pub fn btio(q: u64, max_steps: u64) -> Result<Steps> {
    let n = BT_CLASS_D_GRID;
    if q == 0 || n % q != 0 {
        bail!("btio: √P = {q} does not divide the grid of {n} points");
    }
    let rows: Vec<Vec<(u64, u64)>> = (0..q * q)
        .map(|p| super::btio::rows_of(n, q, p, 0))
        .collect();
    let total = rows[0].len() as u64;
    let take = total.min(max_steps.max(1));
    let steps = (0..take)
        .map(|j| {
            let t = (j * total / take) as usize;
            rows.iter()
                .enumerate()
                .map(|(p, r)| {
                    let (start, len) = r[t];
                    Write {
                        rank: p as u64,
                        start,
                        end: start + len,
                    }
                })
                .collect()
        })
        .collect();
    Ok(Steps {
        record: n / q * BT_POINT_BYTES,
        file_bytes: n * n * n * BT_POINT_BYTES,
        steps,
    })
}

/// False conflicts of one pattern at one unit size and `k`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PatternCount {
    /// Writes examined.
    pub requests: u64,
    /// Concurrent cross-rank pairs with disjoint bytes but intersecting unit ranges.
    pub unit_pairs: u64,
    /// Writes in at least one such pair.
    pub unit_hit: u64,
    /// Concurrent cross-rank pairs with disjoint bytes but intersecting CITRON held intervals.
    pub citron_pairs: u64,
    /// Writes in at least one such pair.
    pub citron_hit: u64,
}

/// Pairs of `intervals` (with their writes) that intersect while their writes' bytes do not and
/// their ranks differ; marks the writes involved in `hit`.
fn false_pairs(intervals: &mut [((u64, u64), usize)], writes: &[Write], hit: &mut [bool]) -> u64 {
    intervals.sort_unstable();
    let mut pairs = 0;
    for i in 0..intervals.len() {
        let ((_, hi), wi) = intervals[i];
        for &((lo_j, _), wj) in &intervals[i + 1..] {
            if lo_j >= hi {
                break;
            }
            let (a, b) = (writes[wi], writes[wj]);
            if a.rank != b.rank && !overlap((a.start, a.end), (b.start, b.end)) {
                pairs += 1;
                hit[wi] = true;
                hit[wj] = true;
            }
        }
    }
    pairs
}

/// Counts the false conflicts of `steps` with lock units of `unit` bytes and CITRON split `k`.
pub fn count_pattern(steps: &Steps, unit: u64, k: usize) -> Result<PatternCount> {
    let units = steps.file_bytes.div_ceil(unit);
    let Some(h) = height_for(units) else {
        bail!("{units} lock units: no tree that large");
    };
    let root = Node::root(h);
    let mut count = PatternCount::default();
    for step in &steps.steps {
        let mut by_unit = Vec::with_capacity(step.len());
        let mut by_held = Vec::with_capacity(step.len());
        for (i, w) in step.iter().enumerate() {
            let (l, r) = (w.start / unit, w.end.div_ceil(unit));
            by_unit.push(((l, r), i));
            let h = held(root, l, r, k);
            by_held.push(((h.lo, h.hi), i));
        }
        let mut hit = vec![false; step.len()];
        count.unit_pairs += false_pairs(&mut by_unit, step, &mut hit);
        count.unit_hit += hit.iter().filter(|&&h| h).count() as u64;
        hit.fill(false);
        count.citron_pairs += false_pairs(&mut by_held, step, &mut hit);
        count.citron_hit += hit.iter().filter(|&&h| h).count() as u64;
        count.requests += step.len() as u64;
    }
    Ok(count)
}

/// One (procs, unit, k) result of pattern mode.
#[derive(Serialize, Debug)]
struct PatternResult {
    mode: &'static str,
    pattern: Pattern,
    procs: u64,
    record_bytes: u64,
    unit_bytes: u64,
    k: usize,
    requests: u64,
    /// False conflicts from the unit size alone, per request.
    unit_false_per_req: f64,
    /// Share of requests in at least one false conflict from the unit size alone.
    unit_hit: f64,
    /// False conflicts with CITRON's k-split, per request.
    citron_false_per_req: f64,
    /// Share of requests in at least one false conflict with CITRON's k-split.
    citron_hit: f64,
}

fn pattern(args: &FalseConflictsArgs, pattern: Pattern) -> Result<()> {
    let procs = if !args.procs.is_empty() {
        args.procs.clone()
    } else {
        match pattern {
            Pattern::Btio => vec![4, 9, 16, 36, 64],
            Pattern::Io500Hard => vec![64],
        }
    };
    let mut report = Report::new(
        args.json,
        &[
            "pattern",
            "procs",
            "record B",
            "unit B",
            "k",
            "requests",
            "unit false/req",
            "unit hit",
            "citron false/req",
            "citron hit",
        ],
    );
    for &p in &procs {
        let steps = match pattern {
            Pattern::Io500Hard => io500_hard(p, args.rounds),
            Pattern::Btio => {
                let q = (p as f64).sqrt().round() as u64;
                if q * q != p {
                    bail!("btio needs a square process count, not {p}");
                }
                btio(q, args.max_steps)?
            }
        };
        for &unit in &args.unit_sizes {
            for &k in &args.k {
                let c = count_pattern(&steps, unit, k)?;
                let per = |x: u64| x as f64 / c.requests.max(1) as f64;
                let result = PatternResult {
                    mode: "pattern",
                    pattern,
                    procs: p,
                    record_bytes: steps.record,
                    unit_bytes: unit,
                    k,
                    requests: c.requests,
                    unit_false_per_req: per(c.unit_pairs),
                    unit_hit: per(c.unit_hit),
                    citron_false_per_req: per(c.citron_pairs),
                    citron_hit: per(c.citron_hit),
                };
                report.add(
                    vec![
                        pattern.name().to_string(),
                        p.to_string(),
                        steps.record.to_string(),
                        unit.to_string(),
                        k.to_string(),
                        c.requests.to_string(),
                        fmt_f(result.unit_false_per_req, 3),
                        fmt_f(result.unit_hit, 3),
                        fmt_f(result.citron_false_per_req, 3),
                        fmt_f(result.citron_hit, 3),
                    ],
                    &result,
                );
            }
        }
    }
    report.finish();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact Fig. 11 pair rate on a small tree, by enumerating every pair of left borders.
    fn exact(root: Node, k: usize, length: u64) -> f64 {
        let m = root.end() - length + 1;
        let held: Vec<(u64, u64)> = (0..m)
            .map(|a| {
                let h = held(root, a, a + length, k);
                (h.lo, h.hi)
            })
            .collect();
        let mut false_pairs = 0u64;
        for a in 0..m {
            for b in 0..m {
                if !overlap((a, a + length), (b, b + length))
                    && overlap(held[a as usize], held[b as usize])
                {
                    false_pairs += 1;
                }
            }
        }
        false_pairs as f64 / (m * m) as f64
    }

    #[test]
    fn importance_sampling_matches_exhaustive_count() {
        let root = Node::root(3); // 1024 units
        let mut rng = SmallRng::seed_from_u64(5);
        for (k, length) in [(1, 40), (2, 100), (1, 3)] {
            let want = exact(root, k, length);
            let (_, _, got, stderr) = fig11_point(root, k, length, 40_000, &mut rng);
            assert!(
                (got - want).abs() <= 5.0 * stderr + 1e-9,
                "k {k} L {length}: estimate {got} ± {stderr}, exact {want}"
            );
        }
    }

    #[test]
    fn small_ranges_split_into_leaves_never_falsely_conflict_with_k2() {
        // §4.6: for L <= 64, k = 2 locks leaves only.
        let root = Node::root(12);
        let mut rng = SmallRng::seed_from_u64(6);
        for length in [1, 7, 64] {
            let (nodes, excess, rate, _) = fig11_point(root, 2, length, 2_000, &mut rng);
            assert!(nodes <= 2.0);
            assert_eq!(excess, 0.0);
            assert_eq!(rate, 0.0);
        }
    }

    #[test]
    fn held_interval_examples() {
        let root = Node::root(3);
        // Inside one leaf: exactly the request.
        assert_eq!(held(root, 3, 9, 2).lo, 3);
        assert_eq!(held(root, 3, 9, 2).hi, 9);
        // Across the middle with k = 1: the root.
        let h = held(root, 511, 513, 1);
        assert_eq!((h.lo, h.hi, h.nodes, h.waste), (0, 1024, 1, 1022));
    }

    #[test]
    fn io500_neighbours_share_units_unless_aligned() {
        let steps = io500_hard(4, 3);
        // 47008 = 32 · 1469: 32-byte units split records exactly, 4 KiB units do not.
        let aligned = count_pattern(&steps, 32, 2).unwrap();
        assert_eq!(aligned.unit_pairs, 0);
        // ... but a 1469-unit record split into two tree nodes covers some of its neighbours.
        assert!(aligned.citron_pairs > 0);
        let c = count_pattern(&steps, 4096, 2).unwrap();
        // Three neighbour pairs per round of four.
        assert_eq!(c.unit_pairs, 3 * 3);
        assert!(c.citron_pairs >= c.unit_pairs);
        assert_eq!(c.requests, 12);
    }

    #[test]
    fn btio_writes_of_a_step_are_disjoint_runs() {
        let steps = btio(8, 100).unwrap();
        assert_eq!(steps.record, 2040);
        for step in &steps.steps {
            assert_eq!(step.len(), 64);
            let mut s: Vec<_> = step.iter().map(|w| (w.start, w.end)).collect();
            s.sort_unstable();
            assert!(s.windows(2).all(|p| p[0].1 <= p[1].0));
            assert!(s.iter().all(|&(_, e)| e <= steps.file_bytes));
        }
        // 8-byte units never split a 40-byte point: no unit-level false conflicts.
        let c = count_pattern(&steps, 8, 2).unwrap();
        assert_eq!(c.unit_pairs, 0);
        assert!(btio(7, 10).is_err());
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("x").is_err());
    }
}
