//! Procedures: code a server runs next to its memory on a client's behalf, one round trip per
//! call (the Cell paper: where a server's CPU is on the data path anyway, let it do a
//! multi-step operation locally instead of answering one round trip per step).
//!
//! A procedure sees the server's memory exactly as a client does: through endpoints ([`crate::Endpoint`])
//! (opened from the [`Connector`] it is given), whose batches run through the same executor,
//! region checks and fencing as the batches a client sends. So a procedure that implements a
//! one-sided protocol step by step is that protocol, on the same words, and interoperates with
//! clients that run it themselves (CITRON's acquire, `lockmgr::citron`).
//!
//! Only a backend whose verbs a server CPU executes offers procedures (`tcp`): there the call
//! replaces round trips that each cost the server a wake-up. On `mem` and `shm` the client's
//! own CPU is next to the memory already; [`crate::Endpoint::call`] refuses with
//! [`FabricError::Unsupported`] and callers run the steps themselves.

use crate::endpoint::Connector;
use crate::error::{FabricError, Result};
use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

/// A procedure's number on the wire. Numbers are assigned by the crates that define
/// procedures; a server answers a number it has no procedure for with
/// [`FabricError::Unsupported`].
pub type ProcedureId = u32;

/// The procedure of [`crate::TcpServer::accept_session_floors`]: raises the server's session
/// floor ([`crate::FabricServer::refuse_sessions_before`]) on a sessionless peer's behalf.
pub const SESSION_FLOOR: ProcedureId = 0xF100_0001;

/// Has the server behind `endpoint` refuse every client session numbered below `floor`, and
/// returns once no batch of theirs can execute there any more: `Ok(true)`. `Ok(false)` where
/// the server cannot ([`crate::FabricServer::can_fence`]: on shm and mem, clients map or reach
/// the memory themselves) or does not offer it. `endpoint` must be sessionless (session 0).
///
/// This is how a meta server that restarted cuts off, at a data server, the clients of its
/// earlier run that have not noticed the restart, before it zeroes a chunk there or hands one
/// out: a write of theirs, through a chunk location the crash forgot, would otherwise land in
/// a chunk that is free again, or another file's.
pub fn raise_session_floor(endpoint: &mut dyn crate::Endpoint, floor: u64) -> Result<bool> {
    let mut reply = Vec::new();
    match endpoint.call(SESSION_FLOOR, &floor.to_le_bytes(), &mut reply) {
        Ok(()) => Ok(true),
        Err(FabricError::Unsupported(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Most bytes of a call's arguments or of its result.
pub const MAX_CALL_BYTES: usize = 64 << 10;

/// Something a server runs on its clients' behalf. One `Procedure` serves every connection;
/// each connection that calls it gets its own [`ProcedureSession`].
pub trait Procedure: Send + Sync {
    /// The state of one connection's calls, opened at its first call. `host` opens endpoints
    /// on the server's own memory, whose batches are checked (regions, bounds, the
    /// connection's session against revocations) as the connection's own batches are.
    /// `session` is the client session the connection presented (0: none), the one fences
    /// revoke.
    fn open(&self, host: Arc<dyn Connector>, session: u64) -> Result<Box<dyn ProcedureSession>>;
}

/// One connection's calls of one procedure, in order, on the connection's thread.
pub trait ProcedureSession: Send {
    /// Runs one call with `args`, appending its result (at most [`MAX_CALL_BYTES`]) to
    /// `reply`. The caller sees an `Err` as [`FabricError::Procedure`], except
    /// [`FabricError::Refused`] from a host endpoint (the connection's session was revoked),
    /// after which the server answers `Revoked` and closes the connection.
    fn call(&mut self, args: &[u8], reply: &mut Vec<u8>) -> Result<()>;
}

/// The procedures a server offers, by number.
#[derive(Default)]
pub(crate) struct Procedures {
    table: RwLock<HashMap<ProcedureId, Arc<dyn Procedure>>>,
}

impl Procedures {
    /// Offers `procedure` under `id`; a number already taken is refused.
    pub(crate) fn add(&self, id: ProcedureId, procedure: Arc<dyn Procedure>) -> Result<()> {
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        if table.contains_key(&id) {
            return Err(FabricError::Config(format!(
                "procedure {id} is already registered"
            )));
        }
        table.insert(id, procedure);
        Ok(())
    }

    /// The procedure offered under `id`.
    pub(crate) fn get(&self, id: ProcedureId) -> Option<Arc<dyn Procedure>> {
        self.table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .cloned()
    }
}
