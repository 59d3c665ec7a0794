//! `tensorwire-diffusion`: the thin layer that makes the transfer engine and the store speak the
//! language of a disaggregated diffusion pipeline (Condition Encode -> DiT Denoise -> VAE Decode):
//! the payloads stages hand each other and the connector that hands them over. Stages, queue
//! messages and their scheduling are `tensorwire-orchestrator`'s.
//!
//! - [`payload`]: payload kinds, lease policies, chunking, the payload a stage publishes.
//! - [`lease`]: the lease state machine (plain data, time passed in).
//! - [`reference`](mod@reference): [`PayloadRef`], what a consumer needs, small enough for a queue message.
//! - [`connector`]: [`DiffusionConnector`], publish and consume, p2p or store-relayed, with chunked
//!   handoff that overlaps transfer and decode; its decisions are the sans-IO state machines of
//!   [`handoff`], its messages those of [`control`], its errors [`ConnectorError`].
//! - [`cache`]: stable cache keys (embedding, CFG, checkpoint) and a best-effort cache over the
//!   store, shared by every process that sees it.

pub mod cache;
pub mod connector;
pub mod control;
mod error;
pub mod handoff;
pub mod lease;
pub mod payload;
pub mod reference;

pub use connector::{
    ChunkView, ConnectorConfig, ConsumerHint, Consumption, DiffusionConnector, Mode, Publication,
};
pub use error::{ConnectorError, LeaseEnd, Result};
pub use lease::{Lease, LeaseState};
pub use payload::{Chunking, LeasePolicy, PayloadKind, StagePayload};
pub use reference::{PayloadRef, Source};
