//! Fencing: which client sessions are revoked, under which epoch, and which data servers have
//! applied it (CITRON §3.10, "the CM notifies the lock server to destroy the QPs of the failed
//! clients"; docs/ARCHITECTURE.md "Fencing").

use crate::sync::lock;
use proto::FsError;
use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a `Fence` waits for the data servers to apply a revocation (their long poll
/// answers at once; this covers a data server that is slow or going away).
pub(crate) const FENCE_WAIT: Duration = Duration::from_secs(3);

/// How many ended sessions' process ids [`FenceTable`] keeps.
const ENDED_PIDS_KEPT: usize = 4096;

/// Revokes client sessions on one fabric server.
pub(crate) type RevokeFn = Box<dyn Fn(&[u64]) + Send + Sync>;

/// Whether process `pid` (of this server's pid namespace) has exited: no such process, or a
/// zombie waiting to be reaped. A process that is still there, or whose state cannot be read,
/// is not gone. A pid reused by another process since reads as not gone: the lease decides.
pub(crate) fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "pid (comm) S ...": the state follows the last ')' (comm may hold one).
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| matches!(state, 'Z' | 'X')),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

#[derive(Default)]
struct Fences {
    /// Bumped by every fence that revokes something.
    epoch: u64,
    /// Every session revoked since this meta server started, with the epoch that revoked it.
    revoked: Vec<(u64, u64)>,
    /// Per registered data server (by id): its registration's connection epoch, and the fence
    /// epoch it has applied. Entries come and go with registrations.
    applied: HashMap<u32, (u64, u64)>,
    /// The latest sessions that ended whose client process the kernel named (the local
    /// socket's peer credentials), at most [`ENDED_PIDS_KEPT`]: where the fabric cannot fence
    /// (shm), a lock waiter may break a holder of one of them once that process is gone.
    ended_pids: VecDeque<(u64, u32)>,
}

impl Fences {
    /// The data servers that have not applied `epoch` yet.
    fn behind(&self, epoch: u64) -> Vec<u32> {
        self.applied
            .iter()
            .filter(|(_, &(_, applied))| applied < epoch)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Revokes `sessions` under a new epoch, which it returns.
    fn revoke(&mut self, sessions: &[u64]) -> u64 {
        self.epoch += 1;
        let epoch = self.epoch;
        self.revoked
            .extend(sessions.iter().map(|&session| (epoch, session)));
        epoch
    }
}

/// The sessions fenced so far and the data servers that apply them.
///
/// Invariant: a `Fence` is answered only after every data server registered now has applied an
/// epoch at least as new as the fence's ([`FenceTable::await_epoch`]), so from then on no
/// fabric server that holds file data or lock words executes a batch of a revoked session.
/// The epoch sent to the data servers' long polls is sent under the table's lock, so it never
/// goes backwards.
pub(crate) struct FenceTable {
    fences: Mutex<Fences>,
    /// Signalled when a data server applies an epoch or goes away (a `Fence` waits on it).
    acked: Condvar,
    /// `Fences::epoch`, watched by the data servers' long polls.
    epoch: tokio::sync::watch::Sender<u64>,
    /// Revokes sessions on the meta server's own fabric server, where it can (tcp).
    local_revoke: OnceLock<RevokeFn>,
}

impl Default for FenceTable {
    fn default() -> Self {
        FenceTable {
            fences: Mutex::default(),
            acked: Condvar::new(),
            epoch: tokio::sync::watch::channel(0).0,
            local_revoke: OnceLock::new(),
        }
    }
}

impl FenceTable {
    /// Installs the function that revokes sessions on the meta server's own fabric server
    /// (the first call wins).
    pub fn set_local_revoke(&self, revoke: RevokeFn) {
        let _ = self.local_revoke.set(revoke);
    }

    /// Whether the meta server's fabric can refuse a session ([`FenceTable::set_local_revoke`]
    /// was called); where it cannot (shm), a process that maps the memory cannot be kept out.
    pub fn can_fence(&self) -> bool {
        self.local_revoke.get().is_some()
    }

    /// Revokes `sessions` under a new fence epoch, which it returns: on the meta server's own
    /// fabric server at once, on the data servers through their revocation poll (a caller that
    /// must know they refuse them waits with [`FenceTable::await_epoch`]).
    pub fn revoke(&self, sessions: &[u64]) -> u64 {
        let mut f = lock(&self.fences);
        self.revoke_locked(&mut f, sessions)
    }

    fn revoke_locked(&self, f: &mut Fences, sessions: &[u64]) -> u64 {
        let epoch = f.revoke(sessions);
        if let Some(revoke) = self.local_revoke.get() {
            revoke(sessions);
        }
        self.epoch.send_replace(epoch);
        epoch
    }

    /// Revokes `sessions` if there are any (as [`FenceTable::revoke`]); the epoch to wait for
    /// either way: the newest one, which covers every revocation so far.
    pub fn revoke_all_of(&self, sessions: &[u64]) -> u64 {
        let mut f = lock(&self.fences);
        if !sessions.is_empty() {
            self.revoke_locked(&mut f, sessions);
        }
        f.epoch
    }

    /// Revokes an ended session (unless a fence did already); a later fence waits for its
    /// epoch like its own. `pid`: the ended client's process as the kernel named it, kept
    /// for [`FenceTable::ended_process_gone`].
    pub fn revoke_ended(&self, session: u64, pid: Option<u32>) {
        let mut f = lock(&self.fences);
        if let Some(pid) = pid {
            if f.ended_pids.len() >= ENDED_PIDS_KEPT {
                f.ended_pids.pop_front();
            }
            f.ended_pids.push_back((session, pid));
        }
        if f.revoked.iter().any(|&(_, s)| s == session) {
            return;
        }
        self.revoke_locked(&mut f, &[session]);
    }

    /// Whether the latest ended session `named` picks had a process the kernel named, and that
    /// process is gone.
    pub fn ended_process_gone(&self, named: impl Fn(u64) -> bool) -> bool {
        let pid = lock(&self.fences)
            .ended_pids
            .iter()
            .rev()
            .find(|&&(session, _)| named(session))
            .map(|&(_, pid)| pid);
        pid.is_some_and(process_gone)
    }

    /// The epoch that revoked the first revoked session `named` picks.
    pub fn revoked_epoch(&self, named: impl Fn(u64) -> bool) -> Option<u64> {
        lock(&self.fences)
            .revoked
            .iter()
            .find(|&&(_, s)| named(s))
            .map(|&(epoch, _)| epoch)
    }

    /// How many sessions were revoked since start.
    pub fn revoked_count(&self) -> u64 {
        lock(&self.fences).revoked.len() as u64
    }

    /// Waits until every registered data server has applied fence epoch `epoch`, or fails
    /// after `wait`.
    pub fn await_epoch(&self, epoch: u64, wait: Duration) -> Result<(), FsError> {
        let deadline = Instant::now() + wait;
        let mut f = lock(&self.fences);
        loop {
            let behind = f.behind(epoch);
            if behind.is_empty() {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FsError::Io(format!(
                    "fence epoch {epoch}: data servers {behind:?} did not acknowledge within {wait:?}"
                )));
            }
            f = self
                .acked
                .wait_timeout(f, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Data server `id` registered on connection `conn`: from now on a fence waits for it
    /// too; it has applied no epoch yet.
    pub fn server_registered(&self, id: u32, conn: u64) {
        lock(&self.fences).applied.insert(id, (conn, 0));
    }

    /// Data server `id`'s registration on connection `conn` closed: a fence no longer waits
    /// for it (its fabric server is gone with it, or it will register again and be sent every
    /// revocation from epoch 0). A stale connection closing changes nothing.
    pub fn server_gone(&self, id: u32, conn: u64) {
        let mut f = lock(&self.fences);
        if f.applied.get(&id).is_some_and(|(c, _)| *c == conn) {
            f.applied.remove(&id);
            self.acked.notify_all();
        }
    }

    /// The data server registered as `id` on connection `conn` has applied fence epochs up to
    /// `known`.
    pub fn applied(&self, id: u32, conn: u64, known: u64) {
        let mut f = lock(&self.fences);
        if let Some(entry) = f.applied.get_mut(&id).filter(|(c, _)| *c == conn) {
            entry.1 = known;
            self.acked.notify_all();
        }
    }

    /// The revocation epoch to watch, for a data server's long poll.
    pub fn watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.epoch.subscribe()
    }

    /// The current fence epoch, and the sessions revoked after epoch `known`.
    pub fn revocations_since(&self, known: u64) -> (u64, Vec<u64>) {
        let f = lock(&self.fences);
        let sessions = f
            .revoked
            .iter()
            .filter(|&&(epoch, _)| epoch > known)
            .map(|&(_, session)| session)
            .collect();
        (f.epoch, sessions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const SHORT: Duration = Duration::from_millis(50);

    #[test]
    fn without_data_servers_a_fence_is_applied_at_once() {
        let t = FenceTable::default();
        let epoch = t.revoke(&[7]);
        assert_eq!(epoch, 1);
        t.await_epoch(epoch, Duration::ZERO).unwrap();
        assert_eq!(t.revocations_since(0), (1, vec![7]));
        assert_eq!(t.revocations_since(1), (1, vec![]));
        assert_eq!(*t.watch().borrow(), 1);
    }

    #[test]
    fn a_fence_waits_for_every_registered_server_and_only_its_connection_counts() {
        let t = Arc::new(FenceTable::default());
        t.server_registered(1, 10);
        t.server_registered(2, 20);
        let epoch = t.revoke(&[7, 8]);
        assert!(t.await_epoch(epoch, SHORT).is_err());
        t.applied(1, 10, epoch);
        // A stale connection of server 2 acknowledges nothing.
        t.applied(2, 19, epoch);
        assert!(t.await_epoch(epoch, SHORT).is_err());
        let waiter = {
            let t = t.clone();
            std::thread::spawn(move || t.await_epoch(epoch, Duration::from_secs(10)))
        };
        // A server that goes away is no longer waited for; a stale close changes nothing.
        t.server_gone(2, 19);
        t.server_gone(2, 20);
        waiter.join().unwrap().unwrap();
    }

    #[test]
    fn an_ended_session_is_revoked_once() {
        let t = FenceTable::default();
        t.revoke(&[5]);
        t.revoke_ended(5, None);
        assert_eq!(t.revoked_count(), 1);
        t.revoke_ended(6, None);
        assert_eq!(t.revoked_count(), 2);
        assert_eq!(t.revoked_epoch(|s| s == 6), Some(2));
        assert_eq!(t.revoked_epoch(|s| s == 9), None);
        // Nothing revoked: the epoch to wait for is the newest.
        assert_eq!(t.revoke_all_of(&[]), 2);
        assert_eq!(t.revoke_all_of(&[9]), 3);
    }

    #[test]
    fn ended_processes_are_remembered_boundedly() {
        let t = FenceTable::default();
        // A pid that cannot exist is gone; this process is not.
        t.revoke_ended(1, Some(u32::MAX));
        t.revoke_ended(2, Some(std::process::id()));
        assert!(t.ended_process_gone(|s| s == 1));
        assert!(!t.ended_process_gone(|s| s == 2));
        assert!(!t.ended_process_gone(|s| s == 3));
        for s in 0..ENDED_PIDS_KEPT as u64 {
            t.revoke_ended(100 + s, Some(std::process::id()));
        }
        assert!(!t.ended_process_gone(|s| s == 1), "forgotten");
    }
}
