//! The chunk API's pure parts: `ChunkPlan` (which byte ranges each chunk covers), `ChunkTracker`
//! (the consumer's landed-chunk state machine) and `ReadySet` (the producer's shared ready marks).
//! The engine's `ChunkSender` and `ChunkStream` drive them over a session.

mod plan;
pub(crate) mod ready;
mod tracker;

pub use plan::{ByteRange, Chunk, ChunkPlan, LandedChunk, MAX_RANGES};
pub use tracker::ChunkTracker;
