//! The handshake every CitronFS server runs (`fabric::handshake::server_handshake`), for each
//! protocol: the second byte selects it (0: the tcp fabric's verbs, 1: the lock server, 2: the
//! meta server's RPC with its `Role`), the rest is what the peer sends. See
//! `fabric::handshake::fuzz_server_handshake` for what is checked.
#![no_main]

use fabric::handshake::{fuzz_server_handshake, Protocol};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte's lowest bit: recompute the frames' checksums (fabric::fuzz::reseal).
    let data = fabric::fuzz::libfuzzer_input(data, 1);
    let Some((&which, input)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => fuzz_server_handshake::<()>(input, Protocol::Verbs),
        1 => fuzz_server_handshake::<()>(input, Protocol::LockServer),
        _ => proto::fuzz::hello_entry(input),
    }
});
