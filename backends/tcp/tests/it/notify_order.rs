//! Notification order against a READ in flight: an ordered notification (`Session::notify`)
//! reaches the peer only once every earlier op ended; an unordered one
//! (`Session::notify_unordered`) leaves at once, on a stream no data is queued on. The READ's
//! data comes back through a proxy throttled to 16 KiB/s per stream, so the 64 KiB READ cannot end
//! while the test looks (4 s); then the proxy heals and everything completes with the right
//! bytes. The READ is one piece (under two of tcp's 512 KiB minimum shares), so of the two streams
//! one stays free for the unordered notification: a READ cut over both streams would leave none,
//! and the notification would wait behind throttled data on whichever it took (the peer serves a
//! stream's requests in order).

use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::{Engine, Permissions, TransferOp};
use tensorwire_tcp::{TcpBackend, TcpConfig};
use tensorwire_testkit::faults::{Fault, FaultProxy};

const LEN: u64 = 64 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unordered_notification_overtakes_a_read_in_flight() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let proxy = FaultProxy::start(port).await.unwrap();
    let b_cfg = TcpConfig { listen: port, advertise: Some(proxy.addr()), ..TcpConfig::default() };
    let b = Engine::builder().backend(TcpBackend::new(b_cfg).unwrap()).start().await.unwrap();
    let a_cfg =
        TcpConfig { streams: 2, stall_timeout: Duration::from_secs(60), ..TcpConfig::default() };
    let a = Engine::builder().backend(TcpBackend::new(a_cfg).unwrap()).start().await.unwrap();
    let local = a.alloc(LEN, Permissions::NONE).await.unwrap();
    let remote = b.alloc(LEN, Permissions::READ_WRITE).await.unwrap();
    let data: Vec<u8> = (0..LEN as usize).map(|i| (i % 241) as u8).collect();
    remote.write_bytes(0, &data).unwrap();
    let session = a.connect(b.local_addr()).await.unwrap();
    session.notify(Bytes::from_static(b"warm")).await.unwrap(); // connections open
    assert_eq!(&b.recv_notification(Duration::from_secs(10)).await.unwrap().payload[..], b"warm");

    proxy.set(Fault::Throttle(16 << 10));
    let mut read =
        session.submit(vec![TransferOp::read(&local, 0, &remote.remote(), 0, LEN)]).await;
    let mut read = read.pop().unwrap();
    let ordered = tokio::spawn({
        let s = session.clone();
        async move { s.notify(Bytes::from_static(b"ordered")).await }
    });
    session.notify_unordered(Bytes::from_static(b"unordered")).await.unwrap();
    let n = b.recv_notification(Duration::from_secs(10)).await.unwrap();
    assert_eq!(&n.payload[..], b"unordered", "the unordered notification comes first");
    tokio::select! {
        biased;
        r = &mut read => panic!("the throttled READ ended already: {r:?}"),
        _ = std::future::ready(()) => {}
    }
    assert!(!ordered.is_finished(), "the ordered notification waits for the READ");

    proxy.set(Fault::None);
    read.await.unwrap();
    ordered.await.unwrap().unwrap();
    let n = b.recv_notification(Duration::from_secs(10)).await.unwrap();
    assert_eq!(&n.payload[..], b"ordered");
    assert!(local.to_vec(0, LEN).unwrap() == data, "READ bytes differ");
}
