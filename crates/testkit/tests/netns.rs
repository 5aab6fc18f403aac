//! The network-namespace harness itself: hosts reach each other over the switch, a cut link
//! loses every packet until healed, and dropping the network leaves no namespace behind.

use std::net::TcpListener;
use std::time::{Duration, Instant};
use testkit::netns::Network;
use testkit::skip_without_netns;

#[test]
fn hosts_talk_until_cut_and_again_once_healed_and_nothing_is_left() {
    skip_without_netns!();
    let net = Network::new(&["a", "b", "c"]).unwrap();
    let a = net.host("a").at(4000);
    // A listener on host a (its socket lives in a's namespace).
    let listener = net
        .run_in("a", move || TcpListener::bind(a))
        .unwrap()
        .unwrap();
    let accept = std::thread::spawn(move || {
        // b, c, c again while b is cut, b once healed.
        for _ in 0..4 {
            if listener.accept().is_err() {
                return;
            }
        }
    });
    let short = Duration::from_millis(500);
    net.connect_from("b", a, short).expect("b reaches a");
    net.connect_from("c", a, short).expect("c reaches a");

    net.cut("b").unwrap();
    let start = Instant::now();
    let cut = net.connect_from("b", a, short);
    assert!(cut.is_err(), "b is cut off, yet connected");
    assert!(start.elapsed() >= short, "failed at once, not by loss");
    net.connect_from("c", a, short).expect("c is not cut");

    net.heal("b").unwrap();
    net.connect_from("b", a, Duration::from_secs(5))
        .expect("b reaches a again once healed");
    accept.join().unwrap();

    let names = net.namespaces().to_vec();
    assert_eq!(names.len(), 4, "{names:?}");
    for ns in &names {
        assert!(std::path::Path::new("/run/netns").join(ns).exists(), "{ns}");
    }
    drop(net);
    for ns in &names {
        assert!(
            !std::path::Path::new("/run/netns").join(ns).exists(),
            "{ns} left behind"
        );
    }
}

#[test]
fn a_process_runs_in_its_host_and_keeps_the_mount_namespace() {
    skip_without_netns!();
    let net = Network::new(&["x"]).unwrap();
    let mut cmd = std::process::Command::new("sh");
    cmd.args([
        "-c",
        "ip -o -4 addr show dev eth0; readlink /proc/self/ns/mnt; sleep 30",
    ]);
    let mut p = net.spawn("x", "sh", cmd).unwrap();
    p.wait_for_output("mnt:", Duration::from_secs(10)).unwrap();
    let out = p.output();
    assert!(out.contains("10.77.0.1/24"), "{out}");
    let ours = std::fs::read_link("/proc/self/ns/mnt").unwrap();
    assert!(out.contains(&*ours.to_string_lossy()), "{out} vs {ours:?}");
    let start = Instant::now();
    drop(p);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "stop took too long"
    );
}

/// A tcp fabric server drops the connection of a client whose link was cut (nothing closed,
/// nothing answered) within `fabric::tcp::DEAD_PEER_AFTER`, instead of keeping its thread
/// blocked on it for ever.
#[test]
fn a_fabric_server_drops_a_vanished_client() {
    skip_without_netns!();
    use fabric::{Credentials, EndpointExt, RegionId, RemoteAddr, TcpEndpoint, TcpServer};
    let net = Network::new(&["server", "client"]).unwrap();
    let at = net.host("server").at(4100);
    let creds = Credentials::new("netns", "secret");
    let c = creds.clone();
    let server = net
        .run_in("server", move || TcpServer::bind(at, c))
        .unwrap()
        .unwrap();
    server.register(RegionId(1), 4096).unwrap();
    let mut ep = net
        .run_in("client", move || TcpEndpoint::connect(at, &creds))
        .unwrap()
        .unwrap();
    ep.faa(RemoteAddr::new(RegionId(1), 0), 1).unwrap();
    assert_eq!(server.connection_count(), 1);
    net.cut("client").unwrap();
    let start = Instant::now();
    let bound = fabric::tcp::DEAD_PEER_AFTER + Duration::from_secs(5);
    testkit::wait_until(bound, "the server to drop the vanished client", || {
        server.connection_count() == 0
    });
    println!(
        "the server dropped the cut client's connection after {:?}",
        start.elapsed()
    );
    drop(ep);
}
