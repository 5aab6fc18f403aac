//! A small mutation fuzzer for the stable toolchain, and the helpers the fuzz entry points
//! share.
//!
//! Every decoder of network input in CitronFS has an entry point: a plain function taking
//! `&[u8]` that feeds the bytes to the decoder exactly as a server or client does and checks
//! the outcome (no panic, a bounded allocation, a typed error, a correct round trip), panicking
//! on a finding. `fuzz/` (cargo-fuzz, nightly, libFuzzer) calls each entry from a target; on
//! the stable toolchain each crate's tests call [`run`] on the same entry, which mutates a seed
//! corpus of valid inputs for a bounded time, so that CI exercises every decoder on every run.
//!
//! [`run`] is no match for libFuzzer's coverage guidance: it finds what byte flips, splices
//! and truncations of valid messages find. Run the real fuzzers for longer (see `fuzz/`).
//!
//! The time per entry is [`DEFAULT_BUDGET`], or `CITRONFS_FUZZ_MS` milliseconds; the random
//! seed is the clock's, or `CITRONFS_FUZZ_SEED`, and is printed with any failing input so the
//! run can be repeated.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// How long [`run`] fuzzes an entry when `CITRONFS_FUZZ_MS` is not set.
pub const DEFAULT_BUDGET: Duration = Duration::from_secs(3);

/// The largest input [`run`] makes: larger than every handshake limit, small enough that an
/// execution stays fast.
const MAX_INPUT: usize = 96 << 10;

/// What a [`run`] did.
#[derive(Clone, Copy, Debug)]
pub struct Report {
    /// Inputs executed (seeds included).
    pub execs: u64,
    /// The random seed, for repeating the run.
    pub seed: u64,
}

/// xorshift64*: enough randomness for mutations, and no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// Values that sit on the edges decoders check: zero, all ones, varint continuation bits, the
/// frame length fields' limits.
const INTERESTING: [u8; 8] = [0x00, 0x01, 0x7f, 0x80, 0xfe, 0xff, 0x40, 0x10];

/// One random mutation of `input`, sometimes spliced with `other`.
fn mutate(rng: &mut Rng, input: &mut Vec<u8>, other: &[u8]) {
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        let len = input.len();
        match rng.below(9) {
            0 if len > 0 => {
                let at = rng.below(len);
                input[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let at = rng.below(len);
                input[at] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 if len > 0 => {
                let at = rng.below(len);
                input[at] = rng.next() as u8;
            }
            3 => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                input.splice(at..at, bytes);
            }
            4 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(16));
                input.drain(at..at + n);
            }
            5 if len > 0 => input.truncate(rng.below(len)),
            6 if !other.is_empty() => {
                // Splice: a prefix of this input and a suffix of another.
                let at = rng.below(len + 1);
                let from = rng.below(other.len());
                input.truncate(at);
                input.extend_from_slice(&other[from..]);
            }
            7 if len > 0 => {
                // Repeat a chunk: streams of several messages.
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(64));
                let chunk = input[at..at + n].to_vec();
                let to = rng.below(len + 1);
                input.splice(to..to, chunk);
            }
            8 if len >= 4 => {
                // A little-endian u32 (a frame length) set to an edge value.
                let at = rng.below(len - 3);
                let value: u32 = match rng.below(5) {
                    0 => 0,
                    1 => u32::MAX,
                    2 => 64 << 10,
                    3 => (64 << 10) + 1,
                    _ => rng.next() as u32,
                };
                input[at..at + 4].copy_from_slice(&value.to_le_bytes());
            }
            _ => {}
        }
    }
    input.truncate(MAX_INPUT);
}

/// Runs `entry` on every seed, then on mutations of them and on random bytes, for `budget`
/// (or `CITRONFS_FUZZ_MS`). A panic in `entry` is re-raised after the failing input is
/// printed (hex) with the seed of the run. Returns what was done.
pub fn run(name: &str, seeds: &[Vec<u8>], budget: Duration, entry: impl Fn(&[u8])) -> Report {
    run_framed(name, seeds, budget, None, entry)
}

/// [`run`] for an entry whose input holds a stream of frames from byte `frames_at` on: half
/// of the mutated inputs have their frames' checksums recomputed ([`reseal`]) before they are
/// run, so that mutations reach the decoders behind the checksum instead of stopping at it.
pub fn run_framed(
    name: &str,
    seeds: &[Vec<u8>],
    budget: Duration,
    frames_at: Option<usize>,
    entry: impl Fn(&[u8]),
) -> Report {
    let budget = env_u64("CITRONFS_FUZZ_MS")
        .map(Duration::from_millis)
        .unwrap_or(budget);
    let seed = env_u64("CITRONFS_FUZZ_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let mut rng = Rng(seed | 1);
    let mut execs = 0u64;
    let mut exec = |input: &[u8]| {
        execs += 1;
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| entry(input))) {
            let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
            eprintln!(
                "fuzz {name}: failing input ({} bytes, CITRONFS_FUZZ_SEED={seed}): {hex}",
                input.len()
            );
            resume_unwind(panic);
        }
    };
    for s in seeds {
        exec(s);
    }
    let started = Instant::now();
    let mut input = Vec::new();
    while started.elapsed() < budget {
        if seeds.is_empty() || rng.below(16) == 0 {
            let n = rng.below(256);
            input.clear();
            input.extend((0..n).map(|_| rng.next() as u8));
        } else {
            input.clone_from(&seeds[rng.below(seeds.len())]);
            let other = &seeds[rng.below(seeds.len())];
            mutate(&mut rng, &mut input, other);
            if let Some(at) = frames_at {
                if rng.below(2) == 0 && at <= input.len() {
                    reseal(&mut input[at..]);
                }
            }
        }
        exec(&input);
    }
    // In the test's output (shown with --nocapture or on failure): how much was tried.
    eprintln!(
        "fuzz {name}: {execs} inputs in {:.1} s (CITRONFS_FUZZ_SEED={seed})",
        started.elapsed().as_secs_f64()
    );
    Report { execs, seed }
}

/// A reader and writer over fixed input bytes, for driving a protocol loop without a socket:
/// reads come from the input (then EOF), writes are collected.
#[derive(Debug, Default)]
pub struct Pipe<'a> {
    /// What is left to read.
    pub input: &'a [u8],
    /// Everything written.
    pub output: Vec<u8>,
}

impl<'a> Pipe<'a> {
    /// A pipe reading `input`.
    pub fn new(input: &'a [u8]) -> Self {
        Self {
            input,
            output: Vec::new(),
        }
    }
}

impl std::io::Read for Pipe<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl std::io::Write for Pipe<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Asserts that a frame body read from `available` input bytes was not allocated for more
/// than arrived: the capacity may be at most twice what was read plus a small constant (a
/// growing `Vec`), whatever length the frame's header declared.
pub fn assert_bounded(body: &Vec<u8>, available: usize) {
    assert!(
        body.capacity() <= 2 * available.max(body.len()) + 4096,
        "a frame body of capacity {} for {} input bytes: allocated before the bytes arrived",
        body.capacity(),
        available
    );
}

/// Recomputes the checksum of every frame in `stream` (frames back to back, the last one
/// possibly cut short: its checksum covers what is there), leaving the lengths as they are.
/// A fuzzer's mutations of a frame body are rejected by the checksum unless it is resealed.
pub fn reseal(stream: &mut [u8]) {
    let header = crate::frame::HEADER_LEN;
    let mut at = 0;
    while stream.len() - at >= header {
        let len = u32::from_le_bytes(stream[at..at + 4].try_into().expect("4 bytes")) as usize;
        let body = at + header..(at + header).saturating_add(len).min(stream.len());
        let crc = crc32fast::hash(&stream[body.clone()]);
        stream[at + 4..at + header].copy_from_slice(&crc.to_le_bytes());
        at = body.end;
    }
}

/// The input of a cargo-fuzz target whose entry takes a stream of frames from byte
/// `frames_at` on: the first byte's lowest bit says whether to [`reseal`] them, so that
/// libFuzzer can explore both the checksum check and what lies behind it.
pub fn libfuzzer_input(data: &[u8], frames_at: usize) -> std::borrow::Cow<'_, [u8]> {
    match data.split_first() {
        Some((&flags, rest)) if flags & 1 == 1 => {
            let mut owned = rest.to_vec();
            if frames_at <= owned.len() {
                reseal(&mut owned[frames_at..]);
            }
            std::borrow::Cow::Owned(owned)
        }
        Some((_, rest)) => std::borrow::Cow::Borrowed(rest),
        None => std::borrow::Cow::Borrowed(data),
    }
}

/// A frame holding `body`, as every CitronFS protocol writes one.
pub fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + crate::frame::HEADER_LEN);
    out.extend_from_slice(&crate::frame::header_for(body));
    out.extend_from_slice(body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The driver itself: it runs the seeds, mutates for the budget, and reports a panic.
    #[test]
    fn runs_seeds_and_reports_findings() {
        let report = run(
            "self-test",
            &[b"hello".to_vec()],
            Duration::from_millis(50),
            |_| {},
        );
        assert!(report.execs > 1);
        let found = catch_unwind(|| {
            run(
                "self-test",
                &[vec![0u8; 4]],
                Duration::from_secs(5),
                |input| assert!(!input.contains(&0xff), "found 0xff"),
            )
        });
        assert!(found.is_err(), "a reachable assertion must be found");
    }

    /// Resealed frames pass their checksum, a cut-short last frame included.
    #[test]
    fn reseal_fixes_checksums() {
        let mut stream = [frame(b"abc"), frame(b"defgh")].concat();
        stream[crate::frame::HEADER_LEN] = b'x';
        stream.truncate(stream.len() - 2);
        reseal(&mut stream);
        let mut r = &stream[..];
        let mut body = Vec::new();
        crate::frame::read_frame(&mut r, 16, &mut body).unwrap();
        assert_eq!(body, b"xbc");
        let header: [u8; 8] = r[..8].try_into().unwrap();
        let header = crate::frame::parse_header(&header, 16).unwrap();
        assert_eq!(header.crc, crc32fast::hash(b"def"));
    }
}
