//! Copies of whole words between a region and a caller's buffer: the inner loop of every READ
//! and WRITE verb ([`crate::region::Region`]).
//!
//! # Why not a plain word loop for every size
//! A region is touched only through `AtomicU64` words (each aligned word is loaded or stored
//! whole, never torn), and a loop of 8-byte atomic loads or stores is what the compiler makes of
//! that: it never merges them into wider moves. For a bulk copy that loop is much slower than a
//! `memcpy`: measured on the 2-core development VM (a throwaway loop copying 1 MiB at a time
//! through a 512 MiB array of words, so that the region side is cold), 1 MiB out of the words
//! took 113–128 µs word by word against 76–88 µs with `rep movsq`, and 1 MiB into them 192–217 µs
//! against 88–93 µs (the loop's 8-byte stores each read the destination line for ownership;
//! the string move's fast path does not). A 1 MiB read or write through a mount spends most of
//! its time in this copy (a 1 MiB read measured at 0.57× the FUSE ceiling on 16 cores).
//!
//! # Why `rep movsq` keeps the words whole
//! On x86-64, `rep movsq` moves quadwords. Between an 8-byte-aligned source and an 8-byte-aligned
//! destination, each quadword element is a naturally aligned 8-byte access on both sides, and the
//! processor's fast-string path only ever widens such accesses (to whole cache lines); it never
//! splits an aligned quadword. So every region word is read or written whole, as by the word
//! loop — the guarantee the design gives for verbs ("atomics are linearizable per word, ...
//! reads of more than 8 bytes may tear"). The fast path is taken only when both sides are
//! aligned; otherwise the word loop runs.
//!
//! What a string move does *not* keep is the order of its own element accesses (Intel SDM
//! vol. 3, §9.2.4, "fast-string operation and out-of-order stores"). A verb's words were never
//! ordered among themselves (an RNIC writes a payload in any order either); but the verbs of a
//! batch execute in posting order, and a later verb (a lock release, a check word) must not be
//! seen before this copy. A full fence after the move restores that order. `tests` check the
//! whole-word property under concurrent stores.
//!
//! Because the move is inline assembly, the compiler treats it as opaque memory access, not as
//! non-atomic Rust loads and stores racing with other threads' atomics.
//!
//! Below [`BULK_MIN_BYTES`] the word loop is as fast (a string move has a start-up cost) and is
//! what lock words, records and check words keep using.

use std::sync::atomic::{AtomicU64, Ordering};

/// Whole-word copies of at least this many bytes go through the string move (x86-64 only).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const BULK_MIN_BYTES: usize = 512;

/// Whether a copy to or from `buffer` (the side that is not a region's, whose words are
/// aligned anyway) takes the string move (x86-64 only): long enough and 8-byte aligned.
#[cfg(target_arch = "x86_64")]
#[inline]
fn takes_string_move(buffer: &[u8]) -> bool {
    buffer.len() >= BULK_MIN_BYTES && (buffer.as_ptr() as usize) % 8 == 0
}

/// Copies `out.len() / 8` words starting at `src` into `out`, each word loaded whole.
///
/// # Safety
/// `src` must point to `out.len() / 8` valid, aligned, live `AtomicU64` words; `out.len()` must
/// be a multiple of 8.
#[inline]
pub(crate) unsafe fn load_words(src: *const AtomicU64, out: &mut [u8]) {
    debug_assert!(out.len() % 8 == 0);
    #[cfg(target_arch = "x86_64")]
    if takes_string_move(out) {
        let words = out.len() / 8;
        // SAFETY: both ranges are valid for `words` quadwords (the caller's contract and
        // `out`'s length), 8-byte aligned (checked above; `AtomicU64`'s alignment), and do not
        // overlap (`out` is an exclusive borrow of memory that is not a region's).
        unsafe { move_quadwords(src.cast::<u64>(), out.as_mut_ptr().cast::<u64>(), words) };
        return;
    }
    for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
        // SAFETY: `i < out.len() / 8`, within the caller's valid range.
        let word = unsafe { &*src.add(i) };
        chunk.copy_from_slice(&word.load(Ordering::Acquire).to_le_bytes());
    }
}

/// Copies `data` (a multiple of 8 bytes) into the words starting at `dst`, each word stored
/// whole.
///
/// # Safety
/// `dst` must point to `data.len() / 8` valid, aligned, live `AtomicU64` words; `data.len()`
/// must be a multiple of 8.
#[inline]
pub(crate) unsafe fn store_words(dst: *const AtomicU64, data: &[u8]) {
    debug_assert!(data.len() % 8 == 0);
    #[cfg(target_arch = "x86_64")]
    if takes_string_move(data) {
        let words = data.len() / 8;
        // SAFETY: as in `load_words`, with the roles swapped: `dst` is the region's words
        // (written through shared `AtomicU64`s, which permit mutation), `data` a buffer that is
        // not a region's.
        unsafe { move_quadwords(data.as_ptr().cast::<u64>(), dst as *mut u64, words) };
        return;
    }
    for (i, chunk) in data.chunks_exact(8).enumerate() {
        let value = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        // SAFETY: `i < data.len() / 8`, within the caller's valid range.
        let word = unsafe { &*dst.add(i) };
        word.store(value, Ordering::Release);
    }
}

/// `rep movsq`: `words` quadwords from `src` to `dst`, then a full fence (module docs).
///
/// # Safety
/// Both ranges valid for `words` quadwords, 8-byte aligned, not overlapping.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn move_quadwords(src: *const u64, dst: *mut u64, words: usize) {
    // SAFETY: the caller's contract; the direction flag is clear at every Rust call boundary
    // (System V ABI), so the move runs forward.
    unsafe {
        std::arch::asm!(
            "rep movsq",
            inout("rcx") words => _,
            inout("rsi") src => _,
            inout("rdi") dst => _,
            options(nostack, preserves_flags),
        );
    }
    std::sync::atomic::fence(Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn words(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(0)).collect()
    }

    /// Every length on both sides of the bulk threshold, and a misaligned buffer (the word
    /// loop's path), copy exactly their words both ways.
    #[test]
    fn copies_match_the_word_loop_at_every_size_and_alignment() {
        let threshold = BULK_MIN_BYTES / 8;
        for len_words in [0, 1, 7, threshold - 1, threshold, threshold + 1, 1000, 4096] {
            for skew in [0usize, 1, 3, 8] {
                let region = words(len_words);
                let mut backing = vec![0u8; len_words * 8 + 16];
                let data = &mut backing[skew..skew + len_words * 8];
                for (i, b) in data.iter_mut().enumerate() {
                    *b = (i as u8).wrapping_mul(31) ^ 0xA5;
                }
                let expected = data.to_vec();
                // SAFETY: `region` holds `len_words` words.
                unsafe { store_words(region.as_ptr(), data) };
                for (i, w) in region.iter().enumerate() {
                    let word = u64::from_le_bytes(expected[i * 8..][..8].try_into().unwrap());
                    assert_eq!(
                        w.load(Ordering::Relaxed),
                        word,
                        "word {i}, {len_words} words, skew {skew}"
                    );
                }
                let mut back = vec![0u8; len_words * 8 + 16];
                let out = &mut back[skew..skew + len_words * 8];
                // SAFETY: as above.
                unsafe { load_words(region.as_ptr(), out) };
                assert_eq!(out, &expected[..], "{len_words} words, skew {skew}");
            }
        }
    }

    /// Bulk loads racing with stores of whole words never see a torn word: every word
    /// read is one some store wrote (all eight bytes alike), for as long as the race runs.
    /// The stores alternate between the word loop and the bulk path, so torn bulk stores
    /// would show too.
    #[test]
    fn racing_bulk_copies_never_tear_a_word() {
        const WORDS: usize = 1 << 12;
        let region: Arc<Vec<AtomicU64>> = Arc::new(words(WORDS));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let region = region.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut round = 0u64;
                let mut data = vec![0u8; WORDS * 8];
                while !stop.load(Ordering::Relaxed) {
                    round = round.wrapping_add(1);
                    let byte = (round % 251) as u8;
                    // Half the rounds word by word, half through the bulk path.
                    if round % 2 == 0 {
                        for w in region.iter() {
                            w.store(u64::from_ne_bytes([byte; 8]), Ordering::Release);
                        }
                    } else {
                        data.fill(byte);
                        // SAFETY: `region` holds `WORDS` words.
                        unsafe { store_words(region.as_ptr(), &data) };
                    }
                }
            })
        };
        let mut out = vec![0u64; WORDS];
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(300);
        let mut reads = 0u64;
        while std::time::Instant::now() < deadline || reads < 50 {
            // SAFETY: `out` is `WORDS` u64s, so its bytes are 8-aligned and a multiple of 8;
            // `region` holds `WORDS` words.
            let bytes =
                unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), WORDS * 8) };
            // SAFETY: as above.
            unsafe { load_words(region.as_ptr(), bytes) };
            for (i, word) in out.iter().enumerate() {
                let b = word.to_ne_bytes();
                assert!(b.iter().all(|&x| x == b[0]), "word {i} torn: {b:?}");
            }
            reads += 1;
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
    }
}
