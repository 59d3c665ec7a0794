//! The control endpoint: one TCP listener per engine serving the P2P handshake. After the
//! authenticated opening (`tensorwire_proto::handshake`) the client sends its descriptor
//! (`Hello`) and the server answers with its own. Every read is bounded in size and time, and an
//! engine with a cluster secret (or, for a peer on loopback, the user's loopback secret) sends
//! its descriptor (which carries region keys) only to a peer that proved it holds the same.
//!
//! What a peer can hold here: a connection is pending until its handshake ends, bounded by the
//! handshake timeout and in number (`tensorwire_proto::admission`: the oldest pending goes when
//! a source or the listener is full), and the descriptor it leaves behind is bounded in size
//! ([`super::EngineConfig::max_peer_descriptor`]) and kept in a bounded table
//! ([`super::peers`]).

use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use tensorwire_proto::admission::{Admission, Limits};
use tensorwire_proto::handshake::{self, Handshake, expect};
use tensorwire_proto::wire::frame::CONTROL;
use tokio::net::{TcpListener, TcpStream};

use super::{EngineShared, lock};
use crate::error::{Error, Result};
use crate::wire::descriptor::EngineDescriptor;

/// Frame kind of a descriptor.
const HELLO: u8 = 1;

/// Accept loop; holds the engine weakly and ends when the engine is gone.
pub(crate) async fn serve(listener: TcpListener, engine: Weak<EngineShared>) {
    let limit = match engine.upgrade() {
        Some(e) => e.config.handshake_timeout,
        None => return,
    };
    let admission = Admission::new("engine control endpoint", Limits::handshake(limit));
    loop {
        let (sock, peer) = tensorwire_proto::accept::accept(&listener, "engine control").await;
        if engine.strong_count() == 0 {
            return;
        }
        let mut pending = admission.admit(peer.ip());
        let engine = engine.clone();
        tokio::spawn(async move {
            match pending.prove(answer(sock, peer, engine)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::warn!(%peer, %err, "handshake refused"),
                Err(closed) => tracing::debug!(%peer, ?closed, "handshake ended unfinished"),
            }
        });
        // Let the connections just accepted run their handshakes before more are accepted.
        tokio::task::yield_now().await;
    }
}

/// The peer's descriptor from a `Hello`, refused when larger than the engine allows.
fn descriptor_of(payload: &[u8], engine: &EngineShared) -> Result<EngineDescriptor> {
    let max = engine.config.max_peer_descriptor;
    if payload.len() > max {
        return Err(Error::protocol(format!(
            "a peer's descriptor of {} bytes exceeds this engine's bound of {max} \
             (EngineConfig::max_peer_descriptor)",
            payload.len()
        )));
    }
    EngineDescriptor::decode(payload)
}

async fn answer(mut sock: TcpStream, addr: SocketAddr, engine: Weak<EngineShared>) -> Result<()> {
    let dropped = || Error::PeerClosed("engine dropped".into());
    let secret = engine.upgrade().ok_or_else(dropped)?.config.cluster_secret.clone();
    Handshake { framing: &CONTROL, secret: secret.as_ref(), peer: addr }.server(&mut sock).await?;
    let hello = expect(&mut sock, &CONTROL, HELLO).await?;
    let engine = engine.upgrade().ok_or_else(dropped)?;
    let theirs = match descriptor_of(&hello, &engine) {
        Ok(d) => d,
        Err(e) => return handshake::refuse(&mut sock, &CONTROL, e).await,
    };
    let own = engine.descriptor().encode();
    lock(&engine.peers).insert(theirs, hello.len());
    CONTROL.write(&mut sock, HELLO, &own).await
}

async fn connect(addr: SocketAddr) -> Result<TcpStream> {
    let sock = TcpStream::connect(addr)
        .await
        .map_err(|e| Error::PeerClosed(format!("cannot reach control endpoint {addr}: {e}")))?;
    sock.set_nodelay(true)?;
    Ok(sock)
}

async fn exchange(
    mut sock: TcpStream,
    addr: SocketAddr,
    engine: &Arc<EngineShared>,
) -> Result<(EngineDescriptor, usize)> {
    let secret = engine.config.cluster_secret.as_ref();
    Handshake { framing: &CONTROL, secret, peer: addr }.client(&mut sock).await?;
    CONTROL.write(&mut sock, HELLO, &engine.descriptor().encode()).await?;
    let hello = expect(&mut sock, &CONTROL, HELLO).await?;
    Ok((descriptor_of(&hello, engine)?, hello.len()))
}

/// Dials and shakes hands; dials again (twice at most, after 5 and 20 ms) when the peer closed
/// the connection during the handshake: a listener at its bound of pending connections closes
/// its oldest one to admit a newcomer, so under a flood of strangers' connections a peer's may
/// go before it proved itself. Any other failure (one to connect included) is returned at once.
async fn dial(addr: SocketAddr, engine: &Arc<EngineShared>) -> Result<(EngineDescriptor, usize)> {
    for pause in [5, 20] {
        match exchange(connect(addr).await?, addr, engine).await {
            Err(Error::PeerClosed(why)) => {
                tracing::debug!(%addr, %why, "handshake: the peer closed; dialing again");
            }
            other => return other,
        }
        tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
    }
    exchange(connect(addr).await?, addr, engine).await
}

/// Client side of the handshake, bounded by the engine's handshake timeout.
pub(crate) async fn handshake(
    addr: SocketAddr,
    engine: &Arc<EngineShared>,
) -> Result<EngineDescriptor> {
    let limit = engine.config.handshake_timeout;
    let (desc, len) = tokio::time::timeout(limit, dial(addr, engine))
        .await
        .map_err(|_| Error::timeout(format!("handshake with {addr}"), limit))??;
    lock(&engine.peers).insert(desc.clone(), len);
    Ok(desc)
}
