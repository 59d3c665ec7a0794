//! `tensorwire-shm`: the same-host backend. Between two engines on one host a transfer is one
//! memcpy between the two processes' mappings of the same memory.
//!
//! - **Sharing.** Engine-allocated regions are memfd-backed. When a peer first touches a region,
//!   this backend passes it the region's memfd over a Unix socket (`SCM_RIGHTS`, abstract
//!   namespace, same-uid peers only) after the engine checked the op's key, permission and bounds.
//!   Regions peers may only read are passed as read-only descriptors (mapped `PROT_READ`). A
//!   writable grant is also readable: `mmap` cannot express write-only.
//! - **One copy.** The initiator copies between its local slice and its mapping of the peer's
//!   region. The first op on a region asks the peer to hold it (Begin/Granted, 56-byte frames)
//!   and is granted a lease: the region stays held for the connection, and later ops with the
//!   same key and access copy with no message (inline in `submit` up to 1 MiB per call).
//!   Deregistration revokes the lease (Forget; the client answers Released once its copies are
//!   over), so it waits for remote copies as for local ones. Waiting is on the socket (epoll),
//!   never a spinning poll.
//! - **Shutdown.** Each accepted connection gets a live page first: one sealed memfd page the
//!   server marks closed before its shutdown returns. An op copied in `submit` reads it (one
//!   load), so none lands in memory of a peer whose shutdown has returned; a peer that dies
//!   without one is seen by the connection's reader at the end of its stream.
//! - **Fallback.** Caller-registered (raw) memory has no memfd: `register` returns no blob for
//!   it, so the engine picks its next backend (tcp) for ops on such regions.
//! - **Cleanup.** Mappings of a peer's memory are dropped when the peer deregisters the region
//!   (Forget), when the connection closes, or when the peer dies (end of stream); descriptors are
//!   closed right after mapping; nothing is created in `/dev/shm` or on the file system.
//! - **Other media.** The protocol above is written once, over a [`Medium`]: what a region
//!   exports, how a peer opens it, how bytes are copied. [`ShmBackend::new`] runs it over
//!   [`Memfd`] (host memory, CPU copies); [`ShmBackend::with_medium`] over another, such as
//!   `tensorwire-cuda`'s CUDA IPC (device memory, GPU copies).

mod client;
mod live;
mod mapping;
pub mod medium;
mod memfd;
mod server;
mod uds;
pub mod wire;

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use tensorwire_core::backend::kit::{Serving, WeakList};
use tensorwire_core::backend::{
    Backend, BackendHost, Capabilities, Connection, PeerBackendInfo, RegionInfo,
};
use tensorwire_core::{Error, RegionId, Result};

use client::{ClientShared, ShmConnection};
pub use medium::{Export, Grant, MAX_SHARE_BYTES, Medium, Opened};
pub use memfd::Memfd;
use server::{Served, ServerConn};
use uds::{FrameReader, FrameWriter};

/// The backend's name.
pub const NAME: &str = "shm";

/// Shareable regions by id, with their exports.
#[derive(Debug)]
pub(crate) struct Table {
    regions: Mutex<HashMap<RegionId, Arc<Export>>>,
    /// The backend's name, for errors.
    pub(crate) backend: &'static str,
}

impl Table {
    pub(crate) fn get(&self, id: RegionId) -> Option<Arc<Export>> {
        self.regions.lock().get(&id).cloned()
    }
}

#[derive(Debug)]
struct Inner {
    /// The Unix listener, the engine host, the accept loop and serving tasks.
    serving: Serving<std::os::unix::net::UnixListener>,
    table: Arc<Table>,
    served: Served,
    clients: WeakList<ClientShared>,
}

impl Inner {
    fn close(&self) {
        self.serving.close();
        self.served.close();
        for c in self.clients.take() {
            c.kill(self.serving.closed_error());
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

/// The shared-memory backend (one per engine), over [`Memfd`] or another [`Medium`].
#[derive(Debug)]
pub struct ShmBackend {
    cfg: ShmConfig,
    name: String,
    medium: Arc<dyn Medium>,
    inner: Arc<Inner>,
}

impl ShmBackend {
    /// A backend with the default settings.
    pub fn new() -> Result<Arc<ShmBackend>> {
        Self::with_config(ShmConfig::default())
    }

    /// Binds the backend's Unix socket (abstract namespace, unguessable name).
    pub fn with_config(cfg: ShmConfig) -> Result<Arc<ShmBackend>> {
        Self::with_medium(Arc::new(Memfd), cfg)
    }

    /// The same-host protocol over `medium` (its name is the backend's name): binds the Unix
    /// socket (abstract namespace, unguessable name).
    pub fn with_medium(medium: Arc<dyn Medium>, cfg: ShmConfig) -> Result<Arc<ShmBackend>> {
        use std::os::linux::net::SocketAddrExt;
        let backend = medium.name();
        let name =
            format!("tensorwire-{backend}-{}-{:016x}", std::process::id(), rand::random::<u64>());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
        listener.set_nonblocking(true)?;
        Ok(Arc::new(ShmBackend {
            cfg,
            name,
            medium,
            inner: Arc::new(Inner {
                serving: Serving::new(backend, listener),
                table: Arc::new(Table { regions: Mutex::default(), backend }),
                served: Served::default(),
                clients: WeakList::default(),
            }),
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
        if inner.serving.is_closed() {
            return;
        }
        match sock.peer_cred() {
            Ok(c) if c.uid() == me => {}
            other => {
                tracing::warn!(?other, "shm: refusing a peer running as another user");
                continue;
            }
        }
        let Some(host) = inner.serving.host() else { continue };
        let (live, live_fd) = match live::LivePage::create() {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "shm: refusing a peer: no live page for it");
                continue;
            }
        };
        let sock = Arc::new(sock);
        let conn = Arc::new(ServerConn {
            writer: FrameWriter::new(sock.clone()),
            mapped: Mutex::new(Default::default()),
        });
        inner.served.push(&conn, live, || inner.serving.is_closed());
        let reader = FrameReader::new(sock);
        inner.serving.spawn(server::serve(conn, reader, host, inner.table.clone(), live_fd));
    }
}

#[async_trait]
impl Backend for ShmBackend {
    fn name(&self) -> &'static str {
        self.medium.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.medium.capabilities()
    }

    async fn start(&self, host: Arc<dyn BackendHost>) -> Result<()> {
        let listener = self.inner.serving.start(host, tokio::net::UnixListener::from_std)?;
        self.inner.serving.spawn(accept_loop(listener, Arc::downgrade(&self.inner)));
        Ok(())
    }

    fn endpoint(&self) -> Bytes {
        Bytes::from(self.name.clone().into_bytes())
    }

    async fn register(&self, region: &RegionInfo) -> Result<Option<Bytes>> {
        let Some(export) = self.medium.export(region)? else {
            return Ok(None); // memory this medium cannot share: peers reach it another way
        };
        if export.share.len() > MAX_SHARE_BYTES {
            return Err(Error::Internal(format!(
                "{}: a {}-byte export (at most {MAX_SHARE_BYTES})",
                self.medium.name(),
                export.share.len()
            )));
        }
        self.inner.table.regions.lock().insert(region.id, Arc::new(export));
        Ok(Some(Bytes::new()))
    }

    async fn deregister(&self, id: RegionId) -> Result<()> {
        self.inner.table.regions.lock().remove(&id);
        for conn in self.inner.served.live() {
            conn.forget(id).await;
        }
        Ok(())
    }

    async fn connect(&self, peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>> {
        use std::os::linux::net::SocketAddrExt;
        self.inner.serving.ensure_open()?;
        if peer.endpoint.len() > 100 {
            return Err(Error::protocol("shm endpoint: name too long"));
        }
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(&peer.endpoint)?;
        let sock = std::os::unix::net::UnixStream::connect_addr(&addr).map_err(|e| {
            Error::PeerClosed(format!("shm: cannot reach {}'s shm backend: {e}", peer.engine))
        })?;
        sock.set_nonblocking(true)?;
        let sock = tokio::net::UnixStream::from_std(sock)?;
        let (conn, shared) = ShmConnection::new(sock, self.medium.clone(), self.cfg.answer_timeout);
        self.inner.clients.push(&shared);
        Ok(Arc::new(conn))
    }

    async fn shutdown(&self) {
        self.inner.close();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use tensorwire_core::{Engine, Error, Permissions, TransferOp};

    use super::ShmBackend;
    use crate::server::SHARE_UNASKED;

    /// A grant that carries an export the client did not ask for (it has the region mapped
    /// already) is refused: the op fails, and the descriptor is not mapped over the one in use.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_export_nobody_asked_for_is_refused() {
        let a = Engine::builder().backend(ShmBackend::new().unwrap()).start().await.unwrap();
        let b = Engine::builder().backend(ShmBackend::new().unwrap()).start().await.unwrap();
        let local = a.alloc(1 << 16, Permissions::NONE).await.unwrap();
        let peer = b.alloc(1 << 16, Permissions::READ_WRITE).await.unwrap();
        local.write_bytes(0, &[5u8; 4096]).unwrap();
        let s = a.connect(b.local_addr()).await.unwrap();
        // Opens the region (asking for its export) and leases it for WRITE.
        let r = s.transfer(TransferOp::write(&local, 0, &peer.remote(), 0, 4096)).await.unwrap();
        assert_eq!(r.backend, "shm");
        // The READ lease's Begin does not ask for the export again; the server now sends it.
        SHARE_UNASKED.store(true, Ordering::SeqCst);
        let e = s.transfer(TransferOp::read(&local, 0, &peer.remote(), 0, 4096)).await;
        SHARE_UNASKED.store(false, Ordering::SeqCst);
        match e {
            Err(Error::Protocol(m)) => assert!(m.contains("nobody asked for"), "{m}"),
            other => panic!("an unasked export was accepted: {other:?}"),
        }
        assert_eq!(peer.to_vec(0, 4096).unwrap(), vec![5u8; 4096], "the WRITE landed");
    }
}
