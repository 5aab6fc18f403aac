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

/// Most replicas a chunk may have ([`Replicas`]): a replication factor above it is refused.
pub const MAX_REPLICAS: usize = 4;

/// The extended attribute that sets the replication factor of what is created in a
/// directory from then on (a decimal number, `1..=MAX_REPLICAS`): a new file or directory
/// inherits its parent's, and a file's chunks get that many replicas on distinct data servers
/// (docs/REPLICAS.md). Without it, the meta server's `--replicas` applies.
pub const REPLICAS_XATTR: &str = "citronfs.replicas";

/// Parses a value of [`REPLICAS_XATTR`]: a decimal number in `1..=MAX_REPLICAS` (surrounding
/// whitespace, such as the newline `echo` adds, is ignored).
pub fn parse_replicas(value: &[u8]) -> Result<usize, crate::FsError> {
    let text = std::str::from_utf8(value).unwrap_or("").trim();
    match text.parse::<usize>() {
        Ok(n) if (1..=MAX_REPLICAS).contains(&n) => Ok(n),
        _ => Err(crate::FsError::Invalid(format!(
            "{REPLICAS_XATTR} must be a number from 1 to {MAX_REPLICAS}, not {:?}",
            String::from_utf8_lossy(value)
        ))),
    }
}

/// Where the replicas of one chunk live: one to [`MAX_REPLICAS`] locations on distinct data
/// servers, the first the one it was placed on first. Kept inline (no allocation), so that a
/// client's cache of one-replica chunks costs what a cache of plain locations did.
#[derive(Clone, Copy)]
pub struct Replicas {
    len: u8,
    locs: [ChunkLoc; MAX_REPLICAS],
}

impl Replicas {
    /// One replica at `loc`.
    pub const fn one(loc: ChunkLoc) -> Replicas {
        Replicas {
            len: 1,
            locs: [loc; MAX_REPLICAS],
        }
    }

    /// The replicas at `locs`; fails unless there are 1 to [`MAX_REPLICAS`] of them on distinct
    /// data servers.
    pub fn new(locs: &[ChunkLoc]) -> Result<Replicas, crate::FsError> {
        let Some(&first) = locs.first() else {
            return Err(crate::FsError::Invalid("a chunk without a replica".into()));
        };
        if locs.len() > MAX_REPLICAS {
            return Err(crate::FsError::Invalid(format!(
                "a chunk with {} replicas (at most {MAX_REPLICAS})",
                locs.len()
            )));
        }
        for (i, a) in locs.iter().enumerate() {
            if locs[..i].iter().any(|b| b.server == a.server) {
                return Err(crate::FsError::Invalid(format!(
                    "two replicas of a chunk on data server {}",
                    a.server
                )));
            }
        }
        let mut out = Replicas::one(first);
        out.locs[..locs.len()].copy_from_slice(locs);
        out.len = locs.len() as u8;
        Ok(out)
    }

    /// The locations, the first placed first.
    pub fn as_slice(&self) -> &[ChunkLoc] {
        &self.locs[..self.len as usize]
    }

    /// The first replica's location.
    pub fn first(&self) -> ChunkLoc {
        self.locs[0]
    }

    /// How many replicas there are (at least 1).
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Never: a chunk has at least one replica (here for the convention of `len`).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The replica on data server `server`, if any.
    pub fn on(&self, server: u32) -> Option<ChunkLoc> {
        self.as_slice().iter().copied().find(|l| l.server == server)
    }
}

/// Equal when the locations are, in order (the unused slots are not compared).
impl PartialEq for Replicas {
    fn eq(&self, other: &Replicas) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Replicas {}

impl std::hash::Hash for Replicas {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

impl std::fmt::Debug for Replicas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl IntoIterator for Replicas {
    type Item = ChunkLoc;
    type IntoIter = std::iter::Take<std::array::IntoIter<ChunkLoc, MAX_REPLICAS>>;

    /// The locations, the first placed first.
    fn into_iter(self) -> Self::IntoIter {
        self.locs.into_iter().take(self.len as usize)
    }
}

impl From<ChunkLoc> for Replicas {
    fn from(loc: ChunkLoc) -> Replicas {
        Replicas::one(loc)
    }
}

impl Serialize for Replicas {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.as_slice().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Replicas {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Replicas, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Replicas;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(
                    f,
                    "1 to {MAX_REPLICAS} chunk locations on distinct data servers"
                )
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Replicas, A::Error> {
                let mut locs = [ChunkLoc {
                    server: 0,
                    index: 0,
                }; MAX_REPLICAS];
                let mut n = 0;
                while let Some(loc) = seq.next_element::<ChunkLoc>()? {
                    if n == MAX_REPLICAS {
                        return Err(serde::de::Error::invalid_length(n + 1, &self));
                    }
                    locs[n] = loc;
                    n += 1;
                }
                Replicas::new(&locs[..n]).map_err(serde::de::Error::custom)
            }
        }
        d.deserialize_seq(Visit)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(server: u32) -> ChunkLoc {
        ChunkLoc { server, index: 7 }
    }

    /// A replica set crosses the wire as a list of locations; one that is empty, longer than
    /// `MAX_REPLICAS` or names a server twice is refused when decoded, never trusted.
    #[test]
    fn replica_sets_round_trip_and_bad_ones_are_refused() {
        let two = Replicas::new(&[loc(1), loc(0)]).unwrap();
        let bytes = postcard::to_stdvec(&two).unwrap();
        assert_eq!(postcard::from_bytes::<Replicas>(&bytes).unwrap(), two);
        assert_eq!(
            bytes,
            postcard::to_stdvec(&vec![loc(1), loc(0)]).unwrap(),
            "a plain list"
        );
        assert_eq!(two.into_iter().collect::<Vec<_>>(), vec![loc(1), loc(0)]);
        assert_eq!(two.on(0), Some(loc(0)));
        assert_eq!(two.on(2), None);
        for bad in [
            vec![],
            vec![loc(0), loc(0)],
            (0..=MAX_REPLICAS as u32).map(loc).collect(),
        ] {
            let bytes = postcard::to_stdvec(&bad).unwrap();
            assert!(postcard::from_bytes::<Replicas>(&bytes).is_err(), "{bad:?}");
            assert!(Replicas::new(&bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_replicas(b"2\n").unwrap(), 2);
        for bad in [&b"0"[..], b"5", b"-1", b"x", b""] {
            assert!(parse_replicas(bad).is_err(), "{bad:?}");
        }
    }
}
