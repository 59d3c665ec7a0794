//! `xfer --orchestrator`: the scheduler core's decision rate and latency with many workers, on one
//! core (library mode, no I/O). A steady state: a fixed number of requests in flight; each step
//! finishes the oldest running item, submits a new request for each one that completed, and
//! calls `dispatch`, whose time is recorded per call. The clock starts once the requests in
//! flight are submitted and the first dispatch has filled the idle workers, and stops when
//! `requests` more have completed: the filling (a one-time cost that grows with the count) and
//! a drain at the end (fewer and fewer in flight) are not in the figure.
//!
//! [`run_reuse`] runs the same through the [`Driver`] (the bookkeeping the service and the
//! simulator use) with reuse on: embedding-cache hits start at denoise with the cached
//! reference, interactive requests preempt batch denoise jobs, which yield with a checkpoint
//! and resume from it, and every denoise run checkpoints.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;
use tensorwire_orchestrator::sched::{
    Dispatch, ItemKey, MaxFreeCredit, SchedConfig, SchedStats, Scheduler, Submit, WorkerId,
};
use tensorwire_orchestrator::{Driver, StageResult};
use tensorwire_orchestrator::{Priority, Stage};

/// The measurement.
#[derive(Debug, Clone, Serialize)]
pub struct OrchestratorFigure {
    /// Tells the line apart.
    pub orchestrator: bool,
    /// "scheduler" (the core alone) or "driver, caches and preemption".
    pub mode: &'static str,
    /// Requests that started at denoise (embedding-cache hits).
    pub cache_hits: u64,
    /// Batch jobs asked to yield for an interactive one.
    pub preempt_asks: u64,
    /// Jobs that yielded and were queued again to resume from their checkpoint.
    pub yielded: u64,
    /// Workers (a third per stage).
    pub workers: u32,
    /// Requests completed.
    pub requests: u64,
    /// Dispatch decisions made.
    pub decisions: u64,
    /// Wall seconds of the whole loop (submits, results, dispatches).
    pub seconds: f64,
    /// Decisions per second.
    pub decisions_per_s: f64,
    /// Median time of a dispatch call that made at least one decision, microseconds.
    pub p50_dispatch_us: f64,
    /// 99th percentile of the same, microseconds.
    pub p99_dispatch_us: f64,
}

/// Completes `requests` requests through `workers` workers with `in_flight` requests outstanding
/// all along.
pub fn run(workers: u32, requests: u64, in_flight: u64) -> OrchestratorFigure {
    // Nobody here yields a job: without asks to take, preemption stays off.
    let cfg =
        SchedConfig { heartbeat_timeout: Duration::MAX, preempt: false, ..SchedConfig::default() };
    let mut s = Scheduler::new(cfg, Box::new(MaxFreeCredit));
    let stages = [Stage::Encode, Stage::Denoise, Stage::Decode];
    for w in 0..workers {
        s.join(WorkerId(u64::from(w)), stages[(w % 3) as usize], 1, "node", vec![], Duration::ZERO);
    }
    let mut next = 0u64;
    let submit = |s: &mut Scheduler, r: u64, now: Duration| {
        let p = if r % 4 == 0 { Priority::Interactive } else { Priority::Batch };
        s.submit(Submit::new(r, p), now);
    };
    for _ in 0..in_flight.max(1) {
        submit(&mut s, next, Duration::ZERO);
        next += 1;
    }
    let mut running: VecDeque<Dispatch> = s.dispatch(Duration::ZERO).into();
    let before = s.stats();
    let start = Instant::now();
    let mut lat: Vec<f64> = Vec::new();
    let mut done = 0u64;
    let mut step = 0u64;
    while done < requests {
        step += 1;
        let now = Duration::from_micros(step);
        if let Some(d) = running.pop_front() {
            s.finished(d.item.key, d.worker, now);
        }
        for _ in s.take_outcomes() {
            done += 1;
            submit(&mut s, next, now);
            next += 1;
        }
        let t = Instant::now();
        let ds = s.dispatch(now);
        if !ds.is_empty() {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        running.extend(ds);
        if running.is_empty() {
            break; // nothing runs and nothing can: no worker of a stage with work
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let st = since(before, s.stats());
    figure("scheduler", workers, done, seconds, lat, st, 0)
}

fn figure(
    mode: &'static str,
    workers: u32,
    requests: u64,
    seconds: f64,
    mut lat: Vec<f64>,
    st: SchedStats,
    cache_hits: u64,
) -> OrchestratorFigure {
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        lat.get(((p * lat.len() as f64) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    OrchestratorFigure {
        orchestrator: true,
        mode,
        cache_hits,
        preempt_asks: st.preempt_asks,
        yielded: st.yielded,
        workers,
        requests,
        decisions: st.dispatched,
        seconds,
        decisions_per_s: st.dispatched as f64 / seconds.max(1e-9),
        p50_dispatch_us: pct(0.5),
        p99_dispatch_us: pct(0.99),
    }
}

/// The steady state of [`run`] (timed as it is) through the [`Driver`] with reuse on: every other request hits
/// the embedding cache (it starts at denoise with the cached reference), every fourth is
/// interactive; the oldest running item ends each step, a denoise job saving a checkpoint
/// first, or yielding with one when it was asked to; ended requests' outputs are released at
/// once. The time covers all of it (results, checkpoints, yields, releases, dispatches).
pub fn run_reuse(workers: u32, requests: u64, in_flight: u64) -> OrchestratorFigure {
    let cfg = SchedConfig { heartbeat_timeout: Duration::MAX, ..SchedConfig::default() };
    let mut d: Driver<(), ()> = Driver::new(cfg, Box::new(MaxFreeCredit));
    let stages = [Stage::Encode, Stage::Denoise, Stage::Decode];
    for w in 0..workers {
        d.join(stages[(w % 3) as usize], 1, "node", vec![], (), Duration::ZERO);
    }
    let mut hits = 0u64;
    let mut submit = |d: &mut Driver<(), ()>, r: u64, now: Duration| {
        let p = if r % 4 == 0 { Priority::Interactive } else { Priority::Batch };
        if r % 2 == 1 {
            hits += 1;
            let s = Submit { start: Stage::Denoise, ..Submit::new(r, p) };
            let _ = d.submit_with(s, b"cached embedding ref".to_vec(), (), now);
        } else {
            let _ = d.submit(Submit::new(r, p), (), now);
        }
    };
    let mut next = 0u64;
    for _ in 0..in_flight.max(1) {
        submit(&mut d, next, Duration::ZERO);
        next += 1;
    }
    let mut running: VecDeque<(WorkerId, ItemKey)> = d
        .dispatch(Duration::ZERO)
        .iter()
        .map(|a| (a.dispatch.worker, a.dispatch.item.key))
        .collect();
    let before = d.sched().stats();
    let start = Instant::now();
    let mut asked: std::collections::HashSet<ItemKey> = Default::default();
    let mut lat: Vec<f64> = Vec::new();
    let (mut done, mut step) = (0u64, 0u64);
    while done < requests {
        step += 1;
        let now = Duration::from_micros(step);
        if let Some((w, key)) = running.pop_front() {
            if key.stage == Stage::Denoise && asked.remove(&key) {
                d.yielded(w, key, 20, b"checkpoint ref at 20".to_vec(), now);
            } else {
                if key.stage == Stage::Denoise {
                    d.checkpoint(w, key, 40, b"checkpoint ref at 40".to_vec());
                }
                d.result(w, key, StageResult::Done(b"payload ref".to_vec()), now);
            }
        }
        for _ in d.take_outcomes() {
            done += 1;
            submit(&mut d, next, now);
            next += 1;
        }
        let rel: Vec<(WorkerId, u64)> = d.releases().iter().map(|r| (r.id, r.request)).collect();
        for (w, r) in rel {
            d.released(w, r);
        }
        let t = Instant::now();
        let ds: Vec<(WorkerId, ItemKey)> =
            d.dispatch(now).iter().map(|a| (a.dispatch.worker, a.dispatch.item.key)).collect();
        if !ds.is_empty() {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        running.extend(ds);
        asked.extend(d.take_asks().into_iter().map(|(key, _, _)| key));
        if running.is_empty() {
            break;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let st = since(before, d.sched().stats());
    figure("driver, caches and preemption", workers, done, seconds, lat, st, hits)
}

/// The counts of the timed window: the decisions, asks and yields made since `before` (the
/// other counters as they stand at the end).
fn since(before: SchedStats, now: SchedStats) -> SchedStats {
    SchedStats {
        dispatched: now.dispatched - before.dispatched,
        preempt_asks: now.preempt_asks - before.preempt_asks,
        yielded: now.yielded - before.yielded,
        ..now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timed_window_completes_the_requests_asked_for() {
        for f in [run(30, 200, 60), run_reuse(30, 200, 60), run(30, 50, 1), run(3, 10, 1000)] {
            assert!(
                f.decisions >= f.requests,
                "each completion needs its last stage decided: {f:?}"
            );
            assert!(f.decisions_per_s > 0.0, "{f:?}");
        }
        // The requests asked for, no fewer: in flight stays full to the end (no drain).
        assert_eq!(run(30, 200, 60).requests, 200);
        assert_eq!(run_reuse(30, 200, 60).requests, 200);
        assert_eq!(run(3, 10, 1000).requests, 10);
    }
}
