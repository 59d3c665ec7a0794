//! Sessions and lifetimes: reverse sessions, a peer going away, deregistration and cancellation
//! while transfers are in flight.

use std::time::Duration;

use tensorwire_core::{EngineConfig, Error, Missing, Permissions, TransferOp};

use crate::{PairFactory, bounded, connected, connected_with, pattern};

/// After `a` connects to `b`, `b` has a session back to `a` without dialing, and can write to `a`.
pub async fn reverse_session(f: &dyn PairFactory) {
    let (pair, _s) = connected(f).await;
    let back = pair.b.session(pair.a.id()).expect("b knows a from the inbound handshake");
    assert_eq!(back.peer(), pair.a.id());
    let target = crate::alloc(f, &pair.a, 1024, Permissions::WRITE).await.unwrap();
    let src = crate::alloc(f, &pair.b, 1024, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &pattern(1024, 8)).unwrap();
    bounded("reverse write", back.transfer(TransferOp::write(&src, 0, &target.remote(), 0, 1024)))
        .await
        .unwrap();
    assert_eq!(target.to_vec(0, 1024).unwrap(), pattern(1024, 8));
    let unknown = tensorwire_core::EngineId(12345);
    assert!(matches!(pair.a.session(unknown), Err(Error::NotFound(Missing::Peer(_)))));
}

/// The peer shuts down while 64 x 1 MiB WRITEs are in flight: every op resolves (done, or
/// `PeerClosed`/`Timeout`) within the configured timeout, and later ops and notifications fail.
pub async fn peer_goes_away_mid_transfer(f: &dyn PairFactory) {
    let config =
        EngineConfig { transfer_timeout: Duration::from_secs(5), ..EngineConfig::default() };
    let (pair, s) = connected_with(f, config).await;
    let (n, size) = (64u64, 1u64 << 20);
    let src = crate::alloc(f, &pair.a, n * size, Permissions::NONE).await.unwrap();
    let dst = crate::alloc(f, &pair.b, n * size, Permissions::WRITE).await.unwrap();
    let remote = dst.remote();
    let ops = (0..n).map(|i| TransferOp::write(&src, i * size, &remote, i * size, size)).collect();
    let handles = s.submit(ops).await;
    pair.b.shutdown().await;
    for (i, h) in handles.into_iter().enumerate() {
        if let Err(e) = bounded("in-flight op", h).await {
            assert!(e.is_peer_failure(), "op {i}: expected PeerClosed or Timeout, got {e}");
        }
    }
    let e = bounded("after shutdown", s.transfer(TransferOp::write(&src, 0, &remote, 0, size)))
        .await
        .unwrap_err();
    assert!(e.is_peer_failure(), "expected PeerClosed or Timeout, got {e}");
    let e = bounded("notify", s.notify(bytes::Bytes::from_static(b"x"))).await.unwrap_err();
    assert!(e.is_peer_failure(), "expected PeerClosed or Timeout, got {e}");
    let e = bounded("connect", pair.a.connect(pair.b.local_addr())).await.unwrap_err();
    assert!(e.is_peer_failure(), "connect to a shut-down engine: {e}");
}

/// Deregistering a region that a 64 MiB WRITE is landing in waits for it (the op completes or is
/// refused as deregistered), returns within its bound, and later ops are refused.
pub async fn deregister_with_transfers_in_flight(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let len = 64u64 << 20;
    let src = crate::alloc(f, &pair.a, len, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &pattern(len as usize, 5)).unwrap();
    let dst = crate::alloc(f, &pair.b, len, Permissions::WRITE).await.unwrap();
    let remote = dst.remote();
    let mut hs = s.submit(vec![TransferOp::write(&src, 0, &remote, 0, len)]).await;
    let h = hs.pop().unwrap();
    bounded("deregister", dst.deregister()).await.expect("deregister waits, then succeeds");
    match bounded("in-flight write", h).await {
        Ok(r) => assert_eq!(r.bytes, len),
        Err(e) => assert!(
            matches!(e, Error::NotFound(Missing::Deregistered(_))),
            "in-flight op: expected success or Deregistered, got {e}"
        ),
    }
    let e =
        bounded("after", s.transfer(TransferOp::write(&src, 0, &remote, 0, 8))).await.unwrap_err();
    assert!(matches!(e, Error::NotFound(Missing::Deregistered(_))), "{e}");
    assert_eq!(pair.b.region_count(), 0);
}

/// A region that several ops used (a backend may keep state for it between ops: a lease, a
/// cached grant) deregisters within its bound while a 64 MiB WRITE lands in it; later WRITEs and
/// READs, on the same cached path, are refused.
pub async fn deregister_after_repeated_ops(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let len = 64u64 << 20;
    let src = crate::alloc(f, &pair.a, len, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &pattern(len as usize, 9)).unwrap();
    let dst = crate::alloc(f, &pair.b, len, Permissions::READ_WRITE).await.unwrap();
    let remote = dst.remote();
    for i in 0..4u64 {
        let op = TransferOp::write(&src, i * 4096, &remote, i * 4096, 4096);
        bounded("small write", s.transfer(op)).await.unwrap();
        let op = TransferOp::read(&src, len - 4096, &remote, i * 4096, 4096);
        bounded("small read", s.transfer(op)).await.unwrap();
    }
    assert_eq!(dst.to_vec(0, 4 * 4096).unwrap(), pattern(len as usize, 9)[..4 * 4096]);
    let mut hs = s.submit(vec![TransferOp::write(&src, 0, &remote, 0, len)]).await;
    let h = hs.pop().unwrap();
    bounded("deregister", dst.deregister()).await.expect("deregister waits, then succeeds");
    if let Err(e) = bounded("in-flight write", h).await {
        assert!(matches!(e, Error::NotFound(Missing::Deregistered(_))), "in-flight op: {e}");
    }
    let e = bounded("write after", s.transfer(TransferOp::write(&src, 0, &remote, 0, 8)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotFound(Missing::Deregistered(_))), "{e}");
    let e = bounded("read after", s.transfer(TransferOp::read(&src, 0, &remote, 0, 8)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotFound(Missing::Deregistered(_))), "{e}");
}

/// Dropping the handle of a 64 MiB READ cancels it: once the drop returns, the destination does not
/// change any more (checked after another transfer on the same session has completed).
pub async fn cancellation_is_safe(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let len = 64u64 << 20;
    let remote_src = crate::alloc(f, &pair.b, len, Permissions::READ).await.unwrap();
    remote_src.write_bytes(0, &vec![0xee; len as usize]).unwrap();
    let dst = crate::alloc(f, &pair.a, len, Permissions::NONE).await.unwrap();
    let mut hs = s.submit(vec![TransferOp::read(&dst, 0, &remote_src.remote(), 0, len)]).await;
    tokio::task::yield_now().await;
    drop(hs.pop());
    let snapshot = dst.to_vec(0, len).unwrap();
    // Let the backend run: a full transfer of the same size on the same session.
    let other = crate::alloc(f, &pair.a, len, Permissions::NONE).await.unwrap();
    bounded("other read", s.transfer(TransferOp::read(&other, 0, &remote_src.remote(), 0, len)))
        .await
        .unwrap();
    assert!(dst.to_vec(0, len).unwrap() == snapshot, "bytes landed after the handle was dropped");
    // The engine and the region are still usable.
    bounded("reuse", s.transfer(TransferOp::read(&dst, 0, &remote_src.remote(), 0, 4096)))
        .await
        .unwrap();
    assert_eq!(dst.to_vec(0, 4096).unwrap(), vec![0xee; 4096]);
}
