//! The commands that run CitronFS: an embedded cluster (`up`) and each role on its own host.

pub mod config;
pub mod roles;
pub mod up;
