//! Client *processes* for tests: [`ClusterExt::spawn_mount_process`](crate::ClusterExt::spawn_mount_process) re-executes the current test
//! binary to run one named test, whose body is [`child_mount_main`]; it mounts the cluster and
//! serves until its stdin closes.
//!
//! The parent tells the child what to mount through environment variables (the `ENV_*`
//! constants), and the child says it has mounted by printing [`READY`] on stdout.

use cluster::{is_mounted, lazy_unmount, Cluster, Mount};
use fs_client::{CitronFs, LockScheme, MountOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

const ENV_META: &str = "CITRONFS_TEST_CHILD_META";
const ENV_CLUSTER: &str = "CITRONFS_TEST_CHILD_CLUSTER";
const ENV_TOKEN: &str = "CITRONFS_TEST_CHILD_TOKEN";
const ENV_SCHEME: &str = "CITRONFS_TEST_CHILD_SCHEME";
const ENV_MOUNTPOINT: &str = "CITRONFS_TEST_CHILD_MOUNTPOINT";
/// What a child prints once it has mounted.
const READY: &str = "CITRONFS-CHILD-MOUNTED";
/// How long a child may take to mount.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a child may take to unmount and exit once its stdin is closed, before it is killed.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

/// [`ClusterExt::spawn_mount_process`](crate::ClusterExt::spawn_mount_process).
pub(crate) fn spawn_mount_process(
    cluster: &Cluster,
    child_test: &str,
    scheme: LockScheme,
) -> ChildMount {
    let dir = tempfile::Builder::new()
        .prefix("citronfs-mnt-")
        .tempdir()
        .expect("mount point directory");
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut child = Command::new(exe)
        .args([child_test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ENV_META, cluster.meta_addr().to_string())
        .env(ENV_CLUSTER, cluster.name())
        .env(ENV_TOKEN, cluster.token())
        .env(ENV_SCHEME, scheme.to_string())
        .env(ENV_MOUNTPOINT, dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the client process");
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    let mut guard = ChildMount {
        child,
        stdin,
        dir,
        output: Arc::new(Mutex::new(String::new())),
        log: Arc::new(Mutex::new(String::new())),
    };
    // Its log goes on to this process's stderr as before (not through the test harness's
    // capture) and is kept for `ChildMount::log`.
    let log = guard.log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let _ = writeln!(std::io::stderr().lock(), "{line}");
            let mut kept = log.lock().unwrap_or_else(|e| e.into_inner());
            kept.push_str(&line);
            kept.push('\n');
        }
    });
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
    let deadline = Instant::now() + MOUNT_TIMEOUT;
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
                "the client process did not mount within {MOUNT_TIMEOUT:?}; its output:\n{}",
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

/// A client process with a FUSE mount of the cluster (see [`ClusterExt::spawn_mount_process`](crate::ClusterExt::spawn_mount_process)).
/// On drop: its stdin is closed (it unmounts and exits), and if it has not exited within a few
/// seconds it is killed; whatever is still mounted is detached lazily.
pub struct ChildMount {
    child: Child,
    stdin: Option<ChildStdin>,
    dir: tempfile::TempDir,
    output: Arc<Mutex<String>>,
    log: Arc<Mutex<String>>,
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

    /// What the client process logged (its stderr) so far: warnings by default, more with
    /// `RUST_LOG`.
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Stops the client process (SIGSTOP) until the returned guard is dropped (SIGCONT), so
    /// that a test that fails while it is stopped still lets it go on and exit.
    ///
    /// Its mount answers nothing meanwhile: a call of the test into it waits until then.
    pub fn stop(&self) -> Stopped {
        signal(self.pid(), libc::SIGSTOP);
        Stopped(self.pid())
    }
}

/// A stopped client process (see [`ChildMount::stop`]); continued when dropped.
#[must_use = "the process continues when this is dropped"]
pub struct Stopped(u32);

impl Drop for Stopped {
    fn drop(&mut self) {
        signal(self.0, libc::SIGCONT);
    }
}

/// Sends `sig` to child process `pid`; a failure is a test failure.
fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a child's pid touches no memory of ours.
    let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
}

impl Drop for ChildMount {
    fn drop(&mut self) {
        // EOF on stdin asks the child to unmount and exit.
        drop(self.stdin.take());
        let deadline = Instant::now() + EXIT_TIMEOUT;
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
        // Its server died with it: nothing to abort here, only the mount to detach.
        lazy_unmount(self.dir.path());
    }
}

/// The body of a client process's test (see [`ClusterExt::spawn_mount_process`](crate::ClusterExt::spawn_mount_process)): when this
/// process was started as one, connects, mounts, prints the ready line, serves until stdin is
/// closed, then unmounts. Run normally (no environment), it returns at once.
pub fn child_mount_main() {
    let (Ok(meta), Ok(cluster), Ok(token), Ok(scheme), Some(mountpoint)) = (
        std::env::var(ENV_META),
        std::env::var(ENV_CLUSTER),
        std::env::var(ENV_TOKEN),
        std::env::var(ENV_SCHEME),
        std::env::var_os(ENV_MOUNTPOINT),
    ) else {
        return;
    };
    // Its log goes to stderr (RUST_LOG; warn by default), which the parent passes on to its
    // own and keeps (`ChildMount::log`), so that a failing test shows what each client
    // process saw.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    tracing::info!(pid = std::process::id(), "client process starting");
    let mut options = MountOptions::new(meta, cluster, token);
    options.scheme = scheme.parse().expect("scheme");
    let fs = Arc::new(CitronFs::connect(options).expect("the client process connects"));
    let mount = Mount::at(fs, Path::new(&mountpoint), &cluster::fuse_options())
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
    // Dropping the mount unmounts it (lazily if busy).
    drop(mount);
}
