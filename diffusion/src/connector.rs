//! The `DiffusionConnector`: what a stage worker calls to hand its output to the next stage and to
//! fetch its inputs. The decisions are the sans-IO state machines of [`crate::handoff`]; this
//! file is the IO around them (the engine, the store, the notification stream).
//!
//! - **p2p**: the payload stays in the producer's registered buffer (kept alive by the connector
//!   until its lease ends). A consumer subscribes; the producer announces chunks as it marks them
//!   ready; the consumer READs each chunk's byte ranges straight into its destination as soon as it
//!   is announced and yields a view per chunk, in landing order; then reports it consumed.
//! - **store**: once every chunk is ready the producer's bytes go to the store (`put_from`) and the
//!   buffer is released; the consumer waits (bounded) for the key, `get_into`s its destination,
//!   and the store's lease (consumer count or TTL) removes the object.
//! - **auto**: p2p when the consumer is known and has credit at publish time, store otherwise.
//!
//! Every wait is bounded by [`ConnectorConfig::wait_timeout`]; a producer that died surfaces as
//! [`ConnectorError::ProducerGone`] or a timeout, never a hang.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use tensorwire_core::{
    ByteRange, ChunkPlan, Engine, EngineId, Region, Session, TensorMeta, TransferHandle, TransferOp,
};
use tensorwire_store::{Retention, Store, StoreError};
use tokio::sync::mpsc;

use crate::control::Control;
use crate::error::{ConnectorError, Result};
use crate::handoff::{Action, Fetch, FetchStep, Next, Publisher};
use crate::lease::Lease;
use crate::payload::{Chunking, LeasePolicy, StagePayload};
use crate::reference::{PayloadRef, Source};

/// How payloads travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Consumer reads from the producer's buffer.
    P2p,
    /// Relayed through the store.
    Store,
    /// p2p when the consumer is known and has credit at publish time, store otherwise.
    Auto,
}

/// What the producer knows about the consumer at publish time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerHint {
    /// Free slots the consumer advertised.
    pub credit: u32,
}

/// Connector settings.
#[derive(Debug, Clone)]
pub struct ConnectorConfig {
    /// Transfer mode.
    pub mode: Mode,
    /// crc32c per chunk (p2p) or per payload (store), verified by the consumer.
    pub checksum: bool,
    /// Bound on every wait: a chunk announcement, a store key appearing.
    pub wait_timeout: Duration,
}

impl Default for ConnectorConfig {
    fn default() -> Self {
        ConnectorConfig { mode: Mode::Auto, checksum: false, wait_timeout: Duration::from_secs(30) }
    }
}

/// One chunk of a payload, now in the consumer's destination (its ranges are offsets in the
/// destination region).
pub type ChunkView = tensorwire_core::LandedChunk;

/// A held payload's memory, and where it goes in store mode.
#[derive(Debug)]
struct Buffer {
    region: Arc<Region>,
    offset: u64,
    plan: ChunkPlan,
    meta: TensorMeta,
    /// Store mode: the key, retention and lease it is stored with.
    store: Option<(Vec<u8>, Retention, LeasePolicy)>,
}

/// Chunks in flight per consume (reads of later chunks proceed while earlier ones land).
const WINDOW: usize = 4;

#[derive(Debug)]
struct Inner {
    engine: Engine,
    store: Option<Arc<dyn Store>>,
    cfg: ConnectorConfig,
    publisher: Mutex<Publisher<Buffer>>,
    waiters: Mutex<HashMap<(EngineId, u64), mpsc::Sender<Control>>>,
    /// Consumption reports on their way, by (producer, payload): they complete in the
    /// background, and a later consume of the same payload waits for its report first, so it
    /// sees the payload consumed.
    reporting: Mutex<HashMap<(EngineId, u64), tokio::sync::watch::Receiver<bool>>>,
    /// Sessions with producers, by control address (one handshake per producer).
    sessions: tokio::sync::Mutex<HashMap<SocketAddr, Session>>,
    next: AtomicU64,
}

/// The connector (one per stage worker; it owns its engine's notification stream).
#[derive(Debug)]
pub struct DiffusionConnector {
    inner: Arc<Inner>,
    dispatcher: tokio::task::JoinHandle<()>,
}

impl Drop for DiffusionConnector {
    fn drop(&mut self) {
        self.dispatcher.abort();
    }
}

/// The crc32c of `ranges` of `region` (offsets relative to `base`).
fn crc_of(region: &Region, base: u64, ranges: &[ByteRange]) -> Result<u32> {
    ranges.iter().try_fold(0u32, |crc, r| {
        let s = region.slice(base + r.offset, r.len)?;
        Ok(s.with_host_bytes(|b| crc32c::crc32c_append(crc, b))?)
    })
}

fn plan_of(meta: &TensorMeta, chunking: Option<Chunking>) -> Result<ChunkPlan> {
    let plan = match chunking {
        Some(c) => ChunkPlan::new(meta, c.dim as usize, c.count),
        None if meta.shape.is_empty() => {
            return Err(ConnectorError::Mismatch(
                "a scalar payload has nothing to hand off".into(),
            ));
        }
        None => ChunkPlan::new(meta, 0, 1),
    };
    plan.map_err(|e| ConnectorError::Mismatch(e.to_string()))
}

fn fits(region: &Region, offset: u64, plan: &ChunkPlan) -> Result<()> {
    match offset.checked_add(plan.extent()) {
        Some(end) if end <= region.len() => Ok(()),
        _ => Err(ConnectorError::DestinationTooSmall {
            region: region.id().0,
            offset,
            needed: plan.extent(),
            len: region.len(),
        }),
    }
}

fn store_key(engine: EngineId, id: u64) -> Vec<u8> {
    format!("tw/{engine}/{id}").into_bytes()
}

impl DiffusionConnector {
    /// A connector over `engine` (and `store`, needed for store and auto modes).
    pub fn new(
        engine: Engine,
        store: Option<Arc<dyn Store>>,
        cfg: ConnectorConfig,
    ) -> DiffusionConnector {
        let inner = Arc::new(Inner {
            engine,
            store,
            cfg,
            publisher: Mutex::default(),
            waiters: Mutex::default(),
            reporting: Mutex::default(),
            sessions: tokio::sync::Mutex::default(),
            next: AtomicU64::new(1),
        });
        let dispatcher = tokio::spawn(dispatch(Arc::downgrade(&inner)));
        DiffusionConnector { inner, dispatcher }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// Payloads this connector still holds (p2p buffers waiting for consumers, store puts
    /// waiting for chunks).
    pub fn held(&self) -> usize {
        self.inner.publisher.lock().held()
    }

    /// Publishes a payload; returns at once. An unchunked payload is ready now; a chunked one
    /// becomes available chunk by chunk through [`Publication::mark_ready`].
    pub fn publish(&self, p: StagePayload, hint: Option<ConsumerHint>) -> Result<Publication> {
        let inner = &self.inner;
        let plan = plan_of(&p.meta, p.chunking)?;
        fits(&p.region, p.offset, &plan)?;
        let p2p = match inner.cfg.mode {
            Mode::P2p => true,
            Mode::Store => false,
            Mode::Auto => hint.is_some_and(|h| h.credit > 0),
        };
        if !p2p && inner.store.is_none() {
            return Err(ConnectorError::InvalidArgument("store mode without a store".into()));
        }
        if p2p && !p.region.permissions().read {
            return Err(ConnectorError::InvalidArgument(format!(
                "p2p payload region {} must be readable by peers (Permissions::READ)",
                p.region.id().0
            )));
        }
        let id = inner.next.fetch_add(1, Ordering::Relaxed);
        let engine = inner.engine.id();
        let chunked = p.chunking.is_some();
        // p2p chunks carry their checksums in their announcements; a stored payload carries the
        // checksum of all its bytes.
        let checksum = match !p2p && inner.cfg.checksum {
            true => Some(p.region.slice(p.offset, plan.extent())?.crc32c()?),
            false => None,
        };
        let source = if p2p {
            let (region, addr) = (p.region.remote(), inner.engine.local_addr());
            Source::P2p { addr, payload: id, region, offset: p.offset }
        } else {
            Source::Store { key: store_key(engine, id) }
        };
        let reference = PayloadRef {
            request: p.request,
            kind: p.kind,
            source,
            meta: p.meta.clone(),
            chunking: p.chunking,
            lease: p.lease,
            checksum,
        };
        let retention = match p.lease {
            LeasePolicy::SoftPin => Retention::Soft,
            _ => Retention::Pinned, // consumer counts and TTLs remove it; never evicted before
        };
        let chunks = plan.len();
        let buffer = Buffer {
            region: p.region,
            offset: p.offset,
            plan,
            meta: p.meta,
            store: (!p2p).then(|| (store_key(engine, id), retention, p.lease)),
        };
        let lease = Lease::new(p.lease, Instant::now());
        inner.publisher.lock().publish(id, buffer, chunks, lease, !p2p);
        let mut publication = Publication {
            reference,
            id,
            inner: Arc::downgrade(inner),
            complete: false,
            stored: None,
        };
        if !chunked {
            publication.mark_ready(0)?;
        }
        Ok(publication)
    }

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
                let s = match session_to(&self.inner, *addr).await {
                    Ok(s) if s.peer() == region.engine => s,
                    _ => return Ok(()), // the producer, and its payload, are gone
                };
                // Only a subscriber's report counts; subscribing again is harmless.
                for c in [
                    Control::Subscribe { payload: *payload },
                    Control::Consumed { payload: *payload },
                ] {
                    if s.notify(Bytes::from(c.encode())).await.is_err() {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }

    fn fetch(
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
        let inner = self.inner.clone();
        let r = r.clone();
        let task = tokio::spawn(async move {
            let at = Destination { region: &dst, offset, plan: &plan };
            let out = match &r.source {
                Source::P2p { .. } => consume_p2p(&inner, &r, at, &tx, report).await,
                Source::Store { key } => consume_store(&inner, &r, key, at, &tx, report).await,
            };
            if let Err(e) = out {
                let _ = tx.send(Err(e)).await;
            }
        });
        Ok(Consumption { rx, task })
    }

    /// Drops a p2p payload now (its lease notwithstanding); subscribers are told it is gone.
    pub fn retire(&self, p: &Publication) {
        let mut out = Vec::new();
        self.inner.publisher.lock().retire(p.id, &mut out);
        act(&self.inner, out);
    }
}

/// Carries out the publisher's actions; returns the store put a `Store` action started.
fn act(
    inner: &Arc<Inner>,
    actions: Vec<Action<Buffer>>,
) -> Option<tokio::task::JoinHandle<Result<()>>> {
    let mut put = None;
    for a in actions {
        match a {
            Action::Send { to, msg } => {
                let inner = inner.clone();
                tokio::spawn(async move { tell(&inner, to, &msg).await });
            }
            Action::Release { buffer, .. } => drop(buffer),
            Action::Store { buffer, .. } => {
                let store = inner.store.clone();
                put = Some(tokio::spawn(async move {
                    let r = store_put(store, buffer).await;
                    if let Err(e) = &r {
                        tracing::warn!(error = %e, "connector: store put failed");
                    }
                    r
                }));
            }
        }
    }
    put
}

/// Puts a complete store-mode payload and sets its lease; the buffer is released once the store
/// has the bytes.
async fn store_put(store: Option<Arc<dyn Store>>, b: Buffer) -> Result<()> {
    let store =
        store.ok_or_else(|| ConnectorError::Internal("a store payload without a store".into()))?;
    let (key, retention, lease) = b
        .store
        .ok_or_else(|| ConnectorError::Internal("a p2p payload sent to the store".into()))?;
    let bytes = b.region.slice(b.offset, b.plan.extent())?;
    store.put_from(&key, &b.meta, &bytes, retention).await?;
    drop(bytes);
    drop(b.region);
    match lease {
        LeasePolicy::DeleteOnConsume { consumers } => {
            store.set_lease(&key, consumers, None).await?
        }
        LeasePolicy::Ttl(d) => store.set_lease(&key, 0, Some(d)).await?,
        LeasePolicy::SoftPin | LeasePolicy::Pinned => {}
    }
    Ok(())
}

/// A published payload.
#[derive(Debug)]
pub struct Publication {
    /// What consumers need (send it in a queue message).
    pub reference: PayloadRef,
    id: u64,
    inner: Weak<Inner>,
    complete: bool,
    stored: Option<tokio::task::JoinHandle<Result<()>>>,
}

impl Publication {
    /// The connector's id for this payload.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Chunk `index` is written and may be sent. Marking a chunk twice, or one past the plan,
    /// is [`ConnectorError::InvalidArgument`].
    pub fn mark_ready(&mut self, index: u32) -> Result<()> {
        let inner = self
            .inner
            .upgrade()
            .ok_or_else(|| ConnectorError::Internal("connector dropped".into()))?;
        let mut out = Vec::new();
        let complete = {
            let mut publisher = inner.publisher.lock();
            let crc = match publisher.buffer(self.id) {
                Some(b) if inner.cfg.checksum && b.store.is_none() => {
                    let chunk = b
                        .plan
                        .chunk(index)
                        .map_err(|e| ConnectorError::InvalidArgument(e.to_string()))?;
                    Some(crc_of(&b.region, b.offset, &chunk.ranges)?)
                }
                _ => None,
            };
            publisher.mark_ready(self.id, index, crc, &mut out)?
        };
        self.complete = complete;
        if let Some(put) = act(&inner, out) {
            self.stored = Some(put);
        }
        Ok(())
    }

    /// Store mode: waits until the store holds the payload (every chunk marked, put done);
    /// returns at once in p2p mode. Publishing never needs this; a producer that wants its
    /// consumers to find the payload without waiting calls it before announcing the reference.
    pub async fn stored(&mut self) -> Result<()> {
        match self.stored.take() {
            Some(job) => {
                job.await.map_err(|e| ConnectorError::Internal(format!("store put task: {e}")))?
            }
            None => Ok(()),
        }
    }

    /// Marks every chunk not yet marked.
    pub fn mark_all_ready(&mut self) -> Result<()> {
        let inner = self
            .inner
            .upgrade()
            .ok_or_else(|| ConnectorError::Internal("connector dropped".into()))?;
        let n = plan_of(&self.reference.meta, self.reference.chunking)?.len();
        for i in 0..n {
            let ready = inner.publisher.lock().is_ready(self.id, i);
            if ready == Some(false) {
                self.mark_ready(i)?;
            }
        }
        Ok(())
    }
}

impl Drop for Publication {
    fn drop(&mut self) {
        // Abandoned before every chunk was ready: tell subscribers instead of letting them wait.
        let Some(inner) = self.inner.upgrade().filter(|_| !self.complete) else { return };
        let mut out = Vec::new();
        inner.publisher.lock().abandon(self.id, &mut out);
        if tokio::runtime::Handle::try_current().is_ok() {
            act(&inner, out);
        }
    }
}

/// Sends `msg` to `to` (best effort: a consumer that went away is not an error).
async fn tell(inner: &Inner, to: EngineId, msg: &Control) {
    if let Ok(s) = inner.engine.session(to) {
        if let Err(err) = s.notify(Bytes::from(msg.encode())).await {
            tracing::debug!(peer = %to, error = %err, "connector: could not notify");
        }
    }
}

/// The connector's notification loop: feeds the publisher and routes announcements to fetches.
async fn dispatch(inner: Weak<Inner>) {
    loop {
        let Some(i) = inner.upgrade() else { return };
        let n = match i.engine.recv_notification(Duration::from_millis(500)).await {
            Ok(n) => n,
            Err(tensorwire_core::Error::Timeout { .. }) => {
                let mut out = Vec::new();
                i.publisher.lock().sweep(Instant::now(), &mut out);
                act(&i, out);
                continue;
            }
            Err(_) => return, // engine shut down
        };
        let c = match Control::decode(&n.payload) {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(from = %n.from, error = %e, "connector: bad control message");
                continue;
            }
        };
        let mut out = Vec::new();
        match c {
            Control::Subscribe { payload } => {
                i.publisher.lock().subscribe(n.from, payload, Instant::now(), &mut out);
            }
            Control::Consumed { payload } => {
                i.publisher.lock().consumed(n.from, payload, Instant::now(), &mut out);
            }
            Control::Ready { payload, .. } | Control::Gone { payload, .. } => {
                let tx = i.waiters.lock().get(&(n.from, payload)).cloned();
                if let Some(tx) = tx {
                    let _ = tx.send(c).await;
                }
            }
        }
        act(&i, out);
    }
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
struct Destination<'a> {
    region: &'a Region,
    offset: u64,
    plan: &'a ChunkPlan,
}

impl Destination<'_> {
    fn view(&self, index: u32) -> Result<ChunkView> {
        self.plan.landed(index, self.offset).map_err(|e| ConnectorError::Internal(e.to_string()))
    }

    fn crc(&self, index: u32) -> Result<u32> {
        let c = self.plan.chunk(index).map_err(|e| ConnectorError::Internal(e.to_string()))?;
        crc_of(self.region, self.offset, &c.ranges)
    }
}

async fn session_to(inner: &Inner, addr: SocketAddr) -> Result<Session> {
    let mut s = inner.sessions.lock().await;
    if let Some(x) = s.get(&addr) {
        return Ok(x.clone());
    }
    let x = inner.engine.connect(addr).await.map_err(ConnectorError::from_producer)?;
    s.insert(addr, x.clone());
    Ok(x)
}

/// Why a read of a p2p payload failed. A buffer that is no longer registered means the payload
/// ended: the producer says why in answer to the subscription (sent before any read completes).
async fn read_failed(
    e: tensorwire_core::Error,
    payload: u64,
    rx: &mut mpsc::Receiver<Control>,
    wait: Duration,
) -> ConnectorError {
    if !matches!(e, tensorwire_core::Error::NotFound(_)) {
        return ConnectorError::from_producer(e);
    }
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Some(c)) = tokio::time::timeout_at(deadline, rx.recv()).await {
        if let Control::Gone { why, .. } = c {
            return why.error(payload);
        }
    }
    ConnectorError::ProducerGone(format!("payload {payload}: its buffer is gone ({e})"))
}

/// Removes the waiter entry however the consume ends.
struct Waiter<'a>(&'a Inner, (EngineId, u64));

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.0.waiters.lock().remove(&self.1);
    }
}

async fn consume_p2p(
    inner: &Arc<Inner>,
    r: &PayloadRef,
    dst: Destination<'_>,
    out: &mpsc::Sender<Result<ChunkView>>,
    report: bool,
) -> Result<()> {
    let Source::P2p { addr, payload, region: ref remote, offset: src_base } = r.source else {
        return Err(ConnectorError::Internal("not a p2p payload".into()));
    };
    let engine = remote.engine;
    let wait = inner.cfg.wait_timeout;
    let reported = inner.reporting.lock().get(&(engine, payload)).cloned();
    if let Some(mut r) = reported {
        let _ = tokio::time::timeout(wait, r.wait_for(|done| *done)).await;
    }
    let s = session_to(inner, addr).await?;
    if s.peer() != engine {
        return Err(ConnectorError::ProducerGone(format!(
            "{engine} at {addr}: another engine answers there"
        )));
    }
    let (tx, mut rx) = mpsc::channel(dst.plan.len() as usize + 4);
    inner.waiters.lock().insert((engine, payload), tx);
    let _w = Waiter(inner, (engine, payload));
    let mut reads: HashMap<u32, Vec<TransferHandle>> = HashMap::new();
    let (mut fetch, mut steps) = Fetch::new(payload, dst.plan.len(), WINDOW, r.chunking.is_none());
    // The subscription completes in the background: a read does not wait a round trip for it.
    // Chunk announcements and a Gone answer come once it lands; the consumption report (which
    // counts only from a subscriber) is sent after it.
    let mut subscribed: Option<tokio::task::JoinHandle<bool>> = None;
    loop {
        for step in std::mem::take(&mut steps) {
            match step {
                FetchStep::Read(index) => {
                    let chunk = dst
                        .plan
                        .chunk(index)
                        .map_err(|e| ConnectorError::Internal(e.to_string()))?;
                    let ops = chunk
                        .ranges
                        .iter()
                        .map(|b| {
                            TransferOp::read(
                                dst.region,
                                dst.offset + b.offset,
                                remote,
                                src_base + b.offset,
                                b.len,
                            )
                        })
                        .collect();
                    reads.insert(index, s.submit(ops).await);
                }
                FetchStep::Yield(index) => {
                    if out.send(dst.view(index)).await.is_err() {
                        return Ok(()); // the consumer stopped listening
                    }
                }
                // Every view is out; the lease moves on once the producer knows. The report goes
                // out now and completes in the background: the consumer has its bytes and does
                // not wait a round trip for it (a later consume of this payload does).
                FetchStep::Report if !report => return Ok(()),
                FetchStep::Report => {
                    let bytes = Bytes::from(Control::Consumed { payload }.encode());
                    let (done, pending) = tokio::sync::watch::channel(false);
                    inner.reporting.lock().insert((engine, payload), pending);
                    let (s, inner) = (s.clone(), inner.clone());
                    let subscription = subscribed.take();
                    tokio::spawn(async move {
                        let ok = match subscription {
                            Some(h) => h.await.unwrap_or(false),
                            None => true,
                        };
                        if !ok {
                            tracing::debug!(payload, "connector: not subscribed; no report");
                        } else if let Err(e) = s.notify(bytes).await {
                            tracing::debug!(payload, error = %e, "connector: consumption report");
                        }
                        inner.reporting.lock().remove(&(engine, payload));
                        done.send_replace(true);
                    });
                    return Ok(());
                }
                FetchStep::Fail(e) => return Err(e),
            }
        }
        if subscribed.is_none() {
            // After the speculative read of an unchunked payload was submitted (the engine orders
            // the subscription after it).
            let bytes = Bytes::from(Control::Subscribe { payload }.encode());
            let s = s.clone();
            subscribed = Some(tokio::spawn(async move {
                match s.notify(bytes).await {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::debug!(payload, error = %e, "connector: subscription");
                        false
                    }
                }
            }));
        }
        steps = match fetch.next() {
            Next::Done => return Ok(()),
            Next::Landing { index, or_message } => {
                // A message already here goes first, while there is room for more reads.
                match or_message.then(|| rx.try_recv().ok()).flatten() {
                    Some(c) => fetch.on_message(&c),
                    None => {
                        for h in reads.remove(&index).unwrap_or_default() {
                            if let Err(e) = h.await {
                                return Err(read_failed(e, payload, &mut rx, wait).await);
                            }
                        }
                        let crc = if fetch.wants_crc(index) { Some(dst.crc(index)?) } else { None };
                        fetch.on_landed(index, crc)
                    }
                }
            }
            Next::Message => match tokio::time::timeout(wait, rx.recv()).await {
                Ok(Some(c)) => fetch.on_message(&c),
                Ok(None) => return Err(ConnectorError::Internal("connector closed".into())),
                Err(_) => {
                    return Err(ConnectorError::Timeout {
                        what: format!("chunk announcements of payload {payload} from {engine}"),
                        after: wait,
                    });
                }
            },
        };
    }
}

async fn consume_store(
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
