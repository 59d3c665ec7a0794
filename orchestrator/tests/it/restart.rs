//! The service survives its own restart with a journal: it is stopped mid-run (its tasks
//! aborted, as a crash would) and started again on the same address from the same journal.
//! Workers and the submitter reconnect on their own; the items that were running are claimed
//! by the workers that ran them, results finished meanwhile are resent, and every request
//! completes once, each of its stages run once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tensorwire_orchestrator::sched::SchedConfig;
use tensorwire_orchestrator::service::{
    OrchestratorService, ServiceConfig, SubmitClient, WorkerClient,
};
use tensorwire_orchestrator::{Priority, Stage};

type Runs = Arc<Mutex<HashMap<(u64, Stage), u32>>>;

async fn serve(at: SocketAddr, journal: &Path) -> OrchestratorService {
    // No worker is declared dead on a loaded machine (that would re-run its item legitimately);
    // the workers reconnect well within the grace.
    let sched =
        SchedConfig { heartbeat_timeout: Duration::from_secs(60), ..SchedConfig::default() };
    let cfg = ServiceConfig {
        sched,
        recovery_grace: Some(Duration::from_secs(5)),
        journal: Some(journal.to_path_buf()),
        compact_bytes: 16 << 10, // compacts a few times during the run
        ..ServiceConfig::default()
    };
    OrchestratorService::serve(at, cfg).await.unwrap()
}

/// A worker whose items take `ms`; it checks its input is the previous stage's output and
/// counts its runs.
async fn worker(at: SocketAddr, stage: Stage, ms: u64, runs: Runs) -> Arc<WorkerClient> {
    let hb = Duration::from_millis(100);
    let (w, mut rx) = WorkerClient::connect(at, None, stage, 2, "h", hb).await.unwrap();
    let w = Arc::new(w);
    let me = w.clone();
    tokio::spawn(async move {
        while let Some(a) = rx.recv().await {
            let (w, runs) = (me.clone(), runs.clone());
            tokio::spawn(async move {
                if a.release_only {
                    let _ = w.released(&a).await;
                    return;
                }
                *runs.lock().entry((a.request, a.stage)).or_default() += 1;
                let want = a.stage.prev().map(|p| format!("{}:{}", p.name(), a.request));
                assert_eq!(want.map(String::into_bytes).unwrap_or_default(), a.inputs);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let out = format!("{}:{}", a.stage.name(), a.request).into_bytes();
                let _ = w.report_with(&a, Ok::<_, String>(out)).await;
            });
        }
    });
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_completes_once_across_a_restart() {
    let dir = std::env::temp_dir().join(format!("tw-restart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let journal = dir.join("orchestrator.journal");
    let _ = std::fs::remove_file(&journal);
    let svc = serve("127.0.0.1:0".parse().unwrap(), &journal).await;
    let at = svc.addr();
    let runs: Runs = Arc::default();
    let mut workers = Vec::new();
    for (stage, ms) in [(Stage::Encode, 20), (Stage::Denoise, 60), (Stage::Decode, 30)] {
        workers.push(worker(at, stage, ms, runs.clone()).await);
    }
    let sub = SubmitClient::connect(at, None).await.unwrap();
    let n = 40u64;
    let mut outs = Vec::new();
    for r in 0..n {
        outs.push(sub.submit(r, Priority::Batch).await.unwrap());
    }
    // Mid-run: some requests done, some running at every stage.
    while runs.lock().keys().filter(|(_, s)| *s == Stage::Decode).count() < 8 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(svc);
    tokio::time::sleep(Duration::from_millis(300)).await; // results pile up meanwhile
    let svc = serve(at, &journal).await;
    for (r, o) in outs.into_iter().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(30), o).await;
        assert!(matches!(got, Ok(Ok(Ok(())))), "request {r}: {got:?}");
    }
    let st = svc.stats().await.unwrap();
    assert_eq!((st.duplicated, st.parked), (0, 0), "{st:?}");
    let runs = runs.lock();
    for r in 0..n {
        for stage in Stage::ALL {
            assert_eq!(runs.get(&(r, stage)), Some(&1), "request {r} at {stage:?}");
        }
    }
    drop(workers);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A journal whose disk fills up after its first write.
#[derive(Debug, Default)]
struct FullDisk {
    book: tensorwire_orchestrator::journal::Book,
    pending: usize,
    written: u32,
}

#[async_trait::async_trait]
impl tensorwire_orchestrator::service::JournalStore for FullDisk {
    fn book(&self) -> &tensorwire_orchestrator::journal::Book {
        &self.book
    }
    fn append(&mut self, f: &tensorwire_orchestrator::journal::Fact) {
        self.book.apply(f);
        self.pending += 1;
    }
    async fn commit(&mut self) -> std::io::Result<()> {
        if self.pending == 0 {
            return Ok(());
        }
        if self.written >= 1 {
            return Err(std::io::Error::other("no space left on device"));
        }
        (self.pending, self.written) = (0, self.written + 1);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_that_cannot_be_written_stops_the_service() {
    let cfg = ServiceConfig {
        journal_store: Some(Box::new(FullDisk::default())),
        ..ServiceConfig::default()
    };
    let svc = OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), cfg).await.unwrap();
    let sub = SubmitClient::connect(svc.addr(), None).await.unwrap();
    let _first = sub.submit(1, Priority::Batch).await.unwrap();
    // Its turn written (it waits at encode: there is no worker), the next write fails.
    while svc.stats().await.unwrap().queued[Stage::Encode.index()] == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _second = sub.submit(2, Priority::Batch).await.unwrap(); // cannot be made durable
    // The service stops rather than run on without its journal, and answers nothing more.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Err(e) = svc.stats().await {
            assert!(matches!(e, tensorwire_orchestrator::OrchestratorError::Stopped), "{e}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the service did not stop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A journal whose commits wait for the test's word while the gate is shut: the test sees a
/// commit waiting, and what the service's peers received meanwhile.
#[derive(Debug, Default)]
struct Gated {
    book: tensorwire_orchestrator::journal::Book,
    pending: usize,
    gate: Arc<Gate>,
}

#[derive(Debug)]
struct Gate {
    shut: std::sync::atomic::AtomicBool,
    /// Commits let through while shut.
    permits: tokio::sync::Semaphore,
    /// A commit is waiting at the shut gate.
    waiting: std::sync::atomic::AtomicBool,
    /// Facts made durable so far.
    durable: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl tensorwire_orchestrator::service::JournalStore for Gated {
    fn book(&self) -> &tensorwire_orchestrator::journal::Book {
        &self.book
    }
    fn append(&mut self, f: &tensorwire_orchestrator::journal::Fact) {
        self.book.apply(f);
        self.pending += 1;
    }
    async fn commit(&mut self) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.pending == 0 {
            return Ok(());
        }
        if self.gate.shut.load(SeqCst) {
            self.gate.waiting.store(true, SeqCst);
            self.gate.permits.acquire().await.expect("the gate's semaphore closed").forget();
            self.gate.waiting.store(false, SeqCst);
        }
        self.gate.durable.fetch_add(std::mem::take(&mut self.pending), SeqCst);
        Ok(())
    }
}

impl Default for Gate {
    fn default() -> Gate {
        Gate {
            shut: false.into(),
            permits: tokio::sync::Semaphore::new(0),
            waiting: false.into(),
            durable: 0.into(),
        }
    }
}

impl Gate {
    /// Shuts the gate, runs `act`, waits until a commit is held at the gate, then checks that
    /// `quiet` holds for a while: nothing that depends on the held facts left the service.
    async fn holds(
        &self,
        what: &str,
        act: impl std::future::Future<Output = ()>,
        mut quiet: impl FnMut() -> bool,
    ) {
        use std::sync::atomic::Ordering::SeqCst;
        self.shut.store(true, SeqCst);
        act.await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !self.waiting.load(SeqCst) {
            assert!(tokio::time::Instant::now() < deadline, "{what}: no commit came to the gate");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for _ in 0..30 {
            assert!(quiet(), "{what}: left the service before its journal commit");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.shut.store(false, SeqCst);
        self.permits.add_permits(1);
    }
}

/// Durable before acknowledged: an assignment, an outcome and an ack each leave the service
/// only after the journal commit of the turn that made them returned (a commit held at a gate
/// keeps all three in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_leaves_the_service_before_its_journal_commit() {
    use std::sync::atomic::Ordering::SeqCst;
    let gate = Arc::new(Gate::default());
    let journal = Gated { gate: gate.clone(), ..Gated::default() };
    let cfg = ServiceConfig { journal_store: Some(Box::new(journal)), ..ServiceConfig::default() };
    let svc = OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), cfg).await.unwrap();
    let at = svc.addr();
    let hb = Duration::from_millis(100);
    let mut workers = Vec::new();
    for stage in Stage::ALL {
        workers.push(WorkerClient::connect(at, None, stage, 1, "h", hb).await.unwrap());
    }
    let sub = SubmitClient::connect(at, None).await.unwrap();

    // The assignment of a submitted request.
    let (w0, rx0) = &mut workers[0];
    let mut outcome = None;
    gate.holds(
        "an assignment",
        async { outcome = Some(sub.submit(7, Priority::Interactive).await.unwrap()) },
        || rx0.is_empty(),
    )
    .await;
    let a = tokio::time::timeout(Duration::from_secs(10), rx0.recv()).await.unwrap().unwrap();
    assert_eq!((a.request, a.stage), (7, Stage::Encode));

    // The ack of a result.
    let durable = gate.durable.load(SeqCst);
    gate.holds(
        "an ack",
        async { w0.report_with(&a, Ok::<_, String>(b"emb".to_vec())).await.unwrap() },
        || w0.unacknowledged() == 1,
    )
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while w0.unacknowledged() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the result was never acknowledged");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(gate.durable.load(SeqCst) > durable);

    // The outcome of the request, once its last stage reported.
    let last = workers.len() - 1;
    for (i, (w, rx)) in workers.iter_mut().enumerate().skip(1) {
        let a = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.unwrap().unwrap();
        let report = w.report_with(&a, Ok::<_, String>(Vec::new()));
        if i < last {
            report.await.unwrap();
            continue;
        }
        let out = outcome.as_mut().unwrap();
        gate.holds("an outcome", async { report.await.unwrap() }, || {
            matches!(out.try_recv(), Err(tokio::sync::oneshot::error::TryRecvError::Empty))
        })
        .await;
    }
    let done = tokio::time::timeout(Duration::from_secs(10), outcome.unwrap()).await;
    done.unwrap().unwrap().unwrap();
}
