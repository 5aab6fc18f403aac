//! A model-based property test of POSIX behaviour: random sequences of file-system operations
//! (over a small set of names, so that they collide) are applied through `std::fs` to a
//! CitronFS mount and to a directory of the local file system, the model. Every operation must
//! give the same result — the same value, or an error with the same errno — and the trees must
//! be equal at the end. A failure is shrunk to a minimal sequence of operations.
//!
//! Besides the classic calls: fallocate(2) in the modes CitronFS supports (allocate, keep
//! size, punch hole), renameat2(2) with `RENAME_EXCHANGE` and `RENAME_NOREPLACE`, and
//! `WriteAgain`, which writes twice through one open file and reports whether each write moved
//! mtime and ctime (every write must, not only the first after an open).

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use testkit::{skip_without_fuse, Cluster, ClusterSpec};

/// Names for files and for directories. Operations mostly pick the fitting kind, sometimes the
/// other (create over a directory, rmdir of a file, ...), and the names nest, so operations
/// collide: rename into a missing parent, over a non-empty directory, and so on.
const FILES: &[&str] = &["f", "g", "d/f", "d/g", "e/f", "d/e/f"];
const DIRS: &[&str] = &["d", "e", "d/e", "e/d"];
/// Symlink targets: relative, into directories, up one level (still inside the case), missing.
const TARGETS: &[&str] = &["f", "d", "d/f", "../f", "e/f", "missing"];
const MODES: &[u32] = &[0o600, 0o644, 0o755, 0o700, 0o444];

#[derive(Clone, Debug)]
enum Op {
    /// Open for writing (creating it if missing, never truncating) and write at an offset.
    Write {
        path: &'static str,
        offset: u64,
        data: Vec<u8>,
    },
    Truncate {
        path: &'static str,
        len: u64,
    },
    Read {
        path: &'static str,
    },
    ReadAt {
        path: &'static str,
        offset: u64,
        len: usize,
    },
    Mkdir {
        path: &'static str,
    },
    Rmdir {
        path: &'static str,
    },
    Unlink {
        path: &'static str,
    },
    Rename {
        from: &'static str,
        to: &'static str,
    },
    Link {
        from: &'static str,
        to: &'static str,
    },
    Symlink {
        target: &'static str,
        path: &'static str,
    },
    Readlink {
        path: &'static str,
    },
    Stat {
        path: &'static str,
    },
    Lstat {
        path: &'static str,
    },
    ReadDir {
        path: &'static str,
    },
    Chmod {
        path: &'static str,
        mode: u32,
    },
    /// fallocate(2) on a file opened for writing (not created).
    Fallocate {
        path: &'static str,
        mode: i32,
        offset: u64,
        len: u64,
    },
    /// renameat2(2) with `flags` (`RENAME_EXCHANGE` or `RENAME_NOREPLACE`).
    Rename2 {
        from: &'static str,
        to: &'static str,
        flags: u32,
    },
    /// Opens an existing file for writing, writes `data` at `offset`, waits until the clock
    /// has moved past the file's times, writes again: did each write move mtime and ctime?
    WriteAgain {
        path: &'static str,
        offset: u64,
        data: Vec<u8>,
    },
}

/// The fallocate(2) modes CitronFS supports.
const FALLOCATE_MODES: &[i32] = &[
    0,
    libc::FALLOC_FL_KEEP_SIZE,
    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
];

/// The renameat2(2) flags tried.
const RENAME2_FLAGS: &[u32] = &[libc::RENAME_EXCHANGE, libc::RENAME_NOREPLACE];

/// A name, usually a file's.
fn path() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        5 => proptest::sample::select(FILES),
        1 => proptest::sample::select(DIRS),
    ]
}

/// A name, usually a directory's (the case's root, "", included).
fn dir_path() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        1 => Just(""),
        6 => proptest::sample::select(DIRS),
        1 => proptest::sample::select(FILES),
    ]
}

/// Any name, for renames (files and directories alike).
fn any_path() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        1 => proptest::sample::select(FILES),
        1 => proptest::sample::select(DIRS),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (path(), 0u64..70_000, proptest::collection::vec(any::<u8>(), 0..3_000))
            .prop_map(|(path, offset, data)| Op::Write { path, offset, data }),
        2 => (path(), 0u64..70_000).prop_map(|(path, len)| Op::Truncate { path, len }),
        3 => path().prop_map(|path| Op::Read { path }),
        2 => (path(), 0u64..70_000, 0usize..5_000)
            .prop_map(|(path, offset, len)| Op::ReadAt { path, offset, len }),
        2 => dir_path().prop_map(|path| Op::Mkdir { path }),
        2 => dir_path().prop_map(|path| Op::Rmdir { path }),
        2 => path().prop_map(|path| Op::Unlink { path }),
        4 => (any_path(), any_path()).prop_map(|(from, to)| Op::Rename { from, to }),
        2 => (path(), path()).prop_map(|(from, to)| Op::Link { from, to }),
        2 => (proptest::sample::select(TARGETS), path())
            .prop_map(|(target, path)| Op::Symlink { target, path }),
        1 => path().prop_map(|path| Op::Readlink { path }),
        3 => path().prop_map(|path| Op::Stat { path }),
        2 => path().prop_map(|path| Op::Lstat { path }),
        3 => dir_path().prop_map(|path| Op::ReadDir { path }),
        2 => (any_path(), proptest::sample::select(MODES))
            .prop_map(|(path, mode)| Op::Chmod { path, mode }),
        3 => (path(), proptest::sample::select(FALLOCATE_MODES), 0u64..70_000, 0u64..70_000)
            .prop_map(|(path, mode, offset, len)| Op::Fallocate { path, mode, offset, len }),
        3 => (any_path(), any_path(), proptest::sample::select(RENAME2_FLAGS))
            .prop_map(|(from, to, flags)| Op::Rename2 { from, to, flags }),
        1 => (path(), 0u64..70_000, proptest::collection::vec(any::<u8>(), 1..2_000))
            .prop_map(|(path, offset, data)| Op::WriteAgain { path, offset, data }),
    ]
}

/// What an operation gave: a description of its value, or the errno of its error.
type Outcome = Result<String, i32>;

fn errno(e: io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

fn ctime(meta: &std::fs::Metadata) -> SystemTime {
    UNIX_EPOCH + Duration::new(meta.ctime() as u64, meta.ctime_nsec() as u32)
}

/// Waits until the clock reads well past the file's mtime and ctime, so that a write must
/// give it later ones (local file systems stamp with a coarse clock tick).
fn wait_past(meta: &std::fs::Metadata) {
    let latest = meta.modified().unwrap().max(ctime(meta)) + Duration::from_millis(20);
    while SystemTime::now() <= latest {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn describe(meta: &std::fs::Metadata) -> String {
    let ft = meta.file_type();
    if ft.is_dir() {
        // Directory sizes are the file system's own business; link counts are not.
        format!("dir mode {:o} nlink {}", meta.mode() & 0o7777, meta.nlink())
    } else if ft.is_symlink() {
        format!("symlink size {}", meta.len())
    } else if ft.is_file() {
        format!(
            "file mode {:o} size {} nlink {}",
            meta.mode() & 0o7777,
            meta.len(),
            meta.nlink()
        )
    } else {
        format!("other {:?}", ft)
    }
}

fn apply(root: &Path, op: &Op) -> Outcome {
    let p = |s: &str| root.join(s);
    let r: io::Result<String> = (|| match op {
        Op::Write { path, offset, data } => {
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(p(path))?;
            f.write_all_at(data, *offset)?;
            Ok(format!("wrote {}", data.len()))
        }
        Op::Truncate { path, len } => {
            OpenOptions::new()
                .write(true)
                .open(p(path))?
                .set_len(*len)?;
            Ok(String::new())
        }
        Op::Read { path } => Ok(format!("{:?}", std::fs::read(p(path))?)),
        Op::ReadAt { path, offset, len } => {
            let f = std::fs::File::open(p(path))?;
            let mut buf = vec![0u8; *len];
            let mut n = 0;
            // Read until EOF or full: how much a single read returns is not the point.
            while n < buf.len() {
                match f.read_at(&mut buf[n..], offset + n as u64)? {
                    0 => break,
                    k => n += k,
                }
            }
            buf.truncate(n);
            Ok(format!("{buf:?}"))
        }
        Op::Mkdir { path } => std::fs::create_dir(p(path)).map(|()| String::new()),
        Op::Rmdir { path } => std::fs::remove_dir(p(path)).map(|()| String::new()),
        Op::Unlink { path } => std::fs::remove_file(p(path)).map(|()| String::new()),
        Op::Rename { from, to } => std::fs::rename(p(from), p(to)).map(|()| String::new()),
        Op::Link { from, to } => std::fs::hard_link(p(from), p(to)).map(|()| String::new()),
        Op::Symlink { target, path } => {
            std::os::unix::fs::symlink(target, p(path)).map(|()| String::new())
        }
        Op::Readlink { path } => Ok(format!("{:?}", std::fs::read_link(p(path))?)),
        Op::Stat { path } => Ok(describe(&std::fs::metadata(p(path))?)),
        Op::Lstat { path } => Ok(describe(&std::fs::symlink_metadata(p(path))?)),
        Op::ReadDir { path } => {
            let mut names = std::fs::read_dir(p(path))?
                .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect::<io::Result<Vec<_>>>()?;
            names.sort();
            Ok(names.join(","))
        }
        Op::Chmod { path, mode } => {
            std::fs::set_permissions(p(path), std::fs::Permissions::from_mode(*mode))
                .map(|()| String::new())
        }
        Op::Fallocate {
            path,
            mode,
            offset,
            len,
        } => {
            let f = OpenOptions::new().write(true).open(p(path))?;
            // SAFETY: a valid descriptor; fallocate touches no memory of ours.
            let r = unsafe { libc::fallocate(f.as_raw_fd(), *mode, *offset as i64, *len as i64) };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(String::new())
        }
        Op::Rename2 { from, to, flags } => {
            let c = |s: &str| CString::new(p(s).as_os_str().as_bytes()).expect("no NUL");
            let (from, to) = (c(from), c(to));
            // SAFETY: two NUL-terminated paths that outlive the call.
            let r = unsafe {
                libc::renameat2(
                    libc::AT_FDCWD,
                    from.as_ptr(),
                    libc::AT_FDCWD,
                    to.as_ptr(),
                    *flags,
                )
            };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(String::new())
        }
        Op::WriteAgain { path, offset, data } => {
            let f = OpenOptions::new().write(true).open(p(path))?;
            let mut moved = Vec::new();
            for _ in 0..2 {
                let before = f.metadata()?;
                wait_past(&before);
                f.write_all_at(data, *offset)?;
                let after = f.metadata()?;
                moved.push(format!(
                    "mtime moved {}, ctime moved {}",
                    after.modified()? > before.modified()?,
                    ctime(&after) > ctime(&before)
                ));
            }
            Ok(moved.join("; "))
        }
    })();
    r.map_err(errno)
}

/// Everything under `dir`: relative path, kind, mode, file contents, link targets, link counts.
fn tree(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for path in entries {
            let rel = path.strip_prefix(base).unwrap().display().to_string();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            out.push(format!("{rel}: {}", describe(&meta)));
            if meta.is_dir() {
                walk(base, &path, out);
            } else if meta.file_type().is_symlink() {
                out.push(format!(
                    "{rel} -> {}",
                    std::fs::read_link(&path).unwrap().display()
                ));
            } else {
                let data = std::fs::read(&path).unwrap();
                out.push(format!(
                    "{rel} = {} bytes, {:016x}",
                    data.len(),
                    hash(&data)
                ));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out
}

fn hash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A short, readable form of an operation for failure reports (written bytes elided).
fn show(op: &Op) -> String {
    match op {
        Op::Write { path, offset, data } => {
            format!(
                "Write {{ path: {path:?}, offset: {offset}, len: {} }}",
                data.len()
            )
        }
        Op::WriteAgain { path, offset, data } => {
            format!(
                "WriteAgain {{ path: {path:?}, offset: {offset}, len: {} }}",
                data.len()
            )
        }
        other => format!("{other:?}"),
    }
}

/// Where every case starts: directories d, e and d/e; files f and d/f.
fn setup() -> Vec<Op> {
    vec![
        Op::Mkdir { path: "d" },
        Op::Mkdir { path: "e" },
        Op::Mkdir { path: "d/e" },
        Op::Write {
            path: "f",
            offset: 0,
            data: b"contents of f".to_vec(),
        },
        Op::Write {
            path: "d/f",
            offset: 65_530,
            data: b"across a chunk boundary".to_vec(),
        },
    ]
}

#[test]
fn random_operations_match_the_local_file_system() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let mnt = cluster.mount().unwrap();
    let local = tempfile::tempdir().unwrap();
    let cases = AtomicU64::new(0);
    let (oks, errs) = (AtomicU64::new(0), AtomicU64::new(0));

    // 24 cases keep CI fast; CITRONFS_MODEL_CASES=N explores more.
    let n_cases = std::env::var("CITRONFS_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    let mut runner = TestRunner::new(Config {
        cases: n_cases,
        max_shrink_iters: 256,
        // Shrinking failures are reported in the panic; no regression files in the crate.
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = proptest::collection::vec(op(), 1..30);
    let result = runner.run(&strategy, |ops| {
        // Each case (shrinking included) starts from empty directories; the operations run in
        // `case/root`, so that `../f` stays inside what is compared.
        let n = cases.fetch_add(1, Ordering::Relaxed);
        let (mcase, lcase) = (
            mnt.path().join(format!("case-{n}")),
            local.path().join(format!("case-{n}")),
        );
        for case in [&mcase, &lcase] {
            std::fs::create_dir_all(case.join("root")).unwrap();
            // A populated start, so that most operations find something to work on.
            for op in setup() {
                apply(&case.join("root"), &op).unwrap();
            }
        }
        for (i, op) in ops.iter().enumerate() {
            let got = apply(&mcase.join("root"), op);
            let want = apply(&lcase.join("root"), op);
            if got.is_ok() {
                oks.fetch_add(1, Ordering::Relaxed);
            } else {
                errs.fetch_add(1, Ordering::Relaxed);
            }
            if got != want {
                return Err(TestCaseError::fail(format!(
                    "operation {i}, {}: CitronFS gave {got:?}, the local file system {want:?}",
                    show(op)
                )));
            }
        }
        let (got, want) = (tree(&mcase), tree(&lcase));
        if got != want {
            return Err(TestCaseError::fail(format!(
                "the trees differ at the end:\nCitronFS: {got:#?}\nlocal: {want:#?}"
            )));
        }
        // Free what the case used (the cluster is small), checking that removal works too.
        for case in [&mcase, &lcase] {
            if let Err(e) = std::fs::remove_dir_all(case) {
                return Err(TestCaseError::fail(format!(
                    "removing {}: {e}",
                    case.display()
                )));
            }
        }
        Ok(())
    });
    match result {
        Ok(()) => {
            println!(
            "{} cases (at most 29 operations each) gave the same results: {} successes, {} errors",
            cases.load(Ordering::Relaxed), oks.load(Ordering::Relaxed), errs.load(Ordering::Relaxed)
        )
        }
        Err(TestError::Fail(why, ops)) => panic!(
            "{why}\nminimal failing sequence ({} operations):\n{}",
            ops.len(),
            ops.iter().map(show).collect::<Vec<_>>().join("\n")
        ),
        Err(e) => panic!("{e}"),
    }
}
