//! `citronfs bench btio` end to end, small: class S over two client processes (real FUSE
//! mounts), every lock scheme, the data read back and verified by the benchmark itself.

use std::process::Command;

#[test]
fn btio_small_run_verifies_every_scheme_through_client_processes() {
    if let Some(why) = testkit::fuse_unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_citronfs"))
        .args([
            "bench",
            "btio",
            "--class",
            "S",
            "--procs",
            "4",
            "--clients",
            "2",
        ])
        .args(["--steps", "2", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench btio failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let schemes: Vec<&str> = results
        .iter()
        .map(|r| r["scheme"].as_str().unwrap())
        .collect();
    assert_eq!(schemes, ["citron", "mutex", "seg", "server"]);
    for r in &results {
        assert_eq!(r["verified"], true, "{r}");
        // 2 steps of 12·12 rows per process: 4 · 2 · 72 writes.
        assert_eq!(r["writes"], 576, "{r}");
        assert_eq!(r["bytes"], 2 * 12 * 12 * 12 * 40, "{r}");
        assert!(r["mib_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
}
