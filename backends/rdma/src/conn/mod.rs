//! The initiator side of a connection: setup (NIC pairing, QPs, the Hello exchange), leases,
//! the IO shell around [`Dispatch`] (posting its requests, feeding it completions from each CQ's
//! completion channel, rebuilding rails, ending ops), cancellation, and the fallback of ops
//! that lost every rail.
//!
//! Every op is in one place at a time, recorded under the connection's lock: waiting for its
//! lease, in the dispatcher, or handed to another backend. A completion's drop looks there.
//!
//! `state` holds what is under the lock and what every part reaches; `setup` opens a
//! connection; `shell` is the IO around the dispatcher; `tasks` are the background tasks; this
//! file is the `Connection` the engine holds.

mod setup;
mod shell;
mod state;
mod tasks;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use tensorwire_core::backend::{Completion, Connection, Direction, Op};
use tensorwire_core::{Error, Result};
use tokio::sync::oneshot;

use crate::control;
use crate::region::unregistered;
use crate::shared::lock;
use crate::wire::Msg;

use self::state::{After, LeaseKey, OpCtx, Place};
pub(crate) use setup::connect;
pub(crate) use state::ConnShared;

/// The connection as the engine holds it; dropping it ends the connection.
#[derive(Debug)]
pub(crate) struct RdmaConnection {
    conn: Arc<ConnShared>,
}

impl RdmaConnection {
    pub(crate) fn new(conn: Arc<ConnShared>) -> RdmaConnection {
        RdmaConnection { conn }
    }
}

impl Drop for RdmaConnection {
    fn drop(&mut self) {
        self.conn.close(Error::PeerClosed("rdma: connection dropped".into()));
    }
}

impl Connection for RdmaConnection {
    fn submit(&self, ops: Vec<Op>) -> Vec<Completion> {
        let c = &self.conn;
        let now = Instant::now();
        let mut completions = Vec::with_capacity(ops.len());
        let mut after = After::default();
        let mut out = Vec::new();
        let mut early: Vec<(Op, oneshot::Sender<Result<()>>, Result<()>)> = Vec::new();
        {
            let mut st = lock(&c.state);
            for op in ops {
                let id = st.next_id;
                st.next_id += 1;
                let (tx, rx) = oneshot::channel();
                let reads = op.dir() == Direction::Read;
                completions.push(Box::pin(RdmaCompletion {
                    rx,
                    conn: c.clone(),
                    id,
                    reads,
                    finished: false,
                }) as Completion);
                if let Some(e) = &st.closed {
                    early.push((op, tx, Err(e.clone())));
                    continue;
                }
                if op.local().is_empty() {
                    early.push((op, tx, Ok(())));
                    continue;
                }
                let Some(local) = c.backend.region(op.local().region_id()) else {
                    let e = unregistered(op.local().region_id());
                    early.push((op, tx, Err(e)));
                    continue;
                };
                let r = op.remote();
                let key = LeaseKey {
                    region: r.region,
                    write: op.dir() == Direction::Write,
                    key: r.key.to_bits(),
                };
                let ctx = OpCtx { local, lease: None, op, id, key, tx };
                match st.leases.get(&key).map(|l| l.0.clone()) {
                    Some(lease) => st.start(ctx, &lease, now, &mut out, &mut after),
                    None => {
                        st.places.insert(id, Place::Waiting(key));
                        if st.asked.insert(key) {
                            after.ask.push((key, ctx.op.remote().blob.clone()));
                        }
                        st.waiting.entry(key).or_default().push(ctx);
                    }
                }
            }
            c.run(&mut st, out, now, &mut after);
        }
        for (op, tx, r) in early {
            drop(op);
            let _ = tx.send(r);
        }
        c.finish(after);
        completions
    }

    fn notify(&self, msg: Bytes) -> Completion {
        let c = self.conn.clone();
        Box::pin(async move {
            let limit = c.backend.cfg.answer_timeout;
            let m = control::ask(&c.sender, &c.requests, limit, "notification answer", |req| {
                Msg::Notify { req, msg }
            })
            .await?;
            match m {
                Msg::NotifyAck { error: None, .. } => Ok(()),
                Msg::NotifyAck { error: Some(e), .. } => Err(e),
                other => Err(Error::protocol(format!(
                    "rdma: notification answered with kind {}",
                    other.kind()
                ))),
            }
        })
    }

    fn broken(&self) -> Option<Error> {
        lock(&self.conn.state).closed.clone()
    }
}

/// One op's completion; dropping it before it resolves cancels the op (see the crate docs).
struct RdmaCompletion {
    rx: oneshot::Receiver<Result<()>>,
    conn: Arc<ConnShared>,
    id: u64,
    reads: bool,
    finished: bool,
}

impl Future for RdmaCompletion {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(r) => {
                self.finished = true;
                Poll::Ready(r.unwrap_or_else(|_| {
                    Err(Error::PeerClosed("rdma: the op was dropped unfinished".into()))
                }))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for RdmaCompletion {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.cancel(self.id, self.reads);
        }
    }
}
