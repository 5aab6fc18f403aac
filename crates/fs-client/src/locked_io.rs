//! One locked I/O: the range lock around a body of data verbs ([`locked`]). Acquire with the
//! file control block's words in the granting batch, run the body, release — with the MTIME
//! raise at the head of the release where the scheme's release is one-sided verbs — and count
//! the I/O (`IoCounters`).
//!
//! Invariants:
//! - The body never runs while the granting batch's words record a replicated write cut over
//!   the units held (a slot set over them, or BEGUN ≠ ENDED: `cut_repair`): the lock is given
//!   back for an exclusive one over the cut range (the whole file, for the counters), and
//!   there the replicas are repaired first (`cut_repair::repair`), whatever the body is.
//! - The lock is held from the batch that read the FCB (its granting batch) until after the
//!   body's last data verb and raise completed; the body runs only with an FCB that is the
//!   file's ([`check_owner`]).
//! - A change that lost its lease after part of it was sent fails (`LeaseLostPartway`), never
//!   redone: the release hands the next holder a range with that part in it.
//! - A failed acquisition or release marks the worker broken (its lock handle is in doubt).

use crate::client::Inner;
use crate::error::Error;
use crate::fcb::{check_owner, finish_mtime_raise, Fcb, FcbReads, MtimeRaise};
use crate::handles::OpenInode;
use crate::locks::file_range;
use crate::workers::{Made, Worker};
use lockmgr::{LockId, LockMode, LockStats};
use std::ops::Range;
use std::sync::Arc;

/// Runs `body` holding units `units` of `inode` locked in `mode`, with the file's FCB words as
/// the acquisition found them; releases after it, whatever it returned. Where those words say a
/// replicated write was cut over these units (`cut_repair::must_hold`), `body` runs under an
/// exclusive lock over the cut range and `units` instead, after `cut_repair::repair` (see the
/// module docs). A failed acquisition or release marks the worker broken (its lock handle is
/// in doubt).
///
/// `mode`: [`LockMode::Shared`] for a body that only reads (a read: no data verb that writes,
/// no MTIME raise, no RPC that changes the file), so that overlapping reads of several
/// clients hold the range together where the scheme shares
/// (`lockmgr::RangeLock::acquire_mode_with`); [`LockMode::Exclusive`] for anything that
/// changes the file. A shared grant still excludes every writer of an overlapping range, so
/// a read never sees a torn write. `touch` must be `None` with a shared lock.
///
/// `touch` (a write's start time) asks for MTIME to be raised to it ([`MtimeRaise`]): at
/// the head of the release batch where the release is one-sided verbs that carry it for
/// free (`lockmgr::RangeLock::release_carries_verbs`), else by `body`, which is then given
/// the time as its third argument and posts the raise beside its data (`fcb::FcbRaises`).
///
/// Round trips: the FCB reads ride in the lock's granting batch ([`FcbReads`]; the lock
/// handle's endpoint reaches the meta region, where the lock words and the FCB live), and
/// the MTIME raise in a batch waited for anyway, so a locked I/O costs the lock's own round
/// trips plus its data batches: three in sequence for a 4 KiB read or overwrite on one data
/// server, two where the release is posted (CITRON at the host). A scheme that cannot carry
/// verbs in its acquisition (a lock service) reads the FCB on the worker's meta endpoint, one
/// round trip more, after the grant.
pub(crate) fn locked<T>(
    inner: &Inner,
    w: &mut Worker,
    inode: &Arc<OpenInode>,
    units: Range<u64>,
    mode: LockMode,
    touch: Option<u64>,
    body: impl FnOnce(&mut Worker, Fcb, Option<u64>) -> Result<T, Error>,
) -> Result<T, Error> {
    debug_assert!(
        mode == LockMode::Exclusive || touch.is_none(),
        "a shared lock never raises MTIME"
    );
    let io = &inner.io;
    let before = io.start(w);
    let lock_before = w.locks.handle(&w.view, inode)?.stats();
    // A write of a file seen replicated claims its record's slot in the grant, where the
    // scheme runs carried verbs once granted (`cut_repair::claim_in_grant`).
    let claim = touch.is_some() && mode == LockMode::Exclusive;
    let (mut id, mut found, mut mode, mut claimed) = grant(w, inode, units.clone(), mode, claim)?;
    let mut held = units;
    // A replicated write cut by its writer's death or lost lease (`cut_repair`): a slot set
    // over these units, or BEGUN ≠ ENDED. Trade this lock for the exclusive one the repair
    // needs (the hull of ours and the cut's, or the whole file) until the words the grant read
    // ask for nothing more; there the replicas are repaired before the body reads or writes.
    for _ in 0..=proto::fcb::SLOT_COUNT {
        if check_owner(inode, found.ino).is_err() {
            break;
        }
        let wider = match crate::cut_repair::must_hold(&found, &held) {
            None => break,
            Some(need) if mode == LockMode::Exclusive && covers(&held, &need) => break,
            Some(need) => need,
        };
        release_plain(w, inode, id, claimed.take())?;
        held = wider;
        (id, found, mode, claimed) = grant(w, inode, held.clone(), LockMode::Exclusive, false)?;
    }
    // A claim the grant made is the record of whatever this lock's body changes: its release
    // undoes it (`cut_repair::post_ended`), on every path.
    w.cut.made = claimed;
    let touch_at_release = match w.locks.handle(&w.view, inode)?.release_carries_verbs() {
        true => touch,
        false => None,
    };
    let touch_in_body = touch.filter(|_| touch_at_release.is_none());
    failpoint!("fs_client::io::locked");
    // An FCB that is not this file's is refused before any data verb or raise touches it
    // (the lock is released all the same).
    let (result, owned) = match check_owner(inode, found.ino) {
        Ok(()) => {
            let exclusive = mode == LockMode::Exclusive;
            let repaired = match crate::cut_repair::must_hold(&found, &held) {
                Some(need) if exclusive && covers(&held, &need) => {
                    crate::cut_repair::repair(inner, w, inode, &found, &held)
                }
                // Still cut after every widening: a new cut each time (clients dying one
                // after another); the I/O is redone.
                Some(_) => Err(Error::LeaseLost),
                None => Ok(found),
            };
            (
                repaired.and_then(|f| {
                    crate::cut_repair::arm(w, inode, held.clone(), &f, exclusive);
                    body(w, f, touch_in_body)
                }),
                true,
            )
        }
        Err(e) => (Err(e), false),
    };
    // A lease lost partway through a change: the release below hands the range to the
    // next holder with that part in it, so the change must not be redone and reported
    // done — another client may read the part in between, a torn read of a write that
    // then succeeded. It fails instead, as a write cut by a crash does.
    let result = match result {
        Err(Error::LeaseLost) if w.changed => Err(Error::LeaseLostPartway),
        other => other,
    };
    let mut extra = std::mem::take(&mut w.batch);
    let mut out = std::mem::take(&mut w.out);
    extra.clear();
    // The end of a replicated write's record rides at the head of the release, while the
    // lease is still ahead; a change that failed after part of it was sent leaves it.
    let failed_partway = result.is_err() && w.changed;
    if w.cut.made.is_some() {
        inode
            .replicated
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
    crate::cut_repair::post_ended(w, &mut extra, inode, failed_partway);
    w.lease = None;
    w.changed = false;
    let raise = touch_at_release
        .filter(|_| owned)
        .and_then(|now| MtimeRaise::post(&mut extra, inode, found.mtime, now));
    let meta_ep = &mut *w.meta_ep;
    let mut lock_rtts = 0;
    let released = w.locks.handle(&w.view, inode).and_then(|l| {
        // Nothing carried whose result is read (the record's end): where the release is
        // posted, it goes in the posted call.
        let released = match raise {
            None => l.release_forgetting(id, &extra, meta_ep),
            Some(_) => l.release_with(id, &extra, &mut out, meta_ep),
        }
        .map_err(Error::lock(inode.ino));
        lock_rtts = lock_round_trips(&l.stats()) - lock_round_trips(&lock_before);
        released
    });
    w.batch = extra;
    let released = released.and_then(|()| match &raise {
        Some(raise) => finish_mtime_raise(w, inode, raise, &out),
        None => Ok(()),
    });
    w.out = out;
    if released.is_err() {
        w.broken = true;
    }
    io.finish(w, before, lock_rtts);
    let value = result?;
    released?;
    Ok(value)
}

/// Acquires units `units` of `inode` in `mode` with the FCB words in the granting batch
/// ([`FcbReads`]), and notes the lease in the worker: the lock's id, the words, the mode. A
/// failed acquisition marks the worker broken (its lock handle is in doubt).
fn grant(
    w: &mut Worker,
    inode: &Arc<OpenInode>,
    units: Range<u64>,
    mode: LockMode,
    claim: bool,
) -> Result<(LockId, Fcb, LockMode, Option<Made>), Error> {
    let range = file_range(w.locks.scheme(), inode.ino, units.clone())?;
    let mut extra = std::mem::take(&mut w.batch);
    let mut out = std::mem::take(&mut w.out);
    extra.clear();
    let reads = FcbReads::post(&mut extra, inode);
    let session = w.view.session();
    let lock = w.locks.handle(&w.view, inode)?;
    let claim = (claim && lock.extra_runs_once_granted())
        .then(|| crate::cut_repair::claim_in_grant(session, inode, &units, &mut extra))
        .flatten();
    let acquired = lock
        .acquire_mode_with(range, mode, &extra, &mut out, &mut *w.meta_ep)
        .map(|id| (id, lock.lease_deadline(id)));
    // The reads' results are there only when the lock was granted (a failed acquisition may
    // have executed no batch that carried them).
    let granted = acquired.map(|held| {
        let claimed = claim.as_ref().and_then(|c| c.made(&out));
        (held, reads.decode(&out), claimed)
    });
    w.batch = extra;
    w.out = out;
    match granted {
        Ok(((id, lease), found, claimed)) => {
            w.lease = lease;
            w.changed = false;
            w.cut = Default::default();
            Ok((id, found, mode, claimed))
        }
        Err(e) => {
            w.broken = true;
            Err(Error::lock(inode.ino)(e))
        }
    }
}

/// Releases lock `id` of `inode`, a grant given back before any body ran, carrying only the
/// undoing of `claimed` (a claim its grant made); a failure marks the worker broken.
fn release_plain(
    w: &mut Worker,
    inode: &Arc<OpenInode>,
    id: LockId,
    claimed: Option<Made>,
) -> Result<(), Error> {
    w.lease = None;
    let mut extra = std::mem::take(&mut w.batch);
    let out = std::mem::take(&mut w.out);
    extra.clear();
    if let Some(made) = claimed {
        crate::cut_repair::undo(made, inode, &mut extra);
    }
    let meta_ep = &mut *w.meta_ep;
    let released = w.locks.handle(&w.view, inode).and_then(|l| {
        l.release_forgetting(id, &extra, meta_ep)
            .map_err(Error::lock(inode.ino))
    });
    w.batch = extra;
    w.out = out;
    if released.is_err() {
        w.broken = true;
    }
    released
}

/// Whether units `held` include every unit of `need`.
fn covers(held: &Range<u64>, need: &Range<u64>) -> bool {
    held.start <= need.start && need.end <= held.end
}

/// The round trips a lock handle has spent acquiring and releasing.
fn lock_round_trips(stats: &LockStats) -> u64 {
    stats.acquire.round_trips + stats.release.round_trips
}
