//! Consuming: a payload's bytes read into the consumer's destination, p2p (subscribed to the
//! producer, chunk by chunk) or from the store, yielding a view per chunk as it lands.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_core::{
    ChunkPlan, EngineId, Region, Session, TensorMeta, TransferHandle, TransferOp,
};
use tensorwire_store::StoreError;
use tokio::sync::mpsc;

use crate::control::Control;
use crate::error::{ConnectorError, Result};
use crate::handoff::{Fetch, FetchStep, Next};
use crate::payload::LeasePolicy;
use crate::reference::{PayloadRef, Source};

use super::state::{
    ChunkView, DiffusionConnector, Inner, ToFetch, WINDOW, crc_of, fits, hold_for, hold_ms, plan_of,
};
use super::turn::Turn;

impl DiffusionConnector {
    /// Fetches a payload into `dst` at `offset`, yielding a view per chunk as it lands. With
    /// `expect`, the payload's dtype and shape must match it. Once every chunk has landed the
    /// payload is reported consumed (a `DeleteOnConsume` lease counts this consumer).
    pub fn consume(
        &self,
        r: &PayloadRef,
        dst: Arc<Region>,
        offset: u64,
        expect: Option<&TensorMeta>,
    ) -> Result<Consumption> {
        self.fetch(r, dst, offset, expect, true)
    }

    /// [`DiffusionConnector::consume`] without the report: the payload stays as it was (a
    /// `DeleteOnConsume` payload stays for another consumer) until [`DiffusionConnector::release`].
    /// A stage worker consumes its inputs this way and releases them once its result is
    /// committed, so a worker that dies mid-stage leaves its inputs for the retry.
    pub fn consume_held(
        &self,
        r: &PayloadRef,
        dst: Arc<Region>,
        offset: u64,
        expect: Option<&TensorMeta>,
    ) -> Result<Consumption> {
        self.fetch(r, dst, offset, expect, false)
    }

    /// Reports `r` consumed, as [`DiffusionConnector::consume`] does when its last chunk lands:
    /// a `DeleteOnConsume` lease counts one consumer (other policies end on their own). Any
    /// holder of the reference may release it, whether or not this connector read it. Releasing
    /// a payload that is gone already (released, expired, or its p2p producer died) is not an
    /// error.
    pub async fn release(&self, r: &PayloadRef) -> Result<()> {
        if !matches!(r.lease, LeasePolicy::DeleteOnConsume { .. }) {
            return Ok(());
        }
        match &r.source {
            Source::Store { key } => {
                let store = self.inner.store.as_ref().ok_or_else(|| {
                    ConnectorError::InvalidArgument("a store payload without a store".into())
                })?;
                match store.consumed(key).await {
                    Ok(_) | Err(StoreError::NotFound { .. }) => {} // released already, or expired
                    Err(e) => return Err(e.into()),
                }
            }
            Source::P2p { addr, payload, region, .. } => {
                // Ends when this returns: a later consume or release goes after this report.
                let mut turn = Turn::take(&self.inner, region.engine, *payload);
                turn.wait_before().await;
                let s = match session_to(&self.inner, *addr).await {
                    Ok(s) if s.peer() == region.engine => s,
                    _ => return Ok(()), // the producer, and its payload, are gone
                };
                // A payload no longer served refuses it: released already, nothing to do.
                let done = Control::Done { payload: *payload, consumed: true };
                let _ = s.notify(Bytes::from(done.encode())).await;
            }
        }
        Ok(())
    }

    pub(super) fn fetch(
        &self,
        r: &PayloadRef,
        dst: Arc<Region>,
        offset: u64,
        expect: Option<&TensorMeta>,
        report: bool,
    ) -> Result<Consumption> {
        if let Some(e) = expect {
            if e.dtype != r.meta.dtype || e.shape != r.meta.shape {
                return Err(ConnectorError::Mismatch(format!(
                    "payload is {:?} {:?}, destination expects {:?} {:?}",
                    r.meta.dtype, r.meta.shape, e.dtype, e.shape
                )));
            }
        }
        let plan = plan_of(&r.meta, r.chunking)?;
        fits(&dst, offset, &plan)?;
        let (tx, rx) = mpsc::channel(plan.len() as usize + 1);
        // Taken here, in the caller's call: a consume or release of the payload asked for after
        // this one returns goes after it, whenever their tasks run.
        let turn = match &r.source {
            Source::P2p { payload, region, .. } => {
                Some(Turn::take(&self.inner, region.engine, *payload))
            }
            Source::Store { .. } => None,
        };
        let inner = self.inner.clone();
        let r = r.clone();
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let at = Destination { region: &dst, offset, plan: &plan };
            let out = match &r.source {
                Source::P2p { .. } => consume_p2p(&inner, &r, at, &tx, report, turn).await,
                Source::Store { key } => consume_store(&inner, &r, key, at, &tx, report).await,
            };
            match out {
                Ok(()) => consumed(r.kind.name(), plan.extent(), started.elapsed()),
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                }
            }
        });
        Ok(Consumption { rx, task })
    }
}

/// A consume's last byte landed: its count, bytes and time in the metrics.
pub(super) fn consumed(kind: &'static str, bytes: u64, took: Duration) {
    metrics::counter!("tensorwire_handoff_consumes_total", "kind" => kind).increment(1);
    metrics::counter!("tensorwire_handoff_bytes_total", "kind" => kind, "direction" => "in")
        .increment(bytes);
    metrics::histogram!("tensorwire_handoff_seconds", "kind" => kind).record(took.as_secs_f64());
}

/// Chunk views arriving for one consume.
#[derive(Debug)]
pub struct Consumption {
    rx: mpsc::Receiver<Result<ChunkView>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Consumption {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Consumption {
    /// The next chunk to land, `Ok(None)` once every chunk has.
    pub async fn next(&mut self) -> Result<Option<ChunkView>> {
        self.rx.recv().await.transpose()
    }

    /// Waits for every chunk; returns them in landing order.
    pub async fn all(mut self) -> Result<Vec<ChunkView>> {
        let mut v = Vec::new();
        while let Some(c) = self.next().await? {
            v.push(c);
        }
        Ok(v)
    }
}

/// Where a consume lands.
#[derive(Debug, Clone, Copy)]
pub(super) struct Destination<'a> {
    region: &'a Region,
    offset: u64,
    plan: &'a ChunkPlan,
}

impl Destination<'_> {
    pub(super) fn view(&self, index: u32) -> Result<ChunkView> {
        self.plan.landed(index, self.offset).map_err(|e| ConnectorError::Internal(e.to_string()))
    }

    pub(super) fn crc(&self, index: u32) -> Result<u32> {
        let c = self.plan.chunk(index).map_err(|e| ConnectorError::Internal(e.to_string()))?;
        crc_of(self.region, self.offset, &c.ranges)
    }
}

pub(super) async fn session_to(inner: &Inner, addr: SocketAddr) -> Result<Session> {
    let mut s = inner.sessions.lock().await;
    if let Some(x) = s.get(&addr) {
        return Ok(x.clone());
    }
    let x = inner.engine.connect(addr).await.map_err(ConnectorError::from_producer)?;
    s.insert(addr, x.clone());
    Ok(x)
}

/// Why a read of a p2p payload, or its `Done`, failed. A buffer no longer registered, or a
/// refused `Done` or subscription, means the payload ended: the producer says why in a Gone
/// message of its own.
pub(super) async fn read_failed(
    e: tensorwire_core::Error,
    payload: u64,
    rx: &mut mpsc::Receiver<Result<Control>>,
    wait: Duration,
) -> ConnectorError {
    if !matches!(e, tensorwire_core::Error::NotFound(_)) {
        return ConnectorError::from_producer(e);
    }
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Some(c)) = tokio::time::timeout_at(deadline, rx.recv()).await {
        match c {
            Ok(Control::Gone { why, .. }) => return why.error(payload),
            Err(e) => return e,
            Ok(_) => {}
        }
    }
    ConnectorError::ProducerGone(format!("payload {payload}: its buffer is gone ({e})"))
}

/// Removes the waiter entry however the consume ends, unless a later consume of the payload
/// (in its turn, once this one's report left) has put its own there since.
pub(super) struct Waiter<'a>(&'a Inner, (EngineId, u64), ToFetch);

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        let mut w = self.0.waiters.lock();
        if w.get(&self.1).is_some_and(|tx| tx.same_channel(&self.2)) {
            w.remove(&self.1);
        }
    }
}

/// One consume's subscription to a p2p payload: sent at once (unordered: it follows no data),
/// holding the payload's buffer for this consumer, and ended exactly once by `Done` (counting
/// the consumer with the report, or not however else the consume ends), in the background after
/// the subscription itself and ordered after the consume's reads (a cancelled read has ended by
/// then). A chunked payload's goes on its own: its verdict is known once its `notify` returns
/// (a refused one is followed by the producer's Gone, which says why; one that could not be
/// delivered ends the fetch through `to`). An unchunked payload's rides with the read, which
/// succeeds only if the producer accepted it.
pub(super) struct Subscription {
    session: Session,
    payload: u64,
    verdict: Verdict,
    /// The consume's turn at the payload, ended once `Done` has left (or none was owed).
    turn: Option<Turn>,
}

/// Where a subscription stands, as far as its consumer knows.
pub(super) enum Verdict {
    /// Its `notify` is under way, on its own task; it answers whether the producer accepted it.
    Pending(tokio::task::JoinHandle<bool>),
    /// It rides with the read, whose outcome is its verdict: until the read succeeded, the
    /// producer may or may not have it (a `Done` then ends it either way).
    Riding,
    /// Accepted.
    Accepted,
    /// Ended: `Done` is on its way, or was never owed.
    Ended,
}

impl Subscription {
    pub(super) fn new(
        session: &Session,
        payload: u64,
        verdict: Verdict,
        turn: Option<Turn>,
    ) -> Subscription {
        Subscription { session: session.clone(), payload, verdict, turn }
    }

    pub(super) fn message(payload: u64, hold: Duration) -> Bytes {
        Bytes::from(Control::Subscribe { payload, hold_ms: hold_ms(hold) }.encode())
    }

    /// Sends the subscription on its own task (the consume waits for announcements meanwhile).
    pub(super) fn start(
        session: &Session,
        payload: u64,
        hold: Duration,
        to: ToFetch,
        turn: Option<Turn>,
    ) -> Subscription {
        let (bytes, s) = (Self::message(payload, hold), session.clone());
        let send = tokio::spawn(async move {
            match s.notify_unordered(bytes).await {
                Ok(()) => true,
                Err(tensorwire_core::Error::NotFound(_)) => false, // a Gone follows
                Err(e) => {
                    let _ = to.send(Err(ConnectorError::from_producer(e))).await;
                    false
                }
            }
        });
        Self::new(session, payload, Verdict::Pending(send), turn)
    }

    /// A subscription that rides with the read (returned with the message to carry): the read
    /// succeeds only if the producer accepted it.
    pub(super) fn riding(
        session: &Session,
        payload: u64,
        hold: Duration,
        turn: Option<Turn>,
    ) -> (Subscription, Bytes) {
        (Self::new(session, payload, Verdict::Riding, turn), Self::message(payload, hold))
    }

    /// The read it rode with succeeded: the producer accepted it.
    pub(super) fn confirmed(&mut self) {
        if matches!(self.verdict, Verdict::Riding) {
            self.verdict = Verdict::Accepted;
        }
    }

    /// Ends the subscription, in the background; a later consume or release of the payload
    /// waits for it (the turn ends with the task that sends `Done`). A refused one is owed no
    /// `Done`; one whose verdict is unknown gets one (a producer that refused it refuses that
    /// too).
    pub(super) fn end(&mut self, consumed: bool) {
        let verdict = match std::mem::replace(&mut self.verdict, Verdict::Ended) {
            Verdict::Pending(send) => Some(send),
            Verdict::Accepted | Verdict::Riding => None,
            Verdict::Ended => return,
        };
        let (s, payload, turn) = (self.session.clone(), self.payload, self.turn.take());
        let msg = Bytes::from(Control::Done { payload, consumed }.encode());
        tokio::spawn(async move {
            let accepted = match verdict {
                Some(send) => send.await.unwrap_or(false),
                None => true,
            };
            if !accepted {
                tracing::debug!(payload, "connector: not subscribed; nothing to end");
            } else if let Err(e) = s.notify(msg).await {
                tracing::debug!(payload, error = %e, "connector: ending a subscription");
            }
            drop(turn); // the report has left: the next consume or release of the payload goes
        });
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if !matches!(self.verdict, Verdict::Ended) && tokio::runtime::Handle::try_current().is_ok()
        {
            self.end(false);
        }
    }
}

pub(super) async fn consume_p2p(
    inner: &Arc<Inner>,
    r: &PayloadRef,
    dst: Destination<'_>,
    out: &mpsc::Sender<Result<ChunkView>>,
    report: bool,
    mut turn: Option<Turn>,
) -> Result<()> {
    let Source::P2p { addr, payload, region: ref remote, offset: base } = r.source else {
        return Err(ConnectorError::Internal("not a p2p payload".into()));
    };
    let engine = remote.engine;
    if let Some(t) = turn.as_mut() {
        t.wait_before().await;
    }
    let s = session_to(inner, addr).await?;
    if s.peer() != engine {
        return Err(ConnectorError::ProducerGone(format!(
            "{engine} at {addr}: another engine answers there"
        )));
    }
    let (tx, rx) = mpsc::channel(dst.plan.len() as usize + 4);
    inner.waiters.lock().insert((engine, payload), tx.clone());
    let _w = Waiter(inner, (engine, payload), tx.clone());
    // The producer keeps the buffer for this consumer until `held_until` at least (its clock
    // starts when the subscription arrives, after this one): a read that ends later may have
    // read a buffer given back, and fails the consume.
    let wait = inner.cfg.wait_timeout;
    let hold = hold_for(wait, dst.plan.len());
    let held_until = tokio::time::Instant::now() + hold;
    // An unchunked payload's subscription rides with its read; a chunked one's goes first, on
    // its own task. Declared before the reads, so dropped after them (the `Done` on the way out
    // is ordered after the reads' cancellation).
    let p = P2pRead { s, remote, base, payload, dst, wait, hold, held_until, rx };
    match r.chunking {
        None => {
            let (subscription, notice) = Subscription::riding(&p.s, payload, hold, turn);
            p.whole(subscription, notice, r.checksum, out, report).await
        }
        Some(_) => {
            let subscription = Subscription::start(&p.s, payload, hold, tx, turn);
            p.chunked(subscription, out, report).await
        }
    }
}

/// One consume of a p2p payload under way.
pub(super) struct P2pRead<'a> {
    s: Session,
    remote: &'a tensorwire_core::RemoteRegion,
    base: u64,
    payload: u64,
    dst: Destination<'a>,
    wait: Duration,
    hold: Duration,
    held_until: tokio::time::Instant,
    rx: mpsc::Receiver<Result<Control>>,
}

impl P2pRead<'_> {
    /// Submits the reads of chunk `index`, the first with `notice` when there is one.
    pub(super) async fn submit(
        &self,
        index: u32,
        notice: Option<Bytes>,
    ) -> Result<Vec<TransferHandle>> {
        let chunk =
            self.dst.plan.chunk(index).map_err(|e| ConnectorError::Internal(e.to_string()))?;
        let (dst, remote, base) = (&self.dst, self.remote, self.base);
        let ops = chunk
            .ranges
            .iter()
            .map(|b| {
                TransferOp::read(dst.region, dst.offset + b.offset, remote, base + b.offset, b.len)
            })
            .collect();
        Ok(match notice {
            Some(n) => self.s.submit_with_notice(n, ops).await,
            None => self.s.submit(ops).await,
        })
    }

    /// Waits for `reads`; then they must have ended within the producer's hold.
    pub(super) async fn landed(&mut self, reads: Vec<TransferHandle>) -> Result<()> {
        for h in reads {
            if let Err(e) = h.await {
                return Err(read_failed(e, self.payload, &mut self.rx, self.wait).await);
            }
        }
        if tokio::time::Instant::now() >= self.held_until {
            let what = format!("reads of payload {} within the producer's hold", self.payload);
            return Err(ConnectorError::Timeout { what, after: self.hold });
        }
        Ok(())
    }

    /// An unchunked payload is complete at publish: its subscription rides with its read (the
    /// producer's backend delivers it before serving the read where it can, beside it where it
    /// cannot), and the read succeeds only if the producer accepted it. The producer accepts the
    /// subscription only if it still serves the payload when it arrives; a payload no longer
    /// served is never served again, so it was served throughout every read before, and the
    /// subscription holds it for the reads after. A read that succeeded so confirms its bytes
    /// without a round trip after it; a refused subscription fails the read, and a Gone says
    /// why. `Done` goes in the background.
    pub(super) async fn whole(
        mut self,
        mut subscription: Subscription,
        notice: Bytes,
        checksum: Option<u32>,
        out: &mpsc::Sender<Result<ChunkView>>,
        report: bool,
    ) -> Result<()> {
        let reads = self.submit(0, Some(notice)).await?;
        self.landed(reads).await?;
        subscription.confirmed();
        if let Some(expected) = checksum {
            let actual = self.dst.crc(0)?;
            if actual != expected {
                let what = format!("payload {}", self.payload);
                return Err(ConnectorError::Checksum { what, expected, actual });
            }
        }
        // The report first: the consume ends with the view, and the caller's `all` returns once
        // this task has ended (the view sent first left the report's set-up between them, about
        // 20 us of a 4 MiB handoff). The bytes are in and checked either way.
        subscription.end(report);
        let _ = out.send(self.dst.view(0)).await;
        Ok(())
    }

    /// A chunked payload: read each chunk as it is announced, within a window, and say `Done`
    /// once every chunk landed.
    pub(super) async fn chunked(
        mut self,
        mut subscription: Subscription,
        out: &mpsc::Sender<Result<ChunkView>>,
        report: bool,
    ) -> Result<()> {
        let (payload, dst) = (self.payload, self.dst);
        let mut reads_of: HashMap<u32, Vec<TransferHandle>> = HashMap::new();
        let mut fetch = Fetch::new(payload, dst.plan.len(), WINDOW);
        let mut steps = Vec::new();
        loop {
            for step in std::mem::take(&mut steps) {
                match step {
                    FetchStep::Read(index) => {
                        let reads = self.submit(index, None).await?;
                        reads_of.insert(index, reads);
                    }
                    FetchStep::Yield(index) => {
                        if out.send(dst.view(index)).await.is_err() {
                            return Ok(()); // the consumer stopped listening
                        }
                    }
                    // Every view is out; the lease moves on once the producer knows. The report
                    // completes in the background: the consumer has its bytes and does not wait a
                    // round trip for it (a later consume of this payload does).
                    FetchStep::Report => {
                        subscription.end(report);
                        return Ok(());
                    }
                    FetchStep::Fail(e) => return Err(e),
                }
            }
            steps = match fetch.next() {
                Next::Done => return Ok(()),
                Next::Landing { index, or_message } => {
                    // A message already here goes first, while there is room for more reads.
                    match or_message.then(|| self.rx.try_recv().ok()).flatten() {
                        Some(c) => fetch.on_message(&c?),
                        None => {
                            self.landed(reads_of.remove(&index).unwrap_or_default()).await?;
                            let crc =
                                if fetch.wants_crc(index) { Some(dst.crc(index)?) } else { None };
                            fetch.on_landed(index, crc)
                        }
                    }
                }
                Next::Message => match tokio::time::timeout(self.wait, self.rx.recv()).await {
                    Ok(Some(c)) => fetch.on_message(&c?),
                    Ok(None) => return Err(ConnectorError::Internal("connector closed".into())),
                    Err(_) => {
                        return Err(ConnectorError::Timeout {
                            what: format!(
                                "chunk announcements of payload {payload} from {}",
                                self.s.peer()
                            ),
                            after: self.wait,
                        });
                    }
                },
            };
        }
    }
}

pub(super) async fn consume_store(
    inner: &Inner,
    r: &PayloadRef,
    key: &[u8],
    dst: Destination<'_>,
    out: &mpsc::Sender<Result<ChunkView>>,
    report: bool,
) -> Result<()> {
    let store = inner
        .store
        .as_ref()
        .ok_or_else(|| ConnectorError::InvalidArgument("a store payload without a store".into()))?;
    let wait = inner.cfg.wait_timeout;
    let deadline = Instant::now() + wait;
    let mut pause = Duration::from_millis(1);
    while !store.exists(key).await? {
        if Instant::now() >= deadline {
            return Err(ConnectorError::Missing {
                payload: String::from_utf8_lossy(key).into_owned(),
                why: format!(
                    "not in the store within {wait:?} (never published, consumed, or expired)"
                ),
            });
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    let (meta, _) = store.get_into(key, dst.region, dst.offset).await?;
    if meta.dtype != r.meta.dtype || meta.shape != r.meta.shape {
        return Err(ConnectorError::Mismatch("stored payload does not match its reference".into()));
    }
    if let Some(expected) = r.checksum {
        let actual = dst.region.slice(dst.offset, dst.plan.extent())?.crc32c()?;
        if actual != expected {
            let what = format!("payload {}", String::from_utf8_lossy(key));
            return Err(ConnectorError::Checksum { what, expected, actual });
        }
    }
    for i in 0..dst.plan.len() {
        if out.send(dst.view(i)).await.is_err() {
            break;
        }
    }
    if report && matches!(r.lease, LeasePolicy::DeleteOnConsume { .. }) {
        store.consumed(key).await?;
    }
    Ok(())
}
