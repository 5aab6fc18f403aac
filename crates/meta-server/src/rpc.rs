//! The RPC service over TCP (tokio): the async twin of `proto::rpc::{send, recv}` — a
//! `fabric::frame` (8-byte header: length, crc32) around a postcard message — the handshake,
//! and one task per connection that reads requests and runs them concurrently, answering each
//! under its id as it finishes.
//!
//! sled and the fabric verbs block, so a request runs on tokio's blocking pool
//! (`spawn_blocking`), whose thread also writes the answer, and a slow request (zeroing chunks,
//! a lock tree created for a large file) never stalls other connections — except a quick one
//! (`requests::inline`: tens of microseconds in memory) alone on its connection, which
//! the async worker that read it handles and answers itself, saving the hand-off's thread
//! wake-up; after that answer the connection is served awake for a while (`awake`).

use crate::awake::{AwakeServe, Handback};
use crate::service::Service;
use fabric::frame::{check_body, header_for, parse_header, FrameError, HEADER_LEN};
use fabric::handshake::{
    self, Admission, Admitted, ChallengeAnswer, Limit, Protocol, Refusal, HANDSHAKE_TIMEOUT,
    MAX_HELLO_FRAME,
};
use proto::rpc::{HelloAnswer, RequestFrame, ResponseFrame, Role, Welcome, MAX_FRAME};
use proto::FsError;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{
    AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter,
};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;

/// The read half of a connection's stream (tcp, or the local Unix socket): read by the async
/// loop, and watched through its descriptor by the awake thread (`awake`).
pub(crate) trait ReadHalf: AsyncRead + Unpin + Send + Sync + 'static {
    /// The stream's descriptor.
    fn fd(&self) -> BorrowedFd<'_>;
}

impl ReadHalf for tokio::net::tcp::OwnedReadHalf {
    fn fd(&self) -> BorrowedFd<'_> {
        self.as_ref().as_fd()
    }
}

impl ReadHalf for tokio::net::unix::OwnedReadHalf {
    fn fd(&self) -> BorrowedFd<'_> {
        self.as_ref().as_fd()
    }
}

/// How the connection limits count a peer of the local socket: as loopback, which it is.
const LOCAL_PEER: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// How a peer of the local socket is named in logs and in a status report.
const LOCAL_PEER_NAME: &str = "local";

/// Reads one frame (like `fabric::frame::read_frame`, asynchronously): the length is checked
/// against `max` before anything is allocated, the body is checked against its crc32.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    body: &mut Vec<u8>,
) -> Result<(), FrameError> {
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header).await?;
    let header = parse_header(&header, max)?;
    body.clear();
    // Grow only as bytes arrive: a peer declaring a large frame and stalling costs nothing.
    (&mut *r).take(header.len as u64).read_to_end(body).await?;
    check_body(&header, body)
}

/// Writes `message` as one frame and flushes.
pub async fn send<W: AsyncWrite + Unpin, T: Serialize>(w: &mut W, message: &T) -> io::Result<()> {
    let body = postcard::to_stdvec(message)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("response of {} bytes exceeds the frame limit", body.len()),
        ));
    }
    w.write_all(&header_for(&body)).await?;
    w.write_all(&body).await?;
    w.flush().await
}

/// Reads one frame and decodes it.
async fn recv<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
    body: &mut Vec<u8>,
) -> Result<T, String> {
    read_frame(r, MAX_FRAME, body)
        .await
        .map_err(|e| e.to_string())?;
    postcard::from_bytes(body).map_err(|e| format!("malformed message: {e}"))
}

/// How long a data server's registration connection may stay silent before the server is
/// declared gone. A data server sends its next revocation poll as soon as the last is
/// answered (at the latest a second after it was asked), so a live one is never silent for
/// more than a round trip; 5 s is also the data server's own bound on each poll's answer,
/// after which it registers again.
pub const DATA_SERVER_SILENCE: Duration = Duration::from_secs(5);

/// Where the RPC service takes connections: tcp, or the local Unix socket
/// ([`crate::MetaConfig::local_rpc`]), whose peers count as loopback for the limits.
pub(crate) enum Listener {
    /// Any host.
    Tcp(TcpListener),
    /// This host.
    Local(UnixListener),
}

/// Accepts connections on `listener` until `stop` turns true, each counted by `admission`
/// until its task ends (what a clean shutdown waits for: [`Admission::wait_all_closed`]). The
/// same handshake, limits and service on both kinds of listener; only a tcp peer is watched
/// with keepalives (a local peer that dies closes its socket, and one that is stopped is what
/// the session lease is for).
pub(crate) async fn accept_loop(
    listener: Listener,
    service: Arc<Service>,
    mut stop: watch::Receiver<bool>,
    admission: Arc<Admission>,
    awake: Arc<AwakeServe>,
) {
    let serving = Serving {
        service,
        stop: stop.clone(),
        admission,
        awake,
    };
    loop {
        let accepted = tokio::select! {
            accepted = async {
                match &listener {
                    Listener::Tcp(l) => l.accept().await.map(|(stream, peer)| {
                        let _ = stream.set_nodelay(true);
                        // A client or data server that vanishes (cut link, dead host) must
                        // not keep its task and session for ever.
                        fabric::tcp::watch_peer(&stream);
                        let (r, w) = stream.into_split();
                        serving.admit(r, w, peer.ip(), peer.to_string(), None);
                    }),
                    Listener::Local(l) => l.accept().await.map(|(stream, _)| {
                        let pid = stream
                            .peer_cred()
                            .ok()
                            .and_then(|cred| cred.pid())
                            .and_then(|pid| u32::try_from(pid).ok());
                        let (r, w) = stream.into_split();
                        serving.admit(r, w, LOCAL_PEER, LOCAL_PEER_NAME.into(), pid);
                    }),
                }
            } => accepted,
            _ = stop.changed() => break,
        };
        if let Err(error) = accepted {
            tracing::warn!(%error, "accept failed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// What every accepted connection is served with.
struct Serving {
    service: Arc<Service>,
    stop: watch::Receiver<bool>,
    admission: Arc<Admission>,
    awake: Arc<AwakeServe>,
}

impl Serving {
    /// Counts the connection of `r` and `w` from `ip` (named `peer` in logs; `peer_pid`: its
    /// process, from the Unix socket's peer credentials) against the limits before a byte is
    /// read — beyond them it gets a refusal naming the limit and costs no buffer — and serves
    /// it on a task of its own.
    fn admit<R: ReadHalf, W: AsyncWrite + Unpin + Send + 'static>(
        &self,
        r: R,
        w: W,
        ip: IpAddr,
        peer: String,
        peer_pid: Option<u32>,
    ) {
        let admitted = match self.admission.admit(ip) {
            Ok(admitted) => admitted,
            Err(refusal) => {
                tracing::warn!(%peer, %refusal, "refused a connection");
                tokio::spawn(refuse(r, w, refusal));
                return;
            }
        };
        let service = self.service.clone();
        let stop = self.stop.clone();
        let awake = self.awake.clone();
        tokio::spawn(async move {
            if let Err(why) =
                connection(r, w, service, stop, admitted, &awake, &peer, peer_pid).await
            {
                tracing::debug!(%peer, why, "connection closed");
            }
        });
    }
}

/// Answers a connection refused at accept time with `refusal` and closes it. The peer's hello
/// is read and discarded for a moment first (at most [`MAX_HELLO_FRAME`] bytes, half a second),
/// so that the close does not reset the connection before the refusal arrives.
async fn refuse<R, W>(mut r: R, mut w: W, refusal: Refusal)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if send(&mut w, &HelloAnswer::Err(refusal)).await.is_err() {
        return;
    }
    let _ = w.shutdown().await;
    let mut sink = [0u8; 4096];
    let mut left = MAX_HELLO_FRAME;
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        while left > 0 {
            match r.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

/// Runs `f` on the blocking pool ([`guarded`]).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, FsError> + Send + 'static,
) -> Result<T, FsError> {
    tokio::task::spawn_blocking(move || guarded(f))
        .await
        .unwrap_or_else(|e| Err(FsError::Io(format!("meta server internal error: {e}"))))
}

/// Runs `f`, a handler; a panic in it is its caller's internal error, not the connection's
/// end (the state it leaves is as consistent as sled left it: see `sync::lock`).
fn guarded<T>(f: impl FnOnce() -> Result<T, FsError>) -> Result<T, FsError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(FsError::Io(
            "meta server internal error: the request's handler panicked".into(),
        ))
    })
}

#[allow(clippy::too_many_arguments)]
async fn connection<R, W>(
    r: R,
    w: W,
    service: Arc<Service>,
    mut stop: watch::Receiver<bool>,
    mut admitted: Admitted,
    awake: &Arc<AwakeServe>,
    peer: &str,
    peer_pid: Option<u32>,
) -> Result<(), String>
where
    R: ReadHalf,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut reader = BufReader::new(r);
    let mut writer = BufWriter::new(w);
    let hello = accept_hello(&mut reader, &mut writer, &service.settings.credentials).await?;
    admitted.authenticated();
    match hello.role {
        Role::Client { host, pid } => {
            let origin = crate::status::Origin {
                host,
                pid,
                peer: peer.to_owned(),
                peer_pid,
            };
            client_connection(reader, writer, &service, &mut stop, awake, origin).await
        }
        Role::DataServer {
            fabric,
            region,
            region_bytes,
            name,
            incarnation,
            zone,
        } => {
            let svc = service.clone();
            let registered = blocking(move || {
                svc.register_data_server(
                    &name,
                    fabric,
                    region,
                    region_bytes,
                    incarnation,
                    zone.as_deref(),
                )
            })
            .await;
            let (id, epoch) = match registered {
                Ok(r) => r,
                Err(e) => {
                    let why = format!("data server registration failed: {e}");
                    let _ = send(
                        &mut writer,
                        &HelloAnswer::Err(Refusal::Rejected(why.clone())),
                    )
                    .await;
                    return Err(why);
                }
            };
            if let Err(e) = send(&mut writer, &HelloAnswer::Ok(Welcome::DataServer { id })).await {
                // The server went away during its registration: it is not live, whatever the
                // registration made it (a later one by the same name replaces it anyway).
                service.data_server_gone(id, epoch);
                return Err(e.to_string());
            }
            let registration = Registration { id, epoch };
            let result =
                data_server_connection(&mut reader, &mut writer, &service, &mut stop, registration)
                    .await;
            service.data_server_gone(id, epoch);
            result
        }
    }
}

/// The shared handshake (fabric::handshake): an unauthenticated peer gets a small frame limit
/// and one deadline for the whole exchange, and a refusal saying why.
async fn accept_hello<R, W>(
    reader: &mut BufReader<R>,
    writer: &mut BufWriter<W>,
    credentials: &fabric::Credentials,
) -> Result<handshake::Hello<Role>, String>
where
    R: ReadHalf,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut body = Vec::new();
    let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
    let late = || Refusal::BadHello(format!("no handshake within {HANDSHAKE_TIMEOUT:?}"));
    let challenged = match tokio::time::timeout_at(
        deadline,
        read_frame(&mut *reader, MAX_HELLO_FRAME, &mut body),
    )
    .await
    {
        Ok(Ok(())) => handshake::accept::<Role>(&body, Protocol::Rpc, credentials),
        Ok(Err(e)) => Err(Refusal::BadHello(e.to_string())),
        Err(_) => Err(late()),
    };
    let hello = match challenged {
        Ok(challenged) => {
            let challenge: ChallengeAnswer = Ok(challenged.challenge().clone());
            send(&mut *writer, &challenge)
                .await
                .map_err(|e| e.to_string())?;
            match tokio::time::timeout_at(
                deadline,
                read_frame(&mut *reader, MAX_HELLO_FRAME, &mut body),
            )
            .await
            {
                Ok(Ok(())) => challenged.verify(&body, credentials),
                Ok(Err(e)) => Err(Refusal::BadHello(format!("no proof: {e}"))),
                Err(_) => Err(late()),
            }
        }
        Err(refusal) => Err(refusal),
    };
    match hello {
        Ok(hello) => Ok(hello),
        Err(refusal) => {
            tracing::warn!(%refusal, "refused a connection");
            let _ = send(&mut *writer, &HelloAnswer::Err(refusal.clone())).await;
            Err(refusal.to_string())
        }
    }
}

/// A client's connection once its handshake is done: opens its session (or says why not),
/// serves its requests, and ends the session when the connection ends.
async fn client_connection<R, W>(
    mut reader: BufReader<R>,
    mut writer: BufWriter<W>,
    service: &Arc<Service>,
    stop: &mut watch::Receiver<bool>,
    awake: &Arc<AwakeServe>,
    origin: crate::status::Origin,
) -> Result<(), String>
where
    R: ReadHalf,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (host, pid) = (origin.host.clone(), origin.pid);
    let svc = service.clone();
    let info = match blocking(move || svc.open_session(origin)).await {
        Ok(info) => info,
        Err(e) => {
            let refusal = match e {
                FsError::TooManySessions { limit } => Refusal::Limit {
                    limit: Limit::Sessions,
                    value: limit,
                },
                e => Refusal::Rejected(e.to_string()),
            };
            tracing::warn!(host, pid, %refusal, "refused a client session");
            let why = refusal.to_string();
            let _ = send(&mut writer, &HelloAnswer::Err(refusal)).await;
            return Err(why);
        }
    };
    let session = info.session;
    tracing::info!(session, host, pid, "client session opened");
    send(&mut writer, &HelloAnswer::Ok(Welcome::Client(info)))
        .await
        .map_err(|e| e.to_string())?;
    let result = serve(&mut reader, writer, service, stop, session, awake).await;
    let svc = service.clone();
    let _ = blocking(move || {
        svc.end_session(session);
        Ok(())
    })
    .await;
    tracing::info!(session, "client session closed");
    result
}

/// A data server's registration: its id and the connection epoch it was registered under.
#[derive(Clone, Copy)]
struct Registration {
    id: u32,
    epoch: u64,
}

/// A registered data server's connection: its life is the registration's; answers heartbeats
/// and revocation polls until it closes, falls silent or the meta server stops.
async fn data_server_connection<R, W>(
    reader: &mut BufReader<R>,
    writer: &mut BufWriter<W>,
    service: &Arc<Service>,
    stop: &mut watch::Receiver<bool>,
    registration: Registration,
) -> Result<(), String>
where
    R: ReadHalf,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let id = registration.id;
    let mut body = Vec::new();
    loop {
        tokio::select! {
            frame = tokio::time::timeout(
                DATA_SERVER_SILENCE,
                recv::<_, RequestFrame>(&mut *reader, &mut body),
            ) => match frame {
                Err(_) => {
                    // A cut link or a frozen host closes nothing: without this bound the
                    // registration would stay live (and fences would wait on it) until TCP
                    // gave up, minutes later.
                    tracing::warn!(
                        id,
                        "data server silent for {DATA_SERVER_SILENCE:?}: declared gone"
                    );
                    return Err(format!(
                        "data server {id} sent nothing for {DATA_SERVER_SILENCE:?}"
                    ));
                }
                Ok(Err(why)) => return Err(why),
                Ok(Ok(frame)) => {
                    let result = match frame.request {
                        proto::rpc::Request::Heartbeat => Ok(proto::rpc::Response::Ok),
                        proto::rpc::Request::AwaitRevocations { known } => {
                            match revocation_poll(reader, service, stop, registration, known).await {
                                Poll::Answer(answer) => Ok(answer),
                                Poll::Closed => {
                                    return Err("the data server closed its registration".into())
                                }
                                Poll::Stopping => {
                                    let _ = send(&mut *writer, &goodbye()).await;
                                    return Ok(());
                                }
                            }
                        }
                        _ => Err(FsError::Invalid(
                            "a data server connection only takes heartbeats and revocation \
                             polls"
                                .into(),
                        )),
                    };
                    if let Err(e) = send(&mut *writer, &ResponseFrame::new(frame.id, result)).await {
                        return Err(e.to_string());
                    }
                }
            },
            _ = stop.changed() => {
                let _ = send(&mut *writer, &goodbye()).await;
                return Ok(());
            }
        }
    }
}

/// How a revocation poll ended ([`revocation_poll`]).
enum Poll {
    /// With this answer.
    Answer(proto::rpc::Response),
    /// The data server closed its connection meanwhile.
    Closed,
    /// The meta server is stopping.
    Stopping,
}

/// A data server's revocation poll (`AwaitRevocations`), having applied epochs up to `known`:
/// answers at once if newer revocations exist, else at the first one or after a second (the
/// poll is the heartbeat). Meanwhile it watches the connection: a data server that dies must
/// be marked gone at once (clients ask the layout to learn where it comes back), not a second
/// later.
async fn revocation_poll<R: ReadHalf>(
    reader: &mut BufReader<R>,
    service: &Arc<Service>,
    stop: &mut watch::Receiver<bool>,
    registration: Registration,
    known: u64,
) -> Poll {
    service.fence_applied(registration.id, registration.epoch, known);
    let mut watch = service.fence_watch();
    let poll = tokio::time::timeout(
        std::time::Duration::from_secs(1),
        watch.wait_for(|&newest| newest > known),
    );
    tokio::select! {
        _ = poll => {}
        filled = reader.fill_buf() => {
            if filled.map_or(true, |b| b.is_empty()) {
                return Poll::Closed;
            }
        }
        _ = stop.changed() => return Poll::Stopping,
    }
    let (newest, sessions) = service.revocations_since(known);
    Poll::Answer(proto::rpc::Response::Revocations {
        epoch: newest,
        sessions,
    })
}

/// What a connection is sent when the meta server stops cleanly, before it closes: an answer
/// to no request (id 0) saying so, so that its peer can tell a clean stop from a crash
/// (`proto::rpc::RpcError::ServerStopping`) — a data server waits for the next meta server
/// without a warning, a client says why its calls fail.
fn goodbye() -> ResponseFrame {
    ResponseFrame::new(0, Err(FsError::Unavailable(proto::rpc::STOPPING.into())))
}

/// Requests of one client connection that may run at once. A client's threads share one
/// connection (fs-client multiplexes it), so a connection carries as many concurrent calls as
/// the client has threads in namespace operations; the bound keeps what one connection can
/// queue on the blocking pool (and buffer as unsent answers) finite.
pub const MAX_IN_FLIGHT_PER_CONNECTION: usize = 64;

/// Answers a client session's requests until the connection closes or the server stops.
///
/// Requests run concurrently (on the blocking pool, at most
/// [`MAX_IN_FLIGHT_PER_CONNECTION`] at once; a quick one alone on the connection inline, see
/// below) and are answered as they finish, under their
/// request id: one client's threads do not wait behind each other's calls. A caller waits for
/// its answer before its next call, so each thread's calls stay in order. The blocking-pool
/// thread that ran a request writes its answer itself (the writer is shared under an async
/// mutex): handing it to a writer task cost one more thread wake-up per call. A request's
/// permit is released only once its answer is written, so a client that stops reading stops
/// being served; the session ends only once every request it started has answered.
async fn serve<R, W>(
    reader: &mut BufReader<R>,
    writer: W,
    service: &Arc<Service>,
    stop: &mut watch::Receiver<bool>,
    session: u64,
    awake: &Arc<AwakeServe>,
) -> Result<(), String>
where
    R: ReadHalf,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let connection = Connection {
        service: service.clone(),
        session,
        writer: Arc::new(tokio::sync::Mutex::new(writer)),
        permits: Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT_PER_CONNECTION)),
        write_failed: Arc::new(watch::channel(None).0),
        runtime: tokio::runtime::Handle::current(),
    };
    let result = connection.read_loop(reader, stop, awake).await;
    // Every request started has answered (or failed to write) before the session ends.
    connection.all_answered().await;
    if *stop.borrow() {
        linger(reader, &mut *connection.writer.lock().await).await;
    }
    result
}

/// One client connection as [`serve`] answers it: what its requests in flight share.
struct Connection<W> {
    service: Arc<Service>,
    session: u64,
    /// The connection's writer, shared by every request in flight.
    writer: Arc<tokio::sync::Mutex<W>>,
    /// One per request that may be in flight, held until it is answered.
    permits: Arc<tokio::sync::Semaphore>,
    /// Told when an answer could not be written: the connection then ends (the stream may be
    /// mid-frame).
    write_failed: Arc<watch::Sender<Option<String>>>,
    runtime: tokio::runtime::Handle,
}

impl<W: AsyncWrite + Unpin + Send + 'static> Connection<W> {
    /// Reads and starts requests until the connection closes, fails or the server stops.
    async fn read_loop<R: ReadHalf>(
        &self,
        reader: &mut BufReader<R>,
        stop: &mut watch::Receiver<bool>,
        awake: &Arc<AwakeServe>,
    ) -> Result<(), String> {
        let mut write_failure = self.write_failed.subscribe();
        let mut body = Vec::new();
        // A frame the awake thread read and left to this loop (`awake::Handback::Frame`).
        let mut handed_back = None;
        loop {
            let read = match handed_back.take() {
                Some(read) => read,
                None => tokio::select! {
                    read = read_frame(reader, MAX_FRAME, &mut body) => read,
                    _ = stop.changed() => return self.stopping().await,
                    _ = write_failure.changed() => {
                        return Err(write_failure.borrow().clone().unwrap_or_default());
                    }
                },
            };
            let frame = self.decode(read, &body).await?;
            let permit = tokio::select! {
                permit = self.permits.clone().acquire_owned() => {
                    permit.map_err(|e| e.to_string())?
                }
                _ = stop.changed() => return self.stopping().await,
            };
            // Alone on its connection (this one holds the only permit taken) and quick
            // (`requests::inline`): handled right here, on the async worker that read it, and
            // answered from it — no thread hand-off at all. A request that arrives meanwhile
            // waits in the socket until this one is answered (tens of microseconds); while
            // others are in flight, every request goes to the pool.
            if self.permits.available_permits() == MAX_IN_FLIGHT_PER_CONNECTION - 1
                && crate::requests::inline(&frame.request)
            {
                self.answer_here(frame, permit).await?;
                // The caller's next request usually follows within tens of microseconds.
                match awake
                    .serve(
                        reader,
                        &self.writer,
                        &self.service,
                        self.session,
                        stop,
                        &mut body,
                    )
                    .await
                {
                    Handback::Idle => {}
                    Handback::Frame(read) => handed_back = Some(read),
                    Handback::Failed(why) => return Err(why),
                }
                continue;
            }
            self.answering().on_pool(self.session, frame, permit);
        }
    }

    /// The request a frame read into `body` holds; one the server cannot take is refused:
    /// answered under id 0 (no request has it), with the reason, before the connection closes,
    /// so that the client learns why (see `proto::rpc::Client::call`).
    async fn decode(
        &self,
        read: Result<(), FrameError>,
        body: &[u8],
    ) -> Result<RequestFrame, String> {
        match decode_request(read, body) {
            Ok(frame) => Ok(frame),
            Err(Undecodable::Refused(why)) => {
                tracing::warn!(session = self.session, why, "closing a client connection");
                let frame = ResponseFrame::new(0, Err(FsError::Invalid(why.clone())));
                let _ = send(&mut *self.writer.lock().await, &frame).await;
                Err(why)
            }
            Err(Undecodable::Broken(why)) => Err(why),
        }
    }

    /// Runs `frame` on this async worker and writes its answer; `permit` is released once it
    /// is written.
    async fn answer_here(
        &self,
        frame: RequestFrame,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<(), String> {
        let answer = run_request(&self.service, self.session, frame);
        let sent = send(&mut *self.writer.lock().await, &answer).await;
        drop(permit);
        sent.map_err(|e| format!("writing an answer: {e}"))
    }

    /// The server stops: no request is started any more, and once every request started has
    /// answered, the client is told so. Invariant: nothing is answered after the goodbye, so a
    /// call the goodbye fails was not executed, and the client may make it again on its next
    /// connection (`proto::rpc::RpcError::ServerStopping`). (A request still running when the
    /// shutdown's grace runs out leaves with its connection unanswered, and no goodbye: its
    /// client cannot tell, as after a crash.)
    async fn stopping(&self) -> Result<(), String> {
        self.all_answered().await;
        let _ = send(&mut *self.writer.lock().await, &goodbye()).await;
        Ok(())
    }

    /// Waits until every request started has answered (or failed to write).
    async fn all_answered(&self) {
        let _ = self
            .permits
            .acquire_many(MAX_IN_FLIGHT_PER_CONNECTION as u32)
            .await;
    }

    /// What a request handed to the blocking pool takes with it.
    fn answering(&self) -> Answering<W> {
        Answering {
            service: self.service.clone(),
            writer: self.writer.clone(),
            write_failed: self.write_failed.clone(),
            runtime: self.runtime.clone(),
        }
    }
}

/// What a request handed to the blocking pool needs to be run and answered there.
struct Answering<W> {
    service: Arc<Service>,
    /// The connection's writer, shared by every request in flight.
    writer: Arc<tokio::sync::Mutex<W>>,
    /// Told when an answer could not be written (the connection then ends).
    write_failed: Arc<watch::Sender<Option<String>>>,
    runtime: tokio::runtime::Handle,
}

impl<W: AsyncWrite + Unpin + Send + 'static> Answering<W> {
    /// Runs `frame` of `session` on the blocking pool, whose thread writes the answer: one
    /// thread hand-off per request, on the way in. `permit` is released once it is answered.
    fn on_pool(self, session: u64, frame: RequestFrame, permit: tokio::sync::OwnedSemaphorePermit) {
        tokio::task::spawn_blocking(move || {
            let frame = run_request(&self.service, session, frame);
            let sent = self
                .runtime
                .block_on(async { send(&mut *self.writer.lock().await, &frame).await });
            if let Err(e) = sent {
                self.write_failed
                    .send_replace(Some(format!("writing an answer: {e}")));
            }
            drop(permit);
        });
    }
}

/// A lingering close: the goodbye is the last thing sent (then a FIN), and what the client
/// sends meanwhile is read and dropped, for a while. Closed with bytes unread, the socket
/// would answer with a reset, and a reset may make the client's kernel drop the goodbye
/// unread — its calls would then fail as after a crash, not as calls the server never ran.
async fn linger<R: ReadHalf, W: AsyncWrite + Unpin>(reader: &mut BufReader<R>, writer: &mut W) {
    let _ = writer.shutdown().await;
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(STOP_LINGER, async {
        while matches!(reader.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// Why a client's frame is not a request ([`decode_request`]).
enum Undecodable {
    /// The server cannot take it: refused with this reason, then the connection closes.
    Refused(String),
    /// The stream broke: the connection closes.
    Broken(String),
}

/// The request a frame read into `body` (`read`: how reading it went) holds.
fn decode_request(read: Result<(), FrameError>, body: &[u8]) -> Result<RequestFrame, Undecodable> {
    match read {
        Ok(()) => postcard::from_bytes(body)
            .map_err(|e| Undecodable::Refused(format!("malformed request: {e}"))),
        Err(FrameError::TooLarge { len, max }) => Err(Undecodable::Refused(format!(
            "a request frame of {len} bytes exceeds the limit of {max} bytes \
             (proto::rpc::MAX_FRAME)"
        ))),
        Err(e) => Err(Undecodable::Broken(e.to_string())),
    }
}

/// How long a connection of a stopping meta server reads and drops what its client still
/// sends after the goodbye (see [`serve`]), unless the client closes first, as a live one does
/// once it has read the goodbye.
const STOP_LINGER: Duration = Duration::from_millis(200);

/// Runs one request of session `session` ([`guarded`]) and makes its answer.
pub(crate) fn run_request(service: &Service, session: u64, frame: RequestFrame) -> ResponseFrame {
    let RequestFrame {
        id,
        release_first,
        request,
        expires,
    } = frame;
    let expires = expires.map(fabric::clock::instant_of);
    ResponseFrame::new(
        id,
        guarded(|| service.handle_by(session, release_first, request, expires)),
    )
}

#[cfg(feature = "fuzzing")]
/// Fuzz entry: `input` is the byte stream a peer sends to the meta server's RPC port, read
/// exactly as a connection reads it ([`read_frame`]: the hello and the proof at most
/// [`MAX_HELLO_FRAME`] bytes each, checked by `handshake::accept` — the server's nonce
/// `handshake::FUZZ_NONCE` — and `Challenged::verify`; then request frames of at most [`MAX_FRAME`]
/// decoded as [`RequestFrame`]s). With a `store`, each namespace request is also run against
/// it as the service runs it. Checks, panicking on a finding:
/// - no frame body is allocated beyond the bytes that arrived, whatever length it declares;
/// - every decoded request survives a round trip through its encoding;
/// - the store answers every request with a result (no panic), never creates an entry under
///   a name that `check_name_for` refuses, and its root stays a directory whose listing holds
///   only good names.
pub fn fuzz_entry(input: &[u8], store: Option<&crate::store::Store>) {
    thread_local! {
        static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime");
    }
    RUNTIME.with(|rt| rt.block_on(fuzz_stream(input, store)));
}

#[cfg(feature = "fuzzing")]
async fn fuzz_stream(input: &[u8], store: Option<&crate::store::Store>) {
    let mut reader = input;
    let mut body = Vec::new();
    let read = read_frame(&mut reader, MAX_HELLO_FRAME, &mut body).await;
    fabric::fuzz::assert_bounded(&body, input.len());
    if read.is_err() {
        return;
    }
    let credentials = fabric::handshake::fuzz_credentials();
    let challenged = match handshake::accept_with_nonce::<Role>(
        &body,
        Protocol::Rpc,
        &credentials,
        handshake::FUZZ_NONCE,
    ) {
        Ok(challenged) if matches!(challenged.hello().role, Role::Client { .. }) => challenged,
        _ => return,
    };
    let available = reader.len();
    let read = read_frame(&mut reader, MAX_HELLO_FRAME, &mut body).await;
    fabric::fuzz::assert_bounded(&body, available);
    if read.is_err() || challenged.verify(&body, &credentials).is_err() {
        return;
    }
    loop {
        let available = reader.len();
        let read = read_frame(&mut reader, MAX_FRAME, &mut body).await;
        fabric::fuzz::assert_bounded(&body, available);
        if read.is_err() {
            return;
        }
        let Ok(frame) = postcard::from_bytes::<RequestFrame>(&body) else {
            continue;
        };
        proto::fuzz::assert_round_trip(&frame);
        if let Some(store) = store {
            fuzz_dispatch(store, frame.request);
        }
    }
}

#[cfg(feature = "fuzzing")]
/// Runs a namespace request against `store` the way the service does and checks the
/// invariants [`fuzz_entry`] lists.
fn fuzz_dispatch(store: &crate::store::Store, request: proto::rpc::Request) {
    use proto::rpc::{check_name_for, Group, NameOp, Request};
    use proto::FileKind;
    // The name a successful call created.
    let created = match request.class().group {
        Group::Read => {
            fuzz_read(store, request);
            None
        }
        Group::Change => {
            let name = match &request {
                Request::Mknod { name, .. }
                | Request::Mkdir { name, .. }
                | Request::Symlink { name, .. } => Some(name.clone()),
                Request::Link { new_name, .. } | Request::Rename { new_name, .. } => {
                    Some(new_name.clone())
                }
                _ => None,
            };
            let done = crate::service::change_namespace(store, request, |_| false);
            name.filter(|_| done.is_ok())
        }
        // The service runs `Create` as `Mknod` of a file, then `Open`.
        Group::File => match request {
            Request::Create {
                parent,
                name,
                perm,
                caller,
                ..
            } => {
                let done = store.mknod(parent, &name, FileKind::File, perm, 0, caller);
                Some(name).filter(|_| done.is_ok())
            }
            _ => None,
        },
        Group::Chunks => {
            if let Request::ChunkMap { ino, first, count } = request {
                if let Ok(chunks) = store.chunk_map(ino, first, count) {
                    assert_eq!(chunks.len() as u64, count);
                }
            }
            None
        }
        // The rest need the service's state (open files, data servers, the meta region).
        Group::Cluster => None,
    };
    if let Some(name) = created {
        assert!(
            check_name_for(NameOp::Create, &name).is_ok(),
            "the store accepted the bad name {name:?}"
        );
    }
    fuzz_check_root(store);
}

#[cfg(feature = "fuzzing")]
/// Runs a read of the namespace against `store` ([`fuzz_dispatch`]).
fn fuzz_read(store: &crate::store::Store, request: proto::rpc::Request) {
    use proto::rpc::Request;
    match request {
        Request::Lookup { parent, name } => drop(store.lookup(parent, &name)),
        Request::GetAttr { ino } => drop(store.getattr(ino)),
        Request::Readlink { ino } => drop(store.readlink(ino)),
        Request::ReadDir { ino, cookie, max } | Request::ReadDirPlus { ino, cookie, max } => {
            if let Ok(entries) = store.readdir(ino, cookie, max) {
                assert!(entries.len() <= (max.clamp(1, 4096)) as usize);
            }
        }
        Request::GetXattr { ino, name } => drop(store.getxattr(ino, &name)),
        Request::ListXattr { ino } => drop(store.listxattr(ino)),
        _ => {}
    }
}

#[cfg(feature = "fuzzing")]
/// Checks that the root of `store` is a directory whose listing holds only good names.
fn fuzz_check_root(store: &crate::store::Store) {
    use proto::rpc::check_name;
    use proto::{FileKind, ROOT_INO};
    let root = store.getattr(ROOT_INO).expect("the root exists");
    assert_eq!(root.kind, FileKind::Dir);
    let entries = store
        .readdir(ROOT_INO, 2, 4096)
        .expect("the root can be listed");
    for entry in entries {
        assert!(
            check_name(&entry.name).is_ok(),
            "bad name {:?} in the root",
            entry.name
        );
    }
}
