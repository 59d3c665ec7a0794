//! Publishing: a stage's output registered where it is, announced chunk by chunk, and carried
//! to the store when its lease says so; the [`Publication`] a producer holds.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use tensorwire_store::{Retention, Store};

use crate::error::{ConnectorError, Result};
use crate::handoff::Action;
use crate::lease::Lease;
use crate::payload::{LeasePolicy, StagePayload};
use crate::reference::{PayloadRef, Source};

use super::state::{
    Buffer, ConsumerHint, DiffusionConnector, Inner, Mode, crc_of, fits, plan_of, store_key, tell,
};

impl DiffusionConnector {
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

/// Carries out the publisher's actions; returns the store put a `Store` action started.
pub(super) fn act(
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
pub(super) async fn store_put(store: Option<Arc<dyn Store>>, b: Buffer) -> Result<()> {
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
