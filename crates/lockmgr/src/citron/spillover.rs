//! The spillover mutex for `[N, ∞)` (§3.3, Alg. 1 l. 3-4) and the maximizer (§3.9.1).
//!
//! The mutex is a DSLR-style ticket lock on one word: the high 32 bits are the next ticket, the
//! low 32 bits the ticket being served. Take a ticket with a masked FAA of `1 << 32` (boundaries
//! at bits 31 and 63, so neither half carries into the other), poll until served, release with a
//! masked FAA of `1`. Both halves wrap modulo 2^32 and are only compared for equality.
//!
//! Recovery (§3.10 applied to the mutex): a waiter `Δ` tickets behind that sees the served
//! counter stand still for `Δ · T_lease` presumes every holder ahead dead and moves the counter
//! to its own ticket with one masked CAS that compares the counter it saw (so of several waiters
//! only one moves it, and only if it really did not move).
//!
//! Bounded waits: a waiter paused while its turn came finds the served counter moved
//! past its ticket by such a break-in (relative to the next ticket); it holds nothing then and
//! starts over with a new ticket instead of polling forever. The release is a masked CAS
//! `serving: ticket -> ticket + 1` rather than a blind FAA, so that a holder whose turn was
//! broken while it was paused leaves the new holder's turn alone (same cost: one atomic).
//! The lease deadline of a hold is [`super::lease::spill_deadline`]; the configured fence runs
//! before every break-in.
//!
//! Holding the mutex also freezes `N`: scale-ups and scale-downs happen only under it. After
//! taking it, a client re-reads the config record (batched with the take) and starts over if the
//! tree changed, so the range it protects is `[N, ∞)` of the current tree.

use super::config::{ConfigRecord, RECORD_BYTES};
use super::{layout, lease, CitronClient};
use crate::scheme::LockError;
use fabric::AtomicHandle;
use std::time::Instant;

/// Whether a release CAS (`post_spill_release`) that returned `old` took effect.
pub(crate) fn spill_released(old: u64, ticket: u64) -> bool {
    old & SERVING == ticket & SERVING
}

/// Masked-FAA boundary mask of the spillover word.
pub(crate) const SPILL_BOUNDARY: u64 = (1 << 31) | (1 << 63);
/// Addend that takes a ticket.
pub(crate) const SPILL_TAKE: u64 = 1 << 32;
const SERVING: u64 = 0xFFFF_FFFF;

impl CitronClient {
    /// Takes the spillover mutex for a request ending at `end` (Alg. 1 l. 4), ORing `end` into
    /// the maximizer first when a scale-up could cover it. Returns the ticket held and the
    /// hold's lease deadline, or `None` (mutex not held) when the caller must start over: the
    /// tree changed under a stale config, this call scaled it up (Alg. 4), or our turn was
    /// passed over while we were not looking.
    pub(crate) fn acquire_spillover(
        &mut self,
        end: u64,
    ) -> Result<Option<(u64, Instant)>, LockError> {
        let spill = self.spill_addr();
        let maxi = self.maximizer_addr();
        let grow = self.opts.auto_scale_up && end <= self.rec.max_units;
        self.batch.clear();
        if grow {
            // OR the right end: masked CAS with an empty compare mask always succeeds and sets
            // exactly the bits of `end`. The OR of values below 2^b stays below 2^b, so the
            // maximizer is at most twice the largest end (§3.9.1).
            self.batch.masked_cas(maxi, 0, 0, end, end);
        }
        let take = self.batch.masked_faa(spill, SPILL_TAKE, SPILL_BOUNDARY);
        let rec_read = self.batch.read(self.base, RECORD_BYTES as usize);
        let max_read = self.batch.read(maxi, 8);
        let lease = self.rec.t_lease();
        // The post time of the last verb that did not see our turn (`lease::spill_deadline`).
        let mut anchor = Instant::now();
        self.exec()?;
        let old = self.out.old(take);
        let ticket = old >> 32;
        let mut serving = old & SERVING;
        let mut record = ConfigRecord::open(self.out.bytes(rec_read))?;
        let mut maximizer = self.out.word(max_read, 0);
        if serving != ticket {
            // Poll until served (batched with the record, read after the mutex is ours).
            let mut backoff = self.backoff();
            let mut since = Instant::now();
            loop {
                backoff.snooze(&mut self.rng);
                self.batch.clear();
                let w = self.batch.read(spill, 8);
                let r = self.batch.read(self.base, RECORD_BYTES as usize);
                let mx = self.batch.read(maxi, 8);
                let poll = Instant::now();
                self.exec()?;
                let word = self.out.word(w, 0);
                let now_serving = word & SERVING;
                if now_serving == ticket {
                    record = ConfigRecord::open(self.out.bytes(r))?;
                    maximizer = self.out.word(mx, 0);
                    break;
                }
                anchor = poll;
                let next = word >> 32;
                if ticket.wrapping_sub(now_serving) & SERVING
                    >= next.wrapping_sub(now_serving) & SERVING
                {
                    // Passed over: a waiter behind us broke in while we were not looking. We
                    // hold nothing; start over with a new ticket.
                    self.stats.passed_over += 1;
                    tracing::warn!(
                        ticket,
                        serving = now_serving,
                        "spillover mutex: our turn was passed over (paused?); starting over"
                    );
                    return Ok(None);
                }
                if now_serving != serving {
                    serving = now_serving;
                    since = Instant::now();
                    backoff.reset();
                    continue;
                }
                let ahead = ticket.wrapping_sub(serving) & SERVING;
                if since.elapsed() >= lease * (ahead.max(1) as u32) {
                    // Every holder ahead is presumed dead: fence them off, then serve ourselves
                    // (one verb). A refused fence: no break now, another patience first.
                    if !crate::fence::before_recovery(self.opts.fence.as_ref(), "spillover mutex") {
                        since = Instant::now();
                        continue;
                    }
                    let cas_posted = Instant::now();
                    let old = self.ep_masked_cas(spill, serving, SERVING, ticket, SERVING)?;
                    if old & SERVING == serving {
                        anchor = cas_posted;
                        self.stats.recoveries += 1;
                        tracing::warn!(ticket, serving, "spillover mutex: holder presumed dead");
                        let fresh =
                            super::read_record(&mut self.ep, self.base, self.rec.t_lease() * 4)?;
                        record = Some(fresh);
                        maximizer = self.ep_read_u64(maxi)?;
                        break;
                    }
                    since = Instant::now();
                }
            }
        }
        // We hold the mutex: nobody rewrites the record now, a torn copy is only a race with a
        // writer that has finished; read it again.
        let record = match record {
            Some(r) => r,
            None => super::read_record(&mut self.ep, self.base, self.rec.t_lease() * 4)?,
        };
        if record.pending {
            // A scale-up announced by a holder of this mutex that lost it (it died, or it was
            // stopped past its lease): finish it, then start over on the grown tree.
            self.rec = record;
            let finished = self.finish_scale_up();
            self.release_spillover(ticket)?;
            finished?;
            return Ok(None);
        }
        if record.epoch != self.rec.epoch {
            let grew = record.units() != self.rec.units();
            self.rec = record;
            if grew && end <= self.rec.units() {
                self.release_spillover(ticket)?;
                return Ok(None);
            }
            if grew {
                // Still out of bound; the tree part of the request changed: start over.
                self.release_spillover(ticket)?;
                return Ok(None);
            }
        }
        if grow
            && maximizer > self.rec.units()
            && self.rec.units() < self.rec.max_units
            && self.scale_failed_epoch != Some(self.rec.epoch)
        {
            // Alg. 4, under the mutex we already hold; then release it (Alg. 4 l. 11) and start
            // over on the grown tree.
            self.progress.set(super::Phase::ScaleUp);
            match self.scale_up(maximizer) {
                Ok(true) => {
                    self.release_spillover(ticket)?;
                    return Ok(None);
                }
                Ok(false) => {} // nothing to grow, or the allocator refused: keep the mutex.
                Err(e) => {
                    let _ = self.release_spillover(ticket);
                    return Err(e);
                }
            }
        }
        Ok(Some((ticket, lease::spill_deadline(anchor, lease))))
    }

    /// Posts the release of the spillover mutex held with `ticket` into the current batch: a
    /// masked CAS on the served half, `ticket -> ticket + 1`. Invariant: while the served
    /// counter is our ticket, only we (releasing) or a breaker (moving it to its own ticket)
    /// write it; so the CAS takes effect exactly when the mutex is still ours. Check the result
    /// with [`spill_released`].
    pub(crate) fn post_spill_release(&mut self, ticket: u64) -> AtomicHandle {
        let addr = self.spill_addr();
        self.batch.masked_cas(
            addr,
            ticket & SERVING,
            SERVING,
            ticket.wrapping_add(1) & SERVING,
            SERVING,
        )
    }

    /// Releases the spillover mutex on its own (one round trip).
    pub(crate) fn release_spillover(&mut self, ticket: u64) -> Result<(), LockError> {
        self.batch.clear();
        let h = self.post_spill_release(ticket);
        self.exec()?;
        if !spill_released(self.out.old(h), ticket) {
            self.stats.late_releases += 1;
            tracing::warn!(
                ticket,
                "spillover mutex: released after it was broken; left its new holder alone"
            );
        }
        Ok(())
    }

    pub(crate) fn ep_masked_cas(
        &mut self,
        addr: fabric::RemoteAddr,
        cmp: u64,
        cmp_mask: u64,
        swap: u64,
        swap_mask: u64,
    ) -> Result<u64, LockError> {
        self.batch.clear();
        let h = self.batch.masked_cas(addr, cmp, cmp_mask, swap, swap_mask);
        self.exec()?;
        Ok(self.out.old(h))
    }

    pub(crate) fn ep_read_u64(&mut self, addr: fabric::RemoteAddr) -> Result<u64, LockError> {
        self.batch.clear();
        let h = self.batch.read(addr, 8);
        self.exec()?;
        Ok(self.out.word(h, 0))
    }
}

/// The height a scale-up to cover `maximizer` aims at (at least `min_levels` above `current`,
/// at most what `max_units` allows); `None` when no growth is possible.
pub(crate) fn target_height(
    current: u32,
    maximizer: u64,
    max_units: u64,
    min_levels: u32,
) -> Option<u32> {
    let limit = layout::height_for(max_units).unwrap_or(layout::MAX_HEIGHT);
    let limit = if layout::tree_units(limit) > max_units && limit > current {
        // Never exceed max_units: the largest height within it.
        limit - 1
    } else {
        limit
    };
    let want = layout::height_for(maximizer).unwrap_or(layout::MAX_HEIGHT);
    let target = want.max(current + min_levels.max(1)).min(limit);
    (target > current).then_some(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_heights() {
        // 256-unit tree (h=2), request to 300: one level (4x).
        assert_eq!(target_height(2, 300, 1 << 30, 1), Some(3));
        // Far beyond: straight to the covering height.
        assert_eq!(target_height(2, 1 << 20, 1 << 30, 1), Some(8));
        // Capped by max_units.
        assert_eq!(target_height(2, 1 << 20, 1024, 1), Some(3));
        assert_eq!(target_height(3, 1 << 20, 1024, 1), None);
        // Minimum growth.
        assert_eq!(target_height(2, 300, 1 << 30, 2), Some(4));
    }
}
