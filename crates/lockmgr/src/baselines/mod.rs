//! The baseline lock schemes of CITRON Table 1 that matter to a file system, behind the same
//! [`RangeLock`](crate::RangeLock) trait as CITRON:
//!
//! - [`mutex`] (`"mutex"`): one DSLR-style ticket lock for everything;
//! - [`seg`] (`"seg"`): static segmentation, one ticket lock per fixed-size segment;
//! - [`server`] (`"server"`): a CPU lock server holding an interval set, over TCP.
//!
//! Each creates its shared state and opens per-thread handles next to its own code;
//! [`crate::schemes`] describes, creates and opens every scheme, these and CITRON, through one
//! type and two functions.

pub mod mutex;
pub mod seg;
pub mod server;
pub mod ticket;

pub use mutex::{MutexLock, MutexScheme};
pub use seg::{SegConfig, SegLock, SegScheme, SegSpec};
pub use server::{LockServer, LockServerAt, LockServerClient};
pub use ticket::{Backoff, TicketConfig, TicketLock};

use crate::carry::CarryingEndpoint;
use crate::scheme::{LockError, LockId};
use crate::stats::LockStats;
use fabric::{Batch, Completions, Endpoint};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::collections::HashMap;
use std::time::Instant;

/// The bookkeeping every fabric-based baseline client shares: its endpoint, a random stream for
/// backoff, the locks it holds (`T`: what releasing needs) and its statistics.
pub(crate) struct ClientCore<T> {
    /// The lock words' endpoint, which can carry a caller's verbs (`crate::carry`).
    endpoint: CarryingEndpoint,
    rng: SmallRng,
    /// Per held lock: what releasing needs, and its lease deadline (`None`: no lease).
    held: HashMap<u64, (T, Option<Instant>)>,
    next_id: u64,
    pub(crate) stats: LockStats,
}

impl<T> ClientCore<T> {
    pub(crate) fn new(endpoint: Box<dyn Endpoint>) -> Self {
        Self {
            endpoint: CarryingEndpoint::new(endpoint),
            rng: SmallRng::from_rng(&mut rand::rng()),
            held: HashMap::new(),
            next_id: 1,
            stats: LockStats::default(),
        }
    }

    /// Runs one acquisition, accounting its time and traffic, and records what it holds and
    /// its lease deadline; carries `extra` in the acquisition's batches
    /// ([`crate::RangeLock::acquire_with`]; empty for a plain acquire): the ticket lock learns its grant from the FAA that
    /// takes the ticket, or from the poll that sees it served, and whichever that is, it is the
    /// acquisition's last batch and `extra` rides at its end. On a fabric failure after the
    /// grant the lock is still recorded as held, for the caller to release.
    pub(crate) fn acquire_carrying(
        &mut self,
        extra: &Batch,
        out: &mut Completions,
        take: impl FnOnce(
            &mut dyn Endpoint,
            &mut SmallRng,
            &mut LockStats,
        ) -> Result<(T, Option<Instant>), LockError>,
    ) -> Result<LockId, LockError> {
        let started = Instant::now();
        let before = self.endpoint.stats();
        self.endpoint.carry_after(extra);
        let result = take(&mut self.endpoint, &mut self.rng, &mut self.stats);
        let carried = self.endpoint.finish(result.is_ok(), out);
        self.stats.acquire_time += started.elapsed();
        self.stats
            .acquire
            .add(&self.endpoint.stats().since(&before));
        let held = result?;
        let id = self.next_id;
        self.next_id += 1;
        self.held.insert(id, held);
        self.stats.acquisitions += 1;
        carried?;
        Ok(LockId(id))
    }

    /// The lease deadline of held lock `id`.
    pub(crate) fn deadline(&self, id: LockId) -> Option<Instant> {
        self.held.get(&id.0).and_then(|(_, d)| *d)
    }

    /// Runs one release of a lock this client holds, accounting its traffic. `give_back`
    /// returns whether every word was still ours; if not (or the lease deadline had passed) the
    /// release is counted as late: the conditional verbs left a successor's state alone.
    ///
    /// Carries `extra` at the head of the release's first batch
    /// ([`crate::RangeLock::release_with`]; empty for a plain release).
    pub(crate) fn release_carrying(
        &mut self,
        id: LockId,
        extra: &Batch,
        out: &mut Completions,
        give_back: impl FnOnce(&mut dyn Endpoint, T) -> Result<bool, LockError>,
    ) -> Result<(), LockError> {
        let (held, deadline) = self.held.remove(&id.0).ok_or(LockError::NotHeld(id))?;
        let late = deadline.is_some_and(|d| Instant::now() >= d);
        let before = self.endpoint.stats();
        self.endpoint.carry_before(extra);
        let result = give_back(&mut self.endpoint, held);
        let carried = self.endpoint.finish(result.is_ok(), out);
        self.stats
            .release
            .add(&self.endpoint.stats().since(&before));
        let ours = result?;
        carried?;
        if late || !ours {
            self.stats.late_releases += 1;
            tracing::warn!(
                ?id,
                broken = !ours,
                "ticket lock: release after the lease deadline; conditional verbs left the lock's new holder alone"
            );
        }
        self.stats.releases += 1;
        Ok(())
    }
}
