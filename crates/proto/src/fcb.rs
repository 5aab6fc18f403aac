//! The file control block: the per-open-file words in the meta server's registered region that
//! clients read and update one-sidedly.
//!
//! ```text
//! word 0  INO         the inode this block belongs to (0 = free); clients check it on open
//! word 1  SIZE        the file size in bytes; raised with CAS by a writer holding the range lock
//!                     that covers the new end, so every client sees the new size without an RPC
//! word 2  GENERATION  the file's data-layout generation (see `Attr::generation`); chunk-map
//!                     caches of an older generation are stale
//! word 3..8           reserved, zero
//! ```
//!
//! Invariant: `SIZE` only grows through one-sided CAS under a range lock; it shrinks only through
//! the meta server's truncate, which bumps `GENERATION` first.

/// Bytes in one file control block.
pub const FCB_BYTES: u64 = 64;
/// Byte offset of the inode word.
pub const INO: u64 = 0;
/// Byte offset of the size word.
pub const SIZE: u64 = 8;
/// Byte offset of the generation word.
pub const GENERATION: u64 = 16;
