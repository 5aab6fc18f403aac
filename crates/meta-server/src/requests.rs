//! What the server must know about a request before it runs it, read from the request's row in
//! proto's request table (`proto::rpc::RequestKind::class`): where a new kind of request is
//! classified, once, for the client and the server alike.

use proto::rpc::Request;

/// Whether `request` may run on the async worker that read it (`rpc`'s `serve`): its handler
/// only touches the namespace in memory and answers within tens of microseconds
/// ([`proto::rpc::Cost::Quick`], [`Request::is_quick`]). Anything that may take long goes to the blocking
/// pool, so that the two async workers never stall on it.
pub(crate) fn inline(request: &Request) -> bool {
    request.is_quick()
}

/// Whether `request` may change an inode's attributes or whether it is open, and so its slot
/// in the attribute table (`proto::rpc::RequestClass::changes_inodes`): the service publishes
/// the slots it touched before the answer, so that a client that saw the answer reads the
/// change one-sidedly.
pub(crate) fn changes_inodes(request: &Request) -> bool {
    request.class().changes_inodes
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
    use proto::rpc::Cost;
    use proto::{Caller, SetAttr};

    #[test]
    fn a_truncate_goes_to_the_pool_and_other_setattrs_run_inline() {
        let setattr = |size| Request::SetAttr {
            ino: 2,
            set: SetAttr {
                size,
                perm: Some(0o600),
                ..SetAttr::default()
            },
            caller: Caller::default(),
        };
        assert!(!inline(&setattr(Some(0))));
        assert!(changes_inodes(&setattr(Some(0))));
        assert!(inline(&setattr(None)));
        assert!(!changes_inodes(&Request::Statfs));
        assert!(!inline(&Request::Fsync { ino: 2 }));
        assert_eq!(Request::Fsync { ino: 2 }.class().cost, Cost::Slow);
    }
}
