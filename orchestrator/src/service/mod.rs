//! Service mode: the orchestrator over the network, with its own versioned protocol ([`wire`]),
//! the server ([`OrchestratorService`]) and its clients ([`WorkerClient`], [`SubmitClient`]).

mod client;
mod elastic;
mod logfile;
mod server;
pub mod wire;

pub use client::{
    Assignment, RECONNECT_FOR, Resolver, SubmitClient, Target, WorkerClient, WorkerSpec,
};
pub use logfile::{JournalFile, JournalStore};
pub use server::{METRICS_LABEL, MetricsTarget, OrchestratorService, ServiceConfig, metrics_label};
