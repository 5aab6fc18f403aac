//! Re-replication's transactions (docs/REPLICAS.md, `crate::rereplicate`): which chunks have
//! fewer live replicas than their file's factor, placing one more replica of such a chunk,
//! and committing it (or giving it back) once its bytes were copied.
//!
//! # A replica being filled is marked lost
//! The new replica enters the chunk's set at once ([`Store::add_replica`]), so that its block
//! is accounted for like every other (the file is charged for it, freeing the file frees it,
//! `citronfs fsck` sees it as the chunk's), but marked in `lost` until its bytes are copied:
//! chunk maps leave lost replicas out ([`Store::chunk_map`]), so no client reads it nor writes
//! it meanwhile, and the checker counts the chunk under-replicated still. The commit
//! ([`Store::commit_replica`]) clears the mark and drops the chunk's replicas that are not
//! live, bumping the file's generation; giving it back ([`Store::abandon_replica`]) frees the
//! block. A crash between leaves a lost replica beside live ones: an under-replicated chunk,
//! which the next pass re-replicates (dropping the lost replica).

use super::space::zone_order;
use super::*;
use std::collections::{HashMap, HashSet};

/// A chunk with fewer live replicas than its file's factor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Short {
    /// The file.
    pub ino: Ino,
    /// The chunk's index in the file.
    pub chunk: u64,
    /// Every replica in its set, live or not.
    pub replicas: Replicas,
    /// How many of them are live.
    pub live: usize,
    /// The file's replication factor.
    pub factor: usize,
}

/// A replica placed by [`Store::add_replica`], to be filled from `source` and then committed
/// ([`Store::commit_replica`]) or given back ([`Store::abandon_replica`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    /// The file.
    pub ino: Ino,
    /// The chunk's index in the file.
    pub chunk: u64,
    /// The new replica's block (marked lost until committed).
    pub loc: ChunkLoc,
    /// The live replica its bytes are copied from.
    pub source: ChunkLoc,
    /// Replicas the placement dropped from the set (not live: lost, or on a server that is
    /// away, where the set had no room for one more), to be zeroed and recycled.
    pub freed: Vec<Block>,
    /// The file's attributes after the placement when it dropped a replica a client may have
    /// cached (one on a server that is away): its generation was bumped, to be published.
    pub bumped: Option<Attr>,
}

impl Tx<'_> {
    /// Whether the block at `loc` is marked lost.
    fn is_lost(&self, loc: ChunkLoc) -> TxResult<bool> {
        Ok(self
            .t(T_LOST)
            .get(key_server(loc.server, loc.index))?
            .is_some())
    }

    /// Takes replica `loc` of chunk `chunk` out of use: dirty (to be zeroed whole before
    /// reuse), its lost mark and tail record gone. The caller rewrites the set.
    fn drop_replica(&self, chunk: u64, loc: ChunkLoc) -> TxResult<Block> {
        let key = key_server(loc.server, loc.index);
        self.t(T_LOST).remove(key)?;
        self.t(T_TAILS).remove(key)?;
        let order = self.1.order(chunk);
        self.t(T_DIRTY).insert(key, &[order as u8])?;
        Ok(Block { loc, order })
    }

    /// Writes chunk `chunk` of `ino`'s set as `locs` (not empty).
    fn put_set(&self, ino: Ino, chunk: u64, locs: &[ChunkLoc]) -> TxResult<()> {
        let set = lift(Replicas::new(locs).map_err(|e| corrupt(&e.to_string())))?;
        self.t(T_CHUNKS)
            .insert(key_u64s(ino, chunk), encode_replicas(&set))?;
        Ok(())
    }

    /// Chunk `chunk` of `ino`'s set, if allocated.
    fn chunk_set(&self, ino: Ino, chunk: u64) -> TxResult<Option<Replicas>> {
        match self.t(T_CHUNKS).get(key_u64s(ino, chunk))? {
            Some(v) => Ok(Some(lift(decode_replicas(&v))?)),
            None => Ok(None),
        }
    }
}

impl Store {
    /// Every chunk of a file with fewer live replicas than the file's factor
    /// ([`Store::replicas_of`] with `default`), those with no live replica left (nothing to
    /// copy from: lost, or every server away) included. A replica is live when its server is in `live` and it
    /// is not marked lost.
    pub fn under_replicated(
        &self,
        live: &HashSet<u32>,
        default: usize,
    ) -> Result<Vec<Short>, FsError> {
        let mut factors: HashMap<Ino, usize> = HashMap::new();
        let mut out = Vec::new();
        for item in self.tree(T_CHUNKS).iter() {
            let (k, v) = item.map_err(db_err)?;
            let (ino, chunk) = decode_u64_pair(&k)?;
            let replicas = decode_replicas(&v)?;
            let factor = match factors.get(&ino) {
                Some(&f) => f,
                None => *factors
                    .entry(ino)
                    .or_insert(self.replicas_of(ino, default)?),
            };
            let mut alive = 0;
            for loc in replicas.as_slice() {
                if live.contains(&loc.server) && !self.is_lost(*loc)? {
                    alive += 1;
                }
            }
            if alive < factor {
                out.push(Short {
                    ino,
                    chunk,
                    replicas,
                    live: alive,
                    factor,
                });
            }
        }
        Ok(out)
    }

    /// Whether the block at `loc` is marked lost.
    fn is_lost(&self, loc: ChunkLoc) -> Result<bool, FsError> {
        self.tree(T_LOST)
            .contains_key(key_server(loc.server, loc.index))
            .map_err(db_err)
    }

    /// Places one more replica of chunk `chunk` of `ino`, whose set must still be `expect`
    /// (else `None`: it changed since it was found short), on a live server (`live`, by id)
    /// that holds no live replica of it: the servers are walked in zone order
    /// ([`zone_order`]) from `(ino + chunk) % n`, as [`Store::allocate_chunks`] walks them,
    /// and a server in a zone none of the chunk's live replicas is in is preferred. A
    /// non-live replica on the chosen server, and as many non-live ones as the set needs to
    /// make room ([`MAX_REPLICAS`]), are dropped. `None` too when the chunk has no live
    /// replica to copy from, or as many live replicas as `live` has servers. `NoSpace` when
    /// no candidate has a free block of the chunk's order.
    ///
    /// The new replica is marked lost until [`Store::commit_replica`] (see the module docs).
    pub fn add_replica(
        &self,
        ino: Ino,
        chunk: u64,
        expect: &Replicas,
        live: &[u32],
    ) -> Result<Option<Pending>, FsError> {
        let zones = self.zones_of(live)?;
        let order = zone_order(live, zones);
        self.tx(|tx| {
            let Some(set) = tx.chunk_set(ino, chunk)? else {
                return Ok(None);
            };
            if set != *expect {
                return Ok(None);
            }
            let mut alive = Vec::new();
            for &loc in set.as_slice() {
                if live.contains(&loc.server) && !tx.is_lost(loc)? {
                    alive.push(loc);
                }
            }
            let Some(&source) = alive.first() else {
                return Ok(None);
            };
            let used_zones: Vec<&ZoneKey> = order
                .iter()
                .filter(|(id, _)| alive.iter().any(|l| l.server == *id))
                .map(|(_, z)| z)
                .collect();
            let candidates: Vec<&(u32, ZoneKey)> = order
                .iter()
                .filter(|(id, _)| !alive.iter().any(|l| l.server == *id))
                .collect();
            if candidates.is_empty() {
                return Ok(None);
            }
            let n = candidates.len();
            let start = (ino.wrapping_add(chunk) % n as u64) as usize;
            let mut placed = None;
            'passes: for new_zones_only in [true, false] {
                for k in 0..n {
                    let (id, zone) = candidates[(start + k) % n];
                    if new_zones_only && used_zones.contains(&zone) {
                        continue;
                    }
                    if let Some(index) = tx.take_block(*id, tx.1.order(chunk))? {
                        placed = Some(ChunkLoc { server: *id, index });
                        break 'passes;
                    }
                }
            }
            let Some(loc) = placed else {
                return abort(FsError::NoSpace);
            };
            // The set: the live replicas first, then the others (minus one on the chosen
            // server), then the new one; non-live ones dropped from the end for room.
            let mut others: Vec<ChunkLoc> = set
                .as_slice()
                .iter()
                .copied()
                .filter(|l| !alive.contains(l))
                .collect();
            let mut freed = Vec::new();
            let mut visible_dropped = false;
            let mut discard = |tx: &Tx, l: ChunkLoc, freed: &mut Vec<Block>| -> TxResult<()> {
                // A replica on a server that is away is in chunk maps clients may have
                // cached (a lost one is not).
                if !tx.is_lost(l)? {
                    visible_dropped = true;
                }
                freed.push(tx.drop_replica(chunk, l)?);
                Ok(())
            };
            if let Some(i) = others.iter().position(|l| l.server == loc.server) {
                let l = others.remove(i);
                discard(tx, l, &mut freed)?;
            }
            while alive.len() + others.len() + 1 > MAX_REPLICAS {
                let Some(l) = others.pop() else { break };
                discard(tx, l, &mut freed)?;
            }
            let mut locs = alive.clone();
            locs.extend(&others);
            locs.push(loc);
            tx.put_set(ino, chunk, &locs)?;
            tx.t(T_LOST)
                .insert(key_server(loc.server, loc.index), &key_u64s(ino, chunk))?;
            let mut attr = tx.inode(ino)?;
            let len = tx.1.len(chunk);
            attr.allocated = (attr.allocated + len).saturating_sub(len * freed.len() as u64);
            let bumped = visible_dropped.then(|| {
                attr.generation += 1;
                attr.clone()
            });
            tx.put_inode(&attr)?;
            Ok(Some(Pending {
                ino,
                chunk,
                loc,
                source,
                freed,
                bumped,
            }))
        })
    }

    /// Commits replica `p` (its bytes copied from `p.source`): its lost mark goes, and every
    /// replica of the chunk that is not live now (its server not in `live`, or marked lost)
    /// leaves the set, freed; the file's generation is bumped, so that a client's cached
    /// chunk map is dropped at its next I/O. Returns the file's attributes (to publish the
    /// generation) and the blocks freed; `None` when `p` is no longer what it was (the chunk
    /// was freed or its set rewritten, the new replica or the source marked lost: a server
    /// came back with new memory), and nothing changes.
    pub fn commit_replica(
        &self,
        p: &Pending,
        live: &HashSet<u32>,
    ) -> Result<Option<(Attr, Vec<Block>)>, FsError> {
        self.tx(|tx| {
            let Some(set) = tx.chunk_set(p.ino, p.chunk)? else {
                return Ok(None);
            };
            let pending_mark = tx.t(T_LOST).get(key_server(p.loc.server, p.loc.index))?;
            let still_pending = pending_mark
                .as_deref()
                .is_some_and(|v| v == key_u64s(p.ino, p.chunk).as_slice());
            if set.on(p.loc.server) != Some(p.loc)
                || set.on(p.source.server) != Some(p.source)
                || !still_pending
                || tx.is_lost(p.source)?
                || !live.contains(&p.loc.server)
                || !live.contains(&p.source.server)
            {
                return Ok(None);
            }
            tx.t(T_LOST).remove(key_server(p.loc.server, p.loc.index))?;
            let mut keep = Vec::new();
            let mut freed = Vec::new();
            for &l in set.as_slice() {
                if live.contains(&l.server) && !tx.is_lost(l)? {
                    keep.push(l);
                } else {
                    freed.push(tx.drop_replica(p.chunk, l)?);
                }
            }
            tx.put_set(p.ino, p.chunk, &keep)?;
            let mut attr = tx.inode(p.ino)?;
            attr.allocated = attr
                .allocated
                .saturating_sub(tx.1.len(p.chunk) * freed.len() as u64);
            attr.generation += 1;
            tx.put_inode(&attr)?;
            Ok(Some((attr, freed)))
        })
    }

    /// Gives back replica `p` (its copy failed): it leaves the set, freed, if it is still
    /// there and still being filled; the blocks freed.
    pub fn abandon_replica(&self, p: &Pending) -> Result<Vec<Block>, FsError> {
        self.tx(|tx| {
            let Some(set) = tx.chunk_set(p.ino, p.chunk)? else {
                return Ok(Vec::new());
            };
            let mark = tx.t(T_LOST).get(key_server(p.loc.server, p.loc.index))?;
            let ours = mark
                .as_deref()
                .is_some_and(|v| v == key_u64s(p.ino, p.chunk).as_slice());
            if set.on(p.loc.server) != Some(p.loc) || !ours {
                return Ok(Vec::new());
            }
            let keep: Vec<ChunkLoc> = set
                .as_slice()
                .iter()
                .copied()
                .filter(|&l| l != p.loc)
                .collect();
            let freed = vec![tx.drop_replica(p.chunk, p.loc)?];
            if keep.is_empty() {
                tx.t(T_CHUNKS).remove(key_u64s(p.ino, p.chunk))?;
            } else {
                tx.put_set(p.ino, p.chunk, &keep)?;
            }
            let mut attr = tx.inode(p.ino)?;
            attr.allocated = attr.allocated.saturating_sub(tx.1.len(p.chunk));
            tx.put_inode(&attr)?;
            Ok(freed)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsck::{check, Live};

    const ME: Caller = Caller { uid: 0, gid: 0 };

    /// A store of 64 KiB chunks with a data server per zone of `zones` (`None`: none named),
    /// ids in that order.
    fn store_in_zones(dir: &Path, zones: &[Option<&str>]) -> Store {
        let store = Store::open(dir, 64 << 10, ME).unwrap();
        let addr: FabricAddr = "tcp:127.0.0.1:1".parse().unwrap();
        for (i, zone) in zones.iter().enumerate() {
            store
                .register_server_in_zone(
                    &format!("ds-{i}"),
                    &addr,
                    fabric::RegionId(1),
                    64,
                    1,
                    *zone,
                )
                .unwrap();
        }
        store
    }

    /// A file `name` of `chunks` chunks of `replicas` replicas over `servers`.
    fn file(store: &Store, name: &str, chunks: u64, servers: &[u32], replicas: usize) -> Ino {
        let f = store
            .mknod(ROOT_INO, name, FileKind::File, 0o644, 0, ME)
            .unwrap();
        store
            .persist_size(f.ino, store.layout().start(chunks))
            .unwrap();
        store
            .allocate_chunks(f.ino, f.generation, 0, chunks, servers, replicas)
            .unwrap();
        f.ino
    }

    /// What the consistency checker finds in `store` (nothing open).
    fn findings(store: &Store) -> Vec<proto::fsck::Finding> {
        check(&store.image().unwrap(), &Live::default(), store.layout()).0
    }

    fn set(store: &Store, ino: Ino, chunk: u64) -> Vec<ChunkLoc> {
        store
            .chunk_at(ino, chunk)
            .unwrap()
            .unwrap()
            .as_slice()
            .to_vec()
    }

    /// Four servers in zones a, a, b, b, every chunk with a replica in each zone; a server of
    /// zone b dies: its chunks are short, and each new replica goes to the other server of
    /// zone b, unseen by chunk maps until committed; the commit drops the dead replica (freed,
    /// charged no more) and bumps the generation; the checker finds nothing wrong throughout.
    #[test]
    fn a_new_replica_goes_to_the_zone_the_chunk_lost_and_replaces_the_dead_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in_zones(dir.path(), &[Some("a"), Some("a"), Some("b"), Some("b")]);
        let f = file(&store, "f", 4, &[0, 1, 2, 3], 2);
        let before = store.getattr(f).unwrap();
        let all: HashSet<u32> = [0, 1, 2, 3].into();
        assert_eq!(store.under_replicated(&all, 2).unwrap(), Vec::new());
        // Server 2 (zone b) dies.
        let live: HashSet<u32> = [0, 1, 3].into();
        let short = store.under_replicated(&live, 2).unwrap();
        let hit: Vec<u64> = (0..4)
            .filter(|&c| set(&store, f, c).iter().any(|l| l.server == 2))
            .collect();
        assert!(!hit.is_empty());
        assert_eq!(short.iter().map(|s| s.chunk).collect::<Vec<_>>(), hit);
        for s in &short {
            assert_eq!((s.ino, s.live, s.factor), (f, 1, 2));
            let p = store
                .add_replica(f, s.chunk, &s.replicas, &[0, 1, 3])
                .unwrap()
                .expect("placed");
            assert_eq!(
                p.loc.server, 3,
                "the live server of the zone the chunk lost"
            );
            assert_ne!(p.source.server, 2);
            assert!(p.freed.is_empty() && p.bumped.is_none());
            // Not in the chunk map until committed; charged, and consistent.
            let map = store.chunk_map(f, s.chunk, 1).unwrap()[0].unwrap();
            assert!(map.on(3).is_none(), "{map:?}");
            assert_eq!(findings(&store), Vec::new());
            let (attr, freed) = store.commit_replica(&p, &live).unwrap().expect("committed");
            assert_eq!(freed.len(), 1);
            assert_eq!(freed[0].loc.server, 2);
            assert!(attr.generation > before.generation);
            let now = set(&store, f, s.chunk);
            assert_eq!(now, vec![p.source, p.loc]);
            assert_eq!(
                store.chunk_map(f, s.chunk, 1).unwrap()[0]
                    .unwrap()
                    .as_slice(),
                now
            );
        }
        assert_eq!(store.getattr(f).unwrap().allocated, before.allocated);
        assert_eq!(store.under_replicated(&live, 2).unwrap(), Vec::new());
        assert_eq!(findings(&store), Vec::new());
    }

    /// A server back with new memory holds lost replicas: the new replica may go back to it
    /// (the only other server), the lost block dropped in the same transaction.
    #[test]
    fn a_lost_replica_is_replaced_on_its_own_server() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in_zones(dir.path(), &[None, None]);
        let f = file(&store, "f", 3, &[0, 1], 2);
        let addr: FabricAddr = "tcp:127.0.0.1:1".parse().unwrap();
        let (_, lost) = store
            .register_server("ds-1", &addr, fabric::RegionId(1), 64, 2)
            .unwrap();
        assert_eq!(lost, 3);
        let live: HashSet<u32> = [0, 1].into();
        let short = store.under_replicated(&live, 2).unwrap();
        assert_eq!(short.len(), 3);
        for s in short {
            let old = s.replicas.on(1).unwrap();
            let p = store
                .add_replica(f, s.chunk, &s.replicas, &[0, 1])
                .unwrap()
                .expect("placed");
            assert_eq!(p.loc.server, 1);
            assert_eq!(p.freed.iter().map(|b| b.loc).collect::<Vec<_>>(), vec![old]);
            assert!(p.bumped.is_none(), "a lost replica is in no client's map");
            store.commit_replica(&p, &live).unwrap().expect("committed");
            assert_eq!(set(&store, f, s.chunk), vec![p.source, p.loc]);
        }
        assert!(store.lost_chunks().unwrap().is_empty());
        assert_eq!(store.under_replicated(&live, 2).unwrap(), Vec::new());
        assert_eq!(findings(&store), Vec::new());
    }

    /// A placement given back leaves the chunk as it was (the block freed, the charge
    /// undone); a set that changed since it was found short is not touched; a commit after
    /// the file was freed does nothing; a chunk with no live replica or no server to go to is
    /// not placed.
    #[test]
    fn abandoned_and_stale_placements_leave_the_chunk_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in_zones(dir.path(), &[None, None, None]);
        let f = file(&store, "f", 2, &[0, 1, 2], 2);
        let before = store.getattr(f).unwrap();
        let original = store.chunk_at(f, 0).unwrap().unwrap();
        let dead = original.as_slice()[1].server;
        let live: Vec<u32> = (0..3).filter(|&s| s != dead).collect();
        let p = store.add_replica(f, 0, &original, &live).unwrap().unwrap();
        assert_eq!(
            store.getattr(f).unwrap().allocated,
            before.allocated + store.layout().len(0)
        );
        let freed = store.abandon_replica(&p).unwrap();
        assert_eq!(freed.iter().map(|b| b.loc).collect::<Vec<_>>(), vec![p.loc]);
        assert_eq!(store.chunk_at(f, 0).unwrap().unwrap(), original);
        assert_eq!(store.getattr(f).unwrap().allocated, before.allocated);
        assert_eq!(findings(&store), Vec::new());
        // Found short with another set: left alone.
        let other = Replicas::one(original.first());
        assert_eq!(store.add_replica(f, 0, &other, &live).unwrap(), None);
        // No live replica to copy from, or every live server holds one already.
        assert_eq!(store.add_replica(f, 0, &original, &[dead]).unwrap(), None);
        assert_eq!(
            store
                .add_replica(f, 0, &original, &[original.first().server])
                .unwrap(),
            None
        );
        // The file freed under a placement: the commit does nothing.
        let p = store.add_replica(f, 0, &original, &live).unwrap().unwrap();
        store.unlink(ROOT_INO, "f", |_| false).unwrap();
        let live: HashSet<u32> = live.into_iter().collect();
        assert_eq!(store.commit_replica(&p, &live).unwrap(), None);
        assert_eq!(store.abandon_replica(&p).unwrap(), Vec::new());
        assert_eq!(findings(&store), Vec::new());
    }
}
