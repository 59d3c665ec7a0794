//! The orchestrator as a service, with workers in other processes: a decode worker process that is
//! killed (SIGKILL) while it holds items; every request still completes and nothing is decoded
//! twice. Plus: a client with the wrong cluster secret is refused. The worker processes are this
//! test binary's child entry point "decode_worker".

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::Duration;

use tensorwire_conformance::harness::{ChildBody, child_command};
use tensorwire_core::ClusterSecret;
use tensorwire_orchestrator::sched::SchedConfig;
use tensorwire_orchestrator::service::{
    OrchestratorService, ServiceConfig, SubmitClient, WorkerClient,
};
use tensorwire_orchestrator::timeline::Mark;
use tensorwire_orchestrator::{OrchestratorError, Priority, Stage};

const SECRET: &str = "correct horse battery staple";

/// The child entry point "decode_worker": `mode` and the orchestrator's address.
pub(crate) fn decode_worker_child(args: Vec<String>) -> ChildBody {
    Box::pin(async move { decode_worker(&args[0], &args[1]).await })
}

fn secret() -> ClusterSecret {
    ClusterSecret::new(SECRET)
}

/// A decode worker process: "ok" decodes (reports) every assignment; "hang" holds them forever.
async fn decode_worker(mode: &str, orch: &str) {
    let addr = orch.parse().unwrap();
    let s = secret();
    let (w, mut rx) = WorkerClient::connect(
        addr,
        Some(&s),
        Stage::Decode,
        2,
        "child",
        Duration::from_millis(200),
    )
    .await
    .unwrap();
    println!("@@JOINED {}", w.id());
    while let Some(a) = rx.recv().await {
        if mode == "hang" {
            println!("@@HOLDING {}", a.request);
            continue; // never reports: the parent kills this process
        }
        w.handoff(&a, 4096, Duration::from_micros(1500)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        w.report(&a, Ok::<(), String>(())).await.unwrap();
        println!("@@DECODED {}", a.request);
    }
}

struct Proc {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(mode: &str, orch: &str) -> Proc {
    let mut child =
        child_command("decode_worker", &[mode, orch]).stdout(Stdio::piped()).spawn().unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let (tx, lines) = std::sync::mpsc::sync_channel(1024);
    std::thread::spawn(move || {
        for l in out.lines().map_while(Result::ok) {
            if let Some(at) = l.find("@@") {
                if tx.send(l[at + 2..].to_string()).is_err() {
                    break;
                }
            }
        }
    });
    Proc { child, lines }
}

fn wait_line(p: &Proc, prefix: &str) -> String {
    loop {
        let l =
            p.lines.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| panic!("no {prefix}"));
        if l.starts_with(prefix) {
            return l;
        }
    }
}

async fn service() -> OrchestratorService {
    let cfg = ServiceConfig {
        sched: SchedConfig {
            heartbeat_timeout: Duration::from_secs(2),
            max_attempts: 3,
            ..SchedConfig::default()
        },
        secret: Some(secret()),
        handshake_timeout: Duration::from_secs(5),
        ..ServiceConfig::default()
    };
    OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), cfg).await.unwrap()
}

/// In-process encode or denoise worker: reports every assignment at once.
async fn instant_worker(addr: std::net::SocketAddr, stage: Stage) -> tokio::task::JoinHandle<()> {
    let s = secret();
    let (w, mut rx) =
        WorkerClient::connect(addr, Some(&s), stage, 4, "parent", Duration::from_millis(200))
            .await
            .unwrap();
    tokio::spawn(async move {
        while let Some(a) = rx.recv().await {
            w.report(&a, Ok::<(), String>(())).await.unwrap();
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_decode_worker_loses_nothing() {
    let svc = service().await;
    let addr = svc.addr();
    let hang = spawn("hang", &addr.to_string());
    wait_line(&hang, "JOINED");
    let ok = spawn("ok", &addr.to_string());
    wait_line(&ok, "JOINED");
    let _enc = instant_worker(addr, Stage::Encode).await;
    let _den = instant_worker(addr, Stage::Denoise).await;
    let sub = SubmitClient::connect(addr, Some(&secret())).await.unwrap();
    let mut outcomes = Vec::new();
    for r in 0..20 {
        outcomes.push(sub.submit(r, Priority::Batch).await.unwrap());
    }
    let held = wait_line(&hang, "HOLDING");
    // SAFETY: signalling our own child process by pid; no memory is involved.
    assert_eq!(unsafe { libc::kill(hang.child.id() as libc::pid_t, libc::SIGKILL) }, 0);
    for (r, o) in outcomes.into_iter().enumerate() {
        let res =
            tokio::time::timeout(Duration::from_secs(30), o).await.expect("request hung").unwrap();
        assert!(res.is_ok(), "request {r}: {res:?}");
    }
    let mut decoded: HashMap<u64, u32> = HashMap::new();
    while let Ok(l) = ok.lines.recv_timeout(Duration::from_millis(500)) {
        if let Some(r) = l.strip_prefix("DECODED ") {
            *decoded.entry(r.trim().parse().unwrap()).or_default() += 1;
        }
    }
    assert_eq!(
        decoded.len(),
        20,
        "every request decoded by the surviving worker ({held} was held)"
    );
    assert!(decoded.values().all(|&n| n == 1), "decoded twice: {decoded:?}");
    // The held request's timeline shows it: decode handed out twice, to two workers, then done.
    let held: u64 = held["HOLDING ".len()..].trim().parse().unwrap();
    let t = sub.timeline(held, Duration::from_secs(10)).await.unwrap().expect("kept");
    let marks: Vec<(Option<Stage>, Mark)> = t.events.iter().map(|e| (e.stage, e.mark)).collect();
    assert_eq!(marks.first(), Some(&(None, Mark::Submitted)), "{}", t.render());
    assert_eq!(marks.last(), Some(&(None, Mark::Ended { ok: true })), "{}", t.render());
    let decoders: Vec<u64> = marks
        .iter()
        .filter_map(|m| match m {
            (Some(Stage::Decode), Mark::Dispatched { worker }) => Some(*worker),
            _ => None,
        })
        .collect();
    assert!(decoders.len() == 2 && decoders[0] != decoders[1], "{}", t.render());
    let requeued = marks.iter().position(|m| *m == (Some(Stage::Decode), Mark::Requeued));
    let second =
        marks.iter().rposition(|m| matches!(m, (Some(Stage::Decode), Mark::Dispatched { .. })));
    assert!(
        requeued.is_some_and(|r| Some(r) < second),
        "requeued before the second try: {}",
        t.render()
    );
    let handoff = (Some(Stage::Decode), Mark::Handoff { bytes: 4096, micros: 1500 });
    assert!(marks.contains(&handoff), "the decoder's input arrival: {}", t.render());
    for stage in Stage::ALL {
        assert!(marks.contains(&(Some(stage), Mark::Done)), "{stage:?} done: {}", t.render());
    }
    assert!(t.events.windows(2).all(|w| w[0].at <= w[1].at), "in time order");
    assert!(t.ttff().is_some_and(|f| f <= t.span()));
    assert_eq!(sub.timeline(1 << 40, Duration::from_secs(10)).await.unwrap(), None);
    drop(hang);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused() {
    let svc = service().await;
    let wrong = ClusterSecret::new("not the secret");
    let e = SubmitClient::connect(svc.addr(), Some(&wrong)).await.unwrap_err();
    assert!(matches!(e, OrchestratorError::Refused(_)), "{e}");
    let e = WorkerClient::connect(svc.addr(), None, Stage::Decode, 1, "h", Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(e, OrchestratorError::Refused(_)), "no secret: {e}");
}
