//! Registered memory: the region handle users hold, the descriptor peers hold, and the guarded slices
//! every byte of registered memory is reached through ([`MemSlice`]: bounds, memory kind and the
//! in-flight gate checked once, here).

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::ids::{AccessKey, EngineId, RegionId};
use crate::inflight::InflightGate;
use crate::memory::{DeviceCopier, HostMapping, MemoryKind};
use crate::tensor::{decode_kind, encode_kind};
use crate::wire::codec::{Reader, Writer};

/// What a remote peer may do with a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Permissions {
    /// Peers may READ from it.
    pub read: bool,
    /// Peers may WRITE into it.
    pub write: bool,
}

impl Permissions {
    /// Not visible to peers at all.
    pub const NONE: Permissions = Permissions { read: false, write: false };
    /// Peers may read.
    pub const READ: Permissions = Permissions { read: true, write: false };
    /// Peers may write.
    pub const WRITE: Permissions = Permissions { read: false, write: true };
    /// Peers may read and write.
    pub const READ_WRITE: Permissions = Permissions { read: true, write: true };

    pub(crate) fn bits(self) -> u8 {
        u8::from(self.read) | (u8::from(self.write) << 1)
    }
    pub(crate) fn from_bits(b: u8) -> Result<Self> {
        if b > 3 {
            return Err(Error::protocol(format!("unknown permission bits {b:#x}")));
        }
        Ok(Permissions { read: b & 1 != 0, write: b & 2 != 0 })
    }
}

/// The direction of an access, seen from the region's owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Bytes are read out of the region.
    Read,
    /// Bytes are written into the region.
    Write,
}

#[derive(Debug)]
pub(crate) enum Storage {
    Owned(Arc<HostMapping>),
    /// Engine memory page-locked by the GPU driver: unlocked (`pin` drops) before it is unmapped.
    Pinned {
        _pin: Owner,
        mapping: Arc<HostMapping>,
    },
    /// Caller memory at this address (see `Engine::register_raw`'s contract).
    Raw(usize),
    /// Caller memory at this address, kept valid by `owner` (see `Engine::register_owned`): the
    /// owner drops with the last holder of the region, after every transfer that used it.
    Kept {
        addr: usize,
        _owner: Owner,
    },
}

/// What keeps caller memory alive (a framework tensor, a buffer); opaque to the engine.
pub(crate) struct Owner {
    /// Never read: held to be dropped with the region.
    _keep: Box<dyn std::any::Any + Send + Sync>,
}

impl Owner {
    pub(crate) fn new(owner: impl std::any::Any + Send + Sync) -> Owner {
        Owner { _keep: Box::new(owner) }
    }
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Owner(..)")
    }
}

/// The memory and registration state of a region; shared by the handle and every in-flight op.
#[derive(Debug)]
pub(crate) struct RegionInner {
    pub(crate) id: RegionId,
    pub(crate) key: AccessKey,
    pub(crate) kind: MemoryKind,
    pub(crate) perms: Permissions,
    pub(crate) len: u64,
    pub(crate) storage: Storage,
    pub(crate) gate: InflightGate,
    pub(crate) drained: tokio::sync::Notify,
    /// Each backend's public blob for this region (a backend that cannot reach it has none).
    pub(crate) blobs: Vec<(&'static str, Bytes)>,
    pub(crate) engine_id: EngineId,
    /// The engine's copier for device memory, if a GPU crate gave it one.
    pub(crate) copier: Option<Arc<dyn DeviceCopier>>,
}

impl RegionInner {
    pub(crate) fn base(&self) -> *mut u8 {
        match &self.storage {
            Storage::Owned(m) | Storage::Pinned { mapping: m, .. } => m.ptr(),
            Storage::Raw(addr) | Storage::Kept { addr, .. } => *addr as *mut u8,
        }
    }

    /// Checks `offset + len <= self.len` without overflow.
    pub(crate) fn check_bounds(&self, offset: u64, len: u64, what: &str) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                what: format!("{what} region {}", self.id.0),
                offset,
                len,
                limit: self.len,
            }),
        }
    }

    /// Enters the in-flight gate for `[offset, offset+len)`; fails once deregistration started.
    pub(crate) fn slice(self: &Arc<Self>, offset: u64, len: u64, what: &str) -> Result<MemSlice> {
        self.check_bounds(offset, len, what)?;
        if !self.gate.enter() {
            return Err(Error::NotFound(crate::error::Missing::Deregistered(self.id)));
        }
        Ok(MemSlice { region: self.clone(), offset, len })
    }
}

/// A bounds-checked window of registered memory, holding the region's in-flight gate open while it
/// lives: deregistration waits for every `MemSlice` to drop.
///
/// Host bytes are reached through its safe accessors ([`MemSlice::with_host_bytes`],
/// [`MemSlice::write_at`], [`MemSlice::read_at`], [`MemSlice::crc32c`]), any kind through
/// [`MemSlice::copy_from`] (device memory only through the engine's [`DeviceCopier`]); each
/// refuses what it cannot do for the slice's memory kind with [`Error::Unsupported`]. Backends
/// that hand the memory to hardware or the kernel take its [`MemSlice::ptr`].
#[derive(Debug)]
pub struct MemSlice {
    region: Arc<RegionInner>,
    offset: u64,
    len: u64,
}

impl MemSlice {
    /// The region this slice is in.
    pub fn region_id(&self) -> RegionId {
        self.region.id
    }
    /// Offset of the slice in its region.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Memory kind of the region.
    pub fn kind(&self) -> MemoryKind {
        self.region.kind
    }
    /// Pointer to the first byte of the slice, for backends handing the memory to a NIC, a
    /// socket or a driver; valid for `len()` bytes while the slice lives, in the address space of
    /// its [`MemSlice::kind`] (a device pointer for device memory: never dereference it on the
    /// CPU). Other transfers may access the same bytes concurrently (as with memory shown to a
    /// NIC): use `ptr::copy`, never form references that assume exclusivity.
    pub fn ptr(&self) -> *mut u8 {
        // `offset + len <= region len` was checked at construction, so this stays in the allocation.
        self.region.base().wrapping_add(self.offset as usize)
    }
    /// The region, offset and length (for building a transfer of this slice).
    pub(crate) fn parts(&self) -> (Arc<RegionInner>, u64, u64) {
        (self.region.clone(), self.offset, self.len)
    }
    /// This backend's public blob for the region (what its `register` returned).
    pub fn blob(&self, backend: &str) -> Option<&Bytes> {
        self.region.blobs.iter().find(|(n, _)| *n == backend).map(|(_, b)| b)
    }
    /// A narrower window of this slice (`offset` relative to the slice). It fails only out of
    /// bounds, never because deregistration started: this slice holds the region, and the window
    /// holds it too (deregistration waits for both), so a transfer that resolved its range can
    /// always finish, or drain, what it began.
    pub fn sub(&self, offset: u64, len: u64) -> Result<MemSlice> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                self.region.gate.join();
                Ok(MemSlice { region: self.region.clone(), offset: self.offset + offset, len })
            }
            _ => Err(Error::OutOfBounds {
                what: format!("slice of region {}", self.region.id.0),
                offset,
                len,
                limit: self.len,
            }),
        }
    }
}

impl MemSlice {
    fn host_only(&self, what: &str) -> Result<()> {
        if self.kind().is_host() {
            return Ok(());
        }
        Err(Error::Unsupported {
            backend: "engine",
            what: format!("{what} of {:?} region {} on the CPU", self.kind(), self.region.id.0),
        })
    }

    fn host_len(&self) -> Result<usize> {
        usize::try_from(self.len).map_err(|_| Error::Capacity {
            what: "host view".into(),
            requested: self.len,
            limit: usize::MAX as u64,
        })
    }

    /// Runs `f` over the slice's bytes (host memory only). The view is of registered memory: a
    /// peer allowed to WRITE into the region, or a transfer this process started into it, may
    /// change the bytes while `f` runs; read them after the transfers that fill them completed.
    pub fn with_host_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.host_only("reading bytes")?;
        let n = self.host_len()?;
        if n == 0 {
            return Ok(f(&[]));
        }
        // SAFETY: host memory of the region, `n` bytes from the slice's start, in bounds (checked
        // when the slice was made) and kept registered and mapped by the slice's gate.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr().cast_const(), n) };
        Ok(f(bytes))
    }

    /// Copies `data` into the slice at `offset` (host memory only).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.host_only("writing bytes")?;
        let dst = self.sub(offset, data.len() as u64)?;
        // SAFETY: `dst` is `data.len()` bytes of live host memory (checked by `sub`), `data` as
        // many readable bytes. (`copy_bytes`, not a plain memcpy: a caller's buffer often sits
        // at the page distance from a region where the C library's memcpy crawls.)
        unsafe { crate::copy::copy_bytes(data.as_ptr() as usize, dst.ptr() as usize, data.len()) };
        Ok(())
    }

    /// Copies the slice's bytes at `offset` into `out` (host memory only).
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.host_only("reading bytes")?;
        let src = self.sub(offset, out.len() as u64)?;
        // SAFETY: as in `write_at`, in the other direction.
        unsafe {
            crate::copy::copy_bytes(src.ptr() as usize, out.as_mut_ptr() as usize, out.len())
        };
        Ok(())
    }

    /// The crc32c of the slice's bytes (host memory only).
    pub fn crc32c(&self) -> Result<u32> {
        self.with_host_bytes(crc32c::crc32c)
    }

    /// Copies every byte of `src` into this slice (equal lengths). Host to host is a CPU copy
    /// (streaming stores for large ones); a copy that involves device memory goes through the
    /// engine's [`DeviceCopier`], and without one is [`Error::Unsupported`].
    pub fn copy_from(&self, src: &MemSlice) -> Result<()> {
        if src.len != self.len {
            return Err(Error::InvalidArgument(format!(
                "copy of {} bytes of region {} into {} bytes of region {}",
                src.len, src.region.id.0, self.len, self.region.id.0
            )));
        }
        if self.kind().is_host() && src.kind().is_host() {
            let n = self.host_len()?;
            // SAFETY: both are live host slices of `n` bytes (their gates hold them); overlap is
            // allowed (an engine may copy within one region) and handled by `copy_bytes`.
            unsafe { crate::copy::copy_bytes(src.ptr() as usize, self.ptr() as usize, n) };
            return Ok(());
        }
        let copier = self.region.copier.as_ref().or(src.region.copier.as_ref());
        match copier {
            Some(c) => c.copy(self, src),
            None => Err(Error::Unsupported {
                backend: "engine",
                what: format!(
                    "copy from {:?} region {} to {:?} region {}: no device copier (give the \
                     engine one with EngineBuilder::device_copier)",
                    src.kind(),
                    src.region.id.0,
                    self.kind(),
                    self.region.id.0
                ),
            }),
        }
    }

    /// Stops holding up deregistration while keeping engine-allocated memory mapped until the
    /// returned value drops. For a backend that gives up on an op its transport may still touch
    /// (requests left queued after a forced close): the region can be deregistered, its memory is
    /// not freed under the transport (engine memory, and caller memory registered with an owner).
    /// Memory the caller registered with `register_raw` cannot be kept alive by the engine: the
    /// slice is handed back (`Err`) and deregistration keeps waiting for it (bounded by the
    /// engine's `deregister_timeout`).
    pub fn detach(self) -> std::result::Result<DetachedMemory, MemSlice> {
        match self.region.storage {
            Storage::Owned(_) | Storage::Pinned { .. } | Storage::Kept { .. } => {
                Ok(DetachedMemory { _region: self.region.clone() })
            }
            Storage::Raw(_) => Err(self),
        }
    }
}

/// Engine-allocated memory kept mapped after its slice released the region (see
/// [`MemSlice::detach`]).
#[derive(Debug)]
pub struct DetachedMemory {
    _region: Arc<RegionInner>,
}

impl Drop for MemSlice {
    fn drop(&mut self) {
        if self.region.gate.exit() {
            self.region.drained.notify_one();
        }
    }
}

/// What a region is registered with (the engine), as the [`Region`] handle calls it; this module
/// names nothing of the engine's.
pub(crate) trait Registry: Send + Sync + Debug {
    /// Deregisters `inner` and waits for its transfers to drain ([`Region::deregister`]).
    fn unregister<'a>(
        self: Arc<Self>,
        inner: &'a Arc<RegionInner>,
    ) -> Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;
    /// Refuses access to `inner` now and has the backends forget it in the background (a
    /// dropped [`Region`]).
    fn dropped(self: Arc<Self>, inner: &Arc<RegionInner>);
}

/// A registered region of memory, owned by the user. Dropping it deregisters it (after in-flight
/// transfers finish, the memory of an engine-allocated region is freed); `deregister` does the same
/// and waits for in-flight transfers to drain.
#[derive(Debug)]
pub struct Region {
    pub(crate) inner: Arc<RegionInner>,
    pub(crate) engine: Weak<dyn Registry>,
}

impl Region {
    /// The region's id on its engine.
    pub fn id(&self) -> RegionId {
        self.inner.id
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// Memory kind.
    pub fn kind(&self) -> MemoryKind {
        self.inner.kind
    }
    /// What peers may do.
    pub fn permissions(&self) -> Permissions {
        self.inner.perms
    }
    /// A checked window `[offset, offset + len)` of the region (see [`MemSlice`]); the region
    /// cannot finish deregistering while the slice lives.
    pub fn slice(&self, offset: u64, len: u64) -> Result<MemSlice> {
        self.inner.slice(offset, len, "local")
    }
    /// Everything a peer needs to address this region: hand it over out of band (a queue message,
    /// a payload ref) or let peers see it in the handshake descriptor.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            engine: self.inner.engine_id,
            id: self.inner.id,
            key: self.inner.key,
            len: self.inner.len,
            kind: self.inner.kind,
            perms: self.inner.perms,
            blobs: self.inner.blobs.iter().map(|(n, b)| (n.to_string(), b.clone())).collect(),
        }
    }

    /// Copies `data` into the region at `offset`. Device memory is written through the engine's
    /// device copier (by way of a host buffer), never by the CPU; without one it is
    /// [`Error::Unsupported`].
    pub fn write_bytes(&self, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.slice(offset, data.len() as u64)?;
        if self.inner.kind.is_host() {
            return dst.write_at(0, data);
        }
        let host = self.scratch(data.len() as u64)?;
        host.write_at(0, data)?;
        dst.copy_from(&host)
    }

    /// Copies region bytes at `offset` into `out`; device memory as in [`Region::write_bytes`].
    pub fn read_bytes(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.slice(offset, out.len() as u64)?;
        if self.inner.kind.is_host() {
            return src.read_at(0, out);
        }
        let host = self.scratch(out.len() as u64)?;
        host.copy_from(&src)?;
        host.read_at(0, out)
    }

    /// `len` bytes of host memory outside every region table (peers never see it), copied to and
    /// from with this region's device copier: the host side of a CPU access to device memory.
    fn scratch(&self, len: u64) -> Result<MemSlice> {
        let n = usize::try_from(len).map_err(|_| Error::Capacity {
            what: "host copy".into(),
            requested: len,
            limit: usize::MAX as u64,
        })?;
        let inner = Arc::new(RegionInner {
            id: RegionId(u64::MAX),
            key: AccessKey::random(),
            kind: MemoryKind::Host,
            perms: Permissions::NONE,
            len,
            storage: Storage::Owned(Arc::new(HostMapping::new(n)?)),
            gate: InflightGate::new(),
            drained: tokio::sync::Notify::new(),
            blobs: Vec::new(),
            engine_id: self.inner.engine_id,
            copier: self.inner.copier.clone(),
        });
        inner.slice(0, len, "host copy")
    }

    /// A copy of `len` bytes at `offset`.
    pub fn to_vec(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let n = usize::try_from(len).map_err(|_| Error::Capacity {
            what: "host copy".into(),
            requested: len,
            limit: usize::MAX as u64,
        })?;
        let mut v = vec![0u8; n];
        self.read_bytes(offset, &mut v)?;
        Ok(v)
    }

    /// Deregisters: peers are refused from now on, backends forget the region, and this waits (up to
    /// the engine's deregister timeout) until every in-flight transfer using it has finished.
    pub async fn deregister(mut self) -> Result<()> {
        let engine = std::mem::replace(&mut self.engine, Weak::<Unregistered>::new());
        match engine.upgrade() {
            Some(e) => e.unregister(&self.inner).await,
            None => Ok(()),
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Some(e) = self.engine.upgrade() {
            e.dropped(&self.inner);
        }
    }
}

/// The registry of a region handle that has let go of its engine (a `Weak` of it never upgrades).
#[derive(Debug)]
struct Unregistered;

impl Registry for Unregistered {
    fn unregister<'a>(
        self: Arc<Self>,
        _: &'a Arc<RegionInner>,
    ) -> Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>> {
        Box::pin(async { Ok(()) })
    }
    fn dropped(self: Arc<Self>, _: &Arc<RegionInner>) {}
}

/// A peer's view of a region: id, key, length, kind, permissions and each backend's public blob.
/// Small and serialisable; it travels in descriptors and queue messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Engine that owns the region.
    pub engine: EngineId,
    /// Region id on that engine.
    pub id: RegionId,
    /// Access key.
    pub key: AccessKey,
    /// Length in bytes.
    pub len: u64,
    /// Memory kind.
    pub kind: MemoryKind,
    /// What peers may do.
    pub perms: Permissions,
    /// Backend name -> public blob.
    pub blobs: Vec<(String, Bytes)>,
}

/// Most backend blobs one region carries.
pub(crate) const MAX_BLOBS: usize = 16;
/// Largest backend blob.
pub const MAX_BLOB_BYTES: usize = 4096;

impl RemoteRegion {
    /// The blob a backend registered for this region.
    pub fn blob(&self, backend: &str) -> Option<&Bytes> {
        self.blobs.iter().find(|(n, _)| n == backend).map(|(_, b)| b)
    }

    /// Appends the wire encoding.
    pub fn encode(&self, w: &mut Writer) {
        w.u128(self.engine.0).u64(self.id.0).u128(self.key.to_bits()).u64(self.len);
        encode_kind(w, self.kind);
        w.u8(self.perms.bits());
        w.u32(self.blobs.len() as u32);
        for (n, b) in &self.blobs {
            w.str(n).bytes(b);
        }
    }

    /// Decodes what `encode` wrote; never panics.
    pub fn decode(r: &mut Reader<'_>) -> Result<RemoteRegion> {
        let engine = EngineId(r.u128()?);
        let id = RegionId(r.u64()?);
        let key = AccessKey::from_bits(r.u128()?);
        let len = r.u64()?;
        let kind = decode_kind(r)?;
        let perms = Permissions::from_bits(r.u8()?)?;
        let n = r.count(MAX_BLOBS, "backend blobs")?;
        let mut blobs = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.str(64, "backend name")?;
            let blob = r.owned_bytes(MAX_BLOB_BYTES, "backend blob")?;
            blobs.push((name, blob));
        }
        Ok(RemoteRegion { engine, id, key, len, kind, perms, blobs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostMapping;

    fn region(storage: Storage, len: u64) -> Arc<RegionInner> {
        Arc::new(RegionInner {
            id: RegionId(1),
            key: AccessKey::random(),
            kind: MemoryKind::Host,
            perms: Permissions::READ_WRITE,
            len,
            storage,
            gate: InflightGate::new(),
            drained: tokio::sync::Notify::new(),
            blobs: Vec::new(),
            engine_id: EngineId(1),
            copier: None,
        })
    }

    #[test]
    fn detached_memory_stays_mapped_but_no_longer_holds_deregistration() {
        let r = region(Storage::Owned(Arc::new(HostMapping::new(4096).unwrap())), 4096);
        let s = r.slice(0, 4096, "test").unwrap();
        let p = s.ptr();
        let kept = s.detach().expect("engine memory can be detached");
        assert!(r.gate.close(), "the detached slice no longer counts as in flight");
        drop(r);
        // SAFETY: `kept` holds the region (and its mapping) alive; 4096 bytes at `p`.
        unsafe { std::ptr::write_bytes(p, 7, 4096) };
        drop(kept);
    }

    #[test]
    fn a_held_slice_narrows_after_deregistration_started() {
        let r = region(Storage::Owned(Arc::new(HostMapping::new(4096).unwrap())), 4096);
        let s = r.slice(0, 4096, "test").unwrap();
        assert!(!r.gate.close(), "the slice holds deregistration");
        assert!(r.slice(0, 8, "test").is_err(), "a new range is refused once closed");
        let part = s.sub(4000, 96).expect("a window of a held slice");
        assert_eq!((part.offset(), part.len()), (4000, 96));
        assert!(s.sub(4000, 97).is_err(), "still bounds-checked");
        drop(s);
        assert!(!r.gate.is_drained(), "the window holds deregistration too");
        drop(part);
        assert!(r.gate.is_drained());
    }

    #[test]
    fn raw_memory_cannot_be_detached() {
        let mut buf = vec![0u8; 64];
        let r = region(Storage::Raw(buf.as_mut_ptr() as usize), 64);
        let s = r.slice(0, 64, "test").unwrap();
        let s = s.detach().expect_err("the engine cannot keep caller memory alive");
        assert!(!r.gate.close(), "the slice still holds deregistration");
        drop(s);
        assert!(r.gate.is_drained());
    }
}
