//! `citronfs`: the one command a CitronFS user needs.

mod bench;
mod report;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// CitronFS: a distributed in-memory file system with one-sided range locks (CITRON).
#[derive(Parser)]
#[command(name = "citronfs", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a benchmark and print its figures (a table by default, JSON lines with --json).
    #[command(subcommand)]
    Bench(bench::Bench),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CITRONFS_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Bench(bench) => bench.run(),
    }
}
