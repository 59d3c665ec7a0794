//! Library mode: the [`Driver`] run by a tokio task, with stage workers registered as async
//! handlers in this process. Every decision comes from the scheduler; this file only moves events
//! in and runs the handlers the decisions name.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::Stage;
use tokio::sync::{mpsc, oneshot};

use crate::clock::Ticker;
use crate::driver::{Driver, OrchestratorStats, StageResult, metrics_due};
use crate::error::{OrchestratorError, Result};
use crate::sched::{ItemKey, Outcome, RoutingPolicy, SchedConfig, Submit, WorkerId};
use crate::timeline::Timeline;

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

/// Why a handler failed (any error; its text goes with the re-queue).
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// A stage worker's body.
pub trait StageHandler: Send + Sync + 'static {
    /// Runs one item; an error re-queues it (up to the attempt limit).
    fn run(
        &self,
        work: Work,
    ) -> Pin<Box<dyn Future<Output = std::result::Result<(), HandlerError>> + Send + 'static>>;
}

impl<F, Fut, E> StageHandler for F
where
    F: Fn(Work) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<(), E>> + Send + 'static,
    E: Into<HandlerError>,
{
    fn run(
        &self,
        work: Work,
    ) -> Pin<Box<dyn Future<Output = std::result::Result<(), HandlerError>> + Send + 'static>> {
        let fut = self(work);
        Box::pin(async move { fut.await.map_err(Into::into) })
    }
}

enum Event {
    Timeline {
        /// `None`: the slowest of the kept ended requests.
        request: Option<u64>,
        reply: oneshot::Sender<Option<Timeline>>,
    },
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
        result: std::result::Result<(), String>,
    },
    Stats {
        reply: oneshot::Sender<OrchestratorStats>,
    },
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
        let task = tokio::spawn(run(Driver::new(cfg, policy), rx, tx.downgrade()));
        Orchestrator { tx, task }
    }

    async fn ask<T>(&self, e: impl FnOnce(oneshot::Sender<T>) -> Event) -> Result<T> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(e(reply)).await.map_err(|_| OrchestratorError::Stopped)?;
        rx.await.map_err(|_| OrchestratorError::Stopped)
    }

    /// Registers an in-process worker for `stage` with `slots` concurrent items.
    pub async fn add_worker(
        &self,
        stage: Stage,
        slots: u32,
        host: &str,
        handler: Arc<dyn StageHandler>,
    ) -> Result<WorkerId> {
        let host = host.to_string();
        self.ask(|reply| Event::Join { stage, slots, host, handler, reply }).await
    }

    /// Submits a request; the receiver yields its outcome.
    pub async fn submit(&self, s: Submit) -> Result<oneshot::Receiver<Outcome>> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Event::Submit { s, reply }).await.map_err(|_| OrchestratorError::Stopped)?;
        Ok(rx)
    }

    /// A snapshot.
    pub async fn stats(&self) -> Result<OrchestratorStats> {
        self.ask(|reply| Event::Stats { reply }).await
    }

    /// The timeline of `request` (in flight, or among the last ended ones).
    pub async fn timeline(&self, request: u64) -> Result<Option<Timeline>> {
        self.ask(|reply| Event::Timeline { request: Some(request), reply }).await
    }

    /// The timeline of the slowest request (submission to end) among the last ended ones.
    pub async fn slowest(&self) -> Result<Option<Timeline>> {
        self.ask(|reply| Event::Timeline { request: None, reply }).await
    }
}

type LibraryDriver = Driver<Arc<dyn StageHandler>, oneshot::Sender<Outcome>>;

async fn run(mut d: LibraryDriver, mut rx: mpsc::Receiver<Event>, tx: mpsc::WeakSender<Event>) {
    let mut clock = Ticker::new(Duration::from_millis(50));
    let mut published = Duration::ZERO;
    while let Some((now, ev)) = clock.next(&mut rx).await {
        match ev {
            Some(Event::Join { stage, slots, host, handler, reply }) => {
                let _ = reply.send(d.join(stage, slots, &host, Vec::new(), handler, now));
            }
            Some(Event::Submit { s, reply }) => {
                if let Err((reply, o)) = d.submit(s, reply, now) {
                    let _ = reply.send(o);
                }
            }
            Some(Event::Done { key, worker, result }) => {
                let result = match result {
                    Ok(()) => StageResult::Done(Vec::new()),
                    Err(e) => StageResult::Failed(e),
                };
                d.result(worker, key, result, now);
            }
            Some(Event::Stats { reply }) => {
                let _ = reply.send(d.stats(now));
            }
            Some(Event::Timeline { request, reply }) => {
                let t = match request {
                    Some(r) => d.timeline(r),
                    None => d.ended_timelines().max_by_key(|t| t.span()),
                };
                let _ = reply.send(t.cloned());
            }
            None => {}
        }
        d.heartbeat_all(now);
        for a in d.dispatch(now) {
            let Some(tx) = tx.upgrade() else { return };
            let (item, worker) = (a.dispatch.item, a.dispatch.worker);
            let work = Work {
                request: item.key.request,
                stage: item.key.stage,
                attempt: item.attempt,
                worker,
            };
            let run = a.worker.run(work);
            tokio::spawn(async move {
                let result = run.await.map_err(|e| e.to_string());
                let _ = tx.send(Event::Done { key: item.key, worker, result }).await;
            });
        }
        drop(d.take_dead()); // in-process workers are never silent; keep the list empty
        drop(d.take_asks()); // handlers run a job to its end: a preempted job is not asked back
        for e in d.take_outcomes() {
            if let Some(w) = e.waiter {
                let _ = w.send(e.outcome);
            }
        }
        if metrics_due(now, published) {
            d.publish_metrics();
            published = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Priority;
    use crate::sched::MaxFreeCredit;
    use crate::timeline::Mark;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn pipeline_with_a_flaky_decoder() {
        let o = Orchestrator::start(SchedConfig::default(), Box::new(MaxFreeCredit));
        let fails = Arc::new(AtomicU32::new(0));
        let ok = |_w: Work| async { Ok::<(), HandlerError>(()) };
        o.add_worker(Stage::Encode, 2, "h", Arc::new(ok)).await.unwrap();
        o.add_worker(Stage::Denoise, 2, "h", Arc::new(ok)).await.unwrap();
        let f = fails.clone();
        let flaky = move |w: Work| {
            let f = f.clone();
            async move {
                if w.attempt == 1 && w.request % 2 == 0 {
                    f.fetch_add(1, Ordering::Relaxed);
                    return Err("decoder hiccup".into());
                }
                Ok::<(), HandlerError>(())
            }
        };
        o.add_worker(Stage::Decode, 2, "h", Arc::new(flaky)).await.unwrap();
        let mut rx = Vec::new();
        for r in 0..20 {
            let s = Submit::new(r, Priority::Batch);
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
        // Every failed decode shows in its request's timeline, queued again after it.
        let mut failed = 0;
        for r in 0..20 {
            let t = o.timeline(r).await.unwrap().expect("kept");
            assert_eq!(t.events.last().unwrap().mark, Mark::Ended { ok: true });
            let marks: Vec<_> = t.events.iter().map(|e| (e.stage, e.mark)).collect();
            for (i, m) in marks.iter().enumerate() {
                if *m == (Some(Stage::Decode), Mark::Failed) {
                    failed += 1;
                    assert_eq!(marks[i + 1], (Some(Stage::Decode), Mark::Queued), "{}", t.render());
                }
            }
        }
        assert_eq!(failed, 10);
        let slowest = o.slowest().await.unwrap().unwrap();
        for r in 0..20 {
            assert!(o.timeline(r).await.unwrap().unwrap().span() <= slowest.span());
        }
        assert_eq!(o.timeline(99).await.unwrap(), None);
    }
}
