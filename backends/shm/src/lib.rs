//! `tensorwire-shm`: the same-host backend. Between two engines on one host a transfer is one
//! memcpy between the two processes' mappings of the same memory.
//!
//! - **Sharing.** Engine-allocated regions are memfd-backed. When a peer first touches a region,
//!   this backend passes it the region's memfd over a Unix socket (`SCM_RIGHTS`, abstract
//!   namespace, same-uid peers only) after the engine checked the op's key, permission and bounds.
//!   Regions peers may only read are passed as read-only descriptors (mapped `PROT_READ`). A
//!   writable grant is also readable: `mmap` cannot express write-only.
//! - **One copy.** The initiator copies between its local slice and its mapping of the peer's
//!   region; the control messages around it (Begin/Granted/End, 56-byte frames) make the peer hold
//!   the region open while the copy runs, so deregistration waits for remote copies too. Waiting is
//!   on the socket (epoll), never a spinning poll.
//! - **Fallback.** Caller-registered (raw) memory has no memfd: `register` returns no blob for
//!   it, so the engine picks its next backend (tcp) for ops on such regions.
//! - **Cleanup.** Mappings of a peer's memory are dropped when the peer deregisters the region
//!   (Forget), when the connection closes, or when the peer dies (end of stream); descriptors are
//!   closed right after mapping; nothing is created in `/dev/shm` or on the file system.

mod client;
mod mapping;
mod server;
mod uds;
pub mod wire;

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use tensorwire_core::backend::kit::TaskSet;
use tensorwire_core::backend::{
    Backend, BackendHost, Capabilities, Connection, PeerBackendInfo, RegionInfo,
};
use tensorwire_core::{Error, RegionId, Result};

use client::{ClientShared, ShmConnection};
use server::ServerConn;
use uds::{FrameReader, FrameWriter};

/// The backend's name.
pub const NAME: &str = "shm";

/// A registered region's descriptor, as peers receive it.
#[derive(Debug)]
pub(crate) struct Share {
    fd: OwnedFd,
    pub(crate) len: u64,
    pub(crate) writable: bool,
}

impl Share {
    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Shareable regions by id.
#[derive(Debug, Default)]
pub(crate) struct Table {
    regions: Mutex<HashMap<RegionId, Arc<Share>>>,
}

impl Table {
    pub(crate) fn get(&self, id: RegionId) -> Option<Arc<Share>> {
        self.regions.lock().get(&id).cloned()
    }
}

#[derive(Debug, Default)]
struct Inner {
    host: OnceLock<Arc<dyn BackendHost>>,
    table: Arc<Table>,
    closed: AtomicBool,
    /// Accept loop and serving tasks, aborted at shutdown.
    tasks: Arc<TaskSet>,
    served: Mutex<Vec<Weak<ServerConn>>>,
    clients: Mutex<Vec<Weak<ClientShared>>>,
}

impl Inner {
    fn track(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(fut);
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.tasks.abort_all();
        self.served.lock().clear();
        let clients: Vec<_> = self.clients.lock().drain(..).collect();
        for c in clients.iter().filter_map(Weak::upgrade) {
            c.kill(Error::PeerClosed("local shm backend shut down".into()));
        }
        self.table.regions.lock().clear();
    }
}

/// Shared-memory backend settings.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// A peer that leaves a request unanswered this long is declared dead: every op pending on
    /// the connection fails with `Timeout` (a stopped or hung process).
    pub answer_timeout: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig { answer_timeout: Duration::from_secs(10) }
    }
}

/// The shared-memory backend (one per engine).
#[derive(Debug)]
pub struct ShmBackend {
    cfg: ShmConfig,
    name: String,
    listener: Mutex<Option<std::os::unix::net::UnixListener>>,
    inner: Arc<Inner>,
}

impl ShmBackend {
    /// A backend with the default settings.
    pub fn new() -> Result<Arc<ShmBackend>> {
        Self::with_config(ShmConfig::default())
    }

    /// Binds the backend's Unix socket (abstract namespace, unguessable name).
    pub fn with_config(cfg: ShmConfig) -> Result<Arc<ShmBackend>> {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("tensorwire-shm-{}-{:016x}", std::process::id(), rand::random::<u64>());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
        listener.set_nonblocking(true)?;
        Ok(Arc::new(ShmBackend {
            cfg,
            name,
            listener: Mutex::new(Some(listener)),
            inner: Arc::new(Inner::default()),
        }))
    }
}

impl Drop for ShmBackend {
    fn drop(&mut self) {
        self.inner.close();
    }
}

async fn accept_loop(listener: tokio::net::UnixListener, inner: Weak<Inner>) {
    // SAFETY: getuid has no preconditions and cannot fail.
    let me = unsafe { libc::getuid() };
    loop {
        let sock = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "shm: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(inner) = inner.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        match sock.peer_cred() {
            Ok(c) if c.uid() == me => {}
            other => {
                tracing::warn!(?other, "shm: refusing a peer running as another user");
                continue;
            }
        }
        let Some(host) = inner.host.get().cloned() else { continue };
        let sock = Arc::new(sock);
        let conn = Arc::new(ServerConn {
            writer: FrameWriter::new(sock.clone()),
            mapped: Mutex::new(Default::default()),
        });
        {
            let mut served = inner.served.lock();
            served.retain(|w| w.strong_count() > 0);
            served.push(Arc::downgrade(&conn));
        }
        let reader = FrameReader::new(sock);
        inner.track(server::serve(conn, reader, host, inner.table.clone()));
    }
}

#[async_trait]
impl Backend for ShmBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::host(true, 1 << 40)
    }

    async fn start(&self, host: Arc<dyn BackendHost>) -> Result<()> {
        if self.inner.host.set(host).is_err() {
            return Err(Error::InvalidArgument("shm: backend started twice".into()));
        }
        let std_listener =
            self.listener.lock().take().ok_or_else(|| {
                Error::Internal("shm: the listener was taken before start".into())
            })?;
        let l =
            tokio::net::UnixListener::from_std(std_listener).map_err(|e| Error::Unsupported {
                backend: NAME,
                what: format!("serving outside a tokio runtime: {e}"),
            })?;
        self.inner.track(accept_loop(l, Arc::downgrade(&self.inner)));
        Ok(())
    }

    fn endpoint(&self) -> Bytes {
        Bytes::from(self.name.clone().into_bytes())
    }

    async fn register(&self, region: &RegionInfo) -> Result<Option<Bytes>> {
        let Some(mem) = region.shareable() else {
            return Ok(None); // caller memory: peers reach it through another backend
        };
        // Peers that may only read get a read-only descriptor: they cannot map it writable.
        let share = Share {
            fd: mem.open(region.perms.write)?,
            len: mem.len(),
            writable: region.perms.write,
        };
        self.inner.table.regions.lock().insert(region.id, Arc::new(share));
        Ok(Some(Bytes::new()))
    }

    async fn deregister(&self, id: RegionId) -> Result<()> {
        self.inner.table.regions.lock().remove(&id);
        let served: Vec<_> = self.inner.served.lock().iter().filter_map(Weak::upgrade).collect();
        for conn in served {
            conn.forget(id).await;
        }
        Ok(())
    }

    async fn connect(&self, peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>> {
        use std::os::linux::net::SocketAddrExt;
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::PeerClosed("local shm backend shut down".into()));
        }
        if peer.endpoint.len() > 100 {
            return Err(Error::protocol("shm endpoint: name too long"));
        }
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(&peer.endpoint)?;
        let sock = std::os::unix::net::UnixStream::connect_addr(&addr).map_err(|e| {
            Error::PeerClosed(format!("shm: cannot reach {}'s shm backend: {e}", peer.engine))
        })?;
        sock.set_nonblocking(true)?;
        let sock = tokio::net::UnixStream::from_std(sock)?;
        let (conn, shared) = ShmConnection::new(sock, self.cfg.answer_timeout);
        let mut clients = self.inner.clients.lock();
        clients.retain(|w| w.strong_count() > 0);
        clients.push(Arc::downgrade(&shared));
        Ok(Arc::new(conn))
    }

    async fn shutdown(&self) {
        self.inner.close();
    }
}
