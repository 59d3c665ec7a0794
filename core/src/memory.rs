//! Memory kinds and engine-allocated host memory (memfd-backed, so a same-host peer can map it).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

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

/// A set of memory kinds (used in [`crate::Capabilities`]).
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
            .ok_or_else(|| Error::protocol("mmap returned a null mapping"))?;
        Ok(HostMapping { ptr, len, fd: Some(fd) })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The memfd behind the mapping (None for an empty mapping), for same-host sharing.
    pub(crate) fn fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(AsRawFd::as_raw_fd)
    }
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
