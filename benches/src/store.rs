//! `xfer --store`: the store's put_from / get_into against the raw medium of the same bytes: a
//! memcpy for the embedded store, a raw engine transfer over tcp to the node's pool for a remote
//! store node (same session, same engine, same sizes, interleaved).

use crate::Result;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use clap::ValueEnum;
use tensorwire_core::{DType, Engine, Permissions, Region, TensorMeta, TransferOp};
use tensorwire_store::{EmbeddedStore, RemoteStore, Retention, Store, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

use crate::memcpy::SharedMemcpy;

/// Which store to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreMode {
    /// In-process store; baseline memcpy.
    Embedded,
    /// Store node over tcp on loopback; baseline a raw engine transfer.
    Remote,
}

impl StoreMode {
    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            StoreMode::Embedded => "embedded",
            StoreMode::Remote => "remote",
        }
    }
}

/// Everything one store measurement needs.
#[derive(Debug)]
pub struct StoreBench {
    mode: StoreMode,
    streams: usize,
    store: Arc<dyn Store>,
    remote: Option<Arc<RemoteStore>>,
    src: Region,
    dst: Region,
    copy: SharedMemcpy,
    next: AtomicU64,
    scratch: u64,
    _keep: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

async fn engine(streams: usize) -> Result<Engine> {
    let tcp = TcpBackend::new(TcpConfig { streams, ..TcpConfig::default() })?;
    Ok(Engine::builder().backend(tcp).start().await?)
}

fn meta(len: u64) -> TensorMeta {
    TensorMeta::contiguous(DType::U8, &[len])
}

impl StoreBench {
    /// Builds the store, regions of `max` bytes and one stored object to read.
    pub async fn new(mode: StoreMode, max: u64, streams: usize) -> Result<StoreBench> {
        let client = engine(streams).await?;
        let cfg = StoreConfig { capacity: 4 * max + (16 << 20), ..StoreConfig::default() };
        let (store, remote, keep): (Arc<dyn Store>, _, Vec<Box<dyn std::any::Any + Send + Sync>>) =
            match mode {
                StoreMode::Embedded => {
                    (EmbeddedStore::new(&client, cfg).await?, None, vec![Box::new(client.clone())])
                }
                StoreMode::Remote => {
                    let node_engine = engine(streams).await?;
                    let backing =
                        EmbeddedStore::new(&node_engine, StoreConfig { shared: true, ..cfg })
                            .await?;
                    let node = StoreNode::serve(backing, "127.0.0.1:0".parse()?).await?;
                    let r = Arc::new(
                        RemoteStore::connect(&client, node_engine.local_addr(), node.addr())
                            .await?,
                    );
                    (r.clone(), Some(r), vec![Box::new(node), Box::new(node_engine)])
                }
            };
        let src = client.alloc(max, Permissions::NONE).await?;
        let dst = client.alloc(max, Permissions::NONE).await?;
        src.write_bytes(0, &vec![7u8; max as usize])?;
        dst.write_bytes(0, &vec![1u8; max as usize])?;
        // The remote baseline moves its bytes into a pool area of its own (a pinned object).
        let scratch = match &remote {
            Some(r) => {
                let p =
                    r.begin_put(b"baseline-scratch", &meta(max), max, Retention::Pinned).await?;
                r.commit_put(p).await?;
                p.offset
            }
            None => 0,
        };
        Ok(StoreBench {
            mode,
            streams: if mode == StoreMode::Remote { streams } else { 1 },
            store,
            remote,
            src,
            dst,
            copy: SharedMemcpy::new(if mode == StoreMode::Embedded { max } else { 0 }),
            next: AtomicU64::new(0),
            scratch,
            _keep: keep,
        })
    }

    /// Line name.
    pub fn name(&self) -> &'static str {
        match self.mode {
            StoreMode::Embedded => "store-embedded",
            StoreMode::Remote => "store-remote",
        }
    }

    /// Streams used.
    pub fn streams(&self) -> usize {
        self.streams
    }

    /// Baseline name.
    pub fn baseline(&self) -> &'static str {
        match self.mode {
            StoreMode::Embedded => "memcpy",
            StoreMode::Remote => "engine-tcp",
        }
    }

    /// One put_from (then remove, so the pool never fills) or one get_into of `size` bytes.
    pub async fn store_op(&self, write: bool, size: u64) -> Result<()> {
        if write {
            let key = format!("put-{}", self.next.fetch_add(1, Ordering::Relaxed));
            self.store
                .put_from(key.as_bytes(), &meta(size), &self.src.slice(0, size)?, Retention::Normal)
                .await?;
            self.store.remove(key.as_bytes()).await.map(drop).map_err(Into::into)
        } else {
            // One stored object per size, put on first use.
            let key = format!("read-{size}");
            if !self.store.exists(key.as_bytes()).await? {
                self.store
                    .put_from(
                        key.as_bytes(),
                        &meta(size),
                        &self.src.slice(0, size)?,
                        Retention::Pinned,
                    )
                    .await?;
            }
            self.store.get_into(key.as_bytes(), &self.dst, 0).await.map(drop).map_err(Into::into)
        }
    }

    /// The raw medium moving the same bytes.
    pub async fn baseline_op(&self, write: bool, size: u64) -> Result<()> {
        match &self.remote {
            Some(r) => {
                let pool = r.pool();
                let op = if write {
                    TransferOp::write(&self.src, 0, pool, self.scratch, size)
                } else {
                    TransferOp::read(&self.dst, 0, pool, self.scratch, size)
                };
                r.session().transfer(op).await.map(drop).map_err(Into::into)
            }
            None => {
                self.copy.copy(size);
                Ok(())
            }
        }
    }
}
