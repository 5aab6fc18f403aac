//! Names no kernel sends, given to the library: the errno Linux gives for the same call on
//! tmpfs, whether the library answers itself (empty, '/', NUL, too long) or the meta server
//! does ('.' and '..', whose answer depends on the parent).

use fs_client::{CitronFs, ROOT_INO};
use testkit::{Cluster, ClusterSpec};

#[test]
fn bad_names_get_linux_errnos_through_the_library() {
    let cluster = Cluster::start(ClusterSpec::default().with_data_servers(1, 16)).unwrap();
    let fs = cluster.client().unwrap();
    let me = CitronFs::process_caller();
    let d = fs.mkdir(me, ROOT_INO, "d", 0o755).unwrap();
    let (f, fh) = fs.create(me, d.ino, "f", 0o644, libc::O_RDWR).unwrap();
    fs.release(fh).unwrap();
    let errno = |e: fs_client::Error| e.errno();

    for dot in [".", ".."] {
        assert_eq!(
            errno(fs.mkdir(me, d.ino, dot, 0o755).unwrap_err()),
            libc::EEXIST
        );
        // open(O_CREAT) of an existing directory, as on Linux: EISDIR, EEXIST with O_EXCL.
        assert_eq!(
            errno(fs.create(me, d.ino, dot, 0o644, libc::O_RDWR).unwrap_err()),
            libc::EISDIR
        );
        assert_eq!(
            errno(
                fs.create(me, d.ino, dot, 0o644, libc::O_RDWR | libc::O_EXCL)
                    .unwrap_err()
            ),
            libc::EEXIST
        );
        assert_eq!(
            errno(fs.symlink(me, d.ino, dot, "f").unwrap_err()),
            libc::EEXIST
        );
        assert_eq!(errno(fs.link(f.ino, d.ino, dot).unwrap_err()), libc::EEXIST);
        assert_eq!(errno(fs.unlink(d.ino, dot).unwrap_err()), libc::EISDIR);
        assert_eq!(
            errno(fs.rename(d.ino, dot, ROOT_INO, "x", false).unwrap_err()),
            libc::EBUSY
        );
        assert_eq!(
            errno(fs.rename(d.ino, "f", ROOT_INO, dot, true).unwrap_err()),
            libc::EEXIST
        );
    }
    assert_eq!(errno(fs.rmdir(d.ino, ".").unwrap_err()), libc::EINVAL);
    assert_eq!(errno(fs.rmdir(d.ino, "..").unwrap_err()), libc::ENOTEMPTY);
    // Looking up '.' and '..' is fine: the directory and its parent.
    assert_eq!(fs.lookup(d.ino, ".").unwrap().ino, d.ino);
    assert_eq!(fs.lookup(d.ino, "..").unwrap().ino, ROOT_INO);

    assert_eq!(
        errno(fs.mkdir(me, d.ino, "", 0o755).unwrap_err()),
        libc::ENOENT
    );
    assert_eq!(errno(fs.unlink(d.ino, "").unwrap_err()), libc::ENOENT);
    for bad in ["a/b", "a\0b"] {
        assert_eq!(
            errno(fs.mkdir(me, d.ino, bad, 0o755).unwrap_err()),
            libc::EINVAL
        );
        assert_eq!(errno(fs.lookup(d.ino, bad).unwrap_err()), libc::EINVAL);
    }
    let long = "n".repeat(256);
    assert_eq!(
        errno(fs.mkdir(me, d.ino, &long, 0o755).unwrap_err()),
        libc::ENAMETOOLONG
    );
    let names: Vec<String> = fs
        .readdir(d.ino, 0, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, vec![".", "..", "f"]);
}
