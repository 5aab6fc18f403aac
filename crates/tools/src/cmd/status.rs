//! `citronfs status`: asks a running meta server how the cluster stands (`Request::Status`,
//! answered from the meta server's own state: `meta_server`'s `status` module) and prints it:
//! aligned tables by default, one JSON object (`proto::status::ClusterStatus`) with `--json`.
//!
//! It opens a client session of its own to ask — listed among the sessions, marked as the
//! caller — and opens no file and mounts nothing. Exit status 0 when the meta server answered,
//! 1 when it could not be asked (unreachable, or the handshake refused: a wrong token or
//! cluster name).

use super::config::{init_logging, require_token, AskConfig, CommonArgs, RoleArgs};
use crate::report::Report;
use anyhow::{Context, Result};
use clap::Args;
use proto::rpc::{Client, Request, Response, Role, RpcError};
use proto::status::{ClusterStatus, TOP_OPEN_FILES};
use serde::Serialize;
use std::time::Duration;

/// How long `citronfs status` waits for the meta server's answer.
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(30);

/// The host name the status session presents (in the meta server's log and its own listing).
pub const STATUS_HOST: &str = "citronfs-status";

/// Flags of `citronfs status`.
#[derive(Args, Debug, Default, Serialize)]
pub struct StatusArgs {
    #[command(flatten)]
    #[serde(flatten)]
    common: CommonArgs,
    /// The meta server's RPC address.
    #[arg(long)]
    meta: Option<String>,
    /// One JSON object (the whole status) instead of tables.
    #[arg(long)]
    #[serde(skip)]
    json: bool,
}

impl RoleArgs for StatusArgs {
    type Config = AskConfig;
    fn common(&self) -> &CommonArgs {
        &self.common
    }
}

/// Runs `citronfs status`: asks, then prints.
pub fn status(args: StatusArgs) -> Result<()> {
    let settings = args.load()?;
    init_logging(&settings.log)?;
    let credentials = fabric::Credentials::new(
        settings.cluster,
        require_token(settings.token, settings.token_file.as_deref())?,
    );
    let status = request(&settings.meta, &credentials)?;
    if args.json {
        println!("{}", render_json(&status));
    } else {
        print!("{}", render_table(&status));
    }
    Ok(())
}

/// Asks the meta server at `addr` for the cluster's status, presenting `credentials`.
pub fn request(addr: &str, credentials: &fabric::Credentials) -> Result<ClusterStatus> {
    let role = Role::Client {
        host: STATUS_HOST.into(),
        pid: std::process::id(),
    };
    let mut client = Client::connect(addr, credentials, role).map_err(|e| {
        if let RpcError::ServerUnverified(_) = e {
            anyhow::anyhow!("refused the meta server at {addr}: {e} (check --token and --cluster)")
        } else if e.is_refusal() {
            anyhow::anyhow!(
                "the meta server at {addr} refused the connection: {e} (check --token and \
                 --cluster, and that it runs this version of CitronFS)"
            )
        } else {
            anyhow::anyhow!("cannot reach the meta server at {addr}: {e}")
        }
    })?;
    client.set_timeout(Some(STATUS_TIMEOUT))?;
    match client
        .call(Request::Status)
        .with_context(|| format!("asking the meta server at {addr} for its status"))?
    {
        Ok(Response::Status(status)) => Ok(*status),
        Ok(other) => anyhow::bail!("the meta server answered status with {other:?}"),
        Err(e) => Err(anyhow::anyhow!("the meta server refused status: {e}")),
    }
}

/// The status as one JSON object (pretty-printed).
pub fn render_json(status: &ClusterStatus) -> String {
    serde_json::to_string_pretty(status).expect("a status serializes")
}

/// A duration in milliseconds, for people: `850ms`, `4.2s`, `3m07s`, `2h05m`, `3d04h`.
fn duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        _ if ms < 1000 => format!("{ms}ms"),
        0..60 => format!("{:.1}s", ms as f64 / 1000.0),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

/// Bytes, for people: binary units with one decimal (`512.0 MiB`).
fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The status as text: a few lines about the cluster and the meta server, then a table each
/// of data servers, sessions and open files (the tables of `crate::report`).
pub fn render_table(status: &ClusterStatus) -> String {
    let meta = &status.meta;
    let db = &meta.database;
    let protocols: Vec<String> = status
        .protocols
        .iter()
        .map(|p| format!("{} v{}", p.name, p.version))
        .collect();
    let mut out = format!(
        "cluster      {}\nprotocols    {}\n",
        status.cluster,
        protocols.join(", ")
    );
    out += &format!(
        "meta server  up {}, state in {}, region at {}, {} requests, {} inodes\n",
        duration(meta.uptime_ms),
        meta.state_dir,
        meta.fabric,
        meta.requests,
        meta.inodes
    );
    out += &format!(
        "database     {} changes committed, {} written, {}{}\n",
        db.committed,
        db.written,
        match db.last_flush_ago_ms {
            Some(ago) => format!("last flush {} ago", duration(ago)),
            None => "no flush since it opened".into(),
        },
        match &db.failed {
            Some(why) => format!(", WRITER FAILED: {why}"),
            None => String::new(),
        }
    );
    out += &format!(
        "leases       session {}, fenceable after {} of silence\n",
        duration(meta.session_lease_ms),
        duration(meta.fence_after_ms)
    );

    out += &rereplication_line(&status.rereplication);

    let live = status.data_servers.iter().filter(|d| d.live).count();
    out += &format!(
        "\ndata servers ({live} live of {})\n",
        status.data_servers.len()
    );
    let mut servers = Report::new(
        false,
        &[
            "id",
            "name",
            "zone",
            "address",
            "incarnation",
            "state",
            "chunks",
            "capacity",
            "used",
            "free",
        ],
    );
    for d in &status.data_servers {
        servers.add(
            vec![
                d.id.to_string(),
                d.name.clone(),
                d.zone.clone().unwrap_or_else(|| "-".into()),
                d.address.clone(),
                d.incarnation.to_string(),
                if d.live { "live" } else { "DOWN" }.into(),
                d.chunks.to_string(),
                bytes(d.capacity_bytes),
                bytes(d.used_bytes()),
                bytes(d.free_bytes),
            ],
            &(),
        );
    }
    out += &servers.table();

    out += &format!(
        "\nsessions ({}; {} fenced since the meta server started)\n",
        status.sessions.len(),
        status.fenced_sessions
    );
    let mut sessions = Report::new(
        false,
        &[
            "session",
            "host",
            "pid",
            "peer",
            "age",
            "last heard",
            "fenceable",
            "open files",
        ],
    );
    for s in &status.sessions {
        let host = if s.caller {
            format!("{} (this command)", s.host)
        } else {
            s.host.clone()
        };
        sessions.add(
            vec![
                s.id.to_string(),
                host,
                s.pid.to_string(),
                s.peer.clone(),
                duration(s.age_ms),
                format!("{} ago", duration(s.silent_ms)),
                if s.fenceable { "yes" } else { "no" }.into(),
                s.open_files.to_string(),
            ],
            &(),
        );
    }
    out += &sessions.table();

    out += &format!(
        "\nopen files ({}{})\n",
        status.open_file_count,
        if status.open_file_count > status.open_files.len() as u64 {
            format!("; the {TOP_OPEN_FILES} held by most sessions")
        } else {
            String::new()
        }
    );
    if !status.open_files.is_empty() {
        let mut files = Report::new(false, &["inode", "sessions", "lock", "lock calls"]);
        for f in &status.open_files {
            files.add(
                vec![
                    f.ino.to_string(),
                    f.sessions.to_string(),
                    f.scheme.clone(),
                    f.lock_calls.to_string(),
                ],
                &(),
            );
        }
        out += &files.table();
        out += "lock calls: record locks and lock-tree growth, which reach the meta server as \
                requests; range locks are taken one-sidedly and are not counted\n";
    }
    out
}

/// The `re-replication` line of a status: the pass running (or the last one), the totals and
/// the rate limit.
fn rereplication_line(r: &proto::status::RereplicationStatus) -> String {
    let limit = match r.limit_mib_per_s {
        0 => "no rate limit".to_string(),
        n => format!("limit {n} MiB/s"),
    };
    let pass = if r.running {
        format!(
            "running: {} chunks done, {} left, {} failed, {} copied at {:.1} MiB/s",
            r.done,
            r.left,
            r.failed,
            bytes(r.bytes),
            r.kib_per_s as f64 / 1024.0
        )
    } else if r.done + r.failed > 0 {
        format!(
            "idle; last pass {} chunks done, {} failed, {} copied at {:.1} MiB/s",
            r.done,
            r.failed,
            bytes(r.bytes),
            r.kib_per_s as f64 / 1024.0
        )
    } else {
        "idle".to_string()
    };
    let next = match r.next_pass_in_ms {
        Some(ms) => format!(", next pass in {}", duration(ms)),
        None => String::new(),
    };
    format!(
        "re-replication {pass}{next} ({} chunks since start, {limit})\n",
        r.total_done
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_every_section_aligned() {
        let status = proto::fuzz::sample_status();
        let text = render_table(&status);
        for wanted in [
            "cluster      citronfs",
            "rpc v",
            "up 1h02m",
            "/var/lib/citronfs/meta",
            "last flush 1.5s ago",
            "data servers (1 live of 2)",
            "rack-a",
            "DOWN",
            "64.0 MiB",
            "4.0 MiB",
            "sessions (2; 3 fenced since the meta server started)",
            "citronfs-status (this command)",
            "open files (1)",
            "lock calls",
            "re-replication running: 12 chunks done, 30 left, 1 failed, 12.0 MiB copied at \
             64.0 MiB/s (40 chunks since start, limit 128 MiB/s)",
        ] {
            assert!(text.contains(wanted), "{wanted:?} missing from:\n{text}");
        }
        // Each table's rows are as wide as its header (right-aligned cells, no ragged rows).
        let lines: Vec<&str> = text.lines().collect();
        let header = lines.iter().position(|l| l.starts_with("id ")).unwrap();
        let width = lines[header].len();
        for row in &lines[header + 1..header + 4] {
            assert_eq!(row.len(), width, "{row:?}");
        }
    }

    #[test]
    fn the_json_is_the_status_itself() {
        let status = proto::fuzz::sample_status();
        let json = render_json(&status);
        let back: ClusterStatus = serde_json::from_str(&json).unwrap();
        assert_eq!(back, status);
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(value["data_servers"][0]["free_bytes"], 60 << 20);
        assert_eq!(value["meta"]["database"]["last_flush_ago_ms"], 1500);
    }

    #[test]
    fn durations_and_sizes_read_as_people_write_them() {
        assert_eq!(duration(850), "850ms");
        assert_eq!(duration(4_200), "4.2s");
        assert_eq!(duration(187_000), "3m07s");
        assert_eq!(duration(7_500_000), "2h05m");
        assert_eq!(duration(3 * 86_400_000 + 4 * 3_600_000), "3d04h");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
    }
}
