//! The `--config` TOML files of the `citronfs` roles, layered as the command layers them
//! (`cmd::roles::fuzz_config_file`). `citronfs` is a binary crate, so its two settings modules
//! are compiled into this target from their sources (`tools_cmd.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code, missing_docs, unused_imports)]
#[path = "tools_cmd.rs"]
mod cmd;

fuzz_target!(|data: &[u8]| {
    cmd::roles::fuzz_config_file(data);
});
