//! Lease deadlines of what a CITRON client holds (§3.10 seen from the holder's side).
//!
//! Recovery is lazy: a waiter that sees a word stand still for long enough presumes its owner
//! dead and breaks its hold. The owner may only be paused. For every part of a lock this module
//! gives the *earliest* instant, on the owner's clock, at which some waiter's recovery could break
//! it. Before it the part is certainly still ours; after it, it may not be — and then:
//!
//! - the file system must stop posting data verbs ([`crate::RangeLock::lease_deadline`] is the
//!   minimum over the parts);
//! - a grant whose deadline has passed by the time the acquisition ends is given back and the
//!   acquisition starts over (`CitronClient::acquire_inner`);
//! - a release must not apply blind verbs to a part past its deadline (`release_parts`): the
//!   leaf bits and `DCnt` carry no owner, so they are left to lazy recovery; the ticket/`Occ`
//!   and the spillover mutex are released with conditional verbs at all times.
//!
//! # The common argument
//!
//! Every recovery rule has the form "the word (or some of its fields) stood still for `k·T_lease`
//! on the waiter's clock, measured from the first read that showed the current value (or from a
//! later instant), and the repairing masked CAS compares that value". A value that one of our
//! verbs wrote was written after the verb was *posted*, so every waiter's stand-still clock for
//! it started after our post time `p` (linearizability of the server's atomics). Clocks are
//! well-behaved (§3.2): a waiter's `k·T_lease` lasts at least `(1 - δ)·k·T_lease` of ours, with
//! `δ = 1e-4` as in inequality (1). So the part cannot be broken before `p + (1 - δ)·k·T_lease`.
//! A later write by someone else to the same fields only delays the break further.
//!
//! # The rules, as implemented, and their `k`
//!
//! - **Ticket break-in** (phase (a), l. 11; `wait_ticket`): a waiter `Δ >= 1` tickets behind
//!   `TCnt` breaks in when `TCnt` and `Occ` stood still for `(Δ + H + 2)·T_lease`, `H` the node's
//!   height: `k = H + 3`. `p` is the post time of our last verb that changed `TCnt`/`Occ` (setting
//!   `Occ` in phase (c); our own break-in), or, before phase (c), of the last verb that did not see
//!   our turn yet (the ticket's FAA, or the last poll before the grant): `TCnt` became our ticket
//!   after it, and a waiter behind us took its ticket after ours. [`word_deadline`].
//! - **`DCnt` repair** (phase (d), l. 36; `wait_window`): a waiter at node `Y` sets `DCnt` to
//!   `DMax` when both stood still for `H_Y·T_lease`: `k = H_Y`, `p` the post time of our
//!   notification (`DMax += 1`) at `Y`. A scale-up's copy of the notification to new ancestors
//!   (Alg. 4 l. 8) is made later, on higher nodes: covered. [`token_deadline`].
//! - **Leaf repair** (l. 22; `repair_leaf`): a client holding a leaf's ancestor zeroes the leaf
//!   when the whole word stood still for `T_lease`: `k = 1`, `p` the post time of our masked CAS
//!   on the leaf (or on the fast path's children). [`bits_deadline`].
//! - **Spillover mutex** (`acquire_spillover`): a waiter `Δ >= 1` tickets behind breaks in after
//!   `Δ·T_lease`: `k = 1`, `p` as for a bakery ticket. [`spill_deadline`].
//! - **Recovery by identity** (`wait_ticket`, `acquire`'s module docs): the first waiter breaks
//!   `TCnt`/`Occ` of a holder its fence calls gone, whenever that is. No deadline of ours has to
//!   cover it: a holder the fence calls gone can post nothing any server executes any more.
//! - **Line 18** (an occupied ancestor standing still for `T_lease`) breaks nothing: the waiter
//!   escalates to the ancestor and queues for its ticket, i.e. the first rule.
//!
//! The residual window: a deadline check happens right before a verb is posted; a client paused
//! between the check and the post posts late. The guard the file system adds to its check, and
//! the [`crate::Fence`] the breaker calls before breaking (which revokes the paused client's
//! session), cover it; the lock words' own late verbs are conditional or left out.

use super::config::DELTA;
use std::time::{Duration, Instant};

/// `p + (1 - δ)·k·T_lease`: the earliest break of a value we wrote with a verb posted at `p`,
/// under a rule with a stand-still of `k·T_lease`.
pub fn after(p: Instant, lease: Duration, k: u32) -> Instant {
    p + (lease * k).mul_f64(1.0 - DELTA)
}

/// Ticket and `Occ` of an internal node of height `hgt`, last changed (or last seen not yet
/// ours) by a verb posted at `p`: `k = hgt + 3` (the break-in patience with `Δ = 1`).
pub fn word_deadline(p: Instant, lease: Duration, hgt: u32) -> Instant {
    after(p, lease, hgt + 3)
}

/// A notification posted at `p` on a node of height `hgt` (>= 1): `k = hgt`.
pub fn token_deadline(p: Instant, lease: Duration, hgt: u32) -> Instant {
    after(p, lease, hgt.max(1))
}

/// Leaf bits (or whole leaf children) set by a masked CAS posted at `p`: `k = 1`.
pub fn bits_deadline(p: Instant, lease: Duration) -> Instant {
    after(p, lease, 1)
}

/// The spillover mutex, our turn last unseen (or taken by our break-in) at `p`: `k = 1`.
pub fn spill_deadline(p: Instant, lease: Duration) -> Instant {
    after(p, lease, 1)
}
