//! How ops spread over a connection's streams, read from the backend's per-stream counters
//! (`Engine::backend_stats`): a piece goes to an idle stream before a busy one takes a second, so
//! a 1 MiB op uses both streams of a two-stream connection (a READ request is tiny: without that
//! rule the first writer to wake took every piece). The data path runs through a proxy that holds
//! each read 2 ms, so no piece is answered before the other stream's writer has run: the split
//! is then exact, whatever the scheduler does (without the delay, a stream whose first piece is
//! answered before the other writer wakes rightly takes the second too). Beyond one piece per
//! stream, the stream with the fewest pieces outstanding takes the next, so an op of four pieces
//! runs two on each stream (it used to run three on one whenever that writer woke first, and the
//! other stream idled for a third of the op).

use std::time::Duration;

use tensorwire_core::{Engine, Permissions, Region, Session, TransferOp};
use tensorwire_tcp::{TcpBackend, TcpConfig};
use tensorwire_testkit::faults::{Fault, FaultProxy};

const LEN: u64 = 1 << 20;

fn counter(e: &Engine, name: &str) -> u64 {
    e.backend_stats()
        .into_iter()
        .filter(|(b, _)| *b == tensorwire_tcp::NAME)
        .flat_map(|(_, s)| s)
        .find(|(n, _)| n == name)
        .map_or(0, |(_, v)| v)
}

/// An initiator with two streams of `piece_bytes` pieces, a target behind a proxy that holds each
/// read 2 ms, a local and a remote region of `len` bytes (the remote one filled with a pattern,
/// returned), and a session between them.
async fn delayed_pair(
    piece_bytes: u64,
    len: u64,
) -> (FaultProxy, Engine, Engine, Region, Region, Vec<u8>, Session) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let proxy = FaultProxy::start(port).await.unwrap();
    proxy.set(Fault::Delay(Duration::from_millis(2)));
    let b_cfg = TcpConfig { listen: port, advertise: Some(proxy.addr()), ..TcpConfig::default() };
    let b = Engine::builder().backend(TcpBackend::new(b_cfg).unwrap()).start().await.unwrap();
    let a_cfg = TcpConfig { streams: 2, piece_bytes, ..TcpConfig::default() };
    let a = Engine::builder().backend(TcpBackend::new(a_cfg).unwrap()).start().await.unwrap();
    let local = a.alloc(len, Permissions::NONE).await.unwrap();
    let remote = b.alloc(len, Permissions::READ_WRITE).await.unwrap();
    let data: Vec<u8> = (0..len as usize).map(|i| (i % 251) as u8).collect();
    remote.write_bytes(0, &data).unwrap();
    let session = a.connect(b.local_addr()).await.unwrap();
    (proxy, a, b, local, remote, data, session)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_of_a_mib_uses_both_streams() {
    let (_proxy, a, _b, local, remote, data, session) =
        delayed_pair(TcpConfig::default().piece_bytes, LEN).await;

    const OPS: u64 = 8;
    for _ in 0..OPS {
        session.transfer(TransferOp::read(&local, 0, &remote.remote(), 0, LEN)).await.unwrap();
    }
    assert!(local.to_vec(0, LEN).unwrap() == data, "READ bytes differ");
    let (p0, p1) = (counter(&a, "stream0.pieces"), counter(&a, "stream1.pieces"));
    assert_eq!(p0 + p1, 2 * OPS, "each 1 MiB READ is cut in two pieces");
    assert_eq!((p0, p1), (OPS, OPS), "READ pieces: stream0 {p0}, stream1 {p1}");
    let (b0, b1) = (counter(&a, "stream0.bytes"), counter(&a, "stream1.bytes"));
    assert_eq!((b0, b1), (OPS * LEN / 2, OPS * LEN / 2));

    for _ in 0..OPS {
        session.transfer(TransferOp::write(&local, 0, &remote.remote(), 0, LEN)).await.unwrap();
    }
    let (q0, q1) = (counter(&a, "stream0.pieces") - p0, counter(&a, "stream1.pieces") - p1);
    assert_eq!((q0, q1), (OPS, OPS), "WRITE pieces: stream0 {q0}, stream1 {q1}");
}

/// An op of four pieces on two streams: each stream takes two, whichever writer wakes first (a
/// stream may take a second piece while the other works, not a third while the other has one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pieces_beyond_one_per_stream_are_shared_evenly() {
    let piece = 256u64 << 10;
    let len = 4 * piece;
    let (_proxy, a, _b, local, remote, data, session) = delayed_pair(piece, len).await;
    const OPS: u64 = 8;
    for _ in 0..OPS {
        session.transfer(TransferOp::read(&local, 0, &remote.remote(), 0, len)).await.unwrap();
    }
    assert!(local.to_vec(0, len).unwrap() == data, "READ bytes differ");
    let (p0, p1) = (counter(&a, "stream0.pieces"), counter(&a, "stream1.pieces"));
    assert_eq!((p0, p1), (2 * OPS, 2 * OPS), "READ pieces: stream0 {p0}, stream1 {p1}");
}

/// Small ops of one submit pack onto the first stream while it has little in flight (each
/// stream that answers wakes its reader: spreading a few small ops costs more than it saves),
/// and spill to the next once the first holds 256 KiB: 4 KiB ops, 64 per stream, the rest to the
/// writers; an op that would take the first past 256 KiB goes to the next. Behind the delaying
/// proxy nothing is answered meanwhile, so the split is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_ops_of_a_batch_pack_onto_one_stream() {
    let (_proxy, a, _b, local, remote, data, session) =
        delayed_pair(TcpConfig::default().piece_bytes, LEN).await;
    let ops = |n: u64| -> Vec<TransferOp> {
        (0..n)
            .map(|i| TransferOp::read(&local, i * 4096, &remote.remote(), i * 4096, 4096))
            .collect()
    };
    for r in session.submit(ops(8)).await {
        r.await.unwrap();
    }
    assert_eq!(local.to_vec(0, 8 * 4096).unwrap(), data[..8 * 4096], "READ bytes differ");
    let (p0, p1) = (counter(&a, "stream0.pieces"), counter(&a, "stream1.pieces"));
    assert_eq!((p0, p1), (8, 0), "8 small READs: stream0 {p0}, stream1 {p1}");

    for r in session.submit(ops(256)).await {
        r.await.unwrap();
    }
    let (q0, q1) = (counter(&a, "stream0.pieces") - p0, counter(&a, "stream1.pieces") - p1);
    assert_eq!(q0 + q1, 256);
    assert!(q0 >= 64 && q1 >= 64, "256 small READs: stream0 {q0}, stream1 {q1}");

    // At the bound: 63 ops of 4 KiB leave room for 4 KiB more on the first stream, not 8.
    let (r0, r1) = (counter(&a, "stream0.pieces"), counter(&a, "stream1.pieces"));
    let mut edge = ops(63);
    edge.push(TransferOp::read(&local, 63 * 4096, &remote.remote(), 63 * 4096, 8192));
    for r in session.submit(edge).await {
        r.await.unwrap();
    }
    let (e0, e1) = (counter(&a, "stream0.pieces") - r0, counter(&a, "stream1.pieces") - r1);
    assert_eq!((e0, e1), (63, 1), "63 x 4 KiB + 8 KiB: stream0 {e0}, stream1 {e1}");
}
