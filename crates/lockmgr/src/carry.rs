//! Carrying a caller's verbs in a lock scheme's own batches ([`RangeLock::acquire_with`],
//! [`RangeLock::release_with`]): an endpoint wrapper that every fabric scheme (CITRON, `mutex`,
//! `seg`) executes through, so that the scheme's code — every poll, every abort, every phase —
//! stays as it is, and the caller's verbs ride along without a round trip of their own.
//!
//! - During an acquisition ([`CarryingEndpoint::carry_after`]) the caller's verbs are appended
//!   to **every** batch the scheme executes, and only the results of the **last** one are
//!   kept. The scheme decides that it holds the lock from what its batches return and then
//!   returns; so its last batch executed at or after the verbs that told it so (the granting
//!   verbs precede the carried ones in posting order on one endpoint), and the results handed
//!   back were read under the lock. Results of earlier batches (an attempt that aborted, a poll
//!   that was not yet served) are overwritten, never returned.
//! - During a release ([`CarryingEndpoint::carry_before`]) the caller's verbs go at the head of
//!   the release's first batch, before any release verb, so whoever takes the lock next sees
//!   their effects.
//!
//! When the scheme executed no batch while carrying (it cannot happen for a lock acquired or
//! held, but the wrapper does not rely on it), [`CarryingEndpoint::finish`] executes the verbs
//! alone, after the acquisition or before the release: one round trip more, still in order.
//!
//! [`RangeLock::acquire_with`]: crate::RangeLock::acquire_with
//! [`RangeLock::release_with`]: crate::RangeLock::release_with

use fabric::{Batch, Capabilities, Completions, Endpoint, EndpointStats};

/// The [`RangeLock`](crate::RangeLock) methods `acquire`, `release`, `acquire_with` and
/// `release_with` of a scheme that carries a caller's verbs in its own batches, through its
/// inherent `take(range, extra, out)` and `give_back(id, extra, out)`: the plain calls carry
/// nothing, and `fallback` is never used (an uncontended grant stays one round trip). An
/// exclusive-only scheme keeps the trait's `acquire_mode_with`, which takes every request
/// through `acquire_with`; a scheme that shares writes its own.
macro_rules! carrying_lock_methods {
    () => {
        fn acquire(
            &mut self,
            range: std::ops::Range<u64>,
        ) -> Result<$crate::LockId, $crate::LockError> {
            self.take(
                range,
                &fabric::Batch::new(),
                &mut fabric::Completions::new(),
            )
        }

        fn release(&mut self, id: $crate::LockId) -> Result<(), $crate::LockError> {
            self.give_back(id, &fabric::Batch::new(), &mut fabric::Completions::new())
        }

        fn acquire_with(
            &mut self,
            range: std::ops::Range<u64>,
            extra: &fabric::Batch,
            out: &mut fabric::Completions,
            _fallback: &mut dyn fabric::Endpoint,
        ) -> Result<$crate::LockId, $crate::LockError> {
            self.take(range, extra, out)
        }

        fn release_with(
            &mut self,
            id: $crate::LockId,
            extra: &fabric::Batch,
            out: &mut fabric::Completions,
            _fallback: &mut dyn fabric::Endpoint,
        ) -> Result<(), $crate::LockError> {
            self.give_back(id, extra, out)
        }
    };
}
pub(crate) use carrying_lock_methods;

/// Where the carried verbs go in the batches executed meanwhile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Nothing carried: batches pass through unchanged.
    Idle,
    /// After the verbs of every batch (an acquisition).
    After,
    /// Before the verbs of the next batch only (a release).
    Before,
}

/// A scheme's endpoint that can carry a caller's verbs (see the module docs).
pub(crate) struct CarryingEndpoint {
    inner: Box<dyn Endpoint>,
    mode: Mode,
    /// The caller's verbs, copied (buffers reused from one call to the next).
    extra: Batch,
    /// The scheme's batch joined with `extra`.
    joined: Batch,
    /// `extra`'s results from the last batch that carried it.
    results: Completions,
    /// Whether some batch carried `extra` since it was given.
    carried: bool,
}

impl CarryingEndpoint {
    /// Wraps a scheme's endpoint; nothing is carried until asked.
    pub(crate) fn new(inner: Box<dyn Endpoint>) -> Self {
        Self {
            inner,
            mode: Mode::Idle,
            extra: Batch::new(),
            joined: Batch::new(),
            results: Completions::new(),
            carried: false,
        }
    }

    /// Carries `extra` after the verbs of every batch executed until [`Self::finish`]. An empty
    /// `extra` carries nothing (batches pass through unchanged).
    pub(crate) fn carry_after(&mut self, extra: &Batch) {
        self.start(extra, Mode::After);
    }

    /// Carries `extra` before the verbs of the next batch executed.
    pub(crate) fn carry_before(&mut self, extra: &Batch) {
        self.start(extra, Mode::Before);
    }

    fn start(&mut self, extra: &Batch, mode: Mode) {
        self.extra.clear();
        self.extra.append(extra);
        self.carried = extra.is_empty();
        self.results.reset_for(extra);
        self.mode = if extra.is_empty() { Mode::Idle } else { mode };
    }

    /// Stops carrying and puts `extra`'s results into `out`. With `run_alone` (the operation
    /// succeeded) and no batch having carried `extra`, executes it alone first, one round trip.
    /// Without it, `out` is left alone and nothing more is executed.
    pub(crate) fn finish(
        &mut self,
        run_alone: bool,
        out: &mut Completions,
    ) -> Result<(), fabric::FabricError> {
        self.mode = Mode::Idle;
        if !run_alone {
            return Ok(());
        }
        if !self.carried {
            self.inner.execute(&self.extra, &mut self.results)?;
            self.carried = true;
        }
        std::mem::swap(out, &mut self.results);
        Ok(())
    }
}

impl Endpoint for CarryingEndpoint {
    fn execute(&mut self, batch: &Batch, out: &mut Completions) -> fabric::Result<()> {
        match self.mode {
            Mode::Idle => self.inner.execute(batch, out),
            Mode::After => {
                self.joined.clear();
                self.joined.append(batch);
                self.joined.append(&self.extra);
                self.inner.execute(&self.joined, out)?;
                out.take_tail(batch.atomic_count(), batch.read_bytes(), &mut self.results);
                self.carried = true;
                Ok(())
            }
            Mode::Before => {
                self.joined.clear();
                self.joined.append(&self.extra);
                self.joined.append(batch);
                self.mode = Mode::Idle;
                self.inner.execute(&self.joined, out)?;
                out.take_front(
                    self.extra.atomic_count(),
                    self.extra.read_bytes(),
                    &mut self.results,
                );
                self.carried = true;
                Ok(())
            }
        }
    }

    fn stats(&self) -> EndpointStats {
        self.inner.stats()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    /// Procedures carry nothing: a hosted acquisition's call goes through as it is.
    fn call(
        &mut self,
        procedure: fabric::procedure::ProcedureId,
        args: &[u8],
        result: &mut Vec<u8>,
    ) -> fabric::Result<()> {
        self.inner.call(procedure, args, result)
    }

    /// Posted procedure calls carry nothing either.
    fn post_call(
        &mut self,
        procedure: fabric::procedure::ProcedureId,
        args: &[u8],
    ) -> fabric::Result<()> {
        self.inner.post_call(procedure, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::{EndpointExt, MemServer, RegionId, RemoteAddr};

    fn setup() -> (CarryingEndpoint, RemoteAddr) {
        let server = MemServer::new();
        server.register(RegionId(1), 64).unwrap();
        let at = RemoteAddr::new(RegionId(1), 0);
        let ep = fabric::Connector::connect(&server).unwrap();
        (CarryingEndpoint::new(ep), at)
    }

    #[test]
    fn carried_reads_come_from_the_last_batch() {
        let (mut ep, at) = setup();
        ep.write_u64(at.add(8), 7).unwrap();
        let mut extra = Batch::new();
        let word = extra.read(at.add(8), 8);
        ep.carry_after(&extra);
        // The scheme's own batches: a FAA, then a write of the word the caller reads.
        assert_eq!(ep.faa(at, 1).unwrap(), 0);
        ep.write_u64(at.add(8), 9).unwrap();
        let before = ep.stats().round_trips;
        let mut out = Completions::new();
        ep.finish(true, &mut out).unwrap();
        // No round trip of its own, and the value as of the last batch.
        assert_eq!(ep.stats().round_trips, before);
        assert_eq!(out.word(word, 0), 9);
        // The scheme's own results are not disturbed by the carried ones.
        assert_eq!(ep.faa(at, 1).unwrap(), 1);
    }

    #[test]
    fn carried_verbs_go_before_the_next_batch_only() {
        let (mut ep, at) = setup();
        let mut extra = Batch::new();
        let swap = extra.cas(at, 0, 5);
        ep.carry_before(&extra);
        // The "release": it sees the carried CAS's effect, and its own old value is its own.
        assert_eq!(ep.faa(at, 1).unwrap(), 5);
        assert_eq!(ep.faa(at, 1).unwrap(), 6);
        let mut out = Completions::new();
        ep.finish(true, &mut out).unwrap();
        assert_eq!(out.old(swap), 0);
    }

    #[test]
    fn nothing_executed_means_one_batch_alone() {
        let (mut ep, at) = setup();
        let mut extra = Batch::new();
        let word = extra.read(at, 8);
        ep.carry_after(&extra);
        let mut out = Completions::new();
        ep.finish(true, &mut out).unwrap();
        assert_eq!(ep.stats().round_trips, 1);
        assert_eq!(out.word(word, 0), 0);
        // After finishing, batches pass through.
        assert_eq!(ep.faa(at, 2).unwrap(), 0);
        assert_eq!(ep.stats().verbs, 2);
    }
}
