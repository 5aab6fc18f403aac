//! The attribute table (`proto::attrs`): `getattr` reads it one-sidedly — no request reaches
//! the meta server — sees every change another client made (chmod, a write to an open file,
//! truncate, unlink), and falls back to the RPC when a slot is torn, empty or another inode's.

use fabric::{EndpointExt, RemoteAddr};
use fs_client::{CitronFs, FsError, LockScheme, SetAttr, ROOT_INO};
use proto::attrs::{self, AttrSlot};
use testkit::{Cluster, ClusterSpec};

fn me() -> fs_client::Caller {
    CitronFs::process_caller()
}

fn start() -> Cluster {
    Cluster::start(ClusterSpec::default().with_data_servers(1, 64)).unwrap()
}

/// Requests the meta server handles while `f` runs (heartbeats excepted).
fn requests_during<T>(cluster: &Cluster, f: impl FnOnce() -> T) -> (T, u64) {
    let before = cluster.meta().request_count();
    let out = f();
    (out, cluster.meta().request_count() - before)
}

#[test]
fn a_stat_after_another_clients_change_sees_it_without_an_rpc() {
    let cluster = start();
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    assert!(
        b.cluster().attr_table.is_some(),
        "the meta server publishes a table"
    );
    let (attr, fh) = a.create(me(), ROOT_INO, "f", 0o644, libc::O_RDWR).unwrap();
    let ino = attr.ino;

    let (seen, rpcs) = requests_during(&cluster, || b.getattr(ino).unwrap());
    assert_eq!(rpcs, 0, "a created file's attributes are published");
    assert_eq!(seen.perm, 0o644);

    // A write raises SIZE in the FCB one-sidedly: the slot names the FCB, b reads it there.
    a.write(fh, 0, &[7u8; 5000]).unwrap();
    let (seen, rpcs) = requests_during(&cluster, || b.getattr(ino).unwrap());
    assert_eq!((seen.size, rpcs), (5000, 0));

    let chmod = SetAttr {
        perm: Some(0o600),
        ..SetAttr::default()
    };
    a.setattr(me(), ino, chmod).unwrap();
    let (seen, rpcs) = requests_during(&cluster, || b.getattr(ino).unwrap());
    assert_eq!((seen.perm, rpcs), (0o600, 0));

    let truncate = SetAttr {
        size: Some(10),
        ..SetAttr::default()
    };
    a.setattr(me(), ino, truncate).unwrap();
    assert_eq!(b.getattr(ino).unwrap().size, 10);

    // Closed: the size is persisted and the slot no longer names an FCB.
    a.release(fh).unwrap();
    let (seen, rpcs) = requests_during(&cluster, || b.getattr(ino).unwrap());
    assert_eq!((seen.size, rpcs), (10, 0));

    a.unlink(ROOT_INO, "f").unwrap();
    assert!(matches!(
        b.getattr(ino),
        Err(fs_client::Error::Fs(FsError::NotFound))
    ));
}

#[test]
fn torn_empty_and_foreign_slots_fall_back_to_the_rpc() {
    let cluster = start();
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let table = fs.cluster().attr_table.expect("a table");
    let (attr, fh) = fs.create(me(), ROOT_INO, "g", 0o640, libc::O_RDWR).unwrap();
    fs.release(fh).unwrap();
    let ino = attr.ino;
    let (_, rpcs) = requests_during(&cluster, || fs.getattr(ino).unwrap());
    assert_eq!(rpcs, 0);

    // Someone else's hands on the meta region: the test writes the slot as a torn read or a
    // stale collision would find it.
    let info = fs.cluster();
    let mut ep = fabric::connect(&info.meta_fabric, &cluster.credentials(), 0)
        .unwrap()
        .connect()
        .unwrap();
    let slot_addr: RemoteAddr = table.slot_addr(ino);
    let good = ep.read(slot_addr, attrs::SLOT_BYTES as usize).unwrap();
    let published = attrs::decode(&good, ino).expect("published");

    let mut torn = good.clone();
    torn[40] ^= 0xff;
    let foreign = attrs::encode(&AttrSlot {
        attr: proto::Attr {
            ino: ino + table.slots,
            ..published.attr.clone()
        },
        ..published.clone()
    })
    .unwrap();
    for (what, bytes) in [
        ("torn", torn),
        ("empty", vec![0u8; attrs::SLOT_BYTES as usize]),
        ("another inode's", foreign),
    ] {
        ep.write(slot_addr, &bytes).unwrap();
        let (seen, rpcs) = requests_during(&cluster, || fs.getattr(ino).unwrap());
        assert_eq!(rpcs, 1, "a {what} slot costs the RPC");
        assert_eq!(seen, published.attr, "and the RPC's answer is the truth");
        // The RPC filled the slot again (except over another inode's, which it replaces too:
        // the asked inode wins the slot).
        let (_, rpcs) = requests_during(&cluster, || fs.getattr(ino).unwrap());
        assert_eq!(rpcs, 0, "after a {what} slot, the RPC republished it");
    }
}

#[test]
fn a_known_name_is_looked_up_one_sidedly_until_its_directory_changes() {
    let cluster = start();
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let dir = a.mkdir(me(), ROOT_INO, "d", 0o755).unwrap().ino;
    let (first, fh) = a.create(me(), dir, "x", 0o644, libc::O_RDWR).unwrap();
    a.release(fh).unwrap();
    let (seen, rpcs) = requests_during(&cluster, || a.lookup(dir, "x").unwrap());
    assert_eq!(
        (seen.ino, rpcs),
        (first.ino, 0),
        "the creator knows the name it created"
    );

    let (seen, rpcs) = requests_during(&cluster, || b.lookup(dir, "x").unwrap());
    assert_eq!(
        (seen.ino, rpcs),
        (first.ino, 1),
        "the first lookup of a name is an RPC"
    );
    let (seen, rpcs) = requests_during(&cluster, || b.lookup(dir, "x").unwrap());
    assert_eq!(
        (seen.ino, rpcs),
        (first.ino, 0),
        "a known name is read one-sidedly"
    );

    // Another client replaces the name: b must see the new file, not its cached inode (which
    // lives on under another name, so its slot stays valid: only the directory's version
    // tells the cached name is stale).
    a.link(first.ino, ROOT_INO, "keep").unwrap();
    let (second, fh) = a.create(me(), dir, "y", 0o600, libc::O_RDWR).unwrap();
    a.release(fh).unwrap();
    a.rename(dir, "y", dir, "x", false).unwrap();
    let seen = b.lookup(dir, "x").unwrap();
    assert_eq!((seen.ino, seen.perm), (second.ino, 0o600));
    a.unlink(dir, "x").unwrap();
    assert!(matches!(
        b.lookup(dir, "x"),
        Err(fs_client::Error::Fs(FsError::NotFound))
    ));
}
