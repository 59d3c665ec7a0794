//! The plugin boundary: a `Backend` moves bytes between registered memory of two engines; the engine
//! does everything else (handshake, sessions, selection, chunking, timeouts, telemetry).
//!
//! Contract for implementors (the conformance suite checks it):
//! - `Connection::submit` returns one `Completion` per op, each resolving on its own: a slow op never
//!   delays its batchmates.
//! - Dropping a `Completion` cancels its op: once the drop returns, no more bytes of that op are written
//!   into local memory (the remote side of a WRITE may have received a prefix).
//! - Inbound operations on two-sided media are checked through `BackendHost::resolve` (key,
//!   permission, bounds, deregistration) and the returned `MemSlice` is held while the bytes move.
//! - `Connection::notify` delivers its message after every op submitted before it on the connection.
//! - A peer that goes away fails pending ops with `Error::PeerClosed` (or the engine's timeout fires).

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::Result;
use crate::ids::{AccessKey, EngineId, RegionId};
use crate::memory::{MemoryKind, MemoryKinds};
use crate::region::{Access, MemSlice, Permissions};

/// What a backend can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Memory kinds it can move from or into locally.
    pub local: MemoryKinds,
    /// Memory kinds it can reach on the peer.
    pub remote: MemoryKinds,
    /// Supports READ.
    pub read: bool,
    /// Supports WRITE.
    pub write: bool,
    /// Supports notifications.
    pub notify: bool,
    /// Only works when both engines are on the same host.
    pub same_host_only: bool,
    /// Largest single op; the engine splits larger transfers.
    pub max_request_bytes: u64,
}

/// Direction of an op, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Remote -> local.
    Read,
    /// Local -> remote.
    Write,
}

impl Direction {
    /// The access the op makes on the remote region.
    pub fn remote_access(self) -> Access {
        match self {
            Direction::Read => Access::Read,
            Direction::Write => Access::Write,
        }
    }
}

/// The remote end of an op: region, key, offset, length, and the backend's public blob for it.
#[derive(Debug, Clone)]
pub struct RemoteSlice {
    /// Region id on the peer.
    pub region: RegionId,
    /// Access key.
    pub key: AccessKey,
    /// Offset in the region.
    pub offset: u64,
    /// This backend's public blob for the region (empty when it registered none).
    pub blob: Bytes,
}

/// One READ or WRITE between a local slice and a remote slice of the same length.
#[derive(Debug)]
pub struct Op {
    /// Direction.
    pub dir: Direction,
    /// Local memory (length of the op).
    pub local: MemSlice,
    /// Remote memory.
    pub remote: RemoteSlice,
}

/// The completion of one op. Dropping it cancels the op (see the module contract).
pub type Completion = Pin<Box<dyn Future<Output = Result<()>> + Send + 'static>>;

/// What a backend registers for a region.
#[derive(Debug, Clone)]
pub struct RegionInfo {
    /// Region id.
    pub id: RegionId,
    /// Memory kind.
    pub kind: MemoryKind,
    /// Base address.
    pub addr: usize,
    /// Length in bytes.
    pub len: u64,
    /// Peer permissions.
    pub perms: Permissions,
    /// The memfd behind engine-allocated host memory (for same-host mapping), if any.
    pub fd: Option<std::os::fd::RawFd>,
}

/// What a backend needs to reach a peer: its engine, host identity and this backend's endpoint blob.
#[derive(Debug, Clone)]
pub struct PeerBackendInfo {
    /// Peer engine.
    pub engine: EngineId,
    /// Peer host identity.
    pub host: String,
    /// The peer backend's `endpoint()` blob.
    pub endpoint: Bytes,
}

/// The engine side a backend calls into: region lookup for inbound ops, and the inbound
/// notification sink.
pub trait BackendHost: Send + Sync + Debug + 'static {
    /// Resolves an inbound access, checking region existence, key, permission and bounds in that order.
    fn resolve(
        &self,
        region: RegionId,
        key: AccessKey,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<MemSlice>;
    /// Delivers an inbound notification; an error (queue full) goes back to the sender.
    fn deliver(&self, msg: Bytes) -> Result<()>;
}

/// A transport plugin. Object-safe; the engine holds it as `Arc<dyn Backend>`.
#[async_trait]
pub trait Backend: Send + Sync + Debug + 'static {
    /// Short stable name ("mem", "tcp", "shm", ...).
    fn name(&self) -> &'static str;
    /// What it can do.
    fn capabilities(&self) -> Capabilities;
    /// Called once by the engine before any other call except `name` and `capabilities`.
    fn attach(&self, host: Arc<dyn BackendHost>);
    /// What a peer needs to reach this backend.
    fn endpoint(&self) -> Bytes;
    /// Registers a region; returns the public blob peers need for it.
    async fn register(&self, region: &RegionInfo) -> Result<Bytes>;
    /// Forgets a region.
    async fn deregister(&self, id: RegionId) -> Result<()>;
    /// Whether this backend can reach a remote region, given the blob the peer's instance of this
    /// backend registered for it (`None`: the region carries none). The engine skips to the next
    /// backend when this is false (e.g. shared memory cannot reach caller-registered memory).
    fn reaches(&self, blob: Option<&Bytes>) -> bool {
        let _ = blob;
        true
    }
    /// Opens a connection to a peer's backend.
    async fn connect(&self, peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>>;
    /// Stops serving: pending and later ops on either side fail with `PeerClosed`.
    async fn shutdown(&self);
}

/// A connection to one peer's backend.
pub trait Connection: Send + Sync + Debug + 'static {
    /// Starts the ops; one completion per op, in the same order.
    fn submit(&self, ops: Vec<Op>) -> Vec<Completion>;
    /// Sends a small message, delivered after every op submitted before it.
    fn notify(&self, msg: Bytes) -> Completion;
}
