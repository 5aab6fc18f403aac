//! The `--config` TOML files of the `citronfs` roles, layered as the command layers them
//! (`tools::fuzz_config_file`, from the `tools` library with its `fuzzing` feature).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tools::fuzz_config_file(data);
});
