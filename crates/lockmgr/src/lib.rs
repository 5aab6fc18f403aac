//! Range locks over one-sided verbs.
//!
//! [`RangeLock`] is the interface of every scheme: CITRON (the paper's §3), and the baselines of the
//! paper's Table 1 that matter to a file system. The crate knows nothing of files: it locks ranges
//! of an abstract address space of lock units.
//!
//! [`schemes`] is the one seam between the schemes and their users: one description type
//! ([`LockScheme`]), one function that creates a lock's state ([`schemes::create`]) and one that
//! opens a handle on it ([`schemes::open`]), with what a lock's host offers so that clients
//! acquire there ([`schemes::LockHost`]) and the hooks a user gives every scheme alike
//! ([`Fence`], [`schemes::LockWordAllocator`]).

/// A failpoint (`fail::fail_point!`) where a crash test stops a client: compiled to nothing
/// unless the cargo feature `failpoints` is on, and then inert until a test configures it
/// (`fail::cfg_callback`); the crash tests make the process SIGKILL itself there.
#[cfg(feature = "failpoints")]
macro_rules! failpoint {
    ($name:expr) => {
        fail::fail_point!($name)
    };
}
/// A failpoint (see the `failpoints` build): nothing in this build.
#[cfg(not(feature = "failpoints"))]
macro_rules! failpoint {
    ($name:expr) => {};
}

pub mod backoff;
pub mod baselines;
pub(crate) mod carry;
pub mod chaos;
pub mod citron;
pub mod fence;
pub mod hosting;
pub mod scheme;
pub mod schemes;
pub mod stats;

pub use chaos::{ChaosConfig, ChaosConnector, ChaosEndpoint, StallEndpoint, StallSwitch};
pub use citron::{Citron, CitronClient, CitronConfig, ClientOptions};
pub use fence::{holder_identity, Fence};
pub use scheme::{check_range, LockError, LockId, LockMode, ProgressFn, RangeLock};
pub use schemes::{LockRef, LockScheme};
pub use stats::{AbortCounts, LockStats};
