//! Restarts, refusals, sessions and data-server membership.

mod common;
use common::*;
use data_server::DataServer;
use fabric::Backend;
use fabric::{EndpointExt, RemoteAddr, ShmConnector};
use lockmgr::LockScheme;
use proto::rpc::{Client, Request, Response, Role, RpcError};
use proto::{fcb, FabricAddr, FsError, ROOT_INO};
use std::time::Duration;

fn shm(addr: &FabricAddr) -> impl fabric::Endpoint {
    match addr {
        FabricAddr::Shm { dir } => ShmConnector::attach(dir.clone()).unwrap().endpoint(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn restart_keeps_namespace_chunks_sizes_and_data() {
    let mut cl = start(2, 8, true);
    let ids: Vec<u32> = cl.data_servers().iter().map(|d| d.id()).collect();
    let (f, locs) = {
        let mut fs = Fs::connect(&cl);
        let d = fs.mkdir(ROOT_INO, "dir").unwrap();
        let f = fs.create(d.ino, "file").unwrap();
        fs.attr(Request::Symlink {
            parent: ROOT_INO,
            name: "link".into(),
            target: "dir/file".into(),
            caller: ME,
        })
        .unwrap();
        let o = match fs
            .call(Request::Open {
                ino: f.ino,
                scheme: LockScheme::CITRON,
            })
            .unwrap()
        {
            Response::Open(o) => o,
            other => panic!("{other:?}"),
        };
        let locs = fs.allocate(f.ino, 0, 0, 3).unwrap();
        for (i, loc) in locs.iter().enumerate() {
            let info = &fs.info.data_servers[loc.server as usize];
            shm(&info.fabric)
                .write(
                    RemoteAddr::new(info.region, loc.index * layout().unit()),
                    &[i as u8 + 1; 16],
                )
                .unwrap();
        }
        let FabricAddr::Shm { dir } = &fs.info.meta_fabric else {
            panic!()
        };
        let mut meta = ShmConnector::attach(dir.clone()).unwrap().endpoint();
        meta.cas(o.fcb.add(fcb::SIZE), 0, 2 * CHUNK + 16).unwrap();
        // The file stays open across the shutdown: the size is persisted from the FCB.
        (f, locs)
    };
    // Every server stops (the meta server first, persisting the open file's size) and starts
    // again on the same database and region files.
    cl.restart().unwrap();
    assert_eq!(
        cl.data_servers().iter().map(|d| d.id()).collect::<Vec<_>>(),
        ids,
        "ids are stable by name"
    );
    let mut fs = Fs::connect(&cl);
    let d = fs.lookup(ROOT_INO, "dir").unwrap();
    let f2 = fs.lookup(d.ino, "file").unwrap();
    assert_eq!(f2.ino, f.ino);
    assert_eq!(f2.size, 2 * CHUNK + 16);
    let link = fs.lookup(ROOT_INO, "link").unwrap().ino;
    assert_eq!(
        fs.call(Request::Readlink { ino: link }),
        Ok(Response::Data(b"dir/file".to_vec()))
    );
    let map: Vec<_> = fs
        .chunk_map(f.ino, 0, 3)
        .into_iter()
        .map(|l| l.unwrap())
        .collect();
    assert_eq!(map, locs);
    for (i, loc) in locs.iter().enumerate() {
        let info = &fs.info.data_servers[loc.server as usize];
        let got = shm(&info.fabric)
            .read(
                RemoteAddr::new(info.region, loc.index * layout().unit()),
                16,
            )
            .unwrap();
        assert_eq!(got, vec![i as u8 + 1; 16], "chunk {i} kept its data");
    }
    let s = fs.stats();
    // Chunks 0..3 of a file hold 4 + 4 + 8 KiB.
    assert_eq!(s.total_blocks * s.block_size, 16 * CHUNK);
    assert_eq!(
        (s.total_blocks - s.free_blocks) * s.block_size,
        layout().charged(layout().start(3))
    );
    // New inodes do not reuse old numbers.
    assert!(fs.create(ROOT_INO, "new").unwrap().ino > f.ino);
}

#[test]
fn wrong_token_or_cluster_is_refused_clearly() {
    let cl = start(0, 1, false);
    let role = Role::Client {
        host: "h".into(),
        pid: 1,
    };
    match Client::connect(
        cl.meta_addr(),
        &fabric::Credentials::new(cl.name(), "wrong"),
        role.clone(),
    ) {
        // The client cannot verify the server (it proves another secret), and says so.
        Err(RpcError::ServerUnverified(why)) => {
            assert!(why.contains("could not verify the server"), "{why}");
            assert!(!why.contains(cl.token()), "{why}");
        }
        other => panic!(
            "expected the server unverified, got {:?}",
            other.map(|_| ())
        ),
    }
    match Client::connect(
        cl.meta_addr(),
        &fabric::Credentials::new("other", cl.token()),
        role,
    ) {
        Err(RpcError::Refused(why)) => assert!(why.to_string().contains("cluster"), "{why}"),
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
    let mut bad = cl.data_config(9);
    bad.token = "wrong".into();
    let err = DataServer::start(bad).err().expect("refused");
    assert!(format!("{err:#}").contains("token"), "{err:#}");
    // The server still serves good clients.
    let mut fs = Fs::connect(&cl);
    assert!(fs.getattr(ROOT_INO).is_ok());
}

#[test]
fn sessions_expire_and_release_their_files() {
    let cl = Cluster::start(ClusterSpec {
        session_lease: Duration::from_millis(300),
        ..spec(1, 4, false)
    })
    .unwrap();
    let free = cl.meta().meta_free_bytes();
    let mut quiet = Fs::connect(&cl);
    let mut busy = Fs::connect(&cl);
    let f = quiet.create(ROOT_INO, "f").unwrap();
    quiet
        .call(Request::Open {
            ino: f.ino,
            scheme: LockScheme::CITRON,
        })
        .unwrap();
    // The same scheme: a file open under one refuses opens under another (SchemeInUse).
    busy.call(Request::Open {
        ino: f.ino,
        scheme: LockScheme::CITRON,
    })
    .unwrap();
    quiet.unlink(ROOT_INO, "f").unwrap();
    for _ in 0..12 {
        std::thread::sleep(Duration::from_millis(50));
        busy.heartbeat().unwrap();
    }
    // The quiet session is gone; the busy one (heartbeating) still holds the file.
    assert_eq!(quiet.call(Request::Heartbeat), Err(FsError::Stale));
    assert_eq!(busy.getattr(f.ino).unwrap().nlink, 0);
    busy.ok(Request::Release { ino: f.ino }).unwrap();
    assert_eq!(
        busy.getattr(f.ino),
        Err(FsError::NotFound),
        "the orphan went with the last opener"
    );
    assert_eq!(cl.meta().meta_free_bytes(), free);

    // A closed connection ends its session at once.
    let g = busy.create(ROOT_INO, "g").unwrap();
    let mut other = Fs::connect(&cl);
    other
        .call(Request::Open {
            ino: g.ino,
            scheme: LockScheme::CITRON,
        })
        .unwrap();
    assert!(cl.meta().meta_free_bytes() < free);
    drop(other);
    testkit::wait_until(
        Duration::from_secs(2),
        "the closed session's file to be released",
        || cl.meta().meta_free_bytes() == free,
    );
}

#[test]
fn allocation_avoids_departed_data_servers() {
    let mut cl = start(2, 4, false);
    let gone = cl.data_servers()[1].id();
    cl.data_servers_mut()[1].shutdown();
    let mut fs = Fs::connect(&cl);
    let f = fs.create(ROOT_INO, "f").unwrap();
    // The meta server notices the closed registration connection at once (EOF); give the
    // blocking pool a moment to run the bookkeeping.
    std::thread::sleep(Duration::from_millis(200));
    let g = fs.getattr(f.ino).unwrap().generation;
    // Four whole chunks (from `full()` on) fill the one server left.
    let locs = fs.allocate(f.ino, g, full(), 4).unwrap();
    assert!(locs.iter().all(|l| l.server != gone), "{locs:?}");
    assert_eq!(fs.allocate(f.ino, g, 0, 1), Err(FsError::NoSpace));
}

#[test]
fn tcp_fabric_serves_fcbs_and_zeroes_chunks() {
    let cl = Cluster::start(ClusterSpec {
        fabric: Backend::Tcp,
        ..spec(1, 4, false)
    })
    .unwrap();
    let mut fs = Fs::connect(&cl);
    let tcp = |addr: &FabricAddr| match addr {
        FabricAddr::Tcp { addr } => {
            fabric::TcpEndpoint::connect(addr.as_str(), &cl.credentials()).unwrap()
        }
        other => panic!("{other:?}"),
    };
    let mut meta_ep = tcp(&fs.info.meta_fabric);
    let f = fs.create(ROOT_INO, "f").unwrap();
    let o = match fs
        .call(Request::Open {
            ino: f.ino,
            scheme: LockScheme::CITRON,
        })
        .unwrap()
    {
        Response::Open(o) => o,
        other => panic!("{other:?}"),
    };
    assert_eq!(meta_ep.read_u64(o.fcb.add(fcb::INO)).unwrap(), f.ino);
    let loc = fs.allocate(f.ino, 0, 0, 1).unwrap()[0];
    let info = fs.info.data_servers[0].clone();
    let mut data_ep = tcp(&info.fabric);
    let at = RemoteAddr::new(info.region, loc.index * layout().unit());
    data_ep.write(at, &[7u8; 64]).unwrap();
    meta_ep.cas(o.fcb.add(fcb::SIZE), 0, 64).unwrap();
    fs.attr(Request::SetAttr {
        ino: f.ino,
        set: proto::SetAttr {
            size: Some(32),
            ..Default::default()
        },
        caller: ME,
    })
    .unwrap();
    assert_eq!(
        data_ep.read(at, 64).unwrap(),
        [[7u8; 32], [0u8; 32]].concat()
    );
}

/// Fencing on tcp: a `Fence` revokes the sessions that have been silent for `fence_after` on
/// the meta server's fabric server and on every data server before it answers — their open
/// endpoints execute nothing more and new ones are refused — while the fencing session and a
/// heartbeating one keep working.
/// The fence tests' `fence_after`: 20 heartbeat intervals (`BEAT`), so that a heartbeat made
/// late by a loaded machine does not fence the session that is meant to be live.
const FENCE_AFTER: Duration = Duration::from_millis(400);
/// The fence tests' heartbeat interval.
const BEAT: Duration = Duration::from_millis(20);
/// Heartbeats of the live sessions while the silent one is silent: 3× `FENCE_AFTER`.
const SILENCE_BEATS: u32 = 60;

#[test]
fn fence_revokes_silent_sessions_on_every_fabric_server() {
    use fabric::{FabricError, TcpConnector};
    let cl = Cluster::start(ClusterSpec {
        fabric: Backend::Tcp,
        fence_after: FENCE_AFTER,
        ..spec(1, 4, false)
    })
    .unwrap();

    let mut silent = Fs::connect(&cl);
    let mut live = Fs::connect(&cl);
    let mut fencer = Fs::connect(&cl);
    let connect = |fs: &Fs, addr: &FabricAddr| {
        let FabricAddr::Tcp { addr } = addr else {
            panic!("tcp expected")
        };
        TcpConnector::connect_session(addr.as_str(), cl.credentials(), fs.info.session).unwrap()
    };
    let ds = silent.info.data_servers[0].clone();
    let data_word = RemoteAddr::new(ds.region, 0);
    let meta_word = RemoteAddr::new(silent.info.meta_region, 0);
    let silent_data = connect(&silent, &ds.fabric);
    let silent_meta = connect(&silent, &silent.info.meta_fabric);
    let live_data = connect(&live, &ds.fabric);
    let (mut sd, mut sm) = (
        silent_data.endpoint().unwrap(),
        silent_meta.endpoint().unwrap(),
    );
    let mut ld = live_data.endpoint().unwrap();
    sd.write_u64(data_word, 1).unwrap();
    sm.read_u64(meta_word).unwrap();

    // The silent session says nothing for 3× fence_after; the live one heartbeats.
    for _ in 0..SILENCE_BEATS {
        std::thread::sleep(BEAT);
        live.heartbeat().unwrap();
    }
    fencer.ok(Request::Fence).unwrap();

    let refused = |r: Result<u64, FabricError>| match r {
        Err(FabricError::Refused(why)) => assert!(why.contains("revoked"), "{why}"),
        other => panic!("a fenced session's verb must be refused, got {other:?}"),
    };
    refused(sd.write_u64(data_word, 2).map(|()| 0));
    refused(sm.read_u64(meta_word));
    assert!(
        silent_data.endpoint().is_err(),
        "a new connection is refused too"
    );
    assert_eq!(
        ld.read_u64(data_word).unwrap(),
        1,
        "the fenced write did not land"
    );
    ld.write_u64(data_word, 3).unwrap();
    assert_eq!(silent.call(Request::Heartbeat), Err(FsError::Stale));
    live.heartbeat().unwrap();
    fencer.ok(Request::Fence).unwrap();
    ld.write_u64(data_word, 4).unwrap();
}

/// A client stopped past `fence_after` and resumed just before a fence is still fenced: on a
/// resume, its heartbeat and a stale post (checked before the stop) race, and when the heartbeat
/// wins, the client is no longer silent while the post is still on its way — the breaker must
/// revoke it anyway, or the post lands after the breaker took the lock (the torn record of
/// `crates/tests/tests/pause.rs`).
#[test]
fn a_session_back_from_a_silence_is_still_fenced() {
    use fabric::{FabricError, TcpConnector};
    let cl = Cluster::start(ClusterSpec {
        fabric: Backend::Tcp,
        fence_after: FENCE_AFTER,
        ..spec(1, 4, false)
    })
    .unwrap();
    let mut resumed = Fs::connect(&cl);
    let mut live = Fs::connect(&cl);
    let mut fencer = Fs::connect(&cl);
    let ds = resumed.info.data_servers[0].clone();
    let FabricAddr::Tcp { addr } = &ds.fabric else {
        panic!("tcp expected")
    };
    let connector =
        TcpConnector::connect_session(addr.as_str(), cl.credentials(), resumed.info.session)
            .unwrap();
    let mut ep = connector.endpoint().unwrap();
    let word = RemoteAddr::new(ds.region, 0);
    ep.write_u64(word, 1).unwrap();
    // "Stopped" for 3× fence_after while the others heartbeat, then back: it speaks first.
    for _ in 0..SILENCE_BEATS {
        std::thread::sleep(BEAT);
        live.heartbeat().unwrap();
        fencer.heartbeat().unwrap();
    }
    resumed.heartbeat().unwrap();
    live.heartbeat().unwrap();
    fencer.ok(Request::Fence).unwrap();
    // Its stale post arrives after the fence: refused.
    match ep.write_u64(word, 2) {
        Err(FabricError::Refused(why)) => assert!(why.contains("revoked"), "{why}"),
        other => panic!("the resumed session's post must be refused, got {other:?}"),
    }
    let mut check =
        TcpConnector::connect_session(addr.as_str(), cl.credentials(), live.info.session)
            .unwrap()
            .endpoint()
            .unwrap();
    assert_eq!(
        check.read_u64(word).unwrap(),
        1,
        "the stale post did not land"
    );
    // The live session and the fencer were not fenced.
    check.write_u64(word, 3).unwrap();
    live.heartbeat().unwrap();
    fencer.heartbeat().unwrap();
}

/// A session that ended without a fence — its lease ran out while its client was stopped — is
/// revoked on every fabric server too: a later fence revokes only sessions it still knows, so
/// without this the stopped client's batches would still execute when it resumes.
#[test]
fn a_session_ended_by_its_lease_is_revoked_on_every_fabric_server() {
    use fabric::{FabricError, TcpConnector};
    let cl = Cluster::start(ClusterSpec {
        fabric: Backend::Tcp,
        session_lease: Duration::from_millis(300),
        ..spec(1, 4, false)
    })
    .unwrap();
    let mut expired = Fs::connect(&cl);
    let mut live = Fs::connect(&cl);
    let ds = expired.info.data_servers[0].clone();
    let FabricAddr::Tcp { addr } = &ds.fabric else {
        panic!("tcp expected")
    };
    let connector =
        TcpConnector::connect_session(addr.as_str(), cl.credentials(), expired.info.session)
            .unwrap();
    let mut ep = connector.endpoint().unwrap();
    let word = RemoteAddr::new(ds.region, 0);
    ep.write_u64(word, 1).unwrap();
    // The expired session says nothing past its lease; the live one heartbeats.
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(50));
        live.heartbeat().unwrap();
    }
    assert_eq!(expired.call(Request::Heartbeat), Err(FsError::Stale));
    // The data server applies the revocation at its next poll.
    testkit::wait_until(
        Duration::from_secs(10),
        "the expired session revoked",
        || matches!(ep.write_u64(word, 2), Err(FabricError::Refused(_))),
    );
    let mut check =
        TcpConnector::connect_session(addr.as_str(), cl.credentials(), live.info.session)
            .unwrap()
            .endpoint()
            .unwrap();
    assert_eq!(
        check.read_u64(word).unwrap(),
        1,
        "nothing landed once revoked"
    );
}

/// The lock server of the `server` scheme runs only when asked for, and then takes no request
/// from a peer without the cluster's token; without it, opening a file for the `server` scheme
/// fails with a clear error instead of pointing clients at nothing.
#[test]
fn lock_server_runs_only_when_asked_and_checks_the_token() {
    use lockmgr::baselines::LockServerClient;
    use lockmgr::{LockError, RangeLock};

    let cl = Cluster::start(spec(1, 4, false)).unwrap();
    let mut fs = Fs::connect(&cl);
    assert_eq!(fs.info.lock_server, None, "no lock server unless asked");
    let f = fs.create(ROOT_INO, "f").unwrap();
    let open = |fs: &mut Fs, scheme| fs.call(Request::Open { ino: f.ino, scheme });
    assert_eq!(
        open(&mut fs, LockScheme::SERVER).unwrap_err(),
        FsError::NotSupported
    );
    assert!(open(&mut fs, LockScheme::CITRON).is_ok());
    drop(fs);
    drop(cl);

    let cl = Cluster::start(ClusterSpec {
        lock_server: true,
        ..spec(1, 4, false)
    })
    .unwrap();
    let fs = Fs::connect(&cl);
    let addr = fs
        .info
        .lock_server
        .clone()
        .expect("asked for a lock server");
    for bad in [
        fabric::Credentials::new(cl.name(), "wrong"),
        fabric::Credentials::new(cl.name(), ""),
        fabric::Credentials::new("other", cl.token()),
    ] {
        match LockServerClient::connect(addr.as_str(), &bad) {
            Err(LockError::Server(why)) => assert!(
                why.contains("refused") || why.contains("could not verify the server"),
                "{why}"
            ),
            Err(other) => panic!("expected a refusal, got {other}"),
            Ok(_) => panic!("the lock server let in a peer with {bad:?}"),
        }
    }
    // A fabric client dialling the lock server's port is told it has the wrong address.
    match fabric::TcpEndpoint::connect(addr.as_str(), &cl.credentials()) {
        Err(e) => assert!(
            e.to_string().contains("lock server"),
            "a wrong-port refusal names the protocol: {e}"
        ),
        Ok(_) => panic!("a verbs client was accepted by the lock server"),
    }
    let mut good = LockServerClient::connect(addr.as_str(), &cl.credentials()).unwrap();
    let id = good.acquire(0..8).unwrap();
    good.release(id).unwrap();
}

/// A data server started while its meta server is away (not started yet, or restarting: a
/// soak's restarted data server hit a meta server killed during its registration and exited)
/// waits for it and registers, instead of exiting. Seen failing (connection refused at once)
/// before the first registration retried.
/// A meta server that stops cleanly says so on every connection before closing it, so that its
/// peers can tell a clean stop from a crash: a data server then waits for the next meta server
/// with an info line instead of warning that it lost it (`citronfs up` printed two warnings on
/// every Ctrl-C), and a client's calls fail with `ServerStopping`.
#[test]
fn a_clean_stop_tells_every_connection_it_is_stopping() {
    let mut cl = start(1, 4, false);
    let client = shared_client(&cl);
    assert!(matches!(client.call(Request::Heartbeat), Ok(Ok(_))));
    cl.restart_meta().unwrap();
    // The goodbye waits in the connection (a client has no reader thread: its next call
    // reads it) and fails that call with `ServerStopping`, and every later one as not sent
    // for that reason: none of them ran.
    for _ in 0..2 {
        match client.call(Request::Heartbeat) {
            Err(e) if e.is_server_stopping() && !e.maybe_executed() => {}
            other => panic!("expected ServerStopping, got {:?}", other.map(|_| ())),
        }
        assert!(client.is_broken());
    }
    // The data server registered again with the new meta server, which serves.
    let mut fs = Fs::connect(&cl);
    assert!(fs.getattr(ROOT_INO).is_ok());
}

#[test]
fn a_data_server_started_before_its_meta_server_waits_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let addr = testkit::restartable_addr().unwrap();
    let token = testkit::random_token().unwrap();
    let mut meta_config = meta_server::MetaConfig::new(dir.path().join("db"), fabric::ServeAt::Mem);
    meta_config.listen = addr;
    meta_config.token = token.clone();
    let config = data_server::DataConfig {
        name: "early".into(),
        meta_addr: addr.to_string(),
        cluster: meta_config.cluster.clone(),
        token,
        capacity_bytes: 4 << 20,
        fabric: fabric::ServeAt::Mem,
        backing: data_server::Backing::Memory,
        zone: None,
    };
    let data = std::thread::spawn(move || DataServer::start(config));
    // Long enough for the first attempts to find nobody listening.
    std::thread::sleep(Duration::from_millis(300));
    let meta = meta_server::MetaServer::start(meta_config).unwrap();
    let data = data
        .join()
        .unwrap()
        .expect("registered once the meta server was up");
    assert_eq!(data.id(), 0);
    drop(data);
    drop(meta);
}

/// A shrinking truncate leaves the bytes of its new last chunk past the size to zero (its
/// tail). While that chunk's data server is away the meta server refuses the truncate
/// (`Unavailable`, which clients retry) instead of leaving the tail to zero when the server
/// registers again: on shm a client that has not yet noticed the server's absence still writes
/// to its region, and what it wrote past the new size would be zeroed then. Seen failing (the
/// truncate answered at once) before the refusal.
#[test]
fn a_shrink_whose_tail_is_on_an_absent_data_server_is_refused_until_it_is_back() {
    let mut cl = start(1, 8, true);
    let mut fs = Fs::connect(&cl);
    let f = fs.create(ROOT_INO, "f").unwrap();
    let set_size = |fs: &mut Fs, size: u64| {
        fs.attr(Request::SetAttr {
            ino: f.ino,
            set: proto::SetAttr {
                size: Some(size),
                ..proto::SetAttr::default()
            },
            caller: ME,
        })
    };
    let full = layout().start(4);
    // Sized first (a size raised over chunks frees them: at rest only a dead writer leaves
    // chunks past the size), then the chunks a writer would allocate and fill.
    let grown = set_size(&mut fs, full).unwrap();
    fs.allocate(f.ino, grown.generation, 0, 4).unwrap();
    let live = |fs: &mut Fs| match fs.call(Request::Cluster).unwrap() {
        Response::Cluster(info) => info.data_servers.iter().any(|ds| ds.live),
        other => panic!("{other:?}"),
    };
    cl.data_servers_mut()[0].shutdown();
    testkit::wait_until(Duration::from_secs(10), "the data server gone", || {
        !live(&mut fs)
    });
    // Mid-chunk: a tail to zero on the absent server.
    let shrunk = layout().start(2) + 100;
    match set_size(&mut fs, shrunk) {
        Err(FsError::Unavailable(why)) => assert!(why.contains("away"), "{why}"),
        other => panic!("expected the truncate refused, got {other:?}"),
    }
    assert_eq!(fs.getattr(f.ino).unwrap().size, full, "nothing changed");
    // Chunk-aligned: nothing to zero, nothing to wait for.
    set_size(&mut fs, layout().start(3)).unwrap();
    cl.restart_data_server(0).unwrap();
    testkit::wait_until(Duration::from_secs(10), "the data server back", || {
        live(&mut fs)
    });
    assert_eq!(set_size(&mut fs, shrunk).unwrap().size, shrunk);
}
