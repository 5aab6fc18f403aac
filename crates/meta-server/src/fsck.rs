//! The consistency checker (`citronfs fsck`): compares every record of the namespace and the
//! chunk allocation state with every other, and (at rest) the open files' lock words with "no
//! lock held", and repairs what can be repaired without guessing.
//!
//! It runs in the meta server, which owns all of that: `Store::image` reads the
//! database, the service adds what lives only in memory (which files are open, the size in
//! their control blocks, their locks) and holds its state lock throughout, so that no namespace
//! change, chunk allocation or chunk recycling runs between the scans. [`check_offline`] runs
//! the same checks on a stopped server's database.
//!
//! # What is compared (each a [`Finding`])
//!
//! - **Chunks.** Every chunk-map entry names a known server, a chunk below that server's
//!   `next_fresh` mark and its region's end, and no chunk named by another entry; the map
//!   belongs to a regular file. Every chunk below `next_fresh` is in exactly one of: a chunk
//!   map, the free stack, the dirty set — so in files + free + dirty + never used adds up to the
//!   server's chunks. The free stack is `free_count` entries in slots `0..free_count`, each a
//!   distinct chunk. Every inode's `allocated` is the bytes of the chunks its map holds.
//! - **Sizes.** No file has a chunk wholly beyond its size (truncate frees those; at rest no
//!   write is in flight that allocated ahead of raising the size). For a file open somewhere
//!   the size is in its control block, and writes in flight allocate ahead of it, so open
//!   files are compared only at rest.
//! - **Links.** A non-directory's link count is the number of entries naming it; a
//!   directory's is 2 + its subdirectories. Every entry names an existing inode of its kind and
//!   has its readdir index (and every index its entry); a directory is named by exactly one
//!   entry, matching its parent pointer.
//! - **Reachability.** Every inode is reachable from the root, or unlinked and open somewhere
//!   (an orphan, marked as such); an orphan mark on an inode open nowhere is stale (the server
//!   deletes those at start). Records of missing inodes (xattrs, symlink targets, parent
//!   pointers, cookie counters) are strays.
//! - **Locks at rest** (`FsckOptions::at_rest`, or no other session connected): every open
//!   file's lock words are free and their counters balanced (`lockmgr::schemes::inspect`) —
//!   the service adds these findings.
//! - **Lost chunks.** Chunks of a memory-only data server that came back without its memory
//!   are marked lost by the meta server (`store`'s `lost` tree): each file with some whose
//!   every replica is lost is a finding (`lost-chunks`; a lost replica beside a live one is
//!   under-replication, see below), not repaired — the data is gone; the user truncates or removes
//!   the file. A mark that does not name the chunk map's entry is reported as a stray record.
//! - **Replicas** (the running server only: `crate::replica_check`, called by the service).
//!   The bytes of a chunk's live replicas, read from their data servers, are the same (files
//!   at rest only), and every chunk has as many live replicas as its file's factor.
//!
//! # Repairs (`repair`)
//!
//! Only what has one right answer: at rest, lock words that no live client holds or waits
//! for are put back at rest (`lockmgr::schemes::reset_to_rest`, by the service); dangling entries and strays are removed; unreachable
//! inodes (open nowhere) are deleted and their chunks freed; stale orphan marks are resolved
//! (deleted when unlinked, unmarked when linked); link counts are set to what the entries give,
//! and chunk-byte counts to what the chunk maps hold;
//! chunks of no file, and chunks beyond the size of a file open nowhere, are freed; leaked
//! chunks are freed (marked dirty, so they are zeroed before reuse); a broken free stack is
//! rebuilt from its valid entries; a dirty mark on a chunk in use is dropped. Repairs run in
//! rounds (one repair can reveal the next: a deleted directory's children become unreachable)
//! until a round finds nothing more to do. Not repaired, because the right answer is not known:
//! chunks shared by two files or naming nothing allocated, kind mismatches, directory parent
//! conflicts; lock words when the caller does not say no client is active (`at_rest`).

use crate::store::{Block, Image, ServerRecord, Store};
use proto::fsck::{Finding, FsckCounts, FsckOptions, FsckReport, Repair, MAX_FINDINGS};
use proto::layout::Layout;
use proto::{ChunkLoc, FileKind, FsError, Ino, ROOT_INO};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::path::Path;

/// At most this many repair rounds (each check, repair) before the final check.
const REPAIR_ROUNDS: usize = 8;

/// What the checker needs to know beyond the database: which files are open (by some live
/// session) and, at rest, the size in their control blocks.
#[derive(Clone, Debug, Default)]
pub(crate) struct Live {
    /// Open files, with the size in their control block when it could be read.
    pub open: BTreeMap<Ino, Option<u64>>,
    /// Nothing is in flight: compare open files' chunk maps with their control blocks.
    pub at_rest: bool,
}

/// Runs every check of the module docs on `image`; returns the findings and what was looked at.
pub(crate) fn check(image: &Image, live: &Live, layout: Layout) -> (Vec<Finding>, FsckCounts) {
    let mut out = Vec::new();
    check_chunks(image, live, layout, &mut out);
    check_lost(image, &mut out);
    check_namespace(image, live, &mut out);
    let counts = FsckCounts {
        inodes: image.inodes.len() as u64,
        entries: image.entries.len() as u64,
        chunks: image.chunks.len() as u64,
        servers: image.servers.len() as u64,
        ..FsckCounts::default()
    };
    (out, counts)
}

/// Files with lost chunks (see the module docs).
fn check_lost(image: &Image, out: &mut Vec<Finding>) {
    let maps: HashSet<(Ino, u64, ChunkLoc)> = image.chunks.iter().copied().collect();
    let lost: HashSet<(Ino, u64, ChunkLoc)> = image.lost.iter().copied().collect();
    // Chunks with a replica not marked lost: their data is still there (the replica checks
    // count them under-replicated).
    let held: HashSet<(Ino, u64)> = image
        .chunks
        .iter()
        .filter(|c| !lost.contains(c))
        .map(|&(ino, chunk, _)| (ino, chunk))
        .collect();
    let mut per_file: BTreeMap<Ino, (Vec<u64>, BTreeSet<u32>)> = BTreeMap::new();
    for &(ino, chunk, loc) in &image.lost {
        if held.contains(&(ino, chunk)) && maps.contains(&(ino, chunk, loc)) {
            continue;
        }
        if maps.contains(&(ino, chunk, loc)) {
            let (chunks, servers) = per_file.entry(ino).or_default();
            chunks.push(chunk);
            servers.insert(loc.server);
        } else {
            out.push(Finding::StrayRecord {
                ino,
                what: format!(
                    "a lost mark on chunk {chunk} at {loc:?}, which its chunk map does not name"
                ),
            });
        }
    }
    for (ino, (mut chunks, servers)) in per_file {
        chunks.sort_unstable();
        chunks.dedup();
        out.push(Finding::LostChunks {
            ino,
            chunks,
            servers: servers.into_iter().collect(),
        });
    }
}

/// The data servers' records as the chunk checks see them.
struct Space<'a> {
    servers: HashMap<u32, &'a ServerRecord>,
    /// The layout's largest order.
    max: u32,
    layout: Layout,
}

impl<'a> Space<'a> {
    fn new(image: &'a Image, layout: Layout) -> Space<'a> {
        Space {
            servers: image.servers.iter().map(|s| (s.id, s)).collect(),
            max: layout.max_order(),
            layout,
        }
    }

    /// Units below `next_fresh` (in chunk-size blocks): allocated at least once.
    fn limit(&self, s: &ServerRecord) -> u64 {
        s.next_fresh.min(s.chunks) << self.max
    }

    /// Whether `b` is an aligned block of a known server below its `next_fresh` mark.
    fn allocated(&self, b: &Block) -> bool {
        let units = Layout::units_of(b.order);
        self.servers.get(&b.loc.server).is_some_and(|s| {
            b.order <= self.max
                && b.loc.index % units == 0
                && b.loc
                    .index
                    .checked_add(units)
                    .is_some_and(|e| e <= self.limit(s))
        })
    }
}

/// What a block of a server's region is, for the sweep of [`sweep_units`].
#[derive(Clone, Copy)]
enum Kind {
    Used(Ino, u64),
    Free,
    Dirty,
}

fn check_chunks(image: &Image, live: &Live, layout: Layout, out: &mut Vec<Finding>) {
    let space = Space::new(image, layout);
    let (used, per_file) = check_chunk_maps(image, &space, out);
    check_allocated_bytes(image, &per_file, layout, out);
    check_sizes(image, live, per_file, layout, out);
    let free_blocks = check_free_stacks(image, &space, out);
    // Dirty set.
    let mut dirty_blocks: Vec<Block> = Vec::new();
    for &block in &image.dirty {
        if !space.allocated(&block) {
            out.push(Finding::DirtyChunkOutOfRange { loc: block.loc });
        } else {
            dirty_blocks.push(block);
        }
    }
    sweep_units(image, &space, &used, &free_blocks, &dirty_blocks, out);
}

/// The blocks chunk maps name (each once, with its first owner) and each file's chunk indexes;
/// reports chunks on unknown servers or outside what was allocated, maps of what is not a file,
/// and chunks two maps name.
#[allow(clippy::type_complexity)]
fn check_chunk_maps(
    image: &Image,
    space: &Space,
    out: &mut Vec<Finding>,
) -> (Vec<(Block, Ino, u64)>, BTreeMap<Ino, Vec<u64>>) {
    let mut owners: HashMap<ChunkLoc, Vec<(Ino, u64)>> = HashMap::new();
    let mut used: Vec<(Block, Ino, u64)> = Vec::new();
    let mut of_no_file: BTreeMap<Ino, u64> = BTreeMap::new();
    let mut per_file: BTreeMap<Ino, Vec<u64>> = BTreeMap::new();
    for &(ino, chunk, loc) in &image.chunks {
        match image.inodes.get(&ino) {
            Some(attr) if attr.kind == FileKind::File => {
                per_file.entry(ino).or_default().push(chunk)
            }
            _ => *of_no_file.entry(ino).or_default() += 1,
        }
        let block = Block {
            loc,
            order: space.layout.order(chunk),
        };
        if !space.servers.contains_key(&loc.server) {
            out.push(Finding::ChunkOnUnknownServer { ino, chunk, loc });
        } else if !space.allocated(&block) {
            out.push(Finding::ChunkNotAllocated { ino, chunk, loc });
        }
        let o = owners.entry(loc).or_default();
        if o.is_empty() {
            used.push((block, ino, chunk));
        }
        o.push((ino, chunk));
    }
    for (ino, chunks) in of_no_file {
        out.push(Finding::ChunkOfNoFile { ino, chunks });
    }
    let mut shared: Vec<(&ChunkLoc, &Vec<(Ino, u64)>)> =
        owners.iter().filter(|(_, o)| o.len() > 1).collect();
    shared.sort_by_key(|(loc, _)| (loc.server, loc.index));
    for (loc, o) in shared {
        out.push(Finding::ChunkSharedBy {
            loc: *loc,
            owners: o.clone(),
        });
    }
    (used, per_file)
}

/// Chunk bytes: what each file counts against what its map holds (every file, those without
/// chunks included).
fn check_allocated_bytes(
    image: &Image,
    per_file: &BTreeMap<Ino, Vec<u64>>,
    layout: Layout,
    out: &mut Vec<Finding>,
) {
    for (&ino, attr) in &image.inodes {
        let counted = per_file
            .get(&ino)
            .map_or(0, |chunks| layout.held(chunks.iter().copied()));
        if attr.allocated != counted {
            out.push(Finding::WrongAllocated {
                ino,
                stored: attr.allocated,
                counted,
            });
        }
    }
}

/// Sizes: chunks wholly beyond the size (see the module docs for open files).
fn check_sizes(
    image: &Image,
    live: &Live,
    per_file: BTreeMap<Ino, Vec<u64>>,
    layout: Layout,
    out: &mut Vec<Finding>,
) {
    for (ino, chunks) in per_file {
        let size = match live.open.get(&ino) {
            None => image.inodes[&ino].size,
            Some(Some(fcb_size)) if live.at_rest => *fcb_size,
            Some(_) => continue,
        };
        let first_beyond = layout.chunks_below(size);
        let mut beyond: Vec<u64> = chunks.into_iter().filter(|&c| c >= first_beyond).collect();
        // A chunk of several replicas is listed once per replica: named once.
        beyond.dedup();
        if !beyond.is_empty() {
            out.push(Finding::ChunkBeyondSize {
                ino,
                size,
                chunks: beyond,
            });
        }
    }
}

/// Free stacks: per server and order, `free_counts[order]` entries in slots
/// `0..free_counts[order]`, each a distinct allocated block with its free-index entry. Returns
/// the free blocks that are allocated and listed once.
fn check_free_stacks(image: &Image, space: &Space, out: &mut Vec<Finding>) -> Vec<Block> {
    let mut free: BTreeMap<u32, Vec<(u32, u64, u64)>> = BTreeMap::new();
    for &(server, order, slot, at) in &image.free {
        free.entry(server).or_default().push((order, slot, at));
    }
    let mut index: HashMap<(u32, u64), (u32, u64)> = HashMap::new();
    let mut index_count: HashMap<u32, u64> = HashMap::new();
    for &(server, at, order, slot) in &image.freeidx {
        index.insert((server, at), (order, slot));
        *index_count.entry(server).or_default() += 1;
    }
    let mut free_blocks: Vec<Block> = Vec::new();
    for rec in &image.servers {
        let entries = free.remove(&rec.id).unwrap_or_default();
        let indexed = index_count.get(&rec.id).copied().unwrap_or(0);
        let mut problems =
            free_stack_problems(rec, &entries, &index, indexed, space, &mut free_blocks);
        if !problems.is_empty() {
            problems.sort();
            problems.dedup();
            problems.truncate(8);
            out.push(Finding::FreeStackBroken {
                server: rec.id,
                detail: problems.join("; "),
            });
        }
    }
    for (server, entries) in free {
        out.push(Finding::FreeStackBroken {
            server,
            detail: format!("{} entries for a server with no record", entries.len()),
        });
    }
    free_blocks
}

/// What is wrong with server `rec`'s free stacks, whose `entries` are (order, slot, unit
/// offset), given the free index (`indexed` entries of it are the server's); pushes each free
/// block that is allocated and listed once to `free_blocks`.
fn free_stack_problems(
    rec: &ServerRecord,
    entries: &[(u32, u64, u64)],
    index: &HashMap<(u32, u64), (u32, u64)>,
    indexed: u64,
    space: &Space,
    free_blocks: &mut Vec<Block>,
) -> Vec<String> {
    let max = space.max;
    let mut problems = Vec::new();
    if rec.free_counts.len() != max as usize + 1 {
        problems.push(format!(
            "{} stack counts for {} orders",
            rec.free_counts.len(),
            max + 1
        ));
    }
    let mut slots: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    let mut seen = HashSet::new();
    for &(order, slot, at) in entries {
        let count = rec.free_counts.get(order as usize).copied().unwrap_or(0);
        if slot >= count || !slots.entry(order).or_default().insert(slot) {
            problems.push(format!("order {order} slot {slot} for a count of {count}"));
        }
        let block = Block {
            loc: ChunkLoc {
                server: rec.id,
                index: at,
            },
            order,
        };
        if !space.allocated(&block) {
            problems.push(format!(
                "block {at} of order {order} was never allocated or is misaligned"
            ));
        } else if !seen.insert(at) {
            problems.push(format!("block {at} is on it twice"));
        } else {
            free_blocks.push(block);
        }
        if index.get(&(rec.id, at)) != Some(&(order, slot)) {
            problems.push(format!("block {at} has no matching free-index entry"));
        }
    }
    for (order, &count) in rec.free_counts.iter().enumerate() {
        let n = slots.get(&(order as u32)).map_or(0, |s| s.len() as u64);
        if n != count {
            problems.push(format!("order {order}: {n} entries for a count of {count}"));
        }
    }
    if indexed != entries.len() as u64 {
        problems.push(format!(
            "{} free-index entries for {} stack entries",
            indexed,
            entries.len()
        ));
    }
    problems
}

/// Every unit below `next_fresh` in exactly one block: a sweep per server over the used, free
/// and dirty blocks in address order finds overlaps and gaps (leaks).
fn sweep_units(
    image: &Image,
    space: &Space,
    used: &[(Block, Ino, u64)],
    free_blocks: &[Block],
    dirty_blocks: &[Block],
    out: &mut Vec<Finding>,
) {
    let mut per_server: BTreeMap<u32, Vec<(u64, u64, Kind)>> = BTreeMap::new();
    let mut add = |b: &Block, kind: Kind| {
        let start = b.loc.index;
        let end = start.saturating_add(Layout::units_of(b.order));
        per_server
            .entry(b.loc.server)
            .or_default()
            .push((start, end, kind));
    };
    for (b, ino, chunk) in used {
        if space.allocated(b) {
            add(b, Kind::Used(*ino, *chunk));
        }
    }
    free_blocks.iter().for_each(|b| add(b, Kind::Free));
    dirty_blocks.iter().for_each(|b| add(b, Kind::Dirty));
    let (max, layout) = (space.max, space.layout);
    for rec in &image.servers {
        let mut blocks = per_server.remove(&rec.id).unwrap_or_default();
        blocks.sort_by_key(|&(start, end, _)| (start, end));
        // The block reaching furthest so far.
        let mut cover: Option<(u64, u64, Kind)> = None;
        let mut reached = 0u64;
        for &(start, end, kind) in &blocks {
            if start > reached {
                leaks(rec.id, reached, start, max, layout, out);
            }
            if let Some((c_start, _, c_kind)) = cover.filter(|_| start < reached) {
                if let Some(finding) = overlap(rec.id, (c_start, c_kind), (start, kind)) {
                    out.push(finding);
                }
            }
            if end > reached {
                reached = end;
                cover = Some((start, end, kind));
            }
        }
        let top = space.limit(rec);
        if top > reached {
            leaks(rec.id, reached, top, max, layout, out);
        }
    }
}

/// What two overlapping blocks of `server` say: the one reaching furthest so far (`cover`, at
/// its start) and the next one (`next`, at its start).
fn overlap(server: u32, cover: (u64, Kind), next: (u64, Kind)) -> Option<Finding> {
    let ((c_start, c_kind), (start, kind)) = (cover, next);
    let loc = |index| ChunkLoc { server, index };
    Some(match (c_kind, kind) {
        (Kind::Used(ino, chunk), Kind::Free) | (Kind::Free, Kind::Used(ino, chunk)) => {
            Finding::ChunkUsedAndFree {
                ino,
                chunk,
                loc: loc(if matches!(kind, Kind::Free) {
                    start
                } else {
                    c_start
                }),
                dirty: false,
            }
        }
        (Kind::Used(ino, chunk), Kind::Dirty) | (Kind::Dirty, Kind::Used(ino, chunk)) => {
            Finding::ChunkUsedAndFree {
                ino,
                chunk,
                loc: loc(if matches!(kind, Kind::Dirty) {
                    start
                } else {
                    c_start
                }),
                dirty: true,
            }
        }
        (Kind::Free, Kind::Dirty) => Finding::ChunkFreeAndDirty { loc: loc(start) },
        (Kind::Dirty, Kind::Free) => Finding::ChunkFreeAndDirty { loc: loc(c_start) },
        (Kind::Used(a, ca), Kind::Used(b, cb)) => Finding::ChunkSharedBy {
            loc: loc(start),
            owners: vec![(a, ca), (b, cb)],
        },
        (Kind::Free, Kind::Free) => Finding::FreeStackBroken {
            server,
            detail: format!("free blocks at {c_start} and {start} overlap"),
        },
        // Dirty blocks come from chunk maps and leaks: two overlapping ones were two
        // overlapping chunks, reported while they were used.
        (Kind::Dirty, Kind::Dirty) => return None,
    })
}

/// Reports units `from..to` of `server` (in no block) as the fewest aligned blocks.
fn leaks(server: u32, mut from: u64, to: u64, max: u32, layout: Layout, out: &mut Vec<Finding>) {
    while from < to {
        let mut order = max.min(from.trailing_zeros());
        while from + Layout::units_of(order) > to {
            order -= 1;
        }
        out.push(Finding::LeakedChunk {
            loc: ChunkLoc {
                server,
                index: from,
            },
            bytes: layout.unit() << order,
        });
        from += Layout::units_of(order);
    }
}

/// What the directory entries say of the inodes they name.
#[derive(Default)]
struct Tally {
    /// Links of non-directories counted from the entries.
    links: HashMap<Ino, u32>,
    /// Subdirectories per directory.
    subdirs: HashMap<Ino, u32>,
    /// The directories whose entries name each directory.
    named_by: HashMap<Ino, Vec<Ino>>,
    /// What each directory's entries name.
    children: HashMap<Ino, Vec<Ino>>,
}

fn check_namespace(image: &Image, live: &Live, out: &mut Vec<Finding>) {
    let tally = check_entries(image, out);
    let reached = reachable(image, &tally.children);
    for (&ino, attr) in &image.inodes {
        if attr.kind == FileKind::Dir {
            check_dir_links(image, &tally, &reached, ino, attr, out);
        } else {
            check_file_links(image, &tally, &reached, ino, attr, out);
        }
        let open = live.open.contains_key(&ino);
        let orphan = image.orphans.contains(&ino);
        if !reached.contains(&ino) {
            if orphan {
                if !open || attr.nlink > 0 {
                    out.push(Finding::StaleOrphan {
                        ino,
                        nlink: attr.nlink,
                    });
                }
            } else {
                out.push(Finding::Unreachable {
                    ino,
                    kind: attr.kind,
                    nlink: attr.nlink,
                });
            }
        } else if orphan {
            // Linked and marked: its last release would delete a file that has names.
            out.push(Finding::StaleOrphan {
                ino,
                nlink: attr.nlink,
            });
        }
    }
    check_stray_records(image, out);
}

/// Checks every directory entry against its directory, its inode, the readdir index and the
/// cookie counter (and the index against the entries); counts what the sound ones name.
fn check_entries(image: &Image, out: &mut Vec<Finding>) -> Tally {
    let index: HashMap<(Ino, u64), &crate::store::ImageEntry> = image
        .index
        .iter()
        .map(|e| ((e.parent, e.cookie), e))
        .collect();
    let mut tally = Tally::default();
    for e in &image.entries {
        let Some(target) = check_entry(image, &index, e, out) else {
            continue;
        };
        tally.children.entry(e.parent).or_default().push(e.ino);
        if target.kind == FileKind::Dir {
            *tally.subdirs.entry(e.parent).or_default() += 1;
            tally.named_by.entry(e.ino).or_default().push(e.parent);
        } else {
            *tally.links.entry(e.ino).or_default() += 1;
        }
    }
    let entries: HashSet<(Ino, u64)> = image.entries.iter().map(|e| (e.parent, e.cookie)).collect();
    for i in &image.index {
        if !entries.contains(&(i.parent, i.cookie)) {
            out.push(Finding::EntryMismatch {
                parent: i.parent,
                name: i.name.clone(),
                detail: format!("readdir index at cookie {} has no entry", i.cookie),
            });
        }
    }
    tally
}

/// Checks entry `e`; the inode it names, unless it is in no directory or names nothing.
fn check_entry<'a>(
    image: &'a Image,
    index: &HashMap<(Ino, u64), &crate::store::ImageEntry>,
    e: &crate::store::ImageEntry,
    out: &mut Vec<Finding>,
) -> Option<&'a proto::Attr> {
    let mismatch = |detail: String| Finding::EntryMismatch {
        parent: e.parent,
        name: e.name.clone(),
        detail,
    };
    match image.inodes.get(&e.parent) {
        Some(dir) if dir.kind == FileKind::Dir => {}
        _ => {
            out.push(mismatch(
                "it is in something that is not an existing directory".into(),
            ));
            return None;
        }
    }
    let Some(target) = image.inodes.get(&e.ino) else {
        out.push(Finding::DanglingEntry {
            parent: e.parent,
            name: e.name.clone(),
            ino: e.ino,
        });
        return None;
    };
    if target.kind != e.kind {
        out.push(mismatch(format!(
            "it says {:?}, inode {} is {:?}",
            e.kind, e.ino, target.kind
        )));
    }
    match index.get(&(e.parent, e.cookie)) {
        Some(i) if i.ino == e.ino && i.name == e.name && i.kind == e.kind => {}
        _ => out.push(mismatch(format!(
            "no matching readdir index at cookie {}",
            e.cookie
        ))),
    }
    if image
        .cookies
        .get(&e.parent)
        .is_none_or(|&next| e.cookie >= next)
    {
        out.push(mismatch(format!(
            "cookie {} is not below the directory's next cookie (it would be reused)",
            e.cookie
        )));
    }
    Some(target)
}

/// The inodes reachable from the root through `children`.
fn reachable(image: &Image, children: &HashMap<Ino, Vec<Ino>>) -> HashSet<Ino> {
    let mut reached: HashSet<Ino> = HashSet::new();
    let mut queue = VecDeque::from([ROOT_INO]);
    while let Some(ino) = queue.pop_front() {
        if !reached.insert(ino) {
            continue;
        }
        for &child in children.get(&ino).into_iter().flatten() {
            if image.inodes.contains_key(&child) {
                queue.push_back(child);
            }
        }
    }
    reached
}

/// A directory's link count and parent pointer against the entries that name it.
fn check_dir_links(
    image: &Image,
    tally: &Tally,
    reached: &HashSet<Ino>,
    ino: Ino,
    attr: &proto::Attr,
    out: &mut Vec<Finding>,
) {
    let counted = 2 + tally.subdirs.get(&ino).copied().unwrap_or(0);
    if attr.nlink != counted && (reached.contains(&ino) || ino == ROOT_INO) {
        out.push(Finding::WrongLinkCount {
            ino,
            kind: attr.kind,
            stored: attr.nlink,
            counted,
        });
    }
    let namers = tally.named_by.get(&ino).map(Vec::as_slice).unwrap_or(&[]);
    let parent = image.parents.get(&ino).copied();
    let detail = if ino == ROOT_INO {
        (parent != Some(ROOT_INO) || !namers.is_empty())
            .then(|| format!("the root's parent is {parent:?} and entries in {namers:?} name it"))
    } else if namers.len() > 1 {
        Some(format!(
            "named by entries in several directories: {namers:?}"
        ))
    } else if namers.len() == 1 && parent != Some(namers[0]) {
        Some(format!(
            "named in directory {} but its parent pointer is {parent:?}",
            namers[0]
        ))
    } else {
        None
    };
    if let Some(detail) = detail {
        out.push(Finding::DirectoryParent { ino, detail });
    }
}

/// A non-directory's link count against its entries, and records only directories or
/// symlinks may have.
fn check_file_links(
    image: &Image,
    tally: &Tally,
    reached: &HashSet<Ino>,
    ino: Ino,
    attr: &proto::Attr,
    out: &mut Vec<Finding>,
) {
    let counted = tally.links.get(&ino).copied().unwrap_or(0);
    // An orphan (unlinked while open) has no entry and a count of 0.
    if attr.nlink != counted && reached.contains(&ino) {
        out.push(Finding::WrongLinkCount {
            ino,
            kind: attr.kind,
            stored: attr.nlink,
            counted,
        });
    }
    if attr.kind == FileKind::Symlink && !image.symlinks.contains(&ino) {
        out.push(Finding::StrayRecord {
            ino,
            what: "a symlink without a target".into(),
        });
    }
    if image.parents.contains_key(&ino) {
        out.push(Finding::StrayRecord {
            ino,
            what: "a parent pointer on something that is not a directory".into(),
        });
    }
}

/// Records of inodes that do not exist.
fn check_stray_records(image: &Image, out: &mut Vec<Finding>) {
    let mut strays: BTreeMap<Ino, Vec<&str>> = BTreeMap::new();
    let sets: [(&str, Box<dyn Iterator<Item = Ino> + '_>); 5] = [
        ("xattrs", Box::new(image.xattr_inos.iter().copied())),
        ("a symlink target", Box::new(image.symlinks.iter().copied())),
        ("a parent pointer", Box::new(image.parents.keys().copied())),
        ("a cookie counter", Box::new(image.cookies.keys().copied())),
        ("an orphan mark", Box::new(image.orphans.iter().copied())),
    ];
    for (what, inos) in sets {
        for ino in inos {
            if !image.inodes.contains_key(&ino) {
                strays.entry(ino).or_default().push(what);
            }
        }
    }
    for (ino, what) in strays {
        out.push(Finding::StrayRecord {
            ino,
            what: format!("{} of an inode that does not exist", what.join(", ")),
        });
    }
}

/// What one repair round did: the repairs, and the chunks it freed (now dirty: the caller
/// zeroes and recycles them where their servers are reachable).
#[derive(Default)]
pub(crate) struct Repaired {
    pub repairs: Vec<Repair>,
    pub freed: Vec<Block>,
}

impl Repaired {
    /// `ino`'s chunks were freed (`effects`).
    fn freed_chunks(&mut self, ino: Ino, effects: crate::store::Effects) {
        self.repairs.push(Repair::FreedChunks {
            ino,
            chunks: effects.freed.len() as u64,
        });
        self.freed.extend(effects.freed);
    }

    /// `ino` was deleted (`effects`).
    fn deleted_inode(&mut self, ino: Ino, effects: crate::store::Effects) {
        self.repairs.push(Repair::DeletedInode {
            ino,
            chunks: effects.freed.len() as u64,
        });
        self.freed.extend(effects.freed);
    }
}

/// Repairs what `findings` (of a check of `image`) allow (see the module docs); files open
/// somewhere are never deleted or trimmed.
pub(crate) fn repair(
    store: &Store,
    image: &Image,
    live: &Live,
    findings: &[Finding],
) -> Result<Repaired, FsError> {
    let mut done = Repaired::default();
    let mut rebuild: BTreeSet<u32> = BTreeSet::new();
    let mut deleted: HashSet<Ino> = HashSet::new();
    for finding in findings {
        repair_namespace(store, image, live, finding, &mut done, &mut deleted)?;
        repair_space(store, live, finding, &mut done, &mut rebuild)?;
    }
    let layout = store.layout();
    for server in rebuild {
        let Some(rec) = image.servers.iter().find(|s| s.id == server) else {
            continue;
        };
        let keep = valid_free_blocks(image, layout, rec);
        let before = store.repair_rebuild_free(server, &keep)?;
        done.repairs.push(Repair::RebuiltFreeStack {
            server,
            from: before,
            to: keep.len() as u64,
        });
    }
    Ok(done)
}

/// Repairs one finding about the namespace (entries, links, orphans, stray records); others
/// are left alone. `deleted`: the inodes deleted so far, never deleted twice.
fn repair_namespace(
    store: &Store,
    image: &Image,
    live: &Live,
    finding: &Finding,
    done: &mut Repaired,
    deleted: &mut HashSet<Ino>,
) -> Result<(), FsError> {
    match finding {
        Finding::DanglingEntry { parent, name, .. }
            if store.repair_remove_entry(*parent, name)? =>
        {
            done.repairs.push(Repair::RemovedEntry {
                parent: *parent,
                name: name.clone(),
            });
        }
        Finding::StrayRecord { ino, .. } if !image.inodes.contains_key(ino) => {
            store.repair_remove_stray(*ino)?;
            done.repairs.push(Repair::RemovedStrayRecords { ino: *ino });
        }
        Finding::Unreachable { ino, .. }
            if !live.open.contains_key(ino) && *ino != ROOT_INO && deleted.insert(*ino) =>
        {
            done.deleted_inode(*ino, store.repair_delete_inode(*ino)?);
        }
        Finding::StaleOrphan { ino, nlink } => {
            if *nlink > 0 {
                store.repair_unmark_orphan(*ino)?;
                done.repairs.push(Repair::UnmarkedOrphan { ino: *ino });
            } else if !live.open.contains_key(ino) && deleted.insert(*ino) {
                done.deleted_inode(*ino, store.repair_delete_inode(*ino)?);
            }
        }
        Finding::WrongLinkCount {
            ino,
            stored,
            counted,
            ..
        } => {
            store.repair_set_nlink(*ino, *counted)?;
            done.repairs.push(Repair::SetLinkCount {
                ino: *ino,
                from: *stored,
                to: *counted,
            });
        }
        _ => {}
    }
    Ok(())
}

/// Repairs one finding about space (chunk maps, allocated bytes, leaks, the dirty set); the
/// servers whose free stacks must be rebuilt are added to `rebuild`. Others are left alone.
fn repair_space(
    store: &Store,
    live: &Live,
    finding: &Finding,
    done: &mut Repaired,
    rebuild: &mut BTreeSet<u32>,
) -> Result<(), FsError> {
    match finding {
        Finding::ChunkOfNoFile { ino, .. } => {
            done.freed_chunks(*ino, store.repair_free_chunks(*ino, 0)?);
        }
        Finding::WrongAllocated {
            ino,
            stored,
            counted,
        } => {
            store.repair_set_allocated(*ino, *counted)?;
            done.repairs.push(Repair::SetAllocated {
                ino: *ino,
                from: *stored,
                to: *counted,
            });
        }
        Finding::ChunkBeyondSize { ino, chunks, .. } if !live.open.contains_key(ino) => {
            let from = chunks.iter().copied().min().unwrap_or(0);
            done.freed_chunks(*ino, store.repair_free_chunks(*ino, from)?);
        }
        Finding::LeakedChunk { loc, bytes } => {
            let units = bytes / store.layout().unit();
            if units.is_power_of_two() {
                let block = Block {
                    loc: *loc,
                    order: units.trailing_zeros(),
                };
                store.repair_mark_dirty(block)?;
                done.repairs.push(Repair::FreedLeakedChunk { loc: *loc });
                done.freed.push(block);
            }
        }
        Finding::FreeStackBroken { server, .. } => {
            rebuild.insert(*server);
        }
        Finding::ChunkFreeAndDirty { loc } => {
            rebuild.insert(loc.server);
        }
        Finding::ChunkUsedAndFree { loc, dirty, .. } => {
            if *dirty {
                store.repair_clear_dirty(*loc)?;
                done.repairs.push(Repair::ClearedDirtyMark { loc: *loc });
            } else {
                rebuild.insert(loc.server);
            }
        }
        Finding::DirtyChunkOutOfRange { loc } => {
            store.repair_clear_dirty(*loc)?;
            done.repairs.push(Repair::ClearedDirtyMark { loc: *loc });
        }
        _ => {}
    }
    Ok(())
}

/// The free blocks of server `rec` a rebuilt stack keeps, as (unit offset, order): allocated
/// and aligned, overlapping no chunk, dirty block or other kept free block, in stack order.
fn valid_free_blocks(image: &Image, layout: Layout, rec: &ServerRecord) -> Vec<(u64, u32)> {
    let server = rec.id;
    let limit = rec.next_fresh.min(rec.chunks) << layout.max_order();
    // Occupied ranges: start → end.
    let mut taken: BTreeMap<u64, u64> = BTreeMap::new();
    let overlaps = |taken: &BTreeMap<u64, u64>, start: u64, end: u64| {
        taken
            .range(..end)
            .next_back()
            .is_some_and(|(_, &e)| e > start)
    };
    for &(_, chunk, loc) in image.chunks.iter().filter(|c| c.2.server == server) {
        let end = loc.index.saturating_add(layout.len(chunk) / layout.unit());
        taken.insert(loc.index, end);
    }
    for b in image.dirty.iter().filter(|b| b.loc.server == server) {
        let end = b.loc.index.saturating_add(Layout::units_of(b.order));
        taken.insert(b.loc.index, end);
    }
    let mut entries: Vec<(u32, u64, u64)> = image
        .free
        .iter()
        .filter(|&&(s, _, _, _)| s == server)
        .map(|&(_, order, slot, at)| (order, slot, at))
        .collect();
    entries.sort_unstable();
    let mut keep = Vec::new();
    for (order, _, at) in entries {
        if order > layout.max_order() {
            continue;
        }
        let units = Layout::units_of(order);
        let end = at.saturating_add(units);
        if at % units == 0 && end <= limit && !overlaps(&taken, at, end) {
            taken.insert(at, end);
            keep.push((at, order));
        }
    }
    keep
}

/// The whole run on `store`: a check, then with `options.repair` rounds of repair and check.
/// `live` is called before each check (the service reads its control blocks); `locks(reset)`
/// inspects the open files' locks (the service; at rest only): it adds findings the store
/// cannot see to the first and last check, and with `reset` puts busy words back at rest and
/// says so. Returns the report and the chunks repairs freed.
pub(crate) fn run(
    store: &Store,
    options: FsckOptions,
    mut live: impl FnMut() -> Live,
    mut locks: impl FnMut(bool) -> (Vec<Finding>, u64, Vec<Repair>),
) -> Result<(FsckReport, Vec<Block>), FsError> {
    let mut state = live();
    let image = store.image()?;
    let (mut findings, mut counts) = check(&image, &state, store.layout());
    let (lock_findings, inspected, _) = locks(false);
    findings.extend(lock_findings);
    counts.locks = inspected;
    let mut report = FsckReport {
        counts,
        at_rest: state.at_rest,
        ..FsckReport::default()
    };
    let mut freed = Vec::new();
    if options.repair && !findings.is_empty() {
        report.repairs.extend(locks(true).2);
        let (mut image, mut round) = (image, findings.clone());
        for _ in 0..REPAIR_ROUNDS {
            let done = repair(store, &image, &state, &round)?;
            freed.extend(done.freed);
            let progress = !done.repairs.is_empty();
            report.repairs.extend(done.repairs);
            state = live();
            image = store.image()?;
            round = check(&image, &state, store.layout()).0;
            if !progress || round.is_empty() {
                break;
            }
        }
        // The locks' final word.
        round.extend(locks(false).0);
        round.truncate(MAX_FINDINGS);
        report.remaining = Some(round);
    }
    report.truncated = findings.len().saturating_sub(MAX_FINDINGS) as u64;
    findings.truncate(MAX_FINDINGS);
    report.findings = findings;
    Ok((report, freed))
}

/// How long [`request`] waits for the meta server's answer: a check reads the whole namespace.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Asks the running meta server at `addr` to check itself (the `Fsck` RPC, with the cluster's
/// `credentials`), as `citronfs fsck` does; `who` names the caller in the server's log.
pub fn request(
    addr: &str,
    credentials: &fabric::Credentials,
    options: FsckOptions,
    who: &str,
) -> anyhow::Result<FsckReport> {
    use anyhow::Context;
    use proto::rpc::{Client, Request, Response, Role};
    let role = Role::Client {
        host: who.into(),
        pid: std::process::id(),
    };
    let mut client = Client::connect(addr, credentials, role)
        .with_context(|| format!("cannot reach the meta server at {addr}"))?;
    client.set_timeout(Some(REQUEST_TIMEOUT))?;
    match client.call(Request::Fsck(options))? {
        Ok(Response::Fsck(report)) => Ok(report),
        Ok(other) => anyhow::bail!("the meta server answered fsck with {other:?}"),
        Err(e) => Err(anyhow::anyhow!("the meta server refused fsck: {e}")),
    }
}

/// Checks (and with `repair`, repairs) the database of a stopped meta server in `db_dir`. No
/// file is open then; orphans (unlinked while open when the server stopped) show as stale, and
/// the server would delete them at its next start anyway. Chunks freed by repairs stay dirty
/// until their data server registers again, which zeroes them.
pub fn check_offline(db_dir: &Path, repair: bool) -> anyhow::Result<FsckReport> {
    let (store, _chunk_size) = Store::open_existing(db_dir)?;
    let options = FsckOptions {
        repair,
        at_rest: true,
    };
    let no_locks = |_| (Vec::new(), 0, Vec::new());
    let (report, _freed) =
        run(&store, options, Live::default, no_locks).map_err(|e| anyhow::anyhow!("{e}"))?;
    store.flush().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Corruption;
    use proto::{Caller, FabricAddr};

    const CS: u64 = 4096;
    const OWNER: Caller = Caller { uid: 0, gid: 0 };

    /// A healthy namespace: /d/e (dirs), /d/f and /g (files with chunks, /g linked twice as
    /// /d/h), /s (symlink), a chunk freed and recycled, on two servers of 8 chunks.
    fn healthy() -> (tempfile::TempDir, Store, Ino, Ino) {
        healthy_with(CS)
    }

    /// [`healthy`] with chunks of `cs` bytes (above 4 KiB the first chunks of a file are
    /// smaller: blocks of several orders share the servers' regions).
    fn healthy_with(cs: u64) -> (tempfile::TempDir, Store, Ino, Ino) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), cs, OWNER).unwrap();
        let l = store.layout();
        for name in ["ds-0", "ds-1"] {
            let fabric: FabricAddr = "tcp:127.0.0.1:1".parse().unwrap();
            store
                .register_server(name, &fabric, fabric::RegionId(1), 8, 1)
                .unwrap();
        }
        let d = store.mkdir(ROOT_INO, "d", 0o755, OWNER).unwrap().ino;
        store.mkdir(d, "e", 0o755, OWNER).unwrap();
        let f = store
            .mknod(d, "f", FileKind::File, 0o644, 0, OWNER)
            .unwrap()
            .ino;
        let g = store
            .mknod(ROOT_INO, "g", FileKind::File, 0o644, 0, OWNER)
            .unwrap()
            .ino;
        store.link(g, d, "h").unwrap();
        store.symlink(ROOT_INO, "s", "g", OWNER).unwrap();
        store.allocate_chunks(f, 0, 0, 3, &[0, 1], 1).unwrap();
        store.allocate_chunks(g, 0, 0, 2, &[0, 1], 1).unwrap();
        store.persist_size(f, l.start(3)).unwrap();
        store.persist_size(g, l.start(2) - 1).unwrap();
        // Truncate f to one chunk: two chunks freed (dirty), then recycled (free).
        let set = proto::SetAttr {
            size: Some(l.start(1)),
            ..proto::SetAttr::default()
        };
        let (_, effects) = store.setattr(f, &set, OWNER, None).unwrap();
        assert_eq!(effects.freed.len(), 2);
        store.recycle(effects.freed[0].loc).unwrap();
        (dir, store, f, g)
    }

    fn findings(store: &Store, live: &Live) -> Vec<Finding> {
        check(&store.image().unwrap(), live, store.layout()).0
    }

    /// Damages a healthy store, expects `kind` among the findings, repairs, expects a clean
    /// store with every file's content as before.
    fn damaged(damage: impl Fn(&Store, Ino, Ino) -> Vec<Corruption>, kinds: &[&str]) {
        for cs in [CS, 64 << 10] {
            damaged_with(cs, &damage, kinds);
        }
    }

    fn damaged_with(
        cs: u64,
        damage: &impl Fn(&Store, Ino, Ino) -> Vec<Corruption>,
        kinds: &[&str],
    ) {
        let (_dir, store, f, g) = healthy_with(cs);
        for c in damage(&store, f, g) {
            store.corrupt(&c).unwrap();
        }
        let found = findings(&store, &Live::default());
        for kind in kinds {
            assert!(
                found.iter().any(|x| x.kind() == *kind),
                "expected {kind} in {found:#?}"
            );
        }
        let (report, _) = run(
            &store,
            FsckOptions {
                repair: true,
                at_rest: false,
            },
            Live::default,
            |_| (Vec::new(), 0, Vec::new()),
        )
        .unwrap();
        assert!(!report.repairs.is_empty(), "{kinds:?}: nothing repaired");
        assert_eq!(
            report.remaining,
            Some(Vec::new()),
            "{kinds:?} after {:#?}",
            report.repairs
        );
        assert_eq!(findings(&store, &Live::default()), Vec::new());
    }

    /// Chunks of two replicas: each replica's block is the file's, and charged to it.
    #[test]
    fn a_healthy_namespace_with_replicas_has_no_findings() {
        for cs in [CS, 64 << 10] {
            let (_dir, store, _, _) = healthy_with(cs);
            let r = store
                .mknod(ROOT_INO, "r", FileKind::File, 0o644, 0, OWNER)
                .unwrap()
                .ino;
            let l = store.layout();
            store.persist_size(r, l.start(3)).unwrap();
            let sets = store.allocate_chunks(r, 0, 0, 3, &[0, 1], 2).unwrap();
            assert!(sets.iter().all(|s| s.len() == 2));
            assert_eq!(store.getattr(r).unwrap().allocated, 2 * l.held(0..3));
            assert_eq!(findings(&store, &Live::default()), Vec::new());
        }
    }

    #[test]
    fn a_healthy_namespace_of_mixed_block_sizes_has_no_findings() {
        let (_dir, store, _, _) = healthy_with(64 << 10);
        assert_eq!(findings(&store, &Live::default()), Vec::new());
    }

    #[test]
    fn a_healthy_namespace_has_no_findings() {
        let (_dir, store, f, _) = healthy();
        assert_eq!(findings(&store, &Live::default()), Vec::new());
        // Open with a larger size in its control block (a write in flight): fine while not
        // at rest; at rest, the control block's size is what counts.
        let mut live = Live::default();
        live.open.insert(f, Some(3 * CS));
        assert_eq!(findings(&store, &live), Vec::new());
        live.at_rest = true;
        assert_eq!(findings(&store, &live), Vec::new());
        let generation = store.getattr(f).unwrap().generation;
        store
            .allocate_chunks(f, generation, 1, 4, &[0, 1], 1)
            .unwrap();
        let found = findings(&store, &live);
        assert!(
            matches!(&found[..], [Finding::ChunkBeyondSize { chunks, .. }] if chunks == &[3, 4]),
            "{found:?}"
        );
        // Closing the file frees chunks beyond its size.
        store.persist_size(f, 3 * CS).unwrap();
        let effects = store.free_beyond_size(f).unwrap();
        assert_eq!(effects.freed.len(), 2);
        assert_eq!(findings(&store, &Live::default()), Vec::new());
    }

    #[test]
    fn files_with_lost_chunks_are_listed() {
        let (_dir, store, f, g) = healthy();
        // ds-0 comes back with new memory (another incarnation than `healthy` registered).
        let fabric: FabricAddr = "tcp:127.0.0.1:1".parse().unwrap();
        let (_, lost) = store
            .register_server("ds-0", &fabric, fabric::RegionId(1), 8, 2)
            .unwrap();
        assert!(lost > 0);
        let found = findings(&store, &Live::default());
        let listed: Vec<Ino> = found
            .iter()
            .filter_map(|x| match x {
                Finding::LostChunks { ino, servers, .. } if servers == &[0] => Some(*ino),
                _ => None,
            })
            .collect();
        assert!(!listed.is_empty(), "{found:#?}");
        assert!(listed.iter().all(|i| [f, g].contains(i)), "{found:#?}");
        assert_eq!(found.len(), listed.len(), "only lost chunks: {found:#?}");
    }

    #[test]
    fn chunk_bytes() {
        damaged(
            |_, f, _| {
                vec![Corruption::SetAllocated {
                    ino: f,
                    allocated: 12_345,
                }]
            },
            &["wrong-allocated"],
        );
        // A directory has no chunks.
        damaged(
            |_, _, _| {
                vec![Corruption::SetAllocated {
                    ino: ROOT_INO,
                    allocated: 4096,
                }]
            },
            &["wrong-allocated"],
        );
    }

    #[test]
    fn link_counts() {
        damaged(
            |_, f, _| vec![Corruption::SetNlink { ino: f, nlink: 3 }],
            &["wrong-link-count"],
        );
        damaged(
            |_, _, _| {
                vec![Corruption::SetNlink {
                    ino: ROOT_INO,
                    nlink: 7,
                }]
            },
            &["wrong-link-count"],
        );
        // One of g's two names gone: count 2, one entry.
        damaged(
            |_, _, _| {
                vec![Corruption::RemoveEntry {
                    parent: ROOT_INO,
                    name: "g".into(),
                }]
            },
            &["wrong-link-count"],
        );
    }

    #[test]
    fn dangling_entries_and_strays() {
        damaged(
            |_, _, _| {
                vec![Corruption::AddEntry {
                    parent: ROOT_INO,
                    name: "ghost".into(),
                    ino: 999,
                    kind: FileKind::File,
                }]
            },
            &["dangling-entry"],
        );
        // A directory's record gone: its entry dangles, its parent pointer and counter stray,
        // and the root's link count is one too many.
        damaged(
            |store, _, _| {
                let e = store.lookup(store.lookup(ROOT_INO, "d").unwrap().ino, "e");
                vec![Corruption::RemoveInode {
                    ino: e.unwrap().ino,
                }]
            },
            &["dangling-entry", "stray-record", "wrong-link-count"],
        );
    }

    #[test]
    fn unreachable_inodes_and_their_chunks() {
        // f's only name gone: f and its chunk are unreachable until repaired.
        damaged(
            |store, _, _| {
                let d = store.lookup(ROOT_INO, "d").unwrap().ino;
                vec![Corruption::RemoveEntry {
                    parent: d,
                    name: "f".into(),
                }]
            },
            &["unreachable-inode"],
        );
        // A whole subtree cut loose: d and everything under it only it reached.
        damaged(
            |_, _, _| {
                vec![Corruption::RemoveEntry {
                    parent: ROOT_INO,
                    name: "d".into(),
                }]
            },
            &["unreachable-inode", "wrong-link-count"],
        );
    }

    #[test]
    fn chunk_allocation() {
        damaged(
            |_, _, _| vec![Corruption::LeakChunk { server: 1 }],
            &["leaked-chunk"],
        );
        damaged(
            |store, f, _| {
                let loc = store.chunk_map(f, 0, 1).unwrap()[0].unwrap().first();
                vec![Corruption::PushFree { loc }]
            },
            &["chunk-used-and-free"],
        );
        damaged(
            |store, f, _| {
                let loc = store.chunk_map(f, 0, 1).unwrap()[0].unwrap().first();
                vec![Corruption::MarkDirty { loc }]
            },
            &["chunk-used-and-free"],
        );
        // The freed-and-recycled chunk on the free stack marked dirty too.
        damaged(
            |store, _, _| {
                let image = store.image().unwrap();
                let (server, _, _, index) = image.free[0];
                vec![Corruption::MarkDirty {
                    loc: ChunkLoc { server, index },
                }]
            },
            &["chunk-free-and-dirty"],
        );
        // Chunks under an inode that does not exist.
        damaged(
            |store, f, _| {
                let loc = store.chunk_map(f, 0, 1).unwrap()[0].unwrap().first();
                vec![
                    Corruption::MapChunk {
                        ino: 4242,
                        chunk: 0,
                        loc: ChunkLoc {
                            server: loc.server,
                            index: 7,
                        },
                    },
                    Corruption::LeakChunk { server: loc.server },
                ]
            },
            &["chunks-of-no-file"],
        );
        // A file's stored size shrunk under its chunks.
        damaged(
            |_, _, g| vec![Corruption::SetSize { ino: g, size: 10 }],
            &["chunks-beyond-size"],
        );
    }

    #[test]
    fn what_is_not_repaired_is_still_found() {
        let (_dir, store, f, g) = healthy();
        let loc = store.chunk_map(f, 0, 1).unwrap()[0].unwrap().first();
        // g's chunk 5 is f's chunk 0; f's chunk 9 is on a server that does not exist.
        store
            .corrupt(&Corruption::MapChunk {
                ino: g,
                chunk: 1,
                loc,
            })
            .unwrap();
        store
            .corrupt(&Corruption::MapChunk {
                ino: f,
                chunk: 0,
                loc: ChunkLoc {
                    server: 9,
                    index: 0,
                },
            })
            .unwrap();
        let (report, _) = run(
            &store,
            FsckOptions {
                repair: true,
                at_rest: false,
            },
            Live::default,
            |_| (Vec::new(), 0, Vec::new()),
        )
        .unwrap();
        let kinds: Vec<&str> = report.findings.iter().map(Finding::kind).collect();
        assert!(kinds.contains(&"chunk-on-unknown-server"), "{kinds:?}");
        let remaining = report.remaining.unwrap();
        assert!(
            remaining
                .iter()
                .any(|x| x.kind() == "chunk-on-unknown-server"),
            "{remaining:?}"
        );
    }

    #[test]
    fn a_stopped_servers_database_is_checked_offline() {
        let (dir, store, f, _) = healthy();
        let d = store.lookup(ROOT_INO, "d").unwrap().ino;
        store
            .corrupt(&Corruption::RemoveEntry {
                parent: d,
                name: "f".into(),
            })
            .unwrap();
        store.flush().unwrap();
        drop(store);
        let report = check_offline(dir.path(), false).unwrap();
        assert!(
            report
                .findings
                .iter()
                .any(|x| matches!(x, Finding::Unreachable { ino, .. } if *ino == f)),
            "{report:?}"
        );
        assert_eq!(report.remaining, None);
        let report = check_offline(dir.path(), true).unwrap();
        assert_eq!(report.remaining, Some(Vec::new()), "{report:?}");
        assert!(check_offline(dir.path(), false).unwrap().clean());
        let empty = tempfile::tempdir().unwrap();
        assert!(check_offline(empty.path(), false).is_err());
    }
}
