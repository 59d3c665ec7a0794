//! What a stranger (a peer that never passed an engine handshake) can hold on the data
//! listener: a stream that does not send the preamble and the backend's ticket within the
//! pending deadline is closed, the pending streams of a source and of the listener are bounded
//! (the oldest goes), a wrong ticket or an old preamble is closed unanswered, and a peer that
//! did shake hands still connects and moves bytes while strangers keep the bound full.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::{Engine, Permissions, TransferOp};
use tensorwire_proto::admission::Limits;
use tensorwire_tcp::wire::{PREAMBLE, TICKET_LEN};
use tensorwire_tcp::{TcpBackend, TcpConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a test waits for what must happen (never a bound the code is held to).
const PATIENCE: Duration = Duration::from_secs(20);

async fn engine(pending: Limits) -> (Engine, Arc<TcpBackend>) {
    let tcp = TcpBackend::new(TcpConfig { pending, ..TcpConfig::default() }).unwrap();
    let e = Engine::builder().backend(tcp.clone()).start().await.unwrap();
    (e, tcp)
}

/// Waits until the server closed `s` (end of stream or reset), and says what it sent first.
async fn closed_by_server(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    let read = async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(PATIENCE, read).await.expect("the server kept a stranger's stream open");
    got
}

/// Whether the server still holds `s` open: nothing to read, and no end either, yet.
async fn still_open(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1];
    tokio::time::timeout(Duration::from_millis(50), s.read(&mut buf)).await.is_err()
}

async fn until(mut cond: impl FnMut() -> bool) {
    tokio::time::timeout(PATIENCE, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("condition never held");
}

#[tokio::test]
async fn silent_and_half_open_streams_are_closed_at_the_deadline() {
    let limits = Limits { pending: 64, per_source: 64, deadline: Duration::from_millis(200) };
    let (_e, tcp) = engine(limits).await;
    let at = tcp.local_addr();
    let mut silent = TcpStream::connect(at).await.unwrap();
    // The attack of the issue: the public preamble, then nothing.
    let mut preamble_only = TcpStream::connect(at).await.unwrap();
    preamble_only.write_all(&PREAMBLE).await.unwrap();
    assert!(closed_by_server(&mut silent).await.is_empty());
    assert!(closed_by_server(&mut preamble_only).await.is_empty(), "answered without a ticket");
    until(|| tcp.pending_streams(None) == 0).await;
}

#[tokio::test]
async fn a_wrong_ticket_or_an_older_preamble_is_closed_unanswered() {
    let (_e, tcp) = engine(Limits::handshake(Duration::from_secs(30))).await;
    let at = tcp.local_addr();
    let mut wrong = TcpStream::connect(at).await.unwrap();
    wrong.write_all(&[&PREAMBLE[..], &[7u8; TICKET_LEN]].concat()).await.unwrap();
    assert!(closed_by_server(&mut wrong).await.is_empty());
    let mut old = PREAMBLE;
    old[6] = 2; // version 2 had no ticket
    let mut v2 = TcpStream::connect(at).await.unwrap();
    v2.write_all(&[&old[..], &[0u8; TICKET_LEN]].concat()).await.unwrap();
    assert!(closed_by_server(&mut v2).await.is_empty());
    assert_eq!(tcp.served_streams(), 0);
}

#[tokio::test]
async fn the_oldest_pending_stream_of_a_full_source_goes() {
    let limits = Limits { pending: 64, per_source: 4, deadline: Duration::from_secs(60) };
    let (_e, tcp) = engine(limits).await;
    let at = tcp.local_addr();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(at).await.unwrap());
    }
    until(|| tcp.pending_streams(None) == 4).await;
    for s in &mut held {
        assert!(still_open(s).await);
    }
    // A fifth from the same source: the first goes, the others stay.
    let _fifth = TcpStream::connect(at).await.unwrap();
    closed_by_server(&mut held[0]).await;
    for s in &mut held[1..] {
        assert!(still_open(s).await);
    }
    assert_eq!(tcp.pending_streams(Some("127.0.0.1".parse().unwrap())), 4);
}

#[tokio::test]
async fn the_listener_bound_holds_across_sources() {
    let limits = Limits { pending: 6, per_source: 4, deadline: Duration::from_secs(60) };
    let (_e, tcp) = engine(limits).await;
    let port = tcp.local_addr().port();
    let mut held = Vec::new();
    // Three sources on loopback (127.0.0.x), three streams each: nine stay within six.
    for src in 1..=3u8 {
        for _ in 0..3 {
            let sock = tokio::net::TcpSocket::new_v4().unwrap();
            sock.bind(SocketAddr::from(([127, 0, 0, 10 + src], 0))).unwrap();
            held.push(sock.connect(SocketAddr::from(([127, 0, 0, 1], port))).await.unwrap());
        }
    }
    until(|| tcp.pending_streams(None) == 6).await;
    // The three oldest (all of the first source) went.
    for s in &mut held[..3] {
        closed_by_server(s).await;
    }
    for s in &mut held[3..] {
        assert!(still_open(s).await);
    }
}

/// A peer that shook hands connects and moves bytes while strangers keep opening idle streams
/// far past the bounds (from its own source address, loopback), about one a millisecond: each
/// new one closes the oldest pending, and the peer's streams prove themselves in between (a
/// stream closed at setup is tried again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_shook_hands_gets_through_a_flood_of_idle_streams() {
    let limits = Limits { pending: 16, per_source: 8, deadline: Duration::from_secs(60) };
    let (b, tcp) = engine(limits).await;
    let at = tcp.local_addr();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut held = std::collections::VecDeque::new();
            let mut opened = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(s) = TcpStream::connect(at).await {
                    held.push_back(s);
                    opened += 1;
                }
                if held.len() > 200 {
                    held.pop_front(); // the client side's own descriptors stay bounded
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            opened
        })
    };
    until(|| tcp.pending_streams(None) == 8).await;
    let a = Engine::builder()
        .backend(TcpBackend::new(TcpConfig::default()).unwrap())
        .start()
        .await
        .unwrap();
    let src = a.alloc(1 << 20, Permissions::NONE).await.unwrap();
    let dst = b.alloc(1 << 20, Permissions::WRITE).await.unwrap();
    src.write_bytes(0, &[0xab; 1 << 20]).unwrap();
    for _ in 0..5 {
        let s = a.connect(b.local_addr()).await.unwrap();
        let op = TransferOp::write(&src, 0, &dst.remote(), 0, 1 << 20);
        tokio::time::timeout(PATIENCE, s.transfer(op)).await.unwrap().unwrap();
        s.close().await;
        assert!(tcp.pending_streams(None) <= 8);
    }
    assert_eq!(dst.to_vec(0, 1 << 20).unwrap(), vec![0xab; 1 << 20]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let opened = flood.await.unwrap();
    assert!(opened > 8, "the flood opened only {opened} streams");
}
