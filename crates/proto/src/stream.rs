//! The byte stream under an RPC connection to the meta server: tcp, or a Unix domain socket for
//! a client on the meta server's own host.
//!
//! Why a second transport: on one host, a loopback tcp round trip pays the whole tcp stack on
//! both sides of both messages, and a metadata call (a create, an open) is one round trip plus
//! tens of microseconds of handling. A Unix stream socket carries the same frames for less: a
//! 128-byte ping-pong between two threads took 57 µs at p50 against 87–97 µs over loopback tcp
//! across the two CPUs of the development VM, and 10 against 16–21 µs on one CPU. The meta
//! server offers one where every client must be on its host anyway (the shm fabric:
//! `meta_server::MetaConfig::local_rpc`) and names it in its welcome
//! ([`crate::ClusterInfo::local_rpc`]); clients that can open it use it (`fs-client`'s
//! `meta`), the others stay on tcp.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// Connects to the Unix socket at `path`, trying for at most `timeout`. A plain `connect` waits
/// for as long as the server's backlog stays full (a stopped server with many clients
/// connecting), as a tcp connect to a silent host would without its bound. (socket2's
/// `connect_timeout` does not do here: a non-blocking Unix connect that meets a full backlog
/// fails with EAGAIN and leaves the socket unconnected, to be tried again, rather than
/// connecting in the background as tcp does.)
pub fn connect_local(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let addr = socket2::SockAddr::unix(path)?;
    let socket = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    loop {
        match socket.connect(&addr) {
            Ok(()) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{} accepted no connection within {timeout:?} (its backlog is full)",
                        path.display()
                    ),
                ))
            }
            Err(e) => return Err(e),
        }
    }
    socket.set_nonblocking(false)?;
    Ok(UnixStream::from(std::os::fd::OwnedFd::from(socket)))
}

/// A connected stream to the meta server.
#[derive(Debug)]
pub enum MetaStream {
    /// Over tcp (any host).
    Tcp(TcpStream),
    /// Over a Unix domain socket (this host).
    Local(UnixStream),
}

impl MetaStream {
    /// Another handle to the same stream (one reads while another writes).
    pub fn try_clone(&self) -> io::Result<MetaStream> {
        Ok(match self {
            MetaStream::Tcp(s) => MetaStream::Tcp(s.try_clone()?),
            MetaStream::Local(s) => MetaStream::Local(s.try_clone()?),
        })
    }

    /// Bounds each read (None: none).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            MetaStream::Tcp(s) => s.set_read_timeout(timeout),
            MetaStream::Local(s) => s.set_read_timeout(timeout),
        }
    }

    /// Bounds each write (None: none).
    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            MetaStream::Tcp(s) => s.set_write_timeout(timeout),
            MetaStream::Local(s) => s.set_write_timeout(timeout),
        }
    }

    /// Sends small frames at once (tcp's `TCP_NODELAY`; a Unix socket never waits).
    pub fn set_nodelay(&self) -> io::Result<()> {
        match self {
            MetaStream::Tcp(s) => s.set_nodelay(true),
            MetaStream::Local(_) => Ok(()),
        }
    }

    /// Shuts the stream down, which ends a read in progress on any handle of it.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            MetaStream::Tcp(s) => s.shutdown(how),
            MetaStream::Local(s) => s.shutdown(how),
        }
    }

    /// Whether this is the local (Unix socket) transport.
    pub fn is_local(&self) -> bool {
        matches!(self, MetaStream::Local(_))
    }
}

impl AsFd for MetaStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            MetaStream::Tcp(s) => s.as_fd(),
            MetaStream::Local(s) => s.as_fd(),
        }
    }
}

impl Read for MetaStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            MetaStream::Tcp(s) => s.read(buf),
            MetaStream::Local(s) => s.read(buf),
        }
    }
}

impl Write for MetaStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            MetaStream::Tcp(s) => s.write(buf),
            MetaStream::Local(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            MetaStream::Tcp(s) => s.flush(),
            MetaStream::Local(s) => s.flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connect to a socket whose server accepts nothing gives up after its timeout once the
    /// backlog is full; one to a missing socket fails at once; one to a serving socket works.
    #[test]
    fn a_local_connect_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let missing = connect_local(&dir.path().join("none.sock"), Duration::from_secs(5));
        assert_eq!(missing.unwrap_err().kind(), io::ErrorKind::NotFound);
        let path = dir.path().join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mut pending = Vec::new();
        let timed_out = loop {
            let start = Instant::now();
            match connect_local(&path, Duration::from_millis(50)) {
                Ok(stream) => pending.push(stream),
                Err(e) => break (e, start.elapsed()),
            }
            assert!(pending.len() < 10_000, "the backlog never filled");
        };
        assert_eq!(
            timed_out.0.kind(),
            io::ErrorKind::TimedOut,
            "{:?}",
            timed_out.0
        );
        assert!(
            timed_out.1 >= Duration::from_millis(50),
            "{:?}",
            timed_out.1
        );
        assert!(timed_out.1 < Duration::from_secs(5), "{:?}", timed_out.1);
        // Accepting one frees a place, which the next connect takes; the stream it gives
        // blocks in a read (a read with a timeout waits it out instead of failing at once).
        let (_accepted, _) = listener.accept().unwrap();
        let late = connect_local(&path, Duration::from_secs(5)).unwrap();
        late.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let start = Instant::now();
        let read = (&late).read(&mut [0u8; 1]);
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert!(
            start.elapsed() >= Duration::from_millis(15),
            "the stream is blocking"
        );
        drop(pending);
    }

    #[test]
    fn both_transports_carry_bytes_both_ways_and_shut_down() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let local = MetaStream::Local(UnixStream::connect(&path).unwrap());
        let (peer_local, _) = listener.accept().unwrap();
        let tcp_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = MetaStream::Tcp(TcpStream::connect(tcp_listener.local_addr().unwrap()).unwrap());
        let (peer_tcp, _) = tcp_listener.accept().unwrap();
        assert!(local.is_local() && !tcp.is_local());
        for (mut ours, mut theirs) in [
            (local, MetaStream::Local(peer_local)),
            (tcp, MetaStream::Tcp(peer_tcp)),
        ] {
            ours.set_nodelay().unwrap();
            ours.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            ours.write_all(b"ping").unwrap();
            let mut got = [0u8; 4];
            theirs.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"ping");
            theirs.write_all(b"pong").unwrap();
            let mut reader = ours.try_clone().unwrap();
            reader.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"pong");
            ours.shutdown(Shutdown::Both).unwrap();
            assert_eq!(theirs.read(&mut got).unwrap(), 0, "the peer sees the end");
        }
    }
}
