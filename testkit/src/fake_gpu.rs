//! A fake GPU for tests that run without one: [`FakeGpu`] implements the engine's GPU seam
//! ([`tensorwire_core::gpu::Gpu`]) with "device memory" the CPU cannot touch: host pages mapped
//! `PROT_NONE`, made readable and writable only inside the fake's own copies. A backend or an
//! engine path that dereferences device memory on the CPU (instead of going through the device
//! copier) crashes the test instead of passing by accident.
//!
//! ```ignore
//! let gpu = FakeGpu::new();
//! let engine = Engine::builder().backend(b).gpu(gpu.clone()).start().await?;
//! let dev = engine.alloc_device(0, 1 << 20, Permissions::READ_WRITE).await?;
//! ```
//!
//! It also fakes a framework's streams ([`FakeGpu::stream`]): a test holds one back (as if a
//! kernel queued on it had not run yet) and releases it, and an event recorded on it while it is
//! held completes only at the release ([`FakeEvent`]), so a test can check that nothing reads a
//! tensor before its producer's event, nor writes one before its consumer's.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tensorwire_core::backend::kit::lock;

use tensorwire_core::{Error, MemSlice, MemoryKind, Result, gpu::DeviceCopier, gpu::Gpu};

/// One fake device allocation: a private anonymous mapping, `PROT_NONE` outside copies.
#[derive(Debug)]
struct Allocation {
    base: usize,
    len: usize,
    ordinal: u32,
}

/// Unmaps an allocation when its region's owner drops.
struct Freed {
    gpu: Arc<Inner>,
    base: usize,
}

impl Drop for Freed {
    fn drop(&mut self) {
        let a = lock(&self.gpu.allocs).remove(&self.base);
        if let Some(a) = a {
            // SAFETY: exactly the mapping `alloc_device` made, unmapped once; the region that
            // used it is gone (this owner drops with it).
            unsafe { libc::munmap(a.base as *mut libc::c_void, a.len) };
        }
        self.gpu.freed.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Default)]
struct Inner {
    allocs: Mutex<BTreeMap<usize, Allocation>>,
    /// Copies running on each allocation (by base): its pages are accessible while any runs,
    /// so copies of different ops run side by side, as a GPU's copy engines do.
    copying: Mutex<BTreeMap<usize, usize>>,
    copies: AtomicUsize,
    /// Fake streams by id: (held back now, releases so far).
    streams: Mutex<BTreeMap<u64, (bool, u64)>>,
    pins: AtomicUsize,
    unpins: AtomicUsize,
    freed: AtomicUsize,
}

/// A fake GPU (see the module docs). Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct FakeGpu {
    inner: Arc<Inner>,
}

/// What a fake GPU did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FakeGpuCounts {
    /// Copies through the device copier.
    pub copies: usize,
    /// Host ranges pinned, and unpinned.
    pub pins: usize,
    /// Host ranges unpinned.
    pub unpins: usize,
    /// Device allocations freed.
    pub freed: usize,
    /// Device allocations live now.
    pub live: usize,
}

impl FakeGpu {
    /// A fake GPU with devices 0 and 1.
    pub fn new() -> Arc<FakeGpu> {
        Arc::new(FakeGpu::default())
    }

    /// What it did so far.
    pub fn counts(&self) -> FakeGpuCounts {
        let i = &self.inner;
        FakeGpuCounts {
            copies: i.copies.load(Ordering::Relaxed),
            pins: i.pins.load(Ordering::Relaxed),
            unpins: i.unpins.load(Ordering::Relaxed),
            freed: i.freed.load(Ordering::Relaxed),
            live: lock(&i.allocs).len(),
        }
    }

    /// A new fake stream (its id, never 0: 0 is the legacy default stream, which is never held).
    pub fn stream(&self) -> u64 {
        let mut streams = lock(&self.inner.streams);
        let id = streams.keys().next_back().map_or(1, |k| k + 1);
        streams.insert(id, (false, 0));
        id
    }

    /// Holds stream `id` back: events recorded on it from now on complete at its release.
    pub fn hold_stream(&self, id: u64) -> Result<()> {
        self.with_stream(id, |s| s.0 = true)
    }

    /// Releases stream `id`: the events recorded while it was held complete.
    pub fn release_stream(&self, id: u64) -> Result<()> {
        self.with_stream(id, |s| {
            if s.0 {
                *s = (false, s.1 + 1);
            }
        })
    }

    /// Records an event on stream `id`: done at once if the stream is not held, else at its
    /// next release.
    pub fn record_event(&self, id: u64) -> Result<FakeEvent> {
        if id == 0 {
            return Ok(FakeEvent { gpu: self.inner.clone(), stream: 0, after: None });
        }
        let mut after = None;
        self.with_stream(id, |s| after = s.0.then_some(s.1))?;
        Ok(FakeEvent { gpu: self.inner.clone(), stream: id, after })
    }

    fn with_stream(&self, id: u64, f: impl FnOnce(&mut (bool, u64))) -> Result<()> {
        let mut streams = lock(&self.inner.streams);
        let s = streams
            .get_mut(&id)
            .ok_or_else(|| Error::InvalidArgument(format!("fake gpu: no stream {id}")))?;
        f(s);
        Ok(())
    }

    /// The allocation containing `[addr, addr + len)`, if any.
    fn find(&self, addr: usize, len: usize) -> Option<(usize, usize, u32)> {
        let allocs = lock(&self.inner.allocs);
        let (_, a) = allocs.range(..=addr).next_back()?;
        (addr >= a.base && addr.checked_add(len)? <= a.base + a.len)
            .then_some((a.base, a.len, a.ordinal))
    }

    /// The device allocation holding `addr`: (base, length, device), as a driver's pointer
    /// query gives it; `None` for memory that is not this fake's device memory.
    pub fn allocation(&self, addr: u64) -> Option<(u64, u64, u32)> {
        let (base, len, ordinal) = self.find(usize::try_from(addr).ok()?, 1)?;
        Some((base as u64, len as u64, ordinal))
    }

    /// Copies `n` bytes from `src` to `dst`, either of which may be this fake's device memory
    /// (made accessible for the copy only), as a driver's copy between unified addresses does.
    ///
    /// # Safety
    /// `[src, src+n)` readable and `[dst, dst+n)` writable (once accessible) for the call.
    pub unsafe fn copy_raw(&self, src: usize, dst: usize, n: usize) {
        let mut opened: Vec<(usize, usize)> = [dst, src]
            .into_iter()
            .filter_map(|a| self.find(a, n.max(1)).map(|(base, len, _)| (base, len)))
            .collect();
        opened.dedup();
        {
            let mut running = lock(&self.inner.copying);
            for &(base, len) in &opened {
                let k = running.entry(base).or_insert(0);
                if *k == 0 {
                    Self::protect(base, len, libc::PROT_READ | libc::PROT_WRITE);
                }
                *k += 1;
            }
        }
        // SAFETY: the caller's contract, and any device side is accessible while this copy is
        // counted on it; `ptr::copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
        let mut running = lock(&self.inner.copying);
        for (base, len) in opened {
            if let Some(k) = running.get_mut(&base) {
                *k -= 1;
                if *k == 0 {
                    running.remove(&base);
                    Self::protect(base, len, libc::PROT_NONE);
                }
            }
        }
        self.inner.copies.fetch_add(1, Ordering::Relaxed);
    }

    fn protect(base: usize, len: usize, prot: libc::c_int) {
        // SAFETY: changing the protection of one of our own mappings.
        let r = unsafe { libc::mprotect(base as *mut libc::c_void, len, prot) };
        assert_eq!(r, 0, "fake gpu: mprotect failed");
    }
}

/// An event recorded on a fake stream ([`FakeGpu::record_event`]).
#[derive(Debug)]
pub struct FakeEvent {
    gpu: Arc<Inner>,
    stream: u64,
    /// The stream's release count when it was recorded on a held stream.
    after: Option<u64>,
}

impl FakeEvent {
    /// Whether the work it marks has run (the stream was released since it was recorded).
    pub fn done(&self) -> bool {
        let Some(after) = self.after else { return true };
        lock(&self.gpu.streams).get(&self.stream).is_none_or(|&(_, releases)| releases > after)
    }
}

/// Unlocks a pinned range when dropped (counted).
struct Pin(Arc<Inner>);

impl Drop for Pin {
    fn drop(&mut self) {
        self.0.unpins.fetch_add(1, Ordering::Relaxed);
    }
}

impl DeviceCopier for FakeGpu {
    fn name(&self) -> &'static str {
        "fake-gpu"
    }

    fn copy(&self, dst: &MemSlice, src: &MemSlice) -> Result<()> {
        let n = src.len() as usize;
        for s in [dst, src] {
            if let MemoryKind::Device { ordinal } = s.kind() {
                let (_, _, o) = self.find(s.ptr() as usize, n).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "fake gpu: {:#x}+{n} is not device memory of this GPU",
                        s.ptr() as usize
                    ))
                })?;
                if o != ordinal {
                    return Err(Error::InvalidArgument(format!(
                        "fake gpu: memory of device {o} named as device {ordinal}"
                    )));
                }
            }
        }
        // SAFETY: both slices are live and `n` bytes long (lengths checked by `copy_from`).
        unsafe { self.copy_raw(src.ptr() as usize, dst.ptr() as usize, n) };
        Ok(())
    }
}

impl Gpu for FakeGpu {
    fn alloc_device(
        &self,
        ordinal: u32,
        len: u64,
    ) -> Result<(u64, Box<dyn std::any::Any + Send + Sync>)> {
        if ordinal > 1 {
            return Err(Error::InvalidArgument(format!("fake gpu: no device {ordinal}")));
        }
        let n = usize::try_from(len.max(1)).map_err(|_| Error::Capacity {
            what: "fake device allocation".into(),
            requested: len,
            limit: usize::MAX as u64,
        })?;
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        let base = p as usize;
        lock(&self.inner.allocs).insert(base, Allocation { base, len: n, ordinal });
        Ok((base as u64, Box::new(Freed { gpu: self.inner.clone(), base })))
    }

    unsafe fn pin(&self, _addr: usize, _len: u64) -> Result<Box<dyn std::any::Any + Send + Sync>> {
        self.inner.pins.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(Pin(self.inner.clone())))
    }

    fn check_device(&self, addr: u64, len: u64, ordinal: u32) -> Result<()> {
        match self.find(addr as usize, len as usize) {
            Some((_, _, o)) if o == ordinal => Ok(()),
            Some((_, _, o)) => Err(Error::InvalidArgument(format!(
                "{addr:#x}: memory of device {o}, not device {ordinal}"
            ))),
            None => Err(Error::InvalidArgument(format!(
                "{addr:#x}+{len}: not device memory (the fake GPU did not allocate it)"
            ))),
        }
    }
}
