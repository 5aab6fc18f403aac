//! What a meta server (or an impostor) sends a client: the challenge answering its hello, the
//! answer to its proof, then responses, read as `proto::rpc::Client` reads them
//! (`proto::fuzz::client_entry`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte's lowest bit: recompute the frames' checksums (fabric::fuzz::reseal).
    proto::fuzz::client_entry(&fabric::fuzz::libfuzzer_input(data, 0));
});
