//! The parent's side: the store (one node, or store node processes), the orchestrator service and supervised worker processes,
//! with a submitter ([`Cluster`]), and the probes and counts the demo and soak report.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::demo::pipeline::Split;
use crate::supervise::{Chaos, Slot, Supervisor};
use tensorwire_orchestrator::rebalance::RebalanceConfig;
use tensorwire_orchestrator::sched::SchedConfig;
use tensorwire_orchestrator::service::{OrchestratorService, ServiceConfig, SubmitClient};
use tensorwire_orchestrator::{Priority, Stage};
use tensorwire_sim::profiles::Model;

/// An outcome to wait for: the request, when it was submitted (from the run's start), and the
/// service's answer to come.
/// A watched request: its (id, submitted, ended) when it completed, or the line saying why it was
/// lost.
pub(super) type Pending = tokio::task::JoinHandle<Result<(u64, Duration, Duration), String>>;

/// Waits, from now on, for the outcome of request `r` submitted at `sent` (from `start`): the
/// outcome is timed when it arrives, whatever the caller does meanwhile.
pub(super) fn watch(
    r: u64,
    sent: Duration,
    o: tokio::sync::oneshot::Receiver<tensorwire_orchestrator::Result<()>>,
    start: Instant,
) -> Pending {
    tokio::spawn(async move {
        match tokio::time::timeout(Duration::from_secs(600), o).await {
            Ok(Ok(Ok(()))) => Ok((r, sent, start.elapsed())),
            Ok(Ok(Err(e))) => Err(e.to_string()),
            _ => Err(format!("request {r}: no outcome")),
        }
    })
}

/// Every watched outcome: (request, submitted, ended) for the completed ones, and a line per
/// lost one.
pub(super) async fn outcomes(
    waits: Vec<Pending>,
) -> anyhow::Result<(Vec<(u64, Duration, Duration)>, Vec<String>)> {
    let (mut done, mut lost) = (Vec::new(), Vec::new());
    for w in waits {
        match w.await? {
            Ok(d) => done.push(d),
            Err(e) => lost.push(e),
        }
    }
    Ok((done, lost))
}

/// What a cluster of worker processes needs to know.
#[derive(Debug, Clone)]
pub(crate) struct ClusterArgs {
    /// Stage time multiplier.
    pub(crate) time_scale: f64,
    /// Profile file, if not the built-in one.
    pub(crate) profiles: Option<std::path::PathBuf>,
    /// Mean seconds between chaos kills.
    pub(crate) chaos: Option<f64>,
    /// Seed of the kills.
    pub(crate) seed: u64,
    /// Denoise saves a step checkpoint every N steps (0: never).
    pub(crate) checkpoint_every: u32,
    /// The orchestrator's process serves metrics here, and each worker on a loopback port.
    pub(crate) metrics: crate::observe::MetricsArgs,
    /// Elastic pools: the orchestrator's rebalancer, and every worker may serve every stage
    /// (each switch paying, on the time scale, the fixed time below plus the weights' load).
    pub(crate) rebalance: Option<(RebalanceConfig, crate::switching::SwitchCost)>,
    /// The store: one node here, or store node processes (each with a pool big enough for
    /// every request in flight's embeddings).
    pub(crate) store: super::StoreLayout,
}

/// A store node, the orchestrator service and supervised worker processes, with a submitter.
pub(crate) struct Cluster {
    stores: super::stores::Stores,
    orch: OrchestratorService,
    sup: Supervisor,
    lines: tokio::sync::mpsc::Receiver<String>,
    sub: SubmitClient,
    attempts: u32,
    _endpoint: Option<tensorwire_observe::Endpoint>,
}

/// What a cluster did, once stopped.
pub(crate) struct ClusterReport {
    pub(crate) supervisor: crate::supervise::SupervisorReport,
    pub(crate) orchestrator: tensorwire_orchestrator::OrchestratorStats,
    pub(crate) attempts: u32,
    /// What the store nodes went through (with store node processes).
    pub(crate) store: Option<String>,
}

impl Cluster {
    /// Starts everything and waits until every worker has joined; chaos (if any) starts then.
    pub(crate) async fn start(
        a: &ClusterArgs,
        models: &[Model],
        split: Split,
    ) -> anyhow::Result<Cluster> {
        let stores = super::stores::Stores::start(a.store).await?;
        // Under chaos a long denoise item may be killed a few times in a row: give it more
        // tries (each death counts as one, the same as a failure, so a request that kills
        // every worker it touches still ends).
        let attempts = if a.chaos.is_some() { 5 } else { 3 };
        let sched = SchedConfig {
            heartbeat_timeout: Duration::from_secs(10),
            max_attempts: attempts,
            ..SchedConfig::default()
        };
        let rebalance = a.rebalance.as_ref().map(|(r, _)| r.clone());
        let cfg = ServiceConfig { sched, rebalance, ..ServiceConfig::default() };
        let orch = OrchestratorService::serve(
            "127.0.0.1:0".parse().map_err(|_| anyhow::Error::msg("address"))?,
            cfg,
        )
        .await?;
        let health = tensorwire_observe::Health::new();
        let endpoint = a.metrics.start("orchestrator", health.clone()).await?;
        // This process runs the orchestrator and the store nodes (engines over tcp).
        use tensorwire_observe::Layer;
        let layers = [Layer::Engine(&["tcp"]), Layer::Store, Layer::Orchestrator];
        tensorwire_observe::export_at_zero(&layers);
        let mut worker_metrics: Vec<String> = Vec::new();
        if endpoint.is_some() {
            worker_metrics = vec!["--metrics-listen".into(), "127.0.0.1:0".into()];
        }
        if let Some((_, cost)) = &a.rebalance {
            worker_metrics.extend([
                "--can".into(),
                "encode,denoise,decode".into(),
                "--switch-gbps".into(),
                cost.switch_gbps.to_string(),
                "--switch-s".into(),
                cost.switch_s.to_string(),
            ]);
        }
        let exe = std::env::current_exe()?;
        let (tx, mut lines) = tokio::sync::mpsc::channel::<String>(4096);
        let names = models.iter().map(|m| m.name.clone()).collect::<Vec<_>>().join(",");
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
                    orch.addr().to_string(),
                    "--models".into(),
                    names.clone(),
                    "--time-scale".into(),
                    a.time_scale.to_string(),
                    "--checkpoint-every".into(),
                    a.checkpoint_every.to_string(),
                ];
                let args: Vec<String> = args
                    .into_iter()
                    .chain(stores.worker_args())
                    .chain(worker_metrics.clone())
                    .collect();
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
        let chaos =
            a.chaos.map(|s| Chaos { every: Duration::from_secs_f64(s), seed: a.seed, gate: None });
        let sup = Supervisor::start(slots, tx, chaos);
        let mut joined = 0;
        while joined < workers {
            match tokio::time::timeout(Duration::from_secs(30), lines.recv()).await {
                Ok(Some(l)) if l.starts_with("JOINED") => joined += 1,
                Ok(Some(_)) => {}
                _ => {
                    return Err(anyhow::anyhow!(
                        "only {joined} of {workers} worker processes joined"
                    ));
                }
            }
        }
        sup.unleash();
        stores.unleash();
        let sub = SubmitClient::connect(orch.addr(), None).await?;
        let list = orch.metrics_targets_fn();
        health.targets(move || crate::observe::targets(list()));
        Ok(Cluster { stores, orch, sup, lines, sub, attempts, _endpoint: endpoint })
    }

    /// Submits `requests` at once and waits for each; returns the completed ones with their
    /// end-to-end time from `start`, and one line per request lost.
    pub(crate) async fn run(
        &self,
        requests: std::ops::Range<u64>,
        start: Instant,
    ) -> anyhow::Result<(Vec<(u64, Duration)>, Vec<String>)> {
        self.run_as(requests, Priority::Batch, start).await
    }

    /// Submits each request of `schedule` at its time after `start` (batch class) and waits
    /// for all; returns, for each completed one, when it was submitted and when it ended (from
    /// `start`), and one line per request lost.
    pub(crate) async fn run_timed(
        &self,
        schedule: &[(u64, Duration)],
        start: Instant,
    ) -> anyhow::Result<(Vec<(u64, Duration, Duration)>, Vec<String>)> {
        let mut waits = Vec::new();
        for &(r, at) in schedule {
            tokio::time::sleep_until((start + at).into()).await;
            let o = self.sub.submit(r, Priority::Batch).await?;
            waits.push(watch(r, start.elapsed(), o, start));
        }
        outcomes(waits).await
    }

    /// [`Cluster::run`] with requests of class `p`.
    async fn run_as(
        &self,
        requests: impl IntoIterator<Item = u64>,
        p: Priority,
        start: Instant,
    ) -> anyhow::Result<(Vec<(u64, Duration)>, Vec<String>)> {
        let mut waits = Vec::new();
        for r in requests {
            let o = self.sub.submit(r, p).await?;
            waits.push(watch(r, start.elapsed(), o, start));
        }
        let (done, lost) = outcomes(waits).await?;
        Ok((done.into_iter().map(|(r, _, ended)| (r, ended)).collect(), lost))
    }

    /// The orchestrator's timeline of `request`, if it still has it.
    pub(crate) async fn timeline(
        &self,
        request: u64,
    ) -> Option<tensorwire_orchestrator::timeline::Timeline> {
        self.sub.timeline(request, Duration::from_secs(10)).await.ok().flatten()
    }

    /// The workers' `@@` lines that arrive within `quiet` of each other.
    pub(crate) async fn drain_lines(&mut self, quiet: Duration) -> Vec<String> {
        let mut v = Vec::new();
        while let Ok(Some(l)) = tokio::time::timeout(quiet, self.lines.recv()).await {
            v.push(l);
        }
        v
    }

    /// Preemption shown: `holders` batch requests of the model with the longest denoise (ids
    /// from `first` on) take every denoise worker, then one interactive request of the
    /// shortest arrives; it preempts a batch job, which yields at its next step and resumes
    /// from its checkpoint. Returns one line on what happened.
    pub(crate) async fn preemption_probe(
        &self,
        first: u64,
        holders: u32,
        models: &[Model],
    ) -> anyhow::Result<String> {
        let before = self.orch.stats().await?.sched;
        let n = u64::from(holders);
        let (batch, (long, short)) = long_jobs(first, n, models);
        let len = models.len().max(1) as u64;
        let urgent = batch.last().map_or(first, |b| b + len) - long + short;
        let start = Instant::now();
        let held = self.run_as(batch, Priority::Batch, start);
        // Once every denoise worker runs a batch job, the interactive one arrives.
        let wait = async {
            let full = Instant::now() + Duration::from_secs(10);
            while Instant::now() < full {
                match self.orch.stats().await {
                    Ok(st) if st.running[Stage::Denoise.index()] >= holders as usize => break,
                    _ => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
            let t = Instant::now();
            let r = self.run_as([urgent], Priority::Interactive, t).await;
            (t.elapsed(), r)
        };
        let (held, (took, inter)) = tokio::join!(held, wait);
        let ((batch, lost), (_, lost2)) = (held?, inter?);
        if let Some(e) = lost.first().or(lost2.first()) {
            return Err(anyhow::anyhow!("preemption probe: {e}"));
        }
        let mut times: Vec<Duration> = batch.iter().map(|(_, t)| *t).collect();
        times.sort();
        let after = self.orch.stats().await?.sched;
        Ok(format!(
            "preemption: with {holders} batch jobs ({}) on the {holders} denoise workers, an \
             interactive request ({}) completed in {} ms (batch median {} ms); {} yield asks, {} \
             jobs yielded and resumed from their checkpoints",
            models[long as usize].name,
            models[short as usize].name,
            took.as_millis(),
            times.get(times.len() / 2).map_or(0, |t| t.as_millis()),
            after.preempt_asks - before.preempt_asks,
            after.yielded - before.yielded
        ))
    }

    /// Migration shown: `holders` batch jobs of the longest model (ids from `first` on) take
    /// every denoise worker; the worker running one of them gets SIGTERM, drains (its job yields
    /// at its next step and resumes on another worker from the checkpoint) and exits, and the
    /// supervisor starts a replacement. Returns one line, and the `@@` lines it read.
    pub(crate) async fn migration_probe(
        &mut self,
        first: u64,
        holders: u32,
        models: &[Model],
    ) -> anyhow::Result<(String, Vec<String>)> {
        let before = self.orch.stats().await?.sched;
        let (batch, _) = long_jobs(first, u64::from(holders), models);
        let mut outs = Vec::new();
        for &r in &batch {
            outs.push(self.sub.submit(r, Priority::Batch).await?);
        }
        let mut seen: Vec<String> = Vec::new();
        let words = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        // The first worker process to start one of them is the one scaled down.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut pid = None;
        while pid.is_none() && Instant::now() < deadline {
            let Ok(Some(l)) = tokio::time::timeout(POLL, self.lines.recv()).await else { continue };
            if let [w, r, p] = &words(&l)[..] {
                if w == "DENOISE" && r.parse().is_ok_and(|r| batch.contains(&r)) {
                    pid = Some(p.clone());
                }
            }
            seen.push(l);
        }
        let pid =
            pid.ok_or_else(|| anyhow::Error::msg("migration probe: no denoise job started"))?;
        // Let it run a few steps first.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t = Instant::now();
        let target: libc::pid_t =
            pid.parse().map_err(|_| anyhow::anyhow!("migration probe: a worker pid {pid:?}"))?;
        // SAFETY: kill(2) takes plain integers and touches no memory of ours; `target` is a
        // worker process this cluster supervises.
        if unsafe { libc::kill(target, libc::SIGTERM) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(anyhow::anyhow!("migration probe: cannot send SIGTERM to {pid}: {e}"));
        }
        let mut drained = None;
        while drained.is_none() && t.elapsed() < Duration::from_secs(120) {
            let Ok(Some(l)) = tokio::time::timeout(POLL, self.lines.recv()).await else { continue };
            if words(&l) == ["DRAINED", pid.as_str()] {
                drained = Some(t.elapsed());
            }
            seen.push(l);
        }
        let drained = drained
            .ok_or_else(|| anyhow::Error::msg("migration probe: the worker did not drain"))?;
        for (r, o) in batch.iter().zip(outs) {
            match tokio::time::timeout(Duration::from_secs(600), o).await {
                Ok(Ok(Ok(()))) => {}
                other => return Err(anyhow::anyhow!("migration probe: request {r}: {other:?}")),
            }
        }
        let after = self.orch.stats().await?.sched;
        Ok((
            format!(
                "migration: the denoise worker running a batch job got SIGTERM, drained in {} ms \
                 and exited; {} jobs yielded and moved on from their checkpoints; all {} \
                 requests completed",
                drained.as_millis(),
                after.yielded - before.yielded,
                batch.len()
            ),
            seen,
        ))
    }

    /// Store counters once the last releases have landed (bounded wait: releases follow
    /// results).
    pub(crate) async fn settled_store(&self) -> anyhow::Result<tensorwire_store::StoreStats> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let st = self.stores.store().stats().await?;
            if st.objects == 0 || Instant::now() >= deadline {
                return Ok(st);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Process ids of the live workers.
    pub(crate) fn worker_pids(&self) -> Vec<u32> {
        self.sup.pids()
    }

    /// Stops the workers and says what happened.
    pub(crate) async fn stop(self) -> anyhow::Result<ClusterReport> {
        let supervisor = self.sup.stop();
        let orchestrator = self.orch.stats().await?;
        let store = self.stores.stop();
        Ok(ClusterReport { supervisor, orchestrator, attempts: self.attempts, store })
    }
}

impl ClusterReport {
    /// One line: kills per stage, restarts, the requests' fate and the store.
    pub(crate) fn line(&self, completed: usize, lost: usize, store_left: u64) -> String {
        let mut by = HashMap::<&str, u32>::new();
        for (l, n) in &self.supervisor.killed {
            *by.entry(l.as_str()).or_default() += n;
        }
        let killed: u32 = by.values().sum();
        let by = ["encode", "denoise", "decode"]
            .iter()
            .map(|s| format!("{s} {}", by.get(s).copied().unwrap_or(0)))
            .collect::<Vec<_>>()
            .join(", ");
        let st = &self.orchestrator;
        format!(
            "reliability: {killed} workers killed ({by}), {} restarted; requests completed \
             {completed}, lost {lost}, duplicated {}; items re-queued {}, stages re-run after a \
             lost input {} ({} tries per stage); store objects left {store_left}",
            self.supervisor.restarts,
            st.duplicated,
            st.sched.requeued,
            st.sched.reran,
            self.attempts
        )
    }
}

/// How often a probe looks at the workers' lines.
pub(super) const POLL: Duration = Duration::from_millis(50);

/// `n` request ids from `first` on whose model (request r runs model r mod len) has the longest
/// denoise, and the indices of the longest and shortest models.
pub(super) fn long_jobs(first: u64, n: u64, models: &[Model]) -> (Vec<u64>, (u64, u64)) {
    let len = models.len().max(1) as u64;
    let pick = |longer: bool| {
        (0..models.len())
            .reduce(|a, b| {
                let (x, y) = (models[b].denoise_ms(), models[a].denoise_ms());
                if x != y && (x > y) == longer { b } else { a }
            })
            .unwrap_or(0) as u64
    };
    let (long, short) = (pick(true), pick(false));
    let base = first.div_ceil(len) * len;
    ((0..n).map(|k| base + k * len + long).collect(), (long, short))
}

/// What the denoise workers said about their step checkpoints.
#[derive(Debug, Default)]
pub(crate) struct Steps {
    saved: u64,
    resumed: u64,
    /// Steps not run again thanks to the checkpoints resumed from.
    kept: u64,
    yielded: u64,
}

impl Steps {
    /// Counts one `@@` line (split in words).
    pub(crate) fn count(&mut self, f: &[&str]) {
        let step = |s: &str| s.parse::<u64>().unwrap_or(0);
        match f {
            ["CHECKPOINT", _, _] => self.saved += 1,
            ["RESUMED", _, s] => {
                (self.resumed, self.kept) = (self.resumed + 1, self.kept + step(s))
            }
            ["YIELDED", _, _] => self.yielded += 1,
            _ => {}
        }
    }

    /// One line of the report.
    pub(crate) fn line(&self, every: u32) -> String {
        format!(
            "step checkpoints (every {every} steps): {} saved, {} jobs resumed from one ({} steps \
             not run again), {} jobs yielded",
            self.saved, self.resumed, self.kept, self.yielded
        )
    }
}
