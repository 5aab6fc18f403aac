//! How the client opens range locks on a file.
//!
//! Ranges are in lock units of the file (`[0, FILE_UNITS)`; a whole-file lock is wider, see
//! [`whole_file`]). The meta server creates each open file's lock and sends it in the open
//! reply ([`proto::OpenFile::lock`]: the scheme with every parameter it chose, and the base
//! address); `open_file_lock` opens exactly that through [`lockmgr::schemes::open`]. What the
//! file system adds per scheme:
//!
//! - `citron`: scale-ups allocate tree words with the `AllocateLockWords` RPC
//!   (`RpcTreeAllocator`), and a lease recovery fences first (`MetaFence`).
//! - `mutex`, `seg`: nothing.
//! - `server`: the CPU lock server at [`proto::ClusterInfo::lock_server`] locks one global space
//!   for every file: file `ino`'s unit `u` is `ino << 40 | u` ([`server_range`]), so files never
//!   conflict with each other and inode numbers must stay below `2^24`; one connection per
//!   worker serves every file (`open_server_lock`).

use crate::error::Error;
use crate::meta::{unexpected, Meta};
use crate::plan::FILE_UNITS;
use fabric::RemoteAddr;
use lockmgr::baselines::LockServerAt;
use lockmgr::citron::{ClientOptions, TreeAllocator};
use lockmgr::schemes::{self, OpenOptions, NO_STATE};
use lockmgr::{LockError, LockRef, LockScheme, RangeLock};
use proto::rpc::{Request, Response};
use proto::{FsError, Ino};
use std::ops::Range;
use std::sync::Arc;

/// The unit range that excludes every other reader and writer of the file (truncate, append).
///
/// For the fabric schemes it reaches to `u64::MAX`: CITRON then takes its spillover mutex as
/// well as the tree, and a range ending beyond its largest tree is never ORed into the
/// maximizer, so a whole-file lock does not make the tree grow.
pub fn whole_file(scheme: LockScheme) -> Range<u64> {
    match scheme {
        LockScheme::Server => 0..FILE_UNITS,
        _ => 0..u64::MAX,
    }
}

/// The `server` scheme's global range for units `range` of file `ino`.
pub fn server_range(ino: Ino, range: Range<u64>) -> Result<Range<u64>, FsError> {
    if ino >= 1 << 24 {
        return Err(FsError::Invalid(format!(
            "inode {ino} is beyond the server lock scheme's 2^24 files"
        )));
    }
    let base = ino << 40;
    let end = range.end.min(FILE_UNITS);
    Ok(base + range.start.min(end)..base + end)
}

/// Scale-up memory for one file's CITRON tree, from the meta server.
pub(crate) struct RpcTreeAllocator {
    pub(crate) meta: Arc<Meta>,
    pub(crate) ino: Ino,
}

impl TreeAllocator for RpcTreeAllocator {
    fn allocate(&self, words: u64) -> Result<RemoteAddr, LockError> {
        match self.meta.call(Request::AllocateLockWords {
            ino: self.ino,
            words,
        }) {
            Ok(Response::Addr(addr)) => Ok(addr),
            Ok(other) => Err(unexpected("AllocateLockWords", other)),
            Err(e) => Err(e),
        }
        .map_err(|e| LockError::Hook {
            what: "lock tree allocation",
            source: Box::new(e),
        })
    }

    /// The meta server hosts file locks on tcp and allocates their words itself, by inode.
    fn host_tag(&self) -> Option<u64> {
        Some(self.ino)
    }
}

/// The file system's fence (docs/ARCHITECTURE.md "Fencing"): before this client breaks a lock whose
/// holder it presumes dead, the meta server revokes every silent session on the meta and data
/// fabric servers (`Request::Fence`), so that a holder that was only stopped cannot land a
/// write after the break.
pub(crate) struct MetaFence {
    pub(crate) meta: Arc<Meta>,
}

impl lockmgr::Fence for MetaFence {
    fn fence(&self) -> Result<(), LockError> {
        match self.meta.call(Request::Fence) {
            Ok(Response::Ok) => Ok(()),
            Ok(other) => Err(unexpected("Fence", other)),
            Err(e) => Err(e),
        }
        .map_err(|e| LockError::Hook {
            what: "fence before a lease recovery",
            source: Box::new(e),
        })
    }

    fn holder_gone(&self, owner: u64, stopped: bool) -> Result<bool, LockError> {
        match self.meta.call(Request::HolderGone { owner, stopped }) {
            Ok(Response::Gone(gone)) => Ok(gone),
            Ok(other) => Err(unexpected("HolderGone", other)),
            Err(e) => Err(e),
        }
        .map_err(|e| LockError::Hook {
            what: "asking whether a lock holder is gone",
            source: Box::new(e),
        })
    }
}

/// Opens this thread's handle on the lock of an open file (the fabric schemes), as the meta
/// server created it.
pub(crate) fn open_file_lock(
    lock: &LockRef,
    connector: &dyn fabric::Connector,
    meta: &Arc<Meta>,
    ino: Ino,
    hosting: lockmgr::citron::Hosting,
    session: u64,
) -> Result<Box<dyn RangeLock>, Error> {
    let options = OpenOptions {
        citron: ClientOptions {
            fence: Some(Arc::new(MetaFence { meta: meta.clone() })),
            hosting,
            // Waiters ask the meta server about this client's holds by its session, the one
            // its fabric endpoints present (and a fence revokes).
            owner: Some(session),
            ..ClientOptions::default()
        },
        allocator: Some(Arc::new(RpcTreeAllocator {
            meta: meta.clone(),
            ino,
        })),
        ..OpenOptions::default()
    };
    schemes::open(lock, connector, &options).map_err(Error::lock(ino))
}

/// Opens this thread's connection to the cluster's lock server (the `server` scheme: one for
/// every file, see [`server_range`]).
pub(crate) fn open_server_lock(
    connector: &dyn fabric::Connector,
    at: &LockServerAt,
) -> Result<Box<dyn RangeLock>, LockError> {
    let lock = LockRef {
        scheme: LockScheme::SERVER,
        base: NO_STATE,
    };
    let options = OpenOptions {
        server: Some(at.clone()),
        ..OpenOptions::default()
    };
    schemes::open(&lock, connector, &options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_ranges_keep_files_apart() {
        let a = server_range(1, 0..FILE_UNITS).unwrap();
        let b = server_range(2, 0..1).unwrap();
        assert_eq!(a, 1 << 40..2 << 40);
        assert_eq!(b, 2 << 40..(2 << 40) + 1);
        assert_eq!(
            server_range(3, whole_file(LockScheme::SERVER)).unwrap().end,
            4 << 40
        );
        // A fabric scheme's whole-file range is clipped to the file's slice.
        assert_eq!(
            server_range(3, 5..u64::MAX).unwrap(),
            (3 << 40) + 5..4 << 40
        );
        assert!(server_range(1 << 24, 0..1).is_err());
    }
}
