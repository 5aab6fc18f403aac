//! [`NullFs`]: a file system that stores nothing and answers at once — a **measuring tool**,
//! not a file system to keep data in.
//!
//! Mounted through the very FUSE adapter that serves CitronFS ([`crate::fuse::mount`], same
//! mount options, same request threads, same negotiated request sizes), it shows the ceiling of
//! the FUSE path on a machine: what a read or write costs when the file system behind the
//! adapter takes no time at all. `citronfs bench fs --fs null` measures it in the same run as
//! CitronFS and tmpfs and reports CitronFS's ratio to it.
//!
//! What it keeps, all in memory and bounded:
//! - a tree of directories and regular files — up to [`NullFs::MAX_FILES`] of them created over
//!   its life (names, owner, mode, times: enough for `mkdir`, `open(O_CREAT)`, `stat`, `ls`,
//!   `unlink` and `rmdir`, so that `citronfs bench meta --fs null` runs the same phases in the
//!   same directories as on CitronFS);
//! - each file's size: a write raises it to the write's end, a truncate sets it.
//!
//! What it does with data: nothing. A write returns its length and keeps no byte of it; a
//! read returns zeros, as many as asked for up to the file's size. The hot path — [`read`],
//! [`write_as`] — takes no lock and allocates nothing (one atomic on the file's size; reads
//! lend a shared buffer of zeros).
//!
//! [`read`]: FsBackend::read
//! [`write_as`]: FsBackend::write_as

use crate::backend::FsBackend;
use crate::error::Error;
use crate::handles::FileHandle;
use proto::rpc::{check_name_for, NameOp};
use proto::{
    Attr, Caller, DirEntry, FileKind, FsError, FsStats, Ino, SetAttr, SetTime, Timestamp, ROOT_INO,
};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// The first file's inode number (the root is [`ROOT_INO`]).
const FIRST_FILE: Ino = ROOT_INO + 1;

/// Bytes of zeros a read can lend without allocating: the largest FUSE request (16 MiB plus a
/// page). The buffer is never written, so its pages stay the kernel's shared zero page.
const ZEROS: usize = (16 << 20) + 4096;

/// The block size reported (as CitronFS reports its 1 MiB chunks).
const BLOCK: u64 = 1 << 20;

/// The file-system totals reported: a nominal 1 TiB, all of it free (nothing is stored).
const NOMINAL_BLOCKS: u64 = (1 << 40) / BLOCK;

/// A file's attributes other than its size.
#[derive(Clone, Debug)]
struct Meta {
    perm: u16,
    uid: u32,
    gid: u32,
    nlink: u32,
    atime: Timestamp,
    mtime: Timestamp,
    ctime: Timestamp,
    crtime: Timestamp,
}

/// A file or a directory.
#[derive(Clone, Debug)]
struct Node {
    meta: Meta,
    /// A directory's entries (`None`: a file).
    entries: Option<BTreeMap<String, Ino>>,
    /// A directory's parent (the root's own).
    parent: Ino,
}

/// The names and attributes (not on the hot path: one mutex).
#[derive(Default)]
struct Tree {
    /// Every node created and not removed: directories until `rmdir`, files until unlinked
    /// *and* (as far as this tree knows) forever after, since an unlinked file may still be
    /// open.
    nodes: HashMap<Ino, Node>,
    /// The next inode number to give.
    next: Ino,
}

impl Tree {
    /// The entries of directory `ino`.
    fn dir(&self, ino: Ino) -> Result<&BTreeMap<String, Ino>, Error> {
        match self.nodes.get(&ino) {
            Some(Node {
                entries: Some(e), ..
            }) => Ok(e),
            Some(_) => Err(FsError::NotDir.into()),
            None => Err(FsError::NotFound.into()),
        }
    }

    fn dir_mut(&mut self, ino: Ino) -> Result<&mut BTreeMap<String, Ino>, Error> {
        match self.nodes.get_mut(&ino) {
            Some(Node {
                entries: Some(e), ..
            }) => Ok(e),
            Some(_) => Err(FsError::NotDir.into()),
            None => Err(FsError::NotFound.into()),
        }
    }

    /// Adds a node named `name` in `parent` (checked to be a directory without that name).
    fn add(&mut self, parent: Ino, name: &str, node: Node) -> Ino {
        let ino = self.next;
        self.next += 1;
        let (now, subdir) = (node.meta.mtime, node.entries.is_some());
        self.dir_mut(parent)
            .expect("checked by the caller")
            .insert(name.to_string(), ino);
        self.nodes.insert(ino, node);
        self.entries_changed(parent, now, if subdir { 1 } else { 0 });
        ino
    }

    /// Directory `parent`'s entries changed at `now`: its mtime and ctime move, and its link
    /// count by `subdirs` (each subdirectory's `..` links it).
    fn entries_changed(&mut self, parent: Ino, now: Timestamp, subdirs: i32) {
        if let Some(p) = self.nodes.get_mut(&parent) {
            p.meta.nlink = p.meta.nlink.saturating_add_signed(subdirs);
            p.meta.mtime = now;
            p.meta.ctime = now;
        }
    }
}

/// The null file system (see the module docs).
pub struct NullFs {
    tree: Mutex<Tree>,
    /// File sizes, indexed by `ino - FIRST_FILE`: read and raised without the tree's lock.
    sizes: Box<[AtomicU64]>,
    zeros: Vec<u8>,
    /// FLUSH requests received ([`NullFs::flush_requests`]).
    flushes: AtomicU64,
}

impl Default for NullFs {
    fn default() -> Self {
        NullFs::new()
    }
}

impl NullFs {
    /// How many FLUSH requests the kernel sent (one per close(2) unless it honours the
    /// adapter's `FOPEN_NOFLUSH`): what the mount tests check.
    pub fn flush_requests(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }

    /// Files and directories a null file system can create over its life (then `ENOSPC`):
    /// 2 MiB of size words, enough for `bench meta`'s runs (a few tens of thousands).
    pub const MAX_FILES: usize = 1 << 18;

    /// An empty null file system, its root owned by this process.
    pub fn new() -> NullFs {
        NullFs::with_capacity(Self::MAX_FILES)
    }

    /// [`NullFs::new`] with room for `files` files and directories over its life.
    pub fn with_capacity(files: usize) -> NullFs {
        // SAFETY: geteuid and getegid cannot fail and touch no memory.
        let owner = unsafe {
            Caller {
                uid: libc::geteuid(),
                gid: libc::getegid(),
            }
        };
        let created = Timestamp::now();
        let root = Node {
            meta: Meta {
                perm: 0o777,
                uid: owner.uid,
                gid: owner.gid,
                nlink: 2,
                atime: created,
                mtime: created,
                ctime: created,
                crtime: created,
            },
            entries: Some(BTreeMap::new()),
            parent: ROOT_INO,
        };
        NullFs {
            tree: Mutex::new(Tree {
                nodes: HashMap::from([(ROOT_INO, root)]),
                next: FIRST_FILE,
            }),
            sizes: (0..files).map(|_| AtomicU64::new(0)).collect(),
            zeros: vec![0; ZEROS],
            flushes: AtomicU64::new(0),
        }
    }

    fn tree(&self) -> std::sync::MutexGuard<'_, Tree> {
        self.tree.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The size word of file `ino`.
    fn size_of(&self, ino: Ino) -> Result<&AtomicU64, Error> {
        ino.checked_sub(FIRST_FILE)
            .and_then(|i| self.sizes.get(usize::try_from(i).ok()?))
            .ok_or_else(|| FsError::Stale.into())
    }

    fn node_attr(&self, ino: Ino, node: &Node) -> Attr {
        let m = &node.meta;
        let (kind, size) = match node.entries {
            Some(_) => (FileKind::Dir, 0),
            None => (
                FileKind::File,
                self.size_of(ino).map_or(0, |s| s.load(Ordering::Relaxed)),
            ),
        };
        Attr {
            ino,
            kind,
            perm: m.perm,
            nlink: m.nlink,
            uid: m.uid,
            gid: m.gid,
            rdev: 0,
            size,
            atime: m.atime,
            mtime: m.mtime,
            ctime: m.ctime,
            crtime: m.crtime,
            generation: 0,
            allocated: 0,
        }
    }

    fn attr(&self, tree: &Tree, ino: Ino) -> Result<Attr, Error> {
        let node = tree.nodes.get(&ino).ok_or(FsError::NotFound)?;
        Ok(self.node_attr(ino, node))
    }

    /// A new node's inode number is free in the size table (`ENOSPC` once the table is used
    /// up).
    fn check_room(&self, tree: &Tree) -> Result<(), Error> {
        self.size_of(tree.next).map_err(|_| FsError::NoSpace)?;
        Ok(())
    }
}

fn new_meta(caller: Caller, perm: u16, nlink: u32) -> Meta {
    let now = Timestamp::now();
    Meta {
        perm: perm & 0o7777,
        uid: caller.uid,
        gid: caller.gid,
        nlink,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
    }
}

/// The checks of a name for `op`, as the meta server makes them
/// (`proto::rpc::check_name_for`).
fn check_name(op: NameOp, name: &str) -> Result<(), Error> {
    Ok(check_name_for(op, name)?)
}

fn set_time(t: SetTime) -> Timestamp {
    match t {
        SetTime::At(t) => t,
        SetTime::Now => Timestamp::now(),
    }
}

impl FsBackend for NullFs {
    type ReadData<'a> = Cow<'a, [u8]>;

    fn flush(&self, _fh: FileHandle) -> Result<(), Error> {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn fs_name(&self) -> &'static str {
        "citronfs-null"
    }

    fn blksize(&self) -> u64 {
        BLOCK
    }

    fn lookup(&self, parent: Ino, name: &str) -> Result<Attr, Error> {
        let tree = self.tree();
        let ino = *tree.dir(parent)?.get(name).ok_or(FsError::NotFound)?;
        self.attr(&tree, ino)
    }

    fn getattr(&self, ino: Ino) -> Result<Attr, Error> {
        self.attr(&self.tree(), ino)
    }

    fn setattr(&self, _caller: Caller, ino: Ino, set: SetAttr) -> Result<Attr, Error> {
        let mut tree = self.tree();
        if ino == ROOT_INO {
            return Err(FsError::Perm.into());
        }
        let node = tree.nodes.get_mut(&ino).ok_or(FsError::NotFound)?;
        if let Some(size) = set.size {
            if node.entries.is_some() {
                return Err(FsError::IsDir.into());
            }
            self.size_of(ino)?.store(size, Ordering::Relaxed);
            node.meta.mtime = Timestamp::now();
        }
        let meta = &mut node.meta;
        if let Some(perm) = set.perm {
            meta.perm = perm & 0o7777;
        }
        if set.kill_suidgid {
            meta.perm &= !0o6000;
        }
        meta.uid = set.uid.unwrap_or(meta.uid);
        meta.gid = set.gid.unwrap_or(meta.gid);
        if let Some(t) = set.atime {
            meta.atime = set_time(t);
        }
        if let Some(t) = set.mtime {
            meta.mtime = set_time(t);
        }
        meta.ctime = Timestamp::now();
        let node = node.clone();
        Ok(self.node_attr(ino, &node))
    }

    fn open(&self, _caller: Caller, ino: Ino, _flags: i32) -> Result<FileHandle, Error> {
        match self.tree().nodes.get(&ino) {
            Some(Node { entries: None, .. }) => Ok(FileHandle(ino)),
            Some(_) => Err(FsError::IsDir.into()),
            None => Err(FsError::NotFound.into()),
        }
    }

    fn create(
        &self,
        caller: Caller,
        parent: Ino,
        name: &str,
        perm: u16,
        flags: i32,
    ) -> Result<(Attr, FileHandle), Error> {
        check_name(NameOp::Create, name)?;
        let mut tree = self.tree();
        if let Some(&ino) = tree.dir(parent)?.get(name) {
            if flags & libc::O_EXCL != 0 {
                return Err(FsError::Exists.into());
            }
            return match tree.nodes.get(&ino) {
                Some(Node { entries: None, .. }) => Ok((self.attr(&tree, ino)?, FileHandle(ino))),
                _ => Err(FsError::IsDir.into()),
            };
        }
        self.check_room(&tree)?;
        let node = Node {
            meta: new_meta(caller, perm, 1),
            entries: None,
            parent,
        };
        let ino = tree.add(parent, name, node);
        self.size_of(ino)?.store(0, Ordering::Relaxed);
        Ok((self.attr(&tree, ino)?, FileHandle(ino)))
    }

    fn release(&self, _fh: FileHandle) -> Result<(), Error> {
        // A handle is the inode number: nothing to give back.
        Ok(())
    }

    fn read(&self, fh: FileHandle, offset: u64, len: usize) -> Result<Cow<'_, [u8]>, Error> {
        let size = self.size_of(fh.0)?.load(Ordering::Relaxed);
        let n = size
            .saturating_sub(offset)
            .min(len.try_into().unwrap_or(u64::MAX)) as usize;
        Ok(match self.zeros.get(..n) {
            Some(zeros) => Cow::Borrowed(zeros),
            None => Cow::Owned(vec![0; n]),
        })
    }

    /// Zeros written into the caller's buffer: as many bytes as a read of a real file
    /// system writes there, so that the ceiling keeps the one pass over the answer that
    /// CitronFS's read makes.
    fn read_in_place(
        &self,
        fh: FileHandle,
        offset: u64,
        len: usize,
        buf: &mut [u8],
    ) -> Result<usize, Error> {
        let size = self.size_of(fh.0)?.load(Ordering::Relaxed);
        let n = size.saturating_sub(offset).min(len.min(buf.len()) as u64) as usize;
        buf[..n].fill(0);
        Ok(n)
    }

    fn write_as(
        &self,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _kill_suidgid: bool,
    ) -> Result<usize, Error> {
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| FsError::Invalid("write past the largest offset".into()))?;
        self.size_of(fh.0)?.fetch_max(end, Ordering::Relaxed);
        Ok(data.len())
    }

    fn fsync(&self, _fh: FileHandle) -> Result<(), Error> {
        Ok(())
    }

    fn readdir(&self, ino: Ino, cookie: u64, max: u32) -> Result<Vec<DirEntry>, Error> {
        let tree = self.tree();
        let entries = tree.dir(ino)?;
        let parent = tree.nodes.get(&ino).map_or(ROOT_INO, |n| n.parent);
        let kind = |child: Ino| match tree.nodes.get(&child) {
            Some(Node {
                entries: Some(_), ..
            }) => FileKind::Dir,
            _ => FileKind::File,
        };
        let dots = [(".", ino, FileKind::Dir), ("..", parent, FileKind::Dir)];
        let entries = dots
            .into_iter()
            .chain(
                entries
                    .iter()
                    .map(|(name, &child)| (name.as_str(), child, kind(child))),
            )
            .enumerate()
            // Cookie `i + 1` continues after the `i`-th entry. A name created or removed
            // between two calls shifts the later ones: a listing during changes may show an
            // entry twice or miss one, as POSIX allows.
            .skip(usize::try_from(cookie).unwrap_or(usize::MAX))
            .take(max as usize)
            .map(|(i, (name, ino, kind))| DirEntry {
                ino,
                kind,
                name: name.to_string(),
                cookie: i as u64 + 1,
            })
            .collect();
        Ok(entries)
    }

    fn statfs(&self) -> Result<FsStats, Error> {
        let tree = self.tree();
        let used = tree.nodes.len() as u64;
        let left = (self.sizes.len() as u64 + FIRST_FILE).saturating_sub(tree.next);
        Ok(FsStats {
            block_size: BLOCK,
            total_blocks: NOMINAL_BLOCKS,
            free_blocks: NOMINAL_BLOCKS,
            inodes: used + left,
            free_inodes: left,
        })
    }

    fn unlink(&self, parent: Ino, name: &str) -> Result<(), Error> {
        check_name(NameOp::Unlink, name)?;
        let mut tree = self.tree();
        let ino = *tree.dir(parent)?.get(name).ok_or(FsError::NotFound)?;
        if tree.dir(ino).is_ok() {
            return Err(FsError::IsDir.into());
        }
        tree.dir_mut(parent)?.remove(name);
        let now = Timestamp::now();
        if let Some(file) = tree.nodes.get_mut(&ino) {
            file.meta.nlink = 0;
            file.meta.ctime = now;
        }
        tree.entries_changed(parent, now, 0);
        Ok(())
    }

    fn mkdir(&self, caller: Caller, parent: Ino, name: &str, perm: u16) -> Result<Attr, Error> {
        check_name(NameOp::Create, name)?;
        let mut tree = self.tree();
        if tree.dir(parent)?.contains_key(name) {
            return Err(FsError::Exists.into());
        }
        self.check_room(&tree)?;
        let node = Node {
            meta: new_meta(caller, perm, 2),
            entries: Some(BTreeMap::new()),
            parent,
        };
        let ino = tree.add(parent, name, node);
        self.attr(&tree, ino)
    }

    fn rmdir(&self, parent: Ino, name: &str) -> Result<(), Error> {
        check_name(NameOp::Unlink, name)?;
        let mut tree = self.tree();
        let ino = *tree.dir(parent)?.get(name).ok_or(FsError::NotFound)?;
        if !tree.dir(ino)?.is_empty() {
            return Err(FsError::NotEmpty.into());
        }
        tree.dir_mut(parent)?.remove(name);
        tree.nodes.remove(&ino);
        tree.entries_changed(parent, Timestamp::now(), -1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> Caller {
        Caller { uid: 0, gid: 0 }
    }

    #[test]
    fn reads_zeros_up_to_the_size_writes_keep_nothing() {
        let fs = NullFs::new();
        let (attr, fh) = fs.create(me(), ROOT_INO, "a", 0o644, 0).unwrap();
        assert_eq!((attr.kind, attr.size), (FileKind::File, 0));
        assert!(fs.read(fh, 0, 4096).unwrap().is_empty());
        assert_eq!(fs.write_as(fh, 8192, &[7; 4096], false).unwrap(), 4096);
        assert_eq!(fs.getattr(attr.ino).unwrap().size, 12288);
        // A write below the end does not shrink the file.
        fs.write_as(fh, 0, &[7; 10], false).unwrap();
        assert_eq!(fs.lookup(ROOT_INO, "a").unwrap().size, 12288);
        let data = fs.read(fh, 4096, 4096).unwrap();
        assert_eq!(&*data, &[0u8; 4096][..], "zeros, not what was written");
        assert_eq!(
            fs.read(fh, 10240, 4096).unwrap().len(),
            2048,
            "short at the end"
        );
        assert!(fs.read(fh, 1 << 30, 1).unwrap().is_empty());
        // Larger than the shared buffer of zeros: still zeros, still the length asked.
        fs.setattr(
            me(),
            attr.ino,
            SetAttr {
                size: Some(64 << 20),
                ..SetAttr::default()
            },
        )
        .unwrap();
        let big = fs.read(fh, 0, 32 << 20).unwrap();
        assert!(big.len() == 32 << 20 && big.iter().all(|&b| b == 0));
    }

    #[test]
    fn names_come_and_go() {
        let fs = NullFs::new();
        let (a, _) = fs.create(me(), ROOT_INO, "a", 0o600, 0).unwrap();
        let (b, _) = fs.create(me(), ROOT_INO, "b", 0o600, 0).unwrap();
        assert_ne!(a.ino, b.ino);
        // open(O_CREAT) of an existing name opens it; O_EXCL refuses.
        assert_eq!(
            fs.create(me(), ROOT_INO, "a", 0o600, 0).unwrap().0.ino,
            a.ino
        );
        assert!(matches!(
            fs.create(me(), ROOT_INO, "a", 0o600, libc::O_EXCL),
            Err(Error::Fs(FsError::Exists))
        ));
        let names = |fs: &NullFs| -> Vec<String> {
            let mut all = Vec::new();
            let mut cookie = 0;
            loop {
                let page = fs.readdir(ROOT_INO, cookie, 2).unwrap();
                let Some(last) = page.last() else { break };
                cookie = last.cookie;
                all.extend(page.into_iter().map(|e| e.name));
            }
            all
        };
        assert_eq!(names(&fs), [".", "..", "a", "b"]);
        fs.unlink(ROOT_INO, "a").unwrap();
        assert_eq!(names(&fs), [".", "..", "b"]);
        assert!(matches!(
            fs.lookup(ROOT_INO, "a"),
            Err(Error::Fs(FsError::NotFound))
        ));
        // Still there for whoever holds it open.
        assert_eq!(fs.getattr(a.ino).unwrap().nlink, 0);
    }

    #[test]
    fn directories_hold_files_and_go_when_empty() {
        let fs = NullFs::new();
        let d = fs.mkdir(me(), ROOT_INO, "d", 0o755).unwrap();
        assert_eq!((d.kind, d.nlink), (FileKind::Dir, 2));
        assert_eq!(
            fs.getattr(ROOT_INO).unwrap().nlink,
            3,
            "the subdirectory's '..'"
        );
        assert!(matches!(
            fs.mkdir(me(), ROOT_INO, "d", 0o755),
            Err(Error::Fs(FsError::Exists))
        ));
        let (f, _) = fs.create(me(), d.ino, "f", 0o644, 0).unwrap();
        assert_eq!(fs.lookup(d.ino, "f").unwrap().ino, f.ino);
        assert!(matches!(
            fs.lookup(ROOT_INO, "f"),
            Err(Error::Fs(FsError::NotFound))
        ));
        assert!(matches!(
            fs.create(me(), f.ino, "g", 0o644, 0),
            Err(Error::Fs(FsError::NotDir))
        ));
        let listed: Vec<(String, Ino)> = fs
            .readdir(d.ino, 0, 10)
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.ino))
            .collect();
        assert_eq!(
            listed,
            [
                (".".to_string(), d.ino),
                ("..".to_string(), ROOT_INO),
                ("f".to_string(), f.ino)
            ]
        );
        assert!(matches!(
            fs.rmdir(ROOT_INO, "d"),
            Err(Error::Fs(FsError::NotEmpty))
        ));
        assert!(matches!(
            fs.unlink(ROOT_INO, "d"),
            Err(Error::Fs(FsError::IsDir))
        ));
        fs.unlink(d.ino, "f").unwrap();
        fs.rmdir(ROOT_INO, "d").unwrap();
        assert!(matches!(
            fs.lookup(ROOT_INO, "d"),
            Err(Error::Fs(FsError::NotFound))
        ));
        assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 2);
    }

    #[test]
    fn the_table_is_bounded() {
        let fs = NullFs::with_capacity(64);
        fs.mkdir(me(), ROOT_INO, "d", 0o755).unwrap();
        for i in 1..64 {
            fs.create(me(), ROOT_INO, &format!("f{i}"), 0o600, 0)
                .unwrap();
        }
        assert!(matches!(
            fs.create(me(), ROOT_INO, "one-too-many", 0o600, 0),
            Err(Error::Fs(FsError::NoSpace))
        ));
        assert!(matches!(
            fs.read(FileHandle(u64::MAX), 0, 1),
            Err(Error::Fs(FsError::Stale))
        ));
    }
}
