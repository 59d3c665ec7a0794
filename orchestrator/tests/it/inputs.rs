//! Inputs outlive failures, through the service: a decode worker whose input died with its
//! producer says so and denoise runs again from its own (still held) input; once a request
//! ends, completed or failed, every output of it is handed to a live worker to release, and kept
//! until that worker says it did; a worker declared dead is disconnected.

use std::time::Duration;

use tensorwire_orchestrator::sched::SchedConfig;
use tensorwire_orchestrator::service::{
    Assignment, OrchestratorService, ServiceConfig, SubmitClient, WorkerClient,
};
use tensorwire_orchestrator::{OrchestratorError, Priority, Stage};
use tokio::sync::mpsc;

async fn service(max_attempts: u32) -> OrchestratorService {
    let sched = SchedConfig { max_attempts, ..SchedConfig::default() };
    let cfg = ServiceConfig { sched, ..ServiceConfig::default() };
    OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), cfg).await.unwrap()
}

/// A worker of `stage` run by `body`; every assignment it gets is also sent to `seen`.
async fn worker<F>(s: &OrchestratorService, stage: Stage, seen: mpsc::Sender<Assignment>, body: F)
where
    F: Fn(&Assignment, usize) -> Result<Vec<u8>, (bool, String)> + Send + 'static,
{
    let hb = Duration::from_millis(100);
    let (w, mut rx) = WorkerClient::connect(s.addr(), None, stage, 1, "h", hb).await.unwrap();
    tokio::spawn(async move {
        let mut n = 0;
        while let Some(a) = rx.recv().await {
            let _ = seen.send(a.clone()).await;
            if a.release_only {
                w.released(&a).await.unwrap();
                continue;
            }
            n += 1;
            match body(&a, n) {
                Ok(out) => w.report_with(&a, Ok::<_, String>(out)).await.unwrap(),
                Err((true, why)) => w.report_lost_input(&a, &why).await.unwrap(),
                Err((false, why)) => w.report_with(&a, Err::<Vec<u8>, _>(why)).await.unwrap(),
            }
        }
    });
}

async fn outcome(sub: &SubmitClient, r: u64) -> Result<(), OrchestratorError> {
    let rx = sub.submit(r, Priority::Batch).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), rx).await.expect("an outcome").unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_input_reruns_the_producer_and_decode_releases_everything() {
    let s = service(3).await;
    let (tx, mut seen) = mpsc::channel(64);
    let out = |stage: &'static str| {
        move |a: &Assignment, n: usize| Ok(format!("{stage}:{}:{n}", a.request).into_bytes())
    };
    worker(&s, Stage::Encode, tx.clone(), out("enc")).await;
    worker(&s, Stage::Denoise, tx.clone(), out("den")).await;
    worker(&s, Stage::Decode, tx, |_, n| match n {
        1 => Err((true, "producer gone".into())),
        _ => Ok(Vec::new()),
    })
    .await;
    let sub = SubmitClient::connect(s.addr(), None).await.unwrap();
    outcome(&sub, 4).await.unwrap();
    let release = released(&mut seen).await;
    let log: Vec<_> = release.1.into_iter().map(|a| (a.stage, a.inputs)).collect();
    let b = |s: &str| s.as_bytes().to_vec();
    assert_eq!(
        log,
        vec![
            (Stage::Encode, vec![]),
            (Stage::Denoise, b("enc:4:1")),
            (Stage::Decode, b("den:4:1")),
            (Stage::Denoise, b("enc:4:1")), // run again from its own input
            (Stage::Decode, b("den:4:2")),
        ]
    );
    let r = release.0;
    assert_eq!((r.request, r.stage), (4, Stage::Decode), "the decode worker releases");
    assert_eq!(r.held, vec![b("enc:4:1"), b("den:4:1"), b("den:4:2")], "every output");
    let st = settled(&s).await;
    assert_eq!((st.sched.reran, st.sched.completed, st.duplicated), (1, 1, 0));
}

/// The first release-only assignment seen, and every assignment before it.
async fn released(seen: &mut mpsc::Receiver<Assignment>) -> (Assignment, Vec<Assignment>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut before = Vec::new();
    loop {
        let a = tokio::time::timeout_at(deadline, seen.recv()).await.expect("a release").unwrap();
        if a.release_only {
            return (a, before);
        }
        before.push(a);
    }
}

/// Stats once the worker's `Released` has arrived (bounded wait).
async fn settled(s: &OrchestratorService) -> tensorwire_orchestrator::OrchestratorStats {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = s.stats().await.unwrap();
        if st.unreleased == 0 || tokio::time::Instant::now() > deadline {
            return st;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_request_has_its_outputs_released() {
    let s = service(2).await;
    let (tx, mut seen) = mpsc::channel(64);
    worker(&s, Stage::Encode, tx.clone(), |a, _| Ok(format!("enc:{}", a.request).into_bytes()))
        .await;
    worker(&s, Stage::Denoise, tx.clone(), |_, _| Err((false, "out of memory".into()))).await;
    worker(&s, Stage::Decode, tx, |_, _| Ok(Vec::new())).await;
    let sub = SubmitClient::connect(s.addr(), None).await.unwrap();
    let e = outcome(&sub, 8).await.unwrap_err();
    assert!(e.to_string().contains("out of memory"), "{e}");
    let (release, _) = released(&mut seen).await;
    assert_eq!((release.request, release.held), (8, vec![b"enc:8".to_vec()]));
    assert_eq!(settled(&s).await.unreleased, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_declared_dead_is_disconnected_and_rejoins() {
    let sched =
        SchedConfig { heartbeat_timeout: Duration::from_millis(300), ..SchedConfig::default() };
    let cfg = ServiceConfig { sched, ..ServiceConfig::default() };
    let s = OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), cfg).await.unwrap();
    // Heartbeats far apart: the service declares it dead, and closes its connection rather than
    // keep a zombie that would never get work again; the client joins again by itself.
    let slow = Duration::from_secs(30);
    let (w, _rx) =
        WorkerClient::connect(s.addr(), None, Stage::Decode, 1, "h", slow).await.unwrap();
    let first = w.id();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while w.id() == first && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_ne!(w.id(), first, "the worker should have rejoined under a new id");
    let st = s.stats().await.unwrap();
    assert!(st.sched.dead_workers >= 1, "{st:?}");
    assert_eq!(st.slots[Stage::Decode.index()], 1, "one live decode worker at a time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_worker_loses_its_items_to_others_and_is_closed_once_healed() {
    use tensorwire_testkit::faults::{Fault, FaultProxy};
    let sched =
        SchedConfig { heartbeat_timeout: Duration::from_millis(400), ..SchedConfig::default() };
    let cfg = ServiceConfig { sched, ..ServiceConfig::default() };
    let s = OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), cfg).await.unwrap();
    let proxy = FaultProxy::start(s.addr()).await.unwrap();
    let hb = Duration::from_millis(50);
    // The only encode worker at first sits behind the proxy.
    let (far, mut far_rx) =
        WorkerClient::connect(proxy.addr(), None, Stage::Encode, 1, "far", hb).await.unwrap();
    let (tx, _seen) = mpsc::channel(64);
    worker(&s, Stage::Denoise, tx.clone(), |_, _| Ok(Vec::new())).await;
    worker(&s, Stage::Decode, tx.clone(), |_, _| Ok(Vec::new())).await;
    let sub = SubmitClient::connect(s.addr(), None).await.unwrap();
    let out = sub.submit(1, Priority::Batch).await.unwrap();
    let a = tokio::time::timeout(Duration::from_secs(5), far_rx.recv()).await.unwrap().unwrap();
    assert_eq!(a.request, 1);
    proxy.set(Fault::Partition); // before it reports: its heartbeats stop arriving too
    far.report_with(&a, Ok::<_, String>(b"late".to_vec())).await.unwrap();
    // A worker on this side of the partition takes the item over once the far one is declared
    // dead, and the request completes.
    worker(&s, Stage::Encode, tx, |_, _| Ok(b"near".to_vec())).await;
    let r = tokio::time::timeout(Duration::from_secs(10), out).await.expect("completes").unwrap();
    assert!(r.is_ok(), "{r:?}");
    let st = s.stats().await.unwrap();
    assert_eq!((st.sched.dead_workers, st.duplicated), (1, 0));
    // Healed: the far worker was closed; it rejoins, says what it held, and its late result is
    // ignored (acknowledged, never accepted).
    let first = far.id();
    proxy.set(Fault::None);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while far.id() == first && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_ne!(far.id(), first, "the far worker should have rejoined");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = s.stats().await.unwrap();
    assert_eq!((st.sched.completed, st.duplicated), (1, 0));
    assert!(st.sched.ignored >= 1, "the late result is ignored: {st:?}");
    assert!(far_rx.try_recv().is_err(), "nothing more for the far worker");
}
