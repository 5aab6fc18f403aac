//! The CitronFS client.
//!
//! - [`CitronFs`]: the library — POSIX-like calls on inodes and file handles, usable without a
//!   mount. Reads and writes move data with one-sided verbs under a range lock of the mount's
//!   scheme (DESIGN.md "Files"); see [`client`] for the data path and its threading.
//! - [`fuse`] (cargo feature `fuse`, on by default): the FUSE adapter, thin over the library.
//! - [`plan`]: the byte-range arithmetic of the data path (lock units, chunks, verb batches).
//! - [`locks`]: how each lock scheme is opened on a file.
//!
//! No FUSE type appears outside [`fuse`].

pub mod client;
#[cfg(feature = "fuse")]
pub mod fuse;
pub mod locks;
mod meta;
pub mod plan;

pub use client::{CitronFs, FileHandle, MountOptions};
pub use lockmgr::LockScheme;
pub use proto::rpc::XattrMode;
pub use proto::{
    Attr, Caller, DirEntry, FileKind, FsError, FsStats, Ino, SetAttr, SetTime, Timestamp, ROOT_INO,
};
