//! [`CitronFs`]'s record-lock calls: POSIX record locks (`fcntl`'s `F_GETLK`, `F_SETLK`,
//! `F_SETLKW`; `lockf`) and `flock`, kept for the whole cluster by the meta server. What this
//! client holds, and what it gives back when, is `records`' [`RecordOwners`] (see its module
//! docs for the rules).
//!
//! [`RecordOwners`]: crate::records::RecordOwners

use crate::client::CitronFs;
use crate::error::Error;
use crate::handles::FileHandle;
use crate::meta::unexpected;
use crate::records::{GRACE_RETRY, WAIT_SLICE};
use proto::records::{RecordClaim, RecordKind, RecordLock};
use proto::rpc::{Request, Response};
use proto::{FsError, Ino};

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
        loop {
            match self.try_getlk(fh, owner, start, end, kind) {
                // The locks of before are being taken back: the answer would miss them.
                Err(Error::Fs(FsError::InGrace)) => std::thread::sleep(GRACE_RETRY),
                other => return other,
            }
        }
    }

    /// [`CitronFs::getlk`] asked once: `FsError::InGrace` (EAGAIN) during the meta server's
    /// grace period after a restart, instead of waiting it out — for a caller that waits
    /// elsewhere (the FUSE adapter, on a thread of its own rather than a request thread).
    pub fn try_getlk(
        &self,
        fh: FileHandle,
        owner: u64,
        start: u64,
        end: u64,
        kind: RecordKind,
    ) -> Result<Option<RecordLock>, Error> {
        let ino = self.inner.files.handle(fh)?.inode.ino;
        let call = Request::GetLk {
            ino,
            owner,
            start,
            end,
            kind,
        };
        match self.inner.meta.call(call)? {
            Response::RecordLock(lock) => Ok(lock),
            other => Err(unexpected("GetLk", other)),
        }
    }

    /// [`CitronFs::setlk`] tried once, without waiting for anything: a lock in the way is
    /// `FsError::WouldBlock`, the meta server's grace period after a restart
    /// `FsError::InGrace` (both EAGAIN) — for a caller that waits elsewhere.
    pub fn try_setlk(&self, fh: FileHandle, claim: RecordClaim) -> Result<(), Error> {
        let ino = self.inner.files.handle(fh)?.inode.ino;
        if claim.kind.is_some() {
            self.inner.records.add(ino, fh, claim.owner);
        }
        self.inner.records.call(&self.inner.meta, ino, claim, 0)
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
        let ino = self.inner.files.handle(fh)?.inode.ino;
        if claim.kind.is_some() {
            self.inner.records.add(ino, fh, claim.owner);
        }
        let wait_ms = match wait {
            Some(_) => WAIT_SLICE.as_millis() as u32,
            None => 0,
        };
        loop {
            let stop = || wait.is_some_and(|stop| stop());
            match self
                .inner
                .records
                .call(&self.inner.meta, ino, claim, wait_ms)
            {
                Err(Error::Fs(FsError::WouldBlock)) if wait.is_some() => {}
                Err(Error::Fs(FsError::InGrace)) => std::thread::sleep(GRACE_RETRY),
                other => return other,
            }
            if stop() {
                return Err(Error::Interrupted);
            }
        }
    }

    /// Gives back every record lock `owner` holds on `fh`'s file (a close: POSIX gives a
    /// process's locks on a file back when it closes any descriptor of it). No call when
    /// `owner` took none of that file's through this client.
    pub fn release_records(&self, fh: FileHandle, owner: u64) -> Result<(), Error> {
        let ino = self.inner.files.handle(fh)?.inode.ino;
        if !self.inner.records.holds_at_close(ino, owner) {
            return Ok(());
        }
        self.inner.records.unlock_all(&self.inner.meta, ino, owner)
    }

    /// Whether reads and writes of `fh`'s file by lock owner `owner` (the kernel's, as in
    /// `F_SETLK`) may go on: [`Error::RecordLockLost`] (EIO) once a record lock of `owner` on
    /// the file, or one taken through `fh`, was lost (see the module docs), until the owner
    /// unlocks or closes the file. [`CitronFs::read`] and [`CitronFs::write`] check the
    /// handle's owners themselves; a caller that knows the I/O's owner (FUSE's direct I/O
    /// names it) checks it here first. One atomic load while no lock of this client was lost.
    pub fn check_record_locks(&self, fh: FileHandle, owner: u64) -> Result<(), Error> {
        if !self.inner.records.any_lost() {
            return Ok(());
        }
        let ino = self.inner.files.handle(fh)?.inode.ino;
        self.inner.records.check(fh, ino, Some(owner))
    }

    /// Whether closes of `ino`, opened now, must say who closed (FUSE's FLUSH): while this
    /// client holds record locks of it (see the module docs).
    pub fn wants_flush(&self, ino: Ino) -> bool {
        self.inner.records.any(ino)
    }
}
