//! The narrow verbs interface the `rdma` backend is written against: what it needs of
//! libibverbs, and nothing more.
//!
//! Two providers implement it: [`super::soft`], an emulation for the processes of one host
//! with a real NIC's semantics (for tests, and for every line of the backend to run in CI),
//! and `super::ibverbs`, the thin shim over `rdma-sys`. The backend never learns which it has.
//!
//! The pieces, in libibverbs' terms:
//!
//! - a [`Device`] (`ibv_context`) reports its [`DeviceAttrs`] (`ibv_query_device`): above all
//!   its atomic capability ([`AtomicCap`]: `IBV_ATOMIC_NONE`, `_HCA`, `_GLOB`);
//! - a [`ProtectionDomain`] (`ibv_pd`) registers memory ([`MemoryRegion`], `ibv_reg_mr`) with
//!   [`Access`] flags and an lkey/rkey pair, and creates RC queue pairs in itself;
//! - a [`QueuePair`] (`ibv_qp` with its own send completion queue) walks the RC state machine
//!   RESET → INIT → RTR → RTS ([`QpState`]; any error moves it to ERROR, where every posted
//!   request completes with [`WcStatus::WrFlushErr`]), posts a chain of [`WorkRequest`]s with
//!   one doorbell ([`QueuePair::post_send`]: `ibv_post_send` of a linked list), and polls
//!   completions with a deadline ([`QueuePair::poll`]: `ibv_poll_cq` in a loop).
//!
//! Ordering (InfiniBand RC, as the providers must give it and no more): requests of one QP are
//! executed at the responder in posting order, except that a request posted after an RDMA Read
//! or an atomic may be executed before that Read or atomic has completed — a Read may return
//! bytes a later Write of the same QP stored, and a later Write may land before an earlier
//! atomic — unless the later request carries [`WorkRequest::fence`] (`IBV_SEND_FENCE`: "its
//! processing won't begin until all prior RDMA Read and Atomic operations on the same Send
//! Queue have completed"). Completions of one QP are delivered in posting order; an unsignalled
//! request is known complete when a later signalled one is polled. Nothing is ordered between
//! two QPs.

use crate::error::Result;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// Memory access flags of a registration (`ibv_access_flags`, same bits) and of a queue pair
/// (what its responder lets remote peers do).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Access(pub u32);

impl Access {
    /// The local NIC may write it (`IBV_ACCESS_LOCAL_WRITE`): the target of a Read's or an
    /// atomic's result.
    pub const LOCAL_WRITE: Access = Access(1);
    /// Remote peers may RDMA Write it (`IBV_ACCESS_REMOTE_WRITE`).
    pub const REMOTE_WRITE: Access = Access(2);
    /// Remote peers may RDMA Read it (`IBV_ACCESS_REMOTE_READ`).
    pub const REMOTE_READ: Access = Access(4);
    /// Remote peers may run atomics on it (`IBV_ACCESS_REMOTE_ATOMIC`).
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// Everything a served region allows.
    pub const SERVED: Access = Access(1 | 2 | 4 | 8);

    /// Whether every flag of `other` is set here.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// How atomic a device's atomics are (`ibv_device_attr::atomic_cap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AtomicCap {
    /// No atomics (`IBV_ATOMIC_NONE`): the `rdma` backend refuses such a device.
    None,
    /// Atomic against the atomics of this device only (`IBV_ATOMIC_HCA`): not against the
    /// host CPU's atomics, nor against plain stores, on the same word.
    Hca,
    /// Atomic against every access to the word, the CPU's included (`IBV_ATOMIC_GLOB`).
    Glob,
}

/// What a device reports about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceAttrs {
    /// The device's name (`mlx5_0`, `rxe0`, `soft0`).
    pub name: String,
    /// How atomic its atomics are.
    pub atomic_cap: AtomicCap,
    /// Most outstanding work requests of one send queue.
    pub max_qp_wr: u32,
    /// Largest registration.
    pub max_mr_size: u64,
    /// Whether atomic results land in local memory big-endian (some devices' "reply BE" mode;
    /// upstream verbs have no query for it, so the ibverbs provider says `false`). The backend
    /// converts to host order either way.
    pub atomic_reply_be: bool,
}

/// What a peer needs to connect a queue pair to this one (exchanged over the authenticated
/// tcp handshake).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QpAddress {
    /// The queue pair number.
    pub qpn: u32,
    /// The first packet sequence number this side sends.
    pub psn: u32,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The port's GID (RoCE: from the interface's address).
    pub gid: [u8; 16],
}

/// The states of an RC queue pair (`ibv_qp_state`, the ones this backend uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Just created: nothing may be posted.
    Reset,
    /// Initialised with a port, a P_Key and its responder's access flags.
    Init,
    /// Ready to receive: connected to its peer (QPN, PSN, address).
    Rtr,
    /// Ready to send: requests may be posted.
    Rts,
    /// A request failed (or the QP was moved here): every request completes flushed.
    Error,
}

/// What one work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrOp {
    /// RDMA Read `len` bytes of remote memory into the local buffer.
    Read,
    /// RDMA Write `len` bytes of the local buffer into remote memory.
    Write,
    /// Atomic compare-and-swap of the aligned remote word; its old value lands in the local
    /// buffer (8 bytes).
    CompareSwap {
        /// The value compared with.
        compare: u64,
        /// The value stored when they are equal.
        swap: u64,
    },
    /// Atomic fetch-and-add of the aligned remote word; its old value lands in the local
    /// buffer (8 bytes).
    FetchAdd {
        /// The addend (wrapping).
        add: u64,
    },
}

impl WrOp {
    /// Whether this is an atomic.
    pub fn is_atomic(self) -> bool {
        matches!(self, WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. })
    }

    /// Whether a later request may overtake this one unless fenced (Reads and atomics).
    pub fn may_be_overtaken(self) -> bool {
        !matches!(self, WrOp::Write)
    }
}

/// One work request of a chain (`ibv_send_wr` with one scatter/gather element).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// The caller's id, returned in its completion.
    pub wr_id: u64,
    /// What it does.
    pub op: WrOp,
    /// The local buffer: its address, length and the lkey of the registration holding it.
    pub local_addr: u64,
    /// Bytes moved (8 for an atomic).
    pub len: u32,
    /// The lkey of the local buffer's registration.
    pub lkey: u32,
    /// The remote address (in the peer's registration's address space).
    pub remote_addr: u64,
    /// The rkey of the remote registration.
    pub rkey: u32,
    /// Whether a successful completion is reported (`IBV_SEND_SIGNALED`); a failed request is
    /// reported whatever this says.
    pub signaled: bool,
    /// `IBV_SEND_FENCE`: not begun before every earlier Read and atomic of this QP completed.
    pub fence: bool,
}

/// The status of a completion (`ibv_wc_status`, the ones this backend tells apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// The local buffer was too short for the operation (`IBV_WC_LOC_LEN_ERR`).
    LocalLength,
    /// The local buffer is not registered with the needed access (`IBV_WC_LOC_PROT_ERR`).
    LocalProtection,
    /// The remote registration refused it: bad rkey, out of its range, or access not granted
    /// (`IBV_WC_REM_ACCESS_ERR`).
    RemoteAccess,
    /// The responder could not do it: a misaligned atomic, an operation its QP does not allow
    /// (`IBV_WC_REM_INV_REQ_ERR`).
    RemoteInvalidRequest,
    /// The responder failed (`IBV_WC_REM_OP_ERR`).
    RemoteOperation,
    /// No answer from the peer after the transport's retries (`IBV_WC_RETRY_EXC_ERR`): it is
    /// gone or unreachable.
    RetryExceeded,
    /// The QP was in the error state: not executed (`IBV_WC_WR_FLUSH_ERR`).
    Flushed,
    /// Any other status, by its number.
    Other(u32),
}

impl WcStatus {
    /// What the status means, for error messages.
    pub fn describe(self) -> String {
        match self {
            WcStatus::Success => "success".into(),
            WcStatus::LocalLength => "local length error".into(),
            WcStatus::LocalProtection => "local protection error".into(),
            WcStatus::RemoteAccess => {
                "remote access error (rkey, range or access flags refused by the server's NIC)"
                    .into()
            }
            WcStatus::RemoteInvalidRequest => {
                "remote invalid request (misaligned atomic or an operation not allowed)".into()
            }
            WcStatus::RemoteOperation => "remote operation error".into(),
            WcStatus::RetryExceeded => {
                "transport retries exceeded (the server's queue pair is gone or unreachable)".into()
            }
            WcStatus::Flushed => "flushed (the queue pair was in the error state)".into(),
            WcStatus::Other(n) => format!("completion status {n}"),
        }
    }
}

/// One completion (`ibv_wc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The request's id.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
}

/// A provider of the interface: opens devices.
pub trait Provider: Send + Sync {
    /// The provider's name (`soft`, `ibverbs`).
    fn name(&self) -> &'static str;

    /// Opens device `name`, or the first one found. Errors name what is missing (no device,
    /// no kernel support).
    fn open(&self, name: Option<&str>) -> Result<Arc<dyn Device>>;
}

/// An open device.
pub trait Device: Send + Sync {
    /// What it reports about itself.
    fn attrs(&self) -> &DeviceAttrs;

    /// Allocates a protection domain.
    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>>;
}

/// A protection domain: registrations and queue pairs in it reach each other only.
pub trait ProtectionDomain: Send + Sync {
    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    /// The memory must stay valid (not freed, not unmapped) until the returned registration is
    /// dropped, and every other user of it must access it with atomic operations: the NIC
    /// reads and writes it at any time.
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn MemoryRegion>>;

    /// Creates an RC queue pair (in [`QpState::Reset`]) with room for `max_send_wr`
    /// outstanding requests, and its own send completion queue.
    fn create_qp(&self, max_send_wr: u32) -> Result<Box<dyn QueuePair>>;
}

/// A registration (`ibv_mr`); dropping it deregisters.
pub trait MemoryRegion: Send + Sync {
    /// The registered memory's first byte.
    fn addr(&self) -> u64;
    /// Bytes registered.
    fn len(&self) -> u64;
    /// Whether nothing is registered.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The key local requests name it by.
    fn lkey(&self) -> u32;
    /// The key remote peers name it by.
    fn rkey(&self) -> u32;
}

/// An RC queue pair with its send completion queue; dropping it destroys both.
pub trait QueuePair: Send {
    /// What a peer needs to connect to it.
    fn address(&self) -> QpAddress;

    /// Its state.
    fn state(&self) -> QpState;

    /// RESET → INIT, letting remote peers do `access` through it.
    fn to_init(&mut self, access: Access) -> Result<()>;

    /// INIT → RTR, connected to `remote`.
    fn to_rtr(&mut self, remote: &QpAddress) -> Result<()>;

    /// RTR → RTS.
    fn to_rts(&mut self) -> Result<()>;

    /// Any state → ERROR: every outstanding and later request completes flushed.
    fn to_error(&mut self) -> Result<()>;

    /// Posts `chain` with one doorbell. `Err` when nothing could be posted (the QP not in RTS
    /// or ERROR, the send queue full); otherwise each request completes (a failed one, and
    /// every request after a failure, with a completion whether signalled or not).
    fn post_send(&mut self, chain: &[WorkRequest]) -> Result<()>;

    /// The next completion, waiting for it until `deadline`; `None` if none came by then.
    fn poll(&mut self, deadline: Instant) -> Result<Option<WorkCompletion>>;
}
