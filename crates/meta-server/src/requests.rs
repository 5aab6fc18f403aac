//! What the server must know about a request before it runs it, one row per request kind, so
//! that a new kind of request is classified in one place (the match is exhaustive: adding a
//! request to `proto::rpc::Request` fails to compile until it has its row here).

use proto::rpc::Request;

/// How a request is run ([`traits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Traits {
    /// It may run on the async worker that read it (`rpc`'s `serve`): its handler only touches
    /// the namespace in memory (the staged image, the attribute table, the open files) and
    /// answers within tens of microseconds. Anything that may take long — waiting for the
    /// database's flush (fsync, a truncate's tail), for other clients (revocations, fences),
    /// for a data server (allocations that zero chunks, registrations), or working through
    /// many entries (a directory page, a whole check) — goes to the blocking pool, so that the
    /// two async workers never stall on it.
    pub inline: bool,
    /// It may change an inode's attributes or whether it is open, and so its slot in the
    /// attribute table: the service publishes the slots it touched before the answer, so
    /// that a client that saw the answer reads the change one-sidedly.
    pub changes_inodes: bool,
}

/// The [`Traits`] of `request`.
pub(crate) fn traits(request: &Request) -> Traits {
    let (inline, changes_inodes) = match request {
        Request::Heartbeat
        | Request::Cluster
        | Request::Lookup { .. }
        | Request::GetAttr { .. }
        | Request::Readlink { .. }
        | Request::Statfs
        | Request::GetXattr { .. }
        | Request::ListXattr { .. }
        | Request::ChunkMap { .. } => (true, false),
        Request::Mknod { .. }
        | Request::Create { .. }
        | Request::Mkdir { .. }
        | Request::Symlink { .. }
        | Request::Link { .. }
        | Request::Unlink { .. }
        | Request::Rmdir { .. }
        | Request::Rename { .. }
        | Request::SetXattr { .. }
        | Request::RemoveXattr { .. }
        | Request::Open { .. }
        | Request::Release { .. } => (true, true),
        // A size change may zero a tail after a flush.
        Request::SetAttr { set, .. } => (set.size.is_none(), true),
        // A page is up to 4,096 entries, each with a getattr for `ReadDirPlus`: milliseconds.
        Request::ReadDir { .. } | Request::ReadDirPlus { .. } => (false, false),
        // Zeroed chunks (counted in the file's `allocated`), or memory for a lock tree, from
        // the data servers or the meta region.
        Request::AllocateChunks { .. } => (false, true),
        Request::AllocateLockWords { .. } => (false, false),
        // A scan of the file's chunks, and its generation bumped.
        Request::FreeChunks { .. } => (false, true),
        // A table lookup.
        Request::GetLk { .. } => (true, false),
        // May wait (up to a second) for another owner's record lock to go.
        Request::SetLk { wait_ms, .. } => (*wait_ms == 0, false),
        // Waits for other clients' sessions and the fabric servers.
        Request::Fence | Request::HolderGone { .. } | Request::AwaitRevocations { .. } => {
            (false, false)
        }
        // Waits for the database's flush; persists sizes.
        Request::Fsync { .. } => (false, true),
        // A whole check, which may repair.
        Request::Fsck { .. } => (false, true),
        // Reads the data servers' records and every session under the state lock: rare, and
        // not worth an async worker's time.
        Request::Status => (false, false),
    };
    Traits {
        inline,
        changes_inodes,
    }
}

/// The names of the request kinds, the `kind` label of the meta server's request metrics,
/// indexed by [`kind`].
pub(crate) const KIND_NAMES: [&str; 35] = [
    "heartbeat",
    "cluster",
    "lookup",
    "get_attr",
    "set_attr",
    "mknod",
    "mkdir",
    "symlink",
    "link",
    "unlink",
    "rmdir",
    "rename",
    "readlink",
    "read_dir",
    "read_dir_plus",
    "statfs",
    "set_xattr",
    "get_xattr",
    "list_xattr",
    "remove_xattr",
    "open",
    "release",
    "chunk_map",
    "allocate_chunks",
    "fsync",
    "allocate_lock_words",
    "fence",
    "await_revocations",
    "fsck",
    "create",
    "free_chunks",
    "get_lk",
    "set_lk",
    "status",
    "holder_gone",
];

/// The kind of `request`: its index in [`KIND_NAMES`].
pub(crate) fn kind(request: &Request) -> usize {
    match request {
        Request::Heartbeat => 0,
        Request::Cluster => 1,
        Request::Lookup { .. } => 2,
        Request::GetAttr { .. } => 3,
        Request::SetAttr { .. } => 4,
        Request::Mknod { .. } => 5,
        Request::Mkdir { .. } => 6,
        Request::Symlink { .. } => 7,
        Request::Link { .. } => 8,
        Request::Unlink { .. } => 9,
        Request::Rmdir { .. } => 10,
        Request::Rename { .. } => 11,
        Request::Readlink { .. } => 12,
        Request::ReadDir { .. } => 13,
        Request::ReadDirPlus { .. } => 14,
        Request::Statfs => 15,
        Request::SetXattr { .. } => 16,
        Request::GetXattr { .. } => 17,
        Request::ListXattr { .. } => 18,
        Request::RemoveXattr { .. } => 19,
        Request::Open { .. } => 20,
        Request::Release { .. } => 21,
        Request::ChunkMap { .. } => 22,
        Request::AllocateChunks { .. } => 23,
        Request::Fsync { .. } => 24,
        Request::AllocateLockWords { .. } => 25,
        Request::Fence => 26,
        Request::AwaitRevocations { .. } => 27,
        Request::Fsck(..) => 28,
        Request::Create { .. } => 29,
        Request::FreeChunks { .. } => 30,
        Request::GetLk { .. } => 31,
        Request::SetLk { .. } => 32,
        Request::Status => 33,
        Request::HolderGone { .. } => 34,
    }
}

/// Whether a request frame counts as a client request (`MetaHandle::request_count`, and of
/// those `awake_count`): every request but a heartbeat, and a heartbeat that carries releases
/// (a client's idle closes), since those do a client's work.
pub(crate) fn counted(request: &Request, release_first: &[proto::Ino]) -> bool {
    !matches!(request, Request::Heartbeat) || !release_first.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::{Caller, SetAttr};

    #[test]
    fn a_truncate_goes_to_the_pool_and_other_setattrs_run_inline() {
        let truncate = Request::SetAttr {
            ino: 2,
            set: SetAttr {
                size: Some(0),
                ..SetAttr::default()
            },
            caller: Caller::default(),
        };
        assert_eq!(
            traits(&truncate),
            Traits {
                inline: false,
                changes_inodes: true
            }
        );
        let chmod = Request::SetAttr {
            ino: 2,
            set: SetAttr {
                perm: Some(0o600),
                ..SetAttr::default()
            },
            caller: Caller::default(),
        };
        assert!(traits(&chmod).inline);
        assert!(!traits(&Request::Statfs).changes_inodes);
        assert!(!traits(&Request::Fsync { ino: 2 }).inline);
    }
}
