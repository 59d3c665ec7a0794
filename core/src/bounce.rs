//! A bounce: a pinned host buffer of the engine's staging pool, lent to an op (or to a backend
//! staging on the target side, [`crate::backend::BackendHost::bounce`]) whose memory is on a GPU
//! the transport cannot reach, and back in the pool when dropped.

use std::sync::{Arc, Mutex, Weak};

use tokio::sync::OwnedSemaphorePermit;

use crate::cancel::CancelGate;
use crate::error::{Error, Result};
use crate::region::{MemSlice, Region};
use crate::sync::lock;

/// Bytes of one bounce buffer.
pub const BOUNCE_BYTES: u64 = 4 << 20;

/// A pinned host buffer of the engine's staging pool, back in the pool when dropped.
#[derive(Debug)]
pub struct Bounce {
    region: Option<Region>,
    free: Weak<Mutex<Vec<Region>>>,
    _permit: OwnedSemaphorePermit,
}

impl Bounce {
    /// `region`, taken from the pool's `free` list (or made) under `permit`; back in `free` when
    /// dropped.
    pub(crate) fn new(
        region: Region,
        free: Weak<Mutex<Vec<Region>>>,
        permit: OwnedSemaphorePermit,
    ) -> Bounce {
        Bounce { region: Some(region), free, _permit: permit }
    }

    /// Its length ([`BOUNCE_BYTES`]).
    pub fn len(&self) -> u64 {
        self.region.as_ref().map_or(0, Region::len)
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its first `len` bytes.
    pub fn slice(&self, len: u64) -> Result<MemSlice> {
        self.sub(0, len)
    }

    /// `len` bytes of it at `offset`.
    pub fn sub(&self, offset: u64, len: u64) -> Result<MemSlice> {
        match &self.region {
            Some(r) => r.slice(offset, len),
            None => Err(Error::Internal("a bounce without its region".into())),
        }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        if let (Some(r), Some(free)) = (self.region.take(), self.free.upgrade()) {
            lock(&free).push(r);
        }
    }
}

/// Copies `src` into `dst` through the engine's device copier on a blocking thread, inside
/// `gate` when one is given (a copy into local memory of a cancellable op).
pub async fn copy_blocking(
    dst: MemSlice,
    src: MemSlice,
    gate: Option<Arc<CancelGate>>,
) -> Result<bool> {
    let done = tokio::task::spawn_blocking(move || match gate {
        Some(g) => g.run(|| dst.copy_from(&src)).map_or(Ok(false), |r| r.map(|()| true)),
        None => dst.copy_from(&src).map(|()| true),
    })
    .await;
    done.map_err(|e| Error::Internal(format!("a staging copy task failed: {e}")))?
}
