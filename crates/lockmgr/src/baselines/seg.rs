//! The `seg` baseline: static segmentation (CITRON Table 1 "SS", \[35\]).
//!
//! The address space is cut into fixed-size segments of `segment_units` units, each guarded by a
//! [`TicketLock`]. A range locks every segment it touches, in ascending lock-index order, so two
//! clients never wait for each other in a cycle (the classic ordered-locking argument: a client
//! waiting for lock `j` holds only locks below `j`, and whoever holds `j` never waits for a lock
//! below `j`).
//!
//! # Wrapping
//!
//! Only `segments` lock words exist (the region must stay small even for a 2^64-unit address
//! space). Segment `s` is guarded by lock `s mod segments`. This is still safe: two ranges that
//! share a unit share its segment, hence its lock. It only adds false conflicts between segments
//! that are `segments` apart. One range may touch two segments that wrap onto the *same* lock;
//! the client therefore takes each distinct lock exactly once (a ticket lock is not reentrant:
//! taking it twice would deadlock on itself), in ascending lock-index order, which keeps the
//! ordering argument above intact. A range touching at least `segments` segments takes every
//! lock.
//!
//! Acquiring is one round trip per lock when uncontended (a ticket must be served before the next
//! is taken; taking tickets speculatively in one batch could interleave with another client and
//! deadlock). Releasing is one round trip for up to [`MAX_BATCH_VERBS`] locks.

use super::ticket::{TicketConfig, TicketLock};
use super::ClientCore;
use crate::scheme::{check_range, LockError, LockId, RangeLock};
use crate::schemes::{write_spec, Fields, LockMemory, LockScheme};
use crate::stats::LockStats;
use fabric::batch::MAX_BATCH_VERBS;
use fabric::{Batch, Completions, Connector, Endpoint, RemoteAddr};
use std::ops::Range;

/// A `seg` lock's description (`seg:<segment_units>:<segments>`): how its words cut the address
/// space. A 0 field is left to the creator ([`crate::schemes::CreateOptions::seg`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegSpec {
    /// Units per segment.
    pub segment_units: u64,
    /// Lock words; segments beyond wrap onto them.
    pub segments: u64,
}

impl SegSpec {
    /// `seg` with both parameters left to the creator.
    pub const PLAIN: Self = Self {
        segment_units: 0,
        segments: 0,
    };

    /// What a creator picks by default: 16 units per segment over 1024 words (8 KiB). For the
    /// file system, with its 4 KiB lock units, that is one word per 64 KiB of a file, and files
    /// beyond 64 MiB wrap (false conflicts only, see the module docs).
    pub const DEFAULT: Self = Self {
        segment_units: 16,
        segments: 1024,
    };

    /// Fills the fields left open from `defaults`.
    pub fn resolve(&self, defaults: &SegSpec) -> Self {
        let or = |value: u64, default: u64| if value == 0 { default } else { value };
        Self {
            segment_units: or(self.segment_units, defaults.segment_units),
            segments: or(self.segments, defaults.segments),
        }
    }

    /// The configuration of a client with ticket behaviour `ticket` (the one place a
    /// description becomes a [`SegConfig`]).
    pub fn config(&self, ticket: TicketConfig) -> SegConfig {
        SegConfig {
            segment_units: self.segment_units,
            segments: self.segments,
            ticket,
        }
    }

    /// Bytes of memory the lock takes from its base: one word per segment lock.
    pub fn region_bytes(&self) -> Result<u64, LockError> {
        self.check()?;
        Ok(SegScheme::region_bytes(
            &self.config(TicketConfig::default()),
        ))
    }

    fn check(&self) -> Result<(), LockError> {
        if self.segment_units == 0 || self.segments == 0 {
            return Err(LockError::Config(format!(
                "seg: segment_units ({}) and segments ({}) must be at least 1",
                self.segment_units, self.segments
            )));
        }
        Ok(())
    }

    /// Writes the spec form: `seg:<segment_units>:<segments>`, trailing fields the creator
    /// decides left out.
    pub(crate) fn write(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write_spec(
            f,
            LockScheme::SEG.name(),
            &[self.segment_units, self.segments],
            None,
        )
    }

    /// Reads the fields [`SegSpec::write`] writes.
    pub(crate) fn parse(fields: &mut Fields<'_>) -> Result<Self, LockError> {
        Ok(Self {
            segment_units: fields.number("segment units")?,
            segments: fields.number("segment count")?,
        })
    }

    /// Creates the lock from a resolved description: takes its words from `memory` and sets
    /// them all unlocked. Returns the base address and the bytes taken.
    pub(crate) fn create_in(
        &self,
        memory: &mut dyn LockMemory,
    ) -> Result<(RemoteAddr, u64), LockError> {
        let bytes = self.region_bytes()?;
        let base = memory.allocate(bytes)?;
        SegScheme::create(
            memory.endpoint(),
            base,
            self.config(TicketConfig::default()),
        )?;
        Ok((base, bytes))
    }
}

/// How a `seg` instance is cut.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegConfig {
    /// Units per segment (at least 1).
    pub segment_units: u64,
    /// Lock words (at least 1); segments beyond wrap onto them (see the module docs).
    pub segments: u64,
    /// The ticket locks' client behaviour.
    pub ticket: TicketConfig,
}

impl SegConfig {
    /// Segments of `segment_units` units over an address space of `units` units, with at most
    /// `max_segments` lock words (beyond, segments wrap).
    pub fn covering(segment_units: u64, units: u64, max_segments: u64) -> Self {
        let segment_units = segment_units.max(1);
        Self {
            segment_units,
            segments: units.div_ceil(segment_units).clamp(1, max_segments.max(1)),
            ticket: TicketConfig::default(),
        }
    }
}

/// The shared state of one `seg` instance: where its lock words are and how ranges map to them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegScheme {
    base: RemoteAddr,
    config: SegConfig,
}

impl SegScheme {
    /// Bytes of registered memory an instance with this configuration occupies at its base.
    pub fn region_bytes(config: &SegConfig) -> u64 {
        config.segments.max(1) * 8
    }

    /// Creates the instance at `base` (8-byte aligned, [`Self::region_bytes`] bytes), resetting
    /// every lock word to free. Only while no client uses it.
    pub fn create(
        endpoint: &mut dyn Endpoint,
        base: RemoteAddr,
        config: SegConfig,
    ) -> Result<Self, LockError> {
        let scheme = Self::attach(base, config)?;
        // Zero the words in large writes: a fresh region is zero already, a reused one is not.
        const CHUNK_WORDS: u64 = 64 * 1024;
        let zeros = vec![0u8; (CHUNK_WORDS * 8) as usize];
        let mut word = 0;
        while word < scheme.config.segments {
            let n = (scheme.config.segments - word).min(CHUNK_WORDS);
            let mut batch = Batch::new();
            batch.write(base.word(word), &zeros[..(n * 8) as usize]);
            endpoint.execute(&batch, &mut Completions::new())?;
            word += n;
        }
        Ok(scheme)
    }

    /// Describes an instance that another client already created at `base`.
    pub fn attach(base: RemoteAddr, config: SegConfig) -> Result<Self, LockError> {
        if config.segment_units == 0 || config.segments == 0 {
            return Err(LockError::Config(format!(
                "seg: segment_units ({}) and segments ({}) must be at least 1",
                config.segment_units, config.segments
            )));
        }
        if base.offset % 8 != 0 {
            return Err(LockError::Config(format!(
                "seg: base address {base} is not 8-byte aligned"
            )));
        }
        Ok(Self { base, config })
    }

    /// The configuration.
    pub fn config(&self) -> &SegConfig {
        &self.config
    }

    /// The distinct lock indices guarding `range` (non-empty), in ascending order.
    pub fn locks_for(&self, range: &Range<u64>) -> impl Iterator<Item = u64> {
        let s = self.config.segments;
        let first = range.start / self.config.segment_units;
        let last = (range.end - 1) / self.config.segment_units;
        // `last - first` cannot overflow; `+ 1` only if the range spans all of u64 with unit
        // segments, which `>= s` covers too.
        let touched = (last - first).saturating_add(1);
        let (low, high) = if touched >= s {
            (0..s, 0..0)
        } else {
            let (a, b) = (first % s, last % s);
            if a <= b {
                (a..b + 1, 0..0)
            } else {
                // Wrapped: [0, b] and [a, s), ascending, disjoint because touched < s.
                (0..b + 1, a..s)
            }
        };
        low.chain(high)
    }

    /// Opens a handle for one thread, with its own endpoint from `connector`.
    pub fn open(&self, connector: &dyn Connector) -> Result<SegLock, LockError> {
        Ok(self.open_with(connector.connect()?))
    }

    /// Opens a handle for one thread over `endpoint`.
    pub fn open_with(&self, endpoint: Box<dyn Endpoint>) -> SegLock {
        SegLock {
            scheme: self.clone(),
            core: ClientCore::new(endpoint),
        }
    }
}

/// One thread's handle on a `seg` instance.
pub struct SegLock {
    scheme: SegScheme,
    /// Per held lock: the (lock index, ticket) pairs it took.
    core: ClientCore<Vec<(u64, u32)>>,
}

/// Releases `held` locks in batches. Returns whether every one was still ours (always, without
/// leases).
fn release_all(
    scheme: &SegScheme,
    endpoint: &mut dyn Endpoint,
    held: &[(u64, u32)],
) -> Result<bool, LockError> {
    let leased = scheme.config.ticket.lease.is_some();
    let mut all_ours = true;
    let mut batch = Batch::new();
    let mut out = Completions::new();
    for chunk in held.chunks(MAX_BATCH_VERBS) {
        batch.clear();
        for &(index, ticket) in chunk {
            let addr = scheme.base.word(index);
            if leased {
                // Same masked CAS as `TicketLock::release` with a lease, batched.
                batch.masked_cas(
                    addr,
                    u64::from(ticket),
                    0xFFFF_FFFF,
                    u64::from(ticket.wrapping_add(1)),
                    0xFFFF_FFFF,
                );
            } else {
                batch.faa(addr, TicketLock::release_addend(ticket));
            }
        }
        endpoint.execute(&batch, &mut out)?;
        if leased {
            all_ours &= out
                .olds()
                .iter()
                .zip(chunk)
                .all(|(&old, &(_, ticket))| old as u32 == ticket);
        }
    }
    Ok(all_ours)
}

impl SegLock {
    /// An acquisition carrying `extra` ([`RangeLock::acquire_with`]) in the ticket locks' own
    /// batches (`ClientCore::acquire_carrying`): the last batch is the grant of the last
    /// segment's ticket lock, taken after every earlier one.
    ///
    /// With a lease, the lock's deadline is the earliest of its ticket locks' deadlines. The
    /// first locks may pass theirs while the client waits for later ones: then everything is
    /// given back (conditionally, harmless to whoever broke them) and the acquisition starts
    /// over, so that a returned lock always has its deadline ahead.
    fn take(
        &mut self,
        range: Range<u64>,
        extra: &Batch,
        out: &mut Completions,
    ) -> Result<LockId, LockError> {
        check_range(&range)?;
        let scheme = &self.scheme;
        self.core
            .acquire_carrying(extra, out, |endpoint, rng, stats| loop {
                let mut held = Vec::new();
                let mut deadline: Option<std::time::Instant> = None;
                for index in scheme.locks_for(&range) {
                    let lock = TicketLock::new(scheme.base.word(index));
                    match lock.acquire(endpoint, &scheme.config.ticket, rng) {
                        Ok(outcome) => {
                            stats.recoveries += outcome.recoveries;
                            stats.passed_over += outcome.passed_over;
                            held.push((index, outcome.ticket));
                            deadline = match (deadline, outcome.deadline) {
                                (Some(a), Some(b)) => Some(a.min(b)),
                                (a, b) => a.or(b),
                            };
                        }
                        Err(error) => {
                            // Do not leave the locks taken so far behind; the fabric already failed,
                            // so this is best effort.
                            let _ = release_all(scheme, endpoint, &held);
                            return Err(error);
                        }
                    }
                }
                if deadline.is_none_or(|d| std::time::Instant::now() < d) {
                    return Ok((held, deadline));
                }
                stats.passed_over += 1;
                tracing::warn!(
                ?range,
                "seg: a segment's lease deadline passed while waiting for the others; starting over"
            );
                release_all(scheme, endpoint, &held)?;
            })
    }

    /// A release carrying `extra` ([`RangeLock::release_with`]) at the head of its first
    /// batch. With a lease, a release after the lease deadline uses conditional masked CASes
    /// that leave segments broken meanwhile alone; it returns `Ok` and is counted in
    /// [`LockStats::late_releases`].
    fn give_back(
        &mut self,
        id: LockId,
        extra: &Batch,
        out: &mut Completions,
    ) -> Result<(), LockError> {
        let scheme = &self.scheme;
        self.core
            .release_carrying(id, extra, out, |endpoint, held| {
                release_all(scheme, endpoint, &held)
            })
    }
}

impl RangeLock for SegLock {
    crate::carry::carrying_lock_methods!();

    /// The release's batch carries `extra` at its head.
    fn release_carries_verbs(&self) -> bool {
        true
    }

    fn lease_deadline(&self, id: LockId) -> Option<std::time::Instant> {
        self.core.deadline(id)
    }

    fn stats(&self) -> LockStats {
        self.core.stats
    }

    fn scheme(&self) -> &'static str {
        LockScheme::SEG.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::RegionId;

    fn scheme(segment_units: u64, segments: u64) -> SegScheme {
        SegScheme::attach(
            RemoteAddr::new(RegionId(0), 0),
            SegConfig {
                segment_units,
                segments,
                ticket: TicketConfig::default(),
            },
        )
        .unwrap()
    }

    #[test]
    fn ranges_map_to_distinct_ascending_locks() {
        let s = scheme(10, 8);
        let locks = |r: Range<u64>| s.locks_for(&r).collect::<Vec<_>>();
        assert_eq!(locks(0..1), vec![0]);
        assert_eq!(locks(9..11), vec![0, 1]);
        assert_eq!(locks(25..35), vec![2, 3]);
        // Segments 7, 8, 9 wrap onto locks 7, 0, 1: ascending, each once.
        assert_eq!(locks(75..95), vec![0, 1, 7]);
        // Segments 6..=13 are 8 segments: all locks.
        assert_eq!(locks(60..140), (0..8).collect::<Vec<_>>());
        assert_eq!(locks(0..u64::MAX), (0..8).collect::<Vec<_>>());
        assert_eq!(locks(u64::MAX - 1..u64::MAX).len(), 1);
        let unit = scheme(1, 4);
        assert_eq!(unit.locks_for(&(0..u64::MAX)).count(), 4);
    }
}
