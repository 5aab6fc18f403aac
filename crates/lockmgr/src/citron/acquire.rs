//! Step 2 of lock acquisition (CITRON Alg. 2 l. 6-37): for each node of the split, in ascending
//! order, phases (a) ticket, (b) wait for occupied ancestors, (c) occupy or lock the leaf,
//! (d) notify ancestors and wait for descendants; with the fast path of §3.8, starvation
//! avoidance (§3.5.4) and lease recovery at every spin point (§3.10).
//!
//! Deviation in phase (b), for inequality (1): after waiting for an occupied ancestor, the walk
//! re-reads *all* ancestors instead of only those above the one it waited for (l. 19). `t1` must
//! precede the moment any ancestor was occupied (§3.5.5: a `t1` per ancestor); a fresh read of all
//! of them gives one `t1` that is valid for every ancestor, at the price of a slightly larger
//! read batch (no extra round trip).
//!
//! Extension of the fast path (§3.8), the *one-batch leaf*: a leaf request posts phase (b)'s
//! ancestor reads (l. 14) in the same batch as (c)'s masked CAS and (d)'s notifications, so an
//! uncontended leaf takes one round trip instead of the paper's two. The fabric executes a batch
//! in posting order (on RDMA the CAS would carry the fence flag, which orders it after the
//! reads), so the reads still precede the CAS at the server and `t1`, taken before posting,
//! still precedes any `Occ` they miss: inequality (1) keeps its meaning. When the reads find an
//! occupied ancestor (or the root's `Exp`), the CAS and the notifications were speculative and
//! are undone exactly as an aborted attempt is (§3.5.5: aborting is releasing). To everyone else
//! the attempt looks like one whose reads came just before the ancestor's `Occ` and that then
//! aborted, a history the unbatched protocol already allows; so it adds no state another client
//! can observe. The request then waits in the regular phase (b).
//!
//! Addition for `k >= 2` (not in the paper): a request holding node 1 while it waits for node 2
//! can deadlock with a wider lock `Y` whose occupied node covers both — `Y` waits in phase (d)
//! for node 1's notifications, the request waits in phase (b) for `Y`'s `Occ` (or in a ticket
//! queue behind someone who does). So a request that finds, in phase (b), an occupied ancestor
//! covering a node it already holds gives back everything it holds on the tree and starts over
//! (holding nothing, it can wait like anyone else); and a request that waits in a ticket queue
//! longer than `restart_after` while holding nodes does the same.
//!
//! Bounded waits under lease recovery: a client paused past its lease (SIGSTOP, a VM
//! pause) resumes with its old view while waiters behind it have broken its hold (§3.10). Every
//! place where it could wait for something that will never come, or act on a hold that is no
//! longer its own, checks for it:
//!
//! - phase (a), `wait_ticket`: `TCnt` moved past our ticket (outside `[TCnt, TMax)`) — passed
//!   over by a break-in; the ticket is not ours, the request starts over;
//! - phase (c), `post_occupy`: `Occ` is set by a masked CAS conditional on `TCnt` still being our
//!   ticket; if it fails, our turn was broken between the grant and the occupation;
//! - phase (d) and everything held so far: a notification repaired by a waiter (`DCnt := DMax`)
//!   leaves no trace we could read (`DCnt` counts releases in any order), so it is decided by
//!   time: every part carries its lease deadline (`lease`), and an acquisition that ends past
//!   its lock's deadline gives everything back and starts over (`acquire_inner`).
//!
//! The releases that follow are safe for whoever holds the lock now (`release` module docs).
//!
//! Recovery by identity (an addition to §3.10): the ticket break-in waits `(Δ + H + 2)·T_lease`
//! because a live holder may take that long without moving the word. When the holder is known
//! *gone* that patience buys nothing. A client with an identity (`ClientOptions::owner`) writes
//! an owner record with every node it occupies (`layout`, "Owner word"); the first waiter in
//! line (`Δ = 1`) that sees an occupied node stand still reads the record and, if it names the
//! turn being served, asks its fence whether that holder is gone ([`crate::Fence::holder_gone`]:
//! ended and revoked on every server, or — once the node stood still a whole `T_lease` —
//! silent and fenced by this very question). Then it breaks in with the same masked CAS as the
//! lease rule. The first question comes after `T_lease / 4`, then at growing intervals (at
//! most `T_lease`), so a holder killed outright is broken within about a quarter of a lease and
//! a stopped one within about one, instead of `(H + 3)·T_lease`. Safety does not rest on time
//! here: a holder the fence calls gone can land no verb on any server, its late releases and
//! data writes included. A holder the fence cannot vouch for keeps the lease rule.
//!
//! Verbs carried for the caller (`RangeLock::acquire_with`, `crate::carry`): they ride at the
//! end of every batch this module executes, and the results of the acquisition's last batch
//! are handed back. That batch is where the grant is learned, or later: for the last node of
//! the split (l. 6-7 lock the nodes in ascending order, so it is the last one acquired), l. 37
//! returns ACQUIRED right after either l. 31's notification batch (a leaf, no descendants to
//! wait for; with the one-batch leaf, the batch of l. 14, l. 22 and l. 31 together), accepted
//! by l. 32-33's checks, or the l. 36 poll that found `DCnt = DMax` on the last descendant (an
//! internal node). In both the carried verbs are posted after the granting verbs on the same
//! endpoint, so they execute after them: every conflicting holder that released before the
//! grant (its release verbs observed by l. 11, l. 18 or l. 36, or l. 22's CAS succeeding) is
//! seen, and one that comes after waits for our release (l. 34-36 against our l. 31
//! notification, which inequality (1) of l. 32 guarantees landed in time). The spillover
//! mutex (Alg. 1 l. 4) is taken before the tree (l. 6), so a tree batch is the last whenever
//! the range reaches into the tree. An attempt that aborts (l. 15, 26, 32, 33) or restarts is
//! followed by more batches, whose results replace its own.

use super::config::DELTA;
use super::layout::{
    self, counter_gap, dcnt, dmax, exp_tag, occ, tcnt, tmax, LeafShare, Node, ADD_DMAX, ADD_TMAX,
    BOUNDARY, DCNT, DCNT_SHIFT, DMAX, LEAF_SHARE_BYTES, OCC, TCNT, TCNT_SHIFT, TMAX,
};
use super::lease;
use super::split::split;
use super::{CitronClient, Held, HeldNode, Phase, Token};
use crate::backoff::wait_until;
use crate::scheme::LockError;
use fabric::{AtomicHandle, ReadHandle, RemoteAddr};
use std::collections::VecDeque;
use std::time::Instant;

/// Why an attempt on a node was given up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Why {
    /// Inequality (1) failed (Alg. 2 l. 32).
    TimeLimit,
    /// The root carries `Exp`: the tree is being scaled (Alg. 2 l. 15, l. 33).
    ScaleUp,
    /// An occupied ancestor did not move for `T_lease` (§3.10, l. 18).
    Suspected,
    /// The leaf kept failing its masked CAS (§3.5.4, l. 23): lock the parent, then repair the
    /// leaf if a dead holder left bits in it (§3.10, l. 22).
    Starvation(Node),
    /// A writer waited in phase (b) for the readers of an ancestor longer than
    /// `starvation_after` while readers kept coming: it locks that ancestor instead, whose
    /// bakery bars new readers behind it (`docs/SHARED_LOCKS.md`, writer starvation).
    ReadersStarve,
}

/// The result of one `LOCKNODE` (Alg. 2 l. 8).
pub(crate) enum Outcome {
    /// Locked; `true` when it took the fast path without waiting.
    Acquired(Box<HeldNode>, bool),
    /// Undone; retry the same node.
    Aborted(Why),
    /// Undone; lock this ancestor instead.
    Escalate(Node, Why),
    /// Undone; give back every node of the request and start over (deadlock avoidance).
    Restart,
    /// Undone (a reader): the bits of this leaf that kept it out stood still for the
    /// starvation bound. Give back every node of the request, take the writer's path that
    /// repairs a dead writer's leaf (`repair_leaf_as_writer`), then start over in shared mode.
    RepairLeaf(Node),
}

/// A bakery ticket taken and served (`take_ticket`).
struct TicketTaken {
    /// Served at once, without waiting.
    at_once: bool,
    /// The fast path's phase-(b) reads, batched with the ticket, found nothing in the way: when
    /// they were posted (phase (b) is done).
    phase_b_done: Option<Instant>,
}

/// Result of waiting for a bakery ticket (`wait_ticket`).
enum TicketWait {
    /// Served: `TCnt` is our ticket, and became so after this instant (the post time of the last
    /// poll that did not see it, or of our break-in's CAS): the anchor of `lease::word_deadline`.
    Served(Instant),
    /// Give up this attempt (the ticket, if served, is still ours to pass on).
    Give(Outcome),
    /// Our ticket was passed over by another waiter's break-in: it is not ours any more.
    PassedOver,
}

/// Result of phase (b).
enum PhaseB {
    /// No occupied ancestor, as of a read batch posted at this instant; `true` if it waited.
    Clear(Instant, bool),
    /// Give up this attempt.
    Give(Outcome),
}

/// What a request for one node knows before its first verb (`lock_node`, `lock_node_shared`):
/// the tree's shape and timing as the record gives them, and the words it will touch.
struct NodeRequest {
    /// The nodes of this request already held.
    holding: Vec<Node>,
    /// The tree's height.
    h: u32,
    /// Every `m`-th ancestor is notified (§3.5.4).
    m: u32,
    /// `T_wait` (§3.5.5).
    t_wait: std::time::Duration,
    /// The bound of inequality (1): `T_wait · (1 − δ)`.
    bound: std::time::Duration,
    /// The tree's root.
    root: Node,
    /// The node's word.
    addr: RemoteAddr,
    /// The root's word.
    root_addr: RemoteAddr,
    /// Every ancestor of the node, nearest first, with its word.
    ancs: Vec<(Node, RemoteAddr)>,
    /// The ancestors to notify (Alg. 2 l. 31), each with the word its notification goes to.
    targets: Vec<(Node, RemoteAddr)>,
}

impl CitronClient {
    /// A request for `node` given `held`, its notifications going to `target_word` of each
    /// target ancestor (the node word for a writer's `DMax`, the share word for a reader's
    /// `SMax`).
    fn node_request(
        &self,
        node: Node,
        held: &[HeldNode],
        target_word: fn(&Self, Node) -> Result<RemoteAddr, LockError>,
    ) -> Result<NodeRequest, LockError> {
        let h = self.rec.height;
        let m = self.rec.m;
        let t_wait = self.rec.t_wait();
        let root = Node::root(h);
        let mut ancs = Vec::with_capacity(node.level(h) as usize);
        for d in 1..=node.level(h) {
            let a = node.ancestor(d);
            ancs.push((a, self.node_addr(a)?));
        }
        let mut targets = Vec::new();
        layout::notify_targets(node, h, m, &mut targets);
        let targets = targets
            .into_iter()
            .map(|t| target_word(self, t).map(|a| (t, a)))
            .collect::<Result<_, _>>()?;
        Ok(NodeRequest {
            holding: held.iter().map(|h| h.node).collect(),
            h,
            m,
            t_wait,
            bound: t_wait.mul_f64(1.0 - DELTA),
            root,
            addr: self.node_addr(node)?,
            root_addr: self.node_addr(root)?,
            ancs,
            targets,
        })
    }
}

impl CitronClient {
    /// Alg. 2 l. 31: posts the `DMax` notification of every target ancestor and the read of the
    /// root, into the current batch (one round trip with whatever else it carries).
    fn post_notify(
        &mut self,
        targets: &[(Node, RemoteAddr)],
        root_addr: RemoteAddr,
    ) -> (Vec<AtomicHandle>, ReadHandle) {
        let toks = targets
            .iter()
            .map(|(_, a)| self.batch.masked_faa(*a, ADD_DMAX, BOUNDARY))
            .collect();
        (toks, self.batch.read(root_addr, 8))
    }

    /// Phase (c) on an internal node (Alg. 2 l. 28), as a conditional verb: set `Occ` only if
    /// `TCnt` is still our ticket and `Occ` clear. Same cost as the paper's masked FAA (one
    /// atomic in the same batch), and identical in effect while the ticket is ours — by the
    /// bakery invariant (`HeldNode::ticket_no`) nobody else writes `TCnt`/`Occ` then, and `Occ`
    /// is clear when our turn begins (our predecessor's release, or a break-in, cleared it).
    /// But a holder paused between its grant and this verb, whose turn a waiter broke meanwhile
    /// (§3.10 l. 11: `TCnt` moved to the breaker's ticket, `Occ` cleared), must not set the
    /// breaker's `Occ`: `Occ` is one bit, so the breaker's own masked FAA would then *clear* it.
    ///
    /// With an identity (`ClientOptions::owner`), the node's owner record is written first, in
    /// the same batch (`layout`, "Owner word"): a waiter that sees our `Occ` reads our record.
    fn post_occupy(&mut self, node: Node, addr: RemoteAddr, ticket: u64) -> AtomicHandle {
        if let Some(owner) = self.opts.owner {
            if let Some(at) = layout::owner_addr(&self.rec.segments, node) {
                self.batch.write_u64(at, layout::owner_word(ticket, owner));
            }
        }
        self.batch
            .masked_cas(addr, ticket << TCNT_SHIFT, TCNT | OCC, OCC, OCC)
    }

    /// Whether `post_occupy`'s CAS (which returned `old`) took effect. If not, our ticket was
    /// passed over by a break-in: counted, and the caller gives back the rest and starts over.
    fn occupied_ours(&mut self, old: u64, ticket: u64) -> bool {
        if old & (TCNT | OCC) == ticket << TCNT_SHIFT {
            return true;
        }
        self.stats.passed_over += 1;
        self.progress.aborted(8);
        tracing::warn!(
            ticket,
            tcnt = tcnt(old),
            "lock tree node: our turn was broken before we occupied it (paused past the lease?); starting over"
        );
        false
    }

    /// The release tokens of a notification that has executed, in a batch posted at `posted`:
    /// where each went, the `Exp` tag it saw (Alg. 3 l. 10-12 compares it at release to find
    /// scale-ups in between), and its lease deadline (`lease::token_deadline`).
    fn notify_tokens(
        &self,
        targets: &[(Node, RemoteAddr)],
        toks: &[AtomicHandle],
        posted: Instant,
        shared: bool,
    ) -> Vec<Token> {
        let lease = self.rec.t_lease();
        targets
            .iter()
            .zip(toks)
            .map(|((n, a), h)| Token {
                node: *n,
                addr: *a,
                tag: exp_tag(self.out.old(*h)),
                deadline: lease::token_deadline(posted, lease, n.hgt),
                shared,
            })
            .collect()
    }

    /// `ACQUIRELOCKONTREE` (Alg. 2 l. 4-7) for `[l, r)` inside `[0, N)`: the nodes go into `held`.
    pub(crate) fn acquire_on_tree(
        &mut self,
        l: u64,
        r: u64,
        held: &mut Held,
        fast: &mut bool,
    ) -> Result<(), LockError> {
        // Step 1 (l. 5).
        let root = Node::root(self.rec.height);
        let mut pending: VecDeque<Node> = split(root, l, r, self.opts.k).into();
        let mut origin_leaf: Option<Node> = None;
        let mut restart_backoff = self.backoff();
        // Leaves a reader took the writer's path to repair (`Outcome::RepairLeaf`).
        let mut repaired: Vec<Node> = Vec::new();
        // l. 6-7: ascending order, each until acquired.
        while let Some(first) = pending.pop_front() {
            let mut target = first;
            loop {
                self.progress.attempt(target);
                // The configuration this attempt works with: undoing an attempt may re-read the
                // record (Alg. 3 l. 11, inside `release_parts`), so `self.rec` after the attempt
                // is not necessarily the one the attempt saw.
                let attempt_epoch = self.rec.epoch;
                let outcome = if self.shared() {
                    self.lock_node_shared(target, l, r, &mut held.nodes)?
                } else {
                    self.lock_node(target, l, r, &mut held.nodes)?
                };
                let why = match &outcome {
                    Outcome::Acquired(..) => 0,
                    Outcome::Aborted(Why::TimeLimit) => 1,
                    Outcome::Aborted(Why::ScaleUp) => 2,
                    Outcome::Escalate(_, Why::Starvation(_)) => 4,
                    Outcome::Aborted(_) | Outcome::Escalate(..) => 3,
                    Outcome::Restart => 5,
                    Outcome::RepairLeaf(_) => 9,
                };
                if why != 0 {
                    self.progress.aborted(why);
                }
                let outcome = match outcome {
                    // Once per leaf and acquisition: a reader whose leaf is still in the way
                    // after a repair (live writers kept coming) escalates as readers do.
                    Outcome::RepairLeaf(leaf) if repaired.contains(&leaf) => {
                        Outcome::Escalate(leaf.parent(), Why::Starvation(leaf))
                    }
                    o => o,
                };
                match outcome {
                    Outcome::RepairLeaf(leaf) => {
                        *fast = false;
                        repaired.push(leaf);
                        self.stats.retries += 1;
                        self.stats.starvation_escalations += 1;
                        let all = std::mem::take(&mut held.nodes);
                        self.release_parts(&all, None)?;
                        self.repair_leaf_as_writer(leaf)?;
                        let root = Node::root(self.rec.height);
                        pending = split(root, l, r, self.opts.k).into();
                        match pending.pop_front() {
                            Some(n) => target = n,
                            None => break,
                        }
                    }
                    Outcome::Restart => {
                        *fast = false;
                        self.stats.retries += 1;
                        self.stats.aborts.restart += 1;
                        let all = std::mem::take(&mut held.nodes);
                        self.release_parts(&all, None)?;
                        // The split of the tree as it is now (it may have grown).
                        let root = Node::root(self.rec.height);
                        pending = split(root, l, r, self.opts.k).into();
                        self.progress.set(Phase::Backoff);
                        restart_backoff.snooze(&mut self.rng);
                        match pending.pop_front() {
                            Some(n) => target = n,
                            None => break,
                        }
                    }
                    Outcome::Acquired(hn, was_fast) => {
                        *fast &= was_fast;
                        // §3.10 l. 22: after a starvation escalation, bits left in the leaf
                        // by a dead client are repaired — but not when the fast path (§3.8)
                        // locked the leaf whole as one of the node's children: then those
                        // bits are ours (the leaf was zero when we set them). Zeroing them
                        // would let a client whose phase-(b) read preceded our Occ take the
                        // leaf while we skip the phase-(d) wait, an overlap (and counted a
                        // recovery of a live client).
                        let leaf = origin_leaf.take();
                        let ours = match leaf {
                            Some(leaf) => hn.children.contains(&self.node_addr(leaf)?),
                            None => true,
                        };
                        held.nodes.push(*hn);
                        if let (Some(leaf), false) = (leaf, ours) {
                            self.repair_leaf(leaf)?;
                        }
                        break;
                    }
                    Outcome::Aborted(why) => {
                        *fast = false;
                        self.stats.retries += 1;
                        match why {
                            Why::TimeLimit => self.stats.aborts.time_limit += 1,
                            Why::ScaleUp => {
                                self.stats.aborts.scale_up += 1;
                                // Re-read the configuration; node names survive the scale-up,
                                // so the remaining nodes stay valid (§3.9.1).
                                self.wait_for_new_config(attempt_epoch)?;
                            }
                            Why::Suspected | Why::Starvation(_) | Why::ReadersStarve => {}
                        }
                    }
                    Outcome::Escalate(anc, why) => {
                        *fast = false;
                        self.stats.retries += 1;
                        match why {
                            Why::Starvation(leaf) => {
                                self.stats.starvation_escalations += 1;
                                // A reader holding the parent must not zero the leaf: a live
                                // writer may hold bits there while it waits for the readers
                                // of the leaf (`docs/SHARED_LOCKS.md`); a writer repairs it.
                                if !self.shared() {
                                    origin_leaf.get_or_insert(leaf);
                                }
                            }
                            Why::ReadersStarve => self.stats.starvation_escalations += 1,
                            _ => self.stats.aborts.suspected_failure += 1,
                        }
                        // Locking `anc` covers everything of ours inside it: release those
                        // (waiting for our own notifications would deadlock) and drop the
                        // nodes still to come inside it. What stays held lies left of `anc`,
                        // so the ascending order holds.
                        let (inside, keep): (Vec<HeldNode>, Vec<HeldNode>) =
                            std::mem::take(&mut held.nodes)
                                .into_iter()
                                .partition(|h| h.node.within(&anc));
                        held.nodes = keep;
                        self.release_parts(&inside, None)?;
                        pending.retain(|n| !n.within(&anc));
                        target = anc;
                    }
                }
            }
        }
        Ok(())
    }

    /// After an `Exp` abort (Alg. 2 l. 15, l. 33; §3.9.1 "he aborts and retries"): re-read the
    /// record until a finished configuration newer than `old` — the one the aborted attempt
    /// worked with — shows.
    ///
    /// Liveness: `old` must be the attempt's epoch, not `self.rec.epoch` at the time of the
    /// call. Undoing the attempt releases its notifications, and a release that finds a changed
    /// `Exp` tag continues on the new ancestors after re-reading the record (Alg. 3 l. 10-12):
    /// `self.rec` may already be the finished new configuration. Waiting for a configuration
    /// newer than *that* waited for a scale-up that might never come, while the request held
    /// its earlier nodes (k = 2) and wider requests waited for them in phase (d) — the hang
    /// of `citron_safety` under load.
    fn wait_for_new_config(&mut self, old: u64) -> Result<(), LockError> {
        self.progress.set(Phase::WaitConfig);
        let patience = self.rec.t_lease() * 10;
        let start = Instant::now();
        let mut backoff = self.backoff();
        loop {
            if self.rec.epoch != old && !self.rec.pending {
                return Ok(());
            }
            self.refresh()?;
            if self.rec.epoch != old && !self.rec.pending {
                return Ok(());
            }
            if self.rec.pending && start.elapsed() > self.rec.t_lease() * 2 {
                // The scaler holds the spillover mutex while it scales: past its lease, take
                // the mutex (breaking a dead holder's), which finishes the scale-up.
                self.finish_abandoned_scale_up()?;
                continue;
            }
            if start.elapsed() > patience {
                return Err(LockError::Config(
                    "a scale-up started but never finished (scaler died?)".into(),
                ));
            }
            backoff.snooze(&mut self.rng);
        }
    }

    /// Takes the spillover mutex (breaking a dead holder's after its lease) and gives it back:
    /// a holder that finds the record pending finishes the scale-up (`acquire_spillover`).
    fn finish_abandoned_scale_up(&mut self) -> Result<(), LockError> {
        if let Some((ticket, _)) = self.acquire_spillover(0)? {
            self.release_spillover(ticket)?;
        }
        Ok(())
    }

    /// `LOCKNODE` (Alg. 2 l. 8-37) on `node` for the request `[l, r)`.
    /// `held`: the nodes of this request already held (given back early to avoid deadlock,
    /// see the module docs).
    pub(crate) fn lock_node(
        &mut self,
        node: Node,
        l: u64,
        r: u64,
        held: &mut Vec<HeldNode>,
    ) -> Result<Outcome, LockError> {
        let NodeRequest {
            holding,
            h,
            m,
            t_wait,
            bound,
            root,
            addr,
            root_addr,
            ancs,
            targets,
        } = self.node_request(node, held, Self::node_addr)?;
        // Readers of an ancestor block us as its Occ does (`docs/SHARED_LOCKS.md`).
        // (Computed where used: only the root's until this client has seen readers in use.)
        let mut anc_shares: Vec<RemoteAddr> = self.anc_shares(&ancs)?;
        let share = self.share_addr(node)?;
        let mask = if node.is_leaf() {
            node.leaf_mask(l, r)
        } else {
            0
        };
        let fastp = self.opts.fast_path;
        let mut was_fast = fastp;
        let mut hn = HeldNode::new(node, addr);
        let mut phase_b_done: Option<Instant> = None;

        // Phase (a), l. 9-11: a bakery ticket on an internal node.
        if !node.is_leaf() {
            match self.take_ticket(node, addr, held, &ancs, &anc_shares, &mut hn)? {
                Ok(TicketTaken {
                    at_once,
                    phase_b_done: done,
                }) => {
                    was_fast &= at_once;
                    phase_b_done = done;
                }
                Err(give) => return Ok(give),
            }
        }

        let mut leaf_fail_since: Option<Instant> = None;
        let mut leaf_backoff = self.backoff();
        // A leaf on the fast path posts its phase-(b) reads in the (c)+(d) batch (module docs,
        // "one-batch leaf"), until an occupied ancestor has been seen: from then on it waits in
        // phase (b) like everyone else.
        let mut one_batch = fastp && node.is_leaf() && !ancs.is_empty();
        loop {
            // Phase (b), l. 12-19.
            self.progress.set(Phase::Ancestors);
            let t1 = match phase_b_done.take() {
                Some(t) => t,
                // Posted below, in front of phase (c)'s masked CAS.
                None if one_batch => Instant::now(),
                None => {
                    anc_shares = self.anc_shares(&ancs)?;
                    match self.phase_b(&ancs, &anc_shares, &holding)? {
                        PhaseB::Clear(t1, waited) => {
                            if waited {
                                was_fast = false;
                            }
                            t1
                        }
                        PhaseB::Give(outcome) => {
                            self.release_parts(&[hn], None)?;
                            return Ok(outcome);
                        }
                    }
                }
            };

            // Phase (c), l. 20-28, and the notification of (d), l. 29-31.
            self.progress.set(Phase::Occupy);
            let t0;
            let t2;
            let root_word;
            // A leaf's share words read right after the masked CAS (posting order): readers
            // that registered before our bits landed (`docs/SHARED_LOCKS.md`, leaves).
            let leaf_share: Option<LeafShare>;
            // Fast path over leaves: the children's share words and our own, read after the
            // children's CASes; the wait of (d) is skipped only when no reader shows there.
            let mut kids_readers = true;
            if fastp {
                // §3.8: (c) and (d) in one batch; for a node over leaves, also lock its four
                // children whole so that the wait of (d) can be skipped.
                self.batch.clear();
                // One-batch leaf: l. 14's reads, executed before the CAS (posting order).
                if one_batch {
                    anc_shares = self.anc_shares(&ancs)?;
                }
                let b_anc = one_batch.then(|| self.post_anc_reads(&ancs, &anc_shares));
                let main = if node.is_leaf() {
                    self.batch.masked_cas(addr, 0, mask, mask, mask)
                } else {
                    self.post_occupy(node, addr, hn.ticket_no)
                };
                let ls = node
                    .is_leaf()
                    .then(|| self.batch.read(share, LEAF_SHARE_BYTES));
                let kids: Vec<(RemoteAddr, AtomicHandle)> = if node.hgt == 1 {
                    let mut v = Vec::with_capacity(4);
                    for i in 0..4 {
                        let c = self.node_addr(Node::new(0, node.pos * 4 + i))?;
                        v.push((c, self.batch.masked_cas(c, 0, !0, !0, !0)));
                    }
                    v
                } else {
                    Vec::new()
                };
                let kid_shares: Option<(ReadHandle, ReadHandle)> = if node.hgt == 1 {
                    let first = self.share_addr(Node::new(0, node.pos * 4))?;
                    Some((
                        self.batch.read(first, 4 * LEAF_SHARE_BYTES),
                        self.batch.read(share, 8),
                    ))
                } else {
                    None
                };
                let (toks, rr) = self.post_notify(&targets, root_addr);
                // The lease deadlines of what this batch takes are anchored at `t1`, taken
                // before the batch was posted (an earlier anchor is a conservative one, see
                // `lease`): no extra clock read on the fast path.
                let posted = t1;
                self.exec()?;
                t2 = Instant::now();
                t0 = t2;
                hn.tokens = self.notify_tokens(&targets, &toks, posted, false);
                hn.bits_deadline = Some(lease::bits_deadline(posted, self.rec.t_lease()));
                let old = self.out.old(main);
                leaf_share = ls.map(|h| LeafShare::read(&self.out, h, 0));
                if let Some((kh, own)) = kid_shares {
                    // The four children's share words are consecutive slots of one level.
                    let own = self.out.word(own, 0);
                    let per_kid = layout::SHARE_WORDS_PER_NODE as usize;
                    kids_readers = layout::node_readers(own) != 0
                        || (0..4).any(|i| LeafShare::read(&self.out, kh, i * per_kid).readers(!0));
                }
                if !node.is_leaf() {
                    // The leaf children this batch locked whole are ours, whatever follows.
                    hn.children = kids
                        .iter()
                        .filter(|(_, kh)| self.out.old(*kh) == 0)
                        .map(|(a, _)| *a)
                        .collect();
                    if !self.occupied_ours(old, hn.ticket_no) {
                        // Passed over (see `occupied_ours`): give back what this batch got —
                        // the children, the notifications — but not the ticket or Occ.
                        hn.ticket = false;
                        self.release_parts(&[hn], None)?;
                        return Ok(Outcome::Restart);
                    }
                }
                if let Some(r) = b_anc.as_ref().filter(|_| one_batch) {
                    let (words, swords, flagged) = self.anc_words(r);
                    let expanding = words.last().is_some_and(|w| exp_tag(*w) != 0);
                    if expanding || flagged || blocking(&words, &swords).is_some() {
                        // l. 15-16: the attempt was speculative; undo what it did (as an
                        // abort would, §3.5.5) and take the regular phase (b).
                        let undo = HeldNode {
                            tokens: std::mem::take(&mut hn.tokens),
                            leaf_mask: if old & mask == 0 { mask } else { 0 },
                            bits_deadline: hn.bits_deadline,
                            ..HeldNode::new(node, addr)
                        };
                        self.release_parts(&[undo], None)?;
                        if expanding {
                            return Ok(Outcome::Aborted(Why::ScaleUp));
                        }
                        self.stats.aborts.occupied_ancestor += 1;
                        self.stats.retries += 1;
                        self.progress.aborted(6);
                        was_fast = false;
                        one_batch = false;
                        continue;
                    }
                }
                if node.is_leaf() {
                    if old & mask != 0 {
                        // l. 22 failed: roll the notifications back (§3.8) and go back to (b).
                        let undo = HeldNode {
                            tokens: std::mem::take(&mut hn.tokens),
                            ..HeldNode::new(node, addr)
                        };
                        self.release_parts(&[undo], None)?;
                        if let Some(o) = self.leaf_failed(node, &mut leaf_fail_since) {
                            return Ok(o);
                        }
                        was_fast = false;
                        leaf_backoff.snooze(&mut self.rng);
                        continue;
                    }
                    hn.leaf_mask = mask;
                } else {
                    hn.occupied(old, (node == root).then_some(h));
                    hn.word_deadline =
                        Some(lease::word_deadline(posted, self.rec.t_lease(), node.hgt));
                }
                root_word = self.out.word(rr, 0);
            } else {
                self.batch.clear();
                let main = if node.is_leaf() {
                    self.batch.masked_cas(addr, 0, mask, mask, mask)
                } else {
                    self.post_occupy(node, addr, hn.ticket_no)
                };
                let ls = node
                    .is_leaf()
                    .then(|| self.batch.read(share, LEAF_SHARE_BYTES));
                // Anchored at `t1` (before the post; conservative, see `lease`).
                let posted = t1;
                self.exec()?;
                t0 = Instant::now();
                let old = self.out.old(main);
                leaf_share = ls.map(|h| LeafShare::read(&self.out, h, 0));
                let lease_t = self.rec.t_lease();
                if node.is_leaf() {
                    hn.bits_deadline = Some(lease::bits_deadline(posted, lease_t));
                    if old & mask != 0 {
                        if let Some(o) = self.leaf_failed(node, &mut leaf_fail_since) {
                            return Ok(o);
                        }
                        leaf_backoff.snooze(&mut self.rng);
                        continue;
                    }
                    hn.leaf_mask = mask;
                } else {
                    if !self.occupied_ours(old, hn.ticket_no) {
                        hn.ticket = false;
                        return Ok(Outcome::Restart);
                    }
                    hn.word_deadline = Some(lease::word_deadline(posted, lease_t, node.hgt));
                    hn.occupied(old, (node == root).then_some(h));
                }
                // l. 31: notify every m-th ancestor and read the root, one batch.
                self.batch.clear();
                let (toks, rr) = self.post_notify(&targets, root_addr);
                // Anchored at `t0`, taken after phase (c) and before this post.
                self.exec()?;
                t2 = Instant::now();
                hn.tokens = self.notify_tokens(&targets, &toks, t0, false);
                root_word = self.out.word(rr, 0);
            }

            // l. 33: a scale-up began (the root is snapshotted first, so any notification made
            // after a node's snapshot sees the root's Exp).
            if exp_tag(root_word) != 0 {
                self.release_parts(&[hn], None)?;
                return Ok(Outcome::Aborted(Why::ScaleUp));
            }
            // l. 32, inequality (1): t2 - t1 <= (1 - δ)·T_wait.
            if t2.duration_since(t1) > bound {
                self.release_parts(&[hn], None)?;
                return Ok(Outcome::Aborted(Why::TimeLimit));
            }
            if node.is_leaf() {
                if let Some(w) = leaf_share.filter(|w| w.readers(mask)) {
                    // Readers registered before our bits: they leave (or back off, seeing our
                    // bits); new ones back off. Wait for them, holding the bits, for a while.
                    was_fast = false;
                    self.progress.set(Phase::Descendants);
                    let patience = self.opts.starvation_after.min(self.rec.t_lease() / 4);
                    if let Some(last) = self.wait_leaf_readers(share, mask, w, patience)? {
                        self.release_parts(&[hn.clone()], None)?;
                        hn.tokens.clear();
                        hn.leaf_mask = 0;
                        let moved = self.leaf_readers_stood(share, mask, last)?;
                        if moved {
                            // Live readers kept us out: starvation avoidance applies.
                            if let Some(o) = self.leaf_failed(node, &mut leaf_fail_since) {
                                return Ok(o);
                            }
                        } else {
                            self.stats.aborts.leaf_conflict += 1;
                            self.stats.retries += 1;
                        }
                        leaf_backoff.snooze(&mut self.rng);
                        continue;
                    }
                }
                return Ok(Outcome::Acquired(Box::new(hn), was_fast));
            }
            if hn.children.len() == 4 && !kids_readers {
                // §3.8: every descendant is locked explicitly and no reader registered below
                // or here; no wait needed.
                return Ok(Outcome::Acquired(Box::new(hn), was_fast));
            }
            was_fast = false;
            self.progress.set(Phase::Descendants);
            // l. 34: wait until t0 + T_wait, then l. 35-36.
            wait_until(t0 + t_wait);
            self.wait_window(node, m, &mut hn, false)?;
            return Ok(Outcome::Acquired(Box::new(hn), was_fast));
        }
    }

    /// `LOCKNODE` in shared mode (`docs/SHARED_LOCKS.md`): the phases of Alg. 2 with readers'
    /// verbs. (a) as a writer: a bakery ticket on an internal node (so a writer ahead in the
    /// queue is waited for, and a writer behind bars later readers). (b) waits for occupied
    /// ancestors only — readers above do not block a reader. (c) registers in the node's share
    /// word instead of occupying: `RMax += 1` and the ticket passed on in the same batch (an
    /// internal node), or the touched groups' `Max += 1` followed by a read of the leaf's bits
    /// (a leaf: a set bit of ours means a writer; back off). (d) notifies the share words of
    /// the same ancestors (`SMax += 1`) and waits for writers below only (`DCnt == DMax`).
    ///
    /// Fast path: as the exclusive one — a leaf in one batch; a node over leaves registers as
    /// a reader of its four children too and reads their bits after, so that, none set, the
    /// wait of (d) is skipped (no writer below holds, and a later one sees our registration).
    pub(crate) fn lock_node_shared(
        &mut self,
        node: Node,
        l: u64,
        r: u64,
        held: &mut Vec<HeldNode>,
    ) -> Result<Outcome, LockError> {
        // Readers notify ancestors in their share words (`SMax`).
        let NodeRequest {
            holding,
            h,
            m,
            t_wait,
            bound,
            root,
            addr,
            root_addr,
            ancs,
            targets,
        } = self.node_request(node, held, Self::share_addr)?;
        let share = self.share_addr(node)?;
        let mask = if node.is_leaf() {
            node.leaf_mask(l, r)
        } else {
            0
        };
        let register = LeafShare::register(mask);
        let all_groups = LeafShare::register(!0);
        let fastp = self.opts.fast_path;
        let lease_t = self.rec.t_lease();
        let mut was_fast = fastp;
        // What an attempt holds: nothing yet.
        let fresh = || HeldNode {
            share: Some(share),
            ..HeldNode::new(node, addr)
        };
        let mut hn = fresh();
        let mut phase_b_done: Option<Instant> = None;

        // An internal node: without a ticket while nobody is in its bakery (fast path only,
        // `docs/SHARED_LOCKS.md`, "Readers without a ticket"); else phase (a) first.
        let mut ticketless = fastp && !node.is_leaf();
        let mut need_ticket = !node.is_leaf() && !ticketless;
        // Over leaves: register in the children too, to skip the wait of (d) (§3.8).
        let mut kids_fast = fastp;
        let mut leaf_fail_since: Option<Instant> = None;
        let mut leaf_backoff = self.backoff();
        let mut one_batch = fastp && (node.is_leaf() || ticketless) && !ancs.is_empty();
        // The leaf's bits under our mask at the failed attempts, and since when they read so;
        // `moved`: they changed since the first. A dead writer's bits stand still
        // (`docs/SHARED_LOCKS.md`, "Readers repair a dead writer's leaf").
        let mut in_way: Option<(u64, Instant)> = None;
        let mut moved = false;
        loop {
            if need_ticket {
                need_ticket = false;
                // Phase (a): as `lock_node` (the ancestors' words only: readers above do not
                // block a reader).
                match self.take_ticket(node, addr, held, &ancs, &[], &mut hn)? {
                    Ok(TicketTaken {
                        at_once,
                        phase_b_done: done,
                    }) => {
                        was_fast &= at_once;
                        phase_b_done = done;
                    }
                    Err(give) => return Ok(give),
                }
            }
            // Phase (b): occupied ancestors only.
            self.progress.set(Phase::Ancestors);
            let t1 = match phase_b_done.take() {
                Some(t) => t,
                None if one_batch => Instant::now(),
                None => match self.phase_b(&ancs, &[], &holding)? {
                    PhaseB::Clear(t1, waited) => {
                        if waited {
                            was_fast = false;
                        }
                        t1
                    }
                    PhaseB::Give(outcome) => {
                        self.release_parts(&[hn], None)?;
                        return Ok(outcome);
                    }
                },
            };

            // Phase (c): register; (d)'s notification in the same batch on the fast path.
            self.progress.set(Phase::Occupy);
            self.batch.clear();
            let b_reads: Vec<ReadHandle> = if one_batch {
                ancs.iter().map(|(_, a)| self.batch.read(*a, 8)).collect()
            } else {
                Vec::new()
            };
            // Readers are in use on this lock (`layout::READERS_SEEN`): set before the
            // registration (posting order), so a writer that reads the flag clear reads before
            // any registration of ours.
            let root_share = self.share_addr(root)?;
            self.batch
                .masked_cas(root_share, 0, 0, layout::READERS_SEEN, layout::READERS_SEEN);
            let (main, bits_read, pass) = if node.is_leaf() {
                let reg = register
                    .post_add(&mut self.batch, share)
                    .expect("a leaf request touches a unit");
                (reg, Some(self.batch.read(addr, 8)), None)
            } else if ticketless {
                let reg = self.batch.masked_faa(share, ADD_TMAX, BOUNDARY);
                // The node word after our registration (posting order): a writer that holds
                // or waits has a ticket out, `TMax != TCnt`.
                (reg, Some(self.batch.read(addr, 8)), None)
            } else {
                let reg = self.batch.masked_faa(share, ADD_TMAX, BOUNDARY);
                // Pass the ticket on, conditional on it still being ours (`post_occupy`).
                let next = ((hn.ticket_no + 1) & layout::COUNTER_MASK) << TCNT_SHIFT;
                let pass = self.batch.masked_cas(
                    addr,
                    hn.ticket_no << TCNT_SHIFT,
                    TCNT | OCC,
                    next,
                    TCNT | OCC,
                );
                (reg, None, Some(pass))
            };
            let kids: Vec<RemoteAddr> = if kids_fast && node.hgt == 1 {
                let mut v = Vec::with_capacity(4);
                for i in 0..4 {
                    let c = self.share_addr(Node::new(0, node.pos * 4 + i))?;
                    all_groups.post_add(&mut self.batch, c);
                    v.push(c);
                }
                v
            } else {
                Vec::new()
            };
            let kid_bits = if kids.is_empty() {
                None
            } else {
                let first = self.node_addr(Node::new(0, node.pos * 4))?;
                Some(self.batch.read(first, 32))
            };
            // Anchored at `t1`, taken before the post (conservative, see `lease`).
            let posted = t1;
            let extract = |out: &fabric::Completions| CVals {
                reg_old: out.old(main),
                check: match (bits_read, pass) {
                    (Some(h), _) => out.word(h, 0),
                    (None, Some(h)) => out.old(h),
                    _ => 0,
                },
                kid_bits: kid_bits.map(|h| {
                    [
                        out.word(h, 0),
                        out.word(h, 1),
                        out.word(h, 2),
                        out.word(h, 3),
                    ]
                }),
                b_words: b_reads.iter().map(|r| out.word(*r, 0)).collect(),
            };
            let mut cvals = None;
            let mut t0 = posted;
            if !fastp {
                self.exec()?;
                t0 = Instant::now();
                cvals = Some(extract(&self.out));
                self.batch.clear();
            }
            let (toks, rr) = self.post_notify(&targets, root_addr);
            self.exec()?;
            let t2 = Instant::now();
            if fastp {
                t0 = t2;
            }
            let c = match cvals {
                Some(c) => c,
                None => extract(&self.out),
            };
            hn.tokens = self.notify_tokens(&targets, &toks, if fastp { posted } else { t0 }, true);
            let root_word = self.out.word(rr, 0);
            if node.is_leaf() {
                hn.leaf_register = register;
                hn.bits_deadline = Some(lease::bits_deadline(posted, lease_t));
            } else {
                hn.ticket = false;
                hn.readers = true;
                hn.readers_deadline = Some(lease::token_deadline(posted, lease_t, node.hgt));
                hn.reader_children = kids;
                hn.bits_deadline = Some(lease::bits_deadline(posted, lease_t));
                if !ticketless && c.check & (TCNT | OCC) != hn.ticket_no << TCNT_SHIFT {
                    // Our turn was broken before we passed it on (paused past the lease?):
                    // the ticket is not ours; undo the registration and start over.
                    self.stats.passed_over += 1;
                    self.progress.aborted(8);
                    self.release_parts(&[hn], None)?;
                    return Ok(Outcome::Restart);
                }
                hn.readers_tag = exp_tag(c.reg_old);
                hn.root_of = (node == root).then_some(h);
                if ticketless && (occ(c.check) || tmax(c.check) != tcnt(c.check)) {
                    // Someone is in the bakery: a writer holds or waits (or a reader is
                    // about to pass its turn on). Undo, and queue for a ticket like a writer.
                    self.release_parts(&[hn], None)?;
                    self.stats.retries += 1;
                    hn = fresh();
                    ticketless = false;
                    need_ticket = true;
                    one_batch = false;
                    was_fast = false;
                    continue;
                }
            }
            if one_batch {
                let expanding = c.b_words.last().is_some_and(|w| exp_tag(*w) != 0);
                if expanding || blocking(&c.b_words, &[]).is_some() {
                    // Speculative: undo (an abort, §3.5.5) and take the regular phase (b).
                    self.release_parts(&[hn], None)?;
                    hn = fresh();
                    if expanding {
                        return Ok(Outcome::Aborted(Why::ScaleUp));
                    }
                    self.stats.aborts.occupied_ancestor += 1;
                    self.stats.retries += 1;
                    self.progress.aborted(6);
                    was_fast = false;
                    one_batch = false;
                    continue;
                }
            }
            if node.is_leaf() && c.check & mask != 0 {
                // A writer holds (or is taking) some of our units: back off, wait, retry.
                self.release_parts(&[hn], None)?;
                hn = fresh();
                let bits = c.check & mask;
                match in_way {
                    Some((b, _)) if b == bits => {}
                    Some(_) => {
                        moved = true;
                        in_way = Some((bits, Instant::now()));
                    }
                    None => in_way = Some((bits, Instant::now())),
                }
                if let Some(o) = self.leaf_failed(node, &mut leaf_fail_since) {
                    // Writers come and go: escalate to the parent as the starvation rule says.
                    if moved || !node.parent().in_tree(h) {
                        return Ok(o);
                    }
                    // The same bits all along. For `T_lease / 2` — longer than a live writer
                    // holds its bits while it waits for readers (`T_lease / 4` at most) —
                    // perhaps a dead writer's, which only a writer's path may clear. Until
                    // then, a live writer's critical section: keep waiting here (the parent,
                    // shared, would wait for that writer's notification all the same).
                    if in_way.is_some_and(|(_, since)| since.elapsed() >= lease_t / 2) {
                        return Ok(Outcome::RepairLeaf(node));
                    }
                }
                was_fast = false;
                leaf_backoff.snooze(&mut self.rng);
                continue;
            }
            if exp_tag(root_word) != 0 {
                self.release_parts(&[hn], None)?;
                return Ok(Outcome::Aborted(Why::ScaleUp));
            }
            if t2.duration_since(t1) > bound {
                self.release_parts(&[hn], None)?;
                if one_batch || ticketless || (kids_fast && node.hgt == 1) {
                    // The fast path's batch (phase (b)'s reads, the children's 16 FAAs) took
                    // longer than inequality (1) allows — a slow fabric, or a loaded host. Each
                    // retry would post the same batch and abort again; the plain path posts
                    // (b), (c) and (d) apart and waits in (d) instead.
                    self.stats.aborts.time_limit += 1;
                    self.stats.retries += 1;
                    self.progress.aborted(1);
                    hn = fresh();
                    ticketless = false;
                    need_ticket = !node.is_leaf();
                    one_batch = false;
                    kids_fast = false;
                    was_fast = false;
                    continue;
                }
                return Ok(Outcome::Aborted(Why::TimeLimit));
            }
            if node.is_leaf() {
                return Ok(Outcome::Acquired(Box::new(hn), was_fast));
            }
            if c.kid_bits.is_some_and(|b| b.iter().all(|w| *w == 0)) {
                // No writer holds a leaf below, and a later one sees our registration there.
                return Ok(Outcome::Acquired(Box::new(hn), was_fast));
            }
            was_fast = false;
            self.progress.set(Phase::Descendants);
            wait_until(t0 + t_wait);
            self.wait_window(node, m, &mut hn, true)?;
            return Ok(Outcome::Acquired(Box::new(hn), was_fast));
        }
    }

    /// A reader found `leaf`'s bits in its way, unchanged, for the starvation bound
    /// (`Outcome::RepairLeaf`): it takes the path a writer takes after a starvation escalation
    /// from that leaf — the parent, exclusively (`lock_node`, with all of its recovery) — and,
    /// holding it, repairs the leaf as that writer would (`repair_leaf`: bits that stand still
    /// for `T_lease` under an exclusive parent are a dead client's), then gives the parent back.
    /// The caller holds nothing of its request meanwhile (it gave it back) and starts over in
    /// shared mode. Never zeroes a live writer's bits: it *is* the writer's path, entered by a
    /// reader (`docs/SHARED_LOCKS.md`, "Readers repair a dead writer's leaf").
    fn repair_leaf_as_writer(&mut self, leaf: Node) -> Result<(), LockError> {
        let parent = leaf.parent();
        let leaf_addr = self.node_addr(leaf)?;
        let mode = self.mode;
        self.mode = crate::LockMode::Exclusive;
        let mut held = Held::default();
        let mut fast = true;
        tracing::debug!(
            ?leaf,
            "lock tree leaf: a reader takes the writer's path to repair it"
        );
        let mut result = self.acquire_on_tree(parent.start(), parent.end(), &mut held, &mut fast);
        if result.is_ok() {
            // Bits the fast path (§3.8) set in the leaf are ours (see `acquire_on_tree`).
            let ours = held.nodes.iter().any(|h| h.children.contains(&leaf_addr));
            if !ours {
                result = self.repair_leaf(leaf);
            }
        }
        let released = self.release_parts(&held.nodes, None);
        self.mode = mode;
        // The exclusive path's own bookkeeping of leaf readers is not the caller's.
        self.leaf_readers_seen = None;
        result?;
        released
    }

    /// A leaf's masked CAS failed (l. 22): count it, and escalate to the parent once it has kept
    /// failing for `starvation_after` (l. 23-24).
    fn leaf_failed(&mut self, leaf: Node, since: &mut Option<Instant>) -> Option<Outcome> {
        self.stats.aborts.leaf_conflict += 1;
        self.stats.retries += 1;
        let first = *since.get_or_insert_with(Instant::now);
        (first.elapsed() >= self.opts.starvation_after)
            .then(|| Outcome::Escalate(leaf.parent(), Why::Starvation(leaf)))
    }

    /// Phase (a), l. 9-11, on internal `node`: a bakery ticket, and on the fast path the reads of
    /// phase (b) in the same batch (`post_anc_reads` with `shares`: a writer's share words or
    /// readers' flag, none for a reader), hoping the ticket is served at once (§3.8). Waits for
    /// the turn. `Err`: give up with that outcome (what `hn` held is given back); `Ok`: the
    /// turn is ours, recorded in `hn`.
    fn take_ticket(
        &mut self,
        node: Node,
        addr: RemoteAddr,
        held: &mut Vec<HeldNode>,
        ancs: &[(Node, RemoteAddr)],
        shares: &[RemoteAddr],
        hn: &mut HeldNode,
    ) -> Result<Result<TicketTaken, Outcome>, LockError> {
        let fastp = self.opts.fast_path;
        let lease_t = self.rec.t_lease();
        let is_root = node == Node::root(self.rec.height);
        self.batch.clear();
        let th = self.batch.masked_faa(addr, ADD_TMAX, BOUNDARY);
        let anc_reads = fastp.then(|| self.post_anc_reads(ancs, shares));
        let posted = Instant::now();
        self.exec()?;
        hn.ticket = true;
        let old = self.out.old(th);
        let ticket = tmax(old);
        hn.ticket_no = ticket;
        // Served at once: TCnt was our ticket before the FAA executed, but every waiter that
        // could break in behind us took its ticket after ours, so `posted` anchors the
        // deadline (`lease` module docs, ticket break-in).
        hn.word_deadline = Some(lease::word_deadline(posted, lease_t, node.hgt));
        // A bakery ticket can only be given up once served (passing it on is TCnt += 1), so
        // every abort below happens after the ticket has come up.
        let mut taken = TicketTaken {
            at_once: true,
            phase_b_done: None,
        };
        if tcnt(old) != ticket {
            taken.at_once = false;
            self.progress.set(Phase::Ticket);
            match self.wait_ticket(addr, ticket, old, posted, node, is_root, held)? {
                TicketWait::Served(anchor) => {
                    hn.word_deadline = Some(lease::word_deadline(anchor, lease_t, node.hgt));
                }
                TicketWait::Give(give) => {
                    self.release_parts(std::slice::from_ref(hn), None)?;
                    return Ok(Err(give));
                }
                // Nothing of this node is ours; what the request holds elsewhere was or is
                // given back by the restart.
                TicketWait::PassedOver => return Ok(Err(Outcome::Restart)),
            }
        } else if is_root && exp_tag(old) != 0 {
            self.release_parts(std::slice::from_ref(hn), None)?;
            return Ok(Err(Outcome::Aborted(Why::ScaleUp)));
        } else if let Some(r) = &anc_reads {
            let (words, swords, flagged) = self.anc_words(r);
            if words.last().is_some_and(|w| exp_tag(*w) != 0) {
                self.release_parts(std::slice::from_ref(hn), None)?;
                return Ok(Err(Outcome::Aborted(Why::ScaleUp)));
            }
            if !flagged && blocking(&words, &swords).is_none() {
                taken.phase_b_done = Some(posted);
            }
        }
        Ok(Ok(taken))
    }

    /// l. 11: poll until `TCnt` reaches our ticket. Recovery (§3.10): if `TCnt` and `Occ` stand
    /// still for `(Δ + H + 2)·T_lease`, set `TCnt` to our ticket and clear `Occ`, one masked CAS.
    ///
    /// The patience is what a *live* holder ahead may take without moving either field: Δ
    /// tickets ahead, a lease each; plus, for the one being served, the recoveries it may itself
    /// wait out while holding the node — phase (d) repairs dead notifications in its window after
    /// up to `H·T_lease` (`H` the node's height, see `wait_window`), a starvation escalation then
    /// repairs the dead leaf after another `T_lease` (`repair_leaf`) — and one lease of margin.
    /// With `(Δ + 1)·T_lease`, as before, a waiter behind a live holder that was repairing a dead
    /// leaf broke in; the holder's release then flipped `Occ` back on and pushed `TCnt` past the
    /// next ticket, which hung that ticket's owner (the recovery test `dead_leaf_holder` on tcp,
    /// debug build, loaded machine).
    ///
    /// Deadlock avoidance: after `restart_after`, the request's nodes in `held` are given back
    /// while the wait goes on; once served, the caller passes the ticket on and starts over.
    ///
    /// Bounded wait: a waiter that was paused while its turn came may find `TCnt`
    /// *past* its ticket — a waiter behind it saw `TCnt` and `Occ` stand still and broke in,
    /// setting `TCnt` to its own ticket (and others may have followed). `TCnt == ticket` then
    /// never holds again. The queue is `[TCnt, TMax)` (15-bit counters, compared relative to
    /// `TMax` as `layout::counter_gap` does); a ticket outside it was passed over: it is not
    /// ours any more (passing it on would push `TCnt` past a live holder), so the attempt
    /// returns [`TicketWait::PassedOver`] and the request starts over.
    ///
    /// `posted`: the post time of the FAA that took the ticket (the first anchor of the lease
    /// deadline, see [`TicketWait::Served`]).
    #[allow(clippy::too_many_arguments)]
    fn wait_ticket(
        &mut self,
        addr: RemoteAddr,
        ticket: u64,
        first: u64,
        posted: Instant,
        node: Node,
        is_root: bool,
        held: &mut Vec<HeldNode>,
    ) -> Result<TicketWait, LockError> {
        let lease = self.rec.t_lease();
        let started = Instant::now();
        let mut restart = false;
        let mut last = first & (TCNT | OCC);
        let mut since = Instant::now();
        // Escalated here because phase (b) saw this very value stand still (l. 18): it has
        // stood still since then (the recovery rules count from the first read that showed
        // the current value, `lease` module docs).
        if let Some((_, _, seen_since)) = self
            .suspected
            .take()
            .filter(|&(n, seen, _)| n == node && seen == last)
        {
            since = seen_since;
        }
        // When (stand-still time) to ask next whether the holder is gone.
        let mut next_ask = lease / 4;
        let mut backoff = self.backoff();
        // The post time of the last verb that did not see our turn.
        let mut anchor = posted;
        loop {
            backoff.snooze(&mut self.rng);
            let poll = Instant::now();
            let w = self.ep_read_u64(addr)?;
            if tcnt(w) == ticket {
                if restart {
                    return Ok(TicketWait::Give(Outcome::Restart));
                }
                if is_root && exp_tag(w) != 0 {
                    return Ok(TicketWait::Give(Outcome::Aborted(Why::ScaleUp)));
                }
                return Ok(TicketWait::Served(anchor));
            }
            anchor = poll;
            if counter_gap(ticket, tcnt(w)) >= counter_gap(tmax(w), tcnt(w)) {
                // Passed over. What the request held was given back already if `restart`; the
                // caller's restart gives back the rest.
                self.stats.passed_over += 1;
                self.progress.aborted(8);
                tracing::warn!(
                    ?addr,
                    ticket,
                    tcnt = tcnt(w),
                    tmax = tmax(w),
                    "lock tree node: our ticket was passed over by a lease recovery (paused?); starting over"
                );
                return Ok(TicketWait::PassedOver);
            }
            if !restart && !held.is_empty() && started.elapsed() >= self.opts.restart_after {
                let give_back = std::mem::take(held);
                self.release_parts(&give_back, None)?;
                restart = true;
            }
            let seen = w & (TCNT | OCC);
            if seen != last {
                last = seen;
                since = Instant::now();
                next_ask = lease / 4;
                backoff.reset();
                continue;
            }
            let ahead = counter_gap(ticket, tcnt(w)) as u32;
            // Break in when the holder is known gone (module docs, "Recovery by identity"),
            // or by the lease rule once `TCnt` and `Occ` stood still for the patience.
            let stood = since.elapsed();
            let gone = ahead == 1 && occ(w) && stood >= next_ask && {
                next_ask = stood + lease.min(stood.max(lease / 4));
                self.holder_gone(node, w, stood >= lease)?
            };
            let patience_out = !gone && stood >= lease * (ahead + node.hgt + 2);
            // The lease rule fences first (it may take a while, and may refuse: then do not
            // break in, and try again after another full patience); a gone holder is out already.
            if patience_out
                && !crate::fence::before_recovery(self.opts.fence.as_ref(), "ticket break-in")
            {
                since = Instant::now();
                continue;
            }
            if gone || patience_out {
                let swap = ticket << TCNT_SHIFT;
                let cas_posted = Instant::now();
                let old = self.ep_masked_cas(addr, w, TCNT | OCC, swap, TCNT | OCC)?;
                if old & (TCNT | OCC) == seen {
                    self.stats.recoveries += 1;
                    if gone {
                        tracing::warn!(?addr, ticket, after = ?stood, "lock tree node: its holder is gone (ended or fenced); broke its turn");
                    } else {
                        tracing::warn!(?addr, ticket, "lock tree node: holder presumed dead");
                    }
                    if restart {
                        return Ok(TicketWait::Give(Outcome::Restart));
                    }
                    // Our CAS wrote the value waiters now watch: it anchors the deadline.
                    return Ok(TicketWait::Served(cas_posted));
                }
                if patience_out {
                    since = Instant::now();
                }
            }
        }
    }

    /// Recovery by identity: whether the holder of `node`'s turn in `w` (occupied) is known
    /// gone. Reads the node's owner record; a record of this turn names the holder, and the
    /// fence says whether it is out for good ([`crate::Fence::holder_gone`]; `stopped`: the
    /// node stood still for a whole `T_lease`, so a silent holder may be fenced now).
    fn holder_gone(&mut self, node: Node, w: u64, stopped: bool) -> Result<bool, LockError> {
        let Some(fence) = self.opts.fence.clone() else {
            return Ok(false);
        };
        let Some(at) = layout::owner_addr(&self.rec.segments, node) else {
            return Ok(false);
        };
        let record = self.ep_read_u64(at)?;
        let Some(owner) = layout::owner_of(record, tcnt(w)) else {
            return Ok(false);
        };
        Ok(crate::fence::holder_gone(Some(&fence), owner, stopped))
    }

    /// Phase (b), l. 12-19: wait until no ancestor is occupied; abort on the root's `Exp`
    /// (l. 15); suspect a failure when an occupied ancestor stands still for `T_lease` (l. 18).
    ///
    /// `shares`: a writer's ancestors' share words (empty for a reader): an ancestor with
    /// readers blocks a writer as an occupied one does (`docs/SHARED_LOCKS.md`).
    fn phase_b(
        &mut self,
        ancs: &[(Node, RemoteAddr)],
        shares: &[RemoteAddr],
        holding: &[Node],
    ) -> Result<PhaseB, LockError> {
        let mut owned: Vec<RemoteAddr>;
        let mut shares = shares;
        if ancs.is_empty() {
            return Ok(PhaseB::Clear(Instant::now(), false));
        }
        let lease = self.rec.t_lease();
        let mut waited = false;
        loop {
            self.batch.clear();
            let anc_reads = self.post_anc_reads(ancs, shares);
            let t1 = Instant::now();
            self.exec()?;
            let (words, swords, flagged) = self.anc_words(&anc_reads);
            if flagged {
                // Readers are in use: read again, share words included.
                owned = self.anc_shares(ancs)?;
                shares = &owned;
                continue;
            }
            if words.last().is_some_and(|w| exp_tag(*w) != 0) {
                return Ok(PhaseB::Give(Outcome::Aborted(Why::ScaleUp)));
            }
            // l. 16: the lowest occupied ancestor (for a writer: or one with readers).
            let Some(i) = blocking(&words, &swords) else {
                return Ok(PhaseB::Clear(t1, waited));
            };
            if !occ(words[i]) {
                // Readers only: wait until they are gone (a writer).
                waited = true;
                let (anc, _) = ancs[i];
                if holding.iter().any(|h| h.within(&anc)) {
                    return Ok(PhaseB::Give(Outcome::Restart));
                }
                if let Some(give) =
                    self.wait_ancestor_readers(anc, ancs[i].1, shares[i], swords[i])?
                {
                    return Ok(PhaseB::Give(give));
                }
                continue;
            }
            waited = true;
            let (anc, anc_addr) = ancs[i];
            if holding.iter().any(|h| h.within(&anc)) {
                // Its holder waits for what we hold under it: give way (module docs).
                return Ok(PhaseB::Give(Outcome::Restart));
            }
            let is_root = i + 1 == ancs.len();
            let mut last = words[i] & (TCNT | OCC);
            let mut since = Instant::now();
            // When (stand-still time) to ask whether its holder is gone (recovery by identity).
            let mut next_ask = lease / 4;
            let mut backoff = self.backoff();
            // l. 18.
            loop {
                backoff.snooze(&mut self.rng);
                let w = self.ep_read_u64(anc_addr)?;
                if is_root && exp_tag(w) != 0 {
                    return Ok(PhaseB::Give(Outcome::Aborted(Why::ScaleUp)));
                }
                if !occ(w) {
                    break;
                }
                let seen = w & (TCNT | OCC);
                if seen != last {
                    last = seen;
                    since = Instant::now();
                    next_ask = lease / 4;
                } else if since.elapsed() >= lease {
                    self.suspected = Some((anc, last, since));
                    return Ok(PhaseB::Give(Outcome::Escalate(anc, Why::Suspected)));
                } else if since.elapsed() >= next_ask {
                    // A holder known gone need not be waited out for the rest of the lease:
                    // escalate now; the ticket wait there asks again and breaks in.
                    next_ask = since.elapsed() * 2;
                    if self.holder_gone(anc, w, false)? {
                        self.suspected = Some((anc, last, since));
                        return Ok(PhaseB::Give(Outcome::Escalate(anc, Why::Suspected)));
                    }
                }
            }
        }
    }

    /// l. 35-36: wait until `DCnt == DMax` on `node` and its internal descendants within `m`
    /// levels. Recovery (§3.10): a node whose counters stand still for `H·T_lease` (`H` its height
    /// above the leaves) has `DCnt` set to `DMax`, one masked CAS.
    ///
    /// A writer (`shared == false`) also waits for the shared twins in the same nodes' share
    /// words (`SCnt == SMax`: no shared acquisition below notified) and, at `node` itself, for
    /// its readers (`RCnt == RMax`); the same stand-still repairs them (dead readers). A reader
    /// waits for writers only (`docs/SHARED_LOCKS.md`).
    fn wait_window(
        &mut self,
        node: Node,
        m: u32,
        hn: &mut HeldNode,
        shared: bool,
    ) -> Result<(), LockError> {
        let lease = self.rec.t_lease();
        // (node, address, the fields that must pair up: DCnt/DMax, and TCnt/TMax too for our
        // own share word's readers).
        let mut nodes: Vec<(Node, RemoteAddr, u64)> = Vec::new();
        for (hgt, start, count) in layout::window(node, m) {
            for pos in start..start + count {
                let n = Node::new(hgt, pos);
                nodes.push((n, self.node_addr(n)?, DCNT | DMAX));
            }
        }
        // A writer's share words: read when this client has seen readers in use; otherwise
        // the root's `READERS_SEEN` flag is read first, and only if it is set are they read
        // (polled below). A reader that sets the flag after our read notifies after it too,
        // past `t0 + T_wait`: its phase-(b) read came after our `Occ` (inequality (1)), so
        // it waits for us (`docs/SHARED_LOCKS.md`, "Writers pay for readers once used").
        let share_nodes = |me: &Self, nodes: &[(Node, RemoteAddr, u64)]| {
            nodes
                .iter()
                .map(|&(n, _, _)| {
                    let fields = if n == node {
                        DCNT | DMAX | TCNT | TMAX
                    } else {
                        DCNT | DMAX
                    };
                    me.share_addr(n).map(|a| (n, a, fields))
                })
                .collect::<Result<Vec<_>, LockError>>()
        };
        self.batch.clear();
        let flag = if shared {
            None
        } else if !self.readers_seen {
            let root_share = self.share_addr(Node::root(self.rec.height))?;
            Some(self.batch.read(root_share, 8))
        } else {
            let mut more = share_nodes(self, &nodes)?;
            nodes.append(&mut more);
            None
        };
        // Fast-path children that were only partly locked: give them back first (§3.8) — unless
        // we were paused past their lease deadline since locking them: then a leaf repair may
        // have zeroed them and someone else set them again; leave them to lazy recovery
        // (`release` module docs).
        let children_live = hn.bits_deadline.is_none_or(|d| Instant::now() < d);
        if (!hn.children.is_empty() || !hn.reader_children.is_empty()) && !children_live {
            self.stats.late_releases += 1;
            tracing::warn!(
                ?node,
                "fast-path children given back after their lease deadline: left to lazy recovery"
            );
        }
        for c in hn.children.drain(..) {
            if children_live {
                self.batch.write_u64(c, 0);
            }
        }
        for c in hn.reader_children.drain(..) {
            if children_live {
                LeafShare::register(!0)
                    .release()
                    .post_add(&mut self.batch, c);
            }
        }
        // Consecutive slots are read with one verb: a level of the window is one run per
        // segment (§3.5.5: m reads for m levels in one tree).
        let mut runs: Vec<(usize, usize, ReadHandle)> = Vec::new();
        let mut i = 0;
        while i < nodes.len() {
            let mut j = i + 1;
            while j < nodes.len() && nodes[j].1 == nodes[j - 1].1.add(8) {
                j += 1;
            }
            let h = self.batch.read(nodes[i].1, (j - i) * 8);
            runs.push((i, j, h));
            i = j;
        }
        self.exec()?;
        let now = Instant::now();
        let flagged = flag.is_some_and(|h| self.out.word(h, 0) & layout::READERS_SEEN != 0);
        if flagged {
            self.readers_seen = true;
        }
        let paired =
            |w: u64, fields: u64| dcnt(w) == dmax(w) && (fields & TCNT == 0 || tcnt(w) == tmax(w));
        let mut waiting: Vec<(Node, RemoteAddr, u64, u64, Instant)> = Vec::new();
        for (i, j, h) in runs {
            for (k, n) in nodes[i..j].iter().enumerate() {
                let w = self.out.word(h, k);
                if !paired(w, n.2) {
                    waiting.push((n.0, n.1, n.2, w & n.2, now));
                }
            }
        }
        if flagged {
            // Not read yet: polled below (an impossible `seen` starts their stand-still clock
            // at the first poll).
            for (n, a, fields) in share_nodes(self, &nodes)? {
                waiting.push((n, a, fields, !fields, now));
            }
        }
        let mut backoff = self.backoff();
        while !waiting.is_empty() {
            backoff.snooze(&mut self.rng);
            self.batch.clear();
            let reads: Vec<ReadHandle> = waiting
                .iter()
                .map(|(_, a, _, _, _)| self.batch.read(*a, 8))
                .collect();
            self.exec()?;
            let words: Vec<u64> = reads.iter().map(|r| self.out.word(*r, 0)).collect();
            let mut still = Vec::with_capacity(waiting.len());
            for ((n, a, fields, seen, since), w) in waiting.into_iter().zip(words) {
                if paired(w, fields) {
                    continue;
                }
                let now_seen = w & fields;
                if now_seen != seen {
                    still.push((n, a, fields, now_seen, Instant::now()));
                    continue;
                }
                if since.elapsed() >= lease * n.hgt {
                    if !crate::fence::before_recovery(self.opts.fence.as_ref(), "DCnt repair") {
                        still.push((n, a, fields, seen, Instant::now()));
                        continue;
                    }
                    // DCnt := DMax (and RCnt := RMax for readers of the node itself).
                    let swap = (dmax(w) << DCNT_SHIFT) | (tmax(w) << TCNT_SHIFT);
                    let swap_mask = DCNT | (fields & TCNT);
                    let old = self.ep_masked_cas(a, w, fields, swap, swap_mask)?;
                    if old & fields == seen {
                        self.stats.recoveries += 1;
                        tracing::warn!(
                            ?n,
                            "lock tree: notifications (or readers) of a dead client repaired"
                        );
                        continue;
                    }
                    still.push((n, a, fields, old & fields, Instant::now()));
                    continue;
                }
                still.push((n, a, fields, seen, since));
            }
            waiting = still;
        }
        Ok(())
    }

    /// A writer holding leaf bits `mask` waits until no reader of the groups they touch is
    /// registered in the leaf's share words at `share` (`first`: as read after our CAS).
    /// Readers that registered before our bits leave; those that see our bits back off. But
    /// only for `patience`: our bits' lease is one `T_lease` (`lease::bits_deadline`), shorter
    /// than a dead reader's stand-still; so `false` (still readers) makes the caller undo and
    /// retry like a failed CAS, escalating to the parent after `starvation_after`, where
    /// `repair_leaf` repairs dead readers (§3.10 for readers).
    fn wait_leaf_readers(
        &mut self,
        share: RemoteAddr,
        mask: u64,
        first: LeafShare,
        patience: std::time::Duration,
    ) -> Result<Option<LeafShare>, LockError> {
        let start = Instant::now();
        let mut last = first;
        let mut backoff = self.backoff();
        while last.readers(mask) {
            if start.elapsed() >= patience {
                return Ok(Some(last));
            }
            backoff.snooze(&mut self.rng);
            last = self.ep_read_leaf_share(share)?;
        }
        Ok(None)
    }

    /// Reads a leaf's share words (`share`: the first), one verb.
    fn ep_read_leaf_share(&mut self, share: RemoteAddr) -> Result<LeafShare, LockError> {
        self.batch.clear();
        let h = self.batch.read(share, LEAF_SHARE_BYTES);
        self.exec()?;
        Ok(LeafShare::read(&self.out, h, 0))
    }

    /// Repairs the groups of a leaf's readers that `fields` names, seen as `seen` (which
    /// stood still for `T_lease`): one masked CAS per share word, comparing what was seen.
    /// Whether every word still held what was seen (the repair took).
    fn repair_leaf_readers(
        &mut self,
        share: RemoteAddr,
        seen: LeafShare,
        mask: u64,
    ) -> Result<bool, LockError> {
        let fields = LeafShare::fields(mask);
        let repaired = seen.repaired(mask);
        self.batch.clear();
        let hs: Vec<(usize, AtomicHandle)> = fields
            .0
            .iter()
            .enumerate()
            .filter(|(_, f)| **f != 0)
            .map(|(i, &f)| {
                let at = share.word(i as u64);
                (i, self.batch.masked_cas(at, seen.0[i], f, repaired.0[i], f))
            })
            .collect();
        self.exec()?;
        Ok(hs
            .iter()
            .all(|&(i, h)| self.out.old(h) & fields.0[i] == seen.0[i] & fields.0[i]))
    }

    /// A leaf writer gave up waiting for the leaf's readers, whose share words read `last`:
    /// tracks how long the touched groups stood still (across attempts and aborts, in
    /// `self.leaf_readers_seen`) and, past
    /// `T_lease`, repairs them (`Cnt := Max`: every reader registered then is dead, §3.10 —
    /// the counter pairs only grow, so standing still means nobody came or left). Returns
    /// whether they moved since the last attempt (live readers: counts towards starvation).
    fn leaf_readers_stood(
        &mut self,
        share: RemoteAddr,
        mask: u64,
        last: LeafShare,
    ) -> Result<bool, LockError> {
        let v = last.and(&LeafShare::fields(mask));
        match self.leaf_readers_seen {
            Some((at, s, since)) if at == share && s == v => {
                if since.elapsed() >= self.rec.t_lease()
                    && crate::fence::before_recovery(
                        self.opts.fence.as_ref(),
                        "leaf readers repair",
                    )
                {
                    if self.repair_leaf_readers(share, last, mask)? {
                        self.stats.recoveries += 1;
                        tracing::warn!(?share, "lock tree leaf: readers of a dead client repaired");
                    }
                    self.leaf_readers_seen = None;
                }
                Ok(false)
            }
            _ => {
                self.leaf_readers_seen = Some((share, v, Instant::now()));
                Ok(true)
            }
        }
    }

    /// A writer in phase (b) found readers (and no `Occ`) at ancestor `anc`: waits until they
    /// are gone (`None`: read the ancestors again). Readers standing still for `T_lease` are
    /// suspected dead: lock `anc` (its ticket wait and phase (d) repair them). Readers that keep
    /// coming for `starvation_after`: lock `anc`, whose bakery bars new readers behind us.
    fn wait_ancestor_readers(
        &mut self,
        anc: Node,
        anc_addr: RemoteAddr,
        share: RemoteAddr,
        first: u64,
    ) -> Result<Option<Outcome>, LockError> {
        let lease = self.rec.t_lease();
        let is_root = anc == Node::root(self.rec.height);
        let started = Instant::now();
        let mut last = first & (TCNT | TMAX);
        let mut since = started;
        let mut moved = false;
        let mut backoff = self.backoff();
        loop {
            backoff.snooze(&mut self.rng);
            self.batch.clear();
            let wh = self.batch.read(anc_addr, 8);
            let sh = self.batch.read(share, 8);
            self.exec()?;
            let (w, sw) = (self.out.word(wh, 0), self.out.word(sh, 0));
            if is_root && exp_tag(w) != 0 {
                return Ok(Some(Outcome::Aborted(Why::ScaleUp)));
            }
            if occ(w) || layout::node_readers(sw) == 0 {
                return Ok(None);
            }
            let seen = sw & (TCNT | TMAX);
            if seen != last {
                last = seen;
                since = Instant::now();
                moved = true;
            } else if since.elapsed() >= lease {
                return Ok(Some(Outcome::Escalate(anc, Why::Suspected)));
            }
            // Readers that come and go (not dead ones standing still) for `starvation_after`.
            if moved && started.elapsed() >= self.opts.starvation_after {
                return Ok(Some(Outcome::Escalate(anc, Why::ReadersStarve)));
            }
        }
    }

    /// A writer's share words of `ancs` (lowest first) — only the root's (for the
    /// `READERS_SEEN` flag) while this client has not seen readers in use; empty without
    /// ancestors.
    fn anc_shares(&self, ancs: &[(Node, RemoteAddr)]) -> Result<Vec<RemoteAddr>, LockError> {
        if self.readers_seen {
            ancs.iter().map(|(a, _)| self.share_addr(*a)).collect()
        } else {
            ancs.last()
                .map(|(root, _)| self.share_addr(*root))
                .into_iter()
                .collect()
        }
    }

    /// Posts reads of the ancestors' words and (a writer's) their share words — or, while this
    /// client has not seen the lock used in shared mode, only the root's share word first, for
    /// its `READERS_SEEN` flag (`layout`, "Share word"): one read instead of one per ancestor.
    fn post_anc_reads(&mut self, ancs: &[(Node, RemoteAddr)], shares: &[RemoteAddr]) -> AncReads {
        let flag = match shares.last() {
            Some(root_share) if !self.readers_seen => Some(self.batch.read(*root_share, 8)),
            _ => None,
        };
        let reads = ancs.iter().map(|(_, a)| self.batch.read(*a, 8)).collect();
        let sreads = if flag.is_none() {
            shares.iter().map(|a| self.batch.read(*a, 8)).collect()
        } else {
            Vec::new()
        };
        AncReads {
            reads,
            sreads,
            flag,
        }
    }

    /// What `post_anc_reads` read: the ancestors' words, their share words (if read), and
    /// whether the flag read found readers in use for the first time — then the reads are
    /// incomplete and the caller treats the ancestors as blocking (it reads them again).
    fn anc_words(&mut self, r: &AncReads) -> (Vec<u64>, Vec<u64>, bool) {
        let words = r.reads.iter().map(|h| self.out.word(*h, 0)).collect();
        let swords = r.sreads.iter().map(|h| self.out.word(*h, 0)).collect();
        let flagged = r
            .flag
            .is_some_and(|h| self.out.word(h, 0) & layout::READERS_SEEN != 0);
        if flagged {
            self.readers_seen = true;
        }
        (words, swords, flagged)
    }

    /// §3.10, l. 22: holding the leaf's parent (or higher), bits still set in the leaf can only
    /// belong to a client that is undoing an attempt, or to a dead one; zero them only if they
    /// stand still for `T_lease`.
    ///
    /// The paper zeroes the leaf as soon as it finds it non-zero ("Alice detects a failure").
    /// But a live client whose phase-(b) read preceded our `Occ` may set its bits (and notify)
    /// after we finished phase (d): inequality (1) then fails for it and it undoes the attempt —
    /// its bits are visible for the length of that undo. Zeroing them at once counted a live
    /// client as dead, and worse, its late undo (a masked CAS `mask -> 0`) could then clear the
    /// bits of the next holder of that leaf once we let go of the parent. Waiting until the
    /// bits vanish (live) or stand still for the lease (dead) keeps the repair to dead clients,
    /// like every other recovery of §3.10.
    fn repair_leaf(&mut self, leaf: Node) -> Result<(), LockError> {
        let addr = self.node_addr(leaf)?;
        let lease = self.rec.t_lease();
        let mut last = self.ep_read_u64(addr)?;
        let mut since = Instant::now();
        let mut backoff = self.backoff();
        while last != 0 {
            if since.elapsed() >= lease {
                if !crate::fence::before_recovery(self.opts.fence.as_ref(), "leaf repair") {
                    since = Instant::now();
                    continue;
                }
                let old = self.ep_masked_cas(addr, last, !0, 0, !0)?;
                if old == last {
                    self.stats.recoveries += 1;
                    tracing::warn!(
                        ?leaf,
                        bits = last,
                        "lock tree leaf: bits of a dead client cleared"
                    );
                    break;
                }
            }
            backoff.snooze(&mut self.rng);
            let w = self.ep_read_u64(addr)?;
            if w != last {
                last = w;
                since = Instant::now();
            }
        }
        // The leaf's readers (shared mode): the same rule — registrations that stand still
        // for `T_lease` while we hold the parent belong to dead readers (a live one that
        // registered before our `Occ` was waited for in phase (d); a later one backs off).
        let share = self.share_addr(leaf)?;
        let mut last = self.ep_read_leaf_share(share)?;
        let mut since = Instant::now();
        while last.readers(!0) {
            if since.elapsed() >= lease {
                if !crate::fence::before_recovery(self.opts.fence.as_ref(), "leaf readers repair") {
                    since = Instant::now();
                    continue;
                }
                if self.repair_leaf_readers(share, last, !0)? {
                    self.stats.recoveries += 1;
                    tracing::warn!(?leaf, "lock tree leaf: readers of a dead client repaired");
                    return Ok(());
                }
            }
            backoff.snooze(&mut self.rng);
            let w = self.ep_read_leaf_share(share)?;
            if w != last {
                last = w;
                since = Instant::now();
            }
        }
        Ok(())
    }
}

/// The lowest ancestor (index into the reads, lowest first) that blocks: occupied, or — when
/// `swords` (a writer's reads of the share words) is not empty — with readers.
fn blocking(words: &[u64], swords: &[u64]) -> Option<usize> {
    (0..words.len())
        .find(|&i| occ(words[i]) || swords.get(i).is_some_and(|s| layout::node_readers(*s) != 0))
}

/// What phase (c) of a shared acquisition returned.
struct CVals {
    /// The share word before our registration.
    reg_old: u64,
    /// A leaf: its bits after our registration; internal: the word before our ticket pass.
    check: u64,
    /// The fast path over leaves: the four children's bits after our registrations.
    kid_bits: Option<[u64; 4]>,
    /// The one-batch leaf's ancestor reads.
    b_words: Vec<u64>,
}

/// Reads posted by `post_anc_reads`.
struct AncReads {
    reads: Vec<ReadHandle>,
    sreads: Vec<ReadHandle>,
    flag: Option<ReadHandle>,
}
