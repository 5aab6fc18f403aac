//! The handshake's secret on a real `tcp` fabric connection: it never crosses the wire, a
//! captured handshake replayed to the server is refused, a wrong secret is refused with a
//! message that says which side failed, and a server that does not know the secret is found
//! out by the client before it sends anything derived from the secret.

use fabric::frame;
use fabric::handshake::{self, Challenge, ChallengeAnswer, Proof, Protocol, Refusal};
use fabric::tcp::wire::{Hello, HelloAnswer, PROTOCOL_VERSION};
use fabric::{
    Batch, Completions, Credentials, Endpoint, EndpointExt, FabricError, RegionId, RemoteAddr,
    TcpEndpoint, TcpServer,
};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

const CLUSTER: &str = "capture-cluster";
/// A token no other bytes of a session could contain by chance.
const TOKEN: &str = "tok-9f2c6e1ab7d04c58-never-on-the-wire";
const R: RegionId = RegionId(1);

fn creds() -> Credentials {
    Credentials::new(CLUSTER, TOKEN)
}

fn server() -> TcpServer {
    let server = TcpServer::bind("127.0.0.1:0", creds()).unwrap();
    server.register(R, 4096).unwrap();
    server
}

/// What a recording proxy saw: the bytes of each direction of every connection through it.
#[derive(Default)]
struct Recording {
    to_server: Vec<Vec<u8>>,
    to_client: Vec<Vec<u8>>,
}

/// A TCP proxy to `target` that records both directions of every connection it relays.
fn recording_proxy(target: SocketAddr) -> (SocketAddr, Arc<Mutex<Recording>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let recording = Arc::new(Mutex::new(Recording::default()));
    let rec = recording.clone();
    thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let server = TcpStream::connect(target).unwrap();
            let index = {
                let mut r = rec.lock().unwrap();
                r.to_server.push(Vec::new());
                r.to_client.push(Vec::new());
                r.to_server.len() - 1
            };
            let relay = |mut from: TcpStream, mut to: TcpStream, to_server: bool| {
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
                            let seen = if to_server {
                                &mut r.to_server
                            } else {
                                &mut r.to_client
                            };
                            seen[index].extend_from_slice(&buf[..n]);
                        }
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                });
            };
            relay(
                client.try_clone().unwrap(),
                server.try_clone().unwrap(),
                true,
            );
            relay(server, client, false);
        }
    });
    (addr, recording)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Reads frames from `bytes`: their bodies.
fn frames(mut bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut bodies = Vec::new();
    while !bytes.is_empty() {
        let mut body = Vec::new();
        frame::read_frame(&mut bytes, usize::MAX, &mut body).unwrap();
        bodies.push(body);
    }
    bodies
}

/// A session through the recording proxy: the handshake, then writes and reads.
fn recorded_session(server: &TcpServer) -> Recording {
    let (proxy, recording) = recording_proxy(server.local_addr());
    {
        let mut ep = TcpEndpoint::connect(proxy, &creds()).unwrap();
        let a = RemoteAddr::new(R, 8);
        ep.write_u64(a, 0x5eed).unwrap();
        assert_eq!(ep.read_u64(a).unwrap(), 0x5eed);
        let mut batch = Batch::new();
        batch.write(RemoteAddr::new(R, 64), b"payload-in-the-clear");
        batch.read(RemoteAddr::new(R, 64), 20);
        let mut out = Completions::new();
        ep.execute(&batch, &mut out).unwrap();
    }
    // The relays finish once both sides have closed.
    thread::sleep(Duration::from_millis(200));
    let mut r = recording.lock().unwrap();
    Recording {
        to_server: std::mem::take(&mut r.to_server),
        to_client: std::mem::take(&mut r.to_client),
    }
}

/// The token's bytes are nowhere in a real session's bytes, either direction — while the
/// cluster's name and the session's data are (the capture does see the traffic).
#[test]
fn the_token_never_crosses_the_wire() {
    let server = server();
    let recording = recorded_session(&server);
    assert_eq!(recording.to_server.len(), 1);
    let (up, down) = (&recording.to_server[0], &recording.to_client[0]);
    assert!(
        contains(up, CLUSTER.as_bytes()),
        "the capture saw the hello"
    );
    assert!(contains(up, b"payload-in-the-clear"), "and the session");
    assert!(contains(down, b"payload-in-the-clear"));
    for (direction, bytes) in [("client to server", up), ("server to client", down)] {
        assert!(
            !contains(bytes, TOKEN.as_bytes()),
            "the token crossed the wire {direction}"
        );
        // Nor any 8-byte piece of it.
        for piece in TOKEN.as_bytes().windows(8) {
            assert!(
                !contains(bytes, piece),
                "part of the token went {direction}"
            );
        }
    }
    // Client to server: the hello, the proof, then the requests.
    let up = frames(up);
    let hello: Hello = postcard::from_bytes(&up[0]).unwrap();
    assert_eq!(
        (hello.protocol, hello.version, hello.cluster.as_str()),
        (Protocol::Verbs, PROTOCOL_VERSION, CLUSTER)
    );
    let _: Proof = postcard::from_bytes(&up[1]).unwrap();
}

/// The client's bytes of a captured handshake (and session), replayed to the server on a new
/// connection, are refused: the server's fresh nonce makes the old proof useless.
#[test]
fn a_replayed_handshake_is_refused() {
    let server = server();
    let recording = recorded_session(&server);
    let captured = &recording.to_server[0];
    // What the captured session wrote is undone, so that a replayed write would show.
    let a = RemoteAddr::new(R, 8);
    let mut ep = TcpEndpoint::connect(server.local_addr(), &creds()).unwrap();
    ep.write_u64(a, 0).unwrap();
    let mut replay = TcpStream::connect(server.local_addr()).unwrap();
    replay
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    replay.write_all(captured).unwrap();
    let mut answer = Vec::new();
    frame::read_frame(&mut replay, usize::MAX, &mut answer).unwrap();
    let challenge: ChallengeAnswer = postcard::from_bytes(&answer).unwrap();
    let old: ChallengeAnswer = postcard::from_bytes(&frames(&recording.to_client[0])[0]).unwrap();
    assert_ne!(
        challenge.unwrap().nonce,
        old.unwrap().nonce,
        "every challenge is fresh"
    );
    frame::read_frame(&mut replay, usize::MAX, &mut answer).unwrap();
    let answer: HelloAnswer = postcard::from_bytes(&answer).unwrap();
    match answer {
        Err(refusal @ Refusal::BadToken { .. }) => {
            assert!(
                refusal.to_string().contains("could not verify the client"),
                "{refusal}"
            );
        }
        other => panic!("a replayed handshake was answered {other:?}"),
    }
    // The server closed it: the rest of the replay (the session's requests) never ran.
    let mut rest = Vec::new();
    let _ = replay.read_to_end(&mut rest);
    assert!(rest.is_empty(), "the server answered a replayed request");
    assert_eq!(ep.read_u64(a).unwrap(), 0, "a replayed write ran");
}

/// A client with a wrong secret that sends its proof anyway (as a client that skipped the check
/// of the server would) is refused by the server, which says it could not verify the client and
/// echoes no secret.
#[test]
fn a_wrong_secret_is_refused_by_the_server() {
    let server = server();
    let wrong = Credentials::new(CLUSTER, "not-the-token");
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let hello = postcard::to_stdvec(&Hello::new(Protocol::Verbs, &wrong, 0, ())).unwrap();
    frame::write_frame(&mut s, &hello).unwrap();
    let mut answer = Vec::new();
    frame::read_frame(&mut s, usize::MAX, &mut answer).unwrap();
    let challenge: Challenge = postcard::from_bytes::<ChallengeAnswer>(&answer)
        .unwrap()
        .unwrap();
    // The careful client refuses this server …
    match handshake::answer_challenge(&wrong, &hello, &answer) {
        Err(e @ handshake::HandshakeError::ServerUnverified { .. }) => {
            assert!(e.to_string().contains("could not verify the server"), "{e}")
        }
        other => panic!("expected the server unverified, got {other:?}"),
    }
    // … a careless one sends its proof, and the server refuses it.
    let proof = postcard::to_stdvec(&Proof::new(&wrong, &hello, &challenge)).unwrap();
    frame::write_frame(&mut s, &proof).unwrap();
    frame::read_frame(&mut s, usize::MAX, &mut answer).unwrap();
    match postcard::from_bytes::<HelloAnswer>(&answer).unwrap() {
        Err(refusal @ Refusal::BadToken { .. }) => {
            let text = refusal.to_string();
            assert!(
                text.contains("authentication failed: the server could not verify the client"),
                "{text}"
            );
            assert!(!text.contains("not-the-token") && !text.contains(TOKEN));
        }
        other => panic!("expected BadToken, got {other:?}"),
    }
}

/// How a fake server makes its challenge from the hello's bytes.
type MakeChallenge = Box<dyn Fn(&[u8]) -> Challenge + Send>;

/// A fake server answering one connection's hello with `challenge`; joined, what it received
/// from the client after its challenge.
fn fake_server(challenge: MakeChallenge) -> (SocketAddr, thread::JoinHandle<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let handle = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut hello = Vec::new();
        frame::read_frame(&mut s, usize::MAX, &mut hello).unwrap();
        let answer: ChallengeAnswer = Ok(challenge(&hello));
        frame::write_frame(&mut s, &postcard::to_stdvec(&answer).unwrap()).unwrap();
        let mut after = Vec::new();
        let _ = s.read_to_end(&mut after);
        after
    });
    (addr, handle)
}

/// A server that does not know the secret — one that makes up its proof, one that holds
/// another secret, one that replays a real server's challenge — is found out by the client,
/// which says so and sends nothing more.
#[test]
fn a_fake_server_is_detected_by_the_client() {
    let real = server();
    let recording = recorded_session(&real);
    let captured: ChallengeAnswer =
        postcard::from_bytes(&frames(&recording.to_client[0])[0]).unwrap();
    let captured = captured.unwrap();
    let fakes: Vec<MakeChallenge> = vec![
        // A made-up proof.
        Box::new(|_| Challenge {
            nonce: handshake::fresh_nonce(),
            mac: [0x42; handshake::MAC_LEN],
        }),
        // A server holding another secret (for the right cluster).
        Box::new(|hello| {
            handshake::accept::<()>(
                hello,
                Protocol::Verbs,
                &Credentials::new(CLUSTER, "impostor"),
            )
            .unwrap()
            .challenge()
            .clone()
        }),
        // A real server's challenge, captured from another connection.
        Box::new(move |_| captured.clone()),
    ];
    for fake in fakes {
        let (addr, handle) = fake_server(fake);
        match TcpEndpoint::connect(addr, &creds()) {
            Err(FabricError::Unverified(why)) => {
                assert!(
                    why.contains("authentication failed: the client could not verify the server"),
                    "{why}"
                );
                assert!(!why.contains(TOKEN), "{why}");
            }
            Err(other) => panic!("expected the server unverified, got {other}"),
            Ok(_) => panic!("the client accepted a server that does not know the secret"),
        }
        let after = handle.join().unwrap();
        assert!(
            after.is_empty(),
            "the client sent {} bytes to an unverified server",
            after.len()
        );
    }
}
