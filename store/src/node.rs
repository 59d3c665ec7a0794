//! A store node: serves an [`EmbeddedStore`] (allocated with `shared: true`) to remote engines
//! over the store RPC. Object bytes never cross the RPC; clients move them with engine transfers
//! into and out of the pool region. A connection opens with the authenticated handshake (the
//! cluster secret, when one is given) and must then prove it holds the pool's access key (which
//! peers learn through the engine handshake). A periodic sweep drops puts never committed and
//! reads never closed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::Error;
use tensorwire_core::backend::kit::TaskSet;
use tensorwire_proto::admission::{Admission, Limits, Pending};
use tensorwire_proto::auth::{ClusterSecret, check_listener};
use tensorwire_proto::handshake::Handshake;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::api::Store;
use crate::embedded::EmbeddedStore;
use crate::error::{Result, StoreError};
use crate::rpc::{self, FRAMING, Request, Response};

/// Bound on a client's handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A running store node; dropping it stops serving.
#[derive(Debug)]
pub struct StoreNode {
    addr: SocketAddr,
    tasks: Arc<TaskSet>,
}

impl Drop for StoreNode {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

impl StoreNode {
    /// Serves `store` on `listen`, authenticating clients with the cluster secret of the engine
    /// the store was made on (clients prove it, then the pool's access key). Like the engine's
    /// control endpoint, an address other hosts can reach needs a secret or the engine's
    /// `insecure` opt-out.
    pub async fn serve(store: Arc<EmbeddedStore>, listen: SocketAddr) -> Result<StoreNode> {
        let secret = store.secret.clone();
        check_listener("store node", listen, secret.as_ref(), store.insecure)?;
        let l = TcpListener::bind(listen).await.map_err(|e| {
            Error::InvalidArgument(format!("store node: cannot listen on {listen}: {e}"))
        })?;
        let addr = l.local_addr().map_err(Error::from)?;
        let tasks = TaskSet::new();
        let weak = Arc::downgrade(&store);
        tasks.spawn(async move {
            for tick in 0u64.. {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let Some(s) = weak.upgrade() else { return };
                s.expire();
                if tick % 4 == 0 {
                    s.publish_metrics();
                }
            }
        });
        let conns = tasks.clone();
        // Connections that have not finished their handshake are bounded in time and number
        // (tensorwire_proto::admission); those that did are clients that hold the secret.
        let admission = Admission::new("store node", Limits::handshake(HANDSHAKE_TIMEOUT));
        tasks.spawn(async move {
            loop {
                let (sock, peer) = tensorwire_proto::accept::accept(&l, "store node").await;
                let _ = sock.set_nodelay(true);
                let pending = admission.admit(peer.ip());
                conns.spawn(serve_conn(sock, peer, store.clone(), secret.clone(), pending));
            }
        });
        Ok(StoreNode { addr, tasks })
    }

    /// The RPC address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// What one client holds, released when its connection ends.
#[derive(Debug, Default)]
struct Held {
    authed: bool,
    puts: Vec<u64>,
    reads: Vec<(u64, Vec<u8>)>,
}

impl Held {
    /// A put this connection began (a client cannot finish another client's put).
    fn take_put(&mut self, ticket: u64) -> Result<()> {
        let at = self.puts.iter().position(|&t| t == ticket).ok_or_else(|| {
            StoreError::InvalidArgument(format!("put {ticket} was not begun on this connection"))
        })?;
        self.puts.swap_remove(at);
        Ok(())
    }
}

async fn serve_conn(
    mut sock: TcpStream,
    peer: SocketAddr,
    store: Arc<EmbeddedStore>,
    secret: Option<ClusterSecret>,
    mut pending: Pending,
) {
    let hs = Handshake { framing: &FRAMING, secret: secret.as_ref(), peer };
    match pending.prove(hs.server(&mut sock)).await {
        Ok(Ok(())) => pending.proved(),
        Ok(Err(e)) => return tracing::warn!(%peer, error = %e, "store node: handshake refused"),
        Err(closed) => return tracing::debug!(%peer, ?closed, "store node: handshake unfinished"),
    }
    let mut held = Held::default();
    loop {
        let (kind, payload) = match FRAMING.read(&mut sock).await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "store node: connection dropped");
                break;
            }
        };
        let Ok((req, body)) = rpc::split(&payload) else { break };
        let r = match Request::decode(kind, body) {
            Ok(q) => handle(&store, q, &mut held).await,
            Err(e) => Err(StoreError::Engine(e)),
        };
        let Ok(out) = rpc::reply(req, &r) else { break };
        if sock.write_all(&out).await.is_err() {
            break;
        }
    }
    // A client that went away mid-put or mid-get leaks nothing (the sweep would catch it too).
    for t in held.puts {
        store.abort(t);
    }
    for (t, key) in held.reads {
        store.close(t, &key);
    }
}

async fn handle(store: &EmbeddedStore, req: Request, held: &mut Held) -> Result<Response> {
    match req {
        Request::Hello => {
            return Ok(Response::Pool { region: store.pool().id, engine: store.engine_addr });
        }
        Request::Auth { region, key } => {
            let pool = store.pool();
            if region != pool.id || key != pool.key {
                return Err(Error::AccessDenied("store node: wrong pool key".into()).into());
            }
            held.authed = true;
            return Ok(Response::Done);
        }
        _ if !held.authed => {
            return Err(Error::AccessDenied("store node: authenticate first (Auth)".into()).into());
        }
        _ => {}
    }
    Ok(match req {
        Request::Reserve { key, meta, len, retention } => {
            let p = store.begin_put(&key, &meta, len, retention)?;
            held.puts.push(p.ticket);
            Response::Reserved { ticket: p.ticket, offset: p.offset }
        }
        Request::Commit { ticket } => {
            held.take_put(ticket)?;
            store.commit(ticket)?;
            Response::Done
        }
        Request::Abort { ticket } => {
            held.take_put(ticket)?;
            store.abort(ticket);
            Response::Done
        }
        Request::Open { key } => {
            let o = store.open_in_pool(&key)?;
            held.reads.push((o.ticket, key));
            Response::Opened { ticket: o.ticket, offset: o.offset, len: o.len, meta: o.meta }
        }
        Request::Close { ticket } => {
            let at = held.reads.iter().position(|(t, _)| *t == ticket).ok_or_else(|| {
                StoreError::InvalidArgument(format!("read {ticket} is not open on this connection"))
            })?;
            let (_, key) = held.reads.swap_remove(at);
            store.close(ticket, &key);
            Response::Done
        }
        Request::Exists { key } => Response::Flag(store.exists(&key).await?),
        Request::Remove { key } => Response::Flag(store.remove(&key).await?),
        Request::Pin { key, up } => {
            if up {
                store.pin(&key).await?;
            } else {
                store.unpin(&key).await?;
            }
            Response::Done
        }
        Request::Stats => Response::Stats(store.stats().await?),
        Request::Lease { key, consumers, ttl_ms } => {
            let ttl = (ttl_ms > 0).then(|| Duration::from_millis(ttl_ms));
            store.set_lease(&key, consumers, ttl).await?;
            Response::Done
        }
        Request::Consumed { key } => Response::Flag(store.consumed(&key).await?),
        Request::List { after, limit } => Response::Objects(store.list(&after, limit as usize)),
        Request::Hello | Request::Auth { .. } => Response::Done,
    })
}
