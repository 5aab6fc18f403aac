//! One-sided access to an open file's control block (FCB, `proto::fcb`): its INO, SIZE and
//! GENERATION words in the meta region.
//!
//! Invariants:
//! - SIZE is the truth about a file's size while it is open anywhere: writers of every client
//!   raise it one-sidedly, and only upward, with a CAS ([`Inner::raise_size`]) while they hold
//!   the range lock of their write; the meta server persists it on release, fsync and truncate.
//!   Attributes of an open file therefore take their size from here ([`Inner::fresh_size`]).
//! - Each word is read atomically; SIZE and GENERATION are read in one round trip but are two
//!   words, so a reader that needs them consistent holds the range lock that a truncate would
//!   need (every read and write does).
//! - The FCB an `Open` names must carry the inode's number ([`Inner::check_fcb_owner`]):
//!   writing through another file's FCB would corrupt it.

use crate::client::Inner;
use crate::error::{Error, Peer};
use crate::handles::OpenInode;
use crate::workers::Worker;
use fabric::{Batch, Completions};
use proto::{fcb, Attr, FileKind};

impl Inner {
    /// Reads SIZE and GENERATION from the FCB (two word reads in one round trip: each word is
    /// read atomically).
    pub(crate) fn read_fcb(&self, w: &mut Worker, inode: &OpenInode) -> Result<(u64, u64), Error> {
        let Worker {
            meta_ep,
            batch,
            out,
            broken,
            ..
        } = w;
        batch.clear();
        let size = batch.read(inode.fcb.add(fcb::SIZE), 8);
        let generation = batch.read(inode.fcb.add(fcb::GENERATION), 8);
        if let Err(e) = meta_ep.execute(batch, out) {
            *broken = true;
            return Err(Error::fabric(Peer::Meta)(e));
        }
        Ok((out.word(size, 0), out.word(generation, 0)))
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
            if let Err(e) = w.meta_ep.execute(&w.batch, &mut w.out) {
                w.broken = true;
                return Err(Error::fabric(Peer::Meta)(e));
            }
            let old = w.out.old(h);
            if old == seen {
                break;
            }
            seen = old;
        }
        Ok(())
    }

    /// For a file open here, replaces the size with the FCB's (the truth, updated one-sidedly
    /// by writers of every client).
    pub(crate) fn fresh_size(&self, mut attr: Attr) -> Result<Attr, Error> {
        if attr.kind == FileKind::File {
            if let Some(inode) = self.open_entry(attr.ino) {
                let mut w = self.checkout()?;
                let inode = self.live_inode(&inode, &w.view)?;
                attr.size = self.read_fcb(&mut w, &inode)?.0;
            }
        }
        Ok(attr)
    }

    /// Checks that the FCB `Open` named belongs to this inode: a mismatch means the meta
    /// server's region and this client disagree, and writing through it would corrupt another
    /// file.
    pub(crate) fn check_fcb_owner(&self, inode: &OpenInode) -> Result<(), Error> {
        let mut w = self.checkout()?;
        let mut batch = Batch::new();
        let h = batch.read(inode.fcb.add(fcb::INO), 8);
        let mut out = Completions::new();
        if let Err(e) = w.meta_ep.execute(&batch, &mut out) {
            w.broken = true;
            return Err(Error::fabric(Peer::Meta)(e));
        }
        let found = out.word(h, 0);
        if found != inode.ino {
            return Err(Error::Protocol(format!(
                "file control block at {} belongs to inode {found}, not {}",
                inode.fcb, inode.ino
            )));
        }
        Ok(())
    }
}
