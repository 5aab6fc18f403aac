//! The baseline lock schemes of seed 000 Table 1 that matter to a file system, behind the same
//! [`RangeLock`] trait as CITRON:
//!
//! - [`mutex`] (`"mutex"`): one DSLR-style ticket lock for everything;
//! - [`seg`] (`"seg"`): static segmentation, one ticket lock per fixed-size segment;
//! - [`server`] (`"server"`): a CPU lock server holding an interval set, over TCP.
//!
//! [`SchemeKind`] and [`SchemeInstance`] are the small factory the tests and the benchmark use
//! to create a scheme's shared state once and open one handle per thread, for these baselines
//! and for CITRON ([`crate::citron`], `"citron"` and `"citron-nofastpath"`).

pub mod mutex;
pub mod seg;
pub mod server;
pub mod ticket;

pub use mutex::{MutexLock, MutexScheme};
pub use seg::{SegConfig, SegLock, SegScheme};
pub use server::{LockServer, LockServerClient};
pub use ticket::{Backoff, TicketConfig, TicketLock};

use crate::citron::{
    layout, Citron, CitronClient, CitronConfig, ClientOptions, FabricBumpAllocator, NoAllocator,
    TreeAllocator,
};
use crate::scheme::{LockError, LockId, RangeLock};
use crate::stats::LockStats;
use fabric::{Connector, Endpoint, EndpointStats, RemoteAddr};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The `mutex` scheme's name.
pub const SCHEME_MUTEX: &str = "mutex";
/// The `seg` scheme's name.
pub const SCHEME_SEG: &str = "seg";
/// The `server` scheme's name.
pub const SCHEME_SERVER: &str = "server";
/// CITRON's name.
pub const SCHEME_CITRON: &str = "citron";
/// CITRON without the fast path of §3.8.
pub const SCHEME_CITRON_NOFASTPATH: &str = "citron-nofastpath";

/// Which scheme to create, with the parameters that shape its shared state.
///
/// Non-exhaustive: the CITRON variants join this list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemeKind {
    /// One ticket lock for the whole address space.
    Mutex,
    /// Static segmentation.
    Seg {
        /// Units per segment.
        segment_units: u64,
        /// Lock words; segments beyond wrap onto them.
        segments: u64,
    },
    /// A CPU lock server on TCP loopback (or wherever [`SchemeInstance::attach`] points).
    Server,
    /// CITRON (seed 000 §3), created with [`CitronConfig::default`] but for `unit_count`, and
    /// without a tree allocator: ranges beyond the tree take the spillover mutex, no scale-up.
    /// (The same as [`SchemeKind::CitronScaling`] with `max_unit_count = unit_count` and the
    /// default lease.)
    Citron {
        /// `N`, the units the tree covers.
        unit_count: u64,
        /// The fast path of §3.8.
        fast_path: bool,
    },
    /// CITRON whose tree scales up, with a chosen lease.
    ///
    /// With `max_unit_count > unit_count`, the lock's memory (see [`SchemeKind::region_bytes`])
    /// ends with a growth area and the cursor of a [`FabricBumpAllocator`] over it, so clients in
    /// any process scale the tree up (Alg. 4) as far as `max_unit_count`; otherwise there is no
    /// allocator and ranges beyond the tree stay on the spillover mutex.
    CitronScaling {
        /// `N`, the units the tree covers at first.
        unit_count: u64,
        /// The fast path of §3.8.
        fast_path: bool,
        /// How far scale-ups may grow the tree (no growth when `<= unit_count`).
        max_unit_count: u64,
        /// `T_lease` in milliseconds (§3.10), 0 for the default. A holder must release within it
        /// or be presumed dead, so it must exceed the longest critical section by far.
        lease_ms: u64,
        /// `T_wait` in microseconds (§3.5.5), 0 to derive it from the creator's measured round
        /// trip. Give it when clients see longer round trips than the creator measures (a loaded
        /// host, a slower path).
        t_wait_us: u64,
    },
}

/// A CITRON kind's parameters, both variants alike.
#[derive(Clone, Copy, Debug)]
struct CitronParams {
    unit_count: u64,
    fast_path: bool,
    max_unit_count: u64,
    lease_ms: u64,
    t_wait_us: u64,
}

impl SchemeKind {
    /// Whether this is CITRON (with or without the fast path, growing or not).
    pub fn is_citron(&self) -> bool {
        self.citron().is_some()
    }

    /// The parameters of a CITRON kind (`None` for the baselines).
    fn citron(&self) -> Option<CitronParams> {
        match *self {
            SchemeKind::Citron {
                unit_count,
                fast_path,
            } => Some(CitronParams {
                unit_count,
                fast_path,
                max_unit_count: unit_count,
                lease_ms: 0,
                t_wait_us: 0,
            }),
            SchemeKind::CitronScaling {
                unit_count,
                fast_path,
                max_unit_count,
                lease_ms,
                t_wait_us,
            } => Some(CitronParams {
                unit_count,
                fast_path,
                max_unit_count,
                lease_ms,
                t_wait_us,
            }),
            _ => None,
        }
    }

    /// The scheme's name, as [`RangeLock::scheme`] reports it.
    pub fn name(&self) -> &'static str {
        if let Some(c) = self.citron() {
            return if c.fast_path {
                SCHEME_CITRON
            } else {
                SCHEME_CITRON_NOFASTPATH
            };
        }
        match self {
            SchemeKind::Mutex => SCHEME_MUTEX,
            SchemeKind::Seg { .. } => SCHEME_SEG,
            SchemeKind::Server => SCHEME_SERVER,
            _ => SCHEME_CITRON,
        }
    }

    /// Bytes of registered memory the scheme needs at its base address (0: none).
    pub fn region_bytes(&self) -> u64 {
        match self {
            SchemeKind::Mutex => MutexScheme::REGION_BYTES,
            SchemeKind::Seg {
                segment_units,
                segments,
            } => {
                SegScheme::region_bytes(&seg_config(*segment_units, *segments, Default::default()))
            }
            SchemeKind::Server => 0,
            // An impossible size makes `create` fail with the real reason.
            SchemeKind::Citron { .. } | SchemeKind::CitronScaling { .. } => self
                .citron()
                .and_then(|c| citron_growth(c.unit_count, c.max_unit_count))
                .map_or(0, |g| g.area_offset + g.area_len),
        }
    }
}

/// The spec form: `mutex`, `seg:<segment_units>:<segments>`, `server`,
/// `citron:<units>[:<max_units>[:<lease_ms>[:<t_wait_us>]]]`, the same for `citron-nofastpath` (parsed back by
/// [`SchemeKind::from_str`](std::str::FromStr)), so a kind can cross a process boundary or a
/// command line.
impl std::fmt::Display for SchemeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SchemeKind::Seg {
                segment_units,
                segments,
            } => write!(f, "{SCHEME_SEG}:{segment_units}:{segments}"),
            SchemeKind::Citron { unit_count, .. } => write!(f, "{}:{unit_count}", self.name()),
            SchemeKind::CitronScaling {
                unit_count,
                max_unit_count,
                lease_ms,
                t_wait_us,
                ..
            } => write!(
                f,
                "{}:{unit_count}:{max_unit_count}:{lease_ms}:{t_wait_us}",
                self.name()
            ),
            other => f.write_str(other.name()),
        }
    }
}

impl std::str::FromStr for SchemeKind {
    type Err = LockError;

    fn from_str(spec: &str) -> Result<Self, LockError> {
        let mut parts = spec.split(':');
        let name = parts.next().unwrap_or_default();
        // The next field as a number, if there is one.
        let mut optional = |what: &str| -> Result<Option<u64>, LockError> {
            parts
                .next()
                .map(|field| {
                    field
                        .parse()
                        .map_err(|e| LockError::Config(format!("scheme {spec:?}: bad {what}: {e}")))
                })
                .transpose()
        };
        let mut number = |what: &str| -> Result<u64, LockError> {
            optional(what)?
                .ok_or_else(|| LockError::Config(format!("scheme {spec:?}: {what} missing")))
        };
        let kind = match name {
            SCHEME_MUTEX => SchemeKind::Mutex,
            SCHEME_SERVER => SchemeKind::Server,
            SCHEME_SEG => SchemeKind::Seg {
                segment_units: number("segment units")?,
                segments: number("segment count")?,
            },
            SCHEME_CITRON | SCHEME_CITRON_NOFASTPATH => {
                let unit_count = number("unit count")?;
                let fast_path = name == SCHEME_CITRON;
                match optional("max unit count")? {
                    None => SchemeKind::Citron {
                        unit_count,
                        fast_path,
                    },
                    Some(max_unit_count) => SchemeKind::CitronScaling {
                        unit_count,
                        fast_path,
                        max_unit_count,
                        lease_ms: optional("lease")?.unwrap_or(0),
                        t_wait_us: optional("T_wait")?.unwrap_or(0),
                    },
                }
            }
            _ => return Err(LockError::Config(format!("unknown lock scheme {spec:?}"))),
        };
        if parts.next().is_some() {
            return Err(LockError::Config(format!(
                "scheme {spec:?}: unexpected trailing fields"
            )));
        }
        Ok(kind)
    }
}

/// Where a [`SchemeKind::Citron`] lock keeps its growth room, as offsets from its base.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CitronGrowth {
    /// The [`FabricBumpAllocator`] cursor word.
    cursor_offset: u64,
    /// The zeroed area scale-ups allocate from.
    area_offset: u64,
    /// Its bytes (0: no growth).
    area_len: u64,
}

/// The growth room of a lock of `unit_count` units that may grow to `max_unit_count`: the nodes
/// every scale-up together can add, `tree_nodes(H_max) - tree_nodes(H_0)` words (each scale-up's
/// segment holds exactly the nodes it adds, and the tree never grows past `max_unit_count`).
fn citron_growth(unit_count: u64, max_unit_count: u64) -> Option<CitronGrowth> {
    let tree = Citron::bytes_needed(unit_count).ok()?;
    let h0 = layout::height_for(unit_count)?;
    // The tallest height within `max_unit_count` (what `scaleup::target_height` stops at).
    let h_max = (h0..=layout::MAX_HEIGHT)
        .take_while(|&h| h == h0 || layout::tree_units(h) <= max_unit_count)
        .last()?;
    let area_len = (layout::tree_nodes(h_max) - layout::tree_nodes(h0)) * 8;
    Some(CitronGrowth {
        cursor_offset: tree,
        area_offset: tree + 8,
        area_len,
    })
}

fn seg_config(segment_units: u64, segments: u64, ticket: TicketConfig) -> SegConfig {
    SegConfig {
        segment_units,
        segments,
        ticket,
    }
}

/// One created lock instance: the shared state every client opens handles on.
#[derive(Clone)]
#[non_exhaustive]
pub enum SchemeInstance {
    /// A `mutex` instance.
    Mutex(MutexScheme),
    /// A `seg` instance.
    Seg(SegScheme),
    /// A lock server's address, and the server itself when this process runs it.
    Server {
        /// Where clients connect.
        addr: SocketAddr,
        /// What they present in the handshake.
        credentials: fabric::Credentials,
        /// The in-process server, kept alive as long as any clone of the instance.
        server: Option<Arc<LockServer>>,
    },
    /// A CITRON lock: where it is and how its clients behave.
    Citron {
        /// The lock's base address (its config record).
        base: RemoteAddr,
        /// Client options (fast path or not).
        options: ClientOptions,
        /// Growth room for scale-ups: the allocator's cursor, the area and its bytes (`None`:
        /// no scale-ups).
        growth: Option<(RemoteAddr, RemoteAddr, u64)>,
    },
}

impl SchemeInstance {
    /// Creates a fresh instance of `kind`: initializes its words at `base` (through `endpoint`),
    /// or, for `server`, starts a [`LockServer`] on `127.0.0.1:0` in this process.
    pub fn create(
        kind: SchemeKind,
        endpoint: &mut dyn Endpoint,
        base: RemoteAddr,
        ticket: TicketConfig,
    ) -> Result<Self, LockError> {
        Ok(match kind {
            SchemeKind::Mutex => Self::Mutex(MutexScheme::create(endpoint, base, ticket)?),
            SchemeKind::Seg {
                segment_units,
                segments,
            } => Self::Seg(SegScheme::create(
                endpoint,
                base,
                seg_config(segment_units, segments, ticket),
            )?),
            SchemeKind::Server => {
                // An in-process server of its own: a fresh token, which only this instance's
                // clients (and processes it is handed to, `server_addr`) know.
                let token = fabric::handshake::random_token()
                    .map_err(|e| LockError::Server(format!("cannot make a token: {e}")))?;
                let credentials = fabric::Credentials::new("lockmgr", token);
                let server = LockServer::bind("127.0.0.1:0", credentials.clone())
                    .map_err(|e| LockError::Server(format!("cannot start lock server: {e}")))?;
                Self::Server {
                    addr: server.addr(),
                    credentials,
                    server: Some(Arc::new(server)),
                }
            }
            SchemeKind::Citron { .. } | SchemeKind::CitronScaling { .. } => {
                let CitronParams {
                    unit_count,
                    max_unit_count,
                    lease_ms,
                    t_wait_us,
                    ..
                } = kind
                    .citron()
                    .ok_or_else(|| LockError::Config("not citron".into()))?;
                let defaults = CitronConfig::default();
                Citron::create(
                    endpoint,
                    base,
                    CitronConfig {
                        unit_count,
                        max_unit_count: max_unit_count.max(unit_count),
                        t_lease: if lease_ms == 0 {
                            defaults.t_lease
                        } else {
                            Duration::from_millis(lease_ms)
                        },
                        t_wait: (t_wait_us > 0).then(|| Duration::from_micros(t_wait_us)),
                        ..defaults
                    },
                )?;
                let instance = Self::attach(kind, base, ticket, None)?;
                if let Self::Citron {
                    growth: Some((cursor, area, len)),
                    ..
                } = instance
                {
                    FabricBumpAllocator::format(endpoint, cursor, area, len)?;
                }
                instance
            }
        })
    }

    /// Describes an instance another process created: at `base` for the fabric schemes, at
    /// `server` (its address and the credentials it checks) for the lock server.
    pub fn attach(
        kind: SchemeKind,
        base: RemoteAddr,
        ticket: TicketConfig,
        server: Option<(SocketAddr, fabric::Credentials)>,
    ) -> Result<Self, LockError> {
        Ok(match kind {
            SchemeKind::Mutex => Self::Mutex(MutexScheme::attach(base, ticket)),
            SchemeKind::Seg {
                segment_units,
                segments,
            } => Self::Seg(SegScheme::attach(
                base,
                seg_config(segment_units, segments, ticket),
            )?),
            SchemeKind::Server => {
                let (addr, credentials) = server.ok_or_else(|| {
                    LockError::Config("server: the lock server's address is needed".into())
                })?;
                Self::Server {
                    addr,
                    credentials,
                    server: None,
                }
            }
            SchemeKind::Citron { .. } | SchemeKind::CitronScaling { .. } => {
                let CitronParams {
                    fast_path,
                    unit_count,
                    max_unit_count,
                    ..
                } = kind
                    .citron()
                    .ok_or_else(|| LockError::Config("not citron".into()))?;
                let growth = citron_growth(unit_count, max_unit_count)
                    .filter(|g| g.area_len > 0)
                    .map(|g| {
                        (
                            base.add(g.cursor_offset),
                            base.add(g.area_offset),
                            g.area_len,
                        )
                    });
                Self::Citron {
                    base,
                    options: ClientOptions {
                        fast_path,
                        auto_scale_up: growth.is_some(),
                        ..ClientOptions::default()
                    },
                    growth,
                }
            }
        })
    }

    /// The lock server's address and credentials, for the `server` scheme.
    pub fn server_addr(&self) -> Option<(SocketAddr, &fabric::Credentials)> {
        match self {
            Self::Server {
                addr, credentials, ..
            } => Some((*addr, credentials)),
            _ => None,
        }
    }

    /// Opens a handle for one thread; fabric schemes take an endpoint from `connector`.
    pub fn open(&self, connector: &dyn Connector) -> Result<Box<dyn RangeLock>, LockError> {
        Ok(match self {
            Self::Mutex(scheme) => Box::new(scheme.open(connector)?),
            Self::Seg(scheme) => Box::new(scheme.open(connector)?),
            Self::Server {
                addr, credentials, ..
            } => Box::new(LockServerClient::connect(addr, credentials)?),
            Self::Citron {
                base,
                options,
                growth,
            } => {
                // Each client allocates through its own endpoint: endpoints are per thread.
                let allocator: Arc<dyn TreeAllocator> = match growth {
                    Some((cursor, area, len)) => Arc::new(FabricBumpAllocator::new(
                        connector.connect()?,
                        *cursor,
                        *area,
                        *len,
                    )),
                    None => Arc::new(NoAllocator),
                };
                Box::new(CitronClient::open(
                    connector.connect()?,
                    *base,
                    allocator,
                    options.clone(),
                )?)
            }
        })
    }
}

/// Opens a handle for one thread on `instance` (see [`SchemeInstance::open`]).
pub fn open_scheme(
    instance: &SchemeInstance,
    connector: &dyn Connector,
) -> Result<Box<dyn RangeLock>, LockError> {
    instance.open(connector)
}

/// The bookkeeping every fabric-based baseline client shares: its endpoint, a random stream for
/// backoff, the locks it holds (`T`: what releasing needs) and its statistics.
pub(crate) struct ClientCore<T> {
    endpoint: Box<dyn Endpoint>,
    rng: SmallRng,
    /// Per held lock: what releasing needs, and its lease deadline (`None`: no lease).
    held: HashMap<u64, (T, Option<Instant>)>,
    next_id: u64,
    pub(crate) stats: LockStats,
}

impl<T> ClientCore<T> {
    pub(crate) fn new(endpoint: Box<dyn Endpoint>) -> Self {
        Self {
            endpoint,
            rng: SmallRng::from_rng(&mut rand::rng()),
            held: HashMap::new(),
            next_id: 1,
            stats: LockStats::default(),
        }
    }

    /// Runs one acquisition, accounting its time and traffic, and records what it holds and
    /// its lease deadline.
    pub(crate) fn acquire(
        &mut self,
        take: impl FnOnce(
            &mut dyn Endpoint,
            &mut SmallRng,
            &mut LockStats,
        ) -> Result<(T, Option<Instant>), LockError>,
    ) -> Result<LockId, LockError> {
        let started = Instant::now();
        let before = self.endpoint.stats();
        let result = take(&mut *self.endpoint, &mut self.rng, &mut self.stats);
        self.stats.acquire_time += started.elapsed();
        add_traffic(
            &mut self.stats.acquire,
            &self.endpoint.stats().since(&before),
        );
        let held = result?;
        let id = self.next_id;
        self.next_id += 1;
        self.held.insert(id, held);
        self.stats.acquisitions += 1;
        Ok(LockId(id))
    }

    /// The lease deadline of held lock `id`.
    pub(crate) fn deadline(&self, id: LockId) -> Option<Instant> {
        self.held.get(&id.0).and_then(|(_, d)| *d)
    }

    /// Runs one release of a lock this client holds, accounting its traffic. `give_back`
    /// returns whether every word was still ours; if not (or the lease deadline had passed) the
    /// release is counted as late: the conditional verbs left a successor's state alone.
    pub(crate) fn release(
        &mut self,
        id: LockId,
        give_back: impl FnOnce(&mut dyn Endpoint, T) -> Result<bool, LockError>,
    ) -> Result<(), LockError> {
        let (held, deadline) = self.held.remove(&id.0).ok_or(LockError::NotHeld(id))?;
        let late = deadline.is_some_and(|d| Instant::now() >= d);
        let before = self.endpoint.stats();
        let result = give_back(&mut *self.endpoint, held);
        add_traffic(
            &mut self.stats.release,
            &self.endpoint.stats().since(&before),
        );
        let ours = result?;
        if late || !ours {
            self.stats.late_releases += 1;
            tracing::warn!(
                ?id,
                broken = !ours,
                "ticket lock: release after the lease deadline; conditional verbs left the lock's new holder alone"
            );
        }
        self.stats.releases += 1;
        Ok(())
    }
}

fn add_traffic(into: &mut EndpointStats, delta: &EndpointStats) {
    into.round_trips += delta.round_trips;
    into.verbs += delta.verbs;
    into.atomics += delta.atomics;
    into.bytes_read += delta.bytes_read;
    into.bytes_written += delta.bytes_written;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn citron_spec_round_trip() {
        let kind = SchemeKind::CitronScaling {
            unit_count: 1024,
            fast_path: false,
            max_unit_count: 1 << 16,
            lease_ms: 60_000,
            t_wait_us: 150,
        };
        assert_eq!(kind.to_string(), "citron-nofastpath:1024:65536:60000:150");
        assert_eq!(kind.to_string().parse::<SchemeKind>().unwrap(), kind);
        // The short form: no growth, the default lease.
        let short = SchemeKind::Citron {
            unit_count: 4096,
            fast_path: true,
        };
        assert_eq!("citron:4096".parse::<SchemeKind>().unwrap(), short);
        assert_eq!(short.to_string(), "citron:4096");
        assert_eq!(short.name(), "citron");
        assert!("citron:1:x".parse::<SchemeKind>().is_err());
    }

    #[test]
    fn citron_growth_room() {
        // 1024 units (height 3) growing to 2^16 (height 6): the nodes of heights 4..=6.
        let g = citron_growth(1024, 1 << 16).unwrap();
        assert_eq!(g.cursor_offset, Citron::bytes_needed(1024).unwrap());
        assert_eq!(g.area_offset, g.cursor_offset + 8);
        assert_eq!(
            g.area_len,
            (layout::tree_nodes(6) - layout::tree_nodes(3)) * 8
        );
        // No growth asked: no room.
        assert_eq!(citron_growth(1024, 1024).unwrap().area_len, 0);
        // A limit between heights stops at the height below it.
        assert_eq!(
            citron_growth(1024, 5000).unwrap().area_len,
            (layout::tree_nodes(4) - layout::tree_nodes(3)) * 8
        );
    }
}
