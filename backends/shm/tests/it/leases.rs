//! Leases under deregistration: a peer runs small ops in a loop on a region it leased (copied
//! inline in `submit`) while the owner deregisters the region. The deregistration returns within
//! its bound; no op started after it returned succeeds (each is refused as deregistered); every
//! op that succeeded moved the right bytes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tensorwire_core::{Engine, Error, Missing, Permissions, TransferOp};
use tensorwire_shm::ShmBackend;

const OP: u64 = 4096;
const LEN: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistration_revokes_a_lease_in_use() {
    let a = Engine::builder().backend(ShmBackend::new().unwrap()).start().await.unwrap();
    let b = Engine::builder().backend(ShmBackend::new().unwrap()).start().await.unwrap();
    let src = a.alloc(LEN, Permissions::NONE).await.unwrap();
    let pattern: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    src.write_bytes(0, &pattern).unwrap();
    let dst = b.alloc(LEN, Permissions::READ_WRITE).await.unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    let remote = dst.remote();
    s.transfer(TransferOp::write(&src, 0, &remote, 0, OP)).await.unwrap(); // leased from here
    let stop = Arc::new(AtomicBool::new(false));
    let (src, s2, remote2, stop2) = (Arc::new(src), s.clone(), remote.clone(), stop.clone());
    let looping = tokio::spawn(async move {
        let mut log = Vec::new();
        let mut i = 0u64;
        while !stop2.load(Ordering::Relaxed) {
            let at = (i % (LEN / OP)) * OP;
            let started = Instant::now();
            let r = s2.transfer(TransferOp::write(&src, at, &remote2, at, OP)).await;
            log.push((started, at, r.map(drop)));
            i += 1;
            tokio::task::yield_now().await;
        }
        log
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Keep a view of the bytes: the region's memory goes with it.
    let landed = dst.to_vec(0, LEN).unwrap();
    let deregistered = tokio::time::timeout(Duration::from_secs(10), dst.deregister())
        .await
        .expect("deregistration returned within its bound");
    deregistered.unwrap();
    let returned = Instant::now();
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop.store(true, Ordering::Relaxed);
    let log = looping.await.unwrap();
    let ok = log.iter().filter(|l| l.2.is_ok()).count();
    assert!(ok > 10, "the loop ran on the lease before the deregistration: {ok} ops");
    let mut refused = 0;
    for (started, at, r) in &log {
        match r {
            Ok(()) => {
                assert!(*started < returned, "an op started after the deregistration succeeded");
                let at = *at as usize;
                // Ops that landed before the snapshot carry the pattern there.
                let got = &landed[at..at + OP as usize];
                assert!(
                    got == &pattern[at..at + OP as usize] || got.iter().all(|&x| x == 0),
                    "op at {at} moved other bytes"
                );
            }
            Err(e) => {
                assert!(matches!(e, Error::NotFound(Missing::Deregistered(_))), "{e}");
                refused += 1;
            }
        }
    }
    assert!(refused > 0, "ops after the deregistration were refused");
}

/// An op on a lease right after the peer's shutdown returned (before this side's reader can have
/// seen the stream end) is refused, not copied into memory the peer no longer serves: a prepared
/// post first, then submitted ops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_copy_lands_after_the_peer_shut_down() {
    for round in 0..20 {
        let a = Engine::builder().backend(ShmBackend::new().unwrap()).start().await.unwrap();
        let b = Engine::builder().backend(ShmBackend::new().unwrap()).start().await.unwrap();
        let src = a.alloc(LEN, Permissions::NONE).await.unwrap();
        let dst = b.alloc(LEN, Permissions::READ_WRITE).await.unwrap();
        let s = a.connect(b.local_addr()).await.unwrap();
        let remote = dst.remote();
        s.transfer(TransferOp::write(&src, 0, &remote, 0, OP)).await.unwrap(); // leased from here
        s.transfer(TransferOp::write(&src, 0, &remote, 0, OP)).await.unwrap(); // copied in submit
        let prep = s.prepare(vec![TransferOp::write(&src, 0, &remote, 0, OP)]).await.unwrap();
        prep.post().await.await.unwrap(); // copied in post
        b.shutdown().await;
        let e = prep.post().await.await.unwrap_err();
        assert!(e.is_peer_failure(), "round {round}, prepared: {e}");
        let e = s.transfer(TransferOp::write(&src, 0, &remote, 0, OP)).await.unwrap_err();
        assert!(e.is_peer_failure(), "round {round}: {e}");
        let e = s.transfer(TransferOp::read(&src, 0, &remote, 0, OP)).await.unwrap_err();
        assert!(e.is_peer_failure(), "round {round}: {e}");
        a.shutdown().await;
    }
}

/// A post of more bytes than a call copies within itself (four 512 KiB ops on a leased region):
/// the ops past that budget are submitted, and every post lands all of its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_past_its_call_budget_lands_every_op() {
    let (piece, n) = (512u64 << 10, 4u64);
    let a = Engine::builder().backend(ShmBackend::new().unwrap()).start().await.unwrap();
    let b = Engine::builder().backend(ShmBackend::new().unwrap()).start().await.unwrap();
    let src = a.alloc(piece * n, Permissions::NONE).await.unwrap();
    let dst = b.alloc(piece * n, Permissions::READ_WRITE).await.unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    let remote = dst.remote();
    let ops = (0..n).map(|i| TransferOp::write(&src, i * piece, &remote, i * piece, piece));
    let prep = s.prepare(ops.collect()).await.unwrap();
    for round in 0..3u8 {
        let data: Vec<u8> = (0..piece * n).map(|i| (i % 253) as u8 ^ round).collect();
        src.write_bytes(0, &data).unwrap();
        let report = prep.post().await.await.unwrap();
        assert_eq!(report.bytes, piece * n);
        assert!(dst.to_vec(0, piece * n).unwrap() == data, "round {round}");
    }
    a.shutdown().await;
    b.shutdown().await;
}
