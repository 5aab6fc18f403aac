//! The interface every range-lock scheme implements: CITRON and the baselines alike, so that the
//! file system and the benchmarks can use any of them.

use crate::stats::LockStats;
use fabric::{Batch, Completions, Endpoint, FabricError};
use std::ops::Range;
use thiserror::Error;

/// Identifies one lock held by a [`RangeLock`] client, to release it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LockId(pub u64);

/// Why a lock operation failed. Contention never fails an operation: it waits (and aborts and
/// retries inside the scheme); these are the failures a caller must see.
#[derive(Debug, Error)]
pub enum LockError {
    /// The fabric failed (server gone, bad address).
    #[error("fabric: {0}")]
    Fabric(#[from] FabricError),
    /// The range is empty or otherwise unusable.
    #[error("invalid range {start}..{end}: {why}")]
    InvalidRange {
        /// Start of the range.
        start: u64,
        /// End of the range.
        end: u64,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The lock id is not held by this client.
    #[error("lock {0:?} is not held by this client")]
    NotHeld(LockId),
    /// The scheme's configuration or shared state is unusable.
    #[error("{0}")]
    Config(String),
    /// The lock's memory reads zeros where its configuration was: its server stopped or
    /// restarted and emptied the memory a client still reaches (a shm mapping of a region file
    /// it removed, `fabric::shm`). Not a broken lock: the client is behind its cluster, and
    /// finds the lock again once it has caught up.
    #[error("the lock's memory was emptied (its server stopped or restarted)")]
    Emptied,
    /// The lock server (for the `server` baseline) broke the protocol or refused the request.
    #[error("lock server: {0}")]
    Server(String),
    /// A hook the scheme calls outside its lock words failed: the user's fence
    /// ([`crate::Fence`]) or an allocation of lock words ([`crate::schemes::LockWordAllocator`]). The
    /// hook's own error is kept whole as the source (a file system's RPC failure, say), so
    /// whoever reports it can name the real cause and the caller's errno mapping can see it.
    #[error("{what}: {source}")]
    Hook {
        /// What the hook was asked to do.
        what: &'static str,
        /// The hook's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The creator's memory cannot hold a lock's state ([`crate::schemes::LockMemory`]), so the
    /// caller can tell "full" from "broken" (the meta server answers `ENOSPC`).
    #[error("no room for the lock's state ({bytes} bytes)")]
    NoSpace {
        /// Bytes asked for.
        bytes: u64,
    },
}

/// How a lock is held: exclusive (a writer: no other holder overlaps it) or shared (a reader:
/// other shared holders may overlap it, no exclusive one may). Spelled `exclusive` and `shared`
/// in configuration files, on command lines ([`std::str::FromStr`]) and in reports.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LockMode {
    /// No other holder of an overlapping range.
    #[default]
    Exclusive,
    /// Only other shared holders of overlapping ranges.
    Shared,
}

impl LockMode {
    /// The mode as the benchmarks and reports spell it.
    pub const fn name(self) -> &'static str {
        match self {
            LockMode::Exclusive => "exclusive",
            LockMode::Shared => "shared",
        }
    }
}

impl std::fmt::Display for LockMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for LockMode {
    type Err = String;

    /// `exclusive` or `shared`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "exclusive" => Ok(LockMode::Exclusive),
            "shared" => Ok(LockMode::Shared),
            other => Err(format!(
                "unknown lock mode {other:?} (expected shared or exclusive)"
            )),
        }
    }
}

/// The modes of a scheme that grants exclusive locks only.
pub const EXCLUSIVE_ONLY: &[LockMode] = &[LockMode::Exclusive];
/// The modes of a scheme that grants shared locks as well.
pub const EXCLUSIVE_AND_SHARED: &[LockMode] = &[LockMode::Exclusive, LockMode::Shared];

/// Describes, when called from any thread, where a client's current acquisition is
/// ([`RangeLock::progress`]).
pub type ProgressFn = std::sync::Arc<dyn Fn() -> String + Send + Sync>;

/// One client's handle on a range-lock instance. Locks are exclusive unless taken with
/// [`RangeLock::acquire_mode`] in [`LockMode::Shared`] on a scheme that has that mode; ranges are in lock units,
/// half-open `[start, end)`, anywhere in `[0, u64::MAX)`.
///
/// A handle belongs to one thread (it owns that thread's endpoints); open one per thread.
pub trait RangeLock: Send {
    /// Blocks until `range` is held by this client and returns the id to release it with.
    fn acquire(&mut self, range: Range<u64>) -> Result<LockId, LockError>;

    /// Releases a lock taken with [`RangeLock::acquire`] (or [`RangeLock::acquire_mode`]).
    fn release(&mut self, id: LockId) -> Result<(), LockError>;

    /// The modes this scheme grants ([`RangeLock::acquire_mode`]); default: exclusive only.
    fn modes(&self) -> &'static [LockMode] {
        EXCLUSIVE_ONLY
    }

    /// Blocks until `range` is held by this client in `mode`. [`LockMode::Exclusive`] is
    /// [`RangeLock::acquire`]. A scheme without a shared mode (see [`RangeLock::modes`]) grants
    /// a shared request exclusively (this default): a stronger lock, never a wrong one.
    fn acquire_mode(&mut self, range: Range<u64>, mode: LockMode) -> Result<LockId, LockError> {
        let _ = mode;
        self.acquire(range)
    }

    /// [`RangeLock::acquire`], also executing the caller's verbs `extra` (reads of the data
    /// the lock guards, say) **after the lock was granted**, with their results in `out`
    /// (`extra`'s handles read them there). This is how a file system learns a file's size in
    /// the lock's round trips instead of one of its own.
    ///
    /// Invariant (what makes the values usable): `out` holds the results of a batch that
    /// executed after the verbs by which the scheme learned that the lock is its own, in
    /// posting order on one endpoint; so every write of a conflicting holder released before
    /// the grant is visible in them, and no conflicting holder writes until this lock is
    /// released. Values read in an earlier batch of the acquisition (one that ended in an
    /// abort or a wait) would not be: a scheme that carries `extra` in its own batches keeps
    /// only the results of the last one.
    ///
    /// `fallback` is an endpoint to the memory `extra` addresses. The schemes whose lock words
    /// live there (CITRON, `mutex`, `seg`) carry `extra` at the end of every batch of the
    /// acquisition and never touch it, so a grant in one round trip stays one; this default,
    /// for schemes that cannot carry verbs (the `server` scheme's RPC), executes `extra` on
    /// `fallback` in one more round trip after the grant: correct, one round trip slower. If
    /// that fails the lock is released again (best effort) and the error returned. An empty
    /// `extra` costs nothing.
    fn acquire_with(
        &mut self,
        range: Range<u64>,
        extra: &Batch,
        out: &mut Completions,
        fallback: &mut dyn Endpoint,
    ) -> Result<LockId, LockError> {
        let id = self.acquire(range)?;
        if extra.is_empty() {
            return Ok(id);
        }
        if let Err(e) = fallback.execute(extra, out) {
            let _ = self.release(id);
            return Err(e.into());
        }
        Ok(id)
    }

    /// [`RangeLock::acquire_with`] in `mode`: the lock as [`RangeLock::acquire_mode`] grants
    /// it, `extra` carried (or executed on `fallback`) as [`RangeLock::acquire_with`] does,
    /// under the same invariant. A shared grant excludes every exclusive holder of an
    /// overlapping range, so values `extra` reads are no writer's half-done work.
    ///
    /// This default takes every request exclusively through [`RangeLock::acquire_with`] (a
    /// stronger lock, never a wrong one), so that a scheme's own way of carrying verbs is kept;
    /// the schemes with a shared mode that carry verbs (CITRON, one-sided) override it.
    fn acquire_mode_with(
        &mut self,
        range: Range<u64>,
        mode: LockMode,
        extra: &Batch,
        out: &mut Completions,
        fallback: &mut dyn Endpoint,
    ) -> Result<LockId, LockError> {
        let _ = mode;
        self.acquire_with(range, extra, out, fallback)
    }

    /// [`RangeLock::release`], executing the caller's verbs `extra` **before** the release
    /// verbs (the next holder sees their effects), with their results in `out`.
    ///
    /// Schemes whose lock words live where `extra` goes post it at the head of the release's
    /// first batch (same endpoint, so posting order puts it before the release); this default
    /// executes it on `fallback` first, in a round trip of its own. The lock is released even
    /// if `extra` failed; the first error is returned.
    fn release_with(
        &mut self,
        id: LockId,
        extra: &Batch,
        out: &mut Completions,
        fallback: &mut dyn Endpoint,
    ) -> Result<(), LockError> {
        let carried = match extra.is_empty() {
            true => Ok(()),
            false => fallback.execute(extra, out),
        };
        let released = self.release(id);
        carried?;
        released
    }

    /// Whether [`RangeLock::acquire_with`] (and [`RangeLock::acquire_mode_with`]) executes
    /// `extra` exactly once, after the grant and only with it, so that verbs that change memory
    /// (a CAS claiming something under the lock) may ride in it. `false` (this default, and the
    /// schemes that carry `extra` in their own batches): `extra` may also execute in batches
    /// that ended in an abort or a wait, before the lock was this client's, so it must only
    /// read. `true`: CITRON acquired at the host (the host executes `extra` after its grant)
    /// and the schemes that execute it on `fallback` after the grant.
    fn extra_runs_once_granted(&self) -> bool {
        false
    }

    /// [`RangeLock::release_with`] for verbs whose results nobody reads: a caller's
    /// bookkeeping whose loss a later holder makes good (the end of a record that, left, only
    /// makes the next holder repair what needs no repair). Executed before the release verbs,
    /// as `release_with` does. Where the release is posted without waiting (CITRON at a host
    /// that takes carried verbs in a posted release),
    /// `extra` rides in that posted call and costs no round trip; this default is
    /// `release_with`. If `extra` fails there, the release does not run either and the lock is
    /// recovered as a dead holder's when its lease runs out.
    fn release_forgetting(
        &mut self,
        id: LockId,
        extra: &Batch,
        fallback: &mut dyn Endpoint,
    ) -> Result<(), LockError> {
        self.release_with(id, extra, &mut Completions::new(), fallback)
    }

    /// Whether [`RangeLock::release_with`] carries its `extra` in a round trip the release
    /// takes anyway (`true`: the schemes whose release is one-sided verbs on the memory `extra`
    /// addresses), so that verbs a caller can leave to the release cost nothing there. `false`
    /// (this default): `extra` costs a round trip of its own, because the release is an RPC
    /// (`server`) or is posted without waiting for an answer (CITRON acquired at the host), and
    /// a caller does better to send such verbs beside other work it waits for anyway.
    fn release_carries_verbs(&self) -> bool {
        false
    }

    /// This client's statistics so far.
    fn stats(&self) -> LockStats;

    /// The scheme's name, as the benchmark and the mount option spell it.
    fn scheme(&self) -> &'static str;

    /// A description of where the current acquisition is, readable from another thread while
    /// `acquire` blocks (what a liveness watchdog prints); `None` for schemes without one.
    fn progress(&self) -> Option<ProgressFn> {
        None
    }

    /// The lease deadline of a held lock: the earliest instant at which another client's lease
    /// recovery (CITRON §3.10) could break it, computed conservatively on this client's clock.
    /// Past it the lock may belong to someone else: the caller must not post data verbs when
    /// `now + guard > deadline` (its `guard` covering the time from that check to the verbs'
    /// execution). Releasing after the deadline is allowed and harmless to the lock's next
    /// holders (counted in [`LockStats::late_releases`]).
    ///
    /// `None`: this scheme's locks are never broken by other clients (the `server` scheme, a
    /// ticket lock without a lease), or `id` is not held.
    fn lease_deadline(&self, id: LockId) -> Option<std::time::Instant> {
        let _ = id;
        None
    }
}

/// Checks a requested range: non-empty.
pub fn check_range(range: &Range<u64>) -> Result<(), LockError> {
    if range.start >= range.end {
        return Err(LockError::InvalidRange {
            start: range.start,
            end: range.end,
            why: "empty range",
        });
    }
    Ok(())
}
