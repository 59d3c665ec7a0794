//! The seam between the same-host lease protocol (Unix socket control channel, grants, leases,
//! Forget/Released; written once in this crate) and the memory it moves bytes through. A
//! [`Medium`] says what a registered region exports to peers, how a peer opens that export in its
//! own process, and how bytes are copied between an op's local memory and the opened export.
//! [`crate::Memfd`] shares engine-allocated host memory as memfds copied with the CPU;
//! `tensorwire-cuda` shares device allocations as CUDA IPC handles copied by the GPU.

use std::any::Any;
use std::fmt::Debug;
use std::os::fd::OwnedFd;

use tensorwire_core::Result;
use tensorwire_core::backend::kit::SEGMENT;
use tensorwire_core::backend::{Capabilities, RegionInfo};

/// Largest export a grant carries besides its descriptor (a medium's handle codec).
pub const MAX_SHARE_BYTES: usize = 4096;

/// What peers get for a region, made once at registration; as a [`Grant`], what this process
/// received from a peer with a grant (the same fields, filled from the wire).
#[derive(Debug)]
pub struct Export {
    /// Bytes that travel with the first grant of the region to a peer (at most
    /// [`MAX_SHARE_BYTES`]): an IPC handle, or nothing.
    pub share: Vec<u8>,
    /// A descriptor that travels with it (`SCM_RIGHTS`), or none.
    pub fd: Option<OwnedFd>,
    /// Bytes a peer may reach through the export: the region's length.
    pub len: u64,
    /// Whether the export lets a peer write (a read-only export is refused writes by the peer's
    /// own mapping where the medium can express it, and always by the client's bounds check).
    pub writable: bool,
}

/// A peer's export as this process received it with a grant: what [`Medium::open`] opens.
pub type Grant = Export;

/// A peer's export opened in this process: the address of its first byte (in the address space
/// the medium copies in: a CPU address, or a device address) and whatever keeps it open (closed
/// when dropped, after every copy through it is over).
#[derive(Debug)]
pub struct Opened {
    /// Address of the region's first byte.
    pub addr: usize,
    /// Closes the opening when dropped (an unmap, an IPC handle close).
    pub keep: Box<dyn Any + Send + Sync>,
}

/// The memory a same-host backend shares and how it copies (see the module docs).
pub trait Medium: Send + Sync + Debug + 'static {
    /// The backend's name ("shm", "cuda").
    fn name(&self) -> &'static str;
    /// What the backend can do.
    fn capabilities(&self) -> Capabilities;
    /// The export of `region` for peers, or `None` when this medium cannot share its memory
    /// (the engine then picks another backend for ops on it).
    fn export(&self, region: &RegionInfo) -> Result<Option<Export>>;
    /// Opens a peer's export. Checks everything it can (sizes, handle versions): the grant
    /// comes from another process.
    fn open(&self, grant: Grant) -> Result<Opened>;
    /// Copies `n` bytes from `src` to `dst` and returns once they are in place (never with bytes
    /// still in flight: a cancel waits for the copy in progress, then frees the memory).
    ///
    /// # Safety
    /// `[src, src+n)` readable and `[dst, dst+n)` writable for the call: one is an op's local
    /// slice, the other lies inside an [`Opened`] export that outlives the call.
    unsafe fn copy(&self, src: usize, dst: usize, n: usize) -> Result<()>;
    /// Bytes copied between cancellation checks (a cancel waits for at most one).
    fn segment(&self) -> u64 {
        SEGMENT
    }
    /// Ops on a leased region up to this many bytes are copied inside `submit`, with no task
    /// (0: never; for media whose copy is cheap to start, like a memcpy).
    fn inline_bytes(&self) -> u64 {
        0
    }
    /// Whether a copy holds its thread while a DMA runs (a GPU copy): the protocol then runs
    /// each segment on a blocking thread instead of a runtime worker. CPU copies: false.
    fn blocking(&self) -> bool {
        false
    }
}
