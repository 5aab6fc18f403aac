//! The commands that run CitronFS: an embedded cluster (`up`), each role on its own host, and
//! the consistency checker (`fsck`).

pub mod config;
pub mod fsck;
pub mod roles;
pub mod up;
