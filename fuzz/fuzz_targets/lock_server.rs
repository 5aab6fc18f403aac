//! What a peer sends the lock server of the `server` scheme: the handshake, then requests,
//! served as a connection is (`lockmgr::baselines::server::fuzz_entry`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte's lowest bit: recompute the frames' checksums (fabric::fuzz::reseal).
    lockmgr::baselines::server::fuzz_entry(&fabric::fuzz::libfuzzer_input(data, 1));
});
