//! GPU checks of `CudaGpu` on a real GPU: device and pinned memory, device pointer checks, the
//! whole conformance suite over tcp with every region in device memory (staged through pinned
//! bounces on both sides), the allocation queries IPC export relies on, and the whole suite over
//! the cuda backend. Each test is ignored unless asked for, with the reason (a GPU and its
//! driver); asked for where there is none, it fails saying why. Run them with
//! `cargo test -p tensorwire-cuda --test it -- --include-ignored --test-threads=1 gpu::`
//! (scripts/gpu-check runs the built binary so).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tensorwire_conformance::{DevicePair, harness};
use tensorwire_core::{Engine, MemoryKind, Permissions, backend::Backend};
use tensorwire_cuda::CudaGpu;
use tensorwire_tcp::{TcpBackend, TcpConfig};

/// The GPU, or the reason there is none (these tests run only when asked for).
fn gpu() -> Arc<CudaGpu> {
    CudaGpu::new().unwrap_or_else(|e| panic!("no GPU to run this on: {e}"))
}

fn tcp() -> Arc<dyn Backend> {
    TcpBackend::new(TcpConfig::default()).expect("a tcp backend")
}

async fn engine(gpu: Arc<CudaGpu>) -> Engine {
    Engine::builder().backend(tcp()).gpu(gpu).start().await.expect("an engine")
}

fn device_and_pinned_memory(gpu: Arc<CudaGpu>) -> Pin<Box<dyn Future<Output = ()>>> {
    Box::pin(async move {
        let e = engine(gpu).await;
        let dev = e.alloc_device(0, 64 << 20, Permissions::READ_WRITE).await.unwrap();
        assert_eq!(dev.kind(), MemoryKind::Device { ordinal: 0 });
        let data: Vec<u8> = (0..(64u32 << 20)).map(|i| (i % 253) as u8).collect();
        dev.write_bytes(0, &data).unwrap();
        assert!(dev.to_vec(0, 64 << 20).unwrap() == data, "bytes through the device differ");
        let pinned = e.alloc_pinned(1 << 20, Permissions::NONE).await.unwrap();
        assert_eq!(pinned.kind(), MemoryKind::HostPinned);
        pinned.write_bytes(0, b"pinned").unwrap();
        dev.slice(0, 6).unwrap().copy_from(&pinned.slice(0, 6).unwrap()).unwrap();
        assert_eq!(dev.to_vec(0, 6).unwrap(), b"pinned");
        let base = dev.slice(0, 1).unwrap().ptr() as u64;
        // SAFETY: inside the live allocation above, which outlives the alias (deregistered
        // first).
        let alias = unsafe { e.register_device(base + 4096, 4096, 0, Permissions::READ) }.await;
        alias.unwrap().deregister().await.unwrap();
        let host = pinned.slice(0, 1).unwrap().ptr() as u64;
        // SAFETY: refused by the check; nothing is registered.
        let refused = unsafe { e.register_device(host, 64, 0, Permissions::READ) }.await;
        assert!(refused.is_err(), "host memory passed the device check");
    })
}

fn conformance_over_device_memory(_gpu: Arc<CudaGpu>) -> Pin<Box<dyn Future<Output = ()>>> {
    Box::pin(async move {
        let pair = DevicePair::new(tcp, || CudaGpu::new().expect("the GPU"));
        tensorwire_conformance::run_all(&pair).await;
    })
}

/// The driver's view of allocations that IPC export relies on: a region made by `alloc_device`
/// is one whole allocation (odd sizes included), an address inside it names the same one, and
/// a handle can be made for it.
fn ipc_allocations(gpu: Arc<CudaGpu>) -> Pin<Box<dyn Future<Output = ()>>> {
    Box::pin(async move {
        use tensorwire_cuda::IpcDriver;
        let e = engine(gpu.clone()).await;
        for len in [1u64, 4097, 3 << 20, (64 << 20) + 1] {
            let dev = e.alloc_device(0, len, Permissions::READ).await.unwrap();
            let base = dev.slice(0, 1).unwrap().ptr() as u64;
            assert_eq!(gpu.allocation(base).unwrap(), (base, len), "the {len}-byte allocation");
            if len > 1 {
                assert_eq!(gpu.allocation(base + 1).unwrap(), (base, len), "inside it");
            }
            gpu.export(base, 0).expect("an IPC handle");
        }
        assert_ne!(gpu.uuid(0).unwrap(), [0; 16]);
    })
}

/// The whole suite over the cuda backend, device memory on both engines. Both engines run in
/// this process, so openings take the exporter's address as it is (a handle cannot be opened by
/// its exporter); `xfer --backend cuda` moves bytes between two processes (the
/// cuIpcOpenMemHandle path) and checks a round trip.
fn cuda_backend_conformance(_gpu: Arc<CudaGpu>) -> Pin<Box<dyn Future<Output = ()>>> {
    Box::pin(async move {
        let cuda = || -> Arc<dyn Backend> {
            let gpu = CudaGpu::new().expect("the GPU");
            tensorwire_cuda::backend(gpu, Default::default()).expect("a cuda backend")
        };
        let pair = DevicePair::new(cuda, || CudaGpu::new().expect("the GPU"));
        tensorwire_conformance::run_all(&pair).await;
    })
}

#[test]
#[ignore = "needs an NVIDIA GPU and its driver: --include-ignored (scripts/gpu-check)"]
fn cuda_device_and_pinned_memory() {
    harness::block_on(device_and_pinned_memory(gpu()));
}

#[test]
#[ignore = "needs an NVIDIA GPU and its driver: --include-ignored (scripts/gpu-check)"]
fn cuda_tcp_conformance_over_device_memory() {
    harness::block_on(conformance_over_device_memory(gpu()));
}

#[test]
#[ignore = "needs an NVIDIA GPU and its driver: --include-ignored (scripts/gpu-check)"]
fn cuda_ipc_allocations() {
    harness::block_on(ipc_allocations(gpu()));
}

#[test]
#[ignore = "needs an NVIDIA GPU and its driver: --include-ignored (scripts/gpu-check)"]
fn cuda_backend_conformance_over_device_memory() {
    harness::block_on(cuda_backend_conformance(gpu()));
}
