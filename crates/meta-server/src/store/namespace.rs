//! Namespace transactions: reads and changes of inodes, directory entries, symlinks and
//! xattrs, each change one transaction over every tree (see the module docs of [`super`]).

use super::*;

impl Tx<'_> {
    /// Deletes an inode and everything hanging off it (`doomed`: scanned by the caller).
    pub(super) fn delete_inode(&self, ino: Ino, doomed: &Doomed) -> TxResult<()> {
        self.touch(ino);
        self.t(T_INODES).remove(be64(ino))?;
        self.t(T_PARENTS).remove(be64(ino))?;
        self.t(T_COOKIES).remove(be64(ino))?;
        self.t(T_SYMLINKS).remove(be64(ino))?;
        self.t(T_ORPHANS).remove(be64(ino))?;
        for key in &doomed.xattrs {
            self.t(T_XATTRS).remove(key.as_slice())?;
        }
        self.free_chunks(ino, &doomed.chunks).map(drop)
    }

    /// Moves entry `src` from `from` (directory, name) to `to`, where no entry is, updating
    /// both directories' times and link counts, a moved directory's parent pointer and the
    /// moved inode's change time.
    fn move_entry(
        &self,
        (parent, name): (Ino, &str),
        (new_parent, new_name): (Ino, &str),
        src: &Dirent,
        now: Timestamp,
    ) -> TxResult<()> {
        self.remove_dirent(parent, name, src)?;
        self.add_dirent(new_parent, new_name, src.ino, src.kind)?;
        // Re-read the parents: a replaced target may have changed `new_parent`.
        let mut old_dir = self.inode(parent)?;
        if parent != new_parent {
            let mut np = self.inode(new_parent)?;
            if src.kind == FileKind::Dir {
                self.t(T_PARENTS).insert(be64(src.ino), &be64(new_parent))?;
                old_dir.nlink = old_dir.nlink.saturating_sub(1);
                np.nlink += 1;
            }
            np.mtime = now;
            np.ctime = now;
            self.put_inode(&np)?;
        }
        old_dir.mtime = now;
        old_dir.ctime = now;
        self.put_inode(&old_dir)?;
        let mut moved = self.inode(src.ino)?;
        moved.ctime = now;
        self.put_inode(&moved)
    }

    /// Sets regular file `attr`'s size to `size` (from `old`): frees the chunks `doomed` (those
    /// wholly past the smaller of the two) with a new generation, and records the tail of the
    /// last chunk a shrink leaves to zero.
    pub(super) fn set_size(
        &self,
        attr: &mut Attr,
        size: u64,
        old: u64,
        doomed: &[(u64, ChunkLoc)],
    ) -> TxResult<Effects> {
        match attr.kind {
            FileKind::File => {}
            FileKind::Dir => return abort(FsError::IsDir),
            _ => {
                return abort(FsError::Invalid(
                    "only regular files have a size to set".into(),
                ))
            }
        }
        let (layout, ino) = (self.1, attr.ino);
        let mut effects = Effects::default();
        if size < old || !doomed.is_empty() {
            // Clients drop cached chunk locations of older generations.
            attr.generation += 1;
            attr.allocated = attr
                .allocated
                .saturating_sub(self.free_chunks(ino, doomed)?);
            effects.freed = self.blocks(doomed);
            // Only a shrink leaves bytes of the file's last chunk to zero.
            let (chunk, from) = layout.locate(size);
            if size < old && from != 0 {
                if let Some(v) = self.t(T_CHUNKS).get(key_u64s(ino, chunk))? {
                    let order = layout.order(chunk);
                    // Every replica's tail (a lost one's too: it is zeroed whole when its
                    // chunk is freed or copied again).
                    for &loc in lift(decode_replicas(&v))?.as_slice() {
                        self.t(T_TAILS)
                            .insert(key_server(loc.server, loc.index), &encode_tail(from, order))?;
                        effects.tails.push(Tail {
                            block: Block { loc, order },
                            from,
                        });
                    }
                }
            }
        }
        attr.size = size;
        Ok(effects)
    }
}

impl Store {
    // ---- reads ------------------------------------------------------------------------------

    /// An inode's attributes.
    pub fn getattr(&self, ino: Ino) -> Result<Attr, FsError> {
        match self.tree(T_INODES).get(be64(ino)).map_err(db_err)? {
            Some(v) => dec(&v, "inode"),
            None => Err(FsError::NotFound),
        }
    }

    pub(super) fn get_dirent(&self, parent: Ino, name: &str) -> Result<Option<Dirent>, FsError> {
        match self
            .tree(T_DIRENTS)
            .get(key2(parent, name.as_bytes()))
            .map_err(db_err)?
        {
            Some(v) => Ok(Some(dec(&v, "directory entry")?)),
            None => Ok(None),
        }
    }

    /// The inode the entry `name` in `parent` names, if it exists.
    pub fn entry_ino(&self, parent: Ino, name: &str) -> Result<Option<Ino>, FsError> {
        Ok(self.get_dirent(parent, name)?.map(|e| e.ino))
    }

    /// The entry `name` in `parent`.
    pub fn lookup(&self, parent: Ino, name: &str) -> Result<Attr, FsError> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let dir = self.getattr(parent)?;
        if dir.kind != FileKind::Dir {
            return Err(FsError::NotDir);
        }
        match name {
            "." => return Ok(dir),
            ".." => return self.getattr(self.parent_of(parent)?),
            _ => {}
        }
        match self.get_dirent(parent, name)? {
            Some(e) => self.getattr(e.ino),
            None => Err(FsError::NotFound),
        }
    }

    /// `Invalid` when directory `moving` would land in its own subtree by moving into `into`:
    /// that would cut the subtree loose. Walks up from `into` to the root; meeting `moving`
    /// means it is an ancestor of `into` (or `into` itself).
    pub(super) fn check_not_into_own_subtree(&self, moving: Ino, into: Ino) -> Result<(), FsError> {
        let mut at = into;
        loop {
            if at == moving {
                return Err(FsError::Invalid(
                    "cannot move a directory into its own subtree".into(),
                ));
            }
            if at == ROOT_INO {
                return Ok(());
            }
            at = self.parent_of(at)?;
        }
    }

    pub(super) fn parent_of(&self, dir: Ino) -> Result<Ino, FsError> {
        match self.tree(T_PARENTS).get(be64(dir)).map_err(db_err)? {
            Some(v) => decode_u64(&v),
            None => Err(corrupt(&format!("directory {dir} has no parent"))),
        }
    }

    /// Up to `max` entries of directory `ino` after `cookie`.
    pub fn readdir(&self, ino: Ino, cookie: u64, max: u32) -> Result<Vec<DirEntry>, FsError> {
        let dir = self.getattr(ino)?;
        if dir.kind != FileKind::Dir {
            return Err(FsError::NotDir);
        }
        let max = max.clamp(1, 4096) as usize;
        let mut out = Vec::new();
        if cookie < 1 {
            out.push(DirEntry {
                ino,
                kind: FileKind::Dir,
                name: ".".into(),
                cookie: 1,
            });
        }
        if cookie < 2 && out.len() < max {
            out.push(DirEntry {
                ino: self.parent_of(ino)?,
                kind: FileKind::Dir,
                name: "..".into(),
                cookie: 2,
            });
        }
        let start = key_u64s(ino, cookie.saturating_add(1).max(FIRST_ENTRY_COOKIE));
        let end = key_u64s(ino, u64::MAX);
        for item in self.tree(T_DIRINDEX).range(start..=end) {
            if out.len() >= max {
                break;
            }
            let (k, v) = item.map_err(db_err)?;
            let entry: IndexEntry = dec(&v, "directory index")?;
            out.push(DirEntry {
                ino: entry.ino,
                kind: entry.kind,
                name: entry.name,
                cookie: decode_u64(&k[8..])?,
            });
        }
        Ok(out)
    }

    /// A symlink's target.
    pub fn readlink(&self, ino: Ino) -> Result<Vec<u8>, FsError> {
        let attr = self.getattr(ino)?;
        if attr.kind != FileKind::Symlink {
            return Err(FsError::Invalid(format!("inode {ino} is not a symlink")));
        }
        match self.tree(T_SYMLINKS).get(be64(ino)).map_err(db_err)? {
            Some(v) => Ok(v.to_vec()),
            None => Err(corrupt(&format!("symlink {ino} has no target"))),
        }
    }

    /// An xattr's value.
    pub fn getxattr(&self, ino: Ino, name: &str) -> Result<Vec<u8>, FsError> {
        self.getattr(ino)?;
        match self
            .tree(T_XATTRS)
            .get(key2(ino, name.as_bytes()))
            .map_err(db_err)?
        {
            Some(v) => Ok(v.to_vec()),
            None => Err(FsError::NoAttr),
        }
    }

    /// The names of an inode's xattrs.
    pub fn listxattr(&self, ino: Ino) -> Result<Vec<String>, FsError> {
        self.getattr(ino)?;
        let mut names = Vec::new();
        for item in self.tree(T_XATTRS).scan_prefix(be64(ino)) {
            let (k, _) = item.map_err(db_err)?;
            names.push(String::from_utf8_lossy(&k[8..]).into_owned());
        }
        Ok(names)
    }

    /// Inodes unlinked while open (deleted when their last opener goes, or at start).
    pub fn orphans(&self) -> Result<Vec<Ino>, FsError> {
        let mut out = Vec::new();
        for item in self.tree(T_ORPHANS).iter() {
            let (k, _) = item.map_err(db_err)?;
            out.push(decode_u64(&k)?);
        }
        Ok(out)
    }

    /// Whether directory `ino` has no entries (read through the staged writes).
    pub(super) fn is_empty(&self, ino: Ino) -> Result<bool, FsError> {
        match self.tree(T_DIRENTS).scan_prefix(be64(ino)).next() {
            None => Ok(true),
            Some(Ok(_)) => Ok(false),
            Some(Err(e)) => Err(db_err(e)),
        }
    }

    pub(super) fn scan_doomed(&self, ino: Ino) -> Result<Doomed, FsError> {
        Ok(Doomed {
            chunks: self.scan_chunks(ino, 0)?,
            xattrs: self
                .tree(T_XATTRS)
                .scan_prefix(be64(ino))
                .keys()
                .map(|k| k.map(|k| k.to_vec()).map_err(db_err))
                .collect::<Result<_, _>>()?,
        })
    }

    // ---- namespace changes (callers serialize them) -----------------------------------------

    /// Fails unless `ino` is a directory (`NotFound`, `NotDir`).
    pub(super) fn check_dir(&self, ino: Ino) -> Result<(), FsError> {
        match self.getattr(ino)?.kind {
            FileKind::Dir => Ok(()),
            _ => Err(FsError::NotDir),
        }
    }

    /// Checks a name given to `op` in directory `parent` as Linux orders the checks: for `.`
    /// and `..` the parent first (a missing or non-directory parent answers before the name),
    /// then the name with the errno Linux gives for `op` ([`check_name_for`]). A hostile
    /// client need not go through the kernel, which never sends these names, so the meta
    /// server checks every name itself.
    pub(super) fn check_entry_name(
        &self,
        parent: Ino,
        name: &str,
        op: NameOp,
    ) -> Result<(), FsError> {
        if is_dot(name) {
            self.check_dir(parent)?;
        }
        check_name_for(op, name)
    }

    pub(super) fn create(
        &self,
        parent: Ino,
        name: &str,
        caller: Caller,
        node: NewNode<'_>,
    ) -> Result<Attr, FsError> {
        let NewNode {
            kind,
            perm,
            rdev,
            target,
        } = node;
        self.check_entry_name(parent, name, NameOp::Create)?;
        self.tx(|tx| {
            let mut dir = tx.dir(parent)?;
            if tx.dirent(parent, name)?.is_some() {
                return abort(FsError::Exists);
            }
            let ino = tx.next_ino()?;
            let now = Timestamp::now();
            let (perm, gid) = new_node_owner(&dir, kind, perm, caller);
            let attr = Attr {
                ino,
                kind,
                perm,
                nlink: if kind == FileKind::Dir { 2 } else { 1 },
                uid: caller.uid,
                gid,
                rdev,
                size: target.map_or(0, |t| t.len() as u64),
                atime: now,
                mtime: now,
                ctime: now,
                crtime: now,
                generation: 0,
                allocated: 0,
            };
            tx.put_inode(&attr)?;
            tx.add_dirent(parent, name, ino, kind)?;
            if matches!(kind, FileKind::File | FileKind::Dir) {
                // The directory's replication factor, inherited (docs/REPLICAS.md).
                let key = key2(parent, REPLICAS_XATTR.as_bytes());
                if let Some(v) = tx.t(T_XATTRS).get(&key)? {
                    tx.t(T_XATTRS)
                        .insert(key2(ino, REPLICAS_XATTR.as_bytes()), v)?;
                }
            }
            if kind == FileKind::Dir {
                tx.t(T_PARENTS).insert(be64(ino), &be64(parent))?;
                dir.nlink += 1;
            }
            if let Some(target) = target {
                tx.t(T_SYMLINKS).insert(be64(ino), target.as_bytes())?;
            }
            dir.mtime = now;
            dir.ctime = now;
            tx.put_inode(&dir)?;
            Ok(attr)
        })
    }

    /// Creates a file, device node, fifo or socket.
    pub fn mknod(
        &self,
        parent: Ino,
        name: &str,
        kind: FileKind,
        perm: u16,
        rdev: u32,
        caller: Caller,
    ) -> Result<Attr, FsError> {
        if matches!(kind, FileKind::Dir | FileKind::Symlink) {
            return Err(FsError::Invalid(
                "mknod makes no directories or symlinks".into(),
            ));
        }
        self.create(
            parent,
            name,
            caller,
            NewNode {
                kind,
                perm,
                rdev,
                target: None,
            },
        )
    }

    /// Creates a directory.
    pub fn mkdir(
        &self,
        parent: Ino,
        name: &str,
        perm: u16,
        caller: Caller,
    ) -> Result<Attr, FsError> {
        self.create(
            parent,
            name,
            caller,
            NewNode {
                kind: FileKind::Dir,
                perm,
                rdev: 0,
                target: None,
            },
        )
    }

    /// Creates a symlink.
    pub fn symlink(
        &self,
        parent: Ino,
        name: &str,
        target: &str,
        caller: Caller,
    ) -> Result<Attr, FsError> {
        if target.len() > SYMLINK_MAX {
            return Err(FsError::NameTooLong);
        }
        if target.is_empty() || target.contains('\0') {
            return Err(FsError::Invalid("bad symlink target".into()));
        }
        self.create(
            parent,
            name,
            caller,
            NewNode {
                kind: FileKind::Symlink,
                perm: 0o777,
                rdev: 0,
                target: Some(target),
            },
        )
    }

    /// Adds a hard link.
    pub fn link(&self, ino: Ino, new_parent: Ino, new_name: &str) -> Result<Attr, FsError> {
        self.check_entry_name(new_parent, new_name, NameOp::Create)?;
        self.tx(|tx| {
            let mut attr = tx.inode(ino)?;
            if attr.kind == FileKind::Dir {
                return abort(FsError::Perm);
            }
            if attr.nlink == 0 {
                // An unlinked-but-open file cannot be linked back (Linux: ENOENT).
                return abort(FsError::NotFound);
            }
            let mut dir = tx.dir(new_parent)?;
            if tx.dirent(new_parent, new_name)?.is_some() {
                return abort(FsError::Exists);
            }
            let now = Timestamp::now();
            attr.nlink += 1;
            attr.ctime = now;
            tx.put_inode(&attr)?;
            tx.add_dirent(new_parent, new_name, ino, attr.kind)?;
            dir.mtime = now;
            dir.ctime = now;
            tx.put_inode(&dir)?;
            Ok(attr)
        })
    }

    /// Removes a non-directory entry; `is_open(ino)` says whether the inode is open somewhere
    /// (then its last link leaves it as an orphan, deleted at the last release).
    pub fn unlink(
        &self,
        parent: Ino,
        name: &str,
        is_open: impl Fn(Ino) -> bool,
    ) -> Result<Effects, FsError> {
        self.check_entry_name(parent, name, NameOp::Unlink)?;
        let entry = self.get_dirent(parent, name)?;
        let doomed = match &entry {
            Some(e) if e.kind != FileKind::Dir && !is_open(e.ino) => self.scan_doomed(e.ino)?,
            _ => Doomed::default(),
        };
        let open = entry.as_ref().is_some_and(|e| is_open(e.ino));
        self.tx(|tx| {
            let mut dir = tx.dir(parent)?;
            let Some(entry) = tx.dirent(parent, name)? else {
                return abort(FsError::NotFound);
            };
            if entry.kind == FileKind::Dir {
                return abort(FsError::IsDir);
            }
            let now = Timestamp::now();
            tx.remove_dirent(parent, name, &entry)?;
            dir.mtime = now;
            dir.ctime = now;
            tx.put_inode(&dir)?;
            drop_link(tx, entry.ino, open, &doomed, now)
        })
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, parent: Ino, name: &str) -> Result<(), FsError> {
        self.check_entry_name(parent, name, NameOp::Rmdir)?;
        let entry = self.get_dirent(parent, name)?;
        let (doomed, empty) = match &entry {
            Some(e) if e.kind == FileKind::Dir => (self.scan_doomed(e.ino)?, self.is_empty(e.ino)?),
            _ => (Doomed::default(), true),
        };
        self.tx(|tx| {
            let mut dir = tx.dir(parent)?;
            let Some(entry) = tx.dirent(parent, name)? else {
                return abort(FsError::NotFound);
            };
            if entry.kind != FileKind::Dir {
                return abort(FsError::NotDir);
            }
            if !empty {
                return abort(FsError::NotEmpty);
            }
            let now = Timestamp::now();
            tx.remove_dirent(parent, name, &entry)?;
            tx.delete_inode(entry.ino, &doomed)?;
            dir.nlink = dir.nlink.saturating_sub(1);
            dir.mtime = now;
            dir.ctime = now;
            tx.put_inode(&dir)?;
            Ok(())
        })
    }

    /// Renames `parent/name` to `new_parent/new_name` with POSIX replace rules.
    pub fn rename(
        &self,
        parent: Ino,
        name: &str,
        new_parent: Ino,
        new_name: &str,
        no_replace: bool,
        is_open: impl Fn(Ino) -> bool,
    ) -> Result<Effects, FsError> {
        if is_dot(name) || is_dot(new_name) {
            // Linux resolves both parents before it looks at either last name.
            self.check_dir(parent)?;
            self.check_dir(new_parent)?;
        }
        check_name_for(NameOp::RenameFrom, name)?;
        check_name_for(NameOp::RenameTo { no_replace }, new_name)?;
        let src = self.get_dirent(parent, name)?.ok_or(FsError::NotFound)?;
        let dst = self.get_dirent(new_parent, new_name)?;
        if src.kind == FileKind::Dir {
            self.check_not_into_own_subtree(src.ino, new_parent)?;
        }
        let dst_open = dst.as_ref().is_some_and(|d| is_open(d.ino));
        let dst_empty = match &dst {
            Some(d) if d.kind == FileKind::Dir => self.is_empty(d.ino)?,
            _ => true,
        };
        let doomed = match &dst {
            Some(d) if d.ino != src.ino && !dst_open => self.scan_doomed(d.ino)?,
            _ => Doomed::default(),
        };
        self.tx(|tx| {
            tx.dir(parent)?;
            let Some(src) = tx.dirent(parent, name)? else {
                return abort(FsError::NotFound);
            };
            tx.dir(new_parent)?;
            let dst = tx.dirent(new_parent, new_name)?;
            let now = Timestamp::now();
            let mut effects = Effects::default();
            if let Some(dst) = &dst {
                if no_replace {
                    return abort(FsError::Exists);
                }
                if dst.ino == src.ino {
                    // Two links to one inode (or the same name): POSIX says do nothing.
                    return Ok(effects);
                }
                match (src.kind == FileKind::Dir, dst.kind == FileKind::Dir) {
                    (true, false) => return abort(FsError::NotDir),
                    (false, true) => return abort(FsError::IsDir),
                    (true, true) => {
                        if !dst_empty {
                            return abort(FsError::NotEmpty);
                        }
                        tx.remove_dirent(new_parent, new_name, dst)?;
                        tx.delete_inode(dst.ino, &doomed)?;
                        let mut np = tx.inode(new_parent)?;
                        np.nlink = np.nlink.saturating_sub(1);
                        tx.put_inode(&np)?;
                    }
                    (false, false) => {
                        tx.remove_dirent(new_parent, new_name, dst)?;
                        effects = drop_link(tx, dst.ino, dst_open, &doomed, now)?;
                    }
                }
            }
            tx.move_entry((parent, name), (new_parent, new_name), &src, now)?;
            Ok(effects)
        })
    }

    /// Swaps `parent/name` and `new_parent/new_name`, both of which must exist
    /// (`RENAME_EXCHANGE`): each name then refers to the other's inode. A directory that moves
    /// to another parent takes its `..` (parent record and link counts) along; neither may move
    /// into its own subtree. Both inodes' ctimes and both directories' mtimes and ctimes move.
    pub fn exchange(
        &self,
        parent: Ino,
        name: &str,
        new_parent: Ino,
        new_name: &str,
    ) -> Result<Effects, FsError> {
        if is_dot(name) || is_dot(new_name) {
            self.check_dir(parent)?;
            self.check_dir(new_parent)?;
        }
        check_name_for(NameOp::RenameFrom, name)?;
        // Both names are existing entries: the rules of a source name hold for each.
        check_name_for(NameOp::RenameFrom, new_name)?;
        let a = self.get_dirent(parent, name)?.ok_or(FsError::NotFound)?;
        let b = self
            .get_dirent(new_parent, new_name)?
            .ok_or(FsError::NotFound)?;
        if parent != new_parent {
            // A directory moving to the other parent must not land in its own subtree.
            for (moving, into) in [(&a, new_parent), (&b, parent)] {
                if moving.kind == FileKind::Dir {
                    self.check_not_into_own_subtree(moving.ino, into)?;
                }
            }
        }
        self.tx(|tx| {
            tx.dir(parent)?;
            tx.dir(new_parent)?;
            let (Some(a), Some(b)) = (tx.dirent(parent, name)?, tx.dirent(new_parent, new_name)?)
            else {
                return abort(FsError::NotFound);
            };
            if a.ino == b.ino {
                // The same inode under both names (or the same name): nothing changes.
                return Ok(Effects::default());
            }
            let now = Timestamp::now();
            tx.remove_dirent(parent, name, &a)?;
            tx.remove_dirent(new_parent, new_name, &b)?;
            tx.add_dirent(parent, name, b.ino, b.kind)?;
            tx.add_dirent(new_parent, new_name, a.ino, a.kind)?;
            let mut old_dir = tx.inode(parent)?;
            if parent != new_parent {
                let mut np = tx.inode(new_parent)?;
                // `..` links: a directory leaving a parent takes one link with it.
                for (moved, from, to) in [(&a, parent, new_parent), (&b, new_parent, parent)] {
                    if moved.kind == FileKind::Dir {
                        tx.t(T_PARENTS).insert(be64(moved.ino), &be64(to))?;
                        let (from_dir, to_dir) = if from == parent {
                            (&mut old_dir, &mut np)
                        } else {
                            (&mut np, &mut old_dir)
                        };
                        from_dir.nlink = from_dir.nlink.saturating_sub(1);
                        to_dir.nlink += 1;
                    }
                }
                np.mtime = now;
                np.ctime = now;
                tx.put_inode(&np)?;
            }
            old_dir.mtime = now;
            old_dir.ctime = now;
            tx.put_inode(&old_dir)?;
            for ino in [a.ino, b.ino] {
                let mut moved = tx.inode(ino)?;
                moved.ctime = now;
                tx.put_inode(&moved)?;
            }
            Ok(Effects::default())
        })
    }

    /// Deletes an orphan (unlinked while open) once nobody has it open.
    pub fn delete_orphan(&self, ino: Ino) -> Result<Effects, FsError> {
        // Every last close asks; few files are orphans. Callers serialize mutations, so a
        // plain read is exact and spares the scans and a transaction.
        if self
            .tree(T_ORPHANS)
            .get(be64(ino))
            .map_err(db_err)?
            .is_none()
        {
            return Ok(Effects::default());
        }
        let doomed = self.scan_doomed(ino)?;
        self.tx(|tx| {
            if tx.t(T_ORPHANS).get(be64(ino))?.is_none() {
                return Ok(Effects::default());
            }
            tx.delete_inode(ino, &doomed)?;
            Ok(Effects {
                freed: tx.blocks(&doomed.chunks),
                ..Effects::default()
            })
        })
    }

    /// Changes attributes, all in one transaction; enforces ownership for chmod and chown by
    /// non-root callers. A size change applies to regular files only: shrinking bumps the
    /// generation and frees the chunks wholly past the new end (returned in `freed`; the caller
    /// zeroes the tail of the last partial chunk). `old_size` is the file's current size when the
    /// caller knows better than the database (the file control block's, if open).
    pub fn setattr(
        &self,
        ino: Ino,
        set: &SetAttr,
        caller: Caller,
        old_size: Option<u64>,
    ) -> Result<(Attr, Effects), FsError> {
        let layout = self.layout;
        let current = self.getattr(ino)?;
        let old = old_size.unwrap_or(current.size);
        // Chunks wholly past the smaller of the two sizes: past the new size when shrinking
        // (truncate's promise), past the old one when growing — at rest (the caller holds the
        // whole-file lock, so no write is in flight) a chunk there can only be left by a write
        // whose client died before it raised the size, and an extension must read zeros there,
        // not that write's data.
        let doomed = match set.size {
            Some(size) => self.scan_chunks(ino, layout.chunks_below(size.min(old)))?,
            None => Vec::new(),
        };
        self.tx(|tx| {
            let mut attr = tx.inode(ino)?;
            let now = Timestamp::now();
            let mut effects = Effects::default();
            let mut changed = false;
            if let Some(size) = set.size {
                effects = tx.set_size(&mut attr, size, old, &doomed)?;
                attr.mtime = now;
                changed = true;
            }
            changed |= lift(set_owner_and_mode(&mut attr, set, caller))?;
            changed |= set_times(&mut attr, set, now);
            if changed {
                attr.ctime = now;
            }
            tx.put_inode(&attr)?;
            Ok((attr, effects))
        })
    }

    /// Records a file's size (from its file control block) without touching anything else.
    pub fn persist_size(&self, ino: Ino, size: u64) -> Result<(), FsError> {
        self.persist_live(ino, size, 0)
    }

    /// Records what a file's control block holds (`proto::fcb::live`): its size, and its
    /// latest data-change time `mtime_ns` (0: none) as mtime and ctime where it is later.
    pub fn persist_live(&self, ino: Ino, size: u64, mtime_ns: u64) -> Result<(), FsError> {
        // Most closes change nothing (a file opened and closed, or created empty): a plain
        // read settles it without a transaction (callers serialize mutations, so it is exact).
        match self.getattr(ino) {
            Ok(old) if fcb::live(old.clone(), size, mtime_ns) == old => return Ok(()),
            Err(FsError::NotFound) => return Ok(()),
            _ => {}
        }
        self.tx(|tx| {
            let old = match tx.t(T_INODES).get(be64(ino))? {
                Some(v) => lift(dec::<Attr>(&v, "inode"))?,
                None => return Ok(()),
            };
            let attr = fcb::live(old.clone(), size, mtime_ns);
            if attr != old {
                tx.put_inode(&attr)?;
            }
            Ok(())
        })
    }

    /// How many replicas each chunk of `ino` gets: its [`REPLICAS_XATTR`] (inherited from its
    /// directory when it was created), else `default` (the cluster's).
    pub fn replicas_of(&self, ino: Ino, default: usize) -> Result<usize, FsError> {
        match self
            .tree(T_XATTRS)
            .get(key2(ino, REPLICAS_XATTR.as_bytes()))
            .map_err(db_err)?
        {
            Some(v) => proto::parse_replicas(&v),
            None => Ok(default),
        }
    }

    /// Sets an xattr. [`REPLICAS_XATTR`] must be a replication factor
    /// ([`proto::parse_replicas`]).
    pub fn setxattr(
        &self,
        ino: Ino,
        name: &str,
        value: &[u8],
        mode: XattrMode,
    ) -> Result<(), FsError> {
        check_xattr_name(name)?;
        if value.len() > XATTR_VALUE_MAX {
            return Err(FsError::NameTooLong);
        }
        if name == REPLICAS_XATTR {
            proto::parse_replicas(value)?;
        }
        self.tx(|tx| {
            let mut attr = tx.inode(ino)?;
            let key = key2(ino, name.as_bytes());
            let exists = tx.t(T_XATTRS).get(&key)?.is_some();
            match mode {
                XattrMode::Create if exists => return abort(FsError::Exists),
                XattrMode::Replace if !exists => return abort(FsError::NoAttr),
                _ => {}
            }
            tx.t(T_XATTRS).insert(key, value)?;
            attr.ctime = Timestamp::now();
            tx.put_inode(&attr)?;
            Ok(())
        })
    }

    /// Removes an xattr.
    pub fn removexattr(&self, ino: Ino, name: &str) -> Result<(), FsError> {
        check_xattr_name(name)?;
        self.tx(|tx| {
            let mut attr = tx.inode(ino)?;
            if tx.t(T_XATTRS).remove(key2(ino, name.as_bytes()))?.is_none() {
                return abort(FsError::NoAttr);
            }
            attr.ctime = Timestamp::now();
            tx.put_inode(&attr)?;
            Ok(())
        })
    }
}

/// Removes one link of `ino` (its directory entry is gone already): the inode goes when its last
/// link does, unless it is open (then it becomes an orphan).
pub(super) fn drop_link(
    tx: &Tx,
    ino: Ino,
    open: bool,
    doomed: &Doomed,
    now: Timestamp,
) -> TxResult<Effects> {
    let mut attr = tx.inode(ino)?;
    attr.nlink = attr.nlink.saturating_sub(1);
    attr.ctime = now;
    let mut effects = Effects::default();
    if attr.nlink > 0 {
        tx.put_inode(&attr)?;
    } else if open {
        tx.put_inode(&attr)?;
        tx.t(T_ORPHANS).insert(be64(ino), &[][..])?;
        effects.orphaned = Some(ino);
    } else {
        tx.delete_inode(ino, doomed)?;
        effects.freed = tx.blocks(&doomed.chunks);
    }
    Ok(effects)
}

/// Permission bits and group of a node `caller` creates in directory `dir` with bits `perm`:
/// in a set-group-ID directory the node takes the directory's group, and a new directory keeps
/// the set-group-ID bit (POSIX, Linux `inode_init_owner`). The kernel has already removed
/// set-group-ID from a non-directory's `perm` where the caller may not keep it.
pub(super) fn new_node_owner(dir: &Attr, kind: FileKind, perm: u16, caller: Caller) -> (u16, u32) {
    let perm = perm & 0o7777;
    let sgid = libc::S_ISGID as u16;
    if dir.perm & sgid == 0 {
        return (perm, caller.gid);
    }
    let perm = if kind == FileKind::Dir {
        perm | sgid
    } else {
        perm
    };
    (perm, dir.gid)
}

/// Refuses an empty xattr name or one longer than `XATTR_NAME_MAX`.
pub(super) fn check_xattr_name(name: &str) -> Result<(), FsError> {
    if name.is_empty() {
        return Err(FsError::Invalid("empty xattr name".into()));
    }
    if name.len() > XATTR_NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    Ok(())
}

/// Applies the permission bits, set-ID clearing, owner and group of `set` to `attr`, as `caller`
/// may: ownership is enforced for chmod and chown by non-root callers. Whether it changed
/// anything.
pub(super) fn set_owner_and_mode(
    attr: &mut Attr,
    set: &SetAttr,
    caller: Caller,
) -> Result<bool, FsError> {
    let root = caller.uid == 0;
    let owner = caller.uid == attr.uid;
    let mut changed = false;
    if let Some(perm) = set.perm {
        let perm = perm & 0o7777;
        // Anyone may clear set-ID bits and nothing else: the kernel asks so, with the caller's
        // credentials, when a non-owner truncates or writes a set-ID file.
        let only_clears_setid =
            perm & !attr.perm == 0 && (perm ^ attr.perm) & !fcb::SETID_BITS == 0;
        if !root && !owner && !only_clears_setid {
            return Err(FsError::Perm);
        }
        attr.perm = perm;
        changed = true;
    }
    if set.kill_suidgid && attr.kind == FileKind::File {
        let clear = fcb::setid_to_clear(attr.perm);
        if clear != 0 {
            attr.perm &= !clear;
            changed = true;
        }
    }
    if let Some(uid) = set.uid {
        if !root && uid != attr.uid {
            return Err(FsError::Perm);
        }
        attr.uid = uid;
        changed = true;
    }
    if let Some(gid) = set.gid {
        // Non-root owners may change the group (the kernel checks their membership).
        if !root && !owner && gid != attr.gid {
            return Err(FsError::Perm);
        }
        attr.gid = gid;
        changed = true;
    }
    Ok(changed)
}

/// Applies the access and modification times of `set` to `attr` (`now` for "now"). Whether it
/// changed anything.
pub(super) fn set_times(attr: &mut Attr, set: &SetAttr, now: Timestamp) -> bool {
    let at = |t: SetTime| match t {
        SetTime::At(t) => t,
        SetTime::Now => now,
    };
    if let Some(t) = set.atime {
        attr.atime = at(t);
    }
    if let Some(t) = set.mtime {
        attr.mtime = at(t);
    }
    set.atime.is_some() || set.mtime.is_some()
}
