//! Tests across two OS processes, written once for every backend. The test binary re-runs itself
//! as the child (a [`crate::harness`] child entry point); the child owns a writable region,
//! prints `READY <control addr> <region> <chunked transfer id>` and either receives a chunked
//! 64 MiB tensor (checking every byte) or just holds still to be stopped and killed. In a
//! backend's test binary, a module holds the two tests and the binary's root names the child:
//!
//! ```ignore
//! // tests/it/two_process.rs
//! tensorwire_conformance::multiprocess_tests!("engine", my_backend);
//! // tests/it/main.rs
//! tensorwire_conformance::children! { "engine" => two_process::child }
//! ```

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_core::{
    ChunkPlan, DType, Engine, EngineConfig, Permissions, RegionId, TensorMeta, TransferOp,
    backend::Backend,
};

/// [8, 32, 256, 512] bf16 = 64 MiB, chunked in 8 along dim 1.
fn meta() -> TensorMeta {
    TensorMeta::contiguous(DType::BF16, &[8, 32, 256, 512])
}

fn byte_at(i: usize) -> u8 {
    (i as u32).wrapping_mul(2_654_435_761).rotate_left(11) as u8
}

async fn engine(backend: Arc<dyn Backend>, transfer_timeout: Duration) -> Engine {
    let cfg = EngineConfig { transfer_timeout, ..EngineConfig::default() };
    Engine::builder().backend(backend).config(cfg).start().await.expect("start engine")
}

/// The child's body, in `mode` ("receive" or "hold"). The backend is made only in the child, so
/// the parent's own tests never see a stray backend (its sockets, its threads) appear and vanish
/// while they count resources.
pub async fn child(make: impl FnOnce() -> Arc<dyn Backend>, mode: &str) {
    let e = engine(make(), Duration::from_secs(30)).await;
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

/// A running child; killed and reaped on drop.
#[derive(Debug)]
pub struct Spawned {
    /// The process.
    pub child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
    /// Its engine's control address.
    pub addr: SocketAddr,
    /// Its writable region.
    pub region: RegionId,
    /// Its expected chunked transfer.
    pub transfer: u64,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns this test binary's child entry point `name` in `mode` ("receive" or "hold").
pub fn spawn_child(name: &str, mode: &str) -> Spawned {
    let mut child = crate::harness::child_command(name, &[mode])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child test process");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("READY ").map(str::to_string))
        .expect("child never became ready");
    let f: Vec<&str> = ready.split_whitespace().collect();
    Spawned {
        addr: f[0].parse().unwrap(),
        region: RegionId(f[1].parse().unwrap()),
        transfer: f[2].parse().unwrap(),
        child,
        lines,
    }
}

/// Parent: sends the chunked 64 MiB tensor (chunks marked out of order) to a receiving child
/// (entry point `name`), which checks every byte.
pub async fn chunked_tensor_to_child(backend: Arc<dyn Backend>, name: &str) {
    let mut child = spawn_child(name, "receive");
    let e = engine(backend.clone(), Duration::from_secs(20)).await;
    let meta = meta();
    let len = meta.nbytes().unwrap();
    let src = e.alloc(len, Permissions::NONE).await.unwrap();
    let data: Vec<u8> = (0..len as usize).map(byte_at).collect();
    src.write_bytes(0, &data).unwrap();
    let s = e.connect(child.addr).await.expect("connect to child");
    let remote = s.remote_region(child.region).expect("child advertised its region");
    let plan = ChunkPlan::new(&meta, 1, 8).unwrap();
    let sender = s.chunk_sender(child.transfer, plan, &src, 0, &remote, 0).unwrap();
    for i in (0..8).rev() {
        sender.mark_ready(i).unwrap();
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

/// Parent: stops the child with ops in flight (each must fail as a peer failure within the
/// engine's bounds), kills it (later ops fail soon after), and checks nothing is left: no
/// connection task, no op holding the source region.
pub async fn child_stopped_then_killed(backend: Arc<dyn Backend>, name: &str) {
    let child = spawn_child(name, "hold");
    let e = engine(backend, Duration::from_secs(3)).await;
    let (n, size) = (32u64, 16u64 << 20);
    let src = e.alloc(n * size, Permissions::NONE).await.unwrap();
    let tasks_before = alive_tasks(); // the engine's listeners, before any session or stream
    let s = e.connect(child.addr).await.unwrap();
    let remote = s.remote_region(child.region).unwrap();
    s.transfer(TransferOp::write(&src, 0, &remote, 0, 4096)).await.expect("warm-up write");
    // Backends that serve connections with tokio tasks have some running now (a backend with its
    // own progress thread has none); either way none may outlive the dead peer.

    signal(&child.child, libc::SIGSTOP);
    let ops = (0..n).map(|i| TransferOp::write(&src, i * size, &remote, i * size, size)).collect();
    let started = Instant::now();
    let handles = s.submit(ops).await;
    for (i, h) in handles.into_iter().enumerate() {
        let r = tokio::time::timeout(Duration::from_secs(30), h).await.expect("op hung");
        if let Err(e) = r {
            assert!(e.is_peer_failure(), "op {i}: {e}");
        }
    }
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(25), "failure detection took {waited:?}");

    signal(&child.child, libc::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = s.transfer(TransferOp::write(&src, 0, &remote, 0, size)).await;
        match r {
            Err(e) if e.is_peer_failure() => break,
            other => assert!(Instant::now() < deadline, "a killed peer still answers: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive_tasks() > tasks_before && Instant::now() < deadline {
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

/// The two-process tests of a backend made by `$make`, in the module where it expands: the tests
/// `chunked_tensor_to_child` and `child_stopped_then_killed`, and `child`, the child entry point
/// to name `$name` in the binary's [`children!`](crate::children).
#[macro_export]
macro_rules! multiprocess_tests {
    ($name:literal, $make:expr) => {
        #[test]
        fn chunked_tensor_to_child() {
            $crate::harness::block_on($crate::multiprocess::chunked_tensor_to_child(
                ($make)(),
                $name,
            ));
        }

        #[test]
        fn child_stopped_then_killed() {
            $crate::harness::block_on($crate::multiprocess::child_stopped_then_killed(
                ($make)(),
                $name,
            ));
        }

        /// The child entry point of these tests.
        pub(crate) fn child(args: Vec<String>) -> $crate::harness::ChildBody {
            Box::pin(async move {
                let mode = args.first().map_or("receive", String::as_str);
                $crate::multiprocess::child($make, mode).await
            })
        }
    };
}
