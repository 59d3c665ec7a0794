//! The `Backend` and `Connection` the engine sees: thin senders of commands to the progress
//! thread, and completions whose drop cancels safely (see [`OpGate`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tensorwire_core::backend::{
    Backend, BackendHost, Capabilities, Completion, Connection, Direction, Op, PeerBackendInfo,
    RegionInfo,
};
use tensorwire_core::{Error, RegionId, Result};
use tokio::sync::oneshot;

use crate::gate::OpGate;
use crate::progress::{self, Cmd, Handle};
use crate::tokens::Submitted;
use crate::{NAME, UcxConfig};

fn gone() -> Error {
    Error::PeerClosed("local ucx backend shut down".into())
}

/// Awaits a reply from the progress thread, at most `bound`.
async fn reply<T>(rx: oneshot::Receiver<Result<T>>, what: &str, bound: Duration) -> Result<T> {
    match tokio::time::timeout(bound, rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(gone()),
        Err(_) => Err(Error::timeout(format!("ucx: {what}"), bound)),
    }
}

/// The UCX backend (one per engine; one progress thread each).
#[derive(Debug)]
pub struct UcxBackend {
    cfg: UcxConfig,
    handle: Arc<Handle>,
    address: Bytes,
}

impl UcxBackend {
    /// A backend with the default settings (transports from UCX's environment variables).
    pub fn new() -> Result<Arc<UcxBackend>> {
        Self::with_config(UcxConfig::default())
    }

    /// Starts UCX (context, worker, progress thread) with `cfg`.
    pub fn with_config(cfg: UcxConfig) -> Result<Arc<UcxBackend>> {
        let (handle, address) = progress::start(cfg.clone())?;
        Ok(Arc::new(UcxBackend { cfg, handle, address: Bytes::from(address) }))
    }

    /// The version of the libucx in use.
    pub fn ucx_version() -> String {
        crate::ffi::version()
    }

    /// Allocates `len` bytes through UCX, for tensors this backend moves often. With UCX's
    /// shared-memory transports such memory lives in a segment the peer maps, so a put or get
    /// into it is one copy instead of UCX's software put/get (two copies through a message queue).
    /// Register it with [`tensorwire_core::Engine::register_raw`]; the region must be deregistered
    /// before the returned [`UcxMemory`] is dropped.
    pub async fn allocate(&self, len: u64) -> Result<UcxMemory> {
        if len == 0 {
            return Err(Error::InvalidArgument("ucx: allocating 0 bytes".into()));
        }
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Allocate { len, reply: tx })?;
        let addr = reply(rx, "allocating memory", self.cfg.answer_timeout).await?;
        Ok(UcxMemory { addr, len, handle: self.handle.clone() })
    }

    /// How many ops this backend's callers copied themselves in `submit` so far: ops of at most
    /// 1 MiB per call on a lease whose region UCX maps into this process (memory the peer
    /// allocated through UCX, over a shared-memory transport). The rest went through the
    /// progress thread.
    pub fn ops_copied_in_submit(&self) -> u64 {
        self.handle.mapped.copied()
    }

    fn send(&self, cmd: Cmd) -> Result<()> {
        if self.handle.is_closed() {
            return Err(gone());
        }
        self.handle.send(cmd).map_err(|_| gone())
    }
}

impl Drop for UcxBackend {
    fn drop(&mut self) {
        self.handle.mark_closed();
        let _ = self.handle.send(Cmd::Shutdown { reply: None });
    }
}

#[async_trait]
impl Backend for UcxBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::host(false, 1 << 40)
    }

    async fn start(&self, host: Arc<dyn BackendHost>) -> Result<()> {
        self.send(Cmd::Start(host))
    }

    fn endpoint(&self) -> Bytes {
        self.address.clone()
    }

    async fn register(&self, region: &RegionInfo) -> Result<Option<Bytes>> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Register { info: region.clone(), reply: tx })?;
        reply(rx, "registering a region", self.cfg.answer_timeout).await
    }

    async fn deregister(&self, id: RegionId) -> Result<()> {
        // Unmapping waits (inside the thread) for the ops and holds that use the region.
        let _ = self.send(Cmd::Deregister(id));
        Ok(())
    }

    async fn connect(&self, peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Connect { address: peer.endpoint.clone(), reply: tx })?;
        let bound = self.cfg.answer_timeout + Duration::from_secs(1);
        let conn = reply(rx, &format!("connecting to {}", peer.engine), bound).await?;
        Ok(Arc::new(UcxConnection {
            conn,
            handle: self.handle.clone(),
            answer_timeout: self.cfg.answer_timeout,
        }))
    }

    async fn shutdown(&self) {
        self.handle.mark_closed();
        let (tx, rx) = oneshot::channel();
        if self.handle.send(Cmd::Shutdown { reply: Some(tx) }).is_ok() {
            let bound = self.cfg.answer_timeout + Duration::from_secs(2);
            let _ = tokio::time::timeout(bound, rx).await;
        }
    }
}

/// Memory allocated through UCX by [`UcxBackend::allocate`]; freed on drop (if the backend shut
/// down first, it stays allocated until the process exits).
#[derive(Debug)]
pub struct UcxMemory {
    addr: usize,
    len: u64,
    handle: Arc<Handle>,
}

impl UcxMemory {
    /// First byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty (never: zero-byte allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for UcxMemory {
    fn drop(&mut self) {
        let _ = self.handle.send(Cmd::Free { addr: self.addr });
    }
}

/// A connection to one peer's UCX backend.
#[derive(Debug)]
pub(crate) struct UcxConnection {
    conn: u64,
    handle: Arc<Handle>,
    answer_timeout: Duration,
}

impl Drop for UcxConnection {
    fn drop(&mut self) {
        let _ = self.handle.send(Cmd::Close { conn: self.conn });
    }
}

impl Connection for UcxConnection {
    fn submit(&self, ops: Vec<Op>) -> Vec<Completion> {
        let mut completions = Vec::with_capacity(ops.len());
        let mut submitted = Vec::with_capacity(ops.len());
        let mut budget = crate::mapped::INLINE_BYTES;
        for op in ops {
            if let Some(()) = self.handle.mapped.copy(self.conn, &op, &mut budget) {
                completions.push(tensorwire_core::backend::kit::ready(Ok(())));
                continue;
            }
            let (tx, rx) = oneshot::channel();
            let gate = Arc::new(OpGate::new());
            completions.push(Box::pin(UcxCompletion {
                rx,
                gate: gate.clone(),
                reads: op.dir() == Direction::Read,
                finished: false,
                handle: self.handle.clone(),
                conn: self.conn,
                bound: self.answer_timeout,
            }) as Completion);
            submitted.push(Submitted { op, gate, done: tx });
        }
        if !submitted.is_empty() && !self.handle.is_closed() {
            // A refused command drops its senders: every completion resolves as PeerClosed.
            let _ = self.handle.send(Cmd::Submit { conn: self.conn, ops: submitted });
        }
        completions
    }

    fn notify(&self, msg: Bytes) -> Completion {
        let (handle, conn, bound) = (self.handle.clone(), self.conn, self.answer_timeout);
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            handle.send(Cmd::Notify { conn, msg, reply: tx }).map_err(|_| gone())?;
            reply(rx, "notification answer", bound + Duration::from_secs(1)).await
        })
    }
}

/// One op's completion. Dropping it before it resolves cancels the op; for a READ the drop
/// returns only once UCX stopped writing into the local memory.
struct UcxCompletion {
    rx: oneshot::Receiver<Result<()>>,
    gate: Arc<OpGate>,
    reads: bool,
    finished: bool,
    handle: Arc<Handle>,
    conn: u64,
    bound: Duration,
}

impl Future for UcxCompletion {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let r = Pin::new(&mut self.rx).poll(cx);
        if let Poll::Ready(r) = r {
            self.finished = true;
            return Poll::Ready(r.unwrap_or_else(|_| Err(gone())));
        }
        Poll::Pending
    }
}

impl Drop for UcxCompletion {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        self.gate.cancel();
        if !self.reads || self.gate.wait_idle(self.bound) {
            return;
        }
        // UCX did not finish the requests in time: force-close the endpoint, which cancels them.
        let error = Error::timeout("ucx: a cancelled READ did not stop", self.bound);
        if self.handle.send(Cmd::Kill { conn: self.conn, error }).is_ok()
            && !self.gate.wait_idle(self.bound)
        {
            tracing::error!("ucx: a cancelled READ still has requests in flight");
        }
    }
}
