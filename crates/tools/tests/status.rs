//! `citronfs status` end to end: against a cluster with two client sessions and a file both
//! hold open, `--json` lists both data servers (live), the two sessions and the status
//! command's own (marked `caller`), and the open file held by two sessions; the table names
//! the same; a wrong token is refused with a message that says so.

use fs_client::CitronFs;
use proto::status::ClusterStatus;
use proto::ROOT_INO;
use std::process::{Command, Output};
use std::time::{Duration, Instant};
use testkit::{Cluster, ClusterSpec};

const TOKEN: &str = "status-test-token";

/// Runs `citronfs status ARGS` against `cluster` with `token`, with no `CITRONFS_*` variable
/// from outside.
fn status(cluster: &Cluster, token: &str, extra: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_citronfs"));
    cmd.arg("status")
        .args(["--meta", &cluster.meta_addr().to_string()])
        .args(["--cluster", cluster.name(), "--token", token])
        .args(extra);
    for (key, _) in std::env::vars() {
        if key.starts_with("CITRONFS_") {
            cmd.env_remove(key);
        }
    }
    cmd.output().expect("run citronfs status")
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn json_status(cluster: &Cluster) -> ClusterStatus {
    let out = status(cluster, TOKEN, &["--json"]);
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)))
}

#[test]
fn status_lists_servers_sessions_and_open_files_and_refuses_a_wrong_token() {
    let cluster = Cluster::start(ClusterSpec {
        token: Some(TOKEN.into()),
        ..ClusterSpec::default()
    })
    .unwrap();
    let me = CitronFs::process_caller();
    let first = cluster.client().unwrap();
    let second = cluster.client().unwrap();
    let (file, _held) = first
        .create(me, ROOT_INO, "shared", 0o644, libc::O_RDWR)
        .unwrap();
    let _also_held = second.open(me, file.ino, libc::O_RDWR).unwrap();

    // A client may open a session on tcp and move to the meta server's local socket, closing
    // the first: its end is noticed by the server a moment later.
    let deadline = Instant::now() + Duration::from_secs(10);
    let got = loop {
        let got = json_status(&cluster);
        let others = got.sessions.iter().filter(|s| !s.caller).count();
        if others == 2 || Instant::now() > deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(100));
    };

    assert_eq!(got.cluster, cluster.name());
    let rpc = got.protocols.iter().find(|p| p.name == "rpc").unwrap();
    assert_eq!(rpc.version, proto::rpc::VERSION);
    assert_eq!(
        got.meta.state_dir,
        cluster.state_dir().join("meta-db").display().to_string(),
        "{got:#?}"
    );
    assert_eq!(got.data_servers.len(), cluster.data_servers().len());
    for d in &got.data_servers {
        assert!(d.live, "{d:?}");
        assert!(
            d.capacity_bytes > 0 && d.free_bytes <= d.capacity_bytes,
            "{d:?}"
        );
    }
    // The two clients' sessions, and this command's own.
    assert_eq!(got.sessions.len(), 3, "{:#?}", got.sessions);
    let callers: Vec<_> = got.sessions.iter().filter(|s| s.caller).collect();
    assert_eq!(callers.len(), 1);
    assert_eq!(callers[0].host, "citronfs-status");
    assert_eq!(callers[0].open_files, 0);
    let holders = got
        .sessions
        .iter()
        .filter(|s| !s.caller && s.open_files == 1)
        .count();
    assert_eq!(holders, 2, "{:#?}", got.sessions);
    assert_eq!(got.open_file_count, 1);
    assert_eq!(got.open_files[0].ino, file.ino);
    assert_eq!(got.open_files[0].sessions, 2);

    let table = status(&cluster, TOKEN, &[]);
    assert!(table.status.success(), "{}", text(&table));
    let shown = String::from_utf8_lossy(&table.stdout);
    for wanted in [
        "data servers (2 live of 2)",
        "citronfs-status (this command)",
        "open files (1)",
        &file.ino.to_string(),
    ] {
        assert!(
            shown.contains(wanted),
            "{wanted:?} missing: {}",
            text(&table)
        );
    }

    let refused = status(&cluster, "not-the-token", &["--json"]);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(refused.stdout.is_empty(), "{}", text(&refused));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("refused") && said.contains("token"),
        "{}",
        text(&refused)
    );
}
