//! Registered memory regions and the verb executor that runs batches against them.
//!
//! A [`Region`] is a block of 8-byte-aligned memory: anonymous heap memory (the `mem` backend),
//! or a file mapped `MAP_SHARED` (the `shm` backend, and what a `tcp` server serves). All access
//! goes through `AtomicU64` words, because any byte of a region may be written concurrently by
//! other threads and processes: atomics are linearizable per word, plain word stores are atomic,
//! and only reads or writes spanning several words may tear, exactly as with an RNIC.

use crate::addr::{RegionId, RemoteAddr};
use crate::atomic_ops::{masked_cas_matches, masked_cas_result, masked_faa_result};
use crate::batch::{Batch, Completions, Verb};
use crate::error::VerbError;
use crate::word_copy;
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Atomics are sequentially consistent: the lock protocol's proof relies on the server executing
/// all atomics "as if in a global order" (CITRON §3.5.5).
const ATOMIC: Ordering = Ordering::SeqCst;

/// A registered region of memory, shared by everyone who holds it.
pub struct Region {
    id: RegionId,
    words: *const AtomicU64,
    len: u64,
    /// Whether the memory is a mapping of a file (flushes `msync` it) or plain memory.
    mapped: bool,
    /// Keeps the memory behind `words` alive (a `Box<[AtomicU64]>` or a memory map).
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: `words` points into memory owned by `_owner`, which is `Send + Sync` and lives as long
// as the region; all access to that memory goes through `AtomicU64`, which is `Sync`.
unsafe impl Send for Region {}
// SAFETY: as above; shared access only ever uses atomic operations.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}

impl Region {
    /// A zeroed anonymous region of `len` bytes (rounded up to whole words).
    pub fn anonymous(id: RegionId, len: u64) -> Self {
        let words = len.div_ceil(8) as usize;
        let memory: Box<[AtomicU64]> = (0..words).map(|_| AtomicU64::new(0)).collect();
        let ptr = memory.as_ptr();
        Self {
            id,
            words: ptr,
            len: words as u64 * 8,
            mapped: false,
            _owner: Box::new(memory),
        }
    }

    /// A region over memory owned by `owner`, starting at `ptr` and `len` bytes long.
    ///
    /// # Safety
    /// `ptr` must be 8-byte aligned and valid for reads and writes of `len` bytes for as long as
    /// `owner` lives; `owner` must not move or free that memory; every other user of it must
    /// only access it atomically (other processes mapping the same file included); and it must be
    /// a page-aligned `mmap` of a file, since [`Verb::Flush`] `msync`s it.
    pub unsafe fn from_raw(
        id: RegionId,
        ptr: *mut u8,
        len: u64,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        assert_eq!(ptr as usize % 8, 0, "region memory must be 8-byte aligned");
        Self {
            id,
            words: ptr as *const AtomicU64,
            len: len / 8 * 8,
            mapped: true,
            _owner: owner,
        }
    }

    /// The first byte of the region's memory, for registering it with an RDMA device (which
    /// then reads and writes it; every other access is atomic).
    #[cfg(feature = "rdma")]
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.words as *mut u8
    }

    /// The region's id.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// The region's size in bytes (a multiple of 8).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The word at byte offset `offset`. The caller has checked bounds and alignment.
    #[inline]
    fn word(&self, offset: u64) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= self.len);
        // SAFETY: `offset` is aligned and in bounds (checked by `check` before execution), and the
        // memory lives as long as `self` (see the type's invariant).
        unsafe { &*self.words.add((offset / 8) as usize) }
    }

    /// A pointer to the word at byte offset `offset` and those after it, for copies of many
    /// words (a reference to one word covers that word only). The caller has checked alignment
    /// and bounds before using it.
    #[inline]
    fn words_at(&self, offset: u64) -> *const AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset <= self.len);
        self.words.wrapping_add((offset / 8) as usize)
    }

    /// Checks that `verb` (the `index`-th of its batch) fits this region.
    pub fn check(&self, index: usize, verb: &Verb) -> Result<(), VerbError> {
        let addr = verb.addr();
        let span = verb.span();
        if verb.is_atomic() && addr.offset % 8 != 0 {
            return Err(VerbError::Misaligned { index, addr });
        }
        match addr.offset.checked_add(span) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(VerbError::OutOfBounds {
                index,
                addr,
                len: span,
                region_len: self.len,
            }),
        }
    }

    /// Copies `out.len()` bytes starting at `offset` out of the region, each word loaded whole
    /// (so a read never tears a word another thread stores). The caller has checked bounds.
    ///
    /// The whole words in the middle go through [`word_copy::load_words`] (a string move for
    /// bulk copies); only a partial word at either end is taken apart: the general partial-word
    /// copy costs a `memmove` call per word, which made reads two to three times slower than
    /// writes (`bench fs --fs library`, 1 MiB sequential).
    fn read_into(&self, offset: u64, out: &mut [u8]) {
        let mut pos = offset;
        let mut done = 0;
        // A partial word at the start.
        if pos % 8 != 0 && !out.is_empty() {
            let word_start = pos & !7;
            let skip = (pos - word_start) as usize;
            let take = (8 - skip).min(out.len());
            let bytes = self.word(word_start).load(Ordering::Acquire).to_le_bytes();
            out[..take].copy_from_slice(&bytes[skip..skip + take]);
            done = take;
            pos += take as u64;
        }
        // Whole words (`pos` is aligned here unless `out` is used up).
        let whole = (out.len() - done) / 8 * 8;
        if whole > 0 {
            // SAFETY: `pos` is aligned and `pos + whole` in bounds (the caller checked the
            // verb's span), so `whole / 8` words from `pos` are the region's.
            unsafe { word_copy::load_words(self.words_at(pos), &mut out[done..done + whole]) };
            pos += whole as u64;
        }
        done += whole;
        // A partial word at the end.
        if done < out.len() {
            let take = out.len() - done;
            let bytes = self.word(pos).load(Ordering::Acquire).to_le_bytes();
            out[done..].copy_from_slice(&bytes[..take]);
        }
    }

    /// Copies `data` into the region at `offset`. Whole words are stored; a partial word at either
    /// end is merged with a CAS loop so that a concurrent atomic on its other bytes is never lost.
    /// The caller has checked bounds.
    fn write_from(&self, offset: u64, data: &[u8]) {
        let mut pos = offset;
        let mut done = 0;
        // A partial word at the start.
        if pos % 8 != 0 && !data.is_empty() {
            let word_start = pos & !7;
            let skip = (pos - word_start) as usize;
            let take = (8 - skip).min(data.len());
            self.merge_into_word(word_start, skip, &data[..take]);
            done = take;
            pos += take as u64;
        }
        // Whole words, each stored whole (`pos` is aligned here unless `data` is used up).
        let whole = (data.len() - done) / 8 * 8;
        if whole > 0 {
            // SAFETY: as in `read_into`: `whole / 8` words from the aligned `pos` are in bounds.
            unsafe { word_copy::store_words(self.words_at(pos), &data[done..done + whole]) };
            pos += whole as u64;
        }
        done += whole;
        // A partial word at the end.
        if done < data.len() {
            self.merge_into_word(pos, 0, &data[done..]);
        }
    }

    /// Stores `bytes` at byte `skip` of the word at `word_start` with a CAS loop, so that a
    /// concurrent atomic on the word's other bytes is never lost.
    fn merge_into_word(&self, word_start: u64, skip: usize, bytes: &[u8]) {
        let _ = self.word(word_start).fetch_update(ATOMIC, ATOMIC, |old| {
            let mut word = old.to_le_bytes();
            word[skip..skip + bytes.len()].copy_from_slice(bytes);
            Some(u64::from_le_bytes(word))
        });
    }

    /// Makes `[offset, offset + len)` durable: `msync(MS_SYNC)` of the pages covering it on a
    /// mapped region, nothing on plain memory. The caller has checked bounds.
    fn flush(&self, offset: u64, len: u64) -> std::io::Result<()> {
        if !self.mapped || len == 0 {
            return Ok(());
        }
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        let start = offset / page * page;
        let end = (offset + len).min(self.len);
        // SAFETY: [start, end) lies inside this mapping (bounds checked, the mapping starts on
        // a page boundary), and msync only writes dirty pages back; it does not touch memory.
        let rc = unsafe {
            libc::msync(
                (self.words as *mut u8).add(start as usize).cast(),
                (end - start) as usize,
                libc::MS_SYNC,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Executes one atomic verb on an aligned, in-bounds word and returns the old value.
    fn atomic(&self, verb: &Verb) -> u64 {
        match *verb {
            Verb::Cas { addr, expect, swap } => {
                match self
                    .word(addr.offset)
                    .compare_exchange(expect, swap, ATOMIC, ATOMIC)
                {
                    Ok(old) | Err(old) => old,
                }
            }
            Verb::Faa { addr, add } => self.word(addr.offset).fetch_add(add, ATOMIC),
            Verb::MaskedCas {
                addr,
                cmp,
                cmp_mask,
                swap,
                swap_mask,
            } => {
                // `fetch_update` returns Err(old) when the closure declines: the compare failed.
                match self.word(addr.offset).fetch_update(ATOMIC, ATOMIC, |old| {
                    masked_cas_matches(old, cmp, cmp_mask)
                        .then(|| masked_cas_result(old, swap, swap_mask))
                }) {
                    Ok(old) | Err(old) => old,
                }
            }
            Verb::MaskedFaa {
                addr,
                add,
                boundary_mask,
            } => match self.word(addr.offset).fetch_update(ATOMIC, ATOMIC, |old| {
                Some(masked_faa_result(old, add, boundary_mask))
            }) {
                Ok(old) | Err(old) => old,
            },
            Verb::Read { .. } | Verb::Write { .. } | Verb::Flush { .. } => {
                unreachable!("not an atomic verb")
            }
        }
    }
}

/// The regions an executor can reach, indexed by region id.
///
/// Endpoints keep one of these as a cache in front of a slower, shared lookup, so that the post
/// path takes no lock (SMART: per-thread endpoints, nothing shared on the post path).
#[derive(Clone, Debug, Default)]
pub struct RegionTable {
    slots: Vec<Option<Arc<Region>>>,
}

impl RegionTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The region with this id, if present.
    #[inline]
    pub fn get(&self, id: RegionId) -> Option<&Arc<Region>> {
        self.slots.get(id.0 as usize).and_then(Option::as_ref)
    }

    /// Adds or replaces a region.
    pub fn insert(&mut self, region: Arc<Region>) {
        let index = region.id().0 as usize;
        if self.slots.len() <= index {
            self.slots.resize(index + 1, None);
        }
        self.slots[index] = Some(region);
    }

    /// Removes a region.
    pub fn remove(&mut self, id: RegionId) -> Option<Arc<Region>> {
        self.slots.get_mut(id.0 as usize).and_then(Option::take)
    }

    /// All present regions.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Region>> {
        self.slots.iter().flatten()
    }

    /// Makes sure every region `batch` names is in the table, fetching missing ones with
    /// `resolve`. Ids that `resolve` cannot find stay missing; [`RegionTable::check`] reports them.
    pub fn fill_from(
        &mut self,
        batch: &Batch,
        mut resolve: impl FnMut(RegionId) -> Option<Arc<Region>>,
    ) {
        for verb in batch.verbs() {
            let id = verb.addr().region;
            if self.get(id).is_none() {
                if let Some(region) = resolve(id) {
                    self.insert(region);
                }
            }
        }
    }

    /// Checks every verb of `batch` against the table: region known, in bounds, aligned.
    pub fn check(&self, batch: &Batch) -> Result<(), VerbError> {
        for (index, verb) in batch.verbs().iter().enumerate() {
            let region = verb.addr().region;
            self.get(region)
                .ok_or(VerbError::UnknownRegion { index, region })?
                .check(index, verb)?;
        }
        Ok(())
    }

    /// Checks `batch`, then executes all of its verbs in posting order, filling `out`.
    ///
    /// Nothing executes unless every verb is valid. Two errors are found while running: a
    /// failed flush ([`VerbError::FlushFailed`]), reported after the whole batch has run, and
    /// the batch's expiry ([`VerbError::Expired`]), which stops it before the verb it names. The batch's shape (payload length) is an
    /// invariant of [`Batch`]; batches decoded from the network must pass
    /// [`Batch::check_shape`] first.
    pub fn execute(&self, batch: &Batch, out: &mut Completions) -> Result<(), VerbError> {
        self.check(batch)?;
        out.reset_for(batch);
        let mut payload = batch.payload();
        let mut failed = None;
        let expires = batch.expires();
        for (index, verb) in batch.verbs().iter().enumerate() {
            // An expired batch stops before its next verb: nothing of it lands after the
            // instant (a lock holder's lease deadline, `Batch::expire_at`).
            if expires.is_some_and(|t| std::time::Instant::now() >= t) {
                return Err(VerbError::Expired { index });
            }
            let region = self.get(verb.addr().region).expect("checked above");
            match *verb {
                Verb::Read { addr, len } => {
                    region.read_into(addr.offset, out.next_read(batch, len as usize))
                }
                Verb::Write { addr, len } => {
                    let (data, rest) = payload.split_at(len as usize);
                    region.write_from(addr.offset, data);
                    payload = rest;
                }
                Verb::Flush { addr, len } => {
                    if let Err(e) = region.flush(addr.offset, len) {
                        failed.get_or_insert(VerbError::FlushFailed {
                            index,
                            addr,
                            reason: e.to_string(),
                        });
                    }
                }
                ref atomic => out.push_old(region.atomic(atomic)),
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

/// Stores `value` in the word at `addr` directly (for servers initializing their own regions);
/// `None` if `addr` is not an aligned word inside the region.
pub fn store_word(region: &Region, addr: RemoteAddr, value: u64) -> Option<()> {
    region
        .check(0, &Verb::Faa { addr, add: 0 })
        .ok()
        .map(|()| region.word(addr.offset).store(value, ATOMIC))
}

/// Reads the word at `addr` directly (for servers inspecting their own regions).
pub fn load_word(region: &Region, addr: RemoteAddr) -> Option<u64> {
    region
        .check(0, &Verb::Faa { addr, add: 0 })
        .ok()
        .map(|()| region.word(addr.offset).load(ATOMIC))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (offset, length) near word boundaries writes exactly its bytes and leaves the
    /// bytes around it alone.
    #[test]
    fn writes_at_every_offset_and_length_touch_only_their_bytes() {
        for offset in 0..24u64 {
            for len in 0..=40usize {
                let region = Region::anonymous(RegionId(1), 64);
                let background = vec![0xC3u8; 64];
                region.write_from(0, &background);
                let data: Vec<u8> = (0..len as u8).map(|i| i.wrapping_add(1)).collect();
                region.write_from(offset, &data);
                let mut expected = background.clone();
                expected[offset as usize..offset as usize + len].copy_from_slice(&data);
                let mut out = vec![0u8; 64];
                region.read_into(0, &mut out);
                assert_eq!(out, expected, "offset {offset}, length {len}");
            }
        }
    }

    /// Every (offset, length) near word boundaries reads exactly the bytes written: the split
    /// into a head, whole words and a tail loses or shifts nothing.
    #[test]
    fn reads_at_every_offset_and_length_match_what_was_written() {
        let region = Region::anonymous(RegionId(1), 64);
        let pattern: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
        region.write_from(0, &pattern);
        for offset in 0..24u64 {
            for len in 0..=(64 - offset as usize).min(40) {
                let mut out = vec![0xEEu8; len];
                region.read_into(offset, &mut out);
                assert_eq!(
                    out,
                    &pattern[offset as usize..offset as usize + len],
                    "offset {offset}, length {len}"
                );
            }
        }
    }
}
