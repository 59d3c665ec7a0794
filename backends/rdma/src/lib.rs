//! `tensorwire-rdma`: the RDMA backend ("rdma"). One-sided RDMA WRITE and READ between
//! registered regions of two engines, sliced and sprayed over every NIC pair that reaches the
//! peer, with rails that fail over and an op that falls back to the engine's next backend when
//! no rail is left.
//!
//! - **Verbs seam.** Everything the backend asks of a NIC goes through [`verbs`]: libibverbs
//!   through `sideway` (cargo feature `verbs`; [`ibverbs_provider`]) or the software NIC
//!   [`soft`], which implements reliable-connected semantics in process (ordered per QP, the
//!   responder's key, bounds and access checks, faults on demand), so the whole backend runs and
//!   is tested where no RDMA device exists.
//! - **Setup.** The endpoint blob carries a control-channel address and each NIC's
//!   GID/LID/port/fabric. A connection opens the control channel with the engine's
//!   authenticated handshake (the cluster secret), pairs NICs of the same fabric, and exchanges
//!   QP numbers and PSNs (`qps_per_nic` QPs per NIC pair; each QP is a *rail*).
//! - **Grants.** A region's blob carries its rkey on each NIC. An op also needs a lease: the
//!   first op on a region for an access asks the target, which checks region, key, permission
//!   and bounds through the engine, holds the region (deregistration waits) and answers with its
//!   addresses. Later ops with the same key run at once, their range checked against the lease.
//!   Deregistration sends Forget; the initiator answers Released once its requests on the
//!   region completed. MRs grant remote access only as the region's permissions say, so the
//!   NIC enforces them too.
//! - **Data path.** Ops are cut into [`DataPath::slice_bytes`] slices; each goes to the usable
//!   rail with room and the least bytes in flight, among the rails whose local NIC suits the
//!   region's memory (NUMA node of host memory, PCIe distance of the GPU; [`affinity`]) first.
//!   Every request is signalled; completions come through each CQ's completion channel,
//!   awaited by tokio (no polling while idle). The state machine is [`dispatch`], apart from IO.
//! - **Failures.** A completion in error fails or retries only its slice: a path failure pauses
//!   the rail with backoff ([`rails`]) and sends the slice to another rail; the rail's QP is
//!   re-created (through the control channel) once its old requests are flushed. A refused
//!   access (bad key, bounds) is an error, never retried. When every rail is paused the op is
//!   handed back to the engine ([`tensorwire_core::backend::Op::fall_back`]), which runs it on its next
//!   backend (tcp) within the op's deadline.
//! - **Cancellation.** A posted request cannot be recalled: dropping a READ's completion posts
//!   nothing more and waits (bounded by [`RdmaConfig::cancel_timeout`]) for its requests; past
//!   that, their QPs are moved to ERROR and the drop waits for the flush, so no byte lands after
//!   the drop returns.
//! - **GPUDirect.** Device regions are registered as dma-bufs when a GPU crate provides
//!   [`DeviceMemory`]; otherwise the backend does not take them (the engine moves them with
//!   another backend).
//! - **Counters.** Per NIC bytes, requests, errors and requests in flight, through
//!   [`tensorwire_core::Engine::backend_stats`].

pub mod affinity;
mod backend;
pub mod blob;
mod conn;
mod control;
pub mod dispatch;
#[cfg(feature = "verbs")]
mod ibv;
pub mod rails;
mod region;
mod serve;
mod shared;
pub mod soft;
pub mod verbs;
pub mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use backend::RdmaBackend;
pub use dispatch::DataPath;
pub use region::DeviceMemory;

use verbs::{Provider, QpTiming};

/// The backend's name.
pub const NAME: &str = "rdma";

/// RDMA backend settings.
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// Control channel listener (port 0 picks one). Default 127.0.0.1:0; bind a routable address
    /// (or 0.0.0.0 with `advertise`) between hosts.
    pub listen: SocketAddr,
    /// Address peers dial, when it differs from the bound one.
    pub advertise: Option<SocketAddr>,
    /// Accept unauthenticated peers on a reachable listener (warned); see the engine's rule.
    pub insecure: bool,
    /// NICs to use, by device name (`None`: every NIC the provider has).
    pub nics: Option<Vec<String>>,
    /// QPs (rails) per NIC pair.
    pub qps_per_nic: usize,
    /// How ops become work requests: slice size, windows per rail and per op, retries, rail
    /// backoff, strict affinity.
    pub data_path: DataPath,
    /// Bound on a control-channel answer (lease, notification, rail, setup).
    pub answer_timeout: Duration,
    /// How long a dropped READ waits for its requests before their QPs are moved to ERROR.
    pub cancel_timeout: Duration,
    /// QP transport settings (timeouts, retries).
    pub timing: QpTiming,
    /// The GPU side of GPUDirect RDMA (device regions as dma-bufs), when a GPU crate gives one.
    pub device_memory: Option<Arc<dyn DeviceMemory>>,
    /// The sysfs root NIC topology is read from.
    pub sysfs: PathBuf,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            insecure: false,
            nics: None,
            qps_per_nic: 2,
            data_path: DataPath::default(),
            answer_timeout: Duration::from_secs(10),
            cancel_timeout: Duration::from_secs(2),
            timing: QpTiming::default(),
            device_memory: None,
            sysfs: PathBuf::from("/sys"),
        }
    }
}

/// libibverbs (through `sideway`), when this build has the `verbs` feature.
pub fn ibverbs_provider() -> tensorwire_core::Result<Arc<dyn Provider>> {
    #[cfg(feature = "verbs")]
    {
        Ok(Arc::new(ibv::Ibverbs::new(PathBuf::from("/sys"))))
    }
    #[cfg(not(feature = "verbs"))]
    {
        Err(tensorwire_core::Error::Unsupported {
            backend: NAME,
            what: "this build has no libibverbs: enable the `verbs` feature of tensorwire-rdma \
                   (its build needs cmake and libclang; at run time libibverbs.so.1)"
                .into(),
        })
    }
}

/// Whether this host has an RDMA device the kernel knows of (`/sys/class/infiniband`).
pub fn host_has_rdma_device() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}
