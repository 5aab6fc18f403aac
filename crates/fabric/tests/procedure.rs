//! Procedures on the `tcp` backend (`fabric::procedure`): a call runs next to the server's
//! memory in one round trip, on the same words one-sided clients use; refusals and failures
//! leave the endpoint usable; fencing stops a procedure's batches without waiting for it.

use fabric::{
    Backend, Connector, Credentials, Endpoint, EndpointExt, FabricError, MemServer, Procedure,
    ProcedureSession, RegionId, RemoteAddr, TcpConnector, TcpEndpoint, TcpServer,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const R: RegionId = RegionId(1);

fn creds() -> Credentials {
    Credentials::new("procedures", "token")
}

/// Procedure 1: fetch-and-add 1 on the word at the offset in its 8 argument bytes, then read
/// the word after it; returns both (two round trips' worth of steps, run at the server).
const FAA_THEN_READ: u32 = 1;
/// Procedure 2: polls the word at offset 0 until it is non-zero, then writes 1 at offset 8 —
/// a procedure that waits, like a lock acquisition.
const WAIT_THEN_WRITE: u32 = 2;

struct Steps {
    wait: bool,
}

impl Procedure for Steps {
    fn open(
        &self,
        host: Arc<dyn Connector>,
        _session: u64,
    ) -> fabric::Result<Box<dyn ProcedureSession>> {
        Ok(Box::new(StepsSession {
            wait: self.wait,
            ep: host.connect()?,
        }))
    }
}

struct StepsSession {
    wait: bool,
    ep: Box<dyn Endpoint>,
}

impl ProcedureSession for StepsSession {
    fn call(&mut self, args: &[u8], result: &mut Vec<u8>) -> fabric::Result<()> {
        if self.wait {
            while self.ep.read_u64(RemoteAddr::new(R, 0))? == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            return self.ep.write_u64(RemoteAddr::new(R, 8), 1);
        }
        let offset = u64::from_le_bytes(
            args.try_into()
                .map_err(|_| FabricError::Config("8 argument bytes expected".into()))?,
        );
        let old = self.ep.faa(RemoteAddr::new(R, offset), 1)?;
        let next = self.ep.read_u64(RemoteAddr::new(R, offset + 8))?;
        result.extend_from_slice(&old.to_le_bytes());
        result.extend_from_slice(&next.to_le_bytes());
        Ok(())
    }
}

fn server() -> TcpServer {
    let server = TcpServer::bind("127.0.0.1:0", creds()).unwrap();
    server.register(R, 4096).unwrap();
    server
        .register_procedure(FAA_THEN_READ, Arc::new(Steps { wait: false }))
        .unwrap();
    server
        .register_procedure(WAIT_THEN_WRITE, Arc::new(Steps { wait: true }))
        .unwrap();
    server
}

fn call(ep: &mut dyn Endpoint, id: u32, args: &[u8]) -> fabric::Result<Vec<u8>> {
    let mut out = Vec::new();
    ep.call(id, args, &mut out)?;
    Ok(out)
}

#[test]
fn a_call_runs_next_to_memory_on_the_words_clients_use() {
    let server = server();
    let connector = TcpConnector::connect(server.local_addr(), creds()).unwrap();
    let mut ep = connector.endpoint().unwrap();
    ep.write_u64(RemoteAddr::new(R, 64), 41).unwrap();
    ep.write_u64(RemoteAddr::new(R, 72), 99).unwrap();
    let before = ep.stats().round_trips;
    let out = call(&mut ep, FAA_THEN_READ, &64u64.to_le_bytes()).unwrap();
    assert_eq!(out[..8], 41u64.to_le_bytes());
    assert_eq!(out[8..], 99u64.to_le_bytes());
    assert_eq!(
        ep.stats().round_trips,
        before + 1,
        "a call is one round trip"
    );
    // The procedure's step landed on the word a one-sided client reads.
    assert_eq!(ep.read_u64(RemoteAddr::new(R, 64)).unwrap(), 42);
    // Calls of one connection keep their session; another connection gets its own.
    let mut other = connector.endpoint().unwrap();
    let out = call(&mut other, FAA_THEN_READ, &64u64.to_le_bytes()).unwrap();
    assert_eq!(out[..8], 42u64.to_le_bytes());
}

/// A posted call costs no round trip and gets no answer, yet runs in order: after the batch
/// sent before it, before the call sent after it.
#[test]
fn a_posted_call_runs_in_order_without_a_round_trip() {
    let server = server();
    let mut ep = TcpEndpoint::connect(server.local_addr(), &creds()).unwrap();
    ep.write_u64(RemoteAddr::new(R, 256), 10).unwrap();
    let before = ep.stats();
    for _ in 0..3 {
        ep.post_call(FAA_THEN_READ, &256u64.to_le_bytes()).unwrap();
    }
    let spent = ep.stats().since(&before);
    assert_eq!(spent.round_trips, 0, "posting waits for nothing");
    assert_eq!(spent.posted_calls, 3);
    // The next call's answer is its own, and it sees the three posted increments.
    let out = call(&mut ep, FAA_THEN_READ, &256u64.to_le_bytes()).unwrap();
    assert_eq!(out[..8], 13u64.to_le_bytes());
    assert_eq!(ep.read_u64(RemoteAddr::new(R, 256)).unwrap(), 14);
    assert!(!ep.is_broken());

    // Backends without a server CPU post no calls, and say so.
    let mem = MemServer::new();
    mem.register(R, 64).unwrap();
    let mut local = mem.connect().unwrap();
    assert!(matches!(
        local.post_call(FAA_THEN_READ, &0u64.to_le_bytes()),
        Err(FabricError::Unsupported(_))
    ));
}

/// A posted call that fails closes the connection, like a failed unsignaled work request: the
/// request after it does not run, and fails saying why, as disconnected.
#[test]
fn a_failed_posted_call_closes_the_connection_and_nothing_after_it_runs() {
    let server = server();
    let connector = TcpConnector::connect(server.local_addr(), creds()).unwrap();
    let mut ep = connector.endpoint().unwrap();
    // Bad arguments: the procedure fails at the server.
    ep.post_call(FAA_THEN_READ, b"short").unwrap();
    match ep.faa(RemoteAddr::new(R, 512), 1) {
        Err(FabricError::Disconnected(why)) => {
            assert!(
                why.contains("posted call") && why.contains("8 argument bytes"),
                "{why}"
            )
        }
        other => panic!("the batch after a failed posted call must fail, got {other:?}"),
    }
    assert!(ep.is_broken());
    let mut other = connector.endpoint().unwrap();
    assert_eq!(
        other.read_u64(RemoteAddr::new(R, 512)).unwrap(),
        0,
        "the batch sent after the failed posted call did not run"
    );
    // An unknown procedure, posted, fails the same way (the call that follows is not run).
    other.post_call(99, b"").unwrap();
    match call(&mut other, FAA_THEN_READ, &512u64.to_le_bytes()) {
        Err(FabricError::Disconnected(why)) => assert!(why.contains("99"), "{why}"),
        r => panic!("the call after a failed posted call must fail, got {r:?}"),
    }
    let mut third = connector.endpoint().unwrap();
    assert_eq!(third.read_u64(RemoteAddr::new(R, 512)).unwrap(), 0);
}

#[test]
fn refusals_and_failures_leave_the_endpoint_usable() {
    let server = server();
    // A number can be offered once.
    assert!(server
        .register_procedure(FAA_THEN_READ, Arc::new(Steps { wait: false }))
        .is_err());
    let mut ep = TcpEndpoint::connect(server.local_addr(), &creds()).unwrap();
    match call(&mut ep, 99, b"") {
        Err(FabricError::Unsupported(why)) => assert!(why.contains("99"), "{why}"),
        other => panic!("an unknown procedure must be Unsupported, got {other:?}"),
    }
    // The procedure's own failures: bad arguments, a verb out of bounds.
    match call(&mut ep, FAA_THEN_READ, b"short") {
        Err(FabricError::Procedure(why)) => assert!(why.contains("8 argument bytes"), "{why}"),
        other => panic!("a failing procedure must be reported, got {other:?}"),
    }
    assert!(matches!(
        call(&mut ep, FAA_THEN_READ, &(1u64 << 20).to_le_bytes()),
        Err(FabricError::Procedure(_))
    ));
    // Still in sync: a batch and a call go through.
    assert_eq!(ep.faa(RemoteAddr::new(R, 128), 3).unwrap(), 0);
    call(&mut ep, FAA_THEN_READ, &128u64.to_le_bytes()).unwrap();
    assert_eq!(ep.read_u64(RemoteAddr::new(R, 128)).unwrap(), 4);
    // Arguments no server would take are refused before sending.
    let huge = vec![0u8; fabric::procedure::MAX_CALL_BYTES + 1];
    assert!(matches!(
        call(&mut ep, FAA_THEN_READ, &huge),
        Err(FabricError::Config(_))
    ));
    assert!(!ep.is_broken());

    // Backends without a server CPU run no procedures: the caller runs the steps itself.
    let mem = MemServer::new();
    mem.register(R, 64).unwrap();
    let mut local = mem.connect().unwrap();
    assert!(matches!(
        call(&mut local, FAA_THEN_READ, &0u64.to_le_bytes()),
        Err(FabricError::Unsupported(_))
    ));
    let dir = tempfile::tempdir().unwrap();
    let at = Backend::Shm.serve_at(dir.path().join("s"), "127.0.0.1:0".parse().unwrap());
    let shm = fabric::serve(&at, &creds()).unwrap();
    assert!(matches!(
        shm.register_procedure(FAA_THEN_READ, Arc::new(Steps { wait: false })),
        Err(FabricError::Unsupported(_))
    ));
}

/// Fencing a session does not wait for its waiting procedure (it is between batches), and the
/// procedure's next batch is refused: nothing of the session's runs after the revocation.
#[test]
fn a_revoked_session_runs_nothing_more_and_is_not_waited_for() {
    let server = server();
    let mut victim = TcpEndpoint::connect_session(server.local_addr(), &creds(), 7).unwrap();
    let caller = std::thread::spawn(move || call(&mut victim, WAIT_THEN_WRITE, b""));
    // Let the procedure start polling.
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    server.revoke(&[7]);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "the revocation waited for a procedure between batches"
    );
    let mut other = TcpEndpoint::connect(server.local_addr(), &creds()).unwrap();
    other.write_u64(RemoteAddr::new(R, 0), 1).unwrap();
    match caller.join().unwrap() {
        Err(FabricError::Refused(why)) => assert!(why.contains("revoked"), "{why}"),
        other => panic!("a revoked session's call must be refused, got {other:?}"),
    }
    assert_eq!(
        other.read_u64(RemoteAddr::new(R, 8)).unwrap(),
        0,
        "a revoked session's procedure wrote after the revocation"
    );
    // The same procedure for a live client completes.
    call(&mut other, WAIT_THEN_WRITE, b"").unwrap();
    assert_eq!(other.read_u64(RemoteAddr::new(R, 8)).unwrap(), 1);
}

/// A call may wait at the server longer than a batch may take (a lock acquired at the host
/// waits for the lock): its answer is awaited for the call bound, not the batch bound; past
/// the call bound it fails as timed out.
#[test]
fn a_call_waits_up_to_the_call_bound_not_the_batch_bound() {
    let server = server();
    let timeouts = fabric::TcpTimeouts {
        connect: Duration::from_secs(5),
        batch: Duration::from_millis(100),
        call: Duration::from_secs(10),
    };
    let mut ep = TcpEndpoint::connect_with(server.local_addr(), &creds(), 0, timeouts).unwrap();
    // Timed from here, before the sleep that precedes the write the call waits for: timed
    // from inside the thread, a thread that started late (a loaded machine) saw 497 ms.
    let began = Instant::now();
    let caller = std::thread::spawn(move || {
        let out = call(&mut ep, WAIT_THEN_WRITE, b"");
        (out, Instant::now(), ep)
    });
    std::thread::sleep(Duration::from_millis(500));
    let mut other = TcpEndpoint::connect(server.local_addr(), &creds()).unwrap();
    other.write_u64(RemoteAddr::new(R, 0), 1).unwrap();
    let (out, answered, mut ep) = caller.join().unwrap();
    out.unwrap();
    let waited = answered - began;
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
    assert!(!ep.is_broken());
    assert_eq!(ep.read_u64(RemoteAddr::new(R, 8)).unwrap(), 1);

    // Past the call bound: timed out, the endpoint given up.
    other.write_u64(RemoteAddr::new(R, 0), 0).unwrap();
    let short = fabric::TcpTimeouts {
        call: Duration::from_millis(300),
        ..timeouts
    };
    let mut ep = TcpEndpoint::connect_with(server.local_addr(), &creds(), 0, short).unwrap();
    let start = Instant::now();
    match call(&mut ep, WAIT_THEN_WRITE, b"") {
        Err(FabricError::TimedOut(why)) => assert!(why.contains("procedure call"), "{why}"),
        other => panic!("a call past its bound must time out, got {other:?}"),
    }
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert!(ep.is_broken());
    other.write_u64(RemoteAddr::new(R, 0), 1).unwrap();
}
