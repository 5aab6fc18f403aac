//! A meta server killed (SIGKILL, no clean shutdown) and started again on its database, under a
//! live client: what the client fsynced survives with its size, the
//! client carries on through the handles it had open, what the durability promise does not
//! cover (the size of a file grown since its last fsync or close) is the only thing that may
//! be lost (docs/RELIABILITY.md), and the client's next fsync reports that loss with EIO
//! instead of vouching for changes the crash took.
//!
//! The meta server is the real `citronfs meta-server` process; the data server and the client
//! run in this process.

use data_server::{Backing, DataConfig, DataServer, DATA_REGION};
use fabric::{EndpointExt, RemoteAddr, ServeAt};
use fs_client::{CitronFs, MountOptions};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use testkit::{pattern, wait_until};

const CLUSTER: &str = "crash-test";
const CHUNK: usize = 64 << 10;

/// A `citronfs meta-server` child, killed on drop.
struct MetaProcess(Child);

impl MetaProcess {
    fn start(db: &Path, listen: SocketAddr, token: &str) -> MetaProcess {
        let child = Command::new(env!("CARGO_BIN_EXE_citronfs"))
            .args(["meta-server", "--cluster", CLUSTER, "--fabric", "tcp"])
            .args(["--chunk-size", "64K", "--region-size", "16M"])
            .arg("--listen")
            .arg(listen.to_string())
            .arg("--db")
            .arg(db)
            .env("CITRONFS_TOKEN", token)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start citronfs meta-server");
        let mut meta = MetaProcess(child);
        wait_until(Duration::from_secs(30), "the meta server to listen", || {
            assert!(
                meta.0.try_wait().unwrap().is_none(),
                "the meta server exited"
            );
            TcpStream::connect(listen).is_ok()
        });
        meta
    }

    fn kill(mut self) {
        // SIGKILL: no shutdown path runs, nothing is persisted on the way out.
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for MetaProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_killed_meta_server_keeps_what_was_fsynced_and_clients_carry_on() {
    testkit::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("meta-db");
    // Restarted on this address: outside the ephemeral range (testkit::restartable_addr).
    let listen = testkit::restartable_addr().unwrap();
    let token = testkit::random_token().unwrap();
    let meta = MetaProcess::start(&db, listen, &token);
    let data = DataServer::start(DataConfig {
        name: "ds-0".into(),
        meta_addr: listen.to_string(),
        cluster: CLUSTER.into(),
        token: token.clone(),
        capacity_bytes: 16 << 20,
        fabric: ServeAt::Tcp {
            listen: "127.0.0.1:0".parse().unwrap(),
        },
        backing: Backing::Memory,
        zone: None,
    })
    .unwrap();
    let fs = CitronFs::connect(MountOptions::new(
        listen.to_string(),
        CLUSTER,
        token.clone(),
    ))
    .unwrap();
    let me = CitronFs::process_caller();
    let root = proto::ROOT_INO;

    // `durable` is written and fsynced; `grown` was fsynced at one size, then grew.
    let durable_data = pattern(1, 0, 5 * CHUNK + 11);
    let (durable, fh) = fs.create(me, root, "durable", 0o644, libc::O_RDWR).unwrap();
    fs.write(fh, 0, &durable_data).unwrap();
    fs.fsync(fh).unwrap();
    let grown_data = pattern(2, 0, 3 * CHUNK);
    let (grown, gh) = fs.create(me, root, "grown", 0o644, libc::O_RDWR).unwrap();
    fs.write(gh, 0, &grown_data[..CHUNK]).unwrap();
    fs.fsync(gh).unwrap();
    fs.write(gh, CHUNK as u64, &grown_data[CHUNK..]).unwrap();

    // A free chunk holding data, as one handed out by an allocation that the crash rolls
    // back would (the last chunk of the region: the files above use the first few).
    let last_chunk = RemoteAddr::new(DATA_REGION, (16 << 20) - CHUNK as u64);
    let mut raw = fabric::connect(
        data.fabric(),
        &fabric::Credentials::new(CLUSTER.to_string(), token.clone()),
        0,
    )
    .unwrap()
    .connect()
    .unwrap();
    raw.write(last_chunk, &vec![0xAB; CHUNK]).unwrap();

    meta.kill();
    let _meta = MetaProcess::start(&db, listen, &token);

    // Through the handle opened before the crash: the fsynced file whole.
    assert_eq!(
        fs.read(fh, 0, durable_data.len() + 100).unwrap(),
        durable_data,
        "the fsynced file after the crash"
    );
    assert_eq!(
        fs.getattr(durable.ino).unwrap().size,
        durable_data.len() as u64
    );
    // The grown file: at least what was fsynced; beyond it the promise does not reach.
    let size = fs.getattr(grown.ino).unwrap().size;
    assert!(
        size >= CHUNK as u64,
        "the fsynced size of `grown` was lost: {size}"
    );
    let got = fs.read(gh, 0, grown_data.len()).unwrap();
    assert_eq!(&got[..CHUNK], &grown_data[..CHUNK]);
    // The meta server found the crash and zeroes the data server's free chunks when it
    // registers again, before anything can be allocated on it.
    wait_until(
        Duration::from_secs(20),
        "the free chunk zeroed after the crash",
        || raw.read(last_chunk, CHUNK).unwrap().iter().all(|&b| b == 0),
    );
    // The first fsync after the crash says that changes acknowledged before it (the growth
    // of `grown`) may be lost — they were; the client carries on: writes, fsync, new files.
    fs.write(gh, 0, &grown_data).unwrap();
    let err = fs.fsync(gh).unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    fs.fsync(gh).unwrap();
    assert_eq!(fs.read(gh, 0, grown_data.len()).unwrap(), grown_data);
    let (_, nh) = fs.create(me, root, "after", 0o644, libc::O_RDWR).unwrap();
    fs.write(nh, 0, b"after the crash").unwrap();
    assert_eq!(fs.read(nh, 0, 100).unwrap(), b"after the crash");
    for h in [fh, gh, nh] {
        fs.release(h).unwrap();
    }
}
