//! Where a client is inside its current acquisition, readable from other threads: what a
//! liveness watchdog prints when an acquisition takes far too long (which phase of Alg. 2 it is
//! stuck in, on which node, after how many attempts).
//!
//! The client updates it with relaxed atomic stores at phase boundaries (not inside spin loops),
//! so keeping it costs nothing measurable; a reader may see fields of neighbouring moments mixed,
//! which is fine for a diagnostic.

use super::layout::Node;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The step of the protocol a client is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Not acquiring.
    Idle,
    /// Taking or waiting for the spillover mutex (Alg. 1 l. 4).
    Spillover,
    /// Scaling the tree up (Alg. 4).
    ScaleUp,
    /// Waiting for a newer configuration after an `Exp` abort.
    WaitConfig,
    /// Phase (a): waiting in a node's ticket queue (Alg. 2 l. 11).
    Ticket,
    /// Phase (b): waiting for occupied ancestors (Alg. 2 l. 12-19).
    Ancestors,
    /// Phase (c) and the notification of (d) (Alg. 2 l. 20-31).
    Occupy,
    /// Phase (d): waiting for descendants' notifications (Alg. 2 l. 34-36).
    Descendants,
    /// Backing off after an abort, before the next attempt.
    Backoff,
    /// Releasing (Alg. 3), or undoing an aborted attempt.
    Release,
}

impl Phase {
    const ALL: [Phase; 10] = [
        Phase::Idle,
        Phase::Spillover,
        Phase::ScaleUp,
        Phase::WaitConfig,
        Phase::Ticket,
        Phase::Ancestors,
        Phase::Occupy,
        Phase::Descendants,
        Phase::Backoff,
        Phase::Release,
    ];

    fn code(self) -> u32 {
        Self::ALL.iter().position(|p| *p == self).unwrap_or(0) as u32
    }

    fn from_code(code: u32) -> Phase {
        Self::ALL.get(code as usize).copied().unwrap_or(Phase::Idle)
    }
}

/// A client's progress, shared with observers ([`super::CitronClient::progress`]).
#[derive(Debug, Default)]
pub struct Progress {
    phase: AtomicU32,
    /// `hgt << 58 | pos + 1` of the node worked on (0: none).
    node: AtomicU64,
    /// Attempts (`LOCKNODE` calls) in the current acquisition.
    attempts: AtomicU64,
    /// Aborts in the current acquisition.
    aborts: AtomicU64,
    /// Why the last attempt was given up (a short static text's index in [`WHY`]).
    last_why: AtomicU32,
}

/// Reasons an attempt is given up, as [`ProgressSnapshot::last_abort`] names them.
pub const WHY: [&str; 10] = [
    "none",
    "time limit (inequality (1))",
    "scale-up (Exp)",
    "suspected failure",
    "starvation escalation",
    "restart (deadlock avoidance)",
    "occupied ancestor (one-batch leaf)",
    "lease deadline passed before the grant",
    "passed over by a lease recovery",
    "a reader repairs a leaf as a writer (bits stood still)",
];

/// A copy of a [`Progress`] at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgressSnapshot {
    /// The step the client is in.
    pub phase: Phase,
    /// The tree node it works on, if any.
    pub node: Option<Node>,
    /// `LOCKNODE` attempts in the current acquisition.
    pub attempts: u64,
    /// Aborted attempts in the current acquisition.
    pub aborts: u64,
    /// Why the last one was given up.
    pub last_abort: &'static str,
}

impl Progress {
    /// What the client is doing now.
    pub fn snapshot(&self) -> ProgressSnapshot {
        let node = self.node.load(Ordering::Relaxed);
        ProgressSnapshot {
            phase: Phase::from_code(self.phase.load(Ordering::Relaxed)),
            node: (node != 0).then(|| Node::new((node >> 58) as u32, (node & ((1 << 58) - 1)) - 1)),
            attempts: self.attempts.load(Ordering::Relaxed),
            aborts: self.aborts.load(Ordering::Relaxed),
            last_abort: WHY
                .get(self.last_why.load(Ordering::Relaxed) as usize)
                .copied()
                .unwrap_or("?"),
        }
    }

    pub(crate) fn set(&self, phase: Phase) {
        self.phase.store(phase.code(), Ordering::Relaxed);
    }

    pub(crate) fn attempt(&self, node: Node) {
        // Heights are below 29 and positions below 4^28 = 2^56: the packing cannot collide.
        self.node.store(
            (u64::from(node.hgt) << 58) | (node.pos + 1),
            Ordering::Relaxed,
        );
        self.attempts.fetch_add(1, Ordering::Relaxed);
    }

    /// An attempt was given up, for the reason `WHY[why]`.
    pub(crate) fn aborted(&self, why: usize) {
        self.aborts.fetch_add(1, Ordering::Relaxed);
        self.last_why.store(why as u32, Ordering::Relaxed);
    }

    pub(crate) fn start(&self) {
        self.node.store(0, Ordering::Relaxed);
        self.attempts.store(0, Ordering::Relaxed);
        self.aborts.store(0, Ordering::Relaxed);
        self.last_why.store(0, Ordering::Relaxed);
    }
}
