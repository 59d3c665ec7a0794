//! The nodes of a cluster store as its client sees them: how to reach one ([`Dial`]), what it
//! offers ([`Member`]: the store API and a listing), and whether it is thought alive. A node
//! whose call failed loses its connection and is dialled again on its next use; a node that
//! cannot be dialled is left out of placement for a short while, then tried again.

use std::fmt::Debug;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use tensorwire_core::{Engine, Error};

use super::placement::NodeId;
use crate::api::{ObjectInfo, Store};
use crate::embedded::EmbeddedStore;
use crate::error::{Result, StoreError};
use crate::remote::RemoteStore;

/// A node of a cluster store: the [`Store`] API and a listing of its objects.
#[async_trait]
pub trait Member: Store {
    /// Up to `limit` objects with keys after `after`, in key order.
    async fn list(&self, after: &[u8], limit: usize) -> Result<Vec<ObjectInfo>>;
    /// The client is dropped after its node failed: release what it holds of the node (its
    /// engine session's connections).
    async fn close(&self) {}
}

#[async_trait]
impl Member for RemoteStore {
    async fn list(&self, after: &[u8], limit: usize) -> Result<Vec<ObjectInfo>> {
        RemoteStore::list(self, after, limit).await
    }

    async fn close(&self) {
        self.session().close().await;
    }
}

#[async_trait]
impl Member for EmbeddedStore {
    async fn list(&self, after: &[u8], limit: usize) -> Result<Vec<ObjectInfo>> {
        Ok(EmbeddedStore::list(self, after, limit))
    }
}

/// Reaches a node by its id.
#[async_trait]
pub trait Dial: Send + Sync + Debug {
    /// A client of `node`.
    async fn dial(&self, node: &NodeId) -> Result<Arc<dyn Member>>;
    /// Whether `node` runs on this host (reads try such replicas first).
    fn local(&self, node: &NodeId) -> bool;
}

/// Store nodes over the network: a node's id is its RPC address, dialled with
/// [`RemoteStore::connect_node`] from `engine`.
#[derive(Debug, Clone)]
pub struct RemoteDial {
    /// The engine object bytes move through.
    pub engine: Engine,
}

#[async_trait]
impl Dial for RemoteDial {
    async fn dial(&self, node: &NodeId) -> Result<Arc<dyn Member>> {
        let addr: SocketAddr = node.parse().map_err(|_| {
            StoreError::InvalidArgument(format!("store node id {node:?} is not an address"))
        })?;
        Ok(Arc::new(RemoteStore::connect_node(&self.engine, addr).await?))
    }

    fn local(&self, node: &NodeId) -> bool {
        let ip = node.parse::<SocketAddr>().map(|a| a.ip());
        ip.is_ok_and(|ip| ip.is_loopback() || ip == self.engine.local_addr().ip())
    }
}

/// Whether `e` says the node failed (so the call goes to another replica), rather than the
/// caller's arguments or the object.
pub(crate) fn node_failed(e: &StoreError) -> bool {
    match e {
        StoreError::Engine(e) => !matches!(
            e,
            Error::InvalidArgument(_)
                | Error::OutOfBounds { .. }
                | Error::InvalidTensor(_)
                | Error::Unsupported { .. }
        ),
        StoreError::Io { .. } | StoreError::Corrupt(_) | StoreError::Internal(_) => true,
        _ => false,
    }
}

/// One node as the client tracks it.
#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) id: NodeId,
    client: tokio::sync::Mutex<Option<Arc<dyn Member>>>,
    /// Left out of placement until then (its last dial failed).
    down_until: Mutex<Option<Instant>>,
}

impl Node {
    pub(crate) fn new(id: NodeId) -> Node {
        Node { id, client: tokio::sync::Mutex::new(None), down_until: Mutex::new(None) }
    }

    /// Thought alive: never failed a dial, or its time out has passed.
    pub(crate) fn up(&self) -> bool {
        self.down_until.lock().is_none_or(|t| Instant::now() >= t)
    }

    /// The node's client, dialled (within `timeout`) if it has none; and whether it was
    /// dialled just now (a connection kept from earlier may have gone stale: its node restarted).
    pub(crate) async fn client(
        &self,
        dial: &dyn Dial,
        timeout: Duration,
        down_for: Duration,
    ) -> Result<(Arc<dyn Member>, bool)> {
        let mut c = self.client.lock().await;
        if let Some(m) = c.as_ref() {
            return Ok((m.clone(), false));
        }
        let dialled = match tokio::time::timeout(timeout, dial.dial(&self.id)).await {
            Ok(r) => r,
            Err(_) => {
                Err(Error::timeout(format!("dialling store node {}", self.id), timeout).into())
            }
        };
        match dialled {
            Ok(m) => {
                *self.down_until.lock() = None;
                *c = Some(m.clone());
                Ok((m, true))
            }
            Err(e) => {
                *self.down_until.lock() = Some(Instant::now() + down_for);
                Err(e)
            }
        }
    }

    /// A call through `m` failed with `e`: if the node failed, its connection is dropped (the
    /// next use dials again).
    pub(crate) async fn failed(&self, m: &Arc<dyn Member>, e: &StoreError) {
        if node_failed(e) {
            let mut c = self.client.lock().await;
            if c.as_ref().is_some_and(|cur| Arc::ptr_eq(cur, m)) {
                *c = None;
                drop(c);
                m.close().await;
            }
        }
    }
}
