//! `citronfs bench rereplicate` end to end, tiny: a run per rate limit, each a data server's
//! lost chunks re-replicated and checked. It checks that the run works and reports, and that
//! the limit holds, not the speed.

use std::process::Command;

#[test]
fn bench_rereplicate_times_a_pass_per_rate_limit() {
    let out = Command::new(env!("CARGO_BIN_EXE_citronfs"))
        .args([
            "bench",
            "rereplicate",
            "--size",
            "4",
            "--rates",
            "0,8",
            "--json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench rereplicate failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    for (row, limit) in rows.iter().zip([0, 8]) {
        assert_eq!(row["limit_mib_per_s"].as_u64(), Some(limit), "{row}");
        assert!(row["chunks"].as_u64().unwrap() > 0, "{row}");
        assert!(row["mib"].as_f64().unwrap() > 0.0, "{row}");
        let speed = row["mib_per_s"].as_f64().unwrap();
        assert!(speed > 0.0, "{row}");
        if limit > 0 {
            // The pass waits before each chunk for the ones before: its last chunk may come
            // in ahead of the limit by one chunk's worth.
            assert!(speed <= limit as f64 * 1.5, "{row}");
        }
    }
}
