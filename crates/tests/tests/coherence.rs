//! Two mounts of one cluster, each served by its own client process: a write through one is
//! visible at once through the other (data and size), and overlapping, unaligned writes of
//! self-describing records from both, read concurrently through both, are never seen torn —
//! for each lock scheme (citron, mutex, seg, server; the scheme is per mount).
//!
//! The test process only issues system calls on the two mount points; the kernel hands them to
//! the client processes, so every read and write goes through one of two independent CitronFS
//! clients. With the `rdma` feature, the citron case runs on the rdma fabric too (its provider
//! from `CITRONFS_RDMA_PROVIDER`: `soft` in CI, whose NIC spans the processes of a host).

use fs_client::LockScheme;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use testkit::ClusterExt;
use testkit::{open_rw, pattern, skip_without_fuse, ChildMount, Cluster, ClusterSpec};

/// The client processes run this test (see `ClusterExt::spawn_mount_process`); run normally it
/// does nothing.
#[test]
fn child_mount() {
    testkit::child_mount_main();
}

const CHUNK: u64 = 64 << 10;

/// The record slots: unaligned byte ranges around a chunk boundary (so across two data servers
/// and many 4 KiB lock units) that overlap each other in every way — tail, head, nested.
const SLOTS: [(u64, usize); 4] = [
    (CHUNK - 5_001, 10_000),
    (CHUNK + 2_999, 9_000),
    (CHUNK - 7_003, 3_001),
    (CHUNK - 1_237, 1_500),
];

/// Bytes of the unit a record repeats: writer, slot, sequence (u32), checksum (u16).
const UNIT: usize = 8;

fn unit(writer: u8, slot: u8, seq: u32) -> [u8; UNIT] {
    let mut u = [0u8; UNIT];
    u[0] = writer;
    u[1] = slot;
    u[2..6].copy_from_slice(&seq.to_le_bytes());
    let sum = checksum(&u[..6]);
    u[6..].copy_from_slice(&sum.to_le_bytes());
    u
}

/// Never 0 for a unit of zeros, so unwritten bytes never decode.
fn checksum(bytes: &[u8]) -> u16 {
    bytes.iter().fold(0xA5C3u16, |acc, &b| {
        acc.rotate_left(5) ^ u16::from(b).wrapping_mul(0x9E37)
    })
}

/// The whole record `writer` writes into `slot` as its write number `seq`.
fn record(writer: u8, slot: usize, seq: u32) -> Vec<u8> {
    let u = unit(writer, slot as u8, seq);
    (0..SLOTS[slot].1).map(|i| u[i % UNIT]).collect()
}

/// If `bytes`, found at file offset `at`, are one piece of a single record of slot `slot`,
/// returns that record's (writer, seq).
fn decode(slot: usize, at: u64, bytes: &[u8]) -> Option<(u8, u32)> {
    let start = SLOTS[slot].0;
    if bytes.len() < UNIT || at < start {
        return None;
    }
    let phase = ((at - start) % UNIT as u64) as usize;
    let mut u = [0u8; UNIT];
    for (i, &b) in bytes.iter().take(UNIT).enumerate() {
        u[(phase + i) % UNIT] = b;
    }
    let sum = u16::from_le_bytes([u[6], u[7]]);
    if checksum(&u[..6]) != sum || usize::from(u[1]) != slot {
        return None;
    }
    let whole = bytes
        .iter()
        .enumerate()
        .all(|(i, &b)| b == u[(phase + i) % UNIT]);
    whole.then(|| (u[0], u32::from_le_bytes([u[2], u[3], u[4], u[5]])))
}

/// Checks a read of slot `target`: cut at every other slot's boundaries, each piece must be a
/// piece of one record of a slot that covers it, and all pieces showing records of one slot
/// must show the same record (that slot's last write) — what atomic writes guarantee.
fn check_read(target: usize, got: &[u8]) -> Result<(), String> {
    let (t0, tlen) = SLOTS[target];
    let t1 = t0 + tlen as u64;
    let mut cuts: Vec<u64> = SLOTS
        .iter()
        .flat_map(|&(s, l)| [s, s + l as u64])
        .filter(|&c| c > t0 && c < t1)
        .chain([t0, t1])
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut seen: [Option<(u8, u32)>; SLOTS.len()] = [None; SLOTS.len()];
    for w in cuts.windows(2) {
        let (p0, p1) = (w[0], w[1]);
        let piece = &got[(p0 - t0) as usize..(p1 - t0) as usize];
        let found = SLOTS
            .iter()
            .enumerate()
            .filter(|(_, &(s, l))| s <= p0 && p1 <= s + l as u64)
            .find_map(|(slot, _)| decode(slot, p0, piece).map(|rec| (slot, rec)));
        let Some((slot, rec)) = found else {
            return Err(format!(
                "torn read of slot {target}: bytes {p0}..{p1} are no single record; \
                 they start {:02x?}",
                &piece[..piece.len().min(32)]
            ));
        };
        match seen[slot] {
            Some(other) if other != rec => {
                return Err(format!(
                    "torn read of slot {target}: slot {slot}'s records {other:?} and {rec:?} \
                     both show"
                ))
            }
            _ => seen[slot] = Some(rec),
        }
    }
    Ok(())
}

/// A small deterministic generator (xorshift64*): thread-local randomness without a seed
/// to pass around.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) % n as u64) as usize
    }
}

/// Writes through one mount are seen at once through the other, in both directions: data
/// through an open handle and a fresh open, size through stat.
fn visible_at_once(a: &Path, b: &Path) {
    std::fs::write(a.join("v"), b"first").unwrap();
    assert_eq!(std::fs::read(b.join("v")).unwrap(), b"first");
    assert_eq!(std::fs::metadata(b.join("v")).unwrap().len(), 5);
    let fa = open_rw(&a.join("v"));
    let fb = open_rw(&b.join("v"));
    let mut len = 5u64;
    for round in 0..20u64 {
        let (writer, reader, wdir, rdir) = if round % 2 == 0 {
            (&fa, &fb, a, b)
        } else {
            (&fb, &fa, b, a)
        };
        // The reader's side has just looked at the size (so the kernel has it cached).
        assert_eq!(std::fs::metadata(rdir.join("v")).unwrap().len(), len);
        assert_eq!(reader.metadata().unwrap().len(), len);
        // Extend by an unaligned amount that crosses chunk boundaries now and then.
        let grow = pattern(round, len, 7_777 + round as usize * 1_000);
        writer.write_all_at(&grow, len).unwrap();
        len += grow.len() as u64;
        let mut back = vec![0u8; grow.len()];
        reader
            .read_exact_at(&mut back, len - grow.len() as u64)
            .unwrap();
        assert_eq!(
            back, grow,
            "round {round}: appended data not seen by the other mount"
        );
        assert_eq!(
            std::fs::metadata(rdir.join("v")).unwrap().len(),
            len,
            "round {round}: size not seen by the other mount"
        );
        assert_eq!(reader.metadata().unwrap().len(), len);
        // Overwrite in the middle, seen through a fresh open on the other side.
        let mid = len / 3;
        let over = pattern(round + 100, mid, 333);
        std::fs::OpenOptions::new()
            .write(true)
            .open(wdir.join("v"))
            .unwrap()
            .write_all_at(&over, mid)
            .unwrap();
        let mut back = vec![0u8; over.len()];
        File::open(rdir.join("v"))
            .unwrap()
            .read_exact_at(&mut back, mid)
            .unwrap();
        assert_eq!(
            back, over,
            "round {round}: overwrite not seen by the other mount"
        );
    }
    // A truncate through one mount shrinks the file for the other.
    fa.set_len(1000).unwrap();
    assert_eq!(std::fs::metadata(b.join("v")).unwrap().len(), 1000);
    assert_eq!(std::fs::read(b.join("v")).unwrap().len(), 1000);
}

/// Two writers per mount write whole records into random slots while one reader per mount
/// reads random slots; every read must pass [`check_read`].
fn no_torn_records(a: &Path, b: &Path, scheme: LockScheme) {
    // 60 writes per writer keep CI fast; CITRONFS_COHERENCE_WRITES=N runs longer.
    let writes: u32 = std::env::var("CITRONFS_COHERENCE_WRITES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    const MIN_READS: u64 = 40;
    assert!(
        SLOTS
            .iter()
            .all(|&(s, l)| s % UNIT as u64 != 0 || l % UNIT != 0),
        "slots should be unaligned"
    );
    // Every slot holds a whole record before anyone reads.
    std::fs::write(a.join("records"), b"").unwrap();
    let f = open_rw(&a.join("records"));
    for (slot, &(off, _)) in SLOTS.iter().enumerate() {
        f.write_all_at(&record(0, slot, 0), off).unwrap();
    }
    drop(f);

    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::new();
    let mut readers = Vec::new();
    for (m, dir) in [a, b].into_iter().enumerate() {
        let path = dir.join("records");
        for t in 0..2u8 {
            let path = path.clone();
            let id = 1 + m as u8 * 2 + t;
            writers.push(std::thread::spawn(move || {
                let f = open_rw(&path);
                let mut rng = Rng(0x1234_5678 * u64::from(id) + 1);
                for seq in 1..=writes {
                    let slot = rng.below(SLOTS.len());
                    let rec = record(id, slot, seq);
                    let n = f.write_at(&rec, SLOTS[slot].0).unwrap();
                    assert_eq!(n, rec.len(), "a short write cannot be atomic");
                }
            }));
        }
        let (stop, reads) = (stop.clone(), reads.clone());
        readers.push(std::thread::spawn(move || {
            let f = File::open(&path).unwrap();
            let mut rng = Rng(0x9876_5431 + m as u64);
            let mut mine = 0u64;
            while mine < MIN_READS || !stop.load(Ordering::Relaxed) {
                let slot = rng.below(SLOTS.len());
                let mut got = vec![0u8; SLOTS[slot].1];
                let n = f.read_at(&mut got, SLOTS[slot].0).unwrap();
                assert_eq!(n, got.len(), "short read of slot {slot}");
                if let Err(e) = check_read(slot, &got) {
                    panic!("{} (mount {m}, {})", e, scheme.name());
                }
                mine += 1;
                reads.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let mut failed = Vec::new();
    for w in writers {
        if let Err(e) = w.join() {
            failed.push(e);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        if let Err(e) = r.join() {
            failed.push(e);
        }
    }
    if let Some(e) = failed.into_iter().next() {
        std::panic::resume_unwind(e);
    }
    // The final state passes too, read through either mount.
    for dir in [a, b] {
        let f = File::open(dir.join("records")).unwrap();
        for (slot, &(off, len)) in SLOTS.iter().enumerate() {
            let mut got = vec![0u8; len];
            f.read_exact_at(&mut got, off).unwrap();
            check_read(slot, &got).unwrap();
        }
    }
    println!(
        "{}: {} writes, {} reads through two client processes, none torn",
        scheme.name(),
        4 * writes,
        reads.load(Ordering::Relaxed)
    );
}

fn two_processes(scheme: LockScheme) {
    two_processes_on(scheme, ClusterSpec::default().fabric);
}

fn two_processes_on(scheme: LockScheme, fabric: testkit::Backend) {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec {
        chunk_size: CHUNK,
        scheme,
        fabric,
        ..ClusterSpec::default()
    })
    .unwrap();
    let a: ChildMount = cluster.spawn_mount_process("child_mount", scheme);
    let b: ChildMount = cluster.spawn_mount_process("child_mount", scheme);
    assert_ne!(a.pid(), b.pid());
    visible_at_once(a.path(), b.path());
    no_torn_records(a.path(), b.path(), scheme);
}

#[test]
fn two_client_processes_citron() {
    two_processes(LockScheme::CITRON);
}

#[test]
fn two_client_processes_mutex() {
    two_processes(LockScheme::MUTEX);
}

#[test]
fn two_client_processes_seg() {
    two_processes(LockScheme::SEG);
}

#[test]
fn two_client_processes_server() {
    two_processes(LockScheme::SERVER);
}

/// On the rdma fabric: the servers in this process, the two clients in theirs, every verb
/// through the rdma backend (the soft NIC in CI). Skipped, and recorded, where no device opens.
#[cfg(feature = "rdma")]
#[test]
fn two_client_processes_citron_rdma() {
    if let Err(e) = fabric::rdma::open_device() {
        testkit::skip(testkit::Need::Rdma, &e.to_string());
        return;
    }
    two_processes_on(LockScheme::CITRON, testkit::Backend::Rdma);
}

/// The checker itself: whole records pass, a record with a foreign piece fails.
#[test]
fn checker_catches_torn_records() {
    let mut file = vec![0u8; (CHUNK + 20_000) as usize];
    let put = |file: &mut Vec<u8>, w: u8, slot: usize, seq: u32| {
        let (off, _) = SLOTS[slot];
        let rec = record(w, slot, seq);
        file[off as usize..off as usize + rec.len()].copy_from_slice(&rec);
    };
    let read = |file: &Vec<u8>, slot: usize| {
        let (off, len) = SLOTS[slot];
        file[off as usize..off as usize + len].to_vec()
    };
    for slot in 0..SLOTS.len() {
        put(&mut file, 0, slot, 0);
    }
    put(&mut file, 3, 1, 7);
    put(&mut file, 2, 3, 9);
    for slot in 0..SLOTS.len() {
        check_read(slot, &read(&file, slot)).unwrap();
    }
    // Half of a newer record of slot 0 (as if a write landed only on one chunk).
    let newer = record(4, 0, 11);
    let (off, len) = SLOTS[0];
    let half = (CHUNK - off) as usize;
    file[off as usize..off as usize + half].copy_from_slice(&newer[..half]);
    assert!(check_read(0, &read(&file, 0)).is_err());
    assert!(len > half);
    // A byte of garbage inside a piece.
    put(&mut file, 4, 0, 11);
    check_read(0, &read(&file, 0)).unwrap();
    file[off as usize + 17] ^= 1;
    assert!(check_read(0, &read(&file, 0)).is_err());
}

/// `open(O_RDWR | O_CREAT)` without `O_EXCL` of one name through two client processes at once:
/// both opens succeed and name one file (POSIX: an existing name is opened, not `EEXIST`), and
/// what one writes through its descriptor the other reads through its own. With `O_EXCL`
/// exactly one of the two wins.
#[test]
fn create_race_opens_the_existing_file() {
    skip_without_fuse!();
    const NAMES: usize = 300;
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let a = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let racer = |dir: std::path::PathBuf, id: u8| {
        let barrier = barrier.clone();
        std::thread::spawn(move || {
            let (mut failed, mut excl_won) = (Vec::new(), 0usize);
            for i in 0..NAMES {
                barrier.wait();
                let path = dir.join(format!("plain-{i}"));
                match OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&path)
                {
                    // Each writes its own byte at its own offset; both must land in one file.
                    Ok(f) => f.write_all_at(&[id], u64::from(id)).unwrap(),
                    Err(e) => failed.push(format!("{}: {e}", path.display())),
                }
                barrier.wait();
                let path = dir.join(format!("excl-{i}"));
                match OpenOptions::new().write(true).create_new(true).open(&path) {
                    Ok(_) => excl_won += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => failed.push(format!("{} (O_EXCL): {e}", path.display())),
                }
            }
            (failed, excl_won)
        })
    };
    let ta = racer(a.path().to_path_buf(), 1);
    let tb = racer(b.path().to_path_buf(), 2);
    let (fa, wa) = ta.join().unwrap();
    let (fb, wb) = tb.join().unwrap();
    let failed: Vec<String> = fa.into_iter().chain(fb).collect();
    assert!(
        failed.is_empty(),
        "{} of {} racing opens failed, e.g. {:?}",
        failed.len(),
        2 * NAMES,
        &failed[..failed.len().min(5)]
    );
    assert_eq!(wa + wb, NAMES, "O_EXCL: exactly one creator per name");
    for i in 0..NAMES {
        let got = std::fs::read(a.path().join(format!("plain-{i}"))).unwrap();
        assert_eq!(
            got,
            [0, 1, 2],
            "name {i}: the two opens named different files"
        );
    }
    println!(
        "create race: {NAMES} names, {} racing opens, none failed",
        2 * NAMES
    );
}

/// Locks of two schemes do not exclude each other, so while a file is open through a client of
/// one scheme, a client of another cannot open it (EBUSY, the reason in its log); once the
/// first has closed it, the other may. Before this was checked, both opens succeeded and their
/// writes were not atomic against each other.
#[test]
fn a_file_open_under_one_scheme_refuses_clients_of_another() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let citron = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let mutex = cluster.spawn_mount_process("child_mount", LockScheme::MUTEX);
    let also_citron = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    std::fs::write(citron.path().join("f"), b"shared").unwrap();

    let held = open_rw(&citron.path().join("f"));
    let refused = OpenOptions::new()
        .read(true)
        .open(mutex.path().join("f"))
        .expect_err("a mutex client opened a file open under citron");
    assert_eq!(refused.raw_os_error(), Some(libc::EBUSY), "{refused}");
    // A client of the same scheme shares the file as before.
    let mut buf = [0u8; 6];
    open_rw(&also_citron.path().join("f"))
        .read_exact_at(&mut buf, 0)
        .unwrap();
    assert_eq!(&buf, b"shared");
    // Metadata needs no lock: stat works for every client.
    assert_eq!(std::fs::metadata(mutex.path().join("f")).unwrap().len(), 6);

    // Closed everywhere: the other scheme may open it, and then holds it against citron.
    drop(held);
    // The release of the citron clients' opens reaches the meta server after close(2)
    // returns (the kernel sends RELEASE asynchronously).
    let mut opened = None;
    testkit::wait_until(
        std::time::Duration::from_secs(10),
        "the mutex client's open once citron closed the file",
        || match open_rw_result(&mutex.path().join("f")) {
            Ok(f) => {
                opened = Some(f);
                true
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => false,
            Err(e) => panic!("open after the other scheme closed: {e}"),
        },
    );
    let held = opened.expect("opened once the wait ended");
    held.write_all_at(b"MUTEX!", 0).unwrap();
    let refused = OpenOptions::new()
        .read(true)
        .open(citron.path().join("f"))
        .expect_err("a citron client opened a file open under mutex");
    assert_eq!(refused.raw_os_error(), Some(libc::EBUSY), "{refused}");
    drop(held);
}

fn open_rw_result(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().read(true).write(true).open(path)
}

/// A name one client still has cached (the kernel keeps an entry for the attribute TTL) whose
/// file another client removed or replaced: creating it, opening it for writing or reading
/// through the first client acts on what the name is now, as on NFS. The client answers ESTALE
/// for an inode that no longer exists (or that only its own lingering release keeps, for an
/// open that would write), and the kernel then looks the name up again. Before, an `O_CREAT`
/// open failed with ENOENT, or opened the removed file: SQLite, whose rollback journal is
/// created and deleted by every transaction, failed with "unable to open database file" when
/// two mounts shared a database. A read-only open within the TTL may still read the removed
/// file as it was (see `CitronFs::open`).
#[test]
fn a_name_another_client_removed_or_replaced_is_looked_up_again() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let a = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    for round in 0..20 {
        let (in_a, in_b) = (a.path().join("journal"), b.path().join("journal"));
        std::fs::write(&in_a, b"old").unwrap();
        // A's kernel now has the name cached; B removes the file behind it.
        assert_eq!(std::fs::metadata(&in_a).unwrap().len(), 3);
        std::fs::remove_file(&in_b).unwrap();
        match round % 4 {
            // Created anew (SQLite's journal).
            0 => {
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&in_a)
                    .unwrap_or_else(|e| panic!("round {round}: O_CREAT open: {e}"));
                assert_eq!(f.metadata().unwrap().len(), 0, "round {round}");
            }
            // Gone: read, it is the removed file as it was (within the entry TTL the name may
            // still lead to it, as a stat may) or ENOENT, and ENOENT once the TTL is over.
            1 => testkit::wait_until(Duration::from_secs(5), "A to see the removal", || {
                match std::fs::read(&in_a) {
                    Ok(old) => {
                        assert_eq!(old, b"old", "round {round}");
                        false
                    }
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
                    Err(e) => panic!("round {round}: {e}"),
                }
            }),
            // Replaced by another file of the same name: read, it is the removed one as it was
            // (within the TTL) or the new one, never an error; written, the new one.
            2 => {
                std::fs::write(&in_b, b"the new one").unwrap();
                testkit::wait_until(Duration::from_secs(5), "A to see the new file", || {
                    match std::fs::read(&in_a) {
                        Ok(got) if got == b"the new one" => true,
                        Ok(got) => {
                            assert_eq!(got, b"old", "round {round}");
                            false
                        }
                        Err(e) => panic!("round {round}: {e}"),
                    }
                });
            }
            _ => {
                std::fs::write(&in_b, b"the new one").unwrap();
                let mut f = OpenOptions::new()
                    .append(true)
                    .open(&in_a)
                    .unwrap_or_else(|e| panic!("round {round}: {e}"));
                std::io::Write::write_all(&mut f, b", appended").unwrap();
                drop(f);
                assert_eq!(std::fs::read(&in_b).unwrap(), b"the new one, appended");
            }
        }
        let _ = std::fs::remove_file(&in_a);
    }
    // A directory removed and made again under the same name: listed through A, it is the new
    // one (OPENDIR of the old inode is ESTALE too); and so for a symlink's target.
    let (dir_a, dir_b) = (a.path().join("d"), b.path().join("d"));
    let (link_a, link_b) = (a.path().join("l"), b.path().join("l"));
    for round in 0..10 {
        std::fs::create_dir(&dir_b).unwrap();
        std::os::unix::fs::symlink("old-target", &link_b).unwrap();
        assert_eq!(std::fs::read_dir(&dir_a).unwrap().count(), 0);
        assert_eq!(
            std::fs::read_link(&link_a).unwrap().as_os_str(),
            "old-target"
        );
        std::fs::remove_dir(&dir_b).unwrap();
        std::fs::create_dir(&dir_b).unwrap();
        std::fs::write(dir_b.join("new"), b"").unwrap();
        std::fs::remove_file(&link_b).unwrap();
        std::os::unix::fs::symlink("new-target", &link_b).unwrap();
        let names: Vec<_> = std::fs::read_dir(&dir_a)
            .unwrap_or_else(|e| panic!("round {round}: list the new directory: {e}"))
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["new"], "round {round}");
        assert_eq!(
            std::fs::read_link(&link_a).unwrap().as_os_str(),
            "new-target",
            "round {round}"
        );
        std::fs::remove_file(dir_b.join("new")).unwrap();
        std::fs::remove_dir(&dir_b).unwrap();
        std::fs::remove_file(&link_b).unwrap();
    }
}

/// A file replaced over and over by rename (write a temporary file, rename it over the name:
/// the usual atomic update) is always there for readers of both mounts, and always whole: an
/// open finds the current file or the one just replaced, never ENOENT. Before, the readers'
/// kernels opened the replaced inode through the cached name, and between 7 % and 44 % of the
/// reads failed with ENOENT (3,000 reads against 2,000 renames, by hand).
///
/// What is left: the kernel looks a stale name up again once (ESTALE, `LOOKUP_REVAL`); when
/// the file is replaced again between that lookup and its open, the second try is stale too
/// and the reader gets ESTALE, as on NFSv3. Counted, and bounded here at 2 % of the reads (seen:
/// 0–1 in 12,000 reads in release builds, about 1 in 4,000 in a debug build).
#[test]
fn a_file_replaced_by_rename_is_always_there_and_whole() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let a = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let version = |i: u32| format!("v{i:06}").repeat(1000).into_bytes();
    std::fs::write(a.path().join("target"), version(0)).unwrap();
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let readers: Vec<_> = [a.path(), b.path()]
            .into_iter()
            .map(|mount| {
                let done = &done;
                s.spawn(move || {
                    let (mut reads, mut stale) = (0u32, 0u32);
                    while !done.load(Ordering::Relaxed) || reads < 100 {
                        match std::fs::read(mount.join("target")) {
                            Ok(got) => assert!(
                                got.len() == 7000 && got == got[..7].repeat(1000),
                                "a torn file through {mount:?}"
                            ),
                            Err(e) if e.raw_os_error() == Some(libc::ESTALE) => stale += 1,
                            Err(e) => panic!("read {reads} through {mount:?}: {e}"),
                        }
                        reads += 1;
                    }
                    (reads, stale)
                })
            })
            .collect();
        for i in 1..=400 {
            let tmp = a.path().join("target.tmp");
            std::fs::write(&tmp, version(i)).unwrap();
            std::fs::rename(&tmp, a.path().join("target")).unwrap();
        }
        done.store(true, Ordering::Relaxed);
        for r in readers {
            let (reads, stale) = r.join().unwrap();
            eprintln!("{reads} reads ({stale} ESTALE) while the file was replaced 400 times");
            assert!(
                stale * 50 <= reads,
                "{stale} of {reads} reads failed with ESTALE"
            );
        }
    });
}
