//! Observability for tensorwire processes.
//!
//! The libraries record what they do through the [`metrics`] facade (counters, gauges and
//! histograms named `tensorwire_*`, each listed in [`FAMILIES`]); nothing is recorded until a
//! process installs a recorder. This crate gives a long-running process (`tensorwire serve`,
//! `tensorwire worker`, the Python `Service` and `Worker`) what an operator scrapes:
//!
//! - [`install`]: the Prometheus recorder (once per process), with the histogram buckets of
//!   every `_seconds` family, and the families' help texts;
//! - [`Endpoint`]: a small HTTP listener answering `GET /metrics` (the Prometheus text format),
//!   `GET /healthz` (the process is alive: its runtime answers) and `GET /readyz` (every
//!   readiness check of its [`Health`] passes: 200, or 503 naming the checks that fail), and
//!   `GET /sd`: the metrics endpoints of the processes this one knows of (the workers that
//!   joined its orchestrator), in the JSON of Prometheus' HTTP service discovery, so that one
//!   `http_sd_configs` entry finds every worker.
//!
//! The listener serves three fixed routes: it reads one request head (at most 8 KiB, within
//! 5 s), answers and closes, and serves at most 64 connections at once. A full HTTP stack would
//! be the largest dependency of the default build for that.
//!
//! What the endpoint reveals: counts, sizes, rates and latencies (requests, bytes moved per
//! backend, queue depths, store occupancy, worker counts per pool). It never shows a key, a
//! secret, a payload, a region address or a request's inputs. A reachable address still tells
//! anyone who reaches it how busy the cluster is, so [`Endpoint::serve`] refuses one unless the
//! caller passes `expose` (the CLI's `--metrics-expose`).

mod exporter;
mod families;
mod health;
mod http;
mod scrape;
mod zeros;

pub use exporter::{install, render};
pub use families::{FAMILIES, Family, Kind};
pub use health::{Health, Target};
pub use http::{Endpoint, Limits as EndpointLimits, MAX_HEAD};
pub use scrape::{Sample, Samples, get};
pub use zeros::{Layer, export_at_zero};
