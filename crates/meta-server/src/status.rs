//! `Request::Status`: the cluster as this meta server sees it ([`proto::status::ClusterStatus`],
//! what `citronfs status` prints).
//!
//! The service hands over [`Facts`] — what it holds, copied under its state lock in one go
//! (`Service::status_facts`) — and [`report`] turns them into the answer, without locks. Lock
//! traffic is what reaches this server as RPCs only (record locks, CITRON scale-ups); the range
//! locks clients take one-sidedly never do, and are not counted (`proto::status`).

use proto::status::{
    ClusterStatus, DataServerStatus, DatabaseStatus, MetaStatus, OpenFileStatus, ProtocolVersion,
    SessionStatus, TOP_OPEN_FILES,
};
use proto::Ino;
use std::time::{Duration, Instant};

/// Where a client session comes from, as its connection said in its handshake.
#[derive(Clone, Debug, Default)]
pub(crate) struct Origin {
    /// The host the client named.
    pub host: String,
    /// The client's process id, as it said.
    pub pid: u32,
    /// The connection's peer address (`local` on the Unix socket).
    pub peer: String,
    /// On the Unix socket: the client's process as the kernel names it in this server's pid
    /// namespace (the socket's peer credentials), not as the client said. What tells a lock
    /// waiter on shm that a holder's process is gone (`Service::holder_gone`).
    pub peer_pid: Option<u32>,
}

/// One session as the service holds it.
pub(crate) struct SessionFacts {
    pub id: u64,
    pub origin: Origin,
    pub opened: Instant,
    pub last_seen: Instant,
    pub resumed_until: Option<Instant>,
    pub open_files: usize,
}

/// One open file as the service holds it.
pub(crate) struct OpenFacts {
    pub ino: Ino,
    pub sessions: usize,
    pub scheme: String,
    pub lock_calls: u64,
}

/// One registered data server: its record, and what the service knows of it now.
pub(crate) struct ServerFacts {
    pub record: crate::store::ServerRecord,
    pub incarnation: u64,
    pub live: bool,
    /// Layout units freed and not yet zeroed.
    pub dirty_units: u64,
}

/// Everything a status is made of, taken by the service at one moment.
pub(crate) struct Facts {
    pub cluster: String,
    pub started: Instant,
    pub state_dir: String,
    pub fabric: String,
    pub requests: u64,
    pub inodes: u64,
    pub chunk_size: u64,
    pub session_lease: Duration,
    pub fence_after: Duration,
    pub layout: proto::layout::Layout,
    pub database: crate::staged::Progress,
    pub servers: Vec<ServerFacts>,
    pub sessions: Vec<SessionFacts>,
    pub fenced: u64,
    pub open: Vec<OpenFacts>,
    /// Re-replication's progress (`crate::rereplicate`), as reported.
    pub rereplication: proto::status::RereplicationStatus,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The status `facts` describe, as `caller` (a session id) asked for it at `now`.
pub(crate) fn report(facts: Facts, caller: u64, now: Instant) -> ClusterStatus {
    let since = |then: Instant| ms(now.saturating_duration_since(then));
    let unit = facts.layout.unit();
    let max = facts.layout.max_order();
    let data_servers = facts
        .servers
        .iter()
        .map(|s| DataServerStatus {
            id: s.record.id,
            name: s.record.name.clone(),
            zone: s.record.zone.clone(),
            address: s.record.fabric.to_string(),
            incarnation: s.incarnation,
            live: s.live,
            chunks: s.record.chunks,
            capacity_bytes: (s.record.chunks << max).saturating_mul(unit),
            free_bytes: s
                .record
                .unallocated_units(max, s.dirty_units)
                .saturating_mul(unit),
        })
        .collect();
    let mut sessions: Vec<SessionStatus> = facts
        .sessions
        .iter()
        .map(|s| session_status(s, caller, facts.fence_after, now))
        .collect();
    sessions.sort_by_key(|s| s.id);
    let (open_file_count, open_files) = top_open_files(facts.open);
    ClusterStatus {
        cluster: facts.cluster,
        protocols: ProtocolVersion::all(),
        meta: MetaStatus {
            uptime_ms: since(facts.started),
            state_dir: facts.state_dir,
            fabric: facts.fabric,
            requests: facts.requests,
            inodes: facts.inodes,
            chunk_size: facts.chunk_size,
            fence_after_ms: ms(facts.fence_after),
            session_lease_ms: ms(facts.session_lease),
            database: DatabaseStatus {
                committed: facts.database.committed,
                written: facts.database.written,
                last_flush_ago_ms: facts.database.last_flush.map(since),
                failed: facts.database.failed,
            },
        },
        data_servers,
        sessions,
        fenced_sessions: facts.fenced,
        open_file_count,
        open_files,
        rereplication: facts.rereplication,
    }
}

/// Session `s` as `caller` sees it at `now`.
fn session_status(
    s: &SessionFacts,
    caller: u64,
    fence_after: Duration,
    now: Instant,
) -> SessionStatus {
    let silent = now.saturating_duration_since(s.last_seen);
    SessionStatus {
        id: s.id,
        host: s.origin.host.clone(),
        pid: s.origin.pid,
        peer: s.origin.peer.clone(),
        age_ms: ms(now.saturating_duration_since(s.opened)),
        silent_ms: ms(silent),
        // `SessionTable::fence_targets`' test.
        fenceable: silent > fence_after || s.resumed_until.is_some_and(|until| now < until),
        open_files: s.open_files as u64,
        caller: s.id == caller,
    }
}

/// How many files are open, and the [`TOP_OPEN_FILES`] first of them: those open in the most
/// sessions, then with the most lock calls, then by inode.
fn top_open_files(mut open: Vec<OpenFacts>) -> (u64, Vec<OpenFileStatus>) {
    open.sort_by(|a, b| {
        b.sessions
            .cmp(&a.sessions)
            .then(b.lock_calls.cmp(&a.lock_calls))
            .then(a.ino.cmp(&b.ino))
    });
    let count = open.len() as u64;
    let top = open
        .into_iter()
        .take(TOP_OPEN_FILES)
        .map(|f| OpenFileStatus {
            ino: f.ino,
            sessions: f.sessions as u64,
            scheme: f.scheme,
            lock_calls: f.lock_calls,
        })
        .collect();
    (count, top)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(now: Instant) -> Facts {
        let layout = proto::layout::Layout::new(1 << 20).unwrap();
        let session = |id, silent_ms, open_files| SessionFacts {
            id,
            origin: Origin {
                host: format!("h{id}"),
                pid: 1,
                peer: "local".into(),
                peer_pid: None,
            },
            opened: now - Duration::from_secs(60),
            last_seen: now - Duration::from_millis(silent_ms),
            resumed_until: None,
            open_files,
        };
        let open = |ino, sessions, lock_calls| OpenFacts {
            ino,
            sessions,
            scheme: "citron".into(),
            lock_calls,
        };
        Facts {
            cluster: "c".into(),
            started: now - Duration::from_secs(5),
            state_dir: "/db".into(),
            fabric: "mem:m".into(),
            requests: 3,
            inodes: 4,
            chunk_size: 1 << 20,
            session_lease: Duration::from_secs(10),
            fence_after: Duration::from_millis(100),
            layout,
            database: crate::staged::Progress {
                committed: 2,
                written: 2,
                last_flush: None,
                failed: None,
            },
            servers: vec![ServerFacts {
                record: crate::store::ServerRecord {
                    id: 0,
                    name: "ds0".into(),
                    fabric: "mem:d".parse().unwrap(),
                    region: fabric::RegionId(1),
                    chunks: 8,
                    next_fresh: 6,
                    free_counts: vec![0; layout.max_order() as usize + 1],
                    zone: None,
                },
                incarnation: 9,
                live: true,
                dirty_units: 0,
            }],
            sessions: vec![session(20, 5, 0), session(10, 500, 2)],
            fenced: 1,
            open: (1..=12)
                .map(|i| open(i, 1, 0))
                .chain([open(99, 2, 5)])
                .collect(),
            rereplication: Default::default(),
        }
    }

    #[test]
    fn a_report_orders_sessions_and_ranks_open_files() {
        let now = Instant::now();
        let status = report(facts(now), 20, now);
        assert_eq!(status.meta.uptime_ms, 5_000);
        let ids: Vec<u64> = status.sessions.iter().map(|s| s.id).collect();
        assert_eq!(ids, [10, 20]);
        assert!(status.sessions[0].fenceable, "silent past fence_after");
        assert!(!status.sessions[1].fenceable);
        assert!(status.sessions[1].caller && !status.sessions[0].caller);
        assert_eq!(status.open_file_count, 13);
        assert_eq!(status.open_files.len(), TOP_OPEN_FILES);
        assert_eq!(status.open_files[0].ino, 99, "most sessions first");
        assert_eq!(status.open_files[1].ino, 1, "then by inode");
        let ds = &status.data_servers[0];
        assert_eq!(ds.capacity_bytes, 8 << 20);
        assert_eq!(ds.free_bytes, 2 << 20, "chunks 6..8 never allocated");
        assert_eq!(ds.used_bytes(), 6 << 20);
    }
}
