//! The client library end to end against an in-process cluster (a meta server and data servers
//! on shm): data across chunks and servers, holes, coherence between two clients, truncate,
//! write atomicity under every lock scheme, and a full data server.

use fabric::Backend;
use fs_client::{CitronFs, FileKind, FsError, LockScheme, SetAttr, XattrMode, ROOT_INO};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::{pattern, Cluster, ClusterSpec, TEST_CHUNK_SIZE as CHUNK};

/// A cluster on shm of `servers` data servers of `chunks` chunks of [`CHUNK`] bytes each.
/// Bytes the layout charges for the chunks that hold bytes `[from, to)`.
fn charged(from: u64, to: u64) -> u64 {
    let layout = proto::layout::Layout::new(CHUNK).unwrap();
    let (first, last) = (layout.locate(from).0, layout.locate(to - 1).0);
    (first..=last).map(|k| layout.len(k)).sum()
}

fn start(servers: usize, chunks: u64) -> Cluster {
    Cluster::start(ClusterSpec::default().with_data_servers(servers, chunks)).unwrap()
}

fn me() -> fs_client::Caller {
    CitronFs::process_caller()
}

fn new_file(fs: &CitronFs, name: &str) -> (u64, fs_client::FileHandle) {
    let (attr, fh) = fs
        .create(me(), ROOT_INO, name, 0o644, libc::O_RDWR)
        .unwrap();
    (attr.ino, fh)
}

#[test]
fn data_crosses_chunks_and_servers() {
    let cluster = start(2, 64);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fh) = new_file(&fs, "striped");
    // 5.5 chunks at an unaligned offset: at least 6 chunks over both servers.
    let off = 1000;
    let data = pattern(1, off, (5 * CHUNK + CHUNK / 2) as usize);
    assert_eq!(fs.write(fh, off, &data).unwrap(), data.len());
    assert_eq!(fs.getattr(ino).unwrap().size, off + data.len() as u64);
    assert_eq!(fs.read(fh, off, data.len()).unwrap(), data);
    // Unaligned pieces, and a read past the end is short.
    assert_eq!(
        fs.read(fh, off + 70_000, 100_000).unwrap(),
        &data[70_000..170_000]
    );
    let tail = fs.read(fh, off + data.len() as u64 - 10, 4096).unwrap();
    assert_eq!(tail, &data[data.len() - 10..]);
    assert!(fs
        .read(fh, off + data.len() as u64 + 1, 10)
        .unwrap()
        .is_empty());
    // The first `off` bytes were never written: zeros.
    assert_eq!(fs.read(fh, 0, off as usize).unwrap(), vec![0; off as usize]);
    // Both data servers hold chunks of the file.
    let stats = fs.statfs().unwrap();
    let layout = proto::layout::Layout::new(CHUNK).unwrap();
    let end = off + data.len() as u64;
    let (first, last) = (layout.locate(off).0, layout.locate(end - 1).0);
    let charged: u64 = (first..=last).map(|k| layout.len(k)).sum();
    assert_eq!(
        (stats.total_blocks - stats.free_blocks) * stats.block_size,
        charged
    );
    fs.release(fh).unwrap();

    // Reopened (a new Open on the meta server), the data is still there.
    let fh = fs.open(me(), ino, libc::O_RDONLY).unwrap();
    assert_eq!(fs.read(fh, off, data.len()).unwrap(), data);
    fs.release(fh).unwrap();
}

#[test]
fn holes_read_as_zeros() {
    let cluster = start(2, 64);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fh) = new_file(&fs, "sparse");
    let far = 7 * CHUNK + 123;
    fs.write(fh, far, b"end").unwrap();
    fs.write(fh, 10, b"start").unwrap();
    assert_eq!(fs.getattr(ino).unwrap().size, far + 3);
    let all = fs.read(fh, 0, (far + 3) as usize).unwrap();
    assert_eq!(&all[10..15], b"start");
    assert_eq!(&all[far as usize..], b"end");
    assert!(all[15..far as usize].iter().all(|&b| b == 0));
    // Only the two chunks written were allocated.
    let stats = fs.statfs().unwrap();
    let layout = proto::layout::Layout::new(CHUNK).unwrap();
    let charged = layout.len(0) + layout.len(layout.locate(far).0);
    assert_eq!(
        (stats.total_blocks - stats.free_blocks) * stats.block_size,
        charged
    );
}

/// A buffer reused from read to read (`read_into`, as the FUSE adapter reads) holds an earlier
/// read's bytes: holes must still read as zeros, and what the call says it read must be the
/// file's bytes and no more.
#[test]
fn a_reused_read_buffer_reads_holes_as_zeros() {
    let cluster = start(2, 64);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let (_, fh) = new_file(&fs, "sparse-reused");
    let far = 3 * CHUNK + 5;
    fs.write(fh, far, b"tail").unwrap();
    fs.write(fh, 7, b"head").unwrap();
    let size = (far + 4) as usize;
    // Dirty, and longer than the file: never shrunk, never zeroed by the call.
    let mut buf = vec![0xAB; size + 100];
    let n = fs.read_into(fh, 0, size + 50, &mut buf).unwrap();
    assert_eq!(n, size);
    assert_eq!(&buf[7..11], b"head");
    assert_eq!(&buf[far as usize..size], b"tail");
    assert!(buf[..7].iter().all(|&b| b == 0), "a hole read stale bytes");
    assert!(
        buf[11..far as usize].iter().all(|&b| b == 0),
        "a hole read stale bytes"
    );
    assert_eq!(buf.len(), size + 100, "the buffer was shrunk");
    // A read at the end of the file reads nothing, whatever the buffer holds.
    assert_eq!(fs.read_into(fh, size as u64, 10, &mut buf).unwrap(), 0);
}

/// A read into a slice the caller owns (`read_in_place`, as the FUSE adapter reads over
/// io_uring, into the kernel's answer buffer): the file's bytes at the slice's start, holes as
/// zeros over stale bytes, never more than the slice holds, and the same bytes whether the
/// slice has room for the read's check words after them (read in place) or not (read into a
/// buffer of the library's own and copied).
#[test]
fn a_read_in_place_fills_the_callers_slice() {
    let cluster = start(2, 64);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let (_, fh) = new_file(&fs, "in-place");
    // Data on both servers, with a hole between.
    let data = pattern(3, 0, (CHUNK + 300) as usize);
    fs.write(fh, 0, &data).unwrap();
    let far = 4 * CHUNK + 9;
    fs.write(fh, far, b"tail").unwrap();
    let size = (far + 4) as usize;
    let mut expected = vec![0u8; size];
    expected[..data.len()].copy_from_slice(&data);
    expected[far as usize..].copy_from_slice(b"tail");
    for room in [size + 4096, size] {
        let mut buf = vec![0xCD; room];
        let n = fs.read_in_place(fh, 0, size + 100, &mut buf).unwrap();
        assert_eq!(n, size, "room {room}");
        assert!(buf[..n] == expected[..], "room {room}: wrong bytes");
    }
    // A slice shorter than the read asked for: the read is cut to it.
    let mut short = vec![0xCD; 1000];
    assert_eq!(fs.read_in_place(fh, 50, 5000, &mut short).unwrap(), 1000);
    assert_eq!(&short[..], &expected[50..1050]);
    // At the end of the file: nothing.
    assert_eq!(
        fs.read_in_place(fh, size as u64, 10, &mut short).unwrap(),
        0
    );
}

#[test]
fn two_clients_see_each_others_writes_and_sizes_at_once() {
    let cluster = start(2, 64);
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fa) = new_file(&a, "shared");
    // b has not opened the file: its getattr goes to the meta server, which reads the FCB.
    a.write(fa, 0, b"hello").unwrap();
    assert_eq!(b.lookup(ROOT_INO, "shared").unwrap().size, 5);
    let fb = b.open(me(), ino, libc::O_RDWR).unwrap();
    for round in 0..20u64 {
        let off = round * 10_007;
        let data = pattern(round, off, 20_000);
        a.write(fa, off, &data).unwrap();
        // No RPC, no cache: the other client sees data and size at once.
        assert_eq!(b.read(fb, off, data.len()).unwrap(), data);
        assert_eq!(b.getattr(ino).unwrap().size, off + 20_000);
        let back = pattern(round + 100, off + 5, 7);
        b.write(fb, off + 5, &back).unwrap();
        assert_eq!(a.read(fa, off + 5, 7).unwrap(), back);
    }
    a.release(fa).unwrap();
    b.release(fb).unwrap();
}

#[test]
fn truncate_and_regrow_reads_zeros() {
    let cluster = start(2, 64);
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fa) = new_file(&a, "trunc");
    let fb = b.open(me(), ino, libc::O_RDWR).unwrap();
    let data = pattern(7, 0, (3 * CHUNK + 500) as usize);
    a.write(fa, 0, &data).unwrap();
    // b has the chunk map cached after this read.
    assert_eq!(b.read(fb, 0, data.len()).unwrap(), data);

    let size = |n| SetAttr {
        size: Some(n),
        ..SetAttr::default()
    };
    assert_eq!(a.setattr(me(), ino, size(100)).unwrap().size, 100);
    assert_eq!(b.getattr(ino).unwrap().size, 100);
    assert_eq!(b.read(fb, 0, data.len()).unwrap(), &data[..100]);
    // Regrow by truncate: everything past 100 reads as zeros on both clients.
    a.setattr(me(), ino, size(2 * CHUNK)).unwrap();
    let grown = b.read(fb, 0, (2 * CHUNK) as usize).unwrap();
    assert_eq!(&grown[..100], &data[..100]);
    assert!(grown[100..].iter().all(|&x| x == 0));
    // Regrow by writing far: b's stale chunk map must not be used.
    b.write(fb, 3 * CHUNK, b"tail").unwrap();
    let all = a.read(fa, 0, (3 * CHUNK + 4) as usize).unwrap();
    assert_eq!(&all[..100], &data[..100]);
    assert!(all[100..(3 * CHUNK) as usize].iter().all(|&x| x == 0));
    assert_eq!(&all[(3 * CHUNK) as usize..], b"tail");
    // O_TRUNC on open truncates too.
    let ft = b.open(me(), ino, libc::O_RDWR | libc::O_TRUNC).unwrap();
    assert_eq!(a.getattr(ino).unwrap().size, 0);
    assert!(a.read(fa, 0, 10).unwrap().is_empty());
    for fh in [ft, fb] {
        b.release(fh).unwrap();
    }
    a.release(fa).unwrap();
}

#[test]
fn append_goes_to_the_end_across_clients() {
    let cluster = start(2, 64);
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fa) = new_file(&a, "log");
    a.release(fa).unwrap();
    let fa = a.open(me(), ino, libc::O_WRONLY | libc::O_APPEND).unwrap();
    let fb = b.open(me(), ino, libc::O_WRONLY | libc::O_APPEND).unwrap();
    let threads: Vec<_> = [(Arc::new(a), fa, b'a'), (Arc::new(b), fb, b'b')]
        .into_iter()
        .map(|(fs, fh, c)| {
            std::thread::spawn(move || {
                for _ in 0..50 {
                    fs.write(fh, 0, &[c; 100]).unwrap();
                }
                fs
            })
        })
        .collect();
    let clients: Vec<Arc<CitronFs>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let r = clients[0].open(me(), ino, libc::O_RDONLY).unwrap();
    let all = clients[0].read(r, 0, 20_000).unwrap();
    assert_eq!(all.len(), 100 * 100);
    // Every record whole, none lost.
    for rec in all.chunks(100) {
        assert!(rec.iter().all(|&x| x == rec[0]), "an append was torn");
    }
    assert_eq!(all.iter().filter(|&&x| x == b'a').count(), 5000);
}

/// Two clients, two writer threads each, writing whole records of one uniform tag byte into two
/// overlapping, unaligned ranges that cross a chunk boundary (and so two data servers and many
/// lock units); one reader thread per client reads the first range. With atomic writes the part
/// of A outside B holds one writer's tag throughout, and so does the part inside B.
fn no_torn_records(scheme: LockScheme) {
    const A: (u64, usize) = (CHUNK - 5_001, 10_000);
    const B: (u64, usize) = (CHUNK + 2_999, 9_000);
    let split = (B.0 - A.0) as usize;
    let cluster = Cluster::start(ClusterSpec {
        lock_server: scheme.uses_service(),
        ..ClusterSpec::default().with_data_servers(2, 64)
    })
    .unwrap();
    let clients: Vec<Arc<CitronFs>> = (0..2)
        .map(|_| Arc::new(cluster.connect(scheme).unwrap()))
        .collect();
    let (ino, fh) = new_file(&clients[0], "records");
    clients[0].write(fh, A.0, &vec![1u8; A.1]).unwrap();
    clients[0].release(fh).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for (c, fs) in clients.iter().enumerate() {
        for t in 0..2u8 {
            let fs = fs.clone();
            let tag_base = 2 + (c as u8) * 100 + t * 50;
            threads.push(std::thread::spawn(move || {
                let fh = fs.open(me(), ino, libc::O_RDWR).unwrap();
                for i in 0..150u32 {
                    let tag = tag_base + (i % 50) as u8;
                    let (off, len) = if i % 3 == 2 { B } else { A };
                    fs.write(fh, off, &vec![tag; len]).unwrap();
                }
                fs.release(fh).unwrap();
            }));
        }
        let (fs, stop, reads) = (fs.clone(), stop.clone(), reads.clone());
        threads.push(std::thread::spawn(move || {
            let fh = fs.open(me(), ino, libc::O_RDONLY).unwrap();
            while !stop.load(Ordering::Relaxed) {
                let got = fs.read(fh, A.0, A.1).unwrap();
                assert_eq!(got.len(), A.1);
                let (outside, inside) = got.split_at(split);
                assert!(
                    outside.iter().all(|&x| x == outside[0]),
                    "torn read outside the overlap: {:?}",
                    distinct(outside)
                );
                assert!(
                    inside.iter().all(|&x| x == inside[0]),
                    "torn read inside the overlap: {:?}",
                    distinct(inside)
                );
                reads.fetch_add(1, Ordering::Relaxed);
            }
            fs.release(fh).unwrap();
        }));
    }
    let readers: Vec<_> = [2, 5].into_iter().collect();
    let mut writers = Vec::new();
    let mut reader_threads = Vec::new();
    for (i, t) in threads.into_iter().enumerate() {
        if readers.contains(&i) {
            reader_threads.push(t);
        } else {
            writers.push(t);
        }
    }
    for w in writers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for r in reader_threads {
        r.join().unwrap();
    }
    assert!(reads.load(Ordering::Relaxed) > 0);
    println!(
        "{}: 600 writes, {} reads, none torn",
        scheme.name(),
        reads.load(Ordering::Relaxed)
    );
}

fn distinct(bytes: &[u8]) -> Vec<u8> {
    let mut v = bytes.to_vec();
    v.sort_unstable();
    v.dedup();
    v
}

#[test]
fn no_torn_records_citron() {
    no_torn_records(LockScheme::CITRON);
}

#[test]
fn no_torn_records_mutex() {
    no_torn_records(LockScheme::MUTEX);
}

#[test]
fn no_torn_records_seg() {
    no_torn_records(LockScheme::SEG);
}

#[test]
fn no_torn_records_server() {
    no_torn_records(LockScheme::SERVER);
}

/// A description with parameters: CITRON without the fast path, its growth room (up to 2^16
/// units) set aside by the meta server right after the tree rather than handed out by RPC; the
/// clients learn where from the open reply alone.
#[test]
fn no_torn_records_citron_with_parameters() {
    no_torn_records("citron-nofastpath:256:65536:0:0:room".parse().unwrap());
}

/// A description with parameters: 4-unit segments on 64 words, so that the records' segments
/// wrap onto shared words.
#[test]
fn no_torn_records_seg_with_parameters() {
    no_torn_records("seg:4:64".parse().unwrap());
}

#[test]
fn full_data_server_gives_enospc_and_corrupts_nothing() {
    // 2 servers of 4 chunks: 8 chunks in all.
    let cluster = start(2, 4);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fh) = new_file(&fs, "keep");
    let data = pattern(3, 0, (3 * CHUNK) as usize);
    fs.write(fh, 0, &data).unwrap();
    let (_, big) = new_file(&fs, "big");
    let err = fs
        .write(big, 0, &vec![9u8; (6 * CHUNK) as usize])
        .unwrap_err();
    assert_eq!(err, FsError::NoSpace);
    assert_eq!(err.errno(), libc::ENOSPC);
    // Growing the kept file fails the same way; what it had is intact.
    let err = fs.write(fh, 3 * CHUNK, &vec![9u8; (6 * CHUNK) as usize]);
    assert_eq!(err.unwrap_err(), FsError::NoSpace);
    assert_eq!(fs.getattr(ino).unwrap().size, 3 * CHUNK);
    assert_eq!(fs.read(fh, 0, data.len()).unwrap(), data);
    // What fits still fits.
    fs.write(big, 0, b"small").unwrap();
    assert_eq!(fs.read(big, 0, 5).unwrap(), b"small");
}

#[test]
fn namespace_calls() {
    let cluster = start(1, 16);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let d = fs.mkdir(me(), ROOT_INO, "dir", 0o755).unwrap();
    assert_eq!(d.kind, FileKind::Dir);
    let (f, fh) = fs.create(me(), d.ino, "f", 0o600, libc::O_RDWR).unwrap();
    fs.write(fh, 0, b"abc").unwrap();
    fs.release(fh).unwrap();
    assert_eq!(fs.getattr(f.ino).unwrap().size, 3);
    assert_eq!(
        fs.mkdir(me(), ROOT_INO, "dir", 0o755).unwrap_err(),
        FsError::Exists
    );
    assert_eq!(fs.rmdir(ROOT_INO, "dir").unwrap_err(), FsError::NotEmpty);
    assert_eq!(fs.lookup(d.ino, "nope").unwrap_err(), FsError::NotFound);
    assert_eq!(
        fs.lookup(d.ino, &"x".repeat(256)).unwrap_err(),
        FsError::NameTooLong
    );

    fs.link(f.ino, ROOT_INO, "hard").unwrap();
    assert_eq!(fs.getattr(f.ino).unwrap().nlink, 2);
    let s = fs.symlink(me(), ROOT_INO, "sym", "dir/f").unwrap();
    assert_eq!(fs.readlink(s.ino).unwrap(), b"dir/f");
    fs.rename(d.ino, "f", ROOT_INO, "moved", false).unwrap();
    let names: Vec<String> = fs
        .readdir(ROOT_INO, 0, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    for n in ["dir", "hard", "sym", "moved"] {
        assert!(names.contains(&n.to_string()), "{n} in {names:?}");
    }
    let chmod = SetAttr {
        perm: Some(0o640),
        ..SetAttr::default()
    };
    assert_eq!(fs.setattr(me(), f.ino, chmod).unwrap().perm, 0o640);

    fs.setxattr(f.ino, "user.k", b"v", XattrMode::Create)
        .unwrap();
    assert_eq!(
        fs.setxattr(f.ino, "user.k", b"w", XattrMode::Create)
            .unwrap_err(),
        FsError::Exists
    );
    assert_eq!(fs.getxattr(f.ino, "user.k").unwrap(), b"v");
    assert_eq!(fs.listxattr(f.ino).unwrap(), vec!["user.k".to_string()]);
    fs.removexattr(f.ino, "user.k").unwrap();
    assert_eq!(fs.getxattr(f.ino, "user.k").unwrap_err(), FsError::NoAttr);

    fs.unlink(ROOT_INO, "moved").unwrap();
    fs.unlink(ROOT_INO, "hard").unwrap();
    fs.rmdir(ROOT_INO, "dir").unwrap();
    assert_eq!(
        fs.open(me(), d.ino, libc::O_RDONLY).unwrap_err(),
        FsError::NotFound
    );
}

#[test]
fn many_threads_one_client_large_io() {
    let cluster = start(2, 1024);
    let fs = Arc::new(cluster.connect(LockScheme::CITRON).unwrap());
    let (ino, fh) = new_file(&fs, "par");
    fs.release(fh).unwrap();
    let started = Instant::now();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let fs = fs.clone();
            std::thread::spawn(move || {
                let fh = fs.open(me(), ino, libc::O_RDWR).unwrap();
                let off = t * 9 * CHUNK + 17;
                let data = pattern(t, off, (8 * CHUNK) as usize);
                for _ in 0..5 {
                    fs.write(fh, off, &data).unwrap();
                    assert_eq!(fs.read(fh, off, data.len()).unwrap(), data);
                }
                fs.release(fh).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let elapsed = started.elapsed();
    println!(
        "4 threads x 5 x (512 KiB write + read) in {elapsed:?} ({:.0} MiB/s)",
        40.0 * 0.5 / elapsed.as_secs_f64().max(1e-9) * 1.0
    );
    assert!(elapsed < Duration::from_secs(60));
}

#[test]
fn tcp_fabric_two_clients() {
    let cluster = Cluster::start(ClusterSpec {
        fabric: Backend::Tcp,
        ..ClusterSpec::default().with_data_servers(2, 64)
    })
    .unwrap();
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fa) = new_file(&a, "over-tcp");
    let fb = b.open(me(), ino, libc::O_RDWR).unwrap();
    let data = pattern(11, 333, (3 * CHUNK) as usize);
    a.write(fa, 333, &data).unwrap();
    assert_eq!(b.read(fb, 333, data.len()).unwrap(), data);
    assert_eq!(b.getattr(ino).unwrap().size, 333 + 3 * CHUNK);
    b.release(fb).unwrap();
    a.release(fa).unwrap();
}

/// One data server, so that consecutive chunks can lie back to back in its region and merge
/// into verbs, which the client must cut at the fabric's 16 MiB per verb.
#[test]
fn writes_beyond_one_verb_are_split() {
    let cluster = start(1, 400);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let (_, fh) = new_file(&fs, "huge");
    let data = pattern(13, 100, (20 << 20) + 100);
    assert_eq!(fs.write(fh, 100, &data).unwrap(), data.len());
    assert_eq!(fs.read(fh, 100, data.len()).unwrap(), data);
}

/// Waits until the wall clock is past `t` (file times come from it), so that the next change
/// must give a later time.
fn clock_past(t: fs_client::Timestamp) {
    while fs_client::Timestamp::now() <= t {
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn every_write_moves_mtime_and_ctime_for_every_client() {
    let cluster = start(1, 64);
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fh) = new_file(&a, "times");
    let mut last = a.getattr(ino).unwrap();
    for i in 0..3u64 {
        clock_past(last.mtime.max(last.ctime));
        // Overwrites too, not only writes that extend the file.
        a.write(fh, 0, &[i as u8; 100]).unwrap();
        // The writer and a client without the file open (the meta server merges the FCB).
        let mine = a.getattr(ino).unwrap();
        let theirs = b.getattr(ino).unwrap();
        assert!(
            mine.mtime > last.mtime && mine.ctime > last.ctime,
            "write {i}"
        );
        assert_eq!(
            (theirs.mtime, theirs.ctime),
            (mine.mtime, mine.ctime),
            "write {i}"
        );
        last = mine;
    }
    // An explicit time is kept until the next write, which moves it again.
    let past = fs_client::Timestamp {
        secs: 1_000_000_000,
        nanos: 0,
    };
    let set = SetAttr {
        mtime: Some(fs_client::SetTime::At(past)),
        ..SetAttr::default()
    };
    assert_eq!(a.setattr(me(), ino, set).unwrap().mtime, past);
    assert_eq!(b.getattr(ino).unwrap().mtime, past);
    a.write(fh, 0, b"x").unwrap();
    assert!(b.getattr(ino).unwrap().mtime > last.mtime);
    // The times reach the database on release: a restartless reopen elsewhere sees them.
    let before = a.getattr(ino).unwrap();
    a.release(fh).unwrap();
    assert_eq!(b.getattr(ino).unwrap().mtime, before.mtime);
}

#[test]
fn fallocate_allocates_extends_and_punches() {
    use fs_client::Fallocate;
    let cluster = start(1, 64);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fh) = new_file(&fs, "falloc");
    let used = |fs: &CitronFs| {
        let s = fs.statfs().unwrap();
        (s.total_blocks - s.free_blocks) * s.block_size
    };
    // Mode 0: chunks for the range, and the size to its end.
    fs.fallocate(fh, CHUNK / 2, 2 * CHUNK, Fallocate::Allocate, false)
        .unwrap();
    assert_eq!(fs.getattr(ino).unwrap().size, CHUNK / 2 + 2 * CHUNK);
    assert_eq!(used(&fs), charged(CHUNK / 2, CHUNK / 2 + 2 * CHUNK));
    assert_eq!(
        fs.read(fh, 0, 3 * CHUNK as usize).unwrap(),
        vec![0; (CHUNK / 2 + 2 * CHUNK) as usize]
    );
    // Keep size: the chunks below the size are taken, nothing past the end; the size stays.
    fs.fallocate(fh, 0, 10 * CHUNK, Fallocate::KeepSize, false)
        .unwrap();
    assert_eq!(fs.getattr(ino).unwrap().size, CHUNK / 2 + 2 * CHUNK);
    assert_eq!(used(&fs), charged(0, CHUNK / 2 + 2 * CHUNK));
    // Punch: the range reads zeros, the rest keeps its data, the size stays.
    let data = pattern(7, 0, (2 * CHUNK) as usize);
    fs.write(fh, 0, &data).unwrap();
    fs.fallocate(fh, 100, CHUNK, Fallocate::PunchHole, false)
        .unwrap();
    let got = fs.read(fh, 0, (2 * CHUNK) as usize).unwrap();
    let mut want = data.clone();
    want[100..(100 + CHUNK) as usize].fill(0);
    assert_eq!(got, want);
    assert_eq!(fs.getattr(ino).unwrap().size, CHUNK / 2 + 2 * CHUNK);
    // Zero length is EINVAL, and so is a range past the largest file.
    let err = fs
        .fallocate(fh, 0, 0, Fallocate::Allocate, false)
        .unwrap_err();
    assert_eq!(err.errno(), libc::EINVAL);
    let err = fs
        .fallocate(fh, u64::MAX - 10, 100, Fallocate::Allocate, false)
        .unwrap_err();
    assert_eq!(err.errno(), libc::EINVAL);
    // Modes: the supported three, nothing else.
    assert_eq!(Fallocate::from_mode(0), Some(Fallocate::Allocate));
    assert_eq!(
        Fallocate::from_mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE),
        Some(Fallocate::PunchHole)
    );
    assert_eq!(Fallocate::from_mode(libc::FALLOC_FL_PUNCH_HOLE), None);
    assert_eq!(Fallocate::from_mode(libc::FALLOC_FL_ZERO_RANGE), None);
    assert_eq!(Fallocate::from_mode(libc::FALLOC_FL_COLLAPSE_RANGE), None);
    fs.release(fh).unwrap();
}

/// A hole punched over whole chunks gives them back to the data servers, and a client that
/// had their locations cached never writes into them afterwards: its next lock's batch reads
/// the generation the punch bumped. Before, a punch only overwrote the chunks with zeros and
/// kept them.
#[test]
fn a_punched_hole_gives_its_chunks_back_and_stale_locations_are_dropped() {
    use fs_client::Fallocate;
    let cluster = start(1, 64);
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let used = |fs: &CitronFs| {
        assert!(cluster.meta().wait_reclaimed(Duration::from_secs(10)));
        let s = fs.statfs().unwrap();
        (s.total_blocks - s.free_blocks) * s.block_size
    };
    let (ino, fa) = new_file(&a, "punched");
    let len = 8 * CHUNK;
    let data = pattern(5, 0, len as usize);
    a.write(fa, 0, &data).unwrap();
    let full = used(&a);
    assert_eq!(full, charged(0, len));
    // B reads everything: it now has every chunk's location cached.
    let fb = b.open(me(), ino, libc::O_RDWR).unwrap();
    assert_eq!(b.read(fb, 0, len as usize).unwrap(), data);
    // [CHUNK - 100, 7 CHUNK + 100): chunks [CHUNK, 7 CHUNK) wholly inside, bytes at each end.
    let (from, to) = (CHUNK - 100, 7 * CHUNK + 100);
    a.fallocate(fa, from, to - from, Fallocate::PunchHole, false)
        .unwrap();
    assert_eq!(
        used(&a),
        full - 6 * CHUNK,
        "the six whole chunks given back"
    );
    // What the file holds, as the other client's stat sees it (st_blocks).
    assert_eq!(b.getattr(ino).unwrap().allocated, full - 6 * CHUNK);
    let mut want = data.clone();
    want[from as usize..to as usize].fill(0);
    assert_eq!(a.read(fa, 0, len as usize).unwrap(), want);
    assert_eq!(b.read(fb, 0, len as usize).unwrap(), want);
    // B writes into the hole: new chunks, not the freed ones it had cached (which the
    // reclaimer zeroes and another file may get).
    let fill = pattern(6, CHUNK, (2 * CHUNK) as usize);
    b.write(fb, 2 * CHUNK, &fill).unwrap();
    want[(2 * CHUNK) as usize..(4 * CHUNK) as usize].copy_from_slice(&fill);
    let (_, other) = new_file(&a, "other");
    let other_data = pattern(7, 0, (4 * CHUNK) as usize);
    a.write(other, 0, &other_data).unwrap();
    assert_eq!(used(&a), full - 4 * CHUNK + charged(0, 4 * CHUNK));
    assert_eq!(a.read(fa, 0, len as usize).unwrap(), want);
    assert_eq!(a.read(other, 0, (4 * CHUNK) as usize).unwrap(), other_data);
    // A punch inside one chunk frees nothing and zeroes its bytes.
    a.fallocate(fa, 10, 20, Fallocate::PunchHole, false)
        .unwrap();
    want[10..30].fill(0);
    assert_eq!(b.read(fb, 0, len as usize).unwrap(), want);
    for fh in [fa, other] {
        a.release(fh).unwrap();
    }
    b.release(fb).unwrap();
}

/// Two clients each punch holes in their own half of one file and write the holes full again,
/// as fast as they can, for a while: every punch bumps the file's generation under the other
/// client's feet (its cached chunk locations go stale, its allocations answer `Stale` and are
/// redone), yet neither ever sees an error, zeros where it wrote, or its data in the other
/// half, and the space in use ends where a file without holes would have it.
#[test]
fn punches_and_writes_of_two_clients_in_one_file_stay_in_their_ranges() {
    use fs_client::Fallocate;
    use rand::{Rng, SeedableRng};
    let cluster = start(2, 64);
    let half = 8 * CHUNK;
    let (ino, _) = new_file(&cluster.connect(LockScheme::CITRON).unwrap(), "halves");
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..2u64)
        .map(|who| {
            let fs = cluster.connect(LockScheme::CITRON).unwrap();
            let (stop, rounds) = (stop.clone(), rounds.clone());
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(who);
                let fh = fs.open(me(), ino, libc::O_RDWR).unwrap();
                let base = who * half;
                let mut mine = pattern(who, 0, half as usize);
                fs.write(fh, base, &mine).unwrap();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) || n < 20 {
                    // A punch of at least one whole chunk, ragged at both ends.
                    let from = rng.random_range(0..half - 2 * CHUNK);
                    let to = rng.random_range(from + 2 * CHUNK..=half);
                    fs.fallocate(fh, base + from, to - from, Fallocate::PunchHole, false)
                        .unwrap_or_else(|e| panic!("client {who}: punch: {e}"));
                    mine[from as usize..to as usize].fill(0);
                    let got = fs.read(fh, base, half as usize).unwrap();
                    assert!(got == mine, "client {who}, round {n}: after the punch");
                    let fill = pattern(who * 1000 + n, from, (to - from) as usize);
                    fs.write(fh, base + from, &fill)
                        .unwrap_or_else(|e| panic!("client {who}: write: {e}"));
                    mine[from as usize..to as usize].copy_from_slice(&fill);
                    n += 1;
                }
                rounds.fetch_add(n, Ordering::Relaxed);
                let got = fs.read(fh, base, half as usize).unwrap();
                fs.release(fh).unwrap();
                (got == mine, fs)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    let mut clients = Vec::new();
    for (who, worker) in workers.into_iter().enumerate() {
        let (intact, fs) = worker.join().unwrap();
        assert!(intact, "client {who}: its half at the end");
        clients.push(fs);
    }
    assert!(rounds.load(Ordering::Relaxed) >= 40);
    assert!(cluster.meta().wait_reclaimed(Duration::from_secs(10)));
    let s = clients[0].statfs().unwrap();
    assert_eq!(
        (s.total_blocks - s.free_blocks) * s.block_size,
        charged(0, 2 * half)
    );
}

/// A punch is atomic against reads as a write is: while one client writes a region whole with
/// a new pattern and punches it out again, over and over, another client's reads of the region
/// each see one pattern whole or zeros whole — never a mix, never a freed chunk's old bytes
/// (its cached locations go stale at every punch).
#[test]
fn reads_see_a_punch_whole_or_not_at_all() {
    use fs_client::Fallocate;
    let cluster = start(2, 64);
    let len = 4 * CHUNK;
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fa) = new_file(&a, "flicker");
    a.write(fa, 0, &vec![0; len as usize]).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let b = cluster.connect(LockScheme::CITRON).unwrap();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let fb = b.open(me(), ino, libc::O_RDONLY).unwrap();
            let (mut zeros, mut whole) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) || zeros + whole < 50 {
                let got = b.read(fb, 0, len as usize).unwrap();
                if got.iter().all(|&x| x == 0) {
                    zeros += 1;
                    continue;
                }
                // Which pattern: its seed is in the first 8 bytes, and it must be whole.
                let seed = u64::from_le_bytes(got[..8].try_into().unwrap());
                let mut want = pattern(seed, 0, len as usize);
                want[..8].copy_from_slice(&seed.to_le_bytes());
                assert!(got == want, "a read saw a mix (seed {seed})");
                whole += 1;
            }
            b.release(fb).unwrap();
            (zeros, whole)
        })
    };
    let started = Instant::now();
    let mut rounds = 0u64;
    while started.elapsed() < Duration::from_millis(1500) {
        let seed = rounds + 1;
        let mut data = pattern(seed, 0, len as usize);
        data[..8].copy_from_slice(&seed.to_le_bytes());
        a.write(fa, 0, &data).unwrap();
        a.fallocate(fa, 0, len, Fallocate::PunchHole, false)
            .unwrap();
        rounds += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let (zeros, whole) = reader.join().unwrap();
    assert!(rounds >= 10, "{rounds} rounds");
    assert!(zeros > 0, "the reader never saw the punched state");
    eprintln!("reader: {zeros} zero reads, {whole} whole patterns, {rounds} rounds");
    a.release(fa).unwrap();
}

/// SEEK_DATA and SEEK_HOLE by chunk: written chunks are data, the rest of the file below its
/// size is holes, the end counts as a hole, and nothing is found at or past the end.
#[test]
fn seek_finds_data_and_holes_by_chunk() {
    use fs_client::{Fallocate, SeekTo};
    let cluster = start(1, 64);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fh) = new_file(&fs, "holes");
    let size = 16 * CHUNK;
    let set = SetAttr {
        size: Some(size),
        ..SetAttr::default()
    };
    fs.setattr(me(), ino, set).unwrap();
    // Whole chunks from CHUNK on: [5C, 6C) and [10C, 11C) written, one byte each.
    fs.write(fh, 5 * CHUNK + 10, b"x").unwrap();
    fs.write(fh, 10 * CHUNK + 10, b"y").unwrap();
    let seek = |at: u64, to: SeekTo| fs.seek(fh, at, to).unwrap();
    assert_eq!(seek(0, SeekTo::Data), Some(5 * CHUNK));
    assert_eq!(seek(5 * CHUNK + 50, SeekTo::Data), Some(5 * CHUNK + 50));
    assert_eq!(seek(0, SeekTo::Hole), Some(0));
    assert_eq!(seek(5 * CHUNK, SeekTo::Hole), Some(6 * CHUNK));
    assert_eq!(seek(6 * CHUNK, SeekTo::Data), Some(10 * CHUNK));
    assert_eq!(seek(10 * CHUNK + 1, SeekTo::Hole), Some(11 * CHUNK));
    assert_eq!(seek(11 * CHUNK, SeekTo::Data), None, "no data after");
    assert_eq!(seek(15 * CHUNK, SeekTo::Hole), Some(15 * CHUNK));
    assert_eq!(seek(size, SeekTo::Hole), None, "at the end");
    assert_eq!(seek(size + 1, SeekTo::Data), None, "past the end");
    // A punched chunk is a hole again; a dense tail ends in the end's hole.
    fs.fallocate(fh, 5 * CHUNK, CHUNK, Fallocate::PunchHole, false)
        .unwrap();
    assert_eq!(seek(0, SeekTo::Data), Some(10 * CHUNK));
    fs.write(fh, 11 * CHUNK, &vec![1; (5 * CHUNK) as usize])
        .unwrap();
    assert_eq!(seek(10 * CHUNK, SeekTo::Hole), Some(size));
    fs.release(fh).unwrap();
}

#[test]
fn an_unprivileged_write_clears_set_id_bits() {
    let cluster = start(1, 64);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fh) = new_file(&fs, "setid");
    let chmod = |p: u16| SetAttr {
        perm: Some(p),
        ..SetAttr::default()
    };
    fs.setattr(me(), ino, chmod(0o6755)).unwrap();
    // A privileged writer (CAP_FSETID) clears nothing.
    fs.write_as(fh, 0, b"root", false).unwrap();
    assert_eq!(fs.getattr(ino).unwrap().perm, 0o6755);
    // Another writer clears set-user-ID, and set-group-ID as group-execute is set; the
    // permission bits reach the writer through the file control block (set while open).
    fs.write_as(fh, 0, b"user", true).unwrap();
    assert_eq!(fs.getattr(ino).unwrap().perm, 0o755);
    fs.setattr(me(), ino, chmod(0o6745)).unwrap();
    fs.write_as(fh, 4, b"more", true).unwrap();
    assert_eq!(fs.getattr(ino).unwrap().perm, 0o2745);
    fs.release(fh).unwrap();
}

#[test]
fn fallocate_beyond_one_step_is_done_in_pieces() {
    use fs_client::Fallocate;
    // 25 MiB of chunks: room for a range over the 16 MiB done under one lock.
    let cluster = start(1, 400);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fh) = new_file(&fs, "big");
    let len = 20u64 << 20;
    fs.fallocate(fh, 0, len, Fallocate::Allocate, false)
        .unwrap();
    assert_eq!(fs.getattr(ino).unwrap().size, len);
    let s = fs.statfs().unwrap();
    assert_eq!(
        (s.total_blocks - s.free_blocks) * s.block_size,
        charged(0, len)
    );
    // Data on both sides of a punch across the step boundary.
    let data = pattern(3, 0, len as usize);
    for (i, piece) in data.chunks(4 << 20).enumerate() {
        fs.write(fh, (i as u64) * (4 << 20), piece).unwrap();
    }
    let (from, to) = (1_000_001u64, 19_000_003u64);
    fs.fallocate(fh, from, to - from, Fallocate::PunchHole, false)
        .unwrap();
    let mut want = data;
    want[from as usize..to as usize].fill(0);
    for at in (0..len).step_by(4 << 20) {
        let got = fs.read(fh, at, 4 << 20).unwrap();
        assert!(got == want[at as usize..][..got.len()], "bytes at {at}");
    }
    assert_eq!(fs.getattr(ino).unwrap().size, len);
    fs.release(fh).unwrap();
}

/// A client whose meta server is gone lets go at once: dropping it gives back its open files
/// on its current connection only, and waits for no reconnection. Before, each release
/// reconnected for up to 10 s (`RECONNECT_WAIT`), one wait per open file: a `citronfs mount`
/// of a killed embedded cluster took a minute and more to exit.
#[test]
fn a_client_of_a_stopped_meta_server_drops_at_once() {
    let cluster = start(1, 64);
    let fs = cluster.connect(LockScheme::CITRON).unwrap();
    for i in 0..6 {
        let (_, fh) = new_file(&fs, &format!("open-{i}"));
        fs.write(fh, 0, b"held open").unwrap();
    }
    cluster.shutdown().unwrap();
    let started = Instant::now();
    drop(fs);
    let took = started.elapsed();
    // One refused connection attempt at most, not 10 s per open file.
    assert!(took < Duration::from_secs(5), "dropping took {took:?}");
}

/// Writers of disjoint ranges extend one file at once: a write's SIZE CAS may find another
/// writer's smaller raise, and must then raise again before it releases its lock, so that the
/// size is at or past the end of every write that returned (what a reader that locks after it
/// relies on). Each thread checks that after each of its writes.
#[test]
fn concurrent_extending_writes_never_leave_the_size_behind() {
    const THREADS: u64 = 4;
    const BLOCKS: u64 = 64;
    const BLOCK: u64 = 4096;
    let cluster = start(1, 64);
    let fs = Arc::new(cluster.connect(LockScheme::CITRON).unwrap());
    for round in 0..8 {
        let (ino, fh) = new_file(&fs, &format!("extended-{round}"));
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let fs = fs.clone();
                std::thread::spawn(move || {
                    // Thread t writes blocks t, t + THREADS, ...: the threads leapfrog the size.
                    for b in (t..BLOCKS).step_by(THREADS as usize) {
                        let block = pattern(b, 0, BLOCK as usize);
                        fs.write(fh, b * BLOCK, &block).unwrap();
                        let size = fs.getattr(ino).unwrap().size;
                        assert!(
                            size >= (b + 1) * BLOCK,
                            "round {round} block {b}: size {size}"
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(fs.getattr(ino).unwrap().size, BLOCKS * BLOCK);
        for b in 0..BLOCKS {
            let block = fs.read(fh, b * BLOCK, BLOCK as usize).unwrap();
            assert_eq!(
                block,
                pattern(b, 0, BLOCK as usize),
                "round {round} block {b}"
            );
        }
        fs.release(fh).unwrap();
    }
}

/// Record locks (`fcntl`) through the library, as two clients: one owner number on two
/// clients is two owners; `getlk` reports the holder (its pid only within its client); a wait
/// ends when the holder gives the lock back, or when the caller says stop; a client dropped
/// gives its locks back.
#[test]
fn record_locks_of_two_clients() {
    use fs_client::{Error, RecordClaim, RecordKind, RecordLock};
    let claim = |owner, start, end, kind, pid| RecordClaim {
        owner,
        start,
        end,
        kind,
        pid,
    };
    let cluster = start(1, 16);
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fa) = new_file(&a, "locked");
    let fb = b.open(me(), ino, libc::O_RDWR).unwrap();
    let (write, read) = (Some(RecordKind::Write), Some(RecordKind::Read));
    a.setlk(fa, claim(1, 0, 99, write, 11), None).unwrap();
    let refused = b.setlk(fb, claim(1, 50, 50, read, 22), None).unwrap_err();
    assert_eq!(refused.errno(), libc::EAGAIN, "{refused}");
    let held = RecordLock {
        start: 0,
        end: 99,
        kind: RecordKind::Write,
        pid: 0,
    };
    assert_eq!(b.getlk(fb, 1, 0, 0, RecordKind::Read).unwrap(), Some(held));
    // Another owner of A's own client sees the pid.
    assert_eq!(
        a.getlk(fa, 2, 0, 0, RecordKind::Read).unwrap(),
        Some(RecordLock { pid: 11, ..held })
    );
    assert_eq!(a.getlk(fa, 1, 0, 0, RecordKind::Write).unwrap(), None);
    // A wait told to stop ends with EINTR.
    let stop = || true;
    let stopped = b
        .setlk(fb, claim(1, 0, 0, write, 22), Some(&stop))
        .unwrap_err();
    assert!(matches!(stopped, Error::Interrupted), "{stopped}");
    assert_eq!(stopped.errno(), libc::EINTR);
    // A wait ends when A gives the lock back (at a close).
    let go_on = || false;
    std::thread::scope(|s| {
        let waiter = s.spawn(|| b.setlk(fb, claim(1, 10, 10, write, 22), Some(&go_on)));
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiter.is_finished(), "the wait did not wait");
        a.release_records(fa, 1).unwrap();
        waiter.join().unwrap().unwrap();
    });
    assert_eq!(
        a.setlk(fa, claim(1, 0, 20, read, 11), None)
            .unwrap_err()
            .errno(),
        libc::EAGAIN
    );
    // Locks taken through a handle go with its release.
    let fa2 = a.open(me(), ino, libc::O_RDWR).unwrap();
    a.setlk(fa2, claim(3, 500, 599, write, 11), None).unwrap();
    assert!(b.setlk(fb, claim(1, 550, 550, read, 22), None).is_err());
    a.release(fa2).unwrap();
    b.setlk(fb, claim(1, 550, 550, read, 22), None).unwrap();
    // B's client goes: its locks go with its session.
    drop(b);
    let started = Instant::now();
    while a.setlk(fa, claim(1, 0, 20, write, 11), None).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "B's lock stayed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    a.release(fa).unwrap();
}

/// A client's record locks outlive a restart of the meta server: its heartbeat finds the new
/// session and takes them back during the server's grace period, when no other client's new
/// lock is granted (those are asked again until it ends). Before, the restart dropped them
/// silently and another client took the same bytes at once.
#[test]
fn record_locks_are_taken_back_after_a_meta_server_restart() {
    use fs_client::{RecordClaim, RecordKind};
    let mut cluster = start(1, 16);
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fa) = new_file(&a, "locked");
    let claim = |owner, kind| RecordClaim {
        owner,
        start: 0,
        end: 99,
        kind,
        pid: 1,
    };
    a.setlk(fa, claim(1, Some(RecordKind::Write)), None)
        .unwrap();
    cluster.restart_meta().unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let fb = b.open(me(), ino, libc::O_RDWR).unwrap();
    let asked = Instant::now();
    // F_GETLK waits out the grace too, and then sees A's lock.
    let seen = b.getlk(fb, 2, 0, 0, RecordKind::Read).unwrap();
    assert_eq!(seen.map(|l| (l.start, l.end)), Some((0, 99)));
    let refused = b
        .setlk(fb, claim(2, Some(RecordKind::Read)), None)
        .unwrap_err();
    assert_eq!(refused.errno(), libc::EAGAIN, "{refused}");
    eprintln!("B was refused {:?} after asking", asked.elapsed());
    // A still holds it, and gives it back.
    a.setlk(fa, claim(1, None), None).unwrap();
    b.setlk(fb, claim(2, Some(RecordKind::Read)), None).unwrap();
    for (fs, fh) in [(&a, fa), (&b, fb)] {
        fs.release(fh).unwrap();
    }
}

/// A client holds at most `max_record_locks_per_session` record locks: one more is refused with
/// ENOLCK (the meta server's memory is not the client's to fill); unlocks always pass, and free
/// room.
#[test]
fn record_locks_beyond_the_session_limit_are_refused() {
    use fs_client::{RecordClaim, RecordKind};
    let cluster = Cluster::start(ClusterSpec {
        max_record_locks_per_session: 3,
        ..ClusterSpec::default().with_data_servers(1, 16)
    })
    .unwrap();
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let (_, fa) = new_file(&a, "many");
    // Bytes [10 i, 10 i + 5) apart from each other: one lock each.
    let claim = |i: u64, kind| RecordClaim {
        owner: 1,
        start: 10 * i,
        end: 10 * i + 4,
        kind,
        pid: 1,
    };
    let write = Some(RecordKind::Write);
    for i in 0..3 {
        a.setlk(fa, claim(i, write), None).unwrap();
    }
    let refused = a.setlk(fa, claim(3, write), None).unwrap_err();
    assert_eq!(refused.errno(), libc::ENOLCK, "{refused}");
    a.setlk(fa, claim(0, None), None).unwrap();
    a.setlk(fa, claim(3, write), None).unwrap();
    a.release(fa).unwrap();
}

/// Two clients each holding a lock the other waits for: the wait that closes the cycle fails
/// at once with EDEADLK (as `F_SETLKW` does on a local file system) instead of both waiting
/// until a signal; when its owner gives way, the other wait is granted.
#[test]
fn a_record_lock_wait_that_would_deadlock_fails_with_edeadlk() {
    use fs_client::{RecordClaim, RecordKind};
    let cluster = start(1, 16);
    let a = cluster.connect(LockScheme::CITRON).unwrap();
    let b = cluster.connect(LockScheme::CITRON).unwrap();
    let (ino, fa) = new_file(&a, "crossed");
    let fb = b.open(me(), ino, libc::O_RDWR).unwrap();
    let claim = |start, kind| RecordClaim {
        owner: 1,
        start,
        end: start + 9,
        kind,
        pid: 1,
    };
    let write = Some(RecordKind::Write);
    a.setlk(fa, claim(0, write), None).unwrap();
    b.setlk(fb, claim(10, write), None).unwrap();
    // Waits give up after 20 s, so that a deadlock not found fails the test, not hangs it.
    let started = Instant::now();
    let go_on = || started.elapsed() > Duration::from_secs(20);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        // Each waits for the other's bytes.
        for (name, fs, fh, want) in [("A", &a, fa, 10), ("B", &b, fb, 0)] {
            let tx = tx.clone();
            let go_on = &go_on;
            s.spawn(move || {
                let result = fs.setlk(fh, claim(want, write), Some(go_on));
                tx.send((name, result.map_err(|e| e.errno()))).unwrap();
            });
        }
        let (first, result) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("neither wait ended: no deadlock found");
        assert_eq!(result, Err(libc::EDEADLK), "{first}'s wait");
        // Its owner gives way: the other's wait is granted.
        let (fs, fh, held) = if first == "A" {
            (&a, fa, 0)
        } else {
            (&b, fb, 10)
        };
        fs.setlk(fh, claim(held, None), None).unwrap();
        let (second, result) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_ne!(second, first);
        assert_eq!(result, Ok(()), "{second}'s wait");
    });
    a.release(fa).unwrap();
    b.release(fb).unwrap();
}
