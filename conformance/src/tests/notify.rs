//! Notifications: after the data they follow, in order, bounded in size and in queue depth.

use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::{EngineConfig, Error, Permissions, TransferOp};
use tensorwire_proto::wire::envelope::MAX_NOTIFY_BYTES;

use crate::{PairFactory, bounded, connected, connected_with, pattern};

const WAIT: Duration = Duration::from_secs(30);

/// WRITEs submitted (not awaited) before a notification have landed when the peer receives it.
pub async fn notification_after_data(f: &dyn PairFactory) {
    let caps = f.capabilities();
    assert!(caps.notify, "the suite needs notifications; a backend without them is not conformant");
    let (pair, s) = connected(f).await;
    let len = 8u64 << 20;
    let data = pattern(len as usize, 77);
    let src = crate::alloc(f, &pair.a, len, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &data).unwrap();
    let dst = crate::alloc(f, &pair.b, len, Permissions::WRITE).await.unwrap();
    let remote = dst.remote();
    let chunk = len / 8;
    let ops =
        (0..8).map(|i| TransferOp::write(&src, i * chunk, &remote, i * chunk, chunk)).collect();
    let handles = s.submit(ops).await; // held, not awaited: dropping would cancel
    bounded("notify", s.notify(Bytes::from_static(b"data is in"))).await.unwrap();
    let n = bounded("recv", pair.b.recv_notification(WAIT)).await.unwrap();
    assert_eq!(n.from, pair.a.id());
    assert_eq!(&n.payload[..], b"data is in");
    assert!(dst.to_vec(0, len).unwrap() == data, "notification arrived before the data it follows");
    for h in handles {
        bounded("write", h).await.unwrap();
    }
}

/// 200 notifications arrive in the order sent, with the sender's id.
pub async fn notifications_in_order(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    for i in 0u32..200 {
        bounded("notify", s.notify(Bytes::copy_from_slice(&i.to_le_bytes()))).await.unwrap();
    }
    for i in 0u32..200 {
        let n = bounded("recv", pair.b.recv_notification(WAIT)).await.unwrap();
        assert_eq!(n.from, pair.a.id());
        assert_eq!(&n.payload[..], &i.to_le_bytes(), "notification {i} out of order");
    }
    let none = pair.b.recv_notification(Duration::from_millis(50)).await;
    assert!(matches!(none, Err(Error::Timeout { .. })), "extra notification: {none:?}");
}

/// An oversized payload and a full receiver queue are `Capacity` errors at the sender; the largest
/// allowed payload goes through intact.
pub async fn notification_bounds(f: &dyn PairFactory) {
    let config = EngineConfig { notification_queue: 4, ..EngineConfig::default() };
    let (pair, s) = connected_with(f, config).await;
    let too_big = Bytes::from(vec![1u8; MAX_NOTIFY_BYTES + 1]);
    let e = bounded("notify", s.notify(too_big)).await.unwrap_err();
    assert!(matches!(e, Error::Capacity { .. }), "oversized notification: {e}");
    let max = Bytes::from(pattern(MAX_NOTIFY_BYTES, 4));
    bounded("notify", s.notify(max.clone())).await.unwrap();
    for _ in 0..3 {
        bounded("notify", s.notify(Bytes::from_static(b"x"))).await.unwrap();
    }
    let e = bounded("notify", s.notify(Bytes::from_static(b"overflow"))).await.unwrap_err();
    assert!(matches!(e, Error::Capacity { .. }), "full queue: {e}");
    assert_eq!(bounded("recv", pair.b.recv_notification(WAIT)).await.unwrap().payload, max);
}

/// A notification handler on the receiver decides each notification's fate, and its verdict is
/// what the sender's `notify` returns: taken (not queued), refused (the sender gets the error,
/// the connection stays usable), or passed on to the queue.
pub async fn notification_handler_verdicts(f: &dyn PairFactory) {
    use std::sync::Arc;
    use tensorwire_core::{Handled, Missing};
    let (pair, s) = connected(f).await;
    let taken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = taken.clone();
    let from = pair.a.id();
    pair.b.set_notification_handler(Some(Arc::new(move |n| {
        assert_eq!(n.from, from);
        match &n.payload[..] {
            b"take" => {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Handled::Taken
            }
            b"refuse" => Handled::Refused(Error::NotFound(Missing::Other("refused here".into()))),
            _ => Handled::Pass,
        }
    })));
    bounded("notify", s.notify(Bytes::from_static(b"take"))).await.unwrap();
    assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1, "taken before notify returned");
    let e = bounded("notify", s.notify(Bytes::from_static(b"refuse"))).await.unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "a refusal is the handler's error: {e}");
    assert!(e.to_string().contains("refused here"), "the refusal keeps its reason: {e}");
    bounded("notify", s.notify_unordered(Bytes::from_static(b"pass"))).await.unwrap();
    let n = bounded("recv", pair.b.recv_notification(WAIT)).await.unwrap();
    assert_eq!(&n.payload[..], b"pass", "only the passed notification is queued");
    pair.b.set_notification_handler(None);
    bounded("notify", s.notify(Bytes::from_static(b"take"))).await.unwrap();
    let n = bounded("recv", pair.b.recv_notification(WAIT)).await.unwrap();
    assert_eq!(&n.payload[..], b"take", "without a handler everything is queued");
}

/// `submit_with_notice`: the notice has reached the peer's handler once the first op completed
/// (READ or WRITE first); a refusal fails that op, and only that op, with the handler's error; a
/// passed notice is queued; an oversized one fails the ops and sends nothing; and the session
/// stays usable throughout.
pub async fn notice_with_ops(f: &dyn PairFactory) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use tensorwire_core::{Handled, Missing};
    let (pair, s) = connected(f).await;
    let taken = Arc::new(AtomicUsize::new(0));
    let seen = taken.clone();
    pair.b.set_notification_handler(Some(Arc::new(move |n| match &n.payload[..] {
        b"take" => {
            seen.fetch_add(1, SeqCst);
            Handled::Taken
        }
        b"refuse" => Handled::Refused(Error::NotFound(Missing::Other("refused here".into()))),
        _ => Handled::Pass,
    })));
    let len = 1u64 << 20;
    let data = pattern(len as usize, 31);
    let theirs = crate::alloc(f, &pair.b, len, Permissions::READ_WRITE).await.unwrap();
    theirs.write_bytes(0, &data).unwrap();
    let mine = crate::alloc(f, &pair.a, len, Permissions::NONE).await.unwrap();
    let remote = theirs.remote();
    let half = len / 2;
    let reads =
        || vec![0, half].into_iter().map(|at| TransferOp::read(&mine, at, &remote, at, half));
    let notice = |b: &'static [u8]| Bytes::from_static(b);

    for (first_is_read, round) in [(true, 1), (false, 2)] {
        let mut ops: Vec<TransferOp> = reads().collect();
        if !first_is_read {
            ops.insert(0, TransferOp::write(&mine, 0, &remote, 0, 16)); // writes back what it read
        }
        let n = ops.len();
        for h in s.submit_with_notice(notice(b"take"), ops).await {
            bounded("op with a taken notice", h).await.unwrap();
        }
        assert_eq!(taken.load(SeqCst), round, "the notice was delivered by the first op's end");
        assert!(mine.to_vec(0, len).unwrap() == data, "the ops moved their bytes");

        let mut ops: Vec<TransferOp> = reads().collect();
        if !first_is_read {
            ops.insert(0, TransferOp::write(&mine, 0, &remote, 0, 16));
        }
        let mut hs = s.submit_with_notice(notice(b"refuse"), ops).await.into_iter();
        let e = bounded("op with a refused notice", hs.next().unwrap()).await.unwrap_err();
        assert!(matches!(e, Error::NotFound(_)), "a refusal is the handler's error: {e}");
        assert!(e.to_string().contains("refused here"), "the refusal keeps its reason: {e}");
        assert_eq!(hs.len(), n - 1);
        for h in hs {
            bounded("the refused op's batchmates", h).await.unwrap();
        }
    }

    let hs = s.submit_with_notice(notice(b"pass"), reads().collect()).await;
    for h in hs {
        bounded("op with a passed notice", h).await.unwrap();
    }
    let n = bounded("recv", pair.b.recv_notification(WAIT)).await.unwrap();
    assert_eq!((n.from, &n.payload[..]), (pair.a.id(), &b"pass"[..]), "a passed notice is queued");

    let too_big = Bytes::from(vec![1u8; MAX_NOTIFY_BYTES + 1]);
    for h in s.submit_with_notice(too_big, reads().collect()).await {
        let e = bounded("op with an oversized notice", h).await.unwrap_err();
        assert!(matches!(e, Error::Capacity { .. }), "oversized notice: {e}");
    }
    let none = pair.b.recv_notification(Duration::from_millis(50)).await;
    assert!(matches!(none, Err(Error::Timeout { .. })), "an oversized notice went out: {none:?}");
    bounded("read", s.transfer(reads().next().unwrap())).await.unwrap();
}
