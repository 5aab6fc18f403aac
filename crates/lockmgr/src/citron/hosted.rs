//! Host-executed acquisitions: CITRON's acquire and release run at the lock tree's host on
//! behalf of a client, an acquire in one round trip and a release posted without one (Cell,
//! Cell: where a server's CPU executes every verb anyway, let it run the multi-step operation
//! next to memory instead of answering one round trip per step; chosen per endpoint).
//!
//! On the `tcp` fabric every one-sided verb is executed by the server's CPU, so each round trip
//! of Alg. 2 — the ticket, the phase-(b) reads, each poll of a ticket or of the phase-(d)
//! window — costs the server a wake-up and the client a system call pair. A hosted client sends
//! one procedure call ([`fabric::procedure`]) instead; the host runs *the same protocol on the
//! same words*: it opens an ordinary [`CitronClient`] whose endpoint is the host's own memory
//! (`fabric`'s host endpoints: the same executor, region checks and fencing as the client's
//! batches) and calls its `acquire` — Alg. 1 and Alg. 2 l. 4-37 with the fast path (§3.8),
//! starvation avoidance (§3.5.4) and lease recovery (§3.10) — and later its `release` (Alg. 3),
//! which the client posts and does not wait for (`CitronClient::release_hosted` says why that
//! is safe).
//! Nothing in the lock words tells a hosted acquisition from a one-sided one, so hosted and
//! one-sided clients share one tree, and the protocol's safety argument covers both: the host
//! client is just another client, with its own `t1`/`t2` for inequality (1) (§3.5.5) on the
//! host's clock, and its waits (ticket polls, the phase-(d) window) cost no network at all.
//!
//! Modes: a shared request (`RangeLock::acquire_mode`, `docs/SHARED_LOCKS.md`) is run at the
//! host in shared mode, an exclusive one exclusively: the host's client takes what the
//! client's own would have. So overlapping shared requests of several hosted clients (each
//! connection's calls run one at a time, on the connection's thread) hold their ranges
//! together, beside one-sided readers, and an exclusive one waits for all of them. An exclusive
//! request travels as [`Call::Acquire`], the call of builds before the modes; a shared one as
//! [`Call::AcquireMode`], answered with the mode granted.
//!
//! The lease: the host returns, with a grant, how much of the lock's lease (`lease` module) was
//! left when the call *began* at the host; the client counts it from the instant it *sent* the
//! call, which is earlier, so its deadline is never later than the host's.
//!
//! Choosing (per endpoint, [`Hosting`]): a client hosts its acquisitions when its endpoint's
//! backend has the server's CPU on the data path (`tcp`: the round trips a one-sided acquire
//! would take cost the server CPU anyway), the server offers the procedure ([`CitronHost`]
//! registered under [`PROCEDURE`]), and the host can open the lock as the client would. A client
//! with a fence (`ClientOptions::fence`) is hosted only by a host that fences on its behalf
//! ([`CitronHost::fencing`]): the host could not call the client's own before a break-in.
//! A host connection that closes leaves what its client held to lease recovery, exactly like a
//! one-sided client that died: the client may still be inside its critical section. A shared
//! hold's reader registrations are recovered by the readers' rules (`docs/SHARED_LOCKS.md`,
//! "Lease recovery (§3.10) for readers"), with the host's fence where it fences.

use super::{CitronClient, ClientOptions};
use crate::fence::Fence;
pub use crate::hosting::{HostAllocate, HostFence, HostWrap, Hosting};
use crate::scheme::{LockError, LockId, LockMode, RangeLock};
use crate::schemes::LockScheme;
use crate::stats::{AbortCounts, LockStats};
use fabric::procedure::{Procedure, ProcedureId, ProcedureSession};
use fabric::tcp::wire::{self, DecodedReply};
use fabric::{Batch, Completions, Connector, Endpoint, FabricError, RemoteAddr};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The fabric procedure number of [`CitronHost`].
pub const PROCEDURE: ProcedureId = 0xC17_0001;

/// The client options the host's client uses (all but the fence, which never travels: the
/// host fences with its own, [`CitronHost::fencing`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct HostOptions {
    k: u32,
    auto_scale_up: bool,
    starvation_after: Duration,
    restart_after: Duration,
    backoff_base: Duration,
    backoff_max: Duration,
}

impl HostOptions {
    fn of(options: &ClientOptions) -> Self {
        Self {
            k: options.k as u32,
            auto_scale_up: options.auto_scale_up,
            starvation_after: options.starvation_after,
            restart_after: options.restart_after,
            backoff_base: options.backoff_base,
            backoff_max: options.backoff_max,
        }
    }

    fn client_options(&self) -> ClientOptions {
        ClientOptions {
            k: self.k as usize,
            auto_scale_up: self.auto_scale_up,
            starvation_after: self.starvation_after,
            restart_after: self.restart_after,
            backoff_base: self.backoff_base,
            backoff_max: self.backoff_max,
            fence: None,
            hosting: Hosting::Never,
            ..ClientOptions::default()
        }
    }
}

/// A call of [`PROCEDURE`].
#[derive(Debug, Serialize, Deserialize)]
enum Call {
    /// Open (or reopen) a lock for this connection. (A newtype variant of a struct is encoded
    /// as the struct variant of the same fields that builds before [`OpenArgs`] sent.)
    Open(OpenArgs),
    /// Acquire `[start, end)` on the lock at `base` exclusively (Alg. 1), then execute `extra`
    /// (a batch in the tcp wire's encoding, empty for none) under it: the caller's carried
    /// verbs (`RangeLock::acquire_with`). Answered [`Answer::Acquired`]. The call of hosts and
    /// clients from before the modes, which meant exclusive there too: an exclusive request
    /// still sends it, so either side of an exclusive acquisition may be of such a build.
    Acquire {
        base: RemoteAddr,
        start: u64,
        end: u64,
        extra: Vec<u8>,
    },
    /// Release lock `id` of the lock at `base` (Alg. 3).
    Release { base: RemoteAddr, id: u64 },
    /// [`Call::Release`], posted (`Endpoint::post_call`): nobody waits for its answer, so
    /// what the host's client counted in it goes with the next answer.
    PostedRelease { base: RemoteAddr, id: u64 },
    /// [`Call::Acquire`] in `mode` (`docs/SHARED_LOCKS.md`): what a shared request sends.
    /// Answered [`Answer::AcquiredMode`]. A host from before the modes cannot decode it and
    /// fails the call (the request fails; nothing is granted).
    AcquireMode {
        base: RemoteAddr,
        start: u64,
        end: u64,
        mode: LockMode,
        extra: Vec<u8>,
    },
    /// [`Call::Open`], answered [`Answer::OpenedWith`], which says what this host takes
    /// beyond the calls above. A host from before it cannot decode it and fails the call; the
    /// client then sends [`Call::Open`] and uses none of them.
    OpenWith(OpenArgs),
    /// [`Call::PostedRelease`] that first executes `extra` (a batch in the tcp wire's
    /// encoding) at the host, its results dropped (`RangeLock::release_forgetting`). Sent only
    /// to a host whose [`HostFeatures::posted_release_carries`] said it takes it.
    PostedReleaseWith {
        base: RemoteAddr,
        id: u64,
        extra: Vec<u8>,
    },
}

/// What [`Call::Open`] and [`Call::OpenWith`] open.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct OpenArgs {
    /// The lock's description (its spec string, as created).
    scheme: String,
    /// Where it is.
    base: RemoteAddr,
    /// The client's options, for the host's client.
    options: HostOptions,
    /// The client has a fence, so the host must fence before every break-in it makes on the
    /// client's behalf, or refuse.
    fenced: bool,
    /// The client allocator's tag (`LockWordAllocator::host_tag`), for a tree that grows from
    /// an allocator.
    allocator: Option<u64>,
}

/// What a host takes beyond the calls of hosts from before [`Call::OpenWith`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct HostFeatures {
    /// [`Call::PostedReleaseWith`].
    posted_release_carries: bool,
}

/// What the host's client counted during one call (everything a client's statistics hold but
/// the traffic, which stayed in the host, and the operation counts, which the caller keeps).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
struct Counts {
    aborts: AbortCounts,
    retries: u64,
    fast_path: u64,
    starvation_escalations: u64,
    spillover: u64,
    scale_ups: u64,
    recoveries: u64,
    late_releases: u64,
    passed_over: u64,
}

impl Counts {
    fn of(d: &LockStats) -> Self {
        Self {
            aborts: d.aborts,
            retries: d.retries,
            fast_path: d.fast_path,
            starvation_escalations: d.starvation_escalations,
            spillover: d.spillover,
            scale_ups: d.scale_ups,
            recoveries: d.recoveries,
            late_releases: d.late_releases,
            passed_over: d.passed_over,
        }
    }

    fn add_to(&self, stats: &mut LockStats) {
        stats.merge(&LockStats {
            aborts: self.aborts,
            retries: self.retries,
            fast_path: self.fast_path,
            starvation_escalations: self.starvation_escalations,
            spillover: self.spillover,
            scale_ups: self.scale_ups,
            recoveries: self.recoveries,
            late_releases: self.late_releases,
            passed_over: self.passed_over,
            ..LockStats::default()
        });
    }
}

/// A grant at the host ([`Answer::Acquired`], [`Answer::AcquiredMode`]).
#[derive(Debug, Serialize, Deserialize)]
struct Grant {
    /// The host's lock id.
    id: u64,
    /// The lock's lease left when the call began at the host (`None`: no deadline).
    lease_left: Option<Duration>,
    /// What the host's client counted in the call.
    counts: Counts,
    /// Those of the call's `extra` batch, in the tcp wire's encoding (empty without one).
    completions: Vec<u8>,
}

/// The host's answer.
#[derive(Debug, Serialize, Deserialize)]
enum Answer {
    Opened,
    /// [`Call::Acquire`] granted, exclusively. (A newtype variant of a struct is encoded as
    /// the struct variant of the same fields that hosts from before the modes answer.)
    Acquired(Grant),
    Released {
        counts: Counts,
    },
    /// [`Call::AcquireMode`] granted in `mode`: the mode the host ran the protocol in (a
    /// shared request's part past the tree, the spillover mutex, is held exclusively all the
    /// same).
    AcquiredMode {
        mode: LockMode,
        grant: Grant,
    },
    /// [`Call::OpenWith`] opened, with what this host takes.
    OpenedWith(HostFeatures),
}

/// The procedure a `tcp` fabric server offers so that CITRON clients can acquire at the host
/// (register it under [`PROCEDURE`] with `TcpServer::register_procedure` or
/// `FabricServer::register_procedure`).
#[derive(Default)]
pub struct CitronHost {
    /// Wraps the host connector of every connection (tests inject delays into the host's
    /// steps with it, as into any client's).
    wrap: Option<HostWrap>,
    /// The fence of each client session, for clients that have one.
    fence: Option<HostFence>,
    /// The allocator of each allocator tag, for trees that grow from one.
    allocate: Option<HostAllocate>,
}

impl CitronHost {
    /// The procedure, reaching the host's memory directly.
    pub fn new() -> Self {
        Self::default()
    }

    /// The procedure, reaching the host's memory through `wrap(host)` (e.g. a
    /// [`crate::ChaosConnector`] that injects delays around every host batch).
    pub fn wrapped(wrap: HostWrap) -> Self {
        Self {
            wrap: Some(wrap),
            ..Self::default()
        }
    }

    /// Hosts trees that grow from an allocator ([`super::CitronGrowth::Allocator`]): a
    /// hosted client's scale-ups (Alg. 4) run at the host, which allocates from
    /// `allocate(tag)`, `tag` being the client allocator's [`crate::schemes::LockWordAllocator::host_tag`]. The
    /// file system's meta server allocates a file's lock words as its `AllocateLockWords`
    /// request would. Without it, such a tree is acquired one-sided.
    pub fn allocating(mut self, allocate: HostAllocate) -> Self {
        self.allocate = Some(allocate);
        self
    }

    /// Hosts clients that have a fence too: before a break-in on behalf of the client of
    /// session `s` (the session its connection presented), the host calls `fence(s)`'s
    /// [`Fence::fence`], as that client would have called its own (`crate::fence`). The file
    /// system's meta server, which hosts the lock trees, fences with its own `Fence` request
    /// handler: the same revocation of silent sessions, without the RPC. Without it, a client
    /// with a fence is refused and acquires one-sided.
    pub fn fencing(mut self, fence: HostFence) -> Self {
        self.fence = Some(fence);
        self
    }
}

impl Procedure for CitronHost {
    fn open(
        &self,
        host: Arc<dyn Connector>,
        session: u64,
    ) -> fabric::Result<Box<dyn ProcedureSession>> {
        let host = match &self.wrap {
            Some(wrap) => wrap(host),
            None => host,
        };
        Ok(Box::new(HostSession {
            session,
            host,
            allocate: self.allocate.clone(),
            fence: self.fence.as_ref().map(|fence| fence(session)),
            locks: HashMap::new(),
            unreported: LockStats::default(),
            carried: None,
        }))
    }
}

/// One connection's hosted locks: a CITRON client per lock it opened.
struct HostSession {
    /// The session the connection presented: the identity of what its client holds
    /// (`ClientOptions::owner`) when the host fences on its behalf.
    session: u64,
    host: Arc<dyn Connector>,
    /// The fence of this connection's client session, if the host can fence.
    fence: Option<Arc<dyn Fence>>,
    /// Where trees that grow from an allocator get memory, if the host can allocate.
    allocate: Option<HostAllocate>,
    locks: HashMap<RemoteAddr, CitronClient>,
    /// What the host's clients counted in posted releases, not yet reported (it rides on the
    /// next answer).
    unreported: LockStats,
    /// Executes the calls' carried verbs, opened at the first.
    carried: Option<Carried>,
}

/// The endpoint and buffers a host session executes carried verbs with.
struct Carried {
    ep: Box<dyn Endpoint>,
    scratch: Vec<fabric::Verb>,
    batch: Batch,
    out: Completions,
}

/// A lock error as a procedure's failure; a fabric error keeps its kind (a revoked session's
/// `Refused` closes the connection).
fn failed(e: LockError) -> FabricError {
    match e {
        LockError::Fabric(e) => e,
        e => FabricError::Procedure(e.to_string()),
    }
}

impl HostSession {
    /// The counts to answer with: `spent` in this call, and what posted releases counted
    /// since the last answer.
    fn report(&mut self, spent: &LockStats) -> Counts {
        let mut counts = std::mem::take(&mut self.unreported);
        counts.merge(spent);
        Counts::of(&counts)
    }

    /// Acquires `range` of the lock at `base` in `mode` (Alg. 1), then executes the carried
    /// batch `extra` under it; `began`: when the call began at the host, which the grant's
    /// lease left counts from.
    fn acquire(
        &mut self,
        began: Instant,
        base: RemoteAddr,
        range: std::ops::Range<u64>,
        mode: LockMode,
        extra: &[u8],
    ) -> fabric::Result<Grant> {
        let client = self.lock(base)?;
        let before = client.stats();
        let id = client.acquire_mode(range, mode).map_err(failed)?;
        let lease_left = client
            .lease_deadline(id)
            .map(|d| d.saturating_duration_since(began));
        let spent = client.stats().since(&before);
        let completions = match self.carry(extra) {
            Ok(completions) => completions,
            Err(e) => {
                // Held, but the caller cannot use it without its verbs' results.
                let _ = self.lock(base)?.release(id);
                return Err(e);
            }
        };
        Ok(Grant {
            id: id.0,
            lease_left,
            counts: self.report(&spent),
            completions,
        })
    }

    /// Releases lock `id` of the lock at `base` (Alg. 3); returns what its client counted.
    fn release(&mut self, base: RemoteAddr, id: u64) -> fabric::Result<LockStats> {
        let client = self.lock(base)?;
        let before = client.stats();
        client.release(LockId(id)).map_err(failed)?;
        Ok(client.stats().since(&before))
    }

    /// Opens (or reopens) the lock at `base`, described by `scheme`, for this connection
    /// ([`Call::Open`]).
    fn open(&mut self, open: OpenArgs) -> fabric::Result<()> {
        let OpenArgs {
            scheme,
            base,
            options,
            fenced,
            allocator,
        } = open;
        let spec = match scheme.parse::<LockScheme>() {
            Ok(LockScheme::Citron(spec)) => spec,
            Ok(other) => {
                return Err(FabricError::Procedure(format!(
                    "{other} is not a CITRON lock"
                )))
            }
            Err(e) => return Err(FabricError::Procedure(e.to_string())),
        };
        let mut client_options = options.client_options();
        if fenced {
            let Some(fence) = &self.fence else {
                return Err(FabricError::Procedure(
                    "this host cannot fence on its clients' behalf; acquire one-sided".into(),
                ));
            };
            client_options.fence = Some(fence.clone());
            // Waiters ask the fence about holders by this identity: the session the
            // fence revokes.
            client_options.owner = Some(self.session);
        }
        let allocator = match (allocator, &self.allocate) {
            (Some(tag), Some(allocate)) => Some(allocate(tag)),
            _ => None,
        };
        let client = spec
            .open(base, &*self.host, &client_options, allocator.as_ref())
            .map_err(failed)?;
        self.locks.insert(base, client);
        Ok(())
    }

    fn lock(&mut self, base: RemoteAddr) -> fabric::Result<&mut CitronClient> {
        self.locks.get_mut(&base).ok_or_else(|| {
            FabricError::Procedure(format!("lock at {base:?} not opened on this connection"))
        })
    }

    /// Executes the carried batch `extra` (the tcp wire's encoding; empty: none) on the host's
    /// memory and returns its completions, encoded the same way (empty for none). Decoded with
    /// the wire's own checks: the bytes come from the client.
    fn carry(&mut self, extra: &[u8]) -> fabric::Result<Vec<u8>> {
        if extra.is_empty() {
            return Ok(Vec::new());
        }
        let carried = match &mut self.carried {
            Some(carried) => carried,
            None => self.carried.insert(Carried {
                ep: self.host.connect()?,
                scratch: Vec::new(),
                batch: Batch::new(),
                out: Completions::new(),
            }),
        };
        wire::decode_request(extra, &mut carried.scratch, &mut carried.batch).map_err(|e| {
            FabricError::Procedure(format!("carried verbs: {}", wire::RemoteError::from(e)))
        })?;
        carried.ep.execute(&carried.batch, &mut carried.out)?;
        let mut completions = Vec::new();
        wire::encode_completions(&mut completions, &carried.out);
        Ok(completions)
    }
}

impl ProcedureSession for HostSession {
    fn call(&mut self, args: &[u8], result: &mut Vec<u8>) -> fabric::Result<()> {
        let began = Instant::now();
        let call: Call = postcard::from_bytes(args)
            .map_err(|e| FabricError::Procedure(format!("bad CITRON host call: {e}")))?;
        let answer = match call {
            Call::Open(open) => {
                self.open(open)?;
                Answer::Opened
            }
            Call::OpenWith(open) => {
                self.open(open)?;
                Answer::OpenedWith(HostFeatures {
                    posted_release_carries: true,
                })
            }
            Call::Acquire {
                base,
                start,
                end,
                extra,
            } => Answer::Acquired(self.acquire(
                began,
                base,
                start..end,
                LockMode::Exclusive,
                &extra,
            )?),
            Call::AcquireMode {
                base,
                start,
                end,
                mode,
                extra,
            } => Answer::AcquiredMode {
                mode,
                grant: self.acquire(began, base, start..end, mode, &extra)?,
            },
            Call::Release { base, id } => {
                let spent = self.release(base, id)?;
                Answer::Released {
                    counts: self.report(&spent),
                }
            }
            Call::PostedRelease { base, id } => {
                let spent = self.release(base, id)?;
                self.unreported.merge(&spent);
                // Nobody reads the answer of a posted call.
                return Ok(());
            }
            Call::PostedReleaseWith { base, id, extra } => {
                // The verbs first, as a one-sided release's head runs them; if they fail the
                // lock stays held (the connection closes: lease recovery).
                self.carry(&extra)?;
                let spent = self.release(base, id)?;
                self.unreported.merge(&spent);
                return Ok(());
            }
        };
        *result = postcard::to_extend(&answer, std::mem::take(result))
            .map_err(|e| FabricError::Procedure(format!("encode CITRON host answer: {e}")))?;
        Ok(())
    }
}

/// A client's side of hosting: where its locks are held (`CitronClient` keeps one when it
/// hosts).
#[derive(Debug, Default)]
pub(crate) struct Hosted {
    /// The host's lock ids this client holds, with their lease deadlines.
    held: HashMap<u64, Option<Instant>>,
    /// What the host takes beyond the first calls (none where it answered [`Call::Open`]).
    features: HostFeatures,
    args: Vec<u8>,
    reply: Vec<u8>,
}

impl CitronClient {
    /// Decides where this client acquires ([`Hosting`]): asks the host to open the lock
    /// described by `scheme` when hosting is possible and wanted; stays one-sided otherwise.
    pub(crate) fn choose_hosting(&mut self, scheme: &LockScheme) -> Result<(), LockError> {
        let wanted = match self.opts.hosting {
            Hosting::Never => false,
            Hosting::Always => true,
            Hosting::Auto => self.ep.capabilities().server_cpu_on_data_path,
        };
        if !wanted {
            return Ok(());
        }
        let open = OpenArgs {
            scheme: scheme.to_string(),
            base: self.base,
            options: HostOptions::of(&self.opts),
            fenced: self.opts.fence.is_some(),
            allocator: self.allocator.host_tag(),
        };
        let mut hosted = Hosted::default();
        // A host that tells what it takes; one from before that fails the call, and is asked
        // the old way.
        let answer = match host_call(&mut self.ep, &mut hosted, &Call::OpenWith(open.clone())) {
            Err(e) if !is_connection_lost(&e) => {
                host_call(&mut self.ep, &mut hosted, &Call::Open(open))
            }
            answer => answer,
        };
        match answer {
            Ok(Answer::Opened) => {
                self.hosted = Some(hosted);
                Ok(())
            }
            Ok(Answer::OpenedWith(features)) => {
                hosted.features = features;
                self.hosted = Some(hosted);
                Ok(())
            }
            Ok(other) => Err(LockError::Config(format!(
                "CITRON host answered {other:?} to an open"
            ))),
            Err(e) if self.opts.hosting == Hosting::Auto && !is_connection_lost(&e) => {
                tracing::debug!("CITRON: acquiring one-sided, the host cannot: {e}");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Whether this client acquires at the host.
    pub fn is_hosted(&self) -> bool {
        self.hosted.is_some()
    }

    /// [`RangeLock::acquire_mode_with`] at the host: one round trip, `extra` executed at the
    /// host right after the grant, its results into `out`. An `extra` that cannot travel in
    /// the call ([`travels`]) is executed in a round trip of its own after it, on the same
    /// endpoint (so after the grant, under the lock). An exclusive request sends
    /// [`Call::Acquire`], a shared one [`Call::AcquireMode`]; a grant in a weaker mode than
    /// asked for is given back and fails.
    pub(crate) fn acquire_hosted(
        &mut self,
        range: std::ops::Range<u64>,
        mode: LockMode,
        extra: &Batch,
        out: &mut Completions,
    ) -> Result<LockId, LockError> {
        crate::scheme::check_range(&range)?;
        let in_call = !extra.is_empty() && travels(extra);
        let Some(hosted) = self.hosted.as_mut() else {
            unreachable!("only called when hosted")
        };
        let sent = Instant::now();
        let before = self.ep.stats();
        let (base, start, end) = (self.base, range.start, range.end);
        let extra_bytes = if in_call {
            encode_carried(extra)
        } else {
            Vec::new()
        };
        let call = match mode {
            LockMode::Exclusive => Call::Acquire {
                base,
                start,
                end,
                extra: extra_bytes,
            },
            LockMode::Shared => Call::AcquireMode {
                base,
                start,
                end,
                mode,
                extra: extra_bytes,
            },
        };
        let answer = host_call(&mut self.ep, hosted, &call);
        self.stats.acquire.add(&self.ep.stats().since(&before));
        self.stats.acquire_time += sent.elapsed();
        let (granted, grant) = match answer? {
            Answer::Acquired(grant) => (LockMode::Exclusive, grant),
            Answer::AcquiredMode { mode, grant } => (mode, grant),
            other => {
                return Err(LockError::Config(format!(
                    "CITRON host answered {other:?} to an acquire"
                )))
            }
        };
        grant.counts.add_to(&mut self.stats);
        self.stats.acquisitions += 1;
        hosted
            .held
            .insert(grant.id, grant.lease_left.map(|left| sent + left));
        let (id, completions) = (LockId(grant.id), grant.completions);
        if granted != mode && granted != LockMode::Exclusive {
            // A weaker lock than asked for: not one the caller may use.
            let _ = self.release_hosted(id, &Batch::new(), &mut Completions::new());
            return Err(LockError::Config(format!(
                "CITRON host granted a {mode} request {granted}"
            )));
        }
        let carried = if in_call {
            decode_carried(&completions, extra, out)
        } else if extra.is_empty() {
            Ok(())
        } else {
            self.ep.carry_after(extra);
            self.ep.finish(true, out).map_err(LockError::from)
        };
        if let Err(e) = carried {
            // Held, but the caller cannot use it without its verbs' results: give it back.
            let _ = self.release_hosted(id, &Batch::new(), &mut Completions::new());
            return Err(e);
        }
        Ok(id)
    }

    /// [`RangeLock::release_with`] at the host: `extra` first, in a batch of its own (one
    /// round trip, held to the fabric's batch bound: a release never waits for anything), then
    /// the release, posted (`Endpoint::post_call`), so that it costs no round trip of its own;
    /// one round trip where the endpoint cannot post. Released even when `extra` failed.
    ///
    /// Why posting is safe: calls on one endpoint run in the order sent, so the release runs
    /// after everything this client did under the lock and before its next request; nothing
    /// the client does next depends on the release having run. If the release fails at the
    /// host (it cannot, short of a bug or the connection's fencing), the host closes the
    /// connection, the next call fails as disconnected, and the lock is recovered like a dead
    /// client's when its lease runs out (§3.10). What the host counted in the release (a late
    /// release, say) comes back with the next answer.
    pub(crate) fn release_hosted(
        &mut self,
        id: LockId,
        extra: &Batch,
        out: &mut Completions,
    ) -> Result<(), LockError> {
        let before = self.ep.stats();
        let carried = if extra.is_empty() {
            Ok(())
        } else {
            self.ep.carry_before(extra);
            self.ep.finish(true, out).map_err(LockError::from)
        };
        let Some(hosted) = self.hosted.as_mut() else {
            unreachable!("only called when hosted")
        };
        let result = match hosted.held.remove(&id.0) {
            None => Err(LockError::NotHeld(id)),
            Some(_) => release_at_host(&mut self.ep, hosted, self.base, id.0).map(|counts| {
                if let Some(counts) = counts {
                    counts.add_to(&mut self.stats);
                }
                self.stats.releases += 1;
            }),
        };
        self.stats.release.add(&self.ep.stats().since(&before));
        result.and(carried)
    }

    /// [`RangeLock::release_forgetting`] at the host: where the host takes it
    /// ([`HostFeatures::posted_release_carries`]) and `extra` travels in a call, one posted
    /// [`Call::PostedReleaseWith`], no round trip at all; else [`Self::release_hosted`].
    ///
    /// Why that is safe: the host executes `extra` and then the release, in that order and
    /// after everything sent before on this endpoint; `extra`'s results are the caller's to
    /// forgo. If `extra` fails there, the host fails the call: the connection closes, the
    /// release does not run, and the lock is recovered when its lease runs out, as after a
    /// posted release that failed.
    pub(crate) fn release_hosted_forgetting(
        &mut self,
        id: LockId,
        extra: &Batch,
    ) -> Result<(), LockError> {
        let carries = self
            .hosted
            .as_ref()
            .is_some_and(|h| h.features.posted_release_carries);
        if extra.is_empty() || !carries || !travels(extra) {
            return self.release_hosted(id, extra, &mut Completions::new());
        }
        let before = self.ep.stats();
        let base = self.base;
        let Some(hosted) = self.hosted.as_mut() else {
            unreachable!("only called when hosted")
        };
        if !hosted.held.contains_key(&id.0) {
            return Err(LockError::NotHeld(id));
        }
        let call = Call::PostedReleaseWith {
            base,
            id: id.0,
            extra: encode_carried(extra),
        };
        encode_call(hosted, &call)?;
        let result = match self.ep.post_call(PROCEDURE, &hosted.args) {
            // An endpoint that cannot post: the verbs, then the release, each waited for.
            Err(FabricError::Unsupported(_)) => {
                return self.release_hosted(id, extra, &mut Completions::new())
            }
            posted => posted.map_err(LockError::from),
        };
        hosted.held.remove(&id.0);
        if result.is_ok() {
            self.stats.releases += 1;
        }
        self.stats.release.add(&self.ep.stats().since(&before));
        result
    }

    /// The lease deadline of hosted lock `id` (see the module docs).
    pub(crate) fn hosted_deadline(&self, id: LockId) -> Option<Instant> {
        self.hosted
            .as_ref()
            .and_then(|h| h.held.get(&id.0).copied().flatten())
    }

    /// Drops hosted lock `id` from this client's books without releasing it.
    pub(crate) fn forget_hosted(&mut self, id: LockId) -> Result<(), LockError> {
        self.hosted
            .as_mut()
            .and_then(|h| h.held.remove(&id.0))
            .map(|_| ())
            .ok_or(LockError::NotHeld(id))
    }
}

/// Whether an error means the connection is gone (as opposed to the host refusing).
fn is_connection_lost(e: &LockError) -> bool {
    matches!(
        e,
        LockError::Fabric(
            FabricError::Disconnected(_) | FabricError::TimedOut(_) | FabricError::Io { .. }
        )
    )
}

/// Whether carried verbs travel in a host call (`Call::Acquire::extra`):
/// a batch without an expiry (the host's clock is not the caller's; carried lock-path verbs have
/// none) that fits a call's arguments and result with room to spare.
fn travels(extra: &Batch) -> bool {
    const MOST: usize = fabric::procedure::MAX_CALL_BYTES / 8;
    extra.expires().is_none()
        && extra.payload().len() <= MOST
        && extra.read_bytes() <= MOST
        && extra.len() <= 256
}

/// `extra` in the tcp wire's encoding (empty for an empty batch).
fn encode_carried(extra: &Batch) -> Vec<u8> {
    let mut bytes = Vec::new();
    if !extra.is_empty() {
        wire::encode_batch(&mut bytes, extra);
    }
    bytes
}

/// Fills `out` with the results of `extra`, carried in an acquire call, from the host's
/// encoded `completions`.
fn decode_carried(
    completions: &[u8],
    extra: &Batch,
    out: &mut Completions,
) -> Result<(), LockError> {
    match wire::decode_reply(completions, extra, out) {
        Ok(DecodedReply::Completions { .. }) => Ok(()),
        Ok(DecodedReply::Error(e)) => Err(LockError::Fabric(FabricError::Procedure(format!(
            "carried verbs: {e}"
        )))),
        Err(why) => Err(LockError::Fabric(FabricError::Protocol(format!(
            "the CITRON host's answer to the carried verbs: {why}"
        )))),
    }
}

/// Releases host lock `id` of the lock at `base` through `ep`: posted where the endpoint can
/// post (no answer, so no counts: they ride on the next answer), else in a call whose answer
/// brings the counts.
fn release_at_host(
    ep: &mut dyn fabric::Endpoint,
    bufs: &mut Hosted,
    base: RemoteAddr,
    id: u64,
) -> Result<Option<Counts>, LockError> {
    encode_call(bufs, &Call::PostedRelease { base, id })?;
    match ep.post_call(PROCEDURE, &bufs.args) {
        Ok(()) => return Ok(None),
        Err(FabricError::Unsupported(_)) => {}
        Err(e) => return Err(e.into()),
    }
    match host_call(ep, bufs, &Call::Release { base, id })? {
        Answer::Released { counts } => Ok(Some(counts)),
        other => Err(LockError::Config(format!(
            "CITRON host answered {other:?} to a release"
        ))),
    }
}

/// Encodes `call` into `bufs.args`.
fn encode_call(bufs: &mut Hosted, call: &Call) -> Result<(), LockError> {
    bufs.args.clear();
    bufs.args = postcard::to_extend(call, std::mem::take(&mut bufs.args))
        .map_err(|e| LockError::Config(format!("encode CITRON host call: {e}")))?;
    Ok(())
}

/// One call of [`PROCEDURE`] through `ep`.
fn host_call(
    ep: &mut dyn fabric::Endpoint,
    bufs: &mut Hosted,
    call: &Call,
) -> Result<Answer, LockError> {
    encode_call(bufs, call)?;
    bufs.reply.clear();
    ep.call(PROCEDURE, &bufs.args, &mut bufs.reply)?;
    postcard::from_bytes(&bufs.reply)
        .map_err(|e| LockError::Config(format!("bad CITRON host answer: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calls and answers as builds before the modes had them.
    mod before_modes {
        use super::super::{Counts, HostOptions};
        use fabric::RemoteAddr;
        use serde::{Deserialize, Serialize};
        use std::time::Duration;

        #[derive(Debug, Serialize, Deserialize)]
        pub enum Call {
            Open {
                scheme: String,
                base: RemoteAddr,
                options: HostOptions,
                fenced: bool,
                allocator: Option<u64>,
            },
            Acquire {
                base: RemoteAddr,
                start: u64,
                end: u64,
                extra: Vec<u8>,
            },
            Release {
                base: RemoteAddr,
                id: u64,
            },
            PostedRelease {
                base: RemoteAddr,
                id: u64,
            },
        }

        #[derive(Debug, Serialize, Deserialize)]
        pub enum Answer {
            Opened,
            Acquired {
                id: u64,
                lease_left: Option<Duration>,
                counts: Counts,
                completions: Vec<u8>,
            },
            Released {
                counts: Counts,
            },
        }
    }

    const BASE: RemoteAddr = RemoteAddr::new(fabric::RegionId(3), 64);

    /// An exclusive acquisition speaks the format of builds before the modes, both ways; a
    /// shared one is refused by such a host rather than taken for something else.
    #[test]
    fn an_exclusive_acquisition_keeps_the_format_from_before_the_modes() {
        let call = Call::Acquire {
            base: BASE,
            start: 5,
            end: 9,
            extra: vec![1, 2, 3],
        };
        let bytes = postcard::to_allocvec(&call).unwrap();
        let old = postcard::to_allocvec(&before_modes::Call::Acquire {
            base: BASE,
            start: 5,
            end: 9,
            extra: vec![1, 2, 3],
        })
        .unwrap();
        assert_eq!(bytes, old, "the exclusive acquire call");

        let answer = Answer::Acquired(Grant {
            id: 7,
            lease_left: Some(Duration::from_millis(300)),
            counts: Counts {
                retries: 2,
                ..Counts::default()
            },
            completions: vec![4, 5],
        });
        let bytes = postcard::to_allocvec(&answer).unwrap();
        match postcard::from_bytes::<before_modes::Answer>(&bytes).unwrap() {
            before_modes::Answer::Acquired {
                id,
                lease_left,
                counts,
                completions,
            } => assert_eq!(
                (id, lease_left, counts.retries, completions),
                (7, Some(Duration::from_millis(300)), 2, vec![4, 5])
            ),
            other => panic!("an old client reads {other:?}"),
        }

        let shared = postcard::to_allocvec(&Call::AcquireMode {
            base: BASE,
            start: 5,
            end: 9,
            mode: LockMode::Shared,
            extra: Vec::new(),
        })
        .unwrap();
        assert!(
            postcard::from_bytes::<before_modes::Call>(&shared).is_err(),
            "a host from before the modes must fail a shared call, not run it"
        );
    }

    /// A host from before [`Call::OpenWith`] cannot decode it (so it fails the call, and the
    /// client opens the old way and posts no [`Call::PostedReleaseWith`]); the old calls and
    /// answers keep their encoding, so an old client of a new host sees nothing new.
    #[test]
    fn the_calls_that_tell_a_host_features_leave_older_peers_alone() {
        let options = HostOptions::of(&ClientOptions::default());
        let args = OpenArgs {
            scheme: "citron".into(),
            base: BASE,
            options: options.clone(),
            fenced: false,
            allocator: None,
        };
        let open_with = postcard::to_allocvec(&Call::OpenWith(args.clone())).unwrap();
        assert!(postcard::from_bytes::<before_modes::Call>(&open_with).is_err());
        let posted = postcard::to_allocvec(&Call::PostedReleaseWith {
            base: BASE,
            id: 3,
            extra: vec![1],
        })
        .unwrap();
        assert!(postcard::from_bytes::<before_modes::Call>(&posted).is_err());
        let open = postcard::to_allocvec(&Call::Open(args)).unwrap();
        let old_open = postcard::to_allocvec(&before_modes::Call::Open {
            scheme: "citron".into(),
            base: BASE,
            options,
            fenced: false,
            allocator: None,
        })
        .unwrap();
        assert_eq!(open, old_open);
        let opened = postcard::to_allocvec(&Answer::Opened).unwrap();
        assert!(matches!(
            postcard::from_bytes::<before_modes::Answer>(&opened),
            Ok(before_modes::Answer::Opened)
        ));
    }
}
