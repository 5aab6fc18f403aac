//! Skips that are seen and counted: a test that cannot run here says why on the real stderr
//! (past the test harness's capture, so `cargo test` shows it even when the test passes) and,
//! where `CITRONFS_SKIP_LOG` names a file, appends a line to it, which `.ci/run` counts and
//! checks against what the machine has.
//!
//! Each skip names what it lacked ([`Need`]): `.ci/run` fails a run in which a test skipped for
//! lack of something the machine has (root, a usable `/dev/fuse`, `ip`), so that a green run
//! says the tests ran rather than returned early.

use std::io::Write;

/// The environment variable naming the file skips are appended to (one line each).
pub const ENV_SKIP_LOG: &str = "CITRONFS_SKIP_LOG";

/// What a skipped test needed and did not find.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// FUSE mounts: `/dev/fuse` that opens, and `fusermount3` for a non-root user.
    Fuse,
    /// Root (to switch users, to make network namespaces).
    Root,
    /// Network namespaces: root, `ip` (iproute2), and a kernel and container that allow them.
    Netns,
    /// An RDMA device that opens (the `rdma` fabric's provider from `CITRONFS_RDMA_PROVIDER`:
    /// `ibverbs` needs a device; `soft` runs anywhere).
    Rdma,
    /// Something else: a kernel feature (FUSE over io_uring, shared mappings of direct-I/O
    /// files), a tool outside the project's install list.
    Other,
}

impl Need {
    /// The word the skip log uses.
    pub fn word(self) -> &'static str {
        match self {
            Need::Fuse => "fuse",
            Need::Root => "root",
            Need::Netns => "netns",
            Need::Rdma => "rdma",
            Need::Other => "other",
        }
    }
}

/// Records that the calling test skips itself for lack of `need`, saying `why`: one line on
/// the real stderr, and one in the skip log when [`ENV_SKIP_LOG`] is set. The caller then
/// returns.
pub fn skip(need: Need, why: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("(unnamed test)")
        .to_string();
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let binary = binary.rsplit_once('-').map_or(&*binary, |(name, _)| name);
    let why = why.replace('\n', " ");
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED {binary}::{test} (needs {}): {why}",
        need.word()
    );
    if let Some(path) = std::env::var_os(ENV_SKIP_LOG) {
        if let Ok(mut log) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(log, "{}\t{binary}::{test}\t{why}", need.word());
        }
    }
}
