//! A READ's notice rides in the request of the READ's first piece: the server delivers it before
//! it serves that piece. The peer's handler rewrites the region the READ names when the notice
//! arrives, so the READ returns the rewritten bytes only if the notice came first (a notice sent
//! beside the READ, as the default `Connection::submit_noticed` does, could arrive after the bytes
//! left). The READ is one piece (under two of tcp's 512 KiB minimum shares): a READ cut over both
//! streams has its other piece served on its own. A refusal is the READ's answer, and the stream
//! serves the next READ.

use std::sync::Arc;

use bytes::Bytes;
use tensorwire_core::{Engine, Error, Handled, Missing, Permissions, TransferOp};
use tensorwire_tcp::{TcpBackend, TcpConfig};

const LEN: u64 = 64 << 10;

async fn engine() -> Engine {
    let cfg = TcpConfig { streams: 2, ..TcpConfig::default() };
    Engine::builder().backend(TcpBackend::new(cfg).unwrap()).start().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_is_served_after_its_notice() {
    let (a, b) = (engine().await, engine().await);
    let local = a.alloc(LEN, Permissions::NONE).await.unwrap();
    let theirs = Arc::new(b.alloc(LEN, Permissions::READ).await.unwrap());
    theirs.write_bytes(0, &vec![1u8; LEN as usize]).unwrap();
    let region = theirs.clone();
    b.set_notification_handler(Some(Arc::new(move |n| match &n.payload[..] {
        [fill] if *fill != 0 => {
            region.write_bytes(0, &vec![*fill; LEN as usize]).unwrap();
            Handled::Taken
        }
        _ => Handled::Refused(Error::NotFound(Missing::Other("not served".into()))),
    })));
    let s = a.connect(b.local_addr()).await.unwrap();
    let read = || vec![TransferOp::read(&local, 0, &theirs.remote(), 0, LEN)];
    for fill in 2u8..12 {
        let mut h = s.submit_with_notice(Bytes::from(vec![fill]), read()).await;
        h.pop().unwrap().await.unwrap();
        let got = local.to_vec(0, LEN).unwrap();
        assert!(
            got.iter().all(|&x| x == fill),
            "round {fill}: the READ was served before its notice"
        );
    }
    let mut h = s.submit_with_notice(Bytes::from_static(&[0]), read()).await;
    let e = h.pop().unwrap().await.unwrap_err();
    assert!(e.to_string().contains("not served"), "the refusal answers the READ: {e}");
    s.transfer(read().pop().unwrap()).await.unwrap();
    assert!(local.to_vec(0, LEN).unwrap().iter().all(|&x| x == 11));
}
