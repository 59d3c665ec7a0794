//! A backend's own control channel, written once: a TCP connection opened with the engine's
//! authenticated handshake (the cluster secret, [`crate::backend::BackendHost::cluster_secret`]),
//! framed messages of the backend's protocol ([`Message`]), a writer task fed by a bounded
//! queue ([`Sender`]), and requests matched with their answers by id ([`Requests`], [`ask`]).

use crate::backend::kit::lock;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

use crate::auth::ClusterSecret;
use crate::error::{Error, Result};
use crate::handshake::Handshake;
use crate::wire::frame::Framing;
use tensorwire_proto::admission::Pending;

/// Messages queued for the writer task.
const QUEUE: usize = 1024;

/// A message of a backend's control channel: a frame kind and a payload, in `FRAMING`.
pub trait Message: Sized + Send + Sync + std::fmt::Debug + 'static {
    /// The protocol's framing (its magic, version and payload bound).
    const FRAMING: Framing;
    /// The frame kind.
    fn kind(&self) -> u8;
    /// The payload.
    fn encode(&self) -> Vec<u8>;
    /// Decodes a frame of kind `kind`; never panics.
    fn decode(kind: u8, payload: &[u8]) -> Result<Self>;
    /// Whether this message ends the channel (the writer stops after sending it).
    fn is_bye(&self) -> bool;
}

/// Dials `addr` and runs the client side of the engine's handshake in `framing` (the cluster
/// secret from [`crate::backend::BackendHost::cluster_secret`]), bounded by `limit`.
pub async fn dial(
    addr: SocketAddr,
    framing: &Framing,
    secret: Option<&ClusterSecret>,
    limit: Duration,
) -> Result<TcpStream> {
    let name = framing.name;
    let fut = async {
        let mut sock = TcpStream::connect(addr).await.map_err(|e| {
            Error::PeerClosed(format!("{name}: cannot reach the control channel {addr}: {e}"))
        })?;
        sock.set_nodelay(true)?;
        Handshake { framing, secret, peer: addr }.client(&mut sock).await?;
        Ok(sock)
    };
    tokio::time::timeout(limit, fut).await.map_err(|_| {
        Error::timeout(format!("{name}: opening the control channel to {addr}"), limit)
    })?
}

/// The server side of the handshake on an accepted control channel, bounded by `limit` and by
/// the connection's place among the listener's pending ones (`pending`, from
/// [`crate::backend::kit::Serving::admit`]), which it gives back once the peer proved itself.
pub async fn accept(
    sock: &mut TcpStream,
    framing: &Framing,
    secret: Option<&ClusterSecret>,
    peer: SocketAddr,
    limit: Duration,
    pending: &mut Pending,
) -> Result<()> {
    let hs = Handshake { framing, secret, peer };
    let handshake = tokio::time::timeout(limit, hs.server(sock));
    match pending.prove(handshake).await {
        Ok(Ok(r)) => {
            pending.proved();
            r
        }
        Ok(Err(_)) => Err(Error::timeout(format!("{}: peer handshake", framing.name), limit)),
        Err(closed) => Err(closed.error(framing.name, pending.deadline())),
    }
}

/// Reads the next message; `None` at the end of the stream.
pub async fn read<M: Message>(r: &mut OwnedReadHalf) -> Result<Option<M>> {
    match M::FRAMING.read(r).await? {
        Some((kind, payload)) => M::decode(kind, &payload).map(Some),
        None => Ok(None),
    }
}

/// Writes one message.
pub async fn write<M: Message>(w: &mut (impl tokio::io::AsyncWrite + Unpin), m: &M) -> Result<()> {
    M::FRAMING.write(w, m.kind(), &m.encode()).await
}

/// The sending side of a control channel: a bounded queue drained by a writer task.
#[derive(Debug)]
pub struct Sender<M> {
    tx: mpsc::Sender<M>,
}

impl<M> Clone for Sender<M> {
    fn clone(&self) -> Self {
        Sender { tx: self.tx.clone() }
    }
}

impl<M: Message> Sender<M> {
    /// Starts the writer task on `w`; it ends when every `Sender` is gone, after a message
    /// that ends the channel ([`Message::is_bye`]), or when the stream fails.
    pub fn start(mut w: OwnedWriteHalf) -> Sender<M> {
        let (tx, mut rx) = mpsc::channel::<M>(QUEUE);
        tokio::spawn(async move {
            while let Some(m) = rx.recv().await {
                let bye = m.is_bye();
                if let Err(e) = write(&mut w, &m).await {
                    tracing::debug!(error = %e, protocol = M::FRAMING.name, "control channel write failed");
                    return;
                }
                if bye {
                    break;
                }
            }
            let _ = w.shutdown().await;
        });
        Sender { tx }
    }

    /// Queues `m`, waiting for room.
    pub async fn send(&self, m: M) -> Result<()> {
        self.tx.send(m).await.map_err(|_| {
            Error::PeerClosed(format!("{}: the control channel is closed", M::FRAMING.name))
        })
    }

    /// Queues `m` from synchronous code: at once when there is room, else from a task.
    pub fn send_later(&self, m: M) {
        match self.tx.try_send(m) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(m)) => {
                let tx = self.tx.clone();
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move {
                        let _ = tx.send(m).await;
                    });
                }
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }
}

/// Requests awaiting their answer, by id.
#[derive(Debug)]
pub struct Requests<M> {
    next: AtomicU64,
    waiting: Mutex<HashMap<u64, oneshot::Sender<M>>>,
    closed: Mutex<Option<Error>>,
}

impl<M> Default for Requests<M> {
    fn default() -> Self {
        Requests {
            next: AtomicU64::new(0),
            waiting: Mutex::new(HashMap::new()),
            closed: Mutex::new(None),
        }
    }
}

impl<M: Message> Requests<M> {
    /// A new request id and the receiver of its answer (an error once the channel closed).
    pub fn open(&self) -> Result<(u64, oneshot::Receiver<M>)> {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = oneshot::channel();
        let mut w = lock(&self.waiting);
        if let Some(e) = lock(&self.closed).clone() {
            return Err(e);
        }
        w.insert(id, tx);
        Ok((id, rx))
    }

    /// Delivers an answer; false when nobody waits for `req`.
    pub fn answer(&self, req: u64, m: M) -> bool {
        match lock(&self.waiting).remove(&req) {
            Some(tx) => tx.send(m).is_ok(),
            None => false,
        }
    }

    /// Forgets a request (its waiter gave up).
    pub fn abandon(&self, req: u64) {
        lock(&self.waiting).remove(&req);
    }

    /// The channel closed: every waiting request fails with `e`, and later ones too.
    pub fn close(&self, e: Error) {
        let mut w = lock(&self.waiting);
        lock(&self.closed).get_or_insert(e);
        w.clear();
    }

    /// Why the channel closed.
    pub fn closed(&self) -> Option<Error> {
        lock(&self.closed).clone()
    }
}

/// Sends a request made by `make(id)` and waits for its answer, at most `limit`.
pub async fn ask<M: Message>(
    sender: &Sender<M>,
    requests: &Requests<M>,
    limit: Duration,
    what: &str,
    make: impl FnOnce(u64) -> M,
) -> Result<M> {
    let (id, rx) = requests.open()?;
    if let Err(e) = sender.send(make(id)).await {
        requests.abandon(id);
        return Err(e);
    }
    match tokio::time::timeout(limit, rx).await {
        Ok(Ok(m)) => Ok(m),
        Ok(Err(_)) => Err(requests.closed().unwrap_or_else(|| {
            Error::PeerClosed(format!("{}: the control channel closed", M::FRAMING.name))
        })),
        Err(_) => {
            requests.abandon(id);
            Err(Error::timeout(format!("{}: {what}", M::FRAMING.name), limit))
        }
    }
}
