//! A model-based property test of POSIX behaviour: random sequences of file-system operations
//! (over a small set of names, so that they collide) are applied through `std::fs` to a
//! CitronFS mount and to a directory of the local file system, the model. Every operation must
//! give the same result — the same value, or an error with the same errno — and the trees must
//! be equal at the end. A failure is shrunk to a minimal sequence of operations.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
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
}

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
    ]
}

/// What an operation gave: a description of its value, or the errno of its error.
type Outcome = Result<String, i32>;

fn errno(e: io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
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
