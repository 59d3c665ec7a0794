//! The orchestrator's journal, sans-IO: the facts that decide where every request is
//! ([`Fact`]), their byte form (each record length-prefixed and checksummed, decoded by a total
//! function), and [`Book`], the fold of a sequence of facts into the state a restarted
//! orchestrator resumes from. The service writes the facts to a file (`service::logfile`); the
//! [`crate::Driver`] produces them and rebuilds itself from a book.
//!
//! What is recorded: submissions, dispatches (for the try number), accepted results with their
//! outputs, lost inputs (the stage before runs again), announced outputs, checkpoints, yields
//! (a preempted or drained job given back), ends, and releases.
//! A compacted journal is one [`Fact::State`] per request still of interest plus the recent
//! outcomes, which replays to the same book.

use std::collections::{BTreeMap, HashMap, VecDeque};

use tensorwire_core::{Error, Result};
use tensorwire_proto::wire::codec::{Reader, Writer};

use crate::sched::{ItemKey, Outcome};
use crate::{Priority, Stage};

/// Largest record body.
pub const MAX_RECORD: usize = 4 << 20;
/// Largest opaque output in a record (the service protocol's bound).
pub const MAX_DATA: usize = crate::service::wire::MAX_DATA;
/// Most outputs one request's state lists.
pub const MAX_OUTPUTS: usize = 64;
/// Longest failure reason kept.
pub const MAX_REASON: usize = 1024;
/// Ended requests whose outcome a book remembers (for a submitter that asks again after a
/// reconnect).
pub const RECENT: usize = 4096;
/// Bytes before each record body: its length and its CRC-32C.
pub const RECORD_HEADER: usize = 8;

/// One fact about a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fact {
    /// A request was accepted.
    Submitted {
        /// Request.
        request: u64,
        /// Class.
        priority: Priority,
        /// The stage it starts at.
        start: Stage,
        /// That stage's inputs, given with the request (empty when it starts at the first).
        inputs: Vec<u8>,
    },
    /// An item was handed to a worker on its `attempt`.
    Dispatched {
        /// Item.
        key: ItemKey,
        /// Try number.
        attempt: u32,
    },
    /// A stage's result was accepted; `outputs` are the next stage's inputs.
    Accepted {
        /// Item.
        key: ItemKey,
        /// What it reported.
        outputs: Vec<u8>,
    },
    /// The stage at `key` found its input gone: the stage before runs again.
    LostInput {
        /// Item that lost its input.
        key: ItemKey,
    },
    /// A worker said the item will output `data` (released with the request).
    Announced {
        /// Request.
        request: u64,
        /// The announced outputs.
        data: Vec<u8>,
    },
    /// The request ended.
    Ended(Outcome),
    /// The request's outputs were released.
    Released {
        /// Request.
        request: u64,
    },
    /// The worker running `key` saved its state at `step` as `data`: a next try resumes there.
    Checkpointed {
        /// Item.
        key: ItemKey,
        /// Step reached.
        step: u32,
        /// The saved state's reference.
        data: Vec<u8>,
    },
    /// The worker running `key` gave it back at a step boundary (after its checkpoint): it waits
    /// in the queue, handed to nobody.
    Yielded {
        /// Item.
        key: ItemKey,
    },
    /// The request's start stage resumes from this checkpoint, given with the request (edit and
    /// resume from an earlier request's checkpoint): not the request's own, never released.
    ResumeFrom {
        /// Request.
        request: u64,
        /// The checkpoint's step.
        step: u32,
        /// The saved state's reference.
        data: Vec<u8>,
    },
    /// Everything about one request at once (what compaction writes).
    State {
        /// Request.
        request: u64,
        /// Its state.
        entry: Entry,
    },
}

/// Where one request is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Class.
    pub priority: Priority,
    /// The stage it started at, and that stage's inputs given with the request (never
    /// released: they are not the request's, e.g. a cache entry).
    pub start: (Stage, Vec<u8>),
    /// The stage it waits for or runs (meaningless once ended).
    pub stage: Stage,
    /// That stage's try number.
    pub attempt: u32,
    /// Whether that try was handed to a worker (it may still run it).
    pub dispatched: bool,
    /// Re-runs after lost inputs.
    pub reruns: u32,
    /// Accepted outputs in order, by the stage that reported them.
    pub outputs: Vec<(Stage, Vec<u8>)>,
    /// Outputs announced before they existed (checkpoints too: released with the request).
    pub announced: Vec<Vec<u8>>,
    /// The current stage's last checkpoint: the step and the saved state's reference.
    pub checkpoint: Option<(u32, Vec<u8>)>,
    /// How it ended, once it has (its outputs then wait to be released).
    pub ended: Option<Outcome>,
}

impl Entry {
    fn new(priority: Priority, start: Stage, inputs: Vec<u8>) -> Entry {
        Entry {
            priority,
            start: (start, inputs),
            stage: start,
            attempt: 1,
            dispatched: false,
            reruns: 0,
            outputs: Vec::new(),
            announced: Vec::new(),
            checkpoint: None,
            ended: None,
        }
    }

    /// Every output to release once the request ends: the accepted ones and the announced ones
    /// not among them.
    pub fn to_release(&self) -> Vec<Vec<u8>> {
        release_list(self.outputs.iter().map(|(_, o)| o.clone()).collect(), &self.announced)
    }
}

/// `outputs` followed by each of `announced` not already in it.
pub(crate) fn release_list(mut outputs: Vec<Vec<u8>>, announced: &[Vec<u8>]) -> Vec<Vec<u8>> {
    for a in announced {
        if !outputs.contains(a) {
            outputs.push(a.clone());
        }
    }
    outputs
}

/// The state a journal replays to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Book {
    /// Requests in flight, or ended with outputs not yet released.
    pub entries: BTreeMap<u64, Entry>,
    /// The last [`RECENT`] requests that ended and need nothing more, oldest first.
    pub recent: VecDeque<Outcome>,
}

impl Book {
    /// Applies one fact. Facts about unknown requests (their start was compacted away, or
    /// never written) are ignored, except an end, which is remembered as recent.
    pub fn apply(&mut self, f: &Fact) {
        match f {
            Fact::Submitted { request, priority, start, inputs } => {
                self.entries
                    .entry(*request)
                    .or_insert_with(|| Entry::new(*priority, *start, inputs.clone()));
            }
            Fact::Dispatched { key, attempt } => {
                if let Some(e) = self.live(key.request).filter(|e| e.stage == key.stage) {
                    (e.attempt, e.dispatched) = (*attempt, true);
                }
            }
            Fact::Accepted { key, outputs } => {
                if let Some(e) = self.live(key.request) {
                    if !outputs.is_empty() && e.outputs.len() < MAX_OUTPUTS {
                        e.outputs.push((key.stage, outputs.clone()));
                    }
                    if let Some(next) = key.stage.next() {
                        (e.stage, e.attempt, e.dispatched) = (next, 1, false);
                    }
                    e.checkpoint = None;
                }
            }
            Fact::LostInput { key } => {
                if let (Some(e), Some(prev)) = (self.live(key.request), key.stage.prev()) {
                    (e.stage, e.attempt, e.reruns) = (prev, 1, e.reruns.saturating_add(1));
                    (e.dispatched, e.checkpoint) = (false, None);
                }
            }
            Fact::Announced { request, data } => {
                if let Some(e) = self.entries.get_mut(request) {
                    if !e.announced.contains(data) && e.announced.len() < MAX_OUTPUTS {
                        e.announced.push(data.clone());
                    }
                }
            }
            Fact::Checkpointed { key, step, data } => {
                if let Some(e) = self.live(key.request).filter(|e| e.stage == key.stage) {
                    e.checkpoint = Some((*step, data.clone()));
                    if !data.is_empty()
                        && !e.announced.contains(data)
                        && e.announced.len() < MAX_OUTPUTS
                    {
                        e.announced.push(data.clone());
                    }
                }
            }
            Fact::Yielded { key } => {
                if let Some(e) = self.live(key.request).filter(|e| e.stage == key.stage) {
                    e.dispatched = false;
                }
            }
            Fact::ResumeFrom { request, step, data } => {
                if let Some(e) = self.live(*request).filter(|e| e.stage == e.start.0) {
                    e.checkpoint = Some((*step, data.clone()));
                }
            }
            Fact::Ended(o) => match self.entries.get_mut(&o.request()) {
                Some(e) if e.ended.is_none() => {
                    e.ended = Some(o.clone());
                    if e.to_release().is_empty() {
                        self.retire(o.request());
                    }
                }
                Some(_) => {}
                None => self.remember(o.clone()),
            },
            Fact::Released { request } => {
                if self.entries.get(request).is_some_and(|e| e.ended.is_some()) {
                    self.retire(*request);
                }
            }
            Fact::State { request, entry } => {
                self.entries.insert(*request, entry.clone());
            }
        }
    }

    fn live(&mut self, request: u64) -> Option<&mut Entry> {
        self.entries.get_mut(&request).filter(|e| e.ended.is_none())
    }

    fn retire(&mut self, request: u64) {
        if let Some(o) = self.entries.remove(&request).and_then(|e| e.ended) {
            self.remember(o);
        }
    }

    fn remember(&mut self, o: Outcome) {
        if self.recent.len() >= RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(o);
    }

    /// The recent outcomes by request.
    pub fn recent_by_request(&self) -> HashMap<u64, Outcome> {
        self.recent.iter().map(|o| (o.request(), o.clone())).collect()
    }

    /// The records of [`Book::snapshot`], as a compacted journal holds them.
    pub fn snapshot_bytes(&self) -> Vec<u8> {
        self.snapshot().iter().flat_map(Fact::encode).collect()
    }

    /// The facts a compacted journal holds: they replay to this book.
    pub fn snapshot(&self) -> Vec<Fact> {
        let recent = self.recent.iter().cloned().map(Fact::Ended);
        let states =
            self.entries.iter().map(|(&request, e)| Fact::State { request, entry: e.clone() });
        recent.chain(states).collect()
    }
}

fn put_key(w: &mut Writer, k: ItemKey) {
    w.u64(k.request);
    k.stage.encode(w);
}

fn get_key(r: &mut Reader<'_>) -> Result<ItemKey> {
    Ok(ItemKey { request: r.u64()?, stage: Stage::decode(r)? })
}

fn clip(s: &str) -> &str {
    let mut end = s.len().min(MAX_REASON);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn put_outcome(w: &mut Writer, o: &Outcome) {
    match o {
        Outcome::Completed { request } => w.u64(*request).u8(1).str(""),
        Outcome::Failed { request, reason } => w.u64(*request).u8(0).str(clip(reason)),
    };
}

fn get_outcome(r: &mut Reader<'_>) -> Result<Outcome> {
    let request = r.u64()?;
    let ok = r.u8()?;
    let reason = r.str(MAX_REASON, "reason")?;
    match ok {
        1 => Ok(Outcome::Completed { request }),
        0 => Ok(Outcome::Failed { request, reason }),
        t => Err(Error::protocol(format!("journal: unknown outcome tag {t}"))),
    }
}

impl Fact {
    /// The record body.
    pub fn encode_body(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Fact::Submitted { request, priority, start, inputs } => {
                w.u8(1).u64(*request);
                priority.encode(&mut w);
                start.encode(&mut w);
                w.bytes(&inputs[..inputs.len().min(MAX_DATA)]);
            }
            Fact::Dispatched { key, attempt } => {
                w.u8(2);
                put_key(&mut w, *key);
                w.u32(*attempt);
            }
            Fact::Accepted { key, outputs } => {
                w.u8(3);
                put_key(&mut w, *key);
                w.bytes(&outputs[..outputs.len().min(MAX_DATA)]);
            }
            Fact::LostInput { key } => {
                w.u8(4);
                put_key(&mut w, *key);
            }
            Fact::Announced { request, data } => {
                w.u8(5).u64(*request).bytes(&data[..data.len().min(MAX_DATA)]);
            }
            Fact::Ended(o) => {
                w.u8(6);
                put_outcome(&mut w, o);
            }
            Fact::Released { request } => {
                w.u8(7).u64(*request);
            }
            Fact::Checkpointed { key, step, data } => {
                w.u8(9);
                put_key(&mut w, *key);
                w.u32(*step).bytes(&data[..data.len().min(MAX_DATA)]);
            }
            Fact::Yielded { key } => {
                w.u8(10);
                put_key(&mut w, *key);
            }
            Fact::ResumeFrom { request, step, data } => {
                w.u8(11).u64(*request).u32(*step).bytes(&data[..data.len().min(MAX_DATA)]);
            }
            Fact::State { request, entry: e } => {
                w.u8(8).u64(*request);
                e.priority.encode(&mut w);
                e.start.0.encode(&mut w);
                w.bytes(&e.start.1[..e.start.1.len().min(MAX_DATA)]);
                e.stage.encode(&mut w);
                w.u32(e.attempt).bool(e.dispatched).u32(e.reruns);
                w.u32(e.outputs.len().min(MAX_OUTPUTS) as u32);
                for (s, o) in e.outputs.iter().take(MAX_OUTPUTS) {
                    s.encode(&mut w);
                    w.bytes(&o[..o.len().min(MAX_DATA)]);
                }
                w.u32(e.announced.len().min(MAX_OUTPUTS) as u32);
                for a in e.announced.iter().take(MAX_OUTPUTS) {
                    w.bytes(&a[..a.len().min(MAX_DATA)]);
                }
                w.opt(e.checkpoint.as_ref(), |w, (step, d)| {
                    w.u32(*step).bytes(&d[..d.len().min(MAX_DATA)]);
                });
                w.opt(e.ended.as_ref(), put_outcome);
            }
        }
        w.finish()
    }

    /// Decodes a record body. Never panics.
    pub fn decode_body(b: &[u8]) -> Result<Fact> {
        let mut r = Reader::new(b, "journal record");
        let data = |r: &mut Reader<'_>| Ok::<_, Error>(r.bytes(MAX_DATA, "outputs")?.to_vec());
        let f = match r.u8()? {
            1 => Fact::Submitted {
                request: r.u64()?,
                priority: Priority::decode(&mut r)?,
                start: Stage::decode(&mut r)?,
                inputs: data(&mut r)?,
            },
            2 => Fact::Dispatched { key: get_key(&mut r)?, attempt: r.u32()? },
            3 => Fact::Accepted { key: get_key(&mut r)?, outputs: data(&mut r)? },
            4 => Fact::LostInput { key: get_key(&mut r)? },
            5 => Fact::Announced { request: r.u64()?, data: data(&mut r)? },
            6 => Fact::Ended(get_outcome(&mut r)?),
            7 => Fact::Released { request: r.u64()? },
            8 => {
                let request = r.u64()?;
                let priority = Priority::decode(&mut r)?;
                let start = (Stage::decode(&mut r)?, data(&mut r)?);
                let stage = Stage::decode(&mut r)?;
                let attempt = r.u32()?;
                let dispatched = r.bool("dispatched")?;
                let reruns = r.u32()?;
                let n = r.count(MAX_OUTPUTS, "outputs")?;
                let outputs = (0..n)
                    .map(|_| Ok((Stage::decode(&mut r)?, data(&mut r)?)))
                    .collect::<Result<Vec<_>>>()?;
                let n = r.count(MAX_OUTPUTS, "announced")?;
                let announced = (0..n).map(|_| data(&mut r)).collect::<Result<Vec<_>>>()?;
                let checkpoint = r.opt("checkpoint", |r| {
                    Ok((r.u32()?, r.bytes(MAX_DATA, "checkpoint")?.to_vec()))
                })?;
                let ended = r.opt("ended", get_outcome)?;
                let entry = Entry {
                    priority,
                    start,
                    stage,
                    attempt,
                    dispatched,
                    reruns,
                    outputs,
                    announced,
                    checkpoint,
                    ended,
                };
                Fact::State { request, entry }
            }
            9 => Fact::Checkpointed { key: get_key(&mut r)?, step: r.u32()?, data: data(&mut r)? },
            10 => Fact::Yielded { key: get_key(&mut r)? },
            11 => Fact::ResumeFrom { request: r.u64()?, step: r.u32()?, data: data(&mut r)? },
            t => return Err(Error::protocol(format!("journal: unknown record tag {t}"))),
        };
        r.finish()?;
        Ok(f)
    }

    /// The whole record: body length, CRC-32C of the body, body.
    pub fn encode(&self) -> Vec<u8> {
        let body = self.encode_body();
        let mut out = Vec::with_capacity(RECORD_HEADER + body.len());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }
}

/// What [`replay`] found.
#[derive(Debug, Default)]
pub struct Replayed {
    /// The facts, in order.
    pub facts: Vec<Fact>,
    /// Bytes of whole, valid records from the start (where the next record goes).
    pub valid: usize,
    /// Why reading stopped before the end, if it did (a torn or corrupt record; nothing after
    /// it is trusted).
    pub stopped: Option<String>,
}

/// Reads the records of `b` in order, stopping at the first torn or corrupt one. Never panics.
pub fn replay(b: &[u8]) -> Replayed {
    let mut out = Replayed::default();
    let mut at = 0usize;
    while at < b.len() {
        let Some(head) = b.get(at..at + RECORD_HEADER) else {
            out.stopped = Some(format!("a torn record header at byte {at}"));
            break;
        };
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if len > MAX_RECORD {
            out.stopped = Some(format!("a record of {len} bytes at byte {at}"));
            break;
        }
        let Some(body) = b.get(at + RECORD_HEADER..at + RECORD_HEADER + len) else {
            out.stopped = Some(format!("a torn record at byte {at}"));
            break;
        };
        if crc32c::crc32c(body) != crc {
            out.stopped = Some(format!("a record with a bad checksum at byte {at}"));
            break;
        }
        match Fact::decode_body(body) {
            Ok(f) => out.facts.push(f),
            Err(e) => {
                out.stopped = Some(format!("an unreadable record at byte {at}: {e}"));
                break;
            }
        }
        at += RECORD_HEADER + len;
        out.valid = at;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(request: u64, stage: Stage) -> ItemKey {
        ItemKey { request, stage }
    }

    fn arb_fact() -> impl Strategy<Value = Fact> {
        let stage = (0usize..3).prop_map(|i| Stage::ALL[i]);
        let pri =
            any::<bool>().prop_map(|b| if b { Priority::Interactive } else { Priority::Batch });
        let data = proptest::collection::vec(any::<u8>(), 0..6);
        let outcome = (0u64..6, any::<bool>()).prop_map(|(request, ok)| {
            if ok {
                Outcome::Completed { request }
            } else {
                Outcome::Failed { request, reason: "x".into() }
            }
        });
        prop_oneof![
            (0u64..6, pri, 0usize..2).prop_map(|(request, priority, i)| Fact::Submitted {
                request,
                priority,
                start: Stage::ALL[i],
                inputs: if i == 0 { vec![] } else { b"cached".to_vec() },
            }),
            (0u64..6, stage.clone(), 1u32..4)
                .prop_map(|(r, s, attempt)| Fact::Dispatched { key: key(r, s), attempt }),
            (0u64..6, stage.clone(), data.clone())
                .prop_map(|(r, s, outputs)| Fact::Accepted { key: key(r, s), outputs }),
            (0u64..6, stage).prop_map(|(r, s)| Fact::LostInput { key: key(r, s) }),
            (0u64..6, data).prop_map(|(request, data)| Fact::Announced { request, data }),
            outcome.prop_map(Fact::Ended),
            (0u64..6).prop_map(|request| Fact::Released { request }),
            (0u64..6, 0usize..3, 0u32..50, proptest::collection::vec(any::<u8>(), 0..6)).prop_map(
                |(r, s, step, data)| Fact::Checkpointed { key: key(r, Stage::ALL[s]), step, data }
            ),
            (0u64..6, 0usize..3).prop_map(|(r, s)| Fact::Yielded { key: key(r, Stage::ALL[s]) }),
            (0u64..6, 0u32..50, proptest::collection::vec(any::<u8>(), 0..6))
                .prop_map(|(request, step, data)| Fact::ResumeFrom { request, step, data }),
        ]
    }

    #[test]
    fn a_request_moves_through_its_stages_and_retires_once_released() {
        let mut b = Book::default();
        let facts = [
            Fact::Submitted {
                request: 1,
                priority: Priority::Batch,
                start: Stage::Encode,
                inputs: vec![],
            },
            Fact::Dispatched { key: key(1, Stage::Encode), attempt: 1 },
            Fact::Accepted { key: key(1, Stage::Encode), outputs: b"emb".to_vec() },
            Fact::Dispatched { key: key(1, Stage::Denoise), attempt: 2 },
        ];
        facts.iter().for_each(|f| b.apply(f));
        let e = &b.entries[&1];
        assert_eq!((e.stage, e.attempt, e.outputs.len()), (Stage::Denoise, 2, 1));
        b.apply(&Fact::Accepted { key: key(1, Stage::Denoise), outputs: b"lat".to_vec() });
        b.apply(&Fact::LostInput { key: key(1, Stage::Decode) });
        let e = &b.entries[&1];
        assert_eq!((e.stage, e.attempt, e.reruns), (Stage::Denoise, 1, 1), "denoise re-runs");
        b.apply(&Fact::Ended(Outcome::Completed { request: 1 }));
        assert_eq!(b.entries[&1].to_release(), vec![b"emb".to_vec(), b"lat".to_vec()]);
        b.apply(&Fact::Released { request: 1 });
        assert!(b.entries.is_empty());
        assert_eq!(b.recent_by_request()[&1], Outcome::Completed { request: 1 });
    }

    /// What a book keeps of outputs is bounded and free of repeats: an empty output is none,
    /// an announced output (a checkpoint's reference too) is kept once, and neither list grows
    /// past MAX_OUTPUTS.
    #[test]
    fn outputs_and_announcements_are_kept_once_and_bounded() {
        let mut b = Book::default();
        let start = Stage::Encode;
        b.apply(&Fact::Submitted { request: 1, priority: Priority::Batch, start, inputs: vec![] });
        b.apply(&Fact::Accepted { key: key(1, Stage::Encode), outputs: vec![] });
        assert!(b.entries[&1].outputs.is_empty(), "an empty output is no output");
        for _ in 0..3 {
            b.apply(&Fact::Announced { request: 1, data: b"put".to_vec() });
        }
        assert_eq!(b.entries[&1].announced, vec![b"put".to_vec()], "announced once");
        let cp = |step, data: &[u8]| Fact::Checkpointed {
            key: key(1, Stage::Denoise),
            step,
            data: data.to_vec(),
        };
        b.apply(&cp(4, b"put")); // the same reference: not again
        b.apply(&cp(5, b"ckpt"));
        b.apply(&cp(6, b"ckpt"));
        b.apply(&cp(7, b""));
        assert_eq!(b.entries[&1].announced, vec![b"put".to_vec(), b"ckpt".to_vec()]);
        assert_eq!(b.entries[&1].checkpoint, Some((7, vec![])));
        for i in 0..2 * MAX_OUTPUTS as u32 {
            b.apply(&Fact::Announced { request: 1, data: i.to_le_bytes().to_vec() });
            b.apply(&cp(8 + i, &(i + 1000).to_le_bytes()));
        }
        assert_eq!(b.entries[&1].announced.len(), MAX_OUTPUTS);
        for i in 0..2 * MAX_OUTPUTS as u32 {
            b.apply(&Fact::Accepted {
                key: key(1, Stage::Denoise),
                outputs: i.to_le_bytes().to_vec(),
            });
        }
        assert_eq!(b.entries[&1].outputs.len(), MAX_OUTPUTS);
        // A request ends once: a later outcome (a late report) does not replace the first.
        b.apply(&Fact::Ended(Outcome::Completed { request: 1 }));
        b.apply(&Fact::Ended(Outcome::Failed { request: 1, reason: "late".into() }));
        assert_eq!(b.entries[&1].ended, Some(Outcome::Completed { request: 1 }));
    }

    /// A record's length is checked against MAX_RECORD before its bytes are looked at: one of
    /// MAX_RECORD bytes is read (and found unreadable here), one byte more stops the replay at
    /// its header, however many bytes follow.
    #[test]
    fn replay_bounds_a_record_at_max_record_inclusive() {
        let record = |len: usize, body: &[u8]| {
            let mut b = (len as u32).to_le_bytes().to_vec();
            b.extend(crc32c::crc32c(body).to_le_bytes());
            b.extend(body);
            b
        };
        let zeros = vec![0u8; MAX_RECORD];
        let at_bound = replay(&record(MAX_RECORD, &zeros));
        assert!(at_bound.stopped.as_deref().unwrap().contains("unreadable record"), "{at_bound:?}");
        let mut past = vec![0u8; MAX_RECORD + 1];
        past[..MAX_RECORD].copy_from_slice(&zeros);
        let over = replay(&record(MAX_RECORD + 1, &past));
        assert!(over.stopped.as_deref().unwrap().contains("a record of"), "{:?}", over.stopped);
        let huge = replay(&record(u32::MAX as usize, &[]));
        assert!(huge.stopped.as_deref().unwrap().contains("a record of"), "{:?}", huge.stopped);
    }

    #[test]
    fn a_yield_hands_the_job_to_nobody_and_a_given_checkpoint_is_never_released() {
        let mut b = Book::default();
        let d = key(1, Stage::Denoise);
        let facts = [
            Fact::Submitted {
                request: 1,
                priority: Priority::Batch,
                start: Stage::Denoise,
                inputs: b"emb".to_vec(),
            },
            Fact::ResumeFrom { request: 1, step: 6, data: b"cp of 0".to_vec() },
            Fact::Dispatched { key: d, attempt: 1 },
        ];
        facts.iter().for_each(|f| b.apply(f));
        assert_eq!(b.entries[&1].checkpoint, Some((6, b"cp of 0".to_vec())));
        b.apply(&Fact::Checkpointed { key: d, step: 9, data: b"cp 9".to_vec() });
        b.apply(&Fact::Yielded { key: d });
        let e = &b.entries[&1];
        assert_eq!((e.dispatched, e.attempt), (false, 1), "queued on the same try");
        assert_eq!(e.checkpoint, Some((9, b"cp 9".to_vec())));
        b.apply(&Fact::Ended(Outcome::Completed { request: 1 }));
        assert_eq!(b.entries[&1].to_release(), vec![b"cp 9".to_vec()]);
    }

    #[test]
    fn a_torn_or_corrupt_tail_stops_the_replay_at_the_last_whole_record() {
        let a = Fact::Submitted {
            request: 1,
            priority: Priority::Batch,
            start: Stage::Encode,
            inputs: vec![],
        }
        .encode();
        let b = Fact::Released { request: 1 }.encode();
        let mut all = [a.clone(), b.clone()].concat();
        for cut in 0..all.len() {
            let r = replay(&all[..cut]);
            let want = if cut < a.len() { 0 } else { 1 };
            assert_eq!(r.facts.len(), want, "cut at {cut}");
            assert_eq!(r.valid, if want == 0 { 0 } else { a.len() });
            assert_eq!(r.stopped.is_some(), cut != 0 && cut != a.len());
        }
        let last = all.len() - 1;
        all[last] ^= 1;
        let r = replay(&all);
        assert_eq!((r.facts.len(), r.valid), (1, a.len()));
        assert!(r.stopped.unwrap().contains("checksum"));
    }

    proptest! {
        /// Any fact round-trips through its record.
        #[test]
        fn records_round_trip(f in arb_fact()) {
            let r = replay(&f.encode());
            prop_assert_eq!(r.facts, vec![f]);
        }

        /// The decoders are total.
        #[test]
        fn decoders_are_total(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Fact::decode_body(&bytes);
            let r = replay(&bytes);
            prop_assert!(r.valid <= bytes.len());
        }

        /// A compacted journal replays to the book it was taken from, and facts after it apply
        /// the same way to both.
        #[test]
        fn a_snapshot_replays_to_the_same_book(
            facts in proptest::collection::vec(arb_fact(), 0..80),
            after in proptest::collection::vec(arb_fact(), 0..20),
        ) {
            let mut b = Book::default();
            facts.iter().for_each(|f| b.apply(f));
            let bytes = b.snapshot_bytes();
            let mut c = Book::default();
            replay(&bytes).facts.iter().for_each(|f| c.apply(f));
            prop_assert_eq!(&c, &b);
            after.iter().for_each(|f| { b.apply(f); c.apply(f); });
            prop_assert_eq!(&c, &b);
        }
    }
}
