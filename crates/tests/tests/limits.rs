//! The meta server's limit on open files per session, seen through a mount: open(2) beyond it
//! fails with EMFILE, and closing a file frees its place.

use std::fs::File;
use std::time::Duration;
use testkit::{skip_without_fuse, wait_until, Cluster, ClusterSpec};

#[test]
fn opens_beyond_the_session_limit_get_emfile() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec {
        max_open_per_session: 3,
        ..ClusterSpec::default().with_data_servers(1, 16)
    })
    .unwrap();
    let mount = cluster.mount().unwrap();
    let path = |i: usize| mount.path().join(format!("f{i}"));
    let mut open: Vec<File> = (0..3).map(|i| File::create(path(i)).unwrap()).collect();
    // Another handle on a file the session has open does not count again.
    open.push(File::open(path(0)).unwrap());
    let error = File::create(path(3)).unwrap_err();
    assert_eq!(error.raw_os_error(), Some(libc::EMFILE), "{error}");
    // The kernel releases a closed file asynchronously: wait for its place to free.
    drop(open.remove(1));
    wait_until(Duration::from_secs(10), "a closed file's place", || {
        File::create(path(3)).is_ok()
    });
}
