//! `citronfs bench rereplicate`: how fast the meta server re-replicates the chunks a data
//! server lost (docs/REPLICAS.md).
//!
//! Per rate limit asked (`--rates`, MiB/s, 0: none), the run starts an embedded cluster of
//! three memory-backed data servers with a replication factor of 2 and the server's default
//! chunk size, writes `--size` MiB of files through the client library, then restarts one data
//! server: it comes back with new memory, its replicas are marked lost, and after the grace
//! (100 ms here) the meta server gives every chunk it held a new replica, copied from the live
//! one under the file's range lock, a chunk at a time. The row says how many chunks and bytes
//! the pass copied, how long it took and at what speed (the meta server's own measure, from the
//! pass's start to its end), with the limit. A check at the end (`fsck`) must find every chunk
//! with two live replicas holding the same bytes.

use super::runner::Run;
use crate::report::{fmt_f, Report};
use anyhow::{bail, Context, Result};
use clap::Args;
use cluster::{Cluster, ClusterSpec};
use fabric::Backend;
use serde::Serialize;
use std::time::{Duration, Instant};

/// Flags of `citronfs bench rereplicate`.
#[derive(Args, Debug)]
pub struct RereplicateArgs {
    /// MiB of file data written before a data server is restarted (each byte is kept twice).
    #[arg(long, default_value_t = 64)]
    size: u64,
    /// Rate limits to measure, in MiB/s, comma-separated (0: none).
    #[arg(long, value_delimiter = ',', default_value = "0,64")]
    rates: Vec<u64>,
    /// The fabric between the meta server and the data servers.
    #[arg(long, value_enum, default_value = "tcp")]
    fabric: Backend,
    /// Print the rows as JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

/// One measured pass.
#[derive(Serialize)]
struct Row {
    fabric: String,
    limit_mib_per_s: u64,
    chunk_bytes: u64,
    chunks: u64,
    mib: f64,
    seconds: f64,
    mib_per_s: f64,
}

/// Runs the benchmark.
pub fn run(args: &RereplicateArgs) -> Result<()> {
    let run = Run::start(args.json, args.rates.len() as u64)?;
    let mut report = Report::new(
        args.json,
        &[
            "fabric",
            "limit MiB/s",
            "chunk",
            "chunks",
            "MiB copied",
            "seconds",
            "MiB/s",
        ],
    );
    for &rate in &args.rates {
        run.check()?;
        run.say(format!("rate limit {rate} MiB/s"));
        let row = measure(args, rate, &run)?;
        report.add(
            vec![
                row.fabric.clone(),
                match rate {
                    0 => "none".into(),
                    n => n.to_string(),
                },
                format!("{} KiB", row.chunk_bytes >> 10),
                row.chunks.to_string(),
                fmt_f(row.mib, 1),
                fmt_f(row.seconds, 2),
                fmt_f(row.mib_per_s, 1),
            ],
            &row,
        );
        run.advance();
    }
    run.finish();
    report.finish();
    Ok(())
}

/// One cluster, one restart, one pass at `rate` MiB/s.
fn measure(args: &RereplicateArgs, rate: u64, run: &Run) -> Result<Row> {
    let spec = ClusterSpec::server_defaults();
    let chunk = spec.chunk_size;
    // Each server holds two thirds of the data's replicas, and the restarted one all it held
    // again: room for the whole size each, and some.
    let capacity = (args.size << 20) + 8 * chunk;
    let mut cluster = Cluster::start(ClusterSpec {
        name: "citronfs-bench-rereplicate".into(),
        data_servers: 3,
        capacity,
        fabric: args.fabric,
        replicas: 2,
        rereplicate_mib_s: rate,
        rereplicate_after: Duration::from_millis(100),
        ..spec
    })
    .context("starting the cluster")?;
    let fs = cluster.client().context("a client")?;
    let me = fs_client::CitronFs::process_caller();
    let file_bytes = 16 << 20;
    let mut left = args.size << 20;
    let mut i = 0;
    let data = vec![0xA5u8; 1 << 20];
    while left > 0 {
        run.check()?;
        let (_, fh) = fs
            .create(me, proto::ROOT_INO, &format!("f{i}"), 0o644, libc::O_RDWR)
            .map_err(|e| anyhow::anyhow!("create: {e}"))?;
        let n = left.min(file_bytes);
        for at in (0..n).step_by(data.len()) {
            let len = (n - at).min(data.len() as u64) as usize;
            fs.write(fh, at, &data[..len])
                .map_err(|e| anyhow::anyhow!("write: {e}"))?;
        }
        fs.release(fh)
            .map_err(|e| anyhow::anyhow!("release: {e}"))?;
        left -= n;
        i += 1;
    }
    drop(fs);
    cluster
        .restart_data_server(2)
        .context("restarting a data server")?;
    let started = Instant::now();
    let status = loop {
        run.check()?;
        let status = status(&cluster)?;
        let r = &status.rereplication;
        if !r.running && r.total_done > 0 && r.left == 0 {
            break status;
        }
        if started.elapsed() > Duration::from_secs(3600) {
            bail!("re-replication did not finish within an hour: {r:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let r = status.rereplication;
    let report = cluster
        .fsck(proto::fsck::FsckOptions::default())
        .context("fsck")?;
    if !report.clean() || report.counts.under_replicated > 0 || r.failed > 0 {
        bail!(
            "after re-replication: {} under-replicated, {} failed, findings {:#?}",
            report.counts.under_replicated,
            r.failed,
            report.findings
        );
    }
    let mib = r.bytes as f64 / f64::from(1 << 20);
    let mib_per_s = r.kib_per_s as f64 / 1024.0;
    Ok(Row {
        fabric: format!("{:?}", args.fabric).to_lowercase(),
        limit_mib_per_s: rate,
        chunk_bytes: chunk,
        chunks: r.done,
        mib,
        seconds: if mib_per_s > 0.0 {
            mib / mib_per_s
        } else {
            0.0
        },
        mib_per_s,
    })
}

/// The cluster's status.
fn status(cluster: &Cluster) -> Result<proto::status::ClusterStatus> {
    let client = cluster.rpc_client()?;
    match client.call(proto::rpc::Request::Status) {
        Ok(Ok(proto::rpc::Response::Status(status))) => Ok(*status),
        other => bail!("status: {other:?}"),
    }
}
