//! Service mode: the orchestrator over the network, with its own versioned protocol ([`wire`]),
//! the server ([`OrchestratorService`]) and its clients ([`WorkerClient`], [`SubmitClient`]).

mod client;
mod logfile;
mod server;
pub mod wire;

pub use client::{Assignment, RECONNECT_FOR, SubmitClient, WorkerClient};
pub use server::{OrchestratorService, ServiceConfig};
