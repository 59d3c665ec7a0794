//! `tensorwire serve`: an engine (tcp) with a store node and, optionally, the orchestrator
//! service, for multi-process and multi-host runs; `tensorwire worker`: a stage worker process
//! that joins the orchestrator service and runs the stage time of a profiled model for each
//! assignment (compute is simulated; payload bytes between processes are exercised by the
//! diffusion crate's multi-process tests). Both read flags or a TOML file (flags win).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use tensorwire_core::{Engine, EngineConfig};
use tensorwire_orchestrator::Stage;
use tensorwire_orchestrator::service::{OrchestratorService, ServiceConfig, Target, WorkerClient};
use tensorwire_proto::auth::is_exposed;
use tensorwire_store::{EmbeddedStore, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

use crate::observe::{Flag, Joining, MetricsArgs};
use crate::secret;
use tensorwire_observe::Health;
use tensorwire_sim::profiles;

/// `serve` options.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ServeArgs {
    /// TOML file with any of: listen, data_listen, store_listen, store_mib, spill_dir,
    /// orchestrator_listen, journal, etcd, cluster, lease_secs, secret_file, insecure,
    /// metrics_listen, metrics_expose.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Engine control endpoint.
    #[arg(long)]
    pub(crate) listen: Option<SocketAddr>,
    /// TCP data listener (peers dial this for transfers).
    #[arg(long)]
    pub(crate) data_listen: Option<SocketAddr>,
    /// Store node RPC listener.
    #[arg(long)]
    pub(crate) store_listen: Option<SocketAddr>,
    /// Store pool size, MiB.
    #[arg(long)]
    pub(crate) store_mib: Option<u64>,
    /// Spill directory for the store. Objects there survive a restart: a node started on it
    /// finds them again, and a clean stop (Ctrl-C, --for-secs) writes the pool there first.
    #[arg(long)]
    pub(crate) spill_dir: Option<PathBuf>,
    /// Also serve the orchestrator here.
    #[arg(long)]
    pub(crate) orchestrator_listen: Option<SocketAddr>,
    /// The orchestrator's journal file: with one, a restarted orchestrator resumes every
    /// request it had (workers and submitters reconnect on their own).
    #[arg(long)]
    pub(crate) journal: Option<PathBuf>,
    /// etcd endpoint (e.g. http://10.0.0.9:2379): register the engine and the store node there,
    /// and run the orchestrator as one of a standby group (elected through etcd, its journal kept
    /// there; `--orchestrator-listen` then needs a fixed port).
    #[arg(long)]
    pub(crate) etcd: Option<String>,
    /// Cluster name (the key prefix in etcd).
    #[arg(long)]
    pub(crate) cluster: Option<String>,
    /// Lease of the etcd registrations and candidacy, seconds: how long a dead process's entry
    /// (or a dead leader) lasts.
    #[arg(long)]
    pub(crate) lease_secs: Option<u64>,
    /// File holding the cluster secret (every process of the cluster uses the same; make one
    /// with `tensorwire secret new FILE`). Needed to listen on an address other hosts can reach.
    #[arg(long)]
    pub(crate) secret_file: Option<PathBuf>,
    /// Listen on reachable addresses without a cluster secret: anyone who reaches them can read
    /// and overwrite every payload. Warned at start and for every peer from another host.
    #[arg(long)]
    pub(crate) insecure: bool,
    /// Stop after this many seconds (default: run until interrupted).
    #[arg(long)]
    pub(crate) for_secs: Option<u64>,
    #[command(flatten)]
    pub(crate) metrics: MetricsArgs,
    /// Elastic pools: the orchestrator moves workers that can serve other stages (`worker
    /// --can`) between pools as the load shifts.
    #[arg(long)]
    pub(crate) rebalance: bool,
    /// With --rebalance: the rebalancer's settings.
    #[command(flatten)]
    pub(crate) rebalance_args: crate::switching::RebalanceArgs,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServeFile {
    listen: Option<SocketAddr>,
    data_listen: Option<SocketAddr>,
    store_listen: Option<SocketAddr>,
    store_mib: Option<u64>,
    spill_dir: Option<PathBuf>,
    orchestrator_listen: Option<SocketAddr>,
    journal: Option<PathBuf>,
    etcd: Option<String>,
    cluster: Option<String>,
    lease_secs: Option<u64>,
    secret_file: Option<PathBuf>,
    insecure: Option<bool>,
    metrics_listen: Option<SocketAddr>,
    metrics_expose: Option<bool>,
}

fn load<T: for<'de> Deserialize<'de> + Default>(p: &Option<PathBuf>) -> anyhow::Result<T> {
    match p {
        None => Ok(T::default()),
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| anyhow::anyhow!("{}: cannot read: {e}", p.display()))?;
            toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {}", p.display(), e.message()))
        }
    }
}

/// Runs `serve`.
pub(crate) async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let f: ServeFile = load(&a.config)?;
    // The endpoint first: /healthz answers while the rest starts, /readyz once it is up.
    let health = Health::new();
    let (engine_up, node_up) = (Flag::default(), Flag::default());
    engine_up.check(&health, "engine");
    node_up.check(&health, "store_node");
    let metrics = MetricsArgs {
        metrics_listen: a.metrics.metrics_listen.or(f.metrics_listen),
        metrics_expose: a.metrics.metrics_expose || f.metrics_expose.unwrap_or(false),
    };
    let _endpoint = metrics.start("serve", health.clone()).await?;
    // Every family this process records, from its start (at zero): its engine moves bytes over
    // tcp, it serves a store and an orchestrator.
    use tensorwire_observe::Layer;
    tensorwire_observe::export_at_zero(&[
        Layer::Engine(&["tcp"]),
        Layer::Store,
        Layer::Orchestrator,
    ]);
    let listen = a.listen.or(f.listen).unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 7000)));
    let data = a.data_listen.or(f.data_listen).unwrap_or_else(|| SocketAddr::new(listen.ip(), 0));
    let store_listen =
        a.store_listen.or(f.store_listen).unwrap_or_else(|| SocketAddr::new(listen.ip(), 7100));
    let secret = secret::read(a.secret_file.or(f.secret_file).as_deref())?;
    let insecure = a.insecure || f.insecure.unwrap_or(false);
    let tcp = TcpBackend::new(TcpConfig { listen: data, ..TcpConfig::default() })?;
    let cluster_secret = secret.clone();
    let cfg = EngineConfig { listen, cluster_secret, insecure, ..EngineConfig::default() };
    let engine = Engine::builder()
        .backend(tcp)
        .config(cfg)
        .start()
        .await
        .map_err(|e| anyhow::anyhow!("engine on {listen}: {e}"))?;
    engine_up.set(true);
    let store_cfg = StoreConfig {
        capacity: a.store_mib.or(f.store_mib).unwrap_or(1024) << 20,
        spill_dir: a.spill_dir.or(f.spill_dir),
        persist: true, // with a spill directory, objects there survive a restart of the node
        shared: true,
        ..StoreConfig::default()
    };
    let store = EmbeddedStore::new(&engine, store_cfg).await?;
    let node = StoreNode::serve(store.clone(), store_listen).await?;
    node_up.set(true);
    println!("engine {} control {}", engine.id(), engine.local_addr());
    println!(
        "store node {} (pool {} MiB{})",
        node.addr(),
        store.pool().len >> 20,
        store.spill_io().map_or(String::new(), |s| format!(", spill: {s}"))
    );
    let cluster = a.cluster.or(f.cluster).unwrap_or_else(|| "default".into());
    let ttl = Duration::from_secs(a.lease_secs.or(f.lease_secs).unwrap_or(5).max(1));
    let etcd = match a.etcd.or(f.etcd) {
        Some(url) => Some(crate::cluster::Etcd::connect(&url, &cluster, ttl).await?),
        None => None,
    };
    let _registered = match &etcd {
        Some(c) => Some(c.register(&engine, node.addr()).await?),
        None => None,
    };
    // The orchestrator this process serves (once elected, with --etcd), for its closing line.
    let serving: crate::cluster::Serving = Default::default();
    if a.orchestrator_listen.or(f.orchestrator_listen).is_some() {
        // Ready once this process serves the orchestrator (a standby is not, until elected).
        let s = serving.clone();
        health.check("orchestrator", move || s.try_lock().map_or(true, |o| o.is_some()));
        let s = serving.clone();
        health.targets(move || {
            let list = s.try_lock().ok().and_then(|o| o.as_ref().map(|o| o.metrics_targets()));
            crate::observe::targets(list.unwrap_or_default())
        });
    }
    let mut leading: Option<tokio::task::JoinHandle<String>> = None;
    let headroom = tensorwire_orchestrator::sched::SchedConfig::default().decode_headroom;
    let rebalance = match a.rebalance {
        true => Some(a.rebalance_args.config(1.0, headroom)?),
        false => None,
    };
    if rebalance.is_some() && a.orchestrator_listen.or(f.orchestrator_listen).is_none() {
        anyhow::bail!("--rebalance: this process serves no orchestrator (--orchestrator-listen)");
    }
    match (a.orchestrator_listen.or(f.orchestrator_listen), &etcd) {
        (Some(at), None) => {
            let journal = a.journal.or(f.journal);
            let cfg =
                ServiceConfig { secret, insecure, journal, rebalance, ..ServiceConfig::default() };
            let o = OrchestratorService::serve(at, cfg).await?;
            println!("orchestrator {}", o.addr());
            *serving.lock().await = Some(o);
        }
        (Some(at), Some(c)) => {
            if at.port() == 0 {
                return Err(anyhow::anyhow!(
                    "--orchestrator-listen {at}: with --etcd the orchestrator needs a fixed port \
                     (its address is what the leader publishes)"
                ));
            }
            if a.journal.is_some() || f.journal.is_some() {
                return Err(anyhow::Error::msg(
                    "--journal: with --etcd the orchestrator's journal is in etcd",
                ));
            }
            let cfg = ServiceConfig { secret, insecure, rebalance, ..ServiceConfig::default() };
            println!("standby orchestrator {at}: campaigning to lead cluster {cluster}");
            leading = Some(tokio::spawn(c.clone().lead(at, cfg, serving.clone())));
        }
        (None, _) => {}
    }
    // Stops cleanly at the end of --for-secs or on Ctrl-C (SIGINT), whichever comes first.
    let stop = async {
        let secs = async {
            match a.for_secs {
                Some(s) => tokio::time::sleep(Duration::from_secs(s)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = secs => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    let lost = async {
        match &mut leading {
            Some(t) => t.await.unwrap_or_else(|e| e.to_string()),
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = stop => {}
        why = lost => return Err(anyhow::Error::msg(why)),
    }
    if let Some(o) = serving.lock().await.as_ref() {
        if let Ok(st) = o.stats().await {
            println!(
                "orchestrator: completed {}, failed {}, duplicated {}, re-queued {}, unreleased {}",
                st.sched.completed,
                st.sched.failed,
                st.duplicated,
                st.sched.requeued,
                st.unreleased
            );
        }
    }
    engine_up.set(false);
    match store.shutdown() {
        Ok(n) if n > 0 => println!("store: {n} objects written to the spill tier"),
        Ok(_) => {}
        Err(e) => eprintln!("store: writing the pool to the spill tier failed: {e}"),
    }
    engine.shutdown().await;
    Ok(())
}

/// `worker` options.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct WorkerArgs {
    /// encode, denoise or decode.
    #[arg(long)]
    pub(crate) role: String,
    /// Orchestrator service address...
    #[arg(long, required_unless_present = "etcd")]
    pub(crate) connect: Option<SocketAddr>,
    /// ...or an etcd endpoint where the cluster's orchestrator leader is found (again at every
    /// reconnection, so the worker follows a new leader).
    #[arg(long, conflicts_with = "connect")]
    pub(crate) etcd: Option<String>,
    /// With --etcd: the cluster name.
    #[arg(long, default_value = "default")]
    pub(crate) cluster: String,
    /// Model whose stage time each item takes.
    #[arg(long, default_value = "wan2.1-t2v-1.3b-480p")]
    pub(crate) model: String,
    /// Profile file (default: built in).
    #[arg(long)]
    pub(crate) profiles: Option<PathBuf>,
    /// Multiplies the stage time.
    #[arg(long, default_value_t = 0.05)]
    pub(crate) time_scale: f64,
    /// Concurrent items.
    #[arg(long, default_value_t = 1)]
    pub(crate) slots: u32,
    /// File holding the cluster secret (the one the orchestrator uses).
    #[arg(long)]
    pub(crate) secret_file: Option<PathBuf>,
    /// Join an orchestrator on another host without a cluster secret.
    #[arg(long)]
    pub(crate) insecure: bool,
    /// Move real payloads: the store node's engine (control address)...
    #[arg(long, requires = "store")]
    pub(crate) store_engine: Option<SocketAddr>,
    /// ...and its RPC address.
    #[arg(long, requires = "store_engine")]
    pub(crate) store: Option<SocketAddr>,
    /// Or move real payloads through a cluster store over these store nodes (their RPC
    /// addresses, comma-separated: objects placed by rendezvous hashing, with --replicas copies).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["store", "store_engine"])]
    pub(crate) store_nodes: Vec<SocketAddr>,
    /// With --store-nodes (or store nodes found in etcd): copies of each object.
    #[arg(long, default_value_t = 2)]
    pub(crate) replicas: usize,
    /// With payloads: the request mix (request r uses model r mod len), as in `demo --models`.
    /// With `--etcd` and without the store options, `--models` alone moves payloads through a
    /// cluster store over the store nodes registered in etcd.
    #[arg(long, value_delimiter = ',')]
    pub(crate) models: Vec<String>,
    /// With payloads, for denoise: save a step checkpoint of a batch job to the store every N
    /// steps (0: never); a job whose worker dies resumes from its last one elsewhere.
    #[arg(long, default_value_t = 0)]
    pub(crate) checkpoint_every: u32,
    /// The same for interactive jobs (short ones, usually: 0, never, by default).
    #[arg(long, default_value_t = 0)]
    pub(crate) checkpoint_every_interactive: u32,
    #[command(flatten)]
    pub(crate) metrics: MetricsArgs,
    /// Other stages this worker can serve (elastic pools: an orchestrator run with
    /// --rebalance may move it there; it drains, loads the stage and joins that pool).
    #[arg(long, value_delimiter = ',')]
    pub(crate) can: Vec<String>,
    /// What a switch costs (times the --time-scale).
    #[command(flatten)]
    pub(crate) switch: crate::switching::SwitchCost,
}

/// Runs `worker`.
pub(crate) async fn worker(a: WorkerArgs) -> anyhow::Result<()> {
    let stage = Stage::ALL.into_iter().find(|s| s.name() == a.role).ok_or_else(|| {
        anyhow::anyhow!("--role {:?}: expected encode, denoise or decode", a.role)
    })?;
    let secret = secret::read(a.secret_file.as_deref())?;
    // Ready once joined (it rejoins on its own after a lost connection).
    let health = Health::new();
    let joined = Flag::default();
    joined.check(&health, "joined");
    let endpoint = a.metrics.start(&format!("worker-{}", a.role), health).await?;
    let join = Joining { labels: crate::observe::worker_labels(endpoint.as_ref()), joined };
    let mut etcd = None;
    let target: Target = match (a.connect, &a.etcd) {
        (Some(addr), _) => {
            if secret.is_none() && is_exposed(addr) && !a.insecure {
                return Err(anyhow::anyhow!(
                    "joining the orchestrator at {addr} without a cluster secret: pass \
                     --secret-file FILE (the orchestrator's; `tensorwire secret new FILE` makes \
                     one) or --insecure"
                ));
            }
            addr.into()
        }
        (None, Some(url)) => {
            let e = crate::cluster::Etcd::connect(url, &a.cluster, Duration::from_secs(5)).await?;
            let t = e.leader_target();
            etcd = Some(e);
            t
        }
        (None, None) => {
            return Err(anyhow::Error::msg("worker: pass --connect ADDR or --etcd URL"));
        }
    };
    let all = profiles::load(a.profiles.as_deref())?;
    let mut serves = vec![stage];
    serves.extend(crate::switching::stages(&a.can)?.into_iter().filter(|s| *s != stage));
    let mobility = |models: &[tensorwire_sim::profiles::Model]| -> anyhow::Result<_> {
        let cost = a.switch.times(models)?.map(|d| d.mul_f64(a.time_scale));
        Ok(crate::switching::Mobility { serves: serves.clone(), cost })
    };
    use crate::demo::procs::StoreAt;
    let store = match (a.store_engine.zip(a.store), &etcd) {
        (Some((e, rpc)), _) => Some(StoreAt::Node(e, rpc)),
        _ if !a.store_nodes.is_empty() => Some(StoreAt::Cluster(a.store_nodes.clone(), a.replicas)),
        (None, Some(e)) if !a.models.is_empty() => {
            Some(StoreAt::Registered(e.discovery(), a.replicas))
        }
        (None, _) => None,
    };
    if let Some(store) = store {
        // A payload worker: an engine over tcp and a connector, exported from the start.
        use tensorwire_observe::Layer;
        tensorwire_observe::export_at_zero(&[Layer::Engine(&["tcp"]), Layer::Connector]);
        let names = if a.models.is_empty() { vec![a.model.clone()] } else { a.models.clone() };
        let mix: Vec<tensorwire_sim::profiles::Model> =
            profiles::pick(&all, &names)?.into_iter().cloned().collect();
        let mobility = mobility(&mix)?;
        return crate::demo::procs::payload_worker(
            (stage, a.slots),
            target,
            store,
            secret,
            (mix, mobility),
            (a.time_scale, [a.checkpoint_every_interactive, a.checkpoint_every]),
            &join,
        )
        .await;
    }
    let m = profiles::pick(&all, std::slice::from_ref(&a.model))?[0].clone();
    let mobility = mobility(std::slice::from_ref(&m))?;
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| anyhow::anyhow!("SIGTERM handler: {e}"))?;
    let (mut stage, mut switched) = (stage, None);
    loop {
        let spec = mobility.spec((stage, a.slots.max(1)), (&host, &join.labels), switched);
        let (w, mut rx) =
            WorkerClient::join(target.clone(), secret.as_ref(), spec, Duration::from_secs(1))
                .await?;
        join.joined.set(true);
        println!("worker {} ({stage}) joined {target:?}", w.id());
        let ms = match stage {
            Stage::Encode => m.encode_ms,
            Stage::Denoise => m.denoise_ms(),
            Stage::Decode => m.decode_ms,
        };
        let t = Duration::from_secs_f64((ms * a.time_scale / 1e3).max(0.0));
        let w = std::sync::Arc::new(w);
        let run = |job: tensorwire_orchestrator::service::Assignment| {
            let w = w.clone();
            let span = job.span();
            let item = async move {
                tokio::time::sleep(t).await;
                let _ = w.report(&job, Ok::<(), String>(())).await;
            };
            tokio::spawn(tracing::Instrument::instrument(item, span));
        };
        let drain = Duration::from_secs(120);
        match crate::switching::serve_pool(&w, &mut rx, &mut term, drain, run).await? {
            crate::switching::Left::Terminated => return Ok(()),
            crate::switching::Left::Switch(to) => {
                join.joined.set(false);
                drop(w);
                switched =
                    Some(crate::switching::switch(stage, to, mobility.cost[to.index()]).await);
                stage = to;
            }
        }
    }
}
