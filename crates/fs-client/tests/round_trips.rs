//! Fabric round trips per small I/O: a 4 KiB read or overwrite on one data server
//! takes three in sequence — the lock's acquisition (carrying the file's FCB words), the data
//! batch, the lock's release (carrying a write's MTIME raise) — and an extending write's SIZE
//! raise goes beside its data batch (one round trip more, not in sequence). Where the release
//! is posted (CITRON at the host, on tcp) a write's MTIME raise goes beside its data too, and
//! the lock costs one round trip. A write to chunks of two or more replicas takes one more in
//! sequence before its data: it records itself in the file control block (`cut_repair`) —
//! except at the host, where the record's claim and clear ride in the lock's own calls.
//! Counted from the endpoints' own statistics
//! (`CitronFs::io_stats`), which count every endpoint's round trips, overlapping ones too.

use fabric::Backend;
use fs_client::{CitronFs, IoStats, LockScheme, ROOT_INO};
use testkit::{pattern, Cluster, ClusterSpec};

/// How often each I/O is timed: an acquisition that CITRON's inequality (1) aborts on a loaded
/// machine (a thread descheduled mid-round-trip) takes more round trips, legitimately, so the
/// lock's count is the least seen. Only the lock's count varies.
const TRIES: usize = 5;

/// Runs `op` [`TRIES`] times and returns the round trips of the try whose lock took the
/// fewest, checking that each took one locked I/O and `others` round trips besides the lock's.
fn counted(fs: &CitronFs, others: u64, mut op: impl FnMut()) -> IoStats {
    (0..TRIES)
        .map(|_| {
            let before = fs.io_stats();
            op();
            let spent = fs.io_stats().since(&before);
            assert_eq!(spent.locked_ios, 1, "{spent:?}");
            assert_eq!(
                spent.round_trips - spent.lock_round_trips,
                others,
                "{spent:?}"
            );
            spent
        })
        .min_by_key(|s| s.lock_round_trips)
        .expect("tried")
}

/// `(read, overwrite, extending write)` round trips, total and of the lock, under `scheme` on
/// `fabric`, with one data server.
fn small_io_round_trips(scheme: LockScheme, fabric: Backend) -> [(u64, u64); 3] {
    small_io_round_trips_of(scheme, fabric, 1)
}

/// [`small_io_round_trips`] with `replicas` data servers and as many replicas of every chunk:
/// a write's data batches (one per replica's server, posted together in one round) each count.
fn small_io_round_trips_of(
    scheme: LockScheme,
    fabric: Backend,
    replicas: usize,
) -> [(u64, u64); 3] {
    let spec = ClusterSpec {
        lock_server: scheme.uses_service(),
        fabric,
        replicas,
        ..ClusterSpec::default()
    };
    let data = replicas as u64 - 1;
    // Where the release carries no verbs (posted, or an RPC), the MTIME raise goes beside the
    // data batch: one round trip more outside the lock's.
    let posted = fabric == Backend::Tcp && scheme == LockScheme::CITRON;
    // A write to chunks of two or more replicas records itself in the file control block
    // before its data (`cut_repair`: a slot's CAS): one round trip in sequence more — except
    // where the scheme runs an acquisition's carried verbs once granted (CITRON at the host,
    // the server scheme's reads after the grant), and the claim rides there, once a write of
    // the file was seen replicated (the warm-up's).
    let claimed_in_grant = posted || scheme == LockScheme::SERVER;
    let begun = u64::from(replicas > 1 && !claimed_in_grant);
    let beside = u64::from(scheme == LockScheme::SERVER || posted);
    let cluster = Cluster::start(spec.with_data_servers(replicas, 64)).unwrap();
    let fs = cluster.connect(scheme).unwrap();
    let (attr, fh) = fs
        .create(
            CitronFs::process_caller(),
            ROOT_INO,
            "small",
            0o644,
            libc::O_RDWR,
        )
        .unwrap();
    let block = pattern(7, 0, 4096);
    // Warm up: the chunk is allocated, its location cached, the lock handle opened.
    fs.write(fh, 0, &block).unwrap();
    assert_eq!(fs.read(fh, 0, 4096).unwrap(), block);
    let lone = u64::from(scheme == LockScheme::SERVER);
    // Data; the server scheme reads the FCB in a round trip of its own.
    let read = counted(&fs, 1 + lone, || {
        assert_eq!(fs.read(fh, 0, 4096).unwrap(), block)
    });
    let mtime_before = fs.getattr(attr.ino).unwrap().mtime;
    std::thread::sleep(std::time::Duration::from_millis(2));
    let other = pattern(8, 0, 4096);
    // Data, and MTIME beside it where the release cannot carry it.
    let overwrite = counted(&fs, 1 + data + begun + lone + beside, || {
        assert_eq!(fs.write(fh, 0, &other).unwrap(), 4096)
    });
    // The MTIME raise landed; the data too.
    let after = fs.getattr(attr.ino).unwrap();
    assert!(
        after.mtime > mtime_before,
        "{:?} {:?}",
        after.mtime,
        mtime_before
    );
    assert_eq!(after.size, 4096);
    assert_eq!(fs.read(fh, 0, 4096).unwrap(), other);
    // Data, and SIZE beside it (with MTIME where the release cannot carry it); each try
    // extends the file by another block.
    let mut end = 4096;
    let extend = counted(&fs, 2 + data + begun + lone, || {
        assert_eq!(fs.write(fh, end, &block).unwrap(), 4096);
        end += 4096;
        assert_eq!(fs.getattr(attr.ino).unwrap().size, end);
    });
    fs.release(fh).unwrap();
    [read, overwrite, extend].map(|s| (s.round_trips, s.lock_round_trips))
}

#[test]
fn small_io_takes_three_round_trips_under_fabric_schemes() {
    for scheme in [LockScheme::CITRON, LockScheme::MUTEX, LockScheme::SEG] {
        // Uncontended: the lock takes one round trip each way, the FCB riding in them.
        assert_eq!(
            small_io_round_trips(scheme, Backend::Shm),
            [(3, 2), (3, 2), (4, 2)],
            "{scheme}: (total, lock) for a read, an overwrite, an extending write"
        );
    }
}

#[test]
fn the_server_scheme_posts_the_fcb_words_on_its_own() {
    // The lock server's RPC cannot carry fabric verbs: the FCB reads take a round trip of
    // their own after the grant, and a write's MTIME raise goes beside its data batch.
    assert_eq!(
        small_io_round_trips(LockScheme::SERVER, Backend::Shm),
        [(4, 2), (5, 2), (5, 2)]
    );
}

#[test]
fn citron_at_the_host_takes_one_lock_round_trip_per_small_io() {
    // tcp: CITRON acquires at the meta server in one round trip and posts the release; a
    // write's MTIME (and SIZE) raise goes beside its data batch, so a read or a write waits for
    // two round trips in sequence.
    assert_eq!(
        small_io_round_trips(LockScheme::CITRON, Backend::Tcp),
        [(2, 1), (3, 1), (3, 1)]
    );
}

#[test]
fn a_small_write_of_two_replicas_takes_one_data_batch_per_replica() {
    // A read takes one replica; a write's two data batches (one per server) are counted each,
    // posted in the same round (`transfer::exec_data_round`), after the round trip that
    // records the write (`cut_repair`; clearing it rides in the release).
    assert_eq!(
        small_io_round_trips_of(LockScheme::CITRON, Backend::Shm, 2),
        [(3, 2), (5, 2), (6, 2)]
    );
}

#[test]
fn citron_at_the_host_with_two_replicas_records_the_write_in_the_lock_round_trips() {
    // tcp: the host claims the write's record slot right after its grant (carried in the
    // acquire call) and clears it right before the release (carried in the posted release),
    // so a replicated write waits for two round trips in sequence, as one of one replica does:
    // the acquisition, then both data batches and the MTIME raise together.
    assert_eq!(
        small_io_round_trips_of(LockScheme::CITRON, Backend::Tcp, 2),
        [(2, 1), (4, 1), (4, 1)]
    );
}
