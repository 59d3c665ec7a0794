//! The client of a [`crate::StoreNode`]: the same [`Store`] API, with object bytes moved by engine
//! transfers straight between the caller's regions and the node's pool.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tensorwire_core::{
    Engine, Error, MemSlice, Permissions, Region, RemoteRegion, Session, TensorMeta, TransferOp,
    backend::Direction,
};
use tensorwire_proto::handshake::Handshake;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::oneshot;

use crate::api::{ObjectInfo, Retention, Store, StoreStats, check_key, check_meta, put_staged};
use crate::embedded::PendingPut;
use crate::error::{Result, StoreError};
use crate::rpc::{self, FRAMING, Request, Response};

type Reply = std::result::Result<Response, StoreError>;
type Waiters = Mutex<(HashMap<u64, oneshot::Sender<Reply>>, Option<Error>)>;

#[derive(Debug)]
struct Rpc {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    waiters: Arc<Waiters>,
    next: Arc<AtomicU64>,
    timeout: Duration,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Rpc {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

fn fail_all(w: &Waiters, e: Error) {
    let pending = {
        let mut g = w.lock();
        g.1.get_or_insert(e.clone());
        std::mem::take(&mut g.0)
    };
    for (_, tx) in pending {
        let _ = tx.send(Err(e.clone().into()));
    }
}

impl Rpc {
    async fn connect(engine: &Engine, addr: SocketAddr) -> Result<Rpc> {
        let cfg = engine.config();
        let (hs, timeout) = (cfg.handshake_timeout, cfg.transfer_timeout);
        let opened = async {
            let mut sock = TcpStream::connect(addr)
                .await
                .map_err(|e| Error::PeerClosed(format!("store node {addr}: {e}")))?;
            sock.set_nodelay(true)?;
            let secret = cfg.cluster_secret.as_ref();
            Handshake { framing: &FRAMING, secret, peer: addr }.client(&mut sock).await?;
            Ok::<_, Error>(sock)
        };
        let sock = tokio::time::timeout(hs, opened)
            .await
            .map_err(|_| Error::timeout(format!("handshake with store node {addr}"), hs))??;
        let (mut rd, wr) = sock.into_split();
        let waiters: Arc<Waiters> = Arc::default();
        let w = waiters.clone();
        let next = Arc::new(AtomicU64::new(1));
        let issued = next.clone();
        let reader = tokio::spawn(async move {
            let e = loop {
                let frame = match FRAMING.read(&mut rd).await {
                    Ok(Some(f)) => f,
                    Ok(None) => break Error::PeerClosed("store node closed the connection".into()),
                    Err(e) => break e,
                };
                let (kind, payload) = frame;
                let decoded = rpc::split(&payload)
                    .and_then(|(req, body)| Ok((req, Response::decode(kind, body)?)));
                let (req, reply) = match decoded {
                    Ok(x) => x,
                    Err(e) => break e,
                };
                match w.lock().0.remove(&req) {
                    Some(tx) => {
                        let _ = tx.send(reply);
                    }
                    // The answer to a call that timed out (a slow node, a healed partition).
                    None if req < issued.load(Ordering::Relaxed) => {}
                    None => break Error::protocol("store rpc: unsolicited response"),
                }
            };
            fail_all(&w, e);
        });
        Ok(Rpc { writer: tokio::sync::Mutex::new(wr), waiters, next, timeout, reader })
    }

    /// Why this connection can carry no more calls, if it cannot.
    fn broken(&self) -> Option<Error> {
        self.waiters.lock().1.clone()
    }

    async fn call(&self, req: Request) -> Result<Response> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut g = self.waiters.lock();
            if let Some(e) = &g.1 {
                return Err(e.clone().into());
            }
            g.0.insert(id, tx);
        }
        let (kind, body) = req.encode();
        let frame = rpc::frame(kind, id, &body)?;
        if let Err(e) = self.writer.lock().await.write_all(&frame).await {
            let e = Error::from(e);
            fail_all(&self.waiters, e.clone());
            return Err(e.into());
        }
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::PeerClosed("store rpc connection closed".into()).into()),
            Err(_) => {
                self.waiters.lock().0.remove(&id);
                Err(Error::timeout("store node did not answer", self.timeout).into())
            }
        }
    }
}

fn unexpected(r: Response) -> StoreError {
    Error::protocol(format!("store rpc: unexpected response {r:?}")).into()
}

/// A remote store: the [`Store`] API over a store node.
#[derive(Debug)]
pub struct RemoteStore {
    engine: Engine,
    session: Session,
    pool: RemoteRegion,
    node_rpc: SocketAddr,
    /// The RPC connection; replaced when it breaks (see [`RemoteStore::call`]).
    rpc: Mutex<Arc<Rpc>>,
    redial: tokio::sync::Mutex<()>,
}

impl RemoteStore {
    /// Connects `engine` to the node's engine (control address) and its store RPC, and
    /// authenticates with the pool's access key learned in the engine handshake.
    pub async fn connect(
        engine: &Engine,
        node_engine: SocketAddr,
        node_rpc: SocketAddr,
    ) -> Result<RemoteStore> {
        RemoteStore::dial(engine, Some(node_engine), node_rpc).await
    }

    /// [`RemoteStore::connect`] given only the node's RPC address: the node tells where its
    /// engine listens (an engine listening on every interface is dialled at the RPC's IP).
    pub async fn connect_node(engine: &Engine, node_rpc: SocketAddr) -> Result<RemoteStore> {
        RemoteStore::dial(engine, None, node_rpc).await
    }

    async fn dial(
        engine: &Engine,
        node_engine: Option<SocketAddr>,
        node_rpc: SocketAddr,
    ) -> Result<RemoteStore> {
        let rpc = Rpc::connect(engine, node_rpc).await?;
        let (pool_id, told) = match rpc.call(Request::Hello).await? {
            Response::Pool { region, engine } => (region, engine),
            r => return Err(unexpected(r)),
        };
        let node_engine = node_engine.unwrap_or(match told.ip().is_unspecified() {
            true => SocketAddr::new(node_rpc.ip(), told.port()),
            false => told,
        });
        let session = engine.connect(node_engine).await?;
        let pool = session.remote_region(pool_id).map_err(|_| {
            StoreError::Engine(Error::AccessDenied(format!(
                "store node pool region {} is not visible to this engine (is the store shared?)",
                pool_id.0
            )))
        })?;
        rpc.call(Request::Auth { region: pool.id, key: pool.key }).await?;
        Ok(RemoteStore {
            engine: engine.clone(),
            session,
            pool,
            node_rpc,
            rpc: Mutex::new(Arc::new(rpc)),
            redial: tokio::sync::Mutex::new(()),
        })
    }

    /// One call over the RPC connection. A connection that broke (the node went away, a
    /// partition or reset cut it) is replaced by a new one first, so a healed network needs no
    /// new client; a node that came back with a different pool is an error.
    async fn call(&self, req: Request) -> Result<Response> {
        let current = self.rpc.lock().clone();
        let rpc = match current.broken() {
            None => current,
            Some(_) => self.redial().await?,
        };
        rpc.call(req).await
    }

    async fn redial(&self) -> Result<Arc<Rpc>> {
        let _one = self.redial.lock().await;
        let current = self.rpc.lock().clone();
        if current.broken().is_none() {
            return Ok(current); // another call redialed meanwhile
        }
        let fresh = Rpc::connect(&self.engine, self.node_rpc).await?;
        match fresh.call(Request::Hello).await? {
            Response::Pool { region, .. } if region == self.pool.id => {}
            Response::Pool { .. } => {
                return Err(StoreError::Engine(Error::PeerClosed(format!(
                    "store node {}: it restarted (its pool changed); connect again",
                    self.node_rpc
                ))));
            }
            r => return Err(unexpected(r)),
        }
        fresh.call(Request::Auth { region: self.pool.id, key: self.pool.key }).await?;
        let fresh = Arc::new(fresh);
        *self.rpc.lock() = fresh.clone();
        Ok(fresh)
    }

    /// Reserves space on the node for `key`: write the bytes to [`RemoteStore::pool`] at the
    /// returned offset with any engine transfer, then [`RemoteStore::commit_put`]. If this client
    /// goes away first, the node reclaims the space.
    pub async fn begin_put(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        len: u64,
        r: Retention,
    ) -> Result<PendingPut> {
        let (ticket, offset) = self.reserve(key, meta, len, r).await?;
        Ok(PendingPut { ticket, offset })
    }

    /// Publishes a put begun with [`RemoteStore::begin_put`].
    pub async fn commit_put(&self, p: PendingPut) -> Result<()> {
        self.done(Request::Commit { ticket: p.ticket }).await
    }

    /// The node's pool region.
    pub fn pool(&self) -> &RemoteRegion {
        &self.pool
    }

    /// The session with the node's engine.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Up to `limit` of the node's objects (at most [`crate::rpc::MAX_LIST`]) with keys after
    /// `after`, in key order.
    pub async fn list(&self, after: &[u8], limit: usize) -> Result<Vec<ObjectInfo>> {
        let limit = limit.min(crate::rpc::MAX_LIST) as u32;
        match self.call(Request::List { after: after.to_vec(), limit }).await? {
            Response::Objects(list) => Ok(list),
            r => Err(unexpected(r)),
        }
    }

    /// The node's RPC address.
    pub fn node(&self) -> SocketAddr {
        self.node_rpc
    }

    async fn reserve(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        len: u64,
        r: Retention,
    ) -> Result<(u64, u64)> {
        check_key(key)?;
        check_meta(meta, len)?;
        let req = Request::Reserve { key: key.to_vec(), meta: meta.clone(), len, retention: r };
        match self.call(req).await? {
            Response::Reserved { ticket, offset } => Ok((ticket, offset)),
            r => Err(unexpected(r)),
        }
    }

    async fn open(&self, key: &[u8]) -> Result<(u64, u64, u64, TensorMeta)> {
        check_key(key)?;
        match self.call(Request::Open { key: key.to_vec() }).await? {
            Response::Opened { ticket, offset, len, meta } => Ok((ticket, offset, len, meta)),
            r => Err(unexpected(r)),
        }
    }

    async fn done(&self, req: Request) -> Result<()> {
        match self.call(req).await? {
            Response::Done => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    async fn flag(&self, req: Request) -> Result<bool> {
        match self.call(req).await? {
            Response::Flag(b) => Ok(b),
            r => Err(unexpected(r)),
        }
    }
}

#[async_trait]
impl Store for RemoteStore {
    async fn put(&self, key: &[u8], meta: &TensorMeta, bytes: &[u8], r: Retention) -> Result<()> {
        put_staged(self, &self.engine, (key, meta, bytes), r).await
    }

    async fn put_from(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        src: &MemSlice,
        r: Retention,
    ) -> Result<()> {
        let (ticket, at) = self.reserve(key, meta, src.len(), r).await?;
        let moved = if src.is_empty() {
            Ok(())
        } else {
            let op = TransferOp::from_slice(Direction::Write, src, &self.pool, at);
            self.session.transfer(op).await.map(drop)
        };
        match moved {
            Ok(()) => self.done(Request::Commit { ticket }).await,
            Err(e) => {
                let _ = self.done(Request::Abort { ticket }).await;
                Err(e.into())
            }
        }
    }

    async fn get(&self, key: &[u8]) -> Result<(TensorMeta, Vec<u8>)> {
        let (ticket, at, len, meta) = self.open(key).await?;
        let r = async {
            let staging = self.engine.alloc(len.max(1), Permissions::NONE).await?;
            if len > 0 {
                self.session.transfer(TransferOp::read(&staging, 0, &self.pool, at, len)).await?;
            }
            staging.to_vec(0, len)
        }
        .await
        .map_err(StoreError::from);
        let closed = self.done(Request::Close { ticket }).await;
        let bytes = r?;
        closed?;
        Ok((meta, bytes))
    }

    async fn get_into(&self, key: &[u8], dst: &Region, offset: u64) -> Result<(TensorMeta, u64)> {
        let (ticket, at, len, meta) = self.open(key).await?;
        let r = match dst.slice(offset, len) {
            Err(e) => Err(e),
            Ok(_) if len == 0 => Ok(()),
            Ok(_) => self
                .session
                .transfer(TransferOp::read(dst, offset, &self.pool, at, len))
                .await
                .map(drop),
        };
        let closed = self.done(Request::Close { ticket }).await;
        r?;
        closed?;
        Ok((meta, len))
    }

    async fn exists(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        self.flag(Request::Exists { key: key.to_vec() }).await
    }

    async fn meta(&self, key: &[u8]) -> Result<TensorMeta> {
        let (ticket, _, _, meta) = self.open(key).await?;
        self.done(Request::Close { ticket }).await?;
        Ok(meta)
    }

    async fn remove(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        self.flag(Request::Remove { key: key.to_vec() }).await
    }

    async fn pin(&self, key: &[u8]) -> Result<()> {
        check_key(key)?;
        self.done(Request::Pin { key: key.to_vec(), up: true }).await
    }

    async fn unpin(&self, key: &[u8]) -> Result<()> {
        check_key(key)?;
        self.done(Request::Pin { key: key.to_vec(), up: false }).await
    }

    async fn set_lease(&self, key: &[u8], consumers: u32, ttl: Option<Duration>) -> Result<()> {
        check_key(key)?;
        let ttl_ms = ttl.map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1));
        self.done(Request::Lease { key: key.to_vec(), consumers, ttl_ms }).await
    }

    async fn consumed(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        self.flag(Request::Consumed { key: key.to_vec() }).await
    }

    async fn stats(&self) -> Result<StoreStats> {
        match self.call(Request::Stats).await? {
            Response::Stats(s) => Ok(s),
            r => Err(unexpected(r)),
        }
    }
}
