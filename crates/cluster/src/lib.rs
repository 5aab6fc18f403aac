//! An embedded CitronFS cluster: a meta server and data servers in one process, what
//! `citronfs up` runs and the benchmarks start.
//!
//! - [`Cluster`]: a meta server and N data servers in this process, as a [`ClusterSpec`] says
//!   (shm or tcp fabric, memory- or file-backed data, a temporary or a given state directory,
//!   chunk counts and sizes, leases); [`Cluster::connect`] opens a `CitronFs` client session,
//!   [`Cluster::restart`] stops and starts every server on the same state, and
//!   [`Cluster::shutdown`] (or drop) stops them cleanly. The state directory's layout is the
//!   same for every run, so that a `--state-dir` written by one is read by the next.
//! - [`Mount`]: an in-process FUSE mount of a client, in a fresh directory or a given one,
//!   unmounted on drop — lazily, with its FUSE connection aborted, when it is busy — so that
//!   nothing is left mounted.
//! - Helpers of what runs around a cluster: [`die_with_parent`] (child processes that do not
//!   outlive their starter), [`random_token`], [`restartable_addr`], and [`pattern`] (the data
//!   the benchmarks and tests write and verify).
//!
//! Every server setting of an embedded cluster is made here once: a change to a server's
//! configuration is a change to [`ClusterSpec`] and [`Cluster`]. Errors of starting,
//! connecting, mounting and restarting are returned (`anyhow`), since `citronfs up` reports
//! them to a user. The test suites' helpers (client processes, fault injection, skips) live in
//! the `testkit` crate, on top of this one.

mod cluster;
mod mount;
mod orphans;
mod util;

pub use cluster::{
    run_dir_parent, sweep_stale_run_dirs, BackingKind, Cluster, ClusterSpec, TEST_CHUNK_SIZE,
};
/// The fabric backend a cluster runs on (the fabric crate's own choice type).
pub use fabric::Backend;
pub use mount::{fuse_options, is_mounted, lazy_unmount, Mount};
pub use orphans::die_with_parent;
pub use util::{pattern, random_token, restartable_addr};
