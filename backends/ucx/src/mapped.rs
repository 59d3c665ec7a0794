//! Leased regions this process reaches directly, and the copies callers make into them.
//!
//! Over UCX's shared-memory transports, memory the peer allocated through UCX is mapped into this
//! process once its remote key is unpacked (`ucp_rkey_ptr` gives the address), and a put or get
//! on it is a `memcpy` inside the UCX call. On the progress thread that copy costs the op two
//! thread crossings: the command in and the completion out, each a wake-up (about 35 of a 1 MiB
//! op's 60 us, most of a 4 KiB op's 30 us). So a lease whose whole region is mapped here is also
//! listed in [`Mapped`], and an op on it of at most [`INLINE_BYTES`] is copied by the caller in
//! `submit`, like the shm backend's leased ops: no UCX call, no request, no thread crossing, and
//! the copy is at its destination when `submit` returns (a WRITE needs no flush).
//!
//! The progress thread owns the list: it adds a view when a lease is granted on a mapped region
//! and removes it, under the write lock, before the lease can end: when the peer revokes it
//! (Forget; a peer that shuts down first takes back every lease this way before its Bye), when
//! it is released, when the connection fails or closes, and at shutdown. A caller
//! copies only under the read lock, so once a view is gone no copy into it is running, the lease
//! (holding the remote key, which keeps the mapping) is given back only after that, and the peer
//! unmaps its region only after the lease came back. An op the list cannot take (no view, another
//! key, a range beyond the lease, a larger op, the rest of a larger batch) goes the usual way.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use tensorwire_core::backend::kit::copy_bytes;
use tensorwire_core::backend::{Direction, Op};
use tensorwire_core::{AccessKey, RegionId};

/// Most bytes one `submit` call copies itself (the rest go to the progress thread): a copy holds
/// the caller's runtime thread, and 1 MiB is about 25 us here.
pub(crate) const INLINE_BYTES: u64 = 1 << 20;

/// A leased region as mapped here.
#[derive(Debug, Clone, Copy)]
struct View {
    /// Where the region's first byte is mapped in this process.
    base: usize,
    len: u64,
    key: AccessKey,
}

/// The mapped leases of one backend, by (connection, region, write access).
#[derive(Debug, Default)]
pub(crate) struct Mapped {
    views: RwLock<HashMap<(u64, RegionId, bool), View>>,
    /// Ops copied by their callers so far.
    copied: AtomicU64,
}

impl Mapped {
    fn read(&self) -> RwLockReadGuard<'_, HashMap<(u64, RegionId, bool), View>> {
        self.views.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, HashMap<(u64, RegionId, bool), View>> {
        self.views.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Lists a lease on `region` (for `write` access, with `key`) whose `len` bytes are mapped
    /// here at `base`. Progress thread only; `base` must stay mapped until the view is removed.
    pub(crate) fn add(
        &self,
        conn: u64,
        (region, write): (RegionId, bool),
        base: usize,
        len: u64,
        key: AccessKey,
    ) {
        self.write().insert((conn, region, write), View { base, len, key });
    }

    /// Removes a lease's view; returns once no caller copies into it.
    pub(crate) fn remove(&self, conn: u64, (region, write): (RegionId, bool)) {
        self.write().remove(&(conn, region, write));
    }

    /// Removes every view of a connection; returns once no caller copies into them.
    pub(crate) fn remove_conn(&self, conn: u64) {
        self.write().retain(|k, _| k.0 != conn);
    }

    /// Removes every view (shutdown).
    pub(crate) fn clear(&self) {
        self.write().clear();
    }

    /// Copies `op` (on connection `conn`) now, if a view takes it and it fits in `budget`, which
    /// it then uses up; `None` when the op must go to the progress thread.
    pub(crate) fn copy(&self, conn: u64, op: &Op, budget: &mut u64) -> Option<()> {
        let len = op.local().len();
        if len == 0 || len > *budget {
            return None;
        }
        let write = op.dir() == Direction::Write;
        let views = self.read();
        let v = views.get(&(conn, op.remote().region, write))?;
        let off = op.remote().offset;
        if v.key != op.remote().key || off.checked_add(len).is_none_or(|end| end > v.len) {
            return None;
        }
        *budget -= len;
        let remote = v.base + off as usize;
        let local = op.local().ptr() as usize;
        let (src, dst) = if write { (local, remote) } else { (remote, local) };
        // SAFETY: `op.local()` is a live registered host slice of `len` bytes that `op` holds for
        // this call; `[remote, remote+len)` lies inside the leased region's mapping (checked
        // against the view's length), which stays mapped while the view is listed, and the read
        // guard keeps it listed until the copy is over; the peer holds its region for the lease,
        // which was granted for this access and key. `copy_bytes` allows the two to overlap (a
        // peer in this process).
        unsafe { copy_bytes(src, dst, len as usize) };
        drop(views);
        self.copied.fetch_add(1, Ordering::Relaxed);
        Some(())
    }

    /// Ops copied by their callers so far.
    pub(crate) fn copied(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }
}
