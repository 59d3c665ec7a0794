//! [`IpcDriver`] over the CUDA driver API, for [`CudaGpu`]: allocations from
//! `cuPointerGetAttribute`, handles from `cuIpcGetMemHandle`, openings with
//! `cuIpcOpenMemHandle` (lazy peer access, so a GPU reaches another's memory over NVLink or PCIe
//! peer to peer) closed with `cuIpcCloseMemHandle`, and copies with `cuMemcpyAsync` on the
//! thread's copy stream of the device whose memory they touch (unified addressing: the driver
//! picks the path from the two addresses).

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::sys;
use tensorwire_core::{Error, Result};

use crate::CudaGpu;
use crate::gpu::{Inner, check};
use crate::ipc::IpcShare;
use crate::medium::IpcDriver;

/// A peer's allocation opened with `cuIpcOpenMemHandle`, closed when dropped.
struct IpcOpening {
    inner: Arc<Inner>,
    ordinal: u32,
    ptr: sys::CUdeviceptr,
}

impl Drop for IpcOpening {
    fn drop(&mut self) {
        if self.inner.enter(self.ordinal).is_ok() {
            // SAFETY: closing exactly the opening made in `open`, once; every copy through it
            // holds the mapping that owns this value, so none is running.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

impl IpcDriver for CudaGpu {
    fn allocation(&self, addr: u64) -> Result<(u64, u64)> {
        let (mem_type, _, start, size) = self.attributes(addr)?;
        if mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(Error::InvalidArgument(format!("cuda: {addr:#x} is not device memory")));
        }
        Ok((start, size))
    }

    fn uuid(&self, ordinal: u32) -> Result<[u8; 16]> {
        let d = self
            .inner
            .devices
            .get(ordinal as usize)
            .ok_or_else(|| Error::InvalidArgument(format!("cuda: no device {ordinal}")))?;
        let mut u = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: writes one UUID for a valid device handle.
        check(unsafe { sys::cuDeviceGetUuid_v2(&mut u, d.dev) }, "cuDeviceGetUuid")?;
        Ok(u.bytes.map(|b| b as u8))
    }

    fn export(&self, base: u64, ordinal: u32) -> Result<[u8; 64]> {
        self.inner.enter(ordinal)?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: writes one handle; `base` is the start of a live allocation of this device
        // (checked by the caller through `allocation`).
        check(unsafe { sys::cuIpcGetMemHandle(&mut h, base) }, "cuIpcGetMemHandle")?;
        Ok(h.reserved.map(|b| b as u8))
    }

    fn open(&self, share: &IpcShare, here: bool) -> Result<(u64, Box<dyn Any + Send + Sync>)> {
        if here {
            // Exported by this process (another engine of it): the address is valid as it is,
            // and the exporter holds the allocation while the grant lasts.
            return Ok((share.addr, Box::new(())));
        }
        let ordinal = (0..self.device_count() as u32)
            .find(|&o| self.uuid(o).is_ok_and(|u| u == share.uuid))
            .ok_or_else(|| Error::Unsupported {
                backend: crate::NAME,
                what: "the peer's GPU is not visible to this process (CUDA_VISIBLE_DEVICES?)"
                    .into(),
            })?;
        self.inner.enter(ordinal)?;
        let handle = sys::CUipcMemHandle { reserved: share.handle.map(|b| b as _) };
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: writes one device pointer; the handle bytes came from the peer's driver (a
        // wrong one is refused by the driver with an error).
        let r = unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags) };
        check(r, "cuIpcOpenMemHandle")?;
        Ok((ptr, Box::new(IpcOpening { inner: self.inner.clone(), ordinal, ptr })))
    }

    unsafe fn copy(&self, src: u64, dst: u64, n: usize) -> Result<()> {
        // On the stream of the device whose memory is written, or else read (an opening of a
        // peer's allocation is device memory of the GPU it lives on).
        let device = |a: u64| {
            self.placement(a).ok().and_then(|(t, o)| {
                (t == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32).then_some(o as u32)
            })
        };
        let ordinal = device(dst).or_else(|| device(src)).unwrap_or(0);
        // SAFETY: forwarded contract.
        unsafe { self.inner.copy(src, dst, n, ordinal) }
    }
}
