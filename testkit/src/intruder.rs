//! A client that does not know the cluster secret and tries anyway, for the "secure by default"
//! tests of every listener (engine control endpoint, store node, orchestrator service): it opens
//! the handshake, ignores the server's proof, sends a made-up proof (or none) and then the
//! protocol's first message, and returns every frame the server sent until it closed. A listener
//! with a secret must answer only with its challenge and a refusal.

use std::net::SocketAddr;
use std::time::Duration;

use tensorwire_proto::auth::{ClusterSecret, Side, Transcript, nonce};
use tensorwire_proto::wire::frame::Framing;
use tensorwire_proto::wire::handshake::{CHALLENGE, Challenge, OPEN, Open, PROOF, Proof, REJECT};

/// How the intruder answers the challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// A proof made with a random key.
    WrongProof,
    /// No proof, as a peer without a secret would send.
    NoProof,
    /// A true proof of this secret (the probe that shows what a member, or a process of the
    /// same user on loopback, gets).
    Proves(ClusterSecret),
}

/// Every frame (kind, payload) `addr` sent to the intruder, which sent `first` after its proof.
pub async fn frames_received(
    addr: SocketAddr,
    framing: &Framing,
    claim: Claim,
    first: (u8, &[u8]),
) -> Vec<(u8, Vec<u8>)> {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("the listener accepts");
    let mine = nonce();
    framing.write(&mut s, OPEN, &Open { nonce: mine }.encode()).await.expect("send Open");
    let mut got = Vec::new();
    if let Some(f) = read(&mut s, framing, addr).await {
        got.push(f);
    }
    let proof = match claim {
        Claim::WrongProof => Some(nonce()),
        Claim::NoProof => None,
        Claim::Proves(k) => {
            let theirs = got.first().and_then(|(_, p)| Challenge::decode(p).ok());
            theirs.map(|ch| {
                let t = Transcript { magic: framing.magic, client: mine, server: ch.nonce };
                k.proof(Side::Client, &t)
            })
        }
    };
    // The server may close as soon as it sees the proof: later writes may fail, which is fine.
    let _ = framing.write(&mut s, PROOF, &Proof { proof }.encode()).await;
    let _ = framing.write(&mut s, first.0, first.1).await;
    while let Some(f) = read(&mut s, framing, addr).await {
        got.push(f);
    }
    got
}

/// The next frame, `None` once the server closed (or broke the framing); a server that does
/// neither within 10 s fails the test.
async fn read(
    s: &mut tokio::net::TcpStream,
    framing: &Framing,
    addr: SocketAddr,
) -> Option<(u8, Vec<u8>)> {
    match tokio::time::timeout(Duration::from_secs(10), framing.read(s)).await {
        Ok(Ok(f)) => f,
        Ok(Err(_)) => None,
        Err(_) => panic!("{} at {addr} neither answered nor closed", framing.name),
    }
}

/// Panics unless `frames` are one challenge and then nothing but refusals, and no payload holds
/// `needle` (a region key, in its wire form).
pub fn assert_refused(what: &str, frames: &[(u8, Vec<u8>)], needle: Option<&[u8]>) {
    assert!(matches!(frames.first(), Some((CHALLENGE, _))), "{what}: no challenge: {frames:?}");
    for (kind, payload) in &frames[1..] {
        assert_eq!(*kind, REJECT, "{what}: an unauthenticated client got frame kind {kind}");
        if let Some(n) = needle {
            assert!(!payload.windows(n.len()).any(|w| w == n), "{what}: a key leaked");
        }
    }
    assert!(frames.len() >= 2, "{what}: closed without a refusal");
}
