//! Endpoints: one client thread's connection to one server (the paper's queue pair).

use crate::addr::RemoteAddr;
use crate::batch::{Batch, Completions, MAX_BATCH_BYTES, MAX_BATCH_VERBS, MAX_IO_BYTES};
use crate::error::Result;
use serde::Serialize;
use std::time::{Duration, Instant};

/// How a backend executes masked atomic verbs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum MaskedAtomics {
    /// The NIC executes them natively.
    Native,
    /// A CPU compare-exchange loop on the word: atomic, one round trip (mem, shm: the client's
    /// CPU on shared memory; tcp: the server's verb executor).
    CpuCasLoop,
    /// The client emulates them with remote CAS loops: atomic, but extra round trips under
    /// contention (RDMA devices without masked atomics).
    ClientEmulated,
}

/// What a backend can do, reported per endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// The backend's name: `mem`, `shm`, `tcp`, `rdma`.
    pub backend: &'static str,
    /// How masked atomics are executed.
    pub masked_atomics: MaskedAtomics,
    /// Most verbs in one batch.
    pub max_batch_verbs: usize,
    /// Most bytes in one read or write verb.
    pub max_io_bytes: usize,
    /// Most bytes one batch moves in each direction.
    pub max_batch_bytes: usize,
    /// Whether a server CPU executes verbs (true only for `tcp`, the software NIC).
    pub server_cpu_on_data_path: bool,
}

impl Capabilities {
    /// The capabilities of a backend that executes verbs with the CPU on shared memory.
    pub const fn local(backend: &'static str) -> Self {
        Self {
            backend,
            masked_atomics: MaskedAtomics::CpuCasLoop,
            max_batch_verbs: MAX_BATCH_VERBS,
            max_io_bytes: MAX_IO_BYTES,
            max_batch_bytes: MAX_BATCH_BYTES,
            server_cpu_on_data_path: false,
        }
    }
}

/// Counters of what an endpoint has posted. The lock protocol's cost is measured in these.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EndpointStats {
    /// Batches executed (one round trip each).
    pub round_trips: u64,
    /// Verbs executed.
    pub verbs: u64,
    /// Atomic verbs among them.
    pub atomics: u64,
    /// Bytes returned by reads.
    pub bytes_read: u64,
    /// Bytes carried by writes.
    pub bytes_written: u64,
    /// Calls posted without waiting for their result ([`Endpoint::post_call`]): no round
    /// trip of their own.
    pub posted_calls: u64,
}

impl EndpointStats {
    /// Counts one executed batch.
    pub fn record(&mut self, batch: &Batch) {
        self.round_trips += 1;
        self.verbs += batch.len() as u64;
        self.atomics += batch.atomic_count() as u64;
        self.bytes_read += batch.read_bytes() as u64;
        self.bytes_written += batch.payload().len() as u64;
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &EndpointStats) {
        self.round_trips += other.round_trips;
        self.verbs += other.verbs;
        self.atomics += other.atomics;
        self.bytes_read += other.bytes_read;
        self.bytes_written += other.bytes_written;
        self.posted_calls += other.posted_calls;
    }

    /// The counts accumulated since `earlier` was taken.
    pub fn since(&self, earlier: &EndpointStats) -> EndpointStats {
        EndpointStats {
            round_trips: self.round_trips - earlier.round_trips,
            verbs: self.verbs - earlier.verbs,
            atomics: self.atomics - earlier.atomics,
            bytes_read: self.bytes_read - earlier.bytes_read,
            bytes_written: self.bytes_written - earlier.bytes_written,
            posted_calls: self.posted_calls - earlier.posted_calls,
        }
    }
}

/// One client thread's connection to one server.
///
/// Verbs of a batch execute in posting order, and batches on one endpoint execute in the order
/// they are posted; `execute` returns once the whole batch has completed (one round trip).
/// An endpoint is used by one thread at a time (`&mut self`); give every thread its own.
///
/// A batch can also be posted now and completed later ([`Endpoint::post`],
/// [`Endpoint::complete`]), so that one thread has batches in flight to several servers at
/// once, each on its own endpoint, and waits for them together: the round trips overlap
/// instead of adding up. One batch at a time is in flight per endpoint.
pub trait Endpoint: Send {
    /// Executes `batch` and fills `out` with its results.
    ///
    /// On `Err`, no verb of the batch executed, except for
    /// [`FabricError::Disconnected`](crate::FabricError::Disconnected) and
    /// [`FabricError::TimedOut`](crate::FabricError::TimedOut), after which the outcome is
    /// unknown.
    fn execute(&mut self, batch: &Batch, out: &mut Completions) -> Result<()>;

    /// Starts executing `batch`, whose results go into `out`; [`Endpoint::complete`] with the
    /// same batch and completions waits for them. `batch` and `out` must not change in
    /// between (a placed batch's reads may land in `out` at either call).
    ///
    /// This default executes the whole batch here and leaves nothing to `complete`: what the
    /// backends whose verbs run on the client's own CPU (`mem`, `shm`) and wrappers do. `tcp`
    /// sends the request here and reads the reply in `complete`. Errors as for `execute`; a
    /// batch whose post failed is not completed.
    fn post(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        self.execute(batch, out)
    }

    /// Waits for the batch posted last on this endpoint and fills `out` with its results (see
    /// [`Endpoint::post`]). Errors as for `execute`.
    fn complete(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        let _ = (batch, out);
        Ok(())
    }

    /// The counters of everything this endpoint has executed.
    fn stats(&self) -> EndpointStats;

    /// What this endpoint's backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Calls procedure `procedure` at the server with `args` and appends its result to
    /// `result` (one round trip; [`crate::procedure`]).
    ///
    /// Errors: [`FabricError::Unsupported`](crate::FabricError::Unsupported) when this backend
    /// or its server offers no such procedure (nothing ran; the default for backends without
    /// a server CPU), [`FabricError::Procedure`](crate::FabricError::Procedure) when it ran and
    /// failed, and otherwise as [`Endpoint::execute`].
    fn call(
        &mut self,
        procedure: crate::procedure::ProcedureId,
        args: &[u8],
        result: &mut Vec<u8>,
    ) -> Result<()> {
        let _ = (args, result);
        Err(crate::FabricError::Unsupported(format!(
            "{} endpoints run no procedures (asked for {procedure})",
            self.capabilities().backend
        )))
    }

    /// Sends a call of procedure `procedure` with `args` that nobody waits for: it runs at the
    /// server after every request sent before it and before every request sent after it, and
    /// costs no round trip of its own (an unsignaled work request, in RDMA's terms). Its
    /// result is dropped.
    ///
    /// `Ok` means it was sent. If it fails at the server, the server closes the connection
    /// and nothing sent after it runs: the next request on this endpoint fails with
    /// [`FabricError::Disconnected`](crate::FabricError::Disconnected) saying why. So a caller
    /// posts only calls whose failure it can leave to the recovery a lost connection gets
    /// anyway (a lock release: a lock not released is recovered when its lease runs out).
    ///
    /// Errors: [`FabricError::Unsupported`](crate::FabricError::Unsupported) where this backend
    /// runs no procedures (nothing was sent; the default), and otherwise as
    /// [`Endpoint::execute`].
    fn post_call(&mut self, procedure: crate::procedure::ProcedureId, args: &[u8]) -> Result<()> {
        let _ = args;
        Err(crate::FabricError::Unsupported(format!(
            "{} endpoints run no procedures (asked to post {procedure})",
            self.capabilities().backend
        )))
    }
}

impl<E: Endpoint + ?Sized> Endpoint for Box<E> {
    fn execute(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        (**self).execute(batch, out)
    }
    fn post(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        (**self).post(batch, out)
    }
    fn complete(&mut self, batch: &Batch, out: &mut Completions) -> Result<()> {
        (**self).complete(batch, out)
    }
    fn stats(&self) -> EndpointStats {
        (**self).stats()
    }
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
    fn call(
        &mut self,
        procedure: crate::procedure::ProcedureId,
        args: &[u8],
        result: &mut Vec<u8>,
    ) -> Result<()> {
        (**self).call(procedure, args, result)
    }
    fn post_call(&mut self, procedure: crate::procedure::ProcedureId, args: &[u8]) -> Result<()> {
        (**self).post_call(procedure, args)
    }
}

/// Something that opens endpoints to one server: give each thread its own endpoint.
pub trait Connector: Send + Sync {
    /// Opens a new endpoint to the server.
    fn connect(&self) -> Result<Box<dyn Endpoint>>;

    /// [`Connector::connect`], given up at `deadline` if that comes before the backend's own
    /// connect bound ([`FabricError::TimedOut`](crate::FabricError::TimedOut)): what a lock
    /// holder connecting to a data server uses, with its batches' expiry as the deadline
    /// ([`crate::Batch::expire_at`]), so that a silent server cannot keep it past its lease.
    /// `None`: the backend's bound alone. This default ignores the deadline: the backends
    /// whose connect cannot block on a peer (`mem`, `shm`) need none.
    fn connect_by(&self, deadline: Option<std::time::Instant>) -> Result<Box<dyn Endpoint>> {
        let _ = deadline;
        self.connect()
    }
}

/// A shared connector ([`crate::connect`] returns one) is a connector.
impl<C: Connector + ?Sized> Connector for std::sync::Arc<C> {
    fn connect(&self) -> Result<Box<dyn Endpoint>> {
        (**self).connect()
    }
    fn connect_by(&self, deadline: Option<std::time::Instant>) -> Result<Box<dyn Endpoint>> {
        (**self).connect_by(deadline)
    }
}

/// A boxed connector is a connector.
impl<C: Connector + ?Sized> Connector for Box<C> {
    fn connect(&self) -> Result<Box<dyn Endpoint>> {
        (**self).connect()
    }
    fn connect_by(&self, deadline: Option<std::time::Instant>) -> Result<Box<dyn Endpoint>> {
        (**self).connect_by(deadline)
    }
}

/// One-verb conveniences on any endpoint. Each call is one round trip; hot paths build batches.
pub trait EndpointExt: Endpoint {
    /// Reads `len` bytes at `addr`.
    fn read(&mut self, addr: RemoteAddr, len: usize) -> Result<Vec<u8>> {
        let mut batch = Batch::new();
        let handle = batch.read(addr, len);
        let mut out = Completions::new();
        self.execute(&batch, &mut out)?;
        Ok(out.bytes(handle).to_vec())
    }

    /// Reads the little-endian word at `addr`.
    fn read_u64(&mut self, addr: RemoteAddr) -> Result<u64> {
        let mut batch = Batch::new();
        let handle = batch.read(addr, 8);
        let mut out = Completions::new();
        self.execute(&batch, &mut out)?;
        Ok(out.word(handle, 0))
    }

    /// Writes `data` at `addr`.
    fn write(&mut self, addr: RemoteAddr, data: &[u8]) -> Result<()> {
        let mut batch = Batch::new();
        batch.write(addr, data);
        self.execute(&batch, &mut Completions::new())
    }

    /// Writes the word `value` at `addr`.
    fn write_u64(&mut self, addr: RemoteAddr, value: u64) -> Result<()> {
        self.write(addr, &value.to_le_bytes())
    }

    /// Compare-and-swap; returns the old value (the swap happened iff it equals `expect`).
    fn cas(&mut self, addr: RemoteAddr, expect: u64, swap: u64) -> Result<u64> {
        self.one_atomic(|b| b.cas(addr, expect, swap))
    }

    /// Fetch-and-add; returns the old value.
    fn faa(&mut self, addr: RemoteAddr, add: u64) -> Result<u64> {
        self.one_atomic(|b| b.faa(addr, add))
    }

    /// Masked compare-and-swap; returns the old value.
    fn masked_cas(
        &mut self,
        addr: RemoteAddr,
        cmp: u64,
        cmp_mask: u64,
        swap: u64,
        swap_mask: u64,
    ) -> Result<u64> {
        self.one_atomic(|b| b.masked_cas(addr, cmp, cmp_mask, swap, swap_mask))
    }

    /// Masked fetch-and-add; returns the old value.
    fn masked_faa(&mut self, addr: RemoteAddr, add: u64, boundary_mask: u64) -> Result<u64> {
        self.one_atomic(|b| b.masked_faa(addr, add, boundary_mask))
    }

    #[doc(hidden)]
    fn one_atomic(
        &mut self,
        post: impl FnOnce(&mut Batch) -> crate::batch::AtomicHandle,
    ) -> Result<u64> {
        let mut batch = Batch::new();
        let handle = post(&mut batch);
        let mut out = Completions::new();
        self.execute(&batch, &mut out)?;
        Ok(out.old(handle))
    }
}

impl<E: Endpoint + ?Sized> EndpointExt for E {}

/// Measures the round-trip time of an 8-byte read at `addr`: the median of `samples` reads.
///
/// The lock manager derives its `T_wait` from this (CITRON §3.5.5 reserves a share of the wait
/// for every round trip a conflicting client may take).
pub fn measure_rtt(
    endpoint: &mut dyn Endpoint,
    addr: RemoteAddr,
    samples: usize,
) -> Result<Duration> {
    let mut batch = Batch::new();
    batch.read(addr, 8);
    let mut out = Completions::new();
    let mut times = Vec::with_capacity(samples.max(1));
    for _ in 0..samples.max(1) {
        let start = Instant::now();
        endpoint.execute(&batch, &mut out)?;
        times.push(start.elapsed());
    }
    times.sort_unstable();
    Ok(times[times.len() / 2])
}

/// Round-trip times of 8-byte reads measured by several threads at once
/// ([`measure_rtt_under_load`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RttProfile {
    /// Threads that posted reads concurrently, each on its own endpoint.
    pub threads: usize,
    /// Round trips timed, all threads together.
    pub samples: usize,
    /// Median round trip.
    pub p50: Duration,
    /// 90th percentile.
    pub p90: Duration,
    /// 99th percentile.
    pub p99: Duration,
}

/// Measures the round trip of an 8-byte read at `addr` while `threads` endpoints of
/// `connector`, one per thread, each post `samples` reads back to back (after `samples / 10`
/// untimed ones).
///
/// Why under load: a lock protocol's timing bounds (CITRON's `T_wait`) matter only when clients
/// conflict, that is, when many of them are posting at once; and on a backend whose verbs a
/// server CPU executes (`tcp`), a round trip then includes queueing behind the other threads,
/// not only the wire. A single thread on an idle machine measures neither: on the 2-core test
/// VMs it saw anything from 6 µs (a busy core) to 80 µs (cores waking from idle) over tcp.
pub fn measure_rtt_under_load(
    connector: &dyn Connector,
    addr: RemoteAddr,
    threads: usize,
    samples: usize,
) -> Result<RttProfile> {
    let threads = threads.max(1);
    let samples = samples.max(1);
    let mut endpoints = (0..threads)
        .map(|_| connector.connect())
        .collect::<Result<Vec<_>>>()?;
    let start = std::sync::Barrier::new(threads);
    let per_thread = std::thread::scope(|s| {
        let workers: Vec<_> = endpoints
            .iter_mut()
            .map(|ep| {
                let start = &start;
                s.spawn(move || -> Result<Vec<Duration>> {
                    let mut batch = Batch::new();
                    batch.read(addr, 8);
                    let mut out = Completions::new();
                    let mut times = Vec::with_capacity(samples);
                    start.wait();
                    for _ in 0..samples / 10 {
                        ep.execute(&batch, &mut out)?; // warm-up, not timed
                    }
                    for _ in 0..samples {
                        let posted = Instant::now();
                        ep.execute(&batch, &mut out)?;
                        times.push(posted.elapsed());
                    }
                    Ok(times)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("an RTT probe thread panicked"))
            .collect::<Result<Vec<_>>>()
    })?;
    let mut all: Vec<Duration> = per_thread.into_iter().flatten().collect();
    all.sort_unstable();
    let at = |q: f64| all[((all.len() - 1) as f64 * q).round() as usize];
    Ok(RttProfile {
        threads,
        samples: all.len(),
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemServer, RegionId};

    #[test]
    fn rtt_under_load_counts_every_thread() {
        let server = MemServer::new();
        server.register(RegionId(1), 64).unwrap();
        let profile =
            measure_rtt_under_load(&server, RemoteAddr::new(RegionId(1), 0), 3, 40).unwrap();
        assert_eq!((profile.threads, profile.samples), (3, 120));
        assert!(profile.p50 <= profile.p90 && profile.p90 <= profile.p99);
        // A verb the server refuses is an error, not a measurement.
        assert!(measure_rtt_under_load(&server, RemoteAddr::new(RegionId(9), 0), 2, 5).is_err());
    }
}
