//! The cluster store over three store nodes (each with its own engine, reached over tcp): the
//! store suite (where its single-pool assumptions hold), reads that fall over when the node of
//! the first replica dies, leases across replicas, and repair after a node loss and a restart.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tensorwire_core::{DType, Engine, EngineConfig, Permissions, TensorMeta};
use tensorwire_proto::discovery::{Discovery, Entry, Registration};
use tensorwire_store::cluster::{ClusterConfig, ClusterStore, placement};
use tensorwire_store::testing::{StoreFactory, StoreUnderTest};
use tensorwire_store::{EmbeddedStore, Retention, Store, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

async fn engine() -> Engine {
    let tcp = TcpBackend::new(TcpConfig::default()).unwrap();
    let config =
        EngineConfig { transfer_timeout: Duration::from_secs(5), ..EngineConfig::default() };
    Engine::builder().backend(tcp).config(config).start().await.unwrap()
}

/// One store node: its engine, pool and RPC server (dropping it is the node dying).
struct Node {
    store: Arc<EmbeddedStore>,
    server: StoreNode,
    engine: Engine,
}

impl Node {
    async fn start(at: SocketAddr, cfg: &StoreConfig) -> Node {
        let engine = engine().await;
        let store =
            EmbeddedStore::new(&engine, StoreConfig { shared: true, ..cfg.clone() }).await.unwrap();
        let server = StoreNode::serve(store.clone(), at).await.unwrap();
        Node { store, server, engine }
    }

    async fn kill(self) {
        drop(self.server);
        self.engine.shutdown().await;
    }
}

/// Three nodes and a client.
struct Cluster {
    nodes: Vec<Option<Node>>,
    addrs: Vec<SocketAddr>,
    client: Engine,
    store: Arc<ClusterStore>,
    cfg: StoreConfig,
}

/// Node `i`'s configuration: `cfg` with a spill folder of its own under `cfg`'s.
fn node_cfg(cfg: &StoreConfig, i: usize) -> StoreConfig {
    let spill_dir = cfg.spill_dir.as_ref().map(|d| d.join(format!("node-{i}")));
    StoreConfig { spill_dir, ..cfg.clone() }
}

impl Cluster {
    async fn start(n: usize, node_cfg: StoreConfig, cfg: ClusterConfig) -> Cluster {
        let mut nodes = Vec::new();
        for i in 0..n {
            let at = "127.0.0.1:0".parse().unwrap();
            nodes.push(Some(Node::start(at, &self::node_cfg(&node_cfg, i)).await));
        }
        let addrs: Vec<SocketAddr> = nodes.iter().flatten().map(|n| n.server.addr()).collect();
        let client = engine().await;
        let store = Arc::new(ClusterStore::remote(&client, &addrs, cfg).unwrap());
        Cluster { nodes, addrs, client, store, cfg: node_cfg }
    }

    /// The node index of `key`'s replicas, in placement order.
    fn placement(&self, key: &[u8]) -> Vec<usize> {
        let ids: Vec<String> = self.addrs.iter().map(|a| a.to_string()).collect();
        placement::rank(key, &ids)
            .into_iter()
            .map(|id| ids.iter().position(|i| i == id).unwrap())
            .collect()
    }

    /// Which live nodes hold `key`.
    async fn holders(&self, key: &[u8]) -> Vec<usize> {
        let mut v = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            if let Some(n) = n {
                if n.store.exists(key).await.unwrap() {
                    v.push(i);
                }
            }
        }
        v
    }

    /// Asserts that `key` is held by exactly its first two nodes.
    async fn assert_on_placement(&self, key: &[u8]) {
        let mut held = self.holders(key).await;
        held.sort_unstable();
        let mut want = self.placement(key)[..2].to_vec();
        want.sort_unstable();
        assert_eq!(held, want, "{:?} is not on its placement", String::from_utf8_lossy(key));
    }

    async fn kill(&mut self, i: usize) {
        self.nodes[i].take().unwrap().kill().await;
    }

    /// Starts node `i` again, empty, at its old address.
    async fn restart(&mut self, i: usize) {
        self.nodes[i] = Some(Node::start(self.addrs[i], &node_cfg(&self.cfg, i)).await);
    }
}

fn meta(len: u64) -> TensorMeta {
    TensorMeta::contiguous(DType::U8, &[len])
}

struct ThreeNodes;

#[async_trait]
impl StoreFactory for ThreeNodes {
    async fn make(&self, cfg: StoreConfig) -> StoreUnderTest {
        let c = Cluster::start(3, cfg, ClusterConfig::default()).await;
        let (store, client) = (c.store.clone(), c.client.clone());
        StoreUnderTest { store, client, keep: vec![Box::new(Arc::new(c.nodes))] }
    }

    async fn abandon_put(&self, _: &StoreUnderTest, _: &[u8], _: u64) {
        unreachable!("not run against a cluster: see the list below")
    }

    fn spill_file(&self, _: &StoreUnderTest, _: &[u8]) -> Option<PathBuf> {
        None
    }
}

/// The suite's tests whose expectations hold for a cluster. Left out: eviction order and
/// pinning against one pool's capacity (each node evicts on its own, and with two replicas a
/// pool holds a different mix), the spill tier (a node's, tested there), the abandoned put
/// (a node's sweep, tested there), and the two that end by counting objects in `stats`
/// (`bad_inputs`, `concurrent_readers_and_writers`: a cluster's counters add its nodes', so
/// they count copies; their other checks are those of `exact_bytes` and `batches`).
mod suite {
    use super::*;
    use tensorwire_store::testing;

    macro_rules! run {
        ($($name:ident),*) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                testing::$name(&ThreeNodes).await
            }
        )*};
    }
    run!(exact_bytes, exists_and_remove, meta_without_bytes, batches, leases);
}

fn pool() -> StoreConfig {
    StoreConfig { capacity: 16 << 20, ..StoreConfig::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_lands_on_its_placement_and_a_get_survives_its_first_replica_dying() {
    let mut c = Cluster::start(3, pool(), ClusterConfig::default()).await;
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
    let len = data.len() as u64;
    let key = b"embed/42";
    c.store.put(key, &meta(len), &data, Retention::Normal).await.unwrap();
    let order = c.placement(key);
    c.assert_on_placement(key).await;

    // Between put and get, the node of the first replica dies (SIGKILL-like: no goodbye).
    c.kill(order[0]).await;
    let dst = c.client.alloc(len + 8, Permissions::NONE).await.unwrap();
    let (m, n) = c.store.get_into(key, &dst, 8).await.unwrap();
    assert_eq!((m, n), (meta(len), len));
    assert!(dst.to_vec(8, len).unwrap() == data, "bytes from the second replica differ");
    let (_, got) = c.store.get(key).await.unwrap();
    assert!(got == data);
    assert!(c.store.exists(key).await.unwrap());

    // A read past its deadline tries no further replica.
    let cfg = ClusterConfig { read_deadline: Duration::ZERO, ..ClusterConfig::default() };
    let hasty = ClusterStore::remote(&c.client, &c.addrs, cfg).unwrap();
    let e = hasty.get(key).await.unwrap_err();
    assert!(
        matches!(e, tensorwire_store::StoreError::Engine(tensorwire_core::Error::Timeout { .. })),
        "{e}"
    );

    // A key one replica holds already: the put is refused and leaves no copy elsewhere.
    let second = order[1];
    let node = c.nodes[second].as_ref().unwrap();
    node.store.put(b"taken", &meta(2), &[7, 7], Retention::Normal).await.unwrap();
    let e = c.store.put(b"taken", &meta(3), &[1, 2, 3], Retention::Normal).await.unwrap_err();
    assert!(matches!(e, tensorwire_store::StoreError::Exists { .. }), "{e}");
    assert_eq!(c.holders(b"taken").await, vec![second], "a copy written beside the refusal stayed");

    // A put while that node is down goes to the live nodes; a get of a missing key says so.
    c.store.put(b"later", &meta(3), &[1, 2, 3], Retention::Normal).await.unwrap();
    let mut held = c.holders(b"later").await;
    held.sort_unstable();
    assert_eq!(held.len(), 2);
    assert!(!held.contains(&order[0]));
    assert!(matches!(
        c.store.get(b"never").await,
        Err(tensorwire_store::StoreError::NotFound { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_spill_file_on_the_first_replica_is_read_from_the_next() {
    let dir = std::env::temp_dir().join(format!("tw-cluster-spill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = StoreConfig {
        capacity: 4 << 20,
        high_watermark: 0.75,
        low_watermark: 0.5,
        spill_dir: Some(dir.clone()),
        ..StoreConfig::default()
    };
    let c = Cluster::start(3, cfg, ClusterConfig::default()).await;
    let key = b"spilled/1";
    let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 13 + 5) as u8).collect();
    c.store.put(key, &meta(data.len() as u64), &data, Retention::Normal).await.unwrap();
    for i in 0..12 {
        let filler = format!("filler/{i}");
        c.store
            .put(filler.as_bytes(), &meta(1 << 20), &vec![1; 1 << 20], Retention::Normal)
            .await
            .unwrap();
    }
    // The first replica's copy went to its spill folder: one flipped byte in its bytes.
    let first = c.placement(key)[0];
    let folder = dir.join(format!("node-{first}"));
    let file = std::fs::read_dir(&folder)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            let head = std::fs::read(p).unwrap_or_default();
            head.len() > 4096 && head[..4096].windows(key.len()).any(|w| w == key)
        })
        .unwrap_or_else(|| panic!("{key:?} was not spilled on its first replica ({folder:?})"));
    let mut b = std::fs::read(&file).unwrap();
    b[4096 + 1000] ^= 0x40;
    std::fs::write(&file, &b).unwrap();
    let e = c.nodes[first].as_ref().unwrap().store.get(key).await.unwrap_err();
    assert!(matches!(e, tensorwire_store::StoreError::Corrupt(_)), "{e}");
    // The cluster reads it from the next replica instead of failing.
    let (m, got) = c.store.get(key).await.unwrap();
    assert_eq!(m, meta(data.len() as u64));
    assert!(got == data, "the bytes read past the corrupt replica differ");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_count_each_consumer_once_per_object_and_reach_every_replica() {
    let c = Cluster::start(3, pool(), ClusterConfig::default()).await;
    let s = &c.store;
    // Two consumers: the first report leaves both replicas, the second removes both.
    s.put(b"two", &meta(8), &[9; 8], Retention::Pinned).await.unwrap();
    s.set_lease(b"two", 2, None).await.unwrap();
    assert!(!s.consumed(b"two").await.unwrap());
    assert_eq!(c.holders(b"two").await.len(), 2, "one report must not count twice");
    assert!(s.consumed(b"two").await.unwrap());
    assert!(c.holders(b"two").await.is_empty(), "the last report removes every replica");
    assert!(matches!(s.consumed(b"two").await, Err(tensorwire_store::StoreError::NotFound { .. })));

    // A consumer faster than the lease: counted on every replica when the count comes.
    s.put(b"early", &meta(8), &[1; 8], Retention::Pinned).await.unwrap();
    assert!(!s.consumed(b"early").await.unwrap());
    s.set_lease(b"early", 1, None).await.unwrap();
    assert!(c.holders(b"early").await.is_empty());

    // A replica that missed a report (its node was out of reach) holds a higher count: the
    // repair lowers it to the lowest, so the object still goes with its last consumer.
    s.put(b"missed", &meta(8), &[5; 8], Retention::Pinned).await.unwrap();
    s.set_lease(b"missed", 3, None).await.unwrap();
    let first = c.placement(b"missed")[0];
    assert!(!c.nodes[first].as_ref().unwrap().store.consumed(b"missed").await.unwrap());
    let r = s.repair().await.unwrap();
    assert_eq!(r.recounted, 1, "{r:?}");
    assert!(!s.consumed(b"missed").await.unwrap());
    assert!(s.consumed(b"missed").await.unwrap());
    assert!(c.holders(b"missed").await.is_empty(), "a replica outlived the last consumer");

    // Replicas with different counts (a report one of them missed, no repair yet): when one
    // says a report was the last, every copy goes, the one whose count was higher too.
    s.put(b"uneven", &meta(8), &[6; 8], Retention::Pinned).await.unwrap();
    s.set_lease(b"uneven", 2, None).await.unwrap();
    let second = c.placement(b"uneven")[1];
    assert!(!c.nodes[second].as_ref().unwrap().store.consumed(b"uneven").await.unwrap());
    assert!(s.consumed(b"uneven").await.unwrap(), "the second replica's count reached zero");
    assert!(c.holders(b"uneven").await.is_empty(), "a replica outlived the report that was last");

    // A TTL applies on every replica.
    s.put(b"ttl", &meta(8), &[2; 8], Retention::Normal).await.unwrap();
    s.set_lease(b"ttl", 0, Some(Duration::from_millis(200))).await.unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while !c.holders(b"ttl").await.is_empty() {
        assert!(std::time::Instant::now() < until, "the TTL did not remove every replica");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Pins reach every replica: eviction pressure on every node leaves a pinned object whole.
    s.put(b"pinned", &meta(4 << 20), &vec![3; 4 << 20], Retention::Normal).await.unwrap();
    s.pin(b"pinned").await.unwrap();
    for i in 0..12 {
        let key = format!("filler-{i}");
        s.put(key.as_bytes(), &meta(3 << 20), &vec![4; 3 << 20], Retention::Normal).await.unwrap();
    }
    assert!(s.stats().await.unwrap().evictions > 0, "the fillers must have evicted something");
    assert_eq!(c.holders(b"pinned").await.len(), 2, "a pinned replica was evicted");
    s.unpin(b"pinned").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_restores_replicas_after_a_loss_and_rebalances_after_a_restart() {
    let mut c = Cluster::start(3, pool(), ClusterConfig::default()).await;
    let n = 60usize;
    for i in 0..n {
        let key = format!("obj-{i}");
        let body = vec![i as u8; 1000 + i];
        c.store
            .put(key.as_bytes(), &meta(body.len() as u64), &body, Retention::Pinned)
            .await
            .unwrap();
        c.store.set_lease(key.as_bytes(), 2, None).await.unwrap();
    }
    // One consumer of every object reported before the loss: the copies must remember it.
    for i in 0..n {
        assert!(!c.store.consumed(format!("obj-{i}").as_bytes()).await.unwrap());
    }
    let r = c.store.repair().await.unwrap();
    assert!(r.idle(), "nothing to repair on a healthy cluster: {r:?}");
    assert_eq!(r.objects, n);

    c.kill(1).await;
    // Rounds until nothing is left to do (the first finds node 1 dead when it dials it).
    let mut copied = 0;
    for round in 0.. {
        let r = c.store.repair().await.unwrap();
        copied += r.copied;
        if r.idle() && round > 0 {
            break;
        }
        assert!(round < 10, "repair does not converge: {r:?}");
    }
    let lost_replica =
        (0..n).filter(|i| c.placement(format!("obj-{i}").as_bytes())[..2].contains(&1)).count();
    assert_eq!(copied, lost_replica, "one copy per object that had a replica on the dead node");
    for i in 0..n {
        let key = format!("obj-{i}");
        assert_eq!(c.holders(key.as_bytes()).await.len(), 2, "{key} has not two replicas");
    }

    // The node comes back empty at its address: its share moves back, the stand-ins go.
    c.restart(1).await;
    // Rounds until all three nodes are listed (node 1 sits out the rest of its time out after
    // the failed dial) and nothing is left to do.
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = c.store.repair().await.unwrap();
        if r.idle() && r.nodes == 3 {
            break;
        }
        assert!(std::time::Instant::now() < until, "rebalance does not converge: {r:?}");
        if r.idle() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for i in 0..n {
        let key = format!("obj-{i}");
        c.assert_on_placement(key.as_bytes()).await;
        let (_, body) = c.store.get(key.as_bytes()).await.unwrap();
        assert!(body == vec![i as u8; 1000 + i], "{key}'s bytes changed");
    }
    // The copies kept the lease: one more report per object removes every replica.
    for i in 0..n {
        assert!(c.store.consumed(format!("obj-{i}").as_bytes()).await.unwrap());
    }
    assert_eq!(c.store.stats().await.unwrap().objects, 0, "objects left after the last consumer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repair_copy_carries_the_objects_pins_and_lease() {
    let mut c = Cluster::start(3, pool(), ClusterConfig::default()).await;
    let key = b"pinned/1";
    c.store.put(key, &meta(64), &[8; 64], Retention::Normal).await.unwrap();
    c.store.pin(key).await.unwrap();
    c.store.pin(key).await.unwrap();
    c.store.set_lease(key, 3, None).await.unwrap();
    let order = c.placement(key);
    c.kill(order[0]).await;
    for round in 0.. {
        let r = c.store.repair().await.unwrap();
        if r.idle() && round > 0 {
            break;
        }
        assert!(round < 10, "repair does not converge: {r:?}");
    }
    // The stand-in (the next node of the placement) holds the copy, as pinned as the original.
    let stand_in = order[2];
    let node = c.nodes[stand_in].as_ref().unwrap();
    let info = node.store.list(b"", 100).into_iter().find(|i| i.key == key).expect("no copy");
    assert_eq!((info.pins, info.consumers), (2, 3), "the copy lost its pins or lease: {info:?}");
}

/// A registry a test changes by hand.
#[derive(Debug, Default)]
struct Registry(parking_lot::Mutex<Vec<SocketAddr>>);

#[async_trait]
impl Discovery for Registry {
    async fn register(&self, _: Entry) -> tensorwire_core::Result<Box<dyn Registration>> {
        unreachable!("the test registers by hand")
    }
    async fn list(&self, kind: &str) -> tensorwire_core::Result<Vec<Entry>> {
        assert_eq!(kind, "store");
        let entry = |a: &SocketAddr| Entry {
            kind: kind.into(),
            id: a.to_string(),
            addr: *a,
            meta: Vec::new(),
        };
        Ok(self.0.lock().iter().map(entry).collect())
    }
    async fn watch(
        &self,
        _: &str,
    ) -> tensorwire_core::Result<tokio::sync::mpsc::Receiver<tensorwire_proto::discovery::Change>>
    {
        unreachable!("the cluster store polls")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_follows_the_registry_and_a_joining_node_takes_its_share() {
    let c = Cluster::start(3, pool(), ClusterConfig::default()).await;
    let registry = Arc::new(Registry::default());
    *registry.0.lock() = c.addrs[..2].to_vec();
    let store = Arc::new(ClusterStore::remote(&c.client, &[], ClusterConfig::default()).unwrap());
    let _follow = store.follow(registry.clone(), Duration::from_millis(20)).await.unwrap();
    assert_eq!(store.nodes().len(), 2, "the registry is read before follow returns");
    for i in 0..30 {
        let key = format!("k{i}");
        store.put(key.as_bytes(), &meta(100), &[i as u8; 100], Retention::Normal).await.unwrap();
        assert!(!c.holders(key.as_bytes()).await.contains(&2), "placed on an unregistered node");
    }
    // The third node registers: the membership follows, and the repair moves its share there.
    registry.0.lock().push(c.addrs[2]);
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while store.nodes().len() < 3 {
        assert!(std::time::Instant::now() < until, "the new node never joined");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    while !store.repair().await.unwrap().idle() {
        assert!(std::time::Instant::now() < until, "the rebalance does not end");
    }
    for i in 0..30 {
        let key = format!("k{i}");
        c.assert_on_placement(key.as_bytes()).await;
        let (_, body) = store.get(key.as_bytes()).await.unwrap();
        assert!(body == vec![i as u8; 100]);
    }
}

/// Every node down when a put comes (a rolling restart, a chaos run): the put waits for one to be
/// back and succeeds, instead of failing at once; with no node back within `wait_for_node` it
/// fails, bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_waits_for_a_node_to_come_back_and_gives_up_in_time() {
    let cfg = ClusterConfig { wait_for_node: Duration::from_secs(20), ..ClusterConfig::default() };
    let mut c = Cluster::start(2, pool(), cfg).await;
    c.store.put(b"before", &meta(10), &[1; 10], Retention::Normal).await.unwrap();
    c.kill(0).await;
    c.kill(1).await;
    // The first put after the deaths marks both nodes down; node 1 comes back 1.5 s later.
    let store = c.store.clone();
    let put = tokio::spawn(async move {
        let t = std::time::Instant::now();
        store.put(b"during", &meta(10), &[2; 10], Retention::Normal).await.map(|()| t.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!put.is_finished(), "the put ended while no node was up");
    c.restart(1).await;
    let took = tokio::time::timeout(Duration::from_secs(30), put).await.unwrap().unwrap().unwrap();
    assert!(took >= Duration::from_millis(1500), "the put returned before any node was back");
    assert_eq!(c.holders(b"during").await, vec![1]);

    // No node back at all: the put fails once its wait is over.
    let cfg =
        ClusterConfig { wait_for_node: Duration::from_millis(600), ..ClusterConfig::default() };
    let mut d = Cluster::start(1, pool(), cfg).await;
    d.kill(0).await;
    let t = std::time::Instant::now();
    let r = d.store.put(b"never", &meta(10), &[3; 10], Retention::Normal).await;
    assert!(r.is_err(), "a put with every node dead succeeded: {r:?}");
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "the put waited past its bound: {:?}",
        t.elapsed()
    );
}
