//! Write-behind for the namespace's sled trees: every tree is held in memory whole (the
//! *image*), read from there, and a mutation is applied to the image when it commits and
//! written to sled by a committer thread soon after, many mutations at a time, made atomic by
//! a journal record instead of a sled transaction. sled is the durable copy, read only when
//! the store opens.
//!
//! # Why
//! A sled 0.34 transaction costs far more than the work in it: it pins the log, which seals
//! and writes the log buffer before and after its batch manifest, each write handed to sled's
//! IO thread pool (a `pwrite`, `sync_file_range` and a wake-up of every waiting IO thread), and
//! it holds sled's global concurrency lock, which stops every plain read of the database
//! meanwhile. Measured on the 2-core machine, `Store::mknod` spent 150 µs of a create's 208 µs
//! in the meta server's handler there, and the whole create waited for it. The durability
//! promise never asked for that wait (docs/RELIABILITY.md: a crash may lose what was
//! acknowledged since sled's last flush), so a request now waits for memory only.
//!
//! Reads come from the image for the same reason: a sled 0.34 `get` (an epoch pin, a walk of
//! its page cache, a node view) was more than a third of the handler time of a create, an
//! unlink and an open on the 2-core machine (`perf`, `bench meta --fs library`); a
//! `BTreeMap` lookup under a read lock is a small fraction of it.
//!
//! # Memory
//! The image holds every key and value of the namespace's trees (inodes, directory entries,
//! chunk maps, xattrs, ...), on top of sled's own cache: measured with `citronfs up` and 50,000
//! empty files, the process grew 1.7–1.9 KB per file with the image against 1.2 KB without,
//! so about 0.5–0.7 KB per file. A meta server of an in-memory file system serves the
//! namespace from memory anyway; the image makes that explicit.
//!
//! # The journal
//! The committer writes a batch as: one `journal` record holding every write of the batch
//! (key: the batch's last sequence number), then the writes themselves as plain sled inserts
//! and removes, then the removal of the record. sled's log is written and recovered in order
//! (a crash recovers a prefix of it), so after a crash either the record is there — and
//! [`Staged::new`] applies its writes again (they are idempotent: set or remove a key) before
//! anything reads — or every write of the batch is, or none. A batch is written as each key's
//! last write in it ([`coalesce`]): creates in one directory rewrite the directory's inode and
//! the inode counter each time, and sled takes them once per batch (on the 2-core machine,
//! `bench meta --fs library --threads 4`: half the sled writes, 13% less committer CPU).
//! Plain writes take no global lock, so readers are never stopped; this module never opens a
//! sled transaction.
//!
//! # Invariants
//! - **Reads see every committed mutation.** A mutation's writes enter the image, all under
//!   one write lock, before [`Staged::transaction`] returns; the image is the only thing read.
//! - **The image is sled after its pending write sets.** It is loaded from sled when the store
//!   opens (after the journal's replay) and every change to sled is a queued write set that
//!   was applied to the image first, so once settled, sled and the image hold the same.
//! - **sled holds a prefix of the mutations, each whole.** Write sets reach sled in commit
//!   order, each batch behind its journal record, so a crash leaves the state after some
//!   prefix of the acknowledged mutations — never part of one.
//! - **Mutations are serialized** ([`Staged::transaction`] holds `writer` across the closure),
//!   so a closure's reads are exact and it runs once; sled's own optimistic retries never
//!   happen here.
//! - **Bounded lag.** At most [`MAX_PENDING`] write sets wait for the committer; a mutation
//!   beyond that waits for it (back-pressure, never unbounded memory).
//! - **A failed sled write stops mutations.** The committer records the error; later
//!   mutations and [`Staged::settle`] fail with it (`FsError::Io`), reads keep answering from
//!   memory and sled. Nothing acknowledged is silently dropped while the server runs.
//!
//! [`Staged::settle`] waits until sled holds everything committed so far; a flush settles
//! first, so `fsync`, a clean shutdown and every "durable before" rule of the service keep
//! their meaning.

use proto::FsError;
use sled::transaction::ConflictableTransactionError;
use sled::{IVec, Tree};
use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::JoinHandle;

/// Write sets that may wait for the committer before a mutation waits for it.
pub(crate) const MAX_PENDING: usize = 4096;

/// How long the committer, woken by a mutation, waits for more before it writes (unless a
/// settle or a stop hurries it). Waking it is a cross-CPU wake-up the mutating request pays
/// for; with the linger, a stream of mutations pays it once per batch, not once each, and a
/// batch's journal record and sled writes are shared.
pub(crate) const COMMIT_LINGER: std::time::Duration = std::time::Duration::from_millis(2);

/// One write: tree index, key, value (`None`: remove).
type Write = (usize, Vec<u8>, Option<IVec>);

/// One write as a journal record holds it (see [`Write`]).
type JournalWrite<'a> = (usize, &'a [u8], Option<&'a [u8]>);

/// A mutation's own writes, per tree, by key (`None`: removed).
type OwnWrites = Vec<BTreeMap<Vec<u8>, Option<IVec>>>;

/// One tree's image: every key and value (see the module docs).
type Image = BTreeMap<IVec, IVec>;

/// How many entries a range read takes from the image per read lock ([`Entries`]).
const RANGE_STEP: usize = 64;

/// The writes of one committed mutation, in the order it made them.
struct WriteSet {
    seq: u64,
    writes: Vec<Write>,
}

struct Inner {
    /// Write sets waiting for the committer, in commit order.
    queue: VecDeque<WriteSet>,
    /// The last sequence number given to a mutation (0: none yet).
    last: u64,
    /// Every mutation up to this one is in sled.
    durable_in_sled: u64,
    /// The committer's sled error: no mutation commits any more.
    failed: Option<String>,
    /// When [`Staged::flush`] last flushed sled to disk.
    last_flush: Option<std::time::Instant>,
    /// The committer waits for work with an empty queue: the next mutation wakes it.
    idle: bool,
    /// Someone waits for sled ([`Staged::settle`]): the committer writes without lingering.
    hurry: bool,
    stop: bool,
}

struct Shared {
    db: sled::Db,
    trees: Vec<Tree>,
    /// Per tree, its whole content as committed (see the module docs); written only by
    /// committing mutations, which hold `writer` (and `inner`) meanwhile.
    image: RwLock<Vec<Image>>,
    /// Batches being written: the journal (see the module docs).
    journal: Tree,
    inner: Mutex<Inner>,
    /// The committer waits here for work.
    work: Condvar,
    /// Settlers and back-pressured mutations wait here for the committer.
    written: Condvar,
    /// Held across a mutation's closure: mutations one at a time.
    writer: Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A sled failure as the file system reports it.
pub(crate) fn db_err(e: sled::Error) -> FsError {
    FsError::Io(format!("meta database: {e}"))
}

/// The trees of one sled database, written behind (see the module docs).
pub(crate) struct Staged {
    shared: Arc<Shared>,
    committer: Option<JoinHandle<()>>,
}

impl Staged {
    /// Stages writes to `trees` of `db`; starts the committer thread. First completes the
    /// batches a crash interrupted (their journal records), then loads every tree into memory.
    pub(crate) fn new(db: sled::Db, trees: Vec<Tree>) -> Result<Staged, FsError> {
        let journal = db.open_tree(JOURNAL).map_err(db_err)?;
        let replayed = replay(&db, &trees, &journal)?;
        if replayed > 0 {
            tracing::info!(
                batches = replayed,
                "completed the namespace writes a crash interrupted"
            );
        }
        let image = trees
            .iter()
            .map(|tree| tree.iter().collect::<sled::Result<Image>>())
            .collect::<sled::Result<Vec<Image>>>()
            .map_err(db_err)?;
        let shared = Arc::new(Shared {
            image: RwLock::new(image),
            inner: Mutex::new(Inner {
                queue: VecDeque::new(),
                last: 0,
                durable_in_sled: 0,
                failed: None,
                last_flush: None,
                idle: false,
                hurry: false,
                stop: false,
            }),
            db,
            trees,
            journal,
            work: Condvar::new(),
            written: Condvar::new(),
            writer: Mutex::new(()),
        });
        let committer = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("meta-committer".into())
                .spawn(move || shared.commit_loop())
                .map_err(|e| {
                    FsError::Io(format!("cannot start the meta database's committer: {e}"))
                })?
        };
        Ok(Staged {
            shared,
            committer: Some(committer),
        })
    }

    /// Tree `i` of the database, read from the image and written through mutations.
    pub(crate) fn tree(&self, i: usize) -> StagedTree<'_> {
        StagedTree { staged: self, i }
    }

    /// Tree `i` in sled itself, bypassing the image (tests: what reached sled).
    #[cfg(test)]
    fn raw(&self, i: usize) -> &Tree {
        &self.shared.trees[i]
    }

    /// Runs `f` as one mutation: it reads the image and its own writes, and its
    /// writes become visible to every read at once when it returns `Ok`, then reach sled
    /// behind it (with the next batch). An `Err` discards its writes and is the result (a
    /// closure's `Abort(e)` is `e`). `f` runs exactly once: mutations are serialized, so
    /// nothing conflicts.
    pub(crate) fn transaction<A>(
        &self,
        f: impl FnOnce(&TxView<'_>) -> Result<A, ConflictableTransactionError<FsError>>,
    ) -> Result<A, FsError> {
        let shared = &*self.shared;
        let _writer = lock(&shared.writer);
        {
            let mut inner = lock(&shared.inner);
            if let Some(why) = &inner.failed {
                return Err(failed(why));
            }
            // Back-pressure: the committer is far behind.
            while inner.queue.len() >= MAX_PENDING && inner.failed.is_none() {
                inner = shared
                    .written
                    .wait(inner)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
        let view = TxView {
            shared,
            writes: std::cell::RefCell::new(vec![BTreeMap::new(); shared.trees.len()]),
        };
        let result = match f(&view) {
            Ok(result) => result,
            Err(ConflictableTransactionError::Abort(e)) => return Err(e),
            Err(ConflictableTransactionError::Storage(e)) => return Err(db_err(e)),
            // `Conflict`: only sled's own transactions produce it, and none runs here.
            Err(e) => return Err(FsError::Io(format!("meta database transaction: {e:?}"))),
        };
        let writes = view.writes.into_inner();
        let count: usize = writes.iter().map(BTreeMap::len).sum();
        if count == 0 {
            return Ok(result);
        }
        let mut inner = lock(&shared.inner);
        if let Some(why) = &inner.failed {
            return Err(failed(why));
        }
        inner.last += 1;
        let seq = inner.last;
        let mut set = Vec::with_capacity(count);
        {
            let mut image = shared.image.write().unwrap_or_else(PoisonError::into_inner);
            for (tree, writes) in writes.into_iter().enumerate() {
                for (key, value) in writes {
                    match &value {
                        Some(value) => {
                            image[tree].insert(IVec::from(key.as_slice()), value.clone())
                        }
                        None => image[tree].remove(key.as_slice()),
                    };
                    set.push((tree, key, value));
                }
            }
        }
        inner.queue.push_back(WriteSet { seq, writes: set });
        let wake = std::mem::take(&mut inner.idle);
        drop(inner);
        if wake {
            shared.work.notify_one();
        }
        Ok(result)
    }

    /// Waits until sled holds every mutation committed before this call.
    pub(crate) fn settle(&self) -> Result<(), FsError> {
        let shared = &*self.shared;
        let mut inner = lock(&shared.inner);
        let target = inner.last;
        while inner.durable_in_sled < target {
            if let Some(why) = &inner.failed {
                return Err(failed(why));
            }
            inner.hurry = true;
            shared.work.notify_one();
            inner = shared
                .written
                .wait(inner)
                .unwrap_or_else(PoisonError::into_inner);
        }
        Ok(())
    }

    /// Settles, then flushes sled to disk.
    pub(crate) fn flush(&self) -> Result<(), FsError> {
        self.settle()?;
        self.shared.db.flush().map_err(db_err)?;
        lock(&self.shared.inner).last_flush = Some(std::time::Instant::now());
        Ok(())
    }

    /// Where the write-behind stands, for a status report.
    pub(crate) fn progress(&self) -> Progress {
        let inner = lock(&self.shared.inner);
        Progress {
            committed: inner.last,
            written: inner.durable_in_sled,
            last_flush: inner.last_flush,
            failed: inner.failed.clone(),
        }
    }
}

/// Where the write-behind stands ([`Staged::progress`]).
pub(crate) struct Progress {
    /// The last mutation's sequence number: mutations committed since the store opened.
    pub committed: u64,
    /// Every mutation up to this one is in sled.
    pub written: u64,
    /// When [`Staged::flush`] last flushed sled to disk.
    pub last_flush: Option<std::time::Instant>,
    /// The committer's sled error, if it stopped.
    pub failed: Option<String>,
}

impl Drop for Staged {
    /// Writes what is staged to sled (the committer drains its queue before it stops).
    fn drop(&mut self) {
        lock(&self.shared.inner).stop = true;
        self.shared.work.notify_one();
        if let Some(committer) = self.committer.take() {
            let _ = committer.join();
        }
    }
}

fn failed(why: &str) -> FsError {
    FsError::Io(format!(
        "the meta database failed a write; no change is accepted until the meta server \
         restarts: {why}"
    ))
}

impl Shared {
    /// The committer: takes every waiting write set and writes them in one sled
    /// transaction, in commit order, until stopped with nothing left.
    fn commit_loop(&self) {
        loop {
            let batch: Vec<WriteSet> = {
                let mut inner = lock(&self.inner);
                while inner.queue.is_empty() && !inner.stop {
                    inner.idle = true;
                    inner = self
                        .work
                        .wait(inner)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                inner.idle = false;
                if inner.queue.is_empty() {
                    return;
                }
                // Linger for more (module docs), unless hurried.
                let until = std::time::Instant::now() + COMMIT_LINGER;
                while !inner.hurry && !inner.stop && inner.queue.len() < MAX_PENDING / 2 {
                    let left = until.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    inner = self
                        .work
                        .wait_timeout(inner, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                inner.hurry = false;
                inner.queue.drain(..).collect()
            };
            let last = batch.last().map_or(0, |set| set.seq);
            let written = self.write(last, &batch);
            let mut inner = lock(&self.inner);
            match written {
                Ok(()) => inner.durable_in_sled = last,
                Err(e) => {
                    let why = e.to_string();
                    tracing::error!(
                        error = why,
                        "the meta database failed a write: the meta server accepts no more \
                         changes (what was acknowledged stays readable until it stops)"
                    );
                    inner.failed = Some(why);
                    inner.queue.clear();
                }
            }
            drop(inner);
            self.written.notify_all();
        }
    }

    /// Writes `batch` to sled behind its journal record (see the module docs), each key once:
    /// its last value in the batch ([`coalesce`]).
    fn write(&self, last: u64, batch: &[WriteSet]) -> sled::Result<()> {
        let writes = coalesce(batch);
        let record = postcard::to_stdvec(&writes).expect("postcard encodes byte strings");
        self.journal.insert(last.to_be_bytes(), record)?;
        for (tree, key, value) in writes {
            apply(&self.trees[tree], key, value)?;
        }
        self.journal.remove(last.to_be_bytes())?;
        Ok(())
    }

    /// Every tree's image, read-locked.
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Image>> {
        self.image.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The value of `key` in tree `i` as committed.
    fn get(&self, i: usize, key: &[u8]) -> Option<IVec> {
        self.read()[i].get(key).cloned()
    }
}

/// The writes of `batch` that sled needs: the last write of each key, in key order per tree.
///
/// Why this is enough: a batch reaches sled whole or not at all (its journal record), so the
/// states in between its write sets are never seen in sled, only the state after the last;
/// and that state is each key's last write. Streams of creates in one directory write the
/// directory's inode (its times, its size) and the inode counter once per create: a batch of
/// them writes each once. Key order also makes sled's inserts walk its tree in order.
fn coalesce(batch: &[WriteSet]) -> Vec<JournalWrite<'_>> {
    // Every write in commit order, sorted by tree and key: the sort is stable, so writes of
    // one key stay in commit order and the last of them wins.
    let mut all: Vec<JournalWrite<'_>> = batch
        .iter()
        .flat_map(|set| &set.writes)
        .map(|(tree, key, value)| (*tree, key.as_slice(), value.as_deref()))
        .collect();
    all.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    let mut writes: Vec<JournalWrite<'_>> = Vec::with_capacity(all.len());
    for write in all {
        match writes.last_mut() {
            Some(last) if last.0 == write.0 && last.1 == write.1 => *last = write,
            _ => writes.push(write),
        }
    }
    writes
}

/// Opens the sled database in `dir`.
///
/// sled releases its directory lock from a background thread after the last handle of a
/// database is dropped, so a store opened again in the same process (a meta server restarted
/// by the test kit, a test) can find it still held for a moment: the lock is waited for, up
/// to 5 s, before its error is returned.
pub(crate) fn open_sled(dir: &std::path::Path) -> sled::Result<sled::Db> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match sled::open(dir) {
            // sled reports it as an `Other` error with this text (sled 0.34's config.rs).
            Err(sled::Error::Io(e))
                if e.to_string().starts_with("could not acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            opened => return opened,
        }
    }
}

/// Sets `key` of `tree` to `value`, or removes it (`None`): one write of a batch.
fn apply(tree: &Tree, key: &[u8], value: Option<&[u8]>) -> sled::Result<()> {
    match value {
        Some(value) => tree.insert(key, value).map(drop),
        None => tree.remove(key).map(drop),
    }
}

/// The tree of journal records (see the module docs).
const JOURNAL: &str = "journal";

/// Applies the writes of every journal record left by a crash, removes the records and
/// flushes; returns how many there were. A record that does not decode, or names a tree that
/// does not exist, is corruption: opening fails rather than guess.
fn replay(db: &sled::Db, trees: &[Tree], journal: &Tree) -> Result<usize, FsError> {
    let mut replayed = 0;
    for item in journal.iter() {
        let (key, record) = item.map_err(db_err)?;
        let writes: Vec<(usize, Vec<u8>, Option<Vec<u8>>)> = postcard::from_bytes(&record)
            .map_err(|e| FsError::Io(format!("meta database: a journal record: {e}")))?;
        for (tree, key, value) in writes {
            let tree = trees.get(tree).ok_or_else(|| {
                FsError::Io(format!(
                    "meta database: a journal record names tree {tree} of {}",
                    trees.len()
                ))
            })?;
            apply(tree, &key, value.as_deref()).map_err(db_err)?;
        }
        journal.remove(key).map_err(db_err)?;
        replayed += 1;
    }
    if replayed > 0 {
        db.flush().map_err(db_err)?;
    }
    Ok(replayed)
}

/// A tree read from the image (reads outside mutations; a write here is a mutation of its
/// own).
pub(crate) struct StagedTree<'a> {
    staged: &'a Staged,
    i: usize,
}

impl StagedTree<'_> {
    /// The value of `key`.
    pub(crate) fn get(&self, key: impl AsRef<[u8]>) -> sled::Result<Option<IVec>> {
        Ok(self.staged.shared.get(self.i, key.as_ref()))
    }

    /// Whether `key` has a value.
    pub(crate) fn contains_key(&self, key: impl AsRef<[u8]>) -> sled::Result<bool> {
        Ok(self.staged.shared.read()[self.i].contains_key(key.as_ref()))
    }

    /// The entries with keys in `range`, in key order.
    pub(crate) fn range<K: AsRef<[u8]>, R: std::ops::RangeBounds<K>>(&self, range: R) -> Entries {
        let owned = |b: Bound<&K>| match b {
            Bound::Included(k) => Bound::Included(k.as_ref().to_vec()),
            Bound::Excluded(k) => Bound::Excluded(k.as_ref().to_vec()),
            Bound::Unbounded => Bound::Unbounded,
        };
        Entries {
            shared: self.staged.shared.clone(),
            i: self.i,
            from: owned(range.start_bound()),
            to: owned(range.end_bound()),
            taken: std::collections::VecDeque::new(),
            done: false,
        }
    }

    /// The entries whose keys start with `prefix`, in key order.
    pub(crate) fn scan_prefix(&self, prefix: impl AsRef<[u8]>) -> Entries {
        let prefix = prefix.as_ref().to_vec();
        match prefix_end(&prefix) {
            Some(end) => self.range(prefix..end),
            None => self.range(prefix..),
        }
    }

    /// Every entry, in key order.
    pub(crate) fn iter(&self) -> Entries {
        self.range::<Vec<u8>, _>(..)
    }

    /// How many entries the tree has.
    pub(crate) fn len(&self) -> usize {
        self.staged.shared.read()[self.i].len()
    }

    /// Sets `key` to `value`, as a mutation of its own.
    pub(crate) fn insert(&self, key: impl AsRef<[u8]>, value: &[u8]) -> Result<(), FsError> {
        let i = self.i;
        self.staged
            .transaction(|view| view.tree(i).insert(key.as_ref(), value).map(drop))
    }

    /// Removes `key`, as a mutation of its own.
    pub(crate) fn remove(&self, key: impl AsRef<[u8]>) -> Result<(), FsError> {
        let key = key.as_ref().to_vec();
        let i = self.i;
        self.staged
            .transaction(|view| view.tree(i).remove(key.as_slice()).map(drop))
    }
}

/// The smallest key greater than every key starting with `prefix` (`None`: there is none,
/// the prefix is all `0xff`).
fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// A range of a tree's image, in key order, read [`RANGE_STEP`] entries per read lock: a long
/// scan (a large directory's pages) neither copies the whole range at once nor holds the lock
/// across its caller's work. Each step reads the image as committed then: a mutation behind
/// the scan's last step is not seen, one beyond it is.
pub(crate) struct Entries {
    shared: Arc<Shared>,
    i: usize,
    /// Where the next step starts: the range's start, then just past the last key taken.
    from: Bound<Vec<u8>>,
    to: Bound<Vec<u8>>,
    taken: std::collections::VecDeque<(IVec, IVec)>,
    /// The image has nothing more in the range.
    done: bool,
}

impl Iterator for Entries {
    type Item = sled::Result<(IVec, IVec)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.taken.is_empty() && !self.done {
            let empty = match (&self.from, &self.to) {
                (Bound::Included(a), Bound::Excluded(b))
                | (Bound::Excluded(a), Bound::Included(b))
                | (Bound::Excluded(a), Bound::Excluded(b)) => a >= b,
                (Bound::Included(a), Bound::Included(b)) => a > b,
                _ => false,
            };
            if !empty {
                let bounds = (
                    self.from.as_ref().map(Vec::as_slice),
                    self.to.as_ref().map(Vec::as_slice),
                );
                let image = self.shared.read();
                self.taken.extend(
                    image[self.i]
                        .range::<[u8], _>(bounds)
                        .take(RANGE_STEP)
                        .map(|(k, v)| (k.clone(), v.clone())),
                );
            }
            self.done = self.taken.len() < RANGE_STEP;
            if let Some((last, _)) = self.taken.back() {
                self.from = Bound::Excluded(last.to_vec());
            }
        }
        self.taken.pop_front().map(Ok)
    }
}

impl Entries {
    /// The keys only.
    pub(crate) fn keys(self) -> impl Iterator<Item = sled::Result<IVec>> {
        self.map(|item| item.map(|(k, _)| k))
    }
}

/// A mutation's view: its own writes, then the image.
pub(crate) struct TxView<'a> {
    shared: &'a Shared,
    writes: std::cell::RefCell<OwnWrites>,
}

impl TxView<'_> {
    /// Tree `i` in this mutation.
    pub(crate) fn tree(&self, i: usize) -> TxTree<'_> {
        TxTree { view: self, i }
    }
}

/// One tree in a mutation ([`TxView::tree`]).
pub(crate) struct TxTree<'a> {
    view: &'a TxView<'a>,
    i: usize,
}

type TxResult<T> = Result<T, ConflictableTransactionError<FsError>>;

impl TxTree<'_> {
    /// The value of `key` as this mutation sees it.
    pub(crate) fn get(&self, key: impl AsRef<[u8]>) -> TxResult<Option<IVec>> {
        let key = key.as_ref();
        if let Some(value) = self.view.writes.borrow()[self.i].get(key) {
            return Ok(value.clone());
        }
        Ok(self.view.shared.get(self.i, key))
    }

    /// Sets `key` to `value`; returns the value before.
    pub(crate) fn insert(
        &self,
        key: impl AsRef<[u8]>,
        value: impl Into<IVec>,
    ) -> TxResult<Option<IVec>> {
        let old = self.get(key.as_ref())?;
        self.view.writes.borrow_mut()[self.i].insert(key.as_ref().to_vec(), Some(value.into()));
        Ok(old)
    }

    /// Removes `key`; returns the value before.
    pub(crate) fn remove(&self, key: impl AsRef<[u8]>) -> TxResult<Option<IVec>> {
        let old = self.get(key.as_ref())?;
        self.view.writes.borrow_mut()[self.i].insert(key.as_ref().to_vec(), None);
        Ok(old)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staged(dir: &std::path::Path) -> Staged {
        // The directory may still be locked by a store of this test just dropped.
        let db = open_sled(dir).unwrap();
        let trees = vec![db.open_tree("a").unwrap(), db.open_tree("b").unwrap()];
        Staged::new(db, trees).unwrap()
    }

    fn put(s: &Staged, tree: usize, key: &[u8], value: Option<&[u8]>) {
        s.transaction(|tx| {
            match value {
                Some(v) => tx.tree(tree).insert(key, v)?,
                None => tx.tree(tree).remove(key)?,
            };
            Ok(())
        })
        .unwrap();
    }

    fn all(s: &Staged, tree: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
        s.tree(tree)
            .iter()
            .map(|r| r.map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap())
            .collect()
    }

    /// A reference model: every mutation applied to plain maps at once. Reads of the
    /// image must match it whether or not the committer has caught up, and after a settle
    /// sled alone must match it.
    /// A batch reaches sled as each key's last write, whatever came before it in the batch.
    #[test]
    fn a_batch_is_written_as_each_keys_last_write() {
        let set = |seq: u64, writes: &[JournalWrite<'_>]| WriteSet {
            seq,
            writes: writes
                .iter()
                .map(|(t, k, v)| (*t, k.to_vec(), v.map(IVec::from)))
                .collect(),
        };
        let batch = vec![
            set(
                1,
                &[
                    (0, b"dir", Some(b"1")),
                    (0, b"x", Some(b"a")),
                    (1, b"dir", Some(b"t1")),
                ],
            ),
            set(2, &[(0, b"x", None), (0, b"dir", Some(b"2"))]),
            set(3, &[(0, b"dir", Some(b"3")), (0, b"b", Some(b"b"))]),
            set(4, &[(0, b"y", None), (0, b"y", Some(b"y"))]),
        ];
        let want: Vec<JournalWrite<'_>> = vec![
            (0, b"b", Some(b"b")),
            (0, b"dir", Some(b"3")),
            (0, b"x", None),
            (0, b"y", Some(b"y")),
            (1, b"dir", Some(b"t1")),
        ];
        assert_eq!(coalesce(&batch), want);
    }

    #[test]
    fn reads_match_a_model_before_and_after_the_committer() {
        let dir = tempfile::tempdir().unwrap();
        let s = staged(dir.path());
        let mut model: Vec<BTreeMap<Vec<u8>, Vec<u8>>> = vec![BTreeMap::new(), BTreeMap::new()];
        let mut x: u64 = 7;
        for round in 0..3000u64 {
            // A small key space, so that keys are overwritten and removed while staged.
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let tree = (x >> 60) as usize % 2;
            let key = vec![b'k', (x >> 40) as u8 % 24];
            if (x >> 20) % 3 == 0 {
                put(&s, tree, &key, None);
                model[tree].remove(&key);
            } else {
                let value = round.to_be_bytes().to_vec();
                put(&s, tree, &key, Some(&value));
                model[tree].insert(key.clone(), value);
            }
            if round % 97 == 0 {
                for (t, model) in model.iter().enumerate() {
                    let want: Vec<_> = model.clone().into_iter().collect();
                    assert_eq!(all(&s, t), want, "round {round}, tree {t}");
                    let range: Vec<_> = s
                        .tree(t)
                        .range(vec![b'k', 5]..vec![b'k', 12])
                        .map(|r| r.unwrap().0.to_vec())
                        .collect();
                    let want: Vec<_> = model
                        .range(vec![b'k', 5]..vec![b'k', 12])
                        .map(|(k, _)| k.clone())
                        .collect();
                    assert_eq!(range, want, "round {round}, tree {t}, range");
                    for k in 0..24u8 {
                        let key = vec![b'k', k];
                        assert_eq!(
                            s.tree(t).get(&key).unwrap().map(|v| v.to_vec()),
                            model.get(&key).cloned()
                        );
                    }
                }
            }
        }
        s.settle().unwrap();
        for (t, model) in model.into_iter().enumerate() {
            let in_sled: Vec<_> = s
                .raw(t)
                .iter()
                .map(|r| r.map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap())
                .collect();
            assert_eq!(in_sled, model.into_iter().collect::<Vec<_>>());
        }
    }

    /// A mutation's writes are all or nothing: an aborted one leaves no trace, and a
    /// mutation reads its own writes.
    #[test]
    fn an_aborted_mutation_leaves_nothing_and_a_mutation_reads_its_own_writes() {
        let dir = tempfile::tempdir().unwrap();
        let s = staged(dir.path());
        put(&s, 0, b"x", Some(b"1"));
        let aborted = s.transaction(|tx| {
            tx.tree(0).insert(b"x", &b"2"[..])?;
            tx.tree(1).insert(b"y", &b"2"[..])?;
            assert_eq!(tx.tree(0).get(b"x")?.as_deref(), Some(&b"2"[..]));
            Err::<(), _>(ConflictableTransactionError::Abort(FsError::Exists))
        });
        assert!(matches!(aborted, Err(FsError::Exists)));
        assert_eq!(s.tree(0).get(b"x").unwrap().as_deref(), Some(&b"1"[..]));
        assert_eq!(s.tree(1).get(b"y").unwrap(), None);
        s.settle().unwrap();
        assert_eq!(s.raw(1).get(b"y").unwrap(), None);
    }

    /// What was acknowledged before the store is dropped is in sled when it is opened again.
    #[test]
    fn dropping_writes_everything_staged() {
        let dir = tempfile::tempdir().unwrap();
        let s = staged(dir.path());
        let db = s.shared.db.clone();
        for i in 0..500u32 {
            put(&s, 1, &i.to_be_bytes(), Some(b"v"));
        }
        // Not settled: the drop must write the rest.
        drop(s);
        assert_eq!(db.open_tree("b").unwrap().len(), 500);
    }

    /// A crash between a batch's journal record and the end of its writes: opening again
    /// completes the batch from the record (and says so by emptying the journal), and a record
    /// that does not decode refuses the open instead of guessing.
    #[test]
    fn a_batch_cut_by_a_crash_is_completed_from_its_journal_record() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        let trees = vec![db.open_tree("a").unwrap(), db.open_tree("b").unwrap()];
        trees[0].insert(b"gone", &b"old"[..]).unwrap();
        trees[1].insert(b"kept", &b"old"[..]).unwrap();
        // The committer wrote the record and the first of its three writes, then died.
        let writes: Vec<JournalWrite<'_>> = vec![
            (1, b"kept", Some(b"new")),
            (0, b"gone", None),
            (0, b"made", Some(b"new")),
        ];
        let journal = db.open_tree(JOURNAL).unwrap();
        journal
            .insert(9u64.to_be_bytes(), postcard::to_stdvec(&writes).unwrap())
            .unwrap();
        trees[1].insert(b"kept", &b"new"[..]).unwrap();
        drop(journal);
        let s = Staged::new(db.clone(), trees).unwrap();
        assert_eq!(
            s.tree(1).get(b"kept").unwrap().as_deref(),
            Some(&b"new"[..])
        );
        assert_eq!(s.tree(0).get(b"gone").unwrap(), None);
        assert_eq!(
            s.tree(0).get(b"made").unwrap().as_deref(),
            Some(&b"new"[..])
        );
        assert_eq!(s.raw(0).get(b"made").unwrap().as_deref(), Some(&b"new"[..]));
        assert!(db.open_tree(JOURNAL).unwrap().is_empty());
        drop(s);

        db.open_tree(JOURNAL)
            .unwrap()
            .insert(10u64.to_be_bytes(), &[0xff, 0xff][..])
            .unwrap();
        let trees = vec![db.open_tree("a").unwrap(), db.open_tree("b").unwrap()];
        let refused = Staged::new(db, trees)
            .err()
            .expect("a corrupt record refuses the open");
        assert!(refused.to_string().contains("journal record"), "{refused}");
    }

    /// A range longer than one step of [`Entries`] is read whole, in order, once each, with
    /// its bounds kept; mutations while it is read show beyond the step it is in.
    #[test]
    fn a_long_range_is_read_in_steps_without_loss_or_repeat() {
        let dir = tempfile::tempdir().unwrap();
        let s = staged(dir.path());
        let key = |i: u32| format!("k{i:05}").into_bytes();
        for i in 0..(3 * RANGE_STEP as u32 + 7) {
            put(&s, 0, &key(i), Some(b"v"));
        }
        let from = key(3);
        let to = key(3 * RANGE_STEP as u32);
        let mut scan = s.tree(0).range(from.clone()..=to.clone());
        let mut seen = Vec::new();
        for (n, item) in scan.by_ref().enumerate() {
            let (k, _) = item.unwrap();
            seen.push(k.to_vec());
            if n == RANGE_STEP + 1 {
                // Behind the scan: not seen. Beyond the step it is in: seen, once.
                put(&s, 0, &key(4), None);
                put(&s, 0, &key(3 * RANGE_STEP as u32 - 2), None);
                put(&s, 0, b"k00150x", Some(b"new"));
            }
        }
        let mut want: Vec<Vec<u8>> = (3..=3 * RANGE_STEP as u32)
            .filter(|&i| i != 3 * RANGE_STEP as u32 - 2)
            .map(key)
            .collect();
        want.push(b"k00150x".to_vec());
        want.sort();
        assert_eq!(seen, want);
        assert!(scan.next().is_none(), "a finished scan stays finished");
        let excluded: Vec<_> = s
            .tree(0)
            .range((Bound::Excluded(from), Bound::Excluded(to)))
            .keys()
            .map(|k| k.unwrap().to_vec())
            .collect();
        assert_eq!(excluded.first(), Some(&key(5)), "key 4 was removed");
        assert_eq!(excluded.last(), Some(&key(3 * RANGE_STEP as u32 - 1)));
    }

    /// A store opened again reads what the last one committed (its image is loaded from sled).
    #[test]
    fn an_opened_store_reads_what_was_committed_before() {
        let dir = tempfile::tempdir().unwrap();
        let s = staged(dir.path());
        for i in 0..300u32 {
            put(&s, 1, &i.to_be_bytes(), Some(&i.to_le_bytes()));
        }
        put(&s, 1, &7u32.to_be_bytes(), None);
        drop(s);
        let s = staged(dir.path());
        assert_eq!(s.tree(1).len(), 299);
        assert_eq!(s.tree(1).get(7u32.to_be_bytes()).unwrap(), None);
        assert_eq!(
            s.tree(1).get(8u32.to_be_bytes()).unwrap().as_deref(),
            Some(&8u32.to_le_bytes()[..])
        );
        assert_eq!(s.tree(1).iter().count(), 299);
    }

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"ab"), Some(b"ac".to_vec()));
        assert_eq!(prefix_end(&[1, 0xff]), Some(vec![2]));
        assert_eq!(prefix_end(&[0xff, 0xff]), None);
    }
}
