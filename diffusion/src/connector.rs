//! The `DiffusionConnector`: what a stage worker calls to hand its output to the next stage and to
//! fetch its inputs.
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
//! Every wait is bounded by [`ConnectorConfig::wait_timeout`]; a producer that died surfaces as a
//! transfer error or a timeout, never a hang.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_core::sync::lock;
use tensorwire_core::{
    ByteRange, ChunkPlan, Engine, EngineId, Error, Missing, Region, RemoteRegion, Result, Session,
    TensorMeta, TransferOp,
};
use tensorwire_store::{Retention, Store};
use tokio::sync::mpsc;

use crate::control::Control;
use crate::lease::{Lease, LeaseState};
use crate::payload::{Chunking, LeasePolicy, StagePayload};
use crate::reference::{PayloadRef, Source};

/// The stage a connector serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Condition encoder.
    Encode,
    /// DiT denoiser.
    Denoise,
    /// VAE decoder.
    Decode,
}

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
    /// Stage.
    pub role: Role,
    /// Transfer mode.
    pub mode: Mode,
    /// crc32c per chunk (p2p) or per payload (store), verified by the consumer.
    pub checksum: bool,
    /// Bound on every wait: a chunk announcement, a store key appearing.
    pub wait_timeout: Duration,
}

impl Default for ConnectorConfig {
    fn default() -> Self {
        ConnectorConfig {
            role: Role::Denoise,
            mode: Mode::Auto,
            checksum: false,
            wait_timeout: Duration::from_secs(30),
        }
    }
}

/// One chunk of a payload, now in the consumer's destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkView {
    /// Chunk index.
    pub index: u32,
    /// First index along the chunk dimension.
    pub start: u64,
    /// One past the last index along the chunk dimension.
    pub end: u64,
    /// The bytes now valid, as offsets in the destination region.
    pub ranges: Vec<ByteRange>,
}

#[derive(Debug)]
struct Published {
    region: Arc<Region>,
    offset: u64,
    plan: ChunkPlan,
    /// Per chunk: None = not ready; Some(crc) = ready.
    ready: Vec<Option<Option<u32>>>,
    subscribers: Vec<EngineId>,
    lease: Lease,
    /// Store mode: where the bytes go once every chunk is ready.
    store: Option<(Vec<u8>, Retention)>,
}

#[derive(Debug)]
struct Inner {
    engine: Engine,
    store: Option<Arc<dyn Store>>,
    cfg: ConnectorConfig,
    published: Mutex<HashMap<u64, Published>>,
    waiters: Mutex<HashMap<(EngineId, u64), mpsc::Sender<Control>>>,
    /// Per producer: (data session, control session). Control messages get their own session so
    /// they never wait behind data ops (a notification is ordered after earlier ops on its
    /// connection).
    sessions: tokio::sync::Mutex<HashMap<SocketAddr, (Session, Session)>>,
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

fn crc_of(base: *const u8, ranges: &[ByteRange]) -> u32 {
    ranges.iter().fold(0u32, |crc, r| {
        // SAFETY: callers pass ranges inside a live region of which `base` is the start (checked
        // against the plan's extent when the payload was published or the consume began).
        let s = unsafe { std::slice::from_raw_parts(base.add(r.offset as usize), r.len as usize) };
        crc32c::crc32c_append(crc, s)
    })
}

fn plan_of(meta: &TensorMeta, chunking: Option<Chunking>) -> Result<ChunkPlan> {
    match chunking {
        Some(c) => ChunkPlan::new(meta, c.dim as usize, c.count),
        None if meta.shape.is_empty() => Err(Error::InvalidTensor("a scalar payload".into())),
        None => ChunkPlan::new(meta, 0, 1),
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
            published: Mutex::default(),
            waiters: Mutex::default(),
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
        lock(&self.inner.published).len()
    }

    /// Publishes a payload; returns at once. An unchunked payload is ready now; a chunked one
    /// becomes available chunk by chunk through [`Publication::mark_ready`].
    pub fn publish(&self, p: StagePayload, hint: Option<ConsumerHint>) -> Result<Publication> {
        let inner = &self.inner;
        let plan = plan_of(&p.meta, p.chunking)?;
        match p.offset.checked_add(plan.extent()) {
            Some(end) if end <= p.region.len() => {}
            _ => {
                return Err(Error::OutOfBounds {
                    what: "payload in its region".into(),
                    offset: p.offset,
                    len: plan.extent(),
                    limit: p.region.len(),
                });
            }
        }
        let p2p = match inner.cfg.mode {
            Mode::P2p => true,
            Mode::Store => false,
            Mode::Auto => hint.is_some_and(|h| h.credit > 0),
        };
        if !p2p && inner.store.is_none() {
            return Err(Error::Unsupported {
                backend: "connector",
                what: "store mode without a store".into(),
            });
        }
        if p2p && !p.region.permissions().read {
            return Err(Error::AccessDenied(format!(
                "p2p payload region {} must be readable by peers (Permissions::READ)",
                p.region.id().0
            )));
        }
        let id = inner.next.fetch_add(1, Ordering::Relaxed);
        let engine = inner.engine.id();
        let chunked = p.chunking.is_some();
        let checksum = (!chunked && inner.cfg.checksum).then(|| {
            // SAFETY: the plan's extent from `offset` lies inside the region (checked above).
            crc_of(unsafe { p.region.as_ptr().add(p.offset as usize) }, &plan.chunks()[0].ranges)
        });
        let source = if p2p {
            Source::P2p {
                engine,
                addr: inner.engine.local_addr(),
                payload: id,
                region: p.region.id(),
                key: p.region.remote().key,
                offset: p.offset,
            }
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
        let n = plan.len() as usize;
        let entry = Published {
            region: p.region,
            offset: p.offset,
            plan,
            ready: vec![None; n],
            subscribers: Vec::new(),
            lease: Lease::new(p.lease, Instant::now()),
            store: (!p2p).then(|| (store_key(engine, id), retention)),
        };
        lock(&inner.published).insert(id, entry);
        let publication = Publication {
            reference,
            id,
            inner: Arc::downgrade(inner),
            complete: false,
            stored: None,
        };
        if !chunked {
            let mut publication = publication;
            publication.ready_inner(0)?;
            return Ok(publication);
        }
        Ok(publication)
    }

    /// Fetches a payload into `dst` at `offset`, yielding a view per chunk as it lands. With
    /// `expect`, the payload's dtype and shape must match it.
    pub fn consume(
        &self,
        r: &PayloadRef,
        dst: Arc<Region>,
        offset: u64,
        expect: Option<&TensorMeta>,
    ) -> Result<Consumption> {
        if let Some(e) = expect {
            if e.dtype != r.meta.dtype || e.shape != r.meta.shape {
                return Err(Error::InvalidTensor(format!(
                    "payload is {:?} {:?}, destination expects {:?} {:?}",
                    r.meta.dtype, r.meta.shape, e.dtype, e.shape
                )));
            }
        }
        let plan = plan_of(&r.meta, r.chunking)?;
        match offset.checked_add(plan.extent()) {
            Some(end) if end <= dst.len() => {}
            _ => {
                return Err(Error::OutOfBounds {
                    what: format!("destination region {}", dst.id().0),
                    offset,
                    len: plan.extent(),
                    limit: dst.len(),
                });
            }
        }
        let (tx, rx) = mpsc::channel(plan.len() as usize + 1);
        let inner = self.inner.clone();
        let r = r.clone();
        let task = tokio::spawn(async move {
            let out = match &r.source {
                Source::P2p { .. } => consume_p2p(&inner, &r, &plan, &dst, offset, &tx).await,
                Source::Store { key } => {
                    consume_store(&inner, &r, key, &plan, &dst, offset, &tx).await
                }
            };
            if let Err(e) = out {
                let _ = tx.send(Err(e)).await;
            }
        });
        Ok(Consumption { rx, task })
    }

    /// Drops a p2p payload now (its lease notwithstanding); subscribers are told it is gone.
    pub async fn retire(&self, p: &Publication) {
        let gone = lock(&self.inner.published).remove(&p.id);
        if let Some(g) = gone {
            let e = Error::NotFound(Missing::Other(format!(
                "payload {} retired by its producer",
                p.id
            )));
            tell(&self.inner, &g.subscribers, &Control::Gone { payload: p.id, error: e }).await;
        }
    }
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

    /// Chunk `index` is written and may be sent.
    pub fn mark_ready(&mut self, index: u32) -> Result<()> {
        self.ready_inner(index)
    }

    fn ready_inner(&mut self, index: u32) -> Result<()> {
        let inner =
            self.inner.upgrade().ok_or_else(|| Error::PeerClosed("connector dropped".into()))?;
        let (subs, crc, all, store_job) = {
            let mut map = lock(&inner.published);
            let p = map.get_mut(&self.id).ok_or_else(|| {
                Error::NotFound(Missing::Other(format!("payload {} is no longer held", self.id)))
            })?;
            let chunk = p.plan.chunk(index)?.clone();
            if p.ready[index as usize].is_some() {
                return Err(Error::InvalidArgument(format!("chunk {index} marked ready twice")));
            }
            let crc = (inner.cfg.checksum && p.store.is_none()).then(|| {
                // SAFETY: the plan's extent from `offset` lies inside the region (checked at
                // publish) and the region is held by this entry.
                crc_of(unsafe { p.region.as_ptr().add(p.offset as usize) }, &chunk.ranges)
            });
            p.ready[index as usize] = Some(crc);
            let all = p.ready.iter().all(Option::is_some);
            let job = match (&p.store, all) {
                (Some((key, retention)), true) => Some((
                    key.clone(),
                    *retention,
                    p.region.clone(),
                    p.offset,
                    p.plan.extent(),
                    p.lease.policy(),
                )),
                _ => None,
            };
            if job.is_some() {
                map.remove(&self.id); // the store takes it from here; the buffer goes with the put
            }
            (p_subs(&map, self.id), crc, all, job)
        };
        self.complete = all;
        if !subs.is_empty() {
            let msg = Control::Ready { payload: self.id, index, crc };
            let inner2 = inner.clone();
            tokio::spawn(async move { tell(&inner2, &subs, &msg).await });
        }
        if let Some((key, retention, region, offset, len, lease)) = store_job {
            let store = inner.store.clone().ok_or_else(|| Error::protocol("store vanished"))?;
            let meta = self.reference.meta.clone();
            self.stored = Some(tokio::spawn(async move {
                let r = async {
                    store.put_from(&key, &meta, &region, offset, len, retention).await?;
                    drop(region); // released the moment the store has the bytes
                    match lease {
                        LeasePolicy::DeleteOnConsume { consumers } => {
                            store.set_lease(&key, consumers, None).await
                        }
                        LeasePolicy::Ttl(d) => store.set_lease(&key, 0, Some(d)).await,
                        _ => Ok(()),
                    }
                }
                .await;
                if let Err(e) = &r {
                    tracing::warn!(error = %e, "connector: store put failed");
                }
                r
            }));
        }
        Ok(())
    }

    /// Store mode: waits until the store holds the payload (every chunk marked, put done);
    /// returns at once in p2p mode. Publishing never needs this; a producer that wants its
    /// consumers to find the payload without waiting calls it before announcing the reference.
    pub async fn stored(&mut self) -> Result<()> {
        match self.stored.take() {
            Some(job) => job.await.map_err(|e| Error::protocol(format!("store put task: {e}")))?,
            None => Ok(()),
        }
    }

    /// Marks every chunk not yet marked.
    pub fn mark_all_ready(&mut self) -> Result<()> {
        let n = plan_of(&self.reference.meta, self.reference.chunking)?.len();
        for i in 0..n {
            match self.mark_ready(i) {
                Ok(()) | Err(Error::InvalidArgument(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

fn p_subs(map: &HashMap<u64, Published>, id: u64) -> Vec<EngineId> {
    map.get(&id).map(|p| p.subscribers.clone()).unwrap_or_default()
}

impl Drop for Publication {
    fn drop(&mut self) {
        if self.complete {
            return;
        }
        // Abandoned before every chunk was ready: tell subscribers instead of letting them wait.
        let Some(inner) = self.inner.upgrade() else { return };
        let gone = lock(&inner.published).remove(&self.id);
        if let Some(g) = gone {
            let e = Error::PeerClosed(format!("payload {}: the producer abandoned it", self.id));
            let msg = Control::Gone { payload: self.id, error: e };
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move { tell(&inner, &g.subscribers, &msg).await });
            }
        }
    }
}

/// Sends `msg` to each engine in `to` (best effort: a consumer that went away is not an error).
async fn tell(inner: &Inner, to: &[EngineId], msg: &Control) {
    let bytes = Bytes::from(msg.encode());
    for &e in to {
        if let Ok(s) = inner.engine.session(e) {
            if let Err(err) = s.notify(bytes.clone()).await {
                tracing::debug!(peer = %e, error = %err, "connector: could not notify");
            }
        }
    }
}

/// The connector's notification loop: serves subscriptions and routes announcements.
async fn dispatch(inner: Weak<Inner>) {
    loop {
        let Some(i) = inner.upgrade() else { return };
        let n = match i.engine.recv_notification(Duration::from_millis(500)).await {
            Ok(n) => n,
            Err(Error::Timeout { .. }) => {
                sweep(&i);
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
        match c {
            Control::Subscribe { payload } => {
                let replies = subscribe(&i, n.from, payload);
                for r in replies {
                    tell(&i, &[n.from], &r).await;
                }
            }
            Control::Consumed { payload } => {
                let mut map = lock(&i.published);
                let done = match map.get_mut(&payload) {
                    Some(p) => {
                        p.subscribers.retain(|&s| s != n.from);
                        p.lease.consume(Instant::now()) != LeaseState::Live
                    }
                    None => false,
                };
                if done {
                    map.remove(&payload); // the buffer is released here
                }
            }
            Control::Ready { payload, .. } | Control::Gone { payload, .. } => {
                let tx = lock(&i.waiters).get(&(n.from, payload)).cloned();
                if let Some(tx) = tx {
                    let _ = tx.send(c).await;
                }
            }
        }
    }
}

/// Drops p2p payloads whose lease expired.
fn sweep(i: &Inner) {
    let now = Instant::now();
    lock(&i.published).retain(|_, p| p.store.is_some() || p.lease.state(now) == LeaseState::Live);
}

fn subscribe(i: &Inner, from: EngineId, payload: u64) -> Vec<Control> {
    let mut map = lock(&i.published);
    let Some(p) = map.get_mut(&payload) else {
        let e = Error::NotFound(Missing::Other(format!("payload {payload} is not published here")));
        return vec![Control::Gone { payload, error: e }];
    };
    if let Err(e) = p.lease.check(Instant::now(), &format!("payload {payload}")) {
        map.remove(&payload);
        return vec![Control::Gone { payload, error: e }];
    }
    p.subscribers.push(from);
    p.ready
        .iter()
        .enumerate()
        .filter_map(|(k, r)| r.map(|crc| Control::Ready { payload, index: k as u32, crc }))
        .collect()
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
        match self.rx.recv().await {
            Some(Ok(v)) => Ok(Some(v)),
            Some(Err(e)) => Err(e),
            None => Ok(None),
        }
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

fn view(plan: &ChunkPlan, index: u32, offset: u64) -> Result<ChunkView> {
    let c = plan.chunk(index)?;
    Ok(ChunkView {
        index,
        start: c.start,
        end: c.end,
        ranges: c
            .ranges
            .iter()
            .map(|r| ByteRange { offset: offset + r.offset, len: r.len })
            .collect(),
    })
}

async fn session_to(inner: &Inner, addr: SocketAddr) -> Result<(Session, Session)> {
    let mut s = inner.sessions.lock().await;
    if let Some(x) = s.get(&addr) {
        return Ok(x.clone());
    }
    let x = (inner.engine.connect(addr).await?, inner.engine.connect(addr).await?);
    s.insert(addr, x.clone());
    Ok(x)
}

async fn remote_region(s: &Session, id: tensorwire_core::RegionId) -> Result<RemoteRegion> {
    if let Ok(r) = s.remote_region(id) {
        return Ok(r);
    }
    s.refresh().await?;
    s.remote_region(id)
}

/// Removes the waiter entry however the consume ends.
struct Waiter<'a>(&'a Inner, (EngineId, u64));

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        lock(&self.0.waiters).remove(&self.1);
    }
}

async fn consume_p2p(
    inner: &Inner,
    r: &PayloadRef,
    plan: &ChunkPlan,
    dst: &Region,
    offset: u64,
    out: &mpsc::Sender<Result<ChunkView>>,
) -> Result<()> {
    let Source::P2p { engine, addr, payload, region, offset: src_base, .. } = r.source else {
        return Err(Error::protocol("not a p2p payload"));
    };
    let (s, ctl) = session_to(inner, addr).await?;
    if s.peer() != engine {
        return Err(Error::NotFound(Missing::Peer(format!(
            "{engine} at {addr} (another engine answers there)"
        ))));
    }
    let remote = remote_region(&s, region).await?;
    let (tx, mut rx) = mpsc::channel(plan.len() as usize + 4);
    lock(&inner.waiters).insert((engine, payload), tx);
    let _w = Waiter(inner, (engine, payload));
    let mut done = vec![false; plan.len() as usize];
    let mut left = plan.len();
    let wait = inner.cfg.wait_timeout;
    // Announced chunks whose READs are in flight, oldest first: reads of later chunks proceed
    // while earlier ones complete and are handed to the caller.
    let mut flight: std::collections::VecDeque<(
        u32,
        Option<u32>,
        Vec<tensorwire_core::TransferHandle>,
    )> = std::collections::VecDeque::new();
    const WINDOW: usize = 4;
    let read_chunk = |index: u32| -> Result<Vec<TransferOp>> {
        Ok(plan
            .chunk(index)?
            .ranges
            .iter()
            .map(|b| TransferOp::read(dst, offset + b.offset, &remote, src_base + b.offset, b.len))
            .collect())
    };
    // An unchunked payload is complete at publish: start reading it while the subscription
    // round trip runs. Its bytes are handed out only once the producer confirmed the lease (a
    // payload already consumed or expired answers Gone, and what was read is discarded).
    let mut speculative =
        if r.chunking.is_none() { Some(s.submit(read_chunk(0)?).await) } else { None };
    ctl.notify(Bytes::from(Control::Subscribe { payload }.encode())).await?;
    while left > 0 {
        // Take every announcement already here (up to the window) without waiting.
        let next = if flight.is_empty() {
            match tokio::time::timeout(wait, rx.recv()).await {
                Ok(Some(c)) => Some(c),
                Ok(None) => return Err(Error::PeerClosed("connector closed".into())),
                Err(_) => {
                    return Err(Error::timeout(
                        format!("payload {payload} of {engine}: {left} chunks not announced"),
                        wait,
                    ));
                }
            }
        } else if flight.len() < WINDOW {
            rx.try_recv().ok()
        } else {
            None
        };
        match next {
            Some(Control::Ready { index, crc, .. }) => {
                let i = index as usize;
                if i < done.len() && !done[i] {
                    done[i] = true;
                    let handles = match speculative.take() {
                        Some(h) if index == 0 => h,
                        _ => s.submit(read_chunk(index)?).await,
                    };
                    flight.push_back((index, crc, handles));
                }
                continue;
            }
            Some(Control::Gone { error, .. }) => return Err(error),
            Some(_) => continue,
            None => {}
        }
        let Some((index, crc, handles)) = flight.pop_front() else { continue };
        for h in handles {
            h.await?;
        }
        if let Some(expected) = crc {
            let chunk = plan.chunk(index)?;
            // SAFETY: `offset + extent` lies inside `dst` (checked before the consume began).
            let actual = crc_of(unsafe { dst.as_ptr().add(offset as usize) }, &chunk.ranges);
            if actual != expected {
                return Err(Error::Checksum {
                    what: format!("chunk {index} of payload {payload}"),
                    expected,
                    actual,
                });
            }
        }
        left -= 1;
        if out.send(view(plan, index, offset)).await.is_err() {
            return Ok(()); // the consumer stopped listening
        }
    }
    // Every view is out; the lease moves on once the producer knows (before the stream ends, so
    // a consume that follows sees the payload consumed).
    ctl.notify(Bytes::from(Control::Consumed { payload }.encode())).await
}

async fn consume_store(
    inner: &Inner,
    r: &PayloadRef,
    key: &[u8],
    plan: &ChunkPlan,
    dst: &Region,
    offset: u64,
    out: &mpsc::Sender<Result<ChunkView>>,
) -> Result<()> {
    let store = inner.store.as_ref().ok_or_else(|| Error::Unsupported {
        backend: "connector",
        what: "store payload without a store".into(),
    })?;
    let wait = inner.cfg.wait_timeout;
    let deadline = Instant::now() + wait;
    let mut pause = Duration::from_millis(1);
    while !store.exists(key).await? {
        if Instant::now() >= deadline {
            return Err(Error::NotFound(Missing::Other(format!(
                "payload {} not in the store within {wait:?} (never published, consumed, or expired)",
                String::from_utf8_lossy(key)
            ))));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    let (meta, _) = store.get_into(key, dst, offset).await?;
    if meta.dtype != r.meta.dtype || meta.shape != r.meta.shape {
        return Err(Error::InvalidTensor("stored payload does not match its reference".into()));
    }
    if let Some(expected) = r.checksum {
        // SAFETY: `offset + extent` lies inside `dst` (checked before the consume began).
        let actual = crc_of(unsafe { dst.as_ptr().add(offset as usize) }, &plan.chunks()[0].ranges);
        if actual != expected {
            return Err(Error::Checksum {
                what: format!("payload {}", String::from_utf8_lossy(key)),
                expected,
                actual,
            });
        }
    }
    for i in 0..plan.len() {
        if out.send(view(plan, i, offset)).await.is_err() {
            break;
        }
    }
    if let LeasePolicy::DeleteOnConsume { .. } = r.lease {
        store.consumed(key).await?;
    }
    Ok(())
}
