//! The client's error: what failed, with its cause kept, and the one mapping to an errno.
//!
//! [`proto::FsError`] is the meta server's answer on the wire; it is serializable, so it can
//! only carry text. Everything that goes wrong on the client's side of the wire — a fabric verb
//! or connection, a range-lock operation, the RPC transport, a lease that ran out, an answer
//! that contradicts the protocol — is an [`Error`](enum@Error) variant that keeps its typed cause as its
//! `source()`, so a log line (the FUSE adapter's, `fuse`) or a caller can name the real cause.
//!
//! Conventions:
//! - **One mapping to errno**, [`Error::errno`]: a server's answer keeps the errno the wire
//!   error names ([`FsError::errno`]); every failure below the file system is `EIO` (the
//!   operation's outcome is unknown; docs/ARCHITECTURE.md "Fencing": a fenced client's I/O fails with EIO).
//!   The match lists every variant, so a new one must choose.
//! - **Display includes the cause**, as the rest of the workspace does (`FabricError::Io`,
//!   `LockError::Fabric`): `{err}` alone is a full sentence for a log line or an `anyhow`
//!   message. [`Chain`] walks `source()` and writes each cause that the text so far does not
//!   already contain, so a chain prints every cause exactly once whichever convention each of
//!   its links follows.
//! - Converting to `std::io::Error` keeps everything: the raw OS error when the error says no
//!   more than its errno, else an error of the errno's kind carrying this error.

use fabric::FabricError;
use lockmgr::LockError;
use proto::rpc::RpcError;
use proto::{FsError, Ino};
use std::fmt;
use thiserror::Error;

/// A fabric server this client talks to, as named in an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// The meta server's fabric (file control blocks and lock words).
    Meta,
    /// Data server `0`.
    Data(u32),
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Meta => write!(f, "the meta region"),
            Peer::Data(id) => write!(f, "data server {id}"),
        }
    }
}

/// Why a [`crate::CitronFs`] call failed (see the module docs).
#[derive(Debug, Error)]
pub enum Error {
    /// A file-system outcome as the wire error names it: the meta server's answer (ENOENT,
    /// EEXIST, ESTALE for a revoked session, ...), or the same rule checked by this client
    /// before asking (a bad name, a released handle, a range past the largest file).
    #[error(transparent)]
    Fs(#[from] FsError),
    /// The RPC to the meta server failed below the file system (connection, framing,
    /// encoding, a refused handshake): the call's outcome is unknown.
    #[error("meta server {addr}: {source}")]
    Rpc {
        /// The meta server's address.
        addr: String,
        /// The transport's error.
        #[source]
        source: RpcError,
    },
    /// A fabric connection or batch of verbs failed (server gone, session revoked by a fence,
    /// a verb refused): the batch may or may not have executed.
    #[error("fabric to {peer}: {source}")]
    Fabric {
        /// The server the endpoint reaches.
        peer: Peer,
        /// The fabric's error.
        #[source]
        source: FabricError,
    },
    /// A range-lock operation on a file failed (opening, acquiring or releasing its lock).
    #[error("range lock of inode {ino}: {source}")]
    Lock {
        /// The file.
        ino: Ino,
        /// The lock manager's error.
        #[source]
        source: LockError,
    },
    /// The lease of the range lock guarding an I/O ran out before its data verbs could be
    /// posted (a write) or had completed (a read): another client may have broken the lock, so
    /// the I/O must not count. The data path retries under a new lock and reports this only
    /// when that keeps happening.
    #[error("the range lock's lease ran out before the I/O was done")]
    LeaseLost,
    /// The lease of the range lock guarding a change (a write, a fallocate step) ran out after
    /// part of it was sent — a data batch to one data server but not yet to another, say — so
    /// that part may be in the file. It is not redone: releasing the lock handed the range to
    /// the next holder, who may have read the part, and redoing it would make that torn read
    /// one of a write reported done. The caller sees EIO and the range may hold the part, as
    /// after a write cut by a crash.
    #[error(
        "the range lock's lease ran out partway through the change, after part of it was \
         sent: that part may be in the file, and the change is not redone"
    )]
    LeaseLostPartway,
    /// The meta server answered a call with a response of the wrong kind.
    #[error("meta server answered {call} with {got}")]
    UnexpectedResponse {
        /// The call.
        call: &'static str,
        /// The kind of response it got.
        got: &'static str,
    },
    /// The meta server's answers contradict the protocol, each other, or what this client
    /// checked (a file control block of another inode, a chunk outside its data server, a
    /// chunk count that does not match the request, ...).
    #[error("{0}")]
    Protocol(String),
    /// The file control block where this client's open of a file puts it belongs to another
    /// file (its INO word says so). After a meta server restart this is the client not having
    /// caught up yet — the new meta session lays files out anew, and reopening the file finds
    /// its new place — so the data path catches up and redoes the I/O; within one session it
    /// is a protocol violation (`view`'s `recover` tells the two apart). Nothing is written
    /// through such a block.
    #[error(
        "file control block at {fcb} belongs to inode {found}, not {ino} (opened in meta \
         session {session})"
    )]
    ForeignFcb {
        /// The file.
        ino: Ino,
        /// The inode the block's INO word names.
        found: Ino,
        /// Where the block is.
        fcb: fabric::RemoteAddr,
        /// The meta session the file was opened in.
        session: u64,
    },
    /// A chunk lives on a data server this client was not told about at connect.
    #[error("data server {0} is unknown to this client (joined after it connected?)")]
    UnknownDataServer(u32),
    /// A write's chunk allocation found a new file generation (a truncate or unlink elsewhere)
    /// on every attempt.
    #[error("inode {ino}: the file generation kept changing during a write")]
    GenerationChurn {
        /// The file.
        ino: Ino,
    },
    /// A data server an I/O needs stayed unregistered (down, or cut off from the meta server)
    /// for the whole wait (`view`'s `Views::data_deadline`).
    #[error(
        "data server {server} is not connected to the cluster (waited {waited:?} for it, in this \
         call or since this client first found it away)"
    )]
    DataServerAway {
        /// The data server.
        server: u32,
        /// How long the client waited for it: since the call began, or since the client first
        /// found it away in this outage, if that was earlier.
        waited: std::time::Duration,
    },
    /// A data batch reached another life of a data server than this client's view knows (its
    /// incarnation word did not match): the server restarted, and the client must catch up
    /// before the outcome can count.
    #[error(
        "data server {server} is at incarnation {found:#x}, not {expected:#x} as this client \
         knew it (it restarted)"
    )]
    StaleDataServer {
        /// The data server.
        server: u32,
        /// The incarnation this client's view has.
        expected: u64,
        /// The incarnation word read.
        found: u64,
    },
    /// A write's (or a flush's) data round failed on data server `server`, and every chunk it
    /// touched there has a replica on another server: once the meta server has marked the
    /// server down it drops those replicas, so the I/O is redone at once with a chunk map
    /// learnt anew, without waiting for the server (`view`'s `recover`; docs/REPLICAS.md "A
    /// dead data server"). Transient, as the failure it carries.
    #[error("data server {server} failed an I/O of chunks with replicas elsewhere: {source}")]
    ReplicaServerFailed {
        /// The data server.
        server: u32,
        /// The failure.
        #[source]
        source: Box<Error>,
    },
    /// An fsync found that changes this client made before the meta server restarted (and
    /// that no fsync covered) may have been lost with it.
    #[error(
        "the meta server restarted since this client's last fsync: changes it acknowledged \
         before may be lost"
    )]
    ChangesMaybeLost,
    /// The session's heartbeat thread could not be started.
    #[error("cannot start the heartbeat thread: {0}")]
    Heartbeat(#[source] std::io::Error),
    /// A wait the caller asked to stop (a signal reached the process blocked in `F_SETLKW`).
    #[error("interrupted")]
    Interrupted,
    /// A record lock the calling lock owner held on this file was lost: the client's meta
    /// session ended without a restart's grace (a lost connection, a fence, a stopped
    /// client), and another client took the bytes before it could take the lock back
    /// (`records`). Its reads and writes of the file fail, as on NFS, until it unlocks or
    /// closes the file: what it wrote under the lock may have been interleaved with another
    /// client's writes, and it must not go on as if the lock had held.
    #[error(
        "inode {ino}: a record lock this process held was lost when the client's meta session \
         ended, and another client took it; reads and writes fail until it unlocks or closes \
         the file"
    )]
    RecordLockLost {
        /// The file.
        ino: Ino,
    },
}

impl Error {
    /// The errno a POSIX caller sees for this error: the one place the client maps errors to
    /// errnos (see the module docs).
    pub fn errno(&self) -> i32 {
        match self {
            Error::Fs(e) => e.errno(),
            Error::Rpc { .. }
            | Error::Fabric { .. }
            | Error::Lock { .. }
            | Error::LeaseLost
            | Error::LeaseLostPartway
            | Error::UnexpectedResponse { .. }
            | Error::Protocol(_)
            | Error::UnknownDataServer(_)
            | Error::GenerationChurn { .. }
            | Error::DataServerAway { .. }
            | Error::StaleDataServer { .. }
            | Error::ReplicaServerFailed { .. }
            | Error::ChangesMaybeLost
            | Error::RecordLockLost { .. }
            | Error::ForeignFcb { .. }
            | Error::Heartbeat(_) => libc::EIO,
            Error::Interrupted => libc::EINTR,
        }
    }

    /// Whether the failure was below the file system and may pass once the client has caught
    /// up with the cluster (a server restarted, a connection broke, the layout changed): the
    /// data path then refreshes its view and tries again (`io`). A refusal (wrong token, a
    /// revoked session: the client joins again instead, `Error::is_fenced`), a verb refused
    /// for its shape, a protocol violation or a server's answer are final.
    ///
    /// A new connection refused because its session is of an earlier run of the meta server
    /// (`FabricError::SessionBehind`, tcp) is transient: the client opened it under a view it
    /// had not yet found out of date (its heartbeat had not met the restart), and catching up
    /// gives it a session of this run. Nothing of the I/O ran on that connection.
    ///
    /// So is a new connection refused for one of the server's limits on connections
    /// (`FabricError::Limited`: a flood of connections that never authenticate, say): the
    /// session is fine, nothing ran, and the endpoint tried again for its connect bound
    /// already; the I/O is redone within the recovery budget. It never ends the session.
    pub(crate) fn is_transient(&self) -> bool {
        fn fabric(e: &FabricError) -> bool {
            matches!(
                e,
                FabricError::Io { .. }
                    | FabricError::Disconnected(_)
                    | FabricError::SessionBehind(_)
                    | FabricError::Limited(_)
            )
        }
        match self {
            Error::Rpc { source, .. } => !source.is_refusal(),
            // A data server registers its regions one after another as it starts: an endpoint
            // that connected in between lacks the later ones (the incarnation word). A fresh
            // endpoint, once the client has caught up, finds them.
            Error::Fabric {
                peer: Peer::Data(_),
                source: FabricError::Verb(fabric::VerbError::UnknownRegion { .. }),
            } => true,
            Error::Fabric { source, .. } => fabric(source),
            Error::Lock {
                source: LockError::Fabric(source),
                ..
            } => fabric(source),
            // A lock whose memory its server emptied: a client behind a meta server restart
            // (shm), as `ForeignFcb`.
            Error::Lock {
                source: LockError::Emptied,
                ..
            } => true,
            Error::UnknownDataServer(_)
            | Error::StaleDataServer { .. }
            | Error::ReplicaServerFailed { .. }
            | Error::ForeignFcb { .. }
            | Error::Fs(FsError::Unavailable(_)) => true,
            _ => false,
        }
    }

    /// Whether a fabric server refused this client's session: revoked by a fence
    /// (docs/ARCHITECTURE.md "Fencing"; tcp). Every verb of the session is refused from then on, so the
    /// client must join again in a new session (`meta::Meta::session_ended`).
    pub(crate) fn is_fenced(&self) -> bool {
        matches!(
            self,
            Error::Fabric {
                source: FabricError::Refused(_),
                ..
            } | Error::Lock {
                source: LockError::Fabric(FabricError::Refused(_)),
                ..
            }
        )
    }

    /// The data server a failure is about, if it names one.
    pub(crate) fn data_server(&self) -> Option<u32> {
        match self {
            Error::Fabric {
                peer: Peer::Data(id),
                ..
            }
            | Error::UnknownDataServer(id)
            | Error::StaleDataServer { server: id, .. }
            | Error::ReplicaServerFailed { server: id, .. }
            | Error::DataServerAway { server: id, .. } => Some(*id),
            _ => None,
        }
    }

    /// A fabric failure on `peer`.
    pub(crate) fn fabric(peer: Peer) -> impl Fn(FabricError) -> Error + Copy {
        move |source| Error::Fabric { peer, source }
    }

    /// A range-lock failure on file `ino`.
    pub(crate) fn lock(ino: Ino) -> impl Fn(LockError) -> Error + Copy {
        move |source| Error::Lock { ino, source }
    }
}

/// An error is equal to a wire error when it is exactly that answer (or local check), so that
/// callers and tests can compare with `FsError::NotFound` and the like.
impl PartialEq<FsError> for Error {
    fn eq(&self, other: &FsError) -> bool {
        matches!(self, Error::Fs(e) if e == other)
    }
}

/// See the module docs: the raw OS error when nothing else would be lost.
impl From<Error> for std::io::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Fs(e) => e.into(),
            other => std::io::Error::new(proto::kind_from_errno(other.errno()), other),
        }
    }
}

/// Displays an error and its causes as `error: cause: cause of cause`, each cause written
/// once: a cause whose text the line already contains (its wrapper's Display included it) is
/// skipped, and the walk goes on to its own cause.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = self.0.to_string();
        f.write_str(&shown)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            let text = cause.to_string();
            if !shown.contains(&text) {
                write!(f, ": {text}")?;
                shown.push_str(": ");
                shown.push_str(&text);
            }
            next = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    /// An error that follows the other convention: its Display leaves the cause out.
    #[derive(Debug, Error)]
    #[error("outer step failed")]
    struct Terse(#[source] std::io::Error);

    fn disconnected() -> FabricError {
        FabricError::Disconnected("peer closed the connection".into())
    }

    #[test]
    fn errnos() {
        assert_eq!(Error::from(FsError::NotFound).errno(), libc::ENOENT);
        assert_eq!(Error::from(FsError::NoSpace).errno(), libc::ENOSPC);
        assert_eq!(Error::from(FsError::Stale).errno(), libc::ESTALE);
        assert_eq!(Error::from(FsError::Io("sled".into())).errno(), libc::EIO);
        assert_eq!(
            Error::fabric(Peer::Data(2))(disconnected()).errno(),
            libc::EIO
        );
        let lock = Error::lock(7)(LockError::Fabric(disconnected()));
        assert_eq!(lock.errno(), libc::EIO);
        assert_eq!(Error::LeaseLost.errno(), libc::EIO);
        assert_eq!(Error::LeaseLostPartway.errno(), libc::EIO);
        assert!(!Error::LeaseLostPartway.is_transient(), "never redone");
        assert_eq!(Error::UnknownDataServer(3).errno(), libc::EIO);
        let rpc = Error::Rpc {
            addr: "meta:1".into(),
            source: RpcError::Refused(proto::rpc::Refusal::BadToken {
                cluster: "c".into(),
            }),
        };
        assert_eq!(rpc.errno(), libc::EIO);
        assert_eq!(Error::from(FsError::Exists), FsError::Exists);
        assert_ne!(Error::LeaseLost, FsError::Io(String::new()));
    }

    #[test]
    fn a_fabric_cause_is_kept() {
        let e = Error::fabric(Peer::Data(2))(disconnected());
        let source = e.source().expect("a source");
        let fabric = source
            .downcast_ref::<FabricError>()
            .expect("the fabric error itself");
        assert!(matches!(fabric, FabricError::Disconnected(_)));
        let chain = Chain(&e).to_string();
        assert_eq!(
            chain,
            "fabric to data server 2: connection to server lost: peer closed the connection"
        );
    }

    /// A new connection refused for a server's limit on connections is redone, never taken
    /// for a fence (which would end the session); a refusal of the session is a fence.
    #[test]
    fn a_limit_refusal_is_transient_and_no_fence() {
        let limited = || FabricError::Limited("too many connections waiting".into());
        for e in [
            Error::fabric(Peer::Meta)(limited()),
            Error::lock(7)(LockError::Fabric(limited())),
        ] {
            assert!(e.is_transient() && !e.is_fenced(), "{e}");
        }
        let revoked = Error::fabric(Peer::Meta)(FabricError::Refused("revoked".into()));
        assert!(revoked.is_fenced() && !revoked.is_transient());
    }

    #[test]
    fn the_chain_goes_through_the_lock_manager() {
        // A fence whose RPC failed: client error → lock error → hook → client error → fabric.
        let hook = LockError::Hook {
            what: "fence before a lease recovery",
            source: Box::new(Error::fabric(Peer::Meta)(disconnected())),
        };
        let e = Error::lock(9)(hook);
        let mut depth = 0;
        let mut found = false;
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(cause) = next {
            found |= cause.downcast_ref::<FabricError>().is_some();
            depth += 1;
            next = cause.source();
        }
        assert!(found, "the fabric error is in the source chain");
        assert_eq!(depth, 4);
        let chain = Chain(&e).to_string();
        assert_eq!(
            chain.matches("peer closed the connection").count(),
            1,
            "{chain}"
        );
        assert!(chain.starts_with("range lock of inode 9: fence before a lease recovery"));
    }

    #[test]
    fn the_chain_writes_causes_a_display_left_out() {
        let io = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "broken pipe");
        let e = Error::Heartbeat(std::io::Error::other(Terse(io)));
        let chain = Chain(&e).to_string();
        assert_eq!(
            chain,
            "cannot start the heartbeat thread: outer step failed: broken pipe"
        );
    }

    #[test]
    fn io_errors_keep_errno_and_cause() {
        let io = std::io::Error::from(Error::from(FsError::NotEmpty));
        assert_eq!(io.raw_os_error(), Some(libc::ENOTEMPTY));
        let io = std::io::Error::from(Error::fabric(Peer::Meta)(disconnected()));
        assert_eq!(io.kind(), proto::kind_from_errno(libc::EIO));
        assert!(
            io.to_string().contains("peer closed the connection"),
            "{io}"
        );
        let inner = io.get_ref().and_then(|e| e.downcast_ref::<Error>());
        assert_eq!(inner.map(Error::errno), Some(libc::EIO));
    }
}
