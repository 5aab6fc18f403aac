//! `citronfs fsck` end to end: a healthy cluster checks clean (at rest too, with a file open);
//! a database damaged while the meta server is stopped is caught offline (`--db`) and by the
//! restarted server, `--repair` fixes it, and the next check is clean. Exit statuses 0, 1, 2.

use fs_client::{CitronFs, FileKind};
use meta_server::store::{Corruption, Store};
use proto::ROOT_INO;
use std::path::Path;
use std::process::{Command, Output};
use testkit::{BackingKind, Cluster, ClusterSpec, TEST_CHUNK_SIZE};

const TOKEN: &str = "fsck-test-token";

/// Runs `citronfs fsck ARGS` with no `CITRONFS_*` variable from outside.
fn fsck(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_citronfs"));
    cmd.arg("fsck").args(args);
    for (key, _) in std::env::vars() {
        if key.starts_with("CITRONFS_") {
            cmd.env_remove(key);
        }
    }
    cmd.output().expect("run citronfs fsck")
}

fn online(cluster: &Cluster, extra: &[&str]) -> Output {
    let meta = cluster.meta_addr().to_string();
    let mut args = vec![
        "--meta",
        &meta,
        "--cluster",
        cluster.name(),
        "--token",
        TOKEN,
    ];
    args.extend_from_slice(extra);
    fsck(&args)
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The `kind` of every JSON line of `out` whose phase is `phase`.
fn kinds(out: &Output, phase: &str) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("one JSON object a line"))
        .filter(|v| v["phase"] == phase)
        .map(|v| v["kind"].as_str().unwrap_or("").to_string())
        .collect()
}

fn spec(state: &Path) -> ClusterSpec {
    ClusterSpec {
        token: Some(TOKEN.into()),
        state_dir: Some(state.to_path_buf()),
        backing: BackingKind::File,
        ..ClusterSpec::default()
    }
}

#[test]
fn fsck_checks_repairs_and_says_so_in_its_exit_status() {
    let state = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(spec(state.path())).unwrap();
    let fs = cluster.client().unwrap();
    let me = CitronFs::process_caller();
    let dir = fs.mkdir(me, ROOT_INO, "d", 0o755).unwrap().ino;
    let (file, fh) = fs.create(me, dir, "f", 0o644, libc::O_RDWR).unwrap();
    // Five chunks over both data servers, then a link and a symlink.
    let data = testkit::pattern(7, 0, 5 * TEST_CHUNK_SIZE as usize);
    fs.write(fh, 0, &data).unwrap();
    fs.link(file.ino, ROOT_INO, "hard").unwrap();
    fs.symlink(me, ROOT_INO, "soft", "d/f").unwrap();
    let (_, other) = fs
        .create(me, ROOT_INO, "gone", 0o644, libc::O_RDWR)
        .unwrap();
    fs.write(other, 0, b"unlinked while open").unwrap();
    fs.unlink(ROOT_INO, "gone").unwrap();

    // Clean, with files open (one of them unlinked): not at rest without the flag...
    let out = online(&cluster, &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("0 findings"),
        "{}",
        text(&out)
    );
    // ... and at rest: both open files' locks inspected, nothing held.
    let out = online(&cluster, &["--at-rest", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(out.stdout.is_empty(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("2 open-file locks (at rest)"),
        "{}",
        text(&out)
    );
    fs.release(fh).unwrap();
    fs.release(other).unwrap();
    drop(fs);
    cluster.shutdown().unwrap();

    // Damage while stopped: a wrong link count, an entry naming nothing, a leaked chunk.
    {
        let (store, _) = Store::open_existing(&state.path().join("meta-db")).unwrap();
        for damage in [
            Corruption::SetNlink {
                ino: file.ino,
                nlink: 5,
            },
            Corruption::AddEntry {
                parent: dir,
                name: "ghost".into(),
                ino: 9999,
                kind: FileKind::File,
            },
            Corruption::LeakChunk { server: 0 },
        ] {
            store.corrupt(&damage).unwrap();
        }
        store.flush().unwrap();
    }
    let db = state.path().join("meta-db");
    let out = fsck(&["--db", db.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let mut found = kinds(&out, "found");
    found.sort();
    assert_eq!(
        found,
        ["dangling-entry", "leaked-chunk", "wrong-link-count"],
        "{}",
        text(&out)
    );

    // The restarted server finds the same; --repair fixes it; then it is clean.
    let cluster = Cluster::start(spec(state.path())).unwrap();
    let out = online(&cluster, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let out = online(&cluster, &["--repair", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(
        kinds(&out, "remaining"),
        Vec::<String>::new(),
        "{}",
        text(&out)
    );
    let repaired = String::from_utf8_lossy(&out.stdout);
    assert!(
        repaired.contains("set inode") && repaired.contains("freed leaked"),
        "{}",
        text(&out)
    );
    let out = online(&cluster, &["--at-rest"]);
    assert!(out.status.success(), "{}", text(&out));
    // The data is untouched.
    let fs = cluster.client().unwrap();
    let attr = fs.lookup(ROOT_INO, "hard").unwrap();
    assert_eq!(attr.nlink, 2);
    let fh = fs.open(me, attr.ino, libc::O_RDONLY).unwrap();
    assert_eq!(fs.read(fh, 0, data.len()).unwrap(), data);
    fs.release(fh).unwrap();
}

#[test]
fn fsck_errors_exit_with_2() {
    // Nobody listens there.
    let out = fsck(&["--meta", "127.0.0.1:1", "--token", "t"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot reach the meta server"),
        "{}",
        text(&out)
    );
    // No token for a running server.
    let out = fsck(&["--meta", "127.0.0.1:1"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    // A directory that holds no database.
    let empty = tempfile::tempdir().unwrap();
    let out = fsck(&["--db", empty.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}
