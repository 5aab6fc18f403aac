//! A DSLR-style ticket lock on one 64-bit word, driven with one-sided verbs only.
//!
//! This is the building block of the `mutex` and `seg` baselines (CITRON Table 1, "SS": one
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
//!   exponential backoff between reads (SMART §4.3) so waiters do not flood the server.
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
//! fails harmlessly if the lock was already taken from them ([`TicketLock::release`] returns
//! `false`; the `mutex` and `seg` handles count it in `LockStats::late_releases` and return `Ok`).
//!
//! A waiter whose own turn was broken while it was paused finds `now serving` beyond its ticket
//! ([`passed_over`]) and takes a new one instead of polling forever; every hold has a lease
//! deadline ([`lease_deadline`]) past which the holder must not use it, and the break itself is
//! preceded by the configured [`Fence`].
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
use crate::citron::config::DELTA;
use crate::fence::{self, Fence};
use std::sync::Arc;

/// How a ticket lock behaves on the client side. The default: default backoff, no lease, no
/// fence.
#[derive(Clone, Default)]
pub struct TicketConfig {
    /// Backoff between polls while waiting for the turn.
    pub backoff: Backoff,
    /// The holder lease: `None` (the default) never breaks a lock.
    pub lease: Option<Duration>,
    /// Called before this client breaks an expired holder's lease (see [`Fence`]); a failing
    /// fence keeps the lock unbroken for now.
    pub fence: Option<Arc<dyn Fence>>,
}

impl std::fmt::Debug for TicketConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TicketConfig")
            .field("backoff", &self.backoff)
            .field("lease", &self.lease)
            .field("fence", &self.fence.as_ref().map(|_| "Fence"))
            .finish()
    }
}

/// Two configurations are equal when they have the same backoff and lease and the same fence
/// object (or none).
impl PartialEq for TicketConfig {
    fn eq(&self, other: &Self) -> bool {
        self.backoff == other.backoff
            && self.lease == other.lease
            && match (&self.fence, &other.fence) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

impl Eq for TicketConfig {}

/// What one ticket acquisition did, for the caller's statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TicketOutcome {
    /// The ticket taken (needed to release).
    pub ticket: u32,
    /// Polls that found the lock still held by someone else.
    pub polls: u64,
    /// Whether this acquisition broke an expired holder's lease.
    pub recoveries: u64,
    /// Times this acquisition found its turn passed over by someone else's lease recovery (or
    /// its grant already past the lease deadline) and took a new ticket.
    pub passed_over: u64,
    /// With a lease: the earliest instant at which a waiter may break this hold (see
    /// [`TicketLock::acquire`]).
    pub deadline: Option<Instant>,
}

/// Whether `ticket` was passed over: `now serving` has moved beyond it (relative to the next
/// ticket, wrapping) without this client having been served. Tickets in the queue are those in
/// `[serving, next)`; ours is no longer among them.
pub fn passed_over(word: u64, ticket: u32) -> bool {
    let (serving, next) = (now_serving(word), next_ticket(word));
    ticket != serving && ticket.wrapping_sub(serving) >= next.wrapping_sub(serving)
}

/// The lease deadline of a hold whose turn began no earlier than `anchor` (this client's clock):
/// `anchor + (1 - δ)·lease`.
///
/// Why it is safe: a waiter breaks the hold when `now serving` has stood still for a whole lease
/// *on its clock*, measured from the first read that showed the current value (or from the
/// moment it took its ticket, which is after ours: a waiter behind us took its ticket after
/// we did). The current value — our ticket — was written after `anchor`, which is the post time
/// of our last verb that did *not* see it (the ticket's FAA when it found the lock busy, else
/// the last poll before the grant; the FAA itself when it was served at once). So no waiter's
/// stand-still clock started before `anchor`, and a lease on a clock that runs at most `δ`
/// faster than ours is at least `(1 - δ)·lease` of ours.
pub fn lease_deadline(anchor: Instant, lease: Duration) -> Instant {
    anchor + lease.mul_f64(1.0 - DELTA)
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
    ///
    /// With a lease, every wait is bounded: a waiter whose ticket was passed over (a waiter
    /// behind it broke its turn while it was not looking, e.g. paused) takes a new ticket; a
    /// grant seen only after its own lease deadline ([`lease_deadline`]) is given back (with
    /// the conditional release) and retried, so that a returned hold always has its deadline
    /// ahead ([`TicketOutcome::deadline`]).
    pub fn acquire(
        &self,
        endpoint: &mut dyn Endpoint,
        config: &TicketConfig,
        rng: &mut SmallRng,
    ) -> Result<TicketOutcome, LockError> {
        let mut outcome = TicketOutcome::default();
        loop {
            // The anchor of the lease deadline: the post time of the last verb that did not see
            // our turn (see `lease_deadline`).
            let mut anchor = Instant::now();
            let old = endpoint.faa(self.addr, TAKE_TICKET)?;
            let ticket = next_ticket(old);
            outcome.ticket = ticket;
            let mut serving = now_serving(old);
            let mut served = serving == ticket;
            let mut backoff = BackoffState::new(config.backoff);
            let mut serving_since = Instant::now();
            while !served {
                backoff.snooze(rng);
                let posted = Instant::now();
                let word = endpoint.read_u64(self.addr)?;
                let now = now_serving(word);
                if now == ticket {
                    served = true;
                    break;
                }
                anchor = posted;
                outcome.polls += 1;
                if config.lease.is_some() && passed_over(word, ticket) {
                    // Our turn came and went while we were not looking: someone broke it. We
                    // hold nothing; take a new ticket.
                    outcome.passed_over += 1;
                    tracing::warn!(addr = %self.addr, ticket, serving = now, "ticket lock: our turn was passed over (lease broken while we waited); taking a new ticket");
                    break;
                }
                if now != serving {
                    serving = now;
                    serving_since = Instant::now();
                    continue;
                }
                if let Some(lease) = config.lease {
                    if serving_since.elapsed() >= lease {
                        // The holder of `serving` has held (or waited for) its turn for a whole
                        // lease without moving: break it, after fencing it off the servers. The
                        // masked CAS compares only the low half, so concurrent ticket takers do
                        // not make it fail, and concurrent repairers of the same stall advance
                        // it exactly once.
                        if !fence::before_recovery(config.fence.as_ref(), "ticket lock") {
                            serving_since = Instant::now();
                            continue;
                        }
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
            if !served {
                continue;
            }
            let Some(lease) = config.lease else {
                return Ok(outcome);
            };
            let deadline = lease_deadline(anchor, lease);
            if Instant::now() < deadline {
                outcome.deadline = Some(deadline);
                return Ok(outcome);
            }
            // Served, but seen only after the lease deadline (we were paused): a waiter may
            // break the hold at any moment. Give it back (conditionally) and start over.
            outcome.passed_over += 1;
            tracing::warn!(addr = %self.addr, ticket, "ticket lock: turn seen only after its lease deadline; giving it back");
            self.release(endpoint, config, ticket)?;
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
    /// longer ours, and nothing was changed). Invariant behind the CAS: while `now serving` is
    /// our ticket, nobody but us (or a breaker, which moves it past us) writes that half.
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

    #[test]
    fn a_passed_over_waiter_takes_a_new_ticket() {
        // The word as a break-in leaves it: tickets 0..3 taken, `now serving` moved to 2 past
        // ticket 1 (whose owner was paused).
        let word = (3u64 << 32) | 2;
        assert!(passed_over(word, 1));
        assert!(!passed_over(word, 2));
        // Wrapping: tickets u32::MAX, 0, 1 taken, serving 0.
        let word = word_of(2, 0);
        assert!(passed_over(word, u32::MAX));
        assert!(!passed_over(word, 1));
        // Everyone served, ticket 4 skipped.
        assert!(passed_over((5u64 << 32) | 5, 4));

        // A waiter whose turn is skipped while it waits does not poll forever.
        let (server, lock) = setup();
        let mut ep = server.endpoint();
        // Ticket 0 is held.
        ep.write_u64(lock.addr, word_of(1, 0)).unwrap();
        let mut waiter_ep = server.endpoint();
        let waiter = std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(4);
            let config = TicketConfig {
                lease: Some(Duration::from_secs(5)),
                ..TicketConfig::default()
            };
            lock.acquire(&mut waiter_ep, &config, &mut rng).unwrap()
        });
        // The waiter takes ticket 1; then ticket 2 is taken and breaks in over it (as a waiter
        // behind a paused one does), and holds.
        while next_ticket(ep.read_u64(lock.addr).unwrap()) != 2 {
            std::thread::yield_now();
        }
        ep.write_u64(lock.addr, word_of(3, 2)).unwrap();
        // The waiter notices, takes ticket 3, and is served when 2 releases.
        while next_ticket(ep.read_u64(lock.addr).unwrap()) != 4 {
            std::thread::yield_now();
        }
        ep.faa(lock.addr, 1).unwrap();
        let outcome = waiter.join().unwrap();
        assert_eq!(outcome.ticket, 3);
        assert_eq!(outcome.passed_over, 1);
        assert!(outcome.deadline.is_some());
    }

    fn word_of(next: u32, serving: u32) -> u64 {
        (u64::from(next) << 32) | u64::from(serving)
    }

    struct CountingFence {
        calls: std::sync::atomic::AtomicU64,
        fail_first: u64,
    }

    impl Fence for CountingFence {
        fn fence(&self) -> Result<(), LockError> {
            let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if n < self.fail_first {
                Err(LockError::Config("fence refused (test)".into()))
            } else {
                Ok(())
            }
        }
    }

    #[test]
    fn the_fence_runs_before_a_break_and_a_failing_fence_delays_it() {
        let (server, lock) = setup();
        let fence = Arc::new(CountingFence {
            calls: Default::default(),
            fail_first: 2,
        });
        let config = TicketConfig {
            lease: Some(Duration::from_millis(20)),
            fence: Some(fence.clone()),
            ..TicketConfig::default()
        };
        let mut rng = SmallRng::seed_from_u64(5);
        let mut dead = server.endpoint();
        lock.acquire(&mut dead, &config, &mut rng).unwrap();
        let mut alive = server.endpoint();
        let started = Instant::now();
        let outcome = lock.acquire(&mut alive, &config, &mut rng).unwrap();
        // Two refused fences cost a lease each before the third lets the break happen.
        assert!(started.elapsed() >= Duration::from_millis(60));
        assert_eq!(fence.calls.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert_eq!(outcome.recoveries, 1);
    }
}
