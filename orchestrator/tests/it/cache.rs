//! An embedding-cache hit skips the encoder, end to end through the service: the first request
//! with a prompt runs encode, which writes the embedding to the cache and reports a reference to
//! it; the second with the same prompt is submitted straight to denoise with that reference
//! (`SubmitClient::submit_from`), and denoise reads the cached bytes through the connector. The
//! entry outlives both requests (releasing a request does not touch it).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tensorwire_core::{DType, Engine, Permissions, TensorMeta, backend::MemBackend};
use tensorwire_diffusion::cache::{StoreCache, embedding_key};
use tensorwire_diffusion::{ConnectorConfig, DiffusionConnector, PayloadKind, PayloadRef};
use tensorwire_orchestrator::service::{
    OrchestratorService, ServiceConfig, SubmitClient, WorkerClient,
};
use tensorwire_orchestrator::{Priority, Stage};
use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_store::{EmbeddedStore, Store, StoreConfig};

const N: u64 = 64 << 10;

fn meta() -> TensorMeta {
    TensorMeta::contiguous(DType::U8, &[N])
}

fn encode_ref(r: &PayloadRef) -> Vec<u8> {
    let mut w = Writer::new();
    r.encode(&mut w);
    w.finish()
}

fn decode_ref(b: &[u8]) -> PayloadRef {
    let mut r = Reader::new(b, "test ref");
    PayloadRef::decode(&mut r).unwrap()
}

/// What request `r`'s prompt embeds to (the same prompt for every request here).
fn embedding() -> Vec<u8> {
    (0..N).map(|i| (i * 7 + 1) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedding_cache_hit_skips_the_encoder() {
    let engine = Engine::builder().backend(MemBackend::new()).start().await.unwrap();
    let store =
        EmbeddedStore::new(&engine, StoreConfig { capacity: 8 << 20, ..StoreConfig::default() })
            .await
            .unwrap();
    let store: Arc<dyn Store> = store;
    let cache = Arc::new(StoreCache::embeddings(store.clone(), Duration::from_secs(60)));
    let conn = Arc::new(DiffusionConnector::new(
        engine.clone(),
        Some(store.clone()),
        ConnectorConfig::default(),
    ));
    let svc = OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), ServiceConfig::default())
        .await
        .unwrap();
    let key = embedding_key("umt5-xxl", "1", "a cat at dawn", false, &[]);
    let encoded = Arc::new(AtomicU32::new(0));
    for stage in Stage::ALL {
        let hb = Duration::from_millis(100);
        let (w, mut rx) = WorkerClient::connect(svc.addr(), None, stage, 1, "h", hb).await.unwrap();
        let (cache, conn, engine, encoded) =
            (cache.clone(), conn.clone(), engine.clone(), encoded.clone());
        tokio::spawn(async move {
            while let Some(a) = rx.recv().await {
                if a.release_only {
                    for h in &a.held {
                        conn.release(&decode_ref(h)).await.unwrap();
                    }
                    w.released(&a).await.unwrap();
                    continue;
                }
                let out = match stage {
                    Stage::Encode => {
                        encoded.fetch_add(1, Ordering::Relaxed);
                        let src = engine.alloc(N, Permissions::NONE).await.unwrap();
                        src.write_bytes(0, &embedding()).unwrap();
                        cache.put_from(&key, &meta(), &src.slice(0, N).unwrap()).await;
                        encode_ref(&cache.reference(
                            &key,
                            a.request,
                            PayloadKind::ConditionEmbedding,
                            meta(),
                        ))
                    }
                    Stage::Denoise => {
                        let r = decode_ref(&a.inputs);
                        let dst = Arc::new(engine.alloc(N, Permissions::NONE).await.unwrap());
                        conn.consume_held(&r, dst.clone(), 0, Some(&meta()))
                            .unwrap()
                            .all()
                            .await
                            .unwrap();
                        assert_eq!(dst.to_vec(0, N).unwrap(), embedding(), "request {}", a.request);
                        Vec::new()
                    }
                    Stage::Decode => Vec::new(),
                };
                w.report_with(&a, Ok::<_, String>(out)).await.unwrap();
            }
        });
    }
    let sub = SubmitClient::connect(svc.addr(), None).await.unwrap();
    for request in [1u64, 2] {
        let out = if cache.contains(&key).await {
            let r = cache.reference(&key, request, PayloadKind::ConditionEmbedding, meta());
            sub.submit_from(request, Priority::Interactive, Stage::Denoise, encode_ref(&r)).await
        } else {
            sub.submit(request, Priority::Interactive).await
        };
        let r = tokio::time::timeout(Duration::from_secs(20), out.unwrap()).await.unwrap().unwrap();
        assert!(r.is_ok(), "request {request}: {r:?}");
    }
    assert_eq!(encoded.load(Ordering::Relaxed), 1, "the second request skipped the encoder");
    let st = cache.stats();
    assert_eq!((st.misses, st.hits, st.written), (1, 1, 1));
    tokio::time::sleep(Duration::from_millis(300)).await; // releases land
    assert!(cache.contains(&key).await, "the cache entry outlives the requests");
    assert_eq!(svc.stats().await.unwrap().unreleased, 0);
}
