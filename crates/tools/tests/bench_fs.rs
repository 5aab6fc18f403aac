//! `citronfs bench fs` end to end, tiny: tmpfs, the null FUSE backend and a CitronFS mount in
//! one run, with CitronFS's ratios to the null ceiling. It checks that the run works and
//! reports, not its speed.

use std::process::Command;

#[test]
fn bench_fs_measures_the_null_ceiling_in_the_same_run() {
    if let Some(why) = testkit::fuse_unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_citronfs"))
        .args(["bench", "fs", "--fs", "tmpfs,null,citronfs"])
        .args(["--patterns", "rand-read,seq-write", "--threads", "1"])
        .args(["--size", "4M", "--duration", "0.2", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench fs failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let order: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r["fs"].as_str().unwrap(), r["pattern"].as_str().unwrap()))
        .collect();
    assert_eq!(
        order,
        [
            ("tmpfs", "rand-read"),
            ("null", "rand-read"),
            ("citronfs", "rand-read"),
            ("tmpfs", "seq-write"),
            ("null", "seq-write"),
            ("citronfs", "seq-write"),
        ],
        "each case runs on every file system back to back"
    );
    for r in &rows {
        assert!(r["ops"].as_u64().unwrap() > 0, "{r}");
        let fs = r["fs"].as_str().unwrap();
        // Only CitronFS is compared with the null ceiling, and always when it ran.
        for key in ["ratio_vs_null", "p50_vs_null"] {
            assert_eq!(r[key].is_f64(), fs == "citronfs", "{key}: {r}");
        }
        assert_eq!(r["ratio_vs_tmpfs"].is_f64(), fs != "tmpfs", "{r}");
    }
    let citron = &rows[2];
    let null = &rows[1];
    let ratio = citron["p50_us"].as_f64().unwrap() / null["p50_us"].as_f64().unwrap();
    assert!(
        (citron["p50_vs_null"].as_f64().unwrap() - ratio).abs() < 1e-9,
        "{citron}"
    );
}
