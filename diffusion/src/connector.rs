//! The `DiffusionConnector`: what a stage worker calls to hand its output to the next stage and to
//! fetch its inputs. The decisions are the sans-IO state machines of [`crate::handoff`]; this
//! file is the IO around them (the engine, the store, the notification stream).
//!
//! - **p2p**: the payload stays in the producer's registered buffer (kept alive by the connector
//!   until its lease ends and no consumer holds it). A consumer subscribes, holding the buffer
//!   while it reads; the producer announces chunks as it marks them ready; the consumer READs each
//!   chunk's byte ranges straight into its destination as soon as it is announced (an unchunked
//!   payload's read starts with the subscription) and yields a view per chunk, in landing order;
//!   then reports it consumed.
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
    ByteRange, ChunkPlan, Engine, EngineId, Handled, Notification, Region, Session, TensorMeta,
    TransferHandle, TransferOp,
};
use tensorwire_store::{Retention, Store, StoreError};
use tokio::sync::mpsc;

use crate::control::{Control, MAX_HOLD};
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

/// Where a fetch under way gets its producer's messages (an error ends it).
type ToFetch = mpsc::Sender<Result<Control>>;

/// Chunks in flight per consume (reads of later chunks proceed while earlier ones land).
const WINDOW: usize = 4;

/// How often the producer side ends expired leases and releases buffers whose holds ran out.
const SWEEP: Duration = Duration::from_millis(500);

/// How long a consume of `chunks` chunks asks its producer to hold the payload: a wait for each
/// chunk's announcement and one for the reads, at most [`MAX_HOLD`].
fn hold_for(wait: Duration, chunks: u32) -> Duration {
    wait.checked_mul(chunks.saturating_add(1)).map_or(MAX_HOLD, |d| d.min(MAX_HOLD))
}

fn hold_ms(hold: Duration) -> u32 {
    u32::try_from(hold.as_millis()).unwrap_or(u32::MAX)
}

#[derive(Debug)]
struct Inner {
    engine: Engine,
    store: Option<Arc<dyn Store>>,
    cfg: ConnectorConfig,
    publisher: Mutex<Publisher<Buffer>>,
    /// Producer messages for the fetches under way, by (producer, payload); an error ends the
    /// fetch.
    waiters: Mutex<HashMap<(EngineId, u64), ToFetch>>,
    /// The runtime the connector was made on (the notification handler runs on backend tasks).
    rt: tokio::runtime::Handle,
    /// Consumption reports (and unsubscriptions) on their way, by (producer, payload): they
    /// complete in the background, and a later consume or release of the same payload waits for
    /// them first, so it sees the payload as the report left it.
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
        self.inner.engine.set_notification_handler(None);
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
        // One chunk along dimension 0 needs the whole tensor dense: say so in those words.
        None => ChunkPlan::new(meta, 0, 1).map_err(|e| match e {
            tensorwire_core::Error::InvalidTensor(_) => {
                tensorwire_core::Error::InvalidTensor(format!(
                    "an unchunked payload must be contiguous: shape {:?} has strides {:?} \
                     (elements), row-major is {:?}; publish a contiguous copy",
                    meta.shape,
                    meta.strides,
                    tensorwire_core::tensor::row_major_strides(&meta.shape)
                ))
            }
            e => e,
        }),
    };
    plan.map_err(|e| match e {
        tensorwire_core::Error::InvalidTensor(m) => ConnectorError::InvalidTensor(m),
        tensorwire_core::Error::InvalidArgument(m) => ConnectorError::InvalidArgument(m),
        e => ConnectorError::Transport(e),
    })
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
            rt: tokio::runtime::Handle::current(),
            reporting: Mutex::default(),
            sessions: tokio::sync::Mutex::default(),
            next: AtomicU64::new(1),
        });
        let weak = Arc::downgrade(&inner);
        inner.engine.set_notification_handler(Some(Arc::new(move |n: &Notification| {
            match weak.upgrade() {
                Some(inner) => on_notification(&inner, n),
                None => Handled::Pass,
            }
        })));
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

    /// Subscriptions of consumers to payloads this connector holds: each keeps its payload's
    /// buffer while its consumer reads, even past the payload's lease.
    pub fn readers(&self) -> usize {
        self.inner.publisher.lock().readers()
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
        // A stored payload carries the checksum of all its bytes, an unchunked p2p payload that
        // of its one chunk; the chunks of a chunked one carry theirs in their announcements.
        let checksum = match (inner.cfg.checksum, p2p, chunked) {
            (false, _, _) | (true, true, true) => None,
            (true, false, _) => Some(p.region.slice(p.offset, plan.extent())?.crc32c()?),
            (true, true, false) => {
                let chunk =
                    plan.chunk(0).map_err(|e| ConnectorError::InvalidArgument(e.to_string()))?;
                Some(crc_of(&p.region, p.offset, &chunk.ranges)?)
            }
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
        let kind = p.kind.name();
        metrics::counter!("tensorwire_handoff_publishes_total", "kind" => kind).increment(1);
        metrics::counter!("tensorwire_handoff_bytes_total", "kind" => kind, "direction" => "out")
            .increment(plan.extent());
        let buffer = Buffer {
            region: p.region,
            offset: p.offset,
            plan,
            meta: p.meta,
            store: (!p2p).then(|| (store_key(engine, id), retention, p.lease)),
        };
        let lease = Lease::new(p.lease, Instant::now());
        let whole = p2p && !chunked;
        match whole {
            true => inner.publisher.lock().publish_whole(id, buffer, checksum, lease),
            false => inner.publisher.lock().publish(id, buffer, chunks, lease, !p2p),
        }
        let mut publication = Publication {
            reference,
            id,
            inner: Arc::downgrade(inner),
            complete: whole,
            stored: None,
        };
        if !chunked && !whole {
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
                reports_sent(&self.inner, region.engine, *payload).await;
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
            let started = Instant::now();
            let at = Destination { region: &dst, offset, plan: &plan };
            let out = match &r.source {
                Source::P2p { .. } => consume_p2p(&inner, &r, at, &tx, report).await,
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

    /// Whether `p`'s payload is still served here (its lease has not ended, nor was it
    /// retired); a store payload is served until it went to the store.
    pub fn serves(&self, p: &Publication) -> bool {
        self.inner.publisher.lock().buffer(p.id).is_some()
    }

    /// Drops a p2p payload now (its lease notwithstanding); subscribers are told it is gone.
    pub fn retire(&self, p: &Publication) {
        let mut out = Vec::new();
        self.inner.publisher.lock().retire(p.id, &mut out);
        act(&self.inner, out);
    }
}

/// A consume's last byte landed: its count, bytes and time in the metrics.
fn consumed(kind: &'static str, bytes: u64, took: Duration) {
    metrics::counter!("tensorwire_handoff_consumes_total", "kind" => kind).increment(1);
    metrics::counter!("tensorwire_handoff_bytes_total", "kind" => kind, "direction" => "in")
        .increment(bytes);
    metrics::histogram!("tensorwire_handoff_seconds", "kind" => kind).record(took.as_secs_f64());
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
                let i = inner.clone();
                inner.rt.spawn(async move { tell(&i, to, &msg).await });
            }
            // A region dropped outside the runtime (a backend's own thread delivering a
            // notification to the handler) could not start its deregistration: drop it on the
            // runtime then.
            Action::Release { buffer, .. } => match tokio::runtime::Handle::try_current() {
                Ok(_) => drop(buffer),
                Err(_) => drop(inner.rt.spawn(async move { drop(buffer) })),
            },
            Action::Store { buffer, .. } => {
                let store = inner.store.clone();
                put = Some(inner.rt.spawn(async move {
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
        act(&inner, out);
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

/// The connector's notification handler: acts on each connector message as it arrives, on the
/// backend's task (no queue, no wake-up of another task), and answers a subscription with its
/// verdict: the subscriber's `notify` succeeds only if it is subscribed. Other notifications
/// go to the engine's queue, which the connector's loop drains.
fn on_notification(inner: &Arc<Inner>, n: &Notification) -> Handled {
    let c = match Control::decode(&n.payload) {
        Ok(Some(c)) => c,
        Ok(None) => return Handled::Pass,
        Err(e) => {
            tracing::warn!(from = %n.from, error = %e, "connector: bad control message");
            return Handled::Refused(e);
        }
    };
    let mut out = Vec::new();
    let mut verdict = Handled::Taken;
    match c {
        Control::Subscribe { payload, hold_ms } => {
            let hold = Duration::from_millis(u64::from(hold_ms));
            let now = Instant::now();
            if !inner.publisher.lock().subscribe(n.from, payload, hold, now, &mut out) {
                verdict = refused(payload);
            }
        }
        Control::Done { payload, consumed } => {
            let now = Instant::now();
            if !inner.publisher.lock().done(n.from, payload, consumed, now, &mut out) {
                verdict = refused(payload);
            }
        }
        Control::Ready { payload, .. } | Control::Gone { payload, .. } => {
            let tx = inner.waiters.lock().get(&(n.from, payload)).cloned();
            if let Some(tx) = tx {
                if let Err(mpsc::error::TrySendError::Full(c)) = tx.try_send(Ok(c)) {
                    inner.rt.spawn(async move { tx.send(c).await });
                }
            }
        }
    }
    act(inner, out);
    verdict
}

/// The verdict on a message about a payload no longer served (a Gone message says why).
fn refused(payload: u64) -> Handled {
    let why = format!("payload {payload} is not served here");
    Handled::Refused(tensorwire_core::Error::NotFound(tensorwire_core::Missing::Other(why)))
}

/// The connector's loop: ends expired leases and releases buffers whose holds ran out, and
/// drains notifications that are not the connector's.
async fn dispatch(inner: Weak<Inner>) {
    let mut swept = Instant::now();
    loop {
        let Some(i) = inner.upgrade() else { return };
        if swept.elapsed() >= SWEEP {
            swept = Instant::now();
            let mut out = Vec::new();
            i.publisher.lock().sweep(swept, &mut out);
            act(&i, out);
        }
        match i.engine.recv_notification(SWEEP).await {
            Ok(n) => tracing::debug!(from = %n.from, "connector: not a connector message"),
            Err(tensorwire_core::Error::Timeout { .. }) => {}
            Err(_) => return, // engine shut down
        }
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

/// Why a read of a p2p payload, or its `Done`, failed. A buffer no longer registered, or a
/// refused `Done` or subscription, means the payload ended: the producer says why in a Gone
/// message of its own.
async fn read_failed(
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

/// Removes the waiter entry however the consume ends.
struct Waiter<'a>(&'a Inner, (EngineId, u64));

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.0.waiters.lock().remove(&self.1);
    }
}

/// Waits (bounded) for the reports of earlier consumes of `payload` still on their way.
async fn reports_sent(inner: &Inner, engine: EngineId, payload: u64) {
    let pending = inner.reporting.lock().get(&(engine, payload)).cloned();
    if let Some(mut r) = pending {
        let _ = tokio::time::timeout(inner.cfg.wait_timeout, r.wait_for(|done| *done)).await;
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
struct Subscription {
    inner: Arc<Inner>,
    session: Session,
    engine: EngineId,
    payload: u64,
    verdict: Verdict,
}

/// Where a subscription stands, as far as its consumer knows.
enum Verdict {
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
    fn new(inner: &Arc<Inner>, session: &Session, payload: u64, verdict: Verdict) -> Subscription {
        Subscription {
            inner: inner.clone(),
            session: session.clone(),
            engine: session.peer(),
            payload,
            verdict,
        }
    }

    fn message(payload: u64, hold: Duration) -> Bytes {
        Bytes::from(Control::Subscribe { payload, hold_ms: hold_ms(hold) }.encode())
    }

    /// Sends the subscription on its own task (the consume waits for announcements meanwhile).
    fn start(
        inner: &Arc<Inner>,
        session: &Session,
        payload: u64,
        hold: Duration,
        to: ToFetch,
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
        Self::new(inner, session, payload, Verdict::Pending(send))
    }

    /// A subscription that rides with the read (returned with the message to carry): the read
    /// succeeds only if the producer accepted it.
    fn riding(
        inner: &Arc<Inner>,
        session: &Session,
        payload: u64,
        hold: Duration,
    ) -> (Subscription, Bytes) {
        (Self::new(inner, session, payload, Verdict::Riding), Self::message(payload, hold))
    }

    /// The read it rode with succeeded: the producer accepted it.
    fn confirmed(&mut self) {
        if matches!(self.verdict, Verdict::Riding) {
            self.verdict = Verdict::Accepted;
        }
    }

    /// Ends the subscription, in the background; a later consume or release of the payload
    /// waits for it. A refused one is owed no `Done`; one whose verdict is unknown gets one (a
    /// producer that refused it refuses that too).
    fn end(&mut self, consumed: bool) {
        let verdict = match std::mem::replace(&mut self.verdict, Verdict::Ended) {
            Verdict::Pending(send) => Some(send),
            Verdict::Accepted | Verdict::Riding => None,
            Verdict::Ended => return,
        };
        let key = (self.engine, self.payload);
        let (done, pending) = tokio::sync::watch::channel(false);
        self.inner.reporting.lock().insert(key, pending);
        let (s, inner, payload) = (self.session.clone(), self.inner.clone(), self.payload);
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
            inner.reporting.lock().remove(&key);
            done.send_replace(true);
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

async fn consume_p2p(
    inner: &Arc<Inner>,
    r: &PayloadRef,
    dst: Destination<'_>,
    out: &mpsc::Sender<Result<ChunkView>>,
    report: bool,
) -> Result<()> {
    let Source::P2p { addr, payload, region: ref remote, offset: base } = r.source else {
        return Err(ConnectorError::Internal("not a p2p payload".into()));
    };
    let engine = remote.engine;
    reports_sent(inner, engine, payload).await;
    let s = session_to(inner, addr).await?;
    if s.peer() != engine {
        return Err(ConnectorError::ProducerGone(format!(
            "{engine} at {addr}: another engine answers there"
        )));
    }
    let (tx, rx) = mpsc::channel(dst.plan.len() as usize + 4);
    inner.waiters.lock().insert((engine, payload), tx.clone());
    let _w = Waiter(inner, (engine, payload));
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
            let (subscription, notice) = Subscription::riding(inner, &p.s, payload, hold);
            p.whole(subscription, notice, r.checksum, out, report).await
        }
        Some(_) => {
            let subscription = Subscription::start(inner, &p.s, payload, hold, tx);
            p.chunked(subscription, out, report).await
        }
    }
}

/// One consume of a p2p payload under way.
struct P2pRead<'a> {
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
    async fn submit(&self, index: u32, notice: Option<Bytes>) -> Result<Vec<TransferHandle>> {
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
    async fn landed(&mut self, reads: Vec<TransferHandle>) -> Result<()> {
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
    async fn whole(
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
    async fn chunked(
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
