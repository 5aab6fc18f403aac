//! The `ibverbs` provider: the verbs interface ([`super::verbs`]) over libibverbs, through
//! `rdma-sys`, and nothing else — every rule of the backend lives above it and runs in CI on
//! the `soft` provider. This file has never run against a device on this project's machines
//! (none has one: `ibv_get_device_list` fails with ENOSYS); its tests skip themselves visibly
//! there. docs/RDMA.md keeps the table of what has run on hardware.
//!
//! Port 1 of the device is used; the GID index is [`ENV_GID_INDEX`] (default 0; RoCE v2 GIDs
//! are often at index 1 or 3: `show_gids`). Queue pairs are RC with one send CQ each and no
//! receive queue in use.

use super::verbs::{
    Access, AtomicCap, Device, DeviceAttrs, MemoryRegion, ProtectionDomain, Provider, QpAddress,
    QpState, QueuePair, WcStatus, WorkCompletion, WorkRequest, WrOp,
};
use crate::error::{FabricError, Result};
use rdma_sys as ibv;
use std::ffi::CStr;
use std::sync::Arc;
use std::time::Instant;

/// The environment variable choosing the GID index of port 1 (default 0).
pub const ENV_GID_INDEX: &str = "CITRONFS_RDMA_GID_INDEX";

/// The port every queue pair uses.
const PORT: u8 = 1;

/// The libibverbs provider.
#[derive(Clone, Copy, Debug, Default)]
pub struct IbverbsProvider;

fn os_error(what: &str) -> FabricError {
    let e = std::io::Error::last_os_error();
    let hint = match e.raw_os_error() {
        Some(libc::ENOSYS) => {
            " (no kernel support for RDMA on this machine: no device, no rxe/siw)"
        }
        Some(libc::ENOMEM) => " (out of memory, or the locked-memory limit: ulimit -l)",
        Some(libc::EPERM) | Some(libc::EACCES) => " (not permitted: /dev/infiniband access?)",
        _ => "",
    };
    FabricError::Config(format!("rdma: {what}: {e}{hint}"))
}

struct Context {
    ctx: *mut ibv::ibv_context,
}

// SAFETY: an ibv_context is safe to use from any thread (libibverbs is thread-safe).
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `ctx` was opened by ibv_open_device and everything made from it holds an
        // `Arc` of this context, so nothing uses it any more.
        unsafe { ibv::ibv_close_device(self.ctx) };
    }
}

struct IbDevice {
    ctx: Arc<Context>,
    attrs: DeviceAttrs,
    max_rd_atomic: u8,
    gid_index: i32,
}

impl Provider for IbverbsProvider {
    fn name(&self) -> &'static str {
        "ibverbs"
    }

    fn open(&self, name: Option<&str>) -> Result<Arc<dyn Device>> {
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer; the list is freed below.
        let list = unsafe { ibv::ibv_get_device_list(&mut count) };
        if list.is_null() {
            return Err(os_error("ibv_get_device_list"));
        }
        let mut chosen = None;
        let mut names = Vec::new();
        for i in 0..count.max(0) as usize {
            // SAFETY: the list holds `count` devices.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a listed device has a NUL-terminated name.
            let dev_name = unsafe { CStr::from_ptr(ibv::ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            if chosen.is_none() && name.is_none_or(|n| n == dev_name) {
                chosen = Some((dev, dev_name.clone()));
            }
            names.push(dev_name);
        }
        let ctx = chosen.map(|(dev, n)| {
            // SAFETY: `dev` is in the list, which is still alive.
            (unsafe { ibv::ibv_open_device(dev) }, n)
        });
        // SAFETY: `list` came from ibv_get_device_list; opened contexts outlive it.
        unsafe { ibv::ibv_free_device_list(list) };
        let (ctx, dev_name) = match ctx {
            None if names.is_empty() => {
                return Err(FabricError::Config(
                    "rdma: no RDMA device on this machine (ibv_get_device_list found none)".into(),
                ))
            }
            None => {
                return Err(FabricError::Config(format!(
                    "rdma: no device {:?} (found: {})",
                    name.unwrap_or_default(),
                    names.join(", ")
                )))
            }
            Some((ctx, _)) if ctx.is_null() => return Err(os_error("ibv_open_device")),
            Some(found) => found,
        };
        let ctx = Arc::new(Context { ctx });
        // SAFETY: zeroed is a valid ibv_device_attr (plain integers); `ctx` is open.
        let mut attr: ibv::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { ibv::ibv_query_device(ctx.ctx, &mut attr) } != 0 {
            return Err(os_error("ibv_query_device"));
        }
        let atomic_cap = match attr.atomic_cap {
            ibv::ibv_atomic_cap::IBV_ATOMIC_GLOB => AtomicCap::Glob,
            ibv::ibv_atomic_cap::IBV_ATOMIC_HCA => AtomicCap::Hca,
            _ => AtomicCap::None,
        };
        let gid_index = std::env::var(ENV_GID_INDEX)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Ok(Arc::new(IbDevice {
            ctx,
            attrs: DeviceAttrs {
                name: dev_name,
                atomic_cap,
                max_qp_wr: attr.max_qp_wr.max(1) as u32,
                max_mr_size: attr.max_mr_size,
                // Upstream verbs cannot ask; devices reply in host order unless configured.
                atomic_reply_be: false,
            },
            max_rd_atomic: attr.max_qp_rd_atom.clamp(1, 16) as u8,
            gid_index,
        }))
    }
}

impl Device for IbDevice {
    fn attrs(&self) -> &DeviceAttrs {
        &self.attrs
    }

    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>> {
        // SAFETY: the context is open.
        let pd = unsafe { ibv::ibv_alloc_pd(self.ctx.ctx) };
        if pd.is_null() {
            return Err(os_error("ibv_alloc_pd"));
        }
        Ok(Arc::new(IbPd {
            pd: Arc::new(PdInner {
                pd,
                _ctx: self.ctx.clone(),
            }),
            ctx: self.ctx.clone(),
            max_qp_wr: self.attrs.max_qp_wr,
            max_rd_atomic: self.max_rd_atomic,
            gid_index: self.gid_index,
        }))
    }
}

struct IbPd {
    pd: Arc<PdInner>,
    ctx: Arc<Context>,
    max_qp_wr: u32,
    max_rd_atomic: u8,
    gid_index: i32,
}

/// A protection domain, kept alive by its registrations and queue pairs (and it keeps its
/// device context).
struct PdInner {
    pd: *mut ibv::ibv_pd,
    _ctx: Arc<Context>,
}

// SAFETY: a protection domain may be used from any thread.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: registrations and queue pairs hold an `Arc` of their domain, so none is left.
        unsafe { ibv::ibv_dealloc_pd(self.pd) };
    }
}

struct IbMr {
    mr: *mut ibv::ibv_mr,
    _pd: Arc<PdInner>,
}

// SAFETY: an ibv_mr is plain data after registration.
unsafe impl Send for IbMr {}
// SAFETY: as above.
unsafe impl Sync for IbMr {}

impl MemoryRegion for IbMr {
    fn addr(&self) -> u64 {
        // SAFETY: `mr` is a live registration.
        unsafe { (*self.mr).addr as u64 }
    }
    fn len(&self) -> u64 {
        // SAFETY: as above.
        unsafe { (*self.mr).length as u64 }
    }
    fn lkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for IbMr {
    fn drop(&mut self) {
        // SAFETY: `mr` is a live registration, deregistered once.
        unsafe { ibv::ibv_dereg_mr(self.mr) };
    }
}

impl ProtectionDomain for IbPd {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn MemoryRegion>> {
        // SAFETY: the caller keeps the memory valid while registered.
        let mr = unsafe { ibv::ibv_reg_mr(self.pd.pd, addr.cast(), len, access.0 as i32) };
        if mr.is_null() {
            return Err(os_error(&format!("ibv_reg_mr of {len} bytes")));
        }
        Ok(Box::new(IbMr {
            mr,
            _pd: self.pd.clone(),
        }))
    }

    fn create_qp(&self, max_send_wr: u32) -> Result<Box<dyn QueuePair>> {
        let depth = max_send_wr.min(self.max_qp_wr);
        // SAFETY: the context is open; no channel, no completion vector.
        let cq = unsafe {
            ibv::ibv_create_cq(
                self.ctx.ctx,
                depth as i32,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(os_error("ibv_create_cq"));
        }
        // SAFETY: zeroed is a valid ibv_qp_init_attr (null pointers, zero counts).
        let mut init: ibv::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq;
        init.recv_cq = cq;
        init.cap.max_send_wr = depth;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.qp_type = ibv::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        // SAFETY: the domain is live and `init` names a live CQ.
        let qp = unsafe { ibv::ibv_create_qp(self.pd.pd, &mut init) };
        if qp.is_null() {
            let err = os_error("ibv_create_qp");
            // SAFETY: the CQ was created above and nothing else uses it.
            unsafe { ibv::ibv_destroy_cq(cq) };
            return Err(err);
        }
        // SAFETY: zeroed is a valid ibv_port_attr; the context is open.
        let mut port: ibv::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { ibv::___ibv_query_port(self.ctx.ctx, PORT, &mut port) } != 0 {
            return Err(os_error("ibv_query_port"));
        }
        // SAFETY: zeroed is a valid gid; the context is open.
        let mut gid: ibv::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { ibv::ibv_query_gid(self.ctx.ctx, PORT, self.gid_index, &mut gid) } != 0 {
            return Err(os_error("ibv_query_gid"));
        }
        Ok(Box::new(IbQp {
            qp,
            cq,
            _pd: self.pd.clone(),
            state: QpState::Reset,
            // SAFETY: a union of bytes; every bit pattern is valid.
            gid: unsafe { gid.raw },
            lid: port.lid,
            mtu: port.active_mtu,
            psn: rand::random::<u32>() & 0x00ff_ffff,
            max_rd_atomic: self.max_rd_atomic,
            gid_index: self.gid_index,
            sges: Vec::new(),
            wrs: Vec::new(),
        }))
    }
}

struct IbQp {
    qp: *mut ibv::ibv_qp,
    cq: *mut ibv::ibv_cq,
    /// Dropped after the queue pair is destroyed (the `Drop` impl runs before the fields).
    _pd: Arc<PdInner>,
    state: QpState,
    gid: [u8; 16],
    lid: u16,
    mtu: ibv::ibv_mtu::Type,
    psn: u32,
    max_rd_atomic: u8,
    gid_index: i32,
    sges: Vec<ibv::ibv_sge>,
    wrs: Vec<ibv::ibv_send_wr>,
}

// SAFETY: a queue pair is used by one thread at a time (`&mut self`); libibverbs allows any.
unsafe impl Send for IbQp {}

impl Drop for IbQp {
    fn drop(&mut self) {
        // SAFETY: both were created by `create_qp`, are destroyed once, QP first.
        unsafe {
            ibv::ibv_destroy_qp(self.qp);
            ibv::ibv_destroy_cq(self.cq);
        }
    }
}

impl IbQp {
    fn modify(&mut self, attr: &mut ibv::ibv_qp_attr, mask: u32, to: QpState) -> Result<()> {
        // SAFETY: `qp` is live; `attr` is a valid attribute block for `mask`.
        if unsafe { ibv::ibv_modify_qp(self.qp, attr, mask as i32) } != 0 {
            self.state = QpState::Error;
            return Err(os_error(&format!("ibv_modify_qp to {to:?}")));
        }
        self.state = to;
        Ok(())
    }
}

fn status(s: ibv::ibv_wc_status::Type) -> WcStatus {
    use ibv::ibv_wc_status as st;
    match s {
        st::IBV_WC_SUCCESS => WcStatus::Success,
        st::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
        st::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
        st::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        st::IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequest,
        st::IBV_WC_REM_OP_ERR => WcStatus::RemoteOperation,
        st::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        st::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
        other => WcStatus::Other(other),
    }
}

impl QueuePair for IbQp {
    fn address(&self) -> QpAddress {
        QpAddress {
            // SAFETY: `qp` is live.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            lid: self.lid,
            gid: self.gid,
        }
    }

    fn state(&self) -> QpState {
        self.state
    }

    fn to_init(&mut self, access: Access) -> Result<()> {
        use ibv::ibv_qp_attr_mask as m;
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = PORT;
        attr.qp_access_flags = access.0;
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_PKEY_INDEX.0
            | m::IBV_QP_PORT.0
            | m::IBV_QP_ACCESS_FLAGS.0;
        self.modify(&mut attr, mask, QpState::Init)
    }

    fn to_rtr(&mut self, remote: &QpAddress) -> Result<()> {
        use ibv::ibv_qp_attr_mask as m;
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = self.mtu;
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = self.max_rd_atomic;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.port_num = PORT;
        if remote.gid != [0; 16] {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = remote.gid;
            attr.ah_attr.grh.sgid_index = self.gid_index as u8;
            attr.ah_attr.grh.hop_limit = 64;
        }
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_AV.0
            | m::IBV_QP_PATH_MTU.0
            | m::IBV_QP_DEST_QPN.0
            | m::IBV_QP_RQ_PSN.0
            | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | m::IBV_QP_MIN_RNR_TIMER.0;
        self.modify(&mut attr, mask, QpState::Rtr)
    }

    fn to_rts(&mut self) -> Result<()> {
        use ibv::ibv_qp_attr_mask as m;
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv::ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.sq_psn = self.psn;
        attr.max_rd_atomic = self.max_rd_atomic;
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_TIMEOUT.0
            | m::IBV_QP_RETRY_CNT.0
            | m::IBV_QP_RNR_RETRY.0
            | m::IBV_QP_SQ_PSN.0
            | m::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify(&mut attr, mask, QpState::Rts)
    }

    fn to_error(&mut self) -> Result<()> {
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv::ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            &mut attr,
            ibv::ibv_qp_attr_mask::IBV_QP_STATE.0,
            QpState::Error,
        )
    }

    fn post_send(&mut self, chain: &[WorkRequest]) -> Result<()> {
        if chain.is_empty() {
            return Ok(());
        }
        self.sges.clear();
        self.sges.extend(chain.iter().map(|wr| ibv::ibv_sge {
            addr: wr.local_addr,
            length: wr.len,
            lkey: wr.lkey,
        }));
        self.wrs.clear();
        for (wr, sge) in chain.iter().zip(self.sges.iter_mut()) {
            // SAFETY: zeroed is a valid ibv_send_wr (null pointers, zero fields).
            let mut w: ibv::ibv_send_wr = unsafe { std::mem::zeroed() };
            w.wr_id = wr.wr_id;
            w.sg_list = sge;
            w.num_sge = 1;
            let mut flags = 0;
            if wr.signaled {
                flags |= ibv::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if wr.fence {
                flags |= ibv::ibv_send_flags::IBV_SEND_FENCE.0;
            }
            w.send_flags = flags;
            match wr.op {
                WrOp::Read | WrOp::Write => {
                    w.opcode = if wr.op == WrOp::Read {
                        ibv::ibv_wr_opcode::IBV_WR_RDMA_READ
                    } else {
                        ibv::ibv_wr_opcode::IBV_WR_RDMA_WRITE
                    };
                    w.wr.rdma = ibv::rdma_t {
                        remote_addr: wr.remote_addr,
                        rkey: wr.rkey,
                    };
                }
                WrOp::CompareSwap { compare, swap } => {
                    w.opcode = ibv::ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
                    w.wr.atomic = ibv::atomic_t {
                        remote_addr: wr.remote_addr,
                        compare_add: compare,
                        swap,
                        rkey: wr.rkey,
                    };
                }
                WrOp::FetchAdd { add } => {
                    w.opcode = ibv::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
                    w.wr.atomic = ibv::atomic_t {
                        remote_addr: wr.remote_addr,
                        compare_add: add,
                        swap: 0,
                        rkey: wr.rkey,
                    };
                }
            }
            self.wrs.push(w);
        }
        // One doorbell: the requests linked in posting order.
        let base = self.wrs.as_mut_ptr();
        for i in 0..self.wrs.len() - 1 {
            // SAFETY: `i + 1` is within the vector, which is not resized from here on.
            self.wrs[i].next = unsafe { base.add(i + 1) };
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: `qp` is live; the chain and its SGEs live in `self` for the call (the
        // provider copies them into the send queue before returning).
        let rc = unsafe { ibv::ibv_post_send(self.qp, base, &mut bad) };
        if rc != 0 {
            return Err(FabricError::Config(format!(
                "rdma: ibv_post_send: {}",
                std::io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    fn poll(&mut self, deadline: Instant) -> Result<Option<WorkCompletion>> {
        loop {
            // SAFETY: zeroed is a valid ibv_wc.
            let mut wc: ibv::ibv_wc = unsafe { std::mem::zeroed() };
            // SAFETY: `cq` is live; room for one completion.
            let n = unsafe { ibv::ibv_poll_cq(self.cq, 1, &mut wc) };
            if n < 0 {
                return Err(FabricError::Config(format!(
                    "rdma: ibv_poll_cq failed ({n})"
                )));
            }
            if n == 1 {
                let status = status(wc.status);
                if status != WcStatus::Success {
                    self.state = QpState::Error;
                }
                return Ok(Some(WorkCompletion {
                    wr_id: wc.wr_id,
                    status,
                }));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Says on stderr that a test skipped and why, and logs it where `.ci/run` counts skips
    /// (`CITRONFS_SKIP_LOG`, the format of `testkit::skip`, which fabric cannot reach).
    fn skip(test: &str, why: &str) {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIPPED fabric::{test} (needs rdma): {why}"
        );
        if let Some(path) = std::env::var_os("CITRONFS_SKIP_LOG") {
            if let Ok(mut log) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
            {
                let _ = writeln!(log, "rdma\tfabric::{test}\t{why}");
            }
        }
    }

    /// The device [`super::super::ENV_DEVICE`] names or the first found, or why there is none.
    fn device(test: &str) -> Option<Arc<dyn Device>> {
        let name = std::env::var(super::super::ENV_DEVICE).ok();
        match IbverbsProvider.open(name.as_deref()) {
            Ok(device) => Some(device),
            Err(e) => {
                skip(test, &e.to_string());
                None
            }
        }
    }

    /// Without a device the provider says so, clearly, and never panics (on a machine with a
    /// device, the first open succeeds and only the unknown name is checked).
    #[test]
    fn no_device_is_a_clear_error() {
        if let Err(e) = IbverbsProvider.open(None) {
            let text = e.to_string();
            assert!(text.starts_with("rdma: "), "{text}");
        }
        let err = IbverbsProvider
            .open(Some("no-such-device-0"))
            .err()
            .expect("no device has that name");
        assert!(err.to_string().contains("rdma: "), "{err}");
    }

    /// The backend's own tests on the real device: a server and a client endpoint over a
    /// loopback queue pair, every verb, the emulated masked atomics, an error completion.
    #[test]
    fn the_backend_on_a_real_device() {
        use crate::endpoint::EndpointExt;
        use crate::{RegionId, RemoteAddr};
        let test = "rdma::ibverbs::tests::the_backend_on_a_real_device";
        let Some(device) = device(test) else { return };
        let device = match super::super::usable(device) {
            Ok(d) => d,
            Err(e) => return skip(test, &e.to_string()),
        };
        let creds = crate::Credentials::new("ibverbs-test", "secret");
        let server =
            super::super::RdmaServer::bind_on(device.clone(), "127.0.0.1:0", creds.clone())
                .unwrap();
        server.register(RegionId(1), 1 << 20).unwrap();
        let connector = super::super::RdmaConnector::on_device(
            device,
            server.local_addr(),
            creds,
            0,
            crate::TcpTimeouts::DEFAULT,
        )
        .unwrap();
        let mut ep = connector.endpoint().unwrap();
        let w = RemoteAddr::new(RegionId(1), 64);
        ep.write(RemoteAddr::new(RegionId(1), 3), b"hello rdma")
            .unwrap();
        assert_eq!(
            ep.read(RemoteAddr::new(RegionId(1), 3), 10).unwrap(),
            b"hello rdma"
        );
        assert_eq!(ep.faa(w, 5).unwrap(), 0);
        assert_eq!(ep.cas(w, 5, 7).unwrap(), 5);
        assert_eq!(ep.masked_faa(w, 1, 1 << 31).unwrap(), 7);
        assert_eq!(ep.masked_cas(w, 8, 0xff, 0x100, 0xf00).unwrap(), 8);
        assert_eq!(ep.read_u64(w).unwrap(), 0x108);
        // A deregistered region: a remote access error, an error not a panic or a hang.
        server.register(RegionId(2), 4096).unwrap();
        let mut other = connector.endpoint().unwrap();
        other.read_u64(RemoteAddr::new(RegionId(2), 0)).unwrap();
        server.deregister(RegionId(2));
        let err = other.read_u64(RemoteAddr::new(RegionId(2), 0)).unwrap_err();
        assert!(err.to_string().contains("rdma"), "{err}");
    }
}
