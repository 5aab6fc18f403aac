//! `citronfs`: the one command a CitronFS user needs. The binary (`src/main.rs`) calls [`main`];
//! with the `fuzzing` feature the library also gives the fuzz targets of `fuzz/` the entry of
//! the roles' settings files (`fuzz_config_file`).

mod bench;
mod cmd;
mod plot;
mod report;
mod soak;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use cmd::config::{init_logging, log_from_env};
use cmd::roles::SETTINGS_HELP;

/// The fuzz entry of the roles' `--config` files (the `config_file` target of `fuzz/`).
#[cfg(feature = "fuzzing")]
pub use cmd::roles::fuzz_config_file;

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
    #[command(after_help = SETTINGS_HELP)]
    MetaServer(cmd::roles::MetaArgs),
    /// Run a data server (serves a region of memory, optionally file-backed). It registers with
    /// the meta server, waiting up to 60 s for one that is not up yet or restarting (a wrong
    /// token or cluster fails at once), and registers again whenever the meta server restarts.
    #[command(after_help = SETTINGS_HELP)]
    DataServer(cmd::roles::DataArgs),
    /// Mount a running cluster.
    #[command(after_help = SETTINGS_HELP)]
    Mount(cmd::roles::MountArgs),
    /// The mount(8) helper: mount SPEC (the meta server's HOST:PORT) at DIR as mount(8) calls
    /// a helper, returning once the mount is up and serving it from a background process until
    /// `umount DIR`. The binary runs this when invoked as mount.citronfs or
    /// mount.fuse.citronfs: symlink it as /sbin/mount.citronfs (and /sbin/mount.fuse.citronfs)
    /// and `mount -t citronfs HOST:PORT DIR -o token_file=PATH`, or an fstab line, mounts.
    /// Exit status 0 mounted, 1 wrong invocation, 32 mount failure.
    MountHelper(cmd::helper::HelperArgs),
    /// Run a benchmark and print its figures (a table by default, JSON lines with --json).
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Check a cluster's namespace, chunk allocation and locks for consistency (and repair
    /// what can be repaired); exit status 0 clean, 1 findings, 2 error.
    #[command(after_help = SETTINGS_HELP)]
    Fsck(cmd::fsck::FsckArgs),
    /// Show a running cluster: the meta server, every data server (live or not, capacity),
    /// the client sessions (host, age, when last heard, fenceable), and the open files. Tables
    /// by default, one JSON object with --json. Asks the meta server over its own client
    /// session (listed as this command's); opens no file.
    #[command(after_help = SETTINGS_HELP)]
    Status(cmd::status::StatusArgs),
    /// Run a cluster of processes under a mixed workload while killing and restarting clients
    /// and servers at random, then verify every file against what the clients acknowledged.
    Soak(soak::SoakArgs),
    /// One client of `citronfs soak` (started by it).
    #[command(hide = true)]
    SoakClient(soak::client::ClientArgs),
}

/// The `citronfs` command: parses the command line (or mount(8)'s, when the binary is invoked
/// as its helper) and runs it; the exit status to return.
pub fn main() -> std::process::ExitCode {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Invoked as mount(8)'s helper (a symlink named mount.citronfs): `citronfs mount-helper`.
    let invoked_as = argv
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .filter(|n| cmd::helper::HELPER_NAMES.contains(&n.as_str()));
    if invoked_as.is_some() {
        argv.splice(0..1, ["citronfs".into(), "mount-helper".into()]);
    }
    let matches = command().try_get_matches_from(argv).unwrap_or_else(|e| {
        // mount(8)'s status for a wrong invocation is 1, clap's 2.
        if invoked_as.is_some() && e.use_stderr() {
            let _ = e.print();
            std::process::exit(i32::from(cmd::helper::EXIT_USAGE));
        }
        e.exit()
    });
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // fsck and the mount helper have exit statuses of their own.
    let command = match cli.command {
        Command::Fsck(args) => return cmd::fsck::fsck(args),
        Command::MountHelper(args) => {
            let name = invoked_as.unwrap_or_else(|| "citronfs mount-helper".into());
            return cmd::helper::run(args, &name);
        }
        other => other,
    };
    match run(command) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // The cause chain on one line, no backtrace: these are user-facing errors (a wrong
            // token, a busy mount point), not crashes.
            eprintln!("citronfs: error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The command line, with the roles' defaults (and the log filter's) shown in `--help`.
fn command() -> clap::Command {
    cmd::roles::show_role_defaults(Cli::command())
        .mut_subcommand(
            "status",
            cmd::config::show_defaults::<cmd::config::AskConfig>,
        )
        .after_help(format!(
        "Logging: --log on the roles; {} for every command: a level (error, warn, info, debug, \
         trace) or a tracing filter such as info,meta_server=debug [default: {}].",
        cmd::config::LOG_ENV,
        cmd::config::DEFAULT_LOG
    ))
}

fn run(command: Command) -> Result<()> {
    // The roles start logging once their settings (`log` among them) are layered; the other
    // commands take the filter from the environment.
    match command {
        Command::Up(args) => {
            init_logging(&log_from_env())?;
            cmd::up::up(args)
        }
        Command::MetaServer(args) => cmd::roles::meta_server(args),
        Command::DataServer(args) => cmd::roles::data_server(args),
        Command::Mount(args) => cmd::roles::mount(args),
        Command::MountHelper(_) => unreachable!("run by main"),
        Command::Bench(bench) => {
            init_logging(&log_from_env())?;
            bench.run()
        }
        Command::Fsck(args) => match cmd::fsck::fsck(args) {
            code if code == std::process::ExitCode::SUCCESS => Ok(()),
            _ => anyhow::bail!("fsck found problems"),
        },
        Command::Status(args) => cmd::status::status(args),
        Command::Soak(args) => {
            init_logging(&log_from_env())?;
            soak::run(args)
        }
        Command::SoakClient(args) => {
            init_logging(&log_from_env())?;
            soak::client::run(args)
        }
    }
}
