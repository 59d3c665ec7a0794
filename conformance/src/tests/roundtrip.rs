//! WRITE then READ round trips of assorted sizes and alignments, with exact byte checks.

use tensorwire_core::{Permissions, TransferOp};

use crate::{PairFactory, bounded, connected, pattern};

/// Writes `len` bytes from `a` at `local_off` into `b` at `remote_off`, checks every byte of `b`'s
/// region (including the untouched margins), then reads them back into a fresh region of `a`.
async fn round_trip(f: &dyn PairFactory, len: u64, local_off: u64, remote_off: u64) {
    let (pair, s) = connected(f).await;
    let data = pattern(len as usize, 0x5a);
    let src = crate::alloc(f, &pair.a, local_off + len, Permissions::NONE).await.unwrap();
    src.write_bytes(local_off, &data).unwrap();
    let margin = 64;
    let dst =
        crate::alloc(f, &pair.b, remote_off + len + margin, Permissions::READ_WRITE).await.unwrap();
    let remote = dst.remote();

    let w =
        bounded("write", s.transfer(TransferOp::write(&src, local_off, &remote, remote_off, len)))
            .await
            .unwrap_or_else(|e| panic!("write of {len} bytes: {e}"));
    assert_eq!(w.bytes, len);
    let all = dst.to_vec(0, dst.len()).unwrap();
    assert!(all[..remote_off as usize].iter().all(|&b| b == 0), "bytes before the target changed");
    assert!(
        all[(remote_off + len) as usize..].iter().all(|&b| b == 0),
        "bytes after the target changed"
    );
    assert!(
        all[remote_off as usize..(remote_off + len) as usize] == data[..],
        "written bytes differ"
    );

    let back = crate::alloc(f, &pair.a, local_off + len, Permissions::NONE).await.unwrap();
    bounded("read", s.transfer(TransferOp::read(&back, local_off, &remote, remote_off, len)))
        .await
        .unwrap_or_else(|e| panic!("read of {len} bytes: {e}"));
    assert!(back.to_vec(local_off, len).unwrap() == data, "read-back bytes differ");
}

/// A zero-byte transfer completes and changes nothing.
pub async fn write_read_zero_bytes(f: &dyn PairFactory) {
    round_trip(f, 0, 0, 0).await;
}

/// One byte.
pub async fn write_read_one_byte(f: &dyn PairFactory) {
    round_trip(f, 1, 0, 0).await;
}

/// One page.
pub async fn write_read_4k(f: &dyn PairFactory) {
    round_trip(f, 4096, 0, 0).await;
}

/// Unaligned offsets on both sides and an odd length.
pub async fn write_read_unaligned(f: &dyn PairFactory) {
    round_trip(f, 65_531, 13, 4099).await;
}

/// 64 MiB.
pub async fn write_read_64mib(f: &dyn PairFactory) {
    round_trip(f, 64 << 20, 0, 0).await;
}

/// READ returns what the peer itself put in its region.
pub async fn read_serves_peer_data(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let data = pattern(1 << 20, 3);
    let owned = crate::alloc(f, &pair.b, 1 << 20, Permissions::READ).await.unwrap();
    owned.write_bytes(0, &data).unwrap();
    let dst = crate::alloc(f, &pair.a, 1 << 20, Permissions::NONE).await.unwrap();
    bounded("read", s.transfer(TransferOp::read(&dst, 0, &owned.remote(), 0, 1 << 20)))
        .await
        .unwrap();
    assert!(dst.to_vec(0, 1 << 20).unwrap() == data);
}
