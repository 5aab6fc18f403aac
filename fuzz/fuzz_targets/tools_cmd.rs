//! The settings modules of the `citronfs` command (a binary crate, so not a library to depend
//! on), compiled from their sources for the `config_file` target. `roles` reaches `config` and
//! `signals` through `super`, as in the command.

#[path = "../../crates/tools/src/cmd/config.rs"]
pub mod config;
#[path = "../../crates/tools/src/cmd/roles.rs"]
pub mod roles;
#[path = "../../crates/tools/src/cmd/signals.rs"]
pub mod signals;

pub use signals::{wait_for_stop, StopSignals};
