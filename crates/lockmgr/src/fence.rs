//! The fencing hook of lease recovery (CITRON §3.10).
//!
//! Lease recovery presumes a holder dead when it has been silent for long enough, and then breaks
//! its hold with one write to the lock words. A holder that was only *paused* (SIGSTOP, a VM
//! pause, a long GC) is not dead: when it resumes it still believes it holds the lock, and any
//! data write it lands after the break can interleave with the new holder's. The lock protocol
//! makes the paused holder's *lock* verbs harmless (see `citron::release` and
//! `baselines::ticket`), and [`crate::RangeLock::lease_deadline`] tells the holder when to stop
//! posting data verbs; a [`Fence`] closes the rest: it is called right before the break, and the
//! file system uses it to revoke the presumed-dead client's sessions on the data servers first.

use crate::scheme::LockError;

/// Called by a client right before it breaks another client's hold: any lease recovery write
/// (CITRON's ticket break-in, `DCnt` repair, leaf zeroing, the spillover mutex's repair, and the
/// baselines' ticket-lock repair). The file system uses it to have the presumed-dead client's
/// session revoked on the servers first, so that a late holder can never land a write after its
/// lock is broken.
///
/// If `fence` returns an error, the lock is not broken: the client logs it, keeps waiting, and
/// calls the fence again before its next attempt to break the hold.
pub trait Fence: Send + Sync {
    /// Fences the presumed-dead holder off the data servers. Blocking is allowed (the caller is
    /// a waiter that would otherwise spin).
    fn fence(&self) -> Result<(), LockError>;
}

/// Runs the fence, if any, before a recovery write described by `what`. `true`: go ahead and
/// break the hold; `false`: the fence failed (logged); do not break it now.
pub(crate) fn before_recovery(fence: Option<&std::sync::Arc<dyn Fence>>, what: &str) -> bool {
    let Some(fence) = fence else {
        return true;
    };
    match fence.fence() {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, what, "lease recovery: fence failed; not breaking the hold, will retry");
            false
        }
    }
}
