//! The mount(8) helper: `citronfs mount-helper`, which is also what the `citronfs` binary runs
//! when it is invoked as `mount.citronfs` or `mount.fuse.citronfs` (a symlink in /sbin, where
//! mount(8) looks for the helper of a file system type).
//!
//! mount(8) calls `/sbin/mount.TYPE SPEC DIR [-sfnv] [-o OPTIONS] [-t TYPE]`: SPEC is the meta
//! server's `HOST:PORT`, OPTIONS the settings of `citronfs mount` as `key=value` (`token_file`,
//! `cluster`, `scheme`, `private`, ...; see [`SETTING_OPTIONS`]) and the generic options of
//! mount(8) and systemd (`_netdev`, `nofail`, `noauto`, `x-systemd.*`, ...), which are theirs
//! and ignored here. The helper checks the settings, then forks: the child connects, mounts and
//! tells the parent, which exits 0 as soon as the mount is up while the child, detached from
//! the terminal (`setsid`, standard streams on /dev/null or `log_file`), serves the mount until
//! `umount DIR` (or SIGTERM, which unmounts). A mount that fails exits 32, mount(8)'s status
//! for a mount failure, with the reason on standard error; a wrong invocation exits 1.

use super::roles::{check_mount_settings, mount_with, MountArgs};
use anyhow::{bail, Context, Result};
use clap::{Args, FromArgMatches};
use std::ffi::OsString;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The names under which the `citronfs` binary is the mount(8) helper: `mount.citronfs` for
/// `mount -t citronfs`, `mount.fuse.citronfs` for `mount -t fuse.citronfs` (the type the mount
/// table shows).
pub const HELPER_NAMES: [&str; 2] = ["mount.citronfs", "mount.fuse.citronfs"];

/// mount(8)'s exit status for a wrong invocation (an unknown option, a missing argument).
pub const EXIT_USAGE: u8 = 1;
/// mount(8)'s exit status for a mount that failed.
pub const EXIT_MOUNT_FAILURE: u8 = 32;

/// The options that are settings of `citronfs mount`, given to it as `--KEY VALUE`
/// (`private` alone means `private=true`). The meta server's address is SPEC, and the token
/// itself is not an option: it would show in `ps` and in /etc/fstab, which every user reads.
pub const SETTING_OPTIONS: [&str; 10] = [
    "token_file",
    "cluster",
    "scheme",
    "read_locks",
    "private",
    "log",
    "connect_timeout_ms",
    "batch_timeout_ms",
    "fuse_ring_threads",
    "config",
];

/// Options of mount(8), libmount and systemd that concern them, not the file system
/// (`x-*` and `comment=*` as well): accepted and ignored. `nodev` and `nosuid` are what every
/// CitronFS mount is anyway; `noatime` too.
const GENERIC_OPTIONS: [&str; 23] = [
    "defaults",
    "auto",
    "noauto",
    "_netdev",
    "nofail",
    "user",
    "nouser",
    "users",
    "owner",
    "group",
    "rw",
    "nodev",
    "nosuid",
    "noatime",
    "nodiratime",
    "relatime",
    "exec",
    "noexec",
    "async",
    "dev",
    "suid",
    "atime",
    "allow_other",
];

/// Flags of `citronfs mount-helper`: mount(8)'s calling convention for a helper.
#[derive(Args, Debug)]
pub struct HelperArgs {
    /// The meta server's RPC address, HOST:PORT (the first field of an fstab line).
    spec: String,
    /// Where to mount (an existing directory).
    dir: PathBuf,
    /// Mount options, comma-separated: token_file=PATH (a file of mode 0600 holding the
    /// cluster's token), cluster=NAME, scheme=SCHEME, read_locks=shared|exclusive, private,
    /// log=FILTER, log_file=PATH (where the background process logs; default none),
    /// connect_timeout_ms=N, batch_timeout_ms=N, fuse_ring_threads=N, config=PATH (a
    /// `citronfs mount` TOML file);
    /// mount(8)'s and systemd's own (_netdev, nofail, noauto, x-systemd.*, defaults, rw, ...)
    /// are ignored.
    #[arg(short = 'o', value_name = "OPTIONS")]
    options: Vec<String>,
    /// Sloppy: ignore options this helper does not know instead of failing.
    #[arg(short = 's')]
    sloppy: bool,
    /// Fake: check the options and the token file, mount nothing.
    #[arg(short = 'f')]
    fake: bool,
    /// No mtab: accepted for mount(8) (there is no mtab to write).
    #[arg(short = 'n')]
    no_mtab: bool,
    /// Verbose: say what is mounted, with which settings.
    #[arg(short = 'v')]
    verbose: bool,
    /// The type mount(8) was given: accepted and ignored (the mount's type is always
    /// fuse.citronfs).
    #[arg(short = 't', value_name = "TYPE")]
    fstype: Option<String>,
}

/// What the options ask of the helper itself, beside the `citronfs mount` command line.
#[derive(Debug, Default, PartialEq)]
struct Parsed {
    /// `citronfs mount`'s flags (after the subcommand and the mount point).
    flags: Vec<String>,
    /// Where the background process writes its log (standard error); `None`: /dev/null.
    log_file: Option<PathBuf>,
}

/// Splits mount(8)'s `-o` lists into `citronfs mount` flags and the helper's own options;
/// an unknown option is an error unless `sloppy`.
fn parse_options(lists: &[String], sloppy: bool) -> Result<Parsed> {
    let mut parsed = Parsed::default();
    for option in lists.iter().flat_map(|l| l.split(',')) {
        let (key, value) = match option.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (option, None),
        };
        match (key, value) {
            ("", None) => {}
            ("token", _) => bail!(
                "the token is not a mount option (it would show in ps and in /etc/fstab): \
                 put it in a file of mode 0600 and give -o token_file=PATH"
            ),
            ("ro", None) => bail!("CitronFS mounts are read-write only: drop the ro option"),
            ("log_file", Some(path)) if !path.is_empty() => {
                parsed.log_file = Some(PathBuf::from(path))
            }
            ("private", None) => parsed.flags.push("--private".into()),
            (key, Some(value)) if SETTING_OPTIONS.contains(&key) => {
                parsed.flags.push(format!("--{}", key.replace('_', "-")));
                parsed.flags.push(value.to_string());
            }
            (key, None) if SETTING_OPTIONS.contains(&key) => {
                bail!("the mount option {key} needs a value: {key}=...")
            }
            (key, _)
                if GENERIC_OPTIONS.contains(&key) || key.starts_with("x-") || key == "comment" =>
            {
                // mount(8)'s, systemd's, or what every CitronFS mount is anyway.
            }
            _ if sloppy => {}
            _ => bail!(
                "unknown mount option {option:?} (known: {}, log_file, and mount(8)'s own such \
                 as _netdev, nofail, x-systemd.*; -s ignores unknown ones)",
                SETTING_OPTIONS.join(", ")
            ),
        }
    }
    Ok(parsed)
}

/// The `citronfs mount` arguments the helper's invocation stands for.
fn mount_args(args: &HelperArgs, dir: &Path, parsed: &Parsed) -> Result<MountArgs> {
    let mut argv: Vec<OsString> = vec!["citronfs".into(), "mount".into(), dir.into()];
    argv.push("--meta".into());
    argv.push(args.spec.clone().into());
    argv.extend(parsed.flags.iter().map(OsString::from));
    let matches = crate::command()
        .try_get_matches_from(argv)
        .map_err(|e| anyhow::anyhow!("{}", e.render().to_string().trim_end()))?;
    match crate::Cli::from_arg_matches(&matches)?.command {
        crate::Command::Mount(mount) => Ok(mount),
        _ => unreachable!("parsed as the mount subcommand"),
    }
}

/// Runs the helper; its exit status is mount(8)'s (module docs).
pub fn run(args: HelperArgs, name: &str) -> ExitCode {
    let fail = |code: u8, error: anyhow::Error| {
        eprintln!("{name}: {error:#}");
        ExitCode::from(code)
    };
    // Wrong invocations: said before anything is tried.
    let parsed = match parse_options(&args.options, args.sloppy) {
        Ok(parsed) => parsed,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    // Absolute, as the background process leaves the working directory for /.
    let dir = match std::fs::canonicalize(&args.dir) {
        Ok(dir) if dir.is_dir() => dir,
        Ok(_) => {
            return fail(
                EXIT_MOUNT_FAILURE,
                anyhow::anyhow!("mount point {} is not a directory", args.dir.display()),
            )
        }
        Err(e) => {
            return fail(
                EXIT_MOUNT_FAILURE,
                anyhow::anyhow!("mount point {}: {e}", args.dir.display()),
            )
        }
    };
    let mount = match mount_args(&args, &dir, &parsed) {
        Ok(mount) => mount,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    // The token file and the settings, checked here so that the user sees what is wrong.
    let settings = match check_mount_settings(&mount) {
        Ok(settings) => settings,
        Err(e) => return fail(EXIT_MOUNT_FAILURE, e),
    };
    if args.verbose {
        eprintln!(
            "{name}: mounting {} at {} (cluster {:?}, lock scheme {}, {})",
            args.spec,
            dir.display(),
            settings.cluster,
            settings.scheme,
            if settings.private {
                "private"
            } else {
                "shared"
            }
        );
    }
    if args.fake {
        return ExitCode::SUCCESS;
    }
    match daemonize() {
        Ok(Side::Parent(Outcome::Mounted)) => ExitCode::SUCCESS,
        // The background process said why on standard error.
        Ok(Side::Parent(Outcome::Failed)) => ExitCode::from(EXIT_MOUNT_FAILURE),
        Ok(Side::Parent(Outcome::Died(why))) => fail(
            EXIT_MOUNT_FAILURE,
            anyhow::anyhow!("not mounted: the background process {why}"),
        ),
        Ok(Side::Child(ready)) => serve(mount, args.spec, ready, parsed.log_file, name),
        Err(e) => fail(EXIT_MOUNT_FAILURE, e),
    }
}

/// The background process: mounts, tells the parent, leaves the terminal, serves.
fn serve(
    mount: MountArgs,
    source: String,
    ready: OwnedFd,
    log_file: Option<PathBuf>,
    name: &str,
) -> ExitCode {
    let mut ready = Some(std::fs::File::from(ready));
    let result = mount_with(mount, Some(source), |_| {
        // Leave the terminal before saying so: once the parent exits, nothing may write to it.
        if let Err(e) = detach(log_file.as_deref()) {
            eprintln!("{name}: warning: {e:#}");
        }
        if let Some(mut pipe) = ready.take() {
            let _ = std::io::Write::write_all(&mut pipe, b"1");
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Before the mount was up, standard error is still the caller's, and the parent
            // exits with the failure; after, it goes to the log file.
            eprintln!("{name}: {e:#}");
            ExitCode::from(EXIT_MOUNT_FAILURE)
        }
    }
}

/// Standard input and output on /dev/null, standard error on `log_file` (appended) or
/// /dev/null, the working directory /.
fn detach(log_file: Option<&Path>) -> Result<()> {
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .context("open /dev/null")?;
    let log = match log_file {
        Some(path) => std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("open the log file {}", path.display()))?,
        None => null.try_clone().context("open /dev/null")?,
    };
    for (from, to) in [(&null, 0), (&null, 1), (&log, 2)] {
        // SAFETY: dup2 of descriptors this process owns onto its standard streams.
        if unsafe { libc::dup2(from.as_raw_fd(), to) } < 0 {
            return Err(std::io::Error::last_os_error()).context("redirect the standard streams");
        }
    }
    std::env::set_current_dir("/").context("change directory to /")?;
    Ok(())
}

/// What the parent side of [`daemonize`] saw of the background process.
enum Outcome {
    /// It said the mount is up.
    Mounted,
    /// It exited without mounting (saying why).
    Failed,
    /// It ended otherwise (how).
    Died(String),
}

/// Which side of [`daemonize`]'s fork this is.
enum Side {
    /// The caller: whether the mount came up.
    Parent(Outcome),
    /// The background process, with the pipe to write `1` to once mounted.
    Child(OwnedFd),
}

/// Forks a background process in a session of its own; the parent waits until it says it is
/// mounted or exits. Called while this process has a single thread (nothing has started any).
fn daemonize() -> Result<Side> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills `fds` with two new descriptors on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error()).context("pipe");
    }
    // SAFETY: both descriptors are new and owned here alone.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the process has one thread (the helper forks before connecting or mounting), so
    // the child's copy of memory is consistent.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()).context("fork"),
        0 => {
            drop(read);
            // SAFETY: setsid has no memory effects; it fails only for a group leader, which a
            // fresh child is not.
            unsafe { libc::setsid() };
            Ok(Side::Child(write))
        }
        child => {
            drop(write);
            let mut said = Vec::new();
            let _ = std::fs::File::from(read).read_to_end(&mut said);
            if said == b"1" {
                return Ok(Side::Parent(Outcome::Mounted));
            }
            // The child ended before mounting: its status.
            let mut status = 0;
            // SAFETY: waiting for this process's own child.
            unsafe { libc::waitpid(child, &mut status, 0) };
            Ok(Side::Parent(if libc::WIFEXITED(status) {
                match libc::WEXITSTATUS(status) {
                    0 => Outcome::Died("exited before mounting".into()),
                    _ => Outcome::Failed,
                }
            } else {
                Outcome::Died(format!("was killed by signal {}", libc::WTERMSIG(status)))
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn settings_become_flags_and_generic_options_are_ignored() {
        let parsed = parse_options(
            &strings(&[
                "rw,_netdev,nofail,x-systemd.automount,x-systemd.mount-timeout=30,defaults",
                "token_file=/etc/citronfs/token,cluster=prod,scheme=seg:4:4096,private",
                "log_file=/var/log/citronfs.log,comment=systemd.automount",
            ]),
            false,
        )
        .unwrap();
        assert_eq!(
            parsed.flags,
            strings(&[
                "--token-file",
                "/etc/citronfs/token",
                "--cluster",
                "prod",
                "--scheme",
                "seg:4:4096",
                "--private",
            ])
        );
        assert_eq!(
            parsed.log_file.as_deref(),
            Some(Path::new("/var/log/citronfs.log"))
        );
    }

    #[test]
    fn unknown_options_fail_unless_sloppy_and_the_token_is_never_an_option() {
        let err = parse_options(&strings(&["cluster=a,bogus=1"]), false).unwrap_err();
        assert!(err.to_string().contains("\"bogus=1\""), "{err}");
        assert!(parse_options(&strings(&["bogus=1"]), true).is_ok());
        let err = parse_options(&strings(&["token=secret"]), true).unwrap_err();
        assert!(err.to_string().contains("token_file"), "{err}");
        assert!(parse_options(&strings(&["ro"]), true).is_err());
        assert!(parse_options(&strings(&["cluster"]), false).is_err());
    }

    #[test]
    fn every_setting_option_is_a_flag_of_mount() {
        let args = HelperArgs {
            spec: "10.0.0.1:7700".into(),
            dir: "/mnt".into(),
            options: vec![],
            sloppy: false,
            fake: false,
            no_mtab: false,
            verbose: false,
            fstype: None,
        };
        for key in SETTING_OPTIONS {
            let value = match key {
                "private" => "true",
                "scheme" => "mutex",
                "read_locks" => "exclusive",
                "cluster" | "log" | "token_file" | "config" => "x",
                _ => "5",
            };
            let parsed = parse_options(&[format!("{key}={value}")], false).unwrap();
            mount_args(&args, Path::new("/mnt"), &parsed)
                .unwrap_or_else(|e| panic!("{key}: {e:#}"));
        }
    }
}
