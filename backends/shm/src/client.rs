//! The initiating side: one Unix stream to the peer's backend. An op asks the peer to hold the
//! region (Begin), maps the region from the granted memfd the first time, copies once between
//! the local slice and the mapping, and releases the region (End). A reader task matches grants
//! to ops, drops mappings the peer forgets, and fails everything when the peer goes away.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tensorwire_core::backend::kit::{CancelGate, decode_error, gated_copy, spawn_cancellable};
use tensorwire_core::backend::{Completion, Connection, Direction, Op};
use tensorwire_core::{Error, RegionId, Result};
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

use crate::mapping::Mapping;
use crate::uds::{FrameReader, FrameWriter};
use crate::wire::{ACCESS_WRITE, Header, Kind, WANT_FD, WRITABLE};

/// A peer's answer to a Begin or Notify.
#[derive(Debug)]
struct Answer {
    len: u64,
    writable: bool,
    fd: Option<OwnedFd>,
}

#[derive(Debug, Default)]
struct State {
    pending: HashMap<u64, oneshot::Sender<Result<Answer>>>,
    maps: HashMap<RegionId, Arc<Mapping>>,
    dead: Option<Error>,
}

#[derive(Debug)]
pub(crate) struct ClientShared {
    writer: FrameWriter,
    state: Mutex<State>,
    next_req: AtomicU64,
    answer_timeout: Duration,
}

impl ClientShared {
    /// Fails every waiting op and drops every mapping of the peer's memory; idempotent.
    pub(crate) fn kill(&self, e: Error) {
        let (pending, maps) = {
            let mut s = self.state.lock();
            if s.dead.is_none() {
                s.dead = Some(e.clone());
            }
            (std::mem::take(&mut s.pending), std::mem::take(&mut s.maps))
        };
        for (_, tx) in pending {
            let _ = tx.send(Err(e.clone()));
        }
        drop(maps); // ops still copying hold their own Arc; the last one unmaps
    }

    fn alive(&self) -> Result<()> {
        match &self.state.lock().dead {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Sends `h` (+ body) and waits for the answer to its request id.
    async fn ask(&self, h: Header, body: &[u8]) -> Result<Answer> {
        let (tx, rx) = oneshot::channel();
        {
            let mut s = self.state.lock();
            if let Some(e) = &s.dead {
                return Err(e.clone());
            }
            s.pending.insert(h.req, tx);
        }
        if let Err(e) = self.writer.send(&h, body, None).await {
            self.state.lock().pending.remove(&h.req);
            self.kill(e.clone());
            return Err(e);
        }
        match tokio::time::timeout(self.answer_timeout, rx).await {
            Ok(r) => r.unwrap_or_else(|_| Err(Error::PeerClosed("shm connection closed".into()))),
            Err(_) => {
                // An unresponsive peer (stopped, hung) is as good as dead: fail everything now
                // rather than one op per timeout.
                let e = Error::timeout("shm: the peer did not answer", self.answer_timeout);
                self.kill(e.clone());
                Err(e)
            }
        }
    }
}

/// A connection to one peer's shm backend.
#[derive(Debug)]
pub(crate) struct ShmConnection {
    shared: Arc<ClientShared>,
    reader: AbortHandle,
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        self.shared.kill(Error::PeerClosed("shm connection dropped".into()));
        self.reader.abort();
    }
}

impl ShmConnection {
    pub(crate) fn new(
        sock: UnixStream,
        answer_timeout: Duration,
    ) -> (ShmConnection, Arc<ClientShared>) {
        let sock = Arc::new(sock);
        let shared = Arc::new(ClientShared {
            writer: FrameWriter::new(sock.clone()),
            state: Mutex::new(State::default()),
            next_req: AtomicU64::new(1),
            answer_timeout,
        });
        let r = shared.clone();
        let reader = tokio::spawn(read_loop(r, FrameReader::new(sock))).abort_handle();
        (ShmConnection { shared: shared.clone(), reader }, shared)
    }
}

async fn read_loop(c: Arc<ClientShared>, mut reader: FrameReader) {
    let err = loop {
        let f = match reader.next().await {
            Ok(Some(f)) => f,
            Ok(None) => break Error::PeerClosed("shm: the peer closed the connection".into()),
            Err(e) => break e,
        };
        match f.h.kind {
            Kind::Forget => {
                c.state.lock().maps.remove(&f.h.region);
            }
            Kind::Granted | Kind::NotifyAck => {
                let Some(tx) = c.state.lock().pending.remove(&f.h.req) else {
                    break Error::protocol(format!("shm: answer to unknown request {}", f.h.req));
                };
                let answer = if f.h.ok {
                    Ok(Answer { len: f.h.len, writable: f.h.flags & WRITABLE != 0, fd: f.fd })
                } else {
                    Err(decode_error(&f.body).unwrap_or_else(|e| e))
                };
                let _ = tx.send(answer);
            }
            k => break Error::protocol(format!("shm: the server sent a {k:?}")),
        }
    };
    c.kill(err);
}

async fn run_op(c: Arc<ClientShared>, op: Op, gate: Arc<CancelGate>) -> Result<()> {
    let len = op.local().len();
    let region = op.remote().region;
    let write = op.dir() == Direction::Write;
    let cached = c.state.lock().maps.get(&region).cloned();
    let mut h = Header::new(Kind::Begin, c.next_req.fetch_add(1, Ordering::Relaxed));
    h.region = region;
    h.key = op.remote().key;
    h.offset = op.remote().offset;
    h.len = len;
    h.flags = if write { ACCESS_WRITE } else { 0 } | if cached.is_none() { WANT_FD } else { 0 };
    let answer = c.ask(h, &[]).await?;
    // From here the peer holds the region for us: always release it, whatever happens.
    let result = copy(&c, &op, cached, answer, &gate).await;
    let end = Header::new(Kind::End, h.req);
    let released = c.writer.send(&end, &[], None).await;
    result?;
    released?;
    c.alive()
}

async fn copy(
    c: &ClientShared,
    op: &Op,
    cached: Option<Arc<Mapping>>,
    answer: Answer,
    gate: &CancelGate,
) -> Result<()> {
    let map = match (answer.fd, cached) {
        (Some(fd), _) => {
            let m = Arc::new(Mapping::new(fd, answer.len, answer.writable)?);
            let mut s = c.state.lock();
            if s.dead.is_none() {
                s.maps.insert(op.remote().region, m.clone());
            }
            m
        }
        (None, Some(m)) => m,
        (None, None) => return Err(Error::protocol("shm: granted without a descriptor")),
    };
    let len = op.local().len();
    let write = op.dir() == Direction::Write;
    let remote = map.at(op.remote().offset, len, write)?;
    let local = op.local().ptr() as usize;
    let (src, dst) = if write { (local, remote) } else { (remote, local) };
    // SAFETY: `op.local()` is a live registered slice of `len` bytes held by `op`; `remote` is
    // inside `map` (checked by `at`), which this function holds; the peer holds its region open
    // (in-flight gate) until our End.
    unsafe { gated_copy(src, dst, len, gate, || c.alive()) }.await?;
    Ok(())
}

impl Connection for ShmConnection {
    fn broken(&self) -> Option<Error> {
        self.shared.alive().err()
    }

    fn submit(&self, ops: Vec<Op>) -> Vec<Completion> {
        ops.into_iter()
            .map(|op| {
                let c = self.shared.clone();
                spawn_cancellable(move |gate| async move {
                    if op.local().is_empty() { c.alive() } else { run_op(c, op, gate).await }
                })
            })
            .collect()
    }

    fn notify(&self, msg: Bytes) -> Completion {
        let c = self.shared.clone();
        Box::pin(async move {
            let mut h = Header::new(Kind::Notify, c.next_req.fetch_add(1, Ordering::Relaxed));
            h.len = msg.len() as u64;
            c.ask(h, &msg).await.map(drop)
        })
    }
}
