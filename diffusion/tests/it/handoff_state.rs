//! Property tests of the connector's sans-IO handoff state machines, driven with random event
//! orders: the publisher hands every buffer back exactly once and tells each subscriber every
//! ready chunk; a fetch reads and yields each chunk exactly once, within its window, and reports
//! only at the end.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use tensorwire_core::EngineId;
use tensorwire_diffusion::control::{Control, Gone, MAX_HOLD};
use tensorwire_diffusion::handoff::{Action, Fetch, FetchStep, Next, Publisher};
use tensorwire_diffusion::{ConnectorError, Lease, LeasePolicy};

#[derive(Debug, Clone)]
enum Op {
    Publish { id: u64, chunks: u32, lease: u8, to_store: bool },
    PublishWhole { id: u64, lease: u8 },
    Mark { id: u64, index: u32 },
    Subscribe { from: u8, id: u64, hold_ms: u64 },
    Done { from: u8, id: u64, consumed: bool },
    Retire { id: u64 },
    Abandon { id: u64 },
    Sweep { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..4, 1u32..5, 0u8..4, any::<bool>())
            .prop_map(|(id, chunks, lease, to_store)| Op::Publish { id, chunks, lease, to_store }),
        (0u64..4, 0u8..4).prop_map(|(id, lease)| Op::PublishWhole { id, lease }),
        (0u64..4, 0u32..5).prop_map(|(id, index)| Op::Mark { id, index }),
        (0u8..3, 0u64..4, 0u64..300).prop_map(|(from, id, hold_ms)| Op::Subscribe {
            from,
            id,
            hold_ms
        }),
        (0u8..3, 0u64..4, any::<bool>()).prop_map(|(from, id, consumed)| Op::Done {
            from,
            id,
            consumed
        }),
        (0u64..4).prop_map(|id| Op::Retire { id }),
        (0u64..4).prop_map(|id| Op::Abandon { id }),
        (0u64..300).prop_map(|ms| Op::Sweep { ms }),
    ]
}

/// The test's own account of one held payload.
#[derive(Debug, Default)]
struct Model {
    buffer: u64,
    chunks: u32,
    to_store: bool,
    /// Published whole: subscribing is its announcement (no Ready is sent).
    whole: bool,
    ready: BTreeSet<u32>,
    /// Subscribers and the end of each one's hold.
    subscribers: HashMap<EngineId, Instant>,
    /// No longer served (its buffer may wait for holds).
    ended: bool,
}

proptest! {
    #[test]
    fn publisher_returns_every_buffer_once_never_under_a_hold_and_announces_every_ready_chunk(
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut p: Publisher<u64> = Publisher::default();
        let mut models: HashMap<u64, Model> = HashMap::new();
        let mut next_buffer = 0u64;
        let mut returned: HashSet<u64> = HashSet::new();
        let mut issued: HashSet<u64> = HashSet::new();
        for op in ops {
            let mut out = Vec::new();
            match op {
                Op::Publish { id, chunks, lease, to_store } => {
                    if models.contains_key(&id) { continue; } // ids are unique per connector
                    next_buffer += 1;
                    issued.insert(next_buffer);
                    p.publish(id, next_buffer, chunks, Lease::new(policy(lease), now), to_store);
                    models.insert(id, Model { buffer: next_buffer, chunks, to_store, ..Model::default() });
                }
                Op::PublishWhole { id, lease } => {
                    if models.contains_key(&id) { continue; }
                    next_buffer += 1;
                    issued.insert(next_buffer);
                    p.publish_whole(id, next_buffer, Some(0), Lease::new(policy(lease), now));
                    let ready = BTreeSet::from([0]);
                    models.insert(id, Model { buffer: next_buffer, chunks: 1, whole: true, ready, ..Model::default() });
                }
                Op::Mark { id, index } => {
                    let valid = models.get(&id).is_some_and(|m| !m.ended && index < m.chunks && !m.ready.contains(&index));
                    let r = p.mark_ready(id, index, Some(index), &mut out);
                    prop_assert_eq!(r.is_ok(), valid, "mark {} of {}: {:?}", index, id, r.err());
                    if r.is_ok() {
                        let m = models.get_mut(&id).unwrap();
                        m.ready.insert(index);
                        // Every subscriber hears of the chunk.
                        let told: HashSet<EngineId> = out.iter().filter_map(|a| match a {
                            Action::Send { to, msg: Control::Ready { index: i, .. } } if *i == index => Some(*to),
                            _ => None,
                        }).collect();
                        prop_assert_eq!(told, m.subscribers.keys().copied().collect::<HashSet<_>>());
                    }
                }
                Op::Subscribe { from, id, hold_ms } => {
                    let from = EngineId(u128::from(from));
                    let subscribed = p.subscribe(from, id, Duration::from_millis(hold_ms), now, &mut out);
                    let gone = out.iter().any(|a| matches!(a, Action::Send { msg: Control::Gone { .. }, to } if *to == from));
                    prop_assert_eq!(subscribed, !gone, "subscribed, or told why not");
                    match models.get_mut(&id) {
                        Some(m) if !gone => {
                            prop_assert!(!m.ended && !m.to_store, "an ended or store payload subscribed to");
                            let until = now + Duration::from_millis(hold_ms);
                            let held = m.subscribers.entry(from).or_insert(until);
                            *held = (*held).max(until);
                            let replayed: BTreeSet<u32> = out.iter().filter_map(|a| match a {
                                Action::Send { to, msg: Control::Ready { index, .. } } if *to == from => Some(*index),
                                _ => None,
                            }).collect();
                            let expected = if m.whole { BTreeSet::new() } else { m.ready.clone() };
                            prop_assert_eq!(replayed, expected, "a subscriber learns every ready chunk");
                        }
                        Some(_) => {}
                        None => prop_assert!(gone, "a payload not held answers Gone"),
                    }
                }
                Op::Done { from, id, consumed } => {
                    let from = EngineId(u128::from(from));
                    let served = p.done(from, id, consumed, now, &mut out);
                    let gone = out.iter().any(|a| matches!(a, Action::Send { msg: Control::Gone { .. }, to } if *to == from));
                    prop_assert_eq!(served, !gone, "served, or told why not");
                    match models.get_mut(&id) {
                        Some(m) => {
                            prop_assert!(!served || !(m.ended || m.to_store), "an ended payload confirmed");
                            m.subscribers.remove(&from);
                        }
                        None => prop_assert!(!served, "a payload not held confirmed"),
                    }
                }
                Op::Retire { id } => p.retire(id, &mut out),
                Op::Abandon { id } => p.abandon(id, &mut out),
                Op::Sweep { ms } => {
                    now += Duration::from_millis(ms);
                    p.sweep(now, &mut out);
                }
            }
            check(&out, &mut models, &issued, &mut returned, now)?;
            // Payloads that stopped being served in this step: the subscribers of an incomplete
            // one were told.
            for (id, m) in &mut models {
                let ended = p.buffer(*id).is_none();
                if ended && !m.ended && m.ready.len() < m.chunks as usize {
                    for s in m.subscribers.keys() {
                        let told = out.iter().any(|a| matches!(a, Action::Send { to, msg: Control::Gone { payload, .. } } if to == s && payload == id));
                        prop_assert!(told, "subscriber {} of {} not told it ended", s, id);
                    }
                }
                prop_assert!(!m.ended || ended, "payload {} served again", id);
                m.ended = ended;
                if m.ended {
                    m.subscribers.retain(|_, until| *until > now || !matches!(op, Op::Sweep { .. }));
                }
            }
            prop_assert_eq!(p.held(), models.len());
        }
        let ids: Vec<u64> = models.keys().copied().collect();
        let mut out = Vec::new();
        for id in ids { p.retire(id, &mut out); }
        now += MAX_HOLD + Duration::from_secs(1);
        p.sweep(now, &mut out);
        check(&out, &mut models, &issued, &mut returned, now)?;
        prop_assert_eq!(returned, issued, "every buffer comes back exactly once");
        prop_assert_eq!(p.held(), 0);
    }
}

fn policy(lease: u8) -> LeasePolicy {
    match lease {
        0 => LeasePolicy::DeleteOnConsume { consumers: 1 },
        1 => LeasePolicy::DeleteOnConsume { consumers: 2 },
        2 => LeasePolicy::Ttl(Duration::from_millis(100)),
        _ => LeasePolicy::Pinned,
    }
}

/// Checks one step's actions against the models: buffers come back once, only from ended
/// payloads nobody holds (store payloads once complete); chunks are announced only once ready.
fn check(
    out: &[Action<u64>],
    models: &mut HashMap<u64, Model>,
    issued: &HashSet<u64>,
    returned: &mut HashSet<u64>,
    now: Instant,
) -> Result<(), TestCaseError> {
    for a in out {
        match a {
            Action::Release { payload, buffer } | Action::Store { payload, buffer } => {
                prop_assert!(issued.contains(buffer), "a buffer never published");
                prop_assert!(returned.insert(*buffer), "buffer {} handed back twice", buffer);
                let m = models.remove(payload).expect("a payload the model holds");
                prop_assert_eq!(m.buffer, *buffer);
                let held = m.subscribers.values().filter(|&&until| until > now).count();
                prop_assert_eq!(held, 0, "payload {} released under {} holds", payload, held);
                if matches!(a, Action::Store { .. }) {
                    prop_assert_eq!(m.ready.len(), m.chunks as usize);
                }
            }
            Action::Send { msg: Control::Ready { payload, index, crc }, .. } => {
                prop_assert_eq!(*crc, Some(*index));
                let marked = models.get(payload).is_some_and(|m| m.ready.contains(index));
                prop_assert!(
                    marked,
                    "announced chunk {} of {} before it was ready",
                    index,
                    payload
                );
            }
            Action::Send { .. } => {}
        }
    }
    Ok(())
}

/// Drives a fetch the way the connector does, with `choices` deciding whether a waiting message
/// goes before the oldest landing. Returns the steps in order.
fn drive(
    chunks: u32,
    window: usize,
    mut messages: Vec<Control>,
    mut choices: impl Iterator<Item = bool>,
    bad_crc: Option<u32>,
) -> Vec<FetchStep> {
    let mut f = Fetch::new(7, chunks, window);
    let mut log: Vec<FetchStep> = Vec::new();
    let mut steps = Vec::new();
    for _ in 0..10_000 {
        log.append(&mut steps);
        steps = match f.next() {
            Next::Done => return log,
            Next::Message if messages.is_empty() => return log, // the driver would time out
            Next::Message => f.on_message(&messages.remove(0)),
            Next::Landing { index, or_message } => {
                if or_message && !messages.is_empty() && choices.next().unwrap_or(false) {
                    f.on_message(&messages.remove(0))
                } else {
                    let crc = f
                        .wants_crc(index)
                        .then(|| if bad_crc == Some(index) { !index } else { index });
                    f.on_landed(index, crc)
                }
            }
        };
    }
    panic!("the fetch did not settle: {log:?}");
}

proptest! {
    #[test]
    fn fetch_reads_and_yields_each_chunk_once_within_its_window(
        chunks in 1u32..9,
        window in 1usize..5,
        order in Just(()).prop_perturb(|_, mut rng| {
            let mut v: Vec<u32> = (0..8).collect();
            for i in (1..v.len()).rev() { v.swap(i, rng.random_range(0..=i)); }
            v
        }),
        repeats in proptest::collection::vec(0u32..8, 0..4),
        choices in proptest::collection::vec(any::<bool>(), 0..64),
    ) {
        let mut messages: Vec<Control> = order.iter().chain(&repeats).filter(|&&i| i < chunks)
            .map(|&i| Control::Ready { payload: 7, index: i, crc: Some(i) }).collect();
        messages.insert(0, Control::Subscribe { payload: 7, hold_ms: 1 }); // not for a fetch: ignored
        let log = drive(chunks, window, messages, choices.into_iter(), None);
        let (mut read, mut yielded, mut in_flight) = (Vec::new(), Vec::new(), 0usize);
        for (k, s) in log.iter().enumerate() {
            match s {
                FetchStep::Read(i) => { read.push(*i); in_flight += 1; prop_assert!(in_flight <= window, "window exceeded"); }
                FetchStep::Yield(i) => {
                    prop_assert!(read.contains(i), "yielded {} before reading it", i);
                    yielded.push(*i);
                    in_flight -= 1;
                }
                FetchStep::Report => prop_assert_eq!(k, log.len() - 1, "report is last"),
                FetchStep::Fail(e) => prop_assert!(false, "failed: {}", e),
            }
        }
        let all: BTreeSet<u32> = (0..chunks).collect();
        prop_assert_eq!(read.iter().copied().collect::<BTreeSet<_>>(), all.clone());
        prop_assert_eq!(read.len(), chunks as usize, "a chunk read twice");
        prop_assert_eq!(yielded.iter().copied().collect::<BTreeSet<_>>(), all);
        prop_assert_eq!(yielded.len(), chunks as usize, "a chunk yielded twice");
        prop_assert!(matches!(log.last(), Some(FetchStep::Report)));
    }

    #[test]
    fn fetch_fails_once_and_stops_on_gone_or_a_bad_checksum(
        chunks in 1u32..6,
        gone_at in 0usize..6,
        bad in proptest::option::of(0u32..6),
    ) {
        let mut messages: Vec<Control> =
            (0..chunks).map(|i| Control::Ready { payload: 7, index: i, crc: Some(i) }).collect();
        let gone = gone_at < messages.len();
        if gone {
            messages.insert(gone_at, Control::Gone { payload: 7, why: Gone::Expired });
        }
        let log = drive(chunks, 2, messages, std::iter::repeat(true), bad);
        let fails: Vec<&ConnectorError> = log.iter().filter_map(|s| match s { FetchStep::Fail(e) => Some(e), _ => None }).collect();
        let bad_hit = bad.is_some_and(|b| b < chunks);
        if gone || bad_hit {
            prop_assert_eq!(fails.len(), 1, "{:?}", log);
            prop_assert!(matches!(log.last(), Some(FetchStep::Fail(_))), "nothing after a failure");
            prop_assert!(!log.iter().any(|s| matches!(s, FetchStep::Report)));
        } else {
            prop_assert!(fails.is_empty());
        }
    }
}
