//! Prepared transfers: ops checked once and posted again and again move the bytes of each post,
//! count as submitted ops do, and still meet the peer's checks at every post.

use std::sync::Arc;

use tensorwire_core::{Error, Missing, Permissions, TransferOp};

use crate::{PairFactory, bounded, connected, pattern};

/// Two WRITEs (reverse placement) prepared once and posted three times, the source changed
/// before each post: every post lands its own bytes, reports them, and counts as two ops. Then a
/// READ prepared and posted, four posts of it at once, and an empty preparation.
pub async fn prepared_posts_again_and_again(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let src = crate::alloc(f, &pair.a, 8192, Permissions::NONE).await.unwrap();
    let dst = crate::alloc(f, &pair.b, 8192, Permissions::READ_WRITE).await.unwrap();
    let remote = dst.remote();
    let writes = vec![
        TransferOp::write(&src, 0, &remote, 4096, 4096),
        TransferOp::write(&src, 4096, &remote, 0, 100),
    ];
    let prep = bounded("prepare", s.prepare(writes)).await.unwrap();
    assert_eq!(prep.ops().len(), 2);
    let before = pair.a.stats();
    for round in 0..3u8 {
        let data = pattern(8192, round);
        src.write_bytes(0, &data).unwrap();
        let report = bounded("post", prep.post().await).await.unwrap();
        assert_eq!(report.bytes, 4196, "round {round}");
        let names: Vec<_> = pair.a.backends().iter().map(|b| b.name()).collect();
        assert!(names.contains(&report.backend), "{} not in {names:?}", report.backend);
        let got = dst.to_vec(0, 8192).unwrap();
        assert!(got[4096..] == data[..4096], "round {round}: the first op landed wrong");
        assert!(got[..100] == data[4096..4196], "round {round}: the second op landed wrong");
    }
    let after = pair.a.stats();
    assert_eq!(after.ops_ok - before.ops_ok, 6);
    assert_eq!(after.bytes_written - before.bytes_written, 3 * 4196);

    let back = crate::alloc(f, &pair.a, 8192, Permissions::NONE).await.unwrap();
    let read = vec![TransferOp::read(&back, 0, &remote, 0, 8192)];
    let prep = Arc::new(bounded("prepare read", s.prepare(read)).await.unwrap());
    let posts: Vec<_> = (0..4)
        .map(|_| {
            let prep = prep.clone();
            tokio::spawn(async move { prep.post().await.await })
        })
        .collect();
    for p in posts {
        let report = bounded("read post", p).await.unwrap().unwrap();
        assert_eq!(report.bytes, 8192);
    }
    assert!(back.to_vec(0, 8192).unwrap() == dst.to_vec(0, 8192).unwrap());

    let none = bounded("prepare nothing", s.prepare(Vec::new())).await.unwrap();
    assert_eq!(bounded("post nothing", none.post().await).await.unwrap().bytes, 0);
}

/// A preparation refuses what a submit refuses (here an op past the remote region's end), and a
/// post after the peer deregistered its region fails as a submitted op does, though the region
/// was in use by posts just before (an shm lease held on it). A local region deregisters while
/// a preparation names it; posts fail after.
pub async fn prepared_meets_the_peers_checks(f: &dyn PairFactory) {
    let (pair, s) = connected(f).await;
    let src = crate::alloc(f, &pair.a, 4096, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &pattern(4096, 3)).unwrap();
    let dst = crate::alloc(f, &pair.b, 4096, Permissions::READ_WRITE).await.unwrap();
    let remote = dst.remote();
    let past = TransferOp::write(&src, 0, &remote, 1, 4096);
    let e = bounded("prepare past the end", s.prepare(vec![past])).await.unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");

    let prep = bounded("prepare", s.prepare(vec![TransferOp::write(&src, 0, &remote, 0, 4096)]))
        .await
        .unwrap();
    for _ in 0..3 {
        bounded("post", prep.post().await).await.unwrap();
    }
    assert_eq!(dst.to_vec(0, 4096).unwrap(), pattern(4096, 3));
    let again = crate::alloc(f, &pair.a, 4096, Permissions::NONE).await.unwrap();
    again.write_bytes(0, &[0x5a; 4096]).unwrap();
    let prep = bounded("prepare", s.prepare(vec![TransferOp::write(&again, 0, &remote, 0, 4096)]))
        .await
        .unwrap();
    bounded("deregister", dst.deregister()).await.unwrap();
    let e = bounded("post after deregister", prep.post().await).await.unwrap_err();
    assert!(matches!(e, Error::NotFound(Missing::Deregistered(id)) if id == remote.id), "{e}");
    let e = bounded("post again", prep.post().await).await.unwrap_err();
    assert!(matches!(e, Error::NotFound(Missing::Deregistered(_))), "{e}");

    // A preparation does not hold its local region: deregistering it does not wait for the
    // preparation, and later posts fail.
    let dst = crate::alloc(f, &pair.b, 4096, Permissions::READ_WRITE).await.unwrap();
    let op = TransferOp::write(&again, 0, &dst.remote(), 0, 4096);
    let prep = bounded("prepare", s.prepare(vec![op])).await.unwrap();
    bounded("post", prep.post().await).await.unwrap();
    let id = again.id();
    bounded("deregister the local region", again.deregister()).await.unwrap();
    let e = bounded("post after", prep.post().await).await.unwrap_err();
    assert!(matches!(e, Error::NotFound(Missing::Deregistered(d)) if d == id), "{e}");
}
