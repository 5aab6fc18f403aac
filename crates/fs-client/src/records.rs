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
//! docs/ARCHITECTURE.md). So `RecordOwners` keeps the locks granted through this client, and
//! per handle the owners that took locks through it:
//! - a file opened while this client holds locks of it is opened with FLUSH
//!   ([`crate::CitronFs::wants_flush`]), and each close of it gives the closing owner's locks back
//!   ([`crate::CitronFs::release_records`]): POSIX exactly (the case that matters is a process that
//!   opens and closes a second descriptor of a file it has locked);
//! - a handle through which locks were taken gives them back when it is released (the last
//!   close of its open file description, which the kernel sends after `close` returns): a
//!   process that opens, locks and closes (or exits) holds its locks until then, not longer.
//!
//! What differs from POSIX, then: a close of a descriptor opened before the process's first
//! lock of the file, while another descriptor of it stays open, gives nothing back; and a lock
//! taken through a descriptor shared with a forked child lasts until both have closed it.
//!
//! After a restart. Locks live in the meta server's memory, so the client keeps its own account
//! of what was granted (a [`Table`] under one session), and when its heartbeat finds a new
//! meta session it takes them all back (`SetLk` with `reclaim`): a restarted meta server grants
//! only such reclaims during its grace period (`meta_server::MetaConfig::record_lock_grace`, 2 s)
//! and answers other new locks and `F_GETLK` `InGrace`, which the client asks again 50 ms later
//! ([`crate::CitronFs::try_setlk`] and [`crate::CitronFs::try_getlk`] ask once, for a caller that waits
//! elsewhere: the FUSE adapter waits on a thread of its own, not a request thread). A session
//! that ended without a restart (a lost connection, a fence, a client stopped past its session
//! lease) has no grace: a lock another client took meanwhile cannot be taken back. It is then
//! *lost*, as NFS has it (Linux's default, `nfs.recover_lost_locks=0`): the owner's reads and
//! writes of the file fail with EIO ([`Error::RecordLockLost`], [`crate::CitronFs::check_record_locks`]),
//! and so do those through the handle it was taken through, until the owner unlocks (any
//! `F_UNLCK` of the file) or closes the file. A process that went on writing as if it still
//! held the lock would interleave its writes with the new holder's; failing them is how it
//! learns, since nothing else tells a process that its lock is gone.
//!
//! `flock` arrives the same way (`FUSE_FLOCK_LOCKS`): a lock of the whole file whose owner is
//! the open file, taken through its handle and so given back at the handle's release.
//!
//! Deadlocks: the meta server keeps who waits for what (`proto::records::Table::wait`), and a
//! wait that would close a cycle of owners each waiting for the next one's lock fails with
//! EDEADLK, as on a local file system.

use crate::error::Error;
use crate::handles::FileHandle;
use crate::meta::{unexpected, Meta, NewSession};
use proto::records::{Owner, RecordClaim, Table};
use proto::rpc::{Request, Response};
use proto::Ino;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::Duration;

/// How long one `SetLk` call of a wait waits at the meta server for a conflicting lock to go:
/// how late a signal may end a wait.
pub const WAIT_SLICE: Duration = Duration::from_millis(200);

/// How soon a new lock refused for the meta server's grace period (`FsError::InGrace`) is
/// asked again.
pub(crate) const GRACE_RETRY: Duration = Duration::from_millis(50);

/// The record locks of this client, as granted (what it takes back when a new meta session
/// begins: [`RecordOwners::reclaim`]; who holds locks of a file), and through which handle
/// each owner took them (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct RecordOwners {
    owners: Mutex<Owners>,
    /// Held (shared) by every `SetLk` call with its bookkeeping, and (exclusive) by a reclaim:
    /// what a reclaim takes back is exactly what the meta server granted and nothing since
    /// gave back.
    calls: RwLock<()>,
    /// Whether [`Owners::lost`] has anything. Invariant: written only under the `owners`
    /// mutex, right after `lost` changed; every read and write loads it, and takes the mutex
    /// only when it is set (see [`RecordOwners::check`]).
    any_lost: AtomicBool,
}

#[derive(Debug, Default)]
struct Owners {
    /// The owners that took locks through each handle, and its file.
    by_handle: HashMap<u64, (Ino, HashSet<u64>)>,
    /// The locks granted to this client's owners (all under session 0).
    held: Table,
    /// The owners whose locks of a file were lost (see the module docs): `(file, owner)`,
    /// until the owner unlocks or closes the file.
    lost: HashSet<(Ino, u64)>,
}

/// An owner of this client in its account ([`Owners::held`]).
fn mine(owner: u64) -> Owner {
    Owner { session: 0, owner }
}

impl RecordOwners {
    fn lock(&self) -> std::sync::MutexGuard<'_, Owners> {
        self.owners.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Notes that `owner` lost locks of `ino`.
    fn lose(&self, ino: Ino, owner: u64) {
        let mut o = self.lock();
        o.lost.insert((ino, owner));
        self.any_lost.store(true, Ordering::SeqCst);
    }

    /// Forgets that `owner` lost locks of `ino` (it unlocked or closed the file).
    fn forgive(&self, o: &mut Owners, ino: Ino, owner: u64) {
        if o.lost.remove(&(ino, owner)) {
            self.any_lost.store(!o.lost.is_empty(), Ordering::SeqCst);
        }
    }

    /// Whether some owner of this client lost record locks (see the module docs).
    pub(crate) fn any_lost(&self) -> bool {
        self.any_lost.load(Ordering::SeqCst)
    }

    /// Whether I/O of `ino` through handle `fh` by lock owner `owner` (if the caller knows
    /// it) may go on: not if `owner` lost locks of the file, nor if an owner that took locks
    /// through `fh` did (a `flock` lock's owner is its open file, which no read names).
    pub(crate) fn check(&self, fh: FileHandle, ino: Ino, owner: Option<u64>) -> Result<(), Error> {
        if !self.any_lost.load(Ordering::SeqCst) {
            return Ok(());
        }
        let o = self.lock();
        let lost = |owner: u64| o.lost.contains(&(ino, owner));
        let through = o.by_handle.get(&fh.0).map(|(_, owners)| owners);
        if owner.is_some_and(lost) || through.is_some_and(|owners| owners.iter().any(|&w| lost(w)))
        {
            return Err(Error::RecordLockLost { ino });
        }
        Ok(())
    }

    /// Makes `SetLk` call `claim` on `ino`, and keeps what it granted. An unlock ends a loss
    /// of the owner's locks of the file (see the module docs).
    pub(crate) fn call(
        &self,
        meta: &Meta,
        ino: Ino,
        claim: RecordClaim,
        wait_ms: u32,
    ) -> Result<(), Error> {
        let _calls = self.calls.read().unwrap_or_else(PoisonError::into_inner);
        let call = Request::SetLk {
            ino,
            claim,
            wait_ms,
            reclaim: false,
        };
        match meta.call(call)? {
            Response::Ok => {
                let mut o = self.lock();
                if let Err(in_the_way) = o.held.set(ino, 0, &claim) {
                    // Not reached while the account follows the meta server's grants: this
                    // lock would then not be taken back after a restart.
                    tracing::warn!(ino, ?claim, ?in_the_way, "record lock account out of step");
                }
                if claim.kind.is_none() {
                    self.forgive(&mut o, ino, claim.owner);
                }
                Ok(())
            }
            other => Err(unexpected("SetLk", other)),
        }
    }

    /// Takes back, in a new meta session (the meta server restarted, or the connection was
    /// lost), every lock this client held: during the server's grace period after a restart
    /// nobody else can have taken them. One that another client holds by now (a session that
    /// ended without a restart), or that cannot be asked for, is lost: logged, gone from the
    /// account, and its owner's I/O of the file fails until it unlocks or closes the file.
    pub(crate) fn reclaim(&self, meta: &Meta) {
        let _calls = self.calls.write().unwrap_or_else(PoisonError::into_inner);
        let claims = self.lock().held.claims();
        if claims.is_empty() {
            return;
        }
        tracing::warn!(
            locks = claims.len(),
            "new meta session: taking back this client's record locks"
        );
        for (ino, _, claim) in claims {
            let call = Request::SetLk {
                ino,
                claim,
                wait_ms: 0,
                reclaim: true,
            };
            let error = match meta.call(call) {
                Ok(Response::Ok) => continue,
                Ok(other) => unexpected("SetLk", other),
                Err(e) => e,
            };
            tracing::error!(
                ino,
                start = claim.start,
                end = claim.end,
                error = %crate::error::Chain(&error),
                "a record lock of this client could not be taken back after the meta session \
                 ended: its process no longer holds it, and its reads and writes of the file \
                 fail until it unlocks or closes it"
            );
            let gone = RecordClaim {
                kind: None,
                ..claim
            };
            let _ = self.lock().held.set(ino, 0, &gone);
            self.lose(ino, claim.owner);
        }
    }

    /// Notes that `owner` takes a lock of `ino` through handle `fh`, and through no other
    /// handle of `ino` any more: its locks of the file go with this handle's release now. The
    /// kernel sends a handle's release after the close, in the background, and a process that
    /// closed the file (its locks given back by the close) and opened and locked it again
    /// could see the old handle's late release give back its new lock (`record_locks.rs`,
    /// once in a full run of the suite: another client then got a conflicting lock).
    pub(crate) fn add(&self, ino: Ino, fh: FileHandle, owner: u64) {
        let mut o = self.lock();
        for (&other, (file, through)) in o.by_handle.iter_mut() {
            if other != fh.0 && *file == ino {
                through.remove(&owner);
            }
        }
        o.by_handle
            .entry(fh.0)
            .or_insert_with(|| (ino, HashSet::new()))
            .1
            .insert(owner);
    }

    /// Whether `owner` holds locks of `ino`; a close that asks ends a loss of them.
    pub(crate) fn holds_at_close(&self, ino: Ino, owner: u64) -> bool {
        let mut o = self.lock();
        self.forgive(&mut o, ino, owner);
        o.held.holds(ino, mine(owner))
    }

    /// The file of handle `fh` and the owners that took locks through it and hold them still;
    /// forgets the handle, and the losses of those owners (the handle's release closes the
    /// file for them).
    fn take_handle(&self, fh: FileHandle) -> Option<(Ino, Vec<u64>)> {
        let mut o = self.lock();
        let (ino, through) = o.by_handle.remove(&fh.0)?;
        for &owner in &through {
            self.forgive(&mut o, ino, owner);
        }
        let held = through
            .into_iter()
            .filter(|&owner| o.held.holds(ino, mine(owner)))
            .collect();
        Some((ino, held))
    }

    /// Whether this client holds record locks of `ino`.
    pub(crate) fn any(&self, ino: Ino) -> bool {
        self.lock().held.any(ino)
    }
}

impl RecordOwners {
    /// `CitronFs::check_record_locks` for the owners that took locks through `fh`, whoever
    /// does the I/O: the data path's check.
    pub(crate) fn check_handle(&self, fh: FileHandle, ino: Ino) -> Result<(), Error> {
        self.check(fh, ino, None)
    }

    /// Gives back the record locks of handle `fh`, being released: those taken through it and
    /// not given back since (see the module docs). Failures are logged: the handle goes anyway,
    /// and the session's end or the file's last release gives the locks back at the latest.
    pub(crate) fn release_handle(&self, meta: &Meta, fh: FileHandle) {
        let Some((ino, owners)) = self.take_handle(fh) else {
            return;
        };
        for owner in owners {
            if let Err(error) = self.unlock_all(meta, ino, owner) {
                tracing::warn!(ino, owner, error = %crate::error::Chain(&error), "record locks not given back at a release");
            }
        }
    }

    /// Gives back every record lock of `owner` on `ino`.
    pub(crate) fn unlock_all(&self, meta: &Meta, ino: Ino, owner: u64) -> Result<(), Error> {
        self.call(meta, ino, RecordClaim::unlock_all(owner), 0)
    }
}

impl NewSession for RecordOwners {
    /// Takes the record locks of the session that ended back ([`RecordOwners::reclaim`]).
    fn new_session(&self, meta: &Meta) {
        self.reclaim(meta);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An owner's locks of a file go with the release of the handle it locked through last, not
    /// with a late release of one it locked through before.
    #[test]
    fn an_owners_locks_go_with_the_handle_it_locked_through_last() {
        let r = RecordOwners::default();
        let (ino, old, new, other) = (7, FileHandle(1), FileHandle(2), FileHandle(3));
        r.add(ino, old, 10);
        r.add(ino, old, 11);
        r.add(ino, new, 10);
        r.add(8, other, 10);
        let through = |fh: FileHandle| r.lock().by_handle.get(&fh.0).map(|(_, o)| o.clone());
        assert_eq!(through(old), Some(HashSet::from([11])));
        assert_eq!(through(new), Some(HashSet::from([10])));
        assert_eq!(through(other), Some(HashSet::from([10])), "another file's");
    }

    /// A loss fails I/O of the file by its owner (through any handle) and through the handle
    /// the lock was taken through (by anyone), nothing else; the owner's close, or the
    /// handle's release, ends it.
    #[test]
    fn a_loss_fails_the_owners_io_and_its_handles_until_a_close() {
        let r = RecordOwners::default();
        let (ino, through, other) = (7, FileHandle(1), FileHandle(2));
        let lost = |fh, ino, owner| matches!(r.check(fh, ino, owner), Err(Error::RecordLockLost { ino: i }) if i == ino);
        r.add(ino, through, 10);
        assert!(!lost(through, ino, Some(10)));
        r.lose(ino, 10);
        assert!(
            lost(other, ino, Some(10)),
            "the owner, through another handle"
        );
        assert!(
            lost(through, ino, Some(11)),
            "another owner, through the lock's handle"
        );
        assert!(
            lost(through, ino, None),
            "the library's check of the handle"
        );
        assert!(!lost(other, ino, Some(11)), "another owner, another handle");
        assert!(!lost(other, ino, None));
        assert!(!lost(other, 8, Some(10)), "another file");
        assert!(!r.holds_at_close(ino, 10));
        assert!(!lost(through, ino, Some(10)) && !lost(through, ino, None));
        assert!(!r.any_lost.load(Ordering::SeqCst));
        r.lose(ino, 10);
        assert_eq!(r.take_handle(through), Some((ino, vec![])));
        assert!(!lost(other, ino, Some(10)));
        assert!(!r.any_lost.load(Ordering::SeqCst));
    }
}
