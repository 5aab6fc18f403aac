//! A worker's range-lock handles: one per open file where each file has a lock of its own, one
//! handle on the lock service where the scheme keeps every file's lock there
//! ([`lockmgr::schemes::Placement`]). How a handle is opened is `locks`' business; this
//! module decides when.
//!
//! Invariants:
//! - A handle belongs to the worker that holds the cache, so to one call at a time (a
//!   `RangeLock` handle owns its endpoints and must not be shared between threads).
//! - A handle is reused only for the same *open* of its inode (`OpenInode::open_id`): after a
//!   last close and a new `Open`, the meta server may have moved the lock state, so a handle
//!   opened before is replaced.
//! - A handle's statistics outlive it: a replaced or dropped handle's counters are added to the
//!   pool's retired total, so `CitronFs::lock_stats` never goes backwards.

use crate::client::Inner;
use crate::error::Error;
use crate::handles::OpenInode;
use crate::locks;
use crate::view::View;
use lockmgr::{LockStats, RangeLock};
use proto::Ino;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

/// One worker's range-lock handles (see the module docs).
#[derive(Default)]
pub(crate) struct LockCache {
    /// Per open inode: the inode (weakly: closing it must free it) and this worker's lock
    /// handle on it. Unused with a lock service.
    files: HashMap<Ino, (Weak<OpenInode>, Box<dyn RangeLock>)>,
    /// The handle on the lock service (one lock space for every file).
    service: Option<Box<dyn RangeLock>>,
}

impl LockCache {
    /// This worker's lock handle for `inode` in `inner`'s scheme, opened on first use.
    pub(crate) fn handle(
        &mut self,
        inner: &Inner,
        view: &View,
        inode: &Arc<OpenInode>,
    ) -> Result<&mut Box<dyn RangeLock>, Error> {
        if inner.scheme.uses_service() {
            if self.service.is_none() {
                let at = view
                    .servers
                    .lock_service
                    .as_ref()
                    .expect("checked at connect");
                self.service = Some(
                    locks::open_service_lock(&inner.scheme, &*view.servers.meta, at)
                        .map_err(Error::lock(inode.ino))?,
                );
            }
            return Ok(self.service.as_mut().expect("set above"));
        }
        let fresh = !matches!(self.files.get(&inode.ino),
            Some((known, _)) if known.upgrade().is_some_and(|k| k.open_id == inode.open_id));
        if fresh {
            let handle = locks::open_file_lock(
                &inode.lock,
                &*view.servers.meta,
                &inner.meta,
                inode.ino,
                inner.opts.citron_hosting,
                view.session(),
            )?;
            if let Some((_, old)) = self
                .files
                .insert(inode.ino, (Arc::downgrade(inode), handle))
            {
                inner.pool.retire(&old.stats());
            }
        }
        Ok(&mut self.files.get_mut(&inode.ino).expect("inserted above").1)
    }

    /// Drops the handles of files closed (or freed) since they were opened, and returns their
    /// statistics.
    pub(crate) fn drop_closed(&mut self) -> LockStats {
        let mut retired = LockStats::default();
        self.files.retain(|_, (inode, lock)| {
            let keep = inode
                .upgrade()
                .is_some_and(|i| !i.closed.load(Ordering::Relaxed));
            if !keep {
                retired.merge(&lock.stats());
            }
            keep
        });
        retired
    }

    /// Adds the statistics of every lock handle held here into `total`.
    pub(crate) fn merge_stats(&self, total: &mut LockStats) {
        for (_, lock) in self.files.values() {
            total.merge(&lock.stats());
        }
        if let Some(lock) = &self.service {
            total.merge(&lock.stats());
        }
    }
}
