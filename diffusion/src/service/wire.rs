//! The orchestrator service protocol: 8-byte headers (magic "TO", version, kind, payload length)
//! and payloads of at most [`MAX_PAYLOAD`] bytes built with the core codec. Total decoders.
//!
//! Session: the client sends `Open{nonce}`; the server answers `Challenge{nonce, proof}`; the
//! client checks the proof (with a cluster secret) and sends `Hello{proof, role}`; the server
//! checks it and answers `Welcome{worker id}` or `Reject{reason}`. Then workers send heartbeats,
//! credits and results and receive assignments; submitters send requests and receive outcomes.

use tensorwire_core::auth::AUTH_LEN;
use tensorwire_core::wire::codec::{Reader, Writer};
use tensorwire_core::{Error, Result};

use crate::queue::{Priority, Stage};

/// Header length.
pub const HEADER_LEN: usize = 8;
const MAGIC: [u8; 2] = *b"TO";
const VERSION: u8 = 1;
/// Largest payload.
pub const MAX_PAYLOAD: u32 = 64 << 10;
const MAX_TEXT: usize = 1024;
const MAX_LABELS: usize = 8;
/// Largest opaque stage data (inputs / outputs) in one message.
pub const MAX_DATA: usize = 48 << 10;

/// What a client is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// A stage worker.
    Worker {
        /// Its stage.
        stage: Stage,
        /// Concurrent items it takes.
        slots: u32,
        /// Its host.
        host: String,
        /// Rail / NUMA labels.
        labels: Vec<String>,
    },
    /// A client that submits requests.
    Submitter,
}

/// Every message of the protocol (field names say what the variant documentation describes).
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Client: its nonce.
    Open { nonce: [u8; AUTH_LEN] },
    /// Server: its nonce and proof.
    Challenge { nonce: [u8; AUTH_LEN], proof: [u8; AUTH_LEN] },
    /// Client: its proof and role.
    Hello { proof: [u8; AUTH_LEN], role: Role },
    /// Server: accepted (workers get their id; submitters 0).
    Welcome { worker: u64 },
    /// Server: refused.
    Reject { reason: String },
    /// Worker: alive.
    Heartbeat,
    /// Worker: its slot count changed.
    Credit { slots: u32 },
    /// Server -> worker: run this item; `data` is what the previous stage reported (its outputs,
    /// e.g. encoded payload references), empty for the first stage.
    Assign { request: u64, stage: Stage, attempt: u32, data: Vec<u8> },
    /// Worker: an item ended; `data` (its outputs) goes to the next stage's assignment.
    Result { request: u64, stage: Stage, ok: bool, reason: String, data: Vec<u8> },
    /// Submitter: a new request.
    Submit { request: u64, priority: Priority, deadline_ms: u64 },
    /// Server -> submitter: a request ended.
    Outcome { request: u64, ok: bool, reason: String },
}

fn stage_tag(s: Stage) -> u8 {
    match s {
        Stage::Encode => 0,
        Stage::Denoise => 1,
        Stage::Decode => 2,
    }
}

fn stage_of(t: u8) -> Result<Stage> {
    Ok(match t {
        0 => Stage::Encode,
        1 => Stage::Denoise,
        2 => Stage::Decode,
        _ => return Err(Error::protocol(format!("orchestrator: unknown stage {t}"))),
    })
}

fn clip(s: &str) -> &str {
    let mut end = s.len().min(MAX_TEXT);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn array(r: &mut Reader<'_>) -> Result<[u8; AUTH_LEN]> {
    let mut a = [0u8; AUTH_LEN];
    for b in &mut a {
        *b = r.u8()?;
    }
    Ok(a)
}

impl Msg {
    /// Header + payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        let kind = match self {
            Msg::Open { nonce } => {
                w.raw(nonce);
                1
            }
            Msg::Challenge { nonce, proof } => {
                w.raw(nonce).raw(proof);
                2
            }
            Msg::Hello { proof, role } => {
                w.raw(proof);
                match role {
                    Role::Worker { stage, slots, host, labels } => {
                        w.u8(1).u8(stage_tag(*stage)).u32(*slots).str(clip(host));
                        w.u32(labels.len().min(MAX_LABELS) as u32);
                        for l in labels.iter().take(MAX_LABELS) {
                            w.str(clip(l));
                        }
                    }
                    Role::Submitter => {
                        w.u8(2);
                    }
                }
                3
            }
            Msg::Welcome { worker } => {
                w.u64(*worker);
                4
            }
            Msg::Reject { reason } => {
                w.str(clip(reason));
                5
            }
            Msg::Heartbeat => 6,
            Msg::Credit { slots } => {
                w.u32(*slots);
                7
            }
            Msg::Assign { request, stage, attempt, data } => {
                w.u64(*request).u8(stage_tag(*stage)).u32(*attempt).bytes(data);
                8
            }
            Msg::Result { request, stage, ok, reason, data } => {
                w.u64(*request)
                    .u8(stage_tag(*stage))
                    .u8(u8::from(*ok))
                    .str(clip(reason))
                    .bytes(data);
                9
            }
            Msg::Submit { request, priority, deadline_ms } => {
                let p = match priority {
                    Priority::Interactive => 0,
                    Priority::Batch => 1,
                };
                w.u64(*request).u8(p).u64(*deadline_ms);
                10
            }
            Msg::Outcome { request, ok, reason } => {
                w.u64(*request).u8(u8::from(*ok)).str(clip(reason));
                11
            }
        };
        let payload = w.finish();
        let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(kind);
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&payload);
        out
    }

    /// Decodes a header: (kind, payload length). Never panics.
    pub fn header(h: &[u8]) -> Result<(u8, u32)> {
        let h: &[u8; HEADER_LEN] =
            h.try_into().map_err(|_| Error::protocol("orchestrator: short header"))?;
        if h[..2] != MAGIC {
            return Err(Error::protocol("orchestrator: bad magic"));
        }
        if h[2] != VERSION {
            return Err(Error::protocol(format!(
                "orchestrator protocol version {} (this build speaks {VERSION})",
                h[2]
            )));
        }
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        if len > MAX_PAYLOAD {
            return Err(Error::Capacity {
                what: "orchestrator frame".into(),
                requested: len.into(),
                limit: MAX_PAYLOAD.into(),
            });
        }
        Ok((h[3], len))
    }

    /// Decodes a payload of `kind`. Never panics.
    pub fn decode(kind: u8, p: &[u8]) -> Result<Msg> {
        let mut r = Reader::new(p, "orchestrator message");
        let m = match kind {
            1 => Msg::Open { nonce: array(&mut r)? },
            2 => Msg::Challenge { nonce: array(&mut r)?, proof: array(&mut r)? },
            3 => {
                let proof = array(&mut r)?;
                let role = match r.u8()? {
                    1 => {
                        let stage = stage_of(r.u8()?)?;
                        let slots = r.u32()?;
                        let host = r.str(MAX_TEXT, "host")?;
                        let n = r.count(MAX_LABELS, "labels")?;
                        let labels =
                            (0..n).map(|_| r.str(MAX_TEXT, "label")).collect::<Result<_>>()?;
                        Role::Worker { stage, slots, host, labels }
                    }
                    2 => Role::Submitter,
                    t => return Err(Error::protocol(format!("orchestrator: unknown role {t}"))),
                };
                Msg::Hello { proof, role }
            }
            4 => Msg::Welcome { worker: r.u64()? },
            5 => Msg::Reject { reason: r.str(MAX_TEXT, "reason")? },
            6 => Msg::Heartbeat,
            7 => Msg::Credit { slots: r.u32()? },
            8 => Msg::Assign {
                request: r.u64()?,
                stage: stage_of(r.u8()?)?,
                attempt: r.u32()?,
                data: r.bytes(MAX_DATA, "data")?.to_vec(),
            },
            9 => Msg::Result {
                request: r.u64()?,
                stage: stage_of(r.u8()?)?,
                ok: r.u8()? != 0,
                reason: r.str(MAX_TEXT, "reason")?,
                data: r.bytes(MAX_DATA, "data")?.to_vec(),
            },
            10 => {
                let request = r.u64()?;
                let priority = match r.u8()? {
                    0 => Priority::Interactive,
                    1 => Priority::Batch,
                    t => return Err(Error::protocol(format!("orchestrator: priority {t}"))),
                };
                Msg::Submit { request, priority, deadline_ms: r.u64()? }
            }
            11 => Msg::Outcome {
                request: r.u64()?,
                ok: r.u8()? != 0,
                reason: r.str(MAX_TEXT, "reason")?,
            },
            k => return Err(Error::protocol(format!("orchestrator: unknown message kind {k}"))),
        };
        r.finish()?;
        Ok(m)
    }
}

/// Reads one message from `s`; `Ok(None)` at a clean end of stream.
pub async fn read_msg(s: &mut (impl tokio::io::AsyncReadExt + Unpin)) -> Result<Option<Msg>> {
    let mut h = [0u8; HEADER_LEN];
    match s.read_exact(&mut h).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let (kind, len) = Msg::header(&h)?;
    let mut p = vec![0u8; len as usize];
    s.read_exact(&mut p).await?;
    Msg::decode(kind, &p).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        let msgs = [
            Msg::Open { nonce: [1; AUTH_LEN] },
            Msg::Challenge { nonce: [2; AUTH_LEN], proof: [3; AUTH_LEN] },
            Msg::Hello {
                proof: [4; AUTH_LEN],
                role: Role::Worker {
                    stage: Stage::Decode,
                    slots: 2,
                    host: "h".into(),
                    labels: vec!["rail0".into()],
                },
            },
            Msg::Hello { proof: [0; AUTH_LEN], role: Role::Submitter },
            Msg::Assign { request: 9, stage: Stage::Denoise, attempt: 2, data: vec![1, 2] },
            Msg::Result {
                request: 9,
                stage: Stage::Denoise,
                ok: false,
                reason: "oom".into(),
                data: vec![],
            },
            Msg::Submit { request: 1, priority: Priority::Interactive, deadline_ms: 5 },
            Msg::Outcome { request: 1, ok: true, reason: String::new() },
            Msg::Heartbeat,
        ];
        for m in msgs {
            let b = m.encode();
            let (k, n) = Msg::header(&b[..HEADER_LEN]).unwrap();
            assert_eq!(n as usize, b.len() - HEADER_LEN);
            assert_eq!(Msg::decode(k, &b[HEADER_LEN..]).unwrap(), m);
        }
    }

    proptest! {
        #[test]
        fn decoders_are_total(kind in any::<u8>(), bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Msg::decode(kind, &bytes);
            let _ = Msg::header(&bytes);
        }
    }
}
