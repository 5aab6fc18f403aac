//! The commands that run CitronFS: an embedded cluster (`up`), each role on its own host, and
//! the consistency checker (`fsck`).

pub mod config;
pub mod fsck;
pub mod roles;
pub mod up;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Catches SIGINT and SIGTERM from now on: the returned flag is set when one arrives. Called
/// first thing by the commands that serve until told to stop (`mount`, `up`, `data-server`),
/// before they connect or mount — not when they start waiting: a signal in between would
/// otherwise kill the process by the default action, and a FUSE mount whose process died so
/// stays in the mount table, dead (ENOTCONN), until someone unmounts it by hand. Seen when a
/// benchmark was killed just as its client processes mounted (`tools/tests/workloads.rs`,
/// a CI run of 2026-11-27). A signal that comes while the command is still starting is acted
/// on as soon as it is started.
pub fn catch_stop_signals() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone())?;
    }
    Ok(stop)
}

/// Blocks until `stop` ([`catch_stop_signals`]) is set.
pub fn wait_for_stop(stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
    }
}
