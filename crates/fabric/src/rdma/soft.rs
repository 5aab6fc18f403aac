//! The `soft` provider: an emulation of an RDMA NIC with a real NIC's semantics and no
//! stronger ones, so that every line of the `rdma` backend above the verbs runs in CI, and code
//! that relies on what hardware does not promise fails here as it would there. It reaches the
//! queue pairs of every process of the host that uses it.
//!
//! **Where requests execute.** A chain is executed on the poster's thread, inside `post_send`,
//! request by request in the order below. The requester's half of a request (its local buffer:
//! lkey, range, access) is checked and moved there; the responder's half — its queue pair's
//! state and access flags, the rkey, range and access of the registration, and the bytes —
//! runs in the process that created the responder queue pair (`respond`): directly when that
//! is this process, else on a thread of that process, reached over a unix socket in the host's
//! soft-NIC directory (`soft_link`: `CITRONFS_RDMA_SOFT_DIR`, default
//! `/dev/shm/citronfs-softnic-<uid>`; the process is named by its soft GID, which carries its
//! process id and a per-process random nonce). So registered memory is only ever touched by the
//! NIC of the process that registered it, as a NIC touches only its own host's memory: any
//! memory can be registered (heap, file mappings), and the device-wide atomic lock of that
//! process orders every atomic on it, whichever process posted it. A peer process that is gone
//! (exited, killed: no socket, the stream closed) or silent for `soft_link::RETRY_TIMEOUT`
//! fails the request with [`WcStatus::RetryExceeded`]; a responder queue pair destroyed or in
//! the error state is seen by the next request (also [`WcStatus::RetryExceeded`]).
//!
//! What it emulates, rule by rule (each has a unit test below):
//!
//! - **Registrations**: an lkey and a different rkey per registration; a request is checked by
//!   its keys, its range and the access flags of the registration and of the responder's queue
//!   pair, and both keys must belong to the queue pair's protection domain. A local fault
//!   completes with [`WcStatus::LocalProtection`] (or [`WcStatus::LocalLength`] for an atomic
//!   whose local buffer is not 8 bytes), a remote one with [`WcStatus::RemoteAccess`].
//! - **Atomics** act on 8-byte aligned words only (else [`WcStatus::RemoteInvalidRequest`]).
//!   By default the device reports [`AtomicCap::Hca`] and means it: an atomic is a load and a
//!   store under the device-wide lock of the process owning the memory, atomic against the
//!   other atomics of the emulated NIC (from any process) but **not** against the CPU's
//!   atomics or plain stores on the same word. With
//!   [`SoftOptions::glob`] (`CITRONFS_RDMA_SOFT_ATOMIC=glob`) they are CPU atomics and the
//!   device reports [`AtomicCap::Glob`]. [`SoftOptions::reply_be`]
//!   (`CITRONFS_RDMA_SOFT_REPLY_BE=1`) returns atomic results big-endian, as devices in a
//!   "reply BE" mode do.
//! - **Ordering** (InfiniBand RC): the responder executes a QP's requests in posting order,
//!   except that a request after an RDMA Read or an atomic may overtake it unless fenced. The
//!   emulation takes the most adversarial legal order: every unfenced Read and atomic is
//!   executed as late as it may be — just before the next fenced request, or at the end of its
//!   chain — so a Read returns what later Writes of its chain stored, and a Write lands before
//!   an earlier atomic, unless a fence says otherwise. Reads and atomics keep their order
//!   among themselves (weaker is legal on hardware; this is a stronger-than-required point).
//! - **Errors**: the first failed request completes with its error whether signalled or not,
//!   the QP moves to [`QpState::Error`], and every request after it — of this chain and of
//!   every later post — completes with [`WcStatus::Flushed`]. A request to a queue pair that
//!   no longer exists, or is not connected, completes with [`WcStatus::RetryExceeded`].
//! - **Completions** come in posting order; a successful unsignalled request gives none.
//!
//! What it cannot emulate: timing (a request is executed inside `post_send`, a round trip to
//! another process is a unix-socket exchange and its responder a scheduled thread), the NIC's
//! caches and its PCIe transactions (a multi-word Write tears only at 8-byte word boundaries
//! here; a real NIC may place bytes in any order within a request), peers on other hosts (one
//! host's processes only, of one user, in one pid namespace), a responder process that is
//! stopped rather than gone (its requesters wait up to `soft_link::RETRY_TIMEOUT` inside
//! `post_send` before retries are exceeded, where a NIC would keep answering for it), a
//! process forked after using soft (it keeps its parent's GID but not its socket), and
//! link-level faults other than a silent peer ([`stall`]).

use super::soft_link::{self, Link};
use super::verbs::{
    Access, AtomicCap, Device, DeviceAttrs, MemoryRegion, ProtectionDomain, Provider, QpAddress,
    QpState, QueuePair, WcStatus, WorkCompletion, WorkRequest, WrOp,
};
use crate::error::{FabricError, Result};
use crate::word_copy;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::Instant;

/// The environment variable choosing the soft device's atomicity: `glob` or `hca` (default).
pub const ENV_ATOMIC: &str = "CITRONFS_RDMA_SOFT_ATOMIC";
/// The environment variable making the soft device return atomic results big-endian (`1`).
pub const ENV_REPLY_BE: &str = "CITRONFS_RDMA_SOFT_REPLY_BE";
/// The environment variable choosing how requests to this process's own queue pairs travel:
/// `wire` (default: over the process's socket, as requests from other processes do) or
/// `direct` (a function call).
pub const ENV_LOOPBACK: &str = "CITRONFS_RDMA_SOFT_LOOPBACK";

/// How the soft device behaves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SoftOptions {
    /// Atomics are CPU atomics and the device reports `IBV_ATOMIC_GLOB`.
    pub glob: bool,
    /// Atomic results land big-endian.
    pub reply_be: bool,
    /// The device has no atomics (`IBV_ATOMIC_NONE`), as some iWARP devices.
    pub no_atomics: bool,
    /// Requests to this process's own queue pairs are function calls instead of socket
    /// exchanges: faster, but a round trip in the process then costs far less than one to
    /// another process, which a NIC's loopback does not (a server measuring its round trips
    /// through its loopback, as the meta server does for CITRON's `T_wait`, would measure
    /// the wrong thing for clients in other processes).
    pub direct_loopback: bool,
}

impl SoftOptions {
    /// The options the environment sets ([`ENV_ATOMIC`], [`ENV_REPLY_BE`]).
    pub fn from_env() -> Self {
        let atomic = std::env::var(ENV_ATOMIC).unwrap_or_default();
        SoftOptions {
            glob: atomic == "glob",
            no_atomics: atomic == "none",
            reply_be: std::env::var(ENV_REPLY_BE).is_ok_and(|v| v == "1"),
            direct_loopback: std::env::var(ENV_LOOPBACK).is_ok_and(|v| v == "direct"),
        }
    }
}

/// The soft provider.
#[derive(Clone, Copy, Debug, Default)]
pub struct SoftProvider {
    options: SoftOptions,
}

impl SoftProvider {
    /// A provider whose devices behave as `options` say.
    pub fn new(options: SoftOptions) -> Self {
        Self { options }
    }
}

/// Everything the emulated NICs of this process share: the "network".
struct SoftFabric {
    next_key: AtomicU32,
    next_qpn: AtomicU32,
    next_pd: AtomicU64,
    lkeys: RwLock<HashMap<u32, Arc<MrEntry>>>,
    rkeys: RwLock<HashMap<u32, Arc<MrEntry>>>,
    qps: RwLock<HashMap<u32, Arc<QpShared>>>,
    stalled: Mutex<HashSet<u32>>,
    /// What makes an `IBV_ATOMIC_HCA` atomic atomic: against the NIC's other atomics only.
    atomics: Mutex<()>,
}

fn fabric() -> &'static SoftFabric {
    static FABRIC: OnceLock<SoftFabric> = OnceLock::new();
    FABRIC.get_or_init(|| SoftFabric {
        next_key: AtomicU32::new(0x1000),
        next_qpn: AtomicU32::new(0x100),
        next_pd: AtomicU64::new(1),
        lkeys: RwLock::default(),
        rkeys: RwLock::default(),
        qps: RwLock::default(),
        stalled: Mutex::default(),
        atomics: Mutex::new(()),
    })
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Makes queue pair `qpn` silent (`on`) or normal again: requests posted on it are accepted
/// and never executed nor completed, as on a link whose peer stopped answering, so that
/// whoever waits for them must give up at its deadline. For tests.
pub fn stall(qpn: u32, on: bool) {
    let mut stalled = lock(&fabric().stalled);
    if on {
        stalled.insert(qpn);
    } else {
        stalled.remove(&qpn);
    }
}

/// The GID of this process's soft port: `fe80::`, a random nonce drawn once per process
/// (bytes 4..12) and the process id (bytes 12..16). Peers in other processes of the host find
/// the process's socket by it ([`soft_link`]).
fn gid() -> [u8; 16] {
    static NONCE: OnceLock<u64> = OnceLock::new();
    let nonce = *NONCE.get_or_init(rand::random::<u64>);
    let mut gid = [0u8; 16];
    gid[0] = 0xfe;
    gid[1] = 0x80;
    gid[4..12].copy_from_slice(&nonce.to_be_bytes());
    gid[12..].copy_from_slice(&std::process::id().to_be_bytes());
    gid
}

impl Provider for SoftProvider {
    fn name(&self) -> &'static str {
        "soft"
    }

    fn open(&self, name: Option<&str>) -> Result<Arc<dyn Device>> {
        if let Some(name) = name.filter(|n| *n != "soft0") {
            return Err(FabricError::Config(format!(
                "rdma: no device {name:?} (the soft provider has one device, soft0)"
            )));
        }
        let atomic_cap = if self.options.no_atomics {
            AtomicCap::None
        } else if self.options.glob {
            AtomicCap::Glob
        } else {
            AtomicCap::Hca
        };
        Ok(Arc::new(SoftDevice {
            options: self.options,
            attrs: DeviceAttrs {
                name: "soft0".into(),
                atomic_cap,
                max_qp_wr: 16_384,
                max_mr_size: u64::MAX,
                atomic_reply_be: self.options.reply_be,
            },
        }))
    }
}

struct SoftDevice {
    options: SoftOptions,
    attrs: DeviceAttrs,
}

impl Device for SoftDevice {
    fn attrs(&self) -> &DeviceAttrs {
        &self.attrs
    }

    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>> {
        Ok(Arc::new(SoftPd {
            id: fabric().next_pd.fetch_add(1, Ordering::Relaxed),
            options: self.options,
            max_qp_wr: self.attrs.max_qp_wr,
        }))
    }
}

struct SoftPd {
    id: u64,
    options: SoftOptions,
    max_qp_wr: u32,
}

struct MrEntry {
    addr: u64,
    len: u64,
    access: Access,
    pd: u64,
    /// Whether the registration still exists: read-held while its bytes move, so that
    /// deregistering waits for requests in flight on it (the memory may go right after).
    live: RwLock<bool>,
}

impl MrEntry {
    fn covers(&self, addr: u64, len: u32) -> bool {
        addr >= self.addr
            && addr
                .checked_add(u64::from(len))
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

struct SoftMr {
    entry: Arc<MrEntry>,
    lkey: u32,
    rkey: u32,
}

impl MemoryRegion for SoftMr {
    fn addr(&self) -> u64 {
        self.entry.addr
    }
    fn len(&self) -> u64 {
        self.entry.len
    }
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        write(&fabric().lkeys).remove(&self.lkey);
        write(&fabric().rkeys).remove(&self.rkey);
        // Waits for the requests moving bytes of it now; later ones find it dead.
        *write(&self.entry.live) = false;
    }
}

impl ProtectionDomain for SoftPd {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn MemoryRegion>> {
        // The emulation moves memory a word at a time; a NIC has no such need, but every
        // buffer of the backend is word-aligned anyway.
        if addr.is_null() || addr as usize % 8 != 0 || len % 8 != 0 {
            return Err(FabricError::Config(format!(
                "rdma: registration of {len} bytes at {addr:p} failed: the soft provider \
                 registers 8-byte aligned whole words only"
            )));
        }
        let f = fabric();
        let lkey = f.next_key.fetch_add(1, Ordering::Relaxed);
        // A different rkey, so that mixing the two up fails as on hardware.
        let rkey = lkey ^ 0x5a00_0000;
        let entry = Arc::new(MrEntry {
            addr: addr as u64,
            len: len as u64,
            access,
            pd: self.id,
            live: RwLock::new(true),
        });
        write(&f.lkeys).insert(lkey, entry.clone());
        write(&f.rkeys).insert(rkey, entry.clone());
        Ok(Box::new(SoftMr { entry, lkey, rkey }))
    }

    fn create_qp(&self, max_send_wr: u32) -> Result<Box<dyn QueuePair>> {
        if max_send_wr == 0 || max_send_wr > self.max_qp_wr {
            return Err(FabricError::Config(format!(
                "rdma: a queue pair of {max_send_wr} requests (the device allows 1 to {})",
                self.max_qp_wr
            )));
        }
        let f = fabric();
        // Peers (in other processes, and in this one unless `direct_loopback`) reach this queue
        // pair through the process's socket.
        soft_link::serve(gid());
        let qpn = f.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
        let shared = Arc::new(QpShared {
            pd: self.id,
            options: self.options,
            state: Mutex::new((QpState::Reset, Access(0))),
        });
        write(&f.qps).insert(qpn, shared.clone());
        Ok(Box::new(SoftQp {
            qpn,
            psn: rand::random::<u32>() & 0x00ff_ffff,
            shared,
            options: self.options,
            max_send_wr,
            remote: None,
            link: RefCell::default(),
            cq: VecDeque::new(),
        }))
    }
}

/// What the responder side of a queue pair needs of it: its domain, its device's options,
/// state and access flags.
struct QpShared {
    pd: u64,
    options: SoftOptions,
    state: Mutex<(QpState, Access)>,
}

struct SoftQp {
    qpn: u32,
    psn: u32,
    shared: Arc<QpShared>,
    options: SoftOptions,
    max_send_wr: u32,
    remote: Option<QpAddress>,
    /// The stream to the responder's process, where that is another process.
    link: RefCell<Link>,
    cq: VecDeque<WorkCompletion>,
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        write(&fabric().qps).remove(&self.qpn);
        stall(self.qpn, false);
    }
}

impl SoftQp {
    fn set_state(&self, from: &[QpState], to: QpState, access: Option<Access>) -> Result<()> {
        let mut state = lock(&self.shared.state);
        if !from.contains(&state.0) {
            return Err(FabricError::Config(format!(
                "rdma: queue pair {:#x} cannot move from {:?} to {to:?}",
                self.qpn, state.0
            )));
        }
        state.0 = to;
        if let Some(access) = access {
            state.1 = access;
        }
        Ok(())
    }

    /// Checks and executes one request; its status. The requester's side (the local buffer)
    /// is checked and moved here; the responder's side by [`respond`], in this process or,
    /// through [`Link`], in the responder's.
    fn run(&self, wr: &WorkRequest) -> WcStatus {
        let f = fabric();
        // The requester's side: the local buffer.
        let local = match read(&f.lkeys).get(&wr.lkey) {
            Some(mr) if mr.pd == self.shared.pd => mr.clone(),
            _ => return WcStatus::LocalProtection,
        };
        if wr.op.is_atomic() && wr.len != 8 {
            return WcStatus::LocalLength;
        }
        if !local.covers(wr.local_addr, wr.len)
            || (wr.op != WrOp::Write && !local.access.contains(Access::LOCAL_WRITE))
        {
            return WcStatus::LocalProtection;
        }
        // The responder: a connected queue pair of this "network".
        let Some(remote) = self.remote else {
            return WcStatus::RetryExceeded;
        };
        let mut payload = Vec::new();
        if wr.op == WrOp::Write {
            let live = read(&local.live);
            if !*live {
                return WcStatus::LocalProtection;
            }
            payload = vec![0u8; wr.len as usize];
            // SAFETY: the local range lies inside a registration that is live while `live` is
            // held, whose memory is valid, word-aligned and accessed atomically by everyone.
            unsafe { load_bytes(wr.local_addr, &mut payload) };
        }
        let ask = Ask {
            qpn: remote.qpn,
            op: wr.op,
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
            len: wr.len,
        };
        let direct = self.options.direct_loopback || !soft_link::serve(gid());
        let answer = if remote.gid == gid() && direct {
            respond(&ask, &payload)
        } else {
            self.link.borrow_mut().ask(&remote.gid, &ask, &payload)
        };
        let mut bytes = match answer {
            Ok(bytes) => bytes,
            Err(status) => return status,
        };
        if wr.op == WrOp::Write {
            return WcStatus::Success;
        }
        if bytes.len()
            != if wr.op.is_atomic() {
                8
            } else {
                wr.len as usize
            }
        {
            // Not what the responder's side ever answers: a corrupt answer.
            return WcStatus::RemoteOperation;
        }
        if wr.op.is_atomic() {
            let mut old = [0u8; 8];
            old.copy_from_slice(&bytes);
            let old = u64::from_le_bytes(old);
            bytes = if self.options.reply_be {
                old.to_be_bytes()
            } else {
                old.to_le_bytes()
            }
            .to_vec();
        }
        let live = read(&local.live);
        if !*live {
            return WcStatus::LocalProtection;
        }
        // SAFETY: as above; `bytes` is as long as the local range (a Read's `len`, or 8).
        unsafe { store_bytes(wr.local_addr, &bytes) };
        WcStatus::Success
    }

    /// Executes `chain` in the most adversarial order RC allows; returns the index of the
    /// first failed request and its status, if one failed.
    fn execute(&self, chain: &[WorkRequest]) -> Option<(usize, WcStatus)> {
        let mut deferred: Vec<usize> = Vec::new();
        let run_deferred = |deferred: &mut Vec<usize>, before: usize| {
            for &i in deferred.iter().filter(|&&i| i < before) {
                let status = self.run(&chain[i]);
                if status != WcStatus::Success {
                    return Some((i, status));
                }
            }
            deferred.retain(|&i| i >= before);
            None
        };
        for (i, wr) in chain.iter().enumerate() {
            if wr.fence {
                if let Some(failed) = run_deferred(&mut deferred, i) {
                    return Some(failed);
                }
            }
            if wr.op.may_be_overtaken() {
                deferred.push(i);
                continue;
            }
            let status = self.run(wr);
            if status != WcStatus::Success {
                // The responder executed every request before this one (deferred Reads and
                // atomics included): one of them may have failed first.
                return Some(run_deferred(&mut deferred, i).unwrap_or((i, status)));
            }
        }
        run_deferred(&mut deferred, chain.len())
    }
}

/// One request as its responder sees it, after the requester's local checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Ask {
    /// The responder's queue pair.
    pub qpn: u32,
    /// What to do.
    pub op: WrOp,
    /// Where, in the registration `rkey` names.
    pub remote_addr: u64,
    /// The remote registration's key.
    pub rkey: u32,
    /// Bytes moved (8 for an atomic).
    pub len: u32,
}

/// The responder's side of one request, executed in the process that owns the responder queue
/// pair and the memory: checks the queue pair (it must exist and be connected: else
/// [`WcStatus::RetryExceeded`], as from a peer that is gone), its access flags, the rkey, range
/// and access of the registration, then moves the bytes. Returns what a Read read or the old
/// value of an atomic (8 bytes, little-endian), or the request's failed status. A Write's bytes
/// are `payload`.
pub(super) fn respond(ask: &Ask, payload: &[u8]) -> std::result::Result<Vec<u8>, WcStatus> {
    let f = fabric();
    let responder = read(&f.qps)
        .get(&ask.qpn)
        .cloned()
        .ok_or(WcStatus::RetryExceeded)?;
    // Held until the request has executed: a responder moved to the error state executes
    // nothing after the move returns, as a NIC's after `ibv_modify_qp` (fencing relies on it).
    let responder_state = lock(&responder.state);
    let (state, qp_access) = *responder_state;
    if !matches!(state, QpState::Rtr | QpState::Rts) {
        return Err(WcStatus::RetryExceeded);
    }
    let need = match ask.op {
        WrOp::Read => Access::REMOTE_READ,
        WrOp::Write => Access::REMOTE_WRITE,
        WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. } => Access::REMOTE_ATOMIC,
    };
    if !qp_access.contains(need) {
        return Err(WcStatus::RemoteInvalidRequest);
    }
    if ask.op.is_atomic() && (ask.remote_addr % 8 != 0 || responder.options.no_atomics) {
        return Err(WcStatus::RemoteInvalidRequest);
    }
    let target = match read(&f.rkeys).get(&ask.rkey) {
        Some(mr)
            if mr.pd == responder.pd
                && mr.access.contains(need)
                && mr.covers(ask.remote_addr, ask.len) =>
        {
            mr.clone()
        }
        _ => return Err(WcStatus::RemoteAccess),
    };
    if ask.op == WrOp::Write && payload.len() != ask.len as usize {
        return Err(WcStatus::RemoteOperation);
    }
    // Held while the bytes move: the registration, and so its memory, stays valid
    // (`ProtectionDomain::register`'s contract) until this is released.
    let live = read(&target.live);
    if !*live {
        return Err(WcStatus::RemoteAccess);
    }
    let answer = match ask.op {
        WrOp::Read => {
            let mut bytes = vec![0u8; ask.len as usize];
            // SAFETY: the remote range lies inside a live registration (checked above), whose
            // memory is valid, word-aligned and accessed atomically by everyone.
            unsafe { load_bytes(ask.remote_addr, &mut bytes) };
            bytes
        }
        WrOp::Write => {
            // SAFETY: as for a Read.
            unsafe { store_bytes(ask.remote_addr, payload) };
            Vec::new()
        }
        WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. } => {
            // SAFETY: the word is aligned (checked) and inside a live registration.
            let word = unsafe { &*(ask.remote_addr as *const AtomicU64) };
            atomic(responder.options.glob, word, ask.op)
                .to_le_bytes()
                .to_vec()
        }
    };
    drop((live, responder_state));
    Ok(answer)
}

/// One atomic on `word`: with `glob`, a CPU atomic; otherwise a load and a store that only the
/// device's other atomics wait for (`IBV_ATOMIC_HCA`: a CPU's atomic or store on the same word
/// in between is lost, as it may be on hardware). Every atomic on a registration's words is
/// executed in the process that registered it ([`respond`]), so the process's device lock
/// orders all of them.
fn atomic(glob: bool, word: &AtomicU64, op: WrOp) -> u64 {
    let new = |old: u64| match op {
        WrOp::CompareSwap { compare, swap } => {
            if old == compare {
                swap
            } else {
                old
            }
        }
        WrOp::FetchAdd { add } => old.wrapping_add(add),
        WrOp::Read | WrOp::Write => old,
    };
    if glob {
        match word.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |old| Some(new(old))) {
            Ok(old) | Err(old) => old,
        }
    } else {
        let _device = lock(&fabric().atomics);
        let old = word.load(Ordering::SeqCst);
        let value = new(old);
        if value != old || matches!(op, WrOp::FetchAdd { .. }) {
            word.store(value, Ordering::SeqCst);
        }
        old
    }
}

impl QueuePair for SoftQp {
    fn address(&self) -> QpAddress {
        QpAddress {
            qpn: self.qpn,
            psn: self.psn,
            lid: 0,
            gid: gid(),
        }
    }

    fn state(&self) -> QpState {
        lock(&self.shared.state).0
    }

    fn to_init(&mut self, access: Access) -> Result<()> {
        self.set_state(&[QpState::Reset], QpState::Init, Some(access))
    }

    fn to_rtr(&mut self, remote: &QpAddress) -> Result<()> {
        self.set_state(&[QpState::Init], QpState::Rtr, None)?;
        self.remote = Some(*remote);
        Ok(())
    }

    fn to_rts(&mut self) -> Result<()> {
        self.set_state(&[QpState::Rtr], QpState::Rts, None)
    }

    fn to_error(&mut self) -> Result<()> {
        lock(&self.shared.state).0 = QpState::Error;
        Ok(())
    }

    fn post_send(&mut self, chain: &[WorkRequest]) -> Result<()> {
        let state = self.state();
        if !matches!(state, QpState::Rts | QpState::Error) {
            return Err(FabricError::Config(format!(
                "rdma: posting on queue pair {:#x} in state {state:?} (only RTS and ERROR \
                 accept requests)",
                self.qpn
            )));
        }
        if chain.len() + self.cq.len() > self.max_send_wr as usize {
            return Err(FabricError::Config(format!(
                "rdma: {} requests do not fit the send queue of {} on queue pair {:#x}",
                chain.len(),
                self.max_send_wr,
                self.qpn
            )));
        }
        if state == QpState::Error {
            self.cq.extend(chain.iter().map(|wr| WorkCompletion {
                wr_id: wr.wr_id,
                status: WcStatus::Flushed,
            }));
            return Ok(());
        }
        if lock(&fabric().stalled).contains(&self.qpn) {
            return Ok(());
        }
        let failed = self.execute(chain);
        for (i, wr) in chain.iter().enumerate() {
            let status = match failed {
                Some((at, status)) if at == i => status,
                Some((at, _)) if i > at => WcStatus::Flushed,
                _ if wr.signaled => WcStatus::Success,
                _ => continue,
            };
            self.cq.push_back(WorkCompletion {
                wr_id: wr.wr_id,
                status,
            });
        }
        if failed.is_some() {
            self.to_error()?;
        }
        Ok(())
    }

    fn poll(&mut self, deadline: Instant) -> Result<Option<WorkCompletion>> {
        if let Some(wc) = self.cq.pop_front() {
            return Ok(Some(wc));
        }
        // Requests execute inside `post_send`: a completion not here now never comes (a
        // stalled peer). Wait out the deadline as a poller would.
        let now = Instant::now();
        if deadline > now {
            std::thread::sleep(deadline - now);
        }
        Ok(None)
    }
}

/// Copies `out.len()` bytes at `addr` into `out`, each word loaded whole.
///
/// # Safety
/// Every word the range touches must be valid, 8-byte aligned memory, accessed by everyone
/// else atomically.
unsafe fn load_bytes(addr: u64, out: &mut [u8]) {
    let mut pos = addr as usize;
    let mut done = 0;
    if pos % 8 != 0 && !out.is_empty() {
        let start = pos & !7;
        let skip = pos - start;
        let take = (8 - skip).min(out.len());
        // SAFETY: the caller's contract covers the word holding the range's first byte.
        let bytes = unsafe { &*(start as *const AtomicU64) }
            .load(Ordering::Acquire)
            .to_le_bytes();
        out[..take].copy_from_slice(&bytes[skip..skip + take]);
        done = take;
        pos += take;
    }
    let whole = (out.len() - done) / 8 * 8;
    if whole > 0 {
        // SAFETY: `pos` is aligned and the `whole / 8` words from it are in the range.
        unsafe { word_copy::load_words(pos as *const AtomicU64, &mut out[done..done + whole]) };
        pos += whole;
        done += whole;
    }
    if done < out.len() {
        // SAFETY: the word holding the range's last byte.
        let bytes = unsafe { &*(pos as *const AtomicU64) }
            .load(Ordering::Acquire)
            .to_le_bytes();
        let take = out.len() - done;
        out[done..].copy_from_slice(&bytes[..take]);
    }
}

/// Stores `data` at `addr`: whole words stored whole, a partial word at either end merged with
/// a CAS loop.
///
/// # Safety
/// As [`load_bytes`].
unsafe fn store_bytes(addr: u64, data: &[u8]) {
    // SAFETY (of the closure's callers): `start` is an aligned word of the range.
    let merge = |start: usize, skip: usize, bytes: &[u8]| {
        // SAFETY: the caller's contract covers the word.
        let word = unsafe { &*(start as *const AtomicU64) };
        let _ = word.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |old| {
            let mut w = old.to_le_bytes();
            w[skip..skip + bytes.len()].copy_from_slice(bytes);
            Some(u64::from_le_bytes(w))
        });
    };
    let mut pos = addr as usize;
    let mut done = 0;
    if pos % 8 != 0 && !data.is_empty() {
        let start = pos & !7;
        let skip = pos - start;
        let take = (8 - skip).min(data.len());
        merge(start, skip, &data[..take]);
        done = take;
        pos += take;
    }
    let whole = (data.len() - done) / 8 * 8;
    if whole > 0 {
        // SAFETY: `pos` is aligned and the `whole / 8` words from it are in the range.
        unsafe { word_copy::store_words(pos as *const AtomicU64, &data[done..done + whole]) };
        pos += whole;
        done += whole;
    }
    if done < data.len() {
        merge(pos, 0, &data[done..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A registered buffer of `words` words.
    struct Buf {
        mr: Box<dyn MemoryRegion>,
        words: Box<[AtomicU64]>,
    }

    impl Buf {
        fn new(pd: &dyn ProtectionDomain, words: usize, access: Access) -> Self {
            let words: Box<[AtomicU64]> = (0..words).map(|_| AtomicU64::new(0)).collect();
            // SAFETY: the words live in `Buf` with the registration, which is dropped first
            // (field order), and are only accessed atomically.
            let mr =
                unsafe { pd.register(words.as_ptr() as *mut u8, words.len() * 8, access) }.unwrap();
            Buf { mr, words }
        }
        fn at(&self, byte: u64) -> u64 {
            self.mr.addr() + byte
        }
        fn word(&self, i: usize) -> u64 {
            self.words[i].load(Ordering::SeqCst)
        }
        fn set(&self, i: usize, v: u64) {
            self.words[i].store(v, Ordering::SeqCst)
        }
    }

    /// A client's and a server's protection domains and their connected queue pairs.
    type Pair = (
        Arc<dyn ProtectionDomain>,
        Arc<dyn ProtectionDomain>,
        Box<dyn QueuePair>,
        Box<dyn QueuePair>,
    );

    fn pair(provider: SoftProvider, server_access: Access) -> Pair {
        let dev = provider.open(None).unwrap();
        let cpd = dev.alloc_pd().unwrap();
        let spd = dev.alloc_pd().unwrap();
        let mut c = cpd.create_qp(64).unwrap();
        let mut s = spd.create_qp(64).unwrap();
        c.to_init(Access(0)).unwrap();
        s.to_init(server_access).unwrap();
        c.to_rtr(&s.address()).unwrap();
        s.to_rtr(&c.address()).unwrap();
        c.to_rts().unwrap();
        s.to_rts().unwrap();
        (cpd, spd, c, s)
    }

    fn wr(
        id: u64,
        op: WrOp,
        local: &Buf,
        at: u64,
        remote: &Buf,
        rat: u64,
        len: u32,
    ) -> WorkRequest {
        WorkRequest {
            wr_id: id,
            op,
            local_addr: local.at(at),
            len,
            lkey: local.mr.lkey(),
            remote_addr: remote.at(rat),
            rkey: remote.mr.rkey(),
            signaled: false,
            fence: false,
        }
    }

    fn drain(qp: &mut dyn QueuePair) -> Vec<WorkCompletion> {
        let mut all = Vec::new();
        while let Some(wc) = qp.poll(Instant::now()).unwrap() {
            all.push(wc);
        }
        all
    }

    fn post_one(qp: &mut dyn QueuePair, mut w: WorkRequest) -> WcStatus {
        w.signaled = true;
        qp.post_send(&[w]).unwrap();
        qp.poll(Instant::now())
            .unwrap()
            .expect("a completion")
            .status
    }

    #[test]
    fn queue_pairs_walk_the_rc_state_machine() {
        let dev = SoftProvider::default().open(None).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let mut qp = pd.create_qp(4).unwrap();
        assert_eq!(qp.state(), QpState::Reset);
        let remote = qp.address();
        assert!(qp.to_rtr(&remote).is_err(), "RESET -> RTR skips INIT");
        assert!(qp.post_send(&[]).is_err(), "posting in RESET");
        qp.to_init(Access::SERVED).unwrap();
        assert!(qp.to_rts().is_err(), "INIT -> RTS skips RTR");
        assert!(qp.post_send(&[]).is_err(), "posting in INIT");
        qp.to_rtr(&remote).unwrap();
        assert!(qp.post_send(&[]).is_err(), "posting in RTR");
        qp.to_rts().unwrap();
        qp.post_send(&[]).unwrap();
        assert!(pd.create_qp(0).is_err());
        assert!(SoftProvider::default().open(Some("mlx5_0")).is_err());
    }

    #[test]
    fn reads_writes_and_atomics_move_the_right_bytes() {
        let (cpd, spd, mut c, _s) = pair(SoftProvider::default(), Access::SERVED);
        let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
        let remote = Buf::new(&*spd, 8, Access::SERVED);
        local.set(0, 0x1122_3344_5566_7788);
        // An unaligned 5-byte write, then a read of it.
        assert_eq!(
            post_one(&mut *c, wr(1, WrOp::Write, &local, 1, &remote, 3, 5)),
            WcStatus::Success
        );
        // Bytes 1..6 of the local word (77 66 55 44 33, little-endian) at bytes 3..8.
        assert_eq!(remote.word(0), 0x3344_5566_7700_0000);
        assert_eq!(remote.word(1), 0);
        assert_eq!(
            post_one(&mut *c, wr(2, WrOp::Read, &local, 8, &remote, 0, 16)),
            WcStatus::Success
        );
        assert_eq!(
            (local.word(1), local.word(2)),
            (remote.word(0), remote.word(1))
        );
        remote.set(3, 10);
        let faa = WrOp::FetchAdd { add: 5 };
        assert_eq!(
            post_one(&mut *c, wr(3, faa, &local, 32, &remote, 24, 8)),
            WcStatus::Success
        );
        assert_eq!((local.word(4), remote.word(3)), (10, 15));
        let cas = WrOp::CompareSwap {
            compare: 15,
            swap: 99,
        };
        assert_eq!(
            post_one(&mut *c, wr(4, cas, &local, 32, &remote, 24, 8)),
            WcStatus::Success
        );
        assert_eq!((local.word(4), remote.word(3)), (15, 99));
        let miss = WrOp::CompareSwap {
            compare: 15,
            swap: 7,
        };
        assert_eq!(
            post_one(&mut *c, wr(5, miss, &local, 32, &remote, 24, 8)),
            WcStatus::Success
        );
        assert_eq!((local.word(4), remote.word(3)), (99, 99));
    }

    #[test]
    fn keys_ranges_and_access_flags_are_checked() {
        let provider = SoftProvider::default();
        // Each case on a fresh pair: a failure moves the QP to the error state.
        type Case = fn(&Buf, &Buf, &Buf, &Buf) -> (WorkRequest, WcStatus);
        let cases: Vec<Case> = vec![
            // A wrong rkey (the lkey instead).
            |l, r, _, _| {
                let mut w = wr(1, WrOp::Read, l, 0, r, 0, 8);
                w.rkey = r.mr.lkey();
                (w, WcStatus::RemoteAccess)
            },
            // Past the end of the remote registration.
            |l, r, _, _| (wr(1, WrOp::Read, l, 0, r, 60, 8), WcStatus::RemoteAccess),
            // A registration without remote write.
            |l, _, ro, _| (wr(1, WrOp::Write, l, 0, ro, 0, 8), WcStatus::RemoteAccess),
            // Nor atomics.
            |l, _, ro, _| {
                (
                    wr(1, WrOp::FetchAdd { add: 1 }, l, 0, ro, 0, 8),
                    WcStatus::RemoteAccess,
                )
            },
            // A misaligned atomic.
            |l, r, _, _| {
                (
                    wr(1, WrOp::FetchAdd { add: 1 }, l, 0, r, 4, 8),
                    WcStatus::RemoteInvalidRequest,
                )
            },
            // An atomic with a local buffer not of 8 bytes.
            |l, r, _, _| {
                (
                    wr(1, WrOp::FetchAdd { add: 1 }, l, 0, r, 0, 4),
                    WcStatus::LocalLength,
                )
            },
            // A read into a local buffer the NIC may not write.
            |_, r, _, lro| {
                (
                    wr(1, WrOp::Read, lro, 0, r, 0, 8),
                    WcStatus::LocalProtection,
                )
            },
            // Past the local registration.
            |l, r, _, _| (wr(1, WrOp::Read, l, 60, r, 0, 8), WcStatus::LocalProtection),
        ];
        for (n, case) in cases.into_iter().enumerate() {
            let (cpd, spd, mut c, _s) = pair(provider, Access::SERVED);
            let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
            let local_ro = Buf::new(&*cpd, 8, Access(0));
            let remote = Buf::new(&*spd, 8, Access::SERVED);
            let remote_ro = Buf::new(&*spd, 8, Access::REMOTE_READ);
            let (w, want) = case(&local, &remote, &remote_ro, &local_ro);
            assert_eq!(post_one(&mut *c, w), want, "case {n}");
            assert_eq!(c.state(), QpState::Error, "case {n}");
            assert_eq!(remote.word(0), 0, "case {n}: nothing landed");
        }
        // A key of another protection domain is refused too (the server's key, the client's
        // own domain as if it were the responder's).
        let (cpd, spd, mut c, _s) = pair(provider, Access::SERVED);
        let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
        let foreign = Buf::new(&*cpd, 8, Access::SERVED);
        let _remote = Buf::new(&*spd, 8, Access::SERVED);
        assert_eq!(
            post_one(&mut *c, wr(1, WrOp::Read, &local, 0, &foreign, 0, 8)),
            WcStatus::RemoteAccess
        );
        // The responder's queue pair must allow the operation as well.
        let (cpd, spd, mut c, _s) = pair(provider, Access::REMOTE_READ);
        let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
        let remote = Buf::new(&*spd, 8, Access::SERVED);
        assert_eq!(
            post_one(&mut *c, wr(1, WrOp::Write, &local, 0, &remote, 0, 8)),
            WcStatus::RemoteInvalidRequest
        );
    }

    #[test]
    fn an_error_moves_the_qp_to_error_and_flushes_what_follows() {
        let (cpd, spd, mut c, _s) = pair(SoftProvider::default(), Access::SERVED);
        let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
        let remote = Buf::new(&*spd, 8, Access::SERVED);
        local.set(0, 7);
        let good = wr(1, WrOp::Write, &local, 0, &remote, 0, 8);
        let bad = wr(2, WrOp::Write, &local, 0, &remote, 64, 8);
        let mut after = wr(3, WrOp::Write, &local, 0, &remote, 8, 8);
        after.signaled = true;
        c.post_send(&[good, bad, after]).unwrap();
        let got = drain(&mut *c);
        // The unsignalled good one says nothing; the failed one reports although unsignalled.
        assert_eq!(
            got,
            vec![
                WorkCompletion {
                    wr_id: 2,
                    status: WcStatus::RemoteAccess
                },
                WorkCompletion {
                    wr_id: 3,
                    status: WcStatus::Flushed
                },
            ]
        );
        assert_eq!(
            (remote.word(0), remote.word(1)),
            (7, 0),
            "before ran, after did not"
        );
        assert_eq!(c.state(), QpState::Error);
        // Everything later is flushed, signalled or not.
        c.post_send(&[good, good]).unwrap();
        assert_eq!(
            drain(&mut *c)
                .iter()
                .filter(|w| w.status == WcStatus::Flushed)
                .count(),
            2
        );
        assert_eq!(remote.word(0), 7);
    }

    #[test]
    fn a_later_request_overtakes_an_unfenced_read() {
        let (cpd, spd, mut c, _s) = pair(SoftProvider::default(), Access::SERVED);
        let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
        let remote = Buf::new(&*spd, 8, Access::SERVED);
        local.set(0, 1);
        local.set(1, 2);
        let w1 = wr(1, WrOp::Write, &local, 0, &remote, 0, 8);
        let r = wr(2, WrOp::Read, &local, 16, &remote, 0, 8);
        let mut w2 = wr(3, WrOp::Write, &local, 8, &remote, 0, 8);
        w2.signaled = true;
        // Write then Read is ordered; the Read may see the Write after it.
        c.post_send(&[w1, r, w2]).unwrap();
        assert_eq!(drain(&mut *c).len(), 1);
        assert_eq!(local.word(2), 2, "the unfenced Read saw the later Write");
        // With the fence on the later Write, the Read sees only what came before it.
        remote.set(0, 0);
        w2.fence = true;
        c.post_send(&[w1, r, w2]).unwrap();
        drain(&mut *c);
        assert_eq!(local.word(2), 1, "the fenced Write waited for the Read");
        assert_eq!(remote.word(0), 2);
    }

    #[test]
    fn a_later_write_overtakes_an_unfenced_atomic() {
        let (cpd, spd, mut c, _s) = pair(SoftProvider::default(), Access::SERVED);
        let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
        let remote = Buf::new(&*spd, 8, Access::SERVED);
        local.set(0, 100);
        let faa = wr(1, WrOp::FetchAdd { add: 1 }, &local, 8, &remote, 0, 8);
        let mut w = wr(2, WrOp::Write, &local, 0, &remote, 0, 8);
        w.signaled = true;
        c.post_send(&[faa, w]).unwrap();
        drain(&mut *c);
        assert_eq!(
            (local.word(1), remote.word(0)),
            (100, 101),
            "the Write went first"
        );
        remote.set(0, 0);
        w.fence = true;
        c.post_send(&[faa, w]).unwrap();
        drain(&mut *c);
        assert_eq!(
            (local.word(1), remote.word(0)),
            (0, 100),
            "fenced: in posting order"
        );
        // Atomics keep their order among themselves, and a Read after a Write sees it.
        let w0 = wr(3, WrOp::Write, &local, 0, &remote, 0, 8);
        let cas = wr(
            4,
            WrOp::CompareSwap {
                compare: 100,
                swap: 5,
            },
            &local,
            8,
            &remote,
            0,
            8,
        );
        let mut r = wr(5, WrOp::Read, &local, 16, &remote, 0, 8);
        r.signaled = true;
        c.post_send(&[w0, cas, faa, r]).unwrap();
        drain(&mut *c);
        assert_eq!((local.word(1), local.word(2)), (5, 6));
    }

    #[test]
    fn an_error_in_a_deferred_read_comes_first() {
        let (cpd, spd, mut c, _s) = pair(SoftProvider::default(), Access::SERVED);
        let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
        let remote = Buf::new(&*spd, 8, Access::SERVED);
        let bad_read = wr(1, WrOp::Read, &local, 0, &remote, 64, 8);
        let bad_write = wr(2, WrOp::Write, &local, 0, &remote, 64, 8);
        c.post_send(&[bad_read, bad_write]).unwrap();
        let got = drain(&mut *c);
        assert_eq!(
            got[0],
            WorkCompletion {
                wr_id: 1,
                status: WcStatus::RemoteAccess
            }
        );
        assert_eq!(got[1].status, WcStatus::Flushed);
    }

    #[test]
    fn a_silent_peer_times_out_and_a_gone_one_exceeds_retries() {
        let (cpd, spd, mut c, s) = pair(SoftProvider::default(), Access::SERVED);
        let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
        let remote = Buf::new(&*spd, 8, Access::SERVED);
        stall(c.address().qpn, true);
        let mut w = wr(1, WrOp::Read, &local, 0, &remote, 0, 8);
        w.signaled = true;
        c.post_send(&[w]).unwrap();
        let start = Instant::now();
        assert_eq!(c.poll(start + Duration::from_millis(50)).unwrap(), None);
        assert!(start.elapsed() >= Duration::from_millis(50));
        stall(c.address().qpn, false);
        drop(s);
        assert_eq!(post_one(&mut *c, w), WcStatus::RetryExceeded);
    }

    #[test]
    fn atomic_capability_and_reply_byte_order() {
        let dev = SoftProvider::default().open(None).unwrap();
        assert_eq!(dev.attrs().atomic_cap, AtomicCap::Hca);
        let glob = SoftOptions {
            glob: true,
            ..SoftOptions::default()
        };
        let dev = SoftProvider::new(glob).open(None).unwrap();
        assert_eq!(dev.attrs().atomic_cap, AtomicCap::Glob);
        let none = SoftOptions {
            no_atomics: true,
            ..SoftOptions::default()
        };
        assert_eq!(
            SoftProvider::new(none)
                .open(None)
                .unwrap()
                .attrs()
                .atomic_cap,
            AtomicCap::None
        );
        let be = SoftOptions {
            reply_be: true,
            ..SoftOptions::default()
        };
        let (cpd, spd, mut c, _s) = pair(SoftProvider::new(be), Access::SERVED);
        let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
        let remote = Buf::new(&*spd, 8, Access::SERVED);
        remote.set(0, 0x0102);
        let faa = wr(1, WrOp::FetchAdd { add: 1 }, &local, 0, &remote, 0, 8);
        assert_eq!(post_one(&mut *c, faa), WcStatus::Success);
        assert_eq!(local.word(0), 0x0102u64.swap_bytes());
        assert_eq!(remote.word(0), 0x0103);
    }

    #[test]
    fn hca_atomics_are_atomic_among_themselves() {
        // Over the process's socket (the default) and by function calls.
        for direct_loopback in [false, true] {
            hca_atomics_are_atomic(SoftOptions {
                direct_loopback,
                ..SoftOptions::default()
            });
        }
    }

    fn hca_atomics_are_atomic(options: SoftOptions) {
        let provider = SoftProvider::new(options);
        let dev = provider.open(None).unwrap();
        let spd = dev.alloc_pd().unwrap();
        let remote = Arc::new(Buf::new(&*spd, 1, Access::SERVED));
        std::thread::scope(|s| {
            for _ in 0..4 {
                let remote = remote.clone();
                let dev = dev.clone();
                let spd = spd.clone();
                s.spawn(move || {
                    let cpd = dev.alloc_pd().unwrap();
                    let mut c = cpd.create_qp(4).unwrap();
                    let mut srv = spd.create_qp(4).unwrap();
                    c.to_init(Access(0)).unwrap();
                    srv.to_init(Access::SERVED).unwrap();
                    c.to_rtr(&srv.address()).unwrap();
                    srv.to_rtr(&c.address()).unwrap();
                    c.to_rts().unwrap();
                    srv.to_rts().unwrap();
                    let local = Buf::new(&*cpd, 1, Access::LOCAL_WRITE);
                    for _ in 0..2000 {
                        let w = wr(1, WrOp::FetchAdd { add: 1 }, &local, 0, &remote, 0, 8);
                        assert_eq!(post_one(&mut *c, w), WcStatus::Success);
                    }
                });
            }
        });
        assert_eq!(remote.word(0), 8000);
    }

    #[test]
    fn registrations_must_be_whole_words() {
        let dev = SoftProvider::default().open(None).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let mut buf = [0u64; 2];
        let p = buf.as_mut_ptr() as *mut u8;
        // SAFETY: `buf` outlives the (failed) registrations.
        unsafe {
            assert!(pd.register(p.wrapping_add(1), 8, Access::SERVED).is_err());
            assert!(pd.register(p, 12, Access::SERVED).is_err());
            assert!(pd.register(p, 16, Access::SERVED).is_ok());
        }
    }

    // Peers in other processes: a child process (this test binary, running
    // `responder_child`) registers memory and serves queue pairs; this process posts to them.

    const ENV_CHILD: &str = "CITRONFS_SOFT_TEST_RESPONDER";
    const ENV_QPS: &str = "CITRONFS_SOFT_TEST_QPS";
    /// Words the child serves.
    const CHILD_WORDS: usize = 64;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn unhex(s: &str) -> [u8; 16] {
        let mut out = [0u8; 16];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
        }
        out
    }

    /// The child's side: serves `CITRONFS_SOFT_TEST_QPS` queue pairs and a region of
    /// `CHILD_WORDS` words, and obeys commands on stdin. Run normally, it does nothing.
    #[test]
    fn responder_child() {
        use std::io::BufRead;
        if std::env::var_os(ENV_CHILD).is_none() {
            return;
        }
        let n: usize = std::env::var(ENV_QPS).unwrap().parse().unwrap();
        let dev = SoftProvider::default().open(None).unwrap();
        let spd = dev.alloc_pd().unwrap();
        let words: Box<[AtomicU64]> = (0..CHILD_WORDS).map(|_| AtomicU64::new(0)).collect();
        // SAFETY: `words` outlives the registration (dropped explicitly or first, below).
        let mut mr = Some(
            unsafe { spd.register(words.as_ptr() as *mut u8, CHILD_WORDS * 8, Access::SERVED) }
                .unwrap(),
        );
        let mut qps: Vec<Box<dyn QueuePair>> = (0..n)
            .map(|_| {
                let mut qp = spd.create_qp(64).unwrap();
                qp.to_init(Access::SERVED).unwrap();
                qp
            })
            .collect();
        let m = mr.as_ref().unwrap();
        let qpns: Vec<String> = qps.iter().map(|q| q.address().qpn.to_string()).collect();
        println!(
            "READY {} {} {} {}",
            m.rkey(),
            m.addr(),
            hex(&qps[0].address().gid),
            qpns.join(" ")
        );
        let mut lines = std::io::stdin().lock().lines();
        // PEER <gid> <qpn>...: the parent's queue pairs, one for each of ours.
        let line = lines.next().unwrap().unwrap();
        let mut parts = line.split_whitespace().skip(1);
        let gid = unhex(parts.next().unwrap());
        for qp in qps.iter_mut() {
            let qpn = parts.next().unwrap().parse().unwrap();
            qp.to_rtr(&QpAddress {
                qpn,
                psn: 0,
                lid: 0,
                gid,
            })
            .unwrap();
            qp.to_rts().unwrap();
        }
        println!("CONNECTED");
        for line in lines {
            let line = line.unwrap();
            let words_of: Vec<&str> = line.split_whitespace().collect();
            match words_of.as_slice() {
                ["word", i] => {
                    let i: usize = i.parse().unwrap();
                    println!("WORD {}", words[i].load(Ordering::SeqCst));
                }
                ["faa", count] => {
                    // Fetch-and-adds on word 0 from this process's own queue pairs.
                    let count: usize = count.parse().unwrap();
                    let cpd = dev.alloc_pd().unwrap();
                    let mut c = cpd.create_qp(4).unwrap();
                    let mut srv = spd.create_qp(4).unwrap();
                    c.to_init(Access(0)).unwrap();
                    srv.to_init(Access::SERVED).unwrap();
                    c.to_rtr(&srv.address()).unwrap();
                    srv.to_rtr(&c.address()).unwrap();
                    c.to_rts().unwrap();
                    srv.to_rts().unwrap();
                    let local = Buf::new(&*cpd, 1, Access::LOCAL_WRITE);
                    let m = mr.as_ref().unwrap();
                    for _ in 0..count {
                        let w = WorkRequest {
                            wr_id: 1,
                            op: WrOp::FetchAdd { add: 1 },
                            local_addr: local.at(0),
                            len: 8,
                            lkey: local.mr.lkey(),
                            remote_addr: m.addr(),
                            rkey: m.rkey(),
                            signaled: true,
                            fence: false,
                        };
                        assert_eq!(post_one(&mut *c, w), WcStatus::Success);
                    }
                    println!("DONE");
                }
                ["dereg"] => {
                    mr = None;
                    println!("OK");
                }
                ["destroy"] => {
                    qps.clear();
                    println!("OK");
                }
                _ => panic!("unknown command {line:?}"),
            }
        }
        drop(mr);
        drop(words);
    }

    /// A running child and what it serves.
    struct Child {
        process: std::process::Child,
        stdin: std::process::ChildStdin,
        stdout: std::io::BufReader<std::process::ChildStdout>,
        rkey: u32,
        addr: u64,
    }

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.process.kill();
            let _ = self.process.wait();
        }
    }

    impl Child {
        /// Starts a child serving `n` queue pairs and connects `n` of ours, in `cpd`, to them.
        fn spawn(cpd: &dyn ProtectionDomain, n: usize) -> (Child, Vec<Box<dyn QueuePair>>) {
            use std::process::{Command, Stdio};
            let mut process = Command::new(std::env::current_exe().unwrap())
                .args([
                    "rdma::soft::tests::responder_child",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(ENV_CHILD, "1")
                .env(ENV_QPS, n.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let stdin = process.stdin.take().unwrap();
            let stdout = std::io::BufReader::new(process.stdout.take().unwrap());
            let mut child = Child {
                process,
                stdin,
                stdout,
                rkey: 0,
                addr: 0,
            };
            let ready = child.expect("READY ");
            let mut parts = ready.split_whitespace();
            child.rkey = parts.next().unwrap().parse().unwrap();
            child.addr = parts.next().unwrap().parse().unwrap();
            let gid = unhex(parts.next().unwrap());
            let mut ours = Vec::new();
            for part in parts {
                let mut qp = cpd.create_qp(64).unwrap();
                qp.to_init(Access(0)).unwrap();
                qp.to_rtr(&QpAddress {
                    qpn: part.parse().unwrap(),
                    psn: 0,
                    lid: 0,
                    gid,
                })
                .unwrap();
                qp.to_rts().unwrap();
                ours.push(qp);
            }
            let qpns: Vec<String> = ours.iter().map(|q| q.address().qpn.to_string()).collect();
            child.send(&format!(
                "PEER {} {}",
                hex(&ours[0].address().gid),
                qpns.join(" ")
            ));
            child.expect("CONNECTED");
            (child, ours)
        }

        fn send(&mut self, line: &str) {
            use std::io::Write;
            writeln!(self.stdin, "{line}").unwrap();
            self.stdin.flush().unwrap();
        }

        /// The rest of the first line of output holding `tag`, after it.
        fn expect(&mut self, tag: &str) -> String {
            use std::io::BufRead;
            loop {
                let mut line = String::new();
                assert!(
                    self.stdout.read_line(&mut line).unwrap() > 0,
                    "the child exited before {tag:?}"
                );
                if let Some(at) = line.find(tag) {
                    return line[at + tag.len()..].trim().to_string();
                }
            }
        }

        fn word(&mut self, i: usize) -> u64 {
            self.send(&format!("word {i}"));
            self.expect("WORD ").parse().unwrap()
        }

        /// A request from `local` (byte `at`) to the child's region (byte `rat`).
        fn wr(&self, id: u64, op: WrOp, local: &Buf, at: u64, rat: u64, len: u32) -> WorkRequest {
            WorkRequest {
                wr_id: id,
                op,
                local_addr: local.at(at),
                len,
                lkey: local.mr.lkey(),
                remote_addr: self.addr + rat,
                rkey: self.rkey,
                signaled: false,
                fence: false,
            }
        }
    }

    #[test]
    fn a_responder_in_another_process_runs_the_verbs_and_checks_them() {
        let dev = SoftProvider::default().open(None).unwrap();
        let cpd = dev.alloc_pd().unwrap();
        let (mut child, mut qps) = Child::spawn(&*cpd, 4);
        let local = Buf::new(&*cpd, 8, Access::LOCAL_WRITE);
        let c = &mut *qps[0];
        local.set(0, 0x1122_3344_5566_7788);
        assert_eq!(
            post_one(c, child.wr(1, WrOp::Write, &local, 1, 3, 5)),
            WcStatus::Success
        );
        assert_eq!(child.word(0), 0x3344_5566_7700_0000);
        assert_eq!(
            post_one(c, child.wr(2, WrOp::Read, &local, 8, 0, 16)),
            WcStatus::Success
        );
        assert_eq!((local.word(1), local.word(2)), (0x3344_5566_7700_0000, 0));
        let faa = WrOp::FetchAdd { add: 5 };
        assert_eq!(
            post_one(c, child.wr(3, faa, &local, 32, 24, 8)),
            WcStatus::Success
        );
        let cas = WrOp::CompareSwap {
            compare: 5,
            swap: 99,
        };
        assert_eq!(
            post_one(c, child.wr(4, cas, &local, 40, 24, 8)),
            WcStatus::Success
        );
        assert_eq!((local.word(4), local.word(5), child.word(3)), (0, 5, 99));
        // The adversarial order holds across processes too: an unfenced Read sees a later
        // Write of its chain.
        local.set(6, 7);
        let r = child.wr(5, WrOp::Read, &local, 56, 16, 8);
        let mut w = child.wr(6, WrOp::Write, &local, 48, 16, 8);
        w.signaled = true;
        c.post_send(&[r, w]).unwrap();
        assert_eq!(drain(c).len(), 1);
        assert_eq!(local.word(7), 7, "the unfenced Read saw the later Write");

        // A remote access error (past the region), then everything after it flushed.
        let c = &mut *qps[1];
        let bad = child.wr(7, WrOp::Read, &local, 0, CHILD_WORDS as u64 * 8, 8);
        assert_eq!(post_one(c, bad), WcStatus::RemoteAccess);
        assert_eq!(c.state(), QpState::Error);
        let ok = child.wr(8, WrOp::Read, &local, 0, 0, 8);
        assert_eq!(post_one(c, ok), WcStatus::Flushed);
        // A misaligned atomic, and a wrong rkey.
        let c = &mut *qps[2];
        let faa = child.wr(9, WrOp::FetchAdd { add: 1 }, &local, 0, 4, 8);
        assert_eq!(post_one(c, faa), WcStatus::RemoteInvalidRequest);
        // Deregistered behind our back: a remote access error.
        child.send("dereg");
        child.expect("OK");
        let c = &mut *qps[3];
        assert_eq!(post_one(c, ok), WcStatus::RemoteAccess);
        // The responder's queue pairs destroyed: retries exceeded.
        let (mut child, mut qps) = Child::spawn(&*cpd, 1);
        let ok = child.wr(10, WrOp::Read, &local, 0, 0, 8);
        assert_eq!(post_one(&mut *qps[0], ok), WcStatus::Success);
        child.send("destroy");
        child.expect("OK");
        assert_eq!(post_one(&mut *qps[0], ok), WcStatus::RetryExceeded);
    }

    #[test]
    fn atomics_from_two_processes_lose_no_update() {
        const EACH: usize = 2000;
        let dev = SoftProvider::default().open(None).unwrap();
        let cpd = dev.alloc_pd().unwrap();
        let (mut child, qps) = Child::spawn(&*cpd, 2);
        let (rkey, addr) = (child.rkey, child.addr);
        // The child adds from its own queue pairs while two threads here add from theirs.
        child.send(&format!("faa {EACH}"));
        std::thread::scope(|s| {
            for mut qp in qps {
                let cpd = cpd.clone();
                s.spawn(move || {
                    let local = Buf::new(&*cpd, 1, Access::LOCAL_WRITE);
                    for _ in 0..EACH {
                        let w = WorkRequest {
                            wr_id: 1,
                            op: WrOp::FetchAdd { add: 1 },
                            local_addr: local.at(0),
                            len: 8,
                            lkey: local.mr.lkey(),
                            remote_addr: addr,
                            rkey,
                            signaled: true,
                            fence: false,
                        };
                        assert_eq!(post_one(&mut *qp, w), WcStatus::Success);
                    }
                });
            }
        });
        child.expect("DONE");
        assert_eq!(child.word(0), 3 * EACH as u64);
    }

    #[test]
    fn a_peer_killed_mid_run_exceeds_retries_without_a_hang() {
        let dev = SoftProvider::default().open(None).unwrap();
        let cpd = dev.alloc_pd().unwrap();
        let (mut child, mut qps) = Child::spawn(&*cpd, 1);
        let mut qp = qps.pop().unwrap();
        let done = Arc::new(AtomicU64::new(0));
        let (rkey, addr) = (child.rkey, child.addr);
        let counter = done.clone();
        let poster = std::thread::spawn(move || {
            let local = Buf::new(&*cpd, 1, Access::LOCAL_WRITE);
            let w = WorkRequest {
                wr_id: 1,
                op: WrOp::FetchAdd { add: 1 },
                local_addr: local.at(0),
                len: 8,
                lkey: local.mr.lkey(),
                remote_addr: addr,
                rkey,
                signaled: true,
                fence: false,
            };
            loop {
                let status = post_one(&mut *qp, w);
                if status != WcStatus::Success {
                    // Later requests are flushed: the queue pair is in error.
                    return (status, post_one(&mut *qp, w), qp.state());
                }
                counter.fetch_add(1, Ordering::SeqCst);
            }
        });
        let start = Instant::now();
        while done.load(Ordering::SeqCst) < 100 {
            assert!(start.elapsed() < Duration::from_secs(30), "no progress");
            std::thread::sleep(Duration::from_millis(1));
        }
        child.process.kill().unwrap();
        child.process.wait().unwrap();
        let killed = Instant::now();
        let (status, after, state) = poster.join().unwrap();
        assert_eq!(status, WcStatus::RetryExceeded);
        assert_eq!(after, WcStatus::Flushed);
        assert_eq!(state, QpState::Error);
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "the poster noticed the dead peer only after {:?}",
            killed.elapsed()
        );
    }
}
