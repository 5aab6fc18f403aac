//! Configuration: what the creator decides once for every client (the shared record in the lock's
//! memory), what each client may choose for itself, and the allocator scale-ups use.
//!
//! # Memory of one lock instance, from `base`
//!
//! ```text
//! base + 0      config record, sealed with a crc (fabric::record), RECORD_BYTES long
//! base + 2048   spillover mutex word (DSLR-style ticket lock: next ticket high 32, serving low 32)
//! base + 2056   maximizer word (OR of out-of-bound right ends)
//! base + 2064   the initial tree, tree_nodes(H) words in level order (slot = index - 1),
//!               then as many owner records, then as many share words, in the same order (`layout`, "Owner word", "Share word")
//! ```
//!
//! Later scale-ups add segments elsewhere (from the [`LockWordAllocator`]); the record lists them.

use super::layout::{self, Segment};
use crate::scheme::LockError;
use crate::schemes::LockWordAllocator;
use fabric::{record, RemoteAddr};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Bytes reserved for the sealed config record.
pub const RECORD_BYTES: u64 = 2048;
/// Offset of the spillover mutex word.
pub const SPILLOVER_OFFSET: u64 = RECORD_BYTES;
/// Offset of the maximizer word.
pub const MAXIMIZER_OFFSET: u64 = RECORD_BYTES + 8;
/// Offset of the initial tree.
pub const TREE_OFFSET: u64 = RECORD_BYTES + 16;

/// The clock-drift bound δ of inequality (1) (Sundial's number, §3.5.5).
pub const DELTA: f64 = 1e-4;

/// Round trips a conflicting client may need between its last phase-(b) read and the end of its
/// notification (§3.5.5): up to two reads in step 2(b) and the masked-FAA batch of 2(c)+(d).
pub const T_WAIT_ROUND_TRIPS: u32 = 3;
/// Share of `T_wait` reserved per round trip, as a multiple of the measured RTT (the paper
/// reserves 5 µs for a 2 µs RTT).
pub const T_WAIT_RTT_FACTOR: f64 = 2.5;
/// The least share per round trip: below it, scheduling noise (not the fabric) dominates and the
/// abort rate of inequality (1) climbs.
pub const T_WAIT_FLOOR_PER_RTT: Duration = Duration::from_micros(5);

/// Masked atomics the phase-(c)+(d) batch of one request may carry in a tree that grows to
/// `tallest_height` levels with meet-in-the-middle distance `m`, counted for `T_wait` where
/// the fabric emulates them ([`t_wait_round_trips`]): the conditional `Occ` of phase (c) and
/// the `DMax` notifications of the request's target ancestors ([`layout::notify_targets`]:
/// the parent and every `m`-th ancestor above it, most for a leaf — one more for every `m`
/// levels of height). 4 for the file system's trees (`m` = 4, up to 2^30 units: height 13),
/// 8 for the tallest tree ([`layout::MAX_HEIGHT`]) at `m` = 4.
pub fn emulated_masked_atomics(tallest_height: u32, m: u32) -> u32 {
    let m = m.max(1);
    let mut targets = Vec::new();
    let most = (0..tallest_height)
        .map(|hgt| {
            layout::notify_targets(layout::Node::new(hgt, 0), tallest_height, m, &mut targets);
            targets.len() as u32
        })
        .max()
        .unwrap_or(0);
    1 + most
}

/// The fewest round trips `T_wait` reserves where masked atomics are emulated: 11, the count of
/// a tree of height 13 (the paper's 3, and a Read and a CAS for each of 4 masked atomics), with
/// which CITRON runs live on the `soft` provider for every tree up to that height. A smaller
/// tree has fewer notifications to emulate, but its batch still carries the plain reads chained
/// around them (phase (b)'s before, the root's after), and its CAS loops retry under contention:
/// counting only the masked atomics of a 16k-unit tree (7 round trips) livelocked the safety
/// checker's shared runs on rdma/soft (every holder aborting on inequality (1) for 5 s).
pub const T_WAIT_EMULATED_MIN_ROUND_TRIPS: u32 = 11;

/// The round trips `T_wait` reserves for fabrics whose masked atomics are `masked`, for a lock
/// whose tree grows to `tallest_height` levels with meet-in-the-middle distance `m`: the
/// paper's [`T_WAIT_ROUND_TRIPS`] where a masked atomic is one verb of a batch, and two more
/// for each masked atomic of the phase-(c)+(d) batch ([`emulated_masked_atomics`]) where the
/// client emulates them (a Read, then a CAS, each a round trip of its own: `rdma`, whose verbs
/// have no masked atomics), and never fewer than [`T_WAIT_EMULATED_MIN_ROUND_TRIPS`] there.
/// Counting the emulated batch as one round trip made every non-fast-path attempt fail
/// inequality (1) there: a livelock; a count fixed for the file system's trees undercounts a
/// taller tree's notifications.
pub fn t_wait_round_trips(masked: fabric::MaskedAtomics, tallest_height: u32, m: u32) -> u32 {
    match masked {
        fabric::MaskedAtomics::ClientEmulated => (T_WAIT_ROUND_TRIPS
            + 2 * emulated_masked_atomics(tallest_height, m))
        .max(T_WAIT_EMULATED_MIN_ROUND_TRIPS),
        fabric::MaskedAtomics::Native | fabric::MaskedAtomics::CpuCasLoop => T_WAIT_ROUND_TRIPS,
    }
}

/// `T_wait` for a fabric whose round trip takes `rtt` and whose masked atomics are one verb:
/// `3 · max(2.5 · RTT, 5 µs)` — the paper's 15 µs at 2 µs RTT (§3.5.5), scaled with the fabric.
pub fn t_wait_for_rtt(rtt: Duration) -> Duration {
    t_wait_for(rtt, T_WAIT_ROUND_TRIPS)
}

/// `T_wait` for a fabric whose round trip takes `rtt`, reserving `round_trips` of them
/// ([`t_wait_round_trips`]): `max(2.5 · RTT, 5 µs)` each.
pub fn t_wait_for(rtt: Duration, round_trips: u32) -> Duration {
    let per = rtt.mul_f64(T_WAIT_RTT_FACTOR).max(T_WAIT_FLOOR_PER_RTT);
    per * round_trips
}

/// The round trip a `T_wait` reserving `round_trips` round trips was derived from
/// ([`t_wait_for`] inverted; at least the floor's share, 2 µs): what a client that only knows
/// the lock's record knows of the fabric's round trip under load. The client counts the
/// round trips as the creator did ([`ConfigRecord::t_wait_round_trips`]).
pub fn rtt_for_t_wait(t_wait: Duration, round_trips: u32) -> Duration {
    t_wait.div_f64(f64::from(round_trips.max(1)) * T_WAIT_RTT_FACTOR)
}

/// Threads of the load under which [`t_wait_under_load`] measures the round trip: twice the
/// cores (at least 4), enough to keep every core busy with clients and, on `tcp`, the server
/// threads that execute their verbs.
pub fn rtt_load_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    (2 * cores).max(4)
}

/// Reads each load thread posts in [`t_wait_under_load`].
pub const RTT_LOAD_SAMPLES: usize = 500;

/// `T_wait` for clients that reach locks shaped as `config` says (their tallest tree and `m`)
/// through `connector`: [`t_wait_for`] of the 90th percentile round trip measured under load
/// ([`fabric::measure_rtt_under_load`], reading the word at `addr`), for
/// [`CitronConfig::t_wait_round_trips`] round trips.
///
/// Why loaded and why p90: inequality (1) is tested only by clients that conflict, hence busy
/// ones, and a time-limit abort costs a whole attempt, so the reserve per round trip must cover
/// most round trips under load, not the idle median. Measured on the 2-core test VM over tcp,
/// 8 threads, mixed ranges (`citronfs bench locks`): the idle single-thread median gave
/// `T_wait` anywhere from 45 µs (abort rate 0.48) to 600 µs from run to run; fixed values of
/// 100/200/300/500 µs gave abort rates 0.05/0.03/0.02/0.02 and equal throughput within noise,
/// while 1 ms and 3 ms lost 10% and 40% to non-leaf holders waiting out phase (d).
pub fn t_wait_under_load(
    connector: &dyn fabric::Connector,
    addr: RemoteAddr,
    config: &CitronConfig,
) -> Result<(Duration, fabric::RttProfile), LockError> {
    let masked = connector.connect()?.capabilities().masked_atomics;
    let round_trips = config.t_wait_round_trips(masked)?;
    let profile =
        fabric::measure_rtt_under_load(connector, addr, rtt_load_threads(), RTT_LOAD_SAMPLES)?;
    Ok((t_wait_for(profile.p90, round_trips), profile))
}

/// A bump allocator over a zeroed stretch of a region (tests, single-process use). Never frees.
#[derive(Debug)]
pub struct BumpAllocator {
    base: RemoteAddr,
    len: u64,
    next: AtomicU64,
}

impl BumpAllocator {
    /// Serves `len` bytes from `base` (which must be zeroed and unused otherwise).
    pub fn new(base: RemoteAddr, len: u64) -> Self {
        Self {
            base,
            len,
            next: AtomicU64::new(0),
        }
    }

    /// Bytes handed out so far.
    pub fn used(&self) -> u64 {
        self.next.load(Ordering::SeqCst)
    }
}

impl LockWordAllocator for BumpAllocator {
    fn allocate(&self, words: u64) -> Result<RemoteAddr, LockError> {
        let bytes = words
            .checked_mul(8)
            .ok_or_else(|| LockError::Config("allocation too large".into()))?;
        let start = self.next.fetch_add(bytes, Ordering::SeqCst);
        if start.checked_add(bytes).is_none_or(|end| end > self.len) {
            return Err(LockError::Config(format!(
                "tree allocator exhausted: {bytes} bytes wanted, {} of {} used",
                start, self.len
            )));
        }
        Ok(self.base.add(start))
    }
}

/// A bump allocator whose cursor lives in remote memory, so that every client of a lock —
/// threads and processes, on any backend — allocates from one zeroed area (Alg. 4 l. 3 without
/// a server CPU: tests, and deployments that pre-provision the tree's growth room).
///
/// Allocation is one FAA of the request's byte count on the cursor word; the old value is the
/// offset handed out. Concurrent allocations therefore get disjoint stretches. A request that
/// does not fit is refused (the cursor stays past the end, so every later one is refused too);
/// the area is never freed. The creator must zero the cursor and the area once
/// ([`FabricBumpAllocator::format`]); a region registered fresh is zeroed already.
pub struct FabricBumpAllocator {
    endpoint: std::sync::Mutex<Box<dyn fabric::Endpoint>>,
    cursor: RemoteAddr,
    area: RemoteAddr,
    len: u64,
}

impl std::fmt::Debug for FabricBumpAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricBumpAllocator")
            .field("cursor", &self.cursor)
            .field("area", &self.area)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl FabricBumpAllocator {
    /// Serves `len` bytes from `area`, with its cursor (bytes handed out) at `cursor`; the verbs
    /// go through `endpoint`. `cursor` must not lie inside the area.
    pub fn new(
        endpoint: Box<dyn fabric::Endpoint>,
        cursor: RemoteAddr,
        area: RemoteAddr,
        len: u64,
    ) -> Self {
        Self {
            endpoint: std::sync::Mutex::new(endpoint),
            cursor,
            area,
            len,
        }
    }

    /// Zeroes the cursor and the area (once, by the creator, before any client allocates).
    pub fn format(
        endpoint: &mut dyn fabric::Endpoint,
        cursor: RemoteAddr,
        area: RemoteAddr,
        len: u64,
    ) -> Result<(), LockError> {
        use fabric::EndpointExt;
        let chunk = vec![0u8; len.min(1 << 20) as usize];
        let mut offset = 0;
        while offset < len {
            let n = (len - offset).min(chunk.len() as u64) as usize;
            endpoint.write(area.add(offset), &chunk[..n])?;
            offset += n as u64;
        }
        endpoint.write_u64(cursor, 0)?;
        Ok(())
    }

    /// Bytes handed out so far, as the cursor says (may exceed the area after a refusal).
    pub fn used(&self) -> Result<u64, LockError> {
        use fabric::EndpointExt;
        let mut ep = self
            .endpoint
            .lock()
            .map_err(|_| LockError::Config("allocator endpoint poisoned".into()))?;
        Ok(ep.read_u64(self.cursor)?)
    }
}

impl LockWordAllocator for FabricBumpAllocator {
    fn allocate(&self, words: u64) -> Result<RemoteAddr, LockError> {
        use fabric::EndpointExt;
        let bytes = words
            .checked_mul(8)
            .filter(|b| *b <= self.len)
            .ok_or_else(|| LockError::Config("allocation too large".into()))?;
        let start = {
            let mut ep = self
                .endpoint
                .lock()
                .map_err(|_| LockError::Config("allocator endpoint poisoned".into()))?;
            ep.faa(self.cursor, bytes)?
        };
        // The cursor is remote data: check the arithmetic rather than trust it.
        if start.checked_add(bytes).is_none_or(|end| end > self.len) {
            return Err(LockError::Config(format!(
                "tree allocator exhausted: {bytes} bytes wanted, {start} of {} used",
                self.len
            )));
        }
        Ok(self.area.add(start))
    }
}

/// An allocator that always refuses (scale-up disabled).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoAllocator;

impl LockWordAllocator for NoAllocator {
    fn allocate(&self, _words: u64) -> Result<RemoteAddr, LockError> {
        Err(LockError::Config("this lock has no tree allocator".into()))
    }
}

/// What the creator of a lock decides for every client ([`super::Citron::create`]).
///
/// Limits: at most 32767 outstanding requests on one tree node at once (the 15-bit counters of
/// §3.4); `m` at most 6 (scale-up tags, see `layout`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CitronConfig {
    /// Lock units the tree covers at first (`N`); rounded up to `64·4^(H-1)`, at least 256.
    pub unit_count: u64,
    /// Meet-in-the-middle distance `m` (§3.5.5), 1..=6; default 4.
    pub m: u32,
    /// `T_wait` override; `None` derives it from the creating endpoint's measured round-trip time
    /// with [`t_wait_for_rtt`]. Give it explicitly when clients reach the lock over a slower
    /// fabric than the creator does.
    pub t_wait: Option<Duration>,
    /// The lease (§3.10): a lock must be released within it; a holder silent for longer is
    /// presumed dead and repaired.
    pub t_lease: Duration,
    /// Scale-ups never grow the tree past this many units (ranges ending beyond stay on the
    /// spillover mutex and are not ORed into the maximizer).
    pub max_unit_count: u64,
    /// Least growth of one scale-up, in levels (1 = 4×, §3.9.1).
    pub min_scale_levels: u32,
}

impl CitronConfig {
    /// The tallest tree this lock may grow to ([`layout::tallest_height`]).
    pub fn tallest_height(&self) -> Result<u32, LockError> {
        let height = layout::height_for(self.unit_count).ok_or_else(|| {
            LockError::Config(format!("{} units exceed the largest tree", self.unit_count))
        })?;
        Ok(layout::tallest_height(height, self.max_unit_count))
    }

    /// The round trips this lock's `T_wait` reserves where the fabric's masked atomics are
    /// `masked` ([`t_wait_round_trips`] for its tallest tree and `m`).
    pub fn t_wait_round_trips(&self, masked: fabric::MaskedAtomics) -> Result<u32, LockError> {
        Ok(t_wait_round_trips(masked, self.tallest_height()?, self.m))
    }
}

impl Default for CitronConfig {
    fn default() -> Self {
        Self {
            unit_count: 1 << 16,
            m: 4,
            t_wait: None,
            t_lease: Duration::from_millis(500),
            max_unit_count: 1 << 30,
            min_scale_levels: 1,
        }
    }
}

/// What each client chooses for itself ([`super::CitronClient::open`]).
#[derive(Clone)]
pub struct ClientOptions {
    /// Most nodes a range is split into (§3.5.1); default 2.
    pub k: usize,
    /// The fast path of §3.8 (batched phases, explicit locking of leaf children); default on.
    pub fast_path: bool,
    /// Scale the tree up when an out-of-bound request finds the maximizer set (Alg. 4).
    pub auto_scale_up: bool,
    /// A leaf's masked CAS failing for this long escalates to its parent (§3.5.4, Alg. 2 l. 23).
    pub starvation_after: Duration,
    /// A request holding some of its nodes gives them back and starts over when it has waited
    /// this long in a ticket queue for the next one (deadlock avoidance, see `acquire`).
    pub restart_after: Duration,
    /// First backoff bound between polls (about a round trip, SMART §4.3).
    pub backoff_base: Duration,
    /// Backoff truncation.
    pub backoff_max: Duration,
    /// Called right before this client breaks another client's hold (any lease recovery write
    /// of §3.10: ticket break-in, `DCnt` repair, leaf zeroing, spillover-mutex repair); see
    /// [`crate::Fence`]. A failing fence keeps the hold unbroken for now. Default: none.
    pub fence: Option<std::sync::Arc<dyn crate::fence::Fence>>,
    /// Where acquisitions run: here, one-sided, or at the lock tree's host in one round trip
    /// ([`super::hosted`]); default [`Hosting::Auto`](super::Hosting::Auto).
    pub hosting: super::Hosting,
    /// Who this client is to the others' lease recovery: written with every node it occupies
    /// (`layout`, "Owner word"; its low 48 bits), so that a waiter can ask its
    /// [`crate::Fence::holder_gone`] about the holder instead of waiting out the lease. The
    /// file system gives its meta session. Default: none (no record is written; a waiter
    /// behind this client waits out the lease).
    pub owner: Option<u64>,
}

impl std::fmt::Debug for ClientOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientOptions")
            .field("k", &self.k)
            .field("fast_path", &self.fast_path)
            .field("auto_scale_up", &self.auto_scale_up)
            .field("starvation_after", &self.starvation_after)
            .field("restart_after", &self.restart_after)
            .field("backoff_base", &self.backoff_base)
            .field("backoff_max", &self.backoff_max)
            .field("fence", &self.fence.as_ref().map(|_| "Fence"))
            .field("hosting", &self.hosting)
            .field("owner", &self.owner)
            .finish()
    }
}

/// Equal options: equal fields, and the same fence object (or none).
impl PartialEq for ClientOptions {
    fn eq(&self, other: &Self) -> bool {
        self.k == other.k
            && self.fast_path == other.fast_path
            && self.auto_scale_up == other.auto_scale_up
            && self.starvation_after == other.starvation_after
            && self.restart_after == other.restart_after
            && self.backoff_base == other.backoff_base
            && self.backoff_max == other.backoff_max
            && self.hosting == other.hosting
            && self.owner == other.owner
            && match (&self.fence, &other.fence) {
                (None, None) => true,
                (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            k: 2,
            fast_path: true,
            auto_scale_up: true,
            starvation_after: Duration::from_millis(2),
            restart_after: Duration::from_millis(1),
            backoff_base: Duration::from_micros(1),
            backoff_max: Duration::from_micros(256),
            fence: None,
            hosting: super::Hosting::Auto,
            owner: None,
        }
    }
}

/// One scale-up (or scale-down) in the record's history; releasers look up the tag they find on
/// a node here to know where a scale-up copied their notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Tree height before.
    pub before: u32,
    /// Tree height after.
    pub after: u32,
    /// The tag written into `Exp`.
    pub tag: u8,
    /// Copies into ancestors outside the tree of this height were abandoned by a scale-down.
    pub cap: u32,
}

/// The shared configuration record, read one-sidedly by every client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigRecord {
    /// Bumped by every rewrite.
    pub epoch: u64,
    /// Height of the tree clients lock on.
    pub height: u32,
    /// `m`.
    pub m: u32,
    /// `T_wait` in nanoseconds.
    pub t_wait_ns: u64,
    /// `T_lease` in nanoseconds.
    pub t_lease_ns: u64,
    /// Scale-up limit, in units.
    pub max_units: u64,
    /// Least growth, in levels.
    pub min_scale_levels: u32,
    /// Storage, oldest first.
    pub segments: Vec<Segment>,
    /// Scale history, oldest first; the last one may be in progress (`pending`).
    pub events: Vec<Event>,
    /// A scale-up has written this record but not finished: `events.last()` and
    /// `segments.last()` belong to it, `height` is still the old one.
    pub pending: bool,
    /// The tag the next scale-up writes.
    pub next_tag: u8,
}

impl ConfigRecord {
    /// `N`: units the tree covers.
    pub fn units(&self) -> u64 {
        layout::tree_units(self.height)
    }

    /// `T_wait`.
    pub fn t_wait(&self) -> Duration {
        Duration::from_nanos(self.t_wait_ns)
    }

    /// `T_lease`.
    pub fn t_lease(&self) -> Duration {
        Duration::from_nanos(self.t_lease_ns)
    }

    /// The round trips this lock's `T_wait` reserves where the fabric's masked atomics are
    /// `masked`, counted as its creator counted them ([`CitronConfig::t_wait_round_trips`]:
    /// the tallest tree within [`ConfigRecord::max_units`], and `m`).
    pub fn t_wait_round_trips(&self, masked: fabric::MaskedAtomics) -> u32 {
        t_wait_round_trips(
            masked,
            layout::tallest_height(self.height, self.max_units),
            self.m,
        )
    }

    /// Seals the record for writing.
    pub fn seal(&self) -> Result<Vec<u8>, LockError> {
        let payload = postcard::to_stdvec(self)
            .map_err(|e| LockError::Config(format!("encoding config record: {e}")))?;
        let sealed = record::seal(&payload);
        if sealed.len() as u64 > RECORD_BYTES {
            return Err(LockError::Config(format!(
                "config record of {} bytes exceeds {RECORD_BYTES}: too many scale events",
                sealed.len()
            )));
        }
        Ok(sealed)
    }

    /// Opens a record read from remote memory: `Ok(None)` when the read tore (read again),
    /// [`LockError::Emptied`] when it is all zeros (no record was ever written there, or its
    /// server emptied the memory: every sealed config record has a nonzero length).
    pub fn open(bytes: &[u8]) -> Result<Option<Self>, LockError> {
        if bytes.iter().all(|&b| b == 0) {
            return Err(LockError::Emptied);
        }
        let Ok(payload) = record::open(bytes) else {
            return Ok(None);
        };
        let rec: ConfigRecord = match postcard::from_bytes(payload) {
            Ok(r) => r,
            // A checksum match with undecodable contents is not a torn read: the memory is not
            // a CITRON lock.
            Err(e) => return Err(LockError::Config(format!("bad config record: {e}"))),
        };
        rec.validate()?;
        Ok(Some(rec))
    }

    /// Checks what the client relies on, so that remote garbage never panics it.
    pub fn validate(&self) -> Result<(), LockError> {
        let bad = |why: &str| Err(LockError::Config(format!("bad config record: {why}")));
        if !(layout::MIN_HEIGHT..=layout::MAX_HEIGHT).contains(&self.height) {
            return bad("height");
        }
        if !(1..=6).contains(&self.m) {
            return bad("m");
        }
        if self.segments.is_empty() || self.segments[0].before != 0 {
            return bad("segments");
        }
        for s in &self.segments {
            if s.after > layout::MAX_HEIGHT || s.before >= s.after || s.cap > s.after {
                return bad("segment heights");
            }
        }
        for e in &self.events {
            if e.after > layout::MAX_HEIGHT || e.before >= e.after && e.tag != layout::SHRUNK_TAG {
                return bad("event heights");
            }
        }
        if self.t_wait_ns == 0 || self.t_lease_ns == 0 {
            return bad("times");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t_wait_derivation() {
        // The paper's testbed: 2 µs RTT -> 15 µs.
        assert_eq!(
            t_wait_for_rtt(Duration::from_micros(2)),
            Duration::from_micros(15)
        );
        // Fast in-process fabric: the floor.
        assert_eq!(
            t_wait_for_rtt(Duration::from_nanos(100)),
            Duration::from_micros(15)
        );
        // A software NIC at 40 µs: 300 µs.
        assert_eq!(
            t_wait_for_rtt(Duration::from_micros(40)),
            Duration::from_micros(300)
        );
        // And back: the round trip a record's T_wait stands for (the floor's, 2 µs, at least).
        assert_eq!(
            rtt_for_t_wait(Duration::from_micros(300), T_WAIT_ROUND_TRIPS),
            Duration::from_micros(40)
        );
        assert_eq!(
            rtt_for_t_wait(
                t_wait_for_rtt(Duration::from_nanos(100)),
                T_WAIT_ROUND_TRIPS
            ),
            Duration::from_micros(2)
        );
    }

    /// Where masked atomics are emulated, `T_wait` counts two round trips for each masked
    /// atomic of the phase-(c)+(d) batch: phase (c)'s `Occ` and a leaf's notifications, one
    /// more every `m` levels of the tallest tree the lock may grow to — not a fixed 4.
    #[test]
    fn emulated_masked_atomics_follow_the_tallest_tree() {
        use fabric::MaskedAtomics::{ClientEmulated, CpuCasLoop, Native};
        // The notifications counted are what `notify_targets` makes for the deepest node.
        let mut targets = Vec::new();
        for h in layout::MIN_HEIGHT..=layout::MAX_HEIGHT {
            for m in 1..=6 {
                layout::notify_targets(layout::Node::new(0, 0), h, m, &mut targets);
                assert_eq!(
                    emulated_masked_atomics(h, m),
                    1 + targets.len() as u32,
                    "h {h}, m {m}"
                );
            }
        }
        // m = 4: the parent, then every 4th ancestor down to level 3.
        assert_eq!(emulated_masked_atomics(2, 4), 2);
        assert_eq!(emulated_masked_atomics(5, 4), 2);
        assert_eq!(emulated_masked_atomics(6, 4), 3);
        assert_eq!(emulated_masked_atomics(13, 4), 4);
        assert_eq!(emulated_masked_atomics(layout::MAX_HEIGHT, 4), 8);
        // The file system's trees (CitronConfig::default: up to 2^30 units) keep the 4 the
        // constant had; a lock allowed to grow to the tallest tree counts 8.
        let fs = CitronConfig::default();
        assert_eq!(fs.tallest_height().unwrap(), 13);
        assert_eq!(fs.t_wait_round_trips(ClientEmulated).unwrap(), 3 + 2 * 4);
        let tallest = CitronConfig {
            max_unit_count: u64::MAX,
            ..CitronConfig::default()
        };
        assert_eq!(tallest.tallest_height().unwrap(), layout::MAX_HEIGHT);
        assert_eq!(
            tallest.t_wait_round_trips(ClientEmulated).unwrap(),
            3 + 2 * 8
        );
        // A small tree that may not grow: fewer notifications, but never under the floor.
        let small = CitronConfig {
            unit_count: 256,
            max_unit_count: 256,
            ..CitronConfig::default()
        };
        assert_eq!(small.tallest_height().unwrap(), 2);
        assert_eq!(
            small.t_wait_round_trips(ClientEmulated).unwrap(),
            T_WAIT_EMULATED_MIN_ROUND_TRIPS
        );
        // The safety checker's locks (1024 units, growing to 16384): the floor, not 3 + 2 · 2.
        let checker = CitronConfig {
            unit_count: 1024,
            max_unit_count: 16384,
            ..CitronConfig::default()
        };
        assert_eq!(
            checker.t_wait_round_trips(ClientEmulated).unwrap(),
            T_WAIT_EMULATED_MIN_ROUND_TRIPS
        );
        // A tree already taller than its limit is its own tallest.
        assert_eq!(layout::tallest_height(8, 256), 8);
        // Native and CPU masked atomics are one verb of the batch: the paper's 3.
        for masked in [Native, CpuCasLoop] {
            assert_eq!(
                tallest.t_wait_round_trips(masked).unwrap(),
                T_WAIT_ROUND_TRIPS
            );
        }
        // A client counts from the record what the creator counted from its config, and
        // inverts the T_wait with it.
        let rtt = Duration::from_micros(40);
        for config in [fs, tallest, small] {
            let round_trips = config.t_wait_round_trips(ClientEmulated).unwrap();
            let t_wait = t_wait_for(rtt, round_trips);
            let height = layout::height_for(config.unit_count).unwrap();
            let record = ConfigRecord {
                epoch: 1,
                height,
                m: config.m,
                t_wait_ns: t_wait.as_nanos() as u64,
                t_lease_ns: 1,
                max_units: config.max_unit_count,
                min_scale_levels: 1,
                segments: Vec::new(),
                events: Vec::new(),
                pending: false,
                next_tag: 1,
            };
            assert_eq!(record.t_wait_round_trips(ClientEmulated), round_trips);
            assert_eq!(rtt_for_t_wait(record.t_wait(), round_trips), rtt);
        }
    }
}
