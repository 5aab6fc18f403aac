//! Inodes, attributes, directory entries and server descriptors.

use fabric::{RegionId, RemoteAddr};
use lockmgr::LockRef;
use serde::{Deserialize, Serialize};

/// An inode number. The root directory is [`ROOT_INO`]; 0 is never an inode.
pub type Ino = u64;

/// The root directory's inode number.
pub const ROOT_INO: Ino = 1;

/// The longest file name (one path component) in bytes, as in Linux.
pub const NAME_MAX: usize = 255;

/// The longest symbolic-link target in bytes.
pub const SYMLINK_MAX: usize = 4095;

/// The longest extended-attribute name in bytes, and the largest value.
pub const XATTR_NAME_MAX: usize = 255;
/// The largest extended-attribute value in bytes.
pub const XATTR_VALUE_MAX: usize = 64 << 10;

/// What kind of object an inode is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// A named pipe.
    Fifo,
    /// A character device.
    CharDevice,
    /// A block device.
    BlockDevice,
    /// A Unix socket.
    Socket,
}

impl FileKind {
    /// The kind encoded in the `S_IFMT` bits of a mode.
    pub fn from_mode(mode: u32) -> Option<FileKind> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG => FileKind::File,
            libc::S_IFDIR => FileKind::Dir,
            libc::S_IFLNK => FileKind::Symlink,
            libc::S_IFIFO => FileKind::Fifo,
            libc::S_IFCHR => FileKind::CharDevice,
            libc::S_IFBLK => FileKind::BlockDevice,
            libc::S_IFSOCK => FileKind::Socket,
            _ => return None,
        })
    }

    /// The `S_IFMT` bits of this kind.
    pub fn mode_bits(self) -> u32 {
        match self {
            FileKind::File => libc::S_IFREG,
            FileKind::Dir => libc::S_IFDIR,
            FileKind::Symlink => libc::S_IFLNK,
            FileKind::Fifo => libc::S_IFIFO,
            FileKind::CharDevice => libc::S_IFCHR,
            FileKind::BlockDevice => libc::S_IFBLK,
            FileKind::Socket => libc::S_IFSOCK,
        }
    }
}

/// A point in time: seconds and nanoseconds since the Unix epoch.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Timestamp {
    /// Seconds since the epoch (negative before it).
    pub secs: i64,
    /// Nanoseconds within the second, `< 1_000_000_000`.
    pub nanos: u32,
}

impl Timestamp {
    /// The current wall-clock time.
    pub fn now() -> Timestamp {
        let d = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Timestamp {
            secs: d.as_secs() as i64,
            nanos: d.subsec_nanos(),
        }
    }

    /// The time `nanos` nanoseconds after the epoch.
    pub fn from_nanos(nanos: u64) -> Timestamp {
        Timestamp {
            secs: (nanos / 1_000_000_000) as i64,
            nanos: (nanos % 1_000_000_000) as u32,
        }
    }

    /// Nanoseconds since the epoch; 0 for a time before it, saturating far after it (a file
    /// control block's MTIME word, `crate::fcb`).
    pub fn as_nanos(self) -> u64 {
        if self.secs < 0 {
            return 0;
        }
        (self.secs as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(u64::from(self.nanos))
    }
}

/// An inode's attributes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    /// Inode number.
    pub ino: Ino,
    /// Object kind.
    pub kind: FileKind,
    /// Permission bits (`0o7777`: rwx for user, group, other, plus setuid, setgid, sticky).
    pub perm: u16,
    /// Hard links.
    pub nlink: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Device number, for device nodes.
    pub rdev: u32,
    /// Size in bytes (for a symlink, the target's length).
    pub size: u64,
    /// Last access.
    pub atime: Timestamp,
    /// Last data change.
    pub mtime: Timestamp,
    /// Last status change.
    pub ctime: Timestamp,
    /// Creation.
    pub crtime: Timestamp,
    /// Bumped when the file's data layout is invalidated (truncate to a shorter size, unlink of
    /// the last link, a hole punched over whole chunks): clients drop cached chunk maps of
    /// older generations.
    pub generation: u64,
    /// Bytes of the chunks the file holds: the memory its data takes on the data servers, what
    /// `st_blocks` counts (in 512-byte blocks). Holes take none, and the first chunks of a file
    /// are small ([`crate::layout`]). 0 for anything but a regular file.
    pub allocated: u64,
}

/// A time to set: a given time or "now" (as the server sees it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SetTime {
    /// This time.
    At(Timestamp),
    /// The server's current time.
    Now,
}

/// Which attributes a `setattr` changes; `None` leaves one alone.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetAttr {
    /// New permission bits.
    pub perm: Option<u16>,
    /// New owner.
    pub uid: Option<u32>,
    /// New group.
    pub gid: Option<u32>,
    /// New size (truncate or extend with zeros).
    pub size: Option<u64>,
    /// New access time.
    pub atime: Option<SetTime>,
    /// New modification time.
    pub mtime: Option<SetTime>,
    /// Clear the set-user-ID bit, and the set-group-ID bit when group-execute is set
    /// ([`crate::fcb::setid_to_clear`]), of a regular file: a write or truncate by a caller
    /// without `CAP_FSETID` (FUSE's `FUSE_WRITE_KILL_SUIDGID`). Any caller may ask; it changes
    /// ctime only when a bit was set.
    pub kill_suidgid: bool,
}

/// Who asks: the caller's credentials, for permission checks and new objects' owners.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Caller {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

/// One directory entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// The entry's inode.
    pub ino: Ino,
    /// Its kind.
    pub kind: FileKind,
    /// Its name.
    pub name: String,
    /// The cookie to pass to continue listing after this entry.
    pub cookie: u64,
}

/// File-system totals, for `statfs`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsStats {
    /// The block size reported: the layout's smallest chunk
    /// ([`crate::layout::Layout::unit`]), the unit every allocation is a power-of-two multiple of.
    pub block_size: u64,
    /// Blocks in all data servers' regions (registered ones, connected or not).
    pub total_blocks: u64,
    /// Blocks in no file (free, never used, or freed and still to be zeroed).
    pub free_blocks: u64,
    /// Inodes in use.
    pub inodes: u64,
    /// How many more inodes can be created: every file holding data takes at least one block,
    /// so this is `free_blocks` (files without data cost no block and are not limited by it).
    pub free_inodes: u64,
}

/// How to reach a server's registered regions: the fabric's own address type.
pub use fabric::FabricAddr;

/// The region of a data server that holds one word: its incarnation
/// ([`DataServerInfo::incarnation`]), written at start. Clients read it in the same batch as
/// their data verbs, after them, and discard the batch's outcome when it is not the
/// incarnation they know: their view of the server is older than the memory they reached.
pub const INCARNATION_REGION: RegionId = RegionId(2);

/// A data server as clients see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataServerInfo {
    /// Its id, dense from 0.
    pub id: u32,
    /// How to reach its region.
    pub fabric: FabricAddr,
    /// The region holding its chunks.
    pub region: RegionId,
    /// Chunks it holds (its region is `chunks · chunk_size` bytes).
    pub chunks: u64,
    /// The life of its region it registered with last (see `Role::DataServer`): clients
    /// compare it to tell a restarted server whose memory is new from the one they knew.
    pub incarnation: u64,
    /// Whether it is registered now (its registration connection is open). A client's I/O on
    /// a server that is not waits a bounded time for it, then fails with EIO.
    pub live: bool,
}

/// Where one chunk of a file lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChunkLoc {
    /// The data server.
    pub server: u32,
    /// Where the chunk starts in that server's region, in units of
    /// [`crate::layout::Layout::unit`] (its byte offset is `index · unit`); its length is the
    /// layout's for its chunk index in the file.
    pub index: u64,
}

/// What a client learns when it opens a session: how the cluster is laid out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterInfo {
    /// The session id; heartbeats and session-bound state use it.
    pub session: u64,
    /// How to reach the meta server's region (file control blocks and lock trees).
    pub meta_fabric: FabricAddr,
    /// The meta server's region.
    pub meta_region: RegionId,
    /// The data servers.
    pub data_servers: Vec<DataServerInfo>,
    /// Bytes per chunk (a power of two).
    pub chunk_size: u64,
    /// Bytes per lock unit (a power of two).
    pub lock_unit: u64,
    /// The lease a session must renew within (heartbeat every third of it).
    pub session_lease_ms: u64,
    /// A session silent for longer than this is revoked (fenced) when another client breaks a
    /// lock it may hold ([`Request::Fence`](crate::rpc::Request::Fence)); clients heartbeat at
    /// a quarter of it.
    pub fence_after_ms: u64,
    /// Where the `server` lock scheme's lock server listens (`host:port`), if it runs.
    pub lock_server: Option<String>,
    /// Moves whenever the data servers' layout changes (one registers, comes back with a new
    /// address or incarnation, or goes away); heartbeats carry it, so clients learn of a
    /// change within a heartbeat period and fetch the layout again.
    pub layout_epoch: u64,
    /// The attribute table in the meta region, read one-sidedly by `getattr`
    /// ([`crate::attrs`]); `None`: every stat is an RPC.
    pub attr_table: Option<crate::attrs::AttrTableRef>,
    /// The directory-entry table in the meta region, where `lookup` resolves names
    /// one-sidedly ([`crate::dentries`]); `None`: every lookup is an RPC.
    pub dentry_table: Option<crate::dentries::DentryTableRef>,
    /// A Unix socket on the meta server's host where it takes the same connections
    /// ([`crate::stream`]): a client on that host may connect there instead, for cheaper
    /// calls. Offered where every client is on that host (the shm fabric); `None`: tcp only.
    pub local_rpc: Option<String>,
}

/// What a client needs to do I/O on an open file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenFile {
    /// The file's attributes at open.
    pub attr: Attr,
    /// The file control block in the meta server's region ([`crate::fcb`] has its layout).
    pub fcb: RemoteAddr,
    /// The file's lock for the requested scheme: its state in the meta server's region, with
    /// the description as the meta server created it (every parameter it chose filled in), so
    /// that the client opens exactly that ([`lockmgr::schemes::open`]).
    pub lock: LockRef,
}

/// Addresses live in the meta region as [`RemoteAddr`]s; re-exported for convenience.
pub use fabric::RemoteAddr as Addr;
