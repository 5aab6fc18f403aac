//! Small helpers of the test suites.

use std::time::{Duration, Instant};

/// Polls `done` every few milliseconds (backing off to 50 ms) until it holds; panics naming
/// `what` after `timeout`. For tests: waiting on a condition instead of sleeping a guess.
pub fn wait_until(timeout: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Opens an existing file for reading and writing, panicking (a test's failure) when it cannot.
pub fn open_rw(path: &std::path::Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {} read-write: {e}", path.display()))
}

/// Sends this process's logs (`RUST_LOG`, default `warn`) to the test harness's captured
/// output, so that a failing test shows what the servers and clients said. Idempotent.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// A user buffer of `len` bytes that starts `page_offset` bytes into a page (the kernel cuts an
/// unaligned direct-I/O call differently from an aligned one, so tests try both).
pub struct UserBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl UserBuf {
    /// A zeroed buffer of `len` bytes at `page_offset` (below 4096) into a page.
    pub fn new(len: usize, page_offset: usize) -> UserBuf {
        const PAGE: usize = 4096;
        assert!(page_offset < PAGE, "a page offset is below {PAGE}");
        let storage = vec![0u8; len + 2 * PAGE];
        let aligned = storage.as_ptr().align_offset(PAGE);
        assert!(
            aligned < PAGE,
            "a Vec<u8> can be page-aligned within a page"
        );
        UserBuf {
            storage,
            start: aligned + page_offset,
            len,
        }
    }

    /// The buffer.
    pub fn get(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    /// The buffer, to fill.
    pub fn get_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// Bytes of a block of a [`tagged_record`].
pub const TAG_BLOCK: usize = 4096;

/// A self-describing record of `len` bytes: every [`TAG_BLOCK`] block is the tag
/// (`writer`, `seq`) repeated, so that a read of it shows whose write each block holds.
pub fn tagged_record(writer: u32, seq: u32, len: usize) -> Vec<u8> {
    let mut tag = [0u8; 8];
    tag[..4].copy_from_slice(&writer.to_le_bytes());
    tag[4..].copy_from_slice(&seq.to_le_bytes());
    tag.iter().copied().cycle().take(len).collect()
}

/// The (writer, seq) of every block of `buf` ([`tagged_record`]); `Err` if a block is not one
/// tag repeated (a block torn inside).
pub fn record_tags(buf: &[u8]) -> Result<Vec<(u32, u32)>, String> {
    buf.chunks(TAG_BLOCK)
        .enumerate()
        .map(|(i, b)| {
            if !b.chunks(8).all(|c| c == &b[..8]) {
                return Err(format!("block {i} is torn inside"));
            }
            Ok((
                u32::from_le_bytes(b[..4].try_into().expect("8-byte blocks")),
                u32::from_le_bytes(b[4..8].try_into().expect("8-byte blocks")),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_until_returns_once_done_and_panics_past_the_deadline() {
        let mut n = 0;
        wait_until(Duration::from_secs(5), "three polls", || {
            n += 1;
            n >= 3
        });
        assert_eq!(n, 3);
        let late = std::panic::catch_unwind(|| {
            wait_until(Duration::from_millis(20), "never", || false);
        });
        assert!(late.is_err());
    }
}
