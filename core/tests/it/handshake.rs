//! Handshake authentication and robustness of the control endpoint.
#![cfg(not(loom))] // the loom build has only the sans-IO pieces

use std::time::Duration;

use tensorwire_core::{
    ClusterSecret, Engine, EngineConfig, EngineDescriptor, Error, Missing, Permissions, TransferOp,
};
use tensorwire_proto::auth::{AUTH_LEN, Side, Transcript};
use tensorwire_proto::handshake::expect;
use tensorwire_proto::wire::frame::{CONTROL, FrameHeader};
use tensorwire_proto::wire::handshake::{CHALLENGE, Challenge, OPEN, Open, PROOF, Proof};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn engine(secret: Option<&[u8]>) -> Engine {
    let config = EngineConfig {
        cluster_secret: secret.map(ClusterSecret::new),
        handshake_timeout: Duration::from_secs(2),
        ..EngineConfig::default()
    };
    Engine::builder()
        .backend(tensorwire_core::backend::MemBackend::new())
        .config(config)
        .start()
        .await
        .unwrap()
}

#[tokio::test]
async fn same_secret_connects_and_moves_bytes() {
    let (a, b) = (engine(Some(b"s3cret")).await, engine(Some(b"s3cret")).await);
    let s = a.connect(b.local_addr()).await.unwrap();
    let src = a.alloc(16, Permissions::NONE).await.unwrap();
    src.write_bytes(0, b"authenticated!!!").unwrap();
    let dst = b.alloc(16, Permissions::WRITE).await.unwrap();
    s.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, 16)).await.unwrap();
    assert_eq!(dst.to_vec(0, 16).unwrap(), b"authenticated!!!");
    assert!(b.session(a.id()).is_ok(), "the server knows the authenticated client");
}

#[tokio::test]
async fn wrong_secret_is_refused_both_ways_and_learns_nothing() {
    let (a, b) = (engine(Some(b"right")).await, engine(Some(b"wrong")).await);
    let _visible = b.alloc(64, Permissions::READ_WRITE).await.unwrap();
    let e = a.connect(b.local_addr()).await.unwrap_err();
    assert!(matches!(e, Error::AccessDenied(_)), "{e}");
    assert!(matches!(b.session(a.id()), Err(Error::NotFound(Missing::Peer(_)))));
    assert!(matches!(a.session(b.id()), Err(Error::NotFound(Missing::Peer(_)))));
    let e = b.connect(a.local_addr()).await.unwrap_err();
    assert!(matches!(e, Error::AccessDenied(_)), "{e}");
}

/// On loopback an engine without a secret proves this user's loopback secret, so an engine
/// with another secret (a cluster's, or another user's loopback secret) refuses it both ways.
/// (Between hosts the same pair is refused for the secret on one side only: the proto crate's
/// handshake tests.)
#[tokio::test]
async fn a_secret_on_one_side_only_is_refused() {
    let (with, without) = (engine(Some(b"k")).await, engine(None).await);
    let e = without.connect(with.local_addr()).await.unwrap_err();
    assert!(e.to_string().contains("wrong cluster secret"), "{e}");
    let e = with.connect(without.local_addr()).await.unwrap_err();
    assert!(e.to_string().contains("wrong cluster secret"), "{e}");
    assert!(matches!(with.session(without.id()), Err(Error::NotFound(_))));
}

/// The loopback default: engines with no secret prove the user's loopback secret (an honest
/// hand client proving it gets in), and a client that knows the port but not the secret (what
/// another local user is) gets a refusal, never the descriptor with its region keys.
#[tokio::test]
async fn on_loopback_a_stranger_without_the_users_secret_learns_nothing() {
    let b = engine(None).await;
    let _visible = b.alloc(64, Permissions::READ_WRITE).await.unwrap();
    let x = engine(None).await;
    let hello = x.descriptor().encode();
    let mine = tensorwire_proto::loopback_secret::loopback_secret().unwrap();
    let honest: Cheat = |k, t, _| Some(k.proof(Side::Client, t));
    let theirs = hand_client(&b, &mine, honest, &hello).await.unwrap();
    assert_eq!(EngineDescriptor::decode(&theirs).unwrap().engine, b.id());
    let other_user = ClusterSecret::new(b"another user's loopback secret");
    let y = engine(None).await;
    let e = hand_client(&b, &other_user, honest, &y.descriptor().encode()).await.unwrap_err();
    assert!(matches!(e, Error::AccessDenied(_)), "{e}");
    let e = hand_client(&b, &mine, |_, _, _| None, &y.descriptor().encode()).await.unwrap_err();
    assert!(matches!(e, Error::AccessDenied(_)), "no proof: {e}");
    assert!(matches!(b.session(y.id()), Err(Error::NotFound(_))));
}

fn fake_descriptor(id: u128, pad: usize) -> EngineDescriptor {
    let blob = bytes::Bytes::from(vec![7u8; 4096]);
    EngineDescriptor {
        engine: tensorwire_core::EngineId(id),
        host: "h".into(),
        backends: (0..pad.div_ceil(4096).min(16))
            .map(|i| (format!("b{i}"), blob.clone()))
            .collect(),
        regions: vec![],
    }
}

/// A peer's descriptor larger than the engine's bound is refused at the handshake, and what the
/// engine keeps of its peers stays within its bounds however many shake hands (the least
/// recently used go; a closed session takes its peer's descriptor with it).
#[tokio::test]
async fn descriptors_are_bounded_in_size_and_in_number() {
    let config = EngineConfig {
        max_peer_descriptor: 32 << 10,
        max_peers: 8,
        max_peer_bytes: 1 << 20,
        ..EngineConfig::default()
    };
    let b = Engine::builder()
        .backend(tensorwire_core::backend::MemBackend::new())
        .config(config)
        .start()
        .await
        .unwrap();
    let mine = tensorwire_proto::loopback_secret::loopback_secret().unwrap();
    let honest: Cheat = |k, t, _| Some(k.proof(Side::Client, t));
    let big = fake_descriptor(1, 64 << 10).encode();
    let e = hand_client(&b, &mine, honest, &big).await.unwrap_err();
    assert!(e.to_string().contains("max_peer_descriptor"), "{e}");
    assert_eq!(b.known_peers().0, 0);
    for id in 100..300u128 {
        hand_client(&b, &mine, honest, &fake_descriptor(id, 20 << 10).encode()).await.unwrap();
        let (n, bytes) = b.known_peers();
        assert!(n <= 8 && bytes <= 1 << 20, "{n} peers, {bytes} bytes");
    }
    assert!(matches!(b.session(tensorwire_core::EngineId(100)), Err(Error::NotFound(_))));
    assert!(b.session(tensorwire_core::EngineId(299)).is_ok());
    // A real peer's session closed takes its descriptor along.
    let a = engine(None).await;
    a.connect(b.local_addr()).await.unwrap();
    let s = b.session(a.id()).unwrap();
    s.close().await;
    let e = b.session(a.id()).unwrap_err();
    assert!(matches!(e, Error::NotFound(Missing::Peer(_))), "{e}");
}

#[tokio::test]
async fn no_secret_accepts_any_peer() {
    let (a, b) = (engine(None).await, engine(None).await);
    let s = a.connect(b.local_addr()).await.unwrap();
    assert_eq!(s.peer(), b.id());
}

#[tokio::test]
async fn garbage_and_silent_clients_do_not_hurt_the_endpoint() {
    let b = engine(Some(b"k")).await;
    // Garbage: refused or closed, never a crash.
    let mut junk = tokio::net::TcpStream::connect(b.local_addr()).await.unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), junk.read_to_end(&mut buf)).await.unwrap();
    // An oversized frame header (this build's prefix, so the length check is what refuses it).
    let mut big = tokio::net::TcpStream::connect(b.local_addr()).await.unwrap();
    let oversized = FrameHeader { kind: 3, len: 0x7fff_ffff };
    big.write_all(&CONTROL.header(oversized)).await.unwrap();
    // A client that says nothing is dropped after the handshake timeout.
    let mut silent = tokio::net::TcpStream::connect(b.local_addr()).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut [0u8; 1])).await;
    assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "silent client not dropped: {n:?}");
    // A real peer still gets in.
    let a = engine(Some(b"k")).await;
    a.connect(b.local_addr()).await.unwrap();
}

/// One way a client that starts right (its own nonce, the server's `Challenge` read) may cheat
/// on its proof, given the transcript and the server's challenge.
type Cheat = fn(&ClusterSecret, &Transcript, &Challenge) -> Option<[u8; AUTH_LEN]>;

/// Runs the client side of the control handshake by hand with `prove` for its proof, then sends
/// `hello` (an engine's descriptor) as its first message: the server's answer.
async fn hand_client(
    b: &Engine,
    k: &ClusterSecret,
    prove: Cheat,
    hello: &[u8],
) -> Result<Vec<u8>, Error> {
    let mut s = tokio::net::TcpStream::connect(b.local_addr()).await.unwrap();
    let mine: [u8; AUTH_LEN] = std::array::from_fn(|i| i as u8 ^ 0x5a);
    CONTROL.write(&mut s, OPEN, &Open { nonce: mine }.encode()).await.unwrap();
    let ch = Challenge::decode(&expect(&mut s, &CONTROL, CHALLENGE).await.unwrap()).unwrap();
    let t = Transcript { magic: CONTROL.magic, client: mine, server: ch.nonce };
    CONTROL.write(&mut s, PROOF, &Proof { proof: prove(k, &t, &ch) }.encode()).await.unwrap();
    let _ = CONTROL.write(&mut s, 1, hello).await; // HELLO: the client's descriptor
    tokio::time::timeout(Duration::from_secs(5), expect(&mut s, &CONTROL, 1)).await.unwrap()
}

/// A client that opens right and cheats on its proof is refused: its first message is answered
/// with a `Reject`, never with the server's descriptor (which carries region keys), and the
/// server does not know it as a peer. The same steps with an honest proof get in.
#[tokio::test]
async fn a_client_that_cheats_on_its_proof_is_refused() {
    let b = engine(Some(b"s3cret")).await;
    let _visible = b.alloc(64, Permissions::READ_WRITE).await.unwrap();
    let x = engine(Some(b"s3cret")).await; // the engine the cheater claims to be
    let hello = x.descriptor().encode();
    let k = ClusterSecret::new(b"s3cret");
    let cheats: [(&str, Cheat); 7] = [
        ("no proof", |_, _, _| None),
        ("zeros", |_, _, _| Some([0; AUTH_LEN])),
        ("the server's own proof sent back", |_, _, ch| ch.proof),
        ("the secret, proving the server's side", |k, t, _| Some(k.proof(Side::Server, t))),
        ("the secret over another client nonce", |k, t, _| {
            let replayed = Transcript { client: [9; AUTH_LEN], ..*t };
            Some(k.proof(Side::Client, &replayed))
        }),
        ("the secret over another protocol", |k, t, _| {
            Some(k.proof(Side::Client, &Transcript { magic: *b"TR", ..*t }))
        }),
        ("another secret", |_, t, _| Some(ClusterSecret::new(b"guess").proof(Side::Client, t))),
    ];
    for (what, cheat) in cheats {
        let e = hand_client(&b, &k, cheat, &hello).await.unwrap_err();
        assert!(matches!(e, Error::AccessDenied(_)), "{what}: {e}");
        assert!(
            matches!(b.session(x.id()), Err(Error::NotFound(Missing::Peer(_)))),
            "{what}: the server took the cheater's descriptor"
        );
    }
    let honest: Cheat = |k, t, _| Some(k.proof(Side::Client, t));
    let theirs = hand_client(&b, &k, honest, &hello).await.unwrap();
    assert_eq!(EngineDescriptor::decode(&theirs).unwrap().engine, b.id());
    assert!(b.session(x.id()).is_ok(), "the honest client is a peer");
}

#[tokio::test]
async fn unreachable_address_is_peer_closed() {
    let a = engine(None).await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let e = a.connect(dead).await.unwrap_err();
    assert!(matches!(e, Error::PeerClosed(_)), "{e}");
}

#[tokio::test]
async fn the_control_address_is_free_once_shutdown_returns() {
    let e = engine(None).await;
    let addr = e.local_addr();
    let s = engine(None).await.connect(addr).await.unwrap(); // the listener has served a client
    drop(s);
    e.shutdown().await;
    let again = std::net::TcpListener::bind(addr);
    assert!(again.is_ok(), "{addr} still taken after shutdown: {:?}", again.err());
}

/// The control endpoint under strangers that keep opening idle connections (about one a
/// millisecond, holding up to 300: past its bound of 64 pending per source): each newcomer
/// closes the oldest pending one, and a peer still shakes hands, every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_shakes_hands_through_a_flood_of_idle_connections() {
    let b = engine(None).await;
    let at = b.local_addr();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut held = std::collections::VecDeque::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(s) = tokio::net::TcpStream::connect(at).await {
                    held.push_back(s);
                }
                if held.len() > 300 {
                    held.pop_front();
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            held.len()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await; // the bound is full by now
    let a = engine(None).await;
    for _ in 0..10 {
        let s = a.connect(at).await.unwrap();
        assert_eq!(s.peer(), b.id());
        s.close().await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(flood.await.unwrap() > 64, "the flood held too few connections to fill the bound");
}
