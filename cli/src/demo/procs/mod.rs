//! `tensorwire demo --processes`: the disaggregated run with every stage worker in its own OS
//! process over tcp. The parent runs an engine with a store node and the orchestrator service;
//! each worker (`tensorwire worker ... --store-engine --store`) has its own engine and connector,
//! consumes its inputs from the references the orchestrator passes along, simulates the stage
//! time, publishes its outputs (embeddings through the store, latents p2p in temporal chunks)
//! and checks every byte it receives. Decode workers report the time of their first decoded
//! chunk on stdout, which gives TTFF.
//!
//! Workers lose nothing when killed: a stage reads its inputs without reporting them consumed
//! (`consume_held`); once a request ends the orchestrator hands every payload of it to a worker
//! to release (another one, should that one die first); a stage whose input died with its p2p
//! producer says so, and the orchestrator runs the producer stage again. The parent supervises
//! the worker processes (a killed one is restarted), and `--chaos SECS` kills random workers.
//!
//! Denoise runs step by step and, with `--checkpoint-every N` (batch jobs; interactive ones with
//! `--checkpoint-every-interactive`), saves its latents to the store every N steps (keeping the
//! last two) and tells the orchestrator; a job whose worker died resumes on another from its
//! last checkpoint, checking the bytes it loads. Asked to yield (an interactive job waits, or
//! the worker drains), it saves a checkpoint at the next step and gives the job back. Each
//! saved, resumed or yielded step is an `@@` line on stdout. SIGTERM drains the worker (its
//! denoise jobs move to other workers from their checkpoints) and then it exits.

mod cluster;
mod stores;
mod worker;

pub(crate) use cluster::{Cluster, ClusterArgs, Steps};
pub(crate) use stores::{StoreArgs, StoreLayout};
pub(crate) use worker::{StoreAt, payload_worker};
