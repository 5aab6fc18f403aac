//! One-sided name lookups: a name resolved in the meta server's directory-entry table
//! (`proto::dentries`) and its attributes read from the attribute table (`proto::attrs`),
//! with no RPC and no meta-server CPU, whether or not the directory changed lately.
//!
//! Invariants:
//! - An answer comes only from slots that are whole (crc-sealed) and say so for sure: the entry
//!   is held by its slot (found), or its slot neither holds it nor counts others (absent) and
//!   the parent's attribute slot says it is a directory (so an absent name in a file or a
//!   removed directory goes to the RPC, which knows ENOTDIR from ENOENT). Anything else — a
//!   torn read, a slot counting others, an inode whose attribute slot another holds — is
//!   [`OneSided::Unknown`]: the caller asks the meta server.
//! - The meta server rewrites a slot after every committed change and before answering it, so a
//!   lookup that begins after a change was answered sees that change (or a newer one): never
//!   staler than an RPC issued at the same moment.

use crate::error::Error;
use crate::fcb::{live_slot_attr, read_slots};
use crate::workers::Worker;
use proto::dentries::Answer;
use proto::{Attr, FileKind, Ino};

/// What a one-sided lookup found.
#[derive(Debug)]
pub(crate) enum OneSided {
    /// The name is this inode, with these attributes.
    Found(Attr),
    /// The name does not exist.
    Absent,
    /// The tables cannot tell: ask the meta server.
    Unknown,
}

/// Looks `name` up in `parent` one-sidedly: one round trip reads the entry's slot and the
/// parent's attributes, a second the inode's attributes when found (a third, its FCB, when
/// it is open somewhere). `.` and `..` are not in the table: the caller asks the meta server.
pub(crate) fn lookup_one_sided(w: &mut Worker, parent: Ino, name: &str) -> Result<OneSided, Error> {
    let (Some(attrs), Some(entries)) = (w.view.info.attr_table, w.view.info.dentry_table) else {
        return Ok(OneSided::Unknown);
    };
    w.batch.clear();
    let entry = w.batch.read(
        entries.slot_addr(entries.slot_of(parent, name)),
        proto::dentries::SLOT_BYTES as usize,
    );
    let dir = w
        .batch
        .read(attrs.slot_addr(parent), proto::attrs::SLOT_BYTES as usize);
    w.exec_meta()?;
    let answer = proto::dentries::decode(w.out.bytes(entry))
        .map_or(Answer::Unknown, |slot| slot.answer(parent, name));
    let is_dir = proto::attrs::decode(w.out.bytes(dir), parent)
        .is_some_and(|slot| slot.attr.kind == FileKind::Dir);
    match answer {
        Answer::Found(ino) => {
            let [slot] = read_slots(w, &attrs, [ino])?;
            let Some(slot) = slot else {
                return Ok(OneSided::Unknown);
            };
            Ok(match live_slot_attr(w, &attrs, slot)? {
                Some(attr) => OneSided::Found(attr),
                None => OneSided::Unknown,
            })
        }
        Answer::Absent if is_dir => Ok(OneSided::Absent),
        Answer::Absent | Answer::Unknown => Ok(OneSided::Unknown),
    }
}
