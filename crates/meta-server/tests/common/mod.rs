//! The meta server's tests: clusters from the one harness (`testkit`), sized here, and `Fs`, a
//! client session that speaks `proto::rpc` directly (no `CitronFs`), with typed helpers.
#![allow(dead_code)]

use proto::rpc::{Client, Request, Response, Role, Welcome};
use proto::{Attr, Caller, ClusterInfo, FileKind, FsError, Ino};
use std::time::Duration;
pub use testkit::{Cluster, ClusterSpec};

/// Bytes per chunk of every test cluster here.
pub const CHUNK: u64 = testkit::TEST_CHUNK_SIZE;

/// The file layout of test clusters (chunks grow from 4 KiB to [`CHUNK`]).
pub fn layout() -> proto::layout::Layout {
    proto::layout::Layout::new(CHUNK).unwrap()
}

/// The first chunk index of a file from which on every chunk is [`CHUNK`] bytes.
pub fn full() -> u64 {
    layout().locate(CHUNK).0
}

/// `statfs` blocks as whole [`CHUNK`]s.
pub fn in_chunks(blocks: u64, s: &proto::FsStats) -> u64 {
    blocks * s.block_size / CHUNK
}

/// `n` data servers of `chunks` chunks each on shm, file-backed if `file`, and a small (1 MiB)
/// meta region.
pub fn spec(n: usize, chunks: u64, file: bool) -> ClusterSpec {
    ClusterSpec {
        meta_region_bytes: 1 << 20,
        backing: if file {
            testkit::BackingKind::File
        } else {
            testkit::BackingKind::Memory
        },
        ..ClusterSpec::default().with_data_servers(n, chunks)
    }
}

/// Starts the cluster of [`spec`].
pub fn start(n: usize, chunks: u64, file: bool) -> Cluster {
    Cluster::start(spec(n, chunks, file)).unwrap()
}

/// Makes a regular file `name` in the root directory through a shared connection and returns
/// its inode.
pub fn shared_mknod(client: &proto::rpc::SharedClient, name: &str) -> Ino {
    match client
        .call(Request::Mknod {
            parent: proto::ROOT_INO,
            name: name.into(),
            kind: FileKind::File,
            perm: 0o644,
            rdev: 0,
            caller: ME,
        })
        .unwrap()
        .unwrap()
    {
        Response::Attr(attr) => attr.ino,
        other => panic!("mknod {name}: expected attributes, got {other:?}"),
    }
}

/// A client session on one connection that many threads share (`proto::rpc::SharedClient`,
/// as `fs-client` uses it), each call bounded by 10 s.
pub fn shared_client(cluster: &Cluster) -> proto::rpc::SharedClient {
    cluster.rpc_client().unwrap()
}

/// A client session with typed helpers.
pub struct Fs {
    pub c: Client,
    pub info: ClusterInfo,
}

pub const ME: Caller = Caller {
    uid: 1000,
    gid: 1000,
};

impl Fs {
    /// Opens a client session with `cluster`'s meta server.
    pub fn connect(cluster: &Cluster) -> Fs {
        let c = Client::connect(
            cluster.meta_addr(),
            &cluster.credentials(),
            Role::Client {
                host: "test".into(),
                pid: std::process::id(),
            },
        )
        .unwrap();
        let info = match c.welcome() {
            Welcome::Client(info) => info.clone(),
            other => panic!("unexpected welcome {other:?}"),
        };
        c.set_timeout(Some(Duration::from_secs(10))).unwrap();
        Fs { c, info }
    }

    pub fn call(&mut self, r: Request) -> Result<Response, FsError> {
        self.c.call(r).expect("rpc transport")
    }

    pub fn attr(&mut self, r: Request) -> Result<Attr, FsError> {
        match self.call(r)? {
            Response::Attr(a) => Ok(a),
            other => panic!("expected Attr, got {other:?}"),
        }
    }

    pub fn ok(&mut self, r: Request) -> Result<(), FsError> {
        match self.call(r)? {
            Response::Ok => Ok(()),
            other => panic!("expected Ok, got {other:?}"),
        }
    }

    /// Renews the session (a client session's heartbeat answers the layout epoch).
    pub fn heartbeat(&mut self) -> Result<u64, FsError> {
        match self.call(Request::Heartbeat)? {
            Response::Heartbeat { layout_epoch } => Ok(layout_epoch),
            other => panic!("expected Heartbeat, got {other:?}"),
        }
    }

    pub fn mkdir(&mut self, parent: Ino, name: &str) -> Result<Attr, FsError> {
        self.attr(Request::Mkdir {
            parent,
            name: name.into(),
            perm: 0o755,
            caller: ME,
        })
    }

    pub fn create(&mut self, parent: Ino, name: &str) -> Result<Attr, FsError> {
        self.attr(Request::Mknod {
            parent,
            name: name.into(),
            kind: FileKind::File,
            perm: 0o644,
            rdev: 0,
            caller: ME,
        })
    }

    pub fn lookup(&mut self, parent: Ino, name: &str) -> Result<Attr, FsError> {
        self.attr(Request::Lookup {
            parent,
            name: name.into(),
        })
    }

    pub fn getattr(&mut self, ino: Ino) -> Result<Attr, FsError> {
        self.attr(Request::GetAttr { ino })
    }

    pub fn unlink(&mut self, parent: Ino, name: &str) -> Result<(), FsError> {
        self.ok(Request::Unlink {
            parent,
            name: name.into(),
        })
    }

    pub fn rmdir(&mut self, parent: Ino, name: &str) -> Result<(), FsError> {
        self.ok(Request::Rmdir {
            parent,
            name: name.into(),
        })
    }

    pub fn rename(
        &mut self,
        p: Ino,
        n: &str,
        np: Ino,
        nn: &str,
        no_replace: bool,
    ) -> Result<(), FsError> {
        self.ok(Request::Rename {
            parent: p,
            name: n.into(),
            new_parent: np,
            new_name: nn.into(),
            no_replace,
            exchange: false,
        })
    }

    pub fn names(&mut self, ino: Ino) -> Vec<String> {
        match self
            .call(Request::ReadDir {
                ino,
                cookie: 0,
                max: 1000,
            })
            .unwrap()
        {
            Response::Entries(e) => e.into_iter().map(|e| e.name).collect(),
            other => panic!("{other:?}"),
        }
    }

    pub fn allocate(
        &mut self,
        ino: Ino,
        generation: u64,
        first: u64,
        count: u64,
    ) -> Result<Vec<proto::ChunkLoc>, FsError> {
        match self.call(Request::AllocateChunks {
            ino,
            generation,
            first,
            count,
        })? {
            // The first replica of each (one, unless a test asks for more).
            Response::Chunks(c) => Ok(c
                .into_iter()
                .map(|c| c.expect("allocated").first())
                .collect()),
            other => panic!("{other:?}"),
        }
    }

    /// The first replica of each chunk (`None`: a hole).
    pub fn chunk_map(&mut self, ino: Ino, first: u64, count: u64) -> Vec<Option<proto::ChunkLoc>> {
        match self.call(Request::ChunkMap { ino, first, count }).unwrap() {
            Response::Chunks(c) => c.into_iter().map(|r| r.map(|r| r.first())).collect(),
            other => panic!("{other:?}"),
        }
    }

    pub fn stats(&mut self) -> proto::FsStats {
        match self.call(Request::Statfs).unwrap() {
            Response::Stats(s) => s,
            other => panic!("{other:?}"),
        }
    }
}
