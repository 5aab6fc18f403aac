//! The settings modules of the `citronfs` command (a binary crate, so not a library to depend
//! on), compiled from their sources for the `config_file` target. `roles` reaches `config` as
//! `super::config`, as in the command.

#[path = "../../crates/tools/src/cmd/config.rs"]
pub mod config;
#[path = "../../crates/tools/src/cmd/roles.rs"]
pub mod roles;
