//! A small in-process cluster for the meta server's tests: a meta server and data servers on
//! shm, in temporary directories, driven through `proto::rpc::Client`.
#![allow(dead_code)]

use data_server::{Backing, DataConfig, DataFabric, DataHandle, DataServer};
use meta_server::{MetaConfig, MetaFabric, MetaHandle, MetaServer};
use proto::rpc::{Client, Request, Response, Role, Welcome};
use proto::{Attr, Caller, ClusterInfo, FileKind, FsError, Ino};
use std::path::PathBuf;
use std::time::Duration;

pub const TOKEN: &str = "secret";
pub const CLUSTER: &str = "test";
pub const CHUNK: u64 = 64 << 10;

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub meta: MetaHandle,
    pub data: Vec<DataHandle>,
    pub config: MetaConfig,
}

pub fn meta_config(dir: &std::path::Path) -> MetaConfig {
    let mut c = MetaConfig::new(
        dir.join("db"),
        MetaFabric::Shm {
            dir: dir.join("meta-shm"),
        },
    );
    c.cluster = CLUSTER.into();
    c.token = TOKEN.into();
    // The suites open files with every scheme, `server` included.
    c.lock_server = true;
    c.chunk_size = CHUNK;
    c.region_bytes = 1 << 20;
    c
}

pub fn data_config(
    dir: &std::path::Path,
    meta: &MetaHandle,
    i: usize,
    chunks: u64,
    file: bool,
) -> DataConfig {
    let sdir: PathBuf = dir.join(format!("data-{i}"));
    DataConfig {
        name: format!("ds{i}"),
        meta_addr: meta.addr().to_string(),
        cluster: CLUSTER.into(),
        token: TOKEN.into(),
        capacity_bytes: chunks * CHUNK,
        fabric: DataFabric::Shm { dir: sdir.clone() },
        backing: if file {
            Backing::File { dir: sdir }
        } else {
            Backing::Memory
        },
    }
}

impl Cluster {
    /// A meta server and `n` data servers of `chunks` chunks each.
    pub fn start(n: usize, chunks: u64, file: bool) -> Cluster {
        Self::start_with(n, chunks, file, |_| {})
    }

    pub fn start_with(
        n: usize,
        chunks: u64,
        file: bool,
        tweak: impl FnOnce(&mut MetaConfig),
    ) -> Cluster {
        // Under /dev/shm when it exists, so that memory-backed regions are in shared memory.
        let dir = tempfile::Builder::new()
            .prefix("citronfs-meta-test")
            .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() {
                "/dev/shm"
            } else {
                "/tmp"
            })
            .unwrap();
        let mut config = meta_config(dir.path());
        tweak(&mut config);
        let meta = MetaServer::start(config.clone()).unwrap();
        let data = (0..n)
            .map(|i| DataServer::start(data_config(dir.path(), &meta, i, chunks, file)).unwrap())
            .collect();
        Cluster {
            dir,
            meta,
            data,
            config,
        }
    }

    pub fn client(&self) -> Fs {
        Fs::connect(&self.meta)
    }
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
    pub fn connect(meta: &MetaHandle) -> Fs {
        let c = Client::connect(
            meta.addr(),
            &fabric::Credentials::new(CLUSTER, TOKEN),
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
            Response::Chunks(c) => Ok(c.into_iter().map(|c| c.expect("allocated")).collect()),
            other => panic!("{other:?}"),
        }
    }

    pub fn chunk_map(&mut self, ino: Ino, first: u64, count: u64) -> Vec<Option<proto::ChunkLoc>> {
        match self.call(Request::ChunkMap { ino, first, count }).unwrap() {
            Response::Chunks(c) => c,
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
