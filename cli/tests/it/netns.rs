//! A partition by link-down: `tensorwire serve` (engine, store node, orchestrator) runs in its
//! own network namespace, reached through a veth pair; the test's engine, store client, workers
//! and submitter are on this side. Taking the namespace's end of the link down cuts every
//! connection at the IP level (no proxy in the way): store calls and transfers fail within their
//! bounds with an error; the orchestrator declares the silent workers dead. Put back up, the same
//! clients work again without restarting anything: new transfers move the right bytes, the
//! workers rejoin on their own, and every request completes, the one submitted during the
//! partition too.
//!
//! Needs root and `ip` (iproute2); without them the test says it is skipped and why.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tensorwire_core::ClusterSecret;
use tensorwire_core::{DType, Engine, EngineConfig, Permissions, TensorMeta};
use tensorwire_orchestrator::service::{SubmitClient, WorkerClient};
use tensorwire_orchestrator::{Priority, Stage};
use tensorwire_store::{RemoteStore, Retention, Store};
use tensorwire_tcp::{TcpBackend, TcpConfig};

use crate::common::Kill;

const EXE: &str = env!("CARGO_BIN_EXE_tensorwire");
/// The client engine's transfer bound.
const BOUND: Duration = Duration::from_secs(1);

/// A network namespace joined to this one by a veth pair, `10.77.N.1` here and `10.77.N.2`
/// there; deleted (with the pair) on drop.
struct Netns {
    name: String,
    inner: String,
    here: String,
    there: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Netns {
    fn create() -> Result<Netns, String> {
        let pid = std::process::id();
        let n = pid % 250 + 1;
        let ns = Netns {
            name: format!("tw{pid}"),
            inner: format!("twb{pid}"),
            here: format!("10.77.{n}.1"),
            there: format!("10.77.{n}.2"),
        };
        let outer = format!("twa{pid}");
        ip(&["netns", "add", &ns.name])?;
        ip(&["link", "add", &outer, "type", "veth", "peer", "name", &ns.inner])?;
        ip(&["link", "set", &ns.inner, "netns", &ns.name])?;
        ip(&["addr", "add", &format!("{}/30", ns.here), "dev", &outer])?;
        ip(&["link", "set", &outer, "up"])?;
        ns.exec(&["ip", "addr", "add", &format!("{}/30", ns.there), "dev", &ns.inner])?;
        ns.exec(&["ip", "link", "set", "lo", "up"])?;
        ns.link(true)?;
        Ok(ns)
    }

    fn exec(&self, args: &[&str]) -> Result<(), String> {
        ip(&[&["netns", "exec", &self.name][..], args].concat())
    }

    /// The namespace's end of the link up or down.
    fn link(&self, up: bool) -> Result<(), String> {
        self.exec(&["ip", "link", "set", &self.inner, if up { "up" } else { "down" }])
    }

    fn addr(&self, port: u16) -> SocketAddr {
        format!("{}:{port}", self.there).parse().unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]); // takes the veth pair with it
    }
}

/// Why this machine cannot run the test, if it cannot.
fn unsupported() -> Option<String> {
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Uid:").map(str::to_string)))
        .and_then(|l| l.split_whitespace().next().map(str::to_string));
    if uid.as_deref() != Some("0") {
        return Some("not root (network namespaces need CAP_NET_ADMIN)".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("no `ip` command (iproute2)".into());
    }
    None
}

async fn within<T>(what: &str, d: Duration, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(d, f).await.unwrap_or_else(|_| panic!("{what}: no answer within {d:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_down_partition_fails_within_bounds_and_heals_without_restarts() {
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED: partition by link-down: {why}");
        return;
    }
    let ns = match Netns::create() {
        Ok(ns) => ns,
        Err(e) => {
            eprintln!("SKIPPED: partition by link-down: cannot make a network namespace: {e}");
            return;
        }
    };
    let dir = std::env::temp_dir().join(format!("tw-netns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret_file = dir.join("secret");
    let _ = std::fs::remove_file(&secret_file);
    assert!(
        Command::new(EXE).args(["secret", "new"]).arg(&secret_file).status().unwrap().success()
    );
    let secret = ClusterSecret::from_file(&secret_file).unwrap();
    let (control, store_rpc, orch) = (ns.addr(7000), ns.addr(7100), ns.addr(7200));
    let mut serve = Command::new("ip")
        .args(["netns", "exec", &ns.name, EXE, "serve", "--store-mib", "16", "--for-secs", "120"])
        .args(["--listen", &control.to_string(), "--store-listen", &store_rpc.to_string()])
        .args(["--orchestrator-listen", &orch.to_string()])
        .arg("--secret-file")
        .arg(&secret_file)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(serve.stdout.take().unwrap());
    let serve = Kill(serve);
    let up = out.lines().map_while(Result::ok).any(|l| l.starts_with("orchestrator "));
    assert!(up, "serve did not start in the namespace");

    // This side: an engine and a store client over the link, three workers and a submitter.
    let tcp = TcpBackend::new(TcpConfig::default()).unwrap();
    let cfg = EngineConfig {
        cluster_secret: Some(secret.clone()),
        transfer_timeout: BOUND,
        ..EngineConfig::default()
    };
    let engine = Engine::builder().backend(tcp).config(cfg).start().await.unwrap();
    let remote = RemoteStore::connect(&engine, control, store_rpc).await.unwrap();
    let n = 256 << 10;
    let meta = TensorMeta::contiguous(DType::U8, &[n]);
    let src = engine.alloc(n, Permissions::NONE).await.unwrap();
    let data: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
    src.write_bytes(0, &data).unwrap();
    let all = src.slice(0, n).unwrap();
    remote.put_from(b"before", &meta, &all, Retention::Normal).await.unwrap();
    let hb = Duration::from_millis(100);
    let mut workers = Vec::new();
    for stage in Stage::ALL {
        let (w, mut rx) =
            WorkerClient::connect(orch, Some(&secret), stage, 2, "here", hb).await.unwrap();
        let w = std::sync::Arc::new(w);
        let me = w.clone();
        workers.push((
            w,
            tokio::spawn(async move {
                while let Some(a) = rx.recv().await {
                    if a.release_only {
                        let _ = me.released(&a).await;
                    } else {
                        let _ = me.report(&a, Ok::<(), String>(())).await;
                    }
                }
            }),
        ));
    }
    let sub = SubmitClient::connect(orch, Some(&secret)).await.unwrap();
    let first = sub.submit(1, Priority::Interactive).await.unwrap();
    within("request 1", Duration::from_secs(20), first).await.unwrap().unwrap();

    // Link down: calls fail within their bounds; a request waits.
    ns.link(false).unwrap();
    let t = Instant::now();
    let e = within("exists during the partition", BOUND * 10, remote.exists(b"before")).await;
    assert!(e.is_err(), "a call across a downed link must fail: {e:?}");
    let dst = engine.alloc(n, Permissions::NONE).await.unwrap();
    let e =
        within("get during the partition", BOUND * 10, remote.get_into(b"before", &dst, 0)).await;
    assert!(e.is_err(), "a read across a downed link must fail: {e:?}");
    eprintln!("partitioned: both calls failed within {:?}", t.elapsed());
    let waiting = sub.submit(2, Priority::Interactive).await.unwrap();
    // Longer than the service's heartbeat timeout (5 s): it declares the workers dead and closes
    // their connections; they find out once the link is back, and rejoin on their own.
    let ids: Vec<u64> = workers.iter().map(|(w, _)| w.id()).collect();
    tokio::time::sleep(Duration::from_secs(6)).await;

    // Link up: the same clients work again.
    ns.link(true).unwrap();
    let healed = Instant::now();
    let mut ok = false;
    while healed.elapsed() < Duration::from_secs(20) {
        if matches!(remote.exists(b"before").await, Ok(true)) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the store client did not recover after the link came back");
    remote.get_into(b"before", &dst, 0).await.unwrap();
    assert!(dst.to_vec(0, n).unwrap() == data, "bytes after the partition");
    remote.put_from(b"after", &meta, &all, Retention::Normal).await.unwrap();
    let (_, got) = remote.get(b"after").await.unwrap();
    assert!(got == data);
    within("request 2, submitted during the partition", Duration::from_secs(30), waiting)
        .await
        .unwrap()
        .unwrap();
    let third = sub.submit(3, Priority::Interactive).await.unwrap();
    within("request 3", Duration::from_secs(30), third).await.unwrap().unwrap();
    eprintln!("healed: everything worked again {:?} after the link came back", healed.elapsed());
    let now: Vec<u64> = workers.iter().map(|(w, _)| w.id()).collect();
    assert!(ids.iter().zip(&now).all(|(a, b)| a != b), "the workers rejoined: {ids:?} -> {now:?}");
    for (_, task) in workers {
        task.abort();
    }
    drop(serve);
    drop(ns);
    let _ = std::fs::remove_dir_all(&dir);
}
