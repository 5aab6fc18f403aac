//! One soak client (`citronfs soak-client`, started by `citronfs soak`): a library client of
//! the cluster running the mixed workload until it is killed, journaling every operation
//! (`journal`).
//!
//! The workload, each operation followed by an fsync before it is acknowledged:
//! - record writes to the client's own slots of one shared file (slots are interleaved between
//!   clients, and a record straddles lock units, chunks and data servers, so neighbours'
//!   locks and writes meet in every lock unit at a slot boundary);
//! - creates of private files with patterned contents, renames, truncates and unlinks.
//!
//! A failed operation (EIO while a server restarts) stays unacknowledged and is journaled with
//! its errno (the soak counts them); the file it touched is then left alone, so that each file
//! has at most one uncertain operation for the verifier.

use super::journal::{now_ms, record, Entry, Journal, Op};
use anyhow::{Context, Result};
use clap::Args;
use fs_client::{CitronFs, FileHandle, MountOptions};
use proto::{Ino, SetAttr, ROOT_INO};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;

/// The name of the shared file and of the directory of private files.
pub const SHARED: &str = "shared";
/// The directory of the private files.
pub const DIR: &str = "files";

/// `citronfs soak-client`: internal, started by `citronfs soak`.
#[derive(Args, Debug)]
pub struct ClientArgs {
    /// The meta server's RPC address.
    #[arg(long)]
    pub meta: String,
    /// The cluster's name (the token comes from CITRONFS_TOKEN).
    #[arg(long)]
    pub cluster: String,
    /// This client's number (its slots are those equal to it modulo --clients).
    #[arg(long)]
    pub id: u32,
    /// How many times this client was started before (sequence numbers and file names of each
    /// life differ).
    #[arg(long)]
    pub life: u32,
    /// How many clients the soak runs.
    #[arg(long)]
    pub clients: u32,
    /// Slots in the shared file.
    #[arg(long)]
    pub slots: u32,
    /// The journal to append to.
    #[arg(long)]
    pub journal: PathBuf,
    /// Seed of the random choices.
    #[arg(long)]
    pub seed: u64,
}

/// A private file this life of the client may still touch.
struct Private {
    name: String,
    len: u64,
}

/// Runs the workload until killed (or a setup step fails).
pub fn run(args: ClientArgs) -> Result<()> {
    let token = std::env::var(crate::cmd::config::TOKEN_ENV)
        .context("the soak client takes the token from the environment")?;
    // A client started while the soak restarts the meta server waits for it, as the rest of
    // its setup does.
    let fs = retry(|| CitronFs::connect(MountOptions::new(&args.meta, &args.cluster, &token)))?;
    let me = CitronFs::process_caller();
    let mut journal = Journal::create(&args.journal)?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let dir = retry(|| fs.lookup(ROOT_INO, DIR).map(|a| a.ino))?;
    let shared = retry(|| {
        let ino = fs.lookup(ROOT_INO, SHARED)?.ino;
        fs.open(me, ino, libc::O_RDWR)
    })?;
    let mine: Vec<u32> = (0..args.slots)
        .filter(|s| s % args.clients == args.id)
        .collect();
    let mut seq = u64::from(args.life) << 32;
    let mut files: Vec<Private> = Vec::new();
    let mut next_file = 0u64;
    loop {
        let choice = rng.random_range(0..100);
        let op = if choice < 60 || (files.is_empty() && choice >= 75) {
            seq += 1;
            Op::Write {
                slot: mine[rng.random_range(0..mine.len())],
                seq,
            }
        } else if choice < 75 {
            next_file += 1;
            Op::Create {
                name: format!("c{}.{}.{next_file}", args.id, args.life),
                seed: rng.random(),
                len: rng.random_range(1..=200_000),
            }
        } else {
            let i = rng.random_range(0..files.len());
            let f = &files[i];
            match choice {
                75..=83 => Op::Rename {
                    from: f.name.clone(),
                    to: format!("{}.r", f.name),
                },
                84..=91 => Op::Truncate {
                    name: f.name.clone(),
                    len: rng.random_range(0..=f.len),
                },
                _ => Op::Unlink {
                    name: f.name.clone(),
                },
            }
        };
        journal.log(&Entry::Intent(op.clone()))?;
        let done = apply(&fs, me, dir, shared, args.id, &op);
        // The file an operation touched is left alone from now on unless it was acknowledged
        // (at most one uncertain operation per file).
        let touched = match &op {
            Op::Write { .. } | Op::Create { .. } => None,
            Op::Rename { from, .. } => Some(from),
            Op::Truncate { name, .. } | Op::Unlink { name } => Some(name),
        };
        if let Some(name) = touched {
            files.retain(|f| &f.name != name);
        }
        match done {
            Ok(()) => {
                journal.log(&Entry::Ack(op.clone(), now_ms()))?;
                match op {
                    Op::Create { name, len, .. } => files.push(Private { name, len }),
                    Op::Rename { to, .. } => files.push(Private {
                        name: to.clone(),
                        // Renamed files are only renamed again or removed, never truncated
                        // against a stale length: re-read it.
                        len: fs.lookup(dir, &to).map(|a| a.size).unwrap_or_default(),
                    }),
                    Op::Truncate { name, len } => files.push(Private { name, len }),
                    Op::Write { .. } | Op::Unlink { .. } => {}
                }
            }
            Err(error) => {
                eprintln!("soak client {}: {op}: {error}", args.id);
                journal.log(&Entry::Failed(op, error.errno()))?;
            }
        }
    }
}

/// Does `op`, then makes it durable (an fsync: of the file written, else of the shared file,
/// which flushes the namespace too).
fn apply(
    fs: &CitronFs,
    me: proto::Caller,
    dir: Ino,
    shared: FileHandle,
    id: u32,
    op: &Op,
) -> Result<(), fs_client::Error> {
    match op {
        Op::Write { slot, seq } => {
            let r = record(*slot, id, *seq);
            fs.write(shared, u64::from(*slot) * r.len() as u64, &r)?;
            fs.fsync(shared)
        }
        Op::Create { name, seed, len } => {
            let (_, fh) = fs.create(me, dir, name, 0o644, libc::O_RDWR | libc::O_EXCL)?;
            let data = cluster::pattern(*seed, 0, *len as usize);
            let result = fs.write(fh, 0, &data).and_then(|_| fs.fsync(fh));
            let _ = fs.release(fh);
            result
        }
        Op::Rename { from, to } => {
            fs.rename(dir, from, dir, to, true)?;
            fs.fsync(shared)
        }
        Op::Truncate { name, len } => {
            let ino = fs.lookup(dir, name)?.ino;
            let set = SetAttr {
                size: Some(*len),
                ..SetAttr::default()
            };
            fs.setattr(me, ino, set)?;
            fs.fsync(shared)
        }
        Op::Unlink { name } => {
            fs.unlink(dir, name)?;
            fs.fsync(shared)
        }
    }
}

/// Retries a setup step while the cluster restarts a server (each call already waits a
/// bounded time), for up to a minute.
fn retry<T>(mut f: impl FnMut() -> Result<T, fs_client::Error>) -> Result<T> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("soak client setup: {e}; retrying");
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            Err(e) => return Err(anyhow::anyhow!("soak client setup: {e}")),
        }
    }
}
