//! Re-replication (docs/REPLICAS.md): the meta server gives every chunk that has fewer live
//! replicas than its file's factor a new replica on another live data server, in the
//! background, a chunk at a time, at a limited rate. This module owns when passes run, their
//! progress and their pace; what a pass does to one chunk (the file's range lock, the copy, the
//! commit) is the service's (`service::rereplicate`), and the transactions are the store's
//! (`store::rereplicate`).
//!
//! # When a pass runs
//! - After a data server is marked down (its registration connection closed, or it went
//!   silent) or came back with new memory, once [`Settings::after`] has passed since: a server
//!   that restarts within it with its memory (a file- or shm-backed region) costs no copy, a
//!   memory-only one's replicas are marked lost when it registers and are re-replicated then.
//!   Every event moves the pass no later than `after` from it.
//! - At once when `citronfs fsck --repair` finds under-replicated chunks (it runs the pass
//!   itself and waits for it).
//! - Again `after` after a pass that left chunks undone (no room, a copy failed).

use crate::sync::lock;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The default of [`Settings::rate`]: 128 MiB/s, a fraction of one link or memory channel, so
/// that clients' I/O keeps most of the data servers' bandwidth while a lost server's data
/// (a few GiB) is copied again within a minute or so.
pub const DEFAULT_REREPLICATE_MIB_S: u64 = 128;

/// The default of [`Settings::after`]: 30 s, longer than a data server's restart takes (a
/// server that keeps its memory across one is not copied), short next to the time a second
/// failure is likely to take.
pub const DEFAULT_REREPLICATE_AFTER: Duration = Duration::from_secs(30);

/// How often a pass logs its progress.
const LOG_EVERY: Duration = Duration::from_secs(2);

/// What re-replication is told.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    /// Bytes copied per second at most (0: no limit).
    pub rate: u64,
    /// How long after a data server is marked down a pass runs.
    pub after: Duration,
}

/// Re-replication's schedule and progress (see the module docs).
pub(crate) struct Rereplicator {
    settings: Settings,
    state: Mutex<Schedule>,
    wake: Condvar,
    /// Held by whoever re-replicates chunks (the thread's pass, `fsck --repair`'s): one
    /// chunk at a time in the whole server.
    pub work: Mutex<()>,
}

#[derive(Default)]
struct Schedule {
    /// When the next pass is due.
    due: Option<Instant>,
    stop: bool,
    progress: Progress,
}

/// A pass's progress.
#[derive(Clone, Debug, Default)]
struct Progress {
    running: bool,
    started: Option<Instant>,
    ended: Option<Instant>,
    done: u64,
    left: u64,
    failed: u64,
    bytes: u64,
    total_done: u64,
    last_log: Option<Instant>,
}

impl Progress {
    /// Bytes per second so far.
    fn rate(&self, now: Instant) -> f64 {
        let Some(started) = self.started else {
            return 0.0;
        };
        let end = if self.running {
            now
        } else {
            self.ended.unwrap_or(now)
        };
        let secs = end.saturating_duration_since(started).as_secs_f64();
        if secs > 0.0 {
            self.bytes as f64 / secs
        } else {
            0.0
        }
    }
}

impl Rereplicator {
    /// No pass due yet.
    pub fn new(settings: Settings) -> Rereplicator {
        Rereplicator {
            settings,
            state: Mutex::new(Schedule::default()),
            wake: Condvar::new(),
            work: Mutex::new(()),
        }
    }

    /// The settings.
    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// A data server was marked down or came back with new memory: a pass is due no later
    /// than [`Settings::after`] from now.
    pub fn server_changed(&self) {
        self.due_in(self.settings.after);
    }

    /// A pass is due no later than `wait` from now.
    pub fn due_in(&self, wait: Duration) {
        let at = Instant::now() + wait;
        let mut st = lock(&self.state);
        st.due = Some(st.due.map_or(at, |due| due.min(at)));
        self.wake.notify_all();
    }

    /// Blocks until a pass is due (`true`) or [`Rereplicator::stop`] was called (`false`).
    pub fn next_pass(&self) -> bool {
        let mut st = lock(&self.state);
        loop {
            if st.stop {
                return false;
            }
            let now = Instant::now();
            match st.due {
                Some(due) if due <= now => {
                    st.due = None;
                    return true;
                }
                Some(due) => {
                    st = self
                        .wake
                        .wait_timeout(st, due - now)
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .0;
                }
                None => {
                    st = self
                        .wake
                        .wait(st)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            }
        }
    }

    /// Ends [`Rereplicator::next_pass`] for good, and the pass running at its next chunk.
    pub fn stop(&self) {
        lock(&self.state).stop = true;
        self.wake.notify_all();
    }

    /// Whether [`Rereplicator::stop`] was called.
    pub fn stopping(&self) -> bool {
        lock(&self.state).stop
    }

    /// A pass begins with `left` chunks to do.
    pub fn pass_begins(&self, left: u64) {
        let mut st = lock(&self.state);
        let total_done = st.progress.total_done;
        st.progress = Progress {
            running: true,
            started: Some(Instant::now()),
            left,
            total_done,
            ..Progress::default()
        };
        tracing::info!(chunks = left, "re-replication pass begins");
    }

    /// A chunk of the pass is done: re-replicated with `bytes` copied (`Some`), or not
    /// (`None`: failed, or nothing to do any more). Logs the progress now and then.
    pub fn chunk_done(&self, copied: Option<u64>) {
        let mut st = lock(&self.state);
        let p = &mut st.progress;
        p.left = p.left.saturating_sub(1);
        match copied {
            Some(bytes) => {
                p.done += 1;
                p.total_done += 1;
                p.bytes += bytes;
            }
            None => p.failed += 1,
        }
        let now = Instant::now();
        if p.last_log
            .is_none_or(|at| now.duration_since(at) >= LOG_EVERY)
        {
            p.last_log = Some(now);
            tracing::info!(
                done = p.done,
                left = p.left,
                failed = p.failed,
                mib_per_s = format!("{:.1}", p.rate(now) / f64::from(1 << 20)),
                "re-replication progress"
            );
        }
    }

    /// A chunk of the pass needed nothing any more (its set changed since the pass began:
    /// freed, rewritten, re-replicated by another pass).
    pub fn chunk_skipped(&self) {
        let mut st = lock(&self.state);
        st.progress.left = st.progress.left.saturating_sub(1);
    }

    /// The pass ended; when it left chunks undone, another is due [`Settings::after`] later.
    pub fn pass_ends(&self) {
        let now = Instant::now();
        let undone = {
            let mut st = lock(&self.state);
            let p = &mut st.progress;
            p.running = false;
            p.ended = Some(now);
            p.left = 0;
            tracing::info!(
                done = p.done,
                failed = p.failed,
                mib = p.bytes >> 20,
                mib_per_s = format!("{:.1}", p.rate(now) / f64::from(1 << 20)),
                elapsed = ?p.started.map(|s| now.duration_since(s)).unwrap_or_default(),
                "re-replication pass ended"
            );
            p.failed > 0
        };
        if undone {
            self.due_in(self.settings.after);
        }
    }

    /// How long to wait before copying the next chunk so that the `bytes` copied since the
    /// pass began keep to the rate limit ([`pace`]).
    pub fn pace_now(&self) -> Duration {
        let st = lock(&self.state);
        let p = &st.progress;
        match p.started {
            Some(started) => pace(p.bytes, self.settings.rate, started.elapsed()),
            None => Duration::ZERO,
        }
    }

    /// Where re-replication stands, as `citronfs status` shows it.
    pub fn status(&self) -> proto::status::RereplicationStatus {
        let st = lock(&self.state);
        let p = &st.progress;
        let now = Instant::now();
        proto::status::RereplicationStatus {
            running: p.running,
            done: p.done,
            left: p.left,
            failed: p.failed,
            bytes: p.bytes,
            kib_per_s: (p.rate(now) / 1024.0) as u64,
            total_done: p.total_done,
            limit_mib_per_s: self.settings.rate >> 20,
            next_pass_in_ms: st
                .due
                .map(|due| due.saturating_duration_since(now).as_millis() as u64),
        }
    }
}

/// How long to wait, `elapsed` after a start, before copying more so that the `bytes` copied
/// since do not exceed `rate` bytes per second (0: no limit, no wait).
pub(crate) fn pace(bytes: u64, rate: u64, elapsed: Duration) -> Duration {
    if rate == 0 {
        return Duration::ZERO;
    }
    let due = Duration::from_secs_f64(bytes as f64 / rate as f64);
    due.saturating_sub(elapsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pace_keeps_to_the_rate() {
        const MIB: u64 = 1 << 20;
        // 10 MiB at 10 MiB/s take a second: after 0.25 s, 0.75 s to wait.
        assert_eq!(
            pace(10 * MIB, 10 * MIB, Duration::from_millis(250)),
            Duration::from_millis(750)
        );
        // Behind the rate: no wait.
        assert_eq!(pace(MIB, 10 * MIB, Duration::from_secs(1)), Duration::ZERO);
        // No limit.
        assert_eq!(pace(u64::MAX, 0, Duration::ZERO), Duration::ZERO);
        // A copy of `n` chunks paced this way takes n · chunk / rate in all.
        let (chunk, rate) = (MIB, 64 * MIB);
        let mut clock = Duration::ZERO;
        let mut bytes = 0;
        for _ in 0..64 {
            clock += pace(bytes, rate, clock);
            bytes += chunk;
        }
        clock += pace(bytes, rate, clock);
        assert_eq!(clock, Duration::from_secs(1));
    }

    #[test]
    fn a_pass_is_due_after_the_grace_and_stop_ends_the_wait() {
        let r = Rereplicator::new(Settings {
            rate: 0,
            after: Duration::from_millis(50),
        });
        let start = Instant::now();
        r.server_changed();
        // A later event does not put it off.
        std::thread::sleep(Duration::from_millis(10));
        r.server_changed();
        assert!(r.next_pass());
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(50), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        r.due_in(Duration::ZERO);
        assert!(r.next_pass());
        r.stop();
        assert!(!r.next_pass());
    }

    #[test]
    fn progress_counts_chunks_and_a_pass_with_failures_is_retried() {
        let r = Rereplicator::new(Settings {
            rate: 4 << 20,
            after: Duration::from_secs(3600),
        });
        r.pass_begins(4);
        r.chunk_done(Some(1 << 20));
        r.chunk_done(None);
        r.chunk_skipped();
        let s = r.status();
        assert!(s.running);
        assert_eq!((s.done, s.left, s.failed, s.bytes), (1, 1, 1, 1 << 20));
        assert_eq!(s.limit_mib_per_s, 4);
        assert!(r.pace_now() > Duration::ZERO, "1 MiB at 4 MiB/s: a wait");
        r.pass_ends();
        let s = r.status();
        assert!(!s.running);
        assert_eq!((s.done, s.left, s.total_done), (1, 0, 1));
        assert!(
            s.next_pass_in_ms.is_some(),
            "a failed chunk is retried later"
        );
    }
}
