//! Prometheus metrics of the meta server, registered into a registry its caller owns
//! ([`crate::MetaHandle::register_metrics`]); nothing here is global.
//!
//! - [`RequestMetrics`]: per request kind, the requests handled, their latency and the errors
//!   answered, counted where every request is handled (`Service::handle_by`): a relaxed
//!   increment and a histogram observe per request, once registered; nothing before.
//! - The state collector: sessions, open files, data servers live and down, capacity and free
//!   bytes, inodes, fenced sessions and requests handled — read from the service's state at
//!   each scrape (the same facts `citronfs status` shows), never kept on the hot path.

use crate::service::Service;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use proto::rpc::RequestKind;
use std::sync::{OnceLock, Weak};

/// The `kind` label of a request metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// The labels of a failed request: its kind and the errno its error maps to.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    kind: &'static str,
    errno: String,
}

fn latency_histogram() -> Histogram {
    // 1 µs to about 8 s, doubling.
    Histogram::new(exponential_buckets(1e-6, 2.0, 24))
}

/// One request kind's count and latency, made on its first request.
struct KindSlot {
    requests: Counter,
    latency: Histogram,
}

/// The meta server's per request kind metrics (see the module docs).
pub(crate) struct RequestMetrics {
    requests: Family<KindLabels, Counter>,
    latency: Family<KindLabels, Histogram, fn() -> Histogram>,
    errors: Family<ErrorLabels, Counter>,
    slots: Vec<OnceLock<KindSlot>>,
}

impl RequestMetrics {
    /// New metrics, registered in `registry`.
    pub(crate) fn register(registry: &mut Registry) -> RequestMetrics {
        let m = RequestMetrics {
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            errors: Family::default(),
            slots: RequestKind::ALL.iter().map(|_| OnceLock::new()).collect(),
        };
        registry.register(
            "meta_requests",
            "Client requests (RPCs) handled by the meta server, by kind",
            m.requests.clone(),
        );
        registry.register(
            "meta_request_duration_seconds",
            "Time the meta server took to handle a request, by kind",
            m.latency.clone(),
        );
        registry.register(
            "meta_request_errors",
            "Requests the meta server answered with an error, by kind and errno",
            m.errors.clone(),
        );
        m
    }

    /// Counts one request of kind `kind` that took `seconds`, failed with `errno` if any.
    pub(crate) fn record(&self, kind: RequestKind, seconds: f64, errno: Option<i32>) {
        let slot = self.slots[kind.index()].get_or_init(|| {
            let labels = KindLabels { kind: kind.name() };
            KindSlot {
                requests: self.requests.get_or_create(&labels).clone(),
                latency: self.latency.get_or_create(&labels).clone(),
            }
        });
        slot.requests.inc();
        slot.latency.observe(seconds);
        if let Some(errno) = errno {
            self.errors
                .get_or_create(&ErrorLabels {
                    kind: kind.name(),
                    errno: proto::error::errno_name(errno),
                })
                .inc();
        }
    }
}

/// Reads the service's state at each scrape (see the module docs).
pub(crate) struct StateCollector {
    pub(crate) service: Weak<Service>,
}

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateCollector").finish_non_exhaustive()
    }
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

fn bytes(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(service) = self.service.upgrade() else {
            return Ok(());
        };
        let status = match service.status_now() {
            Ok(status) => status,
            Err(error) => {
                tracing::warn!(%error, "metrics: cannot read the meta server's state");
                return Ok(());
            }
        };
        let e = &mut encoder;
        gauge(
            e,
            "meta_sessions",
            "Client sessions open.",
            status.sessions.len() as i64,
        )?;
        gauge(
            e,
            "meta_open_files",
            "Files open in at least one session.",
            bytes(status.open_file_count),
        )?;
        let live = status.data_servers.iter().filter(|d| d.live).count() as i64;
        let servers = status.data_servers.len() as i64;
        let g = ConstGauge::new(0i64);
        let mut d = e.encode_descriptor(
            "meta_data_servers",
            "Registered data servers, by whether they are connected (live) or not (down).",
            None,
            g.metric_type(),
        )?;
        ConstGauge::new(live).encode(d.encode_family(&[("state", "live")])?)?;
        ConstGauge::new(servers - live).encode(d.encode_family(&[("state", "down")])?)?;
        let capacity: u64 = status.data_servers.iter().map(|d| d.capacity_bytes).sum();
        let free: u64 = status.data_servers.iter().map(|d| d.free_bytes).sum();
        gauge(
            e,
            "meta_capacity_bytes",
            "Bytes of file data the registered data servers hold in all.",
            bytes(capacity),
        )?;
        gauge(
            e,
            "meta_free_bytes",
            "Bytes of the data servers' capacity free for new chunks.",
            bytes(free),
        )?;
        gauge(
            e,
            "meta_used_bytes",
            "Bytes of the data servers' capacity in use.",
            bytes(capacity.saturating_sub(free)),
        )?;
        gauge(
            e,
            "meta_inodes",
            "Inodes in the namespace.",
            bytes(status.meta.inodes),
        )?;
        gauge(
            e,
            "meta_fenced_sessions",
            "Sessions fenced (their range locks revoked after their lease ran out) and not yet forgotten.",
            bytes(status.fenced_sessions),
        )?;
        let r = &status.rereplication;
        gauge(
            e,
            "meta_rereplication_left_chunks",
            "Chunks the running re-replication pass has still to copy (0 when none runs).",
            bytes(r.left),
        )?;
        gauge(
            e,
            "meta_rereplication_failed_chunks",
            "Chunks the current or last re-replication pass could not copy (retried later).",
            bytes(r.failed),
        )?;
        let c = ConstCounter::new(r.total_done);
        c.encode(e.encode_descriptor(
            "meta_rereplicated_chunks",
            "Chunks re-replicated (given a new replica in place of a lost one) since start.",
            None,
            c.metric_type(),
        )?)?;
        let c = ConstCounter::new(status.meta.requests);
        c.encode(e.encode_descriptor(
            "meta_handled_requests",
            "Client requests handled since start, heartbeats excepted.",
            None,
            c.metric_type(),
        )?)?;
        Ok(())
    }
}
