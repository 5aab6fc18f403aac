//! The baseline lock schemes of seed 000 Table 1 that matter to a file system, behind the same
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

use crate::scheme::{LockError, LockId};
use crate::stats::LockStats;
use fabric::{Endpoint, EndpointStats};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::collections::HashMap;
use std::time::Instant;

/// The bookkeeping every fabric-based baseline client shares: its endpoint, a random stream for
/// backoff, the locks it holds (`T`: what releasing needs) and its statistics.
pub(crate) struct ClientCore<T> {
    endpoint: Box<dyn Endpoint>,
    rng: SmallRng,
    /// Per held lock: what releasing needs, and its lease deadline (`None`: no lease).
    held: HashMap<u64, (T, Option<Instant>)>,
    next_id: u64,
    pub(crate) stats: LockStats,
}

impl<T> ClientCore<T> {
    pub(crate) fn new(endpoint: Box<dyn Endpoint>) -> Self {
        Self {
            endpoint,
            rng: SmallRng::from_rng(&mut rand::rng()),
            held: HashMap::new(),
            next_id: 1,
            stats: LockStats::default(),
        }
    }

    /// Runs one acquisition, accounting its time and traffic, and records what it holds and
    /// its lease deadline.
    pub(crate) fn acquire(
        &mut self,
        take: impl FnOnce(
            &mut dyn Endpoint,
            &mut SmallRng,
            &mut LockStats,
        ) -> Result<(T, Option<Instant>), LockError>,
    ) -> Result<LockId, LockError> {
        let started = Instant::now();
        let before = self.endpoint.stats();
        let result = take(&mut *self.endpoint, &mut self.rng, &mut self.stats);
        self.stats.acquire_time += started.elapsed();
        add_traffic(
            &mut self.stats.acquire,
            &self.endpoint.stats().since(&before),
        );
        let held = result?;
        let id = self.next_id;
        self.next_id += 1;
        self.held.insert(id, held);
        self.stats.acquisitions += 1;
        Ok(LockId(id))
    }

    /// The lease deadline of held lock `id`.
    pub(crate) fn deadline(&self, id: LockId) -> Option<Instant> {
        self.held.get(&id.0).and_then(|(_, d)| *d)
    }

    /// Runs one release of a lock this client holds, accounting its traffic. `give_back`
    /// returns whether every word was still ours; if not (or the lease deadline had passed) the
    /// release is counted as late: the conditional verbs left a successor's state alone.
    pub(crate) fn release(
        &mut self,
        id: LockId,
        give_back: impl FnOnce(&mut dyn Endpoint, T) -> Result<bool, LockError>,
    ) -> Result<(), LockError> {
        let (held, deadline) = self.held.remove(&id.0).ok_or(LockError::NotHeld(id))?;
        let late = deadline.is_some_and(|d| Instant::now() >= d);
        let before = self.endpoint.stats();
        let result = give_back(&mut *self.endpoint, held);
        add_traffic(
            &mut self.stats.release,
            &self.endpoint.stats().since(&before),
        );
        let ours = result?;
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

fn add_traffic(into: &mut EndpointStats, delta: &EndpointStats) {
    into.round_trips += delta.round_trips;
    into.verbs += delta.verbs;
    into.atomics += delta.atomics;
    into.bytes_read += delta.bytes_read;
    into.bytes_written += delta.bytes_written;
}
