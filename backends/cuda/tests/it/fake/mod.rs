//! A fake CUDA IPC driver over the conformance suite's fake GPU (device memory the CPU cannot
//! touch): handles are random tokens a table of exports resolves, openings and closings are
//! counted, and copies go through the fake GPU. Both engines of a test share one, as two
//! processes share one GPU driver.
#![allow(dead_code)] // each test file uses a part

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tensorwire_core::{Error, Result, backend::Backend};
use tensorwire_cuda::IpcDriver;
use tensorwire_cuda::ipc::IpcShare;
use tensorwire_testkit::fake_gpu::FakeGpu;

#[derive(Debug, Default)]
pub(crate) struct Counts {
    pub(crate) exported: AtomicUsize,
    pub(crate) opened: AtomicUsize,
    pub(crate) closed: AtomicUsize,
    /// Exports fail (as `cuIpcGetMemHandle` does on memory from `cuMemCreate`).
    pub(crate) refuse: std::sync::atomic::AtomicBool,
}

#[derive(Debug)]
pub(crate) struct FakeIpc {
    pub(crate) gpu: Arc<FakeGpu>,
    /// Handle -> (base, length) of the allocation it opens.
    exports: Mutex<HashMap<[u8; 64], (u64, u64)>>,
    pub(crate) counts: Arc<Counts>,
}

impl FakeIpc {
    pub(crate) fn new(gpu: Arc<FakeGpu>) -> Arc<FakeIpc> {
        Arc::new(FakeIpc { gpu, exports: Mutex::default(), counts: Arc::default() })
    }

    pub(crate) fn opened(&self) -> usize {
        self.counts.opened.load(Ordering::Relaxed)
    }

    pub(crate) fn closed(&self) -> usize {
        self.counts.closed.load(Ordering::Relaxed)
    }

    pub(crate) fn exported(&self) -> usize {
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
        self.exports.lock().unwrap().insert(handle, (base, len));
        self.counts.exported.fetch_add(1, Ordering::Relaxed);
        Ok(handle)
    }

    fn open(&self, share: &IpcShare, _here: bool) -> Result<(u64, Box<dyn Any + Send + Sync>)> {
        // Always through the table (a real driver shortcuts its own exports): the handle must
        // be one the driver made, for the allocation the share names.
        match self.exports.lock().unwrap().get(&share.handle) {
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
pub(crate) fn cuda(ipc: &Arc<FakeIpc>) -> Arc<dyn Backend> {
    tensorwire_cuda::backend(ipc.clone(), Default::default()).expect("a cuda backend")
}
