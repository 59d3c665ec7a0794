//! A peer's region mapped into this process from the memfd it granted. The descriptor is closed
//! right after `mmap` (the mapping keeps the memory); dropping the `Mapping` unmaps it.

use std::os::fd::{AsRawFd, OwnedFd};

use tensorwire_core::{Error, Result};

/// A shared mapping of a peer's region.
#[derive(Debug)]
pub(crate) struct Mapping {
    addr: usize,
    len: u64,
    writable: bool,
}

impl Mapping {
    /// Maps `len` bytes of `fd`, writable only if the peer granted a writable descriptor.
    pub(crate) fn new(fd: OwnedFd, len: u64, writable: bool) -> Result<Mapping> {
        if len == 0 {
            return Err(Error::protocol("shm: peer granted a zero-length region"));
        }
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
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), n, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(Mapping { addr: p as usize, len, writable })
    }

    /// Address of byte `offset`, after checking `[offset, offset+len)` is inside the mapping and
    /// that a write is allowed.
    pub(crate) fn at(&self, offset: u64, len: u64, write: bool) -> Result<usize> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(Error::OutOfBounds {
                    what: "shm mapping".into(),
                    offset,
                    len,
                    limit: self.len,
                });
            }
        }
        if write && !self.writable {
            return Err(Error::AccessDenied("shm: the peer granted this region read-only".into()));
        }
        Ok(self.addr + offset as usize)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`, unmapped once; every op copying through it
        // holds an `Arc<Mapping>`, so none is running.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) };
    }
}
