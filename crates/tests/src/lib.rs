//! The harness of CitronFS's file-system tests (the tests themselves are in `tests/`).
//!
//! - [`Cluster`]: a meta server and data servers in this process, on temporary directories
//!   (shm regions under `/dev/shm` with unique names), listening on port 0.
//! - [`Cluster::mount`]: an in-process FUSE mount in a fresh directory ([`Mount`], unmounted on
//!   drop, also when the test panics).
//! - [`Cluster::spawn_mount_process`]: a second client *process* ([`ChildMount`]): the current
//!   test binary re-executed to run one named test, which calls [`child_mount_main`]; killed and
//!   lazily unmounted on drop.
//! - [`fuse_unavailable`] / [`skip_without_fuse!`]: tests skip, saying why, where FUSE is
//!   missing.
//! - [`wait_until`]: poll a condition with a deadline instead of sleeping.

use data_server::{Backing, DataConfig, DataFabric, DataHandle, DataServer};
use fs_client::fuse::{FuseOptions, MountHandle};
use fs_client::{CitronFs, LockScheme, MountOptions};
use meta_server::{MetaConfig, MetaFabric, MetaHandle, MetaServer};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// The cluster name every test cluster uses.
pub const CLUSTER: &str = "citronfs-tests";
/// The cluster token every test cluster uses.
pub const TOKEN: &str = "test-token";

/// Why FUSE mounts cannot work here, or `None` when they can: /dev/fuse must exist and open,
/// and a non-root user needs `fusermount3` (Debian package fuse3).
pub fn fuse_unavailable() -> Option<String> {
    fs_client::fuse::check_mountable(Path::new(fs_client::fuse::FUSE_DEVICE)).err()
}

/// Returns from the calling test, printing why, when FUSE mounts cannot work here.
#[macro_export]
macro_rules! skip_without_fuse {
    () => {
        if let Some(why) = $crate::fuse_unavailable() {
            println!("skipped: {why}");
            return;
        }
    };
}

/// The first of `names` found on `PATH` (or in /bin, /usr/bin).
fn find_program(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/bin")])
        .collect();
    names
        .iter()
        .flat_map(|n| dirs.iter().map(move |d| d.join(n)))
        .find(|p| p.is_file())
}

/// Polls `done` every few milliseconds until it holds; panics naming `what` after `timeout`.
pub fn wait_until(timeout: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Whether `path` is a mount point now (read from /proc/self/mountinfo).
pub fn is_mounted(path: &Path) -> bool {
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    info.lines().any(|line| {
        line.split(' ')
            .nth(4)
            .is_some_and(|m| unescape_mountinfo(m) == path.as_os_str().to_string_lossy())
    })
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape_mountinfo(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let code: String = chars.by_ref().take(3).collect();
            if let Ok(b) = u8::from_str_radix(&code, 8) {
                out.push(b as char);
                continue;
            }
            out.push('\\');
            out.push_str(&code);
        } else {
            out.push(c);
        }
    }
    out
}

/// Detaches whatever is mounted at `path` even if it is busy or its server is gone
/// (`umount -l`, else `fusermount3 -uz`): the last resort of the guards' `Drop`.
pub fn lazy_unmount(path: &Path) {
    if !is_mounted(path) {
        return;
    }
    let quiet = |mut c: Command| {
        c.stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let mut umount = Command::new("umount");
    umount.arg("-l").arg(path);
    if quiet(umount) {
        return;
    }
    if let Some(fusermount) = find_program(&["fusermount3", "fusermount"]) {
        let mut c = Command::new(fusermount);
        c.arg("-uz").arg(path);
        quiet(c);
    }
}

/// Aborts the FUSE connection of the file system whose device is `dev` (through fusectl,
/// mounting it if needed). A lazily detached mount whose server lives in this process must be
/// aborted: otherwise, when the process exits, closing a file still open on it waits for an
/// answer from server threads that are already gone, and the process never ends.
fn abort_fuse_connection(dev: u64) {
    let connections = Path::new("/sys/fs/fuse/connections");
    // The connection's name is the kernel's device number: minor only, as FUSE's major is 0.
    let abort = connections.join(libc::minor(dev).to_string()).join("abort");
    if !abort.exists() {
        let _ = Command::new("mount")
            .args(["-t", "fusectl", "fusectl"])
            .arg(connections)
            .stderr(Stdio::null())
            .status();
    }
    let _ = std::fs::write(abort, b"1");
}

/// How the servers talk to clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricKind {
    /// Shared memory under /dev/shm.
    Shm,
    /// The tcp software NIC on 127.0.0.1.
    Tcp,
}

/// What holds the data servers' regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackingKind {
    /// Anonymous memory: lost when a data server stops.
    Memory,
    /// A file in the cluster's directory: kept across a restart of the servers.
    File,
}

/// What [`Cluster::start`] starts.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// How many data servers.
    pub data_servers: usize,
    /// Bytes of each data server's region.
    pub capacity: u64,
    /// Bytes per chunk.
    pub chunk_size: u64,
    /// The fabric of the meta region and the data servers.
    pub fabric: FabricKind,
    /// What holds the data servers' regions.
    pub backing: BackingKind,
    /// The lock scheme of [`Cluster::mount`] and [`Cluster::client`].
    pub scheme: LockScheme,
}

impl Default for ClusterSpec {
    /// Two data servers of 16 MiB on shm, memory-backed, 64 KiB chunks (small, so that modest
    /// files cross chunk and server boundaries), the citron scheme.
    fn default() -> Self {
        ClusterSpec {
            data_servers: 2,
            capacity: 16 << 20,
            chunk_size: 64 << 10,
            fabric: FabricKind::Shm,
            backing: BackingKind::Memory,
            scheme: LockScheme::CITRON,
        }
    }
}

/// A meta server and data servers running in this process.
pub struct Cluster {
    // Field order is drop order: data servers, then the meta server, then the directory.
    data: Vec<DataHandle>,
    meta: MetaHandle,
    meta_config: MetaConfig,
    spec: ClusterSpec,
    dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts a cluster as `spec` says, in a fresh temporary directory.
    pub fn start(spec: ClusterSpec) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("citronfs-tests-")
            .tempdir_in(if Path::new("/dev/shm").is_dir() {
                "/dev/shm"
            } else {
                "/tmp"
            })
            .expect("temporary directory for the cluster");
        let mut config = MetaConfig::new(
            dir.path().join("db"),
            match spec.fabric {
                FabricKind::Shm => MetaFabric::Shm {
                    dir: dir.path().join("meta-shm"),
                },
                FabricKind::Tcp => MetaFabric::Tcp {
                    listen: "127.0.0.1:0".parse().expect("address"),
                },
            },
        );
        config.cluster = CLUSTER.into();
        config.token = TOKEN.into();
        config.chunk_size = spec.chunk_size;
        config.region_bytes = 16 << 20;
        let meta = MetaServer::start(config.clone()).expect("meta server starts");
        // A restart listens where the first run did, so that nothing needs to learn a new port.
        config.listen = meta.addr();
        let mut cluster = Cluster {
            data: Vec::new(),
            meta,
            meta_config: config,
            spec,
            dir,
        };
        cluster.start_data_servers();
        cluster
    }

    fn start_data_servers(&mut self) {
        for i in 0..self.spec.data_servers {
            let sdir = self.dir.path().join(format!("data-{i}"));
            let handle = DataServer::start(DataConfig {
                name: format!("ds{i}"),
                meta_addr: self.meta.addr().to_string(),
                cluster: CLUSTER.into(),
                token: TOKEN.into(),
                capacity_bytes: self.spec.capacity,
                fabric: match self.spec.fabric {
                    FabricKind::Shm => DataFabric::Shm { dir: sdir.clone() },
                    FabricKind::Tcp => DataFabric::Tcp {
                        listen: "127.0.0.1:0".parse().expect("address"),
                    },
                },
                backing: match self.spec.backing {
                    BackingKind::Memory => Backing::Memory,
                    BackingKind::File => Backing::File {
                        dir: sdir.join("backing"),
                    },
                },
            })
            .expect("data server starts");
            self.data.push(handle);
        }
    }

    /// What the cluster was started with.
    pub fn spec(&self) -> &ClusterSpec {
        &self.spec
    }

    /// The meta server's RPC address.
    pub fn meta_addr(&self) -> String {
        self.meta.addr().to_string()
    }

    /// Stops every server (data servers first, then the meta server, which persists what is
    /// open) and starts them again on the same database, directories and address. Unmount
    /// first: clients' sessions do not survive it.
    pub fn restart(&mut self) {
        for d in &mut self.data {
            d.shutdown();
        }
        self.data.clear();
        self.meta
            .shutdown()
            .expect("meta server shuts down cleanly");
        self.meta = MetaServer::start(self.meta_config.clone()).expect("meta server restarts");
        self.start_data_servers();
    }

    /// Mount options for a client of this cluster with `scheme`.
    pub fn options(&self, scheme: LockScheme) -> MountOptions {
        let mut opts = MountOptions::new(self.meta_addr(), CLUSTER, TOKEN);
        opts.scheme = scheme;
        opts
    }

    /// A new library client (its own session) with the spec's scheme.
    pub fn client(&self) -> CitronFs {
        CitronFs::connect(self.options(self.spec.scheme)).expect("client connects")
    }

    /// An in-process FUSE mount with the spec's scheme, in a fresh directory.
    pub fn mount(&self) -> Mount {
        self.mount_with(self.spec.scheme)
    }

    /// An in-process FUSE mount with `scheme`, in a fresh directory.
    pub fn mount_with(&self, scheme: LockScheme) -> Mount {
        let fs = Arc::new(CitronFs::connect(self.options(scheme)).expect("client connects"));
        let dir = mount_dir();
        let handle = fs_client::fuse::mount(fs.clone(), dir.path(), &FuseOptions::default())
            .expect("FUSE mount");
        let dev = std::fs::metadata(dir.path()).map_or(0, |m| m.dev());
        Mount {
            handle: Some(handle),
            fs,
            dev,
            dir,
        }
    }

    /// Starts a second client process that mounts this cluster with `scheme` and returns once
    /// the mount is up. The process is this test binary running the test `child_test`, which
    /// must call [`child_mount_main`] (and does nothing when run normally).
    pub fn spawn_mount_process(&self, child_test: &str, scheme: LockScheme) -> ChildMount {
        let dir = mount_dir();
        let exe = std::env::current_exe().expect("the test binary's path");
        let mut child = Command::new(exe)
            .args([child_test, "--exact", "--nocapture", "--test-threads=1"])
            .env(ENV_META, self.meta_addr())
            .env(ENV_SCHEME, scheme.to_string())
            .env(ENV_MOUNTPOINT, dir.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the client process");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let mut guard = ChildMount {
            child,
            stdin,
            dir,
            output: Arc::new(Mutex::new(String::new())),
        };
        let (ready_tx, ready_rx) = mpsc::channel();
        let output = guard.output.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest prints `test NAME ... ` without a newline before the test body.
                if line.trim_end().ends_with(READY) {
                    let _ = ready_tx.send(());
                }
                let mut out = output.lock().unwrap_or_else(|e| e.into_inner());
                out.push_str(&line);
                out.push('\n');
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match ready_rx.recv_timeout(Duration::from_millis(50)) {
                Ok(()) => break,
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {
                    if let Ok(Some(status)) = guard.child.try_wait() {
                        panic!(
                            "the client process exited ({status}) before mounting; its output:\n{}",
                            guard.output()
                        );
                    }
                }
                Err(_) => panic!(
                    "the client process did not mount within 30 s; its output:\n{}",
                    guard.output()
                ),
            }
        }
        assert!(
            is_mounted(guard.path()),
            "the client process says it mounted, but {} is no mount point",
            guard.path().display()
        );
        guard
    }
}

/// A fresh, empty directory to mount on (in the ordinary temporary directory, not /dev/shm).
fn mount_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("citronfs-mnt-")
        .tempdir()
        .expect("mount point directory")
}

/// An in-process FUSE mount; unmounts on drop (lazily if it is busy, e.g. after a panic with
/// files still open).
pub struct Mount {
    handle: Option<MountHandle>,
    fs: Arc<CitronFs>,
    /// The mounted file system's device number (names its FUSE connection).
    dev: u64,
    dir: tempfile::TempDir,
}

impl Mount {
    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The client library behind the mount (its statistics, or calls that bypass the kernel).
    pub fn fs(&self) -> &Arc<CitronFs> {
        &self.fs
    }

    /// The largest read or write, in bytes, that this mount keeps atomic for every alignment
    /// of the user's buffer (see `fs_client::fuse::MountHandle::atomic_bound`).
    pub fn atomic_bound(&self) -> u64 {
        self.handle
            .as_ref()
            .expect("mounted until unmount or drop")
            .atomic_bound()
    }

    /// Unmounts now, failing if the unmount fails.
    pub fn unmount(mut self) -> std::io::Result<()> {
        let handle = self.handle.take().expect("mounted until unmount or drop");
        handle.unmount()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            if handle.unmount().is_err() {
                // Busy (files still open, e.g. after a panic): detach it, and abort the
                // connection so that those files' closes cannot hang this process's exit.
                lazy_unmount(self.dir.path());
                if self.dev != 0 {
                    abort_fuse_connection(self.dev);
                }
            }
        }
        // A mount point left behind makes the TempDir's removal fail; detach it regardless.
        lazy_unmount(self.dir.path());
    }
}

const ENV_META: &str = "CITRONFS_TEST_CHILD_META";
const ENV_SCHEME: &str = "CITRONFS_TEST_CHILD_SCHEME";
const ENV_MOUNTPOINT: &str = "CITRONFS_TEST_CHILD_MOUNTPOINT";
/// What a child prints once it has mounted.
const READY: &str = "CITRONFS-CHILD-MOUNTED";

/// A client process with a FUSE mount of the cluster (see [`Cluster::spawn_mount_process`]).
/// On drop: its stdin is closed (it unmounts and exits), and if it has not exited within a few
/// seconds it is killed; whatever is still mounted is detached lazily.
pub struct ChildMount {
    child: Child,
    stdin: Option<ChildStdin>,
    dir: tempfile::TempDir,
    output: Arc<Mutex<String>>,
}

impl ChildMount {
    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The process id of the client process.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the client process printed on stdout so far.
    pub fn output(&self) -> String {
        self.output
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for ChildMount {
    fn drop(&mut self) {
        // EOF on stdin asks the child to unmount and exit.
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
            }
        }
        lazy_unmount(self.dir.path());
    }
}

/// The body of a client process's test (see [`Cluster::spawn_mount_process`]): when this
/// process was started as one, connects, mounts, prints the ready line, serves until stdin is
/// closed, then unmounts. Run normally (no environment), it returns at once.
pub fn child_mount_main() {
    let (Ok(meta), Ok(scheme), Some(mountpoint)) = (
        std::env::var(ENV_META),
        std::env::var(ENV_SCHEME),
        std::env::var_os(ENV_MOUNTPOINT),
    ) else {
        return;
    };
    let scheme: LockScheme = scheme.parse().expect("scheme");
    let mut opts = MountOptions::new(meta, CLUSTER, TOKEN);
    opts.scheme = scheme;
    let fs = Arc::new(CitronFs::connect(opts).expect("the client process connects"));
    let handle = fs_client::fuse::mount(fs, &mountpoint, &FuseOptions::default())
        .expect("the client process mounts");
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{READY}");
    let _ = stdout.flush();
    drop(stdout);
    // Serve until the parent closes stdin (or dies, which closes it too).
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        line.clear();
    }
    if handle.unmount().is_err() {
        lazy_unmount(Path::new(&mountpoint));
    }
}

/// `len` bytes of a pattern that differs at every file offset and per `seed`, so that data
/// read back at the wrong offset or from the wrong writer is caught.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (offset + i).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(31);
            (x >> 29) as u8
        })
        .collect()
}
