//! Real multi-host faults: a meta server, two data servers and two client
//! hosts, each a `citronfs` process in a network namespace of its own on a private switch
//! (`testkit::netns`), over the tcp fabric; a link is cut by taking its veth down, as a pulled
//! cable: nothing is closed or answered, packets are lost.
//!
//! - `cut_client_mid_write`: a client cut off in the middle of a stream of writes to a shared
//!   file leaves the other client working (its writes to the same ranges finish within
//!   [`RECOVERY_BOUND`]: the cut client's range lock is recovered and its session fenced); the
//!   cut client's calls fail within [`CUT_CLIENT_IO_BOUND`] instead of hanging; once healed, it carries
//!   on or fails cleanly (EIO/ESTALE) and a fresh mount works; every record of the file is
//!   whole.
//! - `cut_data_server`: I/O on chunks of a cut data server fails with EIO within [`IO_BOUND`]
//!   and never hangs, I/O on the other server's chunks keeps working, and once healed every
//!   chunk reads back what it held (a write that failed while the link was down never lands
//!   later).
//!
//! - `heal_data_server`: the paths from both clients to `ds2` are cut (`Network::cut_between`,
//!   the meta server keeps hearing from `ds2`, so the layout does not change) long enough for
//!   the kernel to give up the clients' idle connections; after the heal, the client that was
//!   idle through the cut reads the whole file at once, the one whose reads failed during it
//!   reads those chunks, and the idle one writes them, each within [`HEALED_BOUND`].
//! - `a_write_cut_from_its_data_server_frees_its_range_within_its_lease`: a write whose
//!   client's path to one data server goes silent fails, and the range it had locked is free
//!   for the other client at once ([`FREED_BOUND`]), not after lazy recovery.
//!
//! - `a_replica_server_cut_from_the_meta_server_is_dropped_for_good`: with two replicas, `ds2`
//!   cut off from the meta server and from the writing client (the other client still reaches
//!   it) is marked down and its replicas are dropped; the write goes on with `ds1` alone, and
//!   neither during the cut nor once healed — `ds2` registers again, the same process with its
//!   old memory — does a read get the old bytes of a dropped replica.
//!
//! The tests run one at a time (a lock), since their bounds are timings on a shared machine.
//! They skip (pass, printing why) without root, `ip`, network namespaces or FUSE.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use testkit::netns::{ProcessCluster, ProcessClusterSpec};
use testkit::{pattern, skip_without_fuse, skip_without_netns};

/// The `citronfs` binary under test.
const BIN: &str = env!("CARGO_BIN_EXE_citronfs");

/// How long a client's read or write on a cut data server may take before it fails: a call
/// fails at the first bound it meets — the fabric's batch and connect bounds (5 s each,
/// `fabric::tcp::{BATCH_TIMEOUT, CONNECT_TIMEOUT}`), or, when it found a connection the kernel
/// had already given up and the meta server no longer counts the server live, the wait for
/// it to register again, which ends 10 s after the call began (fs-client `DATA_SERVER_WAIT`) —
/// plus slack for a loaded 2-core machine.
const IO_BOUND: Duration = Duration::from_secs(12);

/// How long the surviving client may take to finish a sweep of writes over every record of
/// the shared file after the other client was cut while writing all of it: the cut client's
/// hold must be recovered, then the sweep itself runs. CITRON breaks a bakery ticket that
/// stood still for `(Δ + H + 2)·T_lease` (lockmgr `citron::lease`): with `T_lease` = 2 s and
/// this file's tree of height `H` = 2, 10 s after the cut; then each leaf the dead client had
/// set is repaired once it stood still for `T_lease`, one after the other as the sweep
/// reaches it (up to 4 leaves of 64 lock units: 8 s); the breaker's fence waits at most 3 s
/// for the data servers. 21 s in all, and slack for a loaded 2-core machine. (Measured:
/// 10–18 s.)
const RECOVERY_BOUND: Duration = Duration::from_secs(30);

/// How long a call of the *cut* client may take to fail: its data verbs' batch times out
/// (5 s), then it gives its range lock back, which on the same dead link times out too (5 s
/// more, fs-client `io::locked` releases whatever the body returned); slack on top.
/// (Measured: 10.2 s.)
const CUT_CLIENT_IO_BOUND: Duration = Duration::from_secs(15);

/// Cut-client trials per run: at least this many, and more (up to [`MAX_CLIENT_TRIALS`]) until
/// one cut has caught the client holding a lock, so that recovery is always exercised.
const CLIENT_TRIALS: usize = 2;
/// The most cut-client trials per run.
const MAX_CLIENT_TRIALS: usize = 4;

/// Bytes per chunk of the test clusters: small, so that the shared file spans many chunks on
/// both data servers.
const CHUNK: u64 = 64 << 10;

/// A self-describing record of the shared file: writer, sequence number and slot in a header,
/// then a body that is a function of them, so that a torn or misplaced record is caught.
const RECORD: u64 = 24 << 10;
/// Records in the shared file (960 KiB: 15 chunks; a record may straddle two chunks on two
/// servers).
const SLOTS: u64 = 40;
const HEADER: usize = 24;

/// One test at a time: each measures bounds on a machine shared with the other.
static SERIAL: Mutex<()> = Mutex::new(());

fn record(writer: u64, seq: u64, slot: u64) -> Vec<u8> {
    let mut r = Vec::with_capacity(RECORD as usize);
    r.extend_from_slice(&writer.to_le_bytes());
    r.extend_from_slice(&seq.to_le_bytes());
    r.extend_from_slice(&slot.to_le_bytes());
    r.extend_from_slice(&pattern(
        writer << 32 | seq,
        slot * RECORD,
        RECORD as usize - HEADER,
    ));
    r
}

/// Checks every record of `data` (the whole shared file): never written (zeros) or whole.
/// Returns how many were written, by writer (index 1 and 2).
fn check_records(data: &[u8]) -> [u64; 3] {
    let mut by = [0u64; 3];
    assert_eq!(
        data.len() as u64 % RECORD,
        0,
        "the file is not whole records"
    );
    for (slot, r) in data.chunks(RECORD as usize).enumerate() {
        if r.iter().all(|&b| b == 0) {
            continue;
        }
        let word = |i: usize| u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap());
        let (writer, seq, at) = (word(0), word(1), word(2));
        assert!(
            (writer == 1 || writer == 2) && at == slot as u64,
            "slot {slot}: bad header (writer {writer}, seq {seq}, slot {at})"
        );
        assert!(
            r == record(writer, seq, at).as_slice(),
            "slot {slot}: record of writer {writer} seq {seq} is torn"
        );
        by[writer as usize] += 1;
    }
    by
}

/// What a writer thread saw.
#[derive(Default)]
struct Log {
    /// (when it started, how long it took, errno or 0) of each call.
    ops: Vec<(Instant, Duration, i32)>,
    /// When the call in progress started, if one is.
    in_flight: Option<Instant>,
}

/// A thread writing to the shared file at `path` until stopped: writer 1 one record per call,
/// sweeping the slots in order; writer 2 the whole file (every record) per call.
struct Writer {
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Log>>,
    done: mpsc::Receiver<()>,
}

impl Writer {
    fn start(path: PathBuf, writer: u64) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Log::default()));
        let (tx, done) = mpsc::channel();
        let (s, l) = (stop.clone(), log.clone());
        std::thread::spawn(move || {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .expect("open the shared file");
            // The data is made beforehand (a few versions, cycled): making a record is slow
            // in a debug build, and a writer should spend its time in its write calls.
            let (versions, per_call) = if writer == 1 {
                (3u64, 1u64)
            } else {
                (4, SLOTS)
            };
            let calls: Vec<(u64, Vec<u8>)> = (1..=versions * SLOTS / per_call)
                .map(|seq| {
                    let first = (seq * per_call) % SLOTS;
                    let data = (first..first + per_call)
                        .flat_map(|slot| record(writer, seq, slot))
                        .collect();
                    (first * RECORD, data)
                })
                .collect();
            let mut seq = 0u64;
            while !s.load(Ordering::SeqCst) {
                seq += 1;
                let (offset, data) = &calls[seq as usize % calls.len()];
                let offset = *offset;
                let start = Instant::now();
                l.lock().unwrap_or_else(PoisonError::into_inner).in_flight = Some(start);
                let errno = match file.write_all_at(data, offset) {
                    Ok(()) => 0,
                    Err(e) => e.raw_os_error().unwrap_or(-1),
                };
                let mut log = l.lock().unwrap_or_else(PoisonError::into_inner);
                log.in_flight = None;
                log.ops.push((start, start.elapsed(), errno));
                if errno != 0 {
                    // A failed mount stays failed: do not spin on it.
                    drop(log);
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
            let _ = tx.send(());
        });
        Writer { stop, log, done }
    }

    /// Calls finished since `t` (ok, failed).
    fn since(&self, t: Instant) -> (usize, usize) {
        let log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        let after: Vec<_> = log.ops.iter().filter(|(s, _, _)| *s >= t).collect();
        let ok = after.iter().filter(|(_, _, e)| *e == 0).count();
        (ok, after.len() - ok)
    }

    /// Calls that started before `t` and finished (or are still running) after it: how long
    /// after `t` they ended (or so far), and their errno once ended.
    fn straddling(&self, t: Instant) -> Vec<(Duration, Option<i32>)> {
        let log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<_> = log
            .ops
            .iter()
            .filter(|(s, d, _)| *s < t && *s + *d >= t)
            .map(|(s, d, e)| ((*s + *d).saturating_duration_since(t), Some(*e)))
            .collect();
        if log.in_flight.is_some_and(|s| s < t) {
            out.push((t.elapsed(), None));
        }
        out
    }

    /// The longest call that started at or after `t`, and the one in progress.
    fn slowest_since(&self, t: Instant) -> Duration {
        let log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        let done = log
            .ops
            .iter()
            .filter(|(s, _, _)| *s >= t)
            .map(|(_, d, _)| *d)
            .max()
            .unwrap_or_default();
        done.max(log.in_flight.map(|s| s.elapsed()).unwrap_or_default())
    }

    fn in_flight_for(&self) -> Option<Duration> {
        let log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        log.in_flight.map(|s| s.elapsed())
    }

    /// Stops the thread; fails if it does not end within `bound` (a call hanging).
    fn stop(self, bound: Duration, what: &str) -> Log {
        self.stop.store(true, Ordering::SeqCst);
        if self.done.recv_timeout(bound).is_err() {
            panic!("{what}: its call did not return within {bound:?} (hung)");
        }
        Arc::try_unwrap(self.log)
            .map(|m| m.into_inner().unwrap_or_else(PoisonError::into_inner))
            .unwrap_or_default()
    }
}

/// Runs `f` on a thread and waits at most `bound` for it: a hang fails the test instead of
/// hanging it (the thread is left blocked in the kernel until its mount goes away).
fn bounded<T: Send + 'static>(
    bound: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> (T, Duration) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        let out = f();
        let _ = tx.send((out, start.elapsed()));
    });
    rx.recv_timeout(bound)
        .unwrap_or_else(|_| panic!("{what} did not return within {bound:?} (hung)"))
}

/// The wall clock as `HH:MM:SS.mmm` (UTC), to match the servers' logs.
fn utc_now() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let s = t.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        s / 3600,
        s / 60 % 60,
        s % 60,
        t.subsec_millis()
    )
}

fn errno_name(e: i32) -> &'static str {
    match e {
        0 => "ok",
        libc::EIO => "EIO",
        libc::ESTALE => "ESTALE",
        libc::ENOTCONN => "ENOTCONN",
        _ => "other",
    }
}

fn start_cluster() -> ProcessCluster {
    ProcessCluster::start(
        Path::new(BIN),
        &ProcessClusterSpec {
            chunk_size: CHUNK,
            ..ProcessClusterSpec::default()
        },
    )
    .expect("start the cluster")
}

/// Fences the meta server logged: a `Fence` before a lease-rule break ("fencing silent
/// sessions"), or a waiter's question about the silent holder of a lock-tree node ("fencing a
/// silent session").
fn fences_logged(meta_log: &str) -> usize {
    meta_log.matches("fencing silent sessions").count()
        + meta_log.matches("fencing a silent session").count()
}

#[test]
fn cut_client_mid_write() {
    skip_without_netns!();
    skip_without_fuse!();
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut cluster = start_cluster();
    let m1 = cluster.mount(1, &[]).unwrap();
    let shared = m1.join("shared");
    std::fs::write(&shared, vec![0u8; (SLOTS * RECORD) as usize]).unwrap();
    let mut fenced_trials = 0;
    for trial in 0..MAX_CLIENT_TRIALS {
        if trial >= CLIENT_TRIALS && fenced_trials > 0 {
            break;
        }
        let m2 = cluster.mount(2, &[]).unwrap();
        let fences_before = fences_logged(&cluster.meta().output());
        let w1 = Writer::start(shared.clone(), 1);
        let w2 = Writer::start(m2.join("shared"), 2);
        let t = Instant::now();
        testkit::wait_until(Duration::from_secs(30), "both clients writing", || {
            w1.since(t).0 >= 5 && w2.since(t).0 >= 3
        });
        // Cut c2 in the middle of a whole-file write: it (most likely) holds the lock of
        // every record, across chunks on both data servers.
        testkit::wait_until(Duration::from_secs(10), "c2 in a write", || {
            w2.in_flight_for().is_some()
        });
        let cut_at = Instant::now();
        let cut_clock = utc_now();
        cluster.net().cut("c2").unwrap();
        let c2_mid_write = w2.in_flight_for().is_some();

        // c1 keeps working: a whole sweep over every record, started after the cut, finishes
        // within the recovery bound.
        let sweep_from = Instant::now();
        let deadline = sweep_from + RECOVERY_BOUND;
        loop {
            let (ok, failed) = w1.since(sweep_from);
            assert_eq!(
                failed, 0,
                "trial {trial}: c1's writes failed after c2 was cut"
            );
            if ok as u64 >= SLOTS {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "trial {trial}: c1 finished {ok} of {SLOTS} writes within {RECOVERY_BOUND:?} \
                 of c2's cut (slowest call {:?})",
                w1.slowest_since(sweep_from)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let recovered_in = sweep_from.elapsed();
        let c1_slowest = w1.slowest_since(sweep_from);

        // c2's call in progress at the cut returns (fails) within the I/O bound of the cut
        // (counted from the cut, not from now), while the link is still down.
        let mut c2_first = None;
        testkit::wait_until(
            CUT_CLIENT_IO_BOUND.saturating_sub(cut_at.elapsed()),
            "c2's call in progress at the cut to return",
            || {
                let s = w2.straddling(cut_at);
                c2_first = s.iter().find_map(|(d, e)| e.map(|e| (*d, e)));
                s.iter().all(|(_, e)| e.is_some())
            },
        );
        for (ended, _) in w2.straddling(cut_at) {
            assert!(
                ended <= CUT_CLIENT_IO_BOUND,
                "trial {trial}: c2's call in progress at the cut ended {ended:?} after it"
            );
        }
        let c1_log = w1.stop(IO_BOUND, "c1's writer");
        assert!(c1_log.ops.iter().all(|(_, _, e)| *e == 0));

        // Heal: c2's writer ends within a bound (it carries on or fails cleanly).
        cluster.net().heal("c2").unwrap();
        let c2_log = w2.stop(CUT_CLIENT_IO_BOUND * 2, "c2's writer");
        let after_cut: Vec<i32> = c2_log
            .ops
            .iter()
            .filter(|(s, d, _)| *s + *d >= cut_at)
            .map(|(_, _, e)| *e)
            .collect();
        for &e in &after_cut {
            assert!(
                e == 0 || e == libc::EIO || e == libc::ESTALE,
                "trial {trial}: c2's write failed with errno {e}, not EIO/ESTALE"
            );
        }
        // Once healed, the old mount either works or fails cleanly, within the bound.
        let path = m2.join("shared");
        let (healed, took) = bounded(CUT_CLIENT_IO_BOUND, "c2's write after healing", move || {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.write_all_at(&record(2, u64::MAX, 0), 0))
                .map_err(|e| e.raw_os_error().unwrap_or(-1))
        });
        let healed_errno = healed.err().unwrap_or(0);
        assert!(
            [0, libc::EIO, libc::ESTALE].contains(&healed_errno),
            "trial {trial}: after healing c2 got errno {healed_errno}"
        );

        // A fresh mount on c2 works, and sees what c1 wrote. Right after the heal, c2's
        // kernel may still hold failed neighbour (ARP) entries from the cut and answer
        // EHOSTUNREACH for a few seconds, as on a real host whose cable was replugged: a mount
        // that fails so is retried, within a bound.
        let remount_from = Instant::now();
        let fresh = loop {
            match cluster.mount(2, &[]) {
                Ok(path) => break path,
                Err(e) if remount_from.elapsed() < IO_BOUND * 2 => {
                    println!("trial {trial}: a fresh mount on c2 failed, retrying: {e:#}");
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => panic!("trial {trial}: no fresh mount on c2 after healing: {e:#}"),
            }
        };
        let remounted_in = remount_from.elapsed();
        let probe = record(2, 1 << 40 | trial as u64, SLOTS - 1);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(fresh.join("shared"))
            .unwrap();
        f.write_all_at(&probe, (SLOTS - 1) * RECORD).unwrap();
        let mut back = vec![0u8; RECORD as usize];
        std::fs::File::open(&shared)
            .unwrap()
            .read_exact_at(&mut back, (SLOTS - 1) * RECORD)
            .unwrap();
        assert!(
            back == probe,
            "trial {trial}: c1 does not see c2's fresh write"
        );

        let data = std::fs::read(&shared).unwrap();
        let by = check_records(&data);
        let fences = fences_logged(&cluster.meta().output()) - fences_before;
        if fences > 0 {
            fenced_trials += 1;
        }
        println!(
            "trial {trial}: c2 cut at {cut_clock} UTC, mid-write: {c2_mid_write}; c1's sweep after the cut \
             took {recovered_in:?} (slowest write {c1_slowest:?}); c2's call at the cut: \
             {:?}; c2's writes ending after the cut: {:?}; c2 after healing: {} in {took:?}; \
             fresh mount on c2 after {remounted_in:?}; fences: {fences}; records by c1/c2: \
             {}/{}",
            c2_first.map(|(d, e)| (d, errno_name(e))),
            after_cut.iter().map(|&e| errno_name(e)).collect::<Vec<_>>(),
            errno_name(healed_errno),
            by[1],
            by[2],
        );
        cluster.unmount(2);
    }
    // A trial whose cut caught c2 holding a lock (the usual case) made c1 break it, after
    // fencing c2; at least one must have.
    assert!(
        fenced_trials > 0,
        "no trial needed a fence: the cut never caught c2 holding a lock"
    );
}

#[test]
fn cut_data_server() {
    skip_without_netns!();
    skip_without_fuse!();
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut cluster = start_cluster();
    let m1 = cluster.mount(1, &[]).unwrap();
    let m2 = cluster.mount(2, &[]).unwrap();
    const CHUNKS: u64 = 8;
    let mut expected: Vec<Vec<u8>> = (0..CHUNKS)
        .map(|c| pattern(5, c * CHUNK, CHUNK as usize))
        .collect();
    std::fs::write(m1.join("striped"), expected.concat()).unwrap();

    // Cut ds2. Read every chunk at once from c1: those on ds2 fail with EIO within the bound,
    // the others succeed.
    cluster.net().cut("ds2").unwrap();
    let cut_at = Instant::now();
    let reads = read_chunks(&m1.join("striped"), CHUNKS);
    let failed: Vec<u64> = (0..CHUNKS)
        .filter(|&c| reads[c as usize].1.is_err())
        .collect();
    for (c, (took, result)) in reads.iter().enumerate() {
        assert!(
            *took < IO_BOUND,
            "chunk {c}: the read took {took:?}, over {IO_BOUND:?}"
        );
        match result {
            Ok(data) => assert!(
                *data == expected[c],
                "chunk {c} read back wrong data while ds2 was cut"
            ),
            Err(e) => assert_eq!(*e, libc::EIO, "chunk {c}: errno {e}, not EIO"),
        }
    }
    // The first CHUNK bytes are the file's small first chunks (4 KiB, 4 KiB, 8 KiB, ...:
    // `proto::layout`), striped over both servers, so that piece fails; from CHUNK on, each
    // piece is one chunk, and chunks are striped: exactly every other piece is on ds2.
    assert_eq!(failed.first(), Some(&0), "failed pieces {failed:?}");
    let striped: Vec<u64> = failed.iter().copied().filter(|&c| c > 0).collect();
    assert!(
        !striped.is_empty()
            && striped.len() as u64 == (CHUNKS - striped[0]).div_ceil(2)
            && striped.windows(2).all(|w| w[1] - w[0] == 2),
        "failed pieces {failed:?} are not every other one after the first"
    );
    let on_ds2 = striped[0];
    let on_ds1 = if on_ds2 == 1 { 2 } else { on_ds2 - 1 };

    // Writes from c2: to a chunk on ds1 succeed, to one on ds2 fail with EIO, in bound.
    let fresh = pattern(6, 0, CHUNK as usize);
    let write = |chunk: u64, data: Vec<u8>| {
        let path = m2.join("striped");
        bounded(IO_BOUND * 2, "a write while ds2 is cut", move || {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.write_all_at(&data, chunk * CHUNK))
                .map_err(|e| e.raw_os_error().unwrap_or(-1))
        })
    };
    let (ok, took_ok) = write(on_ds1, fresh.clone());
    assert_eq!(ok, Ok(()), "a write to chunk {on_ds1} on ds1");
    expected[on_ds1 as usize] = fresh.clone();
    let (bad, took_bad) = write(on_ds2, fresh.clone());
    assert_eq!(bad, Err(libc::EIO), "a write to chunk {on_ds2} on ds2");
    assert!(took_ok < IO_BOUND && took_bad < IO_BOUND);
    let longest_failure = reads
        .iter()
        .filter(|r| r.1.is_err())
        .map(|r| r.0)
        .max()
        .unwrap_or_default()
        .max(took_bad);
    let longest_success = reads
        .iter()
        .filter(|r| r.1.is_ok())
        .map(|r| r.0)
        .max()
        .unwrap_or_default()
        .max(took_ok);

    // Heal: every chunk reads back what it held (ds2 kept its memory; the failed write never
    // landed), from both clients, within a bound.
    cluster.net().heal("ds2").unwrap();
    let healed_at = Instant::now();
    let mut last = Vec::new();
    let whole = (0..)
        .map(|_| {
            last = read_chunks(&m1.join("striped"), CHUNKS);
            last.iter().all(|r| r.1.is_ok())
        })
        .take_while(|&ok| !ok && healed_at.elapsed() < IO_BOUND * 2)
        .count();
    let reads_ok = last.iter().all(|r| r.1.is_ok());
    assert!(
        reads_ok,
        "chunks unreadable {:?} after healing ds2",
        healed_at.elapsed()
    );
    let readable_in = healed_at.elapsed();
    for (c, (_, r)) in last.iter().enumerate() {
        assert!(
            *r.as_ref().unwrap() == expected[c],
            "chunk {c} holds other data after healing"
        );
    }
    let from_c2 = std::fs::read(m2.join("striped")).unwrap();
    assert!(from_c2 == expected.concat(), "c2 reads other data");
    println!(
        "ds2 cut: chunks {failed:?} failed with EIO (slowest failure {longest_failure:?}, \
         slowest success {longest_success:?}, {:?} after the cut; c2's writes: to ds1 ok in \
         {took_ok:?}, to ds2 EIO in {took_bad:?}); healed: all chunks readable after \
         {readable_in:?} ({whole} failed rounds)",
        cut_at.elapsed()
    );
}

/// How long the first access after a heal may take: a fresh connection and the I/O, well
/// under the fabric's 5 s batch bound, so that neither a wait for a dead connection's timeout
/// nor a lock left to lazy recovery (`T_lease` = 2 s per step) fits in it.
const HEALED_BOUND: Duration = Duration::from_millis(1500);

/// How long `heal_data_server` keeps `ds2` cut off from the clients: longer than a client
/// connection's dead-peer bound (`fabric::tcp::watch_peer_within` the 5 s batch bound), so
/// that the kernel gives up the idle client's connections to `ds2` while it is cut.
const HEAL_CUT: Duration = Duration::from_secs(7);

#[test]
fn heal_data_server() {
    skip_without_netns!();
    skip_without_fuse!();
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut cluster = start_cluster();
    let m1 = cluster.mount(1, &[]).unwrap();
    let m2 = cluster.mount(2, &[]).unwrap();
    const CHUNKS: u64 = 8;
    let expected: Vec<Vec<u8>> = (0..CHUNKS)
        .map(|c| pattern(7, c * CHUNK, CHUNK as usize))
        .collect();
    std::fs::write(m1.join("striped"), expected.concat()).unwrap();
    // Both clients read everything once: their workers connect to both data servers.
    for m in [&m1, &m2] {
        for (c, (_, r)) in read_chunks(&m.join("striped"), CHUNKS).iter().enumerate() {
            assert!(
                r.as_ref().ok() == Some(&expected[c]),
                "chunk {c} before the cut"
            );
        }
    }

    // Cut the paths from both clients to ds2 (the meta server keeps hearing from ds2, so the
    // layout does not change: the clients keep their connections, which die silently). c1
    // reads every chunk while cut (those on ds2 fail); c2 stays idle.
    for client in ["c1", "c2"] {
        cluster.net().cut_between(client, "ds2").unwrap();
    }
    let cut_at = Instant::now();
    let during = read_chunks(&m1.join("striped"), CHUNKS);
    let failed: Vec<u64> = (0..CHUNKS)
        .filter(|&c| during[c as usize].1.is_err())
        .collect();
    assert!(!failed.is_empty(), "no read failed while ds2 was cut off");
    std::thread::sleep(HEAL_CUT.saturating_sub(cut_at.elapsed()));
    for client in ["c1", "c2"] {
        cluster.net().heal_between(client, "ds2").unwrap();
    }

    // The idle client's first read after the heal succeeds, promptly.
    let path = m2.join("striped");
    let (idle_first, idle_took) = bounded(IO_BOUND * 2, "c2's first read after the heal", {
        move || std::fs::read(&path).map_err(|e| e.raw_os_error().unwrap_or(-1))
    });
    // The client whose reads failed during the cut: no stall on its first access of them.
    let mut c1_after = Vec::new();
    for &c in &failed {
        let path = m1.join("striped");
        let (r, took) = bounded(IO_BOUND * 2, "c1's first read after the heal", move || {
            read_chunk(&path, c)
        });
        c1_after.push((c, took, r));
    }
    // The other client writes those chunks (what they hold): no stall behind the parts of
    // c1's locks that its failed reads released late (left to lazy recovery).
    let mut c2_writes = Vec::new();
    for &c in &failed {
        let path = m2.join("striped");
        let data = expected[c as usize].clone();
        let (r, took) = bounded(IO_BOUND * 2, "c2's first write after the heal", move || {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.write_all_at(&data, c * CHUNK))
                .map_err(|e| e.raw_os_error().unwrap_or(-1))
        });
        c2_writes.push((c, took, r));
    }
    println!(
        "ds2 cut off from both clients for {HEAL_CUT:?}: c1's reads of chunks {failed:?} \
         failed; c2 (idle through the cut) first read: {} in {idle_took:?}; c1's first reads \
         of the failed chunks: {:?}; c2's writes of them: {:?}",
        errno_name(idle_first.as_ref().err().copied().unwrap_or(0)),
        outcomes(&c1_after),
        outcomes(&c2_writes)
    );
    match idle_first {
        Ok(data) => assert!(
            data == expected.concat(),
            "c2 read other data after the heal"
        ),
        Err(e) => panic!("c2's first read after the heal failed with errno {e}"),
    }
    assert!(
        idle_took < HEALED_BOUND,
        "c2's first read after the heal took {idle_took:?}, over {HEALED_BOUND:?}"
    );
    for (c, took, r) in c1_after {
        assert!(
            r.as_ref().ok() == Some(&expected[c as usize]),
            "c1's first read of chunk {c} after the heal: {r:?}"
        );
        assert!(
            took < HEALED_BOUND,
            "c1's first read of chunk {c} after the heal took {took:?}, over {HEALED_BOUND:?}"
        );
    }
    for (c, took, r) in c2_writes {
        assert_eq!(r, Ok(()), "c2's write of chunk {c} after the heal");
        assert!(
            took < HEALED_BOUND,
            "c2's write of chunk {c} after the heal took {took:?}, over {HEALED_BOUND:?}"
        );
    }
    let whole = std::fs::read(m1.join("striped")).unwrap();
    assert!(whole == expected.concat(), "c1 reads other data at the end");
}

/// How long the other client's reads of a range may take once a write to it failed because the
/// writer's path to a data server went silent: the writer's lock must be free by then. Three
/// quarters of the lock lease (`T_lease` = 2 s): a lock released late leaves the range to lazy
/// recovery, which waits a whole `T_lease` first. (Measured: 3–430 ms; 4.0 s when released
/// late.)
const FREED_BOUND: Duration = Duration::from_millis(1500);

/// The writer's path to `ds2` goes silent (`Network::cut_between`) while it holds a range lock
/// over chunks on both data servers; its write fails, and the other client's reads of both
/// chunks succeed at once afterwards. The writer's batch to `ds2` expires ahead of the lock's
/// lease, so it gets its call back while the lease still runs and releases the lock in time.
/// Before, it waited out the fabric's 5 s batch bound, released after the 2 s lease, and left
/// the lock's leaf bits for lazy recovery: the other client's reads then waited 2 s or more.
#[test]
fn a_write_cut_from_its_data_server_frees_its_range_within_its_lease() {
    skip_without_netns!();
    skip_without_fuse!();
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut cluster = start_cluster();
    let m1 = cluster.mount(1, &[]).unwrap();
    let m2 = cluster.mount(2, &[]).unwrap();
    const CHUNKS: u64 = 4;
    let before = pattern(11, 0, (CHUNKS * CHUNK) as usize);
    std::fs::write(m1.join("shared"), &before).unwrap();
    // Both clients have read the file: their workers are connected to both data servers.
    for m in [&m1, &m2] {
        assert!(std::fs::read(m.join("shared")).unwrap() == before);
    }

    // Chunks 1 and 2 are on different data servers (striped): c1's write of both holds one
    // range lock over both, and its batch to ds2 gets no answer.
    cluster.net().cut_between("c1", "ds2").unwrap();
    let path = m1.join("shared");
    let (write, write_took) = bounded(IO_BOUND * 2, "c1's write across the cut", move || {
        let data = pattern(12, CHUNK, 2 * CHUNK as usize);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| f.write_all_at(&data, CHUNK))
            .map_err(|e| e.raw_os_error().unwrap_or(-1))
    });
    // c2 reaches both servers: its reads of the two chunks find the range free.
    let mut reads = Vec::new();
    for c in [1, 2] {
        let path = m2.join("shared");
        let (r, took) = bounded(
            IO_BOUND * 2,
            "c2's read after c1's write failed",
            move || read_chunk(&path, c).map(drop),
        );
        reads.push((c, took, r));
    }
    cluster.net().heal_between("c1", "ds2").unwrap();
    println!(
        "c1's write across its cut path to ds2: {} after {write_took:?}; c2's reads of chunks \
         1 and 2 then: {:?}",
        errno_name(write.err().unwrap_or(0)),
        outcomes(&reads)
    );
    assert_eq!(write, Err(libc::EIO), "c1's write with its path to ds2 cut");
    for (c, took, r) in reads {
        assert_eq!(r, Ok(()), "c2's read of chunk {c}");
        assert!(
            took < FREED_BOUND,
            "c2's read of chunk {c} took {took:?} after c1's write failed, over \
             {FREED_BOUND:?}: c1's lock was not released in time"
        );
    }
}

/// Each chunk's access of `results` (chunk, how long, outcome) with its outcome named.
fn outcomes<T>(results: &[(u64, Duration, Result<T, i32>)]) -> Vec<(u64, Duration, &str)> {
    results
        .iter()
        .map(|(c, took, r)| {
            (
                *c,
                *took,
                errno_name(r.as_ref().err().copied().unwrap_or(0)),
            )
        })
        .collect()
}

/// Chunk `c` of the file at `path`, or the errno its read failed with.
fn read_chunk(path: &Path, c: u64) -> Result<Vec<u8>, i32> {
    let mut buf = vec![0u8; CHUNK as usize];
    std::fs::File::open(path)
        .and_then(|f| f.read_exact_at(&mut buf, c * CHUNK))
        .map(|()| buf)
        .map_err(|e| e.raw_os_error().unwrap_or(-1))
}

/// Reads chunks `0..n` of `path` at once, one thread each: (how long, the data or errno).
/// Fails the test if any read does not return within twice the I/O bound.
fn read_chunks(path: &Path, n: u64) -> Vec<(Duration, Result<Vec<u8>, i32>)> {
    let left = Arc::new(AtomicU64::new(n));
    let threads: Vec<_> = (0..n)
        .map(|c| {
            let path = path.to_path_buf();
            let left = left.clone();
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let start = Instant::now();
                let r = read_chunk(&path, c);
                left.fetch_sub(1, Ordering::SeqCst);
                let _ = tx.send((start.elapsed(), r));
            });
            rx
        })
        .collect();
    let deadline = Instant::now() + IO_BOUND * 2;
    threads
        .into_iter()
        .enumerate()
        .map(|(c, rx)| {
            rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| {
                    panic!(
                        "reading chunk {c} hung ({} reads still running)",
                        left.load(Ordering::SeqCst)
                    )
                })
        })
        .collect()
}

/// How long the meta server takes to mark a data server it no longer hears from down and drop
/// its replicas: its silence bound (`rpc::DATA_SERVER_SILENCE`, 5 s) after the server's last
/// revocation poll (one a second), plus slack for a loaded 2-core machine.
const DOWN_BOUND: Duration = Duration::from_secs(15);

/// How long a data server cut off from the meta server takes to register again once healed:
/// its connection to the meta server, closed at the other end during the cut, is found dead at
/// the next packet or after the peer-silence bound (10 s, `fabric::tcp::watch_peer`); slack on
/// top.
const BACK_BOUND: Duration = Duration::from_secs(30);

/// setxattr(2) of `citronfs.replicas` = `factor` on `dir`.
fn set_replicas(dir: &Path, factor: u32) {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    let name = std::ffi::CString::new(proto::REPLICAS_XATTR).unwrap();
    let value = factor.to_string();
    // SAFETY: both strings are NUL-terminated, and the value's pointer and length describe it.
    let r = unsafe {
        libc::setxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr: {}", std::io::Error::last_os_error());
}

/// A data server that never died, only cut off from the meta server and from one client (the
/// other still reaches it), is marked down after the meta server's silence bound, and its
/// replicas of a file of two replicas are dropped: the cut client's write of the whole file
/// then succeeds with `ds1` alone (before drops, it waited for `ds2` and failed with EIO).
/// The other client, which reaches `ds2` throughout, reads the new data; healed, `ds2` — the
/// same process, with its old memory and incarnation — registers again, and no read of either
/// client gets the old bytes its dropped replicas still hold.
#[test]
fn a_replica_server_cut_from_the_meta_server_is_dropped_for_good() {
    skip_without_netns!();
    skip_without_fuse!();
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut cluster = ProcessCluster::start(
        Path::new(BIN),
        &ProcessClusterSpec {
            chunk_size: CHUNK,
            // The meta server says when it registers a data server.
            log: "warn,meta_server::registry=info".into(),
            ..ProcessClusterSpec::default()
        },
    )
    .expect("start the cluster");
    let m1 = cluster.mount(1, &[]).unwrap();
    let m2 = cluster.mount(2, &[]).unwrap();
    std::fs::create_dir(m1.join("two")).unwrap();
    set_replicas(&m1.join("two"), 2);
    const CHUNKS: u64 = 8;
    let old = pattern(21, 0, (CHUNKS * CHUNK) as usize);
    std::fs::write(m1.join("two/f"), &old).unwrap();
    for m in [&m1, &m2] {
        assert!(std::fs::read(m.join("two/f")).unwrap() == old);
    }
    let registered = |cluster: &mut ProcessCluster| {
        cluster
            .meta()
            .output()
            .matches("data server registered")
            .count()
    };
    assert_eq!(registered(&mut cluster), 2);

    for host in ["meta", "c1"] {
        cluster.net().cut_between(host, "ds2").unwrap();
    }
    let cut_at = Instant::now();
    cluster
        .meta()
        .wait_for_output("dropped the replicas", DOWN_BOUND)
        .expect("the meta server drops ds2's replicas");
    let down_after = cut_at.elapsed();
    let new = pattern(22, 0, old.len());
    let path = m1.join("two/f");
    let data = new.clone();
    // In place (no truncate, which would free the chunks): the chunks keep their dropped
    // replicas, whose blocks on ds2 keep the old bytes.
    let (written, write_took) = bounded(IO_BOUND * 2, "c1's write with ds2 down", move || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| f.write_all_at(&data, 0))
            .map_err(|e| e.raw_os_error().unwrap_or(-1))
    });
    assert_eq!(written, Ok(()), "c1's write with ds2 down");
    // c2 reaches ds2, which still holds the old bytes: it reads the new ones.
    for c in 0..CHUNKS {
        let at = (c * CHUNK) as usize;
        let got = read_chunk(&m2.join("two/f"), c);
        assert!(
            got.as_deref() == Ok(&new[at..at + CHUNK as usize]),
            "during the cut: chunk {c} does not read the new data"
        );
    }

    for host in ["meta", "c1"] {
        cluster.net().heal_between(host, "ds2").unwrap();
    }
    let deadline = Instant::now() + BACK_BOUND;
    while registered(&mut cluster) < 3 {
        assert!(
            Instant::now() < deadline,
            "ds2 did not register again within {BACK_BOUND:?} of the heal"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "ds2 cut off from the meta server: marked down and its replicas dropped after \
         {down_after:?}; c1's write of the file then took {write_took:?}; ds2 registered again \
         after the heal"
    );
    // Chunk by chunk (each client reads a chunk from the replica its session picks: half of
    // them would be ds2's), a few times over, from both clients.
    for round in 0..3 {
        for m in [&m1, &m2] {
            for c in 0..CHUNKS {
                let at = (c * CHUNK) as usize;
                let got = read_chunk(&m.join("two/f"), c);
                assert!(
                    got.as_deref() == Ok(&new[at..at + CHUNK as usize]),
                    "round {round}, {}: chunk {c} does not read the new data",
                    m.display()
                );
            }
        }
    }
}
