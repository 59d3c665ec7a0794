//! The store suite against the embedded store and against a store node reached over tcp.

use std::sync::Arc;

use async_trait::async_trait;
use tensorwire_conformance::store::{StoreFactory, StoreUnderTest};
use tensorwire_core::{DType, Engine, TensorMeta};
use tensorwire_store::{EmbeddedStore, RemoteStore, Retention, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

async fn tcp_engine() -> Engine {
    Engine::builder().backend(TcpBackend::new(TcpConfig::default()).unwrap()).start().await.unwrap()
}

struct Embedded;

#[async_trait]
impl StoreFactory for Embedded {
    async fn make(&self, cfg: StoreConfig) -> StoreUnderTest {
        let engine = tcp_engine().await;
        let store = EmbeddedStore::new(&engine, cfg).await.unwrap();
        StoreUnderTest { store: store.clone(), client: engine, backing: store, keep: Vec::new() }
    }

    async fn abandon_put(&self, t: &StoreUnderTest, key: &[u8], len: u64) {
        let meta = TensorMeta::contiguous(DType::U8, &[len]);
        t.backing.begin_put(key, &meta, len, Retention::Normal).unwrap(); // never committed
    }
}

struct Remote;

#[async_trait]
impl StoreFactory for Remote {
    async fn make(&self, cfg: StoreConfig) -> StoreUnderTest {
        let node_engine = tcp_engine().await;
        let backing =
            EmbeddedStore::new(&node_engine, StoreConfig { shared: true, ..cfg }).await.unwrap();
        let node = StoreNode::serve(backing.clone(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
        let client = tcp_engine().await;
        let remote =
            RemoteStore::connect(&client, node_engine.local_addr(), node.addr()).await.unwrap();
        StoreUnderTest {
            store: Arc::new(remote),
            client,
            backing,
            keep: vec![Box::new(node), Box::new(node_engine)],
        }
    }

    async fn abandon_put(&self, t: &StoreUnderTest, key: &[u8], len: u64) {
        // A second client begins a put and dies (its connection closes) before committing.
        let client = tcp_engine().await;
        let node_engine = t.keep[1].downcast_ref::<Engine>().unwrap();
        let node = t.keep[0].downcast_ref::<StoreNode>().unwrap();
        let remote =
            RemoteStore::connect(&client, node_engine.local_addr(), node.addr()).await.unwrap();
        let meta = TensorMeta::contiguous(DType::U8, &[len]);
        remote.begin_put(key, &meta, len, Retention::Normal).await.unwrap();
        drop(remote);
        client.shutdown().await;
    }
}

mod embedded {
    use super::*;
    tensorwire_conformance::store_tests!(Embedded);
}

mod remote {
    use super::*;
    tensorwire_conformance::store_tests!(Remote);
}
