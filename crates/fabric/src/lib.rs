//! One-sided verbs over registered memory regions.
//!
//! Everything in CitronFS — lock words, file control blocks, file data — is reached through this
//! crate. A server registers [`Region`]s; a client opens one [`Endpoint`] per thread per server
//! and posts [`Batch`]es of verbs (`read`, `write`, `cas`, `faa`, `masked_cas`, `masked_faa`),
//! each batch one round trip, executed in posting order. The verbs' semantics follow CITRON
//! §2.1 and are defined once, in [`atomic_ops`]; every backend runs them through the same
//! executor ([`RegionTable::execute`]), so they cannot disagree:
//!
//! - [`mem`]: in-process regions, for tests and the single-process mode;
//! - [`shm`]: regions are shared-memory files mapped by every process on the host; the owning
//!   server's CPU is never involved;
//! - [`tcp`]: a software NIC; the server executes verbs it receives in checksummed frames.
//!
//! Which backend is a value ([`Backend`], [`ServeAt`], [`FabricAddr`]): everything else goes
//! through [`serve`] and [`connect`] ([`transport`]), the one place a backend is chosen.
//!
//! Hosts are little-endian: words travel and sit in memory as little-endian `u64`s.

#[cfg(not(target_endian = "little"))]
compile_error!("the fabric assumes a little-endian host");

pub mod addr;
pub mod atomic_ops;
pub mod batch;
pub mod clock;
pub mod endpoint;
pub mod error;
pub mod frame;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzz;
pub mod handshake;
pub mod local;
pub mod mem;
pub mod procedure;
pub mod record;
pub mod region;
pub mod shm;
pub mod tcp;
pub mod transport;
mod word_copy;

pub use addr::{RegionId, RemoteAddr};
pub use batch::{AtomicHandle, Batch, Completions, ReadHandle, Verb, REPLY_AFTER_EXPIRY};
pub use endpoint::{
    measure_rtt, measure_rtt_under_load, Capabilities, Connector, Endpoint, EndpointExt,
    EndpointStats, MaskedAtomics, RttProfile,
};
pub use error::{BatchError, FabricError, Result, VerbError};
pub use handshake::Credentials;
pub use mem::MemServer;
pub use procedure::{Procedure, ProcedureId, ProcedureSession};
pub use region::{Region, RegionTable};
pub use shm::{ShmConnector, ShmServer};
pub use tcp::{TcpConnector, TcpEndpoint, TcpServer, TcpTimeouts};
pub use transport::{
    connect, connect_with, serve, Backend, Backing, FabricAddr, FabricServer, ServeAt,
};
