//! Small helpers of the cluster and of what runs around it (the benchmarks, the soak).

use anyhow::{Context, Result};

/// A fresh random cluster token (128 bits from /dev/urandom, as hex), for a cluster whose spec
/// names none: each cluster gets its own, so that no client of another can join it.
pub fn random_token() -> Result<String> {
    fabric::handshake::random_token().context("read /dev/urandom")
}

/// `len` bytes of a pattern that differs at every file offset and per `seed`, so that data
/// read back at the wrong offset or from the wrong writer is caught.
///
/// Each byte is the splitmix64 finalizer of the offset mixed with the seed, so every bit of
/// both reaches every bit of the byte (a plain product keeps a small seed's bits out of the
/// byte taken, and two writers' patterns would then be equal).
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    let key = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len as u64)
        .map(|i| {
            let mut x = (offset + i) ^ key;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (x ^ (x >> 31)) as u8
        })
        .collect()
}

/// A free loopback address for a server that must come back on the *same* address after it is
/// killed and restarted (the soak's and the crash tests' meta server), chosen below the
/// kernel's ephemeral port range (`/proc/sys/net/ipv4/ip_local_port_range`). Every other server
/// binds port 0 and gets an ephemeral port, so none of them can take this one while its owner
/// is starting or away — which a port picked by binding port 0 and releasing it allows (a CI
/// run's soak connected to such a port and found a fabric server there). Falls back to an
/// ephemeral port when the range leaves no room below it.
pub fn restartable_addr() -> Result<std::net::SocketAddr> {
    use std::net::TcpListener;
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const FLOOR: u16 = 10_000;
    if low > FLOOR + 1000 {
        use rand::Rng;
        let mut rng = rand::rng();
        for _ in 0..256 {
            let port = rng.random_range(FLOOR..low);
            if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
                return Ok(listener.local_addr()?);
            }
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_hex() {
        let (a, b) = (random_token().unwrap(), random_token().unwrap());
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn pattern_differs_by_offset_and_seed() {
        let a = pattern(1, 0, 4096);
        assert_eq!(pattern(1, 100, 10), a[100..110]);
        // Neighbouring seeds (two writers of one test) differ at nearly every byte.
        let b = pattern(2, 0, 4096);
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        assert!(same < 64, "{same} of 4096 bytes equal");
        assert!(a.windows(2).any(|w| w[0] != w[1]));
    }
}
