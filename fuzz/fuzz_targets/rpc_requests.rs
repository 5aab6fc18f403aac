//! What a peer sends the meta server's RPC port, read as a connection reads it and run into a
//! real namespace store (`meta_server::rpc::fuzz_entry`). The store lives in a temporary
//! directory for the life of the fuzzing process, so requests build on earlier ones.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meta_server::store::Store;
use std::sync::OnceLock;

fn store() -> &'static Store {
    static STORE: OnceLock<Store> = OnceLock::new();
    STORE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("citronfs-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let owner = proto::Caller { uid: 0, gid: 0 };
        Store::open(&dir, 4096, owner).expect("a store in the temporary directory")
    })
}

fuzz_target!(|data: &[u8]| {
    // The first byte's lowest bit: recompute the frames' checksums (fabric::fuzz::reseal).
    let data = fabric::fuzz::libfuzzer_input(data, 0);
    meta_server::rpc::fuzz_entry(&data, Some(store()));
});
