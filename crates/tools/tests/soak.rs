//! A short `citronfs soak` on each fabric: clients, the meta server and a data server are each
//! killed at least once while the workload runs, and the verification finds no acknowledged
//! write lost, no torn record and no unexpected file (the soak exits non-zero otherwise).
//! Longer soaks are run by hand (docs/RELIABILITY.md quotes one).

use std::process::Command;

fn short_soak(fabric: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_citronfs"))
        .args(["soak", "--minutes", "0.25", "--clients", "2"])
        .args(["--kill-every", "1.5", "--seed", "11", "--json"])
        .args(["--fabric", fabric])
        .output()
        .expect("run citronfs soak");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the soak failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    let did = &report["did"];
    let found = &report["found"];
    for kind in ["kills_client", "kills_meta", "kills_data"] {
        assert!(did[kind].as_u64().unwrap() >= 1, "no {kind}: {report}");
    }
    for bad in ["lost", "torn", "unexpected"] {
        assert_eq!(found[bad].as_u64(), Some(0), "{bad}: {report}");
    }
    assert_eq!(report["fsck_findings"], serde_json::json!([]), "{report}");
    assert!(found["acked"]["write"].as_u64().unwrap() > 0, "{report}");
    // The clients carried on after the servers came back (they do not just fail safely).
    assert!(
        found["acked_after_last_server_restart"].as_u64().unwrap() > 0,
        "{report}"
    );
    assert!(found["slots"].as_u64().unwrap() > 0, "{report}");
}

#[test]
fn short_soak_on_tcp_loses_nothing() {
    short_soak("tcp");
}

#[test]
fn short_soak_on_shm_loses_nothing() {
    short_soak("shm");
}
