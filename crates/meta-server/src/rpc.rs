//! The RPC service over TCP (tokio): the async twin of `proto::rpc::{send, recv}` — a
//! `fabric::frame` (8-byte header: length, crc32) around a postcard message — the handshake,
//! and one task per connection that answers one request at a time.
//!
//! sled and the fabric verbs block, so each request runs on tokio's blocking pool
//! (`spawn_blocking`): the async workers only move bytes, and a slow request (zeroing chunks, a
//! lock tree created for a large file) never stalls other connections.

use crate::service::Service;
use fabric::frame::{check_body, header_for, parse_header, FrameError, HEADER_LEN};
use fabric::handshake::{self, Protocol, Refusal, HANDSHAKE_TIMEOUT, MAX_HELLO_FRAME};
use proto::rpc::{HelloAnswer, RequestFrame, ResponseFrame, Role, Welcome, MAX_FRAME};
use proto::FsError;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{
    AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

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

/// Accepts connections until `stop` turns true.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    service: Arc<Service>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    // A client or data server that vanishes (cut link, dead host) must not
                    // keep its task and session for ever.
                    fabric::tcp::watch_peer(&stream);
                    let service = service.clone();
                    let stop = stop.clone();
                    tokio::spawn(async move {
                        if let Err(why) = connection(stream, service, stop).await {
                            tracing::debug!(%peer, why, "connection closed");
                        }
                    });
                }
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = stop.changed() => break,
        }
    }
}

/// Runs `f` on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, FsError> + Send + 'static,
) -> Result<T, FsError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(FsError::Io(format!("meta server internal error: {e}"))))
}

async fn connection(
    stream: TcpStream,
    service: Arc<Service>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), String> {
    let (r, w) = stream.into_split();
    let mut reader = BufReader::new(r);
    let mut writer = BufWriter::new(w);
    let mut body = Vec::new();
    // The shared handshake (fabric::handshake): an unauthenticated peer gets a small frame
    // limit and a deadline, and a refusal saying why.
    let settings = &service.settings;
    let hello = match tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        read_frame(&mut reader, MAX_HELLO_FRAME, &mut body),
    )
    .await
    {
        Ok(Ok(())) => handshake::accept::<Role>(&body, Protocol::Rpc, &settings.credentials),
        Ok(Err(e)) => Err(Refusal::BadHello(e.to_string())),
        Err(_) => Err(Refusal::BadHello(format!(
            "no hello within {HANDSHAKE_TIMEOUT:?}"
        ))),
    };
    let hello = match hello {
        Ok(hello) => hello,
        Err(refusal) => {
            tracing::warn!(%refusal, "refused a connection");
            let _ = send(&mut writer, &HelloAnswer::Err(refusal.clone())).await;
            return Err(refusal.to_string());
        }
    };
    match hello.role {
        Role::Client { host, pid } => {
            let svc = service.clone();
            let info = match blocking(move || svc.open_session()).await {
                Ok(info) => info,
                Err(e) => {
                    let refusal = Refusal::Rejected(e.to_string());
                    let _ = send(&mut writer, &HelloAnswer::Err(refusal)).await;
                    return Err(e.to_string());
                }
            };
            let session = info.session;
            tracing::info!(session, host, pid, "client session opened");
            send(&mut writer, &HelloAnswer::Ok(Welcome::Client(info)))
                .await
                .map_err(|e| e.to_string())?;
            let result = serve(&mut reader, &mut writer, &service, &mut stop, session).await;
            let svc = service.clone();
            let _ = blocking(move || {
                svc.end_session(session);
                Ok(())
            })
            .await;
            tracing::info!(session, "client session closed");
            result
        }
        Role::DataServer {
            fabric,
            region,
            region_bytes,
            name,
            incarnation,
        } => {
            let svc = service.clone();
            let registered = blocking(move || {
                svc.register_data_server(&name, fabric, region, region_bytes, incarnation)
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
            send(&mut writer, &HelloAnswer::Ok(Welcome::DataServer { id }))
                .await
                .map_err(|e| e.to_string())?;
            // The connection's life is the registration's: answer heartbeats until it closes.
            let result = loop {
                tokio::select! {
                    frame = tokio::time::timeout(
                        DATA_SERVER_SILENCE,
                        recv::<_, RequestFrame>(&mut reader, &mut body),
                    ) => match frame {
                        Err(_) => {
                            // A cut link or a frozen host closes nothing: without this bound the
                            // registration would stay live (and fences would wait on it) until
                            // TCP gave up, minutes later.
                            tracing::warn!(
                                id,
                                "data server silent for {DATA_SERVER_SILENCE:?}: declared gone"
                            );
                            break Err(format!(
                                "data server {id} sent nothing for {DATA_SERVER_SILENCE:?}"
                            ));
                        }
                        Ok(Err(why)) => break Err(why),
                        Ok(Ok(frame)) => {
                            let result = match frame.request {
                                proto::rpc::Request::Heartbeat => Ok(proto::rpc::Response::Ok),
                                proto::rpc::Request::AwaitRevocations { known } => {
                                    service.fence_applied(id, epoch, known);
                                    let mut watch = service.fence_watch();
                                    // Answer at once if newer revocations exist, else at the
                                    // first one or after a second (the poll is the heartbeat).
                                    // Meanwhile watch the connection: a data server that dies
                                    // must be marked gone at once (clients ask the layout to
                                    // learn where it comes back), not a second later.
                                    let poll = tokio::time::timeout(
                                        std::time::Duration::from_secs(1),
                                        watch.wait_for(|&newest| newest > known),
                                    );
                                    tokio::select! {
                                        _ = poll => {}
                                        filled = reader.fill_buf() => {
                                            if filled.map_or(true, |b| b.is_empty()) {
                                                break Err("the data server closed its registration".into());
                                            }
                                        }
                                    }
                                    let (newest, sessions) = service.revocations_since(known);
                                    Ok(proto::rpc::Response::Revocations {
                                        epoch: newest,
                                        sessions,
                                    })
                                }
                                _ => Err(FsError::Invalid(
                                    "a data server connection only takes heartbeats and \
                                     revocation polls"
                                        .into(),
                                )),
                            };
                            if let Err(e) = send(&mut writer, &ResponseFrame { id: frame.id, result }).await {
                                break Err(e.to_string());
                            }
                        }
                    },
                    _ = stop.changed() => break Ok(()),
                }
            };
            service.data_server_gone(id, epoch);
            result
        }
    }
}

/// Answers a client session's requests, one at a time, until the connection closes or the
/// server stops.
async fn serve<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    reader: &mut R,
    writer: &mut W,
    service: &Arc<Service>,
    stop: &mut watch::Receiver<bool>,
    session: u64,
) -> Result<(), String> {
    let mut body = Vec::new();
    loop {
        let frame: RequestFrame = tokio::select! {
            frame = recv(reader, &mut body) => frame?,
            _ = stop.changed() => return Ok(()),
        };
        let svc = service.clone();
        let request = frame.request;
        let result = blocking(move || svc.handle(session, request)).await;
        send(
            writer,
            &ResponseFrame {
                id: frame.id,
                result,
            },
        )
        .await
        .map_err(|e| e.to_string())?;
    }
}
