//! Elastic pools from the CLI's side: the rebalancer's settings (`serve --rebalance`,
//! `simulate --elastic`, the demo's shift scenario), what a switch costs (loading a stage's
//! weights, from the profiles), and a worker's life across pools (`worker --can`): it serves
//! one pool until SIGTERM or a switch order, drains (its denoise jobs give their checkpoints
//! back at the next step), pays the switch and joins the other pool.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tensorwire_orchestrator::Stage;
use tensorwire_orchestrator::rebalance::RebalanceConfig;
use tensorwire_orchestrator::service::{Assignment, WorkerClient, WorkerSpec};
use tokio::signal::unix::Signal;
use tokio::sync::mpsc;

use tensorwire_sim::profiles::Model;

/// The rebalancer's settings, in seconds of (profile) time.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RebalanceArgs {
    /// Seconds between the rebalancer's decisions.
    #[arg(long, default_value_t = 30.0)]
    pub(crate) rebalance_interval_s: f64,
    /// Seconds a worker stays in a pool before it may move again (and before a move is undone).
    #[arg(long, default_value_t = 300.0)]
    pub(crate) dwell_s: f64,
    /// Seconds within which a backlog is to be cleared and a switch paid back.
    #[arg(long, default_value_t = 600.0)]
    pub(crate) horizon_s: f64,
}

impl RebalanceArgs {
    /// The settings with every time multiplied by `scale` (the demo's time scale), for a
    /// scheduler with `headroom` (its `decode_headroom`).
    pub(crate) fn config(&self, scale: f64, headroom: u32) -> anyhow::Result<RebalanceConfig> {
        let s = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 && v * scale < 1e9 {
                Ok(Duration::from_secs_f64(v * scale))
            } else {
                Err(anyhow::anyhow!("{name} {v}: must be a finite number of seconds >= 0"))
            }
        };
        let cfg = RebalanceConfig {
            interval: s("--rebalance-interval-s", self.rebalance_interval_s)?,
            dwell: s("--dwell-s", self.dwell_s)?,
            horizon: s("--horizon-s", self.horizon_s)?,
            decode_headroom: headroom,
            ..RebalanceConfig::default()
        };
        cfg.check().map_err(anyhow::Error::msg)?;
        Ok(cfg)
    }
}

/// What switching a worker to a stage costs: loading the stage's weights of every model it
/// serves, plus a fixed setup time.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SwitchCost {
    /// Switching to a stage loads its weights (every model's, from the profiles) at this rate,
    /// GB/s.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) switch_gbps: f64,
    /// ... plus this fixed time (process and runtime setup), seconds.
    #[arg(long, default_value_t = 10.0)]
    pub(crate) switch_s: f64,
}

impl SwitchCost {
    /// The time to switch to each stage for `models`.
    pub(crate) fn times<'a>(
        &self,
        models: impl IntoIterator<Item = &'a Model> + Clone,
    ) -> anyhow::Result<[Duration; 3]> {
        if !(self.switch_gbps.is_finite() && self.switch_gbps > 0.0) {
            return Err(anyhow::anyhow!("--switch-gbps {}: must be > 0", self.switch_gbps));
        }
        if !(self.switch_s.is_finite() && (0.0..1e6).contains(&self.switch_s)) {
            return Err(anyhow::anyhow!(
                "--switch-s {}: must be in [0, 1e6) seconds",
                self.switch_s
            ));
        }
        Ok(Stage::ALL.map(|s| {
            let gb: f64 =
                models.clone().into_iter().map(|m| m.weights_gb.map_or(0.0, |w| w.get(s))).sum();
            Duration::from_secs_f64(self.switch_s + gb / self.switch_gbps)
        }))
    }
}

/// Parses `--can`: stage names.
pub(crate) fn stages(names: &[String]) -> anyhow::Result<Vec<Stage>> {
    names
        .iter()
        .map(|n| {
            Stage::ALL
                .into_iter()
                .find(|s| s.name() == n.trim())
                .ok_or_else(|| anyhow::anyhow!("--can {n:?}: expected encode, denoise or decode"))
        })
        .collect()
}

/// A worker that may move between pools: the stages it can serve and what a switch to each
/// costs (already on the time scale it runs at).
#[derive(Debug, Clone)]
pub(crate) struct Mobility {
    /// Every stage it can serve (its first pool's included).
    pub(crate) serves: Vec<Stage>,
    /// Time to switch to each stage.
    pub(crate) cost: [Duration; 3],
}

impl Mobility {
    /// What it says when it joins the pool of `stage`.
    pub(crate) fn spec(
        &self,
        (stage, slots): (Stage, u32),
        (host, labels): (&str, &[String]),
        switched: Option<Duration>,
    ) -> WorkerSpec {
        let can = self
            .serves
            .iter()
            .filter(|&&s| s != stage)
            .map(|&s| (s, self.cost[s.index()]))
            .collect();
        WorkerSpec { labels: labels.to_vec(), can, switched, ..WorkerSpec::new(stage, slots, host) }
    }
}

/// How a worker's time in a pool ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Left {
    /// SIGTERM: it drains and exits.
    Terminated,
    /// The service told it to serve this stage.
    Switch(Stage),
}

/// Hands every assignment `rx` brings to `run` until SIGTERM or a switch order, then drains
/// the worker within `drain`: the service gives it nothing new and asks its denoise jobs back,
/// and what it assigned before (even in the same turn as the order) still runs.
pub(crate) async fn serve_pool(
    w: &Arc<WorkerClient>,
    rx: &mut mpsc::Receiver<Assignment>,
    term: &mut Signal,
    drain: Duration,
    mut run: impl FnMut(Assignment),
) -> anyhow::Result<Left> {
    let closed = || anyhow::Error::msg("the orchestrator closed the connection");
    let left = loop {
        let a = tokio::select! {
            a = rx.recv() => a,
            _ = term.recv() => break Left::Terminated,
            to = w.switch_order() => break Left::Switch(to),
        };
        run(a.ok_or_else(closed)?);
    };
    // Items run on while the drain waits for them (their tasks hold the client), and so does an
    // assignment that crossed the order: the service dispatches and moves a worker in one turn,
    // and until the worker runs it (it yields or finishes), the service never sees it empty.
    let drained = w.drain(drain);
    tokio::pin!(drained);
    loop {
        tokio::select! {
            r = &mut drained => {
                r.map_err(|e| anyhow::anyhow!("draining: {e}"))?;
                return Ok(left);
            }
            a = rx.recv() => run(a.ok_or_else(closed)?),
        }
    }
}

/// Pays a switch from `from` to `to` (sleeps `cost`: the simulated weight load) and says so
/// on stdout (`@@SWITCHED FROM TO MS UNIX_MS`); returns how long it took.
pub(crate) async fn switch(from: Stage, to: Stage, cost: Duration) -> Duration {
    let t = Instant::now();
    tokio::time::sleep(cost).await;
    let took = t.elapsed();
    let unix = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    println!("@@SWITCHED {from} {to} {} {}", took.as_millis(), unix.as_millis());
    took
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire_sim::profiles;

    #[test]
    fn switch_costs_come_from_the_weights_and_settings_are_checked() {
        let all = profiles::load(None).unwrap();
        let wan = profiles::pick(&all, &["wan2.1-t2v-1.3b-480p".into()]).unwrap();
        let c = SwitchCost { switch_gbps: 2.0, switch_s: 10.0 };
        let t = c.times(wan.iter().copied()).unwrap();
        // T5 9.4 GB, DiT 2.9 GB, VAE 0.2 GB at 2 GB/s, plus 10 s.
        assert_eq!(t.map(|d| d.as_millis()), [14_700, 11_450, 10_100]);
        assert!(SwitchCost { switch_gbps: 0.0, ..c.clone() }.times(wan.iter().copied()).is_err());
        let r = RebalanceArgs { rebalance_interval_s: 30.0, dwell_s: 300.0, horizon_s: 600.0 };
        let cfg = r.config(0.01, 0).unwrap();
        assert_eq!((cfg.interval, cfg.dwell), (Duration::from_millis(300), Duration::from_secs(3)));
        let bad = RebalanceArgs { horizon_s: 0.0, ..r.clone() };
        assert!(bad.config(1.0, 0).is_err());
        assert_eq!(stages(&["decode".into()]).unwrap(), [Stage::Decode]);
        assert!(stages(&["vae".into()]).unwrap_err().to_string().contains("expected encode"));
        let m = Mobility { serves: vec![Stage::Denoise, Stage::Decode], cost: t };
        let spec = m.spec((Stage::Denoise, 1), ("h", &[]), None);
        assert_eq!(spec.can, vec![(Stage::Decode, t[2])]);
    }
}
