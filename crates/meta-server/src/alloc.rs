//! A first-fit allocator over the meta region, for file control blocks and lock state.
//!
//! Invariants: free extents are disjoint, non-adjacent (coalesced) and 64-byte aligned; every
//! allocation is a multiple of [`GRANULE`] bytes, so lock words and FCBs stay 8-byte aligned and
//! an FCB never shares a cache line with another file's words.

use std::collections::BTreeMap;

/// Allocation granularity in bytes.
pub const GRANULE: u64 = 64;

/// Free extents of one region: offset → length.
#[derive(Debug)]
pub struct RegionAlloc {
    free: BTreeMap<u64, u64>,
    free_bytes: u64,
}

impl RegionAlloc {
    /// Serves `start..end` (rounded inwards to the granule).
    pub fn new(start: u64, end: u64) -> Self {
        let start = start.div_ceil(GRANULE) * GRANULE;
        let end = end / GRANULE * GRANULE;
        let mut free = BTreeMap::new();
        if end > start {
            free.insert(start, end - start);
        }
        Self {
            free,
            free_bytes: end.saturating_sub(start),
        }
    }

    /// Bytes not allocated.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Rounds a request up to the granule (what `alloc` takes and `free` must be given).
    pub fn round(bytes: u64) -> Option<u64> {
        bytes.max(1).checked_next_multiple_of(GRANULE)
    }

    /// Allocates `bytes` (rounded up); `None` when no extent is large enough.
    pub fn alloc(&mut self, bytes: u64) -> Option<u64> {
        let bytes = Self::round(bytes)?;
        let (&off, &len) = self.free.iter().find(|(_, &len)| len >= bytes)?;
        self.free.remove(&off);
        if len > bytes {
            self.free.insert(off + bytes, len - bytes);
        }
        self.free_bytes -= bytes;
        Some(off)
    }

    /// Returns an allocation (`bytes` as it was asked for; rounded the same way).
    pub fn free(&mut self, off: u64, bytes: u64) {
        let Some(mut len) = Self::round(bytes) else {
            return;
        };
        self.free_bytes += len;
        let mut off = off;
        if let Some((&prev, &plen)) = self.free.range(..off).next_back() {
            debug_assert!(prev + plen <= off, "double free at {off:#x}");
            if prev + plen == off {
                self.free.remove(&prev);
                off = prev;
                len += plen;
            }
        }
        if let Some(&nlen) = self.free.get(&(off + len)) {
            self.free.remove(&(off + len));
            len += nlen;
        }
        self.free.insert(off, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesce() {
        let mut a = RegionAlloc::new(64, 64 * 10);
        assert_eq!(a.free_bytes(), 64 * 9);
        let x = a.alloc(1).unwrap();
        let y = a.alloc(100).unwrap();
        let z = a.alloc(64).unwrap();
        assert_eq!((x, y, z), (64, 128, 256));
        assert!(a.alloc(64 * 6).is_none());
        a.free(y, 100);
        a.free(x, 1);
        a.free(z, 64);
        assert_eq!(a.free_bytes(), 64 * 9);
        assert_eq!(a.alloc(64 * 9), Some(64));
    }
}
