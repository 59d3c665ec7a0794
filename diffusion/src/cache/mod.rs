//! Cross-instance reuse over the store: stable cache keys ([`keys`]) and a best-effort cache of
//! one kind per [`StoreCache`] (condition embeddings, CFG features), and step checkpoints
//! ([`Checkpoints`]) that let a denoise job resume where its last try stopped.

mod checkpoint;
pub mod keys;
mod store_cache;

pub use checkpoint::{CheckpointRef, Checkpoints, MAX_STATE};
pub use keys::{CacheKey, CheckpointOf, Sampler, Shape, cfg_key, checkpoint_key, embedding_key};
pub use store_cache::{CachePolicy, CacheStats, StoreCache};
