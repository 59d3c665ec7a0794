//! The cluster through a real etcd (started on loopback ports by the test; skipped, with the
//! reason, where there is no `etcd` binary):
//! - `tensorwire serve --etcd` registers its engine and store node; a watcher sees them join, and
//!   leave once the process is killed with SIGKILL (its lease runs out);
//! - two `serve --orchestrator-listen --etcd` processes: one leads, one waits; workers found the
//!   leader through etcd (`worker --etcd`); the leader is killed with SIGKILL mid-run; the standby
//!   is elected, rebuilds the queues from the journal in etcd, the workers and the submitter
//!   follow it, and every request completes;
//! - payload workers given only `--etcd` find the orchestrator and the store nodes there.
//!
//! Needs the cli's `etcd` feature (`.ci/run` runs it with it).
#![cfg(feature = "etcd")]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use tensorwire_etcd::testing::EtcdServer;
use tensorwire_etcd::{EtcdDiscovery, leader_addr, leader_resolver};
use tensorwire_orchestrator::Priority;
use tensorwire_orchestrator::service::{SubmitClient, Target};
use tensorwire_proto::discovery::{Change, Discovery};

use crate::common::{Kill, free_port};

const EXE: &str = env!("CARGO_BIN_EXE_tensorwire");

fn etcd() -> Option<EtcdServer> {
    EtcdServer::start().map_err(|why| eprintln!("SKIPPED: {why}")).ok()
}

/// `tensorwire serve` in `cluster`, its stdout lines sent to `lines` tagged with `tag`.
fn serve(
    url: &str,
    cluster: &str,
    orch: Option<SocketAddr>,
    tag: usize,
    lines: &mpsc::SyncSender<(usize, String)>,
) -> Kill {
    let mut c = Command::new(EXE);
    // 64 MiB: the payload test holds up to four 8 MiB embeddings until their requests end.
    c.args(["serve", "--listen", "127.0.0.1:0", "--store-listen", "127.0.0.1:0"])
        .args(["--store-mib", "64"])
        .args(["--for-secs", "120", "--etcd", url, "--cluster", cluster, "--lease-secs", "2"]);
    if let Some(at) = orch {
        c.args(["--orchestrator-listen", &at.to_string()]);
    }
    let mut child = c.stdout(Stdio::piped()).spawn().unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let tx = lines.clone();
    std::thread::spawn(move || {
        for l in out.lines().map_while(Result::ok) {
            let _ = tx.send((tag, l));
        }
    });
    Kill(child)
}

fn wait_line(rx: &mpsc::Receiver<(usize, String)>, what: impl Fn(&str) -> bool) -> (usize, String) {
    loop {
        let (t, l) = rx.recv_timeout(Duration::from_secs(30)).expect("a line from serve");
        if what(&l) {
            return (t, l);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_registers_in_etcd_and_its_entries_go_when_it_is_killed() {
    let Some(etcd) = etcd() else { return };
    let c = tensorwire_etcd::connect(std::slice::from_ref(&etcd.url), Duration::from_secs(5))
        .await
        .unwrap();
    let d = EtcdDiscovery::new(c, "reg", Duration::from_secs(2));
    let mut engines = d.watch("engine").await.unwrap();
    let (tx, rx) = mpsc::sync_channel(1024);
    let mut s = serve(&etcd.url, "reg", None, 0, &tx);
    let (_, line) = wait_line(&rx, |l| l.starts_with("registered in etcd"));
    let joined = tokio::time::timeout(Duration::from_secs(10), engines.recv()).await.unwrap();
    let Some(Change::Joined(e)) = joined else { panic!("{joined:?}") };
    assert!(line.contains(&e.addr.to_string()), "{line} names {}", e.addr);
    let stores = d.list("store").await.unwrap();
    assert_eq!(stores.len(), 1);
    assert_eq!(stores[0].meta, e.addr.to_string().into_bytes(), "a store names its engine");
    s.0.kill().unwrap(); // SIGKILL: no goodbye, the lease runs out
    s.0.wait().unwrap();
    let left = tokio::time::timeout(Duration::from_secs(15), engines.recv()).await.unwrap();
    assert_eq!(left, Some(Change::Left { kind: "engine".into(), id: e.id.clone() }));
    assert!(d.list("store").await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_orchestrator_takes_over_after_sigkill_and_every_request_completes() {
    let Some(etcd) = etcd() else { return };
    let (tx, rx) = mpsc::sync_channel(1024);
    let addrs = [free_port(), free_port()];
    let mut servers: Vec<Option<Kill>> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| Some(serve(&etcd.url, "ha", Some(*a), i, &tx)))
        .collect();
    let (first, _) = wait_line(&rx, |l| l.contains("(leader of cluster ha)"));
    let c = tensorwire_etcd::connect(std::slice::from_ref(&etcd.url), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(leader_addr(&c, "ha").await, Some(addrs[first]));
    let mut workers = Vec::new();
    for role in ["encode", "denoise", "decode"] {
        let w = Command::new(EXE)
            .args(["worker", "--role", role, "--etcd", &etcd.url, "--cluster", "ha"])
            .args(["--time-scale", "0.005"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        workers.push(Kill(w));
    }
    let sub = SubmitClient::connect_to(Target::Resolve(leader_resolver(c.clone(), "ha")), None)
        .await
        .unwrap();
    let mut outs = Vec::new();
    for r in 0..24 {
        outs.push(sub.submit(r, Priority::Batch).await.unwrap());
    }
    let mut outs = outs.into_iter();
    for o in outs.by_ref().take(4) {
        let r = tokio::time::timeout(Duration::from_secs(60), o).await.expect("hung").unwrap();
        assert!(r.is_ok(), "{r:?}");
    }
    // SIGKILL the leader mid-run: the standby is elected once its lease (2 s) runs out.
    drop(servers[first].take());
    let (second, _) = wait_line(&rx, |l| l.contains("(leader of cluster ha)"));
    assert_ne!(second, first, "the standby leads now");
    for (i, o) in outs.enumerate() {
        let r = tokio::time::timeout(Duration::from_secs(60), o).await;
        assert!(matches!(r, Ok(Ok(Ok(())))), "request {}: {r:?}", i + 4);
    }
    assert_eq!(leader_addr(&c, "ha").await, Some(addrs[second]));
    // The new leader's own count, from its closing line (SIGINT: a clean stop).
    let pid = servers[second].as_ref().unwrap().0.id().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let (_, line) = wait_line(&rx, |l| l.starts_with("orchestrator: completed"));
    eprintln!("new leader: {line}");
    assert!(line.contains("duplicated 0,"), "{line}");
    drop(workers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_workers_find_the_orchestrator_and_the_store_nodes_through_etcd() {
    let Some(etcd) = etcd() else { return };
    let (tx, rx) = mpsc::sync_channel(1024);
    let _serve = serve(&etcd.url, "pay", Some(free_port()), 0, &tx);
    wait_line(&rx, |l| l.contains("(leader of cluster pay)"));
    // A second store node: the workers' cluster store places each object on both (2 replicas).
    let _second = serve(&etcd.url, "pay", None, 1, &tx);
    wait_line(&rx, |l| l.starts_with("registered in etcd"));
    let mut workers = Vec::new();
    for role in ["encode", "denoise", "decode"] {
        // No --connect, no --store-engine/--store: the orchestrator and the store nodes come
        // from etcd.
        let w = Command::new(EXE)
            .args(["worker", "--role", role, "--etcd", &etcd.url, "--cluster", "pay"])
            .args(["--models", "wan2.1-t2v-1.3b-480p", "--time-scale", "0.002"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        workers.push(Kill(w));
    }
    let c = tensorwire_etcd::connect(std::slice::from_ref(&etcd.url), Duration::from_secs(5))
        .await
        .unwrap();
    let sub =
        SubmitClient::connect_to(Target::Resolve(leader_resolver(c, "pay")), None).await.unwrap();
    let mut outs = Vec::new();
    for r in 0..4 {
        outs.push(sub.submit(r, Priority::Interactive).await.unwrap());
    }
    // Each payload worker checks every byte it receives: a completed request moved real bytes.
    for (r, o) in outs.into_iter().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(60), o).await;
        assert!(matches!(got, Ok(Ok(Ok(())))), "request {r}: {got:?}");
    }
    drop(workers);
}

#[test]
fn a_standby_orchestrator_needs_a_fixed_port_and_no_journal_file() {
    let Some(etcd) = etcd() else { return };
    let run = |extra: &[&str]| {
        let out = Command::new(EXE)
            .args(["serve", "--listen", "127.0.0.1:0", "--store-listen", "127.0.0.1:0"])
            .args(["--store-mib", "16", "--for-secs", "5", "--etcd", &etcd.url])
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        err
    };
    let err = run(&["--orchestrator-listen", "127.0.0.1:0"]);
    assert!(err.contains("needs a fixed port"), "{err}");
    let at = free_port().to_string();
    let err = run(&["--orchestrator-listen", &at, "--journal", "/tmp/tw-unused.journal"]);
    assert!(err.contains("journal is in etcd"), "{err}");
}
