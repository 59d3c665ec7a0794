//! [`Memfd`], the shm backend's medium: engine-allocated host memory shared as its memfd (a
//! read-only descriptor for regions peers may only read, mapped `PROT_READ`), mapped by the peer
//! and copied with the CPU. The descriptor is closed right after `mmap` (the mapping keeps the
//! memory); dropping the opening unmaps it.

use std::os::fd::{AsRawFd, OwnedFd};

use tensorwire_core::backend::kit::copy_bytes;
use tensorwire_core::backend::{Capabilities, RegionInfo};
use tensorwire_core::{Error, Result};

use crate::medium::{Export, Grant, Medium, Opened};

/// Host memory shared as memfds, copied by the CPU (the shm backend's medium).
#[derive(Debug, Default, Clone, Copy)]
pub struct Memfd;

/// Ops on a leased region are copied right in `submit`, up to this many bytes per call: no task
/// to spawn and no thread to wake, which on an idle machine costs more than a small copy. The
/// caller waits for at most this much copying (about 25 us).
const INLINE: u64 = 1 << 20;

impl Medium for Memfd {
    fn name(&self) -> &'static str {
        crate::NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::host(true, 1 << 40)
    }

    fn export(&self, region: &RegionInfo) -> Result<Option<Export>> {
        let Some(mem) = region.shareable() else {
            return Ok(None); // caller memory: peers reach it through another backend
        };
        // Peers that may only read get a read-only descriptor: they cannot map it writable.
        let fd = mem.open(region.perms.write)?;
        Ok(Some(Export {
            share: Vec::new(),
            fd: Some(fd),
            len: mem.len(),
            writable: region.perms.write,
        }))
    }

    fn open(&self, grant: Grant) -> Result<Opened> {
        let Grant { fd, len, writable, .. } = grant;
        let fd = fd.ok_or_else(|| Error::protocol("shm: a grant without its memfd"))?;
        map(&fd, len, writable) // the descriptor closes here: the mapping keeps the memory
    }

    unsafe fn copy(&self, src: usize, dst: usize, n: usize) -> Result<()> {
        // SAFETY: forwarded contract (both ranges valid for `n` bytes for the call).
        unsafe { copy_bytes(src, dst, n) };
        Ok(())
    }

    fn inline_bytes(&self) -> u64 {
        INLINE
    }
}

/// An `mmap` of a peer's memfd, unmapped when dropped.
#[derive(Debug)]
struct Unmap {
    addr: usize,
    len: usize,
}

impl Drop for Unmap {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `map`, unmapped once; every op copying through it
        // holds the mapping that owns this value, so none is running.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// Maps `len` (non-zero, checked by the caller) bytes of `fd` shared, writable only if the peer
/// granted a writable descriptor; refused when `fd` holds fewer bytes.
pub(crate) fn map(fd: &OwnedFd, len: u64, writable: bool) -> Result<Opened> {
    // SAFETY: fstat on an open descriptor into a zeroed stat buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    if (st.st_size as u64) < len {
        return Err(Error::protocol(format!(
            "shm: granted descriptor holds {} bytes, region claims {len}",
            st.st_size
        )));
    }
    let n = usize::try_from(len).map_err(|_| Error::protocol("shm: region exceeds usize"))?;
    let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
    // SAFETY: mapping `n` bytes of a descriptor at least that large, at no fixed address.
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), n, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().into());
    }
    let addr = p as usize;
    Ok(Opened { addr, keep: Box::new(Unmap { addr, len: n }) })
}
