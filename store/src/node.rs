//! A store node: serves an [`EmbeddedStore`] (allocated with `shared: true`) to remote engines
//! over the store RPC. Object bytes never cross the RPC; clients move them with engine transfers
//! into and out of the pool region. A connection must first prove it holds the pool's access key
//! (which peers only learn through the engine handshake, authenticated when the engine has a
//! cluster secret). A periodic sweep drops puts never committed and reads never closed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::{Error, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::api::Store;
use crate::embedded::EmbeddedStore;
use crate::rpc::{self, ERR, HEADER_LEN, OK, Request, Response};

/// A running store node; dropping it stops serving.
#[derive(Debug)]
pub struct StoreNode {
    addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for StoreNode {
    fn drop(&mut self) {
        self.tasks.iter().for_each(JoinHandle::abort);
    }
}

impl StoreNode {
    /// Serves `store` on `listen`.
    pub async fn serve(store: Arc<EmbeddedStore>, listen: SocketAddr) -> Result<StoreNode> {
        let l = TcpListener::bind(listen).await.map_err(|e| {
            Error::InvalidArgument(format!("store node: cannot listen on {listen}: {e}"))
        })?;
        let addr = l.local_addr()?;
        let sweeper = {
            let store = Arc::downgrade(&store);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    match store.upgrade() {
                        Some(s) => s.expire(),
                        None => return,
                    }
                }
            })
        };
        let acceptor = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    a = l.accept() => match a {
                        Ok((sock, _)) => {
                            let _ = sock.set_nodelay(true);
                            conns.spawn(serve_conn(sock, store.clone()));
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "store node: accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    },
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(StoreNode { addr, tasks: vec![sweeper, acceptor] })
    }

    /// The RPC address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Reads one frame; `Ok(None)` at a clean end of stream.
pub(crate) async fn read_frame(
    s: &mut (impl AsyncReadExt + Unpin),
) -> Result<Option<(rpc::Header, Vec<u8>)>> {
    let mut h = [0u8; HEADER_LEN];
    match s.read_exact(&mut h).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let h = rpc::decode_header(&h)?;
    let mut p = vec![0u8; h.len as usize]; // bounded by MAX_PAYLOAD in decode
    s.read_exact(&mut p).await?;
    Ok(Some((h, p)))
}

async fn serve_conn(mut sock: TcpStream, store: Arc<EmbeddedStore>) {
    let mut authed = false;
    let mut tickets_put: Vec<u64> = Vec::new();
    let mut tickets_read: Vec<u64> = Vec::new();
    loop {
        let (h, p) = match read_frame(&mut sock).await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(error = %e, "store node: connection dropped");
                break;
            }
        };
        let r = match Request::decode(h.kind, &p) {
            Ok(req) => handle(&store, req, &mut authed, &mut tickets_put, &mut tickets_read).await,
            Err(e) => Err(e),
        };
        let out = match r {
            Ok(resp) => rpc::frame(OK, h.req, &resp.encode()),
            Err(e) => rpc::frame(ERR, h.req, &rpc::error_payload(&e)),
        };
        if sock.write_all(&out).await.is_err() {
            break;
        }
    }
    // A client that went away mid-put or mid-get leaks nothing (the sweep would catch it too).
    for t in tickets_put {
        store.abort(t);
    }
    for t in tickets_read {
        store.close(t);
    }
}

async fn handle(
    store: &EmbeddedStore,
    req: Request,
    authed: &mut bool,
    puts: &mut Vec<u64>,
    reads: &mut Vec<u64>,
) -> Result<Response> {
    match req {
        Request::Hello => return Ok(Response::Pool(store.pool().id)),
        Request::Auth { region, key } => {
            let pool = store.pool();
            if region != pool.id || key != pool.key {
                return Err(Error::AccessDenied("store node: wrong pool key".into()));
            }
            *authed = true;
            return Ok(Response::Done);
        }
        _ if !*authed => {
            return Err(Error::AccessDenied("store node: authenticate first (Auth)".into()));
        }
        _ => {}
    }
    Ok(match req {
        Request::Reserve { key, meta, len, retention } => {
            let r = store.reserve(&key, &meta, len, retention)?;
            puts.push(r.ticket);
            Response::Reserved { ticket: r.ticket, offset: r.off }
        }
        Request::Commit { ticket } => {
            puts.retain(|&t| t != ticket);
            store.commit(ticket)?;
            Response::Done
        }
        Request::Abort { ticket } => {
            puts.retain(|&t| t != ticket);
            store.abort(ticket);
            Response::Done
        }
        Request::Open { key } => {
            let (o, off) = store.open(&key, true)?;
            let offset =
                off.ok_or_else(|| Error::protocol("store node: object not in the pool"))?;
            reads.push(o.ticket);
            Response::Opened { ticket: o.ticket, offset, len: o.len, meta: o.meta }
        }
        Request::Close { ticket } => {
            reads.retain(|&t| t != ticket);
            store.close(ticket);
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
        Request::Hello | Request::Auth { .. } => Response::Done,
    })
}
