//! The commands that run CitronFS: an embedded cluster (`up`), each role on its own host, the
//! consistency checker (`fsck`), a running cluster's state (`status`), and the metrics
//! responder every role serves with `--metrics ADDR` (`metrics`).

pub mod config;
pub mod fsck;
pub mod helper;
pub mod metrics;
pub mod roles;
pub mod signals;
pub mod status;
pub mod up;

pub use signals::{wait_for_stop, StopSignals};
