//! The workload benchmarks end to end, small (`citronfs bench btio`, `bench oltp`): over two
//! client processes (real FUSE mounts), every lock scheme, the data verified by the benchmark
//! itself. They check that the workloads run and verify, not their speed.

use std::process::Command;

/// Runs `citronfs bench ARGS --json` and returns its results, one per scheme, in order.
fn bench(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_citronfs"))
        .arg("bench")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench {args:?} failed: {}\n{stdout}",
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
    results
}

#[test]
fn btio_small_run_verifies_every_scheme_through_client_processes() {
    if let Some(why) = testkit::fuse_unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let results = bench(&[
        "btio",
        "--class",
        "S",
        "--procs",
        "4",
        "--clients",
        "2",
        "--steps",
        "2",
    ]);
    for r in &results {
        assert_eq!(r["verified"], true, "{r}");
        // 2 steps of 2·6·6 rows per process: 4 · 2 · 72 writes.
        assert_eq!(r["writes"], 576, "{r}");
        assert_eq!(r["bytes"], 2 * 12 * 12 * 12 * 40, "{r}");
        assert!(r["mib_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[test]
fn oltp_small_run_checks_every_read_through_client_processes() {
    if let Some(why) = testkit::fuse_unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let results = bench(&["oltp", "--clients", "2", "--duration", "1"]);
    for r in &results {
        assert_eq!(r["verified"], true, "{r}");
        assert!(r["reads"].as_u64().unwrap() > 0, "{r}");
        assert!(r["ops_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
}
