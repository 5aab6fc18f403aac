//! The workload benchmarks end to end, small (`citronfs bench btio`, `bench oltp`): over two
//! client processes (real FUSE mounts), every lock scheme, the data verified by the benchmark
//! itself (a mismatch fails the run: its exit status is checked). They check that the
//! workloads run and verify, not their speed.

use std::process::Command;

/// Runs `citronfs bench ARGS --json` and returns its results, one per scheme (and read-lock
/// mode), in order; their schemes must be `schemes`.
fn bench_of(args: &[&str], schemes: &[&str]) -> Vec<serde_json::Value> {
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
    let got: Vec<&str> = results
        .iter()
        .map(|r| r["scheme"].as_str().unwrap())
        .collect();
    assert_eq!(got, schemes);
    results
}

/// [`bench_of`] with every scheme once.
fn bench(args: &[&str]) -> Vec<serde_json::Value> {
    bench_of(args, &["citron", "mutex", "seg", "server"])
}

#[test]
fn btio_small_run_verifies_every_scheme_through_client_processes() {
    if let Some(why) = testkit::fuse_unavailable() {
        testkit::skip(testkit::Need::Fuse, &why);
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
        testkit::skip(testkit::Need::Fuse, &why);
        return;
    }
    let results = bench(&["oltp", "--clients", "2", "--duration", "1"]);
    for r in &results {
        assert!(r["reads"].as_u64().unwrap() > 0, "{r}");
        assert!(r["ops_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["read_locks"], "shared", "{r}");
    }
}

/// `--read-locks shared,exclusive`: each scheme runs with reads locked shared, then exclusive,
/// both in the report.
#[test]
fn oltp_runs_each_read_lock_mode_side_by_side() {
    if let Some(why) = testkit::fuse_unavailable() {
        testkit::skip(testkit::Need::Fuse, &why);
        return;
    }
    let results = bench_of(
        &[
            "oltp",
            "--clients",
            "1",
            "--duration",
            "1",
            "--scheme",
            "citron,mutex",
            "--read-locks",
            "shared,exclusive",
        ],
        &["citron", "citron", "mutex", "mutex"],
    );
    let modes: Vec<&str> = results
        .iter()
        .map(|r| r["read_locks"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["shared", "exclusive", "shared", "exclusive"]);
    for r in &results {
        assert!(r["reads"].as_u64().unwrap() > 0, "{r}");
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
        testkit::skip(testkit::Need::Fuse, &why);
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

/// The processes whose parent is `pid` and whose command line contains `word`.
fn children_of(pid: u32, word: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`: comm may hold spaces, so split after its ')'.
        let Some(after) = stat.rsplit_once(')').map(|(_, rest)| rest) else {
            continue;
        };
        let ppid = after.split_whitespace().nth(1).and_then(|p| p.parse().ok());
        let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
        if ppid == Some(pid) && String::from_utf8_lossy(&cmdline).contains(word) {
            found.push(child);
        }
    }
    found
}

/// Whether process `pid` still runs (a zombie does not).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next()),
            Some("Z" | "X")
        ),
        Err(_) => false,
    }
}

/// The mount points under `dir`.
fn mounts_under(dir: &std::path::Path) -> Vec<String> {
    let prefix = dir.to_str().unwrap();
    std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1).map(str::to_string))
        .filter(|m| m.starts_with(prefix))
        .collect()
}

/// A workload benchmark with its client processes mounted under a temporary directory of
/// its own; whatever it leaves (processes, mounts) is removed on drop, so a failing test
/// cleans up too.
struct RunningBench {
    bench: std::process::Child,
    clients: Vec<u32>,
    tmp: tempfile::TempDir,
    /// The parent of the benchmark's cluster run directory (`CITRONFS_RUN_DIR`): its own, so
    /// that no cluster of another test sweeps what this one left.
    run_parent: tempfile::TempDir,
}

impl RunningBench {
    /// Starts `citronfs bench oltp` for long enough, and returns once its two client
    /// processes have mounted.
    fn start() -> RunningBench {
        let tmp = tempfile::tempdir().unwrap();
        let run_parent = tempfile::tempdir_in(testkit::run_dir_parent()).unwrap();
        let bench = Command::new(env!("CARGO_BIN_EXE_citronfs"))
            .args(["bench", "oltp", "--clients", "2", "--scheme", "citron"])
            .args(["--duration", "60", "--json"])
            // The client processes' mount points and logs go there.
            .env("TMPDIR", tmp.path())
            .env("CITRONFS_RUN_DIR", run_parent.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut run = RunningBench {
            bench,
            clients: Vec::new(),
            tmp,
            run_parent,
        };
        let pid = run.bench.id();
        testkit::wait_until(
            std::time::Duration::from_secs(60),
            "the benchmark's two clients to mount",
            || {
                run.clients = children_of(pid, "mount");
                run.clients.len() == 2 && mounts_under(run.tmp.path()).len() == 2
            },
        );
        run
    }

    /// Sends `signal` to the benchmark and waits for it to exit; returns its stderr.
    fn signal(&mut self, signal: libc::c_int) -> String {
        // SAFETY: kill(2) on our own child's pid touches no memory of ours.
        unsafe { libc::kill(self.bench.id() as libc::pid_t, signal) };
        let mut stderr = String::new();
        if let Some(mut pipe) = self.bench.stderr.take() {
            use std::io::Read;
            let _ = pipe.read_to_string(&mut stderr);
        }
        let status = self.bench.wait().unwrap();
        assert!(!status.success(), "the benchmark succeeded: {stderr}");
        stderr
    }

    /// Waits a while for the client processes to exit and their mounts to go; panics naming
    /// `after` (what happened to the benchmark, and what it said), with what the clients that
    /// stayed were doing and what they logged, if they do not. Without `die_with_parent` they
    /// never go. The bound is 60 s. A client used to redo each request in flight when its
    /// cluster died for the data path's whole recovery budget, one after another, while it
    /// unmounted: past 30 s on a loaded 2-core machine (a fresh-clone run of 2026-11-27), past
    /// 60 s in CI; an unmount now tells the client library it is going away
    /// (`CitronFs::shutting_down`), and those requests fail at once. Until a client stopped
    /// reconnecting for each open file it gave back at exit (`CitronFs`'s drop), a daemon
    /// here took 20 s to over a minute.
    fn wait_clients_gone(&self, after: &str) {
        let gone = || {
            !self.clients.iter().any(|&c| running(c)) && mounts_under(self.tmp.path()).is_empty()
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !gone() {
            if std::time::Instant::now() > deadline {
                panic!(
                    "timed out after 60 s waiting for client processes {:?} and their mounts \
                     to go {after}\nmounts left: {:?}\n{}",
                    self.clients,
                    mounts_under(self.tmp.path()),
                    self.clients_state()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// What each client process still running is doing (the state and kernel wait channel of
    /// each of its threads), and every client's log: the story of a client that did not exit.
    fn clients_state(&self) -> String {
        let mut out = String::new();
        for &c in self.clients.iter().filter(|&&c| running(c)) {
            out.push_str(&format!("client {c} threads (name state wchan):\n"));
            let tasks = std::fs::read_dir(format!("/proc/{c}/task"))
                .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
                .unwrap_or_default();
            for task in tasks {
                let read = |f: &str| {
                    std::fs::read_to_string(task.join(f))
                        .unwrap_or_default()
                        .trim()
                        .to_string()
                };
                let stat = read("stat");
                let state = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_string))
                    .unwrap_or_default();
                out.push_str(&format!("  {} {state} {}\n", read("comm"), read("wchan")));
            }
        }
        let logs = std::fs::read_dir(self.tmp.path())
            .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .unwrap_or_default();
        for log in logs
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
        {
            out.push_str(&format!(
                "log {}:\n{}\n",
                log.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            ));
        }
        out
    }
}

impl Drop for RunningBench {
    fn drop(&mut self) {
        let _ = self.bench.kill();
        let _ = self.bench.wait();
        for &c in &self.clients {
            // SAFETY: as in `signal`; a pid that has gone is at worst refused.
            unsafe { libc::kill(c as libc::pid_t, libc::SIGKILL) };
        }
        for m in mounts_under(self.tmp.path()) {
            let _ = Command::new("umount").args(["-l", &m]).status();
        }
    }
}

#[test]
fn an_interrupted_workload_benchmark_unmounts_and_stops_its_clients() {
    if let Some(why) = testkit::fuse_unavailable() {
        testkit::skip(testkit::Need::Fuse, &why);
        return;
    }
    let mut run = RunningBench::start();
    let stderr = run.signal(libc::SIGTERM);
    assert!(stderr.contains("interrupted"), "{stderr}");
    run.wait_clients_gone(&format!("after SIGTERM (stderr: {stderr})"));
    // Mount points and their logs are removed too.
    let left: Vec<_> = std::fs::read_dir(run.tmp.path())
        .unwrap()
        .flatten()
        .collect();
    assert!(left.is_empty(), "left in TMPDIR: {left:?}");
    // And so is the cluster's run directory: an interrupted benchmark removes its own.
    let left: Vec<_> = std::fs::read_dir(run.run_parent.path())
        .unwrap()
        .flatten()
        .collect();
    assert!(
        left.is_empty(),
        "left in the run directory's parent: {left:?}"
    );
}

#[test]
fn a_killed_workload_benchmark_leaves_no_client_process_or_mount() {
    if let Some(why) = testkit::fuse_unavailable() {
        testkit::skip(testkit::Need::Fuse, &why);
        return;
    }
    let mut run = RunningBench::start();
    let pid = run.bench.id();
    let stderr = run.signal(libc::SIGKILL);
    run.wait_clients_gone(&format!("after SIGKILL (stderr: {stderr})"));
    // What a killed process cannot remove itself, its cluster's run directory (named after
    // it), the next cluster of that name removes; here the sweep is called directly. The
    // benchmark's run directories have a parent of their own, so that no cluster another test
    // starts meanwhile sweeps this one first.
    let parent = run.run_parent.path().to_path_buf();
    let left = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&parent)
            .map(|d| {
                d.flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with(&format!("citronfs-oltp-{pid}-")))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(left().len(), 1, "the killed benchmark's run directory");
    testkit::sweep_stale_run_dirs(&parent, "citronfs-oltp");
    assert_eq!(left(), Vec::<std::path::PathBuf>::new());
}
