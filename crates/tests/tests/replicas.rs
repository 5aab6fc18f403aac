//! Replicas (docs/REPLICAS.md) through real mounts: with a replication factor of 2 on two
//! data servers, every file written through the mount reads back whole after one of the data
//! servers is killed with SIGKILL — no EIO, nothing lost, nothing torn — both before the meta
//! server noticed the death (the read fails on the dead server and is redone from the other
//! replica under the same lock) and after (the client reads the live replica only). The
//! replication factor is set through the mount with `setxattr` on a directory, checked
//! (a factor above the live data servers is EINVAL), inherited, and charged in `st_blocks`.
//! Writes go on while a replica's data server is dead (the meta server drops its replicas),
//! and a dropped replica is never read again, even by a client whose chunk map predates the
//! drop, when its server comes back with its old memory.
//!
//! The data servers are processes of their own (this test binary run again as
//! [`child_data_server`]), so that one can be killed as a machine dies: no shutdown path runs.

use std::ffi::CString;
use std::io::{BufRead, BufReader};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use testkit::{pattern, skip_without_fuse, wait_until, Backend, Cluster, ClusterSpec};

const ENV_NAME: &str = "CITRONFS_TEST_DS_NAME";
const ENV_META: &str = "CITRONFS_TEST_DS_META";
const ENV_CLUSTER: &str = "CITRONFS_TEST_DS_CLUSTER";
const ENV_TOKEN: &str = "CITRONFS_TEST_DS_TOKEN";
const ENV_CAPACITY: &str = "CITRONFS_TEST_DS_CAPACITY";
/// What a data server process prints once it has registered.
const READY: &str = "CITRONFS-DATA-SERVER-READY";
const CHUNK: u64 = 64 << 10;
const CAPACITY: u64 = 32 << 20;

/// A cluster of `data_servers` data servers (0: none started in-process, the test starts them as
/// processes) on `fabric` whose files keep two replicas of every chunk.
fn replicated(data_servers: usize, fabric: Backend) -> ClusterSpec {
    ClusterSpec {
        data_servers,
        capacity: CAPACITY,
        chunk_size: CHUNK,
        fabric,
        replicas: 2,
        ..ClusterSpec::default()
    }
}

/// The body of a data server process (see [`DataProcess::start`]); run normally (no
/// environment), it returns at once.
#[test]
fn child_data_server() {
    let (Ok(name), Ok(meta), Ok(cluster), Ok(token), Ok(capacity)) = (
        std::env::var(ENV_NAME),
        std::env::var(ENV_META),
        std::env::var(ENV_CLUSTER),
        std::env::var(ENV_TOKEN),
        std::env::var(ENV_CAPACITY),
    ) else {
        return;
    };
    let _server = data_server::DataServer::start(data_server::DataConfig {
        name,
        meta_addr: meta,
        cluster,
        token,
        capacity_bytes: capacity.parse().expect("a capacity"),
        fabric: fabric::ServeAt::Tcp {
            listen: "127.0.0.1:0".parse().expect("an address"),
        },
        backing: data_server::Backing::Memory,
        zone: None,
    })
    .expect("the data server starts");
    println!("{READY}");
    // Serves until its stdin closes (the test is done) or it is killed.
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        line.clear();
    }
}

/// A data server process, killed on drop.
struct DataProcess(Child);

impl DataProcess {
    fn start(cluster: &Cluster, name: &str) -> DataProcess {
        let exe = std::env::current_exe().expect("the test binary's path");
        let mut command = Command::new(exe);
        command
            .args([
                "child_data_server",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_NAME, name)
            .env(ENV_META, cluster.meta_addr().to_string())
            .env(ENV_CLUSTER, cluster.name())
            .env(ENV_TOKEN, cluster.token())
            .env(ENV_CAPACITY, CAPACITY.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        testkit::die_with_parent(&mut command);
        let mut child = command.spawn().expect("spawn a data server process");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let ready = lines.any(|l| l.is_ok_and(|l| l.contains(READY)));
        assert!(ready, "data server {name} did not start");
        DataProcess(child)
    }

    /// SIGKILL: the process dies at once, its memory with it.
    fn kill(&mut self) {
        self.0.kill().expect("kill the data server");
        self.0.wait().expect("reap the data server");
    }
}

impl Drop for DataProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// How many data servers the meta server has live.
fn live_data_servers(cluster: &Cluster) -> usize {
    let client = cluster.rpc_client().expect("an RPC client");
    match client.call(proto::rpc::Request::Status) {
        Ok(Ok(proto::rpc::Response::Status(status))) => {
            status.data_servers.iter().filter(|d| d.live).count()
        }
        other => panic!("status: {other:?}"),
    }
}

/// Two data servers of `cluster` as processes of their own (`ds-0`, `ds-1`), once the meta
/// server has both live.
fn two_data_processes(cluster: &Cluster) -> [DataProcess; 2] {
    data_processes(cluster)
}

/// `N` data servers of `cluster` as processes of their own (`ds-0`, ...), once the meta server
/// has them all live.
fn data_processes<const N: usize>(cluster: &Cluster) -> [DataProcess; N] {
    let servers = std::array::from_fn(|i| DataProcess::start(cluster, &format!("ds-{i}")));
    wait_until(
        Duration::from_secs(30),
        "the data servers to be live",
        || live_data_servers(cluster) == N,
    );
    servers
}

/// setxattr(2) of `name` on `path`; the errno when it fails.
fn set_xattr(path: &Path, name: &str, value: &[u8]) -> Result<(), i32> {
    let p = CString::new(path.as_os_str().as_bytes()).expect("a path");
    let n = CString::new(name).expect("a name");
    // SAFETY: both strings are NUL-terminated, and the value's pointer and length describe it.
    let r = unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

/// getxattr(2) of `name` on `path`.
fn get_xattr(path: &Path, name: &str) -> Result<Vec<u8>, i32> {
    let p = CString::new(path.as_os_str().as_bytes()).expect("a path");
    let n = CString::new(name).expect("a name");
    let mut buf = vec![0u8; 64];
    // SAFETY: both strings are NUL-terminated, and the buffer's pointer and length describe it.
    let r = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    buf.truncate(r as usize);
    Ok(buf)
}

/// The files the test writes: (name, size), from under a block to several chunks, and one
/// that ends mid-chunk.
const FILES: [(&str, usize); 4] = [
    ("small", 5_000),
    ("chunk", CHUNK as usize),
    ("big", 3 * (1 << 20) + 12_345),
    ("many-chunks", 40 * CHUNK as usize),
];

/// Opens every file.
fn open_all(dir: &Path) -> Vec<std::fs::File> {
    FILES
        .iter()
        .map(|(name, _)| std::fs::File::open(dir.join(name)).unwrap())
        .collect()
}

/// Reads every file back through `files` (as [`open_all`] opened them) in pieces of `piece`
/// bytes; the errors and the files that differ.
fn read_back(files: &[std::fs::File], piece: usize) -> (Vec<String>, Vec<String>) {
    let (mut errors, mut wrong) = (Vec::new(), Vec::new());
    for (seed, ((name, size), file)) in FILES.iter().zip(files).enumerate() {
        let want = pattern(seed as u64 + 1, 0, *size);
        let mut got = vec![0u8; *size];
        let mut at = 0;
        while at < *size {
            let n = piece.min(size - at);
            match file.read_exact_at(&mut got[at..at + n], at as u64) {
                Ok(()) => at += n,
                Err(e) => {
                    errors.push(format!("read {name} at {at}: {e}"));
                    break;
                }
            }
        }
        if at == *size && got != want {
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            wrong.push(format!("{name}: first wrong byte at {first:?}"));
        }
    }
    (errors, wrong)
}

/// Writes the files with `replicas` replicas through a mount, kills data server `victim` (0 or
/// 1), and reads everything back.
fn kill_a_data_server_under_a_mount(replicas: usize, victim: usize) {
    skip_without_fuse!();
    testkit::init_logging();
    let cluster = Cluster::start(ClusterSpec {
        data_servers: 0,
        capacity: CAPACITY,
        chunk_size: CHUNK,
        fabric: Backend::Tcp,
        // Heartbeats (a quarter of `fence_after`) every 500 ms rather than 25: the reads right
        // after the kill come before the client hears of it, and meet the dead server.
        fence_after: Duration::from_secs(2),
        lock_lease: Duration::from_secs(10),
        replicas: 1,
        ..ClusterSpec::default()
    })
    .unwrap();
    let mut servers = two_data_processes(&cluster);
    let mount = cluster.mount().unwrap();
    let dir = mount.path().join("d");
    std::fs::create_dir(&dir).unwrap();
    // More replicas than live data servers: refused, clearly.
    assert_eq!(
        set_xattr(&dir, proto::REPLICAS_XATTR, b"3"),
        Err(libc::EINVAL)
    );
    assert_eq!(
        set_xattr(&dir, proto::REPLICAS_XATTR, b"two"),
        Err(libc::EINVAL)
    );
    let factor = replicas.to_string();
    set_xattr(&dir, proto::REPLICAS_XATTR, factor.as_bytes()).unwrap();
    assert_eq!(
        get_xattr(&dir, proto::REPLICAS_XATTR).unwrap(),
        factor.as_bytes()
    );

    for (seed, (name, size)) in FILES.iter().enumerate() {
        let data = pattern(seed as u64 + 1, 0, *size);
        // Written in 1 MiB calls, as a copy would.
        let file = std::fs::File::create(dir.join(name)).unwrap();
        for (i, part) in data.chunks(1 << 20).enumerate() {
            file.write_all_at(part, (i << 20) as u64).unwrap();
        }
        drop(file);
        let path = dir.join(name);
        assert_eq!(
            get_xattr(&path, proto::REPLICAS_XATTR).unwrap(),
            factor.as_bytes(),
            "{name} inherits the directory's factor"
        );
        // Every replica is charged.
        let layout = proto::layout::Layout::new(CHUNK).unwrap();
        let blocks = std::fs::metadata(&path).unwrap().blocks();
        assert_eq!(
            blocks * 512,
            replicas as u64 * layout.charged(*size as u64),
            "{name}: st_blocks counts {replicas} replicas"
        );
    }
    // Opened, and read once (the client learns where the chunks are), before the kill.
    let files = open_all(&dir);
    let (errors, wrong) = read_back(&files, 1 << 20);
    assert!(
        errors.is_empty() && wrong.is_empty(),
        "{errors:?} {wrong:?}"
    );

    // SIGKILL one data server, and read at once through the open files: the client has not
    // heard of the death (no call to the meta server brought it), so the reads of chunks
    // whose chosen replica was on the dead server fail there and are redone from the other.
    servers[victim].kill();
    let (errors, wrong) = read_back(&files, 1 << 20);
    eprintln!(
        "replicas {replicas}, ds-{victim} killed: right after the kill: {} errors, {} files wrong",
        errors.len(),
        wrong.len()
    );
    assert!(
        errors.is_empty() && wrong.is_empty(),
        "replicas {replicas}: reads after a data server was killed: errors {errors:#?}, wrong \
         {wrong:#?}"
    );
    // Once the meta server knows: reads go to the live replica only, in small pieces too.
    wait_until(
        Duration::from_secs(30),
        "the meta server to see the death",
        || live_data_servers(&cluster) == 1,
    );
    let (errors, wrong) = read_back(&open_all(&dir), 4096 * 3 + 1);
    assert!(
        errors.is_empty() && wrong.is_empty(),
        "replicas {replicas}: reads once the death is known: errors {errors:#?}, wrong \
         {wrong:#?}"
    );
    drop(files);
    drop(mount);
}

/// Each server killed in turn: the other holds every chunk, so every replica was written.
#[test]
fn two_replicas_read_back_whole_after_either_data_server_is_killed() {
    for victim in [1, 0] {
        kill_a_data_server_under_a_mount(2, victim);
    }
}

/// Zones: four data servers in two zones (`ClusterSpec::zones`, the data servers' `--zone`),
/// two replicas of every chunk: each chunk of a file written through a client has one replica
/// in each zone, and the meta server's status shows every server's zone.
#[test]
fn two_replicas_land_in_distinct_zones() {
    testkit::init_logging();
    let zones = ["a", "a", "b", "b"];
    let cluster = Cluster::start(ClusterSpec {
        data_servers: zones.len(),
        capacity: CAPACITY,
        chunk_size: CHUNK,
        replicas: 2,
        zones: zones.iter().map(|z| z.to_string()).collect(),
        ..ClusterSpec::default()
    })
    .unwrap();
    let client = cluster.rpc_client().unwrap();
    let status = match client.call(proto::rpc::Request::Status) {
        Ok(Ok(proto::rpc::Response::Status(status))) => status,
        other => panic!("status: {other:?}"),
    };
    let zone_of: std::collections::HashMap<u32, String> = status
        .data_servers
        .iter()
        .map(|d| (d.id, d.zone.clone().expect("every server names a zone")))
        .collect();
    assert_eq!(zone_of.len(), zones.len(), "{:?}", status.data_servers);

    let fs = cluster.client().unwrap();
    let (attr, fh) = fs
        .create(
            fs_client::CitronFs::process_caller(),
            proto::ROOT_INO,
            "f",
            0o644,
            libc::O_RDWR,
        )
        .unwrap();
    let chunks = 24;
    let size = proto::layout::Layout::new(CHUNK).unwrap().start(chunks) as usize;
    let data = pattern(7, 0, size);
    assert_eq!(fs.write(fh, 0, &data).unwrap(), size);
    let map = match client.call(proto::rpc::Request::ChunkMap {
        ino: attr.ino,
        first: 0,
        count: chunks,
    }) {
        Ok(Ok(proto::rpc::Response::Chunks(map))) => map,
        other => panic!("ChunkMap answered {other:?}"),
    };
    let mut firsts = std::collections::HashSet::new();
    for (k, replicas) in map.iter().enumerate() {
        let replicas = replicas.unwrap_or_else(|| panic!("chunk {k} is allocated"));
        let in_zones: Vec<&str> = replicas
            .as_slice()
            .iter()
            .map(|loc| zone_of[&loc.server].as_str())
            .collect();
        assert_eq!(replicas.len(), 2, "chunk {k}: {replicas:?}");
        assert_ne!(in_zones[0], in_zones[1], "chunk {k}: {replicas:?}");
        firsts.insert(replicas.first().server);
    }
    assert_eq!(firsts.len(), zones.len(), "the first replicas are striped");
    assert_eq!(fs.read(fh, 0, size).unwrap(), data);
    fs.release(fh).unwrap();
}

/// Where chunk `chunk` of `ino` has its replicas, as the meta server's chunk map says.
fn replicas_of(cluster: &Cluster, ino: proto::Ino, chunk: u64) -> Vec<proto::ChunkLoc> {
    let client = cluster.rpc_client().expect("an RPC client");
    match client.call(proto::rpc::Request::ChunkMap {
        ino,
        first: chunk,
        count: 1,
    }) {
        Ok(Ok(proto::rpc::Response::Chunks(chunks))) => chunks
            .first()
            .and_then(|c| c.as_ref())
            .map(|r| r.as_slice().to_vec())
            .expect("the chunk exists"),
        other => panic!("chunk map: {other:?}"),
    }
}

/// Writes `data` to a new file `/name` through a library client, and closes it; its inode.
fn write_file(fs: &fs_client::CitronFs, name: &str, data: &[u8]) -> proto::Ino {
    let me = fs_client::CitronFs::process_caller();
    let (attr, fh) = fs
        .create(me, proto::ROOT_INO, name, 0o644, libc::O_RDWR)
        .expect("create");
    for (i, part) in data.chunks(1 << 20).enumerate() {
        fs.write(fh, (i << 20) as u64, part).expect("write");
    }
    fs.release(fh).expect("release");
    attr.ino
}

/// `citronfs fsck` compares a chunk's replicas at rest: one replica's bytes changed directly
/// on its data server (a one-sided write through the fabric, bypassing every client) is a
/// `replicas-differ` finding naming the file, its path, the chunk, both replicas' servers and
/// the first differing byte; `--repair` copies the first replica over it; the next check is
/// clean and the file reads back as written. An open file, while clients are active, is not
/// compared, and the report says so.
#[test]
fn fsck_finds_and_repairs_replicas_that_differ() {
    use fabric::{Connector, EndpointExt};
    use proto::fsck::{Finding, FsckOptions, Repair};
    testkit::init_logging();
    let cluster = Cluster::start(replicated(2, Backend::Tcp)).unwrap();
    let fs = cluster.client().unwrap();
    let size = 3 * CHUNK as usize + 1000;
    let data = pattern(7, 0, size);
    let ino = write_file(&fs, "f", &data);
    // The client gone, the file is open nowhere: no lock on it can be held, and it is compared.
    drop(fs);
    const CHECK: FsckOptions = FsckOptions {
        repair: false,
        at_rest: false,
    };
    wait_until(
        Duration::from_secs(10),
        "the client's session to end",
        || cluster.fsck(CHECK).unwrap().counts.open_files == 0,
    );
    let report = cluster.fsck(CHECK).unwrap();
    assert!(report.clean(), "{:#?}", report.findings);
    assert!(report.counts.replicated_chunks >= 4, "{:?}", report.counts);
    assert_eq!(report.counts.under_replicated, 0);

    // Other bytes at byte 777 of chunk 2's second replica.
    let layout = proto::layout::Layout::new(CHUNK).unwrap();
    let chunk = 2;
    let replicas = replicas_of(&cluster, ino, chunk);
    assert_eq!(replicas.len(), 2, "{replicas:?}");
    let (first, second) = (replicas[0], replicas[1]);
    let server = cluster
        .data_servers()
        .iter()
        .find(|d| d.id() == second.server)
        .expect("the replica's data server");
    let mut ep = fabric::connect(server.fabric(), &cluster.credentials(), 0)
        .unwrap()
        .connect()
        .unwrap();
    let at = second.index * layout.unit() + 777;
    let addr = fabric::RemoteAddr::new(data_server::DATA_REGION, at);
    let old = ep.read(addr, 16).unwrap();
    let new: Vec<u8> = old.iter().map(|b| !b).collect();
    ep.write(addr, &new).unwrap();

    let report = cluster.fsck(CHECK).unwrap();
    let expected = Finding::ReplicasDiffer {
        ino,
        path: Some("/f".into()),
        chunk,
        reference: first,
        other: second,
        offset: 777,
        file_offset: layout.start(chunk) + 777,
    };
    assert_eq!(report.findings, vec![expected.clone()]);
    eprintln!("fsck: {expected}");

    let report = cluster
        .fsck(FsckOptions {
            repair: true,
            at_rest: false,
        })
        .unwrap();
    assert_eq!(report.findings, vec![expected]);
    assert_eq!(
        report.repairs,
        vec![Repair::CopiedReplica {
            ino,
            chunk,
            from: first,
            to: second
        }]
    );
    assert_eq!(report.remaining, Some(Vec::new()));
    assert_eq!(ep.read(addr, 16).unwrap(), old, "the replica was repaired");
    let report = cluster.fsck(CHECK).unwrap();
    assert!(report.clean(), "{:#?}", report.findings);

    // The file reads back as written.
    let fs = cluster.client().unwrap();
    let me = fs_client::CitronFs::process_caller();
    let fh = fs.open(me, ino, libc::O_RDONLY).unwrap();
    assert!(fs.read(fh, 0, size).unwrap() == data, "the file reads back");
    // Open, while another session is connected and no --at-rest: not compared, and said.
    let report = cluster.fsck(FsckOptions::default()).unwrap();
    assert_eq!(report.replicas_not_compared.len(), 1, "{report:#?}");
    assert_eq!(report.replicas_not_compared[0].0, ino);
    fs.release(fh).unwrap();
}

/// A data server killed (SIGKILL) under files of two replicas: fsck counts every chunk with a
/// replica there as under-replicated, per file and in the summary, and `--repair` leaves them
/// (no other live server to place a second replica on).
#[test]
fn fsck_counts_chunks_under_replicated_after_a_data_server_is_killed() {
    use proto::fsck::{Finding, FsckOptions};
    testkit::init_logging();
    let cluster = Cluster::start(replicated(0, Backend::Tcp)).unwrap();
    let mut servers = two_data_processes(&cluster);
    let fs = cluster.client().unwrap();
    let layout = proto::layout::Layout::new(CHUNK).unwrap();
    let sizes = [CHUNK as usize * 3, 5000];
    let inos: Vec<proto::Ino> = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| write_file(&fs, &format!("f{i}"), &pattern(i as u64, 0, size)))
        .collect();
    let report = cluster.fsck(FsckOptions::default()).unwrap();
    assert!(report.clean(), "{:#?}", report.findings);

    servers[1].kill();
    wait_until(
        Duration::from_secs(30),
        "the meta server to see the death",
        || live_data_servers(&cluster) == 1,
    );
    let report = cluster
        .fsck(FsckOptions {
            repair: true,
            at_rest: false,
        })
        .unwrap();
    let mut total = 0;
    for (&ino, &size) in inos.iter().zip(&sizes) {
        let chunks = layout.chunks_below(size as u64);
        total += chunks;
        let expected = Finding::UnderReplicated {
            ino,
            path: Some(format!(
                "/f{}",
                inos.iter().position(|&i| i == ino).unwrap()
            )),
            factor: 2,
            chunks,
            fewest: 1,
        };
        assert!(
            report.findings.contains(&expected),
            "{expected:?} in {:#?}",
            report.findings
        );
        assert!(report.remaining.as_ref().unwrap().contains(&expected));
    }
    assert_eq!(report.counts.under_replicated, total);
    assert!(report.repairs.is_empty(), "{:#?}", report.repairs);
    // Nothing left to compare: one live replica each.
    assert_eq!(report.counts.replicated_chunks, 0);
    drop(fs);
}

/// A memory-only data server restarted under files of two replicas comes back with new memory:
/// its replicas are marked lost, so fsck counts their chunks under-replicated and does not
/// compare the empty replicas with the live ones (which would differ everywhere).
#[test]
fn fsck_counts_replicas_on_a_server_back_with_new_memory_and_does_not_compare_them() {
    use proto::fsck::{Finding, FsckOptions};
    testkit::init_logging();
    let mut cluster = Cluster::start(replicated(2, Backend::Tcp)).unwrap();
    let fs = cluster.client().unwrap();
    let size = 2 * CHUNK as usize;
    let ino = write_file(&fs, "f", &pattern(3, 0, size));
    drop(fs);
    cluster.restart_data_server(1).unwrap();
    wait_until(Duration::from_secs(30), "two live data servers", || {
        live_data_servers(&cluster) == 2
    });
    let report = cluster.fsck(FsckOptions::default()).unwrap();
    let chunks = proto::layout::Layout::new(CHUNK)
        .unwrap()
        .chunks_below(size as u64);
    assert_eq!(
        report.findings,
        vec![Finding::UnderReplicated {
            ino,
            path: Some("/f".into()),
            factor: 2,
            chunks,
            fewest: 1,
        }]
    );
    assert_eq!(report.counts.under_replicated, chunks);
    assert_eq!(report.counts.replicated_chunks, 0);
}

/// Files of the live-I/O test below, their blocks, and a block's bytes: 8 KiB blocks cross
/// the geometric layout's small chunks (4, 4, 8, 16, 32 KiB ...), so one write spans two
/// chunks at times.
const LIVE_FILES: usize = 4;
const LIVE_BLOCKS: usize = 24;
const LIVE_BLOCK: usize = 8192;

/// Block `block` of file `file` as its write number `seq` fills it: every 8-byte word says
/// all three, so a read that sees two writes (torn) or another block is caught.
fn stamped(file: usize, block: usize, seq: u64) -> Vec<u8> {
    let word = (seq << 24) | ((file as u64) << 16) | block as u64;
    word.to_le_bytes().repeat(LIVE_BLOCK / 8)
}

/// The write number a block read holds; `Err` when it is not one whole write of this block.
fn stamp_of(file: usize, block: usize, bytes: &[u8]) -> Result<u64, String> {
    let first = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if bytes.chunks(8).any(|w| w != first.to_le_bytes()) {
        return Err(format!("file {file} block {block}: torn (words differ)"));
    }
    if first & 0xFF_FFFF != ((file as u64) << 16) | block as u64 {
        return Err(format!("file {file} block {block}: holds {first:#x}"));
    }
    Ok(first >> 24)
}

/// A small deterministic generator (xorshift) for the threads' choices.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Writes while a replica's data server is dead (docs/REPLICAS.md "A dead data server"): two
/// mounts (two clients), replicas 2 on two memory-only data server processes, one writer
/// thread per file (files spread over both mounts) and one reader per mount, all running while
/// `ds-1` is killed with SIGKILL. The meta server drops the dead server's replicas, and the
/// writers that met the dead server catch up and go on with the live replica: no EIO, no
/// write lost (every read sees at least the last write acknowledged before it began, and
/// everything reads back as last acknowledged), nothing torn.
#[test]
fn writers_and_readers_go_on_while_a_replica_server_is_dead() {
    skip_without_fuse!();
    testkit::init_logging();
    let mut cluster = Cluster::start(replicated(0, Backend::Tcp)).unwrap();
    let mut servers = two_data_processes(&cluster);
    live_io_across_a_replica_server_death(&mut cluster, |_| servers[1].kill());
}

/// [`writers_and_readers_go_on_while_a_replica_server_is_dead`] on shm, the data servers in
/// this process and `ds-1` stopped (its regions emptied, its incarnation word zeroed: the
/// clients' batches to it find the word zero, `StaleDataServer`, rather than a broken
/// connection).
#[test]
fn writers_and_readers_go_on_while_a_replica_server_is_stopped_on_shm() {
    skip_without_fuse!();
    testkit::init_logging();
    let mut cluster = Cluster::start(replicated(2, Backend::Shm)).unwrap();
    live_io_across_a_replica_server_death(&mut cluster, |cluster| {
        cluster.data_servers_mut()[1].shutdown()
    });
}

/// The body of the two tests above: `cluster` has two live data servers and replicas 2;
/// `kill` makes `ds-1` die (or stop) while the writers and readers run.
fn live_io_across_a_replica_server_death(cluster: &mut Cluster, kill: impl FnOnce(&mut Cluster)) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    let mounts = [cluster.mount().unwrap(), cluster.mount().unwrap()];
    for file in 0..LIVE_FILES {
        let f = std::fs::File::create(mounts[0].path().join(format!("f{file}"))).unwrap();
        for block in 0..LIVE_BLOCKS {
            f.write_all_at(&stamped(file, block, 1), (block * LIVE_BLOCK) as u64)
                .unwrap();
        }
    }
    // The last write number acknowledged per block, the writes done, what went wrong.
    let acked: Arc<Vec<AtomicU64>> = Arc::new(
        (0..LIVE_FILES * LIVE_BLOCKS)
            .map(|_| AtomicU64::new(1))
            .collect(),
    );
    let writes = Arc::new(AtomicU64::new(0));
    let reads = Arc::new(AtomicU64::new(0));
    // The longest write, in microseconds: the pause the death cost a writer.
    let slowest = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut threads = Vec::new();
    for file in 0..LIVE_FILES {
        let path = mounts[file % 2].path().join(format!("f{file}"));
        let (acked, writes, slowest, stop, failures) = (
            acked.clone(),
            writes.clone(),
            slowest.clone(),
            stop.clone(),
            failures.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            let mut x = 0x9E37_79B9 + file as u64;
            let mut seq = 1;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                let block = (next(&mut x) % LIVE_BLOCKS as u64) as usize;
                let began = std::time::Instant::now();
                let written =
                    f.write_all_at(&stamped(file, block, seq), (block * LIVE_BLOCK) as u64);
                slowest.fetch_max(began.elapsed().as_micros() as u64, Ordering::SeqCst);
                match written {
                    Ok(()) => {
                        acked[file * LIVE_BLOCKS + block].store(seq, Ordering::SeqCst);
                        writes.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) => failures
                        .lock()
                        .unwrap()
                        .push(format!("write f{file} block {block}: {e}")),
                }
            }
        }));
    }
    for (m, mount) in mounts.iter().enumerate() {
        let dir = mount.path().to_path_buf();
        let (acked, reads, stop, failures) =
            (acked.clone(), reads.clone(), stop.clone(), failures.clone());
        threads.push(std::thread::spawn(move || {
            let files: Vec<std::fs::File> = (0..LIVE_FILES)
                .map(|f| std::fs::File::open(dir.join(format!("f{f}"))).unwrap())
                .collect();
            let mut x = 0x51_7CC1 + m as u64;
            let mut buf = vec![0u8; LIVE_BLOCK];
            while !stop.load(Ordering::Relaxed) {
                let file = (next(&mut x) % LIVE_FILES as u64) as usize;
                let block = (next(&mut x) % LIVE_BLOCKS as u64) as usize;
                let before = acked[file * LIVE_BLOCKS + block].load(Ordering::SeqCst);
                let wrong = match files[file].read_exact_at(&mut buf, (block * LIVE_BLOCK) as u64) {
                    Err(e) => Some(format!("read f{file} block {block} (mount {m}): {e}")),
                    Ok(()) => match stamp_of(file, block, &buf) {
                        Err(e) => Some(format!("mount {m}: {e}")),
                        Ok(seq) if seq < before => Some(format!(
                            "mount {m}: f{file} block {block} reads write {seq}, but write \
                             {before} was acknowledged before the read began (lost)"
                        )),
                        Ok(_) => None,
                    },
                };
                reads.fetch_add(1, Ordering::SeqCst);
                if let Some(wrong) = wrong {
                    failures.lock().unwrap().push(wrong);
                }
            }
        }));
    }
    let count = |c: &AtomicU64| c.load(Ordering::SeqCst);
    wait_until(Duration::from_secs(30), "writes before the kill", || {
        count(&writes) >= 100 && count(&reads) >= 100
    });
    kill(cluster);
    let killed_at = (count(&writes), count(&reads));
    wait_until(
        Duration::from_secs(30),
        "the meta server to see the death",
        || live_data_servers(cluster) == 1,
    );
    // Writes and reads go on: a few hundred more of each (not waited for past the bound of a
    // write's wait for a dead server, so that a stall shows as such).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while (count(&writes) < killed_at.0 + 300 || count(&reads) < killed_at.1 + 300)
        && std::time::Instant::now() < deadline
        && failures.lock().unwrap().is_empty()
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    let after = (count(&writes) - killed_at.0, count(&reads) - killed_at.1);
    let failures = std::mem::take(&mut *failures.lock().unwrap());
    let slowest = Duration::from_micros(count(&slowest));
    eprintln!(
        "replica server killed under live I/O: {} writes and {} reads after the kill, {} \
         failures, slowest write {slowest:?}",
        after.0,
        after.1,
        failures.len()
    );
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(
        after.0 >= 300 && after.1 >= 300,
        "writes and reads stalled after the kill: {after:?}"
    );
    // No write waited for the dead server (that wait is 10 s).
    assert!(slowest < Duration::from_secs(5), "a write took {slowest:?}");
    // Everything reads back as last acknowledged, through both clients.
    for mount in &mounts {
        for file in 0..LIVE_FILES {
            let f = std::fs::File::open(mount.path().join(format!("f{file}"))).unwrap();
            let mut buf = vec![0u8; LIVE_BLOCK];
            for block in 0..LIVE_BLOCKS {
                f.read_exact_at(&mut buf, (block * LIVE_BLOCK) as u64)
                    .unwrap();
                let want = count(&acked[file * LIVE_BLOCKS + block]);
                assert_eq!(
                    stamp_of(file, block, &buf),
                    Ok(want),
                    "f{file} block {block}"
                );
            }
        }
    }
}

/// A file-backed data server stopped, then started again with its old memory at its old
/// address, serves none of the replicas the meta server dropped while it was away — not even
/// to a client whose cached chunk map and view predate the drop (its heartbeats are 30 s
/// apart, so nothing told it of the stop): the drop moved the file's generation, which every
/// locked I/O reads, so that client's next read learns the chunk map anew.
#[test]
fn a_server_back_with_its_old_memory_serves_no_dropped_replica() {
    testkit::init_logging();
    let long = Duration::from_secs(600);
    let mut cluster = Cluster::start(ClusterSpec {
        backing: testkit::BackingKind::File,
        session_lease: long,
        fence_after: Duration::from_secs(120),
        lock_lease: long,
        ..replicated(2, Backend::Tcp)
    })
    .unwrap();
    let me = fs_client::CitronFs::process_caller();
    let (stale, writer) = (cluster.client().unwrap(), cluster.client().unwrap());
    let size = 6 * CHUNK as usize;
    let layout = proto::layout::Layout::new(CHUNK).unwrap();
    let chunks = layout.chunks_below(size as u64);
    let old = pattern(1, 0, size);
    let ino = write_file(&stale, "f", &old);
    // Both clients learn where every chunk is (both replicas).
    let fa = stale.open(me, ino, libc::O_RDONLY).unwrap();
    let fb = writer.open(me, ino, libc::O_RDWR).unwrap();
    assert_eq!(stale.read(fa, 0, size).unwrap(), old);
    assert_eq!(writer.read(fb, 0, size).unwrap(), old);
    for c in 0..chunks {
        assert_eq!(replicas_of(&cluster, ino, c).len(), 2, "chunk {c}");
    }

    // ds-1 stops; its region file stays.
    let fabric::FabricAddr::Tcp { addr } = cluster.data_servers()[1].fabric().clone() else {
        panic!("a tcp data server");
    };
    cluster.data_servers_mut()[1].shutdown();
    wait_until(
        Duration::from_secs(30),
        "the meta server to see ds-1 gone",
        || live_data_servers(&cluster) == 1,
    );
    // New data over the whole file, while ds-1 is down: no EIO; ds-1's replicas are dropped.
    let new = pattern(2, 0, size);
    for (i, part) in new.chunks(CHUNK as usize).enumerate() {
        writer
            .write(fb, (i * CHUNK as usize) as u64, part)
            .expect("a write while a replica's data server is down");
    }
    for c in 0..chunks {
        let servers: Vec<u32> = replicas_of(&cluster, ino, c)
            .iter()
            .map(|l| l.server)
            .collect();
        assert_eq!(servers, [0], "chunk {c} without the dropped replica");
    }

    // ds-1 back with its old memory (the same incarnation), at its old address.
    let mut config = cluster.data_config(1);
    config.fabric = fabric::ServeAt::Tcp {
        listen: addr.parse().unwrap(),
    };
    cluster.data_servers_mut()[1] = data_server::DataServer::start(config).unwrap();
    wait_until(Duration::from_secs(30), "ds-1 back", || {
        live_data_servers(&cluster) == 2
    });
    for c in 0..chunks {
        assert_eq!(
            replicas_of(&cluster, ino, c).len(),
            1,
            "chunk {c} stays dropped"
        );
    }
    // The client whose map predates the drop reads the new data, chunk by chunk (a read
    // picks each chunk's replica by the chunk and the session: half of them would be ds-1's),
    // again and again (its endpoint to ds-1 broke; a new one reaches ds-1 back).
    for round in 0..3 {
        for c in 0..chunks {
            let (from, len) = (layout.start(c), layout.len(c) as usize);
            let got = stale.read(fa, from, len).unwrap();
            assert!(
                got == new[from as usize..from as usize + len],
                "round {round}: chunk {c} reads the dropped replica's old bytes"
            );
        }
    }
    assert_eq!(writer.read(fb, 0, size).unwrap(), new);
    let fresh = cluster.client().unwrap();
    let fc = fresh.open(me, ino, libc::O_RDONLY).unwrap();
    assert_eq!(fresh.read(fc, 0, size).unwrap(), new);
    for (fs, fh) in [(&stale, fa), (&writer, fb), (&fresh, fc)] {
        fs.release(fh).unwrap();
    }
}

/// The cluster's status, as `citronfs status` gets it.
fn status(cluster: &Cluster) -> proto::status::ClusterStatus {
    let client = cluster.rpc_client().expect("an RPC client");
    match client.call(proto::rpc::Request::Status) {
        Ok(Ok(proto::rpc::Response::Status(status))) => *status,
        other => panic!("status: {other:?}"),
    }
}

/// How many chunks `fsck` finds short of their file's replicas now.
fn under_replicated(cluster: &Cluster) -> u64 {
    let report = cluster
        .fsck(proto::fsck::FsckOptions::default())
        .expect("fsck");
    report.counts.under_replicated
}

/// Files of several chunks (and one of less than one), `f0`, `f1`, ..., written through
/// `fs`: their inodes and contents.
fn write_files(fs: &fs_client::CitronFs) -> Vec<(proto::Ino, Vec<u8>)> {
    [
        CHUNK as usize * 9 + 123,
        CHUNK as usize * 4,
        5000,
        CHUNK as usize * 16,
    ]
    .iter()
    .enumerate()
    .map(|(i, &size)| {
        let data = pattern(100 + i as u64, 0, size);
        (write_file(fs, &format!("f{i}"), &data), data)
    })
    .collect()
}

/// Every file reads back as written through a new client.
fn assert_read_back(cluster: &Cluster, files: &[(proto::Ino, Vec<u8>)]) {
    let fs = cluster.client().unwrap();
    let me = fs_client::CitronFs::process_caller();
    for (ino, data) in files {
        let fh = fs.open(me, *ino, libc::O_RDONLY).unwrap();
        let got = fs.read(fh, 0, data.len()).unwrap();
        let first = got.iter().zip(data).position(|(a, b)| a != b);
        assert!(
            got.len() == data.len() && first.is_none(),
            "inode {ino}: {} bytes of {}, first wrong byte at {first:?}",
            got.len(),
            data.len()
        );
        fs.release(fh).unwrap();
    }
}

/// A clean `fsck` once no session has a file open, every replica compared: no finding, no
/// chunk under-replicated, and `compared` chunks of several replicas.
fn assert_clean_at_rest(cluster: &Cluster) -> proto::fsck::FsckReport {
    use proto::fsck::FsckOptions;
    wait_until(Duration::from_secs(20), "no file open anywhere", || {
        cluster
            .fsck(FsckOptions::default())
            .unwrap()
            .counts
            .open_files
            == 0
    });
    let report = cluster.fsck(FsckOptions::default()).unwrap();
    assert!(report.clean(), "{:#?}", report.findings);
    assert!(report.replicas_not_compared.is_empty(), "{report:#?}");
    assert_eq!(report.counts.under_replicated, 0);
    report
}

/// A data server killed (SIGKILL) under files of two replicas on three data servers: once it
/// has been down for the grace, the meta server gives every chunk it held a replica a new one
/// on the data server that has none, in the background; then fsck finds nothing (every chunk
/// has two live replicas holding the same bytes), no chunk names the dead server any more,
/// every file reads back, and the status tells how much was copied and how fast (no rate
/// limit: the figure printed is the copy's speed on this machine).
#[test]
fn a_killed_data_servers_chunks_are_re_replicated_in_the_background() {
    testkit::init_logging();
    let cluster = Cluster::start(ClusterSpec {
        rereplicate_after: Duration::from_millis(300),
        rereplicate_mib_s: 0,
        ..replicated(0, Backend::Tcp)
    })
    .unwrap();
    let mut servers = data_processes::<3>(&cluster);
    let fs = cluster.client().unwrap();
    let files = write_files(&fs);
    drop(fs);
    assert_clean_at_rest(&cluster);
    let layout = proto::layout::Layout::new(CHUNK).unwrap();
    let victim = 2;
    let on_victim: u64 = files
        .iter()
        .map(|(ino, data)| {
            (0..layout.chunks_below(data.len() as u64))
                .filter(|&c| {
                    replicas_of(&cluster, *ino, c)
                        .iter()
                        .any(|l| l.server == victim)
                })
                .count() as u64
        })
        .sum();
    assert!(on_victim > 0);

    servers[victim as usize].kill();
    wait_until(
        Duration::from_secs(30),
        "the meta server to see the death",
        || live_data_servers(&cluster) == 2,
    );
    wait_until(Duration::from_secs(60), "re-replication to finish", || {
        under_replicated(&cluster) == 0
    });
    let report = assert_clean_at_rest(&cluster);
    let total: u64 = files
        .iter()
        .map(|(_, data)| layout.chunks_below(data.len() as u64))
        .sum();
    assert_eq!(
        report.counts.replicated_chunks, total,
        "every chunk compared"
    );
    for (ino, data) in &files {
        for c in 0..layout.chunks_below(data.len() as u64) {
            let replicas = replicas_of(&cluster, *ino, c);
            assert_eq!(replicas.len(), 2, "inode {ino} chunk {c}: {replicas:?}");
            assert!(replicas.iter().all(|l| l.server != victim), "{replicas:?}");
        }
    }
    assert_read_back(&cluster, &files);
    let status = status(&cluster);
    let r = &status.rereplication;
    assert_eq!(r.total_done, on_victim, "{r:?}");
    assert!(!r.running && r.failed == 0, "{r:?}");
    eprintln!(
        "re-replicated {} chunks ({} KiB) at {:.1} MiB/s (no rate limit; tcp fabric, one \
         machine)",
        r.done,
        r.bytes >> 10,
        r.kib_per_s as f64 / 1024.0
    );
}

/// `citronfs fsck --repair` re-replicates at once what it finds under-replicated (the
/// background pass is hours away here): each chunk is a `re-replicated` repair, nothing is
/// left in `remaining`, and the next check is clean.
#[test]
fn fsck_repair_re_replicates_under_replicated_chunks() {
    use proto::fsck::{Finding, FsckOptions, Repair};
    testkit::init_logging();
    let cluster = Cluster::start(ClusterSpec {
        rereplicate_after: Duration::from_secs(3600),
        ..replicated(0, Backend::Tcp)
    })
    .unwrap();
    let mut servers = data_processes::<3>(&cluster);
    let fs = cluster.client().unwrap();
    let files = write_files(&fs);
    drop(fs);
    servers[0].kill();
    wait_until(
        Duration::from_secs(30),
        "the meta server to see the death",
        || live_data_servers(&cluster) == 2,
    );
    let short = under_replicated(&cluster);
    assert!(short > 0);
    let report = cluster
        .fsck(FsckOptions {
            repair: true,
            at_rest: false,
        })
        .unwrap();
    assert!(
        report
            .findings
            .iter()
            .any(|f| matches!(f, Finding::UnderReplicated { .. })),
        "{:#?}",
        report.findings
    );
    let copied = report
        .repairs
        .iter()
        .filter(|r| matches!(r, Repair::Rereplicated { from, to, .. } if from.server != 0 && to.server != 0))
        .count() as u64;
    assert_eq!(copied, short, "{:#?}", report.repairs);
    assert_eq!(report.remaining, Some(Vec::new()));
    assert_clean_at_rest(&cluster);
    assert_read_back(&cluster, &files);
}

/// Where a writer of [`no_write_is_lost_while_chunks_are_re_replicated`] writes: a file open
/// in a library client, or a file of a FUSE mount.
enum Writer {
    Library(fs_client::CitronFs, fs_client::FileHandle),
    Mount(std::fs::File),
}

impl Writer {
    fn write_at(&self, at: u64, data: &[u8]) -> Result<(), String> {
        match self {
            Writer::Library(fs, fh) => fs.write(*fh, at, data).map(drop).map_err(|e| e.to_string()),
            Writer::Mount(file) => file.write_all_at(data, at).map_err(|e| e.to_string()),
        }
    }

    /// Closes the file (a mount's data reaches the cluster by then).
    fn close(self) -> Result<(), String> {
        match self {
            Writer::Library(fs, fh) => fs.release(fh).map_err(|e| e.to_string()),
            Writer::Mount(file) => file.sync_all().map_err(|e| e.to_string()),
        }
    }
}

/// Starts a thread that writes 4 KiB somewhere in each 64 KiB of `model` (the file's
/// contents, `writer`'s file) in turn, other bytes every time, until `stop`; counts its
/// writes in `writes`; returns the file's contents as they must be.
fn spawn_writer(
    writer: Writer,
    mut model: Vec<u8>,
    seed: u64,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    writes: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> std::thread::JoinHandle<Result<Vec<u8>, String>> {
    use std::sync::atomic::Ordering;
    std::thread::spawn(move || {
        writer.write_at(0, &model)?;
        let pieces = (model.len() / CHUNK as usize) as u64;
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let piece = (i % pieces) as usize;
            let at = piece * CHUNK as usize + ((i * 4096) as usize % CHUNK as usize);
            let data = pattern(seed + i, 0, 4096);
            writer
                .write_at(at as u64, &data)
                .map_err(|e| format!("write {i} at {at}: {e}"))?;
            model[at..at + data.len()].copy_from_slice(&data);
            writes.fetch_add(1, Ordering::Relaxed);
            i += 1;
        }
        writer.close()?;
        Ok(model)
    })
}

/// Writers keep writing files of two replicas — one through the client library, one through a
/// FUSE mount where this machine has FUSE — while a data server restarts with new memory (its
/// replicas lost) and the meta server re-replicates the chunks, slowly (rate-limited), so that
/// writes land before, during and after each chunk's copy: writes that come after a chunk's
/// copy must reach its new replica too (the writers' cached chunk maps are stale then). At
/// rest afterwards every replica holds the same bytes (fsck compares them all) and the files
/// hold every write.
#[test]
fn no_write_is_lost_while_chunks_are_re_replicated() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    testkit::init_logging();
    let mut cluster = Cluster::start(ClusterSpec {
        rereplicate_after: Duration::from_millis(200),
        // 64 KiB chunks at 1 MiB/s: one chunk every 60 ms or so, for a few seconds.
        rereplicate_mib_s: 1,
        ..replicated(3, Backend::Tcp)
    })
    .unwrap();
    let fs = cluster.client().unwrap();
    let mut files = write_files(&fs);
    drop(fs);
    let size = 24 * CHUNK as usize;
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let me = fs_client::CitronFs::process_caller();
    let library = cluster.client().unwrap();
    let (attr, fh) = library
        .create(me, proto::ROOT_INO, "w", 0o644, libc::O_RDWR)
        .unwrap();
    let mut writers = vec![(
        attr.ino,
        spawn_writer(
            Writer::Library(library, fh),
            pattern(7, 0, size),
            1000,
            stop.clone(),
            writes.clone(),
        ),
    )];
    let mount = match testkit::fuse_unavailable() {
        Some(why) => {
            eprintln!("no writer through a FUSE mount: {why}");
            None
        }
        None => {
            let mount = cluster.mount().unwrap();
            let path = mount.path().join("m");
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .unwrap();
            let ino = std::fs::metadata(&path).unwrap().ino();
            writers.push((
                ino,
                spawn_writer(
                    Writer::Mount(file),
                    pattern(8, 0, size),
                    1_000_000,
                    stop.clone(),
                    writes.clone(),
                ),
            ));
            Some(mount)
        }
    };
    wait_until(Duration::from_secs(10), "the writers to write", || {
        writes.load(Ordering::Relaxed) > 50
    });
    cluster.restart_data_server(2).unwrap();
    // Writes while a pass copies chunks.
    let mut during = 0u64;
    let mut seen_running = None;
    wait_until(Duration::from_secs(120), "re-replication to finish", || {
        let r = status(&cluster).rereplication;
        if r.running {
            let now = writes.load(Ordering::Relaxed);
            during = now - *seen_running.get_or_insert(now);
            false
        } else {
            r.total_done > 0 && under_replicated(&cluster) == 0
        }
    });
    stop.store(true, Ordering::Relaxed);
    for (ino, writer) in writers {
        let model = writer.join().unwrap().expect("every write succeeds");
        files.push((ino, model));
    }
    drop(mount);
    let r = status(&cluster).rereplication;
    eprintln!(
        "{} writes, {during} of them while chunks were copied; {} chunks re-replicated at \
         {:.2} MiB/s (limit 1 MiB/s)",
        writes.load(Ordering::Relaxed),
        r.total_done,
        r.kib_per_s as f64 / 1024.0
    );
    assert!(during > 0, "the writers wrote while chunks were copied");
    assert!(r.kib_per_s <= 1100, "the rate limit holds: {r:?}");
    assert_clean_at_rest(&cluster);
    assert_read_back(&cluster, &files);
}

/// A meta server that stalls itself (its state lock held for 7 s, as a long check over a large
/// namespace held it) drops no replica: every data server's registration call times out
/// during the stall (they wait 5 s) and they register again, but the silence was the meta
/// server's own. Every chunk keeps its two replicas, and the client's session, silent for
/// longer than its lease only because nobody answered it, is not ended. Before the meta server
/// watched its own stalls, the servers were marked down one after another and each one's
/// replicas dropped where another was live at that instant — until only one copy was left.
#[test]
fn a_stalled_meta_server_drops_no_replica_and_ends_no_session() {
    testkit::init_logging();
    let cluster = Cluster::start(ClusterSpec {
        session_lease: Duration::from_secs(3),
        ..replicated(3, Backend::Tcp)
    })
    .unwrap();
    let fs = cluster.client().unwrap();
    let files = write_files(&fs);
    assert_eq!(under_replicated(&cluster), 0);
    let before = status(&cluster);
    assert_eq!(before.data_servers.len(), 3);
    let sessions = |s: &proto::status::ClusterStatus| -> Vec<u64> {
        s.sessions.iter().map(|s| s.id).collect()
    };
    // The client's session is the oldest (the checks' RPC clients come and go).
    let client_session = before.sessions.iter().max_by_key(|s| s.age_ms).unwrap().id;

    let epoch = cluster.meta().layout_epoch();
    cluster.meta().hold_state_lock(Duration::from_secs(7));

    // The data servers gave up on their calls during the stall, were marked down, and
    // registered again: six moves of the layout.
    wait_until(
        Duration::from_secs(30),
        "the data servers marked down and registered again",
        || cluster.meta().layout_epoch() >= epoch + 6 && live_data_servers(&cluster) == 3,
    );
    assert_eq!(
        under_replicated(&cluster),
        0,
        "replicas were dropped after the meta server's own stall"
    );
    // The session is still this one's: its next write needs no new session.
    let me = fs_client::CitronFs::process_caller();
    let (ino, data) = &files[0];
    let fh = fs.open(me, *ino, libc::O_RDWR).unwrap();
    fs.write(fh, 0, &data[..4096]).unwrap();
    fs.release(fh).unwrap();
    assert!(
        sessions(&status(&cluster)).contains(&client_session),
        "the client's session ended"
    );
    assert_read_back(&cluster, &files);
    drop(fs);
}

/// A write's chunk allocation outlasts a file generation that moves again and again: a
/// re-replication pass bumps the generation at every chunk it commits, milliseconds apart, and
/// an allocation whose generation moved is answered `Stale`. Here the next five allocations of
/// the file each find it moved just before them; the write still succeeds and reads back.
/// Before an allocation kept trying for a while, the third `Stale` failed the write with EIO
/// ("the file generation kept changing during a write"), as a 10-minute soak saw six times.
#[test]
fn a_write_outlasts_a_generation_moved_before_each_allocation() {
    testkit::init_logging();
    let cluster = Cluster::start(replicated(2, Backend::Tcp)).unwrap();
    let fs = cluster.client().unwrap();
    let first = pattern(5, 0, CHUNK as usize);
    let ino = write_file(&fs, "f", &first);
    cluster.meta().churn_generation(ino, 5);
    let me = fs_client::CitronFs::process_caller();
    let fh = fs.open(me, ino, libc::O_RDWR).unwrap();
    let more = pattern(6, 0, CHUNK as usize);
    fs.write(fh, 4 * CHUNK, &more)
        .expect("a write whose allocations met a moving generation");
    assert_eq!(fs.read(fh, 4 * CHUNK, more.len()).unwrap(), more);
    assert_eq!(fs.read(fh, 0, first.len()).unwrap(), first);
    fs.release(fh).unwrap();
}
