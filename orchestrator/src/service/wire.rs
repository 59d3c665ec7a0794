//! The orchestrator service protocol, on the common framing ([`FRAMING`], magic "TO"): after the
//! authenticated handshake (`tensorwire_proto::handshake`) the client says what it is (`Hello`)
//! and the server answers `Welcome{worker id}`; then workers send heartbeats, credits and results
//! and receive assignments, and submitters send requests and receive outcomes. A refusal is the
//! handshake's `Reject` frame. Bodies are built with the core codec; decoders are total.

use std::time::Duration;

use crate::timeline::Timeline;
use crate::{Priority, Stage};
use tensorwire_core::{Error, Result};
use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_proto::wire::frame::Framing;

/// Largest payload.
pub const MAX_PAYLOAD: u32 = 1 << 20;
/// The service's framing (version 7: a worker says which other stages it can serve and what a
/// switch costs, and the service may tell it to switch; version 6: a submitter may ask for a
/// request's timeline, and a worker says when its inputs arrived; version 5:
/// results are acknowledged; a reconnecting worker says what
/// it still runs, a reconnecting submitter what it still waits for; a request may start past the
/// first stage with that stage's inputs and a checkpoint to resume from; workers checkpoint
/// items and a next try resumes there; the service asks a worker to yield a job (preemption,
/// drain) and a worker may ask to be drained).
pub const FRAMING: Framing =
    Framing { name: "orchestrator", magic: *b"TO", version: 7, max_payload: MAX_PAYLOAD };
const MAX_TEXT: usize = 1024;
const MAX_LABELS: usize = 8;
/// Largest opaque stage data (inputs / outputs) in one message.
pub const MAX_DATA: usize = 48 << 10;
/// Most outputs one release lists (with `MAX_DATA` each, a release stays within `MAX_PAYLOAD`).
pub const MAX_HELD: usize = 16;

/// How a worker ended an item, on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// It failed (tag 0).
    Failed,
    /// It finished (tag 1).
    Done,
    /// Its input was gone (tag 2): the stage before runs again.
    LostInput,
}

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
        /// The other stages it can serve, each with the time to switch to it (elastic pools).
        can: Vec<(Stage, Duration)>,
        /// It joins after switching from another stage, which took this long.
        switched: Option<Duration>,
    },
    /// A client that submits requests.
    Submitter,
}

/// Every message of the protocol (field names say what the variant documentation describes).
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Client: what it is.
    Hello { role: Role },
    /// Server: accepted (workers get their id; submitters 0).
    Welcome { worker: u64 },
    /// Worker: alive.
    Heartbeat,
    /// Worker: its slot count changed.
    Credit { slots: u32 },
    /// Server -> worker: run this item; `data` is what the previous stage reported (its outputs,
    /// e.g. encoded payload references), empty for the first stage. `resume` is the item's last
    /// checkpoint (what a worker that ran it before said with `Checkpoint`), empty for none:
    /// continue from `resume_step`. `priority` is the request's class (e.g. a worker checkpoints
    /// batch jobs more often than interactive ones).
    Assign {
        request: u64,
        stage: Stage,
        priority: Priority,
        attempt: u32,
        data: Vec<u8>,
        resume_step: u32,
        resume: Vec<u8>,
    },
    /// Worker: an item ended; `data` (its outputs) goes to the next stage's assignment.
    Result { request: u64, stage: Stage, ending: Ending, reason: String, data: Vec<u8> },
    /// Submitter: a new request, starting at `start` with `data` as that stage's inputs (empty
    /// and the first stage for a plain request); `resume` (empty for none) is a checkpoint that
    /// stage resumes from at `resume_step` (edit and resume).
    Submit {
        request: u64,
        priority: Priority,
        deadline_ms: u64,
        start: Stage,
        data: Vec<u8>,
        resume_step: u32,
        resume: Vec<u8>,
    },
    /// Server -> submitter: a request ended.
    Outcome { request: u64, ok: bool, reason: String },
    /// Server -> worker: `request` ended; nothing will consume `held`, its stages' outputs:
    /// release them, then say `Released`.
    Release { request: u64, held: Vec<Vec<u8>> },
    /// Worker: the outputs of `request` are released.
    Released { request: u64 },
    /// Worker: the item of `request` at `stage` it runs will output `data`; sent before the
    /// outputs exist (e.g. with the key of a store put about to start), so that they are
    /// released when the request ends even if this worker dies before its result.
    Announce { request: u64, stage: Stage, data: Vec<u8> },
    /// Worker, right after a reconnect: it still runs (or ran, result not yet acknowledged)
    /// this item on `attempt`; the service lets it keep the item if it can.
    Holding { request: u64, stage: Stage, attempt: u32 },
    /// Server -> worker: the result for this item is recorded (or will never be accepted):
    /// the worker may forget it.
    Ack { request: u64, stage: Stage },
    /// Submitter, after a reconnect: it still waits for `request` (submitted before, as
    /// described); the service answers with its outcome, now or when it ends, and submits it if
    /// never seen.
    Resume {
        request: u64,
        priority: Priority,
        start: Stage,
        data: Vec<u8>,
        resume_step: u32,
        resume: Vec<u8>,
    },
    /// Worker: the item it runs reached `step` and its state is saved as `data` (e.g. the
    /// reference of a step checkpoint in the store): should the worker die, the item's next
    /// try resumes from there. Released with the request's outputs when it ends.
    Checkpoint { request: u64, stage: Stage, step: u32, data: Vec<u8> },
    /// Server -> worker: checkpoint this job at its next step boundary and give it back with
    /// `Yielded` (an interactive job waits for the slot, or this worker is draining).
    Yield { request: u64, stage: Stage },
    /// Worker: it gave the job back at `step`, its state saved as `data` (empty: the last
    /// checkpoint stands); acknowledged like a result.
    Yielded { request: u64, stage: Stage, step: u32, data: Vec<u8> },
    /// Worker: take no new items, ask it to yield its jobs, and say `Drained` once it holds
    /// nothing (scale-down).
    Drain,
    /// Server -> worker: it holds nothing and gets nothing more; it may stop.
    Drained,
    /// Submitter: the timeline of `request` (in flight, or among the last ended).
    AskTimeline { request: u64 },
    /// Server -> submitter: the answer (`None`: unknown, or ended too long ago).
    TimelineIs { request: u64, timeline: Option<Timeline> },
    /// Worker: the item's input payloads arrived, `bytes` in all, the last byte in hand
    /// `micros` after it started consuming (for the request's timeline).
    Handoff { request: u64, stage: Stage, bytes: u64, micros: u64 },
    /// Server -> worker: serve `stage` instead (elastic pools). The service drains the worker
    /// (`Drained` follows once it holds nothing); it then loads that stage and joins again.
    Switch { stage: Stage },
}

fn put_held(w: &mut Writer, held: &[Vec<u8>]) {
    w.u32(held.len().min(MAX_HELD) as u32);
    for h in held.iter().take(MAX_HELD) {
        w.bytes(h);
    }
}

fn get_held(r: &mut Reader<'_>) -> Result<Vec<Vec<u8>>> {
    let n = r.count(MAX_HELD, "held outputs")?;
    (0..n).map(|_| Ok(r.bytes(MAX_DATA, "held output")?.to_vec())).collect()
}

/// A duration in whole milliseconds, saturating.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn clip(s: &str) -> &str {
    let mut end = s.len().min(MAX_TEXT);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Msg {
    /// The frame kind and body.
    pub fn encode_body(&self) -> (u8, Vec<u8>) {
        let mut w = Writer::new();
        let kind = match self {
            Msg::Hello { role } => {
                match role {
                    Role::Worker { stage, slots, host, labels, can, switched } => {
                        w.u8(1);
                        stage.encode(&mut w);
                        w.u32(*slots).str(clip(host));
                        w.u32(labels.len().min(MAX_LABELS) as u32);
                        for l in labels.iter().take(MAX_LABELS) {
                            w.str(clip(l));
                        }
                        w.u32(can.len().min(Stage::ALL.len()) as u32);
                        for (s, cost) in can.iter().take(Stage::ALL.len()) {
                            s.encode(&mut w);
                            w.u64(millis(*cost));
                        }
                        match switched {
                            Some(d) => w.u8(1).u64(millis(*d)),
                            None => w.u8(0),
                        };
                    }
                    Role::Submitter => {
                        w.u8(2);
                    }
                }
                1
            }
            Msg::Welcome { worker } => {
                w.u64(*worker);
                2
            }
            Msg::Heartbeat => 3,
            Msg::Credit { slots } => {
                w.u32(*slots);
                4
            }
            Msg::Assign { request, stage, priority, attempt, data, resume_step, resume } => {
                w.u64(*request);
                stage.encode(&mut w);
                priority.encode(&mut w);
                w.u32(*attempt).bytes(data).u32(*resume_step).bytes(resume);
                5
            }
            Msg::Result { request, stage, ending, reason, data } => {
                w.u64(*request);
                stage.encode(&mut w);
                let tag = match ending {
                    Ending::Failed => 0,
                    Ending::Done => 1,
                    Ending::LostInput => 2,
                };
                w.u8(tag).str(clip(reason)).bytes(data);
                6
            }
            Msg::Submit { request, priority, deadline_ms, start, data, resume_step, resume } => {
                w.u64(*request);
                priority.encode(&mut w);
                w.u64(*deadline_ms);
                start.encode(&mut w);
                w.bytes(data).u32(*resume_step).bytes(resume);
                7
            }
            Msg::Outcome { request, ok, reason } => {
                w.u64(*request).u8(u8::from(*ok)).str(clip(reason));
                8
            }
            Msg::Release { request, held } => {
                w.u64(*request);
                put_held(&mut w, held);
                9
            }
            Msg::Released { request } => {
                w.u64(*request);
                10
            }
            Msg::Announce { request, stage, data } => {
                w.u64(*request);
                stage.encode(&mut w);
                w.bytes(data);
                11
            }
            Msg::Holding { request, stage, attempt } => {
                w.u64(*request);
                stage.encode(&mut w);
                w.u32(*attempt);
                12
            }
            Msg::Ack { request, stage } => {
                w.u64(*request);
                stage.encode(&mut w);
                13
            }
            Msg::Resume { request, priority, start, data, resume_step, resume } => {
                w.u64(*request);
                priority.encode(&mut w);
                start.encode(&mut w);
                w.bytes(data).u32(*resume_step).bytes(resume);
                14
            }
            Msg::Checkpoint { request, stage, step, data } => {
                w.u64(*request);
                stage.encode(&mut w);
                w.u32(*step).bytes(data);
                15
            }
            Msg::Yield { request, stage } => {
                w.u64(*request);
                stage.encode(&mut w);
                16
            }
            Msg::Yielded { request, stage, step, data } => {
                w.u64(*request);
                stage.encode(&mut w);
                w.u32(*step).bytes(data);
                17
            }
            Msg::Drain => 18,
            Msg::Drained => 19,
            Msg::AskTimeline { request } => {
                w.u64(*request);
                20
            }
            Msg::TimelineIs { request, timeline } => {
                w.u64(*request);
                match timeline {
                    Some(t) => {
                        w.u8(1);
                        t.encode(&mut w);
                    }
                    None => {
                        w.u8(0);
                    }
                }
                21
            }
            Msg::Handoff { request, stage, bytes, micros } => {
                w.u64(*request);
                stage.encode(&mut w);
                w.u64(*bytes).u64(*micros);
                22
            }
            Msg::Switch { stage } => {
                stage.encode(&mut w);
                23
            }
        };
        (kind, w.finish())
    }

    /// The whole frame (header + body).
    pub fn encode(&self) -> Result<Vec<u8>> {
        let (kind, body) = self.encode_body();
        FRAMING.encode(kind, &body)
    }

    /// Decodes a body of `kind`. Never panics.
    pub fn decode(kind: u8, p: &[u8]) -> Result<Msg> {
        let mut r = Reader::new(p, "orchestrator message");
        let m = match kind {
            1 => {
                let role = match r.u8()? {
                    1 => {
                        let stage = Stage::decode(&mut r)?;
                        let slots = r.u32()?;
                        let host = r.str(MAX_TEXT, "host")?;
                        let n = r.count(MAX_LABELS, "labels")?;
                        let labels =
                            (0..n).map(|_| r.str(MAX_TEXT, "label")).collect::<Result<_>>()?;
                        let n = r.count(Stage::ALL.len(), "stages a worker can serve")?;
                        let can = (0..n)
                            .map(|_| Ok((Stage::decode(&mut r)?, Duration::from_millis(r.u64()?))))
                            .collect::<Result<_>>()?;
                        let switched = match r.u8()? {
                            0 => None,
                            1 => Some(Duration::from_millis(r.u64()?)),
                            t => {
                                return Err(Error::protocol(format!(
                                    "orchestrator: switched flag {t}"
                                )));
                            }
                        };
                        Role::Worker { stage, slots, host, labels, can, switched }
                    }
                    2 => Role::Submitter,
                    t => return Err(Error::protocol(format!("orchestrator: unknown role {t}"))),
                };
                Msg::Hello { role }
            }
            2 => Msg::Welcome { worker: r.u64()? },
            3 => Msg::Heartbeat,
            4 => Msg::Credit { slots: r.u32()? },
            5 => Msg::Assign {
                request: r.u64()?,
                stage: Stage::decode(&mut r)?,
                priority: Priority::decode(&mut r)?,
                attempt: r.u32()?,
                data: r.bytes(MAX_DATA, "data")?.to_vec(),
                resume_step: r.u32()?,
                resume: r.bytes(MAX_DATA, "resume")?.to_vec(),
            },
            6 => Msg::Result {
                request: r.u64()?,
                stage: Stage::decode(&mut r)?,
                ending: match r.u8()? {
                    0 => Ending::Failed,
                    1 => Ending::Done,
                    2 => Ending::LostInput,
                    t => return Err(Error::protocol(format!("orchestrator: unknown ending {t}"))),
                },
                reason: r.str(MAX_TEXT, "reason")?,
                data: r.bytes(MAX_DATA, "data")?.to_vec(),
            },
            7 => Msg::Submit {
                request: r.u64()?,
                priority: Priority::decode(&mut r)?,
                deadline_ms: r.u64()?,
                start: Stage::decode(&mut r)?,
                data: r.bytes(MAX_DATA, "data")?.to_vec(),
                resume_step: r.u32()?,
                resume: r.bytes(MAX_DATA, "resume")?.to_vec(),
            },
            8 => Msg::Outcome {
                request: r.u64()?,
                ok: r.u8()? != 0,
                reason: r.str(MAX_TEXT, "reason")?,
            },
            9 => Msg::Release { request: r.u64()?, held: get_held(&mut r)? },
            10 => Msg::Released { request: r.u64()? },
            11 => Msg::Announce {
                request: r.u64()?,
                stage: Stage::decode(&mut r)?,
                data: r.bytes(MAX_DATA, "data")?.to_vec(),
            },
            12 => {
                Msg::Holding { request: r.u64()?, stage: Stage::decode(&mut r)?, attempt: r.u32()? }
            }
            13 => Msg::Ack { request: r.u64()?, stage: Stage::decode(&mut r)? },
            14 => Msg::Resume {
                request: r.u64()?,
                priority: Priority::decode(&mut r)?,
                start: Stage::decode(&mut r)?,
                data: r.bytes(MAX_DATA, "data")?.to_vec(),
                resume_step: r.u32()?,
                resume: r.bytes(MAX_DATA, "resume")?.to_vec(),
            },
            15 => Msg::Checkpoint {
                request: r.u64()?,
                stage: Stage::decode(&mut r)?,
                step: r.u32()?,
                data: r.bytes(MAX_DATA, "data")?.to_vec(),
            },
            16 => Msg::Yield { request: r.u64()?, stage: Stage::decode(&mut r)? },
            17 => Msg::Yielded {
                request: r.u64()?,
                stage: Stage::decode(&mut r)?,
                step: r.u32()?,
                data: r.bytes(MAX_DATA, "data")?.to_vec(),
            },
            18 => Msg::Drain,
            19 => Msg::Drained,
            20 => Msg::AskTimeline { request: r.u64()? },
            21 => Msg::TimelineIs {
                request: r.u64()?,
                timeline: match r.u8()? {
                    0 => None,
                    1 => Some(Timeline::decode(&mut r)?),
                    t => return Err(Error::protocol(format!("orchestrator: timeline flag {t}"))),
                },
            },
            22 => Msg::Handoff {
                request: r.u64()?,
                stage: Stage::decode(&mut r)?,
                bytes: r.u64()?,
                micros: r.u64()?,
            },
            23 => Msg::Switch { stage: Stage::decode(&mut r)? },
            k => return Err(Error::protocol(format!("orchestrator: unknown message kind {k}"))),
        };
        r.finish()?;
        Ok(m)
    }
}

/// Writes every message of `rx` to `wr` until either side closes, then ends the stream.
pub(crate) async fn write_msgs(
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    mut rx: tokio::sync::mpsc::Receiver<Msg>,
) {
    use tokio::io::AsyncWriteExt;
    while let Some(m) = rx.recv().await {
        let Ok(frame) = m.encode() else { break };
        if wr.write_all(&frame).await.is_err() {
            break;
        }
    }
    let _ = wr.shutdown().await;
}

/// Reads one message from `s`; `Ok(None)` at a clean end of stream. A handshake `Reject` is
/// [`Error::AccessDenied`] with the server's reason.
pub async fn read_msg(s: &mut (impl tokio::io::AsyncRead + Unpin)) -> Result<Option<Msg>> {
    match FRAMING.read(s).await? {
        None => Ok(None),
        Some((tensorwire_proto::wire::handshake::REJECT, reason)) => {
            Err(Error::AccessDenied(format!("orchestrator: {}", String::from_utf8_lossy(&reason))))
        }
        Some((kind, body)) => Msg::decode(kind, &body).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        let msgs = [
            Msg::Hello {
                role: Role::Worker {
                    stage: Stage::Decode,
                    slots: 2,
                    host: "h".into(),
                    labels: vec!["rail0".into()],
                    can: vec![(Stage::Denoise, Duration::from_millis(2500))],
                    switched: Some(Duration::from_millis(31)),
                },
            },
            Msg::Hello { role: Role::Submitter },
            Msg::Welcome { worker: 3 },
            Msg::Credit { slots: 4 },
            Msg::Assign {
                request: 9,
                stage: Stage::Denoise,
                priority: Priority::Batch,
                attempt: 2,
                data: vec![1, 2],
                resume_step: 20,
                resume: vec![3],
            },
            Msg::Checkpoint { request: 9, stage: Stage::Denoise, step: 20, data: vec![3] },
            Msg::Result {
                request: 9,
                stage: Stage::Denoise,
                ending: Ending::LostInput,
                reason: "oom".into(),
                data: vec![],
            },
            Msg::Submit {
                request: 1,
                priority: Priority::Interactive,
                deadline_ms: 5,
                start: Stage::Denoise,
                data: b"cached".to_vec(),
                resume_step: 12,
                resume: b"cp".to_vec(),
            },
            Msg::Outcome { request: 1, ok: true, reason: String::new() },
            Msg::Release { request: 4, held: vec![vec![5; 3], vec![]] },
            Msg::Released { request: 4 },
            Msg::Announce { request: 4, stage: Stage::Encode, data: vec![6, 7] },
            Msg::Holding { request: 4, stage: Stage::Denoise, attempt: 2 },
            Msg::Ack { request: 4, stage: Stage::Decode },
            Msg::Resume {
                request: 4,
                priority: Priority::Batch,
                start: Stage::Encode,
                data: vec![],
                resume_step: 0,
                resume: vec![],
            },
            Msg::Yield { request: 4, stage: Stage::Denoise },
            Msg::Yielded { request: 4, stage: Stage::Denoise, step: 7, data: vec![8] },
            Msg::Drain,
            Msg::Drained,
            Msg::Heartbeat,
            Msg::AskTimeline { request: 4 },
            Msg::Handoff { request: 4, stage: Stage::Decode, bytes: 1 << 20, micros: 350 },
            Msg::Switch { stage: Stage::Encode },
            Msg::TimelineIs { request: 4, timeline: None },
            Msg::TimelineIs {
                request: 4,
                timeline: Some(crate::timeline::Timeline {
                    request: 4,
                    priority: Priority::Interactive,
                    events: vec![crate::timeline::Event {
                        at: std::time::Duration::from_micros(5),
                        stage: Some(Stage::Decode),
                        mark: crate::timeline::Mark::Dispatched { worker: 3 },
                    }],
                }),
            },
        ];
        for m in msgs {
            let f = m.encode().unwrap();
            let (k, body) = FRAMING.decode(&f).unwrap();
            assert_eq!(Msg::decode(k, body).unwrap(), m);
        }
    }

    proptest! {
        #[test]
        fn decoders_are_total(kind in any::<u8>(), bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Msg::decode(kind, &bytes);
            let _ = FRAMING.decode(&bytes);
        }
    }
}
