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
//!   cannot make a verb touch memory outside a chunk. A chunk's locations are its replicas
//!   ([`Replicas`], docs/REPLICAS.md): writes go to each, reads to one ([`ChunkRun::read_from`]).

use crate::error::Error;
use crate::meta::{unexpected, Meta};
use crate::plan::Geometry;
use crate::view::View;
use proto::rpc::{Request, Response};
use proto::{ChunkLoc, FsError, Ino, Replicas};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

/// Tries of an allocation whose file generation moved ([`ChunkLocator::locate`]) before
/// [`GENERATION_CHURN_PATIENCE`] counts.
const MIN_ALLOCATE_TRIES: usize = 3;

/// How long an allocation goes on trying while the file's generation keeps moving (a
/// re-replication pass over the file commits a chunk every few milliseconds) before it fails
/// with `GenerationChurn`: half the default lock lease, which the write holds meanwhile.
const GENERATION_CHURN_PATIENCE: Duration = Duration::from_secs(1);

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
    map: HashMap<u64, Replicas>,
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
    /// `locs[i]`: chunk `first + i`'s replicas (`None`: a hole).
    pub(crate) locs: Vec<Option<Replicas>>,
}

impl ChunkRun {
    /// Where chunk `chunk`'s replicas live (`None`: a hole, or outside the run).
    pub(crate) fn get(&self, chunk: u64) -> Option<Replicas> {
        chunk
            .checked_sub(self.first)
            .and_then(|i| self.locs.get(i as usize).copied().flatten())
    }

    /// The replica of chunk `chunk` a read takes (`Ok(None)`: a hole): the only one; else,
    /// among those not on a server in `avoid` (servers this read already failed on), those
    /// whose server `live` says is registered, one picked by `spread` (the client's session)
    /// so that clients share the load, and the same client keeps to the same one; else any not
    /// avoided. `Err(())` when every replica is on a server to avoid.
    pub(crate) fn read_from(
        &self,
        chunk: u64,
        spread: u64,
        avoid: &[u32],
        live: impl Fn(u32) -> bool,
    ) -> Result<Option<ChunkLoc>, ()> {
        let Some(replicas) = self.get(chunk) else {
            return Ok(None);
        };
        let all = replicas.as_slice();
        if all.len() == 1 && avoid.is_empty() {
            return Ok(Some(all[0]));
        }
        let usable = |l: &&ChunkLoc| !avoid.contains(&l.server);
        let live_count = all.iter().filter(usable).filter(|l| live(l.server)).count();
        let pick = |n: usize| (chunk.wrapping_add(spread) % n as u64) as usize;
        if live_count > 0 {
            return Ok(all
                .iter()
                .filter(usable)
                .filter(|l| live(l.server))
                .nth(pick(live_count))
                .copied());
        }
        all.iter().find(usable).copied().map(Some).ok_or(())
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
        // An allocation answered `Stale` is tried again with the generation the FCB has now.
        // The generation moves at truncates and unlinks elsewhere, and at every change of a
        // chunk's replicas (a dead server's replicas dropped, a re-replicated chunk
        // committed), which a re-replication pass makes one chunk after another, milliseconds
        // apart: so a few tries are not enough while one runs, and the tries go on for a
        // while instead (each costs two round trips; the lease check before the data verbs
        // still bounds the write).
        let started = std::time::Instant::now();
        for attempt in 0.. {
            if attempt >= MIN_ALLOCATE_TRIES && started.elapsed() > GENERATION_CHURN_PATIENCE {
                break;
            }
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
            for (i, replicas) in got.into_iter().enumerate() {
                let c = a + i as u64;
                let Some(replicas) = replicas else {
                    if allocate {
                        return Err(Error::Protocol(format!(
                            "meta server allocated no chunk {c} of inode {}",
                            file.ino
                        )));
                    }
                    continue;
                };
                for &loc in replicas.as_slice() {
                    check_loc(self.view, self.geometry, c, loc)?;
                }
                if cacheable {
                    cache.map.insert(c, replicas);
                }
                if (chunks.start..chunks.end).contains(&c) {
                    locs[(c - chunks.start) as usize] = Some(replicas);
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
    ) -> (Vec<Option<Replicas>>, Option<(u64, u64)>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(server: u32) -> ChunkLoc {
        ChunkLoc {
            server,
            index: u64::from(server) * 10,
        }
    }

    /// A read takes a live replica, spread over them by chunk and session, skips servers it
    /// failed on, falls back to one the view calls away when no other is left, and gives up
    /// only when every replica is on a server it failed on.
    #[test]
    fn a_read_picks_a_live_replica_not_failed_on() {
        let run = ChunkRun {
            first: 4,
            locs: vec![
                Some(Replicas::new(&[loc(0), loc(1)]).unwrap()),
                Some(Replicas::one(loc(2))),
                None,
            ],
        };
        let all = |_: u32| true;
        assert_eq!(run.read_from(6, 0, &[], all), Ok(None), "a hole");
        assert_eq!(run.read_from(5, 9, &[], all), Ok(Some(loc(2))));
        assert_eq!(run.read_from(5, 9, &[2], all), Err(()));
        // Spread: the session moves the choice.
        let a = run.read_from(4, 0, &[], all).unwrap().unwrap();
        let b = run.read_from(4, 1, &[], all).unwrap().unwrap();
        assert_ne!(a.server, b.server);
        for spread in 0..4 {
            assert_eq!(run.read_from(4, spread, &[0], all), Ok(Some(loc(1))));
            assert_eq!(run.read_from(4, spread, &[], |s| s != 1), Ok(Some(loc(0))));
            // Both away in the view: the first not failed on.
            assert_eq!(run.read_from(4, spread, &[0], |_| false), Ok(Some(loc(1))));
        }
        assert_eq!(run.read_from(4, 0, &[1, 0], all), Err(()));
    }
}
