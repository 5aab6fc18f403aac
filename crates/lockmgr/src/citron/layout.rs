//! The lock tree's shape: node bit layout, node naming and index arithmetic, and where each node
//! lives in remote memory (CITRON §3.3, §3.4, §3.9.1).
//!
//! # Nodes
//!
//! The tree is a quaternary segment tree of height `H` (levels `0..H`, the root at level 0, the
//! leaves at level `H-1`); it covers `N = 64·4^(H-1)` lock units. In level order the nodes are
//! numbered from 1 (the root), `CHILD(x, i) = 4x - 2 + i`, `PARENT(x) = (x + 2) / 4`, and level
//! `L` starts at index `(4^L + 2) / 3` ([`level_start`]).
//!
//! Inside the client a node is named by [`Node`]: its *height above the leaves* `hgt` and its
//! *position* `pos` among the nodes of that height, left to right. This name does not depend on
//! `H`: a scale-up puts the old tree in place as the leftmost subtree of the new one (§3.9.1), so
//! every old node keeps its `(hgt, pos)`, only its level-order index changes. Held locks and the
//! notifications they made therefore survive a scale-up unchanged.
//!
//! # Internal node word (64 bits, modified with masked FAA / masked CAS)
//!
//! ```text
//!  63..61  60   59 ....... 45  44 ....... 30  29 ....... 15  14 ........ 0
//! [ Exp  ][Occ][    TCnt     ][    TMax     ][    DCnt     ][    DMax     ]
//!  3 bits 1 bit   15 bits        15 bits        15 bits        15 bits
//! ```
//!
//! The masked-FAA boundary mask has the most significant bit of every field set ([`BOUNDARY`]),
//! so a carry never leaves its field: a counter wraps modulo 2^15 on its own. Counters are only
//! ever compared for equality (`TCnt == ticket`, `DCnt == DMax`) or subtracted modulo 2^15, which
//! is wrap-safe as long as fewer than 2^15 requests are outstanding on one node at once — the
//! paper's hard limit of 32767 concurrent clients (§3.4). Past it a counter pair aliases and the
//! lock is unsafe; nothing detects that (the limit is documented on [`super::CitronConfig`]).
//! `Occ` is a one-bit field: `+1` sets it and adding its all-ones value (`1 << 60`) clears it.
//!
//! `Exp` is 3 bits instead of the paper's one: it holds the *tag* of the last scale-up that
//! touched the node (0 = never). Scale-up tags cycle through `1..=6`, a scale-down marks the
//! abandoned root with [`SHRUNK_TAG`] (7). A releaser compares the tag it sees when it releases a
//! notification with the tag it saw when it made it: a different tag means a scale-up copied that
//! notification to new ancestors, and which scale-up it was (hence which ancestors) — see
//! `super::scaleup`.
//!
//! # Leaf word
//!
//! A 64-bit bitmap: bit `i` of leaf `pos` is lock unit `64·pos + i`.
//!
//! # Owner word
//!
//! Every node has a second word, its *owner record*, in a parallel array right after the nodes
//! of its [`Segment`] ([`owner_addr`]). A client that was given an identity
//! (`ClientOptions::owner`: the file system gives its meta session) writes
//! `(ticket, identity)` there ([`owner_word`]) in the batch that occupies the node, *before*
//! the masked CAS that sets `Occ` (verbs of a batch execute in posting order). A waiter that
//! finds `Occ` set with `TCnt = t` and the owner record naming ticket `t` therefore reads what
//! the holder of this very turn wrote — a record of an earlier turn names another ticket, and
//! one left by a holder whose turn was broken names a ticket that is no longer `TCnt` — so it can
//! ask whether that holder is still alive instead of waiting out the lease (`acquire`'s
//! `wait_ticket`). Leaves and the notification counters carry no owner; their recovery stays
//! the lease's.
//!
//! ```text
//!  63   62 ....... 48  47 ........................................ 0
//! [V ][   ticket     ][          identity (its low 48 bits)         ]
//! ```
//!
//! `V` set marks a record (zeroed memory holds none).
//!
//! # Share word (shared mode, `docs/SHARED_LOCKS.md`)
//!
//! Every node has a third word, its *share word*, in a second parallel array after the owner
//! records ([`share_addr`]). On an internal node it has the node word's layout, with other
//! meanings (so [`BOUNDARY`], the field accessors and the scale-up's copy code apply as is):
//!
//! ```text
//!  63..61  60   59 ....... 45  44 ....... 30  29 ....... 15  14 ........ 0
//! [ Tag  ][ 0 ][    RCnt     ][    RMax     ][    SCnt     ][    SMax     ]
//! ```
//!
//! `RMax - RCnt` readers hold the node itself (a shared acquisition registers with `RMax += 1`
//! and leaves with `RCnt += 1`); `SMax - SCnt` shared acquisitions below notified it (the
//! shared twin of `DCnt/DMax`). `Tag` is the scale-up tag, written by the same scale-up that
//! tags the node word, so a releaser learns from its own release verb whether its shared
//! notification was copied.
//!
//! A node has [`SHARE_WORDS_PER_NODE`] share words, side by side; an internal node uses the
//! first. On a leaf they count the readers of each *group* of [`LEAF_GROUP_UNITS`] units
//! ([`LeafShare`]), as counter pairs, two groups per word:
//!
//! ```text
//!  63 ........ 48  47 ........ 32  31 ........ 16  15 ......... 0
//! [  Cnt (2i+1)  ][  Max (2i+1)  ][  Cnt (2i)    ][  Max (2i)    ]   share word i
//! ```
//!
//! group `g` being units `8g..8g+8` of the leaf ([`LEAF_SHARE_BOUNDARY`]). A writer waits for
//! the readers of the groups its bits touch, so the smaller the groups, the fewer readers of
//! other units it waits for; eight groups cost a reader one masked FAA per share word it
//! touches (one for a range inside 16 units) and a writer one read of all four words.

use fabric::RemoteAddr;
use serde::{Deserialize, Serialize};

/// Bits of `DMax`.
pub const DMAX_SHIFT: u32 = 0;
/// Bits of `DCnt`.
pub const DCNT_SHIFT: u32 = 15;
/// Bits of `TMax`.
pub const TMAX_SHIFT: u32 = 30;
/// Bits of `TCnt`.
pub const TCNT_SHIFT: u32 = 45;
/// The `Occ` bit.
pub const OCC_SHIFT: u32 = 60;
/// The `Exp` tag's lowest bit.
pub const EXP_SHIFT: u32 = 61;
/// Width of every counter.
pub const COUNTER_BITS: u32 = 15;
/// All ones of one counter field (also its modulus minus one).
pub const COUNTER_MASK: u64 = (1 << COUNTER_BITS) - 1;

/// The `DMax` field in place.
pub const DMAX: u64 = COUNTER_MASK << DMAX_SHIFT;
/// The `DCnt` field in place.
pub const DCNT: u64 = COUNTER_MASK << DCNT_SHIFT;
/// The `TMax` field in place.
pub const TMAX: u64 = COUNTER_MASK << TMAX_SHIFT;
/// The `TCnt` field in place.
pub const TCNT: u64 = COUNTER_MASK << TCNT_SHIFT;
/// The `Occ` flag in place.
pub const OCC: u64 = 1 << OCC_SHIFT;
/// The `Exp` tag in place.
pub const EXP: u64 = 0b111 << EXP_SHIFT;

/// Masked-FAA boundary mask: the most significant bit of every field.
pub const BOUNDARY: u64 = (1 << 14) | (1 << 29) | (1 << 44) | (1 << 59) | (1 << 60) | (1 << 63);

/// Masked-FAA addend: take a ticket (`TMax += 1`, Alg. 2 l. 10).
pub const ADD_TMAX: u64 = 1 << TMAX_SHIFT;
/// Masked-FAA addend: set `Occ` (Alg. 2 l. 28).
pub const ADD_OCC: u64 = 1 << OCC_SHIFT;
/// Masked-FAA addend: notify (`DMax += 1`, Alg. 2 l. 31).
pub const ADD_DMAX: u64 = 1 << DMAX_SHIFT;
/// Masked-FAA addend: release a notification (`DCnt += 1`, Alg. 3 l. 9).
pub const ADD_DCNT: u64 = 1 << DCNT_SHIFT;
/// Masked-FAA addend: pass the ticket on without having occupied (`TCnt += 1`).
pub const ADD_TCNT: u64 = 1 << TCNT_SHIFT;
/// Masked-FAA addend: vacate (`Occ -= 1, TCnt += 1`, Alg. 3 l. 7). Adding the one-bit field's
/// all-ones value subtracts one.
pub const RELEASE_OCC: u64 = (1 << OCC_SHIFT) | (1 << TCNT_SHIFT);

/// Tag a scale-down writes on the root it abandons.
pub const SHRUNK_TAG: u8 = 7;
/// Scale-up tags cycle through `1..=MAX_SCALE_TAG`.
pub const MAX_SCALE_TAG: u8 = 6;

/// Tallest tree: `N = 64·4^28 = 2^62` units.
pub const MAX_HEIGHT: u32 = 29;
/// Smallest tree: a root over four leaves (the root must be internal, it carries `Exp`).
pub const MIN_HEIGHT: u32 = 2;

/// The decoded fields of an internal node word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct NodeWord {
    /// Scale-up tag (0: never expanded).
    pub exp: u8,
    /// Occupied flag.
    pub occ: bool,
    /// Ticket being served.
    pub tcnt: u16,
    /// Next ticket.
    pub tmax: u16,
    /// Released notifications from descendants.
    pub dcnt: u16,
    /// Notifications from descendants.
    pub dmax: u16,
}

impl NodeWord {
    /// Decodes a word.
    pub const fn decode(w: u64) -> Self {
        Self {
            exp: ((w & EXP) >> EXP_SHIFT) as u8,
            occ: w & OCC != 0,
            tcnt: ((w & TCNT) >> TCNT_SHIFT) as u16,
            tmax: ((w & TMAX) >> TMAX_SHIFT) as u16,
            dcnt: ((w & DCNT) >> DCNT_SHIFT) as u16,
            dmax: ((w & DMAX) >> DMAX_SHIFT) as u16,
        }
    }

    /// Encodes the fields (counters are taken modulo 2^15, the tag modulo 8).
    pub const fn encode(&self) -> u64 {
        ((self.exp as u64 & 0b111) << EXP_SHIFT)
            | ((self.occ as u64) << OCC_SHIFT)
            | ((self.tcnt as u64 & COUNTER_MASK) << TCNT_SHIFT)
            | ((self.tmax as u64 & COUNTER_MASK) << TMAX_SHIFT)
            | ((self.dcnt as u64 & COUNTER_MASK) << DCNT_SHIFT)
            | ((self.dmax as u64 & COUNTER_MASK) << DMAX_SHIFT)
    }
}

/// The `Exp` tag of a word.
pub const fn exp_tag(w: u64) -> u8 {
    ((w & EXP) >> EXP_SHIFT) as u8
}

/// `TCnt` of a word.
pub const fn tcnt(w: u64) -> u64 {
    (w & TCNT) >> TCNT_SHIFT
}

/// `TMax` of a word.
pub const fn tmax(w: u64) -> u64 {
    (w & TMAX) >> TMAX_SHIFT
}

/// `DCnt` of a word.
pub const fn dcnt(w: u64) -> u64 {
    (w & DCNT) >> DCNT_SHIFT
}

/// `DMax` of a word.
pub const fn dmax(w: u64) -> u64 {
    (w & DMAX) >> DMAX_SHIFT
}

/// Whether the word is occupied.
pub const fn occ(w: u64) -> bool {
    w & OCC != 0
}

/// `(a - b) mod 2^15`: how far counter `a` is ahead of counter `b`.
pub const fn counter_gap(a: u64, b: u64) -> u64 {
    a.wrapping_sub(b) & COUNTER_MASK
}

/// Masked-FAA addend that adds `n` to `DMax`.
pub const fn add_dmax(n: u64) -> u64 {
    (n & COUNTER_MASK) << DMAX_SHIFT
}

/// `4^e`.
pub const fn pow4(e: u32) -> u64 {
    1u64 << (2 * e)
}

/// The level-order index of the first node of level `level` (`(4^L + 2) / 3`; 1 for the root).
pub const fn level_start(level: u32) -> u64 {
    // 4^L ≡ 1 (mod 3), so ceil(4^L / 3) = (4^L + 2) / 3.
    pow4(level).div_ceil(3)
}

/// Nodes in a tree of height `h`: `(4^h - 1) / 3`.
pub const fn tree_nodes(h: u32) -> u64 {
    (pow4(h) - 1) / 3
}

/// `CHILD(x, i) = 4x - 2 + i` (§3.3).
pub const fn child(x: u64, i: u64) -> u64 {
    4 * x - 2 + i
}

/// `PARENT(x) = (x + 2) / 4` (§3.3).
pub const fn parent(x: u64) -> u64 {
    (x + 2) / 4
}

/// The level of level-order index `x` (the root is level 0).
pub fn level_of(x: u64) -> u32 {
    let mut level = 0;
    while level_start(level + 1) <= x {
        level += 1;
    }
    level
}

/// Units covered by a tree of height `h`: `64·4^(h-1)`.
pub const fn tree_units(h: u32) -> u64 {
    64 * pow4(h - 1)
}

/// The smallest height (at least [`MIN_HEIGHT`]) whose tree covers `units`, if one exists.
pub fn height_for(units: u64) -> Option<u32> {
    (MIN_HEIGHT..=MAX_HEIGHT).find(|&h| tree_units(h) >= units)
}

/// The tallest tree a lock now of height `height` may grow to when its scale-ups stop at
/// `max_units` units: the tallest height within `max_units` (where `spillover::target_height`
/// stops), or `height` itself if that is already as tall.
pub fn tallest_height(height: u32, max_units: u64) -> u32 {
    (height..=MAX_HEIGHT)
        .take_while(|&h| h == height || tree_units(h) <= max_units)
        .last()
        .unwrap_or(height)
}

/// A node of the lock tree, named independently of the tree's height (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Node {
    /// Height above the leaves (0: a leaf).
    pub hgt: u32,
    /// Position among the nodes of this height, from the left.
    pub pos: u64,
}

impl Node {
    /// The node `(hgt, pos)`.
    pub const fn new(hgt: u32, pos: u64) -> Self {
        Self { hgt, pos }
    }

    /// Whether this is a leaf (a bitmap word).
    pub const fn is_leaf(&self) -> bool {
        self.hgt == 0
    }

    /// log2 of the units the node covers.
    pub const fn span_log2(&self) -> u32 {
        6 + 2 * self.hgt
    }

    /// Units covered by the node.
    pub const fn span(&self) -> u64 {
        1 << self.span_log2()
    }

    /// First unit covered.
    pub const fn start(&self) -> u64 {
        self.pos << self.span_log2()
    }

    /// One past the last unit covered.
    pub const fn end(&self) -> u64 {
        self.start() + self.span()
    }

    /// The ancestor `d` levels up (`d = 0`: the node itself).
    pub const fn ancestor(&self, d: u32) -> Node {
        Node {
            hgt: self.hgt + d,
            pos: self.pos >> (2 * d),
        }
    }

    /// The parent.
    pub const fn parent(&self) -> Node {
        self.ancestor(1)
    }

    /// Whether `self` is `other` or one of its descendants.
    pub const fn within(&self, other: &Node) -> bool {
        self.hgt <= other.hgt && (self.pos >> (2 * (other.hgt - self.hgt))) == other.pos
    }

    /// Whether the node belongs to the tree of height `h` (the leftmost subtree of every taller
    /// tree).
    pub const fn in_tree(&self, h: u32) -> bool {
        self.hgt < h && self.pos < pow4(h - 1 - self.hgt)
    }

    /// Level in the tree of height `h` (the node must be in it).
    pub const fn level(&self, h: u32) -> u32 {
        h - 1 - self.hgt
    }

    /// Level-order index in the tree of height `h` (the node must be in it).
    pub const fn index(&self, h: u32) -> u64 {
        level_start(self.level(h)) + self.pos
    }

    /// The node with level-order index `x` in the tree of height `h`.
    pub fn from_index(x: u64, h: u32) -> Node {
        let level = level_of(x);
        Node {
            hgt: h - 1 - level,
            pos: x - level_start(level),
        }
    }

    /// The root of the tree of height `h`.
    pub const fn root(h: u32) -> Node {
        Node { hgt: h - 1, pos: 0 }
    }

    /// Bitmask of the units of `[l, r)` inside this leaf.
    pub fn leaf_mask(&self, l: u64, r: u64) -> u64 {
        let lo = l.max(self.start()) - self.start();
        let hi = r.min(self.end()).saturating_sub(self.start());
        if hi <= lo {
            return 0;
        }
        let width = hi - lo;
        let bits = if width == 64 {
            u64::MAX
        } else {
            (1u64 << width) - 1
        };
        bits << lo
    }
}

/// One stretch of remote memory holding tree nodes: the whole initial tree (`before == 0`), or
/// the nodes a scale-up from height `before` to `after` added (§3.9.1). Nodes are stored in level
/// order of the tree of height `after`, skipping the old tree's nodes: the slot of node `x` is `x`
/// minus the old nodes ahead of it in level order, minus one (slots count from 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Height of the tree before the scale-up that allocated this segment (0: the initial tree).
    pub before: u32,
    /// Height after it.
    pub after: u32,
    /// Nodes outside the tree of this height were abandoned by a scale-down and no longer map
    /// here (`cap == after` unless shrunk).
    pub cap: u32,
    /// Where slot 0 lies.
    pub addr: RemoteAddr,
}

impl Segment {
    /// Nodes the segment holds.
    pub const fn words(&self) -> u64 {
        tree_nodes(self.after) - tree_nodes(self.before)
    }

    /// Words of memory the segment takes: its nodes, their owner records and their share
    /// words ([`STORAGE_WORDS_PER_NODE`]).
    pub const fn storage_words(&self) -> u64 {
        STORAGE_WORDS_PER_NODE * self.words()
    }

    /// Whether `node` is stored here.
    pub const fn holds(&self, node: Node) -> bool {
        let top = if self.cap < self.after {
            self.cap
        } else {
            self.after
        };
        node.in_tree(top) && (self.before == 0 || !node.in_tree(self.before))
    }

    /// The slot of `node` (which must be held here).
    pub const fn slot(&self, node: Node) -> u64 {
        let x = node.index(self.after);
        let level = node.level(self.after);
        let grown = self.after - self.before;
        let ahead = if self.before == 0 || level < grown {
            0
        } else {
            // Old nodes of levels `grown..level` plus all old nodes of `level` (they lie left of
            // `node`): a full tree of height `level - grown + 1`.
            tree_nodes(level - grown + 1)
        };
        x - ahead - 1
    }
}

/// Share words per node: an internal node uses the first, a leaf all of them ([`LeafShare`]).
pub const SHARE_WORDS_PER_NODE: u64 = 4;

/// Words of storage per tree node: the node word, its owner record and its share words.
pub const STORAGE_WORDS_PER_NODE: u64 = 2 + SHARE_WORDS_PER_NODE;

/// Units of a leaf that one reader counter pair covers (a *group*; two per share word).
pub const LEAF_GROUP_UNITS: u32 = 8;

/// Masked-FAA boundary mask of a leaf's share word: four 16-bit fields.
pub const LEAF_SHARE_BOUNDARY: u64 = (1 << 15) | (1 << 31) | (1 << 47) | (1 << 63);

/// Bytes of a leaf's share words, read with one verb.
pub const LEAF_SHARE_BYTES: usize = 8 * SHARE_WORDS_PER_NODE as usize;

/// A leaf's reader counters: its [`SHARE_WORDS_PER_NODE`] share words, or an addend to them, or
/// a mask of their fields. Every pair only grows (modulo 2^16), `Max` when a reader registers,
/// `Cnt` when it leaves, so equal pairs mean no reader, and a pair that stood still means
/// nobody came or went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeafShare(pub [u64; SHARE_WORDS_PER_NODE as usize]);

/// Word `i`'s view of a leaf bitmask: its low half set when group `2i` is touched, its high
/// half when group `2i + 1` is.
const fn word_view(mask: u64, i: usize) -> u64 {
    let b = (mask >> (2 * LEAF_GROUP_UNITS as usize * i)) & 0xFFFF;
    (b & 0xFF) | ((b >> LEAF_GROUP_UNITS) << 32)
}

/// Whether a pair of share word `w` that `view` selects (a [`word_view`]) is apart: a reader.
const fn pairs_apart(w: u64, view: u64) -> bool {
    let lo = view & 0xFFFF_FFFF != 0 && (w & 0xFFFF) != ((w >> 16) & 0xFFFF);
    let hi = view >> 32 != 0 && ((w >> 32) & 0xFFFF) != ((w >> 48) & 0xFFFF);
    lo || hi
}

impl LeafShare {
    /// The addend that registers a reader of every group `mask` (a leaf bitmask) touches
    /// (`Max += 1` each).
    pub const fn register(mask: u64) -> Self {
        let mut w = [0; SHARE_WORDS_PER_NODE as usize];
        let mut i = 0;
        while i < w.len() {
            let v = word_view(mask, i);
            w[i] = (v & 0xFFFF_FFFF != 0) as u64 | (((v >> 32 != 0) as u64) << 32);
            i += 1;
        }
        Self(w)
    }

    /// The addend that deregisters what `self` (a [`LeafShare::register`]) registered
    /// (`Cnt += 1` each).
    pub const fn release(self) -> Self {
        let mut w = self.0;
        let mut i = 0;
        while i < w.len() {
            w[i] <<= 16;
            i += 1;
        }
        Self(w)
    }

    /// Whether nothing is in it (an addend that adds nothing).
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }

    /// Whether these counters show a reader of a group `mask` touches.
    pub fn readers(&self, mask: u64) -> bool {
        self.0
            .iter()
            .enumerate()
            .any(|(i, &w)| pairs_apart(w, word_view(mask, i)))
    }

    /// The share words that show a reader (a counter pair apart).
    pub fn busy_words(&self) -> impl Iterator<Item = u64> + '_ {
        self.0
            .iter()
            .copied()
            .filter(|&w| pairs_apart(w, word_view(!0, 0)))
    }

    /// The fields (both counters of each group) that `mask` touches.
    pub const fn fields(mask: u64) -> Self {
        let reg = Self::register(mask);
        let mut w = reg.0;
        let mut i = 0;
        while i < w.len() {
            w[i] = (w[i] | (w[i] << 16)) * 0xFFFF;
            i += 1;
        }
        Self(w)
    }

    /// `self` with only the fields of `fields`.
    pub fn and(&self, fields: &Self) -> Self {
        let mut w = self.0;
        for (w, f) in w.iter_mut().zip(fields.0) {
            *w &= f;
        }
        Self(w)
    }

    /// These counters with every group `mask` touches repaired: `Cnt` set to `Max` (the
    /// repair of dead readers, §3.10 for shared mode).
    pub fn repaired(&self, mask: u64) -> Self {
        let mut w = self.0;
        for (i, w) in w.iter_mut().enumerate() {
            let v = word_view(mask, i);
            if v & 0xFFFF_FFFF != 0 {
                *w = (*w & !(0xFFFF << 16)) | ((*w & 0xFFFF) << 16);
            }
            if v >> 32 != 0 {
                *w = (*w & !(0xFFFF << 48)) | (((*w >> 32) & 0xFFFF) << 48);
            }
        }
        Self(w)
    }

    /// The words and their addresses from `at` (the leaf's first share word) that are not
    /// zero: where an addend adds something, or a field mask has fields.
    pub fn nonzero(&self, at: RemoteAddr) -> impl Iterator<Item = (RemoteAddr, u64)> + '_ {
        self.0
            .iter()
            .enumerate()
            .filter(|(_, w)| **w != 0)
            .map(move |(i, w)| (at.word(i as u64), *w))
    }

    /// The counters read at `h` (a read of [`LEAF_SHARE_BYTES`]), from word `first` of it.
    pub fn read(out: &fabric::Completions, h: fabric::ReadHandle, first: usize) -> Self {
        let mut w = [0; SHARE_WORDS_PER_NODE as usize];
        for (i, w) in w.iter_mut().enumerate() {
            *w = out.word(h, first + i);
        }
        Self(w)
    }

    /// Posts the masked FAAs that add `self` (an addend) at `at`, one per word it changes;
    /// returns the first one's handle (none for an empty addend).
    pub fn post_add(
        &self,
        batch: &mut fabric::Batch,
        at: RemoteAddr,
    ) -> Option<fabric::AtomicHandle> {
        let mut first = None;
        for (a, add) in self.nonzero(at) {
            let h = batch.masked_faa(a, add, LEAF_SHARE_BOUNDARY);
            first.get_or_insert(h);
        }
        first
    }
}

/// The root's share word's flag (bit 60, unused otherwise) that every shared acquisition sets
/// before it registers: readers are in use on this lock. A writer that never saw it set reads
/// it instead of its ancestors' share words (one verb instead of one per ancestor), and a
/// scale-up carries it to the new root.
pub const READERS_SEEN: u64 = OCC;

/// Readers holding an internal node (`RMax - RCnt` of its share word).
pub const fn node_readers(share: u64) -> u64 {
    counter_gap(tmax(share), tcnt(share))
}

/// Where `node`'s (first) share word lives given the storage `segments`, if it has storage: the
/// second parallel array after the segment's nodes, [`SHARE_WORDS_PER_NODE`] words per node.
pub fn share_addr(segments: &[Segment], node: Node) -> Option<RemoteAddr> {
    segments.iter().find(|s| s.holds(node)).map(|s| {
        s.addr
            .word(2 * s.words() + SHARE_WORDS_PER_NODE * s.slot(node))
    })
}

/// The valid bit of an owner record.
pub const OWNER_VALID: u64 = 1 << 63;
/// Bits of the identity an owner record keeps.
pub const OWNER_ID_BITS: u32 = 48;
/// The identity field of an owner record.
pub const OWNER_ID: u64 = (1 << OWNER_ID_BITS) - 1;

/// The owner record of the holder of `ticket` whose identity is `owner` (its low 48 bits).
pub const fn owner_word(ticket: u64, owner: u64) -> u64 {
    OWNER_VALID | ((ticket & COUNTER_MASK) << OWNER_ID_BITS) | (owner & OWNER_ID)
}

/// The identity (low 48 bits) an owner record names for `ticket`, if it is a record of that
/// ticket.
pub const fn owner_of(record: u64, ticket: u64) -> Option<u64> {
    if record & OWNER_VALID != 0
        && (record >> OWNER_ID_BITS) & COUNTER_MASK == ticket & COUNTER_MASK
    {
        Some(record & OWNER_ID)
    } else {
        None
    }
}

/// Where `node`'s owner record lives given the storage `segments`, if it has storage: the
/// parallel array after the segment's nodes.
pub fn owner_addr(segments: &[Segment], node: Node) -> Option<RemoteAddr> {
    segments
        .iter()
        .find(|s| s.holds(node))
        .map(|s| s.addr.word(s.words() + s.slot(node)))
}

/// Where `node` lives given the storage `segments` (first holder wins), if it has storage.
pub fn node_addr(segments: &[Segment], node: Node) -> Option<RemoteAddr> {
    segments
        .iter()
        .find(|s| s.holds(node))
        .map(|s| s.addr.word(s.slot(node)))
}

/// The ancestors of `node` that Alg. 2 l. 30-31 notifies in a tree of height `h`, lowest first:
/// the parent, then every `m`-th ancestor beyond it (distances `1, 1+m, 1+2m, …`). Following
/// §3.5.5, ancestors in the top `m-1` levels are not notified (except the parent); the ancestor
/// at level `m-1` replaces them, which keeps every window of `m` consecutive levels above `node`
/// holding one notified ancestor (see `targets_cover_every_window` in the tests).
pub fn notify_targets(node: Node, h: u32, m: u32, out: &mut Vec<Node>) {
    out.clear();
    let level = node.level(h);
    if level == 0 {
        return;
    }
    out.push(node.parent());
    let mut target = level - 1;
    loop {
        if target < m {
            // The next one would land in the top `m - 1` levels (or above the root).
            break;
        }
        let next = target - m;
        if next >= m - 1 {
            out.push(node.ancestor(level - next));
            target = next;
        } else {
            // Replace the rest by the ancestor at level `m - 1` (unless already the last one).
            if target > m - 1 {
                out.push(node.ancestor(level - (m - 1)));
            }
            break;
        }
    }
}

/// Internal descendants of `node` within `m` levels (depths `0..m`), grouped by depth: for each
/// depth, the height and the range of positions (Alg. 2 l. 35).
pub fn window(node: Node, m: u32) -> impl Iterator<Item = (u32, u64, u64)> {
    (0..m)
        .take_while(move |&d| d < node.hgt)
        .map(move |d| (node.hgt - d, node.pos << (2 * d), pow4(d)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::RegionId;
    use proptest::prelude::*;

    #[test]
    fn encode_decode_fields() {
        let w = NodeWord {
            exp: 5,
            occ: true,
            tcnt: 0x7ABC,
            tmax: 0x1234,
            dcnt: 0x7FFF,
            dmax: 1,
        };
        let e = w.encode();
        assert_eq!(NodeWord::decode(e), w);
        assert_eq!(exp_tag(e), 5);
        assert_eq!(tcnt(e), 0x7ABC);
        assert!(occ(e));
    }

    #[test]
    fn owner_records() {
        let w = owner_word(0x7ABC, 0x1234_5678_9ABC_DEF0);
        assert_eq!(owner_of(w, 0x7ABC), Some(0x5678_9ABC_DEF0));
        assert_eq!(owner_of(w, 0x7ABB), None, "another turn's record");
        assert_eq!(owner_of(0, 0), None, "zeroed memory holds no record");
        assert_eq!(
            owner_of(owner_word(0x8000, 5), 0),
            Some(5),
            "tickets wrap at 2^15"
        );
    }

    #[test]
    fn masked_faa_fields_wrap_alone() {
        use fabric::atomic_ops::masked_faa_result;
        let full = NodeWord {
            exp: 0,
            occ: false,
            tcnt: 0x7FFF,
            tmax: 0x7FFF,
            dcnt: 0x7FFF,
            dmax: 0x7FFF,
        }
        .encode();
        let all = ADD_TMAX | ADD_DCNT | ADD_DMAX | ADD_TCNT;
        assert_eq!(masked_faa_result(full, all, BOUNDARY), 0);
        let occupied = masked_faa_result(0, ADD_OCC, BOUNDARY);
        assert!(occ(occupied));
        let released = masked_faa_result(occupied | (3 << EXP_SHIFT), RELEASE_OCC, BOUNDARY);
        assert!(!occ(released));
        assert_eq!(tcnt(released), 1);
        assert_eq!(exp_tag(released), 3, "no carry into Exp");
    }

    #[test]
    fn leaf_share_words() {
        use fabric::atomic_ops::masked_faa_result;
        let add = |w: LeafShare, a: LeafShare| {
            let mut out = w;
            for (o, a) in out.0.iter_mut().zip(a.0) {
                *o = masked_faa_result(*o, a, LEAF_SHARE_BOUNDARY);
            }
            out
        };
        // Units 2..4: group 0, the low pair of word 0.
        let lo = LeafShare::register(0b1100);
        assert_eq!(lo, LeafShare([1, 0, 0, 0]));
        // Units 0 and 40: groups 0 and 5 (word 2's high pair).
        let two = LeafShare::register(1 | (1 << 40));
        assert_eq!(two, LeafShare([1, 0, 1 << 32, 0]));
        assert_eq!(LeafShare::register(!0), LeafShare([1 | (1 << 32); 4]));
        // Units 7..9 straddle groups 0 and 1: one word, both pairs.
        assert_eq!(
            LeafShare::register(0b11 << 7),
            LeafShare([1 | (1 << 32), 0, 0, 0])
        );
        let w = add(LeafShare::default(), two);
        assert_eq!(w.busy_words().collect::<Vec<_>>(), vec![1, 1 << 32]);
        assert!(w.readers(1));
        assert!(w.readers(1 << 47), "unit 47 is in group 5");
        assert!(!w.readers(1 << 48), "unit 48 is in group 6");
        assert!(!w.readers(0xFF00), "group 1 has no reader");
        let w = add(w, lo.release());
        assert!(!w.readers(1));
        assert!(w.readers(1 << 41));
        assert!(!w.repaired(1 << 41).readers(1 << 41));
        assert_eq!(
            LeafShare::fields(1 << 41),
            LeafShare([0, 0, 0xFFFF_FFFF << 32, 0])
        );
        assert_eq!(
            w.and(&LeafShare::fields(1 << 41)),
            LeafShare([0, 0, 1 << 32, 0])
        );
        // Wrap: Max at 0xFFFF plus one is 0 and carries nowhere.
        let full = LeafShare([0xFFFF | (0xFFFF << 16), 0, 0, 0]);
        let w = add(full, lo);
        assert_eq!(w, LeafShare([0xFFFF << 16, 0, 0, 0]));
        assert!(w.readers(1));
        // Every unit maps to exactly one group, and a group's 8 units to the same one.
        for unit in 0..64 {
            let reg = LeafShare::register(1 << unit);
            assert_eq!(reg.0.iter().map(|w| w.count_ones()).sum::<u32>(), 1);
            assert_eq!(reg, LeafShare::register(1 << (unit / 8 * 8)));
        }
    }

    #[test]
    fn index_arithmetic_basics() {
        assert_eq!(level_start(0), 1);
        assert_eq!(level_start(1), 2);
        assert_eq!(level_start(2), 6);
        assert_eq!(level_start(3), 22);
        assert_eq!(child(1, 0), 2);
        assert_eq!(child(2, 3), 9);
        assert_eq!(parent(9), 2);
        assert_eq!(tree_units(2), 256);
        assert_eq!(height_for(1), Some(2));
        assert_eq!(height_for(257), Some(3));
        assert_eq!(height_for(u64::MAX), None);
    }

    #[test]
    fn leaf_masks() {
        let leaf = Node::new(0, 2);
        assert_eq!(leaf.leaf_mask(128, 192), u64::MAX);
        assert_eq!(leaf.leaf_mask(130, 132), 0b1100);
        assert_eq!(leaf.leaf_mask(0, 129), 1);
        assert_eq!(leaf.leaf_mask(191, 500), 1 << 63);
        assert_eq!(leaf.leaf_mask(0, 10), 0);
    }

    #[test]
    fn notify_targets_examples() {
        let mut out = Vec::new();
        // Height 10, m = 4: a leaf at level 9 notifies levels 8, 4 and then level 3 replaces 0.
        let leaf = Node::new(0, 12345);
        notify_targets(leaf, 10, 4, &mut out);
        let levels: Vec<u32> = out.iter().map(|n| n.level(10)).collect();
        assert_eq!(levels, vec![8, 4, 3]);
        // Level 3 itself: only the parent.
        notify_targets(Node::new(6, 0), 10, 4, &mut out);
        assert_eq!(out, vec![Node::new(7, 0)]);
        // Level 4: the parent is level 3; nothing more.
        notify_targets(Node::new(5, 1), 10, 4, &mut out);
        assert_eq!(out.iter().map(|n| n.level(10)).collect::<Vec<_>>(), vec![3]);
        // Level 7: parent (6), then level 2 is in the top m-1, replaced by level 3.
        notify_targets(Node::new(2, 1), 10, 4, &mut out);
        assert_eq!(
            out.iter().map(|n| n.level(10)).collect::<Vec<_>>(),
            vec![6, 3]
        );
        // The root notifies nothing.
        notify_targets(Node::root(10), 10, 4, &mut out);
        assert!(out.is_empty());
    }

    fn seg(before: u32, after: u32, offset: u64) -> Segment {
        Segment {
            before,
            after,
            cap: after,
            addr: RemoteAddr::new(RegionId(0), offset),
        }
    }

    /// Storage of a tree grown through `heights` (first = initial height): every node of the
    /// final tree has exactly one slot, slots of a segment are dense, and old nodes keep theirs.
    fn check_storage(heights: &[u32]) {
        let mut segments = Vec::new();
        let mut offset = 0u64;
        let mut before = 0;
        for &h in heights {
            let s = seg(before, h, offset);
            offset += s.storage_words() * 8;
            segments.push(s);
            before = h;
        }
        let top = *heights.last().unwrap();
        let mut seen = std::collections::HashSet::new();
        for x in 1..=tree_nodes(top) {
            let node = Node::from_index(x, top);
            assert_eq!(node.index(top), x);
            let holders: Vec<_> = segments.iter().filter(|s| s.holds(node)).collect();
            assert_eq!(holders.len(), 1, "node {node:?} held once");
            let s = holders[0];
            assert!(s.slot(node) < s.words(), "slot in range");
            assert!(seen.insert(node_addr(&segments, node).unwrap()));
            assert!(seen.insert(owner_addr(&segments, node).unwrap()));
            let share = share_addr(&segments, node).unwrap();
            for i in 0..SHARE_WORDS_PER_NODE {
                assert!(seen.insert(share.word(i)));
            }
        }
        assert_eq!(seen.len() as u64, STORAGE_WORDS_PER_NODE * tree_nodes(top));
    }

    #[test]
    fn storage_after_scale_ups() {
        check_storage(&[2]);
        check_storage(&[2, 3]);
        check_storage(&[2, 5]);
        check_storage(&[3, 4, 6]);
        check_storage(&[2, 3, 4, 5, 7]);
    }

    /// Every window of `m` consecutive levels above a node (what an ancestor there checks,
    /// Alg. 2 l. 35) contains a notified ancestor, and the first one is the parent.
    fn targets_cover_every_window(node: Node, h: u32, m: u32) {
        let mut out = Vec::new();
        notify_targets(node, h, m, &mut out);
        let level = node.level(h);
        for anc_level in 0..level {
            let lo = anc_level;
            let hi = (anc_level + m - 1).min(level - 1);
            assert!(
                out.iter()
                    .any(|t| (lo..=hi).contains(&t.level(h)) && node.within(t)),
                "node {node:?} h {h} m {m}: ancestor at level {anc_level} sees no notification ({out:?})"
            );
        }
        // No target in the top m-1 levels except the parent.
        for t in &out[1.min(out.len())..] {
            assert!(t.level(h) >= m - 1);
        }
    }

    proptest! {
        #[test]
        fn child_parent_inverse(x in 1u64..1_000_000, i in 0u64..4) {
            prop_assert_eq!(parent(child(x, i)), x);
            let h = 12;
            let node = Node::from_index(x, h);
            let c = Node::from_index(child(x, i), h);
            prop_assert_eq!(c.parent(), node);
            prop_assert_eq!(c.pos, node.pos * 4 + i);
        }

        #[test]
        fn levels_ranges(level in 0u32..20) {
            prop_assert_eq!(level_start(level + 1) - level_start(level), pow4(level));
            prop_assert_eq!(level_of(level_start(level)), level);
            prop_assert_eq!(level_of(level_start(level + 1) - 1), level);
            prop_assert_eq!(tree_nodes(level + 1), level_start(level + 1) - 1);
        }

        #[test]
        fn index_after_scale_up(h in 2u32..10, g in 1u32..5, hgt in 0u32..9, pos in 0u64..1 << 16) {
            let hgt = hgt % h;
            let pos = pos % pow4(h - 1 - hgt);
            let node = Node::new(hgt, pos);
            // In the grown tree, the old node sits at level + g, same position: the leftmost
            // subtree, and index arithmetic (CHILD/PARENT) still holds there.
            let big = h + g;
            let x = node.index(big);
            prop_assert_eq!(node.level(big), node.level(h) + g);
            prop_assert_eq!(Node::from_index(x, big), node);
            if node.level(big) > 0 {
                prop_assert_eq!(parent(x), node.parent().index(big));
            }
            if hgt > 0 {
                prop_assert_eq!(child(x, 2), Node::new(hgt - 1, pos * 4 + 2).index(big));
            }
        }

        #[test]
        fn notification_windows(h in 2u32..14, m in 1u32..7, hgt in 0u32..13, pos: u64) {
            let hgt = hgt % h;
            let node = Node::new(hgt, pos % pow4(h - 1 - hgt));
            targets_cover_every_window(node, h, m);
        }

        #[test]
        fn node_word_round_trip(raw: u64) {
            prop_assert_eq!(NodeWord::decode(raw).encode(), raw);
        }
    }
}
