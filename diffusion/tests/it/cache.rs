//! The store-backed cache: a miss, a write, then hits for everyone sharing the store; entries
//! go after their TTL; hot entries are pinned and outlive pressure that evicts ordinary ones;
//! the CFG cache's byte budget drops this process's oldest entries; a lookup that fails is a
//! miss, never an error.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::{DType, Engine, Permissions, TensorMeta, backend::MemBackend};
use tensorwire_diffusion::cache::{StoreCache, embedding_key};
use tensorwire_store::{EmbeddedStore, Retention, Store, StoreConfig};

async fn store(capacity: u64) -> (Engine, Arc<EmbeddedStore>) {
    let e = Engine::builder().backend(MemBackend::new()).start().await.unwrap();
    let cfg = StoreConfig { capacity, ..StoreConfig::default() };
    let s = EmbeddedStore::new(&e, cfg).await.unwrap();
    (e, s)
}

fn meta(n: u64) -> TensorMeta {
    TensorMeta::contiguous(DType::U8, &[n])
}

#[tokio::test]
async fn a_miss_a_write_then_hits_for_every_process_sharing_the_store() {
    let (e, s) = store(8 << 20).await;
    let a = StoreCache::embeddings(s.clone(), Duration::from_secs(60));
    let b = StoreCache::embeddings(s.clone(), Duration::from_secs(60));
    let key = embedding_key("umt5-xxl", "1", "a cat", false, &[]);
    let n = 64 << 10;
    let src = e.alloc(n, Permissions::NONE).await.unwrap();
    src.write_bytes(0, &vec![7u8; n as usize]).unwrap();
    let dst = e.alloc(n, Permissions::NONE).await.unwrap();
    assert!(a.get_into(&key, &dst, 0).await.is_none(), "empty: a miss");
    assert!(a.put_from(&key, &meta(n), &src.slice(0, n).unwrap()).await);
    assert!(!b.put_from(&key, &meta(n), &src.slice(0, n).unwrap()).await, "written once");
    assert_eq!(b.get_into(&key, &dst, 0).await, Some(meta(n)), "the other process hits");
    assert_eq!(dst.to_vec(0, n).unwrap(), vec![7u8; n as usize]);
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!((sa.misses, sa.hits, sa.written), (1, 0, 1));
    assert_eq!((sb.hits, sb.hit_bytes, sb.written, sb.errors), (1, n, 0, 0));
    // A destination too small is a failed lookup: a miss, counted as an error, not a panic.
    let small = e.alloc(16, Permissions::NONE).await.unwrap();
    assert!(b.get_into(&key, &small, 0).await.is_none());
    assert_eq!(b.stats().errors, 1);
}

#[tokio::test]
async fn entries_expire_and_hot_ones_are_pinned_through_pressure() {
    let (_e, s) = store(4 << 20).await;
    let c = StoreCache::embeddings(s.clone(), Duration::from_millis(150));
    let cold = embedding_key("t5", "1", "cold", false, &[]);
    let hot = embedding_key("t5", "1", "blurry, low quality", true, &[]);
    c.mark_hot(hot);
    let v = vec![1u8; 512 << 10];
    let put = |k| {
        let (c, v) = (&c, &v);
        async move {
            let e = Engine::builder().backend(MemBackend::new()).start().await.unwrap();
            let r = e.alloc(v.len() as u64, Permissions::NONE).await.unwrap();
            r.write_bytes(0, v).unwrap();
            c.put_from(&k, &meta(v.len() as u64), &r.slice(0, v.len() as u64).unwrap()).await
        }
    };
    assert!(put(cold).await);
    assert!(put(hot).await);
    assert!(c.get(&cold).await.is_some());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(c.get(&cold).await.is_none(), "expired after its TTL");
    assert!(c.get(&hot).await.is_some(), "hot: no TTL");
    // Pressure: ordinary objects fill the pool; the hot entry (pinned) stays.
    for i in 0..12 {
        let _ = s.put(format!("o{i}").as_bytes(), &meta(512 << 10), &v, Retention::Normal).await;
    }
    assert!(c.get(&hot).await.is_some(), "pinned through eviction");
}

#[tokio::test]
async fn the_cfg_budget_drops_the_oldest_entries_this_process_wrote() {
    let (e, s) = store(8 << 20).await;
    let n = 256 << 10;
    let c = StoreCache::cfg(s.clone(), Duration::from_secs(60), 3 * n);
    let src = e.alloc(n, Permissions::NONE).await.unwrap();
    let neg = embedding_key("t5", "1", "neg", true, &[]);
    let keys: Vec<_> = (0..5u32)
        .map(|step| {
            let shape = tensorwire_diffusion::cache::Shape { width: 64, height: 64, frames: 1 };
            let sampler = tensorwire_diffusion::cache::Sampler { name: "euler", state: &[] };
            tensorwire_diffusion::cache::cfg_key("m", &neg, step, shape, sampler)
        })
        .collect();
    for k in &keys {
        assert!(c.put_from(k, &meta(n), &src.slice(0, n).unwrap()).await);
    }
    assert_eq!(c.stats().dropped, 2);
    assert!(c.get(&keys[0]).await.is_none() && c.get(&keys[1]).await.is_none(), "oldest gone");
    for k in &keys[2..] {
        assert!(c.get(k).await.is_some());
    }
}
