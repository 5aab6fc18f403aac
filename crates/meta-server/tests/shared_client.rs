//! One connection shared by many threads (`proto::rpc::SharedClient`): the meta server runs a
//! connection's requests concurrently and each blocking-pool thread writes its own answer (under
//! the connection's writer lock), so answers come back interleaved and in any order; every call
//! must still get its own, whole.

mod common;
use common::*;
use proto::rpc::{Request, Response};
use proto::{FileKind, ROOT_INO};

fn ino_of(answer: Response) -> u64 {
    match answer {
        Response::Attr(attr) => attr.ino,
        other => panic!("expected attributes, got {other:?}"),
    }
}

/// Eight threads make interleaved calls on one connection: each makes files and asks for
/// them back by name and by inode. An answer handed to the wrong caller (or lost, or read
/// twice) shows as a wrong inode, a wrong kind of answer, or a call that never returns (the
/// 10 s call bound fails it).
#[test]
fn threads_sharing_a_connection_each_get_their_own_answers() {
    let cl = start(1, 8, false);
    let client = shared_client(&cl);
    std::thread::scope(|scope| {
        for t in 0..8 {
            let client = &client;
            scope.spawn(move || {
                for j in 0..60 {
                    let name = format!("t{t}-{j}");
                    let made = ino_of(
                        client
                            .call(Request::Mknod {
                                parent: ROOT_INO,
                                name: name.clone(),
                                kind: FileKind::File,
                                perm: 0o644,
                                rdev: 0,
                                caller: ME,
                            })
                            .unwrap()
                            .unwrap(),
                    );
                    let found = ino_of(
                        client
                            .call(Request::Lookup {
                                parent: ROOT_INO,
                                name: name.clone(),
                            })
                            .unwrap()
                            .unwrap(),
                    );
                    assert_eq!(found, made, "{name}: lookup answered another call");
                    let got = ino_of(
                        client
                            .call(Request::GetAttr { ino: made })
                            .unwrap()
                            .unwrap(),
                    );
                    assert_eq!(got, made, "{name}: getattr answered another call");
                }
            });
        }
    });
    assert!(!client.is_broken());
}
