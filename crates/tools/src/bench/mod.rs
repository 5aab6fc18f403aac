//! `citronfs bench`: workloads that print figures.

pub mod fabric;
pub mod false_conflicts;
pub mod fs;
pub mod locks;
pub mod meta;

use anyhow::Result;
use clap::Subcommand;

/// The benchmarks.
#[derive(Subcommand)]
pub enum Bench {
    /// Round-trip time and batched verb throughput of every fabric backend, with a bare TCP
    /// ping-pong of the same message sizes as the reference.
    Fabric(fabric::FabricArgs),
    /// Range-lock schemes side by side (CITRON against the baselines): locks granted per second,
    /// acquire latency, aborts, round trips per acquire and release, CPU per lock.
    Locks(locks::LocksArgs),
    /// False conflicts of CITRON's range split (seed 000 Fig. 11: k = 1, 2, 3, L up to 4096) or,
    /// with --pattern, of a lock unit size under an application's access pattern.
    FalseConflicts(false_conflicts::FalseConflictsArgs),
    /// The file system against tmpfs in one run: sequential 1 MiB and random 4 KiB reads and
    /// writes, 1 and 4 threads on a shared file, on an embedded cluster's FUSE mount and on
    /// /dev/shm, with the ratios.
    Fs(fs::FsArgs),
    /// Metadata operations against tmpfs in one run: create, stat, open+close and unlink per
    /// second through an embedded cluster's FUSE mount and on /dev/shm, 1 and 4 threads, with
    /// the ratios and the meta server's requests per operation.
    Meta(meta::MetaArgs),
}

impl Bench {
    /// Runs the chosen benchmark.
    pub fn run(self) -> Result<()> {
        match self {
            Bench::Fabric(args) => fabric::run(&args),
            Bench::Locks(args) => locks::run(&args),
            Bench::FalseConflicts(args) => false_conflicts::run(&args),
            Bench::Fs(args) => fs::run(&args),
            Bench::Meta(args) => meta::run(&args),
        }
    }
}
