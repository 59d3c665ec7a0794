//! Encode -> denoise -> decode through the connector, in p2p, store and auto modes: a text
//! embedding consumed by two stages, and a [16, 21, 60, 104] bf16 latent handed to decode in 7
//! temporal chunks while they are produced. Every byte is checked; afterwards the store holds no
//! object and no connector holds a buffer.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::{DType, Engine, Permissions, Region, TensorMeta};
use tensorwire_diffusion::{
    Chunking, ConnectorConfig, ConnectorError, ConsumerHint, DiffusionConnector, LeaseEnd,
    LeasePolicy, Mode, PayloadKind, Source, StagePayload,
};
use tensorwire_store::{EmbeddedStore, RemoteStore, Store, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

async fn engine() -> Engine {
    Engine::builder().backend(TcpBackend::new(TcpConfig::default()).unwrap()).start().await.unwrap()
}

fn fill(r: &Region, seed: u8) -> Vec<u8> {
    let data: Vec<u8> = (0..r.len() as usize)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(5) as u8 ^ seed)
        .collect();
    r.write_bytes(0, &data).unwrap();
    data
}

struct Cluster {
    node_store: Arc<EmbeddedStore>,
    _node: StoreNode,
    _node_engine: Engine,
    encode: DiffusionConnector,
    denoise: DiffusionConnector,
    decode: DiffusionConnector,
}

async fn cluster(mode: Mode, wait: Duration) -> Cluster {
    let node_engine = engine().await;
    let node_store =
        EmbeddedStore::new(&node_engine, StoreConfig { shared: true, ..StoreConfig::default() })
            .await
            .unwrap();
    let node = StoreNode::serve(node_store.clone(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut conns = Vec::new();
    for _stage in 0..3 {
        let e = engine().await;
        let store: Arc<dyn Store> = Arc::new(
            RemoteStore::connect(&e, node_engine.local_addr(), node.addr()).await.unwrap(),
        );
        let cfg = ConnectorConfig { mode, checksum: true, wait_timeout: wait };
        conns.push(DiffusionConnector::new(e, Some(store), cfg));
    }
    let decode = conns.pop().unwrap();
    let denoise = conns.pop().unwrap();
    let encode = conns.pop().unwrap();
    Cluster { node_store, _node: node, _node_engine: node_engine, encode, denoise, decode }
}

async fn pipeline(mode: Mode) {
    let c = cluster(mode, Duration::from_secs(10)).await;
    // Condition embedding: [1, 226, 4096] bf16, consumed by two stages.
    let emb_meta = TensorMeta::contiguous(DType::BF16, &[1, 226, 4096]);
    let emb_len = emb_meta.nbytes().unwrap();
    let emb = Arc::new(c.encode.engine().alloc(emb_len, Permissions::READ).await.unwrap());
    let emb_data = fill(&emb, 1);
    let pub_emb = c
        .encode
        .publish(
            StagePayload {
                request: 1,
                kind: PayloadKind::ConditionEmbedding,
                region: emb.clone(),
                offset: 0,
                meta: emb_meta.clone(),
                chunking: None,
                lease: LeasePolicy::DeleteOnConsume { consumers: 2 },
            },
            None, // auto: consumer unknown -> store
        )
        .unwrap();
    drop(emb); // the producer lets go of its buffer at once
    for consumer in [&c.denoise, &c.decode] {
        let dst = Arc::new(consumer.engine().alloc(emb_len, Permissions::NONE).await.unwrap());
        let views = consumer
            .consume(&pub_emb.reference, dst.clone(), 0, Some(&emb_meta))
            .unwrap()
            .all()
            .await
            .unwrap();
        assert_eq!(views.len(), 1);
        assert!(dst.to_vec(0, emb_len).unwrap() == emb_data, "embedding bytes");
    }

    // Latent: chunked along T into 7, produced chunk by chunk while decode consumes.
    let meta = TensorMeta::contiguous(DType::BF16, &[16, 21, 60, 104]);
    let len = meta.nbytes().unwrap();
    let latent = Arc::new(c.denoise.engine().alloc(len, Permissions::READ).await.unwrap());
    let data = fill(&latent, 2);
    let mut publication = c
        .denoise
        .publish(
            StagePayload {
                request: 1,
                kind: PayloadKind::Latent,
                region: latent.clone(),
                offset: 0,
                meta: meta.clone(),
                chunking: Some(Chunking { dim: 1, count: 7 }),
                lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
            },
            Some(ConsumerHint { credit: 1 }), // auto: consumer known with credit -> p2p
        )
        .unwrap();
    drop(latent);
    let reference = publication.reference.clone();
    let dst = Arc::new(c.decode.engine().alloc(len, Permissions::NONE).await.unwrap());
    let mut consumption = c.decode.consume(&reference, dst.clone(), 0, Some(&meta)).unwrap();
    let producer = tokio::spawn(async move {
        for i in [0u32, 2, 1, 3, 4, 6, 5] {
            tokio::time::sleep(Duration::from_millis(5)).await;
            publication.mark_ready(i).unwrap();
        }
        publication
    });
    let mut seen = Vec::new();
    while let Some(v) = consumption.next().await.unwrap() {
        assert_eq!((v.end - v.start), 3, "21 frames in 7 chunks");
        for r in &v.ranges {
            let (at, n) = (r.offset as usize, r.len as usize);
            assert!(dst.to_vec(r.offset, r.len).unwrap() == data[at..at + n], "chunk {}", v.index);
        }
        seen.push(v.index);
    }
    let _publication = producer.await.unwrap();
    seen.sort_unstable();
    assert_eq!(seen, (0..7).collect::<Vec<_>>());
    assert!(dst.to_vec(0, len).unwrap() == data);

    // Nothing is left: the store is empty and no connector holds a buffer.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = c.node_store.stats().await.unwrap();
        let held = c.encode.held() + c.denoise.held() + c.decode.held();
        if st.objects == 0 && st.used == 0 && held == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "left behind: {st:?}, {held} held buffers");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_p2p() {
    pipeline(Mode::P2p).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_store() {
    pipeline(Mode::Store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_auto() {
    pipeline(Mode::Auto).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_distinct_and_bounded() {
    let c = cluster(Mode::P2p, Duration::from_secs(2)).await;
    let meta = TensorMeta::contiguous(DType::BF16, &[4, 1024]);
    let len = meta.nbytes().unwrap();
    let buf = Arc::new(c.denoise.engine().alloc(len, Permissions::READ).await.unwrap());
    fill(&buf, 3);
    let payload = |lease| StagePayload {
        request: 9,
        kind: PayloadKind::Feature,
        region: buf.clone(),
        offset: 0,
        meta: meta.clone(),
        chunking: None,
        lease,
    };
    let dst = Arc::new(c.decode.engine().alloc(len, Permissions::NONE).await.unwrap());

    // Shape mismatch with the destination's expectation.
    let p =
        c.denoise.publish(payload(LeasePolicy::DeleteOnConsume { consumers: 1 }), None).unwrap();
    let wrong = TensorMeta::contiguous(DType::BF16, &[1024, 4]);
    let e = c.decode.consume(&p.reference, dst.clone(), 0, Some(&wrong)).unwrap_err();
    assert!(matches!(e, ConnectorError::Mismatch(_)), "{e}");
    // A payload its producer never published.
    let mut bogus = p.reference.clone();
    if let Source::P2p { payload, .. } = &mut bogus.source {
        *payload += 1000;
    }
    let e = c.decode.consume(&bogus, dst.clone(), 0, None).unwrap().all().await.unwrap_err();
    assert!(matches!(e, ConnectorError::Missing { .. }), "never published: {e}");
    // Consumed once; a second consume learns it is gone.
    c.decode.consume(&p.reference, dst.clone(), 0, None).unwrap().all().await.unwrap();
    let e = c.decode.consume(&p.reference, dst.clone(), 0, None).unwrap().all().await.unwrap_err();
    assert!(
        matches!(e, ConnectorError::LeaseEnded { end: LeaseEnd::Consumed, .. }),
        "consumed payload: {e}"
    );
    // An expired lease.
    let p = c.denoise.publish(payload(LeasePolicy::Ttl(Duration::from_millis(50))), None).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let e = c.decode.consume(&p.reference, dst.clone(), 0, None).unwrap().all().await.unwrap_err();
    assert!(
        matches!(e, ConnectorError::LeaseEnded { end: LeaseEnd::Expired, .. }),
        "expired lease: {e}"
    );
    // An expired lease whose buffer only the publication held: deregistered by now, so a
    // consumer that connects afterwards never sees it, and still learns why.
    let own = Arc::new(c.denoise.engine().alloc(len, Permissions::READ).await.unwrap());
    let lease = LeasePolicy::Ttl(Duration::from_millis(50));
    let gone = c.denoise.publish(StagePayload { region: own, ..payload(lease) }, None).unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await; // idle sweeps run every 500 ms
    let late = Arc::new(c.encode.engine().alloc(len, Permissions::NONE).await.unwrap());
    let e = c.encode.consume(&gone.reference, late, 0, None).unwrap().all().await;
    assert!(
        matches!(e, Err(ConnectorError::LeaseEnded { end: LeaseEnd::Expired, .. })),
        "expired, buffer released: {e:?}"
    );
    // A destination too small.
    let small = Arc::new(c.decode.engine().alloc(len / 2, Permissions::NONE).await.unwrap());
    let e = c.decode.consume(&p.reference, small, 0, None).unwrap_err();
    assert!(matches!(e, ConnectorError::DestinationTooSmall { .. }), "{e}");
    // Bytes that changed after the producer marked them ready (and computed their checksum).
    let p =
        c.denoise.publish(payload(LeasePolicy::DeleteOnConsume { consumers: 1 }), None).unwrap();
    buf.write_bytes(0, b"overwritten after publish").unwrap();
    let e = c.decode.consume(&p.reference, dst.clone(), 0, None).unwrap().all().await.unwrap_err();
    assert!(matches!(e, ConnectorError::Checksum { .. }), "checksum mismatch: {e}");
    drop(p);
    // A producer that dies mid-handoff: an error within the wait bound, not a hang.
    let meta7 = TensorMeta::contiguous(DType::BF16, &[2, 7, 64]);
    let buf7 = Arc::new(
        c.denoise.engine().alloc(meta7.nbytes().unwrap(), Permissions::READ).await.unwrap(),
    );
    let mut p = c
        .denoise
        .publish(
            StagePayload {
                request: 10,
                kind: PayloadKind::Latent,
                region: buf7,
                offset: 0,
                meta: meta7.clone(),
                chunking: Some(Chunking { dim: 1, count: 7 }),
                lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
            },
            None,
        )
        .unwrap();
    p.mark_ready(0).unwrap();
    let dst7 = Arc::new(
        c.decode.engine().alloc(meta7.nbytes().unwrap(), Permissions::NONE).await.unwrap(),
    );
    let mut cons = c.decode.consume(&p.reference, dst7, 0, None).unwrap();
    assert_eq!(cons.next().await.unwrap().unwrap().index, 0);
    c.denoise.engine().shutdown().await;
    let started = std::time::Instant::now();
    let e = cons.all().await.unwrap_err();
    assert!(
        matches!(e, ConnectorError::ProducerGone(_) | ConnectorError::Timeout { .. }),
        "dead producer: {e}"
    );
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
    drop(p);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchunked_payload_that_is_not_contiguous_is_an_invalid_tensor() {
    let c = cluster(Mode::P2p, Duration::from_secs(2)).await;
    // A [4, 3] u16 tensor seen transposed: shape [3, 4], strides [1, 3].
    let meta = TensorMeta { strides: vec![1, 3], ..TensorMeta::contiguous(DType::U16, &[3, 4]) };
    let buf = Arc::new(c.denoise.engine().alloc(24, Permissions::READ).await.unwrap());
    let payload = |chunking| StagePayload {
        request: 1,
        kind: PayloadKind::Feature,
        region: buf.clone(),
        offset: 0,
        meta: meta.clone(),
        chunking,
        lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
    };
    let e = c.denoise.publish(payload(None), None).unwrap_err();
    let ConnectorError::InvalidTensor(m) = &e else { panic!("expected InvalidTensor, got {e}") };
    assert!(m.contains("contiguous") && m.contains("[1, 3]") && m.contains("[4, 1]"), "{m}");
    assert!(!m.contains("chunking"), "{m}");
    // Chunked along a dimension whose inner dimensions are not dense: the chunk plan's words.
    let e = c.denoise.publish(payload(Some(Chunking { dim: 0, count: 3 })), None).unwrap_err();
    assert!(matches!(&e, ConnectorError::InvalidTensor(m) if m.contains("chunking")), "{e}");
}

/// A stage worker that dies mid-stage leaves its input for the retry: `consume_held` reads
/// without reporting, a second consumer (the retry, on another engine) reads the same bytes,
/// and `release` (from a connector that never read it, too) ends the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_inputs_survive_until_released() {
    let c = cluster(Mode::Auto, Duration::from_millis(300)).await;
    let meta = TensorMeta::contiguous(DType::F32, &[4, 1024]);
    let len = meta.nbytes().unwrap();
    for p2p in [true, false] {
        let src = Arc::new(c.denoise.engine().alloc(len, Permissions::READ).await.unwrap());
        let data = fill(&src, 7);
        let payload = StagePayload {
            request: 3,
            kind: PayloadKind::Latent,
            region: src,
            offset: 0,
            meta: meta.clone(),
            chunking: None,
            lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
        };
        let mut p = c.denoise.publish(payload, p2p.then_some(ConsumerHint { credit: 1 })).unwrap();
        if !p2p {
            p.stored().await.unwrap();
        }
        let r = p.reference.clone();
        for reader in [&c.decode, &c.encode] {
            let dst = Arc::new(reader.engine().alloc(len, Permissions::NONE).await.unwrap());
            reader.consume_held(&r, dst.clone(), 0, Some(&meta)).unwrap().all().await.unwrap();
            assert!(dst.to_vec(0, len).unwrap() == data, "p2p {p2p}: bytes");
        }
        let stats = c.node_store.stats().await.unwrap();
        assert_eq!((c.denoise.held(), stats.objects), (usize::from(p2p), u64::from(!p2p)));
        // The releasing connector never read it (the orchestrator names who releases).
        let releaser = &c.encode;
        releaser.release(&r).await.unwrap();
        releaser.release(&r).await.unwrap(); // twice: harmless
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while c.denoise.held() + c.node_store.stats().await.unwrap().objects as usize > 0 {
            assert!(std::time::Instant::now() < deadline, "p2p {p2p}: still held after release");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let dst = Arc::new(c.decode.engine().alloc(len, Permissions::NONE).await.unwrap());
        let e = c.decode.consume(&r, dst, 0, Some(&meta)).unwrap().all().await.unwrap_err();
        assert!(e.is_payload_lost(), "p2p {p2p}: {e}");
    }
}
