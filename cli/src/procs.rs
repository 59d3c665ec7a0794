//! `tensorwire demo --processes`: the disaggregated run with every stage worker in its own OS
//! process over tcp. The parent runs an engine with a store node and the orchestrator service;
//! each worker (`tensorwire worker ... --store-engine --store`) has its own engine and connector,
//! consumes its inputs from the references the orchestrator passes along, simulates the stage
//! time, publishes its outputs (embeddings through the store, latents p2p in temporal chunks)
//! and checks every byte it receives. Decode workers report the time of their first decoded
//! chunk on stdout, which gives TTFF.
//!
//! Workers lose nothing when killed: a stage reads its inputs without reporting them consumed
//! (`consume_held`); once a request ends the orchestrator hands every payload of it to a worker
//! to release (another one, should that one die first); a stage whose input died with its p2p
//! producer says so, and the orchestrator runs the producer stage again. The parent supervises
//! the worker processes (a killed one is restarted), and `--chaos SECS` kills random workers.
//!
//! Denoise runs step by step and, with `--checkpoint-every N` (batch jobs; interactive ones with
//! `--checkpoint-every-interactive`), saves its latents to the store every N steps (keeping the
//! last two) and tells the orchestrator; a job whose worker died resumes on another from its
//! last checkpoint, checking the bytes it loads. Asked to yield (an interactive job waits, or
//! the worker drains), it saves a checkpoint at the next step and gives the job back. Each
//! saved, resumed or yielded step is an `@@` line on stdout. SIGTERM drains the worker (its
//! denoise jobs move to other workers from their checkpoints) and then it exits.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_core::Permissions;
use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::wire::codec::{Reader, Writer};
use tensorwire_diffusion::cache::{
    CheckpointOf, CheckpointRef, Checkpoints, Sampler, Shape, checkpoint_key, embedding_key,
};
use tensorwire_diffusion::{
    Chunking, ConnectorConfig, ConnectorError, ConsumerHint, DiffusionConnector, LeasePolicy, Mode,
    PayloadKind, PayloadRef, StagePayload,
};
use tensorwire_orchestrator::rebalance::RebalanceConfig;
use tensorwire_orchestrator::sched::SchedConfig;
use tensorwire_orchestrator::service::{
    Assignment, OrchestratorService, ServiceConfig, SubmitClient, WorkerClient,
};
use tensorwire_orchestrator::{HandlerError, Priority, Stage};
use tensorwire_store::{RemoteStore, Store};

use crate::pipeline::{Split, embed_meta, fill, latent_meta, now_us, store_node, tcp_engine};
use crate::profiles::Model;
use crate::supervise::{Chaos, Slot, Supervisor};

fn encode_refs(refs: &[PayloadRef]) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(refs.len() as u32);
    for r in refs {
        r.encode(&mut w);
    }
    w.finish()
}

fn decode_refs(b: &[u8]) -> tensorwire_core::Result<Vec<PayloadRef>> {
    let mut r = Reader::new(b, "stage outputs");
    let n = r.count(16, "payload refs")?;
    let v =
        (0..n).map(|_| PayloadRef::decode(&mut r)).collect::<tensorwire_core::Result<Vec<_>>>()?;
    r.finish()?;
    Ok(v)
}

/// How a stage run ended without an error.
enum Ran {
    /// With these outputs.
    Done(Vec<u8>),
    /// Given back at a step boundary (asked to yield).
    Yielded,
}

/// The latents of `request` after `step` of `steps` (a deterministic trajectory that ends in
/// the bytes decode checks).
fn trajectory(m: &Model, request: u64, step: u32) -> Vec<u8> {
    fill(m.latent_bytes, request + 1 + 7 * u64::from(m.steps.saturating_sub(step)))
}

/// Step checkpoints of one denoise job in the store.
struct Stepper<'a> {
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
async fn run_item(
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
            let emb = refs.first().ok_or("denoise without an embedding")?;
            let dst = Arc::new(c.engine().alloc(m.embed_bytes, Permissions::NONE).await?);
            let t = tokio::time::Instant::now();
            c.consume_held(emb, dst.clone(), 0, Some(&embed))?.all().await?;
            w.handoff(a, m.embed_bytes, t.elapsed()).await?;
            if dst.to_vec(0, m.embed_bytes)? != fill(m.embed_bytes, a.request) {
                return Err(format!("request {}: embedding bytes differ", a.request).into());
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
            let lat = refs.first().ok_or("decode without a latent")?;
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
                return Err(format!("request {}: latent bytes differ", a.request).into());
            }
            Ok(Ran::Done(Vec::new()))
        }
    }
}

/// A worker process that moves payloads (called from `tensorwire worker --store-engine ...`).
/// With `--can`, an orchestrator with `--rebalance` may move it to another pool: it drains,
/// waits for the latents it published to be read, pays the switch and joins that pool.
pub(crate) async fn payload_worker(
    (stage, slots): (Stage, u32),
    orch: tensorwire_orchestrator::service::Target,
    (store_engine, store_rpc): (SocketAddr, SocketAddr),
    secret: Option<ClusterSecret>,
    (models, mobility): (Vec<Model>, crate::switching::Mobility),
    (scale, every): (f64, [u32; 2]),
    join: &crate::observe::Joining,
) -> Result<(), String> {
    let engine = tcp_engine(secret.clone()).await?;
    let store: Arc<dyn Store> = Arc::new(
        RemoteStore::connect(&engine, store_engine, store_rpc).await.map_err(|e| e.to_string())?,
    );
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
        .map_err(|e| format!("SIGTERM handler: {e}"))?;
    let (mut stage, mut switched) = (stage, None);
    loop {
        let spec = mobility.spec((stage, slots.max(1)), ("localhost", &join.labels), switched);
        let (w, mut rx) =
            WorkerClient::join(orch.clone(), secret.as_ref(), spec, Duration::from_millis(500))
                .await
                .map_err(|e| e.to_string())?;
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
            .map_err(|e| format!("{e} (orchestrator {orch:?})"))?;
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

/// An outcome to wait for: the request, when it was submitted (from the run's start), and the
/// service's answer to come.
type Pending = (u64, Duration, tokio::sync::oneshot::Receiver<tensorwire_orchestrator::Result<()>>);

/// Waits for every outcome, each timed when it arrives (not when this loop gets to it); returns
/// (request, submitted, ended) for the completed ones, from `start`, and a line per lost one.
async fn outcomes(
    outs: Vec<Pending>,
    start: Instant,
) -> Result<(Vec<(u64, Duration, Duration)>, Vec<String>), String> {
    let waits: Vec<_> = outs
        .into_iter()
        .map(|(r, sent, o)| {
            tokio::spawn(async move {
                match tokio::time::timeout(Duration::from_secs(600), o).await {
                    Ok(Ok(Ok(()))) => Ok((r, sent, start.elapsed())),
                    Ok(Ok(Err(e))) => Err(e.to_string()),
                    _ => Err(format!("request {r}: no outcome")),
                }
            })
        })
        .collect();
    let (mut done, mut lost) = (Vec::new(), Vec::new());
    for w in waits {
        match w.await.map_err(|e| e.to_string())? {
            Ok(d) => done.push(d),
            Err(e) => lost.push(e),
        }
    }
    Ok((done, lost))
}

/// How long a worker's drain may take.
const DRAIN: Duration = Duration::from_secs(120);

/// Whether a stage failed because an input payload is gone for good.
fn lost(e: &HandlerError) -> bool {
    e.downcast_ref::<ConnectorError>().is_some_and(ConnectorError::is_payload_lost)
}

/// Releases every payload of an ended request, as the orchestrator asks.
async fn release(c: &DiffusionConnector, ck: &Checkpoints, a: &Assignment) {
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
            if let Err(e) = c.release(&r).await {
                eprintln!("worker: request {}: releasing a payload failed: {e}", a.request);
            }
        }
    }
}

/// What a cluster of worker processes needs to know.
#[derive(Debug, Clone)]
pub(crate) struct ClusterArgs {
    /// Stage time multiplier.
    pub(crate) time_scale: f64,
    /// Profile file, if not the built-in one.
    pub(crate) profiles: Option<std::path::PathBuf>,
    /// Mean seconds between chaos kills.
    pub(crate) chaos: Option<f64>,
    /// Seed of the kills.
    pub(crate) seed: u64,
    /// Denoise saves a step checkpoint every N steps (0: never).
    pub(crate) checkpoint_every: u32,
    /// The orchestrator's process serves metrics here, and each worker on a loopback port.
    pub(crate) metrics: crate::observe::MetricsArgs,
    /// Elastic pools: the orchestrator's rebalancer, and every worker may serve every stage
    /// (each switch paying, on the time scale, the fixed time below plus the weights' load).
    pub(crate) rebalance: Option<(RebalanceConfig, crate::switching::SwitchCost)>,
    /// The store node's pool (every request in flight holds its embeddings there).
    pub(crate) store_bytes: u64,
}

/// A store node, the orchestrator service and supervised worker processes, with a submitter.
pub(crate) struct Cluster {
    _node_engine: tensorwire_core::Engine,
    store: Arc<tensorwire_store::EmbeddedStore>,
    _node: tensorwire_store::StoreNode,
    orch: OrchestratorService,
    sup: Supervisor,
    lines: tokio::sync::mpsc::Receiver<String>,
    sub: SubmitClient,
    attempts: u32,
    _endpoint: Option<tensorwire_observe::Endpoint>,
}

/// What a cluster did, once stopped.
pub(crate) struct ClusterReport {
    pub(crate) supervisor: crate::supervise::SupervisorReport,
    pub(crate) orchestrator: tensorwire_orchestrator::OrchestratorStats,
    pub(crate) attempts: u32,
}

impl Cluster {
    /// Starts everything and waits until every worker has joined; chaos (if any) starts then.
    pub(crate) async fn start(
        a: &ClusterArgs,
        models: &[Model],
        split: Split,
    ) -> Result<Cluster, String> {
        let (node_engine, store, node) = store_node(a.store_bytes).await?;
        // Under chaos a long denoise item may be killed a few times in a row: give it more
        // tries (each death counts as one, the same as a failure, so a request that kills
        // every worker it touches still ends).
        let attempts = if a.chaos.is_some() { 5 } else { 3 };
        let sched = SchedConfig {
            heartbeat_timeout: Duration::from_secs(10),
            max_attempts: attempts,
            ..SchedConfig::default()
        };
        let rebalance = a.rebalance.as_ref().map(|(r, _)| r.clone());
        let cfg = ServiceConfig { sched, rebalance, ..ServiceConfig::default() };
        let orch = OrchestratorService::serve("127.0.0.1:0".parse().map_err(|_| "address")?, cfg)
            .await
            .map_err(|e| e.to_string())?;
        let health = tensorwire_observe::Health::new();
        let endpoint = a.metrics.start("orchestrator", health.clone()).await?;
        let mut worker_metrics: Vec<String> = Vec::new();
        if endpoint.is_some() {
            worker_metrics = vec!["--metrics-listen".into(), "127.0.0.1:0".into()];
        }
        if let Some((_, cost)) = &a.rebalance {
            worker_metrics.extend([
                "--can".into(),
                "encode,denoise,decode".into(),
                "--switch-gbps".into(),
                cost.switch_gbps.to_string(),
                "--switch-s".into(),
                cost.switch_s.to_string(),
            ]);
        }
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let (tx, mut lines) = tokio::sync::mpsc::channel::<String>(4096);
        let names = models.iter().map(|m| m.name.clone()).collect::<Vec<_>>().join(",");
        let mut slots = Vec::new();
        for (role, n) in
            [("encode", split.encode), ("denoise", split.denoise), ("decode", split.decode)]
        {
            for _ in 0..n {
                let args = [
                    "worker".to_string(),
                    "--role".into(),
                    role.into(),
                    "--connect".into(),
                    orch.addr().to_string(),
                    "--store-engine".into(),
                    node_engine.local_addr().to_string(),
                    "--store".into(),
                    node.addr().to_string(),
                    "--models".into(),
                    names.clone(),
                    "--time-scale".into(),
                    a.time_scale.to_string(),
                    "--checkpoint-every".into(),
                    a.checkpoint_every.to_string(),
                ];
                let args: Vec<String> = args.into_iter().chain(worker_metrics.clone()).collect();
                let (exe, profiles) = (exe.clone(), a.profiles.clone());
                slots.push(Slot::new(role, move || {
                    let mut cmd = Command::new(&exe);
                    cmd.args(&args).stderr(Stdio::inherit());
                    if let Some(p) = &profiles {
                        cmd.arg("--profiles").arg(p);
                    }
                    cmd
                }));
            }
        }
        let workers = slots.len();
        let chaos = a.chaos.map(|s| Chaos { every: Duration::from_secs_f64(s), seed: a.seed });
        let sup = Supervisor::start(slots, tx, chaos);
        let mut joined = 0;
        while joined < workers {
            match tokio::time::timeout(Duration::from_secs(30), lines.recv()).await {
                Ok(Some(l)) if l.starts_with("JOINED") => joined += 1,
                Ok(Some(_)) => {}
                _ => return Err(format!("only {joined} of {workers} worker processes joined")),
            }
        }
        sup.unleash();
        let sub = SubmitClient::connect(orch.addr(), None).await.map_err(|e| e.to_string())?;
        let list = orch.metrics_targets_fn();
        health.targets(move || crate::observe::targets(list()));
        Ok(Cluster {
            _node_engine: node_engine,
            store,
            _node: node,
            orch,
            sup,
            lines,
            sub,
            attempts,
            _endpoint: endpoint,
        })
    }

    /// Submits `requests` at once and waits for each; returns the completed ones with their
    /// end-to-end time from `start`, and one line per request lost.
    pub(crate) async fn run(
        &self,
        requests: std::ops::Range<u64>,
        start: Instant,
    ) -> Result<(Vec<(u64, Duration)>, Vec<String>), String> {
        self.run_as(requests, Priority::Batch, start).await
    }

    /// Submits each request of `schedule` at its time after `start` (batch class) and waits
    /// for all; returns, for each completed one, when it was submitted and when it ended (from
    /// `start`), and one line per request lost.
    pub(crate) async fn run_timed(
        &self,
        schedule: &[(u64, Duration)],
        start: Instant,
    ) -> Result<(Vec<(u64, Duration, Duration)>, Vec<String>), String> {
        let mut outs = Vec::new();
        for &(r, at) in schedule {
            tokio::time::sleep_until((start + at).into()).await;
            let o = self.sub.submit(r, Priority::Batch).await.map_err(|e| e.to_string())?;
            outs.push((r, start.elapsed(), o));
        }
        outcomes(outs, start).await
    }

    /// [`Cluster::run`] with requests of class `p`.
    async fn run_as(
        &self,
        requests: impl IntoIterator<Item = u64>,
        p: Priority,
        start: Instant,
    ) -> Result<(Vec<(u64, Duration)>, Vec<String>), String> {
        let mut outs = Vec::new();
        for r in requests {
            outs.push((
                r,
                start.elapsed(),
                self.sub.submit(r, p).await.map_err(|e| e.to_string())?,
            ));
        }
        let (done, lost) = outcomes(outs, start).await?;
        Ok((done.into_iter().map(|(r, _, ended)| (r, ended)).collect(), lost))
    }

    /// The orchestrator's timeline of `request`, if it still has it.
    pub(crate) async fn timeline(
        &self,
        request: u64,
    ) -> Option<tensorwire_orchestrator::timeline::Timeline> {
        self.sub.timeline(request, Duration::from_secs(10)).await.ok().flatten()
    }

    /// The workers' `@@` lines that arrive within `quiet` of each other.
    pub(crate) async fn drain_lines(&mut self, quiet: Duration) -> Vec<String> {
        let mut v = Vec::new();
        while let Ok(Some(l)) = tokio::time::timeout(quiet, self.lines.recv()).await {
            v.push(l);
        }
        v
    }

    /// Preemption shown: `holders` batch requests of the model with the longest denoise (ids
    /// from `first` on) take every denoise worker, then one interactive request of the
    /// shortest arrives; it preempts a batch job, which yields at its next step and resumes
    /// from its checkpoint. Returns one line on what happened.
    pub(crate) async fn preemption_probe(
        &self,
        first: u64,
        holders: u32,
        models: &[Model],
    ) -> Result<String, String> {
        let before = self.orch.stats().await.map_err(|e| e.to_string())?.sched;
        let n = u64::from(holders);
        let (batch, (long, short)) = long_jobs(first, n, models);
        let len = models.len().max(1) as u64;
        let urgent = batch.last().map_or(first, |b| b + len) - long + short;
        let start = Instant::now();
        let held = self.run_as(batch, Priority::Batch, start);
        // Once every denoise worker runs a batch job, the interactive one arrives.
        let wait = async {
            let full = Instant::now() + Duration::from_secs(10);
            while Instant::now() < full {
                match self.orch.stats().await {
                    Ok(st) if st.running[Stage::Denoise.index()] >= holders as usize => break,
                    _ => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
            let t = Instant::now();
            let r = self.run_as([urgent], Priority::Interactive, t).await;
            (t.elapsed(), r)
        };
        let (held, (took, inter)) = tokio::join!(held, wait);
        let ((batch, lost), (_, lost2)) = (held?, inter?);
        if let Some(e) = lost.first().or(lost2.first()) {
            return Err(format!("preemption probe: {e}"));
        }
        let mut times: Vec<Duration> = batch.iter().map(|(_, t)| *t).collect();
        times.sort();
        let after = self.orch.stats().await.map_err(|e| e.to_string())?.sched;
        Ok(format!(
            "preemption: with {holders} batch jobs ({}) on the {holders} denoise workers, an \
             interactive request ({}) completed in {} ms (batch median {} ms); {} yield asks, {} \
             jobs yielded and resumed from their checkpoints",
            models[long as usize].name,
            models[short as usize].name,
            took.as_millis(),
            times.get(times.len() / 2).map_or(0, |t| t.as_millis()),
            after.preempt_asks - before.preempt_asks,
            after.yielded - before.yielded
        ))
    }

    /// Migration shown: `holders` batch jobs of the longest model (ids from `first` on) take
    /// every denoise worker; the worker running one of them gets SIGTERM, drains (its job yields
    /// at its next step and resumes on another worker from the checkpoint) and exits, and the
    /// supervisor starts a replacement. Returns one line, and the `@@` lines it read.
    pub(crate) async fn migration_probe(
        &mut self,
        first: u64,
        holders: u32,
        models: &[Model],
    ) -> Result<(String, Vec<String>), String> {
        let before = self.orch.stats().await.map_err(|e| e.to_string())?.sched;
        let (batch, _) = long_jobs(first, u64::from(holders), models);
        let mut outs = Vec::new();
        for &r in &batch {
            outs.push(self.sub.submit(r, Priority::Batch).await.map_err(|e| e.to_string())?);
        }
        let mut seen: Vec<String> = Vec::new();
        let words = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        // The first worker process to start one of them is the one scaled down.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut pid = None;
        while pid.is_none() && Instant::now() < deadline {
            let Ok(Some(l)) = tokio::time::timeout(POLL, self.lines.recv()).await else { continue };
            if let [w, r, p] = &words(&l)[..] {
                if w == "DENOISE" && r.parse().is_ok_and(|r| batch.contains(&r)) {
                    pid = Some(p.clone());
                }
            }
            seen.push(l);
        }
        let pid = pid.ok_or("migration probe: no denoise job started")?;
        // Let it run a few steps first.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t = Instant::now();
        let target: libc::pid_t =
            pid.parse().map_err(|_| format!("migration probe: a worker pid {pid:?}"))?;
        // SAFETY: kill(2) takes plain integers and touches no memory of ours; `target` is a
        // worker process this cluster supervises.
        if unsafe { libc::kill(target, libc::SIGTERM) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(format!("migration probe: cannot send SIGTERM to {pid}: {e}"));
        }
        let mut drained = None;
        while drained.is_none() && t.elapsed() < Duration::from_secs(120) {
            let Ok(Some(l)) = tokio::time::timeout(POLL, self.lines.recv()).await else { continue };
            if words(&l) == ["DRAINED", pid.as_str()] {
                drained = Some(t.elapsed());
            }
            seen.push(l);
        }
        let drained = drained.ok_or("migration probe: the worker did not drain")?;
        for (r, o) in batch.iter().zip(outs) {
            match tokio::time::timeout(Duration::from_secs(600), o).await {
                Ok(Ok(Ok(()))) => {}
                other => return Err(format!("migration probe: request {r}: {other:?}")),
            }
        }
        let after = self.orch.stats().await.map_err(|e| e.to_string())?.sched;
        Ok((
            format!(
                "migration: the denoise worker running a batch job got SIGTERM, drained in {} ms \
                 and exited; {} jobs yielded and moved on from their checkpoints; all {} \
                 requests completed",
                drained.as_millis(),
                after.yielded - before.yielded,
                batch.len()
            ),
            seen,
        ))
    }

    /// Store counters once the last releases have landed (bounded wait: releases follow
    /// results).
    pub(crate) async fn settled_store(&self) -> Result<tensorwire_store::StoreStats, String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let st = self.store.stats().await.map_err(|e| e.to_string())?;
            if st.objects == 0 || Instant::now() >= deadline {
                return Ok(st);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Process ids of the live workers.
    pub(crate) fn worker_pids(&self) -> Vec<u32> {
        self.sup.pids()
    }

    /// Stops the workers and says what happened.
    pub(crate) async fn stop(self) -> Result<ClusterReport, String> {
        let supervisor = self.sup.stop();
        let orchestrator = self.orch.stats().await.map_err(|e| e.to_string())?;
        Ok(ClusterReport { supervisor, orchestrator, attempts: self.attempts })
    }
}

impl ClusterReport {
    /// One line: kills per stage, restarts, the requests' fate and the store.
    pub(crate) fn line(&self, completed: usize, lost: usize, store_left: u64) -> String {
        let mut by = HashMap::<&str, u32>::new();
        for (l, n) in &self.supervisor.killed {
            *by.entry(l.as_str()).or_default() += n;
        }
        let killed: u32 = by.values().sum();
        let by = ["encode", "denoise", "decode"]
            .iter()
            .map(|s| format!("{s} {}", by.get(s).copied().unwrap_or(0)))
            .collect::<Vec<_>>()
            .join(", ");
        let st = &self.orchestrator;
        format!(
            "reliability: {killed} workers killed ({by}), {} restarted; requests completed \
             {completed}, lost {lost}, duplicated {}; items re-queued {}, stages re-run after a \
             lost input {} ({} tries per stage); store objects left {store_left}",
            self.supervisor.restarts,
            st.duplicated,
            st.sched.requeued,
            st.sched.reran,
            self.attempts
        )
    }
}

/// How often a probe looks at the workers' lines.
const POLL: Duration = Duration::from_millis(50);

/// `n` request ids from `first` on whose model (request r runs model r mod len) has the longest
/// denoise, and the indices of the longest and shortest models.
fn long_jobs(first: u64, n: u64, models: &[Model]) -> (Vec<u64>, (u64, u64)) {
    let len = models.len().max(1) as u64;
    let pick = |longer: bool| {
        (0..models.len())
            .reduce(|a, b| {
                let (x, y) = (models[b].denoise_ms(), models[a].denoise_ms());
                if x != y && (x > y) == longer { b } else { a }
            })
            .unwrap_or(0) as u64
    };
    let (long, short) = (pick(true), pick(false));
    let base = first.div_ceil(len) * len;
    ((0..n).map(|k| base + k * len + long).collect(), (long, short))
}

/// What the denoise workers said about their step checkpoints.
#[derive(Debug, Default)]
pub(crate) struct Steps {
    saved: u64,
    resumed: u64,
    /// Steps not run again thanks to the checkpoints resumed from.
    kept: u64,
    yielded: u64,
}

impl Steps {
    /// Counts one `@@` line (split in words).
    pub(crate) fn count(&mut self, f: &[&str]) {
        let step = |s: &str| s.parse::<u64>().unwrap_or(0);
        match f {
            ["CHECKPOINT", _, _] => self.saved += 1,
            ["RESUMED", _, s] => {
                (self.resumed, self.kept) = (self.resumed + 1, self.kept + step(s))
            }
            ["YIELDED", _, _] => self.yielded += 1,
            _ => {}
        }
    }

    /// One line of the report.
    pub(crate) fn line(&self, every: u32) -> String {
        format!(
            "step checkpoints (every {every} steps): {} saved, {} jobs resumed from one ({} steps \
             not run again), {} jobs yielded",
            self.saved, self.resumed, self.kept, self.yielded
        )
    }
}
