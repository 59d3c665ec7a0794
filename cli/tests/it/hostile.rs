//! Hostile bytes at every listening port of `tensorwire serve` (the engine's control endpoint, its
//! tcp data port, the store RPC and the orchestrator service): garbage, frames announcing huge
//! lengths, truncated frames, 200 idle connections and 500 connect/close. The server stays up,
//! closes what it cannot use, and a real pipeline (three workers moving payloads through its
//! store) still completes while the idle connections are open; afterwards its descriptors are
//! back near where they started and its memory did not grow without bound.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tensorwire_core::ClusterSecret;
use tensorwire_orchestrator::Priority;
use tensorwire_orchestrator::service::SubmitClient;
use tensorwire_proto::wire::frame::{CONTROL, Framing};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{Kill, free_port};

const EXE: &str = env!("CARGO_BIN_EXE_tensorwire");
const FRAMINGS: [Framing; 3] =
    [CONTROL, tensorwire_store::rpc::FRAMING, tensorwire_orchestrator::service::wire::FRAMING];

/// Open descriptors and resident bytes of `pid`.
fn usage(pid: u32) -> (usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0);
    (fds, kib << 10)
}

/// Sends `bytes` and waits (bounded) for the server to close the connection; true if it did.
async fn closed_after(addr: SocketAddr, bytes: &[u8]) -> bool {
    let Ok(mut s) = TcpStream::connect(addr).await else { return true };
    let _ = s.write_all(bytes).await;
    let mut sink = vec![0u8; 64 << 10];
    let read_all = async {
        loop {
            match s.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read_all).await.is_ok()
}

/// Every hostile message, for any port.
fn attacks() -> Vec<Vec<u8>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let garbage: Vec<u8> = (0..64 << 10)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let mut v = vec![garbage, vec![0xff; 16]];
    for f in FRAMINGS {
        let frame = f.encode(1, &[1, 2, 3, 4]).unwrap();
        let mut huge = frame.clone();
        huge[4..8].copy_from_slice(&[0xff; 4]); // a length far past the bound
        v.push(huge);
        v.push(frame[..5].to_vec()); // a truncated header, then silence
        let mut short_body = frame.clone();
        short_body.truncate(frame.len() - 2); // a body shorter than announced, then silence
        v.push(short_body);
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_on_every_port_leaves_serve_working_and_bounded() {
    let dir = std::env::temp_dir().join(format!("tw-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret_file = dir.join("secret");
    let _ = std::fs::remove_file(&secret_file);
    assert!(
        Command::new(EXE).arg("secret").arg("new").arg(&secret_file).status().unwrap().success()
    );
    let data = free_port();
    let mut serve = Command::new(EXE)
        .args(["serve", "--listen", "127.0.0.1:0", "--store-listen", "127.0.0.1:0"])
        .args(["--orchestrator-listen", "127.0.0.1:0", "--data-listen", &data.to_string()])
        .args(["--store-mib", "128", "--for-secs", "300"])
        .arg("--secret-file")
        .arg(&secret_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = serve.id();
    let mut lines = BufReader::new(serve.stdout.take().unwrap()).lines().map_while(Result::ok);
    let _serve = Kill(serve);
    let (mut control, mut store, mut orch) = (None, None, None);
    for l in lines.by_ref() {
        let w: Vec<&str> = l.split_whitespace().collect();
        match w[..] {
            ["engine", _, "control", a] => control = a.parse::<SocketAddr>().ok(),
            ["store", "node", a, ..] => store = a.parse::<SocketAddr>().ok(),
            ["orchestrator", a] => orch = a.parse::<SocketAddr>().ok(),
            _ => {}
        }
        if orch.is_some() {
            break;
        }
    }
    let (control, store, orch) = (control.unwrap(), store.unwrap(), orch.unwrap());
    let ports = [control, data, store, orch];
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = usage(pid);

    // Every attack at every port, all at once; each connection must be closed by the server.
    let mut jobs = tokio::task::JoinSet::new();
    for &p in &ports {
        for (i, a) in attacks().into_iter().enumerate() {
            jobs.spawn(async move { (p, i, closed_after(p, &a).await) });
        }
    }
    // Meanwhile: 200 idle connections, and 500 connect/close.
    let mut idle = Vec::new();
    for i in 0..200 {
        if let Ok(s) = TcpStream::connect(ports[i % ports.len()]).await {
            idle.push(s);
        }
    }
    for i in 0..500 {
        drop(TcpStream::connect(ports[i % ports.len()]).await);
    }
    // A real pipeline while the idle connections are open: three workers join and move
    // payloads through the store.
    let mut workers = Vec::new();
    for role in ["encode", "denoise", "decode"] {
        let c = Command::new(EXE)
            .args(["worker", "--role", role, "--connect", &orch.to_string()])
            .args(["--store-engine", &control.to_string(), "--store", &store.to_string()])
            .args(["--time-scale", "0.001", "--slots", "2"])
            .arg("--secret-file")
            .arg(&secret_file)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        workers.push(Kill(c));
    }
    let secret = ClusterSecret::from_file(&secret_file).unwrap();
    let sub = SubmitClient::connect(orch, Some(&secret)).await.unwrap();
    let mut outs = Vec::new();
    for r in 0..6 {
        outs.push(sub.submit(r, Priority::Interactive).await.unwrap());
    }
    for o in outs {
        let r = tokio::time::timeout(Duration::from_secs(60), o).await.expect("request hung");
        assert!(r.unwrap().is_ok(), "a request failed");
    }
    let names = ["control", "data", "store rpc", "orchestrator"];
    let mut open = Vec::new();
    while let Some(j) = jobs.join_next().await {
        let (p, i, closed) = j.unwrap();
        if !closed {
            open.push(format!(
                "attack {i} on {}",
                names[ports.iter().position(|&x| x == p).unwrap()]
            ));
        }
    }
    open.sort();
    assert!(open.is_empty(), "the server kept these connections open: {open:?}");
    drop(idle);
    drop(workers);
    drop(sub);
    // Descriptors come back (bounded wait); memory stays bounded.
    let deadline = Instant::now() + Duration::from_secs(30);
    let after = loop {
        let u = usage(pid);
        if u.0 <= before.0 + 16 || Instant::now() > deadline {
            break u;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(after.0 <= before.0 + 16, "descriptors: {} before, {} after", before.0, after.0);
    assert!(
        after.1 <= before.1 + (128 << 20),
        "resident memory: {} MiB before, {} MiB after",
        before.1 >> 20,
        after.1 >> 20
    );
    let _ = std::fs::remove_dir_all(&dir);
}
