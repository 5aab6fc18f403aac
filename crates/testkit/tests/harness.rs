//! The harness itself: clusters on both fabrics, restarts and state directories that keep what
//! they should, mounts that are never left behind, and directories that are cleaned up.

use fs_client::{CitronFs, LockScheme, ROOT_INO};
use std::path::PathBuf;
use std::sync::Arc;
use testkit::Backend;
use testkit::{pattern, skip_without_fuse, BackingKind, Cluster, ClusterSpec, Mount};

fn me() -> fs_client::Caller {
    CitronFs::process_caller()
}

/// Writes `data` to a new file `name` through the library client `fs`.
fn write_file(fs: &CitronFs, name: &str, data: &[u8]) {
    let (_, fh) = fs
        .create(me(), ROOT_INO, name, 0o644, libc::O_RDWR)
        .unwrap();
    fs.write(fh, 0, data).unwrap();
    fs.release(fh).unwrap();
}

/// Reads all of file `name` through `fs`.
fn read_file(fs: &CitronFs, name: &str) -> Vec<u8> {
    let attr = fs.lookup(ROOT_INO, name).unwrap();
    let fh = fs.open(me(), attr.ino, libc::O_RDONLY).unwrap();
    let data = fs.read(fh, 0, attr.size as usize).unwrap();
    fs.release(fh).unwrap();
    data
}

#[test]
fn clusters_serve_data_on_every_fabric() {
    // mem included: a cluster in one process reaches its servers through mem addresses.
    for fabric in Backend::ALL {
        let cluster = Cluster::start(ClusterSpec {
            fabric,
            ..ClusterSpec::default()
        })
        .unwrap();
        assert_eq!(cluster.data_servers().len(), 2);
        let (a, b) = (cluster.client().unwrap(), cluster.client().unwrap());
        // Three chunks and more: the file is striped over both data servers.
        let data = pattern(1, 0, (3 * cluster.spec().chunk_size + 99) as usize);
        write_file(&a, "f", &data);
        assert_eq!(read_file(&b, "f"), data, "{fabric:?}");
        drop((a, b));
        cluster.shutdown().unwrap();
    }
}

#[test]
fn a_random_token_is_required_and_a_given_one_is_used() {
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let other = Cluster::start(ClusterSpec::default()).unwrap();
    assert_eq!(cluster.token().len(), 32);
    assert_ne!(cluster.token(), other.token(), "each cluster gets its own");
    let mut wrong = cluster.options(LockScheme::CITRON);
    wrong.token = other.token().into();
    assert!(CitronFs::connect(wrong).is_err());

    let given = Cluster::start(ClusterSpec {
        token: Some("given-token".into()),
        data_servers: 0,
        ..ClusterSpec::default()
    })
    .unwrap();
    assert_eq!(given.token(), "given-token");
    assert_eq!(given.options(LockScheme::MUTEX).token, "given-token");
    given.client().unwrap();
}

#[test]
fn restart_keeps_file_backed_data_and_the_address() {
    let mut cluster = Cluster::start(ClusterSpec {
        backing: BackingKind::File,
        ..ClusterSpec::default()
    })
    .unwrap();
    let addr = cluster.meta_addr();
    let ids: Vec<u32> = cluster.data_servers().iter().map(|d| d.id()).collect();
    let data = pattern(2, 0, 300_000);
    write_file(&cluster.client().unwrap(), "kept", &data);
    cluster.restart().unwrap();
    assert_eq!(cluster.meta_addr(), addr);
    assert_eq!(
        cluster
            .data_servers()
            .iter()
            .map(|d| d.id())
            .collect::<Vec<_>>(),
        ids,
        "data servers keep their ids by name"
    );
    assert_eq!(read_file(&cluster.client().unwrap(), "kept"), data);
}

#[test]
fn a_state_dir_outlives_the_cluster_and_the_run_dir_does_not() {
    let state = tempfile::tempdir().unwrap();
    let spec = ClusterSpec {
        state_dir: Some(state.path().to_path_buf()),
        backing: BackingKind::File,
        ..ClusterSpec::default()
    };
    let data = pattern(3, 0, 200_000);
    let run_dir: PathBuf;
    {
        let cluster = Cluster::start(spec.clone()).unwrap();
        assert_eq!(cluster.state_dir(), state.path());
        run_dir = cluster.run_dir().to_path_buf();
        assert!(
            run_dir.join("meta").is_dir(),
            "the meta region is in the run directory"
        );
        write_file(&cluster.client().unwrap(), "f", &data);
        cluster.shutdown().unwrap();
    }
    assert!(!run_dir.exists(), "{} left behind", run_dir.display());
    assert!(state.path().join("meta-db").is_dir());
    assert!(state.path().join("ds-0").is_dir());
    // A second cluster on the same state (a second `citronfs up --state-dir`) finds the file.
    let cluster = Cluster::start(spec).unwrap();
    assert_eq!(read_file(&cluster.client().unwrap(), "f"), data);
}

#[test]
fn a_stopped_data_server_comes_back_with_a_restart() {
    let mut cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let ids: Vec<u32> = cluster.data_servers().iter().map(|d| d.id()).collect();
    cluster.data_servers_mut()[1].shutdown();
    cluster.restart().unwrap();
    assert_eq!(
        cluster
            .data_servers()
            .iter()
            .map(|d| d.id())
            .collect::<Vec<_>>(),
        ids
    );
    let fs = cluster.client().unwrap();
    let data = pattern(4, 0, 4 * cluster.spec().chunk_size as usize);
    write_file(&fs, "striped", &data);
    assert_eq!(read_file(&fs, "striped"), data);
}

#[test]
fn mounts_serve_and_unmount_on_drop_even_after_a_panic() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let mount = cluster.mount().unwrap();
    let path = mount.path().to_path_buf();
    std::fs::write(path.join("a"), b"through FUSE").unwrap();
    assert_eq!(
        read_file(mount.fs(), "a"),
        b"through FUSE",
        "the mount's client is the library's"
    );
    assert!(mount.atomic_bound() >= 1 << 20);
    mount.unmount().unwrap();
    assert!(!path.exists(), "the temporary mount point is removed");

    // A test that panics with a file open on the mount: the drop detaches it lazily and aborts
    // its connection, so neither the mount nor a hang is left.
    let (tx, rx) = std::sync::mpsc::channel();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mount = cluster.mount().unwrap();
        let busy = std::fs::File::create(mount.path().join("busy")).unwrap();
        // The file outlives the mount: it is open while the mount is dropped.
        tx.send((mount.path().to_path_buf(), busy)).unwrap();
        panic!("a failing test");
    }));
    assert!(panicked.is_err());
    let (path, held) = rx.recv().unwrap();
    drop(held);
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .contains(&*path.to_string_lossy());
    assert!(!mounted, "{} is still mounted", path.display());
}

#[test]
fn mount_at_a_given_directory_leaves_it_in_place() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let fs = Arc::new(cluster.client().unwrap());
    let mount = Mount::at(fs, dir.path(), &Default::default()).unwrap();
    std::fs::write(dir.path().join("x"), b"x").unwrap();
    drop(mount);
    assert!(dir.path().is_dir());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "unmounted"
    );
    let missing = dir.path().join("missing");
    let err = Mount::at(
        Arc::new(cluster.client().unwrap()),
        &missing,
        &Default::default(),
    )
    .err()
    .expect("no such directory");
    assert!(err.to_string().contains("not a directory"), "{err:#}");
}
