//! The discrete-event simulation of one layout serving one workload. Requests arrive (Poisson,
//! or all at once to measure capacity); the orchestrator's own driver and scheduler
//! (`tensorwire_orchestrator::Driver`, the code the library orchestrator and the service run)
//! make every dispatch decision; nothing sleeps and no bytes move.
//!
//! Each GPU of a pool joins the driver once per run of consecutive stages it serves (see
//! [`Pool::runs`](super::layout::Pool::runs)): a run is one item whose service time is its stages' times on that GPU (from
//! [`super::fit`]) plus the transfer of its input, with no transfer inside the run. A stage
//! inside a run (decode in a `DV` pool) is passed by a worker that ends its items at once, so
//! the driver still sees every stage. A GPU runs one item at a time: an item dispatched to a GPU
//! busy with its other run (an `EV` pool's encode and decode) starts when the GPU is free.
//!
//! Reuse: embedding-cache hits start at denoise; denoise saves a step checkpoint every N steps
//! (each save costs the latents' transfer to the store); with preemption a batch denoise job asked
//! to yield stops at its next step boundary, saves a checkpoint and resumes from it later.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::time::Duration;

use crate::rng::Rng;
use tensorwire_orchestrator::rebalance::{Flow, Member, RebalanceConfig, Rebalancer};
use tensorwire_orchestrator::sched::{
    AffinityFirst, ItemKey, MaxFreeCredit, RoundRobin, RoutingPolicy, SchedConfig, Submit, WorkerId,
};
use tensorwire_orchestrator::{Driver, Priority, Stage, StageResult};

use super::classes::{self, GpuClass};
use super::fit::{self, PoolFit};
use super::layout::Layout;
use super::workload::{Mix, pick};
use crate::Result;

/// Slots of a worker that passes a stage inside a run (never the limit).
const PASS_SLOTS: u32 = 1 << 24;

/// The links between pools.
#[derive(Debug, Clone, Copy)]
pub struct Net {
    /// GB/s per transfer.
    pub bandwidth_gbps: f64,
    /// Per hop, ms.
    pub latency_ms: f64,
}

/// Settings of a run besides the layout and the mix.
#[derive(Debug, Clone)]
pub struct Knobs {
    /// Routing policy: max-free, round-robin or affinity.
    pub policy: String,
    /// Share of requests interactive (for mix entries that fix no class).
    pub interactive: f64,
    /// Share of requests whose embedding is cached.
    pub embedding_hit_rate: f64,
    /// Step checkpoint every N steps (0: never).
    pub checkpoint_every: u32,
    /// The starvation bound (None: four times the mix's mean denoise time).
    pub aging: Option<Duration>,
    /// Interactive jobs preempt batch denoise.
    pub preempt: bool,
    /// Classifier-free guidance on.
    pub cfg: bool,
    /// Links.
    pub net: Net,
    /// Random seed.
    pub seed: u64,
}

/// How requests arrive.
#[derive(Debug, Clone, Copy)]
pub enum Load {
    /// Poisson arrivals at `rate` per second.
    Poisson {
        /// Requests per second.
        rate: f64,
        /// How many.
        requests: u64,
    },
    /// All queued at time zero: the layout's capacity (as a closed-loop load test measures).
    Saturated {
        /// How many.
        requests: u64,
    },
}

/// A workload that shifts: phases run one after the other, each with its own shares of the
/// mix's entries and its own Poisson rate (a diurnal rate is a run of phases).
#[derive(Debug, Clone)]
pub struct Shift {
    /// The phases, in order.
    pub phases: Vec<Phase>,
}

/// One phase of a [`Shift`].
#[derive(Debug, Clone)]
pub struct Phase {
    /// Share of each mix entry (summing to 1).
    pub shares: Vec<f64>,
    /// Requests per second.
    pub rate: f64,
    /// How long it lasts.
    pub length: Duration,
}

/// Elastic pools: a rebalancer moves GPUs between single-stage pools during the run.
#[derive(Debug, Clone)]
pub struct Elastic {
    /// The rebalancer's settings.
    pub cfg: RebalanceConfig,
    /// Time to switch a GPU to each stage (loading that stage's weights).
    pub switch: [Duration; 3],
}

/// A GPU moved between pools during a run.
#[derive(Debug, Clone, Copy)]
pub struct Moved {
    /// When the rebalancer decided it.
    pub at: Duration,
    /// When the GPU joined its new pool (drained, then switched).
    pub joined: Duration,
    /// The GPU.
    pub gpu: usize,
    /// From this stage's pool...
    pub from: Stage,
    /// ... to this one.
    pub to: Stage,
}

/// A layout checked against the memory of its classes, ready to simulate.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The layout.
    pub layout: Layout,
    /// Per pool: what each stage costs there.
    pub fits: Vec<PoolFit>,
    /// US$ per hour for all its GPUs.
    pub usd_per_hour: f64,
}

impl Prepared {
    /// Fits every pool; Err: the first pool that cannot run, and why.
    pub fn new(layout: &Layout, all: &[GpuClass], mix: &Mix, cfg: bool) -> Result<Prepared> {
        let models = mix.models();
        let mut fits = Vec::new();
        let mut usd = 0.0;
        for p in &layout.pools {
            let class = classes::pick(all, &p.class)?;
            let f = fit::fit(p, class, &models, cfg)
                .map_err(|e| format!("{} on {}: {e}", p.letters(), p.class))?;
            fits.push(f);
            usd += class.usd_per_hour * f64::from(p.count);
        }
        Ok(Prepared { layout: layout.clone(), fits, usd_per_hour: usd })
    }

    /// What the fits decided, a line per pool that had something to say.
    pub fn notes(&self) -> Vec<String> {
        self.layout
            .pools
            .iter()
            .zip(&self.fits)
            .filter(|(_, f)| !f.notes.is_empty())
            .map(|(p, f)| format!("{} on {}: {}", p.letters(), p.class, f.notes.join(", ")))
            .collect()
    }
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Completed requests per second.
    pub throughput: f64,
    /// Time to first frame of every request.
    pub ttff: Vec<Duration>,
    /// ... of the interactive ones.
    pub ttff_interactive: Vec<Duration>,
    /// End to end.
    pub e2e: Vec<Duration>,
    /// Busy share of each pool's GPUs.
    pub utilisation: Vec<f64>,
    /// Scheduler decisions.
    pub decisions: u64,
    /// What reuse did.
    pub reuse: Reused,
    /// GPUs moved between pools (elastic runs).
    pub moves: Vec<Moved>,
}

/// What reuse did in a run.
#[derive(Debug, Clone, Default)]
pub struct Reused {
    /// Requests that skipped encode (embedding-cache hits).
    pub encode_skipped: u64,
    /// Jobs that yielded to an interactive one.
    pub preempted: u64,
    /// Steps not run again: the step each resumed job started from, summed.
    pub resumed_steps: u64,
    /// Latent bytes written to the store as step checkpoints.
    pub checkpoint_bytes: u64,
}

/// A routing policy by name.
pub fn policy(name: &str) -> Result<Box<dyn RoutingPolicy>> {
    Ok(match name {
        "max-free" => Box::new(MaxFreeCredit),
        "round-robin" => Box::new(RoundRobin::default()),
        "affinity" => Box::new(AffinityFirst),
        other => {
            return Err(
                format!("--policy {other:?}: expected max-free, round-robin or affinity").into()
            );
        }
    })
}

/// What happens at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Request arrives.
    Arrive(u64),
    /// A worker ends an item (ignored if a yield cut the run short).
    Done(ItemKey, WorkerId),
    /// A denoise job yields at this step, its checkpoint saved.
    Yield(ItemKey, WorkerId, u32),
    /// The rebalancer's turn (elastic runs).
    Rebalance,
    /// A GPU done switching joins the pool of this index.
    Switched(usize, usize),
}

/// (time, sequence, event).
type SimEvent = (Duration, u64, Ev);

/// Who a driver worker is.
#[derive(Debug, Clone, Copy)]
enum Role {
    /// GPU `gpu` of pool `pool`, serving its run `run`.
    Gpu { gpu: usize, pool: usize, run: usize },
    /// Passes a stage inside a run.
    Pass,
}

/// One simulated GPU: its pool (None while it switches), when it joined it, when it is free.
#[derive(Debug, Clone, Copy, Default)]
struct Gpu {
    pool: Option<usize>,
    since: Duration,
    free_at: Duration,
}

/// A denoise run in progress: its GPU, when it started, the time before its first step, the
/// step it started at, its time per step (checkpoint saves spread over the steps), when it
/// ends, and the sequence number of its end event.
#[derive(Debug, Clone, Copy)]
struct DenoiseRun {
    gpu: usize,
    start: Duration,
    base: Duration,
    from: u32,
    per_step: Duration,
    end: Duration,
    seq: u64,
}

/// Runs `p` under `load`.
pub fn simulate(p: &Prepared, mix: &Mix, k: &Knobs, load: Load) -> Result<Outcome> {
    simulate_with(p, mix, k, load, None, None)
}

/// The arrival times of `shift`'s requests, with the phase of each.
fn shift_arrivals(shift: &Shift, rng: &mut Rng) -> Vec<(Duration, usize)> {
    let mut out = Vec::new();
    let mut start = 0.0;
    for (i, ph) in shift.phases.iter().enumerate() {
        let end = start + ph.length.as_secs_f64();
        let mut t = start;
        loop {
            t += rng.exp(ph.rate);
            if t >= end {
                break;
            }
            out.push((Duration::from_secs_f64(t), i));
        }
        start = end;
    }
    out
}

/// The pool of each stage, for an elastic run (every pool serves one stage, each stage once).
fn stage_pools(p: &Prepared) -> Result<[usize; 3]> {
    let mut of = [usize::MAX; 3];
    for (pi, pool) in p.layout.pools.iter().enumerate() {
        let runs = pool.runs();
        if runs.len() != 1 || runs[0].len() != 1 || of[runs[0][0].index()] != usize::MAX {
            return Err(format!(
                "--elastic moves GPUs between single-stage pools (E:x|D:y|V:z); {} is not one",
                p.layout
            )
            .into());
        }
        of[runs[0][0].index()] = pi;
    }
    if of.contains(&usize::MAX) {
        return Err(format!("--elastic: {} lacks a pool for a stage", p.layout).into());
    }
    Ok(of)
}

/// Runs `p` under `load`, or under `shift` when given (its phases replace the load's arrivals),
/// with GPUs moved between pools when `elastic` is given.
pub fn simulate_with(
    p: &Prepared,
    mix: &Mix,
    k: &Knobs,
    load: Load,
    shift: Option<&Shift>,
    elastic: Option<&Elastic>,
) -> Result<Outcome> {
    let pool_of_stage = match elastic {
        Some(_) => Some(stage_pools(p)?),
        None => None,
    };
    let ms = |x: f64| Duration::from_secs_f64(x.max(0.0) / 1e3);
    let xfer = |bytes: u64| {
        Duration::from_secs_f64(
            bytes as f64 / (k.net.bandwidth_gbps * 1e9) + k.net.latency_ms / 1e3,
        )
    };
    let mean_denoise: f64 = mix.entries.iter().map(|e| e.share * e.model.denoise_ms()).sum();
    let aging = k.aging.unwrap_or(ms(mean_denoise) * 4);
    let cfg = SchedConfig {
        heartbeat_timeout: Duration::MAX,
        preempt: k.preempt,
        aging,
        ..SchedConfig::default()
    };
    let mut d: Driver<(), Duration> = Driver::new(cfg, policy(&k.policy)?);
    let mut roles: HashMap<WorkerId, Role> = HashMap::new();
    let mut gpus: Vec<Gpu> = Vec::new();
    let runs_of: Vec<Vec<Vec<Stage>>> = p.layout.pools.iter().map(|q| q.runs()).collect();
    for (pi, pool) in p.layout.pools.iter().enumerate() {
        for g in 0..pool.count {
            let gpu = gpus.len();
            gpus.push(Gpu { pool: Some(pi), ..Gpu::default() });
            for (run, stages) in runs_of[pi].iter().enumerate() {
                let host = format!("p{pi}g{g}");
                let id = d.join(stages[0], 1, &host, vec![], (), Duration::ZERO);
                roles.insert(id, Role::Gpu { gpu, pool: pi, run });
            }
        }
        for stages in &runs_of[pi] {
            for &s in &stages[1..] {
                let id = d.join(s, PASS_SLOTS, "pass", vec![], (), Duration::ZERO);
                roles.insert(id, Role::Pass);
            }
        }
    }
    let (rate, requests) = match load {
        Load::Poisson { rate, requests } => (Some(rate), requests),
        Load::Saturated { requests } => (None, requests),
    };
    let mut rng = Rng::new(k.seed);
    let mut events: BinaryHeap<Reverse<SimEvent>> = BinaryHeap::new();
    let mut phase_of = Vec::new();
    let requests = match shift {
        Some(sh) => {
            for (r, (at, ph)) in shift_arrivals(sh, &mut rng).into_iter().enumerate() {
                events.push(Reverse((at, r as u64, Ev::Arrive(r as u64))));
                phase_of.push(ph);
            }
            phase_of.len() as u64
        }
        None => {
            let mut t = 0.0;
            for r in 0..requests {
                if let Some(rate) = rate {
                    t += rng.exp(rate);
                }
                events.push(Reverse((Duration::from_secs_f64(t), r, Ev::Arrive(r))));
            }
            requests
        }
    };
    let n = usize::try_from(requests).map_err(|_| "too many requests")?;
    let mut entry_of = vec![0u32; n];
    let mut arrived = vec![Duration::ZERO; n];
    let mut interactive = vec![false; n];
    let mut runs: HashMap<ItemKey, DenoiseRun> = HashMap::new();
    let mut first_frame: HashMap<ItemKey, Duration> = HashMap::new();
    let mut cut: HashSet<u64> = HashSet::new();
    let mut out = Outcome::default();
    let mut seq = requests;
    let mut now = Duration::ZERO;
    // Busy and member time per pool (GPUs may move between pools).
    let mut busy = vec![Duration::ZERO; p.layout.pools.len()];
    let mut member = vec![Duration::ZERO; p.layout.pools.len()];
    // Elastic: the rebalancer, what it measures, and the GPUs told to move (worker -> pool).
    let mut started: HashMap<(ItemKey, WorkerId), Duration> = HashMap::new();
    let mut reb = elastic.map(|e| Rebalancer::new(e.cfg.clone()));
    let mut flow = Flow::new(Duration::ZERO, prior_service(p, mix, shift, pool_of_stage));
    let mut moving: HashMap<WorkerId, (usize, usize)> = HashMap::new();
    if let Some(e) = elastic {
        events.push(Reverse((e.cfg.interval, u64::MAX, Ev::Rebalance)));
    }
    let every = k.checkpoint_every;
    // Checkpoint saves at steps in (from, to) (the last step's latents go to decode instead).
    let saves = |from: u32, to: u32, steps: u32| -> u32 {
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
                let i = r as usize;
                arrived[i] = at;
                let e = match shift {
                    Some(sh) => pick(sh.phases[phase_of[i]].shares.iter().copied(), rng.next_f64()),
                    None if mix.entries.len() > 1 => mix.pick(rng.next_f64()),
                    None => 0,
                };
                entry_of[i] = e as u32;
                let draw = rng.next_f64() < k.interactive;
                let pr = mix.entries[e].priority.unwrap_or(if draw {
                    Priority::Interactive
                } else {
                    Priority::Batch
                });
                interactive[i] = pr == Priority::Interactive;
                if rng.next_f64() < k.embedding_hit_rate {
                    out.reuse.encode_skipped += 1;
                    let s = Submit { start: Stage::Denoise, ..Submit::new(r, pr) };
                    let _ = d.submit_with(s, b"cached embedding".to_vec(), at, at);
                } else {
                    let _ = d.submit(Submit::new(r, pr), at, at);
                }
            }
            Ev::Done(key, w) => {
                if cut.remove(&sq) {
                    continue; // it yielded before
                }
                if let Some(s) = started.remove(&(key, w)) {
                    flow.ended(key.stage, at - s);
                }
                let i = key.request as usize;
                if let Some(run) = runs.remove(&key) {
                    let m = &mix.entries[entry_of[i] as usize].model;
                    let steps = m.steps.max(1);
                    out.reuse.checkpoint_bytes +=
                        u64::from(saves(run.from, steps, steps)) * m.latent_bytes;
                }
                if let Some(f) = first_frame.remove(&key) {
                    out.ttff.push(f - arrived[i]);
                    if interactive[i] {
                        out.ttff_interactive.push(f - arrived[i]);
                    }
                }
                d.result(w, key, StageResult::Done(Vec::new()), at);
            }
            Ev::Yield(key, w, step) => {
                if let Some(run) = runs.remove(&key) {
                    let m = &mix.entries[entry_of[key.request as usize] as usize].model;
                    let saved = saves(run.from, step, m.steps.max(1)) + 1;
                    out.reuse.checkpoint_bytes += u64::from(saved) * m.latent_bytes;
                    let g = &mut gpus[run.gpu];
                    if g.free_at == run.end {
                        if let Some(pi) = g.pool {
                            busy[pi] = busy[pi].saturating_sub(run.end.saturating_sub(at));
                        }
                        g.free_at = at;
                    }
                }
                if let Some(s) = started.remove(&(key, w)) {
                    flow.ended(key.stage, at - s);
                }
                first_frame.remove(&key);
                out.reuse.preempted += 1;
                d.yielded(w, key, step, b"checkpoint".to_vec(), at);
            }
            Ev::Rebalance => {
                // Elastic pools serve one stage each: a pool's stage is its only run's.
                let (Some(e), Some(r), Some(of)) = (elastic, reb.as_mut(), pool_of_stage) else {
                    continue;
                };
                let sc = d.sched();
                let loads = flow.window(
                    at,
                    Stage::ALL.map(|s| sc.queued(s)),
                    Stage::ALL.map(|s| sc.running(s)),
                );
                let mut members: Vec<Member> = roles
                    .iter()
                    .filter(|(w, _)| !moving.contains_key(w))
                    .filter_map(|(&worker, role)| match *role {
                        Role::Gpu { gpu, pool, .. } => {
                            let stage = runs_of[pool][0][0];
                            let can = Stage::ALL
                                .into_iter()
                                .filter(|&s| s != stage)
                                .map(|s| (s, e.switch[s.index()]))
                                .collect();
                            Some(Member { worker, stage, slots: 1, since: gpus[gpu].since, can })
                        }
                        Role::Pass => None,
                    })
                    .collect();
                members.sort_by_key(|m| m.worker);
                for mv in r.decide(at, &loads, &members) {
                    let Some(&Role::Gpu { gpu, .. }) = roles.get(&mv.worker) else { continue };
                    moving.insert(mv.worker, (gpu, of[mv.to.index()]));
                    out.moves.push(Moved { at, joined: at, gpu, from: mv.from, to: mv.to });
                    d.drain(mv.worker, at);
                }
                // Keep deciding while anything is left to happen.
                if !events.is_empty() {
                    events.push(Reverse((at + e.cfg.interval, u64::MAX, Ev::Rebalance)));
                }
            }
            Ev::Switched(gpu, pool) => {
                let stage = runs_of[pool][0][0];
                let g = &mut gpus[gpu];
                g.pool = Some(pool);
                g.since = at;
                g.free_at = g.free_at.max(at);
                let id = d.join(stage, 1, &format!("g{gpu}"), vec![], (), at);
                roles.insert(id, Role::Gpu { gpu, pool, run: 0 });
                if let Some(m) = out.moves.iter_mut().rev().find(|m| m.gpu == gpu) {
                    m.joined = at;
                }
            }
        }
        // Drained GPUs leave their pool and switch.
        let drained: Vec<WorkerId> = d.take_drained().into_iter().map(|(w, _)| w).collect();
        for w in drained {
            let Some((gpu, pool)) = moving.remove(&w) else { continue };
            roles.remove(&w);
            d.leave(w, now);
            let g = &mut gpus[gpu];
            let free = now.max(g.free_at);
            if let Some(pi) = g.pool.take() {
                member[pi] += free.saturating_sub(g.since);
            }
            let cost = elastic.map_or(Duration::ZERO, |e| e.switch[runs_of[pool][0][0].index()]);
            seq += 1;
            events.push(Reverse((free + cost, seq, Ev::Switched(gpu, pool))));
        }
        for t0 in d.take_outcomes().into_iter().filter_map(|e| e.waiter) {
            out.e2e.push(now - t0);
        }
        drop(d.take_dead()); // simulated workers never go silent; keep the list empty
        for x in d.dispatch(now) {
            let (key, w) = (x.dispatch.item.key, x.dispatch.worker);
            let Some(&Role::Gpu { gpu, pool, run }) = roles.get(&w) else {
                seq += 1;
                events.push(Reverse((now, seq, Ev::Done(key, w))));
                continue;
            };
            let e = entry_of[key.request as usize] as usize;
            let m = &mix.entries[e].model;
            let cost = &p.fits[pool].costs[e];
            let stages = &runs_of[pool][run];
            let steps = m.steps.max(1);
            let from = x.resume.map_or(0, |(s, _)| s.min(steps));
            let start = now.max(gpus[gpu].free_at);
            // The input from another pool (or the store), then each stage of the run.
            let mut t = match stages[0] {
                Stage::Encode => Duration::ZERO,
                Stage::Denoise if from > 0 => xfer(m.embed_bytes) + xfer(m.latent_bytes),
                Stage::Denoise => xfer(m.embed_bytes),
                Stage::Decode => xfer(m.latent_bytes),
            };
            let mut denoise = None;
            for &s in stages {
                let c = cost[s.index()].ok_or("a pool's fit covers its stages")?.ms;
                match s {
                    Stage::Encode => t += ms(c),
                    Stage::Denoise => {
                        out.reuse.resumed_steps += u64::from(from);
                        let work = ms(c) * (steps - from)
                            + xfer(m.latent_bytes) * saves(from, steps, steps);
                        let per_step = work / (steps - from).max(1);
                        denoise = Some((t, per_step));
                        t += work;
                    }
                    Stage::Decode => {
                        let chunks = m.chunks().map_or(1, |(_, n)| n);
                        let f = if stages[0] == Stage::Decode {
                            xfer(m.latent_bytes / u64::from(chunks)) + ms(c / f64::from(chunks))
                        } else {
                            t + ms(c / f64::from(chunks))
                        };
                        first_frame.insert(key, start + f);
                        t += ms(c);
                    }
                }
            }
            let g = &mut gpus[gpu];
            g.free_at = start + t;
            busy[pool] += t;
            started.insert((key, w), start);
            seq += 1;
            if let Some((base, per_step)) = denoise {
                let end = start + t;
                runs.insert(key, DenoiseRun { gpu, start, base, from, per_step, end, seq });
            }
            events.push(Reverse((start + t, seq, Ev::Done(key, w))));
        }
        // Asked to yield: the job stops at its next step boundary (past the one it started
        // at), saving a checkpoint; one that would reach its last step first just finishes.
        for (key, w, _) in d.take_asks() {
            let Some(run) = runs.get(&key) else { continue };
            let steps = mix.entries[entry_of[key.request as usize] as usize].model.steps.max(1);
            let latent = mix.entries[entry_of[key.request as usize] as usize].model.latent_bytes;
            let ran = now.saturating_sub(run.start + run.base);
            let done = (ran.as_secs_f64() / run.per_step.as_secs_f64().max(1e-12)) as u32;
            let at_step = run.from + done + 1;
            if at_step >= steps {
                continue;
            }
            let when = run.start + run.base + run.per_step * (at_step - run.from) + xfer(latent);
            cut.insert(run.seq);
            seq += 1;
            events.push(Reverse((when, seq, Ev::Yield(key, w, at_step))));
        }
    }
    let span = now.as_secs_f64().max(1e-9);
    out.throughput = out.e2e.len() as f64 / span;
    for g in &gpus {
        if let Some(pi) = g.pool {
            member[pi] += now.saturating_sub(g.since);
        }
    }
    out.utilisation = busy
        .iter()
        .zip(&member)
        .map(|(b, m)| b.as_secs_f64() / m.as_secs_f64().max(1e-9))
        .collect();
    out.decisions = d.sched().stats().dispatched;
    Ok(out)
}

/// The capacity model's mean time of one item per stage on its pool (denoise: every step), over
/// the first phase's shares (or the mix's): what the rebalancer assumes until items end.
fn prior_service(
    p: &Prepared,
    mix: &Mix,
    shift: Option<&Shift>,
    pools: Option<[usize; 3]>,
) -> [Duration; 3] {
    let Some(of) = pools else { return [Duration::ZERO; 3] };
    let shares: Vec<f64> = match shift.and_then(|s| s.phases.first()) {
        Some(ph) => ph.shares.clone(),
        None => mix.entries.iter().map(|e| e.share).collect(),
    };
    Stage::ALL.map(|s| {
        let ms: f64 = mix
            .entries
            .iter()
            .enumerate()
            .map(|(e, en)| {
                let c = p.fits[of[s.index()]].costs[e][s.index()].map_or(0.0, |c| c.ms);
                let per =
                    if s == Stage::Denoise { c * f64::from(en.model.steps.max(1)) } else { c };
                shares.get(e).copied().unwrap_or(0.0) * per
            })
            .sum();
        Duration::from_secs_f64(ms.max(0.0) / 1e3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profiles;

    fn knobs() -> Knobs {
        Knobs {
            policy: "max-free".into(),
            interactive: 0.0,
            embedding_hit_rate: 0.0,
            checkpoint_every: 0,
            aging: None,
            preempt: true,
            cfg: true,
            net: Net { bandwidth_gbps: 25.0, latency_ms: 0.05 },
            seed: 1,
        }
    }

    fn run(layout: &str, load: Load) -> (Prepared, Outcome, Mix) {
        let all = profiles::load(None).unwrap();
        let mix =
            Mix::single(profiles::pick(&all, &["wan2.1-t2v-1.3b-480p".into()]).unwrap()[0].clone());
        let classes = classes::load(None).unwrap();
        let p =
            Prepared::new(&Layout::parse(layout, "h100").unwrap(), &classes, &mix, true).unwrap();
        let o = simulate(&p, &mix, &knobs(), load).unwrap();
        (p, o, mix)
    }

    #[test]
    fn one_request_costs_its_stages_plus_the_transfers_between_pools() {
        let secs = |d: Duration| d.as_secs_f64();
        let (_, o, mix) = run("EDV:1", Load::Saturated { requests: 1 });
        let m = &mix.entries[0].model;
        let whole = (m.encode_ms + m.denoise_ms() + m.decode_ms) / 1e3;
        assert!((secs(o.e2e[0]) - whole).abs() < 1e-6, "{:?}", o.e2e);
        // The first frame: the first of 7 chunks decoded.
        let first = (m.encode_ms + m.denoise_ms() + m.decode_ms / 7.0) / 1e3;
        assert!((secs(o.ttff[0]) - first).abs() < 1e-6, "{:?}", o.ttff);
        let (_, o, _) = run("E:1|D:1|V:1", Load::Saturated { requests: 1 });
        let hop = |b: u64| b as f64 / 25e9 + 0.05e-3;
        let apart = whole + hop(m.embed_bytes) + hop(m.latent_bytes);
        assert!((secs(o.e2e[0]) - apart).abs() < 1e-6, "{} vs {apart}", secs(o.e2e[0]));
        // Decode fused with denoise: no latent transfer.
        let (_, o, _) = run("E:1|DV:1", Load::Saturated { requests: 1 });
        assert!((secs(o.e2e[0]) - (whole + hop(m.embed_bytes))).abs() < 1e-6);
    }

    #[test]
    fn saturated_capacity_meets_the_analytic_bound_and_no_gpu_runs_two_items() {
        for layout in ["EDV:8", "E:1|DV:7", "EV:1|D:7", "ED:6|V:2", "E:1|D:6|V:1"] {
            let (p, o, mix) = run(layout, Load::Saturated { requests: 2000 });
            let (bound, _) = crate::plan::bound(&p, &mix, 0.0);
            assert!(o.throughput <= bound * 1.001, "{layout}: {} > {bound}", o.throughput);
            assert!(o.throughput >= bound * 0.95, "{layout}: {} << {bound}", o.throughput);
            assert!(
                o.utilisation.iter().all(|&u| u <= 1.0 + 1e-9),
                "{layout}: {:?}",
                o.utilisation
            );
            assert_eq!(o.e2e.len(), 2000, "{layout}");
        }
    }
}
