//! Names of remote memory: region ids and `(region, offset)` addresses.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The name of a registered memory region on one server.
///
/// Region ids are small and dense (they index per-endpoint lookup tables), and they are unique
/// per server, not per cluster: an address is only meaningful together with the endpoint (the
/// server) it is posted to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionId(pub u32);

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "region {}", self.0)
    }
}

/// A byte address in remote memory: `offset` bytes into region `region`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RemoteAddr {
    /// The region the address lies in.
    pub region: RegionId,
    /// Byte offset from the start of the region.
    pub offset: u64,
}

impl RemoteAddr {
    /// The address `offset` bytes into `region`.
    pub const fn new(region: RegionId, offset: u64) -> Self {
        Self { region, offset }
    }

    /// The address `bytes` further on in the same region.
    ///
    /// Overflow is not checked here; every verb's bounds are checked when it executes.
    pub const fn add(self, bytes: u64) -> Self {
        Self {
            region: self.region,
            offset: self.offset.wrapping_add(bytes),
        }
    }

    /// The address of the `index`-th 8-byte word after this one.
    pub const fn word(self, index: u64) -> Self {
        self.add(index.wrapping_mul(8))
    }
}

impl fmt::Display for RemoteAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{:#x}", self.region.0, self.offset)
    }
}
