//! The file control block: the per-open-file words in the meta server's registered region that
//! clients read and update one-sidedly.
//!
//! ```text
//! word 0  INO         the inode this block belongs to (0 = free); clients check it on open
//! word 1  SIZE        the file size in bytes; raised with CAS by a writer holding the range lock
//!                     that covers the new end, so every client sees the new size without an RPC
//! word 2  GENERATION  the file's data-layout generation (see `Attr::generation`); chunk-map
//!                     caches of an older generation are stale
//! word 3  MTIME       nanoseconds since the Unix epoch of the latest data change (write,
//!                     fallocate) made through this block, 0 = none since the times were last
//!                     set; raised with CAS by every writer, in the batch that reads SIZE and
//!                     GENERATION (never lowered by a client)
//! word 4  MODE        the file's permission bits (`0o7777`) as the meta server holds them,
//!                     written at open and after every change of them; writers read it in the
//!                     same batch to learn whether their write must clear the set-user-ID and
//!                     set-group-ID bits (an RPC only then)
//! word 5  BEGUN       replicated writes begun without a slot (below): a writer adds 1 (FAA),
//!                     and waits for it, before the first data verb of a change that touches a
//!                     chunk of two or more replicas, when it found no free slot
//! word 6  ENDED       such writes ended: the writer adds 1 in its range lock's release; a
//!                     client that repaired the whole file's replicas sets it to BEGUN
//! word 7              reserved, zero
//! word 8..15  SLOTS   replicated writes in flight, one a slot (0 = free): a writer claims a
//!                     free slot with a CAS from 0 to its lock's units ([`pack_slot`]), and
//!                     waits for it, before its first data verb to a chunk of two or more
//!                     replicas; it clears the slot in its range lock's release
//! ```
//!
//! A slot found set by a lock holder whose range overlaps the slot's, or BEGUN ≠ ENDED, means a
//! replicated write was cut (its writer died, or lost its lease, between its first data verb
//! and its release): a live writer's slot never overlaps another holder's range (it lies
//! inside the writer's own lock), and a live writer without a slot holds its lock until it has
//! added to ENDED. The replicas of that range (of the whole file, for the counters) may
//! differ, so the holder repairs them before it reads or writes (docs/REPLICAS.md, "A write cut
//! between replicas").
//!
//! Invariants: `SIZE` only grows through one-sided CAS under a range lock; it shrinks only
//! through the meta server's truncate, which bumps `GENERATION` first. `MTIME` only grows
//! through one-sided CAS; the meta server folds it into the database (release, fsync, clean
//! shutdown) and zeroes it when a caller sets the times (utimens), so that an older explicit
//! time is not hidden by it.
//!
//! **Where the attribute truth is.** While a file is open anywhere, its size and its data times
//! are those of the database corrected by its block: [`live`] is the one place that merges
//! them, used by the meta server (`GetAttr`, `Lookup`) and by clients (files open there), and by
//! anything that reads a block one-sidedly.

use crate::types::{Attr, Timestamp};

/// Bytes in one file control block.
pub const FCB_BYTES: u64 = 128;
/// Byte offset of the inode word.
pub const INO: u64 = 0;
/// Byte offset of the size word.
pub const SIZE: u64 = 8;
/// Byte offset of the generation word.
pub const GENERATION: u64 = 16;
/// Byte offset of the data-change time word (nanoseconds since the epoch, 0 = none).
pub const MTIME: u64 = 24;
/// Byte offset of the permission-bits word.
pub const MODE: u64 = 32;
/// Byte offset of the word counting writes to replicated chunks begun (see the module docs).
pub const BEGUN: u64 = 40;
/// Byte offset of the word counting writes to replicated chunks ended (see the module docs).
pub const ENDED: u64 = 48;
/// Byte offset of the first slot of replicated writes in flight (see the module docs).
pub const SLOTS: u64 = 64;
/// How many slots follow [`SLOTS`].
pub const SLOT_COUNT: usize = 8;
/// Bits of a slot's unit count ([`pack_slot`]); the unit start takes the others.
const SLOT_COUNT_BITS: u32 = 24;

/// A slot's value for a write under the lock of units `units` (not empty): the start in the
/// high 40 bits, the count in the low 24, never 0. `None` where that does not fit (a start at
/// or past `2^40`, or `2^24` units or more): such a write counts in BEGUN and ENDED instead.
pub fn pack_slot(units: std::ops::Range<u64>) -> Option<u64> {
    let count = units.end.checked_sub(units.start)?;
    if count == 0 || count >= 1 << SLOT_COUNT_BITS || units.start >= 1 << (64 - SLOT_COUNT_BITS) {
        return None;
    }
    Some(units.start << SLOT_COUNT_BITS | count)
}

/// The lock units a slot's value (not 0) names ([`pack_slot`]).
pub fn unpack_slot(value: u64) -> std::ops::Range<u64> {
    let start = value >> SLOT_COUNT_BITS;
    start..start + (value & ((1 << SLOT_COUNT_BITS) - 1))
}

/// The set-user-ID and set-group-ID bits of a mode.
pub const SETID_BITS: u16 = (libc::S_ISUID | libc::S_ISGID) as u16;

/// The attributes of an open file: the database's `attr` with the block's SIZE, and mtime and
/// ctime raised to its MTIME (a one-sided write changes data, so both times move).
pub fn live(mut attr: Attr, size: u64, mtime_ns: u64) -> Attr {
    attr.size = size;
    if mtime_ns != 0 {
        let t = Timestamp::from_nanos(mtime_ns);
        attr.mtime = attr.mtime.max(t);
        attr.ctime = attr.ctime.max(t);
    }
    attr
}

/// Which set-ID bits a write (or truncate) by a caller without `CAP_FSETID` clears from a
/// regular file of mode `perm`, as Linux does (`setattr_should_drop_suidgid`): set-user-ID
/// always, set-group-ID when group-execute is set (without it the bit marks mandatory locking
/// and stays). Linux also clears set-group-ID when the writer is not in the file's group; a
/// FUSE server is not told the writer's groups, so that case is not covered.
pub fn setid_to_clear(perm: u16) -> u16 {
    let mut clear = perm & libc::S_ISUID as u16;
    if perm & libc::S_ISGID as u16 != 0 && perm & libc::S_IXGRP as u16 != 0 {
        clear |= libc::S_ISGID as u16;
    }
    clear
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_pack_what_fits_and_never_zero() {
        for units in [0..1, 5..9, (1 << 40) - 1..1 << 40, 0..(1 << 24) - 1] {
            let v = pack_slot(units.clone()).unwrap();
            assert_ne!(v, 0);
            assert_eq!(unpack_slot(v), units);
        }
        assert_eq!(pack_slot(0..1 << 24), None);
        assert_eq!(pack_slot(1 << 40..(1 << 40) + 1), None);
        assert_eq!(pack_slot(3..3), None);
        assert_eq!(pack_slot(0..u64::MAX), None);
    }
}
