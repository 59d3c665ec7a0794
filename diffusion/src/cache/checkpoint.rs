//! Step checkpoints in the store: a denoise job's latents at a step with its sampler state, so
//! that the job's next try (on any worker, after the first one died) resumes from that step
//! instead of step 0. A checkpoint is one store object (the latents, under its
//! [`CacheKey`](super::CacheKey)) and a small reference ([`CheckpointRef`]: where the latents
//! are, the step, the sampler state) that the worker hands the orchestrator
//! (`WorkerClient::checkpoint`); the orchestrator gives it back to the next try and, when the
//! request ends, to a worker to release ([`Checkpoints::release`]), which ends its retention.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::{MemSlice, Region, TensorMeta};
use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_store::{Retention, Store, StoreError};

use super::keys::CacheKey;

const MAGIC: &[u8; 4] = b"TWCK";
const VERSION: u8 = 1;
/// Largest sampler state a reference carries.
pub const MAX_STATE: usize = 16 << 10;

/// Where a checkpoint is and what it resumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRef {
    /// Its store key.
    pub key: Vec<u8>,
    /// The latents' tensor.
    pub meta: TensorMeta,
    /// The step they are at.
    pub step: u32,
    /// The sampler's state at that step.
    pub state: Vec<u8>,
}

impl CheckpointRef {
    /// The bytes handed to the orchestrator.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.raw(MAGIC).u8(VERSION).bytes(&self.key);
        self.meta.encode(&mut w);
        w.u32(self.step).bytes(&self.state[..self.state.len().min(MAX_STATE)]);
        w.finish()
    }

    /// Whether `b` is an encoded checkpoint reference (not some other payload reference).
    pub fn is(b: &[u8]) -> bool {
        b.starts_with(MAGIC)
    }

    /// Decodes; never panics.
    pub fn decode(b: &[u8]) -> tensorwire_core::Result<CheckpointRef> {
        let mut r = Reader::new(b, "checkpoint reference");
        if r.raw(MAGIC.len())? != MAGIC || r.u8()? != VERSION {
            return Err(tensorwire_core::Error::protocol(
                "not a checkpoint reference of this version",
            ));
        }
        let key = r.bytes(tensorwire_store::MAX_KEY, "key")?.to_vec();
        let meta = TensorMeta::decode(&mut r)?;
        let step = r.u32()?;
        let state = r.bytes(MAX_STATE, "sampler state")?.to_vec();
        r.finish()?;
        Ok(CheckpointRef { key, meta, step, state })
    }
}

/// Checkpoints in a store.
#[derive(Debug, Clone)]
pub struct Checkpoints {
    store: Arc<dyn Store>,
    ttl: Duration,
}

impl Checkpoints {
    /// Checkpoints kept until released, or `ttl` at most (a job whose request never ends).
    pub fn new(store: Arc<dyn Store>, ttl: Duration) -> Checkpoints {
        Checkpoints { store, ttl }
    }

    /// The reference [`Checkpoints::save`] returns for these arguments, without saving: a
    /// worker announces it to the orchestrator before the put starts, so that a checkpoint
    /// saved just before the worker dies is still released when the request ends.
    pub fn reference(key: &CacheKey, meta: &TensorMeta, step: u32, state: &[u8]) -> CheckpointRef {
        CheckpointRef {
            key: key.store_key("ckpt"),
            meta: meta.clone(),
            step,
            state: state.to_vec(),
        }
    }

    /// Saves the latents in `latent` (described by `meta`) at `step` with the sampler `state`
    /// under `key`; returns the reference to hand to the orchestrator. Saving the same key again
    /// (a retry reaching the same step) keeps the first.
    pub async fn save(
        &self,
        key: &CacheKey,
        meta: &TensorMeta,
        latent: &MemSlice,
        step: u32,
        state: &[u8],
    ) -> Result<CheckpointRef, StoreError> {
        if state.len() > MAX_STATE {
            return Err(StoreError::InvalidArgument(format!(
                "a sampler state of {} bytes; at most {MAX_STATE}",
                state.len()
            )));
        }
        let sk = key.store_key("ckpt");
        match self.store.put_from(&sk, meta, latent, Retention::Pinned).await {
            Ok(()) => self.store.set_lease(&sk, 0, Some(self.ttl)).await?,
            Err(StoreError::Exists { .. }) => {}
            Err(e) => return Err(e),
        }
        Ok(CheckpointRef { key: sk, meta: meta.clone(), step, state: state.to_vec() })
    }

    /// Reads a checkpoint's latents into `dst` at `offset`; checks they are what `r` says.
    pub async fn load(
        &self,
        r: &CheckpointRef,
        dst: &Region,
        offset: u64,
    ) -> Result<(), StoreError> {
        let (meta, _) = self.store.get_into(&r.key, dst, offset).await?;
        if meta != r.meta {
            return Err(StoreError::InvalidTensor(format!(
                "checkpoint {}: stored as {meta:?}, referenced as {:?}",
                String::from_utf8_lossy(&r.key),
                r.meta
            )));
        }
        Ok(())
    }

    /// Ends a checkpoint's retention (its job completed); gone already is fine.
    pub async fn release(&self, r: &CheckpointRef) -> Result<(), StoreError> {
        self.store.remove(&r.key).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tensorwire_core::DType;

    #[test]
    fn references_round_trip_and_are_told_apart() {
        let r = CheckpointRef {
            key: b"tw/cache/ckpt/ab".to_vec(),
            meta: TensorMeta::contiguous(DType::F16, &[16, 60, 104]),
            step: 20,
            state: vec![1, 2, 3],
        };
        let b = r.encode();
        assert!(CheckpointRef::is(&b));
        assert_eq!(CheckpointRef::decode(&b).unwrap(), r);
        assert!(!CheckpointRef::is(b"\\x01other"));
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = CheckpointRef::decode(&bytes);
        }
    }
}
