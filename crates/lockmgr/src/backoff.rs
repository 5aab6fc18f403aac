//! Waiting without burning cores, for every lock scheme: truncated, randomised exponential
//! backoff between polls (SMART §4.3: after the `i`-th failed poll wait
//! `Rand(min(base · 2^i, max))`), and timed waits.
//!
//! Short waits yield the core in a loop (a sleep is never shorter than the kernel's timer slack,
//! tens of µs); waits of at least `sleep_threshold` sleep. With more threads than cores, the
//! holder a waiter waits for may need the very core the waiter is on.

use rand::rngs::SmallRng;
use rand::Rng;
use std::time::{Duration, Instant};

/// Waits at least this long sleep instead of yielding, unless configured otherwise.
pub const SLEEP_THRESHOLD: Duration = Duration::from_micros(50);

/// How a waiter backs off between polls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The first backoff bound (about one round trip).
    pub base: Duration,
    /// The truncation: no single wait is longer.
    pub max: Duration,
    /// Waits at least this long sleep instead of yielding.
    pub sleep_threshold: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_micros(1),
            max: Duration::from_micros(256),
            sleep_threshold: SLEEP_THRESHOLD,
        }
    }
}

/// The state of one wait: the current bound.
#[derive(Debug)]
pub struct BackoffState {
    config: Backoff,
    bound: Duration,
}

impl BackoffState {
    /// Starts a wait.
    pub fn new(config: Backoff) -> Self {
        Self {
            config,
            bound: config.base,
        }
    }

    /// Waits a random time below the current bound, then doubles the bound (up to `max`).
    pub fn snooze(&mut self, rng: &mut SmallRng) {
        let bound = self.bound.as_nanos().max(1) as u64;
        let delay = Duration::from_nanos(rng.random_range(0..=bound));
        self.bound = (self.bound * 2).min(self.config.max.max(self.config.base));
        pause(delay, self.config.sleep_threshold);
    }

    /// Back to the first bound (progress was made).
    pub fn reset(&mut self) {
        self.bound = self.config.base;
    }
}

/// Waits `delay`: sleeps if it is at least `sleep_threshold`, else yields the core until it has
/// passed.
pub fn pause(delay: Duration, sleep_threshold: Duration) {
    if delay.is_zero() {
        return;
    }
    if delay >= sleep_threshold {
        std::thread::sleep(delay);
        return;
    }
    let until = Instant::now() + delay;
    while Instant::now() < until {
        std::thread::yield_now();
    }
}

/// Waits until `deadline` (CITRON's phase (d), Alg. 2 l. 34).
pub fn wait_until(deadline: Instant) {
    let now = Instant::now();
    if deadline > now {
        pause(deadline - now, SLEEP_THRESHOLD);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn bound_doubles_truncates_and_resets() {
        let mut rng = SmallRng::seed_from_u64(1);
        let mut b = BackoffState::new(Backoff {
            base: Duration::from_nanos(100),
            max: Duration::from_nanos(350),
            sleep_threshold: SLEEP_THRESHOLD,
        });
        let bounds: Vec<u128> = (0..4)
            .map(|_| {
                b.snooze(&mut rng);
                b.bound.as_nanos()
            })
            .collect();
        assert_eq!(bounds, vec![200, 350, 350, 350]);
        b.reset();
        assert_eq!(b.bound.as_nanos(), 100);
    }

    #[test]
    fn timed_waits_wait() {
        let start = Instant::now();
        pause(Duration::from_micros(20), SLEEP_THRESHOLD);
        pause(Duration::from_micros(200), SLEEP_THRESHOLD);
        wait_until(Instant::now() + Duration::from_micros(100));
        assert!(start.elapsed() >= Duration::from_micros(320));
    }
}
