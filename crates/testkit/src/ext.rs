//! [`ClusterExt`]: what the test suites do to an embedded [`Cluster`] beyond what a user's
//! cluster does: client processes, waits that panic, crashes.

use crate::child::ChildMount;
use cluster::Cluster;
use fs_client::LockScheme;
use std::time::Duration;

/// Test-only operations on a [`Cluster`] (`use testkit::ClusterExt`).
pub trait ClusterExt {
    /// Starts a second client process that mounts this cluster with `scheme` and returns once
    /// the mount is up. The process is this test binary running the test `child_test`, which
    /// must call [`crate::child_mount_main`] (and does nothing when run normally). Panics if
    /// the child does not mount within 30 s.
    fn spawn_mount_process(&self, child_test: &str, scheme: LockScheme) -> ChildMount;

    /// Waits (up to 30 s, then panics, as [`crate::wait_until`]) until the meta server counts
    /// every data server of this cluster live: after a meta server restart they register
    /// again, on shm only once the earlier run's lock leases have run out.
    fn wait_for_live_data_servers(&self);

    /// [`Cluster::restart_meta`] after a crash instead of a clean stop (`MetaHandle::crash`: no
    /// goodbye, no flush; the next run finds its `running` mark and scrubs).
    #[cfg(feature = "test-hooks")]
    fn crash_meta_and_restart(&mut self) -> anyhow::Result<()>;
}

impl ClusterExt for Cluster {
    fn spawn_mount_process(&self, child_test: &str, scheme: LockScheme) -> ChildMount {
        crate::child::spawn_mount_process(self, child_test, scheme)
    }

    fn wait_for_live_data_servers(&self) {
        let expected = self.data_servers().len();
        crate::wait_until(
            Duration::from_secs(30),
            "the data servers to register with the meta server",
            || {
                let Ok(client) = self.rpc_client() else {
                    return false;
                };
                matches!(
                    client.call(proto::rpc::Request::Cluster),
                    Ok(Ok(proto::rpc::Response::Cluster(info)))
                        if info.data_servers.iter().filter(|d| d.live).count() >= expected
                )
            },
        );
    }

    #[cfg(feature = "test-hooks")]
    fn crash_meta_and_restart(&mut self) -> anyhow::Result<()> {
        self.restart_meta_after(|meta| {
            meta.crash();
            Ok(())
        })
    }
}
