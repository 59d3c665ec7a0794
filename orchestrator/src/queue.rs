//! Queue messages between the orchestrator and stage workers: a request at a stage with its input
//! payload references, priority class, deadline, affinity hints and attempt number. Versioned,
//! bounded, and decoded by a total function (proptest in `tests/it/codecs.rs`, a cargo-fuzz target
//! under `fuzz/`).

use tensorwire_core::{Error, Result};
use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_proto::wire::frame::Framing;

use tensorwire_diffusion::PayloadRef;

use crate::stage::Stage;

/// The message's magic ("TQ") and version (a message is one buffer, bounded by its counts).
pub const FRAMING: Framing =
    Framing { name: "queue message", magic: *b"TQ", version: 1, max_payload: 1 << 20 };
/// Most payload refs in one message.
pub const MAX_REFS: usize = 16;
/// Most affinity labels.
pub const MAX_LABELS: usize = 8;
/// Longest host name or label.
pub const MAX_LABEL: usize = 128;

/// Priority / SLO class; interactive overtakes batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    /// Latency-sensitive.
    Interactive,
    /// Throughput work.
    Batch,
}

impl Priority {
    /// "interactive" or "batch" (e.g. a metric label).
    pub fn name(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Batch => "batch",
        }
    }

    /// Appends the wire tag.
    pub fn encode(self, w: &mut Writer) {
        w.u8(match self {
            Priority::Interactive => 0,
            Priority::Batch => 1,
        });
    }

    /// Reads a wire tag; never panics.
    pub fn decode(r: &mut Reader<'_>) -> Result<Priority> {
        match r.u8()? {
            0 => Ok(Priority::Interactive),
            1 => Ok(Priority::Batch),
            t => Err(Error::protocol(format!("unknown priority tag {t}"))),
        }
    }
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
        w.raw(&FRAMING.magic).u8(FRAMING.version).u64(self.request);
        self.stage.encode(&mut w);
        w.u32(self.payloads.len() as u32);
        for p in &self.payloads {
            p.encode(&mut w);
        }
        self.priority.encode(&mut w);
        w.u64(self.deadline_ms);
        w.opt(self.affinity.host.as_deref(), |w, h| {
            w.str(h);
        });
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
        FRAMING.check_prefix(r.raw(3)?)?;
        let request = r.u64()?;
        let stage = Stage::decode(&mut r)?;
        let n = r.count(MAX_REFS, "payload refs")?;
        let payloads = (0..n).map(|_| PayloadRef::decode(&mut r)).collect::<Result<Vec<_>>>()?;
        let priority = Priority::decode(&mut r)?;
        let deadline_ms = r.u64()?;
        let host = r.opt("host", |r| r.str(MAX_LABEL, "host"))?;
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
