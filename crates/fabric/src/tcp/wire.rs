//! The `tcp` fabric's wire protocol.
//!
//! Every message is one frame of [`crate::frame`] (`[len u32][crc32 u32][body]`). A body is the
//! [postcard] encoding of a [`Hello`], its [`ChallengeAnswer`](crate::handshake::ChallengeAnswer),
//! the client's [`Proof`](crate::handshake::Proof) and its [`HelloAnswer`], then of a [`Request`]
//! (client to server) or a [`Reply`] (server to client).
//!
//! ```text
//! client                                   server
//!   Hello (crate::handshake,         ──▶   (the handshake every CitronFS protocol shares)
//!          Protocol::Verbs)
//!                                    ◀──   Ok(Challenge {nonce, mac})
//!                                          or Err(Refusal), then close
//!   Proof {mac}                      ──▶
//!                                    ◀──   Ok(Welcome {version, regions, clock})
//!                                          or Err(Refusal), then close
//!   Request::Batch(batch)            ──▶   (one frame per batch)
//!                                    ◀──   Reply::Completions {clock, completions}
//!                                          or Reply::Error(RemoteError)
//!   Request::Call{procedure, args}   ──▶   (a procedure run next to memory, crate::procedure)
//!                                    ◀──   Reply::Returned(result)
//!                                          or Reply::Error(RemoteError)
//! ```
//!
//! `Call` and `Returned` came after the protocol's first version without changing it: they are
//! new variants at the end of their enums, so the existing encodings are unchanged, and a server
//! that predates them answers a call `Malformed` ("unknown request tag"), which a client takes
//! as "no procedures here".
//!
//! The two hot messages, `Request::Batch` and `Reply::Completions`, are encoded and decoded by
//! hand rather than through serde, so that a 1 MiB write payload or read result is one `memcpy`
//! instead of a million `serialize_u8` calls. The hand-written encoding is byte-for-byte the
//! postcard encoding of the enum (postcard writes a `Vec<u8>` as a varint length followed by the
//! raw bytes), which the unit tests check; so postcard remains the one definition of the format.
//!
//! `clock`, in the welcome and in every completions reply, is the server's count of
//! microseconds when it wrote the answer; a batch's expiry travels in that count
//! ([`crate::clock`]).
//!
//! Every decoder here is total: any byte string yields a value or an error, never a panic, and
//! the shape of a decoded batch is validated before a single verb is built from it.

use crate::addr::RegionId;
use crate::batch::{Batch, Completions, Verb, MAX_BATCH_BYTES, MAX_BATCH_VERBS, MAX_IO_BYTES};
use crate::clock::PeerClock;
use crate::error::{BatchError, VerbError};
use crate::frame::HEADER_LEN;
use crate::handshake::Protocol;
use crate::procedure::{ProcedureId, MAX_CALL_BYTES};
use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use crate::handshake::{Refusal, MAGIC, MAX_HELLO_FRAME};

/// The version of the verbs protocol this build speaks ([`Protocol::Verbs`]'s).
pub const PROTOCOL_VERSION: u16 = Protocol::Verbs.version();

/// The first message of a connection: the shared hello of every CitronFS protocol, with no
/// role.
pub type Hello = crate::handshake::Hello<()>;

/// The server's answer to the client's proof (the handshake's last message): like every
/// CitronFS protocol's, a `Result` whose error is the shared [`Refusal`], so that a client that
/// dialled another protocol's port still reads why it was refused.
pub type HelloAnswer = Result<Welcome, Refusal>;

/// Upper bound of the postcard encoding of one [`Verb`]: a variant tag (1 byte), a region id
/// (varint u32, 5 bytes), an offset (varint u64, 10 bytes) and at most four more varint u64s.
const MAX_VERB_ENCODING: usize = 1 + 5 + 10 + 4 * 10;

/// The largest request frame body a server reads from an authenticated client: the largest
/// well-formed batch (every verb at its largest encoding, the largest write payload) plus slack
/// for the tags and lengths. Anything larger cannot be a valid batch; the server answers
/// [`RemoteError::FrameTooLarge`] and closes, because the stream cannot be resynchronised.
pub const MAX_REQUEST_FRAME: usize = MAX_BATCH_BYTES + MAX_BATCH_VERBS * MAX_VERB_ENCODING + 64;

/// The largest reply frame body a client reads: the largest read result, every old value at its
/// largest encoding, and room for an error or a region list.
pub const MAX_REPLY_FRAME: usize = MAX_BATCH_BYTES + MAX_BATCH_VERBS * 10 + (1 << 20);

/// Postcard variant index of [`Request::Batch`].
const REQUEST_BATCH_TAG: u32 = 0;
/// Postcard variant index of [`Request::Call`].
const REQUEST_CALL_TAG: u32 = 1;
/// Postcard variant index of [`Request::PostedCall`].
const REQUEST_POSTED_CALL_TAG: u32 = 2;
/// Postcard variant index of [`Reply::Completions`].
const REPLY_COMPLETIONS_TAG: u32 = 0;
/// Postcard variant index of [`Reply::Returned`].
const REPLY_RETURNED_TAG: u32 = 2;

/// A client-to-server message after the handshake.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// One batch of verbs to execute (one round trip).
    Batch(Batch),
    /// One call of a procedure the server offers ([`crate::procedure`]; one round trip).
    Call {
        /// The procedure's number.
        procedure: ProcedureId,
        /// Its arguments, at most [`MAX_CALL_BYTES`].
        args: Vec<u8>,
    },
    /// A call nobody waits for (`Endpoint::post_call`): it runs after every request before it
    /// and before every request after it, and is answered only if it fails — with
    /// [`RemoteError::PostedCallFailed`], after which the server closes the connection, like a
    /// failed unsignaled work request that puts an RDMA queue pair into its error state.
    PostedCall {
        /// The procedure's number.
        procedure: ProcedureId,
        /// Its arguments, at most [`MAX_CALL_BYTES`].
        args: Vec<u8>,
    },
}

/// A region the server serves, as announced in [`Welcome`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// The region's id.
    pub id: RegionId,
    /// Its size in bytes.
    pub len: u64,
}

/// The server's answer to an accepted [`Hello`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The server's [`PROTOCOL_VERSION`].
    pub version: u16,
    /// The regions registered when the connection was accepted.
    pub regions: Vec<RegionInfo>,
    /// The server's count of microseconds when it answered ([`crate::clock`]).
    pub clock: u64,
}

/// Why a server refused one request of an authenticated connection.
///
/// Verb and batch errors are those of every backend, so a client sees the same error over `tcp`
/// as over `mem` or `shm`. After [`RemoteError::FrameTooLarge`], [`RemoteError::Revoked`],
/// [`RemoteError::SessionBehind`] and [`RemoteError::PostedCallFailed`] the server closes the
/// connection; after the others the connection stays usable.
#[derive(Clone, Debug, PartialEq, Eq, Error, Serialize, Deserialize)]
pub enum RemoteError {
    /// A verb was refused; nothing in the batch executed.
    #[error(transparent)]
    Verb(#[from] VerbError),
    /// The batch's shape was refused; nothing in it executed.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// The request frame's checksum did not match; nothing executed.
    #[error("request frame checksum mismatch (header {expected:#010x}, body {actual:#010x})")]
    BadChecksum {
        /// The checksum in the frame header.
        expected: u32,
        /// The checksum of the body the server received.
        actual: u32,
    },
    /// The request frame was larger than any valid request; the server closes the connection.
    #[error("request frame of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge {
        /// The declared length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The request could not be decoded; nothing executed.
    #[error("malformed request: {0}")]
    Malformed(String),
    /// The connection's session was revoked (fenced) by the cluster; nothing executed, and the
    /// server closes the connection.
    #[error("session {session} was revoked by the cluster (fenced after its lease ran out)")]
    Revoked {
        /// The revoked session.
        session: u64,
    },
    /// The server offers no procedure under this number; nothing ran.
    #[error("the server offers no procedure {procedure}")]
    UnknownProcedure {
        /// The number called.
        procedure: ProcedureId,
    },
    /// The procedure ran and failed; it says what it did (its own contract).
    #[error("procedure failed: {0}")]
    Procedure(String),
    /// A posted call ([`Request::PostedCall`]) failed; the server closes the connection, so
    /// nothing the client sent after that call ran. Sent in place of the next answer due.
    #[error("a posted call of procedure {procedure} failed: {why}; nothing sent after it ran")]
    PostedCallFailed {
        /// The number called.
        procedure: ProcedureId,
        /// Why it failed.
        why: String,
    },
    /// The connection's session is of an earlier run of the server that numbers sessions (the
    /// meta server restarted: `TcpServer::refuse_sessions_before`), not revoked: its client is
    /// behind a restart and joins again. Nothing executed, and the server closes the
    /// connection.
    #[error(
        "session {session} is of an earlier run of the meta server (sessions start at {floor})"
    )]
    SessionBehind {
        /// The connection's session.
        session: u64,
        /// The floor it is below.
        floor: u64,
    },
}

/// A server-to-client message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// The batch's completions.
    Completions {
        /// The server's count of microseconds when it answered ([`crate::clock`]).
        clock: u64,
        /// The verbs' results.
        completions: Completions,
    },
    /// The request was refused.
    Error(RemoteError),
    /// A procedure's result (the answer to [`Request::Call`]).
    Returned(Vec<u8>),
}

/// Appends `value` as a postcard (LEB128) varint.
fn put_varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push(value as u8 | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

/// Takes one varint off the front of `bytes`.
fn take_varint<'a>(bytes: &'a [u8], what: &str) -> Result<(u64, &'a [u8]), String> {
    postcard::take_from_bytes::<u64>(bytes).map_err(|e| format!("{what}: {e}"))
}

/// Appends postcard-encoded `value` to `buf` without a temporary allocation.
fn put_postcard<T: Serialize + ?Sized>(buf: &mut Vec<u8>, value: &T) {
    let taken = std::mem::take(buf);
    // Serializing into a Vec only fails for what postcard cannot express (sequences of unknown
    // length, `collect_str` of failing Display impls); the wire types contain none of these.
    *buf = match postcard::to_extend(value, taken) {
        Ok(extended) => extended,
        Err(e) => unreachable!("postcard cannot fail on fabric wire types: {e}"),
    };
}

/// Starts a frame in `buf`: clears it and reserves the header, filled in by [`seal_frame`].
pub(crate) fn begin_frame(buf: &mut Vec<u8>) {
    buf.clear();
    buf.resize(HEADER_LEN, 0);
}

/// Fills in the header of a frame started with [`begin_frame`], so that header and body go out
/// in one `write`.
pub(crate) fn seal_frame(buf: &mut [u8]) {
    let (header, body) = buf.split_at_mut(HEADER_LEN);
    header.copy_from_slice(&crate::frame::header_for(body));
}

/// Appends the postcard encoding of any message to `buf`.
pub fn encode_message<T: Serialize>(buf: &mut Vec<u8>, message: &T) {
    put_postcard(buf, message);
}

/// Appends the encoding of `Request::Batch(batch)` to `buf`: the postcard encoding, with the
/// write payload copied in one piece. The expiry is in this process's clock: for a server in
/// another process use [`encode_batch_for`].
pub fn encode_batch(buf: &mut Vec<u8>, batch: &Batch) {
    encode_batch_for(buf, batch, &PeerClock::SAME_PROCESS);
}

/// [`encode_batch`] for a server whose clock `peer` bounds: the expiry goes out in the
/// server's count, no later than the batch's instant (see [`crate::clock`]).
pub fn encode_batch_for(buf: &mut Vec<u8>, batch: &Batch, peer: &PeerClock) {
    put_varint(buf, u64::from(REQUEST_BATCH_TAG));
    put_postcard(buf, &batch.expires().map(|t| peer.to_peer(t)));
    put_postcard(buf, batch.verbs());
    put_varint(buf, batch.payload().len() as u64);
    buf.extend_from_slice(batch.payload());
}

/// Appends the encoding of `Reply::Completions` for `out`, stamped with this process's clock
/// now: the postcard encoding, with the read data copied in one piece.
pub fn encode_completions(buf: &mut Vec<u8>, out: &Completions) {
    encode_completions_at(buf, out, crate::clock::now_micros());
}

/// [`encode_completions`] stamped with `clock`.
pub fn encode_completions_at(buf: &mut Vec<u8>, out: &Completions, clock: u64) {
    put_varint(buf, u64::from(REPLY_COMPLETIONS_TAG));
    put_varint(buf, clock);
    put_varint(buf, out.olds().len() as u64);
    for &old in out.olds() {
        put_varint(buf, old);
    }
    put_varint(buf, out.data().len() as u64);
    buf.extend_from_slice(out.data());
}

/// Why a request body could not become a batch.
#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The bytes are not a well-formed request.
    Malformed(String),
    /// The request is a well-formed batch of a shape that is refused.
    Shape(BatchError),
}

impl From<DecodeError> for RemoteError {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::Malformed(why) => RemoteError::Malformed(why),
            DecodeError::Shape(e) => RemoteError::Batch(e),
        }
    }
}

/// Decodes a request body. A batch is decoded into `batch` (cleared first; `scratch` holds the
/// verbs meanwhile), both reused across calls so that the server's hot path does not allocate.
///
/// On success the batch has passed [`Batch::check_shape`]. Its shape is checked *before* verbs
/// are pushed into it, in the same order as `check_shape` checks it, so that no hostile length
/// reaches the assertions of [`Batch::read`] and [`Batch::write`].
pub fn decode_request(
    body: &[u8],
    scratch: &mut Vec<Verb>,
    batch: &mut Batch,
) -> Result<(), DecodeError> {
    let malformed = DecodeError::Malformed;
    let (tag, rest) = postcard::take_from_bytes::<u32>(body)
        .map_err(|e| malformed(format!("message tag: {e}")))?;
    if tag != REQUEST_BATCH_TAG {
        return Err(malformed(format!("unknown request tag {tag}")));
    }
    // In this server's count (see `crate::clock`).
    let (expires, rest) = postcard::take_from_bytes::<Option<u64>>(rest)
        .map_err(|e| malformed(format!("expiry: {e}")))?;
    let expires = expires.map(crate::clock::instant_of);

    let (count, mut rest) = take_varint(rest, "verb count").map_err(malformed)?;
    let count = usize::try_from(count).unwrap_or(usize::MAX);
    if count > MAX_BATCH_VERBS {
        return Err(DecodeError::Shape(BatchError::TooManyVerbs {
            count,
            max: MAX_BATCH_VERBS,
        }));
    }
    scratch.clear();
    for index in 0..count {
        let (verb, after) = postcard::take_from_bytes::<Verb>(rest)
            .map_err(|e| malformed(format!("verb {index}: {e}")))?;
        scratch.push(verb);
        rest = after;
    }
    let (payload_len, payload) = take_varint(rest, "payload length").map_err(malformed)?;
    if payload_len != payload.len() as u64 {
        return Err(malformed(format!(
            "payload length {payload_len} but {} bytes follow",
            payload.len()
        )));
    }

    // Shape, in check_shape's order: sizes of single verbs, then totals, then the payload.
    let (mut reads, mut writes) = (0u64, 0u64);
    for (index, verb) in scratch.iter().enumerate() {
        match *verb {
            Verb::Read { len, .. } | Verb::Write { len, .. } if len as usize > MAX_IO_BYTES => {
                return Err(DecodeError::Shape(BatchError::VerbTooLarge {
                    index,
                    len: len as usize,
                    max: MAX_IO_BYTES,
                }));
            }
            Verb::Read { len, .. } => reads += u64::from(len),
            Verb::Write { len, .. } => writes += u64::from(len),
            _ => {}
        }
    }
    if reads > MAX_BATCH_BYTES as u64 || writes > MAX_BATCH_BYTES as u64 {
        return Err(DecodeError::Shape(BatchError::BatchTooLarge {
            bytes: reads.max(writes),
            max: MAX_BATCH_BYTES,
        }));
    }
    if writes != payload_len {
        return Err(DecodeError::Shape(BatchError::PayloadMismatch {
            declared: writes,
            actual: payload_len,
        }));
    }

    // Every length is now within limits and the writes exactly consume the payload.
    batch.clear();
    batch.expire_at(expires);
    let mut data = payload;
    for verb in scratch.iter() {
        let write_data = match *verb {
            Verb::Write { len, .. } => {
                let (this, after) = data.split_at(len as usize);
                data = after;
                this
            }
            _ => &[],
        };
        batch.push(*verb, write_data);
    }
    // The authority on a network batch's shape; it also recomputes the batch's counters.
    batch.check_shape().map_err(DecodeError::Shape)?;
    Ok(())
}

/// What a reply body turned out to be, as far as a client executing a batch cares.
#[derive(Debug, PartialEq, Eq)]
pub enum DecodedReply {
    /// The batch's completions, now in the caller's [`Completions`].
    Completions {
        /// The server's count of microseconds when it answered.
        clock: u64,
    },
    /// The server refused the request.
    Error(RemoteError),
}

/// Decodes the reply to `batch` into `out` (reused across calls).
///
/// `Err` means the reply cannot be trusted (undecodable, a handshake message, or completions that
/// do not answer `batch`); the caller must drop the connection.
pub fn decode_reply(
    body: &[u8],
    batch: &Batch,
    out: &mut Completions,
) -> Result<DecodedReply, String> {
    let (tag, rest) =
        postcard::take_from_bytes::<u32>(body).map_err(|e| format!("reply tag: {e}"))?;
    if tag != REPLY_COMPLETIONS_TAG {
        return match postcard::take_from_bytes::<Reply>(body) {
            Ok((Reply::Error(e), [])) => Ok(DecodedReply::Error(e)),
            Ok((Reply::Error(_), trailing)) => {
                Err(format!("{} trailing bytes after an error", trailing.len()))
            }
            // Unreachable: the tag was not the completions tag. Decoding it slowly is correct.
            Ok((Reply::Completions { .. }, _)) => Err("unexpected encoding of Completions".into()),
            Ok((Reply::Returned(_), _)) => Err("a call's result where completions were due".into()),
            Err(e) => Err(format!("reply: {e}")),
        };
    }
    let (clock, rest) = take_varint(rest, "clock")?;
    let (olds, mut rest) = take_varint(rest, "old value count")?;
    if olds != batch.atomic_count() as u64 {
        return Err(format!(
            "{olds} old values for a batch of {} atomics",
            batch.atomic_count()
        ));
    }
    out.reset_for(batch);
    for _ in 0..olds {
        let (old, after) = take_varint(rest, "old value")?;
        out.push_old(old);
        rest = after;
    }
    let (data_len, data) = take_varint(rest, "read data length")?;
    if data_len != batch.read_bytes() as u64 || data.len() != batch.read_bytes() {
        return Err(format!(
            "{} bytes of read data ({data_len} declared) for a batch reading {}",
            data.len(),
            batch.read_bytes()
        ));
    }
    out.fill_reads(batch, data);
    if !out.matches(batch) {
        return Err("completions do not match the batch".into());
    }
    Ok(DecodedReply::Completions { clock })
}

/// Appends the encoding of `Request::Call { procedure, args }` (or, when `posted`,
/// `Request::PostedCall`) to `buf` (postcard's: the tag, the number, then `args` as a
/// length-prefixed byte string, copied in one piece).
pub fn encode_call(buf: &mut Vec<u8>, procedure: ProcedureId, args: &[u8], posted: bool) {
    let tag = if posted {
        REQUEST_POSTED_CALL_TAG
    } else {
        REQUEST_CALL_TAG
    };
    put_varint(buf, u64::from(tag));
    put_varint(buf, u64::from(procedure));
    put_varint(buf, args.len() as u64);
    buf.extend_from_slice(args);
}

/// Whether a request body is a [`Request::Call`] or a [`Request::PostedCall`] (by its tag; the
/// body is decoded by [`decode_call`]).
pub fn is_call(body: &[u8]) -> bool {
    matches!(
        postcard::take_from_bytes::<u32>(body),
        Ok((REQUEST_CALL_TAG | REQUEST_POSTED_CALL_TAG, _))
    )
}

/// A decoded call: [`Request::Call`] or [`Request::PostedCall`], its arguments borrowed from
/// the request body.
#[derive(Debug, PartialEq, Eq)]
pub struct DecodedCall<'a> {
    /// The procedure's number.
    pub procedure: ProcedureId,
    /// Its arguments.
    pub args: &'a [u8],
    /// Whether nobody waits for its result ([`Request::PostedCall`]).
    pub posted: bool,
}

/// Decodes a call's body. Arguments over [`MAX_CALL_BYTES`] are refused.
pub fn decode_call(body: &[u8]) -> Result<DecodedCall<'_>, DecodeError> {
    let malformed = DecodeError::Malformed;
    let (tag, rest) = postcard::take_from_bytes::<u32>(body)
        .map_err(|e| malformed(format!("message tag: {e}")))?;
    let posted = match tag {
        REQUEST_CALL_TAG => false,
        REQUEST_POSTED_CALL_TAG => true,
        _ => return Err(malformed(format!("request tag {tag} is not a call"))),
    };
    let (procedure, rest) = postcard::take_from_bytes::<u32>(rest)
        .map_err(|e| malformed(format!("procedure number: {e}")))?;
    let (len, args) = take_varint(rest, "argument length").map_err(malformed)?;
    if len != args.len() as u64 {
        return Err(malformed(format!(
            "argument length {len} but {} bytes follow",
            args.len()
        )));
    }
    if args.len() > MAX_CALL_BYTES {
        return Err(malformed(format!(
            "{} bytes of arguments exceed the limit of {MAX_CALL_BYTES}",
            args.len()
        )));
    }
    Ok(DecodedCall {
        procedure,
        args,
        posted,
    })
}

/// Appends the encoding of `Reply::Returned(result)` to `buf`.
pub fn encode_returned(buf: &mut Vec<u8>, result: &[u8]) {
    put_varint(buf, u64::from(REPLY_RETURNED_TAG));
    put_varint(buf, result.len() as u64);
    buf.extend_from_slice(result);
}

/// What a reply body to a call turned out to be.
#[derive(Debug, PartialEq, Eq)]
pub enum DecodedReturn<'a> {
    /// The procedure's result (borrowed from the body).
    Returned(&'a [u8]),
    /// The server refused the call, or the procedure failed.
    Error(RemoteError),
}

/// Decodes the reply to a call. `Err` means the reply cannot be trusted (undecodable, or
/// completions where a result was due); the caller must drop the connection.
pub fn decode_returned(body: &[u8]) -> Result<DecodedReturn<'_>, String> {
    let (tag, rest) =
        postcard::take_from_bytes::<u32>(body).map_err(|e| format!("reply tag: {e}"))?;
    if tag == REPLY_RETURNED_TAG {
        let (len, result) = take_varint(rest, "result length")?;
        if len != result.len() as u64 || result.len() > MAX_CALL_BYTES {
            return Err(format!(
                "{} bytes of result ({len} declared, at most {MAX_CALL_BYTES})",
                result.len()
            ));
        }
        return Ok(DecodedReturn::Returned(result));
    }
    match postcard::take_from_bytes::<Reply>(body) {
        Ok((Reply::Error(e), [])) => Ok(DecodedReturn::Error(e)),
        Ok((Reply::Error(_), trailing)) => {
            Err(format!("{} trailing bytes after an error", trailing.len()))
        }
        Ok((other, _)) => Err(format!("a {} where a call's result was due", other.kind())),
        Err(e) => Err(format!("reply: {e}")),
    }
}

impl Reply {
    /// The variant's name, for error messages.
    fn kind(&self) -> &'static str {
        match self {
            Reply::Completions { .. } => "batch's completions",
            Reply::Error(_) => "error",
            Reply::Returned(_) => "call's result",
        }
    }
}

/// Decodes the answer to a [`Hello`].
pub fn decode_welcome(body: &[u8]) -> Result<HelloAnswer, String> {
    match postcard::take_from_bytes::<HelloAnswer>(body) {
        Ok((answer, [])) => Ok(answer),
        Ok((_, trailing)) => Err(format!(
            "{} trailing bytes after the handshake answer",
            trailing.len()
        )),
        Err(e) => Err(format!("handshake answer: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::RemoteAddr;

    fn sample_batch() -> Batch {
        let r = RegionId(7);
        let mut batch = Batch::new();
        batch.read(RemoteAddr::new(r, 3), 11);
        batch.write(RemoteAddr::new(r, 1 << 40), &[9u8; 300]);
        batch.cas(RemoteAddr::new(r, 8), u64::MAX, 1);
        batch.faa(RemoteAddr::new(r, 16), 1 << 63);
        batch.masked_cas(RemoteAddr::new(r, 24), 1, 2, 3, 4);
        batch.masked_faa(RemoteAddr::new(r, 32), 5, 6);
        batch.write(RemoteAddr::new(r, 0), b"xy");
        batch
    }

    #[test]
    fn call_encoding_is_postcard_and_decodes_back() {
        for posted in [false, true] {
            let mut hand = Vec::new();
            encode_call(&mut hand, 0xC17_0001, b"args", posted);
            let request = if posted {
                Request::PostedCall {
                    procedure: 0xC17_0001,
                    args: b"args".to_vec(),
                }
            } else {
                Request::Call {
                    procedure: 0xC17_0001,
                    args: b"args".to_vec(),
                }
            };
            assert_eq!(hand, postcard::to_stdvec(&request).unwrap());
            assert!(is_call(&hand));
            assert_eq!(
                decode_call(&hand).unwrap(),
                DecodedCall {
                    procedure: 0xC17_0001,
                    args: b"args",
                    posted
                }
            );
        }
        let mut batch = Vec::new();
        encode_batch(&mut batch, &Batch::new());
        assert!(!is_call(&batch));
        assert!(decode_call(&batch).is_err());
    }

    #[test]
    fn hand_encoding_is_postcard() {
        let batch = sample_batch();
        let mut mine = Vec::new();
        encode_batch(&mut mine, &batch);
        let theirs = postcard::to_stdvec(&Request::Batch(batch.clone())).unwrap();
        assert_eq!(mine, theirs);

        let (mut scratch, mut decoded) = (Vec::new(), Batch::new());
        assert_eq!(decode_request(&theirs, &mut scratch, &mut decoded), Ok(()));
        assert_eq!(decoded, batch);
        assert_eq!(decoded.atomic_count(), 4);
        assert_eq!(decoded.read_bytes(), 11);

        // With an expiry: in this process's count, which decodes back to the instant.
        let mut expiring = batch.clone();
        let at = std::time::Instant::now() + std::time::Duration::from_millis(1500);
        expiring.expire_at(Some(at));
        let mut mine = Vec::new();
        encode_batch(&mut mine, &expiring);
        let theirs = postcard::to_stdvec(&Request::Batch(expiring)).unwrap();
        assert_eq!(mine, theirs);
        assert_eq!(decode_request(&theirs, &mut scratch, &mut decoded), Ok(()));
        let back = decoded.expires().expect("an expiry");
        let off = if back > at { back - at } else { at - back };
        assert!(off < std::time::Duration::from_micros(1), "{off:?}");

        let mut out = Completions::new();
        out.reset_for(&batch);
        for old in [0, 1, u64::MAX, 1 << 35] {
            out.push_old(old);
        }
        out.push_read(11).copy_from_slice(b"hello world");
        let mut mine = Vec::new();
        encode_completions_at(&mut mine, &out, 1 << 40);
        let theirs = postcard::to_stdvec(&Reply::Completions {
            clock: 1 << 40,
            completions: out.clone(),
        })
        .unwrap();
        assert_eq!(mine, theirs);
        let mut decoded = Completions::new();
        assert_eq!(
            decode_reply(&theirs, &batch, &mut decoded),
            Ok(DecodedReply::Completions { clock: 1 << 40 })
        );
        assert_eq!(decoded, out);
    }

    #[test]
    fn shape_errors_before_building() {
        let (mut scratch, mut batch) = (Vec::new(), Batch::new());
        // A write claiming more than MAX_IO_BYTES with no payload must not reach Batch::write.
        let mut body = Vec::new();
        put_varint(&mut body, u64::from(REQUEST_BATCH_TAG));
        body.push(0); // no expiry
        put_varint(&mut body, 1);
        put_postcard(
            &mut body,
            &Verb::Write {
                addr: RemoteAddr::new(RegionId(0), 0),
                len: u32::MAX,
            },
        );
        put_varint(&mut body, 0);
        assert!(matches!(
            decode_request(&body, &mut scratch, &mut batch),
            Err(DecodeError::Shape(BatchError::VerbTooLarge {
                index: 0,
                ..
            }))
        ));
        // A verb count far over the limit is refused before anything is decoded.
        let mut body = Vec::new();
        put_varint(&mut body, u64::from(REQUEST_BATCH_TAG));
        body.push(0); // no expiry
        put_varint(&mut body, u64::MAX);
        assert!(matches!(
            decode_request(&body, &mut scratch, &mut batch),
            Err(DecodeError::Shape(BatchError::TooManyVerbs { .. }))
        ));
        // Truncation anywhere is malformed, never a panic.
        let mut full = Vec::new();
        encode_batch(&mut full, &sample_batch());
        for cut in 0..full.len() {
            assert!(decode_request(&full[..cut], &mut scratch, &mut batch).is_err());
        }
    }
}
