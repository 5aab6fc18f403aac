//! What a soak client did, written down as it goes so that a client killed at any moment has
//! left a true account: the shared file's self-describing records, and the journal of intents
//! and acknowledgements the verifier replays.
//!
//! Invariant (what "acknowledged" means): a client writes `I <op>` before it starts an
//! operation and `A <op>` only after the operation *and an fsync after it* returned, so an
//! acknowledged operation is durable by the file system's promise (docs/RELIABILITY.md: an
//! fsync persists the file's size and flushes the whole namespace). An intent without its
//! acknowledgement may or may not have happened, in part for a write.

use std::fmt;
use std::io::Write;
use std::path::Path;

/// Bytes of one record of the shared file: the IOR hard-write size, so that records straddle
/// lock units (4 KiB), chunks and data servers.
pub const RECORD: usize = 47008;

const MAGIC: u64 = u64::from_le_bytes(*b"CFSSOAK1");
const HEADER: usize = 32;

/// The record client `client` writes at `slot` with sequence number `seq`: a header (magic,
/// slot, client, seq, crc32 of everything else) and a payload that differs per (client, seq).
pub fn record(slot: u32, client: u32, seq: u64) -> Vec<u8> {
    let mut r = vec![0u8; RECORD];
    r[..8].copy_from_slice(&MAGIC.to_le_bytes());
    r[8..12].copy_from_slice(&slot.to_le_bytes());
    r[12..16].copy_from_slice(&client.to_le_bytes());
    r[16..24].copy_from_slice(&seq.to_le_bytes());
    let payload = cluster::pattern(seq ^ (u64::from(client) << 48), 0, RECORD - HEADER);
    r[HEADER..].copy_from_slice(&payload);
    let crc = crc(&r);
    r[24..28].copy_from_slice(&crc.to_le_bytes());
    r
}

fn crc(r: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&r[..24]);
    h.update(&r[28..]);
    h.finalize()
}

/// What a slot of the shared file holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Slot {
    /// Never written: all zeros.
    Empty,
    /// A whole record.
    Whole {
        /// Its slot field.
        slot: u32,
        /// Its writer.
        client: u32,
        /// Its sequence number.
        seq: u64,
    },
    /// Anything else: a mix of writes, or damage.
    Torn,
}

/// Decodes a slot's bytes (short reads count as torn).
pub fn decode(bytes: &[u8]) -> Slot {
    if bytes.len() != RECORD {
        return Slot::Torn;
    }
    if bytes.iter().all(|&b| b == 0) {
        return Slot::Empty;
    }
    let word = |a: usize| u64::from_le_bytes(bytes[a..a + 8].try_into().expect("8 bytes"));
    let half = |a: usize| u32::from_le_bytes(bytes[a..a + 4].try_into().expect("4 bytes"));
    if word(0) != MAGIC || half(24) != crc(bytes) {
        return Slot::Torn;
    }
    Slot::Whole {
        slot: half(8),
        client: half(12),
        seq: word(16),
    }
}

/// One operation of a soak client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Record `seq` written to slot `slot` of the shared file.
    Write {
        /// The slot.
        slot: u32,
        /// The record's sequence number.
        seq: u64,
    },
    /// A private file created with `len` bytes of `cluster::pattern(seed, 0, len)`.
    Create {
        /// Its name in the soak directory.
        name: String,
        /// The pattern's seed.
        seed: u64,
        /// Its length.
        len: u64,
    },
    /// A private file renamed.
    Rename {
        /// The old name.
        from: String,
        /// The new name.
        to: String,
    },
    /// A private file truncated to `len`.
    Truncate {
        /// Its name.
        name: String,
        /// The new length.
        len: u64,
    },
    /// A private file removed.
    Unlink {
        /// Its name.
        name: String,
    },
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Write { slot, seq } => write!(f, "W {slot} {seq}"),
            Op::Create { name, seed, len } => write!(f, "C {name} {seed} {len}"),
            Op::Rename { from, to } => write!(f, "R {from} {to}"),
            Op::Truncate { name, len } => write!(f, "T {name} {len}"),
            Op::Unlink { name } => write!(f, "U {name}"),
        }
    }
}

impl Op {
    fn parse(words: &[&str]) -> Option<Op> {
        Some(match words {
            ["W", slot, seq] => Op::Write {
                slot: slot.parse().ok()?,
                seq: seq.parse().ok()?,
            },
            ["C", name, seed, len] => Op::Create {
                name: name.to_string(),
                seed: seed.parse().ok()?,
                len: len.parse().ok()?,
            },
            ["R", from, to] => Op::Rename {
                from: from.to_string(),
                to: to.to_string(),
            },
            ["T", name, len] => Op::Truncate {
                name: name.to_string(),
                len: len.parse().ok()?,
            },
            ["U", name] => Op::Unlink {
                name: name.to_string(),
            },
            _ => return None,
        })
    }
}

/// A journal entry: an intent, an acknowledgement or a failure of an operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// About to start the operation.
    Intent(Op),
    /// The operation and an fsync after it returned, at `at` (ms since the Unix epoch).
    Ack(Op, u64),
    /// The operation (or the fsync after it) failed with this errno; it stays unacknowledged.
    Failed(Op, i32),
}

/// Now, in ms since the Unix epoch (the clock of acknowledgements and of the soak's kills).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The journal a client appends to (one line per entry, one `write` per line).
pub struct Journal(std::fs::File);

impl Journal {
    /// Creates (or appends to) the journal at `path`.
    pub fn create(path: &Path) -> std::io::Result<Journal> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map(Journal)
    }

    /// Appends `entry` (it is in the file when this returns: no user-space buffer).
    pub fn log(&mut self, entry: &Entry) -> std::io::Result<()> {
        let line = match entry {
            Entry::Intent(op) => format!("I {op}\n"),
            Entry::Ack(op, at) => format!("A {op} @{at}\n"),
            Entry::Failed(op, errno) => format!("F {op} !{errno}\n"),
        };
        self.0.write_all(line.as_bytes())
    }
}

/// Reads a journal; a malformed line (the last one, cut by a kill) is skipped.
pub fn read(path: &Path) -> std::io::Result<Vec<Entry>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.split_first() {
                Some((&"I", rest)) => Op::parse(rest).map(Entry::Intent),
                Some((&"A", rest)) => {
                    let (at, op) = rest.split_last()?;
                    let at = at.strip_prefix('@')?.parse().ok()?;
                    Op::parse(op).map(|op| Entry::Ack(op, at))
                }
                Some((&"F", rest)) => {
                    let (errno, op) = rest.split_last()?;
                    let errno = errno.strip_prefix('!')?.parse().ok()?;
                    Op::parse(op).map(|op| Entry::Failed(op, errno))
                }
                _ => None,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_decode_and_damage_is_caught() {
        let r = record(7, 2, 99);
        assert_eq!(
            decode(&r),
            Slot::Whole {
                slot: 7,
                client: 2,
                seq: 99
            }
        );
        assert_eq!(decode(&vec![0; RECORD]), Slot::Empty);
        // Half of one write and half of another: torn.
        let other = record(7, 2, 100);
        let mut mixed = r.clone();
        mixed[RECORD / 2..].copy_from_slice(&other[RECORD / 2..]);
        assert_eq!(decode(&mixed), Slot::Torn);
        // A record cut short by zeros (a write interrupted mid-way): torn.
        let mut cut = r;
        cut[40_000..].fill(0);
        assert_eq!(decode(&cut), Slot::Torn);
    }

    #[test]
    fn journal_round_trips_and_skips_a_cut_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let ops = [
            Op::Write {
                slot: 3,
                seq: 1 << 33,
            },
            Op::Create {
                name: "c0.1.2".into(),
                seed: 5,
                len: 4096,
            },
            Op::Rename {
                from: "a".into(),
                to: "b".into(),
            },
            Op::Truncate {
                name: "b".into(),
                len: 10,
            },
            Op::Unlink { name: "b".into() },
        ];
        let mut j = Journal::create(&path).unwrap();
        for op in &ops {
            j.log(&Entry::Intent(op.clone())).unwrap();
            j.log(&Entry::Ack(op.clone(), 1234)).unwrap();
        }
        j.log(&Entry::Intent(ops[0].clone())).unwrap();
        j.log(&Entry::Failed(ops[0].clone(), libc::EIO)).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"I W 4")
            .unwrap();
        let entries = read(&path).unwrap();
        assert_eq!(entries.len(), 2 * ops.len() + 2);
        assert_eq!(
            entries[2 * ops.len() + 1],
            Entry::Failed(ops[0].clone(), libc::EIO)
        );
        for (i, op) in ops.iter().enumerate() {
            assert_eq!(entries[2 * i], Entry::Intent(op.clone()));
            assert_eq!(entries[2 * i + 1], Entry::Ack(op.clone(), 1234));
        }
    }
}
