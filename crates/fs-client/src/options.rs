//! [`MountOptions`]: how a client reaches its cluster and locks its files.

use lockmgr::schemes::Hosting;
use lockmgr::{LockMode, LockScheme};

/// How to reach a cluster and how to lock files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountOptions {
    /// The meta server's RPC address (`host:port`).
    pub meta_addr: String,
    /// The cluster's name.
    pub cluster: String,
    /// The cluster's shared secret.
    pub token: String,
    /// The range-lock scheme of every read and write (`citron` by default).
    pub scheme: LockScheme,
    /// This client's host name, for the meta server's logs.
    pub host: String,
    /// How long connecting to a tcp fabric server and one batch of verbs may take before a
    /// silent server (a cut link, a frozen host) fails the call with EIO instead of blocking
    /// it ([`fabric::TcpTimeouts::DEFAULT`]: 5 s each).
    pub fabric_timeouts: fabric::TcpTimeouts,
    /// Where range locks are acquired, for a scheme that can be acquired at its host
    /// (CITRON): by default ([`Hosting::Auto`]) at the meta server, which hosts the locks'
    /// memory, where it offers that (tcp: one call per acquisition, the release posted, the
    /// meta server fencing and growing the lock on the client's behalf), and one-sided
    /// otherwise. [`Hosting::Never`] acquires one-sided always (tests that kill a client in the
    /// middle of the protocol).
    pub lock_hosting: Hosting,
    /// The mode of a read's range lock: [`LockMode::Shared`] by default, so that overlapping
    /// reads hold their ranges together where the scheme shares (`docs/SHARED_LOCKS.md`,
    /// "Through the file system"); [`LockMode::Exclusive`] takes them as writes are taken
    /// (the behaviour before shared reads, kept for comparison: `--read-locks exclusive`).
    /// Writes, truncates and fallocate are exclusive always.
    pub read_locks: LockMode,
}

impl MountOptions {
    /// The cluster credentials every server checks in the handshake.
    pub fn credentials(&self) -> fabric::Credentials {
        fabric::Credentials::new(self.cluster.clone(), self.token.clone())
    }

    /// Options for the cluster at `meta_addr` with the default scheme (`citron`).
    pub fn new(
        meta_addr: impl Into<String>,
        cluster: impl Into<String>,
        token: impl Into<String>,
    ) -> MountOptions {
        MountOptions {
            meta_addr: meta_addr.into(),
            cluster: cluster.into(),
            token: token.into(),
            scheme: LockScheme::default(),
            host: hostname(),
            fabric_timeouts: fabric::TcpTimeouts::DEFAULT,
            lock_hosting: Hosting::Auto,
            read_locks: LockMode::Shared,
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}
