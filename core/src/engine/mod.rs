//! The `Engine`: one per process. It owns registered regions, the backends, the control endpoint and
//! peer sessions; it picks a backend per transfer and runs the chunk API over sessions.

mod chunked;
mod control;
mod host;
mod peers;
mod prepared;
mod regions;
mod session;
pub(crate) mod staging;
mod telemetry;
mod transfer;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

pub use chunked::{ChunkSender, ChunkStream};
pub use prepared::PreparedTransfer;
pub use session::Session;
pub use transfer::{TransferHandle, TransferOp, TransferReport};

use crate::backend::{Backend, RegionInfo};
use crate::chunk::ChunkPlan;
use crate::error::{Error, Missing, Result};
use crate::ids::{AccessKey, EngineId, RegionId};
use crate::memory::{DeviceCopier, Gpu, HostMapping, MemoryKind, ShareableMemory};
use crate::region::{Permissions, Region, RegionInner, Registry, Storage};
use crate::wire::descriptor::EngineDescriptor;
use chunked::ChunkSignal;
use regions::RegionTable;

/// Engine settings. Every wait the engine does is bounded by one of these.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Control endpoint address (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Host identity; engines with equal ids may use same-host backends. Default: this boot's id.
    pub host_id: Option<String>,
    /// Bound on one transfer, timed from when its handle is first awaited to its completion (the op
    /// itself starts at submit and progresses whether or not its handle is polled).
    pub transfer_timeout: Duration,
    /// Bound on a control-endpoint handshake.
    pub handshake_timeout: Duration,
    /// Bound on waiting for in-flight transfers when deregistering.
    pub deregister_timeout: Duration,
    /// Bound on waiting for the next chunk of a chunked transfer.
    pub chunk_timeout: Duration,
    /// Capacity of the inbound user-notification queue (a full queue refuses the sender).
    pub notification_queue: usize,
    /// Shared cluster secret. With one, the engine only talks to peers that prove they hold the same
    /// secret (HMAC challenge in the handshake, both directions). Without one it accepts any peer,
    /// so `start` refuses a `listen` address other hosts can reach unless `insecure` is set.
    pub cluster_secret: Option<crate::auth::ClusterSecret>,
    /// Opts out of the rule above: listen on a reachable address without a secret (warned at
    /// start and for every peer from another host). Anyone who reaches the control endpoint then
    /// learns the keys of the regions this engine shows to peers.
    pub insecure: bool,
    /// The largest descriptor a peer may send in a handshake (encoded bytes); a larger one is
    /// refused there. Default 1 MiB, the control frame's bound (a descriptor showing the most
    /// regions a descriptor may hold, 4,096, takes about 400 KiB).
    pub max_peer_descriptor: usize,
    /// Peers' descriptors kept for [`Engine::session`] (the least recently used go first).
    pub max_peers: usize,
    /// Bytes of peers' descriptors kept (the least recently used go first).
    pub max_peer_bytes: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            host_id: None,
            transfer_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            deregister_timeout: Duration::from_secs(30),
            chunk_timeout: Duration::from_secs(30),
            notification_queue: 1024,
            cluster_secret: None,
            insecure: false,
            max_peer_descriptor: 1 << 20,
            max_peers: 1024,
            max_peer_bytes: 64 << 20,
        }
    }
}

/// A user notification received from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Sending engine.
    pub from: EngineId,
    /// Payload (at most [`crate::wire::envelope::MAX_NOTIFY_BYTES`]).
    pub payload: Bytes,
}

/// Counters of what the engine moved (as initiator).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Bytes moved by completed READs.
    pub bytes_read: u64,
    /// Bytes moved by completed WRITEs.
    pub bytes_written: u64,
    /// Ops completed successfully.
    pub ops_ok: u64,
    /// Ops that failed.
    pub ops_failed: u64,
    /// Times a host staging buffer was taken for device memory: by an op of this engine on its
    /// own device memory, or by a backend serving a peer's op on this engine's device memory.
    /// 0 while every device byte moved device to device (the cuda backend): the counter that
    /// shows no host copy happened.
    pub host_staged: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) ops_ok: AtomicU64,
    pub(crate) ops_failed: AtomicU64,
    pub(crate) host_staged: AtomicU64,
    /// Bytes of completed ops, by the backend that moved them.
    pub(crate) by_backend: Mutex<Vec<(&'static str, u64)>>,
}

/// What a [`NotificationHandler`] decided about an inbound notification.
#[derive(Debug)]
pub enum Handled {
    /// Not the handler's: it goes to [`Engine::recv_notification`] as usual.
    Pass,
    /// The handler acted on it; the sender's `notify` succeeds.
    Taken,
    /// The handler refused it; the sender's `notify` fails with this error.
    Refused(Error),
}

/// Sees each inbound user notification as it arrives, before it is queued, and decides what
/// becomes of it. It runs on the receiving backend's IO task, so it must be quick and never
/// block; its verdict is what the sender's [`crate::Session::notify`] returns, which makes a
/// notification a one-way request whose answer is that verdict.
pub type NotificationHandler = Arc<dyn Fn(&Notification) -> Handled + Send + Sync>;

/// Where the engine keeps its [`NotificationHandler`].
#[derive(Default)]
pub(crate) struct HandlerSlot(std::sync::RwLock<Option<NotificationHandler>>);

impl HandlerSlot {
    fn set(&self, h: Option<NotificationHandler>) {
        *self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner) = h;
    }

    pub(crate) fn get(&self) -> Option<NotificationHandler> {
        self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

impl std::fmt::Debug for HandlerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.get().is_some() { "HandlerSlot(set)" } else { "HandlerSlot(none)" })
    }
}

/// The engine's shared state (behind `Engine`, referenced weakly by sessions and regions).
#[derive(Debug)]
pub(crate) struct EngineShared {
    pub(crate) id: EngineId,
    pub(crate) host: String,
    pub(crate) config: EngineConfig,
    pub(crate) backends: Vec<Arc<dyn Backend>>,
    pub(crate) copier: Option<Arc<dyn DeviceCopier>>,
    pub(crate) gpu: Option<Arc<dyn Gpu>>,
    /// Bounce buffers for device staging, made on first use.
    pub(crate) staging: std::sync::OnceLock<Arc<staging::StagingPool>>,
    pub(crate) regions: RegionTable,
    /// Descriptors of peers that completed a handshake with us (either direction), bounded.
    pub(crate) peers: Mutex<peers::PeerTable>,
    pub(crate) sessions: Mutex<HashMap<EngineId, Session>>,
    pub(crate) notif_tx: mpsc::Sender<Notification>,
    pub(crate) notif_handler: HandlerSlot,
    notif_rx: tokio::sync::Mutex<mpsc::Receiver<Notification>>,
    pub(crate) chunk_streams: Mutex<HashMap<u64, mpsc::Sender<ChunkSignal>>>,
    local_addr: SocketAddr,
    listener: Mutex<Option<tokio::task::JoinHandle<()>>>,
    pub(crate) closed: AtomicBool,
    pub(crate) counters: Counters,
}

pub(crate) use crate::sync::lock;

impl Registry for EngineShared {
    fn unregister<'a>(
        self: Arc<Self>,
        inner: &'a Arc<RegionInner>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send + 'a>> {
        Box::pin(async move { self.deregister(inner).await })
    }
    fn dropped(self: Arc<Self>, inner: &Arc<RegionInner>) {
        self.forget(inner);
    }
}

impl EngineShared {
    pub(crate) fn descriptor(&self) -> EngineDescriptor {
        EngineDescriptor {
            engine: self.id,
            host: self.host.clone(),
            backends: self.backends.iter().map(|b| (b.name().to_string(), b.endpoint())).collect(),
            regions: self.regions.advertised(),
        }
    }

    /// The staging pool (device memory through pinned bounces).
    pub(crate) fn staging(self: &Arc<Self>) -> Arc<staging::StagingPool> {
        self.staging
            .get_or_init(|| Arc::new(staging::StagingPool::new(Arc::downgrade(self))))
            .clone()
    }

    pub(crate) fn ensure_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::PeerClosed(format!("local engine {} is shut down", self.id)));
        }
        Ok(())
    }

    async fn register(
        self: &Arc<Self>,
        storage: Storage,
        len: u64,
        kind: MemoryKind,
        perms: Permissions,
    ) -> Result<Region> {
        self.ensure_open()?;
        let id = self.regions.next_id();
        let (addr, shareable) = match &storage {
            Storage::Owned(m) | Storage::Pinned { mapping: m, .. } => {
                (m.ptr() as usize, ShareableMemory::of(m))
            }
            Storage::Raw(a) | Storage::Kept { addr: a, .. } => (*a, None),
        };
        let info = RegionInfo { id, kind, addr, len, perms, shareable };
        let mut blobs = Vec::with_capacity(self.backends.len());
        for (i, b) in self.backends.iter().enumerate() {
            match b.register(&info).await {
                Ok(Some(blob)) => blobs.push((b.name(), blob)),
                Ok(None) => {}
                Err(e) => {
                    for done in &self.backends[..i] {
                        let _ = done.deregister(id).await;
                    }
                    return Err(e);
                }
            }
        }
        let inner = Arc::new(RegionInner {
            id,
            key: AccessKey::random(),
            kind,
            perms,
            len,
            storage,
            gate: crate::inflight::InflightGate::new(),
            drained: tokio::sync::Notify::new(),
            blobs,
            engine_id: self.id,
            copier: self.copier.clone(),
        });
        self.regions.insert(inner.clone());
        Ok(Region { inner, engine: Arc::downgrade(self) as Weak<dyn Registry> })
    }

    /// Drop path: refuse new access now; backends forget the region in the background.
    pub(crate) fn forget(self: &Arc<Self>, inner: &Arc<RegionInner>) {
        self.regions.remove(inner.id);
        inner.gate.close();
        let backends = self.backends.clone();
        let id = inner.id;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                for b in backends {
                    let _ = b.deregister(id).await;
                }
            });
        }
    }

    pub(crate) async fn deregister(self: &Arc<Self>, inner: &Arc<RegionInner>) -> Result<()> {
        self.regions.remove(inner.id);
        let drained_now = inner.gate.close();
        for b in &self.backends {
            b.deregister(inner.id).await?;
        }
        if drained_now {
            return Ok(());
        }
        let limit = self.config.deregister_timeout;
        tokio::time::timeout(limit, async {
            while !inner.gate.is_drained() {
                inner.drained.notified().await;
            }
        })
        .await
        .map_err(|_| {
            Error::timeout(
                format!(
                    "deregistering region {}: {} transfers still in flight",
                    inner.id.0,
                    inner.gate.count()
                ),
                limit,
            )
        })
    }

    pub(crate) fn record(
        &self,
        backend: &'static str,
        dir: crate::backend::Direction,
        bytes: u64,
        ok: bool,
    ) {
        let c = &self.counters;
        if ok {
            c.ops_ok.fetch_add(1, Ordering::Relaxed);
            let mut by = lock(&c.by_backend);
            match by.iter_mut().find(|(b, _)| *b == backend) {
                Some((_, n)) => *n += bytes,
                None => by.push((backend, bytes)),
            }
            drop(by);
            let field = match dir {
                crate::backend::Direction::Read => &c.bytes_read,
                crate::backend::Direction::Write => &c.bytes_written,
            };
            field.fetch_add(bytes, Ordering::Relaxed);
        } else {
            c.ops_failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for EngineShared {
    fn drop(&mut self) {
        if let Some(h) = lock(&self.listener).take() {
            h.abort();
        }
    }
}

/// A transfer engine. Cheap to clone (a handle); the engine stops when the last handle is dropped or
/// on [`Engine::shutdown`].
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use tensorwire_core::{Engine, backend::MemBackend, Permissions, TransferOp};
/// let a = Engine::builder().backend(MemBackend::new()).start().await?;
/// let b = Engine::builder().backend(MemBackend::new()).start().await?;
/// let src = a.alloc(4096, Permissions::NONE).await?;
/// let dst = b.alloc(4096, Permissions::WRITE).await?;
/// src.write_bytes(0, b"hello")?;
/// let session = a.connect(b.local_addr()).await?;
/// let report = session.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, 5)).await?;
/// assert_eq!(report.backend, "mem");
/// assert_eq!(dst.to_vec(0, 5)?, b"hello");
/// # Ok::<(), tensorwire_core::Error>(()) }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct Engine {
    pub(crate) shared: Arc<EngineShared>,
}

/// Builds an [`Engine`].
#[derive(Debug, Default)]
pub struct EngineBuilder {
    config: EngineConfig,
    backends: Vec<Arc<dyn Backend>>,
    copier: Option<Arc<dyn DeviceCopier>>,
    gpu: Option<Arc<dyn Gpu>>,
}

impl EngineBuilder {
    /// Adds a backend; earlier backends are preferred when several fit a transfer.
    pub fn backend(mut self, b: Arc<dyn Backend>) -> Self {
        self.backends.push(b);
        self
    }
    /// Replaces the configuration.
    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }
    /// The copier for device memory (from a GPU crate): [`crate::MemSlice::copy_from`] uses it
    /// for every copy that involves a device region of this engine.
    pub fn device_copier(mut self, copier: Arc<dyn DeviceCopier>) -> Self {
        self.copier = Some(copier);
        self
    }
    /// The GPU driver (from a GPU crate, e.g. `tensorwire_cuda::CudaGpu`): device and pinned
    /// allocations, device pointer checks, and (as the device copier) every copy that involves
    /// device memory.
    pub fn gpu<G: Gpu>(mut self, gpu: Arc<G>) -> Self {
        self.copier = Some(gpu.clone());
        self.gpu = Some(gpu);
        self
    }
    /// Binds the control endpoint, starts the backends and starts serving handshakes. A backend
    /// that cannot start fails the whole start (the backends started before it are shut down).
    pub async fn start(self) -> Result<Engine> {
        if self.backends.is_empty() {
            return Err(Error::InvalidArgument("an engine needs at least one backend".into()));
        }
        let cfg = &self.config;
        let secret = cfg.cluster_secret.as_ref();
        crate::auth::check_listener("engine control endpoint", cfg.listen, secret, cfg.insecure)?;
        let listener = tokio::net::TcpListener::bind(self.config.listen).await.map_err(|e| {
            Error::InvalidArgument(format!(
                "control endpoint: cannot listen on {}: {e}",
                self.config.listen
            ))
        })?;
        let local_addr = listener.local_addr()?;
        let host = self.config.host_id.clone().unwrap_or_else(default_host_id);
        let (notif_tx, notif_rx) = mpsc::channel(self.config.notification_queue.max(1));
        let peers = peers::PeerTable::new(self.config.max_peers, self.config.max_peer_bytes);
        let shared = Arc::new(EngineShared {
            id: EngineId::random(),
            host,
            config: self.config,
            backends: self.backends,
            copier: self.copier,
            gpu: self.gpu,
            staging: std::sync::OnceLock::new(),
            regions: RegionTable::new(),
            peers: Mutex::new(peers),
            sessions: Mutex::new(HashMap::new()),
            notif_tx,
            notif_handler: HandlerSlot::default(),
            notif_rx: tokio::sync::Mutex::new(notif_rx),
            chunk_streams: Mutex::new(HashMap::new()),
            local_addr,
            listener: Mutex::new(None),
            closed: AtomicBool::new(false),
            counters: Counters::default(),
        });
        for (i, b) in shared.backends.iter().enumerate() {
            if let Err(e) = b.start(Arc::new(host::HostAdapter::new(&shared))).await {
                for started in &shared.backends[..i] {
                    started.shutdown().await;
                }
                return Err(e);
            }
        }
        let task = tokio::spawn(control::serve(listener, Arc::downgrade(&shared)));
        *lock(&shared.listener) = Some(task);
        Ok(Engine { shared })
    }
}

/// This machine's identity for same-host detection: the kernel boot id (unique per host and boot).
fn default_host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| format!("pid-host-{}", std::process::id()))
}

impl Engine {
    /// A builder with the default configuration.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    /// This engine's id.
    pub fn id(&self) -> EngineId {
        self.shared.id
    }
    /// Host identity.
    pub fn host_id(&self) -> &str {
        &self.shared.host
    }
    /// Control endpoint address (give it to peers).
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }
    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }
    /// What a peer learns about this engine in a handshake.
    pub fn descriptor(&self) -> EngineDescriptor {
        self.shared.descriptor()
    }
    /// The backends, in order of preference.
    pub fn backends(&self) -> &[Arc<dyn Backend>] {
        &self.shared.backends
    }
    /// Counters of what this engine moved.
    pub fn stats(&self) -> EngineStats {
        let c = &self.shared.counters;
        EngineStats {
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            ops_ok: c.ops_ok.load(Ordering::Relaxed),
            ops_failed: c.ops_failed.load(Ordering::Relaxed),
            host_staged: c.host_staged.load(Ordering::Relaxed),
        }
    }

    /// Bytes of this engine's completed ops (as initiator), by the backend that moved them, in
    /// the order each backend first moved something: which path the bytes took.
    pub fn bytes_by_backend(&self) -> Vec<(&'static str, u64)> {
        lock(&self.shared.counters.by_backend).clone()
    }

    /// Each backend's own counters ([`Backend::stats`]: per NIC or rail, for instance), by
    /// backend name, in order of preference.
    pub fn backend_stats(&self) -> Vec<(&'static str, Vec<(String, u64)>)> {
        self.shared.backends.iter().map(|b| (b.name(), b.stats())).collect()
    }

    /// Allocates and registers `len` bytes of zeroed, page-aligned host memory (memfd-backed, so a
    /// same-host peer can map it). `perms` says what peers may do; `Permissions::NONE` keeps it private.
    pub async fn alloc(&self, len: u64, perms: Permissions) -> Result<Region> {
        let n = usize::try_from(len).map_err(|_| Error::Capacity {
            what: "host allocation".into(),
            requested: len,
            limit: usize::MAX as u64,
        })?;
        let mapping = Arc::new(HostMapping::new(n)?);
        self.shared.register(Storage::Owned(mapping), len, MemoryKind::Host, perms).await
    }

    /// The GPU driver, or the error of a GPU call without one.
    fn gpu(&self, what: &str) -> Result<&Arc<dyn Gpu>> {
        self.shared.gpu.as_ref().ok_or_else(|| Error::Unsupported {
            backend: "engine",
            what: format!(
                "{what}: this engine has no GPU driver (build it with EngineBuilder::gpu, e.g. \
                 tensorwire_cuda::CudaGpu::new(), which needs libcuda)"
            ),
        })
    }

    /// Allocates and registers `len` bytes of device memory on GPU `ordinal` (through the
    /// engine's GPU driver); freed when the region is deregistered and no transfer uses it.
    pub async fn alloc_device(&self, ordinal: u32, len: u64, perms: Permissions) -> Result<Region> {
        let gpu = self.gpu("allocating device memory")?.clone();
        let (addr, owner) = gpu.alloc_device(ordinal, len)?;
        let addr = usize::try_from(addr)
            .map_err(|_| Error::Internal(format!("device address {addr:#x} exceeds usize")))?;
        let storage = Storage::Kept { addr, _owner: crate::region::Owner::new(owner) };
        self.shared.register(storage, len, MemoryKind::Device { ordinal }, perms).await
    }

    /// Allocates and registers `len` bytes of zeroed host memory page-locked by the engine's GPU
    /// driver (`MemoryKind::HostPinned`): host memory the driver's DMA engines reach directly,
    /// what device staging copies through. Like [`Engine::alloc`] it is memfd-backed, so a
    /// same-host peer can map it.
    pub async fn alloc_pinned(&self, len: u64, perms: Permissions) -> Result<Region> {
        let gpu = self.gpu("allocating pinned host memory")?.clone();
        let n = usize::try_from(len).map_err(|_| Error::Capacity {
            what: "pinned host allocation".into(),
            requested: len,
            limit: usize::MAX as u64,
        })?;
        let mapping = Arc::new(HostMapping::new(n)?);
        let pin = if n == 0 {
            crate::region::Owner::new(())
        } else {
            // SAFETY: the mapping is `n` bytes of mapped host memory, and the region keeps it
            // mapped until after the pin is released (`Storage::Pinned` drops `pin` first).
            crate::region::Owner::new(unsafe { gpu.pin(mapping.ptr() as usize, len) }?)
        };
        let storage = Storage::Pinned { _pin: pin, mapping };
        self.shared.register(storage, len, MemoryKind::HostPinned, perms).await
    }

    /// Registers a framework's device memory (what a torch tensor's DLPack capsule points at),
    /// after the engine's GPU driver checked that it is device memory of GPU `ordinal`.
    ///
    /// # Safety
    /// As [`Engine::register_raw`]: `[ptr, ptr + len)` must stay allocated until the region is
    /// deregistered (and that call returned) or every transfer that used it ended.
    pub async unsafe fn register_device(
        &self,
        ptr: u64,
        len: u64,
        ordinal: u32,
        perms: Permissions,
    ) -> Result<Region> {
        let addr = self.checked_device(ptr, len, ordinal)?;
        self.register_caller(Storage::Raw(addr), len, MemoryKind::Device { ordinal }, perms).await
    }

    /// `ptr` as an address, once the GPU driver said `[ptr, ptr + len)` is device memory of GPU
    /// `ordinal`.
    fn checked_device(&self, ptr: u64, len: u64, ordinal: u32) -> Result<usize> {
        self.gpu("registering device memory")?.check_device(ptr, len, ordinal)?;
        usize::try_from(ptr)
            .map_err(|_| Error::InvalidArgument(format!("device address {ptr:#x} exceeds usize")))
    }

    /// [`Engine::register_device`] for memory that `owner` keeps allocated (a framework's
    /// tensor and its DLPack capsule): the engine holds `owner` until the region is
    /// deregistered and no transfer uses the memory any more.
    ///
    /// # Safety
    /// As [`Engine::register_owned`]: `[ptr, ptr + len)` stays allocated while `owner` lives.
    pub async unsafe fn register_device_owned<O: std::any::Any + Send + Sync>(
        &self,
        ptr: u64,
        len: u64,
        ordinal: u32,
        perms: Permissions,
        owner: O,
    ) -> Result<Region> {
        let addr = self.checked_device(ptr, len, ordinal)?;
        let storage = Storage::Kept { addr, _owner: crate::region::Owner::new(owner) };
        self.register_caller(storage, len, MemoryKind::Device { ordinal }, perms).await
    }

    /// Registers caller memory (a framework tensor, a DLPack capsule's data, a GPU buffer).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be memory of `kind` that stays valid (not freed, unmapped or moved) until
    /// the returned region has been deregistered with [`Region::deregister`] and that call returned,
    /// or, if the region is simply dropped, until every transfer that used it has completed or been
    /// dropped. Peers granted `perms` may read or write it at any time while registered; the caller
    /// must not rely on its contents while transfers into it are in flight.
    ///
    /// The returned future is `Send` (it holds the address, not the pointer), so registration can
    /// run inside spawned tasks.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: u64,
        kind: MemoryKind,
        perms: Permissions,
    ) -> impl std::future::Future<Output = Result<Region>> + Send + '_ {
        self.register_caller(Storage::Raw(ptr as usize), len, kind, perms)
    }

    /// Registers caller memory that `owner` keeps valid (the framework tensor or buffer it belongs
    /// to): the engine holds `owner` until the region is deregistered and no transfer uses the
    /// memory any more, then drops it. Unlike [`Engine::register_raw`], the caller need not
    /// outlive the region: dropping every handle is enough.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be memory of `kind` that stays valid (not freed, unmapped or moved) for
    /// as long as `owner` is alive. Peers granted `perms` may read or write it at any time while
    /// registered.
    pub unsafe fn register_owned<O: std::any::Any + Send + Sync>(
        &self,
        owner: O,
        ptr: *mut u8,
        len: u64,
        kind: MemoryKind,
        perms: Permissions,
    ) -> impl std::future::Future<Output = Result<Region>> + Send + '_ {
        let storage =
            Storage::Kept { addr: ptr as usize, _owner: crate::region::Owner::new(owner) };
        self.register_caller(storage, len, kind, perms)
    }

    /// Registers caller memory (`Storage::Raw` or `Storage::Kept`), refusing a null pointer.
    async fn register_caller(
        &self,
        storage: Storage,
        len: u64,
        kind: MemoryKind,
        perms: Permissions,
    ) -> Result<Region> {
        let null = matches!(storage, Storage::Raw(0) | Storage::Kept { addr: 0, .. });
        if null && len > 0 {
            return Err(Error::InvalidArgument("registering caller memory: null pointer".into()));
        }
        self.shared.register(storage, len, kind, perms).await
    }

    /// Connects to the engine whose control endpoint is `addr` (handshake: both sides exchange
    /// descriptors) and returns the session, reusing an existing one to the same engine.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Session> {
        self.shared.ensure_open()?;
        let desc = control::handshake(addr, &self.shared).await?;
        Ok(session::Session::open(&self.shared, desc, Some(addr)))
    }

    /// Peers' descriptors kept now (for [`Engine::session`]) and the bytes they take, within
    /// [`EngineConfig::max_peers`] and [`EngineConfig::max_peer_bytes`].
    pub fn known_peers(&self) -> (usize, usize) {
        lock(&self.shared.peers).usage()
    }

    /// The session with a peer that already shook hands with this engine (either direction).
    /// Descriptors of peers with no session are kept within [`EngineConfig::max_peers`] and
    /// [`EngineConfig::max_peer_bytes`]; a peer forgotten meanwhile is `NotFound` until it shakes
    /// hands again.
    pub fn session(&self, peer: EngineId) -> Result<Session> {
        if let Some(s) = lock(&self.shared.sessions).get(&peer) {
            return Ok(s.clone());
        }
        let desc = lock(&self.shared.peers)
            .get(peer)
            .ok_or_else(|| Error::NotFound(Missing::Peer(peer.to_string())))?;
        Ok(session::Session::open(&self.shared, desc, None))
    }

    /// Installs `handler` (replacing any other): each inbound user notification goes through it
    /// first (see [`NotificationHandler`]). `None` removes it.
    pub fn set_notification_handler(&self, handler: Option<NotificationHandler>) {
        self.shared.notif_handler.set(handler);
    }

    /// Waits up to `timeout` for the next user notification from any peer.
    pub async fn recv_notification(&self, timeout: Duration) -> Result<Notification> {
        let mut rx = self.shared.notif_rx.lock().await;
        match tokio::time::timeout(timeout, rx.recv()).await {
            Ok(Some(n)) => Ok(n),
            Ok(None) => Err(Error::PeerClosed("notification queue closed".into())),
            Err(_) => Err(Error::timeout("waiting for a notification", timeout)),
        }
    }

    /// Prepares to receive a chunked transfer of `plan` into `region`, whose tensor storage starts
    /// at `base`. Give the stream's [`ChunkStream::transfer_id`] and `region.remote()` to the
    /// producer; then `next()` yields each chunk as it lands.
    pub fn expect_chunks(
        &self,
        plan: ChunkPlan,
        region: &Region,
        base: u64,
    ) -> Result<ChunkStream> {
        chunked::ChunkStream::open(&self.shared, plan, region, base)
    }

    /// Stops the engine: the control endpoint closes, backends shut down (peers see `PeerClosed`),
    /// sessions and pending chunk streams fail.
    pub async fn shutdown(&self) {
        self.shared.closed.store(true, Ordering::Release);
        let listener = lock(&self.shared.listener).take();
        if let Some(h) = listener {
            h.abort();
            // The task (and so the listening socket) is gone once this returns: a new engine
            // may bind the same address as soon as `shutdown` returned. Bounded all the same.
            let _ = tokio::time::timeout(Duration::from_secs(5), h).await;
        }
        for b in &self.shared.backends {
            b.shutdown().await;
        }
        lock(&self.shared.sessions).clear();
        lock(&self.shared.chunk_streams).clear();
    }

    /// Number of registered regions: the caller's (the engine's own staging bounces, made on
    /// first use of device staging and kept for reuse, are not counted).
    pub fn region_count(&self) -> usize {
        let own = self.shared.staging.get().map_or(0, |p| p.made());
        self.shared.regions.len().saturating_sub(own)
    }

    /// Looks up a registered region's remote view by id (for tests and diagnostics).
    pub fn remote_region(&self, id: RegionId) -> Option<crate::region::RemoteRegion> {
        self.shared.regions.remote(id)
    }
}
