//! The cluster secret never shows: not in logs (every level), errors, `Debug` output or metrics,
//! through a whole secured cluster's life: engines handshaking and moving bytes, a store node and
//! a remote store, the orchestrator service completing a request, and peers with the wrong
//! secret (or none) being refused at each listener.

use std::io::Write;
use std::sync::Mutex;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tensorwire_core::ClusterSecret;
use tensorwire_core::{Engine, EngineConfig, Permissions, TransferOp};
use tensorwire_orchestrator::service::{
    OrchestratorService, ServiceConfig, SubmitClient, WorkerClient,
};
use tensorwire_orchestrator::{Priority, Stage};
use tensorwire_store::{EmbeddedStore, RemoteStore, Store, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

static LOGS: Mutex<Vec<u8>> = Mutex::new(Vec::new());
static METRICS: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Sink;

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        LOGS.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Keeps every metric's name and labels.
struct Names;

fn note(key: &Key) {
    let labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
    METRICS.lock().unwrap().push(format!("{} {labels:?}", key.name()));
}

impl Recorder for Names {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        note(key);
        Counter::noop()
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        note(key);
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        note(key);
        Histogram::noop()
    }
}

async fn engine(secret: Option<ClusterSecret>) -> Engine {
    let tcp = TcpBackend::new(TcpConfig::default()).unwrap();
    let config = EngineConfig { cluster_secret: secret, ..EngineConfig::default() };
    Engine::builder().backend(tcp).config(config).start().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_secret_never_shows() {
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
        .with_ansi(false)
        .with_writer(|| Sink)
        .init();
    metrics::set_global_recorder(Names).unwrap();

    let dir = std::env::temp_dir().join(format!("tw-secret-shows-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secret");
    let _ = std::fs::remove_file(&file);
    let secret = ClusterSecret::create_file(&file).unwrap();
    let text = std::fs::read_to_string(&file).unwrap().trim().to_string();
    let wrong = ClusterSecret::new("a different secret, not the cluster's");
    let mut seen: Vec<String> = Vec::new(); // errors and Debug output

    // Engines: a secured pair moves bytes; a wrong secret and no secret are refused.
    let (a, b) = (engine(Some(secret.clone())).await, engine(Some(secret.clone())).await);
    let src = a.alloc(4096, Permissions::NONE).await.unwrap();
    let dst = b.alloc(4096, Permissions::WRITE).await.unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    s.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, 4096)).await.unwrap();
    for intruder in [engine(Some(wrong.clone())).await, engine(None).await] {
        seen.push(intruder.connect(b.local_addr()).await.unwrap_err().to_string());
    }
    seen.push(format!("{:?} {:?} {:?}", a.config(), secret, a));

    // A store node and a remote store; a client with the wrong secret is refused.
    let cfg = StoreConfig { capacity: 1 << 20, shared: true, ..StoreConfig::default() };
    let backing = EmbeddedStore::new(&b, cfg).await.unwrap();
    let node = StoreNode::serve(backing.clone(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let remote = RemoteStore::connect(&a, b.local_addr(), node.addr()).await.unwrap();
    let meta = tensorwire_core::TensorMeta::contiguous(tensorwire_core::DType::U8, &[16]);
    remote.put(b"k", &meta, &[7; 16], tensorwire_store::Retention::Normal).await.unwrap();
    let stranger = engine(Some(wrong.clone())).await;
    let refused = RemoteStore::connect(&stranger, b.local_addr(), node.addr()).await.unwrap_err();
    seen.push(refused.to_string());
    seen.push(format!("{backing:?} {remote:?} {node:?}"));

    // The orchestrator service completes a request; wrong and missing secrets are refused.
    let scfg = ServiceConfig { secret: Some(secret.clone()), ..ServiceConfig::default() };
    seen.push(format!("{scfg:?}"));
    let orch = OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), scfg).await.unwrap();
    let mut workers = Vec::new();
    for stage in Stage::ALL {
        let beat = Duration::from_millis(100);
        let (w, mut rx) =
            WorkerClient::connect(orch.addr(), Some(&secret), stage, 1, "h", beat).await.unwrap();
        workers.push(tokio::spawn(async move {
            while let Some(job) = rx.recv().await {
                let _ = w.report(&job, Ok::<(), String>(())).await;
            }
        }));
    }
    let sub = SubmitClient::connect(orch.addr(), Some(&secret)).await.unwrap();
    let done = sub.submit(1, Priority::Interactive).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), done).await.unwrap().unwrap().unwrap();
    for k in [Some(&wrong), None] {
        seen.push(SubmitClient::connect(orch.addr(), k).await.unwrap_err().to_string());
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // late log lines of the refusals

    let logs = String::from_utf8_lossy(&LOGS.lock().unwrap()).into_owned();
    assert!(logs.contains("refused"), "the refusals were logged: {logs}");
    let metrics = METRICS.lock().unwrap().join("\n");
    assert!(metrics.contains("tensorwire_dispatched_total"), "metrics were recorded: {metrics}");
    // The forms it could leak in: the file's hex, upper-case hex, and `Debug` of its bytes.
    let bytes: Vec<u8> = (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect();
    let listed = format!("{:?}", &bytes[..6]);
    let forms = [text.clone(), text.to_uppercase(), listed[..listed.len() - 1].to_string()];
    for (what, haystack) in [("logs", &logs), ("metrics", &metrics), ("errors", &seen.join("\n"))] {
        for form in &forms {
            assert!(!haystack.contains(form.as_str()), "the secret shows in {what}");
        }
    }
    for w in workers {
        w.abort();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
