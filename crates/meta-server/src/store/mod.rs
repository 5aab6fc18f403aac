//! The namespace in sled: inodes, directory entries, xattrs, symlink targets, chunk maps and the
//! data servers' chunk allocation state.
//!
//! # Trees and keys (all integers big-endian, so that key order is numeric order)
//!
//! | tree        | key                         | value                                        |
//! | ----------- | --------------------------- | -------------------------------------------- |
//! | `inodes`    | ino                         | postcard [`Attr`]                            |
//! | `parents`   | dir ino                     | its parent's ino (the root is its own parent) |
//! | `dirents`   | dir ino ++ name             | postcard `Dirent { ino, kind, cookie }`      |
//! | `dirindex`  | dir ino ++ cookie           | postcard `IndexEntry { ino, kind, name }`    |
//! | `cookies`   | dir ino                     | the next cookie to hand out in that dir       |
//! | `xattrs`    | ino ++ name                 | value                                        |
//! | `symlinks`  | ino                         | target                                       |
//! | `chunks`    | ino ++ chunk index          | per replica, the first placed first: server (u32) ++ offset in its region in layout units (u64) (one replica: the format of before replicas) |
//! | `servers`   | server id (u32)             | postcard [`ServerRecord`]                    |
//! | `names`     | server name                 | server id (u32)                              |
//! | `free`      | server id ++ order (u8) ++ slot | unit offset: the server's stack of zeroed free blocks of that order |
//! | `freeidx`   | server id ++ unit offset    | order (u8) ++ slot: where a free block sits in its stack |
//! | `dirty`     | server id ++ unit offset    | order (u8): freed blocks not yet zeroed      |
//! | `orphans`   | ino                         | empty: unlinked (nlink 0) but still open     |
//! | `meta`      | a name                      | counters and settings (`next_ino`, `chunk_size`, `layout`, ...) |
//! | `incarnations` | server id (u32)          | the incarnation it last registered with (u64) |
//! | `lost`      | server id ++ chunk index    | ino ++ chunk index: a file's chunk whose data is gone |
//! | `tails`     | server id ++ unit offset    | offset in the chunk ++ the chunk's order (u8): bytes from there to its end still to be zeroed (a shrinking truncate) |
//! | `scrub`     | server id (u32)             | empty: the server's free chunks may hold data (an unclean shutdown) |
//!
//! # Space: the geometric layout and a buddy allocator
//!
//! A file's chunk `k` holds `unit · 2^order(k)` bytes ([`proto::layout`]: 4 KiB, 4 KiB, 8 KiB,
//! ... up to the chunk size, then chunk-size chunks), so a file is charged less than twice its
//! size above 4 KiB. A server's region is `chunks` blocks of the chunk size (order `L`); a
//! *block* of order `o` is `2^o` units at a unit offset that is a multiple of `2^o`. Blocks are
//! handed out buddy-style: the smallest free block of at least the order asked is split, its
//! upper halves going onto the free stacks of the orders below; a block given back (zeroed)
//! merges with its buddy while the buddy is free at the same order. Each order has a stack
//! (slots `0..free_counts[order]` of the server record, so a transaction pops without a scan)
//! and `freeidx` finds a free block by offset (to merge, the buddy leaves the middle of its
//! stack: the top entry takes its slot).
//!
//! # Invariants
//! - Every mutating operation is one transaction over all trees (`staged`: visible to
//!   every read when it returns, written to sled behind it, all of it or none of it after a
//!   crash); callers serialize mutations (the service holds its state lock around each), so
//!   the key scans some operations do just before their transaction (chunk maps and xattrs of
//!   an inode to delete, whether a directory is empty) are exact. (Those scans are outside the
//!   transaction closure for a reason that is gone: sled 0.34 deadlocked a plain read issued
//!   inside one of its own transactions, and this store no longer opens any.)
//! - Every unit of a server's region is in exactly one block of: a file's chunk map (the
//!   block's order is the layout's for the chunk index), a `free` stack (with its `freeidx`
//!   entry naming that stack and slot), the `dirty` set, or above the server's `next_fresh`
//!   mark (counted in chunk-size blocks: never used). Blocks in `free` and above `next_fresh`
//!   are zero; `dirty` blocks are zeroed by the service before they move to `free` (so a
//!   reused block reads zeros), and only zeroed blocks merge (a free block's buddy is merged
//!   only when it is free too), so a merged block is zero.
//! - A chunk in `lost` is in the chunk map it names: its data server came back with new memory
//!   (a new incarnation) while the chunk held file data, or the replica was dropped when its
//!   server went down while another replica was live (`dropped`). Chunk-map answers leave it
//!   out, and fail with `FsError::Lost` (never zeros) when every replica of the chunk is;
//!   freeing it (truncate, unlink) clears the mark.
//! - Bytes of a file's chunks beyond its size are zero, except in a chunk named in `tails`
//!   from the offset recorded there: a shrinking truncate records its tail in the same
//!   transaction, and the service zeroes it only once that transaction is durable (then drops
//!   the record), so that a crash never leaves the old size with a zeroed tail; a record left
//!   by a crash is zeroed when the chunk's server registers.
//! - After an unclean shutdown (the `running` mark of `meta` was still set at open), every
//!   known server is put in `scrub`: allocations the crash rolled back put chunks that clients
//!   had written back on the free stack (or above `next_fresh`), so a server's free chunks are
//!   zeroed when it registers, before any of them is allocated again.
//! - Directory cookies: `.` is 1, `..` is 2, entries get 3, 4, ... in creation order per
//!   directory; a cookie is never reused in that directory, so listing "after cookie c" is stable
//!   across concurrent creates and deletes.
//!
//! # Files
//! The database is one [`Store`] (one sled database; a transaction spans every tree), its
//! operations kept by concern: this file opens and persists it (trees, keys, the transaction
//! view, flushes, the clean-shutdown mark); `namespace` holds the namespace transactions
//! (inodes, entries, symlinks, xattrs); `space` holds the chunk maps and the data servers'
//! blocks (allocation, freeing, dirty and free stacks, tails, scrubs, lost chunks); `image`
//! reads the whole database for the consistency checker and applies its repairs.

use crate::staged::{db_err, Staged, StagedTree, TxTree, TxView};
use proto::fcb;
use proto::layout::Layout;
use proto::rpc::XattrMode;
use proto::rpc::{check_name_for, is_dot, NameOp};
use proto::{
    Attr, Caller, ChunkLoc, DirEntry, FabricAddr, FileKind, FsError, Ino, Replicas, SetAttr,
    SetTime, Timestamp, MAX_REPLICAS, NAME_MAX, REPLICAS_XATTR, ROOT_INO, SYMLINK_MAX,
    XATTR_NAME_MAX, XATTR_VALUE_MAX,
};
use serde::{Deserialize, Serialize};
use sled::transaction::ConflictableTransactionError;
use std::path::Path;

mod dropped;
mod image;
mod namespace;
mod rereplicate;
mod space;

pub use dropped::Dropped;
#[cfg(any(test, feature = "test-hooks"))]
pub use image::Corruption;
pub(crate) use image::{Image, ImageEntry};
pub use rereplicate::{Pending, Short};

/// Most chunks one `AllocateChunks` or `ChunkMap` call may name (a 1 MiB chunk size makes this
/// 64 GiB): bounds the work one request can cause.
pub const MAX_CHUNKS_PER_CALL: u64 = 1 << 16;

const T_INODES: usize = 0;
const T_PARENTS: usize = 1;
const T_DIRENTS: usize = 2;
const T_DIRINDEX: usize = 3;
const T_COOKIES: usize = 4;
const T_XATTRS: usize = 5;
const T_SYMLINKS: usize = 6;
const T_CHUNKS: usize = 7;
const T_SERVERS: usize = 8;
const T_NAMES: usize = 9;
const T_FREE: usize = 10;
const T_DIRTY: usize = 11;
const T_ORPHANS: usize = 12;
const T_META: usize = 13;
const T_INCARNATIONS: usize = 14;
const T_LOST: usize = 15;
const T_TAILS: usize = 16;
const T_SCRUB: usize = 17;
const T_FREEIDX: usize = 18;
const TREE_NAMES: [&str; 19] = [
    "inodes",
    "parents",
    "dirents",
    "dirindex",
    "cookies",
    "xattrs",
    "symlinks",
    "chunks",
    "servers",
    "names",
    "free",
    "dirty",
    "orphans",
    "meta",
    "incarnations",
    "lost",
    "tails",
    "scrub",
    "freeidx",
];

/// The `layout` mark of `meta`: chunks follow [`proto::layout`] and `ChunkLoc::index` counts
/// layout units. A database without it whose servers hold chunks was made by a CitronFS whose
/// chunks were all the chunk size: its maps cannot be read with this layout.
const LAYOUT_MARK: &[u8] = b"geometric-1";

/// The `inodes` mark of `meta`: every inode record carries [`Attr::allocated`]. A database
/// without it is upgraded when it opens ([`Store::upgrade_inodes`]).
const INODES_MARK: &[u8] = b"allocated-1";

/// An inode record as CitronFS wrote it before [`Attr::allocated`], read as one of now.
/// postcard writes a struct's fields in order, and `allocated` is the last, so the old record
/// is the new one without its last field; a `u64` of 0 is the one byte 0. `None` if the bytes
/// are not such a record either.
fn attr_before_allocated(record: &[u8]) -> Option<Attr> {
    let mut bytes = Vec::with_capacity(record.len() + 1);
    bytes.extend_from_slice(record);
    bytes.push(0);
    postcard::from_bytes(&bytes).ok()
}

const FIRST_ENTRY_COOKIE: u64 = 3;

/// Fails unless `attr` is a regular file's: only those have chunks.
fn check_has_chunks(attr: &Attr) -> Result<(), FsError> {
    match attr.kind {
        FileKind::File => Ok(()),
        FileKind::Dir => Err(FsError::IsDir),
        _ => Err(FsError::Invalid("only regular files have chunks".into())),
    }
}

/// A data server as the meta server remembers it across restarts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerRecord {
    /// Its id (dense from 0, stable by name).
    pub id: u32,
    /// Its stable name.
    pub name: String,
    /// Where it last said its region is.
    pub fabric: FabricAddr,
    /// Its chunk region.
    pub region: fabric::RegionId,
    /// Chunk-size blocks its region holds.
    pub chunks: u64,
    /// Chunk-size blocks `next_fresh..chunks` have never been allocated (and are zero).
    pub next_fresh: u64,
    /// Entries in its `free` stack of each order `0..=L` (slots `0..free_counts[order]`).
    pub free_counts: Vec<u64>,
    /// Its failure domain as it last registered (`citronfs data-server --zone`); `None`: it
    /// named none, or its record was written before zones (see [`ServerRecord::decode`]).
    pub zone: Option<String>,
}

impl ServerRecord {
    /// A stored record: one of now, or one written before [`ServerRecord::zone`] existed. postcard
    /// writes a struct's fields in order and `zone` is the last, so an old record is a new one
    /// without it, and a `None` is the one byte 0: an old record decodes with no zone. (A record
    /// of now with no zone is the old one plus that byte, which an older CitronFS reads too:
    /// postcard ignores bytes after a value.)
    pub(crate) fn decode(v: &[u8]) -> Result<ServerRecord, FsError> {
        match postcard::from_bytes(v) {
            Ok(rec) => Ok(rec),
            Err(postcard::Error::DeserializeUnexpectedEnd) => {
                let mut bytes = Vec::with_capacity(v.len() + 1);
                bytes.extend_from_slice(v);
                bytes.push(0);
                dec(&bytes, "server record")
            }
            Err(e) => Err(corrupt(&format!("server record: {e}"))),
        }
    }

    /// The zone replicas are spread over: its label, else a zone of its own (an unlabelled
    /// server is its own failure domain).
    pub(crate) fn zone_key(&self) -> ZoneKey {
        match &self.zone {
            Some(zone) => ZoneKey::Named(zone.clone()),
            None => ZoneKey::Alone(self.id),
        }
    }

    /// Layout units not in any file (free, never used, or `dirty_units` freed and not yet
    /// zeroed), with chunk-size blocks of order `max_order`.
    pub fn unallocated_units(&self, max_order: u32, dirty_units: u64) -> u64 {
        let free: u64 = self
            .free_counts
            .iter()
            .enumerate()
            .map(|(order, n)| n << order)
            .sum();
        (self.chunks.saturating_sub(self.next_fresh) << max_order) + free + dirty_units
    }
}

/// A failure domain as placement compares them: a `--zone` label, or an unlabelled server alone.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ZoneKey {
    /// The servers labelled with this zone.
    Named(String),
    /// The unlabelled server of this id.
    Alone(u32),
}

/// A block of a data server's region: where it starts and its order (`2^order` units).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Block {
    /// The server and the unit offset.
    pub loc: ChunkLoc,
    /// Its size is `unit << order`.
    pub order: u32,
}

fn free_key(server: u32, order: u32, slot: u64) -> [u8; 13] {
    let mut k = [0u8; 13];
    k[..4].copy_from_slice(&server.to_be_bytes());
    k[4] = order as u8;
    k[5..].copy_from_slice(&slot.to_be_bytes());
    k
}

fn decode_free_key(k: &[u8]) -> Result<(u32, u32, u64), FsError> {
    if k.len() != 13 {
        return Err(corrupt("a free-stack key is not 13 bytes"));
    }
    Ok((
        u32::from_be_bytes(k[..4].try_into().expect("4 bytes")),
        u32::from(k[4]),
        u64::from_be_bytes(k[5..].try_into().expect("8 bytes")),
    ))
}

fn encode_slot(order: u32, slot: u64) -> [u8; 9] {
    let mut v = [0u8; 9];
    v[0] = order as u8;
    v[1..].copy_from_slice(&slot.to_be_bytes());
    v
}

fn decode_slot(v: &[u8]) -> Result<(u32, u64), FsError> {
    if v.len() != 9 {
        return Err(corrupt("a free-index entry is not 9 bytes"));
    }
    Ok((u32::from(v[0]), decode_u64(&v[1..])?))
}

fn decode_order(v: &[u8]) -> Result<u32, FsError> {
    match v {
        [o] => Ok(u32::from(*o)),
        _ => Err(corrupt("a block order is not 1 byte")),
    }
}

/// A tail record: the offset in the chunk, then the chunk's order.
fn encode_tail(from: u64, order: u32) -> [u8; 9] {
    let mut v = [0u8; 9];
    v[..8].copy_from_slice(&from.to_be_bytes());
    v[8] = order as u8;
    v
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Dirent {
    ino: Ino,
    kind: FileKind,
    cookie: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct IndexEntry {
    ino: Ino,
    kind: FileKind,
    name: String,
}

fn be64(x: u64) -> [u8; 8] {
    x.to_be_bytes()
}

fn key2(a: u64, b: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(8 + b.len());
    k.extend_from_slice(&a.to_be_bytes());
    k.extend_from_slice(b);
    k
}

fn key_u64s(a: u64, b: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&a.to_be_bytes());
    k[8..].copy_from_slice(&b.to_be_bytes());
    k
}

fn key_server(server: u32, x: u64) -> [u8; 12] {
    let mut k = [0u8; 12];
    k[..4].copy_from_slice(&server.to_be_bytes());
    k[4..].copy_from_slice(&x.to_be_bytes());
    k
}

fn decode_u64(v: &[u8]) -> Result<u64, FsError> {
    v.try_into()
        .map(u64::from_be_bytes)
        .map_err(|_| corrupt("a counter is not 8 bytes"))
}

fn encode_loc(loc: ChunkLoc) -> [u8; 12] {
    key_server(loc.server, loc.index)
}

fn decode_loc(v: &[u8]) -> Result<ChunkLoc, FsError> {
    if v.len() != 12 {
        return Err(corrupt("a chunk location is not 12 bytes"));
    }
    Ok(ChunkLoc {
        server: u32::from_be_bytes(v[..4].try_into().expect("4 bytes")),
        index: u64::from_be_bytes(v[4..].try_into().expect("8 bytes")),
    })
}

/// The value of a `chunks` entry: each replica's location, the first placed first.
fn encode_replicas(replicas: &Replicas) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 * replicas.len());
    for loc in replicas.as_slice() {
        out.extend_from_slice(&encode_loc(*loc));
    }
    out
}

/// A `chunks` entry's value: 1 to `MAX_REPLICAS` locations on distinct servers.
fn decode_replicas(v: &[u8]) -> Result<Replicas, FsError> {
    if v.is_empty() || v.len() % 12 != 0 || v.len() / 12 > MAX_REPLICAS {
        return Err(corrupt(&format!(
            "a chunk's replica set is {} bytes, not 12 per replica",
            v.len()
        )));
    }
    let mut locs = [ChunkLoc {
        server: 0,
        index: 0,
    }; MAX_REPLICAS];
    let n = v.len() / 12;
    for (i, loc) in v.chunks_exact(12).enumerate() {
        locs[i] = decode_loc(loc)?;
    }
    Replicas::new(&locs[..n]).map_err(|e| corrupt(&e.to_string()))
}

/// Two big-endian u64s (a `key_u64s` key).
fn decode_u64_pair(v: &[u8]) -> Result<(u64, u64), FsError> {
    if v.len() != 16 {
        return Err(corrupt("a pair of u64 is not 16 bytes"));
    }
    Ok((decode_u64(&v[..8])?, decode_u64(&v[8..])?))
}

fn corrupt(what: &str) -> FsError {
    FsError::Io(format!("meta database corrupt: {what}"))
}

fn enc<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("postcard encodes plain structs")
}

fn dec<T: for<'de> Deserialize<'de>>(v: &[u8], what: &str) -> Result<T, FsError> {
    postcard::from_bytes(v).map_err(|e| corrupt(&format!("{what}: {e}")))
}

type TxResult<T> = Result<T, ConflictableTransactionError<FsError>>;

fn abort<T>(e: FsError) -> TxResult<T> {
    Err(ConflictableTransactionError::Abort(e))
}

/// Lifts an `FsError` result into a transaction result (aborting with it).
fn lift<T>(r: Result<T, FsError>) -> TxResult<T> {
    r.map_err(ConflictableTransactionError::Abort)
}

/// What committed transactions changed, for the meta server's one-sided tables.
#[derive(Default)]
struct Touched {
    /// Inodes written or deleted (the attribute table: [`Store::take_touched`]).
    inos: Vec<Ino>,
    /// Directory entries added or removed, in the order they happened (the entry table:
    /// [`Store::take_entry_changes`]).
    entries: Vec<EntryChange>,
}

/// A directory entry added (`ino` is `Some`) or removed (`None`) by a committed transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryChange {
    /// The directory.
    pub parent: Ino,
    /// The entry's name.
    pub name: String,
    /// The inode it names now, or `None`: removed.
    pub ino: Option<Ino>,
}

/// One transaction's view of every tree, with typed accessors, the file layout, and what it
/// changed (for [`Store::take_touched`] and [`Store::take_entry_changes`]).
struct Tx<'a>(&'a TxView<'a>, Layout, &'a std::cell::RefCell<Touched>);

impl Tx<'_> {
    fn t(&self, i: usize) -> TxTree<'_> {
        self.0.tree(i)
    }

    fn touch(&self, ino: Ino) {
        self.2.borrow_mut().inos.push(ino);
    }

    fn entry_changed(&self, parent: Ino, name: &str, ino: Option<Ino>) {
        self.2.borrow_mut().entries.push(EntryChange {
            parent,
            name: name.to_owned(),
            ino,
        });
    }

    fn inode(&self, ino: Ino) -> TxResult<Attr> {
        match self.t(T_INODES).get(be64(ino))? {
            Some(v) => lift(dec(&v, "inode")),
            None => abort(FsError::NotFound),
        }
    }

    fn put_inode(&self, attr: &Attr) -> TxResult<()> {
        self.touch(attr.ino);
        self.t(T_INODES).insert(be64(attr.ino), enc(attr))?;
        Ok(())
    }

    fn dir(&self, ino: Ino) -> TxResult<Attr> {
        let attr = self.inode(ino)?;
        if attr.kind != FileKind::Dir {
            return abort(FsError::NotDir);
        }
        Ok(attr)
    }

    fn dirent(&self, parent: Ino, name: &str) -> TxResult<Option<Dirent>> {
        match self.t(T_DIRENTS).get(key2(parent, name.as_bytes()))? {
            Some(v) => Ok(Some(lift(dec(&v, "directory entry"))?)),
            None => Ok(None),
        }
    }

    /// Adds an entry. The parent counts as touched (its size and times changed: its slot in
    /// the attribute table is republished), and the entry as changed (the entry table).
    fn add_dirent(&self, parent: Ino, name: &str, ino: Ino, kind: FileKind) -> TxResult<()> {
        self.touch(parent);
        self.entry_changed(parent, name, Some(ino));
        let cookie = match self.t(T_COOKIES).get(be64(parent))? {
            Some(v) => lift(decode_u64(&v))?,
            None => FIRST_ENTRY_COOKIE,
        };
        self.t(T_COOKIES).insert(be64(parent), &be64(cookie + 1))?;
        self.t(T_DIRENTS).insert(
            key2(parent, name.as_bytes()),
            enc(&Dirent { ino, kind, cookie }),
        )?;
        self.t(T_DIRINDEX).insert(
            key_u64s(parent, cookie),
            enc(&IndexEntry {
                ino,
                kind,
                name: name.to_owned(),
            }),
        )?;
        Ok(())
    }

    /// Removes an entry; the parent counts as touched and the entry as changed (see
    /// `add_dirent`).
    fn remove_dirent(&self, parent: Ino, name: &str, entry: &Dirent) -> TxResult<()> {
        self.touch(parent);
        self.entry_changed(parent, name, None);
        self.t(T_DIRENTS).remove(key2(parent, name.as_bytes()))?;
        self.t(T_DIRINDEX).remove(key_u64s(parent, entry.cookie))?;
        Ok(())
    }

    fn next_ino(&self) -> TxResult<Ino> {
        let next = match self.t(T_META).get(b"next_ino")? {
            Some(v) => lift(decode_u64(&v))?,
            None => ROOT_INO + 1,
        };
        self.t(T_META).insert(b"next_ino", &be64(next + 1))?;
        Ok(next)
    }
}

/// What a new inode is.
struct NewNode<'a> {
    kind: FileKind,
    perm: u16,
    rdev: u32,
    /// A symlink's target.
    target: Option<&'a str>,
}

/// What deleting an inode removes besides its own records, scanned before the transaction.
#[derive(Default)]
struct Doomed {
    chunks: Vec<(u64, ChunkLoc)>,
    xattrs: Vec<Vec<u8>>,
}

/// What a namespace change did that the service must follow up on.
#[derive(Debug, Default)]
pub struct Effects {
    /// Blocks freed (now dirty): zero them, then [`Store::recycle`] them.
    pub freed: Vec<Block>,
    /// The replicas of a chunk whose bytes from an offset on (to its end) are to be zeroed
    /// once the change is durable, then [`Store::tail_zeroed`] (a shrinking truncate).
    pub tails: Vec<Tail>,
    /// An inode whose last link went while it is open: deleted at its last release.
    pub orphaned: Option<Ino>,
}

/// A chunk's tail to zero: bytes `from..block size` of `block`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tail {
    /// The chunk.
    pub block: Block,
    /// The first byte to zero, from the chunk's start.
    pub from: u64,
}

/// How far inode numbers jump at a start after a crash (see [`Store::open`]): more than a
/// meta server can hand out between two of sled's flushes (every 500 ms), so that no number
/// given out before a crash and lost with it is given out again; 2^32 crashes fit in the
/// 64-bit space.
const INO_SKIP_AFTER_CRASH: u64 = 1 << 32;

/// The sled database of one meta server, written behind (`staged`).
pub struct Store {
    staged: Staged,
    layout: Layout,
    /// Inodes written or deleted by committed transactions since the last
    /// [`Store::take_touched`]: the meta server republishes their attributes; and the
    /// directory entries they changed, in commit order ([`Store::take_entry_changes`]).
    touched: std::sync::Mutex<Touched>,
    /// Whether an allocation has logged that replicas of a chunk share a zone (once).
    warned_shared_zone: std::sync::atomic::AtomicBool,
}

impl Store {
    /// Opens sled in `dir` (`staged::open_sled`, which waits out the lock of a database just
    /// closed in this process) and every tree of the namespace, touching nothing.
    fn open_trees(dir: &Path, chunk_size: u64) -> anyhow::Result<Store> {
        let layout = Layout::new(chunk_size).map_err(|e| anyhow::anyhow!("{e}"))?;
        let db = crate::staged::open_sled(dir).map_err(|e| {
            anyhow::anyhow!("cannot open the meta database in {}: {e}", dir.display())
        })?;
        let trees = TREE_NAMES
            .iter()
            .map(|n| db.open_tree(n))
            .collect::<Result<Vec<_>, _>>()?;
        let staged = Staged::new(db, trees).map_err(|e| {
            anyhow::anyhow!("cannot open the meta database in {}: {e}", dir.display())
        })?;
        Ok(Store {
            staged,
            layout,
            touched: std::sync::Mutex::new(Touched::default()),
            warned_shared_zone: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Opens (or creates) the database in `dir`, creating the root directory (owned by
    /// `root_owner`) on first start. A database created with another chunk size is refused: its
    /// chunk maps would be meaningless.
    pub fn open(dir: &Path, chunk_size: u64, root_owner: Caller) -> anyhow::Result<Store> {
        let store = Store::open_trees(dir, chunk_size)?;
        store.check_layout(dir, chunk_size)?;
        let meta = store.tree(T_META);
        store.upgrade_inodes()?;
        // The `running` mark: set from now on until a clean shutdown (`Store::mark_clean`).
        // Found set, the last run ended in a crash.
        if meta.get(b"running")?.is_some() {
            let servers = store.servers().map_err(|e| anyhow::anyhow!("{e}"))?;
            for rec in &servers {
                store.tree(T_SCRUB).insert(rec.id.to_be_bytes(), &[])?;
            }
            // Inode numbers handed out after the last flush were lost with the crash, but
            // clients may still hold them (an acknowledged create not yet fsynced) and reopen
            // them by number in their new session: a number is never handed out twice.
            let next = match meta.get(b"next_ino")? {
                Some(v) => decode_u64(&v).map_err(|e| anyhow::anyhow!("{e}"))?,
                None => ROOT_INO + 1,
            };
            meta.insert(
                b"next_ino",
                &be64(next.saturating_add(INO_SKIP_AFTER_CRASH)),
            )?;
            tracing::warn!(
                servers = servers.len(),
                "the last run of this meta server did not shut down cleanly: free chunks of \
                 every data server are zeroed when it registers, and inode numbers resume \
                 2^32 above the last durable one"
            );
        }
        meta.insert(b"running", &[][..])?;
        store.staged.flush()?;
        store.create_root(root_owner)?;
        Ok(store)
    }

    /// Refuses a database of another chunk layout or chunk size than `chunk_size`'s (its chunk
    /// maps would be meaningless); marks a new one with both.
    fn check_layout(&self, dir: &Path, chunk_size: u64) -> anyhow::Result<()> {
        let meta = self.tree(T_META);
        match meta.get(b"layout")? {
            Some(v) if v.as_ref() == LAYOUT_MARK => {}
            Some(v) => anyhow::bail!(
                "the meta database in {} has the unknown chunk layout {:?}",
                dir.display(),
                String::from_utf8_lossy(&v)
            ),
            None if self.tree(T_SERVERS).len() == 0 => {
                meta.insert(b"layout", LAYOUT_MARK)?;
            }
            None => anyhow::bail!(
                "the meta database in {} was made by an older CitronFS (every chunk {} bytes); \
                 this one sizes chunks geometrically: start from an empty state directory",
                dir.display(),
                chunk_size
            ),
        }
        match meta.get(b"chunk_size")? {
            Some(v) => {
                let stored = decode_u64(&v).map_err(|e| anyhow::anyhow!("{e}"))?;
                anyhow::ensure!(
                    stored == chunk_size,
                    "the meta database in {} uses chunk size {stored}, not {chunk_size}",
                    dir.display()
                );
            }
            None => {
                meta.insert(b"chunk_size", &be64(chunk_size))?;
            }
        }
        Ok(())
    }

    /// Creates the root directory, owned by `root_owner`, unless it exists.
    fn create_root(&self, root_owner: Caller) -> anyhow::Result<()> {
        if self.tree(T_INODES).get(be64(ROOT_INO))?.is_none() {
            let now = Timestamp::now();
            let root = Attr {
                ino: ROOT_INO,
                kind: FileKind::Dir,
                perm: 0o755,
                nlink: 2,
                uid: root_owner.uid,
                gid: root_owner.gid,
                rdev: 0,
                size: 0,
                atime: now,
                mtime: now,
                ctime: now,
                crtime: now,
                generation: 0,
                allocated: 0,
            };
            self.tx(|tx| {
                tx.put_inode(&root)?;
                tx.t(T_PARENTS).insert(be64(ROOT_INO), &be64(ROOT_INO))?;
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Opens the existing database in `dir` (a stopped meta server's) without creating
    /// anything; returns it with the chunk size it was created with.
    pub fn open_existing(dir: &Path) -> anyhow::Result<(Store, u64)> {
        let has_files = std::fs::read_dir(dir)
            .map_err(|e| anyhow::anyhow!("cannot read the meta database {}: {e}", dir.display()))?
            .next()
            .is_some();
        anyhow::ensure!(
            has_files,
            "{} is empty: no meta database there",
            dir.display()
        );
        // Opened with the smallest layout, replaced by the stored chunk size's at once.
        let mut store = Store::open_trees(dir, proto::layout::MIN_CHUNK)?;
        let meta = store.tree(T_META);
        let chunk_size = match meta.get(b"chunk_size")? {
            Some(v) => decode_u64(&v).map_err(|e| anyhow::anyhow!("{e}"))?,
            None => anyhow::bail!("{} holds no CitronFS meta database", dir.display()),
        };
        anyhow::ensure!(
            meta.get(b"layout")?.as_deref() == Some(LAYOUT_MARK),
            "the meta database in {} does not use this CitronFS's chunk layout",
            dir.display()
        );
        store.layout = Layout::new(chunk_size).map_err(|e| anyhow::anyhow!("{e}"))?;
        store.upgrade_inodes()?;
        Ok((store, chunk_size))
    }

    /// Rewrites the inode records of a database written before [`Attr::allocated`] existed
    /// with it, counted from each file's chunk map, and marks the database as upgraded (an
    /// empty one is marked at once). Runs when the store opens, before anything reads an inode
    /// — for an offline `fsck` too, even without `--repair`: a record of before cannot be read
    /// otherwise, and the rewrite changes no file, only how its attributes are stored.
    fn upgrade_inodes(&self) -> anyhow::Result<()> {
        let meta = self.tree(T_META);
        if meta.get(b"inodes")?.as_deref() == Some(INODES_MARK) {
            return Ok(());
        }
        let mut old = Vec::new();
        for item in self.tree(T_INODES).iter() {
            let (key, value) = item.map_err(|e| anyhow::anyhow!("{e}"))?;
            // A record of this version decodes whole; one of before lacks the last field.
            if postcard::from_bytes::<Attr>(&value).is_err() {
                let attr = attr_before_allocated(&value).ok_or_else(|| {
                    anyhow::anyhow!("an inode record of the meta database does not decode")
                })?;
                old.push((key, attr));
            }
        }
        let upgraded = old.len();
        for (key, mut attr) in old {
            let chunks = self
                .scan_chunks(attr.ino, 0)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            attr.allocated = self.layout.held(chunks.iter().map(|(index, _)| *index));
            self.tree(T_INODES)
                .insert(key, &enc(&attr))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        meta.insert(b"inodes", INODES_MARK)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        self.staged.flush().map_err(|e| anyhow::anyhow!("{e}"))?;
        if upgraded > 0 {
            tracing::info!(
                upgraded,
                "meta database upgraded: inode records now count their chunks' bytes"
            );
        }
        Ok(())
    }

    /// Runs `f` as one transaction over every tree: its writes are visible to every read when
    /// it returns `Ok` and reach sled behind it ([`Staged::transaction`]).
    fn tx<A>(&self, f: impl FnOnce(&Tx) -> TxResult<A>) -> Result<A, FsError> {
        let touched = std::cell::RefCell::new(Touched::default());
        let result = self
            .staged
            .transaction(|view| f(&Tx(view, self.layout, &touched)))?;
        let touched = touched.into_inner();
        if !touched.inos.is_empty() || !touched.entries.is_empty() {
            let mut all = self.touched_now();
            all.inos.extend(touched.inos);
            all.entries.extend(touched.entries);
        }
        Ok(result)
    }

    fn touched_now(&self) -> std::sync::MutexGuard<'_, Touched> {
        self.touched
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes the inodes committed transactions wrote or deleted since the last call, each
    /// once.
    pub fn take_touched(&self) -> Vec<Ino> {
        let mut inos = std::mem::take(&mut self.touched_now().inos);
        inos.sort_unstable();
        inos.dedup();
        inos
    }

    /// Takes the directory entries committed transactions added or removed since the last
    /// call, in commit order (callers serialize mutations, so that is the database's order).
    pub fn take_entry_changes(&self) -> Vec<EntryChange> {
        std::mem::take(&mut self.touched_now().entries)
    }

    /// Every directory entry: `(parent, name, ino)`, for filling the entry table at start.
    pub fn all_entries(&self) -> Result<Vec<(Ino, String, Ino)>, FsError> {
        self.tree(T_DIRENTS)
            .iter()
            .map(|item| {
                let (k, v) = item.map_err(db_err)?;
                let parent = decode_u64(k.get(..8).ok_or_else(|| corrupt("short entry key"))?)?;
                let name = String::from_utf8(k[8..].to_vec())
                    .map_err(|_| corrupt("entry name is not UTF-8"))?;
                let entry: Dirent = dec(&v, "directory entry")?;
                Ok((parent, name, entry.ino))
            })
            .collect()
    }

    fn tree(&self, i: usize) -> StagedTree<'_> {
        self.staged.tree(i)
    }

    /// Flushes everything to disk: every change acknowledged so far is written to sled
    /// first (`Staged::flush`).
    pub fn flush(&self) -> Result<(), FsError> {
        self.staged.flush()
    }

    /// Where the write-behind stands (`Staged::progress`), for a status report.
    pub(crate) fn progress(&self) -> crate::staged::Progress {
        self.staged.progress()
    }

    /// Flushes after clearing the `running` mark: the next open finds a clean shutdown.
    pub fn mark_clean(&self) -> Result<(), FsError> {
        self.tree(T_META).remove(b"running")?;
        self.flush()
    }

    /// The file layout of this database.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Every inode in use.
    pub fn inode_count(&self) -> Result<u64, FsError> {
        Ok(self.tree(T_INODES).len() as u64)
    }
}

fn decode_server_key(k: &[u8]) -> Result<(u32, u64), FsError> {
    if k.len() != 12 {
        return Err(corrupt("a server key is not 12 bytes"));
    }
    Ok((
        u32::from_be_bytes(k[..4].try_into().expect("4 bytes")),
        u64::from_be_bytes(k[4..].try_into().expect("8 bytes")),
    ))
}

fn decode_ino_prefix(k: &[u8]) -> Result<Ino, FsError> {
    k.get(..8)
        .ok_or_else(|| corrupt("a key is shorter than an inode number"))
        .and_then(decode_u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CS: u64 = 4096;
    const ME: Caller = Caller { uid: 0, gid: 0 };

    fn addr() -> FabricAddr {
        "tcp:127.0.0.1:1".parse().unwrap()
    }

    fn file_with_chunks(store: &Store, name: &str, chunks: u64) -> Attr {
        // The size first: a size change frees chunks past the smaller of the two sizes.
        let attr = store
            .mknod(ROOT_INO, name, FileKind::File, 0o644, 0, ME)
            .unwrap();
        let size = Some(chunks * CS);
        let (attr, _) = store
            .setattr(
                attr.ino,
                &SetAttr {
                    size,
                    ..SetAttr::default()
                },
                ME,
                None,
            )
            .unwrap();
        store
            .allocate_chunks(attr.ino, attr.generation, 0, chunks, &[0], 1)
            .unwrap();
        store.getattr(attr.ino).unwrap()
    }

    /// A file's `allocated` follows its chunks: allocations add their bytes, a hole, a
    /// truncate and fsck's frees take theirs off.
    #[test]
    fn allocated_counts_the_bytes_of_a_files_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 64 << 10, ME).unwrap();
        store
            .register_server("ds-0", &addr(), fabric::RegionId(1), 8, 1)
            .unwrap();
        let l = store.layout();
        let f = store
            .mknod(ROOT_INO, "f", FileKind::File, 0o644, 0, ME)
            .unwrap();
        assert_eq!(f.allocated, 0);
        let bytes = |chunks: std::ops::Range<u64>| chunks.map(|c| l.len(c)).sum::<u64>();
        store.allocate_chunks(f.ino, 0, 0, 7, &[0], 1).unwrap();
        assert_eq!(store.getattr(f.ino).unwrap().allocated, bytes(0..7));
        // Allocating chunks that exist adds nothing.
        store.allocate_chunks(f.ino, 0, 2, 3, &[0], 1).unwrap();
        assert_eq!(store.getattr(f.ino).unwrap().allocated, bytes(0..7));
        let (attr, _) = store.free_chunks_in(f.ino, 2, 3).unwrap();
        assert_eq!(attr.allocated, bytes(0..7) - bytes(2..5));
        store.persist_size(f.ino, l.start(7)).unwrap();
        let set = SetAttr {
            size: Some(l.start(1)),
            ..SetAttr::default()
        };
        let (attr, _) = store.setattr(f.ino, &set, ME, None).unwrap();
        assert_eq!(attr.allocated, bytes(0..1));
        assert_eq!(store.getattr(f.ino).unwrap().allocated, bytes(0..1));
    }

    /// A database written before `Attr::allocated` opens: its inode records are rewritten
    /// with the bytes of their chunks, once.
    #[test]
    fn a_database_of_before_allocated_is_upgraded_when_it_opens() {
        let dir = tempfile::tempdir().unwrap();
        let (ino, want) = {
            let store = Store::open(dir.path(), CS, ME).unwrap();
            store
                .register_server("ds-0", &addr(), fabric::RegionId(1), 8, 1)
                .unwrap();
            let f = file_with_chunks(&store, "f", 3);
            assert_eq!(f.allocated, 3 * CS);
            // Back to the old encoding, every record, and no mark.
            for item in store.tree(T_INODES).iter() {
                let (key, value) = item.unwrap();
                let a: Attr = postcard::from_bytes(&value).unwrap();
                // Written as the record was before the field: its other fields, in order.
                let old = enc(&(
                    a.ino,
                    a.kind,
                    a.perm,
                    a.nlink,
                    a.uid,
                    a.gid,
                    a.rdev,
                    a.size,
                    (a.atime, a.mtime, a.ctime, a.crtime),
                    a.generation,
                ));
                store.tree(T_INODES).insert(key, &old).unwrap();
            }
            store.tree(T_META).remove(b"inodes").unwrap();
            store.mark_clean().unwrap();
            assert!(
                store.getattr(f.ino).is_err(),
                "the old records do not decode"
            );
            (f.ino, f)
        };
        let store = Store::open(dir.path(), CS, ME).unwrap();
        assert_eq!(store.getattr(ino).unwrap(), want);
        assert_eq!(store.getattr(ROOT_INO).unwrap().allocated, 0);
        assert_eq!(
            store.tree(T_META).get(b"inodes").unwrap().as_deref(),
            Some(INODES_MARK)
        );
    }

    /// A number handed out before a crash may have been lost with it while a client still
    /// holds it (an acknowledged create not yet fsynced); after the crash no new file gets it,
    /// else that client's reopen by number would write into another file (a soak found an
    /// acknowledged file holding another file's bytes). A clean restart goes on from where it
    /// stopped.
    #[test]
    fn inode_numbers_are_never_handed_out_twice_across_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let file = |store: &Store, name: &str| {
            let attr = store.mknod(ROOT_INO, name, FileKind::File, 0o644, 0, ME);
            attr.unwrap().ino
        };
        let store = Store::open(dir.path(), CS, ME).unwrap();
        let a = file(&store, "a");
        store.flush().unwrap();
        // Handed out, acknowledged, never flushed: lost in the crash below.
        let lost = file(&store, "b");
        assert_eq!(lost, a + 1);
        // A crash: the `running` mark stays set, and "b" never reached the disk.
        drop(store);
        let store = Store::open(dir.path(), CS, ME).unwrap();
        let after = file(&store, "c");
        assert!(
            after > lost + (1 << 31),
            "ino {after} after a crash, {lost} before it"
        );
        // A clean stop: the next number follows on.
        store.mark_clean().unwrap();
        drop(store);
        let store = Store::open(dir.path(), CS, ME).unwrap();
        let next = file(&store, "d");
        assert_eq!(next, after + 1);
    }

    #[test]
    fn a_new_incarnation_marks_the_servers_chunks_lost_until_freed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), CS, ME).unwrap();
        let region = fabric::RegionId(1);
        store.register_server("ds", &addr(), region, 64, 7).unwrap();
        let f = file_with_chunks(&store, "f", 3);
        // The same incarnation again (a file-backed server): nothing lost.
        let (_, lost) = store.register_server("ds", &addr(), region, 64, 7).unwrap();
        assert_eq!(lost, 0);
        assert_eq!(store.chunk_map(f.ino, 0, 3).unwrap().len(), 3);
        // A new incarnation: every chunk of the file is lost, and says so.
        let (_, lost) = store.register_server("ds", &addr(), region, 64, 8).unwrap();
        assert_eq!(lost, 3);
        assert_eq!(store.incarnation(0).unwrap(), 8);
        assert!(matches!(
            store.chunk_map(f.ino, 1, 1),
            Err(FsError::Lost(_))
        ));
        assert!(matches!(
            store.allocate_chunks(f.ino, f.generation, 0, 4, &[0], 1),
            Err(FsError::Lost(_))
        ));
        assert_eq!(store.lost_chunks().unwrap().len(), 3);
        // Truncating to nothing frees them: no longer lost, the file reads as holes.
        let (_, effects) = store
            .setattr(
                f.ino,
                &SetAttr {
                    size: Some(0),
                    ..SetAttr::default()
                },
                ME,
                None,
            )
            .unwrap();
        assert_eq!(effects.freed.len(), 3);
        assert!(store.lost_chunks().unwrap().is_empty());
        assert_eq!(store.chunk_map(f.ino, 0, 3).unwrap(), vec![None; 3]);
    }

    #[test]
    fn a_shrinking_truncate_records_its_tail_until_zeroed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), CS, ME).unwrap();
        store
            .register_server("ds", &addr(), fabric::RegionId(1), 64, 1)
            .unwrap();
        let f = file_with_chunks(&store, "f", 2);
        let shrink = |size| {
            store
                .setattr(
                    f.ino,
                    &SetAttr {
                        size: Some(size),
                        ..SetAttr::default()
                    },
                    ME,
                    None,
                )
                .unwrap()
                .1
        };
        // To a chunk boundary: no tail.
        assert!(shrink(CS + CS).tails.is_empty());
        // Into the middle of chunk 1: its tail from offset 100 on, recorded durably.
        let effects = shrink(CS + 100);
        let tail = effects.tails[0];
        assert_eq!(tail.from, 100);
        assert_eq!(store.tails().unwrap(), vec![tail]);
        let loc = tail.block.loc;
        store.tail_zeroed(loc).unwrap();
        assert!(store.tails().unwrap().is_empty());
        // Freeing the chunk drops a pending tail with it (a dirty chunk is zeroed whole).
        let effects = shrink(CS + 50);
        assert_eq!(effects.tails.len(), 1);
        let effects = shrink(10);
        assert_eq!(effects.freed, vec![Block { loc, order: 0 }]);
        assert_eq!(store.tails().unwrap().len(), 1, "chunk 0's tail only");
    }

    #[test]
    fn opening_waits_for_the_directory_lock_of_a_store_being_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let first = Store::open(dir.path(), CS, ME).unwrap();
        let dropper = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(first);
        });
        // Held for 300 ms more: without the wait this fails at once.
        let second = Store::open(dir.path(), CS, ME);
        dropper.join().unwrap();
        assert!(second.is_ok(), "{:?}", second.err());
    }

    #[test]
    fn an_unclean_shutdown_puts_every_server_in_scrub() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path(), CS, ME).unwrap();
            store
                .register_server("ds", &addr(), fabric::RegionId(1), 64, 1)
                .unwrap();
            store.mark_clean().unwrap();
        }
        {
            let store = Store::open(dir.path(), CS, ME).unwrap();
            assert!(!store.needs_scrub(0).unwrap(), "after a clean shutdown");
            // Dropped without `mark_clean`: a crash, as far as the next open can tell.
            store.flush().unwrap();
        }
        let store = Store::open(dir.path(), CS, ME).unwrap();
        assert!(store.needs_scrub(0).unwrap());
        let free = store.free_chunks_of(0).unwrap();
        assert_eq!(free, vec![(0, 64)]);
        store.scrubbed(0).unwrap();
        assert!(!store.needs_scrub(0).unwrap());
    }

    /// Units of server 0 in no file, as statfs counts them.
    fn unallocated(store: &Store) -> u64 {
        let rec = &store.servers().unwrap()[0];
        let dirty: u64 = store
            .dirty_chunks()
            .unwrap()
            .iter()
            .map(|b| Layout::units_of(b.order))
            .sum();
        rec.unallocated_units(store.layout().max_order(), dirty)
    }

    #[test]
    fn small_files_take_small_blocks_which_merge_back_when_freed() {
        let dir = tempfile::tempdir().unwrap();
        // 64 KiB chunks: orders 0..=4 of 4 KiB; a region of 2 chunks = 32 units.
        let store = Store::open(dir.path(), 64 << 10, ME).unwrap();
        store
            .register_server("ds", &addr(), fabric::RegionId(1), 2, 1)
            .unwrap();
        let mut files = Vec::new();
        // 32 one-block files fill exactly the two 64 KiB chunks (the old layout: 2 files).
        for i in 0..32 {
            let f = store
                .mknod(ROOT_INO, &format!("f{i}"), FileKind::File, 0o644, 0, ME)
                .unwrap();
            let loc = store
                .allocate_chunks(f.ino, f.generation, 0, 1, &[0], 1)
                .unwrap()[0]
                .first();
            files.push((f, loc));
        }
        let mut offsets: Vec<u64> = files.iter().map(|(_, l)| l.index).collect();
        offsets.sort_unstable();
        assert_eq!(offsets, (0..32).collect::<Vec<_>>(), "every unit once");
        assert_eq!(unallocated(&store), 0);
        let g = store
            .mknod(ROOT_INO, "g", FileKind::File, 0o644, 0, ME)
            .unwrap();
        assert!(matches!(
            store.allocate_chunks(g.ino, g.generation, 0, 1, &[0], 1),
            Err(FsError::NoSpace)
        ));
        // Freed and zeroed, the blocks merge back into whole chunks: a 64 KiB chunk (index 5 of
        // a file, order 4) fits again.
        for i in 0..files.len() {
            let effects = store.unlink(ROOT_INO, &format!("f{i}"), |_| false).unwrap();
            for b in effects.freed {
                assert_eq!(b.order, 0);
                store.recycle(b.loc).unwrap();
            }
        }
        assert_eq!(unallocated(&store), 32);
        let rec = &store.servers().unwrap()[0];
        assert_eq!(
            rec.free_counts,
            vec![0, 0, 0, 0, 2],
            "merged into two whole chunks"
        );
        let locs = store
            .allocate_chunks(g.ino, g.generation, 0, 6, &[0], 1)
            .unwrap();
        let layout = store.layout();
        for (k, loc) in locs.iter().map(|r| r.first()).enumerate() {
            let units = layout.len(k as u64) / layout.unit();
            assert_eq!(loc.index % units, 0, "chunk {k} aligned to its size");
        }
        // Chunks 0..=5 hold 4+4+8+16+32+64 KiB = 32 units: the whole region.
        assert_eq!(unallocated(&store), 0);
    }

    /// A store of 64 KiB chunks with `n` data servers of 8 chunks each.
    fn store_with_servers(dir: &Path, n: usize) -> Store {
        let store = Store::open(dir, 64 << 10, ME).unwrap();
        for i in 0..n {
            store
                .register_server(&format!("ds-{i}"), &addr(), fabric::RegionId(1), 8, 1)
                .unwrap();
        }
        store
    }

    /// With a replication factor of 2, every chunk gets two blocks of its order on distinct
    /// servers (spread over the three), the file is charged both, and freeing the file frees
    /// both (each becomes dirty); a one-replica chunk is stored as it was before replicas.
    #[test]
    fn replicas_are_placed_on_distinct_servers_and_charged_and_freed_each() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_servers(dir.path(), 3);
        let l = store.layout();
        let f = store
            .mknod(ROOT_INO, "f", FileKind::File, 0o644, 0, ME)
            .unwrap();
        let sets = store
            .allocate_chunks(f.ino, f.generation, 0, 7, &[0, 1, 2], 2)
            .unwrap();
        let mut firsts = std::collections::BTreeSet::new();
        for (k, set) in sets.iter().enumerate() {
            assert_eq!(set.len(), 2, "chunk {k}: {set:?}");
            assert_ne!(set.as_slice()[0].server, set.as_slice()[1].server);
            firsts.insert(set.first().server);
            let units = l.len(k as u64) / l.unit();
            for loc in set.as_slice() {
                assert_eq!(loc.index % units, 0, "chunk {k} aligned to its size");
            }
        }
        assert_eq!(firsts.len(), 3, "first replicas striped over every server");
        assert_eq!(
            store.getattr(f.ino).unwrap().allocated,
            2 * l.held(0..7),
            "both replicas charged"
        );
        // What a client learns is what was placed; allocating again changes nothing.
        let map = store.chunk_map(f.ino, 0, 7).unwrap();
        assert_eq!(map, sets.iter().copied().map(Some).collect::<Vec<_>>());
        assert_eq!(
            store
                .allocate_chunks(f.ino, f.generation, 0, 7, &[0, 1, 2], 2)
                .unwrap(),
            sets
        );
        assert_eq!(store.getattr(f.ino).unwrap().allocated, 2 * l.held(0..7));
        // A file of one replica per chunk: its values are one 12-byte location, as before.
        let g = store
            .mknod(ROOT_INO, "g", FileKind::File, 0o644, 0, ME)
            .unwrap();
        let one = store
            .allocate_chunks(g.ino, g.generation, 0, 1, &[0, 1, 2], 1)
            .unwrap()[0];
        let raw = store
            .tree(T_CHUNKS)
            .get(key_u64s(g.ino, 0))
            .unwrap()
            .unwrap();
        assert_eq!(raw.as_ref(), &encode_loc(one.first())[..]);
        // Unlinked: every replica's block is freed.
        let effects = store.unlink(ROOT_INO, "f", |_| false).unwrap();
        assert_eq!(effects.freed.len(), 14);
        let mut freed: Vec<_> = effects.freed.iter().map(|b| b.loc).collect();
        let mut placed: Vec<_> = sets.iter().flat_map(|s| s.as_slice().to_vec()).collect();
        freed.sort_by_key(|l| (l.server, l.index));
        placed.sort_by_key(|l| (l.server, l.index));
        assert_eq!(freed, placed);
        assert_eq!(store.dirty_chunks().unwrap().len(), 14);
    }

    /// More replicas than servers given: one per server (a server away; the service refuses
    /// a factor above the servers the cluster has). Out of space on one server: the next.
    #[test]
    fn replicas_take_the_servers_there_are() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_servers(dir.path(), 2);
        let f = store
            .mknod(ROOT_INO, "f", FileKind::File, 0o644, 0, ME)
            .unwrap();
        let sets = store
            .allocate_chunks(f.ino, f.generation, 0, 2, &[1], 3)
            .unwrap();
        assert!(sets.iter().all(|s| s.len() == 1 && s.first().server == 1));
        // Two servers of 8 chunks: with 2 replicas each, 8 more full chunks fit, not 9.
        let g = store
            .mknod(ROOT_INO, "g", FileKind::File, 0o644, 0, ME)
            .unwrap();
        assert!(matches!(
            store.allocate_chunks(g.ino, g.generation, 6, 9, &[0, 1], 2),
            Err(FsError::NoSpace)
        ));
        assert_eq!(store.getattr(g.ino).unwrap().allocated, 0, "all or nothing");
    }

    /// A replica whose server came back with new memory is left out of the chunk's map while
    /// another holds the data; the chunk is lost only when every replica is.
    #[test]
    fn a_lost_replica_is_left_out_until_every_replica_is_lost() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_servers(dir.path(), 2);
        let f = store
            .mknod(ROOT_INO, "f", FileKind::File, 0o644, 0, ME)
            .unwrap();
        store
            .allocate_chunks(f.ino, f.generation, 0, 3, &[0, 1], 2)
            .unwrap();
        let (_, lost) = store
            .register_server("ds-0", &addr(), fabric::RegionId(1), 8, 2)
            .unwrap();
        assert_eq!(lost, 3);
        for set in store.chunk_map(f.ino, 0, 3).unwrap() {
            let set = set.unwrap();
            assert_eq!(set.len(), 1);
            assert_eq!(set.first().server, 1);
        }
        let again = store
            .allocate_chunks(f.ino, f.generation, 0, 3, &[0, 1], 2)
            .unwrap();
        assert!(again.iter().all(|s| s.len() == 1 && s.first().server == 1));
        store
            .register_server("ds-1", &addr(), fabric::RegionId(1), 8, 2)
            .unwrap();
        assert!(matches!(
            store.chunk_map(f.ino, 0, 1),
            Err(FsError::Lost(_))
        ));
    }

    /// `citronfs.replicas` is a factor from 1 to MAX_REPLICAS, inherited by the files and
    /// directories created below it; without it the cluster's default applies.
    #[test]
    fn the_replicas_xattr_is_checked_and_inherited() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_servers(dir.path(), 2);
        let d = store.mkdir(ROOT_INO, "d", 0o755, ME).unwrap();
        for bad in [&b"0"[..], b"5", b"two", b""] {
            assert!(
                matches!(
                    store.setxattr(d.ino, REPLICAS_XATTR, bad, XattrMode::Either),
                    Err(FsError::Invalid(_))
                ),
                "{bad:?}"
            );
        }
        assert_eq!(store.replicas_of(d.ino, 1).unwrap(), 1);
        store
            .setxattr(d.ino, REPLICAS_XATTR, b"2\n", XattrMode::Either)
            .unwrap();
        let f = store
            .mknod(d.ino, "f", FileKind::File, 0o644, 0, ME)
            .unwrap();
        let e = store.mkdir(d.ino, "e", 0o755, ME).unwrap();
        let g = store
            .mknod(e.ino, "g", FileKind::File, 0o644, 0, ME)
            .unwrap();
        let outside = store
            .mknod(ROOT_INO, "h", FileKind::File, 0o644, 0, ME)
            .unwrap();
        assert_eq!(store.replicas_of(f.ino, 1).unwrap(), 2);
        assert_eq!(
            store.replicas_of(g.ino, 1).unwrap(),
            2,
            "through a subdirectory"
        );
        assert_eq!(store.getxattr(f.ino, REPLICAS_XATTR).unwrap(), b"2\n");
        assert_eq!(store.replicas_of(outside.ino, 3).unwrap(), 3, "the default");
        // A shrinking truncate records the tail of every replica.
        let set = |size| SetAttr {
            size: Some(size),
            ..SetAttr::default()
        };
        let (f, _) = store.setattr(f.ino, &set(8192), ME, None).unwrap();
        store
            .allocate_chunks(f.ino, f.generation, 0, 2, &[0, 1], 2)
            .unwrap();
        let (_, effects) = store.setattr(f.ino, &set(5000), ME, Some(8192)).unwrap();
        assert_eq!(effects.tails.len(), 2);
        assert_ne!(
            effects.tails[0].block.loc.server,
            effects.tails[1].block.loc.server
        );
        assert_eq!(store.tails().unwrap().len(), 2);
    }

    /// A store of 64 KiB chunks with a data server of 64 chunks in each of `zones` (`None`:
    /// unlabelled), ids in that order.
    fn store_in_zones(dir: &Path, zones: &[Option<&str>]) -> Store {
        let store = Store::open(dir, 64 << 10, ME).unwrap();
        for (i, zone) in zones.iter().enumerate() {
            let (rec, _) = store
                .register_server_in_zone(
                    &format!("ds-{i}"),
                    &addr(),
                    fabric::RegionId(1),
                    64,
                    1,
                    *zone,
                )
                .unwrap();
            assert_eq!((rec.id as usize, rec.zone.as_deref()), (i, *zone));
        }
        store
    }

    /// The replica sets of chunks `0..chunks` of each of `files` new files, allocated with
    /// `replicas` over every server of `store`.
    fn place(store: &Store, files: usize, chunks: u64, replicas: usize) -> Vec<Replicas> {
        let servers: Vec<u32> = store.servers().unwrap().iter().map(|r| r.id).collect();
        let mut out = Vec::new();
        for i in 0..files {
            let f = store
                .mknod(ROOT_INO, &format!("f{i}"), FileKind::File, 0o644, 0, ME)
                .unwrap();
            out.extend(
                store
                    .allocate_chunks(f.ino, f.generation, 0, chunks, &servers, replicas)
                    .unwrap(),
            );
        }
        out
    }

    /// Four servers in two zones, two replicas: every chunk of every file has one replica in
    /// each zone, and the replicas spread evenly over the four servers.
    #[test]
    fn two_replicas_go_one_to_each_of_two_zones() {
        let dir = tempfile::tempdir().unwrap();
        let zones = [Some("a"), Some("a"), Some("b"), Some("b")];
        let store = store_in_zones(dir.path(), &zones);
        let sets = place(&store, 8, 12, 2);
        let mut per_server = [0usize; 4];
        for set in &sets {
            let [x, y] = set.as_slice() else {
                panic!("two replicas: {set:?}")
            };
            assert_ne!(
                zones[x.server as usize], zones[y.server as usize],
                "one replica per zone: {set:?}"
            );
            per_server[x.server as usize] += 1;
            per_server[y.server as usize] += 1;
        }
        assert_eq!(per_server.iter().sum::<usize>(), 8 * 12 * 2);
        assert!(
            per_server.iter().all(|&n| n == 8 * 12 * 2 / 4),
            "even spread: {per_server:?}"
        );
    }

    /// Fewer zones than replicas: the replicas still go to distinct servers (every zone used),
    /// and the allocation succeeds. One zone of three servers and one of one, two replicas:
    /// the lone server holds a replica of every chunk.
    #[test]
    fn fewer_zones_than_replicas_fall_back_to_distinct_servers() {
        let dir = tempfile::tempdir().unwrap();
        let zones = [Some("a"), Some("a"), Some("b")];
        let store = store_in_zones(dir.path(), &zones);
        for set in place(&store, 4, 8, 3) {
            let servers: std::collections::BTreeSet<u32> =
                set.as_slice().iter().map(|l| l.server).collect();
            assert_eq!(servers.len(), 3, "distinct servers: {set:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let zones = [Some("a"), Some("a"), Some("a"), Some("b")];
        let store = store_in_zones(dir.path(), &zones);
        for set in place(&store, 4, 8, 2) {
            assert!(set.on(3).is_some(), "the other zone's server: {set:?}");
            assert_eq!(set.len(), 2);
        }
    }

    /// Unlabelled servers are zones of their own: with two servers in zone `a` and two
    /// unlabelled, three replicas are never on both servers of `a`.
    #[test]
    fn unlabelled_servers_are_zones_of_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let zones = [Some("a"), None, Some("a"), None];
        let store = store_in_zones(dir.path(), &zones);
        for set in place(&store, 6, 8, 3) {
            assert_eq!(set.len(), 3);
            assert!(
                !(set.on(0).is_some() && set.on(2).is_some()),
                "both servers of zone a: {set:?}"
            );
        }
        // All unlabelled: the striping and the next-server rule of before zones.
        let dir = tempfile::tempdir().unwrap();
        let store = store_in_zones(dir.path(), &[None, None, None]);
        let f = store
            .mknod(ROOT_INO, "g", FileKind::File, 0o644, 0, ME)
            .unwrap();
        let sets = store
            .allocate_chunks(f.ino, f.generation, 0, 6, &[0, 1, 2], 2)
            .unwrap();
        for (c, set) in sets.iter().enumerate() {
            let first = ((f.ino + c as u64) % 3) as u32;
            let servers: Vec<u32> = set.as_slice().iter().map(|l| l.server).collect();
            assert_eq!(servers, [first, (first + 1) % 3], "chunk {c}");
        }
    }

    /// The placement order alternates between zones, each zone's servers in their order;
    /// servers all alone keep theirs.
    #[test]
    fn zone_order_alternates_zones() {
        let named = |z: &str| ZoneKey::Named(z.into());
        let order = space::zone_order(
            &[0, 1, 2, 3, 4],
            vec![
                named("a"),
                named("a"),
                named("b"),
                ZoneKey::Alone(3),
                named("a"),
            ],
        );
        let ids: Vec<u32> = order.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [0, 2, 3, 1, 4]);
        let alone: Vec<ZoneKey> = (0..3).map(ZoneKey::Alone).collect();
        let ids: Vec<u32> = space::zone_order(&[0, 1, 2], alone)
            .iter()
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(ids, [0, 1, 2]);
    }

    /// A server record written before zones (no `zone` field) still opens, with no zone; a
    /// registration names its zone, and a later one without a zone clears it.
    #[test]
    fn a_server_record_from_before_zones_decodes_with_no_zone() {
        /// The record as CitronFS wrote it before zones.
        #[derive(Serialize)]
        struct Before {
            id: u32,
            name: String,
            fabric: FabricAddr,
            region: fabric::RegionId,
            chunks: u64,
            next_fresh: u64,
            free_counts: Vec<u64>,
        }
        let before = Before {
            id: 0,
            name: "ds-0".into(),
            fabric: addr(),
            region: fabric::RegionId(1),
            chunks: 64,
            next_fresh: 3,
            free_counts: vec![1, 0, 2, 0, 0],
        };
        let old = postcard::to_stdvec(&before).unwrap();
        let rec = ServerRecord::decode(&old).unwrap();
        assert_eq!(
            rec,
            ServerRecord {
                id: 0,
                name: "ds-0".into(),
                fabric: addr(),
                region: fabric::RegionId(1),
                chunks: 64,
                next_fresh: 3,
                free_counts: vec![1, 0, 2, 0, 0],
                zone: None,
            }
        );
        // A record of now round-trips, with or without a zone; damage is still an error.
        let zoned = ServerRecord {
            zone: Some("rack-1".into()),
            ..rec.clone()
        };
        assert_eq!(ServerRecord::decode(&enc(&zoned)).unwrap(), zoned);
        assert_eq!(ServerRecord::decode(&enc(&rec)).unwrap(), rec);
        assert!(ServerRecord::decode(&old[..old.len() - 3]).is_err());

        // In a store: an old record in the servers tree opens, and the server allocates.
        let dir = tempfile::tempdir().unwrap();
        let store = store_in_zones(dir.path(), &[Some("a"), Some("b")]);
        let max = store.layout().max_order() as usize;
        let old = postcard::to_stdvec(&Before {
            id: 0,
            name: "ds-0".into(),
            fabric: addr(),
            region: fabric::RegionId(1),
            chunks: 64,
            next_fresh: 0,
            free_counts: vec![0; max + 1],
        })
        .unwrap();
        store
            .tx(|tx| {
                tx.t(T_SERVERS).insert(0u32.to_be_bytes(), old.clone())?;
                Ok(())
            })
            .unwrap();
        let zones: Vec<Option<String>> = store
            .servers()
            .unwrap()
            .into_iter()
            .map(|r| r.zone)
            .collect();
        assert_eq!(zones, [None, Some("b".to_string())]);
        assert_eq!(place(&store, 1, 4, 2).len(), 4);
        // Registering again names the zone; without one, it is cleared.
        let (rec, _) = store
            .register_server_in_zone("ds-0", &addr(), fabric::RegionId(1), 64, 1, Some("c"))
            .unwrap();
        assert_eq!(rec.zone.as_deref(), Some("c"));
        assert_eq!(store.servers().unwrap()[0].zone.as_deref(), Some("c"));
        let (rec, _) = store
            .register_server("ds-0", &addr(), fabric::RegionId(1), 64, 1)
            .unwrap();
        assert_eq!(rec.zone, None);
    }
}
