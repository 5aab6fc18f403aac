//! POSIX record locks (`fcntl`'s `F_GETLK`, `F_SETLK`, `F_SETLKW`; `lockf`), kept for the whole
//! cluster by the meta server (`proto::records`, `Request::GetLk`/`SetLk`), so that they
//! exclude processes of other clients as they do processes of one.
//!
//! An owner is the kernel's lock owner (a process's file table, or an open file description
//! for OFD locks); the meta server tells owners of different clients apart by session. A wait
//! (`F_SETLKW`) is a series of calls, each waiting up to [`WAIT_SLICE`] at the meta server, so
//! that the caller's signal ends it between calls ([`Error::Interrupted`], EINTR) and a lost
//! meta server fails it instead of hanging it. POSIX gives a process's locks on a file back
//! when it closes any descriptor of it: the FUSE adapter calls [`CitronFs::release_records`] at
//! each close (FUSE's FLUSH), which costs a call only for owners that took a lock of that file
//! through this client ([`RecordOwners`]).
//!
//! Not done: deadlock detection (`EDEADLK`): two owners waiting for each other's locks wait
//! until a signal ends one wait. Locks live in the meta server's memory and in one session: a
//! meta server restart, or a reconnection after a lost connection, gives them all back, and
//! the processes that held them are not told.

use crate::client::{CitronFs, FileHandle};
use crate::error::Error;
use crate::meta::unexpected;
use proto::records::{RecordKind, RecordLock};
use proto::rpc::{Request, Response};
use proto::Ino;
use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// How long one `SetLk` call of a wait waits at the meta server for a conflicting lock to go:
/// how late a signal may end a wait.
pub const WAIT_SLICE: Duration = Duration::from_millis(200);

/// The (file, owner) pairs that may hold record locks taken through this client: a close by
/// an owner not in it gives nothing back and costs no call.
#[derive(Debug, Default)]
pub(crate) struct RecordOwners(Mutex<HashSet<(Ino, u64)>>);

impl RecordOwners {
    fn add(&self, ino: Ino, owner: u64) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((ino, owner));
    }

    /// Whether `owner` may hold locks of `ino`; forgets the pair.
    fn take(&self, ino: Ino, owner: u64) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(ino, owner))
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

    /// `F_SETLK` (`wait` `None`) or `F_SETLKW`: takes (`kind` set) or gives back (`None`)
    /// `owner`'s record lock over bytes `[start, end]` (inclusive) of `fh`'s file, with POSIX's
    /// rules. A lock that conflicts with another owner's fails with EAGAIN, or with `wait`
    /// waits until it can be taken, asking `wait` between the meta server's waits whether to
    /// stop ([`Error::Interrupted`] when it says so).
    #[allow(clippy::too_many_arguments)]
    pub fn setlk(
        &self,
        fh: FileHandle,
        owner: u64,
        start: u64,
        end: u64,
        kind: Option<RecordKind>,
        pid: u32,
        wait: Option<&dyn Fn() -> bool>,
    ) -> Result<(), Error> {
        let ino = self.inner.handle(fh)?.inode.ino;
        if kind.is_some() {
            // Before the call: a lock granted and then a close racing this bookkeeping must
            // still find the pair.
            self.inner.records.add(ino, owner);
        }
        let wait_ms = match wait {
            Some(_) => WAIT_SLICE.as_millis() as u32,
            None => 0,
        };
        loop {
            let call = Request::SetLk {
                ino,
                owner,
                start,
                end,
                kind,
                pid,
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
        match self.inner.meta.call(Request::SetLk {
            ino,
            owner,
            start: 0,
            end: u64::MAX,
            kind: None,
            pid: 0,
            wait_ms: 0,
        })? {
            Response::Ok => Ok(()),
            other => Err(unexpected("SetLk", other)),
        }
    }
}
