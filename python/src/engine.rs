//! `Engine`, `Region` and `Session`: the transfer engine from Python. An engine listens on a
//! control address (tcp backend); regions are tensors (DLPack, zero-copy), engine-allocated
//! buffers or raw addresses (the Mooncake-style API); a region's `descriptor()` is what a peer
//! needs to reach it, handed over out of band.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tensorwire_core::ClusterSecret;
use tensorwire_core::{EngineConfig, MemoryKind, RemoteRegion, TransferOp, backend::Backend};
use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_tcp::{TcpBackend, TcpConfig};

use crate::dlpack::{Tensor, perms};
use crate::errors::{Failure, Raise, Res};
use crate::runtime::{seconds, wait, wait_sized};

/// Parses "host:port" (a missing port means any free port).
pub(crate) fn addr(s: &str) -> Res<SocketAddr> {
    let with_port = if s.contains(':') { s.to_string() } else { format!("{s}:0") };
    if let Ok(a) = with_port.parse() {
        return Ok(a);
    }
    std::net::ToSocketAddrs::to_socket_addrs(&with_port)
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| Failure::invalid(format!("{s:?} is not a host:port address")))
}

/// The secret in `file`, if one is given (see `ClusterSecret::from_file` for the checks).
pub(crate) fn secret(file: Option<PathBuf>) -> Res<Option<ClusterSecret>> {
    Ok(file.map(|p| ClusterSecret::from_file(&p)).transpose()?)
}

/// The backends this package can build, in the order an engine prefers them.
const BACKENDS: &[&str] = &["cuda", "shm", "rdma", "ucx", "tcp"];

/// An engine's backends when none are named: the cuda backend first where the process has a GPU
/// driver (it moves device regions between engines of one host and nothing else), then tcp.
fn default_backends() -> Vec<String> {
    let mut names = vec!["tcp".to_string()];
    if crate::gpu::present() {
        names.insert(0, "cuda".to_string());
    }
    names
}

/// Builds the backend `name` for an engine listening on `ip`. "rdma" needs a device and this
/// package built with the `verbs` feature, "ucx" the `ucx` feature; without, they are
/// `Unsupported` (never the in-process software NIC, which cannot reach another process).
fn backend(name: &str, ip: IpAddr, tcp: &TcpConfig, insecure: bool) -> Res<Arc<dyn Backend>> {
    Ok(match name {
        "tcp" => TcpBackend::new(tcp.clone())?,
        "shm" => tensorwire_shm::ShmBackend::new()?,
        "cuda" => crate::gpu::cuda_backend()?,
        "ucx" => tensorwire_ucx::new_backend(tensorwire_ucx::UcxConfig::default())?,
        "rdma" => {
            if !tensorwire_rdma::host_has_rdma_device() {
                return Err(tensorwire_core::Error::Unsupported {
                    backend: "rdma",
                    what: "this host has no RDMA device (/sys/class/infiniband is empty)".into(),
                }
                .into());
            }
            let listen = SocketAddr::new(ip, 0);
            let cfg = tensorwire_rdma::RdmaConfig { listen, insecure, ..Default::default() };
            tensorwire_rdma::RdmaBackend::new(cfg, tensorwire_rdma::ibverbs_provider()?)?
        }
        other => {
            return Err(Failure::invalid(format!(
                "unknown backend {other:?}: this package has {BACKENDS:?}"
            )));
        }
    })
}

/// Bytes moved by completed transfers, by the backend that moved them.
type Moved = Arc<Mutex<BTreeMap<&'static str, u64>>>;

/// A transfer engine with a tcp backend (or the backends named). Every method that waits
/// releases the GIL and takes a `timeout` in seconds.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Engine {
    pub(crate) inner: tensorwire_core::Engine,
    moved: Moved,
}

#[pymethods]
impl Engine {
    /// Starts an engine whose control endpoint listens on `listen` ("host:port"; port 0 or no
    /// port picks a free one). On an address other hosts can reach it needs `secret_file` (see
    /// `tensorwire secret new`) or `insecure=True`. `checksum` adds a crc32c to every piece.
    /// `backends` names the transports ("cuda", "tcp", "shm", "rdma", "ucx"), preferred in that
    /// list's order; one that cannot run here raises `UnsupportedError` saying why. By default:
    /// "cuda" then "tcp" in a process with a GPU driver, else "tcp". The engine gets the
    /// process's GPU driver, if any, for device tensors (see `tensorwire.gpu`).
    #[new]
    #[pyo3(signature = (listen = "127.0.0.1:0", *, secret_file = None, insecure = false, checksum = false, streams = 0, backends = None, timeout = 30.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        secret_file: Option<PathBuf>,
        insecure: bool,
        checksum: bool,
        streams: usize,
        backends: Option<Vec<String>>,
        timeout: f64,
    ) -> PyResult<Engine> {
        let backends = backends.unwrap_or_else(default_backends);
        let listen = addr(listen).raise(py)?;
        let cluster_secret = secret(secret_file).raise(py)?;
        let data = SocketAddr::new(listen.ip(), 0);
        let mut tcp = TcpConfig { listen: data, checksum, ..TcpConfig::default() };
        if streams > 0 {
            tcp.streams = streams;
        }
        if backends.is_empty() {
            return Err(Failure::invalid("an engine needs at least one backend").into_py(py));
        }
        let config = EngineConfig { listen, cluster_secret, insecure, ..EngineConfig::default() };
        let t = seconds(timeout).raise(py)?;
        let inner = wait(py, t, "starting the engine", async move {
            let mut b = crate::gpu::equip(tensorwire_core::Engine::builder());
            for name in &backends {
                b = b.backend(backend(name, listen.ip(), &tcp, insecure)?);
            }
            Ok(b.config(config).start().await?)
        })?;
        Ok(Engine { inner, moved: Moved::default() })
    }

    /// The backends' names, in order of preference.
    #[getter]
    fn backends(&self) -> Vec<&'static str> {
        self.inner.backends().iter().map(|b| b.name()).collect()
    }

    /// Bytes moved by this engine's completed `Session` transfers, by backend name.
    fn moved(&self) -> BTreeMap<&'static str, u64> {
        self.moved.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// What this engine moved as initiator: "bytes_read", "bytes_written", "ops_ok",
    /// "ops_failed", "host_staged" (times device memory went through a host staging buffer, on
    /// this engine's side, for its own ops or a peer's: 0 while every device byte moved device
    /// to device) and "by_backend" (bytes of completed ops by the backend that moved them).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let s = self.inner.stats();
        let d = pyo3::types::PyDict::new(py);
        d.set_item("bytes_read", s.bytes_read)?;
        d.set_item("bytes_written", s.bytes_written)?;
        d.set_item("ops_ok", s.ops_ok)?;
        d.set_item("ops_failed", s.ops_failed)?;
        d.set_item("host_staged", s.host_staged)?;
        let by: BTreeMap<&'static str, u64> = self.inner.bytes_by_backend().into_iter().collect();
        d.set_item("by_backend", by)?;
        Ok(d)
    }

    /// The control address peers connect to ("ip:port").
    #[getter]
    fn address(&self) -> String {
        self.inner.local_addr().to_string()
    }

    /// The engine's id.
    #[getter]
    fn id(&self) -> String {
        self.inner.id().to_string()
    }

    /// Registers memory for transfers, without copying it: a `tensor` (anything with
    /// `__dlpack__`: host memory, or CUDA device memory with a GPU driver; the region keeps it
    /// alive), or `length` bytes at `address` (Mooncake's `register_memory`: device memory if the
    /// GPU driver says the address is, else host memory; the caller keeps that memory valid until
    /// `Region.close()` returned, since the engine cannot hold a raw address). Peers may read the
    /// region if `readable`, write it if `writable`.
    #[pyo3(signature = (tensor = None, *, address = None, length = None, readable = true, writable = true, timeout = 30.0))]
    fn register(
        &self,
        py: Python<'_>,
        tensor: Option<&Bound<'_, PyAny>>,
        address: Option<usize>,
        length: Option<u64>,
        readable: bool,
        writable: bool,
        timeout: f64,
    ) -> PyResult<Region> {
        let (engine, p) = (self.inner.clone(), perms(readable, writable));
        let t = seconds(timeout).raise(py)?;
        let inner = match (tensor, address, length) {
            (Some(obj), None, None) => {
                let tensor = Tensor::import(obj)?;
                wait(
                    py,
                    t,
                    "registering a tensor",
                    async move { tensor.register(&engine, p).await },
                )?
            }
            (None, Some(address), Some(length)) => wait(py, t, "registering memory", async move {
                if let Some(ordinal) = crate::gpu::device_of(address as u64) {
                    // SAFETY: the Python caller guarantees `address..address+length` stays
                    // allocated until the region is closed (documented above); the GPU driver
                    // checks it is device memory of `ordinal`.
                    let r = unsafe { engine.register_device(address as u64, length, ordinal, p) };
                    return Ok(r.await?);
                }
                let ptr = address as *mut u8;
                // SAFETY: the Python caller guarantees `address..address+length` is host memory
                // that stays valid until the region is closed (documented above: the raw-address
                // API has no way to hold the memory itself).
                let r = unsafe { engine.register_raw(ptr, length, MemoryKind::Host, p) };
                Ok(r.await?)
            })?,
            _ => {
                let e = Failure::invalid("register a tensor, or address= and length=, not both");
                return Err(e.into_py(py));
            }
        };
        Ok(Region::new(inner))
    }

    /// Allocates `length` zeroed bytes of engine memory (same-host peers can map it).
    #[pyo3(signature = (length, *, readable = true, writable = true, timeout = 30.0))]
    fn alloc(
        &self,
        py: Python<'_>,
        length: u64,
        readable: bool,
        writable: bool,
        timeout: f64,
    ) -> PyResult<Region> {
        let engine = self.inner.clone();
        let inner = wait(py, seconds(timeout).raise(py)?, "allocating memory", async move {
            Ok(engine.alloc(length, perms(readable, writable)).await?)
        })?;
        Ok(Region::new(inner))
    }

    /// Connects to the engine at `address` (handshake; reuses an existing session).
    #[pyo3(signature = (address, *, timeout = 30.0))]
    fn connect(&self, py: Python<'_>, address: &str, timeout: f64) -> PyResult<Session> {
        let a = addr(address).raise(py)?;
        let engine = self.inner.clone();
        let inner = wait(py, seconds(timeout).raise(py)?, "connecting", async move {
            Ok(engine.connect(a).await?)
        })?;
        Ok(Session { inner, moved: self.moved.clone() })
    }

    /// The next notification from any peer: (sender engine id, payload).
    #[pyo3(signature = (*, timeout = 30.0))]
    fn recv_notification<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
    ) -> PyResult<(String, Bound<'py, PyBytes>)> {
        let t = seconds(timeout).raise(py)?;
        let engine = self.inner.clone();
        let n = wait(py, t + std::time::Duration::from_millis(50), "a notification", async move {
            Ok(engine.recv_notification(t).await?)
        })?;
        Ok((n.from.to_string(), PyBytes::new(py, &n.payload)))
    }

    /// Stops the engine: pending transfers fail, peers see it gone.
    #[pyo3(signature = (*, timeout = 30.0))]
    fn shutdown(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let engine = self.inner.clone();
        wait(py, seconds(timeout).raise(py)?, "shutting down", async move {
            engine.shutdown().await;
            Ok(())
        })
    }
}

/// A registered region. `close()` (or dropping every reference) deregisters it; for memory
/// registered by address, `close()` waits until no transfer uses it.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Region {
    inner: std::sync::Mutex<Option<Arc<tensorwire_core::Region>>>,
}

impl Region {
    pub(crate) fn new(r: tensorwire_core::Region) -> Region {
        Region { inner: std::sync::Mutex::new(Some(Arc::new(r))) }
    }

    /// The region, unless it was closed.
    pub(crate) fn get(&self) -> Res<Arc<tensorwire_core::Region>> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .ok_or_else(|| Failure::invalid("the region was closed"))
    }
}

#[pymethods]
impl Region {
    /// Length in bytes.
    #[getter]
    fn length(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.get().raise(py)?.len())
    }

    /// The address of the region's first byte in this process (host memory only), for APIs
    /// that name memory by address (Mooncake's); valid while the region is registered.
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<usize> {
        let r = self.get().raise(py)?;
        if !r.kind().is_host() {
            let what = format!("a {:?} region has no host address", r.kind());
            return Err(Failure::new("UnsupportedError", what).into_py(py));
        }
        let s = r.slice(0, r.len()).map_err(Failure::from).raise(py)?;
        Ok(s.ptr() as usize)
    }

    /// Region id on its engine.
    #[getter]
    fn id(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.get().raise(py)?.id().0)
    }

    /// What a peer needs to reach this region (id, access key, length, backends' blobs), as
    /// bytes to hand over out of band. Anyone holding it can access the region as permitted.
    fn descriptor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let mut w = Writer::new();
        self.get().raise(py)?.remote().encode(&mut w);
        Ok(PyBytes::new(py, &w.finish()))
    }

    /// A copy of `length` bytes at `offset` (for tests and small control data).
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let v = self.get().and_then(|r| Ok(r.to_vec(offset, length)?)).raise(py)?;
        Ok(PyBytes::new(py, &v))
    }

    /// Copies `data` into the region at `offset`.
    fn write(&self, py: Python<'_>, offset: u64, data: &[u8]) -> PyResult<()> {
        self.get().and_then(|r| Ok(r.write_bytes(offset, data)?)).raise(py)
    }

    /// Deregisters now, waiting (up to `timeout`) for the transfers that use the region; later
    /// calls on this object raise. Idempotent.
    #[pyo3(signature = (*, timeout = 30.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let taken = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let Some(r) = taken else { return Ok(()) };
        let t = seconds(timeout).raise(py)?;
        wait(py, t, "deregistering", async move {
            match Arc::try_unwrap(r) {
                Ok(region) => Ok(region.deregister().await?),
                Err(_) => Ok(()), // a transfer or publication still holds it: it goes with them
            }
        })
    }
}

/// Decodes a `Region.descriptor()`.
pub(crate) fn remote(descriptor: &[u8]) -> Res<RemoteRegion> {
    let mut r = Reader::new(descriptor, "region descriptor");
    let d = RemoteRegion::decode(&mut r)?;
    r.finish()?;
    Ok(d)
}

/// One transfer of a batch: (local region, local offset, remote descriptor, remote offset, length).
type Op<'a> = (PyRef<'a, Region>, u64, Vec<u8>, u64, u64);

/// A session with one peer engine.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Session {
    inner: tensorwire_core::Session,
    moved: Moved,
}

/// Adds `bytes` to what `backend` moved.
fn count(moved: &Moved, backend: &'static str, bytes: u64) {
    *moved.lock().unwrap_or_else(PoisonError::into_inner).entry(backend).or_default() += bytes;
}

/// The engine's ops of a batch from Python: WRITEs or READs.
fn built(py: Python<'_>, write: bool, ops: Vec<Op<'_>>) -> PyResult<Vec<TransferOp>> {
    let mut built = Vec::with_capacity(ops.len());
    for (local, lo, desc, ro, len) in ops {
        let remote = remote(&desc).raise(py)?;
        let local = local.get().raise(py)?;
        built.push(if write {
            TransferOp::write(&local, lo, &remote, ro, len)
        } else {
            TransferOp::read(&local, lo, &remote, ro, len)
        });
    }
    Ok(built)
}

impl Session {
    fn run(&self, py: Python<'_>, write: bool, ops: Vec<Op<'_>>, timeout: f64) -> PyResult<u64> {
        let built = built(py, write, ops)?;
        let bytes = built.iter().map(TransferOp::len).sum();
        let (s, moved) = (self.inner.clone(), self.moved.clone());
        wait_sized(py, seconds(timeout).raise(py)?, "a transfer", bytes, async move {
            let mut bytes = 0;
            for h in s.submit(built).await {
                let backend = h.backend();
                let n = h.await?.bytes;
                count(&moved, backend, n);
                bytes += n;
            }
            Ok(bytes)
        })
    }

    fn prepare(
        &self,
        py: Python<'_>,
        write: bool,
        ops: Vec<Op<'_>>,
        timeout: f64,
    ) -> PyResult<PreparedTransfer> {
        let built = built(py, write, ops)?;
        let s = self.inner.clone();
        let inner = wait(py, seconds(timeout).raise(py)?, "preparing a transfer", async move {
            Ok(s.prepare(built).await?)
        })?;
        Ok(PreparedTransfer { inner: Arc::new(inner), moved: self.moved.clone() })
    }
}

/// Ops checked once (`Session.prepare_write`, `Session.prepare_read`) and run again with each
/// `post`: for a transfer made again and again, such as the same tensor every step.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct PreparedTransfer {
    inner: Arc<tensorwire_core::PreparedTransfer>,
    moved: Moved,
}

#[pymethods]
impl PreparedTransfer {
    /// Runs every op once more and waits for all; returns the bytes moved. The peer's checks
    /// hold at every post (a region it deregistered since raises `NotFoundError`).
    #[pyo3(signature = (*, timeout = 30.0))]
    fn post(&self, py: Python<'_>, timeout: f64) -> PyResult<u64> {
        let (p, moved) = (self.inner.clone(), self.moved.clone());
        let bytes = p.ops().iter().map(TransferOp::len).sum();
        wait_sized(py, seconds(timeout).raise(py)?, "a prepared transfer", bytes, async move {
            let report = p.post().await.await?;
            count(&moved, report.backend, report.bytes);
            Ok(report.bytes)
        })
    }

    /// How many ops each post runs.
    fn __len__(&self) -> usize {
        self.inner.ops().len()
    }
}

/// The `Session` methods; WRITE and READ (one op, and batches) are written once.
macro_rules! session_methods {
    ($(($one:ident, $batch:ident, $prepare:ident, $write:literal, $doc:literal, $batch_doc:literal)),*) => {
        #[pymethods]
        impl Session {
            /// The peer engine's id.
            #[getter]
            fn peer(&self) -> String {
                self.inner.peer().to_string()
            }

            $(
            #[doc = $doc]
            #[pyo3(signature = (local, local_offset, remote, remote_offset, length, *, timeout = 30.0))]
            fn $one(
                &self,
                py: Python<'_>,
                local: PyRef<'_, Region>,
                local_offset: u64,
                remote: Vec<u8>,
                remote_offset: u64,
                length: u64,
                timeout: f64,
            ) -> PyResult<u64> {
                let op = (local, local_offset, remote, remote_offset, length);
                self.run(py, $write, vec![op], timeout)
            }

            #[doc = $batch_doc]
            #[pyo3(signature = (ops, *, timeout = 30.0))]
            fn $batch(&self, py: Python<'_>, ops: Vec<Op<'_>>, timeout: f64) -> PyResult<u64> {
                self.run(py, $write, ops, timeout)
            }

            /// The ops (tuples as in the batch call) checked once, for `post` to run again and
            /// again; raises what the batch call would for an op it refuses.
            #[pyo3(signature = (ops, *, timeout = 30.0))]
            fn $prepare(
                &self,
                py: Python<'_>,
                ops: Vec<Op<'_>>,
                timeout: f64,
            ) -> PyResult<PreparedTransfer> {
                self.prepare(py, $write, ops, timeout)
            }
            )*

            /// Sends a notification; the peer gets it from `recv_notification` after every
            /// earlier transfer on this session.
            #[pyo3(signature = (payload, *, timeout = 30.0))]
            fn notify(&self, py: Python<'_>, payload: Vec<u8>, timeout: f64) -> PyResult<()> {
                let s = self.inner.clone();
                wait(py, seconds(timeout).raise(py)?, "a notification", async move {
                    Ok(s.notify(Bytes::from(payload)).await?)
                })
            }
        }
    };
}

session_methods!(
    (
        write,
        batch_write,
        prepare_write,
        true,
        "WRITE `length` bytes from `local[local_offset:]` into the peer's region (its \
         descriptor) at `remote_offset`; returns the bytes moved.",
        "Many WRITEs (each op a tuple as in `write`), moved concurrently; waits for all."
    ),
    (
        read,
        batch_read,
        prepare_read,
        false,
        "READ `length` bytes of the peer's region (its descriptor) at `remote_offset` into \
         `local[local_offset:]`; returns the bytes moved.",
        "Many READs (each op a tuple as in `read`), moved concurrently; waits for all."
    )
);
