//! Per-client lock statistics.

use fabric::EndpointStats;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Why an acquisition attempt was aborted and retried.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortCounts {
    /// Inequality (1) failed: the notification took longer than `(1 - δ)·T_wait` (Alg. 2 l. 32).
    pub time_limit: u64,
    /// A concurrent scale-up was seen through `Exp` (Alg. 2 l. 15, l. 33).
    pub scale_up: u64,
    /// A leaf masked-CAS failed and the attempt went back to step 2(b) (Alg. 2 l. 26).
    pub leaf_conflict: u64,
    /// A stalled holder was suspected and the attempt moved to lock an ancestor (§3.10, l. 18).
    pub suspected_failure: u64,
    /// A request gave back the nodes it already held and started over, because a wider lock
    /// waiting for those nodes blocked its next node (CITRON with `k >= 2`; see
    /// `citron::acquire`).
    pub restart: u64,
    /// A one-batch leaf attempt (CITRON's fast path, see `citron::acquire`) found an occupied
    /// ancestor in the reads it had batched with its masked CAS, undid the CAS and its
    /// notifications, and went back to wait in step 2(b).
    pub occupied_ancestor: u64,
}

impl AbortCounts {
    /// All aborts together.
    pub fn total(&self) -> u64 {
        self.time_limit
            + self.scale_up
            + self.leaf_conflict
            + self.suspected_failure
            + self.restart
            + self.occupied_ancestor
    }
}

/// What one client's lock handle has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LockStats {
    /// Locks granted.
    pub acquisitions: u64,
    /// Locks released.
    pub releases: u64,
    /// Aborted attempts, by cause.
    pub aborts: AbortCounts,
    /// Attempts retried after an abort (one per abort that was followed by a new attempt).
    pub retries: u64,
    /// Acquisitions that completed on the fast path (§3.8).
    pub fast_path: u64,
    /// Leaf acquisitions that escalated to the parent to avoid starvation (§3.5.4).
    pub starvation_escalations: u64,
    /// Acquisitions that needed the spillover mutex (part of the range at or beyond `N`).
    pub spillover: u64,
    /// Scale-ups this client performed (Algorithm 4).
    pub scale_ups: u64,
    /// Repairs of state left by a failed client (§3.10).
    pub recoveries: u64,
    /// Releases (or give-backs of an aborted attempt) that came after the lock's lease deadline
    /// ([`crate::RangeLock::lease_deadline`]) or found the lock already broken: their verbs were
    /// made conditional or left out, so that they cannot disturb a later holder.
    pub late_releases: u64,
    /// Waits that found their turn passed over by another client's lease recovery (a ticket
    /// skipped by a break-in, a notification repaired, a grant found after its lease deadline):
    /// the client gave back what it still held and started the acquisition over.
    pub passed_over: u64,
    /// Fabric traffic spent acquiring.
    pub acquire: EndpointStats,
    /// Fabric traffic spent releasing.
    pub release: EndpointStats,
    /// Total time spent inside `acquire`.
    pub acquire_time: Duration,
}

impl LockStats {
    /// Round trips per acquisition.
    pub fn rtts_per_acquire(&self) -> f64 {
        ratio(self.acquire.round_trips, self.acquisitions)
    }

    /// Round trips per release.
    pub fn rtts_per_release(&self) -> f64 {
        ratio(self.release.round_trips, self.releases)
    }

    /// Verbs per acquisition.
    pub fn verbs_per_acquire(&self) -> f64 {
        ratio(self.acquire.verbs, self.acquisitions)
    }

    /// Verbs per release.
    pub fn verbs_per_release(&self) -> f64 {
        ratio(self.release.verbs, self.releases)
    }

    /// Aborts per acquisition.
    pub fn abort_rate(&self) -> f64 {
        ratio(self.aborts.total(), self.acquisitions)
    }

    /// Adds another client's statistics into these.
    pub fn merge(&mut self, other: &LockStats) {
        self.acquisitions += other.acquisitions;
        self.releases += other.releases;
        self.aborts.time_limit += other.aborts.time_limit;
        self.aborts.scale_up += other.aborts.scale_up;
        self.aborts.leaf_conflict += other.aborts.leaf_conflict;
        self.aborts.suspected_failure += other.aborts.suspected_failure;
        self.aborts.restart += other.aborts.restart;
        self.aborts.occupied_ancestor += other.aborts.occupied_ancestor;
        self.retries += other.retries;
        self.fast_path += other.fast_path;
        self.starvation_escalations += other.starvation_escalations;
        self.spillover += other.spillover;
        self.scale_ups += other.scale_ups;
        self.recoveries += other.recoveries;
        self.late_releases += other.late_releases;
        self.passed_over += other.passed_over;
        self.acquire.add(&other.acquire);
        self.release.add(&other.release);
        self.acquire_time += other.acquire_time;
    }
}

impl LockStats {
    /// What was counted since `earlier`, a snapshot of these same statistics (counters only
    /// grow).
    pub fn since(&self, earlier: &LockStats) -> LockStats {
        let (a, b) = (&self.aborts, &earlier.aborts);
        LockStats {
            acquisitions: self.acquisitions - earlier.acquisitions,
            releases: self.releases - earlier.releases,
            aborts: AbortCounts {
                time_limit: a.time_limit - b.time_limit,
                scale_up: a.scale_up - b.scale_up,
                leaf_conflict: a.leaf_conflict - b.leaf_conflict,
                suspected_failure: a.suspected_failure - b.suspected_failure,
                restart: a.restart - b.restart,
                occupied_ancestor: a.occupied_ancestor - b.occupied_ancestor,
            },
            retries: self.retries - earlier.retries,
            fast_path: self.fast_path - earlier.fast_path,
            starvation_escalations: self.starvation_escalations - earlier.starvation_escalations,
            spillover: self.spillover - earlier.spillover,
            scale_ups: self.scale_ups - earlier.scale_ups,
            recoveries: self.recoveries - earlier.recoveries,
            late_releases: self.late_releases - earlier.late_releases,
            passed_over: self.passed_over - earlier.passed_over,
            acquire: self.acquire.since(&earlier.acquire),
            release: self.release.since(&earlier.release),
            acquire_time: self.acquire_time.saturating_sub(earlier.acquire_time),
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}
