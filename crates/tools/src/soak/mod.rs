//! `citronfs soak`: a cluster of real processes — a meta server, data servers (two file-backed
//! ones by default) and several clients — running a mixed workload while the soak kills
//! (SIGKILL) and restarts clients and servers at random; at the end it verifies every file
//! against what the clients acknowledged, runs `fsck --at-rest`, and prints what it did and
//! what it found, with the operations that failed (EIO and others).
//!
//! The parts: `client` (the workload, `citronfs soak-client`), `journal` (records and the
//! intent/acknowledgement journal), `verify` (the verdict). This module is the supervisor.
//!
//! The data servers are file-backed by default, so a kill loses no acknowledged data by the file
//! system's promise (docs/RELIABILITY.md). With `--memory-only` they keep data in memory only
//! and come back empty: only replicas (`--replicas 2` or more) keep the data then, so a data
//! server is killed only while no chunk is under-replicated (asked of `fsck`), as the promise
//! of replicas is to outlive one server at a time. Clients are library clients (no FUSE mount
//! to clean up after each kill).

pub mod client;
pub mod journal;
pub mod verify;

use crate::report::Report;
use anyhow::{bail, Context, Result};
use clap::Args;
use fabric::Backend;
use fs_client::{CitronFs, MountOptions};
use proto::ROOT_INO;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CLUSTER: &str = "soak";
/// Slots of the shared file per client.
const SLOTS_PER_CLIENT: u32 = 16;

/// `citronfs soak`.
#[derive(Args, Debug)]
pub struct SoakArgs {
    /// How long the workload runs under faults, in minutes (fractions allowed).
    #[arg(long, default_value_t = 1.0)]
    pub minutes: f64,
    /// Client processes.
    #[arg(long, default_value_t = 3)]
    pub clients: u32,
    /// The fabric between clients and servers (`shm` or `tcp`).
    #[arg(long, value_enum, default_value_t = Backend::Tcp)]
    pub fabric: Backend,
    /// Mean seconds between two kills (exponentially distributed).
    #[arg(long, default_value_t = 3.0)]
    pub kill_every: f64,
    /// What the soak kills: any of `client`, `meta`, `data`, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [Kind::Client, Kind::Meta, Kind::Data])]
    pub kill: Vec<Kind>,
    /// Data servers (default: 2, or one more than `--replicas` when that is 2 or more, so that
    /// a killed server's chunks have somewhere to be re-replicated).
    #[arg(long)]
    pub data_servers: Option<usize>,
    /// The cluster's replication factor (`meta-server --replicas`).
    #[arg(long, default_value_t = 1)]
    pub replicas: u32,
    /// Data servers keep data in memory only (no backing file): a killed one comes back empty.
    /// Needs `--replicas 2` or more when data servers are killed.
    #[arg(long)]
    pub memory_only: bool,
    /// Fail (exit non-zero) when any operation returned EIO, besides lost, torn or unexpected
    /// data: what replicas promise for data-server kills (meta-server kills stall clients
    /// until it is back, which may surface errors).
    #[arg(long)]
    pub fail_on_eio: bool,
    /// Seed of the random choices (kills, workloads); random by default, printed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep the soak's directory (journals, logs, database, regions) and print where it is; a
    /// soak whose verification fails keeps it anyway.
    #[arg(long)]
    pub keep: bool,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// What the soak may kill (`--kill`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Client processes.
    Client,
    /// The meta server.
    Meta,
    /// Data servers.
    Data,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Client => "client",
            Kind::Meta => "meta",
            Kind::Data => "data",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Meta,
    Data(usize),
    Client(u32),
}

/// A process of the soak cluster, killed on drop.
struct Proc {
    role: Role,
    child: Option<Child>,
    /// How many times it was started.
    lives: u32,
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What the soak did.
#[derive(Debug, Default, Serialize)]
struct Done {
    seed: u64,
    fabric: String,
    seconds: f64,
    clients: u32,
    data_servers: usize,
    replicas: u32,
    memory_only: bool,
    kills_client: u64,
    kills_meta: u64,
    kills_data: u64,
    /// Data-server kills left out because some chunk was under-replicated then (memory-only
    /// data servers: a second loss before re-replication ends loses data by design).
    data_kills_skipped: u64,
    /// Clients that exited on their own (and were started again).
    client_exits: u64,
    /// When a server was last started again (ms since the Unix epoch; 0: never).
    last_server_restart_ms: u64,
}

struct Soak {
    exe: PathBuf,
    dir: PathBuf,
    shm: PathBuf,
    token: String,
    listen: SocketAddr,
    fabric: Backend,
    clients: u32,
    replicas: u32,
    memory_only: bool,
    rng: StdRng,
    procs: Vec<Proc>,
}

impl Soak {
    fn command(&self, role: Role, life: u32, seed: u64) -> Command {
        let mut cmd = Command::new(&self.exe);
        // The processes log warnings to their files in the soak directory, or what
        // CITRONFS_LOG asks for (`info` shows registrations, scrubs and reconnections).
        let log = std::env::var(crate::cmd::config::LOG_ENV).unwrap_or_else(|_| "warn".into());
        cmd.env(crate::cmd::config::TOKEN_ENV, &self.token)
            .env(crate::cmd::config::LOG_ENV, log)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let fabric = match self.fabric {
            Backend::Shm => "shm",
            _ => "tcp",
        };
        match role {
            Role::Meta => {
                cmd.args(["meta-server", "--cluster", CLUSTER, "--fabric", fabric])
                    .args(["--replicas", &self.replicas.to_string()])
                    // A killed memory-only server's chunks are re-replicated a second after
                    // it went down, not after the default grace: the soak kills often.
                    .args(["--rereplicate-after", "1"])
                    .args([
                        "--chunk-size",
                        &verify::CHUNK.to_string(),
                        "--region-size",
                        "64M",
                    ])
                    .arg("--listen")
                    .arg(self.listen.to_string())
                    .arg("--db")
                    .arg(self.dir.join("meta-db"))
                    .arg("--region-dir")
                    .arg(self.shm.join("meta"));
            }
            Role::Data(i) => {
                cmd.args(["data-server", "--cluster", CLUSTER, "--fabric", fabric])
                    // 128 MiB per copy of the data: every replica takes the space again (a
                    // 10-minute soak of 3 clients at replicas 2 filled 3 servers of 128 MiB).
                    .args(["--name", &format!("ds-{i}")])
                    .args(["--capacity", &format!("{}M", 128 * self.replicas)])
                    .arg("--meta")
                    .arg(self.listen.to_string());
                if self.memory_only {
                    cmd.arg("--region-dir")
                        .arg(self.shm.join(format!("ds-{i}")));
                } else {
                    let backing = self.dir.join(format!("ds-{i}"));
                    cmd.arg("--backing-dir")
                        .arg(&backing)
                        .arg("--region-dir")
                        .arg(&backing);
                }
            }
            Role::Client(id) => {
                cmd.args(["soak-client", "--cluster", CLUSTER])
                    .arg("--meta")
                    .arg(self.listen.to_string())
                    .args(["--id", &id.to_string(), "--life", &life.to_string()])
                    .args(["--clients", &self.clients.to_string()])
                    .args(["--slots", &(self.clients * SLOTS_PER_CLIENT).to_string()])
                    .arg("--journal")
                    .arg(self.dir.join(format!("journal-{id}-{life}")))
                    .args(["--seed", &seed.to_string()]);
            }
        }
        cmd
    }

    fn log_file(&self, role: Role) -> Result<std::fs::File> {
        let name = match role {
            Role::Meta => "meta.log".to_string(),
            Role::Data(i) => format!("ds-{i}.log"),
            Role::Client(id) => format!("client-{id}.log"),
        };
        Ok(std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(name))?)
    }

    /// Starts process `i` of `procs` (again).
    fn start(&mut self, i: usize) -> Result<()> {
        let role = self.procs[i].role;
        let life = self.procs[i].lives;
        // Each life of a client gets its own seed.
        let seed: u64 = self.rng.random();
        let mut cmd = self.command(role, life, seed);
        cmd.stderr(self.log_file(role)?);
        let child = cmd.spawn().with_context(|| format!("start {role:?}"))?;
        let p = &mut self.procs[i];
        p.child = Some(child);
        p.lives += 1;
        if role == Role::Meta {
            self.wait_for_meta()?;
        }
        Ok(())
    }

    fn wait_for_meta(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(self.listen).is_err() {
            if let Some(status) = self.procs[0]
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "the meta server exited ({status}); see {}",
                    self.dir.join("meta.log").display()
                );
            }
            if Instant::now() > deadline {
                bail!("the meta server did not listen within a minute");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Waits until `count` data servers are live at the meta server (at most a minute).
    fn wait_for_data_servers(&self, count: usize) -> Result<()> {
        let credentials = fabric::Credentials::new(CLUSTER.to_string(), self.token.clone());
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let live = crate::cmd::status::request(&self.listen.to_string(), &credentials)
                .map(|s| s.data_servers.iter().filter(|d| d.live).count())
                .unwrap_or(0);
            if live >= count {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{live} of {count} data servers registered within a minute");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether no chunk is under-replicated now (`fsck`'s count; a failed check counts as
    /// not): waits up to [`REPLICATED_WAIT`] for re-replication to end.
    fn fully_replicated(&self) -> Result<bool> {
        let deadline = Instant::now() + REPLICATED_WAIT;
        loop {
            let options = proto::fsck::FsckOptions {
                repair: false,
                at_rest: false,
            };
            let under = fsck(self, options)
                .map(|r| r.counts.under_replicated)
                .unwrap_or(u64::MAX);
            if under == 0 {
                return Ok(true);
            }
            if Instant::now() > deadline {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.procs[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs the soak (see the module docs).
pub fn run(args: SoakArgs) -> Result<()> {
    if !matches!(args.fabric, Backend::Shm | Backend::Tcp) {
        bail!("the soak runs its servers as processes: --fabric shm or tcp");
    }
    if args.clients == 0 || args.minutes <= 0.0 || args.kill_every <= 0.0 {
        bail!("--clients, --minutes and --kill-every must be positive");
    }
    let data_servers = args.data_servers.unwrap_or(if args.replicas >= 2 {
        args.replicas as usize + 1
    } else {
        2
    });
    if data_servers == 0 || args.replicas == 0 || args.replicas as usize > data_servers {
        bail!(
            "--replicas {} needs at least as many --data-servers ({data_servers})",
            args.replicas
        );
    }
    if args.memory_only && args.replicas < 2 && args.kill.contains(&Kind::Data) {
        bail!(
            "--memory-only data servers lose their data when killed: give --replicas 2 or more, \
             or leave `data` out of --kill"
        );
    }
    if args.kill.is_empty() {
        bail!("--kill names nothing to kill");
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    let dir = tempfile::Builder::new()
        .prefix("citronfs-soak-")
        .tempdir()
        .context("create the soak directory")?;
    let shm = tempfile::Builder::new()
        .prefix("citronfs-soak-")
        .tempdir_in(if Path::new("/dev/shm").is_dir() {
            "/dev/shm"
        } else {
            "/tmp"
        })
        .context("create the soak's shared-memory directory")?;
    let mut soak = Soak {
        exe: std::env::current_exe().context("find the citronfs executable")?,
        dir: dir.path().to_path_buf(),
        shm: shm.path().to_path_buf(),
        token: cluster::random_token()?,
        // The meta server is restarted on this address: outside the ephemeral range.
        listen: cluster::restartable_addr()?,
        fabric: args.fabric,
        clients: args.clients,
        replicas: args.replicas,
        memory_only: args.memory_only,
        rng: StdRng::seed_from_u64(seed),
        procs: Vec::new(),
    };
    let mut roles = vec![Role::Meta];
    roles.extend((0..data_servers).map(Role::Data));
    roles.extend((0..args.clients).map(Role::Client));
    soak.procs = roles
        .iter()
        .map(|&role| Proc {
            role,
            child: None,
            lives: 0,
        })
        .collect();
    for i in 0..=data_servers {
        soak.start(i)?;
    }
    // Every data server registered before the clients start: a file's replicas are placed on
    // the servers live then, and a factor above them is refused (EINVAL).
    soak.wait_for_data_servers(data_servers)?;
    prepare(&soak)?;
    for i in data_servers + 1..soak.procs.len() {
        soak.start(i)?;
    }

    let mut done = Done {
        seed,
        fabric: format!("{:?}", args.fabric).to_lowercase(),
        clients: args.clients,
        data_servers,
        replicas: args.replicas,
        memory_only: args.memory_only,
        ..Done::default()
    };
    let started = Instant::now();
    let total = Duration::from_secs_f64(args.minutes * 60.0);
    let bar = indicatif::ProgressBar::new(total.as_secs());
    bar.set_style(
        indicatif::ProgressStyle::with_template("soak {elapsed_precise}/{len}s {wide_bar} {msg}")
            .expect("a valid template"),
    );
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let exp = rand_distr::Exp::new(1.0 / args.kill_every).context("--kill-every")?;
    while started.elapsed() < total {
        let pause = Duration::from_secs_f64(soak.rng.sample(exp)).min(total - started.elapsed());
        std::thread::sleep(pause);
        bar.set_position(started.elapsed().as_secs());
        // Clients that stopped on their own are started again.
        for i in data_servers + 1..soak.procs.len() {
            let exited = soak.procs[i]
                .child
                .as_mut()
                .is_some_and(|c| c.try_wait().ok().flatten().is_some());
            if exited {
                done.client_exits += 1;
                soak.procs[i].child = None;
                soak.start(i)?;
            }
        }
        if started.elapsed() >= total {
            break;
        }
        // The first kills take one of each kind asked for (so that even a short soak kills a
        // client, the meta server and a data server); then clients are killed most often, each
        // server about as often as a client.
        let kills = done.kills_client + done.kills_meta + done.kills_data;
        let kind = match [Kind::Meta, Kind::Data, Kind::Client]
            .into_iter()
            .filter(|k| args.kill.contains(k))
            .nth(kills as usize)
        {
            Some(first) => first,
            None => loop {
                let kind = match soak.rng.random_range(0..10) {
                    0..=1 => Kind::Meta,
                    2..=3 => Kind::Data,
                    _ => Kind::Client,
                };
                if args.kill.contains(&kind) {
                    break kind;
                }
            },
        };
        if kind == Kind::Data && soak.memory_only && !soak.fully_replicated()? {
            done.data_kills_skipped += 1;
            continue;
        }
        let victim = match kind {
            Kind::Meta => 0,
            Kind::Data => 1 + soak.rng.random_range(0..data_servers),
            Kind::Client => data_servers + 1 + soak.rng.random_range(0..args.clients as usize),
        };
        soak.kill(victim);
        match soak.procs[victim].role {
            Role::Meta => done.kills_meta += 1,
            Role::Data(_) => done.kills_data += 1,
            Role::Client(_) => done.kills_client += 1,
        }
        bar.set_message(format!(
            "kills: {} clients, {} meta, {} data",
            done.kills_client, done.kills_meta, done.kills_data
        ));
        std::thread::sleep(Duration::from_millis(soak.rng.random_range(100..1000)));
        soak.start(victim)?;
        if victim <= data_servers {
            done.last_server_restart_ms = journal::now_ms();
        }
    }
    bar.finish_and_clear();
    done.seconds = started.elapsed().as_secs_f64();

    // The clients must be seen carrying on after the servers came back, not merely failing
    // safely; a server restarted just before the end leaves them no time to show it (a
    // fresh-clone CI run on a slow machine: 0 acknowledged after the last restart, nothing
    // lost). So before they are stopped, one of them must acknowledge an operation after the
    // last server restart, waited for at most AFTER_RESTART_WAIT (no kills meanwhile).
    if done.last_server_restart_ms > 0 {
        let deadline = Instant::now() + AFTER_RESTART_WAIT;
        while !acked_since(&soak.dir, done.last_server_restart_ms)? && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    // Stop the clients (a kill: whatever they were doing is unacknowledged), and verify with
    // every server up.
    for i in data_servers + 1..soak.procs.len() {
        soak.kill(i);
    }
    // Memory-only data servers: the last one killed may still be re-replicating; the verdict
    // (fsck's under-replicated chunks) is taken once that ended or REPLICATED_WAIT ran out.
    if soak.memory_only && done.kills_data > 0 {
        soak.fully_replicated()?;
    }
    let verdict = verify_all(&soak, done.last_server_restart_ms)
        .and_then(|found| Ok((found, fsck_at_rest(&soak)?)));
    // Kept when asked for whatever the verdict, and when the verdict is not clean: its
    // journals, logs and regions are the evidence.
    let clean = matches!(&verdict, Ok((found, fsck))
        if found.clean() && fsck.clean() && !(args.fail_on_eio && found.eio > 0));
    if args.keep || !clean {
        let kept = dir.keep();
        let shm = shm.keep();
        eprintln!(
            "soak directory kept: {} (shared memory: {})",
            kept.display(),
            shm.display()
        );
    }
    let (found, fsck) = verdict?;
    report(&args, &done, &found, &fsck);
    if !clean {
        let fsck_findings: Vec<String> = fsck.findings.iter().map(|f| f.to_string()).collect();
        bail!(
            "the soak found {} lost, {} torn, {} unexpected, {} EIO and {} fsck findings \
             (seed {seed}): {:#?} {fsck_findings:#?}",
            found.lost,
            found.torn,
            found.unexpected,
            found.eio,
            fsck.findings.len() as u64 + fsck.truncated,
            found.problems
        );
    }
    Ok(())
}

fn connect(soak: &Soak) -> Result<CitronFs> {
    CitronFs::connect(MountOptions::new(
        soak.listen.to_string(),
        CLUSTER,
        soak.token.clone(),
    ))
    .map_err(|e| anyhow::anyhow!("connect to the soak cluster: {e}"))
}

/// Creates the shared file (all slots) and the directory of private files.
fn prepare(soak: &Soak) -> Result<()> {
    let fs = connect(soak)?;
    let me = CitronFs::process_caller();
    fs.mkdir(me, ROOT_INO, client::DIR, 0o755)
        .map_err(|e| anyhow::anyhow!("mkdir: {e}"))?;
    let (_, fh) = fs
        .create(me, ROOT_INO, client::SHARED, 0o644, libc::O_RDWR)
        .map_err(|e| anyhow::anyhow!("create the shared file: {e}"))?;
    fs.fsync(fh).map_err(|e| anyhow::anyhow!("fsync: {e}"))?;
    let _ = fs.release(fh);
    Ok(())
}

/// How long the soak waits, before it kills a memory-only data server, for no chunk to be
/// under-replicated.
const REPLICATED_WAIT: Duration = Duration::from_secs(30);

/// How long the soak waits, after its last kill, for a client to acknowledge an operation
/// after the last server restart.
const AFTER_RESTART_WAIT: Duration = Duration::from_secs(20);

/// Every client journal in `dir` (one per client life), read.
fn journals(dir: &Path) -> Result<Vec<Vec<journal::Entry>>> {
    let mut journals = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let is_journal = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("journal-"));
        if is_journal {
            journals.push(journal::read(&path)?);
        }
    }
    Ok(journals)
}

/// Whether some client acknowledged an operation after `since` (ms since the Unix epoch).
fn acked_since(dir: &Path, since: u64) -> Result<bool> {
    Ok(journals(dir)?
        .iter()
        .flatten()
        .any(|e| matches!(e, journal::Entry::Ack(_, at) if *at > since)))
}

fn verify_all(soak: &Soak, last_restart: u64) -> Result<verify::Findings> {
    let fs = connect(soak)?;
    let journals = journals(&soak.dir)?;
    verify::verify(
        &fs,
        &journals,
        soak.clients * SLOTS_PER_CLIENT,
        last_restart,
    )
}

/// `citronfs fsck --at-rest` of the soak's cluster (no client is left but the checker).
fn fsck_at_rest(soak: &Soak) -> Result<proto::fsck::FsckReport> {
    let options = proto::fsck::FsckOptions {
        repair: false,
        at_rest: true,
    };
    fsck(soak, options)
}

/// `citronfs fsck` of the soak's cluster.
fn fsck(soak: &Soak, options: proto::fsck::FsckOptions) -> Result<proto::fsck::FsckReport> {
    let credentials = fabric::Credentials::new(CLUSTER.to_string(), soak.token.clone());
    meta_server::fsck::request(
        &soak.listen.to_string(),
        &credentials,
        options,
        "citronfs-soak",
    )
}

fn report(args: &SoakArgs, done: &Done, found: &verify::Findings, fsck: &proto::fsck::FsckReport) {
    #[derive(Serialize)]
    struct Out<'a> {
        did: &'a Done,
        found: &'a verify::Findings,
        fsck_findings: Vec<String>,
    }
    let mut r = Report::new(args.json, &["what", "count"]);
    let acked = |k: &str| found.acked.get(k).copied().unwrap_or(0).to_string();
    let rows: Vec<(&str, String)> = vec![
        ("seed", done.seed.to_string()),
        ("fabric", done.fabric.clone()),
        ("seconds", format!("{:.0}", done.seconds)),
        ("clients", done.clients.to_string()),
        ("data servers", done.data_servers.to_string()),
        ("replicas", done.replicas.to_string()),
        (
            "data servers' memory",
            if done.memory_only {
                "memory only"
            } else {
                "file-backed"
            }
            .to_string(),
        ),
        ("kills of clients", done.kills_client.to_string()),
        ("kills of the meta server", done.kills_meta.to_string()),
        ("kills of data servers", done.kills_data.to_string()),
        (
            "data-server kills skipped (under-replicated)",
            done.data_kills_skipped.to_string(),
        ),
        ("clients that exited", done.client_exits.to_string()),
        ("acknowledged record writes", acked("write")),
        ("acknowledged creates", acked("create")),
        ("acknowledged renames", acked("rename")),
        ("acknowledged truncates", acked("truncate")),
        ("acknowledged unlinks", acked("unlink")),
        ("unacknowledged operations", found.unacked.to_string()),
        ("operations that returned EIO", found.eio.to_string()),
        (
            "operations that returned another error",
            found.other_errors.to_string(),
        ),
        (
            "acknowledged after the last server restart",
            found.acked_after_last_server_restart.to_string(),
        ),
        ("slots verified", found.slots.to_string()),
        ("files verified", found.files.to_string()),
        ("lost acknowledged writes", found.lost.to_string()),
        ("torn records", found.torn.to_string()),
        (
            "interrupted records (allowed)",
            found.interrupted.to_string(),
        ),
        ("unexpected files", found.unexpected.to_string()),
        (
            "fsck --at-rest findings",
            (fsck.findings.len() as u64 + fsck.truncated).to_string(),
        ),
    ];
    if args.json {
        let fsck_findings = fsck.findings.iter().map(|f| f.to_string()).collect();
        r.add(
            Vec::new(),
            &Out {
                did: done,
                found,
                fsck_findings,
            },
        );
    } else {
        for (what, count) in rows {
            r.add(vec![what.to_string(), count], &());
        }
    }
    r.finish();
}
