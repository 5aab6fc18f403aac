//! Space: the chunk maps of files and the data servers' blocks — the buddy allocator's
//! free stacks, the dirty set, tails to zero, scrubs and lost chunks (see "Space" in the
//! module docs of [`super`]).

use super::*;

impl Tx<'_> {
    pub(super) fn server(&self, id: u32) -> TxResult<ServerRecord> {
        match self.t(T_SERVERS).get(id.to_be_bytes())? {
            Some(v) => lift(ServerRecord::decode(&v)),
            None => abort(corrupt(&format!("data server {id} has no record"))),
        }
    }

    pub(super) fn put_server(&self, rec: &ServerRecord) -> TxResult<()> {
        self.t(T_SERVERS).insert(rec.id.to_be_bytes(), enc(rec))?;
        Ok(())
    }

    /// Server `id`'s record, checked to have a free stack per order of the layout.
    pub(super) fn allocator(&self, id: u32) -> TxResult<ServerRecord> {
        let rec = self.server(id)?;
        if rec.free_counts.len() != self.1.max_order() as usize + 1 {
            return abort(corrupt(&format!(
                "data server {id} has {} free stacks for {} orders",
                rec.free_counts.len(),
                self.1.max_order() + 1
            )));
        }
        Ok(rec)
    }

    /// Pushes the zeroed free block at unit offset `at` onto its order's stack.
    pub(super) fn push_free(&self, rec: &mut ServerRecord, at: u64, order: u32) -> TxResult<()> {
        let slot = rec.free_counts[order as usize];
        self.t(T_FREE)
            .insert(free_key(rec.id, order, slot), &be64(at))?;
        self.t(T_FREEIDX)
            .insert(key_server(rec.id, at), &encode_slot(order, slot))?;
        rec.free_counts[order as usize] += 1;
        Ok(())
    }

    /// Takes the block in `slot` of `order`'s stack out (the top entry moves into its slot);
    /// returns its unit offset.
    pub(super) fn unlink_free(
        &self,
        rec: &mut ServerRecord,
        order: u32,
        slot: u64,
    ) -> TxResult<u64> {
        let o = order as usize;
        let Some(last) = rec.free_counts[o].checked_sub(1) else {
            return abort(corrupt("a free stack is empty"));
        };
        let Some(at) = self.t(T_FREE).remove(free_key(rec.id, order, slot))? else {
            return abort(corrupt("a free stack has a hole"));
        };
        let at = lift(decode_u64(&at))?;
        if slot != last {
            let Some(moved) = self.t(T_FREE).remove(free_key(rec.id, order, last))? else {
                return abort(corrupt("a free stack has a hole"));
            };
            self.t(T_FREE)
                .insert(free_key(rec.id, order, slot), moved.clone())?;
            let moved = lift(decode_u64(&moved))?;
            self.t(T_FREEIDX)
                .insert(key_server(rec.id, moved), &encode_slot(order, slot))?;
        }
        self.t(T_FREEIDX).remove(key_server(rec.id, at))?;
        rec.free_counts[o] = last;
        Ok(at)
    }

    /// Takes a zeroed block of `order` from server `id`, if it has room: the smallest free
    /// block of at least that order, else a never-used chunk-size block, split down to `order`
    /// (the upper halves go free). Returns its unit offset.
    pub(super) fn take_block(&self, id: u32, order: u32) -> TxResult<Option<u64>> {
        let mut rec = self.allocator(id)?;
        let max = self.1.max_order();
        let found = (order..=max).find(|&p| rec.free_counts[p as usize] > 0);
        let (at, mut p) = match found {
            Some(p) => {
                let top = rec.free_counts[p as usize] - 1;
                (self.unlink_free(&mut rec, p, top)?, p)
            }
            None if rec.next_fresh < rec.chunks => {
                rec.next_fresh += 1;
                ((rec.next_fresh - 1) << max, max)
            }
            None => return Ok(None),
        };
        while p > order {
            p -= 1;
            self.push_free(&mut rec, at + Layout::units_of(p), p)?;
        }
        self.put_server(&rec)?;
        Ok(Some(at))
    }

    /// Gives back a zeroed block: merged with its buddy while the buddy is free at the same
    /// order, then pushed onto its order's stack.
    pub(super) fn release_block(&self, block: Block) -> TxResult<()> {
        let mut rec = self.allocator(block.loc.server)?;
        let (mut at, mut order) = (block.loc.index, block.order);
        while order < self.1.max_order() {
            let buddy = at ^ Layout::units_of(order);
            let Some(v) = self.t(T_FREEIDX).get(key_server(rec.id, buddy))? else {
                break;
            };
            let (buddy_order, slot) = lift(decode_slot(&v))?;
            if buddy_order != order {
                break;
            }
            self.unlink_free(&mut rec, order, slot)?;
            at = at.min(buddy);
            order += 1;
        }
        self.push_free(&mut rec, at, order)?;
        self.put_server(&rec)
    }

    /// Frees the chunks of `ino` listed in `chunks` (keys and locations, scanned by the caller):
    /// they leave the chunk map and become dirty (to be zeroed before reuse). Returns their
    /// bytes, which the caller takes off the inode's `allocated` (it holds the inode).
    pub(super) fn free_chunks(&self, ino: Ino, chunks: &[(u64, ChunkLoc)]) -> TxResult<u64> {
        for (index, loc) in chunks {
            self.t(T_CHUNKS).remove(key_u64s(ino, *index))?;
            // A lost chunk freed is an ordinary dirty chunk of the server's new memory; a dirty
            // chunk is zeroed whole, tail included.
            self.t(T_LOST).remove(key_server(loc.server, loc.index))?;
            self.t(T_TAILS).remove(key_server(loc.server, loc.index))?;
            self.t(T_DIRTY).insert(
                key_server(loc.server, loc.index),
                &[self.1.order(*index) as u8],
            )?;
        }
        Ok(self.1.held(chunks.iter().map(|(index, _)| *index)))
    }

    /// The blocks of a file's chunks (index in the file, location).
    pub(super) fn blocks(&self, chunks: &[(u64, ChunkLoc)]) -> Vec<Block> {
        chunks
            .iter()
            .map(|&(k, loc)| Block {
                loc,
                order: self.1.order(k),
            })
            .collect()
    }
}

impl Store {
    /// Where chunks `first..first+count` of `ino` live: the replicas of each that hold its
    /// data (a replica whose server came back with new memory is left out); `Lost` when
    /// every replica of one of them is lost.
    pub fn chunk_map(
        &self,
        ino: Ino,
        first: u64,
        count: u64,
    ) -> Result<Vec<Option<Replicas>>, FsError> {
        check_chunk_range(first, count)?;
        self.getattr(ino)?;
        let mut out = vec![None; count as usize];
        let start = key_u64s(ino, first);
        let end = key_u64s(ino, first + count);
        for item in self.tree(T_CHUNKS).range(start..end) {
            let (k, v) = item.map_err(db_err)?;
            let index = decode_u64(&k[8..])?;
            let replicas = decode_replicas(&v)?;
            out[(index - first) as usize] = Some(self.holding(ino, index, replicas)?);
        }
        Ok(out)
    }

    /// Where chunk `index` of `ino` is, if allocated: every replica, lost or not.
    pub fn chunk_at(&self, ino: Ino, index: u64) -> Result<Option<Replicas>, FsError> {
        self.tree(T_CHUNKS)
            .get(key_u64s(ino, index))
            .map_err(db_err)?
            .map(|v| decode_replicas(&v))
            .transpose()
    }

    /// The replicas of chunk `index` of `ino` that hold its data (not `lost`); `Lost` when
    /// none does. A chunk of one replica (every chunk before replicas) costs one lookup, as
    /// it did.
    pub(super) fn holding(
        &self,
        ino: Ino,
        index: u64,
        replicas: Replicas,
    ) -> Result<Replicas, FsError> {
        let lost = |loc: &ChunkLoc| {
            self.tree(T_LOST)
                .contains_key(key_server(loc.server, loc.index))
                .map_err(db_err)
        };
        if replicas.len() == 1 {
            return match lost(&replicas.first())? {
                true => Err(lost_error(ino, index, replicas.first())),
                false => Ok(replicas),
            };
        }
        let mut kept = [replicas.first(); MAX_REPLICAS];
        let mut n = 0;
        for loc in replicas.as_slice() {
            if !lost(loc)? {
                kept[n] = *loc;
                n += 1;
            }
        }
        match n {
            0 => Err(lost_error(ino, index, replicas.first())),
            n => Replicas::new(&kept[..n]).map_err(|e| corrupt(&e.to_string())),
        }
    }

    /// Every lost chunk: (ino, chunk index in the file, where it was).
    pub fn lost_chunks(&self) -> Result<Vec<(Ino, u64, ChunkLoc)>, FsError> {
        let mut out = Vec::new();
        for item in self.tree(T_LOST).iter() {
            let (k, v) = item.map_err(db_err)?;
            let loc = decode_loc(&k)?;
            let (ino, index) = decode_u64_pair(&v)?;
            out.push((ino, index, loc));
        }
        Ok(out)
    }

    /// Whether data server `id`'s free chunks must be zeroed before use (see the module docs).
    pub fn needs_scrub(&self, id: u32) -> Result<bool, FsError> {
        self.tree(T_SCRUB)
            .contains_key(id.to_be_bytes())
            .map_err(db_err)
    }

    /// Data server `id`'s free space as (unit offset, units) ranges: its free blocks and the
    /// never-used chunk-size blocks (one range), in no order.
    pub fn free_chunks_of(&self, id: u32) -> Result<Vec<(u64, u64)>, FsError> {
        let Some(v) = self.tree(T_SERVERS).get(id.to_be_bytes()).map_err(db_err)? else {
            return Ok(Vec::new());
        };
        let rec = ServerRecord::decode(&v)?;
        let max = self.layout.max_order();
        let mut out = Vec::new();
        if rec.next_fresh < rec.chunks {
            out.push((rec.next_fresh << max, (rec.chunks - rec.next_fresh) << max));
        }
        for item in self.tree(T_FREE).scan_prefix(id.to_be_bytes()) {
            let (k, v) = item.map_err(db_err)?;
            let (_, order, _) = decode_free_key(&k)?;
            out.push((decode_u64(&v)?, Layout::units_of(order)));
        }
        Ok(out)
    }

    /// Data server `id` was scrubbed. (A crash before this reaches the disk scrubs it again
    /// at the next start, which is harmless: only free chunks are zeroed.)
    pub fn scrubbed(&self, id: u32) -> Result<(), FsError> {
        self.tree(T_SCRUB).remove(id.to_be_bytes())?;
        Ok(())
    }

    /// Every chunk tail still to be zeroed.
    pub fn tails(&self) -> Result<Vec<Tail>, FsError> {
        let mut out = Vec::new();
        for item in self.tree(T_TAILS).iter() {
            let (k, v) = item.map_err(db_err)?;
            if v.len() != 9 {
                return Err(corrupt("a tail record is not 9 bytes"));
            }
            out.push(Tail {
                block: Block {
                    loc: decode_loc(&k)?,
                    order: decode_order(&v[8..])?,
                },
                from: decode_u64(&v[..8])?,
            });
        }
        Ok(out)
    }

    /// Forgets the tail record of `loc` (its tail was zeroed).
    pub fn tail_zeroed(&self, loc: ChunkLoc) -> Result<(), FsError> {
        self.tree(T_TAILS)
            .remove(key_server(loc.server, loc.index))?;
        Ok(())
    }

    /// The incarnation data server `id` last registered with (0: unknown).
    pub fn incarnation(&self, id: u32) -> Result<u64, FsError> {
        match self
            .tree(T_INCARNATIONS)
            .get(id.to_be_bytes())
            .map_err(db_err)?
        {
            Some(v) => decode_u64(&v),
            None => Ok(0),
        }
    }

    /// Every known data server.
    pub fn servers(&self) -> Result<Vec<ServerRecord>, FsError> {
        let mut out = Vec::new();
        for item in self.tree(T_SERVERS).iter() {
            let (_, v) = item.map_err(db_err)?;
            out.push(ServerRecord::decode(&v)?);
        }
        Ok(out)
    }

    /// The dirty (freed, not yet zeroed) blocks.
    pub fn dirty_chunks(&self) -> Result<Vec<Block>, FsError> {
        let mut out = Vec::new();
        for item in self.tree(T_DIRTY).iter() {
            let (k, v) = item.map_err(db_err)?;
            out.push(Block {
                loc: decode_loc(&k)?,
                order: decode_order(&v)?,
            });
        }
        Ok(out)
    }

    /// The chunks of `ino` with index `>= from`, one entry per replica (see
    /// [`Store::scan_chunks_in`]).
    pub(super) fn scan_chunks(&self, ino: Ino, from: u64) -> Result<Vec<(u64, ChunkLoc)>, FsError> {
        self.scan_chunks_in(ino, from..=u64::MAX)
    }

    /// The allocated chunks of `ino` among `chunks`, in order, one entry per replica (a
    /// chunk of `n` replicas is listed `n` times with its index): what freeing them frees,
    /// and what the file is charged for them.
    pub(super) fn scan_chunks_in(
        &self,
        ino: Ino,
        chunks: std::ops::RangeInclusive<u64>,
    ) -> Result<Vec<(u64, ChunkLoc)>, FsError> {
        let mut out = Vec::new();
        for item in self
            .tree(T_CHUNKS)
            .range(key_u64s(ino, *chunks.start())..=key_u64s(ino, *chunks.end()))
        {
            let (k, v) = item.map_err(db_err)?;
            let index = decode_u64(&k[8..])?;
            for loc in decode_replicas(&v)?.as_slice() {
                out.push((index, *loc));
            }
        }
        Ok(out)
    }

    /// Frees the chunks of file `ino` wholly beyond its size (as stored), bumping its generation
    /// if there were any. Called when the last opener releases the file: at rest, such chunks
    /// can only be left by a write whose client died between allocating them and raising the
    /// size, and nothing could ever read them.
    pub fn free_beyond_size(&self, ino: Ino) -> Result<Effects, FsError> {
        let attr = match self.getattr(ino) {
            Ok(attr) if attr.kind == FileKind::File => attr,
            Ok(_) | Err(FsError::NotFound) => return Ok(Effects::default()),
            Err(e) => return Err(e),
        };
        let doomed = self.scan_chunks(ino, self.layout.chunks_below(attr.size))?;
        if doomed.is_empty() {
            // The common case (every last close): no transaction.
            return Ok(Effects::default());
        }
        Ok(self.free_listed(ino, doomed)?.1)
    }

    /// Frees the allocated chunks among chunks `[first, first + count)` of regular file `ino`
    /// (`Request::FreeChunks`: a hole punched over them), bumping its generation if there were
    /// any; returns its attributes as stored and what was freed.
    pub fn free_chunks_in(
        &self,
        ino: Ino,
        first: u64,
        count: u64,
    ) -> Result<(Attr, Effects), FsError> {
        let attr = self.getattr(ino)?;
        check_has_chunks(&attr)?;
        let doomed = match count {
            0 => Vec::new(),
            _ => self.scan_chunks_in(ino, first..=first.saturating_add(count - 1))?,
        };
        if doomed.is_empty() {
            return Ok((attr, Effects::default()));
        }
        self.free_listed(ino, doomed)
    }

    /// Frees `doomed` (not empty), chunks of file `ino` found allocated (callers serialize
    /// mutations, so they still are), and bumps its generation: a client's cached location of
    /// one of them is then of an older generation, which it drops.
    pub(super) fn free_listed(
        &self,
        ino: Ino,
        doomed: Vec<(u64, ChunkLoc)>,
    ) -> Result<(Attr, Effects), FsError> {
        debug_assert!(!doomed.is_empty(), "nothing to free: no generation to bump");
        self.tx(|tx| {
            let mut attr = tx.inode(ino)?;
            attr.generation += 1;
            attr.allocated = attr.allocated.saturating_sub(tx.free_chunks(ino, &doomed)?);
            tx.put_inode(&attr)?;
            let freed = tx.blocks(&doomed);
            Ok((
                attr,
                Effects {
                    freed,
                    ..Effects::default()
                },
            ))
        })
    }

    /// Makes sure chunks `first..first+count` of `ino` exist, taking zeroed blocks of each
    /// chunk's order from the servers in `servers` (the connected ones, by id, each once):
    /// chunk `c`'s first replica prefers server `servers[(ino + c) % n]` (striping), and each
    /// further replica the next server in `servers` (cyclically) that has space, so that the
    /// `min(replicas, n)` replicas of a chunk are on distinct servers. With more than one
    /// replica, the servers' zones ([`ServerRecord::zone`]) count too: `servers` is taken in
    /// an order that alternates between zones ([`zone_order`]), and a further replica prefers
    /// a server in a zone the chunk has no replica in yet, then any other server (fewer zones
    /// than replicas, or a zone full: logged once). All or nothing: out of space aborts the
    /// whole transaction with `NoSpace`. Chunks that exist are returned as
    /// [`Store::chunk_map`] returns them (their replicas that hold data).
    pub fn allocate_chunks(
        &self,
        ino: Ino,
        generation: u64,
        first: u64,
        count: u64,
        servers: &[u32],
        replicas: usize,
    ) -> Result<Vec<Replicas>, FsError> {
        check_chunk_range(first, count)?;
        let want = replicas.clamp(1, MAX_REPLICAS).min(servers.len().max(1));
        // One replica (the common case) reads no server record: zones cannot matter.
        let zoned = match want {
            1 => None,
            _ => Some(self.zones_of(servers)?),
        };
        let (servers, zones): (Vec<u32>, Vec<ZoneKey>) = match zoned {
            Some(zones) => zone_order(servers, zones).into_iter().unzip(),
            None => (servers.to_vec(), Vec::new()),
        };
        let servers = servers.as_slice();
        let shared_zone = std::cell::Cell::new(false);
        let placed_sets = self.tx(|tx| {
            let mut attr = tx.inode(ino)?;
            if let Err(e) = check_has_chunks(&attr) {
                return abort(e);
            }
            if attr.generation != generation {
                return abort(FsError::Stale);
            }
            let allocated = attr.allocated;
            let mut out = Vec::with_capacity(count as usize);
            // Servers found without a block of some order in this transaction are not asked
            // again for that order or a larger one (chunk orders only grow with the index).
            let mut full = vec![false; servers.len()];
            for c in first..first + count {
                let key = key_u64s(ino, c);
                if let Some(v) = tx.t(T_CHUNKS).get(key)? {
                    let found = lift(decode_replicas(&v))?;
                    let mut kept = [found.first(); MAX_REPLICAS];
                    let mut n = 0;
                    for loc in found.as_slice() {
                        if tx
                            .t(T_LOST)
                            .get(key_server(loc.server, loc.index))?
                            .is_none()
                        {
                            kept[n] = *loc;
                            n += 1;
                        }
                    }
                    if n == 0 {
                        return abort(lost_error(ino, c, found.first()));
                    }
                    out.push(lift(
                        Replicas::new(&kept[..n]).map_err(|e| corrupt(&e.to_string())),
                    )?);
                    continue;
                }
                let n = servers.len();
                let start = if n == 0 {
                    0
                } else {
                    ((ino.wrapping_add(c)) % n as u64) as usize
                };
                let mut placed = [ChunkLoc {
                    server: 0,
                    index: 0,
                }; MAX_REPLICAS];
                let mut got = 0;
                // Zones: a first pass only over servers in zones the chunk has no replica in
                // yet, then a pass over the rest; without zones, the second pass alone.
                let mut used = [usize::MAX; MAX_REPLICAS];
                let passes: &[bool] = if zones.is_empty() {
                    &[false]
                } else {
                    &[true, false]
                };
                for &new_zones_only in passes {
                    for k in 0..n {
                        if got == want {
                            break;
                        }
                        let slot = (start + k) % n;
                        if full[slot] || used[..got].contains(&slot) {
                            continue;
                        }
                        if new_zones_only && used[..got].iter().any(|&u| zones[u] == zones[slot]) {
                            continue;
                        }
                        match tx.take_block(servers[slot], tx.1.order(c))? {
                            Some(index) => {
                                placed[got] = ChunkLoc {
                                    server: servers[slot],
                                    index,
                                };
                                used[got] = slot;
                                got += 1;
                            }
                            None => full[slot] = true,
                        }
                    }
                    if new_zones_only && got < want {
                        shared_zone.set(true);
                    }
                }
                if got < want {
                    return abort(FsError::NoSpace);
                }
                let set = lift(Replicas::new(&placed[..got]).map_err(|e| corrupt(&e.to_string())))?;
                tx.t(T_CHUNKS).insert(key, encode_replicas(&set))?;
                attr.allocated += tx.1.len(c) * got as u64;
                out.push(set);
            }
            if attr.allocated != allocated {
                tx.put_inode(&attr)?;
            }
            Ok(out)
        })?;
        if shared_zone.get()
            && !self
                .warned_shared_zone
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            let zones: std::collections::HashSet<&ZoneKey> = zones.iter().collect();
            tracing::warn!(
                replicas = want,
                zones = zones.len(),
                "some replicas of a chunk share a zone: fewer zones among the live data \
                 servers than replicas (or a zone's servers are full); they are still on \
                 distinct servers (logged once)"
            );
        }
        Ok(placed_sets)
    }

    /// The zone of each of `servers` (by their records).
    pub(super) fn zones_of(&self, servers: &[u32]) -> Result<Vec<ZoneKey>, FsError> {
        servers
            .iter()
            .map(
                |&id| match self.tree(T_SERVERS).get(id.to_be_bytes()).map_err(db_err)? {
                    Some(v) => Ok(ServerRecord::decode(&v)?.zone_key()),
                    None => Err(corrupt(&format!("data server {id} has no record"))),
                },
            )
            .collect()
    }

    /// The order of dirty block `loc` (`None`: not dirty, recycled already).
    pub fn dirty_order(&self, loc: ChunkLoc) -> Result<Option<u32>, FsError> {
        match self
            .tree(T_DIRTY)
            .get(key_server(loc.server, loc.index))
            .map_err(db_err)?
        {
            Some(v) => decode_order(&v).map(Some),
            None => Ok(None),
        }
    }

    /// Gives a zeroed dirty block back to its server's allocator (merged with its free buddies).
    pub fn recycle(&self, loc: ChunkLoc) -> Result<(), FsError> {
        self.tx(|tx| {
            let Some(v) = tx.t(T_DIRTY).remove(key_server(loc.server, loc.index))? else {
                return Ok(());
            };
            let order = lift(decode_order(&v))?;
            tx.release_block(Block { loc, order })
        })
    }

    /// Registers (or re-registers, by name) a data server presenting `incarnation`; returns its
    /// record and how many of its chunks were marked lost. A server that comes back smaller than
    /// the chunks already handed out is refused.
    ///
    /// A known server presenting another incarnation than it last did has new memory: every
    /// chunk of a file on it is marked lost (`lost`), and its dirty chunks need no zeroing
    /// (they are zero), which the caller's usual zeroing of dirty chunks does harmlessly.
    pub fn register_server(
        &self,
        name: &str,
        fabric: &FabricAddr,
        region: fabric::RegionId,
        chunks: u64,
        incarnation: u64,
    ) -> Result<(ServerRecord, u64), FsError> {
        self.register_server_in_zone(name, fabric, region, chunks, incarnation, None)
    }

    /// [`Store::register_server`] for a server in failure domain `zone` (recorded as it says
    /// at each registration: `None` clears a zone it named before).
    pub fn register_server_in_zone(
        &self,
        name: &str,
        fabric: &FabricAddr,
        region: fabric::RegionId,
        chunks: u64,
        incarnation: u64,
        zone: Option<&str>,
    ) -> Result<(ServerRecord, u64), FsError> {
        // The scan is outside the transaction (sled deadlocks a read inside one); registrations
        // and allocations are serialized by the service's state lock, so it stays exact.
        let known = self
            .tree(T_NAMES)
            .get(name.as_bytes())
            .map_err(db_err)?
            .and_then(|v| <[u8; 4]>::try_from(v.as_ref()).ok())
            .map(u32::from_be_bytes);
        let doomed: Vec<(Ino, u64, ChunkLoc)> = match known {
            Some(id) if self.incarnation(id)? != incarnation => self.chunks_on(id)?,
            _ => Vec::new(),
        };
        let rec = self.tx(|tx| {
            let id = match tx.t(T_NAMES).get(name.as_bytes())? {
                Some(v) => {
                    let bytes: [u8; 4] = match v.as_ref().try_into() {
                        Ok(b) => b,
                        Err(_) => return abort(corrupt("a server id is not 4 bytes")),
                    };
                    Some(u32::from_be_bytes(bytes))
                }
                None => None,
            };
            let rec = match id {
                Some(id) => {
                    let mut rec = tx.server(id)?;
                    if chunks < rec.next_fresh {
                        return abort(FsError::Invalid(format!(
                            "data server {name:?} came back with {chunks} chunks, but chunks up \
                             to {} are in use",
                            rec.next_fresh
                        )));
                    }
                    rec.fabric = fabric.clone();
                    rec.region = region;
                    rec.chunks = chunks;
                    rec.zone = zone.map(str::to_owned);
                    rec
                }
                None => {
                    let next = match tx.t(T_META).get(b"next_server")? {
                        Some(v) => lift(decode_u64(&v))?,
                        None => 0,
                    };
                    tx.t(T_META).insert(b"next_server", &be64(next + 1))?;
                    let id = u32::try_from(next)
                        .map_err(|_| ConflictableTransactionError::Abort(FsError::NoSpace))?;
                    tx.t(T_NAMES).insert(name.as_bytes(), &id.to_be_bytes())?;
                    ServerRecord {
                        id,
                        name: name.to_owned(),
                        fabric: fabric.clone(),
                        region,
                        chunks,
                        next_fresh: 0,
                        free_counts: vec![0; tx.1.max_order() as usize + 1],
                        zone: zone.map(str::to_owned),
                    }
                }
            };
            tx.put_server(&rec)?;
            tx.t(T_INCARNATIONS)
                .insert(rec.id.to_be_bytes(), &be64(incarnation))?;
            for (ino, index, loc) in &doomed {
                tx.t(T_LOST)
                    .insert(key_server(loc.server, loc.index), &key_u64s(*ino, *index))?;
            }
            Ok(rec)
        })?;
        Ok((rec, doomed.len() as u64))
    }

    /// Every replica of a file's chunk on data server `server`: (ino, chunk index, location).
    pub(super) fn chunks_on(&self, server: u32) -> Result<Vec<(Ino, u64, ChunkLoc)>, FsError> {
        let mut out = Vec::new();
        for item in self.tree(T_CHUNKS).iter() {
            let (k, v) = item.map_err(db_err)?;
            if let Some(loc) = decode_replicas(&v)?.on(server) {
                let (ino, index) = decode_u64_pair(&k)?;
                out.push((ino, index, loc));
            }
        }
        Ok(out)
    }
}

/// `servers` (with their `zones`) in the order placement walks them: round-robin over the
/// zones (in the order each first appears), each zone's servers in their order — so that the
/// next server after any one is in another zone where one is left, and each server follows
/// about as many others (the replicas spread evenly). Servers all in zones of their own keep
/// their order.
pub(crate) fn zone_order(servers: &[u32], zones: Vec<ZoneKey>) -> Vec<(u32, ZoneKey)> {
    let mut groups: Vec<(ZoneKey, Vec<u32>)> = Vec::new();
    for (&id, zone) in servers.iter().zip(zones) {
        match groups.iter_mut().find(|(z, _)| *z == zone) {
            Some((_, members)) => members.push(id),
            None => groups.push((zone, vec![id])),
        }
    }
    let mut out = Vec::with_capacity(servers.len());
    let deepest = groups.iter().map(|(_, m)| m.len()).max().unwrap_or(0);
    for round in 0..deepest {
        for (zone, members) in &groups {
            if let Some(&id) = members.get(round) {
                out.push((id, zone.clone()));
            }
        }
    }
    out
}

/// The error of an I/O touching lost chunk `index` of `ino`.
pub(super) fn lost_error(ino: Ino, index: u64, loc: ChunkLoc) -> FsError {
    FsError::Lost(format!(
        "chunk {index} of inode {ino} was on data server {}, which restarted without its memory",
        loc.server
    ))
}

/// Refuses a chunk range longer than [`MAX_CHUNKS_PER_CALL`] or past the last chunk index.
pub(super) fn check_chunk_range(first: u64, count: u64) -> Result<(), FsError> {
    if count > MAX_CHUNKS_PER_CALL || first.checked_add(count).is_none() {
        return Err(FsError::Invalid(format!(
            "chunk range {first}+{count} is too large (at most {MAX_CHUNKS_PER_CALL} per call)"
        )));
    }
    Ok(())
}
