//! One connection shared by many threads (`proto::rpc::SharedClient`): the meta server runs a
//! connection's requests concurrently and each blocking-pool thread writes its own answer (under
//! the connection's writer lock), so answers come back interleaved and in any order; every call
//! must still get its own, whole.

mod common;
use common::*;
use proto::rpc::{Request, Response};
use proto::ROOT_INO;

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
                    let made = shared_mknod(client, &name);
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

/// Callers that come and go at odd moments: with no reader thread, one waiting caller reads
/// for all and hands the role over when its own answer arrives (`SharedClient`'s
/// leader/follower). Sixteen threads, each pausing a varying few microseconds between calls,
/// so that callers arrive while a reader is reading, leaving, or gone: a hand-over missed
/// leaves a caller parked until the 10 s call bound fails it; an answer given to the wrong
/// caller shows as a wrong inode.
#[test]
fn callers_arriving_and_leaving_at_any_moment_all_get_their_answers() {
    let cl = start(1, 8, false);
    let client = shared_client(&cl);
    let made: Vec<u64> = (0..16)
        .map(|t| shared_mknod(&client, &format!("f{t}")))
        .collect();
    std::thread::scope(|scope| {
        for (t, &ino) in made.iter().enumerate() {
            let client = &client;
            scope.spawn(move || {
                for j in 0..300u64 {
                    // 0 to 60 µs, different for every thread and call.
                    let pause = (j * 7 + t as u64 * 13) % 61;
                    if pause > 0 {
                        std::thread::sleep(std::time::Duration::from_micros(pause));
                    }
                    let got = ino_of(client.call(Request::GetAttr { ino }).unwrap().unwrap());
                    assert_eq!(got, ino, "thread {t}, call {j}: answered another call");
                }
            });
        }
    });
    assert!(!client.is_broken());
}
