//! Writes cut between their replicas (docs/REPLICAS.md, "A write cut between replicas"): how a
//! write that its writer's death left on some replicas only is found and repaired before anyone
//! reads or writes that range again.
//!
//! The record is in the file control block (`proto::fcb`): eight SLOTS, and the counters BEGUN
//! and ENDED.
//!
//! - A change under an exclusive range lock records itself, and waits for it, before its first
//!   data verb to a chunk of two or more replicas ([`before_write`]): it claims a slot free at
//!   its grant with a CAS from 0 to its lock's units; with no slot (all taken, or a lock too
//!   wide to pack: the whole file), it adds 1 to BEGUN. Its release clears the slot, or adds 1
//!   to ENDED ([`post_ended`]) — only when it is done (or sent nothing) and its lease is still
//!   ahead, as a data verb would be posted: a change that failed after part of it was sent, or
//!   a holder past its lease, leaves its record. Files of one replica never touch the words.
//!   Where the lock scheme runs an acquisition's carried verbs once, after the grant (CITRON
//!   at the host), a write of a file seen replicated claims its first slot to try in the
//!   grant itself ([`claim_in_grant`]), and its release's undo rides in a posted release
//!   (`lockmgr::RangeLock::release_forgetting`): no round trip of their own.
//! - Every locked I/O reads them in its lock's granting batch (`fcb::FcbReads`, no round trip of
//!   its own). A slot set over units that overlap the holder's is a cut write: a live writer's
//!   slot lies inside its own lock, which excludes every other holder of those units. So the
//!   holder gives its lock back and takes, exclusively, the hull of its units and the slot's
//!   ([`must_hold`], `locked_io`), and there repairs the slot's range ([`repair`]) and clears
//!   the slot, before its own I/O. Slots of other ranges are left alone (live writers there,
//!   or cuts for whoever gets there).
//! - BEGUN ≠ ENDED names no range, and a live writer without a slot may be in flight: the holder
//!   takes the whole file exclusively, where every live writer has released, and if they still
//!   differ repairs the whole file and sets ENDED to BEGUN. Writers count there only when eight
//!   replicated writes of the file are in flight, or when they lock the whole file.
//!
//! Why no two reads disagree: a write's record lands before any of its data verbs is posted,
//! while its lock is held; any later holder of an overlapping range is granted after that hold
//! ended, so its granting batch sees the record, and it reads nothing before the repair, which
//! runs under an exclusive lock over the whole cut range. A shared grant does not repair: it
//! escalates like a writer.

use crate::chunks::ChunkRun;
use crate::client::Inner;
use crate::error::Error;
use crate::fcb::{read_fcb, Fcb};
use crate::handles::OpenInode;
use crate::meta::unexpected;
use crate::plan::{plan, Geometry, Limits};
use crate::transfer::{exec_plans, on_replicas, Transfer, CHECK_BYTES};
use crate::workers::{Armed, Made, Worker};
use fabric::{Batch, RemoteAddr};
use proto::rpc::{Request, Response};
use proto::{fcb, ChunkLoc, FsError};
use std::ops::Range;

/// Bytes of the file one step of a repair copies (read from the reference replicas, then
/// written to the others).
const REPAIR_WINDOW: u64 = 1 << 20;

/// Free slots a write tries to claim before it counts itself in BEGUN instead.
const CLAIM_TRIES: usize = 2;

/// The address of slot `i` of the FCB at `fcb`.
fn slot_addr(fcb: RemoteAddr, i: usize) -> RemoteAddr {
    fcb.add(fcb::SLOTS + 8 * i as u64)
}

/// Where writers of one file start their search for a free slot: clients by session, the
/// threads of one client by the range they hold (writers of one range never hold it
/// together), so that concurrent writers rarely race for one slot and fall back to BEGUN,
/// which sends every other I/O of the file to the whole-file lock.
fn first_slot(session: u64, units: &Range<u64>) -> usize {
    (session as usize)
        .wrapping_add(units.start as usize)
        .wrapping_add((units.start >> 16) as usize)
}

/// A slot claim carried in a lock's acquisition ([`claim_in_grant`]).
pub(crate) struct GrantClaim {
    cas: fabric::AtomicHandle,
    addr: RemoteAddr,
    value: u64,
}

/// For a write by `session` under an exclusive lock of `units` on a file seen replicated: when
/// the scheme
/// executes an acquisition's carried verbs once, after the grant
/// (`lockmgr::RangeLock::extra_runs_once_granted`), appends to `extra` the CAS that claims the
/// record's first slot to try (from 0 to the units), so that the record costs no round trip of
/// its own. The grant's FCB reads come before it in `extra`, so they show the slot as it was.
/// [`GrantClaim::made`] says whether it took.
pub(crate) fn claim_in_grant(
    session: u64,
    inode: &OpenInode,
    units: &Range<u64>,
    extra: &mut Batch,
) -> Option<GrantClaim> {
    if !inode.replicated.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    let value = fcb::pack_slot(units.clone())?;
    let addr = slot_addr(inode.fcb, first_slot(session, units) % fcb::SLOT_COUNT);
    let cas = extra.cas(addr, 0, value);
    Some(GrantClaim { cas, addr, value })
}

impl GrantClaim {
    /// The record the claim made, read from the granted acquisition's results: the slot, if
    /// it was free.
    pub(crate) fn made(&self, out: &fabric::Completions) -> Option<Made> {
        (out.old(self.cas) == 0).then_some(Made::Slot {
            addr: self.addr,
            value: self.value,
        })
    }
}

/// Appends to `release` the verb that undoes `made` (a claim in a grant given back unused).
pub(crate) fn undo(made: Made, inode: &OpenInode, release: &mut Batch) {
    match made {
        Made::Slot { addr, value } => {
            release.cas(addr, value, 0);
        }
        Made::Counted => {
            release.faa(inode.fcb.add(fcb::ENDED), 1);
        }
    }
}

/// After the grant (and any repair) of a lock of `units` on `inode`, with `found` the FCB
/// words to go on with: under an exclusive lock, lets the changes record themselves
/// ([`before_write`]); a shared lock's body writes nothing, and records nothing. A record
/// the grant made already ([`claim_in_grant`], put in `w.cut.made` by the caller) is the
/// changes' own.
pub(crate) fn arm(
    w: &mut Worker,
    inode: &OpenInode,
    units: Range<u64>,
    found: &Fcb,
    exclusive: bool,
) {
    w.cut.armed = exclusive.then(|| Armed {
        fcb: inode.fcb,
        units,
        free: found
            .slots
            .iter()
            .enumerate()
            .filter(|(_, &v)| v == 0)
            .fold(0, |m, (i, _)| m | 1 << i),
    });
}

/// Before the first data verb of a change to `[off, off + len)` under an exclusive range lock
/// ([`arm`]): when a chunk of it has two or more replicas in `run`, records the write in the
/// file's control block and waits for it, once per lock — a slot claimed with a CAS, else 1
/// added to BEGUN. Nothing for files of one replica, under a shared lock, or once done.
pub(crate) fn before_write(
    w: &mut Worker,
    geometry: &Geometry,
    off: u64,
    len: usize,
    run: &ChunkRun,
) -> Result<(), Error> {
    if w.cut.made.is_some() {
        return Ok(());
    }
    let Some(armed) = &w.cut.armed else {
        return Ok(());
    };
    let replicated = geometry
        .chunks(off, len as u64)
        .any(|c| run.get(c).is_some_and(|r| r.as_slice().len() > 1));
    if !replicated {
        return Ok(());
    }
    let (fcb_at, mut free) = (armed.fcb, armed.free);
    let value = fcb::pack_slot(armed.units.clone());
    // A record landing late (past the lease) is harmless: it only makes a later holder repair
    // replicas that agree.
    w.check_lease_before_post()?;
    if let Some(value) = value {
        let first = first_slot(w.view.session(), &armed.units);
        for _ in 0..CLAIM_TRIES {
            let Some(i) = (0..fcb::SLOT_COUNT)
                .map(|k| (first + k) % fcb::SLOT_COUNT)
                .find(|&i| free & 1 << i != 0)
            else {
                break;
            };
            free &= !(1 << i);
            let addr = slot_addr(fcb_at, i);
            w.batch.clear();
            let cas = w.batch.cas(addr, 0, value);
            w.exec_meta()?;
            if w.out.old(cas) == 0 {
                w.cut.made = Some(Made::Slot { addr, value });
                return Ok(());
            }
        }
    }
    w.batch.clear();
    w.batch.faa(fcb_at.add(fcb::BEGUN), 1);
    w.exec_meta()?;
    // Only once it is known to have landed: an ENDED without its BEGUN would hide a later cut.
    w.cut.made = Some(Made::Counted);
    Ok(())
}

/// Undoes the change's record in `release` (the range lock's release batch) — clears its slot,
/// or adds 1 to ENDED — when it is done or sent nothing (`failed_partway`: it failed after part
/// of it was sent) and the lease is still ahead (`Worker::check_lease_before_post`); otherwise
/// leaves it for the next holder of the range to repair. Clears the worker's record either way.
pub(crate) fn post_ended(
    w: &mut Worker,
    release: &mut Batch,
    inode: &OpenInode,
    failed_partway: bool,
) {
    w.cut.armed = None;
    let Some(made) = w.cut.made.take() else {
        return;
    };
    if failed_partway || w.check_lease_before_post().is_err() {
        return;
    }
    undo(made, inode, release);
}

/// The units a holder of `units` must hold exclusively before it may go on, given the FCB
/// words its grant read (`None`: it may go on as it is): the whole file where BEGUN ≠ ENDED,
/// else the hull of `units` and every slot set over them, when there is one.
pub(crate) fn must_hold(found: &Fcb, units: &Range<u64>) -> Option<Range<u64>> {
    if found.counters_apart() {
        return Some(crate::locks::WHOLE_FILE);
    }
    found
        .slots_over(units)
        .fold(None, |hull: Option<Range<u64>>, (_, v)| {
            let s = fcb::unpack_slot(v);
            let h = hull.unwrap_or_else(|| units.clone());
            Some(h.start.min(s.start)..h.end.max(s.end))
        })
}

/// Repairs what the FCB words `found` of `inode` say was cut within `units`, which the worker
/// holds exclusively (so that [`must_hold`] asks for nothing more): where BEGUN ≠ ENDED the
/// whole file, else each slot set over `units`; returns the words to go on with (those slots
/// cleared, GENERATION moved where chunks were freed). Nothing to repair costs nothing.
///
/// Per cut range: the chunks wholly in it at or past the size are freed (`Request::FreeChunks`:
/// no chunk outlives the size at rest, so there they are a cut extending write's, which a later
/// write's gap would read on one replica); then, for each chunk of what is left of the range,
/// the first replica on a live data server (the reference) is copied over the others on live
/// servers, [`REPAIR_WINDOW`] bytes at a time; then the record is cleared (the slot by a CAS to
/// 0, ENDED set to the BEGUN `found` read). Which replica holds the cut write's bytes is not
/// known: the reference's content wins, so each lock unit reads all of the cut write or none
/// of it, on every replica.
pub(crate) fn repair(
    inner: &Inner,
    w: &mut Worker,
    inode: &OpenInode,
    found: &Fcb,
    units: &Range<u64>,
) -> Result<Fcb, Error> {
    let mut found = *found;
    let whole = found.counters_apart();
    let dead: Vec<(usize, u64)> = match whole {
        // Under the whole-file lock every slot set is a cut one.
        true => found.slots_over(&(0..u64::MAX)).collect(),
        false => found.slots_over(units).collect(),
    };
    if !whole && dead.is_empty() {
        return Ok(found);
    }
    let unit = inner.geometry.lock_unit;
    let ranges: Vec<Range<u64>> = match whole {
        true => std::iter::once(0..u64::MAX).collect(),
        false => dead
            .iter()
            .map(|&(_, v)| {
                let s = fcb::unpack_slot(v);
                s.start.saturating_mul(unit)..s.end.saturating_mul(unit)
            })
            .collect(),
    };
    tracing::warn!(
        ino = inode.ino,
        begun = found.begun,
        ended = found.ended,
        ?ranges,
        "a replicated write of this file was cut (its writer died or lost its lease); \
         copying each chunk's first live replica over the others"
    );
    for bytes in &ranges {
        repair_range(inner, w, inode, &mut found, bytes.clone())?;
    }
    w.check_lease_before_post()?;
    w.batch.clear();
    if whole {
        w.batch.write_u64(inode.fcb.add(fcb::ENDED), found.begun);
        found.ended = found.begun;
    }
    for &(i, v) in &dead {
        w.batch.cas(slot_addr(inode.fcb, i), v, 0);
        found.slots[i] = 0;
    }
    w.changed = true;
    w.exec_meta()?;
    Ok(found)
}

/// Repairs bytes `bytes` of `inode` ([`repair`]): frees its chunks wholly at or past the size,
/// then copies each chunk's reference replica over the others in what is left of the range
/// (below the size, and the chunks past it that the range only partly covers); `found`
/// follows the generation.
fn repair_range(
    inner: &Inner,
    w: &mut Worker,
    inode: &OpenInode,
    found: &mut Fcb,
    bytes: Range<u64>,
) -> Result<(), Error> {
    let geometry = &inner.geometry;
    let layout = &geometry.layout;
    let bytes = bytes.start..bytes.end.min(geometry.max_file_size());
    if bytes.is_empty() {
        return Ok(());
    }
    let size_end = layout.start(layout.chunks_below(found.size));
    let from = bytes.start.max(size_end);
    // To the largest file: every chunk from the one after `from`'s on.
    let to_end = bytes.end >= geometry.max_file_size();
    let doomed = match to_end {
        true => layout.chunks_below(from)..u64::MAX,
        false => layout.chunks_within(from, bytes.end),
    };
    if !doomed.is_empty() && from < bytes.end {
        free_chunks(inner, w, inode, doomed.clone())?;
        found.generation = read_fcb(w, inode)?.generation;
    }
    let mut pieces: Vec<Range<u64>> =
        std::iter::once(bytes.start..bytes.end.min(size_end)).collect();
    if from < bytes.end {
        // The chunks past the size that the range covers only in part: the one it starts in,
        // and the one it ends in.
        let first = layout.locate(from).0;
        let mut partial = vec![first];
        if !to_end {
            partial.push(layout.locate(bytes.end - 1).0);
        }
        partial.dedup();
        for c in partial.into_iter().filter(|c| !doomed.contains(c)) {
            pieces.push(layout.start(c).max(from)..layout.start(c + 1).min(bytes.end));
        }
    }
    for piece in pieces.into_iter().filter(|p| p.start < p.end) {
        let mut off = piece.start;
        while off < piece.end {
            let n = (piece.end - off).min(REPAIR_WINDOW);
            let len = usize::try_from(n).map_err(|_| FsError::Invalid("repair window".into()))?;
            let view = w.view.clone();
            let run = inner.chunk_locations(&view, inode, found.generation, off, len, false)?;
            copy_replicas(w, geometry, off, len, &run)?;
            off += n;
        }
    }
    Ok(())
}

/// Frees `inode`'s chunks `chunks` (at or past its size, inside the cut range the worker holds
/// exclusively): a call held to the lease's deadline at the meta server, as every locked call.
fn free_chunks(
    inner: &Inner,
    w: &mut Worker,
    inode: &OpenInode,
    chunks: Range<u64>,
) -> Result<(), Error> {
    w.check_lease_before_post()?;
    let request = Request::FreeChunks {
        ino: inode.ino,
        first: chunks.start,
        count: chunks.end - chunks.start,
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
///
/// A data server that fails either round, every chunk there having another replica, fails the
/// copy as [`Error::ReplicaServerFailed`] (`transfer::on_replicas`), as a write's rounds do: the
/// I/O is redone at once with a chunk map learnt anew (the meta server drops a down server's
/// replicas), and repairs again, instead of waiting for that server.
fn copy_replicas(
    w: &mut Worker,
    geometry: &Geometry,
    off: u64,
    len: usize,
    run: &ChunkRun,
) -> Result<(), Error> {
    copy_replicas_once(w, geometry, off, len, run)
        .map_err(|e| on_replicas(e, run, geometry.chunks(off, len as u64)))
}

/// [`copy_replicas`]'s rounds.
fn copy_replicas_once(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::locks::WHOLE_FILE;

    fn fcb(slots: &[(u64, u64)], begun: u64, ended: u64) -> Fcb {
        let mut f = Fcb {
            ino: 1,
            size: 0,
            generation: 0,
            mtime: 0,
            mode: 0,
            begun,
            ended,
            slots: [0; fcb::SLOT_COUNT],
        };
        for (i, s) in slots.iter().enumerate() {
            f.slots[i] = fcb::pack_slot(s.0..s.1).unwrap();
        }
        f
    }

    #[test]
    fn only_records_over_the_units_held_ask_for_more() {
        // Nothing recorded, or only writes of other ranges (live writers there): go on.
        assert_eq!(must_hold(&fcb(&[], 3, 3), &(0..10)), None);
        assert_eq!(must_hold(&fcb(&[(10, 20), (30, 31)], 0, 0), &(0..10)), None);
        // A slot over the units: the hull of both, and of every other slot over them.
        assert_eq!(must_hold(&fcb(&[(5, 20)], 0, 0), &(0..10)), Some(0..20));
        assert_eq!(
            must_hold(&fcb(&[(8, 12), (40, 50), (0, 2)], 0, 0), &(1..9)),
            Some(0..12)
        );
        // Counters apart name no range: the whole file.
        assert_eq!(must_hold(&fcb(&[], 4, 3), &(0..10)), Some(WHOLE_FILE));
        // Under the whole-file lock every slot set is over it, and the hull is the lock.
        assert_eq!(
            must_hold(&fcb(&[(8, 12)], 0, 0), &WHOLE_FILE),
            Some(WHOLE_FILE)
        );
    }
}
