//! The process-wide Prometheus recorder.

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::families::{FAMILIES, Kind};

/// Bucket bounds of every `_seconds` histogram: 100 us to 5 min, about three per decade (op
/// latencies of microseconds and video requests of minutes in one set).
const SECONDS_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 25.0, 60.0, 120.0, 300.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder as this process's `metrics` recorder (the first call; later
/// calls do nothing) and sets `tensorwire_build_info{process}` to 1. Metrics recorded before
/// it are not kept. Fails when another recorder was installed first.
pub fn install(process: &str) -> Result<(), String> {
    let mut first = false;
    let mut failed = None;
    HANDLE.get_or_init(|| {
        first = true;
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .expect("the bucket list is not empty")
            .build_recorder();
        let handle = recorder.handle();
        if let Err(e) = metrics::set_global_recorder(recorder) {
            failed = Some(format!("metrics: another recorder is installed: {e}"));
        }
        // Histograms keep their samples until an upkeep folds them in: once every 5 s, as the
        // crate's own HTTP listener does.
        let h = handle.clone();
        let upkeep =
            std::thread::Builder::new().name("tw-metrics-upkeep".into()).spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_secs(5));
                    h.run_upkeep();
                }
            });
        if let Err(e) = upkeep {
            tracing::warn!(error = %e, "metrics: no upkeep thread; histograms fold in at scrapes");
        }
        handle
    });
    if let Some(e) = failed {
        return Err(e);
    }
    if first {
        describe();
    }
    metrics::gauge!(
        "tensorwire_build_info",
        "version" => env!("CARGO_PKG_VERSION"),
        "process" => process.to_string()
    )
    .set(1.0);
    Ok(())
}

/// The families' help texts, shown as `# HELP` lines.
fn describe() {
    for fam in FAMILIES {
        match fam.kind {
            Kind::Counter => metrics::describe_counter!(fam.name, fam.help),
            Kind::Gauge => metrics::describe_gauge!(fam.name, fam.help),
            Kind::Histogram => {
                metrics::describe_histogram!(fam.name, metrics::Unit::Seconds, fam.help)
            }
        }
    }
}

/// The current exposition (Prometheus text format), or `None` before [`install`].
pub fn render() -> Option<String> {
    HANDLE.get().map(|h| {
        h.run_upkeep();
        h.render()
    })
}
