//! Requests per second through the orchestrator service over TCP: an `OrchestratorService` on
//! loopback, 16 worker clients (5 encode, 6 denoise, 5 decode, 4 slots each) and one submitter
//! keeping a fixed number of requests in flight, every client its own connection. A worker ends
//! each item at once with a small output reference, so each request is three assignments, three
//! results and the release of its outputs: the time measured is the service's (its loop, its
//! wire, its journal), not the stages'. With the journal on, every loop turn's facts are written
//! and `fdatasync`ed before the service acts on them (see `service::logfile`).
//!
//! Everything runs in this process, on this runtime: the clients take cores the service would
//! have alone in a deployment.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_orchestrator::sched::SchedConfig;
use tensorwire_orchestrator::service::{
    OrchestratorService, ServiceConfig, SubmitClient, WorkerClient,
};
use tensorwire_orchestrator::{Priority, Stage};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::Result;

/// Worker clients.
pub const WORKERS: usize = 16;
/// Slots of each worker.
const SLOTS: u32 = 4;
/// Bound on one run: a service that stops answering fails the bench instead of hanging it.
const RUN_LIMIT: Duration = Duration::from_secs(300);

/// One run's figures.
#[derive(Debug, Clone, Copy)]
pub struct ServiceRun {
    /// Requests completed.
    pub requests: u64,
    /// Wall seconds from the first submit to the last outcome.
    pub seconds: f64,
    /// Median time from a request's submit to its outcome, microseconds.
    pub p50_us: f64,
}

impl ServiceRun {
    /// Requests per second.
    pub fn per_s(&self) -> f64 {
        self.requests as f64 / self.seconds.max(1e-9)
    }
}

/// The stage of worker `i` of [`WORKERS`].
fn stage_of(i: usize) -> Stage {
    match i * 3 / WORKERS {
        0 => Stage::Encode,
        1 => Stage::Denoise,
        _ => Stage::Decode,
    }
}

/// A worker that ends every item at once; releases are acknowledged.
async fn worker(at: std::net::SocketAddr, stage: Stage, tasks: &mut JoinSet<()>) -> Result<()> {
    let hb = Duration::from_secs(1);
    let (w, mut rx) = WorkerClient::connect(at, None, stage, SLOTS, "bench", hb).await?;
    tasks.spawn(async move {
        while let Some(a) = rx.recv().await {
            let r = if a.release_only {
                w.released(&a).await
            } else {
                let out = format!("{}:{}", a.stage.name(), a.request).into_bytes();
                w.report_with(&a, Ok::<_, String>(out)).await
            };
            if r.is_err() {
                return; // the service is gone; the submitter's wait says so
            }
        }
    });
    Ok(())
}

/// Runs `requests` requests with `in_flight` outstanding through a fresh service, its journal
/// in a fresh file under the system's temporary directory when `journal` is set.
pub async fn run(requests: u64, in_flight: u64, journal: bool) -> Result<ServiceRun> {
    let dir = std::env::temp_dir().join(format!("tw-bench-service-{}", std::process::id()));
    let path = dir.join(format!("journal-{in_flight}-{requests}"));
    if journal {
        std::fs::create_dir_all(&dir)?;
        let _ = std::fs::remove_file(&path);
    }
    // No worker is declared dead on a loaded machine.
    let sched =
        SchedConfig { heartbeat_timeout: Duration::from_secs(60), ..SchedConfig::default() };
    let cfg =
        ServiceConfig { sched, journal: journal.then(|| path.clone()), ..ServiceConfig::default() };
    let svc = OrchestratorService::serve("127.0.0.1:0".parse()?, cfg).await?;
    let got = tokio::time::timeout(RUN_LIMIT, drive(&svc, requests, in_flight)).await;
    drop(svc);
    if journal {
        let _ = std::fs::remove_dir_all(&dir);
    }
    match got {
        Ok(r) => r,
        Err(_) => {
            Err(format!("service bench: {requests} requests not done in {RUN_LIMIT:?}").into())
        }
    }
}

async fn drive(svc: &OrchestratorService, requests: u64, in_flight: u64) -> Result<ServiceRun> {
    let at = svc.addr();
    let mut workers = JoinSet::new();
    for i in 0..WORKERS {
        worker(at, stage_of(i), &mut workers).await?;
    }
    let sub = SubmitClient::connect(at, None).await?;
    let room = Arc::new(Semaphore::new(in_flight.max(1) as usize));
    let mut waits = JoinSet::new();
    let start = Instant::now();
    for r in 0..requests {
        let permit = room.clone().acquire_owned().await?;
        let p = if r % 4 == 0 { Priority::Interactive } else { Priority::Batch };
        let outcome = sub.submit(r, p).await?;
        let t = Instant::now();
        waits.spawn(async move {
            let ended = outcome.await;
            drop(permit);
            match ended {
                Ok(Ok(())) => Ok(t.elapsed().as_secs_f64() * 1e6),
                Ok(Err(e)) => Err(format!("request {r}: {e}")),
                Err(_) => Err(format!("request {r}: the submitter stopped")),
            }
        });
    }
    let mut lat = Vec::with_capacity(requests as usize);
    while let Some(j) = waits.join_next().await {
        lat.push(j??);
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(ServiceRun { requests, seconds, p50_us: crate::measure::median(&lat) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workers_cover_every_stage() {
        let stages: Vec<_> = (0..WORKERS).map(stage_of).collect();
        for s in Stage::ALL {
            assert!(stages.iter().filter(|&&x| x == s).count() >= 5, "{s:?}: {stages:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_request_completes_with_and_without_the_journal() {
        for journal in [false, true] {
            let r = run(40, 8, journal).await.unwrap();
            assert_eq!(r.requests, 40);
            assert!(r.seconds > 0.0 && r.p50_us > 0.0, "{r:?}");
        }
    }
}
