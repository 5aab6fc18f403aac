//! POSIX permissions through a shared mount, checked as users other than the mounter: each step
//! runs a shell command as root or as an unprivileged user (`setpriv`), once in a directory of
//! a CitronFS mount and once in a directory of tmpfs (`/dev/shm`), the reference; exit status,
//! output and error messages must be the same. The steps cover search and write permission on
//! directories, sticky directories, chmod and chown by non-owners, owner and group of new nodes
//! (set-group-ID directories included) and the clearing of set-ID bits on write, truncate and
//! chown.
//!
//! Needs root (to switch users; CI runs as root) and `setpriv` (util-linux); skipped otherwise.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use testkit::{skip_without_fuse, Cluster, ClusterSpec};

/// Who runs a step.
#[derive(Clone, Copy, Debug)]
enum Who {
    Root,
    /// uid 61001, gid 61001, a member of group 100 (`users`).
    Alice,
    /// uid 61002, gid 61002, in no other group.
    Bob,
}

/// One step: a shell command run in the case directory. `settle`: the command only reads
/// attributes, and the kernel may serve them from its attribute cache for the mount's TTL
/// (100 ms) after another request changed them on the server (a write that cleared set-ID
/// bits), so the CitronFS side is retried until it matches or 2 s have passed.
struct Step {
    who: Who,
    cmd: &'static str,
    settle: bool,
}

const fn run(who: Who, cmd: &'static str) -> Step {
    Step {
        who,
        cmd,
        settle: false,
    }
}

const fn look(who: Who, cmd: &'static str) -> Step {
    Step {
        who,
        cmd,
        settle: true,
    }
}

use Who::{Alice, Bob, Root};

/// The case, in order. `st` prints owner, group and mode (`%a`: with set-ID and sticky bits).
const STEPS: &[Step] = &[
    // Directories: world-writable, set-group-ID owned by group 100, sticky, private, and one
    // readable but not searchable.
    run(Root, "mkdir pub shared sticky private noexec ro"),
    run(
        Root,
        "chmod 0777 pub; chgrp 100 shared; chmod 2777 shared; chmod 1777 sticky",
    ),
    run(
        Root,
        "touch private/f noexec/x; chmod 0700 private; chmod 0666 noexec",
    ),
    run(Root, "chmod 0755 ro"),
    look(Root, "st pub shared sticky private noexec ro"),
    // Every user may use the mount; new nodes belong to their creator.
    run(Alice, "touch pub/a && mkdir pub/ad && st pub/a pub/ad"),
    run(Bob, "echo hello > pub/b && cat pub/b && st pub/b"),
    // Search and write permission on directories.
    run(Bob, "ls private"),
    run(Bob, "cat private/f"),
    run(Bob, "ls noexec"),
    run(Bob, "cat noexec/x"),
    run(Bob, "touch ro/x"),
    run(Bob, "mkdir ro/d"),
    run(Bob, "rm -f pub/a"),
    // Set-group-ID directories: the group of the directory, and new directories keep the bit,
    // for a member of the group and for a non-member alike.
    run(
        Alice,
        "touch shared/a && mkdir shared/ad && st shared/a shared/ad",
    ),
    run(
        Bob,
        "touch shared/b && mkdir shared/bd && st shared/b shared/bd",
    ),
    run(Bob, "mkdir shared/bd/deeper && st shared/bd/deeper"),
    run(
        Alice,
        "mknod shared/fifo p && ln -s a shared/link && st shared/fifo",
    ),
    // A set-group-ID file made by a non-member in a set-group-ID directory loses the bit.
    run(Bob, "touch shared/g && chmod 2755 shared/g; st shared/g"),
    // Sticky directories: only the owner (of the file or the directory) removes or renames.
    run(Alice, "touch sticky/a && st sticky/a"),
    run(Bob, "rm -f sticky/a"),
    run(Bob, "mv sticky/a sticky/b"),
    run(Bob, "touch sticky/b && mv sticky/b sticky/c && st sticky/c"),
    run(Alice, "rm sticky/a && ls sticky"),
    // chmod, chown, chgrp and utimes by non-owners; chgrp to a group the owner is not in.
    run(Bob, "chmod 0600 pub/a"),
    run(Bob, "chown 61002 pub/a"),
    run(Alice, "chown 61002 pub/a"),
    run(Alice, "chgrp 100 pub/a && st pub/a"),
    run(Alice, "chgrp 61002 pub/a"),
    run(Bob, "chgrp 100 pub/b"),
    run(Bob, "touch -d 2001-02-03 pub/a"),
    run(
        Alice,
        "chmod 0666 pub/a && touch -d 2001-02-03 pub/a && st pub/a",
    ),
    run(Bob, "touch pub/a && echo more >> pub/a && cat pub/a"),
    // chmod g+s by an owner not in the file's group drops the set-group-ID bit.
    run(Root, "touch pub/g && chown 61001:61002 pub/g"),
    run(Alice, "chmod 2755 pub/g; st pub/g"),
    // Set-ID bits: a write by another user clears set-user-ID, and set-group-ID with
    // group-execute.
    run(
        Root,
        "echo x > pub/s && chown 61001:100 pub/s && chmod 6777 pub/s && st pub/s",
    ),
    run(Bob, "echo y >> pub/s && cat pub/s"),
    look(Root, "st pub/s"),
    // ... also the owner's own write, and set-group-ID without group-execute stays.
    run(Root, "chmod 6767 pub/s"),
    run(Alice, "echo z >> pub/s"),
    look(Root, "st pub/s"),
    // ... a write at an offset (pwrite), not only appends.
    run(Root, "chmod 4777 pub/s"),
    run(
        Bob,
        "printf Q | dd of=pub/s bs=1 seek=1 conv=notrunc status=none",
    ),
    look(Root, "st pub/s && cat pub/s"),
    // A truncate by another user clears them too (the kernel sends the mode).
    run(Root, "chmod 6777 pub/s"),
    run(Bob, "truncate -s 1 pub/s"),
    look(Root, "st pub/s && cat pub/s"),
    run(Root, "chmod 6777 pub/s"),
    run(Bob, ": > pub/s"),
    look(Root, "st pub/s"),
    // chown clears set-user-ID, even by root.
    run(Root, "chmod 4755 pub/s && chown 61002 pub/s && st pub/s"),
    // Root's writes clear nothing.
    run(Root, "chmod 6777 pub/s && echo r >> pub/s && st pub/s"),
    // Directories keep their set-group-ID bit on chmod by the owner.
    run(Alice, "chmod 2755 pub/ad && st pub/ad"),
];

/// What a step gave: exit status, stdout, stderr.
type Outcome = (Option<i32>, String, String);

/// Runs `step` in `dir`: as root directly, as a user through `setpriv`. `umask 022` and a
/// shell function `st` (owner, group, mode and name of each argument) are defined first.
fn exec(dir: &Path, step: &Step) -> Outcome {
    let script = format!(
        "umask 022; st() {{ stat -c '%u:%g %a %n' \"$@\"; }}; {}",
        step.cmd
    );
    let mut cmd = match step.who {
        Root => Command::new("sh"),
        Alice | Bob => {
            let (id, groups) = match step.who {
                Alice => ("61001", "--groups=100"),
                _ => ("61002", "--clear-groups"),
            };
            let mut c = Command::new("setpriv");
            c.args([&format!("--reuid={id}"), &format!("--regid={id}"), groups]);
            c.arg("sh");
            c
        }
    };
    let out = cmd
        .arg("-c")
        .arg(&script)
        .current_dir(dir)
        .env("LC_ALL", "C")
        .output()
        .expect("run sh");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn permissions_as_other_users_match_tmpfs() {
    skip_without_fuse!();
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        testkit::skip(testkit::Need::Root, "switching users needs root");
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        testkit::skip(testkit::Need::Other, "no setpriv (util-linux)");
        return;
    }
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let mnt = cluster.mount().unwrap();
    let reference = tempfile::tempdir_in("/dev/shm").unwrap();
    let (ours, theirs) = (mnt.path().join("case"), reference.path().join("case"));
    for dir in [&ours, &theirs] {
        std::fs::create_dir(dir).unwrap();
    }
    for (dir, parent) in [(&ours, mnt.path()), (&theirs, reference.path())] {
        // Every user must reach the case directory.
        exec(parent, &run(Root, "chmod 0755 . case"));
        assert!(dir.is_dir());
    }
    let mut mismatches = Vec::new();
    for (i, step) in STEPS.iter().enumerate() {
        let want = exec(&theirs, step);
        let mut got = exec(&ours, step);
        if step.settle {
            let deadline = Instant::now() + Duration::from_secs(2);
            while got != want && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
                got = exec(&ours, step);
            }
        }
        if got != want {
            mismatches.push(format!(
                "step {i} ({:?}: {}):\n  CitronFS {got:?}\n  tmpfs    {want:?}",
                step.who, step.cmd
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} steps differ from tmpfs:\n{}",
        mismatches.len(),
        STEPS.len(),
        mismatches.join("\n")
    );
    println!(
        "{} steps as root and two other users matched tmpfs",
        STEPS.len()
    );
}
