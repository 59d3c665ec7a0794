//! The endpoint over real sockets, and the families table against the workspace's sources.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tensorwire_observe::{Endpoint, FAMILIES, Health, Kind};

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

#[tokio::test]
async fn a_reachable_address_needs_expose() {
    let e = Endpoint::serve("0.0.0.0:0".parse().unwrap(), Health::new(), false).await.unwrap_err();
    assert!(e.contains("--metrics-expose"), "{e}");
    let ep = Endpoint::serve("0.0.0.0:0".parse().unwrap(), Health::new(), true).await.unwrap();
    assert_ne!(ep.addr().port(), 0);
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
