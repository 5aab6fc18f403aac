//! Clients of the workload benchmarks (`bench btio`, ...) as the paper has them: separate
//! client processes, each its own `citronfs mount` of one embedded cluster (its own mountpoint,
//! endpoints and lock handles), so that coherence and lock traffic cross client boundaries as
//! on a cluster — or, with `--via library`, as many client-library instances in this process
//! (no FUSE), to separate FUSE's cost.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use cluster::Cluster;
use fs_client::{CitronFs, FileHandle, LockMode, LockScheme};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the workload reaches CitronFS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Via {
    /// Through FUSE: one `citronfs mount` process per client.
    Fuse,
    /// Through the client library in this process: one `CitronFs` per client.
    Library,
}

/// The options every workload benchmark over clients shares (`bench btio`, `bench oltp`).
#[derive(Args, Debug)]
pub struct WorkloadArgs {
    /// Clients: separate `citronfs mount` processes (or library instances with --via library).
    #[arg(long, default_value_t = 2)]
    pub clients: usize,
    /// Lock schemes, comma-separated, each run on fresh files in this one run.
    #[arg(long, value_delimiter = ',', default_value = "citron,mutex,seg,server",
          value_parser = clap::value_parser!(LockScheme))]
    pub scheme: Vec<LockScheme>,
    /// How reads lock their ranges, comma-separated: each scheme runs once per mode, on fresh
    /// files (shared: overlapping reads run together where the scheme shares; exclusive: as
    /// writes, the behaviour before shared reads). `shared,exclusive` compares them.
    #[arg(long, value_delimiter = ',', default_value = "shared",
          value_parser = clap::value_parser!(LockMode))]
    pub read_locks: Vec<LockMode>,
    /// Through FUSE mounts (client processes) or the client library (no FUSE).
    #[arg(long, value_enum, default_value = "fuse")]
    pub via: Via,
    /// Data servers of the embedded cluster.
    #[arg(long, default_value_t = 2)]
    pub data_servers: usize,
    /// Also draw the results into this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// One JSON object per result instead of the table.
    #[arg(long)]
    pub json: bool,
}

impl WorkloadArgs {
    /// The runs asked for, in order: every scheme, each with every read-lock mode.
    pub fn runs(&self) -> Vec<(LockScheme, LockMode)> {
        self.scheme
            .iter()
            .flat_map(|&s| self.read_locks.iter().map(move |&m| (s, m)))
            .collect()
    }

    /// Checks the options every workload shares, then starts the embedded cluster `name` on
    /// `fabric`, each data server of `per_server` bytes (with a lock server where a scheme asked
    /// for needs one).
    pub fn start_cluster(
        &self,
        name: &str,
        fabric: fabric::Backend,
        per_server: u64,
    ) -> Result<Cluster> {
        anyhow::ensure!(self.clients >= 1, "--clients must be at least 1");
        anyhow::ensure!(!self.scheme.is_empty(), "--scheme is empty");
        anyhow::ensure!(!self.read_locks.is_empty(), "--read-locks is empty");
        Cluster::start(cluster::ClusterSpec {
            name: name.into(),
            data_servers: self.data_servers,
            capacity: per_server,
            fabric,
            lock_server: self.scheme.iter().any(LockScheme::uses_service),
            ..cluster::ClusterSpec::server_defaults()
        })
    }

    /// The clients of one run (`scheme`, reads locked `reads`), announced on `run`; with the
    /// run's label ([`WorkloadArgs::label`]).
    pub fn start_clients(
        &self,
        cluster: &Cluster,
        scheme: LockScheme,
        reads: LockMode,
        run: &super::runner::Run,
    ) -> Result<(String, Clients)> {
        run.check()?;
        let label = self.label(scheme, reads);
        run.say(format!("{label}: starting {} clients", self.clients));
        let clients = Clients::start(cluster, scheme, reads, self.clients, self.via)?;
        Ok((label, clients))
    }

    /// The name of one run in tables and plots: the scheme, and its reads' mode when more than
    /// one was asked for.
    pub fn label(&self, scheme: LockScheme, reads: LockMode) -> String {
        if self.read_locks.len() > 1 {
            format!("{scheme} ({reads} reads)")
        } else {
            scheme.to_string()
        }
    }
}

/// One open file as a workload thread sees it: positional reads and writes.
pub trait SharedFile: Send + Sync {
    /// Writes all of `buf` at `offset` (one call: one range lock).
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()>;
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
}

impl SharedFile for File {
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        FileExt::write_all_at(self, buf, offset).context("pwrite")
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        FileExt::read_exact_at(self, buf, offset).context("pread")
    }
}

/// A file opened through the client library; its handle is released on drop.
pub struct LibraryFile {
    fs: Arc<CitronFs>,
    fh: FileHandle,
}

impl LibraryFile {
    /// Wraps handle `fh` of `fs` (released when this is dropped).
    pub fn new(fs: Arc<CitronFs>, fh: FileHandle) -> Self {
        Self { fs, fh }
    }
}

impl SharedFile for LibraryFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let n = self
            .fs
            .write(self.fh, offset, buf)
            .map_err(|e| anyhow::anyhow!("write: {e}"))?;
        anyhow::ensure!(n == buf.len(), "short write: {n} of {}", buf.len());
        Ok(())
    }
    /// Through [`CitronFs::read_into`] and a buffer each thread keeps, as the FUSE adapter
    /// reads over `/dev/fuse`: no allocation and no zeroing per call, one copy into `buf`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        thread_local! {
            static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        READ_BUF.with_borrow_mut(|own| {
            let n = self
                .fs
                .read_into(self.fh, offset, buf.len(), own)
                .map_err(|e| anyhow::anyhow!("read: {e}"))?;
            anyhow::ensure!(n == buf.len(), "short read: {n} of {}", buf.len());
            buf.copy_from_slice(&own[..n]);
            Ok(())
        })
    }
}

impl Drop for LibraryFile {
    fn drop(&mut self) {
        let _ = self.fs.release(self.fh);
    }
}

/// The clients of one run, all of one lock scheme.
pub struct Clients {
    kind: ClientsKind,
}

enum ClientsKind {
    Fuse(Vec<MountProcess>),
    Library(Vec<Arc<CitronFs>>),
}

/// A `citronfs mount` child process and its mountpoint; unmounted and stopped on drop.
struct MountProcess {
    child: Child,
    dir: tempfile::TempDir,
    /// Its stderr (removed with it).
    log: PathBuf,
}

impl Drop for MountProcess {
    fn drop(&mut self) {
        // SIGTERM: the mount unmounts and exits; a stuck one is killed and detached lazily.
        // SAFETY: kill(2) on our own child's pid touches no memory of ours.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() > deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    let _ = Command::new("umount")
                        .arg("-l")
                        .arg(self.dir.path())
                        .status();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// FUSE's `statfs` magic number.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

fn is_fuse_mount(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c_path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `statfs` is plain old data that the call only writes into; `c_path` is a valid
    // NUL-terminated string for the duration of the call.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c_path.as_ptr(), &mut st) == 0 && st.f_type as i64 == FUSE_SUPER_MAGIC
    }
}

impl Clients {
    /// Starts `count` clients of `cluster` with lock scheme `scheme`, their reads locking in
    /// mode `reads` (`MountOptions::read_locks`): `citronfs mount` processes (this same
    /// executable) or library instances.
    pub fn start(
        cluster: &Cluster,
        scheme: LockScheme,
        reads: LockMode,
        count: usize,
        via: Via,
    ) -> Result<Clients> {
        anyhow::ensure!(count >= 1, "at least one client is needed");
        let kind = match via {
            Via::Library => ClientsKind::Library(
                (0..count)
                    .map(|_| {
                        let mut options = cluster.options(scheme);
                        options.read_locks = reads;
                        CitronFs::connect(options).map(Arc::new).map_err(|e| {
                            anyhow::anyhow!("cannot open a session with the cluster: {e}")
                        })
                    })
                    .collect::<Result<_>>()?,
            ),
            Via::Fuse => {
                let exe = std::env::current_exe().context("this executable's path")?;
                let mut mounts = Vec::new();
                for _ in 0..count {
                    let dir = tempfile::Builder::new()
                        .prefix("citronfs-bench-client-")
                        .tempdir()?;
                    // Its log (and the line it prints once mounted) goes to a file next to
                    // the mountpoint, shown when it fails to mount.
                    let log_path = dir.path().with_extension("log");
                    let log = File::create(&log_path)
                        .with_context(|| format!("create {}", log_path.display()))?;
                    let mut command = Command::new(&exe);
                    // SIGTERM (it unmounts and exits) when this benchmark dies, however it
                    // dies: a killed benchmark leaves no mount of a cluster that went with it.
                    // `Clients` are started by the benchmark's main thread, which lives as
                    // long as they do.
                    cluster::die_with_parent(&mut command);
                    let child = command
                        .arg("mount")
                        .arg("--meta")
                        .arg(cluster.meta_addr().to_string())
                        .arg("--cluster")
                        .arg(cluster.name())
                        .arg("--scheme")
                        .arg(scheme.to_string())
                        .arg("--read-locks")
                        .arg(reads.to_string())
                        .arg(dir.path())
                        .env("CITRONFS_TOKEN", cluster.token())
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(log)
                        .spawn()
                        .with_context(|| format!("start {} mount", exe.display()))?;
                    let mut m = MountProcess {
                        child,
                        dir,
                        log: log_path,
                    };
                    let log_text = |m: &MountProcess| {
                        std::fs::read_to_string(&m.log)
                            .unwrap_or_default()
                            .trim()
                            .to_string()
                    };
                    let deadline = Instant::now() + Duration::from_secs(30);
                    while !is_fuse_mount(m.dir.path()) {
                        if let Some(status) = m.child.try_wait()? {
                            bail!(
                                "client process `citronfs mount` exited with {status}: {}",
                                log_text(&m)
                            );
                        }
                        if Instant::now() > deadline {
                            bail!("client process did not mount within 30 s: {}", log_text(&m));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    mounts.push(m);
                }
                ClientsKind::Fuse(mounts)
            }
        };
        Ok(Clients { kind })
    }

    /// How many clients there are.
    pub fn len(&self) -> usize {
        match &self.kind {
            ClientsKind::Fuse(m) => m.len(),
            ClientsKind::Library(l) => l.len(),
        }
    }

    /// Opens (creating it if needed) `name` in the root directory through client `i`, for
    /// reading and writing.
    pub fn open(&self, i: usize, name: &str) -> Result<Box<dyn SharedFile>> {
        match &self.kind {
            ClientsKind::Fuse(mounts) => {
                let path = mounts[i].dir.path().join(name);
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&path)
                    .with_context(|| format!("open {}", path.display()))?;
                Ok(Box::new(f))
            }
            ClientsKind::Library(clients) => {
                let fs = &clients[i];
                let caller = CitronFs::process_caller();
                let fh = match fs.lookup(proto::ROOT_INO, name) {
                    Ok(attr) => fs
                        .open(caller, attr.ino, libc::O_RDWR)
                        .map_err(|e| anyhow::anyhow!("open {name}: {e}"))?,
                    Err(_) => {
                        fs.create(caller, proto::ROOT_INO, name, 0o644, libc::O_RDWR)
                            .map_err(|e| anyhow::anyhow!("create {name}: {e}"))?
                            .1
                    }
                };
                Ok(Box::new(LibraryFile { fs: fs.clone(), fh }))
            }
        }
    }

    /// Removes `name` through client 0 (frees its space for the next run).
    pub fn remove(&self, name: &str) -> Result<()> {
        match &self.kind {
            ClientsKind::Fuse(mounts) => {
                let path: PathBuf = mounts[0].dir.path().join(name);
                std::fs::remove_file(&path).with_context(|| format!("remove {}", path.display()))
            }
            ClientsKind::Library(clients) => clients[0]
                .unlink(proto::ROOT_INO, name)
                .map_err(|e| anyhow::anyhow!("unlink {name}: {e}")),
        }
    }
}
