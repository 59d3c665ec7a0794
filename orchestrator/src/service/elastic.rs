//! Elastic pools in the service: what the [`Rebalancer`] needs to know of the joined workers
//! (the stages each can also serve, when it joined its pool) and of the items (when each was
//! dispatched), and carrying its moves out: the worker is drained (its denoise jobs yield at a
//! step boundary and resume elsewhere) and told which stage to serve; it loads that stage and
//! joins again, saying how long the switch took.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::sync::mpsc;

use super::wire::Msg;
use crate::driver::Driver;
use crate::rebalance::{Flow, Member, RebalanceConfig, Rebalancer};
use crate::sched::{ItemKey, WorkerId};
use crate::stage::Stage;

/// A joined worker, as the rebalancer sees it.
#[derive(Debug, Clone)]
struct Joined {
    slots: u32,
    since: Duration,
    can: Vec<(Stage, Duration)>,
}

/// The service's rebalancing state.
#[derive(Debug)]
pub(crate) struct Pools {
    reb: Rebalancer,
    flow: Flow,
    joined: HashMap<u64, Joined>,
    started: HashMap<ItemKey, Duration>,
    switching: HashSet<u64>,
}

type ServiceDriver = Driver<mpsc::Sender<Msg>, mpsc::Sender<Msg>>;

impl Pools {
    /// Rebalancing from the service's start (its clock's zero), with no service time known yet
    /// (the first window measures them).
    pub(crate) fn new(cfg: RebalanceConfig) -> Pools {
        Pools {
            reb: Rebalancer::new(cfg),
            flow: Flow::new(Duration::ZERO, [Duration::ZERO; 3]),
            joined: HashMap::new(),
            started: HashMap::new(),
            switching: HashSet::new(),
        }
    }

    /// A worker joined (`switched`: after a switch that took this long).
    pub(crate) fn joined(
        &mut self,
        id: u64,
        (stage, slots): (Stage, u32),
        can: Vec<(Stage, Duration)>,
        switched: Option<Duration>,
        now: Duration,
    ) {
        if let Some(took) = switched {
            metrics::histogram!("tensorwire_switch_seconds", "stage" => stage.name())
                .record(took.as_secs_f64());
            tracing::info!(worker = id, %stage, took_ms = took.as_millis(), "orchestrator: a worker switched pools");
        }
        self.joined.insert(id, Joined { slots, since: now, can });
    }

    /// A worker's connection closed.
    pub(crate) fn gone(&mut self, id: u64) {
        self.joined.remove(&id);
        self.switching.remove(&id);
    }

    /// An item went to a worker.
    pub(crate) fn dispatched(&mut self, key: ItemKey, now: Duration) {
        self.started.insert(key, now);
    }

    /// An item ended on its worker, or was given back.
    pub(crate) fn ended(&mut self, key: ItemKey, now: Duration) {
        if let Some(t) = self.started.remove(&key) {
            self.flow.ended(key.stage, now.saturating_sub(t));
        }
    }

    /// The rebalancer's turn, when due: each move drains its worker and tells it where to go.
    pub(crate) fn turn(&mut self, d: &mut ServiceDriver, now: Duration) {
        if !self.reb.due(now) {
            return;
        }
        let sc = d.sched();
        // Items whose worker left are dispatched again later: forget their start.
        self.started.retain(|k, _| sc.holder(*k).is_some());
        let loads = self.flow.window(
            now,
            Stage::ALL.map(|s| sc.queued(s)),
            Stage::ALL.map(|s| sc.running(s)),
        );
        let mut members: Vec<Member> = sc
            .workers()
            .filter(|(id, _, _)| !self.switching.contains(&id.0) && !sc.is_draining(*id))
            .filter_map(|(id, stage, _)| {
                let j = self.joined.get(&id.0)?;
                Some(Member {
                    worker: id,
                    stage,
                    slots: j.slots,
                    since: j.since,
                    can: j.can.clone(),
                })
            })
            .collect();
        members.sort_by_key(|m| m.worker);
        for mv in self.reb.decide(now, &loads, &members) {
            let Some(tx) = d.endpoint(mv.worker).cloned() else { continue };
            tracing::info!(
                worker = mv.worker.0,
                from = %mv.from,
                to = %mv.to,
                switch_ms = mv.cost.as_millis(),
                "orchestrator: moving a worker between pools"
            );
            metrics::counter!("tensorwire_switches_total", "from" => mv.from.name(), "to" => mv.to.name())
                .increment(1);
            self.switching.insert(mv.worker.0);
            let _ = tx.try_send(Msg::Switch { stage: mv.to });
            d.drain(WorkerId(mv.worker.0), now);
        }
    }
}
