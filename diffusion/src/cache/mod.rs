//! Cross-instance reuse over the store: stable cache keys ([`keys`]) and a best-effort cache of
//! one kind per [`StoreCache`] (condition embeddings, CFG features).

pub mod keys;
mod store_cache;

pub use keys::{CacheKey, CheckpointOf, Sampler, Shape, cfg_key, checkpoint_key, embedding_key};
pub use store_cache::{CachePolicy, CacheStats, StoreCache};
