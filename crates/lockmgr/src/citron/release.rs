//! Lock release (CITRON Alg. 3, §3.6): every verb in one batch, one round trip; the
//! continuation after a scale-up (l. 10-12) is in `scaleup`.
//!
//! # Late releases
//!
//! A holder paused past its lease may find its hold broken by a waiter's recovery (§3.10) and the
//! lock held by someone else. Its release must not disturb that successor, so no part is released
//! with a blind verb once it may have been broken (`lease` module):
//!
//! - **ticket and `Occ`** (l. 7): always a masked CAS that compares `TCnt` with our ticket and
//!   `Occ` with what we left, and swaps `TCnt + 1`, `Occ = 0`. While the node is ours it does
//!   exactly what the paper's masked FAA does (same single atomic); after a break-in (`TCnt`
//!   moved to the breaker's ticket) it fails and changes nothing. The paper's FAA instead
//!   flipped the breaker's `Occ` back on (one-bit field) and pushed `TCnt` past the next
//!   ticket, hanging its owner forever (the previous session's finding).
//! - **notifications** (l. 9, `DCnt += 1`): `DCnt` records no owner, so a late `+1` after a
//!   phase-(d) waiter repaired `DCnt := DMax` would put `DCnt` ahead of `DMax`, and the next
//!   notification would then look released while its holder holds. Past the token's deadline
//!   the `+1` is left out: `DCnt` stays behind `DMax` by our notification, exactly as a dead
//!   client leaves it, and lazy recovery repairs it — every client that would wait on it does so
//!   after `H·T_lease` (`wait_window`), so nobody waits forever.
//! - **leaf bits and fast-path children** (l. 5): no owner either (a successor may have set the
//!   same bits after a repair). Past their deadline they are left set; a client that needs them
//!   starves on them, escalates to the parent and zeroes them after `T_lease` (`repair_leaf`).
//! - **the spillover mutex**: a masked CAS `serving: ours -> ours + 1`, always.
//!
//! Each such release is counted in `LockStats::late_releases` and logged at warn; it returns
//! `Ok` (the lock is no longer ours either way).

use super::layout::{
    exp_tag, LeafShare, ADD_DCNT, ADD_TCNT, BOUNDARY, COUNTER_MASK, OCC, TCNT, TCNT_SHIFT,
};
use super::scaleup::Continue;
use super::spillover::spill_released;
use super::{CitronClient, Held, HeldNode};
use crate::scheme::LockError;
use fabric::AtomicHandle;
use std::time::Instant;

/// A release continuation for a root's `Occ` (a scale-up may have copied it), with the `Exp` tag
/// seen when it was set.
type RootOcc = (Continue, u8);

impl CitronClient {
    /// Releases a whole lock (and performs a scale-down it was marked for, §3.9.2).
    pub(crate) fn release_held(&mut self, held: &Held) -> Result<(), LockError> {
        if let Some(height) = held.shrink_to {
            self.shrink_before_release(held, height)?;
        }
        let spill = held.spill.then_some(held.spill_ticket);
        self.release_parts(&held.nodes, spill)
    }

    /// Releases `nodes` (what each one got done: leaf bits, children, ticket/Occ, notifications)
    /// and the spillover mutex held with ticket `spill`, in one batch (Alg. 3 l. 2-9). The same
    /// undoes an aborted attempt (§3.5.5: aborting is releasing). Parts past their lease
    /// deadline are released conditionally or left out (module docs).
    pub(crate) fn release_parts(
        &mut self,
        nodes: &[HeldNode],
        spill: Option<u64>,
    ) -> Result<(), LockError> {
        // One clock read decides which parts are past their deadline.
        let now = Instant::now();
        let live = |d: Option<Instant>| d.is_none_or(|d| now < d);
        let mut late = 0u32;
        self.batch.clear();
        let mut checks: Vec<(AtomicHandle, Continue, u8)> = Vec::new();
        // Ticket CASes, with the word's TCnt|Occ each expects, and its root-occ continuation.
        let mut words: Vec<(AtomicHandle, u64, Option<RootOcc>)> = Vec::new();
        for n in nodes {
            let bits_live = live(n.bits_deadline);
            if n.leaf_mask != 0 {
                if bits_live {
                    // l. 4-5.
                    self.batch
                        .masked_cas(n.addr, n.leaf_mask, n.leaf_mask, 0, n.leaf_mask);
                } else {
                    late += 1;
                }
            }
            if !n.children.is_empty() && !bits_live {
                late += 1;
            }
            for c in n.children.iter().filter(|_| bits_live) {
                // All 64 bits are ours (§3.8).
                self.batch.write_u64(*c, 0);
            }
            if n.ticket {
                // l. 7: vacate (Occ -1, TCnt +1), or pass on a ticket never used — as a masked
                // CAS conditional on TCnt still being our ticket (module docs).
                let expect = (n.ticket_no << TCNT_SHIFT) | if n.occ { OCC } else { 0 };
                let swap = ((n.ticket_no + 1) & COUNTER_MASK) << TCNT_SHIFT;
                let h = self
                    .batch
                    .masked_cas(n.addr, expect, TCNT | OCC, swap, TCNT | OCC);
                let cont = match (n.occ, n.root_of) {
                    (true, Some(height)) => Some((
                        Continue::RootOcc {
                            node: n.node,
                            height,
                            shared: false,
                        },
                        n.occ_tag,
                    )),
                    _ => None,
                };
                words.push((h, expect, cont));
            }
            // Shared parts (`docs/SHARED_LOCKS.md`): leave the node (`RCnt += 1`), the leaf's
            // groups and the fast path's children (`Cnt += 1`); past their deadline a writer
            // may have repaired them already: left out, as a late notification is.
            if n.readers {
                if let (true, Some(at)) = (live(n.readers_deadline), n.share) {
                    let h = self.batch.masked_faa(at, ADD_TCNT, BOUNDARY);
                    if let Some(height) = n.root_of {
                        let c = Continue::RootOcc {
                            node: n.node,
                            height,
                            shared: true,
                        };
                        checks.push((h, c, n.readers_tag));
                    }
                } else {
                    late += 1;
                }
            }
            if !n.leaf_register.is_empty() {
                if let (true, Some(at)) = (bits_live, n.share) {
                    n.leaf_register.release().post_add(&mut self.batch, at);
                } else {
                    late += 1;
                }
            }
            if !n.reader_children.is_empty() && !bits_live {
                late += 1;
            }
            for c in n.reader_children.iter().filter(|_| bits_live) {
                LeafShare::register(!0)
                    .release()
                    .post_add(&mut self.batch, *c);
            }
            for t in &n.tokens {
                if now >= t.deadline {
                    late += 1;
                    continue;
                }
                // l. 8-9 (a shared notification: `SCnt += 1` in the share word, same field).
                let h = self.batch.masked_faa(t.addr, ADD_DCNT, BOUNDARY);
                let c = Continue::Token {
                    node: t.node,
                    shared: t.shared,
                };
                checks.push((h, c, t.tag));
            }
        }
        let spill_cas = spill.map(|ticket| (self.post_spill_release(ticket), ticket));
        if !self.batch.is_empty() {
            self.exec()?;
        }
        for (h, expect, cont) in words {
            let old = self.out.old(h);
            if old & (TCNT | OCC) != expect {
                // Broken while we were away: the CAS changed nothing. A scale-up's copy of our
                // Occ (if any) is left to lazy recovery like a dead client's.
                late += 1;
                continue;
            }
            if let Some((c, tag)) = cont {
                checks.push((h, c, tag));
            }
        }
        if let Some((h, ticket)) = spill_cas {
            if !spill_released(self.out.old(h), ticket) {
                late += 1;
            }
        }
        if late > 0 {
            self.stats.late_releases += 1;
            tracing::warn!(
                parts = late,
                "release after the lease deadline: broken or possibly broken parts left to their new holders and to lazy recovery"
            );
        }
        // l. 10-12: a tag that changed since the notification (or occupation) means a scale-up
        // copied it to new ancestors, which must be released as well.
        let work: Vec<(Continue, u8)> = checks
            .into_iter()
            .filter_map(|(h, c, tag)| {
                let seen = exp_tag(self.out.old(h));
                (seen != tag).then_some((c, seen))
            })
            .collect();
        if work.is_empty() {
            return Ok(());
        }
        self.continue_release(work)
    }
}
