//! The connector's state, shared by its producer side (`publish`), its inbox and its consumer
//! side (`consume`): the types a user configures it with, the buffers it holds, and helpers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tensorwire_core::{ByteRange, ChunkPlan, Engine, EngineId, Region, Session, TensorMeta};
use tensorwire_store::{Retention, Store};
use tokio::sync::mpsc;

use crate::control::{Control, MAX_HOLD};
use crate::error::{ConnectorError, Result};
use crate::handoff::Publisher;
use crate::payload::{Chunking, LeasePolicy};

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
pub(super) struct Buffer {
    pub(super) region: Arc<Region>,
    pub(super) offset: u64,
    pub(super) plan: ChunkPlan,
    pub(super) meta: TensorMeta,
    /// Store mode: the key, retention and lease it is stored with.
    pub(super) store: Option<(Vec<u8>, Retention, LeasePolicy)>,
}

/// Where a fetch under way gets its producer's messages (an error ends it).
pub(super) type ToFetch = mpsc::Sender<Result<Control>>;

/// Chunks in flight per consume (reads of later chunks proceed while earlier ones land).
pub(super) const WINDOW: usize = 4;

/// How often the producer side ends expired leases and releases buffers whose holds ran out.
pub(super) const SWEEP: Duration = Duration::from_millis(500);

/// How long a consume of `chunks` chunks asks its producer to hold the payload: a wait for each
/// chunk's announcement and one for the reads, at most [`MAX_HOLD`].
pub(super) fn hold_for(wait: Duration, chunks: u32) -> Duration {
    wait.checked_mul(chunks.saturating_add(1)).map_or(MAX_HOLD, |d| d.min(MAX_HOLD))
}

pub(super) fn hold_ms(hold: Duration) -> u32 {
    u32::try_from(hold.as_millis()).unwrap_or(u32::MAX)
}

#[derive(Debug)]
pub(super) struct Inner {
    pub(super) engine: Engine,
    pub(super) store: Option<Arc<dyn Store>>,
    pub(super) cfg: ConnectorConfig,
    pub(super) publisher: Mutex<Publisher<Buffer>>,
    /// Producer messages for the fetches under way, by (producer, payload); an error ends the
    /// fetch.
    pub(super) waiters: Mutex<HashMap<(EngineId, u64), ToFetch>>,
    /// The runtime the connector was made on (the notification handler runs on backend tasks).
    pub(super) rt: tokio::runtime::Handle,
    /// The last turn taken at each p2p payload, by (producer, payload): a consume or release
    /// waits for the one before it to end (its report sent, in the background, or none owed),
    /// so it sees the payload as that report left it (see `turn`).
    pub(super) turns: Mutex<HashMap<(EngineId, u64), tokio::sync::watch::Receiver<bool>>>,
    /// Sessions with producers, by control address (one handshake per producer).
    pub(super) sessions: tokio::sync::Mutex<HashMap<SocketAddr, Session>>,
    pub(super) next: AtomicU64,
}

/// The connector (one per stage worker; it owns its engine's notification stream).
#[derive(Debug)]
pub struct DiffusionConnector {
    pub(super) inner: Arc<Inner>,
    pub(super) dispatcher: tokio::task::JoinHandle<()>,
}

impl Drop for DiffusionConnector {
    fn drop(&mut self) {
        self.inner.engine.set_notification_handler(None);
        self.dispatcher.abort();
    }
}

/// The crc32c of `ranges` of `region` (offsets relative to `base`).
pub(super) fn crc_of(region: &Region, base: u64, ranges: &[ByteRange]) -> Result<u32> {
    ranges.iter().try_fold(0u32, |crc, r| {
        let s = region.slice(base + r.offset, r.len)?;
        Ok(s.with_host_bytes(|b| crc32c::crc32c_append(crc, b))?)
    })
}

pub(super) fn plan_of(meta: &TensorMeta, chunking: Option<Chunking>) -> Result<ChunkPlan> {
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
                    tensorwire_core::row_major_strides(&meta.shape)
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

pub(super) fn fits(region: &Region, offset: u64, plan: &ChunkPlan) -> Result<()> {
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

pub(super) fn store_key(engine: EngineId, id: u64) -> Vec<u8> {
    format!("tw/{engine}/{id}").into_bytes()
}

impl DiffusionConnector {
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
}

/// Sends `msg` to `to` (best effort: a consumer that went away is not an error).
pub(super) async fn tell(inner: &Inner, to: EngineId, msg: &Control) {
    if let Ok(s) = inner.engine.session(to) {
        if let Err(err) = s.notify(Bytes::from(msg.encode())).await {
            tracing::debug!(peer = %to, error = %err, "connector: could not notify");
        }
    }
}
