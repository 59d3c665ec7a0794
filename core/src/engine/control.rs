//! The control endpoint: one TCP listener per engine serving the P2P handshake (both sides send a
//! Hello frame carrying their engine descriptor). Every read is bounded in size and time.

use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{EngineShared, lock};
use crate::error::{Error, Result};
use crate::wire::descriptor::EngineDescriptor;
use crate::wire::frame::{FrameHeader, FrameKind, HEADER_LEN, encode_frame};

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

fn expect_hello(kind: FrameKind, payload: &[u8]) -> Result<EngineDescriptor> {
    match kind {
        FrameKind::Hello => EngineDescriptor::decode(payload),
        FrameKind::Reject => Err(Error::AccessDenied(format!(
            "peer refused the handshake: {}",
            String::from_utf8_lossy(payload)
        ))),
    }
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
            match tokio::time::timeout(limit, answer(sock, engine)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::debug!(%peer, %err, "handshake failed"),
                Err(_) => tracing::debug!(%peer, ?limit, "handshake timed out"),
            }
        });
    }
}

async fn answer(mut sock: TcpStream, engine: Weak<EngineShared>) -> Result<()> {
    let (kind, payload) = read_frame(&mut sock).await?;
    let engine = engine.upgrade().ok_or_else(|| Error::PeerClosed("engine dropped".into()))?;
    let peer = match expect_hello(kind, &payload) {
        Ok(p) => p,
        Err(e) => {
            let _ = write_frame(&mut sock, FrameKind::Reject, e.to_string().as_bytes()).await;
            return Err(e);
        }
    };
    let own = engine.descriptor().encode();
    lock(&engine.peers).insert(peer.engine, peer);
    write_frame(&mut sock, FrameKind::Hello, &own).await
}

/// Client side of the handshake, bounded by the engine's handshake timeout.
pub(crate) async fn handshake(
    addr: SocketAddr,
    engine: &Arc<EngineShared>,
) -> Result<EngineDescriptor> {
    let limit = engine.config.handshake_timeout;
    let own = engine.descriptor().encode();
    let run = async {
        let mut sock = TcpStream::connect(addr)
            .await
            .map_err(|e| Error::PeerClosed(format!("cannot reach control endpoint {addr}: {e}")))?;
        sock.set_nodelay(true)?;
        write_frame(&mut sock, FrameKind::Hello, &own).await?;
        let (kind, payload) = read_frame(&mut sock).await?;
        expect_hello(kind, &payload)
    };
    let desc = tokio::time::timeout(limit, run)
        .await
        .map_err(|_| Error::timeout(format!("handshake with {addr}"), limit))??;
    lock(&engine.peers).insert(desc.engine, desc.clone());
    Ok(desc)
}
