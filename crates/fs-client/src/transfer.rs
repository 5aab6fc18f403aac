//! The data verbs of one locked I/O: a read's, a write's, a hole punch's zeros and an fsync's
//! flushes, planned (`plan`) into one batch per data server per round and posted on the
//! worker's endpoints. Called with the range lock held (`locked_io`); this module takes no
//! lock and decides no retry.
//!
//! Invariants:
//! - Every batch of a round is posted before any is awaited, so their round trips overlap,
//!   and every batch posted is completed before a round returns, whatever failed: the caller
//!   releases its lock next, and no verb of its may be in flight then.
//! - A write's batches are posted only while the lock's lease has `lease_guard` left
//!   ([`Worker::check_lease_before_post`]); a read is checked against the lease after it
//!   completed ([`Worker::check_lease_after_read`]). Every batch expires ahead of the lease
//!   ([`Worker::expires`]), so that one whose server went silent is given up in time to
//!   release the lock.
//! - Each batch ends with a read of its data server's incarnation word; a word that is not
//!   the view's discards the round's outcome ([`Error::StaleDataServer`], redone).
//! - A failure other than an expired lease marks the worker broken: its endpoints' state is
//!   unknown, so they are not reused.
//! - A write puts its bytes on every replica of each chunk, all in the same rounds (one batch
//!   per data server per round, every batch of a round posted before any is awaited), and
//!   succeeds only when every replica has them. It never leaves a replica out by itself: a
//!   failure on a server whose chunks all have replicas elsewhere is
//!   [`Error::ReplicaServerFailed`], and the write is redone with the chunk map the meta
//!   server answers then (without that server's replicas once it has dropped them). A read
//!   takes each chunk from one replica (`ChunkRun::read_from`); when a data server fails it,
//!   it is read again, under the same lock, from the chunks' other replicas ([`read`];
//!   docs/REPLICAS.md).

use crate::chunks::ChunkRun;
use crate::error::{Error, Peer};
use crate::plan::{plan, Geometry, Limits, Op, ServerPlan};
use crate::workers::Worker;
use fabric::{Batch, RemoteAddr};
use proto::INCARNATION_REGION;
use std::ops::Range;

/// Bytes of a data server's incarnation word, read at the end of every data batch
/// ([`exec_data_round`]).
pub(crate) const CHECK_BYTES: usize = 8;

/// Where a read's bytes go ([`read`]).
pub(crate) enum ReadDest<'a> {
    /// A buffer grown (never shrunk) to what the read needs: its bytes and check words.
    Grow(&'a mut Vec<u8>),
    /// A slice of the caller's, at least as long as the read: the read lands in it where it
    /// also has room for the check words.
    Slice(&'a mut [u8]),
}

impl ReadDest<'_> {
    /// The same destination, for one more try of a read.
    pub(crate) fn reborrow(&mut self) -> ReadDest<'_> {
        match self {
            ReadDest::Grow(buf) => ReadDest::Grow(buf),
            ReadDest::Slice(buf) => ReadDest::Slice(buf),
        }
    }
}

/// How many bytes of zeros one batch of a hole punch writes.
const ZERO_WINDOW: usize = 1 << 20;

/// What a round of data batches does ([`exec_plans`], [`exec_data_round`]).
#[derive(Clone, Copy)]
pub(crate) enum Transfer {
    /// Read (or flush): checked against the lease after they completed.
    Read,
    /// Write: each batch posted only within the lease; with `raises`, the worker's FCB raises
    /// (`Worker::raises`, `fcb::FcbRaises`) go beside them on the meta endpoint.
    Write {
        /// Whether the worker's raise batch is to be sent.
        raises: bool,
    },
}

/// A data batch's failure as the I/O sees it, marking the worker broken when it leaves the
/// endpoint's state unknown. A batch refused for its expiry (ahead of the lock's lease
/// deadline, `Worker::expires`) is `LeaseLost` — the I/O is redone under a new lock — and
/// leaves the endpoint fine; any other failure breaks it.
fn data_failure(w: &mut Worker, e: Error) -> Error {
    match e {
        Error::Fabric {
            source: fabric::FabricError::Verb(fabric::VerbError::Expired { .. }),
            ..
        } => Error::LeaseLost,
        e => {
            w.broken = true;
            e
        }
    }
}

/// Reads bytes `[off, off + n)` into the first `n` bytes of `dest` (holes read zeros),
/// growing a `Vec` when it is shorter than the read needs (see `CitronFs::read_into`).
///
/// No second copy: the fabric's reads land in `dest`, each at its place
/// (`fabric::Batch::read_to`): a memcpy straight from the region on `shm` and `mem`, one
/// from the reply frame on `tcp`. The batches of every data server are in flight together
/// ([`exec_data_round`]).
///
/// Each chunk is read from one of its replicas (`ChunkRun::read_from`). When a data server
/// fails the read (its connection broke, it restarted, the client does not know it) and every
/// chunk of the read that has a replica there has another on a server not failed yet, the read
/// is done again at once from those others, still under the caller's lock: a dead replica
/// costs no EIO and no wait. A chunk of one replica fails as before (the caller's recovery).
pub(crate) fn read(
    w: &mut Worker,
    geometry: &Geometry,
    off: u64,
    n: usize,
    run: &ChunkRun,
    mut dest: ReadDest<'_>,
) -> Result<(), Error> {
    // Servers this read failed on: empty (no allocation) unless one did.
    let mut avoid: Vec<u32> = Vec::new();
    loop {
        let e = match read_avoiding(w, geometry, off, n, run, dest.reborrow(), &avoid) {
            Err(e) => e,
            done => return done,
        };
        match fallback(&e, geometry, off, n, run, &avoid) {
            Some(server) => {
                tracing::warn!(
                    server,
                    error = %crate::error::Chain(&e),
                    "a read failed on a data server; reading its chunks from other replicas"
                );
                avoid.push(server);
            }
            None => return Err(e),
        }
    }
}

/// The data server to read around after a read failed with `e`: the one that failed it,
/// when it is not avoided yet and every chunk of `[off, off + n)` with a replica on it has
/// another on a server not in `avoid` (so that the next try has a replica of every chunk).
fn fallback(
    e: &Error,
    geometry: &Geometry,
    off: u64,
    n: usize,
    run: &ChunkRun,
    avoid: &[u32],
) -> Option<u32> {
    let server = e.data_server().filter(|_| e.is_transient())?;
    if avoid.contains(&server) {
        return None;
    }
    let mut touched = false;
    for chunk in geometry.chunks(off, n as u64) {
        let Some(replicas) = run.get(chunk) else {
            continue;
        };
        if replicas.on(server).is_none() {
            continue;
        }
        touched = true;
        let other = replicas
            .as_slice()
            .iter()
            .any(|l| l.server != server && !avoid.contains(&l.server));
        if !other {
            return None;
        }
    }
    touched.then_some(server)
}

/// [`read`]'s one try: each chunk from a replica not on a server in `avoid`.
fn read_avoiding(
    w: &mut Worker,
    geometry: &Geometry,
    off: u64,
    n: usize,
    run: &ChunkRun,
    dest: ReadDest<'_>,
    avoid: &[u32],
) -> Result<(), Error> {
    let spread = w.view.session();
    let mut exhausted = None;
    let plans = {
        let view = &w.view;
        plan(
            geometry,
            off,
            n,
            |c| match run.read_from(c, spread, avoid, |s| view.data_server_live(s)) {
                Ok(loc) => loc,
                Err(()) => {
                    exhausted = Some(c);
                    None
                }
            },
            Limits::FABRIC,
        )?
    };
    if let Some(chunk) = exhausted {
        return Err(Error::Protocol(format!(
            "every replica of chunk {chunk} is on a data server this read failed on"
        )));
    }
    // The file's bytes, then one incarnation word per batch of a round (see
    // `exec_data_round`).
    let need = n + CHECK_BYTES * plans.len();
    let buf = match dest {
        ReadDest::Grow(buf) => {
            if buf.len() < need {
                buf.resize(need, 0);
            }
            &mut buf[..need]
        }
        ReadDest::Slice(buf) if buf.len() >= need => &mut buf[..need],
        ReadDest::Slice(buf) => {
            // No room for the check words after the bytes: read into a buffer of our
            // own and copy the bytes out.
            let mut own = Vec::new();
            read_avoiding(w, geometry, off, n, run, ReadDest::Grow(&mut own), avoid)?;
            buf[..n].copy_from_slice(&own[..n]);
            return Ok(());
        }
    };
    // A reused buffer holds an earlier read's bytes: the verbs overwrite the allocated
    // chunks' bytes, holes are zeroed here.
    for piece in geometry.pieces(off, n) {
        if run.get(piece.chunk).is_none() {
            buf[piece.buf_off..piece.buf_off + piece.len].fill(0);
        }
    }
    exec_plans(w, &plans, buf, n, Transfer::Read, |batch, at, op| {
        batch.read_to(at, op.len, op.buf_off);
    })?;
    w.check_lease_after_read()
}

/// Writes `data` at file offset `off`; chunks `run` does not have allocated are skipped
/// (holes: what `zero_allocated` relies on; a write allocates its chunks first). The
/// batches of every data server are in flight together, each posted within the lease
/// ([`exec_data_round`]); with `raises`, the worker's FCB raises go beside the first
/// round.
pub(crate) fn write(
    w: &mut Worker,
    geometry: &Geometry,
    off: u64,
    data: &[u8],
    run: &ChunkRun,
    raises: bool,
) -> Result<(), Error> {
    // A write to a replicated chunk is recorded as in flight before any of its verbs is
    // posted (`cut_repair`).
    crate::cut_repair::before_write(w, geometry, off, data.len(), run)?;
    // Every replica of each chunk, in the same rounds.
    let plans = plan(
        geometry,
        off,
        data.len(),
        |c| run.get(c).into_iter().flatten(),
        Limits::FABRIC,
    )?;
    let mut checks = vec![0u8; CHECK_BYTES * plans.len()];
    exec_plans(
        w,
        &plans,
        &mut checks,
        0,
        Transfer::Write { raises },
        |batch, at, op| {
            batch.write(at, &data[op.buf_off..op.buf_off + op.len]);
        },
    )
    .map_err(|e| on_replicas(e, run, geometry.chunks(off, data.len() as u64)))
}

/// `e`, the failure of a write's or a flush's rounds over the chunks `chunks` of `run`, as
/// [`Error::ReplicaServerFailed`] when it is a transient failure on one data server and every
/// one of those chunks with a replica there has another (so the I/O, redone with a chunk map
/// learnt anew once the meta server dropped that server's replicas, need not wait for it);
/// else `e` as it is.
pub(crate) fn on_replicas(e: Error, run: &ChunkRun, chunks: Range<u64>) -> Error {
    let Some(server) = e
        .data_server()
        .filter(|_| e.is_transient() && !e.is_fenced())
    else {
        return e;
    };
    let mut touched = false;
    for chunk in chunks {
        let Some(replicas) = run.get(chunk) else {
            continue;
        };
        if replicas.on(server).is_none() {
            continue;
        }
        if replicas.len() < 2 {
            return e;
        }
        touched = true;
    }
    match touched {
        true => Error::ReplicaServerFailed {
            server,
            source: Box::new(e),
        },
        false => e,
    }
}

/// Overwrites with zeros the allocated bytes of `[off, off + len)` (holes already read
/// zeros), in windows of [`ZERO_WINDOW`] bytes, each batch posted within the lease.
pub(crate) fn zero_allocated(
    w: &mut Worker,
    geometry: &Geometry,
    off: u64,
    len: usize,
    run: &ChunkRun,
) -> Result<(), Error> {
    let zeros = vec![0u8; ZERO_WINDOW.min(len)];
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(ZERO_WINDOW);
        write(w, geometry, off + done as u64, &zeros[..n], run, false)?;
        done += n;
    }
    Ok(())
}

/// Executes `plans` in rounds of one batch per data server ([`exec_data_round`]),
/// each batch filled by `fill` with the verbs of its ops (given the op's remote address).
/// A write's FCB raises (if any) go with the first round.
pub(crate) fn exec_plans(
    w: &mut Worker,
    plans: &[ServerPlan],
    data: &mut [u8],
    checks_at: usize,
    mut transfer: Transfer,
    mut fill: impl FnMut(&mut Batch, RemoteAddr, &Op),
) -> Result<(), Error> {
    let rounds = plans.iter().map(|sp| sp.batches.len()).max().unwrap_or(0);
    for r in 0..rounds {
        let mut round = Vec::with_capacity(plans.len());
        for sp in plans {
            let Some(pb) = sp.batches.get(r) else {
                continue;
            };
            let region = w.view.servers.region_of(sp.server)?;
            let mut batch = round_batch(w, round.len());
            for op in &pb.ops {
                fill(&mut batch, RemoteAddr::new(region, op.remote_off), op);
            }
            round.push((sp.server, batch));
        }
        exec_data_round(w, &mut round, data, checks_at, transfer)?;
        // The raises went with the first round.
        if let Transfer::Write { raises } = &mut transfer {
            *raises = false;
        }
    }
    // No round to go beside (nothing allocated to write): the raises go alone.
    if let Transfer::Write { raises: true } = transfer {
        w.check_lease_before_post()?;
        w.exec_raises()?;
    }
    Ok(())
}

/// An empty batch for the `i`-th data server of a round: the worker's own for the first
/// (a round on one server allocates nothing), a new one for the others.
fn round_batch(w: &mut Worker, i: usize) -> Batch {
    let mut batch = match i {
        0 => std::mem::take(&mut w.batch),
        _ => Batch::new(),
    };
    batch.clear();
    batch
}

/// Executes one round of data batches, at most one per data server, all posted before any
/// is awaited (`fabric::Endpoint::post`, then `complete`), so their round trips overlap.
/// Their reads land in `data` at their places (`fabric::Batch::read_to`); `data` is the
/// caller's buffer, lent to the worker's completions and taken back, never copied. With
/// `write`, each batch is posted only while the lock's lease has `lease_guard` left
/// ([`Worker::check_lease_before_post`]). A failure marks the worker broken: the endpoints'
/// state is unknown, so they must not be reused.
///
/// Every batch posted is completed before this returns, whatever failed: the caller
/// releases its lock next, and no verb of its may be in flight then.
///
/// Each batch ends with a read of its server's incarnation word (`proto::INCARNATION_REGION`)
/// after the data verbs, placed at `data[checks_at + 8 i..]` for the round's `i`-th batch:
/// if it is not the incarnation of this worker's view, the verbs reached memory other than
/// the one the view describes (the server restarted, and this client has not caught up
/// yet), so their outcome is discarded with `Error::StaleDataServer` (transient: the I/O is
/// redone once the view is fresh). A read therefore never returns a new incarnation's zeros
/// for chunks the meta server now calls lost; a write that landed there only wrote into
/// chunks of the same file (lost chunks stay allocated to their file until it frees them)
/// and is redone, failing with `Lost`.
///
/// A write's FCB raises (`Transfer::Write { raises: true }`: the worker's raise batch) are
/// posted on the meta endpoint after the data batches, within the lease and expiring with
/// it like them, and completed with them into their own completions: their round trip
/// overlaps the data's.
pub(crate) fn exec_data_round(
    w: &mut Worker,
    round: &mut [(u32, Batch)],
    data: &mut [u8],
    checks_at: usize,
    transfer: Transfer,
) -> Result<(), Error> {
    let mut out = std::mem::take(&mut w.out);
    // The reads land in the caller's buffer, lent for the round: no copy.
    let failure = out.lend(data, |out| {
        post_and_complete(w, round, out, checks_at, transfer)
    });
    w.out = out;
    if let Some((_, first)) = round.iter_mut().next() {
        w.batch = std::mem::take(first);
    }
    failure.map_or(Ok(()), Err)
}

/// [`exec_data_round`]'s work, with the caller's buffer lent to `out`: posts the
/// round's batches (and the raises), completes every one posted, and checks the
/// incarnation words; the first failure, if any.
fn post_and_complete(
    w: &mut Worker,
    round: &mut [(u32, Batch)],
    out: &mut fabric::Completions,
    checks_at: usize,
    transfer: Transfer,
) -> Option<Error> {
    let (write, raises) = match transfer {
        Transfer::Read => (false, false),
        Transfer::Write { raises } => (true, raises),
    };
    let incarnation = RemoteAddr::new(INCARNATION_REGION, 0);
    let mut posted = 0;
    let mut failure = None;
    let batches = round.len();
    // The batch completed at `fs_client::io::between_replicas`, if any (set only in the
    // `failpoints` build).
    #[cfg_attr(not(feature = "failpoints"), allow(unused_mut))]
    let mut early: Option<usize> = None;
    for (i, (server, batch)) in round.iter_mut().enumerate() {
        batch.read_to(incarnation, CHECK_BYTES, checks_at + CHECK_BYTES * i);
        // No verb of it may execute after the lease: the endpoint (or the server, on tcp)
        // checks before each verb, so a batch posted in time but delayed past the deadline
        // stops there (`LeaseLost`, the I/O is redone) instead of landing after a waiter
        // broke the lock.
        batch.expire_at(w.expires());
        if write {
            // A lease that ran out is not a fault of the endpoints: not broken.
            if let Err(e) = w.check_lease_before_post() {
                failure = Some(e);
                break;
            }
        }
        let post = w.data_ep(*server).and_then(|ep| {
            ep.post(batch, out)
                .map_err(Error::fabric(Peer::Data(*server)))
        });
        if let Err(e) = post {
            failure = Some(data_failure(w, e));
            break;
        }
        posted += 1;
        w.changed |= write;
        if write && i + 1 < batches {
            failpoint!("fs_client::io::between_servers");
            #[cfg(feature = "failpoints")]
            if early.is_none() && failpoint_configured(BETWEEN_REPLICAS) {
                // This batch completed (landed) before the next is posted, then the
                // failpoint: a write cut after its first replicas only.
                early = Some(i);
                let done = w.data_ep(*server).and_then(|ep| {
                    ep.complete(batch, out)
                        .map_err(Error::fabric(Peer::Data(*server)))
                });
                if let Err(e) = done {
                    failure = Some(data_failure(w, e));
                    break;
                }
                failpoint!("fs_client::io::between_replicas");
            }
        }
    }
    let mut raises_posted = false;
    if raises && failure.is_none() {
        w.raises.expire_at(w.expires());
        // A lease that ran out is not a fault of the endpoint: not broken.
        let post = w.check_lease_before_post().and_then(|()| {
            w.meta_ep
                .post(&w.raises, &mut w.raises_out)
                .map_err(Error::fabric(Peer::Meta))
        });
        match post {
            Ok(()) => {
                raises_posted = true;
                w.changed = true;
            }
            Err(e @ Error::Fabric { .. }) => failure = Some(data_failure(w, e)),
            Err(e) => failure = Some(e),
        }
    }
    for (i, (server, batch)) in round[..posted].iter().enumerate() {
        if early == Some(i) {
            continue;
        }
        let done = w.data_ep(*server).and_then(|ep| {
            ep.complete(batch, out)
                .map_err(Error::fabric(Peer::Data(*server)))
        });
        if let Err(e) = done {
            let e = data_failure(w, e);
            failure.get_or_insert(e);
        }
    }
    if raises_posted {
        if let Err(e) = w.meta_ep.complete(&w.raises, &mut w.raises_out) {
            let e = data_failure(w, Error::fabric(Peer::Meta)(e));
            failure.get_or_insert(e);
        }
    }
    if failure.is_none() {
        for (i, (server, _)) in round.iter().enumerate() {
            let at = checks_at + CHECK_BYTES * i;
            let found = u64::from_le_bytes(
                out.data()[at..at + CHECK_BYTES]
                    .try_into()
                    .expect("8 bytes"),
            );
            let expected = w.view.servers.data(*server).map(|ds| ds.info.incarnation);
            if expected != Some(found) {
                w.broken = true;
                failure = Some(Error::StaleDataServer {
                    server: *server,
                    expected: expected.unwrap_or(0),
                    found,
                });
                break;
            }
        }
    }
    failure
}

/// The failpoint between the batches of a write's round where the batches posted so far have
/// completed (`post_and_complete`): the crash tests' cut between replicas.
#[cfg(feature = "failpoints")]
const BETWEEN_REPLICAS: &str = "fs_client::io::between_replicas";

/// Whether a test configured failpoint `name` (checked only in the `failpoints` build).
#[cfg(feature = "failpoints")]
fn failpoint_configured(name: &str) -> bool {
    fail::list().iter().any(|(n, _)| n == name)
}

/// Flushes the chunks of `run` to their data servers' backing files: one batch of flush
/// verbs per data server, with runs of adjacent chunks merged into one verb (the data half of
/// `fsync`; docs/ARCHITECTURE.md "fs-client").
pub(crate) fn flush(w: &mut Worker, geometry: &Geometry, run: &ChunkRun) -> Result<(), Error> {
    // Byte ranges of the chunks in each server's region.
    let mut per_server: std::collections::BTreeMap<u32, Vec<Range<u64>>> = Default::default();
    for (i, replicas) in run.locs.iter().enumerate() {
        let Some(replicas) = replicas else { continue };
        let chunk = run.first + i as u64;
        for loc in replicas.as_slice() {
            let range = geometry
                .region_range(chunk, *loc)
                .ok_or_else(|| Error::Protocol(format!("chunk {chunk} lies beyond any address")))?;
            per_server.entry(loc.server).or_default().push(range);
        }
    }
    for (server, mut ranges) in per_server {
        ranges.sort_unstable_by_key(|r| r.start);
        let region = w.view.servers.region_of(server)?;
        // One range per run of adjacent chunks.
        let mut runs: Vec<Range<u64>> = Vec::new();
        for r in ranges {
            match runs.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => runs.push(r),
            }
        }
        // A batch carries at most MAX_BATCH_VERBS verbs; stay well below.
        for group in runs.chunks(1024) {
            let mut batch = round_batch(w, 0);
            for r in group {
                batch.flush(RemoteAddr::new(region, r.start), r.end - r.start);
            }
            let mut check = vec![0u8; CHECK_BYTES];
            let chunks = run.first..run.first + run.locs.len() as u64;
            exec_data_round(w, &mut [(server, batch)], &mut check, 0, Transfer::Read)
                .map_err(|e| on_replicas(e, run, chunks))?;
        }
    }
    Ok(())
}
