//! The soak's verdict: replays every client's journal into what each slot of the shared file
//! and each private file may hold, then reads them all back through a fresh client.
//!
//! Rules (see `journal` for what an acknowledgement means):
//! - a slot must hold its owner's last acknowledged record, or a later record whose write was
//!   not acknowledged; an older one is a **lost acknowledged write**, a record that does not
//!   decode is **torn** — unless a write to that slot was interrupted (not acknowledged) after
//!   the last acknowledged one: a write cut short by a kill is not atomic, and is counted as
//!   *interrupted* instead;
//! - a private file must be in the state its acknowledged operations left it in, or, if its
//!   last operation was not acknowledged, in the state after it; a file in no such state is a
//!   **lost acknowledged operation** (or damage), a file nobody created is **unexpected**.

use super::client::{DIR, SHARED};
use super::journal::{decode, Entry, Op, Slot, RECORD};
use fs_client::CitronFs;
use proto::{FileKind, ROOT_INO};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// What a private file may be.
#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Absent,
    /// Exactly `len` bytes of `pattern(seed)`.
    Data {
        seed: u64,
        len: u64,
    },
    /// At most `len` bytes, each `pattern(seed)`'s or zero: a create whose write was cut
    /// short. A write is not atomic when it fails: its data verbs go to several data servers
    /// at once and the size is raised beside them, so any of its blocks may have landed and
    /// the others read zeros (fs-client's `io`, "A write that fails after its raises landed").
    Partial {
        seed: u64,
        len: u64,
    },
}

/// Counts of what the verification found.
#[derive(Debug, Default, Serialize)]
pub struct Findings {
    /// Slots of the shared file checked.
    pub slots: u64,
    /// Private files (names) checked.
    pub files: u64,
    /// Acknowledged operations in all journals, by kind.
    pub acked: BTreeMap<&'static str, u64>,
    /// Operations not acknowledged (a kill or an error cut them short).
    pub unacked: u64,
    /// Operations that returned EIO (a subset of `unacked`).
    pub eio: u64,
    /// Operations that returned another error (a subset of `unacked`).
    pub other_errors: u64,
    /// Operations acknowledged after the last restart of a server: the clients carried on.
    pub acked_after_last_server_restart: u64,
    /// Slots or files that lost an acknowledged write or operation.
    pub lost: u64,
    /// Slots holding a record that does not decode with no interrupted write to explain it.
    pub torn: u64,
    /// Slots holding a cut-short record of a write that was interrupted (allowed).
    pub interrupted: u64,
    /// Files present that no journal created.
    pub unexpected: u64,
    /// Each problem, in words.
    pub problems: Vec<String>,
}

impl Findings {
    /// Whether nothing was lost, torn or unexpected.
    pub fn clean(&self) -> bool {
        self.lost == 0 && self.torn == 0 && self.unexpected == 0
    }
}

fn kind(op: &Op) -> &'static str {
    match op {
        Op::Write { .. } => "write",
        Op::Create { .. } => "create",
        Op::Rename { .. } => "rename",
        Op::Truncate { .. } => "truncate",
        Op::Unlink { .. } => "unlink",
    }
}

/// What the journals say: per slot the last acknowledged sequence number and the sequence
/// numbers of writes never acknowledged; per file name its acceptable states.
#[derive(Default)]
struct Expected {
    acked: HashMap<u32, u64>,
    pending: HashMap<u32, BTreeSet<u64>>,
    /// Every record a journal says was (or may have been) written to each slot: the
    /// candidates a torn slot's pieces are matched against ([`describe_torn`]).
    written: HashMap<u32, BTreeSet<u64>>,
    files: BTreeMap<String, Vec<State>>,
    /// Every private file a journal says was (or may have been) created: name, seed, length —
    /// what a torn slot's foreign bytes are matched against too.
    creates: Vec<(String, u64, u64)>,
}

impl Expected {
    fn certain(&self, name: &str) -> State {
        match self.files.get(name).map(Vec::as_slice) {
            Some([one]) => one.clone(),
            _ => State::Absent,
        }
    }

    /// Replays one journal (one life of one client), whose entries are sequential; counts
    /// acknowledgements after `since` (ms since the Unix epoch).
    fn replay(&mut self, entries: &[Entry], since: u64, found: &mut Findings) {
        let mut i = 0;
        while i < entries.len() {
            let op = match &entries[i] {
                Entry::Intent(op) => op,
                Entry::Failed(_, errno) => {
                    match *errno {
                        libc::EIO => found.eio += 1,
                        _ => found.other_errors += 1,
                    }
                    i += 1;
                    continue;
                }
                Entry::Ack(..) => {
                    i += 1;
                    continue;
                }
            };
            let acked_at = match entries.get(i + 1) {
                Some(Entry::Ack(a, at)) if a == op => Some(*at),
                _ => None,
            };
            let acked = acked_at.is_some();
            if let Some(at) = acked_at {
                *found.acked.entry(kind(op)).or_default() += 1;
                if at > since {
                    found.acked_after_last_server_restart += 1;
                }
                i += 2;
            } else {
                found.unacked += 1;
                i += 1;
            }
            match op {
                Op::Write { slot, seq } => {
                    self.written.entry(*slot).or_default().insert(*seq);
                    if acked {
                        let last = self.acked.entry(*slot).or_default();
                        *last = (*last).max(*seq);
                    } else {
                        self.pending.entry(*slot).or_default().insert(*seq);
                    }
                }
                Op::Create { name, seed, len } => {
                    self.creates.push((name.clone(), *seed, *len));
                    let after = if acked {
                        vec![State::Data {
                            seed: *seed,
                            len: *len,
                        }]
                    } else {
                        vec![
                            State::Absent,
                            State::Partial {
                                seed: *seed,
                                len: *len,
                            },
                        ]
                    };
                    self.files.insert(name.clone(), after);
                }
                Op::Rename { from, to } => {
                    let moved = self.certain(from);
                    if acked {
                        self.files.insert(from.clone(), vec![State::Absent]);
                        self.files.insert(to.clone(), vec![moved]);
                    } else {
                        self.files
                            .insert(from.clone(), vec![moved.clone(), State::Absent]);
                        self.files.insert(to.clone(), vec![State::Absent, moved]);
                    }
                }
                Op::Truncate { name, len } => {
                    let before = self.certain(name);
                    let after = match &before {
                        State::Data { seed, .. } | State::Partial { seed, .. } => State::Data {
                            seed: *seed,
                            len: *len,
                        },
                        State::Absent => State::Absent,
                    };
                    let states = if acked {
                        vec![after]
                    } else {
                        vec![before, after]
                    };
                    self.files.insert(name.clone(), states);
                }
                Op::Unlink { name } => {
                    let before = self.certain(name);
                    let states = if acked {
                        vec![State::Absent]
                    } else {
                        vec![before, State::Absent]
                    };
                    self.files.insert(name.clone(), states);
                }
            }
        }
    }
}

/// Whether `data` (None: no such file) is in `state`.
fn matches(state: &State, data: Option<&[u8]>) -> bool {
    match (state, data) {
        (State::Absent, None) => true,
        (State::Data { seed, len }, Some(d)) => {
            d.len() as u64 == *len && d == cluster::pattern(*seed, 0, d.len()).as_slice()
        }
        (State::Partial { seed, len }, Some(d)) => {
            d.len() as u64 <= *len
                && d.iter()
                    .zip(cluster::pattern(*seed, 0, d.len()))
                    .all(|(&got, want)| got == want || got == 0)
        }
        _ => false,
    }
}

/// Where `data` parts from each state with contents (for a finding's message): the first and
/// last differing offsets, how many bytes differ, and whether those bytes are all zero (a
/// chunk that was never written, or zeroed) — what tells a lost chunk from a foreign write.
fn differences(states: &[State], data: &[u8]) -> String {
    let mut out = String::new();
    for state in states {
        let (State::Data { seed, .. } | State::Partial { seed, .. }) = state else {
            continue;
        };
        let expected = cluster::pattern(*seed, 0, data.len());
        let differ: Vec<usize> = (0..data.len())
            .filter(|&i| data[i] != expected[i])
            .collect();
        if let (Some(first), Some(last)) = (differ.first(), differ.last()) {
            let zeros = differ.iter().all(|&i| data[i] == 0);
            out.push_str(&format!(
                "; against seed {seed}: {} bytes differ, offsets {first}..={last}, {}",
                differ.len(),
                if zeros { "all zero" } else { "not all zero" }
            ));
        }
    }
    out
}

/// What a torn slot holds, piece by piece, for the report: each run of 4 KiB file blocks (the
/// lock unit; chunks and data servers change at such boundaries too) named by the record it
/// matches among the slot's own (records `seq` of its owner), or as zeros, or — for foreign
/// bytes — by where else they belong ([`foreign`]), or as unknown bytes; so that a failure says
/// whether a part was lost (zeros), left behind by an older write, written through a mapping
/// of another file or offset, or cut short (a read shorter than a record, e.g. a size below
/// the slot's end).
fn describe_torn(slot: u32, bytes: &[u8], expected: &Expected, clients: u32) -> String {
    const BLOCK: u64 = 4096;
    let start = u64::from(slot) * RECORD as u64;
    let owner = slot % clients.max(1);
    let records: Vec<(u64, Vec<u8>)> = expected
        .written
        .get(&slot)
        .into_iter()
        .flatten()
        .map(|&seq| (seq, super::journal::record(slot, owner, seq)))
        .collect();
    let mut pieces: Vec<(u64, u64, String)> = Vec::new();
    let mut at = start;
    let end = start + bytes.len() as u64;
    while at < end {
        let next = ((at / BLOCK + 1) * BLOCK).min(end);
        let (lo, hi) = ((at - start) as usize, (next - start) as usize);
        let piece = &bytes[lo..hi];
        let what = if piece.iter().all(|&b| b == 0) {
            "zeros".to_string()
        } else {
            records
                .iter()
                .find(|(_, r)| r.get(lo..hi) == Some(piece))
                .map(|(q, _)| format!("record {q}"))
                .or_else(|| foreign(at, piece, expected, clients))
                .unwrap_or_else(|| "unknown bytes".to_string())
        };
        match pieces.last_mut() {
            Some((_, e, w)) if *w == what => *e = next,
            _ => pieces.push((at, next, what)),
        }
        at = next;
    }
    let mut out = format!("read {} of {RECORD} bytes at {start}:", bytes.len());
    for (a, b, what) in pieces {
        out.push_str(&format!(" {a}..{b} {what};"));
    }
    out
}

/// Where foreign bytes `piece`, read at `at` in the shared file, belong, if anywhere the
/// journals know: at the same offset of another [`CHUNK`]-sized span of the shared file (one
/// chunk mapped twice: past the file's first `CHUNK` bytes, where the layout's smaller chunks
/// sit, every chunk is such a span), or at a 4 KiB-aligned offset of a private file (a block of
/// another file, reused or written through a stale location).
fn foreign(at: u64, piece: &[u8], expected: &Expected, clients: u32) -> Option<String> {
    let in_chunk = at % CHUNK;
    // Another span of the shared file, at the same offset in it.
    let slots = expected
        .written
        .keys()
        .max()
        .map_or(0, |&s| u64::from(s) + 1);
    let chunks = (slots * RECORD as u64).div_ceil(CHUNK);
    for chunk in 0..chunks {
        let there = chunk * CHUNK + in_chunk;
        let slot = (there / RECORD as u64) as u32;
        let within = (there % RECORD as u64) as usize;
        let Some(seqs) = expected.written.get(&slot) else {
            continue;
        };
        for &seq in seqs {
            let r = super::journal::record(slot, slot % clients.max(1), seq);
            let n = piece.len().min(RECORD - within);
            if there != at && r[within..within + n] == piece[..n] {
                return Some(format!("record {seq} of slot {slot} (file offset {there})"));
            }
        }
    }
    // A private file, at any 4 KiB-aligned offset.
    for (name, seed, len) in &expected.creates {
        for off in (0..*len).step_by(4096) {
            let n = piece.len().min((*len - off) as usize);
            if cluster::pattern(*seed, off, n) == piece[..n] {
                return Some(format!("file {name} at offset {off}"));
            }
        }
    }
    None
}

/// The soak's chunk size (its meta server's `--chunk-size`).
pub const CHUNK: u64 = 64 * 1024;

/// Verifies the file system `fs` against `journals` (every client life's entries); the last
/// server restart was at `last_restart` (ms since the Unix epoch).
pub fn verify(
    fs: &CitronFs,
    journals: &[Vec<Entry>],
    slots: u32,
    last_restart: u64,
) -> anyhow::Result<Findings> {
    let mut found = Findings::default();
    let mut expected = Expected::default();
    for journal in journals {
        expected.replay(journal, last_restart, &mut found);
    }
    let fail = |e: fs_client::Error| anyhow::anyhow!("verification read failed: {e}");
    let me = CitronFs::process_caller();

    // The shared file, slot by slot.
    let shared = fs.lookup(ROOT_INO, SHARED).map_err(fail)?;
    let fh = fs.open(me, shared.ino, libc::O_RDONLY).map_err(fail)?;
    for slot in 0..slots {
        found.slots += 1;
        let bytes = fs
            .read(fh, u64::from(slot) * RECORD as u64, RECORD)
            .map_err(fail)?;
        let acked = expected.acked.get(&slot).copied();
        let pending = expected.pending.get(&slot);
        let later_pending = pending.is_some_and(|p| p.iter().any(|&s| Some(s) > acked));
        let bytes = if bytes.is_empty() {
            vec![0; RECORD]
        } else {
            bytes
        };
        match decode(&bytes) {
            Slot::Empty if acked.is_none() => {}
            Slot::Empty => {
                found.lost += 1;
                found.problems.push(format!(
                    "slot {slot}: empty, but record {} was acknowledged",
                    acked.unwrap_or_default()
                ));
            }
            Slot::Whole {
                slot: s, seq: got, ..
            } if s == slot => {
                let ok = Some(got) == acked
                    || (Some(got) > acked && pending.is_some_and(|p| p.contains(&got)));
                if !ok {
                    found.lost += 1;
                    found.problems.push(format!(
                        "slot {slot}: record {got}, but {} was the last acknowledged",
                        acked.map_or("none".into(), |a| a.to_string())
                    ));
                }
            }
            Slot::Whole { slot: s, .. } => {
                found.torn += 1;
                found
                    .problems
                    .push(format!("slot {slot}: holds the record of slot {s}"));
            }
            Slot::Torn if later_pending => found.interrupted += 1,
            Slot::Torn => {
                found.torn += 1;
                // Slot s belongs to client s mod clients (`client`'s `mine`).
                let clients = slots / super::SLOTS_PER_CLIENT;
                found.problems.push(format!(
                    "slot {slot}: torn record, and no interrupted write explains it (last \
                     acknowledged: {}, not acknowledged: {:?}); {}",
                    acked.map_or("none".into(), |a| a.to_string()),
                    pending
                        .map(|p| p.iter().collect::<Vec<_>>())
                        .unwrap_or_default(),
                    describe_torn(slot, &bytes, &expected, clients)
                ));
            }
        }
    }
    let _ = fs.release(fh);

    // The private files: every name the journals know, and every name present.
    let dir = fs.lookup(ROOT_INO, DIR).map_err(fail)?.ino;
    let mut present = BTreeSet::new();
    let mut cookie = 0;
    loop {
        let entries = fs.readdir(dir, cookie, 512).map_err(fail)?;
        let Some(last) = entries.last() else { break };
        cookie = last.cookie;
        for e in entries {
            if e.name != "." && e.name != ".." && e.kind == FileKind::File {
                present.insert(e.name);
            }
        }
    }
    for (name, states) in &expected.files {
        found.files += 1;
        let data = if present.contains(name) {
            let attr = fs.lookup(dir, name).map_err(fail)?;
            let fh = fs.open(me, attr.ino, libc::O_RDONLY).map_err(fail)?;
            let data = fs.read(fh, 0, attr.size as usize).map_err(fail)?;
            let _ = fs.release(fh);
            Some(data)
        } else {
            None
        };
        if !states.iter().any(|s| matches(s, data.as_deref())) {
            found.lost += 1;
            found.problems.push(format!(
                "file {name}: {} is in none of the states {states:?}{}",
                data.as_ref()
                    .map_or("absent".to_string(), |d| format!("{} bytes", d.len())),
                data.as_deref()
                    .map(|d| differences(states, d))
                    .unwrap_or_default()
            ));
        }
    }
    for name in present {
        if !expected.files.contains_key(&name) {
            found.unexpected += 1;
            found
                .problems
                .push(format!("file {name}: present, but no journal created it"));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_slot_is_described_piece_by_piece() {
        use super::super::journal::record;
        // Slot 13 starts at 611,104: its first piece runs to the 4 KiB boundary 614,400.
        let (slot, owner) = (13, 1);
        let start = 13 * RECORD as u64;
        let mut bytes = record(slot, owner, 7);
        let boundary = (614_400 - start) as usize;
        bytes[..boundary].copy_from_slice(&record(slot, owner, 5)[..boundary]);
        // Two whole file blocks further on: one zeroed, one garbled.
        let zeroed = boundary + 4 * 4_096;
        bytes[zeroed..zeroed + 4_096].fill(0);
        bytes[zeroed + 4_096..zeroed + 8_192].fill(0xEE);
        let mut expected = Expected::default();
        expected.written.insert(slot, [5, 7].into_iter().collect());
        let said = describe_torn(slot, &bytes, &expected, 2);
        assert_eq!(
            said,
            "read 47008 of 47008 bytes at 611104: 611104..614400 record 5; 614400..630784 \
             record 7; 630784..634880 zeros; 634880..638976 unknown bytes; 638976..658112 \
             record 7;"
        );
        // A short read says so.
        let said = describe_torn(slot, &bytes[..boundary], &Expected::default(), 2);
        assert!(said.starts_with("read 3296 of 47008"), "{said}");
    }

    #[test]
    fn foreign_bytes_are_traced_to_the_file_or_chunk_they_belong_to() {
        use super::super::journal::record;
        // Slot 29 (client 1 of 2) holds, in its block at 1,368,064 (offset 57,344 of the 64 KiB
        // span 20), bytes of private file "c0.0.3" at 8,192; in the next block, the bytes found
        // at the same place of span 3 (offset 57,344 + 3 × 64 KiB = 253,952: slot 5, record 4).
        let slot = 29;
        let start = slot as usize * RECORD;
        let mut bytes = vec![0u8; RECORD];
        let a = 1_368_064 - start;
        bytes[a..a + 4096].copy_from_slice(&cluster::pattern(99, 8192, 4096));
        let in_slot5 = 253_952 + 4096 - 5 * RECORD;
        bytes[a + 4096..a + 8192].copy_from_slice(&record(5, 1, 4)[in_slot5..in_slot5 + 4096]);
        let mut expected = Expected::default();
        expected.creates.push(("c0.0.3".into(), 99, 20_000));
        expected.written.insert(5, [4].into_iter().collect());
        let said = describe_torn(slot, &bytes, &expected, 2);
        assert!(
            said.contains("1368064..1372160 file c0.0.3 at offset 8192;"),
            "{said}"
        );
        assert!(
            said.contains("1372160..1376256 record 4 of slot 5 (file offset 258048);"),
            "{said}"
        );
    }

    #[test]
    fn a_finding_says_where_and_what_the_bytes_differ() {
        let mut data = cluster::pattern(5, 0, 100);
        data[10..20].fill(0);
        let states = [State::Absent, State::Data { seed: 5, len: 100 }];
        let said = differences(&states, &data);
        assert!(
            said.contains("10 bytes differ, offsets 10..=19, all zero"),
            "{said}"
        );
        data[50] ^= 0xff;
        assert!(
            differences(&states, &data).contains("11 bytes differ, offsets 10..=50, not all zero")
        );
        assert_eq!(differences(&states, &cluster::pattern(5, 0, 100)), "");
    }

    fn op_w(slot: u32, seq: u64) -> Op {
        Op::Write { slot, seq }
    }

    #[test]
    fn replay_pairs_intents_with_acknowledgements() {
        let mut found = Findings::default();
        let mut e = Expected::default();
        let create = Op::Create {
            name: "f".into(),
            seed: 1,
            len: 10,
        };
        let trunc = Op::Truncate {
            name: "f".into(),
            len: 4,
        };
        e.replay(
            &[
                Entry::Intent(op_w(3, 1)),
                Entry::Ack(op_w(3, 1), 10),
                Entry::Intent(op_w(3, 2)),
                Entry::Failed(op_w(3, 2), libc::EIO),
                Entry::Intent(create.clone()),
                Entry::Ack(create, 30),
                Entry::Intent(trunc.clone()),
                Entry::Failed(trunc, libc::ENOSPC),
            ],
            20,
            &mut found,
        );
        assert_eq!(e.acked[&3], 1);
        assert!(e.pending[&3].contains(&2));
        assert_eq!(found.unacked, 2);
        assert_eq!((found.eio, found.other_errors), (1, 1));
        assert_eq!(found.acked_after_last_server_restart, 1);
        assert_eq!(
            e.files["f"],
            vec![
                State::Data { seed: 1, len: 10 },
                State::Data { seed: 1, len: 4 }
            ]
        );
        assert!(matches(&e.files["f"][1], Some(&cluster::pattern(1, 0, 4))));
        assert!(!matches(&e.files["f"][1], Some(&cluster::pattern(2, 0, 4))));
        assert!(!matches(&e.files["f"][1], None));
        // An interrupted create: any of its blocks may have landed, the rest read zeros.
        let partial = State::Partial { seed: 1, len: 10 };
        let mut d = cluster::pattern(1, 0, 10);
        d[2..6].fill(0);
        assert!(matches(&partial, Some(&d)));
        assert!(matches(&partial, Some(&d[..4])));
        d[7] = d[7].wrapping_add(1).max(1);
        assert!(!matches(&partial, Some(&d)), "a foreign byte");
        assert!(
            !matches(&partial, Some(&cluster::pattern(1, 0, 11))),
            "too long"
        );
    }
}
