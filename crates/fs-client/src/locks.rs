//! How the client opens range locks on a file.
//!
//! Ranges are in lock units of the file (`[0, FILE_UNITS)`; a whole-file lock is wider, see
//! [`WHOLE_FILE`]). Where a scheme keeps them is the scheme's to say
//! ([`lockmgr::schemes::Placement`]), and this module asks it:
//!
//! - a lock per file: the meta server creates each open file's lock and sends it in the open
//!   reply ([`proto::OpenFile::lock`]: the scheme with every parameter it chose, and the base
//!   address); `open_file_lock` opens exactly that through [`lockmgr::schemes::open`], with
//!   what the file system adds — memory to grow into from the `AllocateLockWords` RPC
//!   (`RpcLockWords`), a fence before a lease recovery (`MetaFence`), this client's session as
//!   the holder's identity, and where to acquire ([`lockmgr::schemes::Hosting`]); a scheme
//!   takes what it uses of them;
//! - a shared lock service (at [`proto::ClusterInfo::lock_server`]): one connection per
//!   worker serves every file (`open_service_lock`), and file `ino`'s units are locked in its
//!   own slice of the service's space ([`file_range`]), so files never conflict with each
//!   other.

use crate::error::Error;
use crate::meta::{unexpected, Meta};
use fabric::RemoteAddr;
use lockmgr::schemes::{self, Hosting, LockServerAt, LockWordAllocator, OpenOptions};
use lockmgr::{LockError, LockRef, LockScheme, RangeLock};
use proto::rpc::{Request, Response};
use proto::{FsError, Ino};
use std::ops::Range;
use std::sync::Arc;

/// The unit range that excludes every other reader and writer of the file (truncate, append).
///
/// It reaches to `u64::MAX`: CITRON then takes its spillover mutex as well as the tree, and a
/// range ending beyond its largest tree is never ORed into the maximizer, so a whole-file lock
/// does not make the tree grow; a lock service cuts it at the end of the file's slice.
pub const WHOLE_FILE: Range<u64> = 0..u64::MAX;

/// Where `scheme` locks units `range` of file `ino` ([`LockScheme::object_range`]).
pub fn file_range(scheme: &LockScheme, ino: Ino, range: Range<u64>) -> Result<Range<u64>, FsError> {
    scheme
        .object_range(ino, range)
        .map_err(|e| FsError::Invalid(format!("inode {ino}: {e}")))
}

/// Memory one file's lock grows into (CITRON's scale-ups), from the meta server.
pub(crate) struct RpcLockWords {
    pub(crate) meta: Arc<Meta>,
    pub(crate) ino: Ino,
}

impl LockWordAllocator for RpcLockWords {
    fn allocate(&self, words: u64) -> Result<RemoteAddr, LockError> {
        let request = Request::AllocateLockWords {
            ino: self.ino,
            words,
        };
        lock_hook(&self.meta, request, "lock tree allocation", |r| match r {
            Response::Addr(addr) => Ok(addr),
            other => Err(unexpected("AllocateLockWords", other)),
        })
    }

    /// The meta server hosts file locks where its fabric runs procedures, and allocates their
    /// words itself, by inode.
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
        let what = "fence before a lease recovery";
        lock_hook(&self.meta, Request::Fence, what, |r| match r {
            Response::Ok => Ok(()),
            other => Err(unexpected("Fence", other)),
        })
    }

    fn holder_gone(&self, owner: u64, stopped: bool) -> Result<bool, LockError> {
        let request = Request::HolderGone { owner, stopped };
        let what = "asking whether a lock holder is gone";
        lock_hook(&self.meta, request, what, |r| match r {
            Response::Gone(gone) => Ok(gone),
            other => Err(unexpected("HolderGone", other)),
        })
    }
}

/// A lock manager hook's RPC (`what`, for the error): `request`, its answer taken by `answer`,
/// any failure as the hook's [`LockError::Hook`].
fn lock_hook<T>(
    meta: &Meta,
    request: Request,
    what: &'static str,
    answer: impl FnOnce(Response) -> Result<T, Error>,
) -> Result<T, LockError> {
    meta.call(request)
        .and_then(answer)
        .map_err(|e| LockError::Hook {
            what,
            source: Box::new(e),
        })
}

/// Opens this thread's handle on the lock of an open file (a scheme with a lock per file), as
/// the meta server created it.
pub(crate) fn open_file_lock(
    lock: &LockRef,
    connector: &dyn fabric::Connector,
    meta: &Arc<Meta>,
    ino: Ino,
    hosting: Hosting,
    session: u64,
) -> Result<Box<dyn RangeLock>, Error> {
    let options = OpenOptions {
        fence: Some(Arc::new(MetaFence { meta: meta.clone() })),
        hosting: Some(hosting),
        // Waiters ask the meta server about this client's holds by its session, the one
        // its fabric endpoints present (and a fence revokes).
        owner: Some(session),
        allocator: Some(Arc::new(RpcLockWords {
            meta: meta.clone(),
            ino,
        })),
        ..OpenOptions::default()
    };
    schemes::open(lock, connector, &options).map_err(Error::lock(ino))
}

/// Opens this thread's handle on the cluster's lock service (a scheme that keeps every file's
/// lock there: one handle for every file, see [`file_range`]).
pub(crate) fn open_service_lock(
    scheme: &LockScheme,
    connector: &dyn fabric::Connector,
    at: &LockServerAt,
) -> Result<Box<dyn RangeLock>, LockError> {
    let options = OpenOptions {
        server: Some(at.clone()),
        ..OpenOptions::default()
    };
    schemes::open_service(scheme, connector, &options)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::FILE_UNITS;

    #[test]
    fn service_ranges_keep_files_apart() {
        for scheme in ["citron", "mutex", "seg", "server"] {
            let scheme: LockScheme = scheme.parse().unwrap();
            let a = file_range(&scheme, 1, 0..FILE_UNITS).unwrap();
            let b = file_range(&scheme, 2, WHOLE_FILE).unwrap();
            if scheme.uses_service() {
                assert!(a.end <= b.start, "{scheme}: {a:?} {b:?}");
                assert!(file_range(&scheme, 1 << 24, 0..1).is_err());
            } else {
                assert_eq!((a, b), (0..FILE_UNITS, WHOLE_FILE), "{scheme}");
            }
        }
    }
}
