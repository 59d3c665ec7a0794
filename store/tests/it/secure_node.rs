//! Secure by default, the store node: a reachable address needs the engine's cluster secret or
//! its `insecure` opt-out, and a client without the secret learns nothing (not the pool's key),
//! whatever it claims.

use std::net::SocketAddr;

use tensorwire_core::ClusterSecret;
use tensorwire_core::{Engine, EngineConfig, backend::MemBackend};
use tensorwire_store::rpc::{FRAMING, Request};
use tensorwire_store::{EmbeddedStore, StoreConfig, StoreNode};
use tensorwire_testkit::intruder::{Claim, assert_refused, frames_received};

async fn store(config: EngineConfig) -> (Engine, std::sync::Arc<EmbeddedStore>) {
    let e = Engine::builder().backend(MemBackend::new()).config(config).start().await.unwrap();
    let cfg = StoreConfig { capacity: 1 << 20, shared: true, ..StoreConfig::default() };
    let s = EmbeddedStore::new(&e, cfg).await.unwrap();
    (e, s)
}

fn secret() -> Option<ClusterSecret> {
    Some(ClusterSecret::new("0123456789abcdef0123456789abcdef"))
}

fn anywhere() -> SocketAddr {
    "0.0.0.0:0".parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reachable_node_needs_a_secret_or_insecure() {
    let (_e, open) = store(EngineConfig::default()).await;
    let e = StoreNode::serve(open, anywhere()).await.unwrap_err().to_string();
    assert!(e.contains("cluster secret") && e.contains("--insecure"), "{e}");
    let (_e, insecure) = store(EngineConfig { insecure: true, ..EngineConfig::default() }).await;
    StoreNode::serve(insecure, anywhere()).await.unwrap();
    let (_e, secured) =
        store(EngineConfig { cluster_secret: secret(), ..EngineConfig::default() }).await;
    StoreNode::serve(secured, anywhere()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_the_secret_learns_no_pool_key() {
    let (_e, s) = store(EngineConfig { cluster_secret: secret(), ..EngineConfig::default() }).await;
    let key = s.pool().key.to_bits().to_le_bytes();
    let node = StoreNode::serve(s, anywhere()).await.unwrap();
    let at = SocketAddr::from(([127, 0, 0, 1], node.addr().port()));
    let (kind, body) = Request::Hello.encode();
    let first = [&0u64.to_le_bytes()[..], &body].concat();
    for claim in [Claim::WrongProof, Claim::NoProof] {
        let frames = frames_received(at, &FRAMING, claim, (kind, &first)).await;
        assert_refused("store node", &frames, Some(&key));
    }
}
