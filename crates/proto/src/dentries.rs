//! The directory-entry table: every directory entry of the namespace published by the meta
//! server in its registered region, so that a client resolves a name — found or not — with
//! one-sided reads (the Cell paper), and `lookup` costs neither an RPC nor meta-server CPU
//! even right after the directory changed.
//!
//! ```text
//! base + slot · SLOT_BYTES   one slot per `hash(parent, name) % slots` (direct-mapped),
//!                            SLOT_BYTES each: a `fabric::record` (crc32 + length) sealing a
//!                            postcard `DentrySlot`
//! ```
//!
//! A slot *holds* the entries hashed to it that fit (parent, name and inode of each: a dozen
//! short names) and *counts* the others: the live entries that hash to it but are not held
//! there (the slot was full, or a name too long). So the table answers both ways:
//! - the slot holds `(parent, name)`: the name is that inode;
//! - the slot does not hold it and counts no others: the name does not exist;
//! - otherwise the table cannot tell, and the reader asks the meta server.
//!
//! Invariants (kept by the meta server, which alone writes slots):
//! - Every slot is written (sealed) before the table is handed to any client: it is filled
//!   from the database at start, under the state lock, and an unsealed or torn slot (the Cell paper's
//!   "crc-protected variable-length data elements") sends the reader to the RPC.
//! - Every entry of the database is held by its slot or counted there, exactly once. The server
//!   applies each committed change of an entry (added, removed) to the table in commit order,
//!   under its state lock, before the change is answered; so a one-sided read that begins after
//!   a change was answered sees it (or something newer).
//! - `.` and `..` are not entries: they are resolved by the RPC.

use crate::types::Ino;
use fabric::RemoteAddr;
use serde::{Deserialize, Serialize};

/// Bytes of one slot (four cache lines: a dozen short names, or one of up to 230 bytes).
pub const SLOT_BYTES: u64 = 256;

/// Where the table lives, as `ClusterInfo` tells clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DentryTableRef {
    /// The first slot.
    pub base: RemoteAddr,
    /// Slots in the table (at least 1).
    pub slots: u64,
}

impl DentryTableRef {
    /// The index of the slot `(parent, name)` maps to.
    pub fn slot_of(&self, parent: Ino, name: &str) -> u64 {
        hash(parent, name) % self.slots.max(1)
    }

    /// The address of slot `slot`.
    pub fn slot_addr(&self, slot: u64) -> RemoteAddr {
        self.base.add(slot * SLOT_BYTES)
    }
}

/// FNV-1a (64 bits) of the parent's number and the name: the one hash servers and clients
/// share. Not collision-resistant against a chosen name, and need not be: a collision only
/// sends lookups of the names involved to the RPC.
pub fn hash(parent: Ino, name: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    for &b in parent.to_le_bytes().iter().chain(name.as_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(PRIME);
    }
    h
}

/// The entry a slot holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldEntry {
    /// The directory.
    pub parent: Ino,
    /// The name in it.
    pub name: String,
    /// The inode it names.
    pub ino: Ino,
}

/// What one slot holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DentrySlot {
    /// The entries held here.
    pub held: Vec<HeldEntry>,
    /// Live entries that hash here and are not held here.
    pub others: u64,
}

/// What the table says of one name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The name is this inode.
    Found(Ino),
    /// The name does not exist.
    Absent,
    /// The table cannot tell: ask the meta server.
    Unknown,
}

impl DentrySlot {
    /// What this slot says of `(parent, name)`.
    pub fn answer(&self, parent: Ino, name: &str) -> Answer {
        match self.position(parent, name) {
            Some(i) => Answer::Found(self.held[i].ino),
            None if self.others == 0 => Answer::Absent,
            None => Answer::Unknown,
        }
    }

    /// Where `(parent, name)` is in `held`.
    pub fn position(&self, parent: Ino, name: &str) -> Option<usize> {
        self.held
            .iter()
            .position(|e| e.parent == parent && e.name == name)
    }
}

/// The sealed bytes of `slot`, or `None` if they would not fit a slot.
pub fn encode(slot: &DentrySlot) -> Option<Vec<u8>> {
    crate::attrs::seal_slot(slot, SLOT_BYTES)
}

/// The slot in `bytes` if it is whole and sealed; `None` (torn, never written) sends the
/// reader to the RPC.
pub fn decode(bytes: &[u8]) -> Option<DentrySlot> {
    crate::attrs::open_slot(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(name: &str, others: u64) -> DentrySlot {
        DentrySlot {
            held: vec![HeldEntry {
                parent: 7,
                name: name.into(),
                ino: 99,
            }],
            others,
        }
    }

    #[test]
    fn answers_found_absent_and_unknown() {
        assert_eq!(slot("a", 3).answer(7, "a"), Answer::Found(99));
        assert_eq!(slot("a", 0).answer(7, "b"), Answer::Absent);
        assert_eq!(slot("a", 0).answer(8, "a"), Answer::Absent);
        assert_eq!(slot("a", 1).answer(7, "b"), Answer::Unknown);
        assert_eq!(DentrySlot::default().answer(7, "a"), Answer::Absent);
        let counted = DentrySlot {
            held: Vec::new(),
            others: 2,
        };
        assert_eq!(counted.answer(7, "a"), Answer::Unknown);
    }

    #[test]
    fn slots_round_trip_and_long_names_do_not_fit() {
        let s = DentrySlot {
            held: vec![HeldEntry {
                parent: u64::MAX,
                name: "n".repeat(200),
                ino: u64::MAX,
            }],
            others: u64::MAX,
        };
        let bytes = encode(&s).expect("a 200-byte name fits");
        assert_eq!(bytes.len() as u64, SLOT_BYTES);
        assert_eq!(decode(&bytes), Some(s));
        assert_eq!(encode(&slot(&"n".repeat(255), 0)), None);
        let many = DentrySlot {
            held: (0..10)
                .map(|i| HeldEntry {
                    parent: 1 << 20,
                    name: format!("file-{i:05}"),
                    ino: 1 << 30,
                })
                .collect(),
            others: 0,
        };
        assert!(encode(&many).is_some(), "ten short names fit one slot");
        assert_eq!(decode(&[0u8; SLOT_BYTES as usize]), None, "never written");
    }

    #[test]
    fn torn_slots_are_refused() {
        let old = encode(&slot("old", 0)).unwrap();
        let new = encode(&slot("newer-name", 5)).unwrap();
        for cut in (8..SLOT_BYTES as usize).step_by(8) {
            let mut torn = old.clone();
            torn[..cut].copy_from_slice(&new[..cut]);
            if let Some(got) = decode(&torn) {
                assert!(
                    got == slot("old", 0) || got == slot("newer-name", 5),
                    "a torn read at {cut} decoded as {got:?}"
                );
            }
        }
    }

    #[test]
    fn the_hash_spreads_names_and_parents() {
        let table = DentryTableRef {
            base: RemoteAddr::new(fabric::RegionId(0), 0),
            slots: 1 << 16,
        };
        let mut seen = std::collections::HashSet::new();
        for i in 0..1000 {
            seen.insert(table.slot_of(1, &format!("f{i}")));
            seen.insert(table.slot_of(i + 2, "same"));
        }
        assert!(seen.len() > 1950, "{} distinct slots of 2000", seen.len());
    }
}
