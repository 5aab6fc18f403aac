//! What the data path counts: [`IoStats`], the fabric round trips and time of this client's
//! locked I/Os, summed by [`IoCounters`] as each I/O finishes (`locked_io`).

use crate::workers::Worker;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The fabric traffic of the data path: what `CitronFs::io_stats` reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Locked I/Os done (each read, write, fallocate step and truncate takes one range lock;
    /// one redone after a lost lease or a failure counts again).
    pub locked_ios: u64,
    /// Fabric round trips they took, all endpoints together: the lock's, the meta region's
    /// (FCB, chunk tables) and the data servers'. RPCs to the meta server (allocating chunks)
    /// are not fabric round trips and are not counted.
    pub round_trips: u64,
    /// Those of them spent acquiring and releasing the range lock (FCB words carried in them
    /// included).
    pub lock_round_trips: u64,
    /// Nanoseconds they took, each from the start of its acquire to the end of its release:
    /// the library's own time of a read or write, wherever it is called from (a FUSE request
    /// thread, or a caller of the library), apart from looking up its handle.
    pub locked_nanos: u64,
}

impl IoStats {
    /// The counts accumulated since `earlier` was taken.
    pub fn since(&self, earlier: &IoStats) -> IoStats {
        IoStats {
            locked_ios: self.locked_ios - earlier.locked_ios,
            round_trips: self.round_trips - earlier.round_trips,
            lock_round_trips: self.lock_round_trips - earlier.lock_round_trips,
            locked_nanos: self.locked_nanos - earlier.locked_nanos,
        }
    }

    /// Mean microseconds per locked I/O (`None` when there was none).
    pub fn mean_locked_us(&self) -> Option<f64> {
        (self.locked_ios > 0).then(|| self.locked_nanos as f64 / 1e3 / self.locked_ios as f64)
    }
}

/// The client's [`IoStats`], summed by every call as it finishes its locked I/O.
#[derive(Default)]
pub(crate) struct IoCounters {
    locked_ios: AtomicU64,
    round_trips: AtomicU64,
    lock_round_trips: AtomicU64,
    locked_nanos: AtomicU64,
}

/// Where a locked I/O's counting started ([`IoCounters::start`]).
pub(crate) struct IoStart {
    /// The round trips of the worker's own endpoints (meta region, data servers) then.
    round_trips: u64,
    at: Instant,
}

impl IoCounters {
    /// Starts counting a locked I/O on `w`.
    pub(crate) fn start(&self, w: &Worker) -> IoStart {
        IoStart {
            round_trips: Self::own_round_trips(w),
            at: Instant::now(),
        }
    }

    /// The round trips `w`'s own endpoints (meta region, data servers) have taken so far.
    fn own_round_trips(w: &Worker) -> u64 {
        w.meta_ep.stats().round_trips + w.data_round_trips()
    }

    /// Counts one locked I/O on `w` started at `start`, whose lock handle took `lock_rtts`.
    pub(crate) fn finish(&self, w: &Worker, start: IoStart, lock_rtts: u64) {
        let own = Self::own_round_trips(w).saturating_sub(start.round_trips);
        let nanos = u64::try_from(start.at.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.locked_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.locked_ios.fetch_add(1, Ordering::Relaxed);
        self.round_trips
            .fetch_add(own + lock_rtts, Ordering::Relaxed);
        self.lock_round_trips
            .fetch_add(lock_rtts, Ordering::Relaxed);
    }

    /// The counts so far.
    pub(crate) fn snapshot(&self) -> IoStats {
        IoStats {
            locked_ios: self.locked_ios.load(Ordering::Relaxed),
            round_trips: self.round_trips.load(Ordering::Relaxed),
            lock_round_trips: self.lock_round_trips.load(Ordering::Relaxed),
            locked_nanos: self.locked_nanos.load(Ordering::Relaxed),
        }
    }
}
