//! A fake CUDA IPC driver over the fake GPU ([`crate::fake_gpu`], device memory the CPU cannot
//! touch), for tests without a GPU (feature `cuda`: `tensorwire-cuda`'s tests and the Python
//! package's fake CUDA device): handles are random tokens a table of exports resolves, openings and closings are
//! counted, and copies go through the fake GPU. Engines of one process share one, as processes
//! share one GPU driver; a handle opens only in the process that made it.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::fake_gpu::FakeGpu;
use tensorwire_core::backend::kit::lock;
use tensorwire_core::{Error, Result, backend::Backend};
use tensorwire_cuda::IpcDriver;
use tensorwire_cuda::ipc::IpcShare;

/// What a [`FakeIpc`] did, and a switch to make its exports fail.
#[derive(Debug, Default)]
pub struct Counts {
    /// Allocations exported.
    pub exported: AtomicUsize,
    /// Handles opened.
    pub opened: AtomicUsize,
    /// Openings closed.
    pub closed: AtomicUsize,
    /// Exports fail (as `cuIpcGetMemHandle` does on memory from `cuMemCreate`).
    pub refuse: std::sync::atomic::AtomicBool,
}

/// The fake driver (see the module docs).
#[derive(Debug)]
pub struct FakeIpc {
    /// The fake GPU whose memory it shares and copies.
    pub gpu: Arc<FakeGpu>,
    /// Handle -> (base, length) of the allocation it opens.
    exports: Mutex<HashMap<[u8; 64], (u64, u64)>>,
    /// What it did.
    pub counts: Arc<Counts>,
}

impl FakeIpc {
    /// A driver over `gpu`.
    pub fn new(gpu: Arc<FakeGpu>) -> Arc<FakeIpc> {
        Arc::new(FakeIpc { gpu, exports: Mutex::default(), counts: Arc::default() })
    }

    /// Handles opened so far.
    pub fn opened(&self) -> usize {
        self.counts.opened.load(Ordering::Relaxed)
    }

    /// Openings closed so far.
    pub fn closed(&self) -> usize {
        self.counts.closed.load(Ordering::Relaxed)
    }

    /// Allocations exported so far.
    pub fn exported(&self) -> usize {
        self.counts.exported.load(Ordering::Relaxed)
    }
}

/// An opening, counted closed when dropped.
struct Closing(Arc<Counts>);

impl Drop for Closing {
    fn drop(&mut self) {
        self.0.closed.fetch_add(1, Ordering::Relaxed);
    }
}

impl IpcDriver for FakeIpc {
    fn allocation(&self, addr: u64) -> Result<(u64, u64)> {
        self.gpu.allocation(addr).map(|(base, len, _)| (base, len)).ok_or_else(|| {
            Error::InvalidArgument(format!("fake ipc: {addr:#x} is not device memory"))
        })
    }

    fn uuid(&self, ordinal: u32) -> Result<[u8; 16]> {
        Ok([ordinal as u8 + 1; 16])
    }

    fn export(&self, base: u64, _ordinal: u32) -> Result<[u8; 64]> {
        if self.counts.refuse.load(Ordering::Relaxed) {
            return Err(Error::InvalidArgument("fake ipc: this memory has no IPC handle".into()));
        }
        let (_, len) = self.allocation(base)?;
        let mut handle = [0u8; 64];
        handle[..32].copy_from_slice(&rand::random::<[u8; 32]>());
        handle[32..].copy_from_slice(&rand::random::<[u8; 32]>());
        lock(&self.exports).insert(handle, (base, len));
        self.counts.exported.fetch_add(1, Ordering::Relaxed);
        Ok(handle)
    }

    fn open(&self, share: &IpcShare, _here: bool) -> Result<(u64, Box<dyn Any + Send + Sync>)> {
        // Always through the table (a real driver shortcuts its own exports): the handle must
        // be one the driver made, for the allocation the share names.
        match lock(&self.exports).get(&share.handle) {
            Some(&(base, len)) if base == share.addr && len == share.len => {}
            other => {
                return Err(Error::InvalidArgument(format!(
                    "fake ipc: unknown handle ({other:?})"
                )));
            }
        }
        self.counts.opened.fetch_add(1, Ordering::Relaxed);
        Ok((share.addr, Box::new(Closing(self.counts.clone()))))
    }

    unsafe fn copy(&self, src: u64, dst: u64, n: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.gpu.copy_raw(src as usize, dst as usize, n) };
        Ok(())
    }

    /// The fake copies with the CPU, one copy at a time: CPU-sized segments, so a large op lets
    /// its batchmates through between them.
    fn segment(&self) -> u64 {
        tensorwire_core::backend::kit::SEGMENT
    }
}

/// A cuda backend over `ipc`.
pub fn cuda(ipc: &Arc<FakeIpc>) -> Result<Arc<dyn Backend>> {
    tensorwire_cuda::backend(ipc.clone(), Default::default()).map(|b| b as Arc<dyn Backend>)
}
