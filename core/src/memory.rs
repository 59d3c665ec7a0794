//! Memory kinds, engine-allocated host memory (memfd-backed, so a same-host peer can map it), the
//! handle through which a same-host backend shares that memory, and the device copier seam a GPU
//! crate plugs into.

use std::fmt::Debug;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
#[cfg(not(loom))]
use std::sync::Arc;

use crate::error::{Error, Result};

/// Where registered memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Pageable host memory.
    Host,
    /// Page-locked host memory (registered with a GPU driver).
    HostPinned,
    /// GPU memory on the device with this ordinal.
    Device {
        /// CUDA device ordinal.
        ordinal: u32,
    },
}

impl MemoryKind {
    /// True for host memory the CPU can read and write directly.
    pub fn is_host(self) -> bool {
        matches!(self, MemoryKind::Host | MemoryKind::HostPinned)
    }
}

/// A set of memory kinds (used in [`crate::backend::Capabilities`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryKinds {
    /// Pageable host memory.
    pub host: bool,
    /// Pinned host memory.
    pub host_pinned: bool,
    /// Device memory.
    pub device: bool,
}

impl MemoryKinds {
    /// Host and pinned host memory.
    pub const HOST: MemoryKinds = MemoryKinds { host: true, host_pinned: true, device: false };
    /// Device memory only.
    pub const DEVICE: MemoryKinds = MemoryKinds { host: false, host_pinned: false, device: true };
    /// Every kind.
    pub const ALL: MemoryKinds = MemoryKinds { host: true, host_pinned: true, device: true };

    /// Whether `kind` is in the set.
    pub fn contains(self, kind: MemoryKind) -> bool {
        match kind {
            MemoryKind::Host => self.host,
            MemoryKind::HostPinned => self.host_pinned,
            MemoryKind::Device { .. } => self.device,
        }
    }
}

/// A page-aligned shared mapping of a memfd: the memory behind engine-allocated regions.
#[derive(Debug)]
pub(crate) struct HostMapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: Option<OwnedFd>,
}

// SAFETY: the mapping is plain memory owned by this value; all access goes through raw pointers whose
// users synchronise by the engine's protocol (in-flight guards), exactly like memory shown to a NIC.
unsafe impl Send for HostMapping {}
// SAFETY: as above; `&HostMapping` only hands out the base pointer.
unsafe impl Sync for HostMapping {}

impl HostMapping {
    /// Maps `len` zeroed bytes backed by an anonymous memfd. `len == 0` maps nothing.
    pub(crate) fn new(len: usize) -> Result<HostMapping> {
        if len == 0 {
            return Ok(HostMapping { ptr: NonNull::dangling(), len: 0, fd: None });
        }
        let name = c"tensorwire-region";
        // SAFETY: `name` is a valid NUL-terminated string; memfd_create has no other preconditions.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len).map_err(|_| Error::Capacity {
            what: "region size".into(),
            requested: len as u64,
            limit: libc::off_t::MAX as u64,
        })?;
        // SAFETY: `fd` is a valid memfd owned by us.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: mapping a valid fd of at least `len` bytes, with no fixed address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::Internal("mmap returned a null mapping".into()))?;
        Ok(HostMapping { ptr, len, fd: Some(fd) })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The memfd behind the mapping (None for an empty mapping), for same-host sharing.
    fn fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(AsRawFd::as_raw_fd)
    }
}

/// Engine-allocated host memory as a same-host backend sees it at registration: something it can
/// hand to another process of this host (a descriptor to map), never an address to copy through.
/// Caller memory registered with `register_raw` has none.
#[cfg(not(loom))]
#[derive(Debug, Clone)]
pub struct ShareableMemory {
    mapping: Arc<HostMapping>,
}

#[cfg(not(loom))]
impl ShareableMemory {
    pub(crate) fn of(mapping: &Arc<HostMapping>) -> Option<ShareableMemory> {
        mapping.fd().map(|_| ShareableMemory { mapping: mapping.clone() })
    }

    /// Bytes of the memory.
    pub fn len(&self) -> u64 {
        self.mapping.len as u64
    }

    /// Whether it is empty (never: empty mappings are not shareable).
    pub fn is_empty(&self) -> bool {
        self.mapping.len == 0
    }

    /// A new descriptor of the memory to pass to a peer process (e.g. over `SCM_RIGHTS`).
    /// `writable: false` gives a read-only descriptor (reopened through `/proc/self/fd`), so the
    /// peer cannot map it writable; `true` a duplicate of the memfd.
    pub fn open(&self, writable: bool) -> Result<OwnedFd> {
        let fd =
            self.mapping.fd().ok_or_else(|| Error::Internal("shared an empty mapping".into()))?;
        let raw = if writable {
            // SAFETY: F_DUPFD_CLOEXEC on the mapping's memfd, open while `self` holds the mapping.
            unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) }
        } else {
            let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}"))
                .map_err(|_| Error::Internal("a /proc path with a NUL byte".into()))?;
            // SAFETY: opening a NUL-terminated path; the result is checked below.
            unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) }
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: `raw` is a fresh descriptor nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    }
}

/// Copies between memory the CPU cannot touch (device memory) and any other registered memory.
/// A GPU crate implements it (with `cuMemcpy` and friends) and gives it to the engine
/// ([`crate::EngineBuilder::device_copier`]); [`crate::MemSlice::copy_from`] routes every copy
/// that involves a device region through it, and without one such a copy is
/// [`Error::Unsupported`], never a CPU dereference of a device pointer.
#[cfg(not(loom))]
pub trait DeviceCopier: Send + Sync + Debug + 'static {
    /// Short name for errors ("cuda").
    fn name(&self) -> &'static str;
    /// Copies every byte of `src` into `dst` (equal lengths, checked by the caller; the slices'
    /// kinds say where each side lives). Returns once the bytes are in place.
    fn copy(&self, dst: &crate::MemSlice, src: &crate::MemSlice) -> Result<()>;
}

/// A GPU driver as the engine uses it: device memory for [`crate::Engine::alloc_device`], page
/// locking for [`crate::Engine::alloc_pinned`], pointer checks for
/// [`crate::Engine::register_device`], and (as a [`DeviceCopier`]) every copy that involves device
/// memory. A GPU crate implements it (`tensorwire-cuda`) and gives it to the engine with
/// [`crate::EngineBuilder::gpu`]; without one those calls are [`Error::Unsupported`].
#[cfg(not(loom))]
pub trait Gpu: DeviceCopier {
    /// Allocates `len` bytes of device memory on GPU `ordinal`: (device address, owner). The
    /// memory stays allocated until the owner is dropped.
    fn alloc_device(
        &self,
        ordinal: u32,
        len: u64,
    ) -> Result<(u64, Box<dyn std::any::Any + Send + Sync>)>;
    /// Page-locks `[addr, addr + len)` of host memory for the driver's DMA; it is unlocked when the
    /// returned owner drops.
    ///
    /// # Safety
    /// The range must be mapped host memory that outlives the returned owner.
    unsafe fn pin(&self, addr: usize, len: u64) -> Result<Box<dyn std::any::Any + Send + Sync>>;
    /// Checks that `[addr, addr + len)` is device memory of GPU `ordinal` (a framework's tensor);
    /// an error says what it is instead.
    fn check_device(&self, addr: u64, len: u64, ordinal: u32) -> Result<()>;
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: `ptr`/`len` are exactly the mapping created in `new`, unmapped once here; every
            // user of the memory holds an `Arc` to the region owning this mapping, so none is left.
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.len);
            }
        }
    }
}
