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

use crate::addr::RegionId;
use crate::endpoint::{Connector, Endpoint, EndpointExt};
use crate::procedure::{Procedure, ProcedureId, ProcedureSession};
use crate::region::Region;
use server::{serve, Next, Session, Shared};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

/// Runs the server's handling of untrusted bytes on `data`, for fuzzing; panics only on a bug.
///
/// The first byte selects what is exercised, the rest is the input:
/// - bit 0 set: the session starts authenticated (skips the handshake);
/// - bit 1 clear: the input is the raw byte stream of a connection, read with exactly the loop a
///   server connection thread runs (frame header, length limit, checksum, decode, shape check,
///   execute against two small regions, reply);
/// - bit 1 set: the input is a sequence of frame bodies, each `[len: u16 LE][body]`, handed to
///   the same session code without framing (so the fuzzer need not forge checksums);
/// - bit 2 set: instead, the input is a reply body given to the client's decoders.
///
/// The server offers one procedure, [`FUZZ_PROCEDURE`] (it reads a word the arguments name
/// through a host endpoint and echoes the arguments), so that calls reach a procedure's
/// session and its host endpoint as well as the refusals.
///
/// The server's nonce is [`FUZZ_NONCE`](crate::handshake::FUZZ_NONCE), so the seeds' proofs
/// ([`crate::handshake::fuzz_handshake`]) reach past the challenge.
///
/// Every reply the server produces must itself be a well-formed frame holding a decodable
/// [`ChallengeAnswer`](crate::handshake::ChallengeAnswer) then [`wire::HelloAnswer`] (the first
/// two, unless the session started authenticated) or [`wire::Reply`]; that is asserted.
pub fn fuzz_entry(data: &[u8]) {
    let Some((&mode, input)) = data.split_first() else {
        return;
    };
    if mode & 4 != 0 {
        fuzz_client_decoders(input);
        return;
    }
    let shared = Arc::new(Shared::new(crate::handshake::fuzz_credentials()));
    // Region ids with a gap, one region a single word long: edges for the bounds checks.
    for (id, len) in [(0, 8), (2, 4096)] {
        if shared
            .add(Arc::new(Region::anonymous(RegionId(id), len)))
            .is_err()
        {
            unreachable!("fresh table");
        }
    }
    if shared
        .add_procedure(FUZZ_PROCEDURE, Arc::new(FuzzEcho))
        .is_err()
    {
        unreachable!("fresh server");
    }
    let mut session = Session::new(shared);
    session.authenticated = mode & 1 != 0;
    session.fixed_nonce = Some(crate::handshake::FUZZ_NONCE);
    let answer_first = !session.authenticated;
    let mut replies = Vec::new();
    if mode & 2 == 0 {
        serve(
            &mut session,
            &mut &input[..],
            &mut replies,
            || true,
            || {},
            || {},
        );
    } else {
        let mut rest = input;
        while rest.len() >= 2 {
            let len = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
            session.rx.clear();
            session.rx.extend_from_slice(&rest[2..2 + len]);
            rest = &rest[2 + len..];
            let next = session.handle(Ok(()));
            replies.extend_from_slice(session.reply());
            if next == Next::Close {
                break;
            }
        }
    }
    check_replies(&replies, answer_first);
}

/// The number of the procedure the fuzz target's server offers.
pub const FUZZ_PROCEDURE: ProcedureId = 7;

/// [`FUZZ_PROCEDURE`]: reads the word of region 2 at the offset the first 8 bytes of its
/// arguments give (0 without them) through a host endpoint, and returns the arguments followed
/// by that word. A hostile offset fails the read, and with it the call.
struct FuzzEcho;

impl Procedure for FuzzEcho {
    fn open(
        &self,
        host: Arc<dyn Connector>,
        _session: u64,
    ) -> crate::Result<Box<dyn ProcedureSession>> {
        Ok(Box::new(FuzzEchoSession(host.connect()?)))
    }
}

struct FuzzEchoSession(Box<dyn Endpoint>);

impl ProcedureSession for FuzzEchoSession {
    fn call(&mut self, args: &[u8], result: &mut Vec<u8>) -> crate::Result<()> {
        let offset = args
            .get(..8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
        let word = self
            .0
            .read_u64(crate::RemoteAddr::new(RegionId(2), offset))?;
        result.extend_from_slice(args);
        result.extend_from_slice(&word.to_le_bytes());
        Ok(())
    }
}

/// Asserts that `replies` is a sequence of well-formed frames: the answers to a hello and a
/// proof first if `answer_first`, then decodable `Reply`s.
fn check_replies(mut replies: &[u8], answer_first: bool) {
    let mut body = Vec::new();
    let mut handshake: u8 = if answer_first { 2 } else { 0 };
    while !replies.is_empty() {
        if let Err(e) = crate::frame::read_frame(&mut replies, usize::MAX, &mut body) {
            panic!("the server wrote a bad frame: {e}");
        }
        let decoded = match handshake {
            2 => postcard::from_bytes::<crate::handshake::ChallengeAnswer>(&body).map(drop),
            1 => postcard::from_bytes::<wire::HelloAnswer>(&body).map(drop),
            _ => postcard::from_bytes::<wire::Reply>(&body).map(drop),
        };
        handshake = handshake.saturating_sub(1);
        if let Err(e) = decoded {
            panic!("the server wrote an undecodable reply: {e}");
        }
    }
}

/// Feeds `input` to the client's reply decoders as if it came from a server.
fn fuzz_client_decoders(input: &[u8]) {
    use crate::addr::RemoteAddr;
    let _ = wire::decode_welcome(input);
    let _ = wire::decode_returned(input);
    let mut batch = crate::Batch::new();
    let r = RegionId(2);
    batch.faa(RemoteAddr::new(r, 0), 1);
    batch.read(RemoteAddr::new(r, 8), 5);
    batch.masked_cas(RemoteAddr::new(r, 16), 1, 1, 2, 2);
    let mut out = crate::Completions::new();
    if let Ok(wire::DecodedReply::Completions { .. }) = wire::decode_reply(input, &batch, &mut out)
    {
        assert!(out.matches(&batch));
    }
}

/// Seeds for [`fuzz_entry`]: a well-formed session (a hello, then a batch of every verb) in
/// each mode, and the session's frame bodies in the unframed mode.
pub fn fuzz_seeds() -> Vec<Vec<u8>> {
    use crate::addr::RemoteAddr;
    let mut hello = wire::Hello::new(
        crate::handshake::Protocol::Verbs,
        &crate::handshake::fuzz_credentials(),
        0,
        (),
    );
    hello.nonce = crate::handshake::FUZZ_NONCE;
    // The hello and the client's proof, framed, and their bodies.
    let handshake = crate::handshake::fuzz_handshake(&hello);
    let bodies = unframe(&handshake);
    let mut body = Vec::new();
    let mut batch = crate::Batch::new();
    let a = RemoteAddr::new(RegionId(2), 8);
    batch.write(a, b"hello");
    batch.read(a, 5);
    batch.faa(a, 1);
    batch.cas(a, 0, 1);
    batch.masked_cas(RemoteAddr::new(RegionId(2), 16), 1, 1, 2, 2);
    batch.read(RemoteAddr::new(RegionId(0), 0), 8);
    body.clear();
    wire::encode_batch(&mut body, &batch);
    let request = body;
    let mut call = Vec::new();
    wire::encode_call(&mut call, FUZZ_PROCEDURE, &16u64.to_le_bytes(), false);
    let mut posted_call = Vec::new();
    wire::encode_call(&mut posted_call, FUZZ_PROCEDURE, &8u64.to_le_bytes(), true);
    let mut unknown_call = Vec::new();
    wire::encode_call(&mut unknown_call, FUZZ_PROCEDURE + 1, b"?", false);
    let framed = [
        handshake.clone(),
        crate::fuzz::frame(&request),
        crate::fuzz::frame(&call),
    ]
    .concat();
    let unframed = |bodies: &[&[u8]]| -> Vec<u8> {
        bodies
            .iter()
            .flat_map(|b| {
                let mut out = (b.len() as u16).to_le_bytes().to_vec();
                out.extend_from_slice(b);
                out
            })
            .collect()
    };
    vec![
        [&[0u8][..], &framed].concat(),
        [&[1u8][..], &crate::fuzz::frame(&request)].concat(),
        [&[2u8][..], &unframed(&[&bodies[0], &bodies[1], &request])].concat(),
        [&[3u8][..], &unframed(&[&request, &request])].concat(),
        [&[3u8][..], &unframed(&[&call, &unknown_call, &request])].concat(),
        [&[3u8][..], &unframed(&[&posted_call, &call, &request])].concat(),
        vec![4, 2, 2, 200],
        {
            let mut returned = vec![4u8];
            wire::encode_returned(&mut returned, b"result");
            returned
        },
    ]
}

/// The bodies of the frames in `framed`.
fn unframe(mut framed: &[u8]) -> Vec<Vec<u8>> {
    let mut bodies = Vec::new();
    while !framed.is_empty() {
        let mut body = Vec::new();
        if crate::frame::read_frame(&mut framed, usize::MAX, &mut body).is_err() {
            unreachable!("the seeds' frames are well formed");
        }
        bodies.push(body);
    }
    bodies
}

#[cfg(test)]
mod tests {
    use super::*;

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
