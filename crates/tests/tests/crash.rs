//! Client crashes at the worst moments: a client *process* is SIGKILLed
//! exactly where a failpoint stops it — holding a range lock, between the per-server batches of
//! a write spanning chunks on both data servers, holding CITRON's spillover mutex, in the middle
//! of a scale-up, right after the meta server created a file or renamed one for it — while a
//! surviving client works on the same file or directory. After every kill:
//!
//! - the meta server notices the dead session (its connection closed) and gives back what it
//!   held: its sessions and open files are counted by `fsck` (`FsckCounts`);
//! - when it died holding a lock, `fsck --at-rest` finds the lock words it left
//!   (`lock-not-at-rest`): the checker sees them; in every fourth trial `fsck --at-rest
//!   --repair` resets them, in the others the survivor's lease recovery breaks them;
//! - every operation of the survivor returns within [`BOUND`] (lease recovery breaks the dead
//!   client's lock; CITRON's patience is a few `T_lease`);
//! - the data is whole: every 4 KiB block holds one record's tag (the dead client's write may
//!   or may not have landed, block by block — a write cut between its per-server batches is
//!   torn by nature, it was never acknowledged), and after the survivor's write the range holds
//!   exactly the survivor's record;
//! - `fsck --at-rest` finds nothing once the survivor is done (the lock recovered, counters
//!   balanced, chunks, links and sizes consistent), and nothing after the survivor closes.
//!
//! The victim is this test binary re-executed (`crash_victim`) as a library client: the
//! failpoints are the `fail` crate's, built in by the `failpoints` feature of fs-client and
//! lockmgr, and the victim configures its one failpoint with a callback that SIGKILLs its own
//! process on the n-th hit (n random per trial). A victim that exits by itself never reached
//! its failpoint, and fails the test.

use fs_client::{CitronFs, FileHandle, SetAttr};
use proto::fsck::{Finding, FsckOptions, FsckReport};
use proto::{Ino, ROOT_INO};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::{record_tags, tagged_record as record, wait_until, Backend, Cluster, ClusterSpec};

/// The victim processes run this test (see the module docs); run normally it does nothing.
#[test]
fn crash_victim() {
    victim_main();
}

/// A write the size of one record: four 64 KiB chunks, striped over both data servers.
const RECORD: usize = 256 << 10;
const BLOCK: usize = testkit::TAG_BLOCK;
/// Past the lock tree a small file gets (it covers 1 MiB): a write here takes the spillover
/// mutex and scales the tree up.
const BEYOND: u64 = 4 << 20;
/// Every operation of the survivor returns within this, dead holder or not.
const BOUND: Duration = Duration::from_secs(20);
/// `T_lease` of the files' locks: short, so that recovering a dead holder (a few `T_lease`)
/// keeps the trials quick; it must exceed 4 × `fence_after` (100 ms).
const LOCK_LEASE: Duration = Duration::from_millis(600);
/// How long a victim may take to reach its failpoint.
const VICTIM_TIMEOUT: Duration = Duration::from_secs(60);

const ENV_JOB: &str = "CITRONFS_CRASH_JOB";
const SURVIVOR: u32 = 1;
const VICTIM: u32 = 2;

/// What a victim does until its failpoint kills it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    /// Overwrites the record at offset 0 again and again.
    Overwrite,
    /// Writes a record just past the end of the file (allocating its chunks before it raises
    /// the size).
    Extend,
    /// Writes a block at [`BEYOND`]: the first one scales the lock tree up.
    Beyond,
    /// Truncates to the file's size again and again (the whole-file lock: tree and spillover).
    Truncate,
    /// Creates (and opens, and closes) files in the directory.
    Create,
    /// Creates files and renames each over a name the survivor uses too.
    Rename,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Overwrite => "overwrite",
            Op::Extend => "extend",
            Op::Beyond => "beyond",
            Op::Truncate => "truncate",
            Op::Create => "create",
            Op::Rename => "rename",
        }
    }

    fn parse(s: &str) -> Op {
        [
            Op::Overwrite,
            Op::Extend,
            Op::Beyond,
            Op::Truncate,
            Op::Create,
            Op::Rename,
        ]
        .into_iter()
        .find(|op| op.name() == s)
        .unwrap_or_else(|| panic!("unknown op {s:?}"))
    }
}

/// One kind of trial.
#[derive(Clone, Copy)]
struct Point {
    failpoint: &'static str,
    op: Op,
    /// The victim dies holding lock words of the file.
    holds_lock: bool,
    /// Hits of the failpoint to let pass before the kill: random in `0..=max_skip`.
    max_skip: u64,
    trials: usize,
}

// ---- the victim -----------------------------------------------------------------------------

/// The victim process's body: connect, open a file of its own (the meta server must release
/// it when this process dies), arm the failpoint, and work until it fires.
fn victim_main() {
    let Ok(job) = std::env::var(ENV_JOB) else {
        return;
    };
    let f: Vec<&str> = job.split('|').collect();
    let [meta, cluster, token, failpoint, skip, op, name] = f[..] else {
        panic!("bad job {job:?}");
    };
    let op = Op::parse(op);
    let skip: u64 = skip.parse().unwrap();
    let mut options = fs_client::MountOptions::new(meta, cluster, token);
    options.scheme = fs_client::LockScheme::CITRON;
    if failpoint.starts_with("lockmgr::") {
        // The lock protocol's failpoints are on the client's side of it: acquired at the
        // meta server (tcp's default), the protocol runs there, where no client dies.
        options.lock_hosting = fs_client::Hosting::Never;
    }
    let fs = CitronFs::connect(options).expect("the victim connects");
    let me = CitronFs::process_caller();
    let pid = std::process::id();
    let _private = fs
        .create(me, ROOT_INO, &format!("victim-{pid}"), 0o644, libc::O_RDWR)
        .expect("the victim's own file");
    let hits = Arc::new(AtomicU64::new(0));
    fail::cfg_callback(failpoint, move || {
        if hits.fetch_add(1, Ordering::Relaxed) >= skip {
            // SAFETY: kill(2) on our own pid touches no memory.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    })
    .expect("arm the failpoint");
    let dir = fs.lookup(ROOT_INO, "d").expect("the directory").ino;
    for seq in 1..=200u32 {
        match op {
            Op::Overwrite | Op::Extend | Op::Beyond | Op::Truncate => {
                let ino = fs.lookup(dir, name).expect("the file").ino;
                let fh = fs.open(me, ino, libc::O_RDWR).expect("open");
                let done = match op {
                    Op::Overwrite => fs.write(fh, 0, &record(VICTIM, seq, RECORD)).map(drop),
                    Op::Extend => fs
                        .write(fh, RECORD as u64, &record(VICTIM, seq, RECORD))
                        .map(drop),
                    Op::Beyond => fs.write(fh, BEYOND, &record(VICTIM, seq, BLOCK)).map(drop),
                    _ => fs
                        .setattr(
                            me,
                            ino,
                            SetAttr {
                                size: Some(RECORD as u64),
                                ..SetAttr::default()
                            },
                        )
                        .map(drop),
                };
                done.expect("the victim's I/O");
                fs.release(fh).expect("release");
            }
            Op::Create => {
                let (_, fh) = fs
                    .create(me, dir, &format!("c-{pid}-{seq}"), 0o644, libc::O_RDWR)
                    .expect("create");
                fs.release(fh).expect("release");
            }
            Op::Rename => {
                let tmp = format!("r-{pid}-{seq}");
                let (_, fh) = fs
                    .create(me, dir, &tmp, 0o644, libc::O_RDWR)
                    .expect("create");
                fs.write(fh, 0, &record(VICTIM, seq, BLOCK)).expect("write");
                fs.release(fh).expect("release");
                fs.rename(dir, &tmp, dir, name, false).expect("rename");
            }
        }
    }
    println!("the victim finished without reaching {failpoint}");
}

/// A victim process, killed on drop if still running.
struct Victim(Child);

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ---- the survivor and the checks ------------------------------------------------------------

/// Asks the meta server to check itself (a connection of its own: the checker's session is
/// not counted among `sessions`).
fn fsck(cluster: &Cluster, at_rest: bool) -> FsckReport {
    fsck_with(
        cluster,
        FsckOptions {
            repair: false,
            at_rest,
        },
    )
}

/// [`fsck`] with `options`.
fn fsck_with(cluster: &Cluster, options: FsckOptions) -> FsckReport {
    cluster.fsck(options).unwrap()
}

/// Runs `op` and checks that it returned within [`BOUND`]; returns its result and time.
fn bounded<T>(what: &str, op: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let result = op();
    let took = start.elapsed();
    assert!(
        took < BOUND,
        "{what} took {took:?}, beyond the bound of {BOUND:?}"
    );
    (result, took)
}

/// Tallies of one point's trials, for the report line (and docs/RELIABILITY.md).
#[derive(Default)]
struct Tally {
    trials: usize,
    locks_seen: usize,
    /// Trials where the survivor, working alongside, broke the dead client's lock itself
    /// before the check could look.
    recovered_alongside: usize,
    /// Trials where `fsck --at-rest --repair` reset the dead client's words.
    reset_by_fsck: usize,
    /// Sweeps of words no request had recovered, before fsck found the lock at rest (see
    /// [`settle`]).
    sweeps: usize,
    slowest: Duration,
    survivor_ops: usize,
}

/// The survivor's side of one trial on file `name` in directory `dir`: one round of the same
/// kind of work as the victim's, each call bounded, every read checked: once the victim is dead
/// (`alone`), the read after the survivor's write is exactly its record; while the victim still
/// runs, its writes may come between, so each block is the survivor's record or a victim's.
#[allow(clippy::too_many_arguments)]
fn survivor_round(
    fs: &CitronFs,
    dir: Ino,
    name: &str,
    fh: FileHandle,
    ino: Ino,
    op: Op,
    seq: u32,
    alone: bool,
    tally: &mut Tally,
) {
    let me = CitronFs::process_caller();
    let (r, took) = bounded("the survivor's write", || {
        fs.write(fh, 0, &record(SURVIVOR, seq, RECORD))
    });
    r.unwrap();
    tally.slowest = tally.slowest.max(took);
    let (r, took) = bounded("the survivor's read", || fs.read(fh, 0, RECORD));
    tally.slowest = tally.slowest.max(took);
    let read = r.unwrap();
    let tags = record_tags(&read).unwrap_or_else(|e| panic!("after the survivor's write: {e}"));
    let ok =
        |&(writer, s): &(u32, u32)| (writer, s) == (SURVIVOR, seq) || (!alone && writer == VICTIM);
    assert!(
        tags.iter().all(ok),
        "the survivor's record {seq} is not what it reads back{}: {:?}",
        if alone { " (the victim is dead)" } else { "" },
        tags.iter().find(|t| !ok(t))
    );
    let (r, took) = bounded("the survivor's op", || -> Result<(), fs_client::Error> {
        match op {
            Op::Overwrite | Op::Extend | Op::Create => Ok(()),
            // Not while the victim runs: the first write past the tree scales it up, and that
            // must be the victim's.
            Op::Beyond if !alone => Ok(()),
            Op::Beyond => fs
                .write(fh, BEYOND, &record(SURVIVOR, seq, BLOCK))
                .map(drop),
            Op::Truncate => fs
                .setattr(
                    me,
                    ino,
                    SetAttr {
                        size: Some(RECORD as u64),
                        ..SetAttr::default()
                    },
                )
                .map(drop),
            Op::Rename => {
                let tmp = format!("s-{seq}");
                let (_, t) = fs.create(me, dir, &tmp, 0o644, libc::O_RDWR)?;
                fs.release(t)?;
                fs.rename(dir, &tmp, dir, name, false)
            }
        }
    });
    r.unwrap();
    tally.slowest = tally.slowest.max(took);
    if op == Op::Create {
        let (r, took) = bounded("the survivor's create", || {
            fs.create(me, dir, &format!("s-{seq}"), 0o644, libc::O_RDWR)
        });
        tally.slowest = tally.slowest.max(took);
        fs.release(r.unwrap().1).unwrap();
    }
    tally.survivor_ops += 1;
}

/// After a victim died in an extending write, having allocated the chunks past the end but not
/// raised the size: while the file is open they are garbage that fsck --at-rest reports
/// (`chunks-beyond-size`, with the dead write's lock words until someone recovers them). In
/// even trials an extending truncate over them (under the whole-file lock, which recovers the
/// dead lock) must read zeros, not the dead write's data, and frees them; in odd trials the
/// file is only read there and closed: the last release frees them (checked by the caller's
/// fsck after the close).
fn extend_over_the_dead_write(
    cluster: &Cluster,
    fs: &CitronFs,
    ino: Ino,
    fh: FileHandle,
    trial: usize,
) {
    let me = CitronFs::process_caller();
    let report = fsck(cluster, true);
    let garbage = |report: &FsckReport| {
        report.findings.iter().any(|f| {
            matches!(f, Finding::ChunkBeyondSize { ino: i, size, .. }
                if *i == ino && *size == RECORD as u64)
        }) && report.findings.iter().all(|f| {
            matches!(
                f,
                Finding::ChunkBeyondSize { .. } | Finding::LockNotAtRest { .. }
            )
        })
    };
    assert!(
        garbage(&report),
        "the dead extending write's chunks: {report:#?}"
    );
    let size = |size: usize| SetAttr {
        size: Some(size as u64),
        ..SetAttr::default()
    };
    if trial % 2 == 0 {
        fs.setattr(me, ino, size(2 * RECORD)).unwrap();
        let tail = fs.read(fh, RECORD as u64, RECORD).unwrap();
        assert!(
            tail.iter().all(|&b| b == 0),
            "an extending truncate reads the dead write's data instead of zeros"
        );
        fs.setattr(me, ino, size(RECORD)).unwrap();
    } else {
        assert!(fs.read(fh, RECORD as u64, RECORD).unwrap().is_empty());
        let report = fsck(cluster, true);
        assert!(
            garbage(&report),
            "the dead extending write's chunks: {report:#?}"
        );
    }
}

/// `fsck --at-rest` once the survivor is done, after sweeping what lazy recovery leaves.
///
/// Recovery is lazy (CITRON §3.10): a dead holder's word is broken only by a request that
/// needs it. A victim's request that escalated to the root on the fast path (starvation
/// avoidance) holds all four leaves under it whole, not only the units it asked for; the
/// survivor's same-range requests recover the root and their own leaf, and the other leaves
/// stay set until someone asks for them (a release after its lease deadline leaves leaf bits
/// to lazy recovery the same way). `fsck --at-rest` rightly reports such words. So: while the
/// only findings are lock words of this file, make the requests that recover them — a read
/// of each busy leaf's range (a leaf request waits for the bits and breaks them), and the
/// whole-file lock (a truncate to the file's own size) for internal nodes and the spillover
/// mutex — and look again, a few times, each bounded. Any other finding, or words that
/// survive the sweeps, fail the caller's check.
fn settle(
    cluster: &Cluster,
    fs: &CitronFs,
    ino: Ino,
    fh: FileHandle,
    tally: &mut Tally,
) -> FsckReport {
    let me = CitronFs::process_caller();
    /// Bytes of one leaf: 64 lock units of 4 KiB.
    const LEAF: u64 = 64 * 4096;
    for _ in 0..5 {
        let report = fsck(cluster, true);
        let busy: Vec<&String> = report
            .findings
            .iter()
            .filter_map(|f| match f {
                Finding::LockNotAtRest { ino: i, busy, .. } if *i == ino => Some(busy),
                _ => None,
            })
            .flatten()
            .collect();
        if busy.is_empty() || busy.len() < report.findings.len() {
            return report;
        }
        tally.sweeps += 1;
        for word in busy {
            // "node(0, POS) = ...": a leaf.
            let leaf = word
                .strip_prefix("node(0, ")
                .and_then(|rest| rest.split(')').next())
                .and_then(|pos| pos.parse::<u64>().ok());
            let (r, took) = bounded("a sweep", || match leaf {
                Some(pos) => fs.read(fh, pos * LEAF, LEAF as usize).map(drop),
                None => {
                    let size = fs.getattr(ino)?.size;
                    let set = SetAttr {
                        size: Some(size),
                        ..SetAttr::default()
                    };
                    fs.setattr(me, ino, set).map(drop)
                }
            });
            r.unwrap();
            tally.slowest = tally.slowest.max(took);
        }
    }
    fsck(cluster, true)
}

fn run_point(backend: Backend, point: Point) {
    let cluster = Cluster::start(ClusterSpec {
        fabric: backend,
        lock_lease: LOCK_LEASE,
        ..ClusterSpec::default()
    })
    .unwrap();
    let fs = cluster.client().unwrap();
    let me = CitronFs::process_caller();
    let dir = fs.mkdir(me, ROOT_INO, "d", 0o755).unwrap().ino;
    let mut tally = Tally::default();
    let mut seq = 0;
    for trial in 0..point.trials {
        // A fresh file per trial, opened by the survivor while small (so that its lock tree
        // covers 1 MiB and a write at BEYOND scales it up), kept open across the kill.
        let name = format!("f-{trial}");
        let (attr, fh) = fs.create(me, dir, &name, 0o644, libc::O_RDWR).unwrap();
        seq += 1;
        fs.write(fh, 0, &record(SURVIVOR, seq, RECORD)).unwrap();
        let skip = rand::random_range(0..=point.max_skip);
        let job = [
            cluster.meta_addr().to_string(),
            cluster.name().to_string(),
            cluster.token().to_string(),
            point.failpoint.to_string(),
            skip.to_string(),
            point.op.name().to_string(),
            name.clone(),
        ]
        .join("|");
        let recoveries_before = fs.lock_stats().recoveries;
        let exe = std::env::current_exe().unwrap();
        let mut victim = Victim(
            Command::new(exe)
                .args(["crash_victim", "--exact", "--nocapture", "--test-threads=1"])
                .env(ENV_JOB, job)
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        );
        // Every other trial, the survivor works on the same file while the victim runs, until
        // it is killed (and may break a lock the victim died holding before fsck looks); in the
        // others the victim runs alone, and whatever it dies holding is still there for fsck.
        let alongside = trial % 2 == 0;
        let started = Instant::now();
        let status = loop {
            if let Some(status) = victim.0.try_wait().unwrap() {
                break status;
            }
            assert!(
                started.elapsed() < VICTIM_TIMEOUT,
                "{}: the victim did not reach its failpoint within {VICTIM_TIMEOUT:?}",
                point.failpoint
            );
            if alongside {
                seq += 1;
                survivor_round(
                    &fs, dir, &name, fh, attr.ino, point.op, seq, false, &mut tally,
                );
            } else {
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "{}: the victim ended with {status} instead of being killed at its failpoint",
            point.failpoint
        );

        // The meta server ends the dead session and gives back its opens. (The survivor's
        // call carries the releases of the files its rounds closed: lingering opens.)
        fs.statfs().unwrap();
        let mut report = fsck(&cluster, false);
        wait_until(BOUND, "the meta server to end the dead session", || {
            report = fsck(&cluster, false);
            report.counts.sessions == 1
        });
        assert_eq!(
            report.counts.open_files, 1,
            "{}: only the survivor's file is open once the victim is gone",
            point.failpoint
        );
        let recovered_alongside = fs.lock_stats().recoveries > recoveries_before;
        assert!(
            alongside || !recovered_alongside,
            "nothing of the survivor ran while the victim did"
        );
        if recovered_alongside {
            // The victim died while the survivor was waiting for its lock: the survivor broke
            // it already (and its round passed its checks).
            tally.recovered_alongside += 1;
        } else if point.holds_lock {
            // The dead client's lock words are still set until someone recovers them.
            let report = fsck(&cluster, true);
            let left = report
                .findings
                .iter()
                .any(|f| matches!(f, Finding::LockNotAtRest { ino, .. } if *ino == attr.ino));
            assert!(
                left,
                "{}: the victim died holding a lock, but fsck --at-rest sees none: {report:?}",
                point.failpoint
            );
            tally.locks_seen += 1;
            if trial % 4 == 3 && point.op != Op::Extend {
                // The operator's way: nothing is active, so fsck --at-rest --repair puts the
                // dead client's words back at rest, and nobody waits for a lease.
                let report = fsck_with(
                    &cluster,
                    FsckOptions {
                        repair: true,
                        at_rest: true,
                    },
                );
                assert!(
                    report.repairs.iter().any(
                        |r| matches!(r, proto::fsck::Repair::ResetLock { ino, .. } if *ino == attr.ino)
                    ) && report.remaining == Some(Vec::new()),
                    "{}: fsck --at-rest --repair: {report:#?}",
                    point.failpoint
                );
                tally.reset_by_fsck += 1;
            }
        }
        // What the dead client left: whole blocks, each the survivor's last record or one of
        // the victim's (its unacknowledged write may have landed on some servers only).
        let (read, took) = bounded("the survivor's first read after the kill", || {
            fs.read(fh, 0, RECORD)
        });
        tally.slowest = tally.slowest.max(took);
        let tags = record_tags(&read.unwrap())
            .unwrap_or_else(|e| panic!("{}: after the kill: {e}", point.failpoint));
        assert!(
            tags.iter()
                .all(|&(writer, s)| (writer == SURVIVOR && s == seq) || writer == VICTIM),
            "{}: blocks of neither the survivor's last record {seq} nor the victim's: {:?}",
            point.failpoint,
            tags.iter()
                .filter(|t| t.0 != VICTIM && t.1 != seq)
                .take(3)
                .collect::<Vec<_>>()
        );
        // The survivor carries on (recovering the lock where it must), within the bound.
        seq += 1;
        survivor_round(
            &fs, dir, &name, fh, attr.ino, point.op, seq, true, &mut tally,
        );
        if point.op == Op::Extend {
            extend_over_the_dead_write(&cluster, &fs, attr.ino, fh, trial);
        }
        // Odd Extend trials leave the dead write's chunks (checked above) for the close.
        let left_for_the_close = point.op == Op::Extend && trial % 2 == 1;
        let report = if left_for_the_close {
            fsck(&cluster, true)
        } else {
            settle(&cluster, &fs, attr.ino, fh, &mut tally)
        };
        assert!(
            (report.clean() || left_for_the_close) && report.at_rest && report.counts.locks >= 1,
            "{} trial {trial}: fsck --at-rest after the survivor is done: {report:#?}",
            point.failpoint
        );
        fs.release(fh).unwrap();
        // The close's release lingers until the survivor's next call, which carries it.
        fs.statfs().unwrap();
        let report = fsck(&cluster, false);
        assert!(
            report.clean() && report.counts.open_files == 0,
            "{} trial {trial}: fsck after the survivor closed: {report:#?}",
            point.failpoint
        );
        tally.trials += 1;
    }
    println!(
        "{backend:?} {}: {} trials, each victim SIGKILLed at its failpoint; dead lock seen by \
         fsck {} times (reset by fsck --repair {} times), broken by the survivor before fsck \
         looked {} times; {} survivor \
         rounds, slowest call {:?} (bound {BOUND:?}); {} sweeps of dead words outside every \
         request (the survivor released late {} times); fsck clean after every trial",
        point.failpoint,
        tally.trials,
        tally.locks_seen,
        tally.reset_by_fsck,
        tally.recovered_alongside,
        tally.survivor_ops,
        tally.slowest,
        tally.sweeps,
        fs.lock_stats().late_releases
    );
}

/// Runs `point` on tcp, then with fewer trials on shm (where the victim's stores go straight
/// into the regions: no fabric server stands between a killed client and the memory).
fn on_tcp_and_shm(point: Point) {
    run_point(Backend::Tcp, point);
    run_point(Backend::Shm, Point { trials: 4, ..point });
}

#[test]
fn killed_holding_a_range_lock() {
    on_tcp_and_shm(Point {
        failpoint: "fs_client::io::locked",
        op: Op::Overwrite,
        holds_lock: true,
        max_skip: 3,
        trials: 6,
    });
}

#[test]
fn killed_between_the_batches_of_a_write_over_two_servers() {
    on_tcp_and_shm(Point {
        failpoint: "fs_client::io::between_servers",
        op: Op::Overwrite,
        holds_lock: true,
        max_skip: 3,
        trials: 6,
    });
}

/// Killed between the per-server batches of a write past the end of the file: its chunks are
/// allocated, the size never raised.
#[test]
fn killed_in_the_middle_of_an_extending_write() {
    run_point(
        Backend::Tcp,
        Point {
            failpoint: "fs_client::io::between_servers",
            op: Op::Extend,
            holds_lock: true,
            // The first write extends; later ones would overwrite.
            max_skip: 0,
            trials: 4,
        },
    );
}

#[test]
fn killed_holding_the_spillover_mutex() {
    on_tcp_and_shm(Point {
        failpoint: "lockmgr::citron::spillover_held",
        op: Op::Truncate,
        holds_lock: true,
        max_skip: 3,
        trials: 6,
    });
}

/// Killed after announcing a scale-up in the config record (Alg. 4, before any `Exp` tag):
/// the next holder of the spillover mutex breaks the dead scaler's hold and scales up itself.
#[test]
fn killed_during_a_scale_up_after_announcing_it() {
    run_point(
        Backend::Tcp,
        Point {
            failpoint: "lockmgr::citron::scale_up_announced",
            op: Op::Beyond,
            holds_lock: true,
            // One scale-up per file: the first hit.
            max_skip: 0,
            trials: 4,
        },
    );
}

/// Killed after writing the scale-up's `Exp` tags on the old tree's top nodes (Alg. 4 l. 4-5),
/// before copying notifications and publishing: every acquisition that meets the tagged root
/// waits for the new configuration; past the scaler's lease, a waiter takes the spillover
/// mutex (breaking the dead holder's) and finishes the scale-up from what the tree holds now
/// (`lockmgr::citron::scaleup`, "A scale-up whose scaler died"). Before that, the waiters gave
/// up after 10 `T_lease` and the file's I/O failed with EIO until every client closed it.
#[test]
fn killed_during_a_scale_up_after_tagging_the_old_tree() {
    run_point(
        Backend::Tcp,
        Point {
            failpoint: "lockmgr::citron::scale_up_tagged",
            op: Op::Beyond,
            holds_lock: true,
            max_skip: 0,
            trials: 4,
        },
    );
}

#[test]
fn killed_during_create_and_rename() {
    for (failpoint, op) in [
        // A create is one `Create` call (the file made and opened on the meta server).
        ("fs_client::meta::answered::Create", Op::Create),
        ("fs_client::meta::answered::Rename", Op::Rename),
    ] {
        run_point(
            Backend::Tcp,
            Point {
                failpoint,
                op,
                holds_lock: false,
                max_skip: 4,
                trials: 3,
            },
        );
    }
}

/// The checker of this file: whole blocks pass, a block with a foreign word fails.
#[test]
fn a_torn_block_is_caught() {
    let mut r = record(1, 7, 2 * BLOCK);
    assert_eq!(record_tags(&r).unwrap(), vec![(1, 7), (1, 7)]);
    r[BLOCK + 16..BLOCK + 24].copy_from_slice(&record(2, 3, 8));
    assert!(record_tags(&r).is_err());
}
