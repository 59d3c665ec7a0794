//! Two OS processes over real sockets: this test binary re-runs itself as the child (the
//! `child_engine` test, active only when `TW_TCP_CHILD` is set). The child owns a writable 64 MiB
//! region and waits for a chunked tensor; the parent sends it. A second test stops and then kills
//! the child mid-transfer: every pending op must fail as a peer failure within the configured
//! bounds, and nothing of the connection (tasks, region slices) may be left behind.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tensorwire_core::{
    ChunkPlan, DType, Engine, EngineConfig, Permissions, RegionId, TensorMeta, TransferOp,
};
use tensorwire_tcp::{TcpBackend, TcpConfig};

const CHILD_ENV: &str = "TW_TCP_CHILD";

/// [8, 32, 256, 512] bf16 = 64 MiB, chunked in 8 along dim 1.
fn meta() -> TensorMeta {
    TensorMeta::contiguous(DType::BF16, &[8, 32, 256, 512])
}

fn byte_at(i: usize) -> u8 {
    (i as u32).wrapping_mul(2_654_435_761).rotate_left(11) as u8
}

async fn engine(stall: Duration) -> Engine {
    let tcp = TcpBackend::new(TcpConfig { stall_timeout: stall, ..TcpConfig::default() }).unwrap();
    let cfg = EngineConfig { transfer_timeout: Duration::from_secs(20), ..EngineConfig::default() };
    Engine::builder().backend(tcp).config(cfg).start().await.unwrap()
}

/// The child: prints `READY <addr> <region> <transfer id>`, receives the chunked tensor, checks
/// every byte and prints `VERIFIED <bytes>`. In `hold` mode it only waits to be stopped or killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_engine() {
    let Ok(mode) = std::env::var(CHILD_ENV) else { return };
    let e = engine(Duration::from_secs(30)).await;
    let meta = meta();
    let len = if mode == "hold" { 512 << 20 } else { meta.nbytes().unwrap() };
    let dst = e.alloc(len, Permissions::WRITE).await.unwrap();
    let plan = ChunkPlan::new(&meta, 1, 8).unwrap();
    let mut stream = e.expect_chunks(plan, &dst, 0).unwrap();
    println!("READY {} {} {}", e.local_addr(), dst.id().0, stream.transfer_id());
    if mode == "hold" {
        tokio::time::sleep(Duration::from_secs(120)).await;
        return;
    }
    let mut chunks = 0;
    while let Some(c) = stream.next().await.unwrap() {
        chunks += 1;
        println!("CHUNK {} {}..{}", c.index, c.start, c.end);
    }
    assert_eq!(chunks, 8);
    let got = dst.to_vec(0, len).unwrap();
    let bad = got.iter().enumerate().position(|(i, &b)| b != byte_at(i));
    assert_eq!(bad, None, "first wrong byte");
    println!("VERIFIED {len}");
}

struct Spawned {
    child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_child(mode: &str) -> (Spawned, SocketAddr, RegionId, u64) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_engine", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, mode)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child test process");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.find("READY ").map(|at| l[at..].to_string()))
        .expect("child never became ready");
    // libtest may print "test child_engine ... " on the same line first.
    let f: Vec<&str> = ready.split_whitespace().collect();
    let addr = f[1].parse().unwrap();
    let (region, transfer) = (RegionId(f[2].parse().unwrap()), f[3].parse().unwrap());
    (Spawned { child, lines }, addr, region, transfer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_64mib_tensor_to_another_process() {
    let (mut child, addr, region, transfer) = spawn_child("receive");
    let e = engine(Duration::from_secs(30)).await;
    let meta = meta();
    let len = meta.nbytes().unwrap();
    let src = e.alloc(len, Permissions::NONE).await.unwrap();
    let data: Vec<u8> = (0..len as usize).map(byte_at).collect();
    src.write_bytes(0, &data).unwrap();
    let s = e.connect(addr).await.expect("connect to child");
    let remote = s.remote_region(region).expect("child advertised its region");
    let plan = ChunkPlan::new(&meta, 1, 8).unwrap();
    let sender = s.chunk_sender(transfer, plan, &src, 0, &remote, 0).unwrap();
    for i in (0..8).rev() {
        sender.mark_ready(i).unwrap(); // out of order on purpose
    }
    tokio::time::timeout(Duration::from_secs(60), sender.finish()).await.unwrap().unwrap();
    let lines: Vec<String> = child.lines.by_ref().map_while(Result::ok).collect();
    let status = child.child.wait().unwrap();
    assert!(status.success(), "child failed: {lines:?}");
    assert_eq!(lines.iter().filter(|l| l.contains("CHUNK ")).count(), 8, "{lines:?}");
    assert!(lines.iter().any(|l| l.contains(&format!("VERIFIED {len}"))), "{lines:?}");
    assert_eq!(e.stats().bytes_written, len);
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: sending a signal to our own child process by pid; no memory is involved.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({sig})");
}

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current().metrics().num_alive_tasks()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_stopped_then_killed_mid_transfer() {
    let (child, addr, region, _) = spawn_child("hold");
    // A short stall bound: a stopped peer is detected by it; a killed one by the closed socket.
    let e = engine(Duration::from_secs(2)).await;
    let (n, size) = (32u64, 16u64 << 20);
    let src = e.alloc(n * size, Permissions::NONE).await.unwrap();
    let tasks_before = alive_tasks(); // the engine's listeners, before any session or stream
    let s = e.connect(addr).await.unwrap();
    let remote = s.remote_region(region).unwrap();
    s.transfer(TransferOp::write(&src, 0, &remote, 0, 4096)).await.expect("warm-up write");
    assert!(alive_tasks() > tasks_before, "the connection's stream tasks are running");

    // Stopped: nothing is read on the far side, so every op stalls, then times out.
    signal(&child.child, libc::SIGSTOP);
    let ops = (0..n).map(|i| TransferOp::write(&src, i * size, &remote, i * size, size)).collect();
    let started = std::time::Instant::now();
    let handles = s.submit(ops).await;
    for (i, h) in handles.into_iter().enumerate() {
        let r = tokio::time::timeout(Duration::from_secs(30), h).await.expect("op hung");
        let e = r.expect_err("no op can complete against a stopped peer");
        assert!(e.is_peer_failure(), "op {i}: {e}");
    }
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(25), "stall detection took {waited:?}");

    // Killed: later ops fail at once, since the connection is dead.
    signal(&child.child, libc::SIGKILL);
    let r = s.transfer(TransferOp::write(&src, 0, &remote, 0, size)).await;
    assert!(r.expect_err("a dead peer accepted an op").is_peer_failure());

    // Nothing is left behind: the connection's tasks are gone and no op holds the source region.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while alive_tasks() > tasks_before && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        alive_tasks() <= tasks_before,
        "tasks alive: {} (before connecting: {tasks_before})",
        alive_tasks()
    );
    tokio::time::timeout(Duration::from_secs(5), src.deregister())
        .await
        .expect("deregister waited on a leaked op")
        .unwrap();
    drop(child);
}
