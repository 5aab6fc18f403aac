//! Untrusted bytes into the `tcp` fabric server: frame header and length limit, checksum,
//! message decode, batch shape check, and execution against a small region table, exactly as a
//! server connection runs them (see `fabric::tcp::fuzz_entry` for how the first byte selects
//! the entry point). Any panic is a finding; so is a reply the server writes that does not
//! decode.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fabric::tcp::fuzz_entry(data);
});
