//! A cache over the store: values (condition embeddings, CFG features, step checkpoints) under
//! their [`CacheKey`]s, shared by every process of the cluster that sees the same store.
//! Best-effort by design: a lookup that fails for any reason is a miss (counted), never an
//! error; an entry someone else wrote first is not written again. Entries are `Soft` (evicted
//! only after every ordinary object) and go after the policy's TTL; hot keys (a negative
//! prompt's embedding, wanted by nearly every request) are pinned and kept. A byte budget bounds
//! what this process keeps written: past it, its oldest entries are removed first.
//!
//! Counters: hits, misses, bytes served and errors, in [`CacheStats`] and through the `metrics`
//! facade (`tensorwire_cache_{hits,misses,hit_bytes,errors}_total`, label `cache`).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tensorwire_core::{MemSlice, Region, TensorMeta};
use tensorwire_store::{Retention, Store, StoreError};

use super::keys::CacheKey;
use crate::payload::{LeasePolicy, PayloadKind};
use crate::reference::{PayloadRef, Source};

/// How long entries last and how many bytes a process keeps written.
#[derive(Debug, Clone, Copy)]
pub struct CachePolicy {
    /// An entry goes this long after it was written (hot entries stay).
    pub ttl: Duration,
    /// Bytes this process may keep written (0: no bound); past it, its oldest entries go.
    pub budget: u64,
}

/// A cache's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups that found the entry.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Bytes the hits served.
    pub hit_bytes: u64,
    /// Lookups or writes that failed (each also a miss or a skipped write).
    pub errors: u64,
    /// Entries this process wrote.
    pub written: u64,
    /// Of those, removed to stay within the budget.
    pub dropped: u64,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    hit_bytes: AtomicU64,
    errors: AtomicU64,
    written: AtomicU64,
    dropped: AtomicU64,
}

/// A cache of one kind over a store.
#[derive(Debug)]
pub struct StoreCache {
    kind: &'static str,
    store: Arc<dyn Store>,
    policy: CachePolicy,
    hot: Mutex<HashSet<CacheKey>>,
    /// What this process wrote and keeps, oldest first, with the bytes in it.
    mine: Mutex<(VecDeque<(CacheKey, u64)>, u64)>,
    n: Counters,
}

impl StoreCache {
    /// A cache of `kind` (a short name in its store keys and metrics, e.g. "emb").
    pub fn new(kind: &'static str, store: Arc<dyn Store>, policy: CachePolicy) -> StoreCache {
        StoreCache {
            kind,
            store,
            policy,
            hot: Mutex::default(),
            mine: Mutex::default(),
            n: Counters::default(),
        }
    }

    /// The condition-embedding cache: entries for `ttl`, no byte bound.
    pub fn embeddings(store: Arc<dyn Store>, ttl: Duration) -> StoreCache {
        StoreCache::new("emb", store, CachePolicy { ttl, budget: 0 })
    }

    /// The CFG-feature cache: short-lived entries within a byte budget.
    pub fn cfg(store: Arc<dyn Store>, ttl: Duration, budget: u64) -> StoreCache {
        StoreCache::new("cfg", store, CachePolicy { ttl, budget })
    }

    /// From now on `key` is hot: written pinned, without a TTL (e.g. a negative prompt).
    pub fn mark_hot(&self, key: CacheKey) {
        self.hot.lock().insert(key);
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        let n = &self.n;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheStats {
            hits: get(&n.hits),
            misses: get(&n.misses),
            hit_bytes: get(&n.hit_bytes),
            errors: get(&n.errors),
            written: get(&n.written),
            dropped: get(&n.dropped),
        }
    }

    fn count(&self, what: &'static str, a: &AtomicU64, by: u64) {
        a.fetch_add(by, Ordering::Relaxed);
        metrics::counter!(what, "cache" => self.kind).increment(by);
    }

    fn miss(&self, e: Option<&StoreError>) {
        if let Some(e) = e {
            tracing::debug!(cache = self.kind, error = %e, "cache lookup failed; a miss");
            self.count("tensorwire_cache_errors_total", &self.n.errors, 1);
        }
        self.count("tensorwire_cache_misses_total", &self.n.misses, 1);
    }

    fn hit(&self, bytes: u64) {
        self.count("tensorwire_cache_hits_total", &self.n.hits, 1);
        self.count("tensorwire_cache_hit_bytes_total", &self.n.hit_bytes, bytes);
    }

    /// Counts a lookup's result: a hit of `bytes(value)` bytes, or a miss (a failure other
    /// than "not found" also counted as an error); the value on a hit.
    fn looked_up<T>(&self, r: Result<T, StoreError>, bytes: impl FnOnce(&T) -> u64) -> Option<T> {
        match r {
            Ok(v) => {
                self.hit(bytes(&v));
                Some(v)
            }
            Err(StoreError::NotFound { .. }) => {
                self.miss(None);
                None
            }
            Err(e) => {
                self.miss(Some(&e));
                None
            }
        }
    }

    /// Whether `key` is cached (counted as a hit or a miss): what a submitter asks before it
    /// queues work, so that a hit skips the stage that would make the value.
    pub async fn contains(&self, key: &CacheKey) -> bool {
        let sk = key.store_key(self.kind);
        let r = self.store.exists(&sk).await;
        let found =
            r.and_then(|there| if there { Ok(()) } else { Err(StoreError::not_found(&sk)) });
        self.looked_up(found, |_| 0).is_some()
    }

    /// A payload reference to `key`'s entry for `request`, which a consumer reads through the
    /// connector like any store-relayed payload (`meta` is the value's, which the caller knows
    /// from its model). Its lease is `SoftPin`: consuming or releasing it leaves the entry.
    pub fn reference(
        &self,
        key: &CacheKey,
        request: u64,
        kind: PayloadKind,
        meta: TensorMeta,
    ) -> PayloadRef {
        PayloadRef {
            request,
            kind,
            source: Source::Store { key: key.store_key(self.kind) },
            meta,
            chunking: None,
            lease: LeasePolicy::SoftPin,
            checksum: None,
        }
    }

    /// Looks `key` up into `dst` at `offset`; its metadata on a hit, `None` on a miss.
    pub async fn get_into(&self, key: &CacheKey, dst: &Region, offset: u64) -> Option<TensorMeta> {
        let r = self.store.get_into(&key.store_key(self.kind), dst, offset).await;
        self.looked_up(r, |(_, len)| *len).map(|(meta, _)| meta)
    }

    /// Looks `key` up, copying the value out.
    pub async fn get(&self, key: &CacheKey) -> Option<(TensorMeta, Vec<u8>)> {
        let r = self.store.get(&key.store_key(self.kind)).await;
        self.looked_up(r, |(_, bytes)| bytes.len() as u64)
    }

    /// Writes `key`'s value from `src`. True if this call wrote it; false if it was there
    /// already (someone wrote it first) or the write failed (counted).
    pub async fn put_from(&self, key: &CacheKey, meta: &TensorMeta, src: &MemSlice) -> bool {
        let hot = self.hot.lock().contains(key);
        let sk = key.store_key(self.kind);
        let r = if hot { Retention::Pinned } else { Retention::Soft };
        match self.store.put_from(&sk, meta, src, r).await {
            Ok(()) => {}
            Err(StoreError::Exists { .. }) => return false,
            Err(e) => {
                tracing::debug!(cache = self.kind, error = %e, "cache write failed; skipped");
                self.count("tensorwire_cache_errors_total", &self.n.errors, 1);
                return false;
            }
        };
        if !hot {
            if let Err(e) = self.store.set_lease(&sk, 0, Some(self.policy.ttl)).await {
                tracing::debug!(cache = self.kind, error = %e, "cache TTL not set");
            }
        }
        self.n.written.fetch_add(1, Ordering::Relaxed);
        self.keep_within_budget(*key, src.len(), hot).await;
        true
    }

    /// Records what this process wrote and removes its oldest entries past the budget.
    async fn keep_within_budget(&self, key: CacheKey, len: u64, hot: bool) {
        if self.policy.budget == 0 || hot {
            return;
        }
        let drop: Vec<CacheKey> = {
            let mut m = self.mine.lock();
            m.0.push_back((key, len));
            m.1 += len;
            let mut out = Vec::new();
            while m.1 > self.policy.budget {
                let Some((k, n)) = m.0.pop_front() else { break };
                m.1 -= n;
                out.push(k);
            }
            out
        };
        for k in drop {
            if self.store.remove(&k.store_key(self.kind)).await.is_ok() {
                self.n.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
