//! `--metrics ADDR` end to end: `citronfs up` with metrics on 127.0.0.1:0 prints where it
//! serves them; a small workload through the mount moves the FUSE, byte, client and meta-server
//! counters; the scrape is well-formed Prometheus text; any other path is 404.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `citronfs up`, stopped (SIGTERM, then SIGKILL) and its mount point detached on drop.
struct Up {
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: signalling a child this test spawned and has not reaped.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// One HTTP GET of `path` at `addr`: the status code and the body.
fn get(addr: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("no end of the head");
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, body.to_string())
}

/// Parses the Prometheus text format: every line is `# HELP name text`, `# TYPE name kind`,
/// or `name{labels} value` of a family whose TYPE came before; returns each sample's value by
/// its name and labels as written.
fn parse(text: &str) -> HashMap<String, f64> {
    let mut types: HashMap<String, String> = HashMap::new();
    let mut samples = HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            assert!(rest.split_once(' ').is_some(), "{line:?}");
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(
                [
                    "counter",
                    "gauge",
                    "histogram",
                    "summary",
                    "untyped",
                    "info"
                ]
                .contains(&kind),
                "{line:?}"
            );
            types.insert(name.to_string(), kind.to_string());
        } else {
            let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line:?}"));
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("{line:?}"));
            let name = series.split('{').next().unwrap();
            assert!(
                name.starts_with("citronfs_")
                    && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{line:?}"
            );
            if let Some(labels) = series.strip_prefix(name) {
                if !labels.is_empty() {
                    let inner = labels
                        .strip_prefix('{')
                        .and_then(|l| l.strip_suffix("\"}"))
                        .unwrap_or_else(|| panic!("{line:?}"));
                    for pair in inner.split("\",") {
                        let (k, v) = pair.split_once("=\"").unwrap_or_else(|| panic!("{line:?}"));
                        assert!(!k.is_empty() && !v.contains('"'), "{line:?}");
                    }
                }
            }
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| types.contains_key(*f)))
                .unwrap_or(name);
            assert!(types.contains_key(family), "no TYPE before {line:?}");
            samples.insert(series.to_string(), value);
        }
    }
    samples
}

#[test]
fn up_serves_metrics_that_move_with_a_workload() {
    if let Some(why) = testkit::fuse_unavailable() {
        testkit::skip(testkit::Need::Fuse, &why);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cluster = format!("metrics-test-{}", std::process::id());
    let mut child = Command::new(env!("CARGO_BIN_EXE_citronfs"))
        .args(["up", "--memory", "64M", "--private", "--cluster", &cluster])
        .args(["--metrics", "127.0.0.1:0"])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let up = Up { child, dir };
    let mut addr = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let mut line = String::new();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "up ended early");
        if let Some(url) = line.trim().strip_prefix("metrics") {
            let url = url.trim().strip_prefix("http://").unwrap();
            addr = Some(url.strip_suffix("/metrics").unwrap().to_string());
        }
        if line.starts_with("Stop with") {
            break;
        }
    }
    let addr = addr.expect("no metrics line");

    // A file written and read back, and a name that is not there.
    let file = up.dir.path().join("f");
    let data = vec![7u8; 256 << 10];
    std::fs::write(&file, &data).unwrap();
    assert_eq!(std::fs::read(&file).unwrap(), data);
    assert!(std::fs::metadata(up.dir.path().join("missing")).is_err());
    // A directory that is not empty: its removal fails at the meta server (ENOTEMPTY).
    std::fs::create_dir(up.dir.path().join("d")).unwrap();
    std::fs::write(up.dir.path().join("d/x"), b"x").unwrap();
    assert!(std::fs::remove_dir(up.dir.path().join("d")).is_err());

    // A request is counted when its reply has gone, so the counters may lag the system calls
    // by a moment: scraped until they have moved (or 10 s have passed).
    let expected: Vec<(&str, f64)> = vec![
        ("citronfs_fuse_requests_total{op=\"write\"}", 1.0),
        ("citronfs_fuse_requests_total{op=\"read\"}", 1.0),
        (
            "citronfs_fuse_request_duration_seconds_count{op=\"create\"}",
            1.0,
        ),
        (
            "citronfs_fuse_request_errors_total{op=\"lookup\",errno=\"ENOENT\"}",
            1.0,
        ),
        ("citronfs_fuse_written_bytes_total", data.len() as f64),
        ("citronfs_fuse_read_bytes_total", data.len() as f64),
        ("citronfs_client_locked_ios_total", 2.0),
        ("citronfs_client_lock_acquires_total", 2.0),
        ("citronfs_meta_requests_total{kind=\"create\"}", 1.0),
        (
            "citronfs_meta_request_errors_total{kind=\"rmdir\",errno=\"ENOTEMPTY\"}",
            1.0,
        ),
        (
            "citronfs_meta_request_duration_seconds_count{kind=\"allocate_chunks\"}",
            1.0,
        ),
        ("citronfs_meta_sessions", 1.0),
        ("citronfs_meta_data_servers{state=\"live\"}", 2.0),
        ("citronfs_meta_capacity_bytes", (64 << 20) as f64),
        ("citronfs_meta_used_bytes", data.len() as f64),
    ];
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let (code, text) = get(&addr, "/metrics");
        assert_eq!(code, 200, "{text}");
        let m = parse(&text);
        let short: Vec<String> = expected
            .iter()
            .filter(|(series, min)| m.get(*series).is_none_or(|v| v < min))
            .map(|(series, min)| {
                format!("{series} = {:?}, expected at least {min}", m.get(*series))
            })
            .collect();
        if short.is_empty() {
            break text;
        }
        assert!(Instant::now() < deadline, "{}\n{text}", short.join("\n"));
        std::thread::sleep(Duration::from_millis(50));
    };

    // Every metric the Grafana dashboard in docs/ plots is one this scrape declares.
    let dashboard = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/grafana/citronfs.json"),
    )
    .expect("docs/grafana/citronfs.json");
    let declared: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    let mut plotted = 0;
    let mut missing = Vec::new();
    for (i, _) in dashboard.match_indices("citronfs_") {
        let name: String = dashboard[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let family = ["_bucket", "_total", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        if !declared.contains(&family) && !declared.contains(&name.as_str()) {
            missing.push(name);
        }
        plotted += 1;
    }
    assert!(
        missing.is_empty(),
        "the dashboard plots {missing:?}, which the scrape does not declare"
    );
    assert!(
        plotted >= 10,
        "only {plotted} metrics named in the dashboard"
    );

    // Anything else is not found.
    assert_eq!(get(&addr, "/").0, 404);
    assert_eq!(get(&addr, "/metricsx").0, 404);
    drop(up);
}
