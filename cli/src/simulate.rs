//! `tensorwire simulate`: a discrete-event simulation of a serving cluster. Requests arrive as a
//! Poisson process; the orchestrator's own driver and scheduler (`tensorwire_orchestrator::Driver`,
//! the same code the library orchestrator and the service run) make every dispatch decision; a stage's service time is its
//! profiled compute plus the transfer of its input (bytes / bandwidth + per-hop latency). No bytes
//! move and nothing sleeps. The colocated baseline serves whole requests on the same GPUs.
//!
//! Reuse: a share of the requests hits the embedding cache (`--embedding-hit-rate`: encode is
//! skipped, denoise starts from the cached embedding); denoise saves a step checkpoint every N
//! steps (`--checkpoint-every`: the latents go to the store, each save costs their transfer);
//! a share of the requests is interactive (`--interactive`), and with preemption on the
//! scheduler asks a batch denoise job to yield for each waiting interactive one: the job
//! stops at its next step boundary, saves a checkpoint and later resumes from it. With
//! interactive requests the best layout is run with and without preemption and both reported.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tensorwire_benches::rng::Rng;
use tensorwire_orchestrator::sched::{
    AffinityFirst, ItemKey, MaxFreeCredit, RoundRobin, RoutingPolicy, SchedConfig, Submit, WorkerId,
};
use tensorwire_orchestrator::{Driver, Priority, Stage, StageResult};

use crate::demo::{Split, auto_split, parse_split};
use crate::profiles::{self, Model};
use crate::report::percentile;

/// Simulation settings.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SimArgs {
    /// Model to serve (a name from the profiles).
    #[arg(long, default_value = "wan2.1-t2v-14b-480p")]
    pub(crate) model: String,
    /// Profile file (default: the copy built into the binary).
    #[arg(long)]
    pub(crate) profiles: Option<PathBuf>,
    /// GPUs in the cluster.
    #[arg(long, default_value_t = 8)]
    pub(crate) gpus: u32,
    /// Disaggregated split E:N:M; default: try every split and report the best.
    #[arg(long)]
    pub(crate) split: Option<String>,
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
    /// seconds; default: four times the model's denoise time.
    #[arg(long)]
    pub(crate) aging_s: Option<f64>,
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
struct SimResult {
    throughput: f64,
    ttff: Vec<Duration>,
    e2e: Vec<Duration>,
    utilisation: [f64; 3],
    decisions: u64,
    wall: Duration,
    reuse: Reused,
}

/// What reuse did in a run.
#[derive(Debug, Clone, Default)]
struct Reused {
    /// TTFF of the interactive requests.
    ttff_interactive: Vec<Duration>,
    /// Requests that skipped encode (embedding-cache hits).
    encode_skipped: u64,
    /// Jobs that yielded to an interactive one.
    preempted: u64,
    /// Steps not run again: the step each resumed job started from, summed.
    resumed_steps: u64,
    /// Latent bytes written to the store as step checkpoints.
    checkpoint_bytes: u64,
}

fn policy(name: &str) -> Result<Box<dyn RoutingPolicy>, String> {
    Ok(match name {
        "max-free" => Box::new(MaxFreeCredit),
        "round-robin" => Box::new(RoundRobin::default()),
        "affinity" => Box::new(AffinityFirst),
        other => {
            return Err(format!("--policy {other:?}: expected max-free, round-robin or affinity"));
        }
    })
}

/// What happens at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Request arrives.
    Arrive(u64),
    /// A worker ends an item (ignored if the run was cut short by a yield).
    Done(ItemKey, WorkerId),
    /// A denoise job yields at this step, its checkpoint saved.
    Yield(ItemKey, WorkerId, u32),
}

/// (time, sequence, event).
type SimEvent = (Duration, u64, Ev);

/// A denoise run in progress: when it started, its fixed cost before the first step, the step
/// it started at, its time per step (checkpoint saves spread over the steps), and the sequence
/// number of its end event.
#[derive(Debug, Clone, Copy)]
struct DenoiseRun {
    start: Duration,
    base: Duration,
    from: u32,
    per_step: Duration,
    seq: u64,
}

/// Simulates the disaggregated cluster (`preempt`: interactive jobs preempt batch denoise).
fn disaggregated(
    m: &Model,
    split: Split,
    a: &SimArgs,
    rate: f64,
    preempt: bool,
) -> Result<SimResult, String> {
    let wall = Instant::now();
    let ms = |x: f64| Duration::from_secs_f64(x / 1e3);
    // A batch job is ordered as interactive once it waited this long (the starvation bound).
    let aging = a.aging_s.map_or(ms(m.denoise_ms()) * 4, Duration::from_secs_f64);
    let cfg =
        SchedConfig { heartbeat_timeout: Duration::MAX, preempt, aging, ..SchedConfig::default() };
    // Workers are reached through nothing (the events below play them); a request's waiter is
    // its arrival time.
    let mut d: Driver<(), Duration> = Driver::new(cfg, policy(&a.policy)?);
    for stage in Stage::ALL {
        for _ in 0..[split.encode, split.denoise, split.decode][stage.index()] {
            d.join(stage, 1, "node", vec![], (), Duration::ZERO);
        }
    }
    let xfer = |bytes: u64| {
        Duration::from_secs_f64(bytes as f64 / (a.bandwidth_gbps * 1e9) + a.latency_ms / 1e3)
    };
    let chunks = f64::from(m.chunks().map_or(1, |(_, n)| n));
    let mut rng = Rng::new(a.seed);
    let mut events: BinaryHeap<Reverse<SimEvent>> = BinaryHeap::new();
    let mut t = 0.0;
    for r in 0..a.requests {
        t += rng.exp(rate);
        events.push(Reverse((Duration::from_secs_f64(t), r, Ev::Arrive(r))));
    }
    let mut seq = a.requests;
    let mut arrived: HashMap<u64, Duration> = HashMap::new();
    let mut interactive: std::collections::HashSet<u64> = Default::default();
    let mut runs: HashMap<ItemKey, DenoiseRun> = HashMap::new();
    let mut cut: std::collections::HashSet<u64> = Default::default();
    let mut reuse = Reused::default();
    let (mut ttff, mut e2e) = (Vec::new(), Vec::new());
    let mut now = Duration::ZERO;
    let steps = m.steps.max(1);
    let every = a.checkpoint_every;
    // Checkpoint saves at steps in (from, to) (the last step's latents go to decode instead).
    let saves = |from: u32, to: u32| -> u32 {
        if every == 0 {
            0
        } else {
            (from + 1..to.min(steps)).filter(|s| s % every == 0).count() as u32
        }
    };
    while let Some(Reverse((at, sq, ev))) = events.pop() {
        now = at;
        match ev {
            Ev::Arrive(r) => {
                arrived.insert(r, at);
                let p = if rng.next_f64() < a.interactive {
                    interactive.insert(r);
                    Priority::Interactive
                } else {
                    Priority::Batch
                };
                if rng.next_f64() < a.embedding_hit_rate {
                    reuse.encode_skipped += 1;
                    let s = Submit { start: Stage::Denoise, ..Submit::new(r, p) };
                    let _ = d.submit_with(s, b"cached embedding".to_vec(), at, at);
                } else {
                    let _ = d.submit(Submit::new(r, p), at, at);
                }
            }
            Ev::Done(key, w) => {
                if cut.remove(&sq) {
                    continue; // it yielded before
                }
                if let Some(run) = runs.remove(&key) {
                    reuse.checkpoint_bytes += u64::from(saves(run.from, steps)) * m.latent_bytes;
                }
                d.result(w, key, StageResult::Done(Vec::new()), at);
            }
            Ev::Yield(key, w, step) => {
                if let Some(run) = runs.remove(&key) {
                    reuse.checkpoint_bytes += u64::from(saves(run.from, step) + 1) * m.latent_bytes;
                }
                reuse.preempted += 1;
                d.yielded(w, key, step, b"checkpoint".to_vec(), at);
            }
        }
        for t0 in d.take_outcomes().into_iter().filter_map(|e| e.waiter) {
            e2e.push(now - t0);
        }
        drop(d.take_dead()); // simulated workers never go silent; keep the list empty
        for x in d.dispatch(now) {
            let k = x.dispatch.item.key;
            let service = match k.stage {
                Stage::Encode => ms(m.encode_ms),
                Stage::Denoise => {
                    // From the checkpoint it resumes at (loading its latents), or step 0.
                    let from = x.resume.map_or(0, |(s, _)| s.min(steps));
                    reuse.resumed_steps += u64::from(from);
                    let load = if from > 0 { xfer(m.latent_bytes) } else { Duration::ZERO };
                    let base = xfer(m.embed_bytes) + load;
                    let work =
                        ms(m.step_ms) * (steps - from) + xfer(m.latent_bytes) * saves(from, steps);
                    let per_step = work / (steps - from).max(1);
                    runs.insert(k, DenoiseRun { start: now, base, from, per_step, seq: seq + 1 });
                    base + work
                }
                Stage::Decode => xfer(m.latent_bytes) + ms(m.decode_ms),
            };
            if k.stage == Stage::Decode {
                // First frame: the first chunk has landed and is decoded.
                let first =
                    xfer((m.latent_bytes as f64 / chunks) as u64) + ms(m.decode_ms / chunks);
                if let Some(t0) = arrived.get(&k.request) {
                    ttff.push(now + first - *t0);
                    if interactive.contains(&k.request) {
                        reuse.ttff_interactive.push(now + first - *t0);
                    }
                }
            }
            seq += 1;
            events.push(Reverse((now + service, seq, Ev::Done(k, x.dispatch.worker))));
        }
        // Asked to yield: the job stops at its next step boundary (past the one it started
        // at), saving a checkpoint; one that would reach its last step first just finishes.
        for (key, w, _) in d.take_asks() {
            let Some(run) = runs.get(&key) else { continue };
            let ran = now.saturating_sub(run.start + run.base);
            let done = (ran.as_secs_f64() / run.per_step.as_secs_f64().max(1e-12)) as u32;
            let at_step = run.from + done + 1;
            if at_step >= steps {
                continue;
            }
            let when =
                run.start + run.base + run.per_step * (at_step - run.from) + xfer(m.latent_bytes);
            cut.insert(run.seq);
            seq += 1;
            events.push(Reverse((when, seq, Ev::Yield(key, w, at_step))));
        }
    }
    let busy = d.stats(now).busy;
    let span = now.as_secs_f64().max(1e-9);
    let pools = [split.encode, split.denoise, split.decode];
    Ok(SimResult {
        throughput: e2e.len() as f64 / span,
        ttff,
        e2e,
        utilisation: std::array::from_fn(|i| busy[i].as_secs_f64() / (span * f64::from(pools[i]))),
        decisions: d.sched().stats().dispatched,
        wall: wall.elapsed(),
        reuse,
    })
}

/// Simulates colocated serving: `gpus` servers, each runs a whole request (FIFO).
fn colocated(m: &Model, gpus: u32, a: &SimArgs, rate: f64) -> SimResult {
    let wall = Instant::now();
    let per = Duration::from_secs_f64((m.encode_ms + m.denoise_ms() + m.decode_ms) / 1e3);
    let chunks = f64::from(m.chunks().map_or(1, |(_, n)| n));
    let first =
        Duration::from_secs_f64((m.encode_ms + m.denoise_ms() + m.decode_ms / chunks) / 1e3);
    let mut rng = Rng::new(a.seed);
    let mut free: BinaryHeap<Reverse<Duration>> =
        (0..gpus).map(|_| Reverse(Duration::ZERO)).collect();
    let (mut ttff, mut e2e) = (Vec::new(), Vec::new());
    let (mut t, mut end) = (0.0, Duration::ZERO);
    let mut queue: VecDeque<Duration> = VecDeque::new();
    for _ in 0..a.requests {
        t += rng.exp(rate);
        queue.push_back(Duration::from_secs_f64(t));
    }
    while let Some(arr) = queue.pop_front() {
        let Reverse(gpu_free) = free.pop().unwrap_or(Reverse(Duration::ZERO));
        let start = gpu_free.max(arr);
        ttff.push(start + first - arr);
        e2e.push(start + per - arr);
        end = end.max(start + per);
        free.push(Reverse(start + per));
    }
    let span = end.as_secs_f64().max(1e-9);
    let u = per.as_secs_f64() * a.requests as f64 / (span * f64::from(gpus));
    SimResult {
        throughput: a.requests as f64 / span,
        ttff,
        e2e,
        utilisation: [u; 3],
        decisions: 0,
        wall: wall.elapsed(),
        reuse: Reused::default(),
    }
}

fn show(label: &str, r: &SimResult, target: Option<Duration>) {
    let slo = target.map_or(String::new(), |t| {
        let ok = r.ttff.iter().filter(|&&x| x <= t).count();
        format!(", TTFF SLO met {:.1}%", 100.0 * ok as f64 / r.ttff.len().max(1) as f64)
    });
    println!(
        "{label:<34} {:>8.4} req/s  TTFF p50 {:>8.1} s p99 {:>8.1} s  E2E p50 {:>8.1} s p99 {:>8.1} s  util enc/den/dec {:.0}%/{:.0}%/{:.0}%{slo}",
        r.throughput,
        percentile(&r.ttff, 50.0).as_secs_f64(),
        percentile(&r.ttff, 99.0).as_secs_f64(),
        percentile(&r.e2e, 50.0).as_secs_f64(),
        percentile(&r.e2e, 99.0).as_secs_f64(),
        r.utilisation[0] * 100.0,
        r.utilisation[1] * 100.0,
        r.utilisation[2] * 100.0,
    );
}

/// Runs the simulation.
pub(crate) fn run(a: SimArgs) -> Result<(), String> {
    if a.requests == 0 || a.requests > 10_000_000 {
        return Err(format!("--requests {}: must be in 1..=10000000", a.requests));
    }
    if a.bandwidth_gbps.is_nan()
        || a.bandwidth_gbps <= 0.0
        || a.latency_ms.is_nan()
        || a.latency_ms < 0.0
    {
        return Err("--bandwidth-gbps must be > 0 and --latency-ms >= 0".into());
    }
    for (name, v) in
        [("--interactive", a.interactive), ("--embedding-hit-rate", a.embedding_hit_rate)]
    {
        if !(0.0..=1.0).contains(&v) {
            return Err(format!("{name} {v}: a share, 0 to 1"));
        }
    }
    let all = profiles::load(a.profiles.as_deref())?;
    let m = profiles::pick(&all, std::slice::from_ref(&a.model))?[0].clone();
    let per_req_s = (m.encode_ms + m.denoise_ms() + m.decode_ms) / 1e3;
    let sweep_n = a.denoise.unwrap_or(a.gpus.saturating_sub(2).max(1));
    // Default load: 90% of what colocated serving sustains; for --sweep, 90% of what the denoise
    // pool sustains (the decode pool is what is being sized).
    let rate = a.rate.unwrap_or(if a.sweep {
        0.9 * f64::from(sweep_n) / (m.denoise_ms() / 1e3)
    } else {
        0.9 * f64::from(a.gpus) / per_req_s
    });
    if rate.is_nan() || rate <= 0.0 {
        return Err(format!("--rate {rate}: must be > 0"));
    }
    let target = a.target_ttff_ms.map(|x| Duration::from_secs_f64(x / 1e3));
    println!(
        "tensorwire simulate: {} on {} GPUs, {} requests at {:.4} req/s (Poisson), {} GB/s + {} ms per hop, policy {}",
        m.name, a.gpus, a.requests, rate, a.bandwidth_gbps, a.latency_ms, a.policy
    );
    let c = colocated(&m, a.gpus, &a, rate);
    show("colocated", &c, target);
    if a.sweep {
        let target = target.ok_or("--sweep needs --target-ttff-ms")?;
        let n = sweep_n;
        let mut last = f64::INFINITY;
        let mut flat = 0;
        for mm in 1..=64 {
            let split = Split { encode: 1, denoise: n, decode: mm };
            let r = disaggregated(&m, split, &a, rate, true)?;
            show(&format!("1:{n}:{mm}"), &r, Some(target));
            let p99 = percentile(&r.ttff, 99.0);
            if p99 <= target {
                println!(
                    "chosen N:M = {n}:{mm} (smallest decode pool with p99 TTFF <= {:.1} s)",
                    target.as_secs_f64()
                );
                return Ok(());
            }
            // Stop once more decoders no longer help: the wait is elsewhere (denoise).
            flat = if p99.as_secs_f64() >= last * 0.99 { flat + 1 } else { 0 };
            last = p99.as_secs_f64();
            if flat >= 3 {
                return Err(format!(
                    "p99 TTFF stays at {:.1} s however many decoders: {n} denoise workers cannot meet {:.1} s at {rate:.4} req/s (add denoise workers, or lower --rate)",
                    p99.as_secs_f64(),
                    target.as_secs_f64()
                ));
            }
        }
        return Err(format!(
            "no decode pool up to 64 workers meets p99 TTFF <= {:.1} s with {n} denoise workers",
            target.as_secs_f64()
        ));
    }
    let splits: Vec<Split> = match &a.split {
        Some(s) => vec![parse_split(s, a.gpus)?],
        None => {
            let mut v = Vec::new();
            for e in 1..a.gpus {
                for mm in 1..a.gpus {
                    if e + mm < a.gpus {
                        v.push(Split { encode: e, denoise: a.gpus - e - mm, decode: mm });
                    }
                }
            }
            if v.is_empty() {
                v.push(auto_split(&[&m], a.gpus)?);
            }
            v
        }
    };
    let mut best: Option<(Split, SimResult)> = None;
    let mut decisions = 0;
    let wall = Instant::now();
    for split in splits {
        let r = disaggregated(&m, split, &a, rate, true)?;
        decisions += r.decisions;
        let better = best.as_ref().is_none_or(|(_, b)| {
            (r.throughput, -percentile(&r.ttff, 99.0).as_secs_f64())
                > (b.throughput, -percentile(&b.ttff, 99.0).as_secs_f64())
        });
        if better {
            best = Some((split, r));
        }
    }
    let (split, r) = best.ok_or("no split to simulate")?;
    show(
        &format!("disaggregated best {}:{}:{}", split.encode, split.denoise, split.decode),
        &r,
        target,
    );
    println!(
        "best disaggregated / colocated throughput: {:.3}x ({} scheduler decisions in {:.2} s of wall time)",
        r.throughput / c.throughput.max(1e-12),
        decisions,
        wall.elapsed().as_secs_f64()
    );
    let _ = r.wall;
    if a.interactive > 0.0 || a.embedding_hit_rate > 0.0 || a.checkpoint_every > 0 {
        println!("{}", reuse_line(&r.reuse, a.requests));
    }
    if a.interactive > 0.0 {
        let without = disaggregated(&m, split, &a, rate, false)?;
        let p99 = |v: &[Duration]| percentile(v, 99.0).as_secs_f64();
        println!(
            "interactive TTFF p99: {:.1} s with preemption, {:.1} s without ({:.2}x); all requests: p99 TTFF {:.1} s vs {:.1} s, throughput {:.4} vs {:.4} req/s",
            p99(&r.reuse.ttff_interactive),
            p99(&without.reuse.ttff_interactive),
            p99(&r.reuse.ttff_interactive) / p99(&without.reuse.ttff_interactive).max(1e-12),
            p99(&r.ttff),
            p99(&without.ttff),
            r.throughput,
            without.throughput
        );
    }
    Ok(())
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
