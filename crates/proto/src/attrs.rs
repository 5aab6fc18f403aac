//! The attribute table: inode attributes published by the meta server in its registered
//! region, so that clients read them one-sidedly (the Cell paper: reads by the client,
//! writes by the server) and a stat costs neither an RPC nor meta-server CPU.
//!
//! ```text
//! base + slot · SLOT_BYTES   one slot per `ino % slots` (direct-mapped), SLOT_BYTES each:
//!                            a `fabric::record` (crc32 + length) sealing a postcard `AttrSlot`
//! ```
//!
//! Invariants (kept by the meta server, which alone writes slots):
//! - A slot names its inode: a reader that finds another inode there (a collision), an empty
//!   slot, or a record whose checksum does not hold (a read that tore against a rewrite, seed
//!   003's "crc-protected variable-length data elements") falls back to the RPC. No answer
//!   ever comes from a slot that is not whole and of the inode asked for.
//! - A slot is rewritten, under the meta server's state lock, after every committed change of
//!   its inode and before the change is answered; a deleted inode's slot is cleared. So a
//!   one-sided read that begins after a change was answered sees it (or something newer).
//! - `version` grows with every rewrite of any slot during one meta-server run and starts
//!   above every version of an earlier run (the clock), so an equal version means the same
//!   contents.
//! - For a file open on some client (`fcb != 0`), the size in `attr` may lag: the truth is the
//!   SIZE word of the file control block at `fcb` (see [`crate::fcb`]), whose INO word must
//!   name the inode (else the file was closed meanwhile: fall back).

use crate::types::{Attr, Ino};
use fabric::RemoteAddr;
use serde::{Deserialize, Serialize};

/// Bytes of one slot (three cache lines: room for the largest encoding of an [`AttrSlot`]).
pub const SLOT_BYTES: u64 = 192;

/// Where the table lives, as `ClusterInfo` tells clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttrTableRef {
    /// The first slot.
    pub base: RemoteAddr,
    /// Slots in the table (at least 1).
    pub slots: u64,
}

impl AttrTableRef {
    /// The address of the slot `ino` maps to.
    pub fn slot_addr(&self, ino: Ino) -> RemoteAddr {
        self.base.add((ino % self.slots.max(1)) * SLOT_BYTES)
    }
}

/// What one slot holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttrSlot {
    /// Bumped at every rewrite (see the module docs).
    pub version: u64,
    /// The file control block's offset in the meta region while the file is open on some
    /// client (0: not open).
    pub fcb: u64,
    /// The attributes as committed (for an open file, the size may lag: see `fcb`).
    pub attr: Attr,
}

/// The sealed bytes of `slot`, or `None` if they would not fit a slot.
pub fn encode(slot: &AttrSlot) -> Option<Vec<u8>> {
    seal_slot(slot, SLOT_BYTES)
}

/// The slot in `bytes` if it is whole and of inode `ino`; `None` sends the reader to the RPC.
pub fn decode(bytes: &[u8], ino: Ino) -> Option<AttrSlot> {
    let slot: AttrSlot = open_slot(bytes)?;
    (slot.attr.ino == ino).then_some(slot)
}

/// `value` in postcard, sealed as a `fabric::record` and padded to `slot_bytes`; `None` if it
/// would not fit. The one encoding of the one-sided tables' slots (this one and
/// [`crate::dentries`]).
///
/// One allocation, the slot: the value is encoded straight into it and sealed where it lies
/// (a create publishes a slot for the file and one for its directory, a release one more, so a
/// growing encode buffer and a second copy for the seal showed in the meta server's profile).
pub(crate) fn seal_slot<T: Serialize>(value: &T, slot_bytes: u64) -> Option<Vec<u8>> {
    let mut slot = vec![0u8; usize::try_from(slot_bytes).ok()?];
    let payload_len = postcard::to_slice(value, slot.get_mut(fabric::record::HEADER..)?)
        .ok()?
        .len();
    fabric::record::seal_in_place(&mut slot, payload_len);
    Some(slot)
}

/// The value a slot sealed by [`seal_slot`] holds, or `None`: torn, never written (an empty
/// payload), or not a `T`.
pub(crate) fn open_slot<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    let payload = fabric::record::open(bytes).ok()?;
    if payload.is_empty() {
        return None;
    }
    postcard::from_bytes(payload).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{FileKind, Timestamp};

    fn attr(ino: Ino) -> Attr {
        let t = Timestamp {
            secs: i64::MIN,
            nanos: 999_999_999,
        };
        Attr {
            ino,
            kind: FileKind::File,
            perm: 0o7777,
            nlink: u32::MAX,
            uid: u32::MAX,
            gid: u32::MAX,
            rdev: u32::MAX,
            size: u64::MAX,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            generation: u64::MAX,
            allocated: u64::MAX,
        }
    }

    #[test]
    fn the_largest_slot_fits_and_round_trips() {
        let slot = AttrSlot {
            version: u64::MAX,
            fcb: u64::MAX,
            attr: attr(u64::MAX),
        };
        let bytes = encode(&slot).expect("fits");
        assert_eq!(bytes.len() as u64, SLOT_BYTES);
        assert_eq!(decode(&bytes, u64::MAX), Some(slot));
    }

    #[test]
    fn torn_empty_and_foreign_slots_are_refused() {
        let slot = AttrSlot {
            version: 7,
            fcb: 0,
            attr: attr(42),
        };
        let bytes = encode(&slot).unwrap();
        assert_eq!(decode(&bytes, 43), None, "another inode's slot");
        assert_eq!(decode(&[0u8; SLOT_BYTES as usize], 42), None, "empty");
        // Half of a rewrite: the first words of another version, the rest of this one.
        let newer = encode(&AttrSlot {
            version: 8,
            fcb: 64,
            attr: attr(42),
        })
        .unwrap();
        for cut in (8..SLOT_BYTES as usize).step_by(8) {
            let mut torn = bytes.clone();
            torn[..cut].copy_from_slice(&newer[..cut]);
            let got = decode(&torn, 42);
            assert!(
                got.is_none()
                    || got.as_ref() == Some(&slot)
                    || got.as_ref().map(|s| s.version) == Some(8),
                "a torn read at {cut} decoded as {got:?}"
            );
            if got.is_some() {
                // Only a cut that changed nothing of the payload may decode.
                assert!(
                    torn == bytes || torn == newer,
                    "a torn read at {cut} was accepted"
                );
            }
        }
    }
}
