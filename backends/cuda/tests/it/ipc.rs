//! The cuda backend's own rules, behind the fake IPC driver: which regions it exports, which
//! backend the engine picks, and that openings of a peer's memory close when the peer
//! deregisters it.

use tensorwire_testkit::fake_ipc as fake;

use std::sync::Arc;
use std::time::Duration;

use fake::FakeIpc;
use tensorwire_conformance::pattern;
use tensorwire_core::{Engine, Error, Permissions, Session, TransferOp, backend::Backend};
use tensorwire_shm::ShmBackend;
use tensorwire_tcp::{TcpBackend, TcpConfig};
use tensorwire_testkit::fake_gpu::FakeGpu;

fn tcp() -> Arc<dyn Backend> {
    TcpBackend::new(TcpConfig::default()).expect("a tcp backend")
}

/// Two engines with `backends` (made fresh for each), sharing one fake GPU and IPC driver, and a
/// session from the first to the second.
async fn pair(
    ipc: &Arc<FakeIpc>,
    backends: impl Fn() -> Vec<Arc<dyn Backend>>,
) -> (Engine, Engine, Session) {
    let engine = || {
        let mut b = Engine::builder().gpu(ipc.gpu.clone());
        for backend in backends() {
            b = b.backend(backend);
        }
        b.start()
    };
    let (a, b) = (engine().await.unwrap(), engine().await.unwrap());
    let s = a.connect(b.local_addr()).await.unwrap();
    (a, b, s)
}

async fn eventually(what: &str, f: impl Fn() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: not within 5 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_regions_move_over_ipc_and_openings_close_on_deregister() {
    let ipc = FakeIpc::new(FakeGpu::new());
    let (a, b, s) = pair(&ipc, || vec![fake::cuda(&ipc).expect("a cuda backend"), tcp()]).await;
    let n = 3 << 20;
    let src = a.alloc_device(0, n, Permissions::NONE).await.unwrap();
    let dst = b.alloc_device(1, n, Permissions::READ_WRITE).await.unwrap();
    let data = pattern(n as usize, 5);
    src.write_bytes(0, &data).unwrap();
    let h = s.submit(vec![TransferOp::write(&src, 0, &dst.remote(), 0, n)]).await.pop().unwrap();
    assert_eq!(h.backend(), "cuda");
    h.await.unwrap();
    // A READ from host memory: local host memory is fine for the GPU's copy.
    let host = a.alloc(4096, Permissions::NONE).await.unwrap();
    let r = s.transfer(TransferOp::read(&host, 0, &dst.remote(), 4096, 4096)).await.unwrap();
    assert_eq!(r.backend, "cuda");
    assert!(host.to_vec(0, 4096).unwrap() == data[4096..8192]);
    assert!(dst.to_vec(0, n).unwrap() == data, "bytes moved over IPC differ");
    assert_eq!(ipc.opened(), 1, "one opening of the peer's allocation, leased for later ops");
    assert_eq!(ipc.closed(), 0);
    // The counters that show it: every byte by the cuda backend, no staging buffer on either side.
    assert_eq!(a.bytes_by_backend(), vec![("cuda", n + 4096)]);
    assert_eq!((a.stats().host_staged, b.stats().host_staged), (0, 0));
    // Deregistering the region makes the peer drop its opening (Forget, then Released).
    dst.deregister().await.unwrap();
    eventually("the opening closed", || ipc.closed() == 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_memory_and_part_of_an_allocation_go_to_the_next_backend() {
    let ipc = FakeIpc::new(FakeGpu::new());
    let (a, b, s) = pair(&ipc, || {
        vec![
            fake::cuda(&ipc).expect("a cuda backend"),
            ShmBackend::new().expect("shm") as Arc<dyn Backend>,
            tcp(),
        ]
    })
    .await;
    let src = a.alloc(8192, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &pattern(8192, 1)).unwrap();
    let host = b.alloc(8192, Permissions::WRITE).await.unwrap();
    let r = s.transfer(TransferOp::write(&src, 0, &host.remote(), 0, 8192)).await.unwrap();
    assert_eq!(r.backend, "shm", "a peer's host memory goes to shm");
    // A region inside a larger allocation: an IPC handle would open its neighbours too, so the
    // cuda backend does not export it, and tcp (staging through the fake GPU) moves it.
    let whole = b.alloc_device(0, 1 << 20, Permissions::NONE).await.unwrap();
    let exported = ipc.exported();
    let base = whole.slice(0, 1).unwrap().ptr() as u64;
    // SAFETY: inside the live allocation above, which outlives the alias (dropped first).
    let part = unsafe { b.register_device(base + 4096, 8192, 0, Permissions::WRITE) }.await;
    let part = part.unwrap();
    assert_eq!(ipc.exported(), exported, "part of an allocation was exported");
    let staged = b.stats().host_staged;
    let r = s.transfer(TransferOp::write(&src, 0, &part.remote(), 0, 8192)).await.unwrap();
    assert_eq!(r.backend, "tcp");
    assert!(b.stats().host_staged > staged, "the peer staged the write into its device memory");
    assert_eq!(a.stats().host_staged, 0, "the writer's memory is host memory: nothing staged");
    assert_eq!(a.bytes_by_backend(), vec![("shm", 8192), ("tcp", 8192)]);
    assert!(whole.to_vec(4096, 8192).unwrap() == pattern(8192, 1));
    assert_eq!(ipc.opened(), 0, "nothing was opened over IPC");
    part.deregister().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_another_backend_a_part_of_an_allocation_is_refused() {
    let ipc = FakeIpc::new(FakeGpu::new());
    let (a, b, s) = pair(&ipc, || vec![fake::cuda(&ipc).expect("a cuda backend")]).await;
    let src = a.alloc_device(0, 4096, Permissions::NONE).await.unwrap();
    let whole = b.alloc_device(0, 1 << 20, Permissions::NONE).await.unwrap();
    let base = whole.slice(0, 1).unwrap().ptr() as u64;
    // SAFETY: inside the live allocation above, which outlives the alias.
    let part = unsafe { b.register_device(base, 4096, 0, Permissions::WRITE) }.await.unwrap();
    let r = s.transfer(TransferOp::write(&src, 0, &part.remote(), 0, 4096)).await;
    assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
    part.deregister().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_the_driver_cannot_export_still_registers_for_the_next_backend() {
    let ipc = FakeIpc::new(FakeGpu::new());
    let (a, b, s) = pair(&ipc, || vec![fake::cuda(&ipc).expect("a cuda backend"), tcp()]).await;
    ipc.counts.refuse.store(true, std::sync::atomic::Ordering::Relaxed);
    let src = a.alloc(4096, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &pattern(4096, 3)).unwrap();
    let dst = b.alloc_device(0, 4096, Permissions::WRITE).await.unwrap();
    let r = s.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, 4096)).await.unwrap();
    assert_eq!(r.backend, "tcp");
    assert!(dst.to_vec(0, 4096).unwrap() == pattern(4096, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_does_not_match_its_handle_is_refused() {
    use tensorwire_cuda::CudaIpc;
    use tensorwire_cuda::ipc::IpcShare;
    use tensorwire_shm::{Grant, Medium};
    let ipc = FakeIpc::new(FakeGpu::new());
    let (_a, b, _s) = pair(&ipc, || vec![fake::cuda(&ipc).expect("a cuda backend")]).await;
    let region = b.alloc_device(0, 1 << 20, Permissions::READ).await.unwrap();
    let base = region.slice(0, 1).unwrap().ptr() as u64;
    let medium = CudaIpc::new(ipc.clone());
    let share = |len| {
        let s = IpcShare { process: 1, uuid: [1; 16], addr: base, len, handle: [0; 64] };
        s.encode()
    };
    let grant = |share: Vec<u8>, fd, len| Grant { share, fd, len, writable: false };
    let protocol = |r: tensorwire_core::Result<_>, want: &str| match r {
        Err(Error::Protocol(m)) => assert!(m.contains(want), "{m:?} does not say {want:?}"),
        Err(e) => panic!("expected a protocol error saying {want:?}, got {e}"),
        Ok(_) => panic!("a bad grant was opened ({want})"),
    };
    protocol(medium.open(grant(share(1 << 20), None, 4096)), "the grant names 4096");
    let fd: std::os::fd::OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
    protocol(medium.open(grant(share(1 << 20), Some(fd), 1 << 20)), "a descriptor came");
    protocol(medium.open(grant(vec![0; 7], None, 1 << 20)), "an IPC share of 7 bytes");
    assert_eq!(ipc.opened(), 0, "nothing was opened");
}
