//! `tensorwire-diffusion`: the thin layer that makes the transfer engine and the store speak the
//! language of a disaggregated diffusion pipeline (Condition Encode -> DiT Denoise -> VAE Decode).
//!
//! - [`payload`]: payload kinds, lease policies, chunking, the payload a stage publishes.
//! - [`lease`]: the lease state machine (plain data, time passed in).
//! - [`reference`]: [`PayloadRef`], what a consumer needs, small enough for a queue message.
//! - [`queue`]: [`QueueMessage`], the unit of work between orchestrator and workers.
//! - [`sched`]: the orchestrator's scheduler core (sans-IO): queues, credits, priorities,
//!   affinity, failure re-queue.
//! - [`connector`]: [`DiffusionConnector`], publish and consume, p2p or store-relayed, with chunked
//!   handoff that overlaps transfer and decode.

pub mod connector;
mod control;
pub mod lease;
pub mod orchestrator;
pub mod payload;
pub mod queue;
pub mod reference;
pub mod sched;
pub mod service;

pub use connector::{
    ChunkView, ConnectorConfig, ConsumerHint, Consumption, DiffusionConnector, Mode, Publication,
    Role,
};
pub use lease::{Lease, LeaseState};
pub use orchestrator::{Orchestrator, OrchestratorStats, StageHandler, Work};
pub use payload::{Chunking, LeasePolicy, PayloadKind, StagePayload};
pub use queue::{Affinity, Priority, QueueMessage, Stage};
pub use reference::{PayloadRef, Source};
