//! Memory allocated through UCX (`UcxBackend::allocate`), registered with `register_raw` on both
//! sides: WRITE and READ move the exact bytes (one-copy put/get over the shared-memory transports),
//! and the regions deregister cleanly before the memory is freed. Over shared memory such regions
//! are mapped at the peer, whose callers then copy leased ops themselves in `submit` (`mapped`).
#![cfg(feature = "ucx")]

use std::sync::Arc;

use tensorwire_conformance::pattern;
use tensorwire_core::{Engine, MemoryKind, Permissions, Region, TransferOp};
use tensorwire_ucx::{UcxBackend, UcxConfig, UcxMemory};

/// Two engines on UCX backends over `tls`, each with `len` bytes allocated through UCX and
/// registered raw: `ra` on `a` (no remote access), `rb` on `b` (remote READ and WRITE).
struct Pair {
    ua: Arc<UcxBackend>,
    _ub: Arc<UcxBackend>,
    a: Engine,
    b: Engine,
    ma: UcxMemory,
    mb: UcxMemory,
    ra: Region,
    rb: Region,
}

async fn pair(tls: &str, len: u64) -> Pair {
    let (ua, ub) = (
        UcxBackend::with_config(UcxConfig::transports(tls)).unwrap(),
        UcxBackend::with_config(UcxConfig::transports(tls)).unwrap(),
    );
    let a = Engine::builder().backend(ua.clone()).start().await.unwrap();
    let b = Engine::builder().backend(ub.clone()).start().await.unwrap();
    let (ma, mb) = (ua.allocate(len).await.unwrap(), ub.allocate(len).await.unwrap());
    // SAFETY: the tests deregister both regions before they hand the memory to `finish`.
    let (ra, rb) = unsafe {
        (
            a.register_raw(ma.as_ptr(), len, MemoryKind::Host, Permissions::NONE).await.unwrap(),
            b.register_raw(mb.as_ptr(), len, MemoryKind::Host, Permissions::READ_WRITE)
                .await
                .unwrap(),
        )
    };
    Pair { ua, _ub: ub, a, b, ma, mb, ra, rb }
}

/// Frees the memory (its regions deregistered) and shuts both engines down.
async fn finish(a: Engine, b: Engine, memory: (UcxMemory, UcxMemory)) {
    drop(memory);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocated_memory_roundtrip() {
    for tls in ["sm,self", "tcp"] {
        let len = 3u64 << 20;
        let Pair { ua, a, b, ma, mb, ra, rb, .. } = pair(tls, len).await;
        assert!(ua.allocate(0).await.is_err(), "zero bytes");
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
        finish(a, b, (ma, mb)).await;
    }
}

/// Over shared memory, ops on a lease of a region UCX maps here are copied by the caller in
/// `submit` (the first op on the region asks for the lease); larger ops and ops after the peer
/// deregistered the region go through the progress thread; over tcp nothing is mapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_mapped_regions_are_copied_in_submit_until_deregistered() {
    for (tls, mapped) in [("sm,self", true), ("tcp", false)] {
        let len = 4u64 << 20;
        let Pair { ua, a, b, ma, mb, ra, rb, .. } = pair(tls, len).await;
        let s = a.connect(b.local_addr()).await.unwrap();
        let data = pattern(len as usize, 9);
        ra.write_bytes(0, &data).unwrap();
        let write = |off: u64, n: u64| TransferOp::write(&ra, off, &rb.remote(), off, n);
        let read = |off: u64, n: u64| TransferOp::read(&ra, off, &rb.remote(), off, n);

        // The first WRITE asks for the write lease; the next ones (4 KiB and 1 MiB) copy here.
        s.transfer(write(0, 4096)).await.unwrap();
        let before = ua.ops_copied_in_submit();
        s.transfer(write(4096, 4096)).await.unwrap();
        s.transfer(write(1 << 20, 1 << 20)).await.unwrap();
        let copied = ua.ops_copied_in_submit() - before;
        assert_eq!(copied, if mapped { 2 } else { 0 }, "{tls}: WRITEs copied in submit");
        for (off, n) in [(0usize, 8192usize), (1 << 20, 1 << 20)] {
            let got = rb.to_vec(off as u64, n as u64).unwrap();
            assert!(got == data[off..off + n], "{tls}: written bytes differ at {off}");
        }

        // More than 1 MiB goes to the progress thread, whole and exact.
        let before = ua.ops_copied_in_submit();
        s.transfer(write(2 << 20, 2 << 20)).await.unwrap();
        assert_eq!(ua.ops_copied_in_submit(), before, "{tls}: a 2 MiB op is not copied in submit");
        let got = rb.to_vec(2 << 20, 2 << 20).unwrap();
        assert!(got == data[2 << 20..], "{tls}: written bytes differ");

        // READs: the first asks for the read lease, the next one copies here.
        let back = pattern(len as usize, 10);
        rb.write_bytes(0, &back).unwrap();
        s.transfer(read(0, 4096)).await.unwrap();
        let before = ua.ops_copied_in_submit();
        s.transfer(read(8192, 64 << 10)).await.unwrap();
        let copied = ua.ops_copied_in_submit() - before;
        assert_eq!(copied, u64::from(mapped), "{tls}: a READ copied in submit");
        assert!(ra.to_vec(0, 4096).unwrap() == back[..4096], "{tls}: read bytes differ");
        assert!(
            ra.to_vec(8192, 64 << 10).unwrap() == back[8192..8192 + (64 << 10)],
            "{tls}: read bytes differ"
        );

        // Once the peer deregistered the region (its leases revoked and given back), ops on it
        // are refused by the peer, never copied into its memory.
        let stale = rb.remote();
        rb.deregister().await.unwrap();
        let before = ua.ops_copied_in_submit();
        ra.write_bytes(0, &[0xAB; 4096]).unwrap();
        let e = s.transfer(TransferOp::write(&ra, 0, &stale, 0, 4096)).await.unwrap_err();
        assert!(matches!(e, tensorwire_core::Error::NotFound(_)), "{tls}: {e}");
        let e = s.transfer(TransferOp::read(&ra, 0, &stale, 0, 4096)).await.unwrap_err();
        assert!(matches!(e, tensorwire_core::Error::NotFound(_)), "{tls}: {e}");
        assert_eq!(ua.ops_copied_in_submit(), before, "{tls}: nothing copied after deregistration");
        // SAFETY: the region is deregistered; the memory is still allocated (`mb`).
        let left = unsafe { std::slice::from_raw_parts(mb.as_ptr(), 4096) };
        assert_eq!(left, &back[..4096], "{tls}: the deregistered memory was not written");
        ra.deregister().await.unwrap();
        finish(a, b, (ma, mb)).await;
    }
}

/// A peer deregistering a region while this side keeps copying into it in `submit`: every op
/// either lands or is refused (the lease's view goes before the peer unmaps), and the copies
/// stop once deregistration is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistering_while_callers_copy_ends_the_copies_cleanly() {
    let len = 1u64 << 20;
    let Pair { ua, a, b, ma, mb, ra, rb, .. } = pair("sm,self", len).await;
    let s = a.connect(b.local_addr()).await.unwrap();
    let remote = rb.remote();
    let before = ua.ops_copied_in_submit();
    let writer = async {
        let mut landed = 0u64;
        loop {
            let op = TransferOp::write(&ra, 0, &remote, (landed % 16) * 4096, 4096);
            match s.transfer(op).await {
                Ok(_) => landed += 1,
                Err(e) => return (landed, e),
            }
            tokio::task::yield_now().await;
        }
    };
    let deregistering = async {
        while ua.ops_copied_in_submit() < before + 200 {
            tokio::task::yield_now().await;
        }
        rb.deregister().await.unwrap();
        ua.ops_copied_in_submit()
    };
    let bound = std::time::Duration::from_secs(20);
    let ((landed, e), after) =
        tokio::time::timeout(bound, async { tokio::join!(writer, deregistering) })
            .await
            .expect("the writer stops");
    assert!(matches!(e, tensorwire_core::Error::NotFound(_)), "{e}");
    assert!(landed >= 200, "{landed} ops landed");
    assert_eq!(ua.ops_copied_in_submit(), after, "no copy after deregistration returned");
    ra.deregister().await.unwrap();
    finish(a, b, (ma, mb)).await;
}

/// Once the peer's shutdown returned, no op is copied into its mapped region any more: its
/// shutdown takes the leases back first (Forget, then Bye once they are released), so an op
/// right after it goes to the progress thread and fails as a peer failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_copy_lands_after_the_peer_shut_down() {
    for round in 0..10 {
        let Pair { ua, a, b, ma, mb, ra, rb, .. } = pair("sm,self", 1 << 20).await;
        let s = a.connect(b.local_addr()).await.unwrap();
        let remote = rb.remote();
        s.transfer(TransferOp::write(&ra, 0, &remote, 0, 4096)).await.unwrap(); // the lease
        let before = ua.ops_copied_in_submit();
        s.transfer(TransferOp::write(&ra, 0, &remote, 0, 4096)).await.unwrap();
        assert_eq!(ua.ops_copied_in_submit(), before + 1, "round {round}: copied in submit");
        let t = std::time::Instant::now();
        b.shutdown().await;
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "round {round}: shutdown waited");
        let e = s.transfer(TransferOp::write(&ra, 0, &remote, 0, 4096)).await.unwrap_err();
        assert!(e.is_peer_failure(), "round {round}: {e}");
        let e = s.transfer(TransferOp::read(&ra, 0, &remote, 0, 4096)).await.unwrap_err();
        assert!(e.is_peer_failure(), "round {round}: {e}");
        assert_eq!(ua.ops_copied_in_submit(), before + 1, "round {round}: nothing copied after");
        drop(s);
        ra.deregister().await.unwrap();
        let _ = rb.deregister().await;
        finish(a, b, (ma, mb)).await;
    }
}
