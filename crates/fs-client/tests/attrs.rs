//! The attribute table (`proto::attrs`): `getattr` reads it one-sidedly — no request reaches
//! the meta server — sees every change another client made (chmod, a write to an open file,
//! truncate, unlink), and falls back to the RPC when a slot is torn, empty or another inode's.
//! The directory-entry table (`proto::dentries`): `lookup` resolves names, found or absent,
//! one-sidedly on every client, right after the directory changed. `readdirplus`.

use fabric::{EndpointExt, RemoteAddr};
use fs_client::{CitronFs, FileKind, FsError, LockScheme, SetAttr, ROOT_INO};
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
fn names_are_resolved_one_sidedly_by_every_client_even_after_their_directory_changed() {
    let cluster = start();
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    assert!(
        b.cluster().dentry_table.is_some(),
        "the meta server publishes an entry table"
    );
    let dir = a.mkdir(me(), ROOT_INO, "d", 0o755).unwrap().ino;
    let (first, fh) = a.create(me(), dir, "x", 0o644, libc::O_RDWR).unwrap();
    a.release(fh).unwrap();
    let (seen, rpcs) = requests_during(&cluster, || b.lookup(dir, "x").unwrap());
    assert_eq!(
        (seen.ino, rpcs),
        (first.ino, 0),
        "a name another client created is resolved with no RPC"
    );
    let (seen, rpcs) = requests_during(&cluster, || b.lookup(ROOT_INO, "d").unwrap());
    assert_eq!((seen.ino, seen.kind, rpcs), (dir, FileKind::Dir, 0));

    // The directory changes (new names, a rename within it): lookups stay one-sided and
    // see every answered change at once.
    for i in 0..20 {
        let (_, fh) = a
            .create(me(), dir, &format!("other{i}"), 0o644, libc::O_RDWR)
            .unwrap();
        a.release(fh).unwrap();
    }
    a.rename(dir, "x", dir, "renamed", false).unwrap();
    let (seen, rpcs) = requests_during(&cluster, || b.lookup(dir, "renamed").unwrap());
    assert_eq!(
        (seen.ino, rpcs),
        (first.ino, 0),
        "the new name, one-sidedly"
    );
    let (gone, rpcs) = requests_during(&cluster, || b.lookup(dir, "x"));
    assert!(
        matches!(gone, Err(fs_client::Error::Fs(FsError::NotFound))),
        "the old name is gone: {gone:?}"
    );
    assert_eq!(rpcs, 0, "an absent name is known absent without an RPC");

    // Replaced by a rename over it: b sees the new file, not the old inode (which lives on
    // under another name, so its attribute slot stays valid).
    a.link(first.ino, ROOT_INO, "keep").unwrap();
    let (second, fh) = a.create(me(), dir, "y", 0o600, libc::O_RDWR).unwrap();
    a.release(fh).unwrap();
    a.rename(dir, "y", dir, "renamed", false).unwrap();
    let (seen, rpcs) = requests_during(&cluster, || b.lookup(dir, "renamed").unwrap());
    assert_eq!((seen.ino, seen.perm, rpcs), (second.ino, 0o600, 0));
    a.unlink(dir, "renamed").unwrap();
    let (gone, rpcs) = requests_during(&cluster, || b.lookup(dir, "renamed"));
    assert!(matches!(gone, Err(fs_client::Error::Fs(FsError::NotFound))));
    assert_eq!(rpcs, 0);

    // A name in a file is ENOTDIR, not ENOENT: the table cannot say, the RPC does.
    let (file, fh) = a.create(me(), dir, "plain", 0o644, libc::O_RDWR).unwrap();
    a.release(fh).unwrap();
    assert!(matches!(
        b.lookup(file.ino, "z"),
        Err(fs_client::Error::Fs(FsError::NotDir))
    ));
    // And `..` is the server's to resolve.
    assert_eq!(b.lookup(dir, "..").unwrap().ino, ROOT_INO);
}

#[test]
fn names_that_overflow_their_slot_are_still_resolved_rightly() {
    // Names too long to be held in a slot are only counted there: lookups of them, and of
    // absent names hashing to the same slot, go to the RPC and get the truth.
    let cluster = start();
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let long = |i: usize| format!("{i:03}-{}", "n".repeat(240));
    let mut inos = Vec::new();
    for i in 0..5 {
        let (attr, fh) = fs
            .create(me(), ROOT_INO, &long(i), 0o644, libc::O_RDWR)
            .unwrap();
        fs.release(fh).unwrap();
        inos.push(attr.ino);
    }
    for (i, &ino) in inos.iter().enumerate() {
        let (seen, rpcs) = requests_during(&cluster, || fs.lookup(ROOT_INO, &long(i)).unwrap());
        assert_eq!((seen.ino, rpcs), (ino, 1));
    }
    for i in 0..5 {
        fs.unlink(ROOT_INO, &long(i)).unwrap();
        assert!(matches!(
            fs.lookup(ROOT_INO, &long(i)),
            Err(fs_client::Error::Fs(FsError::NotFound))
        ));
    }
}

#[test]
fn readdirplus_answers_each_entrys_attributes() {
    let cluster = start();
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let dir = a.mkdir(me(), ROOT_INO, "d", 0o750).unwrap().ino;
    let (f, fh) = a.create(me(), dir, "f", 0o640, libc::O_RDWR).unwrap();
    // Written and still open: the size is the control block's, not the database's.
    a.write(fh, 0, &[1u8; 7000]).unwrap();
    let sub = a.mkdir(me(), dir, "sub", 0o700).unwrap();
    let link = a.symlink(me(), dir, "l", "f").unwrap();
    let mut listed = Vec::new();
    let mut cookie = 0;
    loop {
        let batch = b.readdirplus(dir, cookie, 2).unwrap();
        let Some((last, _)) = batch.last() else { break };
        cookie = last.cookie;
        listed.extend(batch);
    }
    let names: Vec<&str> = listed.iter().map(|(e, _)| e.name.as_str()).collect();
    assert_eq!(names, [".", "..", "f", "sub", "l"]);
    for (entry, attr) in &listed {
        assert_eq!(entry.ino, attr.ino, "{}", entry.name);
        assert_eq!(attr, &b.getattr(entry.ino).unwrap(), "{}", entry.name);
    }
    let by_name = |n: &str| listed.iter().find(|(e, _)| e.name == n).unwrap().1.clone();
    assert_eq!((by_name("f").size, by_name("f").perm), (7000, 0o640));
    assert_eq!(by_name("f").ino, f.ino);
    assert_eq!(
        (by_name("sub").kind, by_name("sub").ino),
        (FileKind::Dir, sub.ino)
    );
    assert_eq!(by_name("l").kind, FileKind::Symlink);
    assert_eq!(by_name("l").ino, link.ino);
    assert_eq!((by_name(".").ino, by_name("..").ino), (dir, ROOT_INO));
    a.release(fh).unwrap();
}
