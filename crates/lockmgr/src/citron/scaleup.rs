//! Scaling the tree (CITRON §3.9): Algorithm 4, the release continuation of Alg. 3 l. 10-12,
//! and the blocking scale-down of §3.9.2.
//!
//! # What a scale-up copies, and who gives it back
//!
//! A scale-up from height `b` to `a` keeps the old tree as the leftmost subtree. For every
//! internal node `y` in the old tree's top `m` levels, in index order (the root first), one
//! masked CAS writes the scale-up's tag into `Exp` and returns `y`'s word `v` (Alg. 4 l. 5).
//! Then (l. 6-8):
//!
//! - `y`'s outstanding notifications, `v.DMax - v.DCnt`, are added to `DMax` of `y`'s ancestors
//!   at distances `m, 2m, …` in the new tree: every request notified at `y` now also counts
//!   where an acquirer above the old root looks (the chain of notified ancestors keeps gaps of
//!   at most `m` levels up to level `m - 1` of the new tree);
//! - the old root's own `Occ` is added to its ancestors at distances `1, 1 + m, …` — the old root
//!   notified nobody, and an acquirer at its new parent must see it (the paper's "an occupied
//!   node accounts for an extra unit of DMax").
//!
//! All these targets are new nodes (tag 0), invisible to acquirers until the record is committed.
//!
//! A releaser compares the tag returned by its release verb on a node with the tag it saw when it
//! notified (or occupied) it. Equal: no scale-up snapshotted the node in between, nothing was
//! copied. Different: exactly the copies above were made, by the scale-up that wrote this tag —
//! found in the record's event history — and the releaser adds `DCnt` on the same targets
//! (recursively: those targets may themselves have been snapshotted by a later scale-up).
//!
//! Tags cycle through `1..=6` (and `m <= 6`): a node is touched only while it lies in the top
//! `m` levels, i.e. by at most `m` consecutive scale-ups, so the tags it carries over its life are
//! distinct and "different tag" really means "touched". Only the last toucher copies anything
//! (an earlier one found no ancestor `m` levels up, or the node would not still be in the top `m`
//! levels), hence the lookup by the node's current tag. The record is rewritten with the new
//! event marked pending *before* any tag is written, so a releaser that sees a tag finds its
//! event by re-reading the record.
//!
//! Acquirers abort when the root of their tree carries `Exp` (Alg. 2 l. 15, l. 33): the root is
//! snapshotted first, so an acquirer whose notification came after some node's snapshot (and
//! was therefore not copied) sees the root's `Exp` in the same batch, posted after it.
//!
//! # A scale-up whose scaler died (beyond the paper)
//!
//! The scaler holds the spillover mutex throughout. If it dies after announcing (the record is
//! `pending`) — and in particular after tagging, when every acquirer meeting the old root
//! aborts and waits for the new configuration — the next client to take the mutex (which it
//! gets only by breaking the dead holder's lease) finishes the scale-up
//! ([`CitronClient::finish_scale_up`]). It cannot redo l. 6-8 as written: the words the tags
//! snapshotted are gone with the scaler. But what l. 6-8 must achieve at each copy target `t`
//! can be computed from what is there now. The copies at `t` must count every notification
//! (and occupied old root) that was outstanding at the snapshot of a node `y` copying to `t`.
//! Of those, the ones released since went on to release their copy at `t` (`DCnt(t)`, added
//! by releasers that saw the tag change), and the others are still outstanding at `y`. So
//! `t` needs `DMax(t) = DCnt(t) + Σ outstanding(y) now` (+1 for an old root occupied now), set
//! with one masked FAA of the difference whatever the dead scaler added before it died.
//! Untagged nodes are tagged first (their snapshot is now). Races only over-count (a release
//! between reading `y` and reading `t` counts twice; a scaler that was only paused and adds
//! its copies late counts twice): an over-count makes acquirers at `t` wait for a notification
//! that is not there, which lease recovery repairs (§3.10); it never lets two requests overlap,
//! which an under-count could.
//!
//! # Scale-down (§3.9.2)
//!
//! Under a whole-range lock (`[0, ∞)`: the spillover mutex plus the root), the tree can shrink
//! to its leftmost subtree. No request is outstanding then (every notification has been released,
//! or the holder could not have passed its own phase (d)), so the new top `m` levels get their
//! tags reset to 0; the abandoned root gets the shrink tag so that stale waiters abort; the
//! record is rewritten; then the lock is released. The abandoned nodes' memory stays allocated
//! (freeing it needs an allocator call that does not exist yet).

use super::config::{ConfigRecord, Event};
use super::layout::{
    self, add_dmax, counter_gap, dcnt, dmax, occ, pow4, tree_nodes, Node, Segment, ADD_DCNT,
    BOUNDARY, EXP, EXP_SHIFT, MAX_SCALE_TAG, SHRUNK_TAG,
};
use super::spillover::target_height;
use super::{CitronClient, Held};
use crate::scheme::{LockError, LockId};
use fabric::{AtomicHandle, EndpointExt, RemoteAddr};
use std::time::Instant;

/// Most verbs put in one batch by the scaling code (the fabric's limit is 4096).
const CHUNK: usize = 4000;

/// A release that may need to continue on new ancestors.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Continue {
    /// A notification at `node` (or a copy of one made by a scale-up).
    Token {
        /// Where it was made.
        node: Node,
        /// A shared notification (`SMax` of the share word, `docs/SHARED_LOCKS.md`).
        shared: bool,
    },
    /// `Occ` at `node`, which was the root of the tree of height `height` when occupied.
    RootOcc {
        /// The occupied node.
        node: Node,
        /// The tree it was the root of.
        height: u32,
        /// Readers registered at the root (its share word's `RMax`), not `Occ`.
        shared: bool,
    },
}

/// Ancestors of `node` at distances `first, first + m, first + 2m, …` in the tree of height
/// `after` (Alg. 4 l. 6-7), within the tree of height `cap`.
pub(crate) fn copy_targets(node: Node, after: u32, cap: u32, first: u32, m: u32) -> Vec<Node> {
    let level = node.level(after);
    let mut out = Vec::new();
    let mut d = first;
    while d <= level {
        let t = node.ancestor(d);
        if t.in_tree(cap) {
            out.push(t);
        }
        d += m;
    }
    out
}

/// Whether scale-up `e` snapshotted `node` (an internal node in the old tree's top `m` levels).
fn touches(e: &Event, node: Node, m: u32) -> bool {
    e.tag != SHRUNK_TAG && node.hgt >= 1 && node.in_tree(e.before) && node.level(e.before) < m
}

impl CitronClient {
    /// Algorithm 4, called holding the spillover mutex (l. 2) with a current record. Returns
    /// `false` when there is nothing to grow or memory was refused (then not retried until the
    /// record changes). The caller releases the mutex (l. 11).
    pub(crate) fn scale_up(&mut self, maximizer: u64) -> Result<bool, LockError> {
        let b = self.rec.height;
        let m = self.rec.m;
        let Some(a) = target_height(b, maximizer, self.rec.max_units, self.rec.min_scale_levels)
        else {
            self.scale_failed_epoch = Some(self.rec.epoch);
            return Ok(false);
        };
        // l. 3: one allocation for the whole new part: its nodes and their owner records.
        let words = layout::STORAGE_WORDS_PER_NODE * (tree_nodes(a) - tree_nodes(b));
        let seg_addr = match self.allocator.allocate(words) {
            Ok(addr) => addr,
            Err(e) => {
                tracing::warn!(error = %e, "lock tree scale-up: allocation refused");
                self.scale_failed_epoch = Some(self.rec.epoch);
                return Ok(false);
            }
        };
        let tag = self.rec.next_tag;
        let mut next = self.rec.clone();
        next.epoch += 1;
        next.segments.push(Segment {
            before: b,
            after: a,
            cap: a,
            addr: seg_addr,
        });
        next.events.push(Event {
            before: b,
            after: a,
            tag,
            cap: a,
        });
        next.pending = true;
        next.next_tag = tag % MAX_SCALE_TAG + 1;
        let sealed = match next.seal() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "lock tree scale-up: record full");
                self.scale_failed_epoch = Some(self.rec.epoch);
                return Ok(false);
            }
        };
        // The event is announced before any tag is written (see the module docs).
        self.ep.write(self.base, &sealed)?;
        failpoint!("lockmgr::citron::scale_up_announced");

        // l. 4-5: Exp on the internal nodes of the old top m levels, by index order; then the
        // same tag on their share words (`docs/SHARED_LOCKS.md`, scale-up).
        let (top, olds) = self.tag_top(b, m, tag)?;
        let shares = self.tag_shares(&top, tag)?;

        failpoint!("lockmgr::citron::scale_up_tagged");

        // l. 6-8: copy the outstanding notifications (and the old root's Occ) upwards.
        let old_root = Node::root(b);
        let mut adds: Vec<(RemoteAddr, u64)> = Vec::new();
        for (y, v) in top.iter().zip(&olds) {
            let outstanding = counter_gap(dmax(*v), dcnt(*v));
            if outstanding > 0 {
                for t in copy_targets(*y, a, a, m, m) {
                    adds.push((node_addr_in(&next, t)?, add_dmax(outstanding)));
                }
            }
            if *y == old_root && occ(*v) {
                for t in copy_targets(*y, a, a, 1, m) {
                    adds.push((node_addr_in(&next, t)?, add_dmax(1)));
                }
            }
        }
        // The shared twins: outstanding shared notifications (`SMax - SCnt`) go where the
        // exclusive ones go, the old root's readers (`RMax - RCnt`) where its `Occ` goes — into
        // the share words there.
        for (y, sv) in top.iter().zip(&shares) {
            let outstanding = counter_gap(dmax(*sv), dcnt(*sv));
            if outstanding > 0 {
                for t in copy_targets(*y, a, a, m, m) {
                    adds.push((share_addr_in(&next, t)?, add_dmax(outstanding)));
                }
            }
            let readers = layout::node_readers(*sv);
            if *y == old_root && readers > 0 {
                for t in copy_targets(*y, a, a, 1, m) {
                    adds.push((share_addr_in(&next, t)?, add_dmax(readers)));
                }
            }
        }
        for chunk in adds.chunks(CHUNK) {
            self.batch.clear();
            for (addr, add) in chunk {
                self.batch.masked_faa(*addr, *add, BOUNDARY);
            }
            self.exec()?;
        }
        // Readers in use on the old tree are in use on the new one (`layout::READERS_SEEN`).
        if shares
            .first()
            .is_some_and(|w| w & layout::READERS_SEEN != 0)
        {
            self.carry_readers_seen(&next, a)?;
        }

        // l. 9-10: publish the new configuration, clear the maximizer.
        self.publish_scale_up(next, a)?;
        self.stats.scale_ups += 1;
        tracing::debug!(from = b, to = a, tag, "lock tree scaled up");
        Ok(true)
    }

    /// Alg. 4 l. 4-5: writes scale-up tag `tag` into `Exp` of every internal node in the top
    /// `m` levels of the tree of height `b`, by index order (the root first), and returns those
    /// nodes with the words the masked CASes returned (their snapshots).
    fn tag_top(&mut self, b: u32, m: u32, tag: u8) -> Result<(Vec<Node>, Vec<u64>), LockError> {
        let mut top = Vec::new();
        for level in 0..m.min(b - 1) {
            let hgt = b - 1 - level;
            for pos in 0..pow4(level) {
                top.push(Node::new(hgt, pos));
            }
        }
        let mut words = Vec::with_capacity(top.len());
        for chunk in top.chunks(CHUNK) {
            self.batch.clear();
            let mut hs: Vec<AtomicHandle> = Vec::with_capacity(chunk.len());
            for y in chunk {
                let addr = self.node_addr(*y)?;
                hs.push(
                    self.batch
                        .masked_cas(addr, 0, 0, u64::from(tag) << EXP_SHIFT, EXP),
                );
            }
            self.exec()?;
            words.extend(hs.iter().map(|h| self.out.old(*h)));
        }
        Ok((top, words))
    }

    /// The share words of `top` get scale-up tag `tag` (after their node words: an acquirer
    /// whose shared notification missed a snapshot sees the root's `Exp`); returns their
    /// snapshots.
    fn tag_shares(&mut self, top: &[Node], tag: u8) -> Result<Vec<u64>, LockError> {
        let mut words = Vec::with_capacity(top.len());
        for chunk in top.chunks(CHUNK) {
            self.batch.clear();
            let mut hs: Vec<AtomicHandle> = Vec::with_capacity(chunk.len());
            for y in chunk {
                let addr = self.share_addr(*y)?;
                hs.push(
                    self.batch
                        .masked_cas(addr, 0, 0, u64::from(tag) << EXP_SHIFT, EXP),
                );
            }
            self.exec()?;
            words.extend(hs.iter().map(|h| self.out.old(*h)));
        }
        Ok(words)
    }

    /// Alg. 4 l. 9-10: publishes `next` (the announced record) as the finished configuration
    /// of height `a` and clears the maximizer, in one batch.
    fn publish_scale_up(&mut self, mut next: ConfigRecord, a: u32) -> Result<(), LockError> {
        next.height = a;
        next.pending = false;
        next.epoch += 1;
        let sealed = next.seal()?;
        self.batch.clear();
        self.batch.write(self.base, &sealed);
        self.batch.write_u64(self.maximizer_addr(), 0);
        self.exec()?;
        self.rec = next;
        Ok(())
    }

    /// Finishes the scale-up the current record announces (`pending`) whose scaler lost the
    /// spillover mutex (see the module docs). Called holding the spillover mutex with the
    /// pending record as `self.rec`; the caller releases the mutex.
    pub(crate) fn finish_scale_up(&mut self) -> Result<(), LockError> {
        let Some(e) = self.rec.events.last().copied().filter(|_| self.rec.pending) else {
            return Ok(());
        };
        let (b, a, tag, m) = (e.before, e.after, e.tag, self.rec.m);
        // l. 4-5 where the scaler did not get to (idempotent where it did); the words now.
        let (top, words) = self.tag_top(b, m, tag)?;
        let shares = self.tag_shares(&top, tag)?;
        if shares
            .first()
            .is_some_and(|w| w & layout::READERS_SEEN != 0)
        {
            let rec = self.rec.clone();
            self.carry_readers_seen(&rec, a)?;
        }
        // What each copy target must count besides its DCnt: the outstanding notifications of
        // the nodes copying to it (and an occupied old root), every target listed; the same
        // for the share words (shared notifications, the old root's readers).
        let old_root = Node::root(b);
        for shared in [false, true] {
            let snaps = if shared { &shares } else { &words };
            let mut need: std::collections::BTreeMap<(u32, u64), (Node, u64)> = Default::default();
            for (y, v) in top.iter().zip(snaps) {
                let outstanding = counter_gap(dmax(*v), dcnt(*v));
                for t in copy_targets(*y, a, a, m, m) {
                    need.entry((t.hgt, t.pos)).or_insert((t, 0)).1 += outstanding;
                }
                if *y == old_root {
                    let occupied = if shared {
                        layout::node_readers(*v)
                    } else {
                        u64::from(occ(*v))
                    };
                    for t in copy_targets(*y, a, a, 1, m) {
                        need.entry((t.hgt, t.pos)).or_insert((t, 0)).1 += occupied;
                    }
                }
            }
            let targets: Vec<(Node, u64)> = need.into_values().collect();
            self.fix_copies(&targets, shared)?;
        }
        // l. 9-10.
        self.publish_scale_up(self.rec.clone(), a)?;
        self.stats.recoveries += 1;
        tracing::warn!(
            from = b,
            to = a,
            tag,
            "lock tree: finished a scale-up whose scaler died"
        );
        Ok(())
    }

    /// Sets `READERS_SEEN` on the root of the tree of height `a` described by `rec`.
    fn carry_readers_seen(&mut self, rec: &ConfigRecord, a: u32) -> Result<(), LockError> {
        let at = share_addr_in(rec, Node::root(a))?;
        self.batch.clear();
        self.batch
            .masked_cas(at, 0, 0, layout::READERS_SEEN, layout::READERS_SEEN);
        self.exec()
    }

    /// `finish_scale_up`'s repair of the copy targets: each must count `DCnt + n` in `DMax`
    /// (node words, or share words when `shared`).
    fn fix_copies(&mut self, targets: &[(Node, u64)], shared: bool) -> Result<(), LockError> {
        for chunk in targets.chunks(CHUNK) {
            let addrs = chunk
                .iter()
                .map(|(t, _)| {
                    if shared {
                        share_addr_in(&self.rec, *t)
                    } else {
                        node_addr_in(&self.rec, *t)
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            self.batch.clear();
            let reads: Vec<_> = addrs.iter().map(|addr| self.batch.read(*addr, 8)).collect();
            self.exec()?;
            let now: Vec<u64> = reads.iter().map(|h| self.out.word(*h, 0)).collect();
            self.batch.clear();
            for ((addr, (_, n)), w) in addrs.iter().zip(chunk).zip(now) {
                let delta = counter_gap(dcnt(w) + n, dmax(w));
                if delta != 0 {
                    self.batch.masked_faa(*addr, add_dmax(delta), BOUNDARY);
                }
            }
            self.exec()?;
        }
        Ok(())
    }

    /// Alg. 3 l. 10-12, generalised: give back the copies a scale-up made of our notifications
    /// (and of an occupied root), following later scale-ups recursively. `work` holds what to
    /// continue from and the tag seen there.
    pub(crate) fn continue_release(
        &mut self,
        mut work: Vec<(Continue, u8)>,
    ) -> Result<(), LockError> {
        let start = Instant::now();
        let patience = self.rec.t_lease() * 10;
        let mut backoff = self.backoff();
        while !work.is_empty() {
            // l. 11: fetch the configuration that describes the scale-up(s).
            self.refresh()?;
            let m = self.rec.m;
            let mut targets: Vec<(Node, bool)> = Vec::new();
            let mut unresolved = Vec::new();
            for (c, seen) in work.drain(..) {
                if seen == SHRUNK_TAG || seen == 0 {
                    // A scale-down abandoned the node, or reset its tag with nothing
                    // outstanding: nothing was copied.
                    continue;
                }
                match c {
                    Continue::Token { node, shared } => {
                        match self
                            .rec
                            .events
                            .iter()
                            .rev()
                            .find(|e| e.tag == seen && touches(e, node, m))
                        {
                            Some(e) => targets.extend(
                                copy_targets(node, e.after, e.cap, m, m)
                                    .into_iter()
                                    .map(|t| (t, shared)),
                            ),
                            None => unresolved.push((c, seen)),
                        }
                    }
                    Continue::RootOcc {
                        node,
                        height,
                        shared,
                    } => {
                        match self
                            .rec
                            .events
                            .iter()
                            .rev()
                            .find(|e| e.tag != SHRUNK_TAG && e.before == height)
                        {
                            Some(e) if node == Node::root(height) => targets.extend(
                                copy_targets(node, e.after, e.cap, 1, m)
                                    .into_iter()
                                    .map(|t| (t, shared)),
                            ),
                            Some(_) => {}
                            None => unresolved.push((c, seen)),
                        }
                    }
                }
            }
            // l. 12: release the copies; each may have been copied again.
            for chunk in targets.chunks(CHUNK) {
                self.batch.clear();
                let mut hs = Vec::with_capacity(chunk.len());
                for &(t, shared) in chunk {
                    let addr = if shared {
                        layout::share_addr(&self.rec.segments, t)
                    } else {
                        layout::node_addr(&self.rec.segments, t)
                    };
                    if let Some(addr) = addr {
                        hs.push((t, shared, self.batch.masked_faa(addr, ADD_DCNT, BOUNDARY)));
                    }
                }
                if hs.is_empty() {
                    continue;
                }
                self.exec()?;
                for (t, shared, h) in hs {
                    let seen = layout::exp_tag(self.out.old(h));
                    if seen != 0 {
                        work.push((Continue::Token { node: t, shared }, seen));
                    }
                }
            }
            if !unresolved.is_empty() {
                if start.elapsed() > patience {
                    tracing::error!(
                        ?unresolved,
                        "release after scale-up: no matching scale event; copies left behind"
                    );
                } else {
                    backoff.snooze(&mut self.rng);
                    work.extend(unresolved);
                }
            }
        }
        Ok(())
    }

    /// Scale-down (§3.9.2): marks a held whole-range lock (`[0, ∞)`, taken with
    /// [`RangeLock::acquire`](crate::RangeLock::acquire) of `0..u64::MAX`) so that its release
    /// first shrinks the tree to the leftmost subtree covering `unit_count` units. Returns the
    /// new `N` (unchanged when the tree is already that small).
    pub fn scale_down(&mut self, id: LockId, unit_count: u64) -> Result<u64, LockError> {
        let root = Node::root(self.rec.height);
        let held = self.held.get_mut(&id.0).ok_or(LockError::NotHeld(id))?;
        let whole =
            held.spill && held.nodes.len() == 1 && held.nodes[0].node == root && held.nodes[0].occ;
        if !whole {
            return Err(LockError::Config(
                "scale-down needs a held whole-range lock [0, ∞)".into(),
            ));
        }
        let h = layout::height_for(unit_count).ok_or_else(|| {
            LockError::Config(format!("{unit_count} units exceed the largest tree"))
        })?;
        if h >= self.rec.height {
            held.shrink_to = None;
            return Ok(self.rec.units());
        }
        held.shrink_to = Some(h);
        Ok(layout::tree_units(h))
    }

    /// The scale-down part of releasing a marked whole-range lock: tags, then the record.
    pub(crate) fn shrink_before_release(&mut self, held: &Held, h: u32) -> Result<(), LockError> {
        let m = self.rec.m;
        let Some(old_root) = held.nodes.first() else {
            return Ok(());
        };
        let mut next = self.rec.clone();
        next.epoch += 1;
        next.height = h;
        for s in &mut next.segments {
            s.cap = s.cap.min(h);
        }
        for e in &mut next.events {
            e.cap = e.cap.min(h);
        }
        let sealed = next.seal()?;
        self.batch.clear();
        // Stale waiters must abort: the abandoned root gets the shrink tag.
        self.batch
            .masked_cas(old_root.addr, 0, 0, u64::from(SHRUNK_TAG) << EXP_SHIFT, EXP);
        // Nothing is outstanding: the new top m levels start with clean tags.
        for level in 0..m.min(h - 1) {
            for pos in 0..pow4(level) {
                let y = Node::new(h - 1 - level, pos);
                let addr = self.node_addr(y)?;
                self.batch.masked_cas(addr, 0, 0, 0, EXP);
                let share = self.share_addr(y)?;
                self.batch.masked_cas(share, 0, 0, 0, EXP);
            }
        }
        self.batch.write(self.base, &sealed);
        self.exec()?;
        self.rec = next;
        Ok(())
    }
}

fn share_addr_in(rec: &ConfigRecord, node: Node) -> Result<RemoteAddr, LockError> {
    layout::share_addr(&rec.segments, node)
        .ok_or_else(|| LockError::Config(format!("node {node:?} has no storage")))
}

fn node_addr_in(rec: &ConfigRecord, node: Node) -> Result<RemoteAddr, LockError> {
    layout::node_addr(&rec.segments, node)
        .ok_or_else(|| LockError::Config(format!("node {node:?} has no storage")))
}
