//! The `mutex` baseline: one ticket lock for the whole address space. Every range conflicts
//! with every other; this is what an inode mutex gives a file system, and the floor every range
//! lock should beat under concurrency.

use super::ticket::{TicketConfig, TicketLock};
use super::ClientCore;
use crate::scheme::{check_range, LockError, LockId, RangeLock};
use crate::schemes::{LockMemory, LockScheme};
use crate::stats::LockStats;
use fabric::{Batch, Completions, Connector, Endpoint, RemoteAddr};
use std::ops::Range;

/// The shared state of one `mutex` instance: where its lock word is. Cheap to copy; every
/// client (thread or process) that knows it can open a handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MutexScheme {
    lock: TicketLock,
    config: TicketConfig,
}

impl MutexScheme {
    /// Bytes of registered memory the instance occupies at its base address.
    pub const REGION_BYTES: u64 = 8;

    /// Creates the instance at `base` (8-byte aligned, [`Self::REGION_BYTES`] bytes), resetting
    /// the lock word to free. Only while no client uses it.
    pub fn create(
        endpoint: &mut dyn Endpoint,
        base: RemoteAddr,
        config: TicketConfig,
    ) -> Result<Self, LockError> {
        let scheme = Self::attach(base, config);
        scheme.lock.init(endpoint)?;
        Ok(scheme)
    }

    /// `mutex` for [`crate::schemes::create`]: takes its word from `memory` and sets it unlocked.
    /// Returns the base address and the bytes taken.
    pub(crate) fn create_in(memory: &mut dyn LockMemory) -> Result<(RemoteAddr, u64), LockError> {
        let base = memory.allocate(Self::REGION_BYTES)?;
        Self::create(memory.endpoint(), base, TicketConfig::default())?;
        Ok((base, Self::REGION_BYTES))
    }

    /// Describes an instance that another client already created at `base`.
    pub fn attach(base: RemoteAddr, config: TicketConfig) -> Self {
        Self {
            lock: TicketLock::new(base),
            config,
        }
    }

    /// The lock word's address.
    pub fn addr(&self) -> RemoteAddr {
        self.lock.addr
    }

    /// Opens a handle for one thread, with its own endpoint from `connector`.
    pub fn open(&self, connector: &dyn Connector) -> Result<MutexLock, LockError> {
        Ok(self.open_with(connector.connect()?))
    }

    /// Opens a handle for one thread over `endpoint`.
    pub fn open_with(&self, endpoint: Box<dyn Endpoint>) -> MutexLock {
        MutexLock {
            scheme: self.clone(),
            core: ClientCore::new(endpoint),
        }
    }
}

/// One thread's handle on a `mutex` instance.
pub struct MutexLock {
    scheme: MutexScheme,
    core: ClientCore<u32>,
}

impl MutexLock {
    /// An acquisition carrying `extra` ([`RangeLock::acquire_with`]) in the ticket lock's own
    /// batches (`ClientCore::acquire_carrying`).
    fn take(
        &mut self,
        range: Range<u64>,
        extra: &Batch,
        out: &mut Completions,
    ) -> Result<LockId, LockError> {
        check_range(&range)?;
        let lock = self.scheme.lock;
        let config = &self.scheme.config;
        self.core
            .acquire_carrying(extra, out, |endpoint, rng, stats| {
                let outcome = lock.acquire(endpoint, config, rng)?;
                stats.recoveries += outcome.recoveries;
                stats.passed_over += outcome.passed_over;
                Ok((outcome.ticket, outcome.deadline))
            })
    }

    /// A release carrying `extra` ([`RangeLock::release_with`]). With a lease, a release
    /// after the lease deadline is a conditional masked CAS that leaves a lock broken meanwhile
    /// alone; it returns `Ok` and is counted in [`LockStats::late_releases`].
    fn give_back(
        &mut self,
        id: LockId,
        extra: &Batch,
        out: &mut Completions,
    ) -> Result<(), LockError> {
        let lock = self.scheme.lock;
        let config = &self.scheme.config;
        self.core
            .release_carrying(id, extra, out, |endpoint, ticket| {
                lock.release(endpoint, config, ticket)
            })
    }
}

impl RangeLock for MutexLock {
    crate::carry::carrying_lock_methods!();

    /// The release's batch carries `extra` at its head.
    fn release_carries_verbs(&self) -> bool {
        true
    }

    fn lease_deadline(&self, id: LockId) -> Option<std::time::Instant> {
        self.core.deadline(id)
    }

    fn stats(&self) -> LockStats {
        self.core.stats
    }

    fn scheme(&self) -> &'static str {
        LockScheme::MUTEX.name()
    }
}
