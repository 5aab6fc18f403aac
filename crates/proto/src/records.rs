//! POSIX record locks (`fcntl`'s `F_GETLK`, `F_SETLK`, `F_SETLKW`, and `lockf`), kept for the
//! whole cluster by the meta server: what a client asks for and what it is told.
//!
//! These are advisory locks between programs, unrelated to the range locks every read and write
//! takes (those are CITRON's, in `lockmgr`). Byte ranges are inclusive at both ends, as the
//! kernel hands them to FUSE (`u64::MAX` and `i64::MAX` both reach the end of any file).

use serde::{Deserialize, Serialize};

/// A record lock's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RecordKind {
    /// Shared (`F_RDLCK`): any number of owners may hold overlapping read locks.
    Read,
    /// Exclusive (`F_WRLCK`): no other owner may hold an overlapping lock of either kind.
    Write,
}

impl RecordKind {
    /// Whether a lock of this kind and one of `other`, held by two owners over overlapping
    /// bytes, conflict: unless both are read locks.
    pub fn conflicts_with(self, other: RecordKind) -> bool {
        self == RecordKind::Write || other == RecordKind::Write
    }

    /// The kind of an `fcntl` lock type (`F_RDLCK`, `F_WRLCK`); `None` for `F_UNLCK`, an
    /// error for anything else.
    pub fn from_fcntl(typ: i32) -> Result<Option<RecordKind>, crate::FsError> {
        match typ {
            libc::F_RDLCK => Ok(Some(RecordKind::Read)),
            libc::F_WRLCK => Ok(Some(RecordKind::Write)),
            libc::F_UNLCK => Ok(None),
            other => Err(crate::FsError::Invalid(format!("record lock type {other}"))),
        }
    }

    /// The `fcntl` lock type of this kind.
    pub fn fcntl(self) -> i32 {
        match self {
            RecordKind::Read => libc::F_RDLCK,
            RecordKind::Write => libc::F_WRLCK,
        }
    }
}

/// A record lock as `F_GETLK` reports it: the first lock found in the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordLock {
    /// First byte.
    pub start: u64,
    /// Last byte (inclusive).
    pub end: u64,
    /// Its kind.
    pub kind: RecordKind,
    /// The holder's process id when it holds the lock through the asking client's own session;
    /// 0 for a holder on another client, whose pid means nothing on this host (and which the
    /// kernel would refuse: it looks the pid up in the mount's pid namespace).
    pub pid: u32,
}

/// What an owner asks of a byte range (`F_SETLK`): a lock of a kind, or none (an unlock).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordClaim {
    /// The lock owner: the kernel's, unique within its client session.
    pub owner: u64,
    /// First byte.
    pub start: u64,
    /// Last byte (inclusive).
    pub end: u64,
    /// The lock to hold over the range, or `None` to hold nothing there.
    pub kind: Option<RecordKind>,
    /// The owner's process, for `F_GETLK` through the same session.
    pub pid: u32,
}

impl RecordClaim {
    /// `owner`'s unlock of every byte.
    pub fn unlock_all(owner: u64) -> Self {
        RecordClaim {
            owner,
            start: 0,
            end: u64::MAX,
            kind: None,
            pid: 0,
        }
    }
}
