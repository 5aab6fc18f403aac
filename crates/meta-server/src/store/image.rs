//! The database as the consistency checker sees it ([`Image`]), its repairs, and deliberate
//! damage for the checker's tests.

use super::*;

/// A directory entry as the checker sees it.
#[derive(Clone, Debug)]
pub(crate) struct ImageEntry {
    pub parent: Ino,
    pub name: String,
    pub ino: Ino,
    pub kind: FileKind,
    pub cookie: u64,
}

/// Every record of the database, decoded, for the consistency checker (`crate::fsck`). Read tree
/// by tree, so the caller must keep mutations out while it is read (the service holds its state
/// lock). Everything is in memory: the checker's cost is proportional to the namespace.
#[derive(Default)]
pub(crate) struct Image {
    pub inodes: std::collections::BTreeMap<Ino, Attr>,
    pub parents: std::collections::BTreeMap<Ino, Ino>,
    pub entries: Vec<ImageEntry>,
    /// The readdir index: (dir, cookie) → (ino, kind, name).
    pub index: Vec<ImageEntry>,
    pub cookies: std::collections::BTreeMap<Ino, u64>,
    /// Inodes with at least one xattr.
    pub xattr_inos: std::collections::BTreeSet<Ino>,
    pub symlinks: std::collections::BTreeSet<Ino>,
    /// (ino, chunk index, location): one entry per replica.
    pub chunks: Vec<(Ino, u64, ChunkLoc)>,
    pub servers: Vec<ServerRecord>,
    /// Free-stack entries: (server, order, slot, unit offset).
    pub free: Vec<(u32, u32, u64, u64)>,
    /// The free index: (server, unit offset, order, slot).
    pub freeidx: Vec<(u32, u64, u32, u64)>,
    pub dirty: Vec<Block>,
    pub orphans: std::collections::BTreeSet<Ino>,
    /// Chunks marked lost: (ino, chunk index, location).
    pub lost: Vec<(Ino, u64, ChunkLoc)>,
}

impl Store {
    /// Reads every tree into an [`Image`] for the checker. Undecodable records are errors: the
    /// checker compares records, it does not salvage bytes.
    pub(crate) fn image(&self) -> Result<Image, FsError> {
        let mut image = Image::default();
        for item in self.tree(T_INODES).iter() {
            let (_, v) = item.map_err(db_err)?;
            let attr: Attr = dec(&v, "inode")?;
            image.inodes.insert(attr.ino, attr);
        }
        for item in self.tree(T_PARENTS).iter() {
            let (k, v) = item.map_err(db_err)?;
            image.parents.insert(decode_u64(&k)?, decode_u64(&v)?);
        }
        for item in self.tree(T_DIRENTS).iter() {
            let (k, v) = item.map_err(db_err)?;
            let d: Dirent = dec(&v, "directory entry")?;
            image.entries.push(ImageEntry {
                parent: decode_ino_prefix(&k)?,
                name: String::from_utf8_lossy(&k[8..]).into_owned(),
                ino: d.ino,
                kind: d.kind,
                cookie: d.cookie,
            });
        }
        for item in self.tree(T_DIRINDEX).iter() {
            let (k, v) = item.map_err(db_err)?;
            let e: IndexEntry = dec(&v, "directory index")?;
            let cookie = k
                .get(8..)
                .ok_or_else(|| corrupt("a directory index key is short"))
                .and_then(decode_u64)?;
            image.index.push(ImageEntry {
                parent: decode_ino_prefix(&k)?,
                name: e.name,
                ino: e.ino,
                kind: e.kind,
                cookie,
            });
        }
        for item in self.tree(T_COOKIES).iter() {
            let (k, v) = item.map_err(db_err)?;
            image.cookies.insert(decode_u64(&k)?, decode_u64(&v)?);
        }
        for key in self.tree(T_XATTRS).iter().keys() {
            image
                .xattr_inos
                .insert(decode_ino_prefix(&key.map_err(db_err)?)?);
        }
        for key in self.tree(T_SYMLINKS).iter().keys() {
            image.symlinks.insert(decode_u64(&key.map_err(db_err)?)?);
        }
        for item in self.tree(T_CHUNKS).iter() {
            let (k, v) = item.map_err(db_err)?;
            let index = k
                .get(8..)
                .ok_or_else(|| corrupt("a chunk key is short"))
                .and_then(decode_u64)?;
            let ino = decode_ino_prefix(&k)?;
            for loc in decode_replicas(&v)?.as_slice() {
                image.chunks.push((ino, index, *loc));
            }
        }
        image.servers = self.servers()?;
        for item in self.tree(T_FREE).iter() {
            let (k, v) = item.map_err(db_err)?;
            let (server, order, slot) = decode_free_key(&k)?;
            image.free.push((server, order, slot, decode_u64(&v)?));
        }
        for item in self.tree(T_FREEIDX).iter() {
            let (k, v) = item.map_err(db_err)?;
            let (server, at) = decode_server_key(&k)?;
            let (order, slot) = decode_slot(&v)?;
            image.freeidx.push((server, at, order, slot));
        }
        image.dirty = self.dirty_chunks()?;
        image.orphans = self.orphans()?.into_iter().collect();
        image.lost = self.lost_chunks()?;
        Ok(image)
    }

    // ---- repairs (`citronfs fsck --repair`; callers serialize them like every mutation) --

    /// Removes the entry `parent/name` and its readdir index, whatever it names. Link counts
    /// are the checker's next round's business.
    pub(crate) fn repair_remove_entry(&self, parent: Ino, name: &str) -> Result<bool, FsError> {
        self.tx(|tx| {
            let Some(entry) = tx.dirent(parent, name)? else {
                return Ok(false);
            };
            tx.remove_dirent(parent, name, &entry)?;
            Ok(true)
        })
    }

    /// Sets a file's count of chunk bytes ([`Attr::allocated`]) to `allocated`.
    pub(crate) fn repair_set_allocated(&self, ino: Ino, allocated: u64) -> Result<(), FsError> {
        self.tx(|tx| {
            let mut attr = tx.inode(ino)?;
            attr.allocated = allocated;
            tx.put_inode(&attr)
        })
    }

    /// Sets an inode's link count.
    pub(crate) fn repair_set_nlink(&self, ino: Ino, nlink: u32) -> Result<(), FsError> {
        self.tx(|tx| {
            let mut attr = tx.inode(ino)?;
            attr.nlink = nlink;
            attr.ctime = Timestamp::now();
            tx.put_inode(&attr)
        })
    }

    /// Deletes an inode that nothing reaches, with everything hanging off it; a directory's
    /// own entries go too (what they name is unreachable then, for the next round).
    pub(crate) fn repair_delete_inode(&self, ino: Ino) -> Result<Effects, FsError> {
        let doomed = self.scan_doomed(ino)?;
        let entries: Vec<(Vec<u8>, Dirent)> = self
            .tree(T_DIRENTS)
            .scan_prefix(be64(ino))
            .map(|item| {
                let (k, v) = item.map_err(db_err)?;
                Ok((k.to_vec(), dec(&v, "directory entry")?))
            })
            .collect::<Result<_, FsError>>()?;
        self.tx(|tx| {
            for (key, entry) in &entries {
                tx.t(T_DIRENTS).remove(key.as_slice())?;
                tx.t(T_DIRINDEX).remove(key_u64s(ino, entry.cookie))?;
                tx.entry_changed(ino, &String::from_utf8_lossy(&key[8..]), None);
            }
            tx.delete_inode(ino, &doomed)?;
            Ok(Effects {
                freed: tx.blocks(&doomed.chunks),
                ..Effects::default()
            })
        })
    }

    /// Frees the chunks of `ino`'s chunk map from index `from` on (the inode need not exist).
    pub(crate) fn repair_free_chunks(&self, ino: Ino, from: u64) -> Result<Effects, FsError> {
        let doomed = self.scan_chunks(ino, from)?;
        self.tx(|tx| {
            let bytes = tx.free_chunks(ino, &doomed)?;
            if let Some(v) = tx.t(T_INODES).get(be64(ino))? {
                let mut attr: Attr = lift(dec(&v, "inode"))?;
                attr.generation += 1;
                attr.allocated = attr.allocated.saturating_sub(bytes);
                tx.put_inode(&attr)?;
            }
            Ok(Effects {
                freed: tx.blocks(&doomed),
                ..Effects::default()
            })
        })
    }

    /// Marks a leaked block dirty: the service zeroes it and gives it back to the allocator.
    pub(crate) fn repair_mark_dirty(&self, block: Block) -> Result<(), FsError> {
        self.tx(|tx| {
            tx.t(T_DIRTY).insert(
                key_server(block.loc.server, block.loc.index),
                &[block.order as u8],
            )?;
            Ok(())
        })
    }

    /// Takes a chunk out of the dirty set without freeing it (it is in use, or not a chunk).
    pub(crate) fn repair_clear_dirty(&self, loc: ChunkLoc) -> Result<(), FsError> {
        self.tx(|tx| {
            tx.t(T_DIRTY).remove(key_server(loc.server, loc.index))?;
            Ok(())
        })
    }

    /// Rewrites server `id`'s free stacks and free index as exactly `blocks` (zeroed blocks,
    /// decided by the checker: (unit offset, order)); returns the entry count before.
    pub(crate) fn repair_rebuild_free(
        &self,
        id: u32,
        blocks: &[(u64, u32)],
    ) -> Result<u64, FsError> {
        let scan = |tree: usize| -> Result<Vec<Vec<u8>>, FsError> {
            self.tree(tree)
                .scan_prefix(id.to_be_bytes())
                .keys()
                .map(|k| k.map(|k| k.to_vec()).map_err(db_err))
                .collect()
        };
        let keys = scan(T_FREE)?;
        let index_keys = scan(T_FREEIDX)?;
        self.tx(|tx| {
            for key in &keys {
                tx.t(T_FREE).remove(key.as_slice())?;
            }
            for key in &index_keys {
                tx.t(T_FREEIDX).remove(key.as_slice())?;
            }
            let mut rec = tx.server(id)?;
            rec.free_counts = vec![0; tx.1.max_order() as usize + 1];
            for &(at, order) in blocks {
                tx.push_free(&mut rec, at, order)?;
            }
            tx.put_server(&rec)?;
            Ok(keys.len() as u64)
        })
    }

    /// Removes the orphan mark of an inode that still has links (it must not be deleted at
    /// its last release).
    pub(crate) fn repair_unmark_orphan(&self, ino: Ino) -> Result<(), FsError> {
        self.tx(|tx| {
            tx.t(T_ORPHANS).remove(be64(ino))?;
            Ok(())
        })
    }

    /// Removes the records of a missing inode: xattrs, symlink target, parent pointer, cookie
    /// counter, orphan mark.
    pub(crate) fn repair_remove_stray(&self, ino: Ino) -> Result<(), FsError> {
        let xattrs: Vec<Vec<u8>> = self
            .tree(T_XATTRS)
            .scan_prefix(be64(ino))
            .keys()
            .map(|k| k.map(|k| k.to_vec()).map_err(db_err))
            .collect::<Result<_, _>>()?;
        self.tx(|tx| {
            if tx.t(T_INODES).get(be64(ino))?.is_some() {
                return Ok(());
            }
            for key in &xattrs {
                tx.t(T_XATTRS).remove(key.as_slice())?;
            }
            tx.t(T_SYMLINKS).remove(be64(ino))?;
            tx.t(T_PARENTS).remove(be64(ino))?;
            tx.t(T_COOKIES).remove(be64(ino))?;
            tx.t(T_ORPHANS).remove(be64(ino))?;
            Ok(())
        })
    }
}

/// Deliberate damage, for the checker's tests: each breaks one invariant the way a bug or a
/// torn update could, bypassing the rules every real operation keeps.
#[cfg(any(test, feature = "test-hooks"))]
#[derive(Clone, Debug)]
pub enum Corruption {
    /// Sets a stored link count.
    SetNlink {
        /// The inode.
        ino: Ino,
        /// The count to store.
        nlink: u32,
    },
    /// Deletes an inode's record only (its entries then dangle).
    RemoveInode {
        /// The inode.
        ino: Ino,
    },
    /// Removes a directory entry (and its index) only: what it named loses a link, and a
    /// file's last name makes it unreachable.
    RemoveEntry {
        /// The directory.
        parent: Ino,
        /// The name.
        name: String,
    },
    /// Adds an entry (and its index) naming `ino`, touching no link count.
    AddEntry {
        /// The directory.
        parent: Ino,
        /// The name.
        name: String,
        /// What it names (need not exist).
        ino: Ino,
        /// The kind it claims.
        kind: FileKind,
    },
    /// Takes a smallest block from a server's allocation state and puts it nowhere (a leak).
    LeakChunk {
        /// The server.
        server: u32,
    },
    /// Pushes a smallest block onto a server's free stack (a chunk in use: both used and free).
    PushFree {
        /// The chunk.
        loc: ChunkLoc,
    },
    /// Marks a smallest block dirty.
    MarkDirty {
        /// The chunk.
        loc: ChunkLoc,
    },
    /// Writes a chunk-map entry without allocating anything.
    MapChunk {
        /// The inode.
        ino: Ino,
        /// Its chunk index.
        chunk: u64,
        /// Where it claims to be.
        loc: ChunkLoc,
    },
    /// Sets a file's stored size (its chunks stay).
    SetSize {
        /// The inode.
        ino: Ino,
        /// The size to store.
        size: u64,
    },
    /// Sets a file's stored count of chunk bytes ([`Attr::allocated`]; its chunks stay).
    SetAllocated {
        /// The inode.
        ino: Ino,
        /// The count to store.
        allocated: u64,
    },
}

#[cfg(any(test, feature = "test-hooks"))]
impl Store {
    /// Moves `ino`'s generation on by one, as a dropped or re-replicated replica does, and
    /// returns its attributes (tests of the clients' allocations only).
    pub fn bump_generation(&self, ino: Ino) -> Result<Attr, FsError> {
        self.tx(|tx| {
            let mut attr = tx.inode(ino)?;
            attr.generation += 1;
            tx.put_inode(&attr)?;
            Ok(attr)
        })
    }

    /// Applies one [`Corruption`] (tests of the checker only).
    pub fn corrupt(&self, damage: &Corruption) -> Result<(), FsError> {
        self.tx(|tx| {
            match damage {
                Corruption::SetNlink { ino, nlink } => {
                    let mut attr = tx.inode(*ino)?;
                    attr.nlink = *nlink;
                    tx.put_inode(&attr)?;
                }
                Corruption::RemoveInode { ino } => {
                    tx.touch(*ino);
                    tx.t(T_INODES).remove(be64(*ino))?;
                }
                Corruption::RemoveEntry { parent, name } => {
                    let Some(entry) = tx.dirent(*parent, name)? else {
                        return abort(FsError::NotFound);
                    };
                    tx.remove_dirent(*parent, name, &entry)?;
                }
                Corruption::AddEntry {
                    parent,
                    name,
                    ino,
                    kind,
                } => tx.add_dirent(*parent, name, *ino, *kind)?,
                Corruption::LeakChunk { server } => {
                    if tx.take_block(*server, 0)?.is_none() {
                        return abort(FsError::NoSpace);
                    }
                }
                Corruption::PushFree { loc } => {
                    let mut rec = tx.allocator(loc.server)?;
                    tx.push_free(&mut rec, loc.index, 0)?;
                    tx.put_server(&rec)?;
                }
                Corruption::MarkDirty { loc } => {
                    tx.t(T_DIRTY)
                        .insert(key_server(loc.server, loc.index), &[0u8])?;
                }
                Corruption::MapChunk { ino, chunk, loc } => {
                    tx.t(T_CHUNKS)
                        .insert(key_u64s(*ino, *chunk), &encode_loc(*loc))?;
                }
                Corruption::SetSize { ino, size } => {
                    let mut attr = tx.inode(*ino)?;
                    attr.size = *size;
                    tx.put_inode(&attr)?;
                }
                Corruption::SetAllocated { ino, allocated } => {
                    let mut attr = tx.inode(*ino)?;
                    attr.allocated = *allocated;
                    tx.put_inode(&attr)?;
                }
            }
            Ok(())
        })
    }
}
