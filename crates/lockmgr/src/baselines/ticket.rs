//! A DSLR-style ticket lock on one 64-bit word, driven with one-sided verbs only.
//!
//! This is the building block of the `mutex` and `seg` baselines (seed 000 Table 1, "SS": one
//! DSLR instance per segment) and the shape of CITRON's spillover mutex.
//!
//! # Word layout
//!
//! ```text
//!  63            32 31             0
//! +----------------+----------------+
//! |  next ticket   |  now serving   |
//! +----------------+----------------+
//! ```
//!
//! Both halves are `u32` counters compared with wrapping arithmetic, so the lock survives 2^32
//! acquisitions:
//!
//! - **take a ticket**: `FAA(word, 1 << 32)`. The carry out of the top half falls off the word,
//!   so the increment never disturbs `now serving`. The old value says both my ticket and who is
//!   being served: if they are equal, the lock is mine after one round trip.
//! - **wait**: re-read the word until `now serving == my ticket`, with truncated, randomized
//!   exponential backoff between reads (seed 002 §4.3) so waiters do not flood the server.
//! - **release**: `FAA(word, 1)` on `now serving`. When `now serving` wraps from `u32::MAX` to
//!   0, a plain `+1` would carry into `next ticket`; the releaser knows its own ticket (it *is*
//!   `now serving`) and adds `0xFFFF_FFFF_0000_0001` instead, which is `+1` on the low half and
//!   `-1` on the high half, cancelling the carry. One plain FAA either way, so this works on any
//!   NIC, including RDMA devices without masked atomics.
//!
//! # Leases (optional)
//!
//! With a lease `T_lease` configured, a waiter that sees `now serving` unchanged for `T_lease`
//! presumes the holder dead and moves `now serving` forward with one masked CAS on the low half
//! (`cmp = stalled value`, so concurrent repairers advance it once). Holders must then finish
//! within `T_lease`; their release becomes a masked CAS `now serving: mine -> mine + 1`, which
//! fails harmlessly if the lock was already taken from them ([`LockError::NotHeld`]).
//!
//! Lease recovery trusts clocks and critical-section lengths; without a lease the lock never
//! breaks, and a dead holder blocks its waiters forever (DSLR has the same trade-off).

use crate::scheme::LockError;
use fabric::{Endpoint, EndpointExt, RemoteAddr};
use rand::rngs::SmallRng;
use std::time::{Duration, Instant};

/// `FAA` addend that takes a ticket.
const TAKE_TICKET: u64 = 1 << 32;
/// Bits of `now serving`.
const SERVING_MASK: u64 = 0xFFFF_FFFF;
/// `FAA` addend that releases when `now serving` wraps: `+1` low, `-1` high (see module docs).
const RELEASE_WRAPPING: u64 = 0xFFFF_FFFF_0000_0001;

/// The ticket number in a word's high half.
pub fn next_ticket(word: u64) -> u32 {
    (word >> 32) as u32
}

/// The ticket being served, in a word's low half.
pub fn now_serving(word: u64) -> u32 {
    word as u32
}

pub use crate::backoff::Backoff;
use crate::backoff::BackoffState;

/// How a ticket lock behaves on the client side. The default: default backoff, no lease.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TicketConfig {
    /// Backoff between polls while waiting for the turn.
    pub backoff: Backoff,
    /// The holder lease: `None` (the default) never breaks a lock.
    pub lease: Option<Duration>,
}

/// What one ticket acquisition did, for the caller's statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TicketOutcome {
    /// The ticket taken (needed to release).
    pub ticket: u32,
    /// Polls that found the lock still held by someone else.
    pub polls: u64,
    /// Whether this acquisition broke an expired holder's lease.
    pub recoveries: u64,
}

/// A ticket lock at one word of remote memory. Holds no connection: every operation takes the
/// calling thread's endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TicketLock {
    /// The lock word (8-byte aligned).
    pub addr: RemoteAddr,
}

impl TicketLock {
    /// The lock at `addr`.
    pub const fn new(addr: RemoteAddr) -> Self {
        Self { addr }
    }

    /// Initializes the word to the free state (`next ticket == now serving == 0`). Only while no
    /// client uses the lock.
    pub fn init(&self, endpoint: &mut dyn Endpoint) -> Result<(), LockError> {
        endpoint.write_u64(self.addr, 0)?;
        Ok(())
    }

    /// Takes a ticket and waits for its turn.
    pub fn acquire(
        &self,
        endpoint: &mut dyn Endpoint,
        config: &TicketConfig,
        rng: &mut SmallRng,
    ) -> Result<TicketOutcome, LockError> {
        let old = endpoint.faa(self.addr, TAKE_TICKET)?;
        let ticket = next_ticket(old);
        let mut outcome = TicketOutcome {
            ticket,
            ..TicketOutcome::default()
        };
        let mut serving = now_serving(old);
        if serving == ticket {
            return Ok(outcome);
        }
        let mut backoff = BackoffState::new(config.backoff);
        let mut serving_since = Instant::now();
        loop {
            backoff.snooze(rng);
            let word = endpoint.read_u64(self.addr)?;
            let now = now_serving(word);
            if now == ticket {
                return Ok(outcome);
            }
            outcome.polls += 1;
            if now != serving {
                serving = now;
                serving_since = Instant::now();
                continue;
            }
            if let Some(lease) = config.lease {
                if serving_since.elapsed() >= lease {
                    // The holder of `serving` has held (or waited for) its turn for a whole
                    // lease without moving: break it. The masked CAS compares only the low half,
                    // so concurrent ticket takers do not make it fail, and concurrent repairers
                    // of the same stall advance it exactly once.
                    let swapped = serving.wrapping_add(1);
                    let old = endpoint.masked_cas(
                        self.addr,
                        u64::from(serving),
                        SERVING_MASK,
                        u64::from(swapped),
                        SERVING_MASK,
                    )?;
                    if now_serving(old) == serving {
                        outcome.recoveries += 1;
                        tracing::warn!(addr = %self.addr, ticket = serving, "ticket lock lease expired; holder presumed dead");
                    }
                    serving_since = Instant::now();
                }
            }
        }
    }

    /// Posts nothing: returns the addend that releases ticket `ticket` with one plain FAA.
    pub fn release_addend(ticket: u32) -> u64 {
        if ticket == u32::MAX {
            RELEASE_WRAPPING
        } else {
            1
        }
    }

    /// Releases the lock held with `ticket`.
    ///
    /// Without a lease: one FAA. With a lease: a masked CAS that only advances `now serving` if it
    /// is still `ticket`; returns `Ok(false)` if the lease had been broken (the lock was no
    /// longer ours, and nothing was changed).
    pub fn release(
        &self,
        endpoint: &mut dyn Endpoint,
        config: &TicketConfig,
        ticket: u32,
    ) -> Result<bool, LockError> {
        if config.lease.is_some() {
            let old = endpoint.masked_cas(
                self.addr,
                u64::from(ticket),
                SERVING_MASK,
                u64::from(ticket.wrapping_add(1)),
                SERVING_MASK,
            )?;
            Ok(now_serving(old) == ticket)
        } else {
            endpoint.faa(self.addr, Self::release_addend(ticket))?;
            Ok(true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::{MemServer, RegionId};
    use rand::SeedableRng;

    fn setup() -> (MemServer, TicketLock) {
        let server = MemServer::new();
        server.register(RegionId(1), 64).unwrap();
        (server, TicketLock::new(RemoteAddr::new(RegionId(1), 8)))
    }

    #[test]
    fn uncontended_acquire_is_one_round_trip() {
        let (server, lock) = setup();
        let mut ep = server.endpoint();
        let mut rng = SmallRng::seed_from_u64(1);
        let config = TicketConfig::default();
        lock.init(&mut ep).unwrap();
        let before = ep.stats().round_trips;
        let outcome = lock.acquire(&mut ep, &config, &mut rng).unwrap();
        assert_eq!(ep.stats().round_trips - before, 1);
        assert_eq!(outcome.ticket, 0);
        assert!(lock.release(&mut ep, &config, outcome.ticket).unwrap());
        assert_eq!(ep.read_u64(lock.addr).unwrap(), (1 << 32) | 1);
    }

    #[test]
    fn counters_wrap_without_carrying_into_each_other() {
        let (server, lock) = setup();
        let mut ep = server.endpoint();
        let mut rng = SmallRng::seed_from_u64(2);
        let config = TicketConfig::default();
        // Both halves at u32::MAX - 1: two acquisitions wrap both counters.
        let start = (u64::from(u32::MAX - 1) << 32) | u64::from(u32::MAX - 1);
        ep.write_u64(lock.addr, start).unwrap();
        for expected in [u32::MAX - 1, u32::MAX, 0, 1] {
            let outcome = lock.acquire(&mut ep, &config, &mut rng).unwrap();
            assert_eq!(outcome.ticket, expected);
            lock.release(&mut ep, &config, outcome.ticket).unwrap();
            let word = ep.read_u64(lock.addr).unwrap();
            assert_eq!(next_ticket(word), expected.wrapping_add(1));
            assert_eq!(now_serving(word), expected.wrapping_add(1));
        }
    }

    #[test]
    fn lease_recovers_a_dead_holder_and_fences_its_release() {
        let (server, lock) = setup();
        let config = TicketConfig {
            lease: Some(Duration::from_millis(20)),
            ..TicketConfig::default()
        };
        let mut rng = SmallRng::seed_from_u64(3);
        let mut dead = server.endpoint();
        let held = lock.acquire(&mut dead, &config, &mut rng).unwrap();
        // The holder "dies": it never releases. A waiter must get in after about one lease.
        let mut alive = server.endpoint();
        let started = Instant::now();
        let outcome = lock.acquire(&mut alive, &config, &mut rng).unwrap();
        assert!(started.elapsed() >= Duration::from_millis(20));
        assert_eq!(outcome.recoveries, 1);
        // The late release of the dead holder changes nothing.
        assert!(!lock.release(&mut dead, &config, held.ticket).unwrap());
        assert!(lock.release(&mut alive, &config, outcome.ticket).unwrap());
        let word = alive.read_u64(lock.addr).unwrap();
        assert_eq!(now_serving(word), next_ticket(word));
    }
}
