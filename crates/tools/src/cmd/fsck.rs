//! `citronfs fsck`: asks a running meta server to check its namespace, chunk allocation and
//! (at rest) its open files' locks (`Request::Fsck`; the checker is `meta_server::fsck`), or
//! checks a stopped meta server's database directly (`--db`), and prints what it found: an
//! aligned table by default, one JSON object per finding (and per repair) with `--json`.
//!
//! Exit status: 0 when nothing was found, 1 when something was (whether or not `--repair`
//! fixed it: the repairs are listed, and what a second check still finds), 2 when the check
//! could not run.

use super::config::{init_logging, require_token, AskConfig, CommonArgs, RoleArgs};
use crate::report::Report;
use anyhow::{Context, Result};
use clap::Args;
use proto::fsck::{Finding, FsckOptions, FsckReport};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;

/// Flags of `citronfs fsck`.
#[derive(Args, Debug, Default, Serialize)]
pub struct FsckArgs {
    #[command(flatten)]
    #[serde(flatten)]
    common: CommonArgs,
    /// The meta server's RPC address.
    #[arg(long)]
    meta: Option<String>,
    /// Repair what can be repaired (dangling entries, link counts, unreachable inodes, leaked
    /// chunks, broken free stacks, replicas that differ from their chunk's first live replica;
    /// with --at-rest, lock words dead clients left), then check again.
    #[arg(long)]
    #[serde(skip)]
    repair: bool,
    /// No read, write or truncate is in flight on any client: also check that every open
    /// file's lock is at rest and its chunks are within the size in its control block (on by
    /// itself when no other client is connected).
    #[arg(long)]
    #[serde(skip)]
    at_rest: bool,
    /// Check the database of a stopped meta server in this directory instead of asking a
    /// running one (no token needed: it is a local file).
    #[arg(long, conflicts_with = "meta")]
    #[serde(skip)]
    db: Option<PathBuf>,
    /// One JSON object per finding and per repair instead of a table.
    #[arg(long)]
    #[serde(skip)]
    json: bool,
}

impl RoleArgs for FsckArgs {
    type Config = AskConfig;
    fn common(&self) -> &CommonArgs {
        &self.common
    }
}

/// Runs `citronfs fsck`; the exit status is the module docs'.
pub fn fsck(args: FsckArgs) -> ExitCode {
    match run(&args) {
        Ok(report) => {
            print(&report, args.json);
            if report.clean() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(error) => {
            eprintln!("citronfs fsck: error: {error:#}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &FsckArgs) -> Result<FsckReport> {
    let settings = args.load()?;
    init_logging(&settings.log)?;
    if let Some(db) = &args.db {
        return meta_server::fsck::check_offline(db, args.repair)
            .with_context(|| format!("checking the database in {}", db.display()));
    }
    let credentials = fabric::Credentials::new(
        settings.cluster,
        require_token(settings.token, settings.token_file.as_deref())?,
    );
    let options = FsckOptions {
        repair: args.repair,
        at_rest: args.at_rest,
    };
    meta_server::fsck::request(&settings.meta, &credentials, options, "citronfs-fsck")
}

/// One finding as a JSON object: its kind, inode, sentence, and its fields.
fn finding_json(finding: &Finding, phase: &str) -> serde_json::Value {
    serde_json::json!({
        "phase": phase,
        "kind": finding.kind(),
        "ino": finding.ino(),
        "message": finding.to_string(),
        "detail": finding,
    })
}

fn print(report: &FsckReport, json: bool) {
    let mut table = Report::new(json, &["finding", "inode", "what"]);
    let mut add = |finding: &Finding, phase: &str| {
        table.add(
            vec![
                finding.kind().to_string(),
                finding.ino().map_or("-".into(), |i| i.to_string()),
                finding.to_string(),
            ],
            &finding_json(finding, phase),
        )
    };
    for finding in &report.findings {
        add(finding, "found");
    }
    if !report.findings.is_empty() {
        table.finish();
    }
    for repair in &report.repairs {
        if json {
            println!(
                "{}",
                serde_json::json!({ "phase": "repaired", "message": repair.to_string(), "detail": repair })
            );
        } else {
            println!("repaired: {repair}");
        }
    }
    if let Some(remaining) = &report.remaining {
        for finding in remaining {
            if json {
                println!("{}", finding_json(finding, "remaining"));
            } else {
                println!("still found after repair: {finding}");
            }
        }
    }
    for (ino, why) in &report.replicas_not_compared {
        if json {
            println!(
                "{}",
                serde_json::json!({ "phase": "not-compared", "ino": ino, "message": why })
            );
        } else {
            println!("replicas not compared: inode {ino}: {why}");
        }
    }
    let c = report.counts;
    let summary = format!(
        "checked {} inodes, {} entries, {} chunk-map entries on {} data servers, {} open files \
         of {} other sessions, {} open-file locks ({}), {} replicated chunks compared ({} \
         files not compared), {} under-replicated chunks: {} findings{}{}",
        c.inodes,
        c.entries,
        c.chunks,
        c.servers,
        c.open_files,
        c.sessions,
        c.locks,
        if report.at_rest {
            "at rest"
        } else {
            "not checked: clients active, no --at-rest"
        },
        c.replicated_chunks,
        report.replicas_not_compared.len(),
        c.under_replicated,
        report.findings.len() as u64 + report.truncated,
        if report.truncated > 0 {
            format!(" ({} not listed)", report.truncated)
        } else {
            String::new()
        },
        match &report.remaining {
            Some(left) => format!(
                ", {} repairs, {} remaining",
                report.repairs.len(),
                left.len()
            ),
            None => String::new(),
        }
    );
    // The summary is for people: on stderr when stdout carries JSON.
    if json {
        eprintln!("{summary}");
    } else {
        println!("{summary}");
    }
}
