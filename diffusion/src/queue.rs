//! Queue messages between the orchestrator and stage workers. Versioned, bounded, and decoded by
//! a total function (proptest here, a cargo-fuzz target under `fuzz/`).

use tensorwire_core::wire::codec::{Reader, Writer};
use tensorwire_core::{Error, Result};

use crate::reference::PayloadRef;

const MAGIC: [u8; 2] = *b"TQ";
const VERSION: u8 = 1;
/// Most payload refs in one message.
pub const MAX_REFS: usize = 16;
/// Most affinity labels.
pub const MAX_LABELS: usize = 8;
/// Longest host name or label.
pub const MAX_LABEL: usize = 128;

/// Pipeline stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Condition encode.
    Encode,
    /// DiT denoise.
    Denoise,
    /// VAE decode.
    Decode,
}

impl Stage {
    fn tag(self) -> u8 {
        match self {
            Stage::Encode => 0,
            Stage::Denoise => 1,
            Stage::Decode => 2,
        }
    }
    fn from_tag(t: u8) -> Result<Stage> {
        Ok(match t {
            0 => Stage::Encode,
            1 => Stage::Denoise,
            2 => Stage::Decode,
            _ => return Err(Error::protocol(format!("unknown stage {t}"))),
        })
    }
}

/// Priority / SLO class; interactive overtakes batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    /// Latency-sensitive.
    Interactive,
    /// Throughput work.
    Batch,
}

/// Placement hints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Affinity {
    /// The producer's host.
    pub host: Option<String>,
    /// Rail / NUMA labels.
    pub labels: Vec<String>,
}

/// One unit of work for a stage.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueMessage {
    /// Request.
    pub request: u64,
    /// Stage that should run it.
    pub stage: Stage,
    /// Inputs.
    pub payloads: Vec<PayloadRef>,
    /// Class.
    pub priority: Priority,
    /// Deadline, milliseconds since the Unix epoch (0: none).
    pub deadline_ms: u64,
    /// Placement hints.
    pub affinity: Affinity,
    /// 1 for the first try; +1 per re-queue.
    pub attempt: u32,
}

impl QueueMessage {
    /// Encodes; errors when a bound is exceeded.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let too_many = |what: &str, n: usize, max: usize| Error::Capacity {
            what: format!("queue message {what}"),
            requested: n as u64,
            limit: max as u64,
        };
        if self.payloads.len() > MAX_REFS {
            return Err(too_many("payload refs", self.payloads.len(), MAX_REFS));
        }
        if self.affinity.labels.len() > MAX_LABELS {
            return Err(too_many("labels", self.affinity.labels.len(), MAX_LABELS));
        }
        let long =
            self.affinity.host.iter().chain(&self.affinity.labels).find(|s| s.len() > MAX_LABEL);
        if let Some(s) = long {
            return Err(too_many("label bytes", s.len(), MAX_LABEL));
        }
        let mut w = Writer::new();
        w.raw(&MAGIC).u8(VERSION).u64(self.request).u8(self.stage.tag());
        w.u32(self.payloads.len() as u32);
        for p in &self.payloads {
            p.encode(&mut w);
        }
        w.u8(match self.priority {
            Priority::Interactive => 0,
            Priority::Batch => 1,
        });
        w.u64(self.deadline_ms);
        match &self.affinity.host {
            Some(h) => w.u8(1).str(h),
            None => w.u8(0),
        };
        w.u32(self.affinity.labels.len() as u32);
        for l in &self.affinity.labels {
            w.str(l);
        }
        w.u32(self.attempt);
        Ok(w.finish())
    }

    /// Decodes; never panics.
    pub fn decode(b: &[u8]) -> Result<QueueMessage> {
        let mut r = Reader::new(b, "queue message");
        let magic = [r.u8()?, r.u8()?];
        if magic != MAGIC {
            return Err(Error::protocol("queue message: bad magic"));
        }
        let v = r.u8()?;
        if v != VERSION {
            return Err(Error::protocol(format!(
                "queue message version {v} (this build: {VERSION})"
            )));
        }
        let request = r.u64()?;
        let stage = Stage::from_tag(r.u8()?)?;
        let n = r.count(MAX_REFS, "payload refs")?;
        let payloads = (0..n).map(|_| PayloadRef::decode(&mut r)).collect::<Result<Vec<_>>>()?;
        let priority = match r.u8()? {
            0 => Priority::Interactive,
            1 => Priority::Batch,
            t => return Err(Error::protocol(format!("queue message: unknown priority {t}"))),
        };
        let deadline_ms = r.u64()?;
        let host = match r.u8()? {
            0 => None,
            1 => Some(r.str(MAX_LABEL, "host")?),
            t => return Err(Error::protocol(format!("queue message: bad host tag {t}"))),
        };
        let nl = r.count(MAX_LABELS, "labels")?;
        let labels = (0..nl).map(|_| r.str(MAX_LABEL, "label")).collect::<Result<Vec<_>>>()?;
        let attempt = r.u32()?;
        r.finish()?;
        Ok(QueueMessage {
            request,
            stage,
            payloads,
            priority,
            deadline_ms,
            affinity: Affinity { host, labels },
            attempt,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::{Chunking, LeasePolicy, PayloadKind};
    use crate::reference::Source;
    use proptest::prelude::*;
    use std::time::Duration;
    use tensorwire_core::{AccessKey, DType, EngineId, RegionId, TensorMeta};

    fn sample() -> QueueMessage {
        let latent = PayloadRef {
            request: 7,
            kind: PayloadKind::Latent,
            source: Source::P2p {
                engine: EngineId(99),
                addr: "10.0.0.3:7000".parse().unwrap(),
                payload: 3,
                region: RegionId(12),
                key: AccessKey::from_bits(0xabc),
                offset: 4096,
            },
            meta: TensorMeta::contiguous(DType::BF16, &[16, 21, 60, 104]),
            chunking: Some(Chunking { dim: 1, count: 7 }),
            lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
            checksum: None,
        };
        let emb = PayloadRef {
            source: Source::Store { key: b"emb/7".to_vec() },
            kind: PayloadKind::StepLatent { step: 12 },
            lease: LeasePolicy::Ttl(Duration::from_secs(30)),
            checksum: Some(5),
            chunking: None,
            ..latent.clone()
        };
        QueueMessage {
            request: 7,
            stage: Stage::Decode,
            payloads: vec![latent, emb],
            priority: Priority::Interactive,
            deadline_ms: 1_800_000_000_000,
            affinity: Affinity { host: Some("gpu-node-3".into()), labels: vec!["rail0".into()] },
            attempt: 2,
        }
    }

    #[test]
    fn round_trip_and_bounds() {
        let m = sample();
        assert_eq!(QueueMessage::decode(&m.encode().unwrap()).unwrap(), m);
        let mut big = m.clone();
        big.payloads = vec![m.payloads[0].clone(); MAX_REFS + 1];
        assert!(matches!(big.encode(), Err(Error::Capacity { .. })));
        let mut bytes = m.encode().unwrap();
        bytes[2] = 9;
        assert!(QueueMessage::decode(&bytes).unwrap_err().to_string().contains("version 9"));
        let enc = m.encode().unwrap();
        for cut in 0..enc.len() {
            assert!(QueueMessage::decode(&enc[..cut]).is_err(), "truncated at {cut} decoded");
        }
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = QueueMessage::decode(&bytes);
        }

        #[test]
        fn mutated_messages_never_panic(i in 0usize..400, b in any::<u8>()) {
            let mut enc = sample().encode().unwrap();
            let n = enc.len();
            enc[i % n] = b;
            let _ = QueueMessage::decode(&enc);
        }
    }
}
