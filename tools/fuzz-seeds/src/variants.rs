//! Every variant of every message, built directly: the recorded sessions reach the common ones,
//! these make sure the rare ones (errors, refusals, teardown) are seeds too.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::Missing;
use tensorwire_core::{AccessKey, DType, EngineId, Error, MemoryKind, RegionId, TensorMeta};
use tensorwire_diffusion::PayloadRef;
use tensorwire_diffusion::control::{Control, Gone};
use tensorwire_orchestrator::service::wire::{Ending, Msg, Role};
use tensorwire_orchestrator::{Affinity, Priority, QueueMessage, Stage};
use tensorwire_proto::wire::codec::Writer;
use tensorwire_proto::wire::envelope::{Envelope, Message};
use tensorwire_proto::wire::error::encode_error;
use tensorwire_proto::wire::handshake::{Challenge, Open, Proof};
use tensorwire_shm::wire as shm;
use tensorwire_store::rpc::{self, Request, Response};
use tensorwire_store::{Retention, StoreError, StoreStats};
use tensorwire_ucx::wire as ucx;

use crate::Corpus;

/// Adds every variant of every message that does not need a running system.
pub fn add_all(c: &mut Corpus, refs: &[PayloadRef]) {
    errors(c);
    tensors(c);
    handshake(c);
    envelopes(c);
    shm_headers(c);
    c.add("cuda_ipc_share", crate::targets::cuda_share());
    ucx_msgs(c);
    rdma(c);
    nccl(c);
    control(c);
    store_rpc(c);
    orchestrator(c);
    journal(c);
    discovery(c);
    checkpoints(c);
    queue_messages(c, refs);
}

fn errors(c: &mut Corpus) {
    for e in core_errors() {
        c.add("error_body", encode_error(&e));
    }
}

/// One of every core error.
fn core_errors() -> Vec<Error> {
    vec![
        Error::NotFound(Missing::Region(RegionId(7))),
        Error::NotFound(Missing::Deregistered(RegionId(8))),
        Error::NotFound(Missing::Peer("engine 3".into())),
        Error::NotFound(Missing::Transfer(9)),
        Error::NotFound(Missing::Other("thing".into())),
        Error::Unsupported { backend: "tcp", what: "device memory".into() },
        Error::OutOfBounds {
            what: "remote region 7".into(),
            offset: 4096,
            len: 1 << 20,
            limit: 8192,
        },
        Error::AccessDenied("region 7: wrong access key".into()),
        Error::PeerClosed("connection reset".into()),
        Error::Timeout { what: "chunk 3".into(), after: Duration::from_millis(1500) },
        Error::Capacity { what: "notification queue".into(), requested: 1025, limit: 1024 },
        Error::InvalidTensor("2 dimensions but 1 stride".into()),
        Error::Checksum { what: "tcp READ".into(), expected: 0xdead_beef, actual: 0x0bad_f00d },
        Error::Protocol("bad magic".into()),
        Error::Internal("broken invariant".into()),
        Error::InvalidArgument("zero chunks".into()),
        Error::Backend {
            backend: "ucx",
            source: Arc::new(std::io::Error::other("UCS_ERR_IO_ERROR")),
        },
    ]
}

/// Tensors of every dtype and device, strided and offset ones, and the shapes of real payloads.
fn tensors(c: &mut Corpus) {
    let mut metas: Vec<TensorMeta> =
        DType::all().iter().map(|&d| TensorMeta::contiguous(d, &[2, 3, 4])).collect();
    for shape in [&[1, 226, 4096][..], &[16, 21, 60, 104], &[1, 16, 128, 128], &[], &[3, 0, 5]] {
        metas.push(TensorMeta::contiguous(DType::BF16, shape));
    }
    let mut strided = TensorMeta::contiguous(DType::F16, &[2, 4]);
    strided.strides = vec![6, 1];
    strided.byte_offset = 16;
    metas.push(strided);
    for device in [MemoryKind::HostPinned, MemoryKind::Device { ordinal: 1 }] {
        let mut m = TensorMeta::contiguous(DType::F32, &[8, 8]);
        m.device = device;
        metas.push(m);
    }
    for m in &metas {
        let mut w = Writer::new();
        m.encode(&mut w);
        let bytes = w.finish();
        c.add("tensor_meta", bytes.clone());
        let rank = m.shape.len() as u8;
        for dim in 0..rank.max(1) {
            for count in [1u32, 2, 7] {
                let mut input = vec![dim];
                input.extend(count.to_le_bytes());
                input.extend(&bytes);
                c.add("chunk_plan", input);
            }
        }
    }
}

fn handshake(c: &mut Corpus) {
    let (nonce, proof) = ([0x11; 32], [0x22; 32]);
    c.add("handshake", Open { nonce }.encode());
    c.add("handshake", Challenge { nonce, proof: Some(proof) }.encode());
    c.add("handshake", Challenge { nonce, proof: None }.encode());
    c.add("handshake", Proof { proof: Some(proof) }.encode());
    c.add("handshake", Proof { proof: None }.encode());
}

fn envelopes(c: &mut Corpus) {
    let from = EngineId(0x1234_5678_9abc_def0);
    for msg in [
        Message::User(bytes::Bytes::from_static(b"hello")),
        Message::ChunkLanded { transfer: 3, index: 6 },
        Message::ChunkAbort { transfer: 3, reason: "producer gave up".into() },
    ] {
        c.add_result("envelope", Envelope { from, msg }.encode().map(|b| b.to_vec()));
    }
}

fn shm_headers(c: &mut Corpus) {
    use shm::Kind::*;
    for kind in [Begin, Granted, End, Notify, NotifyAck, Forget, Released, Live] {
        let mut h = shm::Header::new(kind, 42);
        h.region = RegionId(3);
        h.key = AccessKey::from_bits(0xfeed_f00d);
        h.offset = 4096;
        h.len = if kind == Notify { 64 } else { 1 << 20 };
        h.flags = match kind {
            Begin => shm::WANT_SHARE | shm::ACCESS_WRITE,
            Granted => shm::HAS_FD | shm::WRITABLE,
            Live => shm::HAS_FD,
            _ => 0,
        };
        c.add("shm_header", h.encode().to_vec());
        if matches!(kind, Granted | NotifyAck) {
            let mut refused = shm::Header::new(kind, 43);
            refused.ok = false;
            refused.len = 40;
            c.add("shm_header", refused.encode().to_vec());
        }
    }
    // A grant with an export's bytes after it (a cuda IPC share).
    let mut g = shm::Header::new(Granted, 44);
    g.len = 64 << 20;
    g.share = tensorwire_cuda::ipc::SHARE_LEN as u16;
    c.add("shm_header", g.encode().to_vec());
}

fn ucx_msgs(c: &mut Corpus) {
    use ucx::Kind::*;
    let error = encode_error(&Error::AccessDenied("region 3 does not grant remote write".into()));
    let envelope =
        Envelope { from: EngineId(1), msg: Message::User(bytes::Bytes::from_static(b"n")) };
    let notify = envelope.encode().map(|b| b.to_vec()).unwrap_or_default();
    for kind in [Hello, HelloAck, Begin, Granted, End, Notify, NotifyAck, Bye, Forget, Released] {
        let mut m = ucx::Msg::new(kind, 5, 6);
        m.region = RegionId(3);
        m.key = AccessKey::from_bits(0xabcd);
        m.offset = 128;
        m.len = 4096;
        match kind {
            Hello => m.body = b"ucx worker address bytes",
            Notify => m.body = &notify,
            HelloAck | NotifyAck => m.flags = ucx::OK,
            Granted => m.flags = ucx::OK | ucx::LEASE,
            Begin => m.flags = ucx::WRITE | ucx::LEASE,
            Released => m.flags = ucx::WRITE,
            Bye => m.flags = ucx::TARGET,
            End | Forget => {}
        }
        c.add("ucx_msg", m.encode());
        if matches!(kind, HelloAck | Granted | NotifyAck) {
            m.flags = 0;
            m.body = &error;
            c.add("ucx_msg", m.encode());
        }
    }
}

fn rdma(c: &mut Corpus) {
    use tensorwire_rdma::blob::{Endpoint, NicAddress, RegionKeys};
    use tensorwire_rdma::verbs::{LinkLayer, QpAddress};
    use tensorwire_rdma::wire::{Msg as R, RailOffer};
    let qp = |n: u32| QpAddress { qpn: n, psn: 7 * n, lid: 3, gid: [n as u8; 16], mtu: 5 };
    let offer = RailOffer { local_nic: 0, remote_nic: 1, qp: qp(0x11) };
    let refusal = Error::AccessDenied("region 3 does not grant remote write".into());
    let msgs = [
        R::Hello { rails: vec![offer, RailOffer { local_nic: 1, remote_nic: 0, qp: qp(0x12) }] },
        R::HelloAck { rails: vec![Ok(qp(0x21)), Err(refusal.clone())] },
        R::Lease { req: 1, region: RegionId(3), key: AccessKey::from_bits(0xabcd), write: true },
        R::Granted { req: 1, len: 4096, bases: vec![(0, 0x7f00_0000_0000), (1, 0x7f00_0000_0000)] },
        R::Refused { req: 2, error: refusal.clone() },
        R::Forget { region: RegionId(3) },
        R::Released { region: RegionId(3), write: false },
        R::Notify { req: 3, msg: bytes::Bytes::from_static(b"notification") },
        R::NotifyAck { req: 3, error: None },
        R::NotifyAck { req: 4, error: Some(refusal.clone()) },
        R::Rail { req: 5, rail: 1, offer },
        R::RailAck { req: 5, answer: Ok(qp(0x31)) },
        R::RailAck { req: 6, answer: Err(refusal) },
        R::Bye,
    ];
    for m in msgs {
        let mut v = vec![m.kind()];
        v.extend(m.encode());
        c.add("rdma_control", v);
    }
    let nic = |i: u8, link| NicAddress {
        name: format!("mlx5_{i}"),
        port: 1,
        lid: u16::from(i) + 1,
        gid: [i; 16],
        gid_index: 3,
        link,
        mtu: 5,
        fabric: 0xfe80_0000_0000_0000,
    };
    let ep = Endpoint {
        control: "10.0.0.7:7003".parse().expect("an address"),
        nics: vec![nic(0, LinkLayer::Ethernet), nic(1, LinkLayer::Infiniband)],
    };
    let mut v = vec![0];
    v.extend(ep.encode());
    c.add("rdma_blob", v);
    let mut v = vec![1];
    v.extend(RegionKeys(vec![(0, 0x1234), (1, 0x5678)]).encode());
    c.add("rdma_blob", v);
}

fn nccl(c: &mut Corpus) {
    use tensorwire_nccl::wire::Msg as N;
    let refusal = Error::AccessDenied("region 3 does not grant remote read".into());
    let mut id = [0u8; 128];
    id.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let (region, key) = (RegionId(3), AccessKey::from_bits(0xabcd));
    let msgs = [
        N::Hello { id },
        N::HelloAck { error: None },
        N::HelloAck { error: Some(Error::Unsupported { backend: "nccl", what: "no GPU".into() }) },
        N::Request { req: 1, write: true, region, key, offset: 4096, len: 1 << 20 },
        N::Request { req: 2, write: false, region, key, offset: 0, len: 64 },
        N::Grant { req: 1 },
        N::Refused { req: 2, error: refusal.clone() },
        N::Done { req: 1, error: None },
        N::Done { req: 3, error: Some(refusal.clone()) },
        N::Notify { req: 4, msg: bytes::Bytes::from_static(b"notification") },
        N::NotifyAck { req: 4, error: None },
        N::NotifyAck { req: 5, error: Some(refusal) },
        N::Bye,
    ];
    for m in msgs {
        let mut v = vec![m.kind()];
        v.extend(m.encode());
        c.add("nccl_control", v);
    }
}

fn control(c: &mut Corpus) {
    let mut all = vec![
        Control::Subscribe { payload: 9, hold_ms: 60_000 },
        Control::Done { payload: 9, consumed: false },
        Control::Ready { payload: 9, index: 2, crc: Some(0x1234_5678) },
        Control::Ready { payload: 9, index: 3, crc: None },
        Control::Done { payload: 9, consumed: true },
    ];
    all.extend(Gone::ALL.map(|why| Control::Gone { payload: 9, why }));
    for m in all {
        c.add("connector_control", m.encode());
    }
}

fn store_rpc(c: &mut Corpus) {
    let meta = TensorMeta::contiguous(DType::BF16, &[1, 226, 4096]);
    let key = b"tw/1/2".to_vec();
    let requests = [
        Request::Hello,
        Request::Auth { region: RegionId(1), key: AccessKey::from_bits(0x77) },
        Request::Reserve {
            key: key.clone(),
            meta: meta.clone(),
            len: 1 << 20,
            retention: Retention::Pinned,
        },
        Request::Commit { ticket: 1 },
        Request::Abort { ticket: 2 },
        Request::Open { key: key.clone() },
        Request::Close { ticket: 3 },
        Request::Exists { key: key.clone() },
        Request::Remove { key: key.clone() },
        Request::Pin { key: key.clone(), up: true },
        Request::Stats,
        Request::Lease { key: key.clone(), consumers: 2, ttl_ms: 30_000 },
        Request::Consumed { key: key.clone() },
    ];
    for (id, r) in requests.iter().enumerate() {
        let (kind, body) = r.encode();
        c.add_result("store_rpc", rpc::frame(kind, id as u64, &body));
    }
    let stats =
        StoreStats { capacity: 1 << 30, used: 1 << 20, objects: 3, ..StoreStats::default() };
    let responses = [
        Response::Done,
        Response::Pool { region: RegionId(1), engine: "127.0.0.1:7000".parse().unwrap() },
        Response::Reserved { ticket: 1, offset: 4096 },
        Response::Opened { ticket: 2, offset: 8192, len: 1 << 20, meta },
        Response::Flag(true),
        Response::Stats(stats),
    ];
    for (id, r) in responses.into_iter().enumerate() {
        c.add_result("store_rpc", rpc::reply(id as u64, &Ok(r)));
    }
    let refusals = [
        StoreError::not_found(&key),
        StoreError::Exists { key: tensorwire_store::StoreKey(key.clone()) },
        StoreError::InvalidArgument("unpin of an unpinned key".into()),
        StoreError::InvalidTensor("meta does not fit".into()),
        StoreError::Capacity { what: "pool".into(), requested: 1 << 31, limit: 1 << 30 },
        StoreError::Corrupt("bad header crc".into()),
        StoreError::Io {
            what: "write spill".into(),
            source: Arc::new(std::io::Error::other("ENOSPC")),
        },
        StoreError::Internal("broken invariant".into()),
    ];
    let engine = core_errors().into_iter().map(StoreError::Engine);
    for (id, e) in refusals.into_iter().chain(engine).enumerate() {
        c.add_result("store_rpc", rpc::reply(id as u64, &Err(e)));
    }
}

fn orchestrator(c: &mut Corpus) {
    let worker = Role::Worker {
        stage: Stage::Denoise,
        slots: 4,
        host: "gpu-node-3".into(),
        labels: vec!["rail0".into(), "numa1".into()],
        can: vec![(Stage::Decode, Duration::from_secs(12))],
        switched: Some(Duration::from_millis(31_900)),
    };
    let msgs = [
        Msg::Hello { role: worker },
        Msg::Hello { role: Role::Submitter },
        Msg::Welcome { worker: 7 },
        Msg::Heartbeat,
        Msg::Credit { slots: 3 },
        Msg::Assign {
            request: 1,
            stage: Stage::Decode,
            priority: Priority::Interactive,
            attempt: 2,
            data: b"refs".to_vec(),
            resume_step: 0,
            resume: Vec::new(),
        },
        Msg::Assign {
            request: 1,
            stage: Stage::Denoise,
            priority: Priority::Batch,
            attempt: 3,
            data: b"refs".to_vec(),
            resume_step: 30,
            resume: b"checkpoint ref".to_vec(),
        },
        Msg::Checkpoint {
            request: 1,
            stage: Stage::Denoise,
            step: 30,
            data: b"checkpoint ref".to_vec(),
        },
        Msg::Result {
            request: 1,
            stage: Stage::Encode,
            ending: Ending::Done,
            reason: String::new(),
            data: b"refs".to_vec(),
        },
        Msg::Result {
            request: 1,
            stage: Stage::Decode,
            ending: Ending::Failed,
            reason: "oom".into(),
            data: Vec::new(),
        },
        Msg::Submit {
            request: 2,
            priority: Priority::Batch,
            deadline_ms: 60_000,
            start: Stage::Encode,
            data: Vec::new(),
            resume_step: 0,
            resume: Vec::new(),
        },
        Msg::Submit {
            request: 3,
            priority: Priority::Interactive,
            deadline_ms: 0,
            start: Stage::Denoise,
            data: b"cached refs".to_vec(),
            resume_step: 20,
            resume: b"checkpoint ref".to_vec(),
        },
        Msg::Result {
            request: 1,
            stage: Stage::Decode,
            ending: Ending::LostInput,
            reason: "producer gone".into(),
            data: Vec::new(),
        },
        Msg::Outcome { request: 2, ok: false, reason: "too many attempts".into() },
        Msg::Release { request: 2, held: vec![b"refs".to_vec(), b"latent refs".to_vec()] },
        Msg::Released { request: 2 },
        Msg::Announce { request: 2, stage: Stage::Encode, data: b"refs".to_vec() },
        Msg::Holding { request: 2, stage: Stage::Denoise, attempt: 1 },
        Msg::Ack { request: 2, stage: Stage::Denoise },
        Msg::Resume {
            request: 2,
            priority: Priority::Interactive,
            start: Stage::Denoise,
            data: b"cached refs".to_vec(),
            resume_step: 0,
            resume: Vec::new(),
        },
        Msg::Yield { request: 2, stage: Stage::Denoise },
        Msg::Yielded {
            request: 2,
            stage: Stage::Denoise,
            step: 14,
            data: b"checkpoint ref".to_vec(),
        },
        Msg::Drain,
        Msg::Drained,
        Msg::Switch { stage: Stage::Decode },
    ];
    for m in msgs {
        let (kind, mut body) = m.encode_body();
        body.insert(0, kind);
        c.add("orchestrator_msg", body);
    }
}

/// Step-checkpoint references: an image's latents, a video's with a sampler state.
fn checkpoints(c: &mut Corpus) {
    use tensorwire_core::{DType, TensorMeta};
    use tensorwire_diffusion::cache::CheckpointRef;
    let refs = [
        CheckpointRef {
            key: b"tw/cache/ckpt/00ff".to_vec(),
            meta: TensorMeta::contiguous(DType::F16, &[16, 128, 128]),
            step: 12,
            state: Vec::new(),
        },
        CheckpointRef {
            key: b"tw/cache/ckpt/a1b2".to_vec(),
            meta: TensorMeta::contiguous(DType::BF16, &[16, 21, 60, 104]),
            step: 30,
            state: b"sigmas and timesteps".to_vec(),
        },
    ];
    for r in refs {
        c.add("checkpoint_ref", r.encode());
    }
}

/// Discovery entries as etcd stores them: an engine, a store node naming its engine, IPv6.
fn discovery(c: &mut Corpus) {
    use tensorwire_proto::discovery::Entry;
    let entries = [
        Entry {
            kind: "engine".into(),
            id: "e1".into(),
            addr: ([10, 0, 0, 5], 7000).into(),
            meta: vec![],
        },
        Entry {
            kind: "store".into(),
            id: "e1".into(),
            addr: ([10, 0, 0, 5], 7100).into(),
            meta: b"10.0.0.5:7000".to_vec(),
        },
        Entry {
            kind: "orchestrator".into(),
            id: "o".into(),
            addr: "[::1]:7200".parse().unwrap(),
            meta: vec![],
        },
    ];
    for e in entries {
        c.add("discovery_entry", e.encode_value());
    }
}

/// Journal records of every kind, alone and as one journal of a request's life, and its
/// compacted form.
fn journal(c: &mut Corpus) {
    use tensorwire_orchestrator::Outcome;
    use tensorwire_orchestrator::journal::{Book, Fact};
    use tensorwire_orchestrator::sched::ItemKey;
    let key = |stage| ItemKey { request: 5, stage };
    let life = [
        Fact::Submitted {
            request: 5,
            priority: Priority::Batch,
            start: Stage::Encode,
            inputs: vec![],
        },
        Fact::Submitted {
            request: 7,
            priority: Priority::Interactive,
            start: Stage::Denoise,
            inputs: b"cached refs".to_vec(),
        },
        Fact::Dispatched { key: key(Stage::Encode), attempt: 1 },
        Fact::Announced { request: 5, data: b"refs".to_vec() },
        Fact::Accepted { key: key(Stage::Encode), outputs: b"refs".to_vec() },
        Fact::Dispatched { key: key(Stage::Denoise), attempt: 2 },
        Fact::Checkpointed { key: key(Stage::Denoise), step: 10, data: b"checkpoint".to_vec() },
        Fact::Yielded { key: key(Stage::Denoise) },
        Fact::ResumeFrom { request: 7, step: 20, data: b"checkpoint ref".to_vec() },
        Fact::Accepted { key: key(Stage::Denoise), outputs: b"latent refs".to_vec() },
        Fact::LostInput { key: key(Stage::Decode) },
        Fact::Ended(Outcome::Failed { request: 5, reason: "too many attempts".into() }),
        Fact::Ended(Outcome::Completed { request: 6 }),
    ];
    let mut book = Book::default();
    for f in &life {
        c.add("orchestrator_journal", f.encode());
        book.apply(f);
    }
    c.add("orchestrator_journal", life.iter().flat_map(Fact::encode).collect());
    c.add("orchestrator_journal", book.snapshot_bytes());
    c.add("orchestrator_journal", Fact::Released { request: 5 }.encode());
}

/// Queue messages carrying the recorded refs, for every stage and priority.
fn queue_messages(c: &mut Corpus, refs: &[PayloadRef]) {
    for stage in Stage::ALL {
        for priority in [Priority::Interactive, Priority::Batch] {
            let m = QueueMessage {
                request: 17,
                stage,
                payloads: refs.to_vec(),
                priority,
                deadline_ms: 120_000,
                affinity: Affinity {
                    host: Some("gpu-node-3".into()),
                    labels: vec!["rail0".into()],
                },
                attempt: 1,
            };
            c.add_result("queue_message", m.encode());
            let bare = QueueMessage {
                payloads: refs.iter().take(1).cloned().collect(),
                affinity: Affinity::default(),
                ..m
            };
            c.add_result("queue_message", bare.encode());
        }
    }
    for r in refs {
        c.add("payload_ref", r.to_bytes());
    }
}
