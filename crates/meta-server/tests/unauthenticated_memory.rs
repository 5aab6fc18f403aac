//! Nothing is buffered beyond a small bound before a peer is authenticated, and an
//! authenticated peer's frame is never allocated in full before its bytes arrive: on the meta
//! server's RPC port, the lock server and the tcp fabric.
//!
//! Each server runs in a child process (this test binary re-executed, see `child_server`),
//! so that its resident memory (VmRSS in /proc) is its own. The test opens many connections
//! that declare huge frames and send only part of them, keeps them open, and watches the
//! server's RSS: it must stay within a small bound. The meta server went from
//! 76 MB → 1.09 GB for 60 such unauthenticated connections before `MAX_HELLO_FRAME` and the
//! read-as-bytes-arrive framing; a regression to allocating a declared length up front would
//! cost 16 MiB (64 MiB on the fabric) per connection here and fail the bound many times over.

use fabric::frame::{header_for, HEADER_LEN};
use fabric::handshake::{self, Credentials, Protocol, MAX_HELLO_FRAME};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "CITRONFS_MEMORY_TEST_CHILD";
const TOKEN: &str = "memory-test";

fn credentials() -> Credentials {
    Credentials::new("citronfs", TOKEN)
}

/// Not a test on its own: when the parent re-executes this binary with `CHILD_ENV` set, it
/// runs the server named there, prints its address and serves until its stdin closes.
#[test]
fn child_server() {
    let Ok(kind) = std::env::var(CHILD_ENV) else {
        return;
    };
    let addr: SocketAddr;
    let dir = tempfile::tempdir().unwrap();
    let _meta;
    let _lock;
    let _fabric;
    match kind.as_str() {
        "meta" => {
            let mut config =
                meta_server::MetaConfig::new(dir.path().join("db"), fabric::ServeAt::Mem);
            config.token = TOKEN.into();
            config.region_bytes = 1 << 20;
            let handle = meta_server::MetaServer::start(config).unwrap();
            addr = handle.addr();
            _meta = handle;
        }
        "lock" => {
            let server =
                lockmgr::baselines::LockServer::bind("127.0.0.1:0", credentials()).unwrap();
            addr = server.addr();
            _lock = server;
        }
        "fabric" => {
            let server = fabric::TcpServer::bind("127.0.0.1:0", credentials()).unwrap();
            addr = server.local_addr();
            _fabric = server;
        }
        other => panic!("unknown child server {other:?}"),
    }
    println!("CHILD-ADDR {addr}");
    std::io::stdout().flush().unwrap();
    // Serve until the parent closes our stdin (or kills us).
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

/// A server in a child process, killed on drop whatever happened.
struct ChildServer {
    child: Child,
    addr: SocketAddr,
}

impl ChildServer {
    fn start(kind: &str) -> ChildServer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_server", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, kind)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut guard = ChildServer {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        for line in stdout.lines() {
            let line = line.unwrap();
            // The test harness prints "test child_server ... " on the same line first.
            if let Some((_, addr)) = line.split_once("CHILD-ADDR ") {
                guard.addr = addr.trim().parse().unwrap();
                return guard;
            }
        }
        panic!("the {kind} child server exited without an address");
    }

    /// Its resident memory in bytes.
    fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the child server is running");
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS in /proc/PID/status");
        kib << 10
    }

    /// The most RSS above `baseline` seen while watching for `window` (the server reads what
    /// arrived on every connection within it: it reads as bytes arrive).
    fn growth_within(&self, baseline: u64, window: Duration) -> u64 {
        let started = Instant::now();
        let mut most = 0;
        while started.elapsed() < window {
            most = most.max(self.rss().saturating_sub(baseline));
            std::thread::sleep(Duration::from_millis(20));
        }
        most
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Connects and sends a frame header declaring `declared` bytes, then `sent` bytes of body.
fn partial_frame(addr: SocketAddr, declared: u32, sent: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    send_partial(&mut s, declared, sent);
    s
}

fn send_partial(s: &mut TcpStream, declared: u32, sent: usize) {
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&declared.to_le_bytes());
    s.write_all(&header).unwrap();
    s.write_all(&vec![0xA5; sent]).unwrap();
}

/// The bound on RSS growth in each test: far below what a regression costs (16 MiB or more per
/// connection, over 300 MiB in every test), far above what the connections legitimately cost
/// (a buffer and, on the thread-per-connection servers, a stack each).
const BOUND: u64 = 64 << 20;

/// 40 unauthenticated connections declaring a 16 MiB hello and sending 32 KiB, and 40
/// declaring the largest hello allowed and sending nearly all of it, all kept open.
fn unauthenticated_flood(server: &ChildServer) -> Vec<TcpStream> {
    let mut open = Vec::new();
    for _ in 0..40 {
        open.push(partial_frame(server.addr, 16 << 20, 32 << 10));
        open.push(partial_frame(
            server.addr,
            MAX_HELLO_FRAME as u32,
            MAX_HELLO_FRAME - 4096,
        ));
    }
    open
}

fn check_unauthenticated(kind: &str) {
    let server = ChildServer::start(kind);
    let baseline = server.rss();
    let open = unauthenticated_flood(&server);
    let growth = server.growth_within(baseline, Duration::from_millis(1500));
    eprintln!(
        "{kind}: RSS {} MiB, +{} KiB with {} unauthenticated connections",
        baseline >> 20,
        growth >> 10,
        open.len()
    );
    assert!(
        growth < BOUND,
        "{kind}: RSS grew by {growth} bytes for {} unauthenticated connections",
        open.len()
    );
}

#[test]
fn meta_server_buffers_little_for_unauthenticated_peers() {
    check_unauthenticated("meta");
}

#[test]
fn lock_server_buffers_little_for_unauthenticated_peers() {
    check_unauthenticated("lock");
}

#[test]
fn fabric_server_buffers_little_for_unauthenticated_peers() {
    check_unauthenticated("fabric");
}

/// Performs a handshake of `protocol` with `role`, returning the connection past it.
fn authenticated<R: serde::Serialize>(addr: SocketAddr, protocol: Protocol, role: R) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let hello = handshake::Hello::new(protocol, &credentials(), 0, role);
    let body = postcard::to_stdvec(&hello).unwrap();
    s.write_all(&header_for(&body)).unwrap();
    s.write_all(&body).unwrap();
    let mut answer = Vec::new();
    fabric::frame::read_frame(&mut s, 1 << 20, &mut answer).unwrap();
    let proof = handshake::answer_challenge(&credentials(), &body, &answer).unwrap();
    s.write_all(&header_for(&proof)).unwrap();
    s.write_all(&proof).unwrap();
    fabric::frame::read_frame(&mut s, 1 << 20, &mut answer).unwrap();
    s
}

/// 20 authenticated meta-server sessions, each declaring a request of the largest frame
/// allowed (16 MiB) and sending 32 KiB of it.
#[test]
fn meta_server_allocates_frames_as_bytes_arrive() {
    let server = ChildServer::start("meta");
    let baseline = server.rss();
    let mut open = Vec::new();
    for _ in 0..20 {
        let role = proto::rpc::Role::Client {
            host: "memory-test".into(),
            pid: std::process::id(),
        };
        let mut s = authenticated(server.addr, Protocol::Rpc, role);
        send_partial(&mut s, proto::rpc::MAX_FRAME as u32, 32 << 10);
        open.push(s);
    }
    let growth = server.growth_within(baseline, Duration::from_millis(1500));
    eprintln!("meta: +{} KiB with 20 partial 16 MiB frames", growth >> 10);
    assert!(growth < BOUND, "meta: RSS grew by {growth} bytes");
}

/// 10 authenticated fabric connections, each declaring a batch of the largest frame allowed
/// (over 64 MiB) and sending 32 KiB of it.
#[test]
fn fabric_server_allocates_frames_as_bytes_arrive() {
    let server = ChildServer::start("fabric");
    let baseline = server.rss();
    let mut open = Vec::new();
    for _ in 0..10 {
        let mut s = authenticated(server.addr, Protocol::Verbs, ());
        send_partial(
            &mut s,
            fabric::tcp::wire::MAX_REQUEST_FRAME as u32,
            32 << 10,
        );
        open.push(s);
    }
    let growth = server.growth_within(baseline, Duration::from_millis(1500));
    eprintln!("fabric: +{} KiB with 10 partial batch frames", growth >> 10);
    assert!(growth < BOUND, "fabric: RSS grew by {growth} bytes");
}
