//! File-system errors, each with the errno a POSIX caller sees.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A file-system operation's failure. Travels over the wire as it is; [`FsError::errno`] maps it
/// for FUSE and for `std::io::Error`.
#[derive(Clone, Debug, PartialEq, Eq, Error, Serialize, Deserialize)]
pub enum FsError {
    /// No such file or directory.
    #[error("no such file or directory")]
    NotFound,
    /// The name exists already.
    #[error("file exists")]
    Exists,
    /// The directory is not empty.
    #[error("directory not empty")]
    NotEmpty,
    /// A path component is not a directory.
    #[error("not a directory")]
    NotDir,
    /// The object is a directory.
    #[error("is a directory")]
    IsDir,
    /// A name is longer than `NAME_MAX` (or a symlink target, xattr name or value too long).
    #[error("name too long")]
    NameTooLong,
    /// The data servers (or the meta server's region) are full.
    #[error("no space left on device")]
    NoSpace,
    /// Permission denied by mode bits.
    #[error("permission denied")]
    Access,
    /// Operation not permitted (ownership).
    #[error("operation not permitted")]
    Perm,
    /// An argument is invalid (renaming a directory into itself, a bad offset, ...).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// No such extended attribute.
    #[error("no such attribute")]
    NoAttr,
    /// A buffer is too small for the result (xattr value or list).
    #[error("result too large for the buffer")]
    Range,
    /// The file handle or session is no longer valid.
    #[error("stale file handle")]
    Stale,
    /// Not supported by CitronFS.
    #[error("operation not supported")]
    NotSupported,
    /// A server is unreachable or broke the protocol; the operation's outcome is unknown.
    #[error("I/O error: {0}")]
    Io(String),
    /// The cluster refused this client (wrong cluster id or token, or protocol version).
    #[error("refused by the cluster: {0}")]
    Refused(String),
    /// A server the call needs is not connected now (no data server registered to allocate
    /// chunks on, e.g. just after a meta server restart): the call did nothing and may succeed
    /// later. Clients wait a bounded time and retry before reporting EIO.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The data asked for is gone: it lived on a data server whose memory was lost (a
    /// memory-only server that restarted empty). Reads and writes of it fail with EIO rather
    /// than return zeros; `citronfs fsck` lists the files.
    #[error("data lost: {0}")]
    Lost(String),
    /// The object is in use by the system in a way that forbids the call (`rename` from or
    /// onto `.` or `..`, as Linux answers).
    #[error("device or resource busy")]
    Busy,
    /// The session has as many files open as the meta server allows (EMFILE).
    #[error("too many open files in this session (limit max_open_per_session = {limit})")]
    TooManyOpen {
        /// The meta server's limit.
        limit: u64,
    },
    /// The meta server has as many client sessions as it allows.
    #[error("too many client sessions (limit max_sessions = {limit}); try again later")]
    TooManySessions {
        /// The meta server's limit.
        limit: u64,
    },
    /// The file is open on another client under another range-lock scheme (EBUSY). Locks of
    /// two schemes do not exclude each other, so a file's readers and writers must all use
    /// one scheme while it is open.
    #[error(
        "the file is open on another client with lock scheme {open_with}, and this client's \
         is {asked}: all clients of a file must use one scheme (citronfs mount --scheme)"
    )]
    SchemeInUse {
        /// The scheme the file is open with.
        open_with: String,
        /// The scheme this open asked for.
        asked: String,
    },
    /// A change made under a range lock (`RequestFrame::expires`) reached the point of being
    /// applied after the lock's lease had run out, or too close to it: it was not applied, since
    /// another client may hold the range by now. The caller redoes it under a new lock (EIO if
    /// it keeps happening).
    #[error(
        "the range lock's lease ran out before the meta server could apply the change; \
         not applied"
    )]
    Expired,
    /// A record lock (`fcntl`) conflicts with one another owner holds (EAGAIN).
    #[error("a conflicting record lock is held")]
    WouldBlock,
    /// A new record lock asked during the meta server's grace period after a restart, when
    /// only the locks held before are granted (`Request::SetLk::reclaim`); asked again a
    /// little later, it is answered (EAGAIN if it ever reaches a caller).
    #[error("record locks are being taken back after a meta server restart; ask again")]
    InGrace,
    /// Waiting for this record lock would deadlock: an owner holding a lock in its way waits,
    /// directly or through others, for one the asking owner holds (EDEADLK).
    #[error("waiting for this record lock would deadlock")]
    Deadlock,
    /// The client session holds as many record locks as the meta server allows (ENOLCK).
    #[error("too many record locks held by this client (limit {limit})")]
    NoLocks {
        /// The meta server's limit.
        limit: u64,
    },
}

impl FsError {
    /// The errno a POSIX caller sees for this error.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::Exists => libc::EEXIST,
            FsError::NotEmpty => libc::ENOTEMPTY,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::NoSpace => libc::ENOSPC,
            FsError::Access => libc::EACCES,
            FsError::Perm => libc::EPERM,
            FsError::Invalid(_) => libc::EINVAL,
            FsError::NoAttr => libc::ENODATA,
            FsError::Range => libc::ERANGE,
            FsError::Stale => libc::ESTALE,
            FsError::NotSupported => libc::EOPNOTSUPP,
            FsError::Io(_)
            | FsError::Refused(_)
            | FsError::Lost(_)
            | FsError::Unavailable(_)
            | FsError::Expired => libc::EIO,
            FsError::Busy | FsError::SchemeInUse { .. } => libc::EBUSY,
            FsError::WouldBlock | FsError::InGrace => libc::EAGAIN,
            FsError::NoLocks { .. } => libc::ENOLCK,
            FsError::Deadlock => libc::EDEADLK,
            FsError::TooManyOpen { .. } => libc::EMFILE,
            FsError::TooManySessions { .. } => libc::EUSERS,
        }
    }
}

/// The `std::io::ErrorKind` of an errno, as std decodes a raw OS error.
pub fn kind_from_errno(errno: i32) -> std::io::ErrorKind {
    std::io::Error::from_raw_os_error(errno).kind()
}

/// Keeps all there is to know: an error that says no more than its errno becomes that raw OS
/// error (exact for `raw_os_error()`, and its text is the errno's); one that carries a message
/// becomes an error of the errno's kind that carries this `FsError`, message and all.
impl From<FsError> for std::io::Error {
    fn from(e: FsError) -> Self {
        match e {
            FsError::Invalid(_)
            | FsError::Io(_)
            | FsError::Refused(_)
            | FsError::Lost(_)
            | FsError::Unavailable(_)
            | FsError::TooManyOpen { .. }
            | FsError::TooManySessions { .. }
            | FsError::SchemeInUse { .. }
            | FsError::Expired
            | FsError::NoLocks { .. } => std::io::Error::new(kind_from_errno(e.errno()), e),
            FsError::NotFound
            | FsError::Exists
            | FsError::NotEmpty
            | FsError::NotDir
            | FsError::IsDir
            | FsError::NameTooLong
            | FsError::NoSpace
            | FsError::Access
            | FsError::Perm
            | FsError::NoAttr
            | FsError::Range
            | FsError::Stale
            | FsError::NotSupported
            | FsError::Busy
            | FsError::WouldBlock
            | FsError::InGrace
            | FsError::Deadlock => std::io::Error::from_raw_os_error(e.errno()),
        }
    }
}

impl From<fabric::FabricError> for FsError {
    fn from(e: fabric::FabricError) -> Self {
        FsError::Io(e.to_string())
    }
}

/// The name of errno `e` (`ENOENT`), or its number for one not listed.
pub fn errno_name(e: i32) -> String {
    let name = match e {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::EXDEV => "EXDEV",
        libc::ENODEV => "ENODEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::EMFILE => "EMFILE",
        libc::ENFILE => "ENFILE",
        libc::ENOTTY => "ENOTTY",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::ERANGE => "ERANGE",
        libc::EDEADLK => "EDEADLK",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::ENOLCK => "ENOLCK",
        libc::ENOSYS => "ENOSYS",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ENODATA => "ENODATA",
        libc::EPROTO => "EPROTO",
        libc::EOVERFLOW => "EOVERFLOW",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ENOTCONN => "ENOTCONN",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::ESTALE => "ESTALE",
        libc::EDQUOT => "EDQUOT",
        _ => return e.to_string(),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_keep_the_message() {
        let io = std::io::Error::from(FsError::Io("meta database corrupt: inode 7".into()));
        assert_eq!(io.kind(), kind_from_errno(libc::EIO));
        assert!(
            io.to_string().contains("meta database corrupt: inode 7"),
            "{io}"
        );
        let inner = io.get_ref().and_then(|e| e.downcast_ref::<FsError>());
        assert!(matches!(inner, Some(FsError::Io(_))));
        let io = std::io::Error::from(FsError::Invalid("bad offset".into()));
        assert_eq!(io.kind(), std::io::ErrorKind::InvalidInput);
        assert!(io.to_string().contains("bad offset"), "{io}");
        // Nothing to keep but the errno: the raw OS error, exact.
        let io = std::io::Error::from(FsError::Stale);
        assert_eq!(io.raw_os_error(), Some(libc::ESTALE));
    }
}
