//! The pool of per-thread data-path state.
//!
//! What one call needs to move data — an endpoint to the meta region, endpoints to the data
//! servers, a range-lock handle per open file, a batch and its completions — lives in a
//! [`Worker`], checked out of the [`WorkerPool`] for the duration of one call and put back
//! after it ([`Checkout`]).
//!
//! Invariants:
//! - No two threads ever share an endpoint or a lock handle: a worker belongs to exactly one
//!   call at a time. The pool's mutex is held for a push or a pop, never across I/O.
//! - A worker whose endpoint or lock handle failed is marked `broken` and dropped instead of
//!   being put back (its connections' state is unknown), so the next call opens fresh ones;
//!   the statistics of its lock handles are kept in the pool's retired total.
//! - A worker drops the lock handles of files closed since its last checkout (the close epoch,
//!   see `handles`) when it is checked out, before any use.
//! - A worker belongs to one `view`: its endpoints and lock handles were made from that view's
//!   connectors. A worker of an older view is dropped at checkout, never reused.

use crate::error::{Error, Peer};
use crate::handles::HandleTable;
use crate::lock_cache::{LockCache, LockSetup};
use crate::view::{View, Views};
use fabric::{Batch, Completions, Endpoint};
use lockmgr::LockStats;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Idle workers, and the statistics of lock handles no worker holds any more.
pub(crate) struct WorkerPool {
    /// What new workers' lock handles are opened with.
    locks: LockSetup,
    /// How much of a lock's lease must be left to post data verbs (twice the cluster's
    /// `fence_after`; see [`Worker::check_lease_before_post`]).
    lease_guard: Duration,
    idle: Mutex<Vec<Worker>>,
    /// Statistics of lock handles already dropped (closed files, broken workers), so that
    /// [`crate::CitronFs::lock_stats`] keeps counting them.
    retired_lock_stats: Mutex<LockStats>,
}

impl WorkerPool {
    /// An empty pool whose workers open lock handles with `locks` and post changes only with
    /// `lease_guard` of their lock's lease left.
    pub(crate) fn new(locks: LockSetup, lease_guard: Duration) -> WorkerPool {
        WorkerPool {
            locks,
            lease_guard,
            idle: Mutex::default(),
            retired_lock_stats: Mutex::default(),
        }
    }

    /// Counts `stats` of lock handles being dropped.
    pub(crate) fn retire(&self, stats: &LockStats) {
        self.retired_lock_stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .merge(stats);
    }

    /// The retired statistics plus those of every idle worker's lock handles.
    pub(crate) fn lock_stats(&self) -> LockStats {
        let mut total = *self
            .retired_lock_stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        for w in idle.iter() {
            w.locks.merge_stats(&mut total);
        }
        total
    }
}

/// One thread's data-path state (see the module docs).
pub(crate) struct Worker {
    /// The view this worker's endpoints and lock handles were made from.
    pub(crate) view: Arc<View>,
    pub(crate) meta_ep: Box<dyn Endpoint>,
    /// Indexed by data server id; connected on first use.
    data_eps: Vec<Option<Box<dyn Endpoint>>>,
    /// This worker's range-lock handles.
    pub(crate) locks: LockCache,
    /// The close epoch this worker's lock handles were last pruned at.
    close_epoch: u64,
    pub(crate) batch: Batch,
    pub(crate) out: Completions,
    /// A write's FCB raises (`fcb::FcbRaises`), which travel beside its data batches while
    /// `batch` and `out` serve the first of them; kept so that no write allocates them.
    pub(crate) raises: Batch,
    /// The raises' results.
    pub(crate) raises_out: Completions,
    /// An endpoint or lock handle of this worker failed: drop it rather than reuse it.
    pub(crate) broken: bool,
    /// The lease deadline of the range lock this worker holds now (`None`: no lock, or one
    /// that is never broken). See [`Worker::check_lease_before_post`]; its batches expire at
    /// [`Worker::expires`].
    pub(crate) lease: Option<Instant>,
    /// How much of the lease must be left to post a change (the pool's `lease_guard`).
    lease_guard: Duration,
    /// Whether part of the change made under the range lock held now may have reached the
    /// file: a data batch of a write, an FCB raise or a locked call was sent. From then on a
    /// lost lease fails the change instead of redoing it (`locked_io::locked`).
    pub(crate) changed: bool,
    /// How the change under the range lock held now records itself as a replicated write in
    /// flight (`cut_repair`).
    pub(crate) cut: CutRecord,
}

/// A worker's record of the replicated write in flight under the lock it holds (`cut_repair`).
#[derive(Debug, Default)]
pub(crate) struct CutRecord {
    /// Set under an exclusive lock, before its body: what a write needs to record itself.
    pub(crate) armed: Option<Armed>,
    /// How the change recorded itself, once it did: its release undoes it.
    pub(crate) made: Option<Made>,
}

/// What a write under an exclusive lock needs to record itself (`cut_repair::before_write`).
#[derive(Debug)]
pub(crate) struct Armed {
    /// The file's control block.
    pub(crate) fcb: fabric::RemoteAddr,
    /// The lock's units (what a slot records).
    pub(crate) units: std::ops::Range<u64>,
    /// The slots the granting batch found free, a bit each.
    pub(crate) free: u32,
}

/// How a change recorded itself as a replicated write in flight.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Made {
    /// It holds the slot at `addr` with `value`: the release clears it.
    Slot {
        /// The slot's address.
        addr: fabric::RemoteAddr,
        /// Its value ([`proto::fcb::pack_slot`]).
        value: u64,
    },
    /// It added 1 to BEGUN: the release adds 1 to ENDED.
    Counted,
}

impl Worker {
    /// When the batches this worker posts under its lock expire (`fabric::Batch::expire_at`):
    /// `lease_guard / 2` before the lease deadline (`None` without a lease).
    ///
    /// Why earlier than the deadline: past its expiry no verb of a batch starts at the server,
    /// and an endpoint waits for the reply only [`fabric::REPLY_AFTER_EXPIRY`] longer. So a
    /// holder whose data server went silent (a cut link, a stopped host) gets its call back
    /// while the lease still runs and releases the lock in time: the next holder finds the
    /// range free instead of starving on bits left for lazy recovery (one `T_lease` or more).
    /// A batch expiring at the deadline itself would be given up only at it, and released
    /// late. Posts need `lease_guard` left ([`Worker::check_lease_before_post`]), so a batch
    /// always has at least `lease_guard / 2` to execute in.
    pub(crate) fn expires(&self) -> Option<Instant> {
        self.lease
            .map(|d| d.checked_sub(self.lease_guard / 2).unwrap_or(d))
    }

    /// Fencing, client side (docs/ARCHITECTURE.md "Fencing"): data verbs that change the file are posted
    /// only while the guarding lock's lease has more than `lease_guard` left, so that they
    /// execute before any other client can break the lock. The guard is twice the cluster's
    /// `fence_after`: a client stopped between this check and its post for long enough to
    /// land late is silent that long, and the breaker's `Fence` revokes it first (tcp).
    pub(crate) fn check_lease_before_post(&self) -> Result<(), Error> {
        match self.lease {
            Some(deadline) if Instant::now() + self.lease_guard > deadline => Err(Error::LeaseLost),
            _ => Ok(()),
        }
    }

    /// Reads are validated after the fact: data read before the lease deadline was read under
    /// the lock; data read later may mix in another client's write.
    pub(crate) fn check_lease_after_read(&self) -> Result<(), Error> {
        match self.lease {
            Some(deadline) if Instant::now() >= deadline => Err(Error::LeaseLost),
            _ => Ok(()),
        }
    }

    /// Executes `self.batch` on the meta endpoint, one round trip, results in `self.out`; a
    /// failure marks the worker broken (the endpoint's state is unknown).
    pub(crate) fn exec_meta(&mut self) -> Result<(), Error> {
        if let Err(e) = self.meta_ep.execute(&self.batch, &mut self.out) {
            self.broken = true;
            return Err(Error::fabric(Peer::Meta)(e));
        }
        Ok(())
    }

    /// Executes the raise batch (`raises`) on the meta endpoint, within the lease (it expires
    /// with it), one round trip, results in `raises_out`; a failure marks the worker broken.
    pub(crate) fn exec_raises(&mut self) -> Result<(), Error> {
        self.raises.expire_at(self.expires());
        self.changed = true;
        if let Err(e) = self.meta_ep.execute(&self.raises, &mut self.raises_out) {
            self.broken = true;
            return Err(Error::fabric(Peer::Meta)(e));
        }
        Ok(())
    }

    /// The round trips this worker's data-server endpoints have taken.
    pub(crate) fn data_round_trips(&self) -> u64 {
        self.data_eps
            .iter()
            .flatten()
            .map(|ep| ep.stats().round_trips)
            .sum()
    }

    /// This worker's endpoint to data server `server`, connected on first use — by the
    /// expiry of the batches of the lock it holds, if it holds one (`Connector::connect_by`).
    pub(crate) fn data_ep(&mut self, server: u32) -> Result<&mut dyn Endpoint, Error> {
        let id = server as usize;
        let ds = self
            .view
            .servers
            .data(server)
            .ok_or(Error::UnknownDataServer(server))?;
        if self.data_eps.len() <= id {
            self.data_eps.resize_with(id + 1, || None);
        }
        if self.data_eps[id].is_none() {
            self.data_eps[id] = Some(
                ds.connector
                    .connect_by(self.expires())
                    .map_err(Error::fabric(Peer::Data(server)))?,
            );
        }
        Ok(self.data_eps[id].as_deref_mut().expect("set above"))
    }
}

/// A worker checked out of the pool; goes back on drop unless broken.
pub(crate) struct Checkout<'a> {
    pool: &'a WorkerPool,
    worker: Option<Worker>,
}

impl std::ops::Deref for Checkout<'_> {
    type Target = Worker;
    fn deref(&self) -> &Worker {
        self.worker.as_ref().expect("present until drop")
    }
}
impl std::ops::DerefMut for Checkout<'_> {
    fn deref_mut(&mut self) -> &mut Worker {
        self.worker.as_mut().expect("present until drop")
    }
}

impl Drop for Checkout<'_> {
    fn drop(&mut self) {
        if let Some(worker) = self.worker.take() {
            if worker.broken {
                worker.locks.merge_stats(
                    &mut self
                        .pool
                        .retired_lock_stats
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner),
                );
            } else {
                self.pool
                    .idle
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(worker);
            }
        }
    }
}

impl WorkerPool {
    /// A worker for one call, of the current view: an idle one, or a new one (connected to
    /// the meta region) when none is idle. Idle workers of older views are dropped. The usual
    /// case — an idle worker of the current view — costs the pool's mutex and atomic loads.
    pub(crate) fn checkout(
        &self,
        views: &Views,
        files: &HandleTable,
    ) -> Result<Checkout<'_>, Error> {
        let mut worker = loop {
            let pooled = self
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            match pooled {
                Some(w) if views.is_current(&w.view) => break w,
                Some(w) => {
                    let mut retired = LockStats::default();
                    w.locks.merge_stats(&mut retired);
                    self.retire(&retired);
                }
                None => {
                    let view = views.current()?;
                    break Worker {
                        meta_ep: view
                            .servers
                            .meta
                            .connect()
                            .map_err(Error::fabric(Peer::Meta))?,
                        view,
                        data_eps: Vec::new(),
                        locks: LockCache::new(self.locks.clone()),
                        close_epoch: files.close_epoch(),
                        batch: Batch::new(),
                        out: Completions::new(),
                        raises: Batch::new(),
                        raises_out: Completions::new(),
                        broken: false,
                        lease: None,
                        lease_guard: self.lease_guard,
                        changed: false,
                        cut: CutRecord::default(),
                    };
                }
            }
        };
        let epoch = files.close_epoch();
        if worker.close_epoch != epoch {
            // Without taking the open-inode table: checkouts happen while it is held
            // (open_inode).
            let retired = worker.locks.drop_closed();
            self.retire(&retired);
        }
        worker.close_epoch = epoch;
        Ok(Checkout {
            pool: self,
            worker: Some(worker),
        })
    }
}
