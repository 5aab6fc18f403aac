//! `citronfs`: the one command a CitronFS user needs.

mod bench;
mod cmd;
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
    /// Start an embedded cluster on this machine (a meta server and data servers, shm fabric by
    /// default) and mount it; Ctrl-C unmounts and stops everything.
    Up(cmd::up::UpArgs),
    /// Run a meta server (namespace, sessions, chunk allocation, file control blocks and locks).
    MetaServer(cmd::roles::MetaArgs),
    /// Run a data server (serves a region of memory, optionally file-backed).
    DataServer(cmd::roles::DataArgs),
    /// Mount a running cluster.
    Mount(cmd::roles::MountArgs),
    /// Run a benchmark and print its figures (a table by default, JSON lines with --json).
    #[command(subcommand)]
    Bench(bench::Bench),
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // The cause chain on one line, no backtrace: these are user-facing errors (a wrong
            // token, a busy mount point), not crashes.
            eprintln!("citronfs: error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CITRONFS_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Cli::parse().command {
        Command::Up(args) => cmd::up::up(args),
        Command::MetaServer(args) => cmd::roles::meta_server(args),
        Command::DataServer(args) => cmd::roles::data_server(args),
        Command::Mount(args) => cmd::roles::mount(args),
        Command::Bench(bench) => bench.run(),
    }
}
