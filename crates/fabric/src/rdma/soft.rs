//! The `soft` provider: an in-process emulation of an RDMA NIC with a real NIC's semantics and
//! no stronger ones, so that every line of the `rdma` backend above the verbs runs in CI, and
//! code that relies on what hardware does not promise fails here as it would there.
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
//!   store under a device-wide lock, atomic against the other atomics of the emulated NIC but
//!   **not** against the CPU's atomics or plain stores on the same word. With
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
//! What it cannot emulate: timing (a request is executed on the poster's thread, inside
//! `post_send`), the NIC's caches and its PCIe transactions (a multi-word Write tears only at
//! 8-byte word boundaries here; a real NIC may place bytes in any order within a request), peers
//! in other processes (the queue pairs and registrations of one process only), and link-level
//! faults other than a silent peer ([`stall`]).

use super::verbs::{
    Access, AtomicCap, Device, DeviceAttrs, MemoryRegion, ProtectionDomain, Provider, QpAddress,
    QpState, QueuePair, WcStatus, WorkCompletion, WorkRequest, WrOp,
};
use crate::error::{FabricError, Result};
use crate::word_copy;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::Instant;

/// The environment variable choosing the soft device's atomicity: `glob` or `hca` (default).
pub const ENV_ATOMIC: &str = "CITRONFS_RDMA_SOFT_ATOMIC";
/// The environment variable making the soft device return atomic results big-endian (`1`).
pub const ENV_REPLY_BE: &str = "CITRONFS_RDMA_SOFT_REPLY_BE";

/// How the soft device behaves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SoftOptions {
    /// Atomics are CPU atomics and the device reports `IBV_ATOMIC_GLOB`.
    pub glob: bool,
    /// Atomic results land big-endian.
    pub reply_be: bool,
    /// The device has no atomics (`IBV_ATOMIC_NONE`), as some iWARP devices.
    pub no_atomics: bool,
}

impl SoftOptions {
    /// The options the environment sets ([`ENV_ATOMIC`], [`ENV_REPLY_BE`]).
    pub fn from_env() -> Self {
        let atomic = std::env::var(ENV_ATOMIC).unwrap_or_default();
        SoftOptions {
            glob: atomic == "glob",
            no_atomics: atomic == "none",
            reply_be: std::env::var(ENV_REPLY_BE).is_ok_and(|v| v == "1"),
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

/// The GID of this process's soft port: `fe80::` and the process id.
fn gid() -> [u8; 16] {
    let mut gid = [0u8; 16];
    gid[0] = 0xfe;
    gid[1] = 0x80;
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
        let qpn = f.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
        let shared = Arc::new(QpShared {
            pd: self.id,
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
            cq: VecDeque::new(),
        }))
    }
}

/// What the responder side of a queue pair needs of it: its domain, state and access flags.
struct QpShared {
    pd: u64,
    state: Mutex<(QpState, Access)>,
}

struct SoftQp {
    qpn: u32,
    psn: u32,
    shared: Arc<QpShared>,
    options: SoftOptions,
    max_send_wr: u32,
    remote: Option<QpAddress>,
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

    /// Checks and executes one request; its status.
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
        let responder = match read(&f.qps).get(&remote.qpn) {
            Some(qp) if remote.gid == gid() => qp.clone(),
            _ => return WcStatus::RetryExceeded,
        };
        // Held until the request has executed: a responder moved to the error state executes
        // nothing after the move returns, as a NIC's after `ibv_modify_qp` (a fence relies on it).
        let responder_state = lock(&responder.state);
        let (state, qp_access) = *responder_state;
        if !matches!(state, QpState::Rtr | QpState::Rts) {
            return WcStatus::RetryExceeded;
        }
        let need = match wr.op {
            WrOp::Read => Access::REMOTE_READ,
            WrOp::Write => Access::REMOTE_WRITE,
            WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. } => Access::REMOTE_ATOMIC,
        };
        if !qp_access.contains(need) {
            return WcStatus::RemoteInvalidRequest;
        }
        if wr.op.is_atomic() && (wr.remote_addr % 8 != 0 || self.options.no_atomics) {
            return WcStatus::RemoteInvalidRequest;
        }
        let target = match read(&f.rkeys).get(&wr.rkey) {
            Some(mr)
                if mr.pd == responder.pd
                    && mr.access.contains(need)
                    && mr.covers(wr.remote_addr, wr.len) =>
            {
                mr.clone()
            }
            _ => return WcStatus::RemoteAccess,
        };
        // `local` and `target` are held until the end: both registrations stay alive, and
        // their memory valid (`ProtectionDomain::register`'s contract), while the bytes move.
        match wr.op {
            WrOp::Read => {
                let mut bytes = vec![0u8; wr.len as usize];
                // SAFETY: the remote range lies inside a live registration (checked above),
                // whose memory is valid, word-aligned and accessed atomically by everyone.
                unsafe { load_bytes(wr.remote_addr, &mut bytes) };
                // SAFETY: as above, for the local registration.
                unsafe { store_bytes(wr.local_addr, &bytes) };
            }
            WrOp::Write => {
                let mut bytes = vec![0u8; wr.len as usize];
                // SAFETY: as for a Read, the roles swapped.
                unsafe { load_bytes(wr.local_addr, &mut bytes) };
                // SAFETY: as above.
                unsafe { store_bytes(wr.remote_addr, &bytes) };
            }
            WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. } => {
                // SAFETY: the word is aligned (checked) and inside a live registration.
                let word = unsafe { &*(wr.remote_addr as *const AtomicU64) };
                let old = self.atomic(word, wr.op);
                let reply = if self.options.reply_be {
                    old.to_be_bytes()
                } else {
                    old.to_le_bytes()
                };
                // SAFETY: the local range (8 bytes) lies inside a live registration.
                unsafe { store_bytes(wr.local_addr, &reply) };
            }
        }
        drop((local, target, responder_state));
        WcStatus::Success
    }

    /// One atomic on `word`: with `glob`, a CPU atomic; otherwise a load and a store that only
    /// the device's other atomics wait for (`IBV_ATOMIC_HCA`: a CPU's atomic or store on the
    /// same word in between is lost, as it may be on hardware).
    fn atomic(&self, word: &AtomicU64, op: WrOp) -> u64 {
        let new = |old: u64| match op {
            WrOp::CompareSwap { compare, swap } => {
                if old == compare {
                    swap
                } else {
                    old
                }
            }
            WrOp::FetchAdd { add } => old.wrapping_add(add),
            WrOp::Read | WrOp::Write => unreachable!("not an atomic"),
        };
        if self.options.glob {
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
        let provider = SoftProvider::default();
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
}
