//! Elastic pools, sans-IO: which workers to move between stage pools as the workload shifts.
//!
//! [`Flow`] turns what a driver sees (items ended per stage with their service times, items
//! queued and running) into a [`PoolLoad`] per stage at each decision; [`Rebalancer::decide`]
//! turns the loads and the pools' members into [`Move`]s. Neither does IO or reads a clock: the
//! service and the simulator (`tensorwire simulate --elastic`) pass the time in and carry the
//! moves out (drain the worker, let it load the other stage's weights, let it join again).
//!
//! The model: a pool of stage `s` needs `demand(s) = arrivals/s x service time` slots to keep
//! up, plus `queued x service time / horizon` to clear its backlog within the horizon; its
//! load is demand over its slots (for denoise, the slots decode lets work: below). The
//! rebalancer lowers the largest load. A move from pool A to pool B is made only if
//! - some pool is short (the largest load is over 1): pools that keep up are left alone;
//! - the worker can serve B, has been in A for at least the dwell time, and A keeps at least
//!   `min_workers` (and is never emptied while it has demand);
//! - the largest load drops by at least the hysteresis factor;
//! - it pays within the horizon: the largest load falls from `before` to `after`, so the
//!   pipeline serves `before / after - 1` more over the horizon less the switch time; the
//!   switch idles the worker's share of A (`slots / A's slots`) for the switch time; the first
//!   must exceed the second.
//!
//! Every item that enters a stage enters the next one (a cached embedding skips encode, never
//! the later stages), so a stage's arrival rate is taken as at least its upstream's: a pool
//! starved by its neighbour does not make the next one look idle.
//!
//! Decode gates denoise: the scheduler admits a denoise job only while fewer latents wait for
//! decode than the decode pool has slots (plus the headroom). A decode pool busy two thirds of
//! the time on one slot holds denoise back 44% of the time (M/M/1: P(N >= 2) = rho^2), so
//! denoise's slots count for the share of the time decode's queue leaves room (Erlang C:
//! P(queue >= c + h) = C(c, a) rho^(c + h)): a decoder added can lower denoise's load.
//!
//! Each move strictly lowers the largest load, so under loads that stay put no assignment of
//! workers comes back and the moves stop (the property tests check it); the dwell time and
//! `max_moves` per `interval` bound how fast a worker can be sent back when the loads do shift.

use std::time::Duration;

use crate::sched::WorkerId;
use crate::stage::Stage;

/// Rebalancer settings.
#[derive(Debug, Clone)]
pub struct RebalanceConfig {
    /// Time between decisions.
    pub interval: Duration,
    /// A worker stays in a pool at least this long after joining it.
    pub dwell: Duration,
    /// Backlogs are to be cleared, and switches paid back, within this time.
    pub horizon: Duration,
    /// Moves per decision, at most.
    pub max_moves: usize,
    /// A move must cut the largest pool load by this factor (>= 1).
    pub hysteresis: f64,
    /// Workers a pool keeps, at least (a pool with demand always keeps one).
    pub min_workers: usize,
    /// The scheduler's [`decode_headroom`](crate::sched::SchedConfig::decode_headroom).
    pub decode_headroom: u32,
}

impl Default for RebalanceConfig {
    /// A decision every 10 s, 60 s of dwell, a 300 s horizon, one move per decision, 1.05
    /// hysteresis, one worker per pool at least, the scheduler's default decode headroom.
    fn default() -> Self {
        RebalanceConfig {
            interval: Duration::from_secs(10),
            dwell: Duration::from_secs(60),
            horizon: Duration::from_secs(300),
            max_moves: 1,
            hysteresis: 1.05,
            min_workers: 1,
            decode_headroom: 0,
        }
    }
}

impl RebalanceConfig {
    /// Checks the settings.
    pub fn check(&self) -> Result<(), String> {
        if self.interval.is_zero() || self.horizon.is_zero() {
            return Err("rebalance interval and horizon must be > 0".into());
        }
        if !(self.hysteresis.is_finite() && self.hysteresis >= 1.0) {
            return Err(format!("rebalance hysteresis {}: must be >= 1", self.hysteresis));
        }
        Ok(())
    }
}

/// What a stage's pool is asked to do, over the last window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolLoad {
    /// Items entering the stage per second.
    pub arrivals_per_s: f64,
    /// Mean service time of one item on one slot.
    pub service: Duration,
    /// Items waiting.
    pub queued: usize,
}

impl PoolLoad {
    /// Slots the pool needs: to keep up with arrivals, and to clear its backlog within
    /// `horizon`.
    pub fn demand(&self, horizon: Duration) -> f64 {
        let s = self.service.as_secs_f64();
        let d = self.arrivals_per_s.max(0.0) * s + self.queued as f64 * s / horizon.as_secs_f64();
        if d.is_finite() { d } else { 0.0 }
    }

    /// Whether the pool has anything to do.
    pub fn has_work(&self) -> bool {
        self.queued > 0 || self.arrivals_per_s > 0.0
    }
}

/// A worker the rebalancer may move.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    /// Its id.
    pub worker: WorkerId,
    /// The stage it serves now.
    pub stage: Stage,
    /// Its slots.
    pub slots: u32,
    /// When it joined its pool.
    pub since: Duration,
    /// Every other stage it can serve, with the time it takes to switch to it.
    pub can: Vec<(Stage, Duration)>,
}

impl Member {
    /// The time to switch to `to`, if this worker can serve it.
    pub fn switch_cost(&self, to: Stage) -> Option<Duration> {
        self.can.iter().find(|(s, _)| *s == to).map(|(_, c)| *c)
    }
}

/// Move `worker` from pool `from` to pool `to`; it is idle for `cost` in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    /// The worker.
    pub worker: WorkerId,
    /// The pool it leaves.
    pub from: Stage,
    /// The pool it joins.
    pub to: Stage,
    /// Its switch time.
    pub cost: Duration,
}

/// Decides moves at most once per interval, and never undoes a move (sends a worker from B to
/// A after one went from A to B) within the dwell time.
#[derive(Debug, Clone)]
pub struct Rebalancer {
    cfg: RebalanceConfig,
    next_at: Duration,
    /// Recent moves: when, from, to.
    recent: Vec<(Duration, Stage, Stage)>,
}

impl Rebalancer {
    /// A rebalancer whose first decision is one interval after time zero.
    pub fn new(cfg: RebalanceConfig) -> Rebalancer {
        let next_at = cfg.interval;
        Rebalancer { cfg, next_at, recent: Vec::new() }
    }

    /// Whether a decision is due at `now`.
    pub fn due(&self, now: Duration) -> bool {
        now >= self.next_at
    }

    /// The moves to make at `now` (none before the next decision is due). `loads` is indexed by
    /// [`Stage::index`]; `members` are the live workers (those draining or switching left out).
    pub fn decide(
        &mut self,
        now: Duration,
        loads: &[PoolLoad; 3],
        members: &[Member],
    ) -> Vec<Move> {
        if !self.due(now) {
            return Vec::new();
        }
        self.next_at = now + self.cfg.interval;
        let dwell = self.cfg.dwell;
        self.recent.retain(|(at, _, _)| now < at.saturating_add(dwell));
        let undo: Vec<(Stage, Stage)> = self.recent.iter().map(|&(_, a, b)| (b, a)).collect();
        let moves = plan_except(&self.cfg, now, loads, members, &undo);
        self.recent.extend(moves.iter().map(|m| (now, m.from, m.to)));
        moves
    }
}

/// One decision: up to `max_moves` moves, each the best of those that pass every rule, with the
/// pools' slots updated after each.
pub fn plan(
    cfg: &RebalanceConfig,
    now: Duration,
    loads: &[PoolLoad; 3],
    members: &[Member],
) -> Vec<Move> {
    plan_except(cfg, now, loads, members, &[])
}

/// [`plan`] without moves from `.0` to `.1` of any pair in `barred`.
fn plan_except(
    cfg: &RebalanceConfig,
    now: Duration,
    loads: &[PoolLoad; 3],
    members: &[Member],
    barred: &[(Stage, Stage)],
) -> Vec<Move> {
    let h = cfg.horizon;
    let demand = demands(loads, h);
    let largest = |slots: &[f64; 3]| largest_load(&demand, slots, cfg.decode_headroom);
    let mut slots = [0f64; 3];
    let mut count = [0usize; 3];
    for m in members {
        slots[m.stage.index()] += f64::from(m.slots);
        count[m.stage.index()] += 1;
    }
    let mut moved: Vec<WorkerId> = Vec::new();
    let mut out = Vec::new();
    while out.len() < cfg.max_moves {
        let before = largest(&slots);
        if before <= 1.0 {
            break; // every pool keeps up
        }
        // (improvement, B's backlog, worker id reversed for the lowest id), the move, its slots
        type Key = (f64, usize, std::cmp::Reverse<u64>);
        let mut best: Option<(Key, Move, f64)> = None;
        for m in members {
            if moved.contains(&m.worker) || now < m.since.saturating_add(cfg.dwell) {
                continue;
            }
            let a = m.stage.index();
            let left = count[a] - 1;
            if left < cfg.min_workers || (left == 0 && loads[a].has_work()) {
                continue;
            }
            for &(to, cost) in &m.can {
                let b = to.index();
                if b == a || cost >= h || barred.contains(&(m.stage, to)) {
                    continue;
                }
                let ms = f64::from(m.slots);
                let mut moved_slots = slots;
                moved_slots[a] -= ms;
                moved_slots[b] += ms;
                let after = largest(&moved_slots);
                if after.is_nan() || after * cfg.hysteresis > before || after >= before {
                    continue;
                }
                // Relative service gained over the horizon against the share idled by the switch.
                let gained = (before / after - 1.0) * (h - cost).as_secs_f64();
                let idled = ms / slots[a] * cost.as_secs_f64();
                if gained <= idled {
                    continue;
                }
                let gain = if before.is_infinite() { f64::MAX } else { before - after };
                let key: Key = (gain, loads[b].queued, std::cmp::Reverse(m.worker.0));
                let better = best.as_ref().is_none_or(|((g, q, w), _, _)| {
                    key.0.total_cmp(g).then(key.1.cmp(q)).then(key.2.cmp(w)).is_gt()
                });
                if better {
                    best = Some((key, Move { worker: m.worker, from: m.stage, to, cost }, ms));
                }
            }
        }
        let Some((_, mv, ms)) = best else { break };
        slots[mv.from.index()] -= ms;
        slots[mv.to.index()] += ms;
        count[mv.from.index()] -= 1;
        count[mv.to.index()] += 1;
        moved.push(mv.worker);
        out.push(mv);
    }
    out
}

/// Erlang C: the chance an arrival waits at an M/M/c queue offered `a` (erlangs); 1 when
/// overloaded.
fn erlang_c(c: u32, a: f64) -> f64 {
    let cf = f64::from(c);
    if c == 0 || a >= cf {
        return 1.0;
    }
    // Erlang B by its recurrence, then C from B.
    let mut b = 1.0;
    for k in 1..=c {
        b = a * b / (f64::from(k) + a * b);
    }
    let rho = a / cf;
    b / (1.0 - rho + rho * b)
}

/// The share of the time a decode pool of `c` slots offered `a` erlangs holds `c + headroom`
/// latents or more in its queue (denoise admissions wait then); 1 when overloaded.
pub fn blocked(c: u32, a: f64, headroom: u32) -> f64 {
    if a.is_nan() || a <= 0.0 {
        return 0.0;
    }
    if c == 0 || a >= f64::from(c) {
        return 1.0;
    }
    let rho = a / f64::from(c);
    (erlang_c(c, a) * rho.powf(f64::from(c) + f64::from(headroom))).clamp(0.0, 1.0)
}

/// Each stage's demand in slots (see [`PoolLoad::demand`]). What enters a stage enters the next
/// one: a stage's arrivals are taken as at least its upstream's (else a starved pool's output
/// understates what its downstream will need).
fn demands(loads: &[PoolLoad; 3], horizon: Duration) -> [f64; 3] {
    let mut loads = *loads;
    for i in 1..loads.len() {
        loads[i].arrivals_per_s = loads[i].arrivals_per_s.max(loads[i - 1].arrivals_per_s);
    }
    std::array::from_fn(|i| loads[i].demand(horizon))
}

/// The largest of [`pool_loads`].
fn largest_load(demand: &[f64; 3], slots: &[f64; 3], headroom: u32) -> f64 {
    pool_loads(demand, slots, headroom).into_iter().fold(0.0, f64::max)
}

/// Each pool's load, `demand / slots` (infinite for demand without slots): denoise's slots
/// count for the share of the time decode leaves room for its admissions.
fn pool_loads(demand: &[f64; 3], slots: &[f64; 3], headroom: u32) -> [f64; 3] {
    let load = |d: f64, s: f64| {
        if s > 0.0 {
            d / s
        } else if d > 0.0 {
            f64::INFINITY
        } else {
            0.0
        }
    };
    let (e, n, v) = (Stage::Encode.index(), Stage::Denoise.index(), Stage::Decode.index());
    let open = 1.0 - blocked(slots[v].round().max(0.0) as u32, demand[v], headroom);
    let mut out = [0.0; 3];
    out[e] = load(demand[e], slots[e]);
    out[n] = load(demand[n], slots[n] * open);
    out[v] = load(demand[v], slots[v]);
    out
}

/// Measures each stage's [`PoolLoad`] between decisions from what a driver sees: items ended
/// (with how long they ran) and a snapshot of items queued and running at each decision.
/// Arrivals are what flowed in: items ended in the window plus the growth of queued and running.
#[derive(Debug, Clone)]
pub struct Flow {
    since: Duration,
    present: [usize; 3],
    ended: [u64; 3],
    busy: [Duration; 3],
    service: [Duration; 3],
    rate: [Option<f64>; 3],
}

impl Flow {
    /// A flow starting at `now`, with `prior` service times per stage (the capacity model's, or
    /// a guess) used until items of a stage have ended.
    pub fn new(now: Duration, prior: [Duration; 3]) -> Flow {
        Flow {
            since: now,
            present: [0; 3],
            ended: [0; 3],
            busy: [Duration::ZERO; 3],
            service: prior,
            rate: [None; 3],
        }
    }

    /// An item of `stage` ended after running `took` (yields count too: their time was spent).
    pub fn ended(&mut self, stage: Stage, took: Duration) {
        let i = stage.index();
        self.ended[i] += 1;
        self.busy[i] = self.busy[i].saturating_add(took);
    }

    /// The loads since the last call, given the items `queued` and `running` per stage now; starts
    /// the next window.
    pub fn window(
        &mut self,
        now: Duration,
        queued: [usize; 3],
        running: [usize; 3],
    ) -> [PoolLoad; 3] {
        let span = now.saturating_sub(self.since).as_secs_f64();
        let mut out = [PoolLoad { arrivals_per_s: 0.0, service: Duration::ZERO, queued: 0 }; 3];
        for i in 0..3 {
            let present = queued[i] + running[i];
            let inflow = self.ended[i] as f64 + present as f64 - self.present[i] as f64;
            if self.ended[i] > 0 {
                // Mostly the new window's mean; a little of the past so one odd item is no step.
                let mean = self.busy[i] / u32::try_from(self.ended[i]).unwrap_or(u32::MAX);
                self.service[i] =
                    if self.service[i].is_zero() { mean } else { (mean * 3 + self.service[i]) / 4 };
            }
            // Arrivals come in bursts (a Poisson window of 30 s at 0.5/s is 15 +- 4): smoothed
            // over about four windows.
            let now_rate = if span > 0.0 { inflow.max(0.0) / span } else { 0.0 };
            let rate = match self.rate[i] {
                Some(old) => (now_rate + 3.0 * old) / 4.0,
                None => now_rate,
            };
            self.rate[i] = Some(rate);
            out[i] = PoolLoad { arrivals_per_s: rate, service: self.service[i], queued: queued[i] };
            self.present[i] = present;
        }
        self.since = now;
        self.ended = [0; 3];
        self.busy = [Duration::ZERO; 3];
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn member(id: u64, stage: Stage, cost: u64) -> Member {
        let can = Stage::ALL.into_iter().filter(|&s| s != stage).map(|s| (s, secs(cost))).collect();
        Member { worker: WorkerId(id), stage, slots: 1, since: Duration::ZERO, can }
    }

    /// `e` encoders, `d` denoisers and `v` decoders (ids from 1, in that order), each able to
    /// switch to the other stages in 5 s.
    fn pools(e: usize, d: usize, v: usize) -> Vec<Member> {
        let stages = [(Stage::Encode, e), (Stage::Denoise, d), (Stage::Decode, v)];
        let all = stages.into_iter().flat_map(|(s, n)| std::iter::repeat_n(s, n));
        all.enumerate().map(|(i, s)| member(i as u64 + 1, s, 5)).collect()
    }

    fn loads(rates: [f64; 3], service: [u64; 3], queued: [usize; 3]) -> [PoolLoad; 3] {
        std::array::from_fn(|i| PoolLoad {
            arrivals_per_s: rates[i],
            service: Duration::from_millis(service[i]),
            queued: queued[i],
        })
    }

    #[test]
    fn an_overloaded_pool_gets_a_worker_from_an_idle_one() {
        let cfg = RebalanceConfig::default();
        let ms = pools(1, 1, 3);
        // Denoise needs 4 slots (1/s x 4 s), decode 0.3.
        let l = loads([1.0, 1.0, 1.0], [100, 4000, 300], [0, 10, 0]);
        let moves = plan(&cfg, secs(100), &l, &ms);
        assert_eq!(moves.len(), 1);
        assert_eq!((moves[0].from, moves[0].to), (Stage::Decode, Stage::Denoise));
        // More per decision when allowed, down to the last decoder; the encoder (the last
        // one) stays.
        let cfg = RebalanceConfig { max_moves: 5, ..cfg };
        let moves = plan(&cfg, secs(100), &l, &ms);
        assert_eq!(moves.len(), 2, "{moves:?}");
        assert!(moves.iter().all(|m| m.from == Stage::Decode && m.to == Stage::Denoise));
    }

    #[test]
    fn a_pool_with_work_keeps_its_last_worker_before_its_service_time_is_known() {
        // A new service: encode has items queued but none has ended, so its service time (and
        // with it its demand and load) reads zero; denoise is short. Moving encode's only
        // worker would lower the largest load, and leave the queued items with nobody.
        let cfg = RebalanceConfig { min_workers: 0, ..RebalanceConfig::default() };
        let ms = pools(1, 1, 0);
        let l = loads([0.0, 1.0, 0.0], [0, 4000, 0], [5, 10, 0]);
        assert!(plan(&cfg, secs(100), &l, &ms).is_empty(), "a pool with work was emptied");
        // Arrivals alone are work too.
        let l = loads([1.0, 1.0, 0.0], [0, 4000, 0], [0, 10, 0]);
        assert!(plan(&cfg, secs(100), &l, &ms).is_empty(), "a pool with arrivals was emptied");
        // With nothing to do, its worker goes where it is needed.
        let l = loads([0.0, 1.0, 0.0], [0, 4000, 0], [0, 10, 0]);
        let moves = plan(&cfg, secs(100), &l, &ms);
        assert_eq!(moves.len(), 1, "{moves:?}");
        assert_eq!((moves[0].from, moves[0].to), (Stage::Encode, Stage::Denoise));
    }

    #[test]
    fn a_switch_that_costs_more_than_it_saves_is_not_made() {
        let ms = pools(1, 1, 2);
        // Denoise is 10% short; a decoder is free to take it, and halves denoise's load. Over
        // the 300 s horizon that gains about 1 x (300 - switch), against half the decode pool
        // idle for the switch: a 5 s switch pays, a 250 s one does not.
        let l = loads([1.0, 1.0, 0.1], [100, 1100, 100], [0, 0, 0]);
        let cfg = RebalanceConfig { hysteresis: 1.0, ..RebalanceConfig::default() };
        assert_eq!(plan(&cfg, secs(100), &l, &ms).len(), 1);
        let ms: Vec<Member> = ms
            .into_iter()
            .map(|mut m| {
                for c in &mut m.can {
                    c.1 = secs(250)
                }
                m
            })
            .collect();
        assert!(plan(&cfg, secs(100), &l, &ms).is_empty());
    }

    #[test]
    fn a_decode_pool_that_holds_denoise_back_gets_a_worker() {
        // One slot two thirds busy blocks 44% of the time (M/M/1: rho^2); two slots 1.8%.
        assert!((erlang_c(1, 0.66) - 0.66).abs() < 1e-12);
        assert!((blocked(1, 0.66, 0) - 0.4356).abs() < 1e-9);
        assert!((blocked(2, 0.66, 0) - 0.0178).abs() < 1e-3, "{}", blocked(2, 0.66, 0));
        assert_eq!((blocked(2, 0.0, 0), blocked(2, 2.0, 0), blocked(0, 0.1, 0)), (0.0, 1.0, 1.0));
        // Headroom lets the queue grow before it blocks.
        assert!(blocked(2, 1.5, 4) < blocked(2, 1.5, 0));
        // A decoder moves over although decode is 66% busy: denoise was held back.
        let ms = pools(1, 3, 1);
        let l = loads([0.05, 0.05, 0.28], [280, 47_000, 2360], [0, 0, 0]);
        let moves = plan(&RebalanceConfig::default(), secs(100), &l, &ms);
        assert_eq!(moves.len(), 1, "{moves:?}");
        assert_eq!((moves[0].from, moves[0].to), (Stage::Denoise, Stage::Decode));
    }

    #[test]
    fn a_move_is_not_undone_within_the_dwell_time() {
        let cfg = RebalanceConfig { dwell: secs(60), ..RebalanceConfig::default() };
        let mut r = Rebalancer::new(cfg);
        let mut ms = pools(0, 4, 1);
        // Decode short: a denoiser moves over.
        let short_decode = loads([0.0, 0.0, 2.0], [100, 1000, 1000], [0, 0, 0]);
        let first = r.decide(secs(100), &short_decode, &ms);
        assert_eq!(first.len(), 1);
        assert_eq!((first[0].from, first[0].to), (Stage::Denoise, Stage::Decode));
        // Then denoise is short: no decoder goes back before 160 s, one may after.
        ms.iter_mut().find(|m| m.worker == first[0].worker).unwrap().stage = Stage::Decode;
        let short_denoise = loads([0.0, 4.0, 0.1], [100, 1000, 10], [0, 0, 0]);
        assert!(r.decide(secs(130), &short_denoise, &ms).is_empty());
        let back = r.decide(secs(160), &short_denoise, &ms);
        assert_eq!(back.len(), 1, "{back:?}");
        assert_eq!((back[0].from, back[0].to), (Stage::Decode, Stage::Denoise));
    }

    #[test]
    fn flow_measures_arrivals_and_service_times() {
        let mut f = Flow::new(Duration::ZERO, [secs(1); 3]);
        for _ in 0..10 {
            f.ended(Stage::Denoise, secs(4));
        }
        // 10 ended and 5 more present than at the start, over 10 s: 1.5/s.
        let l = f.window(secs(10), [0, 3, 0], [0, 2, 0]);
        assert!((l[1].arrivals_per_s - 1.5).abs() < 1e-9, "{l:?}");
        assert_eq!(l[1].service, Duration::from_millis(3250));
        assert_eq!(l[0].service, secs(1));
        assert_eq!(l[1].queued, 3);
        // Nothing came in the next window: the rate falls by a quarter of the way.
        let l = f.window(secs(20), [0, 0, 0], [0, 0, 0]);
        assert!((l[1].arrivals_per_s - 1.125).abs() < 1e-9, "{l:?}");
    }

    fn arb_members() -> impl Strategy<Value = Vec<(u8, u32, u64, u64, u8)>> {
        // (stage, slots, joined at s, switch cost s, stages it can serve: bitmask)
        proptest::collection::vec((0u8..3, 1u32..4, 0u64..200, 0u64..400, 0u8..8), 1..24)
    }

    fn build(raw: &[(u8, u32, u64, u64, u8)]) -> Vec<Member> {
        raw.iter()
            .enumerate()
            .map(|(i, &(s, slots, since, cost, mask))| {
                let stage = Stage::ALL[usize::from(s)];
                let can = Stage::ALL
                    .into_iter()
                    .filter(|&t| t != stage && mask & (1 << t.index()) != 0)
                    .map(|t| (t, secs(cost)))
                    .collect();
                Member { worker: WorkerId(i as u64), stage, slots, since: secs(since), can }
            })
            .collect()
    }

    fn apply(ms: &mut [Member], moves: &[Move], now: Duration) {
        for mv in moves {
            let m = ms.iter_mut().find(|m| m.worker == mv.worker).unwrap();
            let from = m.stage;
            m.stage = mv.to;
            m.since = now + mv.cost;
            m.can.retain(|(s, _)| *s != mv.to);
            m.can.push((from, mv.cost));
        }
    }

    proptest! {
        // About one case in ten moves someone: more cases than the default.
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// Every move passes the rules: the worker can serve the pool it joins and has dwelt; no
        /// pool is emptied while it has work or left under `min_workers`; no switch as long as
        /// the horizon; a decision's moves lower the largest load (over 1) by the hysteresis
        /// factor at least; at most `max_moves`, no worker twice.
        #[test]
        fn every_move_keeps_the_rules(
            raw in arb_members(),
            rates in proptest::array::uniform3(0.0f64..4.0),
            service in proptest::array::uniform3(1u64..20_000),
            queued in proptest::array::uniform3(0usize..50),
            max_moves in 1usize..5,
            min_workers in 0usize..3,
            now in 0u64..400,
        ) {
            let cfg = RebalanceConfig { max_moves, min_workers, ..RebalanceConfig::default() };
            let ms = build(&raw);
            let l = loads(rates, service, queued);
            let moves = plan(&cfg, secs(now), &l, &ms);
            prop_assert!(moves.len() <= max_moves);
            let mut after = ms.clone();
            for mv in &moves {
                let m = ms.iter().find(|m| m.worker == mv.worker).unwrap();
                prop_assert_eq!(m.stage, mv.from);
                prop_assert_eq!(m.switch_cost(mv.to), Some(mv.cost));
                prop_assert!(secs(now) >= m.since + cfg.dwell, "moved before its dwell time");
                prop_assert!(mv.cost < cfg.horizon);
                prop_assert_eq!(moves.iter().filter(|x| x.worker == mv.worker).count(), 1);
            }
            apply(&mut after, &moves, secs(now));
            let largest = |ms: &[Member]| {
                let mut slots = [0.0; 3];
                for m in ms {
                    slots[m.stage.index()] += f64::from(m.slots);
                }
                largest_load(&demands(&l, cfg.horizon), &slots, cfg.decode_headroom)
            };
            if !moves.is_empty() {
                let (b, a) = (largest(&ms), largest(&after));
                prop_assert!(b > 1.0 && a * cfg.hysteresis <= b, "the largest load {b} -> {a}");
            }
            for s in Stage::ALL {
                let before = ms.iter().filter(|m| m.stage == s).count();
                let now_n = after.iter().filter(|m| m.stage == s).count();
                if now_n < before {
                    prop_assert!(now_n >= min_workers, "{s} left with {now_n} < {min_workers}");
                    prop_assert!(now_n > 0 || !l[s.index()].has_work(), "{s} emptied with work");
                }
            }
        }

        /// Under loads that stay put, decisions at every interval stop moving (each move lowers
        /// the largest pool load), and at most `max_moves` happen per interval.
        #[test]
        fn a_stationary_load_converges(
            raw in arb_members(),
            rates in proptest::array::uniform3(0.0f64..4.0),
            service in proptest::array::uniform3(1u64..20_000),
            queued in proptest::array::uniform3(0usize..50),
            max_moves in 1usize..4,
        ) {
            let cfg = RebalanceConfig { max_moves, dwell: secs(20), ..RebalanceConfig::default() };
            let mut r = Rebalancer::new(cfg.clone());
            let mut ms = build(&raw);
            let l = loads(rates, service, queued);
            let mut done = 0usize;
            let mut quiet = 0;
            let mut t = Duration::ZERO;
            for _ in 0..2_000 {
                t += cfg.interval;
                let moves = r.decide(t, &l, &ms);
                prop_assert!(moves.len() <= max_moves);
                done += moves.len();
                apply(&mut ms, &moves, t);
                quiet = if moves.is_empty() { quiet + 1 } else { 0 };
                if quiet > 50 {
                    break;
                }
            }
            prop_assert!(quiet > 50, "still moving after 2,000 decisions: {} moves", done);
        }
    }
}
