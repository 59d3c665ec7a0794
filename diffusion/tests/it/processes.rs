//! Encode, denoise and decode workers as separate OS processes over tcp, with a store node in the
//! parent (which also plays the queue: it forwards payload references between the workers). The
//! text embedding goes to two consumers; the [16, 21, 60, 104] bf16 latent goes to decode in 7
//! temporal chunks while denoise is still producing them. Every byte is checked by its consumer;
//! afterwards the store holds nothing. Runs in p2p, store and auto modes. The workers are this test
//! binary's child entry point "worker".

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use tensorwire_conformance::harness::{ChildBody, child_command};
use tensorwire_core::{DType, Engine, Permissions, Region, TensorMeta};
use tensorwire_diffusion::{
    Chunking, ConnectorConfig, ConsumerHint, DiffusionConnector, LeasePolicy, Mode, PayloadKind,
    PayloadRef, StagePayload,
};
use tensorwire_store::{EmbeddedStore, RemoteStore, Store, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_p2p() {
    run("p2p").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_store() {
    run("store").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_auto() {
    run("auto").await
}

/// The child entry point "worker": role, mode, the store node's engine and RPC addresses.
pub(crate) fn worker_child(args: Vec<String>) -> ChildBody {
    Box::pin(async move { worker(&args[0], &args[1], &args[2], &args[3]).await })
}

fn emb_meta() -> TensorMeta {
    TensorMeta::contiguous(DType::BF16, &[1, 226, 4096])
}

fn latent_meta() -> TensorMeta {
    TensorMeta::contiguous(DType::BF16, &[16, 21, 60, 104])
}

fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len as usize)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(9) as u8 ^ seed)
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

fn mode_of(s: &str) -> Mode {
    match s {
        "p2p" => Mode::P2p,
        "store" => Mode::Store,
        _ => Mode::Auto,
    }
}

/// Lines from the parent, read on a blocking thread.
fn stdin_lines() -> tokio::sync::mpsc::Receiver<String> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    rx
}

async fn expect(rx: &mut tokio::sync::mpsc::Receiver<String>, tag: &str) -> String {
    loop {
        let l = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .expect("parent went quiet")
            .expect("stdin closed");
        if let Some(rest) = l.strip_prefix(tag) {
            return rest.trim().to_string();
        }
    }
}

async fn consume_checked(
    c: &DiffusionConnector,
    r: &PayloadRef,
    expect_meta: &TensorMeta,
    seed: u8,
) -> usize {
    let len = expect_meta.nbytes().unwrap();
    let dst = Arc::new(c.engine().alloc(len, Permissions::NONE).await.unwrap());
    let mut cons = c.consume(r, dst.clone(), 0, Some(expect_meta)).unwrap();
    let want = pattern(len, seed);
    let mut n = 0;
    while let Some(v) = cons.next().await.unwrap() {
        for b in &v.ranges {
            let (at, n) = (b.offset as usize, b.len as usize);
            assert!(dst.to_vec(b.offset, b.len).unwrap() == want[at..at + n], "chunk {}", v.index);
        }
        n += 1;
    }
    assert!(dst.to_vec(0, len).unwrap() == want, "payload differs");
    n
}

async fn buffer(e: &Engine, meta: &TensorMeta, seed: u8) -> Arc<Region> {
    let len = meta.nbytes().unwrap();
    let r = e.alloc(len, Permissions::READ).await.unwrap();
    r.write_bytes(0, &pattern(len, seed)).unwrap();
    Arc::new(r)
}

/// The worker body: `role` in `mode`, with the store node at `node_engine` / `node_rpc`.
async fn worker(role: &str, mode: &str, node_engine: &str, node_rpc: &str) {
    let mode = mode_of(mode);
    let (node_engine, node_rpc) = (node_engine.parse().unwrap(), node_rpc.parse().unwrap());
    let engine = Engine::builder()
        .backend(TcpBackend::new(TcpConfig::default()).unwrap())
        .start()
        .await
        .unwrap();
    let store: Arc<dyn Store> =
        Arc::new(RemoteStore::connect(&engine, node_engine, node_rpc).await.unwrap());
    let cfg = ConnectorConfig { mode, checksum: true, wait_timeout: Duration::from_secs(20) };
    let c = DiffusionConnector::new(engine.clone(), Some(store), cfg);
    let mut input = stdin_lines();
    match role {
        "encode" => {
            let emb = buffer(&engine, &emb_meta(), 11).await;
            let p = c
                .publish(
                    StagePayload {
                        request: 1,
                        kind: PayloadKind::ConditionEmbedding,
                        region: emb,
                        offset: 0,
                        meta: emb_meta(),
                        chunking: None,
                        lease: LeasePolicy::DeleteOnConsume { consumers: 2 },
                    },
                    None,
                )
                .unwrap();
            println!("@@EMB {}", hex(&p.reference.to_bytes()));
            expect(&mut input, "EXIT").await;
            assert_eq!(c.held(), 0, "encode still holds its embedding");
        }
        "denoise" => {
            let emb = PayloadRef::from_bytes(&unhex(&expect(&mut input, "EMB").await)).unwrap();
            assert_eq!(consume_checked(&c, &emb, &emb_meta(), 11).await, 1);
            let latent = buffer(&engine, &latent_meta(), 22).await;
            let mut p = c
                .publish(
                    StagePayload {
                        request: 1,
                        kind: PayloadKind::Latent,
                        region: latent,
                        offset: 0,
                        meta: latent_meta(),
                        chunking: Some(Chunking { dim: 1, count: 7 }),
                        lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
                    },
                    Some(ConsumerHint { credit: 1 }),
                )
                .unwrap();
            println!("@@LAT {}", hex(&p.reference.to_bytes()));
            for i in 0..7 {
                tokio::time::sleep(Duration::from_millis(15)).await; // "denoising" chunk i
                p.mark_ready(i).unwrap();
            }
            expect(&mut input, "EXIT").await;
            // The consumer's Done goes in the background: it may land just after VERIFIED.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while c.held() != 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(c.held(), 0, "denoise still holds its latent 10 s after it was consumed");
        }
        _ => {
            let emb = PayloadRef::from_bytes(&unhex(&expect(&mut input, "EMB").await)).unwrap();
            let lat = PayloadRef::from_bytes(&unhex(&expect(&mut input, "LAT").await)).unwrap();
            assert_eq!(consume_checked(&c, &emb, &emb_meta(), 11).await, 1);
            assert_eq!(consume_checked(&c, &lat, &latent_meta(), 22).await, 7);
            println!("@@VERIFIED");
            expect(&mut input, "EXIT").await;
        }
    }
    println!("@@BYE");
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: std_mpsc::Receiver<String>,
}

impl Worker {
    fn spawn(role: &str, mode: &str, node_engine: &str, node_rpc: &str) -> Worker {
        let mut child = child_command("worker", &[role, mode, node_engine, node_rpc])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn worker");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = std_mpsc::sync_channel(64);
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                if let Some(at) = l.find("@@") {
                    let _ = tx.send(l[at + 2..].to_string());
                }
            }
        });
        Worker { child, stdin, lines }
    }

    fn wait_for(&self, tag: &str) -> String {
        loop {
            let l = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no {tag} from worker"));
            if let Some(rest) = l.strip_prefix(tag) {
                return rest.trim().to_string();
            }
        }
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn run(mode: &str) {
    let node_engine = Engine::builder()
        .backend(TcpBackend::new(TcpConfig::default()).unwrap())
        .start()
        .await
        .unwrap();
    let store =
        EmbeddedStore::new(&node_engine, StoreConfig { shared: true, ..StoreConfig::default() })
            .await
            .unwrap();
    let node = StoreNode::serve(store.clone(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let (ne, nr) = (node_engine.local_addr().to_string(), node.addr().to_string());
    let mut enc = Worker::spawn("encode", mode, &ne, &nr);
    let mut den = Worker::spawn("denoise", mode, &ne, &nr);
    let mut dec = Worker::spawn("decode", mode, &ne, &nr);
    let outcome = tokio::task::spawn_blocking(move || {
        let emb = enc.wait_for("EMB");
        den.send(&format!("EMB {emb}"));
        dec.send(&format!("EMB {emb}"));
        let lat = den.wait_for("LAT");
        dec.send(&format!("LAT {lat}"));
        dec.wait_for("VERIFIED");
        for w in [&mut enc, &mut den, &mut dec] {
            w.send("EXIT");
        }
        for w in [&mut enc, &mut den, &mut dec] {
            w.wait_for("BYE");
            let status = w.child.wait().unwrap();
            assert!(status.success(), "a worker failed");
        }
    })
    .await;
    outcome.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = store.stats().await.unwrap();
        if st.objects == 0 && st.used == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "store not empty: {st:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
