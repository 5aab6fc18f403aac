//! The CitronFS client.
//!
//! - [`CitronFs`]: the library — POSIX-like calls on inodes and file handles, usable without a
//!   mount. Reads and writes move data with one-sided verbs under a range lock of the mount's
//!   scheme (docs/ARCHITECTURE.md "fs-client"); [`client`] maps the facade's calls to the modules that
//!   implement them, and the module `io` reads the data path top-down.
//! - [`Error`] ([`error`]): why a call failed, with its typed cause kept, and [`Error::errno`],
//!   the one mapping to an errno.
//! - [`fuse`] (cargo feature `fuse`, on by default): the FUSE adapter, thin over the library,
//!   generic over [`backend::FsBackend`]: the library, or [`null::NullFs`], a backend that
//!   stores nothing, for measuring the FUSE path by itself (`citronfs bench fs --fs null`).
//! - [`plan`]: the byte-range arithmetic of the data path (lock units, chunks, verb batches).
//! - [`locks`]: how each lock scheme is opened on a file.
//! - [`metrics`]: Prometheus metrics of a mount (FUSE requests by operation, bytes, the
//!   library's I/O and range-lock counters), registered into a registry the caller owns.
//!
//! Inside the library, in layers (a module uses only those below it; no import cycle):
//! - the calls of [`CitronFs`], by concern: `namespace` (names, attributes, opens), `io` (the
//!   data path: read, write, fallocate, seek, fsync, truncate), `fcntl` (record locks);
//! - [`client`]: `CitronFs` itself and `Inner`, which holds the parts and joins them where a
//!   call needs several (a worker of the current view, redoing an I/O after a failure);
//! - the parts, each a struct with private state: `meta` (the meta-server connection), `view`
//!   (the cluster as this client sees it), `handles` (file handles and open inodes), `workers`
//!   (per-thread data-path state) with `lock_cache` (a worker's range-lock handles), [`records`]
//!   (record locks held), `io_stats` (the data path's counters);
//! - the steps of one I/O: `locked_io` (the range lock around it), `transfer` (its data verbs),
//!   `fcb` (the file control block's words), `chunks` (where a file's chunks live), `dentries`
//!   (one-sided lookups);
//! - below them: [`plan`], [`locks`], `servers` (fabric connectors), `options`, [`error`].
//!
//! A read, top-down: [`fuse`] → `backend` → `io` (`CitronFs::read_into`) → `client` (retry,
//! a worker, the open of the current session) → `locked_io` (acquire with the FCB words) →
//! `chunks` → `transfer` → [`plan`] → the fabric; then back up through `locked_io`'s release.
//!
//! No FUSE type appears outside [`fuse`].

/// A failpoint (`fail::fail_point!`) where a crash test stops a client: compiled to nothing
/// unless the cargo feature `failpoints` is on, and then inert until a test configures it
/// (`fail::cfg_callback`); the crash tests make the process SIGKILL itself there.
#[cfg(feature = "failpoints")]
macro_rules! failpoint {
    ($name:expr) => {
        fail::fail_point!($name)
    };
}
/// A failpoint (see the `failpoints` build): nothing in this build.
#[cfg(not(feature = "failpoints"))]
macro_rules! failpoint {
    ($name:expr) => {};
}

#[cfg(feature = "fuse")]
pub mod backend;
mod chunks;
pub mod client;
mod cut_repair;
mod dentries;
pub mod error;
mod fcb;
mod fcntl;
#[cfg(feature = "fuse")]
pub mod fuse;
mod handles;
mod io;
mod io_stats;
mod lock_cache;
mod locked_io;
pub mod locks;
mod meta;
pub mod metrics;
mod namespace;
#[cfg(feature = "fuse")]
pub mod null;
mod options;
pub mod plan;
pub mod records;
mod servers;
mod transfer;
mod view;
mod workers;

pub use client::CitronFs;
pub use error::Error;
pub use handles::FileHandle;
pub use io::{Fallocate, SeekTo};
pub use io_stats::IoStats;
pub use lockmgr::schemes::Hosting;
pub use lockmgr::{LockMode, LockScheme};
pub use options::MountOptions;
pub use proto::records::{RecordClaim, RecordKind, RecordLock};
pub use proto::rpc::XattrMode;
pub use proto::{
    Attr, Caller, DirEntry, FileKind, FsError, FsStats, Ino, SetAttr, SetTime, Timestamp, ROOT_INO,
};
