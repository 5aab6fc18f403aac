//! Verbs carried in a lock's own batches (`RangeLock::acquire_with`, `release_with`): values
//! read in the acquisition must be those the previous holder left, and writes carried in the
//! release must be seen by the next holder. Every thread increments one shared word with a
//! plain read (carried by the acquisition) and a plain write (carried by the release), under
//! ranges that all overlap, with delays injected into every endpoint so that acquisitions poll,
//! abort and retry: a value read in a batch other than the granting one, or a write landing
//! after the release, loses an increment, and the final count comes out short. Shared
//! acquisitions (`RangeLock::acquire_mode_with`) carry reads the same way, and must never find
//! a writer's two-step change halfway.

use fabric::{Batch, Completions, Connector, Endpoint, MemServer, RegionId, RemoteAddr};
use lockmgr::chaos::DelayMode;
use lockmgr::schemes::{self, CreateOptions, FixedMemory};
use lockmgr::{ChaosConfig, ChaosConnector, LockMode, LockScheme, RangeLock};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;

const LOCKS: RegionId = RegionId(1);
const DATA: RegionId = RegionId(2);
const THREADS: u64 = 4;
const ITERATIONS: u64 = 150;

/// A lock of `kind` on a fresh server, and `THREADS` threads that each run `thread(t, lock,
/// fallback, rng)` through an endpoint of their own with delays injected before and after its
/// verbs; the word at `result` once every thread is done.
fn threads_under(
    kind: LockScheme,
    result: RemoteAddr,
    thread: impl Fn(u64, &mut dyn RangeLock, &mut dyn Endpoint, &mut SmallRng) + Sync,
) -> u64 {
    let server = MemServer::new();
    server.register(LOCKS, 4 << 20).unwrap();
    server.register(DATA, 4096).unwrap();
    let server = Arc::new(server);
    let mut ep = server.connect().unwrap();
    let mut memory = FixedMemory::new(&mut *ep, RemoteAddr::new(LOCKS, 0), 4 << 20);
    let created = schemes::create(&kind, &CreateOptions::default(), &mut memory)
        .unwrap_or_else(|e| panic!("create {kind}: {e}"));
    let options = created.open_options();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let chaos = ChaosConnector::new(
                server.clone(),
                ChaosConfig {
                    before: 0.2,
                    after: 0.2,
                    max_delay: Duration::from_micros(50),
                    mode: DelayMode::Auto,
                    seed: Some(t),
                },
            );
            let (created, options, thread) = (&created, &options, &thread);
            let server = server.clone();
            s.spawn(move || {
                let mut lock = schemes::open(&created.lock, &chaos, options).unwrap();
                let mut fallback = server.connect().unwrap();
                let mut rng = SmallRng::seed_from_u64(t);
                thread(t, &mut *lock, &mut *fallback, &mut rng);
            });
        }
    });
    fabric::EndpointExt::read_u64(&mut *ep, result).unwrap()
}

fn count_under(kind: LockScheme) -> u64 {
    let counter = RemoteAddr::new(DATA, 0);
    threads_under(kind, counter, |_, lock, fallback, rng| {
        let (mut extra, mut out) = (Batch::new(), Completions::new());
        for _ in 0..ITERATIONS {
            // Every range holds unit 100: all conflict, in the tree and beyond it.
            let l = rng.random_range(0..=100);
            let r = rng.random_range(101..2000);
            extra.clear();
            let read = extra.read(counter, 8);
            let id = lock.acquire_with(l..r, &extra, &mut out, fallback).unwrap();
            let value = out.word(read, 0);
            extra.clear();
            extra.write_u64(counter, value + 1);
            lock.release_with(id, &extra, &mut out, fallback).unwrap();
        }
    })
}

#[test]
fn carried_verbs_see_and_are_seen_by_every_other_holder() {
    for kind in [
        LockScheme::CITRON,
        LockScheme::CITRON_NOFASTPATH,
        "citron:64".parse().unwrap(),
        LockScheme::MUTEX,
        LockScheme::SEG,
        LockScheme::SERVER,
    ] {
        assert_eq!(count_under(kind), THREADS * ITERATIONS, "{kind}");
    }
}

/// Readers (`acquire_mode_with`, shared) carry reads of two words that writers (exclusive) set
/// to one value in two steps under their lock — the first in a batch of its own, the second
/// carried by the release — with delays everywhere: a carried read executed outside the grant,
/// or a shared grant that let a writer in, finds the two words apart. Returns the writers'
/// count (the same increments as `count_under`).
fn shared_readers_under(kind: LockScheme) -> u64 {
    let (first, second) = (RemoteAddr::new(DATA, 0), RemoteAddr::new(DATA, 8));
    threads_under(kind, second, |t, lock, fallback, rng| {
        let (mut extra, mut out) = (Batch::new(), Completions::new());
        // Threads 0 and 1 write, the others read.
        let writer = t < 2;
        let mode = match writer {
            true => LockMode::Exclusive,
            false => LockMode::Shared,
        };
        for _ in 0..ITERATIONS {
            let l = rng.random_range(0..=100);
            let r = rng.random_range(101..2000);
            extra.clear();
            let a = extra.read(first, 8);
            let b = extra.read(second, 8);
            let id = lock
                .acquire_mode_with(l..r, mode, &extra, &mut out, fallback)
                .unwrap();
            let (va, vb) = (out.word(a, 0), out.word(b, 0));
            assert_eq!(
                va,
                vb,
                "{kind}: a {} lock read a writer halfway",
                mode.name()
            );
            extra.clear();
            if writer {
                fabric::EndpointExt::write_u64(fallback, first, va + 1).unwrap();
                extra.write_u64(second, va + 1);
            }
            lock.release_with(id, &extra, &mut out, fallback).unwrap();
        }
    })
}

#[test]
fn carried_reads_under_shared_locks_never_see_a_writer_halfway() {
    for kind in [
        LockScheme::CITRON,
        LockScheme::CITRON_NOFASTPATH,
        "citron:64".parse().unwrap(),
        LockScheme::MUTEX,
        LockScheme::SEG,
        LockScheme::SERVER,
    ] {
        assert_eq!(shared_readers_under(kind), 2 * ITERATIONS, "{kind}");
    }
}
