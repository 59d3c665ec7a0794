//! `tensorwire-nccl` ("nccl"): GPU to GPU across hosts over NCCL send/recv.
//!
//! - **Communicators.** One per connection, two ranks: the initiator makes the unique id and
//!   sends it over its control channel, which opens with the engine's authenticated handshake
//!   (the cluster secret), so the id rides an authenticated channel; both sides join it.
//! - **Ops.** NCCL has no one-sided READ or WRITE, so each op is a grant and a matched pair: the
//!   initiator asks (region, key, offset, length, direction), the target checks it through the
//!   engine and, granted, posts its half (a receive for a WRITE, a send for a READ) before it
//!   answers; the initiator posts the other half when the grant arrives. Both sides post in
//!   grant order, so NCCL's in-order matching pairs them; ops on a connection run in order on
//!   its communicator. A WRITE completes when the target reports its receive ended (the bytes
//!   are in place), a READ when the initiator's receive ended.
//! - **Failures.** A closed control channel (dead peer, shutdown) aborts the communicator
//!   (`ncclCommAbort`), which ends every posted op with an error, and fails ops not yet granted
//!   at once. A dropped READ waits for its receive (a posted receive cannot be recalled), at
//!   most `cancel_timeout`, then aborts the communicator.
//! - **Seam.** The communicator is behind [`comm::Nccl`]: [`CudaNccl`] (cudarc's NCCL, loaded at
//!   run time, device memory of one GPU per rank) or [`fake::FakeNccl`] (host memory, two ranks
//!   in one process), which runs the whole protocol and the conformance suite here. NCCL needs
//!   two distinct GPUs, one per rank: the real data path does not run on one GPU.

mod backend;
pub mod comm;
mod cuda;
pub mod fake;
pub mod wire;

use std::net::SocketAddr;
use std::time::Duration;

pub use backend::NcclBackend;
pub use cuda::CudaNccl;

/// The backend's name.
pub const NAME: &str = "nccl";

/// NCCL backend settings.
#[derive(Debug, Clone)]
pub struct NcclConfig {
    /// Control channel listener (port 0 picks one); a routable address between hosts.
    pub listen: SocketAddr,
    /// Address peers dial, when it differs from the bound one.
    pub advertise: Option<SocketAddr>,
    /// Accept unauthenticated peers on a reachable listener (warned).
    pub insecure: bool,
    /// The GPU this engine's communicators run on (device regions on other GPUs are not taken).
    pub ordinal: u32,
    /// Bytes per matched pair: larger ops are cut into pieces, and ops take turns piece by
    /// piece, so a large op never gates a small one.
    pub piece_bytes: u64,
    /// Bound on a control answer (setup, grant, notification).
    pub answer_timeout: Duration,
    /// Bound on joining a communicator (both ranks must arrive).
    pub join_timeout: Duration,
    /// How long a dropped READ waits for its receive before the communicator is aborted.
    pub cancel_timeout: Duration,
}

impl Default for NcclConfig {
    fn default() -> Self {
        NcclConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            insecure: false,
            ordinal: 0,
            piece_bytes: 4 << 20,
            answer_timeout: Duration::from_secs(10),
            join_timeout: Duration::from_secs(30),
            cancel_timeout: Duration::from_secs(10),
        }
    }
}
