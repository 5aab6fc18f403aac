//! Acquisitions run at the lock's host, whatever the scheme: where a client runs them
//! ([`Hosting`]) and what a lock's host offers for them ([`LockHost`]).
//!
//! On a fabric whose server CPU executes every one-sided verb anyway (`tcp`), a scheme whose
//! acquisition is several round trips of verbs on the lock's memory can have the host run it
//! next to the memory, in one call. Which schemes can is theirs to say: CITRON can (its
//! `hosted` module); the baselines cannot, and acquire as always. A user names none of them:
//! it sets [`Hosting`] in [`crate::schemes::OpenOptions::hosting`] on the client side, and
//! registers the procedures of a [`LockHost`] on the server that holds the locks' memory.

use crate::citron::CitronHost;
use crate::fence::Fence;
use crate::schemes::LockWordAllocator;
use fabric::procedure::{Procedure, ProcedureId};
use fabric::Connector;
use std::sync::Arc;

/// Where a client runs its acquisitions ([`crate::schemes::OpenOptions::hosting`]). A scheme
/// without acquisitions at the host runs them on the client whatever this says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Hosting {
    /// Always one-sided, on the client.
    Never,
    /// At the host where the endpoint's server executes every verb anyway (`tcp`) and offers
    /// the procedure — and, for a client with a fence, can fence on its behalf
    /// ([`LockHost::fencing`]); one-sided otherwise.
    #[default]
    Auto,
    /// At the host; opening the lock fails if the host cannot.
    Always,
}

/// The allocator a host grows a lock from on behalf of a client whose own allocator has tag
/// `tag` ([`LockWordAllocator::host_tag`], [`LockHost::allocating`]).
pub type HostAllocate = Arc<dyn Fn(u64) -> Arc<dyn LockWordAllocator> + Send + Sync>;

/// A wrapper of the host connector ([`crate::citron::CitronHost::wrapped`]).
pub type HostWrap = Arc<dyn Fn(Arc<dyn Connector>) -> Arc<dyn Connector> + Send + Sync>;

/// The fence a host runs before a break-in on behalf of the client of session `session`
/// ([`LockHost::fencing`]).
pub type HostFence = Arc<dyn Fn(u64) -> Arc<dyn Fence> + Send + Sync>;

/// What the host of locks' memory offers so that clients acquire there ([`Hosting`]): the
/// fabric procedures of every scheme that has acquisitions at the host, each under its own
/// number ([`LockHost::procedures`]).
#[derive(Default)]
pub struct LockHost {
    /// CITRON's acquisitions at the host.
    citron: CitronHost,
}

impl LockHost {
    /// Hosts the acquisitions of every scheme that has them, reaching the host's memory
    /// directly; a client with a fence, or whose lock grows from an allocator, is refused
    /// (it acquires on its own) unless [`LockHost::fencing`] / [`LockHost::allocating`] say
    /// how the host does that for it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Hosts clients that have a fence too: before a break-in on behalf of the client of
    /// session `s` (the session its connection presented), the host calls `fence(s)`'s
    /// [`Fence::fence`] (and asks it [`Fence::holder_gone`]), as that client would have called
    /// its own.
    pub fn fencing(self, fence: HostFence) -> Self {
        Self {
            citron: self.citron.fencing(fence),
        }
    }

    /// Hosts locks that grow from an allocator: a hosted client's growth runs at the host,
    /// which allocates from `allocate(tag)`, `tag` being the client allocator's
    /// [`LockWordAllocator::host_tag`].
    pub fn allocating(self, allocate: HostAllocate) -> Self {
        Self {
            citron: self.citron.allocating(allocate),
        }
    }

    /// The procedures to register on the fabric server of the locks' memory
    /// (`FabricServer::register_procedure`), each with its number.
    pub fn procedures(self) -> Vec<(ProcedureId, Arc<dyn Procedure>)> {
        vec![(
            crate::citron::hosted::PROCEDURE,
            Arc::new(self.citron) as Arc<dyn Procedure>,
        )]
    }
}
