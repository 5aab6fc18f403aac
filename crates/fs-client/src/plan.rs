//! Byte-range arithmetic of the data path, free of I/O so that it can be tested on its own:
//! rounding a byte range outward to lock units, cutting it into per-chunk pieces, and planning
//! the one-sided verbs that move it, grouped into batches per data server.
//!
//! A file's byte `p` lives in the chunk [`proto::layout::Layout::locate`] names (chunks grow
//! geometrically from 4 KiB to the chunk size, so small files take small allocations); a chunk
//! `ChunkLoc { server, index }` starts at byte `index · unit` of the data server's region
//! (`unit`: the layout's smallest chunk). Lock unit `u` covers bytes
//! `[u · lock_unit, (u + 1) · lock_unit)`.

use proto::layout::Layout;
use proto::{ChunkLoc, FsError};
use std::collections::BTreeMap;
use std::ops::Range;

/// Lock units a file may span: a lock service's slice for one object
/// ([`lockmgr::schemes::OBJECT_UNITS`], `2^40`), so that a scheme keeping every file's lock at a
/// lock service gives each its own slice of one lock space (see [`crate::locks`]). With 4 KiB
/// lock units that is 4 PiB per file.
pub const FILE_UNITS: u64 = lockmgr::schemes::OBJECT_UNITS;

/// The cluster's chunk size and lock unit, both powers of two, and the file layout they give.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes of the largest chunk.
    pub chunk_size: u64,
    /// Bytes per lock unit.
    pub lock_unit: u64,
    /// Where a file's bytes lie in its chunks.
    pub layout: Layout,
}

impl Geometry {
    /// Checks what the meta server announced: both sizes non-zero powers of two.
    pub fn new(chunk_size: u64, lock_unit: u64) -> Result<Geometry, FsError> {
        for (what, v) in [("chunk size", chunk_size), ("lock unit", lock_unit)] {
            if !v.is_power_of_two() {
                return Err(FsError::Io(format!(
                    "the meta server announced a {what} of {v} bytes (must be a power of two)"
                )));
            }
        }
        let layout = Layout::new(chunk_size)
            .map_err(|e| FsError::Io(format!("the meta server announced a bad layout: {e}")))?;
        Ok(Geometry {
            chunk_size,
            lock_unit,
            layout,
        })
    }

    /// The largest file size the lock space allows, in bytes.
    pub fn max_file_size(&self) -> u64 {
        FILE_UNITS.saturating_mul(self.lock_unit)
    }

    /// The lock units covering bytes `[off, off + len)`, rounded outward; `len > 0`.
    /// Fails when the range reaches past [`Geometry::max_file_size`].
    pub fn lock_range(&self, off: u64, len: u64) -> Result<Range<u64>, FsError> {
        let end = self.checked_end(off, len)?;
        Ok(off / self.lock_unit..end.div_ceil(self.lock_unit))
    }

    /// `off + len`, refused beyond the largest file.
    pub fn checked_end(&self, off: u64, len: u64) -> Result<u64, FsError> {
        match off.checked_add(len) {
            Some(end) if end <= self.max_file_size() => Ok(end),
            _ => Err(FsError::Invalid(format!(
                "range {off}+{len} reaches past the largest file ({} bytes)",
                self.max_file_size()
            ))),
        }
    }

    /// The chunk indices bytes `[off, off + len)` touch; empty when `len == 0`.
    pub fn chunks(&self, off: u64, len: u64) -> Range<u64> {
        if len == 0 {
            return 0..0;
        }
        self.layout.locate(off).0..self.layout.locate(off + len - 1).0 + 1
    }

    /// The byte range chunk `chunk` of a file occupies in a data server's region at `loc`, or
    /// `None` when it lies beyond any address.
    pub fn region_range(&self, chunk: u64, loc: ChunkLoc) -> Option<Range<u64>> {
        let start = loc.index.checked_mul(self.layout.unit())?;
        Some(start..start.checked_add(self.layout.len(chunk))?)
    }

    /// Cuts bytes `[off, off + len)` into pieces that each lie within one chunk, in file order.
    pub fn pieces(&self, off: u64, len: usize) -> impl Iterator<Item = Piece> + '_ {
        let mut done = 0usize;
        std::iter::from_fn(move || {
            if done >= len {
                return None;
            }
            let pos = off + done as u64;
            let (chunk, chunk_off) = self.layout.locate(pos);
            let n = ((self.layout.len(chunk) - chunk_off) as usize).min(len - done);
            let piece = Piece {
                chunk,
                chunk_off,
                buf_off: done,
                len: n,
            };
            done += n;
            Some(piece)
        })
    }
}

/// A part of an I/O that lies within one chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The chunk's index in the file.
    pub chunk: u64,
    /// Where the piece starts in the chunk.
    pub chunk_off: u64,
    /// Where the piece starts in the caller's buffer.
    pub buf_off: usize,
    /// Its length in bytes.
    pub len: usize,
}

/// One read or write verb of a plan: `len` bytes at byte `remote_off` of a data server's region,
/// to or from `buf[buf_off..buf_off + len]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    /// Byte offset in the data server's region.
    pub remote_off: u64,
    /// Byte offset in the caller's buffer.
    pub buf_off: usize,
    /// Bytes moved.
    pub len: usize,
}

/// The verbs of one batch (one round trip).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlannedBatch {
    /// The verbs, in file order.
    pub ops: Vec<Op>,
    /// Bytes they move together.
    pub bytes: usize,
}

/// Everything one I/O does on one data server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerPlan {
    /// The data server's id.
    pub server: u32,
    /// Its batches, each within [`Limits`].
    pub batches: Vec<PlannedBatch>,
}

/// The fabric's limits a plan respects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes one verb moves.
    pub max_io: usize,
    /// Most verbs in one batch.
    pub max_verbs: usize,
    /// Most bytes one batch moves.
    pub max_batch_bytes: usize,
}

impl Limits {
    /// The fabric's limits ([`fabric::batch`]), less the room of the one verb the data path
    /// appends to every data batch (the 8-byte read of the data server's incarnation word,
    /// `io`).
    pub const FABRIC: Limits = Limits {
        max_io: fabric::batch::MAX_IO_BYTES,
        max_verbs: fabric::batch::MAX_BATCH_VERBS - 1,
        max_batch_bytes: fabric::batch::MAX_BATCH_BYTES - 8,
    };
}

/// Plans the verbs that move bytes `[off, off + len)` of a file: one batch list per data server,
/// with pieces of chunks that lie back to back in one region merged into one verb, every verb at
/// most `limits.max_io` bytes and every batch within the verb and byte limits. `locate` gives
/// the locations a chunk's piece is moved to or from: none for a hole (no verb touches it;
/// reads leave zeros there), one for a read or a chunk of one replica, each replica's for a
/// write (docs/REPLICAS.md) — a piece gets a verb at each, in its server's batches.
///
/// Fails when a location from the meta server cannot be a real address (the offset overflows).
pub fn plan<L>(
    geometry: &Geometry,
    off: u64,
    len: usize,
    mut locate: impl FnMut(u64) -> L,
    limits: Limits,
) -> Result<Vec<ServerPlan>, FsError>
where
    L: IntoIterator<Item = ChunkLoc>,
{
    let max_io = limits.max_io.min(limits.max_batch_bytes).max(1);
    let max_verbs = limits.max_verbs.max(1);
    let mut servers: BTreeMap<u32, Vec<PlannedBatch>> = BTreeMap::new();
    for piece in geometry.pieces(off, len) {
        for loc in locate(piece.chunk) {
            plan_piece(
                geometry,
                &piece,
                loc,
                &mut servers,
                limits,
                max_io,
                max_verbs,
            )?;
        }
    }
    Ok(servers
        .into_iter()
        .map(|(server, batches)| ServerPlan { server, batches })
        .collect())
}

/// Adds the verbs that move `piece` at `loc` to its server's batches in `servers`.
fn plan_piece(
    geometry: &Geometry,
    piece: &Piece,
    loc: ChunkLoc,
    servers: &mut BTreeMap<u32, Vec<PlannedBatch>>,
    limits: Limits,
    max_io: usize,
    max_verbs: usize,
) -> Result<(), FsError> {
    let base = loc
        .index
        .checked_mul(geometry.layout.unit())
        .and_then(|b| b.checked_add(piece.chunk_off))
        .ok_or_else(|| {
            FsError::Io(format!(
                "chunk {} of server {} lies beyond any address",
                loc.index, loc.server
            ))
        })?;
    let batches = servers.entry(loc.server).or_default();
    let mut done = 0usize;
    while done < piece.len {
        let n = (piece.len - done).min(max_io);
        push(
            batches,
            Op {
                remote_off: base + done as u64,
                buf_off: piece.buf_off + done,
                len: n,
            },
            max_io,
            max_verbs,
            limits.max_batch_bytes,
        );
        done += n;
    }
    Ok(())
}

/// Appends `op` to the last batch: merged into the last verb when it continues it both remotely
/// and in the buffer (and the result stays within `max_io`), else as a new verb, else in a new
/// batch when the last one is full.
fn push(
    batches: &mut Vec<PlannedBatch>,
    op: Op,
    max_io: usize,
    max_verbs: usize,
    max_batch_bytes: usize,
) {
    if let Some(batch) = batches.last_mut() {
        if batch.bytes + op.len <= max_batch_bytes {
            if let Some(last) = batch.ops.last_mut() {
                if last.remote_off + last.len as u64 == op.remote_off
                    && last.buf_off + last.len == op.buf_off
                    && last.len + op.len <= max_io
                {
                    last.len += op.len;
                    batch.bytes += op.len;
                    return;
                }
            }
            if batch.ops.len() < max_verbs {
                batch.ops.push(op);
                batch.bytes += op.len;
                return;
            }
        }
    }
    batches.push(PlannedBatch {
        ops: vec![op],
        bytes: op.len,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A write to a chunk of two replicas plans the same verbs on each replica's server: a
    /// 4 KiB write is one batch per server, so one round; a read plans one replica's.
    #[test]
    fn a_write_plans_every_replica_and_a_read_one() {
        let g = Geometry::new(64 << 10, 4096).unwrap();
        let replicas = proto::Replicas::new(&[
            ChunkLoc {
                server: 3,
                index: 16,
            },
            ChunkLoc {
                server: 1,
                index: 32,
            },
        ])
        .unwrap();
        // Within chunk 2 (bytes 8 KiB..16 KiB of the file).
        let write = plan(&g, 8192 + 100, 4096, |_| replicas, Limits::FABRIC).unwrap();
        assert_eq!(write.len(), 2);
        for sp in &write {
            assert_eq!(sp.batches.len(), 1, "one round");
            let at = replicas.on(sp.server).unwrap().index * 4096;
            assert_eq!(
                sp.batches[0].ops,
                vec![Op {
                    remote_off: at + 100,
                    buf_off: 0,
                    len: 4096
                }]
            );
        }
        let read = plan(
            &g,
            8192 + 100,
            4096,
            |_| Some(replicas.first()),
            Limits::FABRIC,
        )
        .unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].server, 3);
    }

    #[test]
    fn lock_ranges_round_outward() {
        let g = Geometry::new(1 << 20, 4096).unwrap();
        assert_eq!(g.lock_range(0, 1).unwrap(), 0..1);
        assert_eq!(g.lock_range(4095, 2).unwrap(), 0..2);
        assert_eq!(g.lock_range(4096, 4096).unwrap(), 1..2);
        assert_eq!(g.lock_range(4097, 4096).unwrap(), 1..3);
        assert!(g.lock_range(g.max_file_size() - 1, 2).is_err());
        assert!(g.lock_range(u64::MAX, 1).is_err());
        assert!(Geometry::new(3, 4096).is_err());
        assert!(Geometry::new(4096, 0).is_err());
    }

    #[test]
    fn contiguous_chunks_merge_and_big_ones_split() {
        let g = Geometry::new(16, 8).unwrap();
        let limits = Limits {
            max_io: 40,
            max_verbs: 2,
            max_batch_bytes: 1000,
        };
        // Chunks 0..8 all on server 0 at indices 10..18: one stream of 128 bytes; verbs merge
        // whole pieces up to 40 bytes (two 16-byte chunks each).
        let plans = plan(
            &g,
            0,
            128,
            |c| {
                Some(ChunkLoc {
                    server: 0,
                    index: 10 + c,
                })
            },
            limits,
        )
        .unwrap();
        assert_eq!(plans.len(), 1);
        let ops: Vec<Op> = plans[0]
            .batches
            .iter()
            .flat_map(|b| b.ops.clone())
            .collect();
        assert_eq!(
            ops.iter().map(|o| o.len).collect::<Vec<_>>(),
            [32, 32, 32, 32]
        );
        assert_eq!(ops[0].remote_off, 160);
        assert!(plans[0].batches.iter().all(|b| b.ops.len() <= 2));
    }

    #[test]
    fn holes_get_no_verbs() {
        let g = Geometry::new(16, 8).unwrap();
        let plans = plan(
            &g,
            8,
            40,
            |c| {
                (c % 2 == 0).then_some(ChunkLoc {
                    server: 1,
                    index: c,
                })
            },
            Limits::FABRIC,
        )
        .unwrap();
        let ops: Vec<Op> = plans[0].batches[0].ops.clone();
        // Bytes 8..16 (chunk 0) and 32..48 (chunk 2); chunk 1 is a hole.
        assert_eq!(
            ops,
            [
                Op {
                    remote_off: 8,
                    buf_off: 0,
                    len: 8
                },
                Op {
                    remote_off: 32,
                    buf_off: 24,
                    len: 16
                }
            ]
        );
    }

    #[test]
    fn overflowing_locations_are_refused() {
        let g = Geometry::new(1 << 20, 4096).unwrap();
        let r = plan(
            &g,
            0,
            10,
            |_| {
                Some(ChunkLoc {
                    server: 0,
                    index: u64::MAX / 2,
                })
            },
            Limits::FABRIC,
        );
        assert!(matches!(r, Err(FsError::Io(_))));
    }

    proptest! {
        /// Every byte of the range is moved by exactly one verb, to the address its chunk's
        /// location gives, and every verb and batch respects the limits.
        #[test]
        fn plans_cover_the_range_exactly(
            chunk_shift in 3u32..8,
            off in 0u64..2000,
            len in 0usize..3000,
            servers in 1u32..4,
            max_io in 1usize..100,
            max_verbs in 1usize..6,
            extra_batch in 0usize..200,
            hole_every in 0u64..5,
        ) {
            let g = Geometry::new(1 << chunk_shift, 8).unwrap();
            // A scattered but deterministic layout: consecutive chunks sometimes adjacent.
            let locate = |c: u64| {
                if hole_every > 0 && c % (hole_every + 1) == hole_every {
                    return None;
                }
                Some(ChunkLoc { server: (c / 2 % servers as u64) as u32, index: c * 3 / 2 })
            };
            let limits = Limits { max_io, max_verbs, max_batch_bytes: max_io + extra_batch };
            let plans = plan(&g, off, len, locate, limits).unwrap();
            let mut covered = vec![0u8; len];
            for sp in &plans {
                for batch in &sp.batches {
                    prop_assert!(!batch.ops.is_empty());
                    prop_assert!(batch.ops.len() <= max_verbs);
                    prop_assert!(batch.bytes <= limits.max_batch_bytes);
                    prop_assert_eq!(batch.bytes, batch.ops.iter().map(|o| o.len).sum::<usize>());
                    for op in &batch.ops {
                        prop_assert!(op.len >= 1 && op.len <= max_io);
                        for i in 0..op.len {
                            let b = op.buf_off + i;
                            let p = off + b as u64;
                            let (c, at) = g.layout.locate(p);
                            let loc = locate(c).expect("verb on a hole");
                            prop_assert_eq!(loc.server, sp.server);
                            prop_assert_eq!(
                                op.remote_off + i as u64,
                                loc.index * g.layout.unit() + at
                            );
                            covered[b] += 1;
                        }
                    }
                }
            }
            for (b, n) in covered.iter().enumerate() {
                let hole = locate(g.layout.locate(off + b as u64).0).is_none();
                prop_assert_eq!(*n, if hole { 0 } else { 1 }, "byte {}", b);
            }
        }

        /// Pieces tile the range in order, each inside one chunk.
        #[test]
        fn pieces_tile_the_range(chunk_shift in 0u32..18, off in 0u64..300_000, len in 0usize..300_000) {
            let g = Geometry::new(1 << chunk_shift, 1).unwrap();
            let mut next = 0usize;
            for p in g.pieces(off, len) {
                prop_assert_eq!(p.buf_off, next);
                prop_assert!(p.len > 0);
                prop_assert!(p.chunk_off + p.len as u64 <= g.layout.len(p.chunk));
                prop_assert_eq!(g.layout.start(p.chunk) + p.chunk_off, off + p.buf_off as u64);
                next += p.len;
            }
            prop_assert_eq!(next, len);
            let chunks = g.chunks(off, len as u64);
            prop_assert_eq!(chunks.end - chunks.start, g.pieces(off, len).count() as u64);
        }

        /// The lock range covers the byte range and no more than one unit on each side.
        #[test]
        fn lock_range_covers(unit_shift in 0u32..16, off in 0u64..1_000_000, len in 1u64..100_000) {
            let g = Geometry::new(1 << 20, 1 << unit_shift).unwrap();
            let r = g.lock_range(off, len).unwrap();
            let u = g.lock_unit;
            prop_assert!(r.start * u <= off && off < (r.start + 1) * u);
            prop_assert!(r.end * u >= off + len && (r.end - 1) * u < off + len);
        }
    }
}
