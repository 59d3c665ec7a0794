//! `tensorwire demo --processes`: the disaggregated run with every stage worker in its own OS
//! process over tcp. The parent runs an engine with a store node and the orchestrator service;
//! each worker (`tensorwire worker ... --store-engine --store`) has its own engine and connector,
//! consumes its inputs from the references the orchestrator passes along, simulates the stage
//! time, publishes its outputs (embeddings through the store, latents p2p in temporal chunks)
//! and checks every byte it receives. Decode workers report the time of their first decoded
//! chunk on stdout, which gives TTFF.
//!
//! Workers lose nothing when killed: a stage reads its inputs without reporting them consumed
//! (`consume_held`); the decode worker, whose assignment lists every payload of the request,
//! releases them all once its result is reported; a stage whose input died with its p2p
//! producer says so, and the orchestrator runs the producer stage again. The parent supervises
//! the worker processes (a killed one is restarted), and `--chaos SECS` kills random workers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tensorwire_core::Permissions;
use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::wire::codec::{Reader, Writer};
use tensorwire_diffusion::{
    Chunking, ConnectorConfig, ConnectorError, ConsumerHint, DiffusionConnector, LeasePolicy, Mode,
    PayloadKind, PayloadRef, StagePayload,
};
use tensorwire_orchestrator::sched::SchedConfig;
use tensorwire_orchestrator::service::{
    Assignment, OrchestratorService, ServiceConfig, SubmitClient, WorkerClient,
};
use tensorwire_orchestrator::{HandlerError, Priority, Stage};
use tensorwire_store::{RemoteStore, Store};

use crate::demo::{DemoArgs, Split, embed_meta, fill, latent_meta, store_node, tcp_engine};
use crate::profiles::Model;
use crate::report::Summary;
use crate::supervise::{Chaos, Slot, Supervisor};

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

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

/// The body of a payload-moving worker for one assignment.
async fn run_item(
    c: &DiffusionConnector,
    m: &Model,
    a: &Assignment,
    scale: f64,
) -> Result<Vec<u8>, HandlerError> {
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
            p.stored().await?;
            Ok(encode_refs(&[p.reference.clone()]))
        }
        Stage::Denoise => {
            let refs = decode_refs(&a.inputs)?;
            let emb = refs.first().ok_or("denoise without an embedding")?;
            let dst = Arc::new(c.engine().alloc(m.embed_bytes, Permissions::NONE).await?);
            c.consume_held(emb, dst.clone(), 0, Some(&embed))?.all().await?;
            if dst.to_vec(0, m.embed_bytes)? != fill(m.embed_bytes, a.request) {
                return Err(format!("request {}: embedding bytes differ", a.request).into());
            }
            sleep(m.denoise_ms()).await;
            let buf = Arc::new(c.engine().alloc(m.latent_bytes, Permissions::READ).await?);
            buf.write_bytes(0, &fill(m.latent_bytes, a.request + 1))?;
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
            Ok(encode_refs(&[p.reference.clone()]))
        }
        Stage::Decode => {
            let refs = decode_refs(&a.inputs)?;
            let lat = refs.first().ok_or("decode without a latent")?;
            let dst = Arc::new(c.engine().alloc(m.latent_bytes, Permissions::NONE).await?);
            let chunks = m.chunks().map_or(1, |(_, n)| n);
            let mut cons = c.consume_held(lat, dst.clone(), 0, Some(&latent))?;
            let mut first = true;
            while cons.next().await?.is_some() {
                sleep(m.decode_ms / f64::from(chunks)).await;
                if first {
                    println!("@@FIRST {} {}", a.request, now_us());
                    first = false;
                }
            }
            if dst.to_vec(0, m.latent_bytes)? != fill(m.latent_bytes, a.request + 1) {
                return Err(format!("request {}: latent bytes differ", a.request).into());
            }
            Ok(Vec::new())
        }
    }
}

/// A worker process that moves payloads (called from `tensorwire worker --store-engine ...`).
pub(crate) async fn payload_worker(
    stage: Stage,
    orch: SocketAddr,
    (store_engine, store_rpc): (SocketAddr, SocketAddr),
    secret: Option<ClusterSecret>,
    models: Vec<Model>,
    scale: f64,
    slots: u32,
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
    let conn = Arc::new(DiffusionConnector::new(engine, Some(store), cfg));
    let (w, mut rx) = WorkerClient::connect(
        orch,
        secret.as_ref(),
        stage,
        slots.max(1),
        "localhost",
        Duration::from_millis(500),
    )
    .await
    .map_err(|e| e.to_string())?;
    println!("@@JOINED {}", w.id());
    let (w, models) = (Arc::new(w), Arc::new(models));
    while let Some(a) = rx.recv().await {
        let (w, models, conn) = (w.clone(), models.clone(), conn.clone());
        tokio::spawn(async move {
            if a.release_only {
                return release(&conn, &a).await;
            }
            let m = &models[(a.request as usize) % models.len()];
            match run_item(&conn, m, &a, scale).await {
                Err(e) if lost(&e) => {
                    let _ = w.report_lost_input(&a, &e.to_string()).await;
                }
                Ok(out) => {
                    let _ = w.report_with(&a, Ok::<_, String>(out)).await;
                    if a.stage.next().is_none() {
                        release(&conn, &a).await;
                    }
                }
                Err(e) => {
                    let _ = w.report_with(&a, Err::<Vec<u8>, _>(e)).await;
                }
            }
        });
    }
    Err(format!("the orchestrator at {orch} closed the connection"))
}

/// Whether a stage failed because an input payload is gone for good.
fn lost(e: &HandlerError) -> bool {
    e.downcast_ref::<ConnectorError>().is_some_and(ConnectorError::is_payload_lost)
}

/// The last stage's worker releases every payload of its request once its result is in (and
/// any worker those of a failed request, when the orchestrator asks).
async fn release(c: &DiffusionConnector, a: &Assignment) {
    for blob in std::iter::once(&a.inputs).chain(&a.held) {
        for r in decode_refs(blob).unwrap_or_default() {
            if let Err(e) = c.release(&r).await {
                eprintln!("worker: request {}: releasing a payload failed: {e}", a.request);
            }
        }
    }
}

/// The disaggregated run with worker processes, supervised (and, with `--chaos`, killed at
/// random once every worker has joined).
pub(crate) async fn disaggregated(
    a: &DemoArgs,
    models: &[Model],
    split: Split,
) -> Result<Summary, String> {
    let (node_engine, store, node) = store_node().await?;
    // Under chaos a long denoise item may be killed a few times in a row: give it more tries
    // (each death counts as one, the same as a failure, so a request that kills every worker
    // it touches still ends).
    let attempts = if a.chaos.is_some() { 5 } else { 3 };
    let sched = SchedConfig {
        heartbeat_timeout: Duration::from_secs(10),
        max_attempts: attempts,
        ..SchedConfig::default()
    };
    let cfg = ServiceConfig { sched, ..ServiceConfig::default() };
    let orch = OrchestratorService::serve("127.0.0.1:0".parse().map_err(|_| "address")?, cfg)
        .await
        .map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<String>(4096);
    let names = models.iter().map(|m| m.name.clone()).collect::<Vec<_>>().join(",");
    let (orch_addr, store_engine, store_rpc) =
        (orch.addr().to_string(), node_engine.local_addr().to_string(), node.addr().to_string());
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
                orch_addr.clone(),
                "--store-engine".into(),
                store_engine.clone(),
                "--store".into(),
                store_rpc.clone(),
                "--models".into(),
                names.clone(),
                "--time-scale".into(),
                a.time_scale.to_string(),
            ];
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
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some(l)) if l.starts_with("JOINED") => joined += 1,
            Ok(Some(_)) => {}
            _ => return Err(format!("only {joined} of {workers} worker processes joined")),
        }
    }
    sup.unleash();
    let sub = SubmitClient::connect(orch.addr(), None).await.map_err(|e| e.to_string())?;
    let start = Instant::now();
    let t0 = now_us();
    let mut outs = Vec::new();
    for r in 0..a.requests {
        outs.push((r, sub.submit(r, Priority::Batch).await.map_err(|e| e.to_string())?));
    }
    // Each outcome is timed when it arrives, not when this loop gets to it.
    let waits: Vec<_> = outs
        .into_iter()
        .map(|(r, o)| {
            tokio::spawn(async move {
                match tokio::time::timeout(Duration::from_secs(600), o).await {
                    Ok(Ok(Ok(()))) => Ok((r, start.elapsed())),
                    Ok(Ok(Err(e))) => Err(e.to_string()),
                    _ => Err(format!("request {r}: no outcome")),
                }
            })
        })
        .collect();
    let mut e2e = Vec::new();
    let mut moved = 0u64;
    let mut lost = Vec::new();
    for w in waits {
        match w.await.map_err(|e| e.to_string())? {
            Ok((r, t)) => {
                e2e.push(t);
                let m = &models[(r as usize) % models.len()];
                moved += m.embed_bytes + m.latent_bytes;
            }
            Err(e) => lost.push(e),
        }
    }
    let elapsed = start.elapsed();
    let mut firsts: HashMap<u64, u64> = HashMap::new();
    while let Ok(Some(l)) = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await {
        let f: Vec<&str> = l.split_whitespace().collect();
        if let ["FIRST", r, us] = f[..] {
            if let (Ok(r), Ok(us)) = (r.parse::<u64>(), us.parse::<u64>()) {
                firsts.entry(r).or_insert(us);
            }
        }
    }
    let ttff = firsts.values().map(|&us| Duration::from_micros(us.saturating_sub(t0))).collect();
    // Releases follow results: give the last ones a moment to reach the store.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut left = store.stats().await.map_err(|e| e.to_string())?;
    while left.objects > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = store.stats().await.map_err(|e| e.to_string())?;
    }
    let report = sup.stop();
    let st = orch.stats().await.map_err(|e| e.to_string())?;
    let killed: u32 = report.killed.iter().map(|(_, n)| n).sum();
    if a.chaos.is_some() || killed > 0 || report.restarts > 0 {
        let by = report.killed.iter().fold(HashMap::<&str, u32>::new(), |mut m, (l, n)| {
            *m.entry(l.as_str()).or_default() += n;
            m
        });
        let by = ["encode", "denoise", "decode"]
            .iter()
            .map(|s| format!("{s} {}", by.get(s).copied().unwrap_or(0)))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "reliability: {killed} workers killed ({by}), {} restarted; requests completed {}, \
             lost {}, duplicated {}; items re-queued {}, stages re-run after a lost input {} \
             ({attempts} tries per stage); store objects left {}",
            report.restarts,
            e2e.len(),
            lost.len(),
            st.duplicated,
            st.sched.requeued,
            st.sched.reran,
            left.objects
        );
    }
    if let Some(first) = lost.first() {
        return Err(format!("{} of {} requests lost; first: {first}", lost.len(), a.requests));
    }
    if st.duplicated > 0 {
        return Err(format!("{} stage results were accepted twice", st.duplicated));
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
        store_left: left.objects,
        layout: format!("{}:{}:{} worker processes", split.encode, split.denoise, split.decode),
    })
}
