//! CitronFS's one in-process cluster harness, used by `citronfs up`, `citronfs bench fs` and
//! every test suite that needs servers.
//!
//! - [`Cluster`]: a meta server and N data servers in this process, as a [`ClusterSpec`] says
//!   (shm or tcp fabric, memory- or file-backed data, a temporary or a given state directory,
//!   chunk counts and sizes, leases); [`Cluster::connect`] opens a `CitronFs` client session,
//!   [`Cluster::restart`] stops and starts every server on the same state, and
//!   [`Cluster::shutdown`] (or drop) stops them cleanly.
//! - [`Mount`]: an in-process FUSE mount of a client, in a fresh directory or a given one,
//!   unmounted on drop — lazily, with its FUSE connection aborted, when it is busy, as after a
//!   panicking test — so that nothing is left mounted.
//! - Test-only extras: [`Cluster::spawn_mount_process`] ([`ChildMount`], a second client
//!   *process*: the test binary re-executed, running [`child_mount_main`]),
//!   [`fuse_unavailable`] and [`skip_without_fuse!`], [`wait_until`], [`pattern`], [`UserBuf`];
//!   [`skip`], which every test that cannot run here calls, so that the skip is seen and
//!   counted (`.ci/run` fails a run that skipped what the machine could have run).
//! - [`netns`]: several hosts on one machine (network namespaces on a private switch, links
//!   that can be cut and healed), processes run on them, for tests of real network faults;
//!   [`skip_without_netns!`] skips where namespaces cannot be made.
//!
//! Every server setting is made here once: a change to a server's configuration is a change to
//! [`ClusterSpec`] and [`Cluster`], not to each suite.
//!
//! Errors of starting, connecting, mounting and restarting are returned (`anyhow`), since
//! `citronfs up` reports them to a user; the test-only extras panic, since only tests call them.

mod child;
mod cluster;
mod mount;
pub mod netns;
mod orphans;
mod skip;
mod util;

pub use child::{child_mount_main, ChildMount, Stopped};
pub use cluster::{
    run_dir_parent, sweep_stale_run_dirs, BackingKind, Cluster, ClusterSpec, TEST_CHUNK_SIZE,
};
/// The fabric backend a cluster runs on (the fabric crate's own choice type).
pub use fabric::Backend;
pub use mount::{fuse_options, fuse_unavailable, Mount};
pub use orphans::die_with_parent;
pub use skip::{skip, Need, ENV_SKIP_LOG};
pub use util::{
    init_logging, open_rw, pattern, random_token, restartable_addr, wait_until, UserBuf,
};
