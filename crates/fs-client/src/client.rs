//! [`CitronFs`]: the client library's facade, and the state its parts share.
//!
//! `CitronFs` is the one public type; its calls are implemented next to the concept they use:
//!
//! | module | calls | owns |
//! | --- | --- | --- |
//! | `namespace` | `lookup`, `getattr`, `setattr`, `mknod`, `create`, `mkdir`, `unlink`, `rmdir`, `rename`, `link`, `symlink`, `readlink`, `readdir`, `statfs`, xattrs | nothing: RPC wrappers over the meta connection |
//! | `handles` | `open`, `release`, `handle_ino` | the file-handle table and the open-inode table (`Open`/`Release` pairing) |
//! | `io` | `read`, `write`, `fsync` | the locked I/O: lock, check the lease, post verbs, release |
//! | `records` | `getlk`, `setlk`, `release_records` | which owners may hold record (`fcntl`) locks of which files |
//! | `workers` | — | the pool of per-thread data-path state (endpoints, batches, lock handles) |
//! | `lock_cache` | — | a worker's range-lock handles, one per open file |
//! | `fcb` | — | reads of a file control block and raises of its SIZE |
//! | `chunks` | — | the per-inode cache of chunk locations |
//! | `servers` | — | the connectors to the fabric servers (`connector_for`) and the lock server's address |
//! | `view` | — | the cluster as this client sees it now (session, layout, connectors), replaced when a server restarts |
//!
//! This module connects (assembles `Inner` from those parts), sums lock statistics, and gives
//! back what is still open when the client is dropped.
//!
//! # Threads and state
//!
//! `CitronFs` is `Send + Sync` and shared by many threads through one `Arc<Inner>`. Shared state
//! is only: the meta connection (one mutex, namespace calls and opens only), the handle and
//! open-inode tables (a `RwLock` read per data call, a mutex per open and close), the worker
//! pool (a mutex for one push or pop per call, never held across I/O) and each open inode's
//! chunk cache (a `RwLock`). Everything that talks to the fabric — endpoints and range-lock
//! handles — belongs to one worker at a time.

use crate::error::Error;
use crate::handles::HandleTable;
use crate::meta::{Heartbeat, Meta};
use crate::plan::Geometry;
use crate::view::View;
use crate::workers::WorkerPool;
use lockmgr::citron::Hosting;
use lockmgr::LockScheme;
use lockmgr::LockStats;
use proto::{Caller, ClusterInfo};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

/// How to reach a cluster and how to lock files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountOptions {
    /// The meta server's RPC address (`host:port`).
    pub meta_addr: String,
    /// The cluster's name.
    pub cluster: String,
    /// The cluster's shared secret.
    pub token: String,
    /// The range-lock scheme of every read and write (`citron` by default).
    pub scheme: LockScheme,
    /// This client's host name, for the meta server's logs.
    pub host: String,
    /// How long connecting to a tcp fabric server and one batch of verbs may take before a
    /// silent server (a cut link, a frozen host) fails the call with EIO instead of blocking
    /// it ([`fabric::TcpTimeouts::DEFAULT`]: 5 s each).
    pub fabric_timeouts: fabric::TcpTimeouts,
    /// Where CITRON locks are acquired: by default ([`Hosting::Auto`]) at the meta server,
    /// which hosts the lock trees, where it offers that (tcp: one call per acquisition, the
    /// release posted, the meta server fencing and scaling up on the client's behalf), and
    /// one-sided otherwise. [`Hosting::Never`] acquires one-sided always (tests that kill a
    /// client in the middle of the protocol).
    pub citron_hosting: Hosting,
}

impl MountOptions {
    /// The cluster credentials every server checks in the handshake.
    pub fn credentials(&self) -> fabric::Credentials {
        fabric::Credentials::new(self.cluster.clone(), self.token.clone())
    }

    /// Options for the cluster at `meta_addr` with the default scheme (`citron`).
    pub fn new(
        meta_addr: impl Into<String>,
        cluster: impl Into<String>,
        token: impl Into<String>,
    ) -> MountOptions {
        MountOptions {
            meta_addr: meta_addr.into(),
            cluster: cluster.into(),
            token: token.into(),
            scheme: LockScheme::default(),
            host: hostname(),
            fabric_timeouts: fabric::TcpTimeouts::DEFAULT,
            citron_hosting: Hosting::Auto,
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// A file handle returned by [`CitronFs::open`] and [`CitronFs::create`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileHandle(pub u64);

/// A connected CitronFS client. `Send + Sync`: share it (in an `Arc`) between threads.
pub struct CitronFs {
    pub(crate) inner: Arc<Inner>,
    _heartbeat: Heartbeat,
}

/// What every call shares: fixed facts about the cluster, set at connect, and one part per
/// concept (each documented in its module).
pub(crate) struct Inner {
    /// The meta-server connection (namespace calls, opens, chunk allocation, fences).
    pub(crate) meta: Arc<Meta>,
    /// How much of a lock's lease must be left to post data verbs (twice the cluster's
    /// `fence_after`; see `io`'s `check_lease_before_post`).
    pub(crate) lease_guard: Duration,
    /// Chunk size and lock unit: fixed for the life of the mount (a meta server that comes
    /// back with others is refused).
    pub(crate) geometry: Geometry,
    pub(crate) scheme: LockScheme,
    /// How this client was asked to connect (for reconnections).
    pub(crate) opts: MountOptions,
    /// The cluster as this client sees it now: session, layout, connectors (`view`).
    pub(crate) view: RwLock<Arc<View>>,
    /// Serializes building new views.
    pub(crate) view_refresh: Mutex<()>,
    /// The installed view's id: a worker whose view has it (and is still current, see
    /// `view`) is used without touching `view`'s lock or count.
    pub(crate) view_id: AtomicU64,
    /// The view id chunk caches must be of: a cache learnt under an older view is emptied
    /// (`chunks`), since a data server may have lost its chunks meanwhile.
    pub(crate) chunk_epoch: AtomicU64,
    /// File handles and the inodes open on this client.
    pub(crate) files: Arc<HandleTable>,
    /// The per-thread data-path state.
    pub(crate) pool: WorkerPool,
    /// The data path's fabric traffic ([`CitronFs::io_stats`]).
    pub(crate) io: crate::io::IoCounters,
    /// Which owners may hold record locks of which files (`records`).
    pub(crate) records: Arc<crate::records::RecordOwners>,
    /// Since when each data server that a call found unregistered has been away, by id
    /// (`view`'s [`Inner::data_deadline`]); a view that has it live again clears it.
    pub(crate) data_away: Mutex<HashMap<u32, Instant>>,
}

impl CitronFs {
    /// Connects to the cluster: opens the session (renewed by a heartbeat thread at a third of
    /// the lease), and attaches to the meta region and every data server's region through the
    /// fabric the meta server names.
    pub fn connect(opts: MountOptions) -> Result<CitronFs, Error> {
        let (meta, info) = Meta::connect(&opts.meta_addr, &opts.cluster, &opts.token, &opts.host)?;
        let meta = Arc::new(meta);
        let files = Arc::new(HandleTable::default());
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
        let inner = Arc::new(Inner {
            lease_guard,
            meta,
            geometry,
            scheme: opts.scheme,
            chunk_epoch: AtomicU64::new(view.id),
            view_id: AtomicU64::new(view.id),
            view: RwLock::new(Arc::new(view)),
            view_refresh: Mutex::new(()),
            opts,
            files,
            pool: WorkerPool::default(),
            io: crate::io::IoCounters::default(),
            records: Arc::default(),
            data_away: Mutex::default(),
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
    pub fn io_stats(&self) -> crate::io::IoStats {
        self.inner.io.snapshot()
    }

    /// What the meta server told this client about the cluster, as of this client's current
    /// view (a reconnection or a change of the data servers brings a newer one).
    pub fn cluster(&self) -> ClusterInfo {
        self.inner
            .view
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .info
            .clone()
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
