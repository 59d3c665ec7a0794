//! Observability from outside, as an operator sees it:
//! - a real Prometheus server (Debian's `prometheus`) scrapes `tensorwire serve` and finds its
//!   three workers through the `/sd` endpoint (http_sd_configs); its HTTP API then reports the
//!   completed-requests counter equal to what the run completed, a TTFF histogram with every
//!   request in it, and bytes moved by the workers' engines. `promtool check metrics` passes on
//!   each process's exposition. Skipped, with the reason, where `prometheus`/`promtool` are
//!   not installed.
//! - an idle `serve` and an idle payload worker expose, from their start, every family they
//!   record (at zero) and none they do not.
//! - `tensorwire top` under tmux shows a running `demo --processes` cluster: its pools and a
//!   non-zero throughput; `q` quits it. Skipped where tmux is not installed.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use tensorwire_observe::{FAMILIES, Samples, get};
use tensorwire_orchestrator::Priority;
use tensorwire_orchestrator::service::SubmitClient;

use crate::common::{Kill, free_port};

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_tensorwire")
}

/// Starts `tensorwire ARGS`, its stdout to read.
fn start(args: &[&str]) -> (Kill, BufReader<ChildStdout>) {
    let mut c = Command::new(exe())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = BufReader::new(c.stdout.take().unwrap());
    (Kill(c), out)
}

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Reads `out` until a line starts with `prefix`; returns the rest of it.
fn line_after(out: &mut impl BufRead, prefix: &str) -> String {
    let mut l = String::new();
    loop {
        l.clear();
        assert!(out.read_line(&mut l).unwrap() > 0, "the process ended before {prefix:?}");
        if let Some(rest) = l.trim_end().strip_prefix(prefix) {
            return rest.to_string();
        }
    }
}

fn metrics_addr(out: &mut impl BufRead) -> SocketAddr {
    let url = line_after(out, "metrics http://");
    url.trim_end_matches("/metrics").parse().unwrap()
}

fn promtool_check(text: &str, what: &str) {
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    p.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics on {what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn url_encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The single value of an instant query (`None`: an empty result).
async fn query(prom: SocketAddr, q: &str) -> Option<f64> {
    let path = format!("/api/v1/query?query={}", url_encode(q));
    let body = get(prom, &path, Duration::from_secs(5)).await.ok()?;
    let at = body.find("\"value\":[")?;
    let rest = &body[at..];
    let v = rest.split('"').nth(3)?; // "value":[TS,"V"]
    v.parse().ok()
}

/// Polls `q` until it equals `want` (or 60 s pass); returns the last value.
async fn settle(prom: SocketAddr, q: &str, want: f64) -> Option<f64> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let v = query(prom, q).await;
        if v == Some(want) || Instant::now() > until {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_serve_and_the_workers_it_lists() {
    if !have("prometheus") || !have("promtool") {
        eprintln!(
            "SKIPPED: prometheus and promtool are not installed (Debian: apt-get install prometheus)"
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("tw-prom-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let served = serve_with_metrics("64", "300");
    let (serve_metrics, engine, node, orch) =
        (served.metrics, served.engine, served.node, served.orch);
    assert_eq!(get(serve_metrics, "/healthz", Duration::from_secs(5)).await.unwrap(), "ok\n");
    let mut workers = Vec::new();
    for role in ["encode", "denoise", "decode"] {
        let c = Command::new(exe())
            .args(["worker", "--role", role, "--connect", &orch, "--store-engine", &engine])
            .args(["--store", &node, "--time-scale", "0.002", "--slots", "2"])
            .args(["--models", "flux.1-dev-1024", "--metrics-listen", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        workers.push(Kill(c));
    }
    // Every worker joined: serve lists three endpoints at /sd, and is ready.
    let until = Instant::now() + Duration::from_secs(30);
    let sd = loop {
        let sd = get(serve_metrics, "/sd", Duration::from_secs(5)).await.unwrap();
        if sd.matches("\"targets\"").count() == 3 {
            break sd;
        }
        assert!(Instant::now() < until, "three workers never listed: {sd}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(get(serve_metrics, "/readyz", Duration::from_secs(5)).await.unwrap(), "ready\n");
    let prom: SocketAddr = format!("127.0.0.1:{}", free_port().port()).parse().unwrap();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  \
         - job_name: serve\n    static_configs:\n      - targets: ['{serve_metrics}']\n  \
         - job_name: workers\n    http_sd_configs:\n      - url: 'http://{serve_metrics}/sd'\n        \
         refresh_interval: 1s\n"
    );
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let prom_log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let _prometheus = Kill(
        Command::new("prometheus")
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={prom}"))
            .stdout(Stdio::null())
            .stderr(prom_log)
            .spawn()
            .unwrap(),
    );
    let until = Instant::now() + Duration::from_secs(60);
    while get(prom, "/-/ready", Duration::from_secs(2)).await.is_err() {
        assert!(Instant::now() < until, "prometheus never ready: see {}", dir.display());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let targets_up = settle(prom, "count(up == 1)", 4.0).await;
    assert_eq!(targets_up, Some(4.0), "serve and three workers scraped ({sd})");

    let sub = SubmitClient::connect(orch.parse().unwrap(), None).await.unwrap();
    let n = 12u64;
    let mut outcomes = Vec::new();
    for r in 0..n {
        outcomes.push(sub.submit(r, Priority::Batch).await.unwrap());
    }
    let mut completed = 0u64;
    for o in outcomes {
        let r = tokio::time::timeout(Duration::from_secs(120), o).await.expect("a request hung");
        completed += u64::from(r.unwrap().is_ok());
    }
    assert_eq!(completed, n);

    let q = "sum(tensorwire_requests_total{job=\"serve\",outcome=\"completed\"})";
    assert_eq!(settle(prom, q, n as f64).await, Some(n as f64), "{q}");
    let q = "sum(tensorwire_ttff_seconds_count{job=\"serve\"})";
    assert_eq!(settle(prom, q, n as f64).await, Some(n as f64), "{q}");
    let q = "sum(tensorwire_handoff_consumes_total{job=\"workers\",stage=\"decode\"})";
    assert_eq!(settle(prom, q, n as f64).await, Some(n as f64), "one latent per request: {q}");
    let q = "sum(tensorwire_transfer_bytes_total{job=\"workers\"}) > 0";
    assert!(query(prom, q).await.is_some(), "the workers' engines moved bytes: {q}");
    let q = "histogram_quantile(0.5, sum by (le) (tensorwire_ttff_seconds_bucket))";
    assert!(query(prom, q).await.is_some_and(|v| v > 0.0), "{q}");

    // Every query of the Grafana dashboard is one Prometheus accepts.
    let dash = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/grafana/tensorwire.json"
    ))
    .unwrap();
    for e in dash.split("\"expr\": \"").skip(1).map(|s| s.split('"').next().unwrap()) {
        let q = e.replace("$__rate_interval", "1m");
        let path = format!("/api/v1/query?query={}", url_encode(&q));
        let body = get(prom, &path, Duration::from_secs(5)).await;
        assert!(body.as_ref().is_ok_and(|b| b.contains("\"status\":\"success\"")), "{q}: {body:?}");
    }
    // The exposition itself, checked by Prometheus' own linter, and by this crate's parser.
    let text = get(serve_metrics, "/metrics", Duration::from_secs(5)).await.unwrap();
    promtool_check(&text, "serve");
    let samples = Samples::parse(&text).unwrap();
    assert_eq!(samples.sum("tensorwire_requests_total", &[("outcome", "completed")]), n as f64);
    let worker: SocketAddr = sd.split('"').nth(3).unwrap().parse().unwrap();
    let text = get(worker, "/metrics", Duration::from_secs(5)).await.unwrap();
    promtool_check(&text, "a worker");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `tensorwire serve` on loopback with a metrics endpoint: the process and what it printed.
struct Served {
    _process: Kill,
    metrics: SocketAddr,
    /// The engine's control address.
    engine: String,
    /// The store node's RPC address.
    node: String,
    /// The orchestrator's address.
    orch: String,
}

/// Starts `serve` on loopback (every listener on a free port) with a store of `store_mib` MiB,
/// for `secs` seconds.
fn serve_with_metrics(store_mib: &str, secs: &str) -> Served {
    let a = "127.0.0.1:0";
    let args = format!(
        "serve --listen {a} --store-listen {a} --orchestrator-listen {a} --store-mib {store_mib} \
         --for-secs {secs} --metrics-listen {a}"
    );
    let (process, mut out) = start(&args.split_whitespace().collect::<Vec<_>>());
    let metrics = metrics_addr(&mut out);
    let engine = line_after(&mut out, "engine ");
    let engine = engine.split(" control ").nth(1).unwrap().to_string();
    let node = line_after(&mut out, "store node ");
    let node = node.split(' ').next().unwrap().to_string();
    let orch = line_after(&mut out, "orchestrator ");
    Served { _process: process, metrics, engine, node, orch }
}

/// The families of the table that `text` (an exposition) has a series of.
fn exposed(text: &str) -> Vec<&'static str> {
    let series: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    let has = |name: &str| {
        let with = |suffix: &str| {
            let n = format!("{name}{suffix}");
            series
                .iter()
                .any(|l| l.starts_with(&format!("{n}{{")) || l.starts_with(&format!("{n} ")))
        };
        with("") || with("_count")
    };
    FAMILIES.iter().map(|f| f.name).filter(|n| has(n)).collect()
}

/// The families recorded by `layers` (the table's `recorded_by`), and the build info.
fn families_of(layers: &[&str]) -> Vec<&'static str> {
    let of = |f: &&tensorwire_observe::Family| {
        layers.contains(&f.recorded_by) || f.recorded_by == "every process"
    };
    FAMILIES.iter().filter(of).map(|f| f.name).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_serve_and_worker_expose_every_family_they_record_from_the_start() {
    let served = serve_with_metrics("16", "120");
    let (serve_metrics, engine, node, orch) =
        (served.metrics, served.engine, served.node, served.orch);
    let text = get(serve_metrics, "/metrics", Duration::from_secs(5)).await.unwrap();
    assert_eq!(exposed(&text), families_of(&["engine", "store", "orchestrator"]), "{text}");

    // A payload worker that joined and did nothing.
    let (_worker, mut wout) = start(&[
        "worker",
        "--role",
        "decode",
        "--connect",
        &orch,
        "--store-engine",
        &engine,
        "--store",
        &node,
        "--time-scale",
        "0.002",
        "--models",
        "flux.1-dev-1024",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let worker_metrics = metrics_addr(&mut wout);
    let want = families_of(&["engine", "connector"]);
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let text = get(worker_metrics, "/metrics", Duration::from_secs(5)).await.unwrap();
        let got = exposed(&text);
        if got == want {
            break;
        }
        assert!(Instant::now() < until, "an idle worker exposes {got:?}, not {want:?}: {text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn tmux(args: &[&str]) -> String {
    let out = Command::new("tmux").args(args).output().unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn top_shows_a_running_demo_cluster_and_quits_on_q() {
    if !Command::new("tmux").arg("-V").output().is_ok_and(|o| o.status.success()) {
        eprintln!("SKIPPED: tmux is not installed (Debian: apt-get install tmux)");
        return;
    }
    let (_demo, mut out) = start(&[
        "demo",
        "--processes",
        "--requests",
        "400",
        "--time-scale",
        "0.01",
        "--checkpoint-every",
        "0",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let addr = metrics_addr(&mut out);
    // Its lines keep coming; nobody reads them past this point, so they go to a thread.
    std::thread::spawn(move || for _ in out.lines() {});
    let session = format!("tw-top-{}", std::process::id());
    let cmd = format!("{} top --connect {addr}", exe());
    tmux(&["new-session", "-d", "-s", &session, "-x", "140", "-y", "30", &cmd]);
    let until = Instant::now() + Duration::from_secs(60);
    let screen = loop {
        std::thread::sleep(Duration::from_millis(500));
        let s = tmux(&["capture-pane", "-p", "-t", &session]);
        let rate = s
            .lines()
            .find_map(|l| l.split("requests: ").nth(1))
            .and_then(|r| r.split("/s").next())
            .and_then(|r| r.trim().parse::<f64>().ok());
        if rate.is_some_and(|r| r > 0.0) {
            break s;
        }
        if Instant::now() > until {
            tmux(&["kill-session", "-t", &session]);
            panic!("no throughput shown within 60 s:\n{s}");
        }
    };
    for pool in ["encode", "denoise", "decode"] {
        assert!(screen.contains(pool) && screen.contains(" live"), "{pool}:\n{screen}");
    }
    tmux(&["send-keys", "-t", &session, "q"]);
    let until = Instant::now() + Duration::from_secs(10);
    let alive = || {
        let mut c = Command::new("tmux");
        c.args(["has-session", "-t", &session]).stderr(Stdio::null());
        c.status().unwrap().success()
    };
    while alive() {
        if Instant::now() > until {
            tmux(&["kill-session", "-t", &session]);
            panic!("top did not quit on q");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
