//! The memory seam: every byte of registered memory is reached through a checked `MemSlice`;
//! host bytes through its safe accessors, device bytes only through the engine's device copier.
#![cfg(not(loom))] // the loom build has only the sans-IO pieces

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use tensorwire_core::{
    Engine, Error, MemSlice, MemoryKind, Permissions, RegionId, Result, backend::Backend,
    backend::BackendHost, backend::Capabilities, backend::Connection, backend::MemBackend,
    backend::PeerBackendInfo, backend::RegionInfo, gpu::DeviceCopier,
};

async fn engine() -> Engine {
    Engine::builder().backend(MemBackend::new()).start().await.unwrap()
}

#[tokio::test]
async fn host_slices_are_bounded_and_their_bytes_safe_to_reach() {
    let e = engine().await;
    let r = e.alloc(4096, Permissions::NONE).await.unwrap();
    let s = r.slice(100, 200).unwrap();
    s.write_at(10, b"seam").unwrap();
    let mut out = [0u8; 4];
    s.read_at(10, &mut out).unwrap();
    assert_eq!(&out, b"seam");
    assert_eq!(r.to_vec(110, 4).unwrap(), b"seam", "the slice starts at offset 100");
    assert_eq!(s.with_host_bytes(|b| b.len()).unwrap(), 200);
    assert_eq!(s.crc32c().unwrap(), crc32c_of(&r.to_vec(100, 200).unwrap()));
    let e1 = r.slice(4000, 97).unwrap_err();
    assert!(
        e1.to_string().contains("offset 4000 + len 97 exceeds length 4096"),
        "names the numbers: {e1}"
    );
    assert!(matches!(s.write_at(198, b"abc"), Err(Error::OutOfBounds { .. })));
    assert!(matches!(r.slice(u64::MAX, 2), Err(Error::OutOfBounds { .. })), "no overflow");

    let other = e.alloc(4096, Permissions::NONE).await.unwrap();
    other.slice(0, 200).unwrap().copy_from(&s).unwrap();
    assert_eq!(other.to_vec(10, 4).unwrap(), b"seam");
    let short = other.slice(0, 199).unwrap();
    assert!(matches!(short.copy_from(&s), Err(Error::InvalidArgument(_))), "lengths differ");
    // Overlapping copy inside one region has memmove semantics.
    r.slice(101, 200).unwrap().copy_from(&r.slice(100, 200).unwrap()).unwrap();
    assert_eq!(r.to_vec(111, 4).unwrap(), b"seam");
}

fn crc32c_of(b: &[u8]) -> u32 {
    // Castagnoli, bitwise: an independent check of `MemSlice::crc32c`.
    let mut crc = !0u32;
    for &x in b {
        crc ^= u32::from(x);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82f6_3b78 } else { crc >> 1 };
        }
    }
    !crc
}

#[tokio::test]
async fn device_bytes_are_never_touched_by_the_cpu_without_a_copier() {
    let e = engine().await;
    let fake_device = 0x7f00_0000_0000usize as *mut u8;
    // SAFETY: the engine has no device copier and refuses CPU access to device regions, so the
    // address is never dereferenced.
    let dev = unsafe {
        e.register_raw(fake_device, 1 << 20, MemoryKind::Device { ordinal: 0 }, Permissions::NONE)
    }
    .await
    .unwrap();
    let d = dev.slice(0, 64).unwrap();
    assert!(matches!(d.with_host_bytes(|_| ()), Err(Error::Unsupported { .. })));
    assert!(matches!(d.crc32c(), Err(Error::Unsupported { .. })));
    assert!(matches!(d.write_at(0, b"x"), Err(Error::Unsupported { .. })));
    let host = e.alloc(64, Permissions::NONE).await.unwrap();
    let err = d.copy_from(&host.slice(0, 64).unwrap()).unwrap_err();
    assert!(err.to_string().contains("no device copier"), "{err}");
    let err = host.slice(0, 64).unwrap().copy_from(&d).unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
}

/// A copier for a "device" that is really host memory, counting its calls.
#[derive(Debug, Default)]
struct FakeCopier {
    calls: AtomicUsize,
}

impl DeviceCopier for FakeCopier {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn copy(&self, dst: &MemSlice, src: &MemSlice) -> Result<()> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        // SAFETY: in this test every "device" region is host memory owned by the test and both
        // slices are live and of equal length (checked by `copy_from` before calling).
        unsafe { std::ptr::copy(src.ptr(), dst.ptr(), src.len() as usize) };
        Ok(())
    }
}

#[tokio::test]
async fn device_copies_go_through_the_engines_copier() {
    let copier = Arc::new(FakeCopier::default());
    let e = Engine::builder()
        .backend(MemBackend::new())
        .device_copier(copier.clone())
        .start()
        .await
        .unwrap();
    let mut fake_gpu = vec![0u8; 4096];
    // SAFETY: `fake_gpu` outlives the region, which is deregistered below before it is read.
    let dev = unsafe {
        e.register_raw(
            fake_gpu.as_mut_ptr(),
            4096,
            MemoryKind::Device { ordinal: 0 },
            Permissions::NONE,
        )
    }
    .await
    .unwrap();
    let host = e.alloc(4096, Permissions::NONE).await.unwrap();
    host.write_bytes(0, b"to the gpu").unwrap();
    dev.slice(8, 10).unwrap().copy_from(&host.slice(0, 10).unwrap()).unwrap();
    let back = e.alloc(16, Permissions::NONE).await.unwrap();
    back.slice(0, 10).unwrap().copy_from(&dev.slice(8, 10).unwrap()).unwrap();
    assert_eq!(copier.calls.load(Ordering::Relaxed), 2);
    assert_eq!(back.to_vec(0, 10).unwrap(), b"to the gpu");
    dev.deregister().await.unwrap();
    assert_eq!(&fake_gpu[8..18], b"to the gpu");
}

/// A backend that cannot start (its device is missing).
#[derive(Debug)]
struct NoDevice;

#[async_trait]
impl Backend for NoDevice {
    fn name(&self) -> &'static str {
        "nodevice"
    }
    fn capabilities(&self) -> Capabilities {
        MemBackend::new().capabilities()
    }
    async fn start(&self, _host: Arc<dyn BackendHost>) -> Result<()> {
        Err(Error::Unsupported { backend: "nodevice", what: "no device on this host".into() })
    }
    fn endpoint(&self) -> Bytes {
        Bytes::new()
    }
    async fn register(&self, _region: &RegionInfo) -> Result<Option<Bytes>> {
        Ok(None)
    }
    async fn deregister(&self, _id: RegionId) -> Result<()> {
        Ok(())
    }
    async fn connect(&self, _peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>> {
        Err(Error::Unsupported { backend: "nodevice", what: "connect".into() })
    }
    async fn shutdown(&self) {}
}

#[tokio::test]
async fn a_backend_that_cannot_start_fails_the_engine_start() {
    let e = Engine::builder().backend(MemBackend::new()).backend(Arc::new(NoDevice)).start().await;
    let err = e.unwrap_err();
    assert!(err.to_string().contains("no device on this host"), "{err}");
}

/// Drops flag it; the owner of registered caller memory.
struct Buffer {
    bytes: Vec<u8>,
    dropped: Arc<AtomicUsize>,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn an_owner_keeps_caller_memory_until_the_region_and_its_slices_are_gone() {
    let e = engine().await;
    let dropped = Arc::new(AtomicUsize::new(0));
    let mut buf = Buffer { bytes: vec![7u8; 4096], dropped: dropped.clone() };
    let ptr = buf.bytes.as_mut_ptr();
    // SAFETY: the Vec's heap block does not move when `buf` moves into the engine, and it lives
    // as long as `buf` does.
    let region = unsafe { e.register_owned(buf, ptr, 4096, MemoryKind::Host, Permissions::NONE) }
        .await
        .unwrap();
    let slice = region.slice(0, 4096).unwrap();
    drop(region);
    assert_eq!(dropped.load(Ordering::SeqCst), 0, "a slice in use keeps the owner");
    drop(slice);
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "dropped with the last holder");
}
