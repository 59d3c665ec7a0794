//! The CLI's use of etcd (`serve --etcd`, `worker --etcd`): registering the engine and the store
//! node, running the orchestrator as one of a standby group, and finding its leader. With the
//! cargo feature `etcd` off (the default: the etcd client needs protoc to build), every `--etcd`
//! option fails with one line saying how to get it.

use std::net::SocketAddr;
use std::time::Duration;

use std::sync::Arc;
use tensorwire_core::Engine;

use tensorwire_orchestrator::service::{OrchestratorService, ServiceConfig, Target};

/// The orchestrator service a `serve` process runs, if any (yet).
pub(crate) type Serving = Arc<tokio::sync::Mutex<Option<OrchestratorService>>>;

/// A connection to the cluster's etcd.
#[derive(Clone)]
pub(crate) struct Etcd {
    #[cfg(feature = "etcd")]
    client: tensorwire_etcd::EtcdClient,
    #[cfg(feature = "etcd")]
    cluster: String,
    #[cfg(feature = "etcd")]
    ttl: Duration,
    /// Without the feature no value exists.
    #[cfg(not(feature = "etcd"))]
    never: std::convert::Infallible,
}

/// Entries this process keeps registered (dropping them takes them out).
pub(crate) struct Registered {
    #[cfg(feature = "etcd")]
    _regs: Vec<Box<dyn tensorwire_proto::discovery::Registration>>,
}

#[cfg(feature = "etcd")]
impl Etcd {
    /// Connects (within 10 s) for `cluster`, with leases of `ttl`.
    pub(crate) async fn connect(url: &str, cluster: &str, ttl: Duration) -> anyhow::Result<Etcd> {
        let client = tensorwire_etcd::connect(&[url.to_string()], Duration::from_secs(10))
            .await
            .map_err(|e| anyhow::anyhow!("--etcd {url}: {e}"))?;
        Ok(Etcd { client, cluster: cluster.into(), ttl })
    }

    /// Registers the engine and the store node (entries that vanish when this process dies).
    pub(crate) async fn register(
        &self,
        engine: &Engine,
        store: SocketAddr,
    ) -> anyhow::Result<Registered> {
        use tensorwire_proto::discovery::{Discovery, Entry};
        let d = tensorwire_etcd::EtcdDiscovery::new(self.client.clone(), &self.cluster, self.ttl);
        let id = engine.id().to_string();
        let control = engine.local_addr();
        let entries = [
            Entry { kind: "engine".into(), id: id.clone(), addr: control, meta: Vec::new() },
            Entry { kind: "store".into(), id, addr: store, meta: control.to_string().into_bytes() },
        ];
        let mut regs = Vec::new();
        for e in entries {
            regs.push(d.register(e).await.map_err(|e| anyhow::anyhow!("etcd: registering: {e}"))?);
        }
        println!(
            "registered in etcd (cluster {}): engine {control}, store node {store}",
            self.cluster
        );
        Ok(Registered { _regs: regs })
    }

    /// The standby orchestrator: waits to be elected, then serves from the journal in etcd
    /// until leadership is lost; returns why (the process then exits).
    pub(crate) async fn lead(
        self,
        at: SocketAddr,
        mut cfg: ServiceConfig,
        serving: Serving,
    ) -> String {
        use tensorwire_etcd::{EtcdJournal, Leadership};
        let (c, cluster) = (&self.client, &self.cluster);
        let r = async {
            let l = Leadership::campaign(c, cluster, at, self.ttl).await?;
            let j = EtcdJournal::open(c, cluster, l.guard(), 1000).await?;
            cfg.journal_store = Some(Box::new(j));
            let o = OrchestratorService::serve(at, cfg).await?;
            println!("orchestrator {} (leader of cluster {cluster})", o.addr());
            *serving.lock().await = Some(o);
            l.lost().await;
            serving.lock().await.take();
            Ok::<String, anyhow::Error>(format!(
                "orchestrator {at}: lost the leadership of cluster {cluster}"
            ))
        };
        r.await.unwrap_or_else(|e| format!("{e:#}"))
    }

    /// Where the orchestrator clients connect: the leader at each (re)connection.
    pub(crate) fn leader_target(&self) -> Target {
        Target::Resolve(tensorwire_etcd::leader_resolver(self.client.clone(), &self.cluster))
    }

    /// The cluster's registry (the store nodes a cluster store follows).
    pub(crate) fn discovery(&self) -> Arc<dyn tensorwire_proto::discovery::Discovery> {
        Arc::new(tensorwire_etcd::EtcdDiscovery::new(self.client.clone(), &self.cluster, self.ttl))
    }
}

#[cfg(not(feature = "etcd"))]
impl Etcd {
    /// Fails: this build has no etcd support.
    pub(crate) async fn connect(url: &str, _: &str, _: Duration) -> anyhow::Result<Etcd> {
        Err(anyhow::anyhow!("--etcd {url}: {}", tensorwire_etcd::DISABLED))
    }

    pub(crate) async fn register(&self, _: &Engine, _: SocketAddr) -> anyhow::Result<Registered> {
        match self.never {}
    }

    pub(crate) async fn lead(self, _: SocketAddr, _: ServiceConfig, _: Serving) -> String {
        match self.never {}
    }

    pub(crate) fn leader_target(&self) -> Target {
        match self.never {}
    }

    pub(crate) fn discovery(&self) -> Arc<dyn tensorwire_proto::discovery::Discovery> {
        match self.never {}
    }
}
