//! Where a file's chunks live: the per-inode cache of chunk locations, and the `ChunkMap` /
//! `AllocateChunks` calls that fill it.
//!
//! Invariants:
//! - A [`ChunkCache`] holds the locations of one file *generation* (the FCB's GENERATION, which
//!   a truncate or an unlink elsewhere moves on). A caller that read a newer generation empties
//!   it; one that read an older generation (it read the FCB before a truncate) bypasses it, and
//!   only a cache of the very generation a location was learnt for may keep it.
//! - Holes are never cached: another client may fill them at any time.
//! - A cache holds only locations learnt under the client's current chunk epoch (the id of the
//!   `view` that last changed, `Views::chunk_epoch`): a data server that came back with new memory makes the meta
//!   server answer `Lost` for its chunks, and a cache from before would not know.
//! - Every location is checked against the data server it names before it is used or cached
//!   (the server is known, the chunk is inside its region), so a bad answer of the meta server
//!   cannot make a verb touch memory outside a chunk.

use crate::error::Error;
use crate::meta::{unexpected, Meta};
use crate::plan::Geometry;
use crate::view::View;
use proto::rpc::{Request, Response};
use proto::{ChunkLoc, FsError, Ino};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock};

/// The chunk locations of one open file that this client knows (see the module docs).
pub(crate) struct ChunkCache {
    /// The file.
    ino: Ino,
    /// Its locations, of one file generation.
    known: RwLock<Known>,
}

impl ChunkCache {
    /// An empty cache of file `ino`, for its generation `generation`.
    pub(crate) fn new(ino: Ino, generation: u64) -> ChunkCache {
        ChunkCache {
            ino,
            known: RwLock::new(Known {
                generation,
                epoch: 0,
                map: HashMap::new(),
            }),
        }
    }
}

/// Chunk locations of one file generation (see the module docs).
struct Known {
    generation: u64,
    /// The chunk epoch (`Views::chunk_epoch`) the locations were learnt in.
    epoch: u64,
    map: HashMap<u64, ChunkLoc>,
}

impl Known {
    /// Empties the cache if it is of an older generation or chunk epoch than given, and says
    /// whether it may hold locations of `generation` learnt in `epoch` now.
    fn catch_up(&mut self, generation: u64, epoch: u64) -> bool {
        if self.generation < generation || self.epoch < epoch {
            self.generation = self.generation.max(generation);
            self.epoch = epoch;
            self.map.clear();
        }
        self.generation == generation && self.epoch == epoch
    }
}

/// Chunk locations for a run of chunks starting at `first`.
pub(crate) struct ChunkRun {
    pub(crate) first: u64,
    /// `locs[i]`: chunk `first + i` (`None`: a hole).
    pub(crate) locs: Vec<Option<ChunkLoc>>,
}

impl ChunkRun {
    /// Where chunk `chunk` lives (`None`: a hole, or outside the run).
    pub(crate) fn get(&self, chunk: u64) -> Option<ChunkLoc> {
        chunk
            .checked_sub(self.first)
            .and_then(|i| self.locs.get(i as usize).copied().flatten())
    }
}

/// Where the data path learns chunk locations: the meta connection that answers, the mount's
/// geometry, the chunk epoch caches must be of, and the view locations are checked against.
pub(crate) struct ChunkLocator<'a> {
    /// Answers `ChunkMap` and `AllocateChunks`.
    pub(crate) meta: &'a Meta,
    /// Chunk size and lock unit.
    pub(crate) geometry: &'a Geometry,
    /// `Views::chunk_epoch`.
    pub(crate) epoch: &'a AtomicU64,
    /// The view of the call: every location must name one of its data servers.
    pub(crate) view: &'a View,
}

impl ChunkLocator<'_> {
    /// Where chunks of bytes `[off, off + len)` live, for file generation `generation`:
    /// `result[i]` is chunk `first + i`'s location (None: a hole). With `allocate`, holes are
    /// allocated with one `AllocateChunks` for the whole missing run. When an allocation finds
    /// the file's layout changed under it, `fresh_generation` reads the generation the FCB has
    /// now, and the lookup starts over with it.
    pub(crate) fn locate(
        &self,
        file: &ChunkCache,
        mut generation: u64,
        off: u64,
        len: usize,
        allocate: bool,
        mut fresh_generation: impl FnMut() -> Result<u64, Error>,
    ) -> Result<ChunkRun, Error> {
        let chunks = self.geometry.chunks(off, len as u64);
        for _attempt in 0..3 {
            // Read before the call: a change during it leaves the answer uncached.
            let epoch = self.epoch.load(Ordering::SeqCst);
            let (mut locs, missing) = self.cached(file, generation, epoch, chunks.clone());
            let Some((a, b)) = missing else {
                return Ok(ChunkRun {
                    first: chunks.start,
                    locs,
                });
            };
            let request = if allocate {
                Request::AllocateChunks {
                    ino: file.ino,
                    generation,
                    first: a,
                    count: b - a + 1,
                }
            } else {
                Request::ChunkMap {
                    ino: file.ino,
                    first: a,
                    count: b - a + 1,
                }
            };
            let got = match self.meta.call(request) {
                Ok(Response::Chunks(got)) => got,
                Ok(other) => return Err(unexpected("ChunkMap/AllocateChunks", other)),
                Err(Error::Fs(FsError::Stale)) if allocate => {
                    // The file's layout changed under us (unlink elsewhere): start over with
                    // the generation the FCB has now.
                    generation = fresh_generation()?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if got.len() as u64 != b - a + 1 {
                return Err(Error::Protocol(format!(
                    "meta server returned {} chunk locations for {} chunks",
                    got.len(),
                    b - a + 1
                )));
            }
            let mut cache = file.known.write().unwrap_or_else(PoisonError::into_inner);
            // Only a cache of this very generation and epoch may learn these locations.
            let cacheable = cache.catch_up(generation, epoch);
            for (i, loc) in got.into_iter().enumerate() {
                let c = a + i as u64;
                let Some(loc) = loc else {
                    if allocate {
                        return Err(Error::Protocol(format!(
                            "meta server allocated no chunk {c} of inode {}",
                            file.ino
                        )));
                    }
                    continue;
                };
                check_loc(self.view, self.geometry, c, loc)?;
                if cacheable {
                    cache.map.insert(c, loc);
                }
                if (chunks.start..chunks.end).contains(&c) {
                    locs[(c - chunks.start) as usize] = Some(loc);
                }
            }
            return Ok(ChunkRun {
                first: chunks.start,
                locs,
            });
        }
        Err(Error::GenerationChurn { ino: file.ino })
    }

    /// The cached locations of `chunks` for `generation` (`None` where not cached), and the
    /// first and last chunk missing. A newer generation empties the cache; an older one (a
    /// caller that read the FCB before a truncate) bypasses it.
    fn cached(
        &self,
        file: &ChunkCache,
        generation: u64,
        epoch: u64,
        chunks: Range<u64>,
    ) -> (Vec<Option<ChunkLoc>>, Option<(u64, u64)>) {
        let lookup = |cache: &Known| {
            let mut missing: Option<(u64, u64)> = None;
            let locs = chunks
                .clone()
                .map(|c| {
                    let loc = if cache.generation == generation && cache.epoch == epoch {
                        cache.map.get(&c).copied()
                    } else {
                        None
                    };
                    if loc.is_none() {
                        missing = Some(missing.map_or((c, c), |(a, _)| (a, c)));
                    }
                    loc
                })
                .collect();
            (locs, missing)
        };
        {
            let cache = file.known.read().unwrap_or_else(PoisonError::into_inner);
            if cache.generation >= generation && cache.epoch >= epoch {
                return lookup(&cache);
            }
        }
        let mut cache = file.known.write().unwrap_or_else(PoisonError::into_inner);
        cache.catch_up(generation, epoch);
        lookup(&cache)
    }
}

/// Checks that chunk `chunk` of a file, at `loc`, lies inside a data server `view` knows.
fn check_loc(view: &View, geometry: &Geometry, chunk: u64, loc: ChunkLoc) -> Result<(), Error> {
    let Some(ds) = view.servers.data(loc.server) else {
        return Err(Error::UnknownDataServer(loc.server));
    };
    let region = ds.info.chunks.saturating_mul(geometry.chunk_size);
    match geometry.region_range(chunk, loc) {
        Some(r) if r.end <= region => Ok(()),
        _ => Err(Error::Protocol(format!(
            "chunk {chunk} at unit {} is beyond data server {}'s {region} bytes",
            loc.index, loc.server
        ))),
    }
}
