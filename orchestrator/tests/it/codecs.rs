//! The orchestrator's codecs: queue messages and stages round-trip, and the queue message
//! decoder is total (proptest; the `queue_message` cargo-fuzz target runs it for longer).

use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use tensorwire_core::{
    AccessKey, DType, EngineId, Error, MemoryKind, Permissions, RegionId, RemoteRegion, TensorMeta,
};
use tensorwire_diffusion::{Chunking, LeasePolicy, PayloadKind, PayloadRef, Source};
use tensorwire_orchestrator::queue::MAX_REFS;
use tensorwire_orchestrator::{Affinity, Priority, QueueMessage, Stage};
use tensorwire_proto::wire::codec::{Reader, Writer};

fn sample() -> QueueMessage {
    let latent = PayloadRef {
        request: 7,
        kind: PayloadKind::Latent,
        source: Source::P2p {
            addr: "10.0.0.3:7000".parse().unwrap(),
            payload: 3,
            region: RemoteRegion {
                engine: EngineId(99),
                id: RegionId(12),
                key: AccessKey::from_bits(0xabc),
                len: 1 << 30,
                kind: MemoryKind::Host,
                perms: Permissions::READ,
                blobs: vec![
                    ("tcp".into(), Bytes::new()),
                    ("shm".into(), Bytes::from_static(b"fd")),
                ],
            },
            offset: 4096,
        },
        meta: TensorMeta::contiguous(DType::BF16, &[16, 21, 60, 104]),
        chunking: Some(Chunking { dim: 1, count: 7 }),
        lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
        checksum: None,
    };
    let emb = PayloadRef {
        source: Source::Store { key: b"emb/7".to_vec() },
        kind: PayloadKind::StepLatent { step: 12 },
        lease: LeasePolicy::Ttl(Duration::from_secs(30)),
        checksum: Some(5),
        chunking: None,
        ..latent.clone()
    };
    QueueMessage {
        request: 7,
        stage: Stage::Decode,
        payloads: vec![latent, emb],
        priority: Priority::Interactive,
        deadline_ms: 1_800_000_000_000,
        affinity: Affinity { host: Some("gpu-node-3".into()), labels: vec!["rail0".into()] },
        attempt: 2,
    }
}

#[test]
fn queue_message_round_trip_and_bounds() {
    let m = sample();
    assert_eq!(QueueMessage::decode(&m.encode().unwrap()).unwrap(), m);
    let mut big = m.clone();
    big.payloads = vec![m.payloads[0].clone(); MAX_REFS + 1];
    assert!(matches!(big.encode(), Err(Error::Capacity { .. })));
    let mut bytes = m.encode().unwrap();
    bytes[2] = 9;
    assert!(QueueMessage::decode(&bytes).unwrap_err().to_string().contains("version 9"));
    let enc = m.encode().unwrap();
    for cut in 0..enc.len() {
        assert!(QueueMessage::decode(&enc[..cut]).is_err(), "truncated at {cut} decoded");
    }
}

#[test]
fn stage_order_index_and_tags_agree() {
    for (i, s) in Stage::ALL.into_iter().enumerate() {
        assert_eq!(s.index(), i);
        let mut w = Writer::new();
        s.encode(&mut w);
        let b = w.finish();
        assert_eq!(Stage::decode(&mut Reader::new(&b, "t")).unwrap(), s);
    }
    assert_eq!(Stage::Encode.next(), Some(Stage::Denoise));
    assert_eq!(Stage::Decode.next(), None);
    assert!(Stage::decode(&mut Reader::new(&[3], "t")).is_err());
}

proptest! {
    #[test]
    fn queue_message_decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = QueueMessage::decode(&bytes);
    }

    #[test]
    fn mutated_queue_messages_never_panic(i in 0usize..400, b in any::<u8>()) {
        let mut enc = sample().encode().unwrap();
        let n = enc.len();
        enc[i % n] = b;
        let _ = QueueMessage::decode(&enc);
    }
}
