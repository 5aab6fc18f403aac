//! Dropped replicas: when a data server is marked down, its replicas of every chunk that has
//! another live replica leave the chunk's set (docs/REPLICAS.md "A dead data server"), so that
//! writes go on with the others and the dropped copy — which misses those writes — is never
//! read again, even if the server comes back with its old memory.
//!
//! A dropped replica is marked in `lost`, exactly as a replica whose server came back with new
//! memory: [`Store::holding`] leaves it out of every chunk map, [`Store::allocate_chunks`]
//! returns the chunk without it, and freeing the chunk (truncate, unlink, hole punch) clears
//! the mark and zeroes the block like any other. Nothing clears it otherwise, so a
//! re-registration of the server (a file-backed one keeps its incarnation, and so its marks)
//! never brings the replica back. The drop moves the generation of every file it touched, so
//! that a client's cached chunk map of such a file is stale at its next locked I/O (the
//! service publishes the generation in the file's control block before any chunk map without
//! the replica can be answered).

use super::*;

/// What [`Store::drop_replicas_on`] did.
#[derive(Debug, Default)]
pub struct Dropped {
    /// How many replicas it dropped.
    pub replicas: u64,
    /// The files they belong to, each once, with their new generation.
    pub files: Vec<Attr>,
}

impl Store {
    /// Drops data server `server`'s replicas (see the module docs): every replica on it, not
    /// already lost, of a chunk with another replica that is not lost and whose server `live`
    /// says is live is marked lost, and the generation of each file touched moves on — all in
    /// one transaction, flushed to disk before this returns. A chunk whose every other replica is lost or on a server that is not
    /// live (and a chunk of one replica) keeps its replica there: its writes wait for the
    /// server, as before replicas. Callers serialize it with allocations and registrations
    /// (the service's state lock), so the scan before the transaction stays exact.
    pub fn drop_replicas_on(
        &self,
        server: u32,
        live: impl Fn(u32) -> bool,
    ) -> Result<Dropped, FsError> {
        let lost = |loc: &ChunkLoc| {
            self.tree(T_LOST)
                .contains_key(key_server(loc.server, loc.index))
                .map_err(db_err)
        };
        let mut doomed: Vec<(Ino, u64, ChunkLoc)> = Vec::new();
        for item in self.tree(T_CHUNKS).iter() {
            let (k, v) = item.map_err(db_err)?;
            let replicas = decode_replicas(&v)?;
            let Some(here) = replicas.on(server) else {
                continue;
            };
            if replicas.len() == 1 || lost(&here)? {
                continue;
            }
            let mut kept = false;
            for other in replicas.as_slice().iter().filter(|l| l.server != server) {
                if live(other.server) && !lost(other)? {
                    kept = true;
                    break;
                }
            }
            if kept {
                let (ino, index) = decode_u64_pair(&k)?;
                doomed.push((ino, index, here));
            }
        }
        if doomed.is_empty() {
            return Ok(Dropped::default());
        }
        let mut inos: Vec<Ino> = doomed.iter().map(|(ino, _, _)| *ino).collect();
        inos.dedup();
        let files = self.tx(|tx| {
            for (ino, index, loc) in &doomed {
                tx.t(T_LOST)
                    .insert(key_server(loc.server, loc.index), &key_u64s(*ino, *index))?;
            }
            let mut files = Vec::with_capacity(inos.len());
            for &ino in &inos {
                let mut attr = tx.inode(ino)?;
                // Cached chunk maps of the file name the dropped replicas: stale now.
                attr.generation += 1;
                tx.put_inode(&attr)?;
                files.push(attr);
            }
            Ok(files)
        })?;
        // Durable before it is answered: writes without the replica come next, and a restart
        // that forgot the marks would read the replica again once its server is back.
        if let Err(error) = self.flush() {
            tracing::error!(
                server,
                %error,
                "replicas dropped but not durable yet: a crash before the next flush forgets \
                 the drop"
            );
        }
        Ok(Dropped {
            replicas: doomed.len() as u64,
            files,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::Caller;

    const ME: Caller = Caller { uid: 0, gid: 0 };

    /// A store of 64 KiB chunks with `n` data servers of 16 chunks, registered at
    /// incarnation 1.
    fn store_with(dir: &Path, n: usize) -> Store {
        let store = Store::open(dir, 64 << 10, ME).unwrap();
        for i in 0..n {
            store
                .register_server(&format!("ds-{i}"), &addr(), fabric::RegionId(1), 16, 1)
                .unwrap();
        }
        store
    }

    fn addr() -> FabricAddr {
        "tcp:127.0.0.1:1".parse().unwrap()
    }

    /// A new file with `chunks` chunks of `replicas` replicas on `servers`.
    fn file(store: &Store, name: &str, chunks: u64, servers: &[u32], replicas: usize) -> Attr {
        let f = store
            .mknod(ROOT_INO, name, FileKind::File, 0o644, 0, ME)
            .unwrap();
        store
            .allocate_chunks(f.ino, f.generation, 0, chunks, servers, replicas)
            .unwrap();
        store.getattr(f.ino).unwrap()
    }

    /// The servers of each of chunks `0..chunks` of `ino` in its chunk map, in id order.
    fn servers_of(store: &Store, ino: Ino, chunks: u64) -> Vec<Vec<u32>> {
        store
            .chunk_map(ino, 0, chunks)
            .unwrap()
            .into_iter()
            .map(|s| {
                let mut servers: Vec<u32> =
                    s.unwrap().as_slice().iter().map(|l| l.server).collect();
                servers.sort_unstable();
                servers
            })
            .collect()
    }

    /// A dead server's replicas leave every chunk that has another live replica: the chunk
    /// maps and allocations answer without them, the files' generations move (and only
    /// theirs), a chunk of one replica there is untouched, and dropping again changes nothing.
    #[test]
    fn a_dead_servers_replicas_leave_chunks_that_have_another() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), 3);
        let two = file(&store, "two", 4, &[0, 1], 2);
        let one = file(&store, "one", 2, &[1], 1);
        let elsewhere = file(&store, "elsewhere", 2, &[0, 2], 2);
        let dropped = store.drop_replicas_on(1, |s| s != 1).unwrap();
        assert_eq!(dropped.replicas, 4);
        assert_eq!(dropped.files.len(), 1);
        assert_eq!(dropped.files[0].ino, two.ino);
        assert_eq!(dropped.files[0].generation, two.generation + 1);
        assert_eq!(
            store.getattr(two.ino).unwrap().generation,
            two.generation + 1
        );
        assert_eq!(servers_of(&store, two.ino, 4), vec![vec![0]; 4]);
        // Replicas 1 on the dead server: kept (its writes wait for the server).
        assert_eq!(servers_of(&store, one.ino, 2), vec![vec![1]; 2]);
        assert_eq!(store.getattr(one.ino).unwrap().generation, one.generation);
        assert_eq!(
            store.getattr(elsewhere.ino).unwrap().generation,
            elsewhere.generation
        );
        // An allocation over the existing chunks answers them without the dropped replica.
        let again = store
            .allocate_chunks(two.ino, two.generation + 1, 0, 4, &[0, 2], 2)
            .unwrap();
        assert!(again.iter().all(|s| s.len() == 1 && s.first().server == 0));
        // Nothing left to drop.
        let twice = store.drop_replicas_on(1, |s| s != 1).unwrap();
        assert_eq!(twice.replicas, 0);
        assert!(twice.files.is_empty());
        assert_eq!(
            store.getattr(two.ino).unwrap().generation,
            two.generation + 1
        );
    }

    /// A replica is dropped only where another holds the data on a live server: with both
    /// servers of a chunk dead, the second to die keeps its replica; a replica beside a lost
    /// one is kept too.
    #[test]
    fn the_last_live_replica_is_never_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), 3);
        let f = file(&store, "f", 3, &[0, 1], 2);
        assert_eq!(store.drop_replicas_on(0, |s| s == 2).unwrap().replicas, 0);
        assert_eq!(servers_of(&store, f.ino, 3), vec![vec![0, 1]; 3]);
        // ds-0 dies first (ds-1 live): dropped. Then ds-1 dies: its replicas are the last.
        assert_eq!(store.drop_replicas_on(0, |s| s != 0).unwrap().replicas, 3);
        assert_eq!(store.drop_replicas_on(1, |s| s == 2).unwrap().replicas, 0);
        assert_eq!(servers_of(&store, f.ino, 3), vec![vec![1]; 3]);
        // A replica beside a lost one (its server came back with new memory) is the last.
        let g = file(&store, "g", 2, &[1, 2], 2);
        store
            .register_server("ds-2", &addr(), fabric::RegionId(1), 16, 7)
            .unwrap();
        assert_eq!(store.drop_replicas_on(1, |_| true).unwrap().replicas, 0);
        assert_eq!(servers_of(&store, g.ino, 2), vec![vec![1]; 2]);
    }

    /// A dropped replica stays out when its server registers again with its old memory (the
    /// same incarnation), and with new memory; freeing the chunk clears the mark and makes the
    /// block dirty (zeroed before reuse), as for any lost replica.
    #[test]
    fn a_dropped_replica_stays_out_until_its_chunk_is_freed() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), 2);
        let f = file(&store, "f", 2, &[0, 1], 2);
        let on_one: Vec<ChunkLoc> = store
            .chunk_map(f.ino, 0, 2)
            .unwrap()
            .into_iter()
            .map(|s| s.unwrap().on(1).unwrap())
            .collect();
        store.drop_replicas_on(1, |s| s == 0).unwrap();
        let (_, lost) = store
            .register_server("ds-1", &addr(), fabric::RegionId(1), 16, 1)
            .unwrap();
        assert_eq!(lost, 0, "its old memory: no new incarnation");
        assert_eq!(servers_of(&store, f.ino, 2), vec![vec![0]; 2]);
        store
            .register_server("ds-1", &addr(), fabric::RegionId(1), 16, 2)
            .unwrap();
        assert_eq!(servers_of(&store, f.ino, 2), vec![vec![0]; 2]);
        // Every replica still in the chunk's record, the dropped ones listed as lost.
        assert_eq!(store.chunk_at(f.ino, 0).unwrap().unwrap().len(), 2);
        let mut lost: Vec<ChunkLoc> = store.lost_chunks().unwrap().iter().map(|l| l.2).collect();
        lost.sort_by_key(|l| l.index);
        assert_eq!(lost, on_one);
        store.unlink(ROOT_INO, "f", |_| false).unwrap();
        assert!(store.lost_chunks().unwrap().is_empty());
        let dirty: Vec<ChunkLoc> = store
            .dirty_chunks()
            .unwrap()
            .iter()
            .map(|b| b.loc)
            .collect();
        assert!(on_one.iter().all(|l| dirty.contains(l)), "{dirty:?}");
    }
}
