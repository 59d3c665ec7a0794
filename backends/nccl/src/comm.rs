//! The communicator seam: what the backend needs of NCCL, for two ranks (one peer pair). The
//! real one is [`crate::cuda::CudaNccl`] (cudarc's NCCL, device memory, one GPU per rank); the
//! fake ([`crate::fake::FakeNccl`]) moves host memory between two ranks of one process with the
//! same matching rule, so the protocol around it is tested where no GPU is.
//!
//! NCCL's rule, which the backend's protocol relies on: between two ranks, the sends of one and
//! the receives of the other match in the order they were posted; a send and its receive must
//! name the same length.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::{MemoryKinds, Result};

/// A communicator's unique id (`ncclUniqueId`): made by rank 0, carried to rank 1 over the
/// authenticated control channel.
pub type UniqueId = [u8; 128];

/// Called once an op posted on a communicator has ended (from another thread).
pub type Done = Box<dyn FnOnce(Result<()>) + Send>;

/// Where communicators come from.
pub trait Nccl: Send + Sync + Debug + 'static {
    /// Its name ("nccl", "fake-nccl").
    fn name(&self) -> &'static str;
    /// The memory its sends and receives take.
    fn memory(&self) -> MemoryKinds;
    /// A fresh unique id (rank 0 calls it).
    fn unique_id(&self) -> Result<UniqueId>;
    /// Joins the two-rank communicator `id` as `rank` (0 or 1) on GPU `ordinal`; blocks until
    /// the other rank joined, at most `timeout`.
    fn join(
        &self,
        id: &UniqueId,
        rank: u32,
        ordinal: u32,
        timeout: Duration,
    ) -> Result<Arc<dyn Comm>>;
}

/// One communicator of two ranks. Ops run in the order they are posted.
pub trait Comm: Send + Sync + Debug {
    /// Posts a send of `len` bytes at `addr` to the other rank; `done` is called when it ended.
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay readable memory of the communicator's kind until `done`
    /// is called.
    unsafe fn send(&self, addr: u64, len: u64, done: Done);
    /// Posts a receive of `len` bytes into `addr` from the other rank; `done` is called when the
    /// bytes are in place (or the op failed).
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay writable memory of the communicator's kind until `done`
    /// is called.
    unsafe fn recv(&self, addr: u64, len: u64, done: Done);
    /// Aborts (`ncclCommAbort`): every pending and later op ends with an error.
    fn abort(&self);
}
