//! Batches: many small requests, concurrent batches, per-request completion, telemetry.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tensorwire_core::{Permissions, TransferOp};

use crate::{PairFactory, bounded, connected, pattern};

/// 1,000 small WRITEs in one batch, then 1,000 READs back; every byte checked.
pub async fn batch_of_1000_small(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let (n, size) = (1000u64, 100u64);
    let data = pattern((n * size) as usize, 9);
    let src = crate::alloc(f, &pair.a, n * size, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &data).unwrap();
    let dst = crate::alloc(f, &pair.b, n * size, Permissions::READ_WRITE).await.unwrap();
    let remote = dst.remote();
    // Reverse placement so a backend that mixes up offsets fails.
    let ops = (0..n)
        .map(|i| TransferOp::write(&src, i * size, &remote, (n - 1 - i) * size, size))
        .collect();
    let handles = s.submit(ops).await;
    assert_eq!(handles.len(), n as usize);
    for (i, h) in handles.into_iter().enumerate() {
        bounded("small write", h).await.unwrap_or_else(|e| panic!("op {i}: {e}"));
    }
    let got = dst.to_vec(0, n * size).unwrap();
    for i in 0..n as usize {
        let j = n as usize - 1 - i;
        assert!(got[j * 100..j * 100 + 100] == data[i * 100..i * 100 + 100], "op {i} landed wrong");
    }
    let back = crate::alloc(f, &pair.a, n * size, Permissions::NONE).await.unwrap();
    let ops = (0..n).map(|i| TransferOp::read(&back, i * size, &remote, i * size, size)).collect();
    for h in s.submit(ops).await {
        bounded("small read", h).await.unwrap();
    }
    assert!(back.to_vec(0, n * size).unwrap() == got);
}

/// Eight tasks submit batches on the same session at once; every byte lands where its op said.
pub async fn concurrent_batches(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let (tasks, per, size) = (8u64, 50u64, 4096u64);
    let total = tasks * per * size;
    let data = pattern(total as usize, 17);
    let src = Arc::new(crate::alloc(f, &pair.a, total, Permissions::NONE).await.unwrap());
    src.write_bytes(0, &data).unwrap();
    let dst = crate::alloc(f, &pair.b, total, Permissions::WRITE).await.unwrap();
    let remote = dst.remote();
    let mut joins = Vec::new();
    for t in 0..tasks {
        let (s, src, remote) = (s.clone(), src.clone(), remote.clone());
        joins.push(tokio::spawn(async move {
            let ops = (0..per)
                .map(|i| {
                    let off = (t * per + i) * size;
                    TransferOp::write(&src, off, &remote, off, size)
                })
                .collect();
            for h in s.submit(ops).await {
                h.await?;
            }
            Ok::<(), tensorwire_core::Error>(())
        }));
    }
    for j in joins {
        bounded("concurrent batch", j).await.unwrap().unwrap();
    }
    assert!(dst.to_vec(0, total).unwrap() == data);
}

/// One 64 MiB request and 32 small ones in one batch: every small one completes before the large one.
pub async fn per_request_completion(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let big = 64u64 << 20;
    let small = 4096u64;
    let src = crate::alloc(f, &pair.a, big + 32 * small, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &pattern((big + 32 * small) as usize, 1)).unwrap();
    let dst = crate::alloc(f, &pair.b, big + 32 * small, Permissions::WRITE).await.unwrap();
    let remote = dst.remote();
    let mut ops = vec![TransferOp::write(&src, 0, &remote, 0, big)];
    ops.extend(
        (0..32).map(|i| TransferOp::write(&src, big + i * small, &remote, big + i * small, small)),
    );
    let order = Arc::new(AtomicUsize::new(0));
    let mut joins = Vec::new();
    for (i, h) in s.submit(ops).await.into_iter().enumerate() {
        let order = order.clone();
        joins.push(tokio::spawn(async move {
            h.await.unwrap_or_else(|e| panic!("op {i}: {e}"));
            (i, order.fetch_add(1, Ordering::SeqCst))
        }));
    }
    let mut finished = Vec::new();
    for j in joins {
        finished.push(bounded("batch member", j).await.unwrap());
    }
    let big_rank = finished.iter().find(|(i, _)| *i == 0).map(|(_, r)| *r).unwrap();
    assert_eq!(
        big_rank, 32,
        "the 64 MiB request completed at rank {big_rank}, before some 4 KiB batchmates"
    );
    assert!(dst.to_vec(0, big + 32 * small).unwrap() == src.to_vec(0, big + 32 * small).unwrap());
}

/// Each handle names the backend that moved it (one of the engine's), and the engine counts bytes.
pub async fn telemetry_names_backend_and_counts_bytes(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let before = pair.a.stats();
    let src = crate::alloc(f, &pair.a, 10_000, Permissions::NONE).await.unwrap();
    let dst = crate::alloc(f, &pair.b, 10_000, Permissions::READ_WRITE).await.unwrap();
    let mut hs = s.submit(vec![TransferOp::write(&src, 0, &dst.remote(), 0, 10_000)]).await;
    let h = hs.pop().unwrap();
    let chosen = h.backend();
    let names: Vec<_> = pair.a.backends().iter().map(|b| b.name()).collect();
    assert!(names.contains(&chosen), "handle names backend {chosen}, engine has {names:?}");
    let report = bounded("write", h).await.unwrap();
    assert_eq!(report.backend, chosen);
    bounded("read", s.transfer(TransferOp::read(&src, 0, &dst.remote(), 0, 4000))).await.unwrap();
    let after = pair.a.stats();
    assert_eq!(after.bytes_written - before.bytes_written, 10_000);
    assert_eq!(after.bytes_read - before.bytes_read, 4000);
    assert_eq!(after.ops_ok - before.ops_ok, 2);
}
