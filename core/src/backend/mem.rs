//! The in-memory backend ("mem"), the reference for backend authors: two engines in one process move bytes with a memcpy
//! between their registered regions, like libp2p's memory transport. Upper layers and the
//! conformance suite use it without sockets; it honours the whole backend contract (per-op
//! completion, cancellation, ops dropped when they end, peer shutdown).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, Weak};

use async_trait::async_trait;
use bytes::Bytes;

use crate::backend::kit::{CancelGate, Reader, Writer, gated_copy, spawn_cancellable};
use crate::backend::{
    Backend, BackendHost, Capabilities, Completion, Connection, Direction, Op, PeerBackendInfo,
    RegionInfo,
};
use crate::error::{Error, Missing, Result};
use crate::ids::RegionId;

const NAME: &str = "mem";

static REGISTRY: LazyLock<Mutex<HashMap<u64, Weak<MemShared>>>> = LazyLock::new(Default::default);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug)]
struct MemShared {
    id: u64,
    host: OnceLock<Arc<dyn BackendHost>>,
    closed: AtomicBool,
}

impl MemShared {
    fn host(&self, who: &str) -> Result<&Arc<dyn BackendHost>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::PeerClosed(format!("{who} mem backend shut down")));
        }
        self.host
            .get()
            .ok_or_else(|| Error::PeerClosed(format!("{who} mem backend is not attached")))
    }
}

fn registry() -> std::sync::MutexGuard<'static, HashMap<u64, Weak<MemShared>>> {
    REGISTRY.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The in-process reference backend.
#[derive(Debug)]
pub struct MemBackend {
    shared: Arc<MemShared>,
}

impl MemBackend {
    /// A new backend instance (one per engine).
    pub fn new() -> Arc<MemBackend> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let shared =
            Arc::new(MemShared { id, host: OnceLock::new(), closed: AtomicBool::new(false) });
        registry().insert(id, Arc::downgrade(&shared));
        Arc::new(MemBackend { shared })
    }
}

impl Drop for MemBackend {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        registry().remove(&self.shared.id);
    }
}

#[async_trait]
impl Backend for MemBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::host(true, 256 << 20)
    }

    async fn start(&self, host: Arc<dyn BackendHost>) -> Result<()> {
        self.shared
            .host
            .set(host)
            .map_err(|_| Error::InvalidArgument("mem backend started twice".into()))
    }

    fn endpoint(&self) -> Bytes {
        let mut w = Writer::new();
        w.u32(std::process::id()).u64(self.shared.id);
        Bytes::from(w.finish())
    }

    async fn register(&self, region: &RegionInfo) -> Result<Option<Bytes>> {
        // Reached through the peer engine's `resolve`: any host memory, nothing to publish.
        Ok(region.kind.is_host().then(Bytes::new))
    }

    async fn deregister(&self, _id: RegionId) -> Result<()> {
        Ok(())
    }

    async fn connect(&self, peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>> {
        let mut r = Reader::new(&peer.endpoint, "mem endpoint");
        let (pid, id) = (r.u32()?, r.u64()?);
        r.finish()?;
        if pid != std::process::id() {
            return Err(Error::Unsupported {
                backend: NAME,
                what: format!("peer {} is in process {pid}, not this one", peer.engine),
            });
        }
        let target = registry().get(&id).cloned().ok_or_else(|| {
            Error::NotFound(Missing::Peer(format!("mem backend {id} of {}", peer.engine)))
        })?;
        Ok(Arc::new(MemConnection { local: self.shared.clone(), peer: target }))
    }

    async fn shutdown(&self) {
        self.shared.closed.store(true, Ordering::Release);
        registry().remove(&self.shared.id);
    }
}

#[derive(Debug)]
struct MemConnection {
    local: Arc<MemShared>,
    peer: Weak<MemShared>,
}

/// Fails unless both ends are still up.
fn both_alive(local: &MemShared, peer: &Weak<MemShared>) -> Result<Arc<dyn BackendHost>> {
    local.host("local")?;
    let peer = peer.upgrade().ok_or_else(|| Error::PeerClosed("peer engine dropped".into()))?;
    peer.host("peer").cloned()
}

async fn run_op(
    op: Op,
    local: Arc<MemShared>,
    peer: Weak<MemShared>,
    gate: Arc<CancelGate>,
) -> Result<()> {
    let host = both_alive(&local, &peer)?;
    let len = op.local().len();
    let remote = host.resolve(op.range(), op.dir().remote_access())?;
    drop(host);
    // Addresses, not pointers, so the future stays `Send` across the yields below.
    let (src, dst) = match op.dir() {
        Direction::Read => (remote.ptr() as usize, op.local().ptr() as usize),
        Direction::Write => (op.local().ptr() as usize, remote.ptr() as usize),
    };
    // SAFETY: `remote` and `op.local` are bounds-checked slices of `len` bytes of live registered
    // host memory, held open by their in-flight gates until this function returns.
    unsafe { gated_copy(src, dst, len, &gate, || both_alive(&local, &peer).map(drop)) }.await?;
    Ok(()) // complete, or cancelled (nobody is waiting for the result)
}

impl Connection for MemConnection {
    fn submit(&self, ops: Vec<Op>) -> Vec<Completion> {
        ops.into_iter()
            .map(|op| {
                let (local, peer) = (self.local.clone(), self.peer.clone());
                spawn_cancellable(move |gate| run_op(op, local, peer, gate))
            })
            .collect()
    }

    fn notify(&self, msg: Bytes) -> Completion {
        let (local, peer) = (self.local.clone(), self.peer.clone());
        Box::pin(async move { both_alive(&local, &peer)?.deliver(msg) })
    }
}
