//! The store side of a process cluster: one store node in the parent (the default), or
//! `--store-nodes N` store node processes (`tensorwire serve` without an orchestrator, each on
//! a fixed port so that a restarted one comes back at its address) behind a cluster store with
//! `--replicas` copies, repaired in the background by the parent. With `--chaos-store SECS` a
//! supervisor kills a random store node (SIGKILL) about every SECS seconds and starts it again,
//! empty; a kill waits until every node is up and the last repair round found nothing to do.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tensorwire_store::cluster::{ClusterConfig, ClusterStore, RepairConfig, spawn_repair};
use tensorwire_store::{Store, StoreNode};

use crate::demo::pipeline::{store_node, tcp_engine};
use crate::supervise::{Chaos, Slot, Supervisor, SupervisorReport};

/// How the cluster's store is laid out.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoreLayout {
    /// Store node processes (0: one node in the parent process).
    pub(crate) nodes: usize,
    /// Copies of each object (with nodes).
    pub(crate) replicas: usize,
    /// Mean seconds between store node kills.
    pub(crate) chaos: Option<f64>,
    /// Seed of those kills.
    pub(crate) seed: u64,
    /// Each node's pool.
    pub(crate) bytes: u64,
}

/// What the repair did over a run.
#[derive(Debug, Default)]
pub(super) struct Repaired {
    copies: AtomicU64,
    bytes: AtomicU64,
    deleted: AtomicU64,
}

/// The running store side.
pub(super) enum Stores {
    /// One node in this process.
    One {
        engine: tensorwire_core::Engine,
        store: Arc<tensorwire_store::EmbeddedStore>,
        node: StoreNode,
    },
    /// Store node processes behind a cluster store.
    Nodes {
        _engine: tensorwire_core::Engine,
        store: Arc<ClusterStore>,
        addrs: Vec<SocketAddr>,
        replicas: usize,
        sup: Supervisor,
        repair: tokio::task::JoinHandle<()>,
        repaired: Arc<Repaired>,
    },
}

/// A port free now on the loopback (the node binds it a moment later).
fn free_port() -> anyhow::Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

impl Stores {
    /// Starts the layout; with nodes, returns once every node answers.
    pub(crate) async fn start(l: StoreLayout) -> anyhow::Result<Stores> {
        if l.nodes == 0 {
            let (engine, store, node) = store_node(l.bytes).await?;
            return Ok(Stores::One { engine, store, node });
        }
        if l.replicas == 0 || l.replicas > l.nodes {
            anyhow::bail!("--replicas {}: needs 1..={} (the store nodes)", l.replicas, l.nodes);
        }
        let exe = std::env::current_exe()?;
        let addrs: Vec<SocketAddr> = (0..l.nodes).map(|_| free_port()).collect::<Result<_, _>>()?;
        let mib = (l.bytes >> 20).max(1).to_string();
        let slots = addrs
            .iter()
            .map(|a| {
                let (exe, at, mib) = (exe.clone(), a.to_string(), mib.clone());
                Slot::new("store", move || {
                    let mut cmd = Command::new(&exe);
                    cmd.args(["serve", "--listen", "127.0.0.1:0", "--store-listen", &at]);
                    cmd.args(["--store-mib", &mib]).stderr(Stdio::inherit());
                    cmd
                })
            })
            .collect();
        let (tx, _lines) = tokio::sync::mpsc::channel::<String>(64);
        // A node is killed only while every node is up and the last repair round found nothing
        // to do (each object has its copies on live nodes): one loss at a time, as replicas
        // can take; a kill before the copies of the last one are back could take both.
        let healthy = Arc::new(AtomicBool::new(false));
        let gate = Some(healthy.clone());
        let chaos =
            l.chaos.map(|s| Chaos { every: Duration::from_secs_f64(s), seed: l.seed, gate });
        let sup = Supervisor::start(slots, tx, chaos);
        let engine = tcp_engine(None).await?;
        let cfg = ClusterConfig { replicas: l.replicas, ..ClusterConfig::default() };
        let store = Arc::new(ClusterStore::remote(&engine, &addrs, cfg)?);
        let until = Instant::now() + Duration::from_secs(30);
        while store.node_stats().await.len() < l.nodes {
            if Instant::now() > until {
                anyhow::bail!(
                    "only {} of {} store nodes answered",
                    store.node_stats().await.len(),
                    l.nodes
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let repaired = Arc::new(Repaired::default());
        let seen = repaired.clone();
        let every = RepairConfig { every: Duration::from_millis(200) };
        let repair = spawn_repair(&store, every, move |r| {
            healthy.store(r.idle(), Ordering::Release);
            seen.copies.fetch_add(r.copied as u64, Ordering::Relaxed);
            seen.bytes.fetch_add(r.bytes, Ordering::Relaxed);
            seen.deleted.fetch_add(r.deleted as u64, Ordering::Relaxed);
        });
        Ok(Stores::Nodes {
            _engine: engine,
            store,
            addrs,
            replicas: l.replicas,
            sup,
            repair,
            repaired,
        })
    }

    /// The arguments that point a worker process at this store.
    pub(crate) fn worker_args(&self) -> Vec<String> {
        match self {
            Stores::One { engine, node, .. } => vec![
                "--store-engine".into(),
                engine.local_addr().to_string(),
                "--store".into(),
                node.addr().to_string(),
            ],
            Stores::Nodes { addrs, replicas, .. } => vec![
                "--store-nodes".into(),
                addrs.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                "--replicas".into(),
                replicas.to_string(),
            ],
        }
    }

    /// The store, as the parent sees it.
    pub(crate) fn store(&self) -> Arc<dyn Store> {
        match self {
            Stores::One { store, .. } => store.clone(),
            Stores::Nodes { store, .. } => store.clone(),
        }
    }

    /// Starts the store chaos, if any.
    pub(crate) fn unleash(&self) {
        if let Stores::Nodes { sup, .. } = self {
            sup.unleash();
        }
    }

    /// Stops the nodes; one line on what the store side went through (None for one node).
    pub(crate) fn stop(self) -> Option<String> {
        let Stores::Nodes { addrs, replicas, sup, repair, repaired, .. } = self else {
            return None;
        };
        repair.abort();
        let SupervisorReport { killed, restarts, .. } = sup.stop();
        let killed: u32 = killed.iter().map(|(_, n)| n).sum();
        Some(format!(
            "store: {} nodes, {replicas} replicas each; {killed} nodes killed, {restarts} \
             restarted empty; repair copied {} objects ({:.1} MiB) and removed {} stand-in copies",
            addrs.len(),
            repaired.copies.load(Ordering::Relaxed),
            repaired.bytes.load(Ordering::Relaxed) as f64 / f64::from(1 << 20),
            repaired.deleted.load(Ordering::Relaxed),
        ))
    }
}

/// The store options of `demo --processes` and `soak`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct StoreArgs {
    /// Run N store node processes behind a cluster store (objects placed by rendezvous hashing,
    /// repaired by this process) instead of one store node in this process.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub(crate) store_nodes: usize,
    /// With --store-nodes: copies of each object.
    #[arg(long, default_value_t = 2)]
    pub(crate) replicas: usize,
    /// With --store-nodes: kill a random store node (SIGKILL) about every SECS seconds once
    /// every worker has joined; it is started again, empty, at its address.
    #[arg(long, value_name = "SECS")]
    pub(crate) chaos_store: Option<f64>,
}

impl StoreArgs {
    /// The layout these options ask for (pools of `bytes`), checked.
    pub(crate) fn layout(&self, seed: u64, bytes: u64) -> anyhow::Result<StoreLayout> {
        if let Some(s) = self.chaos_store {
            if self.store_nodes < 2 || !(0.05..=3600.0).contains(&s) {
                anyhow::bail!("--chaos-store {s}: needs --store-nodes 2 or more and 0.05..=3600 s");
            }
        }
        if self.store_nodes > 64 {
            anyhow::bail!("--store-nodes {}: at most 64", self.store_nodes);
        }
        Ok(StoreLayout {
            nodes: self.store_nodes,
            replicas: self.replicas,
            chaos: self.chaos_store,
            seed: seed ^ 0x5707e,
            bytes,
        })
    }
}
