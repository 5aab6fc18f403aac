//! The consistency checker's vocabulary (`citronfs fsck`): what the meta server's checker can
//! find ([`Finding`]), what `--repair` did about it ([`Repair`]), and the report it answers a
//! [`crate::rpc::Request::Fsck`] with ([`FsckReport`]).
//!
//! The checker runs in the meta server, which owns the namespace and all allocation state (sled)
//! and the open files' control blocks and lock words (its fabric region); see
//! `meta_server::fsck` for what each check compares and why.

use crate::types::{ChunkLoc, FileKind, Ino};
use serde::{Deserialize, Serialize};
use std::fmt;

/// At most this many findings travel in one report (the rest are counted in
/// [`FsckReport::truncated`]): a badly damaged namespace must not make an answer larger than a
/// frame.
pub const MAX_FINDINGS: usize = 10_000;

/// What the checker is asked to do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsckOptions {
    /// Repair what can be repaired, then check again.
    pub repair: bool,
    /// The caller says no read, write or truncate is in flight on any client: check that every
    /// open file's lock is at rest (nothing held, counters balanced) and compare open files'
    /// chunk maps with the size in their control blocks. Also on when no other session is
    /// connected.
    pub at_rest: bool,
}

/// One inconsistency. Each names the objects it is about, so that a finding is actionable on
/// its own; [`fmt::Display`] says it in a sentence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Finding {
    /// A chunk map names a data server the meta server has no record of.
    ChunkOnUnknownServer {
        /// The file.
        ino: Ino,
        /// Its chunk index.
        chunk: u64,
        /// Where the map says it is.
        loc: ChunkLoc,
    },
    /// A chunk map names a chunk past its server's region, or one never handed out (at or
    /// above the server's `next_fresh` mark).
    ChunkNotAllocated {
        /// The file.
        ino: Ino,
        /// Its chunk index.
        chunk: u64,
        /// Where the map says it is.
        loc: ChunkLoc,
    },
    /// One chunk is named by more than one chunk-map entry: two files (or two offsets) would
    /// share data.
    ChunkSharedBy {
        /// The chunk.
        loc: ChunkLoc,
        /// Every (file, chunk index) naming it.
        owners: Vec<(Ino, u64)>,
    },
    /// A chunk in a file's chunk map is also on its server's free stack or dirty set: it would
    /// be handed to another file (or zeroed) under this one.
    ChunkUsedAndFree {
        /// The file.
        ino: Ino,
        /// Its chunk index.
        chunk: u64,
        /// The chunk.
        loc: ChunkLoc,
        /// `true`: in the dirty set; `false`: on the free stack.
        dirty: bool,
    },
    /// A chunk map belongs to an inode that does not exist, or to one that is not a regular
    /// file.
    ChunkOfNoFile {
        /// The inode the map is under.
        ino: Ino,
        /// How many chunks it names.
        chunks: u64,
    },
    /// A file has chunks wholly beyond its size (what truncate frees): their data can never be
    /// read, and an extending truncate would expose it instead of zeros.
    ChunkBeyondSize {
        /// The file.
        ino: Ino,
        /// Its size (from its control block when open).
        size: u64,
        /// The chunk indexes beyond it.
        chunks: Vec<u64>,
    },
    /// A chunk below its server's `next_fresh` mark is in no chunk map, not free and not
    /// dirty: space lost until repaired.
    LeakedChunk {
        /// Where the block starts.
        loc: ChunkLoc,
        /// Its length in bytes: a power-of-two multiple of the layout's unit, aligned to it
        /// (a leaked range is reported as the fewest such blocks).
        bytes: u64,
    },
    /// A server's free stack is not `free_count` entries in slots `0..free_count` of distinct
    /// chunks below `next_fresh`.
    FreeStackBroken {
        /// The server.
        server: u32,
        /// What is wrong, in words.
        detail: String,
    },
    /// A chunk is both on the free stack and in the dirty set.
    ChunkFreeAndDirty {
        /// The chunk.
        loc: ChunkLoc,
    },
    /// A dirty (freed, not yet zeroed) chunk names an unknown server or lies past its region.
    DirtyChunkOutOfRange {
        /// The chunk.
        loc: ChunkLoc,
    },
    /// A server's chunks do not add up: in files + free + dirty + never used ≠ its region's
    /// chunks.
    ChunkCountMismatch {
        /// The server.
        server: u32,
        /// Chunks of its region.
        chunks: u64,
        /// In files + free + dirty + never used, as counted.
        counted: u64,
    },
    /// An inode's link count is not what the namespace says (files: entries naming it;
    /// directories: 2 + subdirectories).
    WrongLinkCount {
        /// The inode.
        ino: Ino,
        /// Its kind.
        kind: FileKind,
        /// Its stored link count.
        stored: u32,
        /// The count the entries give.
        counted: u32,
    },
    /// A file's `allocated` (its chunks' bytes, what `st_blocks` shows) is not what its chunk
    /// map holds.
    WrongAllocated {
        /// The file.
        ino: Ino,
        /// Its stored count, in bytes.
        stored: u64,
        /// What its chunks hold, in bytes.
        counted: u64,
    },
    /// A directory entry names an inode that does not exist.
    DanglingEntry {
        /// The directory.
        parent: Ino,
        /// The name.
        name: String,
        /// The missing inode.
        ino: Ino,
    },
    /// A directory entry's kind (or its readdir index) disagrees with the inode or itself.
    EntryMismatch {
        /// The directory.
        parent: Ino,
        /// The name (or the index's name).
        name: String,
        /// What disagrees, in words.
        detail: String,
    },
    /// A directory is named by more than one entry, or its parent pointer names a directory
    /// other than the one whose entry names it.
    DirectoryParent {
        /// The directory.
        ino: Ino,
        /// What is wrong, in words.
        detail: String,
    },
    /// An inode no entry reaches from the root and no session has open (or an unlinked inode
    /// that is not marked an orphan): space and an inode lost until repaired.
    Unreachable {
        /// The inode.
        ino: Ino,
        /// Its kind.
        kind: FileKind,
        /// Its link count.
        nlink: u32,
    },
    /// An inode marked an orphan (unlinked while open) that no session has open any more, or
    /// that still has links.
    StaleOrphan {
        /// The inode.
        ino: Ino,
        /// Its link count (0 for a proper orphan).
        nlink: u32,
    },
    /// Records hang off an inode that does not exist (xattrs, a symlink target, a directory's
    /// parent pointer or cookie counter), or a symlink lacks its target.
    StrayRecord {
        /// The inode.
        ino: Ino,
        /// Which record, in words.
        what: String,
    },
    /// A file has chunks whose data server came back without its memory (a memory-only server
    /// restarted): their data is gone, and reads and writes of them fail with EIO. Not
    /// repaired (the data cannot be brought back): truncate or remove the file.
    LostChunks {
        /// The file.
        ino: Ino,
        /// Its lost chunk indexes.
        chunks: Vec<u64>,
        /// The data servers they were on.
        servers: Vec<u32>,
    },
    /// An open file's lock is not at rest although nothing is in flight (`--at-rest`): a word
    /// is held or a counter pair is apart.
    LockNotAtRest {
        /// The file.
        ino: Ino,
        /// The lock scheme.
        scheme: String,
        /// The busy words.
        busy: Vec<String>,
    },
    /// Two replicas of a chunk hold different bytes at rest (no lock on the file held): a
    /// read may return either. `--repair` copies the reference replica over the other.
    ReplicasDiffer {
        /// The file.
        ino: Ino,
        /// One of its paths, when the namespace reaches it.
        path: Option<String>,
        /// Its chunk index.
        chunk: u64,
        /// The reference replica: the first live one of the chunk map.
        reference: ChunkLoc,
        /// The replica that differs from it.
        other: ChunkLoc,
        /// The first differing byte, from the start of the chunk.
        offset: u64,
        /// The same byte's offset in the file.
        file_offset: u64,
    },
    /// A file has chunks with fewer live replicas than its replication factor: a replica on a
    /// data server that is not connected, or lost (its server came back with new memory), or
    /// never placed (fewer live servers than the factor at allocation). `--repair`
    /// re-replicates them (`Repair::Rereplicated`) where a live server without a replica of
    /// the chunk has room; what stays short is in `remaining`.
    UnderReplicated {
        /// The file.
        ino: Ino,
        /// One of its paths, when the namespace reaches it.
        path: Option<String>,
        /// Its replication factor.
        factor: u32,
        /// How many of its chunks have fewer live replicas than that.
        chunks: u64,
        /// The fewest live replicas any of its chunks has.
        fewest: u32,
    },
    /// An open file's lock words could not be read or inspected.
    LockUnreadable {
        /// The file.
        ino: Ino,
        /// The lock scheme.
        scheme: String,
        /// Why.
        error: String,
    },
}

impl Finding {
    /// A short, stable name of the finding's kind (the `kind` of `--json` output).
    pub fn kind(&self) -> &'static str {
        match self {
            Finding::ChunkOnUnknownServer { .. } => "chunk-on-unknown-server",
            Finding::ChunkNotAllocated { .. } => "chunk-not-allocated",
            Finding::ChunkSharedBy { .. } => "chunk-shared",
            Finding::ChunkUsedAndFree { .. } => "chunk-used-and-free",
            Finding::ChunkOfNoFile { .. } => "chunks-of-no-file",
            Finding::ChunkBeyondSize { .. } => "chunks-beyond-size",
            Finding::LeakedChunk { .. } => "leaked-chunk",
            Finding::FreeStackBroken { .. } => "free-stack-broken",
            Finding::ChunkFreeAndDirty { .. } => "chunk-free-and-dirty",
            Finding::DirtyChunkOutOfRange { .. } => "dirty-chunk-out-of-range",
            Finding::ChunkCountMismatch { .. } => "chunk-count-mismatch",
            Finding::WrongLinkCount { .. } => "wrong-link-count",
            Finding::WrongAllocated { .. } => "wrong-allocated",
            Finding::DanglingEntry { .. } => "dangling-entry",
            Finding::EntryMismatch { .. } => "entry-mismatch",
            Finding::DirectoryParent { .. } => "directory-parent",
            Finding::Unreachable { .. } => "unreachable-inode",
            Finding::StaleOrphan { .. } => "stale-orphan",
            Finding::StrayRecord { .. } => "stray-record",
            Finding::LockNotAtRest { .. } => "lock-not-at-rest",
            Finding::LockUnreadable { .. } => "lock-unreadable",
            Finding::LostChunks { .. } => "lost-chunks",
            Finding::ReplicasDiffer { .. } => "replicas-differ",
            Finding::UnderReplicated { .. } => "under-replicated",
        }
    }

    /// The inode the finding is about, if one.
    pub fn ino(&self) -> Option<Ino> {
        match self {
            Finding::ChunkOnUnknownServer { ino, .. }
            | Finding::ChunkNotAllocated { ino, .. }
            | Finding::ChunkUsedAndFree { ino, .. }
            | Finding::ChunkOfNoFile { ino, .. }
            | Finding::ChunkBeyondSize { ino, .. }
            | Finding::WrongLinkCount { ino, .. }
            | Finding::WrongAllocated { ino, .. }
            | Finding::DanglingEntry { ino, .. }
            | Finding::DirectoryParent { ino, .. }
            | Finding::Unreachable { ino, .. }
            | Finding::StaleOrphan { ino, .. }
            | Finding::StrayRecord { ino, .. }
            | Finding::LockNotAtRest { ino, .. }
            | Finding::LockUnreadable { ino, .. }
            | Finding::LostChunks { ino, .. }
            | Finding::ReplicasDiffer { ino, .. }
            | Finding::UnderReplicated { ino, .. } => Some(*ino),
            Finding::EntryMismatch { parent, .. } => Some(*parent),
            Finding::ChunkSharedBy { .. }
            | Finding::LeakedChunk { .. }
            | Finding::FreeStackBroken { .. }
            | Finding::ChunkFreeAndDirty { .. }
            | Finding::DirtyChunkOutOfRange { .. }
            | Finding::ChunkCountMismatch { .. } => None,
        }
    }
}

fn loc(l: &ChunkLoc) -> String {
    format!("server {} block at unit {}", l.server, l.index)
}

/// "inode N" or "inode N (PATH)".
fn file(ino: Ino, path: &Option<String>) -> String {
    match path {
        Some(p) => format!("inode {ino} ({p})"),
        None => format!("inode {ino}"),
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::ChunkOnUnknownServer { ino, chunk, loc: l } => write!(
                f,
                "inode {ino} chunk {chunk} is on {}, an unknown data server",
                loc(l)
            ),
            Finding::ChunkNotAllocated { ino, chunk, loc: l } => write!(
                f,
                "inode {ino} chunk {chunk} names {}, which was never allocated",
                loc(l)
            ),
            Finding::ChunkSharedBy { loc: l, owners } => {
                write!(f, "{} is in several chunk maps:", loc(l))?;
                for (ino, chunk) in owners {
                    write!(f, " inode {ino} chunk {chunk};")?;
                }
                Ok(())
            }
            Finding::ChunkUsedAndFree {
                ino,
                chunk,
                loc: l,
                dirty,
            } => write!(
                f,
                "inode {ino} chunk {chunk} ({}) is also {}",
                loc(l),
                if *dirty {
                    "in the dirty set"
                } else {
                    "on the free stack"
                }
            ),
            Finding::ChunkOfNoFile { ino, chunks } => write!(
                f,
                "{chunks} chunks are mapped under inode {ino}, which is not a regular file"
            ),
            Finding::ChunkBeyondSize { ino, size, chunks } => write!(
                f,
                "inode {ino} of {size} bytes has {} chunks wholly beyond its size (first {})",
                chunks.len(),
                chunks.first().copied().unwrap_or(0)
            ),
            Finding::LeakedChunk { loc: l, bytes } => {
                write!(
                    f,
                    "{} ({bytes} bytes) is allocated but in no file, free or dirty",
                    loc(l)
                )
            }
            Finding::FreeStackBroken { server, detail } => {
                write!(f, "server {server}'s free stack: {detail}")
            }
            Finding::ChunkFreeAndDirty { loc: l } => {
                write!(f, "{} is both free and dirty", loc(l))
            }
            Finding::DirtyChunkOutOfRange { loc: l } => {
                write!(f, "dirty {} is outside every server's region", loc(l))
            }
            Finding::ChunkCountMismatch {
                server,
                chunks,
                counted,
            } => write!(
                f,
                "server {server} has {chunks} chunks but {counted} are accounted for"
            ),
            Finding::WrongLinkCount {
                ino,
                kind,
                stored,
                counted,
            } => write!(
                f,
                "{kind:?} inode {ino} has link count {stored}, the namespace gives {counted}"
            ),
            Finding::WrongAllocated {
                ino,
                stored,
                counted,
            } => write!(
                f,
                "file {ino} counts {stored} bytes of chunks, its chunk map holds {counted}"
            ),
            Finding::DanglingEntry { parent, name, ino } => write!(
                f,
                "entry {name:?} in directory {parent} names inode {ino}, which does not exist"
            ),
            Finding::EntryMismatch {
                parent,
                name,
                detail,
            } => write!(f, "entry {name:?} in directory {parent}: {detail}"),
            Finding::DirectoryParent { ino, detail } => write!(f, "directory {ino}: {detail}"),
            Finding::Unreachable { ino, kind, nlink } => write!(
                f,
                "{kind:?} inode {ino} (link count {nlink}) is reachable from no directory and \
                 open nowhere"
            ),
            Finding::StaleOrphan { ino, nlink } => write!(
                f,
                "inode {ino} is marked unlinked-while-open but is open nowhere (link count \
                 {nlink})"
            ),
            Finding::StrayRecord { ino, what } => write!(f, "inode {ino}: {what}"),
            Finding::LockNotAtRest { ino, scheme, busy } => write!(
                f,
                "inode {ino}'s {scheme} lock is not at rest: {}",
                busy.join(", ")
            ),
            Finding::LockUnreadable { ino, scheme, error } => {
                write!(
                    f,
                    "inode {ino}'s {scheme} lock cannot be inspected: {error}"
                )
            }
            Finding::LostChunks {
                ino,
                chunks,
                servers,
            } => write!(
                f,
                "inode {ino} lost chunks {chunks:?}: data server(s) {servers:?} came back \
                 without their memory (reads of them fail with EIO; truncate or remove the file)"
            ),
            Finding::ReplicasDiffer {
                ino,
                path,
                chunk,
                reference,
                other,
                offset,
                file_offset,
            } => write!(
                f,
                "{} chunk {chunk}: the replica on {} differs from the one on {} from byte \
                 {offset} of the chunk (file offset {file_offset})",
                file(*ino, path),
                loc(other),
                loc(reference)
            ),
            Finding::UnderReplicated {
                ino,
                path,
                factor,
                chunks,
                fewest,
            } => write!(
                f,
                "{} has {chunks} chunks with fewer live replicas than its factor {factor} \
                 (fewest: {fewest})",
                file(*ino, path)
            ),
        }
    }
}

/// One thing `--repair` did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Repair {
    /// A directory entry naming a missing inode (and its readdir index) was removed.
    RemovedEntry {
        /// The directory.
        parent: Ino,
        /// The name.
        name: String,
    },
    /// An inode's link count was set to what the namespace gives.
    SetLinkCount {
        /// The inode.
        ino: Ino,
        /// The old count.
        from: u32,
        /// The new count.
        to: u32,
    },
    /// A file's `allocated` was set to what its chunk map holds.
    SetAllocated {
        /// The file.
        ino: Ino,
        /// The old count, in bytes.
        from: u64,
        /// The new count, in bytes.
        to: u64,
    },
    /// An unreachable inode (or stale orphan) was deleted with everything hanging off it; its
    /// chunks were freed.
    DeletedInode {
        /// The inode.
        ino: Ino,
        /// Chunks freed with it.
        chunks: u64,
    },
    /// Chunks were taken out of a chunk map (of no file, or beyond the file's size) and freed.
    FreedChunks {
        /// The inode the map was under.
        ino: Ino,
        /// How many.
        chunks: u64,
    },
    /// A leaked chunk was freed (marked dirty: it is zeroed before reuse).
    FreedLeakedChunk {
        /// The chunk.
        loc: ChunkLoc,
    },
    /// A server's free stack was rebuilt from its valid entries (used, dirty and duplicate
    /// chunks left out).
    RebuiltFreeStack {
        /// The server.
        server: u32,
        /// Entries before.
        from: u64,
        /// Entries after.
        to: u64,
    },
    /// Records of a missing inode were removed.
    RemovedStrayRecords {
        /// The inode.
        ino: Ino,
    },
    /// A chunk's dirty mark was dropped (the chunk is in use, or outside every region): it
    /// must not be zeroed and handed out.
    ClearedDirtyMark {
        /// The chunk.
        loc: ChunkLoc,
    },
    /// An orphan mark was dropped from an inode that still has links.
    UnmarkedOrphan {
        /// The inode.
        ino: Ino,
    },
    /// A replica that differed from its chunk's reference replica was overwritten with the
    /// reference's bytes.
    CopiedReplica {
        /// The file.
        ino: Ino,
        /// Its chunk index.
        chunk: u64,
        /// The replica copied from.
        from: ChunkLoc,
        /// The replica overwritten.
        to: ChunkLoc,
    },
    /// An under-replicated chunk got a new replica, copied from a live one under the file's
    /// range lock (re-replication, docs/REPLICAS.md); its replicas that were not live left
    /// its set.
    Rereplicated {
        /// The file.
        ino: Ino,
        /// Its chunk index.
        chunk: u64,
        /// The replica copied from.
        from: ChunkLoc,
        /// The new replica.
        to: ChunkLoc,
    },
    /// At rest, an open file's busy lock words (a dead client's) were put back at rest.
    ResetLock {
        /// The file.
        ino: Ino,
        /// The lock scheme.
        scheme: String,
        /// The words reset, as they were.
        words: Vec<String>,
    },
}

impl fmt::Display for Repair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Repair::RemovedEntry { parent, name } => {
                write!(f, "removed entry {name:?} from directory {parent}")
            }
            Repair::SetLinkCount { ino, from, to } => {
                write!(f, "set inode {ino}'s link count from {from} to {to}")
            }
            Repair::SetAllocated { ino, from, to } => {
                write!(f, "set file {ino}'s chunk bytes from {from} to {to}")
            }
            Repair::DeletedInode { ino, chunks } => {
                write!(f, "deleted inode {ino} and freed its {chunks} chunks")
            }
            Repair::FreedChunks { ino, chunks } => {
                write!(f, "freed {chunks} chunks mapped under inode {ino}")
            }
            Repair::FreedLeakedChunk { loc: l } => write!(f, "freed leaked {}", loc(l)),
            Repair::RebuiltFreeStack { server, from, to } => write!(
                f,
                "rebuilt server {server}'s free stack ({from} entries, now {to})"
            ),
            Repair::RemovedStrayRecords { ino } => {
                write!(f, "removed the records of missing inode {ino}")
            }
            Repair::ClearedDirtyMark { loc: l } => {
                write!(f, "dropped the dirty mark of {}", loc(l))
            }
            Repair::UnmarkedOrphan { ino } => {
                write!(f, "dropped the orphan mark of linked inode {ino}")
            }
            Repair::CopiedReplica {
                ino,
                chunk,
                from,
                to,
            } => write!(
                f,
                "copied inode {ino} chunk {chunk} from {} over {}",
                loc(from),
                loc(to)
            ),
            Repair::Rereplicated {
                ino,
                chunk,
                from,
                to,
            } => write!(
                f,
                "re-replicated inode {ino} chunk {chunk} from {} to {}",
                loc(from),
                loc(to)
            ),
            Repair::ResetLock { ino, scheme, words } => write!(
                f,
                "reset inode {ino}'s {scheme} lock to rest: {}",
                words.join(", ")
            ),
        }
    }
}

/// What was looked at, for the report's summary line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsckCounts {
    /// Inodes.
    pub inodes: u64,
    /// Directory entries.
    pub entries: u64,
    /// Chunk-map entries.
    pub chunks: u64,
    /// Data servers.
    pub servers: u64,
    /// Open files' locks inspected (0 unless at rest).
    pub locks: u64,
    /// Client sessions connected besides the one asking (a dead client's is gone once the
    /// meta server noticed its connection close or its lease run out).
    pub sessions: u64,
    /// Files open by some session (their control blocks and locks are in the meta region).
    pub open_files: u64,
    /// Chunks of several replicas whose replicas' bytes were compared.
    pub replicated_chunks: u64,
    /// Chunks with fewer live replicas than their file's factor, in every file.
    pub under_replicated: u64,
}

/// The checker's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsckReport {
    /// What the check found (before any repair), at most [`MAX_FINDINGS`].
    pub findings: Vec<Finding>,
    /// Findings beyond [`MAX_FINDINGS`], counted but not sent.
    pub truncated: u64,
    /// What `--repair` did.
    pub repairs: Vec<Repair>,
    /// After repairs: what a second check still finds (`None` without `--repair`).
    pub remaining: Option<Vec<Finding>>,
    /// What the (first) check looked at.
    pub counts: FsckCounts,
    /// Whether locks were checked at rest.
    pub at_rest: bool,
    /// Files with several replicas whose replicas were not compared (nor repaired), and why:
    /// open while clients are active (no `--at-rest`), or their range lock is held.
    pub replicas_not_compared: Vec<(Ino, String)>,
}

impl FsckReport {
    /// Whether the check found nothing.
    pub fn clean(&self) -> bool {
        self.findings.is_empty() && self.truncated == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_round_trips_and_every_finding_says_itself() {
        let report = FsckReport {
            findings: vec![
                Finding::LeakedChunk {
                    loc: ChunkLoc {
                        server: 1,
                        index: 7,
                    },
                    bytes: 4096,
                },
                Finding::WrongLinkCount {
                    ino: 5,
                    kind: FileKind::Dir,
                    stored: 2,
                    counted: 3,
                },
            ],
            truncated: 0,
            repairs: vec![Repair::SetLinkCount {
                ino: 5,
                from: 2,
                to: 3,
            }],
            remaining: Some(Vec::new()),
            counts: FsckCounts::default(),
            at_rest: true,
            replicas_not_compared: vec![(7, "its range lock is held".into())],
        };
        let wire = postcard::to_stdvec(&report).unwrap();
        assert_eq!(postcard::from_bytes::<FsckReport>(&wire).unwrap(), report);
        assert_eq!(report.findings[0].kind(), "leaked-chunk");
        assert_eq!(
            report.findings[0].to_string(),
            "server 1 block at unit 7 (4096 bytes) is allocated but in no file, free or dirty"
        );
        assert_eq!(report.findings[1].ino(), Some(5));
        assert!(!report.clean());
    }
}
