//! Hostile input to the meta server: fuzzed request streams, names no kernel sends ('.', '..',
//! '/', NUL, empty), and the limits on connections, sessions and open files. A hostile client
//! need not go through the kernel, so everything here speaks `proto::rpc` directly.

mod common;
use common::*;
use fabric::handshake::{ConnectionLimits, Limit, Refusal};
use meta_server::{MetaConfig, MetaHandle, MetaServer};
use proto::rpc::{Client, Request, Response, Role, RpcError};
use proto::{FileKind, FsError, ROOT_INO};
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;
use testkit::wait_until;

/// The request streams of every message kind, mutated, through the meta server's framing and
/// decoding and into a real namespace store (`meta_server::rpc::fuzz_entry`).
#[test]
fn fuzz_rpc_requests() {
    let dir = tempfile::tempdir().unwrap();
    let store = meta_server::store::Store::open(dir.path(), 4096, ME).unwrap();
    let seeds = proto::fuzz::request_seeds();
    let report = fabric::fuzz::run_framed(
        "rpc requests",
        &seeds,
        fabric::fuzz::DEFAULT_BUDGET,
        Some(0),
        |input| meta_server::rpc::fuzz_entry(input, Some(&store)),
    );
    assert!(report.execs > seeds.len() as u64);
}

/// '.', '..', empty names, '/' and NUL, given to every call that creates or removes a name,
/// answered with the errno Linux gives for the same call on tmpfs (see docs/RELIABILITY.md),
/// and leaving the namespace as it was.
#[test]
fn dot_and_bad_names_get_linux_errnos() {
    let cl = start(0, 1, false);
    let mut fs = Fs::connect(&cl);
    let d = fs.mkdir(ROOT_INO, "d").unwrap();
    let f = fs.create(d.ino, "f").unwrap();
    let symlink = |fs: &mut Fs, name: &str| {
        fs.attr(Request::Symlink {
            parent: d.ino,
            name: name.into(),
            target: "f".into(),
            caller: ME,
        })
    };
    let link = |fs: &mut Fs, name: &str| {
        fs.attr(Request::Link {
            ino: f.ino,
            new_parent: d.ino,
            new_name: name.into(),
        })
    };
    let errno = |r: Result<proto::Attr, FsError>| r.unwrap_err().errno();
    let errno0 = |r: Result<(), FsError>| r.unwrap_err().errno();
    for dot in [".", ".."] {
        assert_eq!(errno(fs.mkdir(d.ino, dot)), libc::EEXIST, "mkdir {dot}");
        assert_eq!(errno(fs.create(d.ino, dot)), libc::EEXIST, "mknod {dot}");
        assert_eq!(errno(symlink(&mut fs, dot)), libc::EEXIST, "symlink {dot}");
        assert_eq!(errno(link(&mut fs, dot)), libc::EEXIST, "link {dot}");
        assert_eq!(errno0(fs.unlink(d.ino, dot)), libc::EISDIR, "unlink {dot}");
        for no_replace in [false, true] {
            assert_eq!(
                errno0(fs.rename(d.ino, dot, ROOT_INO, "x", no_replace)),
                libc::EBUSY,
                "rename from {dot}"
            );
            assert_eq!(
                errno0(fs.rename(d.ino, "f", ROOT_INO, dot, no_replace)),
                if no_replace {
                    libc::EEXIST
                } else {
                    libc::EBUSY
                },
                "rename onto {dot}, no_replace {no_replace}"
            );
        }
    }
    assert_eq!(errno0(fs.rmdir(d.ino, ".")), libc::EINVAL);
    assert_eq!(errno0(fs.rmdir(d.ino, "..")), libc::ENOTEMPTY);
    // The parent is checked first, as Linux resolves it first.
    assert_eq!(errno(fs.mkdir(f.ino, ".")), libc::ENOTDIR);
    assert_eq!(errno0(fs.rmdir(999_999, "..")), libc::ENOENT);

    for bad in ["a/b", "/", "a\0b", "\0"] {
        assert!(
            matches!(fs.mkdir(d.ino, bad), Err(FsError::Invalid(_))),
            "{bad:?}"
        );
        assert!(
            matches!(fs.create(d.ino, bad), Err(FsError::Invalid(_))),
            "{bad:?}"
        );
        assert!(
            matches!(symlink(&mut fs, bad), Err(FsError::Invalid(_))),
            "{bad:?}"
        );
        assert!(
            matches!(link(&mut fs, bad), Err(FsError::Invalid(_))),
            "{bad:?}"
        );
        assert!(
            matches!(fs.unlink(d.ino, bad), Err(FsError::Invalid(_))),
            "{bad:?}"
        );
        assert!(
            matches!(fs.rmdir(d.ino, bad), Err(FsError::Invalid(_))),
            "{bad:?}"
        );
        assert!(
            matches!(
                fs.rename(d.ino, "f", d.ino, bad, false),
                Err(FsError::Invalid(_))
            ),
            "{bad:?}"
        );
    }
    for call in [
        errno(fs.mkdir(d.ino, "")),
        errno(fs.create(d.ino, "")),
        errno0(fs.unlink(d.ino, "")),
        errno0(fs.rmdir(d.ino, "")),
        errno0(fs.rename(d.ino, "", d.ino, "g", false)),
        errno0(fs.rename(d.ino, "f", d.ino, "", false)),
    ] {
        assert_eq!(
            call,
            libc::ENOENT,
            "an empty name is ENOENT, as an empty path"
        );
    }
    // A name that is only dots beyond two is an ordinary name.
    fs.mkdir(d.ino, "...").unwrap();
    fs.rmdir(d.ino, "...").unwrap();

    // Nothing changed: d holds f, and its link counts are intact.
    assert_eq!(fs.names(d.ino), vec![".", "..", "f"]);
    assert_eq!(fs.getattr(d.ino).unwrap().nlink, 2);
    assert_eq!(fs.getattr(f.ino).unwrap().nlink, 1);
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 3);
}

/// A meta server on the mem fabric (no data servers: these tests need the namespace and
/// sessions only) with `tune` applied to its configuration.
struct Server {
    handle: MetaHandle,
    credentials: fabric::Credentials,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start(tune: impl FnOnce(&mut MetaConfig)) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let mut config = MetaConfig::new(dir.path().join("db"), fabric::ServeAt::Mem);
        config.token = "hostile-test".into();
        config.region_bytes = 1 << 20;
        tune(&mut config);
        let credentials = config.credentials();
        Server {
            handle: MetaServer::start(config).unwrap(),
            credentials,
            _dir: dir,
        }
    }

    fn client(&self) -> Result<Client, RpcError> {
        let c = Client::connect(
            self.handle.addr(),
            &self.credentials,
            Role::Client {
                host: "test".into(),
                pid: std::process::id(),
            },
        )?;
        c.set_timeout(Some(Duration::from_secs(10)))?;
        Ok(c)
    }
}

fn refused_by_limit(result: Result<Client, RpcError>) -> (Limit, u64) {
    match result {
        Err(RpcError::Refused(Refusal::Limit { limit, value })) => (limit, value),
        Err(other) => panic!("expected a refusal naming a limit, got {other}"),
        Ok(_) => panic!("a connection beyond the limit was let in"),
    }
}

#[test]
fn sessions_are_limited() {
    let server = Server::start(|c| c.max_sessions = 2);
    let a = server.client().unwrap();
    let _b = server.client().unwrap();
    let refused = server.client();
    let message = refused
        .as_ref()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert_eq!(refused_by_limit(refused), (Limit::Sessions, 2));
    assert!(message.contains("max_sessions = 2"), "{message}");
    // A session that ends frees its place.
    drop(a);
    wait_until(Duration::from_secs(10), "a session's place to free", || {
        server.client().is_ok()
    });
}

#[test]
fn open_files_per_session_are_limited() {
    let server = Server::start(|c| c.max_open_per_session = 2);
    let mut c = server.client().unwrap();
    let call = |c: &mut Client, r: Request| c.call(r).expect("transport");
    let mut files = Vec::new();
    for name in ["a", "b", "c"] {
        let attr = match call(
            &mut c,
            Request::Mknod {
                parent: ROOT_INO,
                name: name.into(),
                kind: FileKind::File,
                perm: 0o644,
                rdev: 0,
                caller: ME,
            },
        ) {
            Ok(Response::Attr(a)) => a,
            other => panic!("{other:?}"),
        };
        files.push(attr.ino);
    }
    let open = |c: &mut Client, ino| {
        c.call(Request::Open {
            ino,
            scheme: lockmgr::LockScheme::CITRON,
        })
        .expect("transport")
    };
    assert!(open(&mut c, files[0]).is_ok());
    assert!(open(&mut c, files[1]).is_ok());
    let refused = open(&mut c, files[2]).unwrap_err();
    assert_eq!(refused, FsError::TooManyOpen { limit: 2 });
    assert_eq!(refused.errno(), libc::EMFILE);
    assert!(refused.to_string().contains("max_open_per_session = 2"));
    // Another open of a file the session has open does not count again.
    assert!(open(&mut c, files[0]).is_ok());
    // Another session has its own count.
    let mut other = server.client().unwrap();
    assert!(open(&mut other, files[2]).is_ok());
    // A release frees a place.
    assert_eq!(
        call(&mut c, Request::Release { ino: files[1] }),
        Ok(Response::Ok)
    );
    assert!(open(&mut c, files[2]).is_ok());
}

/// Connections that never send a hello hold the pending places; a peer beyond is refused with
/// the limit's name before it is read, and the places free when those connections close.
#[test]
fn pending_handshakes_and_connections_per_peer_are_limited() {
    let server = Server::start(|c| {
        c.connection_limits = ConnectionLimits {
            max_per_peer: 4,
            max_pending: 2,
            max_pending_per_peer: 3,
        }
    });
    let addr = server.handle.addr();
    // Two silent connections, one of them part-way through a hello.
    let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    (&silent[1]).write_all(&[0x10, 0, 0, 0]).unwrap();
    // The server counts a connection when it accepts it: wait for both.
    wait_until(
        Duration::from_secs(10),
        "the pending limit to be reached",
        || {
            matches!(
                server.client(),
                Err(RpcError::Refused(Refusal::Limit {
                    limit: Limit::PendingHandshakes,
                    value: 2
                }))
            )
        },
    );
    drop(silent);
    wait_until(
        Duration::from_secs(10),
        "the pending places to free",
        || server.client().is_ok(),
    );

    // Authenticated connections count against the per-peer limit.
    let mut clients = Vec::new();
    wait_until(
        Duration::from_secs(10),
        "4 clients from one address",
        || {
            if let Ok(c) = server.client() {
                clients.push(c);
            }
            clients.len() == 4
        },
    );
    let refused = server.client();
    let message = refused
        .as_ref()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert_eq!(refused_by_limit(refused), (Limit::ConnectionsPerPeer, 4));
    assert!(
        message.contains("max_connections_per_peer = 4"),
        "{message}"
    );
    clients.pop();
    wait_until(Duration::from_secs(10), "a per-peer place to free", || {
        server.client().map(|c| clients.push(c)).is_ok()
    });
}

/// A new client's heartbeat is answered: the server still serves everyone else.
fn assert_still_serving(server: &Server) {
    let mut c = server.client().unwrap();
    assert!(
        matches!(
            c.call(Request::Heartbeat).unwrap(),
            Ok(Response::Heartbeat { .. })
        ),
        "a heartbeat after"
    );
}

/// Opens a raw client connection past the handshake.
fn raw_session(server: &Server) -> TcpStream {
    let mut s = TcpStream::connect(server.handle.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let hello = proto::rpc::Hello::new(
        fabric::handshake::Protocol::Rpc,
        &server.credentials,
        0,
        Role::Client {
            host: "raw".into(),
            pid: 1,
        },
    );
    let answer: proto::rpc::Welcome =
        fabric::handshake::client_handshake(&mut s, &hello, &server.credentials, 1 << 20).unwrap();
    assert!(matches!(answer, proto::rpc::Welcome::Client(_)));
    s
}

/// A request frame over the limit, or one that does not decode, is answered under id 0 with
/// the reason (naming the limit and its value) before the connection closes.
#[test]
fn oversized_and_malformed_requests_get_a_reason() {
    let server = Server::start(|_| {});
    let mut s = raw_session(&server);
    let len = proto::rpc::MAX_FRAME as u32 + 1;
    let mut header = [0u8; fabric::frame::HEADER_LEN];
    header[..4].copy_from_slice(&len.to_le_bytes());
    s.write_all(&header).unwrap();
    let answer: proto::rpc::ResponseFrame = proto::rpc::recv(&mut s).unwrap();
    assert_eq!(answer.id, 0);
    match answer.result {
        Err(FsError::Invalid(why)) => {
            assert!(why.contains(&len.to_string()), "{why}");
            assert!(why.contains(&proto::rpc::MAX_FRAME.to_string()), "{why}");
        }
        other => panic!("expected the reason, got {other:?}"),
    }
    let mut rest = Vec::new();
    assert_eq!(
        std::io::Read::read_to_end(&mut s, &mut rest).unwrap(),
        0,
        "then the connection closes"
    );

    let mut s = raw_session(&server);
    fabric::frame::write_frame(&mut s, &[0xff; 16]).unwrap();
    let answer: proto::rpc::ResponseFrame = proto::rpc::recv(&mut s).unwrap();
    assert_eq!(answer.id, 0);
    assert!(
        matches!(&answer.result, Err(FsError::Invalid(why)) if why.contains("malformed request")),
        "{answer:?}"
    );
    // The server is still serving everyone else.
    assert_still_serving(&server);
}

/// One address cannot hold every place in the handshake: its silent connections are limited
/// on their own, below the total.
#[test]
fn pending_handshakes_per_peer_are_limited() {
    let server = Server::start(|c| {
        c.connection_limits = ConnectionLimits {
            max_per_peer: 10,
            max_pending: 10,
            max_pending_per_peer: 1,
        }
    });
    let silent = TcpStream::connect(server.handle.addr()).unwrap();
    wait_until(
        Duration::from_secs(10),
        "the per-peer pending limit",
        || {
            matches!(
                server.client(),
                Err(RpcError::Refused(Refusal::Limit {
                    limit: Limit::PendingHandshakesPerPeer,
                    value: 1
                }))
            )
        },
    );
    drop(silent);
    wait_until(Duration::from_secs(10), "the place to free", || {
        server.client().is_ok()
    });
}

/// The same hostile frames, sent while the connection is served awake (after an answer, with
/// `MetaConfig::idle_poll` long enough to cover the test; the meta server's `awake` module
/// reads frames straight from the socket then): an oversized or undecodable frame gets its
/// reason under id 0 and the connection closes, a frame with a bad checksum closes it, a frame
/// that arrives in two pieces and two frames sent at once are answered, and the server goes on
/// serving everyone.
#[test]
fn hostile_frames_sent_while_a_connection_is_served_awake() {
    use proto::rpc::{RequestFrame, ResponseFrame};
    let server = Server::start(|c| c.idle_poll = Duration::from_secs(3));
    let frame = |id: u64| {
        postcard::to_stdvec(&RequestFrame {
            id,
            release_first: Vec::new(),
            request: Request::Statfs,
            expires: None,
        })
        .unwrap()
    };
    let answered = |s: &mut TcpStream, id: u64| {
        let answer: ResponseFrame = proto::rpc::recv(s).unwrap();
        assert_eq!(answer.id, id);
        assert!(
            matches!(answer.result, Ok(Response::Stats(_))),
            "{answer:?}"
        );
    };
    // A session whose first call is answered: its connection is served awake from then on.
    let awake_session = || {
        let mut s = raw_session(&server);
        fabric::frame::write_frame(&mut s, &frame(1)).unwrap();
        answered(&mut s, 1);
        s
    };
    let refused_then_closed = |s: &mut TcpStream, says: &str| {
        let answer: ResponseFrame = proto::rpc::recv(s).unwrap();
        assert_eq!(answer.id, 0);
        assert!(
            matches!(&answer.result, Err(FsError::Invalid(why)) if why.contains(says)),
            "{answer:?}"
        );
        let mut rest = Vec::new();
        assert_eq!(std::io::Read::read_to_end(s, &mut rest).unwrap(), 0);
    };

    let mut s = awake_session();
    let mut header = [0u8; fabric::frame::HEADER_LEN];
    header[..4].copy_from_slice(&(proto::rpc::MAX_FRAME as u32 + 1).to_le_bytes());
    s.write_all(&header).unwrap();
    refused_then_closed(&mut s, "exceeds the limit");

    let mut s = awake_session();
    fabric::frame::write_frame(&mut s, &[0xff; 16]).unwrap();
    refused_then_closed(&mut s, "malformed request");

    let mut s = awake_session();
    let body = frame(2);
    let mut bad = fabric::frame::header_for(&body);
    bad[4] ^= 1;
    s.write_all(&bad).unwrap();
    s.write_all(&body).unwrap();
    let mut rest = Vec::new();
    assert_eq!(
        std::io::Read::read_to_end(&mut s, &mut rest).unwrap(),
        0,
        "a bad checksum closes the connection, unanswered"
    );

    let mut s = awake_session();
    let body = frame(3);
    s.write_all(&fabric::frame::header_for(&body)).unwrap();
    s.write_all(&body[..body.len() / 2]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    s.write_all(&body[body.len() / 2..]).unwrap();
    answered(&mut s, 3);
    let mut both = Vec::new();
    for id in [4, 5] {
        let body = frame(id);
        both.extend_from_slice(&fabric::frame::header_for(&body));
        both.extend_from_slice(&body);
    }
    s.write_all(&both).unwrap();
    answered(&mut s, 4);
    answered(&mut s, 5);

    assert_still_serving(&server);
    assert!(
        server.handle.awake_count() >= 3,
        "the frames were not read by an awake thread ({} answered awake)",
        server.handle.awake_count()
    );
}
