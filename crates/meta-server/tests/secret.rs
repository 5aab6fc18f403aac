//! The cluster's secret on the meta server's RPC connections: it never crosses the wire, a
//! captured handshake replayed to the server is refused, and a client with a wrong secret is
//! refused by the server with a message that says the server could not verify it.

use fabric::frame;
use fabric::handshake::{ChallengeAnswer, Proof, Protocol, Refusal};
use meta_server::{MetaConfig, MetaHandle, MetaServer};
use proto::rpc::{Client, HelloAnswer, Request, Response, Role};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

const TOKEN: &str = "rpc-tok-3b8e51f0c2a94d67-never-on-the-wire";

struct Server {
    handle: MetaHandle,
    credentials: fabric::Credentials,
    _dir: tempfile::TempDir,
}

fn start() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let mut config = MetaConfig::new(dir.path().join("db"), fabric::ServeAt::Mem);
    config.token = TOKEN.into();
    config.region_bytes = 1 << 20;
    let credentials = config.credentials();
    Server {
        handle: MetaServer::start(config).unwrap(),
        credentials,
        _dir: dir,
    }
}

fn role() -> Role {
    Role::Client {
        host: "secret-test".into(),
        pid: std::process::id(),
    }
}

/// What crossed a proxied connection: (client to server, server to client).
type Recorded = Arc<Mutex<(Vec<u8>, Vec<u8>)>>;

/// A proxy to `target` for one connection, recording what crosses it.
fn recording_proxy(target: SocketAddr) -> (SocketAddr, Recorded) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let recorded = Arc::new(Mutex::new((Vec::new(), Vec::new())));
    let rec = recorded.clone();
    thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let server = TcpStream::connect(target).unwrap();
        let relay = |mut from: TcpStream, mut to: TcpStream, up: bool| {
            let rec = rec.clone();
            thread::spawn(move || {
                let mut buf = [0u8; 16 << 10];
                loop {
                    let n = match from.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    {
                        let mut r = rec.lock().unwrap();
                        if up { &mut r.0 } else { &mut r.1 }.extend_from_slice(&buf[..n]);
                    }
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(Shutdown::Write);
            })
        };
        let up = relay(
            client.try_clone().unwrap(),
            server.try_clone().unwrap(),
            true,
        );
        let down = relay(server, client, false);
        let _ = (up.join(), down.join());
    });
    (addr, recorded)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A client session through a recording proxy: the handshake and a few calls. Returns what
/// crossed each way.
fn recorded_session(server: &Server) -> (Vec<u8>, Vec<u8>) {
    let (proxy, recorded) = recording_proxy(server.handle.addr());
    {
        let mut client = Client::connect(proxy, &server.credentials, role()).unwrap();
        assert!(matches!(
            client.call(Request::Heartbeat).unwrap(),
            Ok(Response::Heartbeat { .. })
        ));
        // Not there: answered with an error, which is traffic as good as any.
        let _ = client
            .call(Request::Lookup {
                parent: proto::ROOT_INO,
                name: "captured-file".into(),
            })
            .unwrap();
    }
    testkit::wait_until(
        Duration::from_secs(10),
        "the proxy to see both ends close",
        || Arc::strong_count(&recorded) == 1,
    );
    let r = recorded.lock().unwrap();
    (r.0.clone(), r.1.clone())
}

#[test]
fn the_token_never_crosses_the_wire() {
    let server = start();
    let (up, down) = recorded_session(&server);
    assert!(
        contains(&up, b"captured-file"),
        "the capture saw the session"
    );
    for (direction, bytes) in [("client to server", &up), ("server to client", &down)] {
        for piece in TOKEN.as_bytes().windows(8) {
            assert!(
                !contains(bytes, piece),
                "part of the token went {direction}"
            );
        }
    }
}

#[test]
fn a_replayed_handshake_is_refused() {
    let server = start();
    let (up, _) = recorded_session(&server);
    let mut replay = TcpStream::connect(server.handle.addr()).unwrap();
    replay
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    replay.write_all(&up).unwrap();
    let challenge: ChallengeAnswer = proto::rpc::recv(&mut replay).unwrap();
    assert!(challenge.is_ok());
    let answer: HelloAnswer = proto::rpc::recv(&mut replay).unwrap();
    match answer {
        Err(refusal @ Refusal::BadToken { .. }) => assert!(
            refusal.to_string().contains("could not verify the client"),
            "{refusal}"
        ),
        other => panic!("a replayed handshake was answered {:?}", other.map(|_| ())),
    }
    let mut rest = Vec::new();
    let _ = replay.read_to_end(&mut rest);
    assert!(rest.is_empty(), "the server answered a replayed request");
}

/// A client that holds a wrong secret and sends its proof anyway is refused by the server,
/// which says it could not verify the client and echoes no secret.
#[test]
fn a_wrong_secret_is_refused_by_the_server() {
    let server = start();
    let wrong = fabric::Credentials::new(server.credentials.cluster.clone(), "not-the-token");
    let mut s = TcpStream::connect(server.handle.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let hello =
        postcard::to_stdvec(&proto::rpc::Hello::new(Protocol::Rpc, &wrong, 0, role())).unwrap();
    frame::write_frame(&mut s, &hello).unwrap();
    let challenge = match proto::rpc::recv::<ChallengeAnswer>(&mut s).unwrap() {
        Ok(challenge) => challenge,
        Err(refusal) => panic!("refused the hello: {refusal}"),
    };
    proto::rpc::send(&mut s, &Proof::new(&wrong, &hello, &challenge)).unwrap();
    match proto::rpc::recv::<HelloAnswer>(&mut s).unwrap() {
        Err(refusal @ Refusal::BadToken { .. }) => {
            let text = refusal.to_string();
            assert!(
                text.contains("authentication failed: the server could not verify the client"),
                "{text}"
            );
            assert!(
                !text.contains("not-the-token") && !text.contains(TOKEN),
                "{text}"
            );
        }
        other => panic!("expected BadToken, got {:?}", other.map(|_| ())),
    }
}
