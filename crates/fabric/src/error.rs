//! Errors of the fabric.
//!
//! Every verb is checked before any verb of its batch executes: a batch either runs whole or is
//! refused whole with the index of its first bad verb. The same errors come back from a remote
//! executor over `tcp` (they are serializable), so a client sees the same error whatever backend
//! it uses.

use crate::addr::{RegionId, RemoteAddr};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Why one verb of a batch was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error, Serialize, Deserialize)]
pub enum VerbError {
    /// The region is not registered on this server.
    #[error("verb {index}: {region} is not registered on this server")]
    UnknownRegion {
        /// Position of the verb in its batch.
        index: usize,
        /// The region it named.
        region: RegionId,
    },
    /// The verb reaches past the end of its region.
    #[error(
        "verb {index}: {len} bytes at {addr} reach past the end of the region ({region_len} bytes)"
    )]
    OutOfBounds {
        /// Position of the verb in its batch.
        index: usize,
        /// Where it started.
        addr: RemoteAddr,
        /// How many bytes it touched.
        len: u64,
        /// The region's size.
        region_len: u64,
    },
    /// A flush could not make its range durable. Unlike the other verb errors this is found
    /// while the batch runs: the verbs before and after the flush did execute.
    #[error("verb {index}: flush of {addr} failed: {reason}")]
    FlushFailed {
        /// Position of the verb in its batch.
        index: usize,
        /// Where the flushed range started.
        addr: RemoteAddr,
        /// What the backing store said.
        reason: String,
    },
    /// The batch expired ([`crate::Batch::expire_at`]) before this verb could execute: the
    /// verbs before it executed, this one and those after did not. Found while the batch
    /// runs, like a failed flush.
    #[error("verb {index}: the batch expired before it could execute")]
    Expired {
        /// Position of the first verb not executed.
        index: usize,
    },
    /// An atomic verb on an address that is not 8-byte aligned.
    #[error("verb {index}: atomic verb at {addr} is not 8-byte aligned")]
    Misaligned {
        /// Position of the verb in its batch.
        index: usize,
        /// The misaligned address.
        addr: RemoteAddr,
    },
}

/// Why a whole batch was refused for its shape.
#[derive(Clone, Debug, PartialEq, Eq, Error, Serialize, Deserialize)]
pub enum BatchError {
    /// More verbs than one batch may carry.
    #[error("batch of {count} verbs exceeds the limit of {max}")]
    TooManyVerbs {
        /// Verbs in the batch.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// One read or write moves more bytes than a verb may.
    #[error("verb {index} moves {len} bytes, more than the limit of {max}")]
    VerbTooLarge {
        /// Position of the verb.
        index: usize,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The batch moves more bytes than a batch may.
    #[error("batch moves {bytes} bytes, more than the limit of {max}")]
    BatchTooLarge {
        /// Bytes moved.
        bytes: u64,
        /// The limit.
        max: usize,
    },
    /// The write payload does not match the write verbs' lengths.
    #[error("batch declares {declared} bytes of writes but carries {actual}")]
    PayloadMismatch {
        /// Sum of write lengths.
        declared: u64,
        /// Payload length.
        actual: u64,
    },
}

/// An error from the fabric.
#[derive(Debug, Error)]
pub enum FabricError {
    /// A verb was refused; nothing in its batch executed.
    #[error(transparent)]
    Verb(#[from] VerbError),
    /// The batch was refused for its shape; nothing in it executed.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// An I/O error talking to a server or mapping its memory.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The server refused the connection (wrong cluster, token or protocol version), or the
    /// session's verbs (revoked: the client was fenced).
    #[error("refused by server: {0}")]
    Refused(String),
    /// The server refused a new connection because its session belongs to an earlier run of
    /// the cluster's meta server ([`crate::handshake::Refusal::SessionBehind`]): nothing ran,
    /// and the client, behind a restart it has not noticed yet, must catch up (a new session)
    /// and try again. Unlike [`FabricError::Refused`], nothing about the client is wrong.
    #[error("refused by server: {0}")]
    SessionBehind(String),
    /// The server refused a new connection because one of its limits on connections was
    /// reached ([`crate::handshake::Refusal::Limit`]: too many connections pending their
    /// handshake, or from this address): nothing ran, nothing about the client or its session
    /// is wrong, and a later try may be admitted. The tcp endpoint has already tried again for
    /// up to its connect bound ([`crate::tcp::TcpTimeouts::connect`]) before reporting it.
    #[error("refused by server for now: {0}")]
    Limited(String),
    /// The server did not prove in the handshake that it holds the cluster's secret: an
    /// impostor, or a server given another token (`crate::handshake`). The client sent nothing
    /// derived from the secret and closed the connection; nothing ran.
    #[error("{0}")]
    Unverified(String),
    /// The peer broke the protocol (bad frame, checksum, or unexpected message).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The connection to the server is gone; the batch may or may not have executed.
    #[error("connection to server lost: {0}")]
    Disconnected(String),
    /// The server did not answer within the endpoint's time bound (`tcp::TcpTimeouts`): a cut
    /// link, a frozen or dead host — nothing closed the connection. Like `Disconnected`, the
    /// batch may or may not have executed and the endpoint is dead; unlike it, the bound has
    /// already been spent waiting, so an immediate retry on the same path is not worth it.
    #[error("no answer from server in time: {0}")]
    TimedOut(String),
    /// A backend-level configuration problem (bad path, region exists, ...).
    #[error("{0}")]
    Config(String),
    /// The endpoint or its server does not offer what was asked (a procedure, on a backend or
    /// server without it); nothing ran, and the endpoint stays usable.
    #[error("not offered: {0}")]
    Unsupported(String),
    /// A procedure ran at the server and failed (`crate::procedure`); what it did before
    /// failing is its own contract. The endpoint stays usable.
    #[error("remote procedure failed: {0}")]
    Procedure(String),
}

impl FabricError {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        FabricError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Result type of the fabric.
pub type Result<T, E = FabricError> = std::result::Result<T, E>;
