//! The store suite, written once and run against any [`Store`] through the trait object (the
//! embedded store and a remote store node run it here; another implementation runs it the same
//! way). A [`StoreFactory`] builds a store of a given configuration plus a client engine to
//! allocate the caller's regions from, and says how the store differs where a test needs it
//! (where its spill tier keeps a key, how a client dies mid-put). Expand with
//! `tensorwire_store::store_tests!(factory)`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tensorwire_conformance::{bounded, pattern};
use tensorwire_core::{DType, Engine, Error, Permissions, Region, TensorMeta};

use crate::{Retention, Store, StoreConfig, StoreError};

#[doc(hidden)]
pub mod __private {
    pub use tokio;
}

/// A store under test.
pub struct StoreUnderTest {
    /// The store, through the trait.
    pub store: Arc<dyn Store>,
    /// Engine for the caller's regions.
    pub client: Engine,
    /// Anything that must live as long as the test (engines, the node, the backing store).
    pub keep: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

/// Builds stores for the suite.
#[async_trait]
pub trait StoreFactory: Send + Sync {
    /// A fresh store with `cfg`.
    async fn make(&self, cfg: StoreConfig) -> StoreUnderTest;
    /// Starts a put of `len` bytes under `key` and then vanishes without committing (a client
    /// killed mid-put).
    async fn abandon_put(&self, t: &StoreUnderTest, key: &[u8], len: u64);
    /// The file that holds `key` while it is in the spill tier only (the suite corrupts it), or
    /// `None` when it is not there.
    fn spill_file(&self, t: &StoreUnderTest, key: &[u8]) -> Option<PathBuf>;
}

fn meta(len: u64) -> TensorMeta {
    TensorMeta::contiguous(DType::U8, &[len])
}

fn cfg(capacity: u64) -> StoreConfig {
    StoreConfig { capacity, ..StoreConfig::default() }
}

/// `put_from` of `len` bytes of `src` at `offset`, under `key`, with [`meta`].
async fn put_region(
    store: &dyn Store,
    key: &str,
    src: &Region,
    offset: u64,
    len: u64,
) -> crate::Result<()> {
    store.put_from(key.as_bytes(), &meta(len), &src.slice(offset, len)?, Retention::Normal).await
}

/// put / get and put_from / get_into move exact bytes, at offsets, for several sizes.
pub async fn exact_bytes(f: &dyn StoreFactory) {
    let t = f.make(cfg(64 << 20)).await;
    for (i, len) in [1u64, 4095, 4096, 1 << 20, (3 << 20) + 17].into_iter().enumerate() {
        let data = pattern(len as usize, i as u8);
        let key = format!("copy-{len}");
        bounded("put", t.store.put(key.as_bytes(), &meta(len), &data, Retention::Normal))
            .await
            .unwrap();
        let (m, got) = bounded("get", t.store.get(key.as_bytes())).await.unwrap();
        assert_eq!(m, meta(len));
        assert!(got == data, "put/get of {len} bytes differs");

        let src = t.client.alloc(len + 100, Permissions::NONE).await.unwrap();
        src.write_bytes(100, &data).unwrap();
        let key = format!("region-{len}");
        let put = put_region(&*t.store, &key, &src, 100, len);
        bounded("put_from", put).await.unwrap();
        let dst = t.client.alloc(len + 50, Permissions::NONE).await.unwrap();
        let (m, n) = bounded("get_into", t.store.get_into(key.as_bytes(), &dst, 50)).await.unwrap();
        assert_eq!((m, n), (meta(len), len));
        assert!(dst.to_vec(50, len).unwrap() == data, "put_from/get_into of {len} bytes differs");
        assert!(
            dst.to_vec(0, 50).unwrap().iter().all(|&b| b == 0),
            "bytes before the offset touched"
        );
    }
}

/// exists, remove, and what a removed key looks like.
pub async fn exists_and_remove(f: &dyn StoreFactory) {
    let t = f.make(cfg(8 << 20)).await;
    let s = &t.store;
    assert!(!s.exists(b"k").await.unwrap());
    s.put(b"k", &meta(10), &[1; 10], Retention::Normal).await.unwrap();
    assert!(s.exists(b"k").await.unwrap());
    assert!(s.remove(b"k").await.unwrap());
    assert!(!s.remove(b"k").await.unwrap());
    assert!(matches!(s.get(b"k").await, Err(StoreError::NotFound { key }) if key.0 == b"k"));
    assert_eq!(s.stats().await.unwrap().used, 0, "removed objects free their blocks");
    let batch = s.exists_batch(&[b"a", b"k"]).await;
    assert!(batch.iter().all(|r| matches!(r, Ok(false))));
    assert!(matches!(s.meta(b"k").await, Err(StoreError::NotFound { key }) if key.0 == b"k"));
}

/// `meta` says what an object is without moving its bytes, and leaves no read open.
pub async fn meta_without_bytes(f: &dyn StoreFactory) {
    let t = f.make(cfg(8 << 20)).await;
    let s = &t.store;
    let m = TensorMeta::contiguous(DType::F32, &[3, 5]);
    s.put(b"m", &m, &[7; 60], Retention::Normal).await.unwrap();
    for _ in 0..3 {
        assert_eq!(bounded("meta", s.meta(b"m")).await.unwrap(), m);
    }
    assert!(s.remove(b"m").await.unwrap(), "a meta query holds nothing that blocks a remove");
    assert_eq!(s.stats().await.unwrap().used, 0);
    assert!(matches!(s.meta(b"").await, Err(StoreError::InvalidArgument(_))));
}

/// Each bad input gets its own error, and leaves nothing behind.
pub async fn bad_inputs(f: &dyn StoreFactory) {
    let t = f.make(cfg(4 << 20)).await;
    let s = &t.store;
    assert!(matches!(s.get(b"nope").await, Err(StoreError::NotFound { .. })));
    let dst = t.client.alloc(4096, Permissions::NONE).await.unwrap();
    assert!(matches!(s.get_into(b"nope", &dst, 0).await, Err(StoreError::NotFound { .. })));
    let big = 8u64 << 20;
    let src = t.client.alloc(big, Permissions::NONE).await.unwrap();
    let all = src.slice(0, big).unwrap();
    let e = s.put_from(b"big", &meta(big), &all, Retention::Normal).await.unwrap_err();
    assert!(matches!(e, StoreError::Capacity { .. }), "oversized object: {e}");
    let e = s.put(b"m", &meta(100), &[0; 10], Retention::Normal).await.unwrap_err();
    assert!(matches!(e, StoreError::InvalidTensor(_)), "metadata larger than the bytes: {e}");
    let e = s.put(b"", &meta(1), &[0], Retention::Normal).await.unwrap_err();
    assert!(matches!(e, StoreError::InvalidArgument(_)), "empty key: {e}");
    let long = vec![b'x'; crate::MAX_KEY + 1];
    let e = s.put(&long, &meta(1), &[0], Retention::Normal).await.unwrap_err();
    assert!(matches!(e, StoreError::InvalidArgument(_)), "long key: {e}");
    s.put(b"dup", &meta(8), &[1; 8], Retention::Normal).await.unwrap();
    let e = s.put(b"dup", &meta(8), &[2; 8], Retention::Normal).await.unwrap_err();
    assert!(matches!(e, StoreError::Exists { .. }), "duplicate key: {e}");
    s.put(b"wide", &meta(8192), &[3; 8192], Retention::Normal).await.unwrap();
    let e = s.get_into(b"wide", &dst, 0).await.unwrap_err();
    assert!(
        matches!(e, StoreError::Engine(Error::OutOfBounds { .. })),
        "destination too small: {e}"
    );
    let e = s.unpin(b"dup").await.unwrap_err();
    assert!(matches!(e, StoreError::InvalidArgument(_)), "unpin of an unpinned key: {e}");
    let st = s.stats().await.unwrap();
    assert_eq!(st.objects, 2, "only the two good puts are stored");
}

/// Above the high watermark the least recently used objects go; a read refreshes an object.
pub async fn lru_eviction(f: &dyn StoreFactory) {
    let c = StoreConfig { high_watermark: 0.75, low_watermark: 0.5, ..cfg(4 << 20) };
    let t = f.make(c).await;
    let s = &t.store;
    let mb = 1u64 << 20;
    for k in ["a", "b", "c"] {
        s.put(k.as_bytes(), &meta(mb), &pattern(mb as usize, 1), Retention::Normal).await.unwrap();
    }
    s.get(b"a").await.unwrap(); // a is now more recent than b and c
    s.put(b"d", &meta(mb), &pattern(mb as usize, 2), Retention::Normal).await.unwrap();
    // 4 MiB used > 3 MiB high mark: evict LRU (b, then c) down to 2 MiB.
    let alive: Vec<bool> = futures_lite(s.exists_batch(&[b"a", b"b", b"c", b"d"]).await);
    assert_eq!(alive, [true, false, false, true]);
    let st = s.stats().await.unwrap();
    assert!(st.evictions >= 2 && st.used <= 2 * mb, "{st:?}");
}

fn futures_lite(v: Vec<crate::Result<bool>>) -> Vec<bool> {
    v.into_iter().map(|r| r.unwrap()).collect()
}

/// Pinned objects (by count or by retention) are never evicted; Soft ones go after Normal ones;
/// with nothing evictable a put fails with Capacity.
pub async fn pinning_and_retention(f: &dyn StoreFactory) {
    let c = StoreConfig { high_watermark: 1.0, low_watermark: 1.0, ..cfg(4 << 20) };
    let t = f.make(c).await;
    let s = &t.store;
    let mb = 1u64 << 20;
    let one = pattern(mb as usize, 3);
    s.put(b"pinned", &meta(mb), &one, Retention::Pinned).await.unwrap();
    s.put(b"counted", &meta(mb), &one, Retention::Normal).await.unwrap();
    s.pin(b"counted").await.unwrap();
    s.pin(b"counted").await.unwrap();
    s.put(b"soft", &meta(mb), &one, Retention::Soft).await.unwrap();
    s.put(b"normal", &meta(mb), &one, Retention::Normal).await.unwrap();
    s.put(b"new1", &meta(mb), &one, Retention::Normal).await.unwrap();
    assert!(!s.exists(b"normal").await.unwrap(), "normal goes first");
    assert!(s.exists(b"soft").await.unwrap());
    s.put(b"new2", &meta(mb), &one, Retention::Normal).await.unwrap();
    assert!(!s.exists(b"new1").await.unwrap(), "normal objects before soft ones");
    assert!(s.exists(b"soft").await.unwrap());
    s.unpin(b"counted").await.unwrap();
    s.put(b"new3", &meta(mb), &one, Retention::Normal).await.unwrap();
    assert!(s.exists(b"counted").await.unwrap(), "still pinned once");
    s.pin(b"new3").await.unwrap();
    s.put(b"new4", &meta(mb), &one, Retention::Normal).await.unwrap();
    assert!(!s.exists(b"soft").await.unwrap(), "soft goes when no normal object is evictable");
    s.pin(b"new4").await.unwrap();
    let e = s.put(b"new5", &meta(mb), &one, Retention::Normal).await.unwrap_err();
    assert!(matches!(e, StoreError::Capacity { .. }), "everything pinned: {e}");
    for k in [&b"pinned"[..], b"counted", b"new3", b"new4"] {
        assert!(s.get(k).await.unwrap().1 == one, "{:?} intact", String::from_utf8_lossy(k));
    }
}

/// Many tasks put and get at once; every byte matches.
pub async fn concurrent_readers_and_writers(f: &dyn StoreFactory) {
    let t = f.make(cfg(64 << 20)).await;
    let mut tasks = Vec::new();
    for w in 0..8u8 {
        let store = t.store.clone();
        let client = t.client.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..8u64 {
                let len = 4096 * (i + 1) + u64::from(w);
                let data = pattern(len as usize, w ^ i as u8);
                let key = format!("w{w}-{i}");
                let src = client.alloc(len, Permissions::NONE).await.unwrap();
                src.write_bytes(0, &data).unwrap();
                put_region(&*store, &key, &src, 0, len).await.unwrap();
                for _ in 0..2 {
                    let dst = client.alloc(len, Permissions::NONE).await.unwrap();
                    store.get_into(key.as_bytes(), &dst, 0).await.unwrap();
                    assert!(dst.to_vec(0, len).unwrap() == data, "{key} differs");
                }
            }
        }));
    }
    for task in tasks {
        bounded("worker", task).await.unwrap();
    }
    assert_eq!(t.store.stats().await.unwrap().objects, 64);
}

/// With a spill directory, evicted objects go to files and come back exactly; a corrupt or
/// truncated file is reported, never served.
pub async fn spill_and_reload(f: &dyn StoreFactory) {
    let dir =
        std::env::temp_dir().join(format!("tw-spill-{}-{}", std::process::id(), rand_suffix()));
    let c = StoreConfig {
        high_watermark: 0.75,
        low_watermark: 0.5,
        spill_dir: Some(dir.clone()),
        ..cfg(4 << 20)
    };
    let t = f.make(c).await;
    let s = &t.store;
    let mb = 1u64 << 20;
    let datas: Vec<Vec<u8>> = (0..6).map(|i| pattern(mb as usize + i * 7, i as u8)).collect();
    for (i, d) in datas.iter().enumerate() {
        s.put(format!("o{i}").as_bytes(), &meta(d.len() as u64), d, Retention::Normal)
            .await
            .unwrap();
    }
    let st = s.stats().await.unwrap();
    assert!(st.spilled_objects >= 2, "{st:?}");
    for (i, d) in datas.iter().enumerate() {
        let key = format!("o{i}");
        assert!(s.exists(key.as_bytes()).await.unwrap(), "{key} survives in some tier");
        let dst = t.client.alloc(d.len() as u64, Permissions::NONE).await.unwrap();
        s.get_into(key.as_bytes(), &dst, 0).await.unwrap();
        assert!(dst.to_vec(0, d.len() as u64).unwrap() == *d, "{key} reloaded exactly");
    }
    // Corrupt one spilled object and truncate another.
    let spilled: Vec<(usize, std::path::PathBuf)> = (0..6)
        .filter_map(|i| f.spill_file(&t, format!("o{i}").as_bytes()).map(|p| (i, p)))
        .collect();
    assert!(spilled.len() >= 2, "objects in the spill tier now: {spilled:?}");
    let (ci, cpath) = &spilled[0];
    let mut bytes = std::fs::read(cpath).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xff;
    std::fs::write(cpath, &bytes).unwrap();
    let e = s.get(format!("o{ci}").as_bytes()).await.unwrap_err();
    assert!(matches!(e, StoreError::Corrupt(ref m) if m.contains("checksum")), "corrupt: {e}");
    let (ti, tpath) = &spilled[1];
    let f2 = std::fs::OpenOptions::new().write(true).open(tpath).unwrap();
    f2.set_len(5000).unwrap();
    let e = s.get(format!("o{ti}").as_bytes()).await.unwrap_err();
    assert!(matches!(e, StoreError::Corrupt(ref m) if m.contains("truncated")), "truncated: {e}");
    for i in 0..6 {
        s.remove(format!("o{i}").as_bytes()).await.unwrap();
    }
    drop(t);
    let left = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "spill files left behind");
    let _ = std::fs::remove_dir(&dir);
}

fn rand_suffix() -> u64 {
    Instant::now().elapsed().as_nanos() as u64 ^ (std::ptr::addr_of!(STEP) as u64)
}
static STEP: u8 = 0;

/// A client that starts a put and vanishes leaks nothing: the space comes back within the
/// store's put TTL.
pub async fn abandoned_put_is_reclaimed(f: &dyn StoreFactory) {
    let c = StoreConfig { put_ttl: Duration::from_millis(300), ..cfg(8 << 20) };
    let t = f.make(c).await;
    f.abandon_put(&t, b"ghost", 2 << 20).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = t.store.stats().await.unwrap();
        if st.used == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "abandoned put still holds {} bytes", st.used);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!t.store.exists(b"ghost").await.unwrap());
    // The key is free again.
    t.store.put(b"ghost", &meta(16), &[7; 16], Retention::Normal).await.unwrap();
}

/// Leases: an object with a consumer count goes with its last consumer (one that reported
/// before the count was set counts too); one with a TTL goes when it passes; neither is evicted
/// before.
pub async fn leases(f: &dyn StoreFactory) {
    let t = f.make(cfg(8 << 20)).await;
    let s = &t.store;
    s.put(b"emb", &meta(100), &[5; 100], Retention::Pinned).await.unwrap();
    // A consumer faster than the producer's set_lease: kept, and counted when the count comes.
    assert!(!s.consumed(b"emb").await.unwrap(), "an early consumer is kept");
    assert!(s.exists(b"emb").await.unwrap());
    s.set_lease(b"emb", 3, None).await.unwrap();
    assert!(!s.consumed(b"emb").await.unwrap());
    assert!(s.exists(b"emb").await.unwrap());
    assert!(s.consumed(b"emb").await.unwrap(), "the last consumer removes it");
    assert!(!s.exists(b"emb").await.unwrap());
    assert!(matches!(s.consumed(b"emb").await, Err(StoreError::NotFound { .. })));
    // One and two consumers, counted after the put: gone at the last, not before.
    for n in 1..=2u32 {
        s.put(b"latent", &meta(100), &[7; 100], Retention::Pinned).await.unwrap();
        s.set_lease(b"latent", n, None).await.unwrap();
        for i in 1..n {
            assert!(!s.consumed(b"latent").await.unwrap(), "n={n}: report {i} removed it");
            assert!(s.exists(b"latent").await.unwrap(), "n={n}: gone after {i} of {n}");
        }
        assert!(s.consumed(b"latent").await.unwrap(), "n={n}: the last report removes it");
        assert!(!s.exists(b"latent").await.unwrap());
    }
    s.put(b"ttl", &meta(100), &[6; 100], Retention::Pinned).await.unwrap();
    s.set_lease(b"ttl", 0, Some(Duration::from_millis(200))).await.unwrap();
    assert!(s.exists(b"ttl").await.unwrap());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!s.exists(b"ttl").await.unwrap(), "expired lease removed");
    assert_eq!(s.stats().await.unwrap().used, 0);
}

/// Batch forms answer per item.
pub async fn batches(f: &dyn StoreFactory) {
    let t = f.make(cfg(16 << 20)).await;
    let len = 10_000u64;
    let src = t.client.alloc(4 * len, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &pattern(4 * len as usize, 9)).unwrap();
    let m = meta(len);
    let keys: Vec<Vec<u8>> = (0..4).map(|i| format!("b{i}").into_bytes()).collect();
    let slices: Vec<_> = (0..4).map(|i| src.slice(i * len, len).unwrap()).collect();
    let puts: Vec<crate::PutFrom<'_>> = keys
        .iter()
        .zip(&slices)
        .map(|(k, s)| crate::PutFrom { key: k, meta: &m, src: s, retention: Retention::Normal })
        .collect();
    assert!(t.store.put_from_batch(&puts).await.iter().all(Result::is_ok));
    let dst = t.client.alloc(4 * len, Permissions::NONE).await.unwrap();
    let missing_key = b"nope".to_vec();
    let mut gets: Vec<crate::GetInto<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| crate::GetInto { key: k, dst: &dst, offset: i as u64 * len })
        .collect();
    gets.push(crate::GetInto { key: &missing_key, dst: &dst, offset: 0 });
    let r = t.store.get_into_batch(&gets).await;
    assert!(r[..4].iter().all(Result::is_ok) && matches!(r[4], Err(StoreError::NotFound { .. })));
    assert!(dst.to_vec(0, 4 * len).unwrap() == src.to_vec(0, 4 * len).unwrap());
    let ks: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    assert!(t.store.remove_batch(&ks).await.iter().all(|r| matches!(r, Ok(true))));
}

/// Invokes `$m!` for each store test.
#[doc(hidden)]
#[macro_export]
macro_rules! __each_store_test {
    ($f:expr) => {
        $crate::__one_store_test!($f, exact_bytes);
        $crate::__one_store_test!($f, exists_and_remove);
        $crate::__one_store_test!($f, meta_without_bytes);
        $crate::__one_store_test!($f, bad_inputs);
        $crate::__one_store_test!($f, lru_eviction);
        $crate::__one_store_test!($f, pinning_and_retention);
        $crate::__one_store_test!($f, concurrent_readers_and_writers);
        $crate::__one_store_test!($f, spill_and_reload);
        $crate::__one_store_test!($f, abandoned_put_is_reclaimed);
        $crate::__one_store_test!($f, batches);
        $crate::__one_store_test!($f, leases);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __one_store_test {
    ($f:expr, $name:ident) => {
        #[$crate::testing::__private::tokio::test(
            flavor = "multi_thread",
            worker_threads = 2,
            crate = "tensorwire_store::testing::__private::tokio"
        )]
        async fn $name() {
            $crate::testing::$name(&$f).await
        }
    };
}

/// One `#[tokio::test]` per store test, run against `$factory`.
#[macro_export]
macro_rules! store_tests {
    ($factory:expr) => {
        $crate::__each_store_test!($factory);
    };
}
