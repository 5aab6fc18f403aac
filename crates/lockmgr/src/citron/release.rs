//! Lock release (seed 000 Alg. 3, §3.6): every verb in one batch, one round trip; the
//! continuation after a scale-up (l. 10-12) is in `scaleup`.

use super::layout::{exp_tag, ADD_DCNT, ADD_TCNT, BOUNDARY, RELEASE_OCC};
use super::scaleup::Continue;
use super::spillover::{SPILL_BOUNDARY, SPILL_RELEASE};
use super::{CitronClient, Held, HeldNode};
use crate::scheme::LockError;
use fabric::AtomicHandle;

impl CitronClient {
    /// Releases a whole lock (and performs a scale-down it was marked for, §3.9.2).
    pub(crate) fn release_held(&mut self, held: &Held) -> Result<(), LockError> {
        if let Some(height) = held.shrink_to {
            self.shrink_before_release(held, height)?;
        }
        self.release_parts(&held.nodes, held.spill)
    }

    /// Releases `nodes` (what each one got done: leaf bits, children, ticket/Occ, notifications)
    /// and the spillover mutex if `spill`, in one batch (Alg. 3 l. 2-9). The same undoes an
    /// aborted attempt (§3.5.5: aborting is releasing).
    pub(crate) fn release_parts(
        &mut self,
        nodes: &[HeldNode],
        spill: bool,
    ) -> Result<(), LockError> {
        self.batch.clear();
        let mut checks: Vec<(AtomicHandle, Continue, u8)> = Vec::new();
        for n in nodes {
            if n.leaf_mask != 0 {
                // l. 4-5.
                self.batch
                    .masked_cas(n.addr, n.leaf_mask, n.leaf_mask, 0, n.leaf_mask);
            }
            for c in &n.children {
                // All 64 bits are ours (§3.8).
                self.batch.write_u64(*c, 0);
            }
            if n.ticket {
                // l. 7: vacate (Occ -1, TCnt +1), or pass on a ticket never used.
                let add = if n.occ { RELEASE_OCC } else { ADD_TCNT };
                let h = self.batch.masked_faa(n.addr, add, BOUNDARY);
                if let (true, Some(height)) = (n.occ, n.root_of) {
                    checks.push((
                        h,
                        Continue::RootOcc {
                            node: n.node,
                            height,
                        },
                        n.occ_tag,
                    ));
                }
            }
            for t in &n.tokens {
                // l. 8-9.
                let h = self.batch.masked_faa(t.addr, ADD_DCNT, BOUNDARY);
                checks.push((h, Continue::Token { node: t.node }, t.tag));
            }
        }
        if spill {
            self.batch
                .masked_faa(self.spill_addr(), SPILL_RELEASE, SPILL_BOUNDARY);
        }
        if self.batch.is_empty() {
            return Ok(());
        }
        self.exec()?;
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
