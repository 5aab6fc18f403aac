//! `CitronFs`: the client library's facade, and `Inner`, the parts its calls share.
//!
//! `CitronFs` is the one public type. Its calls are implemented by concern, each in a module
//! that owns no state of its own and reads top-down into the parts below it:
//!
//! | module | calls |
//! | --- | --- |
//! | `namespace` | `lookup`, `getattr`, `setattr`, `mknod`, `create`, `open`, `release`, `mkdir`, `unlink`, `rmdir`, `rename`, `link`, `symlink`, `readlink`, `readdir`, `statfs`, xattrs |
//! | `io` | `read`, `write`, `fallocate`, `seek`, `fsync`, truncation |
//! | `fcntl` | `getlk`, `setlk`, `release_records`, `check_record_locks`, `wants_flush` |
//!
//! `Inner` holds one part per concept, each a struct with private state and a narrow API:
//!
//! | part | module | owns |
//! | --- | --- | --- |
//! | `Meta` | `meta` | the meta-server connection, the session and its heartbeat |
//! | `Views` | `view` | the cluster as this client sees it now (session, layout, connectors), replaced when a server restarts; the outage bound of a call |
//! | `HandleTable` | `handles` | the file-handle table and the open-inode table (`Open`/`Release` pairing, lingering opens) |
//! | `WorkerPool` | `workers` | per-thread data-path state: endpoints, batches, the lease of the lock held, a `LockCache` (`lock_cache`) of range-lock handles |
//! | `RecordOwners` | `records` | which owners hold record (`fcntl`) locks of which files |
//! | `IoCounters` | `io_stats` | the data path's fabric round trips |
//!
//! Below the parts, without state of their own: `locked_io` (one locked I/O: acquire with the
//! FCB words, body, release), `transfer` (the data verbs of one I/O), `fcb` (the file control
//! block's words), `chunks` (an open file's chunk-location cache), `dentries` (one-sided
//! lookups), `plan` (byte-range arithmetic), `locks` (how a scheme's lock is opened),
//! `servers` (fabric connectors).
//!
//! `Inner`'s own methods are the few that need several parts at once: a worker of the current
//! view (`Inner::checkout`), an open of the current session (`Inner::live_inode`), chunk
//! locations (`Inner::chunk_locations`), and redoing an I/O after a failure
//! (`Inner::retry`, `Inner::recover`).
//!
//! # Threads and state
//!
//! `CitronFs` is `Send + Sync` and shared by many threads through one `Arc<Inner>`. Shared state
//! is only: the meta connection (one mutex, namespace calls and opens only), the handle and
//! open-inode tables (a `RwLock` read per data call, a mutex per open and close), the worker
//! pool (a mutex for one push or pop per call, never held across I/O) and each open inode's
//! chunk cache (a `RwLock`). Everything that talks to the fabric — endpoints and range-lock
//! handles — belongs to one worker at a time.

use crate::chunks::{ChunkLocator, ChunkRun};
use crate::error::Error;
use crate::fcb::read_fcb;
use crate::handles::{HandleTable, OpenInode};
use crate::io_stats::{IoCounters, IoStats};
use crate::lock_cache::LockSetup;
use crate::meta::{Heartbeat, Meta};
use crate::options::MountOptions;
use crate::plan::Geometry;
use crate::records::RecordOwners;
use crate::view::{View, Views};
use crate::workers::{Checkout, WorkerPool};
use lockmgr::LockScheme;
use lockmgr::LockStats;
use proto::{Caller, ClusterInfo};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often one read or write is retried under a new lock after its lease ran out.
const LEASE_RETRIES: u32 = 3;

/// The pause before the first redo after a failure below the file system; the pauses double
/// up to half a second, within the call's bound (`view::DATA_SERVER_WAIT`).
const FIRST_PAUSE: Duration = Duration::from_millis(20);

/// A connected CitronFS client. `Send + Sync`: share it (in an `Arc`) between threads.
pub struct CitronFs {
    pub(crate) inner: Arc<Inner>,
    _heartbeat: Heartbeat,
}

/// What every call shares: fixed facts about the cluster, set at connect, and one part per
/// concept (see the module docs).
pub(crate) struct Inner {
    /// The meta-server connection (namespace calls, opens, chunk allocation, fences).
    pub(crate) meta: Arc<Meta>,
    /// Chunk size and lock unit: fixed for the life of the mount (a meta server that comes
    /// back with others is refused).
    pub(crate) geometry: Geometry,
    /// The range-lock scheme of every read and write.
    pub(crate) scheme: LockScheme,
    /// The mode of a read's range lock ([`MountOptions::read_locks`]).
    pub(crate) read_locks: lockmgr::LockMode,
    /// The cluster as this client sees it now.
    pub(crate) views: Views,
    /// File handles and the inodes open on this client.
    pub(crate) files: Arc<HandleTable>,
    /// The per-thread data-path state.
    pub(crate) pool: WorkerPool,
    /// The data path's fabric traffic ([`CitronFs::io_stats`]).
    pub(crate) io: IoCounters,
    /// Which owners may hold record locks of which files.
    pub(crate) records: Arc<RecordOwners>,
}

impl CitronFs {
    /// Connects to the cluster: opens the session (renewed by a heartbeat thread at a third of
    /// the lease), and attaches to the meta region and every data server's region through the
    /// fabric the meta server names.
    pub fn connect(opts: MountOptions) -> Result<CitronFs, Error> {
        let (meta, info) = Meta::connect(&opts.meta_addr, &opts.cluster, &opts.token, &opts.host)?;
        let meta = Arc::new(meta);
        let files = Arc::new(HandleTable::new(opts.scheme));
        meta.set_riders(files.clone());
        let geometry = Geometry::new(info.chunk_size, info.lock_unit)?;
        // Often enough for the session lease, and for a fence (which revokes sessions silent
        // for `fence_after`) never to take this live client for a stopped one.
        let heartbeat = Heartbeat::start(
            meta.clone(),
            (Duration::from_millis(info.session_lease_ms) / 3)
                .min(Duration::from_millis(info.fence_after_ms) / 4),
        )?;
        let lease_guard = 2 * Duration::from_millis(info.fence_after_ms);
        let view = View::first(info, &opts)?;
        let pool = WorkerPool::new(
            LockSetup {
                scheme: opts.scheme,
                hosting: opts.lock_hosting,
                meta: meta.clone(),
            },
            lease_guard,
        );
        let inner = Arc::new(Inner {
            meta: meta.clone(),
            geometry,
            scheme: opts.scheme,
            read_locks: opts.read_locks,
            views: Views::new(meta, opts, geometry, view),
            files,
            pool,
            io: IoCounters::default(),
            records: Arc::default(),
        });
        inner.meta.on_new_session(inner.records.clone());
        // Open one worker now so that a fabric that cannot be reached fails the connect.
        drop(inner.checkout()?);
        Ok(CitronFs {
            inner,
            _heartbeat: heartbeat,
        })
    }

    /// This client's range-lock statistics, summed over its workers' lock handles (those of
    /// closed files included). Handles checked out by a call in progress are not counted until
    /// it returns.
    pub fn lock_stats(&self) -> LockStats {
        self.inner.pool.lock_stats()
    }

    /// The fabric round trips of this client's locked I/Os so far (reads, writes, fallocate,
    /// truncate): all of them, and those of the range lock. Counted as each I/O finishes.
    pub fn io_stats(&self) -> IoStats {
        self.inner.io.snapshot()
    }

    /// What the meta server told this client about the cluster, as of this client's current
    /// view (a reconnection or a change of the data servers brings a newer one).
    pub fn cluster(&self) -> ClusterInfo {
        self.inner.views.installed().info.clone()
    }

    /// Whether this client's connection to the meta server runs over the server's local Unix
    /// socket (`proto::stream`; offered on the shm fabric) rather than tcp.
    pub fn meta_is_local(&self) -> bool {
        self.inner.meta.is_local()
    }

    /// Makes the meta server's cheapest request (`Request::Cluster`, which reads nothing but
    /// settings) once, and waits for its answer: what one round trip of the RPC transport
    /// costs this client, without FUSE and without a handler worth the name (`bench meta`'s
    /// `rpc` row). It is counted as a request like any other.
    pub fn meta_round_trip(&self) -> Result<(), Error> {
        match self.inner.meta.call(proto::rpc::Request::Cluster)? {
            proto::rpc::Response::Cluster(_) => Ok(()),
            other => Err(crate::meta::unexpected("cluster", other)),
        }
    }

    /// The client is going away (its mount is being unmounted, its process told to stop):
    /// from now on a server that is away fails the call at once — the data path's recovery,
    /// the wait for a data server to come back and the meta server's reconnection are cut
    /// short. With a live cluster nothing changes. Without it, a client whose cluster died
    /// (an embedded cluster's process, killed) held each request in flight at the unmount for
    /// the whole recovery budget, one after another, and took more than a minute to exit
    /// (`tools/tests/workloads.rs`). Dropping the client does this too.
    pub fn shutting_down(&self) {
        self.inner.meta.close();
    }

    /// The lock scheme every read and write uses.
    pub fn scheme(&self) -> LockScheme {
        self.inner.scheme
    }

    /// The credentials of this process (for callers without others).
    pub fn process_caller() -> Caller {
        // SAFETY: geteuid and getegid cannot fail and touch no memory.
        unsafe {
            Caller {
                uid: libc::geteuid(),
                gid: libc::getegid(),
            }
        }
    }
}

impl Inner {
    /// A worker for one call, of the current view ([`WorkerPool::checkout`]).
    pub(crate) fn checkout(&self) -> Result<Checkout<'_>, Error> {
        self.pool.checkout(&self.views, &self.files)
    }

    /// `inode` as open in `view`'s session: itself, or reopened if it was opened in an earlier
    /// session, which a restart of the meta server ended (`view`'s invariants: file control
    /// blocks and lock states live in the meta server's region, laid out afresh by a restart).
    pub(crate) fn live_inode(
        &self,
        inode: &Arc<OpenInode>,
        view: &View,
    ) -> Result<Arc<OpenInode>, Error> {
        // A closed inode still in use was replaced by a reopen (`reopen_foreign`): the table
        // has the open to use now.
        if inode.session == view.session() && !inode.closed.load(Ordering::Relaxed) {
            return Ok(inode.clone());
        }
        self.files.reopen(&self.meta, inode.ino, view)
    }

    /// Where chunks of bytes `[off, off + len)` of `inode` live, for file generation
    /// `generation` ([`ChunkLocator::locate`]); with `allocate`, holes are allocated. A file
    /// whose layout changed under an allocation has its FCB read again on a worker of its own.
    pub(crate) fn chunk_locations(
        &self,
        view: &View,
        inode: &OpenInode,
        generation: u64,
        off: u64,
        len: usize,
        allocate: bool,
    ) -> Result<ChunkRun, Error> {
        let locator = ChunkLocator {
            meta: &self.meta,
            geometry: &self.geometry,
            epoch: self.views.chunk_epoch(),
            view,
        };
        locator.locate(&inode.chunks, generation, off, len, allocate, || {
            let mut w = self.checkout()?;
            Ok(read_fcb(&mut w, inode)?.generation)
        })
    }

    /// Runs `op` (one whole locked read or write) again when its lock's lease ran out before
    /// its verbs were done, up to [`LEASE_RETRIES`] times: a stalled client gets a fresh lock
    /// rather than an error, and only one that keeps stalling sees EIO. With `redo`, also after
    /// a failure below the file system, once the client has caught up with the cluster, until
    /// the call's bound runs out ([`Views::data_deadline`]: `DATA_SERVER_WAIT` after
    /// `started`, when the call began; see the module docs). No attempt starts after it; one
    /// that finds a data server still away in an outage older than the bound fails once the
    /// client has caught up (`recover`), without waiting.
    pub(crate) fn retry<T>(
        &self,
        started: Instant,
        redo: bool,
        mut op: impl FnMut() -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut lease_retries = 0;
        let mut recoveries = 0;
        let mut pause = FIRST_PAUSE;
        loop {
            // An atomic load: the session's id sits behind a mutex, and this runs every I/O.
            let generation = self.meta.generation();
            match op() {
                // Fenced: the fabric servers refuse this session's verbs for good (a lock it
                // held was broken while it was stopped or cut off). This I/O fails — its verbs
                // may have landed in part before the fence — and the client joins again in a
                // new session for the next ones, unless it has already.
                Err(e) if e.is_fenced() => {
                    self.meta.session_ended(generation);
                    return Err(e);
                }
                Err(Error::LeaseLost) if lease_retries < LEASE_RETRIES => {
                    lease_retries += 1;
                    tracing::warn!(
                        attempt = lease_retries,
                        "range lock lease ran out mid-I/O; retrying under a new lock"
                    );
                }
                // Not once the client is going away (`CitronFs::shutting_down`): a cluster
                // that died with the process that started it would hold every request in
                // flight at the unmount for the whole budget, one after another per worker.
                Err(e)
                    if redo
                        && e.is_transient()
                        && !self.meta.is_closing()
                        && Instant::now() < self.views.data_deadline(started, None) =>
                {
                    recoveries += 1;
                    tracing::warn!(
                        attempt = recoveries,
                        error = %crate::error::Chain(&e),
                        "I/O failed below the file system; catching up with the cluster and \
                         redoing it"
                    );
                    if recoveries > 1 {
                        let left = self
                            .views
                            .data_deadline(started, None)
                            .saturating_duration_since(Instant::now());
                        std::thread::sleep(pause.min(left));
                        pause = (pause * 2).min(Duration::from_millis(500));
                    }
                    self.recover(e, started)?;
                }
                other => return other,
            }
        }
    }

    /// Catches up with the cluster after `failure` ([`Views::recover`]); a file control block
    /// found to be another file's is mended by opening the file anew
    /// ([`HandleTable::reopen_foreign`]), whose new block must then be the file's.
    pub(crate) fn recover(&self, failure: Error, started: Instant) -> Result<Arc<View>, Error> {
        self.views.recover(failure, started, |ino, fcb, view| {
            self.files
                .reopen_foreign(&self.meta, ino, fcb, view, |inode| {
                    let mut w = self.checkout()?;
                    read_fcb(&mut w, inode).map(drop)
                })
        })
    }
}

impl Drop for CitronFs {
    /// Gives back what this client still has open in its current session, on its current
    /// connection only: the session ends with the connection, and the opens with it. No call
    /// here waits for a meta server that is away: each release reconnecting for
    /// `RECONNECT_WAIT` made a client of a dead cluster take a minute and more to exit (one
    /// wait per open file; seen in `tools/tests/workloads.rs`).
    fn drop(&mut self) {
        let meta = &self.inner.meta;
        meta.close();
        let session = meta.session();
        for inode in self.inner.files.take_all_open() {
            if inode.session == session {
                let released = meta.call_connected(proto::rpc::Request::Release { ino: inode.ino });
                if matches!(released, None | Some(Err(Error::Rpc { .. }))) {
                    // The connection broke: the session, and every open in it, ended.
                    break;
                }
            }
        }
    }
}
