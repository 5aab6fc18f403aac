//! What re-replication does to one chunk, and its passes (docs/REPLICAS.md; the schedule and
//! progress are `crate::rereplicate`'s, the transactions `store::rereplicate`'s).
//!
//! # One chunk, under the file's range lock
//! 1. The meta server opens the file itself, as a session of its own
//!    ([`REREPLICATOR_SESSION`]), as a client's open does (under the state lock, briefly): a
//!    file open nowhere gets its FCB and its lock, under the default scheme; an open file's
//!    lock is joined. From then on every client that opens the file shares that lock, and an
//!    unlink of it leaves an orphan freed at the last close, so its chunks stay where they are.
//! 2. It takes the lock, exclusive, over the chunk's bytes (its lock units), with a handle
//!    of its own on the meta region, as a client would (no state lock held): every writer and
//!    reader of those bytes waits for it, and it waits for those that hold them.
//! 3. Under the state lock, briefly: the new replica is placed (`Store::add_replica`), marked
//!    lost until committed, so that no chunk map names it.
//! 4. Without the state lock: the chunk's bytes are read from a live replica and written to
//!    the new one, one-sidedly through the registry's endpoints, a piece at a time, each write
//!    only while the lock's lease has more than `2·fence_after` left (as clients post data
//!    verbs).
//! 5. Under the state lock, briefly: the commit (`Store::commit_replica`) — the new replica
//!    takes its place, the replicas that are not live leave the set, and the file's
//!    generation is bumped and published in its FCB, all before the lock is released. A copy
//!    that failed (a server gone, the lease short) gives the block back instead.
//! 6. The lock is released and the file closed (freeing its lock state if nobody else has it
//!    open, as a client's last close does).
//!
//! # Why no write is lost
//! A writer of the chunk holds the range lock over it, so it either released before step 2
//! (its bytes are on the live replica the copy reads) or takes the lock after step 5. Every
//! write's acquisition reads the FCB's generation in the lock's own batch, after the grant
//! (`RangeLock::acquire_with`): it sees the generation step 5 published, drops the chunk
//! locations it cached and asks the meta server, whose chunk map names the new replica; so
//! its write goes to every replica, the new one included. A writer of other chunks of the file
//! is not held up, and drops its cache at its next I/O (one `ChunkMap` call), which costs a
//! call, never a wrong location: the replicas of other chunks did not move.

use super::*;
use crate::registry::SharedEndpoint;
use crate::store::{Pending, Short};
use fabric::{Connector, Endpoint, EndpointExt};
use lockmgr::schemes::{Hosting, LockServerAt, OpenOptions};
use lockmgr::{LockRef, RangeLock};
use proto::layout::Layout;
use proto::ChunkLoc;

/// The session under which the meta server has a file open while it re-replicates it: no
/// client's (client sessions are numbered from the clock in microseconds, never 0).
pub(crate) const REREPLICATOR_SESSION: u64 = 0;

/// The bytes copied at once, at most.
const PIECE: usize = 1 << 20;

/// What a pass did.
#[derive(Debug, Default)]
pub(crate) struct PassOutcome {
    /// Chunks re-replicated: (file, chunk, copied from, new replica).
    pub done: Vec<(Ino, u64, ChunkLoc, ChunkLoc)>,
    /// Chunks not re-replicated, and why.
    pub failed: Vec<(Ino, u64, String)>,
}

/// Endpoints of the meta server's own memory, for its handles on files' locks when no
/// fabric server's connector was given ([`Service::set_lock_connector`]): tests of the
/// service alone.
struct OwnConnector(Arc<Region>);

impl Connector for OwnConnector {
    fn connect(&self) -> fabric::Result<Box<dyn Endpoint>> {
        Ok(Box::new(LocalEndpoint::new(Arc::new(OwnRegion(
            self.0.clone(),
        )))))
    }
}

/// The fence the meta server's own lock handles run before breaking a dead holder's lock:
/// the revocation of silent sessions a client's `Fence` request runs.
struct OwnFence(std::sync::Weak<Service>);

impl lockmgr::Fence for OwnFence {
    fn fence(&self) -> Result<(), lockmgr::LockError> {
        let service = self.0.upgrade().ok_or_else(|| lockmgr::LockError::Hook {
            what: "fence before a lease recovery (re-replication)",
            source: "the meta server is stopping".into(),
        })?;
        service
            .fence(REREPLICATOR_SESSION, crate::fences::FENCE_WAIT)
            .map_err(|e| lockmgr::LockError::Hook {
                what: "fence before a lease recovery (re-replication)",
                source: Box::new(e),
            })
    }
}

/// Lock words for the meta server's own handles' scale-ups: as `AllocateLockWords`.
struct OwnLockWords(std::sync::Weak<Service>, Ino);

impl lockmgr::schemes::LockWordAllocator for OwnLockWords {
    fn allocate(&self, words: u64) -> Result<RemoteAddr, lockmgr::LockError> {
        let hook = |source: Box<dyn std::error::Error + Send + Sync>| lockmgr::LockError::Hook {
            what: "lock tree allocation (re-replication)",
            source,
        };
        let service = self
            .0
            .upgrade()
            .ok_or_else(|| hook("the meta server is stopping".into()))?;
        service
            .allocate_lock_words(self.1, words)
            .map_err(|e| hook(Box::new(e)))
    }
}

impl Service {
    /// The connector the meta server's own lock handles use: the meta region's fabric
    /// server's, as a procedure at the server reaches the memory (`FabricServer::host_connector`),
    /// so that its atomics are the clients' (set once, by `MetaServer::start`).
    pub fn set_lock_connector(&self, connector: Arc<dyn Connector>) {
        let _ = self.lock_connector.set(connector);
    }

    /// Tells the service where it is shared (its own lock handles' fence and allocator call
    /// it back); set once, by `MetaServer::start`.
    pub fn set_self(self: &Arc<Self>) {
        let _ = self.me.set(Arc::downgrade(self));
    }

    /// Where re-replication stands (`citronfs status`).
    pub(crate) fn rereplication_status(&self) -> proto::status::RereplicationStatus {
        self.rereplicator.status()
    }

    /// A data server was marked down, or came back with new memory: a pass is due after the
    /// grace.
    pub(crate) fn replicas_may_be_short(&self) {
        self.rereplicator.server_changed();
    }

    /// The re-replication thread's loop (started by `MetaServer::start`): a pass whenever one
    /// is due, until [`Service::stop_rereplicator`].
    pub fn run_rereplicator(&self) {
        while self.rereplicator.next_pass() {
            if let Err(error) = self.rereplicate_pass() {
                tracing::warn!(%error, "re-replication pass failed; retried later");
                self.rereplicator.due_in(self.rereplicator.settings().after);
            }
        }
    }

    /// Stops the re-replication thread (at its next chunk).
    pub fn stop_rereplicator(&self) {
        self.rereplicator.stop();
    }

    /// One pass: every chunk with fewer live replicas than its file's factor that can get
    /// one more (a live replica to copy from, a live server without one), a chunk at a time,
    /// paced to the rate limit.
    pub(crate) fn rereplicate_pass(&self) -> Result<PassOutcome, FsError> {
        let _one = lock(&self.rereplicator.work);
        let (servers, live) = {
            let st = lock(&self.state);
            (st.live.ids().len(), st.live.id_set())
        };
        let todo: Vec<Short> = self
            .store
            .under_replicated(&live, self.settings.replicas)?
            .into_iter()
            .filter(|s| s.live > 0 && s.live < s.factor.min(servers))
            .collect();
        let mut out = PassOutcome::default();
        if todo.is_empty() {
            return Ok(out);
        }
        self.rereplicator.pass_begins(todo.len() as u64);
        for short in todo {
            if self.rereplicator.stopping() {
                break;
            }
            std::thread::sleep(self.rereplicator.pace_now());
            match self.rereplicate_chunk(&short) {
                Ok(Some((from, to, bytes))) => {
                    out.done.push((short.ino, short.chunk, from, to));
                    self.rereplicator.chunk_done(Some(bytes));
                }
                Ok(None) => {
                    // Its set changed meanwhile (freed, written over by a truncate, already
                    // re-replicated): nothing to do.
                    self.rereplicator.chunk_skipped();
                }
                Err(error) => {
                    tracing::warn!(ino = short.ino, chunk = short.chunk, %error, "chunk not re-replicated");
                    out.failed.push((short.ino, short.chunk, error.to_string()));
                    self.rereplicator.chunk_done(None);
                }
            }
        }
        self.rereplicator.pass_ends();
        Ok(out)
    }

    /// Re-replicates one chunk as the module docs say: the replica copied from, the new one
    /// and the bytes copied; `None` when its set changed since it was found short.
    fn rereplicate_chunk(
        &self,
        short: &Short,
    ) -> Result<Option<(ChunkLoc, ChunkLoc, u64)>, FsError> {
        let lock_ref = match self.open_for_rereplication(short.ino) {
            // Deleted since the pass began: its chunks went with it.
            Err(FsError::NotFound) => return Ok(None),
            opened => opened?,
        };
        let result = self.rereplicate_opened(short, &lock_ref);
        let effects = {
            let mut st = lock(&self.state);
            let effects = self.release_locked(&mut st, REREPLICATOR_SESSION, short.ino);
            st.publish_touched(&self.store);
            effects
        };
        match effects {
            Ok(effects) => self.registry.zero_and_recycle(effects.freed),
            Err(error) => {
                tracing::warn!(ino = short.ino, %error, "re-replication's release of the file")
            }
        }
        result
    }

    /// Opens `ino` under [`REREPLICATOR_SESSION`] (module docs, step 1); its lock.
    fn open_for_rereplication(&self, ino: Ino) -> Result<LockRef, FsError> {
        let mut st = lock(&self.state);
        let attr = self.store.getattr(ino)?;
        if attr.kind != FileKind::File {
            return Err(FsError::Invalid(format!(
                "inode {ino} is not a regular file"
            )));
        }
        let st = &mut *st;
        let scheme = LockScheme::default();
        if st.open.ensure_open(&mut st.region, ino, &attr, &scheme)? {
            self.lock_calls.opened(ino);
            st.publish(&self.store, [ino]);
        }
        Ok(st
            .open
            .join(&mut st.region, REREPLICATOR_SESSION, ino, attr)?
            .lock)
    }

    /// Steps 2 to 5 of the module docs, on `ino` opened with lock `lock_ref`.
    fn rereplicate_opened(
        &self,
        short: &Short,
        lock_ref: &LockRef,
    ) -> Result<Option<(ChunkLoc, ChunkLoc, u64)>, FsError> {
        let layout = self.store.layout();
        let mut handle = self.own_lock_handle(lock_ref, short.ino)?;
        let unit = self.settings.lock_unit;
        let start = layout.start(short.chunk);
        let end = start + layout.len(short.chunk);
        let range = lock_ref
            .scheme
            .object_range(short.ino, start / unit..end.div_ceil(unit))
            .map_err(|e| FsError::Invalid(format!("inode {}: {e}", short.ino)))?;
        let id = handle
            .acquire(range)
            .map_err(|e| FsError::Io(format!("re-replication's range lock: {e}")))?;
        let deadline = handle.lease_deadline(id);
        let result = self.rereplicate_locked(short, layout, deadline);
        if let Err(error) = handle.release(id) {
            tracing::warn!(ino = short.ino, %error, "re-replication's lock release");
        }
        result
    }

    /// A handle of the meta server's own on lock `lock_ref` of file `ino`.
    fn own_lock_handle(&self, lock_ref: &LockRef, ino: Ino) -> Result<Box<dyn RangeLock>, FsError> {
        let own;
        let connector: &dyn Connector = match self.lock_connector.get() {
            Some(c) => &**c,
            None => {
                own = OwnConnector(self.region.clone());
                &own
            }
        };
        let server = lock(&self.state)
            .open
            .policy()
            .lock_server
            .as_ref()
            .map(|s| LockServerAt {
                addr: s.addr(),
                credentials: s.credentials().clone(),
            });
        let me = self.me.get().cloned();
        let options = OpenOptions {
            fence: me
                .clone()
                .map(|me| Arc::new(OwnFence(me)) as Arc<dyn lockmgr::Fence>),
            // No owner: a waiter waits out the lease rather than asking whether this holder
            // is gone (it is no client session).
            owner: None,
            hosting: Some(Hosting::Never),
            allocator: me.map(|me| {
                Arc::new(OwnLockWords(me, ino)) as Arc<dyn lockmgr::schemes::LockWordAllocator>
            }),
            server,
            ..OpenOptions::default()
        };
        lockmgr::schemes::open(lock_ref, connector, &options).map_err(|e| {
            FsError::Io(format!(
                "re-replication's handle on inode {ino}'s lock: {e}"
            ))
        })
    }

    /// Steps 3 to 5 of the module docs, the chunk's range lock held until `deadline`.
    fn rereplicate_locked(
        &self,
        short: &Short,
        layout: Layout,
        deadline: Option<Instant>,
    ) -> Result<Option<(ChunkLoc, ChunkLoc, u64)>, FsError> {
        let guard = 2 * self.settings.fence_after;
        let in_time = || match deadline {
            Some(at) if Instant::now() + guard >= at => Err(FsError::Expired),
            _ => Ok(()),
        };
        let len = layout.len(short.chunk);
        // 3. Placed.
        let (pending, from, to, incarnations) = {
            let mut st = lock(&self.state);
            let st = &mut *st;
            let servers = st.live.ids();
            let Some(pending) =
                self.store
                    .add_replica(short.ino, short.chunk, &short.replicas, &servers)?
            else {
                return Ok(None);
            };
            if let Some(attr) = &pending.bumped {
                st.open.publish_generation(&mut st.region, attr)?;
            }
            st.publish_touched(&self.store);
            let from = st.live.endpoint(pending.source.server)?;
            let to = st.live.endpoint(pending.loc.server)?;
            let incarnations = (
                self.store.incarnation(pending.source.server)?,
                self.store.incarnation(pending.loc.server)?,
            );
            (pending, from, to, incarnations)
        };
        self.registry.zero_and_recycle(pending.freed.clone());
        // 4. Copied.
        let copied = copy(&pending, from, to, len, layout.unit(), &in_time);
        // 5. Committed, or given back.
        let mut st = lock(&self.state);
        let st = &mut *st;
        let same = self.store.incarnation(pending.source.server)? == incarnations.0
            && self.store.incarnation(pending.loc.server)? == incarnations.1;
        let committed = match copied.and_then(|()| in_time()) {
            Ok(()) if same => self.store.commit_replica(&pending, &st.live.id_set())?,
            Ok(()) => None,
            Err(error) => {
                let freed = self.store.abandon_replica(&pending)?;
                st.publish_touched(&self.store);
                self.registry.zero_and_recycle(freed);
                return Err(error);
            }
        };
        let Some((attr, freed)) = committed else {
            let freed = self.store.abandon_replica(&pending)?;
            st.publish_touched(&self.store);
            self.registry.zero_and_recycle(freed);
            return Err(FsError::Io(
                "a replica's data server went away or came back with new memory during the copy"
                    .into(),
            ));
        };
        st.open.publish_generation(&mut st.region, &attr)?;
        st.publish_touched(&self.store);
        self.registry.zero_and_recycle(freed);
        Ok(Some((pending.source, pending.loc, len)))
    }

    /// `citronfs fsck --repair`'s re-replication: a pass now, waited for (after the check,
    /// without the state lock); each chunk done is a repair, and what is still short is
    /// `remaining` (replacing the check's under-replicated findings there).
    pub(crate) fn rereplicate_for_fsck(&self, report: &mut FsckReport) -> Result<(), FsError> {
        let outcome = self.rereplicate_pass()?;
        for (ino, chunk, from, to) in outcome.done {
            report.repairs.push(Repair::Rereplicated {
                ino,
                chunk,
                from,
                to,
            });
        }
        let live = lock(&self.state).live.id_set();
        let mut short: BTreeMap<Ino, (usize, u64, u32)> = BTreeMap::new();
        for s in self.store.under_replicated(&live, self.settings.replicas)? {
            let (_, chunks, fewest) = short.entry(s.ino).or_insert((s.factor, 0, u32::MAX));
            *chunks += 1;
            *fewest = (*fewest).min(s.live as u32);
        }
        let path = |ino: Ino| {
            report.findings.iter().find_map(|f| match f {
                Finding::UnderReplicated { ino: i, path, .. } if *i == ino => path.clone(),
                _ => None,
            })
        };
        let still: Vec<Finding> = short
            .into_iter()
            .map(|(ino, (factor, chunks, fewest))| Finding::UnderReplicated {
                ino,
                path: path(ino),
                factor: factor as u32,
                chunks,
                fewest,
            })
            .collect();
        let remaining = report.remaining.get_or_insert_with(Vec::new);
        remaining.retain(|f| !matches!(f, Finding::UnderReplicated { .. }));
        remaining.extend(still);
        remaining.truncate(MAX_FINDINGS);
        Ok(())
    }
}

/// Copies the first `len` bytes of block `p.source` (through `from`) over block `p.loc`
/// (through `to`), `unit` bytes per layout unit, a piece at a time; each write only while
/// `in_time` says the lock's lease allows it.
fn copy(
    p: &Pending,
    from: (SharedEndpoint, RegionId),
    to: (SharedEndpoint, RegionId),
    len: u64,
    unit: u64,
    in_time: &dyn Fn() -> Result<(), FsError>,
) -> Result<(), FsError> {
    let (src, src_region) = from;
    let (dst, dst_region) = to;
    let piece = {
        let a = lock(&src).capabilities().max_io_bytes;
        let b = lock(&dst).capabilities().max_io_bytes;
        a.min(b).clamp(8, PIECE) as u64
    };
    let (src_base, dst_base) = (p.source.index * unit, p.loc.index * unit);
    let mut at = 0;
    while at < len {
        let n = (len - at).min(piece);
        let bytes = lock(&src).read(RemoteAddr::new(src_region, src_base + at), n as usize)?;
        in_time()?;
        lock(&dst).write(RemoteAddr::new(dst_region, dst_base + at), &bytes)?;
        at += n;
    }
    Ok(())
}
