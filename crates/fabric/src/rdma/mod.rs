//! The `rdma` backend (cargo feature `rdma`): one-sided verbs executed by an RDMA NIC, with no
//! server CPU on the data path.
//!
//! Two layers. The backend proper ([`RdmaServer`], [`RdmaConnector`], [`RdmaEndpoint`]) is
//! written against a narrow verbs interface ([`verbs`]); a provider implements that interface:
//! [`soft`], an emulation of a NIC for the processes of one host with a real NIC's semantics
//! (every line of the backend runs in CI on it), or `ibverbs`, the thin shim over libibverbs
//! (`rdma-sys`). The environment chooses: [`ENV_PROVIDER`] (`CITRONFS_RDMA_PROVIDER=soft|
//! ibverbs`, default `ibverbs`) and [`ENV_DEVICE`] (`CITRONFS_RDMA_DEVICE`, default the first
//! device found).
//!
//! **Connection setup.** A server listens on a tcp address; every client endpoint opens one
//! connection to it and runs the cluster's authenticated handshake ([`crate::handshake`],
//! [`Protocol::RdmaSetup`](crate::handshake::Protocol::RdmaSetup)) carrying its queue pair's
//! number, PSN and GID; the welcome carries the server's queue pair for it and the server's
//! regions with their rkeys ([`RegionKey`]). Each region is registered once, when it is
//! registered with the server, not per object nor per client. The connection then stays open
//! as the queue pair's lifeline: the server destroys the queue pair when it closes, and the
//! client asks on it for regions registered after it connected.
//!
//! **Verbs.** `read`, `write`, `cas` and `faa` are the NIC's own (RDMA Read, RDMA Write,
//! compare-and-swap, fetch-and-add; an atomic's result is converted from the byte order the
//! device returns it in). A batch is one chain of work requests, one doorbell and one signalled
//! completion; every request after a Read or an atomic carries `IBV_SEND_FENCE`, since RC lets
//! a later request overtake those otherwise and the fabric promises posting order. Upstream
//! verbs have no masked atomics: `masked_cas` and `masked_faa` are emulated by the client
//! with a Read and a CAS loop through [`crate::atomic_ops`] (extra round trips, reported as
//! [`MaskedAtomics::ClientEmulated`](crate::MaskedAtomics::ClientEmulated)); a flush is a Read
//! of the range's last byte after the writes (the writes are placed in the server's memory
//! when it completes; no `msync` runs). Every verb is checked by the client against the
//! server's region list before anything is posted, so a batch is refused whole with the same
//! [`VerbError`](crate::VerbError) as on every other backend; a batch's expiry is checked when
//! it is posted (a NIC cannot check it later), and an expiring batch's completion is awaited
//! until its expiry plus [`crate::REPLY_AFTER_EXPIRY`] only, as tcp awaits its reply; then the
//! queue pair is moved to the error state, so that nothing of the batch is sent any more.
//!
//! **Errors** are errors, never a panic or a hang: no device (ENOSYS, an empty list), a device
//! without atomics, a failed registration are errors at start-up ([`FabricError::Config`]); a
//! remote access error or a queue pair in error fails the batch with
//! [`FabricError::Disconnected`] (the endpoint is dead; verbs before the failed one may have
//! executed), and a completion that does not come by the batch's deadline
//! ([`TcpTimeouts::batch`](crate::TcpTimeouts), or an expiring batch's expiry plus
//! [`crate::REPLY_AFTER_EXPIRY`]) with [`FabricError::TimedOut`], the queue pair moved to the
//! error state.
//!
//! **The server's own CPU and lock words.** A NIC's atomics are atomic against the CPU's
//! atomics on the same word only where the device reports `IBV_ATOMIC_GLOB`; with
//! `IBV_ATOMIC_HCA` (most devices) a CPU compare-and-swap racing a NIC fetch-and-add can lose
//! either. So on `rdma` every access a server makes to its own regions while clients may act
//! on them — hosted lock acquisitions, lease recovery by the meta server, fsck repair — goes
//! through the NIC: [`crate::FabricServer::connector`] and
//! [`crate::FabricServer::host_connector`] are loopback queue pairs, unless the device reports
//! `IBV_ATOMIC_GLOB`, where the host connector executes on the CPU. That rule is enforced in
//! [`RdmaServer::host_connector`]. (A server initialising a region before any client can reach
//! it, as a data server does at start, is not concurrent with the NIC and may store directly.)

mod endpoint;
pub mod ibverbs;
mod server;
pub mod soft;
mod soft_link;
pub mod verbs;

pub use endpoint::{RdmaConnector, RdmaEndpoint};
pub use server::RdmaServer;

use crate::addr::RegionId;
use crate::error::{FabricError, Result};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use verbs::{AtomicCap, Device, Provider, QpAddress};

/// The environment variable choosing the provider: `soft` or `ibverbs` (the default).
pub const ENV_PROVIDER: &str = "CITRONFS_RDMA_PROVIDER";
/// The environment variable naming the device to open (default: the first found).
pub const ENV_DEVICE: &str = "CITRONFS_RDMA_DEVICE";

/// Work requests one queue pair holds: the most verbs one chain carries (a longer batch is
/// posted as several chains, one after the other).
pub const QP_DEPTH: u32 = 1024;

/// The provider [`ENV_PROVIDER`] names.
pub fn provider() -> Result<Arc<dyn Provider>> {
    let name = std::env::var(ENV_PROVIDER).unwrap_or_else(|_| "ibverbs".into());
    provider_named(&name)
}

/// The provider called `name`.
pub fn provider_named(name: &str) -> Result<Arc<dyn Provider>> {
    match name {
        "soft" => Ok(Arc::new(soft::SoftProvider::new(
            soft::SoftOptions::from_env(),
        ))),
        "ibverbs" => ibverbs_provider(),
        other => Err(FabricError::Config(format!(
            "rdma: unknown provider {other:?} in {ENV_PROVIDER} (soft, ibverbs)"
        ))),
    }
}

fn ibverbs_provider() -> Result<Arc<dyn Provider>> {
    Ok(Arc::new(ibverbs::IbverbsProvider))
}

/// Opens the device the environment names with the provider it names, and checks that it can
/// serve the fabric (it has atomics).
pub fn open_device() -> Result<Arc<dyn Device>> {
    let provider = provider()?;
    let name = std::env::var(ENV_DEVICE).ok();
    usable(provider.open(name.as_deref())?)
}

/// `device`, if it can serve the fabric: it has atomics.
pub fn usable(device: Arc<dyn Device>) -> Result<Arc<dyn Device>> {
    if device.attrs().atomic_cap == AtomicCap::None {
        return Err(FabricError::Config(format!(
            "rdma: device {} has no atomic verbs (IBV_ATOMIC_NONE); the lock protocol needs \
             compare-and-swap and fetch-and-add",
            device.attrs().name
        )));
    }
    Ok(device)
}

/// A served region as a client's NIC reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionKey {
    /// The region.
    pub id: RegionId,
    /// Its first byte in the server's registration.
    pub addr: u64,
    /// Its size.
    pub len: u64,
    /// The rkey of its registration.
    pub rkey: u32,
}

/// What a client's hello adds: its queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetupRole {
    /// The client's queue pair, in INIT.
    pub qp: QpAddress,
}

/// The server's welcome: its queue pair for the client, connected already, and its regions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetupWelcome {
    /// The server's queue pair, in RTS.
    pub qp: QpAddress,
    /// The regions served now.
    pub regions: Vec<RegionKey>,
}

/// A request on the setup connection after the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SetupRequest {
    /// The regions served now (answered with a `Vec<RegionKey>`).
    Regions,
}

/// The largest setup frame either side reads.
const MAX_SETUP_FRAME: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::soft::{SoftOptions, SoftProvider};
    use super::*;
    use crate::addr::RemoteAddr;
    use crate::batch::{Batch, Completions};
    use crate::endpoint::{Connector, EndpointExt};
    use crate::tcp::TcpTimeouts;
    use crate::{Endpoint, MaskedAtomics, VerbError};
    use std::time::{Duration, Instant};

    fn creds() -> crate::Credentials {
        crate::Credentials::new("rdma-tests", "secret")
    }

    fn device(options: SoftOptions) -> Arc<dyn Device> {
        usable(SoftProvider::new(options).open(None).unwrap()).unwrap()
    }

    fn server(options: SoftOptions) -> RdmaServer {
        let server = RdmaServer::bind_on(device(options), "127.0.0.1:0", creds()).unwrap();
        server.register(RegionId(1), 4096).unwrap();
        server
    }

    fn connector(server: &RdmaServer, options: SoftOptions, batch: Duration) -> RdmaConnector {
        let timeouts = TcpTimeouts {
            batch,
            ..TcpTimeouts::DEFAULT
        };
        RdmaConnector::on_device(device(options), server.local_addr(), creds(), 0, timeouts)
            .unwrap()
    }

    const W: RemoteAddr = RemoteAddr::new(RegionId(1), 64);

    /// RC lets a Write overtake an earlier Read; the backend's fences keep posting order.
    #[test]
    fn a_read_before_a_write_in_one_batch_reads_the_old_value() {
        let s = server(SoftOptions::default());
        let mut ep = connector(&s, SoftOptions::default(), Duration::from_secs(5))
            .endpoint()
            .unwrap();
        ep.write_u64(W, 1).unwrap();
        let mut b = Batch::new();
        let r = b.read(W, 8);
        let f = b.faa(W, 10);
        b.write_u64(W, 2);
        let mut out = Completions::new();
        ep.execute(&b, &mut out).unwrap();
        assert_eq!((out.word(r, 0), out.old(f)), (1, 1));
        assert_eq!(ep.read_u64(W).unwrap(), 2);
    }

    #[test]
    fn masked_atomics_are_emulated_and_counted() {
        let s = server(SoftOptions::default());
        let mut ep = connector(&s, SoftOptions::default(), Duration::from_secs(5))
            .endpoint()
            .unwrap();
        assert_eq!(
            ep.capabilities().masked_atomics,
            MaskedAtomics::ClientEmulated
        );
        let before = ep.stats().round_trips;
        assert_eq!(ep.masked_faa(W, 1, 1 << 31).unwrap(), 0);
        // A Read and one CAS, uncontended.
        assert_eq!(ep.stats().round_trips - before, 2);
        assert_eq!(ep.emulated_masked_atomics(), 1);
        // A compare that fails stores nothing: the Read alone.
        let before = ep.stats().round_trips;
        assert_eq!(ep.masked_cas(W, 5, 0xff, 0, 0xff).unwrap(), 1);
        assert_eq!(ep.stats().round_trips - before, 1);
    }

    #[test]
    fn atomic_results_come_back_in_host_order_from_a_reply_be_device() {
        let be = SoftOptions {
            reply_be: true,
            ..SoftOptions::default()
        };
        let s = server(be);
        let mut ep = connector(&s, be, Duration::from_secs(5))
            .endpoint()
            .unwrap();
        ep.write_u64(W, 0x0102_0304).unwrap();
        assert_eq!(ep.faa(W, 1).unwrap(), 0x0102_0304);
        assert_eq!(ep.cas(W, 0x0102_0305, 9).unwrap(), 0x0102_0305);
        assert_eq!(ep.read_u64(W).unwrap(), 9);
    }

    /// A region deregistered behind a client's back: its next verb there meets a remote access
    /// error at the server's NIC; the endpoint says so and stays dead; a new one works.
    #[test]
    fn a_remote_access_error_breaks_the_endpoint_clearly() {
        let s = server(SoftOptions::default());
        s.register(RegionId(2), 4096).unwrap();
        let c = connector(&s, SoftOptions::default(), Duration::from_secs(5));
        let mut ep = c.endpoint().unwrap();
        ep.write_u64(RemoteAddr::new(RegionId(2), 0), 5).unwrap();
        s.deregister(RegionId(2));
        let err = ep.read_u64(RemoteAddr::new(RegionId(2), 0)).unwrap_err();
        assert!(
            matches!(&err, crate::FabricError::Disconnected(why) if why.contains("remote access error")),
            "{err}"
        );
        let err = ep.read_u64(W).unwrap_err();
        assert!(err.to_string().contains("earlier batch"), "{err}");
        let mut fresh = c.endpoint().unwrap();
        // The fresh endpoint learnt the region is gone: refused before posting.
        match fresh.read_u64(RemoteAddr::new(RegionId(2), 0)) {
            Err(crate::FabricError::Verb(VerbError::UnknownRegion { .. })) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(fresh.read_u64(W).unwrap(), 0);
    }

    /// A region registered after the client connected is found on the setup connection.
    #[test]
    fn regions_registered_later_are_found() {
        let s = server(SoftOptions::default());
        let mut ep = connector(&s, SoftOptions::default(), Duration::from_secs(5))
            .endpoint()
            .unwrap();
        s.register(RegionId(7), 64).unwrap();
        ep.write_u64(RemoteAddr::new(RegionId(7), 8), 3).unwrap();
        assert_eq!(ep.read_u64(RemoteAddr::new(RegionId(7), 8)).unwrap(), 3);
    }

    /// A completion that never comes fails the batch at its deadline, not later, not never.
    #[test]
    fn a_silent_server_times_the_batch_out() {
        let s = server(SoftOptions::default());
        let mut ep = connector(&s, SoftOptions::default(), Duration::from_millis(200))
            .endpoint()
            .unwrap();
        soft::stall(ep.qpn(), true);
        let start = Instant::now();
        let err = ep.read_u64(W).unwrap_err();
        assert!(matches!(err, crate::FabricError::TimedOut(_)), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5));
        soft::stall(ep.qpn(), false);
        assert!(ep.read_u64(W).is_err(), "a timed-out endpoint stays dead");
    }

    /// An expiring batch to a silent server fails at its expiry (plus
    /// `REPLY_AFTER_EXPIRY`), not at the batch bound: a lock holder gets control back while its
    /// lease still runs, as on tcp. The queue pair is in error then, so nothing of the batch
    /// can land later; the endpoint stays dead and a new one works.
    #[test]
    fn a_silent_server_fails_an_expiring_batch_at_its_expiry() {
        let s = server(SoftOptions::default());
        let bound = Duration::from_secs(5);
        let c = connector(&s, SoftOptions::default(), bound);
        let mut first = c.endpoint().unwrap();
        first.faa(W, 1).unwrap();
        let mut first = Some(first);
        let expiry = Duration::from_millis(300);
        for masked in [false, true] {
            let mut batch = Batch::new();
            if masked {
                // Emulated: its Read and CAS round trips are held to the expiry too.
                batch.masked_faa(W, 1, 1 << 31);
            } else {
                batch.write(W.add(8), b"expiring");
            }
            let start = Instant::now();
            batch.expire_at(Some(start + expiry));
            let ep = match masked {
                true => c.endpoint().unwrap(),
                false => first.take().unwrap(),
            };
            soft::stall(ep.qpn(), true);
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut ep = ep;
                let result = ep.execute(&batch, &mut Completions::new());
                let _ = tx.send((start.elapsed(), result, ep));
            });
            let (took, result, mut ep) = rx
                .recv_timeout(bound + Duration::from_secs(5))
                .expect("a batch to a silent server must fail, not hang");
            match result {
                Err(crate::FabricError::TimedOut(why)) => {
                    assert!(why.contains("expiry"), "{why}")
                }
                other => panic!("expected TimedOut, got {other:?}"),
            }
            assert!(
                took >= expiry && took < expiry + Duration::from_millis(700),
                "failed after {took:?}; expiry {expiry:?}, batch bound {bound:?}"
            );
            assert_eq!(ep.qp_state(), verbs::QpState::Error);
            soft::stall(ep.qpn(), false);
            assert!(ep.read_u64(W).is_err(), "a timed-out endpoint stays dead");
        }
        let mut fresh = c.endpoint().unwrap();
        assert_eq!(
            fresh.read_u64(W).unwrap(),
            1,
            "nothing of either batch landed"
        );
        assert_eq!(fresh.read_u64(W.add(8)).unwrap(), 0);
    }

    /// A connector asked for an endpoint by a deadline gives up at that deadline when the
    /// server does not answer the setup handshake, not at its connect bound (5 s): a lock
    /// holder connecting to a data server that went silent gets its call back while its lease
    /// still runs, as on tcp.
    #[test]
    fn a_connect_by_a_deadline_to_a_silent_server_ends_at_the_deadline() {
        use std::net::{TcpListener, TcpStream};
        use std::sync::atomic::{AtomicBool, Ordering};
        let s = server(SoftOptions::default());
        let upstream = s.local_addr();
        // A proxy that forwards each setup connection until `silent` is set, and then accepts
        // new ones and never answers them (a host whose process stopped answering).
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
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
        let c = RdmaConnector::on_device(
            device(SoftOptions::default()),
            addr,
            creds(),
            0,
            TcpTimeouts::DEFAULT,
        )
        .unwrap();
        c.endpoint().unwrap().faa(W, 1).unwrap();
        silent.store(true, Ordering::SeqCst);
        let (tx, rx) = std::sync::mpsc::channel();
        let by = Duration::from_millis(300);
        std::thread::spawn(move || {
            let start = Instant::now();
            let result = c.connect_by(Some(start + by)).map(drop);
            let _ = tx.send((start.elapsed(), result));
        });
        let (took, result) = rx
            .recv_timeout(Duration::from_secs(15))
            .expect("a connect to a silent server must end, not hang");
        assert!(
            matches!(&result, Err(crate::FabricError::TimedOut(why)) if why.contains("deadline")),
            "a connect to a server that never answers: {result:?}"
        );
        assert!(
            took >= by && took < by + Duration::from_millis(700),
            "gave up after {took:?}, deadline {by:?}: {result:?}"
        );
    }

    /// Fencing: once a session is revoked, the server's queue pairs for it are in the error
    /// state, so its endpoints' verbs execute nothing more (the word untouched), a new
    /// endpoint naming it is refused, and other sessions go on. Sessions below a floor are
    /// cut off the same way and refused as behind, not as revoked.
    #[test]
    fn a_revoked_session_is_fenced() {
        let s = server(SoftOptions::default());
        let session = |n| {
            RdmaConnector::on_device(
                device(SoftOptions::default()),
                s.local_addr(),
                creds(),
                n,
                TcpTimeouts::DEFAULT,
            )
            .unwrap()
        };
        let fenced = session(7);
        let (mut a, mut b) = (fenced.endpoint().unwrap(), fenced.endpoint().unwrap());
        let other = session(8);
        let mut o = other.endpoint().unwrap();
        a.write_u64(W, 1).unwrap();

        s.revoke(&[7]);
        for ep in [&mut a, &mut b] {
            let err = ep.write_u64(W, 2).unwrap_err();
            assert!(
                matches!(&err, crate::FabricError::Disconnected(why) if why.contains("retries exceeded")),
                "{err}"
            );
            assert_eq!(ep.qp_state(), verbs::QpState::Error);
        }
        assert_eq!(o.read_u64(W).unwrap(), 1, "the fenced write must not land");
        match fenced.endpoint() {
            Err(crate::FabricError::Refused(why)) => {
                assert!(why.contains("session 7 was revoked"), "{why}")
            }
            other => panic!("a revoked session must be refused, got {other:?}"),
        }
        o.write_u64(W, 3).unwrap();

        s.refuse_sessions_before(100);
        assert!(
            o.read_u64(W).is_err(),
            "a session below the floor is cut off"
        );
        match other.endpoint() {
            Err(crate::FabricError::SessionBehind(why)) => {
                assert!(why.contains("start at 100"), "{why}")
            }
            other => panic!("a session below the floor is behind, got {other:?}"),
        }
        let mut current = session(100).endpoint().unwrap();
        assert_eq!(current.read_u64(W).unwrap(), 3);
        // The server's own loopback (session 0) is never fenced.
        assert_eq!(session(0).endpoint().unwrap().read_u64(W).unwrap(), 3);
    }

    #[test]
    fn a_server_gone_is_an_error() {
        let s = server(SoftOptions::default());
        let mut ep = connector(&s, SoftOptions::default(), Duration::from_secs(5))
            .endpoint()
            .unwrap();
        drop(s);
        let err = ep.read_u64(W).unwrap_err();
        assert!(err.to_string().contains("retries exceeded"), "{err}");
    }

    #[test]
    fn devices_and_providers_that_cannot_serve_are_refused() {
        let none = SoftOptions {
            no_atomics: true,
            ..SoftOptions::default()
        };
        let err = usable(SoftProvider::new(none).open(None).unwrap())
            .err()
            .unwrap();
        assert!(err.to_string().contains("no atomic verbs"), "{err}");
        let err = provider_named("verbs").err().unwrap();
        assert!(err.to_string().contains("unknown provider"), "{err}");
        assert!(SoftProvider::default().open(Some("mlx5_0")).is_err());
    }

    #[test]
    fn wrong_credentials_are_refused() {
        let s = server(SoftOptions::default());
        let err = RdmaConnector::on_device(
            device(SoftOptions::default()),
            s.local_addr(),
            crate::Credentials::new("rdma-tests", "wrong"),
            0,
            TcpTimeouts::DEFAULT,
        )
        .unwrap_err();
        // The client finds first that the server does not prove the same secret.
        assert!(
            matches!(
                err,
                crate::FabricError::Refused(_) | crate::FabricError::Unverified(_)
            ),
            "{err}"
        );
    }

    /// The server's own CPU reaches its lock words through the NIC unless the device's
    /// atomics are IBV_ATOMIC_GLOB.
    #[test]
    fn the_host_connector_goes_through_the_nic_unless_atomics_are_global() {
        for (options, cpu) in [
            (SoftOptions::default(), false),
            (
                SoftOptions {
                    glob: true,
                    ..SoftOptions::default()
                },
                true,
            ),
        ] {
            let s = server(options);
            let loopback: Arc<dyn Connector> =
                Arc::new(connector(&s, options, Duration::from_secs(5)));
            let host = s.host_connector(loopback);
            let mut ep = host.connect().unwrap();
            ep.faa(W, 1).unwrap();
            let on_cpu = ep.capabilities().masked_atomics == MaskedAtomics::CpuCasLoop;
            assert_eq!(on_cpu, cpu, "{options:?}");
        }
    }

    /// A batch longer than a queue pair is posted as several chains, in order.
    #[test]
    fn a_batch_longer_than_the_queue_pair_runs_in_order() {
        let s = server(SoftOptions::default());
        let mut ep = connector(&s, SoftOptions::default(), Duration::from_secs(5))
            .endpoint()
            .unwrap();
        let mut b = Batch::new();
        let handles: Vec<_> = (0..QP_DEPTH as usize + 10).map(|_| b.faa(W, 1)).collect();
        let mut out = Completions::new();
        ep.execute(&b, &mut out).unwrap();
        for (i, h) in handles.iter().enumerate() {
            assert_eq!(out.old(*h), i as u64);
        }
        assert_eq!(ep.stats().round_trips, 2);
    }
}
