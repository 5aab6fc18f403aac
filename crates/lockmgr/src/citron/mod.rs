//! CITRON: range locks on a segment tree of lock words, acquired and released with one-sided
//! verbs only (CITRON §3).
//!
//! - [`layout`]: the node bit layout, node naming, index arithmetic and storage of the tree;
//! - [`split`]: step 1, the tree knapsack (§3.5.1);
//! - `acquire` / `release`: step 2 phases (a)-(d) (Alg. 2), release (Alg. 3), the fast path
//!   (§3.8), starvation avoidance (§3.5.4) and lease recovery at the spin points (§3.10);
//! - `spillover`: the DSLR-style ticket mutex for `[N, ∞)` and the maximizer (§3.3, §3.9.1);
//! - [`lease`]: the lease deadline of every held part, derived from the recovery rules of §3.10,
//!   which bounds waits and makes late releases harmless;
//! - `scaleup`: Algorithm 4, the continuation of releases after a scale-up (Alg. 3 l. 10-12),
//!   and the blocking scale-down of §3.9.2;
//! - [`scheme`]: CITRON as one of [`crate::schemes`]: its description ([`CitronSpec`]), how a
//!   creator lays it out in memory and how a client opens it.
//!
//! Use: [`Citron::create`] initialises a lock's memory once; [`Citron::new`] then describes the
//! lock to clients, and [`Citron::client`] / [`Citron::boxed`] open one handle per thread. The
//! file system and the benchmarks go through [`crate::schemes::create`] and
//! [`crate::schemes::open`] instead, which call these.

mod acquire;
pub mod config;
pub mod hosted;
pub mod layout;
pub mod lease;
pub mod progress;
mod release;
mod scaleup;
pub mod scheme;
mod spillover;
pub mod split;

pub use config::{
    emulated_masked_atomics, rtt_for_t_wait, rtt_load_threads, t_wait_for, t_wait_for_rtt,
    t_wait_round_trips, t_wait_under_load, BumpAllocator, CitronConfig, ClientOptions,
    ConfigRecord, FabricBumpAllocator, NoAllocator,
};
pub use hosted::{CitronHost, Hosting};

use crate::backoff::{pause, Backoff, BackoffState, SLEEP_THRESHOLD};
use crate::carry::CarryingEndpoint;
use crate::scheme::{check_range, LockError, LockId, RangeLock};
use crate::schemes::LockWordAllocator;
use crate::stats::LockStats;
use config::{MAXIMIZER_OFFSET, RECORD_BYTES, SPILLOVER_OFFSET, TREE_OFFSET};
use fabric::{measure_rtt, Batch, Completions, Connector, Endpoint, EndpointExt, RemoteAddr};
use layout::{Node, Segment};
pub use progress::{Phase, Progress, ProgressSnapshot};
use rand::rngs::SmallRng;
use rand::SeedableRng;
pub use scheme::{CitronDefaults, CitronGrowth, CitronSpec};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What [`Citron::create`] laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CitronLayout {
    /// Where the lock lives (its config record).
    pub base: RemoteAddr,
    /// `N`: units the tree covers.
    pub unit_count: u64,
    /// Tree height.
    pub height: u32,
    /// The `T_wait` every client uses.
    pub t_wait: Duration,
    /// Bytes used from `base`.
    pub bytes: u64,
}

/// A CITRON lock as clients see it: where it is, how to reach it, how it grows. Cheap to clone;
/// opens one [`CitronClient`] per thread.
#[derive(Clone)]
pub struct Citron {
    connector: Arc<dyn Connector>,
    base: RemoteAddr,
    allocator: Arc<dyn LockWordAllocator>,
    options: ClientOptions,
}

/// Zeros that [`Citron::create`] writes a new lock's memory with, 64 KiB per verb.
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

impl Citron {
    /// Bytes of memory from `base` that a lock covering `unit_count` units needs at first.
    pub fn bytes_needed(unit_count: u64) -> Result<u64, LockError> {
        let h = layout::height_for(unit_count).ok_or_else(|| {
            LockError::Config(format!("{unit_count} units exceed the largest tree"))
        })?;
        // The nodes, their owner records and share words (`layout`, "Owner word", "Share word").
        Ok(TREE_OFFSET + layout::STORAGE_WORDS_PER_NODE * layout::tree_nodes(h) * 8)
    }

    /// Initialises a lock's memory at `base` (which must be [`Citron::bytes_needed`] bytes and
    /// not in use by any client): the config record, the spillover mutex, the maximizer and the
    /// tree. Measures the round-trip time through `endpoint` to derive `T_wait` unless
    /// `config.t_wait` is given.
    pub fn create(
        endpoint: &mut dyn Endpoint,
        base: RemoteAddr,
        config: CitronConfig,
    ) -> Result<CitronLayout, LockError> {
        if !(1..=6).contains(&config.m) {
            return Err(LockError::Config(format!(
                "m = {} (must be 1..=6)",
                config.m
            )));
        }
        if config.t_lease.is_zero() {
            return Err(LockError::Config("T_lease must be positive".into()));
        }
        let height = layout::height_for(config.unit_count).ok_or_else(|| {
            LockError::Config(format!(
                "{} units exceed the largest tree",
                config.unit_count
            ))
        })?;
        let bytes = Self::bytes_needed(config.unit_count)?;
        // Zero everything (the record included), then publish the record: a client that opens
        // the lock too early finds no valid record rather than a half-built tree. Verbs of a
        // batch execute in posting order, so the record may share the zeros' last batch: a
        // file's first tree is a few hundred bytes, and its lock is made in one batch (the
        // meta server makes one per create; three batches and two zeroed buffers were a tenth
        // of a create's handler time).
        let mut batch = Batch::new();
        let mut offset = 0;
        while offset < bytes {
            let n = (bytes - offset).min(ZEROS.len() as u64);
            batch.write(base.add(offset), &ZEROS[..n as usize]);
            offset += n;
            // At most 1 MiB of zeros a batch.
            if batch.payload().len() >= 1 << 20 && offset < bytes {
                endpoint.execute(&batch, &mut Completions::new())?;
                batch.clear();
            }
        }
        let t_wait = match config.t_wait {
            Some(t) => t,
            None => {
                endpoint.execute(&batch, &mut Completions::new())?;
                batch.clear();
                measure_t_wait(endpoint, base, &config)?
            }
        };
        let record = ConfigRecord {
            epoch: 1,
            height,
            m: config.m,
            t_wait_ns: (t_wait.as_nanos() as u64).max(1),
            t_lease_ns: config.t_lease.as_nanos() as u64,
            max_units: config.max_unit_count,
            min_scale_levels: config.min_scale_levels.max(1),
            segments: vec![Segment {
                before: 0,
                after: height,
                cap: height,
                addr: base.add(TREE_OFFSET),
            }],
            events: Vec::new(),
            pending: false,
            next_tag: 1,
        };
        batch.write(base, &record.seal()?);
        endpoint.execute(&batch, &mut Completions::new())?;
        Ok(CitronLayout {
            base,
            unit_count: layout::tree_units(height),
            height,
            t_wait,
            bytes,
        })
    }

    /// Describes the lock at `base` to clients that reach it through `connector`; scale-ups get
    /// memory from `allocator`.
    pub fn new(
        connector: Arc<dyn Connector>,
        base: RemoteAddr,
        allocator: Arc<dyn LockWordAllocator>,
        options: ClientOptions,
    ) -> Self {
        Self {
            connector,
            base,
            allocator,
            options,
        }
    }

    /// Opens a client (one per thread) on its own endpoint.
    pub fn client(&self) -> Result<CitronClient, LockError> {
        CitronClient::open(
            self.connector.connect()?,
            self.base,
            self.allocator.clone(),
            self.options.clone(),
        )
    }

    /// [`Citron::client`], boxed behind the common trait.
    pub fn boxed(&self) -> Result<Box<dyn RangeLock>, LockError> {
        Ok(Box::new(self.client()?))
    }
}

/// `T_wait` (§3.5.5) for a lock shaped as `config` says at `base` as `endpoint` reaches it:
/// [`t_wait_for`] of the median of 64 reads of the spillover word, for the round trips the
/// endpoint's masked atomics take in the lock's tallest tree
/// ([`CitronConfig::t_wait_round_trips`]; what [`Citron::create`] does when no `T_wait` is
/// given).
pub(crate) fn measure_t_wait(
    endpoint: &mut dyn Endpoint,
    base: RemoteAddr,
    config: &CitronConfig,
) -> Result<Duration, LockError> {
    let round_trips = config.t_wait_round_trips(endpoint.capabilities().masked_atomics)?;
    Ok(t_wait_for(
        measure_rtt(endpoint, base.add(SPILLOVER_OFFSET), 64)?,
        round_trips,
    ))
}

/// A notification this client made (`DMax += 1` on `node`, Alg. 2 l. 31), to be released with
/// `DCnt += 1` (Alg. 3 l. 9).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Token {
    pub(crate) node: Node,
    pub(crate) addr: RemoteAddr,
    /// `Exp` tag of the node when the notification was made: a different tag at release means
    /// a scale-up copied the notification upwards (see `scaleup`).
    pub(crate) tag: u8,
    /// The earliest instant at which a phase-(d) waiter could repair `node`'s `DCnt` over this
    /// notification ([`lease::token_deadline`]); a release after it leaves `DCnt` alone.
    pub(crate) deadline: Instant,
    /// A shared acquisition's notification: `SMax` of the node's share word (`addr` is the
    /// share word), released with `SCnt += 1`.
    pub(crate) shared: bool,
}

/// What this client holds (or has done so far) on one tree node.
#[derive(Clone, Debug)]
pub(crate) struct HeldNode {
    pub(crate) node: Node,
    pub(crate) addr: RemoteAddr,
    /// Internal: a ticket was taken (TMax incremented) and is still ours to pass on: not skipped
    /// by a break-in (a ticket passed over is not ours, see `wait_ticket`).
    pub(crate) ticket: bool,
    /// Internal: the ticket's number (`TMax` as taken). Invariant: while `TCnt` equals it, only
    /// this client writes `TCnt` and `Occ` (by the bakery discipline) — except a break-in, which
    /// moves `TCnt` past it. So a release that compares `TCnt == ticket_no` (and `Occ` as we
    /// left it) takes effect exactly when the node is still ours.
    pub(crate) ticket_no: u64,
    /// Internal: the earliest instant at which a waiter could break in over the ticket/`Occ`
    /// ([`lease::word_deadline`]).
    pub(crate) word_deadline: Option<Instant>,
    /// Internal: Occ was set.
    pub(crate) occ: bool,
    /// `Exp` tag when Occ was set.
    pub(crate) occ_tag: u8,
    /// The node was the root of the tree of this height when occupied (its Occ is copied
    /// upwards by a scale-up, Alg. 4 l. 8).
    pub(crate) root_of: Option<u32>,
    /// Leaf: the bits held.
    pub(crate) leaf_mask: u64,
    /// Fast path: leaf children locked whole (§3.8, second optimisation).
    pub(crate) children: Vec<RemoteAddr>,
    /// Leaf bits and children: the earliest instant at which a leaf repair could zero them
    /// ([`lease::bits_deadline`]); a release after it leaves the leaves alone. `None` only while
    /// no bits are held.
    pub(crate) bits_deadline: Option<Instant>,
    /// Notifications made.
    pub(crate) tokens: Vec<Token>,
    /// Shared mode: the node's share word (`layout`, "Share word").
    pub(crate) share: Option<RemoteAddr>,
    /// Shared, internal: registered as a reader of the node (`RMax += 1`), to leave with
    /// `RCnt += 1`.
    pub(crate) readers: bool,
    /// The share word's tag when registering (a root's registration is copied by a scale-up).
    pub(crate) readers_tag: u8,
    /// The earliest instant at which a writer could repair the registration away
    /// ([`lease::token_deadline`]: the same `H·T_lease` stand-still as `DCnt`).
    pub(crate) readers_deadline: Option<Instant>,
    /// Shared, leaf: what was added to the leaf's share words (`layout::LeafShare::register`),
    /// empty if nothing; its deadline is `bits_deadline`.
    pub(crate) leaf_register: layout::LeafShare,
    /// Shared fast path on a node over leaves: the share words of the leaf children registered
    /// whole (every group); their deadline is `bits_deadline`.
    pub(crate) reader_children: Vec<RemoteAddr>,
}

impl HeldNode {
    pub(crate) fn new(node: Node, addr: RemoteAddr) -> Self {
        Self {
            node,
            addr,
            ticket: false,
            ticket_no: 0,
            word_deadline: None,
            occ: false,
            occ_tag: 0,
            root_of: None,
            leaf_mask: 0,
            children: Vec::new(),
            bits_deadline: None,
            tokens: Vec::new(),
            share: None,
            readers: false,
            readers_tag: 0,
            readers_deadline: None,
            leaf_register: layout::LeafShare::default(),
            reader_children: Vec::new(),
        }
    }

    /// The earliest lease deadline of what this node holds.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        let bits = (self.leaf_mask != 0
            || !self.children.is_empty()
            || !self.leaf_register.is_empty()
            || !self.reader_children.is_empty())
        .then_some(self.bits_deadline)
        .flatten();
        let word = self.ticket.then_some(self.word_deadline).flatten();
        let readers = self.readers.then_some(self.readers_deadline).flatten();
        self.tokens
            .iter()
            .map(|t| t.deadline)
            .chain(bits)
            .chain(word)
            .chain(readers)
            .min()
    }

    /// Phase (c) set `Occ` on this internal node (Alg. 2 l. 27); `old` is the word it replaced,
    /// `root_of` the tree height if the node was that tree's root.
    pub(crate) fn occupied(&mut self, old: u64, root_of: Option<u32>) {
        self.occ = true;
        self.occ_tag = layout::exp_tag(old);
        self.root_of = root_of;
    }
}

/// One lock held.
#[derive(Clone, Debug, Default)]
pub(crate) struct Held {
    /// The spillover mutex is held.
    pub(crate) spill: bool,
    /// Its ticket, and the earliest instant at which a waiter could break it
    /// ([`lease::spill_deadline`]).
    pub(crate) spill_ticket: u64,
    pub(crate) spill_deadline: Option<Instant>,
    /// Tree nodes held.
    pub(crate) nodes: Vec<HeldNode>,
    /// A scale-down to this height happens at release (§3.9.2).
    pub(crate) shrink_to: Option<u32>,
}

impl Held {
    /// The lock's lease deadline: the earliest of its parts' ([`RangeLock::lease_deadline`]).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.nodes
            .iter()
            .filter_map(HeldNode::deadline)
            .chain(self.spill.then_some(self.spill_deadline).flatten())
            .min()
    }
}

/// What [`CitronClient::audit`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Audit {
    /// Nodes not at rest (leaf bits set; internal: Occ set or a counter pair apart), with their
    /// words.
    pub busy_nodes: Vec<(Node, u64)>,
    /// Share words not at rest (readers registered, a counter pair apart), with their words
    /// (`layout`, "Share word"; the scale-up tag does not count); a leaf's, each of its share
    /// words that is not.
    pub busy_shares: Vec<(Node, u64)>,
    /// The spillover mutex is held or waited for.
    pub spillover_busy: bool,
    /// The spillover mutex's word (next ticket high, now serving low).
    pub spillover: u64,
    /// The maximizer's value.
    pub maximizer: u64,
}

impl Audit {
    /// Whether the tree and the mutex are at rest.
    pub fn at_rest(&self) -> bool {
        self.busy_nodes.is_empty() && self.busy_shares.is_empty() && !self.spillover_busy
    }
}

/// One thread's handle on a CITRON lock.
pub struct CitronClient {
    /// The lock's endpoint; it carries a caller's verbs in the acquisition's and the release's
    /// batches (`crate::carry`, [`RangeLock::acquire_with`]).
    ep: CarryingEndpoint,
    base: RemoteAddr,
    allocator: Arc<dyn LockWordAllocator>,
    opts: ClientOptions,
    rec: ConfigRecord,
    batch: Batch,
    out: Completions,
    held: HashMap<u64, Held>,
    next_id: u64,
    stats: LockStats,
    rng: SmallRng,
    /// Epoch at which a scale-up failed (allocation refused): not retried until it changes.
    scale_failed_epoch: Option<u64>,
    /// An occupied ancestor that phase (b) saw stand still for `T_lease` before it escalated
    /// to it (l. 18): the node, its `TCnt`/`Occ` as seen, and since when. The ticket wait on it
    /// that follows counts its stand-still from then, not from its own first read.
    suspected: Option<(Node, u64, Instant)>,
    /// Where the current acquisition is, for watchdogs ([`CitronClient::progress`]).
    progress: Arc<Progress>,
    /// Set when this client acquires at the host ([`hosted`]); its books of hosted locks.
    hosted: Option<hosted::Hosted>,
    /// Every poll costs the server's CPU a wake-up (`Capabilities::server_cpu_on_data_path`,
    /// tcp): backoffs start at a round trip instead of `backoff_base` (see `backoff`).
    polls_cost_server: bool,
    /// The endpoint's masked atomics: what the lock's `T_wait` counted round trips for
    /// ([`ConfigRecord::t_wait_round_trips`]).
    masked: fabric::MaskedAtomics,
    /// The mode of the acquisition in progress ([`RangeLock::acquire_mode`]).
    mode: crate::LockMode,
    /// A leaf writer kept out by readers: the leaf's share word, the readers' fields as last
    /// seen, and since when they stood still (`acquire::leaf_readers_stood`), across the
    /// attempts and aborts of one acquisition.
    leaf_readers_seen: Option<(RemoteAddr, layout::LeafShare, Instant)>,
    /// This client saw the lock's `READERS_SEEN` flag set (`layout`): from now on its
    /// writers read the share words of their ancestors and windows directly.
    readers_seen: bool,
}

impl CitronClient {
    /// Opens a client on `endpoint` for the lock at `base` (reads its config record).
    pub fn open(
        mut endpoint: Box<dyn Endpoint>,
        base: RemoteAddr,
        allocator: Arc<dyn LockWordAllocator>,
        options: ClientOptions,
    ) -> Result<Self, LockError> {
        if !(1..=split::MAX_K).contains(&options.k) {
            return Err(LockError::Config(format!(
                "k = {} (must be 1..={})",
                options.k,
                split::MAX_K
            )));
        }
        let rec = read_record(endpoint.as_mut(), base, Duration::from_secs(1))?;
        let endpoint_capabilities = endpoint.capabilities();
        Ok(Self {
            ep: CarryingEndpoint::new(endpoint),
            base,
            allocator,
            opts: options,
            rec,
            batch: Batch::new(),
            out: Completions::new(),
            held: HashMap::new(),
            next_id: 1,
            stats: LockStats::default(),
            rng: SmallRng::from_os_rng(),
            scale_failed_epoch: None,
            suspected: None,
            progress: Arc::default(),
            hosted: None,
            polls_cost_server: endpoint_capabilities.server_cpu_on_data_path,
            masked: endpoint_capabilities.masked_atomics,
            mode: crate::LockMode::Exclusive,
            leaf_readers_seen: None,
            readers_seen: false,
        })
    }

    /// The configuration this client currently works with.
    pub fn record(&self) -> &ConfigRecord {
        &self.rec
    }

    /// `N` as this client knows it.
    pub fn unit_count(&self) -> u64 {
        self.rec.units()
    }

    /// A live view of where this client's current acquisition is (phase, node, attempts), for a
    /// watchdog on another thread to print when an acquisition hangs.
    pub fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }

    /// The endpoint's counters (round trips, verbs).
    pub fn endpoint_stats(&self) -> fabric::EndpointStats {
        self.ep.stats()
    }

    /// Drops the bookkeeping of a held lock without releasing it: what a client that dies
    /// holding it leaves behind (for recovery tests, §3.10).
    pub fn forget(&mut self, id: LockId) -> Result<(), LockError> {
        if self.hosted.is_some() {
            return self.forget_hosted(id);
        }
        self.held
            .remove(&id.0)
            .map(|_| ())
            .ok_or(LockError::NotHeld(id))
    }

    /// Re-reads the config record.
    pub fn refresh(&mut self) -> Result<(), LockError> {
        self.rec = read_record(&mut self.ep, self.base, self.rec.t_lease() * 4)?;
        Ok(())
    }

    /// Reads every node of the current tree, the spillover mutex and the maximizer, and reports
    /// what is not at rest. Meant for tests and debugging with no lock held or in flight: then
    /// every counter pair must match and nothing may be occupied or set.
    pub fn audit(&mut self) -> Result<Audit, LockError> {
        self.refresh()?;
        let h = self.rec.height;
        let mut audit = Audit::default();
        for hgt in 0..h {
            let count = layout::pow4(h - 1 - hgt);
            let mut pos = 0;
            while pos < count {
                let n = (count - pos).min(1 << 16);
                self.batch.clear();
                let mut reads = Vec::with_capacity(n as usize);
                for p in pos..pos + n {
                    let node = Node::new(hgt, p);
                    reads.push((
                        node,
                        self.batch.read(self.node_addr(node)?, 8),
                        self.batch
                            .read(self.share_addr(node)?, layout::LEAF_SHARE_BYTES),
                    ));
                }
                self.exec()?;
                for (node, r, sr) in reads {
                    if node.is_leaf() {
                        let ls = layout::LeafShare::read(&self.out, sr, 0);
                        audit
                            .busy_shares
                            .extend(ls.busy_words().map(|sw| (node, sw)));
                    } else {
                        let sw = self.out.word(sr, 0);
                        if sw & !layout::EXP != 0
                            && (layout::dcnt(sw) != layout::dmax(sw)
                                || layout::tcnt(sw) != layout::tmax(sw))
                        {
                            audit.busy_shares.push((node, sw));
                        }
                    }
                    let w = self.out.word(r, 0);
                    let busy = if node.is_leaf() {
                        w != 0
                    } else {
                        layout::dcnt(w) != layout::dmax(w)
                            || layout::tcnt(w) != layout::tmax(w)
                            || layout::occ(w)
                    };
                    if busy {
                        audit.busy_nodes.push((node, w));
                    }
                }
                pos += n;
            }
        }
        let spill = self.ep.read_u64(self.spill_addr())?;
        audit.spillover_busy = (spill >> 32) != (spill & 0xFFFF_FFFF);
        audit.spillover = spill;
        audit.maximizer = self.ep.read_u64(self.maximizer_addr())?;
        Ok(audit)
    }

    /// Puts every word that [`CitronClient::audit`] finds busy back at rest — leaf bits
    /// cleared; on internal nodes `Occ` cleared, `TCnt := TMax`, `DCnt := DMax`, the `Exp` tag
    /// kept; the spillover mutex's served half set to its next ticket — each with a CAS that
    /// expects the word as audited. Returns the nodes it reset, with their words as they were.
    ///
    /// Only while no client holds, waits for or is acquiring the lock: it is how an operator
    /// who knows that (`citronfs fsck --at-rest --repair`) clears what dead clients left,
    /// which lazy recovery would break only when a request needs it. A word that changed since
    /// the audit means someone is active: it is left alone and the reset fails.
    pub fn reset_to_rest(&mut self) -> Result<Vec<(Node, u64)>, LockError> {
        let audit = self.audit()?;
        let mut reset = Vec::new();
        for &(node, word) in &audit.busy_nodes {
            let rest = if node.is_leaf() {
                0
            } else {
                (word & layout::EXP)
                    | (layout::tmax(word) << layout::TCNT_SHIFT)
                    | (layout::tmax(word) << layout::TMAX_SHIFT)
                    | (layout::dmax(word) << layout::DCNT_SHIFT)
                    | (layout::dmax(word) << layout::DMAX_SHIFT)
            };
            let addr = self.node_addr(node)?;
            let old = self.ep.cas(addr, word, rest)?;
            if old != word {
                return Err(LockError::Config(format!(
                    "node {node:?} changed while being reset ({word:#x} -> {old:#x}): the lock \
                     is in use"
                )));
            }
            reset.push((node, word));
        }
        if audit.spillover_busy {
            let word = audit.spillover;
            let rest = (word & !0xFFFF_FFFF) | (word >> 32);
            let old = self.ep.cas(self.spill_addr(), word, rest)?;
            if old != word {
                return Err(LockError::Config(
                    "the spillover mutex changed while being reset: the lock is in use".into(),
                ));
            }
        }
        Ok(reset)
    }

    fn spill_addr(&self) -> RemoteAddr {
        self.base.add(SPILLOVER_OFFSET)
    }

    fn maximizer_addr(&self) -> RemoteAddr {
        self.base.add(MAXIMIZER_OFFSET)
    }

    fn share_addr(&self, node: Node) -> Result<RemoteAddr, LockError> {
        layout::share_addr(&self.rec.segments, node).ok_or_else(|| {
            LockError::Config(format!("node {node:?} has no storage in the config record"))
        })
    }

    /// Whether the acquisition in progress is shared.
    fn shared(&self) -> bool {
        self.mode == crate::LockMode::Shared
    }

    fn node_addr(&self, node: Node) -> Result<RemoteAddr, LockError> {
        layout::node_addr(&self.rec.segments, node).ok_or_else(|| {
            LockError::Config(format!("node {node:?} has no storage in the config record"))
        })
    }

    /// The backoff between polls (SMART §4.3: the first bound "about a round trip").
    /// Where a poll costs the server a wake-up (tcp), the first bound is at least the round
    /// trip the lock's `T_wait` was derived from ([`config::rtt_for_t_wait`]): polling faster
    /// than a round trip only queues polls at the server, each a wake-up that delays the holder
    /// it waits for. Where polls cost no server (mem, shm, the host of a hosted acquisition),
    /// `backoff_base` as configured.
    fn backoff(&self) -> BackoffState {
        let base = if self.polls_cost_server {
            self.opts.backoff_base.max(config::rtt_for_t_wait(
                self.rec.t_wait(),
                self.rec.t_wait_round_trips(self.masked),
            ))
        } else {
            self.opts.backoff_base
        };
        BackoffState::new(Backoff {
            base,
            max: self.opts.backoff_max.max(base),
            sleep_threshold: SLEEP_THRESHOLD,
        })
    }

    fn exec(&mut self) -> Result<(), LockError> {
        self.ep.execute(&self.batch, &mut self.out)?;
        Ok(())
    }

    fn acquire_inner(&mut self, range: Range<u64>) -> Result<(LockId, bool), LockError> {
        check_range(&range)?;
        self.progress.start();
        loop {
            let mut held = Held::default();
            if range.end > self.rec.units() {
                self.progress.set(Phase::Spillover);
                // Alg. 1 l. 3-4: out-of-bound part.
                let Some((ticket, deadline)) = self.acquire_spillover(range.end)? else {
                    continue; // the tree changed (or we scaled it up): start over.
                };
                held.spill = true;
                held.spill_ticket = ticket;
                held.spill_deadline = Some(deadline);
                self.stats.spillover += 1;
                failpoint!("lockmgr::citron::spillover_held");
            }
            let n = self.rec.units();
            let mut fast = true;
            if range.start < n {
                // Alg. 1 l. 5-6: in-bound part.
                if let Err(e) =
                    self.acquire_on_tree(range.start, range.end.min(n), &mut held, &mut fast)
                {
                    let _ = self.release_held(&held);
                    return Err(e);
                }
            }
            // Every part of the lock must still be within its lease: a part whose deadline has
            // passed (we were paused, or waited too long for a later node) may already belong
            // to someone else — a ticket passed over by a break-in, a notification repaired by
            // a phase-(d) waiter (§3.10). Then the grant is lost: give everything back (the
            // late release leaves whatever was broken alone) and start over. One clock read.
            if held.deadline().is_some_and(|d| Instant::now() >= d) {
                self.stats.passed_over += 1;
                self.progress.aborted(7);
                tracing::warn!(
                    ?range,
                    "lock acquired only after its lease deadline (paused?); giving it back and starting over"
                );
                self.release_held(&held)?;
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            self.held.insert(id, held);
            return Ok((LockId(id), fast));
        }
    }
}

/// Reads and opens the config record, re-reading torn copies (for up to `patience`).
pub(crate) fn read_record(
    ep: &mut dyn Endpoint,
    base: RemoteAddr,
    patience: Duration,
) -> Result<ConfigRecord, LockError> {
    let start = Instant::now();
    let mut delay = Duration::from_micros(1);
    loop {
        let bytes = ep.read(base, RECORD_BYTES as usize)?;
        if let Some(rec) = ConfigRecord::open(&bytes)? {
            return Ok(rec);
        }
        if start.elapsed() > patience {
            return Err(LockError::Config(
                "config record stays torn or missing (lock not created?)".into(),
            ));
        }
        pause(delay, SLEEP_THRESHOLD);
        delay = (delay * 2).min(Duration::from_millis(1));
    }
}

impl CitronClient {
    /// An acquisition carrying `extra` at the end of every batch it executes, the results of
    /// the last one into `out` ([`RangeLock::acquire_with`]; see `acquire`'s module docs for
    /// which batch grants the lock). A client that acquires at the host ([`hosted`]) runs the
    /// acquisition there in one call, `extra` executed by the host right after the grant.
    fn take(
        &mut self,
        range: Range<u64>,
        extra: &Batch,
        out: &mut Completions,
    ) -> Result<LockId, LockError> {
        self.acquire_mode_with(range, crate::LockMode::Exclusive, extra, out)
    }

    /// [`CitronClient::take`] in `mode`: `extra` carried as [`RangeLock::acquire_with`] does.
    pub fn acquire_mode_with(
        &mut self,
        range: Range<u64>,
        mode: crate::LockMode,
        extra: &Batch,
        out: &mut Completions,
    ) -> Result<LockId, LockError> {
        self.leaf_readers_seen = None;
        self.mode = mode;
        if self.hosted.is_some() {
            return self.acquire_hosted(range, mode, extra, out);
        }
        let start = Instant::now();
        let before = self.ep.stats();
        self.ep.carry_after(extra);
        let result = self.acquire_inner(range);
        let carried = self.ep.finish(result.is_ok(), out);
        self.progress.set(Phase::Idle);
        let spent = self.ep.stats().since(&before);
        self.stats.acquire.add(&spent);
        self.stats.acquire_time += start.elapsed();
        let (id, fast) = result?;
        self.stats.acquisitions += 1;
        if fast && self.opts.fast_path {
            self.stats.fast_path += 1;
        }
        if let Err(e) = carried {
            // Held, but the caller cannot use it without its verbs' results: give it back.
            let _ = self.give_back(id, &Batch::new(), &mut Completions::new());
            return Err(e.into());
        }
        Ok(id)
    }

    /// A release carrying `extra` at the head of its first batch ([`RangeLock::release_with`]).
    /// At the host ([`hosted`]): `extra` executed by the host before the release, in one call;
    /// without `extra`, the release is posted.
    fn give_back(
        &mut self,
        id: LockId,
        extra: &Batch,
        out: &mut Completions,
    ) -> Result<(), LockError> {
        if self.hosted.is_some() {
            return self.release_hosted(id, extra, out);
        }
        let held = self.held.remove(&id.0).ok_or(LockError::NotHeld(id))?;
        let before = self.ep.stats();
        self.ep.carry_before(extra);
        let result = self.release_held(&held);
        let carried = self.ep.finish(result.is_ok(), out);
        let spent = self.ep.stats().since(&before);
        self.stats.release.add(&spent);
        result?;
        carried?;
        self.stats.releases += 1;
        Ok(())
    }
}

impl RangeLock for CitronClient {
    crate::carry::carrying_lock_methods!();

    /// Carried as the other calls are, in `mode` one-sided and at the host alike
    /// ([`CitronClient::acquire_mode_with`]).
    fn acquire_mode_with(
        &mut self,
        range: Range<u64>,
        mode: crate::LockMode,
        extra: &Batch,
        out: &mut Completions,
        _fallback: &mut dyn fabric::Endpoint,
    ) -> Result<LockId, LockError> {
        CitronClient::acquire_mode_with(self, range, mode, extra, out)
    }

    fn modes(&self) -> &'static [crate::LockMode] {
        crate::scheme::EXCLUSIVE_AND_SHARED
    }

    /// Shared: see `docs/SHARED_LOCKS.md`. A client that acquires at the host ([`hosted`])
    /// has the host run the same protocol in the same mode.
    fn acquire_mode(
        &mut self,
        range: Range<u64>,
        mode: crate::LockMode,
    ) -> Result<LockId, LockError> {
        self.acquire_mode_with(range, mode, &Batch::new(), &mut Completions::new())
    }

    /// One-sided, the release's first batch carries `extra`; at the host the release is posted
    /// and `extra` would take a round trip of its own (`release_hosted`).
    fn release_carries_verbs(&self) -> bool {
        self.hosted.is_none()
    }

    /// At the host: the host executes `extra` after its grant, once. One-sided, `extra` rides
    /// in every batch of the acquisition, granting or not.
    fn extra_runs_once_granted(&self) -> bool {
        self.hosted.is_some()
    }

    /// At the host, `extra` rides in the posted release where the host takes it
    /// ([`CitronClient::release_hosted_forgetting`]); one-sided, at the head of the release's
    /// first batch, as [`RangeLock::release_with`].
    fn release_forgetting(
        &mut self,
        id: LockId,
        extra: &Batch,
        _fallback: &mut dyn fabric::Endpoint,
    ) -> Result<(), LockError> {
        if self.hosted.is_some() {
            return self.release_hosted_forgetting(id, extra);
        }
        self.give_back(id, extra, &mut Completions::new())
    }

    fn stats(&self) -> LockStats {
        self.stats
    }

    fn progress(&self) -> Option<crate::scheme::ProgressFn> {
        let progress = self.progress.clone();
        Some(Arc::new(move || format!("{:?}", progress.snapshot())))
    }

    /// The earliest of the lock's parts' deadlines (see `lease`): the file system must not post
    /// data verbs under the lock past it.
    fn lease_deadline(&self, id: LockId) -> Option<Instant> {
        if self.hosted.is_some() {
            return self.hosted_deadline(id);
        }
        self.held.get(&id.0).and_then(Held::deadline)
    }

    fn scheme(&self) -> &'static str {
        scheme::name(self.opts.fast_path)
    }
}
