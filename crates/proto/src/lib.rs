//! The wire types every CitronFS process agrees on.
//!
//! - [`types`]: inodes, attributes, directory entries, how to reach a server's regions, an open
//!   file's lock (as [`lockmgr::LockRef`]: lock schemes are described by `lockmgr` alone);
//! - [`error`]: [`FsError`], the file-system errors, each with its errno;
//! - [`attrs`]: the attribute table clients read one-sidedly;
//! - [`dentries`]: the directory-entry table clients resolve names in one-sidedly;
//! - [`fcb`]: the layout of a file control block in the meta server's region;
//! - [`layout`]: where a file's bytes lie in its chunks (the geometric chunk sizes);
//! - [`fsck`]: what the consistency checker finds and repairs, and its report;
//! - [`records`]: POSIX record locks (`fcntl`) as clients ask for them;
//! - [`rpc`]: the meta server's requests and responses, and their framing
//!   (`fabric::frame` + postcard, a versioned handshake);
//! - [`status`]: a running cluster's state, as `citronfs status` shows it;
//! - [`stream`]: the stream an RPC connection runs over (tcp, or a Unix socket on the meta
//!   server's host).

pub mod attrs;
pub mod dentries;
pub mod error;
pub mod fcb;
pub mod fsck;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzz;
pub mod layout;
pub mod records;
mod request;
pub mod rpc;
pub mod status;
pub mod stream;
pub mod types;

pub use error::{kind_from_errno, FsError};
pub use types::*;
