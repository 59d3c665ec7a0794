//! A peer's region opened in this process through the backend's medium (see [`crate::Medium`]):
//! its address, length and write permission, and the opening itself, closed when the last op
//! copying through it drops its `Arc<Mapping>`.

use tensorwire_core::{Error, Result};

use crate::medium::{Grant, Medium, Opened};

/// A peer's region, opened.
#[derive(Debug)]
pub(crate) struct Mapping {
    addr: usize,
    len: u64,
    writable: bool,
    _opened: Opened,
}

impl Mapping {
    /// Opens a grant through `medium`.
    pub(crate) fn open(medium: &dyn Medium, grant: Grant) -> Result<Mapping> {
        let (len, writable) = (grant.len, grant.writable);
        if len == 0 {
            return Err(Error::protocol("shm: peer granted a zero-length region"));
        }
        let opened = medium.open(grant)?;
        Ok(Mapping { addr: opened.addr, len, writable, _opened: opened })
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
