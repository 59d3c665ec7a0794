//! Device memory over tcp with a fake GPU (its memory is PROT_NONE outside the GPU's own copies,
//! so any CPU access to it crashes): the engine stages local device memory through pinned
//! bounces, the target stages its device regions; every combination moves the exact bytes,
//! a staged READ dropped mid-way lands nothing after, a notification sent after a staged
//! WRITE arrives after its bytes, and a device region deregistered while a staged WRITE lands in
//! it ends that WRITE as an op (never by closing the stream).

use std::sync::Arc;
use std::time::Duration;

use tensorwire_conformance::{bounded, pattern};
use tensorwire_core::{Engine, Error, MemoryKind, Missing, Permissions, Region, TransferOp};
use tensorwire_tcp::{TcpBackend, TcpConfig};
use tensorwire_testkit::fake_gpu::FakeGpu;
use tensorwire_testkit::faults::{Fault, FaultProxy};

async fn engine(gpu: Option<Arc<FakeGpu>>) -> Engine {
    let mut b = Engine::builder().backend(TcpBackend::new(TcpConfig::default()).unwrap());
    if let Some(g) = gpu {
        b = b.gpu(g);
    }
    b.start().await.unwrap()
}

async fn put(e: &Engine, r: &Region, off: u64, data: &[u8]) {
    let h = e.alloc(data.len() as u64, Permissions::NONE).await.unwrap();
    h.write_bytes(0, data).unwrap();
    r.slice(off, data.len() as u64)
        .unwrap()
        .copy_from(&h.slice(0, data.len() as u64).unwrap())
        .unwrap();
}

async fn get(e: &Engine, r: &Region, off: u64, len: u64) -> Vec<u8> {
    let h = e.alloc(len, Permissions::NONE).await.unwrap();
    h.slice(0, len).unwrap().copy_from(&r.slice(off, len).unwrap()).unwrap();
    h.to_vec(0, len).unwrap()
}

async fn region(e: &Engine, device: bool, len: u64, perms: Permissions) -> Region {
    if device {
        e.alloc_device(0, len, perms).await.unwrap()
    } else {
        e.alloc(len, perms).await.unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_combination_of_host_and_device_moves_the_exact_bytes() {
    let (ga, gb) = (FakeGpu::new(), FakeGpu::new());
    let a = engine(Some(ga.clone())).await;
    let b = engine(Some(gb.clone())).await;
    let s = a.connect(b.local_addr()).await.unwrap();
    for (local_dev, remote_dev) in [(true, false), (false, true), (true, true)] {
        for len in [1u64, 4096, (5 << 20) + 123, 64 << 20] {
            let what = format!("local device {local_dev}, remote device {remote_dev}, {len} B");
            let l = region(&a, local_dev, len + 64, Permissions::NONE).await;
            let r = region(&b, remote_dev, len + 64, Permissions::READ_WRITE).await;
            let data = pattern(len as usize, len as u8);
            put(&a, &l, 7, &data).await;
            let w = bounded("write", s.transfer(TransferOp::write(&l, 7, &r.remote(), 11, len)))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(w.backend, "tcp");
            assert_eq!(w.host_staged, local_dev, "{what}: the report says whether it staged");
            let served = b.stats().host_staged;
            assert!(get(&b, &r, 11, len).await == data, "{what}: WRITE bytes differ");
            let back = pattern(len as usize, 0x5a);
            put(&b, &r, 3, &back).await;
            let rd = bounded("read", s.transfer(TransferOp::read(&l, 1, &r.remote(), 3, len)))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(rd.host_staged, local_dev, "{what}");
            // The peer counts a staging buffer for every op it serves on its device memory.
            assert_eq!(b.stats().host_staged > served, remote_dev, "{what}: the peer's count");
            assert!(get(&a, &l, 1, len).await == back, "{what}: READ bytes differ");
        }
    }
    assert!(ga.counts().copies > 0 && gb.counts().copies > 0, "both sides staged");
    assert!(ga.counts().pins >= 1, "bounces are pinned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_read_dropped_mid_way_lands_nothing_after() {
    let a = engine(Some(FakeGpu::new())).await;
    let b = engine(None).await;
    let s = a.connect(b.local_addr()).await.unwrap();
    let len = 64u64 << 20;
    let src = b.alloc(len, Permissions::READ).await.unwrap();
    src.write_bytes(0, &vec![0xee; len as usize]).unwrap();
    let dst = a.alloc_device(0, len, Permissions::NONE).await.unwrap();
    let mut hs = s.submit(vec![TransferOp::read(&dst, 0, &src.remote(), 0, len)]).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    drop(hs.pop());
    let snapshot = get(&a, &dst, 0, len).await;
    let other = a.alloc_device(0, len, Permissions::NONE).await.unwrap();
    bounded("other", s.transfer(TransferOp::read(&other, 0, &src.remote(), 0, len))).await.unwrap();
    assert!(get(&a, &dst, 0, len).await == snapshot, "bytes landed after the drop returned");
    assert!(get(&a, &other, 0, len).await.iter().all(|&x| x == 0xee));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_after_a_staged_write_arrives_after_its_bytes() {
    let a = engine(Some(FakeGpu::new())).await;
    let b = engine(None).await;
    let s = a.connect(b.local_addr()).await.unwrap();
    let len = 24u64 << 20;
    let src = a.alloc_device(0, len, Permissions::NONE).await.unwrap();
    put(&a, &src, 0, &pattern(len as usize, 3)).await;
    let dst = b.alloc(len, Permissions::WRITE).await.unwrap();
    let hs = s.submit(vec![TransferOp::write(&src, 0, &dst.remote(), 0, len)]).await;
    bounded("notify", s.notify(bytes::Bytes::from_static(b"done"))).await.unwrap();
    let n = bounded("recv", b.recv_notification(Duration::from_secs(20))).await.unwrap();
    assert_eq!(n.payload.as_ref(), b"done");
    // The notification was delivered only after every byte was in place.
    assert!(dst.to_vec(0, len).unwrap() == pattern(len as usize, 3));
    for h in hs {
        bounded("write", h).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_without_a_gpu_is_refused_with_the_reason() {
    let a = engine(None).await;
    let b = engine(None).await;
    let s = a.connect(b.local_addr()).await.unwrap();
    // SAFETY: a made-up device address that nothing dereferences (no GPU: every path refuses).
    let dev = unsafe {
        b.register_raw(
            0x7e00_0000_0000 as *mut u8,
            4096,
            MemoryKind::Device { ordinal: 0 },
            Permissions::WRITE,
        )
    }
    .await
    .unwrap();
    let src = a.alloc(4096, Permissions::NONE).await.unwrap();
    let e = bounded("write", s.transfer(TransferOp::write(&src, 0, &dev.remote(), 0, 4096)))
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::Unsupported { .. }) && e.to_string().contains("no GPU driver"),
        "{e}"
    );
    // SAFETY: as above.
    let local = unsafe {
        a.register_raw(
            0x7e00_0000_0000 as *mut u8,
            4096,
            MemoryKind::Device { ordinal: 0 },
            Permissions::NONE,
        )
    }
    .await
    .unwrap();
    let host = b.alloc(4096, Permissions::READ).await.unwrap();
    let e = bounded("read", s.transfer(TransferOp::read(&local, 0, &host.remote(), 0, 4096)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
}

/// The target resolves the WRITE's range once, then stages it half a bounce (2 MiB) at a time;
/// the proxy's throttle (4 MiB/s) keeps the first half arriving while deregistration closes the
/// region's gate. The next half's window of the resolved range must still be made (the range holds
/// the region until the WRITE ends), so the WRITE completes or is refused as deregistered, and
/// deregistration finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistering_a_device_region_mid_write_ends_the_op_not_the_stream() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let proxy = FaultProxy::start(port).await.unwrap();
    let b_cfg = TcpConfig { listen: port, advertise: Some(proxy.addr()), ..TcpConfig::default() };
    let b = Engine::builder()
        .backend(TcpBackend::new(b_cfg).unwrap())
        .gpu(FakeGpu::new())
        .start()
        .await
        .unwrap();
    let a_cfg = TcpConfig { streams: 1, ..TcpConfig::default() };
    let a = Engine::builder().backend(TcpBackend::new(a_cfg).unwrap()).start().await.unwrap();
    let len = 3u64 << 20;
    let src = a.alloc(len, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &pattern(len as usize, 4)).unwrap();
    let dst = b.alloc_device(0, len, Permissions::WRITE).await.unwrap();
    let remote = dst.remote();
    let s = a.connect(b.local_addr()).await.unwrap();
    proxy.set(Fault::Throttle(4 << 20));
    let mut hs = s.submit(vec![TransferOp::write(&src, 0, &remote, 0, len)]).await;
    let h = hs.pop().unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await; // the first half is arriving
    bounded("deregister", dst.deregister()).await.expect("deregister waits, then succeeds");
    if let Err(e) = bounded("in-flight write", h).await {
        assert!(
            matches!(e, Error::NotFound(Missing::Deregistered(_))),
            "the WRITE ends as an op, got: {e}"
        );
    }
    proxy.set(Fault::None);
    let e =
        bounded("after", s.transfer(TransferOp::write(&src, 0, &remote, 0, 8))).await.unwrap_err();
    assert!(matches!(e, Error::NotFound(Missing::Deregistered(_))), "{e}");
    assert_eq!(b.region_count(), 0);
}
