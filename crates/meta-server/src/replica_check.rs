//! The consistency checker's replica checks (`citronfs fsck`, docs/REPLICAS.md): for every
//! chunk of several replicas, whether its live replicas hold the same bytes (read one-sidedly
//! from each data server, a piece at a time), and for every file, how many of its chunks have
//! fewer live replicas than its replication factor.
//!
//! # When replicas are compared
//!
//! Only at rest for the file: a write goes to every replica under the file's exclusive range
//! lock, so while a lock on the file may be held the replicas may differ for a moment, by
//! design. A file open nowhere has no lock (locks live in the open-file table), and none can be
//! opened while the service holds its state lock, which every open takes. The service runs
//! [`check`] twice: without that lock on a snapshot (differences found are only candidates:
//! a file may be opened and written meanwhile), then under it with [`Scope::only`] naming the
//! candidates, which are compared again (and repaired) on a fresh snapshot.
//! An open file is compared only when the caller says no client is active (`at_rest`) and its
//! lock inspects at rest; otherwise it is skipped, and the report says so
//! (`FsckReport::replicas_not_compared`). A replica whose read fails (its server gone
//! mid-check) is listed there too, and the check goes on with the other chunks.
//!
//! # Live replicas
//!
//! A replica is live when its data server is connected now and the replica is not marked lost
//! (its server came back with new memory: a new incarnation). Only live replicas are read; the
//! others count toward under-replication (`Finding::UnderReplicated`), as do chunks placed
//! on fewer servers than the factor.
//!
//! # Repair
//!
//! With `repair`, each replica that differs is overwritten with the bytes of the chunk's first
//! live replica (the reference), a piece at a time, then compared again. The meta server
//! cannot take a file's range lock, so this is done only where no lock can be held (the
//! files compared above): a file whose lock is held is neither compared nor repaired.
//! Under-replicated chunks are not repaired here: placing a new replica on another server is
//! re-replication (`crate::rereplicate`), which `fsck --repair` runs after this check, without
//! the state lock.

use crate::store::Image;
use proto::fsck::{Finding, Repair};
use proto::layout::Layout;
use proto::{ChunkLoc, FileKind, FsError, Ino, ROOT_INO};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Reads and writes bytes of a replica's block on its data server.
pub(crate) trait ReplicaIo {
    /// Fills `buf` from byte `offset` of the block at `loc`.
    fn read(&mut self, loc: ChunkLoc, offset: u64, buf: &mut [u8]) -> Result<(), FsError>;
    /// Writes `data` at byte `offset` of the block at `loc`.
    fn write(&mut self, loc: ChunkLoc, offset: u64, data: &[u8]) -> Result<(), FsError>;
}

/// The largest piece read (per replica) or written at once: memory stays bounded whatever the
/// chunk size.
pub(crate) const PIECE: usize = 1 << 20;

/// What the replica checks found and did.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// Findings of the (first) check.
    pub findings: Vec<Finding>,
    /// Copies made (`repair`).
    pub repairs: Vec<Repair>,
    /// With `repair`: what a check after the copies still finds.
    pub remaining: Vec<Finding>,
    /// Chunks whose replicas were compared.
    pub compared: u64,
    /// Chunks with fewer live replicas than their file's factor.
    pub under_replicated: u64,
    /// Files a read or write of whose replicas failed (a data server gone mid-check), and
    /// what failed: the check goes on with the other chunks.
    pub failed: Vec<(Ino, String)>,
}

/// What the replica checks look at and may do.
pub(crate) struct Scope<'a> {
    /// The connected data servers.
    pub live: &'a HashSet<u32>,
    /// Files not to compare (nor repair), and why.
    pub skip: &'a BTreeMap<Ino, String>,
    /// When given, the only chunks to compare (nor repair); every chunk is still counted for
    /// under-replication.
    pub only: Option<&'a HashSet<(Ino, u64)>>,
    /// The largest read or write the I/O takes.
    pub piece: usize,
    /// Copy the reference replica over replicas that differ.
    pub repair: bool,
}

/// The replica checks of the module docs on `image`; `factor(ino)`: a file's replication
/// factor.
pub(crate) fn check(
    image: &Image,
    layout: Layout,
    scope: &Scope,
    factor: impl Fn(Ino) -> Result<usize, FsError>,
    io: &mut dyn ReplicaIo,
) -> Result<Outcome, FsError> {
    let (live, skip, repair) = (scope.live, scope.skip, scope.repair);
    let piece = scope.piece.clamp(8, PIECE);
    let lost: HashSet<(Ino, u64, ChunkLoc)> = image.lost.iter().copied().collect();
    // Each chunk's replicas, in the chunk map's order.
    let mut chunks: BTreeMap<(Ino, u64), Vec<ChunkLoc>> = BTreeMap::new();
    for &(ino, chunk, loc) in &image.chunks {
        if image
            .inodes
            .get(&ino)
            .is_some_and(|a| a.kind == FileKind::File)
        {
            chunks.entry((ino, chunk)).or_default().push(loc);
        }
    }
    let paths = Paths::new(image);
    // The finding of chunk `chunk` of `ino`, whose replica `other` first differs from
    // `reference` at `offset` into the chunk.
    let differ = |ino: Ino, chunk: u64, reference: ChunkLoc, other: ChunkLoc, offset: u64| {
        Finding::ReplicasDiffer {
            ino,
            path: paths.of(ino),
            chunk,
            reference,
            other,
            offset,
            file_offset: layout.start(chunk) + offset,
        }
    };
    let mut out = Outcome::default();
    // Under-replicated chunks per file: (count, fewest live).
    let mut under: BTreeMap<Ino, (u64, u32)> = BTreeMap::new();
    let mut factors: HashMap<Ino, usize> = HashMap::new();
    let mut differing: Vec<(Ino, u64, ChunkLoc, ChunkLoc)> = Vec::new();
    for (&(ino, chunk), replicas) in &chunks {
        let live_replicas: Vec<ChunkLoc> = replicas
            .iter()
            .copied()
            .filter(|loc| live.contains(&loc.server) && !lost.contains(&(ino, chunk, *loc)))
            .collect();
        let want = match factors.get(&ino) {
            Some(&f) => f,
            None => *factors.entry(ino).or_insert(factor(ino)?),
        };
        if live_replicas.len() < want {
            let (n, fewest) = under.entry(ino).or_insert((0, u32::MAX));
            *n += 1;
            *fewest = (*fewest).min(live_replicas.len() as u32);
        }
        if replicas.len() < 2
            || live_replicas.len() < 2
            || skip.contains_key(&ino)
            || scope.only.is_some_and(|only| !only.contains(&(ino, chunk)))
        {
            continue;
        }
        out.compared += 1;
        let reference = live_replicas[0];
        for &other in &live_replicas[1..] {
            let found = match first_difference(io, layout.len(chunk), reference, other, piece) {
                Ok(found) => found,
                Err(e) => {
                    out.failed.push((ino, format!("chunk {chunk}: {e}")));
                    continue;
                }
            };
            if let Some(offset) = found {
                out.findings
                    .push(differ(ino, chunk, reference, other, offset));
                differing.push((ino, chunk, reference, other));
            }
        }
    }
    for (ino, (n, fewest)) in under {
        out.under_replicated += n;
        out.findings.push(Finding::UnderReplicated {
            ino,
            path: paths.of(ino),
            factor: factors.get(&ino).copied().unwrap_or(1) as u32,
            chunks: n,
            fewest,
        });
    }
    if repair {
        for &(ino, chunk, reference, other) in &differing {
            match copy(io, layout.len(chunk), reference, other, piece) {
                Ok(()) => out.repairs.push(Repair::CopiedReplica {
                    ino,
                    chunk,
                    from: reference,
                    to: other,
                }),
                Err(e) => out
                    .failed
                    .push((ino, format!("chunk {chunk}, copying: {e}"))),
            }
        }
        // Compared again: what differs still (or cannot be read), and what stays
        // under-replicated.
        for &(ino, chunk, reference, other) in &differing {
            let found =
                first_difference(io, layout.len(chunk), reference, other, piece).unwrap_or(Some(0));
            if let Some(offset) = found {
                out.remaining
                    .push(differ(ino, chunk, reference, other, offset));
            }
        }
        out.remaining.extend(
            out.findings
                .iter()
                .filter(|f| matches!(f, Finding::UnderReplicated { .. }))
                .cloned(),
        );
    }
    Ok(out)
}

/// The first byte at which the blocks at `a` and `b` differ over their first `len` bytes.
fn first_difference(
    io: &mut dyn ReplicaIo,
    len: u64,
    a: ChunkLoc,
    b: ChunkLoc,
    piece: usize,
) -> Result<Option<u64>, FsError> {
    let (mut x, mut y) = (vec![0u8; piece], vec![0u8; piece]);
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(piece as u64) as usize;
        io.read(a, at, &mut x[..n])?;
        io.read(b, at, &mut y[..n])?;
        if let Some(i) = x[..n].iter().zip(&y[..n]).position(|(p, q)| p != q) {
            return Ok(Some(at + i as u64));
        }
        at += n as u64;
    }
    Ok(None)
}

/// Copies the first `len` bytes of the block at `from` over the block at `to`.
fn copy(
    io: &mut dyn ReplicaIo,
    len: u64,
    from: ChunkLoc,
    to: ChunkLoc,
    piece: usize,
) -> Result<(), FsError> {
    let mut buf = vec![0u8; piece];
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(piece as u64) as usize;
        io.read(from, at, &mut buf[..n])?;
        io.write(to, at, &buf[..n])?;
        at += n as u64;
    }
    Ok(())
}

/// Makes the replicas of a file's chunks agree where a cut write may have left them apart
/// (docs/REPLICAS.md, "A write cut between replicas"): for each chunk of `chunks` (its index
/// and the replicas that hold its data, in the chunk map's order), the first replica on a
/// server `live` calls connected is copied over the others there, a [`PIECE`] at a time. The
/// caller makes sure no range lock of the file can be held (nobody has it open). Returns the
/// replicas copied over; the first failure ends it.
pub(crate) fn copy_from_first(
    layout: Layout,
    chunks: &[(u64, Vec<ChunkLoc>)],
    live: impl Fn(u32) -> bool,
    io: &mut dyn ReplicaIo,
) -> Result<u64, FsError> {
    let mut copied = 0;
    for (chunk, replicas) in chunks {
        let mut on_live = replicas.iter().copied().filter(|l| live(l.server));
        let Some(reference) = on_live.next() else {
            continue;
        };
        for other in on_live {
            copy(io, layout.len(*chunk), reference, other, PIECE)?;
            copied += 1;
        }
    }
    Ok(copied)
}

/// One path of each inode the namespace reaches, from the image's entries.
struct Paths {
    /// An entry naming each inode: (directory, name).
    named: HashMap<Ino, (Ino, String)>,
}

impl Paths {
    fn new(image: &Image) -> Paths {
        let mut named = HashMap::new();
        for e in &image.entries {
            named
                .entry(e.ino)
                .or_insert_with(|| (e.parent, e.name.clone()));
        }
        Paths { named }
    }

    /// `/a/b/c` for `ino`, or `None` when no chain of entries leads to it from the root.
    fn of(&self, ino: Ino) -> Option<String> {
        let mut names = Vec::new();
        let mut at = ino;
        // A damaged namespace may have cycles: at most this deep.
        for _ in 0..4096 {
            if at == ROOT_INO {
                names.reverse();
                return Some(format!("/{}", names.join("/")));
            }
            let (parent, name) = self.named.get(&at)?;
            names.push(name.as_str());
            at = *parent;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;
    use proto::{Caller, FabricAddr};

    const OWNER: Caller = Caller { uid: 0, gid: 0 };

    /// Each server's region in memory.
    #[derive(Default)]
    struct Memory {
        unit: u64,
        regions: HashMap<u32, Vec<u8>>,
    }

    impl ReplicaIo for Memory {
        fn read(&mut self, loc: ChunkLoc, offset: u64, buf: &mut [u8]) -> Result<(), FsError> {
            let at = (loc.index * self.unit + offset) as usize;
            let region = self.regions.entry(loc.server).or_insert(vec![0; 1 << 20]);
            buf.copy_from_slice(&region[at..at + buf.len()]);
            Ok(())
        }
        fn write(&mut self, loc: ChunkLoc, offset: u64, data: &[u8]) -> Result<(), FsError> {
            let at = (loc.index * self.unit + offset) as usize;
            let region = self.regions.entry(loc.server).or_insert(vec![0; 1 << 20]);
            region[at..at + data.len()].copy_from_slice(data);
            Ok(())
        }
    }

    /// `copy_from_first` copies each chunk's first replica on a live server over the others on
    /// live servers, and leaves chunks of one live replica and replicas on servers away alone.
    #[test]
    fn a_cut_write_is_repaired_from_the_first_live_replica() {
        let layout = Layout::new(4096).unwrap();
        let loc = |server, index| ChunkLoc { server, index };
        let mut io = Memory {
            unit: layout.unit(),
            ..Memory::default()
        };
        let len = layout.len(3) as usize;
        io.write(loc(1, 4), 0, &vec![1u8; len]).unwrap();
        io.write(loc(2, 5), 0, &vec![2u8; len]).unwrap();
        io.write(loc(3, 6), 0, &vec![3u8; len]).unwrap();
        // Chunk 3: replicas on 1 (away), 2 and 3: 2 is the reference, copied over 3.
        // Chunk 0: one live replica: nothing to copy.
        let chunks = vec![
            (0, vec![loc(1, 0), loc(2, 0)]),
            (3, vec![loc(1, 4), loc(2, 5), loc(3, 6)]),
        ];
        let copied = copy_from_first(layout, &chunks, |s| s != 1, &mut io).unwrap();
        assert_eq!(copied, 1);
        let read = |io: &mut Memory, l| {
            let mut buf = vec![0u8; len];
            io.read(l, 0, &mut buf).unwrap();
            buf
        };
        assert_eq!(read(&mut io, loc(3, 6)), vec![2u8; len]);
        assert_eq!(
            read(&mut io, loc(1, 4)),
            vec![1u8; len],
            "a server away is not written"
        );
    }

    /// A store with two servers and /d/r, a file of 3 chunks of 2 replicas each, written with
    /// the same bytes on both.
    fn replicated() -> (tempfile::TempDir, Store, Ino, Memory) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 4096, OWNER).unwrap();
        for name in ["ds-0", "ds-1"] {
            let fabric: FabricAddr = "tcp:127.0.0.1:1".parse().unwrap();
            store
                .register_server(name, &fabric, fabric::RegionId(1), 64, 1)
                .unwrap();
        }
        let d = store.mkdir(ROOT_INO, "d", 0o755, OWNER).unwrap().ino;
        let r = store
            .mknod(d, "r", FileKind::File, 0o644, 0, OWNER)
            .unwrap()
            .ino;
        let l = store.layout();
        store.persist_size(r, l.start(3)).unwrap();
        let sets = store.allocate_chunks(r, 0, 0, 3, &[0, 1], 2).unwrap();
        let mut mem = Memory {
            unit: l.unit(),
            ..Memory::default()
        };
        for (c, set) in sets.iter().enumerate() {
            let data: Vec<u8> = (0..l.len(c as u64)).map(|i| (i % 251) as u8).collect();
            for loc in set.as_slice() {
                mem.write(*loc, 0, &data).unwrap();
            }
        }
        (dir, store, r, mem)
    }

    fn run(
        store: &Store,
        live: &[u32],
        skip: &BTreeMap<Ino, String>,
        mem: &mut Memory,
        repair: bool,
    ) -> Outcome {
        let image = store.image().unwrap();
        let live: HashSet<u32> = live.iter().copied().collect();
        let scope = Scope {
            live: &live,
            skip,
            only: None,
            piece: 1000,
            repair,
        };
        check(&image, store.layout(), &scope, |_| Ok(2), mem).unwrap()
    }

    #[test]
    fn replicas_that_differ_are_found_named_and_repaired() {
        let (_dir, store, r, mut mem) = replicated();
        let clean = run(&store, &[0, 1], &BTreeMap::new(), &mut mem, false);
        assert_eq!(clean.findings, Vec::new());
        assert_eq!(clean.compared, 3);
        // One byte of chunk 1's second replica (past the first piece).
        let second = store.chunk_at(r, 1).unwrap().unwrap().as_slice()[1];
        mem.write(second, 1500, &[0xEE]).unwrap();
        let found = run(&store, &[0, 1], &BTreeMap::new(), &mut mem, false);
        match found.findings.as_slice() {
            [Finding::ReplicasDiffer {
                ino,
                path,
                chunk: 1,
                other,
                offset: 1500,
                file_offset,
                ..
            }] => {
                assert_eq!((*ino, *other), (r, second));
                assert_eq!(path.as_deref(), Some("/d/r"));
                assert_eq!(*file_offset, store.layout().start(1) + 1500);
            }
            other => panic!("{other:#?}"),
        }
        // Not compared while its lock may be held.
        let skip = BTreeMap::from([(r, "its range lock is held".to_string())]);
        let skipped = run(&store, &[0, 1], &skip, &mut mem, true);
        assert_eq!((skipped.findings.len(), skipped.repairs.len()), (0, 0));
        let repaired = run(&store, &[0, 1], &BTreeMap::new(), &mut mem, true);
        assert_eq!(repaired.repairs.len(), 1);
        assert_eq!(repaired.remaining, Vec::new());
        assert_eq!(
            run(&store, &[0, 1], &BTreeMap::new(), &mut mem, false).findings,
            Vec::new()
        );
    }

    /// With `only`, chunks outside it are neither compared nor repaired (the second pass of
    /// the service's check compares only what the first found), yet every chunk is counted
    /// for under-replication.
    #[test]
    fn only_the_chunks_named_are_compared_and_every_one_is_counted() {
        let (_dir, store, r, mut mem) = replicated();
        for chunk in [0, 2] {
            let second = store.chunk_at(r, chunk).unwrap().unwrap().as_slice()[1];
            mem.write(second, 7, &[0xEE]).unwrap();
        }
        let image = store.image().unwrap();
        let skip = BTreeMap::new();
        let only: HashSet<(Ino, u64)> = [(r, 2)].into();
        let check_only = |live: &HashSet<u32>, repair, mem: &mut Memory| {
            let scope = Scope {
                live,
                skip: &skip,
                only: Some(&only),
                piece: 1000,
                repair,
            };
            check(&image, store.layout(), &scope, |_| Ok(2), mem).unwrap()
        };
        let out = check_only(&[0, 1].into(), true, &mut mem);
        assert_eq!(out.compared, 1);
        assert!(
            matches!(
                out.findings.as_slice(),
                [Finding::ReplicasDiffer { chunk: 2, .. }]
            ),
            "{:#?}",
            out.findings
        );
        assert_eq!(out.repairs.len(), 1);
        // Chunk 0 was not looked at: it still differs.
        let all = run(&store, &[0, 1], &BTreeMap::new(), &mut mem, false);
        assert!(
            matches!(
                all.findings.as_slice(),
                [Finding::ReplicasDiffer { chunk: 0, .. }]
            ),
            "{:#?}",
            all.findings
        );
        // With a server away, every chunk is under-replicated, named or not.
        let out = check_only(&[0].into(), false, &mut mem);
        assert_eq!(out.under_replicated, 3);
        assert_eq!(out.compared, 0);
    }

    /// [`Memory`] whose reads of one server fail.
    struct Failing(Memory, u32);

    impl ReplicaIo for Failing {
        fn read(&mut self, loc: ChunkLoc, offset: u64, buf: &mut [u8]) -> Result<(), FsError> {
            if loc.server == self.1 {
                return Err(FsError::Io("gone".into()));
            }
            self.0.read(loc, offset, buf)
        }
        fn write(&mut self, loc: ChunkLoc, offset: u64, data: &[u8]) -> Result<(), FsError> {
            self.0.write(loc, offset, data)
        }
    }

    #[test]
    fn a_replica_that_cannot_be_read_is_said_and_the_check_goes_on() {
        let (_dir, store, r, mem) = replicated();
        let image = store.image().unwrap();
        let live: HashSet<u32> = [0, 1].into();
        let skip = BTreeMap::new();
        let scope = Scope {
            live: &live,
            skip: &skip,
            only: None,
            piece: 1000,
            repair: true,
        };
        let mut io = Failing(mem, 1);
        let out = check(&image, store.layout(), &scope, |_| Ok(2), &mut io).unwrap();
        assert_eq!(out.failed.len(), 3, "{:?}", out.failed);
        assert!(out.failed.iter().all(|(ino, _)| *ino == r));
        assert_eq!(out.findings, Vec::new());
    }

    #[test]
    fn replicas_on_a_server_away_are_counted_under_replicated_and_not_read() {
        let (_dir, store, r, mut mem) = replicated();
        let second = store.chunk_at(r, 0).unwrap().unwrap().as_slice()[1];
        mem.write(second, 0, &[0xEE]).unwrap();
        let out = run(&store, &[0], &BTreeMap::new(), &mut mem, true);
        assert_eq!(out.compared, 0);
        assert_eq!(out.under_replicated, 3);
        assert_eq!(
            out.findings,
            vec![Finding::UnderReplicated {
                ino: r,
                path: Some("/d/r".into()),
                factor: 2,
                chunks: 3,
                fewest: 1
            }]
        );
        assert_eq!(out.remaining, out.findings);
    }
}
