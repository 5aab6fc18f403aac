//! The frame every benchmark runs in: a progress bar for people, and an orderly stop on a
//! signal. A workload brings its pattern, its verifier and its report ([`crate::report::Report`],
//! [`crate::plot`]); client processes come from [`super::clients`].

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// One benchmark run: its progress bar (on stderr, hidden with `--json`, whose stdout is for
/// machines) and the flag a first SIGINT or SIGTERM sets.
///
/// A signal ends a run that starts mounts, client processes or servers in an orderly way: the
/// benchmark checks the flag between (and inside) its cases ([`Run::check`]) and fails with
/// "interrupted", so that its guards unmount, stop and remove what it started on the way out; a
/// second signal exits at once with status 130. Client processes die with the benchmark
/// whatever ends it (`clients::MountProcess`, and `cluster::die_with_parent` for an impatient
/// second Ctrl-C).
pub(crate) struct Run {
    progress: ProgressBar,
    stop: Arc<AtomicBool>,
}

impl Run {
    /// Starts a run of `steps` steps (the progress bar's length; [`Run::set_steps`] changes it)
    /// and catches SIGINT and SIGTERM.
    pub(crate) fn start(json: bool, steps: u64) -> Result<Run> {
        let mut run = Run::in_process(json, steps);
        run.stop = crate::cmd::StopSignals::catch()?.into_flag();
        Ok(run)
    }

    /// [`Run::start`] for a run that starts nothing outside this process (no mounts, client
    /// processes or servers): signals are left alone, so the first one ends it at once.
    pub(crate) fn in_process(json: bool, steps: u64) -> Run {
        let progress = if json {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(steps).with_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ({elapsed})")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            )
        };
        Run {
            progress,
            stop: Arc::default(),
        }
    }

    /// Fails with "interrupted" once a signal asked the run to stop.
    pub(crate) fn check(&self) -> Result<()> {
        interrupted(&self.stop)
    }

    /// The flag a signal sets, for loops that poll it themselves.
    pub(crate) fn stop(&self) -> &AtomicBool {
        &self.stop
    }

    /// Says what the run is doing now (the progress bar's message).
    pub(crate) fn say(&self, what: impl Into<Cow<'static, str>>) {
        self.progress.set_message(what);
    }

    /// One step done.
    pub(crate) fn advance(&self) {
        self.progress.inc(1);
    }

    /// The run has `steps` steps in all (known once the run has set up what it measures).
    pub(crate) fn set_steps(&self, steps: u64) {
        self.progress.set_length(steps);
    }

    /// Clears the progress bar before the results are printed.
    pub(crate) fn finish(&self) {
        self.progress.finish_and_clear();
    }
}

/// The error that ends a run once its stop flag (`stop`) is set.
pub(crate) fn interrupted(stop: &AtomicBool) -> Result<()> {
    if stop.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}
