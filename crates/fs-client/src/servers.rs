//! The servers this client reaches, and how: one fabric connector for the meta region, one per
//! data server (with what the meta server said about it: its region and size), and the lock
//! service's address for a scheme that keeps its locks at one
//! ([`lockmgr::schemes::Placement::Service`]).
//!
//! Invariants: a table is fixed once built; a change of the cluster builds a new one for a new
//! `view`, reusing the connectors of servers that did not change. Data servers are indexed by
//! id (ids are checked to be below `2^16`, so the table stays small). A connector makes
//! endpoints; endpoints themselves belong to workers (`workers`).

use crate::error::{Error, Peer};
use crate::options::MountOptions;
use fabric::{Connector, FabricError, RegionId};
use lockmgr::schemes::LockServerAt;
use proto::{ClusterInfo, DataServerInfo, FabricAddr, FsError};
use std::net::ToSocketAddrs;
use std::sync::Arc;

/// One data server as this client reaches it.
pub(crate) struct DataServer {
    pub(crate) info: DataServerInfo,
    pub(crate) connector: Arc<dyn Connector>,
}

/// The connectors to every fabric server of the cluster (see the module docs).
pub(crate) struct Servers {
    /// The meta server's fabric (file control blocks and lock words).
    pub(crate) meta: Arc<dyn Connector>,
    /// Where `meta` reaches.
    meta_fabric: FabricAddr,
    /// Indexed by data server id.
    data: Vec<Option<DataServer>>,
    /// The lock service of a scheme that keeps its locks at one, and the cluster credentials
    /// it checks (`None` where each file has a lock of its own).
    pub(crate) lock_service: Option<LockServerAt>,
}

impl Servers {
    /// Attaches to the meta region and every data server `info` names, for session
    /// `info.session`, and resolves the lock service when `opts.scheme` uses one. The connectors
    /// of `reuse` (a table of the same session) are kept for servers whose address — and, for
    /// data servers, incarnation — did not change.
    pub(crate) fn connect(
        info: &ClusterInfo,
        opts: &MountOptions,
        reuse: Option<&Servers>,
    ) -> Result<Servers, Error> {
        let meta = match reuse {
            Some(old) if old.meta_fabric == info.meta_fabric => old.meta.clone(),
            _ => connector_for(&info.meta_fabric, opts, info.session)
                .map_err(Error::fabric(Peer::Meta))?,
        };
        let mut data: Vec<Option<DataServer>> = Vec::new();
        for ds in &info.data_servers {
            let id = ds.id as usize;
            if id > 1 << 16 {
                return Err(Error::Protocol(format!(
                    "data server id {id} is implausible"
                )));
            }
            if data.len() <= id {
                data.resize_with(id + 1, || None);
            }
            // Never an `Away` stand-in: the old entry must have been live.
            let kept = reuse.and_then(|old| old.data(ds.id)).filter(|old| {
                old.info.live
                    && old.info.fabric == ds.fabric
                    && old.info.incarnation == ds.incarnation
            });
            let connector = match kept {
                Some(old) => old.connector.clone(),
                // A server that is away now (not registered) is not tried: on tcp a server cut
                // off answers nothing, and every new view would wait out the connect bound for
                // it, holding up the calls that need the view. It may be back by the time a
                // chunk on it is needed: its I/O waits for it then (`view`), the others go on;
                // its registration brings a new view, which connects to it.
                None if !ds.live => Arc::new(Away(ds.id)),
                None => connector_for(&ds.fabric, opts, info.session)
                    .map_err(Error::fabric(Peer::Data(ds.id)))?,
            };
            data[id] = Some(DataServer {
                info: ds.clone(),
                connector,
            });
        }
        let lock_service = match (opts.scheme.uses_service(), &info.lock_server) {
            (true, Some(addr)) => Some(LockServerAt {
                addr: addr
                    .to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or_else(|| Error::Protocol(format!("bad lock server address {addr:?}")))?,
                credentials: opts.credentials(),
            }),
            (true, None) => {
                return Err(FsError::Invalid(format!(
                    "the cluster runs no lock server: the {} scheme is unavailable",
                    opts.scheme.name()
                ))
                .into())
            }
            (false, _) => None,
        };
        Ok(Servers {
            meta,
            meta_fabric: info.meta_fabric.clone(),
            data,
            lock_service,
        })
    }

    /// Data server `server`, if this client knows it.
    pub(crate) fn data(&self, server: u32) -> Option<&DataServer> {
        self.data.get(server as usize).and_then(Option::as_ref)
    }

    /// The region data server `server` serves its chunks from.
    pub(crate) fn region_of(&self, server: u32) -> Result<RegionId, Error> {
        self.data(server)
            .map(|ds| ds.info.region)
            .ok_or(Error::UnknownDataServer(server))
    }
}

/// The connector of a data server that was away (not registered with the meta server) when the
/// view was built: every connect fails, as a transient failure, so that the I/O waits for the
/// server (`view`).
struct Away(u32);

impl Connector for Away {
    fn connect(&self) -> Result<Box<dyn fabric::Endpoint>, FabricError> {
        Err(FabricError::Disconnected(format!(
            "data server {} was away (not registered) when this client last learnt the layout",
            self.0
        )))
    }
}

/// A connector to a fabric server for client session `session` (tcp endpoints present it, so
/// the cluster can fence this client; shm cannot refuse anyone). The caller names the server
/// in the error.
fn connector_for(
    addr: &FabricAddr,
    opts: &MountOptions,
    session: u64,
) -> Result<Arc<dyn Connector>, FabricError> {
    fabric::connect_with(addr, &opts.credentials(), session, opts.fabric_timeouts)
}
