//! The data-server registry: registrations and departures of data servers, the endpoints of
//! the live ones, the layout epoch clients watch, and every zeroing of their chunks — the
//! scrub after an unclean shutdown, tails of truncates, and the reclaimer that zeroes and
//! recycles freed chunks.
//!
//! # Nothing is zeroed under a live server's clients
//! Every zeroing a registration does to chunks that may hold file data — the scrub of free
//! chunks after an unclean shutdown, the tails of truncates left unzeroed — happens *before*
//! the server is live (in [`LiveServers`], so in the layout clients see and among the servers
//! chunks are allocated on), so no client write to the server can land before it and be zeroed
//! by it. (Dirty chunks are no file's: they go to the reclaimer.)
//!
//! # Registrations of one server never overlap
//! A data server killed during its registration (a scrub takes seconds for a large region) and
//! started again registers again while the first registration still runs. The two are
//! serialized by the server's name: otherwise the second, finding the scrub not done yet,
//! scrubs from its own list of free chunks while the first one makes the server live —
//! zeroing chunks that clients were meanwhile allocated and wrote (a soak lost acknowledged
//! data this way).
//!
//! # The state lock
//! [`LiveServers`] lives under the service's state lock (the `state` argument of the methods
//! here), together with the namespace changes and allocations: a registration's lost-chunk
//! scan, an allocation's choice of servers and a truncate's check that its tail is reachable
//! all see one moment. Long fabric work runs after that lock is released, on the server's own
//! endpoint mutex.

use crate::fences::FenceTable;
use crate::reclaim::Reclaimer;
use crate::store::{Block, Store, Tail};
use crate::sync::lock;
use fabric::{Connector, Endpoint, EndpointExt, FabricAddr, RegionId, RemoteAddr};
use proto::{ChunkLoc, FsError, Ino};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A live data server's endpoint, shared by whoever zeroes its chunks.
pub(crate) type SharedEndpoint = Arc<Mutex<Box<dyn Endpoint>>>;

struct LiveServer {
    /// Which connection registered it; a stale connection closing does not unregister it.
    epoch: u64,
    region: RegionId,
    endpoint: SharedEndpoint,
}

/// The data servers registered and connected now, kept under the service's state lock.
pub(crate) struct LiveServers {
    live: BTreeMap<u32, LiveServer>,
    next_epoch: u64,
}

impl Default for LiveServers {
    fn default() -> Self {
        LiveServers {
            live: BTreeMap::new(),
            next_epoch: 1,
        }
    }
}

impl LiveServers {
    /// Makes server `id` live with `endpoint` on `region`; the new connection epoch.
    fn insert(&mut self, id: u32, region: RegionId, endpoint: Box<dyn Endpoint>) -> u64 {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let endpoint = Arc::new(Mutex::new(endpoint));
        self.live.insert(
            id,
            LiveServer {
                epoch,
                region,
                endpoint,
            },
        );
        epoch
    }

    /// Removes server `id` if its connection epoch is `epoch`; whether it did.
    fn remove(&mut self, id: u32, epoch: u64) -> bool {
        let current = self.live.get(&id).is_some_and(|s| s.epoch == epoch);
        if current {
            self.live.remove(&id);
        }
        current
    }

    /// Whether server `id` is live.
    pub fn is_live(&self, id: u32) -> bool {
        self.live.contains_key(&id)
    }

    /// The live servers' ids, in order.
    pub fn ids(&self) -> Vec<u32> {
        self.live.keys().copied().collect()
    }

    /// The live servers' ids as a set.
    pub fn id_set(&self) -> HashSet<u32> {
        self.live.keys().copied().collect()
    }

    /// Live server `id`'s endpoint and region; an error when it is not connected.
    pub(crate) fn endpoint(&self, id: u32) -> Result<(SharedEndpoint, RegionId), FsError> {
        let live = self
            .live
            .get(&id)
            .ok_or_else(|| FsError::Io(format!("data server {id} is not connected")))?;
        Ok((live.endpoint.clone(), live.region))
    }

    /// A shrink of `ino` to `size` leaves bytes of its last chunk to zero (a tail); refuses it
    /// (`Unavailable`, which the client retries) while that chunk's data server is away. A
    /// tail left to zero later would be zeroed when the server registers again, and on shm a
    /// client that has not noticed the server's absence yet can still write to its region:
    /// data written past the new size meanwhile would be zeroed then.
    pub fn check_tail_reachable(&self, store: &Store, ino: Ino, size: u64) -> Result<(), FsError> {
        let (chunk, from) = store.layout().locate(size);
        if from == 0 {
            return Ok(());
        }
        // The replicas that hold the data: a lost one (dropped, or its server came back with
        // new memory) is never read again, and its block is zeroed whole when freed.
        let replicas = match store.chunk_map(ino, chunk, 1) {
            Ok(mut sets) => sets.pop().flatten(),
            // Every replica lost: each counts, as for a chunk of one replica.
            Err(FsError::Lost(_)) => store.chunk_at(ino, chunk)?,
            Err(e) => return Err(e),
        };
        match replicas
            .iter()
            .flat_map(|r| r.as_slice())
            .find(|loc| !self.is_live(loc.server))
        {
            Some(loc) => Err(FsError::Unavailable(format!(
                "data server {} holds the last chunk of the truncated file and is away",
                loc.server
            ))),
            None => Ok(()),
        }
    }

    /// Growing `ino` from `old` to `new` bytes: the bytes from the old size to the end of its
    /// chunk become part of the file and must read zeros (they should be; a write that failed
    /// after its data verbs may have left some); zeroes them now, with the state lock held.
    pub fn zero_grown(&self, store: &Store, ino: Ino, old: u64, new: u64) -> Result<(), FsError> {
        let layout = store.layout();
        let (chunk, from) = layout.locate(old);
        if new <= old || from == 0 {
            return Ok(());
        }
        if let Some(Some(replicas)) = store.chunk_map(ino, chunk, 1)?.first() {
            for loc in replicas.as_slice() {
                // A replica whose server is away is skipped while another is here: its reads
                // go to the others (docs/REPLICAS.md).
                if replicas.len() > 1 && !self.is_live(loc.server) {
                    continue;
                }
                let (endpoint, region) = self.endpoint(loc.server)?;
                let base = loc.index * layout.unit();
                let mut ep = lock(&endpoint);
                zero_range(&mut **ep, region, base + from, base + layout.len(chunk))?;
            }
        }
        Ok(())
    }
}

/// Finds live server `id`'s endpoint and region ([`LiveServers::endpoint`]).
type FindEndpoint<'a> = Box<dyn FnMut(u32) -> Result<(SharedEndpoint, RegionId), FsError> + 'a>;

/// One-sided reads and writes of replicas' blocks on the live data servers, through the
/// registry's endpoints, for the consistency checker's replica checks
/// ([`crate::replica_check`]); a server not connected is an error.
pub(crate) struct ReplicaEndpoints<'a> {
    /// Finds a live server's endpoint and region.
    find: FindEndpoint<'a>,
    /// Bytes of a layout unit (a block's index is in units).
    unit: u64,
}

impl LiveServers {
    /// Reads and writes of replicas' blocks through these servers' endpoints (the caller
    /// holds the state lock throughout).
    pub fn replica_io(&self, unit: u64) -> ReplicaEndpoints<'_> {
        ReplicaEndpoints {
            find: Box::new(move |id| self.endpoint(id)),
            unit,
        }
    }
}

impl<'a> ReplicaEndpoints<'a> {
    /// Reads and writes of replicas' blocks through the endpoints of the servers live in
    /// `state`, the state lock taken only to find each one's.
    pub fn looked_up<S: AsMut<LiveServers>>(state: &'a Mutex<S>, unit: u64) -> Self {
        ReplicaEndpoints {
            find: Box::new(move |id| lock(state).as_mut().endpoint(id)),
            unit,
        }
    }
}

impl crate::replica_check::ReplicaIo for ReplicaEndpoints<'_> {
    fn read(&mut self, loc: ChunkLoc, offset: u64, buf: &mut [u8]) -> Result<(), FsError> {
        let (endpoint, region) = (self.find)(loc.server)?;
        let mut ep = lock(&endpoint);
        let piece = ep.capabilities().max_io_bytes.clamp(8, 1 << 20);
        let base = loc.index * self.unit + offset;
        for (i, part) in buf.chunks_mut(piece).enumerate() {
            let at = base + (i * piece) as u64;
            part.copy_from_slice(&ep.read(RemoteAddr::new(region, at), part.len())?);
        }
        Ok(())
    }

    fn write(&mut self, loc: ChunkLoc, offset: u64, data: &[u8]) -> Result<(), FsError> {
        let (endpoint, region) = (self.find)(loc.server)?;
        let mut ep = lock(&endpoint);
        let piece = ep.capabilities().max_io_bytes.clamp(8, 1 << 20);
        let base = loc.index * self.unit + offset;
        for (i, part) in data.chunks(piece).enumerate() {
            ep.write(RemoteAddr::new(region, base + (i * piece) as u64), part)?;
        }
        Ok(())
    }
}

/// What the registry needs of the meta server's settings.
pub(crate) struct RegistrySettings {
    /// To connect to the data servers' fabric.
    pub credentials: fabric::Credentials,
    /// Bytes of a chunk: a region holds `region_bytes / chunk_size` of them.
    pub chunk_size: u64,
    /// The first session id of this run: data servers refuse every session below it.
    pub first_session: u64,
    /// When this run is a restart: when every lock lease of the earlier run has run out. A
    /// data server whose backend cannot refuse the earlier run's sessions (shm, mem) is made
    /// live no sooner.
    pub earlier_leases_until: Option<Instant>,
}

/// The data-server registry (see the module docs).
pub(crate) struct Registry {
    settings: RegistrySettings,
    /// One mutex per data server name, held across each registration of that server: see
    /// "Registrations of one server never overlap".
    registering: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Set when the meta server itself is stopping: connections it closes are then expected,
    /// not news worth a warning.
    stopping: AtomicBool,
    /// [`proto::ClusterInfo::layout_epoch`]: bumped by every registration and disconnection.
    layout_epoch: AtomicU64,
    /// Freed chunks on their way to being zeroed and recycled ([`crate::reclaim`]).
    reclaimer: Reclaimer,
    /// Tests: runs inside a scrub, after the free chunks were listed and before they are zeroed.
    #[cfg(test)]
    pub(crate) scrub_hook: Mutex<Option<Arc<dyn Fn() + Send + Sync>>>,
}

/// How long an allocation that found no free chunk waits for the reclaimer to recycle the
/// chunks freed before it.
const RECLAIM_WAIT: Duration = Duration::from_secs(5);

impl Registry {
    /// A registry with no server registered yet.
    pub fn new(settings: RegistrySettings) -> Registry {
        Registry {
            settings,
            registering: Mutex::new(HashMap::new()),
            stopping: AtomicBool::new(false),
            layout_epoch: AtomicU64::new(1),
            reclaimer: Reclaimer::default(),
            #[cfg(test)]
            scrub_hook: Mutex::new(None),
        }
    }

    /// The layout epoch ([`proto::ClusterInfo::layout_epoch`]).
    pub fn layout_epoch(&self) -> u64 {
        self.layout_epoch.load(Ordering::SeqCst)
    }

    /// Says that the data servers' layout changed: clients fetch it again at their next
    /// heartbeat.
    fn layout_changed(&self) {
        self.layout_epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// Marks the meta server as stopping: connections closed from now on are expected.
    pub fn begin_shutdown(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Registers a data server (by its stable name) and connects to its region; returns its id
    /// and the connection epoch to pass to [`Registry::gone`]. Fences the earlier run's
    /// clients out of it, scrubs it after an unclean shutdown and zeroes the tails left on it,
    /// all before it is live (see the module docs), then queues its dirty chunks.
    #[allow(clippy::too_many_arguments)]
    pub fn register<S: AsMut<LiveServers>>(
        &self,
        state: &Mutex<S>,
        store: &Store,
        fences: &FenceTable,
        name: &str,
        fabric: FabricAddr,
        region: RegionId,
        region_bytes: u64,
        incarnation: u64,
        zone: Option<&str>,
    ) -> Result<(u32, u64), FsError> {
        let chunks = self.chunks_of(name, region_bytes)?;
        let one_at_a_time = lock(&self.registering)
            .entry(name.to_owned())
            .or_default()
            .clone();
        let _registering = lock(&one_at_a_time);
        let mut endpoint = self.connect_fenced(name, &fabric)?;
        let (record, lost) = {
            // Serialized with allocations (the lost-chunk scan must be exact).
            let _st = lock(state);
            store.register_server_in_zone(name, &fabric, region, chunks, incarnation, zone)?
        };
        let id = record.id;
        if store.needs_scrub(id)? {
            // Before it is live, so nothing is allocated on it meanwhile.
            self.scrub(store, &mut *endpoint, region, id)?;
        }
        Self::zero_tails_of(store, &mut *endpoint, region, id)?;
        if lost > 0 {
            tracing::error!(
                name,
                id,
                lost,
                "data server came back with new memory (a new incarnation): its replicas are \
                 lost; chunks with a live replica elsewhere are read from it and re-replicated, \
                 the others read EIO (`citronfs fsck` lists the files)"
            );
        }
        let epoch = lock(state).as_mut().insert(id, region, endpoint);
        fences.server_registered(id, epoch);
        self.layout_changed();
        tracing::info!(
            name,
            id,
            chunks,
            zone = zone.unwrap_or("(none)"),
            ?fabric,
            "data server registered"
        );
        // Chunks freed while it was away are zeroed now that it is reachable.
        let dirty: Vec<Block> = store
            .dirty_chunks()?
            .into_iter()
            .filter(|b| b.loc.server == id)
            .collect();
        self.zero_and_recycle(dirty);
        Ok((id, epoch))
    }

    /// How many chunks a server named `name` with a region of `region_bytes` holds; an error
    /// for a server without a name or a region without a chunk.
    fn chunks_of(&self, name: &str, region_bytes: u64) -> Result<u64, FsError> {
        if name.is_empty() {
            return Err(FsError::Invalid("a data server needs a name".into()));
        }
        let chunks = region_bytes / self.settings.chunk_size;
        if chunks == 0 {
            return Err(FsError::Invalid(format!(
                "a region of {region_bytes} bytes holds no chunk of {} bytes",
                self.settings.chunk_size
            )));
        }
        Ok(chunks)
    }

    /// Connects to a registering server's fabric, and keeps the earlier run's clients out.
    ///
    /// Before anything is zeroed or allocated there: clients of an earlier run of this server
    /// that have not noticed the restart may still hold chunk locations the crash forgot
    /// (allocations it rolled back), and their writes would land in chunks that the scrub
    /// zeroes and this run hands to other files (a soak found a record slot holding another
    /// file's bytes); and a write of theirs still under a lock of the earlier run would meet
    /// writers under this run's locks. From then on the data server refuses their sessions,
    /// and no batch of theirs is still executing (tcp); where it cannot refuse, the earlier
    /// run's leases are waited out instead.
    fn connect_fenced(
        &self,
        name: &str,
        fabric: &FabricAddr,
    ) -> Result<Box<dyn Endpoint>, FsError> {
        let mut endpoint = fabric::connect(fabric, &self.settings.credentials, 0)?.connect()?;
        let fenced =
            fabric::procedure::raise_session_floor(&mut *endpoint, self.settings.first_session)?;
        if !fenced {
            // Nothing can be refused here (shm: clients map the region themselves), so time
            // does it: an earlier run's client posts a write's verbs only while its lock's lease
            // has some time left (fs-client's `io`), and every such lease ran out by then.
            if let Some(wait) = self
                .settings
                .earlier_leases_until
                .and_then(|until| until.checked_duration_since(Instant::now()))
            {
                tracing::info!(
                    name,
                    ?wait,
                    "waiting out the earlier run's lock leases before the data server is used"
                );
                std::thread::sleep(wait);
            }
        }
        Ok(endpoint)
    }

    /// Zeroes every free block of data server `id` (after an unclean shutdown, see `store`):
    /// allocations the crash rolled back left data in blocks now free again.
    fn scrub(
        &self,
        store: &Store,
        ep: &mut dyn Endpoint,
        region: RegionId,
        id: u32,
    ) -> Result<(), FsError> {
        let mut free = store.free_chunks_of(id)?;
        #[cfg(test)]
        {
            let hook = lock(&self.scrub_hook).clone();
            if let Some(hook) = hook {
                hook();
            }
        }
        let started = Instant::now();
        zero_free_runs(ep, region, store.layout().unit(), &mut free)?;
        store.scrubbed(id)?;
        tracing::info!(
            id,
            chunks = free.len(),
            elapsed = ?started.elapsed(),
            "zeroed the free chunks of a data server after an unclean shutdown"
        );
        Ok(())
    }

    /// Zeroes the tails of truncates a crash (or server `id`'s absence) left unzeroed on it:
    /// before it is live, so no write extending such a file lands there first. A tail that
    /// cannot be zeroed yet stays listed.
    fn zero_tails_of(
        store: &Store,
        ep: &mut dyn Endpoint,
        region: RegionId,
        id: u32,
    ) -> Result<(), FsError> {
        let tails: Vec<Tail> = store
            .tails()?
            .into_iter()
            .filter(|tail| tail.block.loc.server == id)
            .collect();
        // After one flush: the truncates that left them are durable.
        let flushed = if tails.is_empty() {
            Ok(())
        } else {
            store.flush()
        };
        for tail in tails {
            let (loc, from, to) = tail_bytes(store, &tail);
            let zeroed = flushed.clone().and_then(|()| {
                zero_in_block(store, ep, region, loc, from, to)?;
                store.tail_zeroed(loc)
            });
            if let Err(error) = zeroed {
                tracing::warn!(?tail, %error, "cannot zero a truncated chunk's tail yet");
            }
        }
        Ok(())
    }

    /// A data server's registration connection `epoch` closed: it is no longer live (unless it
    /// registered again since) and a fence no longer waits for it. Unless the meta server is
    /// stopping, `down` runs next, under the same hold of the state lock (so before any
    /// allocation, registration or layout answer sees the server away): the service drops the
    /// server's replicas there (docs/REPLICAS.md "A dead data server"). The layout epoch moves
    /// after it.
    pub fn gone<S: AsMut<LiveServers>>(
        &self,
        state: &Mutex<S>,
        fences: &FenceTable,
        id: u32,
        epoch: u64,
        down: impl FnOnce(&mut S),
    ) {
        fences.server_gone(id, epoch);
        let mut st = lock(state);
        if st.as_mut().remove(id, epoch) {
            if self.stopping.load(Ordering::Relaxed) {
                tracing::info!(id, "data server connection closed at shutdown");
            } else {
                tracing::warn!(id, "data server disconnected");
                down(&mut st);
            }
            self.layout_changed();
        }
    }

    /// Zeroes bytes `from..to` of the block at `loc` with one-sided writes, through the live
    /// server's endpoint (the state lock taken only to find it).
    fn zero_chunk<S: AsMut<LiveServers>>(
        &self,
        state: &Mutex<S>,
        store: &Store,
        loc: ChunkLoc,
        from: u64,
        to: u64,
    ) -> Result<(), FsError> {
        let (endpoint, region) = lock(state).as_mut().endpoint(loc.server)?;
        let mut ep = lock(&endpoint);
        zero_in_block(store, &mut **ep, region, loc, from, to)
    }

    /// Zeroes the tail of a chunk a shrinking truncate left (`Effects::tail`), once the
    /// truncate is durable; a tail whose server is away is zeroed when it registers again.
    pub fn zero_tail<S: AsMut<LiveServers>>(
        &self,
        state: &Mutex<S>,
        store: &Store,
        tail: Tail,
    ) -> Result<(), FsError> {
        store.flush()?;
        let (loc, from, to) = tail_bytes(store, &tail);
        self.zero_chunk(state, store, loc, from, to)?;
        store.tail_zeroed(loc)
    }

    /// Hands freed blocks (their free has committed) to the reclaimer thread, which zeroes
    /// them once the free is durable and returns them to their servers' free stacks
    /// ([`crate::reclaim`]); a block whose server is away stays dirty until it registers again.
    pub fn zero_and_recycle(&self, freed: Vec<Block>) {
        self.reclaimer.push(freed);
    }

    /// Runs `allocate`; when it finds no free chunk while freed chunks are still on their way
    /// to the free stacks, waits for them (up to [`RECLAIM_WAIT`]) and runs it again: a write
    /// after an unlink on a full file system waits for them, not ENOSPC.
    pub fn allocate_waiting<T>(
        &self,
        allocate: impl Fn() -> Result<T, FsError>,
    ) -> Result<T, FsError> {
        match allocate() {
            Err(FsError::NoSpace) if !self.reclaimer.wait_idle(Duration::ZERO) => {
                self.reclaimer.wait_idle(RECLAIM_WAIT);
                allocate()
            }
            other => other,
        }
    }

    /// The reclaimer thread's loop (started by `MetaServer::start`): one flush, then zeroing
    /// and recycling, per batch; returns once stopped and drained.
    pub fn run_reclaimer<S: AsMut<LiveServers>>(&self, state: &Mutex<S>, store: &Store) {
        let unit = store.layout().unit();
        while let Some(batch) = self.reclaimer.next_batch() {
            crate::reclaim::reclaim_batch(
                &batch,
                || store.flush(),
                |Block { loc, .. }| {
                    // A block queued twice (freed, and listed again by its server's
                    // registration while still dirty) was recycled by the first pass and may
                    // be a file's again: zero only what is still dirty. This thread is the
                    // only one that takes blocks out of the dirty set, so a block dirty here
                    // stays dirty (no file's) until it recycles it below.
                    let Some(order) = store.dirty_order(loc)? else {
                        return Ok(());
                    };
                    self.zero_chunk(state, store, loc, 0, unit << order)?;
                    // Under the state lock like every other allocation change, so that the
                    // consistency checker never sees a chunk between the dirty set and the
                    // free stack.
                    let _st = lock(state);
                    store.recycle(loc)
                },
            );
            self.reclaimer.done();
        }
    }

    /// Stops the reclaimer thread once it has drained its queue.
    pub fn stop_reclaimer(&self) {
        self.reclaimer.stop();
    }

    /// Waits up to `timeout` for the reclaimer to have nothing queued; whether it is idle.
    pub fn reclaimer_idle(&self, timeout: Duration) -> bool {
        self.reclaimer.wait_idle(timeout)
    }
}

/// Layout units freed and not yet zeroed, per server.
pub(crate) fn dirty_units(store: &Store) -> Result<HashMap<u32, u64>, FsError> {
    let mut dirty: HashMap<u32, u64> = HashMap::new();
    for b in store.dirty_chunks()? {
        *dirty.entry(b.loc.server).or_default() += proto::layout::Layout::units_of(b.order);
    }
    Ok(dirty)
}

/// The block of `tail` and the bytes of it to zero.
fn tail_bytes(store: &Store, tail: &Tail) -> (ChunkLoc, u64, u64) {
    let Block { loc, order } = tail.block;
    (loc, tail.from, store.layout().unit() << order)
}

/// Zeroes bytes `from..to` of the block at `loc` through `ep` to `region`.
fn zero_in_block(
    store: &Store,
    ep: &mut dyn Endpoint,
    region: RegionId,
    loc: ChunkLoc,
    from: u64,
    to: u64,
) -> Result<(), FsError> {
    let base = loc.index * store.layout().unit();
    zero_range(ep, region, base + from, base + to)
}

/// Zeroes the blocks `free` lists (unit offset, units), one range per run of adjacent blocks
/// (`free` is sorted first).
fn zero_free_runs(
    ep: &mut dyn Endpoint,
    region: RegionId,
    unit: u64,
    free: &mut [(u64, u64)],
) -> Result<(), FsError> {
    free.sort_unstable();
    let mut i = 0;
    while i < free.len() {
        let (start, mut end) = (free[i].0, free[i].0 + free[i].1);
        let mut j = i + 1;
        while j < free.len() && free[j].0 == end {
            end += free[j].1;
            j += 1;
        }
        zero_range(ep, region, start * unit, end * unit)?;
        i = j;
    }
    Ok(())
}

/// Zeroes bytes `start..end` of `region` with one-sided writes no larger than the endpoint takes.
fn zero_range(
    ep: &mut dyn Endpoint,
    region: RegionId,
    start: u64,
    end: u64,
) -> Result<(), FsError> {
    let piece = ep.capabilities().max_io_bytes.clamp(8, 1 << 20) as u64;
    let zeros = vec![0u8; piece as usize];
    let mut at = start;
    while at < end {
        let n = (end - at).min(piece);
        ep.write(RemoteAddr::new(region, at), &zeros[..n as usize])?;
        at += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta_region::OwnRegion;
    use fabric::local::LocalEndpoint;
    use fabric::Region;

    const R: RegionId = RegionId(3);

    fn filled(bytes: u64) -> LocalEndpoint<OwnRegion> {
        let mut ep = LocalEndpoint::new(Arc::new(OwnRegion(Arc::new(Region::anonymous(R, bytes)))));
        ep.write(RemoteAddr::new(R, 0), &vec![0xFF; bytes as usize])
            .unwrap();
        ep
    }

    fn bytes(ep: &mut LocalEndpoint<OwnRegion>, len: u64) -> Vec<u8> {
        ep.read(RemoteAddr::new(R, 0), len as usize).unwrap()
    }

    #[test]
    fn a_scrub_zeroes_exactly_the_free_blocks() {
        let mut ep = filled(1024);
        // Units of 64 bytes: blocks 4..6 and 2..3 (adjacent once sorted), and 10.
        let mut free = vec![(4, 2), (2, 2), (10, 1)];
        zero_free_runs(&mut ep, R, 64, &mut free).unwrap();
        let got = bytes(&mut ep, 1024);
        for (i, b) in got.iter().enumerate() {
            let unit = i as u64 / 64;
            let want = if (2..6).contains(&unit) || unit == 10 {
                0
            } else {
                0xFF
            };
            assert_eq!(*b, want, "byte {i}");
        }
    }

    #[test]
    fn zeroing_a_range_stays_inside_it() {
        let mut ep = filled(256);
        zero_range(&mut ep, R, 3, 200).unwrap();
        let got = bytes(&mut ep, 256);
        assert!(got[..3].iter().all(|&b| b == 0xFF));
        assert!(got[3..200].iter().all(|&b| b == 0));
        assert!(got[200..].iter().all(|&b| b == 0xFF));
    }

    #[test]
    fn only_the_registering_connection_unregisters_a_server() {
        let mut live = LiveServers::default();
        let first = live.insert(1, R, Box::new(filled(64)));
        let second = live.insert(1, R, Box::new(filled(64)));
        assert!(second > first, "connection epochs increase");
        assert!(!live.remove(1, first), "a stale connection");
        assert!(live.is_live(1));
        assert_eq!(live.ids(), vec![1]);
        assert!(live.remove(1, second));
        assert!(!live.is_live(1));
        assert!(live.endpoint(1).is_err());
    }

    #[test]
    fn a_registration_needs_a_name_and_room_for_a_chunk() {
        let registry = Registry::new(RegistrySettings {
            credentials: fabric::Credentials::new("citronfs", ""),
            chunk_size: 1 << 16,
            first_session: 1,
            earlier_leases_until: None,
        });
        assert!(matches!(
            registry.chunks_of("", 1 << 20),
            Err(FsError::Invalid(_))
        ));
        assert!(matches!(
            registry.chunks_of("ds", 1 << 15),
            Err(FsError::Invalid(_))
        ));
        assert_eq!(registry.chunks_of("ds", 1 << 20).unwrap(), 16);
        assert_eq!(registry.layout_epoch(), 1);
    }
}
