//! [`CudaIpc`]: the cuda backend's medium for the same-host protocol of `tensorwire-shm` (grants,
//! leases, Forget/Released, all written there). A device region is exported as a CUDA IPC handle
//! of its allocation, opened by the peer in its own process, and bytes are copied by the GPU
//! between the op's local memory (device or host: unified addressing) and the opening: NVLink or
//! PCIe peer to peer between GPUs, the device's own copy engines within one.
//!
//! An IPC handle opens a whole allocation, so only a region that *is* a whole allocation (what
//! `Engine::alloc_device` makes, or a framework's allocation registered whole) is exported; a
//! region inside a larger allocation (a tensor carved from a caching allocator's block) is not,
//! so that no peer can reach its neighbours: the engine moves it through its next backend (tcp
//! with device staging). A handle cannot be opened read-only: a peer that may only read is kept
//! from writing by its own backend's check, which a process of the same user that ignores the
//! protocol could skip (the same trust a same-uid process has over `/proc/<pid>/mem`).

use std::any::Any;
use std::fmt::Debug;
use std::sync::{Arc, OnceLock};

use tensorwire_core::backend::{Capabilities, RegionInfo};
use tensorwire_core::{Error, MemoryKind, MemoryKinds, Result};
use tensorwire_shm::{Export, Grant, Medium, Opened};

use crate::NAME;
use crate::ipc::IpcShare;

/// What the cuda backend asks of a GPU driver: the CUDA driver ([`crate::CudaGpu`]) on a GPU
/// machine, a fake in tests without one.
pub trait IpcDriver: Send + Sync + Debug + 'static {
    /// The device allocation holding `addr`: (its base, its length). An error for memory that
    /// is not device memory.
    fn allocation(&self, addr: u64) -> Result<(u64, u64)>;
    /// The UUID of device `ordinal`.
    fn uuid(&self, ordinal: u32) -> Result<[u8; 16]>;
    /// An IPC handle of the allocation at `base` on device `ordinal`.
    fn export(&self, base: u64, ordinal: u32) -> Result<[u8; 64]>;
    /// Opens a peer's export in this process: the allocation's address here and what closes it
    /// when dropped. `here`: this process exported it (a handle cannot be opened by its own
    /// exporter; its address is valid as it is).
    fn open(&self, share: &IpcShare, here: bool) -> Result<(u64, Box<dyn Any + Send + Sync>)>;
    /// Copies `n` bytes from `src` to `dst` (host or device addresses on either side) and returns
    /// once they are in place.
    ///
    /// # Safety
    /// Both ranges are valid (readable, writable) for `n` bytes during the call.
    unsafe fn copy(&self, src: u64, dst: u64, n: usize) -> Result<()>;
    /// Bytes per copy between cancellation checks (a cancelled op waits for at most one; a
    /// batchmate behind it on a serial copier too). The default suits a GPU: a few hundred
    /// microseconds at device bandwidth, large enough that a copy's launch cost is lost in it.
    fn segment(&self) -> u64 {
        256 << 20
    }
}

/// A token for this process, drawn once (see [`crate::ipc`]).
fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(rand::random)
}

/// Device memory shared as CUDA IPC handles, copied by the GPU (see the module docs).
#[derive(Debug)]
pub struct CudaIpc {
    driver: Arc<dyn IpcDriver>,
}

impl CudaIpc {
    /// The medium over `driver`.
    pub fn new(driver: Arc<dyn IpcDriver>) -> CudaIpc {
        CudaIpc { driver }
    }
}

impl Medium for CudaIpc {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: MemoryKinds::ALL,
            remote: MemoryKinds::DEVICE,
            read: true,
            write: true,
            notify: true,
            same_host_only: true,
            max_request_bytes: 1 << 40,
        }
    }

    fn export(&self, region: &RegionInfo) -> Result<Option<Export>> {
        let MemoryKind::Device { ordinal } = region.kind else {
            return Ok(None); // host memory: shm or tcp move it
        };
        if region.len == 0 {
            return Ok(None);
        }
        let base = region.base() as u64;
        // What the driver cannot export (memory it does not know as one allocation, memory from
        // `cuMemCreate`, which has no legacy handle) goes to the next backend, not to an error:
        // the region is still good for every other medium.
        let not_exported = |e: Error| {
            tracing::debug!(region = region.id.0, error = %e, "cuda: not exported over IPC");
            Ok(None)
        };
        let (start, len) = match self.driver.allocation(base) {
            Ok(a) => a,
            Err(e) => return not_exported(e),
        };
        if start != base || len != region.len {
            tracing::debug!(
                region = region.id.0,
                "cuda: not exported over IPC: the region is {} bytes at {:#x} of a {len}-byte \
                 allocation at {start:#x}, and a handle would open all of it",
                region.len,
                base.saturating_sub(start),
            );
            return Ok(None);
        }
        let exported =
            self.driver.uuid(ordinal).and_then(|u| Ok((u, self.driver.export(base, ordinal)?)));
        let (uuid, handle) = match exported {
            Ok(x) => x,
            Err(e) => return not_exported(e),
        };
        let share = IpcShare { process: process_token(), uuid, addr: base, len, handle };
        Ok(Some(Export { share: share.encode(), fd: None, len, writable: region.perms.write }))
    }

    fn open(&self, grant: Grant) -> Result<Opened> {
        let share = IpcShare::decode(&grant.share)?;
        if grant.fd.is_some() {
            return Err(Error::protocol("cuda: a descriptor came with an IPC handle"));
        }
        if share.len != grant.len {
            return Err(Error::protocol(format!(
                "cuda: the IPC handle opens {} bytes, the grant names {}",
                share.len, grant.len
            )));
        }
        let (addr, keep) = self.driver.open(&share, share.process == process_token())?;
        let addr = usize::try_from(addr).map_err(|_| Error::protocol("cuda: address"))?;
        Ok(Opened { addr, keep })
    }

    unsafe fn copy(&self, src: usize, dst: usize, n: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.driver.copy(src as u64, dst as u64, n) }
    }

    fn segment(&self) -> u64 {
        self.driver.segment()
    }

    fn blocking(&self) -> bool {
        true
    }
}
