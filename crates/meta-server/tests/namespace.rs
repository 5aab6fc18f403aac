//! Namespace operations and their POSIX errors, through the RPC service.

mod common;
use common::*;
use proto::rpc::{Request, Response, XattrMode};
use proto::{FileKind, FsError, ROOT_INO};

#[test]
fn create_lookup_and_errors() {
    let cl = start(0, 1, false);
    let mut fs = Fs::connect(&cl);
    let root = fs.getattr(ROOT_INO).unwrap();
    assert_eq!((root.kind, root.nlink), (FileKind::Dir, 2));

    let d = fs.mkdir(ROOT_INO, "d").unwrap();
    assert_eq!(d.nlink, 2);
    assert_eq!(
        fs.getattr(ROOT_INO).unwrap().nlink,
        3,
        "a subdir adds a link to its parent"
    );
    let f = fs.create(d.ino, "f").unwrap();
    assert_eq!(
        (f.kind, f.nlink, f.uid, f.perm),
        (FileKind::File, 1, ME.uid, 0o644)
    );
    assert_eq!(fs.lookup(d.ino, "f").unwrap().ino, f.ino);

    assert_eq!(fs.lookup(d.ino, "nope"), Err(FsError::NotFound));
    assert_eq!(fs.create(d.ino, "f"), Err(FsError::Exists));
    assert_eq!(fs.mkdir(ROOT_INO, "d"), Err(FsError::Exists));
    assert_eq!(fs.create(f.ino, "x"), Err(FsError::NotDir));
    assert_eq!(fs.lookup(f.ino, "x"), Err(FsError::NotDir));
    assert_eq!(
        fs.create(d.ino, &"n".repeat(256)),
        Err(FsError::NameTooLong)
    );
    assert_eq!(
        fs.lookup(d.ino, &"n".repeat(256)),
        Err(FsError::NameTooLong)
    );
    assert!(fs.create(d.ino, &"n".repeat(255)).is_ok());
    assert!(matches!(fs.create(d.ino, "a/b"), Err(FsError::Invalid(_))));
    assert_eq!(fs.getattr(999_999), Err(FsError::NotFound));

    assert_eq!(fs.rmdir(ROOT_INO, "d"), Err(FsError::NotEmpty));
    assert_eq!(fs.unlink(ROOT_INO, "d"), Err(FsError::IsDir));
    assert_eq!(fs.rmdir(d.ino, "f"), Err(FsError::NotDir));
    fs.unlink(d.ino, "f").unwrap();
    fs.unlink(d.ino, &"n".repeat(255)).unwrap();
    assert_eq!(fs.unlink(d.ino, "f"), Err(FsError::NotFound));
    fs.rmdir(ROOT_INO, "d").unwrap();
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 2);
    assert_eq!(fs.getattr(d.ino), Err(FsError::NotFound));
}

#[test]
fn links_symlinks_xattrs_setattr() {
    let cl = start(0, 1, false);
    let mut fs = Fs::connect(&cl);
    let d = fs.mkdir(ROOT_INO, "d").unwrap();
    let f = fs.create(ROOT_INO, "f").unwrap();
    let l = fs
        .attr(Request::Link {
            ino: f.ino,
            new_parent: d.ino,
            new_name: "g".into(),
        })
        .unwrap();
    assert_eq!((l.ino, l.nlink), (f.ino, 2));
    assert_eq!(
        fs.attr(Request::Link {
            ino: d.ino,
            new_parent: ROOT_INO,
            new_name: "dd".into()
        }),
        Err(FsError::Perm)
    );
    assert_eq!(
        fs.attr(Request::Link {
            ino: f.ino,
            new_parent: d.ino,
            new_name: "g".into()
        }),
        Err(FsError::Exists)
    );
    fs.unlink(ROOT_INO, "f").unwrap();
    assert_eq!(fs.getattr(f.ino).unwrap().nlink, 1);

    let s = fs
        .attr(Request::Symlink {
            parent: ROOT_INO,
            name: "s".into(),
            target: "d/g".into(),
            caller: ME,
        })
        .unwrap();
    assert_eq!((s.kind, s.size), (FileKind::Symlink, 3));
    assert_eq!(
        fs.call(Request::Readlink { ino: s.ino }),
        Ok(Response::Data(b"d/g".to_vec()))
    );
    assert!(matches!(
        fs.call(Request::Readlink { ino: d.ino }),
        Err(FsError::Invalid(_))
    ));
    assert_eq!(
        fs.attr(Request::Symlink {
            parent: ROOT_INO,
            name: "long".into(),
            target: "x".repeat(5000),
            caller: ME,
        }),
        Err(FsError::NameTooLong)
    );

    let set = |name: &str, value: &[u8], mode| Request::SetXattr {
        ino: f.ino,
        name: name.into(),
        value: value.to_vec(),
        mode,
    };
    fs.ok(set("user.a", b"1", XattrMode::Either)).unwrap();
    assert_eq!(
        fs.ok(set("user.a", b"2", XattrMode::Create)),
        Err(FsError::Exists)
    );
    assert_eq!(
        fs.ok(set("user.b", b"2", XattrMode::Replace)),
        Err(FsError::NoAttr)
    );
    fs.ok(set("user.a", b"3", XattrMode::Replace)).unwrap();
    fs.ok(set("user.b", b"4", XattrMode::Create)).unwrap();
    assert_eq!(
        fs.call(Request::GetXattr {
            ino: f.ino,
            name: "user.a".into()
        }),
        Ok(Response::Data(b"3".to_vec()))
    );
    assert_eq!(
        fs.call(Request::ListXattr { ino: f.ino }),
        Ok(Response::Names(vec!["user.a".into(), "user.b".into()]))
    );
    fs.ok(Request::RemoveXattr {
        ino: f.ino,
        name: "user.a".into(),
    })
    .unwrap();
    assert_eq!(
        fs.call(Request::GetXattr {
            ino: f.ino,
            name: "user.a".into()
        }),
        Err(FsError::NoAttr)
    );

    // chmod by the owner, chown by a non-root caller refused, by root allowed.
    let mut set = proto::SetAttr {
        perm: Some(0o600),
        ..Default::default()
    };
    let a = fs
        .attr(Request::SetAttr {
            ino: f.ino,
            set: set.clone(),
            caller: ME,
        })
        .unwrap();
    assert_eq!(a.perm, 0o600);
    set = proto::SetAttr {
        uid: Some(0),
        ..Default::default()
    };
    assert_eq!(
        fs.attr(Request::SetAttr {
            ino: f.ino,
            set: set.clone(),
            caller: ME
        }),
        Err(FsError::Perm)
    );
    let root = proto::Caller { uid: 0, gid: 0 };
    assert_eq!(
        fs.attr(Request::SetAttr {
            ino: f.ino,
            set,
            caller: root
        })
        .unwrap()
        .uid,
        0
    );
    let set = proto::SetAttr {
        size: Some(10),
        ..Default::default()
    };
    assert_eq!(
        fs.attr(Request::SetAttr {
            ino: d.ino,
            set,
            caller: root
        }),
        Err(FsError::IsDir)
    );
}

#[test]
fn rename_rules() {
    let cl = start(0, 1, false);
    let mut fs = Fs::connect(&cl);
    let a = fs.mkdir(ROOT_INO, "a").unwrap();
    let b = fs.mkdir(a.ino, "b").unwrap();
    let f = fs.create(ROOT_INO, "f").unwrap();
    let g = fs.create(ROOT_INO, "g").unwrap();
    let e = fs.mkdir(ROOT_INO, "empty").unwrap();

    // file over file replaces; the replaced inode is gone
    fs.rename(ROOT_INO, "f", ROOT_INO, "g", false).unwrap();
    assert_eq!(fs.lookup(ROOT_INO, "g").unwrap().ino, f.ino);
    assert_eq!(fs.getattr(g.ino), Err(FsError::NotFound));
    assert_eq!(fs.lookup(ROOT_INO, "f"), Err(FsError::NotFound));
    // no_replace
    fs.create(ROOT_INO, "h").unwrap();
    assert_eq!(
        fs.rename(ROOT_INO, "g", ROOT_INO, "h", true),
        Err(FsError::Exists)
    );
    // mismatches
    assert_eq!(
        fs.rename(ROOT_INO, "g", ROOT_INO, "empty", false),
        Err(FsError::IsDir)
    );
    assert_eq!(
        fs.rename(ROOT_INO, "empty", ROOT_INO, "g", false),
        Err(FsError::NotDir)
    );
    // dir over non-empty dir
    assert_eq!(
        fs.rename(ROOT_INO, "empty", ROOT_INO, "a", false),
        Err(FsError::NotEmpty)
    );
    // into its own subtree
    assert!(matches!(
        fs.rename(ROOT_INO, "a", b.ino, "x", false),
        Err(FsError::Invalid(_))
    ));
    assert!(matches!(
        fs.rename(ROOT_INO, "a", a.ino, "x", false),
        Err(FsError::Invalid(_))
    ));
    assert_eq!(
        fs.rename(ROOT_INO, "nope", ROOT_INO, "x", false),
        Err(FsError::NotFound)
    );

    // dir over empty dir, across parents: link counts follow
    let root_links = fs.getattr(ROOT_INO).unwrap().nlink;
    fs.rename(a.ino, "b", ROOT_INO, "empty", false).unwrap();
    assert_eq!(fs.getattr(e.ino), Err(FsError::NotFound));
    assert_eq!(fs.lookup(ROOT_INO, "empty").unwrap().ino, b.ino);
    assert_eq!(fs.getattr(a.ino).unwrap().nlink, 2);
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, root_links);
    // ".." follows the move
    fs.rename(ROOT_INO, "empty", a.ino, "b2", false).unwrap();
    assert_eq!(fs.lookup(b.ino, "..").unwrap().ino, a.ino);
    assert_eq!(fs.getattr(a.ino).unwrap().nlink, 3);
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, root_links - 1);
    // hard links to the same inode: rename is a no-op
    fs.attr(Request::Link {
        ino: f.ino,
        new_parent: ROOT_INO,
        new_name: "g3".into(),
    })
    .unwrap();
    fs.rename(ROOT_INO, "g", ROOT_INO, "g3", false).unwrap();
    assert_eq!(fs.lookup(ROOT_INO, "g").unwrap().ino, f.ino);
}

#[test]
fn readdir_cookies_are_stable() {
    let cl = start(0, 1, false);
    let mut fs = Fs::connect(&cl);
    let d = fs.mkdir(ROOT_INO, "d").unwrap();
    for i in 0..10 {
        fs.create(d.ino, &format!("f{i}")).unwrap();
    }
    let page = |fs: &mut Fs, cookie| match fs
        .call(Request::ReadDir {
            ino: d.ino,
            cookie,
            max: 4,
        })
        .unwrap()
    {
        Response::Entries(e) => e,
        other => panic!("{other:?}"),
    };
    let first = page(&mut fs, 0);
    let names: Vec<_> = first.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, [".", "..", "f0", "f1"]);
    assert_eq!(first[1].ino, ROOT_INO);
    // Deleting an entry already listed and adding one does not disturb the listing.
    fs.unlink(d.ino, "f0").unwrap();
    fs.create(d.ino, "zz").unwrap();
    let mut all: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let mut cookie = first.last().unwrap().cookie;
    loop {
        let p = page(&mut fs, cookie);
        if p.is_empty() {
            break;
        }
        cookie = p.last().unwrap().cookie;
        all.extend(p.into_iter().map(|e| e.name));
    }
    let expect: Vec<String> = [
        ".", "..", "f0", "f1", "f2", "f3", "f4", "f5", "f6", "f7", "f8", "f9", "zz",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(all, expect);
    let f1 = fs.lookup(d.ino, "f1").unwrap().ino;
    assert_eq!(
        fs.call(Request::ReadDir {
            ino: f1,
            cookie: 0,
            max: 4
        }),
        Err(FsError::NotDir)
    );
}

/// `SetAttr` as `caller`.
fn set_as(
    fs: &mut Fs,
    ino: proto::Ino,
    set: proto::SetAttr,
    caller: proto::Caller,
) -> Result<proto::Attr, FsError> {
    fs.attr(Request::SetAttr { ino, set, caller })
}

fn perm(p: u16) -> proto::SetAttr {
    proto::SetAttr {
        perm: Some(p),
        ..Default::default()
    }
}

#[test]
fn set_group_id_directories_pass_on_their_group() {
    let cl = start(0, 1, false);
    let mut fs = Fs::connect(&cl);
    let root = proto::Caller { uid: 0, gid: 0 };
    let s = fs.mkdir(ROOT_INO, "s").unwrap();
    let set = proto::SetAttr {
        perm: Some(0o2777),
        gid: Some(100),
        ..Default::default()
    };
    set_as(&mut fs, s.ino, set, root).unwrap();
    // ME (gid ME.gid) creates in it: the directory's group; a subdirectory keeps the bit.
    let f = fs.create(s.ino, "f").unwrap();
    assert_eq!((f.gid, f.perm), (100, 0o644));
    let d = fs.mkdir(s.ino, "d").unwrap();
    assert_eq!((d.gid, d.perm & 0o7777), (100, 0o2755));
    let deeper = fs.mkdir(d.ino, "deeper").unwrap();
    assert_eq!((deeper.gid, deeper.perm), (100, 0o2755));
    // An ordinary directory gives the creator's group.
    let o = fs.mkdir(ROOT_INO, "o").unwrap();
    assert_eq!((o.gid, o.perm), (ME.gid, 0o755));
    assert_eq!(fs.create(o.ino, "f").unwrap().gid, ME.gid);
}

#[test]
fn set_id_bits_are_cleared_by_anyone_and_only_cleared() {
    let cl = start(0, 1, false);
    let mut fs = Fs::connect(&cl);
    let other = proto::Caller {
        uid: ME.uid + 1,
        gid: ME.gid + 1,
    };
    let f = fs.create(ROOT_INO, "f").unwrap();
    set_as(&mut fs, f.ino, perm(0o6777), ME).unwrap();
    // A non-owner may not change the mode, nor add bits ...
    assert_eq!(
        set_as(&mut fs, f.ino, perm(0o6775), other),
        Err(FsError::Perm)
    );
    assert_eq!(
        set_as(&mut fs, f.ino, perm(0o7777), other),
        Err(FsError::Perm)
    );
    // ... but may clear set-ID bits (the kernel asks so on a truncate by a non-owner).
    let a = set_as(&mut fs, f.ino, perm(0o2777), other).unwrap();
    assert_eq!(a.perm, 0o2777);
    assert!(a.ctime >= f.ctime);
    // kill_suidgid: set-user-ID always, set-group-ID with group-execute only.
    let kill = proto::SetAttr {
        kill_suidgid: true,
        ..Default::default()
    };
    set_as(&mut fs, f.ino, perm(0o6777), ME).unwrap();
    assert_eq!(
        set_as(&mut fs, f.ino, kill.clone(), other).unwrap().perm,
        0o777
    );
    set_as(&mut fs, f.ino, perm(0o6767), ME).unwrap();
    assert_eq!(
        set_as(&mut fs, f.ino, kill.clone(), other).unwrap().perm,
        0o2767
    );
    // Directories are left alone.
    let d = fs.mkdir(ROOT_INO, "d").unwrap();
    set_as(&mut fs, d.ino, perm(0o2775), ME).unwrap();
    assert_eq!(set_as(&mut fs, d.ino, kill, other).unwrap().perm, 0o2775);
}

fn exchange(fs: &mut Fs, p: proto::Ino, n: &str, np: proto::Ino, nn: &str) -> Result<(), FsError> {
    fs.ok(Request::Rename {
        parent: p,
        name: n.into(),
        new_parent: np,
        new_name: nn.into(),
        no_replace: false,
        exchange: true,
    })
}

#[test]
fn rename_exchange_swaps_entries_and_directory_links() {
    let cl = start(0, 1, false);
    let mut fs = Fs::connect(&cl);
    let d = fs.mkdir(ROOT_INO, "d").unwrap();
    let e = fs.mkdir(ROOT_INO, "e").unwrap();
    let f = fs.create(ROOT_INO, "f").unwrap();
    let g = fs.create(d.ino, "g").unwrap();
    // Two files in different directories.
    exchange(&mut fs, ROOT_INO, "f", d.ino, "g").unwrap();
    assert_eq!(fs.lookup(ROOT_INO, "f").unwrap().ino, g.ino);
    assert_eq!(fs.lookup(d.ino, "g").unwrap().ino, f.ino);
    // A directory and a file across parents: the directory's `..` and link counts move.
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 4);
    exchange(&mut fs, ROOT_INO, "e", d.ino, "g").unwrap();
    assert_eq!(fs.lookup(d.ino, "g").unwrap().ino, e.ino);
    assert_eq!(fs.lookup(ROOT_INO, "e").unwrap().ino, f.ino);
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 3);
    assert_eq!(fs.getattr(d.ino).unwrap().nlink, 3);
    assert_eq!(fs.lookup(e.ino, "..").unwrap().ino, d.ino);
    // Both must exist.
    assert_eq!(
        exchange(&mut fs, ROOT_INO, "f", ROOT_INO, "nope"),
        Err(FsError::NotFound)
    );
    assert_eq!(
        exchange(&mut fs, ROOT_INO, "nope", ROOT_INO, "e"),
        Err(FsError::NotFound)
    );
    // No directory into its own subtree, either way round.
    assert!(matches!(
        exchange(&mut fs, ROOT_INO, "d", d.ino, "g"),
        Err(FsError::Invalid(_))
    ));
    assert!(matches!(
        exchange(&mut fs, d.ino, "g", ROOT_INO, "d"),
        Err(FsError::Invalid(_))
    ));
    // The same name: nothing changes.
    exchange(&mut fs, ROOT_INO, "d", ROOT_INO, "d").unwrap();
    assert_eq!(fs.lookup(ROOT_INO, "d").unwrap().ino, d.ino);
    // Not with RENAME_NOREPLACE.
    let both = fs.ok(Request::Rename {
        parent: ROOT_INO,
        name: "d".into(),
        new_parent: ROOT_INO,
        new_name: "e".into(),
        no_replace: true,
        exchange: true,
    });
    assert!(matches!(both, Err(FsError::Invalid(_))), "{both:?}");
}
