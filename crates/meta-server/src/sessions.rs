//! The client sessions: who is connected, when each was last heard from, which files each has
//! open, and which of them a fence revokes.

use crate::status::{Origin, SessionFacts};
use proto::{FsError, Ino};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// How long after a silence longer than `fence_after` a session that speaks again stays a
/// fence's target ([`SessionTable::fence_targets`]): twice fs-client's lease guard of
/// `2·fence_after`, i.e. `4·fence_after` (400 ms by default; `T_lease` must exceed it).
pub(crate) fn resumed_window(fence_after: Duration) -> Duration {
    4 * fence_after
}

struct Session {
    /// Where it comes from, for a status report.
    origin: Origin,
    /// When it opened.
    opened: Instant,
    last_seen: Instant,
    /// Until when a `Fence` revokes this session even though it speaks again: it was silent
    /// for longer than `fence_after` before it last spoke (see [`SessionTable::fence_targets`]).
    resumed_until: Option<Instant>,
    /// The files it has open (distinct inodes).
    open: HashSet<Ino>,
}

/// What is left of a session that ended ([`SessionTable::end`]).
pub(crate) struct EndedSession {
    /// The files it had open, to release.
    pub open: HashSet<Ino>,
    /// Its client's process as the kernel named it (`Origin::peer_pid`).
    pub peer_pid: Option<u32>,
}

/// The open sessions.
///
/// Invariant: session ids are handed out in increasing order from the first id of this run
/// and never repeat, across restarts too (the data servers' fabric servers remember revoked
/// sessions for their own lifetime, and the meta region refuses ids below the first).
pub(crate) struct SessionTable {
    sessions: HashMap<u64, Session>,
    next: u64,
}

impl SessionTable {
    /// An empty table whose first session will be `first` (`service::first_session_id`).
    pub fn new(first: u64) -> SessionTable {
        SessionTable {
            sessions: HashMap::new(),
            next: first,
        }
    }

    /// Opens a session from `origin`; `TooManySessions` when `max` are open already.
    pub fn open(&mut self, origin: Origin, max: usize) -> Result<u64, FsError> {
        if self.sessions.len() >= max {
            return Err(FsError::TooManySessions { limit: max as u64 });
        }
        let id = self.next;
        self.next += 1;
        let now = Instant::now();
        self.sessions.insert(
            id,
            Session {
                origin,
                opened: now,
                last_seen: now,
                resumed_until: None,
                open: HashSet::new(),
            },
        );
        Ok(id)
    }

    /// Removes session `id`; what it leaves to clean up, or `None` if it was not open.
    pub fn end(&mut self, id: u64) -> Option<EndedSession> {
        self.sessions.remove(&id).map(|s| EndedSession {
            open: s.open,
            peer_pid: s.origin.peer_pid,
        })
    }

    /// How many sessions are open.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// How many sessions other than `id` are open.
    pub fn others_than(&self, id: u64) -> usize {
        self.sessions.keys().filter(|&&s| s != id).count()
    }

    /// Renews session `id`'s lease; `Stale` if it is gone (expired). A session heard from after
    /// a silence longer than `fence_after` stays a fence's target for [`resumed_window`]. Only
    /// a request's arrival (`arrival`) can end a silence: the renewal after a request that ran
    /// long (its own `Fence` waits for the data servers) is no sign of a stopped client.
    pub fn touch(&mut self, id: u64, arrival: bool, fence_after: Duration) -> Result<(), FsError> {
        let s = self.sessions.get_mut(&id).ok_or(FsError::Stale)?;
        let now = Instant::now();
        let silence = now.saturating_duration_since(s.last_seen);
        if arrival && silence > fence_after {
            tracing::info!(
                session = id,
                ?silence,
                "session heard from again after a silence: still fenceable for a while"
            );
            s.resumed_until = Some(now + resumed_window(fence_after));
        }
        s.last_seen = now;
        Ok(())
    }

    /// The sessions not heard from for longer than `silence`, counted from `awake_since` at the
    /// earliest: the meta server's own stalls are not held against them (`crate::stall`).
    pub fn silent(&self, silence: Duration, awake_since: Instant) -> Vec<u64> {
        self.sessions
            .iter()
            .filter(|(_, s)| s.last_seen.max(awake_since).elapsed() > silence)
            .map(|(&id, _)| id)
            .collect()
    }

    /// The sessions a `Fence` revokes at `now`: those silent for longer than `fence_after`, and
    /// those that spoke again after such a silence less than [`resumed_window`] ago.
    ///
    /// Why the second set: a client stopped past its lease (SIGSTOP, a frozen VM) between its
    /// lease check and its post resumes with both threads runnable at once — its heartbeat and
    /// the stale post. When the heartbeat reaches us first, the client is no longer silent, yet
    /// the post is still on its way; a breaker fencing at that moment (its patience ran out
    /// just after the resume) would revoke nothing and then take the lock, and the stale post
    /// would land after the breaker's write (seen as a torn record in
    /// `crates/tests/tests/pause.rs`). A live thread's check-to-post takes less than
    /// fs-client's guard of `2·fence_after` (the assumption the guard rests on); right after a
    /// resume every thread of the process competes for the CPU, so the window is twice that:
    /// [`resumed_window`]. The cost: a client whose heartbeat stalled for `fence_after` (a
    /// starved host) is fenced by a fence within that window — and fences happen only when
    /// some holder's lease ran out.
    /// The fencing session itself (`caller`, just heard from) is never a target: it breaks a
    /// lock of someone else's.
    pub fn fence_targets(&self, caller: u64, fence_after: Duration, now: Instant) -> Vec<u64> {
        self.sessions
            .iter()
            .filter(|&(&id, s)| {
                id != caller
                    && (now.saturating_duration_since(s.last_seen) > fence_after
                        || s.resumed_until.is_some_and(|until| now < until))
            })
            .map(|(&id, _)| id)
            .collect()
    }

    /// The first open session `named` picks, and how long it has been silent.
    pub fn find(&self, named: impl Fn(u64) -> bool) -> Option<(u64, Duration)> {
        self.sessions
            .iter()
            .find(|(&id, _)| named(id))
            .map(|(&id, s)| (id, s.last_seen.elapsed()))
    }

    /// Refuses (`TooManyOpen`) a new open of `ino` by session `id` when it has `max` files
    /// open already; a file it has open already does not count again.
    pub fn check_open_limit(&self, id: u64, ino: Ino, max: usize) -> Result<(), FsError> {
        match self.sessions.get(&id) {
            Some(s) if !s.open.contains(&ino) && s.open.len() >= max => {
                tracing::warn!(
                    session = id,
                    limit = max,
                    "open refused: the session has too many files open"
                );
                Err(FsError::TooManyOpen { limit: max as u64 })
            }
            _ => Ok(()),
        }
    }

    /// Session `id` has `ino` open.
    pub fn note_open(&mut self, id: u64, ino: Ino) {
        if let Some(s) = self.sessions.get_mut(&id) {
            s.open.insert(ino);
        }
    }

    /// Session `id` no longer has `ino` open.
    pub fn note_closed(&mut self, id: u64, ino: Ino) {
        if let Some(s) = self.sessions.get_mut(&id) {
            s.open.remove(&ino);
        }
    }

    /// Every session as a status report shows it.
    pub fn facts(&self) -> Vec<SessionFacts> {
        self.sessions
            .iter()
            .map(|(&id, s)| SessionFacts {
                id,
                origin: s.origin.clone(),
                opened: s.opened,
                last_seen: s.last_seen,
                resumed_until: s.resumed_until,
                open_files: s.open.len(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FENCE_AFTER: Duration = Duration::from_millis(100);

    fn table_of(n: usize) -> (SessionTable, Vec<u64>) {
        let mut t = SessionTable::new(1000);
        let ids = (0..n)
            .map(|_| t.open(Origin::default(), 16).unwrap())
            .collect();
        (t, ids)
    }

    #[test]
    fn ids_increase_from_the_first_and_the_limit_holds() {
        let mut t = SessionTable::new(1000);
        assert_eq!(t.open(Origin::default(), 2).unwrap(), 1000);
        assert_eq!(t.open(Origin::default(), 2).unwrap(), 1001);
        assert!(matches!(
            t.open(Origin::default(), 2),
            Err(FsError::TooManySessions { limit: 2 })
        ));
        assert!(t.end(1000).is_some());
        assert!(t.end(1000).is_none());
        // An ended session's id is not handed out again.
        assert_eq!(t.open(Origin::default(), 2).unwrap(), 1002);
    }

    #[test]
    fn a_fence_targets_silent_sessions_but_never_its_caller() {
        let (t, ids) = table_of(2);
        let now = Instant::now();
        assert!(t.fence_targets(ids[0], FENCE_AFTER, now).is_empty());
        let later = now + 2 * FENCE_AFTER;
        assert_eq!(t.fence_targets(ids[0], FENCE_AFTER, later), vec![ids[1]]);
        assert_eq!(t.fence_targets(ids[1], FENCE_AFTER, later), vec![ids[0]]);
    }

    #[test]
    fn a_session_back_from_a_silence_stays_a_target_for_the_resumed_window() {
        let (mut t, ids) = table_of(2);
        std::thread::sleep(FENCE_AFTER + Duration::from_millis(20));
        // A renewal after a long request does not end a silence as an arrival does.
        t.touch(ids[1], false, FENCE_AFTER).unwrap();
        assert!(t
            .fence_targets(ids[0], FENCE_AFTER, Instant::now())
            .is_empty());
        std::thread::sleep(FENCE_AFTER + Duration::from_millis(20));
        t.touch(ids[1], true, FENCE_AFTER).unwrap();
        let now = Instant::now();
        assert_eq!(t.fence_targets(ids[0], FENCE_AFTER, now), vec![ids[1]]);
        // Within the window, though heard from just now.
        assert_eq!(
            t.fence_targets(ids[0], FENCE_AFTER, now + FENCE_AFTER / 2),
            vec![ids[1]]
        );
    }

    #[test]
    fn a_gone_session_is_stale() {
        let (mut t, ids) = table_of(1);
        t.end(ids[0]);
        assert!(matches!(
            t.touch(ids[0], true, FENCE_AFTER),
            Err(FsError::Stale)
        ));
    }

    #[test]
    fn the_open_limit_counts_distinct_files_and_ends_with_the_session() {
        let (mut t, ids) = table_of(1);
        let s = ids[0];
        t.check_open_limit(s, 1, 1).unwrap();
        t.note_open(s, 1);
        t.check_open_limit(s, 1, 1).unwrap();
        assert!(matches!(
            t.check_open_limit(s, 2, 1),
            Err(FsError::TooManyOpen { limit: 1 })
        ));
        t.note_closed(s, 1);
        t.check_open_limit(s, 2, 1).unwrap();
        t.note_open(s, 2);
        let ended = t.end(s).unwrap();
        assert_eq!(ended.open, HashSet::from([2]));
        assert_eq!(t.len(), 0);
    }
}
