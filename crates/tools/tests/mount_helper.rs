//! The mount(8) helper end to end, as an operator uses it: `citronfs` symlinked as
//! /sbin/mount.citronfs and /sbin/mount.fuse.citronfs (mount(8) looks for helpers there only;
//! the links are removed when each test ends, also when it fails), then `mount -t citronfs
//! HOST:PORT DIR -o token_file=...`, and `mount --fstab FILE DIR` with an fstab line of the
//! test's own, mount a cluster: /proc/mounts and findmnt show `fuse.citronfs`, files written
//! there read back, and `umount DIR` unmounts and ends the background process. A token file
//! that others may read, and a wrong token, are refused with exit status 32 and a clear
//! message. Needs root (to mount, and to write /sbin) and FUSE: skipped otherwise.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use testkit::{Cluster, ClusterSpec, Need};

/// The helper's links are shared by every test of this file: one test at a time.
static HELPER_LINKS: Mutex<()> = Mutex::new(());

/// The helper installed where mount(8) looks for it, removed on drop.
struct HelperLinks {
    links: Vec<PathBuf>,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

impl HelperLinks {
    fn install() -> HelperLinks {
        let guard = HELPER_LINKS.lock().unwrap_or_else(|e| e.into_inner());
        let exe = Path::new(env!("CARGO_BIN_EXE_citronfs"));
        let mut links = HelperLinks {
            links: Vec::new(),
            _one_at_a_time: guard,
        };
        for name in ["mount.citronfs", "mount.fuse.citronfs"] {
            let link = Path::new("/sbin").join(name);
            // Another run's links (a test binary of another checkout): wait for them to go.
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                match std::os::unix::fs::symlink(exe, &link) {
                    Ok(()) => {
                        links.links.push(link);
                        break;
                    }
                    // Installed by hand, of this very binary: used, and left in place.
                    Err(_)
                        if std::fs::canonicalize(&link).ok() == std::fs::canonicalize(exe).ok() =>
                    {
                        break
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        assert!(
                            Instant::now() < deadline,
                            "{} exists and is not this test's: remove it to run this test",
                            link.display()
                        );
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    Err(e) => panic!("cannot link {}: {e}", link.display()),
                }
            }
        }
        links
    }
}

impl Drop for HelperLinks {
    fn drop(&mut self) {
        for link in &self.links {
            let _ = std::fs::remove_file(link);
        }
    }
}

/// A mount point, lazily unmounted on drop if a test left it mounted.
struct MountPoint(tempfile::TempDir);

impl MountPoint {
    fn new() -> MountPoint {
        MountPoint(
            tempfile::Builder::new()
                .prefix("citronfs-helper-")
                .tempdir()
                .unwrap(),
        )
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for MountPoint {
    fn drop(&mut self) {
        if is_mounted(self.path()) {
            let _ = Command::new("umount").arg("-l").arg(self.path()).status();
        }
    }
}

fn is_mounted(dir: &Path) -> bool {
    fs_client::fuse::is_mount_point(dir).unwrap_or(false)
}

/// Skips the calling test unless it runs as root with FUSE.
macro_rules! skip_unless_root_with_fuse {
    () => {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            testkit::skip(
                Need::Root,
                "mount(8) and its helper in /sbin need root (CI runs as root)",
            );
            return;
        }
        testkit::skip_without_fuse!();
    };
}

/// A started cluster and a private file holding its token.
struct Setup {
    cluster: Cluster,
    _dir: tempfile::TempDir,
    token_file: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        let cluster = Cluster::start(ClusterSpec::default()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, format!("{}\n", cluster.token())).unwrap();
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        Setup {
            cluster,
            _dir: dir,
            token_file,
        }
    }

    fn spec(&self) -> String {
        self.cluster.meta_addr().to_string()
    }

    fn options(&self) -> String {
        format!(
            "token_file={},cluster={}",
            self.token_file.display(),
            self.cluster.name()
        )
    }
}

/// Runs `command` (mount(8) or umount(8)), bounded: the helper must return once mounted.
fn run(command: &mut Command) -> Output {
    let start = Instant::now();
    let output = command.output().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{command:?} took {:?}",
        start.elapsed()
    );
    output
}

fn text(output: &Output) -> String {
    format!(
        "status {:?}, stdout {:?}, stderr {:?}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The /proc/mounts line of `dir`: (source, type).
fn mount_entry(dir: &Path) -> Option<(String, String)> {
    let table = std::fs::read_to_string("/proc/mounts").unwrap();
    table.lines().rev().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        (fields.get(1) == Some(&dir.to_str().unwrap()))
            .then(|| (fields[0].to_string(), fields[2].to_string()))
    })
}

/// The process serving the mount at `dir`: the helper's background process, found by its
/// command line (`/sbin/mount.citronfs SPEC DIR ...`).
fn helper_process(dir: &Path) -> Option<u32> {
    let dir = dir.to_str().unwrap();
    std::fs::read_dir("/proc").ok()?.find_map(|entry| {
        let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        let first = String::from_utf8_lossy(args.first()?);
        let name = first.rsplit('/').next()?;
        let helper = name.starts_with("mount.") && name.ends_with(".citronfs");
        (helper && args.contains(&dir.as_bytes())).then_some(pid)
    })
}

/// Whether `pid` has exited (gone, or a zombie nobody reaped yet).
fn has_exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

/// Checks a mount made by the helper at `dir` of `spec`, uses it, unmounts it with umount(8),
/// and checks that the background process ended.
fn check_mounted_then_unmount(dir: &Path, spec: &str) {
    let (source, fstype) = mount_entry(dir).expect("mounted");
    assert_eq!(fstype, "fuse.citronfs", "/proc/mounts type");
    assert_eq!(source, spec, "/proc/mounts source");
    let findmnt = run(Command::new("findmnt")
        .args(["-n", "-o", "FSTYPE,SOURCE"])
        .arg(dir));
    let shown = String::from_utf8_lossy(&findmnt.stdout);
    assert_eq!(
        shown.split_whitespace().collect::<Vec<_>>(),
        ["fuse.citronfs", spec],
        "{}",
        text(&findmnt)
    );
    let pid = helper_process(dir).expect("a background process serves the mount");

    let file = dir.join("hello.txt");
    std::fs::write(&file, b"mounted by mount(8)\n").unwrap();
    assert_eq!(std::fs::read(&file).unwrap(), b"mounted by mount(8)\n");
    std::fs::remove_file(&file).unwrap();

    let umount = run(Command::new("umount").arg(dir));
    assert!(umount.status.success(), "umount: {}", text(&umount));
    assert!(!is_mounted(dir));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !has_exited(pid) {
        assert!(
            Instant::now() < deadline,
            "the helper's process {pid} still runs after umount"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn mount_t_citronfs_mounts_and_umount_ends_it() {
    skip_unless_root_with_fuse!();
    let setup = Setup::new();
    let _links = HelperLinks::install();
    let dir = MountPoint::new();
    let mount = run(Command::new("mount")
        .args(["-t", "citronfs", &setup.spec()])
        .arg(dir.path())
        .args(["-o", &format!("{},_netdev,nofail", setup.options())]));
    assert!(mount.status.success(), "mount: {}", text(&mount));
    check_mounted_then_unmount(dir.path(), &setup.spec());
}

#[test]
fn an_fstab_line_of_type_fuse_citronfs_mounts() {
    skip_unless_root_with_fuse!();
    let setup = Setup::new();
    let _links = HelperLinks::install();
    let dir = MountPoint::new();
    let fstab_dir = tempfile::tempdir().unwrap();
    let fstab = fstab_dir.path().join("fstab");
    std::fs::write(
        &fstab,
        format!(
            "# CitronFS\n{} {} fuse.citronfs {},_netdev,nofail,x-systemd.automount,\
             x-systemd.mount-timeout=30 0 0\n",
            setup.spec(),
            dir.path().display(),
            setup.options()
        ),
    )
    .unwrap();
    let mount = run(Command::new("mount")
        .arg("--fstab")
        .arg(&fstab)
        .arg(dir.path()));
    assert!(mount.status.success(), "mount --fstab: {}", text(&mount));
    check_mounted_then_unmount(dir.path(), &setup.spec());
}

#[test]
fn a_token_file_others_may_read_is_refused() {
    skip_unless_root_with_fuse!();
    let setup = Setup::new();
    std::fs::set_permissions(&setup.token_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let _links = HelperLinks::install();
    let dir = MountPoint::new();
    let mount = run(Command::new("mount")
        .args(["-t", "citronfs", &setup.spec()])
        .arg(dir.path())
        .args(["-o", &setup.options()]));
    assert_eq!(mount.status.code(), Some(32), "{}", text(&mount));
    let err = String::from_utf8_lossy(&mount.stderr);
    assert!(
        err.contains("mode 0644") && err.contains("chmod 600"),
        "{}",
        text(&mount)
    );
    assert!(!is_mounted(dir.path()));
}

#[test]
fn a_wrong_token_is_refused() {
    skip_unless_root_with_fuse!();
    let setup = Setup::new();
    std::fs::write(&setup.token_file, "not-the-token\n").unwrap();
    let _links = HelperLinks::install();
    let dir = MountPoint::new();
    let mount = run(Command::new("mount")
        .args(["-t", "fuse.citronfs", &setup.spec()])
        .arg(dir.path())
        .args(["-o", &setup.options()]));
    assert_eq!(mount.status.code(), Some(32), "{}", text(&mount));
    let err = String::from_utf8_lossy(&mount.stderr);
    assert!(
        err.contains("mount.fuse.citronfs") && err.contains("token"),
        "{}",
        text(&mount)
    );
    assert!(!is_mounted(dir.path()));
    assert!(helper_process(dir.path()).is_none(), "nothing left running");
}

/// docs/OPERATIONS.md, "Deploying a cluster on several hosts", followed on network namespaces
/// standing for the hosts: a meta server and two data servers, each in its own namespace with
/// its own settings file (addresses of its host, the shared token file), and a client
/// namespace that mounts the cluster from an fstab line with mount(8). Files written through
/// the mount are spread over both data servers, as `citronfs status` (run on the client host)
/// shows, and read back whole; `umount` ends it.
#[test]
fn a_cluster_on_three_hosts_deployed_as_the_guide_says_mounts_from_fstab() {
    skip_unless_root_with_fuse!();
    testkit::skip_without_netns!();
    let bin = Path::new(env!("CARGO_BIN_EXE_citronfs"));
    let net = testkit::netns::Network::new(&["meta", "ds0", "ds1", "client"]).unwrap();
    let etc = tempfile::tempdir().unwrap();
    let token_file = etc.path().join("token");
    std::fs::write(&token_file, "deploy-test-secret\n").unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let meta_at = net.host("meta").at(7700);
    let settings = |name: &str, body: String| {
        let path = etc.path().join(name);
        std::fs::write(&path, body).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    };
    let common = format!(
        "cluster = \"prod\"\ntoken_file = \"{}\"\nfabric = \"tcp\"\n",
        token_file.display()
    );
    let meta_toml = settings(
        "meta.toml",
        format!(
            "{common}db = \"{}\"\nlisten = \"{meta_at}\"\nchunk_size = \"64K\"\n",
            etc.path().join("meta-db").display()
        ),
    );
    let mut meta = net
        .spawn("meta", "meta server", {
            let mut c = Command::new(bin);
            c.args(["meta-server", "--config"]).arg(&meta_toml);
            c
        })
        .unwrap();
    let mut data = Vec::new();
    for name in ["ds0", "ds1"] {
        let toml = settings(
            &format!("data-{name}.toml"),
            format!(
                "{common}name = \"{name}\"\nmeta = \"{meta_at}\"\nfabric_listen = \"{}\"\n\
                 capacity = \"64M\"\n",
                net.host(name).at(7800)
            ),
        );
        data.push(
            net.spawn(name, "data server", {
                let mut c = Command::new(bin);
                c.args(["data-server", "--config"]).arg(&toml);
                c
            })
            .unwrap(),
        );
    }
    // Every data server live, as the client host's `citronfs status` sees it.
    let status = || {
        let mut c = Command::new(bin);
        c.args(["status", "--json", "--cluster", "prod", "--meta"])
            .arg(meta_at.to_string())
            .arg("--token-file")
            .arg(&token_file);
        let _ns = net.enter("client", &mut c).unwrap();
        let out = c.output().unwrap();
        out.status
            .success()
            .then(|| serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap())
    };
    let live = |s: &serde_json::Value| {
        s["data_servers"]
            .as_array()
            .map_or(0, |a| a.iter().filter(|d| d["live"] == true).count())
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if status().is_some_and(|s| live(&s) == 2) {
            break;
        }
        assert!(
            meta.is_running() && data.iter_mut().all(|d| d.is_running()),
            "a server exited: {}\n{}",
            meta.output(),
            data.iter().map(|d| d.output()).collect::<String>()
        );
        assert!(
            Instant::now() < deadline,
            "two live data servers within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let _links = HelperLinks::install();
    let dir = MountPoint::new();
    let fstab = etc.path().join("fstab");
    std::fs::write(
        &fstab,
        format!(
            "{meta_at}  {}  fuse.citronfs  token_file={},cluster=prod,_netdev,nofail  0  0\n",
            dir.path().display(),
            token_file.display()
        ),
    )
    .unwrap();
    let mut mount = Command::new("mount");
    mount.arg("--fstab").arg(&fstab).arg(dir.path());
    let ns = net.enter("client", &mut mount).unwrap();
    let mounted = run(&mut mount);
    drop(ns);
    assert!(
        mounted.status.success(),
        "mount --fstab: {}",
        text(&mounted)
    );
    assert_eq!(
        mount_entry(dir.path()),
        Some((meta_at.to_string(), "fuse.citronfs".to_string()))
    );

    // 16 files of 256 KiB (4 chunks each): both data servers get chunks.
    let files: Vec<(PathBuf, Vec<u8>)> = (0..16u64)
        .map(|i| {
            (
                dir.path().join(format!("f{i}")),
                testkit::pattern(i, 0, 256 << 10),
            )
        })
        .collect();
    for (path, bytes) in &files {
        std::fs::write(path, bytes).unwrap();
    }
    for (path, bytes) in &files {
        assert!(
            std::fs::read(path).unwrap() == *bytes,
            "{} read back",
            path.display()
        );
    }
    let s = status().expect("status from the client host");
    let used: Vec<u64> = s["data_servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["capacity_bytes"].as_u64().unwrap() - d["free_bytes"].as_u64().unwrap())
        .collect();
    assert!(
        used.len() == 2 && used.iter().all(|&u| u > 0),
        "both data servers hold chunks: used {used:?}"
    );

    let pid = helper_process(dir.path()).expect("a background process serves the mount");
    let umount = run(Command::new("umount").arg(dir.path()));
    assert!(umount.status.success(), "umount: {}", text(&umount));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !has_exited(pid) {
        assert!(
            Instant::now() < deadline,
            "the mount's process ends after umount"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
