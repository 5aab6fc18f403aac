//! The `tcp` backend: verbs round trip, concurrent connections, and every kind of bad input a
//! server can receive, each answered with its specific error while other clients keep being
//! served.

use fabric::batch::{MAX_BATCH_VERBS, MAX_IO_BYTES};
use fabric::frame::{self, HEADER_LEN};
use fabric::handshake::Protocol;
use fabric::tcp::wire::{
    self, Hello, HelloAnswer, Refusal, RemoteError, Reply, Request, MAGIC, MAX_HELLO_FRAME,
    MAX_REQUEST_FRAME, PROTOCOL_VERSION,
};
use fabric::{
    Batch, BatchError, Completions, Connector, Credentials, Endpoint, EndpointExt, FabricError,
    MaskedAtomics, Region, RegionId, RemoteAddr, TcpConnector, TcpEndpoint, TcpServer, Verb,
    VerbError,
};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

const CLUSTER: &str = "test-cluster";
const TOKEN: &str = "s3cret";
const R: RegionId = RegionId(1);
const REGION_LEN: u64 = 4096;

fn creds() -> Credentials {
    Credentials::new(CLUSTER, TOKEN)
}

fn addr(offset: u64) -> RemoteAddr {
    RemoteAddr::new(R, offset)
}

/// A server with one 4 KiB region, and a connector to it.
fn setup() -> (TcpServer, TcpConnector) {
    let server = TcpServer::bind("127.0.0.1:0", creds()).unwrap();
    server.register(R, REGION_LEN).unwrap();
    let connector = TcpConnector::connect(server.local_addr(), creds()).unwrap();
    (server, connector)
}

/// Checks that a well-behaved client is still served correctly: a fresh connection does a
/// CAS + FAA + write + read batch on a word of its own.
fn assert_healthy(server: &TcpServer) {
    let mut ep = TcpEndpoint::connect(server.local_addr(), &creds()).unwrap();
    let word = addr(REGION_LEN - 8);
    let before = ep.read_u64(word).unwrap();
    let mut batch = Batch::new();
    let cas = batch.cas(word, before, before + 10);
    let faa = batch.faa(word, 5);
    let read = batch.read(word, 8);
    let mut out = Completions::new();
    ep.execute(&batch, &mut out).unwrap();
    assert_eq!(out.old(cas), before);
    assert_eq!(out.old(faa), before + 10);
    assert_eq!(out.word(read, 0), before + 15);
}

/// A raw socket past the handshake, for sending hand-made frames.
fn raw_authenticated(server: &TcpServer) -> TcpStream {
    let mut stream = TcpStream::connect(server.local_addr()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let hello = send_hello(&mut stream, MAGIC, PROTOCOL_VERSION, CLUSTER);
    let mut challenge = Vec::new();
    frame::read_frame(&mut stream, usize::MAX, &mut challenge).unwrap();
    let proof = fabric::handshake::answer_challenge(&creds(), &hello, &challenge).unwrap();
    frame::write_frame(&mut stream, &proof).unwrap();
    match read_answer(&mut stream) {
        Ok(w) => assert_eq!(w.version, PROTOCOL_VERSION),
        Err(refusal) => panic!("expected Welcome, got {refusal:?}"),
    }
    stream
}

/// Sends a hello (no proof follows unless the caller sends one); returns its encoding.
fn send_hello(stream: &mut TcpStream, magic: u32, version: u16, cluster: &str) -> Vec<u8> {
    let mut hello = Hello::new(Protocol::Verbs, &Credentials::new(cluster, ""), 0, ());
    hello.magic = magic;
    hello.version = version;
    let body = postcard::to_stdvec(&hello).unwrap();
    frame::write_frame(stream, &body).unwrap();
    body
}

fn read_answer(stream: &mut TcpStream) -> HelloAnswer {
    let mut body = Vec::new();
    frame::read_frame(stream, usize::MAX, &mut body).unwrap();
    postcard::from_bytes(&body).unwrap()
}

fn read_reply(stream: &mut TcpStream) -> Reply {
    let mut body = Vec::new();
    frame::read_frame(stream, usize::MAX, &mut body).unwrap();
    postcard::from_bytes(&body).unwrap()
}

fn expect_error(stream: &mut TcpStream) -> RemoteError {
    match read_reply(stream) {
        Reply::Error(e) => e,
        other => panic!("expected an error reply, got {other:?}"),
    }
}

/// Asserts that the server closes `stream` (EOF, or a reset), within the test timeout.
fn assert_closed(stream: &mut TcpStream) {
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => {}
        Ok(_) => panic!("expected the server to close the connection, got more data"),
        Err(e) => assert!(
            !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "server did not close the connection: {e}"
        ),
    }
}

fn batch_body(batch: &Batch) -> Vec<u8> {
    postcard::to_stdvec(&Request::Batch(batch.clone())).unwrap()
}

#[test]
fn every_verb_round_trips() {
    let (server, connector) = setup();
    let mut ep = connector.connect().unwrap();
    let caps = ep.capabilities();
    assert_eq!(caps.backend, "tcp");
    assert_eq!(caps.masked_atomics, MaskedAtomics::CpuCasLoop);
    assert!(caps.server_cpu_on_data_path);

    ep.write(addr(3), b"hello, world").unwrap();
    assert_eq!(ep.read(addr(3), 12).unwrap(), b"hello, world");
    ep.write_u64(addr(64), 41).unwrap();
    assert_eq!(ep.cas(addr(64), 41, 42).unwrap(), 41);
    assert_eq!(
        ep.cas(addr(64), 41, 99).unwrap(),
        42,
        "failed CAS returns old"
    );
    assert_eq!(ep.read_u64(addr(64)).unwrap(), 42);
    assert_eq!(ep.faa(addr(64), u64::MAX).unwrap(), 42, "FAA wraps");
    assert_eq!(ep.read_u64(addr(64)).unwrap(), 41);
    // Masked CAS: compares only the low byte, stores only the high byte.
    ep.write_u64(addr(72), 0x00AA_0000_0000_0011).unwrap();
    let old = ep
        .masked_cas(
            addr(72),
            0x11,
            0xFF,
            0x7700_0000_0000_0000,
            0xFF00_0000_0000_0000,
        )
        .unwrap();
    assert_eq!(old, 0x00AA_0000_0000_0011);
    assert_eq!(ep.read_u64(addr(72)).unwrap(), 0x77AA_0000_0000_0011);
    // Two 32-bit fields: the low field's carry does not cross into the high field.
    ep.write_u64(addr(80), 0xFFFF_FFFF).unwrap();
    let boundary = (1 << 31) | (1 << 63);
    assert_eq!(ep.masked_faa(addr(80), 1, boundary).unwrap(), 0xFFFF_FFFF);
    assert_eq!(ep.read_u64(addr(80)).unwrap(), 0);

    // One batch of everything, executed in posting order.
    let mut batch = Batch::new();
    batch.write(addr(200), &[7u8; 20]);
    let r1 = batch.read(addr(198), 24);
    let a = batch.faa(addr(256), 3);
    let b = batch.faa(addr(256), 4);
    let r2 = batch.read(addr(256), 8);
    let mut out = Completions::new();
    ep.execute(&batch, &mut out).unwrap();
    let mut expect = [0u8; 24];
    expect[2..22].fill(7);
    assert_eq!(out.bytes(r1), &expect[..]);
    assert_eq!((out.old(a), out.old(b), out.word(r2, 0)), (0, 3, 7));

    // 1 MiB each way, in a region big enough for it.
    let big = RegionId(9);
    server.register(big, 2 << 20).unwrap();
    let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 31 + 7) as u8).collect();
    ep.write(RemoteAddr::new(big, 5), &data).unwrap();
    assert_eq!(ep.read(RemoteAddr::new(big, 5), data.len()).unwrap(), data);

    let stats = ep.stats();
    assert_eq!(stats.round_trips, 17);
    assert_eq!(stats.bytes_written, 12 + 8 * 3 + 20 + (1 << 20));
}

#[test]
fn concurrent_faa_sums_exactly() {
    let (server, connector) = setup();
    let connector = Arc::new(connector);
    const THREADS: u64 = 4;
    const ROUNDS: u64 = 500;
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let connector = connector.clone();
            std::thread::spawn(move || {
                let mut ep = connector.connect().unwrap();
                let mut batch = Batch::new();
                let mut out = Completions::new();
                for i in 0..ROUNDS {
                    // Alternate single FAAs and batches of three on the same word.
                    batch.clear();
                    batch.faa(addr(0), t + 1);
                    if i % 2 == 0 {
                        batch.faa(addr(0), t + 1);
                        batch.faa(addr(0), t + 1);
                    }
                    ep.execute(&batch, &mut out).unwrap();
                }
                ep.stats().atomics
            })
        })
        .collect();
    let atomics: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(atomics, THREADS * ROUNDS * 2);
    let per_thread_adds = ROUNDS * 2;
    let expected: u64 = (1..=THREADS).map(|w| w * per_thread_adds).sum();
    let mut ep = connector.connect().unwrap();
    assert_eq!(ep.read_u64(addr(0)).unwrap(), expected);
    drop(server);
}

#[test]
fn verb_errors_are_the_executors() {
    let (server, connector) = setup();
    let mut ep = connector.connect().unwrap();
    let mut out = Completions::new();

    // Every refusal names the first bad verb, and nothing of its batch executes: the write
    // posted before the bad verb must not have happened.
    let cases: Vec<(Verb, VerbError)> = vec![
        (
            Verb::Faa {
                addr: RemoteAddr::new(RegionId(77), 0),
                add: 1,
            },
            VerbError::UnknownRegion {
                index: 1,
                region: RegionId(77),
            },
        ),
        (
            Verb::Read {
                addr: addr(REGION_LEN - 4),
                len: 8,
            },
            VerbError::OutOfBounds {
                index: 1,
                addr: addr(REGION_LEN - 4),
                len: 8,
                region_len: REGION_LEN,
            },
        ),
        (
            Verb::Read {
                addr: addr(u64::MAX - 2),
                len: 8,
            },
            VerbError::OutOfBounds {
                index: 1,
                addr: addr(u64::MAX - 2),
                len: 8,
                region_len: REGION_LEN,
            },
        ),
        (
            Verb::Cas {
                addr: addr(12),
                expect: 0,
                swap: 1,
            },
            VerbError::Misaligned {
                index: 1,
                addr: addr(12),
            },
        ),
    ];
    for (bad, expected) in cases {
        let mut batch = Batch::new();
        batch.write_u64(addr(512), 0xDEAD);
        batch.push(bad, &[]);
        match ep.execute(&batch, &mut out) {
            Err(FabricError::Verb(e)) => assert_eq!(e, expected),
            other => panic!("expected {expected:?}, got {other:?}"),
        }
        assert_eq!(ep.read_u64(addr(512)).unwrap(), 0, "refused batch executed");
        assert_healthy(&server);
    }
    // The same endpoint keeps working after refusals.
    assert_eq!(ep.faa(addr(16), 1).unwrap(), 0);
    assert_eq!(ep.stats().round_trips, 5, "refused batches are not counted");
}

#[test]
fn client_refuses_batches_no_server_accepts() {
    let (server, connector) = setup();
    let mut ep = connector.connect().unwrap();
    let mut batch = Batch::new();
    for _ in 0..=MAX_BATCH_VERBS {
        batch.faa(addr(0), 1);
    }
    assert!(matches!(
        ep.execute(&batch, &mut Completions::new()),
        Err(FabricError::Batch(BatchError::TooManyVerbs { .. }))
    ));
    assert_eq!(ep.faa(addr(0), 1).unwrap(), 0, "endpoint still usable");
    assert_healthy(&server);
}

#[test]
fn bad_batch_shapes_get_batch_errors() {
    let (server, _connector) = setup();
    let mut stream = raw_authenticated(&server);

    // A write verb whose data is missing from the payload.
    let mut body = Vec::new();
    let mut short = Batch::new();
    short.write(addr(0), b"abcdefgh");
    wire::encode_batch(&mut body, &short);
    body.truncate(body.len() - 8);
    let len_at = body.len() - 1;
    body[len_at] = 0; // payload length 0, 0 bytes follow
    frame::write_frame(&mut stream, &body).unwrap();
    assert_eq!(
        expect_error(&mut stream),
        RemoteError::Batch(BatchError::PayloadMismatch {
            declared: 8,
            actual: 0
        })
    );

    // A read larger than any verb may move.
    let mut body = vec![0u8, 0, 1]; // Request::Batch, no expiry, one verb
    body.extend(
        postcard::to_stdvec(&Verb::Read {
            addr: addr(0),
            len: MAX_IO_BYTES as u32 + 1,
        })
        .unwrap(),
    );
    body.push(0);
    frame::write_frame(&mut stream, &body).unwrap();
    assert_eq!(
        expect_error(&mut stream),
        RemoteError::Batch(BatchError::VerbTooLarge {
            index: 0,
            len: MAX_IO_BYTES + 1,
            max: MAX_IO_BYTES
        })
    );

    // More verbs than a batch may carry (the count alone is enough to refuse it).
    let mut body = vec![0u8, 0]; // Request::Batch, no expiry
    body.extend(postcard::to_stdvec(&(MAX_BATCH_VERBS as u64 + 1)).unwrap());
    frame::write_frame(&mut stream, &body).unwrap();
    assert_eq!(
        expect_error(&mut stream),
        RemoteError::Batch(BatchError::TooManyVerbs {
            count: MAX_BATCH_VERBS + 1,
            max: MAX_BATCH_VERBS
        })
    );

    // The connection is still in sync and serves a good batch.
    let mut good = Batch::new();
    good.faa(addr(8), 2);
    frame::write_frame(&mut stream, &batch_body(&good)).unwrap();
    match read_reply(&mut stream) {
        Reply::Completions { completions: c, .. } => assert_eq!(c.olds(), &[0]),
        other => panic!("expected completions, got {other:?}"),
    }
    assert_healthy(&server);
}

#[test]
fn bad_checksum_is_reported_and_the_stream_stays_in_sync() {
    let (server, _connector) = setup();
    let mut stream = raw_authenticated(&server);
    let mut batch = Batch::new();
    batch.faa(addr(8), 1);
    let body = batch_body(&batch);
    let mut wire_bytes = Vec::new();
    frame::write_frame(&mut wire_bytes, &body).unwrap();
    wire_bytes[HEADER_LEN + 2] ^= 0x40; // corrupt the body, keep the header
    stream.write_all(&wire_bytes).unwrap();
    assert!(matches!(
        expect_error(&mut stream),
        RemoteError::BadChecksum { .. }
    ));
    // Nothing executed, and the next (intact) frame is served.
    frame::write_frame(&mut stream, &body).unwrap();
    match read_reply(&mut stream) {
        Reply::Completions { completions: c, .. } => {
            assert_eq!(c.olds(), &[0], "corrupt batch executed")
        }
        other => panic!("expected completions, got {other:?}"),
    }
    assert_healthy(&server);
}

#[test]
fn malformed_messages_are_reported() {
    let (server, _connector) = setup();
    let mut stream = raw_authenticated(&server);
    let garbage: [&[u8]; 5] = [
        b"",                          // no tag
        &[9],                         // unknown message tag
        &[0, 1, 42],                  // a verb with an unknown variant
        &[0, 0, 3, 1, 2],             // payload length 3, 2 bytes follow
        &[0, 0, 0, 0xAA, 0xBB, 0xCC], // trailing bytes after the payload
    ];
    for body in garbage {
        frame::write_frame(&mut stream, body).unwrap();
        match expect_error(&mut stream) {
            RemoteError::Malformed(why) => assert!(!why.is_empty()),
            other => panic!("{body:?}: expected Malformed, got {other:?}"),
        }
    }
    // A second Hello is a protocol error too, but not fatal.
    send_hello(&mut stream, MAGIC, PROTOCOL_VERSION, CLUSTER);
    assert!(matches!(
        expect_error(&mut stream),
        RemoteError::Malformed(_)
    ));
    let mut batch = Batch::new();
    batch.faa(addr(8), 1);
    frame::write_frame(&mut stream, &batch_body(&batch)).unwrap();
    assert!(matches!(read_reply(&mut stream), Reply::Completions { .. }));
    assert_healthy(&server);
}

#[test]
fn oversized_frame_gets_an_error_then_close() {
    let (server, _connector) = setup();
    let mut stream = raw_authenticated(&server);
    let len = (MAX_REQUEST_FRAME + 1) as u32;
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&len.to_le_bytes());
    stream.write_all(&header).unwrap();
    stream.write_all(&[0u8; 1000]).unwrap(); // the start of a body the server will not read
    assert_eq!(
        expect_error(&mut stream),
        RemoteError::FrameTooLarge {
            len: u64::from(len),
            max: MAX_REQUEST_FRAME as u64
        }
    );
    assert_closed(&mut stream);
    assert_healthy(&server);
}

#[test]
fn handshake_refusals() {
    let (server, _connector) = setup();
    let refused = |cluster: &str, token: &str| match TcpEndpoint::connect(
        server.local_addr(),
        &Credentials::new(cluster, token),
    ) {
        Err(FabricError::Refused(why)) => why,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let why = refused("other-cluster", TOKEN);
    assert!(why.contains("wrong cluster"), "{why}");
    // A wrong secret: the client cannot verify the server (whose proof is of another secret)
    // and refuses it, sending nothing more.
    for wrong in ["wrong", ""] {
        match TcpEndpoint::connect(server.local_addr(), &Credentials::new(CLUSTER, wrong)) {
            Err(FabricError::Unverified(why)) => {
                assert!(why.contains("could not verify the server"), "{why}");
                assert!(!why.contains(TOKEN), "the token must not be echoed: {why}");
            }
            other => panic!("expected the server unverified, got {other:?}"),
        }
    }

    // Raw peers: each gets its specific refusal, then the connection is closed.
    let raw = || {
        let s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    };
    let refusal = |s: &mut TcpStream| match read_answer(s) {
        Err(r) => r,
        Ok(welcome) => panic!("expected a refusal, got {welcome:?}"),
    };

    let mut s = raw();
    send_hello(&mut s, MAGIC, PROTOCOL_VERSION + 1, CLUSTER);
    assert_eq!(
        refusal(&mut s),
        Refusal::UnsupportedVersion {
            protocol: Protocol::Verbs,
            client: PROTOCOL_VERSION + 1,
            server: PROTOCOL_VERSION
        }
    );
    assert_closed(&mut s);

    let mut s = raw();
    send_hello(
        &mut s,
        u32::from_le_bytes(*b"HTTP"),
        PROTOCOL_VERSION,
        CLUSTER,
    );
    assert_eq!(refusal(&mut s), Refusal::BadMagic);
    assert_closed(&mut s);

    // A batch before the handshake: it does not start with the magic.
    let mut s = raw();
    let mut batch = Batch::new();
    batch.faa(addr(0), 1);
    frame::write_frame(&mut s, &batch_body(&batch)).unwrap();
    assert!(matches!(
        refusal(&mut s),
        Refusal::BadMagic | Refusal::BadHello(_)
    ));
    assert_closed(&mut s);

    // Undecodable first frames, and a first frame with a bad checksum.
    let mut s = raw();
    frame::write_frame(&mut s, &[0xFF]).unwrap();
    assert!(matches!(refusal(&mut s), Refusal::BadHello(_)));
    assert_closed(&mut s);
    let mut s = raw();
    frame::write_frame(&mut s, &postcard::to_stdvec(&(MAGIC, 9u8)).unwrap()).unwrap();
    assert!(matches!(refusal(&mut s), Refusal::BadHello(_)));
    assert_closed(&mut s);
    let mut s = raw();
    let mut bytes = Vec::new();
    frame::write_frame(
        &mut bytes,
        &postcard::to_stdvec(&Hello::new(Protocol::Verbs, &creds(), 0, ())).unwrap(),
    )
    .unwrap();
    bytes[5] ^= 1;
    s.write_all(&bytes).unwrap();
    assert!(matches!(refusal(&mut s), Refusal::BadHello(_)));
    assert_closed(&mut s);

    // Another protocol entirely: "GET " read as a frame length is far over the handshake limit.
    let mut s = raw();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    match refusal(&mut s) {
        Refusal::BadHello(why) => assert!(why.contains(&MAX_HELLO_FRAME.to_string()), "{why}"),
        other => panic!("expected BadHello, got {other:?}"),
    }
    assert_closed(&mut s);

    assert_healthy(&server);
}

#[test]
fn regions_can_be_added_and_removed() {
    let (server, connector) = setup();
    assert!(matches!(server.register(R, 8), Err(FabricError::Config(_))));
    let shared = Arc::new(Region::anonymous(RegionId(4), 64));
    server.add_region(shared.clone()).unwrap();
    let mut ep = connector.connect().unwrap();
    let a = RemoteAddr::new(RegionId(4), 8);
    ep.write_u64(a, 5).unwrap();
    assert_eq!(fabric::region::load_word(&shared, a), Some(5));
    let mut listed: Vec<_> = TcpEndpoint::connect(server.local_addr(), &creds())
        .unwrap()
        .regions()
        .iter()
        .map(|r| (r.id, r.len))
        .collect();
    listed.sort();
    assert_eq!(listed, vec![(R, REGION_LEN), (RegionId(4), 64)]);

    assert!(server.deregister(RegionId(4)).is_some());
    match ep.read_u64(a) {
        Err(FabricError::Verb(VerbError::UnknownRegion { index: 0, region })) => {
            assert_eq!(region, RegionId(4))
        }
        other => panic!("expected UnknownRegion, got {other:?}"),
    }
}

#[test]
fn dead_server_gives_disconnected_promptly() {
    let (server, connector) = setup();
    let mut ep = connector.connect().unwrap();
    ep.faa(addr(0), 1).unwrap();
    // An unauthenticated idle peer and an authenticated idle one must not delay shutdown.
    let _idle = TcpStream::connect(server.local_addr()).unwrap();
    let _idle_auth = raw_authenticated(&server);
    let start = Instant::now();
    server.shutdown();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "shutdown took {:?}",
        start.elapsed()
    );
    assert_eq!(server.connection_count(), 0);
    for _ in 0..2 {
        match ep.faa(addr(0), 1) {
            Err(FabricError::Disconnected(_)) => {}
            other => panic!("expected Disconnected, got {other:?}"),
        }
    }
    let addr = server.local_addr();
    drop(server);
    assert!(TcpConnector::connect(addr, creds()).is_err());
}

#[test]
fn connections_are_released() {
    let (server, connector) = setup();
    drop(connector);
    for _ in 0..5 {
        let mut ep = TcpEndpoint::connect(server.local_addr(), &creds()).unwrap();
        ep.faa(addr(0), 1).unwrap();
    }
    // Every connection thread ends once its client has gone.
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.connection_count() > 0 {
        assert!(Instant::now() < deadline, "connection threads leaked");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The server's side of a handshake, by hand: the hello, the challenge, the proof, an empty
/// welcome.
fn fake_handshake(s: &mut TcpStream) {
    let mut body = Vec::new();
    frame::read_frame(s, usize::MAX, &mut body).unwrap();
    let challenged = fabric::handshake::accept::<()>(&body, Protocol::Verbs, &creds()).unwrap();
    let challenge: fabric::handshake::ChallengeAnswer = Ok(challenged.challenge().clone());
    frame::write_frame(s, &postcard::to_stdvec(&challenge).unwrap()).unwrap();
    frame::read_frame(s, usize::MAX, &mut body).unwrap();
    challenged.verify(&body, &creds()).unwrap();
    let welcome: HelloAnswer = Ok(wire::Welcome {
        version: PROTOCOL_VERSION,
        regions: vec![],
        clock: 0,
    });
    frame::write_frame(s, &postcard::to_stdvec(&welcome).unwrap()).unwrap();
}

/// A fake server that completes the handshake, reads one batch and then answers it with
/// `reply` (raw bytes, possibly nothing) before closing.
fn fake_server(reply: Vec<u8>) -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut body = Vec::new();
        fake_handshake(&mut s);
        frame::read_frame(&mut s, usize::MAX, &mut body).unwrap();
        s.write_all(&reply).unwrap();
    });
    addr
}

#[test]
fn broken_servers_give_disconnected() {
    let mut batch = Batch::new();
    batch.faa(addr(0), 1);
    let framed = |body: &[u8]| {
        let mut bytes = Vec::new();
        frame::write_frame(&mut bytes, body).unwrap();
        bytes
    };
    let wrong_count = postcard::to_stdvec(&Reply::Completions {
        clock: 0,
        completions: Completions::new(),
    })
    .unwrap();
    let welcome_again = postcard::to_stdvec::<HelloAnswer>(&Ok(wire::Welcome {
        version: PROTOCOL_VERSION,
        regions: vec![],
        clock: 0,
    }))
    .unwrap();
    let mut corrupt = framed(&wrong_count);
    corrupt[HEADER_LEN] ^= 1;
    let replies = [
        Vec::new(),             // closes without answering
        b"\x01\x00".to_vec(),   // half a frame header, then closes
        corrupt,                // checksum mismatch
        framed(&wrong_count),   // completions that do not answer the batch
        framed(&welcome_again), // a handshake message instead of completions
        framed(&[0xFF, 0xFF]),  // undecodable
    ];
    for reply in replies {
        let server = fake_server(reply.clone());
        let mut ep = TcpEndpoint::connect(server, &creds()).unwrap();
        let mut out = Completions::new();
        match ep.execute(&batch, &mut out) {
            Err(FabricError::Disconnected(_)) => {}
            other => panic!("reply {reply:?}: expected Disconnected, got {other:?}"),
        }
        assert!(ep.is_broken());
        assert!(matches!(
            ep.execute(&batch, &mut out),
            Err(FabricError::Disconnected(_))
        ));
    }
}

/// Fencing: once a session is revoked, its open connections execute nothing more (the next
/// batch is refused and the connection closed, the word untouched), a new connection naming it
/// is refused, and other sessions (and session-less peers) go on as before.
#[test]
fn revoked_session_is_fenced() {
    let (server, _connector) = setup();
    let fenced = TcpConnector::connect_session(server.local_addr(), creds(), 7).unwrap();
    let mut a = fenced.endpoint().unwrap();
    let mut b = fenced.endpoint().unwrap();
    let mut other = TcpEndpoint::connect_session(server.local_addr(), &creds(), 8).unwrap();
    let word = addr(64);
    a.write_u64(word, 1).unwrap();

    server.revoke(&[7]);
    for ep in [&mut a, &mut b] {
        let mut batch = Batch::new();
        batch.write(word, &2u64.to_le_bytes());
        let err = ep.execute(&batch, &mut Completions::new()).unwrap_err();
        assert!(
            matches!(&err, FabricError::Refused(why) if why.contains("session 7 was revoked")),
            "{err:?}"
        );
        assert!(ep.is_broken(), "a fenced connection is not reused");
    }
    assert_eq!(
        other.read_u64(word).unwrap(),
        1,
        "the fenced write must not land"
    );
    match TcpEndpoint::connect_session(server.local_addr(), &creds(), 7) {
        Err(FabricError::Refused(why)) => assert!(why.contains("revoked"), "{why}"),
        other => panic!("a revoked session must be refused, got {other:?}"),
    }
    assert!(fenced.endpoint().is_err());
    other.write_u64(word, 3).unwrap();
    assert_eq!(other.read_u64(word).unwrap(), 3);
    assert_healthy(&server);
}

/// A server that numbers its sessions from its start (the meta server) refuses every session
/// of an earlier run: below the floor, open connections execute nothing more and new ones are
/// refused — told that they are behind, not revoked, so that their client catches up instead
/// of taking itself for fenced; sessions at or above it, and session-less peers, go on.
#[test]
fn sessions_below_the_floor_are_fenced() {
    let (server, _connector) = setup();
    let mut old = TcpEndpoint::connect_session(server.local_addr(), &creds(), 99).unwrap();
    let mut current = TcpEndpoint::connect_session(server.local_addr(), &creds(), 100).unwrap();
    let mut none = TcpEndpoint::connect_session(server.local_addr(), &creds(), 0).unwrap();
    let word = addr(64);
    old.write_u64(word, 1).unwrap();

    server.refuse_sessions_before(100);
    let mut batch = Batch::new();
    batch.write(word, &2u64.to_le_bytes());
    let err = old.execute(&batch, &mut Completions::new()).unwrap_err();
    assert!(
        matches!(&err, FabricError::SessionBehind(why)
            if why.contains("session 99 is of an earlier run") && why.contains("start at 100")),
        "{err:?}"
    );
    assert_eq!(
        current.read_u64(word).unwrap(),
        1,
        "the refused write landed"
    );
    match TcpEndpoint::connect_session(server.local_addr(), &creds(), 42) {
        Err(FabricError::SessionBehind(why)) => {
            assert!(
                why.contains("earlier run") && why.contains("start at 100"),
                "{why}"
            )
        }
        other => panic!("a session below the floor must be refused as behind, got {other:?}"),
    }
    // A revoked session at or above the floor is still refused as revoked.
    server.revoke(&[100]);
    match TcpEndpoint::connect_session(server.local_addr(), &creds(), 100) {
        Err(FabricError::Refused(why)) => assert!(why.contains("revoked"), "{why}"),
        other => panic!("a revoked session must be refused, got {other:?}"),
    }
    let mut current = TcpEndpoint::connect_session(server.local_addr(), &creds(), 102).unwrap();
    current.write_u64(word, 3).unwrap();
    none.write_u64(word, 4).unwrap();
    let mut later = TcpEndpoint::connect_session(server.local_addr(), &creds(), 101).unwrap();
    assert_eq!(later.read_u64(word).unwrap(), 4);
    assert_healthy(&server);
}

/// A server that accepts session floors lets a sessionless peer (the meta server) raise its
/// floor with one call, which fences an established connection of an older session at once;
/// a client session may not call it, a malformed floor is refused, and a server that does not
/// offer it says so as `Ok(false)`, not as an error.
#[test]
fn a_sessionless_peer_raises_the_session_floor() {
    use fabric::procedure::raise_session_floor;
    let (server, _connector) = setup();
    let mut old = TcpEndpoint::connect_session(server.local_addr(), &creds(), 99).unwrap();
    let mut meta = TcpEndpoint::connect_session(server.local_addr(), &creds(), 0).unwrap();
    let word = addr(64);
    old.write_u64(word, 1).unwrap();
    assert!(
        !raise_session_floor(&mut meta, 100).unwrap(),
        "not offered yet"
    );
    old.write_u64(word, 2).unwrap();

    server.accept_session_floors().unwrap();
    let mut client = TcpEndpoint::connect_session(server.local_addr(), &creds(), 150).unwrap();
    let err = raise_session_floor(&mut client, 200).unwrap_err();
    assert!(
        matches!(&err, FabricError::Procedure(why) if why.contains("only a sessionless peer (the meta server) may")),
        "{err:?}"
    );
    let mut meta = TcpEndpoint::connect_session(server.local_addr(), &creds(), 0).unwrap();
    let mut result = Vec::new();
    let err = meta
        .call(fabric::procedure::SESSION_FLOOR, &[1, 2, 3], &mut result)
        .unwrap_err();
    assert!(
        matches!(&err, FabricError::Procedure(why) if why.contains("8 bytes, not 3")),
        "{err:?}"
    );
    assert!(raise_session_floor(&mut meta, 100).unwrap());
    let err = old.write_u64(word, 3).unwrap_err();
    assert!(matches!(err, FabricError::SessionBehind(_)), "{err:?}");
    assert!(matches!(
        TcpEndpoint::connect_session(server.local_addr(), &creds(), 99),
        Err(FabricError::SessionBehind(_))
    ));
    assert_eq!(meta.read_u64(word).unwrap(), 2, "the fenced write landed");
    client.write_u64(word, 4).unwrap();
    assert_eq!(meta.read_u64(word).unwrap(), 4);
    assert_healthy(&server);
}

/// What a test proxy does with the bytes it reads while its flag is set.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WhileSet {
    /// Drops them, both ways, as a network link that went down (both sockets stay open;
    /// nothing is ever answered or closed).
    Cut,
    /// Holds the client's bytes and forwards them once the flag is cleared, as a congested
    /// link or a server whose thread was descheduled would: requests arrive late, replies are
    /// untouched.
    HoldRequests,
}

/// A one-connection tcp proxy in front of `upstream`, and the flag that makes it do `mode`.
fn proxy(
    upstream: std::net::SocketAddr,
    mode: WhileSet,
) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicBool>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let flag = Arc::new(AtomicBool::new(false));
    let set = flag.clone();
    std::thread::spawn(move || {
        let Ok((client, _)) = listener.accept() else {
            return;
        };
        let Ok(server) = TcpStream::connect(upstream) else {
            return;
        };
        // One direction; `hold`: keep what arrives while the flag is set, instead of dropping.
        let pump = |mut from: TcpStream, mut to: TcpStream, hold: bool, set: Arc<AtomicBool>| {
            std::thread::spawn(move || {
                from.set_read_timeout(Some(Duration::from_millis(5)))
                    .unwrap();
                let (mut held, mut buf) = (Vec::new(), vec![0u8; 64 << 10]);
                loop {
                    match from.read(&mut buf) {
                        Ok(0) => return,
                        Ok(_) if set.load(Ordering::SeqCst) && !hold => {} // lost
                        Ok(n) => held.extend_from_slice(&buf[..n]),
                        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock) => {}
                        Err(e) if matches!(e.kind(), std::io::ErrorKind::TimedOut) => {}
                        Err(_) => return,
                    }
                    if !set.load(Ordering::SeqCst) && !held.is_empty() {
                        if to.write_all(&held).is_err() {
                            return;
                        }
                        held.clear();
                    }
                }
            })
        };
        let hold = mode == WhileSet::HoldRequests;
        let a = pump(
            client.try_clone().unwrap(),
            server.try_clone().unwrap(),
            hold,
            set.clone(),
        );
        let b = pump(
            server,
            client,
            false,
            if hold { Arc::default() } else { set },
        );
        let _ = (a.join(), b.join());
    });
    (addr, flag)
}

/// A batch on a link that went silent fails with `TimedOut` within the endpoint's batch bound
/// instead of blocking until TCP gives up (minutes), and the endpoint is then dead.
#[test]
fn a_silent_link_fails_a_batch_within_its_bound() {
    use std::sync::atomic::Ordering;
    let server = TcpServer::bind("127.0.0.1:0", creds()).unwrap();
    server.register(R, REGION_LEN).unwrap();
    let (proxy, cut) = proxy(server.local_addr(), WhileSet::Cut);
    let bound = Duration::from_millis(300);
    let timeouts = fabric::TcpTimeouts {
        connect: Duration::from_secs(5),
        batch: bound,
        call: bound,
    };
    let mut ep = TcpEndpoint::connect_with(proxy, &creds(), 0, timeouts).unwrap();
    assert_eq!(ep.timeouts(), timeouts);
    ep.faa(addr(0), 1).unwrap();
    cut.store(true, Ordering::SeqCst);
    // Run the batch on a thread so that a regression (a read without a bound) fails this test
    // instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        let result = ep.faa(addr(0), 1);
        let again = ep.faa(addr(0), 1);
        let _ = tx.send((start.elapsed(), result, again));
    });
    let (took, result, again) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("a batch on a cut link must fail within its bound, not hang");
    match result {
        Err(FabricError::TimedOut(why)) => {
            assert!(why.contains("no reply"), "{why}");
        }
        other => panic!("expected TimedOut, got {other:?}"),
    }
    assert!(
        took >= bound && took < bound + Duration::from_secs(2),
        "failed after {took:?}, bound {bound:?}"
    );
    assert!(
        matches!(again, Err(FabricError::Disconnected(_))),
        "{again:?}"
    );
}

/// A batch that expires is waited for until its expiry (plus `REPLY_AFTER_EXPIRY`), not for
/// the whole batch bound: no verb of it starts at the server after the expiry, so a lock
/// holder whose data server went silent gets control back while its lease still runs and
/// releases its lock in time. Before, it waited out the batch bound (5 s by default, longer
/// than the 2 s lease), released late, and left its range to lazy recovery.
#[test]
fn a_silent_link_fails_an_expiring_batch_at_its_expiry() {
    use std::sync::atomic::Ordering;
    let server = TcpServer::bind("127.0.0.1:0", creds()).unwrap();
    server.register(R, REGION_LEN).unwrap();
    let (proxy, cut) = proxy(server.local_addr(), WhileSet::Cut);
    let mut ep = TcpEndpoint::connect(proxy, &creds()).unwrap();
    let bound = ep.timeouts().batch;
    ep.faa(addr(0), 1).unwrap();
    cut.store(true, Ordering::SeqCst);
    let expiry = Duration::from_millis(300);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut batch = Batch::new();
        batch.write(addr(64), b"expiring");
        let start = Instant::now();
        batch.expire_at(Some(start + expiry));
        let result = ep.execute(&batch, &mut Completions::new());
        let _ = tx.send((start.elapsed(), result));
    });
    let (took, result) = rx
        .recv_timeout(bound + Duration::from_secs(5))
        .expect("a batch on a cut link must fail, not hang");
    match result {
        Err(FabricError::TimedOut(why)) => assert!(why.contains("expiry"), "{why}"),
        other => panic!("expected TimedOut, got {other:?}"),
    }
    assert!(
        took >= expiry && took < expiry + Duration::from_millis(700),
        "failed after {took:?}; expiry {expiry:?}, batch bound {bound:?}"
    );
}

/// A connector asked for an endpoint by a deadline gives up at that deadline when the server
/// does not answer, not at its connect bound (5 s): a lock holder connecting to a data server
/// that went silent gets its call back while its lease still runs. Without a deadline the
/// connect bound applies as before.
#[test]
fn a_connect_by_a_deadline_to_a_silent_server_ends_at_the_deadline() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let server = TcpServer::bind("127.0.0.1:0", creds()).unwrap();
    server.register(R, REGION_LEN).unwrap();
    let upstream = server.local_addr();
    // A proxy that forwards each connection until `silent` is set, and then accepts new ones
    // and never answers them (a host whose process stopped answering its handshake).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let silent = Arc::new(AtomicBool::new(false));
    let quiet = silent.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            if quiet.load(Ordering::SeqCst) {
                held.push(client);
                continue;
            }
            let Ok(server) = TcpStream::connect(upstream) else {
                return;
            };
            for (mut from, mut to) in [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                });
            }
        }
    });
    let connector = TcpConnector::connect(addr, creds()).unwrap();
    let mut first = connector.endpoint().unwrap();
    first.faa(self::addr(0), 1).unwrap();
    silent.store(true, Ordering::SeqCst);
    let (tx, rx) = std::sync::mpsc::channel();
    let by = Duration::from_millis(300);
    std::thread::spawn(move || {
        let start = Instant::now();
        let result = connector.connect_by(Some(start + by)).map(drop);
        let _ = tx.send((start.elapsed(), result));
    });
    let (took, result) = rx
        .recv_timeout(Duration::from_secs(15))
        .expect("a connect to a silent server must end, not hang");
    assert!(
        matches!(result, Err(FabricError::TimedOut(_))),
        "a connect to a server that never answers: {result:?}"
    );
    assert!(
        took >= by && took < by + Duration::from_millis(700),
        "gave up after {took:?}, deadline {by:?}: {result:?}"
    );
}

/// A batch that reaches the server after its expiry does not execute, however much time it
/// had left when it was sent: the expiry travels as an instant in the server's clock
/// (`fabric::clock`). Before, it travelled as the time left on sending, counted again from the
/// arrival, so a request held up on its way (here by a proxy, for 400 ms past its 150 ms
/// deadline) executed as if it had just been sent — the write of a lock holder whose lease
/// had run out, landing after a waiter broke its lock.
#[test]
fn a_batch_delayed_past_its_expiry_on_the_way_does_not_execute() {
    use std::sync::atomic::Ordering;
    let server = TcpServer::bind("127.0.0.1:0", creds()).unwrap();
    server.register(R, REGION_LEN).unwrap();
    let (proxy, hold) = proxy(server.local_addr(), WhileSet::HoldRequests);
    let mut ep = TcpEndpoint::connect(proxy, &creds()).unwrap();
    ep.faa(addr(0), 1).unwrap();

    hold.store(true, Ordering::SeqCst);
    let mut batch = Batch::new();
    batch.write(addr(64), b"too late");
    batch.faa(addr(80), 1);
    let deadline = Instant::now() + Duration::from_millis(150);
    batch.expire_at(Some(deadline));
    let mut out = Completions::new();
    ep.post(&batch, &mut out).unwrap();
    // The proxy lets the request through after the client stopped waiting for it (its expiry
    // and `REPLY_AFTER_EXPIRY`), which closes the connection abortively; whether the request
    // reaches the server before that close does, the server runs no verb of it.
    std::thread::sleep(Duration::from_millis(400));
    hold.store(false, Ordering::SeqCst);
    match ep.complete(&batch, &mut out) {
        Err(FabricError::Verb(VerbError::Expired { index: 0 })) | Err(FabricError::TimedOut(_)) => {
        }
        other => panic!("a batch that arrived 250 ms after its expiry ran: {other:?}"),
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut direct = TcpEndpoint::connect(server.local_addr(), &creds()).unwrap();
    assert_eq!(
        direct.read(addr(64), 8).unwrap(),
        vec![0; 8],
        "no byte landed"
    );
    assert_eq!(direct.read_u64(addr(80)).unwrap(), 0, "no atomic ran");

    // The same batch with time to spare runs through the same kind of proxy (a new one: the
    // client gave the first connection up).
    let (fresh, _) = self::proxy(server.local_addr(), WhileSet::HoldRequests);
    let mut ep = TcpEndpoint::connect(fresh, &creds()).unwrap();
    batch.expire_at(Some(Instant::now() + Duration::from_secs(30)));
    ep.execute(&batch, &mut out).unwrap();
    assert_eq!(direct.read(addr(64), 8).unwrap(), b"too late");
}

/// An endpoint idle for longer than `fabric::clock::RESYNC_AFTER` refreshes what it knows of
/// the server's clock (one empty batch) before it sends an expiry, so that the drift allowed
/// for since its last answer never eats a deadline; a batch without an expiry does not.
#[test]
fn an_idle_endpoint_refreshes_the_servers_clock_before_sending_an_expiry() {
    let (server, connector) = setup();
    let mut ep = connector.connect().unwrap();
    ep.faa(addr(0), 1).unwrap();
    std::thread::sleep(fabric::clock::RESYNC_AFTER + Duration::from_millis(100));
    let before = ep.stats().round_trips;
    ep.faa(addr(0), 1).unwrap();
    assert_eq!(ep.stats().round_trips, before + 1, "no expiry: no refresh");
    std::thread::sleep(fabric::clock::RESYNC_AFTER + Duration::from_millis(100));
    let before = ep.stats().round_trips;
    let mut batch = Batch::new();
    batch.faa(addr(0), 1);
    batch.expire_at(Some(Instant::now() + Duration::from_millis(500)));
    let mut out = Completions::new();
    ep.execute(&batch, &mut out).unwrap();
    assert_eq!(
        ep.stats().round_trips,
        before + 2,
        "the refresh, then the batch"
    );
    // Fresh now: the next expiring batch goes alone.
    batch.expire_at(Some(Instant::now() + Duration::from_millis(500)));
    ep.execute(&batch, &mut out).unwrap();
    assert_eq!(ep.stats().round_trips, before + 3);
    assert_eq!(ep.read_u64(addr(0)).unwrap(), 4);
    drop(server);
}

/// A zero bound means the default, not "no time at all" (which sockets refuse).
#[test]
fn zero_time_bounds_mean_the_defaults() {
    let (server, _connector) = setup();
    let ep = TcpEndpoint::connect_with(
        server.local_addr(),
        &creds(),
        0,
        fabric::TcpTimeouts {
            connect: Duration::ZERO,
            batch: Duration::ZERO,
            call: Duration::ZERO,
        },
    )
    .unwrap();
    assert_eq!(ep.timeouts(), fabric::TcpTimeouts::DEFAULT);
}

/// A server that trickles its reply a byte at a time, each byte within the socket timeout,
/// still fails the batch at its bound: the bound is on the whole batch.
#[test]
fn a_trickling_reply_is_held_to_the_batch_bound() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut body = Vec::new();
        fake_handshake(&mut s);
        frame::read_frame(&mut s, usize::MAX, &mut body).unwrap();
        // A header announcing a large reply, then one byte every 50 ms, forever.
        let _ = s.write_all(&(1u32 << 20).to_le_bytes());
        while s.write_all(&[0]).is_ok() {
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let bound = Duration::from_millis(400);
    let mut ep = TcpEndpoint::connect_with(
        at,
        &creds(),
        0,
        fabric::TcpTimeouts {
            connect: Duration::from_secs(5),
            batch: bound,
            call: bound,
        },
    )
    .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        let result = ep.faa(addr(0), 1);
        let _ = tx.send((start.elapsed(), result));
    });
    let (took, result) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("a trickled reply must fail at the batch's bound, not hang");
    assert!(
        matches!(result, Err(FabricError::TimedOut(_))),
        "{result:?}"
    );
    assert!(took < bound + Duration::from_secs(2), "took {took:?}");
}

/// A server that stops taking bytes (a cut link, a frozen host) fails a large batch within its
/// bound even though the socket accepted part of the request: the bound is on the whole
/// batch, not on each `write`.
#[test]
fn a_peer_that_stops_reading_fails_a_large_batch_within_its_bound() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = listener.local_addr().unwrap();
    let (release, released) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        fake_handshake(&mut s);
        // Read nothing more, keeping the connection open until the test ends.
        let _ = released.recv();
    });
    let bound = Duration::from_millis(400);
    let mut ep = TcpEndpoint::connect_with(
        at,
        &creds(),
        0,
        fabric::TcpTimeouts {
            connect: Duration::from_secs(5),
            batch: bound,
            call: bound,
        },
    )
    .unwrap();
    // 16 MiB: more than the socket buffers of both ends hold.
    let mut batch = Batch::new();
    batch.write(addr(0), &vec![7u8; MAX_IO_BYTES]);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        let mut out = Completions::new();
        let result = ep.execute(&batch, &mut out);
        let _ = tx.send((start.elapsed(), result));
    });
    let (took, result) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("a batch to a peer that stopped reading must fail, not hang");
    drop(release);
    assert!(
        matches!(result, Err(FabricError::TimedOut(_))),
        "{result:?}"
    );
    // At most an eighth over the bound (see the client's `Deadline`), plus scheduling slack.
    assert!(
        took >= bound && took < bound.mul_f64(1.125) + Duration::from_millis(250),
        "took {took:?} for a bound of {bound:?}"
    );
}

/// Polls `done` until it holds, failing after 10 s.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The server's connection limits: a connection beyond a pending limit evicts the oldest
/// connection that has not sent its hello — which is answered `Refusal::Limit`, naming the
/// setting, and closed — rather than be refused, so silent peers cannot keep out a peer that
/// presents its credentials; beyond the per-peer limit a peer is refused (`Refusal::Limit`,
/// before a byte is read or a thread spent), which the endpoint tries again for its connect
/// bound and then reports as `FabricError::Limited`; places free when their connections close.
/// Peers that send a hello but never a proof (they cannot prove the secret) hold their pending
/// places no more firmly than silent ones: a client that completes its handshake evicts the
/// older, which is told why after its challenge and closed.
#[test]
fn peers_without_a_proof_make_room() {
    use fabric::handshake::{ChallengeAnswer, ConnectionLimits, Limit};
    let limits = ConnectionLimits {
        max_per_peer: 10,
        max_pending: 2,
        max_pending_per_peer: 10,
    };
    let server = TcpServer::bind_with_limits("127.0.0.1:0", creds(), limits).unwrap();
    server.register(R, REGION_LEN).unwrap();
    let mut stuck: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(server.local_addr()).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            send_hello(&mut s, MAGIC, PROTOCOL_VERSION, CLUSTER);
            let mut body = Vec::new();
            frame::read_frame(&mut s, usize::MAX, &mut body).unwrap();
            let challenge: ChallengeAnswer = postcard::from_bytes(&body).unwrap();
            assert!(challenge.is_ok());
            s
        })
        .collect();
    let mut ep = TcpEndpoint::connect(server.local_addr(), &creds()).unwrap();
    ep.faa(addr(0), 1).unwrap();
    assert_eq!(
        read_answer(&mut stuck[0]).unwrap_err(),
        Refusal::Limit {
            limit: Limit::PendingHandshakes,
            value: 2
        }
    );
    assert_closed(&mut stuck[0]);
    // The younger still waits for its proof.
    stuck[1]
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut byte = [0u8; 1];
    assert!(matches!(
        stuck[1].read(&mut byte),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
    ));
}

#[test]
fn connections_are_limited_per_peer_and_silent_ones_make_room() {
    use fabric::handshake::{ConnectionLimits, Limit};
    use fabric::tcp::TcpTimeouts;
    let limits = ConnectionLimits {
        max_per_peer: 3,
        max_pending: 2,
        max_pending_per_peer: 3,
    };
    let server = TcpServer::bind_with_limits("127.0.0.1:0", creds(), limits).unwrap();
    server.register(R, REGION_LEN).unwrap();
    assert_eq!(server.limits(), limits);

    // Two silent peers, one of them declaring a huge frame, hold both pending places: a peer
    // that presents its hello evicts the older, which is told why and closed.
    let mut silent: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(server.local_addr()).unwrap())
        .collect();
    (&silent[1])
        .write_all(&u32::MAX.to_le_bytes()[..3])
        .unwrap();
    wait_for("the silent peers to be accepted", || {
        server.connection_count() == 2
    });
    let mut first = TcpEndpoint::connect(server.local_addr(), &creds()).unwrap();
    first.faa(addr(0), 1).unwrap();
    silent[0]
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(
        read_answer(&mut silent[0]).unwrap_err(),
        Refusal::Limit {
            limit: Limit::PendingHandshakes,
            value: 2
        }
    );
    assert_closed(&mut silent[0]);
    // The younger silent peer still holds its place.
    silent[1]
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut byte = [0u8; 1];
    assert!(matches!(
        silent[1].read(&mut byte),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
    ));
    drop(silent);

    let mut endpoints = vec![first];
    wait_for("three endpoints", || {
        if let Ok(ep) = TcpEndpoint::connect(server.local_addr(), &creds()) {
            endpoints.push(ep);
        }
        endpoints.len() == 3
    });
    let bound = Duration::from_millis(300);
    let timeouts = TcpTimeouts {
        connect: bound,
        ..TcpTimeouts::DEFAULT
    };
    let started = Instant::now();
    match TcpEndpoint::connect_with(server.local_addr(), &creds(), 0, timeouts) {
        Err(FabricError::Limited(why)) => assert!(
            why.ends_with(
                &Refusal::Limit {
                    limit: Limit::ConnectionsPerPeer,
                    value: 3
                }
                .to_string()
            ),
            "{why}"
        ),
        other => panic!("expected a refusal for the per-peer limit, got {other:?}"),
    }
    assert!(
        started.elapsed() >= bound,
        "tried again until the connect bound: {:?}",
        started.elapsed()
    );
    // The endpoints in place are served all the while.
    for ep in &mut endpoints[1..] {
        ep.faa(addr(0), 1).unwrap();
    }
    endpoints.pop();
    // A connection refused for a limit is tried again: one place freeing is enough.
    endpoints.push(TcpEndpoint::connect(server.local_addr(), &creds()).unwrap());
    assert_eq!(endpoints[0].read_u64(addr(0)).unwrap(), 3);
}
