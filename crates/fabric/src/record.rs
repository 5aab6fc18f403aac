//! Checksummed multi-word records.
//!
//! A read of more than 8 bytes may tear: it can see half of a concurrent rewrite. Records that are
//! read one-sidedly therefore carry a crc32 of their contents; a reader that finds a mismatch knows
//! the read tore and reads again (LOCO, Cell).
//!
//! Layout: `[crc32 of payload: u32 LE][payload length: u32 LE][payload][zero padding to 8]`.

use thiserror::Error;

/// Bytes a sealed record adds in front of its payload.
pub const HEADER: usize = 8;

/// A record whose checksum does not match: the read tore (or the memory is garbage).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("torn or corrupt record")]
pub struct Torn;

/// The size of a sealed record holding `payload_len` bytes.
pub const fn sealed_len(payload_len: usize) -> usize {
    (HEADER + payload_len).div_ceil(8) * 8
}

/// Seals `payload` into a record of [`sealed_len`] bytes.
pub fn seal(payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; sealed_len(payload.len())];
    out[HEADER..HEADER + payload.len()].copy_from_slice(payload);
    seal_in_place(&mut out, payload.len());
    out
}

/// Seals, where it lies, the payload already written at `record[HEADER..HEADER + payload_len]`:
/// writes the header in front of it (the one place the header is written; [`seal`] is this on
/// a buffer of its own). With `record` zeroed beyond the payload, the bytes are those of
/// [`seal`] padded further with zeros: what a writer of fixed-size slots uses to encode a value
/// straight into its slot.
///
/// # Panics
/// If the payload does not fit in `record` (a caller's bug).
pub fn seal_in_place(record: &mut [u8], payload_len: usize) {
    let crc = crc32fast::hash(&record[HEADER..HEADER + payload_len]);
    record[0..4].copy_from_slice(&crc.to_le_bytes());
    record[4..8].copy_from_slice(&(payload_len as u32).to_le_bytes());
}

/// The payload of a sealed record, or [`Torn`] if its checksum or length does not hold.
pub fn open(record: &[u8]) -> Result<&[u8], Torn> {
    if record.len() < HEADER {
        return Err(Torn);
    }
    let crc = u32::from_le_bytes(record[0..4].try_into().expect("4 bytes"));
    let len = u32::from_le_bytes(record[4..8].try_into().expect("4 bytes")) as usize;
    let payload = record
        .get(HEADER..HEADER.checked_add(len).ok_or(Torn)?)
        .ok_or(Torn)?;
    if crc32fast::hash(payload) == crc {
        Ok(payload)
    } else {
        Err(Torn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_detection() {
        let sealed = seal(b"hello, region");
        assert_eq!(sealed.len() % 8, 0);
        assert_eq!(open(&sealed).unwrap(), b"hello, region");
        let mut torn = sealed.clone();
        torn[HEADER + 2] ^= 1;
        assert_eq!(open(&torn), Err(Torn));
        let mut bad_len = sealed;
        bad_len[4] = 200;
        assert_eq!(open(&bad_len), Err(Torn));
        assert_eq!(open(&[0u8; 3]), Err(Torn));
    }

    #[test]
    fn sealing_in_place_gives_the_bytes_of_seal() {
        for payload in [
            &b""[..],
            b"x",
            b"seven b",
            b"exactly8",
            b"a longer payload, 29 bytes..",
        ] {
            let mut slot = vec![0u8; 64];
            slot[HEADER..HEADER + payload.len()].copy_from_slice(payload);
            seal_in_place(&mut slot, payload.len());
            let sealed = seal(payload);
            assert_eq!(&slot[..sealed.len()], &sealed[..]);
            assert!(slot[sealed.len()..].iter().all(|&b| b == 0));
            assert_eq!(open(&slot).unwrap(), payload);
        }
    }
}
