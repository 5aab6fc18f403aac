//! [`Mount`]: an in-process FUSE mount that is never left behind.

use anyhow::{Context, Result};
use fs_client::fuse::{FuseOptions, IoLimits, MountHandle};
use fs_client::CitronFs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

/// The mount point: a fresh directory of the mount's own, or one the caller gave.
enum MountDir {
    /// Removed (after the unmount) when the [`Mount`] is dropped.
    Temp(tempfile::TempDir),
    /// Left in place.
    Given(PathBuf),
}

impl MountDir {
    fn path(&self) -> &Path {
        match self {
            MountDir::Temp(dir) => dir.path(),
            MountDir::Given(path) => path,
        }
    }
}

/// An in-process FUSE mount of a [`CitronFs`] client. Dropping it unmounts; when that fails
/// (files still open, as after a panicking test) it detaches the mount lazily and aborts its
/// FUSE connection, so that neither a mount nor a hanging process is left behind.
pub struct Mount {
    // Field order is drop order: `Drop` unmounts before the directory is removed.
    handle: Option<MountHandle>,
    fs: Arc<CitronFs>,
    /// The mounted file system's device number (names its FUSE connection); 0 if unknown.
    dev: u64,
    dir: MountDir,
}

/// The FUSE options of a cluster's mounts: shared with every local user (`allow_other`,
/// the kernel checking permissions) where this process may mount so — root, or
/// `user_allow_other` in /etc/fuse.conf — else for this user only.
pub fn fuse_options() -> FuseOptions {
    FuseOptions {
        allow_other: fs_client::fuse::other_users_allowed().is_ok(),
        ..FuseOptions::default()
    }
}

impl Mount {
    /// Mounts `fs` in a fresh, empty directory (in the ordinary temporary directory).
    pub fn in_temp_dir(fs: Arc<CitronFs>, fuse: &FuseOptions) -> Result<Mount> {
        let dir = tempfile::Builder::new()
            .prefix("citronfs-mnt-")
            .tempdir()
            .context("create a mount point")?;
        Mount::new(fs, MountDir::Temp(dir), fuse)
    }

    /// Mounts `fs` at `mountpoint`, an existing directory.
    pub fn at(fs: Arc<CitronFs>, mountpoint: &Path, fuse: &FuseOptions) -> Result<Mount> {
        anyhow::ensure!(
            mountpoint.is_dir(),
            "mount point {} is not a directory",
            mountpoint.display()
        );
        Mount::new(fs, MountDir::Given(mountpoint.to_path_buf()), fuse)
    }

    fn new(fs: Arc<CitronFs>, dir: MountDir, fuse: &FuseOptions) -> Result<Mount> {
        let handle = fs_client::fuse::mount(fs.clone(), dir.path(), fuse).with_context(|| {
            format!(
                "cannot mount at {} (FUSE needs /dev/fuse, and fusermount3 from the fuse3 \
                 package when not root)",
                dir.path().display()
            )
        })?;
        // From the mount table, not stat(2): a stat of its own mount waits on this process's
        // request threads, forever if the process is being killed (`resolve_mount_point`).
        let dev = fs_client::fuse::mounted_device(dir.path())
            .ok()
            .flatten()
            .map_or(0, |(major, minor)| libc::makedev(major, minor));
        Ok(Mount {
            handle: Some(handle),
            fs,
            dev,
            dir,
        })
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// How the kernel's requests reach the mount ([`MountHandle::fuse_rings`]).
    pub fn fuse_rings(&self) -> fs_client::fuse::FuseRings {
        self.handle
            .as_ref()
            .map_or_else(Default::default, |h| h.fuse_rings())
    }

    /// The client library behind the mount (its statistics, or calls that bypass the kernel).
    pub fn fs(&self) -> &Arc<CitronFs> {
        &self.fs
    }

    fn handle(&self) -> &MountHandle {
        self.handle.as_ref().expect("mounted until unmount or drop")
    }

    /// The largest read or write, in bytes, that this mount keeps atomic for every alignment
    /// of the user's buffer (see `fs_client::fuse::MountHandle::atomic_bound`).
    pub fn atomic_bound(&self) -> u64 {
        self.handle().atomic_bound()
    }

    /// What the mount negotiated with the kernel about request sizes.
    pub fn io_limits(&self) -> IoLimits {
        self.handle().io_limits()
    }

    /// Unmounts now, failing if the unmount fails (the drop then detaches it lazily).
    pub fn unmount(mut self) -> std::io::Result<()> {
        let handle = self.handle.take().expect("mounted until unmount or drop");
        handle.unmount()
    }

    /// Serves until `stop` is set (by a SIGINT or SIGTERM handler the caller registered before
    /// mounting) or the mount ends by itself (`fusermount3 -u`), then unmounts (see
    /// `fs_client::fuse::wait_for_signal`).
    pub fn wait_for_signal(mut self, stop: &std::sync::atomic::AtomicBool) -> std::io::Result<()> {
        let handle = self.handle.take().expect("mounted until unmount or drop");
        fs_client::fuse::wait_for_signal(handle, stop)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            // A failure leaves the mount in place; it is detached below.
            let _ = handle.unmount();
        }
        // Still mounted: busy (files still open, e.g. after a panic) or an unmount that failed
        // before. Detach it, and abort the connection so that those files' closes cannot hang
        // this process's exit; a mount point left behind would also make the TempDir's
        // removal fail. The connection is aborted by its number only while the mount table
        // shows this mount, of this device, at this path, and before the detach: then the
        // connection is alive, held by the mount, and the number is ours. A number whose mount
        // is gone may already name another test's new mount, and aborting it fails that test's
        // calls with ECONNABORTED and its unmount with the error of its request threads.
        // (Aborted after the detach, as this did until 2026-11-27, the number was free again
        // as soon as a detach with nothing open ended the connection: a suspect for such
        // failures in `faults.rs` and `restarts.rs`, not proven.)
        if is_mounted(self.path()) {
            let ours = fs_client::fuse::mounted_device(self.path())
                .ok()
                .flatten()
                .is_some_and(|(major, minor)| {
                    self.dev != 0
                        && (major, minor) == (libc::major(self.dev), libc::minor(self.dev))
                });
            if ours {
                abort_fuse_connection(self.dev);
            }
            lazy_unmount(self.path());
        }
    }
}

/// Whether `path` is a mount point now (`fs_client::fuse::is_mount_point`; a table that
/// cannot be read counts as not mounted).
pub fn is_mounted(path: &Path) -> bool {
    fs_client::fuse::is_mount_point(path).unwrap_or(false)
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
