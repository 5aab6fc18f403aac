//! Several "hosts" on one machine, for tests of real network faults: each host is a network
//! namespace with its own address, wired to a private switch (a bridge in a namespace of its
//! own) by a veth pair whose switch end [`Network::cut`] takes down and [`Network::heal`]
//! brings back up — a pulled cable, as seen by TCP: nothing is closed or answered, packets
//! are simply lost.
//!
//! ```text
//!   host "meta" (ns cfs-PID-N-meta)    eth0 10.77.0.1/24 ──veth── h0 ┐
//!   host "ds1"  (ns cfs-PID-N-ds1)     eth0 10.77.0.2/24 ──veth── h1 ├─ br0 (ns cfs-PID-N-sw)
//!   ...                                                               ┘
//! ```
//!
//! Processes run in a host with [`Network::spawn`], which enters only the host's *network*
//! namespace (`setns(CLONE_NEWNET)` between fork and exec): unlike `ip netns exec`, which also
//! unshares the mount namespace, the process keeps this one's, so a FUSE mount it makes is
//! visible to the test. [`Network::connect_from`] opens a TCP connection from inside a host
//! (on a thread that enters its namespace; a socket keeps the namespace it was made in).
//!
//! Cleanup is RAII: dropping a [`HostProcess`] stops its process (SIGTERM, then SIGKILL),
//! dropping a [`MountProcess`] also detaches its mount, and dropping the [`Network`] deletes
//! every namespace it made, with the interfaces in them — also when the test panics. A test
//! process killed outright leaves its namespaces behind; the next [`Network::new`] deletes
//! those of processes that no longer exist (their names carry the pid).
//!
//! Everything here needs root, `ip` (iproute2) and network namespaces: [`netns_unavailable`]
//! says why not, and [`skip_without_netns!`](crate::skip_without_netns) skips a test cleanly.

use anyhow::{bail, Context, Result};
use cluster::{is_mounted, lazy_unmount};
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// The prefix of every namespace this module makes: `cfs-<pid>-<n>-<host>`.
const PREFIX: &str = "cfs-";
/// The switch's subnet: hosts get `10.77.0.1`, `10.77.0.2`, ... in the order given. Each
/// network has its own switch namespace, so networks of concurrent tests never meet and may
/// use the same addresses.
const SUBNET: [u8; 3] = [10, 77, 0];
/// How long a process may take to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Skips the current test (the skip recorded, [`crate::skip`]) unless network namespaces can
/// be made here: root, `ip` on the path, and a kernel and container that allow them.
#[macro_export]
macro_rules! skip_without_netns {
    () => {
        if let Some(why) = $crate::netns::netns_unavailable() {
            $crate::skip($crate::Need::Netns, &why);
            return;
        }
    };
}

/// Why network namespaces cannot be used here (`None`: they can): not root, no `ip`, or
/// creating one fails (no CAP_SYS_ADMIN in a container, no /run/netns). Probed once per
/// process.
pub fn netns_unavailable() -> Option<String> {
    static ANSWER: OnceLock<Option<String>> = OnceLock::new();
    ANSWER.get_or_init(probe).clone()
}

fn probe() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("network namespaces need root".into());
    }
    if ip(&["-V"]).is_err() {
        return Some("`ip` (iproute2) is not installed".into());
    }
    remove_stale_namespaces();
    let probe = format!("{PREFIX}{}-probe", std::process::id());
    match ip(&["netns", "add", &probe]) {
        Ok(()) => {
            let _ = ip(&["netns", "del", &probe]);
            None
        }
        Err(e) => Some(format!("cannot create a network namespace: {e:#}")),
    }
}

/// Runs `ip ARGS`, failing with its stderr.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("run `ip`")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// One host of a [`Network`].
#[derive(Clone, Debug)]
pub struct Host {
    name: String,
    ns: String,
    addr: Ipv4Addr,
    /// The switch's end of the host's veth pair (in the switch namespace).
    port: String,
}

impl Host {
    /// The host's name, as given to [`Network::new`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The host's network namespace (a name under /run/netns).
    pub fn ns(&self) -> &str {
        &self.ns
    }

    /// The host's address on the switch.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// `addr:port` on this host.
    pub fn at(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.addr, port))
    }
}

/// Hosts on a private switch, each a network namespace (see the module docs). Dropping it
/// deletes every namespace it made; stop its processes first (declare the [`Network`] before
/// them, so that it is dropped after them).
#[derive(Debug)]
pub struct Network {
    /// The switch's namespace (made first, deleted last).
    switch: String,
    hosts: Vec<Host>,
    /// Every namespace made so far, for cleanup, including a half-built network's.
    made: Vec<String>,
}

impl Network {
    /// Makes a switch and one host per name (`10.77.0.1`, `10.77.0.2`, ... in order), each
    /// with loopback and its link up. Fails (deleting what it made) if any step fails.
    pub fn new(names: &[&str]) -> Result<Network> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        if names.len() > 250 {
            bail!("at most 250 hosts on one switch");
        }
        remove_stale_namespaces();
        let id = format!(
            "{PREFIX}{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut net = Network {
            switch: format!("{id}-sw"),
            hosts: Vec::new(),
            made: Vec::new(),
        };
        net.add_ns(&net.switch.clone())?;
        let sw = net.switch.clone();
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for (i, name) in names.iter().enumerate() {
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric()) {
                bail!("host name {name:?}: use ASCII letters and digits");
            }
            if net.hosts.iter().any(|h| h.name == *name) {
                bail!("host name {name:?} given twice");
            }
            let ns = format!("{id}-{name}");
            net.add_ns(&ns)?;
            let port = format!("h{i}");
            let addr = Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], i as u8 + 1);
            // Made inside the switch namespace with its peer put straight into the host's:
            // no interface ever exists in this (the test's) namespace, so names cannot clash
            // with the machine's or another test's.
            ip(&[
                "-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                &ns,
            ])?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &sw, "link", "set", &port, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            net.hosts.push(Host {
                name: name.to_string(),
                ns,
                addr,
                port,
            });
        }
        Ok(net)
    }

    /// Makes namespace `ns` with loopback up, remembering it for cleanup.
    fn add_ns(&mut self, ns: &str) -> Result<()> {
        ip(&["netns", "add", ns])?;
        self.made.push(ns.to_string());
        ip(&["-n", ns, "link", "set", "lo", "up"])
    }

    /// The host named `name`; panics if there is none (a test's mistake).
    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name:?} in this network"))
    }

    /// Cuts host `name` off the switch: its link goes down (no carrier at either end), so
    /// every packet to or from it is lost; its sockets stay open and nothing tells its peers.
    pub fn cut(&self, name: &str) -> Result<()> {
        let port = &self.host(name).port;
        ip(&["-n", &self.switch, "link", "set", port, "down"])
    }

    /// Reconnects host `name` to the switch (undoes [`Network::cut`]).
    pub fn heal(&self, name: &str) -> Result<()> {
        let port = &self.host(name).port;
        ip(&["-n", &self.switch, "link", "set", port, "up"])
    }

    /// Cuts only the path between hosts `a` and `b`, silently, while both keep talking to
    /// every other host: each gets a route to the other through a third host of the switch,
    /// which does not forward (a namespace's default) and drops those packets without a word —
    /// no ICMP, nothing fails locally. Undone by [`Network::heal_between`].
    pub fn cut_between(&self, a: &str, b: &str) -> Result<()> {
        let (ha, hb) = (self.host(a), self.host(b));
        let Some(third) = self.hosts.iter().find(|h| h.name != a && h.name != b) else {
            bail!("cutting a path needs a third host on the switch");
        };
        let via = third.addr.to_string();
        for (from, to) in [(ha, hb), (hb, ha)] {
            let dest = format!("{}/32", to.addr);
            ip(&["-n", &from.ns, "route", "add", &dest, "via", &via])?;
        }
        Ok(())
    }

    /// Undoes [`Network::cut_between`].
    pub fn heal_between(&self, a: &str, b: &str) -> Result<()> {
        let (ha, hb) = (self.host(a), self.host(b));
        for (from, to) in [(ha, hb), (hb, ha)] {
            ip(&["-n", &from.ns, "route", "del", &format!("{}/32", to.addr)])?;
        }
        Ok(())
    }

    /// Makes `command` run on host `host` (in its network namespace only: mounts and files
    /// stay the machine's); the processes it forks stay there too. Keep the returned file
    /// open until the command has been started.
    pub fn enter(&self, host: &str, command: &mut Command) -> Result<File> {
        let ns = &self.host(host).ns;
        let netns = File::open(Path::new("/run/netns").join(ns))
            .with_context(|| format!("open the namespace {ns}"))?;
        let fd = netns.as_raw_fd();
        // SAFETY: the hook runs between fork and exec and calls only setns(2), which is
        // async-signal-safe; the caller keeps `netns` (so `fd`) open until the command has
        // started, and it is close-on-exec, so the program does not inherit it.
        unsafe {
            command.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(netns)
    }

    /// Starts `command` on host `host` (in its network namespace only; see the module docs),
    /// its stdout and stderr collected under `label`. The guard stops it on drop.
    pub fn spawn(&self, host: &str, label: &str, mut command: Command) -> Result<HostProcess> {
        let netns = self.enter(host, &mut command)?;
        // Stopped with this process even when it is killed (`die_with_parent`).
        crate::die_with_parent(&mut command);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .with_context(|| format!("start {label} on host {host}"))?;
        drop(netns);
        let output = Arc::new(Mutex::new(String::new()));
        for stream in [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let output = output.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    let mut out = output.lock().unwrap_or_else(PoisonError::into_inner);
                    out.push_str(&line);
                    out.push('\n');
                }
            });
        }
        Ok(HostProcess {
            child,
            label: format!("{label}@{host}"),
            output,
        })
    }

    /// Opens a TCP connection to `to` from inside host `host`, waiting at most `timeout`:
    /// what a program on that host would get (for readiness checks and probes).
    pub fn connect_from(
        &self,
        host: &str,
        to: SocketAddr,
        timeout: Duration,
    ) -> std::io::Result<TcpStream> {
        self.run_in(host, move || TcpStream::connect_timeout(&to, timeout))?
    }

    /// Runs `f` on a thread inside host `host`'s network namespace and returns its result:
    /// sockets it makes belong to the host (a socket keeps the namespace it was made in).
    pub fn run_in<T: Send + 'static>(
        &self,
        host: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<T> {
        let path = Path::new("/run/netns").join(&self.host(host).ns);
        // setns changes the calling thread's namespace only: do it on a thread of its own,
        // which ends with the namespace it entered.
        std::thread::spawn(move || {
            let netns = File::open(path)?;
            // SAFETY: a valid namespace file descriptor and a namespace type; affects this
            // short-lived thread only.
            if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| {
            Err(std::io::Error::other(
                "the thread in the namespace panicked",
            ))
        })
    }

    /// The names of the namespaces this network made (the switch's first).
    pub fn namespaces(&self) -> &[String] {
        &self.made
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Hosts first, the switch (made first) last; deleting a namespace deletes the
        // interfaces in it, and a veth pair goes with either end.
        for ns in self.made.iter().rev() {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("testkit::netns: cleanup: {e:#}");
            }
        }
    }
}

/// Deletes the namespaces left by test processes that died without cleaning up (killed
/// outright): names `cfs-PID-...` whose PID no longer runs.
fn remove_stale_namespaces() {
    let Ok(list) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for entry in list.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}

/// A process running on a host of a [`Network`]; stopped on drop (SIGTERM, then SIGKILL
/// after 5 s). When the test is panicking, what it printed is shown.
pub struct HostProcess {
    child: Child,
    label: String,
    output: Arc<Mutex<String>>,
}

impl HostProcess {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What it printed so far (stdout and stderr, line by line).
    pub fn output(&self) -> String {
        self.output
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Waits until its output contains `text`; fails if it exits first or `timeout` passes.
    pub fn wait_for_output(&mut self, text: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(1);
        loop {
            if self.output().contains(text) {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited ({status}) before printing {text:?}; its output:\n{}",
                    self.label,
                    self.output()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not print {text:?} within {timeout:?}; its output:\n{}",
                    self.label,
                    self.output()
                );
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Whether it is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Asks it to stop (SIGTERM), kills it if it has not exited within 5 s, and reaps it.
    pub fn stop(&mut self) {
        if self.is_running() {
            // SAFETY: kill(2) on our own child's pid, which is not yet reaped (so not reused).
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = Instant::now() + STOP_TIMEOUT;
            while self.is_running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills it at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for HostProcess {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("--- output of {} ---\n{}", self.label, self.output());
        }
    }
}

/// A `citronfs mount` (or any FUSE server) process on a host, with its own mount point.
/// On drop: the process is stopped (SIGTERM makes `citronfs mount` unmount), and whatever is
/// still mounted is detached lazily; the mount point is removed.
pub struct MountProcess {
    // Field order is drop order: the process stops before the directory goes.
    process: HostProcess,
    dir: tempfile::TempDir,
}

impl MountProcess {
    /// A fresh, empty mount point directory, to pass to the program started by
    /// [`MountProcess::start`].
    pub fn mount_point() -> Result<tempfile::TempDir> {
        tempfile::Builder::new()
            .prefix("citronfs-netns-mnt-")
            .tempdir()
            .context("make a mount point")
    }

    /// Starts `command` (which must mount at `dir`) on host `host` and waits, at most
    /// `timeout`, until `dir` is a mount point.
    pub fn start(
        net: &Network,
        host: &str,
        dir: tempfile::TempDir,
        command: Command,
        timeout: Duration,
    ) -> Result<MountProcess> {
        let process = net.spawn(host, "mount", command)?;
        let mut mount = MountProcess { process, dir };
        let deadline = Instant::now() + timeout;
        while !is_mounted(mount.path()) {
            if !mount.process.is_running() {
                bail!(
                    "the mount process on {host} exited before mounting; its output:\n{}",
                    mount.process.output()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "the mount process on {host} did not mount within {timeout:?}; its \
                     output:\n{}",
                    mount.process.output()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(mount)
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The mount point as an owned path.
    pub fn path_buf(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// The process serving the mount.
    pub fn process(&mut self) -> &mut HostProcess {
        &mut self.process
    }
}

impl Drop for MountProcess {
    fn drop(&mut self) {
        // A FUSE server that exits (or is killed) closes /dev/fuse, which aborts the
        // connection: requests still waiting get ENOTCONN, so nothing hangs on it.
        self.process.stop();
        lazy_unmount(self.dir.path());
    }
}

/// What [`ProcessCluster::start`] builds.
#[derive(Clone, Debug)]
pub struct ProcessClusterSpec {
    /// Data servers: hosts `ds1`, `ds2`, ...
    pub data_servers: usize,
    /// Client hosts: `c1`, `c2`, ... (each mounted by [`ProcessCluster::mount`]).
    pub clients: usize,
    /// Bytes per chunk (small, so that a small file spans several chunks and servers).
    pub chunk_size: u64,
    /// Bytes each data server serves.
    pub data_capacity: u64,
    /// The log filter of every process.
    pub log: String,
}

impl Default for ProcessClusterSpec {
    fn default() -> Self {
        ProcessClusterSpec {
            data_servers: 2,
            clients: 2,
            chunk_size: 64 << 10,
            data_capacity: 16 << 20,
            log: "warn".into(),
        }
    }
}

/// The meta server's RPC port on its host.
const META_PORT: u16 = 7700;
/// How long a server or a mount may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A CitronFS cluster of `citronfs` processes, one host each, over the tcp fabric on a
/// [`Network`]: host `meta` runs `citronfs meta-server`, `ds1`... `citronfs data-server`
/// (memory-backed), and `c1`... are client hosts where [`ProcessCluster::mount`] runs
/// `citronfs mount`. Dropping it stops the mounts, then the data servers, then the meta
/// server, then deletes the network.
pub struct ProcessCluster {
    // Field order is drop order.
    mounts: Vec<Option<MountProcess>>,
    data: Vec<HostProcess>,
    meta: HostProcess,
    _state: tempfile::TempDir,
    bin: PathBuf,
    cluster: String,
    token: String,
    log: String,
    net: Network,
}

impl ProcessCluster {
    /// Builds the network and starts the servers of `spec` with the `citronfs` binary `bin`;
    /// returns once the meta server answers and every data server has registered.
    pub fn start(bin: &Path, spec: &ProcessClusterSpec) -> Result<ProcessCluster> {
        let mut names = vec!["meta".to_string()];
        names.extend((1..=spec.data_servers).map(|i| format!("ds{i}")));
        names.extend((1..=spec.clients).map(|i| format!("c{i}")));
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let net = Network::new(&refs)?;
        let state = tempfile::Builder::new()
            .prefix("citronfs-netns-")
            .tempdir()
            .context("state directory")?;
        let token = crate::random_token()?;
        let cluster = format!("netns-{}", std::process::id());
        let meta_at = net.host("meta").at(META_PORT);
        let common = |role: &str| {
            let mut c = Command::new(bin);
            c.arg(role)
                .args(["--cluster", &cluster, "--token", &token, "--log", &spec.log])
                .args(["--fabric", "tcp"]);
            // Settings from this process's environment must not reach the cluster.
            for (key, _) in std::env::vars_os() {
                if key.to_string_lossy().starts_with("CITRONFS_") {
                    c.env_remove(key);
                }
            }
            c
        };
        let mut cmd = common("meta-server");
        cmd.arg("--listen")
            .arg(meta_at.to_string())
            .arg("--db")
            .arg(state.path().join("meta-db"))
            .args(["--chunk-size", &spec.chunk_size.to_string()]);
        let meta = net.spawn("meta", "meta-server", cmd)?;
        let deadline = Instant::now() + START_TIMEOUT;
        while net
            .connect_from("meta", meta_at, Duration::from_secs(1))
            .is_err()
        {
            if Instant::now() >= deadline {
                bail!(
                    "the meta server did not listen on {meta_at} within {START_TIMEOUT:?}; \
                     its output:\n{}",
                    meta.output()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut data = Vec::new();
        for i in 1..=spec.data_servers {
            let host = format!("ds{i}");
            let mut cmd = common("data-server");
            cmd.args(["--name", &host])
                .args(["--meta", &meta_at.to_string()])
                .args(["--fabric-listen", &net.host(&host).at(0).to_string()])
                .args(["--capacity", &spec.data_capacity.to_string()]);
            let mut ds = net.spawn(&host, "data-server", cmd)?;
            ds.wait_for_output("citronfs data-server: id", START_TIMEOUT)?;
            data.push(ds);
        }
        Ok(ProcessCluster {
            mounts: (0..spec.clients).map(|_| None).collect(),
            data,
            meta,
            _state: state,
            bin: bin.to_path_buf(),
            cluster,
            token,
            log: spec.log.clone(),
            net,
        })
    }

    /// The network, to cut and heal links.
    pub fn net(&self) -> &Network {
        &self.net
    }

    /// The meta server's process.
    pub fn meta(&mut self) -> &mut HostProcess {
        &mut self.meta
    }

    /// Data server `i` (1-based: host `ds{i}`).
    pub fn data_server(&mut self, i: usize) -> &mut HostProcess {
        &mut self.data[i - 1]
    }

    /// Mounts the cluster on client host `c{i}` (1-based) with `citronfs mount` and `extra`
    /// flags, replacing (stopping) a mount already there; returns the mount point.
    pub fn mount(&mut self, i: usize, extra: &[&str]) -> Result<PathBuf> {
        let slot = self
            .mounts
            .get_mut(i - 1)
            .with_context(|| format!("no client host c{i}"))?;
        drop(slot.take());
        let dir = MountProcess::mount_point()?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg("mount")
            .arg(dir.path())
            .args(["--cluster", &self.cluster, "--token", &self.token])
            .args(["--log", &self.log])
            .args(["--meta", &self.net.host("meta").at(META_PORT).to_string()])
            .args(extra);
        let mount = MountProcess::start(&self.net, &format!("c{i}"), dir, cmd, START_TIMEOUT)?;
        let path = mount.path_buf();
        *slot = Some(mount);
        Ok(path)
    }

    /// The mount process of client `c{i}`, if mounted.
    pub fn mount_process(&mut self, i: usize) -> Option<&mut MountProcess> {
        self.mounts.get_mut(i - 1).and_then(Option::as_mut)
    }

    /// Stops client `c{i}`'s mount (unmounting it).
    pub fn unmount(&mut self, i: usize) {
        if let Some(slot) = self.mounts.get_mut(i - 1) {
            drop(slot.take());
        }
    }
}
