//! An in-process cluster for the client's tests: a meta server and data servers on shm, in a
//! temporary directory (under /dev/shm when it exists), on port 0.
#![allow(dead_code)]

use data_server::{Backing, DataConfig, DataFabric, DataHandle, DataServer};
use fs_client::{CitronFs, LockScheme, MountOptions};
use meta_server::{MetaConfig, MetaFabric, MetaHandle, MetaServer};

pub const CLUSTER: &str = "fs-client-test";
pub const TOKEN: &str = "secret";
/// Small chunks, so that tests cross chunk and server boundaries with small buffers.
pub const CHUNK: u64 = 64 << 10;

pub struct Cluster {
    // Field order is drop order: data servers, then the meta server, then the directory.
    pub data: Vec<DataHandle>,
    pub meta: MetaHandle,
    pub dir: tempfile::TempDir,
}

impl Cluster {
    /// A meta server and `servers` data servers of `chunks` chunks each, on shm.
    pub fn start(servers: usize, chunks: u64) -> Cluster {
        Self::start_on(servers, chunks, false)
    }

    /// The same on the tcp fabric (`tcp`) or shm.
    pub fn start_on(servers: usize, chunks: u64, tcp: bool) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("citronfs-client-test")
            .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() {
                "/dev/shm"
            } else {
                "/tmp"
            })
            .unwrap();
        let mut config = MetaConfig::new(
            dir.path().join("db"),
            if tcp {
                MetaFabric::Tcp {
                    listen: "127.0.0.1:0".parse().unwrap(),
                }
            } else {
                MetaFabric::Shm {
                    dir: dir.path().join("meta-shm"),
                }
            },
        );
        config.cluster = CLUSTER.into();
        config.token = TOKEN.into();
        config.chunk_size = CHUNK;
        config.region_bytes = 4 << 20;
        let meta = MetaServer::start(config).unwrap();
        let data = (0..servers)
            .map(|i| {
                let sdir = dir.path().join(format!("data-{i}"));
                DataServer::start(DataConfig {
                    name: format!("ds{i}"),
                    meta_addr: meta.addr().to_string(),
                    cluster: CLUSTER.into(),
                    token: TOKEN.into(),
                    capacity_bytes: chunks * CHUNK,
                    fabric: if tcp {
                        DataFabric::Tcp {
                            listen: "127.0.0.1:0".parse().unwrap(),
                        }
                    } else {
                        DataFabric::Shm { dir: sdir }
                    },
                    backing: Backing::Memory,
                })
                .unwrap()
            })
            .collect();
        Cluster { data, meta, dir }
    }

    pub fn options(&self, scheme: LockScheme) -> MountOptions {
        let mut opts = MountOptions::new(self.meta.addr().to_string(), CLUSTER, TOKEN);
        opts.scheme = scheme;
        opts
    }

    /// A new client (its own session) with `scheme`.
    pub fn client(&self, scheme: LockScheme) -> CitronFs {
        CitronFs::connect(self.options(scheme)).unwrap()
    }
}

/// `len` bytes of a pattern that differs at every offset and per `seed`.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (offset + i).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(31);
            (x >> 29) as u8
        })
        .collect()
}
