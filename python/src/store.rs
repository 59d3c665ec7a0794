//! The store from Python: an embedded store on a local engine, a store node serving it, or a
//! client of a remote node; bytes in and out, or tensors without a staging copy (`put_from`,
//! `get_into`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tensorwire_core::{DType, MemoryKind, Permissions, TensorMeta};
use tensorwire_store::{
    ClusterConfig, ClusterStore, EmbeddedStore, GetInto, PutFrom, RemoteStore, Retention,
    StoreConfig,
};

use crate::dlpack::Tensor;
use crate::engine::{Engine, Region, addr};
use crate::errors::{Failure, Raise, Res};
use crate::runtime::{seconds, wait, wait_sized};

fn retention(s: &str) -> Res<Retention> {
    match s {
        "normal" => Ok(Retention::Normal),
        "soft" | "soft_pin" => Ok(Retention::Soft),
        "pinned" => Ok(Retention::Pinned),
        _ => Err(Failure::invalid(format!("retention {s:?}: expected normal, soft or pinned"))),
    }
}

/// A key: str (UTF-8) or bytes.
#[derive(FromPyObject)]
pub(crate) enum Key {
    Text(String),
    Bytes(Vec<u8>),
}

impl Key {
    fn into_bytes(self) -> Vec<u8> {
        match self {
            Key::Text(s) => s.into_bytes(),
            Key::Bytes(b) => b,
        }
    }
}

/// An object store of tensors: embedded (`Store.embedded`) or a client of a node
/// (`Store.connect`). Both have the same methods.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Store {
    inner: Arc<dyn tensorwire_store::Store>,
    embedded: Option<Arc<EmbeddedStore>>,
    cluster: Option<Arc<ClusterStore>>,
    engine: tensorwire_core::Engine,
}

impl Store {
    pub(crate) fn shared(&self) -> Arc<dyn tensorwire_store::Store> {
        self.inner.clone()
    }

    /// Each object's tensor view (DLPack).
    fn tensors(tensors: &[Bound<'_, PyAny>]) -> PyResult<Vec<Tensor>> {
        tensors.iter().map(Tensor::import).collect()
    }
}

#[pymethods]
impl Store {
    /// An embedded store of `capacity` bytes on `engine`; `shared=True` lets a `StoreNode` serve
    /// it; `spill_dir` adds a file tier for evicted objects.
    #[staticmethod]
    #[pyo3(signature = (engine, capacity, *, spill_dir = None, shared = false, timeout = 30.0))]
    fn embedded(
        py: Python<'_>,
        engine: &Engine,
        capacity: u64,
        spill_dir: Option<PathBuf>,
        shared: bool,
        timeout: f64,
    ) -> PyResult<Store> {
        let e = engine.inner.clone();
        let cfg = StoreConfig { capacity, spill_dir, shared, ..StoreConfig::default() };
        let s = wait(py, seconds(timeout).raise(py)?, "creating a store", async move {
            Ok(EmbeddedStore::new(&e, cfg).await?)
        })?;
        Ok(Store {
            inner: s.clone(),
            embedded: Some(s),
            cluster: None,
            engine: engine.inner.clone(),
        })
    }

    /// A client of the store node whose RPC listens on `node_rpc` (the node tells where its
    /// engine listens; `node_engine` overrides that).
    #[staticmethod]
    #[pyo3(signature = (engine, node_rpc, *, node_engine = None, timeout = 30.0))]
    fn connect(
        py: Python<'_>,
        engine: &Engine,
        node_rpc: &str,
        node_engine: Option<&str>,
        timeout: f64,
    ) -> PyResult<Store> {
        let nr = addr(node_rpc).raise(py)?;
        let ne = node_engine.map(addr).transpose().raise(py)?;
        let e = engine.inner.clone();
        let s =
            wait(py, seconds(timeout).raise(py)?, "connecting to the store node", async move {
                Ok(match ne {
                    Some(ne) => RemoteStore::connect(&e, ne, nr).await?,
                    None => RemoteStore::connect_node(&e, nr).await?,
                })
            })?;
        Ok(Store {
            inner: Arc::new(s),
            embedded: None,
            cluster: None,
            engine: engine.inner.clone(),
        })
    }

    /// A cluster store over the store nodes whose RPCs listen on `nodes`: each object on the
    /// first `replicas` live nodes of its rendezvous order, read from any live replica.
    /// Nothing is dialled until first used (a node down now is tried again later).
    #[staticmethod]
    #[pyo3(signature = (engine, nodes, *, replicas = 2))]
    fn cluster(
        py: Python<'_>,
        engine: &Engine,
        nodes: Vec<String>,
        replicas: usize,
    ) -> PyResult<Store> {
        let addrs = nodes.iter().map(|n| addr(n)).collect::<Result<Vec<_>, _>>().raise(py)?;
        let cfg = ClusterConfig { replicas, ..ClusterConfig::default() };
        let c =
            ClusterStore::remote(&engine.inner, &addrs, cfg).map_err(Failure::from).raise(py)?;
        let c = Arc::new(c);
        Ok(Store {
            inner: c.clone(),
            embedded: None,
            cluster: Some(c),
            engine: engine.inner.clone(),
        })
    }

    /// The same store, its puts making `replicas` copies (a cluster store; any store for 1).
    fn with_replicas(&self, py: Python<'_>, replicas: usize) -> PyResult<Store> {
        match &self.cluster {
            Some(c) => {
                let c = Arc::new(c.with_replicas(replicas).map_err(Failure::from).raise(py)?);
                let engine = self.engine.clone();
                Ok(Store { inner: c.clone(), embedded: None, cluster: Some(c), engine })
            }
            None if replicas == 1 => Ok(Store {
                inner: self.inner.clone(),
                embedded: self.embedded.clone(),
                cluster: None,
                engine: self.engine.clone(),
            }),
            None => Err(Failure::invalid(format!(
                "{replicas} replicas need a cluster store (Store.cluster); this store keeps one copy"
            ))
            .into_py(py)),
        }
    }

    /// Whether this is a cluster store (several nodes, replicas).
    #[getter]
    fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// Stores a copy of `data` under `key`.
    #[pyo3(signature = (key, data, *, retention = "normal", timeout = 30.0))]
    fn put(
        &self,
        py: Python<'_>,
        key: Key,
        data: Vec<u8>,
        retention: &str,
        timeout: f64,
    ) -> PyResult<()> {
        let (key, r, s) =
            (key.into_bytes(), self::retention(retention).raise(py)?, self.inner.clone());
        let meta = TensorMeta::contiguous(DType::U8, &[data.len() as u64]);
        let bytes = data.len() as u64;
        wait_sized(py, seconds(timeout).raise(py)?, "a store put", bytes, async move {
            Ok(s.put(&key, &meta, &data, r).await?)
        })
    }

    /// A copy of the bytes stored under `key`.
    #[pyo3(signature = (key, *, timeout = 30.0))]
    fn get<'py>(&self, py: Python<'py>, key: Key, timeout: f64) -> PyResult<Bound<'py, PyBytes>> {
        let (key, s) = (key.into_bytes(), self.inner.clone());
        let (_, bytes) =
            wait(
                py,
                seconds(timeout).raise(py)?,
                "a store get",
                async move { Ok(s.get(&key).await?) },
            )?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Stores `tensor` (its dtype and shape too) without a staging copy.
    #[pyo3(signature = (key, tensor, *, retention = "normal", timeout = 30.0))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: Key,
        tensor: &Bound<'_, PyAny>,
        retention: &str,
        timeout: f64,
    ) -> PyResult<()> {
        let r = self::retention(retention).raise(py)?;
        let t = Tensor::import(tensor)?;
        let done = self.batch(py, vec![key.into_bytes()], vec![t], Some(r), timeout)?;
        done.into_iter().next().unwrap_or(Ok(0)).map(drop).raise(py)
    }

    /// Copies the object under `key` into `tensor` (no staging copy); returns the bytes copied.
    #[pyo3(signature = (key, tensor, *, timeout = 30.0))]
    fn get_into(
        &self,
        py: Python<'_>,
        key: Key,
        tensor: &Bound<'_, PyAny>,
        timeout: f64,
    ) -> PyResult<u64> {
        let t = Tensor::import(tensor)?;
        let done = self.batch(py, vec![key.into_bytes()], vec![t], None, timeout)?;
        done.into_iter().next().unwrap_or(Ok(0)).raise(py)
    }

    /// Stores `length` bytes of a registered region at `offset` (raw-address buffers; see
    /// `Engine.register(address=..., length=...)`).
    #[pyo3(signature = (key, region, offset, length, *, retention = "normal", timeout = 30.0))]
    fn put_from_region(
        &self,
        py: Python<'_>,
        key: Key,
        region: &Region,
        offset: u64,
        length: u64,
        retention: &str,
        timeout: f64,
    ) -> PyResult<()> {
        let r = self::retention(retention).raise(py)?;
        let (key, region, s) = (key.into_bytes(), region.get().raise(py)?, self.inner.clone());
        let meta = TensorMeta::contiguous(DType::U8, &[length]);
        wait_sized(py, seconds(timeout).raise(py)?, "a store put_from", length, async move {
            let src = region.slice(offset, length)?;
            Ok(s.put_from(&key, &meta, &src, r).await?)
        })
    }

    /// Copies the object under `key` into a registered region at `offset`; returns its length.
    #[pyo3(signature = (key, region, offset = 0, *, timeout = 30.0))]
    fn get_into_region(
        &self,
        py: Python<'_>,
        key: Key,
        region: &Region,
        offset: u64,
        timeout: f64,
    ) -> PyResult<u64> {
        let (key, region, s) = (key.into_bytes(), region.get().raise(py)?, self.inner.clone());
        wait(py, seconds(timeout).raise(py)?, "a store get_into", async move {
            Ok(s.get_into(&key, &region, offset).await?.1)
        })
    }

    /// `put_from` of many tensors, concurrently; one exception or None per item.
    #[pyo3(signature = (keys, tensors, *, retention = "normal", timeout = 30.0))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        tensors: Vec<Bound<'_, PyAny>>,
        retention: &str,
        timeout: f64,
    ) -> PyResult<Vec<Option<PyErr>>> {
        let r = self::retention(retention).raise(py)?;
        let ts = Store::tensors(&tensors)?;
        let keys = keys.into_iter().map(Key::into_bytes).collect();
        let out = self.batch(py, keys, ts, Some(r), timeout)?;
        Ok(out.into_iter().map(|r| r.err().map(|f| f.into_py(py))).collect())
    }

    /// `get_into` of many tensors, concurrently; bytes copied (or the exception) per item.
    #[pyo3(signature = (keys, tensors, *, timeout = 30.0))]
    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        tensors: Vec<Bound<'_, PyAny>>,
        timeout: f64,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let ts = Store::tensors(&tensors)?;
        let keys = keys.into_iter().map(Key::into_bytes).collect();
        let out = self.batch(py, keys, ts, None, timeout)?;
        out.into_iter()
            .map(|r| match r {
                Ok(n) => Ok(n.into_pyobject(py)?.into_any().unbind()),
                Err(f) => Ok(f.into_py(py).into_value(py).into_any()),
            })
            .collect()
    }

    /// Removes `key`; False if it was not there.
    #[pyo3(signature = (key, *, timeout = 30.0))]
    fn remove(&self, py: Python<'_>, key: Key, timeout: f64) -> PyResult<bool> {
        self.keyed(py, key, timeout, "a remove", |s, k| async move { s.remove(&k).await })
    }

    /// Whether `key` is stored.
    #[pyo3(signature = (key, *, timeout = 30.0))]
    fn exists(&self, py: Python<'_>, key: Key, timeout: f64) -> PyResult<bool> {
        self.keyed(py, key, timeout, "a lookup", |s, k| async move { s.exists(&k).await })
    }

    /// The object's length in bytes (its bytes do not move).
    #[pyo3(signature = (key, *, timeout = 30.0))]
    fn size(&self, py: Python<'_>, key: Key, timeout: f64) -> PyResult<u64> {
        let m = self.keyed(py, key, timeout, "a lookup", |s, k| async move { s.meta(&k).await })?;
        m.nbytes().map_err(Failure::from).raise(py)
    }

    /// One consumer of `key` is done (see `set_lease`); True when it was the last and the object
    /// is gone.
    #[pyo3(signature = (key, *, timeout = 30.0))]
    fn consumed(&self, py: Python<'_>, key: Key, timeout: f64) -> PyResult<bool> {
        self.keyed(
            py,
            key,
            timeout,
            "a consumed report",
            |s, k| async move { s.consumed(&k).await },
        )
    }

    /// Adds a pin (a pinned object is never evicted; pins count).
    #[pyo3(signature = (key, *, timeout = 30.0))]
    fn pin(&self, py: Python<'_>, key: Key, timeout: f64) -> PyResult<()> {
        self.keyed(py, key, timeout, "a pin", |s, k| async move { s.pin(&k).await })
    }

    /// Drops one pin.
    #[pyo3(signature = (key, *, timeout = 30.0))]
    fn unpin(&self, py: Python<'_>, key: Key, timeout: f64) -> PyResult<()> {
        self.keyed(py, key, timeout, "an unpin", |s, k| async move { s.unpin(&k).await })
    }

    /// Sets a lease: gone after `consumers` `consumed` calls (0: no count) or `ttl` seconds.
    #[pyo3(signature = (key, *, consumers = 0, ttl = None, timeout = 30.0))]
    fn set_lease(
        &self,
        py: Python<'_>,
        key: Key,
        consumers: u32,
        ttl: Option<f64>,
        timeout: f64,
    ) -> PyResult<()> {
        let ttl = ttl.map(seconds).transpose().raise(py)?;
        let (key, s) = (key.into_bytes(), self.inner.clone());
        wait(py, seconds(timeout).raise(py)?, "a lease", async move {
            Ok(s.set_lease(&key, consumers, ttl).await?)
        })
    }

    /// Counters: capacity, used, objects, spilled_objects, evictions, largest_free.
    #[pyo3(signature = (*, timeout = 30.0))]
    fn stats<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.clone();
        let st =
            wait(
                py,
                seconds(timeout).raise(py)?,
                "store stats",
                async move { Ok(s.stats().await?) },
            )?;
        let d = PyDict::new(py);
        d.set_item("capacity", st.capacity)?;
        d.set_item("used", st.used)?;
        d.set_item("objects", st.objects)?;
        d.set_item("spilled_objects", st.spilled_objects)?;
        d.set_item("evictions", st.evictions)?;
        d.set_item("largest_free", st.largest_free)?;
        Ok(d)
    }
}

impl Store {
    /// Runs one keyed store call with the GIL released.
    fn keyed<T, F>(
        &self,
        py: Python<'_>,
        key: Key,
        timeout: f64,
        what: &str,
        call: impl FnOnce(Arc<dyn tensorwire_store::Store>, Vec<u8>) -> F + Send,
    ) -> PyResult<T>
    where
        T: Send,
        F: std::future::Future<Output = tensorwire_store::Result<T>> + Send,
    {
        let (key, s) = (key.into_bytes(), self.inner.clone());
        // A control call of a key: short, the caller spins for its answer.
        wait_sized(py, seconds(timeout).raise(py)?, what, 0, async move { Ok(call(s, key).await?) })
    }

    /// `put_from` (with `put`'s retention) or `get_into` of many tensors, concurrently: the
    /// bytes stored or copied (or the failure) per item.
    fn batch(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        tensors: Vec<Tensor>,
        put: Option<Retention>,
        timeout: f64,
    ) -> PyResult<Vec<Res<u64>>> {
        if keys.len() != tensors.len() {
            return Err(Failure::invalid("as many keys as tensors").into_py(py));
        }
        let (s, e) = (self.inner.clone(), self.engine.clone());
        let bytes = tensors.iter().map(Tensor::span).sum();
        wait_sized(py, seconds(timeout).raise(py)?, "a store batch", bytes, async move {
            // The regions stay registered until the calls are done (slices are checked against
            // deregistration).
            let (mut regions, mut slices, mut metas) = (Vec::new(), Vec::new(), Vec::new());
            for t in tensors {
                // The stored value's layout; it lives in the store's host memory wherever it
                // came from (a device tensor is read out of device memory).
                metas.push(TensorMeta { device: MemoryKind::Host, ..t.meta.clone() });
                let span = t.span();
                let region = t.register(&e, Permissions::NONE).await?;
                slices.push(region.slice(0, span)?);
                regions.push(region);
            }
            let out: Vec<tensorwire_store::Result<u64>> = match put {
                Some(retention) => {
                    let items: Vec<PutFrom<'_>> = (keys.iter().zip(&metas).zip(&slices))
                        .map(|((key, meta), src)| PutFrom { key, meta, src, retention })
                        .collect();
                    let done = s.put_from_batch(&items).await;
                    done.into_iter().zip(&slices).map(|(r, src)| r.map(|()| src.len())).collect()
                }
                None => {
                    let items: Vec<GetInto<'_>> = (keys.iter().zip(&regions))
                        .map(|(key, dst)| GetInto { key, dst, offset: 0 })
                        .collect();
                    let done = s.get_into_batch(&items).await;
                    done.into_iter().map(|r| r.map(|(_, n)| n)).collect()
                }
            };
            drop(regions);
            Ok(out.into_iter().map(|r| r.map_err(Failure::from)).collect())
        })
    }
}

/// A store node: serves an embedded, shared store to other engines.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct StoreNode {
    inner: tensorwire_store::StoreNode,
}

#[pymethods]
impl StoreNode {
    /// Serves `store` (embedded, `shared=True`) on `listen`, with its engine's cluster secret.
    #[new]
    #[pyo3(signature = (store, listen = "127.0.0.1:0", *, timeout = 30.0))]
    fn new(py: Python<'_>, store: &Store, listen: &str, timeout: f64) -> PyResult<StoreNode> {
        let listen: SocketAddr = addr(listen).raise(py)?;
        let s = store
            .embedded
            .clone()
            .ok_or_else(|| Failure::invalid("a store node serves an embedded store").into_py(py))?;
        let inner = wait(py, seconds(timeout).raise(py)?, "starting the store node", async move {
            Ok(tensorwire_store::StoreNode::serve(s, listen).await?)
        })?;
        Ok(StoreNode { inner })
    }

    /// The RPC address clients connect to.
    #[getter]
    fn address(&self) -> String {
        self.inner.addr().to_string()
    }
}
