//! `tensorwire demo`: a disaggregated diffusion pipeline on this machine. Encode, denoise and
//! decode pools are in-process workers driven by the orchestrator; each pool has its own engine
//! (tcp on loopback) and connector, and a store node relays condition embeddings. Real bytes of
//! the profiled sizes move through the engine; stage compute is simulated by sleeping the
//! profiled service times scaled by `--time-scale`. Then the same requests run colocated (each
//! simulated GPU runs all three stages of a request) on the same number of GPUs.

pub(crate) mod pipeline;
pub(crate) mod procs;
pub(crate) mod shift;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use parking_lot::Mutex;
use tensorwire_core::{DType, Permissions, TensorMeta};
use tensorwire_diffusion::cache::{CacheKey, Sampler, Shape, StoreCache, cfg_key, embedding_key};
use tensorwire_diffusion::{
    Chunking, ConnectorConfig, ConsumerHint, DiffusionConnector, LeasePolicy, Mode, PayloadKind,
    PayloadRef, StagePayload,
};
use tensorwire_orchestrator::sched::{MaxFreeCredit, SchedConfig, Submit};
use tensorwire_orchestrator::{
    HandlerError, Orchestrator, Outcome, Priority, Stage, StageHandler, Work,
};
use tensorwire_store::{RemoteStore, Store};

use crate::demo::pipeline::{
    STORE_BYTES, Split, auto_split, embed_meta, fill, latent_meta, now_us, parse_split, store_node,
    tcp_engine,
};
use crate::demo::procs::{Cluster, ClusterArgs, Steps};
use crate::report::Summary;
use tensorwire_sim::profiles::{self, Model};

/// The request mix and the worker pools, shared by `demo` and `soak`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct MixArgs {
    /// Models in the request mix (names from the profiles), round robin (default: the demo
    /// scenario's; for soak wan2.1-t2v-1.3b-480p,flux.1-dev-1024,qwen-image-1328).
    #[arg(long, value_delimiter = ',')]
    pub(crate) models: Option<Vec<String>>,
    /// Profile file (default: the copy built into the binary).
    #[arg(long)]
    pub(crate) profiles: Option<PathBuf>,
    /// Simulated GPUs (workers), for both layouts.
    #[arg(long, default_value_t = 8)]
    pub(crate) gpus: u32,
    /// Disaggregated split E:N:M (encode:denoise:decode workers); default proportional to the
    /// mix's stage times, at least one each.
    #[arg(long)]
    pub(crate) split: Option<String>,
    /// Multiplies every profiled service time (0.05 runs 50 s of GPU work in 2.5 s).
    #[arg(long, default_value_t = 0.05)]
    pub(crate) time_scale: f64,
}

/// The mix when neither `--models` nor a scenario names one.
pub(crate) const DEFAULT_MIX: [&str; 3] =
    ["wan2.1-t2v-1.3b-480p", "flux.1-dev-1024", "qwen-image-1328"];

impl MixArgs {
    /// The models of the mix (`--models`, or `default`) and the split of `gpus` workers into
    /// pools (`--split`, or proportional to the stage times).
    pub(crate) fn resolve(&self, default: &[&str]) -> Result<(Vec<Model>, Split), String> {
        if self.time_scale.is_nan() || self.time_scale <= 0.0 || self.time_scale > 10.0 {
            return Err(format!("--time-scale {}: must be in (0, 10]", self.time_scale));
        }
        let all = profiles::load(self.profiles.as_deref())?;
        let names = self.names(default);
        let mix: Vec<Model> = profiles::pick(&all, &names)?.into_iter().cloned().collect();
        let split = self.split(&mix)?;
        Ok((mix, split))
    }

    /// The model names: `--models`, or `default`.
    pub(crate) fn names(&self, default: &[&str]) -> Vec<String> {
        self.models.clone().unwrap_or_else(|| default.iter().map(|s| s.to_string()).collect())
    }

    /// `--split`, or workers proportional to `mix`'s stage times.
    pub(crate) fn split(&self, mix: &[Model]) -> Result<Split, String> {
        match &self.split {
            Some(s) => parse_split(s, self.gpus),
            None => auto_split(&mix.iter().collect::<Vec<_>>(), self.gpus),
        }
    }
}

/// Demo settings.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DemoArgs {
    /// The mix and the pools.
    #[command(flatten)]
    pub(crate) mix: MixArgs,
    /// The cluster and workload: memory-bound (default), fits (colocated wins) or
    /// heterogeneous; `--models` replaces its mix. Or shift: elastic pools against fixed ones
    /// on worker processes while the mix shifts (its own mix, pools and time scale).
    #[arg(long, default_value = "memory-bound")]
    pub(crate) scenario: String,
    /// Requests.
    #[arg(long, default_value_t = 24)]
    pub(crate) requests: u64,
    /// Distinct prompts per model (requests reuse them round robin; a repeated prompt hits the
    /// embedding cache).
    #[arg(long, default_value_t = 6)]
    pub(crate) prompts: u64,
    /// Run every stage worker as its own OS process over tcp (payloads move between processes;
    /// no embedding cache).
    #[arg(long)]
    pub(crate) processes: bool,
    /// With --processes: kill a random worker process (SIGKILL) about every SECS seconds
    /// (uniformly 0.5-1.5x) once all have joined; the supervisor restarts it. The run then
    /// reports requests completed, lost and duplicated, and store objects left.
    #[arg(long, value_name = "SECS")]
    pub(crate) chaos: Option<f64>,
    /// Seed of the chaos kills.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// With --processes: denoise saves a step checkpoint to the store every N steps (0: never),
    /// and a job whose worker was killed resumes from its last one.
    #[arg(long, default_value_t = 10)]
    pub(crate) checkpoint_every: u32,
    /// With --processes, --metrics-listen: the orchestrator's process serves its metrics and
    /// lists every worker's (each on a free loopback port) at /sd; `tensorwire top --connect
    /// ADDR` shows the cluster.
    #[command(flatten)]
    pub(crate) metrics: crate::observe::MetricsArgs,
}

struct Req {
    model: usize,
    prompt: u64,
}

fn scaled(ms: f64, scale: f64) -> Duration {
    Duration::from_secs_f64((ms * scale / 1000.0).max(0.0))
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

struct Ctx {
    models: Vec<Model>,
    reqs: Vec<Req>,
    scale: f64,
    enc: DiffusionConnector,
    den: DiffusionConnector,
    dec: DiffusionConnector,
    emb: Mutex<HashMap<u64, PayloadRef>>,
    lat: Mutex<HashMap<u64, PayloadRef>>,
    /// The condition-embedding cache (the library's, over the store node).
    cache: StoreCache,
    /// What this run put in it (removed at the end: the store must end empty).
    cached: Mutex<std::collections::HashSet<CacheKey>>,
    /// The store the encoder writes to.
    enc_store: Arc<dyn Store>,
    /// CFG sharing: the unconditional branch's features, shared by the requests with the same
    /// negative prompt (the library's cache, over the store node, through denoise's engine).
    cfg: StoreCache,
    /// What this run put in it, and the store it is in (emptied at the end).
    cfg_keys: Mutex<std::collections::HashSet<CacheKey>>,
    den_store: Arc<dyn Store>,
    submitted: Instant,
    ttff: Mutex<Vec<Duration>>,
    e2e: Mutex<Vec<Duration>>,
    moved: AtomicU64,
    handoff: Mutex<Duration>,
    bars: [ProgressBar; 3],
}

async fn encode(c: Arc<Ctx>, w: Work) -> Result<(), HandlerError> {
    let r = &c.reqs[w.request as usize];
    let m = &c.models[r.model];
    // The cache key of this prompt's embedding (the demo's prompts are numbered).
    let key = embedding_key(&m.name, "1", &format!("prompt {}", r.prompt), false, &[]);
    let meta = embed_meta(m);
    if !c.cache.contains(&key).await {
        tokio::time::sleep(scaled(m.encode_ms, c.scale)).await;
        let buf = c.enc.engine().alloc(m.embed_bytes, Permissions::NONE).await?;
        buf.write_bytes(0, &fill(m.embed_bytes, r.prompt))?;
        // Written once (a concurrent encode of the same prompt finds it there), before denoise
        // is told where it is.
        if !c.cache.put_from(&key, &meta, &buf.slice(0, m.embed_bytes)?).await
            && !c.enc_store.exists(&key.store_key("emb")).await?
        {
            return Err(format!("request {}: the embedding could not be cached", w.request).into());
        }
        c.cached.lock().insert(key);
    }
    let reference = c.cache.reference(&key, w.request, PayloadKind::ConditionEmbedding, meta);
    c.emb.lock().insert(w.request, reference);
    c.bars[0].inc(1);
    Ok(())
}

async fn denoise(c: Arc<Ctx>, w: Work) -> Result<(), HandlerError> {
    let r = &c.reqs[w.request as usize];
    let m = &c.models[r.model];
    let emb = c.emb.lock().get(&w.request).cloned().ok_or("no embedding")?;
    let dst = Arc::new(c.den.engine().alloc(m.embed_bytes, Permissions::NONE).await?);
    let t = Instant::now();
    c.den.consume(&emb, dst, 0, Some(&embed_meta(m)))?.all().await?;
    *c.handoff.lock() += t.elapsed();
    c.moved.fetch_add(m.embed_bytes, Ordering::Relaxed);
    cfg_features(&c, r.model).await?;
    tokio::time::sleep(scaled(m.denoise_ms(), c.scale)).await;
    let buf = Arc::new(c.den.engine().alloc(m.latent_bytes, Permissions::READ).await?);
    buf.write_bytes(0, &fill(m.latent_bytes, w.request))?;
    let mut p = c.den.publish(
        StagePayload {
            request: w.request,
            kind: PayloadKind::Latent,
            region: buf,
            offset: 0,
            meta: latent_meta(m),
            chunking: m.chunks().map(|(dim, count)| Chunking { dim, count }),
            lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
        },
        Some(ConsumerHint { credit: 1 }),
    )?;
    p.mark_all_ready()?;
    c.lat.lock().insert(w.request, p.reference.clone());
    c.bars[1].inc(1);
    Ok(())
}

/// Bytes of the demo's stand-in for a model's CFG features.
const CFG_BYTES: u64 = 256 << 10;

/// Looks up the unconditional branch's features for `model`'s negative prompt (every request
/// here has the same one, the empty prompt) and checks their bytes; on a miss, makes them and
/// shares them. Only the lookup and the bytes are real: no time is modeled for the branch. A
/// model without CFG has no unconditional branch.
async fn cfg_features(c: &Ctx, model: usize) -> Result<(), HandlerError> {
    let m = &c.models[model];
    if !m.cfg {
        return Ok(());
    }
    let negative = embedding_key(&m.name, "1", "", true, &[]);
    let shape = Shape { width: 0, height: 0, frames: 0 };
    let key = cfg_key(&m.name, &negative, 0, shape, Sampler { name: "euler", state: &[] });
    let want = fill(CFG_BYTES, 0x5a + model as u64);
    match c.cfg.get(&key).await {
        Some((_, got)) if got == want => Ok(()),
        Some(_) => Err(format!("{}: shared CFG features differ", m.name).into()),
        None => {
            let buf = c.den.engine().alloc(CFG_BYTES, Permissions::NONE).await?;
            buf.write_bytes(0, &want)?;
            let meta = TensorMeta::contiguous(DType::U8, &[CFG_BYTES]);
            if c.cfg.put_from(&key, &meta, &buf.slice(0, CFG_BYTES)?).await {
                c.cfg_keys.lock().insert(key);
            }
            Ok(())
        }
    }
}

async fn decode(c: Arc<Ctx>, w: Work) -> Result<(), HandlerError> {
    let r = &c.reqs[w.request as usize];
    let m = &c.models[r.model];
    let lat = c.lat.lock().get(&w.request).cloned().ok_or("no latent")?;
    let dst = Arc::new(c.dec.engine().alloc(m.latent_bytes, Permissions::NONE).await?);
    let chunks = m.chunks().map_or(1, |(_, n)| n);
    let t = Instant::now();
    let mut cons = c.dec.consume(&lat, dst.clone(), 0, Some(&latent_meta(m)))?;
    // Chunks land in the background (timed on arrival) while earlier ones are decoded.
    let (tx, mut rx) = tokio::sync::mpsc::channel(chunks as usize + 1);
    let drain = tokio::spawn(async move {
        while let Some(v) = cons.next().await? {
            if tx.send((v, t.elapsed())).await.is_err() {
                break;
            }
        }
        Ok::<(), tensorwire_diffusion::ConnectorError>(())
    });
    let mut first = true;
    let mut landed = Duration::ZERO;
    while let Some((_view, at)) = rx.recv().await {
        landed = at;
        tokio::time::sleep(scaled(m.decode_ms / f64::from(chunks), c.scale)).await; // decode this chunk
        if first {
            c.ttff.lock().push(c.submitted.elapsed());
            first = false;
        }
    }
    drain.await??;
    *c.handoff.lock() += landed;

    c.moved.fetch_add(m.latent_bytes, Ordering::Relaxed);
    let want = fill(m.latent_bytes, w.request);
    if dst.to_vec(0, m.latent_bytes)? != want {
        return Err(format!("request {}: latent bytes differ", w.request).into());
    }
    c.e2e.lock().push(c.submitted.elapsed());
    c.bars[2].inc(1);
    Ok(())
}

fn bars(n: u64, label: &str) -> (MultiProgress, [ProgressBar; 3]) {
    let mp = MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(10));
    let style =
        ProgressStyle::with_template("{prefix:>22} {bar:40.cyan/blue} {pos:>3}/{len:3} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
    let mk = |name: &str| {
        let b = mp.add(ProgressBar::new(n));
        b.set_style(style.clone());
        b.set_prefix(format!("{label} {name}"));
        b
    };
    let b = [mk("encode"), mk("denoise"), mk("decode")];
    (mp, b)
}

/// The disaggregated run.
async fn disaggregated(
    models: &[Model],
    reqs: Vec<Req>,
    split: Split,
    scale: f64,
) -> Result<Summary, String> {
    let (node_engine, store, node) = store_node(STORE_BYTES).await?;
    let mut conns = Vec::new();
    let mut stores = Vec::new();
    for mode in [Mode::Store, Mode::Auto, Mode::Auto] {
        let e = tcp_engine(None).await?;
        let s: Arc<dyn Store> = Arc::new(
            RemoteStore::connect(&e, node_engine.local_addr(), node.addr()).await.map_err(err)?,
        );
        let cfg = ConnectorConfig { mode, checksum: false, wait_timeout: Duration::from_secs(30) };
        stores.push(s.clone());
        conns.push(DiffusionConnector::new(e, Some(s), cfg));
    }
    let den_store = stores[1].clone();
    let enc_store = stores.swap_remove(0);
    let (dec, den, enc) = (
        conns.pop().ok_or("connector")?,
        conns.pop().ok_or("connector")?,
        conns.pop().ok_or("connector")?,
    );
    let n = reqs.len() as u64;
    let (_mp, bars) = bars(n, "disaggregated");
    let ctx = Arc::new(Ctx {
        models: models.to_vec(),
        reqs,
        scale,
        enc,
        den,
        dec,
        emb: Mutex::default(),
        lat: Mutex::default(),
        cache: StoreCache::embeddings(enc_store.clone(), Duration::from_secs(3600)),
        cached: Mutex::default(),
        enc_store,
        cfg: StoreCache::cfg(den_store.clone(), Duration::from_secs(600), 64 << 20),
        cfg_keys: Mutex::default(),
        den_store,
        submitted: Instant::now(),
        ttff: Mutex::default(),
        e2e: Mutex::default(),
        moved: AtomicU64::new(0),
        handoff: Mutex::default(),
        bars,
    });
    let orch = Orchestrator::start(
        SchedConfig { heartbeat_timeout: Duration::from_secs(3600), ..SchedConfig::default() },
        Box::new(MaxFreeCredit),
    );
    for (stage, count) in [
        (Stage::Encode, split.encode),
        (Stage::Denoise, split.denoise),
        (Stage::Decode, split.decode),
    ] {
        for _ in 0..count {
            let c = ctx.clone();
            let h: Arc<dyn StageHandler> = match stage {
                Stage::Encode => Arc::new(move |w| encode(c.clone(), w)),
                Stage::Denoise => Arc::new(move |w| denoise(c.clone(), w)),
                Stage::Decode => Arc::new(move |w| decode(c.clone(), w)),
            };
            orch.add_worker(stage, 1, "localhost", h).await.map_err(err)?;
        }
    }
    let start = Instant::now();
    let mut waits = Vec::new();
    for r in 0..n {
        let s = Submit::new(r, Priority::Batch);
        waits.push(orch.submit(s).await.map_err(err)?);
    }
    for w in waits {
        match w.await.map_err(|_| "orchestrator stopped")? {
            Outcome::Completed { .. } => {}
            Outcome::Failed { request, reason } => {
                return Err(format!("request {request} failed: {reason}"));
            }
        }
    }
    let elapsed = start.elapsed();
    let st = orch.stats().await.map_err(err)?;
    let slowest = orch.slowest().await.map_err(err)?.map(|t| t.render());
    for b in &ctx.bars {
        b.finish();
    }
    // Counted by the engines: every byte the consumers claim, read from the producers.
    let engine_bytes: u64 =
        [&ctx.den, &ctx.dec].iter().map(|c| c.engine().stats().bytes_read).sum::<u64>()
            + [&ctx.enc].iter().map(|c| c.engine().stats().bytes_written).sum::<u64>();
    // Drop the embedding cache; the store must end empty.
    let keys: Vec<CacheKey> = ctx.cached.lock().drain().collect();
    for key in keys {
        ctx.enc_store.remove(&key.store_key("emb")).await.map_err(err)?;
    }
    let keys: Vec<CacheKey> = ctx.cfg_keys.lock().drain().collect();
    for key in keys {
        ctx.den_store.remove(&key.store_key("cfg")).await.map_err(err)?;
    }
    let left = store.stats().await.map_err(err)?;
    let moved = ctx.moved.load(Ordering::Relaxed);
    let handoff = *ctx.handoff.lock();
    let busy: [f64; 3] = std::array::from_fn(|i| st.busy[i].as_secs_f64());
    let workers = [split.encode, split.denoise, split.decode];
    Ok(Summary {
        slowest,
        requests: n,
        elapsed,
        ttff: std::mem::take(&mut *ctx.ttff.lock()),
        e2e: std::mem::take(&mut *ctx.e2e.lock()),
        utilisation: Some(std::array::from_fn(|i| {
            busy[i] / (elapsed.as_secs_f64() * f64::from(workers[i]))
        })),
        moved,
        engine_bytes: Some(engine_bytes),
        handoff_gbps: if handoff.is_zero() {
            0.0
        } else {
            moved as f64 / handoff.as_secs_f64() / 1e9
        },
        cache_hits: ctx.cache.stats().hits,
        cfg_hits: Some(ctx.cfg.stats().hits),
        store_left: left.objects,
        usd_per_hour: 0.0,
        time_scale: 1.0,
        differences: Vec::new(),
        layout: format!(
            "{}:{}:{} (encode:denoise:decode)",
            split.encode, split.denoise, split.decode
        ),
    })
}

/// The colocated run: each GPU runs all three stages of a request, one request at a time.
async fn colocated(models: &[Model], reqs: &[Req], gpus: u32, scale: f64) -> Summary {
    let n = reqs.len() as u64;
    let (_mp, bars) = bars(n, "colocated");
    let bars = Arc::new(bars);
    let sem = Arc::new(tokio::sync::Semaphore::new(gpus as usize));
    let cache: Arc<Mutex<std::collections::HashSet<(usize, u64)>>> = Arc::default();
    let (ttff, e2e) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let hits = Arc::new(AtomicU64::new(0));
    let busy = Arc::new(Mutex::new([0f64; 3]));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for r in reqs {
        let m = models[r.model].clone();
        let key = (r.model, r.prompt);
        let (sem, cache, ttff, e2e, hits, bars, busy) = (
            sem.clone(),
            cache.clone(),
            ttff.clone(),
            e2e.clone(),
            hits.clone(),
            bars.clone(),
            busy.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let Ok(_gpu) = sem.acquire().await else { return };
            let t = Instant::now();
            let hit = !cache.lock().insert(key);
            if hit {
                hits.fetch_add(1, Ordering::Relaxed);
            } else {
                tokio::time::sleep(scaled(m.encode_ms, scale)).await;
            }
            let t1 = Instant::now();
            bars[0].inc(1);
            tokio::time::sleep(scaled(m.denoise_ms(), scale)).await;
            let t2 = Instant::now();
            bars[1].inc(1);
            let chunks = m.chunks().map_or(1, |(_, n)| n);
            for i in 0..chunks {
                tokio::time::sleep(scaled(m.decode_ms / f64::from(chunks), scale)).await;
                if i == 0 {
                    ttff.lock().push(start.elapsed());
                }
            }
            let mut b = busy.lock();
            b[0] += (t1 - t).as_secs_f64();
            b[1] += (t2 - t1).as_secs_f64();
            b[2] += t2.elapsed().as_secs_f64();
            drop(b);
            bars[2].inc(1);
            e2e.lock().push(start.elapsed());
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = start.elapsed();
    for b in bars.iter() {
        b.finish();
    }
    let b = *busy.lock();
    let total = elapsed.as_secs_f64() * f64::from(gpus);
    Summary {
        requests: n,
        elapsed,
        ttff: std::mem::take(&mut *ttff.lock()),
        e2e: std::mem::take(&mut *e2e.lock()),
        utilisation: Some(std::array::from_fn(|i| b[i] / total)),
        moved: 0,
        engine_bytes: None,
        handoff_gbps: 0.0,
        cache_hits: hits.load(Ordering::Relaxed),
        cfg_hits: None,
        store_left: 0,
        usd_per_hour: 0.0,
        time_scale: 1.0,
        differences: Vec::new(),
        slowest: None,
        layout: format!("{gpus} GPUs, each runs encode+denoise+decode"),
    }
}

/// Runs the demo.
pub(crate) async fn run(a: DemoArgs) -> Result<(), String> {
    let (d, c) = compare(&a).await?;
    crate::report::print(&d, &c);
    crate::report::print_decided(&d, &c);
    if let Some(t) = &d.slowest {
        println!("\nslowest request, as the orchestrator saw it (disaggregated):\n{t}");
    }
    if d.store_left != 0 {
        return Err(format!("the store still holds {} objects after the run", d.store_left));
    }
    if let Some(counted) = d.engine_bytes.filter(|&b| b < d.moved) {
        return Err(format!(
            "the engines counted {counted} bytes, the pipeline claims {}",
            d.moved
        ));
    }
    Ok(())
}

/// Runs both layouts on the same requests.
pub(crate) async fn compare(a: &DemoArgs) -> Result<(Summary, Summary), String> {
    if let Some(c) = a.chaos {
        if !a.processes || !(0.05..=3600.0).contains(&c) {
            return Err(format!("--chaos {c}: needs --processes and 0.05..=3600 seconds"));
        }
    }
    if a.requests == 0 || a.requests > 10_000 {
        return Err(format!("--requests {}: must be in 1..=10000", a.requests));
    }
    let sc = crate::scenario::pick(&a.scenario)?;
    let (models, _) = a.mix.resolve(sc.models)?;
    let timed = crate::scenario::time(&sc, &models)?;
    let split = a.mix.split(&timed.disaggregated)?;
    let reqs = |n: u64| -> Vec<Req> {
        (0..n)
            .map(|i| Req { model: (i as usize) % models.len(), prompt: i % a.prompts.max(1) })
            .collect()
    };
    println!(
        "tensorwire demo: {} requests over {} on {} simulated GPUs; service times x{} (profiles: {})",
        a.requests,
        a.mix.names(sc.models).join(", "),
        a.mix.gpus,
        a.mix.time_scale,
        a.mix.profiles.as_ref().map_or("built-in".to_string(), |p| p.display().to_string())
    );
    println!("scenario {}: {}", sc.name, sc.about);
    let on = |s: &str, c: &str| format!("{s} on {c}");
    let (dm, cm) = (&timed.disaggregated, &timed.colocated);
    let (mut d, mut c) = if a.processes {
        // No prompt reuse: the worker processes keep no embedding cache, nor does colocated here.
        let unique: Vec<Req> = (0..a.requests)
            .map(|i| Req { model: (i as usize) % models.len(), prompt: i })
            .collect();
        // The worker processes read the pools' stage times from a profile file.
        let dir = std::env::temp_dir().join(format!("tensorwire-demo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(err)?;
        let file = dir.join("models.toml");
        std::fs::write(&file, profiles::to_toml(dm)?).map_err(err)?;
        let d = in_processes(a, dm, split, Some(file)).await;
        let _ = std::fs::remove_dir_all(&dir);
        (d?, colocated(cm, &unique, a.mix.gpus, a.mix.time_scale).await)
    } else {
        let d = disaggregated(dm, reqs(a.requests), split, a.mix.time_scale).await?;
        (d, colocated(cm, &reqs(a.requests), a.mix.gpus, a.mix.time_scale).await)
    };
    let pools = if sc.pools.iter().all(|p| *p == sc.pools[0]) {
        sc.pools[0].to_string()
    } else {
        format!("{} / {} / {}", sc.pools[0], sc.pools[1], sc.pools[2])
    };
    d.layout = on(&d.layout, &pools);
    c.layout = on(&c.layout, sc.colocated);
    let usd = |n: u32, p: f64| f64::from(n) * p;
    d.usd_per_hour = usd(split.encode, timed.usd.1[0])
        + usd(split.denoise, timed.usd.1[1])
        + usd(split.decode, timed.usd.1[2]);
    c.usd_per_hour = usd(a.mix.gpus, timed.usd.0);
    (d.time_scale, c.time_scale) = (a.mix.time_scale, a.mix.time_scale);
    d.differences = timed.differences;
    Ok((d, c))
}

/// The disaggregated run with worker processes, supervised (and, with `--chaos`, killed at
/// random once every worker has joined).
pub(crate) async fn in_processes(
    a: &DemoArgs,
    models: &[Model],
    split: Split,
    profiles: Option<std::path::PathBuf>,
) -> Result<Summary, String> {
    let ca = ClusterArgs {
        time_scale: a.mix.time_scale,
        profiles: profiles.or_else(|| a.mix.profiles.clone()),
        chaos: a.chaos,
        seed: a.seed,
        checkpoint_every: a.checkpoint_every,
        metrics: a.metrics.clone(),
        rebalance: None,
        store_bytes: STORE_BYTES,
    };
    let mut c = Cluster::start(&ca, models, split).await?;
    let start = Instant::now();
    let t0 = now_us();
    let (done, lost) = c.run(0..a.requests, start).await?;
    let elapsed = start.elapsed();
    let mut e2e = Vec::new();
    let mut moved = 0u64;
    for &(r, t) in &done {
        e2e.push(t);
        let m = &models[(r as usize) % models.len()];
        moved += m.embed_bytes + m.latent_bytes;
    }
    let mut firsts: HashMap<u64, u64> = HashMap::new();
    let mut steps = Steps::default();
    for l in c.drain_lines(Duration::from_millis(300)).await {
        let f: Vec<&str> = l.split_whitespace().collect();
        if let ["FIRST", r, us] = f[..] {
            if let (Ok(r), Ok(us)) = (r.parse::<u64>(), us.parse::<u64>()) {
                firsts.entry(r).or_insert(us);
            }
        }
        steps.count(&f);
    }
    if a.checkpoint_every > 0 && a.chaos.is_none() {
        let next = a.requests;
        let probe = c.preemption_probe(next, split.denoise, models).await?;
        // Past the ids the preemption probe used.
        let next = next + models.len() as u64 * (u64::from(split.denoise) + 2);
        let (moved, seen) = c.migration_probe(next, split.denoise, models).await?;
        for l in seen.into_iter().chain(c.drain_lines(Duration::from_millis(300)).await) {
            steps.count(&l.split_whitespace().collect::<Vec<_>>());
        }
        println!("{probe}");
        println!("{moved}");
    }
    if a.checkpoint_every > 0 {
        println!("{}", steps.line(a.checkpoint_every));
    }
    let slowest = match done.iter().max_by_key(|(_, t)| *t) {
        Some((r, _)) => c.timeline(*r).await,
        None => None,
    };
    let left = c.settled_store().await?;
    let report = c.stop().await?;
    let ttff = firsts.values().map(|&us| Duration::from_micros(us.saturating_sub(t0))).collect();
    if a.chaos.is_some() || report.supervisor.restarts > 0 {
        println!("{}", report.line(done.len(), lost.len(), left.objects));
    }
    if let Some(first) = lost.first() {
        return Err(format!("{} of {} requests lost; first: {first}", lost.len(), a.requests));
    }
    if report.orchestrator.duplicated > 0 {
        return Err(format!(
            "{} stage results were accepted twice",
            report.orchestrator.duplicated
        ));
    }
    Ok(Summary {
        requests: a.requests,
        elapsed,
        ttff,
        e2e,
        utilisation: None,
        moved,
        engine_bytes: None,
        handoff_gbps: 0.0,
        cache_hits: 0,
        cfg_hits: None,
        store_left: left.objects,
        usd_per_hour: 0.0,
        time_scale: 1.0,
        differences: Vec::new(),
        layout: format!("{}:{}:{} worker processes", split.encode, split.denoise, split.decode),
        slowest: slowest.map(|t| t.render()),
    })
}
