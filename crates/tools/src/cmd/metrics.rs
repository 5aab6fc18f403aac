//! `--metrics ADDR` of every role (`meta-server`, `data-server`, `mount`, `up`): a minimal
//! HTTP/1.1 responder serving the role's `prometheus_client` registry in the Prometheus text
//! format at `GET /metrics`, on one thread of its own with a std listener. Any other path is
//! 404, any other method 405; every connection is closed after its answer. Scrapes are rare
//! (seconds apart) and small, so one connection at a time is enough, each bounded by a read
//! and write timeout so that a stalled peer cannot hold the responder.

use anyhow::{Context, Result};
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// The path metrics are served at.
pub const METRICS_PATH: &str = "/metrics";

/// How long a scrape's connection may take to send its request or read the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// The most bytes of a request's head read; a longer one is refused (431).
const MAX_HEAD: usize = 8 << 10;

/// A new registry of a role: every metric named `citronfs_...`.
pub fn registry() -> Registry {
    Registry::with_prefix("citronfs")
}

/// Binds `addr` and serves `registry` from a background thread for the rest of the process;
/// the address bound (its port chosen by the system when `addr`'s is 0).
pub fn serve(addr: SocketAddr, registry: Registry) -> Result<SocketAddr> {
    let listener =
        TcpListener::bind(addr).with_context(|| format!("metrics: cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    let registry = Arc::new(registry);
    std::thread::Builder::new()
        .name("citronfs-metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => {
                        if let Err(error) = answer(stream, &registry) {
                            tracing::debug!(%error, "metrics: a scrape failed");
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "metrics: accept failed");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
        .context("metrics: cannot start the responder's thread")?;
    tracing::info!(%bound, "serving metrics at http://{bound}{METRICS_PATH}");
    Ok(bound)
}

/// Reads one request from `stream` and answers it.
fn answer(mut stream: TcpStream, registry: &Registry) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_HEAD {
            return respond(&mut stream, "431 Request Header Fields Too Large", "", "");
        }
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    let mut words = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    // A query string (`?name[]=...`, which some scrapers send) is ignored.
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET" | "HEAD", METRICS_PATH) => {
            let mut body = String::new();
            prometheus_text::encode(&mut body, registry).map_err(std::io::Error::other)?;
            if method == "HEAD" {
                body.clear();
            }
            respond(&mut stream, "200 OK", prometheus_text::CONTENT_TYPE, &body)
        }
        ("GET" | "HEAD", _) => respond(
            &mut stream,
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: metrics are at /metrics\n",
        ),
        _ => respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET\n",
        ),
    }
}

fn respond(stream: &mut TcpStream, status: &str, kind: &str, body: &str) -> std::io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if !kind.is_empty() {
        out.push_str(&format!("Content-Type: {kind}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(body);
    stream.write_all(out.as_bytes())?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_metrics_and_404_elsewhere() {
        let mut r = registry();
        let c = Counter::<u64>::default();
        r.register("things", "Things", c.clone());
        c.inc_by(3);
        let addr = serve("127.0.0.1:0".parse().unwrap(), r).unwrap();
        let ok = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains("\r\n\r\n# HELP citronfs_things_total Things.\n"),
            "{ok}"
        );
        assert!(ok.ends_with("citronfs_things_total 3\n"), "{ok}");
        let missing = get(addr, "GET /other HTTP/1.1\r\n\r\n");
        assert!(missing.starts_with("HTTP/1.1 404 "), "{missing}");
        let post = get(addr, "POST /metrics HTTP/1.1\r\n\r\n");
        assert!(post.starts_with("HTTP/1.1 405 "), "{post}");
    }
}
