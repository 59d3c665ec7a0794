//! `tensorwire demo --scenario shift`: elastic pools on real processes. Sixteen worker
//! processes (one encoder, fourteen denoisers, one decoder: the best split for images) serve a
//! workload that shifts from images (Qwen-Image) to video (Wan2.1 1.3B, whose VAE decode is
//! fifteen times longer) and back, on the same seeded Poisson schedule twice: with the pools
//! fixed, and with the orchestrator's rebalancer moving workers (each switch drains the
//! worker, its denoise job yielding a checkpoint that another worker resumes, and pays the
//! time to load the other stage's weights). The same comparison as `simulate --elastic`, with
//! payloads moving between processes.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tensorwire_orchestrator::Stage;
use tensorwire_orchestrator::sched::SchedConfig;
use tensorwire_sim::rng::Rng;

use crate::demo::DemoArgs;
use crate::demo::pipeline::{Split, now_us};
use crate::demo::procs::{Cluster, ClusterArgs};
use crate::report::percentile;
use crate::switching::{RebalanceArgs, SwitchCost};
use tensorwire_sim::profiles::{self, Model};

/// The models: requests with even ids are images, odd ones video.
const MODELS: [&str; 2] = ["qwen-image-1328", "wan2.1-t2v-1.3b-480p"];
/// (model, requests per second, seconds), in profile time.
const PHASES: [(usize, f64, f64); 3] = [(0, 0.58, 400.0), (1, 0.28, 400.0), (0, 0.58, 400.0)];
/// Profile time runs this much faster (a 400 s phase takes 6 s).
const SCALE: f64 = 0.015;
/// Worker processes: encode, denoise, decode.
const SPLIT: Split = Split { encode: 1, denoise: 14, decode: 1 };

/// One run's figures, in profile seconds.
struct Run {
    label: &'static str,
    completed: usize,
    lost: usize,
    duplicated: u64,
    ttff: Vec<Duration>,
    e2e: Vec<Duration>,
    /// (profile seconds from the start, from, to, switch time in profile seconds)
    moves: Vec<(f64, String, String, f64)>,
}

/// The requests: (id, when), from a seeded Poisson process per phase.
fn schedule(seed: u64) -> Vec<(u64, Duration)> {
    let mut rng = Rng::new(seed);
    let mut next = [0u64, 1];
    let (mut out, mut start) = (Vec::new(), 0.0);
    for (m, rate, len) in PHASES {
        let mut t = start;
        loop {
            t += rng.exp(rate);
            if t >= start + len {
                break;
            }
            out.push((next[m], Duration::from_secs_f64(t * SCALE)));
            next[m] += 2;
        }
        start += len;
    }
    out
}

/// Runs the schedule on a fresh cluster, elastic or not.
async fn run_once(
    a: &DemoArgs,
    models: &[Model],
    plan: &[(u64, Duration)],
    elastic: bool,
) -> anyhow::Result<Run> {
    let rebalance = match elastic {
        true => {
            let r = RebalanceArgs { rebalance_interval_s: 10.0, dwell_s: 60.0, horizon_s: 120.0 };
            let cfg = r.config(SCALE, SchedConfig::default().decode_headroom)?;
            Some((cfg, SwitchCost { switch_gbps: 2.0, switch_s: 2.0 }))
        }
        false => None,
    };
    let ca = ClusterArgs {
        time_scale: SCALE,
        profiles: a.mix.profiles.clone(),
        chaos: None,
        seed: a.seed,
        checkpoint_every: a.checkpoint_every,
        metrics: crate::observe::MetricsArgs::default(),
        rebalance,
        // A backlog of a few hundred requests, each holding its embeddings until it ends.
        store: crate::demo::procs::StoreLayout {
            nodes: 0,
            replicas: 1,
            chaos: None,
            seed: 0,
            bytes: 4 << 30,
        },
    };
    let mut c = Cluster::start(&ca, models, SPLIT).await?;
    let (start, t0) = (Instant::now(), now_us());
    let (done, lost) = c.run_timed(plan, start).await?;
    let mut firsts: HashMap<u64, u64> = HashMap::new();
    let mut moves = Vec::new();
    for l in c.drain_lines(Duration::from_millis(300)).await {
        let f: Vec<&str> = l.split_whitespace().collect();
        match f[..] {
            ["FIRST", r, us] => {
                if let (Ok(r), Ok(us)) = (r.parse::<u64>(), us.parse::<u64>()) {
                    firsts.entry(r).or_insert(us);
                }
            }
            ["SWITCHED", from, to, ms, unix_ms] => {
                let (Ok(ms), Ok(at)) = (ms.parse::<f64>(), unix_ms.parse::<u64>()) else {
                    continue;
                };
                let at = (at * 1000).saturating_sub(t0) as f64 / 1e6 / SCALE;
                moves.push((at, from.to_string(), to.to_string(), ms / 1e3 / SCALE));
            }
            _ => {}
        }
    }
    moves.sort_by(|x, y| x.0.total_cmp(&y.0));
    let report = c.stop().await?;
    let profile = |d: Duration| d.div_f64(SCALE);
    let mut ttff = Vec::new();
    let mut e2e = Vec::new();
    for &(r, sent, ended) in &done {
        e2e.push(profile(ended.saturating_sub(sent)));
        if let Some(&us) = firsts.get(&r) {
            let submitted = t0 + sent.as_micros() as u64;
            ttff.push(profile(Duration::from_micros(us.saturating_sub(submitted))));
        }
    }
    Ok(Run {
        label: if elastic { "elastic (rebalancer on)" } else { "static" },
        completed: done.len(),
        lost: lost.len(),
        duplicated: report.orchestrator.duplicated,
        ttff,
        e2e,
        moves,
    })
}

/// Runs the scenario.
pub(crate) async fn run(a: DemoArgs) -> anyhow::Result<()> {
    let all = profiles::load(a.mix.profiles.as_deref())?;
    let names: Vec<String> = MODELS.iter().map(|m| m.to_string()).collect();
    let models: Vec<Model> = profiles::pick(&all, &names)?.into_iter().cloned().collect();
    let plan = schedule(a.seed);
    let phases: Vec<String> = PHASES
        .iter()
        .map(|&(m, rate, len)| format!("{} at {rate} req/s for {len:.0} s", MODELS[m]))
        .collect();
    println!(
        "tensorwire demo --scenario shift: {} worker processes ({}:{}:{} at the start), {} requests: {}; times are the profiles' (run x{SCALE}), the same schedule twice",
        SPLIT.encode + SPLIT.denoise + SPLIT.decode,
        SPLIT.encode,
        SPLIT.denoise,
        SPLIT.decode,
        plan.len(),
        phases.join(", then ")
    );
    let mut runs = Vec::new();
    for elastic in [false, true] {
        runs.push(run_once(&a, &models, &plan, elastic).await?);
    }
    let s = |d: Duration| d.as_secs_f64();
    for r in &runs {
        println!(
            "{:<24} completed {}/{} (lost {}, duplicated {}), TTFF p50 {:>6.1} s p99 {:>6.1} s, E2E p99 {:>6.1} s, {} moves",
            r.label,
            r.completed,
            plan.len(),
            r.lost,
            r.duplicated,
            s(percentile(&r.ttff, 50.0)),
            s(percentile(&r.ttff, 99.0)),
            s(percentile(&r.e2e, 99.0)),
            r.moves.len()
        );
    }
    let (st, el) = (&runs[0], &runs[1]);
    for (at, from, to, took) in &el.moves {
        println!("  at {at:>6.0} s: a worker moved {from} -> {to} (switched in {took:.1} s)");
    }
    println!(
        "elastic vs static: p99 TTFF {:.2}x, p50 {:.2}x, E2E p99 {:.2}x (phase boundaries at {:.0} and {:.0} s)",
        s(percentile(&el.ttff, 99.0)) / s(percentile(&st.ttff, 99.0)).max(1e-9),
        s(percentile(&el.ttff, 50.0)) / s(percentile(&st.ttff, 50.0)).max(1e-9),
        s(percentile(&el.e2e, 99.0)) / s(percentile(&st.e2e, 99.0)).max(1e-9),
        PHASES[0].2,
        PHASES[0].2 + PHASES[1].2
    );
    for r in &runs {
        if r.lost > 0 || r.duplicated > 0 || r.completed != plan.len() {
            return Err(anyhow::anyhow!(
                "{}: {} of {} requests completed, {} lost, {} duplicated",
                r.label,
                r.completed,
                plan.len(),
                r.lost,
                r.duplicated
            ));
        }
    }
    if !el.moves.iter().any(|m| m.2 == Stage::Decode.name()) {
        return Err(anyhow::Error::msg(
            "the elastic run moved no worker to decode when video arrived",
        ));
    }
    Ok(())
}
