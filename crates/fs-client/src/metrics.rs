//! Prometheus metrics of a client: what a mount serves at `--metrics ADDR` (`GET /metrics`).
//!
//! Nothing here is global: the caller owns a `prometheus_client` [`Registry`] and registers
//! into it.
//!
//! - [`FuseMetrics`]: per FUSE operation request counts, latency histograms and errors by
//!   errno, and the bytes read and written through the mount. The FUSE adapter (`fuse`)
//!   updates them where it answers the kernel, when the mount has them
//!   (`FuseOptions::metrics`): a relaxed atomic increment and a histogram observe per
//!   request; without them it does nothing more than before.
//! - [`register_client`]: the library's own counters ([`CitronFs::io_stats`],
//!   [`CitronFs::lock_stats`]), read at scrape time by a collector; nothing is added to the
//!   data path.

use crate::CitronFs;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

macro_rules! fuse_ops {
    ($($variant:ident => $name:literal),* $(,)?) => {
        /// A FUSE operation, as the kernel sends it (named after fuser's method).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[allow(missing_docs)]
        pub enum FuseOp {
            $($variant),*
        }

        impl FuseOp {
            /// Every operation, in the order of their slots in [`FuseMetrics`].
            pub const ALL: &'static [FuseOp] = &[$(FuseOp::$variant),*];

            /// The operation's name: the `op` label of its metrics.
            pub fn name(self) -> &'static str {
                match self {
                    $(FuseOp::$variant => $name),*
                }
            }
        }
    };
}

fuse_ops! {
    Lookup => "lookup", Getattr => "getattr", Setattr => "setattr", Readlink => "readlink",
    Mknod => "mknod", Mkdir => "mkdir", Unlink => "unlink", Rmdir => "rmdir",
    Symlink => "symlink", Rename => "rename", Link => "link", Open => "open", Read => "read",
    Write => "write", Fallocate => "fallocate", Flush => "flush", Getlk => "getlk",
    Setlk => "setlk", Release => "release", Fsync => "fsync", Opendir => "opendir",
    Readdir => "readdir", Readdirplus => "readdirplus", Fsyncdir => "fsyncdir",
    Ioctl => "ioctl", Lseek => "lseek", Poll => "poll", CopyFileRange => "copy_file_range",
    Statfs => "statfs", Setxattr => "setxattr", Getxattr => "getxattr",
    Listxattr => "listxattr", Removexattr => "removexattr", Access => "access",
    Create => "create",
}

/// The `op` label of a FUSE operation's metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

/// The labels of a failed request: its operation and the errno it was answered with.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    op: &'static str,
    errno: String,
}

/// Histogram buckets of request latencies in seconds: 1 µs to about 8 s, doubling.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(1e-6, 2.0, 24)
}

fn latency_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

/// One operation's count and latency, made on its first request (so that only operations
/// that happened are exported).
struct OpSlot {
    requests: Counter,
    latency: Histogram,
}

struct FuseInner {
    requests: Family<OpLabels, Counter>,
    latency: Family<OpLabels, Histogram, fn() -> Histogram>,
    errors: Family<ErrorLabels, Counter>,
    read_bytes: Counter,
    written_bytes: Counter,
    slots: Vec<OnceLock<OpSlot>>,
}

/// The FUSE adapter's metrics (see the module docs). A cheap handle: clones share the same
/// counters.
#[derive(Clone)]
pub struct FuseMetrics {
    inner: Arc<FuseInner>,
}

impl Default for FuseMetrics {
    fn default() -> Self {
        FuseMetrics::new()
    }
}

impl std::fmt::Debug for FuseMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseMetrics").finish_non_exhaustive()
    }
}

/// Two handles are equal when they share their counters.
impl PartialEq for FuseMetrics {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for FuseMetrics {}

impl FuseMetrics {
    /// Metrics with every count at zero, registered nowhere yet ([`FuseMetrics::register`]).
    pub fn new() -> Self {
        FuseMetrics {
            inner: Arc::new(FuseInner {
                requests: Family::default(),
                latency: Family::new_with_constructor(latency_histogram),
                errors: Family::default(),
                read_bytes: Counter::default(),
                written_bytes: Counter::default(),
                slots: FuseOp::ALL.iter().map(|_| OnceLock::new()).collect(),
            }),
        }
    }

    /// Registers the metrics in `registry` (names below its prefix, `citronfs_` for the
    /// roles): `fuse_requests_total{op}`, `fuse_request_duration_seconds{op}`,
    /// `fuse_request_errors_total{op,errno}`, `fuse_read_bytes_total`,
    /// `fuse_written_bytes_total`.
    pub fn register(&self, registry: &mut Registry) {
        let i = &self.inner;
        registry.register(
            "fuse_requests",
            "FUSE requests answered, by operation",
            i.requests.clone(),
        );
        registry.register(
            "fuse_request_duration_seconds",
            "Time from a FUSE request's arrival to its answer, by operation",
            i.latency.clone(),
        );
        registry.register(
            "fuse_request_errors",
            "FUSE requests answered with an error, by operation and errno",
            i.errors.clone(),
        );
        registry.register(
            "fuse_read_bytes",
            "Bytes answered to FUSE reads",
            i.read_bytes.clone(),
        );
        registry.register(
            "fuse_written_bytes",
            "Bytes written by FUSE writes",
            i.written_bytes.clone(),
        );
    }

    fn slot(&self, op: FuseOp) -> &OpSlot {
        self.inner.slots[op as usize].get_or_init(|| {
            let labels = OpLabels { op: op.name() };
            OpSlot {
                requests: self.inner.requests.get_or_create(&labels).clone(),
                latency: self.inner.latency.get_or_create(&labels).clone(),
            }
        })
    }

    /// Counts one request of `op` that took `seconds`, answered with `errno` (0: success).
    pub fn record(&self, op: FuseOp, seconds: f64, errno: i32) {
        let slot = self.slot(op);
        slot.requests.inc();
        slot.latency.observe(seconds);
        if errno != 0 {
            self.inner
                .errors
                .get_or_create(&ErrorLabels {
                    op: op.name(),
                    errno: proto::error::errno_name(errno),
                })
                .inc();
        }
    }

    /// Counts `bytes` answered to a read.
    pub fn read_bytes(&self, bytes: usize) {
        self.inner.read_bytes.inc_by(bytes as u64);
    }

    /// Counts `bytes` written.
    pub fn written_bytes(&self, bytes: usize) {
        self.inner.written_bytes.inc_by(bytes as u64);
    }

    /// Starts timing one request of `op`; it is counted when the timer is dropped
    /// ([`OpTimer::fail`] sets the errno it was answered with).
    pub fn start(&self, op: FuseOp) -> OpTimer<'_> {
        OpTimer {
            metrics: self,
            op,
            at: Instant::now(),
            errno: 0,
        }
    }
}

/// One request in progress ([`FuseMetrics::start`]), counted on drop.
pub struct OpTimer<'m> {
    metrics: &'m FuseMetrics,
    op: FuseOp,
    at: Instant,
    errno: i32,
}

impl OpTimer<'_> {
    /// Records that the request was answered with `errno`.
    pub fn fail(&mut self, errno: i32) {
        self.errno = errno;
    }
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        self.metrics
            .record(self.op, self.at.elapsed().as_secs_f64(), self.errno);
    }
}

/// Registers the library's own counters of `fs` in `registry`, read at each scrape from
/// [`CitronFs::io_stats`] and [`CitronFs::lock_stats`] (nothing once `fs` is dropped):
/// `client_locked_ios_total`, `client_round_trips_total`, `client_lock_round_trips_total`,
/// `client_locked_seconds_total`, `client_lock_acquires_total`, `client_lock_releases_total`,
/// `client_lock_aborts_total{reason}`, `client_lock_retries_total`,
/// `client_lock_recoveries_total`, `client_lock_acquire_round_trips_total`.
pub fn register_client(registry: &mut Registry, fs: &Arc<CitronFs>) {
    registry.register_collector(Box::new(ClientCollector {
        fs: Arc::downgrade(fs),
    }));
}

/// Reads a client's counters at scrape time ([`register_client`]).
struct ClientCollector {
    fs: Weak<CitronFs>,
}

impl std::fmt::Debug for ClientCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCollector").finish_non_exhaustive()
    }
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(value);
    c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)
}

impl Collector for ClientCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(fs) = self.fs.upgrade() else {
            return Ok(());
        };
        let io = fs.io_stats();
        let lock = fs.lock_stats();
        let e = &mut encoder;
        counter(
            e,
            "client_locked_ios",
            "Locked I/Os done (reads, writes, fallocate steps, truncates), each under one range lock.",
            io.locked_ios,
        )?;
        counter(
            e,
            "client_round_trips",
            "Fabric round trips of the locked I/Os (lock, meta region, data servers).",
            io.round_trips,
        )?;
        counter(
            e,
            "client_lock_round_trips",
            "Fabric round trips spent acquiring and releasing range locks.",
            io.lock_round_trips,
        )?;
        let secs = ConstCounter::new(io.locked_nanos as f64 / 1e9);
        secs.encode(e.encode_descriptor(
            "client_locked_seconds",
            "Seconds of the locked I/Os, each from its acquire to its release.",
            None,
            secs.metric_type(),
        )?)?;
        counter(
            e,
            "client_lock_acquires",
            "Range locks acquired.",
            lock.acquisitions,
        )?;
        counter(
            e,
            "client_lock_releases",
            "Range locks released.",
            lock.releases,
        )?;
        counter(
            e,
            "client_lock_retries",
            "Range-lock acquire attempts retried after an abort.",
            lock.retries,
        )?;
        counter(
            e,
            "client_lock_recoveries",
            "Range-lock trees recovered after a holder failed.",
            lock.recoveries,
        )?;
        counter(
            e,
            "client_lock_acquire_round_trips",
            "Fabric round trips of range-lock acquires (divide by acquires for round trips per acquire).",
            lock.acquire.round_trips,
        )?;
        let a = &lock.aborts;
        let aborts = ConstCounter::new(0u64);
        let mut d = e.encode_descriptor(
            "client_lock_aborts",
            "Range-lock acquire attempts aborted, by reason.",
            None,
            aborts.metric_type(),
        )?;
        for (reason, n) in [
            ("time_limit", a.time_limit),
            ("scale_up", a.scale_up),
            ("leaf_conflict", a.leaf_conflict),
            ("suspected_failure", a.suspected_failure),
            ("restart", a.restart),
            ("occupied_ancestor", a.occupied_ancestor),
        ] {
            ConstCounter::new(n).encode(d.encode_family(&[("reason", reason)])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_operations_that_happened_are_exported_and_errors_are_named() {
        let m = FuseMetrics::new();
        let mut registry = Registry::with_prefix("citronfs");
        m.register(&mut registry);
        {
            let mut t = m.start(FuseOp::Lookup);
            t.fail(libc::ENOENT);
        }
        drop(m.start(FuseOp::Write));
        m.written_bytes(4096);
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("citronfs_fuse_requests_total{op=\"lookup\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("citronfs_fuse_request_errors_total{op=\"lookup\",errno=\"ENOENT\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("citronfs_fuse_written_bytes_total 4096\n"),
            "{text}"
        );
        assert!(!text.contains("op=\"read\""), "{text}");
        assert!(
            text.contains("citronfs_fuse_request_duration_seconds_count{op=\"write\"} 1\n"),
            "{text}"
        );
    }

    #[test]
    fn every_operation_has_its_slot() {
        for (i, op) in FuseOp::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i, "{}", op.name());
        }
        assert_eq!(proto::error::errno_name(libc::EIO), "EIO");
        assert_eq!(proto::error::errno_name(4095), "4095");
    }
}
