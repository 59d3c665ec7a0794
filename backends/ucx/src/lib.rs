//! `tensorwire-ucx`: the UCX backend. One library, every medium UCX reaches (TCP, same-host shared
//! memory and CMA, RDMA, and GPU memory with a CUDA build of UCX), through its one-sided API.
//!
//! - **Build.** The FFI lives behind the `ucx` cargo feature (`tensorwire-ucx-sys`, bindgen against
//!   the system's headers; Debian: `apt-get install libucx-dev libclang-dev`). Without it the crate
//!   still builds and [`new_backend`] reports `Unsupported`.
//! - **Data path.** Each registered region is mapped with `ucp_mem_map` and its packed remote key
//!   is the region's public blob. A WRITE is `ucp_put_nbx`, a READ `ucp_get_nbx`, in segments of
//!   [`UcxConfig::segment_bytes`] with up to [`UcxConfig::window`] in flight; a WRITE completes
//!   after `ucp_ep_flush_nbx`, so its bytes are at the peer before anything that follows.
//! - **Access control.** Before moving bytes, an op asks the target (active message Begin) to check
//!   it through the engine: region, key, permission, bounds. Only a granted op learns the address of
//!   its range; the target holds the range (deregistration waits) until the op's End. The first op
//!   on a region is granted a lease on the whole region (checked the same way, for its access):
//!   later ops with the same key and access start at once, with no Begin and no End, their range
//!   checked against the lease. Deregistration tells the initiator (Forget), which gives the lease
//!   back (Released) once its ops on it are flushed; deregistration waits for that. UCX itself
//!   does not bound what a modified peer does with a packed key on tcp or shared-memory transports
//!   (CMA lets any same-user process write anywhere): trust peers as you trust UCX's.
//! - **Copies in `submit`.** Where UCX maps a leased region into this process (memory the peer
//!   allocated through UCX, over a shared-memory transport: `ucp_rkey_ptr`), ops on it of up to
//!   1 MiB per `submit` call are copied by the caller, with no UCX call and no thread crossing
//!   (see `mapped`); the progress thread withdraws such a lease's view before the lease can go
//!   back, and a caller copies only while the view is listed.
//! - **Notifications** are active messages, sent once every op submitted before them completed,
//!   and acknowledged (a full queue at the peer is an error at the sender).
//! - **Progress.** One thread per backend owns every UCX object (worker in single-thread mode) and
//!   sleeps in `poll(2)` on the worker's event fd (`ucp_worker_arm`) and a command eventfd: no
//!   spinning when idle, no locks around UCX, callbacks that never race Rust state.
//! - **Cancellation.** Dropping a READ's completion stops new segments and waits until UCX finished
//!   the ones in flight; if they do not finish within the answer timeout the endpoint is
//!   force-closed (UCX cancels them) before the drop returns. UCX never writes into memory whose
//!   op was dropped. Requests UCX keeps after a forced close, and ranges a departed peer held,
//!   keep their memory until the worker is destroyed (engine memory detached, so regions still
//!   deregister). Process exit right after dropping a backend is safe: an `atexit` hook keeps the
//!   progress threads out of UCX while libucs tears down.
//! - **UCX-allocated memory.** [`UcxBackend::allocate`] hands out memory UCX allocated (register it
//!   with `register_raw`): UCX's shared-memory transports map it at the peer, so put/get into it is
//!   one copy; on other memory UCX 1.13 falls back to software put/get (two copies).
//! - **Transports** are UCX's choice, steered by its own environment variables (`UCX_TLS`,
//!   `UCX_NET_DEVICES`, ...) or by [`UcxConfig::options`] (the same names without `UCX_`).

// Without the `ucx` feature the backend these docs link to is not built.
#![cfg_attr(not(feature = "ucx"), allow(rustdoc::broken_intra_doc_links))]

#[cfg(feature = "ucx")]
mod backend;
#[cfg(feature = "ucx")]
mod conns;
#[cfg(feature = "ucx")]
mod exit;
#[cfg(feature = "ucx")]
mod ffi;
pub mod gate;
#[cfg(feature = "ucx")]
mod inbound;
#[cfg(feature = "ucx")]
mod mapped;
#[cfg(feature = "ucx")]
mod outbound;
#[cfg(feature = "ucx")]
mod progress;
#[cfg(feature = "ucx")]
mod tokens;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::{Result, backend::Backend};

#[cfg(feature = "ucx")]
pub use backend::{UcxBackend, UcxMemory};

/// The backend's name.
pub const NAME: &str = "ucx";

/// UCX backend settings.
#[derive(Debug, Clone)]
pub struct UcxConfig {
    /// UCX configuration applied on top of the environment, names without the `UCX_` prefix
    /// (e.g. `("TLS", "sm,self")`, `("NET_DEVICES", "lo")`).
    pub options: Vec<(String, String)>,
    /// A peer that leaves a request unanswered (or UCX requests without progress) this long is
    /// declared dead: every op on the connection fails with `Timeout`.
    pub answer_timeout: Duration,
    /// Bytes per put/get request.
    pub segment_bytes: u64,
    /// Requests in flight per op.
    pub window: u32,
    /// Ask UCX to detect failed peers (`UCP_ERR_HANDLING_MODE_PEER`); transports that cannot are
    /// then not used.
    pub peer_failure_detection: bool,
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            options: Vec::new(),
            answer_timeout: Duration::from_secs(10),
            segment_bytes: 16 << 20,
            window: 2,
            peer_failure_detection: false,
        }
    }
}

impl UcxConfig {
    /// Settings that restrict UCX to the given transports (`UCX_TLS`), on loopback only.
    pub fn transports(tls: &str) -> UcxConfig {
        UcxConfig {
            options: vec![("TLS".into(), tls.into()), ("NET_DEVICES".into(), "lo".into())],
            ..UcxConfig::default()
        }
    }

    /// Adds one UCX option (name without `UCX_`).
    pub fn option(mut self, name: &str, value: &str) -> UcxConfig {
        self.options.push((name.into(), value.into()));
        self
    }
}

/// Whether this build links libucx (the `ucx` feature).
pub const fn available() -> bool {
    cfg!(feature = "ucx")
}

/// A UCX backend, or `Unsupported` when this build has no UCX (or UCX fails to start).
pub fn new_backend(cfg: UcxConfig) -> Result<Arc<dyn Backend>> {
    #[cfg(feature = "ucx")]
    {
        Ok(UcxBackend::with_config(cfg)? as Arc<dyn Backend>)
    }
    #[cfg(not(feature = "ucx"))]
    {
        let _ = cfg;
        Err(tensorwire_core::Error::Unsupported {
            backend: NAME,
            what: "this build has no UCX: enable the `ucx` feature of tensorwire-ucx \
                   (needs `apt-get install libucx-dev libclang-dev`)"
                .into(),
        })
    }
}

#[cfg(all(test, not(feature = "ucx")))]
mod tests {
    #[test]
    fn without_the_feature_the_backend_is_unsupported() {
        let e = super::new_backend(super::UcxConfig::default()).unwrap_err();
        assert!(matches!(e, tensorwire_core::Error::Unsupported { backend: "ucx", .. }), "{e}");
        assert!(!super::available());
    }
}
