//! [`CitronFs`]: the client library.
//!
//! # Threads and state
//!
//! `CitronFs` is shared by many threads. What each call needs for the data path — an endpoint to
//! the meta region, endpoints to the data servers, and a range-lock handle per open file — lives
//! in a [`Worker`], checked out of a pool for the duration of one call and put back after it,
//! so that no two threads ever share an endpoint or a lock handle (the pool's mutex is held for a
//! push or a pop, never across I/O). A worker whose endpoint failed is dropped instead of being
//! put back, so the next call opens fresh connections.
//!
//! Per open inode ([`OpenInode`]): the file control block's address, the lock's address, and a
//! cache of chunk locations valid for one file generation. The first open of an inode by this
//! client sends `Open`, the last close sends `Release`.
//!
//! # The data path (DESIGN.md "Files")
//!
//! read: lock `[off, off+len)` (lock units, rounded outward) → read SIZE and GENERATION from the
//! FCB → one-sided reads of the chunks clipped to the size, one batch per data server (holes read
//! as zeros) → release. write: lock → make sure the chunks exist (cache, else one
//! `AllocateChunks` for the whole missing run) → one-sided writes, one batch per server → raise
//! SIZE with CAS while still holding the lock → release. Locks are released only after the data
//! verbs completed (or failed).

use crate::locks::{self, lock_error, server_range, whole_file};
use crate::meta::{unexpected, Heartbeat, Meta};
use crate::plan::{plan, Geometry, Limits};
use fabric::{Batch, Completions, Connector, Endpoint, RemoteAddr, ShmConnector, TcpConnector};
use lockmgr::{LockId, LockRef, LockScheme, LockStats, RangeLock};
use proto::rpc::{check_name, Request, Response, XattrMode};
use proto::{
    fcb, Attr, Caller, ChunkLoc, ClusterInfo, DataServerInfo, DirEntry, FabricAddr, FileKind,
    FsError, FsStats, Ino, SetAttr, SetTime,
};
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
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
}

impl MountOptions {
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
            scheme: LockScheme::CITRON,
            host: hostname(),
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
    inner: Arc<Inner>,
    _heartbeat: Heartbeat,
}

/// One data server as this client reaches it.
struct DataServer {
    info: DataServerInfo,
    connector: Arc<dyn Connector>,
}

struct Inner {
    meta: Arc<Meta>,
    /// How much of a lock's lease must be left to post data verbs (twice the cluster's
    /// `fence_after`; see [`Inner::check_lease_before_post`]).
    lease_guard: Duration,
    info: ClusterInfo,
    geometry: Geometry,
    scheme: LockScheme,
    meta_connector: Arc<dyn Connector>,
    /// Indexed by data server id.
    data: Vec<Option<DataServer>>,
    lock_server: Option<SocketAddr>,
    /// Inodes this client has open, with their handle counts. Held across `Open`/`Release`
    /// RPCs so that opens and last closes of one inode never race.
    open: Mutex<HashMap<Ino, OpenEntry>>,
    handles: RwLock<HashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    next_open_id: AtomicU64,
    /// Bumped at every last close: workers then drop lock handles of closed files.
    close_epoch: AtomicU64,
    workers: Mutex<Vec<Worker>>,
    /// Statistics of lock handles already dropped (closed files, broken workers), so that
    /// [`CitronFs::lock_stats`] keeps counting them.
    retired_lock_stats: Mutex<LockStats>,
}

struct OpenEntry {
    inode: Arc<OpenInode>,
    handles: usize,
}

/// An inode open on this client.
pub(crate) struct OpenInode {
    ino: Ino,
    /// Unique per `Open` RPC: lock handles opened for an earlier open of the same inode (whose
    /// lock state may have moved) are not reused.
    open_id: u64,
    fcb: RemoteAddr,
    lock: LockRef,
    chunks: RwLock<ChunkCache>,
    /// The next write updates mtime (one `SetAttr` per open, not per write).
    mtime_stale: AtomicBool,
    /// Set at the last close: workers drop their lock handles on it.
    closed: AtomicBool,
}

/// Chunk locations of one file generation. Holes are not cached: another client may fill them.
#[derive(Default)]
struct ChunkCache {
    generation: u64,
    map: HashMap<u64, ChunkLoc>,
}

struct Handle {
    inode: Arc<OpenInode>,
    caller: Caller,
    flags: i32,
}

/// One thread's data-path state (see the module docs).
struct Worker {
    meta_ep: Box<dyn Endpoint>,
    data_eps: Vec<Option<Box<dyn Endpoint>>>,
    /// Per open inode: the inode (weakly: closing it must free it) and this thread's lock
    /// handle on it. Unused with the `server` scheme.
    locks: HashMap<Ino, (Weak<OpenInode>, Box<dyn RangeLock>)>,
    /// The `server` scheme's connection (one global lock space).
    server_lock: Option<Box<dyn RangeLock>>,
    close_epoch: u64,
    batch: Batch,
    out: Completions,
    broken: bool,
    /// The lease deadline of the range lock this worker holds now (`None`: no lock, or one
    /// that is never broken). See [`Inner::check_lease_before_post`].
    lease: Option<Instant>,
}

/// A worker checked out of the pool; goes back on drop unless broken.
struct Checkout<'a> {
    inner: &'a Inner,
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
impl Worker {
    /// Adds the statistics of every lock handle this worker holds into `total`.
    fn merge_lock_stats(&self, total: &mut LockStats) {
        for (_, lock) in self.locks.values() {
            total.merge(&lock.stats());
        }
        if let Some(lock) = &self.server_lock {
            total.merge(&lock.stats());
        }
    }
}

impl Drop for Checkout<'_> {
    fn drop(&mut self) {
        if let Some(worker) = self.worker.take() {
            if worker.broken {
                worker.merge_lock_stats(
                    &mut self
                        .inner
                        .retired_lock_stats
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner),
                );
            } else {
                self.inner
                    .workers
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(worker);
            }
        }
    }
}

/// A connector to a fabric server for client session `session` (tcp endpoints present it, so
/// the cluster can fence this client; shm cannot refuse anyone).
fn connector_for(
    addr: &FabricAddr,
    opts: &MountOptions,
    session: u64,
) -> Result<Arc<dyn Connector>, FsError> {
    Ok(match addr {
        FabricAddr::Shm { dir } => Arc::new(ShmConnector::attach(dir)?),
        FabricAddr::Tcp { addr } => Arc::new(TcpConnector::connect_session(
            addr.as_str(),
            opts.cluster.clone(),
            opts.token.clone(),
            session,
        )?),
    })
}

impl CitronFs {
    /// Connects to the cluster: opens the session (renewed by a heartbeat thread at a third of
    /// the lease), and attaches to the meta region and every data server's region through the
    /// fabric the meta server names.
    pub fn connect(opts: MountOptions) -> Result<CitronFs, FsError> {
        let (meta, info) = Meta::connect(&opts.meta_addr, &opts.cluster, &opts.token, &opts.host)?;
        let meta = Arc::new(meta);
        let geometry = Geometry::new(info.chunk_size, info.lock_unit)?;
        let meta_connector = connector_for(&info.meta_fabric, &opts, info.session)?;
        let mut data: Vec<Option<DataServer>> = Vec::new();
        for ds in &info.data_servers {
            let id = ds.id as usize;
            if id > 1 << 16 {
                return Err(FsError::Io(format!("data server id {id} is implausible")));
            }
            if data.len() <= id {
                data.resize_with(id + 1, || None);
            }
            data[id] = Some(DataServer {
                info: ds.clone(),
                connector: connector_for(&ds.fabric, &opts, info.session)?,
            });
        }
        let lock_server = match (opts.scheme, &info.lock_server) {
            (LockScheme::SERVER, Some(addr)) => Some(
                addr.to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or_else(|| FsError::Io(format!("bad lock server address {addr:?}")))?,
            ),
            (LockScheme::SERVER, None) => {
                return Err(FsError::Invalid(
                    "the cluster runs no lock server: the server scheme is unavailable".into(),
                ))
            }
            _ => None,
        };
        // Often enough for the session lease, and for a fence (which revokes sessions silent
        // for `fence_after`) never to take this live client for a stopped one.
        let heartbeat = Heartbeat::start(
            meta.clone(),
            (Duration::from_millis(info.session_lease_ms) / 3)
                .min(Duration::from_millis(info.fence_after_ms) / 4),
        )?;
        let inner = Arc::new(Inner {
            lease_guard: 2 * Duration::from_millis(info.fence_after_ms),
            meta,
            geometry,
            scheme: opts.scheme,
            meta_connector,
            data,
            lock_server,
            info,
            open: Mutex::new(HashMap::new()),
            handles: RwLock::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            next_open_id: AtomicU64::new(1),
            close_epoch: AtomicU64::new(0),
            workers: Mutex::new(Vec::new()),
            retired_lock_stats: Mutex::new(LockStats::default()),
        });
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
        let mut total = *self
            .inner
            .retired_lock_stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let workers = self
            .inner
            .workers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for w in workers.iter() {
            w.merge_lock_stats(&mut total);
        }
        total
    }

    /// What the meta server told this client about the cluster.
    pub fn cluster(&self) -> &ClusterInfo {
        &self.inner.info
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

    // ---- namespace -------------------------------------------------------------------------

    /// The entry `name` in directory `parent`.
    pub fn lookup(&self, parent: Ino, name: &str) -> Result<Attr, FsError> {
        check_name(name)?;
        let attr = self.inner.attr_call(
            "Lookup",
            Request::Lookup {
                parent,
                name: name.into(),
            },
        )?;
        self.inner.fresh_size(attr)
    }

    /// An inode's attributes; for a file open on this client the size comes one-sidedly from
    /// its file control block.
    pub fn getattr(&self, ino: Ino) -> Result<Attr, FsError> {
        let attr = self.inner.attr_call("GetAttr", Request::GetAttr { ino })?;
        self.inner.fresh_size(attr)
    }

    /// Changes attributes (chmod, chown, utimens, truncate). A size change takes the whole-file
    /// range lock around the `SetAttr` call, so no read or write of any client overlaps it.
    pub fn setattr(&self, caller: Caller, ino: Ino, set: SetAttr) -> Result<Attr, FsError> {
        let explicit_mtime = set.mtime.is_some();
        let attr = match set.size {
            None => self
                .inner
                .attr_call("SetAttr", Request::SetAttr { ino, set, caller })?,
            Some(size) => {
                if size > self.inner.geometry.max_file_size() {
                    return Err(FsError::Invalid(format!(
                        "size {size} exceeds the largest file"
                    )));
                }
                let inode = self.inner.open_inode(ino)?;
                let result = self.inner.truncate(&inode, caller, set);
                self.inner.close_inode(ino);
                result?
            }
        };
        if explicit_mtime {
            if let Some(inode) = self.inner.open_entry(ino) {
                // A write after utimens must move mtime again.
                inode.mtime_stale.store(true, Ordering::Relaxed);
            }
        }
        self.inner.fresh_size(attr)
    }

    /// Creates a file, device node, fifo or socket.
    pub fn mknod(
        &self,
        caller: Caller,
        parent: Ino,
        name: &str,
        kind: FileKind,
        perm: u16,
        rdev: u32,
    ) -> Result<Attr, FsError> {
        check_name(name)?;
        if matches!(kind, FileKind::Dir | FileKind::Symlink) {
            return Err(FsError::Invalid(format!("mknod cannot create a {kind:?}")));
        }
        self.inner.attr_call(
            "Mknod",
            Request::Mknod {
                parent,
                name: name.into(),
                kind,
                perm,
                rdev,
                caller,
            },
        )
    }

    /// Creates a regular file and opens it (`flags` as for [`CitronFs::open`]).
    ///
    /// Without `O_EXCL` this is `open(O_CREAT)`: when the name exists — another client created
    /// it after the kernel's lookup missed — the existing file is opened instead (POSIX), after
    /// the permission check the kernel could not make (it checked only the directory). With
    /// `O_EXCL` an existing name is `EEXIST`.
    pub fn create(
        &self,
        caller: Caller,
        parent: Ino,
        name: &str,
        perm: u16,
        flags: i32,
    ) -> Result<(Attr, FileHandle), FsError> {
        // A name can flicker between existing and missing while other clients create and
        // unlink it; each round trip either creates it or finds it, so a few rounds suffice
        // unless someone loops create/unlink on exactly this name.
        const ROUNDS: usize = 8;
        for _ in 0..ROUNDS {
            match self.mknod(caller, parent, name, FileKind::File, perm, 0) {
                Ok(attr) => {
                    let fh = self.open(caller, attr.ino, flags & !libc::O_TRUNC)?;
                    return Ok((attr, fh));
                }
                Err(FsError::Exists) if flags & libc::O_EXCL == 0 => {}
                Err(e) => return Err(e),
            }
            let attr = match self.lookup(parent, name) {
                Ok(attr) => attr,
                Err(FsError::NotFound) => continue,
                Err(e) => return Err(e),
            };
            match attr.kind {
                FileKind::File => {}
                FileKind::Dir => return Err(FsError::IsDir),
                // A device, fifo, socket or symlink created by another client under this name:
                // the kernel would have resolved it itself, had it seen it; let it retry.
                _ => return Err(FsError::Exists),
            }
            may_open(&attr, caller, flags)?;
            let fh = self.open(caller, attr.ino, flags)?;
            return match self.inner.fresh_size(attr) {
                Ok(attr) => Ok((attr, fh)),
                Err(e) => {
                    let _ = self.release(fh);
                    Err(e)
                }
            };
        }
        Err(FsError::Exists)
    }

    /// Creates a directory.
    pub fn mkdir(
        &self,
        caller: Caller,
        parent: Ino,
        name: &str,
        perm: u16,
    ) -> Result<Attr, FsError> {
        check_name(name)?;
        self.inner.attr_call(
            "Mkdir",
            Request::Mkdir {
                parent,
                name: name.into(),
                perm,
                caller,
            },
        )
    }

    /// Removes a non-directory entry.
    pub fn unlink(&self, parent: Ino, name: &str) -> Result<(), FsError> {
        check_name(name)?;
        self.inner.ok_call(
            "Unlink",
            Request::Unlink {
                parent,
                name: name.into(),
            },
        )
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, parent: Ino, name: &str) -> Result<(), FsError> {
        check_name(name)?;
        self.inner.ok_call(
            "Rmdir",
            Request::Rmdir {
                parent,
                name: name.into(),
            },
        )
    }

    /// Renames `parent/name` to `new_parent/new_name`, replacing a compatible target unless
    /// `no_replace`.
    pub fn rename(
        &self,
        parent: Ino,
        name: &str,
        new_parent: Ino,
        new_name: &str,
        no_replace: bool,
    ) -> Result<(), FsError> {
        check_name(name)?;
        check_name(new_name)?;
        self.inner.ok_call(
            "Rename",
            Request::Rename {
                parent,
                name: name.into(),
                new_parent,
                new_name: new_name.into(),
                no_replace,
            },
        )
    }

    /// Adds the hard link `new_parent/new_name` to `ino`.
    pub fn link(&self, ino: Ino, new_parent: Ino, new_name: &str) -> Result<Attr, FsError> {
        check_name(new_name)?;
        let attr = self.inner.attr_call(
            "Link",
            Request::Link {
                ino,
                new_parent,
                new_name: new_name.into(),
            },
        )?;
        self.inner.fresh_size(attr)
    }

    /// Creates the symbolic link `parent/name` pointing to `target`.
    pub fn symlink(
        &self,
        caller: Caller,
        parent: Ino,
        name: &str,
        target: &str,
    ) -> Result<Attr, FsError> {
        check_name(name)?;
        if target.len() > proto::SYMLINK_MAX {
            return Err(FsError::NameTooLong);
        }
        self.inner.attr_call(
            "Symlink",
            Request::Symlink {
                parent,
                name: name.into(),
                target: target.into(),
                caller,
            },
        )
    }

    /// A symbolic link's target.
    pub fn readlink(&self, ino: Ino) -> Result<Vec<u8>, FsError> {
        self.inner.data_call("Readlink", Request::Readlink { ino })
    }

    /// Up to `max` entries of directory `ino` after `cookie` (0: from the start, with `.` and
    /// `..`); continue with the last entry's cookie.
    pub fn readdir(&self, ino: Ino, cookie: u64, max: u32) -> Result<Vec<DirEntry>, FsError> {
        match self
            .inner
            .meta
            .call(Request::ReadDir { ino, cookie, max })?
        {
            Response::Entries(entries) => Ok(entries),
            other => Err(unexpected("ReadDir", other)),
        }
    }

    /// File-system totals.
    pub fn statfs(&self) -> Result<FsStats, FsError> {
        match self.inner.meta.call(Request::Statfs)? {
            Response::Stats(stats) => Ok(stats),
            other => Err(unexpected("Statfs", other)),
        }
    }

    /// Sets an extended attribute.
    pub fn setxattr(
        &self,
        ino: Ino,
        name: &str,
        value: &[u8],
        mode: XattrMode,
    ) -> Result<(), FsError> {
        if name.len() > proto::XATTR_NAME_MAX || value.len() > proto::XATTR_VALUE_MAX {
            return Err(FsError::NameTooLong);
        }
        self.inner.ok_call(
            "SetXattr",
            Request::SetXattr {
                ino,
                name: name.into(),
                value: value.to_vec(),
                mode,
            },
        )
    }

    /// An extended attribute's value.
    pub fn getxattr(&self, ino: Ino, name: &str) -> Result<Vec<u8>, FsError> {
        self.inner.data_call(
            "GetXattr",
            Request::GetXattr {
                ino,
                name: name.into(),
            },
        )
    }

    /// Extended attribute names.
    pub fn listxattr(&self, ino: Ino) -> Result<Vec<String>, FsError> {
        match self.inner.meta.call(Request::ListXattr { ino })? {
            Response::Names(names) => Ok(names),
            other => Err(unexpected("ListXattr", other)),
        }
    }

    /// Removes an extended attribute.
    pub fn removexattr(&self, ino: Ino, name: &str) -> Result<(), FsError> {
        self.inner.ok_call(
            "RemoveXattr",
            Request::RemoveXattr {
                ino,
                name: name.into(),
            },
        )
    }

    // ---- files -----------------------------------------------------------------------------

    /// Opens regular file `ino` for I/O. `flags` are open(2) flags: `O_TRUNC` truncates (under
    /// the whole-file lock), `O_APPEND` makes every write go to the current end of the file
    /// (under the whole-file lock, so appends of all clients serialize). The first open of an
    /// inode by this client sends `Open` to the meta server; the last release sends `Release`.
    pub fn open(&self, caller: Caller, ino: Ino, flags: i32) -> Result<FileHandle, FsError> {
        let inode = self.inner.open_inode(ino)?;
        if flags & libc::O_TRUNC != 0 && flags & libc::O_ACCMODE != libc::O_RDONLY {
            let set = SetAttr {
                size: Some(0),
                ..SetAttr::default()
            };
            if let Err(e) = self.inner.truncate(&inode, caller, set) {
                self.inner.close_inode(ino);
                return Err(e);
            }
        }
        let fh = self.inner.next_fh.fetch_add(1, Ordering::Relaxed);
        self.inner
            .handles
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                fh,
                Arc::new(Handle {
                    inode,
                    caller,
                    flags,
                }),
            );
        Ok(FileHandle(fh))
    }

    /// Closes a handle; the last handle of an inode on this client releases the inode.
    pub fn release(&self, fh: FileHandle) -> Result<(), FsError> {
        let handle = self
            .inner
            .handles
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&fh.0)
            .ok_or(FsError::Stale)?;
        self.inner.close_inode(handle.inode.ino);
        Ok(())
    }

    /// The inode a handle is open on.
    pub fn handle_ino(&self, fh: FileHandle) -> Result<Ino, FsError> {
        Ok(self.inner.handle(fh)?.inode.ino)
    }

    /// Reads up to `len` bytes at `offset`; fewer at the end of the file. Atomic with respect
    /// to every write of every client that overlaps it.
    pub fn read(&self, fh: FileHandle, offset: u64, len: usize) -> Result<Vec<u8>, FsError> {
        let handle = self.inner.handle(fh)?;
        let max = self.inner.geometry.max_file_size();
        if len == 0 || offset >= max {
            return Ok(Vec::new());
        }
        let len = len.min((max - offset).min(usize::MAX as u64) as usize);
        let units = self.inner.geometry.lock_range(offset, len as u64)?;
        let inner = &*self.inner;
        let inode = &handle.inode;
        inner.retry_lease(|| {
            let mut w = inner.checkout()?;
            inner.locked(&mut w, inode, units.clone(), |w| {
                let (size, generation) = inner.read_fcb(w, inode)?;
                if offset >= size {
                    return Ok(Vec::new());
                }
                let n = len.min((size - offset).min(usize::MAX as u64) as usize);
                let mut buf = vec![0u8; n];
                let locs = inner.chunk_locations(inode, generation, offset, n, false)?;
                inner.transfer_read(w, offset, &mut buf, &locs)?;
                Ok(buf)
            })
        })
    }

    /// Writes `data` at `offset` (or at the end of the file for an `O_APPEND` handle) and
    /// returns the bytes written (all of them). Atomic with respect to every read and write of
    /// every client that overlaps it.
    pub fn write(&self, fh: FileHandle, offset: u64, data: &[u8]) -> Result<usize, FsError> {
        let handle = self.inner.handle(fh)?;
        if data.is_empty() {
            return Ok(0);
        }
        let inner = &*self.inner;
        let inode = &handle.inode;
        let append = handle.flags & libc::O_APPEND != 0;
        let units = if append {
            whole_file(inner.scheme)
        } else {
            inner.geometry.lock_range(offset, data.len() as u64)?
        };
        inner.retry_lease(|| {
            let mut w = inner.checkout()?;
            inner.locked(&mut w, inode, units.clone(), |w| {
                let (size, generation) = inner.read_fcb(w, inode)?;
                let offset = if append { size } else { offset };
                let end = inner.geometry.checked_end(offset, data.len() as u64)?;
                let locs = inner.chunk_locations(inode, generation, offset, data.len(), true)?;
                inner.transfer_write(w, offset, data, &locs)?;
                inner.raise_size(w, inode, size, end)
            })
        })?;
        if inode.mtime_stale.swap(false, Ordering::Relaxed) {
            let set = SetAttr {
                mtime: Some(SetTime::Now),
                ..SetAttr::default()
            };
            let request = Request::SetAttr {
                ino: inode.ino,
                set,
                caller: handle.caller,
            };
            if let Err(error) = inner.meta.call(request) {
                tracing::debug!(ino = inode.ino, %error, "mtime update after write failed");
            }
        }
        Ok(data.len())
    }

    /// Makes the file's size durable on the meta server (and its data, where the data servers
    /// are file-backed: their regions are the files).
    pub fn fsync(&self, fh: FileHandle) -> Result<(), FsError> {
        let handle = self.inner.handle(fh)?;
        {
            let mut w = self.inner.checkout()?;
            self.inner.flush_data(&mut w, &handle.inode)?;
        }
        self.inner.ok_call(
            "Fsync",
            Request::Fsync {
                ino: handle.inode.ino,
            },
        )
    }
}

/// How often one read or write is retried under a new lock after its lease ran out.
const LEASE_RETRIES: u32 = 3;

/// Whether `caller` may open `attr` with open(2) `flags`, by its mode bits (what the kernel's
/// `default_permissions` check would say; root may do anything). Used where the kernel could
/// not check: a file that appeared under a name between the kernel's lookup and its create.
fn may_open(attr: &Attr, caller: Caller, flags: i32) -> Result<(), FsError> {
    if caller.uid == 0 {
        return Ok(());
    }
    let mode = u32::from(attr.perm);
    let bits = if caller.uid == attr.uid {
        mode >> 6
    } else if caller.gid == attr.gid {
        mode >> 3
    } else {
        mode
    } & 0o7;
    let access = flags & libc::O_ACCMODE;
    let want_read = access != libc::O_WRONLY;
    let want_write = access != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
    if (want_read && bits & 0o4 == 0) || (want_write && bits & 0o2 == 0) {
        return Err(FsError::Access);
    }
    Ok(())
}

impl Drop for CitronFs {
    fn drop(&mut self) {
        // Give back what this client still has open; the session ends with the connection.
        let open: Vec<Ino> = self
            .inner
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(ino, _)| ino)
            .collect();
        for ino in open {
            let _ = self.inner.meta.call(Request::Release { ino });
        }
    }
}

impl Inner {
    fn attr_call(&self, what: &str, request: Request) -> Result<Attr, FsError> {
        match self.meta.call(request)? {
            Response::Attr(attr) => Ok(attr),
            other => Err(unexpected(what, other)),
        }
    }

    fn ok_call(&self, what: &str, request: Request) -> Result<(), FsError> {
        match self.meta.call(request)? {
            Response::Ok => Ok(()),
            other => Err(unexpected(what, other)),
        }
    }

    fn data_call(&self, what: &str, request: Request) -> Result<Vec<u8>, FsError> {
        match self.meta.call(request)? {
            Response::Data(data) => Ok(data),
            other => Err(unexpected(what, other)),
        }
    }

    fn handle(&self, fh: FileHandle) -> Result<Arc<Handle>, FsError> {
        self.handles
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&fh.0)
            .cloned()
            .ok_or(FsError::Stale)
    }

    fn open_entry(&self, ino: Ino) -> Option<Arc<OpenInode>> {
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&ino)
            .map(|e| e.inode.clone())
    }

    /// For a file open here, replaces the size with the FCB's (the truth, updated one-sidedly
    /// by writers of every client).
    fn fresh_size(&self, mut attr: Attr) -> Result<Attr, FsError> {
        if attr.kind == FileKind::File {
            if let Some(inode) = self.open_entry(attr.ino) {
                let mut w = self.checkout()?;
                attr.size = self.read_fcb(&mut w, &inode)?.0;
            }
        }
        Ok(attr)
    }

    /// Counts one more open of `ino` on this client, sending `Open` on the first.
    fn open_inode(&self, ino: Ino) -> Result<Arc<OpenInode>, FsError> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = open.get_mut(&ino) {
            entry.handles += 1;
            return Ok(entry.inode.clone());
        }
        let opened = match self.meta.call(Request::Open {
            ino,
            scheme: self.scheme,
        })? {
            Response::Open(opened) => opened,
            other => return Err(unexpected("Open", other)),
        };
        let inode = Arc::new(OpenInode {
            ino,
            open_id: self.next_open_id.fetch_add(1, Ordering::Relaxed),
            fcb: opened.fcb,
            lock: opened.lock,
            chunks: RwLock::new(ChunkCache {
                generation: opened.attr.generation,
                map: HashMap::new(),
            }),
            mtime_stale: AtomicBool::new(true),
            closed: AtomicBool::new(false),
        });
        // The FCB must be this inode's: a mismatch means the meta server's region and this
        // client disagree, and writing through it would corrupt another file.
        let check = (|| {
            let mut w = self.checkout()?;
            let mut batch = Batch::new();
            let h = batch.read(inode.fcb.add(fcb::INO), 8);
            let mut out = Completions::new();
            if let Err(e) = w.meta_ep.execute(&batch, &mut out) {
                w.broken = true;
                return Err(FsError::from(e));
            }
            let found = out.word(h, 0);
            if found != ino {
                return Err(FsError::Io(format!(
                    "file control block at {} belongs to inode {found}, not {ino}",
                    inode.fcb
                )));
            }
            Ok(())
        })();
        if let Err(e) = check {
            let _ = self.meta.call(Request::Release { ino });
            return Err(e);
        }
        open.insert(
            ino,
            OpenEntry {
                inode: inode.clone(),
                handles: 1,
            },
        );
        Ok(inode)
    }

    /// Counts one open of `ino` less, sending `Release` after the last.
    fn close_inode(&self, ino: Ino) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(entry) = open.get_mut(&ino) else {
            return;
        };
        entry.handles -= 1;
        if entry.handles > 0 {
            return;
        }
        if let Some(entry) = open.remove(&ino) {
            entry.inode.closed.store(true, Ordering::Relaxed);
        }
        self.close_epoch.fetch_add(1, Ordering::Relaxed);
        if let Err(error) = self.meta.call(Request::Release { ino }) {
            tracing::warn!(ino, %error, "release of a closed file failed");
        }
    }

    fn checkout(&self) -> Result<Checkout<'_>, FsError> {
        let pooled = self
            .workers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let mut worker = match pooled {
            Some(w) => w,
            None => Worker {
                meta_ep: self.meta_connector.connect()?,
                data_eps: Vec::new(),
                locks: HashMap::new(),
                server_lock: None,
                close_epoch: self.close_epoch.load(Ordering::Relaxed),
                batch: Batch::new(),
                out: Completions::new(),
                broken: false,
                lease: None,
            },
        };
        let epoch = self.close_epoch.load(Ordering::Relaxed);
        if worker.close_epoch != epoch {
            // Without taking `open`: checkouts happen while it is held (open_inode).
            let mut retired = LockStats::default();
            worker.locks.retain(|_, (inode, lock)| {
                let keep = inode
                    .upgrade()
                    .is_some_and(|i| !i.closed.load(Ordering::Relaxed));
                if !keep {
                    retired.merge(&lock.stats());
                }
                keep
            });
            self.retired_lock_stats
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .merge(&retired);
        }
        worker.close_epoch = epoch;
        Ok(Checkout {
            inner: self,
            worker: Some(worker),
        })
    }

    /// This worker's lock handle for `inode`'s scheme, opened on first use.
    fn lock_handle<'w>(
        &self,
        w: &'w mut Worker,
        inode: &Arc<OpenInode>,
    ) -> Result<&'w mut Box<dyn RangeLock>, FsError> {
        if self.scheme == LockScheme::SERVER {
            if w.server_lock.is_none() {
                let addr = self.lock_server.expect("checked at connect");
                w.server_lock = Some(
                    locks::open_server_lock(&*self.meta_connector, addr)
                        .map_err(|e| lock_error(inode.ino, e))?,
                );
            }
            return Ok(w.server_lock.as_mut().expect("set above"));
        }
        let fresh = !matches!(w.locks.get(&inode.ino),
            Some((known, _)) if known.upgrade().is_some_and(|k| k.open_id == inode.open_id));
        if fresh {
            let handle =
                locks::open_file_lock(&inode.lock, &*self.meta_connector, &self.meta, inode.ino)?;
            if let Some((_, old)) = w.locks.insert(inode.ino, (Arc::downgrade(inode), handle)) {
                self.retired_lock_stats
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .merge(&old.stats());
            }
        }
        Ok(&mut w.locks.get_mut(&inode.ino).expect("inserted above").1)
    }

    /// Runs `body` holding units `units` of `inode` locked; releases after it, whatever it
    /// returned. A failed release marks the worker broken (its lock handle is in doubt).
    fn locked<T>(
        &self,
        w: &mut Worker,
        inode: &Arc<OpenInode>,
        units: Range<u64>,
        body: impl FnOnce(&mut Worker) -> Result<T, FsError>,
    ) -> Result<T, FsError> {
        let range = if self.scheme == LockScheme::SERVER {
            server_range(inode.ino, units)?
        } else {
            units
        };
        let lock = self.lock_handle(w, inode)?;
        let (id, lease): (LockId, _) = match lock.acquire(range) {
            Ok(id) => (id, lock.lease_deadline(id)),
            Err(e) => {
                w.broken = true;
                return Err(lock_error(inode.ino, e));
            }
        };
        w.lease = lease;
        let result = body(w);
        w.lease = None;
        let released = self
            .lock_handle(w, inode)
            .and_then(|l| l.release(id).map_err(|e| lock_error(inode.ino, e)));
        if released.is_err() {
            w.broken = true;
        }
        let value = result?;
        released?;
        Ok(value)
    }

    /// Fencing, client side (DESIGN.md "Fencing"): data verbs that change the file are posted
    /// only while the guarding lock's lease has more than `lease_guard` left, so that they
    /// execute before any other client can break the lock. The guard is twice the cluster's
    /// `fence_after`: a client stopped between this check and its post for long enough to
    /// land late is silent that long, and the breaker's `Fence` revokes it first (tcp).
    fn check_lease_before_post(&self, w: &Worker) -> Result<(), FsError> {
        match w.lease {
            Some(deadline) if Instant::now() + self.lease_guard > deadline => {
                Err(FsError::LeaseLost)
            }
            _ => Ok(()),
        }
    }

    /// Reads are validated after the fact: data read before the lease deadline was read under
    /// the lock; data read later may mix in another client's write.
    fn check_lease_after_read(&self, w: &Worker) -> Result<(), FsError> {
        match w.lease {
            Some(deadline) if Instant::now() >= deadline => Err(FsError::LeaseLost),
            _ => Ok(()),
        }
    }

    /// Runs `op` (one whole locked read or write) again when its lock's lease ran out before
    /// its verbs were done, up to [`LEASE_RETRIES`] times: a stalled client gets a fresh lock
    /// rather than an error, and only one that keeps stalling sees EIO.
    fn retry_lease<T>(&self, mut op: impl FnMut() -> Result<T, FsError>) -> Result<T, FsError> {
        let mut attempt = 0;
        loop {
            match op() {
                Err(FsError::LeaseLost) if attempt < LEASE_RETRIES => {
                    attempt += 1;
                    tracing::warn!(
                        attempt,
                        "range lock lease ran out mid-I/O; retrying under a new lock"
                    );
                }
                other => return other,
            }
        }
    }

    /// Reads SIZE and GENERATION from the FCB (two word reads in one round trip: each word is
    /// read atomically).
    fn read_fcb(&self, w: &mut Worker, inode: &OpenInode) -> Result<(u64, u64), FsError> {
        let Worker {
            meta_ep,
            batch,
            out,
            broken,
            ..
        } = w;
        batch.clear();
        let size = batch.read(inode.fcb.add(fcb::SIZE), 8);
        let generation = batch.read(inode.fcb.add(fcb::GENERATION), 8);
        if let Err(e) = meta_ep.execute(batch, out) {
            *broken = true;
            return Err(e.into());
        }
        Ok((out.word(size, 0), out.word(generation, 0)))
    }

    /// Raises SIZE to `end` unless it is there already (CAS loop from `seen`).
    fn raise_size(
        &self,
        w: &mut Worker,
        inode: &OpenInode,
        mut seen: u64,
        end: u64,
    ) -> Result<(), FsError> {
        let addr = inode.fcb.add(fcb::SIZE);
        while end > seen {
            self.check_lease_before_post(w)?;
            w.batch.clear();
            let h = w.batch.cas(addr, seen, end);
            if let Err(e) = w.meta_ep.execute(&w.batch, &mut w.out) {
                w.broken = true;
                return Err(e.into());
            }
            let old = w.out.old(h);
            if old == seen {
                break;
            }
            seen = old;
        }
        Ok(())
    }

    /// Where chunks of bytes `[off, off + len)` live, for file generation `generation`:
    /// `result[i]` is chunk `first + i`'s location (None: a hole). With `allocate`, holes are
    /// allocated with one `AllocateChunks` for the whole missing run.
    fn chunk_locations(
        &self,
        inode: &OpenInode,
        mut generation: u64,
        off: u64,
        len: usize,
        allocate: bool,
    ) -> Result<ChunkRun, FsError> {
        let chunks = self.geometry.chunks(off, len as u64);
        for _attempt in 0..3 {
            let (mut locs, missing) = self.cached(inode, generation, chunks.clone());
            let Some((a, b)) = missing else {
                return Ok(ChunkRun {
                    first: chunks.start,
                    locs,
                });
            };
            let request = if allocate {
                Request::AllocateChunks {
                    ino: inode.ino,
                    generation,
                    first: a,
                    count: b - a + 1,
                }
            } else {
                Request::ChunkMap {
                    ino: inode.ino,
                    first: a,
                    count: b - a + 1,
                }
            };
            let got = match self.meta.call(request) {
                Ok(Response::Chunks(got)) => got,
                Ok(other) => return Err(unexpected("ChunkMap/AllocateChunks", other)),
                Err(FsError::Stale) if allocate => {
                    // The file's layout changed under us (unlink elsewhere): start over with
                    // the generation the FCB has now.
                    let mut w = self.checkout()?;
                    generation = self.read_fcb(&mut w, inode)?.1;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if got.len() as u64 != b - a + 1 {
                return Err(FsError::Io(format!(
                    "meta server returned {} chunk locations for {} chunks",
                    got.len(),
                    b - a + 1
                )));
            }
            let mut cache = inode.chunks.write().unwrap_or_else(PoisonError::into_inner);
            if cache.generation < generation {
                cache.generation = generation;
                cache.map.clear();
            }
            // Only a cache of this very generation may learn these locations.
            let cacheable = cache.generation == generation;
            for (i, loc) in got.into_iter().enumerate() {
                let c = a + i as u64;
                let Some(loc) = loc else {
                    if allocate {
                        return Err(FsError::Io(format!(
                            "meta server allocated no chunk {c} of inode {}",
                            inode.ino
                        )));
                    }
                    continue;
                };
                self.check_loc(loc)?;
                if cacheable {
                    cache.map.insert(c, loc);
                }
                if (chunks.start..chunks.end).contains(&c) {
                    locs[(c - chunks.start) as usize] = Some(loc);
                }
            }
            return Ok(ChunkRun {
                first: chunks.start,
                locs,
            });
        }
        Err(FsError::Io(format!(
            "inode {}: the file generation kept changing during a write",
            inode.ino
        )))
    }

    /// The cached locations of `chunks` for `generation` (`None` where not cached), and the
    /// first and last chunk missing. A newer generation empties the cache; an older one (a
    /// caller that read the FCB before a truncate) bypasses it.
    fn cached(
        &self,
        inode: &OpenInode,
        generation: u64,
        chunks: Range<u64>,
    ) -> (Vec<Option<ChunkLoc>>, Option<(u64, u64)>) {
        let lookup = |cache: &ChunkCache| {
            let mut missing: Option<(u64, u64)> = None;
            let locs = chunks
                .clone()
                .map(|c| {
                    let loc = if cache.generation == generation {
                        cache.map.get(&c).copied()
                    } else {
                        None
                    };
                    if loc.is_none() {
                        missing = Some(missing.map_or((c, c), |(a, _)| (a, c)));
                    }
                    loc
                })
                .collect();
            (locs, missing)
        };
        {
            let cache = inode.chunks.read().unwrap_or_else(PoisonError::into_inner);
            if cache.generation >= generation {
                return lookup(&cache);
            }
        }
        let mut cache = inode.chunks.write().unwrap_or_else(PoisonError::into_inner);
        if cache.generation < generation {
            cache.generation = generation;
            cache.map.clear();
        }
        lookup(&cache)
    }

    fn check_loc(&self, loc: ChunkLoc) -> Result<(), FsError> {
        match self.data.get(loc.server as usize).and_then(Option::as_ref) {
            Some(ds) if loc.index < ds.info.chunks => Ok(()),
            Some(ds) => Err(FsError::Io(format!(
                "chunk {} is beyond data server {}'s {} chunks",
                loc.index, loc.server, ds.info.chunks
            ))),
            None => Err(FsError::Io(format!(
                "chunk on data server {}, which this client does not know (joined after it connected?)",
                loc.server
            ))),
        }
    }

    fn data_ep<'w>(&self, w: &'w mut Worker, server: u32) -> Result<&'w mut dyn Endpoint, FsError> {
        let id = server as usize;
        let ds = self
            .data
            .get(id)
            .and_then(Option::as_ref)
            .ok_or_else(|| FsError::Io(format!("unknown data server {server}")))?;
        if w.data_eps.len() <= id {
            w.data_eps.resize_with(id + 1, || None);
        }
        if w.data_eps[id].is_none() {
            w.data_eps[id] = Some(ds.connector.connect()?);
        }
        Ok(w.data_eps[id].as_deref_mut().expect("set above"))
    }

    /// Reads bytes `[off, off + buf.len())` into `buf` (holes stay as they are: zeros).
    fn transfer_read(
        &self,
        w: &mut Worker,
        off: u64,
        buf: &mut [u8],
        run: &ChunkRun,
    ) -> Result<(), FsError> {
        let plans = plan(
            &self.geometry,
            off,
            buf.len(),
            |c| run.get(c),
            Limits::FABRIC,
        )?;
        for sp in plans {
            let region = self.region_of(sp.server)?;
            for pb in sp.batches {
                let handles = self.exec_data(w, sp.server, |batch| {
                    pb.ops
                        .iter()
                        .map(|op| batch.read(RemoteAddr::new(region, op.remote_off), op.len))
                        .collect::<Vec<_>>()
                })?;
                self.check_lease_after_read(w)?;
                for (op, h) in pb.ops.iter().zip(handles) {
                    buf[op.buf_off..op.buf_off + op.len].copy_from_slice(w.out.bytes(h));
                }
            }
        }
        Ok(())
    }

    /// Writes `data` at file offset `off` (every chunk of `run` allocated).
    fn transfer_write(
        &self,
        w: &mut Worker,
        off: u64,
        data: &[u8],
        run: &ChunkRun,
    ) -> Result<(), FsError> {
        let plans = plan(
            &self.geometry,
            off,
            data.len(),
            |c| run.get(c),
            Limits::FABRIC,
        )?;
        for sp in plans {
            let region = self.region_of(sp.server)?;
            for pb in sp.batches {
                self.check_lease_before_post(w)?;
                self.exec_data(w, sp.server, |batch| {
                    for op in &pb.ops {
                        batch.write(
                            RemoteAddr::new(region, op.remote_off),
                            &data[op.buf_off..op.buf_off + op.len],
                        );
                    }
                })?;
            }
        }
        Ok(())
    }

    /// Makes the file's data durable where its data servers are file-backed (the data half of
    /// `fsync`; DESIGN.md "Files"): one batch of flush verbs per data server, covering every
    /// allocated chunk below the size, with runs of adjacent chunks merged into one verb. Every
    /// write this client acknowledged had completed its data verbs before returning, so the
    /// flushes cover it.
    fn flush_data(&self, w: &mut Worker, inode: &OpenInode) -> Result<(), FsError> {
        let (size, generation) = self.read_fcb(w, inode)?;
        if size == 0 {
            return Ok(());
        }
        let len = usize::try_from(size).map_err(|_| FsError::Invalid("file too large".into()))?;
        let run = self.chunk_locations(inode, generation, 0, len, false)?;
        let mut per_server: std::collections::BTreeMap<u32, Vec<u64>> = Default::default();
        for loc in run.locs.iter().flatten() {
            per_server.entry(loc.server).or_default().push(loc.index);
        }
        let chunk = self.geometry.chunk_size;
        for (server, mut indexes) in per_server {
            indexes.sort_unstable();
            let region = self.region_of(server)?;
            // (first chunk, chunk count) of each run of adjacent chunks.
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for index in indexes {
                match runs.last_mut() {
                    Some((first, count)) if *first + *count == index => *count += 1,
                    _ => runs.push((index, 1)),
                }
            }
            // A batch carries at most MAX_BATCH_VERBS verbs; stay well below.
            for group in runs.chunks(1024) {
                self.exec_data(w, server, |batch| {
                    for &(first, count) in group {
                        batch.flush(RemoteAddr::new(region, first * chunk), count * chunk);
                    }
                })?;
            }
        }
        Ok(())
    }

    /// Fills the worker's batch with `fill` and executes it on data server `server`, one round
    /// trip; the results are in `w.out` afterwards. A failure marks the worker broken: the
    /// endpoint's state is unknown, so it must not be reused.
    fn exec_data<R>(
        &self,
        w: &mut Worker,
        server: u32,
        fill: impl FnOnce(&mut Batch) -> R,
    ) -> Result<R, FsError> {
        let mut batch = std::mem::take(&mut w.batch);
        let mut out = std::mem::take(&mut w.out);
        batch.clear();
        let filled = fill(&mut batch);
        let result = self
            .data_ep(w, server)
            .and_then(|ep| ep.execute(&batch, &mut out).map_err(FsError::from));
        w.batch = batch;
        w.out = out;
        if result.is_err() {
            w.broken = true;
        }
        result.map(|()| filled)
    }

    fn region_of(&self, server: u32) -> Result<fabric::RegionId, FsError> {
        self.data
            .get(server as usize)
            .and_then(Option::as_ref)
            .map(|ds| ds.info.region)
            .ok_or_else(|| FsError::Io(format!("unknown data server {server}")))
    }

    /// Truncates (or extends) under the whole-file lock.
    fn truncate(
        &self,
        inode: &Arc<OpenInode>,
        caller: Caller,
        set: SetAttr,
    ) -> Result<Attr, FsError> {
        let mut w = self.checkout()?;
        let ino = inode.ino;
        self.locked(&mut w, inode, whole_file(self.scheme), |_| {
            self.attr_call("SetAttr", Request::SetAttr { ino, set, caller })
        })
    }
}

/// Chunk locations for a run of chunks starting at `first`.
struct ChunkRun {
    first: u64,
    locs: Vec<Option<ChunkLoc>>,
}

impl ChunkRun {
    fn get(&self, chunk: u64) -> Option<ChunkLoc> {
        chunk
            .checked_sub(self.first)
            .and_then(|i| self.locs.get(i as usize).copied().flatten())
    }
}
