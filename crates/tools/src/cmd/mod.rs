//! The commands that run CitronFS: an embedded cluster (`up`), each role on its own host, the
//! consistency checker (`fsck`), a running cluster's state (`status`), and the metrics
//! responder every role serves with `--metrics ADDR` (`metrics`).

pub mod config;
pub mod fsck;
pub mod metrics;
pub mod roles;
pub mod status;
pub mod up;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// SIGINT and SIGTERM, caught from the moment [`StopSignals::catch`] is called: its flag is
/// set when one arrives. Caught first thing by the commands that serve until told to stop
/// (`mount`, `up`, `data-server`), before they connect or mount — not when they start waiting:
/// a signal in between would otherwise kill the process by the default action, and a FUSE
/// mount whose process died so stays in the mount table, dead (ENOTCONN), until someone
/// unmounts it by hand. Seen when a benchmark was killed just as its client processes mounted
/// (`tools/tests/workloads.rs`, a CI run of 2026-11-27). A signal that comes while the command
/// is still starting is acted on as soon as it is started — and a second one, while it is
/// still starting (a connection that takes its time to time out), exits at once with status
/// 130, as an impatient user's second Ctrl-C should. Once there is a mount to take down in
/// order ([`StopSignals::orderly_from_now`]), a second signal is only noted.
pub struct StopSignals {
    stop: Arc<AtomicBool>,
    /// The handlers that exit on a second signal, until `orderly_from_now` removes them.
    exit_on_second: Vec<signal_hook::SigId>,
}

impl StopSignals {
    /// Starts catching the signals.
    pub fn catch() -> anyhow::Result<StopSignals> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut exit_on_second = Vec::new();
        for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            // Registered first, so that it sees the flag as it was before this signal.
            exit_on_second.push(signal_hook::flag::register_conditional_shutdown(
                signal,
                130,
                stop.clone(),
            )?);
            signal_hook::flag::register(signal, stop.clone())?;
        }
        Ok(StopSignals {
            stop,
            exit_on_second,
        })
    }

    /// The flag a signal sets.
    pub fn flag(&self) -> &AtomicBool {
        &self.stop
    }

    /// The flag, the handlers left as they are (a second signal still exits at once, unless
    /// [`StopSignals::orderly_from_now`] was called before).
    pub fn into_flag(self) -> Arc<AtomicBool> {
        self.stop
    }

    /// Whether a signal came.
    pub fn received(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// From now on a second signal no longer exits at once: the command is about to make what
    /// must be taken down in order (a mount, which a process that simply exits leaves dead).
    pub fn orderly_from_now(&mut self) {
        for id in self.exit_on_second.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// Blocks until a signal came ([`StopSignals`]).
pub fn wait_for_stop(signals: &StopSignals) {
    while !signals.received() {
        std::thread::sleep(Duration::from_millis(100));
    }
}
