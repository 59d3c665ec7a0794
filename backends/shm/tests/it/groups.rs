//! Batches past the inline budget: the rest of a batch of small ops runs in groups, one task per
//! group. Every op of such a batch lands where it said; handles dropped part-way (their ops
//! cancelled inside a group) leave the group's other ops and the connection working.

use tensorwire_core::{Engine, Permissions, TransferOp};
use tensorwire_shm::ShmBackend;

const OP: u64 = 4096;
/// Four times the inline budget (1 MiB per submit): three quarters of the batch run in groups.
const OPS: u64 = 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_past_the_inline_budget_lands_whole_and_survives_dropped_handles() {
    let a = Engine::builder().backend(ShmBackend::new().unwrap()).start().await.unwrap();
    let b = Engine::builder().backend(ShmBackend::new().unwrap()).start().await.unwrap();
    let len = OP * OPS;
    let src = a.alloc(len, Permissions::NONE).await.unwrap();
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
    src.write_bytes(0, &pattern).unwrap();
    let dst = b.alloc(len, Permissions::READ_WRITE).await.unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    let remote = dst.remote();
    // Each op writes its own slot, in reverse order of slots, so a misplaced op shows.
    let ops = |n: u64| {
        (0..n)
            .map(|i| {
                let at = (n - 1 - i) * OP;
                TransferOp::write(&src, at, &remote, at, OP)
            })
            .collect::<Vec<_>>()
    };
    for h in s.submit(ops(OPS)).await {
        let r = tokio::time::timeout(std::time::Duration::from_secs(30), h).await;
        assert_eq!(r.expect("an op of the batch hung").unwrap().backend, "shm");
    }
    let mut got = vec![0u8; len as usize];
    dst.read_bytes(0, &mut got).unwrap();
    assert!(got == pattern, "a batch op landed at the wrong place or not at all");

    // Drop every other handle of a second batch: the kept ones complete.
    let handles = s.submit(ops(OPS)).await;
    let kept: Vec<_> = handles.into_iter().enumerate().filter(|(i, _)| i % 2 == 0).collect();
    for (_, h) in kept {
        tokio::time::timeout(std::time::Duration::from_secs(30), h)
            .await
            .expect("a kept op hung after its batchmates' handles were dropped")
            .unwrap();
    }
    // And the connection still moves bytes.
    let one = s.transfer(TransferOp::read(&src, 0, &remote, 0, OP)).await.unwrap();
    assert_eq!(one.bytes, OP);
}
