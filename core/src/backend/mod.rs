//! The plugin boundary: a `Backend` moves bytes between registered memory of two engines; the engine
//! does everything else (handshake, sessions, selection, chunking, notification ordering, timeouts,
//! telemetry). What a backend author needs besides the trait is in [`kit`].
//!
//! Contract for implementors (the conformance suite checks it):
//! - [`Backend::start`] is called once, inside the engine's tokio runtime, before anything else
//!   but `name` and `capabilities`; an error stops the engine from starting (say what is missing).
//! - [`Backend::register`] returns the public blob a peer needs for a region, or `None` when this
//!   backend cannot reach that memory (the engine then picks another backend for ops on it).
//! - [`Connection::submit`] returns one `Completion` per op, each resolving on its own: a slow op
//!   never delays its batchmates.
//! - An [`Op`] is dropped when it has ended: completed (for a WRITE, the bytes are in place at the
//!   peer), failed or cancelled, never before. The engine orders a notification after every op
//!   dropped before it: a backend keeps each `Op` until its completion is decided.
//! - Dropping a `Completion` cancels its op: once the drop returns, no more bytes of that op are
//!   written into local memory (the remote side of a WRITE may have received a prefix).
//! - Inbound operations on two-sided media are checked through [`BackendHost::resolve`] (key,
//!   permission, bounds, deregistration) and the returned `MemSlice` is held while the bytes move.
//! - [`Connection::notify`] delivers its message to the peer's [`BackendHost::deliver`]; the engine
//!   calls it only once every earlier op on the connection has ended.
//! - [`Connection::submit_noticed`] delivers its notice at the latest by the time the first op's
//!   completion resolves, and fails that op with the peer's refusal. The default sends it beside
//!   the ops with [`Connection::notify`]; a backend that can carry it in the first op's request
//!   (tcp) delivers it before serving that request, and saves the message and its answer.
//! - A peer that goes away fails pending ops with `Error::PeerClosed` (or the engine's timeout
//!   fires).
//!
//! # Writing a backend
//!
//! This module is the backend author's API (the crate root is the user's, [`crate::gpu`] the GPU
//! crate's). Implement [`Backend`] and [`Connection`]; [`kit`] has what a backend needs besides
//! the traits: completions that cancel on drop ([`kit::spawn_cancellable`], [`kit::gated`]),
//! [`kit::CancelGate`] and [`kit::gated_copy`] for CPU copies, [`kit::Serving`] (a listener's
//! host, tasks, live connections and shutdown), the bounded [`kit::Reader`] / [`kit::Writer`]
//! codec, [`kit::Framing`] checks for data headers, and [`kit::encode_error`] /
//! [`kit::decode_error`] to return an inbound op's refusal as the same error. A same-host medium
//! (memory one process can open in another) needs no backend of its own: implement
//! `tensorwire_shm::Medium` and run it with `ShmBackend::with_medium`, as the cuda backend does.
//!
//! - `register` returns the blob a peer needs, or `None` when this backend cannot reach that
//!   memory. [`RegionInfo::base`] is the address to register with a NIC or driver;
//!   [`RegionInfo::shareable`] is what a same-host backend passes to its peer.
//! - Deliver each inbound notification to [`BackendHost::deliver`] and send its result back:
//!   the sender's `notify` returns it (a full queue, or the receiver's handler's verdict).
//! - A medium whose requests can carry a few bytes overrides [`Connection::submit_noticed`] and
//!   delivers the notice before serving the first op's request (tcp puts it in the READ's
//!   request).
//!
//! A complete backend, "toy": both engines in one process, their backends found through a
//! table, every op a CPU copy between the two engines' registered memory ([`MemBackend`] is the
//! same with shutdown and peer checks).
//!
//! ```
//! use std::collections::HashMap;
//! use std::sync::{Arc, Mutex, OnceLock};
//!
//! use async_trait::async_trait;
//! use bytes::Bytes;
//! use tensorwire_core::backend::kit::spawn_cancellable;
//! use tensorwire_core::backend::{
//!     Backend, BackendHost, Capabilities, Completion, Connection, Direction, Op,
//!     PeerBackendInfo, RegionInfo,
//! };
//! use tensorwire_core::{Engine, Error, Missing, Permissions, RegionId, Result, TransferOp};
//!
//! /// Every started toy backend's host, by the id in its endpoint.
//! static HOSTS: Mutex<Vec<Arc<dyn BackendHost>>> = Mutex::new(Vec::new());
//!
//! #[derive(Debug, Default)]
//! struct Toy { id: OnceLock<u32> }
//!
//! #[async_trait]
//! impl Backend for Toy {
//!     fn name(&self) -> &'static str { "toy" }
//!     fn capabilities(&self) -> Capabilities { Capabilities::host(true, 1 << 20) }
//!     async fn start(&self, host: Arc<dyn BackendHost>) -> Result<()> {
//!         let mut hosts = HOSTS.lock().unwrap();
//!         hosts.push(host);
//!         self.id.set(hosts.len() as u32 - 1).map_err(|_| Error::Internal("started twice".into()))
//!     }
//!     fn endpoint(&self) -> Bytes { Bytes::copy_from_slice(&self.id.get().unwrap().to_le_bytes()) }
//!     async fn register(&self, region: &RegionInfo) -> Result<Option<Bytes>> {
//!         Ok(region.kind.is_host().then(Bytes::new)) // the peer reaches it through its host
//!     }
//!     async fn deregister(&self, _: RegionId) -> Result<()> { Ok(()) }
//!     async fn connect(&self, peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>> {
//!         let id = <[u8; 4]>::try_from(&peer.endpoint[..])
//!             .map_err(|_| Error::Protocol("toy endpoint".into()))?;
//!         let host = HOSTS.lock().unwrap().get(u32::from_le_bytes(id) as usize).cloned();
//!         let host = host.ok_or_else(|| Error::NotFound(Missing::Peer("toy".into())))?;
//!         Ok(Arc::new(ToyConnection { peer: host }))
//!     }
//!     async fn shutdown(&self) {}
//! }
//!
//! #[derive(Debug)]
//! struct ToyConnection { peer: Arc<dyn BackendHost> }
//!
//! impl Connection for ToyConnection {
//!     fn submit(&self, ops: Vec<Op>) -> Vec<Completion> {
//!         let one = |op: Op| {
//!             let peer = self.peer.clone();
//!             spawn_cancellable(move |gate| async move {
//!                 // The peer's engine checks region, key, permission and bounds.
//!                 let remote = peer.resolve(op.range(), op.dir().remote_access())?;
//!                 let (dst, src) = match op.dir() {
//!                     Direction::Read => (op.local(), &remote),
//!                     Direction::Write => (&remote, op.local()),
//!                 };
//!                 // No byte lands once the completion was dropped; the op ends with this task.
//!                 gate.run(|| dst.copy_from(src)).unwrap_or(Ok(()))
//!             })
//!         };
//!         ops.into_iter().map(one).collect()
//!     }
//!     fn notify(&self, msg: Bytes) -> Completion {
//!         let r = self.peer.deliver(msg);
//!         Box::pin(async move { r })
//!     }
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let a = Engine::builder().backend(Arc::new(Toy::default())).start().await?;
//! let b = Engine::builder().backend(Arc::new(Toy::default())).start().await?;
//! let src = a.alloc(4096, Permissions::NONE).await?;
//! src.write_bytes(0, &[7; 4096])?;
//! let dst = b.alloc(4096, Permissions::WRITE).await?;
//! let session = a.connect(b.local_addr()).await?;
//! let report = session.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, 4096)).await?;
//! assert_eq!(report.backend, "toy");
//! assert_eq!(dst.to_vec(0, 4096)?, vec![7; 4096]);
//! # Ok::<(), Error>(()) }).unwrap();
//! ```
//!
//! Then run the conformance suite (`tensorwire-conformance`) against it, in the crate's one test
//! binary (`tests/it/main.rs` and its modules): `conformance_tests!(BackendPair::new(||
//! my_backend()))` in one module, the two-process tests with `multiprocess_tests!("engine",
//! my_backend)` in another, and `children! { "engine" => two_process::child }` at the root.

pub mod channel;
pub mod kit;
#[cfg(not(loom))]
mod mem;
mod serving;

pub use crate::region::Access;
#[cfg(not(loom))]
pub use mem::MemBackend;

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::{Error, Result};
use crate::fence::FenceTicket;
use crate::ids::{AccessKey, EngineId, RegionId};
use crate::memory::{MemoryKind, MemoryKinds, ShareableMemory};
use crate::region::{MemSlice, Permissions};

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

impl Capabilities {
    /// A backend that moves host memory both ways and carries notifications (`same_host_only`:
    /// it needs both engines on one host), in ops of at most `max_request_bytes`.
    pub const fn host(same_host_only: bool, max_request_bytes: u64) -> Capabilities {
        Capabilities {
            local: MemoryKinds::HOST,
            remote: MemoryKinds::HOST,
            read: true,
            write: true,
            notify: true,
            same_host_only,
            max_request_bytes,
        }
    }
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
    /// "read" or "write".
    pub fn name(self) -> &'static str {
        match self {
            Direction::Read => "read",
            Direction::Write => "write",
        }
    }

    /// The access the op makes on the remote region.
    pub fn remote_access(self) -> Access {
        match self {
            Direction::Read => Access::Read,
            Direction::Write => Access::Write,
        }
    }
}

/// The remote end of an op: region, key, offset, and the backend's public blob for it.
#[derive(Debug, Clone)]
pub struct RemoteSlice {
    /// Region id on the peer.
    pub region: RegionId,
    /// Access key.
    pub key: AccessKey,
    /// Offset in the region.
    pub offset: u64,
    /// This backend's public blob for the region (what the peer's `register` returned).
    pub blob: Bytes,
}

/// The bytes an op names in its remote region, as the initiator sends them and the target's
/// backend hands them to [`BackendHost::resolve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRange {
    /// Region id on the target.
    pub region: RegionId,
    /// Access key the target checks.
    pub key: AccessKey,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One READ or WRITE between a local slice and a remote slice of the same length. Made by the
/// engine; keep it until the op has ended and drop it then (see the module contract): it carries
/// the engine's notification fence, which is why its parts are reached through accessors and
/// never moved out one by one.
#[derive(Debug)]
pub struct Op {
    pub(crate) dir: Direction,
    pub(crate) local: MemSlice,
    pub(crate) remote: RemoteSlice,
    pub(crate) ticket: FenceTicket,
    /// How the engine runs the op on another backend ([`Op::fall_back`]).
    pub(crate) fallback: Option<Arc<dyn Reroute>>,
}

impl Op {
    /// Direction.
    pub fn dir(&self) -> Direction {
        self.dir
    }
    /// Local memory (the length of the op).
    pub fn local(&self) -> &MemSlice {
        &self.local
    }
    /// Remote memory.
    pub fn remote(&self) -> &RemoteSlice {
        &self.remote
    }
    /// The remote bytes the op touches (its remote slice, the length of its local one).
    pub fn range(&self) -> RemoteRange {
        let r = &self.remote;
        RemoteRange { region: r.region, key: r.key, offset: r.offset, len: self.local.len() }
    }
    /// Ends the op and keeps only its local memory (e.g. to [`MemSlice::detach`] it when the
    /// transport may still touch it after giving up).
    pub fn into_local(self) -> MemSlice {
        let Op { local, ticket, .. } = self;
        drop(ticket);
        local
    }

    /// Hands the op back to the engine, to run on its next backend (in the engine's preference
    /// order, after this one) that the peer shares and that can move it: for a backend that lost
    /// every path to the peer (all its rails failed) while another medium still works. The op
    /// keeps its place in notification order until the other backend ended it, and the same
    /// rules hold for the returned completion (dropping it cancels the op). Call it only once no
    /// byte of the op is still being moved by this backend. Resolves to `why` when no other
    /// backend can carry the op. Moving the op again is safe: a READ or WRITE of the same bytes
    /// is idempotent.
    pub fn fall_back(self, why: Error) -> Completion {
        let Op { dir, local, remote, ticket, fallback } = self;
        match fallback {
            Some(f) => f.run(dir, local, remote, ticket, why),
            None => crate::completion::ready(Err(why)),
        }
    }
}

pub use crate::completion::Completion;

/// How the engine runs an op on another of its backends ([`Op::fall_back`]); the engine
/// implements it, so this module names nothing of the engine's.
pub(crate) trait Reroute: Send + Sync + Debug {
    /// Runs the op `dir` of `local` <-> `remote` on the next backend that can; `ticket` (the
    /// op's place in notification order) is held until it ends there; `why` when none can.
    fn run(
        self: Arc<Self>,
        dir: Direction,
        local: MemSlice,
        remote: RemoteSlice,
        ticket: FenceTicket,
        why: Error,
    ) -> Completion;
}

/// A region as a backend sees it at registration.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RegionInfo {
    /// Region id.
    pub id: RegionId,
    /// Memory kind.
    pub kind: MemoryKind,
    /// Length in bytes.
    pub len: u64,
    /// Peer permissions.
    pub perms: Permissions,
    pub(crate) addr: usize,
    pub(crate) shareable: Option<ShareableMemory>,
}

impl RegionInfo {
    /// The region's base address, in the address space of its memory kind (a device pointer for
    /// device memory), for backends that register memory with hardware (a NIC, a driver). Valid
    /// until the backend's `deregister` for this region returns.
    pub fn base(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// Engine-allocated host memory can be shared with another process of this host (a same-host
    /// backend passes the descriptor to its peer); `None` for caller memory and empty regions.
    pub fn shareable(&self) -> Option<&ShareableMemory> {
        self.shareable.as_ref()
    }
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
    fn resolve(&self, range: RemoteRange, access: Access) -> Result<MemSlice>;
    /// Delivers an inbound notification; an error (queue full) goes back to the sender.
    fn deliver(&self, msg: Bytes) -> Result<()>;
    /// A pinned host buffer of the engine's staging pool, for a backend that moves bytes into or
    /// out of a device region the CPU cannot reach (it receives into the bounce and copies it
    /// over with [`MemSlice::copy_from`], or the other way). Waits while every bounce is in
    /// use; `Unsupported` when the engine has no GPU driver.
    fn bounce(&self) -> Pin<Box<dyn Future<Output = Result<crate::bounce::Bounce>> + Send>>;
    /// The engine's cluster secret, for a backend that serves connections of its own (a setup or
    /// control channel) and authenticates them with [`crate::handshake`] like the engine's
    /// control endpoint; `None` when the engine runs without one. Never log it.
    fn cluster_secret(&self) -> Option<crate::auth::ClusterSecret>;
}

/// A transport plugin. Object-safe; the engine holds it as `Arc<dyn Backend>`.
#[async_trait]
pub trait Backend: Send + Sync + Debug + 'static {
    /// Short stable name ("mem", "tcp", "shm", ...).
    fn name(&self) -> &'static str;
    /// What it can do.
    fn capabilities(&self) -> Capabilities;
    /// Starts serving for the engine `host`: called once, inside the engine's runtime, before any
    /// other call except `name` and `capabilities`. Fails when the backend cannot serve (no
    /// runtime, no device, a listener that cannot start).
    async fn start(&self, host: Arc<dyn BackendHost>) -> Result<()>;
    /// What a peer needs to reach this backend.
    fn endpoint(&self) -> Bytes;
    /// Registers a region; returns the public blob peers need for it, or `None` when this backend
    /// cannot reach the region's memory (ops on it then go through another backend).
    async fn register(&self, region: &RegionInfo) -> Result<Option<Bytes>>;
    /// Forgets a region.
    async fn deregister(&self, id: RegionId) -> Result<()>;
    /// Opens a connection to a peer's backend.
    async fn connect(&self, peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>>;
    /// Stops serving: pending and later ops on either side fail with `PeerClosed`.
    async fn shutdown(&self);
    /// Counters of the backend's own (per NIC, per rail, ...), as (name, value) pairs, for
    /// [`crate::Engine::backend_stats`]. The default: none.
    fn stats(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
}

/// A connection to one peer's backend.
pub trait Connection: Send + Sync + Debug + 'static {
    /// Starts the ops; one completion per op, in the same order.
    fn submit(&self, ops: Vec<Op>) -> Vec<Completion>;
    /// Sends a small message to the peer's [`BackendHost::deliver`]; resolves once it was
    /// delivered (or refused, with the peer's error). The engine orders it after earlier ops.
    fn notify(&self, msg: Bytes) -> Completion;
    /// [`Connection::submit`] with `notice` for the peer's [`BackendHost::deliver`]: the first
    /// op's completion resolves only once the notice was delivered, and fails with the peer's
    /// refusal (or the notice's own failure) even when its bytes moved. Unordered: the notice
    /// waits for no earlier op. The default sends it beside the ops with [`Connection::notify`];
    /// a backend that can carry it in the first op's request delivers it before serving that
    /// request (one message instead of two, and no answer of its own).
    fn submit_noticed(&self, notice: Bytes, ops: Vec<Op>) -> Vec<Completion> {
        crate::completion::notice_beside(self.notify(notice), self.submit(ops))
    }
    /// Why this connection can carry nothing more (a stream failed, the peer went away), or
    /// `None` while it works. The engine then opens a new connection for later transfers, so a
    /// healed network or a restarted peer needs no restart here. The default: never broken.
    fn broken(&self) -> Option<Error> {
        None
    }
    /// Moves `local.len()` bytes in direction `dir` between `local` and `remote` within this
    /// call, when this connection can now (a same-host copy into memory it already holds a
    /// lease on) and the op fits in `budget` (the bytes the caller may still spend copying
    /// inside its call, which an op run here takes from), and returns how it ended; `None`
    /// when it cannot, and then no byte moved and the engine submits the op the usual way.
    /// For [`crate::PreparedTransfer::post`] and lone ops: an op that ends inside the call
    /// needs no fence ticket or completion. `remote` names bytes the peer showed (checked by
    /// the engine against its descriptor), and the peer's checks of key and bounds hold as
    /// for [`Connection::submit`]. The default: never.
    fn run_now(
        &self,
        dir: Direction,
        local: &MemSlice,
        remote: &RemoteSlice,
        budget: &mut u64,
    ) -> Option<Result<()>> {
        let _ = (dir, local, remote, budget);
        None
    }
}
