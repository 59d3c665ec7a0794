//! Memory allocated through UCX (`UcxBackend::allocate`), registered with `register_raw` on both
//! sides: WRITE and READ move the exact bytes (one-copy put/get over the shared-memory transports),
//! and the regions deregister cleanly before the memory is freed.
#![cfg(feature = "ucx")]

use tensorwire_conformance::pattern;
use tensorwire_core::{Engine, MemoryKind, Permissions, TransferOp};
use tensorwire_ucx::{UcxBackend, UcxConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocated_memory_roundtrip() {
    for tls in ["sm,self", "tcp"] {
        let (ua, ub) = (
            UcxBackend::with_config(UcxConfig::transports(tls)).unwrap(),
            UcxBackend::with_config(UcxConfig::transports(tls)).unwrap(),
        );
        let a = Engine::builder().backend(ua.clone()).start().await.unwrap();
        let b = Engine::builder().backend(ub.clone()).start().await.unwrap();
        let len = 3u64 << 20;
        let (ma, mb) = (ua.allocate(len).await.unwrap(), ub.allocate(len).await.unwrap());
        assert!(ua.allocate(0).await.is_err(), "zero bytes");
        // SAFETY: both allocations outlive their regions (deregistered below, before the drop).
        let (ra, rb) = unsafe {
            (
                a.register_raw(ma.as_ptr(), len, MemoryKind::Host, Permissions::NONE)
                    .await
                    .unwrap(),
                b.register_raw(mb.as_ptr(), len, MemoryKind::Host, Permissions::READ_WRITE)
                    .await
                    .unwrap(),
            )
        };
        let data = pattern(len as usize, 3);
        ra.write_bytes(0, &data).unwrap();
        let s = a.connect(b.local_addr()).await.unwrap();
        let r = s.transfer(TransferOp::write(&ra, 0, &rb.remote(), 0, len)).await.unwrap();
        assert_eq!(r.backend, "ucx");
        assert!(rb.to_vec(0, len).unwrap() == data, "{tls}: written bytes differ");
        rb.write_bytes(1000, &[7u8; 4096]).unwrap();
        s.transfer(TransferOp::read(&ra, 77, &rb.remote(), 1000, 4096)).await.unwrap();
        assert_eq!(ra.to_vec(77, 4096).unwrap(), vec![7u8; 4096], "{tls}: read bytes differ");
        ra.deregister().await.unwrap();
        rb.deregister().await.unwrap();
        drop((ma, mb));
        a.shutdown().await;
        b.shutdown().await;
    }
}
