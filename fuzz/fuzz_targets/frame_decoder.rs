//! Untrusted bytes into the `tcp` fabric server: frame header and length limit, checksum,
//! message decode, batch shape check, and execution against a small region table, exactly as a
//! server connection runs them (after a first byte saying whether to reseal the frames, see
//! `fabric::fuzz::libfuzzer_input`; `fabric::tcp::fuzz_entry` says how the next byte selects
//! the entry point). Any panic is a finding; so is a reply the server writes that does not
//! decode.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte's lowest bit: recompute the frames' checksums (fabric::fuzz::reseal).
    fabric::tcp::fuzz_entry(&fabric::fuzz::libfuzzer_input(data, 1));
});
