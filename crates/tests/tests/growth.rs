//! A file grown through a mount from empty to 32 times its initial lock-tree size while other
//! writers and a reader work on it: the CITRON tree scales up (counted in the client's lock
//! statistics) and the data verifies.
//!
//! The meta server sizes a new file's tree to `max(size, 1 MiB) / lock_unit` = 256 units of
//! 4 KiB; the file here grows to 32 MiB (8192 units).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use testkit::{pattern, skip_without_fuse, Cluster, ClusterSpec};

const TARGET: u64 = 32 << 20;
const BLOCK: u64 = 128 << 10;
const SEED: u64 = 42;

#[test]
fn file_grows_past_its_lock_tree_while_writers_run() {
    skip_without_fuse!();
    let cluster = Cluster::start(ClusterSpec {
        data_servers: 2,
        capacity: 40 << 20,
        chunk_size: 1 << 20,
        ..ClusterSpec::default()
    })
    .unwrap();
    let mnt = cluster.mount().unwrap();
    let path = mnt.path().join("growing");
    File::create(&path).unwrap();
    let before = mnt.fs().lock_stats();

    let next_block = Arc::new(AtomicU64::new(0));
    let extenders_done = Arc::new(AtomicBool::new(false));
    let overwrites = Arc::new(AtomicU64::new(0));
    let reads = Arc::new(AtomicU64::new(0));
    let open = || {
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap()
    };

    // Two extending writers claim the next block in turn, so the file grows block by block
    // (with a short-lived hole where the other writer's block is still on its way).
    let extenders: Vec<_> = (0..2)
        .map(|_| {
            let (f, next) = (open(), next_block.clone());
            std::thread::spawn(move || loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let off = k * BLOCK;
                if off >= TARGET {
                    break;
                }
                let data = pattern(SEED, off, BLOCK as usize);
                assert_eq!(f.write_at(&data, off).unwrap(), data.len());
            })
        })
        .collect();
    // Two writers overwrite unaligned ranges inside the current size with the same contents,
    // taking locks all over the growing tree.
    let others: Vec<_> = (0..2u64)
        .map(|t| {
            let (f, done, count) = (open(), extenders_done.clone(), overwrites.clone());
            std::thread::spawn(move || {
                let mut x = 0x5151_u64 + t;
                while !done.load(Ordering::Relaxed) {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let size = f.metadata().unwrap().len();
                    if size < 10_000 {
                        std::thread::yield_now();
                        continue;
                    }
                    let len = 1 + (x >> 50) as usize % 9_000;
                    let off = (x >> 8) % (size - len as u64);
                    let data = pattern(SEED, off, len);
                    assert_eq!(f.write_at(&data, off).unwrap(), len);
                    count.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // A reader: every byte it sees is the pattern's, or zero where no write has landed yet.
    let reader = {
        let (f, done, count) = (open(), extenders_done.clone(), reads.clone());
        std::thread::spawn(move || {
            let mut x = 99u64;
            while !done.load(Ordering::Relaxed) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let size = f.metadata().unwrap().len();
                if size < 100_000 {
                    std::thread::yield_now();
                    continue;
                }
                let len = 1 + (x >> 48) as usize % 60_000;
                let off = (x >> 8) % (size - len as u64);
                let mut got = vec![0u8; len];
                let n = f.read_at(&mut got, off).unwrap();
                let want = pattern(SEED, off, n);
                if let Some(i) = (0..n).find(|&i| got[i] != want[i] && got[i] != 0) {
                    panic!(
                        "byte {} reads {:#04x}, neither the pattern's {:#04x} nor a hole's 0",
                        off + i as u64,
                        got[i],
                        want[i]
                    );
                }
                count.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mut panics = Vec::new();
    for t in extenders {
        panics.extend(t.join().err());
    }
    extenders_done.store(true, Ordering::Relaxed);
    for t in others.into_iter().chain([reader]) {
        panics.extend(t.join().err());
    }
    if let Some(p) = panics.into_iter().next() {
        std::panic::resume_unwind(p);
    }

    // The data verifies, through a fresh open.
    assert_eq!(std::fs::metadata(&path).unwrap().len(), TARGET);
    let f = File::open(&path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    for off in (0..TARGET).step_by(buf.len()) {
        f.read_exact_at(&mut buf, off).unwrap();
        assert!(
            buf == pattern(SEED, off, buf.len()),
            "wrong data in the MiB at {off}"
        );
    }
    drop(f);

    let mut stats = mnt.fs().lock_stats();
    stats.scale_ups -= before.scale_ups;
    println!(
        "grew to {} MiB: {} overwrites, {} reads; locks: {} acquisitions, {} scale-ups, \
         {} spillover, {} aborts ({:?})",
        TARGET >> 20,
        overwrites.load(Ordering::Relaxed),
        reads.load(Ordering::Relaxed),
        stats.acquisitions,
        stats.scale_ups,
        stats.spillover,
        stats.aborts.total(),
        stats.aborts
    );
    assert!(
        stats.scale_ups > 0,
        "the lock tree never scaled up: {stats:?}"
    );
    assert!(overwrites.load(Ordering::Relaxed) > 0);
}
