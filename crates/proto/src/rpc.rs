//! The meta server's RPC protocol: the handshake every CitronFS protocol shares
//! ([`fabric::handshake`], [`Protocol::Rpc`], with a [`Role`]), answered by a [`Welcome`], then
//! one request frame and one response frame per call, each a `fabric::frame` (length + crc32)
//! holding a postcard message.

use crate::error::FsError;
use crate::stream::MetaStream;
use crate::types::*;
use fabric::frame::{read_frame, write_frame, FrameError};
use fabric::{RegionId, RemoteAddr};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;
use thiserror::Error;

use crate::request::{class, requests};
pub use crate::request::{Cost, Effects, Group, RequestClass};
use fabric::handshake::{self, HandshakeError, HANDSHAKE_TIMEOUT};
pub use fabric::handshake::{Credentials, Protocol, Refusal};

/// The version of the RPC protocol this build speaks ([`Protocol::Rpc`]'s).
pub const VERSION: u16 = Protocol::Rpc.version();
/// Largest frame either side accepts (a readdir page or an xattr value fits many times over).
pub const MAX_FRAME: usize = 16 << 20;

/// Who is connecting.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// A file-system client (a mount or a library user).
    Client {
        /// Where it runs, for logs.
        host: String,
        /// Its process id, for logs.
        pid: u32,
    },
    /// A data server registering its region.
    DataServer {
        /// How clients reach its region.
        fabric: FabricAddr,
        /// The region holding its chunks.
        region: RegionId,
        /// The region's size in bytes; the meta server divides it into chunks of its chunk size.
        region_bytes: u64,
        /// Which life of the region this is: a server whose region's contents survived since it
        /// last registered (a file-backed region) presents the same incarnation; one whose
        /// memory is new (a memory-only server restarted) presents a new one, and the meta
        /// server marks every chunk it held lost.
        incarnation: u64,
        /// A stable name, so that a restarted data server gets its old id back (and its data).
        name: String,
        /// Its failure domain (`citronfs data-server --zone`), if it names one: the meta server
        /// places the replicas of a chunk in distinct zones where it can (docs/REPLICAS.md).
        zone: Option<String>,
    },
}

/// The first message on a connection: the shared hello, saying who is connecting.
pub type Hello = fabric::handshake::Hello<Role>;

/// What the server welcomes a peer with, by [`Role`]. (One per connection: the size of its
/// larger variant costs nothing worth a box.)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(clippy::large_enum_variant)]
pub enum Welcome {
    /// A client's session is open.
    Client(ClusterInfo),
    /// A data server is registered under this id.
    DataServer {
        /// Its id.
        id: u32,
    },
}

/// The server's answer to a [`Hello`]: like every CitronFS protocol's, a `Result` whose error is
/// the shared [`Refusal`] (after which the server closes the connection).
pub type HelloAnswer = Result<Welcome, Refusal>;

/// How `setxattr` treats an existing attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum XattrMode {
    /// Create or replace.
    Either,
    /// Fail with `Exists` if it exists (`XATTR_CREATE`).
    Create,
    /// Fail with `NoAttr` if it does not (`XATTR_REPLACE`).
    Replace,
}

// The meta server's requests, one row each: the variant of `Request` (the wire type, in this
// order) `=>` its class (`crate::request`: its name, the meta server's handler group, what
// serving it costs, what it changes).
requests! {
    /// Keeps the session alive. A client session is answered `Heartbeat` (with the layout
    /// epoch); a data server's registration connection `Ok`.
    Heartbeat => class("heartbeat", Group::Cluster, Cost::Quick);
    /// The cluster's layout now (data servers, their incarnations and whether they are
    /// connected), for this session. → `Cluster`
    Cluster => class("cluster", Group::Cluster, Cost::Quick);
    /// The entry `name` in directory `parent`. → `Attr`
    Lookup {
        /// Directory.
        parent: Ino,
        /// Name.
        name: String,
    } => class("lookup", Group::Read, Cost::Quick);
    /// An inode's attributes (the size from its file control block if open). → `Attr`
    GetAttr {
        /// Inode.
        ino: Ino,
    } => class("get_attr", Group::Read, Cost::Quick);
    // Depends: a size change may zero a tail after a flush (`Request::is_quick`).
    /// Changes attributes; a size change truncates or extends. → `Attr`
    SetAttr {
        /// Inode.
        ino: Ino,
        /// What to change.
        set: SetAttr,
        /// Who asks.
        caller: Caller,
    } => class("set_attr", Group::File, Cost::Depends).changes_inodes().changes_namespace();
    /// Creates a file, device node, fifo or socket. → `Attr`
    Mknod {
        /// Directory.
        parent: Ino,
        /// Name.
        name: String,
        /// Kind (not `Dir` or `Symlink`).
        kind: FileKind,
        /// Permission bits.
        perm: u16,
        /// Device number.
        rdev: u32,
        /// Owner.
        caller: Caller,
    } => class("mknod", Group::Change, Cost::Quick).changes_inodes().changes_namespace();
    /// Creates a directory. → `Attr`
    Mkdir {
        /// Parent directory.
        parent: Ino,
        /// Name.
        name: String,
        /// Permission bits.
        perm: u16,
        /// Owner.
        caller: Caller,
    } => class("mkdir", Group::Change, Cost::Quick).changes_inodes().changes_namespace();
    /// Creates a symbolic link. → `Attr`
    Symlink {
        /// Directory.
        parent: Ino,
        /// Name.
        name: String,
        /// Target.
        target: String,
        /// Owner.
        caller: Caller,
    } => class("symlink", Group::Change, Cost::Quick).changes_inodes().changes_namespace();
    /// Adds a hard link to `ino`. → `Attr`
    Link {
        /// The existing inode (not a directory).
        ino: Ino,
        /// Directory of the new name.
        new_parent: Ino,
        /// The new name.
        new_name: String,
    } => class("link", Group::Change, Cost::Quick).changes_inodes().changes_namespace();
    /// Removes a non-directory entry. → `Ok`
    Unlink {
        /// Directory.
        parent: Ino,
        /// Name.
        name: String,
    } => class("unlink", Group::Change, Cost::Quick).changes_inodes().changes_namespace();
    /// Removes an empty directory. → `Ok`
    Rmdir {
        /// Parent directory.
        parent: Ino,
        /// Name.
        name: String,
    } => class("rmdir", Group::Change, Cost::Quick).changes_inodes().changes_namespace();
    /// Renames, replacing a compatible target (an empty directory for a directory). → `Ok`
    Rename {
        /// Source directory.
        parent: Ino,
        /// Source name.
        name: String,
        /// Target directory.
        new_parent: Ino,
        /// Target name.
        new_name: String,
        /// Fail with `Exists` rather than replace (`RENAME_NOREPLACE`).
        no_replace: bool,
        /// Swap the two entries, both of which must exist (`RENAME_EXCHANGE`; not with
        /// `no_replace`).
        exchange: bool,
    } => class("rename", Group::Change, Cost::Quick).changes_inodes().changes_namespace();
    /// A symlink's target. → `Data`
    Readlink {
        /// Inode.
        ino: Ino,
    } => class("readlink", Group::Read, Cost::Quick);
    // A page is up to 4,096 entries, each with a getattr for `ReadDirPlus`: milliseconds.
    /// Directory entries after `cookie` (0 = from the start; `.` and `..` included). → `Entries`
    ReadDir {
        /// Directory.
        ino: Ino,
        /// Continue after this cookie.
        cookie: u64,
        /// At most this many.
        max: u32,
    } => class("read_dir", Group::Read, Cost::Slow);
    /// Like `ReadDir`, with each entry's attributes (as `GetAttr` would answer them): what
    /// `readdirplus` needs to list a directory with its attributes in one call. → `EntriesPlus`
    ReadDirPlus {
        /// Directory.
        ino: Ino,
        /// Continue after this cookie.
        cookie: u64,
        /// At most this many.
        max: u32,
    } => class("read_dir_plus", Group::Read, Cost::Slow);
    /// File-system totals. → `Stats`
    Statfs => class("statfs", Group::Cluster, Cost::Quick);
    /// Sets an extended attribute. → `Ok`
    SetXattr {
        /// Inode.
        ino: Ino,
        /// Name.
        name: String,
        /// Value.
        value: Vec<u8>,
        /// Create/replace semantics.
        mode: XattrMode,
    } => class("set_xattr", Group::Change, Cost::Quick).changes_inodes().changes_namespace();
    /// An extended attribute's value. → `Data`
    GetXattr {
        /// Inode.
        ino: Ino,
        /// Name.
        name: String,
    } => class("get_xattr", Group::Read, Cost::Quick);
    /// Extended attribute names. → `Names`
    ListXattr {
        /// Inode.
        ino: Ino,
    } => class("list_xattr", Group::Read, Cost::Quick);
    /// Removes an extended attribute. → `Ok`
    RemoveXattr {
        /// Inode.
        ino: Ino,
        /// Name.
        name: String,
    } => class("remove_xattr", Group::Change, Cost::Quick).changes_inodes().changes_namespace();
    // State in the meta server's memory only, of the session a broken connection ends: what
    // a first try did went with it.
    /// Opens a regular file for I/O with a lock scheme: sets up its file control block and lock
    /// state if this is the first open. → `Open`
    Open {
        /// Inode.
        ino: Ino,
        /// The mount's lock scheme; what it leaves open, the meta server decides. A file has
        /// one lock per scheme name: a later opener gets the lock as the first one's open
        /// created it (the reply says how).
        scheme: lockmgr::LockScheme,
    } => class("open", Group::File, Cost::Quick).changes_inodes();
    /// The client closed its last handle on `ino`; the size is persisted. → `Ok`
    Release {
        /// Inode.
        ino: Ino,
    } => class("release", Group::File, Cost::Quick).changes_inodes().changes_namespace();
    /// Where chunks `first..first+count` of `ino` live (None for holes). → `Chunks`
    ChunkMap {
        /// Inode.
        ino: Ino,
        /// First chunk index.
        first: u64,
        /// Number of chunks.
        count: u64,
    } => class("chunk_map", Group::Chunks, Cost::Quick);
    // Zeroed chunks (counted in the file's `allocated`) from the data servers.
    /// Makes sure chunks `first..first+count` of `ino` exist (allocating zeroed ones for holes)
    /// and returns where they live. → `Chunks` (all `Some`)
    AllocateChunks {
        /// Inode.
        ino: Ino,
        /// The generation the client's view is of; a mismatch gives `Stale`.
        generation: u64,
        /// First chunk index.
        first: u64,
        /// Number of chunks.
        count: u64,
    } => class("allocate_chunks", Group::Chunks, Cost::Slow).changes_inodes().changes_namespace();
    // Waits for the database's flush; persists sizes. Repeats as the same again.
    /// Persists the file's size from its file control block (fsync, close). → `Ok`
    Fsync {
        /// Inode.
        ino: Ino,
    } => class("fsync", Group::File, Cost::Slow).changes_inodes();
    // Memory from the meta region. Once: lock memory lives in the meta region, freed with
    // the open; a second try would allocate again, the first one's words lost until the
    // file's last close.
    /// Allocates `words` zeroed words in the meta region for `ino`'s lock tree (CITRON
    /// scale-up, Algorithm 4 l. 3). → `Addr`
    AllocateLockWords {
        /// Inode whose lock grows.
        ino: Ino,
        /// Words needed.
        words: u64,
    } => class("allocate_lock_words", Group::File, Cost::Slow).once();
    // Waits for other clients' sessions and the fabric servers; the same again when repeated.
    /// Sent by a client right before it breaks a lock whose holder it presumes dead (CITRON
    /// §3.10 recovery): the meta server revokes every session it has not heard from within
    /// `ClusterInfo::fence_after_ms`, on its own fabric server and on every data server, and
    /// answers only once they all refuse those sessions. → `Ok`
    Fence => class("fence", Group::Cluster, Cost::Slow);
    /// Sent by a client waiting behind a lock-tree node whose owner record names `owner` (the
    /// low 48 bits of the holder's session, `lockmgr::Fence::holder_gone`): is that holder out
    /// for good? The meta server answers `Gone(true)` only where its fabric can fence
    /// (tcp) and only once the session can land no verb on any fabric server: it ended (and was
    /// revoked), or — with `stopped` — it has been silent for longer than
    /// `ClusterInfo::fence_after_ms`, and this call revoked it as `Fence` would. → `Gone`
    HolderGone {
        /// The low 48 bits of the holder's session.
        owner: u64,
        /// The node stood still for a whole `T_lease`: a silent holder may be fenced.
        stopped: bool,
    } => class("holder_gone", Group::Cluster, Cost::Slow);
    /// A data server's long poll on its registration connection (it doubles as its heartbeat):
    /// "I apply revocations up to `known`; answer when there are newer ones, or after a second".
    /// → `Revocations`
    AwaitRevocations {
        /// The revocation epoch this data server has applied.
        known: u64,
    } => class("await_revocations", Group::Cluster, Cost::Slow);
    // A whole check, which may repair. Once: an administrator's check (and repairs), not a
    // change a client makes to its files.
    /// Checks the namespace, the chunk allocation and (at rest) the open files' locks for
    /// consistency, repairing what it can when asked (`citronfs fsck`). → `Fsck`
    Fsck(crate::fsck::FsckOptions) => class("fsck", Group::Cluster, Cost::Slow).changes_inodes().once();
    /// Creates a regular file and opens it for I/O in one call (`Mknod` then `Open`, as the
    /// FUSE `create` needs: one round trip instead of two). Fails with `Exists` when the name
    /// is taken, whatever it names. → `Open`
    Create {
        /// Parent directory.
        parent: Ino,
        /// Name.
        name: String,
        /// Permission bits.
        perm: u16,
        /// Owner.
        caller: Caller,
        /// The opener's lock scheme (as in `Open`).
        scheme: lockmgr::LockScheme,
    } => class("create", Group::File, Cost::Quick).changes_inodes().changes_namespace();
    // A scan of the file's chunks, and its generation bumped.
    /// Frees the allocated chunks among chunks `[first, first + count)` of regular file `ino`
    /// — a hole punched over whole chunks: they read zeros afterwards, and their memory goes
    /// back to the data servers — bumping the file's generation when any was, so that every
    /// client drops its cached locations of them. The caller holds the range lock over those
    /// chunks' bytes, and that is what keeps every other I/O off them; the generation is not
    /// checked (a chunk's number is a function of its offsets, whatever the generation).
    /// → `Ok`
    FreeChunks {
        /// Inode.
        ino: Ino,
        /// First chunk index.
        first: u64,
        /// Number of chunks.
        count: u64,
    } => class("free_chunks", Group::Chunks, Cost::Slow).changes_inodes().changes_namespace();
    /// `F_GETLK`: the first record lock of another owner that a lock of `kind` over bytes
    /// `[start, end]` of `ino` would conflict with (`crate::records`).
    /// → `RecordLock(None)` when there is none
    GetLk {
        /// Inode.
        ino: Ino,
        /// The asking lock owner (the kernel's, unique within this client session).
        owner: u64,
        /// First byte.
        start: u64,
        /// Last byte (inclusive).
        end: u64,
        /// The kind of lock the caller would take.
        kind: crate::records::RecordKind,
    } => class("get_lk", Group::File, Cost::Quick);
    // Depends: may wait (up to a second) for another owner's record lock to go. Repeats as
    // `Open` does.
    /// `F_SETLK`/`F_SETLKW`: takes (`claim.kind` set) or gives back (`None`) the claim's
    /// owner's record lock over its bytes of `ino`, with POSIX's rules for an owner's own locks
    /// (a new lock replaces, splits or merges with those it overlaps or touches; an unlock may
    /// split one). A lock that conflicts with another owner's waits up to `wait_ms` for it to
    /// go, then fails with `WouldBlock`; a waiting client calls again (so that a signal
    /// reaches it between calls, and no server thread waits for long).
    /// → `Ok`
    SetLk {
        /// Inode.
        ino: Ino,
        /// The owner, the range, and the lock to take there (or none: unlock).
        claim: crate::records::RecordClaim,
        /// How long to wait for a conflicting lock to go (0: `F_SETLK`, do not wait).
        wait_ms: u32,
        /// A lock this client held before the meta server restarted (or before its session
        /// ended), taken again: granted during the server's grace period after its start,
        /// which holds back every other new lock so that the holders of before take theirs
        /// back first (as NFS's lock manager does after a reboot).
        reclaim: bool,
    } => class("set_lk", Group::File, Cost::Depends);
    // Reads the data servers' records and every session under the state lock: rare, and
    // not worth an async worker's time.
    /// The cluster as the meta server sees it: itself, its data servers, the client sessions
    /// and the open files (`citronfs status`). Reads only; any authenticated session may ask.
    /// → `Status`
    Status => class("status", Group::Cluster, Cost::Slow);

}

/// A successful result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// Done, nothing to return.
    Ok,
    /// Attributes.
    Attr(Attr),
    /// Directory entries.
    Entries(Vec<DirEntry>),
    /// Directory entries with their attributes (`ReadDirPlus`).
    EntriesPlus(Vec<(DirEntry, Attr)>),
    /// Bytes (a symlink target, an xattr value).
    Data(Vec<u8>),
    /// Names (xattrs).
    Names(Vec<String>),
    /// File-system totals.
    Stats(FsStats),
    /// An opened file.
    Open(OpenFile),
    /// Chunk locations: every replica of each chunk that holds its data (`None`: a hole).
    Chunks(Vec<Option<Replicas>>),
    /// An address in the meta region.
    Addr(RemoteAddr),
    /// A client session's heartbeat answer.
    Heartbeat {
        /// The layout epoch ([`crate::ClusterInfo::layout_epoch`]): when it moves, the client
        /// fetches the layout again (`Cluster`).
        layout_epoch: u64,
    },
    /// The cluster's layout (`session` is the asking session's).
    Cluster(Box<crate::ClusterInfo>),
    /// The sessions revoked after the epoch the data server named, up to epoch `epoch`.
    Revocations {
        /// The current epoch (bumped by each fence that revoked something).
        epoch: u64,
        /// The sessions revoked since the epoch asked about.
        sessions: Vec<u64>,
    },
    /// What the consistency checker found and did.
    Fsck(crate::fsck::FsckReport),
    /// A record lock in the way (`GetLk`), or none.
    RecordLock(Option<crate::records::RecordLock>),
    /// The cluster's state (`Status`).
    Status(Box<crate::status::ClusterStatus>),
    /// Whether a lock holder is out for good (`HolderGone`).
    Gone(bool),
}

/// One request on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestFrame {
    /// Echoed in the response.
    pub id: u64,
    /// Files the sender closed since its last call: the server releases each (as `Release`
    /// would, errors logged and ignored) before it runs `request`, in the same frame, so a
    /// close costs the client no round trip of its own (fs-client's lingering opens).
    pub release_first: Vec<Ino>,
    /// The call.
    pub request: Request,
    /// For a change made under a range lock: the lock's lease deadline, in the server's count
    /// of microseconds ([`fabric::clock`], learnt from [`ResponseFrame::clock`]; never later
    /// than the true deadline). The server applies the change only while the deadline is more
    /// than its margin ahead, checked where the change becomes visible, and refuses it
    /// otherwise with [`FsError::Expired`]: past the deadline another client may hold the
    /// range, and a late truncate or punch would undo what it wrote. `None`: no deadline.
    pub expires: Option<u64>,
}

/// One response on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseFrame {
    /// The request's id.
    pub id: u64,
    /// The result.
    pub result: Result<Response, FsError>,
    /// The server's count of microseconds ([`fabric::clock::now_micros`]) when it made this
    /// answer: what a client names [`RequestFrame::expires`] in.
    pub clock: u64,
}

impl ResponseFrame {
    /// The answer `result` to request `id`, stamped with this process's clock.
    pub fn new(id: u64, result: Result<Response, FsError>) -> Self {
        ResponseFrame {
            id,
            result,
            clock: fabric::clock::now_micros(),
        }
    }
}

/// Why a call failed below the file system: the connection, the framing, the encoding.
#[derive(Debug, Error)]
pub enum RpcError {
    /// The connection failed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// A frame was bad.
    #[error("frame: {0}")]
    Frame(#[from] FrameError),
    /// A message did not decode.
    #[error("malformed message: {0}")]
    Decode(#[from] postcard::Error),
    /// The server refused the handshake.
    #[error("refused: {0}")]
    Refused(Refusal),
    /// The server did not prove in the handshake that it holds the cluster's secret (an
    /// impostor, or a server given another token): the client refused it, as final as a
    /// refusal.
    #[error("{0}")]
    ServerUnverified(String),
    /// The peer answered out of protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The meta server is stopping cleanly and closed the connection (it said so: not a
    /// crash); another may take its place. A call that fails so was not executed: a stopping
    /// server answers every request it runs before it says so (`meta_server`'s connections).
    #[error("the meta server closed the connection: it is shutting down")]
    ServerStopping,
    /// A [`SharedClient`] call whose request never reached the server: the connection was
    /// broken already (for this reason), or the frame could not be written whole (a partial
    /// frame is never read as a request). It may be made again on a new connection.
    #[error("{0} (the request was not sent)")]
    NotSent(Box<RpcError>),
}

impl RpcError {
    /// Whether the server may have executed the failed call: not when its request was never
    /// sent ([`RpcError::NotSent`]) or the server said it was stopping
    /// ([`RpcError::ServerStopping`]) before answering it. Any other failure after the request
    /// left (a crash, a cut link, a timeout) leaves its outcome unknown.
    pub fn maybe_executed(&self) -> bool {
        !matches!(self, RpcError::NotSent(_) | RpcError::ServerStopping)
    }

    /// Whether the server went away under the connection — stopped (said so), or closed or
    /// reset it, or the connection was already broken so when the call came — rather than the
    /// link failing (a timeout, an unreachable host): then a new connection is worth trying at
    /// once, as after a restart, where after a cut link it would only wait for it again.
    pub fn server_went_away(&self) -> bool {
        match self {
            RpcError::ServerStopping => true,
            RpcError::NotSent(why) => why.server_went_away(),
            e => matches!(
                e.io_kind(),
                Some(
                    std::io::ErrorKind::UnexpectedEof
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::BrokenPipe
                )
            ),
        }
    }

    /// The kind of the I/O error underneath, the framing's included (a stream that ended
    /// mid-frame is the connection's failure, not the frame's).
    fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            RpcError::Io(e) | RpcError::Frame(FrameError::Io(e)) => Some(e.kind()),
            _ => None,
        }
    }

    /// Whether the server stopped cleanly (said so), whether or not the request was sent.
    pub fn is_server_stopping(&self) -> bool {
        match self {
            RpcError::ServerStopping => true,
            RpcError::NotSent(why) => why.is_server_stopping(),
            _ => false,
        }
    }

    /// Whether the server refused the connection's handshake (wrong token, another cluster),
    /// or the client refused the server's: final, unlike a broken connection.
    pub fn is_refusal(&self) -> bool {
        match self {
            RpcError::Refused(_) | RpcError::ServerUnverified(_) => true,
            RpcError::NotSent(why) => why.is_refusal(),
            _ => false,
        }
    }
}

/// Why a meta server that stops cleanly closes its connections: the reason of the answer to no
/// request (id 0) it sends each of them last, which [`Client::call`] and [`SharedClient`]
/// report as [`RpcError::ServerStopping`].
pub const STOPPING: &str = "the meta server is shutting down";

/// What an answer under id 0 (to no request: the server closes the connection) means.
fn closed_by_server(result: Result<Response, FsError>) -> Broken {
    match result {
        Err(FsError::Unavailable(why)) if why == STOPPING => Broken::Stopping,
        Err(e) => Broken::Closed(format!("the meta server closed the connection: {e}")),
        Ok(_) => {
            Broken::Closed("the meta server closed the connection: an answer to no request".into())
        }
    }
}

impl From<RpcError> for FsError {
    fn from(e: RpcError) -> Self {
        match e {
            RpcError::Refused(why) => FsError::Refused(why.to_string()),
            RpcError::ServerUnverified(why) => FsError::Refused(why),
            other => FsError::Io(format!("meta server: {other}")),
        }
    }
}

/// Writes `message` as one frame.
pub fn send<T: Serialize>(w: &mut impl Write, message: &T) -> Result<(), RpcError> {
    let body = postcard::to_stdvec(message)?;
    write_frame(w, &body)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame and decodes it as a `T`.
pub fn recv<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, RpcError> {
    let mut body = Vec::new();
    read_frame(r, MAX_FRAME, &mut body)?;
    Ok(postcard::from_bytes(&body)?)
}

/// Connects to the first address of `addr` that answers within `timeout` each: a cut link
/// drops the SYN, and a plain `connect` would wait for the kernel's SYN retries (about two
/// minutes) instead.
fn connect_bounded(addr: impl ToSocketAddrs, timeout: Duration) -> std::io::Result<TcpStream> {
    let mut last = None;
    for candidate in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&candidate, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolved to nothing",
        )
    }))
}

/// A blocking connection to the meta server: one call at a time.
pub struct Client {
    reader: BufReader<MetaStream>,
    writer: BufWriter<MetaStream>,
    next_id: u64,
    welcome: Welcome,
}

impl Client {
    /// Connects to `addr` and performs the handshake as `role`, presenting `credentials`.
    pub fn connect(
        addr: impl ToSocketAddrs,
        credentials: &Credentials,
        role: Role,
    ) -> Result<Client, RpcError> {
        let stream = MetaStream::Tcp(connect_bounded(addr, HANDSHAKE_TIMEOUT)?);
        Client::handshake_on(stream, credentials, role)
    }

    /// [`Client::connect`] over the meta server's Unix socket at `path`, on its host
    /// ([`ClusterInfo::local_rpc`]).
    pub fn connect_local(
        path: &Path,
        credentials: &Credentials,
        role: Role,
    ) -> Result<Client, RpcError> {
        let stream = MetaStream::Local(crate::stream::connect_local(path, HANDSHAKE_TIMEOUT)?);
        Client::handshake_on(stream, credentials, role)
    }

    /// The handshake as `role` on a connected `stream`.
    fn handshake_on(
        mut stream: MetaStream,
        credentials: &Credentials,
        role: Role,
    ) -> Result<Client, RpcError> {
        stream.set_nodelay()?;
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let hello = Hello::new(Protocol::Rpc, credentials, 0, role);
        let welcome: Welcome =
            handshake::client_handshake(&mut stream, &hello, credentials, MAX_FRAME).map_err(
                |e| match e {
                    HandshakeError::Refused(refusal) => RpcError::Refused(refusal),
                    e @ HandshakeError::ServerUnverified { .. } => {
                        RpcError::ServerUnverified(e.to_string())
                    }
                    // A read that timed out reads as EAGAIN ("Resource temporarily unavailable"),
                    // which tells a user nothing: say what happened.
                    HandshakeError::Frame(FrameError::Io(e))
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                    {
                        RpcError::Io(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!(
                                "no answer to the handshake within {HANDSHAKE_TIMEOUT:?} (is it a \
                             CitronFS meta server, and is it running?)"
                            ),
                        ))
                    }
                    HandshakeError::Frame(e) => RpcError::Frame(e),
                    HandshakeError::Decode(e) => RpcError::Decode(e),
                },
            )?;
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        let client = Client {
            reader: BufReader::new(stream.try_clone()?),
            writer: BufWriter::new(stream),
            next_id: 1,
            welcome,
        };
        Ok(client)
    }

    /// What the server answered to the handshake.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// Sets a timeout for each response, and for sending each request (None: wait as long as
    /// it takes). After a timeout the connection may be mid-frame: drop it.
    pub fn set_timeout(&self, timeout: Option<Duration>) -> Result<(), RpcError> {
        self.reader.get_ref().set_read_timeout(timeout)?;
        self.writer.get_ref().set_write_timeout(timeout)?;
        Ok(())
    }

    /// Makes one call and waits for its result.
    pub fn call(&mut self, request: Request) -> Result<Result<Response, FsError>, RpcError> {
        let id = self.next_id;
        self.next_id += 1;
        send(
            &mut self.writer,
            &RequestFrame {
                id,
                release_first: Vec::new(),
                request,
                expires: None,
            },
        )?;
        let response: ResponseFrame = recv(&mut self.reader)?;
        if response.id == 0 {
            // The server refused the connection's input (a frame over the limit, a malformed
            // request) or is stopping, and closes it; no request has id 0.
            return Err(closed_by_server(response.result).error());
        }
        if response.id != id {
            return Err(RpcError::Protocol(format!(
                "response {} to request {id}",
                response.id
            )));
        }
        Ok(response.result)
    }
}

/// Why a [`SharedClient`]'s connection broke, kept for every call that finds it broken.
#[derive(Clone, Debug)]
enum Broken {
    /// The server answered under id 0: it refused the connection's input and closed it.
    Closed(String),
    /// The server answered under id 0 that it is stopping cleanly.
    Stopping,
    /// Reading, writing or decoding failed, or a call timed out (the stream may be mid-frame).
    Failed(std::io::ErrorKind, String),
}

impl Broken {
    /// A read or write of the stream failed with `e`. The kind of an I/O failure is kept,
    /// the framing's included: a server that died (a crash: the stream ends mid-read, or is
    /// reset) must read as gone ([`RpcError::server_went_away`]), so that the calls behind it
    /// reconnect. Kept only from a direct I/O error, a crash of the meta server failed the
    /// first call of each client after it (`tests/fence.rs`).
    fn failed(e: &RpcError) -> Broken {
        let kind = e.io_kind().unwrap_or(std::io::ErrorKind::InvalidData);
        Broken::Failed(kind, e.to_string())
    }

    /// A call waited `t` for its answer in vain.
    fn timed_out(t: Duration) -> Broken {
        Broken::Failed(
            std::io::ErrorKind::TimedOut,
            format!("no answer within {t:?}"),
        )
    }

    fn error(&self) -> RpcError {
        match self {
            Broken::Closed(why) => RpcError::Protocol(why.clone()),
            Broken::Stopping => RpcError::ServerStopping,
            Broken::Failed(kind, why) => RpcError::Io(std::io::Error::new(*kind, why.clone())),
        }
    }
}

/// A call of a [`SharedClient`] waiting for its answer.
struct Waiting {
    /// The calling thread, unparked when its answer has been read by another caller, or when
    /// it should take over reading.
    thread: std::thread::Thread,
    /// Its answer, once another caller has read it.
    answer: Option<Result<Response, FsError>>,
}

/// The calls of a [`SharedClient`] waiting for their answers, whether one of them is reading
/// the stream, or why the connection broke.
#[derive(Default)]
struct MuxState {
    waiting: std::collections::HashMap<u64, Waiting>,
    /// A caller is reading the stream (it holds `SharedClient::reader`).
    reading: bool,
    broken: Option<Broken>,
    /// A send found the server gone (the connection was reset or closed under it): no call
    /// is sent any more, but what the server sent before going is still read — answers, and
    /// the goodbye of a clean stop, which tells the calls waiting that their requests never
    /// ran — until the stream ends (which then breaks the connection).
    unsendable: Option<Broken>,
    /// What the answers told of the server's clock (`None` before the first).
    clock: Option<fabric::clock::PeerClock>,
}

impl MuxState {
    /// Marks the connection broken and wakes every waiting call, which then fails.
    fn break_with(&mut self, why: Broken) {
        if self.broken.is_none() {
            self.broken = Some(why);
        }
        for w in self.waiting.values() {
            w.thread.unpark();
        }
    }

    /// Wakes one waiting call to read the stream, when calls wait and nobody reads.
    fn hand_over_reading(&self) {
        if !self.reading {
            if let Some(w) = self.waiting.values().find(|w| w.answer.is_none()) {
                w.thread.unpark();
            }
        }
    }
}

/// A connection to the meta server shared by many threads: each thread's call is sent at once
/// and waits for the answer under its own id, so calls of different threads are in flight
/// together (the server runs a connection's requests concurrently and answers them as they
/// finish). There is no reader thread: one waiting caller at a time reads the stream, keeps its
/// own answer and hands the others' to their callers (leader/follower), so a call alone on the
/// connection is woken straight by its answer's arrival — one thread wake-up per call on this
/// side instead of two. Once the connection breaks — an I/O or decoding error, the server
/// closing it, a call timing out — every waiting and later call fails; the owner connects
/// again.
///
/// Invariants: `reading` is set exactly while one caller holds `reader`; every call in
/// `waiting` without an answer is either the reader or will be unparked when its answer
/// arrives, when the reader leaves (`hand_over_reading`), or when the connection breaks.
pub struct SharedClient {
    stream: MetaStream,
    writer: std::sync::Mutex<BufWriter<MetaStream>>,
    reader: std::sync::Mutex<BufReader<MetaStream>>,
    state: std::sync::Mutex<MuxState>,
    next_id: std::sync::atomic::AtomicU64,
    timeout: Option<Duration>,
    welcome: Welcome,
}

/// How long the caller reading a [`SharedClient`]'s stream polls it before it sleeps in the
/// read, on a machine with cores to spare ([`spin_budget`]).
const SPIN: Duration = Duration::from_micros(30);

/// [`SPIN`] on a machine of at least 4 CPUs, nothing on a smaller one ([`poll_budget`]). A
/// reader that sleeps in `read` is woken by the answer's arrival: on a virtual machine that
/// wake-up of an idle CPU costs several microseconds of a metadata call's 25–30 µs (16-core
/// machine, `bench meta`'s `rpc` row). Polling first keeps the CPU awake for the usual answer.
///
/// Settled once per process, by the first connection made ([`SharedClient::over`]): the CPU
/// count comes from `available_parallelism`, which follows the *calling thread's* affinity, and
/// a FUSE ring thread is pinned to one CPU. Settled there, by a thread of the mount's start, a
/// call first made on a ring thread cannot turn the poll off for the whole process.
fn spin_budget() -> Duration {
    static BUDGET: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| poll_budget(SPIN))
}

/// `budget` on a machine of at least 4 CPUs, nothing on a smaller one: how long either end of
/// an RPC connection may watch its socket without sleeping, waiting for the other's bytes. On
/// 2 CPUs the watch takes the CPU that the other end needs to compute what it waits for, so
/// it is off there. The client watches before it reads an answer; the meta server after an
/// answer, for the connection's next request (`meta_server::MetaConfig::idle_poll`).
pub fn poll_budget(budget: Duration) -> Duration {
    match std::thread::available_parallelism() {
        Ok(n) if n.get() >= 4 => budget,
        _ => Duration::ZERO,
    }
}

/// Polls `stream` for up to `budget` without sleeping, until it has bytes to read: `true` when
/// they came (or the stream ended or failed, which the read that follows sees at once),
/// `false` when the budget ran out first. Nothing is consumed (`MSG_PEEK`).
fn poll_readable(stream: &impl AsFd, budget: Duration) -> bool {
    use std::os::fd::AsRawFd;
    if budget.is_zero() {
        return false;
    }
    let start = std::time::Instant::now();
    let mut byte = 0u8;
    loop {
        // SAFETY: the descriptor is the stream's, open while `stream` is borrowed; the buffer
        // is one byte of our own.
        let n = unsafe {
            libc::recv(
                stream.as_fd().as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return true;
        }
        let kind = std::io::Error::last_os_error().kind();
        if !matches!(
            kind,
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
        ) {
            return true;
        }
        if start.elapsed() >= budget {
            return false;
        }
        std::hint::spin_loop();
    }
}

fn lock_ignoring_poison<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl SharedClient {
    /// Connects to `addr` and performs the handshake as `role`; each call then waits at most
    /// `timeout` for its answer (None: as long as it takes).
    pub fn connect(
        addr: impl ToSocketAddrs,
        credentials: &Credentials,
        role: Role,
        timeout: Option<Duration>,
    ) -> Result<SharedClient, RpcError> {
        SharedClient::over(Client::connect(addr, credentials, role)?, timeout)
    }

    /// [`SharedClient::connect`] over the meta server's Unix socket at `path`, on its host
    /// ([`ClusterInfo::local_rpc`]).
    pub fn connect_local(
        path: &Path,
        credentials: &Credentials,
        role: Role,
        timeout: Option<Duration>,
    ) -> Result<SharedClient, RpcError> {
        SharedClient::over(Client::connect_local(path, credentials, role)?, timeout)
    }

    /// The connection of `client`, whose handshake is done, shared. Settles [`spin_budget`]
    /// on this thread if no connection did before.
    fn over(client: Client, timeout: Option<Duration>) -> Result<SharedClient, RpcError> {
        spin_budget();
        let Client {
            reader, welcome, ..
        } = client;
        let stream = reader.get_ref().try_clone()?;
        stream.set_write_timeout(timeout)?;
        Ok(SharedClient {
            writer: std::sync::Mutex::new(BufWriter::new(stream.try_clone()?)),
            reader: std::sync::Mutex::new(reader),
            stream,
            state: std::sync::Mutex::new(MuxState::default()),
            next_id: std::sync::atomic::AtomicU64::new(1),
            timeout,
            welcome,
        })
    }

    /// What the server answered to the handshake.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// Whether the connection runs over the meta server's Unix socket (on its host).
    pub fn is_local(&self) -> bool {
        self.stream.is_local()
    }

    /// Whether the connection broke (every call on it fails), or can send no more.
    pub fn is_broken(&self) -> bool {
        let st = lock_ignoring_poison(&self.state);
        st.broken.is_some() || st.unsendable.is_some()
    }

    /// What the answers told of the server's clock, if an answer came within
    /// [`fabric::clock::RESYNC_AFTER`].
    fn server_clock(&self) -> Option<fabric::clock::PeerClock> {
        let now = std::time::Instant::now();
        lock_ignoring_poison(&self.state)
            .clock
            .filter(|c| !c.is_stale(now))
            .map(|c| c.at(now))
    }

    /// Makes one call and waits for its result; other threads' calls proceed meanwhile.
    pub fn call(&self, request: Request) -> Result<Result<Response, FsError>, RpcError> {
        self.call_releasing(Vec::new(), request)
    }

    /// Makes one call, with releases of `release_first` riding ahead of it in its frame
    /// ([`RequestFrame::release_first`]), and waits for its result.
    pub fn call_releasing(
        &self,
        release_first: Vec<Ino>,
        request: Request,
    ) -> Result<Result<Response, FsError>, RpcError> {
        self.call_by(release_first, request, None)
    }

    /// [`SharedClient::call_releasing`] for a change made under a range lock whose lease ends at
    /// `expires` (this process's clock): the request carries it in the server's clock
    /// ([`RequestFrame::expires`]), and the server refuses the change past it
    /// ([`FsError::Expired`]). When no answer has told the server's clock lately
    /// ([`fabric::clock::RESYNC_AFTER`]: an idle connection) a heartbeat learns it first.
    pub fn call_by(
        &self,
        release_first: Vec<Ino>,
        request: Request,
        expires: Option<std::time::Instant>,
    ) -> Result<Result<Response, FsError>, RpcError> {
        let expires = match expires {
            None => None,
            Some(at) => Some(match self.server_clock() {
                Some(clock) => clock.to_peer(at),
                None => {
                    if let Err(e) = self.call_by(Vec::new(), Request::Heartbeat, None)? {
                        return Ok(Err(e));
                    }
                    // Just answered: known now, unless the connection broke (the call below
                    // then fails the same way) or the server sent no usable clock.
                    match self.server_clock() {
                        Some(clock) => clock.to_peer(at),
                        None => 0,
                    }
                }
            }),
        };
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let deadline = self.timeout.map(|t| std::time::Instant::now() + t);
        {
            let mut st = lock_ignoring_poison(&self.state);
            if let Some(why) = st.broken.as_ref().or(st.unsendable.as_ref()) {
                return Err(RpcError::NotSent(Box::new(why.error())));
            }
            st.waiting.insert(
                id,
                Waiting {
                    thread: std::thread::current(),
                    answer: None,
                },
            );
        }
        let sent = {
            let mut w = lock_ignoring_poison(&self.writer);
            send(
                &mut *w,
                &RequestFrame {
                    id,
                    release_first,
                    request,
                    expires,
                },
            )
        };
        if let Err(e) = sent {
            // A partly written frame leaves the stream unusable for sending (and is never
            // taken for a request: the server reads whole frames only).
            let peer_gone = matches!(&e, RpcError::Io(io) if matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ));
            if peer_gone {
                // What the server sent before it went is still read by the calls waiting.
                let mut st = lock_ignoring_poison(&self.state);
                st.unsendable.get_or_insert(Broken::failed(&e));
                st.waiting.remove(&id);
                st.hand_over_reading();
            } else {
                self.fail(Broken::failed(&e));
                lock_ignoring_poison(&self.state).waiting.remove(&id);
            }
            return Err(RpcError::NotSent(Box::new(e)));
        }
        let outcome = self.wait_for(id, deadline);
        let mut st = lock_ignoring_poison(&self.state);
        st.waiting.remove(&id);
        // Leaving: if others wait and nobody reads, one of them must.
        st.hand_over_reading();
        drop(st);
        outcome
    }

    /// Waits for call `id`'s answer until `deadline`, reading the stream while nobody else
    /// does.
    fn wait_for(
        &self,
        id: u64,
        deadline: Option<std::time::Instant>,
    ) -> Result<Result<Response, FsError>, RpcError> {
        let timed_out = || Broken::timed_out(self.timeout.unwrap_or_default());
        loop {
            let mut st = lock_ignoring_poison(&self.state);
            if let Some(answer) = st.waiting.get_mut(&id).and_then(|w| w.answer.take()) {
                return Ok(answer);
            }
            if let Some(why) = &st.broken {
                return Err(why.error());
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(std::time::Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => {
                        // Its answer may still come, mid-frame or late: the connection is
                        // not reused.
                        let why = timed_out();
                        let error = why.error();
                        self.break_locked(st, why);
                        return Err(error);
                    }
                },
                None => None,
            };
            if st.reading {
                drop(st);
                match left {
                    Some(left) => std::thread::park_timeout(left),
                    None => std::thread::park(),
                }
                continue;
            }
            st.reading = true;
            drop(st);
            let read = {
                let mut reader = lock_ignoring_poison(&self.reader);
                if reader.buffer().is_empty() {
                    // Awake for the usual quick answer ([`spin_budget`]); the read below
                    // takes it, or sleeps for a slow one.
                    let budget = left.map_or(spin_budget(), |left| left.min(spin_budget()));
                    poll_readable(reader.get_ref(), budget);
                }
                // The reader's own deadline bounds the read: nothing arriving by then means
                // its call timed out (a timeout mid-frame leaves the stream unusable, and the
                // connection is failed below either way).
                match reader.get_ref().set_read_timeout(left) {
                    Ok(()) => recv::<ResponseFrame>(&mut *reader),
                    Err(e) => Err(RpcError::Io(e)),
                }
            };
            let received = std::time::Instant::now();
            let mut st = lock_ignoring_poison(&self.state);
            st.reading = false;
            if let Ok(frame) = &read {
                match &mut st.clock {
                    Some(clock) => clock.answer(frame.clock, received),
                    None => {
                        st.clock =
                            Some(fabric::clock::PeerClock::from_answer(frame.clock, received))
                    }
                }
            }
            match read {
                Ok(frame) if frame.id == 0 => st.break_with(closed_by_server(frame.result)),
                Ok(frame) if frame.id == id => return Ok(frame.result),
                Ok(frame) => {
                    // None: its caller timed out and broke the connection already.
                    if let Some(w) = st.waiting.get_mut(&frame.id) {
                        w.answer = Some(frame.result);
                        w.thread.unpark();
                    }
                }
                Err(e) => {
                    // SO_RCVTIMEO expiring reads as WouldBlock: the reader's own call timed out.
                    let why = match &e {
                        RpcError::Io(io)
                            if matches!(
                                io.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) =>
                        {
                            timed_out()
                        }
                        _ => Broken::failed(&e),
                    };
                    // Broken before the state lock is let go: no caller may take over
                    // reading a stream that may be mid-frame.
                    self.break_locked(st, why);
                }
            }
        }
    }

    /// Breaks the connection: fails every waiting call and closes the stream, which ends the
    /// read in progress, if any.
    fn fail(&self, why: Broken) {
        self.break_locked(lock_ignoring_poison(&self.state), why);
    }

    /// [`SharedClient::fail`] with the state lock already held: the connection is broken
    /// before the lock is let go, then the stream is closed.
    fn break_locked(&self, mut st: std::sync::MutexGuard<'_, MuxState>, why: Broken) {
        st.break_with(why);
        drop(st);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for SharedClient {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Checks one path component: not empty, not `.` or `..`, no `/` or NUL, at most
/// [`NAME_MAX`] bytes. A bad name is `Invalid` whatever the call; [`check_name_for`] gives the
/// errno Linux gives for the call at hand.
pub fn check_name(name: &str) -> Result<(), FsError> {
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
        return Err(FsError::Invalid(format!("bad file name {name:?}")));
    }
    Ok(())
}

/// The call a new or removed name is given to, for [`check_name_for`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameOp {
    /// `mkdir`, `mknod`, `symlink`, `open(O_CREAT)`, and the new name of `link`.
    Create,
    /// `unlink`.
    Unlink,
    /// `rmdir`.
    Rmdir,
    /// The old name of `rename`.
    RenameFrom,
    /// The new name of `rename` (`no_replace`: `RENAME_NOREPLACE` was asked).
    RenameTo {
        /// `RENAME_NOREPLACE`.
        no_replace: bool,
    },
}

/// Checks one path component given to `op`, answering what Linux answers for the same call on
/// tmpfs (checked there, see docs/RELIABILITY.md) when the name is one it never lets through
/// to a file system:
///
/// | name | Create | Unlink | Rmdir | RenameFrom | RenameTo | RenameTo no_replace |
/// | --- | --- | --- | --- | --- | --- | --- |
/// | `.` | EEXIST | EISDIR | EINVAL | EBUSY | EBUSY | EEXIST |
/// | `..` | EEXIST | EISDIR | ENOTEMPTY | EBUSY | EBUSY | EEXIST |
/// | empty | ENOENT | ENOENT | ENOENT | ENOENT | ENOENT | ENOENT |
///
/// A name containing `/` or NUL cannot reach a file system through the kernel at all (it
/// splits or ends the path), so there is no Linux answer to copy: it is `Invalid` (EINVAL).
/// Longer than [`NAME_MAX`] bytes: `NameTooLong`. Linux resolves the parent directory before it
/// looks at the last name, so callers that can check the parent first should (the meta server
/// does).
pub fn check_name_for(op: NameOp, name: &str) -> Result<(), FsError> {
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    if name.is_empty() {
        return Err(FsError::NotFound);
    }
    if name.contains(['/', '\0']) {
        return Err(FsError::Invalid(format!(
            "file name {name:?} contains '/' or NUL"
        )));
    }
    let dot = name == ".";
    if !dot && name != ".." {
        return Ok(());
    }
    Err(match op {
        NameOp::Create => FsError::Exists,
        NameOp::Unlink => FsError::IsDir,
        NameOp::Rmdir if dot => FsError::Invalid("cannot remove '.'".into()),
        NameOp::Rmdir => FsError::NotEmpty,
        NameOp::RenameFrom => FsError::Busy,
        NameOp::RenameTo { no_replace: true } => FsError::Exists,
        NameOp::RenameTo { no_replace: false } => FsError::Busy,
    })
}

/// Whether `name` is `.` or `..`.
pub fn is_dot(name: &str) -> bool {
    name == "." || name == ".."
}

#[cfg(test)]
mod tests {

    /// A stream that ended or was reset is the server gone, whether the framing or the
    /// connection met it, and whether the caller read it itself or from the broken state; a
    /// timeout, or a frame the peer got wrong, is not.
    #[test]
    fn a_stream_that_ended_is_the_server_gone_at_every_layer() {
        use std::io::{Error as IoError, ErrorKind};
        let eof = || IoError::new(ErrorKind::UnexpectedEof, "ended");
        let gone = [
            RpcError::Io(eof()),
            RpcError::Frame(FrameError::Io(eof())),
            RpcError::Frame(FrameError::Io(IoError::from(ErrorKind::ConnectionReset))),
            Broken::failed(&RpcError::Frame(FrameError::Io(eof()))).error(),
            RpcError::ServerStopping,
        ];
        for e in &gone {
            assert!(e.server_went_away(), "{e:?}");
        }
        let not = [
            RpcError::Io(IoError::from(ErrorKind::TimedOut)),
            RpcError::Frame(FrameError::TooLarge { len: 9, max: 8 }),
            Broken::timed_out(Duration::from_secs(1)).error(),
        ];
        for e in &not {
            assert!(!e.server_went_away(), "{e:?}");
        }
    }
    use super::*;

    /// The poll before a read: it waits out its budget while nothing comes, returns as soon as
    /// bytes (or the end of the stream) are there, and consumes nothing.
    #[test]
    fn polling_a_stream_sees_bytes_and_its_end_and_consumes_nothing() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let budget = Duration::from_millis(20);
        let start = std::time::Instant::now();
        assert!(!poll_readable(&client, budget), "nothing was sent");
        assert!(start.elapsed() >= budget);
        assert!(!poll_readable(&client, Duration::ZERO));
        server.write_all(b"hi").unwrap();
        assert!(poll_readable(&client, Duration::from_secs(10)));
        let mut got = [0u8; 2];
        (&client).read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi", "the poll consumed bytes");
        drop(server);
        assert!(
            poll_readable(&client, Duration::from_secs(10)),
            "the end of the stream"
        );
    }

    #[test]
    fn messages_round_trip() {
        let frame = RequestFrame {
            id: 7,
            release_first: vec![3, 9],
            request: Request::Rename {
                parent: 1,
                name: "a".into(),
                new_parent: 2,
                new_name: "b".into(),
                no_replace: true,
                exchange: false,
            },
            expires: Some(12_345_678),
        };
        let mut wire = Vec::new();
        send(&mut wire, &frame).unwrap();
        let back: RequestFrame = recv(&mut &wire[..]).unwrap();
        assert_eq!(back, frame);

        let resp = ResponseFrame::new(7, Err(FsError::NotEmpty));
        let mut wire = Vec::new();
        send(&mut wire, &resp).unwrap();
        assert_eq!(recv::<ResponseFrame>(&mut &wire[..]).unwrap(), resp);
    }

    #[test]
    fn names() {
        assert!(check_name("ok.txt").is_ok());
        assert_eq!(check_name(&"x".repeat(256)), Err(FsError::NameTooLong));
        assert!(check_name(&"x".repeat(255)).is_ok());
        for bad in ["", ".", "..", "a/b", "a\0b"] {
            assert!(
                matches!(check_name(bad), Err(FsError::Invalid(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn names_per_call() {
        use NameOp::*;
        let errno = |op, name| check_name_for(op, name).unwrap_err().errno();
        for ok in ["a", "...", ".a", "a."] {
            for op in [
                Create,
                Unlink,
                Rmdir,
                RenameFrom,
                RenameTo { no_replace: true },
            ] {
                assert!(check_name_for(op, ok).is_ok(), "{op:?} {ok:?}");
            }
        }
        assert_eq!(errno(Create, "."), libc::EEXIST);
        assert_eq!(errno(Create, ".."), libc::EEXIST);
        assert_eq!(errno(Unlink, "."), libc::EISDIR);
        assert_eq!(errno(Unlink, ".."), libc::EISDIR);
        assert_eq!(errno(Rmdir, "."), libc::EINVAL);
        assert_eq!(errno(Rmdir, ".."), libc::ENOTEMPTY);
        assert_eq!(errno(RenameFrom, ".."), libc::EBUSY);
        assert_eq!(errno(RenameTo { no_replace: false }, "."), libc::EBUSY);
        assert_eq!(errno(RenameTo { no_replace: true }, "."), libc::EEXIST);
        assert_eq!(errno(Create, ""), libc::ENOENT);
        assert_eq!(errno(Rmdir, "a/b"), libc::EINVAL);
        assert_eq!(errno(Unlink, "a\0"), libc::EINVAL);
        assert_eq!(errno(Create, &"x".repeat(256)), libc::ENAMETOOLONG);
    }

    #[test]
    fn errnos() {
        assert_eq!(FsError::NotFound.errno(), libc::ENOENT);
        assert_eq!(FsError::NoSpace.errno(), libc::ENOSPC);
        assert_eq!(
            std::io::Error::from(FsError::NotEmpty).raw_os_error(),
            Some(libc::ENOTEMPTY)
        );
    }
}
