#![no_main]
//! Structured round trips: the fuzzer's bytes choose a message type and build a value of it field
//! by field (`arbitrary`), and the property is about values rather than bytes: encode never
//! panics, a value the decoder accepts comes back equal, and a well-formed value is always
//! accepted (a tensor exactly when `TensorMeta::check` passes; a payload reference when its tensor is
//! well formed and its store key is within bounds).
use std::net::SocketAddr;
use std::time::Duration;

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_proto::wire::envelope::{Envelope, Message};
use tensorwire_proto::wire::handshake::{Challenge, Open, Proof};
use tensorwire_core::{AccessKey, DType, EngineId, MemoryKind, Permissions, RegionId, RemoteRegion, TensorMeta};
use tensorwire_diffusion::control::{Control, Gone};
use tensorwire_diffusion::{Chunking, LeasePolicy, PayloadKind, PayloadRef, Source};
use tensorwire_orchestrator::service::wire::{Ending, FRAMING, MAX_HELD, Msg, Role};
use tensorwire_orchestrator::timeline::{self, Event, Mark, Timeline};
use tensorwire_orchestrator::{Affinity, Priority, QueueMessage, Stage};
use tensorwire_store::MAX_KEY;
use tensorwire_store::rpc::{Request, Response};
use tensorwire_store::{Retention, StoreStats};

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let _ = one(&mut u);
});

fn one(u: &mut Unstructured<'_>) -> Result<()> {
    match u.int_in_range(0..=8u8)? {
        0 => tensor(u),
        1 => payload_ref(u),
        2 => queue_message(u),
        3 => orchestrator(u),
        4 => store_request(u),
        5 => store_response(u),
        6 => control(u),
        7 => envelope(u),
        _ => handshake(u),
    }
}

/// What the decoder gave back is the value; `must`: it gave something back.
fn comes_back<T: PartialEq + std::fmt::Debug>(value: T, back: Option<T>, must: bool) {
    match back {
        Some(b) => assert_eq!(b, value),
        None => assert!(!must, "a well-formed value did not decode: {value:?}"),
    }
}

/// Mostly small numbers (so tensors are often well formed), sometimes any.
fn num(u: &mut Unstructured<'_>) -> Result<u64> {
    if u.ratio(3, 4)? { u.int_in_range(0..=300) } else { u.arbitrary() }
}

fn text(u: &mut Unstructured<'_>, max: usize) -> Result<String> {
    let s: String = u.arbitrary()?;
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Ok(s[..end].to_string())
}

fn meta(u: &mut Unstructured<'_>) -> Result<TensorMeta> {
    let dtype = *u.choose(DType::all())?;
    let rank = u.int_in_range(0..=4usize)?;
    let mut shape = Vec::with_capacity(rank);
    let mut strides = Vec::with_capacity(rank);
    for _ in 0..rank {
        shape.push(num(u)?);
        strides.push(num(u)?);
    }
    let device = match u.int_in_range(0..=2u8)? {
        0 => MemoryKind::Host,
        1 => MemoryKind::HostPinned,
        _ => MemoryKind::Device { ordinal: u.int_in_range(0..=7)? },
    };
    Ok(TensorMeta { dtype, shape, strides, byte_offset: num(u)?, device })
}

fn decode_meta(b: &[u8]) -> Option<TensorMeta> {
    let mut r = Reader::new(b, "fuzz");
    let m = TensorMeta::decode(&mut r).ok()?;
    r.finish().ok().map(|()| m)
}

fn tensor(u: &mut Unstructured<'_>) -> Result<()> {
    let m = meta(u)?;
    let mut w = Writer::new();
    m.encode(&mut w);
    let back = decode_meta(&w.finish());
    match m.check() {
        Ok(_) => assert_eq!(back, Some(m)),
        Err(_) => assert_eq!(back, None, "an ill-formed tensor decoded"),
    }
    Ok(())
}

fn make_ref(u: &mut Unstructured<'_>) -> Result<PayloadRef> {
    let kind = match u.int_in_range(0..=3u8)? {
        0 => PayloadKind::ConditionEmbedding,
        1 => PayloadKind::Latent,
        2 => PayloadKind::StepLatent { step: u.arbitrary()? },
        _ => PayloadKind::Feature,
    };
    let source = if u.arbitrary()? {
        let len = u.int_in_range(0..=MAX_KEY + 2)?;
        Source::Store { key: u.bytes(len)?.to_vec() }
    } else {
        let ip: [u8; 4] = u.arbitrary()?;
        let blob_len = u.int_in_range(0..=16usize)?;
        Source::P2p {
            addr: SocketAddr::from((ip, u.arbitrary::<u16>()?)),
            payload: u.arbitrary()?,
            region: RemoteRegion {
                engine: EngineId(u.arbitrary()?),
                id: RegionId(u.arbitrary()?),
                key: AccessKey::from_bits(u.arbitrary()?),
                len: u.arbitrary()?,
                kind: MemoryKind::Host,
                perms: Permissions { read: u.arbitrary()?, write: u.arbitrary()? },
                blobs: vec![("tcp".into(), u.bytes(blob_len)?.to_vec().into())],
            },
            offset: u.arbitrary()?,
        }
    };
    let lease = match u.int_in_range(0..=3u8)? {
        0 => LeasePolicy::DeleteOnConsume { consumers: u.int_in_range(1..=u32::MAX)? },
        1 => LeasePolicy::Ttl(Duration::from_millis(u.arbitrary()?)),
        2 => LeasePolicy::SoftPin,
        _ => LeasePolicy::Pinned,
    };
    let chunking = if u.arbitrary()? {
        Some(Chunking { dim: u.arbitrary()?, count: u.arbitrary()? })
    } else {
        None
    };
    Ok(PayloadRef {
        request: u.arbitrary()?,
        kind,
        source,
        meta: meta(u)?,
        chunking,
        lease,
        checksum: u.arbitrary()?,
    })
}

/// Whether the decoders must accept `p` (well-formed tensor, store key within bounds).
fn well_formed(p: &PayloadRef) -> bool {
    let key_ok = match &p.source {
        Source::Store { key } => key.len() <= MAX_KEY,
        Source::P2p { .. } => true,
    };
    key_ok && p.meta.check().is_ok()
}

fn payload_ref(u: &mut Unstructured<'_>) -> Result<()> {
    let p = make_ref(u)?;
    let back = PayloadRef::from_bytes(&p.to_bytes()).ok();
    let must = well_formed(&p);
    comes_back(p, back, must);
    Ok(())
}

fn queue_message(u: &mut Unstructured<'_>) -> Result<()> {
    let n = u.int_in_range(0..=3usize)?;
    let payloads = (0..n).map(|_| make_ref(u)).collect::<Result<Vec<_>>>()?;
    let labels = (0..u.int_in_range(0..=9usize)?).map(|_| text(u, 130)).collect::<Result<_>>()?;
    let host = if u.arbitrary()? { Some(text(u, 130)?) } else { None };
    let m = QueueMessage {
        request: u.arbitrary()?,
        stage: *u.choose(&Stage::ALL)?,
        payloads,
        priority: if u.arbitrary()? { Priority::Interactive } else { Priority::Batch },
        deadline_ms: u.arbitrary()?,
        affinity: Affinity { host, labels },
        attempt: u.arbitrary()?,
    };
    if let Ok(bytes) = m.encode() {
        let must = m.payloads.iter().all(well_formed);
        comes_back(m, QueueMessage::decode(&bytes).ok(), must);
    }
    Ok(())
}

fn orchestrator(u: &mut Unstructured<'_>) -> Result<()> {
    let stage = *u.choose(&Stage::ALL)?;
    let short = |u: &mut Unstructured<'_>| text(u, 1024);
    let data = |u: &mut Unstructured<'_>| -> Result<Vec<u8>> {
        let n = u.int_in_range(0..=64usize)?;
        Ok(u.bytes(n)?.to_vec())
    };
    let held = |u: &mut Unstructured<'_>| -> Result<Vec<Vec<u8>>> {
        (0..u.int_in_range(0..=MAX_HELD)?).map(|_| data(u)).collect()
    };
    let priority = |u: &mut Unstructured<'_>| -> Result<Priority> {
        Ok(if u.arbitrary()? { Priority::Interactive } else { Priority::Batch })
    };
    let m = match u.int_in_range(0..=23u8)? {
        0 => Msg::Hello {
            role: Role::Worker {
                stage,
                slots: u.arbitrary()?,
                host: short(u)?,
                labels: (0..u.int_in_range(0..=8usize)?)
                    .map(|_| short(u))
                    .collect::<Result<_>>()?,
                can: (0..u.int_in_range(0..=3usize)?)
                    .map(|_| Ok((stage, Duration::from_millis(u.arbitrary()?))))
                    .collect::<Result<_>>()?,
                switched: if u.arbitrary()? {
                    Some(Duration::from_millis(u.arbitrary()?))
                } else {
                    None
                },
            },
        },
        1 => Msg::Hello { role: Role::Submitter },
        2 => Msg::Welcome { worker: u.arbitrary()? },
        3 => Msg::Heartbeat,
        4 => Msg::Credit { slots: u.arbitrary()? },
        5 => Msg::Assign {
            request: u.arbitrary()?,
            stage,
            priority: priority(u)?,
            attempt: u.arbitrary()?,
            data: data(u)?,
            resume_step: u.arbitrary()?,
            resume: data(u)?,
        },
        6 => Msg::Result {
            request: u.arbitrary()?,
            stage,
            ending: *u.choose(&[Ending::Failed, Ending::Done, Ending::LostInput])?,
            reason: short(u)?,
            data: data(u)?,
        },
        7 => Msg::Submit {
            request: u.arbitrary()?,
            priority: priority(u)?,
            deadline_ms: u.arbitrary()?,
            start: stage,
            data: data(u)?,
            resume_step: u.arbitrary()?,
            resume: data(u)?,
        },
        8 => Msg::Outcome { request: u.arbitrary()?, ok: u.arbitrary()?, reason: short(u)? },
        9 => Msg::Release { request: u.arbitrary()?, held: held(u)? },
        10 => Msg::Released { request: u.arbitrary()? },
        11 => Msg::Announce { request: u.arbitrary()?, stage, data: data(u)? },
        12 => Msg::Holding { request: u.arbitrary()?, stage, attempt: u.arbitrary()? },
        13 => Msg::Ack { request: u.arbitrary()?, stage },
        14 => Msg::Resume {
            request: u.arbitrary()?,
            priority: priority(u)?,
            start: stage,
            data: data(u)?,
            resume_step: u.arbitrary()?,
            resume: data(u)?,
        },
        15 => Msg::Checkpoint { request: u.arbitrary()?, stage, step: u.arbitrary()?, data: data(u)? },
        16 => Msg::Yield { request: u.arbitrary()?, stage },
        17 => Msg::Yielded { request: u.arbitrary()?, stage, step: u.arbitrary()?, data: data(u)? },
        18 => Msg::Drain,
        19 => Msg::Drained,
        20 => Msg::AskTimeline { request: u.arbitrary()? },
        21 => Msg::Handoff {
            request: u.arbitrary()?,
            stage,
            bytes: u.arbitrary()?,
            micros: u.arbitrary()?,
        },
        22 => Msg::Switch { stage },
        _ => {
            let timeline = if u.arbitrary()? {
                let n = u.int_in_range(0..=timeline::MAX_EVENTS)?;
                let mut events = Vec::with_capacity(n);
                for _ in 0..n {
                    let stage = if u.arbitrary()? { Some(stage) } else { None };
                    let mark = match u.int_in_range(0..=12u8)? {
                        11 => Mark::Yielded,
                        12 => Mark::Requeued,
                        10 => Mark::Handoff { bytes: u.arbitrary()?, micros: u.arbitrary()? },
                        0 => Mark::Submitted,
                        1 => Mark::Restored,
                        2 => Mark::Queued,
                        3 => Mark::Dispatched { worker: u.arbitrary()? },
                        4 => Mark::Announced,
                        5 => Mark::Done,
                        6 => Mark::Failed,
                        7 => Mark::LostInput,
                        k => Mark::Ended { ok: k == 9 },
                    };
                    events.push(Event { at: Duration::from_micros(u.arbitrary()?), stage, mark });
                }
                Some(Timeline { request: u.arbitrary()?, priority: priority(u)?, events })
            } else {
                None
            };
            Msg::TimelineIs { request: u.arbitrary()?, timeline }
        }
    };
    let frame = m.encode().expect("a message within bounds fits a frame");
    let (kind, body) = FRAMING.decode(&frame).expect("own frame decodes");
    assert_eq!(Msg::decode(kind, body).ok(), Some(m));
    Ok(())
}

fn key(u: &mut Unstructured<'_>) -> Result<Vec<u8>> {
    let n = u.int_in_range(1..=MAX_KEY)?;
    Ok(u.bytes(n)?.to_vec())
}

fn store_request(u: &mut Unstructured<'_>) -> Result<()> {
    let r = match u.int_in_range(0..=12u8)? {
        0 => Request::Hello,
        1 => Request::Auth {
            region: RegionId(u.arbitrary()?),
            key: AccessKey::from_bits(u.arbitrary()?),
        },
        2 => Request::Reserve {
            key: key(u)?,
            meta: meta(u)?,
            len: u.arbitrary()?,
            retention: *u.choose(&[Retention::Normal, Retention::Soft, Retention::Pinned])?,
        },
        3 => Request::Commit { ticket: u.arbitrary()? },
        4 => Request::Abort { ticket: u.arbitrary()? },
        5 => Request::Open { key: key(u)? },
        6 => Request::Close { ticket: u.arbitrary()? },
        7 => Request::Exists { key: key(u)? },
        8 => Request::Remove { key: key(u)? },
        9 => Request::Pin { key: key(u)?, up: u.arbitrary()? },
        10 => Request::Stats,
        11 => Request::Lease { key: key(u)?, consumers: u.arbitrary()?, ttl_ms: u.arbitrary()? },
        _ => Request::Consumed { key: key(u)? },
    };
    let (kind, body) = r.encode();
    let must = !matches!(&r, Request::Reserve { meta, .. } if meta.check().is_err());
    comes_back(r, Request::decode(kind, &body).ok(), must);
    Ok(())
}

fn store_response(u: &mut Unstructured<'_>) -> Result<()> {
    let r = match u.int_in_range(0..=5u8)? {
        0 => Response::Done,
        1 => {
            let (ip, port): ([u8; 4], u16) = u.arbitrary()?;
            Response::Pool { region: RegionId(u.arbitrary()?), engine: SocketAddr::from((ip, port)) }
        }
        2 => Response::Reserved { ticket: u.arbitrary()?, offset: u.arbitrary()? },
        3 => {
            let [ticket, offset, len] = u.arbitrary()?;
            Response::Opened { ticket, offset, len, meta: meta(u)? }
        }
        4 => Response::Flag(u.arbitrary()?),
        _ => {
            let [capacity, used, objects, spilled_objects, evictions, largest_free] =
                u.arbitrary()?;
            let s =
                StoreStats { capacity, used, objects, spilled_objects, evictions, largest_free };
            Response::Stats(s)
        }
    };
    let back = Response::decode(tensorwire_store::rpc::OK, &r.encode()).ok().and_then(|x| x.ok());
    let must = !matches!(&r, Response::Opened { meta, .. } if meta.check().is_err());
    comes_back(r, back, must);
    Ok(())
}

fn control(u: &mut Unstructured<'_>) -> Result<()> {
    let payload = u.arbitrary()?;
    let m = match u.int_in_range(0..=3u8)? {
        0 => Control::Subscribe { payload, hold_ms: u.arbitrary()? },
        1 => Control::Ready { payload, index: u.arbitrary()?, crc: u.arbitrary()? },
        2 => Control::Done { payload, consumed: u.arbitrary()? },
        _ => Control::Gone { payload, why: *u.choose(&Gone::ALL)? },
    };
    assert_eq!(Control::decode(&m.encode()).ok().flatten(), Some(m));
    Ok(())
}

fn envelope(u: &mut Unstructured<'_>) -> Result<()> {
    let msg = match u.int_in_range(0..=2u8)? {
        0 => {
            let n = u.int_in_range(0..=256usize)?;
            Message::User(u.bytes(n)?.to_vec().into())
        }
        1 => Message::ChunkLanded { transfer: u.arbitrary()?, index: u.arbitrary()? },
        _ => Message::ChunkAbort { transfer: u.arbitrary()?, reason: text(u, 1024)? },
    };
    let e = Envelope { from: EngineId(u.arbitrary()?), msg };
    let bytes = e.encode().expect("a small envelope encodes");
    assert_eq!(Envelope::decode(&bytes).ok(), Some(e));
    Ok(())
}

fn handshake(u: &mut Unstructured<'_>) -> Result<()> {
    let nonce = u.arbitrary()?;
    let proof: Option<[u8; 32]> = u.arbitrary()?;
    let open = Open { nonce };
    assert_eq!(Open::decode(&open.encode()).ok(), Some(open));
    let ch = Challenge { nonce, proof };
    assert_eq!(Challenge::decode(&ch.encode()).ok(), Some(ch));
    let p = Proof { proof };
    assert_eq!(Proof::decode(&p.encode()).ok(), Some(p));
    Ok(())
}
