//! Chunk allocation over the data servers, out of space, open files' control blocks read
//! one-sidedly, truncate, and the meta region's reuse.

mod common;
use common::*;
use fabric::{EndpointExt, RemoteAddr, ShmConnector};
use lockmgr::LockScheme;
use proto::rpc::{Request, Response};
use proto::{fcb, FabricAddr, FsError, OpenFile, SetAttr, ROOT_INO};
use std::collections::HashSet;

fn open(fs: &mut Fs, ino: u64, scheme: LockScheme) -> Result<OpenFile, FsError> {
    match fs.call(Request::Open { ino, scheme })? {
        Response::Open(o) => Ok(o),
        other => panic!("{other:?}"),
    }
}

fn endpoint(addr: &FabricAddr) -> impl fabric::Endpoint {
    match addr {
        FabricAddr::Shm { dir } => ShmConnector::attach(dir.clone()).unwrap().endpoint(),
        other => panic!("shm expected, got {other:?}"),
    }
}

#[test]
fn allocation_is_striped_and_all_or_nothing() {
    let cl = start(2, 4, false);
    let mut fs = Fs::connect(&cl);
    assert_eq!(fs.info.data_servers.len(), 2);
    assert_eq!(fs.info.chunk_size, CHUNK);
    // Chunks from `full()` on are whole chunks (the first ones of a file are smaller).
    let c0 = full();
    let f = fs.create(ROOT_INO, "f").unwrap();
    let locs = fs.allocate(f.ino, 0, c0, 4).unwrap();
    let servers: HashSet<u32> = locs.iter().map(|l| l.server).collect();
    assert_eq!(servers.len(), 2, "striped over both servers: {locs:?}");
    // Allocating again returns the same chunks.
    assert_eq!(fs.allocate(f.ino, 0, c0, 4).unwrap(), locs);
    assert_eq!(
        fs.chunk_map(f.ino, c0, 6)[..4]
            .iter()
            .map(|l| l.unwrap())
            .collect::<Vec<_>>(),
        locs
    );
    assert_eq!(fs.chunk_map(f.ino, c0 + 4, 2), vec![None, None]);
    // A wrong generation is stale.
    assert_eq!(fs.allocate(f.ino, 7, c0 + 4, 1), Err(FsError::Stale));

    let s = fs.stats();
    let free = |fs: &mut Fs| {
        let s = fs.stats();
        in_chunks(s.free_blocks, &s)
    };
    assert_eq!(
        (in_chunks(s.total_blocks, &s), in_chunks(s.free_blocks, &s)),
        (8, 4)
    );
    // 5 more chunks do not fit in the 4 left: nothing is allocated.
    let g = fs.create(ROOT_INO, "g").unwrap();
    assert_eq!(fs.allocate(g.ino, 0, c0 + 10, 5), Err(FsError::NoSpace));
    assert_eq!(free(&mut fs), 4);
    assert!(fs.chunk_map(g.ino, c0 + 10, 5).iter().all(|l| l.is_none()));
    // 4 fit, falling back to whichever server has room.
    let more = fs.allocate(g.ino, 0, c0 + 10, 4).unwrap();
    assert_eq!(more.len(), 4);
    assert_eq!(free(&mut fs), 0);
    assert_eq!(fs.allocate(g.ino, 0, c0 + 20, 1), Err(FsError::NoSpace));
    // Not even the smallest chunk.
    assert_eq!(fs.allocate(g.ino, 0, 0, 1), Err(FsError::NoSpace));

    // Unlinking a file frees (and zeroes) its chunks for reuse.
    let ep_data = cl
        .data_servers()
        .iter()
        .map(|d| d.fabric().clone())
        .collect::<Vec<_>>();
    let loc = more[0];
    let region = fs.info.data_servers[loc.server as usize].region;
    let mut ep = endpoint(&ep_data[loc.server as usize]);
    let addr = RemoteAddr::new(region, loc.index * layout().unit());
    ep.write(addr, b"dirty data").unwrap();
    fs.unlink(ROOT_INO, "g").unwrap();
    // The reclaimer zeroes and recycles in the background.
    assert!(cl.meta().wait_reclaimed(std::time::Duration::from_secs(10)));
    assert_eq!(free(&mut fs), 4);
    assert_eq!(
        ep.read(addr, 10).unwrap(),
        vec![0u8; 10],
        "freed chunks are zeroed"
    );
    let h = fs.create(ROOT_INO, "h").unwrap();
    assert_eq!(fs.allocate(h.ino, 0, c0, 4).unwrap().len(), 4);
}

#[test]
fn open_fcb_truncate_and_region_reuse() {
    // Every scheme's lock state is opened below, the lock server's included.
    let cl = Cluster::start(ClusterSpec {
        lock_server: true,
        ..spec(2, 8, false)
    })
    .unwrap();
    let mut fs = Fs::connect(&cl);
    let FabricAddr::Shm { dir } = &fs.info.meta_fabric else {
        panic!()
    };
    let mut meta = ShmConnector::attach(dir.clone()).unwrap().endpoint();
    let free_before = cl.meta().meta_free_bytes();

    let f = fs.create(ROOT_INO, "f").unwrap();
    let o = open(&mut fs, f.ino, LockScheme::CITRON).unwrap();
    assert_eq!(meta.read_u64(o.fcb.add(fcb::INO)).unwrap(), f.ino);
    assert_eq!(meta.read_u64(o.fcb.add(fcb::SIZE)).unwrap(), 0);
    assert_eq!(meta.read_u64(o.fcb.add(fcb::GENERATION)).unwrap(), 0);
    assert_ne!(o.lock.base, o.fcb);
    // Reopening reuses the FCB; another scheme is refused while the file is open (its lock
    // would not exclude this one's).
    assert_eq!(open(&mut fs, f.ino, LockScheme::CITRON).unwrap().fcb, o.fcb);
    for other in [LockScheme::MUTEX, LockScheme::SEG, LockScheme::SERVER] {
        assert!(
            matches!(
                open(&mut fs, f.ino, other),
                Err(FsError::SchemeInUse { .. })
            ),
            "{other} opened a file open under citron"
        );
    }
    assert!(fs.info.lock_server.is_some());

    // A client raises SIZE one-sidedly; getattr sees it, release persists it.
    let chunks = fs.allocate(f.ino, 0, 0, 3).unwrap();
    let data_eps: Vec<FabricAddr> = cl
        .data_servers()
        .iter()
        .map(|d| d.fabric().clone())
        .collect();
    let mut eps: Vec<_> = data_eps.iter().map(endpoint).collect();
    let regions: Vec<fabric::RegionId> = fs.info.data_servers.iter().map(|d| d.region).collect();
    let region = |id: u32| regions[id as usize];
    let l = layout();
    let at = |loc: proto::ChunkLoc| RemoteAddr::new(region(loc.server), loc.index * l.unit());
    for (i, loc) in chunks.iter().enumerate() {
        eps[loc.server as usize]
            .write(at(*loc), &vec![0xAB; l.len(i as u64) as usize])
            .unwrap_or_else(|e| panic!("chunk {i}: {e}"));
    }
    let size = l.start(3) - 100;
    assert_eq!(meta.cas(o.fcb.add(fcb::SIZE), 0, size).unwrap(), 0);
    assert_eq!(fs.getattr(f.ino).unwrap().size, size);
    assert_eq!(fs.lookup(ROOT_INO, "f").unwrap().size, size);

    // Truncate to the middle of chunk 1: generation bumps (FCB and attr), chunk 2 is freed,
    // the tail of chunk 1 reads zeros, the head of it keeps its data.
    let half = l.len(1) / 2;
    let new_size = l.start(1) + half;
    let a = fs
        .attr(Request::SetAttr {
            ino: f.ino,
            set: SetAttr {
                size: Some(new_size),
                ..Default::default()
            },
            caller: ME,
        })
        .unwrap();
    assert_eq!((a.size, a.generation), (new_size, 1));
    assert_eq!(meta.read_u64(o.fcb.add(fcb::GENERATION)).unwrap(), 1);
    assert_eq!(meta.read_u64(o.fcb.add(fcb::SIZE)).unwrap(), new_size);
    let map = fs.chunk_map(f.ino, 0, 3);
    assert!(
        map[0].is_some() && map[1].is_some() && map[2].is_none(),
        "{map:?}"
    );
    let c1 = chunks[1];
    let base = at(c1);
    let ep = &mut eps[c1.server as usize];
    assert_eq!(ep.read(base.add(half - 8), 8).unwrap(), vec![0xAB; 8]);
    assert_eq!(ep.read(base.add(half), 8).unwrap(), vec![0; 8]);
    assert_eq!(ep.read(base.add(l.len(1) - 8), 8).unwrap(), vec![0; 8]);
    let c2 = chunks[2];
    // Freed chunks are zeroed by the reclaimer thread, after the free is durable.
    assert!(cl.meta().wait_reclaimed(std::time::Duration::from_secs(10)));
    let mut ep2 = endpoint(&data_eps[c2.server as usize]);
    assert_eq!(
        ep2.read(at(c2).add(l.len(2) - 8), 8).unwrap(),
        vec![0; 8],
        "the freed chunk is zeroed"
    );
    // The old generation is stale for allocation now.
    assert_eq!(fs.allocate(f.ino, 0, 2, 1), Err(FsError::Stale));
    assert!(fs.allocate(f.ino, 1, 2, 1).is_ok());

    // Unlink while open: the inode lives until release; then its chunks come back.
    let free_blocks = fs.stats().free_blocks;
    fs.unlink(ROOT_INO, "f").unwrap();
    assert_eq!(fs.getattr(f.ino).unwrap().nlink, 0);
    assert_eq!(fs.stats().free_blocks, free_blocks);
    fs.ok(Request::Release { ino: f.ino }).unwrap();
    assert_eq!(fs.getattr(f.ino), Err(FsError::NotFound));
    let s = fs.stats();
    assert_eq!(in_chunks(s.free_blocks, &s), 16);
    assert_eq!(
        cl.meta().meta_free_bytes(),
        free_before,
        "FCB and lock memory reused"
    );
    assert_eq!(
        meta.read_u64(o.fcb.add(fcb::INO)).unwrap(),
        0,
        "a freed FCB is marked free"
    );
    // Every other scheme's lock state comes back at release too.
    for scheme in [LockScheme::MUTEX, LockScheme::SEG, LockScheme::SERVER] {
        let h = fs.create(ROOT_INO, &format!("{scheme}")).unwrap();
        open(&mut fs, h.ino, scheme).unwrap();
        fs.ok(Request::Release { ino: h.ino }).unwrap();
        assert_eq!(cl.meta().meta_free_bytes(), free_before, "{scheme}");
    }

    // Size persisted at release for a file that stays.
    let g = fs.create(ROOT_INO, "g").unwrap();
    let o = open(&mut fs, g.ino, LockScheme::CITRON).unwrap();
    meta.cas(o.fcb.add(fcb::SIZE), 0, 12345).unwrap();
    fs.ok(Request::Release { ino: g.ino }).unwrap();
    assert_eq!(fs.getattr(g.ino).unwrap().size, 12345);

    // Scale-up memory for an open file; none for a closed one.
    assert_eq!(
        fs.call(Request::AllocateLockWords {
            ino: g.ino,
            words: 16
        }),
        Err(FsError::Stale)
    );
    let o = open(&mut fs, g.ino, LockScheme::CITRON).unwrap();
    match fs
        .call(Request::AllocateLockWords {
            ino: g.ino,
            words: 16,
        })
        .unwrap()
    {
        Response::Addr(a) => {
            assert_eq!(a.region, o.fcb.region);
            assert_eq!(meta.read(a, 128).unwrap(), vec![0; 128]);
        }
        other => panic!("{other:?}"),
    }
    // A huge open file's lock tree does not fit the 1 MiB meta region: NoSpace, nothing leaked.
    fs.ok(Request::Release { ino: g.ino }).unwrap();
    let free = cl.meta().meta_free_bytes();
    fs.attr(Request::SetAttr {
        ino: g.ino,
        set: SetAttr {
            size: Some(1 << 40),
            ..Default::default()
        },
        caller: ME,
    })
    .unwrap();
    assert_eq!(
        open(&mut fs, g.ino, LockScheme::CITRON),
        Err(FsError::NoSpace)
    );
    assert_eq!(cl.meta().meta_free_bytes(), free);
    assert!(open(&mut fs, g.ino, LockScheme::MUTEX).is_ok());
}

#[test]
fn open_reply_carries_the_lock_as_created() {
    let cl = start(2, 8, false);
    let mut fs = Fs::connect(&cl);
    let f = fs.create(ROOT_INO, "f").unwrap();
    // A plain name: the meta server's choices, every one filled in. The tree covers the
    // 1 MiB minimum in 4 KiB units, grows from memory this server hands out, with the
    // cluster's lease and a T_wait it measured.
    let o = open(&mut fs, f.ino, LockScheme::CITRON).unwrap();
    let LockScheme::Citron(spec) = o.lock.scheme else {
        panic!("{}", o.lock.scheme)
    };
    assert!(spec.t_wait_us > 0, "T_wait not measured: {}", o.lock.scheme);
    assert_eq!(
        o.lock.scheme.to_string(),
        format!("citron:256:{}:2000:{}:alloc", 1u64 << 30, spec.t_wait_us)
    );
    // One lock per scheme name: a later opener asking other parameters gets the same lock, as
    // created, so that the two exclude each other.
    let again = open(&mut fs, f.ino, "citron:4096:0:60000".parse().unwrap()).unwrap();
    assert_eq!(again.lock, o.lock);
    // What a description leaves open is the server's; what it gives, the opener's.
    let e = fs.create(ROOT_INO, "e").unwrap();
    let s = open(&mut fs, e.ino, "seg:4".parse().unwrap()).unwrap();
    assert_eq!(s.lock.scheme.to_string(), "seg:4:1024");
    let g = fs.create(ROOT_INO, "g").unwrap();
    let h = open(
        &mut fs,
        g.ino,
        "citron-nofastpath:4096:0:60000".parse().unwrap(),
    )
    .unwrap();
    let LockScheme::Citron(spec) = h.lock.scheme else {
        panic!("{}", h.lock.scheme)
    };
    assert_eq!((spec.unit_count, spec.lease_ms), (4096, 60_000));
    assert!(!spec.fast_path);
    // A lease that leaves clients no guard before fencing is refused.
    let k = fs.create(ROOT_INO, "k").unwrap();
    assert!(matches!(
        open(&mut fs, k.ino, "citron:0:0:1".parse().unwrap()),
        Err(FsError::Invalid(_))
    ));
}

/// `FreeChunks` (a hole punched over whole chunks): frees only the allocated chunks of the
/// range, bumps the generation in the database and in an open file's control block before
/// answering, and refuses what has no chunks; an empty or absent range changes nothing.
#[test]
fn free_chunks_frees_the_range_and_bumps_the_generation() {
    let cl = start(1, 8, false);
    let mut fs = Fs::connect(&cl);
    let FabricAddr::Shm { dir } = &fs.info.meta_fabric else {
        panic!()
    };
    let mut meta = ShmConnector::attach(dir.clone()).unwrap().endpoint();
    let f = fs.create(ROOT_INO, "f").unwrap();
    let o = open(&mut fs, f.ino, LockScheme::CITRON).unwrap();
    let c0 = full();
    fs.allocate(f.ino, 0, c0, 4).unwrap();
    let free = |fs: &mut Fs| {
        assert!(cl.meta().wait_reclaimed(std::time::Duration::from_secs(10)));
        let s = fs.stats();
        in_chunks(s.free_blocks, &s)
    };
    let before = free(&mut fs);
    let punch = |fs: &mut Fs, first: u64, count: u64| {
        fs.ok(Request::FreeChunks {
            ino: f.ino,
            first,
            count,
        })
    };
    // Nothing allocated there, or nothing asked: no change, no bump.
    punch(&mut fs, c0 + 10, 5).unwrap();
    punch(&mut fs, c0, 0).unwrap();
    assert_eq!(fs.getattr(f.ino).unwrap().generation, 0);
    // The middle two of four (the range runs past the last one allocated).
    punch(&mut fs, c0 + 1, 2).unwrap();
    let map = fs.chunk_map(f.ino, c0, 4);
    assert!(
        map[0].is_some() && map[1].is_none() && map[2].is_none() && map[3].is_some(),
        "{map:?}"
    );
    assert_eq!(fs.getattr(f.ino).unwrap().generation, 1);
    assert_eq!(meta.read_u64(o.fcb.add(fcb::GENERATION)).unwrap(), 1);
    assert_eq!(free(&mut fs), before + 2);
    // A range that runs to the end of the chunk numbers.
    punch(&mut fs, c0 + 3, u64::MAX).unwrap();
    assert!(fs.chunk_map(f.ino, c0 + 3, 1)[0].is_none());
    assert_eq!(free(&mut fs), before + 3);
    // The allocation the punches made stale is refused; the current generation allocates.
    assert_eq!(fs.allocate(f.ino, 0, c0 + 1, 1), Err(FsError::Stale));
    assert!(fs.allocate(f.ino, 2, c0 + 1, 1).is_ok());
    // No chunks to free: a directory, a missing inode.
    let d = match fs
        .call(Request::Mkdir {
            parent: ROOT_INO,
            name: "d".into(),
            perm: 0o755,
            caller: ME,
        })
        .unwrap()
    {
        Response::Attr(a) => a,
        other => panic!("{other:?}"),
    };
    for (ino, want) in [(d.ino, FsError::IsDir), (987_654, FsError::NotFound)] {
        assert_eq!(
            fs.ok(Request::FreeChunks {
                ino,
                first: 0,
                count: 1
            }),
            Err(want)
        );
    }
    fs.ok(Request::Release { ino: f.ino }).unwrap();
}

/// A change made under a range lock (`RequestFrame::expires`) is applied only while its lease
/// has more than `fence_after` left, and refused with `Expired` otherwise, with nothing
/// changed: a late punch or truncate must not free or cut off what the lock's next holder
/// wrote. The caller here has heard nothing from the server yet, so it learns the server's
/// clock with a heartbeat first.
#[test]
fn a_change_under_a_lock_whose_lease_has_run_out_is_refused() {
    use std::time::{Duration, Instant};
    let cl = start(1, 8, false);
    let fence_after = cl.spec().fence_after;
    let mut fs = Fs::connect(&cl);
    let f = fs.create(ROOT_INO, "f").unwrap();
    let o = open(&mut fs, f.ino, LockScheme::CITRON).unwrap();
    let c0 = full();
    fs.allocate(f.ino, 0, c0, 4).unwrap();
    // Written by a client: its size raise in the FCB (a `SetAttr` growing the file would
    // free the chunks past the old size).
    let size = layout().start(c0 + 4);
    endpoint(&fs.info.meta_fabric)
        .write_u64(o.fcb.add(fcb::SIZE), size)
        .unwrap();
    let generation = fs.getattr(f.ino).unwrap().generation;
    let locked = shared_client(&cl);
    let call = |request: Request, expires: Instant| {
        locked
            .call_by(Vec::new(), request, Some(expires))
            .expect("rpc transport")
    };
    let punch = Request::FreeChunks {
        ino: f.ino,
        first: c0,
        count: 2,
    };
    let truncate = Request::SetAttr {
        ino: f.ino,
        set: SetAttr {
            size: Some(0),
            ..SetAttr::default()
        },
        caller: ME,
    };
    // Past, and within the margin.
    for expires in [
        Instant::now() - Duration::from_millis(5),
        Instant::now() + fence_after / 2,
    ] {
        assert_eq!(call(punch.clone(), expires), Err(FsError::Expired));
        assert_eq!(call(truncate.clone(), expires), Err(FsError::Expired));
    }
    let attr = fs.getattr(f.ino).unwrap();
    assert_eq!((attr.size, attr.generation), (size, generation));
    assert!(
        fs.chunk_map(f.ino, c0, 4).iter().all(Option::is_some),
        "a refused punch freed chunks"
    );
    // Well ahead: applied.
    let ahead = Instant::now() + Duration::from_secs(10);
    assert_eq!(call(punch, ahead), Ok(Response::Ok));
    assert!(fs.chunk_map(f.ino, c0, 2).iter().all(Option::is_none));
    assert!(matches!(call(truncate, ahead), Ok(Response::Attr(a)) if a.size == 0));
    fs.ok(Request::Release { ino: f.ino }).unwrap();
}
