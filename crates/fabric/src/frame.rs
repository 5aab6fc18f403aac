//! Length-prefixed, crc32-checked frames: the framing of every TCP protocol in CitronFS (the
//! fabric's software NIC, the lock server baseline, the meta server's RPC).
//!
//! A frame is `[len: u32 LE][crc32(body): u32 LE][body: len bytes]`. `len` is checked against the
//! reader's limit *before* anything is allocated, so a hostile length cannot exhaust memory.

use std::io::{self, Read, Write};
use thiserror::Error;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 8;

/// Why a frame could not be read.
#[derive(Debug, Error)]
pub enum FrameError {
    /// The connection failed or closed (cleanly, if `kind` is `UnexpectedEof` at a boundary).
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The peer declared a frame larger than this reader accepts. The stream cannot be
    /// resynchronised without reading the body, so the connection should be closed.
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Declared length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The body's checksum does not match. The body was consumed, so the stream is still in sync
    /// and the connection may continue.
    #[error("frame checksum mismatch (expected {expected:#010x}, got {actual:#010x})")]
    BadChecksum {
        /// The checksum in the header.
        expected: u32,
        /// The checksum of the body received.
        actual: u32,
    },
}

/// Writes one frame holding `body`.
pub fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame body over 4 GiB"))?;
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&len.to_le_bytes());
    header[4..].copy_from_slice(&crc32fast::hash(body).to_le_bytes());
    w.write_all(&header)?;
    w.write_all(body)
}

/// Encodes a frame header for `body` (for writers that gather header and body themselves).
pub fn header_for(body: &[u8]) -> [u8; HEADER_LEN] {
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&(body.len() as u32).to_le_bytes());
    header[4..].copy_from_slice(&crc32fast::hash(body).to_le_bytes());
    header
}

/// Reads one frame into `body` (resized to fit), accepting bodies of at most `max` bytes.
pub fn read_frame(r: &mut impl Read, max: usize, body: &mut Vec<u8>) -> Result<(), FrameError> {
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header)?;
    decode_body(r, &header, max, body)
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Body length in bytes (already checked against the reader's limit).
    pub len: usize,
    /// crc32 of the body.
    pub crc: u32,
}

/// Decodes a header and checks the declared length against `max`, before anything is allocated.
/// Every frame reader, blocking or async, goes through this and [`check_body`].
pub fn parse_header(header: &[u8; HEADER_LEN], max: usize) -> Result<FrameHeader, FrameError> {
    let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(header[4..].try_into().expect("4 bytes"));
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok(FrameHeader { len, crc })
}

/// Checks a body read for `header`: complete, and matching its checksum.
pub fn check_body(header: &FrameHeader, body: &[u8]) -> Result<(), FrameError> {
    if body.len() != header.len {
        return Err(FrameError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "frame body cut short: {} of {} bytes",
                body.len(),
                header.len
            ),
        )));
    }
    let actual = crc32fast::hash(body);
    if actual != header.crc {
        return Err(FrameError::BadChecksum {
            expected: header.crc,
            actual,
        });
    }
    Ok(())
}

/// Reads the body of a frame whose header has already been read.
pub fn decode_body(
    r: &mut impl Read,
    header: &[u8; HEADER_LEN],
    max: usize,
    body: &mut Vec<u8>,
) -> Result<(), FrameError> {
    let header = parse_header(header, max)?;
    // Grow the buffer only as bytes arrive: a peer that declares a large frame and then stalls
    // costs no more memory than it has actually sent.
    body.clear();
    r.take(header.len as u64).read_to_end(body)?;
    check_body(&header, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_checksum_and_limit() {
        let mut wire = Vec::new();
        write_frame(&mut wire, b"abc").unwrap();
        let mut body = Vec::new();
        read_frame(&mut &wire[..], 16, &mut body).unwrap();
        assert_eq!(body, b"abc");

        assert!(matches!(
            read_frame(&mut &wire[..], 2, &mut body),
            Err(FrameError::TooLarge { len: 3, max: 2 })
        ));
        let mut corrupt = wire.clone();
        corrupt[HEADER_LEN] ^= 0xFF;
        assert!(matches!(
            read_frame(&mut &corrupt[..], 16, &mut body),
            Err(FrameError::BadChecksum { .. })
        ));
        assert!(matches!(
            read_frame(&mut &wire[..5], 16, &mut body),
            Err(FrameError::Io(_))
        ));
    }
}
