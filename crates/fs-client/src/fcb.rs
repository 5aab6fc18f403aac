//! One-sided access to an open file's control block (FCB, `proto::fcb`): its INO, SIZE,
//! GENERATION, MTIME and MODE words in the meta region.
//!
//! Invariants:
//! - SIZE is the truth about a file's size while it is open anywhere: writers of every client
//!   raise it one-sidedly, and only upward, with a CAS ([`Inner::raise_size`]) while they hold
//!   the range lock of their write; the meta server persists it on release, fsync and truncate.
//!   Attributes of an open file therefore take their size from here ([`Inner::fresh_size`]).
//! - MTIME (the latest data change) is raised by every write and fallocate, with a CAS in the
//!   batch that reads SIZE and GENERATION ([`Inner::read_fcb_for_write`]): no extra round trip
//!   unless another client raised it meanwhile. So mtime and ctime move on every write, as
//!   POSIX asks, without an RPC; attributes merge it through `proto::fcb::live`.
//! - Each word is read atomically; SIZE and GENERATION are read in one round trip but are two
//!   words, so a reader that needs them consistent holds the range lock that a truncate would
//!   need (every read and write does).
//! - The FCB an `Open` names must carry the inode's number ([`Inner::check_fcb_owner`]):
//!   writing through another file's FCB would corrupt it.

use crate::client::Inner;
use crate::error::Error;
use crate::handles::OpenInode;
use crate::workers::Worker;
use proto::attrs::{AttrSlot, AttrTableRef};
use proto::{fcb, Attr, FileKind, Ino};
use std::sync::atomic::Ordering;

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

/// What a write read from the FCB ([`Inner::read_fcb_for_write`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FcbForWrite {
    /// SIZE.
    pub(crate) size: u64,
    /// GENERATION.
    pub(crate) generation: u64,
    /// MODE: the permission bits as the meta server holds them.
    pub(crate) mode: u16,
}

impl Inner {
    /// `ino`'s attributes read one-sidedly from the meta server's attribute table
    /// (`proto::attrs`): one read of its slot and, when the file is open on some client, one
    /// of its FCB's INO and SIZE words (the size's truth while open). `None` — no table, a
    /// slot of another inode or empty, a torn read, an FCB no longer the file's — sends the
    /// caller to the RPC; an error is a failure of the meta region's fabric.
    pub(crate) fn attr_one_sided(&self, ino: Ino) -> Result<Option<Attr>, Error> {
        let mut w = self.checkout()?;
        let Some(table) = w.view.info.attr_table else {
            return Ok(None);
        };
        let [slot] = read_slots(&mut w, &table, [ino])?;
        match slot {
            Some(slot) => live_slot_attr(&mut w, &table, slot),
            None => Ok(None),
        }
    }

    /// Reads SIZE and GENERATION from the FCB (two word reads in one round trip: each word is
    /// read atomically).
    pub(crate) fn read_fcb(&self, w: &mut Worker, inode: &OpenInode) -> Result<(u64, u64), Error> {
        w.batch.clear();
        let size = w.batch.read(inode.fcb.add(fcb::SIZE), 8);
        let generation = w.batch.read(inode.fcb.add(fcb::GENERATION), 8);
        w.exec_meta()?;
        Ok((w.out.word(size, 0), w.out.word(generation, 0)))
    }

    /// What a write needs from the FCB, read in one round trip with the MTIME raise: SIZE,
    /// GENERATION and MODE (whether set-ID bits must be cleared). `now_ns` is this write's time;
    /// MTIME ends at least that high (a CAS expecting the value last seen; only when another
    /// client moved it meanwhile does it take more round trips, and never lowers it). Like
    /// Linux, the time is taken before the data lands.
    pub(crate) fn read_fcb_for_write(
        &self,
        w: &mut Worker,
        inode: &OpenInode,
        now_ns: u64,
    ) -> Result<FcbForWrite, Error> {
        let mtime_addr = inode.fcb.add(fcb::MTIME);
        let mut expected = inode.mtime_seen.load(Ordering::Relaxed);
        w.batch.clear();
        let size = w.batch.read(inode.fcb.add(fcb::SIZE), 8);
        let generation = w.batch.read(inode.fcb.add(fcb::GENERATION), 8);
        let mode = w.batch.read(inode.fcb.add(fcb::MODE), 8);
        let mut cas = w.batch.cas(mtime_addr, expected, now_ns);
        w.exec_meta()?;
        let found = FcbForWrite {
            size: w.out.word(size, 0),
            generation: w.out.word(generation, 0),
            mode: w.out.word(mode, 0) as u16,
        };
        loop {
            let old = w.out.old(cas);
            if old == expected {
                inode.mtime_seen.store(now_ns, Ordering::Relaxed);
                break;
            }
            if old >= now_ns {
                // A later write (of another client) is there already.
                inode.mtime_seen.store(old, Ordering::Relaxed);
                break;
            }
            expected = old;
            w.batch.clear();
            cas = w.batch.cas(mtime_addr, expected, now_ns);
            w.exec_meta()?;
        }
        Ok(found)
    }

    /// Raises SIZE to `end` unless it is there already (CAS loop from `seen`). Called under the
    /// write's range lock: each CAS is posted only within the lock's lease.
    pub(crate) fn raise_size(
        &self,
        w: &mut Worker,
        inode: &OpenInode,
        mut seen: u64,
        end: u64,
    ) -> Result<(), Error> {
        let addr = inode.fcb.add(fcb::SIZE);
        while end > seen {
            self.check_lease_before_post(w)?;
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

    /// For a file open here, corrects the attributes with the FCB (`proto::fcb::live`: its
    /// SIZE and MTIME are the truth, updated one-sidedly by writers of every client).
    pub(crate) fn fresh_size(&self, attr: Attr) -> Result<Attr, Error> {
        if attr.kind == FileKind::File {
            if let Some(inode) = self.open_entry(attr.ino) {
                let mut w = self.checkout()?;
                let inode = self.live_inode(&inode, &w.view)?;
                w.batch.clear();
                let size = w.batch.read(inode.fcb.add(fcb::SIZE), 8);
                let mtime = w.batch.read(inode.fcb.add(fcb::MTIME), 8);
                w.exec_meta()?;
                return Ok(fcb::live(attr, w.out.word(size, 0), w.out.word(mtime, 0)));
            }
        }
        Ok(attr)
    }

    /// Checks that the FCB `Open` named belongs to this inode: a mismatch means the meta
    /// server's region and this client disagree, and writing through it would corrupt another
    /// file.
    pub(crate) fn check_fcb_owner(&self, inode: &OpenInode) -> Result<(), Error> {
        let mut w = self.checkout()?;
        w.batch.clear();
        let h = w.batch.read(inode.fcb.add(fcb::INO), 8);
        w.exec_meta()?;
        let found = w.out.word(h, 0);
        if found != inode.ino {
            return Err(Error::Protocol(format!(
                "file control block at {} belongs to inode {found}, not {}",
                inode.fcb, inode.ino
            )));
        }
        Ok(())
    }
}
