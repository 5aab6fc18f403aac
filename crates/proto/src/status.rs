//! A running cluster as the meta server sees it: what `Request::Status` answers
//! ([`ClusterStatus`]) and `citronfs status` prints.
//!
//! Every figure is one the meta server keeps anyway (its sessions, data-server registry, open
//! files, database progress) or counts cheaply on its own request path. Range-lock traffic is
//! not among them: CITRON locks are taken with one-sided verbs that never reach the meta
//! server's CPU (and acquisitions it hosts on tcp run inside `lockmgr`, which does not report
//! them per file), so [`OpenFileStatus::lock_calls`] counts only the lock requests that are
//! RPCs — record locks (`GetLk`, `SetLk`) and CITRON scale-ups (`AllocateLockWords`, hosted
//! ones included).

use serde::{Deserialize, Serialize};

/// How many open files a status lists by name ([`ClusterStatus::open_files`]), the ones most
/// sessions hold first; the total is always given.
pub const TOP_OPEN_FILES: usize = 10;

/// The whole answer to `Request::Status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The cluster's name (the one its peers present in their handshake).
    pub cluster: String,
    /// The protocol versions the meta server speaks.
    pub protocols: Vec<ProtocolVersion>,
    /// The meta server itself.
    pub meta: MetaStatus,
    /// Every data server ever registered, live or not, by id.
    pub data_servers: Vec<DataServerStatus>,
    /// Every client session open now, the asking one included ([`SessionStatus::caller`]).
    pub sessions: Vec<SessionStatus>,
    /// Sessions fenced (revoked because silent) since the meta server started.
    pub fenced_sessions: u64,
    /// Files open now, on any session.
    pub open_file_count: u64,
    /// At most [`TOP_OPEN_FILES`] open files: most sessions first, then most lock calls, then
    /// by inode.
    pub open_files: Vec<OpenFileStatus>,
    /// The meta server's re-replication of under-replicated chunks (docs/REPLICAS.md).
    #[serde(default)]
    pub rereplication: RereplicationStatus,
}

/// Where re-replication stands: the pass running now (or the last one), and the totals since
/// the meta server started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RereplicationStatus {
    /// Whether a pass is running now.
    pub running: bool,
    /// Chunks the current (or last) pass re-replicated so far.
    pub done: u64,
    /// Chunks the current pass has still to do (0 once it ended).
    pub left: u64,
    /// Chunks the current (or last) pass could not re-replicate (no room, a copy failed, no
    /// server to place on): retried by a later pass.
    pub failed: u64,
    /// Bytes the current (or last) pass copied.
    pub bytes: u64,
    /// The current (or last) pass's speed so far, in KiB/s.
    pub kib_per_s: u64,
    /// Chunks re-replicated since the meta server started.
    pub total_done: u64,
    /// The rate limit, in MiB/s (0: none).
    pub limit_mib_per_s: u64,
    /// Milliseconds until the next pass is due, if one is.
    pub next_pass_in_ms: Option<u64>,
}

/// One protocol and the version of it a server speaks (`fabric::handshake::Protocol`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtocolVersion {
    /// Its name: `rpc`, `verbs` or `lock-server`.
    pub name: String,
    /// The version.
    pub version: u16,
}

impl ProtocolVersion {
    /// Every protocol with the version this build speaks.
    pub fn all() -> Vec<ProtocolVersion> {
        use fabric::handshake::Protocol;
        [
            ("rpc", Protocol::Rpc),
            ("verbs", Protocol::Verbs),
            ("lock-server", Protocol::LockServer),
        ]
        .into_iter()
        .map(|(name, p)| ProtocolVersion {
            name: name.into(),
            version: p.version(),
        })
        .collect()
    }
}

/// The meta server's own state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaStatus {
    /// Milliseconds since it started.
    pub uptime_ms: u64,
    /// The directory of its database (its state), as it was configured.
    pub state_dir: String,
    /// Its region's fabric address.
    pub fabric: String,
    /// Client requests it has handled since it started, heartbeats excepted.
    pub requests: u64,
    /// Inodes in the namespace.
    pub inodes: u64,
    /// The chunk size in bytes.
    pub chunk_size: u64,
    /// A session silent for this long is fenced by the next `Fence`.
    pub fence_after_ms: u64,
    /// A session silent for this long is ended.
    pub session_lease_ms: u64,
    /// Where its database stands.
    pub database: DatabaseStatus,
}

/// How far the meta server's database is behind its answers: mutations are answered from
/// memory and written to the database behind them, and reach the disk at its flushes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatabaseStatus {
    /// Mutations committed (answered) since the database was opened.
    pub committed: u64,
    /// Of those, how many are written to the database (not necessarily flushed to disk).
    pub written: u64,
    /// Milliseconds since the last flush to disk the meta server made (at an `fsync`, and
    /// before it zeroes chunks that freed or truncated files gave back); `None` when none since
    /// its database was opened. The database's own periodic flushes of its log are not counted.
    pub last_flush_ago_ms: Option<u64>,
    /// The error that stopped the database's writer, if one did (no mutation commits then).
    pub failed: Option<String>,
}

/// One data server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataServerStatus {
    /// Its id, dense from 0.
    pub id: u32,
    /// Its stable name.
    pub name: String,
    /// Its failure domain (`--zone`), if it named one.
    pub zone: Option<String>,
    /// Its region's fabric address.
    pub address: String,
    /// The life of its region it registered with last.
    pub incarnation: u64,
    /// Whether it is registered now.
    pub live: bool,
    /// Chunks (of the chunk size) its region holds.
    pub chunks: u64,
    /// Bytes its region holds.
    pub capacity_bytes: u64,
    /// Bytes that no file holds (free, never used, or freed and waiting to be zeroed).
    pub free_bytes: u64,
}

impl DataServerStatus {
    /// Bytes that files hold.
    pub fn used_bytes(&self) -> u64 {
        self.capacity_bytes.saturating_sub(self.free_bytes)
    }
}

/// One client session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionStatus {
    /// Its id.
    pub id: u64,
    /// The host its client named in its handshake.
    pub host: String,
    /// The client's process id, as it said.
    pub pid: u32,
    /// Where its connection comes from: `ip:port` on tcp, `local` on the meta server's Unix
    /// socket.
    pub peer: String,
    /// Milliseconds since it opened.
    pub age_ms: u64,
    /// Milliseconds since the meta server last heard from it (its lease runs out at
    /// [`MetaStatus::session_lease_ms`]).
    pub silent_ms: u64,
    /// Whether a `Fence` now would revoke it: silent for longer than
    /// [`MetaStatus::fence_after_ms`], or only just back from such a silence. (A fenced session
    /// is ended at once: it is counted in [`ClusterStatus::fenced_sessions`], not listed.)
    pub fenceable: bool,
    /// Files it has open.
    pub open_files: u64,
    /// Whether it is the session that asked for this status.
    pub caller: bool,
}

/// One open file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenFileStatus {
    /// Its inode.
    pub ino: u64,
    /// How many sessions hold it open.
    pub sessions: u64,
    /// Its lock's scheme.
    pub scheme: String,
    /// Lock requests about it that reached the meta server as RPCs since it was opened (see
    /// the module docs: one-sided range-lock traffic is not among them).
    pub lock_calls: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_protocol_is_listed_with_this_builds_version() {
        let all = ProtocolVersion::all();
        let rpc = all.iter().find(|p| p.name == "rpc").unwrap();
        assert_eq!(rpc.version, crate::rpc::VERSION);
        assert_eq!(all.len(), 3);
    }
}
