//! Every lock scheme behind one description type, one way to create a lock's state and one way
//! to open it: the seam where the file system, the benchmarks and the tests meet the schemes.
//!
//! [`LockScheme`] names a scheme and the parameters that shape its shared state. It is what a
//! command line takes (`--scheme`, through [`FromStr`]), and what a configuration file and the
//! wire carry (its serde form is that same string, in every format). A parameter left open (a
//! plain name, or a 0 field) is the creator's to choose:
//!
//! - [`create`] lays out one lock's state in memory the creator provides ([`LockMemory`]),
//!   filling what the description leaves open from the creator's [`CreateOptions`], and returns
//!   a [`LockRef`]: the description with every parameter as created, and the base address;
//! - [`open`] opens one handle (one thread) on a [`LockRef`] through a fabric connector, with the
//!   choices each client makes for itself ([`OpenOptions`]).
//!
//! A [`LockRef`] crosses processes as it is (the meta server's open reply carries one), so a
//! client never derives a lock's layout on its own: it opens exactly what was created.
//!
//! # Placement
//!
//! A user with many lockable objects (a file system's files) asks the scheme where their locks
//! live ([`LockScheme::placement`]) instead of knowing it by name:
//!
//! - [`Placement::PerObject`]: one lock per object, its state in memory the creator provides
//!   ([`create`] per object, [`open`] per object and thread);
//! - [`Placement::Service`]: one lock space at a shared lock service ([`LockServer`], reached
//!   at a [`LockServerAt`]) for every object: a thread opens one handle on the service
//!   ([`open_service`]) and locks object `o`'s range at [`LockScheme::object_range`], a slice
//!   of [`OBJECT_UNITS`] units of its own, so that objects never conflict with each other.
//!
//! # What a user gives every scheme alike
//!
//! A user of many locks (the file system) names no scheme's own types: what it decides is in
//! terms every scheme takes and each uses as far as it has a use for it.
//!
//! - Creating: [`LockDefaults`] (the units a lock covers at first, the holders' lease, the
//!   wait measured by [`wait_under_load`], whether the creator hands out memory to grow into),
//!   turned into each scheme's defaults by [`CreateOptions::from_defaults`].
//! - Opening: [`OpenOptions`]' `fence` (called before any lease recovery breaks a hold),
//!   `owner` (who this client is to the others' recovery; a fence compares sessions by
//!   [`crate::holder_identity`]), `hosting` (acquire at the lock's host, [`Hosting`]) and
//!   `allocator` (memory a lock grows into, [`LockWordAllocator`]).
//! - Hosting: [`LockHost`], the procedures the server of the locks' memory offers so that
//!   clients acquire there (the schemes that can: CITRON).
//!
//! # Spec form
//!
//! ```text
//! citron[:<units>[:<max_units>[:<lease_ms>[:<t_wait_us>[:room|alloc]]]]]   CITRON (the paper's §3)
//! citron-nofastpath[:…]                                                    the same without §3.8
//! mutex                                                                    one ticket lock
//! seg[:<segment_units>[:<segments>]]                                       static segmentation
//! server                                                                   a CPU lock server
//! ```
//!
//! A field that is 0 or left out is the creator's choice; [`Display`](std::fmt::Display) leaves
//! out trailing ones, so that every value reads back as itself. The parameters are documented on
//! [`CitronSpec`] and [`SegSpec`].
//!
//! # Adding a scheme
//!
//! 1. Implement [`RangeLock`] for its client handle, next to the others (`baselines/`) or in a
//!    module of its own, together with its description type (if it has parameters), a
//!    `create_in(&mut dyn LockMemory)` that lays out its state, and whatever its `open` needs.
//! 2. Add a variant to [`LockScheme`] and its plain form to [`LockScheme::PLAIN`] (the name is
//!    then parsed and listed everywhere).
//! 3. Add its arm to each `match` in this module: [`LockScheme::name`], `Display`, `FromStr`,
//!    [`LockScheme::resolve`], [`LockScheme::region_bytes`], [`LockScheme::placement`],
//!    [`LockScheme::lease`], [`create`] and [`open`]; the compiler finds them. Defaults it
//!    needs from creators go into [`CreateOptions`] (derived from [`LockDefaults`] in
//!    [`CreateOptions::from_defaults`]), choices its clients make into [`OpenOptions`] (taking
//!    the every-scheme fields where set); acquisitions it can run at the lock's host offer
//!    their procedure in [`LockHost::procedures`], and a scheme that records its holders says
//!    what it keeps of an owner in [`crate::holder_identity`].
//! 4. The tests at the end of this module run every entry of [`LockScheme::PLAIN`] (round trips,
//!    create, open, lock); add a parameterised example to their list. The safety checker
//!    (`tests/safety.rs`) takes one more line in its `schemes!` list.

use crate::baselines::server;
pub use crate::baselines::server::{LockServer, LockServerAt};
use crate::baselines::{MutexScheme, SegScheme, SegSpec, TicketConfig};
use crate::citron::{CitronConfig, CitronDefaults, CitronGrowth, CitronSpec, ClientOptions};
use crate::fence::Fence;
pub use crate::hosting::{HostAllocate, HostFence, Hosting, LockHost};
use crate::scheme::{LockError, RangeLock};
use fabric::{Connector, Endpoint, EndpointExt, RegionId, RemoteAddr};
use serde::{de, Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::ops::Range;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// Where a scheme keeps the locks of many objects (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// One lock per object, its state in memory the creator provides.
    PerObject,
    /// One lock space at a shared lock service for every object, each object a slice of it
    /// ([`LockScheme::object_range`]).
    Service,
}

/// Units of one object's slice of a [`Placement::Service`] scheme's lock space: object `o`'s
/// unit `u` is `o × OBJECT_UNITS + u`, and a range reaching beyond the slice is cut at its end.
pub const OBJECT_UNITS: u64 = 1 << 40;

/// Objects a [`Placement::Service`] scheme's lock space holds (numbered from 0): `2^24`
/// slices of [`OBJECT_UNITS`] fill the 64-bit unit space.
pub const SERVICE_OBJECTS: u64 = 1 << 24;

/// A lock scheme and the parameters that shape its shared state (see the module docs for the
/// spec form it reads and writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LockScheme {
    /// CITRON (the paper's §3): a segment tree of lock words, with or without the fast path.
    Citron(CitronSpec),
    /// One ticket lock for the whole address space (an inode mutex).
    Mutex,
    /// Static segmentation: one ticket lock per fixed segment.
    Seg(SegSpec),
    /// A CPU lock server holding an interval set, over TCP.
    Server,
}

impl LockScheme {
    /// `citron`: CITRON with the fast path, every parameter the creator's.
    pub const CITRON: Self = Self::Citron(CitronSpec::plain(true));
    /// `citron-nofastpath`: CITRON without the fast path of §3.8.
    pub const CITRON_NOFASTPATH: Self = Self::Citron(CitronSpec::plain(false));
    /// `mutex`.
    pub const MUTEX: Self = Self::Mutex;
    /// `seg`, cut as the creator chooses.
    pub const SEG: Self = Self::Seg(SegSpec::PLAIN);
    /// `server`.
    pub const SERVER: Self = Self::Server;
    /// Every scheme by its plain name, in the order the benchmarks run them.
    pub const PLAIN: [Self; 5] = [
        Self::CITRON,
        Self::CITRON_NOFASTPATH,
        Self::MUTEX,
        Self::SEG,
        Self::SERVER,
    ];

    /// The modes the scheme grants ([`RangeLock::modes`] of its handles): CITRON and the lock
    /// server share readers; `mutex` and `seg` are exclusive only (a shared request is granted
    /// exclusively there).
    pub fn modes(&self) -> &'static [crate::LockMode] {
        match self {
            Self::Citron(_) | Self::Server => crate::scheme::EXCLUSIVE_AND_SHARED,
            Self::Mutex | Self::Seg(_) => crate::scheme::EXCLUSIVE_ONLY,
        }
    }

    /// The scheme's name, as [`RangeLock::scheme`] reports it and the spec form starts.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Citron(spec) => spec.name(),
            Self::Mutex => "mutex",
            Self::Seg(_) => "seg",
            Self::Server => "server",
        }
    }

    /// Whether this is CITRON (with or without the fast path).
    pub fn is_citron(&self) -> bool {
        matches!(self, Self::Citron(_))
    }

    /// The description with what it leaves open filled from `options`, as [`create`] would
    /// create it — except CITRON's `T_wait`, which `create` measures when it is still open.
    pub fn resolve(&self, options: &CreateOptions) -> Result<Self, LockError> {
        Ok(match self {
            Self::Citron(spec) => Self::Citron(spec.resolve(&options.citron)?),
            Self::Seg(spec) => Self::Seg(spec.resolve(&options.seg)),
            Self::Mutex | Self::Server => *self,
        })
    }

    /// Where this scheme keeps the locks of many objects (see the module docs).
    pub fn placement(&self) -> Placement {
        match self {
            Self::Citron(_) | Self::Mutex | Self::Seg(_) => Placement::PerObject,
            Self::Server => Placement::Service,
        }
    }

    /// Whether this scheme's locks live at a shared lock service ([`Placement::Service`]),
    /// which must then be running for them to be opened.
    pub fn uses_service(&self) -> bool {
        self.placement() == Placement::Service
    }

    /// Where units `range` of object `object` are locked: the range itself where each object
    /// has a lock of its own, else the object's slice of the service's lock space (see
    /// [`OBJECT_UNITS`]; an object numbered [`SERVICE_OBJECTS`] or beyond has none).
    pub fn object_range(&self, object: u64, range: Range<u64>) -> Result<Range<u64>, LockError> {
        match self.placement() {
            Placement::PerObject => Ok(range),
            Placement::Service => {
                if object >= SERVICE_OBJECTS {
                    return Err(LockError::Config(format!(
                        "object {object} is beyond the {} lock scheme's 2^24 objects",
                        self.name()
                    )));
                }
                // The last slice's end, 2^64, is cut to u64::MAX: its last unit is never
                // locked, and nothing else can be above it.
                let base = object * OBJECT_UNITS;
                let end = range.end.min(OBJECT_UNITS);
                Ok(base.saturating_add(range.start.min(end))..base.saturating_add(end))
            }
        }
    }

    /// The lease this description fixes for its locks' holders (a holder presumed dead after
    /// it can be broken); `None` where the scheme has no lease or leaves it to the creator.
    pub fn lease(&self) -> Option<Duration> {
        match self {
            Self::Citron(spec) if spec.lease_ms != 0 => Some(Duration::from_millis(spec.lease_ms)),
            Self::Citron(_) | Self::Mutex | Self::Seg(_) | Self::Server => None,
        }
    }

    /// Bytes of memory a lock of this (resolved) description takes from its base; 0 for a
    /// scheme that keeps nothing in remote memory.
    pub fn region_bytes(&self) -> Result<u64, LockError> {
        match self {
            Self::Citron(spec) => spec.region_bytes(),
            Self::Mutex => Ok(MutexScheme::REGION_BYTES),
            Self::Seg(spec) => spec.region_bytes(),
            Self::Server => Ok(0),
        }
    }
}

/// [`LockScheme::CITRON`], every parameter the creator's.
impl Default for LockScheme {
    fn default() -> Self {
        Self::CITRON
    }
}

impl fmt::Display for LockScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Citron(spec) => spec.write(f),
            Self::Seg(spec) => spec.write(f),
            Self::Mutex | Self::Server => f.write_str(self.name()),
        }
    }
}

impl FromStr for LockScheme {
    type Err = LockError;

    fn from_str(spec: &str) -> Result<Self, LockError> {
        let (name, rest) = match spec.split_once(':') {
            Some((name, rest)) => (name, Some(rest)),
            None => (spec, None),
        };
        let plain = Self::PLAIN
            .into_iter()
            .find(|plain| plain.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::PLAIN.iter().map(Self::name).collect();
                LockError::Config(format!(
                    "unknown lock scheme {spec:?} ({})",
                    names.join(", ")
                ))
            })?;
        let mut fields = Fields {
            spec,
            rest: rest.map(|rest| rest.split(':')),
        };
        let scheme = match plain {
            Self::Citron(plain) => Self::Citron(CitronSpec::parse(plain.fast_path, &mut fields)?),
            Self::Seg(_) => Self::Seg(SegSpec::parse(&mut fields)?),
            Self::Mutex | Self::Server => plain,
        };
        fields.end()?;
        Ok(scheme)
    }
}

/// The spec string, in every serde format: configuration files read `scheme = "seg:16:1024"`,
/// and the wire (postcard) carries the few bytes of the same text, with one grammar to keep.
impl Serialize for LockScheme {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for LockScheme {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Spec;
        impl de::Visitor<'_> for Spec {
            type Value = LockScheme;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a lock scheme such as \"citron\" or \"seg:16:1024\"")
            }
            fn visit_str<E: de::Error>(self, spec: &str) -> Result<LockScheme, E> {
                spec.parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_str(Spec)
    }
}

/// The `:`-separated fields after a scheme's name, read in order. A missing number is 0, the
/// creator's choice.
pub(crate) struct Fields<'a> {
    spec: &'a str,
    rest: Option<std::str::Split<'a, char>>,
}

impl<'a> Fields<'a> {
    /// The next field, if any.
    pub(crate) fn word(&mut self) -> Option<&'a str> {
        self.rest.as_mut()?.next()
    }

    /// The next field as a number; 0 when there is none.
    pub(crate) fn number(&mut self, what: &str) -> Result<u64, LockError> {
        match self.word() {
            None => Ok(0),
            Some(field) => field
                .parse()
                .map_err(|e| self.error(format!("bad {what} {field:?}: {e}"))),
        }
    }

    /// An error about this spec.
    pub(crate) fn error(&self, why: String) -> LockError {
        LockError::Config(format!("lock scheme {:?}: {why}", self.spec))
    }

    fn end(mut self) -> Result<(), LockError> {
        match self.word() {
            None => Ok(()),
            Some(field) => Err(self.error(format!("unexpected field {field:?}"))),
        }
    }
}

/// Writes `name`, then `numbers` up to the last one that is not 0 (all of them when `word`
/// follows), then `word`: the shortest spec that reads back as the same value.
pub(crate) fn write_spec(
    f: &mut fmt::Formatter<'_>,
    name: &str,
    numbers: &[u64],
    word: Option<&str>,
) -> fmt::Result {
    f.write_str(name)?;
    let shown = match word {
        Some(_) => numbers.len(),
        None => numbers.iter().rposition(|&n| n != 0).map_or(0, |i| i + 1),
    };
    for n in &numbers[..shown] {
        write!(f, ":{n}")?;
    }
    if let Some(word) = word {
        write!(f, ":{word}")?;
    }
    Ok(())
}

/// A created lock as its clients find it: the description with every parameter as created,
/// and where its state begins. All [`open`] needs besides a connector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LockRef {
    /// What was created.
    pub scheme: LockScheme,
    /// The base address of its state ([`NO_STATE`] for a scheme that keeps none in remote
    /// memory, `server`).
    pub base: RemoteAddr,
}

/// The base address of a lock that keeps no state in remote memory; never read.
pub const NO_STATE: RemoteAddr = RemoteAddr::new(RegionId(0), 0);

/// Memory a creator provides for a lock's state.
pub trait LockMemory {
    /// The endpoint [`create`] initialises the state through.
    fn endpoint(&mut self) -> &mut dyn Endpoint;

    /// `bytes` bytes (8-byte aligned) for the state; [`LockError::NoSpace`] when they do not
    /// fit. [`create`] asks once per lock, and not at all for a scheme without such state.
    fn allocate(&mut self, bytes: u64) -> Result<RemoteAddr, LockError>;
}

/// Memory a lock's state grows into after it was created (CITRON's scale-ups, Alg. 4 l. 3, one
/// call each): zeroed words reachable through the same endpoint as the rest of the lock. The
/// file system's clients bring one that asks the meta server (its `AllocateLockWords` RPC).
pub trait LockWordAllocator: Send + Sync {
    /// Allocates `words` zeroed, 8-byte aligned words and returns the first one's address.
    fn allocate(&self, words: u64) -> Result<RemoteAddr, LockError>;

    /// What the lock's host needs to allocate as this allocator does, for a client that
    /// acquires at the host ([`Hosting`], whose growth then runs there): a tag the host's own
    /// allocator understands ([`LockHost::allocating`]; the file system's is the inode).
    /// `None`, the default: the host cannot, and a lock that grows from an allocator is
    /// acquired on the client.
    fn host_tag(&self) -> Option<u64> {
        None
    }
}

/// One stretch of memory at a known address (a region registered for the lock): what tests and
/// benchmarks create a lock in. Hands out its stretch once.
pub struct FixedMemory<'a> {
    endpoint: &'a mut dyn Endpoint,
    base: RemoteAddr,
    len: u64,
    taken: bool,
}

impl<'a> FixedMemory<'a> {
    /// `len` bytes from `base` (8-byte aligned), initialised through `endpoint`.
    pub fn new(endpoint: &'a mut dyn Endpoint, base: RemoteAddr, len: u64) -> Self {
        Self {
            endpoint,
            base,
            len,
            taken: false,
        }
    }
}

impl LockMemory for FixedMemory<'_> {
    fn endpoint(&mut self) -> &mut dyn Endpoint {
        &mut *self.endpoint
    }

    fn allocate(&mut self, bytes: u64) -> Result<RemoteAddr, LockError> {
        if self.taken || bytes > self.len {
            return Err(LockError::NoSpace { bytes });
        }
        self.taken = true;
        Ok(self.base)
    }
}

/// What a creator decides: the parameters a description leaves open, and where `server` locks
/// live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateOptions {
    /// CITRON's open parameters.
    pub citron: CitronDefaults,
    /// `seg`'s cut, field by field where the description has 0.
    pub seg: SegSpec,
    /// The lock server that holds `server` locks (the meta server runs one); `None`: [`create`]
    /// starts one on loopback in this process.
    pub lock_server: Option<LockServerAt>,
}

/// [`CitronDefaults::default`], [`SegSpec::DEFAULT`], a lock server started by [`create`].
impl Default for CreateOptions {
    fn default() -> Self {
        Self {
            citron: CitronDefaults::default(),
            seg: SegSpec::DEFAULT,
            lock_server: None,
        }
    }
}

/// What a creator of many locks decides for all of them, in terms every scheme understands;
/// [`CreateOptions::from_defaults`] turns it into each scheme's defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockDefaults {
    /// Units a lock covers at first (a scheme whose state is sized by them, CITRON's tree;
    /// beyond them it grows or takes a coarser lock).
    pub units: u64,
    /// How long a holder has to release before the others may presume it dead (schemes with
    /// a lease: CITRON's `T_lease`).
    pub lease: Duration,
    /// The wait that schemes which need one (CITRON's `T_wait`, §3.5.5) give a conflicting
    /// acquisition, as [`wait_under_load`] measured it where clients reach the locks.
    pub wait: Duration,
    /// Whether the creator hands out memory for locks to grow into, through the
    /// [`LockWordAllocator`] its clients bring ([`OpenOptions::allocator`]); `false`: a lock
    /// grows only into room set aside when it was created.
    pub allocates_growth: bool,
    /// The lock server that holds the locks of a scheme that keeps them at a lock service
    /// ([`CreateOptions::lock_server`]).
    pub lock_server: Option<LockServerAt>,
}

impl CreateOptions {
    /// Each scheme's defaults from what the creator decided for all: CITRON covers
    /// `defaults.units` at first with its lease and `T_wait`, and grows from the creator's
    /// allocator as far as [`CitronConfig::default`] allows (no growth without one); `seg` is
    /// cut as [`SegSpec::DEFAULT`]; a scheme at a lock service uses `defaults.lock_server`.
    pub fn from_defaults(defaults: &LockDefaults) -> Self {
        let (growth, max_unit_count) = match defaults.allocates_growth {
            true => (
                CitronGrowth::Allocator,
                CitronConfig::default().max_unit_count,
            ),
            false => (CitronGrowth::Room, 0),
        };
        Self {
            citron: CitronDefaults {
                unit_count: defaults.units,
                max_unit_count,
                growth,
                lease_ms: crate::citron::scheme::duration_ms(defaults.lease),
                t_wait_us: crate::citron::scheme::duration_us(defaults.wait),
            },
            seg: SegSpec::DEFAULT,
            lock_server: defaults.lock_server.clone(),
        }
    }
}

/// The wait a creator gives its locks ([`LockDefaults::wait`]) for clients that reach them
/// through `connector`, derived by the schemes that need one (CITRON's `T_wait`) from the
/// fabric's round trip under load (reading the word at `addr`); with that round trip's profile.
pub fn wait_under_load(
    connector: &dyn Connector,
    addr: RemoteAddr,
) -> Result<(Duration, fabric::RttProfile), LockError> {
    // Locks made from [`LockDefaults`] grow as far as the default configuration allows, so
    // the round trips of their tallest tree are the default's.
    crate::citron::t_wait_under_load(connector, addr, &crate::citron::CitronConfig::default())
}

/// What [`create`] made.
#[derive(Clone)]
pub struct Created {
    /// The lock, as clients open it.
    pub lock: LockRef,
    /// Bytes taken from the [`LockMemory`] at `lock.base` (0: none).
    pub bytes: u64,
    /// `server`: where the lock server listens, and its credentials.
    pub server: Option<LockServerAt>,
    /// A lock server [`create`] started, kept running as long as any clone of this.
    _started: Option<Arc<LockServer>>,
}

impl Created {
    /// [`OpenOptions::default`] with the lock server's address: what a client of this process
    /// opens the lock with.
    pub fn open_options(&self) -> OpenOptions {
        OpenOptions {
            server: self.server.clone(),
            ..OpenOptions::default()
        }
    }
}

/// What each client chooses for itself when it opens a lock; none of it changes the lock's
/// state, which the [`LockRef`] describes.
///
/// The first fields are every scheme's (see the module docs): a scheme uses what it has a use
/// for, and where one is set it takes the place of the same choice in the scheme's own options
/// below (`citron`, `ticket`).
#[derive(Clone, Default)]
pub struct OpenOptions {
    /// Called right before this client breaks another client's hold (any lease recovery);
    /// see [`Fence`]. `None`: the scheme options' own (none by default).
    pub fence: Option<Arc<dyn Fence>>,
    /// Who this client is to the others' lease recovery, recorded with what it holds by the
    /// schemes that record holders (CITRON), so that a waiter can ask its fence
    /// ([`Fence::holder_gone`], by [`crate::holder_identity`]) instead of waiting out the lease.
    /// The file system gives its meta session. `None`: the scheme options' own (none by
    /// default: a waiter waits out the lease).
    pub owner: Option<u64>,
    /// Where acquisitions run ([`Hosting`]); `None`: the scheme options' own
    /// ([`Hosting::Auto`] by default).
    pub hosting: Option<Hosting>,
    /// Where a lock created to grow from its creator's allocator ([`LockDefaults::allocates_growth`])
    /// gets memory (CITRON's scale-ups, Alg. 4 l. 3; the file system's `AllocateLockWords` RPC).
    pub allocator: Option<Arc<dyn LockWordAllocator>>,
    /// CITRON: the client's own options (`k`, backoff, ...). The fast path is the
    /// description's; scale-ups happen only where the lock has somewhere to grow.
    pub citron: ClientOptions,
    /// `mutex` and `seg`: the ticket locks' client behaviour.
    pub ticket: TicketConfig,
    /// `server`: where the lock server listens, and its credentials.
    pub server: Option<LockServerAt>,
}

impl OpenOptions {
    /// CITRON's client options: [`OpenOptions::citron`] with every scheme's fields that are set.
    fn citron_options(&self) -> ClientOptions {
        let own = &self.citron;
        ClientOptions {
            fence: self.fence.clone().or_else(|| own.fence.clone()),
            owner: self.owner.or(own.owner),
            hosting: self.hosting.unwrap_or(own.hosting),
            ..own.clone()
        }
    }

    /// The ticket locks' client behaviour: [`OpenOptions::ticket`] with the fence, if set.
    fn ticket_config(&self) -> TicketConfig {
        TicketConfig {
            fence: self.fence.clone().or_else(|| self.ticket.fence.clone()),
            ..self.ticket.clone()
        }
    }
}

/// Creates one lock of `scheme` in `memory`, with what `scheme` leaves open decided by
/// `options` ([`LockScheme::resolve`]). Only while no client uses the memory. The returned
/// [`Created::lock`] has every parameter as created; hand it to the clients.
pub fn create(
    scheme: &LockScheme,
    options: &CreateOptions,
    memory: &mut dyn LockMemory,
) -> Result<Created, LockError> {
    let resolved = scheme.resolve(options)?;
    let mut created = Created {
        lock: LockRef {
            scheme: resolved,
            base: NO_STATE,
        },
        bytes: 0,
        server: None,
        _started: None,
    };
    match resolved {
        LockScheme::Citron(spec) => {
            let (spec, base, bytes) = spec.create_in(memory)?;
            created.lock = LockRef {
                scheme: LockScheme::Citron(spec),
                base,
            };
            created.bytes = bytes;
        }
        LockScheme::Mutex => {
            (created.lock.base, created.bytes) = MutexScheme::create_in(memory)?;
        }
        LockScheme::Seg(spec) => {
            (created.lock.base, created.bytes) = spec.create_in(memory)?;
        }
        LockScheme::Server => {
            let (at, started) = server::create_state(options.lock_server.as_ref())?;
            created.server = Some(at);
            created._started = started;
        }
    }
    Ok(created)
}

/// Opens one handle (for one thread) on `lock`; fabric schemes take their endpoints from
/// `connector`.
pub fn open(
    lock: &LockRef,
    connector: &dyn Connector,
    options: &OpenOptions,
) -> Result<Box<dyn RangeLock>, LockError> {
    Ok(match lock.scheme {
        LockScheme::Citron(spec) => Box::new(spec.open(
            lock.base,
            connector,
            &options.citron_options(),
            options.allocator.as_ref(),
        )?),
        LockScheme::Mutex => {
            Box::new(MutexScheme::attach(lock.base, options.ticket_config()).open(connector)?)
        }
        LockScheme::Seg(spec) => Box::new(
            SegScheme::attach(lock.base, spec.config(options.ticket_config()))?.open(connector)?,
        ),
        LockScheme::Server => Box::new(server::open_handle(options.server.as_ref())?),
    })
}

/// Opens one handle (for one thread) on the shared lock service of `scheme`, a
/// [`Placement::Service`] scheme, with every object's lock in it ([`LockScheme::object_range`]);
/// `options` say where the service is. A [`Placement::PerObject`] scheme has no service.
pub fn open_service(
    scheme: &LockScheme,
    connector: &dyn Connector,
    options: &OpenOptions,
) -> Result<Box<dyn RangeLock>, LockError> {
    if !scheme.uses_service() {
        return Err(LockError::Config(format!(
            "the {scheme} lock scheme has a lock per object, not a lock service"
        )));
    }
    let lock = LockRef {
        scheme: *scheme,
        base: NO_STATE,
    };
    open(&lock, connector, options)
}

/// A lock word that is not at rest (see [`inspect`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BusyWord {
    /// Which word: a CITRON node (`node(hgt, pos)`), the spillover mutex, a ticket lock.
    pub what: String,
    /// Its value.
    pub word: u64,
}

impl fmt::Display for BusyWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {:#018x}", self.what, self.word)
    }
}

/// Reads every word of `lock`'s state through `endpoint` and returns the words that are not at
/// rest: held (a leaf bit, `Occ`, a ticket being served that was never passed on) or with a
/// counter pair apart (`TCnt != TMax`, `DCnt != DMax`, a ticket lock's `next != serving`).
///
/// Meaningful only while no client holds or waits for the lock — then every word must be at
/// rest, and a busy one is a lock that a dead or broken client left behind (for `citronfs
/// fsck --at-rest` and the crash tests). `Ok(None)` for a scheme whose state is not in remote
/// memory (`server`).
pub fn inspect(
    lock: &LockRef,
    endpoint: Box<dyn Endpoint>,
) -> Result<Option<Vec<BusyWord>>, LockError> {
    use crate::baselines::ticket::{next_ticket, now_serving};
    let mut endpoint = endpoint;
    let ticket_busy = |word: u64| next_ticket(word) != now_serving(word);
    Ok(Some(match lock.scheme {
        LockScheme::Citron(_) => {
            let mut client = crate::citron::CitronClient::open(
                endpoint,
                lock.base,
                Arc::new(crate::citron::NoAllocator),
                ClientOptions::default(),
            )?;
            let audit = client.audit()?;
            let mut busy: Vec<BusyWord> = audit
                .busy_nodes
                .iter()
                .map(|(node, word)| BusyWord {
                    what: format!("node({}, {})", node.hgt, node.pos),
                    word: *word,
                })
                .collect();
            busy.extend(audit.busy_shares.iter().map(|(node, word)| BusyWord {
                what: format!("share({}, {})", node.hgt, node.pos),
                word: *word,
            }));
            if audit.spillover_busy {
                busy.push(BusyWord {
                    what: "spillover mutex".into(),
                    word: audit.spillover,
                });
            }
            busy
        }
        LockScheme::Mutex => {
            let word = endpoint.read_u64(lock.base)?;
            if ticket_busy(word) {
                vec![BusyWord {
                    what: "mutex".into(),
                    word,
                }]
            } else {
                Vec::new()
            }
        }
        LockScheme::Seg(spec) => {
            let mut busy = Vec::new();
            // Large reads, but within what any endpoint takes in one verb.
            const WORDS: u64 = 8192;
            let mut at = 0;
            while at < spec.segments {
                let n = (spec.segments - at).min(WORDS);
                let bytes = endpoint.read(lock.base.word(at), (n * 8) as usize)?;
                for (i, w) in bytes.chunks_exact(8).enumerate() {
                    let word = u64::from_le_bytes(w.try_into().expect("8 bytes"));
                    if ticket_busy(word) {
                        busy.push(BusyWord {
                            what: format!("segment lock {}", at + i as u64),
                            word,
                        });
                    }
                }
                at += n;
            }
            busy
        }
        LockScheme::Server => return Ok(None),
    }))
}

/// Puts every busy word of `lock`'s state (see [`inspect`]) back at rest, each with a CAS
/// that expects the word as inspected, and returns the words it reset (as they were);
/// `Ok(None)` for a scheme whose state is not in remote memory (`server`).
///
/// Only while no client holds, waits for or is acquiring the lock — what dead clients left
/// (`citronfs fsck --at-rest --repair`); a word that changes meanwhile fails the reset.
pub fn reset_to_rest(
    lock: &LockRef,
    endpoint: Box<dyn Endpoint>,
) -> Result<Option<Vec<BusyWord>>, LockError> {
    use crate::baselines::ticket::{next_ticket, now_serving};
    let mut endpoint = endpoint;
    // A ticket lock at rest serves its next ticket.
    let reset_ticket = |endpoint: &mut dyn Endpoint, addr: RemoteAddr, what: String| {
        let word = endpoint.read_u64(addr)?;
        if next_ticket(word) == now_serving(word) {
            return Ok::<_, LockError>(None);
        }
        let rest = (word & !0xFFFF_FFFF) | u64::from(next_ticket(word));
        if endpoint.cas(addr, word, rest)? != word {
            return Err(LockError::Config(format!(
                "{what} changed while being reset: the lock is in use"
            )));
        }
        Ok(Some(BusyWord { what, word }))
    };
    Ok(Some(match lock.scheme {
        LockScheme::Citron(_) => {
            let mut client = crate::citron::CitronClient::open(
                endpoint,
                lock.base,
                Arc::new(crate::citron::NoAllocator),
                ClientOptions::default(),
            )?;
            let spill = client.audit()?;
            let mut reset: Vec<BusyWord> = client
                .reset_to_rest()?
                .into_iter()
                .map(|(node, word)| BusyWord {
                    what: format!("node({}, {})", node.hgt, node.pos),
                    word,
                })
                .collect();
            if spill.spillover_busy {
                reset.push(BusyWord {
                    what: "spillover mutex".into(),
                    word: spill.spillover,
                });
            }
            reset
        }
        LockScheme::Mutex => reset_ticket(&mut *endpoint, lock.base, "mutex".into())?
            .into_iter()
            .collect(),
        LockScheme::Seg(spec) => {
            let mut reset = Vec::new();
            for i in 0..spec.segments {
                let what = format!("segment lock {i}");
                reset.extend(reset_ticket(&mut *endpoint, lock.base.word(i), what)?);
            }
            reset
        }
        LockScheme::Server => return Ok(None),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::citron::{BumpAllocator, CitronGrowth};
    use fabric::MemServer;

    /// Every plain scheme, and parameterised ones: each CITRON field and growth kind, both seg
    /// fields and one left open.
    fn examples() -> Vec<LockScheme> {
        let mut all = LockScheme::PLAIN.to_vec();
        all.extend([
            LockScheme::Citron(CitronSpec {
                unit_count: 1024,
                max_unit_count: 1 << 14,
                lease_ms: 60_000,
                ..CitronSpec::plain(true)
            }),
            LockScheme::Citron(CitronSpec {
                fast_path: false,
                unit_count: 256,
                max_unit_count: 4096,
                lease_ms: 1000,
                t_wait_us: 50,
                growth: Some(CitronGrowth::Room),
            }),
            LockScheme::Citron(CitronSpec {
                unit_count: 1024,
                max_unit_count: 1 << 20,
                growth: Some(CitronGrowth::Allocator),
                ..CitronSpec::plain(true)
            }),
            LockScheme::Seg(SegSpec {
                segment_units: 256,
                segments: 1024,
            }),
            LockScheme::Seg(SegSpec {
                segment_units: 4,
                segments: 0,
            }),
        ]);
        all
    }

    #[test]
    fn every_scheme_round_trips_as_text_and_on_the_wire() {
        for scheme in examples() {
            let text = scheme.to_string();
            assert_eq!(text.parse::<LockScheme>().unwrap(), scheme, "{text}");
            assert!(text.starts_with(scheme.name()), "{text}");
            let wire = postcard::to_stdvec(&scheme).unwrap();
            assert_eq!(
                postcard::from_bytes::<LockScheme>(&wire).unwrap(),
                scheme,
                "{text}"
            );
            let lock = LockRef {
                scheme,
                base: RemoteAddr::new(RegionId(3), 4096),
            };
            let wire = postcard::to_stdvec(&lock).unwrap();
            assert_eq!(postcard::from_bytes::<LockRef>(&wire).unwrap(), lock);
        }
        // Plain names are the plain schemes.
        for plain in LockScheme::PLAIN {
            assert_eq!(plain.name().parse::<LockScheme>().unwrap(), plain);
            assert_eq!(plain.to_string(), plain.name());
        }
        assert_eq!(
            "seg:16:1024".parse::<LockScheme>().unwrap().to_string(),
            "seg:16:1024"
        );
        for bad in [
            "",
            "rwlock",
            "mutex:1",
            "server:",
            "seg:x",
            "seg:1:2:3",
            "citron:",
        ] {
            assert!(bad.parse::<LockScheme>().is_err(), "{bad:?}");
        }
        // Text that is no scheme does not decode from the wire either.
        let wire = postcard::to_stdvec("seg:1:2:3").unwrap();
        assert!(postcard::from_bytes::<LockScheme>(&wire).is_err());
    }

    #[test]
    fn every_scheme_is_created_opened_and_locked_on_mem() {
        const LOCK: RegionId = RegionId(1);
        const GROWTH: RegionId = RegionId(2);
        for scheme in examples() {
            let options = CreateOptions::default();
            let bytes = scheme.resolve(&options).unwrap().region_bytes().unwrap();
            let fabric = MemServer::new();
            fabric.register(LOCK, bytes.max(8)).unwrap();
            fabric.register(GROWTH, 1 << 20).unwrap();
            let base = RemoteAddr::new(LOCK, 0);
            let created = create(
                &scheme,
                &options,
                &mut FixedMemory::new(&mut fabric.endpoint(), base, bytes),
            )
            .unwrap_or_else(|e| panic!("create {scheme}: {e}"));
            // Every parameter is as created: resolving again changes nothing, CITRON's T_wait
            // was measured.
            let lock = created.lock;
            assert_eq!(lock.scheme.resolve(&options).unwrap(), lock.scheme);
            assert_eq!(lock.scheme.name(), scheme.name());
            if let LockScheme::Citron(spec) = lock.scheme {
                assert!(spec.t_wait_us > 0, "{}", lock.scheme);
            }
            assert_eq!(created.bytes, bytes, "{scheme}");
            if bytes > 0 {
                assert_eq!(lock.base, base);
            }
            // What a client receives: the lock as it crossed the wire.
            let lock: LockRef = postcard::from_bytes(&postcard::to_stdvec(&lock).unwrap()).unwrap();
            let mut options = created.open_options();
            if matches!(lock.scheme, LockScheme::Citron(spec)
                if spec.growth == Some(CitronGrowth::Allocator))
            {
                // Without the creator's allocator, such a lock cannot be opened.
                assert!(open(&lock, &fabric, &options).is_err());
                options.allocator = Some(Arc::new(BumpAllocator::new(
                    RemoteAddr::new(GROWTH, 0),
                    1 << 20,
                )));
            }
            let mut a = open(&lock, &fabric, &options).unwrap();
            let mut b = open(&lock, &fabric, &options).unwrap();
            assert_eq!(a.scheme(), scheme.name());
            // Within the tree and beyond it (CITRON's spillover mutex, a scale-up).
            for range in [0..10, 5..1 << 16, 0..u64::MAX] {
                let id = a.acquire(range.clone()).unwrap();
                a.release(id).unwrap();
                // Released: another handle gets the same range at once.
                let id = b.acquire(range).unwrap();
                b.release(id).unwrap();
            }
            assert_eq!(a.stats().acquisitions, 3);
            assert_eq!(b.stats().releases, 3);
            // At rest now; a lock held (and never released, as by a dead client) is not.
            let at_rest = inspect(&lock, Box::new(fabric.endpoint())).unwrap();
            if lock.scheme == LockScheme::SERVER {
                assert_eq!(at_rest, None, "the lock server's state is not in memory");
                continue;
            }
            assert_eq!(at_rest, Some(Vec::new()), "{scheme}");
            for range in [3..40, 0..u64::MAX] {
                let id = a.acquire(range.clone()).unwrap();
                let busy = inspect(&lock, Box::new(fabric.endpoint()))
                    .unwrap()
                    .unwrap();
                assert!(!busy.is_empty(), "{scheme}: {range:?} held, but at rest");
                a.release(id).unwrap();
                let at_rest = inspect(&lock, Box::new(fabric.endpoint())).unwrap();
                assert_eq!(at_rest, Some(Vec::new()), "{scheme} after {range:?}");
            }
            // A holder that dies (its handle dropped, nothing released): the reset puts back
            // exactly the words inspect saw, and the range is free at once.
            for range in [3..40, 0..u64::MAX] {
                let mut dead = open(&lock, &fabric, &options).unwrap();
                dead.acquire(range.clone()).unwrap();
                drop(dead);
                let busy = inspect(&lock, Box::new(fabric.endpoint()))
                    .unwrap()
                    .unwrap();
                assert!(!busy.is_empty(), "{scheme}: {range:?} held by the dead");
                let reset = reset_to_rest(&lock, Box::new(fabric.endpoint()))
                    .unwrap()
                    .unwrap();
                assert_eq!(reset, busy, "{scheme}: {range:?}");
                let at_rest = inspect(&lock, Box::new(fabric.endpoint())).unwrap();
                assert_eq!(at_rest, Some(Vec::new()), "{scheme} reset after {range:?}");
                let start = std::time::Instant::now();
                let id = b.acquire(range.clone()).unwrap();
                b.release(id).unwrap();
                assert!(
                    start.elapsed() < std::time::Duration::from_millis(100),
                    "{scheme}: {range:?} waited {:?} after the reset",
                    start.elapsed()
                );
            }
        }
    }

    #[test]
    fn created_in_the_creators_memory_and_lock_server() {
        // Memory too small: NoSpace, which a file system reports as full.
        let fabric = MemServer::new();
        fabric.register(RegionId(1), 256).unwrap();
        let mut endpoint = fabric.endpoint();
        let result = create(
            &LockScheme::SEG,
            &CreateOptions::default(),
            &mut FixedMemory::new(&mut endpoint, RemoteAddr::new(RegionId(1), 0), 64),
        );
        assert!(matches!(result, Err(LockError::NoSpace { bytes: 8192 })));
        // A creator that runs a lock server gets no second one.
        let credentials = fabric::Credentials::new("c", "t");
        let server = LockServer::bind("127.0.0.1:0", credentials.clone()).unwrap();
        let at = LockServerAt {
            addr: server.addr(),
            credentials,
        };
        let options = CreateOptions {
            lock_server: Some(at.clone()),
            ..CreateOptions::default()
        };
        let mut memory = FixedMemory::new(&mut endpoint, RemoteAddr::new(RegionId(1), 0), 0);
        let created = create(&LockScheme::SERVER, &options, &mut memory).unwrap();
        assert_eq!(created.server, Some(at));
        assert!(created._started.is_none());
        assert_eq!(created.lock.base, NO_STATE);
        let mut lock = open(&created.lock, &fabric, &created.open_options()).unwrap();
        let id = lock.acquire(0..1).unwrap();
        assert_eq!(server.held(), 1);
        lock.release(id).unwrap();
        // Without the server's address, a client cannot open it.
        assert!(open(&created.lock, &fabric, &OpenOptions::default()).is_err());
        // One handle on the service locks every object, each in its own slice.
        let mut service =
            open_service(&LockScheme::SERVER, &fabric, &created.open_options()).unwrap();
        let scheme = LockScheme::SERVER;
        let a = service
            .acquire(scheme.object_range(1, 0..u64::MAX).unwrap())
            .unwrap();
        let b = service
            .acquire(scheme.object_range(2, 0..u64::MAX).unwrap())
            .unwrap();
        service.release(a).unwrap();
        service.release(b).unwrap();
        assert!(open_service(&LockScheme::MUTEX, &fabric, &OpenOptions::default()).is_err());
        // The creator's defaults fill what the description leaves open, and only that.
        let options = CreateOptions {
            seg: SegSpec {
                segment_units: 8,
                segments: 16,
            },
            ..CreateOptions::default()
        };
        let mut memory = FixedMemory::new(&mut endpoint, RemoteAddr::new(RegionId(1), 0), 256);
        let created = create(&"seg:4".parse().unwrap(), &options, &mut memory).unwrap();
        assert_eq!(created.lock.scheme.to_string(), "seg:4:16");
        assert_eq!(created.bytes, 16 * 8);
        // The memory hands out its stretch once.
        assert!(matches!(
            create(&LockScheme::MUTEX, &options, &mut memory),
            Err(LockError::NoSpace { .. })
        ));
    }

    /// Where each scheme keeps its locks, and where an object's range is locked.
    #[test]
    fn placement_and_object_ranges() {
        for scheme in examples() {
            let service = scheme == LockScheme::SERVER;
            assert_eq!(scheme.uses_service(), service, "{scheme}");
            if !service {
                // A lock per object: the range as it is, whatever the object.
                assert_eq!(
                    scheme.object_range(1 << 30, 5..u64::MAX).unwrap(),
                    5..u64::MAX
                );
                continue;
            }
            let a = scheme.object_range(1, 0..OBJECT_UNITS).unwrap();
            let b = scheme.object_range(2, 0..1).unwrap();
            assert_eq!(a, 1 << 40..2 << 40);
            assert_eq!(b, 2 << 40..(2 << 40) + 1);
            assert_eq!(scheme.object_range(3, 0..u64::MAX).unwrap().end, 4 << 40);
            // A range reaching beyond the slice is cut at its end.
            assert_eq!(
                scheme.object_range(3, 5..u64::MAX).unwrap(),
                (3 << 40) + 5..4 << 40
            );
            assert_eq!(
                scheme
                    .object_range(SERVICE_OBJECTS - 1, 0..u64::MAX)
                    .unwrap(),
                u64::MAX - OBJECT_UNITS + 1..u64::MAX
            );
            assert!(scheme.object_range(SERVICE_OBJECTS, 0..1).is_err());
        }
    }

    /// Every scheme's open options take the place of a scheme's own where they are set, and
    /// only there; the creator's defaults become each scheme's.
    #[test]
    fn options_every_scheme_takes() {
        struct NoFence;
        impl Fence for NoFence {
            fn fence(&self) -> Result<(), LockError> {
                Ok(())
            }
        }
        let own: Arc<dyn Fence> = Arc::new(NoFence);
        let mut options = OpenOptions::default();
        options.citron.hosting = Hosting::Never;
        options.citron.owner = Some(7);
        options.citron.fence = Some(own.clone());
        let citron = options.citron_options();
        assert_eq!((citron.hosting, citron.owner), (Hosting::Never, Some(7)));
        assert!(Arc::ptr_eq(citron.fence.as_ref().unwrap(), &own));
        assert!(options.ticket_config().fence.is_none());
        let given: Arc<dyn Fence> = Arc::new(NoFence);
        options.fence = Some(given.clone());
        options.owner = Some(9);
        options.hosting = Some(Hosting::Always);
        let citron = options.citron_options();
        assert_eq!((citron.hosting, citron.owner), (Hosting::Always, Some(9)));
        assert!(Arc::ptr_eq(citron.fence.as_ref().unwrap(), &given));
        assert!(Arc::ptr_eq(
            options.ticket_config().fence.as_ref().unwrap(),
            &given
        ));
        assert_eq!(citron.k, ClientOptions::default().k);

        let defaults = LockDefaults {
            units: 300,
            lease: Duration::from_millis(1500),
            wait: Duration::from_nanos(10_500),
            allocates_growth: true,
            lock_server: None,
        };
        let resolved = LockScheme::CITRON
            .resolve(&CreateOptions::from_defaults(&defaults))
            .unwrap();
        assert_eq!(resolved.to_string(), "citron:1024:1073741824:1500:11:alloc");
        let fixed = CreateOptions::from_defaults(&LockDefaults {
            allocates_growth: false,
            ..defaults
        });
        let resolved = LockScheme::CITRON.resolve(&fixed).unwrap();
        assert_eq!(resolved.to_string(), "citron:1024:1024:1500:11:room");
        assert_eq!(fixed.seg, SegSpec::DEFAULT);
    }

    /// A lease is a description's only where it fixes one.
    #[test]
    fn leases() {
        let fixed: LockScheme = "citron:1024:0:60000".parse().unwrap();
        assert_eq!(fixed.lease(), Some(Duration::from_secs(60)));
        for open in LockScheme::PLAIN {
            assert_eq!(open.lease(), None, "{open}");
        }
    }
}
