//! The meta server's own stalls: silence it must not blame on others.
//!
//! The meta server judges its peers by silence: a data server whose registration connection
//! closes or falls silent is marked down and its replicas are dropped, and a client session
//! silent for its lease is ended. Both go wrong when the silence is the meta server's own: a
//! state lock held for seconds (a consistency check over a large namespace), a frozen process
//! or VM. Then nothing reached it or was answered, every data server's registration call timed
//! out together and every session looks silent — and dropping the data servers' replicas one
//! after another left a single copy of chunks no server had ever missed a write of (a soak lost
//! a chunk that way when it then killed the last server).
//!
//! So the service watches itself: a pulse thread takes the state lock every [`PULSE_EVERY`]
//! and notes when it got it. A gap longer than [`STALL_AFTER`] between two pulses is a stall,
//! and so is a pulse waiting for the lock that long now. While stalled, and for a grace after
//! (the peers' reactions to it arrive then: closed registrations, late heartbeats), the
//! service does nothing for good on the strength of a peer's silence:
//! - a data server marked down keeps its replicas (writes to its chunks wait until it
//!   registers again, as a live server's would; re-replication's pass decides if it does not);
//! - a session's silence is counted only from the stall's end (its heartbeats were waiting
//!   for us).
//!
//! Invariant: [`StallWatch::awake_since`] never moves back, and is never later than now.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often the pulse takes the state lock.
pub const PULSE_EVERY: Duration = Duration::from_millis(100);

/// A gap between pulses (or a wait for the lock) longer than this is a stall: ten times the
/// pulse period, far beyond a scheduling hiccup, well within the 5 s a data server's
/// registration call waits before it gives up.
pub const STALL_AFTER: Duration = Duration::from_secs(1);

/// How long after a stall a data server marked down keeps its replicas: the peers' reactions to
/// a stall arrive just after it (a registration call that timed out during it is seen closed
/// once the state lock is free); this is the data servers' 5 s silence bound, with room.
pub const DROP_GRACE: Duration = Duration::from_secs(5);

/// Milliseconds since the watch began at `now`.
fn ms_since(start: Instant, now: Instant) -> u64 {
    now.saturating_duration_since(start).as_millis() as u64
}

/// The service's record of its own stalls (see the module docs).
pub(crate) struct StallWatch {
    start: Instant,
    /// When the last pulse got the state lock (ms since `start`); `u64::MAX` until the first
    /// (a service without a pulse, as in unit tests, never counts as stalled).
    last_pulse: AtomicU64,
    /// When the pulse now running began waiting for the lock (ms since `start`), or
    /// `u64::MAX` when none waits.
    waiting_since: AtomicU64,
    /// When the most recent stall ended (ms since `start`; 0: none yet).
    last_stall_end: AtomicU64,
}

impl Default for StallWatch {
    fn default() -> Self {
        StallWatch::new(Instant::now())
    }
}

impl StallWatch {
    /// A watch that starts awake at `start`.
    pub fn new(start: Instant) -> StallWatch {
        StallWatch {
            start,
            last_pulse: AtomicU64::new(u64::MAX),
            waiting_since: AtomicU64::new(u64::MAX),
            last_stall_end: AtomicU64::new(0),
        }
    }

    /// The pulse is about to wait for the state lock, at `now`.
    pub fn pulse_waits(&self, now: Instant) {
        self.waiting_since
            .store(ms_since(self.start, now), Ordering::Release);
    }

    /// The pulse got the state lock at `now`: a gap since the last one longer than
    /// [`STALL_AFTER`] was a stall, which ends now.
    pub fn pulse_got(&self, now: Instant) {
        let now_ms = ms_since(self.start, now);
        let last = self.last_pulse.swap(now_ms, Ordering::AcqRel);
        self.waiting_since.store(u64::MAX, Ordering::Release);
        if last != u64::MAX && now_ms.saturating_sub(last) > STALL_AFTER.as_millis() as u64 {
            self.last_stall_end.fetch_max(now_ms, Ordering::AcqRel);
            tracing::warn!(
                stalled_ms = now_ms.saturating_sub(last),
                "the meta server stalled (its state lock or the process): peers' silence during \
                 it and just after is not held against them"
            );
        }
    }

    /// Whether the service is stalled at `now`: the pulse has not had the lock for longer than
    /// [`STALL_AFTER`] (it waits for it, or it was not run at all).
    pub fn stalled(&self, now: Instant) -> bool {
        let now_ms = ms_since(self.start, now);
        let after = STALL_AFTER.as_millis() as u64;
        let waiting = self.waiting_since.load(Ordering::Acquire);
        let last = self.last_pulse.load(Ordering::Acquire);
        if last == u64::MAX {
            return false;
        }
        (waiting != u64::MAX && now_ms.saturating_sub(waiting) > after)
            || now_ms.saturating_sub(last) > after + PULSE_EVERY.as_millis() as u64
    }

    /// Whether the service is stalled at `now` or a stall ended less than `grace` before.
    pub fn stalled_within(&self, now: Instant, grace: Duration) -> bool {
        if self.stalled(now) {
            return true;
        }
        let end = self.last_stall_end.load(Ordering::Acquire);
        end > 0 && ms_since(self.start, now).saturating_sub(end) < grace.as_millis() as u64
    }

    /// Since when the service has been awake at `now`: the end of its last stall (`now`
    /// while stalled; the watch's start when it never stalled). Silence of peers before it
    /// does not count.
    pub fn awake_since(&self, now: Instant) -> Instant {
        if self.stalled(now) {
            return now;
        }
        let end = self.last_stall_end.load(Ordering::Acquire);
        (self.start + Duration::from_millis(end)).min(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(start: Instant, ms: u64) -> Instant {
        start + Duration::from_millis(ms)
    }

    #[test]
    fn a_watch_whose_pulse_never_ran_is_never_stalled() {
        let t0 = Instant::now();
        let watch = StallWatch::new(t0);
        assert!(!watch.stalled_within(at(t0, 60_000), Duration::from_secs(5)));
        assert_eq!(watch.awake_since(at(t0, 60_000)), t0);
    }

    #[test]
    fn regular_pulses_are_no_stall() {
        let t0 = Instant::now();
        let watch = StallWatch::new(t0);
        for ms in (100..3000).step_by(100) {
            watch.pulse_waits(at(t0, ms));
            watch.pulse_got(at(t0, ms + 5));
            assert!(!watch.stalled_within(at(t0, ms + 10), Duration::from_secs(5)));
        }
        assert_eq!(watch.awake_since(at(t0, 3000)), t0);
    }

    #[test]
    fn a_pulse_waiting_for_the_lock_is_a_stall_while_it_waits_and_for_the_grace_after() {
        let t0 = Instant::now();
        let watch = StallWatch::new(t0);
        watch.pulse_got(at(t0, 100));
        watch.pulse_waits(at(t0, 200));
        assert!(!watch.stalled(at(t0, 900)), "0.7 s of waiting is no stall");
        assert!(watch.stalled(at(t0, 1300)));
        assert!(watch.stalled(at(t0, 15_000)));
        assert_eq!(watch.awake_since(at(t0, 15_000)), at(t0, 15_000));
        // The lock comes free at 15.2 s.
        watch.pulse_got(at(t0, 15_200));
        assert!(!watch.stalled(at(t0, 15_250)));
        assert!(watch.stalled_within(at(t0, 15_250), Duration::from_secs(5)));
        for ms in (15_300..=20_300).step_by(100) {
            watch.pulse_waits(at(t0, ms));
            watch.pulse_got(at(t0, ms));
        }
        assert!(watch.stalled_within(at(t0, 20_100), Duration::from_secs(5)));
        assert!(!watch.stalled_within(at(t0, 20_300), Duration::from_secs(5)));
        assert_eq!(watch.awake_since(at(t0, 20_350)), at(t0, 15_200));
    }

    #[test]
    fn a_pulse_that_did_not_run_at_all_is_a_stall() {
        // A frozen process: no pulse waited, none ran.
        let t0 = Instant::now();
        let watch = StallWatch::new(t0);
        watch.pulse_got(at(t0, 100));
        assert!(!watch.stalled(at(t0, 1000)));
        assert!(watch.stalled(at(t0, 2000)));
        watch.pulse_got(at(t0, 9000));
        assert_eq!(watch.awake_since(at(t0, 9100)), at(t0, 9000));
    }

    #[test]
    fn awake_since_never_moves_back() {
        let t0 = Instant::now();
        let watch = StallWatch::new(t0);
        watch.pulse_got(at(t0, 5000));
        let first = watch.awake_since(at(t0, 5100));
        // A late report of an earlier pulse cannot move the stall's end back.
        watch.last_pulse.store(1, Ordering::Release);
        watch.pulse_got(at(t0, 3000));
        assert!(watch.awake_since(at(t0, 5200)) >= first);
    }
}
