//! The engine's GPU calls over the fake GPU: device and pinned allocations, device pointer
//! checks, copies only through the GPU, and `Unsupported` with what is missing without a GPU.

use tensorwire_core::{Engine, Error, MemoryKind, Permissions, backend::MemBackend};
use tensorwire_testkit::fake_gpu::FakeGpu;

#[tokio::test]
async fn without_a_gpu_the_calls_say_what_is_missing() {
    let e = Engine::builder().backend(MemBackend::new()).start().await.unwrap();
    let err = e.alloc_device(0, 4096, Permissions::NONE).await.unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert!(
        err.to_string().contains("no GPU driver") && err.to_string().contains("libcuda"),
        "{err}"
    );
    assert!(e.alloc_pinned(4096, Permissions::NONE).await.is_err());
    // SAFETY: refused before anything is registered.
    let err = unsafe { e.register_device(0x7000_0000_0000, 64, 0, Permissions::READ) }.await;
    assert!(matches!(err, Err(Error::Unsupported { .. })));
}

#[tokio::test]
async fn device_memory_is_reached_only_through_the_gpu() {
    let gpu = FakeGpu::new();
    let e = Engine::builder().backend(MemBackend::new()).gpu(gpu.clone()).start().await.unwrap();
    let dev = e.alloc_device(1, 1 << 20, Permissions::READ_WRITE).await.unwrap();
    assert_eq!(dev.kind(), MemoryKind::Device { ordinal: 1 });
    let s = dev.slice(0, 1).unwrap();
    assert!(matches!(s.write_at(0, b"x"), Err(Error::Unsupported { .. })), "no CPU access");
    drop(s);
    dev.write_bytes(4000, b"via the copier").unwrap();
    assert_eq!(dev.to_vec(4000, 14).unwrap(), b"via the copier");
    let host = e.alloc(4096, Permissions::NONE).await.unwrap();
    host.write_bytes(0, b"through the gpu").unwrap();
    dev.slice(100, 15).unwrap().copy_from(&host.slice(0, 15).unwrap()).unwrap();
    let back = e.alloc(15, Permissions::NONE).await.unwrap();
    back.slice(0, 15).unwrap().copy_from(&dev.slice(100, 15).unwrap()).unwrap();
    assert_eq!(back.to_vec(0, 15).unwrap(), b"through the gpu");
    assert_eq!(gpu.counts().copies, 4);
    assert!(e.alloc_device(7, 64, Permissions::NONE).await.is_err(), "no device 7");
    dev.deregister().await.unwrap();
    assert_eq!((gpu.counts().freed, gpu.counts().live), (1, 0), "freed with its region");
}

#[tokio::test]
async fn pinned_memory_is_host_memory_unpinned_after_its_region() {
    let gpu = FakeGpu::new();
    let e = Engine::builder().backend(MemBackend::new()).gpu(gpu.clone()).start().await.unwrap();
    let p = e.alloc_pinned(1 << 16, Permissions::READ).await.unwrap();
    assert_eq!(p.kind(), MemoryKind::HostPinned);
    p.write_bytes(10, b"pinned").unwrap();
    assert_eq!(p.to_vec(10, 6).unwrap(), b"pinned");
    assert_eq!((gpu.counts().pins, gpu.counts().unpins), (1, 0));
    p.deregister().await.unwrap();
    assert_eq!(gpu.counts().unpins, 1);
}

#[tokio::test]
async fn a_framework_pointer_is_checked_before_it_is_registered() {
    let gpu = FakeGpu::new();
    let e = Engine::builder().backend(MemBackend::new()).gpu(gpu.clone()).start().await.unwrap();
    let dev = e.alloc_device(0, 8192, Permissions::NONE).await.unwrap();
    let base = dev.slice(0, 1).unwrap().ptr() as u64;
    // SAFETY: the fake GPU's allocation outlives the region (deregistered below).
    let alias =
        unsafe { e.register_device(base + 4096, 4096, 0, Permissions::READ) }.await.unwrap();
    assert_eq!(alias.kind(), MemoryKind::Device { ordinal: 0 });
    alias.deregister().await.unwrap();
    // SAFETY: refused by the check; nothing is registered.
    let wrong = unsafe { e.register_device(base, 4096, 1, Permissions::READ) }.await.unwrap_err();
    assert!(wrong.to_string().contains("not device 1"), "{wrong}");
    // SAFETY: as above.
    let host = unsafe { e.register_device(0x1000, 64, 0, Permissions::READ) }.await.unwrap_err();
    assert!(host.to_string().contains("not device memory"), "{host}");
}
