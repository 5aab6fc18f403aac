//! A client process stopped (SIGSTOP) past its lock's lease while another client writes the
//! same range, then continued: its stalled `pwrite` returns within a bound (no wait forever on
//! a ticket that recovery passed over), and it never lands data under a lock that was broken
//! meanwhile — every read of the range, through either mount, shows one whole record, except
//! the tear that is in the nature of striping: a write of A's cut between its per-server
//! batches — by the stop, or by its lease running out there — seen until B's next write
//! ([`explain_tear`]); such a write fails, never reported done.
//!
//! On the tcp fabric this holds by fencing: the client that breaks the lock first has the
//! silent session revoked on every fabric server, so the stopped client's verbs are refused
//! when it continues, and its write fails. With the `rdma` feature the same runs on the rdma
//! fabric (its provider from `CITRONFS_RDMA_PROVIDER`, `soft` in CI), where the fence moves the
//! session's queue pairs to the error state. (On shm a stopped client
//! cannot be fenced; docs/ARCHITECTURE.md "Fencing" and docs/ARCHITECTURE.md say what holds there.)

use fs_client::LockScheme;
use rand::Rng;
use std::collections::{BTreeSet, HashMap};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use testkit::Backend;
use testkit::ClusterExt;
use testkit::{skip_without_fuse, ChildMount, Cluster, ClusterSpec};

/// The client processes run this test (see `ClusterExt::spawn_mount_process`).
#[test]
fn child_mount() {
    testkit::child_mount_main();
}

const BLOCK: usize = 4096;
const RECORD: usize = 1 << 20;

/// A record: every 4 KiB block holds (writer, seq) repeated.
fn record(writer: u32, seq: u32) -> Vec<u8> {
    let mut tag = [0u8; 8];
    tag[..4].copy_from_slice(&writer.to_le_bytes());
    tag[4..].copy_from_slice(&seq.to_le_bytes());
    tag.iter().copied().cycle().take(RECORD).collect()
}

/// A page-aligned buffer of `RECORD` bytes inside `backing`, so that the kernel hands each
/// call to the client whole on any machine (this test is about stopped clients; buffer
/// alignment has its own test, atomic_io.rs).
fn aligned(backing: &mut Vec<u8>) -> &mut [u8] {
    backing.resize(RECORD + BLOCK, 0);
    let skip = backing.as_ptr().align_offset(BLOCK);
    &mut backing[skip..skip + RECORD]
}

/// The (writer, seq) of each block of a read record.
fn tags(buf: &[u8]) -> Vec<(u32, u32)> {
    buf.chunks(BLOCK)
        .map(|b| {
            let w = u32::from_le_bytes(b[..4].try_into().unwrap());
            let s = u32::from_le_bytes(b[4..8].try_into().unwrap());
            (w, s)
        })
        .collect()
}

/// `Err` describing the mix when `buf` is not one whole record.
fn whole(buf: &[u8]) -> Result<(u32, u32), String> {
    let t = tags(buf);
    let first = t[0];
    let bad: Vec<usize> = (0..t.len()).filter(|&i| t[i] != first).collect();
    let intact = buf.chunks(8).all(|c| c == &buf[..8]);
    if bad.is_empty() && intact {
        return Ok(first);
    }
    Err(format!(
        "torn read: block 0 is {first:?}, {} of {} blocks differ (first {:?} at block {})",
        bad.len(),
        t.len(),
        bad.first().map(|&i| t[i]),
        bad.first().copied().unwrap_or(0)
    ))
}

/// The records a read's blocks come from; `Err` when a block is itself not one record's.
fn records(buf: &[u8]) -> Result<BTreeSet<(u32, u32)>, String> {
    let mut found = BTreeSet::new();
    for (i, block) in buf.chunks(BLOCK).enumerate() {
        if !block.chunks(8).all(|c| c == &block[..8]) {
            return Err(format!("block {i} is torn within itself"));
        }
        found.insert(tags(block)[0]);
    }
    Ok(found)
}

/// A read of B's that was not one whole record.
struct TornRead {
    /// B's write just before it.
    after_write: u32,
    /// The records its blocks come from.
    records: BTreeSet<(u32, u32)>,
    /// [`whole`]'s description of it.
    what: String,
    /// When B's write just before it started and returned, and when the read did.
    spans: [(Instant, Instant); 2],
}

/// When each of A's writes started, and whether A was told it succeeded.
type AWrites = HashMap<u32, (Instant, bool)>;

/// Accepts a torn read only as the mark of a write of A's cut by a stop, which is in the
/// nature of striping and which no lock can hide: A's write `s` sends one batch per data
/// server, one after the other; stopped between them, only the first server has its part.
/// B breaks A's lock and reads that half-landed write under the record beneath it, until its
/// own next write replaces both. A tells its caller `s` failed (it was fenced), as a client
/// killed there never acknowledges it (`crash.rs`, "between the per-server batches").
///
/// So the read must show exactly two records: `(1, s)` for a write of A's that was in
/// progress at a stop (the first stop after it started) and did not succeed, and beneath it a
/// record that was complete before that stop — an earlier write of A's, or a write of B's that
/// returned before the stop. A write of A's landing after B broke its lock shows up as
/// A's record over a write of B's made *after* the stop, and is refused. (A late part landing
/// right after the break, before B has written anything, looks the same as the cut write —
/// and overwrites nothing of B's.)
fn explain_tear(
    torn: &TornRead,
    stops: &[Instant],
    a_writes: &AWrites,
    b_done: &[Instant],
) -> Result<(), String> {
    let fail = |why: String| {
        Err(format!(
            "B, after its write {}: {}: {why}",
            torn.after_write, torn.what
        ))
    };
    let recs: Vec<(u32, u32)> = torn.records.iter().copied().collect();
    if recs.len() != 2 {
        return fail(format!("{} records mixed, not 2", recs.len()));
    }
    // The partial one is A's, the later of A's when both are.
    let (top, beneath) = match (recs[0], recs[1]) {
        ((1, x), (1, y)) => ((1, x.max(y)), (1, x.min(y))),
        (a @ (1, _), b) | (b, a @ (1, _)) => (a, b),
        _ => return fail("no record of A's in it".into()),
    };
    let Some(&(started, ok)) = a_writes.get(&top.1) else {
        return fail(format!("A never made write {}", top.1));
    };
    if ok {
        return fail(format!(
            "A's write {} succeeded, yet only part of it is there",
            top.1
        ));
    }
    let beneath_done = match beneath {
        (1, _) => Some(started),
        (2, k) => b_done.get(k as usize - 1).copied(),
        _ => None,
    };
    // The stop that cut it: the first after it started (A makes one write at a time).
    let cut_by = stops.iter().copied().filter(|&stop| started < stop).min();
    let cut_by_a_stop = cut_by.is_some_and(|stop| beneath_done.is_some_and(|done| done < stop));
    if !cut_by_a_stop {
        return fail(format!(
            "A's failed write {} lies over {beneath:?}, which was not complete before any stop \
             that cut it: a write of A's landed after its lock was broken",
            top.1
        ));
    }
    Ok(())
}

/// What A's client process logs of a write that failed for a lease lost partway
/// (`fs_client::Error::LeaseLostPartway`).
const PARTWAY: &str = "lease ran out partway through the change";

/// The write of A's a torn read shows over one other record, if that write failed (the
/// record [`explain_tear`] takes for the partial one).
fn failed_top(torn: &TornRead, a_writes: &AWrites) -> Option<u32> {
    let recs: Vec<(u32, u32)> = torn.records.iter().copied().collect();
    let top = match recs[..] {
        [(1, x), (1, y)] => x.max(y),
        [(1, x), _] | [_, (1, x)] => x,
        _ => return None,
    };
    a_writes
        .get(&top)
        .is_some_and(|&(_, ok)| !ok)
        .then_some(top)
}

/// A torn read's surroundings, for the failure message: B's write and read, A's write under
/// them, and the stops near them, in milliseconds from `began` (whose wall-clock time is given,
/// to find them in the logs).
fn timeline(
    torn: &TornRead,
    began: (Instant, std::time::SystemTime),
    stops: &[Instant],
    stopped_for: Duration,
    a_spans: &HashMap<u32, (Instant, Instant)>,
) -> String {
    let ms = |t: Instant| t.saturating_duration_since(began.0).as_secs_f64() * 1e3;
    let span = |(s, e): (Instant, Instant)| format!("{:.1}..{:.1} ms", ms(s), ms(e));
    let since_epoch = began
        .1
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut out = format!(
        "timeline from {:.6} s since the epoch: B's write {}: {}; B's read: {}",
        since_epoch.as_secs_f64(),
        torn.after_write,
        span(torn.spans[0]),
        span(torn.spans[1])
    );
    for (w, s) in &torn.records {
        if *w == 1 {
            if let Some(&sp) = a_spans.get(s) {
                out += &format!("; A's write {s}: {}", span(sp));
            }
        }
    }
    let (from, to) = (torn.spans[0].0, torn.spans[1].1);
    for &stop in stops {
        let resume = stop + stopped_for;
        if resume + Duration::from_secs(5) > from && stop < to + Duration::from_secs(5) {
            out += &format!("; A stopped {}", span((stop, resume)));
        }
    }
    out
}

/// How [`pause_past_lease`] stops A.
struct Stops {
    /// How many times A is stopped.
    pauses: usize,
    /// How long each stop lasts: past the lock's patience, so that B breaks A's lock.
    stopped_for: Duration,
    /// How long A runs after each stop, at most: each gap is drawn from `[gap/8, gap]` (a
    /// stop falls anywhere in A's write cycle).
    gap: Duration,
}

/// A writes 1 MiB records over [0, 1 MiB) through its mount; B writes and reads back the same
/// range through its own; A's client process is stopped as `how` says.
fn pause_past_lease(spec: ClusterSpec, how: Stops) {
    skip_without_fuse!();
    testkit::init_logging();
    let fabric = spec.fabric;
    let began = (Instant::now(), std::time::SystemTime::now());
    let cluster = Cluster::start(spec).unwrap();
    let a: ChildMount = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b: ChildMount = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    std::fs::write(a.path().join("f"), record(0, 0)).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let open = |dir: &Path| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join("f"))
            .unwrap()
    };
    // A: writes; reports each call's start, outcome and how long it took.
    let (a_tx, a_rx) = mpsc::channel::<(u32, Instant, Result<(), String>, Duration)>();
    let fa = open(a.path());
    let a_stop = stop.clone();
    let writer_a = std::thread::spawn(move || {
        let mut seq = 0;
        let mut backing = Vec::new();
        while !a_stop.load(Ordering::Relaxed) {
            seq += 1;
            let buf = aligned(&mut backing);
            buf.copy_from_slice(&record(1, seq));
            let t = Instant::now();
            let r = fa.write_all_at(buf, 0).map_err(|e| e.to_string());
            let _ = a_tx.send((seq, t, r, t.elapsed()));
        }
    });
    // B: writes, then reads the range back; every read must be one whole record, or else is
    // kept for `explain_tear` (with when each of B's writes returned).
    let fb = open(b.path());
    let (b_stop, b_reads) = (stop.clone(), reads.clone());
    type BRun = (u32, Vec<Instant>, Vec<TornRead>);
    let writer_b = std::thread::spawn(move || -> Result<BRun, String> {
        let mut seq = 0;
        let (mut done, mut torn) = (Vec::new(), Vec::new());
        let (mut wbacking, mut rbacking) = (Vec::new(), Vec::new());
        while !b_stop.load(Ordering::Relaxed) {
            seq += 1;
            let wbuf = aligned(&mut wbacking);
            wbuf.copy_from_slice(&record(2, seq));
            let write_began = Instant::now();
            fb.write_all_at(wbuf, 0)
                .map_err(|e| format!("B's write {seq}: {e}"))?;
            let write_done = Instant::now();
            done.push(write_done);
            let rbuf = aligned(&mut rbacking);
            fb.read_exact_at(rbuf, 0)
                .map_err(|e| format!("B's read: {e}"))?;
            let read_done = Instant::now();
            if let Err(what) = whole(rbuf) {
                let records =
                    records(rbuf).map_err(|e| format!("B, after its write {seq}: {e}"))?;
                torn.push(TornRead {
                    after_write: seq,
                    records,
                    what,
                    spans: [(write_began, write_done), (write_done, read_done)],
                });
            }
            b_reads.fetch_add(1, Ordering::Relaxed);
        }
        Ok((seq, done, torn))
    });

    // Stops long enough for B to presume A dead and break its lock (CITRON's patience is a
    // few `T_lease`: (Δ + H + 2)·2 s on this 1 MiB range's height-1 node; sometimes that runs
    // out just after A continues, the race the fence's resumed window covers), with B's progress
    // while A is stopped counted to show it.
    let Stops {
        pauses,
        stopped_for,
        gap,
    } = how;
    let mut b_while_stopped = 0;
    let mut stops = Vec::new();
    let mut rng = rand::rng();
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..pauses {
        stops.push(Instant::now());
        let resume = a.stop();
        let before = reads.load(Ordering::Relaxed);
        std::thread::sleep(stopped_for);
        b_while_stopped += reads.load(Ordering::Relaxed) - before;
        drop(resume);
        std::thread::sleep(rng.random_range(gap / 8..=gap));
    }
    stop.store(true, Ordering::Relaxed);

    // Every call of A returns, within a bound of its stop plus recovery.
    let bound = stopped_for + Duration::from_secs(10);
    let deadline = Instant::now() + bound;
    let (mut a_ok, mut a_fenced, mut slowest) = (Vec::new(), 0, Duration::ZERO);
    let mut a_writes = AWrites::new();
    let mut a_spans = HashMap::new();
    loop {
        match a_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((seq, started, r, took)) => {
                slowest = slowest.max(took);
                a_writes.insert(seq, (started, r.is_ok()));
                a_spans.insert(seq, (started, started + took));
                match r {
                    Ok(()) => a_ok.push(seq),
                    // Fenced: its session was revoked when B broke its lock; the write in
                    // flight fails, and A joins again in a new session for the next ones.
                    Err(e) if e.contains("os error 5") => a_fenced += 1,
                    Err(e) => panic!("A's write {seq} failed with something else than EIO: {e}"),
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                "A's pwrite did not return within {bound:?} of the last SIGCONT \
                 (a wait that never ends); A's output:\n{}",
                a.output()
            ),
        }
    }
    writer_a.join().unwrap();
    let (b_writes, b_done, torn) = writer_b.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
    // A torn read no stop explains may still show a write of A's whose lease ran out partway
    // (`fs_client::Error::LeaseLostPartway`: its part landed under a lock still A's, was read
    // after A released, and the write failed). A's client process logs each such failure;
    // more such tears than logged failures means a write landed after its lock was broken.
    let partway_failures = a.log().matches(PARTWAY).count();
    let mut partway = BTreeSet::new();
    for t in &torn {
        if let Err(e) = explain_tear(t, &stops, &a_writes, &b_done) {
            let why = format!("{e}\n{}", timeline(t, began, &stops, stopped_for, &a_spans));
            let top = failed_top(t, &a_writes).unwrap_or_else(|| panic!("{why}"));
            partway.insert(top);
            assert!(
                partway.len() <= partway_failures,
                "{why}\n(A logged {partway_failures} writes failed for a lease lost partway, \
                 fewer than the {} such tears)",
                partway.len()
            );
        }
    }
    // The final state, after both stopped: one whole record, and if it is A's, a write A was
    // told succeeded (a write that failed must not land late over B's acknowledged ones) —
    // unless A's last write lost its lease partway, after all of its data was sent.
    let mut backing = Vec::new();
    let buf = aligned(&mut backing);
    open(b.path()).read_exact_at(buf, 0).unwrap();
    let last = whole(buf).unwrap_or_else(|e| panic!("final state: {e}"));
    assert!(
        last.0 != 1 || a_ok.contains(&last.1) || partway_failures > partway.len(),
        "the file ends with A's write {} which A was told failed: a late write landed",
        last.1
    );
    println!(
        "{fabric:?}: {pauses} stops of {stopped_for:?}; A: {} writes ok, {a_fenced} refused \
         after it was fenced, slowest call {slowest:?}; B: {b_writes} writes \
         ({b_while_stopped} while A was stopped), {} reads checked, {} showing A's write cut \
         by a stop, {} a write of A's that lost its lease partway ({partway_failures} such \
         failures logged), none torn otherwise",
        a_ok.len(),
        reads.load(Ordering::Relaxed),
        torn.len() - partway.len(),
        partway.len()
    );
    assert!(
        b_while_stopped > 0,
        "B never got the lock while A was stopped: lease recovery did not happen"
    );
    // A works on after its last stop: fenced or not, it writes again (a fenced client joins
    // again in a new session; before, every later write of a fenced A failed until a remount).
    let last_resume = *stops.last().unwrap() + stopped_for;
    assert!(
        a_writes
            .values()
            .any(|&(started, ok)| ok && started > last_resume),
        "A wrote nothing after its last stop"
    );
}

/// On tcp: A's late batches are refused once B's fence revoked A's session. This failed about
/// two runs in three of the full suite ("B, after its write 145: torn read: block 0 is (1, 23),
/// 128 of 256 blocks differ") while a fence revoked only sessions silent *at the fence*: when B's
/// patience ran out just after A was continued, A's heartbeat reached the meta server before
/// A's stale post (checked before the stop) reached one data server, B's fence revoked nothing,
/// and the post landed after B's write. A session heard from after a silence now stays a
/// fence's target for a while (meta-server `SessionTable::fence_targets`; the deterministic test is
/// `lifecycle.rs` `a_session_back_from_a_silence_is_still_fenced`).
///
/// Ignored for a while: with that fix it passed 9 of 10 runs of the whole `citronfs-tests`
/// crate in a loop, but failed once ("B, after its write 1: torn read: block 0 is (1, 1), 128 of
/// 256 blocks differ") on a machine deliberately overloaded (load average about 10 on 2 cores),
/// without logs: the same race, or a lease overrun (a holder descheduled past its lease while
/// its heartbeat kept going, which no fence stops). The overrun is closed now: every data batch
/// carries the lock's lease deadline and the server checks it before each verb
/// (`fabric::Batch::expire_at`), so a batch posted in time but delayed past the deadline is
/// refused. Back in the suite after 8 of 8 passes, 5 of them beside four busy loops (load
/// average about 5).
///
/// A fresh-clone CI run then failed it once with "B, after its write 3: torn read: block 0 is
/// (1, 5), 133 of 256 blocks differ": the chunks of one data server held A's write 5, those of
/// the other B's write 3 — A stopped between the per-server batches of write 5, after B's write
/// 3 and before B's read broke its lock. That tear is the nature of striping, not a late write
/// (A was fenced; write 5 failed), so the checker now accepts exactly it ([`explain_tear`]).
/// Before, it was rare because the stop had to fall within the sending of one batch.
///
/// The same message then came once more, from a fresh-clone CI run: "A's write 5 succeeded,
/// yet only part of it is there". The stress variant below reproduced it: A's write, cut by a
/// stop after its first batch, found its lease gone when it continued and was redone under a
/// new lock — after B had read the first half — and reported done. A write that lost its lease
/// after part of it was sent now fails (`fs_client::Error::LeaseLostPartway`; the deterministic
/// test is `a_write_losing_its_lease_between_servers_fails_on_each_fabric`).
#[test]
fn stopped_client_past_its_lease_on_tcp() {
    pause_past_lease(
        ClusterSpec {
            fabric: Backend::Tcp,
            ..ClusterSpec::default()
        },
        Stops {
            pauses: 2,
            stopped_for: Duration::from_secs(9),
            gap: Duration::from_millis(700),
        },
    );
}

/// On the rdma fabric (the soft NIC in CI), the servers in this process and the two mounts in
/// client processes of their own: B's fence revokes A's session on every fabric server, which
/// moves its queue pairs to the error state, so A's late verbs execute nothing when it
/// continues, and its reconnection in that session is refused. Skipped, and recorded, where no
/// device opens.
#[cfg(feature = "rdma")]
#[test]
fn stopped_client_past_its_lease_on_rdma() {
    if let Err(e) = fabric::rdma::open_device() {
        testkit::skip(testkit::Need::Rdma, &e.to_string());
        return;
    }
    pause_past_lease(
        ClusterSpec {
            fabric: Backend::Rdma,
            ..ClusterSpec::default()
        },
        Stops {
            pauses: 2,
            stopped_for: Duration::from_secs(9),
            gap: Duration::from_millis(700),
        },
    );
}

/// The same with short leases and many stops, each at a random point of A's write cycle
/// (`PAUSE_STRESS_STOPS` of them, 40 by default; 150 stops take about 5 minutes).
#[test]
#[ignore = "a stress run"]
fn stopped_client_many_short_stops_on_tcp() {
    let rounds = std::env::var("PAUSE_STRESS_STOPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    pause_past_lease(
        ClusterSpec {
            fabric: Backend::Tcp,
            fence_after: Duration::from_millis(50),
            lock_lease: Duration::from_millis(250),
            ..ClusterSpec::default()
        },
        Stops {
            pauses: rounds,
            stopped_for: Duration::from_millis(1600),
            gap: Duration::from_millis(400),
        },
    );
}

/// The tear checker, on the timeline of the fresh-clone CI failure that showed the cut write
/// ("B, after its write 3: torn read: block 0 is (1, 5), 133 of 256 blocks differ (first
/// (2, 3) at block 1)": the 123 blocks of one data server's chunks A's, the 133 of the other's
/// B's), and on the late write it must still catch.
#[test]
fn explain_tear_accepts_a_cut_write_and_refuses_a_late_one() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let stops = [at(300), at(10_000)];
    let mut a_writes = AWrites::new();
    for s in 1..=4 {
        a_writes.insert(s, (at(50 * s as u64), true));
    }
    a_writes.insert(5, (at(250), false)); // in progress at the first stop; fenced
    a_writes.insert(6, (at(10_500), false)); // after the last resume: refused
    let torn = |after_write, recs: &[(u32, u32)]| TornRead {
        after_write,
        records: recs.iter().copied().collect(),
        what: "torn read".into(),
        spans: [(t0, t0); 2],
    };
    // B's writes 1-3 returned before the stop, 4 after it.
    let b_done = [at(100), at(200), at(280), at(9_000)];
    let cut = torn(3, &[(1, 5), (2, 3)]);
    assert_eq!(explain_tear(&cut, &stops, &a_writes, &b_done), Ok(()));
    // A's cut write over an earlier one of its own.
    let over_a = torn(3, &[(1, 4), (1, 5)]);
    assert_eq!(explain_tear(&over_a, &stops, &a_writes, &b_done), Ok(()));
    // A's write 5 over B's write 4, made after the stop: it landed after the break.
    let late = torn(4, &[(1, 5), (2, 4)]);
    assert!(explain_tear(&late, &stops, &a_writes, &b_done)
        .unwrap_err()
        .contains("landed after its lock was broken"));
    // A write A was told succeeded is never half there.
    let acknowledged = torn(3, &[(1, 4), (2, 3)]);
    assert!(explain_tear(&acknowledged, &stops, &a_writes, &b_done).is_err());
    // A write started after every stop was cut by none.
    let unstopped = torn(4, &[(1, 6), (2, 4)]);
    assert!(explain_tear(&unstopped, &stops, &a_writes, &b_done).is_err());
    // Three records, or none of A's: no cut write explains them.
    let three = torn(3, &[(1, 4), (1, 5), (2, 3)]);
    assert!(explain_tear(&three, &stops, &a_writes, &b_done).is_err());
    let only_b = torn(3, &[(2, 2), (2, 3)]);
    assert!(explain_tear(&only_b, &stops, &a_writes, &b_done).is_err());
}

/// The checker: whole records pass; a record with one foreign block fails.
#[test]
fn checker_catches_a_torn_record() {
    let mut r = record(1, 7);
    assert_eq!(whole(&r), Ok((1, 7)));
    r[5 * BLOCK..6 * BLOCK].copy_from_slice(&record(2, 3)[..BLOCK]);
    assert!(whole(&r).is_err());
    let mut r = record(1, 7);
    r[RECORD - 3] ^= 1;
    assert!(whole(&r).is_err());
}

/// A live client whose punch is held up between its lease check and the sending of its
/// `FreeChunks` (a thread descheduled there, a slow connection): failpoint
/// `fs_client::meta::sending::FreeChunks` holds every attempt until the other client has
/// written the range. A's heartbeat keeps running, so no fence revokes it: B waits out A's
/// lease, breaks the lock and writes, and only then is A's call sent. The meta server must
/// refuse each such late `FreeChunks` (the lease's deadline travels with it,
/// `RequestFrame::expires`), so B's write survives and the punch fails with EIO once its
/// retries are spent. With the meta server's check removed, A's first late call freed the
/// chunks under B's write, which then read zeros.
#[test]
fn a_punch_held_up_past_its_lease_does_not_free_a_later_write() {
    use fs_client::{CitronFs, Fallocate};
    const FAILPOINT: &str = "fs_client::meta::sending::FreeChunks";
    let cluster = Cluster::start(ClusterSpec {
        data_servers: 1,
        // Short, so that B's break-ins are quick: the lease must exceed 4 × fence_after.
        fence_after: Duration::from_millis(50),
        lock_lease: Duration::from_millis(250),
        ..ClusterSpec::default()
    })
    .unwrap();
    let chunk = cluster.spec().chunk_size;
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let me = CitronFs::process_caller();
    let (attr, fa) = a
        .create(me, proto::ROOT_INO, "punched", 0o644, libc::O_RDWR)
        .unwrap();
    let len = 6 * chunk as usize;
    let mut want = vec![0xAA; len];
    a.write(fa, 0, &want).unwrap();
    let fb = b.open(me, attr.ino, libc::O_RDWR).unwrap();

    // Attempt n of the punch waits at the failpoint until B's write n is done.
    let b_writes = Arc::new(AtomicU64::new(0));
    let (hit, hits) = mpsc::channel::<u64>();
    {
        let (b_writes, attempts) = (b_writes.clone(), AtomicU64::new(0));
        fail::cfg_callback(FAILPOINT, move || {
            let n = attempts.fetch_add(1, Ordering::SeqCst);
            let _ = hit.send(n);
            let held = Instant::now();
            while b_writes.load(Ordering::SeqCst) <= n && held.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(2));
            }
        })
        .unwrap();
    }
    // [chunk, 5 chunk): four whole chunks (past the first, chunks are `chunk` bytes).
    let (from, to) = (chunk, 5 * chunk);
    let fill = vec![0xBB; (to - from) as usize];
    let punched = std::thread::scope(|s| {
        let punch = s.spawn(|| a.fallocate(fa, from, to - from, Fallocate::PunchHole, false));
        let started = Instant::now();
        while !punch.is_finished() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the punch did not end"
            );
            if let Ok(n) = hits.recv_timeout(Duration::from_millis(20)) {
                // A holds the lock, alive: B waits out its lease, breaks the lock, writes.
                b.write(fb, from, &fill).unwrap();
                b_writes.store(n + 1, Ordering::SeqCst);
            }
        }
        punch.join().unwrap()
    });
    fail::remove(FAILPOINT);
    want[from as usize..to as usize].fill(0xBB);
    let read = b.read(fb, 0, len).unwrap();
    let zeros = read.iter().filter(|&&byte| byte == 0).count();
    assert!(
        read == want,
        "B's write was undone by A's late punch ({punched:?}): {zeros} bytes read zeros"
    );
    assert_eq!(a.read(fa, 0, len).unwrap(), want);
    let error = punched.expect_err("every attempt of the punch was sent past its lease");
    assert_eq!(error.errno(), libc::EIO, "{error}");
    eprintln!(
        "the punch was held {} times, each refused: {error}",
        b_writes.load(Ordering::SeqCst)
    );
    a.release(fa).unwrap();
    b.release(fb).unwrap();
}

/// A live client whose write is held up between its per-server batches (failpoint
/// `fs_client::io::between_servers`: a thread descheduled there) until its lock's lease ran
/// out and the other client, waiting, broke the lock and read the range: that read shows the
/// first server's part of the write and the second server's old bytes. The write must then
/// fail (EIO), not be redone under a new lock and reported done — or a write acknowledged
/// as done was seen half-landed, which is what the pause stress test caught ("A's write 136
/// succeeded, yet only part of it is there"; before, the lost lease was always redone).
fn a_write_losing_its_lease_between_servers_fails(fabric: Backend) {
    const FAILPOINT: &str = "fs_client::io::between_servers";
    testkit::init_logging();
    let cluster = Cluster::start(ClusterSpec {
        fabric,
        // Short, so that B's break-in is quick: the lease must exceed 4 × fence_after.
        fence_after: Duration::from_millis(50),
        lock_lease: Duration::from_millis(250),
        ..ClusterSpec::default()
    })
    .unwrap();
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let me = fs_client::CitronFs::process_caller();
    let (attr, fa) = a
        .create(me, proto::ROOT_INO, "held-up", 0o644, libc::O_RDWR)
        .unwrap();
    // One record over both data servers' chunks.
    a.write(fa, 0, &vec![0xAA; RECORD]).unwrap();
    let fb = b.open(me, attr.ino, libc::O_RDWR).unwrap();

    // The first write batch posted with another still to go holds A until B has read.
    let b_read = Arc::new(AtomicBool::new(false));
    let (hit, hits) = mpsc::channel::<()>();
    {
        let (b_read, first) = (b_read.clone(), AtomicBool::new(true));
        fail::cfg_callback(FAILPOINT, move || {
            if !first.swap(false, Ordering::SeqCst) {
                return;
            }
            let _ = hit.send(());
            let held = Instant::now();
            while !b_read.load(Ordering::SeqCst) && held.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(2));
            }
        })
        .unwrap();
    }
    let (written, seen) = std::thread::scope(|s| {
        let write = s.spawn(|| a.write(fa, 0, &vec![0xCC; RECORD]));
        hits.recv_timeout(Duration::from_secs(20))
            .expect("A's write never reached its second server's batch");
        // A holds the lock, alive: B waits out its lease, breaks the lock, reads.
        let seen = b.read(fb, 0, RECORD).unwrap();
        b_read.store(true, Ordering::SeqCst);
        (write.join().unwrap(), seen)
    });
    fail::remove(FAILPOINT);
    let new = seen.iter().filter(|&&byte| byte == 0xCC).count();
    let old = seen.iter().filter(|&&byte| byte == 0xAA).count();
    assert!(
        new > 0 && old > 0 && new + old == RECORD,
        "B's read was meant to find A's write half-landed: {new} new bytes, {old} old"
    );
    let error = written.expect_err(
        "A's write was reported done, yet B read it half-landed: a lost lease was redone",
    );
    assert_eq!(error.errno(), libc::EIO, "{error}");
    assert!(
        matches!(error, fs_client::Error::LeaseLostPartway),
        "{error}"
    );
    eprintln!("{fabric:?}: B read {new} bytes of A's write and {old} old ones; A's write: {error}");
    a.release(fa).unwrap();
    b.release(fb).unwrap();
}

/// Both fabrics in one test: the failpoint is the process's, so the two must not overlap.
#[test]
fn a_write_losing_its_lease_between_servers_fails_on_each_fabric() {
    a_write_losing_its_lease_between_servers_fails(Backend::Shm);
    a_write_losing_its_lease_between_servers_fails(Backend::Tcp);
}

/// A client process stopped (SIGSTOP) for longer than its meta session's lease loses its
/// session; continued, it joins the cluster again in a new session, and its mount works on:
/// a new file, and the file it had open, are written and read back, through it and through
/// another client. Before, such a mount answered ESTALE and EIO to every call until it was
/// remounted.
#[test]
fn a_client_stopped_past_its_session_lease_joins_again() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec {
        session_lease: Duration::from_millis(600),
        ..ClusterSpec::default()
    })
    .unwrap();
    let a: ChildMount = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b: ChildMount = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(a.path().join("kept-open"))
        .unwrap();
    f.write_all_at(b"before", 0).unwrap();
    let sessions = cluster.meta().session_count();
    {
        let _stopped = a.stop();
        testkit::wait_until(Duration::from_secs(30), "A's session to end", || {
            cluster.meta().session_count() < sessions
        });
    }
    testkit::wait_until(Duration::from_secs(30), "A to work again", || {
        std::fs::write(a.path().join("after"), b"written after").is_ok()
    });
    assert_eq!(
        std::fs::read(b.path().join("after")).unwrap(),
        b"written after"
    );
    testkit::wait_until(
        Duration::from_secs(30),
        "A's open file to work again",
        || f.write_all_at(b"AFTER!", 0).is_ok(),
    );
    let mut back = [0u8; 6];
    std::fs::File::open(b.path().join("kept-open"))
        .unwrap()
        .read_exact_at(&mut back, 0)
        .unwrap();
    assert_eq!(&back, b"AFTER!");
}
