//! Library mode: the scheduler core driven by a tokio task, with stage workers registered as
//! async handlers in this process. Every decision comes from [`Scheduler`]; this file only moves
//! events in and runs the handlers the decisions name. Metrics go through the `metrics` facade
//! (queue depth and free slots per stage, dispatches, re-queues, dispatch latency).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_core::{Error, Result};
use tokio::sync::{mpsc, oneshot};

use crate::queue::Stage;
use crate::sched::{
    Dispatch, ItemKey, Outcome, RoutingPolicy, SchedConfig, Scheduler, Submit, WorkerId,
};

/// What a handler is asked to do.
#[derive(Debug, Clone)]
pub struct Work {
    /// Request.
    pub request: u64,
    /// Stage.
    pub stage: Stage,
    /// Try number (1 first).
    pub attempt: u32,
    /// The worker running it.
    pub worker: WorkerId,
}

/// A stage worker's body.
pub trait StageHandler: Send + Sync + 'static {
    /// Runs one item; an error re-queues it (up to the attempt limit).
    fn run(&self, work: Work) -> Pin<Box<dyn Future<Output = Result<()>> + Send + 'static>>;
}

impl<F, Fut> StageHandler for F
where
    F: Fn(Work) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<()>> + Send + 'static,
{
    fn run(&self, work: Work) -> Pin<Box<dyn Future<Output = Result<()>> + Send + 'static>> {
        Box::pin(self(work))
    }
}

enum Event {
    Join {
        stage: Stage,
        slots: u32,
        host: String,
        handler: Arc<dyn StageHandler>,
        reply: oneshot::Sender<WorkerId>,
    },
    Submit {
        s: Submit,
        reply: oneshot::Sender<Outcome>,
    },
    Done {
        key: ItemKey,
        worker: WorkerId,
        result: Result<()>,
    },
    Stats {
        reply: oneshot::Sender<OrchestratorStats>,
    },
}

/// A snapshot of the orchestrator.
#[derive(Debug, Clone, Default)]
pub struct OrchestratorStats {
    /// Scheduler counters.
    pub sched: crate::sched::SchedStats,
    /// Queue depth per stage (encode, denoise, decode).
    pub queued: [usize; 3],
    /// Running items per stage.
    pub running: [usize; 3],
    /// Busy time per stage summed over its workers (utilisation numerator).
    pub busy: [Duration; 3],
    /// Slots per stage.
    pub slots: [u32; 3],
    /// Time since start.
    pub elapsed: Duration,
}

const STAGES: [Stage; 3] = [Stage::Encode, Stage::Denoise, Stage::Decode];

fn stage_index(s: Stage) -> usize {
    match s {
        Stage::Encode => 0,
        Stage::Denoise => 1,
        Stage::Decode => 2,
    }
}

fn stage_name(s: Stage) -> &'static str {
    ["encode", "denoise", "decode"][stage_index(s)]
}

/// The in-process orchestrator.
#[derive(Debug)]
pub struct Orchestrator {
    tx: mpsc::Sender<Event>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Orchestrator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Event")
    }
}

impl Orchestrator {
    /// Starts the orchestrator loop.
    pub fn start(cfg: SchedConfig, policy: Box<dyn RoutingPolicy>) -> Orchestrator {
        let (tx, rx) = mpsc::channel(4096);
        let task = tokio::spawn(run(Scheduler::new(cfg, policy), rx, tx.downgrade()));
        Orchestrator { tx, task }
    }

    async fn send(&self, e: Event) -> Result<()> {
        self.tx.send(e).await.map_err(|_| Error::PeerClosed("orchestrator stopped".into()))
    }

    /// Registers an in-process worker for `stage` with `slots` concurrent items.
    pub async fn add_worker(
        &self,
        stage: Stage,
        slots: u32,
        host: &str,
        handler: Arc<dyn StageHandler>,
    ) -> Result<WorkerId> {
        let (reply, rx) = oneshot::channel();
        self.send(Event::Join { stage, slots, host: host.into(), handler, reply }).await?;
        rx.await.map_err(|_| Error::PeerClosed("orchestrator stopped".into()))
    }

    /// Submits a request; the receiver yields its outcome.
    pub async fn submit(&self, s: Submit) -> Result<oneshot::Receiver<Outcome>> {
        let (reply, rx) = oneshot::channel();
        self.send(Event::Submit { s, reply }).await?;
        Ok(rx)
    }

    /// A snapshot.
    pub async fn stats(&self) -> Result<OrchestratorStats> {
        let (reply, rx) = oneshot::channel();
        self.send(Event::Stats { reply }).await?;
        rx.await.map_err(|_| Error::PeerClosed("orchestrator stopped".into()))
    }
}

async fn run(mut s: Scheduler, mut rx: mpsc::Receiver<Event>, tx: mpsc::WeakSender<Event>) {
    let start = Instant::now();
    let mut next_worker = 0u64;
    let mut handlers: HashMap<WorkerId, Arc<dyn StageHandler>> = HashMap::new();
    let mut waiting: HashMap<u64, oneshot::Sender<Outcome>> = HashMap::new();
    let mut started: HashMap<ItemKey, Instant> = HashMap::new();
    let mut busy = [Duration::ZERO; 3];
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let ev = tokio::select! {
            e = rx.recv() => match e { Some(e) => Some(e), None => return },
            _ = tick.tick() => None,
        };
        let now = start.elapsed();
        if let Some(ev) = ev {
            match ev {
                Event::Join { stage, slots, host, handler, reply } => {
                    next_worker += 1;
                    let id = WorkerId(next_worker);
                    s.join(id, stage, slots, &host, Vec::new(), now);
                    handlers.insert(id, handler);
                    let _ = reply.send(id);
                }
                Event::Submit { s: sub, reply } => {
                    let r = sub.request;
                    if s.submit(sub, now) {
                        waiting.insert(r, reply);
                    } else {
                        let _ = reply.send(Outcome::Failed {
                            request: r,
                            reason: "duplicate request id".into(),
                        });
                    }
                }
                Event::Done { key, worker, result } => {
                    if let Some(t) = started.remove(&key) {
                        busy[stage_index(key.stage)] += t.elapsed();
                    }
                    match result {
                        Ok(()) => s.finished(key, worker, now),
                        Err(e) => s.failed(key, worker, &e.to_string(), now),
                    };
                }
                Event::Stats { reply } => {
                    let mut st = OrchestratorStats {
                        sched: s.stats(),
                        busy,
                        elapsed: now,
                        ..Default::default()
                    };
                    for stage in STAGES {
                        let i = stage_index(stage);
                        st.queued[i] = s.queued(stage);
                        st.running[i] = s.running(stage);
                        st.slots[i] = s.slots(stage);
                    }
                    let _ = reply.send(st);
                }
            }
        }
        // In-process workers live as long as the orchestrator: keep their leases fresh.
        for &id in handlers.keys() {
            s.heartbeat(id, now);
        }
        let t0 = Instant::now();
        let decisions: Vec<Dispatch> = s.dispatch(now);
        if !decisions.is_empty() {
            metrics::histogram!("tensorwire_dispatch_seconds").record(t0.elapsed().as_secs_f64());
            metrics::counter!("tensorwire_dispatched_total").increment(decisions.len() as u64);
        }
        for d in decisions {
            let Some(h) = handlers.get(&d.worker).cloned() else { continue };
            let Some(tx) = tx.upgrade() else { return };
            started.insert(d.item.key, Instant::now());
            let work = Work {
                request: d.item.key.request,
                stage: d.item.key.stage,
                attempt: d.item.attempt,
                worker: d.worker,
            };
            let (key, worker) = (d.item.key, d.worker);
            tokio::spawn(async move {
                let result = h.run(work).await;
                let _ = tx.send(Event::Done { key, worker, result }).await;
            });
        }
        for o in s.take_outcomes() {
            let r = match &o {
                Outcome::Completed { request } | Outcome::Failed { request, .. } => *request,
            };
            if let Some(w) = waiting.remove(&r) {
                let _ = w.send(o);
            }
        }
        for stage in STAGES {
            metrics::gauge!("tensorwire_queue_depth", "stage" => stage_name(stage))
                .set(s.queued(stage) as f64);
            metrics::gauge!("tensorwire_free_slots", "stage" => stage_name(stage))
                .set(f64::from(s.free_slots(stage)));
        }
        metrics::gauge!("tensorwire_requeued").set(s.stats().requeued as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::Priority;
    use crate::sched::MaxFreeCredit;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn pipeline_with_a_flaky_decoder() {
        let o = Orchestrator::start(SchedConfig::default(), Box::new(MaxFreeCredit));
        let fails = Arc::new(AtomicU32::new(0));
        let ok = |_w: Work| async { Ok(()) };
        o.add_worker(Stage::Encode, 2, "h", Arc::new(ok)).await.unwrap();
        o.add_worker(Stage::Denoise, 2, "h", Arc::new(ok)).await.unwrap();
        let f = fails.clone();
        let flaky = move |w: Work| {
            let f = f.clone();
            async move {
                if w.attempt == 1 && w.request % 2 == 0 {
                    f.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::protocol("decoder hiccup"));
                }
                Ok(())
            }
        };
        o.add_worker(Stage::Decode, 2, "h", Arc::new(flaky)).await.unwrap();
        let mut rx = Vec::new();
        for r in 0..20 {
            let s = Submit {
                request: r,
                priority: Priority::Batch,
                deadline: None,
                host: None,
                labels: vec![],
            };
            rx.push(o.submit(s).await.unwrap());
        }
        for (r, x) in rx.into_iter().enumerate() {
            let out = tokio::time::timeout(Duration::from_secs(10), x).await.unwrap().unwrap();
            assert_eq!(out, Outcome::Completed { request: r as u64 });
        }
        let st = o.stats().await.unwrap();
        assert_eq!(st.sched.completed, 20);
        assert_eq!(st.sched.requeued, u64::from(fails.load(Ordering::Relaxed)));
        assert_eq!(st.sched.requeued, 10);
    }
}
