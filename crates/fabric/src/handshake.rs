//! The one handshake every CitronFS TCP connection opens with: the verbs of the `tcp` fabric,
//! the meta server's RPCs and the `server` scheme's lock server alike. It is a mutual
//! challenge–response over the cluster's shared secret (its token), which never crosses the
//! wire: each side proves it holds the secret with an HMAC-SHA256 over both sides' fresh nonces
//! and the hello.
//!
//! ```text
//! client                                          server
//!   Hello {magic, protocol, version,        ──▶   accept(): magic, protocol and version
//!          cluster, nonce_c, session, role}        first, then the cluster
//!                                           ◀──   Ok(Challenge {nonce_s, mac_s}), or a
//!                                                 Refusal and close
//!   checks mac_s (a server that cannot
//!   prove the secret: refused, closed)
//!   Proof {mac_c}                           ──▶   Challenged::verify(): checks mac_c
//!                                           ◀──   the protocol's welcome, or a Refusal
//!                                                 and close
//!
//! mac_s = HMAC-SHA256(token, SERVER_LABEL ‖ len(hello) ‖ hello ‖ nonce_s)
//! mac_c = HMAC-SHA256(token, CLIENT_LABEL ‖ len(hello) ‖ hello ‖ nonce_s)
//! ```
//!
//! `hello` is the hello's encoding exactly as it crossed the wire, so both MACs bind every
//! field of it (magic, protocol, version, cluster, the client's nonce, session, role) as well
//! as the server's nonce; the direction label keeps one side's MAC from serving as the other's.
//! A server's MAC answers a nonce the client just drew, so an impostor cannot replay one it
//! captured, nor compute one without the secret: the client checks it before it sends anything
//! derived from the secret, and refuses the server otherwise
//! ([`HandshakeError::ServerUnverified`]). A client's MAC answers the server's fresh nonce, so a
//! captured handshake replayed to a server fails ([`Refusal::BadToken`]). MACs are compared in
//! constant time.
//!
//! What it does not do: it authenticates the two ends when the connection opens; it does not
//! encrypt or sign the traffic after it. A peer that can change packets on the path can still
//! relay a handshake and tamper with what follows; run clusters on a network you trust, or
//! under WireGuard or IPsec. A token must be random (`citronfs` makes 128-bit ones,
//! [`random_token`]): a captured handshake lets anyone test guesses of it offline.
//!
//! Every message is one [`frame`](crate::frame) holding a postcard encoding. A [`Hello`]'s
//! first three fields — [`MAGIC`], the [`Protocol`] and that protocol's version — keep their
//! place and encoding in every version, and every answer is a `Result` whose error is the
//! shared [`Refusal`], so that a peer of another version, or one that dialled the wrong port,
//! is told so in plain words instead of being handed a decode error. The fields after them may
//! change with a protocol's version; `role` is what a protocol adds (the meta server's RPC
//! protocol: who is connecting; the others: nothing).
//!
//! Every server checks a hello with [`accept`] and the proof with [`Challenged::verify`], so the
//! rules are written once: the cluster id must match, the client must prove the secret, and a
//! session the server has revoked is refused by the caller's check, after the proof.

use crate::frame::{read_frame, write_frame, FrameError};
use hmac::{Hmac, Mac};
use rand::RngCore;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use std::io::{Read, Write};
use std::time::Duration;
use thiserror::Error;

/// The first field of every [`Hello`]: "CTRN" in ASCII.
pub const MAGIC: u32 = u32::from_le_bytes(*b"CTRN");

/// The largest frame a server reads before the client has proved the secret (its hello, its
/// proof): an unauthenticated peer must not make it allocate much.
pub const MAX_HELLO_FRAME: usize = 64 << 10;

/// How long an unauthenticated connection may take to complete its handshake (the tcp fabric
/// and the meta server bound the whole handshake; the lock server each of its messages), and a
/// client waits for each answer.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 32;

/// A handshake nonce: drawn fresh for every connection, by the client for its [`Hello`] and by
/// the server for its [`Challenge`].
pub type Nonce = [u8; NONCE_LEN];

/// Bytes of a handshake MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;

/// What the server's MAC (in its [`Challenge`]) starts with.
const SERVER_LABEL: &[u8] = b"CitronFS handshake 1: server proof";
/// What the client's MAC (its [`Proof`]) starts with: as long as [`SERVER_LABEL`], so that
/// neither MAC's input is a prefix of the other's.
const CLIENT_LABEL: &[u8] = b"CitronFS handshake 1: client proof";
const _: () = assert!(SERVER_LABEL.len() == CLIENT_LABEL.len());

/// A fresh nonce from the thread's cryptographically secure generator (`rand`'s, seeded from
/// the operating system).
pub fn fresh_nonce() -> Nonce {
    let mut nonce = [0u8; NONCE_LEN];
    rand::rng().fill_bytes(&mut nonce);
    nonce
}

/// Which side a MAC proves.
#[derive(Clone, Copy)]
enum Side {
    Server,
    Client,
}

/// The MAC of `side` over the handshake: the hello's encoding as it crossed the wire and the
/// server's nonce, keyed with `credentials`' token.
fn transcript_mac(
    credentials: &Credentials,
    side: Side,
    hello: &[u8],
    server_nonce: &Nonce,
) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(credentials.token.as_bytes())
        .expect("HMAC takes a key of any length");
    mac.update(match side {
        Side::Server => SERVER_LABEL,
        Side::Client => CLIENT_LABEL,
    });
    mac.update(&(hello.len() as u64).to_le_bytes());
    mac.update(hello);
    mac.update(server_nonce);
    mac
}

fn compute_mac(
    credentials: &Credentials,
    side: Side,
    hello: &[u8],
    server_nonce: &Nonce,
) -> [u8; MAC_LEN] {
    transcript_mac(credentials, side, hello, server_nonce)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `mac` is `side`'s MAC over the handshake, compared in constant time.
fn mac_verifies(
    credentials: &Credentials,
    side: Side,
    hello: &[u8],
    server_nonce: &Nonce,
    mac: &[u8],
) -> bool {
    transcript_mac(credentials, side, hello, server_nonce)
        .verify_slice(mac)
        .is_ok()
}

/// What a connection speaks after the handshake. Each protocol has its own version
/// ([`Protocol::version`]); a server accepts only its own protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Protocol {
    /// One-sided verbs of the `tcp` fabric ([`crate::tcp::wire`]).
    Verbs,
    /// The meta server's RPCs (`proto::rpc`).
    Rpc,
    /// The lock server of the `server` lock scheme (`lockmgr::baselines::server`).
    LockServer,
    /// The `rdma` fabric's connection setup (`crate::rdma`, feature `rdma`): queue pair
    /// numbers, GIDs and rkeys exchanged over an authenticated connection, which then stays
    /// open for the life of the queue pairs.
    RdmaSetup,
}

impl Protocol {
    /// The version of this protocol this build speaks. Bump it on any change to the protocol's
    /// messages, the [`Hello`] after its first three fields included.
    pub const fn version(self) -> u16 {
        match self {
            // 3: the shared hello (protocol field, role).
            // 4: a batch carries its expiry (`Batch::expire_at`); `VerbError::Expired`.
            // 5: the expiry is an instant in the server's clock, which the welcome and every
            // completions reply carry (`crate::clock`), no longer the time left on sending.
            // 6: `Request::PostedCall` (a call answered only if it fails, then the connection
            // closes: `RemoteError::PostedCallFailed`).
            // 7: a session of an earlier run of the meta server is refused as behind
            // (`Refusal::SessionBehind`), no longer as revoked.
            // 8: the handshake is a challenge–response (`Hello::nonce`, `Challenge`, `Proof`):
            // the token no longer crosses the wire.
            Protocol::Verbs => 8,
            // 2: the shared hello; `Open` carries a `lockmgr::LockScheme`, `OpenFile` a `LockRef`.
            // 3: data servers name their incarnation; clients learn the layout epoch in every
            // heartbeat and fetch the layout with `Cluster`; `FsError` answers `Lost`,
            // `Unavailable`, `Busy`, `TooManyOpen`, `TooManySessions`.
            // 4: `ChunkLoc::index` counts 4 KiB units and chunks grow geometrically
            // (`proto::layout`); `FsStats` reports blocks and free inodes; a client connection
            // carries concurrent calls, answered in completion order under their ids;
            // `ClusterInfo` names the attribute table (`proto::attrs`); `SetAttr::kill_suidgid`,
            // `Rename::exchange`; file control blocks carry MTIME and MODE (`proto::fcb`).
            // 5: `ClusterInfo` names the directory-entry table (`proto::dentries`); `OpenFile`
            // no longer carries a directory version.
            // 6: `RequestFrame::release_first` (releases riding on a call).
            // 7: `Attr::allocated` (a file's chunk bytes, `st_blocks`); `Request::FreeChunks`.
            // 8: `RequestFrame::expires` (a change made under a range lock is refused past the
            // lock's lease, `FsError::Expired`), and every `ResponseFrame` carries the server's
            // clock (`crate::clock`) to name it in.
            // 9: `ClusterInfo::local_rpc` (a Unix socket for clients on the server's host).
            // 10: `Request::Status` → `Response::Status` (`proto::status`, `citronfs status`).
            // 11: the handshake is a challenge–response (`Hello::nonce`, `Challenge`, `Proof`):
            // the token no longer crosses the wire.
            // 12: `Request::HolderGone` → `Response::Gone` (lock recovery by identity).
            // 13: `Response::Chunks` names every replica of a chunk (`proto::Replicas`).
            // 14: a data server names its failure domain (`Role::DataServer::zone`), and
            // `DataServerStatus` shows it.
            Protocol::Rpc => 14,
            // 1: the first version with a handshake.
            // 2: the handshake is a challenge–response (`Hello::nonce`, `Challenge`, `Proof`):
            // the token no longer crosses the wire.
            Protocol::LockServer => 2,
            // 1: the first version.
            Protocol::RdmaSetup => 1,
        }
    }

    /// What the protocol is, for messages.
    pub const fn describe(self) -> &'static str {
        match self {
            Protocol::Verbs => "the tcp fabric's verbs",
            Protocol::Rpc => "the meta server's RPCs",
            Protocol::LockServer => "the lock server",
            Protocol::RdmaSetup => "the rdma fabric's connection setup",
        }
    }
}

/// Who may connect to a cluster's servers: the cluster's id and its shared secret. Servers
/// and clients both hold them; the hello names the cluster, and each side proves it holds the
/// secret without sending it (see the module's documentation).
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Credentials {
    /// The cluster id; a peer naming another cluster is refused.
    pub cluster: String,
    /// The shared secret, never sent; a peer that cannot prove it holds it is refused.
    pub token: String,
}

impl Credentials {
    /// Credentials for `cluster` with secret `token`.
    pub fn new(cluster: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            cluster: cluster.into(),
            token: token.into(),
        }
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a secret: never print it.
        f.debug_struct("Credentials")
            .field("cluster", &self.cluster)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// A fresh cluster token: 128 bits from the kernel's generator, in hex.
pub fn random_token() -> std::io::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The first message of every connection.
///
/// Invariant: `magic`, `protocol` and `version` are the first three fields, in this order, in
/// every version of every protocol ([`accept`] decodes them alone before the rest).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello<R> {
    /// Always [`MAGIC`].
    pub magic: u32,
    /// The protocol the client will speak.
    pub protocol: Protocol,
    /// The client's version of that protocol.
    pub version: u16,
    /// The cluster the client believes it talks to.
    pub cluster: String,
    /// The client's nonce, fresh for every connection ([`fresh_nonce`]).
    pub nonce: Nonce,
    /// The client session the connection belongs to (its meta-server session id), or 0 for a
    /// server's own connections and sessionless clients. A server may refuse a session the
    /// cluster has revoked (the `tcp` fabric does: that is how a client whose locks were
    /// broken is fenced).
    pub session: u64,
    /// What the protocol adds to the hello (the RPC protocol: who is connecting).
    pub role: R,
}

impl<R> Hello<R> {
    /// The hello for `protocol` at this build's version, naming `credentials`' cluster, with a
    /// fresh nonce.
    pub fn new(protocol: Protocol, credentials: &Credentials, session: u64, role: R) -> Self {
        Self {
            magic: MAGIC,
            protocol,
            version: protocol.version(),
            cluster: credentials.cluster.clone(),
            nonce: fresh_nonce(),
            session,
            role,
        }
    }
}

impl<R: std::fmt::Debug> std::fmt::Debug for Hello<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hello")
            .field("magic", &self.magic)
            .field("protocol", &self.protocol)
            .field("version", &self.version)
            .field("cluster", &self.cluster)
            .field("nonce", &hex(&self.nonce))
            .field("session", &self.session)
            .field("role", &self.role)
            .finish()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The server's answer to an accepted [`Hello`]: its nonce, and its proof that it holds the
/// cluster's secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Challenge {
    /// The server's nonce, fresh for every connection.
    pub nonce: Nonce,
    /// The server's MAC over the hello and `nonce` (see the module's documentation).
    pub mac: [u8; MAC_LEN],
}

/// The answer to a [`Hello`]: the server's challenge, or why it refused.
pub type ChallengeAnswer = Result<Challenge, Refusal>;

/// The client's answer to a [`Challenge`] it verified: its proof that it holds the cluster's
/// secret. The server answers it with the protocol's welcome or a [`Refusal`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proof {
    /// The client's MAC over the hello and the server's nonce.
    pub mac: [u8; MAC_LEN],
}

impl Proof {
    /// The proof of a client holding `credentials`' secret, answering `challenge` to the hello
    /// whose encoding (as sent) is `hello`. It does not check the challenge:
    /// [`answer_challenge`] does, and a client must.
    pub fn new(credentials: &Credentials, hello: &[u8], challenge: &Challenge) -> Self {
        Self {
            mac: compute_mac(credentials, Side::Client, hello, &challenge.nonce),
        }
    }
}

/// Why a server refused a connection. The server closes the connection after sending it.
#[derive(Clone, Debug, PartialEq, Eq, Error, Serialize, Deserialize)]
pub enum Refusal {
    /// The hello did not start with [`MAGIC`]: not a CitronFS peer.
    #[error("not a CitronFS peer (bad magic)")]
    BadMagic,
    /// The client speaks another protocol: it dialled the wrong port.
    #[error("this port serves {}, not {}: wrong address?", .server.describe(), .client.describe())]
    WrongProtocol {
        /// What the client speaks.
        client: Protocol,
        /// What this server speaks.
        server: Protocol,
    },
    /// The client speaks another version of the protocol.
    #[error("{} version {client} is not supported (this server speaks version {server})",
        .protocol.describe())]
    UnsupportedVersion {
        /// The protocol.
        protocol: Protocol,
        /// The client's version.
        client: u16,
        /// The server's version.
        server: u16,
    },
    /// The client names another cluster. Cluster ids are not secret, so both are reported.
    #[error("wrong cluster: client wants {client:?}, this server belongs to {server:?}")]
    WrongCluster {
        /// The cluster the client asked for.
        client: String,
        /// The server's cluster.
        server: String,
    },
    /// The client's [`Proof`] did not verify: it does not hold the cluster's secret (a wrong
    /// token), or it replayed another connection's handshake.
    #[error(
        "authentication failed: the server could not verify the client (it does not prove \
         cluster {cluster:?}'s secret: wrong token?)"
    )]
    BadToken {
        /// The cluster.
        cluster: String,
    },
    /// The first message was not a well-formed hello.
    #[error("bad handshake: {0}")]
    BadHello(String),
    /// The client's session was revoked (fenced) by the cluster.
    #[error("session {session} was revoked by the cluster (fenced after its lease ran out)")]
    Revoked {
        /// The revoked session.
        session: u64,
    },
    /// The client's session belongs to an earlier run of the server that numbers the sessions
    /// (the meta server restarted since): the client is behind the cluster, not fenced, and
    /// joins it again in a session of this run (`FabricError::SessionBehind`).
    #[error(
        "session {session} belongs to an earlier run of the cluster's meta server (this run's \
         sessions start at {floor}): catch up and join again"
    )]
    SessionBehind {
        /// The client's session.
        session: u64,
        /// The first session of this run.
        floor: u64,
    },
    /// The hello was valid but the service refused the peer (a data server's registration
    /// failed, the meta server is shutting down, …).
    #[error("{0}")]
    Rejected(String),
    /// A limit of the server was reached: the peer is refused before anything of it is read,
    /// and may try again later.
    #[error("{} (limit {} = {value}); try again later", .limit.describe(), .limit.setting())]
    Limit {
        /// Which limit.
        limit: Limit,
        /// Its value on this server.
        value: u64,
    },
}

/// A limit a server puts on its peers, named as its setting is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Limit {
    /// Concurrent connections from one IP address.
    ConnectionsPerPeer,
    /// Connections, from all peers together, that have not completed the handshake.
    PendingHandshakes,
    /// Connections from one IP address that have not completed the handshake.
    PendingHandshakesPerPeer,
    /// Client sessions of a meta server.
    Sessions,
}

impl Limit {
    /// The name of the setting that sets this limit (in config files and, with dashes, flags).
    pub const fn setting(self) -> &'static str {
        match self {
            Limit::ConnectionsPerPeer => "max_connections_per_peer",
            Limit::PendingHandshakes => "max_pending_handshakes",
            Limit::PendingHandshakesPerPeer => "max_pending_handshakes_per_peer",
            Limit::Sessions => "max_sessions",
        }
    }

    /// What was exceeded, for messages.
    pub const fn describe(self) -> &'static str {
        match self {
            Limit::ConnectionsPerPeer => "too many connections from this address",
            Limit::PendingHandshakes => "too many connections waiting for their handshake",
            Limit::PendingHandshakesPerPeer => {
                "too many connections from this address waiting for their handshake"
            }
            Limit::Sessions => "too many client sessions",
        }
    }
}

/// Limits on the connections a TCP server of CitronFS takes: every server (the tcp fabric,
/// the meta server's RPC port, the lock server) checks them when it accepts a connection,
/// before it reads a byte, with an [`Admission`].
///
/// Why these: a single hostile address cannot take every slot ([`max_per_peer`]) nor every
/// place in the handshake ([`max_pending_per_peer`]), and many addresses together cannot hold
/// more than a bounded number of unauthenticated connections — each of which may make the
/// server buffer up to [`MAX_HELLO_FRAME`] — at once ([`max_pending`]). Authenticated
/// connections are not bounded in total: they hold the cluster's token.
///
/// [`max_per_peer`]: ConnectionLimits::max_per_peer
/// [`max_pending_per_peer`]: ConnectionLimits::max_pending_per_peer
/// [`max_pending`]: ConnectionLimits::max_pending
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionLimits {
    /// Concurrent connections (authenticated or not) from one IP address. Every thread of a
    /// client has its own fabric connection, so clients on one host need many.
    pub max_per_peer: usize,
    /// Connections from all peers that have not completed the handshake yet.
    pub max_pending: usize,
    /// Connections from one IP address that have not completed the handshake yet: one
    /// address cannot hold every place of `max_pending` (each for up to
    /// [`HANDSHAKE_TIMEOUT`]) and so keep everyone else out.
    pub max_pending_per_peer: usize,
}

impl ConnectionLimits {
    /// Default of [`ConnectionLimits::max_per_peer`]: every thread of every client process on
    /// a host has its own fabric connection to each server, and benchmarks on one host run
    /// dozens of processes of dozens of threads.
    pub const DEFAULT_MAX_PER_PEER: usize = 4096;
    /// Default of [`ConnectionLimits::max_pending`]: a handshake takes a round trip, so even a
    /// cluster whose clients all start at once rarely has more than a few dozen pending.
    pub const DEFAULT_MAX_PENDING: usize = 256;
    /// Default of [`ConnectionLimits::max_pending_per_peer`]: a quarter of the pending places,
    /// still far more than a host's clients starting at once need.
    pub const DEFAULT_MAX_PENDING_PER_PEER: usize = 64;
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_per_peer: Self::DEFAULT_MAX_PER_PEER,
            max_pending: Self::DEFAULT_MAX_PENDING,
            max_pending_per_peer: Self::DEFAULT_MAX_PENDING_PER_PEER,
        }
    }
}

/// The connections a server holds, counted against its [`ConnectionLimits`].
///
/// Invariant: `per_peer[ip]` counts the live [`Admitted`] of `ip` and those of them not yet
/// [`Admitted::authenticated`] (absent when both are 0), and `pending` the latter over all
/// peers; all are changed only under the mutex, by `admit` and by an `Admitted`'s methods and
/// drop.
#[derive(Debug)]
pub struct Admission {
    limits: ConnectionLimits,
    counts: std::sync::Mutex<Counts>,
    /// Notified whenever a connection closes ([`Admission::wait_all_closed`]).
    closed: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct Counts {
    per_peer: std::collections::HashMap<std::net::IpAddr, PeerCounts>,
    pending: usize,
    /// The connections that may be evicted ([`Admission::admit_evicting`]), per peer, oldest
    /// first: admitted with an eviction, pending, and not [`Admitted::claim`]ed.
    evictable: std::collections::HashMap<std::net::IpAddr, std::collections::VecDeque<Evictable>>,
    /// The id of the next evictable connection (increasing: a queue is in admission order).
    next_id: u64,
}

/// What closes a pending connection to make room for a newer one: called with the refusal
/// that explains why, outside the admission's lock.
pub type Evict = Box<dyn FnOnce(Refusal) + Send>;

/// A pending connection that may be evicted.
struct Evictable {
    id: u64,
    /// Set, under the admission's lock, when the connection is evicted: its pending places
    /// were given to another, and its [`Admitted`] gives back only its `open` place.
    evicted: std::sync::Arc<std::sync::atomic::AtomicBool>,
    evict: Evict,
}

impl std::fmt::Debug for Evictable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Evictable").field("id", &self.id).finish()
    }
}

impl Counts {
    /// Takes the evictable connection `id` of `peer` off its queue, if it is there.
    fn forget_evictable(&mut self, peer: std::net::IpAddr, id: u64) {
        drop(self.take_evictable(peer, id));
    }

    /// Takes the evictable connection `id` of `peer` off its queue: it, if it was there.
    fn take_evictable(&mut self, peer: std::net::IpAddr, id: u64) -> Option<Evictable> {
        let queue = self.evictable.get_mut(&peer)?;
        let taken = queue
            .iter()
            .position(|e| e.id == id)
            .and_then(|at| queue.remove(at));
        if queue.is_empty() {
            self.evictable.remove(&peer);
        }
        taken
    }

    /// Puts `evictable`, of `peer`, back on its queue in its place by age.
    fn restore_evictable(&mut self, peer: std::net::IpAddr, evictable: Evictable) {
        let queue = self.evictable.entry(peer).or_default();
        let at = queue.partition_point(|e| e.id < evictable.id);
        queue.insert(at, evictable);
    }

    /// Evicts the oldest evictable connection of `peer` (`None`: of the peer holding the most
    /// pending places among those with one): frees its pending places and marks it evicted.
    /// Returns what closes it, or `None` if there is none.
    fn evict_oldest(&mut self, peer: Option<std::net::IpAddr>) -> Option<Evict> {
        let victim_peer = match peer {
            Some(peer) => peer,
            None => {
                let per_peer = &self.per_peer;
                *self
                    .evictable
                    .iter()
                    .max_by_key(|(ip, queue)| {
                        let pending = per_peer.get(*ip).map_or(0, |c| c.pending);
                        // Most pending first; among equals, the oldest connection.
                        (
                            pending,
                            std::cmp::Reverse(queue.front().map_or(u64::MAX, |e| e.id)),
                        )
                    })?
                    .0
            }
        };
        let queue = self.evictable.get_mut(&victim_peer)?;
        let victim = queue.pop_front()?;
        if queue.is_empty() {
            self.evictable.remove(&victim_peer);
        }
        victim
            .evicted
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.pending -= 1;
        if let Some(counts) = self.per_peer.get_mut(&victim_peer) {
            counts.pending -= 1;
        }
        Some(victim.evict)
    }
}

/// One peer's connections, and how many of them are pending their handshake.
#[derive(Debug, Default, Clone, Copy)]
struct PeerCounts {
    open: usize,
    pending: usize,
}

impl Admission {
    /// Counts connections against `limits`.
    pub fn new(limits: ConnectionLimits) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            limits,
            counts: std::sync::Mutex::new(Counts::default()),
            closed: std::sync::Condvar::new(),
        })
    }

    /// Waits until every admitted connection has closed (its [`Admitted`] dropped), at most
    /// `bound`; whether they all have. A server stopping cleanly lets its connections end —
    /// and tell their peers so — before it drops what is left.
    pub fn wait_all_closed(&self, bound: Duration) -> bool {
        let (counts, _) = self
            .closed
            .wait_timeout_while(self.counts(), bound, |c| !c.per_peer.is_empty())
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        counts.per_peer.is_empty()
    }

    /// The limits counted against.
    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        // Every critical section leaves the counts consistent; a panic elsewhere must not stop
        // the server from accepting.
        self.counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Admits a new connection from `peer` as pending its handshake, or says which limit it
    /// would exceed. The connection counts until the returned guard is dropped.
    pub fn admit(self: &std::sync::Arc<Self>, peer: std::net::IpAddr) -> Result<Admitted, Refusal> {
        self.admit_with(peer, None)
    }

    /// [`Admission::admit`], except that a pending limit makes room instead of refusing while
    /// it can: when `peer` holds all its pending places, its oldest evictable connection is
    /// evicted; when all peers together hold every pending place, the oldest evictable
    /// connection of the peer holding the most is. An evicted connection's places go to the
    /// new one at once, and its `evict` is called (outside the lock) with the refusal of the
    /// limit, to answer and close it. The new connection is evictable in turn, with `evict`,
    /// until it [claims](Admitted::claim) its place by presenting its hello, and again while the
    /// server waits for its proof ([`Admitted::unclaim`]).
    ///
    /// So a flood of connections that never send their hello churns its own connections, and a
    /// peer that presents its hello within the time the flood takes to open a pending limit's
    /// worth of newer connections is never refused for it. Only when no pending connection is
    /// evictable (all of them are claimed, or admitted with [`Admission::admit`]) is a new one
    /// refused. The per-peer limit on all connections (`max_per_peer`) always refuses.
    pub fn admit_evicting(
        self: &std::sync::Arc<Self>,
        peer: std::net::IpAddr,
        evict: Evict,
    ) -> Result<Admitted, Refusal> {
        self.admit_with(peer, Some(evict))
    }

    fn admit_with(
        self: &std::sync::Arc<Self>,
        peer: std::net::IpAddr,
        evict: Option<Evict>,
    ) -> Result<Admitted, Refusal> {
        let exceeded = |limit: Limit, value: usize| Refusal::Limit {
            limit,
            value: value as u64,
        };
        let mut evicted = Vec::new();
        let mut counts = self.counts();
        let from_peer = counts.per_peer.get(&peer).copied().unwrap_or_default();
        if from_peer.open >= self.limits.max_per_peer {
            return Err(exceeded(
                Limit::ConnectionsPerPeer,
                self.limits.max_per_peer,
            ));
        }
        if from_peer.pending >= self.limits.max_pending_per_peer {
            let refusal = exceeded(
                Limit::PendingHandshakesPerPeer,
                self.limits.max_pending_per_peer,
            );
            // Room is made among the peer's own connections only.
            match evict
                .is_some()
                .then(|| counts.evict_oldest(Some(peer)))
                .flatten()
            {
                Some(victim) => evicted.push((victim, refusal)),
                None => return Err(refusal),
            }
        }
        if counts.pending >= self.limits.max_pending {
            let refusal = exceeded(Limit::PendingHandshakes, self.limits.max_pending);
            match evict.is_some().then(|| counts.evict_oldest(None)).flatten() {
                Some(victim) => evicted.push((victim, refusal)),
                None => {
                    drop(counts);
                    // A victim of the per-peer limit already lost its place: close it anyway.
                    for (victim, refusal) in evicted {
                        victim(refusal);
                    }
                    return Err(exceeded(Limit::PendingHandshakes, self.limits.max_pending));
                }
            }
        }
        let entry = counts.per_peer.entry(peer).or_default();
        entry.open += 1;
        entry.pending += 1;
        counts.pending += 1;
        let slot = evict.map(|evict| {
            let id = counts.next_id;
            counts.next_id += 1;
            let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            counts
                .evictable
                .entry(peer)
                .or_default()
                .push_back(Evictable {
                    id,
                    evicted: flag.clone(),
                    evict,
                });
            (id, flag)
        });
        drop(counts);
        for (victim, refusal) in evicted {
            victim(refusal);
        }
        Ok(Admitted {
            admission: self.clone(),
            peer,
            pending: true,
            slot,
            parked: None,
        })
    }
}

/// One admitted connection: counted by its [`Admission`] until dropped.
#[derive(Debug)]
pub struct Admitted {
    admission: std::sync::Arc<Admission>,
    peer: std::net::IpAddr,
    pending: bool,
    /// An evictable connection's id in its peer's queue, and whether it was evicted.
    slot: Option<(u64, std::sync::Arc<std::sync::atomic::AtomicBool>)>,
    /// A claimed connection's eviction, kept for [`Admitted::unclaim`].
    parked: Option<Evictable>,
}

impl Admitted {
    /// Whether the connection was evicted to make room for a newer one
    /// ([`Admission::admit_evicting`]): it holds no pending place any more, and is being
    /// closed.
    pub fn is_evicted(&self) -> bool {
        self.slot
            .as_ref()
            .is_some_and(|(_, evicted)| evicted.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// The peer's hello has arrived: from now on the connection cannot be evicted, and the
    /// server may answer it. False if it was evicted first; then the server must not answer it
    /// (its evictor answers and closes it).
    pub fn claim(&mut self) -> bool {
        let Some((id, evicted)) = self.slot.take() else {
            return true;
        };
        let mut counts = self.admission.counts();
        if evicted.load(std::sync::atomic::Ordering::SeqCst) {
            self.slot = Some((id, evicted));
            return false;
        }
        self.parked = counts.take_evictable(self.peer, id);
        true
    }

    /// The server answered a frame of the handshake and waits for the peer's next (its proof,
    /// after the challenge): until it [claims](Admitted::claim) its place again, the
    /// connection may be evicted as before, keeping its age. So a peer that sends a hello but
    /// cannot prove the secret holds its pending place no more firmly than one that sends
    /// nothing. Nothing if the connection was not claimed with an eviction.
    pub fn unclaim(&mut self) {
        if let Some(parked) = self.parked.take() {
            if !self.pending {
                return;
            }
            let mut counts = self.admission.counts();
            self.slot = Some((parked.id, parked.evicted.clone()));
            counts.restore_evictable(self.peer, parked);
        }
    }

    /// The peer passed the handshake: it no longer counts as pending.
    pub fn authenticated(&mut self) {
        // What would evict it (a handle on its socket, say) is not needed any more.
        self.parked = None;
        if std::mem::take(&mut self.pending) {
            let mut counts = self.admission.counts();
            if self.is_evicted() {
                // Its pending places were given to another already.
                return;
            }
            if let Some((id, _)) = self.slot.take() {
                counts.forget_evictable(self.peer, id);
            }
            counts.pending -= 1;
            if let Some(peer) = counts.per_peer.get_mut(&self.peer) {
                peer.pending -= 1;
            }
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut counts = self.admission.counts();
        // An evicted connection's pending places were given to another already.
        let pending = self.pending && !self.is_evicted();
        if pending {
            if let Some((id, _)) = &self.slot {
                counts.forget_evictable(self.peer, *id);
            }
            counts.pending -= 1;
        }
        if let Some(peer) = counts.per_peer.get_mut(&self.peer) {
            peer.open -= 1;
            if pending {
                peer.pending -= 1;
            }
            if peer.open == 0 {
                counts.per_peer.remove(&self.peer);
            }
        }
        self.admission.closed.notify_all();
    }
}

/// Answers a connection refused at accept time ([`Admission::admit`]) with `refusal` as the
/// answer to the hello it has not sent yet, and half-closes it. The answer is a few dozen
/// bytes, so the write lands in an empty socket buffer and does not block; the write timeout
/// guards the case where it would. The caller must keep the socket open a moment and read
/// what arrives ([`Refuser`] does): closing it with the peer's hello unread would reset the
/// connection, and the reset can destroy the refusal before the peer reads it.
///
/// Every protocol's answer is a postcard `Result<Welcome, Refusal>`, and the encoding of an
/// `Err` does not depend on the welcome type, so one function serves them all.
pub fn refuse_at_accept(stream: &std::net::TcpStream, refusal: &Refusal) {
    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
    if let Ok(bytes) = refusal_answer(refusal) {
        let mut w = stream;
        let _ = write_frame(&mut w, &bytes);
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// Refuses connections for a thread-per-connection server's accept loop without making it
/// wait: one thread answers each refused connection ([`refuse_at_accept`]), then reads and
/// discards what the peer sends for at most [`Refuser::LINGER`] before closing it, so that the
/// refusal is not destroyed by a reset. A flood costs one thread and at most
/// [`Refuser::MAX_LINGERING`] open sockets; beyond that a refused connection is closed at once.
pub struct Refuser {
    tx: Option<std::sync::mpsc::SyncSender<(std::net::TcpStream, Refusal)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Refuser {
    /// How long a refused connection is kept open, reading, before it is closed.
    pub const LINGER: Duration = Duration::from_millis(200);
    /// Most refused connections kept open at once.
    pub const MAX_LINGERING: usize = 1024;

    /// Starts the refusing thread, named `name`.
    pub fn start(name: &str) -> std::io::Result<Refuser> {
        let (tx, rx) = std::sync::mpsc::sync_channel(Self::MAX_LINGERING);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || refuser_loop(rx))?;
        Ok(Refuser {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Refuses `stream` with `refusal` (closed at once if too many are lingering).
    pub fn refuse(&self, stream: std::net::TcpStream, refusal: Refusal) {
        if let Some(tx) = &self.tx {
            if let Err(std::sync::mpsc::TrySendError::Full((stream, refusal))) =
                tx.try_send((stream, refusal))
            {
                refuse_at_accept(&stream, &refusal);
            }
        }
    }
}

impl Drop for Refuser {
    fn drop(&mut self) {
        // Disconnects the channel: the thread closes what it holds and ends.
        self.tx.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn refuser_loop(rx: std::sync::mpsc::Receiver<(std::net::TcpStream, Refusal)>) {
    use std::io::ErrorKind;
    use std::sync::mpsc::RecvTimeoutError;
    use std::time::Instant;
    let mut lingering: Vec<(std::net::TcpStream, Instant)> = Vec::new();
    let mut sink = [0u8; 4096];
    loop {
        let next = if lingering.is_empty() {
            rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else {
            rx.recv_timeout(Duration::from_millis(10))
        };
        match next {
            Ok((stream, refusal)) => {
                refuse_at_accept(&stream, &refusal);
                if stream.set_nonblocking(true).is_ok() && lingering.len() < Refuser::MAX_LINGERING
                {
                    lingering.push((stream, Instant::now() + Refuser::LINGER));
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let now = Instant::now();
        lingering.retain_mut(|(stream, deadline)| {
            if now >= *deadline {
                return false;
            }
            // Discard what arrived; keep the socket until the peer closes or time is up.
            loop {
                match stream.read(&mut sink) {
                    Ok(0) => return false,
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => return false,
                }
            }
        });
    }
}

/// Decodes and checks the hello in `body` for a server of `protocol` belonging to
/// `credentials`' cluster, and draws the server's nonce: the [`Challenge`] to answer with is
/// [`Challenged::challenge`], and the client's [`Proof`] is checked with
/// [`Challenged::verify`].
///
/// Checks, in order: magic, protocol, version (decoded alone first, so any client learns these
/// mismatches whatever the shape of the rest), then the whole hello without trailing bytes and
/// the cluster id. Whether the session may connect is the caller's check, after the proof.
pub fn accept<R: DeserializeOwned>(
    body: &[u8],
    protocol: Protocol,
    credentials: &Credentials,
) -> Result<Challenged<R>, Refusal> {
    accept_with_nonce(body, protocol, credentials, fresh_nonce())
}

/// [`accept`] with the server's nonce given: for tests and fuzzing only (a server's nonce must
/// be fresh, or a captured handshake could be replayed to it).
pub fn accept_with_nonce<R: DeserializeOwned>(
    body: &[u8],
    protocol: Protocol,
    credentials: &Credentials,
    nonce: Nonce,
) -> Result<Challenged<R>, Refusal> {
    let ((magic, client_protocol, version), _) =
        postcard::take_from_bytes::<(u32, Protocol, u16)>(body)
            .map_err(|e| Refusal::BadHello(format!("cannot decode the hello: {e}")))?;
    if magic != MAGIC {
        return Err(Refusal::BadMagic);
    }
    if client_protocol != protocol {
        return Err(Refusal::WrongProtocol {
            client: client_protocol,
            server: protocol,
        });
    }
    if version != protocol.version() {
        return Err(Refusal::UnsupportedVersion {
            protocol,
            client: version,
            server: protocol.version(),
        });
    }
    let hello = match postcard::take_from_bytes::<Hello<R>>(body) {
        Ok((hello, [])) => hello,
        Ok((_, trailing)) => {
            return Err(Refusal::BadHello(format!(
                "{} trailing bytes after the hello",
                trailing.len()
            )))
        }
        Err(e) => return Err(Refusal::BadHello(format!("cannot decode the hello: {e}"))),
    };
    if hello.cluster != credentials.cluster {
        return Err(Refusal::WrongCluster {
            client: hello.cluster,
            server: credentials.cluster.clone(),
        });
    }
    let challenge = Challenge {
        nonce,
        mac: compute_mac(credentials, Side::Server, body, &nonce),
    };
    Ok(Challenged {
        hello,
        body: body.to_vec(),
        challenge,
    })
}

/// A hello a server accepted ([`accept`]) and challenged, waiting for the client's [`Proof`].
pub struct Challenged<R> {
    hello: Hello<R>,
    /// The hello's encoding as it arrived: what both MACs cover.
    body: Vec<u8>,
    challenge: Challenge,
}

impl<R> Challenged<R> {
    /// The accepted hello (not authenticated yet).
    pub fn hello(&self) -> &Hello<R> {
        &self.hello
    }

    /// The challenge to answer the hello with (`Ok(challenge)`, a [`ChallengeAnswer`]).
    pub fn challenge(&self) -> &Challenge {
        &self.challenge
    }

    /// Checks the client's answer to the challenge, the [`Proof`] encoded in `body`: the hello
    /// once the client proved it holds `credentials`' secret, [`Refusal::BadToken`] if it did
    /// not.
    pub fn verify(self, body: &[u8], credentials: &Credentials) -> Result<Hello<R>, Refusal> {
        let proof = match postcard::take_from_bytes::<Proof>(body) {
            Ok((proof, [])) => proof,
            Ok((_, trailing)) => {
                return Err(Refusal::BadHello(format!(
                    "{} trailing bytes after the proof",
                    trailing.len()
                )))
            }
            Err(e) => return Err(Refusal::BadHello(format!("cannot decode the proof: {e}"))),
        };
        if !mac_verifies(
            credentials,
            Side::Client,
            &self.body,
            &self.challenge.nonce,
            &proof.mac,
        ) {
            return Err(Refusal::BadToken {
                cluster: credentials.cluster.clone(),
            });
        }
        Ok(self.hello)
    }
}

impl<R: std::fmt::Debug> std::fmt::Debug for Challenged<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Challenged")
            .field("hello", &self.hello)
            .finish_non_exhaustive()
    }
}

/// The client's side of the challenge: decodes the server's answer to the hello whose encoding
/// (as sent) is `hello`, checks the server's MAC, and returns the encoded [`Proof`] to send.
/// A refusal is [`HandshakeError::Refused`]; a server that does not prove `credentials`'
/// secret is [`HandshakeError::ServerUnverified`], and the client must close the connection
/// without sending anything more.
pub fn answer_challenge(
    credentials: &Credentials,
    hello: &[u8],
    answer: &[u8],
) -> Result<Vec<u8>, HandshakeError> {
    let challenge = postcard::from_bytes::<ChallengeAnswer>(answer)??;
    if !mac_verifies(
        credentials,
        Side::Server,
        hello,
        &challenge.nonce,
        &challenge.mac,
    ) {
        return Err(HandshakeError::ServerUnverified {
            cluster: credentials.cluster.clone(),
        });
    }
    Ok(postcard::to_stdvec(&Proof::new(
        credentials,
        hello,
        &challenge,
    ))?)
}

/// The encoded answer (a frame body) that refuses a hello or a proof with `refusal`, in every
/// protocol and at either step.
pub fn refusal_answer(refusal: &Refusal) -> Result<Vec<u8>, postcard::Error> {
    postcard::to_stdvec::<Result<(), Refusal>>(&Err(refusal.clone()))
}

/// Why a client's handshake failed.
#[derive(Debug, Error)]
pub enum HandshakeError {
    /// The server refused the connection, saying why.
    #[error("refused: {0}")]
    Refused(#[from] Refusal),
    /// The server did not prove it holds the cluster's secret: an impostor, or a server given
    /// another token. The client sent nothing derived from the secret and closes.
    #[error(
        "authentication failed: the client could not verify the server (it does not prove \
         cluster {cluster:?}'s secret: an impostor, or a server given another token)"
    )]
    ServerUnverified {
        /// The cluster the client wanted.
        cluster: String,
    },
    /// Sending the hello or reading the answer failed (closed, timed out, bad frame).
    #[error("handshake: {0}")]
    Frame(#[from] FrameError),
    /// The answer did not decode: whatever answers does not speak the protocol.
    #[error("bad handshake answer (is this a CitronFS server?): {0}")]
    Decode(#[from] postcard::Error),
}

/// The handshake of a blocking client whose server answers with a postcard
/// `Result<W, Refusal>`: sends the hello, checks the server's challenge and sends the client's
/// proof ([`answer_challenge`]), then reads the welcome. (The `tcp` fabric's verbs do the same
/// inline, in their own buffers.)
pub fn client_handshake<R: Serialize, W: DeserializeOwned>(
    stream: &mut (impl Read + Write),
    hello: &Hello<R>,
    credentials: &Credentials,
    max_answer: usize,
) -> Result<W, HandshakeError> {
    let body = postcard::to_stdvec(hello)?;
    write_frame(stream, &body)
        .and_then(|()| stream.flush())
        .map_err(FrameError::Io)?;
    let mut answer = Vec::new();
    read_frame(stream, max_answer, &mut answer)?;
    let proof = answer_challenge(credentials, &body, &answer)?;
    write_frame(stream, &proof)
        .and_then(|()| stream.flush())
        .map_err(FrameError::Io)?;
    read_frame(stream, max_answer, &mut answer)?;
    Ok(postcard::from_bytes::<Result<W, Refusal>>(&answer)??)
}

/// The server side of [`client_handshake`]: reads the hello (one frame of at most
/// [`MAX_HELLO_FRAME`]), checks it with [`accept`] and answers the challenge, reads the
/// client's proof and checks it ([`Challenged::verify`]), then `admit`s the hello (the
/// service's own check, e.g. revoked sessions) and answers `Ok(welcome(&hello))`. Any failure
/// is answered with its refusal instead, and ends the handshake. Returns the authenticated
/// hello, or the refusal that was sent.
pub fn server_handshake<R: DeserializeOwned, W: Serialize>(
    stream: &mut (impl Read + Write),
    protocol: Protocol,
    credentials: &Credentials,
    welcome: impl FnOnce(&Hello<R>) -> Result<W, Refusal>,
) -> Result<Hello<R>, Refusal> {
    server_handshake_with_nonce(stream, protocol, credentials, fresh_nonce(), welcome)
}

/// [`server_handshake`] with the server's nonce given: for tests and fuzzing only (see
/// [`accept_with_nonce`]).
pub fn server_handshake_with_nonce<R: DeserializeOwned, W: Serialize>(
    stream: &mut (impl Read + Write),
    protocol: Protocol,
    credentials: &Credentials,
    nonce: Nonce,
    welcome: impl FnOnce(&Hello<R>) -> Result<W, Refusal>,
) -> Result<Hello<R>, Refusal> {
    // The peer may be gone already: the refusal is returned to the caller either way.
    fn send<T: Serialize>(stream: &mut impl Write, answer: &T) {
        if let Ok(bytes) = postcard::to_stdvec(answer) {
            let _ = write_frame(stream, &bytes).and_then(|()| stream.flush());
        }
    }
    fn refuse<T>(stream: &mut impl Write, refusal: Refusal) -> Result<T, Refusal> {
        send(stream, &Err::<(), _>(refusal.clone()));
        Err(refusal)
    }
    let mut body = Vec::new();
    let challenged = match read_frame(stream, MAX_HELLO_FRAME, &mut body) {
        Ok(()) => accept_with_nonce::<R>(&body, protocol, credentials, nonce),
        Err(e) => Err(Refusal::BadHello(e.to_string())),
    };
    let challenged = match challenged {
        Ok(challenged) => challenged,
        Err(refusal) => return refuse(stream, refusal),
    };
    send(stream, &Ok::<_, Refusal>(challenged.challenge()));
    let hello = match read_frame(stream, MAX_HELLO_FRAME, &mut body) {
        Ok(()) => challenged.verify(&body, credentials),
        Err(e) => Err(Refusal::BadHello(format!("no proof: {e}"))),
    };
    let hello = match hello {
        Ok(hello) => hello,
        Err(refusal) => return refuse(stream, refusal),
    };
    match welcome(&hello) {
        Ok(w) => {
            send(stream, &Ok::<_, Refusal>(w));
            Ok(hello)
        }
        Err(refusal) => refuse(stream, refusal),
    }
}

#[cfg(any(test, feature = "fuzzing"))]
/// The credentials of every fuzz entry's server: cluster `fuzz`, token `secret`.
pub fn fuzz_credentials() -> Credentials {
    Credentials::new("fuzz", "secret")
}

#[cfg(any(test, feature = "fuzzing"))]
/// The nonce of every fuzz entry's server and client, so that a fuzzer can reach past the
/// challenge with the proofs in the seeds ([`fuzz_handshake`], [`fuzz_challenge`]).
pub const FUZZ_NONCE: Nonce = [7; NONCE_LEN];

#[cfg(any(test, feature = "fuzzing"))]
/// The client's side of a fuzz entry's handshake as frames: `hello`, then the client's proof
/// for a server of [`fuzz_credentials`] drawing [`FUZZ_NONCE`].
pub fn fuzz_handshake<R: Serialize>(hello: &Hello<R>) -> Vec<u8> {
    let body = postcard::to_stdvec(hello).expect("a hello encodes");
    let proof = Proof {
        mac: compute_mac(&fuzz_credentials(), Side::Client, &body, &FUZZ_NONCE),
    };
    let proof = postcard::to_stdvec(&proof).expect("a proof encodes");
    [crate::fuzz::frame(&body), crate::fuzz::frame(&proof)].concat()
}

#[cfg(any(test, feature = "fuzzing"))]
/// The server's answer to `hello` as a frame: the challenge of a server of
/// [`fuzz_credentials`] drawing [`FUZZ_NONCE`], which a client of those credentials verifies.
pub fn fuzz_challenge<R: Serialize>(hello: &Hello<R>) -> Vec<u8> {
    let body = postcard::to_stdvec(hello).expect("a hello encodes");
    let answer: ChallengeAnswer = Ok(Challenge {
        nonce: FUZZ_NONCE,
        mac: compute_mac(&fuzz_credentials(), Side::Server, &body, &FUZZ_NONCE),
    });
    crate::fuzz::frame(&postcard::to_stdvec(&answer).expect("an answer encodes"))
}

#[cfg(any(test, feature = "fuzzing"))]
/// Fuzz entry of the handshake as every server runs it ([`server_handshake`], its nonce
/// [`FUZZ_NONCE`]) for `protocol` with hellos carrying a role of type `R` (the RPC protocol's
/// is `proto::rpc::Role`, the others' `()`); `input` is the byte stream the peer sends.
/// Checks, panicking on a finding: the hello's body is not allocated beyond the bytes that
/// arrived; the server writes a decodable answer to the hello and, only if that is a
/// challenge, exactly one more, and the last agrees with the outcome; a challenge proves the
/// server's secret to a client of its credentials; an authenticated hello is of this protocol
/// and version, names the server's cluster, and is accepted again after a round trip through
/// its encoding.
pub fn fuzz_server_handshake<R: DeserializeOwned + Serialize + PartialEq + std::fmt::Debug>(
    input: &[u8],
    protocol: Protocol,
) {
    let credentials = fuzz_credentials();
    let mut body = Vec::new();
    let _ = read_frame(&mut &input[..], MAX_HELLO_FRAME, &mut body);
    crate::fuzz::assert_bounded(&body, input.len());

    let mut pipe = crate::fuzz::Pipe::new(input);
    let outcome =
        server_handshake_with_nonce::<R, ()>(&mut pipe, protocol, &credentials, FUZZ_NONCE, |_| {
            Ok(())
        });
    let mut written = &pipe.output[..];
    let mut read_answer = |first: bool| -> Result<(), Refusal> {
        let mut answer = Vec::new();
        if let Err(e) = read_frame(&mut written, MAX_HELLO_FRAME, &mut answer) {
            panic!("the server's answer is not a frame: {e}");
        }
        if !first {
            // The welcome, `()`.
            return match postcard::from_bytes::<Result<(), Refusal>>(&answer) {
                Ok(answer) => answer,
                Err(e) => panic!("the server's answer to the proof does not decode: {e}"),
            };
        }
        match postcard::from_bytes::<ChallengeAnswer>(&answer) {
            Ok(Ok(challenge)) => {
                // A challenge answers a hello the server accepted: the first frame's.
                assert!(
                    mac_verifies(
                        &credentials,
                        Side::Server,
                        &body,
                        &challenge.nonce,
                        &challenge.mac
                    ),
                    "the server's challenge does not prove its secret"
                );
                Ok(())
            }
            Ok(Err(refusal)) => Err(refusal),
            Err(e) => panic!("the server's answer to the hello does not decode: {e}"),
        }
    };
    let answer = read_answer(true).and_then(|()| read_answer(false));
    assert!(written.is_empty(), "the server wrote more than its answers");
    match (outcome, answer) {
        (Ok(hello), Ok(())) => {
            assert_eq!(
                (hello.magic, hello.protocol, hello.version),
                (MAGIC, protocol, protocol.version())
            );
            assert_eq!(hello.cluster, credentials.cluster);
            let again = postcard::to_stdvec(&hello).expect("an accepted hello encodes");
            match accept::<R>(&again, protocol, &credentials) {
                Ok(back) => assert!(back.hello == hello, "the hello changed in a round trip"),
                Err(refusal) => panic!("a re-encoded accepted hello is refused: {refusal}"),
            }
        }
        (Err(refused), Err(answered)) => assert_eq!(refused, answered),
        (outcome, answer) => panic!(
            "the answer {answer:?} disagrees with the outcome {:?}",
            outcome.map(|_| ())
        ),
    }
}

#[cfg(any(test, feature = "fuzzing"))]
/// Seeds for [`fuzz_server_handshake`]: handshakes of `protocol` with `role` — the right one
/// (a hello and its proof), one with a wrong proof, and hellos with each field wrong — plus
/// other protocols' hellos.
pub fn fuzz_hello_seeds<R: Serialize + Clone>(protocol: Protocol, role: R) -> Vec<Vec<u8>> {
    let mut good = Hello::new(protocol, &fuzz_credentials(), 7, role.clone());
    good.nonce = FUZZ_NONCE;
    let mut hellos = Vec::new();
    let mut h = good.clone();
    h.cluster = "other".into();
    hellos.push(h);
    let mut h = good.clone();
    h.version += 1;
    hellos.push(h);
    let mut h = good.clone();
    h.magic ^= 1;
    hellos.push(h);
    for other in [Protocol::Verbs, Protocol::Rpc, Protocol::LockServer] {
        let mut h = good.clone();
        h.protocol = other;
        h.version = other.version();
        hellos.push(h);
    }
    let handshake = fuzz_handshake(&good);
    let mut seeds = vec![handshake.clone()];
    // A proof of another secret: the hello's frame, then a proof that does not verify.
    let hello_len = crate::fuzz::frame(&postcard::to_stdvec(&good).expect("encodes")).len();
    let mut wrong = handshake.clone();
    let last = wrong.len() - 1;
    wrong[last] ^= 1;
    let proof = wrong[hello_len + crate::frame::HEADER_LEN..].to_vec();
    seeds.push([&handshake[..hello_len], &crate::fuzz::frame(&proof)].concat());
    seeds.extend(
        hellos
            .iter()
            .map(|h| crate::fuzz::frame(&postcard::to_stdvec(h).expect("a hello encodes"))),
    );
    // A good handshake followed by more bytes (the first request), and one split short.
    let mut followed = handshake.clone();
    followed.extend_from_slice(&handshake);
    seeds.push(followed);
    seeds.push(handshake[..hello_len / 2].to_vec());
    seeds.push(handshake[..hello_len].to_vec());
    seeds
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds() -> Credentials {
        Credentials::new("c", "secret")
    }

    fn encode<R: Serialize>(hello: &Hello<R>) -> Vec<u8> {
        postcard::to_stdvec(hello).unwrap()
    }

    /// The client's side of a handshake with a server whose answer is `answer`: its proof.
    fn client_proof<R: Serialize>(
        hello: &Hello<R>,
        credentials: &Credentials,
        challenge: &Challenge,
    ) -> Result<Vec<u8>, HandshakeError> {
        let answer = postcard::to_stdvec(&Ok::<_, Refusal>(challenge)).unwrap();
        answer_challenge(credentials, &encode(hello), &answer)
    }

    #[test]
    fn accepts_a_good_hello_and_keeps_the_role() {
        let hello = Hello::new(Protocol::Rpc, &creds(), 7, "role".to_string());
        let challenged: Challenged<String> =
            accept(&encode(&hello), Protocol::Rpc, &creds()).unwrap();
        let proof = client_proof(&hello, &creds(), challenged.challenge()).unwrap();
        let got = challenged.verify(&proof, &creds()).unwrap();
        assert_eq!(got.session, 7);
        assert_eq!(got.role, "role");
    }

    #[test]
    fn refuses_each_mismatch_with_its_reason() {
        let good = Hello::new(Protocol::LockServer, &creds(), 0, ());
        let check = |h: &Hello<()>| {
            accept::<()>(&encode(h), Protocol::LockServer, &creds()).map(|c| c.hello().clone())
        };

        let mut h = good.clone();
        h.magic = 1;
        assert_eq!(check(&h).unwrap_err(), Refusal::BadMagic);

        let mut h = good.clone();
        h.protocol = Protocol::Verbs;
        assert!(matches!(
            check(&h).unwrap_err(),
            Refusal::WrongProtocol {
                client: Protocol::Verbs,
                server: Protocol::LockServer
            }
        ));

        let mut h = good.clone();
        h.version = 99;
        assert!(matches!(
            check(&h).unwrap_err(),
            Refusal::UnsupportedVersion { client: 99, .. }
        ));

        let mut h = good.clone();
        h.cluster = "other".into();
        assert!(matches!(
            check(&h).unwrap_err(),
            Refusal::WrongCluster { .. }
        ));

        let mut bytes = encode(&good);
        bytes.push(0);
        assert!(matches!(
            accept::<()>(&bytes, Protocol::LockServer, &creds()).unwrap_err(),
            Refusal::BadHello(_)
        ));
        assert!(matches!(
            accept::<()>(&[], Protocol::LockServer, &creds()).unwrap_err(),
            Refusal::BadHello(_)
        ));
    }

    /// A client of another secret is refused by the server, which says it could not verify the
    /// client; a server of another secret is refused by the client, which says it could not
    /// verify the server. Neither message holds a secret.
    #[test]
    fn a_wrong_secret_is_refused_on_either_side() {
        let hello = Hello::new(Protocol::Verbs, &creds(), 0, ());
        let wrong = Credentials::new("c", "secreT");
        for client in [wrong.clone(), Credentials::new("c", "")] {
            let challenged = accept::<()>(&encode(&hello), Protocol::Verbs, &creds()).unwrap();
            // The client cannot verify this server (it holds another secret) …
            let err = client_proof(&hello, &client, challenged.challenge()).unwrap_err();
            assert!(
                matches!(err, HandshakeError::ServerUnverified { .. }),
                "{err}"
            );
            let text = err.to_string();
            assert!(text.contains("could not verify the server"), "{text}");
            assert!(
                !text.contains("secret\"") && !text.contains("secreT"),
                "{text}"
            );
            // … and a proof made with its secret anyway does not verify at the server.
            let proof = Proof {
                mac: compute_mac(
                    &client,
                    Side::Client,
                    &encode(&hello),
                    &challenged.challenge().nonce,
                ),
            };
            let refusal = challenged
                .verify(&postcard::to_stdvec(&proof).unwrap(), &creds())
                .unwrap_err();
            assert!(matches!(refusal, Refusal::BadToken { .. }));
            let text = refusal.to_string();
            assert!(text.contains("could not verify the client"), "{text}");
            assert!(!text.contains("secreT"), "never echo a token: {text}");
        }
        // A garbled proof is a bad handshake, not a panic.
        let challenged = accept::<()>(&encode(&hello), Protocol::Verbs, &creds()).unwrap();
        assert!(matches!(
            challenged.verify(&[1, 2, 3], &creds()).unwrap_err(),
            Refusal::BadHello(_)
        ));
    }

    /// Each side's MAC is its own: the server's does not pass as the client's (reflected), a
    /// proof of one connection does not pass on another (the server's nonce differs), and a
    /// changed hello field invalidates it.
    #[test]
    fn a_proof_is_bound_to_its_side_connection_and_hello() {
        let hello = Hello::new(Protocol::Rpc, &creds(), 3, 1u8);
        let first = accept::<u8>(&encode(&hello), Protocol::Rpc, &creds()).unwrap();
        let reflected = postcard::to_stdvec(&Proof {
            mac: first.challenge().mac,
        })
        .unwrap();
        let proof = client_proof(&hello, &creds(), first.challenge()).unwrap();
        let second = accept::<u8>(&encode(&hello), Protocol::Rpc, &creds()).unwrap();
        assert_ne!(first.challenge().nonce, second.challenge().nonce);
        assert!(matches!(
            second.verify(&proof, &creds()),
            Err(Refusal::BadToken { .. })
        ));
        let third = accept::<u8>(&encode(&hello), Protocol::Rpc, &creds()).unwrap();
        assert!(matches!(
            third.verify(&reflected, &creds()),
            Err(Refusal::BadToken { .. })
        ));
        // A proof for one session is not one for another.
        let mut other = hello.clone();
        other.session = 4;
        let fourth = accept::<u8>(&encode(&other), Protocol::Rpc, &creds()).unwrap();
        let mac = compute_mac(
            &creds(),
            Side::Client,
            &encode(&hello),
            &fourth.challenge().nonce,
        );
        assert!(matches!(
            fourth.verify(&postcard::to_stdvec(&Proof { mac }).unwrap(), &creds()),
            Err(Refusal::BadToken { .. })
        ));
        assert!(first.verify(&proof, &creds()).is_ok());
    }

    /// A whole handshake over a socket pair, both sides blocking: the welcome arrives, and the
    /// server has the client's role. (`tests/handshake.rs` records a real connection's bytes.)
    #[test]
    fn client_and_server_handshake_over_a_socket_pair() {
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            server_handshake::<u32, String>(&mut b, Protocol::Rpc, &creds(), |h| {
                Ok(format!("welcome {}", h.role))
            })
        });
        let hello = Hello::new(Protocol::Rpc, &creds(), 0, 42u32);
        let welcome: String = client_handshake(&mut a, &hello, &creds(), 1 << 10).unwrap();
        assert_eq!(welcome, "welcome 42");
        assert_eq!(server.join().unwrap().unwrap().role, 42);
    }

    /// A hello of another shape (a later version's) is still told its version is unsupported.
    #[test]
    fn version_is_read_before_the_rest() {
        let mut bytes = postcard::to_stdvec(&(MAGIC, Protocol::Verbs, 42u16)).unwrap();
        bytes.extend_from_slice(&[0xff; 5]);
        assert!(matches!(
            accept::<()>(&bytes, Protocol::Verbs, &creds()).unwrap_err(),
            Refusal::UnsupportedVersion { client: 42, .. }
        ));
    }

    #[test]
    fn credentials_never_print_the_token() {
        let text = format!("{:?}", creds());
        assert!(!text.contains("secret"));
        let text = format!("{:?}", Hello::new(Protocol::Rpc, &creds(), 0, ()));
        assert!(!text.contains("secret"));
    }

    /// A stopping server waits until its admitted connections have all closed: not while one
    /// is open (the bound runs out), at once when none is, woken when the last one closes.
    #[test]
    fn admission_waits_until_every_connection_closed() {
        let admission = Admission::new(ConnectionLimits::default());
        assert!(admission.wait_all_closed(Duration::ZERO), "none admitted");
        let a: std::net::IpAddr = [10, 0, 0, 1].into();
        let (mut one, two) = (admission.admit(a).unwrap(), admission.admit(a).unwrap());
        one.authenticated();
        assert!(!admission.wait_all_closed(Duration::from_millis(20)));
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop((one, two));
        });
        assert!(admission.wait_all_closed(Duration::from_secs(30)));
        closer.join().unwrap();
    }

    /// Admission counts pending and per-peer connections, frees pending places on
    /// authentication and every place on drop, and names the limit it refuses by.
    #[test]
    fn admission_counts_and_frees() {
        let admission = Admission::new(ConnectionLimits {
            max_per_peer: 2,
            max_pending: 2,
            max_pending_per_peer: 2,
        });
        let a: std::net::IpAddr = [10, 0, 0, 1].into();
        let b: std::net::IpAddr = [10, 0, 0, 2].into();
        let limit = |r: Result<Admitted, Refusal>| match r {
            Err(Refusal::Limit { limit, value }) => Some((limit, value)),
            Err(other) => panic!("{other}"),
            Ok(_) => None,
        };
        let mut first = admission.admit(a).unwrap();
        let second = admission.admit(b).unwrap();
        assert_eq!(
            limit(admission.admit(a)),
            Some((Limit::PendingHandshakes, 2))
        );
        first.authenticated();
        first.authenticated(); // idempotent
        let third = admission.admit(a).unwrap();
        assert_eq!(
            limit(admission.admit(b)),
            Some((Limit::PendingHandshakes, 2))
        );
        drop(second);
        assert_eq!(
            limit(admission.admit(a)),
            Some((Limit::ConnectionsPerPeer, 2))
        );
        let from_b = admission.admit(b).unwrap();
        drop((first, third, from_b));
        let counts = admission.counts();
        assert_eq!(counts.pending, 0);
        assert!(counts.per_peer.is_empty(), "{:?}", counts.per_peer);
        drop(counts);

        // One address cannot take every pending place.
        let admission = Admission::new(ConnectionLimits {
            max_per_peer: 10,
            max_pending: 3,
            max_pending_per_peer: 2,
        });
        let held: Vec<Admitted> = (0..2).map(|_| admission.admit(a).unwrap()).collect();
        assert_eq!(
            limit(admission.admit(a)),
            Some((Limit::PendingHandshakesPerPeer, 2))
        );
        let other = admission.admit(b).unwrap();
        assert_eq!(
            limit(admission.admit(b)),
            Some((Limit::PendingHandshakes, 3))
        );
        drop((held, other));
    }

    /// With evictions, a full pending limit makes room: the per-peer one among the peer's own
    /// connections, the total one among those of the peer holding the most, oldest first;
    /// the victim is told which limit, gives back only its `open` place, and cannot claim.
    /// A claimed connection is never evicted, and with nothing evictable the limit refuses.
    #[test]
    fn admission_evicts_the_oldest_unclaimed() {
        use std::sync::mpsc;
        let admission = Admission::new(ConnectionLimits {
            max_per_peer: 10,
            max_pending: 4,
            max_pending_per_peer: 2,
        });
        let a: std::net::IpAddr = [10, 0, 0, 1].into();
        let b: std::net::IpAddr = [10, 0, 0, 2].into();
        let c: std::net::IpAddr = [10, 0, 0, 3].into();
        let (tx, rx) = mpsc::channel();
        let admit = |peer, name: &'static str| {
            let tx = tx.clone();
            admission
                .admit_evicting(
                    peer,
                    Box::new(move |refusal| tx.send((name, refusal)).unwrap()),
                )
                .unwrap()
        };
        let limit = |limit, value| Refusal::Limit { limit, value };
        let (mut a1, a2) = (admit(a, "a1"), admit(a, "a2"));
        // The per-peer limit: a's oldest makes room.
        let a3 = admit(a, "a3");
        assert_eq!(
            rx.try_recv().unwrap(),
            ("a1", limit(Limit::PendingHandshakesPerPeer, 2))
        );
        assert!(a1.is_evicted() && !a1.claim());
        drop(a1);
        assert_eq!(admission.counts().per_peer[&a].open, 2);
        let (mut b1, b2) = (admit(b, "b1"), admit(b, "b2"));
        assert!(rx.try_recv().is_err(), "4 pending places, 4 pending");
        // The total limit: a and b hold two each; a's is older.
        let c1 = admit(c, "c1");
        assert_eq!(
            rx.try_recv().unwrap(),
            ("a2", limit(Limit::PendingHandshakes, 4))
        );
        // b now holds the most; a claimed connection is not evicted.
        assert!(b1.claim());
        let c2 = admit(c, "c2");
        assert_eq!(
            rx.try_recv().unwrap(),
            ("b2", limit(Limit::PendingHandshakes, 4))
        );
        // Pending: a3, b1 (claimed), c1, c2. c holds the most.
        assert_eq!(
            admission.admit(c).map(|_| ()).unwrap_err(),
            limit(Limit::PendingHandshakesPerPeer, 2),
            "admit never evicts"
        );
        let a4 = admit(a, "a4");
        assert_eq!(
            rx.try_recv().unwrap(),
            ("c1", limit(Limit::PendingHandshakes, 4))
        );
        b1.authenticated();
        let counts = admission.counts();
        assert_eq!(counts.pending, 3);
        assert_eq!(counts.per_peer[&b].pending, 0);
        drop(counts);
        // Nothing evictable: the limit refuses.
        let d: std::net::IpAddr = [10, 0, 0, 4].into();
        let mut claimed = vec![a3, c2, a4, admit(d, "d1")];
        for admitted in &mut claimed {
            assert!(admitted.claim());
        }
        assert_eq!(
            admission
                .admit_evicting(d, Box::new(|_| panic!("nothing to evict")))
                .map(|_| ())
                .unwrap_err(),
            limit(Limit::PendingHandshakes, 4)
        );
        assert!(rx.try_recv().is_err());
        drop((claimed, a2, b1, b2, c1));
        let counts = admission.counts();
        assert_eq!(counts.pending, 0);
        assert!(counts.per_peer.is_empty(), "{:?}", counts.per_peer);
        assert!(counts.evictable.is_empty(), "{:?}", counts.evictable);
    }

    /// A connection unclaimed after its challenge is evictable again, in its place by age; it
    /// cannot claim once evicted; once authenticated it is not evictable.
    #[test]
    fn admission_evicts_a_connection_waiting_for_its_proof() {
        use std::sync::mpsc;
        let admission = Admission::new(ConnectionLimits {
            max_per_peer: 10,
            max_pending: 10,
            max_pending_per_peer: 2,
        });
        let a: std::net::IpAddr = [10, 0, 0, 1].into();
        let (tx, rx) = mpsc::channel();
        let admit = |name: &'static str| {
            let tx = tx.clone();
            admission
                .admit_evicting(
                    a,
                    Box::new(move |refusal| tx.send((name, refusal)).unwrap()),
                )
                .unwrap()
        };
        let (mut first, mut second) = (admit("first"), admit("second"));
        // Both sent their hellos; the second authenticates, the first waits for its proof.
        assert!(first.claim() && second.claim());
        first.unclaim();
        second.unclaim();
        second.claim();
        second.authenticated();
        second.unclaim(); // nothing: authenticated
        let _third = admit("third");
        assert!(rx.try_recv().is_err(), "two pending places, two pending");
        let _fourth = admit("fourth");
        assert_eq!(
            rx.try_recv().unwrap(),
            (
                "first",
                Refusal::Limit {
                    limit: Limit::PendingHandshakesPerPeer,
                    value: 2
                }
            )
        );
        assert!(
            first.is_evicted() && !first.claim(),
            "its proof comes too late"
        );
        drop((first, second));
        assert_eq!(admission.counts().per_peer[&a].pending, 2);
    }

    /// The handshake of every protocol under the stable fuzzer (see `crate::fuzz`).
    #[test]
    fn fuzz_handshakes() {
        let budget = crate::fuzz::DEFAULT_BUDGET / 3;
        for protocol in [Protocol::Verbs, Protocol::LockServer] {
            let seeds = fuzz_hello_seeds(protocol, ());
            let report = crate::fuzz::run_framed("handshake", &seeds, budget, Some(0), |input| {
                fuzz_server_handshake::<()>(input, protocol)
            });
            assert!(report.execs > seeds.len() as u64);
        }
        // A protocol whose role carries data (the RPC protocol's is in `proto`).
        let seeds = fuzz_hello_seeds(Protocol::Rpc, ("host".to_string(), 42u32));
        crate::fuzz::run_framed("handshake", &seeds, budget, Some(0), |input| {
            fuzz_server_handshake::<(String, u32)>(input, Protocol::Rpc)
        });
    }

    #[test]
    fn any_bytes_yield_a_refusal_not_a_panic() {
        for len in 0..64 {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 + len) as u8).collect();
            let _ = accept::<u64>(&bytes, Protocol::Rpc, &creds());
        }
    }
}
