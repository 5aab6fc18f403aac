//! The `tcp` backend: a software NIC for clusters without RDMA.
//!
//! A [`TcpServer`] owns registered regions and runs the shared verb executor
//! ([`RegionTable::execute`](crate::RegionTable::execute)) on batches it receives; a
//! [`TcpEndpoint`] is one client thread's TCP connection to it, and a [`TcpConnector`] opens
//! them. One batch is one request frame and one reply frame ([`wire`] has the protocol). Every
//! verb is shape-, region-, bounds- and alignment-checked on the server before any verb of its
//! batch runs, and a refused batch comes back as the same [`VerbError`](crate::VerbError) or
//! [`BatchError`](crate::BatchError) that `mem` and `shm` return.
//!
//! Connections are authenticated by the handshake every CitronFS protocol shares
//! ([`crate::handshake`]: versioned, naming the cluster and the session, a mutual
//! challenge–response over the cluster's secret); a peer that fails it gets a
//! [`Refusal`](crate::handshake::Refusal) and is disconnected.
//!
//! Threads and blocking sockets rather than an async runtime: a connection has at most one
//! outstanding batch, so a thread blocked in `read` that wakes straight into the executor is the
//! lowest-latency design, with no runtime hop between the socket and the verbs.

mod client;
mod server;
pub mod wire;

#[cfg(any(test, feature = "fuzzing"))]
mod fuzz;
#[cfg(any(test, feature = "fuzzing"))]
pub use fuzz::{fuzz_entry, fuzz_seeds, FUZZ_PROCEDURE};

pub use crate::handshake::HANDSHAKE_TIMEOUT;
pub use client::{
    TcpConnector, TcpEndpoint, TcpTimeouts, BATCH_TIMEOUT, CALL_TIMEOUT, CAPABILITIES,
    CONNECT_TIMEOUT, LIMIT_FIRST_PAUSE, LIMIT_MAX_PAUSE,
};
pub use server::TcpServer;
pub use wire::RegionInfo;

/// How long a server keeps a connection whose peer has stopped answering: a cut link or a
/// host that died closes nothing, and without this a server thread (or task) would wait on it
/// forever — for the next request of an idle connection, or to send a reply that is never
/// acknowledged. See [`watch_peer`].
pub const DEAD_PEER_AFTER: Duration = Duration::from_secs(10);

/// Makes the kernel drop connection `socket` once its peer has not answered for about
/// [`DEAD_PEER_AFTER`]: TCP keepalive probes an idle connection after half of it, once a
/// second, and `TCP_USER_TIMEOUT` aborts a connection whose data (or probes) went
/// unacknowledged that long. A live peer's kernel answers the probes, however idle its
/// program is, so only a dead or unreachable peer is dropped. The blocked read or write then
/// fails, and the server's connection ends. Best effort: a failure is logged at debug.
pub fn watch_peer(socket: &impl AsRawFd) {
    watch_peer_within(socket, DEAD_PEER_AFTER);
}

/// [`watch_peer`] finding a dead peer within about `after` (at least 2 s) instead.
pub fn watch_peer_within(socket: &impl AsRawFd, after: Duration) {
    let after = after.max(Duration::from_secs(2));
    let fd = socket.as_raw_fd();
    let secs = |d: Duration| d.as_secs().max(1) as libc::c_int;
    let options: [(libc::c_int, libc::c_int, libc::c_int); 5] = [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(after / 2)),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, secs(after / 2)),
        (
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            after.as_millis() as libc::c_int,
        ),
    ];
    for (level, name, value) in options {
        // SAFETY: `fd` is a socket owned by `socket`, alive for this call; the value is a
        // `c_int` of the size given, which the kernel only reads.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(
                name,
                "setsockopt for dead-peer detection: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

use std::os::fd::AsRawFd;
use std::time::Duration;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::RegionId;

    /// The server's handling of untrusted bytes under the stable fuzzer (see `crate::fuzz`).
    #[test]
    fn fuzz_tcp_server() {
        let seeds = fuzz_seeds();
        let report = crate::fuzz::run_framed(
            "tcp server",
            &seeds,
            crate::fuzz::DEFAULT_BUDGET,
            Some(1),
            fuzz_entry,
        );
        assert!(report.execs > seeds.len() as u64);
    }

    #[test]
    fn fuzz_entry_survives_seeds() {
        fuzz_entry(&[]);
        fuzz_entry(&[0]);
        fuzz_entry(&[0, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0]);
        fuzz_entry(&[3, 4, 0, 1, 1, 0, 0]);
        fuzz_entry(&[4, 2, 2, 200]);
        // A well-formed session: Hello and proof, then a batch with every verb.
        let mut stream = vec![0u8];
        let mut hello = wire::Hello::new(
            crate::handshake::Protocol::Verbs,
            &crate::Credentials::new("fuzz", "secret"),
            0,
            (),
        );
        hello.nonce = crate::handshake::FUZZ_NONCE;
        stream.extend_from_slice(&crate::handshake::fuzz_handshake(&hello));
        let mut body = Vec::new();
        let mut batch = crate::Batch::new();
        let a = crate::RemoteAddr::new(RegionId(2), 8);
        batch.write(a, b"hello");
        batch.read(a, 5);
        batch.faa(a, 1);
        body.clear();
        wire::encode_batch(&mut body, &batch);
        crate::frame::write_frame(&mut stream, &body).unwrap();
        fuzz_entry(&stream);
    }
}
