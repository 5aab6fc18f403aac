//! CITRON as a lock scheme of [`crate::schemes`]: its description ([`CitronSpec`]), how a creator
//! lays out one lock's memory from it, and how a client opens that lock again.
//!
//! What the description fixes, and why it is the creator's to fix (CITRON §3):
//!
//! - `N`, the units the tree covers at first: "N is specified at initialization time" (§3.3);
//!   ranges beyond it take the spillover mutex and are ORed into the maximizer (§3.9.1).
//! - How far and from where the tree grows. Algorithm 4 l. 3 "sends an RPC to the server to
//!   allocate free and zeroed memory": [`CitronGrowth::Allocator`] is that, the clients bring the
//!   allocator (the file system's `AllocateLockWords`); [`CitronGrowth::Room`] pre-provisions the
//!   memory every scale-up can take right after the tree, with a cursor word that clients bump
//!   one-sidedly ([`FabricBumpAllocator`]), for creators without a server CPU (tests, benchmarks).
//! - `T_lease`: "all clients must agree with a lease time" (§3.10), so it is in the config record.
//! - `T_wait` (§3.5.5, Alg. 2 l. 29 and 34): also in the record; measured by the creator when the
//!   description leaves it open, and then written back into the description it returns.
//!
//! The fast path (§3.8) is a client-side choice and changes nothing in memory; it is in the
//! description (`citron` / `citron-nofastpath`) so that the name says what a client runs.

use super::config::{FabricBumpAllocator, NoAllocator};
use super::{layout, measure_t_wait, Citron, CitronClient, CitronConfig, ClientOptions};
use crate::scheme::LockError;
use crate::schemes::{write_spec, Fields, LockMemory, LockWordAllocator};
use fabric::{Connector, RemoteAddr};
use std::sync::Arc;
use std::time::Duration;

/// The name of CITRON with (`citron`) or without (`citron-nofastpath`) the fast path of §3.8.
pub fn name(fast_path: bool) -> &'static str {
    if fast_path {
        "citron"
    } else {
        "citron-nofastpath"
    }
}

/// Where a CITRON lock's scale-ups (Alg. 4 l. 3) get their memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CitronGrowth {
    /// Room the creator set aside after the tree, for every scale-up up to `max_unit_count`,
    /// handed out by a [`FabricBumpAllocator`] whose cursor word precedes it (spec word `room`).
    Room,
    /// The creator's allocator, which every client brings when it opens the lock
    /// (`crate::schemes::OpenOptions::allocator`; spec word `alloc`).
    Allocator,
}

impl CitronGrowth {
    fn word(self) -> &'static str {
        match self {
            CitronGrowth::Room => "room",
            CitronGrowth::Allocator => "alloc",
        }
    }
}

/// A CITRON lock's description. A 0 field (or `None`) is left to the creator, which fills it from
/// its [`CitronDefaults`]; what [`crate::schemes::create`] returns has every field set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CitronSpec {
    /// The fast path of §3.8 (a client-side choice: `citron` or `citron-nofastpath`).
    pub fast_path: bool,
    /// `N`, the units the tree covers at first; as created, rounded up to a whole tree
    /// (`64·4^(H-1)`, see [`layout::tree_units`]).
    pub unit_count: u64,
    /// How far scale-ups may grow the tree, in units (no growth when `<= unit_count`).
    pub max_unit_count: u64,
    /// `T_lease` in milliseconds (§3.10). A holder must release within it or be presumed dead,
    /// so it must exceed the longest critical section by far.
    pub lease_ms: u64,
    /// `T_wait` in microseconds (§3.5.5); 0 (after the defaults) lets the creator derive it from
    /// its measured round trip ([`super::t_wait_for_rtt`]). Give it when clients see longer
    /// round trips than the creator measures (a loaded host, a slower path).
    pub t_wait_us: u64,
    /// Where scale-ups get memory.
    pub growth: Option<CitronGrowth>,
}

/// What a creator decides for the fields a [`CitronSpec`] leaves open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CitronDefaults {
    /// `N` at first.
    pub unit_count: u64,
    /// The growth limit; 0: none (the tree stays at `N`).
    pub max_unit_count: u64,
    /// Where scale-ups get memory.
    pub growth: CitronGrowth,
    /// `T_lease` in milliseconds.
    pub lease_ms: u64,
    /// `T_wait` in microseconds; 0: measured through the creator's endpoint.
    pub t_wait_us: u64,
}

/// [`CitronConfig::default`]'s `N` and `T_lease`, no growth, `T_wait` measured: a lock for one
/// process or one benchmark, which no scale-up surprises.
impl Default for CitronDefaults {
    fn default() -> Self {
        let config = CitronConfig::default();
        Self {
            unit_count: config.unit_count,
            max_unit_count: 0,
            growth: CitronGrowth::Room,
            lease_ms: duration_ms(config.t_lease),
            t_wait_us: 0,
        }
    }
}

/// `d` in whole milliseconds, rounded up (a lease never comes out shorter than asked).
pub fn duration_ms(d: Duration) -> u64 {
    d.as_nanos().div_ceil(1_000_000).min(u64::MAX as u128) as u64
}

/// `d` in whole microseconds, rounded up and at least 1 (a `T_wait` never comes out shorter
/// than measured, which would make inequality (1) of §3.5.5 abort more).
pub fn duration_us(d: Duration) -> u64 {
    (d.as_nanos().div_ceil(1_000).min(u64::MAX as u128) as u64).max(1)
}

impl CitronSpec {
    /// `citron` (or `citron-nofastpath`) with every parameter left to the creator.
    pub const fn plain(fast_path: bool) -> Self {
        Self {
            fast_path,
            unit_count: 0,
            max_unit_count: 0,
            lease_ms: 0,
            t_wait_us: 0,
            growth: None,
        }
    }

    /// The scheme's name ([`name`]).
    pub fn name(&self) -> &'static str {
        name(self.fast_path)
    }

    /// Writes the spec form after the name: `:<units>:<max_units>:<lease_ms>:<t_wait_us>:<growth>`,
    /// trailing fields the creator decides left out.
    pub(crate) fn write(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write_spec(
            f,
            self.name(),
            &[
                self.unit_count,
                self.max_unit_count,
                self.lease_ms,
                self.t_wait_us,
            ],
            self.growth.map(CitronGrowth::word),
        )
    }

    /// Reads the fields [`CitronSpec::write`] writes.
    pub(crate) fn parse(fast_path: bool, fields: &mut Fields<'_>) -> Result<Self, LockError> {
        Ok(Self {
            fast_path,
            unit_count: fields.number("unit count")?,
            max_unit_count: fields.number("max unit count")?,
            lease_ms: fields.number("lease")?,
            t_wait_us: fields.number("T_wait")?,
            growth: match fields.word() {
                None => None,
                Some("room") => Some(CitronGrowth::Room),
                Some("alloc") => Some(CitronGrowth::Allocator),
                Some(other) => return Err(fields.error(format!("growth {other:?} (room, alloc)"))),
            },
        })
    }

    /// Fills the fields left open from `defaults`; `N` is rounded up to the tree that covers it,
    /// the growth limit to at least `N`. `T_wait` may stay 0 (measured by the creator).
    pub fn resolve(&self, defaults: &CitronDefaults) -> Result<Self, LockError> {
        let or = |value: u64, default: u64| if value == 0 { default } else { value };
        let requested = or(self.unit_count, defaults.unit_count);
        let height = layout::height_for(requested.max(1)).ok_or_else(|| {
            LockError::Config(format!("{requested} units exceed the largest tree"))
        })?;
        let unit_count = layout::tree_units(height);
        let lease_ms = or(self.lease_ms, defaults.lease_ms);
        if lease_ms == 0 {
            return Err(LockError::Config("T_lease must be positive".into()));
        }
        Ok(Self {
            fast_path: self.fast_path,
            unit_count,
            max_unit_count: or(self.max_unit_count, defaults.max_unit_count).max(unit_count),
            lease_ms,
            t_wait_us: or(self.t_wait_us, defaults.t_wait_us),
            growth: Some(self.growth.unwrap_or(defaults.growth)),
        })
    }

    /// Bytes of memory the lock takes from its base: the config record, the spillover mutex,
    /// the maximizer and the tree ([`Citron::bytes_needed`]), and with [`CitronGrowth::Room`]
    /// the cursor word and the growth room. Needs `N` and the growth set ([`Self::resolve`]).
    pub fn region_bytes(&self) -> Result<u64, LockError> {
        Ok(match self.room()? {
            Some(room) => room.area_offset + room.area_len,
            None => Citron::bytes_needed(self.unit_count)?,
        })
    }

    /// The growth room, when the lock has one that can hold a scale-up.
    fn room(&self) -> Result<Option<GrowthRoom>, LockError> {
        match self.growth {
            None => Err(LockError::Config(format!(
                "{}: growth not resolved (a lock is opened from what `create` returned)",
                self.name()
            ))),
            Some(CitronGrowth::Allocator) => Ok(None),
            Some(CitronGrowth::Room) => {
                Ok(growth_room(self.unit_count, self.max_unit_count)?
                    .filter(|room| room.area_len > 0))
            }
        }
    }

    /// The [`CitronConfig`] a lock of this (resolved) description is created with: its units,
    /// scale-up limit, lease and `T_wait` (`None` while open, 0), the other choices the
    /// defaults. What `T_wait` is derived for ([`CitronConfig::t_wait_round_trips`]).
    pub fn config(&self) -> CitronConfig {
        CitronConfig {
            unit_count: self.unit_count,
            max_unit_count: self.max_unit_count,
            t_lease: Duration::from_millis(self.lease_ms),
            t_wait: (self.t_wait_us != 0).then(|| Duration::from_micros(self.t_wait_us)),
            ..CitronConfig::default()
        }
    }

    /// Creates the lock from a resolved description: takes [`Self::region_bytes`] from `memory`,
    /// measures `T_wait` if it is open, lays out the record, the spillover mutex, the maximizer
    /// and the tree ([`Citron::create`]), and zeroes the growth room and its cursor. Returns the
    /// description with `T_wait` set, the base address and the bytes taken.
    pub(crate) fn create_in(
        &self,
        memory: &mut dyn LockMemory,
    ) -> Result<(Self, RemoteAddr, u64), LockError> {
        let bytes = self.region_bytes()?;
        let base = memory.allocate(bytes)?;
        let endpoint = memory.endpoint();
        let mut config = self.config();
        // Measured here rather than inside `Citron::create`, so that the record gets exactly
        // the value the returned description states (whole microseconds).
        let t_wait_us = match self.t_wait_us {
            0 => duration_us(measure_t_wait(endpoint, base, &config)?),
            us => us,
        };
        config.t_wait = Some(Duration::from_micros(t_wait_us));
        Citron::create(endpoint, base, config)?;
        if let Some(room) = self.room()? {
            // The memory Alg. 4 l. 3 asks for must be "free and zeroed", and the cursor at 0.
            FabricBumpAllocator::format(
                endpoint,
                base.add(room.cursor_offset),
                base.add(room.area_offset),
                room.area_len,
            )?;
        }
        Ok((Self { t_wait_us, ..*self }, base, bytes))
    }

    /// Opens one client (one thread) on the lock at `base` that was created from this
    /// description. `options` are the client's own choices but for the fast path, which the
    /// description fixes, and scale-ups, which need somewhere to grow; `allocator` is where they
    /// get memory with [`CitronGrowth::Allocator`] (Alg. 4 l. 3).
    pub(crate) fn open(
        &self,
        base: RemoteAddr,
        connector: &dyn Connector,
        options: &ClientOptions,
        allocator: Option<&Arc<dyn LockWordAllocator>>,
    ) -> Result<CitronClient, LockError> {
        let allocator: Option<Arc<dyn LockWordAllocator>> = match (self.growth, self.room()?) {
            (Some(CitronGrowth::Allocator), _) => Some(allocator.cloned().ok_or_else(|| {
                LockError::Config(format!(
                    "{}: the lock grows from its creator's allocator; none was given",
                    self.name()
                ))
            })?),
            // Each client allocates through its own endpoint: endpoints are per thread.
            (_, Some(room)) => Some(Arc::new(FabricBumpAllocator::new(
                connector.connect()?,
                base.add(room.cursor_offset),
                base.add(room.area_offset),
                room.area_len,
            ))),
            // No room: ranges beyond N stay on the spillover mutex (§3.3), nothing scales up.
            _ => None,
        };
        let mut client = CitronClient::open(
            connector.connect()?,
            base,
            allocator.clone().unwrap_or_else(|| Arc::new(NoAllocator)),
            ClientOptions {
                fast_path: self.fast_path,
                auto_scale_up: options.auto_scale_up && allocator.is_some(),
                ..options.clone()
            },
        )?;
        client.choose_hosting(&crate::schemes::LockScheme::Citron(*self))?;
        Ok(client)
    }
}

/// Where a lock with [`CitronGrowth::Room`] keeps its growth room, as offsets from its base.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GrowthRoom {
    /// The [`FabricBumpAllocator`] cursor word.
    cursor_offset: u64,
    /// The zeroed area scale-ups allocate from.
    area_offset: u64,
    /// Its bytes (0: no growth).
    area_len: u64,
}

/// The growth room of a lock of `unit_count` units that may grow to `max_unit_count`: the nodes
/// every scale-up together can add, `tree_nodes(H_max) - tree_nodes(H_0)` of them, each with its
/// owner record (each scale-up's segment holds exactly the nodes it adds, Alg. 4 and Figure 5,
/// and the tree never grows past `max_unit_count`).
fn growth_room(unit_count: u64, max_unit_count: u64) -> Result<Option<GrowthRoom>, LockError> {
    let tree = Citron::bytes_needed(unit_count)?;
    let Some(h0) = layout::height_for(unit_count) else {
        return Ok(None);
    };
    // The tallest height within `max_unit_count` (what `scaleup::target_height` stops at).
    let h_max = layout::tallest_height(h0, max_unit_count);
    let area_len =
        layout::STORAGE_WORDS_PER_NODE * (layout::tree_nodes(h_max) - layout::tree_nodes(h0)) * 8;
    Ok(Some(GrowthRoom {
        cursor_offset: tree,
        area_offset: tree + 8,
        area_len,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schemes::LockScheme;

    #[test]
    fn citron_spec_round_trip() {
        let spec = LockScheme::Citron(CitronSpec {
            fast_path: false,
            unit_count: 1024,
            max_unit_count: 1 << 16,
            lease_ms: 60_000,
            t_wait_us: 150,
            growth: None,
        });
        assert_eq!(spec.to_string(), "citron-nofastpath:1024:65536:60000:150");
        assert_eq!(spec.to_string().parse::<LockScheme>().unwrap(), spec);
        // The short form: N given, everything else the creator's.
        let short = LockScheme::Citron(CitronSpec {
            unit_count: 4096,
            ..CitronSpec::plain(true)
        });
        assert_eq!("citron:4096".parse::<LockScheme>().unwrap(), short);
        assert_eq!(short.to_string(), "citron:4096");
        assert_eq!(short.name(), "citron");
        // The growth word forces every field before it.
        let alloc = LockScheme::Citron(CitronSpec {
            growth: Some(CitronGrowth::Allocator),
            ..CitronSpec::plain(true)
        });
        assert_eq!(alloc.to_string(), "citron:0:0:0:0:alloc");
        assert_eq!(alloc.to_string().parse::<LockScheme>().unwrap(), alloc);
        assert!("citron:1:x".parse::<LockScheme>().is_err());
        assert!("citron:1:2:3:4:more".parse::<LockScheme>().is_err());
        assert!("citron:1:2:3:4:room:5".parse::<LockScheme>().is_err());
    }

    #[test]
    fn resolve_fills_only_what_is_open() {
        let defaults = CitronDefaults {
            unit_count: 5000,
            max_unit_count: 1 << 20,
            growth: CitronGrowth::Allocator,
            lease_ms: 2000,
            t_wait_us: 0,
        };
        let plain = CitronSpec::plain(true).resolve(&defaults).unwrap();
        assert_eq!(
            plain,
            CitronSpec {
                fast_path: true,
                // Rounded up to a whole tree: 64·4^3.
                unit_count: 16384,
                max_unit_count: 1 << 20,
                lease_ms: 2000,
                t_wait_us: 0,
                growth: Some(CitronGrowth::Allocator),
            }
        );
        // Resolving twice changes nothing.
        assert_eq!(plain.resolve(&defaults).unwrap(), plain);
        let given = CitronSpec {
            fast_path: false,
            unit_count: 1024,
            max_unit_count: 10,
            lease_ms: 7,
            t_wait_us: 9,
            growth: Some(CitronGrowth::Room),
        };
        // A limit below N is N: no growth.
        assert_eq!(
            given.resolve(&defaults).unwrap(),
            CitronSpec {
                max_unit_count: 1024,
                ..given
            }
        );
        // Without defaults for the lease, there is none.
        let no_lease = CitronDefaults {
            lease_ms: 0,
            ..defaults
        };
        assert!(CitronSpec::plain(true).resolve(&no_lease).is_err());
        assert!(CitronSpec {
            unit_count: u64::MAX,
            ..CitronSpec::plain(true)
        }
        .resolve(&defaults)
        .is_err());
    }

    #[test]
    fn citron_growth_room() {
        // 1024 units (height 3) growing to 2^16 (height 6): the nodes of heights 4..=6.
        let g = growth_room(1024, 1 << 16).unwrap().unwrap();
        assert_eq!(g.cursor_offset, Citron::bytes_needed(1024).unwrap());
        assert_eq!(g.area_offset, g.cursor_offset + 8);
        assert_eq!(
            g.area_len,
            layout::STORAGE_WORDS_PER_NODE * (layout::tree_nodes(6) - layout::tree_nodes(3)) * 8
        );
        // No growth asked: no room.
        assert_eq!(growth_room(1024, 1024).unwrap().unwrap().area_len, 0);
        // A limit between heights stops at the height below it.
        assert_eq!(
            growth_room(1024, 5000).unwrap().unwrap().area_len,
            layout::STORAGE_WORDS_PER_NODE * (layout::tree_nodes(4) - layout::tree_nodes(3)) * 8
        );
        // The room's bytes follow the tree; no room, no cursor word.
        let spec = |max_unit_count| CitronSpec {
            unit_count: 1024,
            max_unit_count,
            growth: Some(CitronGrowth::Room),
            ..CitronSpec::plain(true)
        };
        assert_eq!(
            spec(1 << 16).region_bytes().unwrap(),
            g.area_offset + g.area_len
        );
        assert_eq!(
            spec(1024).region_bytes().unwrap(),
            Citron::bytes_needed(1024).unwrap()
        );
        assert!(CitronSpec::plain(true).region_bytes().is_err());
    }
}
