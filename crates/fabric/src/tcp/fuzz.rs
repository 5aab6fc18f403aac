//! The tcp server's fuzz entry ([`fuzz_entry`]) and its seeds (feature `fuzzing`).

use super::server::{serve, Next, Session, Shared};
use super::wire;
use crate::addr::RegionId;
use crate::endpoint::{Connector, Endpoint, EndpointExt};
use crate::procedure::{Procedure, ProcedureId, ProcedureSession};
use crate::region::Region;
use std::sync::Arc;

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
