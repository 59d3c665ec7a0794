//! What stages hand each other: payload kinds, lease policies, chunking, and the payload a
//! producer publishes.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::{Error, Region, Result, TensorMeta};
use tensorwire_proto::wire::codec::{Reader, Writer};

/// The kinds of stage outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadKind {
    /// Text/image condition embeddings (multi-consumer, cacheable).
    ConditionEmbedding,
    /// A denoised latent (single consumer: the decoder).
    Latent,
    /// A latent after `step` denoising steps (checkpoint, preemption, migration).
    StepLatent {
        /// Steps done.
        step: u32,
    },
    /// Reusable features (CFG negative branch, TeaCache-style).
    Feature,
}

impl PayloadKind {
    /// A short name, e.g. for a metric label ("embedding", "latent", "step_latent", "feature").
    pub fn name(self) -> &'static str {
        match self {
            PayloadKind::ConditionEmbedding => "embedding",
            PayloadKind::Latent => "latent",
            PayloadKind::StepLatent { .. } => "step_latent",
            PayloadKind::Feature => "feature",
        }
    }

    pub(crate) fn encode(self, w: &mut Writer) {
        match self {
            PayloadKind::ConditionEmbedding => w.u8(0).u32(0),
            PayloadKind::Latent => w.u8(1).u32(0),
            PayloadKind::StepLatent { step } => w.u8(2).u32(step),
            PayloadKind::Feature => w.u8(3).u32(0),
        };
    }
    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<PayloadKind> {
        let (t, step) = (r.u8()?, r.u32()?);
        Ok(match t {
            0 => PayloadKind::ConditionEmbedding,
            1 => PayloadKind::Latent,
            2 => PayloadKind::StepLatent { step },
            3 => PayloadKind::Feature,
            _ => return Err(Error::protocol(format!("unknown payload kind {t}"))),
        })
    }
}

/// How long a published payload lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeasePolicy {
    /// Gone the moment the last of `consumers` consumers finished.
    DeleteOnConsume {
        /// Consumers expected.
        consumers: u32,
    },
    /// Gone `ttl` after publishing.
    Ttl(Duration),
    /// Kept; evicted only after every unpinned object (store mode).
    SoftPin,
    /// Kept until removed.
    Pinned,
}

impl LeasePolicy {
    pub(crate) fn encode(self, w: &mut Writer) {
        match self {
            LeasePolicy::DeleteOnConsume { consumers } => w.u8(0).u64(consumers.into()),
            LeasePolicy::Ttl(d) => w.u8(1).u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            LeasePolicy::SoftPin => w.u8(2).u64(0),
            LeasePolicy::Pinned => w.u8(3).u64(0),
        };
    }
    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<LeasePolicy> {
        let (t, v) = (r.u8()?, r.u64()?);
        Ok(match t {
            0 => LeasePolicy::DeleteOnConsume {
                consumers: u32::try_from(v)
                    .ok()
                    .filter(|&c| c > 0)
                    .ok_or_else(|| Error::protocol(format!("lease with {v} consumers")))?,
            },
            1 => LeasePolicy::Ttl(Duration::from_millis(v)),
            2 => LeasePolicy::SoftPin,
            3 => LeasePolicy::Pinned,
            _ => return Err(Error::protocol(format!("unknown lease policy {t}"))),
        })
    }
}

/// Split a tensor into `count` chunks along dimension `dim` (video latents along T).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunking {
    /// Dimension.
    pub dim: u32,
    /// Chunks.
    pub count: u32,
}

/// A stage output to hand to the next stage.
#[derive(Debug, Clone)]
pub struct StagePayload {
    /// The request it belongs to.
    pub request: u64,
    /// Its kind.
    pub kind: PayloadKind,
    /// The registered memory holding it (kept alive by the connector while needed).
    pub region: Arc<Region>,
    /// Where the tensor's buffer starts in the region.
    pub offset: u64,
    /// The tensor.
    pub meta: TensorMeta,
    /// Chunked handoff, if any.
    pub chunking: Option<Chunking>,
    /// Lifetime.
    pub lease: LeasePolicy,
}
