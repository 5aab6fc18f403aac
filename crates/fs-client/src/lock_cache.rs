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
//! - A handle's statistics outlive it: a replaced handle's counters are kept here until the
//!   cache gives them to the pool's retired total (at a prune, or when the worker goes), and a
//!   dropped handle's go there at once, so `CitronFs::lock_stats` never goes backwards.

use crate::error::Error;
use crate::handles::OpenInode;
use crate::locks;
use crate::meta::Meta;
use crate::view::View;
use lockmgr::schemes::Hosting;
use lockmgr::{LockScheme, LockStats, RangeLock};
use proto::Ino;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

/// What every lock handle of a mount is opened with.
#[derive(Clone)]
pub(crate) struct LockSetup {
    /// The mount's range-lock scheme.
    pub(crate) scheme: LockScheme,
    /// Where range locks are acquired (`MountOptions::lock_hosting`).
    pub(crate) hosting: Hosting,
    /// The meta-server connection (lock-tree allocation, fences).
    pub(crate) meta: Arc<Meta>,
}

/// One worker's range-lock handles (see the module docs).
pub(crate) struct LockCache {
    /// How handles are opened.
    setup: LockSetup,
    /// Per open inode: the inode (weakly: closing it must free it) and this worker's lock
    /// handle on it. Unused with a lock service.
    files: HashMap<Ino, (Weak<OpenInode>, Box<dyn RangeLock>)>,
    /// The handle on the lock service (one lock space for every file).
    service: Option<Box<dyn RangeLock>>,
    /// Statistics of handles replaced here, not yet handed to the pool's retired total.
    retired: LockStats,
}

impl LockCache {
    /// No handles yet; they are opened with `setup`.
    pub(crate) fn new(setup: LockSetup) -> LockCache {
        LockCache {
            setup,
            files: HashMap::new(),
            service: None,
            retired: LockStats::default(),
        }
    }

    /// The mount's range-lock scheme.
    pub(crate) fn scheme(&self) -> &LockScheme {
        &self.setup.scheme
    }

    /// This worker's lock handle for `inode` in the mount's scheme, opened on first use.
    pub(crate) fn handle(
        &mut self,
        view: &View,
        inode: &Arc<OpenInode>,
    ) -> Result<&mut Box<dyn RangeLock>, Error> {
        if self.setup.scheme.uses_service() {
            if self.service.is_none() {
                let at = view
                    .servers
                    .lock_service
                    .as_ref()
                    .expect("checked at connect");
                self.service = Some(
                    locks::open_service_lock(&self.setup.scheme, &*view.servers.meta, at)
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
                &self.setup.meta,
                inode.ino,
                self.setup.hosting,
                view.session(),
            )?;
            if let Some((_, old)) = self
                .files
                .insert(inode.ino, (Arc::downgrade(inode), handle))
            {
                self.retired.merge(&old.stats());
            }
        }
        Ok(&mut self.files.get_mut(&inode.ino).expect("inserted above").1)
    }

    /// Drops the handles of files closed (or freed) since they were opened, and returns their
    /// statistics with those of the handles replaced since the last prune.
    pub(crate) fn drop_closed(&mut self) -> LockStats {
        let mut retired = std::mem::take(&mut self.retired);
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

    /// Adds the statistics of every lock handle held here (and of those replaced here since
    /// the last prune) into `total`.
    pub(crate) fn merge_stats(&self, total: &mut LockStats) {
        total.merge(&self.retired);
        for (_, lock) in self.files.values() {
            total.merge(&lock.stats());
        }
        if let Some(lock) = &self.service {
            total.merge(&lock.stats());
        }
    }
}
