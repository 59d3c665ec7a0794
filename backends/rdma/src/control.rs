//! The control channel as both sides use it: the authenticated opening, a writer task fed by a
//! bounded queue, and (initiator side) requests matched with their answers by id.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tensorwire_core::handshake::Handshake;
use tensorwire_core::{ClusterSecret, Error, Result};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

use crate::wire::{FRAMING, Msg};

/// Messages queued for the writer task.
const QUEUE: usize = 1024;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Dials `addr` and runs the client side of the handshake (bounded by `limit`).
pub(crate) async fn dial(
    addr: SocketAddr,
    secret: Option<&ClusterSecret>,
    limit: Duration,
) -> Result<TcpStream> {
    let fut = async {
        let mut sock = TcpStream::connect(addr).await.map_err(|e| {
            Error::PeerClosed(format!("rdma: cannot reach the control channel {addr}: {e}"))
        })?;
        sock.set_nodelay(true)?;
        Handshake { framing: &FRAMING, secret, peer: addr }.client(&mut sock).await?;
        Ok(sock)
    };
    tokio::time::timeout(limit, fut).await.map_err(|_| {
        Error::timeout(format!("rdma: opening the control channel to {addr}"), limit)
    })?
}

/// Reads the next message; `None` at the end of the stream.
pub(crate) async fn read(r: &mut OwnedReadHalf) -> Result<Option<Msg>> {
    match FRAMING.read(r).await? {
        Some((kind, payload)) => Msg::decode(kind, &payload).map(Some),
        None => Ok(None),
    }
}

/// Writes one message.
pub(crate) async fn write(w: &mut (impl tokio::io::AsyncWrite + Unpin), m: &Msg) -> Result<()> {
    FRAMING.write(w, m.kind(), &m.encode()).await
}

/// The sending side of a control channel: a bounded queue drained by a writer task.
#[derive(Debug, Clone)]
pub(crate) struct Sender {
    tx: mpsc::Sender<Msg>,
}

impl Sender {
    /// Starts the writer task on `w`; it ends when every `Sender` is gone (after a `Bye`) or
    /// the stream fails.
    pub(crate) fn start(mut w: OwnedWriteHalf) -> Sender {
        let (tx, mut rx) = mpsc::channel::<Msg>(QUEUE);
        tokio::spawn(async move {
            while let Some(m) = rx.recv().await {
                let bye = matches!(m, Msg::Bye);
                if let Err(e) = write(&mut w, &m).await {
                    tracing::debug!(error = %e, "rdma: control channel write failed");
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
    pub(crate) async fn send(&self, m: Msg) -> Result<()> {
        self.tx
            .send(m)
            .await
            .map_err(|_| Error::PeerClosed("rdma: the control channel is closed".into()))
    }

    /// Queues `m` from synchronous code: at once when there is room, else from a task.
    pub(crate) fn send_later(&self, m: Msg) {
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
#[derive(Debug, Default)]
pub(crate) struct Requests {
    next: AtomicU64,
    waiting: Mutex<HashMap<u64, oneshot::Sender<Msg>>>,
    closed: Mutex<Option<Error>>,
}

impl Requests {
    /// A new request id and the receiver of its answer (an error once the channel closed).
    pub(crate) fn open(&self) -> Result<(u64, oneshot::Receiver<Msg>)> {
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
    pub(crate) fn answer(&self, req: u64, m: Msg) -> bool {
        match lock(&self.waiting).remove(&req) {
            Some(tx) => tx.send(m).is_ok(),
            None => false,
        }
    }

    /// Forgets a request (its waiter gave up).
    pub(crate) fn abandon(&self, req: u64) {
        lock(&self.waiting).remove(&req);
    }

    /// The channel closed: every waiting request fails with `e`, and later ones too.
    pub(crate) fn close(&self, e: Error) {
        let mut w = lock(&self.waiting);
        lock(&self.closed).get_or_insert(e);
        w.clear();
    }

    /// Why the channel closed.
    pub(crate) fn closed(&self) -> Option<Error> {
        lock(&self.closed).clone()
    }
}

/// Sends a request made by `make(id)` and waits for its answer, at most `limit`.
pub(crate) async fn ask(
    sender: &Sender,
    requests: &Arc<Requests>,
    limit: Duration,
    what: &str,
    make: impl FnOnce(u64) -> Msg,
) -> Result<Msg> {
    let (id, rx) = requests.open()?;
    if let Err(e) = sender.send(make(id)).await {
        requests.abandon(id);
        return Err(e);
    }
    match tokio::time::timeout(limit, rx).await {
        Ok(Ok(m)) => Ok(m),
        Ok(Err(_)) => Err(requests
            .closed()
            .unwrap_or_else(|| Error::PeerClosed("rdma: the control channel closed".into()))),
        Err(_) => {
            requests.abandon(id);
            Err(Error::timeout(format!("rdma: {what}"), limit))
        }
    }
}
