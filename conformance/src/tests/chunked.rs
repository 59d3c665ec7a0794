//! The chunk API end to end: contiguous and strided plans, progressive production, aborts, timeouts.

use std::collections::BTreeSet;
use std::time::Duration;

use tensorwire_core::{ChunkPlan, DType, EngineConfig, Error, Permissions, TensorMeta};

use crate::{PairFactory, bounded, connected, connected_with, pattern};

/// Runs a chunked transfer of `meta` (chunked along `dim` into `count`) with the producer's tensor
/// at `local_base` and the consumer's at `remote_base`, marking chunks in `order`. Checks every
/// chunk event (each index once, ranges as planned, bytes present when reported), end-of-tensor,
/// every byte of the tensor, and that bytes outside the tensor were not touched.
async fn chunked(
    f: &dyn PairFactory,
    meta: TensorMeta,
    dim: usize,
    count: u32,
    local_base: u64,
    remote_base: u64,
    order: &[u32],
) {
    let (pair, s) = connected(f).await;
    let plan = ChunkPlan::new(&meta, dim, count).unwrap();
    let extent = plan.extent();
    let src = crate::alloc(f, &pair.a, local_base + extent, Permissions::NONE).await.unwrap();
    let data = pattern(extent as usize, 0x33);
    src.write_bytes(local_base, &data).unwrap();
    let margin = 128;
    let dst =
        crate::alloc(f, &pair.b, remote_base + extent + margin, Permissions::WRITE).await.unwrap();

    let mut stream = pair.b.expect_chunks(plan.clone(), &dst, remote_base).unwrap();
    let sender = s
        .chunk_sender(
            stream.transfer_id(),
            plan.clone(),
            &src,
            local_base,
            &dst.remote(),
            remote_base,
        )
        .unwrap();
    for &i in order {
        sender.mark_ready(i).unwrap();
    }
    let mut seen = BTreeSet::new();
    while let Some(c) = bounded("next chunk", stream.next()).await.unwrap() {
        assert!(seen.insert(c.index), "chunk {} reported twice", c.index);
        let planned = plan.chunk(c.index).unwrap();
        assert_eq!((c.start, c.end), (planned.start, planned.end));
        assert_eq!(c.ranges.len(), planned.ranges.len());
        for (got, want) in c.ranges.iter().zip(&planned.ranges) {
            assert_eq!((got.offset, got.len), (remote_base + want.offset, want.len));
            let bytes = dst.to_vec(got.offset, got.len).unwrap();
            let o = want.offset as usize;
            assert!(
                bytes == data[o..o + want.len as usize],
                "chunk {} reported before its bytes landed",
                c.index
            );
        }
    }
    assert_eq!(seen.len(), count as usize, "end-of-tensor before every chunk landed");
    assert_eq!(bounded("after end", stream.next()).await.unwrap(), None);
    bounded("finish", sender.finish()).await.unwrap();

    let all = dst.to_vec(0, dst.len()).unwrap();
    let mut covered = vec![false; extent as usize];
    for c in plan.chunks() {
        for r in &c.ranges {
            covered[r.offset as usize..r.end() as usize].iter_mut().for_each(|x| *x = true);
        }
    }
    for (i, &b) in all.iter().enumerate() {
        let rel = i as i64 - remote_base as i64;
        let in_tensor = rel >= 0 && (rel as u64) < extent && covered[rel as usize];
        let want = if in_tensor { data[rel as usize] } else { 0 };
        assert_eq!(b, want, "byte {i} of the consumer region (in tensor: {in_tensor})");
    }
}

/// Chunking along the outermost dimension: one range per chunk; chunks marked out of order.
pub async fn chunked_contiguous(f: &dyn PairFactory) {
    let meta = TensorMeta::contiguous(DType::F32, &[64, 1024]);
    chunked(f, meta, 0, 4, 0, 0, &[2, 0, 3, 1]).await;
}

/// Chunking a [C, T, H, W] bf16 tensor along T: C strided ranges per chunk; a padded leading stride
/// leaves gaps that must stay untouched; different bases on both sides.
pub async fn chunked_strided(f: &dyn PairFactory) {
    let mut meta = TensorMeta::contiguous(DType::BF16, &[4, 7, 6, 10]);
    meta.strides[0] = 7 * 6 * 10 + 20; // padded channels
    meta.byte_offset = 32;
    chunked(f, meta, 1, 7, 128, 64, &[6, 5, 4, 3, 2, 1, 0]).await;
}

/// A Wan2.1 latent [16, 21, 60, 104] bf16 in 7 temporal chunks, produced one at a time: chunk i is
/// marked only after chunk i-1 was received, so each event proves its own chunk's bytes landed.
pub async fn chunked_progressive_latent(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let meta = TensorMeta::contiguous(DType::BF16, &[16, 21, 60, 104]);
    let plan = ChunkPlan::new(&meta, 1, 7).unwrap();
    let n = meta.nbytes().unwrap();
    let data = pattern(n as usize, 21);
    let src = crate::alloc(f, &pair.a, n, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &data).unwrap();
    let dst = crate::alloc(f, &pair.b, n, Permissions::WRITE).await.unwrap();
    let mut stream = pair.b.expect_chunks(plan.clone(), &dst, 0).unwrap();
    let sender =
        s.chunk_sender(stream.transfer_id(), plan.clone(), &src, 0, &dst.remote(), 0).unwrap();
    for i in 0..7 {
        sender.mark_ready(i).unwrap();
        let c = bounded("chunk", stream.next()).await.unwrap().expect("a chunk, not end-of-tensor");
        assert_eq!(c.index, i);
        assert_eq!(c.ranges.len(), 16);
        for r in &c.ranges {
            let (o, l) = (r.offset as usize, r.len as usize);
            assert!(dst.to_vec(r.offset, r.len).unwrap() == data[o..o + l]);
        }
        assert_eq!(stream.remaining(), 6 - i);
    }
    assert_eq!(bounded("end", stream.next()).await.unwrap(), None);
    bounded("finish", sender.finish()).await.unwrap();
    assert!(dst.to_vec(0, n).unwrap() == data);
}

/// A producer that drops its sender mid-transfer makes the consumer fail with `PeerClosed`, not hang.
pub async fn chunk_sender_dropped_aborts(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let meta = TensorMeta::contiguous(DType::U8, &[3, 4096]);
    let plan = ChunkPlan::new(&meta, 0, 3).unwrap();
    let src = crate::alloc(f, &pair.a, 3 * 4096, Permissions::NONE).await.unwrap();
    let dst = crate::alloc(f, &pair.b, 3 * 4096, Permissions::WRITE).await.unwrap();
    let mut stream = pair.b.expect_chunks(plan.clone(), &dst, 0).unwrap();
    let sender = s.chunk_sender(stream.transfer_id(), plan, &src, 0, &dst.remote(), 0).unwrap();
    sender.mark_ready(0).unwrap();
    let first = bounded("first chunk", stream.next()).await.unwrap();
    assert_eq!(first.map(|c| c.index), Some(0));
    drop(sender);
    let e = bounded("after abort", stream.next()).await.unwrap_err();
    assert!(matches!(e, Error::PeerClosed(_)), "expected PeerClosed, got {e}");
    let again = stream.next().await.unwrap_err();
    assert_eq!(again.to_string(), e.to_string(), "a failed stream keeps its error");
}

/// With no producer, the consumer gets `Timeout` after the configured chunk timeout.
pub async fn chunk_stream_times_out(f: &dyn PairFactory) {
    let config =
        EngineConfig { chunk_timeout: Duration::from_millis(300), ..EngineConfig::default() };
    let (pair, _s) = connected_with(f, config).await;
    let meta = TensorMeta::contiguous(DType::U8, &[2, 8]);
    let dst = crate::alloc(f, &pair.b, 16, Permissions::WRITE).await.unwrap();
    let mut stream = pair.b.expect_chunks(ChunkPlan::new(&meta, 0, 2).unwrap(), &dst, 0).unwrap();
    let e = bounded("next", stream.next()).await.unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "expected Timeout, got {e}");
    assert!(e.to_string().contains("2 of 2 chunks still missing"), "{e}");
}

/// Bad marks are errors at the producer; finishing with unmarked chunks aborts the consumer; a plan
/// that does not fit either region is refused up front.
pub async fn chunk_bad_marks(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let meta = TensorMeta::contiguous(DType::U8, &[4, 16]);
    let plan = ChunkPlan::new(&meta, 0, 4).unwrap();
    let src = crate::alloc(f, &pair.a, 64, Permissions::NONE).await.unwrap();
    let dst = crate::alloc(f, &pair.b, 64, Permissions::WRITE).await.unwrap();
    let small = crate::alloc(f, &pair.b, 63, Permissions::WRITE).await.unwrap();
    assert!(matches!(
        pair.b.expect_chunks(plan.clone(), &small, 0),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        s.chunk_sender(1, plan.clone(), &src, 0, &small.remote(), 0),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        s.chunk_sender(1, plan.clone(), &src, 1, &dst.remote(), 0),
        Err(Error::OutOfBounds { .. })
    ));
    let mut stream = pair.b.expect_chunks(plan.clone(), &dst, 0).unwrap();
    let sender = s.chunk_sender(stream.transfer_id(), plan, &src, 0, &dst.remote(), 0).unwrap();
    assert!(matches!(sender.mark_ready(4), Err(Error::InvalidArgument(_))));
    sender.mark_ready(1).unwrap();
    assert!(matches!(sender.mark_ready(1), Err(Error::InvalidArgument(_))));
    let e = bounded("finish", sender.finish()).await.unwrap_err();
    assert!(e.to_string().contains("3 of 4 chunks never marked"), "{e}");
    // The consumer sees chunk 1 (maybe) and then the abort.
    let mut outcome = bounded("next", stream.next()).await;
    if let Ok(Some(c)) = &outcome {
        assert_eq!(c.index, 1);
        outcome = bounded("next", stream.next()).await;
    }
    assert!(matches!(outcome, Err(Error::PeerClosed(_))), "expected abort, got {outcome:?}");
}
