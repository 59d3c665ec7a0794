//! A worker process (`tensorwire worker --store-engine ...`): it joins a pool, consumes its
//! inputs, simulates the stage, publishes its outputs, checkpoints denoise, releases what ended
//! requests held, and drains on SIGTERM or a switch order.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::ClusterSecret;
use tensorwire_core::Permissions;
use tensorwire_diffusion::cache::{
    CheckpointOf, CheckpointRef, Checkpoints, Sampler, Shape, checkpoint_key, embedding_key,
};
use tensorwire_diffusion::{
    Chunking, ConnectorConfig, ConnectorError, ConsumerHint, DiffusionConnector, LeasePolicy, Mode,
    PayloadKind, PayloadRef, StagePayload,
};
use tensorwire_orchestrator::service::{Assignment, WorkerClient};
use tensorwire_orchestrator::{HandlerError, Priority, Stage};
use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_store::{ClusterConfig, ClusterStore, RemoteStore, Store};

use crate::demo::pipeline::{embed_meta, fill, latent_meta, now_us, tcp_engine};
use tensorwire_sim::profiles::Model;

pub(super) fn encode_refs(refs: &[PayloadRef]) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(refs.len() as u32);
    for r in refs {
        r.encode(&mut w);
    }
    w.finish()
}

pub(super) fn decode_refs(b: &[u8]) -> tensorwire_core::Result<Vec<PayloadRef>> {
    let mut r = Reader::new(b, "stage outputs");
    let n = r.count(16, "payload refs")?;
    let v =
        (0..n).map(|_| PayloadRef::decode(&mut r)).collect::<tensorwire_core::Result<Vec<_>>>()?;
    r.finish()?;
    Ok(v)
}

/// How a stage run ended without an error.
pub(super) enum Ran {
    /// With these outputs.
    Done(Vec<u8>),
    /// Given back at a step boundary (asked to yield).
    Yielded,
}

/// The latents of `request` after `step` of `steps` (a deterministic trajectory that ends in
/// the bytes decode checks).
pub(super) fn trajectory(m: &Model, request: u64, step: u32) -> Vec<u8> {
    fill(m.latent_bytes, request + 1 + 7 * u64::from(m.steps.saturating_sub(step)))
}

/// Step checkpoints of one denoise job in the store.
pub(super) struct Stepper<'a> {
    ck: &'a Checkpoints,
    w: &'a WorkerClient,
    a: &'a Assignment,
    m: &'a Model,
    buf: &'a tensorwire_core::Region,
    /// Saved by this run, oldest first (the last two are kept).
    saved: std::collections::VecDeque<CheckpointRef>,
}

impl Stepper<'_> {
    /// Writes the latents at `step` and saves them as a checkpoint (announced first: released
    /// when the request ends even if this worker dies right after the put).
    async fn save(&mut self, step: u32) -> Result<Vec<u8>, HandlerError> {
        self.buf.write_bytes(0, &trajectory(self.m, self.a.request, step))?;
        let key = checkpoint_key(&CheckpointOf {
            model: &self.m.name,
            sampler: Sampler { name: "euler", state: &[] },
            step,
            seed: self.a.request,
            guidance_scale: 5.0,
            shape: Shape { width: 0, height: 0, frames: 0 },
            prompt: embedding_key("demo", "1", &self.a.request.to_string(), false, &[]),
        });
        let meta = latent_meta(self.m);
        let out = Checkpoints::reference(&key, &meta, step, b"euler").encode();
        self.w.announce(self.a, out.clone()).await?;
        let slice = self.buf.slice(0, self.m.latent_bytes)?;
        let r = self.ck.save(&key, &meta, &slice, step, b"euler").await?;
        self.saved.push_back(r);
        if self.saved.len() > 2 {
            // The orchestrator has had the one after it for a whole interval.
            if let Some(old) = self.saved.pop_front() {
                let _ = self.ck.release(&old).await;
            }
        }
        Ok(out)
    }

    /// Loads the checkpoint the assignment resumes from; its step, or 0 (from the start) when
    /// there is none or it cannot be read.
    async fn resume(&self) -> u32 {
        let Some((step, data)) = &self.a.resume else { return 0 };
        let loaded = async {
            let r = CheckpointRef::decode(data)?;
            self.ck.load(&r, self.buf, 0).await?;
            if self.buf.to_vec(0, self.m.latent_bytes)? != trajectory(self.m, self.a.request, *step)
            {
                return Err::<(), HandlerError>("checkpoint bytes differ".into());
            }
            Ok(())
        };
        match loaded.await {
            Ok(()) => {
                println!("@@RESUMED {} {step}", self.a.request);
                *step
            }
            Err(e) => {
                eprintln!(
                    "worker: request {}: checkpoint at {step}: {e}; from step 0",
                    self.a.request
                );
                0
            }
        }
    }
}

/// The body of a payload-moving worker for one assignment.
pub(super) async fn run_item(
    c: &DiffusionConnector,
    ck: &Checkpoints,
    w: &WorkerClient,
    m: &Model,
    a: &Assignment,
    (scale, every): (f64, [u32; 2]),
) -> Result<Ran, HandlerError> {
    let every = every[usize::from(a.priority == Priority::Batch)];
    let sleep = |ms: f64| tokio::time::sleep(Duration::from_secs_f64((ms * scale / 1e3).max(0.0)));
    let (embed, latent) = (embed_meta(m), latent_meta(m));
    match a.stage {
        Stage::Encode => {
            sleep(m.encode_ms).await;
            let buf = Arc::new(c.engine().alloc(m.embed_bytes, Permissions::NONE).await?);
            buf.write_bytes(0, &fill(m.embed_bytes, a.request))?;
            let payload = StagePayload {
                request: a.request,
                kind: PayloadKind::ConditionEmbedding,
                region: buf,
                offset: 0,
                meta: embed,
                chunking: None,
                lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
            };
            let mut p = c.publish(payload, None)?;
            // Said before the put can complete: should this worker die after it did, the
            // orchestrator still releases the object when the request ends.
            let out = encode_refs(&[p.reference.clone()]);
            w.announce(a, out.clone()).await?;
            p.stored().await?;
            Ok(Ran::Done(out))
        }
        Stage::Denoise => {
            let refs = decode_refs(&a.inputs)?;
            let emb =
                refs.first().ok_or_else(|| anyhow::Error::msg("denoise without an embedding"))?;
            let dst = Arc::new(c.engine().alloc(m.embed_bytes, Permissions::NONE).await?);
            let t = tokio::time::Instant::now();
            c.consume_held(emb, dst.clone(), 0, Some(&embed))?.all().await?;
            w.handoff(a, m.embed_bytes, t.elapsed()).await?;
            if dst.to_vec(0, m.embed_bytes)? != fill(m.embed_bytes, a.request) {
                return Err(anyhow::anyhow!("request {}: embedding bytes differ", a.request).into());
            }
            let buf = Arc::new(c.engine().alloc(m.latent_bytes, Permissions::READ).await?);
            let saved = std::collections::VecDeque::new();
            let mut st = Stepper { ck, w, a, m, buf: &buf, saved };
            println!("@@DENOISE {} {}", a.request, std::process::id());
            let from = st.resume().await;
            let step = Duration::from_secs_f64((m.step_ms * scale / 1e3).max(0.0));
            let t0 = tokio::time::Instant::now();
            for s in from..m.steps {
                if s > from && w.yield_requested(a) {
                    let r = st.save(s).await?;
                    w.yield_job(a, s, r).await?;
                    println!("@@YIELDED {} {s}", a.request);
                    return Ok(Ran::Yielded);
                }
                tokio::time::sleep_until(t0 + step * (s + 1 - from)).await;
                let done = s + 1;
                if every > 0 && done % every == 0 && done < m.steps {
                    let r = st.save(done).await?;
                    w.checkpoint(a, done, r).await?;
                    println!("@@CHECKPOINT {} {done}", a.request);
                }
            }
            buf.write_bytes(0, &trajectory(m, a.request, m.steps))?;
            let payload = StagePayload {
                request: a.request,
                kind: PayloadKind::Latent,
                region: buf,
                offset: 0,
                meta: latent,
                chunking: m.chunks().map(|(dim, count)| Chunking { dim, count }),
                lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
            };
            let mut p = c.publish(payload, Some(ConsumerHint { credit: 1 }))?;
            p.mark_all_ready()?;
            Ok(Ran::Done(encode_refs(&[p.reference.clone()])))
        }
        Stage::Decode => {
            let refs = decode_refs(&a.inputs)?;
            let lat = refs.first().ok_or_else(|| anyhow::Error::msg("decode without a latent"))?;
            let dst = Arc::new(c.engine().alloc(m.latent_bytes, Permissions::NONE).await?);
            let chunks = m.chunks().map_or(1, |(_, n)| n);
            let t = tokio::time::Instant::now();
            let mut cons = c.consume_held(lat, dst.clone(), 0, Some(&latent))?;
            let (mut first, mut landed) = (true, 0);
            while cons.next().await?.is_some() {
                landed += 1;
                if landed == chunks {
                    // The last chunk in hand (it decodes chunks as they land, so this is after
                    // the decode of the ones before).
                    w.handoff(a, m.latent_bytes, t.elapsed()).await?;
                }
                sleep(m.decode_ms / f64::from(chunks)).await;
                if first {
                    println!("@@FIRST {} {}", a.request, now_us());
                    first = false;
                }
            }
            if dst.to_vec(0, m.latent_bytes)? != fill(m.latent_bytes, a.request + 1) {
                return Err(anyhow::anyhow!("request {}: latent bytes differ", a.request).into());
            }
            Ok(Ran::Done(Vec::new()))
        }
    }
}

/// Where a worker's store is.
#[derive(Debug, Clone)]
pub(crate) enum StoreAt {
    /// One store node: its engine's control address and its RPC address.
    Node(SocketAddr, SocketAddr),
    /// Store nodes (their RPC addresses) behind a cluster store with this many replicas.
    Cluster(Vec<SocketAddr>, usize),
    /// The store nodes a registry lists (etcd), followed, behind a cluster store.
    Registered(Arc<dyn tensorwire_proto::discovery::Discovery>, usize),
}

impl StoreAt {
    async fn open(&self, engine: &tensorwire_core::Engine) -> anyhow::Result<Arc<dyn Store>> {
        Ok(match self {
            StoreAt::Node(e, rpc) => Arc::new(RemoteStore::connect(engine, *e, *rpc).await?),
            StoreAt::Cluster(nodes, replicas) => {
                let cfg = ClusterConfig { replicas: *replicas, ..ClusterConfig::default() };
                Arc::new(ClusterStore::remote(engine, nodes, cfg)?)
            }
            StoreAt::Registered(registry, replicas) => {
                let cfg = ClusterConfig { replicas: *replicas, ..ClusterConfig::default() };
                let store = Arc::new(ClusterStore::remote(engine, &[], cfg)?);
                store.follow(registry.clone(), Duration::from_secs(1)).await?;
                if store.nodes().is_empty() {
                    anyhow::bail!("no store node is registered");
                }
                store
            }
        })
    }
}

/// A worker process that moves payloads (called from `tensorwire worker --store-engine ...`).
/// With `--can`, an orchestrator with `--rebalance` may move it to another pool: it drains,
/// waits for the latents it published to be read, pays the switch and joins that pool.
pub(crate) async fn payload_worker(
    (stage, slots): (Stage, u32),
    orch: tensorwire_orchestrator::service::Target,
    store_at: StoreAt,
    secret: Option<ClusterSecret>,
    (models, mobility): (Vec<Model>, crate::switching::Mobility),
    (scale, every): (f64, [u32; 2]),
    join: &crate::observe::Joining,
) -> anyhow::Result<()> {
    let engine = tcp_engine(secret.clone()).await?;
    let store = store_at.open(&engine).await?;
    let cfg = ConnectorConfig {
        mode: Mode::Auto,
        checksum: false,
        wait_timeout: Duration::from_secs(30),
    };
    let ck = Arc::new(Checkpoints::new(store.clone(), Duration::from_secs(3600)));
    let conn = Arc::new(DiffusionConnector::new(engine, Some(store), cfg));
    let models = Arc::new(models);
    // SIGTERM: drain (nothing new; denoise jobs yield and move), then exit.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| anyhow::anyhow!("SIGTERM handler: {e}"))?;
    let (mut stage, mut switched) = (stage, None);
    loop {
        let spec = mobility.spec((stage, slots.max(1)), ("localhost", &join.labels), switched);
        let (w, mut rx) =
            WorkerClient::join(orch.clone(), secret.as_ref(), spec, Duration::from_millis(500))
                .await?;
        join.joined.set(true);
        println!("@@JOINED {}", w.id());
        let w = Arc::new(w);
        let run = |a: Assignment| {
            let (w, models, conn, ck) = (w.clone(), models.clone(), conn.clone(), ck.clone());
            let span = a.span();
            let item = async move {
                if a.release_only {
                    release(&conn, &ck, &a).await;
                    let _ = w.released(&a).await;
                    return;
                }
                let m = &models[(a.request as usize) % models.len()];
                match run_item(&conn, &ck, &w, m, &a, (scale, every)).await {
                    Err(e) if lost(&e) => {
                        let _ = w.report_lost_input(&a, &e.to_string()).await;
                    }
                    Ok(Ran::Yielded) => {}
                    Ok(Ran::Done(out)) => {
                        let _ = w.report_with(&a, Ok::<_, String>(out)).await;
                    }
                    Err(e) => {
                        let _ = w.report_with(&a, Err::<Vec<u8>, _>(e)).await;
                    }
                }
            };
            tokio::spawn(tracing::Instrument::instrument(item, span));
        };
        let left = crate::switching::serve_pool(&w, &mut rx, &mut term, DRAIN, run)
            .await
            .map_err(|e| anyhow::anyhow!("{e} (orchestrator {orch:?})"))?;
        // Latents it published p2p are still to be read by decode: wait for them.
        let until = tokio::time::Instant::now() + Duration::from_secs(30);
        while conn.held() > 0 && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        match left {
            crate::switching::Left::Terminated => {
                println!("@@DRAINED {}", std::process::id());
                return Ok(());
            }
            crate::switching::Left::Switch(to) => {
                join.joined.set(false);
                drop(w);
                let cost = mobility.cost[to.index()];
                switched = Some(crate::switching::switch(stage, to, cost).await);
                stage = to;
            }
        }
    }
}

/// How long a worker's drain may take.
pub(super) const DRAIN: Duration = Duration::from_secs(120);

/// Whether a stage failed because an input payload is gone for good.
pub(super) fn lost(e: &HandlerError) -> bool {
    e.downcast_ref::<ConnectorError>().is_some_and(ConnectorError::is_payload_lost)
}

/// Releases every payload of an ended request, as the orchestrator asks.
pub(super) async fn release(c: &DiffusionConnector, ck: &Checkpoints, a: &Assignment) {
    for blob in &a.held {
        if CheckpointRef::is(blob) {
            if let Ok(r) = CheckpointRef::decode(blob) {
                if let Err(e) = ck.release(&r).await {
                    eprintln!("worker: request {}: releasing a checkpoint failed: {e}", a.request);
                }
            }
            continue;
        }
        for r in decode_refs(blob).unwrap_or_default() {
            if let Err(e) = release_payload(c, &r).await {
                eprintln!("worker: request {}: releasing a payload failed: {e}", a.request);
            }
        }
    }
}

/// Tries a release again while it fails, three more times within about a second: the store
/// node that holds the payload may be restarting (killed by `--chaos-store`), and a report that
/// no replica took leaves the payload in the store for good. A cluster store's release fails
/// only when no replica answered that it took the report (and one that is gone already counts
/// as released), so a try again counts no consumer twice on a node that answered.
async fn release_payload(c: &DiffusionConnector, r: &PayloadRef) -> Result<(), ConnectorError> {
    let mut pause = Duration::from_millis(100);
    for _ in 0..3 {
        match c.release(r).await {
            Ok(()) => return Ok(()),
            Err(e) => eprintln!("worker: releasing a payload failed, trying again: {e}"),
        }
        tokio::time::sleep(pause).await;
        pause *= 2;
    }
    c.release(r).await
}
