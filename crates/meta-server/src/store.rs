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
//! | `chunks`    | ino ++ chunk index          | server (u32) ++ offset in its region in layout units (u64) |
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
//!   (a new incarnation) while the chunk held file data. Chunk-map answers that include it fail
//!   with `FsError::Lost` (never zeros); freeing it (truncate, unlink) clears the mark.
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

use crate::staged::{db_err, Staged, StagedTree, TxTree, TxView};
use proto::fcb;
use proto::layout::Layout;
use proto::rpc::XattrMode;
use proto::rpc::{check_name_for, is_dot, NameOp};
use proto::{
    Attr, Caller, ChunkLoc, DirEntry, FabricAddr, FileKind, FsError, Ino, SetAttr, SetTime,
    Timestamp, NAME_MAX, ROOT_INO, SYMLINK_MAX, XATTR_NAME_MAX, XATTR_VALUE_MAX,
};
use serde::{Deserialize, Serialize};
use sled::transaction::ConflictableTransactionError;
use std::path::Path;

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
}

impl ServerRecord {
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

    fn server(&self, id: u32) -> TxResult<ServerRecord> {
        match self.t(T_SERVERS).get(id.to_be_bytes())? {
            Some(v) => lift(dec(&v, "server record")),
            None => abort(corrupt(&format!("data server {id} has no record"))),
        }
    }

    fn put_server(&self, rec: &ServerRecord) -> TxResult<()> {
        self.t(T_SERVERS).insert(rec.id.to_be_bytes(), enc(rec))?;
        Ok(())
    }

    /// Server `id`'s record, checked to have a free stack per order of the layout.
    fn allocator(&self, id: u32) -> TxResult<ServerRecord> {
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
    fn push_free(&self, rec: &mut ServerRecord, at: u64, order: u32) -> TxResult<()> {
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
    fn unlink_free(&self, rec: &mut ServerRecord, order: u32, slot: u64) -> TxResult<u64> {
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
    fn take_block(&self, id: u32, order: u32) -> TxResult<Option<u64>> {
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
    fn release_block(&self, block: Block) -> TxResult<()> {
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
    fn free_chunks(&self, ino: Ino, chunks: &[(u64, ChunkLoc)]) -> TxResult<u64> {
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
    fn blocks(&self, chunks: &[(u64, ChunkLoc)]) -> Vec<Block> {
        chunks
            .iter()
            .map(|&(k, loc)| Block {
                loc,
                order: self.1.order(k),
            })
            .collect()
    }

    /// Deletes an inode and everything hanging off it (`doomed`: scanned by the caller).
    fn delete_inode(&self, ino: Ino, doomed: &Doomed) -> TxResult<()> {
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
    /// A chunk whose bytes from an offset on (to its end) are to be zeroed once the change is
    /// durable, then [`Store::tail_zeroed`] (a shrinking truncate).
    pub tail: Option<Tail>,
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
        })
    }

    /// Opens (or creates) the database in `dir`, creating the root directory (owned by
    /// `root_owner`) on first start. A database created with another chunk size is refused: its
    /// chunk maps would be meaningless.
    pub fn open(dir: &Path, chunk_size: u64, root_owner: Caller) -> anyhow::Result<Store> {
        let store = Store::open_trees(dir, chunk_size)?;
        let meta = store.tree(T_META);
        match meta.get(b"layout")? {
            Some(v) if v.as_ref() == LAYOUT_MARK => {}
            Some(v) => anyhow::bail!(
                "the meta database in {} has the unknown chunk layout {:?}",
                dir.display(),
                String::from_utf8_lossy(&v)
            ),
            None if store.tree(T_SERVERS).len() == 0 => {
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
        if store.tree(T_INODES).get(be64(ROOT_INO))?.is_none() {
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
            store.tx(|tx| {
                tx.put_inode(&root)?;
                tx.t(T_PARENTS).insert(be64(ROOT_INO), &be64(ROOT_INO))?;
                Ok(())
            })?;
        }
        Ok(store)
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

    // ---- reads ------------------------------------------------------------------------------

    /// An inode's attributes.
    pub fn getattr(&self, ino: Ino) -> Result<Attr, FsError> {
        match self.tree(T_INODES).get(be64(ino)).map_err(db_err)? {
            Some(v) => dec(&v, "inode"),
            None => Err(FsError::NotFound),
        }
    }

    fn get_dirent(&self, parent: Ino, name: &str) -> Result<Option<Dirent>, FsError> {
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
    fn check_not_into_own_subtree(&self, moving: Ino, into: Ino) -> Result<(), FsError> {
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

    fn parent_of(&self, dir: Ino) -> Result<Ino, FsError> {
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

    /// Where chunks `first..first+count` of `ino` live.
    pub fn chunk_map(
        &self,
        ino: Ino,
        first: u64,
        count: u64,
    ) -> Result<Vec<Option<ChunkLoc>>, FsError> {
        check_chunk_range(first, count)?;
        self.getattr(ino)?;
        let mut out = vec![None; count as usize];
        let start = key_u64s(ino, first);
        let end = key_u64s(ino, first + count);
        for item in self.tree(T_CHUNKS).range(start..end) {
            let (k, v) = item.map_err(db_err)?;
            let index = decode_u64(&k[8..])?;
            let loc = decode_loc(&v)?;
            self.check_not_lost(ino, index, loc)?;
            out[(index - first) as usize] = Some(loc);
        }
        Ok(out)
    }

    /// Where chunk `index` of `ino` is, if allocated (lost or not).
    pub fn chunk_at(&self, ino: Ino, index: u64) -> Result<Option<ChunkLoc>, FsError> {
        self.tree(T_CHUNKS)
            .get(key_u64s(ino, index))
            .map_err(db_err)?
            .map(|v| decode_loc(&v))
            .transpose()
    }

    /// `Lost` if chunk `index` of `ino`, at `loc`, lost its data.
    fn check_not_lost(&self, ino: Ino, index: u64, loc: ChunkLoc) -> Result<(), FsError> {
        if self
            .tree(T_LOST)
            .contains_key(key_server(loc.server, loc.index))
            .map_err(db_err)?
        {
            return Err(lost_error(ino, index, loc));
        }
        Ok(())
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

    /// Flushes after clearing the `running` mark: the next open finds a clean shutdown.
    pub fn mark_clean(&self) -> Result<(), FsError> {
        self.tree(T_META).remove(b"running")?;
        self.flush()
    }

    /// Whether data server `id`'s free chunks must be zeroed before use (see the module docs).
    pub fn needs_scrub(&self, id: u32) -> Result<bool, FsError> {
        self.tree(T_SCRUB)
            .contains_key(id.to_be_bytes())
            .map_err(db_err)
    }

    /// The file layout of this database.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Data server `id`'s free space as (unit offset, units) ranges: its free blocks and the
    /// never-used chunk-size blocks (one range), in no order.
    pub fn free_chunks_of(&self, id: u32) -> Result<Vec<(u64, u64)>, FsError> {
        let Some(v) = self.tree(T_SERVERS).get(id.to_be_bytes()).map_err(db_err)? else {
            return Ok(Vec::new());
        };
        let rec: ServerRecord = dec(&v, "server record")?;
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

    /// Every inode in use.
    pub fn inode_count(&self) -> Result<u64, FsError> {
        Ok(self.tree(T_INODES).len() as u64)
    }

    /// Every known data server.
    pub fn servers(&self) -> Result<Vec<ServerRecord>, FsError> {
        let mut out = Vec::new();
        for item in self.tree(T_SERVERS).iter() {
            let (_, v) = item.map_err(db_err)?;
            out.push(dec(&v, "server record")?);
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
    fn is_empty(&self, ino: Ino) -> Result<bool, FsError> {
        match self.tree(T_DIRENTS).scan_prefix(be64(ino)).next() {
            None => Ok(true),
            Some(Ok(_)) => Ok(false),
            Some(Err(e)) => Err(db_err(e)),
        }
    }

    fn scan_doomed(&self, ino: Ino) -> Result<Doomed, FsError> {
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

    /// The chunks of `ino` with index `>= from`.
    fn scan_chunks(&self, ino: Ino, from: u64) -> Result<Vec<(u64, ChunkLoc)>, FsError> {
        self.scan_chunks_in(ino, from..=u64::MAX)
    }

    /// The allocated chunks of `ino` among `chunks`, in order.
    fn scan_chunks_in(
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
            out.push((decode_u64(&k[8..])?, decode_loc(&v)?));
        }
        Ok(out)
    }

    // ---- namespace changes (callers serialize them) -----------------------------------------

    /// Fails unless `ino` is a directory (`NotFound`, `NotDir`).
    fn check_dir(&self, ino: Ino) -> Result<(), FsError> {
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
    fn check_entry_name(&self, parent: Ino, name: &str, op: NameOp) -> Result<(), FsError> {
        if is_dot(name) {
            self.check_dir(parent)?;
        }
        check_name_for(op, name)
    }

    fn create(
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
            tx.remove_dirent(parent, name, &src)?;
            tx.add_dirent(new_parent, new_name, src.ino, src.kind)?;
            // Re-read the parents: the replaced target may have changed `new_parent` above.
            let mut old_dir = tx.inode(parent)?;
            if parent != new_parent {
                let mut np = tx.inode(new_parent)?;
                if src.kind == FileKind::Dir {
                    tx.t(T_PARENTS).insert(be64(src.ino), &be64(new_parent))?;
                    old_dir.nlink = old_dir.nlink.saturating_sub(1);
                    np.nlink += 1;
                }
                np.mtime = now;
                np.ctime = now;
                tx.put_inode(&np)?;
            }
            old_dir.mtime = now;
            old_dir.ctime = now;
            tx.put_inode(&old_dir)?;
            let mut moved = tx.inode(src.ino)?;
            moved.ctime = now;
            tx.put_inode(&moved)?;
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
            let root = caller.uid == 0;
            let owner = caller.uid == attr.uid;
            let now = Timestamp::now();
            let mut changed = false;
            let mut effects = Effects::default();
            if let Some(size) = set.size {
                match attr.kind {
                    FileKind::File => {}
                    FileKind::Dir => return abort(FsError::IsDir),
                    _ => {
                        return abort(FsError::Invalid(
                            "only regular files have a size to set".into(),
                        ))
                    }
                }
                if size < old || !doomed.is_empty() {
                    // Clients drop cached chunk locations of older generations.
                    attr.generation += 1;
                    attr.allocated = attr.allocated.saturating_sub(tx.free_chunks(ino, &doomed)?);
                    effects.freed = tx.blocks(&doomed);
                    // Only a shrink leaves bytes of the file's last chunk to zero.
                    let (chunk, from) = layout.locate(size);
                    if size < old && from != 0 {
                        if let Some(v) = tx.t(T_CHUNKS).get(key_u64s(ino, chunk))? {
                            let loc = lift(decode_loc(&v))?;
                            let order = layout.order(chunk);
                            tx.t(T_TAILS).insert(
                                key_server(loc.server, loc.index),
                                &encode_tail(from, order),
                            )?;
                            effects.tail = Some(Tail {
                                block: Block { loc, order },
                                from,
                            });
                        }
                    }
                }
                attr.size = size;
                attr.mtime = now;
                changed = true;
            }
            if let Some(perm) = set.perm {
                let perm = perm & 0o7777;
                // Anyone may clear set-ID bits and nothing else: the kernel asks so, with the
                // caller's credentials, when a non-owner truncates or writes a set-ID file.
                let only_clears_setid =
                    perm & !attr.perm == 0 && (perm ^ attr.perm) & !fcb::SETID_BITS == 0;
                if !root && !owner && !only_clears_setid {
                    return abort(FsError::Perm);
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
                    return abort(FsError::Perm);
                }
                attr.uid = uid;
                changed = true;
            }
            if let Some(gid) = set.gid {
                // Non-root owners may change the group (the kernel checks their membership).
                if !root && !owner && gid != attr.gid {
                    return abort(FsError::Perm);
                }
                attr.gid = gid;
                changed = true;
            }
            let at = |t: SetTime| match t {
                SetTime::At(t) => t,
                SetTime::Now => now,
            };
            if let Some(t) = set.atime {
                attr.atime = at(t);
                changed = true;
            }
            if let Some(t) = set.mtime {
                attr.mtime = at(t);
                changed = true;
            }
            if changed {
                attr.ctime = now;
            }
            tx.put_inode(&attr)?;
            Ok((attr, effects))
        })
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
    fn free_listed(
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

    /// Sets an xattr.
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

    // ---- chunk allocation -------------------------------------------------------------------

    /// Makes sure chunks `first..first+count` of `ino` exist, taking zeroed blocks of each
    /// chunk's order from the servers in `servers` (the connected ones, by id): chunk `c` prefers server
    /// `servers[(ino + c) % n]` (striping), then any other with space. All or nothing: out of
    /// space aborts the whole transaction with `NoSpace`.
    pub fn allocate_chunks(
        &self,
        ino: Ino,
        generation: u64,
        first: u64,
        count: u64,
        servers: &[u32],
    ) -> Result<Vec<ChunkLoc>, FsError> {
        check_chunk_range(first, count)?;
        self.tx(|tx| {
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
                    let loc = lift(decode_loc(&v))?;
                    if tx
                        .t(T_LOST)
                        .get(key_server(loc.server, loc.index))?
                        .is_some()
                    {
                        return abort(lost_error(ino, c, loc));
                    }
                    out.push(loc);
                    continue;
                }
                let n = servers.len();
                let start = if n == 0 {
                    0
                } else {
                    ((ino.wrapping_add(c)) % n as u64) as usize
                };
                let mut placed = None;
                for k in 0..n {
                    let slot = (start + k) % n;
                    if full[slot] {
                        continue;
                    }
                    match tx.take_block(servers[slot], tx.1.order(c))? {
                        Some(index) => {
                            placed = Some(ChunkLoc {
                                server: servers[slot],
                                index,
                            });
                            break;
                        }
                        None => full[slot] = true,
                    }
                }
                let Some(loc) = placed else {
                    return abort(FsError::NoSpace);
                };
                tx.t(T_CHUNKS).insert(key, &encode_loc(loc))?;
                attr.allocated += tx.1.len(c);
                out.push(loc);
            }
            if attr.allocated != allocated {
                tx.put_inode(&attr)?;
            }
            Ok(out)
        })
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

    /// Every chunk of a file on data server `server`: (ino, chunk index, location).
    fn chunks_on(&self, server: u32) -> Result<Vec<(Ino, u64, ChunkLoc)>, FsError> {
        let mut out = Vec::new();
        for item in self.tree(T_CHUNKS).iter() {
            let (k, v) = item.map_err(db_err)?;
            let loc = decode_loc(&v)?;
            if loc.server == server {
                let (ino, index) = decode_u64_pair(&k)?;
                out.push((ino, index, loc));
            }
        }
        Ok(out)
    }
}

/// The error of an I/O touching lost chunk `index` of `ino`.
fn lost_error(ino: Ino, index: u64, loc: ChunkLoc) -> FsError {
    FsError::Lost(format!(
        "chunk {index} of inode {ino} was on data server {}, which restarted without its memory",
        loc.server
    ))
}

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
    /// (ino, chunk index, location).
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
            image
                .chunks
                .push((decode_ino_prefix(&k)?, index, decode_loc(&v)?));
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

/// Removes one link of `ino` (its directory entry is gone already): the inode goes when its last
/// link does, unless it is open (then it becomes an orphan).
fn drop_link(tx: &Tx, ino: Ino, open: bool, doomed: &Doomed, now: Timestamp) -> TxResult<Effects> {
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
fn new_node_owner(dir: &Attr, kind: FileKind, perm: u16, caller: Caller) -> (u16, u32) {
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

fn check_chunk_range(first: u64, count: u64) -> Result<(), FsError> {
    if count > MAX_CHUNKS_PER_CALL || first.checked_add(count).is_none() {
        return Err(FsError::Invalid(format!(
            "chunk range {first}+{count} is too large (at most {MAX_CHUNKS_PER_CALL} per call)"
        )));
    }
    Ok(())
}

fn check_xattr_name(name: &str) -> Result<(), FsError> {
    if name.is_empty() {
        return Err(FsError::Invalid("empty xattr name".into()));
    }
    if name.len() > XATTR_NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    Ok(())
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
            .allocate_chunks(attr.ino, attr.generation, 0, chunks, &[0])
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
        store.allocate_chunks(f.ino, 0, 0, 7, &[0]).unwrap();
        assert_eq!(store.getattr(f.ino).unwrap().allocated, bytes(0..7));
        // Allocating chunks that exist adds nothing.
        store.allocate_chunks(f.ino, 0, 2, 3, &[0]).unwrap();
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
            store.allocate_chunks(f.ino, f.generation, 0, 4, &[0]),
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
        assert!(shrink(CS + CS).tail.is_none());
        // Into the middle of chunk 1: its tail from offset 100 on, recorded durably.
        let effects = shrink(CS + 100);
        let tail = effects.tail.unwrap();
        assert_eq!(tail.from, 100);
        assert_eq!(store.tails().unwrap(), vec![tail]);
        let loc = tail.block.loc;
        store.tail_zeroed(loc).unwrap();
        assert!(store.tails().unwrap().is_empty());
        // Freeing the chunk drops a pending tail with it (a dirty chunk is zeroed whole).
        let effects = shrink(CS + 50);
        assert!(effects.tail.is_some());
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
                .allocate_chunks(f.ino, f.generation, 0, 1, &[0])
                .unwrap()[0];
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
            store.allocate_chunks(g.ino, g.generation, 0, 1, &[0]),
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
            .allocate_chunks(g.ino, g.generation, 0, 6, &[0])
            .unwrap();
        let layout = store.layout();
        for (k, loc) in locs.iter().enumerate() {
            let units = layout.len(k as u64) / layout.unit();
            assert_eq!(loc.index % units, 0, "chunk {k} aligned to its size");
        }
        // Chunks 0..=5 hold 4+4+8+16+32+64 KiB = 32 units: the whole region.
        assert_eq!(unallocated(&store), 0);
    }
}
