//! The client side of the `rdma` backend: a queue pair per endpoint, connected over the
//! authenticated setup connection, and batches posted as chains of work requests.

use super::verbs::{
    Access, Device, MemoryRegion, ProtectionDomain, QpState, QueuePair, WcStatus, WorkRequest, WrOp,
};
use super::{RegionKey, SetupRequest, SetupRole, SetupWelcome, MAX_SETUP_FRAME, QP_DEPTH};
use crate::addr::{RegionId, RemoteAddr};
use crate::atomic_ops::{masked_cas_matches, masked_cas_result, masked_faa_result};
use crate::batch::{Batch, Completions, Verb, MAX_BATCH_BYTES, MAX_BATCH_VERBS, MAX_IO_BYTES};
use crate::endpoint::{Capabilities, Connector, Endpoint, EndpointStats, MaskedAtomics};
use crate::error::{FabricError, Result, VerbError};
use crate::frame::{read_frame, write_frame, FrameError};
use crate::handshake::{self, Credentials, HandshakeError, Hello, Protocol, Refusal};
use crate::tcp::TcpTimeouts;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the `rdma` backend can do.
pub const CAPABILITIES: Capabilities = Capabilities {
    backend: "rdma",
    masked_atomics: MaskedAtomics::ClientEmulated,
    max_batch_verbs: MAX_BATCH_VERBS,
    max_io_bytes: MAX_IO_BYTES,
    max_batch_bytes: MAX_BATCH_BYTES,
    server_cpu_on_data_path: false,
};

/// Opens endpoints to one `rdma` server: each its own queue pair.
pub struct RdmaConnector {
    addr: SocketAddr,
    credentials: Credentials,
    session: u64,
    timeouts: TcpTimeouts,
    pd: Arc<dyn ProtectionDomain>,
    reply_be: bool,
}

impl std::fmt::Debug for RdmaConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaConnector")
            .field("addr", &self.addr)
            .finish()
    }
}

impl RdmaConnector {
    /// A connector to the server whose setup port is `addr`, on the device the environment
    /// names ([`super::open_device`]), presenting `credentials` and client session `session`.
    /// Connects one endpoint to find out that the server is there and admits us.
    pub fn connect_with(
        addr: impl ToSocketAddrs,
        credentials: Credentials,
        session: u64,
        timeouts: TcpTimeouts,
    ) -> Result<Self> {
        Self::on_device(super::open_device()?, addr, credentials, session, timeouts)
    }

    /// [`RdmaConnector::connect_with`] on an open device.
    pub fn on_device(
        device: Arc<dyn Device>,
        addr: impl ToSocketAddrs,
        credentials: Credentials,
        session: u64,
        timeouts: TcpTimeouts,
    ) -> Result<Self> {
        let addr = addr
            .to_socket_addrs()
            .map_err(|e| FabricError::io("rdma: resolve server address", e))?
            .next()
            .ok_or_else(|| FabricError::Config("rdma: the server address is empty".into()))?;
        let defaults = TcpTimeouts::DEFAULT;
        let pick = |d: std::time::Duration, default| if d.is_zero() { default } else { d };
        let timeouts = TcpTimeouts {
            connect: pick(timeouts.connect, defaults.connect),
            batch: pick(timeouts.batch, defaults.batch),
            call: pick(timeouts.call, defaults.call),
        };
        let connector = Self {
            addr,
            credentials,
            session,
            timeouts,
            pd: device.alloc_pd()?,
            reply_be: device.attrs().atomic_reply_be,
        };
        connector.endpoint()?;
        Ok(connector)
    }

    /// A new endpoint: its own queue pair, connected to one of the server's.
    pub fn endpoint(&self) -> Result<RdmaEndpoint> {
        self.endpoint_by(None)
    }

    /// [`RdmaConnector::endpoint`], its setup connection and handshake (the exchange of queue
    /// pair numbers, GIDs and rkeys) given up at `deadline` with [`FabricError::TimedOut`] when
    /// that comes before the connect bound (see [`Connector::connect_by`]).
    pub fn endpoint_by(&self, deadline: Option<Instant>) -> Result<RdmaEndpoint> {
        RdmaEndpoint::connect(self, deadline)
    }
}

impl Connector for RdmaConnector {
    fn connect(&self) -> Result<Box<dyn Endpoint>> {
        Ok(Box::new(self.endpoint()?))
    }
    fn connect_by(&self, deadline: Option<Instant>) -> Result<Box<dyn Endpoint>> {
        Ok(Box::new(self.endpoint_by(deadline)?))
    }
}

/// The setup connection held to one deadline as a whole: before each read or write, the
/// socket's timeouts are narrowed to the time left, and past it every call fails as timed out
/// (a socket timeout alone bounds each call, not the handshake's several).
struct Until<'a> {
    stream: &'a mut TcpStream,
    until: Instant,
}

impl Until<'_> {
    fn before_call(&mut self) -> std::io::Result<()> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the connect's deadline passed",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.set_write_timeout(Some(left))
    }
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.before_call()?;
        self.stream.read(buf)
    }
}

impl Write for Until<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.before_call()?;
        self.stream.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// Whether `e` is a socket timeout (`set_read_timeout` reports one as `WouldBlock`).
fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// The endpoint's registered buffer: the source of writes and the target of reads and atomic
/// results. Grown (registered anew) when a batch needs more.
struct Staging {
    // Field order is drop order: deregister before the memory goes.
    mr: Box<dyn MemoryRegion>,
    words: Box<[AtomicU64]>,
}

impl Staging {
    fn new(pd: &dyn ProtectionDomain, bytes: usize) -> Result<Self> {
        let words: Box<[AtomicU64]> = (0..bytes.div_ceil(8).max(1))
            .map(|_| AtomicU64::new(0))
            .collect();
        // SAFETY: `words` lives in the same `Staging`, dropped after the registration (field
        // order), and is only accessed atomically.
        let mr = unsafe {
            pd.register(
                words.as_ptr() as *mut u8,
                words.len() * 8,
                Access::LOCAL_WRITE,
            )
        }
        .map_err(|e| FabricError::Config(format!("rdma: registering a staging buffer: {e}")))?;
        Ok(Self { mr, words })
    }

    fn len(&self) -> usize {
        self.words.len() * 8
    }

    fn addr(&self, offset: usize) -> u64 {
        self.mr.addr() + offset as u64
    }

    /// Copies `out.len()` bytes at the word-aligned `offset` out.
    fn load(&self, offset: usize, out: &mut [u8]) {
        for (i, chunk) in out.chunks_mut(8).enumerate() {
            let w = self.words[offset / 8 + i]
                .load(Ordering::Acquire)
                .to_le_bytes();
            chunk.copy_from_slice(&w[..chunk.len()]);
        }
    }

    /// Copies `data` in at the word-aligned `offset` (the last word padded with zeros).
    fn store(&self, offset: usize, data: &[u8]) {
        for (i, chunk) in data.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.words[offset / 8 + i].store(u64::from_le_bytes(w), Ordering::Release);
        }
    }
}

/// One client thread's queue pair to one `rdma` server.
pub struct RdmaEndpoint {
    // Field order is drop order: the queue pair goes before the buffer it targets, and before
    // the setup connection whose closing makes the server destroy its end.
    qp: Box<dyn QueuePair>,
    staging: Staging,
    setup: TcpStream,
    peer: SocketAddr,
    pd: Arc<dyn ProtectionDomain>,
    regions: HashMap<RegionId, RegionKey>,
    reply_be: bool,
    timeouts: TcpTimeouts,
    stats: EndpointStats,
    emulated: u64,
    broken: Option<String>,
    wrs: Vec<WorkRequest>,
    /// The chain [`Endpoint::post`] posted and [`Endpoint::complete`] has yet to wait for.
    pending: Option<Pending>,
    /// The expiry of the batch being run ([`Batch::expire_at`]).
    expires: Option<Instant>,
}

/// A posted chain: where its verbs keep their bytes, its signalled request, and when its
/// completion must have come.
struct Pending {
    slots: Vec<Slot>,
    last: Option<u64>,
    by: AnswerBy,
}

/// When a posted chain's completion must have come: its batch bound counted from the posting,
/// or, for an expiring batch, its expiry plus [`crate::REPLY_AFTER_EXPIRY`] when that comes
/// first (as tcp's endpoint waits for a reply; see [`Batch::expire_at`]).
#[derive(Clone, Copy, Debug)]
struct AnswerBy {
    at: Instant,
    /// `at` is the batch's expiry plus [`crate::REPLY_AFTER_EXPIRY`].
    expiry_first: bool,
}

impl AnswerBy {
    /// For a chain posted now, under batch bound `bound`, of a batch that `expires`.
    fn from_now(bound: Duration, expires: Option<Instant>) -> Self {
        let at = Instant::now() + bound;
        match expires.map(|t| t + crate::REPLY_AFTER_EXPIRY) {
            Some(by) if by < at => AnswerBy {
                at: by,
                expiry_first: true,
            },
            _ => AnswerBy {
                at,
                expiry_first: false,
            },
        }
    }
}

impl std::fmt::Debug for RdmaEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaEndpoint")
            .field("peer", &self.peer)
            .field("qp", &self.qp.address().qpn)
            .finish()
    }
}

/// Where a verb of a chain keeps its bytes in the staging buffer.
#[derive(Clone, Copy)]
struct Slot {
    offset: usize,
}

impl RdmaEndpoint {
    /// Connects a new endpoint to `c`'s server: the setup connection and its handshake end by
    /// the connect bound, or by `deadline` when that comes first (a lock holder's, see
    /// [`Connector::connect_by`]), with [`FabricError::TimedOut`] when the server does not
    /// answer in time.
    fn connect(c: &RdmaConnector, deadline: Option<Instant>) -> Result<Self> {
        let peer = c.addr;
        let now = Instant::now();
        let mut until = now + c.timeouts.connect;
        let mut within = format!("within {:?}", c.timeouts.connect);
        if let Some(deadline) = deadline {
            if deadline <= now {
                return Err(FabricError::TimedOut(format!(
                    "rdma: no time left to connect to {peer} before the caller's deadline"
                )));
            }
            if deadline < until {
                until = deadline;
                within = "by the caller's deadline".into();
            }
        }
        let silent = |what: &str| {
            FabricError::TimedOut(format!(
                "rdma: {peer} did not {what} {within} (link down, host frozen, or not a \
                 CitronFS rdma server?)"
            ))
        };
        let mut setup = TcpStream::connect_timeout(&peer, until - now).map_err(|e| {
            if is_timeout(&e) {
                silent("accept the setup connection")
            } else {
                FabricError::io(format!("rdma: connect to {peer}"), e)
            }
        })?;
        let io = |e| FabricError::io(format!("rdma: setup connection to {peer}"), e);
        setup.set_nodelay(true).map_err(io)?;
        let mut qp = c.pd.create_qp(QP_DEPTH)?;
        qp.to_init(Access(0))?;
        let hello = Hello::new(
            Protocol::RdmaSetup,
            &c.credentials,
            c.session,
            SetupRole { qp: qp.address() },
        );
        let welcome: SetupWelcome = match handshake::client_handshake(
            &mut Until {
                stream: &mut setup,
                until,
            },
            &hello,
            &c.credentials,
            MAX_SETUP_FRAME,
        ) {
            Ok(welcome) => welcome,
            Err(HandshakeError::Frame(FrameError::Io(e))) if is_timeout(&e) => {
                return Err(silent("answer the setup handshake"))
            }
            // A session of an earlier run of the meta server is behind, not fenced (as on tcp).
            Err(HandshakeError::Refused(refusal @ Refusal::SessionBehind { .. })) => {
                return Err(FabricError::SessionBehind(format!("{peer}: {refusal}")))
            }
            Err(HandshakeError::Refused(refusal)) => {
                return Err(FabricError::Refused(format!("{peer}: {refusal}")))
            }
            Err(e @ HandshakeError::ServerUnverified { .. }) => {
                return Err(FabricError::Unverified(format!("{peer}: {e}")))
            }
            Err(e) => {
                return Err(FabricError::Protocol(format!(
                    "rdma setup with {peer}: {e}"
                )))
            }
        };
        qp.to_rtr(&welcome.qp)?;
        qp.to_rts()?;
        setup.set_read_timeout(Some(c.timeouts.batch)).map_err(io)?;
        setup
            .set_write_timeout(Some(c.timeouts.batch))
            .map_err(io)?;
        let staging = Staging::new(&*c.pd, 64 << 10)?;
        Ok(Self {
            qp,
            staging,
            setup,
            peer,
            pd: c.pd.clone(),
            regions: welcome.regions.into_iter().map(|k| (k.id, k)).collect(),
            reply_be: c.reply_be,
            timeouts: c.timeouts,
            stats: EndpointStats::default(),
            emulated: 0,
            broken: None,
            wrs: Vec::new(),
            pending: None,
            expires: None,
        })
    }

    /// The server's setup address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// This endpoint's queue pair number.
    pub fn qpn(&self) -> u32 {
        self.qp.address().qpn
    }

    /// The state of this endpoint's queue pair ([`QpState::Error`] once a batch failed or
    /// timed out: the endpoint is dead then).
    pub fn qp_state(&self) -> QpState {
        self.qp.state()
    }

    /// Masked atomics this endpoint has emulated (each a Read and one or more CAS round trips).
    pub fn emulated_masked_atomics(&self) -> u64 {
        self.emulated
    }

    /// Asks the server for its regions (on the setup connection).
    fn refresh_regions(&mut self) -> Result<()> {
        let peer = self.peer;
        let lost = |e: String| FabricError::Disconnected(format!("rdma setup with {peer}: {e}"));
        let request = postcard::to_stdvec(&SetupRequest::Regions)
            .map_err(|e| FabricError::Protocol(e.to_string()))?;
        write_frame(&mut self.setup, &request)
            .and_then(|()| self.setup.flush())
            .map_err(|e| lost(e.to_string()))?;
        let mut body = Vec::new();
        read_frame(&mut self.setup, MAX_SETUP_FRAME, &mut body).map_err(|e| lost(e.to_string()))?;
        let keys: Vec<RegionKey> = postcard::from_bytes(&body)
            .map_err(|e| FabricError::Protocol(format!("rdma region list from {peer}: {e}")))?;
        self.regions = keys.into_iter().map(|k| (k.id, k)).collect();
        Ok(())
    }

    /// Checks every verb against the server's regions, as every backend's executor does
    /// before running anything (`RegionTable::check`).
    fn check(&mut self, batch: &Batch) -> Result<()> {
        if batch
            .verbs()
            .iter()
            .any(|v| !self.regions.contains_key(&v.addr().region))
        {
            self.refresh_regions()?;
        }
        for (index, verb) in batch.verbs().iter().enumerate() {
            let addr = verb.addr();
            let key = self
                .regions
                .get(&addr.region)
                .ok_or(VerbError::UnknownRegion {
                    index,
                    region: addr.region,
                })?;
            if verb.is_atomic() && addr.offset % 8 != 0 {
                return Err(VerbError::Misaligned { index, addr }.into());
            }
            match addr.offset.checked_add(verb.span()) {
                Some(end) if end <= key.len => {}
                _ => {
                    return Err(VerbError::OutOfBounds {
                        index,
                        addr,
                        len: verb.span(),
                        region_len: key.len,
                    }
                    .into())
                }
            }
        }
        Ok(())
    }

    fn remote(&self, addr: RemoteAddr) -> (u64, u32) {
        let key = &self.regions[&addr.region];
        (key.addr + addr.offset, key.rkey)
    }

    fn fail(&mut self, why: String) -> FabricError {
        let _ = self.qp.to_error();
        self.broken = Some(why.clone());
        FabricError::Disconnected(why)
    }

    /// Posts `self.wrs` (the last one signalled) and waits for its completion until the
    /// batch's deadline.
    fn round_trip(&mut self, first_verb: usize) -> Result<()> {
        match self.post_wrs()? {
            Some(last_id) => {
                let by = AnswerBy::from_now(self.timeouts.batch, self.expires);
                self.wait(last_id, first_verb, by)
            }
            None => Ok(()),
        }
    }

    /// Posts `self.wrs` with the last one signalled; that one's id, if there was one.
    fn post_wrs(&mut self) -> Result<Option<u64>> {
        let Some(last) = self.wrs.last_mut() else {
            return Ok(None);
        };
        last.signaled = true;
        let last_id = last.wr_id;
        if let Err(e) = self.qp.post_send(&self.wrs) {
            return Err(self.fail(format!("rdma: posting to {}: {e}", self.peer)));
        }
        Ok(Some(last_id))
    }

    /// Waits for the completion of request `last_id` until `by`: the batch bound, or an
    /// expiring batch's expiry plus [`crate::REPLY_AFTER_EXPIRY`] when that comes first. A
    /// completion that has not come by then fails the batch with [`FabricError::TimedOut`]
    /// (its outcome unknown) and moves the queue pair to the error state: the endpoint is dead
    /// from then on, as after any other queue pair error, and its owner opens a new one.
    ///
    /// Why the error state, and why it is what makes an expiring batch's caller safe to go on
    /// (a lock holder gets control back here within its lease, and releases the lock or lets
    /// it be broken): a NIC never checks a batch's expiry, so a chain posted before it may
    /// still sit in the send queue, or be sent again after a lost packet (RC retransmits for
    /// up to `retry_cnt` local ACK timeouts — seconds), and land after the lock changed hands.
    /// `ibv_modify_qp` to `IBV_QPS_ERR` stops the requester: its send queue processes no more
    /// work requests and sends no request packet, neither a new one nor a retransmission, and
    /// every outstanding work request completes flushed (`IBV_WC_WR_FLUSH_ERR`); a QP in the
    /// error state never leaves it except through RESET, which this endpoint never does. So
    /// once the transition is made, the server's responder gets nothing more of the batch but
    /// packets already on the wire, which the fabric delivers within its packet lifetime
    /// (microseconds in a data centre) or drops — and the caller's lease guard, of which
    /// `REPLY_AFTER_EXPIRY` is a part, leaves it that much and more before the lease ends.
    /// (The server's queue pair is not moved: a silent server cannot be told. It executes
    /// requests in packet order and gets no more from this one.)
    fn wait(&mut self, last_id: u64, first_verb: usize, by: AnswerBy) -> Result<()> {
        loop {
            match self.qp.poll(by.at)? {
                Some(wc) if wc.status == WcStatus::Success => {
                    if wc.wr_id == last_id {
                        return Ok(());
                    }
                }
                Some(wc) => {
                    let why = format!(
                        "rdma: verb {} of the batch to {} failed: {}; the queue pair is in \
                         the error state (verbs before it may have executed)",
                        first_verb as u64 + wc.wr_id,
                        self.peer,
                        wc.status.describe()
                    );
                    return Err(self.fail(why));
                }
                None => {
                    let within = match by.expiry_first {
                        true => format!(
                            "by the batch's expiry (and {:?} after it)",
                            crate::REPLY_AFTER_EXPIRY
                        ),
                        false => format!("within {:?}", self.timeouts.batch),
                    };
                    let why = format!(
                        "rdma: no completion from {} {within} (the batch's outcome is unknown; \
                         the queue pair is moved to the error state, so none of its verbs \
                         executes later)",
                        self.peer
                    );
                    let _ = self.qp.to_error();
                    self.broken = Some(why.clone());
                    return Err(FabricError::TimedOut(why));
                }
            }
        }
    }

    fn ensure_staging(&mut self, bytes: usize) -> Result<()> {
        if self.staging.len() < bytes {
            self.staging = Staging::new(&*self.pd, bytes.next_power_of_two())?;
        }
        Ok(())
    }

    /// Runs `verbs` (native ones, at most [`QP_DEPTH`]; the first is the batch's verb `first`)
    /// as one chain: one doorbell, one signalled completion.
    fn run_chain(
        &mut self,
        batch: &Batch,
        first: usize,
        verbs: &[Verb],
        payload: &mut &[u8],
        out: &mut Completions,
    ) -> Result<()> {
        let (slots, last) = self.start_chain(verbs, payload)?;
        if let Some(last) = last {
            let by = AnswerBy::from_now(self.timeouts.batch, self.expires);
            self.wait(last, first, by)?;
        }
        self.finish_chain(batch, verbs, &slots, out);
        Ok(())
    }

    /// Lays `verbs` out in the staging buffer and posts them as one chain; where each keeps its
    /// bytes, and the signalled request's id (none if nothing needed posting).
    fn start_chain(
        &mut self,
        verbs: &[Verb],
        payload: &mut &[u8],
    ) -> Result<(Vec<Slot>, Option<u64>)> {
        // Lay the chain out in the staging buffer, word-aligned.
        let mut slots = Vec::with_capacity(verbs.len());
        let mut size = 0usize;
        for verb in verbs {
            slots.push(Slot { offset: size });
            size += match *verb {
                Verb::Read { len, .. } | Verb::Write { len, .. } => (len as usize).div_ceil(8) * 8,
                _ => 8,
            };
        }
        self.ensure_staging(size)?;
        self.wrs.clear();
        let lkey = self.staging.mr.lkey();
        let mut outstanding = false;
        for (i, (verb, slot)) in verbs.iter().zip(&slots).enumerate() {
            let (op, len, addr) = match *verb {
                Verb::Read { addr, len } => (WrOp::Read, len, addr),
                Verb::Write { addr, len } => {
                    let (data, rest) = payload.split_at(len as usize);
                    self.staging.store(slot.offset, data);
                    *payload = rest;
                    (WrOp::Write, len, addr)
                }
                Verb::Cas { addr, expect, swap } => (
                    WrOp::CompareSwap {
                        compare: expect,
                        swap,
                    },
                    8,
                    addr,
                ),
                Verb::Faa { addr, add } => (WrOp::FetchAdd { add }, 8, addr),
                Verb::Flush { len: 0, .. } => continue,
                // A Read of the range's last byte: the writes before it are placed in the
                // server's memory when it completes.
                Verb::Flush { addr, len } => (
                    WrOp::Read,
                    1,
                    RemoteAddr::new(addr.region, addr.offset + len - 1),
                ),
                Verb::MaskedCas { .. } | Verb::MaskedFaa { .. } => {
                    unreachable!("masked atomics are emulated, never chained")
                }
            };
            if len == 0 {
                continue;
            }
            let (remote_addr, rkey) = self.remote(addr);
            self.wrs.push(WorkRequest {
                wr_id: i as u64,
                op,
                local_addr: self.staging.addr(slot.offset),
                len,
                lkey,
                remote_addr,
                rkey,
                signaled: false,
                // RC lets a request overtake an earlier Read or atomic; the fabric promises
                // posting order, so every request after one is fenced.
                fence: outstanding,
            });
            outstanding = op.may_be_overtaken();
        }
        let last = self.post_wrs()?;
        Ok((slots, last))
    }

    /// Moves a completed chain's results into `out`.
    fn finish_chain(&self, batch: &Batch, verbs: &[Verb], slots: &[Slot], out: &mut Completions) {
        for (verb, slot) in verbs.iter().zip(slots) {
            match *verb {
                Verb::Read { len, .. } => {
                    self.staging
                        .load(slot.offset, out.next_read(batch, len as usize));
                }
                Verb::Cas { .. } | Verb::Faa { .. } => out.push_old(self.atomic_result(slot)),
                _ => {}
            }
        }
    }

    fn atomic_result(&self, slot: &Slot) -> u64 {
        let raw = self.staging.words[slot.offset / 8].load(Ordering::Acquire);
        // The word holds the bytes as the device wrote them.
        let bytes = raw.to_le_bytes();
        if self.reply_be {
            u64::from_be_bytes(bytes)
        } else {
            u64::from_le_bytes(bytes)
        }
    }

    /// One native atomic or 8-byte Read at `addr`, its own round trip; the word it returns.
    fn one_word(&mut self, index: usize, op: WrOp, addr: RemoteAddr) -> Result<u64> {
        self.ensure_staging(8)?;
        let (remote_addr, rkey) = self.remote(addr);
        self.wrs.clear();
        self.wrs.push(WorkRequest {
            wr_id: 0,
            op,
            local_addr: self.staging.addr(0),
            len: 8,
            lkey: self.staging.mr.lkey(),
            remote_addr,
            rkey,
            signaled: true,
            fence: false,
        });
        self.round_trip(index)?;
        self.stats.round_trips += 1;
        Ok(if op == WrOp::Read {
            self.staging.words[0].load(Ordering::Acquire)
        } else {
            self.atomic_result(&Slot { offset: 0 })
        })
    }

    /// A masked atomic, emulated: a Read, then CAS until the word did not change in between
    /// (each CAS returns the word's value, the next try's guess). Linearizes at the Read when
    /// nothing is to be stored, else at the successful CAS.
    fn masked(&mut self, index: usize, verb: &Verb) -> Result<u64> {
        self.emulated += 1;
        let addr = verb.addr();
        let mut old = self.one_word(index, WrOp::Read, addr)?;
        loop {
            let new = match *verb {
                Verb::MaskedCas {
                    cmp,
                    cmp_mask,
                    swap,
                    swap_mask,
                    ..
                } => {
                    if !masked_cas_matches(old, cmp, cmp_mask) {
                        return Ok(old);
                    }
                    masked_cas_result(old, swap, swap_mask)
                }
                Verb::MaskedFaa {
                    add, boundary_mask, ..
                } => masked_faa_result(old, add, boundary_mask),
                _ => unreachable!("not a masked atomic"),
            };
            if new == old {
                return Ok(old);
            }
            let seen = self.one_word(
                index,
                WrOp::CompareSwap {
                    compare: old,
                    swap: new,
                },
                addr,
            )?;
            if seen == old {
                return Ok(old);
            }
            old = seen;
        }
    }
}

impl RdmaEndpoint {
    /// What every batch goes through first: a live endpoint, every verb checked.
    fn prologue(&mut self, batch: &Batch) -> Result<()> {
        self.expires = batch.expires();
        if let Some(why) = &self.broken {
            return Err(FabricError::Disconnected(format!(
                "{why} (an earlier batch broke this endpoint)"
            )));
        }
        if self.pending.is_some() {
            return Err(self.fail(
                "rdma: a batch was posted while another was in flight on this endpoint".into(),
            ));
        }
        if self.qp.state() == QpState::Error {
            return Err(self.fail(format!("rdma: the queue pair to {} is in error", self.peer)));
        }
        self.check(batch)
    }

    /// Whether `batch` goes as one chain (nothing emulated, within one queue pair's depth).
    fn one_chain(batch: &Batch) -> bool {
        batch.len() <= QP_DEPTH as usize
            && !batch
                .verbs()
                .iter()
                .any(|v| matches!(v, Verb::MaskedCas { .. } | Verb::MaskedFaa { .. }))
    }
}

impl Endpoint for RdmaEndpoint {
    /// A batch that goes as one chain is posted here and waited for in
    /// [`Endpoint::complete`], so that one thread's batches to several servers overlap; any
    /// other (emulated masked atomics, several chains) executes here whole.
    fn post(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        if !Self::one_chain(batch) {
            return self.execute(batch, out);
        }
        // `out` is filled by `complete`, as tcp's is: one completions may serve several
        // endpoints' posted batches.
        self.prologue(batch)?;
        if batch.expires().is_some_and(|t| Instant::now() >= t) {
            return Err(VerbError::Expired { index: 0 }.into());
        }
        let mut payload = batch.payload();
        let (slots, last) = self.start_chain(batch.verbs(), &mut payload)?;
        // The completion is awaited from the posting, so that batches posted together to
        // several servers time out together.
        let by = AnswerBy::from_now(self.timeouts.batch, self.expires);
        self.pending = Some(Pending { slots, last, by });
        Ok(())
    }

    fn complete(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        let Some(pending) = self.pending.take() else {
            return Ok(());
        };
        if let Some(last) = pending.last {
            self.wait(last, 0, pending.by)?;
        }
        out.reset_for(batch);
        self.finish_chain(batch, batch.verbs(), &pending.slots, out);
        self.stats.record(batch);
        Ok(())
    }

    fn execute(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        self.prologue(batch)?;
        out.reset_for(batch);
        let before = self.stats.round_trips;
        let verbs = batch.verbs();
        let mut payload = batch.payload();
        let mut i = 0;
        while i < verbs.len() {
            // Expiry is checked before each chain is posted: a NIC cannot check it later.
            if batch.expires().is_some_and(|t| Instant::now() >= t) {
                return Err(VerbError::Expired { index: i }.into());
            }
            if matches!(verbs[i], Verb::MaskedCas { .. } | Verb::MaskedFaa { .. }) {
                let old = self.masked(i, &verbs[i])?;
                out.push_old(old);
                i += 1;
                continue;
            }
            let end = (i..verbs.len())
                .find(|&j| matches!(verbs[j], Verb::MaskedCas { .. } | Verb::MaskedFaa { .. }))
                .unwrap_or(verbs.len())
                .min(i + QP_DEPTH as usize);
            self.run_chain(batch, i, &verbs[i..end], &mut payload, out)?;
            self.stats.round_trips += 1;
            i = end;
        }
        let chains = self.stats.round_trips - before;
        self.stats.round_trips = before;
        self.stats.record(batch);
        // `record` counted one round trip; a batch with emulated atomics or over a queue
        // pair's depth took more.
        self.stats.round_trips += chains.saturating_sub(1);
        Ok(())
    }

    fn stats(&self) -> EndpointStats {
        self.stats
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }
}
