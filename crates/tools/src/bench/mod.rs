//! `citronfs bench`: workloads that print figures.

pub mod btio;
pub mod clients;
pub mod compare;
pub mod fabric;
pub mod false_conflicts;
pub mod fs;
pub mod io500_hard;
pub mod locks;
pub mod meta;
pub mod oltp;
pub mod rereplicate;
pub(crate) mod runner;

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
    /// False conflicts of CITRON's range split (CITRON Fig. 11: k = 1, 2, 3, L up to 4096) or,
    /// with --pattern, of a lock unit size under an application's access pattern.
    FalseConflicts(false_conflicts::FalseConflictsArgs),
    /// The file system against tmpfs in one run: sequential 1 MiB and random 4 KiB reads and
    /// writes, 1 and 4 threads on a shared file, on an embedded cluster's FUSE mount and on
    /// /dev/shm, with the ratios.
    Fs(fs::FsArgs),
    /// CitronFS (shm and tcp fabrics) against tmpfs, a GlusterFS volume and a MooseFS cluster
    /// in one run: the fio jobs of bench/fio/ (IO500-hard-like, BT-IO-like, OLTP-like, 1 MiB
    /// sequential write and read) and a metadata pass (create, stat, unlink), with the ratios.
    /// The peers are set up from Debian's packages by bench/peers/ and torn down afterwards.
    /// --replicas N keeps N copies of the data on each (CitronFS replicas, GlusterFS replica
    /// bricks, MooseFS chunkservers and goal).
    Compare(compare::CompareArgs),
    /// The NPB BT-IO output pattern (CITRON §4.3.1): P processes on a square grid write
    /// their rows of every output step into one shared file as interleaved, non-conflicting
    /// records, over C client processes (or library instances); every lock scheme in one run,
    /// the data read back and verified; bandwidth, p99 and the ratios to citron.
    Btio(btio::BtioArgs),
    /// The distributed Filebench OLTP of CITRON §4.3.2 (Table 2): per client 1 log writer,
    /// 10 data writers and 50 readers on 10 data files and a log of 10 MB, 8 KiB random I/O;
    /// every lock scheme in one run, every read checked whole; throughput and reader/writer p99.
    Oltp(oltp::OltpArgs),
    /// IO500's IOR hard-write pattern, lock-only (CITRON §4.5, Fig. 10): 47008 B records
    /// interleaved by rank, replayed as locks by one thread per rank — CITRON scaling up from a
    /// small tree against a preallocated tree and the baselines, with throughput over time and
    /// each scale-up's duration; records or replays a trace file.
    Io500Hard(io500_hard::Io500HardArgs),
    /// Metadata operations against tmpfs in one run: create, stat, open+close and unlink per
    /// second through an embedded cluster's FUSE mount and on /dev/shm, 1 and 4 threads, with
    /// the ratios and the meta server's requests per operation.
    Meta(meta::MetaArgs),
    /// Re-replication's speed: a data server of an embedded cluster (3 data servers, 2
    /// replicas) restarted with new memory under --size MiB of files, the meta server's copy of
    /// the chunks it lost timed for each rate limit of --rates (MiB/s, 0: none), then checked.
    Rereplicate(rereplicate::RereplicateArgs),
}

impl Bench {
    /// Runs the chosen benchmark.
    pub fn run(self) -> Result<()> {
        match self {
            Bench::Fabric(args) => fabric::run(&args),
            Bench::Locks(args) => locks::run(&args),
            Bench::FalseConflicts(args) => false_conflicts::run(&args),
            Bench::Fs(args) => fs::run(&args),
            Bench::Compare(args) => compare::run(&args),
            Bench::Btio(args) => btio::run(&args),
            Bench::Oltp(args) => oltp::run(&args),
            Bench::Io500Hard(args) => io500_hard::run(&args),
            Bench::Meta(args) => meta::run(&args),
            Bench::Rereplicate(args) => rereplicate::run(&args),
        }
    }
}
