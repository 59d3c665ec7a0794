//! The diffusion connector from Python: `publish` a tensor (zero-copy; p2p, store-relayed or
//! auto), get a handle that travels as bytes, `consume` it into a destination tensor chunk by
//! chunk. The Python layer (`tensorwire.diffusion`) turns each landed chunk into a view of the
//! destination.

use std::sync::{Arc, Mutex, PoisonError};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tensorwire_core::Permissions;
use tensorwire_diffusion::{
    Chunking, ConnectorConfig, ConsumerHint, DiffusionConnector, LeasePolicy, Mode, PayloadKind,
    PayloadRef, Source, StagePayload,
};

use crate::dlpack::Tensor;
use crate::engine::Engine;
use crate::errors::{Failure, Raise, Res};
use crate::runtime::{runtime, seconds, wait, wait_sized};
use crate::store::Store;

fn mode(s: &str) -> Res<Mode> {
    match s {
        "p2p" => Ok(Mode::P2p),
        "store" => Ok(Mode::Store),
        "auto" => Ok(Mode::Auto),
        _ => Err(Failure::invalid(format!("transfer mode {s:?}: expected p2p, store or auto"))),
    }
}

fn kind(s: &str, step: u32) -> Res<PayloadKind> {
    match s {
        "condition_embedding" | "embedding" => Ok(PayloadKind::ConditionEmbedding),
        "latent" => Ok(PayloadKind::Latent),
        "step_latent" => Ok(PayloadKind::StepLatent { step }),
        "feature" => Ok(PayloadKind::Feature),
        _ => Err(Failure::invalid(format!(
            "payload kind {s:?}: expected condition_embedding, latent, step_latent or feature"
        ))),
    }
}

fn lease(s: &str, consumers: u32, ttl: Option<f64>) -> Res<LeasePolicy> {
    match s {
        "delete_on_consume" if consumers > 0 => Ok(LeasePolicy::DeleteOnConsume { consumers }),
        "delete_on_consume" => Err(Failure::invalid("delete_on_consume needs consumers >= 1")),
        "ttl" => Ok(LeasePolicy::Ttl(seconds(ttl.unwrap_or(0.0))?)),
        "soft_pin" => Ok(LeasePolicy::SoftPin),
        "pinned" => Ok(LeasePolicy::Pinned),
        _ => Err(Failure::invalid(format!(
            "lease {s:?}: expected delete_on_consume, ttl, soft_pin or pinned"
        ))),
    }
}

fn kind_name(k: PayloadKind) -> &'static str {
    match k {
        PayloadKind::ConditionEmbedding => "condition_embedding",
        PayloadKind::Latent => "latent",
        PayloadKind::StepLatent { .. } => "step_latent",
        PayloadKind::Feature => "feature",
    }
}

/// The numpy-style name of a dtype.
pub(crate) fn dtype_name(d: tensorwire_core::DType) -> &'static str {
    use tensorwire_core::DType::*;
    match d {
        Bool => "bool",
        U8 => "uint8",
        U16 => "uint16",
        U32 => "uint32",
        U64 => "uint64",
        I8 => "int8",
        I16 => "int16",
        I32 => "int32",
        I64 => "int64",
        F16 => "float16",
        BF16 => "bfloat16",
        F32 => "float32",
        F64 => "float64",
        F8E4M3 => "float8_e4m3fn",
        F8E5M2 => "float8_e5m2",
        _ => "unknown",
    }
}

/// Decodes a handle's bytes.
pub(crate) fn handle(bytes: &[u8]) -> Res<PayloadRef> {
    PayloadRef::from_bytes(bytes)
        .map_err(|e| Failure::invalid(format!("not a payload handle: {e}")))
}

/// A connector on an engine (it takes over that engine's notifications), with an optional store
/// for store-relayed payloads.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Connector {
    inner: Arc<DiffusionConnector>,
}

#[pymethods]
impl Connector {
    /// `mode`: "p2p", "store" or "auto" (p2p when the consumer is known to have credit);
    /// `checksum`: crc32c per chunk / payload, verified by the consumer; `wait_timeout`: the
    /// bound (seconds) on every wait inside the connector.
    #[new]
    #[pyo3(signature = (engine, store = None, *, mode = "auto", checksum = false, wait_timeout = 30.0))]
    fn new(
        py: Python<'_>,
        engine: &Engine,
        store: Option<&Store>,
        mode: &str,
        checksum: bool,
        wait_timeout: f64,
    ) -> PyResult<Connector> {
        let cfg = ConnectorConfig {
            mode: self::mode(mode).raise(py)?,
            checksum,
            wait_timeout: seconds(wait_timeout).raise(py)?,
        };
        let rt = runtime().raise(py)?;
        let _entered = rt.enter();
        let c = DiffusionConnector::new(engine.inner.clone(), store.map(Store::shared), cfg);
        Ok(Connector { inner: Arc::new(c) })
    }

    /// Publishes `tensor` (no copy: peers read it where it is, so do not change it until the
    /// payload is consumed). Returns a `Publication`; its `handle` goes to the consumer.
    /// `stream`: the producer's CUDA stream (see `crate::stream`): the bytes are read only after
    /// the work queued on it before the call (an unchunked payload is then announced as one
    /// chunk along dimension 0, made ready when that work has ended); a chunked payload's
    /// `mark_ready` uses it unless given its own.
    #[pyo3(signature = (request, kind, tensor, *, chunk_dim = None, num_chunks = None, lease = "delete_on_consume", consumers = 1, ttl = None, step = 0, consumer_credit = None, timeout = 30.0, stream = None))]
    fn publish(
        &self,
        py: Python<'_>,
        request: u64,
        kind: &str,
        tensor: &Bound<'_, PyAny>,
        chunk_dim: Option<u32>,
        num_chunks: Option<u32>,
        lease: &str,
        consumers: u32,
        ttl: Option<f64>,
        step: u32,
        consumer_credit: Option<u32>,
        timeout: f64,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Publication> {
        let kind = self::kind(kind, step).raise(py)?;
        let lease = self::lease(lease, consumers, ttl).raise(py)?;
        let handle = stream.map(crate::stream::handle).transpose()?;
        let mut chunking = match (chunk_dim, num_chunks) {
            (None, None) => None,
            (Some(dim), Some(count)) => Some(Chunking { dim, count }),
            (Some(dim), None) => Some(Chunking { dim, count: 1 }),
            (None, Some(_)) => {
                return Err(Failure::invalid("num_chunks needs chunk_dim").into_py(py));
            }
        };
        let t = Tensor::import_on(tensor, handle)?;
        let meta = t.meta.clone();
        let device = ordinal(&meta);
        // The work queued on the stream so far: an unchunked payload waits for it as one chunk;
        // a 0-d or empty tensor (no chunk along dimension 0) waits for it before it is published.
        let mut event = handle.map(|h| crate::stream::record(h, device)).transpose().raise(py)?;
        let mut first = None;
        if chunking.is_none() && event.is_some() {
            match meta.shape.first() {
                Some(&n) if n > 0 => chunking = Some(Chunking { dim: 0, count: 1 }),
                _ => first = event.take(), // no dimension 0 to chunk, or an empty one
            }
        }
        let conn = self.inner.clone();
        let hint = consumer_credit.map(|credit| ConsumerHint { credit });
        let t_limit = seconds(timeout).raise(py)?;
        let p = wait(py, t_limit, "publishing", async move {
            if let Some(e) = first {
                e.reached(t_limit, "publishing").await?;
            }
            let region = Arc::new(t.register(conn.engine(), Permissions::READ).await?);
            let payload = StagePayload { request, kind, region, offset: 0, meta, chunking, lease };
            Ok(conn.publish(payload, hint)?)
        })?;
        let publication = Publication {
            conn: self.inner.clone(),
            inner: Arc::new(Mutex::new(Some(p))),
            stream: handle,
            device,
        };
        if let Some(e) = event {
            publication.ready_after(py, 0, e, t_limit)?;
        }
        Ok(publication)
    }

    /// Consumes the payload of `handle` into `dst` (a writable, contiguous tensor of the
    /// payload's dtype and shape, host memory). Returns a `Consumption` yielding the chunks as
    /// they land. With `hold`, the payload is not reported consumed (it stays for a retry)
    /// until `release(handle)`. `stream`: the consumer's CUDA stream (see `crate::stream`):
    /// nothing lands in `dst` before the work queued on it before the call has ended, and each
    /// chunk is yielded once its bytes are in `dst`, so work queued on the stream after that
    /// sees them.
    #[pyo3(signature = (handle, dst, *, hold = false, timeout = 30.0, stream = None))]
    fn consume(
        &self,
        py: Python<'_>,
        handle: &[u8],
        dst: &Bound<'_, PyAny>,
        hold: bool,
        timeout: f64,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Consumption> {
        let r = self::handle(handle).raise(py)?;
        let h = stream.map(crate::stream::handle).transpose()?;
        let t = Tensor::import_on(dst, h)?;
        let event = h.map(|h| crate::stream::record(h, ordinal(&t.meta))).transpose().raise(py)?;
        if !t.meta.is_contiguous() {
            return Err(Failure::new(
                "InvalidTensorError",
                "the destination must be contiguous (row-major, no gaps)",
            )
            .into_py(py));
        }
        let expect = t.meta.clone();
        let conn = self.inner.clone();
        let chunks = r.chunking.map_or(1, |c| c.count);
        let chunk_bytes = t.span() / u64::from(chunks.max(1));
        let dim = r.chunking.map(|c| c.dim);
        let limit = seconds(timeout).raise(py)?;
        let engine = conn.engine().clone();
        let start = move |region| -> Res<tensorwire_diffusion::Consumption> {
            Ok(match hold {
                true => conn.consume_held(&r, region, 0, Some(&expect))?,
                false => conn.consume(&r, region, 0, Some(&expect))?,
            })
        };
        let c = wait(py, limit, "starting a consume", async move {
            let region = Arc::new(t.register(&engine, Permissions::NONE).await?);
            let Some(event) = event else { return Ok(Started::Running(start(region)?)) };
            // Started once the stream's earlier work has ended, in the background: the call
            // returns now, and `next` waits for the start.
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                let started = match event.reached(limit, "a consume's stream").await {
                    Ok(()) => start(region),
                    Err(e) => Err(e),
                };
                let _ = tx.send(started);
            });
            Ok(Started::Waiting(rx))
        })?;
        Ok(Consumption { inner: tokio::sync::Mutex::new(c), chunks, dim, chunk_bytes })
    }

    /// Reports the payload of `handle` consumed (the end of a `hold` consume, once the work
    /// that used it is committed). A producer that is gone is not an error. With `wait=False`
    /// the report is sent in the background (bounded by `timeout`; a failure is dropped) and
    /// the call returns at once.
    #[pyo3(signature = (handle, *, wait = true, timeout = 30.0))]
    fn release(&self, py: Python<'_>, handle: &[u8], wait: bool, timeout: f64) -> PyResult<()> {
        let r = self::handle(handle).raise(py)?;
        let conn = self.inner.clone();
        let t = seconds(timeout).raise(py)?;
        if !wait {
            // Nobody is there to hear of a failure: the payload's lease, or its producer
            // retiring it, ends it then.
            runtime().raise(py)?.spawn(async move {
                let _ = tokio::time::timeout(t, conn.release(&r)).await;
            });
            return Ok(());
        }
        self::wait(py, t, "a release", async move { Ok(conn.release(&r).await?) })
    }

    /// Drops a publication before its lease ends (its consumers then see the producer gone).
    fn retire(&self, publication: &Publication) {
        let p = publication.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = p.as_ref() {
            self.inner.retire(p);
        }
    }

    /// Payloads this connector still holds for consumers.
    #[getter]
    fn held(&self) -> usize {
        self.inner.held()
    }
}

/// The device ordinal of a tensor's memory (0 for host memory).
fn ordinal(meta: &tensorwire_core::TensorMeta) -> u32 {
    match meta.device {
        tensorwire_core::MemoryKind::Device { ordinal } => ordinal,
        _ => 0,
    }
}

/// A published payload: hand `handle` to the consumer; mark chunks ready as they are produced.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Publication {
    conn: Arc<DiffusionConnector>,
    inner: Arc<Mutex<Option<tensorwire_diffusion::Publication>>>,
    /// The producer's stream given to `publish`, for `mark_ready`.
    stream: Option<u64>,
    /// The device ordinal of the published tensor (0 for host memory): where its streams are.
    device: u32,
}

impl Publication {
    fn with<T>(&self, f: impl FnOnce(&mut tensorwire_diffusion::Publication) -> Res<T>) -> Res<T> {
        with(&self.inner, f)
    }

    /// Marks chunk `index` ready once `event` (the producer's stream's work) has ended, in the
    /// background; a failure then (the wait timed out, the publication was released) is logged.
    fn ready_after(
        &self,
        py: Python<'_>,
        index: u32,
        event: crate::stream::Event,
        limit: std::time::Duration,
    ) -> PyResult<()> {
        let chunks = self.with(|p| Ok(p.reference.chunking.map_or(1, |c| c.count))).raise(py)?;
        if index >= chunks {
            let e = Failure::invalid(format!("chunk {index} of a payload of {chunks} chunks"));
            return Err(e.into_py(py));
        }
        let inner = self.inner.clone();
        runtime().raise(py)?.spawn(async move {
            let marked = match event.reached(limit, "marking a chunk ready").await {
                Ok(()) => with(&inner, |p| Ok(p.mark_ready(index)?)),
                Err(e) => Err(e),
            };
            if let Err(e) = marked {
                tracing::warn!(chunk = index, error = ?e, "a chunk marked on a stream was not made ready");
            }
        });
        Ok(())
    }
}

fn with<T>(
    inner: &Mutex<Option<tensorwire_diffusion::Publication>>,
    f: impl FnOnce(&mut tensorwire_diffusion::Publication) -> Res<T>,
) -> Res<T> {
    let mut g = inner.lock().unwrap_or_else(PoisonError::into_inner);
    let p = g.as_mut().ok_or_else(|| Failure::invalid("the publication was released"))?;
    f(p)
}

#[pymethods]
impl Publication {
    /// The handle: small bytes that tell a consumer where the payload is.
    #[getter]
    fn handle<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.with(|p| Ok(p.reference.to_bytes())).raise(py)?;
        Ok(PyBytes::new(py, &b))
    }

    /// Chunk `index` is produced: consumers may fetch it. With a stream (this call's, else the
    /// one given to `publish`), once the work queued on it before this call has ended: the
    /// call returns at once, and a failure then is logged (see `crate::stream`).
    #[pyo3(signature = (index, *, stream = None, timeout = 30.0))]
    fn mark_ready(
        &self,
        py: Python<'_>,
        index: u32,
        stream: Option<&Bound<'_, PyAny>>,
        timeout: f64,
    ) -> PyResult<()> {
        let _entered = runtime().raise(py)?.enter();
        let given = stream.map(crate::stream::handle).transpose()?;
        match given.or(self.stream) {
            Some(h) => {
                let event = crate::stream::record(h, self.device).raise(py)?;
                self.ready_after(py, index, event, seconds(timeout).raise(py)?)
            }
            None => self.with(|p| Ok(p.mark_ready(index)?)).raise(py),
        }
    }

    /// Every chunk is produced.
    fn mark_all_ready(&self, py: Python<'_>) -> PyResult<()> {
        let _entered = runtime().raise(py)?.enter();
        self.with(|p| Ok(p.mark_all_ready()?)).raise(py)
    }

    /// Store mode: waits until the payload is in the store (the tensor may then change).
    #[pyo3(signature = (*, timeout = 30.0))]
    fn wait_stored(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let taken = self.inner.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(mut p) = taken else {
            return Err(Failure::invalid("the publication was released").into_py(py));
        };
        let t = seconds(timeout).raise(py)?;
        let (r, p) = py
            .detach(|| {
                let rt = runtime()?;
                Ok::<_, Failure>(rt.block_on(async {
                    let r = tokio::time::timeout(t, p.stored()).await;
                    (r, p)
                }))
            })
            .raise(py)?;
        *self.inner.lock().unwrap_or_else(PoisonError::into_inner) = Some(p);
        match r {
            Ok(r) => r.map_err(|e| Failure::from(e).into_py(py)),
            Err(_) => Err(Failure::new("TimeoutError", "waiting for the store put").into_py(py)),
        }
    }

    /// Stops serving the payload now (consumers see the producer gone); True if it was still
    /// served (not consumed, expired or retired before).
    fn retire(&self) -> bool {
        let p = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(p) = p.as_ref() else { return false };
        let served = self.conn.serves(p);
        self.conn.retire(p);
        served
    }
}

/// A consume, started, or waiting for its stream's earlier work before it starts.
enum Started {
    Waiting(tokio::sync::oneshot::Receiver<Res<tensorwire_diffusion::Consumption>>),
    Running(tensorwire_diffusion::Consumption),
}

/// Chunks of a payload landing in the destination.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Consumption {
    inner: tokio::sync::Mutex<Started>,
    chunks: u32,
    dim: Option<u32>,
    /// About how many bytes each chunk is (how long a wait for one is).
    chunk_bytes: u64,
}

#[pymethods]
impl Consumption {
    /// The next chunk that landed, as (index, start, end) along the chunk dimension, or None when
    /// every chunk has landed (the payload is then consumed).
    #[pyo3(signature = (*, timeout = 30.0))]
    fn next(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<(u32, u64, u64)>> {
        let t = seconds(timeout).raise(py)?;
        wait_sized(py, t, "the next chunk", self.chunk_bytes, async {
            let mut c = self.inner.lock().await;
            if let Started::Waiting(rx) = &mut *c {
                let started = rx
                    .await
                    .map_err(|_| Failure::new("InternalError", "a consume's start was dropped"))?;
                *c = Started::Running(started?);
            }
            match &mut *c {
                Started::Running(c) => Ok(c.next().await?.map(|v| (v.index, v.start, v.end))),
                Started::Waiting(_) => Err(Failure::new("InternalError", "a consume not started")),
            }
        })
    }

    /// Number of chunks.
    #[getter]
    fn num_chunks(&self) -> u32 {
        self.chunks
    }

    /// The chunk dimension (None for an unchunked payload).
    #[getter]
    fn chunk_dim(&self) -> Option<u32> {
        self.dim
    }
}

/// What a handle says: request, kind, dtype, shape, chunking, where the bytes are.
#[pyfunction]
pub(crate) fn describe_handle<'py>(py: Python<'py>, handle: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let r = self::handle(handle).raise(py)?;
    let d = PyDict::new(py);
    d.set_item("request", r.request)?;
    d.set_item("kind", kind_name(r.kind))?;
    d.set_item("dtype", dtype_name(r.meta.dtype))?;
    d.set_item("shape", r.meta.shape.clone())?;
    d.set_item("nbytes", r.meta.nbytes().unwrap_or(0))?;
    d.set_item("chunk_dim", r.chunking.map(|c| c.dim))?;
    d.set_item("num_chunks", r.chunking.map_or(1, |c| c.count))?;
    let (via, key) = match &r.source {
        Source::Store { key } => ("store", Some(PyBytes::new(py, key))),
        Source::P2p { .. } => ("p2p", None),
    };
    d.set_item("source", via)?;
    d.set_item("store_key", key)?;
    Ok(d)
}
