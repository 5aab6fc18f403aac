//! Child processes that do not outlive the process that started them.
//!
//! A benchmark or test that is killed (SIGKILL, a harness timeout, a second Ctrl-C) runs no
//! destructor, so the guards that stop its client processes and servers never run; those
//! children would go on serving mounts of a cluster that is gone, or holding ports. Linux's
//! parent-death signal makes the kernel send them SIGTERM instead — which every `citronfs`
//! role answers by unmounting or stopping in order.

use std::process::Command;

/// Makes the child that `command` starts receive SIGTERM when its parent dies.
///
/// The kernel sends it when the *thread* that started the child exits, so call this only
/// for children started by a thread that lives as long as they should (the main thread, or
/// the test's own thread). A parent that died between the fork and the child's `prctl` is
/// noticed by comparing the child's parent with the starter's pid: the child then exits at
/// once instead of running unwatched.
pub fn die_with_parent(command: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the hook runs between fork and exec and calls only prctl(2), getppid(2) and
    // _exit(2), which are async-signal-safe, and touches no memory but its captured pid.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(command, move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}
