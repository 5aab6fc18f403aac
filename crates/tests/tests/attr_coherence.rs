//! One file, one truth: what a call through one mount changed — a file's size, its times and
//! mode, the names in a directory — is what the other mount of the same cluster shows the
//! moment the call has returned, `stat`, `fstat`, `lseek(SEEK_END)`, lookups and listings
//! included, on shm and on tcp. Each mount is its own client process; the test process only
//! makes system calls on the two mount points.
//!
//! Each check first makes the observing mount look (so that its kernel holds the old answer in
//! whatever cache it keeps), then changes the file through the other mount, then looks again.

use fs_client::LockScheme;
use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, SystemTime};
use testkit::ClusterExt;
use testkit::{skip_without_fuse, Backend, ChildMount, Cluster, ClusterSpec};

/// The client processes run this test (see `ClusterExt::spawn_mount_process`); run normally it
/// does nothing.
#[test]
fn child_mount() {
    testkit::child_mount_main();
}

fn two_mounts(fabric: Backend) -> (Cluster, ChildMount, ChildMount) {
    let cluster = Cluster::start(ClusterSpec {
        fabric,
        ..ClusterSpec::default()
    })
    .unwrap();
    let a = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    let b = cluster.spawn_mount_process("child_mount", LockScheme::CITRON);
    (cluster, a, b)
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

/// Sizes after truncates and writes, seen through the other mount by path, by handle and by
/// `lseek(SEEK_END)`.
fn sizes(a: &Path, b: &Path) {
    std::fs::write(a.join("s"), vec![7u8; 100_000]).unwrap();
    let mut fb = File::open(b.join("s")).unwrap();
    assert_eq!(size(&b.join("s")), 100_000);
    assert_eq!(fb.metadata().unwrap().len(), 100_000);

    // A truncate through A, the file closed there.
    OpenOptions::new()
        .write(true)
        .open(a.join("s"))
        .unwrap()
        .set_len(0)
        .unwrap();
    assert_eq!(size(&b.join("s")), 0, "stat on B after a truncate on A");
    assert_eq!(
        fb.metadata().unwrap().len(),
        0,
        "fstat on B after a truncate on A"
    );

    // Writes through A, the file kept open there: each new end is seen on B at once.
    let fa = OpenOptions::new().write(true).open(a.join("s")).unwrap();
    let mut end = 0u64;
    for (round, (at, len)) in [(0u64, 5_000usize), (1_000_000, 3), (1_000_003, 70_001)]
        .into_iter()
        .enumerate()
    {
        assert_eq!(size(&b.join("s")), end);
        fa.write_all_at(&vec![round as u8 + 1; len], at).unwrap();
        end = at + len as u64;
        assert_eq!(
            size(&b.join("s")),
            end,
            "stat on B after write {round} on A"
        );
        assert_eq!(
            fb.metadata().unwrap().len(),
            end,
            "fstat on B after write {round} on A"
        );
        assert_eq!(
            fb.seek(SeekFrom::End(0)).unwrap(),
            end,
            "lseek(SEEK_END) on B after write {round} on A"
        );
    }
    // A truncate through A with the file open on both.
    fa.set_len(4_096).unwrap();
    assert_eq!(size(&b.join("s")), 4_096);
    assert_eq!(fb.metadata().unwrap().len(), 4_096);
    assert_eq!(fb.seek(SeekFrom::End(0)).unwrap(), 4_096);
    // And the other way round.
    let fb_w = OpenOptions::new().write(true).open(b.join("s")).unwrap();
    let fa_r = File::open(a.join("s")).unwrap();
    assert_eq!(fa_r.metadata().unwrap().len(), 4_096);
    fb_w.write_all_at(b"tail", 9_000).unwrap();
    assert_eq!(fa_r.metadata().unwrap().len(), 9_004);
    assert_eq!(size(&a.join("s")), 9_004);
}

/// Mode and times set through A, and a write's new mtime, seen on B.
fn modes_and_times(a: &Path, b: &Path) {
    std::fs::write(a.join("t"), b"times").unwrap();
    let fb = File::open(b.join("t")).unwrap();
    assert_eq!(fb.metadata().unwrap().mode() & 0o7777, 0o644);
    std::fs::set_permissions(a.join("t"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        std::fs::metadata(b.join("t")).unwrap().mode() & 0o7777,
        0o600,
        "chmod on A, stat on B"
    );
    assert_eq!(
        fb.metadata().unwrap().mode() & 0o7777,
        0o600,
        "chmod on A, fstat on B"
    );

    let then = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    let times = std::fs::FileTimes::new()
        .set_modified(then)
        .set_accessed(then);
    OpenOptions::new()
        .write(true)
        .open(a.join("t"))
        .unwrap()
        .set_times(times)
        .unwrap();
    assert_eq!(
        std::fs::metadata(b.join("t")).unwrap().modified().unwrap(),
        then,
        "utimensat on A, stat on B"
    );
    assert_eq!(fb.metadata().unwrap().modified().unwrap(), then);
    // A write through A moves mtime past the time set.
    OpenOptions::new()
        .write(true)
        .open(a.join("t"))
        .unwrap()
        .write_all_at(b"T", 0)
        .unwrap();
    let after = std::fs::metadata(b.join("t")).unwrap().modified().unwrap();
    assert!(after > then, "a write on A left mtime at {after:?} on B");
}

/// The names of `dir` as `readdir` lists them.
fn listing(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

fn exists(path: &Path) -> bool {
    match std::fs::symlink_metadata(path) {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => panic!("stat {}: {e}", path.display()),
    }
}

/// Names created, renamed and removed through A, seen (or not) on B by lookup and listing.
fn names(a: &Path, b: &Path) {
    std::fs::create_dir(a.join("d")).unwrap();
    assert!(listing(&b.join("d")).is_empty());
    assert!(!exists(&b.join("d/n")), "B looks n up: not there yet");
    std::fs::write(a.join("d/n"), b"n").unwrap();
    assert!(exists(&b.join("d/n")), "created on A, looked up on B");
    assert_eq!(listing(&b.join("d")), BTreeSet::from(["n".to_string()]));

    std::fs::rename(a.join("d/n"), a.join("d/m")).unwrap();
    assert!(
        !exists(&b.join("d/n")),
        "renamed away on A, still there on B"
    );
    assert!(exists(&b.join("d/m")), "renamed to on A, not there on B");
    assert_eq!(listing(&b.join("d")), BTreeSet::from(["m".to_string()]));

    // A name replaced by a directory of the same name.
    std::fs::remove_file(a.join("d/m")).unwrap();
    assert!(!exists(&b.join("d/m")), "removed on A, still there on B");
    std::fs::create_dir(a.join("d/m")).unwrap();
    assert!(std::fs::metadata(b.join("d/m")).unwrap().is_dir());
    for i in 0..20 {
        std::fs::write(a.join(format!("d/m/{i}")), b"x").unwrap();
    }
    assert_eq!(
        listing(&b.join("d/m")).len(),
        20,
        "entries made on A, listed on B"
    );
    for i in 0..10 {
        std::fs::remove_file(a.join(format!("d/m/{i}"))).unwrap();
    }
    assert_eq!(
        listing(&b.join("d/m")).len(),
        10,
        "entries removed on A, listed on B"
    );
}

/// `O_APPEND` writers on both mounts at once, two per mount: no record lost or overwritten, and
/// the file exactly as long as all of them.
fn appends(a: &Path, b: &Path) {
    const RECORD: usize = 1_000;
    const PER_WRITER: usize = 60;
    std::fs::write(a.join("log"), b"").unwrap();
    std::thread::scope(|s| {
        for (w, dir) in [a, a, b, b].into_iter().enumerate() {
            s.spawn(move || {
                let mut f = OpenOptions::new()
                    .append(true)
                    .open(dir.join("log"))
                    .unwrap();
                for seq in 0..PER_WRITER {
                    let tag = format!("{w}:{seq:04}|");
                    let mut rec = tag.clone().into_bytes();
                    rec.resize(RECORD - 1, b'.');
                    rec.push(b'\n');
                    f.write_all(&rec).unwrap();
                }
            });
        }
    });
    let all = std::fs::read(b.join("log")).unwrap();
    assert_eq!(
        all.len(),
        4 * PER_WRITER * RECORD,
        "appends lost or overwritten"
    );
    assert_eq!(size(&a.join("log")), all.len() as u64);
    let mut seen = BTreeSet::new();
    for (i, rec) in all.chunks(RECORD).enumerate() {
        let text = std::str::from_utf8(rec).unwrap_or_else(|_| panic!("record {i} torn"));
        let tag = text.split('|').next().unwrap();
        assert!(
            text.ends_with('\n') && text[tag.len() + 1..RECORD - 1].bytes().all(|c| c == b'.'),
            "record {i} is not one whole record: {text:?}"
        );
        assert!(seen.insert(tag.to_string()), "record {tag} twice");
    }
    assert_eq!(seen.len(), 4 * PER_WRITER);
}

fn attributes_and_names_across_mounts(fabric: Backend) {
    skip_without_fuse!();
    testkit::init_logging();
    let (_cluster, a, b) = two_mounts(fabric);
    sizes(a.path(), b.path());
    modes_and_times(a.path(), b.path());
    names(a.path(), b.path());
    appends(a.path(), b.path());
}

#[test]
fn attributes_and_names_are_one_truth_across_mounts_on_shm() {
    attributes_and_names_across_mounts(Backend::Shm);
}

#[test]
fn attributes_and_names_are_one_truth_across_mounts_on_tcp() {
    attributes_and_names_across_mounts(Backend::Tcp);
}

// ---------------------------------------------------------------------------------------------
// A parallel program in the spirit of an MPI job across two client machines: rank processes,
// ranks 0 and 1 on mount A and ranks 2 and 3 on mount B, one shared file, a barrier between
// steps (each rank says it is done on its stdout and waits for the word to go on from this
// process), truncating, writing disjoint blocks, appending, and every rank checking the size
// and the contents after each barrier.

/// The rank's number, in the environment of a rank process.
const ENV_RANK: &str = "CITRONFS_TEST_RANK";
/// The shared file, as the rank's mount names it.
const ENV_RANK_FILE: &str = "CITRONFS_TEST_RANK_FILE";
const RANKS: u64 = 4;
/// The block sizes of the rounds: under a page, unaligned, across chunks.
const BLOCKS: [u64; 3] = [1_000, 70_001, 300_000];
/// Bytes of one appended record.
const APPENDED: u64 = 777;

/// What rank `rank` writes as its block of round `round` (bytes unique to both).
fn block(round: usize, rank: u64, len: u64) -> Vec<u8> {
    testkit::pattern(1 + round as u64 * 16 + rank, rank * len, len as usize)
}

fn appended(round: usize, rank: u64) -> Vec<u8> {
    let mut rec = format!("round {round} rank {rank}|").into_bytes();
    rec.resize(APPENDED as usize, b'a' + rank as u8);
    rec
}

/// The file size after round `round`'s append step, and the last round's truncate length.
fn truncated(round: usize) -> u64 {
    BLOCKS[round] * RANKS / 3 + 1
}

/// The rank processes run this test; run normally it does nothing.
#[test]
fn rank() {
    let (Ok(rank), Ok(file)) = (std::env::var(ENV_RANK), std::env::var(ENV_RANK_FILE)) else {
        return;
    };
    let rank: u64 = rank.parse().unwrap();
    let file = Path::new(&file);
    let stdin = std::io::stdin();
    let barrier = |step: &str| {
        // A look right before each barrier: the kernel of this rank's mount then holds the
        // attributes from just before the next step, in whatever cache it keeps.
        let _ = std::fs::metadata(file);
        println!("rank {rank} done {step}");
        let mut line = String::new();
        stdin.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "go", "rank {rank}: told {line:?} after {step}");
    };
    let check = |what: &str, want_len: u64, want: &dyn Fn(&[u8]) -> Result<(), String>| {
        let by_path = std::fs::metadata(file).unwrap().len();
        let f = File::open(file).unwrap();
        let by_handle = f.metadata().unwrap().len();
        let end = (&f).seek(SeekFrom::End(0)).unwrap();
        assert!(
            by_path == want_len && by_handle == want_len && end == want_len,
            "rank {rank}, {what}: stat {by_path}, fstat {by_handle}, SEEK_END {end}; \
             want {want_len}"
        );
        let all = std::fs::read(file).unwrap();
        assert_eq!(
            all.len() as u64,
            want_len,
            "rank {rank}, {what}: read length"
        );
        if let Err(e) = want(&all) {
            panic!("rank {rank}, {what}: {e}");
        }
    };
    for (round, &len) in BLOCKS.iter().enumerate() {
        // Rank 0 (or, every other round, rank 2 on the other mount) truncates to 0.
        if rank == (round as u64 % 2) * 2 {
            OpenOptions::new()
                .write(true)
                .open(file)
                .unwrap()
                .set_len(0)
                .unwrap();
        }
        barrier("truncate");
        check("after the truncate to 0", 0, &|_| Ok(()));
        barrier("check");
        // Disjoint blocks.
        OpenOptions::new()
            .write(true)
            .open(file)
            .unwrap()
            .write_all_at(&block(round, rank, len), rank * len)
            .unwrap();
        barrier("blocks");
        let blocks = |all: &[u8]| {
            for r in 0..RANKS {
                let at = (r * len) as usize;
                if all[at..at + len as usize] != block(round, r, len)[..] {
                    return Err(format!("rank {r}'s block of round {round} is not there"));
                }
            }
            Ok(())
        };
        check("after the blocks", RANKS * len, &blocks);
        barrier("check");
        // One append each, at the end then current.
        OpenOptions::new()
            .append(true)
            .open(file)
            .unwrap()
            .write_all(&appended(round, rank))
            .unwrap();
        barrier("append");
        let appends = |all: &[u8]| {
            blocks(all)?;
            let mut tail: Vec<Vec<u8>> = all[(RANKS * len) as usize..]
                .chunks(APPENDED as usize)
                .map(<[u8]>::to_vec)
                .collect();
            tail.sort();
            let mut want: Vec<Vec<u8>> = (0..RANKS).map(|r| appended(round, r)).collect();
            want.sort();
            (tail == want)
                .then_some(())
                .ok_or_else(|| "the appended records are not each there once".to_string())
        };
        check("after the appends", RANKS * (len + APPENDED), &appends);
        barrier("check");
        // A truncate from the other mount's side to an odd length inside the blocks.
        if rank == 3 - (round as u64 % 2) * 2 {
            OpenOptions::new()
                .write(true)
                .open(file)
                .unwrap()
                .set_len(truncated(round))
                .unwrap();
        }
        barrier("shrink");
        let prefix = |all: &[u8]| {
            let mut whole = Vec::new();
            for r in 0..RANKS {
                whole.extend(block(round, r, len));
            }
            (all == &whole[..all.len()])
                .then_some(())
                .ok_or_else(|| "the truncated file is not the blocks' prefix".to_string())
        };
        check("after the shrink", truncated(round), &prefix);
        barrier("check");
    }
    println!("rank {rank} finished");
}

/// Runs [`rank`] in `RANKS` processes, two on each mount, as their barrier.
fn parallel_program(fabric: Backend) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    skip_without_fuse!();
    testkit::init_logging();
    let (_cluster, a, b) = two_mounts(fabric);
    std::fs::write(a.path().join("shared"), b"").unwrap();
    let exe = std::env::current_exe().unwrap();
    struct Rank(std::process::Child);
    impl Drop for Rank {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut ranks: Vec<Rank> = (0..RANKS)
        .map(|r| {
            let mount = if r < 2 { a.path() } else { b.path() };
            Rank(
                Command::new(&exe)
                    .args(["rank", "--exact", "--nocapture", "--test-threads=1"])
                    .env(ENV_RANK, r.to_string())
                    .env(ENV_RANK_FILE, mount.join("shared"))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap(),
            )
        })
        .collect();
    let mut outs: Vec<_> = ranks
        .iter_mut()
        .map(|r| BufReader::new(r.0.stdout.take().unwrap()).lines())
        .collect();
    let mut ins: Vec<_> = ranks
        .iter_mut()
        .map(|r| r.0.stdin.take().unwrap())
        .collect();
    let mut steps = 0;
    'program: loop {
        for (r, out) in outs.iter_mut().enumerate() {
            loop {
                let Some(line) = out.next() else {
                    let status = ranks[r].0.wait().unwrap();
                    panic!("{fabric:?}: rank {r} ended after {steps} steps ({status})");
                };
                let line = line.unwrap();
                // The harness may have begun the line ("test rank ... ").
                if line.ends_with(&format!("rank {r} finished")) {
                    assert_eq!(r, 0, "rank {r} finished before rank 0");
                    break 'program;
                }
                if line.contains(&format!("rank {r} done")) {
                    break;
                }
            }
        }
        steps += 1;
        for input in &mut ins {
            writeln!(input, "go").unwrap();
        }
    }
    for (r, rank) in ranks.iter_mut().enumerate() {
        let status = rank.0.wait().unwrap();
        assert!(status.success(), "{fabric:?}: rank {r}: {status}");
    }
    assert_eq!(steps, BLOCKS.len() * 8, "barriers passed");
}

#[test]
fn a_parallel_program_over_two_mounts_sees_one_file_on_shm() {
    parallel_program(Backend::Shm);
}

#[test]
fn a_parallel_program_over_two_mounts_sees_one_file_on_tcp() {
    parallel_program(Backend::Tcp);
}

// ---------------------------------------------------------------------------------------------
// A model-based test: random steps through either mount (writes, appends, truncates, chmod,
// utimensat, creates, unlinks and renames of names in one directory), after each of which both
// mounts must show exactly what a reference model holds: the file's size (stat, fstat),
// contents, mode and explicitly set modification time, and the directory's names (lookups
// and listings).

mod model {
    use super::*;
    use proptest::prelude::*;

    /// Names the steps create, rename and remove (besides the data file "f").
    const NAMES: [&str; 3] = ["n0", "n1", "n2"];

    #[derive(Clone, Debug)]
    pub(super) enum Step {
        Write { at: u64, len: usize, seed: u64 },
        Append { len: usize, seed: u64 },
        Truncate { len: u64 },
        Chmod { mode: u32 },
        Utime { secs: u64 },
        Create { name: usize },
        Unlink { name: usize },
        Rename { from: usize, to: usize },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => (0u64..200_000, 1usize..70_000, any::<u64>())
                .prop_map(|(at, len, seed)| Step::Write { at, len, seed }),
            2 => (1usize..5_000, any::<u64>()).prop_map(|(len, seed)| Step::Append { len, seed }),
            2 => (0u64..300_000).prop_map(|len| Step::Truncate { len }),
            1 => prop_oneof![Just(0o600u32), Just(0o644), Just(0o640), Just(0o755)]
                .prop_map(|mode| Step::Chmod { mode }),
            1 => (1u64..2_000_000_000).prop_map(|secs| Step::Utime { secs }),
            1 => (0..NAMES.len()).prop_map(|name| Step::Create { name }),
            1 => (0..NAMES.len()).prop_map(|name| Step::Unlink { name }),
            1 => (0..NAMES.len(), 0..NAMES.len()).prop_map(|(from, to)| Step::Rename { from, to }),
        ]
    }

    /// What the file and its directory should be.
    #[derive(Default)]
    struct Model {
        data: Vec<u8>,
        mode: u32,
        /// The modification time last set explicitly, until a write moves it.
        mtime: Option<SystemTime>,
        /// The names besides "f".
        names: BTreeSet<&'static str>,
    }

    fn apply(step: &Step, dir: &Path, model: &mut Model) {
        let f = dir.join("f");
        match *step {
            Step::Write { at, len, seed } => {
                let bytes = testkit::pattern(seed, at, len);
                OpenOptions::new()
                    .write(true)
                    .open(&f)
                    .unwrap()
                    .write_all_at(&bytes, at)
                    .unwrap();
                let end = at as usize + len;
                if model.data.len() < end {
                    model.data.resize(end, 0);
                }
                model.data[at as usize..end].copy_from_slice(&bytes);
                model.mtime = None;
            }
            Step::Append { len, seed } => {
                let bytes = testkit::pattern(seed, 0, len);
                OpenOptions::new()
                    .append(true)
                    .open(&f)
                    .unwrap()
                    .write_all(&bytes)
                    .unwrap();
                model.data.extend(bytes);
                model.mtime = None;
            }
            Step::Truncate { len } => {
                OpenOptions::new()
                    .write(true)
                    .open(&f)
                    .unwrap()
                    .set_len(len)
                    .unwrap();
                model.data.resize(len as usize, 0);
                model.mtime = None;
            }
            Step::Chmod { mode } => {
                std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
                model.mode = mode;
            }
            Step::Utime { secs } => {
                let t = SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
                File::open(&f)
                    .unwrap()
                    .set_times(std::fs::FileTimes::new().set_modified(t))
                    .unwrap();
                model.mtime = Some(t);
            }
            Step::Create { name } => {
                OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(dir.join(NAMES[name]))
                    .unwrap();
                model.names.insert(NAMES[name]);
            }
            Step::Unlink { name } => match std::fs::remove_file(dir.join(NAMES[name])) {
                Ok(()) => assert!(model.names.remove(NAMES[name]), "{step:?}: removed"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    assert!(!model.names.contains(NAMES[name]), "{step:?}: {e}")
                }
                Err(e) => panic!("{step:?}: {e}"),
            },
            Step::Rename { from, to } => {
                match std::fs::rename(dir.join(NAMES[from]), dir.join(NAMES[to])) {
                    Ok(()) => {
                        assert!(model.names.remove(NAMES[from]), "{step:?}: renamed");
                        model.names.insert(NAMES[to]);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        assert!(!model.names.contains(NAMES[from]), "{step:?}: {e}")
                    }
                    Err(e) => panic!("{step:?}: {e}"),
                }
            }
        }
    }

    /// What `dir` shows through one mount, against the model.
    fn compare(dir: &Path, model: &Model) -> Result<(), String> {
        let f = dir.join("f");
        let meta = std::fs::metadata(&f).map_err(|e| format!("stat: {e}"))?;
        let handle = File::open(&f).map_err(|e| format!("open: {e}"))?;
        let fmeta = handle.metadata().map_err(|e| format!("fstat: {e}"))?;
        let want = model.data.len() as u64;
        if meta.len() != want || fmeta.len() != want {
            return Err(format!(
                "size: stat {}, fstat {}, model {want}",
                meta.len(),
                fmeta.len()
            ));
        }
        if meta.mode() & 0o7777 != model.mode {
            return Err(format!(
                "mode {:o}, model {:o}",
                meta.mode() & 0o7777,
                model.mode
            ));
        }
        if let Some(t) = model.mtime {
            let got = meta.modified().map_err(|e| e.to_string())?;
            if got != t {
                return Err(format!("mtime {got:?}, model {t:?}"));
            }
        }
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut &handle, &mut data).map_err(|e| format!("read: {e}"))?;
        if data != model.data {
            let first = data.iter().zip(&model.data).position(|(a, b)| a != b);
            return Err(format!(
                "contents: {} bytes read, first difference at {first:?}",
                data.len()
            ));
        }
        let mut want: BTreeSet<String> = model.names.iter().map(|n| n.to_string()).collect();
        want.insert("f".into());
        let listed = listing(dir);
        if listed != want {
            return Err(format!("listing {listed:?}, model {want:?}"));
        }
        for name in NAMES {
            if exists(&dir.join(name)) != model.names.contains(name) {
                return Err(format!("lookup of {name} disagrees with the model"));
            }
        }
        Ok(())
    }

    pub(super) fn run(fabric: Backend) {
        skip_without_fuse!();
        testkit::init_logging();
        let (_cluster, a, b) = two_mounts(fabric);
        let cases = std::env::var("CITRONFS_MODEL_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(6);
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases,
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        let case = std::sync::atomic::AtomicUsize::new(0);
        let steps = proptest::collection::vec((any::<bool>(), step()), 1..30);
        let result = runner.run(&steps, |steps| {
            // Each case (shrinking included) in a directory of its own.
            let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let name = format!("case{n}");
            std::fs::create_dir(a.path().join(&name)).unwrap();
            std::fs::write(a.path().join(&name).join("f"), b"").unwrap();
            let mut model = Model {
                mode: 0o644,
                ..Model::default()
            };
            for (i, (on_b, step)) in steps.iter().enumerate() {
                let (this, other) = if *on_b {
                    (b.path(), a.path())
                } else {
                    (a.path(), b.path())
                };
                apply(step, &this.join(&name), &mut model);
                for (side, dir) in [("this mount", this), ("the other mount", other)] {
                    compare(&dir.join(&name), &model).map_err(|e| {
                        TestCaseError::fail(format!("after step {i} ({step:?}), {side}: {e}"))
                    })?;
                }
            }
            Ok(())
        });
        if let Err(e) = result {
            panic!("{fabric:?}: {e}");
        }
    }
}

#[test]
fn both_mounts_match_a_model_after_every_step_on_shm() {
    model::run(Backend::Shm);
}

#[test]
fn both_mounts_match_a_model_after_every_step_on_tcp() {
    model::run(Backend::Tcp);
}
