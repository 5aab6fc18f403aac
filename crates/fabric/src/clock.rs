//! Batch deadlines across processes: how a tcp client names, in its server's clock, the instant
//! after which no verb of a batch may execute ([`crate::Batch::expire_at`]).
//!
//! Each process counts microseconds from its own origin ([`now_micros`]; the first use of this
//! module in the process). A client cannot read its server's count, but every answer carries
//! it: an answer read at local instant `r` that says `s` was written at some local instant
//! before `r`, when the server's count minus ours was `s − r` *or more*. So [`PeerClock`]
//! keeps `s − r` as a lower bound of that difference, and a deadline `D` is sent as
//! `D + bound` in the server's count: never later than the true instant, only earlier — by the
//! answer's one-way delay, or by what the two clocks drifted since (allowed for at
//! [`DRIFT_PER_SEC`]). So however long a request waits on its way — in the client between
//! encoding and sending, in socket buffers, in the server before its thread reads it — the
//! server stops it at (or before) the deadline the client set, never after.
//!
//! Before this, the deadline travelled as "microseconds left", counted again from the
//! request's arrival: a request delayed on its way got the delay added to its deadline.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The clocks of two hosts may drift apart by at most this much per second since the last
/// answer (clocks disciplined by NTP slew at most 500 ppm; an undisciplined crystal drifts far
/// less): 1 ms per second, so an estimate [`RESYNC_AFTER`] old is at most 2 ms early.
pub const DRIFT_PER_SEC: Duration = Duration::from_millis(1);

/// A client refreshes its estimate with an empty batch before sending a deadline when its last
/// answer is older than this (an idle connection), so that drift allowance never eats a
/// deadline.
pub const RESYNC_AFTER: Duration = Duration::from_secs(2);

/// This process's origin of counted microseconds.
fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Signed microseconds from this process's origin to `t`.
pub(crate) fn micros_of(t: Instant) -> i64 {
    let o = origin();
    let signed = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
    match t.checked_duration_since(o) {
        Some(after) => signed(after),
        None => -signed(o.duration_since(t)),
    }
}

/// This process's count now, as sent in answers (never negative: the origin is in the past).
/// A server stamps its answers with it; a client learns from them with [`PeerClock::answer`].
pub fn now_micros() -> u64 {
    micros_of(Instant::now()).max(0) as u64
}

/// The instant `micros` after this process's origin (saturating far in the future): a
/// deadline a client sent in this process's count ([`PeerClock::to_peer`]), as an instant here.
pub fn instant_of(micros: u64) -> Instant {
    let o = origin();
    o.checked_add(Duration::from_micros(micros))
        .unwrap_or(o + Duration::from_secs(1 << 30))
}

/// What a client knows of its server's clock: a lower bound of (server's count − ours), learnt
/// from the last answer that raised it (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct PeerClock {
    /// The bound, in microseconds, when `learnt`.
    offset: i64,
    /// When it was learnt (`None`: the peer is this process, no drift).
    learnt: Option<Instant>,
}

impl PeerClock {
    /// The clock of this very process (the peer's count is ours): what a batch's serde
    /// encoding assumes.
    pub const SAME_PROCESS: PeerClock = PeerClock {
        offset: 0,
        learnt: None,
    };

    /// The bound from an answer that carried the peer's count `peer` and was read at
    /// `received`.
    pub fn from_answer(peer: u64, received: Instant) -> PeerClock {
        PeerClock {
            offset: (peer.min(i64::MAX as u64) as i64).saturating_sub(micros_of(received)),
            learnt: Some(received),
        }
    }

    /// Takes in another answer: keeps whichever bound is higher once the old one is aged by
    /// the drift allowance (both are lower bounds; the higher is the tighter).
    pub fn answer(&mut self, peer: u64, received: Instant) {
        let new = PeerClock::from_answer(peer, received);
        if new.offset >= self.offset_at(received) {
            *self = new;
        }
    }

    /// The bound at `now`: the learnt one less the drift allowed since.
    fn offset_at(&self, now: Instant) -> i64 {
        match self.learnt {
            None => self.offset,
            Some(learnt) => {
                let aged = now.saturating_duration_since(learnt).as_micros();
                // Rounded up: the allowance is never short.
                let drift = (aged * DRIFT_PER_SEC.as_micros()).div_ceil(1_000_000);
                self.offset
                    .saturating_sub(i64::try_from(drift).unwrap_or(i64::MAX))
            }
        }
    }

    /// Whether the last answer is older than [`RESYNC_AFTER`] at `now`.
    pub fn is_stale(&self, now: Instant) -> bool {
        self.learnt
            .is_some_and(|learnt| now.saturating_duration_since(learnt) > RESYNC_AFTER)
    }

    /// The bound as it stands at `now`, fixed: a clock that ages no further, for encoding a
    /// batch posted at `now` (so that the post reads the time once).
    pub fn at(&self, now: Instant) -> PeerClock {
        PeerClock {
            offset: self.offset_at(now),
            learnt: None,
        }
    }

    /// `t` in the peer's count, as late as it can be while surely not after `t` (0 when that
    /// lies before the peer's origin: an instant long past). Reads the time only for a bound
    /// that still ages (not one fixed by [`PeerClock::at`]).
    pub fn to_peer(&self, t: Instant) -> u64 {
        let offset = match self.learnt {
            None => self.offset,
            Some(_) => self.offset_at(Instant::now()),
        };
        micros_of(t).saturating_add(offset).max(0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_trip_within_a_microsecond() {
        let t = Instant::now() + Duration::from_millis(1500);
        let back = instant_of(micros_of(t) as u64);
        let diff = if back > t { back - t } else { t - back };
        assert!(diff < Duration::from_micros(1), "{diff:?}");
        // Before the origin: negative, and a peer count of 0.
        let past = origin() - Duration::from_millis(5);
        assert!(micros_of(past) <= -5_000);
        assert_eq!(PeerClock::SAME_PROCESS.to_peer(past), 0);
    }

    #[test]
    fn the_bound_never_exceeds_the_true_offset() {
        // A "server" whose count runs 7 s ahead of ours, answering after a delay: the answer
        // is written at `written` and read 40 ms later.
        let true_offset = 7_000_000i64;
        let _ = now_micros();
        let written = Instant::now();
        let server_count = (micros_of(written) + true_offset) as u64;
        let received = written + Duration::from_millis(40);
        let mut clock = PeerClock::from_answer(server_count, received);
        let bound = clock.offset_at(received);
        assert!(bound <= true_offset, "{bound} > {true_offset}");
        assert!(
            true_offset - bound <= 40_000,
            "as early as the answer's delay, no more"
        );
        // A quicker answer tightens it; a slower one does not loosen it.
        let later = received + Duration::from_millis(10);
        clock.answer((micros_of(later) + true_offset) as u64, later);
        assert_eq!(clock.offset_at(later), true_offset);
        let slow = later + Duration::from_millis(100);
        clock.answer((micros_of(slow) + true_offset - 90_000) as u64, slow);
        assert!(clock.offset_at(slow) > true_offset - 1_000);
        // A deadline goes out no later than the true instant.
        let deadline = Instant::now() + Duration::from_secs(2);
        assert!(clock.to_peer(deadline) as i64 <= micros_of(deadline) + true_offset);
    }

    #[test]
    fn an_old_bound_is_aged_by_the_drift_allowance_and_goes_stale() {
        // The origin is set first (a count is never negative for an instant after it).
        let _ = now_micros();
        let now = Instant::now();
        let clock = PeerClock::from_answer(micros_of(now) as u64, now);
        let later = now + Duration::from_secs(10);
        assert_eq!(clock.offset_at(later), -10_000, "1 ms per second");
        // Fixed at `later`, it converts with that bound and ages no further.
        let fixed = clock.at(later);
        let t = later + Duration::from_secs(1);
        assert_eq!(fixed.to_peer(t) as i64, micros_of(t) - 10_000);
        assert_eq!(
            fixed.at(later + Duration::from_secs(60)).to_peer(t),
            fixed.to_peer(t)
        );
        assert!(!clock.is_stale(now + RESYNC_AFTER));
        assert!(clock.is_stale(later));
        assert!(!PeerClock::SAME_PROCESS.is_stale(later));
    }
}
