//! `xfer --orchestrator`: the scheduler core's decision rate and latency with many workers, on one
//! core (library mode, no I/O). A steady state: a fixed number of requests in flight; each step
//! finishes the oldest running item, submits a new request when one completed, and calls
//! `dispatch`, whose time is recorded per call.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;
use tensorwire_orchestrator::sched::{
    Dispatch, MaxFreeCredit, SchedConfig, Scheduler, Submit, WorkerId,
};
use tensorwire_orchestrator::{Priority, Stage};

/// The measurement.
#[derive(Debug, Clone, Serialize)]
pub struct OrchestratorFigure {
    /// Tells the line apart.
    pub orchestrator: bool,
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

/// Runs `requests` requests through `workers` workers with `in_flight` requests outstanding.
pub fn run(workers: u32, requests: u64, in_flight: u64) -> OrchestratorFigure {
    let cfg = SchedConfig { heartbeat_timeout: Duration::MAX, ..SchedConfig::default() };
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
    let start = Instant::now();
    for _ in 0..in_flight.min(requests) {
        submit(&mut s, next, Duration::ZERO);
        next += 1;
    }
    let mut running: VecDeque<Dispatch> = VecDeque::new();
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
            if next < requests {
                submit(&mut s, next, now);
                next += 1;
            }
        }
        let t = Instant::now();
        let ds = s.dispatch(now);
        if !ds.is_empty() {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        running.extend(ds);
        if running.is_empty() && s.in_flight() == 0 {
            break;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        lat.get(((p * lat.len() as f64) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    let decisions = s.stats().dispatched;
    OrchestratorFigure {
        orchestrator: true,
        workers,
        requests: done,
        decisions,
        seconds,
        decisions_per_s: decisions as f64 / seconds.max(1e-9),
        p50_dispatch_us: pct(0.5),
        p99_dispatch_us: pct(0.99),
    }
}
