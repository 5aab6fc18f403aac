//! The workload benchmarks end to end, small (`citronfs bench btio`, `bench oltp`): over two
//! client processes (real FUSE mounts), every lock scheme, the data verified by the benchmark
//! itself (a mismatch fails the run: its exit status is checked). They check that the
//! workloads run and verify, not their speed.

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
        assert!(r["reads"].as_u64().unwrap() > 0, "{r}");
        assert!(r["ops_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[test]
fn io500_hard_lock_only_scales_up_and_replays_a_recorded_trace() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("hard.trace");
    let run = |args: &[&str]| -> Vec<serde_json::Value> {
        let out = Command::new(env!("CARGO_BIN_EXE_citronfs"))
            .args(["bench", "io500-hard", "--json"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let trace_arg = trace.to_str().unwrap();
    let recorded = run(&[
        "--procs",
        "4",
        "--records",
        "3000",
        "--trace-out",
        trace_arg,
    ]);
    let replayed = run(&["--trace", trace_arg]);
    for results in [&recorded, &replayed] {
        let schemes: Vec<&str> = results
            .iter()
            .map(|r| r["scheme"].as_str().unwrap())
            .collect();
        assert_eq!(
            schemes,
            ["citron", "citron-prealloc", "mutex", "seg", "server"]
        );
        for r in results.iter() {
            assert_eq!(r["writes"], 3000, "{r}");
        }
        // 3000 records of 47008 B reach 34,430 units: four scale-ups from 256 (to 65,536).
        assert_eq!(results[0]["scale_ups"].as_array().unwrap().len(), 4);
        assert_eq!(results[1]["scale_ups"].as_array().unwrap().len(), 0);
    }
}

#[test]
fn io500_hard_with_io_writes_and_verifies_every_record_through_client_processes() {
    if let Some(why) = testkit::fuse_unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let results = bench(&[
        "io500-hard",
        "--io",
        "--procs",
        "4",
        "--records",
        "400",
        "--clients",
        "2",
    ]);
    for r in &results {
        assert_eq!(r["writes"], 400, "{r}");
        assert!(r["mib_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
}
