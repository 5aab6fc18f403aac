//! POSIX record locks (`fcntl`), cluster-wide: the table of held locks
//! ([`proto::records::Table`]), the waits for conflicting locks, and the grace period after a
//! restart during which clients take their locks back.

use crate::sync::lock;
use proto::records::{Owner, RecordClaim, RecordKind, RecordLock, Table};
use proto::{FsError, Ino};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Longest a `SetLk` waits here for a conflicting lock before it answers `WouldBlock`,
/// whatever it asked: its client calls again, so that a waiter's signal reaches it (and a
/// blocking-pool thread is not held) for longer than this.
const SETLK_WAIT_MOST: Duration = Duration::from_secs(1);

/// How long a waiter's wait still counts for deadlock detection after its call answered
/// (`proto::records::Table::wait`): it calls again at once, so this only bridges the gap;
/// a waiter that stopped (a signal) may cause a false EDEADLK within it.
const SETLK_WAIT_GAP: Duration = Duration::from_millis(500);

/// The record locks of every client session.
///
/// Invariant: during the grace period (until `grace_until`) no new lock is granted and no
/// conflict is reported, only locks taken back (`reclaim`), so that no lock is granted over
/// one its holder is still to take back.
pub(crate) struct RecordLocks {
    table: Mutex<Table>,
    /// Signalled whenever locks are given back or cut back (a `SetLk` waiting for a
    /// conflicting lock waits on it).
    changed: Condvar,
    /// Until then only reclaimed locks are granted (`MetaConfig::record_lock_grace`).
    grace_until: Instant,
    /// Locks one session may hold (ENOLCK beyond).
    max_per_session: usize,
}

impl RecordLocks {
    /// An empty table whose grace period lasts until `grace_until`, with at most
    /// `max_per_session` locks per session.
    pub fn new(grace_until: Instant, max_per_session: usize) -> RecordLocks {
        RecordLocks {
            table: Mutex::new(Table::default()),
            changed: Condvar::new(),
            grace_until,
            max_per_session,
        }
    }

    /// Refuses during the grace period: `InGrace`, the client asks again a little later.
    fn check_grace(&self) -> Result<(), FsError> {
        if Instant::now() < self.grace_until {
            return Err(FsError::InGrace);
        }
        Ok(())
    }

    /// `GetLk`: the first lock of another owner that a lock of `kind` over `[start, end]` of
    /// `ino` by `who` conflicts with. During the grace period the table lacks the locks not
    /// taken back yet: `InGrace`.
    pub fn conflict(
        &self,
        ino: Ino,
        who: Owner,
        start: u64,
        end: u64,
        kind: RecordKind,
    ) -> Result<Option<RecordLock>, FsError> {
        self.check_grace()?;
        Ok(lock(&self.table).conflict(ino, who, start, end, kind))
    }

    /// `SetLk` (see `proto::rpc::Request::SetLk`): sets `claim` on `ino` for `session`,
    /// waiting up to `wait` (at most [`SETLK_WAIT_MOST`]) for a conflicting lock to go. A new
    /// lock asked during the grace period is answered `InGrace` unless it is a `reclaim`.
    pub fn set(
        &self,
        session: u64,
        ino: Ino,
        claim: &RecordClaim,
        wait: Duration,
        reclaim: bool,
    ) -> Result<(), FsError> {
        if !reclaim && claim.kind.is_some() {
            self.check_grace()?;
        }
        let mut table = lock(&self.table);
        // A client's locks take the meta server's memory: bounded, as its open files are.
        let limit = self.max_per_session;
        if claim.kind.is_some() && table.held_by(session) >= limit {
            return Err(FsError::NoLocks {
                limit: limit as u64,
            });
        }
        let until = Instant::now() + wait.min(SETLK_WAIT_MOST);
        let mut waiting = false;
        loop {
            let frees = table.frees(ino, session, claim);
            if table.set(ino, session, claim).is_ok() {
                drop(table);
                // Only an unlock or a write lock turned read may free bytes someone waits
                // for; waking every waiter at every grant was a herd of wake-ups.
                if frees {
                    self.changed.notify_all();
                }
                return Ok(());
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FsError::WouldBlock);
            }
            if !std::mem::replace(&mut waiting, true) {
                // A waiter calls again as soon as this answers: its wait counts across the gap.
                let lasts = until + SETLK_WAIT_GAP;
                if table.wait(ino, session, claim, lasts).is_err() {
                    return Err(FsError::Deadlock);
                }
            }
            table = self
                .changed
                .wait_timeout(table, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Gives back every lock of `session` (it ended), waking the `SetLk`s waiting for them.
    pub fn drop_session(&self, session: u64) {
        if lock(&self.table).drop_session(session) {
            self.changed.notify_all();
        }
    }

    /// How many `SetLk`s wait now.
    #[cfg(feature = "test-hooks")]
    pub fn waiters(&self) -> usize {
        lock(&self.table).waiters()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn claim(owner: u64, kind: Option<RecordKind>) -> RecordClaim {
        RecordClaim {
            owner,
            start: 0,
            end: 99,
            kind,
            pid: 1,
        }
    }

    #[test]
    fn during_the_grace_only_reclaims_are_granted() {
        let locks = RecordLocks::new(Instant::now() + Duration::from_secs(60), 8);
        let write = claim(1, Some(RecordKind::Write));
        assert!(matches!(
            locks.set(1, 5, &write, Duration::ZERO, false),
            Err(FsError::InGrace)
        ));
        locks.set(1, 5, &write, Duration::ZERO, true).unwrap();
        // An unlock is never refused.
        locks
            .set(1, 5, &claim(1, None), Duration::ZERO, false)
            .unwrap();
        let who = Owner {
            session: 2,
            owner: 1,
        };
        assert!(matches!(
            locks.conflict(5, who, 0, 9, RecordKind::Read),
            Err(FsError::InGrace)
        ));
    }

    #[test]
    fn a_conflicting_lock_waits_for_the_session_that_holds_it_to_end() {
        let locks = Arc::new(RecordLocks::new(Instant::now(), 8));
        let write = claim(1, Some(RecordKind::Write));
        locks.set(1, 5, &write, Duration::ZERO, false).unwrap();
        assert!(matches!(
            locks.set(2, 5, &write, Duration::ZERO, false),
            Err(FsError::WouldBlock)
        ));
        let who = Owner {
            session: 2,
            owner: 1,
        };
        assert!(locks
            .conflict(5, who, 0, 9, RecordKind::Read)
            .unwrap()
            .is_some());
        let waiter = {
            let locks = locks.clone();
            std::thread::spawn(move || locks.set(2, 5, &write, Duration::from_secs(5), false))
        };
        std::thread::sleep(Duration::from_millis(50));
        locks.drop_session(1);
        waiter.join().unwrap().unwrap();
    }

    #[test]
    fn a_session_holds_at_most_its_limit() {
        let locks = RecordLocks::new(Instant::now(), 1);
        let write = claim(1, Some(RecordKind::Write));
        locks.set(1, 5, &write, Duration::ZERO, false).unwrap();
        assert!(matches!(
            locks.set(1, 6, &write, Duration::ZERO, false),
            Err(FsError::NoLocks { limit: 1 })
        ));
    }
}
