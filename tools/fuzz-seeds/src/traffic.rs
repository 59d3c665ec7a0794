//! Real sessions, recorded: two engines (handshake with and without a cluster secret, a refused
//! peer, transfers, a refused transfer, a notification, a chunked transfer), a pipeline of
//! connectors and a store node (a store-relayed embedding and a chunked p2p latent), and the
//! orchestrator service with a worker per stage and a submitter. Every message they exchanged
//! becomes a seed of the target that decodes it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::ClusterSecret;
use tensorwire_core::{
    AccessKey, ChunkPlan, DType, Engine, EngineConfig, Permissions, Region, TensorMeta, TransferOp,
};
use tensorwire_diffusion::control::Control;
use tensorwire_diffusion::{
    Chunking, ConnectorConfig, ConsumerHint, DiffusionConnector, LeasePolicy, Mode, PayloadKind,
    PayloadRef, StagePayload,
};
use tensorwire_orchestrator::service::wire as service;
use tensorwire_orchestrator::service::{
    OrchestratorService, ServiceConfig, SubmitClient, WorkerClient,
};
use tensorwire_orchestrator::{Priority, Stage};
use tensorwire_proto::wire::envelope::{Envelope, Message};
use tensorwire_proto::wire::frame::{CONTROL, Framing, RESERVED_KINDS};
use tensorwire_proto::wire::handshake::{CHALLENGE, OPEN, PROOF};
use tensorwire_store::{EmbeddedStore, RemoteStore, Store, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

use crate::record::{Conversation, Recorder};
use crate::split::{data_frames, frames};
use crate::{Corpus, Result};

/// The engine control channel's HELLO frame kind (it carries the engine descriptor).
const HELLO: u8 = 1;
/// Bound on every wait of a scenario.
const WAIT: Duration = Duration::from_secs(20);

/// Runs every scenario; returns the payload references the pipeline published.
pub async fn record_all(c: &mut Corpus) -> Result<Vec<PayloadRef>> {
    let secret = ClusterSecret::new("fuzz seeds");
    engines(c, Some(secret.clone())).await?;
    engines(c, None).await?;
    let refs = pipeline(c, &secret).await?;
    orchestrator(c, &secret, &refs).await?;
    Ok(refs)
}

/// An engine on a tcp backend whose data port peers reach through a recorder.
async fn engine(secret: Option<ClusterSecret>, checksum: bool) -> Result<(Engine, Recorder)> {
    let mut data = Recorder::bind().await?;
    let cfg = TcpConfig { advertise: Some(data.addr()), checksum, ..TcpConfig::default() };
    let tcp = TcpBackend::new(cfg)?;
    data.forward_to(tcp.local_addr());
    let config = EngineConfig { cluster_secret: secret, ..EngineConfig::default() };
    let e = Engine::builder().backend(tcp).config(config).start().await?;
    Ok((e, data))
}

async fn engines(c: &mut Corpus, secret: Option<ClusterSecret>) -> Result<()> {
    let (a, a_data) = engine(secret.clone(), true).await?;
    let (b, b_data) = engine(secret.clone(), false).await?;
    let mut control = Recorder::bind().await?;
    control.forward_to(b.local_addr());

    let src = a.alloc(64 << 10, Permissions::READ_WRITE).await?;
    src.write_bytes(0, &[0x5a; 64 << 10])?;
    let dst = b.alloc(64 << 10, Permissions::READ_WRITE).await?;
    let session = a.connect(control.addr()).await?;
    session.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, 4096)).await?;
    session.transfer(TransferOp::read(&src, 0, &dst.remote(), 4096, 1000)).await?;
    session.notify(Bytes::from_static(b"step 3 done")).await?;
    // A READ carrying a notice in its request (what a connector's subscription rides in).
    let read = TransferOp::read(&src, 0, &dst.remote(), 8192, 2000);
    for h in session.submit_with_notice(Bytes::from_static(b"subscribe"), vec![read]).await {
        h.await?;
    }

    // Refused on the peer: a wrong key, and a region deregistered after the descriptor was seen.
    let mut wrong = dst.remote();
    wrong.key = AccessKey::from_bits(wrong.key.to_bits() ^ 1);
    let refused = session.transfer(TransferOp::write(&src, 0, &wrong, 0, 512)).await;
    let gone = b.alloc(4096, Permissions::READ_WRITE).await?;
    let stale = gone.remote();
    drop(gone);
    let missing = session.transfer(TransferOp::read(&src, 0, &stale, 0, 512)).await;
    if refused.is_ok() || missing.is_ok() {
        return Err("a refused transfer succeeded".into());
    }

    // A chunked transfer: WRITEs, then a ChunkLanded notification per chunk.
    let meta = TensorMeta::contiguous(DType::BF16, &[4, 3, 8, 8]);
    let plan = ChunkPlan::new(&meta, 1, 3)?;
    let mut landed = b.expect_chunks(plan.clone(), &dst, 8192)?;
    let sender = session.chunk_sender(landed.transfer_id(), plan, &src, 0, &dst.remote(), 8192)?;
    for i in 0..3 {
        sender.mark_ready(i)?;
    }
    sender.finish().await?;
    while tokio::time::timeout(WAIT, landed.next()).await??.is_some() {}

    // A peer with another secret (or one where none is expected) is refused.
    let other = secret.map_or_else(|| ClusterSecret::new("other"), |_| ClusterSecret::new("wrong"));
    let (intruder, _) = engine(Some(other), false).await?;
    if intruder.connect(control.addr()).await.is_ok() {
        return Err("a peer with the wrong secret was accepted".into());
    }

    framed(c, &control.conversations(), &CONTROL, |c, f| {
        if f.kind == HELLO {
            c.add("engine_descriptor", f.payload().to_vec());
        }
    });
    for data in [&a_data, &b_data] {
        data_channel(c, &data.conversations());
    }
    for e in [&a, &b, &intruder] {
        e.shutdown().await;
    }
    Ok(())
}

/// Whole frames to `frame_header`, handshake payloads to `handshake`, each frame to `each`.
fn framed(
    c: &mut Corpus,
    convs: &[Conversation],
    framing: &Framing,
    mut each: impl FnMut(&mut Corpus, &crate::split::Frame),
) {
    for conv in convs {
        for stream in [&conv.to_server, &conv.to_client] {
            for f in frames(stream, framing) {
                c.add("frame_header", f.whole.clone());
                if [OPEN, CHALLENGE, PROOF].contains(&f.kind) {
                    c.add("handshake", f.payload().to_vec());
                }
                each(c, &f);
            }
        }
    }
}

/// Headers to `tcp_data_header`; notification bodies to `envelope` (and connector messages in
/// them to `connector_control`); refusals to `error_body`.
fn data_channel(c: &mut Corpus, convs: &[Conversation]) {
    use tensorwire_tcp::wire::{Kind, PREAMBLE, TICKET_LEN};
    for conv in convs {
        let client = PREAMBLE.len() + TICKET_LEN;
        for (stream, opening) in [(&conv.to_server, client), (&conv.to_client, PREAMBLE.len())] {
            for f in data_frames(stream, opening) {
                c.add("tcp_data_header", f.header.clone());
                let h = f.decoded;
                if h.kind == Kind::Notify {
                    if let Ok(Envelope { msg: Message::User(m), .. }) = Envelope::decode(&f.payload)
                    {
                        if let Ok(Some(_)) = Control::decode(&m) {
                            c.add("connector_control", m.to_vec());
                        }
                    }
                    c.add("envelope", f.payload);
                } else if h.kind.is_response() && !h.ok {
                    c.add("error_body", f.payload);
                }
            }
        }
    }
}

/// Encode -> denoise -> decode through connectors and a store node: an embedding relayed by the
/// store, a latent handed over p2p in temporal chunks.
async fn pipeline(c: &mut Corpus, secret: &ClusterSecret) -> Result<Vec<PayloadRef>> {
    let (node_engine, node_data) = engine(Some(secret.clone()), false).await?;
    let cfg = StoreConfig { shared: true, ..StoreConfig::default() };
    let store = EmbeddedStore::new(&node_engine, cfg).await?;
    let node = StoreNode::serve(store, "127.0.0.1:0".parse()?).await?;
    let mut rpc = Recorder::bind().await?;
    rpc.forward_to(node.addr());

    let mut stages = Vec::new();
    let mut data = vec![node_data];
    for _ in 0..3 {
        let (e, rec) = engine(Some(secret.clone()), true).await?;
        let remote = RemoteStore::connect(&e, node_engine.local_addr(), rpc.addr()).await?;
        let store: Arc<dyn Store> = Arc::new(remote);
        let cfg = ConnectorConfig { mode: Mode::Auto, checksum: true, wait_timeout: WAIT };
        stages.push(DiffusionConnector::new(e, Some(store), cfg));
        data.push(rec);
    }
    let (encode, denoise, decode) = (&stages[0], &stages[1], &stages[2]);

    let emb_meta = TensorMeta::contiguous(DType::BF16, &[1, 16, 64]);
    let emb = Arc::new(encode.engine().alloc(emb_meta.nbytes()?, Permissions::READ).await?);
    let emb = output(PayloadKind::ConditionEmbedding, emb, &emb_meta, None);
    let emb_pub = encode.publish(emb, None)?; // consumer unknown: through the store
    let emb_dst = Arc::new(denoise.engine().alloc(emb_meta.nbytes()?, Permissions::NONE).await?);
    let got = denoise.consume(&emb_pub.reference, emb_dst, 0, Some(&emb_meta))?;
    tokio::time::timeout(WAIT, got.all()).await??;

    let lat_meta = TensorMeta::contiguous(DType::BF16, &[4, 3, 8, 8]);
    let lat = Arc::new(denoise.engine().alloc(lat_meta.nbytes()?, Permissions::READ).await?);
    let lat = output(PayloadKind::Latent, lat, &lat_meta, Some(Chunking { dim: 1, count: 3 }));
    // A decode worker has a free slot: p2p.
    let mut lat_pub = denoise.publish(lat, Some(ConsumerHint { credit: 1 }))?;
    let lat_dst = Arc::new(decode.engine().alloc(lat_meta.nbytes()?, Permissions::NONE).await?);
    let mut got = decode.consume(&lat_pub.reference, lat_dst, 0, Some(&lat_meta))?;
    for i in 0..3 {
        lat_pub.mark_ready(i)?;
        tokio::time::timeout(WAIT, got.next()).await??;
    }
    while tokio::time::timeout(WAIT, got.next()).await??.is_some() {}

    framed(c, &rpc.conversations(), &tensorwire_store::rpc::FRAMING, |c, f| {
        c.add("store_rpc", f.whole.clone());
    });
    for rec in &data {
        data_channel(c, &rec.conversations());
    }
    Ok(vec![emb_pub.reference.clone(), lat_pub.reference.clone()])
}

/// Request 1's output of `kind` in `region`, for one consumer.
fn output(
    kind: PayloadKind,
    region: Arc<Region>,
    meta: &TensorMeta,
    c: Option<Chunking>,
) -> StagePayload {
    let lease = LeasePolicy::DeleteOnConsume { consumers: 1 };
    StagePayload { request: 1, kind, region, offset: 0, meta: meta.clone(), chunking: c, lease }
}

/// The orchestrator service: a worker per stage (decode fails its first try of request 2) and a
/// submitter of two requests.
async fn orchestrator(c: &mut Corpus, secret: &ClusterSecret, refs: &[PayloadRef]) -> Result<()> {
    let cfg = ServiceConfig {
        secret: Some(secret.clone()),
        handshake_timeout: WAIT,
        ..ServiceConfig::default()
    };
    let service = OrchestratorService::serve("127.0.0.1:0".parse()?, cfg).await?;
    let mut rec = Recorder::bind().await?;
    rec.forward_to(service.addr());
    let outputs: Vec<u8> = refs.first().map(PayloadRef::to_bytes).unwrap_or_default();
    let mut workers = Vec::new();
    for stage in Stage::ALL {
        let beat = Duration::from_millis(50);
        let (w, mut rx) =
            WorkerClient::connect(rec.addr(), Some(secret), stage, 2, "seeds", beat).await?;
        let outputs = outputs.clone();
        workers.push(tokio::spawn(async move {
            while let Some(a) = rx.recv().await {
                if a.stage != Stage::ALL[0] && w.handoff(&a, 65536, beat).await.is_err() {
                    return;
                }
                let r = match (a.stage, a.request, a.attempt) {
                    (Stage::Decode, 2, 1) => Err("transient: out of memory"),
                    _ => Ok(outputs.clone()),
                };
                if w.report_with(&a, r).await.is_err() {
                    return;
                }
            }
        }));
    }
    let submitter = SubmitClient::connect(rec.addr(), Some(secret)).await?;
    let first = submitter.submit(1, Priority::Interactive).await?;
    let second = submitter.submit(2, Priority::Batch).await?;
    for outcome in [first, second] {
        tokio::time::timeout(WAIT, outcome).await??.map_err(|e| e.to_string())?;
    }
    // A timeline asked for and answered, and one the service does not know.
    submitter.timeline(2, WAIT).await?;
    submitter.timeline(99, WAIT).await?;
    tokio::time::sleep(Duration::from_millis(120)).await; // a few heartbeats
    for w in workers {
        w.abort();
    }
    framed(c, &rec.conversations(), &service::FRAMING, |c, f| {
        if f.kind < RESERVED_KINDS {
            let mut input = vec![f.kind];
            input.extend(f.payload());
            c.add("orchestrator_msg", input);
        }
    });
    Ok(())
}
