//! The control endpoint: one TCP listener per engine serving the P2P handshake. After the
//! authenticated opening (`crate::handshake`) the client sends its descriptor (`Hello`) and the
//! server answers with its own. Every read is bounded in size and time, and an engine with a
//! cluster secret sends its descriptor (which carries region keys) only to a peer that proved it
//! holds the same secret.

use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use tokio::net::{TcpListener, TcpStream};

use super::{EngineShared, lock};
use crate::error::{Error, Result};
use crate::handshake::{self, Handshake, expect};
use crate::wire::descriptor::EngineDescriptor;
use crate::wire::frame::CONTROL;

/// Frame kind of a descriptor.
const HELLO: u8 = 1;

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
    let secret = {
        let e = engine.upgrade().ok_or_else(|| Error::PeerClosed("engine dropped".into()))?;
        e.config.cluster_secret.clone()
    };
    Handshake { framing: &CONTROL, secret: secret.as_ref(), peer: addr }.server(&mut sock).await?;
    let theirs = match EngineDescriptor::decode(&expect(&mut sock, &CONTROL, HELLO).await?) {
        Ok(d) => d,
        Err(e) => return handshake::refuse(&mut sock, &CONTROL, e).await,
    };
    let engine = engine.upgrade().ok_or_else(|| Error::PeerClosed("engine dropped".into()))?;
    let own = engine.descriptor().encode();
    lock(&engine.peers).insert(theirs.engine, theirs);
    CONTROL.write(&mut sock, HELLO, &own).await
}

async fn dial(addr: SocketAddr, engine: &Arc<EngineShared>) -> Result<EngineDescriptor> {
    let mut sock = TcpStream::connect(addr)
        .await
        .map_err(|e| Error::PeerClosed(format!("cannot reach control endpoint {addr}: {e}")))?;
    sock.set_nodelay(true)?;
    let secret = engine.config.cluster_secret.as_ref();
    Handshake { framing: &CONTROL, secret, peer: addr }.client(&mut sock).await?;
    CONTROL.write(&mut sock, HELLO, &engine.descriptor().encode()).await?;
    EngineDescriptor::decode(&expect(&mut sock, &CONTROL, HELLO).await?)
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
