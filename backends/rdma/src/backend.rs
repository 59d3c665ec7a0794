//! The `Backend` the engine sees: NICs opened at construction, the control listener, local
//! registrations, and the connections both ways.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use bytes::Bytes;
use tensorwire_core::backend::kit::{Serving, WeakList};
use tensorwire_core::backend::{
    Backend, BackendHost, Capabilities, Connection, PeerBackendInfo, RegionInfo,
};
use tensorwire_core::{Error, MemoryKinds, RegionId, Result};

use crate::blob::Endpoint;
use crate::conn::ConnShared;
use crate::serve::InConn;
use crate::shared::{NicCounters, Shared, lock};
use crate::soft::{SoftFabric, SoftNicSpec, SoftProvider};
use crate::verbs::{NicInfo, Provider};
use crate::{NAME, RdmaConfig};

/// The RDMA backend (one per engine).
#[derive(Debug)]
pub struct RdmaBackend {
    shared: Arc<Shared>,
    /// Connections to peers and from peers (closed with the backend).
    outbound: WeakList<ConnShared>,
    inbound: Arc<WeakList<InConn>>,
}

impl RdmaBackend {
    /// A backend on `provider`'s NICs (those `cfg.nics` names, or all), with its control
    /// listener bound. `Unsupported` when there is no NIC.
    pub fn new(cfg: RdmaConfig, provider: Arc<dyn Provider>) -> Result<Arc<RdmaBackend>> {
        let dp = &cfg.data_path;
        if dp.slice_bytes == 0 || dp.slice_bytes > u64::from(u32::MAX) {
            return Err(Error::InvalidArgument(format!(
                "rdma slice_bytes {} must be in 1..=4294967295",
                dp.slice_bytes
            )));
        }
        if cfg.qps_per_nic == 0 || dp.window == 0 || dp.op_window == 0 {
            return Err(Error::InvalidArgument(
                "rdma qps_per_nic, window and op_window must be at least 1".into(),
            ));
        }
        let verbs =
            |e: crate::verbs::VerbsError| Error::Backend { backend: NAME, source: Arc::new(e) };
        let mut nics = provider.open_all().map_err(verbs)?;
        if let Some(names) = &cfg.nics {
            nics.retain(|n| names.iter().any(|x| *x == n.info().address.name));
        }
        nics.truncate(crate::blob::MAX_NICS);
        if nics.is_empty() {
            return Err(Error::Unsupported {
                backend: NAME,
                what: format!(
                    "no RDMA NIC{} ({} provider)",
                    cfg.nics.as_ref().map_or(String::new(), |n| format!(" named {n:?}")),
                    provider.name()
                ),
            });
        }
        let infos: Vec<NicInfo> = nics.iter().map(|n| n.info().clone()).collect();
        let passive_cqs = nics.iter().map(|n| n.create_cq(16)).collect::<Result<Vec<_>, _>>();
        let passive_cqs = passive_cqs.map_err(verbs)?;
        let listener = std::net::TcpListener::bind(cfg.listen).map_err(|e| {
            Error::InvalidArgument(format!("rdma: cannot listen on {}: {e}", cfg.listen))
        })?;
        listener.set_nonblocking(true)?;
        let bound = listener.local_addr()?;
        let control = cfg.advertise.unwrap_or(bound);
        let endpoint =
            Endpoint { control, nics: infos.iter().map(|i| i.address.clone()).collect() }
                .encode()
                .into();
        let counters = infos.iter().map(|_| NicCounters::default()).collect();
        Ok(Arc::new(RdmaBackend {
            shared: Arc::new(Shared {
                cfg,
                provider: provider.name(),
                nics,
                infos,
                counters,
                passive_cqs,
                regions: Mutex::new(HashMap::new()),
                serving: Serving::new(NAME, listener),
                endpoint,
                released: tokio::sync::Notify::new(),
            }),
            outbound: WeakList::default(),
            inbound: Arc::default(),
        }))
    }

    /// A backend on `count` new software NICs of `fabric` (see [`crate::soft`]); the provider is
    /// returned too, for fault injection.
    pub fn soft(
        cfg: RdmaConfig,
        fabric: &SoftFabric,
        count: usize,
    ) -> Result<(Arc<RdmaBackend>, Arc<SoftProvider>)> {
        let p = SoftProvider::new(fabric, count, SoftNicSpec::default());
        Ok((RdmaBackend::new(cfg, p.clone())?, p))
    }

    /// The control listener's address as peers see it.
    pub fn control_addr(&self) -> SocketAddr {
        Endpoint::decode(&self.shared.endpoint).map_or(self.shared.cfg.listen, |e| e.control)
    }

    /// The NICs in use.
    pub fn nics(&self) -> Vec<NicInfo> {
        self.shared.infos.clone()
    }

    /// The provider's name ("softnic", "ibverbs").
    pub fn provider(&self) -> &'static str {
        self.shared.provider
    }

    /// Stops serving and closes every connection both ways.
    fn close(&self) {
        self.shared.serving.close();
        for c in self.outbound.take() {
            c.close(self.shared.serving.closed_error());
        }
        for c in self.inbound.take() {
            c.close();
        }
    }
}

impl Drop for RdmaBackend {
    fn drop(&mut self) {
        self.close();
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    shared: Weak<Shared>,
    inbound: Arc<WeakList<InConn>>,
) {
    loop {
        let (sock, peer) = tensorwire_proto::accept::accept(&listener, "rdma control").await;
        let Some(s) = shared.upgrade() else { return };
        if s.serving.is_closed() {
            return;
        }
        let _ = sock.set_nodelay(true);
        let pending = s.serving.admit(peer.ip());
        let serve = crate::serve::serve(Arc::downgrade(&s), inbound.clone(), sock, peer, pending);
        s.serving.spawn(serve);
    }
}

#[async_trait]
impl Backend for RdmaBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        // Local device memory needs a way to register it here; the peer's device memory is
        // reachable whenever the peer registered it (its blob says so), whatever this side has.
        let device = self.shared.cfg.device_memory.is_some()
            || self.shared.nics.iter().any(|n| n.peer_memory());
        Capabilities {
            local: MemoryKinds { host: true, host_pinned: true, device },
            remote: MemoryKinds::ALL,
            read: true,
            write: true,
            notify: true,
            same_host_only: false,
            max_request_bytes: 1 << 40,
        }
    }

    async fn start(&self, host: Arc<dyn BackendHost>) -> Result<()> {
        let s = &self.shared;
        let listener = s.serving.start_tcp(host, "rdma control channel", s.cfg.insecure)?;
        let bound = listener.local_addr()?;
        s.serving.spawn(accept_loop(listener, Arc::downgrade(s), self.inbound.clone()));
        tracing::debug!(
            provider = s.provider,
            nics = ?s.infos.iter().map(|n| &n.address.name).collect::<Vec<_>>(),
            %bound,
            "rdma: started"
        );
        Ok(())
    }

    fn endpoint(&self) -> Bytes {
        self.shared.endpoint.clone()
    }

    async fn register(&self, region: &RegionInfo) -> Result<Option<Bytes>> {
        let s = &self.shared;
        let Some(r) =
            crate::region::register(&s.nics, &s.infos, region, s.cfg.device_memory.as_ref())?
        else {
            return Ok(None);
        };
        let blob = Bytes::from(r.keys().encode());
        lock(&s.regions).insert(region.id, Arc::new(r));
        Ok(Some(blob))
    }

    async fn deregister(&self, id: RegionId) -> Result<()> {
        let s = &self.shared;
        // No lease is granted from now on (a grant checks this after holding its lease, so a
        // lease granted meanwhile is among the holders below). Peers that lease the region give
        // it back first (bounded), then its MRs go (once no op of ours still uses them), then
        // any lease a peer did not give back is revoked.
        if let Some(r) = s.region(id) {
            r.closing.store(true, Ordering::SeqCst);
        }
        let holders: Vec<Arc<InConn>> =
            self.inbound.live().into_iter().filter(|c| c.holds(id)).collect();
        for c in &holders {
            c.forget(id);
        }
        let deadline = tokio::time::Instant::now() + s.cfg.answer_timeout;
        loop {
            let released = s.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if !holders.iter().any(|c| c.holds(id)) {
                break;
            }
            if tokio::time::timeout_at(deadline, released).await.is_err() {
                tracing::warn!(
                    region = id.0,
                    "rdma: a peer did not give a lease back in time; revoking it"
                );
                break;
            }
        }
        lock(&s.regions).remove(&id);
        for c in &holders {
            c.revoke(id);
        }
        Ok(())
    }

    async fn connect(&self, peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>> {
        self.shared.serving.ensure_open()?;
        let c = crate::conn::connect(&self.shared, peer).await?;
        self.outbound.push(&c);
        Ok(Arc::new(crate::conn::RdmaConnection::new(c)))
    }

    async fn shutdown(&self) {
        self.close();
    }

    fn stats(&self) -> Vec<(String, u64)> {
        let mut v = Vec::with_capacity(self.shared.infos.len() * 4);
        for (info, c) in self.shared.infos.iter().zip(&self.shared.counters) {
            let n = &info.address.name;
            v.push((format!("{n}.bytes"), c.bytes.load(Ordering::Relaxed)));
            v.push((format!("{n}.ops"), c.ops.load(Ordering::Relaxed)));
            v.push((format!("{n}.errors"), c.errors.load(Ordering::Relaxed)));
            v.push((format!("{n}.inflight"), c.inflight.load(Ordering::Relaxed).max(0) as u64));
        }
        v
    }
}
