//! The backend's state that its connections (`conn`) and serving tasks (`serve`) share with
//! the `Backend` itself (`backend`): the NICs, their counters, the registered regions and the
//! control listener. It names neither side's connection types, so imports point down from all
//! three to here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tensorwire_core::backend::BackendHost;
use tensorwire_core::backend::kit::Serving;
pub(crate) use tensorwire_core::backend::kit::lock;
use tensorwire_core::{Error, RegionId, Result};

use crate::RdmaConfig;
use crate::region::LocalRegion;
use crate::verbs::{Cq, Nic, NicInfo};

/// Per-NIC counters (what `Engine::backend_stats` shows).
#[derive(Debug, Default)]
pub(crate) struct NicCounters {
    pub(crate) bytes: AtomicU64,
    pub(crate) ops: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) inflight: AtomicI64,
}

/// The backend's state, shared by its connections and serving tasks.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) cfg: RdmaConfig,
    pub(crate) provider: &'static str,
    pub(crate) nics: Vec<Arc<dyn Nic>>,
    pub(crate) infos: Vec<NicInfo>,
    pub(crate) counters: Vec<NicCounters>,
    /// A CQ per NIC for the target's QPs (they take no requests of their own).
    pub(crate) passive_cqs: Vec<Arc<dyn Cq>>,
    pub(crate) regions: Mutex<HashMap<RegionId, Arc<LocalRegion>>>,
    pub(crate) serving: Serving<std::net::TcpListener>,
    pub(crate) endpoint: Bytes,
    /// Signalled when a peer gives a lease back.
    pub(crate) released: tokio::sync::Notify,
}

impl Shared {
    pub(crate) fn region(&self, id: RegionId) -> Option<Arc<LocalRegion>> {
        lock(&self.regions).get(&id).cloned()
    }

    pub(crate) fn host(&self) -> Result<Arc<dyn BackendHost>> {
        self.serving.ensure_open()?;
        self.serving.host().ok_or_else(|| Error::PeerClosed("rdma: backend not started".into()))
    }
}
