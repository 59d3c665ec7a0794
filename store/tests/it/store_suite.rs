//! The store suite against the embedded store and against a store node reached over tcp (with a
//! cluster secret on both engines and the node), dialled by its RPC address alone.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use tensorwire_core::{ClusterSecret, DType, Engine, EngineConfig, TensorMeta};
use tensorwire_store::testing::{StoreFactory, StoreUnderTest};
use tensorwire_store::{EmbeddedStore, RemoteStore, Retention, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

fn secret() -> ClusterSecret {
    ClusterSecret::new(b"store suite cluster secret, 32 bytes+")
}

async fn tcp_engine() -> Engine {
    let config = EngineConfig { cluster_secret: Some(secret()), ..EngineConfig::default() };
    let tcp = TcpBackend::new(TcpConfig::default()).unwrap();
    Engine::builder().backend(tcp).config(config).start().await.unwrap()
}

/// The embedded store a test's store is (or is served from): kept first in `keep`.
fn backing(t: &StoreUnderTest) -> &Arc<EmbeddedStore> {
    t.keep[0].downcast_ref::<Arc<EmbeddedStore>>().expect("the backing store is kept first")
}

struct Embedded;

#[async_trait]
impl StoreFactory for Embedded {
    async fn make(&self, cfg: StoreConfig) -> StoreUnderTest {
        let engine = tcp_engine().await;
        let store = EmbeddedStore::new(&engine, cfg).await.unwrap();
        StoreUnderTest { store: store.clone(), client: engine, keep: vec![Box::new(store)] }
    }

    async fn abandon_put(&self, t: &StoreUnderTest, key: &[u8], len: u64) {
        let meta = TensorMeta::contiguous(DType::U8, &[len]);
        backing(t).begin_put(key, &meta, len, Retention::Normal).unwrap(); // never committed
    }

    fn spill_file(&self, t: &StoreUnderTest, key: &[u8]) -> Option<PathBuf> {
        backing(t).spill_file(key)
    }
}

struct Remote;

#[async_trait]
impl StoreFactory for Remote {
    async fn make(&self, cfg: StoreConfig) -> StoreUnderTest {
        let node_engine = tcp_engine().await;
        let backing =
            EmbeddedStore::new(&node_engine, StoreConfig { shared: true, ..cfg }).await.unwrap();
        let listen = "127.0.0.1:0".parse().unwrap();
        let node = StoreNode::serve(backing.clone(), listen).await.unwrap();
        let client = tcp_engine().await;
        // The node's RPC address alone: the node tells where its engine is (`abandon_put` below
        // gives both addresses).
        let remote = RemoteStore::connect_node(&client, node.addr()).await.unwrap();
        StoreUnderTest {
            store: Arc::new(remote),
            client,
            keep: vec![Box::new(backing), Box::new(node), Box::new(node_engine)],
        }
    }

    async fn abandon_put(&self, t: &StoreUnderTest, key: &[u8], len: u64) {
        // A second client begins a put and dies (its connection closes) before committing.
        let client = tcp_engine().await;
        let node = t.keep[1].downcast_ref::<StoreNode>().unwrap();
        let node_engine = t.keep[2].downcast_ref::<Engine>().unwrap();
        let remote =
            RemoteStore::connect(&client, node_engine.local_addr(), node.addr()).await.unwrap();
        let meta = TensorMeta::contiguous(DType::U8, &[len]);
        remote.begin_put(key, &meta, len, Retention::Normal).await.unwrap();
        drop(remote);
        client.shutdown().await;
    }

    fn spill_file(&self, t: &StoreUnderTest, key: &[u8]) -> Option<PathBuf> {
        backing(t).spill_file(key)
    }
}

mod embedded {
    use super::*;
    tensorwire_store::store_tests!(Embedded);
}

mod remote {
    use super::*;
    tensorwire_store::store_tests!(Remote);
}
