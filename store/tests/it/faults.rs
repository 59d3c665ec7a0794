//! The store RPC through a fault proxy: a partition makes a call fail within the engine's
//! `transfer_timeout` (never hang), and once it heals the same client works again (the late
//! answer is dropped, not taken for a protocol error); a reset breaks the connection, and the
//! client dials a new one for its next calls. Object bytes move over the engine, not the proxy.

use std::time::{Duration, Instant};

use tensorwire_core::{DType, Engine, EngineConfig, Permissions, TensorMeta};
use tensorwire_store::{EmbeddedStore, RemoteStore, Retention, Store, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};
use tensorwire_testkit::faults::{Fault, FaultProxy};

const BOUND: Duration = Duration::from_millis(700);

async fn engine(config: EngineConfig) -> Engine {
    let tcp = TcpBackend::new(TcpConfig::default()).unwrap();
    Engine::builder().backend(tcp).config(config).start().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_rpc_survives_a_partition_and_a_reset() {
    let node_engine = engine(EngineConfig::default()).await;
    let cfg = StoreConfig { capacity: 4 << 20, shared: true, ..StoreConfig::default() };
    let store = EmbeddedStore::new(&node_engine, cfg).await.unwrap();
    let node = StoreNode::serve(store, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let proxy = FaultProxy::start(node.addr()).await.unwrap();
    let client = engine(EngineConfig { transfer_timeout: BOUND, ..EngineConfig::default() }).await;
    let remote =
        RemoteStore::connect(&client, node_engine.local_addr(), proxy.addr()).await.unwrap();
    let meta = TensorMeta::contiguous(DType::U8, &[4096]);
    let src = client.alloc(4096, Permissions::NONE).await.unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13) as u8).collect();
    src.write_bytes(0, &data).unwrap();
    let all = src.slice(0, 4096).unwrap();
    remote.put_from(b"k", &meta, &all, Retention::Normal).await.unwrap();

    proxy.set(Fault::Partition);
    let t = Instant::now();
    let e = remote.exists(b"k").await.unwrap_err();
    assert!(t.elapsed() < BOUND * 5, "failed after {:?}", t.elapsed());
    assert!(e.to_string().contains("did not answer"), "{e}");
    proxy.set(Fault::None);
    assert!(remote.exists(b"k").await.unwrap(), "the same client works once healed");

    proxy.reset_all();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _ = remote.exists(b"k").await; // may find the connection cut
    assert!(remote.exists(b"k").await.unwrap(), "a new connection was dialed");
    let dst = client.alloc(4096, Permissions::NONE).await.unwrap();
    remote.get_into(b"k", &dst, 0).await.unwrap();
    assert!(dst.to_vec(0, 4096).unwrap() == data);
    assert!(proxy.forwarded() > 0, "the calls went through the proxy");
}
