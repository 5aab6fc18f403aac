//! CitronFS's test helpers, on top of the embedded cluster of the `cluster` crate (re-exported
//! here, so that a suite names one crate).
//!
//! - [`Cluster`], [`ClusterSpec`], [`Mount`] and the rest of the `cluster` crate, as they are;
//!   [`ClusterSpec::default`] is test-sized.
//! - [`ClusterExt`]: what only tests do to a cluster — [`ClusterExt::spawn_mount_process`]
//!   ([`ChildMount`], a second client *process*: the test binary re-executed, running
//!   [`child_mount_main`]), [`ClusterExt::wait_for_live_data_servers`], and with the
//!   `test-hooks` feature `crash_meta_and_restart` (the meta server's crash hook).
//! - [`fuse_unavailable`] and [`skip_without_fuse!`], [`wait_until`], [`open_rw`],
//!   [`UserBuf`], [`init_logging`]; [`skip`], which every test that cannot run here calls, so
//!   that the skip is seen and counted (`.ci/run` fails a run that skipped what the machine
//!   could have run).
//! - [`netns`]: several hosts on one machine (network namespaces on a private switch, links
//!   that can be cut and healed), processes run on them, for tests of real network faults;
//!   [`skip_without_netns!`] skips where namespaces cannot be made.
//!
//! These helpers panic on failure, since only tests call them.

mod child;
mod ext;
pub mod layering;
pub mod netns;
mod skip;
mod util;

pub use child::{child_mount_main, ChildMount, Stopped};
pub use cluster::{
    die_with_parent, fuse_options, pattern, random_token, restartable_addr, run_dir_parent,
    sweep_stale_run_dirs, Backend, BackingKind, Cluster, ClusterSpec, Mount, TEST_CHUNK_SIZE,
};
pub use ext::ClusterExt;
pub use skip::{skip, Need, ENV_SKIP_LOG};
pub use util::{init_logging, open_rw, record_tags, tagged_record, wait_until, UserBuf, TAG_BLOCK};

/// Why FUSE mounts cannot work here, or `None` when they can: /dev/fuse must exist and open,
/// and a non-root user needs `fusermount3` (Debian package fuse3).
pub fn fuse_unavailable() -> Option<String> {
    fs_client::fuse::check_mountable(std::path::Path::new(fs_client::fuse::FUSE_DEVICE)).err()
}

/// Returns from the calling test when FUSE mounts cannot work here, the skip recorded
/// ([`crate::skip`]: said on stderr, counted by `.ci/run`).
#[macro_export]
macro_rules! skip_without_fuse {
    () => {
        if let Some(why) = $crate::fuse_unavailable() {
            $crate::skip($crate::Need::Fuse, &why);
            return;
        }
    };
}
