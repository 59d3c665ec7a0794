//! The endpoint over real sockets, and the families table against the workspace's sources.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tensorwire_observe::{Endpoint, FAMILIES, Health, Kind, Layer};

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").unwrap().1.to_string();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_serves_metrics_health_and_readiness() {
    tensorwire_observe::install("test").unwrap();
    tensorwire_observe::install("test").unwrap(); // again: nothing happens
    metrics::counter!("tensorwire_transfer_ops_total", "backend" => "tcp", "direction" => "read")
        .increment(3);
    metrics::histogram!("tensorwire_transfer_seconds", "backend" => "tcp", "direction" => "read")
        .record(0.002);
    let health = Health::new();
    let ready = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r = ready.clone();
    health.check("joined", move || r.load(std::sync::atomic::Ordering::Relaxed));
    let ep = Endpoint::serve("127.0.0.1:0".parse().unwrap(), health, false).await.unwrap();
    let addr = ep.addr();
    let (code, body) = tokio::task::spawn_blocking(move || get(addr, "/metrics")).await.unwrap();
    assert_eq!(code, 200);
    assert!(
        body.contains(r#"tensorwire_transfer_ops_total{backend="tcp",direction="read"} 3"#),
        "{body}"
    );
    assert!(body.contains("# HELP tensorwire_transfer_ops_total Transfer ops"), "{body}");
    assert!(
        body.contains(
            r#"tensorwire_transfer_seconds_bucket{backend="tcp",direction="read",le="0.0025"} 1"#
        ),
        "{body}"
    );
    assert!(body.contains(r#"tensorwire_build_info{version="#), "{body}");
    let (code, body) = tokio::task::spawn_blocking(move || get(addr, "/readyz")).await.unwrap();
    assert_eq!((code, body.as_str()), (503, "not ready: joined\n"));
    ready.store(true, std::sync::atomic::Ordering::Relaxed);
    let (code, _) = tokio::task::spawn_blocking(move || get(addr, "/readyz")).await.unwrap();
    assert_eq!(code, 200);
    let (code, _) = tokio::task::spawn_blocking(move || get(addr, "/healthz")).await.unwrap();
    assert_eq!(code, 200);
    // A client that sends nothing does not hold the endpoint: others are still served.
    let idle = TcpStream::connect(addr).unwrap();
    let (code, _) = tokio::task::spawn_blocking(move || get(addr, "/healthz")).await.unwrap();
    assert_eq!(code, 200);
    drop(idle);
}

#[test]
fn every_family_of_a_process_is_exported_from_its_start() {
    tensorwire_observe::install("test").unwrap();
    let layers = [Layer::Engine(&["tcp"]), Layer::Store, Layer::Connector, Layer::Orchestrator];
    tensorwire_observe::export_at_zero(&layers);
    let text = tensorwire_observe::render().unwrap();
    let series = |name: &str| {
        text.lines().filter(|l| !l.starts_with('#')).filter(|l| l.starts_with(name)).count()
    };
    for fam in FAMILIES.iter().filter(|f| !matches!(f.recorded_by, "caches" | "every process")) {
        assert!(series(fam.name) > 0, "{} is not exported: {text}", fam.name);
    }
    // Counters and gauges at zero for each known label value; histograms empty.
    for want in [
        r#"tensorwire_requests_total{class="batch",outcome="failed"} 0"#,
        r#"tensorwire_transfer_errors_total{backend="tcp",kind="peer_closed"} 0"#,
        r#"tensorwire_switches_total{from="decode",to="encode"} 0"#,
        r#"tensorwire_workers{stage="denoise",state="draining"} 0"#,
        r#"tensorwire_store_gets_total{result="miss"} 0"#,
        r#"tensorwire_ttff_seconds_count{class="interactive"} 0"#,
    ] {
        assert!(text.contains(want), "{want} missing: {text}");
    }
    assert!(!text.contains(r#"from="encode",to="encode""#), "a switch to the same stage: {text}");
    // Twice is harmless, and a value recorded before stays.
    metrics::counter!("tensorwire_dispatched_total", "stage" => "encode").increment(2);
    tensorwire_observe::export_at_zero(&layers);
    let text = tensorwire_observe::render().unwrap();
    assert!(text.contains(r#"tensorwire_dispatched_total{stage="encode"} 2"#), "{text}");
}

#[tokio::test]
async fn a_reachable_address_needs_expose() {
    let e = Endpoint::serve("0.0.0.0:0".parse().unwrap(), Health::new(), false).await.unwrap_err();
    assert!(e.contains("--metrics-expose"), "{e}");
    let ep = Endpoint::serve("0.0.0.0:0".parse().unwrap(), Health::new(), true).await.unwrap();
    assert_ne!(ep.addr().port(), 0);
}

/// What the endpoint answers to `request` (raw bytes), or None when it closed unanswered.
fn exchange(addr: SocketAddr, request: &[u8]) -> Option<u16> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = s.write_all(request);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    std::str::from_utf8(out.get(9..12)?).ok()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_is_read_up_to_its_bound_and_no_further() {
    let ep = Endpoint::serve("127.0.0.1:0".parse().unwrap(), Health::new(), false).await.unwrap();
    let addr = ep.addr();
    let head = |len: usize| {
        let start = b"GET /healthz HTTP/1.1\r\nX: ".to_vec();
        let pad = len - start.len() - 4;
        [start, vec![b'a'; pad], b"\r\n\r\n".to_vec()].concat()
    };
    let at_bound = head(tensorwire_observe::MAX_HEAD);
    let code = tokio::task::spawn_blocking(move || exchange(addr, &at_bound)).await.unwrap();
    assert_eq!(code, Some(200), "a head of exactly the bound is served");
    // Twice the bound, its end at the very end: refused as soon as the bound is read, without
    // waiting for the rest (or for the head's deadline).
    let over = head(2 * tensorwire_observe::MAX_HEAD);
    let code = tokio::task::spawn_blocking(move || exchange(addr, &over)).await.unwrap();
    assert_eq!(code, Some(400));
    // A head that never ends is answered 400 once the bound is read.
    let endless = vec![b'a'; 64 << 10];
    let code = tokio::task::spawn_blocking(move || exchange(addr, &endless)).await.unwrap();
    assert_eq!(code, Some(400));
}

#[test]
fn the_default_bounds() {
    let d = tensorwire_observe::EndpointLimits::default();
    assert_eq!(
        (d.pending, d.first_byte, d.head),
        (64, Duration::from_secs(1), Duration::from_secs(5))
    );
    assert_eq!(tensorwire_observe::MAX_HEAD, 8 << 10);
}

/// Past the bound of pending connections the oldest goes, at once (the deadlines here are far
/// away), and the others stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_bound_the_oldest_pending_goes() {
    let limits = tensorwire_observe::EndpointLimits {
        pending: 4,
        first_byte: Duration::from_secs(600),
        head: Duration::from_secs(600),
    };
    let ep = Endpoint::serve_with("127.0.0.1:0".parse().unwrap(), Health::new(), false, limits)
        .await
        .unwrap();
    let addr = ep.addr();
    tokio::task::spawn_blocking(move || {
        let idle: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let open = |s: &TcpStream| {
            s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
            let mut b = [0u8; 1];
            matches!((&*s).read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        };
        std::thread::sleep(Duration::from_millis(100)); // all four accepted
        assert!(idle.iter().all(open));
        let _fifth = TcpStream::connect(addr).unwrap();
        idle[0].set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut b = [0u8; 1];
        let r = (&idle[0]).read(&mut b);
        let waited = |e: &std::io::Error| {
            matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
        };
        assert!(
            matches!(&r, Ok(0)) || matches!(&r, Err(e) if !waited(e)),
            "the oldest stayed: {r:?}"
        );
        assert!(idle[1..].iter().all(open), "a newer one went");
        // A scrape still gets its answer.
        assert_eq!(exchange(addr, b"GET /healthz HTTP/1.1\r\n\r\n"), Some(200));
    })
    .await
    .unwrap();
}

/// A client that keeps re-opening idle connections, about one a millisecond and holding up to
/// 300 (the attack of issue 61: 3 of 30 scrapes got through), does not keep scrapes out: all 30
/// are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_are_answered_while_idle_connections_flood_the_endpoint() {
    let ep = Endpoint::serve("127.0.0.1:0".parse().unwrap(), Health::new(), false).await.unwrap();
    let addr = ep.addr();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut held = std::collections::VecDeque::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(s) = TcpStream::connect(addr) {
                    held.push_back(s);
                }
                if held.len() > 300 {
                    held.pop_front();
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let answered = tokio::task::spawn_blocking(move || {
        (0..30).filter(|_| exchange(addr, b"GET /healthz HTTP/1.1\r\n\r\n") == Some(200)).count()
    })
    .await
    .unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    flood.join().unwrap();
    assert_eq!(answered, 30);
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if p.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | "observe" | ".venv" | "fuzz") {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// Every name a crate records: a literal `"tensorwire_..."` right after `counter!(`,
/// `gauge!(`, `histogram!(`, the caches' `count(` or the engine's `op_key(` (the keys of an
/// ended op, built once per thread).
fn recorded_names() -> Vec<(String, String)> {
    let mut files = Vec::new();
    rust_files(&root(), &mut files);
    let mut names = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut at = 0;
        while let Some(i) = text[at..].find("\"tensorwire_") {
            let start = at + i + 1;
            let len = text[start..].find('"').unwrap_or(0);
            let name = &text[start..start + len];
            let before = text[..at + i].trim_end();
            let recorded = ["counter!(", "gauge!(", "histogram!(", "count(", "op_key("]
                .iter()
                .any(|m| before.ends_with(m));
            if recorded {
                names.push((name.to_string(), f.display().to_string()));
            }
            at = start + len;
        }
    }
    names
}

#[test]
fn every_recorded_name_is_in_the_table_and_every_family_is_recorded_and_documented() {
    let recorded = recorded_names();
    let readme = std::fs::read_to_string(root().join("docs/book/src/metrics.md")).unwrap();
    for (name, file) in &recorded {
        assert!(FAMILIES.iter().any(|f| f.name == name), "{file} records {name}: not in FAMILIES");
    }
    for f in FAMILIES {
        assert!(
            f.name == "tensorwire_build_info" || recorded.iter().any(|(n, _)| n == f.name),
            "{} is in FAMILIES but nothing records it",
            f.name
        );
        assert!(
            readme.contains(&format!("`{}`", f.name)),
            "docs/book/src/metrics.md misses {}",
            f.name
        );
        match f.kind {
            Kind::Counter => assert!(f.name.ends_with("_total"), "{}", f.name),
            Kind::Histogram => assert!(f.name.ends_with("_seconds"), "{}", f.name),
            Kind::Gauge => assert!(!f.name.ends_with("_total"), "{}", f.name),
        }
    }
}

/// The `"expr"` strings of the Grafana dashboard.
fn dashboard_exprs() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("docs/grafana/tensorwire.json")).unwrap();
    text.split("\"expr\": \"").skip(1).map(|s| s.split('"').next().unwrap().to_string()).collect()
}

#[test]
fn the_dashboard_queries_only_families_of_the_table() {
    let exprs = dashboard_exprs();
    assert!(exprs.len() >= 20, "{exprs:?}");
    for e in &exprs {
        let mut names = 0;
        for part in e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if !part.starts_with("tensorwire_") {
                continue;
            }
            names += 1;
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| part.strip_suffix(s))
                .filter(|b| FAMILIES.iter().any(|f| f.name == *b && f.kind == Kind::Histogram))
                .unwrap_or(part);
            assert!(FAMILIES.iter().any(|f| f.name == base), "{e}: {part} is no family");
        }
        assert!(names > 0, "{e}");
    }
}
