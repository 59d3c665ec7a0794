//! `xfer --cluster-store`: the cluster store's aggregate put and get throughput with several
//! clients, on 1 node with 1 replica (the reference), 3 nodes with 1 replica and 3 nodes with
//! 2 replicas, all in this process over tcp on loopback (each node and client with its own
//! engine); then the time the repair takes to restore 2 replicas after a node of 3 dies.
//! Every figure comes from this run; ratios are against the 1-node row of the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tensorwire_core::{DType, Engine, Permissions, Region, TensorMeta};
use tensorwire_store::cluster::{ClusterConfig, ClusterStore};
use tensorwire_store::{EmbeddedStore, Retention, Store, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

use crate::Result;

/// One row of the cluster figures.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterLine {
    /// "put" or "get".
    pub op: &'static str,
    /// Store nodes.
    pub nodes: usize,
    /// Copies per object.
    pub replicas: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// Object size in bytes.
    pub size: u64,
    /// Objects moved per second, all clients together.
    pub ops_per_s: f64,
    /// Object bytes per second (one copy counted once), all clients together, GB/s.
    pub gbps: f64,
    /// Against the 1-node, 1-replica row of the same op and size.
    pub vs_one_node: f64,
}

async fn engine() -> Result<Engine> {
    let tcp = TcpBackend::new(TcpConfig::default())?;
    Ok(Engine::builder().backend(tcp).start().await?)
}

fn meta(len: u64) -> TensorMeta {
    TensorMeta::contiguous(DType::U8, &[len])
}

struct Node {
    _server: StoreNode,
    engine: Engine,
}

/// `n` store nodes of `capacity` bytes each.
async fn nodes(n: usize, capacity: u64) -> Result<Vec<Node>> {
    let mut v = Vec::new();
    for _ in 0..n {
        let engine = engine().await?;
        let cfg = StoreConfig { capacity, shared: true, ..StoreConfig::default() };
        let store = EmbeddedStore::new(&engine, cfg).await?;
        let server = StoreNode::serve(store, "127.0.0.1:0".parse()?).await?;
        v.push(Node { _server: server, engine });
    }
    Ok(v)
}

struct Client {
    store: Arc<ClusterStore>,
    src: Region,
    dst: Region,
    _engine: Engine,
}

/// Puts `objects` objects of `size` per client at once (all clients together), then gets each
/// back; returns (put, get) objects per second.
async fn round(clients: &[Client], objects: usize, size: u64, tag: &str) -> Result<(f64, f64)> {
    let t = Instant::now();
    let puts = clients.iter().enumerate().map(|(c, cl)| async move {
        for i in 0..objects {
            let key = format!("{tag}-{c}-{i}");
            let src = cl.src.slice(0, size)?;
            cl.store.put_from(key.as_bytes(), &meta(size), &src, Retention::Normal).await?;
        }
        Ok::<_, crate::BenchError>(())
    });
    for r in futures::future::join_all(puts).await {
        r?;
    }
    let put = (clients.len() * objects) as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    let gets = clients.iter().enumerate().map(|(c, cl)| async move {
        for i in 0..objects {
            let key = format!("{tag}-{c}-{i}");
            cl.store.get_into(key.as_bytes(), &cl.dst, 0).await?;
        }
        Ok::<_, crate::BenchError>(())
    });
    for r in futures::future::join_all(gets).await {
        r?;
    }
    let get = (clients.len() * objects) as f64 / t.elapsed().as_secs_f64();
    for (c, cl) in clients.iter().enumerate() {
        for i in 0..objects {
            cl.store.remove(format!("{tag}-{c}-{i}").as_bytes()).await?;
        }
    }
    Ok((put, get))
}

/// The throughput rows for each size: best of `runs` rounds per layout.
pub async fn throughput(
    sizes: &[u64],
    clients: usize,
    objects: usize,
    runs: usize,
) -> Result<Vec<ClusterLine>> {
    let mut out = Vec::new();
    for &size in sizes {
        let mut reference = (0.0, 0.0);
        for (n, replicas) in [(1usize, 1usize), (3, 1), (3, 2)] {
            let room = (clients * objects) as u64 * size * replicas as u64;
            let cap = room.div_ceil(n as u64) * 2 + (64 << 20);
            let ns = nodes(n, cap).await?;
            let addrs: Vec<_> = ns.iter().map(|x| x._server.addr()).collect();
            let mut cls = Vec::new();
            for _ in 0..clients {
                let e = engine().await?;
                let cfg = ClusterConfig { replicas, ..ClusterConfig::default() };
                let store = Arc::new(ClusterStore::remote(&e, &addrs, cfg)?);
                let src = e.alloc(size, Permissions::NONE).await?;
                src.write_bytes(0, &vec![7u8; size as usize])?;
                let dst = e.alloc(size, Permissions::NONE).await?;
                cls.push(Client { store, src, dst, _engine: e });
            }
            let (mut put, mut get) = (0f64, 0f64);
            for r in 0..runs.max(1) {
                let (p, g) = round(&cls, objects, size, &format!("r{r}")).await?;
                (put, get) = (put.max(p), get.max(g));
            }
            if n == 1 {
                reference = (put, get);
            }
            for (op, rate, base) in [("put", put, reference.0), ("get", get, reference.1)] {
                let l = ClusterLine {
                    op,
                    nodes: n,
                    replicas,
                    clients,
                    size,
                    ops_per_s: rate,
                    gbps: rate * size as f64 / 1e9,
                    vs_one_node: rate / base,
                };
                eprintln!(
                    "cluster {op} {} x{clients} clients: {n} nodes, {replicas} replicas: {:.0} objects/s, {:.2} GB/s ({:.2}x one node)",
                    crate::measure::fmt_size(size),
                    l.ops_per_s,
                    l.gbps,
                    l.vs_one_node
                );
                out.push(l);
            }
            for n in ns {
                n.engine.shutdown().await;
            }
        }
    }
    Ok(out)
}

/// The repair after a node loss.
#[derive(Debug, Clone, Serialize)]
pub struct RepairLine {
    /// Objects stored (2 replicas over 3 nodes).
    pub objects: usize,
    /// Their size.
    pub size: u64,
    /// Copies the repair made.
    pub copied: usize,
    /// Rounds until nothing was left to do.
    pub rounds: usize,
    /// Seconds from the first round to the last.
    pub seconds: f64,
    /// Copied bytes per second, GB/s.
    pub gbps: f64,
}

/// Stores `objects` objects of `size` with 2 replicas on 3 nodes, kills one node and times the
/// repair rounds until every object has 2 replicas again.
pub async fn repair(objects: usize, size: u64) -> Result<RepairLine> {
    let cap = (objects as u64 * size * 2).div_ceil(2) + (64 << 20);
    let mut ns = nodes(3, cap).await?;
    let addrs: Vec<_> = ns.iter().map(|x| x._server.addr()).collect();
    let e = engine().await?;
    let store = ClusterStore::remote(&e, &addrs, ClusterConfig::default())?;
    let src = e.alloc(size, Permissions::NONE).await?;
    for i in 0..objects {
        let s = src.slice(0, size)?;
        store.put_from(format!("o{i}").as_bytes(), &meta(size), &s, Retention::Normal).await?;
    }
    let dead = ns.remove(1);
    drop(dead._server);
    dead.engine.shutdown().await;
    let t = Instant::now();
    let (mut copied, mut rounds) = (0, 0);
    loop {
        let r = store.repair().await?;
        rounds += 1;
        copied += r.copied;
        if r.idle() && rounds > 1 {
            break;
        }
        if t.elapsed() > Duration::from_secs(600) {
            return Err("repair did not finish in 10 minutes".into());
        }
    }
    let seconds = t.elapsed().as_secs_f64();
    let gbps = copied as f64 * size as f64 / seconds / 1e9;
    for n in ns {
        n.engine.shutdown().await;
    }
    Ok(RepairLine { objects, size, copied, rounds, seconds, gbps })
}
