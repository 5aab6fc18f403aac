//! Where a file's bytes lie in its chunks, and how big each chunk is: a pure function of the
//! offset and the cluster's chunk size, shared by the meta server (allocation, truncate, fsck)
//! and the clients (I/O planning), so that nothing ever moves when a file grows.
//!
//! # The geometric layout
//!
//! With `B` = [`Layout::unit`] (4 KiB, or the chunk size if smaller) and `C` = the chunk size
//! (`C = B · 2^L`):
//!
//! | chunk `k`       | bytes of the file            | size        |
//! | --------------- | ---------------------------- | ----------- |
//! | 0               | `[0, B)`                     | `B`         |
//! | `1 ..= L + 1`   | `[B · 2^(k-1), B · 2^k)`     | `B · 2^(k-1)` |
//! | `k > L + 1`     | `[C · (k - L), C · (k - L + 1))` | `C`     |
//!
//! So the chunks covering `[0, S)` hold at most `2·S` bytes for every `S > B` (below `C` they
//! hold the next power of two of `S`, rounded to `B`; above, less than `S + C ≤ 2·S`), and a
//! file of at most `B` bytes holds one block of `B`. A chunk's size is `B · 2^order` with
//! `order ≤ L`, and the meta server keeps each chunk at an offset of its region aligned to its
//! size (a buddy allocator), so a chunk never straddles two of the region's `C`-sized blocks.
//!
//! A chunk's place in a data server's region, [`crate::ChunkLoc::index`], is counted in units
//! of `B`: the chunk starts at byte `index · B`.

use crate::FsError;

/// The smallest chunk: a file of up to this many bytes is charged this much.
pub const MIN_CHUNK: u64 = 4096;

/// The layout of files in chunks for one chunk size (a power of two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The largest chunk (`C`), the cluster's chunk size.
    chunk_size: u64,
    /// The smallest chunk (`B`) and the unit of [`crate::ChunkLoc::index`].
    unit: u64,
    /// `L`: `chunk_size = unit << max_order`.
    max_order: u32,
}

impl Layout {
    /// The layout for chunk size `chunk_size`; fails unless it is a power of two.
    pub fn new(chunk_size: u64) -> Result<Layout, FsError> {
        if !chunk_size.is_power_of_two() {
            return Err(FsError::Invalid(format!(
                "a chunk size of {chunk_size} bytes is not a power of two"
            )));
        }
        let unit = chunk_size.min(MIN_CHUNK);
        Ok(Layout {
            chunk_size,
            unit,
            max_order: (chunk_size / unit).trailing_zeros(),
        })
    }

    /// The largest chunk's size in bytes.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// The smallest chunk's size in bytes: the unit of region offsets and of `statfs` blocks.
    pub fn unit(&self) -> u64 {
        self.unit
    }

    /// The order of the largest chunk (`chunk_size = unit · 2^max_order`).
    pub fn max_order(&self) -> u32 {
        self.max_order
    }

    /// Units in a block of `order`.
    pub fn units_of(order: u32) -> u64 {
        1u64 << order
    }

    /// The order of chunk `k`: it holds `unit · 2^order` bytes.
    pub fn order(&self, k: u64) -> u32 {
        match k {
            0 => 0,
            k if k <= u64::from(self.max_order) + 1 => (k - 1) as u32,
            _ => self.max_order,
        }
    }

    /// Bytes chunk `k` holds.
    pub fn len(&self, k: u64) -> u64 {
        self.unit << self.order(k)
    }

    /// The file offset where chunk `k` starts (saturating far beyond any file).
    pub fn start(&self, k: u64) -> u64 {
        let l = u64::from(self.max_order);
        match k {
            0 => 0,
            k if k <= l + 1 => self.unit << (k - 1),
            k => self.chunk_size.saturating_mul(k - l),
        }
    }

    /// The chunk holding file byte `off`, and where in it.
    pub fn locate(&self, off: u64) -> (u64, u64) {
        let k = if off < self.unit {
            0
        } else if off < self.chunk_size {
            u64::from((off / self.unit).ilog2()) + 1
        } else {
            off / self.chunk_size + u64::from(self.max_order)
        };
        (k, off - self.start(k))
    }

    /// How many chunks cover bytes `[0, size)`: the first chunk wholly at or past `size`.
    pub fn chunks_below(&self, size: u64) -> u64 {
        if size == 0 {
            return 0;
        }
        self.locate(size - 1).0 + 1
    }

    /// Bytes chunks `chunks` (by index) hold together: what a file with those chunks is
    /// charged (`Attr::allocated`).
    pub fn held(&self, chunks: impl IntoIterator<Item = u64>) -> u64 {
        chunks.into_iter().map(|k| self.len(k)).sum()
    }

    /// The chunks wholly inside bytes `[start, end)` (empty when there are none).
    pub fn chunks_within(&self, start: u64, end: u64) -> std::ops::Range<u64> {
        let first = self.chunks_below(start);
        let end = if end == 0 { 0 } else { self.locate(end).0 };
        first..end.max(first)
    }

    /// Bytes the chunks covering `[0, size)` hold: what a file of `size` bytes without holes
    /// is charged.
    pub fn charged(&self, size: u64) -> u64 {
        match self.chunks_below(size) {
            0 => 0,
            n => self.start(n - 1) + self.len(n - 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `chunks_within` against a chunk-by-chunk check, and `held` against the lengths.
    #[test]
    fn chunks_within_a_range_are_those_it_covers_whole() {
        let l = Layout::new(64 << 10).unwrap();
        let edges = [
            0, 1, 4095, 4096, 4097, 8192, 65_535, 65_536, 65_537, 200_000, 262_144,
        ];
        for &a in &edges {
            for &b in edges.iter().filter(|&&b| b >= a) {
                let want: Vec<u64> = (0..10)
                    .filter(|&k| l.start(k) >= a && l.start(k) + l.len(k) <= b)
                    .collect();
                let got: Vec<u64> = l.chunks_within(a, b).collect();
                assert_eq!(got, want, "[{a}, {b})");
            }
        }
        assert_eq!(l.held(0..5), 64 << 10);
        assert_eq!(l.held([5, 7]), 2 * (64 << 10));
    }

    #[test]
    fn the_first_chunks_double_up_to_the_chunk_size() {
        let l = Layout::new(64 << 10).unwrap();
        assert_eq!(l.unit(), 4096);
        assert_eq!(l.max_order(), 4);
        let lens: Vec<u64> = (0..8).map(|k| l.len(k) >> 10).collect();
        assert_eq!(lens, [4, 4, 8, 16, 32, 64, 64, 64]);
        let starts: Vec<u64> = (0..8).map(|k| l.start(k) >> 10).collect();
        assert_eq!(starts, [0, 4, 8, 16, 32, 64, 128, 192]);
        assert_eq!(l.locate(0), (0, 0));
        assert_eq!(l.locate(4095), (0, 4095));
        assert_eq!(l.locate(4096), (1, 0));
        assert_eq!(l.locate(12 << 10), (2, 4 << 10));
        assert_eq!(l.locate(64 << 10), (5, 0));
        assert_eq!(l.locate((200 << 10) + 1), (7, (8 << 10) + 1));
        assert_eq!(l.chunks_below(0), 0);
        assert_eq!(l.chunks_below(1), 1);
        assert_eq!(l.chunks_below(4097), 2);
        assert_eq!(l.charged(4097), 8192);
        assert_eq!(l.charged(1), 4096);
        assert!(Layout::new(3).is_err());
        assert!(Layout::new(0).is_err());
    }

    #[test]
    fn a_chunk_size_at_or_below_the_unit_is_uniform() {
        for cs in [8u64, 4096] {
            let l = Layout::new(cs).unwrap();
            assert_eq!(l.unit(), cs);
            for k in 0..10 {
                assert_eq!(l.start(k), k * cs);
                assert_eq!(l.len(k), cs);
            }
        }
    }

    proptest! {
        /// Chunks tile the file in order, each offset lies in the chunk `locate` names, and a
        /// file of `S > unit` bytes is charged less than `2·S`.
        #[test]
        fn chunks_tile_and_cost_under_twice_the_size(shift in 0u32..24, off in 0u64..(1 << 32)) {
            let l = Layout::new(1 << shift).unwrap();
            let (k, at) = l.locate(off);
            prop_assert!(at < l.len(k));
            prop_assert_eq!(l.start(k) + at, off);
            prop_assert_eq!(l.start(k + 1), l.start(k) + l.len(k));
            prop_assert!(l.len(k) <= l.chunk_size() && l.len(k) >= l.unit());
            let size = off + 1;
            let charged = l.charged(size);
            prop_assert!(charged >= size);
            if size > l.unit() {
                prop_assert!(charged < 2 * size, "{} bytes charged {}", size, charged);
            } else {
                prop_assert_eq!(charged, l.unit());
            }
            prop_assert_eq!(l.chunks_below(size), k + 1);
        }
    }
}
