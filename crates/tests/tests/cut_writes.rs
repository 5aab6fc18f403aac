//! A write cut by its writer's death between replicas (docs/REPLICAS.md, "A write cut between
//! replicas"): a client process is SIGKILLed in the middle of a write's round, after the batch
//! to the first replicas' data server completed and before the batch to the other replicas'
//! server is posted (`fs_client::io::between_replicas`). Its write is on one replica of every
//! chunk only. Then:
//!
//! - clients of several sessions read the range again and again — each session reads a chunk
//!   from replica `(chunk + session) % 2`, so between them both replicas of every chunk are
//!   read — and every read returns the same bytes, each 4 KiB block whole (the survivor's record
//!   or the dead write's, the same for every read);
//! - once every client closed the file, `citronfs fsck` compares its replicas and finds no
//!   `replicas-differ`;
//! - the same when every client closed the file before anyone read it again (the meta server
//!   repairs at the last close, where the record of the cut goes);
//! - a cut write past the end of the file (its chunks allocated, the size not raised) leaves
//!   nothing behind for a later write past it: the gap reads zeros from every replica; the
//!   same for a cut `O_APPEND` write (recorded in the counters, not a slot).
//!
//! The cluster: two data servers, replicas 2 (every chunk on both), a short lock lease. The
//! victim is this test binary re-executed (`cut_victim`) as a library client with the
//! `failpoints` build of fs-client; it SIGKILLs itself at the failpoint.

use fs_client::CitronFs;
use proto::fsck::{Finding, FsckOptions};
use proto::ROOT_INO;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use testkit::{record_tags, tagged_record as record, wait_until, Backend, Cluster, ClusterSpec};

const CHUNK: u64 = 64 << 10;
/// The range written: four chunks, each with a replica on both data servers.
const RECORD: usize = 4 * CHUNK as usize;
const BLOCK: usize = testkit::TAG_BLOCK;
/// `T_lease` of the file's lock: short, so that the readers break the dead writer's lock soon.
const LOCK_LEASE: Duration = Duration::from_millis(600);
/// How long the victim may take to reach its failpoint.
const VICTIM_TIMEOUT: Duration = Duration::from_secs(60);
/// Readers (each a client of its own session) and reads each.
const READERS: usize = 4;
const READS: usize = 8;

const ENV_JOB: &str = "CITRONFS_CUT_JOB";
const FAILPOINT: &str = "fs_client::io::between_replicas";
const SURVIVOR: u32 = 1;
const VICTIM: u32 = 2;

/// The victim process's body: connect, open the file, arm the failpoint (SIGKILL at its first
/// hit), and write its record at the job's offset (over the survivor's, or past the end); it
/// must die there.
#[test]
fn cut_victim() {
    let Ok(job) = std::env::var(ENV_JOB) else {
        return;
    };
    let f: Vec<&str> = job.split('|').collect();
    let [meta, cluster, token, ino, offset] = f[..] else {
        panic!("bad job {job:?}");
    };
    let mut options = fs_client::MountOptions::new(meta, cluster, token);
    options.scheme = fs_client::LockScheme::CITRON;
    let fs = CitronFs::connect(options).expect("the victim connects");
    let me = CitronFs::process_caller();
    // "append": an O_APPEND write, whose lock is the whole file (its record: the counters).
    let append = offset == "append";
    let flags = libc::O_RDWR | if append { libc::O_APPEND } else { 0 };
    let fh = fs
        .open(me, ino.parse().expect("an inode"), flags)
        .expect("open");
    fail::cfg_callback(FAILPOINT, || {
        // SAFETY: kill(2) on our own pid touches no memory.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    })
    .expect("arm the failpoint");
    let offset: u64 = if append {
        0
    } else {
        offset.parse().expect("an offset")
    };
    let done = fs.write(fh, offset, &record(VICTIM, 2, RECORD));
    println!("the victim's write returned {done:?} without reaching {FAILPOINT}");
}

/// A victim process, killed on drop if still running.
struct Victim(Child);

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a trial does after the kill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Trial {
    /// The victim overwrote the survivor's record; readers read it while the survivor keeps
    /// the file open.
    ReadWhileOpen,
    /// The same, but the survivor closes the file (and goes) before anyone reads it, so that
    /// nobody has it open: the meta server repairs at that last close, where the record of the
    /// cut goes with the file control block.
    ClosedFirst,
    /// The victim wrote past the end (its chunks allocated, the size never raised); the
    /// survivor then writes the last block of that range, and the gap before it must read
    /// zeros on every replica, not the dead write's bytes on one of them.
    ExtendThenGap,
    /// The same with an `O_APPEND` write: its lock is the whole file, so it records itself in
    /// the counters BEGUN and ENDED rather than a slot.
    AppendThenGap,
}

/// One trial on `backend`.
fn cut_between_replicas(backend: Backend, trial: Trial) {
    let closed_first = trial == Trial::ClosedFirst;
    let extend = matches!(trial, Trial::ExtendThenGap | Trial::AppendThenGap);
    testkit::init_logging();
    let cluster = Cluster::start(ClusterSpec {
        data_servers: 2,
        replicas: 2,
        chunk_size: CHUNK,
        fabric: backend,
        lock_lease: LOCK_LEASE,
        ..ClusterSpec::default()
    })
    .unwrap();
    let me = CitronFs::process_caller();
    let survivor = cluster.client().unwrap();
    let (attr, fh) = survivor
        .create(me, ROOT_INO, "f", 0o644, libc::O_RDWR)
        .unwrap();
    survivor.write(fh, 0, &record(SURVIVOR, 1, RECORD)).unwrap();

    let job = [
        cluster.meta_addr().to_string(),
        cluster.name().to_string(),
        cluster.token().to_string(),
        attr.ino.to_string(),
        match trial {
            Trial::AppendThenGap => "append".to_string(),
            Trial::ExtendThenGap => RECORD.to_string(),
            _ => "0".to_string(),
        },
    ]
    .join("|");
    let exe = std::env::current_exe().unwrap();
    let mut victim = Victim(
        Command::new(exe)
            .args(["cut_victim", "--exact", "--nocapture", "--test-threads=1"])
            .env(ENV_JOB, job)
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let started = Instant::now();
    let status = loop {
        if let Some(status) = victim.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < VICTIM_TIMEOUT,
            "the victim did not reach {FAILPOINT} within {VICTIM_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "the victim ended with {status} instead of being killed at {FAILPOINT}"
    );

    const CHECK: FsckOptions = FsckOptions {
        repair: false,
        at_rest: false,
    };
    let survivor = match closed_first {
        true => {
            survivor.release(fh).unwrap();
            drop(survivor);
            wait_until(Duration::from_secs(20), "every session to end", || {
                cluster.fsck(CHECK).unwrap().counts.open_files == 0
            });
            None
        }
        false => Some(survivor),
    };
    // What the readers read: the record, and with `extend` the dead write's range after it.
    let span = if extend { 2 * RECORD } else { RECORD };
    let gap = RECORD / BLOCK..span / BLOCK - 1;
    if extend {
        let survivor = survivor.as_ref().expect("open");
        let last = (span - BLOCK) as u64;
        survivor
            .write(fh, last, &record(SURVIVOR, 3, BLOCK))
            .unwrap();
    }
    // Readers of several sessions, so that both replicas of every chunk are read; each opens
    // the file (unless `closed_first`, the survivor keeps it open throughout, so its control
    // block stays).
    // A client may take two session ids (one per fabric connection, on shm), which would give
    // every reader the same parity and so the same replica of every chunk: an RPC connection
    // between two readers takes one more, so that the readers' sessions alternate.
    let readers: Vec<CitronFs> = (0..READERS)
        .map(|r| {
            if r % 2 == 1 {
                let rpc = cluster.rpc_client().unwrap();
                rpc.call(proto::rpc::Request::Status).unwrap().unwrap();
            }
            cluster.client().unwrap()
        })
        .collect();
    let mut first: Option<Vec<(u32, u32)>> = None;
    for round in 0..READS {
        for (r, fs) in readers.iter().enumerate() {
            let rfh = fs.open(me, attr.ino, libc::O_RDONLY).unwrap();
            let read = fs.read(rfh, 0, span).unwrap();
            fs.release(rfh).unwrap();
            assert_eq!(read.len(), span);
            let tags =
                record_tags(&read).unwrap_or_else(|e| panic!("reader {r}, read {round}: {e}"));
            if extend {
                assert!(
                    tags[gap.clone()].iter().all(|&t| t == (0, 0))
                        && tags[span / BLOCK - 1] == (SURVIVOR, 3),
                    "reader {r}, read {round}: the gap before the survivor's last block does \
                     not read zeros: {:?}",
                    &tags[RECORD / BLOCK..]
                );
            }
            let ours = |t: &(u32, u32)| *t == (SURVIVOR, 1) || *t == (VICTIM, 2);
            assert!(
                tags[..RECORD / BLOCK].iter().all(ours),
                "reader {r}, read {round}: blocks of neither record: {tags:?}"
            );
            match &first {
                None => first = Some(tags),
                Some(seen) => assert!(
                    *seen == tags,
                    "reader {r}, read {round} disagrees with the first read: \
                     blocks (survivor 1, victim 2) {:?} vs {:?}",
                    seen.iter().map(|t| t.0).collect::<Vec<_>>(),
                    tags.iter().map(|t| t.0).collect::<Vec<_>>()
                ),
            }
        }
    }
    let tags = first.unwrap();
    let victims = tags.iter().filter(|t| t.0 == VICTIM).count();
    println!(
        "{backend:?} {trial:?}: {} reads by {READERS} sessions agree: {victims} of {} blocks \
         hold the cut write",
        READERS * READS,
        tags.len()
    );

    // Every client gone: the file is open nowhere, and fsck compares its replicas.
    if let Some(survivor) = survivor {
        survivor.release(fh).unwrap();
    }
    drop(readers);
    wait_until(Duration::from_secs(20), "every session to end", || {
        cluster.fsck(CHECK).unwrap().counts.open_files == 0
    });
    let report = cluster.fsck(CHECK).unwrap();
    let differ: Vec<&Finding> = report
        .findings
        .iter()
        .filter(|f| matches!(f, Finding::ReplicasDiffer { .. }))
        .collect();
    assert!(
        differ.is_empty(),
        "replicas differ after the cut write: {differ:#?}"
    );
    assert!(report.clean(), "{:#?}", report.findings);
}

#[test]
fn a_write_cut_between_replicas_reads_the_same_everywhere_on_tcp() {
    cut_between_replicas(Backend::Tcp, Trial::ReadWhileOpen);
}

/// Nobody reads the file before every client closed it: the meta server repairs at the close.
#[test]
fn a_write_cut_between_replicas_of_a_file_closed_by_all_is_repaired_at_the_close() {
    cut_between_replicas(Backend::Tcp, Trial::ClosedFirst);
}

/// A cut extending write: its chunks past the size are freed by the repair, so a later write's
/// gap reads zeros everywhere.
#[test]
fn a_cut_extending_write_leaves_no_bytes_for_a_later_gap() {
    cut_between_replicas(Backend::Tcp, Trial::ExtendThenGap);
}

/// A cut `O_APPEND` write (the whole-file lock, recorded in the counters): the same.
#[test]
fn a_cut_append_leaves_no_bytes_for_a_later_gap() {
    cut_between_replicas(Backend::Tcp, Trial::AppendThenGap);
}

#[test]
fn a_write_cut_between_replicas_reads_the_same_everywhere_on_shm() {
    cut_between_replicas(Backend::Shm, Trial::ReadWhileOpen);
}
