//! The cluster as this client sees it now: the meta session, the data servers' layout, and the
//! fabric connectors that follow from them — replaced whole when the session or the layout
//! changes, so that a server restart does not break the mount.
//!
//! [`Views`] holds the current view. A [`View`] is immutable. [`Views::current`] returns the current one after a cheap check (two
//! atomic loads and a read lock) that the meta connection is up, that it still belongs to the
//! meta session the connection has, and that no heartbeat brought a newer layout epoch;
//! otherwise it builds the next one ([`Views::refresh`]): asks the meta server for the
//! layout (`Cluster`, which reconnects first if the connection broke — a new session), and
//! connects to the servers, keeping the connectors of data servers whose address and
//! incarnation did not change.
//!
//! Invariants:
//! - One call uses one view from start to end: a worker is built for one view (`workers`) and
//!   is dropped at checkout once a newer view exists, so no endpoint or lock handle of an old
//!   session or of a data server's earlier life is used after the client learnt of the change.
//! - What was opened in an older session is reopened in the current one before use
//!   (the client's `live_inode`): file control blocks and lock states live in the meta server's
//!   region, which a restarted meta server has laid out afresh.
//! - A data server that came back with new memory (a new incarnation) gets new connectors, and
//!   every chunk cache is emptied (the meta server now answers `Lost` for its chunks).

use crate::error::Error;
use crate::meta::{unexpected, Meta};
use crate::options::MountOptions;
use crate::plan::Geometry;
use crate::servers::Servers;
use fabric::RemoteAddr;
use proto::rpc::{Request, Response};
use proto::{ClusterInfo, FsError, Ino};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

/// How long a call of the data path (a read, a write, an fsync, a truncate, a stat of an open
/// file) may go on catching up and redoing its I/O after failures below the file system —
/// waiting for a data server that is down, restarting or cut off to register again —
/// counted from the call's start ([`Views::data_deadline`]): long enough for a restart, short
/// enough that nothing hangs. Then the call fails with EIO.
pub(crate) const DATA_SERVER_WAIT: Duration = Duration::from_secs(10);

/// The cluster as this client sees it (see the module docs).
pub(crate) struct View {
    /// Client-local, increasing with every new view.
    pub(crate) id: u64,
    /// The meta connection's generation (`Meta::generation`) this view belongs to.
    pub(crate) generation: u64,
    /// What the meta server said (`info.session` is this view's session).
    pub(crate) info: ClusterInfo,
    /// The connectors that follow from `info`.
    pub(crate) servers: Servers,
}

impl View {
    /// The first view, from what the meta server said at connect.
    pub(crate) fn first(info: ClusterInfo, opts: &MountOptions) -> Result<View, Error> {
        let servers = Servers::connect(&info, opts, None)?;
        Ok(View {
            id: 1,
            generation: 1,
            info,
            servers,
        })
    }

    /// The meta session this view belongs to.
    pub(crate) fn session(&self) -> u64 {
        self.info.session
    }

    /// Whether data server `id` is registered with the meta server (as of this view).
    pub(crate) fn data_server_live(&self, id: u32) -> bool {
        self.info
            .data_servers
            .iter()
            .any(|ds| ds.id == id && ds.live)
    }
}

/// The current [`View`] of a client, and what replaces it (see the module docs).
pub(crate) struct Views {
    /// The meta-server connection the layout is asked on.
    meta: Arc<Meta>,
    /// How this client was asked to connect (for the connectors of a new view).
    opts: MountOptions,
    /// The mount's chunk size and lock unit: a cluster that comes back with others is refused.
    geometry: Geometry,
    /// The installed view.
    current: RwLock<Arc<View>>,
    /// Serializes building new views.
    refresh: Mutex<()>,
    /// The installed view's id: a worker whose view has it (and is still current, see
    /// [`Views::is_current`]) is used without touching `current`'s lock or count.
    id: AtomicU64,
    /// The view id chunk caches must be of: a cache learnt under an older view is emptied
    /// (`chunks`), since a data server may have lost its chunks meanwhile.
    chunk_epoch: AtomicU64,
    /// Since when each data server that a call found unregistered has been away, by id
    /// ([`Views::data_deadline`]); a view that has it live again clears it.
    data_away: Mutex<HashMap<u32, Instant>>,
}

impl Views {
    /// Holds `first`, the view built at connect.
    pub(crate) fn new(
        meta: Arc<Meta>,
        opts: MountOptions,
        geometry: Geometry,
        first: View,
    ) -> Views {
        Views {
            meta,
            opts,
            geometry,
            chunk_epoch: AtomicU64::new(first.id),
            id: AtomicU64::new(first.id),
            current: RwLock::new(Arc::new(first)),
            refresh: Mutex::new(()),
            data_away: Mutex::default(),
        }
    }

    /// The installed view, as it is (not checked for being current).
    pub(crate) fn installed(&self) -> Arc<View> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The view id chunk caches must be of now (`chunks`).
    pub(crate) fn chunk_epoch(&self) -> &AtomicU64 {
        &self.chunk_epoch
    }

    /// Whether `view` is the installed view and still current: the meta connection is up, of
    /// the view's session, and no heartbeat brought a newer layout epoch. Atomic loads only.
    pub(crate) fn is_current(&self, view: &View) -> bool {
        view.id == self.id.load(Ordering::Acquire)
            && self.meta.is_up()
            && view.generation == self.meta.generation()
            && view.info.layout_epoch >= self.meta.layout_epoch()
    }

    /// The current view, refreshed first if it is out of date (see the module docs).
    pub(crate) fn current(&self) -> Result<Arc<View>, Error> {
        let view = self
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if self.is_current(&view) {
            return Ok(view);
        }
        self.refresh(view.id)
    }

    /// Builds and installs a new view unless one newer than view `seen` was installed meanwhile:
    /// fetches the layout (reconnecting to the meta server, a new session, if the connection
    /// broke) and connects to the servers it names.
    pub(crate) fn refresh(&self, seen: u64) -> Result<Arc<View>, Error> {
        let _one_at_a_time = self.refresh.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if current.id > seen {
            return Ok(current);
        }
        let (generation, info) = loop {
            let info = match self.meta.call(Request::Cluster)? {
                Response::Cluster(info) => *info,
                other => return Err(unexpected("Cluster", other)),
            };
            // The answer is of the session the connection had before and after the call; a
            // reconnection in between (a generation moved) means asking again.
            let (after, latest) = self.meta.latest();
            if after == self.meta.generation() && latest.session == info.session {
                self.meta.note_layout_epoch(info.layout_epoch);
                break (after, info);
            }
        };
        if info.chunk_size != self.geometry.chunk_size || info.lock_unit != self.geometry.lock_unit
        {
            return Err(Error::Protocol(format!(
                "the cluster's chunk size or lock unit changed (now {} and {} bytes): remount",
                info.chunk_size, info.lock_unit
            )));
        }
        let reuse = (current.session() == info.session).then_some(&current.servers);
        let servers = Servers::connect(&info, &self.opts, reuse)?;
        if current.session() != info.session {
            tracing::warn!(
                old = current.session(),
                new = info.session,
                "new meta session: files open on this client are reopened on their next use"
            );
        }
        let view = Arc::new(View {
            id: current.id + 1,
            generation,
            info,
            servers,
        });
        // A data server registered again ends its outage: the next one has a bound of its own.
        self.data_away
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|&id, _| !view.data_server_live(id));
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = view.clone();
        self.id.store(view.id, Ordering::Release);
        // Chunk locations learnt before may name chunks that are lost now: learn them again.
        self.chunk_epoch.store(view.id, Ordering::SeqCst);
        Ok(view)
    }

    /// When a call that began at `started` stops catching up with the cluster and redoing its
    /// I/O, and in particular stops waiting for data server `server` (`None`: no server in
    /// particular) to come back: [`DATA_SERVER_WAIT`] after the call began, or after this
    /// client first found `server` away in the outage it is in ([`Views::data_away`]),
    /// whichever is earlier. So one call ends within the bound however many times it waits
    /// and redoes, and a call made later in the same outage tries once and fails at once, as
    /// for the meta server (`Meta::away_since`). The one place that bound is decided.
    pub(crate) fn data_deadline(&self, started: Instant, server: Option<u32>) -> Instant {
        self.waiting_since(started, server) + DATA_SERVER_WAIT
    }

    /// What [`Views::data_deadline`] counts from: the call's start, or the first failure of
    /// `server`'s outage if that was earlier.
    pub(crate) fn waiting_since(&self, started: Instant, server: Option<u32>) -> Instant {
        let away = server.and_then(|id| {
            self.data_away
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&id)
                .copied()
        });
        away.map_or(started, |since| since.min(started))
    }

    /// Recovers from `failure`, an I/O failure below the file system (`Error::is_transient`),
    /// of a call that began at `started`, before the I/O is tried again: a fresh view
    /// (reconnecting to the meta server if needed, which waits for it within its own bound,
    /// `Meta::away_since`), and, when the failure was on a data server that is not registered
    /// now, a wait for it to come back until [`Views::data_deadline`]. Fails when the cluster
    /// stays unreachable past that bound, so nothing hangs; fails with `failure` itself when
    /// catching up finds this client's meta session over (a fence revoked it, or its lease
    /// ran out while the client was stopped): the I/O fails as any fenced I/O does (EIO), not
    /// with the Stale (ESTALE) the meta server answers an ended session — seen in `pause.rs`
    /// when a revocation reached the data path as a closed connection instead of a refusal. A
    /// refresh that fails below the file system is tried again within the same bound. An
    /// [`Error::ForeignFcb`] in the same session is mended by opening the file anew
    /// (`reopen_foreign`: `HandleTable::reopen_foreign`) when the meta server then gives it another block, and is
    /// final when it names the same one (the block was damaged).
    pub(crate) fn recover(
        &self,
        failure: Error,
        started: Instant,
        reopen_foreign: impl FnOnce(Ino, RemoteAddr, &View) -> Result<(), Error>,
    ) -> Result<Arc<View>, Error> {
        let mut reopen_foreign = Some(reopen_foreign);
        loop {
            let seen = self.installed().id;
            let view = match self.refresh(seen) {
                Err(Error::Fs(FsError::Stale)) => return Err(failure),
                // The meta server went away under the refresh (a restart's old connection
                // answering its last, `ServerStopping`): the connection was dropped, and the
                // next call reconnects. Not after a timeout or an unreachable host: that would
                // only wait again, and the I/O must fail within its bound.
                Err(Error::Rpc { source, .. })
                    if source.server_went_away()
                        && Instant::now() < self.data_deadline(started, None)
                        && !self.meta.is_closing() =>
                {
                    tracing::debug!(error = %source, "refreshing the view failed; trying again");
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                refreshed => refreshed?,
            };
            // A file control block of another file is the client behind a meta restart only
            // if the session moved on since the file was opened; in that session, it is a
            // disagreement no catching up mends.
            // In that session it is an open the meta server no longer holds (released too
            // early, its block given to another file): opened anew, if that gives the file a
            // block of its own; if the server names the same block, it is damaged, and final.
            if let Error::ForeignFcb {
                session, ino, fcb, ..
            } = &failure
            {
                if view.session() == *session {
                    let reopen = reopen_foreign.take().expect("the loop returns after it");
                    if reopen(*ino, *fcb, &view).is_err() {
                        return Err(failure);
                    }
                    return Ok(view);
                }
            }
            let waiting = match &failure {
                // The meta server had no data server to allocate on: wait for one.
                Error::Fs(FsError::Unavailable(_)) => {
                    !view.info.data_servers.iter().any(|ds| ds.live)
                }
                // The word read zero: this client's mapping of it was emptied, its server
                // stopped (shm). Wait until the server is back; the redo's fresh endpoints
                // map its new word.
                Error::StaleDataServer {
                    server, found: 0, ..
                } => !view.data_server_live(*server),
                // The server restarted: wait until the meta server has registered the
                // incarnation the batch found.
                Error::StaleDataServer { server, found, .. } => !view
                    .info
                    .data_servers
                    .iter()
                    .any(|ds| ds.id == *server && ds.live && ds.incarnation == *found),
                // A write or flush of chunks that all have replicas elsewhere: redone at once
                // (this view emptied every chunk cache, and the meta server dropped the
                // server's replicas before any view could call it away: docs/REPLICAS.md);
                // while the meta server still has it live, the redo meets it again and the
                // caller's growing pauses space the tries.
                Error::ReplicaServerFailed { .. } => false,
                _ => failure
                    .data_server()
                    .is_some_and(|id| !view.data_server_live(id)),
            };
            if !waiting {
                return Ok(view);
            }
            let server = failure.data_server();
            if let Some(id) = server.filter(|&id| !view.data_server_live(id)) {
                self.data_away
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(id)
                    .or_insert_with(Instant::now);
            }
            if Instant::now() >= self.data_deadline(started, server) || self.meta.is_closing() {
                return Err(match server {
                    Some(server) => Error::DataServerAway {
                        server,
                        waited: self.waiting_since(started, Some(server)).elapsed(),
                    },
                    None => Error::Fs(FsError::Unavailable(format!(
                        "no data server connected within {:?} of the call",
                        started.elapsed()
                    ))),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
