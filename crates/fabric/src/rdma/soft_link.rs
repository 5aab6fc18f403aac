//! The wire between the `soft` NICs of the processes of one host: how a requester in one
//! process reaches a responder queue pair in another.
//!
//! Every process that creates a soft queue pair listens on a unix socket in the per-host
//! directory [`socket_dir`] (`CITRONFS_RDMA_SOFT_DIR`, else `/dev/shm/citronfs-softnic-<uid>`),
//! named after its soft GID (process id and a random per-process nonce, so a reused process id
//! is not mistaken for the process that had it). A requester queue pair connected to a GID of
//! another process opens one stream to that socket, on its first request, and sends each
//! request there after its local checks; a thread of the responder's process (its "NIC")
//! executes it with [`super::soft::respond`], exactly as an in-process request is executed,
//! and answers with a status and the bytes a Read or an atomic returns. The responder's
//! memory is touched by the responder's process only, so its device-wide atomic lock is the
//! only one its words need.
//!
//! A peer that is gone (no socket, connection refused, the stream closed) or that does not
//! answer within [`RETRY_TIMEOUT`] is [`WcStatus::RetryExceeded`], as on a link whose peer
//! stopped answering; the stream is not used again.

use super::soft::{respond, Ask};
use super::verbs::{WcStatus, WrOp};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable naming the directory of the soft NICs' sockets.
pub const ENV_DIR: &str = "CITRONFS_RDMA_SOFT_DIR";

/// How long a requester waits for a responder in another process to answer one request before
/// it reports [`WcStatus::RetryExceeded`] (a NIC's transport retries, made generous for a
/// loaded machine: the responder is a thread that must be scheduled).
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest request a responder accepts (bigger than any registration the backend makes).
const MAX_LEN: u32 = 1 << 30;

/// Bytes of a request's header: queue pair (4), op (1), remote address (8), rkey (4), length
/// (4), two operands (8 + 8).
const HEADER: usize = 37;

/// The directory of the soft NICs' sockets on this host.
pub fn socket_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(ENV_DIR).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    let base = PathBuf::from("/dev/shm");
    let base = if base.is_dir() {
        base
    } else {
        std::env::temp_dir()
    };
    base.join(format!("citronfs-softnic-{uid}"))
}

/// The socket of the process whose soft GID is `gid`.
fn socket_path(gid: &[u8; 16]) -> PathBuf {
    let (pid, nonce) = split_gid(gid);
    socket_dir().join(format!("{pid}-{nonce:016x}.sock"))
}

/// The process id and nonce a soft GID carries (bytes 4..12 the nonce, 12..16 the pid).
fn split_gid(gid: &[u8; 16]) -> (u32, u64) {
    let mut nonce = [0u8; 8];
    nonce.copy_from_slice(&gid[4..12]);
    let mut pid = [0u8; 4];
    pid.copy_from_slice(&gid[12..]);
    (u32::from_be_bytes(pid), u64::from_be_bytes(nonce))
}

/// Starts this process's responder (once): its socket and the thread accepting on it; whether
/// it listens. An error (the directory not writable, say) leaves the process reachable from
/// itself only (by function calls); it is logged once, and requesters elsewhere see
/// [`WcStatus::RetryExceeded`].
pub(super) fn serve(gid: [u8; 16]) -> bool {
    static LISTENING: OnceLock<bool> = OnceLock::new();
    *LISTENING.get_or_init(|| match start(gid) {
        Ok(()) => true,
        Err(error) => {
            tracing::warn!(
                %error,
                dir = %socket_dir().display(),
                "rdma soft: no socket for peers in other processes; this process's queue \
                 pairs are reachable from this process only"
            );
            false
        }
    })
}

fn start(gid: [u8; 16]) -> std::io::Result<()> {
    let dir = socket_dir();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)?;
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    if std::fs::metadata(&dir)?.uid() != uid {
        return Err(std::io::Error::other(format!(
            "{} belongs to another user",
            dir.display()
        )));
    }
    sweep(&dir);
    let path = socket_path(&gid);
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    std::thread::Builder::new()
        .name("fabric-rdma-softnic".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let spawned = std::thread::Builder::new()
                    .name("fabric-rdma-softnic-qp".into())
                    .spawn(move || answer(stream));
                if let Err(error) = spawned {
                    tracing::warn!(%error, "rdma soft: cannot start a responder thread");
                }
            }
        })?;
    Ok(())
}

/// Removes the sockets of processes that no longer exist.
fn sweep(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".sock"))
            .and_then(|n| n.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: signal 0 only checks that the process exists.
        let gone = unsafe { libc::kill(pid, 0) } == -1
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn op_code(op: WrOp) -> (u8, u64, u64) {
    match op {
        WrOp::Read => (0, 0, 0),
        WrOp::Write => (1, 0, 0),
        WrOp::CompareSwap { compare, swap } => (2, compare, swap),
        WrOp::FetchAdd { add } => (3, add, 0),
    }
}

fn decode_op(code: u8, a: u64, b: u64) -> Option<WrOp> {
    Some(match code {
        0 => WrOp::Read,
        1 => WrOp::Write,
        2 => WrOp::CompareSwap {
            compare: a,
            swap: b,
        },
        3 => WrOp::FetchAdd { add: a },
        _ => return None,
    })
}

fn status_code(status: WcStatus) -> u8 {
    match status {
        WcStatus::RemoteAccess => 1,
        WcStatus::RemoteInvalidRequest => 2,
        WcStatus::RetryExceeded => 3,
        _ => 4,
    }
}

fn decode_status(code: u8) -> WcStatus {
    match code {
        1 => WcStatus::RemoteAccess,
        2 => WcStatus::RemoteInvalidRequest,
        3 => WcStatus::RetryExceeded,
        _ => WcStatus::RemoteOperation,
    }
}

/// Bytes a successful answer to `ask` carries.
fn answer_len(ask: &Ask) -> usize {
    match ask.op {
        WrOp::Read => ask.len as usize,
        WrOp::Write => 0,
        WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. } => 8,
    }
}

/// The responder's side of one stream: requests executed in arrival order until it closes.
fn answer(mut stream: UnixStream) {
    let mut header = [0u8; HEADER];
    let mut payload = Vec::new();
    loop {
        if stream.read_exact(&mut header).is_err() {
            return;
        }
        let u32_at =
            |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().unwrap_or([0; 4]));
        let u64_at =
            |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap_or([0; 8]));
        let Some(op) = decode_op(header[4], u64_at(21), u64_at(29)) else {
            return;
        };
        let ask = Ask {
            qpn: u32_at(0),
            op,
            remote_addr: u64_at(5),
            rkey: u32_at(13),
            len: u32_at(17),
        };
        if ask.len > MAX_LEN {
            return;
        }
        payload.clear();
        if op == WrOp::Write {
            payload.resize(ask.len as usize, 0);
            if stream.read_exact(&mut payload).is_err() {
                return;
            }
        }
        let sent = match respond(&ask, &payload) {
            Ok(bytes) => stream
                .write_all(&[0])
                .and_then(|()| stream.write_all(&bytes)),
            Err(status) => stream.write_all(&[status_code(status)]),
        };
        if sent.is_err() {
            return;
        }
    }
}

/// A requester queue pair's stream to a responder in another process.
#[derive(Debug, Default)]
pub(super) struct Link {
    stream: Option<UnixStream>,
    /// Set once the stream failed: the peer is treated as gone from then on.
    broken: bool,
}

impl Link {
    /// Sends `ask` (and a Write's `payload`) to the process whose GID is `gid` and returns its
    /// answer: the bytes a Read or an atomic returned, or the request's failed status.
    pub(super) fn ask(
        &mut self,
        gid: &[u8; 16],
        ask: &Ask,
        payload: &[u8],
    ) -> Result<Vec<u8>, WcStatus> {
        if self.broken {
            return Err(WcStatus::RetryExceeded);
        }
        let result = self.exchange(gid, ask, payload);
        if result.is_err() {
            self.broken = true;
            self.stream = None;
        }
        result.map_err(|_| WcStatus::RetryExceeded)?
    }

    fn exchange(
        &mut self,
        gid: &[u8; 16],
        ask: &Ask,
        payload: &[u8],
    ) -> std::io::Result<Result<Vec<u8>, WcStatus>> {
        if self.stream.is_none() {
            let stream = UnixStream::connect(socket_path(gid))?;
            stream.set_read_timeout(Some(RETRY_TIMEOUT))?;
            stream.set_write_timeout(Some(RETRY_TIMEOUT))?;
            self.stream = Some(stream);
        }
        let Some(stream) = self.stream.as_mut() else {
            return Err(std::io::ErrorKind::NotConnected.into());
        };
        let (code, a, b) = op_code(ask.op);
        let mut header = [0u8; HEADER];
        header[0..4].copy_from_slice(&ask.qpn.to_le_bytes());
        header[4] = code;
        header[5..13].copy_from_slice(&ask.remote_addr.to_le_bytes());
        header[13..17].copy_from_slice(&ask.rkey.to_le_bytes());
        header[17..21].copy_from_slice(&ask.len.to_le_bytes());
        header[21..29].copy_from_slice(&a.to_le_bytes());
        header[29..37].copy_from_slice(&b.to_le_bytes());
        stream.write_all(&header)?;
        if ask.op == WrOp::Write {
            stream.write_all(payload)?;
        }
        let mut status = [0u8; 1];
        stream.read_exact(&mut status)?;
        if status[0] != 0 {
            return Ok(Err(decode_status(status[0])));
        }
        let mut bytes = vec![0u8; answer_len(ask)];
        stream.read_exact(&mut bytes)?;
        Ok(Ok(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_statuses_round_trip_the_codes() {
        for op in [
            WrOp::Read,
            WrOp::Write,
            WrOp::CompareSwap {
                compare: 1,
                swap: 2,
            },
            WrOp::FetchAdd { add: 3 },
        ] {
            let (code, a, b) = op_code(op);
            assert_eq!(decode_op(code, a, b), Some(op));
        }
        assert_eq!(decode_op(9, 0, 0), None);
        for s in [
            WcStatus::RemoteAccess,
            WcStatus::RemoteInvalidRequest,
            WcStatus::RetryExceeded,
            WcStatus::RemoteOperation,
        ] {
            assert_eq!(decode_status(status_code(s)), s);
        }
        let gid = {
            let mut g = [0u8; 16];
            g[4..12].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
            g[12..].copy_from_slice(&4242u32.to_be_bytes());
            g
        };
        assert_eq!(split_gid(&gid), (4242, 0x0102_0304_0506_0708));
        assert!(socket_path(&gid).ends_with("4242-0102030405060708.sock"));
    }
}
