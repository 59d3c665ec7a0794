//! The control endpoint: one TCP listener per engine serving the P2P handshake (see
//! `wire::handshake` for the message sequence). Every read is bounded in size and time, and an engine
//! with a cluster secret sends its descriptor only to a peer that proved it holds the same secret.

use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{EngineShared, lock};
use crate::auth;
use crate::error::{Error, Result};
use crate::wire::descriptor::EngineDescriptor;
use crate::wire::frame::{FrameHeader, FrameKind, HEADER_LEN, encode_frame};
use crate::wire::handshake::{Challenge, Hello, Open};

pub(crate) async fn read_frame(sock: &mut TcpStream) -> Result<(FrameKind, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    sock.read_exact(&mut h).await?;
    let header = FrameHeader::decode(&h)?;
    let mut payload = vec![0u8; header.len as usize];
    sock.read_exact(&mut payload).await?;
    Ok((header.kind, payload))
}

pub(crate) async fn write_frame(
    sock: &mut TcpStream,
    kind: FrameKind,
    payload: &[u8],
) -> Result<()> {
    sock.write_all(&encode_frame(kind, payload)?).await?;
    sock.flush().await?;
    Ok(())
}

/// Reads a frame that must be `want`; a `Reject` becomes `AccessDenied` with the peer's reason.
async fn expect(sock: &mut TcpStream, want: FrameKind) -> Result<Vec<u8>> {
    let (kind, payload) = read_frame(sock).await?;
    if kind == want {
        return Ok(payload);
    }
    Err(match kind {
        FrameKind::Reject => Error::AccessDenied(format!(
            "peer refused the handshake: {}",
            String::from_utf8_lossy(&payload)
        )),
        other => Error::protocol(format!("handshake: expected {want:?}, got {other:?}")),
    })
}

/// Sends a `Reject` with the error's text (best effort) and returns the error.
async fn refuse<T>(sock: &mut TcpStream, e: Error) -> Result<T> {
    let _ = write_frame(sock, FrameKind::Reject, e.to_string().as_bytes()).await;
    Err(e)
}

/// Accept loop; holds the engine weakly and ends when the engine is gone.
pub(crate) async fn serve(listener: TcpListener, engine: Weak<EngineShared>) {
    loop {
        let Ok((sock, peer)) = listener.accept().await else {
            continue;
        };
        let Some(e) = engine.upgrade() else { return };
        let limit = e.config.handshake_timeout;
        drop(e);
        let engine = engine.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(limit, answer(sock, peer, engine)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::warn!(%peer, %err, "handshake refused"),
                Err(_) => tracing::debug!(%peer, ?limit, "handshake timed out"),
            }
        });
    }
}

async fn answer(mut sock: TcpStream, addr: SocketAddr, engine: Weak<EngineShared>) -> Result<()> {
    let open = Open::decode(&expect(&mut sock, FrameKind::Open).await?);
    let open = match open {
        Ok(o) => o,
        Err(e) => return refuse(&mut sock, e).await,
    };
    let engine = engine.upgrade().ok_or_else(|| Error::PeerClosed("engine dropped".into()))?;
    let secret = engine.config.cluster_secret.clone();
    let nonce = auth::nonce();
    let proof = secret.as_ref().map(|s| s.server_proof(&open.nonce, &nonce));
    write_frame(&mut sock, FrameKind::Challenge, &Challenge { nonce, proof }.encode()).await?;
    let hello = match Hello::decode(&expect(&mut sock, FrameKind::Hello).await?) {
        Ok(h) => h,
        Err(e) => return refuse(&mut sock, e).await,
    };
    match (&secret, hello.proof) {
        (Some(s), Some(p)) if s.verify_client(&nonce, &open.nonce, &p) => {}
        (Some(_), _) => {
            let e = Error::AccessDenied(format!(
                "peer {addr} ({}) did not prove the cluster secret",
                hello.descriptor.engine
            ));
            return refuse(&mut sock, e).await;
        }
        (None, _) => tracing::warn!(
            %addr,
            peer = %hello.descriptor.engine,
            "accepting an unauthenticated peer: no cluster secret is configured"
        ),
    }
    let own = Hello { proof: None, descriptor: engine.descriptor() }.encode();
    lock(&engine.peers).insert(hello.descriptor.engine, hello.descriptor);
    write_frame(&mut sock, FrameKind::Hello, &own).await
}

async fn dial(addr: SocketAddr, engine: &Arc<EngineShared>) -> Result<EngineDescriptor> {
    let mut sock = TcpStream::connect(addr)
        .await
        .map_err(|e| Error::PeerClosed(format!("cannot reach control endpoint {addr}: {e}")))?;
    sock.set_nodelay(true)?;
    let nonce = auth::nonce();
    write_frame(&mut sock, FrameKind::Open, &Open { nonce }.encode()).await?;
    let ch = Challenge::decode(&expect(&mut sock, FrameKind::Challenge).await?)?;
    let proof = match (&engine.config.cluster_secret, ch.proof) {
        (Some(s), Some(p)) if s.verify_server(&nonce, &ch.nonce, &p) => {
            Some(s.client_proof(&ch.nonce, &nonce))
        }
        (Some(_), Some(_)) => {
            let e = Error::AccessDenied(format!(
                "peer {addr} failed authentication: wrong cluster secret"
            ));
            return refuse(&mut sock, e).await;
        }
        (Some(_), None) => {
            let e = Error::AccessDenied(format!(
                "peer {addr} has no cluster secret; refusing an unauthenticated peer"
            ));
            return refuse(&mut sock, e).await;
        }
        (None, Some(_)) => {
            let e = Error::AccessDenied(format!(
                "peer {addr} requires a cluster secret, and this engine has none configured"
            ));
            return refuse(&mut sock, e).await;
        }
        (None, None) => {
            tracing::warn!(%addr, "connecting to an unauthenticated peer: no cluster secret is configured");
            None
        }
    };
    let own = Hello { proof, descriptor: engine.descriptor() }.encode();
    write_frame(&mut sock, FrameKind::Hello, &own).await?;
    Ok(Hello::decode(&expect(&mut sock, FrameKind::Hello).await?)?.descriptor)
}

/// Client side of the handshake, bounded by the engine's handshake timeout.
pub(crate) async fn handshake(
    addr: SocketAddr,
    engine: &Arc<EngineShared>,
) -> Result<EngineDescriptor> {
    let limit = engine.config.handshake_timeout;
    let desc = tokio::time::timeout(limit, dial(addr, engine))
        .await
        .map_err(|_| Error::timeout(format!("handshake with {addr}"), limit))??;
    lock(&engine.peers).insert(desc.engine, desc.clone());
    Ok(desc)
}
