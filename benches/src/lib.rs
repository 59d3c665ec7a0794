//! The tensorwire bench harness: every figure is a ratio against the raw medium measured in the
//! same run, interleaved with the tensorwire measurement (a plain tokio socket pair for tcp,
//! ucx_perftest for ucx, memcpy for in-process and same-host backends; for the store, memcpy or a raw engine transfer).
//! The `xfer` binary drives it and prints one JSON line per measurement.

/// What a measurement can fail with: an engine, store or connector error, or the harness's own.
pub type BenchError = Box<dyn std::error::Error + Send + Sync>;
/// Result of the harness.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

pub mod child_peer;
pub mod cluster;
pub mod connector;
pub mod copy;
pub mod latency;
pub mod measure;
pub mod memcpy;
pub mod orchestrator;
pub mod raw_tcp;
pub mod report;
pub mod scale;
pub mod service;
pub mod store;
pub mod suite;
pub mod thread_cpu;
pub mod transfer;
pub mod ucx_perftest;
