//! Backend selection with shm and tcp in one engine: shm between engines of one host, tcp for
//! caller-registered (unshareable) peer memory and across hosts; every handle names what it used.

use tensorwire_core::{Engine, EngineConfig, MemoryKind, Permissions, TransferOp};
use tensorwire_shm::ShmBackend;
use tensorwire_tcp::{TcpBackend, TcpConfig};

async fn engine(host: &str) -> Engine {
    let config = EngineConfig { host_id: Some(host.into()), ..EngineConfig::default() };
    Engine::builder()
        .backend(ShmBackend::new().unwrap())
        .backend(TcpBackend::new(TcpConfig::default()).unwrap())
        .config(config)
        .start()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_on_one_host_tcp_otherwise() {
    let (a, b) = (engine("host-1").await, engine("host-1").await);
    let src = a.alloc(8192, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &[7; 8192]).unwrap();
    let dst = b.alloc(8192, Permissions::READ_WRITE).await.unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    let r = s.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, 8192)).await.unwrap();
    assert_eq!(r.backend, "shm");
    assert_eq!(dst.to_vec(0, 8192).unwrap(), vec![7; 8192]);

    // Caller memory on the peer has no memfd: shm cannot map it, tcp carries the op.
    let mut caller = vec![0u8; 8192];
    // SAFETY: `caller` outlives the region: it is deregistered (and the call awaited) before the
    // vector is read or dropped.
    let raw =
        unsafe { b.register_raw(caller.as_mut_ptr(), 8192, MemoryKind::Host, Permissions::WRITE) }
            .await
            .unwrap();
    s.refresh().await.unwrap();
    let r = s.transfer(TransferOp::write(&src, 0, &raw.remote(), 0, 8192)).await.unwrap();
    assert_eq!(r.backend, "tcp");
    raw.deregister().await.unwrap();
    assert_eq!(caller, vec![7; 8192]);

    // Caller memory on the initiating side is fine for shm (we copy from our own address space).
    let mut mine = vec![9u8; 8192];
    // SAFETY: as above; deregistered before `mine` is dropped.
    let local =
        unsafe { a.register_raw(mine.as_mut_ptr(), 8192, MemoryKind::Host, Permissions::NONE) }
            .await
            .unwrap();
    let r = s.transfer(TransferOp::write(&local, 0, &dst.remote(), 0, 8192)).await.unwrap();
    assert_eq!(r.backend, "shm");
    local.deregister().await.unwrap();
    mine.clear();

    // Another host: shm is never chosen.
    let c = engine("host-2").await;
    let far = c.alloc(8192, Permissions::WRITE).await.unwrap();
    let s2 = a.connect(c.local_addr()).await.unwrap();
    let r = s2.transfer(TransferOp::write(&src, 0, &far.remote(), 0, 8192)).await.unwrap();
    assert_eq!(r.backend, "tcp");
}
