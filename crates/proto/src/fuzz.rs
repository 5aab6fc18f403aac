//! Fuzz entries of the meta server's RPC protocol as its clients decode it, and the seed
//! corpus of every message kind that they and `meta_server::rpc`'s entry start from (see
//! `fabric::fuzz` for how entries are run on the stable toolchain and in `fuzz/`).

use crate::error::FsError;
use crate::rpc::{
    recv, HelloAnswer, Request, RequestFrame, Response, ResponseFrame, Role, Welcome, XattrMode,
    MAX_FRAME,
};
use crate::types::*;
use fabric::frame::read_frame;
use fabric::fuzz::{assert_bounded, frame, Pipe};
use fabric::handshake::{self, fuzz_credentials, Hello, Limit, Protocol, Refusal};
use fabric::{RegionId, RemoteAddr};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Fuzz entry: the hello of the RPC protocol as the meta server checks it
/// ([`handshake::fuzz_server_handshake`] with [`Role`]).
pub fn hello_entry(input: &[u8]) {
    handshake::fuzz_server_handshake::<Role>(input, Protocol::Rpc);
}

/// Asserts that `value` survives a round trip through its encoding.
pub fn assert_round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(value: &T) {
    let bytes = match postcard::to_stdvec(value) {
        Ok(bytes) => bytes,
        Err(e) => panic!("a decoded message does not encode: {e}: {value:?}"),
    };
    match postcard::from_bytes::<T>(&bytes) {
        Ok(back) => assert_eq!(&back, value, "a message changed in a round trip"),
        Err(e) => panic!("a re-encoded message does not decode: {e}: {value:?}"),
    }
}

/// Fuzz entry: `input` is what a meta server sends a client: the answers to its hello and to
/// its proof, then response frames, read exactly as [`crate::rpc::Client`] reads them
/// ([`handshake::client_handshake`], its nonce [`handshake::FUZZ_NONCE`], then [`recv`]). Checks: no frame body is allocated
/// beyond the bytes that arrived, every decoded message survives a round trip, and the
/// stream ends in a typed error.
pub fn client_entry(input: &[u8]) {
    let mut pipe = Pipe::new(input);
    let hello = fuzz_client_hello();
    match handshake::client_handshake::<Role, Welcome>(
        &mut pipe,
        &hello,
        &fuzz_credentials(),
        MAX_FRAME,
    ) {
        Ok(welcome) => assert_round_trip(&welcome),
        Err(handshake::HandshakeError::Refused(refusal)) => {
            assert_round_trip(&refusal);
            return;
        }
        Err(_) => return,
    }
    loop {
        // The bound first, on a copy of what is left (recv reads the same way).
        let mut body = Vec::new();
        let _ = read_frame(&mut &pipe.input[..], MAX_FRAME, &mut body);
        assert_bounded(&body, pipe.input.len());
        match recv::<ResponseFrame>(&mut pipe) {
            Ok(response) => assert_round_trip(&response),
            Err(_) => return,
        }
    }
}

fn attr(ino: Ino, kind: FileKind) -> Attr {
    Attr {
        ino,
        kind,
        perm: 0o644,
        nlink: 1,
        uid: 1000,
        gid: 1000,
        rdev: 0,
        size: 4096,
        atime: Timestamp::default(),
        mtime: Timestamp {
            secs: 1_700_000_000,
            nanos: 999_999_999,
        },
        ctime: Timestamp { secs: -1, nanos: 1 },
        crtime: Timestamp::default(),
        generation: 3,
        allocated: 4096,
    }
}

/// One request of every kind, with names and values at the edges the server checks ('.',
/// '..', '/', NUL, long names, huge counts).
pub fn sample_requests() -> Vec<Request> {
    let caller = Caller {
        uid: 1000,
        gid: 1000,
    };
    let mut requests = vec![
        Request::Heartbeat,
        Request::Lookup {
            parent: ROOT_INO,
            name: "f".into(),
        },
        Request::GetAttr { ino: ROOT_INO },
        Request::SetAttr {
            ino: 2,
            set: SetAttr {
                size: Some(1 << 20),
                mtime: Some(SetTime::Now),
                atime: Some(SetTime::At(Timestamp::default())),
                ..SetAttr::default()
            },
            caller,
        },
        Request::Mkdir {
            parent: ROOT_INO,
            name: "d".into(),
            perm: 0o755,
            caller,
        },
        Request::Symlink {
            parent: ROOT_INO,
            name: "s".into(),
            target: "f".into(),
            caller,
        },
        Request::Link {
            ino: 2,
            new_parent: ROOT_INO,
            new_name: "g".into(),
        },
        Request::Rename {
            parent: ROOT_INO,
            name: "f".into(),
            new_parent: ROOT_INO,
            new_name: "..".into(),
            no_replace: true,
            exchange: false,
        },
        Request::Rename {
            parent: ROOT_INO,
            name: "f".into(),
            new_parent: ROOT_INO,
            new_name: "g".into(),
            no_replace: false,
            exchange: true,
        },
        Request::Readlink { ino: 3 },
        Request::ReadDir {
            ino: ROOT_INO,
            cookie: 0,
            max: u32::MAX,
        },
        Request::ReadDirPlus {
            ino: ROOT_INO,
            cookie: 3,
            max: 128,
        },
        Request::Statfs,
        Request::SetXattr {
            ino: 2,
            name: "user.a".into(),
            value: vec![7; 100],
            mode: XattrMode::Create,
        },
        Request::GetXattr {
            ino: 2,
            name: "user.a".into(),
        },
        Request::ListXattr { ino: 2 },
        Request::RemoveXattr {
            ino: 2,
            name: "user.a".into(),
        },
        Request::Open {
            ino: 2,
            scheme: lockmgr::LockScheme::CITRON,
        },
        Request::Release { ino: 2 },
        Request::ChunkMap {
            ino: 2,
            first: 0,
            count: u64::MAX,
        },
        Request::AllocateChunks {
            ino: 2,
            generation: 3,
            first: u64::MAX - 1,
            count: 4,
        },
        Request::FreeChunks {
            ino: 2,
            first: u64::MAX - 1,
            count: 4,
        },
        Request::GetLk {
            ino: 2,
            owner: 7,
            start: 10,
            end: u64::MAX,
            kind: crate::records::RecordKind::Write,
        },
        Request::SetLk {
            ino: 2,
            claim: crate::records::RecordClaim {
                owner: 7,
                start: u64::MAX,
                end: 3,
                kind: Some(crate::records::RecordKind::Read),
                pid: 42,
            },
            wait_ms: u32::MAX,
            reclaim: true,
        },
        Request::Fsync { ino: 2 },
        Request::AllocateLockWords {
            ino: 2,
            words: u64::MAX / 4,
        },
        Request::Fence,
        Request::HolderGone {
            owner: u64::MAX,
            stopped: true,
        },
        Request::AwaitRevocations { known: 0 },
        Request::Cluster,
        Request::Status,
        Request::Fsck(crate::fsck::FsckOptions {
            repair: false,
            at_rest: true,
        }),
        Request::Create {
            parent: ROOT_INO,
            name: "f".into(),
            perm: 0o644,
            caller,
            scheme: lockmgr::LockScheme::CITRON,
        },
    ];
    for name in ["f", ".", "..", "", "a/b", "a\0b", &"n".repeat(300)] {
        requests.push(Request::Mknod {
            parent: ROOT_INO,
            name: name.into(),
            kind: FileKind::File,
            perm: 0o644,
            rdev: 0,
            caller,
        });
        requests.push(Request::Unlink {
            parent: ROOT_INO,
            name: name.into(),
        });
        requests.push(Request::Rmdir {
            parent: ROOT_INO,
            name: name.into(),
        });
    }
    requests
}

/// The hello of the fuzz entries' client: a client role, the nonce [`handshake::FUZZ_NONCE`].
fn fuzz_client_hello() -> Hello<Role> {
    let mut hello = Hello::new(
        Protocol::Rpc,
        &fuzz_credentials(),
        0,
        Role::Client {
            host: "fuzz".into(),
            pid: 1,
        },
    );
    hello.nonce = handshake::FUZZ_NONCE;
    hello
}

/// Framed request streams as a meta server reads them: a client's hello and proof (for a
/// server drawing [`handshake::FUZZ_NONCE`]), then requests.
pub fn request_seeds() -> Vec<Vec<u8>> {
    let hello = handshake::fuzz_handshake(&fuzz_client_hello());
    let requests: Vec<Vec<u8>> = sample_requests()
        .into_iter()
        .enumerate()
        .map(|(id, request)| {
            let body = postcard::to_stdvec(&RequestFrame {
                id: id as u64,
                // Some seeds carry releases ahead of their request.
                release_first: if id % 2 == 0 { Vec::new() } else { vec![2] },
                request,
                // Some carry a deadline (a change under a range lock), one long past.
                expires: [None, Some(0), Some(u64::MAX)][id % 3],
            })
            .expect("encodes");
            frame(&body)
        })
        .collect();
    let mut seeds: Vec<Vec<u8>> = requests
        .iter()
        .map(|r| [hello.clone(), r.clone()].concat())
        .collect();
    // Everything in one stream, and a data server's hello.
    seeds.push([vec![hello.clone()], requests].concat().concat());
    let mut ds = Hello::new(
        Protocol::Rpc,
        &fuzz_credentials(),
        0,
        Role::DataServer {
            fabric: FabricAddr::Tcp {
                addr: "127.0.0.1:1".into(),
            },
            region: RegionId(1),
            region_bytes: 1 << 20,
            name: "ds".into(),
            incarnation: 0x1234,
            zone: Some("rack-1".into()),
        },
    );
    ds.nonce = handshake::FUZZ_NONCE;
    seeds.push(handshake::fuzz_handshake(&ds));
    seeds
}

/// A cluster status with every field set, optional ones both ways; also what the renderers of
/// `citronfs status` are tested on.
pub fn sample_status() -> crate::status::ClusterStatus {
    use crate::status::*;
    ClusterStatus {
        cluster: "citronfs".into(),
        protocols: ProtocolVersion::all(),
        meta: MetaStatus {
            uptime_ms: 3_723_004,
            state_dir: "/var/lib/citronfs/meta".into(),
            fabric: "tcp:10.0.0.1:7100".into(),
            requests: 12_345,
            inodes: 42,
            chunk_size: 1 << 20,
            fence_after_ms: 100,
            session_lease_ms: 10_000,
            database: DatabaseStatus {
                committed: 900,
                written: 899,
                last_flush_ago_ms: Some(1_500),
                failed: None,
            },
        },
        data_servers: vec![
            DataServerStatus {
                id: 0,
                name: "ds0".into(),
                zone: Some("rack-a".into()),
                address: "tcp:10.0.0.2:7200".into(),
                incarnation: 7,
                live: true,
                chunks: 64,
                capacity_bytes: 64 << 20,
                free_bytes: 60 << 20,
            },
            DataServerStatus {
                id: 1,
                name: "ds1".into(),
                zone: None,
                address: "tcp:10.0.0.3:7200".into(),
                incarnation: u64::MAX,
                live: false,
                chunks: 0,
                capacity_bytes: 0,
                free_bytes: 0,
            },
        ],
        sessions: vec![
            SessionStatus {
                id: 1_700_000_000_000_001,
                host: "node1".into(),
                pid: 4242,
                peer: "10.0.0.5:50000".into(),
                age_ms: 90_000,
                silent_ms: 20,
                fenceable: false,
                open_files: 1,
                caller: false,
            },
            SessionStatus {
                id: 1_700_000_000_000_002,
                host: "citronfs-status".into(),
                pid: 1,
                peer: "local".into(),
                age_ms: 0,
                silent_ms: 0,
                fenceable: true,
                open_files: 0,
                caller: true,
            },
        ],
        fenced_sessions: 3,
        open_file_count: 1,
        open_files: vec![OpenFileStatus {
            ino: 2,
            sessions: 1,
            scheme: "citron".into(),
            lock_calls: 17,
        }],
        rereplication: RereplicationStatus {
            running: true,
            done: 12,
            left: 30,
            failed: 1,
            bytes: 12 << 20,
            kib_per_s: 65_536,
            total_done: 40,
            limit_mib_per_s: 128,
            next_pass_in_ms: None,
        },
    }
}

/// A cluster description with every field set.
fn sample_cluster() -> ClusterInfo {
    ClusterInfo {
        session: 9,
        meta_fabric: FabricAddr::Shm {
            dir: "/dev/shm/x".into(),
        },
        meta_region: RegionId(0),
        data_servers: vec![DataServerInfo {
            id: 0,
            fabric: FabricAddr::Tcp {
                addr: "10.0.0.2:7701".into(),
            },
            region: RegionId(1),
            chunks: 16,
            incarnation: 7,
            live: true,
        }],
        chunk_size: 1 << 20,
        lock_unit: 4096,
        session_lease_ms: 10_000,
        fence_after_ms: 100,
        lock_server: Some("10.0.0.1:7702".into()),
        layout_epoch: 4,
        attr_table: Some(crate::attrs::AttrTableRef {
            base: fabric::RemoteAddr::new(fabric::RegionId(0), 4096),
            slots: 1024,
        }),
        dentry_table: Some(crate::dentries::DentryTableRef {
            base: fabric::RemoteAddr::new(fabric::RegionId(0), 1 << 20),
            slots: 2048,
        }),
        local_rpc: Some("/dev/shm/x/meta.sock".into()),
    }
}

/// One response of every kind, and errors of every kind.
pub fn sample_responses() -> Vec<Result<Response, FsError>> {
    let mut out: Vec<Result<Response, FsError>> = vec![
        Ok(Response::Ok),
        Ok(Response::Attr(attr(2, FileKind::File))),
        Ok(Response::Entries(vec![DirEntry {
            ino: 2,
            kind: FileKind::Dir,
            name: "..".into(),
            cookie: 2,
        }])),
        Ok(Response::EntriesPlus(vec![(
            DirEntry {
                ino: 5,
                kind: FileKind::File,
                name: "f".into(),
                cookie: 3,
            },
            attr(5, FileKind::File),
        )])),
        Ok(Response::Data(vec![1, 2, 3])),
        Ok(Response::Names(vec!["user.a".into()])),
        Ok(Response::Stats(FsStats {
            block_size: 4096,
            total_blocks: 10,
            free_blocks: 5,
            inodes: 3,
            free_inodes: 5,
        })),
        Ok(Response::Open(OpenFile {
            attr: attr(2, FileKind::File),
            fcb: RemoteAddr::new(RegionId(0), 64),
            lock: lockmgr::schemes::LockRef {
                scheme: lockmgr::LockScheme::CITRON,
                base: RemoteAddr::new(RegionId(0), 128),
            },
        })),
        Ok(Response::Chunks(vec![
            None,
            Some(Replicas::one(ChunkLoc {
                server: 1,
                index: 9,
            })),
            Some(
                Replicas::new(&[
                    ChunkLoc {
                        server: 1,
                        index: 9,
                    },
                    ChunkLoc {
                        server: 0,
                        index: 3,
                    },
                ])
                .expect("two servers"),
            ),
        ])),
        Ok(Response::Addr(RemoteAddr::new(RegionId(0), 4096))),
        Ok(Response::Revocations {
            epoch: 2,
            sessions: vec![5, 6],
        }),
        Ok(Response::Heartbeat { layout_epoch: 3 }),
        Ok(Response::Cluster(Box::new(sample_cluster()))),
        Ok(Response::Status(Box::new(sample_status()))),
        Ok(Response::RecordLock(None)),
        Ok(Response::RecordLock(Some(crate::records::RecordLock {
            start: 5,
            end: u64::MAX,
            kind: crate::records::RecordKind::Read,
            pid: 77,
        }))),
    ];
    out.extend(
        [
            FsError::NotFound,
            FsError::Exists,
            FsError::NotEmpty,
            FsError::NotDir,
            FsError::IsDir,
            FsError::NameTooLong,
            FsError::NoSpace,
            FsError::Access,
            FsError::Perm,
            FsError::Invalid("bad".into()),
            FsError::NoAttr,
            FsError::Range,
            FsError::Stale,
            FsError::NotSupported,
            FsError::Io("gone".into()),
            FsError::Refused("no".into()),
            FsError::Busy,
            FsError::TooManyOpen { limit: 8 },
            FsError::TooManySessions { limit: 8 },
            FsError::SchemeInUse {
                open_with: "mutex".into(),
                asked: "citron".into(),
            },
            FsError::Lost("chunk".into()),
            FsError::Unavailable("no data server".into()),
            FsError::Expired,
            FsError::WouldBlock,
            FsError::InGrace,
            FsError::NoLocks { limit: 65_536 },
            FsError::Deadlock,
        ]
        .into_iter()
        .map(Err),
    );
    out
}

/// Framed streams as a client reads them: the challenge that [`client_entry`]'s client
/// verifies, a welcome (or a refusal), then responses; and refusals of the hello.
pub fn response_seeds() -> Vec<Vec<u8>> {
    let challenge = handshake::fuzz_challenge(&fuzz_client_hello());
    let info = sample_cluster();
    let answers: Vec<HelloAnswer> = vec![
        Ok(Welcome::Client(info)),
        Ok(Welcome::DataServer { id: 3 }),
        Err(Refusal::BadToken {
            cluster: "fuzz".into(),
        }),
        Err(Refusal::Limit {
            limit: Limit::Sessions,
            value: 4,
        }),
    ];
    let answers: Vec<Vec<u8>> = answers
        .iter()
        .map(|a| {
            [
                challenge.clone(),
                frame(&postcard::to_stdvec(a).expect("encodes")),
            ]
            .concat()
        })
        .collect();
    let responses: Vec<Vec<u8>> = sample_responses()
        .into_iter()
        .enumerate()
        .map(|(id, result)| {
            frame(
                &postcard::to_stdvec(&ResponseFrame {
                    id: id as u64 + 1,
                    result,
                    clock: id as u64 * 1_000_003,
                })
                .expect("encodes"),
            )
        })
        .collect();
    let mut seeds: Vec<Vec<u8>> = responses
        .iter()
        .map(|r| [answers[0].clone(), r.clone()].concat())
        .collect();
    seeds.push([answers.clone(), responses].concat().concat());
    seeds.extend(answers);
    // The hello refused at once, and a challenge that does not prove the secret.
    seeds.push(frame(
        &postcard::to_stdvec(&handshake::ChallengeAnswer::Err(Refusal::BadMagic)).expect("encodes"),
    ));
    let forged = handshake::ChallengeAnswer::Ok(handshake::Challenge {
        nonce: handshake::FUZZ_NONCE,
        mac: [0; handshake::MAC_LEN],
    });
    seeds.push(frame(&postcard::to_stdvec(&forged).expect("encodes")));
    seeds
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::fuzz::{run_framed, DEFAULT_BUDGET};

    #[test]
    fn fuzz_rpc_hello() {
        let mut seeds = fabric::handshake::fuzz_hello_seeds(
            Protocol::Rpc,
            Role::Client {
                host: "fuzz".into(),
                pid: 1,
            },
        );
        seeds.extend(request_seeds());
        run_framed("rpc hello", &seeds, DEFAULT_BUDGET, Some(0), hello_entry);
    }

    #[test]
    fn fuzz_rpc_client() {
        let seeds = response_seeds();
        run_framed("rpc client", &seeds, DEFAULT_BUDGET, Some(0), client_entry);
    }

    /// The seeds are what they claim: every response stream is read to its end.
    #[test]
    fn response_seeds_decode() {
        let seeds = response_seeds();
        for (seed, expected) in seeds.iter().zip(sample_responses()) {
            let mut pipe = Pipe::new(seed);
            let challenge: handshake::ChallengeAnswer = recv(&mut pipe).unwrap();
            assert!(challenge.is_ok());
            let answer: HelloAnswer = recv(&mut pipe).unwrap();
            assert!(answer.is_ok());
            let response: ResponseFrame = recv(&mut pipe).unwrap();
            assert_eq!(response.result, expected);
            assert!(pipe.input.is_empty());
        }
    }
}
