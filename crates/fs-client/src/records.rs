//! POSIX record locks (`fcntl`'s `F_GETLK`, `F_SETLK`, `F_SETLKW`; `lockf`), kept for the whole
//! cluster by the meta server (`proto::records`, `Request::GetLk`/`SetLk`), so that they
//! exclude processes of other clients as they do processes of one.
//!
//! An owner is the kernel's lock owner (a process's file table, or an open file description
//! for OFD locks); the meta server tells owners of different clients apart by session. A wait
//! (`F_SETLKW`) is a series of calls, each waiting up to [`WAIT_SLICE`] at the meta server, so
//! that the caller's signal ends it between calls ([`Error::Interrupted`], EINTR) and a lost
//! meta server fails it instead of hanging it.
//!
//! Giving locks back at a close. POSIX gives a process's locks on a file back when it closes
//! any descriptor of that file; the kernel tells a FUSE file system which owner closed only in
//! a FLUSH request, and a FLUSH at every close costs creates and opens 15–25 % (measured:
//! docs/ARCHITECTURE.md). So [`RecordOwners`] keeps, per file, the owners that took locks of it
//! through this client, and per handle, those that took them through that handle:
//! - a file opened while this client holds locks of it is opened with FLUSH
//!   ([`CitronFs::wants_flush`]), and each close of it gives the closing owner's locks back
//!   ([`CitronFs::release_records`]): POSIX exactly (the case that matters is a process that
//!   opens and closes a second descriptor of a file it has locked);
//! - a handle through which locks were taken gives them back when it is released (the last
//!   close of its open file description, which the kernel sends after `close` returns): a
//!   process that opens, locks and closes (or exits) holds its locks until then, not longer.
//!
//! What differs from POSIX, then: a close of a descriptor opened before the process's first
//! lock of the file, while another descriptor of it stays open, gives nothing back; and a lock
//! taken through a descriptor shared with a forked child lasts until both have closed it.
//!
//! Not done: deadlock detection (`EDEADLK`): two owners waiting for each other's locks wait
//! until a signal ends one wait. Locks live in the meta server's memory and in one session: a
//! meta server restart, or a reconnection after a lost connection, gives them all back, and
//! the processes that held them are not told.

use crate::client::{CitronFs, FileHandle};
use crate::error::Error;
use crate::meta::unexpected;
use proto::records::{RecordClaim, RecordKind, RecordLock};
use proto::rpc::{Request, Response};
use proto::Ino;
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// How long one `SetLk` call of a wait waits at the meta server for a conflicting lock to go:
/// how late a signal may end a wait.
pub const WAIT_SLICE: Duration = Duration::from_millis(200);

/// Which owners may hold record locks taken through this client: per file, and per handle
/// they were taken through (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct RecordOwners(Mutex<Owners>);

#[derive(Debug, Default)]
struct Owners {
    by_file: HashMap<Ino, HashSet<u64>>,
    by_handle: HashMap<u64, (Ino, HashSet<u64>)>,
}

impl RecordOwners {
    fn lock(&self) -> std::sync::MutexGuard<'_, Owners> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn add(&self, ino: Ino, fh: FileHandle, owner: u64) {
        let mut o = self.lock();
        o.by_file.entry(ino).or_default().insert(owner);
        o.by_handle
            .entry(fh.0)
            .or_insert_with(|| (ino, HashSet::new()))
            .1
            .insert(owner);
    }

    /// Whether `owner` may hold locks of `ino`; forgets it.
    fn take(&self, ino: Ino, owner: u64) -> bool {
        let mut o = self.lock();
        let Some(owners) = o.by_file.get_mut(&ino) else {
            return false;
        };
        let had = owners.remove(&owner);
        if owners.is_empty() {
            o.by_file.remove(&ino);
        }
        had
    }

    /// The file of handle `fh` and the owners that took locks through it and may hold them
    /// still; forgets the handle and them.
    fn take_handle(&self, fh: FileHandle) -> Option<(Ino, Vec<u64>)> {
        let (ino, through) = self.lock().by_handle.remove(&fh.0)?;
        let held = through
            .into_iter()
            .filter(|&owner| self.take(ino, owner))
            .collect();
        Some((ino, held))
    }

    fn any(&self, ino: Ino) -> bool {
        self.lock().by_file.contains_key(&ino)
    }
}

impl CitronFs {
    /// `F_GETLK`: the first record lock of another owner (of any client) that a lock of `kind`
    /// by `owner` over bytes `[start, end]` (inclusive) of `fh`'s file would conflict with.
    /// Its `pid` is 0 when it is held through another client.
    pub fn getlk(
        &self,
        fh: FileHandle,
        owner: u64,
        start: u64,
        end: u64,
        kind: RecordKind,
    ) -> Result<Option<RecordLock>, Error> {
        let ino = self.inner.handle(fh)?.inode.ino;
        match self.inner.meta.call(Request::GetLk {
            ino,
            owner,
            start,
            end,
            kind,
        })? {
            Response::RecordLock(lock) => Ok(lock),
            other => Err(unexpected("GetLk", other)),
        }
    }

    /// `F_SETLK` (`wait` `None`) or `F_SETLKW`: takes (`claim.kind` set) or gives back
    /// (`None`) the claim's owner's record lock over its bytes of `fh`'s file, with POSIX's
    /// rules. A lock that conflicts with another owner's fails with EAGAIN, or with `wait`
    /// waits until it can be taken, asking `wait` between the meta server's waits whether to
    /// stop ([`Error::Interrupted`] when it says so).
    pub fn setlk(
        &self,
        fh: FileHandle,
        claim: RecordClaim,
        wait: Option<&dyn Fn() -> bool>,
    ) -> Result<(), Error> {
        let ino = self.inner.handle(fh)?.inode.ino;
        if claim.kind.is_some() {
            // Before the call: a lock granted and then a close racing this bookkeeping must
            // still find the owner.
            self.inner.records.add(ino, fh, claim.owner);
        }
        let wait_ms = match wait {
            Some(_) => WAIT_SLICE.as_millis() as u32,
            None => 0,
        };
        loop {
            let call = Request::SetLk {
                ino,
                claim,
                wait_ms,
            };
            match self.inner.meta.call(call) {
                Ok(Response::Ok) => return Ok(()),
                Ok(other) => return Err(unexpected("SetLk", other)),
                Err(Error::Fs(proto::FsError::WouldBlock)) => match wait {
                    Some(stop) if stop() => return Err(Error::Interrupted),
                    Some(_) => {}
                    None => return Err(proto::FsError::WouldBlock.into()),
                },
                Err(e) => return Err(e),
            }
        }
    }

    /// Gives back every record lock `owner` holds on `fh`'s file (a close: POSIX gives a
    /// process's locks on a file back when it closes any descriptor of it). No call when
    /// `owner` took none of that file's through this client.
    pub fn release_records(&self, fh: FileHandle, owner: u64) -> Result<(), Error> {
        let ino = self.inner.handle(fh)?.inode.ino;
        if !self.inner.records.take(ino, owner) {
            return Ok(());
        }
        self.inner.unlock_all(ino, owner)
    }

    /// Whether closes of `ino`, opened now, must say who closed (FUSE's FLUSH): while this
    /// client holds record locks of it (see the module docs).
    pub fn wants_flush(&self, ino: Ino) -> bool {
        self.inner.records.any(ino)
    }
}

impl crate::client::Inner {
    /// Gives back the record locks of handle `fh`, being released: those taken through it and
    /// not given back since (see the module docs). Failures are logged: the handle goes anyway,
    /// and the session's end or the file's last release gives the locks back at the latest.
    pub(crate) fn release_handle_records(&self, fh: FileHandle) {
        let Some((ino, owners)) = self.records.take_handle(fh) else {
            return;
        };
        for owner in owners {
            if let Err(error) = self.unlock_all(ino, owner) {
                tracing::warn!(ino, owner, error = %crate::error::Chain(&error), "record locks not given back at a release");
            }
        }
    }

    /// Gives back every record lock of `owner` on `ino`.
    fn unlock_all(&self, ino: Ino, owner: u64) -> Result<(), Error> {
        match self.meta.call(Request::SetLk {
            ino,
            claim: RecordClaim::unlock_all(owner),
            wait_ms: 0,
        })? {
            Response::Ok => Ok(()),
            other => Err(unexpected("SetLk", other)),
        }
    }
}
