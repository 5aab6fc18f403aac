//! POSIX record locks (`fcntl`'s `F_GETLK`, `F_SETLK`, `F_SETLKW`, and `lockf`), kept for the
//! whole cluster by the meta server: what a client asks for and what it is told.
//!
//! These are advisory locks between programs, unrelated to the range locks every read and write
//! takes (those are CITRON's, in `lockmgr`). Byte ranges are inclusive at both ends, as the
//! kernel hands them to FUSE (`u64::MAX` and `i64::MAX` both reach the end of any file).
//! [`Table`] holds locks with POSIX's rules, for the meta server and for each client's own.

use crate::Ino;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// A record lock's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RecordKind {
    /// Shared (`F_RDLCK`): any number of owners may hold overlapping read locks.
    Read,
    /// Exclusive (`F_WRLCK`): no other owner may hold an overlapping lock of either kind.
    Write,
}

impl RecordKind {
    /// Whether a lock of this kind and one of `other`, held by two owners over overlapping
    /// bytes, conflict: unless both are read locks.
    pub fn conflicts_with(self, other: RecordKind) -> bool {
        self == RecordKind::Write || other == RecordKind::Write
    }

    /// The kind of an `fcntl` lock type (`F_RDLCK`, `F_WRLCK`); `None` for `F_UNLCK`, an
    /// error for anything else.
    pub fn from_fcntl(typ: i32) -> Result<Option<RecordKind>, crate::FsError> {
        match typ {
            libc::F_RDLCK => Ok(Some(RecordKind::Read)),
            libc::F_WRLCK => Ok(Some(RecordKind::Write)),
            libc::F_UNLCK => Ok(None),
            other => Err(crate::FsError::Invalid(format!("record lock type {other}"))),
        }
    }

    /// The `fcntl` lock type of this kind.
    pub fn fcntl(self) -> i32 {
        match self {
            RecordKind::Read => libc::F_RDLCK,
            RecordKind::Write => libc::F_WRLCK,
        }
    }
}

/// A record lock as `F_GETLK` reports it: the first lock found in the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordLock {
    /// First byte.
    pub start: u64,
    /// Last byte (inclusive).
    pub end: u64,
    /// Its kind.
    pub kind: RecordKind,
    /// The holder's process id when it holds the lock through the asking client's own session;
    /// 0 for a holder on another client, whose pid means nothing on this host (and which the
    /// kernel would refuse: it looks the pid up in the mount's pid namespace).
    pub pid: u32,
}

/// What an owner asks of a byte range (`F_SETLK`): a lock of a kind, or none (an unlock).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordClaim {
    /// The lock owner: the kernel's, unique within its client session.
    pub owner: u64,
    /// First byte.
    pub start: u64,
    /// Last byte (inclusive).
    pub end: u64,
    /// The lock to hold over the range, or `None` to hold nothing there.
    pub kind: Option<RecordKind>,
    /// The owner's process, for `F_GETLK` through the same session.
    pub pid: u32,
}

impl RecordClaim {
    /// `owner`'s unlock of every byte.
    pub fn unlock_all(owner: u64) -> Self {
        RecordClaim {
            owner,
            start: 0,
            end: u64::MAX,
            kind: None,
            pid: 0,
        }
    }
}

// ---- the table ----------------------------------------------------------------------------

/// Who holds a record lock: a client session and the kernel's lock owner in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    /// The client session.
    pub session: u64,
    /// The kernel's lock owner, as the client passed it.
    pub owner: u64,
}

/// One lock held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    who: Owner,
    /// First byte.
    start: u64,
    /// Last byte (inclusive).
    end: u64,
    kind: RecordKind,
    pid: u32,
}

impl Held {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start <= end && start <= self.end
    }

    /// Whether it ends right before `start` or starts right after `end`.
    fn touches(&self, start: u64, end: u64) -> bool {
        self.end.checked_add(1) == Some(start) || end.checked_add(1) == Some(self.start)
    }

    /// As `F_GETLK` reports it to `asking`: the pid only to the holder's own session.
    fn report(&self, asking: Owner) -> RecordLock {
        RecordLock {
            start: self.start,
            end: self.end,
            kind: self.kind,
            pid: if self.who.session == asking.session {
                self.pid
            } else {
                0
            },
        }
    }
}

/// Every inode's record locks, with POSIX's rules: kept by the meta server for the whole
/// cluster, and by each client for the locks it holds (what it takes again after the meta
/// server restarts, `fs-client` `records`).
///
/// An owner ([`Owner`]) is a client session together with the kernel's lock owner in that
/// client (a process's file table, or an open file description for OFD locks), so owners of
/// two clients never compare equal even where their kernels chose the same number. The rules:
///
/// - two owners' locks over a common byte conflict unless both are read locks;
/// - an owner's new lock (or unlock) replaces whatever that owner held over its bytes: an
///   owner's locks of one kind that overlap or touch are one lock, and one of the other kind
///   is cut back (split in two where the new lock lies inside it).
///
/// Invariant (kept by [`Table::set`], checked by the model test): one owner's locks on one
/// inode never overlap, and two of the same kind never touch.
#[derive(Debug, Default)]
pub struct Table {
    files: HashMap<Ino, Vec<Held>>,
    /// How many locks each session holds (sessions holding none are absent).
    per_session: HashMap<u64, usize>,
    /// The owners waiting for a lock (`F_SETLKW`), what for and until when: the edges of the
    /// waits-for graph that [`Table::wait`] looks for a cycle in.
    waiting: HashMap<Owner, Waiting>,
}

/// What an owner waits for ([`Table::wait`]).
#[derive(Clone, Copy, Debug)]
struct Waiting {
    ino: Ino,
    start: u64,
    end: u64,
    kind: RecordKind,
    /// The wait counts until then (a waiter's calls follow each other; one that stopped
    /// calling stops counting soon after).
    until: std::time::Instant,
}

/// A wait that would close a cycle of owners each waiting for the next one's lock (EDEADLK).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadlock;

/// How many owners deep [`Table::wait`] follows the waits-for graph (Linux: 10).
const DEADLOCK_DEPTH: usize = 10;

impl Table {
    /// The first lock of another owner that a lock of `kind` over `[start, end]` of `ino` by
    /// `who` would conflict with (`F_GETLK`).
    pub fn conflict(
        &self,
        ino: Ino,
        who: Owner,
        start: u64,
        end: u64,
        kind: RecordKind,
    ) -> Option<RecordLock> {
        self.files.get(&ino)?.iter().find_map(|h| {
            (h.who != who && h.overlaps(start, end) && h.kind.conflicts_with(kind))
                .then(|| h.report(who))
        })
    }

    /// Whether [`Table::set`] of `claim` by its owner in `session` would let go of bytes that
    /// the owner holds now — an unlock of held bytes, or a write lock turned into a read lock —
    /// which is when a waiter for them may now get its lock. Taking new bytes, merging, or
    /// turning a read lock into a write lock lets go of nothing.
    pub fn frees(&self, ino: Ino, session: u64, claim: &RecordClaim) -> bool {
        let who = Owner {
            session,
            owner: claim.owner,
        };
        let Some(locks) = self.files.get(&ino) else {
            return false;
        };
        claim.start <= claim.end
            && locks.iter().any(|h| {
                h.who == who
                    && h.overlaps(claim.start, claim.end)
                    && match claim.kind {
                        None => true,
                        Some(kind) => h.kind == RecordKind::Write && kind == RecordKind::Read,
                    }
            })
    }

    /// Takes (`claim.kind` set) or gives back (`None`) the lock of `claim`'s owner in session
    /// `session` over the claim's bytes of `ino`, with POSIX's rules (module docs); a lock that
    /// conflicts with another owner's is not taken, and the conflicting lock is returned.
    /// `start > end` is taken as the empty range: nothing changes.
    pub fn set(&mut self, ino: Ino, session: u64, claim: &RecordClaim) -> Result<(), RecordLock> {
        let RecordClaim {
            owner,
            start,
            end,
            kind,
            pid,
        } = *claim;
        let who = Owner { session, owner };
        if start > end {
            return Ok(());
        }
        if let Some(kind) = kind {
            if let Some(conflict) = self.conflict(ino, who, start, end, kind) {
                return Err(conflict);
            }
        }
        let locks = self.files.entry(ino).or_default();
        // Only `who`'s locks change: the difference is the session's.
        let before = locks.len();
        let (mut from, mut to) = (start, end);
        let mut kept = Vec::with_capacity(locks.len() + 2);
        for h in locks.drain(..) {
            let same_kind = kind == Some(h.kind);
            if h.who != who || !(h.overlaps(start, end) || (same_kind && h.touches(start, end))) {
                kept.push(h);
            } else if same_kind {
                // One lock with the new one.
                from = from.min(h.start);
                to = to.max(h.end);
            } else {
                // Cut back to what lies outside the new range.
                if h.start < start {
                    kept.push(Held {
                        end: start - 1,
                        ..h
                    });
                }
                if h.end > end {
                    kept.push(Held {
                        start: end + 1,
                        ..h
                    });
                }
            }
        }
        if let Some(kind) = kind {
            kept.push(Held {
                who,
                start: from,
                end: to,
                kind,
                pid,
            });
        }
        let after = kept.len();
        if kept.is_empty() {
            self.files.remove(&ino);
        } else {
            *locks = kept;
        }
        if kind.is_some() {
            // Granted: no longer waiting.
            self.waiting.remove(&who);
        }
        let count = self.per_session.entry(session).or_default();
        *count = (*count + after).saturating_sub(before);
        if *count == 0 {
            self.per_session.remove(&session);
        }
        Ok(())
    }

    /// Owner `who` (`claim`'s owner in `session`) is about to wait, until `until`, for the
    /// lock `claim` asks of `ino`: refused with [`Deadlock`] when an owner holding a lock in its
    /// way waits (directly, or through others waiting in turn) for one that `who` holds, as
    /// POSIX's `F_SETLKW` detects; recorded otherwise. Stale waits (past their `until`) do not
    /// count; a granted lock ends its owner's wait ([`Table::set`]).
    pub fn wait(
        &mut self,
        ino: Ino,
        session: u64,
        claim: &RecordClaim,
        until: std::time::Instant,
    ) -> Result<(), Deadlock> {
        let who = Owner {
            session,
            owner: claim.owner,
        };
        let Some(kind) = claim.kind else {
            return Ok(());
        };
        let now = std::time::Instant::now();
        self.waiting.retain(|_, w| w.until > now);
        let mine = Waiting {
            ino,
            start: claim.start,
            end: claim.end,
            kind,
            until,
        };
        // Breadth first from `who`'s wait: each owner in the way, and what it waits for.
        let mut frontier = vec![(who, mine)];
        for _ in 0..DEADLOCK_DEPTH {
            let mut next = Vec::new();
            for (waiter, w) in &frontier {
                let Some(locks) = self.files.get(&w.ino) else {
                    continue;
                };
                for h in locks.iter().filter(|h| {
                    h.who != *waiter && h.overlaps(w.start, w.end) && h.kind.conflicts_with(w.kind)
                }) {
                    if h.who == who {
                        return Err(Deadlock);
                    }
                    if let Some(theirs) = self.waiting.get(&h.who) {
                        next.push((h.who, *theirs));
                    }
                }
            }
            if next.is_empty() {
                break;
            }
            frontier = next;
        }
        self.waiting.insert(who, mine);
        Ok(())
    }

    /// Whether `who` holds any lock of `ino`.
    pub fn holds(&self, ino: Ino, who: Owner) -> bool {
        self.files
            .get(&ino)
            .is_some_and(|locks| locks.iter().any(|h| h.who == who))
    }

    /// Whether anyone holds a lock of `ino`.
    pub fn any(&self, ino: Ino) -> bool {
        self.files.contains_key(&ino)
    }

    /// How many owners are recorded as waiting (their waits may have run out since).
    pub fn waiters(&self) -> usize {
        self.waiting.len()
    }

    /// How many locks session `session` holds, over every inode.
    pub fn held_by(&self, session: u64) -> usize {
        self.per_session.get(&session).copied().unwrap_or(0)
    }

    /// Gives back every lock of session `session` on `ino` (its last open of the file ended);
    /// whether there was any.
    pub fn drop_file(&mut self, ino: Ino, session: u64) -> bool {
        let Some(locks) = self.files.get_mut(&ino) else {
            return false;
        };
        let before = locks.len();
        locks.retain(|h| h.who.session != session);
        let dropped = before - locks.len();
        if locks.is_empty() {
            self.files.remove(&ino);
        }
        if let Some(count) = self.per_session.get_mut(&session) {
            *count = count.saturating_sub(dropped);
            if *count == 0 {
                self.per_session.remove(&session);
            }
        }
        dropped > 0
    }

    /// Gives back every lock of session `session` (it ended), and ends its waits; whether
    /// there was any lock.
    pub fn drop_session(&mut self, session: u64) -> bool {
        self.waiting.retain(|who, _| who.session != session);
        let inos: Vec<Ino> = self.files.keys().copied().collect();
        let mut dropped = false;
        for ino in inos {
            dropped |= self.drop_file(ino, session);
        }
        dropped
    }

    /// Every lock held, as the inode, the session and the claim that takes it again.
    pub fn claims(&self) -> Vec<(Ino, u64, RecordClaim)> {
        self.files
            .iter()
            .flat_map(|(&ino, locks)| {
                locks.iter().map(move |h| {
                    let claim = RecordClaim {
                        owner: h.who.owner,
                        start: h.start,
                        end: h.end,
                        kind: Some(h.kind),
                        pid: h.pid,
                    };
                    (ino, h.who.session, claim)
                })
            })
            .collect()
    }

    /// How many locks are held, over every inode (for the tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.files.values().map(Vec::len).sum()
    }

    /// What `who` holds at byte `at` of `ino` (for the tests).
    #[cfg(test)]
    fn held_at(&self, ino: Ino, who: Owner, at: u64) -> Option<RecordKind> {
        let mut found = self
            .files
            .get(&ino)?
            .iter()
            .filter(|h| h.who == who && h.start <= at && at <= h.end);
        let first = found.next().map(|h| h.kind);
        assert!(
            found.next().is_none(),
            "two locks of {who:?} over byte {at}"
        );
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: Owner = Owner {
        session: 1,
        owner: 7,
    };
    const B: Owner = Owner {
        session: 2,
        owner: 7,
    };

    fn claim(who: Owner, start: u64, end: u64, kind: Option<RecordKind>, pid: u32) -> RecordClaim {
        RecordClaim {
            owner: who.owner,
            start,
            end,
            kind,
            pid,
        }
    }

    #[test]
    fn two_clients_with_one_kernel_owner_number_are_two_owners() {
        let mut t = Table::default();
        let write = Some(RecordKind::Write);
        t.set(5, A.session, &claim(A, 0, 99, write, 100)).unwrap();
        let seen = t
            .set(5, B.session, &claim(B, 50, 60, Some(RecordKind::Read), 200))
            .unwrap_err();
        // The holder is on another client: its pid is not reported.
        assert_eq!(
            seen,
            RecordLock {
                start: 0,
                end: 99,
                kind: RecordKind::Write,
                pid: 0
            }
        );
        // The holder's own session sees its pid (another owner of that client asks).
        let sibling = Owner {
            session: 1,
            owner: 8,
        };
        assert_eq!(
            t.conflict(5, sibling, 0, 0, RecordKind::Read)
                .map(|l| l.pid),
            Some(100)
        );
        // Other inodes and other bytes are free; the owner itself is never in its own way.
        assert!(t.set(6, B.session, &claim(B, 0, 99, write, 200)).is_ok());
        assert!(t
            .set(5, B.session, &claim(B, 100, u64::MAX, write, 200))
            .is_ok());
        assert_eq!(t.conflict(5, A, 0, 99, RecordKind::Write), None);
        // An unlock splits; the session's end frees the rest.
        t.set(5, A.session, &claim(A, 10, 19, None, 100)).unwrap();
        assert!(t.set(5, B.session, &claim(B, 10, 19, write, 200)).is_ok());
        assert_eq!(t.len(), 5);
        assert!(t.drop_session(1));
        assert_eq!(t.len(), 3);
        assert!(t.drop_file(5, 2));
        assert_eq!(t.len(), 1);
        assert!(!t.drop_session(1));
    }

    #[test]
    fn a_wait_that_closes_a_cycle_is_a_deadlock() {
        use std::time::{Duration, Instant};
        let write = Some(RecordKind::Write);
        let later = Instant::now() + Duration::from_secs(60);
        let [x, y, z] = [(0, 9), (10, 19), (20, 29)];
        let at = |who: Owner, (start, end): (u64, u64)| claim(who, start, end, write, 1);
        let c = Owner {
            session: 3,
            owner: 7,
        };
        let mut t = Table::default();
        for (who, range) in [(A, x), (B, y), (c, z)] {
            t.set(1, who.session, &at(who, range)).unwrap();
        }
        // A waits for B, B for C: no cycle yet. C waiting for A closes one.
        t.wait(1, A.session, &at(A, y), later).unwrap();
        t.wait(1, B.session, &at(B, z), later).unwrap();
        assert_eq!(t.wait(1, c.session, &at(c, x), later), Err(Deadlock));
        // Waiting for bytes nobody in a cycle holds is fine.
        t.wait(1, c.session, &at(c, (100, 100)), later).unwrap();
        // A two-owner cycle; and a wait that ran out does not count.
        let mut t = Table::default();
        t.set(1, A.session, &at(A, x)).unwrap();
        t.set(1, B.session, &at(B, y)).unwrap();
        t.wait(1, A.session, &at(A, y), Instant::now()).unwrap();
        t.wait(1, B.session, &at(B, x), later).unwrap();
        t.wait(1, A.session, &at(A, y), later).unwrap_err();
        // Granted, an owner waits no more; a session's end ends its waits.
        t.set(1, B.session, &at(B, y)).unwrap();
        t.drop_session(A.session);
        t.set(1, B.session, &at(B, x)).unwrap();
        t.wait(1, B.session, &at(B, (0, 0)), later).unwrap();
    }

    /// One operation of the model test.
    #[derive(Clone, Debug)]
    enum Op {
        Set {
            who: usize,
            start: u64,
            len: u64,
            kind: Option<RecordKind>,
        },
        DropSession(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let kind = prop_oneof![
            Just(None),
            Just(Some(RecordKind::Read)),
            Just(Some(RecordKind::Write))
        ];
        prop_oneof![
            8 => (0..OWNERS.len(), 0..BYTES, 1..BYTES, kind).prop_map(|(who, start, len, kind)| {
                Op::Set { who, start, len, kind }
            }),
            1 => (1..3u64).prop_map(Op::DropSession),
        ]
    }

    /// The model's byte range.
    const BYTES: u64 = 40;
    /// Owners: two of session 1 (one kernel number shared with session 2), one of session 2.
    const OWNERS: [Owner; 3] = [
        A,
        Owner {
            session: 1,
            owner: 8,
        },
        B,
    ];

    proptest! {
        /// Against a reference that keeps each owner's kind byte by byte: every answer (taken
        /// or refused) and every byte each owner holds agree after every step, and the table's
        /// invariant holds (`held_at` asserts one lock per byte and owner; merged locks are
        /// checked below).
        #[test]
        fn the_table_agrees_with_a_byte_by_byte_model(ops in proptest::collection::vec(op(), 1..60)) {
            let mut t = Table::default();
            let mut model = vec![[None::<RecordKind>; BYTES as usize]; OWNERS.len()];
            for op in ops {
                match op {
                    Op::Set { who, start, len, kind } => {
                        let end = (start + len - 1).min(BYTES - 1);
                        let conflict = kind.and_then(|k| {
                            (0..OWNERS.len()).filter(|&o| o != who).find(|&o| {
                                (start..=end).any(|b| {
                                    model[o][b as usize].is_some_and(|h| h.conflicts_with(k))
                                })
                            })
                        });
                        let owner = OWNERS[who];
                        let c = claim(owner, start, end, kind, who as u32);
                        // Lets go of bytes iff the owner held some of them and unlocks them,
                        // or held them for writing and now reads.
                        let lets_go = (start..=end).any(|b| {
                            matches!(
                                (model[who][b as usize], kind),
                                (Some(_), None) | (Some(RecordKind::Write), Some(RecordKind::Read))
                            )
                        });
                        let frees = t.frees(9, owner.session, &c);
                        let got = t.set(9, owner.session, &c);
                        prop_assert_eq!(got.is_err(), conflict.is_some(), "{:?}", got);
                        if got.is_ok() {
                            prop_assert_eq!(frees, lets_go);
                        }
                        if let Err(seen) = got {
                            // What it reports is a lock of another owner in the way.
                            prop_assert!(seen.start <= end && start <= seen.end);
                            prop_assert!(seen.kind.conflicts_with(kind.unwrap()));
                        } else {
                            for b in start..=end {
                                model[who][b as usize] = kind;
                            }
                        }
                    }
                    Op::DropSession(session) => {
                        t.drop_session(session);
                        for (o, owner) in OWNERS.iter().enumerate() {
                            if owner.session == session {
                                model[o] = [None; BYTES as usize];
                            }
                        }
                    }
                }
                for (o, &owner) in OWNERS.iter().enumerate() {
                    for b in 0..BYTES {
                        prop_assert_eq!(t.held_at(9, owner, b), model[o][b as usize]);
                    }
                }
                // The count per session is the locks it holds.
                for session in [1, 2] {
                    let held = t.files.values().flatten().filter(|h| h.who.session == session).count();
                    prop_assert_eq!(t.held_by(session), held);
                }
                // Each owner's locks of one kind never touch (they would be one).
                if let Some(locks) = t.files.get(&9) {
                    for x in locks {
                        for y in locks {
                            if x != y && x.who == y.who && x.kind == y.kind {
                                prop_assert!(!x.touches(y.start, y.end), "{:?} {:?}", x, y);
                            }
                        }
                    }
                }
            }
        }
    }
}
