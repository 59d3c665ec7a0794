//! Every bad request is refused with its own error, checked both by the initiator and (with forged
//! descriptors) by the remote side, which must never trust the initiator's checks.

use tensorwire_core::{AccessKey, Error, Missing, Permissions, RegionId, RemoteRegion, TransferOp};

use crate::{PairFactory, bounded, connected};

async fn expect_err(what: &str, s: &tensorwire_core::Session, op: TransferOp) -> Error {
    match bounded(what, s.transfer(op)).await {
        Ok(r) => panic!("{what}: expected an error, got {r:?}"),
        Err(e) => e,
    }
}

/// Out-of-bounds offsets: remote (caught locally, and by the remote when the descriptor lies about
/// the length), local, and offset + len overflowing u64.
pub async fn reject_out_of_bounds(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let src = crate::alloc(f, &pair.a, 8192, Permissions::NONE).await.unwrap();
    let dst = crate::alloc(f, &pair.b, 4096, Permissions::READ_WRITE).await.unwrap();
    let remote = dst.remote();
    let e = expect_err("remote oob", &s, TransferOp::write(&src, 0, &remote, 4095, 2)).await;
    assert!(matches!(e, Error::OutOfBounds { offset: 4095, len: 2, limit: 4096, .. }), "{e}");
    let mut forged = remote.clone();
    forged.len = 1 << 20;
    for op in
        [TransferOp::write(&src, 0, &forged, 4096, 1), TransferOp::read(&src, 0, &forged, 0, 8192)]
    {
        let e = expect_err("forged length", &s, op).await;
        assert!(matches!(e, Error::OutOfBounds { limit: 4096, .. }), "remote side check: {e}");
    }
    let e = expect_err("local oob", &s, TransferOp::write(&src, 8000, &remote, 0, 193)).await;
    assert!(matches!(e, Error::OutOfBounds { offset: 8000, len: 193, limit: 8192, .. }), "{e}");
    let e = expect_err("overflow", &s, TransferOp::write(&src, u64::MAX, &forged, 0, 2)).await;
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    assert!(dst.to_vec(0, 4096).unwrap().iter().all(|&b| b == 0), "a refused op wrote bytes");
}

/// A wrong access key is `AccessDenied`, for READ and WRITE, whichever of its 128 bits are wrong:
/// the lowest and the highest, both edges of the two halves, a middle one, unrelated keys; and
/// after an op with the right key (a backend that keeps a lease per region must still check the
/// key of every op). A refused WRITE changes no byte.
pub async fn reject_wrong_key(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let src = crate::alloc(f, &pair.a, 64, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &[0xEE; 64]).unwrap();
    let dst = crate::alloc(f, &pair.b, 64, Permissions::READ_WRITE).await.unwrap();
    dst.write_bytes(0, &[0x11; 64]).unwrap();
    let real = dst.remote();
    let read = TransferOp::read(&src, 0, &real, 0, 64);
    bounded("the right key", s.transfer(read)).await.unwrap();
    src.write_bytes(0, &[0xEE; 64]).unwrap();
    let k = real.key.to_bits();
    let mut keys: Vec<u128> =
        [0u32, 1, 31, 63, 64, 65, 96, 126, 127].map(|b| k ^ (1u128 << b)).into();
    keys.extend([
        !k,
        k.rotate_left(64),
        k ^ (u128::from(u64::MAX) << 64),
        k ^ u128::from(u64::MAX),
    ]);
    keys.extend(unrelated_keys(k, 4));
    keys.retain(|&x| x != k);
    for bits in keys {
        let mut forged = real.clone();
        forged.key = AccessKey::from_bits(bits);
        for op in
            [TransferOp::write(&src, 0, &forged, 0, 64), TransferOp::read(&src, 0, &forged, 0, 64)]
        {
            let e = expect_err("wrong key", &s, op).await;
            assert!(
                matches!(e, Error::AccessDenied(_)),
                "key {bits:#034x} (right: {k:#034x}): {e}"
            );
        }
    }
    assert_eq!(dst.to_vec(0, 64).unwrap(), [0x11; 64], "a WRITE with a wrong key changed bytes");
}

/// `n` keys unrelated to `k` (splitmix64 over it: no bit pattern in common to rely on).
fn unrelated_keys(k: u128, n: usize) -> Vec<u128> {
    let mut state = (k as u64) ^ ((k >> 64) as u64) ^ 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    (0..n).map(|_| (u128::from(next()) << 64) | u128::from(next())).collect()
}

/// A region id the peer never registered (far out, or the next it would issue) is
/// `NotFound(Region)`.
pub async fn reject_unknown_region(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let src = crate::alloc(f, &pair.a, 64, Permissions::NONE).await.unwrap();
    let dst = crate::alloc(f, &pair.b, 64, Permissions::READ_WRITE).await.unwrap();
    let mut forged = dst.remote();
    forged.id = RegionId(1 << 40);
    let e = expect_err("unknown region", &s, TransferOp::write(&src, 0, &forged, 0, 8)).await;
    assert!(matches!(e, Error::NotFound(Missing::Region(RegionId(id))) if id == 1 << 40), "{e}");
    // The id the peer would issue next was never issued either (not a deregistered region).
    let next = RegionId(dst.id().0 + 1);
    forged.id = next;
    let e = expect_err("next region id", &s, TransferOp::write(&src, 0, &forged, 0, 8)).await;
    assert!(matches!(e, Error::NotFound(Missing::Region(id)) if id == next), "{e}");
}

/// A deregistered region, remote or local, is `NotFound(Deregistered)`.
pub async fn reject_deregistered_region(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let src = crate::alloc(f, &pair.a, 64, Permissions::NONE).await.unwrap();
    let dst = crate::alloc(f, &pair.b, 64, Permissions::READ_WRITE).await.unwrap();
    let remote = dst.remote();
    bounded("deregister", dst.deregister()).await.unwrap();
    let e = expect_err("deregistered remote", &s, TransferOp::write(&src, 0, &remote, 0, 8)).await;
    assert!(matches!(e, Error::NotFound(Missing::Deregistered(id)) if id == remote.id), "{e}");

    let live = crate::alloc(f, &pair.b, 64, Permissions::READ_WRITE).await.unwrap();
    let op = TransferOp::write(&src, 0, &live.remote(), 0, 8);
    let src_id = src.id();
    bounded("deregister", src.deregister()).await.unwrap();
    let e = expect_err("deregistered local", &s, op).await;
    assert!(matches!(e, Error::NotFound(Missing::Deregistered(id)) if id == src_id), "{e}");
}

/// WRITE to a read-only region and READ from a write-only one are `AccessDenied`; a private region
/// is not advertised and refuses both.
pub async fn reject_permissions(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let buf = crate::alloc(f, &pair.a, 64, Permissions::NONE).await.unwrap();
    let ro = crate::alloc(f, &pair.b, 64, Permissions::READ).await.unwrap();
    let wo = crate::alloc(f, &pair.b, 64, Permissions::WRITE).await.unwrap();
    let private = crate::alloc(f, &pair.b, 64, Permissions::NONE).await.unwrap();
    let e = expect_err("write ro", &s, TransferOp::write(&buf, 0, &ro.remote(), 0, 8)).await;
    assert!(matches!(e, Error::AccessDenied(_)), "{e}");
    bounded("read ro", s.transfer(TransferOp::read(&buf, 0, &ro.remote(), 0, 8))).await.unwrap();
    let e = expect_err("read wo", &s, TransferOp::read(&buf, 0, &wo.remote(), 0, 8)).await;
    assert!(matches!(e, Error::AccessDenied(_)), "{e}");
    bounded("write wo", s.transfer(TransferOp::write(&buf, 0, &wo.remote(), 0, 8))).await.unwrap();
    for op in [
        TransferOp::read(&buf, 0, &private.remote(), 0, 8),
        TransferOp::write(&buf, 0, &private.remote(), 0, 8),
    ] {
        let e = expect_err("private", &s, op).await;
        assert!(matches!(e, Error::AccessDenied(_)), "{e}");
    }
    bounded("refresh", s.refresh()).await.unwrap();
    let seen: Vec<RegionId> = s.remote_regions().iter().map(|r| r.id).collect();
    assert!(seen.contains(&ro.id()) && seen.contains(&wo.id()), "advertised: {seen:?}");
    assert!(!seen.contains(&private.id()), "a private region was advertised");
}

/// Regions of the wrong engine on either side are `InvalidArgument`, and a batch mixing good and bad
/// ops completes the good ones.
pub async fn reject_foreign_regions(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let mine = crate::alloc(f, &pair.a, 64, Permissions::READ_WRITE).await.unwrap();
    let theirs = crate::alloc(f, &pair.b, 64, Permissions::READ_WRITE).await.unwrap();
    let remote_of_self: RemoteRegion = mine.remote();
    let mut hs = s
        .submit(vec![
            TransferOp::write(&mine, 0, &remote_of_self, 0, 8),
            TransferOp::write(&theirs, 0, &theirs.remote(), 0, 8),
            TransferOp::write(&mine, 0, &theirs.remote(), 0, 8),
        ])
        .await
        .into_iter();
    for what in ["remote of the wrong engine", "local of the wrong engine"] {
        let e = bounded(what, hs.next().unwrap()).await.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{what}: {e}");
    }
    bounded("good batchmate", hs.next().unwrap()).await.unwrap();
}
