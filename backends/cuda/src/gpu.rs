//! [`CudaGpu`]: the engine's GPU seam over the CUDA driver API. One retained primary context per
//! device; every call first makes the right one current on the calling thread (copies run on the
//! engine's blocking threads, which have none). Copies go on a non-blocking stream per thread
//! and device.

use std::sync::Arc;

use cudarc::driver::sys;
use tensorwire_core::{Error, MemSlice, MemoryKind, Result, gpu::DeviceCopier, gpu::Gpu};

use crate::NAME;

/// Whether the NVIDIA driver library (libcuda) can be loaded here.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library; nothing is called through it.
    unsafe { sys::is_culib_present() }
}

pub(crate) fn check(r: sys::CUresult, call: &str) -> Result<()> {
    r.result().map_err(|e| Error::Backend {
        backend: NAME,
        source: Arc::new(std::io::Error::other(format!("{call}: {e:?}"))),
    })
}

/// A device and its primary context, retained on first use: a context holds device memory, so
/// one is made only on a device this process works with (a process that never touches GPU 3
/// leaves no context there).
#[derive(Debug)]
pub(crate) struct Device {
    pub(crate) dev: sys::CUdevice,
    ctx: std::sync::Mutex<Option<sys::CUcontext>>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) devices: Vec<Device>,
}

// SAFETY: CUDA device handles and contexts are process-wide handles, usable from any thread
// once made current there (which every call here does first).
unsafe impl Send for Inner {}
// SAFETY: as above; `Inner` is never mutated after construction.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        for d in &self.devices {
            if lock(&d.ctx).is_some() {
                // SAFETY: releasing the primary context retained in `enter` for this device,
                // once; every allocation of ours holds `Inner`, so none is left.
                let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(d.dev) };
            }
        }
    }
}

impl Inner {
    /// Makes device `ordinal`'s context current on this thread.
    pub(crate) fn enter(&self, ordinal: u32) -> Result<()> {
        let d = self.devices.get(ordinal as usize).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "cuda: no device {ordinal} (this host has {})",
                self.devices.len()
            ))
        })?;
        let ctx = {
            let mut ctx = lock(&d.ctx);
            match *ctx {
                Some(c) => c,
                None => {
                    let mut c = std::ptr::null_mut();
                    // SAFETY: writes one context handle for a valid device; released in
                    // `Inner::drop` (recorded as retained below).
                    let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut c, d.dev) };
                    check(r, "cuDevicePrimaryCtxRetain")?;
                    *ctx = Some(c);
                    c
                }
            }
        };
        // SAFETY: `ctx` is a primary context retained for the life of `self`.
        check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")
    }

    /// Makes some device's context current, for calls about host memory or unified addresses
    /// (pinning, pointer queries): one this process already retained, else one a framework of
    /// the process has made active (torch's), else device 0's.
    pub(crate) fn enter_any(&self) -> Result<()> {
        if let Some(i) = self.devices.iter().position(|d| lock(&d.ctx).is_some()) {
            return self.enter(i as u32);
        }
        let active = self.devices.iter().position(|d| {
            let (mut flags, mut on) = (0u32, 0i32);
            // SAFETY: writes the flags and state of a valid device's primary context.
            let r = unsafe { sys::cuDevicePrimaryCtxGetState(d.dev, &mut flags, &mut on) };
            r == sys::CUresult::CUDA_SUCCESS && on != 0
        });
        self.enter(active.unwrap_or(0) as u32)
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The engine's GPU over the CUDA driver (see the crate docs). Cheap to clone.
#[derive(Debug, Clone)]
pub struct CudaGpu {
    pub(crate) inner: Arc<Inner>,
}

impl CudaGpu {
    /// Loads the driver and initialises it; each device's primary context is retained when
    /// first used. `Unsupported` without libcuda or without a device.
    pub fn new() -> Result<Arc<CudaGpu>> {
        if !driver_present() {
            return Err(Error::Unsupported {
                backend: NAME,
                what: "no NVIDIA driver here (libcuda.so.1 cannot be loaded): GPU memory needs \
                       one"
                .into(),
            });
        }
        // SAFETY: the library is present (checked above); cuInit has no other precondition.
        check(unsafe { sys::cuInit(0) }, "cuInit")?;
        let mut count = 0;
        // SAFETY: writes one int.
        check(unsafe { sys::cuDeviceGetCount(&mut count) }, "cuDeviceGetCount")?;
        if count <= 0 {
            return Err(Error::Unsupported { backend: NAME, what: "no CUDA device".into() });
        }
        let mut devices = Vec::with_capacity(count as usize);
        for i in 0..count {
            let mut dev = 0;
            // SAFETY: writes one device handle; `i` is below the device count.
            check(unsafe { sys::cuDeviceGet(&mut dev, i) }, "cuDeviceGet")?;
            devices.push(Device { dev, ctx: std::sync::Mutex::new(None) });
        }
        Ok(Arc::new(CudaGpu { inner: Arc::new(Inner { devices }) }))
    }

    /// Devices on this host.
    pub fn device_count(&self) -> usize {
        self.inner.devices.len()
    }

    /// Whether device `a` can read and write device `b`'s memory directly (NVLink or PCIe P2P).
    pub fn can_access_peer(&self, a: u32, b: u32) -> Result<bool> {
        let (Some(da), Some(db)) =
            (self.inner.devices.get(a as usize), self.inner.devices.get(b as usize))
        else {
            return Err(Error::InvalidArgument(format!("cuda: no device {a} or {b}")));
        };
        let mut can = 0;
        // SAFETY: writes one int; both handles are valid devices.
        let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, da.dev, db.dev) };
        check(r, "cuDeviceCanAccessPeer")?;
        Ok(can != 0)
    }

    /// The raw medium benchmarks compare with: `cuMemcpyDtoD` of `n` bytes on the legacy
    /// stream of device `ordinal`'s context, then `cuCtxSynchronize` (a device-to-device
    /// `cuMemcpyDtoD` does not wait for the copy by itself).
    ///
    /// # Safety
    /// `[src, src+n)` and `[dst, dst+n)` are live device memory during the call.
    pub unsafe fn memcpy_dtod(&self, ordinal: u32, dst: u64, src: u64, n: usize) -> Result<()> {
        self.inner.enter(ordinal)?;
        // SAFETY: the caller's contract.
        check(unsafe { sys::cuMemcpyDtoD_v2(dst, src, n) }, "cuMemcpyDtoD")?;
        // SAFETY: waits for the context's work; no precondition beyond a current context.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    /// The ordinal of the device whose memory holds `addr`, or `None` for memory that is not
    /// device memory (host memory the driver does not know, pinned or managed memory): what a
    /// caller handing a raw address is asked, as Mooncake's engine asks the CUDA runtime.
    pub fn device_of(&self, addr: u64) -> Option<u32> {
        match self.placement(addr) {
            Ok((t, o)) if t == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => {
                u32::try_from(o).ok()
            }
            _ => None,
        }
    }

    /// Where `addr` lives: (CUDA memory type, device ordinal).
    pub(crate) fn placement(&self, addr: u64) -> Result<(u32, i32)> {
        self.inner.enter_any()?;
        let (mut mem_type, mut ordinal): (u32, i32) = (0, -1);
        use sys::CUpointer_attribute::*;
        // SAFETY: each out-pointer is a local of its attribute's type (memory type: u32,
        // ordinal: int), as the driver documents.
        unsafe {
            pointer_attribute((&raw mut mem_type).cast(), CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)?;
            pointer_attribute(
                (&raw mut ordinal).cast(),
                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )?;
        }
        Ok((mem_type, ordinal))
    }

    /// The device memory attributes of `addr`: (memory type, device ordinal, range start,
    /// range size).
    pub(crate) fn attributes(&self, addr: u64) -> Result<(u32, i32, u64, u64)> {
        let (mem_type, ordinal) = self.placement(addr)?;
        let (mut start, mut size): (u64, usize) = (0, 0);
        use sys::CUpointer_attribute::*;
        // SAFETY: each out-pointer is a local of its attribute's type (start: CUdeviceptr, size:
        // size_t), as the driver documents.
        unsafe {
            pointer_attribute(
                (&raw mut start).cast(),
                CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                addr,
            )?;
            pointer_attribute((&raw mut size).cast(), CU_POINTER_ATTRIBUTE_RANGE_SIZE, addr)?;
        }
        Ok((mem_type, ordinal, start, size as u64))
    }
}

/// One `cuPointerGetAttribute` of `addr` (a context must be current).
///
/// # Safety
/// `out` points at writable memory of the attribute's type.
unsafe fn pointer_attribute(
    out: *mut std::ffi::c_void,
    a: sys::CUpointer_attribute,
    addr: u64,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check(unsafe { sys::cuPointerGetAttribute(out, a, addr) }, "cuPointerGetAttribute")
}

/// A copy stream of this thread, created on first use: non-blocking, so a transfer never waits
/// for the framework's work on the legacy default stream (nor holds it up), and copies of
/// different threads (ops of different tasks) run side by side on the copy engines. Destroyed
/// when the thread ends.
struct ThreadStream(sys::CUstream);

impl Drop for ThreadStream {
    fn drop(&mut self) {
        // SAFETY: destroying the stream this thread created, once; nothing else knows it.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}

thread_local! {
    /// This thread's copy stream on each device, by ordinal.
    static STREAMS: std::cell::RefCell<Vec<Option<ThreadStream>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

impl Inner {
    /// Copies `n` bytes from `src` to `dst` (host or device addresses: unified addressing) on
    /// this thread's copy stream of device `ordinal` (the device whose memory it touches, so its
    /// copy engines move the bytes), and returns once they are in place.
    ///
    /// # Safety
    /// Both ranges valid for `n` bytes during the call.
    pub(crate) unsafe fn copy(&self, src: u64, dst: u64, n: usize, ordinal: u32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.enter(ordinal)?;
        STREAMS.with(|cell| {
            let mut streams = cell.borrow_mut();
            let at = ordinal as usize;
            if streams.len() <= at {
                streams.resize_with(at + 1, || None);
            }
            if streams[at].is_none() {
                let mut s = std::ptr::null_mut();
                let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
                // SAFETY: writes one stream handle, in the device's primary context (current).
                check(unsafe { sys::cuStreamCreate(&mut s, flags) }, "cuStreamCreate")?;
                streams[at] = Some(ThreadStream(s));
            }
            let stream = streams[at].as_ref().map(|s| s.0).unwrap_or(std::ptr::null_mut());
            // SAFETY: the caller keeps both ranges valid for `n` bytes until the synchronize
            // below returns; the stream is this thread's own.
            check(unsafe { sys::cuMemcpyAsync(dst, src, n, stream) }, "cuMemcpyAsync")?;
            // SAFETY: waits for the copy just queued on this thread's stream.
            check(unsafe { sys::cuStreamSynchronize(stream) }, "cuStreamSynchronize")
        })
    }
}

/// Device memory from `cuMemAlloc`, freed with its region.
struct Allocation {
    inner: Arc<Inner>,
    ordinal: u32,
    ptr: sys::CUdeviceptr,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if self.inner.enter(self.ordinal).is_ok() {
            // SAFETY: freeing our own allocation once; its region and every transfer that used it
            // are gone (this owner drops with the region).
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Host memory page-locked with `cuMemHostRegister`, unlocked with its region.
struct Pinned {
    inner: Arc<Inner>,
    addr: usize,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.inner.enter_any().is_ok() {
            // SAFETY: unregistering exactly the range registered in `pin`, once, while it is
            // still mapped (the region drops the pin before its mapping).
            let _ = unsafe { sys::cuMemHostUnregister(self.addr as *mut std::ffi::c_void) };
        }
    }
}

fn ordinal_of(s: &MemSlice) -> Option<u32> {
    match s.kind() {
        MemoryKind::Device { ordinal } => Some(ordinal),
        _ => None,
    }
}

impl DeviceCopier for CudaGpu {
    fn name(&self) -> &'static str {
        NAME
    }

    fn copy(&self, dst: &MemSlice, src: &MemSlice) -> Result<()> {
        let n = usize::try_from(src.len())
            .map_err(|_| Error::InvalidArgument("cuda: copy larger than usize".into()))?;
        let ordinal = ordinal_of(dst).or_else(|| ordinal_of(src)).unwrap_or(0);
        // SAFETY: both slices are live (their gates are held by the caller) and `n` bytes long
        // (checked by `copy_from`).
        unsafe { self.inner.copy(src.ptr() as u64, dst.ptr() as u64, n, ordinal) }
    }
}

impl Gpu for CudaGpu {
    fn alloc_device(
        &self,
        ordinal: u32,
        len: u64,
    ) -> Result<(u64, Box<dyn std::any::Any + Send + Sync>)> {
        self.inner.enter(ordinal)?;
        let n = usize::try_from(len.max(1))
            .map_err(|_| Error::InvalidArgument("cuda: allocation larger than usize".into()))?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; the context of `ordinal` is current.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, n) }, "cuMemAlloc")?;
        let owner = Allocation { inner: self.inner.clone(), ordinal, ptr };
        Ok((ptr, Box::new(owner)))
    }

    unsafe fn pin(&self, addr: usize, len: u64) -> Result<Box<dyn std::any::Any + Send + Sync>> {
        self.inner.enter_any()?;
        let n = usize::try_from(len)
            .map_err(|_| Error::InvalidArgument("cuda: pin larger than usize".into()))?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller guarantees `[addr, addr + n)` is mapped host memory outliving the
        // returned owner, which unregisters it.
        let r = unsafe { sys::cuMemHostRegister_v2(addr as *mut std::ffi::c_void, n, flags) };
        check(r, "cuMemHostRegister")?;
        Ok(Box::new(Pinned { inner: self.inner.clone(), addr }))
    }

    fn check_device(&self, addr: u64, len: u64, ordinal: u32) -> Result<()> {
        let (mem_type, dev, start, size) = self.attributes(addr).map_err(|e| {
            Error::InvalidArgument(format!("{addr:#x}: not memory the CUDA driver knows ({e})"))
        })?;
        if mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(Error::InvalidArgument(format!(
                "{addr:#x}: not device memory (CUDA memory type {mem_type})"
            )));
        }
        if dev != ordinal as i32 {
            return Err(Error::InvalidArgument(format!(
                "{addr:#x}: memory of device {dev}, not device {ordinal}"
            )));
        }
        if addr.checked_add(len).is_none_or(|end| end > start + size) {
            return Err(Error::OutOfBounds {
                what: format!("device allocation at {start:#x}"),
                offset: addr - start,
                len,
                limit: size,
            });
        }
        Ok(())
    }
}
