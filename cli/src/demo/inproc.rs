//! The demo's in-process run: encode, denoise and decode pools of workers in this process,
//! driven by the orchestrator, each pool with its own engine (tcp on loopback) and connector, a
//! store node relaying condition embeddings and caching them; and the same requests colocated.

use std::collections::HashMap;
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
    STORE_BYTES, Split, embed_meta, fill, latent_meta, store_node, tcp_engine,
};
use crate::report::Summary;
use tensorwire_sim::profiles::Model;

/// The request mix and the worker pools, shared by `demo` and `soak`.
/// One request of the demo: which model of the mix, which prompt (requests with the same prompt
/// share its embedding through the cache).
pub(crate) struct Req {
    pub(crate) model: usize,
    pub(crate) prompt: u64,
}

fn scaled(ms: f64, scale: f64) -> Duration {
    Duration::from_secs_f64((ms * scale / 1000.0).max(0.0))
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
            return Err(anyhow::anyhow!(
                "request {}: the embedding could not be cached",
                w.request
            )
            .into());
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
    let emb =
        c.emb.lock().get(&w.request).cloned().ok_or_else(|| anyhow::Error::msg("no embedding"))?;
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
        Some(_) => Err(anyhow::anyhow!("{}: shared CFG features differ", m.name).into()),
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
    let lat =
        c.lat.lock().get(&w.request).cloned().ok_or_else(|| anyhow::Error::msg("no latent"))?;
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
        return Err(anyhow::anyhow!("request {}: latent bytes differ", w.request).into());
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
pub(crate) async fn disaggregated(
    models: &[Model],
    reqs: Vec<Req>,
    split: Split,
    scale: f64,
) -> anyhow::Result<Summary> {
    let (node_engine, store, node) = store_node(STORE_BYTES).await?;
    let mut conns = Vec::new();
    let mut stores = Vec::new();
    for mode in [Mode::Store, Mode::Auto, Mode::Auto] {
        let e = tcp_engine(None).await?;
        let s: Arc<dyn Store> =
            Arc::new(RemoteStore::connect(&e, node_engine.local_addr(), node.addr()).await?);
        let cfg = ConnectorConfig { mode, checksum: false, wait_timeout: Duration::from_secs(30) };
        stores.push(s.clone());
        conns.push(DiffusionConnector::new(e, Some(s), cfg));
    }
    let den_store = stores[1].clone();
    let enc_store = stores.swap_remove(0);
    let (dec, den, enc) = (
        conns.pop().ok_or_else(|| anyhow::Error::msg("connector"))?,
        conns.pop().ok_or_else(|| anyhow::Error::msg("connector"))?,
        conns.pop().ok_or_else(|| anyhow::Error::msg("connector"))?,
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
            orch.add_worker(stage, 1, "localhost", h).await?;
        }
    }
    let start = Instant::now();
    let mut waits = Vec::new();
    for r in 0..n {
        let s = Submit::new(r, Priority::Batch);
        waits.push(orch.submit(s).await?);
    }
    for w in waits {
        match w.await.map_err(|_| anyhow::Error::msg("orchestrator stopped"))? {
            Outcome::Completed { .. } => {}
            Outcome::Failed { request, reason } => {
                return Err(anyhow::anyhow!("request {request} failed: {reason}"));
            }
        }
    }
    let elapsed = start.elapsed();
    let st = orch.stats().await?;
    let slowest = orch.slowest().await?.map(|t| t.render());
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
        ctx.enc_store.remove(&key.store_key("emb")).await?;
    }
    let keys: Vec<CacheKey> = ctx.cfg_keys.lock().drain().collect();
    for key in keys {
        ctx.den_store.remove(&key.store_key("cfg")).await?;
    }
    let left = store.stats().await?;
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
pub(crate) async fn colocated(models: &[Model], reqs: &[Req], gpus: u32, scale: f64) -> Summary {
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
