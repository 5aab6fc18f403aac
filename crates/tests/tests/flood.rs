//! Unauthenticated floods of the meta server's fabric port (tcp) leave the clients that were
//! already connected working: connections that never send their hello, held open (and opened
//! again when the server closes them) from several loopback addresses or from the clients' own,
//! while two clients create, write, read, stat and remove files on several threads each — and
//! so open new connections to the meta region as their worker pools grow. Every operation must
//! succeed.

use fs_client::{CitronFs, LockScheme, ROOT_INO};
use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use testkit::{init_logging, pattern, Backend, Cluster, ClusterSpec};

/// One flood at a time: each runs hundreds of threads, and the machine may have two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Client threads per client: more than the one worker each client's warm-up made, so that
/// the busy clients open new meta-region connections during the flood.
const THREADS_PER_CLIENT: usize = 4;

/// How long the clients work under the flood.
const BUSY_FOR: Duration = Duration::from_secs(4);

/// A flood's running state.
struct Flood {
    stop: Arc<AtomicBool>,
    /// Connections opened so far (TCP connected; the server may not have accepted them yet).
    opened: Arc<AtomicUsize>,
    /// Connections the server closed (evicted or refused).
    closed: Arc<AtomicUsize>,
    threads: Vec<JoinHandle<()>>,
}

impl Flood {
    /// `per_source` threads for each address of `sources`, each holding one connection to
    /// `target` that sends nothing, and opening another 10 ms after the server closes it.
    fn start(target: SocketAddr, sources: &[Ipv4Addr], per_source: usize) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let mut threads = Vec::new();
        for &source in sources {
            for _ in 0..per_source {
                let (stop, opened, closed) = (stop.clone(), opened.clone(), closed.clone());
                let thread = std::thread::Builder::new()
                    .name("flood".into())
                    .stack_size(64 << 10)
                    .spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            let Ok(mut stream) = connect_from(source, target) else {
                                std::thread::sleep(Duration::from_millis(10));
                                continue;
                            };
                            opened.fetch_add(1, Ordering::Relaxed);
                            let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
                            let mut sink = [0u8; 256];
                            while !stop.load(Ordering::Relaxed) {
                                match stream.read(&mut sink) {
                                    Ok(0) => break,
                                    Ok(_) => {}
                                    Err(e)
                                        if matches!(
                                            e.kind(),
                                            std::io::ErrorKind::WouldBlock
                                                | std::io::ErrorKind::TimedOut
                                        ) => {}
                                    Err(_) => break,
                                }
                            }
                            if !stop.load(Ordering::Relaxed) {
                                closed.fetch_add(1, Ordering::Relaxed);
                                std::thread::sleep(Duration::from_millis(10));
                            }
                        }
                    })
                    .expect("spawn a flood thread");
                threads.push(thread);
            }
        }
        Flood {
            stop,
            opened,
            closed,
            threads,
        }
    }

    /// Stops the flood and closes its connections.
    fn stop(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads {
            thread.join().expect("a flood thread");
        }
        (
            self.opened.load(Ordering::Relaxed),
            self.closed.load(Ordering::Relaxed),
        )
    }
}

/// A TCP connection to `target` from loopback address `source`.
fn connect_from(source: Ipv4Addr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&SocketAddr::V4(SocketAddrV4::new(source, 0)).into())?;
    socket.connect_timeout(&target.into(), Duration::from_secs(2))?;
    Ok(socket.into())
}

/// What the busy clients did under a flood.
#[derive(Debug, Default)]
struct Work {
    ok: usize,
    errors: usize,
    first_error: Option<String>,
}

/// One busy thread: create, write, read back, stat, close and remove files until `until`.
fn busy(fs: &CitronFs, who: &str, until: Instant) -> Work {
    let me = CitronFs::process_caller();
    let mut work = Work::default();
    let data = pattern(who.len() as u64, 0, 8 << 10);
    let note = |work: &mut Work, result: Result<(), String>| match result {
        Ok(()) => work.ok += 1,
        Err(e) => {
            work.errors += 1;
            work.first_error.get_or_insert(e);
        }
    };
    let mut i = 0u64;
    while Instant::now() < until {
        let name = format!("{who}-{i}");
        i += 1;
        let (attr, fh) = match fs.create(me, ROOT_INO, &name, 0o644, libc::O_RDWR) {
            Ok(created) => created,
            Err(e) => {
                note(&mut work, Err(format!("create {name}: {e}")));
                continue;
            }
        };
        note(&mut work, Ok(()));
        let wrote = fs.write(fh, 0, &data).map(|_| ());
        note(&mut work, wrote.map_err(|e| format!("write {name}: {e}")));
        let read = match fs.read(fh, 0, data.len()) {
            Ok(back) if back == data => Ok(()),
            Ok(back) => Err(format!(
                "read {name}: {} bytes, not what was written",
                back.len()
            )),
            Err(e) => Err(format!("read {name}: {e}")),
        };
        note(&mut work, read);
        let stat = fs.getattr(attr.ino).map(|_| ());
        note(&mut work, stat.map_err(|e| format!("stat {name}: {e}")));
        let released = fs.release(fh);
        note(
            &mut work,
            released.map_err(|e| format!("close {name}: {e}")),
        );
        let removed = fs.unlink(ROOT_INO, &name);
        note(
            &mut work,
            removed.map_err(|e| format!("unlink {name}: {e}")),
        );
    }
    work
}

/// Starts a tcp cluster and two warmed-up clients, floods the meta server's fabric port from
/// `per_source` connections of each address of `sources` while the clients work, and returns
/// what they did.
fn clients_under_flood(sources: &[Ipv4Addr], per_source: usize) -> Work {
    init_logging();
    let cluster = Cluster::start(ClusterSpec {
        fabric: Backend::Tcp,
        ..ClusterSpec::default().with_data_servers(1, 64)
    })
    .unwrap();
    let fabric::FabricAddr::Tcp { addr } = cluster.meta().fabric_addr() else {
        panic!("a tcp cluster serves its meta region over tcp");
    };
    let target: SocketAddr = addr.parse().unwrap();
    let clients: Vec<CitronFs> = (0..2)
        .map(|_| cluster.connect(LockScheme::CITRON).unwrap())
        .collect();
    // Warm-up: each client's first worker connects before the flood.
    for (c, fs) in clients.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_millis(200);
        let warm = busy(fs, &format!("warm{c}"), deadline);
        assert_eq!(warm.errors, 0, "before the flood: {warm:?}");
    }

    let flood = Flood::start(target, sources, per_source);
    let want = sources.len() * per_source;
    let deadline = Instant::now() + Duration::from_secs(10);
    while flood.opened.load(Ordering::Relaxed) < want {
        assert!(Instant::now() < deadline, "the flood did not connect");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Let the server accept them all.
    std::thread::sleep(Duration::from_millis(300));

    let until = Instant::now() + BUSY_FOR;
    let work = std::thread::scope(|s| {
        let threads: Vec<_> = clients
            .iter()
            .enumerate()
            .flat_map(|(c, fs)| (0..THREADS_PER_CLIENT).map(move |t| (c, t, fs)))
            .map(|(c, t, fs)| s.spawn(move || busy(fs, &format!("c{c}t{t}"), until)))
            .collect();
        let mut total = Work::default();
        for thread in threads {
            let work = thread.join().expect("a client thread");
            total.ok += work.ok;
            total.errors += work.errors;
            if total.first_error.is_none() {
                total.first_error = work.first_error;
            }
        }
        total
    });
    let (opened, closed) = flood.stop();
    eprintln!(
        "flood of {want} from {} address(es): {opened} connections opened, {closed} closed by \
         the server; clients: {} operations succeeded, {} failed (first: {:?})",
        sources.len(),
        work.ok,
        work.errors,
        work.first_error
    );
    drop(clients);
    cluster.shutdown().unwrap();
    work
}

/// 300 silent connections from 127.0.0.2–.6 (60 each, under the per-address pending limit,
/// over the total one) do not cost the connected clients a single operation.
#[test]
fn a_flood_from_several_addresses_fails_no_operation_of_connected_clients() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let sources: Vec<Ipv4Addr> = (2..=6).map(|i| Ipv4Addr::new(127, 0, 0, i)).collect();
    let work = clients_under_flood(&sources, 60);
    assert_eq!(work.errors, 0, "{work:?}");
    assert!(work.ok > 0, "{work:?}");
}

/// 500 silent connections from the clients' own address (over the per-address pending limit)
/// do not cost the connected clients a single operation.
#[test]
fn a_flood_from_the_clients_address_fails_no_operation_of_connected_clients() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let work = clients_under_flood(&[Ipv4Addr::LOCALHOST], 500);
    assert_eq!(work.errors, 0, "{work:?}");
    assert!(work.ok > 0, "{work:?}");
}
