//! The metrics options every long-running command shares (`--metrics-listen`,
//! `--metrics-expose`), and starting the endpoint they ask for.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tensorwire_observe::{Endpoint, Health, Target};
use tensorwire_orchestrator::service::{MetricsTarget, metrics_label};

/// `--metrics-listen` and `--metrics-expose`.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct MetricsArgs {
    /// Serve Prometheus metrics (/metrics), liveness (/healthz), readiness (/readyz) and the
    /// metrics endpoints of the workers this process's orchestrator knows (/sd, for
    /// Prometheus' http_sd_configs) on this address, e.g. 127.0.0.1:9464 (port 0: any free
    /// port; the address is printed).
    #[arg(long)]
    pub(crate) metrics_listen: Option<SocketAddr>,
    /// Allow --metrics-listen on an address other hosts can reach: it reveals the cluster's
    /// load (counts, rates, queue depths, store occupancy), never keys or payloads.
    #[arg(long)]
    pub(crate) metrics_expose: bool,
}

impl MetricsArgs {
    /// Installs the recorder and serves the endpoint, when asked for; prints its address.
    pub(crate) async fn start(
        &self,
        process: &str,
        health: Health,
    ) -> anyhow::Result<Option<Endpoint>> {
        let Some(listen) = self.metrics_listen else { return Ok(None) };
        let ep = Endpoint::start(process, listen, health, self.metrics_expose)
            .await
            .map_err(anyhow::Error::msg)?;
        println!("metrics http://{}/metrics", ep.addr());
        Ok(Some(ep))
    }
}

/// A readiness flag that a check reads: set once the part it names is up.
#[derive(Debug, Clone, Default)]
pub(crate) struct Flag(Arc<AtomicBool>);

impl Flag {
    pub(crate) fn set(&self, up: bool) {
        self.0.store(up, Ordering::Release);
    }

    /// Adds the check `name` to `health`, ready while this flag is set.
    pub(crate) fn check(&self, health: &Health, name: &str) {
        let f = self.0.clone();
        health.check(name, move || f.load(Ordering::Acquire));
    }
}

/// What a worker joins with (its labels) and the flag it sets once it joined (readiness).
#[derive(Debug, Clone, Default)]
pub(crate) struct Joining {
    pub(crate) labels: Vec<String>,
    pub(crate) joined: Flag,
}

/// The label a worker joins with to say where its endpoint is (none without one). An endpoint
/// on every interface is advertised under this host's name.
pub(crate) fn worker_labels(ep: Option<&Endpoint>) -> Vec<String> {
    ep.map(|e| metrics_label(e.addr())).into_iter().collect()
}

/// The workers' endpoints an orchestrator knows, for `/sd`.
pub(crate) fn targets(list: Vec<MetricsTarget>) -> Vec<Target> {
    list.into_iter().map(|t| Target { labels: t.labels(), addr: t.addr }).collect()
}
