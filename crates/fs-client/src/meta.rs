//! The connection to the meta server: calls, reconnection, and the heartbeat that keeps the
//! session alive.
//!
//! One connection serves the whole client, behind a mutex. Only namespace operations, opens and
//! chunk allocations use it; reads and writes of allocated chunks never do. It is one connection
//! (one session) rather than a pool because the meta server ties open files to the session that
//! opened them: a pool of sessions would have to send each `Release` down the connection that
//! sent the matching `Open`.

use crate::error::Error;
use proto::rpc::{self, Request, Response, Role, Welcome};
use proto::ClusterInfo;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long one call may wait for its answer before the connection is declared dead: the
/// meta server's default session lease (10 s), since a session unanswered for that long is
/// gone on the server anyway. The slowest legitimate call, a `Fence`, waits at most 3 s for
/// the data servers; a cut link must not block a caller (and the heartbeat) for minutes.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The meta server connection (reconnected on demand after a failure).
pub(crate) struct Meta {
    addr: String,
    cluster: String,
    token: String,
    host: String,
    conn: Mutex<Option<rpc::Client>>,
}

impl Meta {
    /// Connects and opens the session.
    pub(crate) fn connect(
        addr: &str,
        cluster: &str,
        token: &str,
        host: &str,
    ) -> Result<(Meta, ClusterInfo), Error> {
        let meta = Meta {
            addr: addr.into(),
            cluster: cluster.into(),
            token: token.into(),
            host: host.into(),
            conn: Mutex::new(None),
        };
        let (client, info) = meta.open()?;
        *meta.conn.lock().unwrap_or_else(PoisonError::into_inner) = Some(client);
        Ok((meta, info))
    }

    fn open(&self) -> Result<(rpc::Client, ClusterInfo), Error> {
        let role = Role::Client {
            host: self.host.clone(),
            pid: std::process::id(),
        };
        let credentials = fabric::Credentials::new(self.cluster.clone(), self.token.clone());
        let client = rpc::Client::connect(self.addr.as_str(), &credentials, role)
            .map_err(|e| self.rpc_error(e))?;
        client
            .set_timeout(Some(CALL_TIMEOUT))
            .map_err(|e| self.rpc_error(e))?;
        match client.welcome() {
            Welcome::Client(info) => {
                let info = info.clone();
                Ok((client, info))
            }
            other => Err(Error::Protocol(format!(
                "meta server {} answered the client handshake with {other:?}",
                self.addr
            ))),
        }
    }

    fn rpc_error(&self, source: rpc::RpcError) -> Error {
        Error::Rpc {
            addr: self.addr.clone(),
            source,
        }
    }

    /// Makes one call: the meta server's answer, or `Error::Fs` with the error it answered.
    /// A broken connection is dropped and the call fails with `Error::Rpc`; the next call
    /// reconnects (as a new session: files opened before must be reopened).
    pub(crate) fn call(&self, request: Request) -> Result<Response, Error> {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        if conn.is_none() {
            let (client, info) = self.open()?;
            tracing::warn!(session = info.session, "reconnected to the meta server");
            *conn = Some(client);
        }
        let client = conn.as_mut().expect("connected above");
        match client.call(request) {
            Ok(answer) => Ok(answer?),
            Err(e) => {
                // The stream may be mid-frame: never reuse it.
                *conn = None;
                Err(self.rpc_error(e))
            }
        }
    }
}

/// The heartbeat thread: renews the session every `period` until stopped.
pub(crate) struct Heartbeat {
    stop: mpsc::Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    /// Starts heartbeats on `meta` every `period` (at least every 5 ms).
    pub(crate) fn start(meta: Arc<Meta>, period: Duration) -> Result<Heartbeat, Error> {
        let period = period.max(Duration::from_millis(5));
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("citronfs-heartbeat".into())
            .spawn(move || loop {
                match stopped.recv_timeout(period) {
                    Err(RecvTimeoutError::Timeout) => {
                        if let Err(error) = meta.call(Request::Heartbeat) {
                            tracing::warn!(%error, "session heartbeat failed");
                        }
                    }
                    // Stopped, or the owner is gone.
                    _ => return,
                }
            })
            .map_err(Error::Heartbeat)?;
        Ok(Heartbeat {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        let _ = self.stop.send(());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A response of the wrong kind: the meta server broke the protocol.
pub(crate) fn unexpected(call: &'static str, response: Response) -> Error {
    Error::UnexpectedResponse {
        call,
        got: short(&response),
    }
}

fn short(response: &Response) -> &'static str {
    match response {
        Response::Ok => "Ok",
        Response::Attr(_) => "Attr",
        Response::Entries(_) => "Entries",
        Response::Data(_) => "Data",
        Response::Names(_) => "Names",
        Response::Stats(_) => "Stats",
        Response::Open(_) => "Open",
        Response::Chunks(_) => "Chunks",
        Response::Addr(_) => "Addr",
        Response::Revocations { .. } => "Revocations",
    }
}
