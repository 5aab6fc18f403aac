//! Ordinary tools through a mount: cp -a, diff -r, tar, find, mv, ln, ln -s, dd, rm -r.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use testkit::Backend;
use testkit::{skip_without_fuse, Cluster, ClusterSpec};

/// Runs `cmd` through `sh -c` in `dir`, panicking with its output if it fails; returns stdout.
fn sh(dir: &Path, cmd: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .current_dir(dir)
        .output()
        .expect("run sh");
    assert!(
        out.status.success(),
        "`{cmd}` failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// A sorted listing of a tree: `find` with type, permissions, size (files) and link target.
fn listing(dir: &Path) -> String {
    let out = sh(
        dir,
        "find . -mindepth 1 \\( -type f -printf '%p f %m %s\\n' \\) -o \
         \\( -type d -printf '%p d %m\\n' \\) -o \\( -type l -printf '%p l %l\\n' \\) | LC_ALL=C sort",
    );
    assert!(!out.is_empty(), "empty listing of {}", dir.display());
    out
}

#[test]
fn ordinary_tools_work_through_a_mount() {
    skip_without_fuse!();
    ordinary_tools(Backend::Shm);
}

/// A shorter round over the tcp software NIC between the client and the servers: cp -a,
/// diff -r, rm -r of a source tree (the tcp fabric is slow in a debug build on a busy machine).
#[test]
fn cp_diff_rm_over_the_tcp_fabric() {
    skip_without_fuse!();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fabric/src");
    let work = tempfile::tempdir().unwrap();
    sh(
        work.path(),
        &format!("cp -a '{}' src", src.canonicalize().unwrap().display()),
    );
    let cluster = Cluster::start(ClusterSpec {
        fabric: Backend::Tcp,
        ..ClusterSpec::default()
    })
    .unwrap();
    let mnt = cluster.mount().unwrap();
    let root = mnt.path();
    sh(root, &format!("cp -a '{}/src' tree", work.path().display()));
    sh(
        root,
        &format!("diff -r '{}/src' tree", work.path().display()),
    );
    assert_eq!(
        listing(&root.join("tree")),
        listing(&work.path().join("src"))
    );
    // `sync` fsyncs every file: flush verbs cross the tcp fabric to the data servers.
    sh(root, "sync tree/*.rs");
    sh(root, "rm -r tree");
    assert_eq!(std::fs::read_dir(root).unwrap().count(), 0);
}

fn ordinary_tools(fabric: Backend) {
    // A snapshot of a source tree (so that edits to the checkout during the test do not
    // matter), with a symlink and an empty directory added.
    let src_repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fabric");
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    sh(
        work.path(),
        &format!("cp -a '{}' src", src_repo.canonicalize().unwrap().display()),
    );
    sh(&src, "ln -s Cargo.toml link-to-manifest && mkdir empty-dir");

    let cluster = Cluster::start(ClusterSpec {
        fabric,
        ..ClusterSpec::default()
    })
    .unwrap();
    let mnt = cluster.mount().unwrap();
    let root = mnt.path();

    // cp -a in, diff -r, the same listing.
    sh(root, &format!("cp -a '{}' tree", src.display()));
    sh(root, &format!("diff -r '{}' tree", src.display()));
    assert_eq!(listing(&root.join("tree")), listing(&src));
    // cp -a keeps modification times.
    let (a, b) = (
        std::fs::metadata(src.join("Cargo.toml")).unwrap(),
        std::fs::metadata(root.join("tree/Cargo.toml")).unwrap(),
    );
    assert_eq!((a.mtime(), a.mtime_nsec()), (b.mtime(), b.mtime_nsec()));

    // tar c | tar x inside the mount, and out of it.
    sh(
        root,
        "mkdir untarred && tar cf - tree | tar xf - -C untarred",
    );
    sh(root, "diff -r tree untarred/tree");
    let out = work.path().join("out");
    std::fs::create_dir(&out).unwrap();
    sh(
        root,
        &format!("tar cf - tree | tar xf - -C '{}'", out.display()),
    );
    sh(work.path(), "diff -r src out/tree");

    // find sees every file.
    let found = sh(root, "find tree -type f | wc -l");
    let expected = sh(&src, "find . -type f | wc -l");
    assert_eq!(found.trim(), expected.trim());

    // mv: a file across directories, a directory, over an existing file.
    sh(root, "mv tree/Cargo.toml untarred/moved.toml");
    sh(root, "mv untarred/tree/src tree-src");
    sh(
        root,
        "echo replaced > victim && mv untarred/moved.toml victim",
    );
    assert_eq!(
        std::fs::read(root.join("victim")).unwrap(),
        std::fs::read(src.join("Cargo.toml")).unwrap()
    );
    assert!(!root.join("untarred/tree/src").exists());
    sh(
        root,
        &format!("diff -r '{}' tree-src", src.join("src").display()),
    );

    // ln and ln -s.
    sh(
        root,
        "ln victim hard && ln -s victim soft && ln -s missing dangling",
    );
    assert_eq!(std::fs::metadata(root.join("victim")).unwrap().nlink(), 2);
    assert_eq!(sh(root, "readlink soft").trim(), "victim");
    assert_eq!(sh(root, "cat soft"), sh(root, "cat hard"));
    assert!(std::fs::metadata(root.join("dangling")).is_err());
    assert!(std::fs::symlink_metadata(root.join("dangling")).is_ok());

    // dd: 8 MiB in 1 MiB blocks, then a write 100 MiB into a hole of another file.
    sh(
        root,
        "dd if=/dev/urandom of=rand8 bs=1M count=8 status=none",
    );
    sh(
        root,
        &format!(
            "dd if=rand8 of='{}' bs=1M status=none",
            out.join("rand8").display()
        ),
    );
    sh(
        root,
        &format!("cmp rand8 '{}'", out.join("rand8").display()),
    );
    assert_eq!(
        std::fs::metadata(root.join("rand8")).unwrap().len(),
        8 << 20
    );
    sh(
        root,
        "printf tail | dd of=holey bs=1M seek=100 conv=notrunc status=none",
    );
    assert_eq!(
        std::fs::metadata(root.join("holey")).unwrap().len(),
        (100 << 20) + 4
    );
    // The hole reads as zeros (a sample of it, through dd skip).
    let zeros = sh(
        root,
        "dd if=holey bs=4096 skip=12345 count=3 status=none | od -An -v -tx1",
    );
    let bytes: Vec<&str> = zeros.split_whitespace().collect();
    assert_eq!(bytes.len(), 3 * 4096);
    assert!(bytes.iter().all(|b| *b == "00"), "the hole is not zeros");
    assert_eq!(sh(root, "dd if=holey bs=1M skip=100 status=none"), "tail");

    // rm -r of everything leaves an empty root.
    sh(
        root,
        "rm -r tree untarred tree-src victim hard soft dangling rand8 holey",
    );
    assert_eq!(std::fs::read_dir(root).unwrap().count(), 0);
}

/// Requests CitronFS has no handler of its own for get the answers a local file system gives:
/// an ioctl ENOTTY (`isatty` is false, as Python's `open` asks of every file), `SEEK_DATA` and
/// `SEEK_HOLE` find the whole file data, `copy_file_range` copies, `poll` finds the file ready.
/// (fuser's defaults answered ENOSYS and logged a warning for each: one per Python `open`.)
#[test]
fn requests_without_a_handler_get_local_answers() {
    use std::os::fd::AsRawFd;
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec::default()).unwrap();
    let mnt = cluster.mount().unwrap();
    let data = testkit::pattern(9, 0, 100_000);
    std::fs::write(mnt.path().join("src"), &data).unwrap();
    let src = std::fs::File::open(mnt.path().join("src")).unwrap();
    let fd = src.as_raw_fd();

    // The unsafe blocks below are plain system calls on descriptors this test owns, with
    // buffers that outlive them.
    // SAFETY: see above.
    assert_eq!(unsafe { libc::isatty(fd) }, 0);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOTTY)
    );
    // SAFETY: see above.
    assert_eq!(unsafe { libc::lseek(fd, 10, libc::SEEK_DATA) }, 10);
    assert_eq!(
        // SAFETY: see above.
        unsafe { libc::lseek(fd, 10, libc::SEEK_HOLE) },
        data.len() as libc::off_t
    );
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: see above.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 1000) }, 1);
    assert_ne!(pfd.revents & libc::POLLIN, 0);

    let dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(mnt.path().join("dst"))
        .unwrap();
    // Explicit offsets: the lseeks above moved the file position.
    let (mut off_in, mut off_out): (libc::loff_t, libc::loff_t) = (0, 0);
    let mut copied = 0usize;
    while copied < data.len() {
        // SAFETY: see above.
        let n = unsafe {
            libc::copy_file_range(
                fd,
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                data.len() - copied,
                0,
            )
        };
        assert!(
            n > 0,
            "copy_file_range: {}",
            std::io::Error::last_os_error()
        );
        copied += n as usize;
    }
    drop(dst);
    assert_eq!(std::fs::read(mnt.path().join("dst")).unwrap(), data);
}
