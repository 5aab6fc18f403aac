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

    /// Whether the holder whose identity is `owner` (the [`holder_identity`] of the owner it
    /// opened its lock with, `schemes::OpenOptions::owner`, as the scheme recorded it) is out for good: it can land no
    /// verb on any server any more — it ended and was revoked everywhere, or (only when
    /// `stopped` is set: the waiter has seen the node stand still for a whole `T_lease`) it was
    /// silent and this call fenced it. `Ok(true)` lets the waiter break the holder's node at
    /// once instead of waiting out the lease's several `T_lease`; `Ok(false)` (alive, or not
    /// known to be out) keeps the lease rule. Blocking is allowed. Default: `Ok(false)`.
    fn holder_gone(&self, owner: u64, stopped: bool) -> Result<bool, LockError> {
        let _ = (owner, stopped);
        Ok(false)
    }
}

/// The identity [`Fence::holder_gone`] names a holder by, for a client that opened its lock
/// with owner `owner` (`schemes::OpenOptions::owner`): what the schemes that record their
/// holders keep of it (CITRON's owner records: its low 48 bits). A fence finds the holder's
/// sessions by comparing theirs through this.
pub fn holder_identity(owner: u64) -> u64 {
    owner & crate::citron::layout::OWNER_ID
}

/// Asks the fence, if any, whether the holder `owner` is out for good ([`Fence::holder_gone`]);
/// `false` without a fence, or when the question fails (logged: the lease rule still holds).
pub(crate) fn holder_gone(
    fence: Option<&std::sync::Arc<dyn Fence>>,
    owner: u64,
    stopped: bool,
) -> bool {
    let Some(fence) = fence else {
        return false;
    };
    match fence.holder_gone(owner, stopped) {
        Ok(gone) => gone,
        Err(e) => {
            tracing::warn!(error = %e, owner, "lease recovery: could not learn whether a holder is gone; waiting out its lease");
            false
        }
    }
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
