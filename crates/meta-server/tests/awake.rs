//! Connections served awake between requests (`MetaConfig::idle_poll`, the meta server's
//! `awake` module): after an answer, a thread watches the connection without sleeping and
//! answers its quick requests itself. Its answers must be the service's, a request it does not
//! run must still be answered, other connections must be answered meanwhile, and a stopping
//! server must not wait for it. Here the budget is seconds, so that a watch that overstays or
//! holds up the runtime shows as a call (or a shutdown) that waits for it; the bounds leave a
//! wide margin for a loaded machine. A first version, which spun on the async worker itself,
//! failed the other-connections check: B's call waited out the whole budget.

mod common;
use common::*;
use proto::rpc::{Request, Response, SharedClient};
use proto::ROOT_INO;
use std::time::{Duration, Instant};

/// Far longer than any call here takes, so that waiting out a watch is unmistakable.
const BUDGET: Duration = Duration::from_secs(3);
/// A call (or a shutdown) that took longer waited for a watch.
const BOUND: Duration = Duration::from_millis(1500);

fn lookup(client: &SharedClient, name: &str) -> u64 {
    match client
        .call(Request::Lookup {
            parent: ROOT_INO,
            name: name.into(),
        })
        .unwrap()
        .unwrap()
    {
        Response::Attr(attr) => attr.ino,
        other => panic!("lookup {name}: {other:?}"),
    }
}

/// The root directory's names (`ReadDir` goes to the blocking pool: an awake thread hands it
/// back to the connection's async loop).
fn names(client: &SharedClient) -> Vec<String> {
    match client
        .call(Request::ReadDir {
            ino: ROOT_INO,
            cookie: 0,
            max: 4096,
        })
        .unwrap()
        .unwrap()
    {
        Response::Entries(entries) => entries.into_iter().map(|e| e.name).collect(),
        other => panic!("readdir: {other:?}"),
    }
}

/// Times one quick call.
fn timed_statfs(client: &SharedClient) -> Duration {
    let start = Instant::now();
    match client.call(Request::Statfs).unwrap().unwrap() {
        Response::Stats(_) => {}
        other => panic!("expected statistics, got {other:?}"),
    }
    start.elapsed()
}

#[test]
fn calls_served_awake_are_answered_right_and_nobody_waits_for_them() {
    let cl = Cluster::start(ClusterSpec {
        meta_idle_poll: BUDGET,
        ..spec(1, 8, false)
    })
    .unwrap();
    let (a, b, c) = (shared_client(&cl), shared_client(&cl), shared_client(&cl));

    // A's first answer starts a watch of A's connection; A's calls that follow are read and
    // answered by it, a directory listing handed back to the async loop among them.
    timed_statfs(&a);
    let awake_before = cl.meta().awake_count();
    for i in 0..20 {
        let start = Instant::now();
        let name = format!("f{i}");
        let made = shared_mknod(&a, &name);
        assert_eq!(lookup(&a, &name), made, "{name}: another inode");
        if i % 5 == 4 {
            assert!(names(&a).contains(&name), "{name} is not listed");
        }
        assert!(
            start.elapsed() < BOUND,
            "{name}: calls took {:?}, a watch did not end when a request came",
            start.elapsed()
        );
    }
    assert!(
        cl.meta().awake_count() >= awake_before + 20,
        "A's calls were not answered by the awake thread ({} of them)",
        cl.meta().awake_count() - awake_before
    );

    // A is watched; B and C, each on a connection of its own, are answered meanwhile.
    let for_b = timed_statfs(&b);
    let for_c = timed_statfs(&c);
    assert!(
        for_b < BOUND && for_c < BOUND,
        "B's call took {for_b:?} and C's {for_c:?} while A's connection was watched: \
         the watch held up the runtime"
    );

    // A stopping server does not wait for the watch to run out.
    timed_statfs(&a);
    let start = Instant::now();
    drop(cl);
    assert!(
        start.elapsed() < BOUND,
        "shutting down took {:?} while a connection was watched",
        start.elapsed()
    );
}
