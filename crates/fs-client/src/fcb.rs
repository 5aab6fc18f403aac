//! One-sided access to an open file's control block (FCB, `proto::fcb`): its INO, SIZE,
//! GENERATION, MTIME and MODE words in the meta region.
//!
//! Invariants:
//! - SIZE is the truth about a file's size while it is open anywhere: writers of every client
//!   raise it one-sidedly, and only upward, with a CAS ([`raise_size`]) while they hold
//!   the range lock of their write; the meta server persists it on release, fsync and truncate.
//!   Attributes of an open file therefore take their size from here (`CitronFs::fresh_size`).
//! - MTIME (the latest data change) is raised by every write and fallocate, with a CAS from the
//!   value read in the acquisition ([`FcbReads`]) to the write's start time ([`MtimeRaise`]),
//!   in a round trip the I/O waits for anyway: at the head of its range lock's release batch
//!   where the release is one-sided verbs, else beside the write's data batches
//!   ([`FcbRaises`]). No extra round trip unless another client raised it meanwhile. So mtime
//!   and ctime move on every write, as POSIX asks, without an RPC; attributes merge it through
//!   `proto::fcb::live`.
//! - A write's SIZE raise ([`FcbRaises`]) is posted beside its data batches and completed with
//!   them, before the release: under the lock the order of the two does not matter (no reader
//!   of the range gets the lock before the release, and one of another range does not read
//!   these bytes), and a CAS that found another writer's smaller raise is redone before the
//!   release ([`finish_fcb_raises`]).
//! - Each word is read atomically; SIZE and GENERATION are read in one round trip but are two
//!   words, so a reader that needs them consistent holds the range lock that a truncate would
//!   need (every read and write does).
//! - Every read of the FCB reads its INO word too, in the same round trip, and is refused
//!   unless it carries the inode's number ([`check_owner`]; a slot's FCB that is no longer the
//!   inode's sends a stat to the RPC instead, [`live_slot_attr`]): writing through another
//!   file's FCB would corrupt it. An I/O checks it before its first data verb (the words ride
//!   in the lock's granting batch, [`FcbReads`]), so a wrong FCB costs an error, never a
//!   write, and an open costs no round trip of its own to check it.

use crate::error::Error;
use crate::handles::OpenInode;
use crate::meta::Meta;
use crate::workers::Worker;
use fabric::{AtomicHandle, Batch, Completions, ReadHandle};
use proto::attrs::{AttrSlot, AttrTableRef};
use proto::{fcb, Attr, Ino};

/// Reads the slots of `inos` in one round trip; each is `None` unless whole and its inode's.
pub(crate) fn read_slots<const N: usize>(
    w: &mut Worker,
    table: &AttrTableRef,
    inos: [Ino; N],
) -> Result<[Option<AttrSlot>; N], Error> {
    w.batch.clear();
    let handles = inos.map(|ino| {
        w.batch
            .read(table.slot_addr(ino), proto::attrs::SLOT_BYTES as usize)
    });
    w.exec_meta()?;
    let mut i = 0;
    Ok(handles.map(|h| {
        let slot = proto::attrs::decode(w.out.bytes(h), inos[i]);
        i += 1;
        slot
    }))
}

/// The attributes a slot holds, with the size from the FCB it names (an open file's truth);
/// `None` if that FCB is no longer the file's (closed meanwhile).
pub(crate) fn live_slot_attr(
    w: &mut Worker,
    table: &AttrTableRef,
    slot: AttrSlot,
) -> Result<Option<Attr>, Error> {
    let mut attr = slot.attr;
    if slot.fcb == 0 {
        return Ok(Some(attr));
    }
    w.batch.clear();
    let fcb_addr = fabric::RemoteAddr::new(table.base.region, slot.fcb);
    let owner = w.batch.read(fcb_addr.add(fcb::INO), 8);
    let size = w.batch.read(fcb_addr.add(fcb::SIZE), 8);
    let mtime = w.batch.read(fcb_addr.add(fcb::MTIME), 8);
    w.exec_meta()?;
    if w.out.word(owner, 0) != attr.ino {
        return Ok(None);
    }
    attr = fcb::live(attr, w.out.word(size, 0), w.out.word(mtime, 0));
    Ok(Some(attr))
}

/// The FCB words read in one verb ([`FcbReads`]): by a locked I/O in the batch that granted
/// its range lock, or alone ([`read_fcb`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fcb {
    /// INO: whose FCB this is ([`check_owner`]).
    pub(crate) ino: Ino,
    /// SIZE.
    pub(crate) size: u64,
    /// GENERATION.
    pub(crate) generation: u64,
    /// MTIME: the latest data change, in nanoseconds.
    pub(crate) mtime: u64,
    /// MODE: the permission bits as the meta server holds them.
    pub(crate) mode: u16,
    /// BEGUN: replicated writes begun without a slot (`cut_repair`).
    pub(crate) begun: u64,
    /// ENDED: such writes ended (`cut_repair`).
    pub(crate) ended: u64,
    /// SLOTS: replicated writes in flight, 0 = free (`cut_repair`, `proto::fcb::pack_slot`).
    pub(crate) slots: [u64; fcb::SLOT_COUNT],
}

impl Fcb {
    /// Whether a replicated write counted in BEGUN has not ended: seen by a lock holder of the
    /// whole file, a write cut between its replicas, somewhere in the file (`cut_repair`).
    pub(crate) fn counters_apart(&self) -> bool {
        self.begun != self.ended
    }

    /// The slots set whose units overlap `units`, with their index: seen by a holder of
    /// `units`, writes cut between their replicas (`cut_repair`).
    pub(crate) fn slots_over(
        &self,
        units: &std::ops::Range<u64>,
    ) -> impl Iterator<Item = (usize, u64)> + '_ {
        let units = units.clone();
        self.slots
            .iter()
            .copied()
            .enumerate()
            .filter(move |&(_, v)| {
                let s = fcb::unpack_slot(v);
                v != 0 && s.start < units.end && units.start < s.end
            })
    }
}

/// The reads of INO, SIZE, GENERATION, MTIME, MODE, BEGUN, ENDED and the SLOTS that ride in a
/// range lock's acquisition (`lockmgr::RangeLock::acquire_with`, on the lock's endpoint to the
/// meta region): one read of the whole block's adjacent words, each word atomic, executed after the verbs that granted the
/// lock. Values read there are as good as a read after the acquisition (the lock scheme's
/// invariant): no writer of the range is active, and every one that held it before has
/// released, its SIZE raise and MTIME included. Values read in any earlier batch would not
/// be; the scheme hands back only the granting batch's (or a later one's).
pub(crate) struct FcbReads {
    /// INO to the last slot: adjacent words, one read verb (word-atomic each, as one read per
    /// word would be; appended to every batch of an acquisition, so one verb).
    words: ReadHandle,
}

/// The FCB words an I/O reads, from INO to the last slot (adjacent, in this order).
const READ_FIRST: u64 = fcb::INO;
/// How many words from [`READ_FIRST`].
const READ_WORDS: usize = (fcb::SLOTS - fcb::INO) as usize / 8 + fcb::SLOT_COUNT;
const _: () = assert!(
    fcb::SIZE == fcb::INO + 8
        && fcb::GENERATION == fcb::INO + 16
        && fcb::MTIME == fcb::INO + 24
        && fcb::MODE == fcb::INO + 32
        && fcb::BEGUN == fcb::INO + 40
        && fcb::ENDED == fcb::INO + 48
        && fcb::SLOTS + 8 * fcb::SLOT_COUNT as u64 <= fcb::FCB_BYTES
);

/// Refuses an FCB whose INO word (`found`) is not `inode`'s: the meta server's region and this
/// client disagree about where the file's control block is (a meta server restart the client
/// has not caught up with yet, see [`Error::ForeignFcb`]), and writing through it would corrupt
/// another file.
pub(crate) fn check_owner(inode: &OpenInode, found: Ino) -> Result<(), Error> {
    if found == inode.ino {
        return Ok(());
    }
    Err(Error::ForeignFcb {
        ino: inode.ino,
        found,
        fcb: inode.fcb,
        session: inode.session,
    })
}

impl FcbReads {
    /// Posts the reads of `inode`'s FCB words into `batch`.
    pub(crate) fn post(batch: &mut Batch, inode: &OpenInode) -> Self {
        Self {
            words: batch.read(inode.fcb.add(READ_FIRST), READ_WORDS * 8),
        }
    }

    /// What the reads returned.
    pub(crate) fn decode(&self, out: &Completions) -> Fcb {
        let word = |at: u64| out.word(self.words, ((at - READ_FIRST) / 8) as usize);
        Fcb {
            ino: word(fcb::INO),
            size: word(fcb::SIZE),
            generation: word(fcb::GENERATION),
            mtime: word(fcb::MTIME),
            mode: word(fcb::MODE) as u16,
            begun: word(fcb::BEGUN),
            ended: word(fcb::ENDED),
            slots: std::array::from_fn(|i| word(fcb::SLOTS + 8 * i as u64)),
        }
    }
}

/// A write's MTIME raise: a CAS from the MTIME the acquisition read to the write's start time,
/// posted in a batch the write waits for anyway (the head of its range lock's release batch,
/// `lockmgr::RangeLock::release_with`, or [`FcbRaises`] beside its data), so a reader that
/// locks after the release sees it, without a round trip of its own. MTIME is not guarded by
/// the range lock (writers of other ranges raise it too), so the CAS may find another value:
/// [`finish_mtime_raise`] then retries, and never lowers it.
pub(crate) struct MtimeRaise {
    cas: AtomicHandle,
    expected: u64,
    now_ns: u64,
}

impl MtimeRaise {
    /// Posts the raise of `inode`'s MTIME from `seen` to `now_ns` into `batch`; nothing when
    /// it is at `now_ns` or later already.
    pub(crate) fn post(
        batch: &mut Batch,
        inode: &OpenInode,
        seen: u64,
        now_ns: u64,
    ) -> Option<Self> {
        (seen < now_ns).then(|| Self {
            cas: batch.cas(inode.fcb.add(fcb::MTIME), seen, now_ns),
            expected: seen,
            now_ns,
        })
    }
}

/// The FCB words a write (or an allocating fallocate) raises under its range lock, in one batch
/// on the meta endpoint, the worker's own (`Worker::raises`): SIZE to the write's end when it
/// extends the file, and MTIME to its start time when the release cannot carry that raise for
/// free (`lockmgr::RangeLock::release_carries_verbs`). A write sends the batch beside its data
/// batches (`transfer`'s `exec_data_round`), so the raises cost no round trip in sequence of their
/// own; [`finish_fcb_raises`] then redoes a CAS that lost to another client, still
/// under the lock.
pub(crate) struct FcbRaises {
    /// SIZE's CAS, from the SIZE the acquisition read to the end of the write.
    size: Option<SizeRaise>,
    /// MTIME's CAS.
    mtime: Option<MtimeRaise>,
}

/// A SIZE raise in flight: the CAS and what it expected and wrote.
struct SizeRaise {
    cas: AtomicHandle,
    seen: u64,
    end: u64,
}

impl FcbRaises {
    /// Fills `w`'s raise batch with the raise of `inode`'s SIZE from `found.size` to `end`
    /// (when `end` is beyond it) and of its MTIME from `found.mtime` to `mtime` (when given and
    /// later); the caller sends it ([`FcbRaises::is_empty`]: nothing to send).
    pub(crate) fn post(
        w: &mut Worker,
        inode: &OpenInode,
        found: &Fcb,
        end: u64,
        mtime: Option<u64>,
    ) -> Self {
        let batch = &mut w.raises;
        batch.clear();
        let size = (end > found.size).then(|| SizeRaise {
            cas: batch.cas(inode.fcb.add(fcb::SIZE), found.size, end),
            seen: found.size,
            end,
        });
        let mtime = mtime.and_then(|now| MtimeRaise::post(batch, inode, found.mtime, now));
        Self { size, mtime }
    }

    /// Nothing to raise: the batch is empty and need not be sent.
    pub(crate) fn is_empty(&self) -> bool {
        self.size.is_none() && self.mtime.is_none()
    }
}

/// `ino`'s attributes read one-sidedly from the meta server's attribute table
/// (`proto::attrs`): one read of its slot and, when the file is open on some client, one
/// of its FCB's INO and SIZE words (the size's truth while open). `None` — no table, a
/// slot of another inode or empty, a torn read, an FCB no longer the file's — sends the
/// caller to the RPC; an error is a failure of the meta region's fabric.
pub(crate) fn attr_one_sided(w: &mut Worker, ino: Ino) -> Result<Option<Attr>, Error> {
    let Some(table) = w.view.info.attr_table else {
        return Ok(None);
    };
    let [slot] = read_slots(w, &table, [ino])?;
    match slot {
        Some(slot) => live_slot_attr(w, &table, slot),
        None => Ok(None),
    }
}

/// Reads the FCB's words outside a lock acquisition ([`FcbReads`] in a batch of its own on
/// the worker's meta endpoint: one round trip), refused unless it is `inode`'s
/// ([`check_owner`]). Each word is read atomically, but not the words together: a reader
/// that needs two of them consistent holds the range lock a change of both would need.
pub(crate) fn read_fcb(w: &mut Worker, inode: &OpenInode) -> Result<Fcb, Error> {
    w.batch.clear();
    let reads = FcbReads::post(&mut w.batch, inode);
    w.exec_meta()?;
    let found = reads.decode(&w.out);
    check_owner(inode, found.ino)?;
    Ok(found)
}

/// Completes an MTIME raise whose CAS executed with results `out`: when another client
/// moved MTIME meanwhile to a time before ours, CAS again from what it found (one round
/// trip each, rare); a later time is left as it is.
pub(crate) fn finish_mtime_raise(
    w: &mut Worker,
    inode: &OpenInode,
    raise: &MtimeRaise,
    out: &Completions,
) -> Result<(), Error> {
    let mut old = out.old(raise.cas);
    let mut expected = raise.expected;
    while old != expected && old < raise.now_ns {
        expected = old;
        w.batch.clear();
        let cas = w
            .batch
            .cas(inode.fcb.add(fcb::MTIME), expected, raise.now_ns);
        w.exec_meta()?;
        old = w.out.old(cas);
    }
    Ok(())
}

/// Completes `raises`, whose batch executed (its results in `w.raises_out`), still under
/// the range lock: a SIZE CAS that found another writer's smaller raise is redone from
/// what it found (one round trip each, within the lease), so a reader that locks after the
/// release finds the size at or beyond this write's end; an MTIME CAS that lost is redone
/// as [`finish_mtime_raise`] does. A raised size lives in the meta server's memory
/// until an fsync or close: noted as unsynced.
pub(crate) fn finish_fcb_raises(
    meta: &Meta,
    w: &mut Worker,
    inode: &OpenInode,
    raises: &FcbRaises,
) -> Result<(), Error> {
    // The retries use the worker's main batch; the raises' results are set aside meanwhile.
    let out = std::mem::take(&mut w.raises_out);
    let finished = finish_with(w, inode, raises, &out);
    w.raises_out = out;
    finished?;
    if raises.size.is_some() {
        meta.note_unsynced(w.view.generation);
    }
    Ok(())
}

/// [`finish_fcb_raises`]' work, with the raises' results set aside in `out`.
fn finish_with(
    w: &mut Worker,
    inode: &OpenInode,
    raises: &FcbRaises,
    out: &Completions,
) -> Result<(), Error> {
    if let Some(size) = &raises.size {
        let old = out.old(size.cas);
        if old != size.seen {
            raise_size(w, inode, old, size.end)?;
        }
    }
    match &raises.mtime {
        Some(mtime) => finish_mtime_raise(w, inode, mtime, out),
        None => Ok(()),
    }
}

/// Raises SIZE to `end` unless it is there already (CAS loop from `seen`). Called under the
/// write's range lock: each CAS is posted only within the lock's lease.
pub(crate) fn raise_size(
    w: &mut Worker,
    inode: &OpenInode,
    mut seen: u64,
    end: u64,
) -> Result<(), Error> {
    let addr = inode.fcb.add(fcb::SIZE);
    while end > seen {
        w.check_lease_before_post()?;
        w.batch.clear();
        let h = w.batch.cas(addr, seen, end);
        w.exec_meta()?;
        let old = w.out.old(h);
        if old == seen {
            break;
        }
        seen = old;
    }
    Ok(())
}
