//! Writes cut between their replicas (docs/REPLICAS.md, "A write cut between replicas"): how a
//! write that its writer's death left on some replicas only is found and repaired before anyone
//! reads or writes the file's data again.
//!
//! The record is two words of the file control block (`proto::fcb`): BEGUN and ENDED.
//!
//! - A change under an exclusive range lock adds 1 to BEGUN, and waits for it, before its first
//!   data verb to a chunk of two or more replicas ([`before_write`]); files of one replica never
//!   touch the words. It adds 1 to ENDED in its lock's release ([`post_ended`]) — only when it
//!   is done (or sent nothing) and its lease is still ahead, as a data verb would be posted: a
//!   change that failed after part of it was sent, or a holder past its lease, leaves the two
//!   apart.
//! - Every locked I/O reads both in its lock's granting batch (`fcb::FcbReads`, no round trip of
//!   its own). Holding any part of the file, BEGUN ≠ ENDED can only mean a write that will never
//!   end: a live writer of another range, or a dead one's leftover — the holder cannot tell
//!   which, nor which range. So it gives its lock back and takes the whole file exclusively
//!   (`locked_io`), where every live writer has released; if the words still differ, no live
//!   client can end that write, and it frees the chunks past the size, copies every chunk's
//!   first live replica over the others ([`repair`]), sets ENDED to the BEGUN it read, and
//!   only then does its own I/O, under that whole-file lock.
//!
//! Why no two reads disagree: a write's BEGUN lands before any of its data verbs is posted,
//! while its lock is held; any later holder of an overlapping range is granted after that hold
//! ended, so its granting batch sees BEGUN raised, and it reads nothing before the repair. The
//! repair runs under the whole-file exclusive lock, so nobody reads while the replicas differ.
//! A shared grant does not repair: it escalates like a writer.

use crate::chunks::ChunkRun;
use crate::client::Inner;
use crate::error::Error;
use crate::fcb::{read_fcb, Fcb};
use crate::handles::OpenInode;
use crate::meta::unexpected;
use crate::plan::{plan, Geometry, Limits};
use crate::transfer::{exec_plans, Transfer, CHECK_BYTES};
use crate::workers::Worker;
use fabric::Batch;
use proto::rpc::{Request, Response};
use proto::{fcb, ChunkLoc, FsError};

/// Bytes of the file one step of a repair copies (read from the reference replicas, then
/// written to the others).
const REPAIR_WINDOW: u64 = 1 << 20;

/// Before the first data verb of a change to `[off, off + len)` under an exclusive range lock
/// (`Worker::begun_at` set): when a chunk of it has two or more replicas in `run`, adds 1 to
/// the file's BEGUN and waits for it, once per lock. Nothing for files of one replica, under a
/// shared lock, or once done under this lock.
pub(crate) fn before_write(
    w: &mut Worker,
    geometry: &Geometry,
    off: u64,
    len: usize,
    run: &ChunkRun,
) -> Result<(), Error> {
    let Some(at) = w.begun_at.filter(|_| !w.begun) else {
        return Ok(());
    };
    let replicated = geometry
        .chunks(off, len as u64)
        .any(|c| run.get(c).is_some_and(|r| r.as_slice().len() > 1));
    if !replicated {
        return Ok(());
    }
    // Landing late (past the lease) is harmless: a BEGUN without its ENDED only makes the next
    // holder repair replicas that agree.
    w.check_lease_before_post()?;
    w.batch.clear();
    w.batch.faa(at, 1);
    w.exec_meta()?;
    // Only once it is known to have landed: an ENDED without its BEGUN would hide a later cut.
    w.begun = true;
    Ok(())
}

/// Adds 1 to `inode`'s ENDED in `release` (the range lock's release batch) when the change
/// under the lock added 1 to BEGUN, it is done or sent nothing (`failed_partway`: it failed
/// after part of it was sent), and the lease is still ahead (`Worker::check_lease_before_post`);
/// otherwise leaves BEGUN and ENDED apart for the next holder to repair. Clears the worker's
/// record either way.
pub(crate) fn post_ended(
    w: &mut Worker,
    release: &mut Batch,
    inode: &OpenInode,
    failed_partway: bool,
) {
    let begun = std::mem::take(&mut w.begun);
    w.begun_at = None;
    if begun && !failed_partway && w.check_lease_before_post().is_ok() {
        release.faa(inode.fcb.add(fcb::ENDED), 1);
    }
}

/// Makes every replica of `inode`'s chunks agree again, holding the whole file exclusively
/// after its granting batch found `found.cut_write()`; returns the FCB words to go on with
/// (GENERATION moves when chunks were freed).
///
/// 1. Chunks at or past the size are freed (`Request::FreeChunks`): no chunk outlives the size
///    at rest, so under the whole-file lock such chunks are a cut extending write's, and on
///    one replica only they would be read by a later write's gap.
/// 2. Chunk by chunk below the size, the first replica on a live data server (the reference)
///    is copied over the others on live servers, [`REPAIR_WINDOW`] bytes at a time.
/// 3. ENDED is set to the BEGUN `found` read.
///
/// Which replica holds the cut write's bytes is not known: the reference's content wins, so
/// each lock unit reads all of the cut write or none of it, on every replica.
pub(crate) fn repair(
    inner: &Inner,
    w: &mut Worker,
    inode: &OpenInode,
    found: &Fcb,
) -> Result<Fcb, Error> {
    let geometry = &inner.geometry;
    let layout = &geometry.layout;
    let below = layout.chunks_below(found.size);
    let end = layout.start(below);
    tracing::warn!(
        ino = inode.ino,
        begun = found.begun,
        ended = found.ended,
        bytes = end,
        "a replicated write of this file was cut (its writer died or lost its lease); \
         copying each chunk's first live replica over the others"
    );
    free_beyond_size(inner, w, inode, below)?;
    let mut found = *found;
    found.generation = read_fcb(w, inode)?.generation;
    let mut off = 0;
    while off < end {
        let n = (end - off).min(REPAIR_WINDOW);
        let len = usize::try_from(n).map_err(|_| FsError::Invalid("repair window".into()))?;
        let view = w.view.clone();
        let run = inner.chunk_locations(&view, inode, found.generation, off, len, false)?;
        copy_replicas(w, geometry, off, len, &run)?;
        off += n;
    }
    w.check_lease_before_post()?;
    w.batch.clear();
    w.batch.write_u64(inode.fcb.add(fcb::ENDED), found.begun);
    w.changed = true;
    w.exec_meta()?;
    found.ended = found.begun;
    Ok(found)
}

/// Frees `inode`'s chunks from `first` on (at or past its size), under the whole-file lock
/// `w` holds: a call held to the lease's deadline at the meta server, as every locked call.
fn free_beyond_size(
    inner: &Inner,
    w: &mut Worker,
    inode: &OpenInode,
    first: u64,
) -> Result<(), Error> {
    w.check_lease_before_post()?;
    let request = Request::FreeChunks {
        ino: inode.ino,
        first,
        count: u64::MAX - first,
    };
    let answer = match inner.meta.call_by(request, w.lease) {
        Err(Error::Fs(FsError::Expired)) => return Err(Error::LeaseLost),
        other => other,
    };
    // Refused for the lease, it changed nothing; any other outcome may have freed them.
    w.changed = true;
    match answer? {
        Response::Ok => Ok(()),
        other => Err(unexpected("FreeChunks", other)),
    }
}

/// The replicas of `chunk` in `run` on data servers live in the worker's view: the first (the
/// reference) and the others; nothing for a hole or a chunk of one live replica.
fn live_replicas(w: &Worker, run: &ChunkRun, chunk: u64) -> Option<(ChunkLoc, Vec<ChunkLoc>)> {
    let replicas = run.get(chunk)?;
    let mut live = replicas
        .as_slice()
        .iter()
        .copied()
        .filter(|l| w.view.data_server_live(l.server));
    let first = live.next()?;
    let others: Vec<ChunkLoc> = live.collect();
    (!others.is_empty()).then_some((first, others))
}

/// Copies bytes `[off, off + len)` of the file from each chunk's reference replica to its
/// other live replicas ([`live_replicas`]): one read round, then one write round, per data
/// server batch as any I/O.
fn copy_replicas(
    w: &mut Worker,
    geometry: &Geometry,
    off: u64,
    len: usize,
    run: &ChunkRun,
) -> Result<(), Error> {
    let chunks: Vec<(u64, ChunkLoc, Vec<ChunkLoc>)> = geometry
        .chunks(off, len as u64)
        .filter_map(|c| live_replicas(w, run, c).map(|(first, others)| (c, first, others)))
        .collect();
    if chunks.is_empty() {
        return Ok(());
    }
    let find = |c: u64| chunks.iter().find(|(k, _, _)| *k == c);
    let reads = plan(geometry, off, len, |c| find(c).map(|e| e.1), Limits::FABRIC)?;
    let mut buf = vec![0u8; len + CHECK_BYTES * reads.len()];
    exec_plans(w, &reads, &mut buf, len, Transfer::Read, |batch, at, op| {
        batch.read_to(at, op.len, op.buf_off);
    })?;
    w.check_lease_after_read()?;
    let writes = plan(
        geometry,
        off,
        len,
        |c| find(c).map(|e| e.2.clone()).unwrap_or_default(),
        Limits::FABRIC,
    )?;
    let mut checks = vec![0u8; CHECK_BYTES * writes.len()];
    exec_plans(
        w,
        &writes,
        &mut checks,
        0,
        Transfer::Write { raises: false },
        |batch, at, op| {
            batch.write(at, &buf[op.buf_off..op.buf_off + op.len]);
        },
    )
}
