//! The `Store` API every store implements, embedded or remote: callers do not care which.

use std::fmt::Debug;

use async_trait::async_trait;
use tensorwire_core::{MemSlice, MemoryKind, Region, TensorMeta};

pub use crate::error::MAX_KEY;
use crate::error::{Result, StoreError};

/// How an object may be evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Retention {
    /// Evicted in LRU order above the high watermark.
    #[default]
    Normal,
    /// Evicted only after every `Normal` object.
    Soft,
    /// Never evicted (removed only explicitly).
    Pinned,
}

impl Retention {
    pub(crate) fn tag(self) -> u8 {
        match self {
            Retention::Normal => 0,
            Retention::Soft => 1,
            Retention::Pinned => 2,
        }
    }
    pub(crate) fn from_tag(t: u8) -> tensorwire_core::Result<Retention> {
        Ok(match t {
            0 => Retention::Normal,
            1 => Retention::Soft,
            2 => Retention::Pinned,
            _ => return Err(tensorwire_core::Error::protocol(format!("unknown retention {t}"))),
        })
    }
}

/// Store counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Pool bytes.
    pub capacity: u64,
    /// Bytes in allocated blocks (objects and pending puts).
    pub used: u64,
    /// Objects in the pool.
    pub objects: u64,
    /// Objects in the spill tier.
    pub spilled_objects: u64,
    /// Objects evicted from the pool (dropped or spilled) since start.
    pub evictions: u64,
    /// Largest block a put could get right now without evicting.
    pub largest_free: u64,
}

/// `put` for a store whose puts read registered memory: stages `bytes` in a region of `engine`,
/// then `put_from` from there (the remote and cluster stores).
pub(crate) async fn put_staged<S: Store + ?Sized>(
    store: &S,
    engine: &tensorwire_core::Engine,
    (key, meta, bytes): (&[u8], &TensorMeta, &[u8]),
    r: Retention,
) -> Result<()> {
    let len = bytes.len() as u64;
    let staging = engine.alloc(len.max(1), tensorwire_core::Permissions::NONE).await?;
    staging.write_bytes(0, bytes)?;
    store.put_from(key, meta, &staging.slice(0, len)?, r).await
}

/// One stored object as a listing shows it: what a copy of it must carry (its bytes aside) to
/// be the same object elsewhere. [`crate::EmbeddedStore::list`] and [`crate::RemoteStore::list`]
/// page through a store in key order; a cluster's repair reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The key.
    pub key: Vec<u8>,
    /// Its length in bytes.
    pub len: u64,
    /// How it may be evicted.
    pub retention: Retention,
    /// Pins held on it.
    pub pins: u32,
    /// Consumers still expected (0: no consumer count).
    pub consumers: u32,
    /// Consumer reports kept until a count is set.
    pub early: u32,
    /// Time left before its lease removes it, if it has one.
    pub ttl_left: Option<std::time::Duration>,
}

/// An object store of tensors in registered memory.
#[async_trait]
pub trait Store: Send + Sync + Debug {
    /// Stores a copy of `bytes` under `key`; `meta` must fit in `bytes.len()`.
    async fn put(&self, key: &[u8], meta: &TensorMeta, bytes: &[u8], r: Retention) -> Result<()>;
    /// Stores the bytes of a slice of registered memory (no intermediate buffer).
    async fn put_from(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        src: &MemSlice,
        r: Retention,
    ) -> Result<()>;
    /// The object's metadata and a copy of its bytes.
    async fn get(&self, key: &[u8]) -> Result<(TensorMeta, Vec<u8>)>;
    /// Copies the object into a registered region at `offset` (no intermediate buffer); returns
    /// its metadata and length.
    async fn get_into(&self, key: &[u8], dst: &Region, offset: u64) -> Result<(TensorMeta, u64)>;
    /// Whether `key` is stored (in the pool or the spill tier).
    async fn exists(&self, key: &[u8]) -> Result<bool>;
    /// The object's metadata (so its length, [`TensorMeta::nbytes`]) without moving its bytes
    /// to the caller.
    async fn meta(&self, key: &[u8]) -> Result<TensorMeta>;
    /// Removes `key`; false if it was not there.
    async fn remove(&self, key: &[u8]) -> Result<bool>;
    /// Adds a pin: a pinned object is never evicted. Pins count.
    async fn pin(&self, key: &[u8]) -> Result<()>;
    /// Drops one pin.
    async fn unpin(&self, key: &[u8]) -> Result<()>;
    /// Counters.
    async fn stats(&self) -> Result<StoreStats>;
    /// Sets `key`'s lease: `consumers` > 0 makes the object go when that many [`Store::consumed`]
    /// calls arrived; `ttl` removes it that long from now. Neither evicts it earlier (store
    /// leased objects with `Retention::Pinned`).
    async fn set_lease(
        &self,
        key: &[u8],
        consumers: u32,
        ttl: Option<std::time::Duration>,
    ) -> Result<()>;
    /// One consumer of `key` is done; true when it was the last and the object is gone. A report
    /// that arrives before the object has a consumer count (a consumer faster than the
    /// producer's [`Store::set_lease`] right after its put) is kept and counted against the
    /// count when it is set.
    async fn consumed(&self, key: &[u8]) -> Result<bool>;

    /// `put_from` for many objects, concurrently; one result per item, in order.
    async fn put_from_batch(&self, items: &[PutFrom<'_>]) -> Vec<Result<()>> {
        let futs = items.iter().map(|p| self.put_from(p.key, p.meta, p.src, p.retention));
        futures::future::join_all(futs).await
    }
    /// `get_into` for many objects, concurrently; one result per item, in order.
    async fn get_into_batch(&self, items: &[GetInto<'_>]) -> Vec<Result<(TensorMeta, u64)>> {
        let futs = items.iter().map(|g| self.get_into(g.key, g.dst, g.offset));
        futures::future::join_all(futs).await
    }
    /// `exists` for many keys.
    async fn exists_batch(&self, keys: &[&[u8]]) -> Vec<Result<bool>> {
        futures::future::join_all(keys.iter().map(|k| self.exists(k))).await
    }
    /// `remove` for many keys.
    async fn remove_batch(&self, keys: &[&[u8]]) -> Vec<Result<bool>> {
        futures::future::join_all(keys.iter().map(|k| self.remove(k))).await
    }
}

/// One item of [`Store::put_from_batch`].
#[derive(Debug)]
pub struct PutFrom<'a> {
    /// Key.
    pub key: &'a [u8],
    /// Metadata.
    pub meta: &'a TensorMeta,
    /// The bytes.
    pub src: &'a MemSlice,
    /// Retention.
    pub retention: Retention,
}

/// One item of [`Store::get_into_batch`].
#[derive(Debug)]
pub struct GetInto<'a> {
    /// Key.
    pub key: &'a [u8],
    /// Destination region.
    pub dst: &'a Region,
    /// Offset in it.
    pub offset: u64,
}

/// Checks a key's length.
pub fn check_key(key: &[u8]) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY {
        return Err(StoreError::InvalidArgument(format!(
            "store key is {} bytes; keys are 1..={MAX_KEY} bytes",
            key.len()
        )));
    }
    Ok(())
}

/// Checks that `meta` describes a host tensor lying inside `len` bytes.
pub fn check_meta(meta: &TensorMeta, len: u64) -> Result<()> {
    meta.validate_for(len, MemoryKind::Host).map_err(|e| {
        StoreError::InvalidTensor(format!("metadata does not fit the object's {len} bytes: {e}"))
    })
}
