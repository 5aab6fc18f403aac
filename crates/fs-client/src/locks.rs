//! How the client opens range locks of each scheme on a file.
//!
//! Ranges are in lock units of the file (`[0, FILE_UNITS)`; a whole-file lock is wider, see
//! [`whole_file`]). Per scheme:
//!
//! - `citron`: one CITRON lock per open file at [`proto::OpenFile::lock`] (its config record);
//!   scale-ups allocate tree words with the `AllocateLockWords` RPC ([`RpcTreeAllocator`]).
//! - `mutex`: one ticket lock word per open file at `lock`.
//! - `seg`: static segmentation at `lock`, cut as [`seg_config`] says (the numbers are in
//!   `proto`, shared with the meta server that creates it).
//! - `server`: the CPU lock server at [`proto::ClusterInfo::lock_server`] locks one global space
//!   for every file: file `ino`'s unit `u` is `ino << 40 | u` ([`server_range`]), so files never
//!   conflict with each other and inode numbers must stay below `2^24`.

use crate::error::Error;
use crate::meta::{unexpected, Meta};
use crate::plan::FILE_UNITS;
use fabric::RemoteAddr;
use lockmgr::baselines::{MutexScheme, SegConfig, SegScheme, TicketConfig};
use lockmgr::citron::{CitronClient, ClientOptions, TreeAllocator};
use lockmgr::{LockError, RangeLock};
use proto::rpc::{Request, Response};
use proto::{FsError, Ino, LockSchemeKind};
use std::ops::Range;
use std::sync::Arc;

/// The `seg` scheme's cut: `proto::SEG_SEGMENT_UNITS` units per segment over
/// `proto::SEG_SEGMENTS` lock words, as the meta server creates it.
pub fn seg_config() -> SegConfig {
    SegConfig {
        segment_units: proto::SEG_SEGMENT_UNITS,
        segments: proto::SEG_SEGMENTS,
        ticket: TicketConfig::default(),
    }
}

/// The unit range that excludes every other reader and writer of the file (truncate, append).
///
/// For the fabric schemes it reaches to `u64::MAX`: CITRON then takes its spillover mutex as
/// well as the tree, and a range ending beyond its largest tree is never ORed into the
/// maximizer, so a whole-file lock does not make the tree grow.
pub fn whole_file(scheme: LockSchemeKind) -> Range<u64> {
    match scheme {
        LockSchemeKind::Server => 0..FILE_UNITS,
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
}

/// The file system's fence (DESIGN.md "Fencing"): before this client breaks a lock whose
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
}

/// Opens this thread's handle on the lock of an open file (the fabric schemes).
pub(crate) fn open_file_lock(
    scheme: LockSchemeKind,
    connector: &dyn fabric::Connector,
    meta: &Arc<Meta>,
    ino: Ino,
    lock: RemoteAddr,
) -> Result<Box<dyn RangeLock>, Error> {
    let lock_err = Error::lock(ino);
    Ok(match scheme {
        LockSchemeKind::Citron => Box::new(
            CitronClient::open(
                connector.connect().map_err(|e| lock_err(e.into()))?,
                lock,
                Arc::new(RpcTreeAllocator {
                    meta: meta.clone(),
                    ino,
                }),
                ClientOptions {
                    fence: Some(Arc::new(MetaFence { meta: meta.clone() })),
                    ..ClientOptions::default()
                },
            )
            .map_err(lock_err)?,
        ),
        LockSchemeKind::Mutex => Box::new(
            MutexScheme::attach(lock, TicketConfig::default())
                .open(connector)
                .map_err(lock_err)?,
        ),
        LockSchemeKind::Seg => Box::new(
            SegScheme::attach(lock, seg_config())
                .map_err(lock_err)?
                .open(connector)
                .map_err(lock_err)?,
        ),
        LockSchemeKind::Server => {
            return Err(lock_err(LockError::Config(
                "the server scheme has no per-file lock (bug)".into(),
            )))
        }
    })
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
            server_range(3, whole_file(LockSchemeKind::Server))
                .unwrap()
                .end,
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
