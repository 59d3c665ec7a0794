//! `tensorwire demo`: a disaggregated diffusion pipeline on this machine. Encode, denoise and
//! decode pools are in-process workers driven by the orchestrator; each pool has its own engine
//! (tcp on loopback) and connector, and a store node relays condition embeddings. Real bytes of
//! the profiled sizes move through the engine; stage compute is simulated by sleeping the
//! profiled service times scaled by `--time-scale`. Then the same requests run colocated (each
//! simulated GPU runs all three stages of a request) on the same number of GPUs.

pub(crate) mod inproc;
pub(crate) mod pipeline;
pub(crate) mod procs;
pub(crate) mod shift;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::demo::inproc::{Req, colocated, disaggregated};
use crate::demo::pipeline::{STORE_BYTES, Split, auto_split, now_us, parse_split};
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
    pub(crate) fn resolve(&self, default: &[&str]) -> anyhow::Result<(Vec<Model>, Split)> {
        if self.time_scale.is_nan() || self.time_scale <= 0.0 || self.time_scale > 10.0 {
            return Err(anyhow::anyhow!("--time-scale {}: must be in (0, 10]", self.time_scale));
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
    pub(crate) fn split(&self, mix: &[Model]) -> anyhow::Result<Split> {
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
    /// With --processes: the store (one node, or store node processes behind a cluster store,
    /// killed at random with --chaos-store).
    #[command(flatten)]
    pub(crate) store: procs::StoreArgs,
}

/// Runs the demo.
pub(crate) async fn run(a: DemoArgs) -> anyhow::Result<()> {
    let (d, c) = compare(&a).await?;
    crate::report::print(&d, &c);
    crate::report::print_decided(&d, &c);
    if let Some(t) = &d.slowest {
        println!("\nslowest request, as the orchestrator saw it (disaggregated):\n{t}");
    }
    if d.store_left != 0 {
        return Err(anyhow::anyhow!(
            "the store still holds {} objects after the run",
            d.store_left
        ));
    }
    if let Some(counted) = d.engine_bytes.filter(|&b| b < d.moved) {
        return Err(anyhow::anyhow!(
            "the engines counted {counted} bytes, the pipeline claims {}",
            d.moved
        ));
    }
    Ok(())
}

/// Runs both layouts on the same requests.
pub(crate) async fn compare(a: &DemoArgs) -> anyhow::Result<(Summary, Summary)> {
    if let Some(c) = a.chaos {
        if !a.processes || !(0.05..=3600.0).contains(&c) {
            return Err(anyhow::anyhow!("--chaos {c}: needs --processes and 0.05..=3600 seconds"));
        }
    }
    a.store.layout(a.seed, STORE_BYTES)?; // checked before anything starts
    if a.store.store_nodes > 0 && !a.processes {
        return Err(anyhow::anyhow!("--store-nodes: needs --processes"));
    }
    if a.requests == 0 || a.requests > 10_000 {
        return Err(anyhow::anyhow!("--requests {}: must be in 1..=10000", a.requests));
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
        std::fs::create_dir_all(&dir)?;
        let file = dir.join("models.toml");
        std::fs::write(&file, profiles::to_toml(dm)?)?;
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
) -> anyhow::Result<Summary> {
    let ca = ClusterArgs {
        time_scale: a.mix.time_scale,
        profiles: profiles.or_else(|| a.mix.profiles.clone()),
        chaos: a.chaos,
        seed: a.seed,
        checkpoint_every: a.checkpoint_every,
        metrics: a.metrics.clone(),
        rebalance: None,
        store: a.store.layout(a.seed, STORE_BYTES)?,
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
    if a.chaos.is_some() || a.store.chaos_store.is_some() || report.supervisor.restarts > 0 {
        println!("{}", report.line(done.len(), lost.len(), left.objects));
    }
    if let Some(l) = &report.store {
        println!("{l}");
    }
    if let Some(first) = lost.first() {
        return Err(anyhow::anyhow!(
            "{} of {} requests lost; first: {first}",
            lost.len(),
            a.requests
        ));
    }
    if report.orchestrator.duplicated > 0 {
        return Err(anyhow::anyhow!(
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
