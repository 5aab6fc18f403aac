//! File handles and the inodes open on this client ([`HandleTable`]), what `CitronFs::open`,
//! `CitronFs::create` and `CitronFs::release` change.
//!
//! Owns two tables ([`HandleTable`]):
//! - the open inodes, each with its handle count: the first open of an inode by this client
//!   sends `Open` (which tells where the file control block and the lock live). While it is in
//!   flight the inode's entry is *busy*: other opens and closes of that inode wait for it (a
//!   condition variable), so at any time an inode has at most one [`OpenInode`] here, and it is
//!   the one the meta server's latest `Open` describes — while opens of other inodes proceed
//!   (the table's mutex is never held across an RPC, except by the rare `reopen`).
//!
//! **Lingering opens.** The last close sends nothing: the inode *lingers* in the table with
//! no handles ([`Linger::Queued`]) and its release rides ahead of the next call this client
//! makes to the meta server, whichever thread makes it (`RequestFrame::release_first`, through
//! [`Riders`]; the heartbeat carries it when the client is idle). So a close costs no round
//! trip and no meta-server request of its own (create + close: one RPC, not two), and a file
//! reopened before then is taken back without an `Open`. While the carrying call is in flight
//! the entry is [`Linger::Riding`] and a new open of the inode waits for it, then sends `Open`
//! — so an open never races the release of the same inode. The server releases a frame's
//! inodes before its request: an `Unlink` after a close finds the file no longer open (no
//! orphan), as before. A lingering open is an open like any other to the meta server and to
//! other clients (its FCB stays live, its size is persisted at the release); what lingers is
//! bounded by the inodes this client closed since its last call.
//! - the file handles, each naming its [`OpenInode`]; looked up (a read lock) by every read,
//!   write and fsync.
//!
//! An open belongs to the meta session that made it (`OpenInode::session`): after a
//! reconnection (a meta server restart) the data path reopens the inode in the new session
//! before using it ([`HandleTable::reopen`], called by the client's `live_inode`), replacing the table's
//! entry and every handle's reference to it; a last close sends `Release` only in the session
//! that holds the open.
//!
//! Closing bumps a *close epoch*: workers compare it at checkout and drop the lock handles of
//! closed files then (`lock_cache`), without taking the open-inode mutex (a checkout happens
//! while it is held, in [`HandleTable::open_inode`]).

use crate::chunks::ChunkCache;
use crate::error::Error;
use crate::meta::{unexpected, Meta, Riders};
use crate::view::View;
use fabric::RemoteAddr;
use lockmgr::{LockRef, LockScheme};
use proto::rpc::{Request, Response};
use proto::{Caller, FsError, Ino};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};

/// A file handle returned by `CitronFs::open` and `CitronFs::create`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileHandle(pub u64);

/// The file-handle and open-inode tables (see the module docs).
pub(crate) struct HandleTable {
    /// Inodes this client has open, with their handle counts, and the lingering ones.
    open: Mutex<OpenInodes>,
    /// Signalled when an entry stops being busy (its `Open` or `Release` answered).
    settled: Condvar,
    handles: RwLock<HashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    next_open_id: AtomicU64,
    /// Bumped at every last close: workers then drop lock handles of closed files.
    close_epoch: AtomicU64,
    /// The lock scheme every `Open` asks for (the mount's).
    scheme: LockScheme,
}

/// The open-inode table.
#[derive(Default)]
struct OpenInodes {
    entries: HashMap<Ino, OpenEntry>,
    /// Inodes whose last close queued their release ([`Linger::Queued`]), in closing order;
    /// an inode reopened meanwhile stays listed and is skipped ([`Riders::take`]).
    lingering: Vec<Ino>,
    /// `Create` calls in flight on this client ([`Creating`]).
    creates: usize,
    /// The inodes whose release a call carried while a `Create` was in flight (emptied when
    /// none is): a `Create` answered for one of them had its open ended by that release
    /// ([`HandleTable::adopt_open`]).
    released_while_creating: HashSet<Ino>,
}

impl OpenInodes {
    /// One `Create` in flight less.
    fn end_create(&mut self) {
        self.creates = self.creates.saturating_sub(1);
        if self.creates == 0 {
            self.released_while_creating.clear();
        }
    }
}

/// A `Create` in flight ([`HandleTable::creating`]), counted in the open-inode table until it is
/// adopted ([`HandleTable::adopt_open`]) or dropped (the call failed).
pub(crate) struct Creating<'a> {
    files: &'a HandleTable,
    /// Counted out already (by `adopt_open`).
    ended: bool,
}

impl Drop for Creating<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.files.open_inodes().end_create();
        }
    }
}

impl HandleTable {
    /// Empty tables of a mount whose files are locked with `scheme`.
    pub(crate) fn new(scheme: LockScheme) -> HandleTable {
        HandleTable {
            open: Mutex::new(OpenInodes::default()),
            settled: Condvar::new(),
            handles: RwLock::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            next_open_id: AtomicU64::new(1),
            close_epoch: AtomicU64::new(0),
            scheme,
        }
    }

    /// How many last closes this client has seen (see the module docs).
    pub(crate) fn close_epoch(&self) -> u64 {
        self.close_epoch.load(Ordering::Relaxed)
    }

    /// The open-inode table, locked.
    fn open_inodes(&self) -> MutexGuard<'_, OpenInodes> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The table locked with `ino`'s entry not busy (absent, or settled: no `Open` in flight,
    /// no release riding on a call).
    fn settled(&self, ino: Ino) -> MutexGuard<'_, OpenInodes> {
        let mut open = self.open_inodes();
        while open
            .entries
            .get(&ino)
            .is_some_and(|e| e.busy || e.linger == Linger::Riding)
        {
            open = self
                .settled
                .wait(open)
                .unwrap_or_else(PoisonError::into_inner);
        }
        open
    }

    /// Empties the open-inode table and returns what was open (the client is going away).
    pub(crate) fn take_all_open(&self) -> Vec<Arc<OpenInode>> {
        let mut open = self.open_inodes();
        open.lingering.clear();
        let taken = open
            .entries
            .drain()
            .filter_map(|(_, entry)| entry.inode)
            .collect();
        drop(open);
        self.settled.notify_all();
        taken
    }
}

struct OpenEntry {
    /// None while the first `Open` is in flight.
    inode: Option<Arc<OpenInode>>,
    handles: usize,
    /// An `Open` or `Release` of this inode is in flight: wait for it (see the module docs).
    busy: bool,
    /// Where the release of a closed inode (no handles) stands.
    linger: Linger,
    /// Readers of the FCB right now ([`HandleTable::pin_open`]): while any, a queued release is not
    /// handed to a call (it stays queued for a later one).
    pins: usize,
}

/// Whether an open found this client holding the inode already ([`HandleTable::open_inode_first`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FirstOpen {
    /// It had handles on it.
    No,
    /// It had none, and sent `Open`, which answered this link count.
    Sent(u32),
    /// It had none, and took a lingering open back without an RPC.
    Lingering,
}

/// The release of an inode this client has closed (see the module docs, "lingering opens").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Linger {
    /// The inode has handles (or its `Open` is in flight).
    No,
    /// Closed; its release waits for the next call to the meta server. A new open takes the
    /// inode back without an RPC.
    Queued,
    /// Closed; its release rides on a call in flight. A new open waits for that call, then
    /// sends `Open`.
    Riding,
}

impl Riders for HandleTable {
    fn take(&self, session: u64) -> Vec<Ino> {
        // Never waits for the table: a thread may call the meta server while it holds it
        // (`reopen`, and what its `Open` needs: a new view, the FCB check). The releases then
        // ride on a later call (the heartbeat's at the latest).
        let mut open = match self.open.try_lock() {
            Ok(open) => open,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Vec::new(),
        };
        let OpenInodes {
            entries, lingering, ..
        } = &mut *open;
        let mut riding = Vec::new();
        let mut pinned = Vec::new();
        let mut ended = false;
        for ino in lingering.drain(..) {
            let Some(entry) = entries.get_mut(&ino) else {
                continue;
            };
            // Reopened since (No), or listed twice (closed, reopened, closed: Riding).
            if entry.linger != Linger::Queued {
                continue;
            }
            // Its FCB is being read: released by a later call.
            if entry.pins > 0 {
                pinned.push(ino);
                continue;
            }
            let Some(inode) = entry.inode.clone() else {
                continue;
            };
            if inode.session != session {
                // Its open ended with its session: nothing to release.
                entries.remove(&ino);
                inode.closed.store(true, Ordering::Relaxed);
                ended = true;
                continue;
            }
            entry.linger = Linger::Riding;
            riding.push(ino);
        }
        *lingering = pinned;
        drop(open);
        if ended {
            self.close_epoch.fetch_add(1, Ordering::Relaxed);
            self.settled.notify_all();
        }
        riding
    }

    fn done(&self, inos: &[Ino]) {
        let mut open = self.open_inodes();
        if open.creates > 0 {
            open.released_while_creating.extend(inos.iter().copied());
        }
        for ino in inos {
            // Riding entries are never reopened (`settled` waits for them) nor taken by
            // another call, so each is still this call's.
            if open
                .entries
                .get(ino)
                .is_some_and(|e| e.linger == Linger::Riding)
            {
                if let Some(inode) = open.entries.remove(ino).and_then(|e| e.inode) {
                    inode.closed.store(true, Ordering::Relaxed);
                }
            }
        }
        drop(open);
        self.close_epoch.fetch_add(1, Ordering::Relaxed);
        self.settled.notify_all();
    }
}

/// An inode open on this client.
pub(crate) struct OpenInode {
    pub(crate) ino: Ino,
    /// Unique per `Open` RPC: lock handles opened for an earlier open of the same inode (whose
    /// lock state may have moved) are not reused.
    pub(crate) open_id: u64,
    /// The meta session the `Open` was made in (`ClusterInfo::session`).
    pub(crate) session: u64,
    /// The file control block (SIZE, GENERATION, MTIME, MODE, the records of replicated writes:
    /// `proto::fcb`) in the meta region.
    pub(crate) fcb: RemoteAddr,
    /// The file's lock state in the meta region (what `locks::open_file_lock` opens).
    pub(crate) lock: LockRef,
    /// Where its chunks live, as far as this client knows.
    pub(crate) chunks: ChunkCache,
    /// Set at the last close: workers drop their lock handles on it.
    pub(crate) closed: AtomicBool,
    /// Set once a write of it recorded itself (it met a chunk of two or more replicas,
    /// `cut_repair::before_write`): later writes claim their record's slot in the lock's grant where the scheme allows
    /// (`cut_repair::claim_in_grant`).
    pub(crate) replicated: AtomicBool,
}

/// What a file handle stands for.
pub(crate) struct Handle {
    pub(crate) inode: Arc<OpenInode>,
    /// Who opened it (a library write by a caller other than root clears set-ID bits).
    pub(crate) caller: Caller,
    /// open(2) flags (`O_APPEND` matters to writes).
    pub(crate) flags: i32,
}

impl HandleTable {
    /// A new file handle on `inode` (counted in the open-inode table already).
    pub(crate) fn new_handle(
        &self,
        inode: Arc<OpenInode>,
        caller: Caller,
        flags: i32,
    ) -> FileHandle {
        let files = self;
        let fh = files.next_fh.fetch_add(1, Ordering::Relaxed);
        files
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
        FileHandle(fh)
    }

    /// What handle `fh` stands for (`Stale` once released).
    pub(crate) fn handle(&self, fh: FileHandle) -> Result<Arc<Handle>, Error> {
        self.handles
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&fh.0)
            .cloned()
            .ok_or(Error::Fs(FsError::Stale))
    }

    /// Forgets handle `fh` and returns what it stood for (`Stale` once released). The inode
    /// stays counted open until [`HandleTable::close_inode`].
    pub(crate) fn remove_handle(&self, fh: FileHandle) -> Result<Arc<Handle>, Error> {
        self.handles
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&fh.0)
            .ok_or(Error::Fs(FsError::Stale))
    }

    /// `ino`, if this client has it open (lingering included: the meta server still holds
    /// that open and its FCB), pinned until the caller's [`HandleTable::unpin_open`], so that the
    /// open is not released while the caller reads its FCB (a lingering open's release would
    /// otherwise ride on another thread's call at any moment, and the block be freed and given
    /// to another file under the read: `Riders::take` keeps a pinned release queued). `None`
    /// while its `Open` or its release is in flight: the meta server may have freed the FCB
    /// already. A pin is not an open: a lingering inode stays queued, listed once.
    pub(crate) fn pin_open(&self, ino: Ino) -> Option<Arc<OpenInode>> {
        let mut open = self.open_inodes();
        let entry = open.entries.get_mut(&ino)?;
        if entry.busy || entry.linger == Linger::Riding {
            return None;
        }
        let inode = entry.inode.clone()?;
        if inode.closed.load(Ordering::Relaxed) {
            return None;
        }
        entry.pins += 1;
        Some(inode)
    }

    /// Ends a [`HandleTable::pin_open`] of `ino`.
    pub(crate) fn unpin_open(&self, ino: Ino) {
        if let Some(entry) = self.open_inodes().entries.get_mut(&ino) {
            entry.pins = entry.pins.saturating_sub(1);
        }
    }

    /// Counts one more open of `ino` on this client, sending `Open` on the first (without
    /// holding the table: see the module docs).
    pub(crate) fn open_inode(&self, meta: &Meta, ino: Ino) -> Result<Arc<OpenInode>, Error> {
        self.open_inode_first(meta, ino).map(|(inode, _)| inode)
    }

    /// [`HandleTable::open_inode`], saying whether this client held a handle on `ino` before.
    pub(crate) fn open_inode_first(
        &self,
        meta: &Meta,
        ino: Ino,
    ) -> Result<(Arc<OpenInode>, FirstOpen), Error> {
        let mut open = self.settled(ino);
        if let Some(entry) = open.entries.get_mut(&ino) {
            if let Some(inode) = &entry.inode {
                let first = match entry.linger {
                    Linger::No => FirstOpen::No,
                    Linger::Queued | Linger::Riding => FirstOpen::Lingering,
                };
                // A lingering inode is taken back: its queued release is skipped.
                entry.handles += 1;
                entry.linger = Linger::No;
                return Ok((inode.clone(), first));
            }
        }
        open.entries.insert(
            ino,
            OpenEntry {
                inode: None,
                handles: 0,
                busy: true,
                linger: Linger::No,
                pins: 0,
            },
        );
        drop(open);
        let sent = self.send_open(meta, ino);
        let mut open = self.open_inodes();
        let result = match (sent, open.entries.get_mut(&ino)) {
            (Ok((inode, nlink)), Some(entry)) => {
                entry.inode = Some(inode.clone());
                entry.handles = 1;
                entry.busy = false;
                Ok((inode, FirstOpen::Sent(nlink)))
            }
            (Ok(_), None) => {
                // The client is going away (`take_all_open` emptied the table).
                let _ = meta.call(Request::Release { ino });
                Err(Error::Fs(FsError::Stale))
            }
            (Err(e), _) => {
                open.entries.remove(&ino);
                Err(e)
            }
        };
        drop(open);
        self.settled.notify_all();
        result
    }

    /// Sends `Open` for `ino` and checks what it names. The open is tagged with the session the
    /// client had before the call: if a reconnection happened during it, the tag is older than
    /// the session that holds the open, and the next use reopens it (harmless), never the
    /// other way round.
    /// Also the file's link count at the open.
    fn send_open(&self, meta: &Meta, ino: Ino) -> Result<(Arc<OpenInode>, u32), Error> {
        let session = meta.session();
        let opened = match meta.call(Request::Open {
            ino,
            scheme: self.scheme,
        })? {
            Response::Open(opened) => opened,
            other => return Err(unexpected("Open", other)),
        };
        let nlink = opened.attr.nlink;
        Ok((self.opened(ino, session, opened), nlink))
    }

    /// The [`OpenInode`] an `Open` (or `Create`) answered in `session` describes. Its FCB is
    /// checked at each use (`fcb::check_owner`), not here: that took a round trip per open.
    fn opened(&self, ino: Ino, session: u64, opened: proto::OpenFile) -> Arc<OpenInode> {
        Arc::new(OpenInode {
            ino,
            open_id: self.next_open_id.fetch_add(1, Ordering::Relaxed),
            session,
            fcb: opened.fcb,
            lock: opened.lock,
            chunks: ChunkCache::new(ino, opened.attr.generation),
            closed: AtomicBool::new(false),
            replicated: AtomicBool::new(false),
        })
    }

    /// Counts a `Create` about to be sent: until its answer is adopted ([`HandleTable::adopt_open`]),
    /// the releases that calls carry are noted, since the new file may be among them.
    pub(crate) fn creating(&self) -> Creating<'_> {
        self.open_inodes().creates += 1;
        Creating {
            files: self,
            ended: false,
        }
    }

    /// Counts an open of `ino` that a `Create` sent in `session` made. The file is new, so this
    /// client normally has no entry for it. If another thread opened it meanwhile (the
    /// Create's open, to the meta server, which keeps one open per session and inode), that
    /// open is shared. If such an open was closed meanwhile and its release carried, the
    /// Create's open ended with it (its FCB may be another file's now): the file is opened
    /// anew.
    pub(crate) fn adopt_open(
        &self,
        meta: &Meta,
        mut creating: Creating<'_>,
        ino: Ino,
        session: u64,
        opened: proto::OpenFile,
    ) -> Result<Arc<OpenInode>, Error> {
        let inode = self.opened(ino, session, opened);
        let mut open = self.settled(ino);
        let released = open.released_while_creating.contains(&ino);
        open.end_create();
        creating.ended = true;
        if let Some(entry) = open.entries.get_mut(&ino) {
            if let Some(existing) = &entry.inode {
                entry.handles += 1;
                entry.linger = Linger::No;
                return Ok(existing.clone());
            }
        }
        if released {
            drop(open);
            tracing::debug!(
                ino,
                "a created file's open was released meanwhile: opened anew"
            );
            return self.open_inode(meta, ino);
        }
        open.entries.insert(
            ino,
            OpenEntry {
                inode: Some(inode.clone()),
                handles: 1,
                busy: false,
                linger: Linger::No,
                pins: 0,
            },
        );
        Ok(inode)
    }

    /// Opens `ino` again in `view`'s session (it was opened in an earlier one, which a restart
    /// of the meta server ended), unless another thread did already; the open-inode table and
    /// every handle on `ino` then name the new open. `Stale` if the inode was closed meanwhile.
    pub(crate) fn reopen(
        &self,
        meta: &Meta,
        ino: Ino,
        view: &View,
    ) -> Result<Arc<OpenInode>, Error> {
        let mut open = self.settled(ino);
        let Some(entry) = open.entries.get_mut(&ino) else {
            return Err(Error::Fs(FsError::Stale));
        };
        let Some(current) = entry.inode.as_mut() else {
            return Err(Error::Fs(FsError::Stale));
        };
        if current.session == view.session() {
            return Ok(current.clone());
        }
        // Rare (after a meta server restart): the table stays locked across this `Open`.
        let (inode, _) = self.send_open(meta, ino)?;
        tracing::info!(
            ino,
            session = inode.session,
            "reopened in the new meta session"
        );
        self.replace_open(current, inode.clone());
        Ok(inode)
    }

    /// Opens `ino` anew in `view`'s session because its control block at `fcb` was found to
    /// be another file's while this client still counts the open (an open the meta server no
    /// longer holds: released too early), unless another thread did already; the open-inode
    /// table and every handle on `ino` then name the new open. An error when the block the
    /// meta server then names is not the file's either (the block itself is damaged: opening
    /// again mends nothing) or the open fails.
    pub(crate) fn reopen_foreign(
        &self,
        meta: &Meta,
        ino: Ino,
        fcb: RemoteAddr,
        view: &View,
        check: impl FnOnce(&Arc<OpenInode>) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut open = self.settled(ino);
        let Some(current) = open
            .entries
            .get_mut(&ino)
            .and_then(|entry| entry.inode.as_mut())
        else {
            return Err(Error::Fs(FsError::Stale));
        };
        if current.fcb != fcb || current.session != view.session() {
            // Reopened meanwhile, by another thread or in a new session.
            return Ok(());
        }
        // Rare: the table stays locked across this `Open` and the read of the block it names,
        // which must be the file's now (else the block is damaged: the error says so).
        let (inode, _) = self.send_open(meta, ino)?;
        check(&inode)?;
        tracing::warn!(
            ino,
            old = %fcb,
            new = %inode.fcb,
            "a file's control block was another file's: opened it anew"
        );
        self.replace_open(current, inode);
        Ok(())
    }

    /// Puts `inode`, a new open of `current`'s file, in its place: in the open-inode table
    /// entry `current` and in every handle on the file; `current` is closed (workers drop
    /// its lock handles).
    fn replace_open(&self, current: &mut Arc<OpenInode>, inode: Arc<OpenInode>) {
        let ino = inode.ino;
        let old = std::mem::replace(current, inode.clone());
        old.closed.store(true, Ordering::Relaxed);
        self.close_epoch.fetch_add(1, Ordering::Relaxed);
        let mut handles = self.handles.write().unwrap_or_else(PoisonError::into_inner);
        for handle in handles.values_mut() {
            if handle.inode.ino == ino {
                *handle = Arc::new(Handle {
                    inode: inode.clone(),
                    caller: handle.caller,
                    flags: handle.flags,
                });
            }
        }
    }

    /// Counts one open of `ino` less. After the last, the inode *lingers*: its release is
    /// queued to ride on the next call to the meta server (any thread's, the heartbeat at
    /// the latest: [`Riders`]), and a new open meanwhile takes it back without an RPC (see
    /// the module docs).
    pub(crate) fn close_inode(&self, meta: &Meta, ino: Ino) {
        let mut open = self.settled(ino);
        let Some(entry) = open.entries.get_mut(&ino) else {
            return;
        };
        let Some(inode) = entry.inode.clone() else {
            return;
        };
        entry.handles = entry.handles.saturating_sub(1);
        if entry.handles > 0 {
            return;
        }
        // An open of an earlier session ended with that session.
        if inode.session != meta.session() {
            open.entries.remove(&ino);
            drop(open);
            inode.closed.store(true, Ordering::Relaxed);
            self.close_epoch.fetch_add(1, Ordering::Relaxed);
            return;
        }
        entry.linger = Linger::Queued;
        open.lingering.push(ino);
    }
}
