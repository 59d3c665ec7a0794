//! Caller memory registered with `register_raw`: host memory moves like engine memory; device memory
//! is refused with `Unsupported` by a host-only backend (never touched by the CPU).
#![cfg(not(loom))] // the loom build has only the sans-IO pieces

use tensorwire_core::{Engine, Error, MemoryKind, Permissions, TransferOp, backend::MemBackend};

async fn engine() -> Engine {
    Engine::builder().backend(MemBackend::new()).start().await.unwrap()
}

#[tokio::test]
async fn raw_host_memory_round_trip_then_deregister_before_free() {
    let (a, b) = (engine().await, engine().await);
    let mut caller = vec![0u8; 10_000];
    // SAFETY: `caller` outlives the region: it is deregistered (and the call awaited) below, before
    // the vector is read or dropped.
    let raw = unsafe {
        a.register_raw(
            caller.as_mut_ptr(),
            caller.len() as u64,
            MemoryKind::Host,
            Permissions::NONE,
        )
    }
    .await
    .unwrap();
    let peer = b.alloc(10_000, Permissions::READ).await.unwrap();
    peer.write_bytes(0, &[0xab; 10_000]).unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    s.transfer(TransferOp::read(&raw, 100, &peer.remote(), 0, 9_000)).await.unwrap();
    raw.deregister().await.unwrap();
    assert!(caller[..100].iter().all(|&x| x == 0));
    assert!(caller[100..9_100].iter().all(|&x| x == 0xab));
    assert!(caller[9_100..].iter().all(|&x| x == 0));
}

#[tokio::test]
async fn device_memory_is_unsupported_by_a_host_backend() {
    let (a, b) = (engine().await, engine().await);
    // A device address the CPU must never dereference: the engine refuses before touching it.
    let fake_device = 0x7f00_0000_0000usize as *mut u8;
    // SAFETY: no backend of this engine supports device memory and `write_bytes`/`to_vec` refuse
    // non-host regions, so the address is never dereferenced.
    let dev = unsafe {
        a.register_raw(fake_device, 1 << 20, MemoryKind::Device { ordinal: 0 }, Permissions::NONE)
    }
    .await
    .unwrap();
    assert!(matches!(dev.write_bytes(0, b"x"), Err(Error::Unsupported { .. })));
    assert!(matches!(dev.to_vec(0, 1), Err(Error::Unsupported { .. })));
    let host = b.alloc(1 << 20, Permissions::READ_WRITE).await.unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    let e = s.transfer(TransferOp::write(&dev, 0, &host.remote(), 0, 4096)).await.unwrap_err();
    match e {
        Error::Unsupported { backend: "engine", what } => {
            assert!(what.contains("Device { ordinal: 0 }"), "{what}")
        }
        other => panic!("expected Unsupported, got {other}"),
    }
}

#[tokio::test]
async fn null_pointer_is_refused() {
    let a = engine().await;
    // SAFETY: a null pointer is rejected before it is stored.
    let r =
        unsafe { a.register_raw(std::ptr::null_mut(), 16, MemoryKind::Host, Permissions::NONE) }
            .await;
    assert!(matches!(r, Err(Error::InvalidArgument(_))));
}
