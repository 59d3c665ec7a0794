//! The authenticated handshake every framed protocol opens with (engine control endpoint, store
//! RPC, orchestrator service), written once. With a cluster secret both sides prove they hold it
//! (HMAC challenge in both directions, see [`crate::auth`]) before either sends anything else:
//! the server proves itself in its `Challenge`, and the client checks that proof before it sends
//! its own proof and, after it, its first protocol message. Without a secret on both sides the
//! handshake still runs (same messages, no proofs) and each side logs that its peer is
//! unauthenticated (a warning for a peer on another host); a secret on one side only is refused
//! with a message saying which.
//!
//! **Loopback.** A side with no secret whose peer is on loopback (127.0.0.0/8, `::1`, or
//! either mapped into IPv6) uses this user's loopback secret instead
//! ([`crate::loopback_secret`]): every process of one user proves it, and a process of
//! another user on the same host is refused. Peers on other hosts without a secret (only an
//! explicitly `insecure` listener admits them) still run unauthenticated.
//!
//! [`Handshake::client`] returns once the client's proof is on its way: the client then sends its
//! first message at once (no extra round trip); a server that refuses the proof answers that
//! message with a `Reject`, which [`expect`] turns into [`Error::AccessDenied`] with the server's
//! reason.

use std::net::SocketAddr;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::auth::{ClusterSecret, Side, Transcript, nonce};
use crate::error::{Error, Result};
use crate::wire::frame::Framing;
use crate::wire::handshake::{CHALLENGE, Challenge, OPEN, Open, PROOF, Proof, REJECT};

/// A byte stream a framed protocol runs on.
pub trait Stream: AsyncRead + AsyncWrite + Unpin {}
impl<S: AsyncRead + AsyncWrite + Unpin + ?Sized> Stream for S {}

/// Reads the next frame of `framing` and requires kind `want`; a `Reject` becomes
/// [`Error::AccessDenied`] with the peer's reason, and an end of stream [`Error::PeerClosed`].
pub async fn expect(
    r: &mut (impl AsyncRead + Unpin + ?Sized),
    framing: &Framing,
    want: u8,
) -> Result<Vec<u8>> {
    match framing.read(r).await? {
        Some((k, payload)) if k == want => Ok(payload),
        Some((REJECT, reason)) => Err(Error::AccessDenied(format!(
            "{} peer refused: {}",
            framing.name,
            String::from_utf8_lossy(&reason)
        ))),
        Some((k, _)) => {
            Err(Error::protocol(format!("{}: expected frame kind {want}, got {k}", framing.name)))
        }
        None => Err(Error::PeerClosed(format!("{}: peer closed the connection", framing.name))),
    }
}

/// Sends a `Reject` with `e`'s text (best effort) and returns `e`.
pub async fn refuse<T>(
    w: &mut (impl AsyncWrite + Unpin + ?Sized),
    framing: &Framing,
    e: Error,
) -> Result<T> {
    let _ = framing.write(w, REJECT, e.to_string().as_bytes()).await;
    Err(e)
}

/// One side's handshake: the protocol, the cluster secret (if any) and the peer's address.
#[derive(Debug, Clone, Copy)]
pub struct Handshake<'a> {
    /// The protocol.
    pub framing: &'a Framing,
    /// The cluster secret; `None` runs the handshake unauthenticated (and warns).
    pub secret: Option<&'a ClusterSecret>,
    /// The peer, for messages.
    pub peer: SocketAddr,
}

/// Whether `peer` is on this host's loopback (IPv4-mapped IPv6 included: a dual-stack
/// listener sees an IPv4 loopback client as `::ffff:127.0.0.1`).
pub fn is_loopback(peer: SocketAddr) -> bool {
    match peer.ip() {
        std::net::IpAddr::V4(v4) => v4.is_loopback(),
        std::net::IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

impl Handshake<'_> {
    /// The secret this side proves: the configured one, else the loopback secret for a peer on
    /// loopback, else none.
    fn secret(&self) -> Result<Option<ClusterSecret>> {
        match self.secret {
            Some(k) => Ok(Some(k.clone())),
            None if is_loopback(self.peer) => crate::loopback_secret::loopback_secret().map(Some),
            None => Ok(None),
        }
    }

    /// The client side: sends `Open`, checks the server's `Challenge`, sends `Proof`. The caller
    /// bounds it with its handshake timeout.
    pub async fn client(&self, s: &mut (impl Stream + ?Sized)) -> Result<()> {
        let (framing, name, peer) = (self.framing, self.framing.name, self.peer);
        let secret = self.secret()?;
        let mine = nonce();
        framing.write(s, OPEN, &Open { nonce: mine }.encode()).await?;
        let ch = Challenge::decode(&expect(s, framing, CHALLENGE).await?)?;
        let t = Transcript { magic: framing.magic, client: mine, server: ch.nonce };
        let refusal = match (secret.as_ref(), ch.proof) {
            (Some(k), Some(p)) if k.verify(Side::Server, &t, &p) => None,
            (Some(_), Some(_)) => Some("failed authentication: wrong cluster secret"),
            (Some(_), None) => Some("has no cluster secret; refusing an unauthenticated peer"),
            (None, Some(_)) => Some("requires a cluster secret, and none is configured here"),
            (None, None) => {
                unauthenticated(peer, name, "talking to");
                None
            }
        };
        if let Some(why) = refusal {
            return refuse(s, framing, Error::AccessDenied(format!("{name} peer {peer} {why}")))
                .await;
        }
        let proof = secret.map(|k| k.proof(Side::Client, &t));
        framing.write(s, PROOF, &Proof { proof }.encode()).await
    }

    /// The server side: answers `Open` with a `Challenge` and checks the client's `Proof`; a
    /// client that fails gets a `Reject` and the error is returned. The caller bounds it with
    /// its handshake timeout.
    pub async fn server(&self, s: &mut (impl Stream + ?Sized)) -> Result<()> {
        let (framing, peer) = (self.framing, self.peer);
        let secret = self.secret()?;
        let open = match Open::decode(&expect(s, framing, OPEN).await?) {
            Ok(o) => o,
            Err(e) => return refuse(s, framing, e).await,
        };
        let t = Transcript { magic: framing.magic, client: open.nonce, server: nonce() };
        let proof = secret.as_ref().map(|k| k.proof(Side::Server, &t));
        framing.write(s, CHALLENGE, &Challenge { nonce: t.server, proof }.encode()).await?;
        let theirs = match Proof::decode(&expect(s, framing, PROOF).await?) {
            Ok(p) => p.proof,
            Err(e) => return refuse(s, framing, e).await,
        };
        match (secret, theirs) {
            (Some(k), Some(p)) if k.verify(Side::Client, &t, &p) => Ok(()),
            (Some(_), _) => {
                let e = Error::AccessDenied(format!(
                    "{} peer {peer} did not prove the cluster secret",
                    framing.name
                ));
                refuse(s, framing, e).await
            }
            (None, _) => {
                unauthenticated(peer, framing.name, "accepted");
                Ok(())
            }
        }
    }
}

/// Logs an unauthenticated peer: a warning when it is on another host (only an explicitly
/// insecure endpoint gets there, see [`crate::auth::check_listener`]), a debug line on loopback.
fn unauthenticated(peer: SocketAddr, protocol: &str, what: &str) {
    if crate::auth::is_exposed(peer) {
        tracing::warn!(%peer, protocol, "{what} an unauthenticated peer: no cluster secret");
    } else {
        tracing::debug!(%peer, protocol, "{what} an unauthenticated local peer");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::frame::CONTROL;

    const LOOPBACK: &str = "127.0.0.1:1";
    const REMOTE: &str = "10.9.8.7:1";

    async fn run(a: Option<&[u8]>, b: Option<&[u8]>, peer: &str) -> (Result<()>, Result<()>) {
        let (mut c, mut s) = tokio::io::duplex(4096);
        let (ka, kb) = (a.map(ClusterSecret::new), b.map(ClusterSecret::new));
        let peer: SocketAddr = peer.parse().unwrap();
        let client = async {
            Handshake { framing: &CONTROL, secret: ka.as_ref(), peer }.client(&mut c).await?;
            // The protocol's first message, answered by the server if it accepted the proof.
            CONTROL.write(&mut c, 1, b"hello").await?;
            expect(&mut c, &CONTROL, 1).await.map(drop)
        };
        let server = async {
            Handshake { framing: &CONTROL, secret: kb.as_ref(), peer }.server(&mut s).await?;
            expect(&mut s, &CONTROL, 1).await?;
            CONTROL.write(&mut s, 1, b"welcome").await
        };
        tokio::join!(client, server)
    }

    #[tokio::test]
    async fn both_sides_prove_the_same_secret() {
        for peer in [LOOPBACK, REMOTE] {
            let (c, s) = run(Some(b"k"), Some(b"k"), peer).await;
            c.unwrap();
            s.unwrap();
            let (c, s) = run(None, None, peer).await;
            c.unwrap();
            s.unwrap();
        }
    }

    #[tokio::test]
    async fn a_wrong_or_missing_secret_is_refused_with_its_reason() {
        let (c, s) = run(Some(b"k"), Some(b"other"), REMOTE).await;
        assert!(c.unwrap_err().to_string().contains("wrong cluster secret"));
        assert!(matches!(s, Err(Error::AccessDenied(_)) | Err(Error::PeerClosed(_))), "{s:?}");
        let (c, _) = run(None, Some(b"k"), REMOTE).await;
        assert!(c.unwrap_err().to_string().contains("requires a cluster secret"));
        let (c, _) = run(Some(b"k"), None, REMOTE).await;
        assert!(c.unwrap_err().to_string().contains("has no cluster secret"));
    }

    /// On loopback a side without a secret proves this user's loopback secret: a peer that
    /// holds another secret (a process of another user, whose loopback secret differs) is
    /// refused both ways, where on another host the same pair would be refused only for the
    /// missing secret.
    #[tokio::test]
    async fn on_loopback_no_secret_means_the_users_own() {
        let mine = crate::loopback_secret::loopback_secret().unwrap();
        let (mut c, mut s) = tokio::io::duplex(4096);
        let peer: SocketAddr = LOOPBACK.parse().unwrap();
        let server = async {
            Handshake { framing: &CONTROL, secret: None, peer }.server(&mut s).await?;
            expect(&mut s, &CONTROL, 1).await.map(drop)
        };
        let client = async {
            // A client that checks the server's proof against the loopback secret itself.
            Handshake { framing: &CONTROL, secret: Some(&mine), peer }.client(&mut c).await?;
            CONTROL.write(&mut c, 1, b"hello").await
        };
        let (s, c) = tokio::join!(server, client);
        c.unwrap();
        s.unwrap();
        let other: &[u8] = b"another user's loopback secret";
        let (c, s) = run(Some(other), None, LOOPBACK).await;
        assert!(c.unwrap_err().to_string().contains("wrong cluster secret"));
        assert!(s.is_err());
        let (c, s) = run(None, Some(other), LOOPBACK).await;
        assert!(c.unwrap_err().to_string().contains("wrong cluster secret"));
        assert!(s.is_err());
    }

    #[test]
    fn loopback_includes_mapped_addresses() {
        for a in ["127.0.0.1:1", "127.8.9.1:1", "[::1]:1", "[::ffff:127.0.0.1]:1"] {
            assert!(is_loopback(a.parse().unwrap()), "{a}");
        }
        for a in ["10.0.0.1:1", "[::ffff:10.0.0.1]:1", "[fe80::1]:1", "0.0.0.0:1"] {
            assert!(!is_loopback(a.parse().unwrap()), "{a}");
        }
    }
}
