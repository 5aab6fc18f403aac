//! `citronfs bench fs` and `citronfs bench meta` end to end, tiny: tmpfs, the null FUSE backend
//! and a CitronFS mount in one run, with CitronFS's ratios to the null ceiling. They check that
//! the runs work and report, not their speed.

use std::process::Command;

/// Runs `citronfs ARGS --json`, which must succeed, and returns its JSON rows.
fn json_rows(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_citronfs"))
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "citronfs {} failed: {}\n{stdout}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Each `bench meta` row's (file system, phase, threads), in order.
fn order_of(rows: &[serde_json::Value]) -> Vec<(&str, &str, u64)> {
    rows.iter()
        .map(|r| {
            (
                r["fs"].as_str().unwrap(),
                r["phase"].as_str().unwrap(),
                r["threads"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn bench_fs_measures_the_null_ceiling_in_the_same_run() {
    if let Some(why) = testkit::fuse_unavailable() {
        testkit::skip(testkit::Need::Fuse, &why);
        return;
    }
    let rows = json_rows(&[
        "bench",
        "fs",
        "--fs",
        "tmpfs,null,citronfs",
        "--patterns",
        "rand-read,seq-write",
        "--threads",
        "1",
        "--size",
        "4M",
        "--duration",
        "0.2",
    ]);
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
        // The client library's own time per call: CitronFS's rows only, and within the call.
        match fs {
            "citronfs" => {
                let locked = r["locked_us"].as_f64().expect("locked_us");
                assert!(
                    locked > 0.0 && locked <= r["max_us"].as_f64().unwrap(),
                    "{r}"
                );
            }
            _ => assert!(r["locked_us"].is_null(), "{r}"),
        }
    }
    let citron = &rows[2];
    let null = &rows[1];
    let ratio = citron["p50_us"].as_f64().unwrap() / null["p50_us"].as_f64().unwrap();
    assert!(
        (citron["p50_vs_null"].as_f64().unwrap() - ratio).abs() < 1e-9,
        "{citron}"
    );
}

/// `--replicas 1,2`: a file of each count, measured back to back, each row naming its count;
/// a replicated write moves its data to two servers, one batch each (more round trips per
/// call than the file of one replica), a read to one.
#[test]
fn bench_fs_measures_each_replica_count() {
    let rows = json_rows(&[
        "bench",
        "fs",
        "--fs",
        "library",
        "--replicas",
        "1,2",
        "--patterns",
        "rand-read,rand-write",
        "--threads",
        "1",
        "--size",
        "4M",
        "--duration",
        "0.2",
    ]);
    let order: Vec<(&str, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["pattern"].as_str().unwrap(),
                r["replicas"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        order,
        [
            ("rand-read", 1),
            ("rand-read", 2),
            ("rand-write", 1),
            ("rand-write", 2)
        ]
    );
    let rtts = |i: usize| rows[i]["rtts_per_op"].as_f64().unwrap();
    assert!(
        rtts(3) > rtts(2) + 0.5,
        "a second replica's batch: {rows:?}"
    );
    assert!(
        rtts(1) < rtts(0) + 0.5,
        "a read takes one replica: {rows:?}"
    );
    // More replicas than data servers: refused.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_citronfs"))
        .args(["bench", "fs", "--fs", "library", "--replicas", "3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--replicas"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bench_meta_measures_the_null_ceiling_in_the_same_run() {
    if let Some(why) = testkit::fuse_unavailable() {
        testkit::skip(testkit::Need::Fuse, &why);
        return;
    }
    let rows = json_rows(&[
        "bench",
        "meta",
        "--fs",
        "tmpfs,null,citronfs",
        "--threads",
        "1,2",
        "--files",
        "20",
    ]);
    let phases = ["create", "stat", "open-close", "unlink"];
    // CitronFS adds its `rpc` row (the transport alone) after each thread count's phases.
    let expected: Vec<(&str, &str, u64)> = ["tmpfs", "null", "citronfs"]
        .into_iter()
        .flat_map(|fs| {
            [1, 2].into_iter().flat_map(move |t| {
                let rpc = (fs == "citronfs").then_some((fs, "rpc", t));
                phases.into_iter().map(move |p| (fs, p, t)).chain(rpc)
            })
        })
        .collect();
    let order = order_of(&rows);
    assert_eq!(order, expected, "every phase on every file system");
    for r in &rows {
        assert_eq!(
            r["ops"].as_u64().unwrap(),
            20 * r["threads"].as_u64().unwrap(),
            "{r}"
        );
        let fs = r["fs"].as_str().unwrap();
        // The rpc row has nothing to compare with.
        let phase = r["phase"].as_str().unwrap() != "rpc";
        for key in ["ratio_vs_null", "p50_vs_null"] {
            assert_eq!(r[key].is_f64(), fs == "citronfs" && phase, "{key}: {r}");
        }
        assert_eq!(r["ratio_vs_tmpfs"].is_f64(), fs != "tmpfs" && phase, "{r}");
        // The meta server's counters: CitronFS only; stat costs it no request.
        assert_eq!(r["rpcs_per_op"].is_f64(), fs == "citronfs", "{r}");
        assert_eq!(r["awake_per_op"].is_f64(), fs == "citronfs", "{r}");
        if let (Some(awake), Some(rpcs)) = (r["awake_per_op"].as_f64(), r["rpcs_per_op"].as_f64()) {
            assert!(awake <= rpcs, "more requests answered awake than made: {r}");
        }
    }
    let of = |fs: &str, phase: &str| {
        rows.iter()
            .find(|r| r["fs"] == fs && r["phase"] == phase && r["threads"] == 1)
            .unwrap()
    };
    let (citron, null) = (of("citronfs", "create"), of("null", "create"));
    let ratio = citron["ops_per_s"].as_f64().unwrap() / null["ops_per_s"].as_f64().unwrap();
    assert!(
        (citron["ratio_vs_null"].as_f64().unwrap() - ratio).abs() < 1e-9,
        "{citron}"
    );
    // A stat reads attributes one-sidedly: no request per stat (a straggler of the phase
    // before, a release riding on a call, may fall in it).
    let stat_rpcs = of("citronfs", "stat")["rpcs_per_op"].as_f64().unwrap();
    assert!(stat_rpcs < 0.2, "{stat_rpcs} requests per stat");
    // The rpc row is one request per operation, timed.
    let rpc = of("citronfs", "rpc");
    let rpcs = rpc["rpcs_per_op"].as_f64().unwrap();
    assert!((0.9..1.5).contains(&rpcs), "{rpcs} requests per rpc: {rpc}");
    assert!(rpc["p50_us"].as_f64().unwrap() > 0.0, "{rpc}");
}

/// `bench meta --fs library` runs the four phases as client library calls (no FUSE, so no
/// FUSE check either): every operation done, and the meta server's requests per operation
/// as the library makes them — none for a lookup (attributes read one-sidedly), one for a
/// create, an open+close (the release rides on a later call) and an unlink.
#[test]
fn bench_meta_runs_the_phases_through_the_library() {
    let rows = json_rows(&[
        "bench",
        "meta",
        "--fs",
        "library",
        "--threads",
        "1,2",
        "--files",
        "30",
    ]);
    let order = order_of(&rows);
    let expected: Vec<(&str, &str, u64)> = [1, 2]
        .into_iter()
        .flat_map(|t| {
            ["create", "stat", "open-close", "unlink"]
                .into_iter()
                .map(move |p| ("library", p, t))
        })
        .collect();
    assert_eq!(order, expected);
    for r in &rows {
        assert_eq!(
            r["ops"].as_u64().unwrap(),
            30 * r["threads"].as_u64().unwrap(),
            "{r}"
        );
        let rpcs = r["rpcs_per_op"].as_f64().unwrap();
        let expected = if r["phase"] == "stat" { 0.0 } else { 1.0 };
        // A straggler (a release riding on the next call, a heartbeat-free retry) may fall
        // into a neighbouring phase.
        assert!(
            (rpcs - expected).abs() < 0.25,
            "{rpcs} requests per op: {r}"
        );
    }
}
