//! The `rdma` backend (cargo feature `rdma`): one-sided verbs executed by an RDMA NIC.

pub mod soft;
pub mod verbs;
