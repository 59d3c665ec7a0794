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

/// `pid`'s usage once its descriptors are back within 16 of `before` (asserted, waiting up to
/// 30 s for the connections it closes to go).
async fn descriptors_back(pid: u32, before: usize) -> (usize, u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let after = loop {
        let u = usage(pid);
        if u.0 <= before + 16 || Instant::now() > deadline {
            break u;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(after.0 <= before + 16, "descriptors: {before} before, {} after", after.0);
    after
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

/// A real pipeline through `serve` (its control, store and orchestrator addresses): three
/// workers join and six requests move payloads through the store, each within a minute;
/// `each` runs as each request completes. The workers and the submitter, to drop later.
async fn pipeline(
    [control, store, orch]: [SocketAddr; 3],
    secret_file: &std::path::Path,
    mut each: impl FnMut(),
) -> (Vec<Kill>, SubmitClient) {
    let mut workers = Vec::new();
    for role in ["encode", "denoise", "decode"] {
        let c = Command::new(EXE)
            .args(["worker", "--role", role, "--connect", &orch.to_string()])
            .args(["--store-engine", &control.to_string(), "--store", &store.to_string()])
            .args(["--time-scale", "0.001", "--slots", "2"])
            .arg("--secret-file")
            .arg(secret_file)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        workers.push(Kill(c));
    }
    let secret = ClusterSecret::from_file(secret_file).unwrap();
    let sub = SubmitClient::connect(orch, Some(&secret)).await.unwrap();
    let mut outs = Vec::new();
    for r in 0..6 {
        outs.push(sub.submit(r, Priority::Interactive).await.unwrap());
    }
    for o in outs {
        let r = tokio::time::timeout(Duration::from_secs(60), o).await.expect("request hung");
        assert!(r.unwrap().is_ok(), "a request failed");
        each();
    }
    (workers, sub)
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
    let mut cmd = Command::new(EXE);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--store-listen", "127.0.0.1:0"])
        .args(["--orchestrator-listen", "127.0.0.1:0", "--data-listen", &data.to_string()])
        .args(["--store-mib", "128", "--for-secs", "300"])
        .arg("--secret-file")
        .arg(&secret_file);
    let (pid, _serve, [control, store, orch]) = spawn_serve(cmd);
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
    let (workers, sub) = pipeline([control, store, orch], &secret_file, || {}).await;
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
    let after = descriptors_back(pid, before.0).await;
    assert!(
        after.1 <= before.1 + (128 << 20),
        "resident memory: {} MiB before, {} MiB after",
        before.1 >> 20,
        after.1 >> 20
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Raises this process's descriptor limit to its hard limit (the test holds thousands of
/// sockets); returns the soft limit now.
fn raise_own_fd_limit() -> u64 {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the struct they are given.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
    }
    l.rlim_cur
}

/// `tensorwire serve` with a secret, every listener on loopback (data on `data`, metrics on
/// `metrics`) and, like the `serve` the attack of issue 61 exhausted, 1,024 descriptors; its
/// pid, the process, and its control, store, orchestrator addresses.
fn serve_with_1024_descriptors(
    secret_file: &std::path::Path,
    data: SocketAddr,
    metrics: SocketAddr,
) -> (u32, Kill, [SocketAddr; 3]) {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(EXE);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--store-listen", "127.0.0.1:0"])
        .args(["--orchestrator-listen", "127.0.0.1:0", "--data-listen", &data.to_string()])
        .args(["--metrics-listen", &metrics.to_string()])
        .args(["--store-mib", "64", "--for-secs", "300"])
        .arg("--secret-file")
        .arg(secret_file);
    // SAFETY: the closure only calls setrlimit, which is async-signal-safe, between fork and
    // exec.
    unsafe {
        cmd.pre_exec(|| {
            let l = libc::rlimit { rlim_cur: 1024, rlim_max: 1024 };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    spawn_serve(cmd)
}

/// Starts `cmd` (a `tensorwire serve` command line) with its stdout read here: its pid, the
/// process, and its control, store and orchestrator addresses once it printed them.
fn spawn_serve(mut cmd: Command) -> (u32, Kill, [SocketAddr; 3]) {
    let mut serve = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let pid = serve.id();
    let mut lines = BufReader::new(serve.stdout.take().unwrap()).lines().map_while(Result::ok);
    let serve = Kill(serve);
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
    std::thread::spawn(move || lines.for_each(drop)); // serve never blocks on its stdout
    (pid, serve, [control.unwrap(), store.unwrap(), orch.unwrap()])
}

fn secret_in(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let f = dir.join("secret");
    let _ = std::fs::remove_file(&f);
    assert!(Command::new(EXE).arg("secret").arg("new").arg(&f).status().unwrap().success());
    f
}

/// GET `path` on `at`: the status, or None when nothing came back within 20 s.
async fn http_status(at: SocketAddr, path: &str) -> Option<u16> {
    let ask = async {
        let mut s = TcpStream::connect(at).await.ok()?;
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await.ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        std::str::from_utf8(out.get(9..12)?).ok()?.parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(20), ask).await.ok().flatten()
}

/// The attack of issue 61 on a `serve` of 1,024 descriptors: 2,000 idle streams over every
/// listener, half of them at the tcp data port after the public preamble (which used to keep a
/// stream forever). `serve` keeps answering its health check, workers join and requests
/// complete, its descriptors never reach its limit, and they come back afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_idle_streams_leave_serve_answering_and_joining() {
    let limit = raise_own_fd_limit();
    let streams = if limit >= 2600 { 2000 } else { (limit as usize).saturating_sub(600) };
    assert!(streams >= 1100, "this process may open {limit} descriptors: too few for the attack");
    let dir = std::env::temp_dir().join(format!("tw-idle-{}", std::process::id()));
    let secret_file = secret_in(&dir);
    let (data, metrics) = (free_port(), free_port());
    let (pid, _serve, [control, store, orch]) =
        serve_with_1024_descriptors(&secret_file, data, metrics);
    assert_eq!(http_status(metrics, "/healthz").await, Some(200));
    let before = usage(pid);
    let ports = [data, control, store, orch, metrics];
    let mut idle = Vec::new();
    let mut most = 0;
    for i in 0..streams {
        // Half at the data port (with the preamble), the rest over the other listeners.
        let at = if i % 2 == 0 { data } else { ports[1 + (i / 2) % 4] };
        if let Ok(mut s) = TcpStream::connect(at).await {
            if at == data {
                let _ = s.write_all(&tensorwire_tcp::wire::PREAMBLE).await;
            }
            idle.push(s);
        }
        if i % 100 == 0 {
            most = most.max(usage(pid).0);
        }
    }
    assert!(idle.len() >= streams * 9 / 10, "only {} of {streams} connected", idle.len());
    // While the streams are open: health answers, three workers join, requests complete.
    for _ in 0..5 {
        assert_eq!(http_status(metrics, "/healthz").await, Some(200), "healthz under the attack");
    }
    let (workers, sub) =
        pipeline([control, store, orch], &secret_file, || most = most.max(usage(pid).0)).await;
    eprintln!(
        "serve's descriptors: {} before, at most {most} under {} idle streams",
        before.0,
        idle.len()
    );
    assert!(most < 1000, "serve held {most} descriptors of its 1,024");
    drop((idle, workers, sub));
    descriptors_back(pid, before.0).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A descriptor as large as a handshake allows (1,000 regions with a 400-byte blob each, about
/// 460 KiB) under a fresh engine id: what a peer that restarts again and again, or a member
/// flooding handshakes, leaves behind.
fn large_descriptor(id: u128) -> Vec<u8> {
    use tensorwire_core::{AccessKey, EngineDescriptor, EngineId, MemoryKind, RegionId};
    let blob = bytes::Bytes::from(vec![0x5au8; 400]);
    let regions = (0..1000u64)
        .map(|i| tensorwire_core::RemoteRegion {
            engine: EngineId(id),
            id: RegionId(i),
            key: AccessKey::from_bits(u128::from(i)),
            len: 4096,
            kind: MemoryKind::Host,
            perms: tensorwire_core::Permissions::READ,
            blobs: vec![("tcp".into(), blob.clone())],
        })
        .collect();
    EngineDescriptor { engine: EngineId(id), host: "h".into(), backends: vec![], regions }.encode()
}

/// 1,000 handshakes with large descriptors (issue 61: 300 took `serve` from 9 to 314 MB, never
/// released): `serve`'s resident memory is flat over the last 400 (the table of peers keeps at
/// most 64 MiB of them, the least recently used going first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_large_handshakes_leave_serve_memory_flat() {
    let dir = std::env::temp_dir().join(format!("tw-descriptors-{}", std::process::id()));
    let secret_file = secret_in(&dir);
    let (pid, _serve, [control, _, _]) =
        serve_with_1024_descriptors(&secret_file, free_port(), free_port());
    let secret = ClusterSecret::from_file(&secret_file).unwrap();
    let start = usage(pid).1;
    let mut rss = Vec::new();
    for i in 0..1000u128 {
        let hello = large_descriptor(1 << 64 | i);
        let mut s = TcpStream::connect(control).await.unwrap();
        let hs = tensorwire_proto::handshake::Handshake {
            framing: &CONTROL,
            secret: Some(&secret),
            peer: control,
        };
        hs.client(&mut s).await.unwrap();
        CONTROL.write(&mut s, 1, &hello).await.unwrap();
        tensorwire_proto::handshake::expect(&mut s, &CONTROL, 1).await.unwrap();
        if i % 100 == 99 {
            rss.push(usage(pid).1);
        }
    }
    let mib = |b: u64| b >> 20;
    // The table fills within the first 200 handshakes; the allocator settles a little later.
    let (half, end) = (rss[5], rss[9]);
    eprintln!(
        "serve's resident memory every 100 handshakes (MiB, {} at start): {:?}",
        mib(start),
        rss.iter().map(|&b| mib(b)).collect::<Vec<_>>()
    );
    assert!(
        end <= half + (32 << 20),
        "resident memory grew from {} MiB after 600 handshakes to {} MiB after 1,000 ({:?} MiB)",
        mib(half),
        mib(end),
        rss.iter().map(|&b| mib(b)).collect::<Vec<_>>()
    );
    assert!(end <= start + (192 << 20), "{} MiB at start, {} MiB at the end", mib(start), mib(end));
    let _ = std::fs::remove_dir_all(&dir);
}
