//! Waiting without burning cores: truncated, randomised exponential backoff between polls
//! (seed 002 §4.3: after the `i`-th failed poll wait `Rand(min(t0·2^i, t_max))`), and the timed
//! wait of phase (d).

use rand::rngs::SmallRng;
use rand::Rng;
use std::time::{Duration, Instant};

/// Waits at least this long sleep instead of yielding: a sleep costs tens of µs of timer slack.
const SLEEP_THRESHOLD: Duration = Duration::from_micros(50);

/// One wait's backoff state.
#[derive(Debug)]
pub(crate) struct Backoff {
    bound: Duration,
    base: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts a wait with first bound `base`, truncated at `max`.
    pub(crate) fn new(base: Duration, max: Duration) -> Self {
        Self {
            bound: base,
            base,
            max: max.max(base),
        }
    }

    /// Waits a random time below the current bound, then doubles the bound.
    pub(crate) fn snooze(&mut self, rng: &mut SmallRng) {
        let bound = self.bound.as_nanos().max(1) as u64;
        let delay = Duration::from_nanos(rng.random_range(0..=bound));
        self.bound = (self.bound * 2).min(self.max);
        pause(delay);
    }

    /// Back to the first bound (progress was made).
    pub(crate) fn reset(&mut self) {
        self.bound = self.base;
    }
}

/// Waits `delay`: sleeps when long, otherwise yields the core until it has passed (with more
/// threads than cores, the client we wait for may need this core).
pub(crate) fn pause(delay: Duration) {
    if delay >= SLEEP_THRESHOLD {
        std::thread::sleep(delay);
        return;
    }
    let until = Instant::now() + delay;
    while Instant::now() < until {
        std::thread::yield_now();
    }
}

/// Waits until `deadline` (phase (d), Alg. 2 l. 34).
pub(crate) fn wait_until(deadline: Instant) {
    let now = Instant::now();
    if deadline > now {
        pause(deadline - now);
    }
}
