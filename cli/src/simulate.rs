//! `tensorwire simulate`: capacity planning by discrete-event simulation with the orchestrator's
//! own scheduler (see [`crate::capacity`]). Modes:
//! - default: colocated serving against every `E:N:M` split on one GPU class (or `--split`);
//! - `--sweep`: the smallest decode pool meeting a TTFF target (benchmark (c));
//! - `--layout L` (repeatable): layouts with grouped stages and pools on GPU classes, against
//!   colocated serving on the same GPUs (benchmark (a)), with the mechanisms that decided;
//! - `--plan`: searches layouts within a budget of GPUs or dollars and prints the best few;
//! - `--calibrate`: the simulator against published results.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::demo::pipeline::parse_split;
use crate::plot::{Labelled, PALETTE, scatter};
use crate::report::percentile;
use tensorwire_sim::calibrate;
use tensorwire_sim::classes::{self, GpuClass};
use tensorwire_sim::engine::{self, Knobs, Load, Net, Outcome, Prepared, Reused};
use tensorwire_sim::layout::Layout;
use tensorwire_sim::plan::{self, Budget};
use tensorwire_sim::profiles;
use tensorwire_sim::workload::Mix;

/// Simulation settings.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SimArgs {
    /// Model to serve (a name from the profiles); see --mix for several.
    #[arg(long, default_value = "wan2.1-t2v-14b-480p")]
    pub(crate) model: String,
    /// A mix of models and classes: MODEL[=SHARE][:interactive|:batch],... (overrides --model).
    #[arg(long)]
    pub(crate) mix: Option<String>,
    /// Profile file (default: the copy built into the binary).
    #[arg(long)]
    pub(crate) profiles: Option<PathBuf>,
    /// GPU class file (default: the one built into the binary).
    #[arg(long)]
    pub(crate) classes: Option<PathBuf>,
    /// GPU class of every pool that names none.
    #[arg(long, default_value = "h100")]
    pub(crate) gpu: String,
    /// GPUs in the cluster (with --plan: the budget, all used).
    #[arg(long)]
    pub(crate) gpus: Option<u32>,
    /// Disaggregated split E:N:M; default: try every split and report the best.
    #[arg(long)]
    pub(crate) split: Option<String>,
    /// A layout to run, e.g. E@l40s:1|DV@h100:7 (repeatable); compared with colocated serving.
    #[arg(long)]
    pub(crate) layout: Vec<String>,
    /// Search layouts within the budget (--gpus and/or --budget-usd) and print the best.
    #[arg(long)]
    pub(crate) plan: bool,
    /// With --plan: write DIR/layouts.svg (capacity and p99 TTFF per layout).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Budget for --plan in US$ per hour.
    #[arg(long)]
    pub(crate) budget_usd: Option<f64>,
    /// Classes --plan may use, comma-separated (default: every class in the file).
    #[arg(long)]
    pub(crate) plan_classes: Option<String>,
    /// Run the published results (profiles/published.toml, or FILE) and compare.
    #[arg(long)]
    pub(crate) calibrate: bool,
    /// Published results for --calibrate.
    #[arg(long)]
    pub(crate) published: Option<PathBuf>,
    /// Requests to simulate.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) requests: u64,
    /// Arrival rate in requests per second (default: 90% of what colocated serving sustains).
    #[arg(long)]
    pub(crate) rate: Option<f64>,
    /// Link bandwidth between stages, GB/s.
    #[arg(long, default_value_t = 25.0)]
    pub(crate) bandwidth_gbps: f64,
    /// Latency per hop, ms.
    #[arg(long, default_value_t = 0.05)]
    pub(crate) latency_ms: f64,
    /// Routing policy: max-free, round-robin or affinity.
    #[arg(long, default_value = "max-free")]
    pub(crate) policy: String,
    /// TTFF target for SLO attainment and --sweep, ms.
    #[arg(long)]
    pub(crate) target_ttff_ms: Option<f64>,
    /// Find the smallest decode pool meeting --target-ttff-ms for the denoise pool of --denoise.
    #[arg(long)]
    pub(crate) sweep: bool,
    /// Denoise workers for --sweep (default: GPUs minus one encoder and one decoder).
    #[arg(long)]
    pub(crate) denoise: Option<u32>,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Share of the requests that are interactive (0..=1); the rest are batch.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) interactive: f64,
    /// Share of the requests whose condition embedding is cached (0..=1): encode is skipped.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) embedding_hit_rate: f64,
    /// Denoise saves a step checkpoint to the store every N steps (0: never).
    #[arg(long, default_value_t = 0)]
    pub(crate) checkpoint_every: u32,
    /// A batch request waiting this long is ordered as interactive (the starvation bound), in
    /// seconds; default: four times the mix's mean denoise time.
    #[arg(long)]
    pub(crate) aging_s: Option<f64>,
    /// Classifier-free guidance off (a CFG model's step runs one branch: about half the time).
    #[arg(long)]
    pub(crate) no_cfg: bool,
    /// Elastic pools: a rebalancer moves GPUs between the E, D and V pools during a shifting
    /// workload (--phases), compared with static splits on the same GPUs.
    #[arg(long)]
    pub(crate) elastic: bool,
    /// The shifting workload for --elastic: MIX@RATE:SECONDS;... (MIX as for --mix).
    #[arg(long)]
    pub(crate) phases: Option<String>,
    /// With --elastic: the rebalancer's settings.
    #[command(flatten)]
    pub(crate) rebalance: crate::switching::RebalanceArgs,
    /// With --elastic: what switching a GPU costs.
    #[command(flatten)]
    pub(crate) switch: crate::switching::SwitchCost,
}

/// GPUs when --gpus is not given.
const DEFAULT_GPUS: u32 = 8;

/// Everything a mode needs, loaded and checked once.
pub(crate) struct Ctx {
    pub(crate) a: SimArgs,
    pub(crate) mix: Mix,
    pub(crate) classes: Vec<GpuClass>,
    pub(crate) knobs: Knobs,
    pub(crate) target: Option<Duration>,
}

impl Ctx {
    pub(crate) fn gpus(&self) -> u32 {
        self.a.gpus.unwrap_or(DEFAULT_GPUS)
    }

    pub(crate) fn prepare(&self, l: &Layout) -> anyhow::Result<Prepared> {
        Ok(Prepared::new(l, &self.classes, &self.mix, self.knobs.cfg)?)
    }

    fn poisson(&self, p: &Prepared, rate: f64, preempt: bool) -> anyhow::Result<Outcome> {
        let k = Knobs { preempt, ..self.knobs.clone() };
        Ok(engine::simulate(p, &self.mix, &k, Load::Poisson { rate, requests: self.a.requests })?)
    }

    /// Capacity: requests per second with every request queued at once.
    fn capacity(&self, p: &Prepared) -> anyhow::Result<f64> {
        let requests = self.a.requests.min(5_000);
        Ok(engine::simulate(p, &self.mix, &self.knobs, Load::Saturated { requests })?.throughput)
    }

    /// Colocated serving on `n` GPUs of the default class.
    fn colocated(&self, n: u32) -> anyhow::Result<Layout> {
        Ok(Layout::parse(&format!("EDV:{n}"), &self.a.gpu)?)
    }
}

/// Runs the simulation.
pub(crate) fn run(a: SimArgs) -> anyhow::Result<()> {
    let (cx, all) = context(a)?;
    if cx.a.calibrate {
        return run_calibrate(&cx, &all);
    }
    if cx.a.plan {
        return run_plan(&cx);
    }
    if !cx.a.layout.is_empty() {
        return run_layouts(&cx);
    }
    run_splits(&cx)
}

/// Checks the arguments and loads what they name.
pub(crate) fn context(a: SimArgs) -> anyhow::Result<(Ctx, Vec<profiles::Model>)> {
    if a.requests == 0 || a.requests > 10_000_000 {
        return Err(anyhow::anyhow!("--requests {}: must be in 1..=10000000", a.requests));
    }
    if !(a.bandwidth_gbps > 0.0 && a.latency_ms >= 0.0) {
        return Err(anyhow::Error::msg("--bandwidth-gbps must be > 0 and --latency-ms >= 0"));
    }
    for (name, v) in
        [("--interactive", a.interactive), ("--embedding-hit-rate", a.embedding_hit_rate)]
    {
        if !(0.0..=1.0).contains(&v) {
            return Err(anyhow::anyhow!("{name} {v}: a share, 0 to 1"));
        }
    }
    if let Some(b) = a.budget_usd.filter(|b| b.is_nan() || *b <= 0.0) {
        return Err(anyhow::anyhow!("--budget-usd {b}: must be > 0"));
    }
    let all = profiles::load(a.profiles.as_deref())?;
    let classes = classes::load(a.classes.as_deref())?;
    classes::pick(&classes, &a.gpu)?;
    let mix = match &a.mix {
        Some(s) => Mix::parse(s, &all)?,
        None => Mix::single(profiles::pick(&all, std::slice::from_ref(&a.model))?[0].clone()),
    };
    engine::policy(&a.policy)?;
    let knobs = Knobs {
        policy: a.policy.clone(),
        interactive: a.interactive,
        embedding_hit_rate: a.embedding_hit_rate,
        checkpoint_every: a.checkpoint_every,
        aging: a.aging_s.map(Duration::from_secs_f64),
        preempt: true,
        cfg: !a.no_cfg,
        net: Net { bandwidth_gbps: a.bandwidth_gbps, latency_ms: a.latency_ms },
        seed: a.seed,
    };
    let target = a.target_ttff_ms.map(|x| Duration::from_secs_f64(x / 1e3));
    Ok((Ctx { a, mix, classes, knobs, target }, all))
}

/// The rate a run offers: --rate, or `share` of what `p` sustains by the analytic bound.
fn offered(cx: &Ctx, p: &Prepared, share: f64) -> anyhow::Result<f64> {
    let rate =
        cx.a.rate.unwrap_or_else(|| share * plan::bound(p, &cx.mix, cx.a.embedding_hit_rate).0);
    if rate.is_nan() || rate <= 0.0 || rate.is_infinite() {
        return Err(anyhow::anyhow!("--rate {rate}: must be > 0"));
    }
    Ok(rate)
}

/// Default mode and --sweep: colocated against `E:N:M` splits on the default class.
fn run_splits(cx: &Ctx) -> anyhow::Result<()> {
    let a = &cx.a;
    let gpus = cx.gpus();
    let colo = cx.prepare(&cx.colocated(gpus)?)?;
    let sweep_n = a.denoise.unwrap_or(gpus.saturating_sub(2).max(1));
    // Default load: 90% of what colocated serving sustains; for --sweep, 90% of what the
    // denoise pool sustains (the decode pool is what is being sized).
    let rate = if a.sweep { sweep_rate(cx, sweep_n)? } else { offered(cx, &colo, 0.9)? };
    println!(
        "tensorwire simulate: {} on {gpus} {}, {} requests at {rate:.4} req/s (Poisson), {} GB/s + {} ms per hop, policy {}",
        cx.mix.describe(),
        a.gpu,
        a.requests,
        a.bandwidth_gbps,
        a.latency_ms,
        a.policy
    );
    let c = cx.poisson(&colo, rate, true)?;
    show("colocated", &colo, &c, cx.target);
    if a.sweep {
        return sweep(cx, sweep_n, rate);
    }
    let splits = splits(a.split.as_deref(), gpus)?;
    let wall = Instant::now();
    let mut decisions = 0;
    let mut best: Option<(Prepared, Outcome)> = None;
    for s in splits {
        let p = cx.prepare(&Layout::parse(&s, &a.gpu)?)?;
        let r = cx.poisson(&p, rate, true)?;
        decisions += r.decisions;
        let key = |o: &Outcome| (o.throughput, -percentile(&o.ttff, 99.0).as_secs_f64());
        if best.as_ref().is_none_or(|(_, b)| key(&r) > key(b)) {
            best = Some((p, r));
        }
    }
    let (p, r) = best.ok_or_else(|| anyhow::Error::msg("no split to simulate"))?;
    show(&format!("disaggregated best {}", p.layout), &p, &r, cx.target);
    println!(
        "best disaggregated / colocated throughput: {:.3}x ({decisions} scheduler decisions in {:.2} s of wall time)",
        r.throughput / c.throughput.max(1e-12),
        wall.elapsed().as_secs_f64()
    );
    if a.interactive > 0.0 || a.embedding_hit_rate > 0.0 || a.checkpoint_every > 0 {
        println!("{}", reuse_line(&r.reuse, a.requests));
    }
    if a.interactive > 0.0 {
        let without = cx.poisson(&p, rate, false)?;
        let p99 = |v: &[Duration]| percentile(v, 99.0).as_secs_f64();
        println!(
            "interactive TTFF p99: {:.1} s with preemption, {:.1} s without ({:.2}x); all requests: p99 TTFF {:.1} s vs {:.1} s, throughput {:.4} vs {:.4} req/s",
            p99(&r.ttff_interactive),
            p99(&without.ttff_interactive),
            p99(&r.ttff_interactive) / p99(&without.ttff_interactive).max(1e-12),
            p99(&r.ttff),
            p99(&without.ttff),
            r.throughput,
            without.throughput
        );
    }
    Ok(())
}

/// The `E:N:M` splits to try on `gpus`: the one `--split` names, else every one.
pub(crate) fn splits(split: Option<&str>, gpus: u32) -> anyhow::Result<Vec<String>> {
    if let Some(s) = split {
        let sp = parse_split(s, gpus)?;
        return Ok(vec![format!("E:{}|D:{}|V:{}", sp.encode, sp.denoise, sp.decode)]);
    }
    let mut v = Vec::new();
    for e in 1..gpus {
        for m in 1..gpus {
            if e + m < gpus {
                v.push(format!("E:{e}|D:{}|V:{m}", gpus - e - m));
            }
        }
    }
    if v.is_empty() {
        return Err(anyhow::anyhow!("--gpus {gpus}: a disaggregated pipeline needs at least 3"));
    }
    Ok(v)
}

/// How a --sweep ended.
enum SweepEnd {
    /// This decode pool is the smallest that meets the target.
    Met(u32),
    /// More decoders stopped helping: the wait is in denoise (the p99 it stays at).
    Flat(Duration),
    /// None up to 64 decoders.
    None,
}

/// One step of a --sweep: the decode pool size, its fitted layout and its run.
type SweepRow = (u32, Prepared, Outcome);

/// Decode pools of 1, 2, ... for `n` denoise workers until p99 TTFF meets the target.
fn sweep_rows(
    cx: &Ctx,
    n: u32,
    rate: f64,
    target: Duration,
) -> anyhow::Result<(Vec<SweepRow>, SweepEnd)> {
    let mut rows = Vec::new();
    let mut last = f64::INFINITY;
    let mut flat = 0;
    for mm in 1..=64 {
        let p = cx.prepare(&Layout::parse(&format!("E:1|D:{n}|V:{mm}"), &cx.a.gpu)?)?;
        let r = cx.poisson(&p, rate, true)?;
        let p99 = percentile(&r.ttff, 99.0);
        rows.push((mm, p, r));
        if p99 <= target {
            return Ok((rows, SweepEnd::Met(mm)));
        }
        // Stop once more decoders no longer help: the wait is elsewhere (denoise).
        flat = if p99.as_secs_f64() >= last * 0.99 { flat + 1 } else { 0 };
        last = p99.as_secs_f64();
        if flat >= 3 {
            return Ok((rows, SweepEnd::Flat(p99)));
        }
    }
    Ok((rows, SweepEnd::None))
}

/// The load of a --sweep: --rate, or 90% of what `n` denoise workers sustain (the decode pool
/// is what is being sized).
fn sweep_rate(cx: &Ctx, n: u32) -> anyhow::Result<f64> {
    let den = cx.prepare(&Layout::parse(&format!("E:1|D:{n}|V:1"), &cx.a.gpu)?)?;
    let rate =
        cx.a.rate
            .unwrap_or_else(|| 0.9 * plan::pool_bounds(&den, &cx.mix, cx.a.embedding_hit_rate)[1]);
    if rate.is_nan() || rate <= 0.0 || rate.is_infinite() {
        return Err(anyhow::anyhow!("--rate {rate}: must be > 0"));
    }
    Ok(rate)
}

/// --sweep: the smallest decode pool with p99 TTFF within the target (benchmark (c)).
fn sweep(cx: &Ctx, n: u32, rate: f64) -> anyhow::Result<()> {
    let target = cx.target.ok_or_else(|| anyhow::Error::msg("--sweep needs --target-ttff-ms"))?;
    let (rows, end) = sweep_rows(cx, n, rate, target)?;
    for (mm, p, r) in &rows {
        show(&format!("1:{n}:{mm}"), p, r, Some(target));
    }
    let t = target.as_secs_f64();
    match end {
        SweepEnd::Met(mm) => {
            let (_, p, r) = &rows[rows.len() - 1];
            println!(
                "chosen N:M = {n}:{mm} (smallest decode pool with p99 TTFF <= {t:.1} s); {}",
                cost_line(p, r.throughput)
            );
            Ok(())
        }
        SweepEnd::Flat(p99) => Err(anyhow::anyhow!(
            "p99 TTFF stays at {:.1} s however many decoders: {n} denoise workers cannot meet {t:.1} s at {rate:.4} req/s (add denoise workers, or lower --rate)",
            p99.as_secs_f64()
        )),
        SweepEnd::None => Err(anyhow::anyhow!(
            "no decode pool up to 64 workers meets p99 TTFF <= {t:.1} s with {n} denoise workers"
        )),
    }
}

/// What `simulate --sweep` found, for a report.
pub(crate) struct SweepFigures {
    /// (decode workers, p99 TTFF in seconds) per step.
    pub(crate) points: Vec<(u32, f64)>,
    /// The chosen N:M (denoise, decode), if a pool met the target.
    pub(crate) chosen: Option<(u32, u32)>,
    /// The p99 TTFF target, seconds.
    pub(crate) target_s: f64,
    /// The offered rate, requests per second.
    pub(crate) rate: f64,
}

/// `simulate --sweep ARGS` for a report.
pub(crate) fn sweep_figures(args: &[&str]) -> anyhow::Result<SweepFigures> {
    let (cx, _) = context(parse_args(args)?)?;
    let target = cx.target.ok_or_else(|| anyhow::Error::msg("--sweep needs --target-ttff-ms"))?;
    let n = cx.a.denoise.unwrap_or(cx.gpus().saturating_sub(2).max(1));
    let rate = sweep_rate(&cx, n)?;
    let (rows, end) = sweep_rows(&cx, n, rate, target)?;
    let pts = rows.iter().map(|(m, _, r)| (*m, percentile(&r.ttff, 99.0).as_secs_f64())).collect();
    let chosen = match end {
        SweepEnd::Met(m) => Some((n, m)),
        _ => None,
    };
    Ok(SweepFigures { points: pts, chosen, target_s: target.as_secs_f64(), rate })
}

/// One layout measured: capacity (saturated) and the run under the offered load.
struct Measured {
    p: Prepared,
    capacity: f64,
    run: Outcome,
}

fn measure(cx: &Ctx, p: Prepared, rate: f64) -> anyhow::Result<Measured> {
    let capacity = cx.capacity(&p)?;
    let run = cx.poisson(&p, rate, true)?;
    Ok(Measured { p, capacity, run })
}

/// --layout: each layout and colocated serving on as many GPUs (benchmark (a)).
fn run_layouts(cx: &Ctx) -> anyhow::Result<()> {
    let mut layouts = Vec::new();
    for l in &cx.a.layout {
        layouts.push(Layout::parse(l, &cx.a.gpu)?);
    }
    let colo_layout = cx.colocated(cx.a.gpus.unwrap_or(layouts[0].gpus()))?;
    if !layouts.iter().any(Layout::colocated) {
        layouts.insert(0, colo_layout);
    }
    let mut fitted = Vec::new();
    for l in &layouts {
        match cx.prepare(l) {
            Ok(p) => fitted.push(p),
            Err(e) => println!("{l}: infeasible: {e}"),
        }
    }
    let first = fitted.first().ok_or_else(|| anyhow::Error::msg("no layout fits its GPUs"))?;
    let rate = offered(cx, first, 0.9)?;
    header(cx, rate);
    let mut rows = Vec::new();
    for p in fitted {
        rows.push(measure(cx, p, rate)?);
    }
    table(cx, &rows);
    compare(&rows);
    Ok(())
}

/// What --plan found: the layouts simulated, best first, and how the search went.
struct Planned {
    rows: Vec<Measured>,
    rate: f64,
    searched: usize,
    budget: Budget,
    infeasible: Vec<String>,
    wall: Duration,
}

/// The layout search and the simulation of its best candidates.
fn plan_rows(cx: &Ctx) -> anyhow::Result<Planned> {
    let a = &cx.a;
    let budget = Budget {
        gpus: a.gpus.or(if a.budget_usd.is_some() { None } else { Some(DEFAULT_GPUS) }),
        usd_per_hour: a.budget_usd,
    };
    let classes: Vec<GpuClass> = match &a.plan_classes {
        Some(list) => {
            let mut v = Vec::new();
            for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                v.push(classes::pick(&cx.classes, name)?.clone());
            }
            v
        }
        None => cx.classes.clone(),
    };
    if classes.is_empty() {
        return Err(anyhow::Error::msg("--plan-classes: no class named"));
    }
    let mut infeasible = Vec::new();
    let wall = Instant::now();
    let found = plan::search(
        &classes,
        &cx.mix,
        budget,
        cx.knobs.cfg,
        a.embedding_hit_rate,
        &mut infeasible,
    );
    // The best few distinct groupings-and-classes, and the best colocated layout.
    let shape = |x: &plan::Candidate| {
        x.prepared.layout.pools.iter().map(|p| (p.letters(), p.class.clone())).collect::<Vec<_>>()
    };
    let mut picked: Vec<plan::Candidate> = Vec::new();
    for c in &found {
        if picked.len() < PLAN_SHOWN && !picked.iter().any(|p| shape(p) == shape(c)) {
            picked.push(c.clone());
        }
    }
    if let Some(colo) = found.iter().find(|c| c.prepared.layout.colocated()) {
        if !picked.iter().any(|p| p.prepared.layout == colo.prepared.layout) {
            picked.push(colo.clone());
        }
    }
    if picked.is_empty() {
        let e = infeasible.first().map_or(String::new(), |e| format!(" (e.g. {e})"));
        return Err(anyhow::anyhow!("no layout fits the budget{e}"));
    }
    // Offered load: 70% of the least capacity shown, so that every row carries it.
    let least = picked.iter().map(|c| c.bound).fold(f64::INFINITY, f64::min);
    let rate = a.rate.unwrap_or(0.7 * least);
    let mut rows = Vec::new();
    for c in picked {
        rows.push(measure(cx, c.prepared, rate)?);
    }
    let per_dollar = budget.usd_per_hour.is_some() && budget.gpus.is_none();
    rows.sort_by(|x, y| {
        let k = |m: &Measured| {
            if per_dollar { m.capacity / m.p.usd_per_hour.max(1e-12) } else { m.capacity }
        };
        k(y).total_cmp(&k(x))
    });
    Ok(Planned { rows, rate, searched: found.len(), budget, infeasible, wall: wall.elapsed() })
}

/// --plan: the layout search, printed (and plotted with --out).
fn run_plan(cx: &Ctx) -> anyhow::Result<()> {
    let p = plan_rows(cx)?;
    println!(
        "plan: {} layouts within {} searched and simulated in {:.2} s ({} pool/class pairs never fit{}); the best {}",
        p.searched,
        budget_text(p.budget),
        p.wall.as_secs_f64(),
        p.infeasible.len(),
        p.infeasible.first().map_or(String::new(), |e| format!(", e.g. {e}")),
        p.rows.len()
    );
    header(cx, p.rate);
    table(cx, &p.rows);
    compare(&p.rows);
    if let Some(dir) = &cx.a.out {
        let file = dir.join("layouts.svg");
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
        plot_layouts(&file, &figures_of(cx, &p), p.rate)?;
        println!("wrote {}", file.display());
    }
    Ok(())
}

/// One layout's figures, for reports and plots.
#[derive(Debug, Clone)]
pub(crate) struct LayoutFigures {
    /// The layout.
    pub(crate) layout: String,
    /// All stages on one pool.
    pub(crate) colocated: bool,
    /// GPUs.
    pub(crate) gpus: u32,
    /// US$ per hour.
    pub(crate) usd_per_hour: f64,
    /// Requests per second, saturated.
    pub(crate) capacity: f64,
    /// p99 TTFF under the offered load, seconds.
    pub(crate) ttff_p99_s: f64,
    /// What decided its figures.
    pub(crate) why: String,
}

fn figures_of(cx: &Ctx, p: &Planned) -> Vec<LayoutFigures> {
    p.rows
        .iter()
        .map(|m| LayoutFigures {
            layout: m.p.layout.to_string(),
            colocated: m.p.layout.colocated(),
            gpus: m.p.layout.gpus(),
            usd_per_hour: m.p.usd_per_hour,
            capacity: m.capacity,
            ttff_p99_s: percentile(&m.run.ttff, 99.0).as_secs_f64(),
            why: mechanisms(cx, m).join("; "),
        })
        .collect()
}

/// A scatter plot of the layouts: capacity against p99 TTFF under the offered load.
pub(crate) fn plot_layouts(file: &Path, rows: &[LayoutFigures], rate: f64) -> anyhow::Result<()> {
    let points: Vec<Labelled> = rows
        .iter()
        .map(|r| Labelled {
            label: r.layout.clone(),
            x: r.capacity,
            y: r.ttff_p99_s,
            color: if r.colocated { PALETTE[1] } else { PALETTE[0] },
        })
        .collect();
    let title = format!("layouts: capacity and p99 TTFF at {rate:.3} req/s (orange: colocated)");
    scatter(file, &title, ("capacity, requests per second", "p99 TTFF, s"), &points)
}

/// Arguments as `tensorwire simulate` takes them.
#[derive(Debug, clap::Parser)]
struct Cmdline {
    #[command(flatten)]
    a: SimArgs,
}

fn parse_args(args: &[&str]) -> anyhow::Result<SimArgs> {
    let all = std::iter::once("simulate").chain(args.iter().copied());
    Ok(<Cmdline as clap::Parser>::try_parse_from(all)?.a)
}

/// The context `tensorwire simulate ARGS` runs in.
#[cfg(test)]
pub(crate) fn context_of(args: &[&str]) -> anyhow::Result<(Ctx, Vec<profiles::Model>)> {
    context(parse_args(args)?)
}

/// `simulate --plan ARGS` for a report: its layouts and the offered load.
pub(crate) fn plan_figures(args: &[&str]) -> anyhow::Result<(Vec<LayoutFigures>, f64, String)> {
    let (cx, _) = context(parse_args(args)?)?;
    let p = plan_rows(&cx)?;
    Ok((figures_of(&cx, &p), p.rate, cx.mix.describe()))
}

/// Layouts --plan simulates and prints.
const PLAN_SHOWN: usize = 6;

fn budget_text(b: Budget) -> String {
    match (b.gpus, b.usd_per_hour) {
        (Some(g), Some(u)) => format!("{g} GPUs and ${u:.2}/h"),
        (Some(g), None) => format!("{g} GPUs"),
        (None, Some(u)) => format!("${u:.2}/h"),
        (None, None) => "no budget".into(),
    }
}

fn header(cx: &Ctx, rate: f64) {
    let a = &cx.a;
    println!(
        "workload: {}; {} requests at {rate:.4} req/s (Poisson) for TTFF, capacity with {} queued at once; CFG {}, embedding hit rate {:.0}%, {:.0}% interactive; {} GB/s + {} ms per hop",
        cx.mix.describe(),
        a.requests,
        a.requests.min(5_000),
        if cx.knobs.cfg { "on" } else { "off" },
        a.embedding_hit_rate * 100.0,
        a.interactive * 100.0,
        a.bandwidth_gbps,
        a.latency_ms
    );
}

/// The comparison table.
fn table(cx: &Ctx, rows: &[Measured]) {
    println!(
        "{:<36} {:>5} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9}  util per pool",
        "layout", "GPUs", "$/h", "cap req/s", "TTFF p50", "TTFF p99", "E2E p99", "$/1k req"
    );
    for m in rows {
        let r = &m.run;
        let util: Vec<String> =
            m.p.layout
                .pools
                .iter()
                .zip(&r.utilisation)
                .map(|(p, u)| format!("{} {:.0}%", p.letters(), u * 100.0))
                .collect();
        let slo = cx.target.map_or(String::new(), |t| format!("  SLO met {:.1}%", slo_met(r, t)));
        println!(
            "{:<36} {:>5} {:>8.2} {:>10.4} {:>8.1}s {:>8.1}s {:>8.1}s {:>9.2}  {}{slo}",
            m.p.layout.to_string(),
            m.p.layout.gpus(),
            m.p.usd_per_hour,
            m.capacity,
            percentile(&r.ttff, 50.0).as_secs_f64(),
            percentile(&r.ttff, 99.0).as_secs_f64(),
            percentile(&r.e2e, 99.0).as_secs_f64(),
            per_1k(m.p.usd_per_hour, m.capacity),
            util.join(" / ")
        );
    }
    for m in rows {
        let why = mechanisms(cx, m);
        println!("  {}: {}", m.p.layout, why.join("; "));
    }
}

/// US$ per 1,000 requests at full capacity.
pub(crate) fn per_1k(usd_per_hour: f64, capacity: f64) -> f64 {
    usd_per_hour / (capacity * 3.6).max(1e-12)
}

fn slo_met(r: &Outcome, t: Duration) -> f64 {
    let ok = r.ttff.iter().filter(|&&x| x <= t).count();
    100.0 * ok as f64 / r.ttff.len().max(1) as f64
}

/// What decided a layout's figures: the memory fit of each pool, the pool that bounds its
/// capacity, and the wait of interactive requests against all.
fn mechanisms(cx: &Ctx, m: &Measured) -> Vec<String> {
    let mut why = Vec::new();
    let notes = m.p.notes();
    if notes.is_empty() {
        why.push("every model fits its pool's memory".into());
    }
    why.extend(notes);
    let (_, b) = plan::bound(&m.p, &cx.mix, cx.a.embedding_hit_rate);
    let pool = &m.p.layout.pools[b];
    why.push(format!(
        "capacity bound by the {} pool ({} x {})",
        pool.letters(),
        pool.count,
        pool.class
    ));
    let r = &m.run;
    if !r.ttff_interactive.is_empty() {
        why.push(format!(
            "interactive p99 TTFF {:.1} s vs {:.1} s for all (head-of-line blocking{})",
            percentile(&r.ttff_interactive, 99.0).as_secs_f64(),
            percentile(&r.ttff, 99.0).as_secs_f64(),
            if r.reuse.preempted > 0 {
                format!(", {} preemptions", r.reuse.preempted)
            } else {
                String::new()
            }
        ));
    }
    why
}

/// Benchmark (a): the best colocated and the best disaggregated row, at equal GPUs and at
/// equal cost.
fn compare(rows: &[Measured]) {
    let Some(c) = rows.iter().find(|m| m.p.layout.colocated()) else { return };
    let p99 = |m: &Measured| percentile(&m.run.ttff, 99.0).as_secs_f64();
    let same_gpus = rows
        .iter()
        .filter(|m| !m.p.layout.colocated() && m.p.layout.gpus() == c.p.layout.gpus())
        .max_by(|x, y| x.capacity.total_cmp(&y.capacity));
    let same_cost = rows
        .iter()
        .filter(|m| !m.p.layout.colocated() && m.p.usd_per_hour <= c.p.usd_per_hour + 1e-9)
        .max_by(|x, y| x.capacity.total_cmp(&y.capacity));
    for (label, d) in [("equal GPU count", same_gpus), ("equal or lower cost", same_cost)] {
        let Some(d) = d else { continue };
        println!(
            "disaggregated vs colocated at {label}: {} vs {}: throughput {:.2}x, p99 TTFF {:.1} s vs {:.1} s, ${:.2} vs ${:.2} per 1k requests",
            d.p.layout,
            c.p.layout,
            d.capacity / c.capacity.max(1e-12),
            p99(d),
            p99(c),
            per_1k(d.p.usd_per_hour, d.capacity),
            per_1k(c.p.usd_per_hour, c.capacity)
        );
    }
}

/// --calibrate: the published results against the simulator.
fn run_calibrate(cx: &Ctx, all: &[profiles::Model]) -> anyhow::Result<()> {
    let results = calibrate::load(cx.a.published.as_deref())?;
    let checked = calibrate::check(&results, all, &cx.classes, &cx.knobs)?;
    println!(
        "{:<22} {:>9} {:>9} {:>6} {:>9}  published result (simulated capacity colocated / disaggregated)",
        "layouts", "published", "simulated", "off", "derived"
    );
    let mut missed = Vec::new();
    for c in &checked {
        let off = c.ratio() / c.published.ratio - 1.0;
        let verdict = if c.within() { "" } else { " MISSED" };
        println!(
            "{:<22} {:>8.2}x {:>8.2}x {:>+5.0}% {:>8.2}x  {} ({}; {:.3} / {:.3} req/s){verdict}",
            format!("{} vs {}", c.published.disaggregated, c.published.colocated),
            c.published.ratio,
            c.ratio(),
            off * 100.0,
            c.derived_ratio(),
            c.published.what,
            c.published.model,
            c.throughput.0,
            c.throughput.1
        );
        if !c.within() {
            match &c.published.lacks {
                Some(l) => println!("  the simulator lacks: {l}"),
                None => missed.push(c.published.what.clone()),
            }
        }
    }
    println!(
        "derived: every time from the H100 profile, the class's speed and the offload model, ignoring the times measured on the class"
    );
    if missed.is_empty() {
        Ok(())
    } else {
        Err(anyhow::anyhow!(
            "{} published result(s) outside their tolerance with no mechanism named: {}",
            missed.len(),
            missed.join("; ")
        ))
    }
}

pub(crate) fn show(label: &str, p: &Prepared, r: &Outcome, target: Option<Duration>) {
    let slo = target.map_or(String::new(), |t| format!(", TTFF SLO met {:.1}%", slo_met(r, t)));
    let util: Vec<String> = p
        .layout
        .pools
        .iter()
        .zip(&r.utilisation)
        .map(|(q, u)| format!("{} {:.0}%", q.letters(), u * 100.0))
        .collect();
    println!(
        "{label:<34} {:>8.4} req/s  TTFF p50 {:>8.1} s p99 {:>8.1} s  E2E p50 {:>8.1} s p99 {:>8.1} s  util {}{slo}",
        r.throughput,
        percentile(&r.ttff, 50.0).as_secs_f64(),
        percentile(&r.ttff, 99.0).as_secs_f64(),
        percentile(&r.e2e, 50.0).as_secs_f64(),
        percentile(&r.e2e, 99.0).as_secs_f64(),
        util.join(" / "),
    );
}

fn cost_line(p: &Prepared, throughput: f64) -> String {
    format!(
        "${:.2}/h, ${:.2} per 1k requests at this load",
        p.usd_per_hour,
        per_1k(p.usd_per_hour, throughput)
    )
}

/// One line on what reuse did in a run.
fn reuse_line(u: &Reused, requests: u64) -> String {
    format!(
        "reuse: encode skipped for {} of {requests} requests (embedding cache), {} jobs preempted, {} steps not run again after a resume, {:.1} GB of step checkpoints to the store ({:.0} MB per request)",
        u.encode_skipped,
        u.preempted,
        u.resumed_steps,
        u.checkpoint_bytes as f64 / 1e9,
        u.checkpoint_bytes as f64 / 1e6 / requests.max(1) as f64,
    )
}
