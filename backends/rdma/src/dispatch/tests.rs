//! The dispatcher driven by arbitrary event orders: every op ends exactly once, only with none
//! of its requests in flight, an op that succeeded had each of its bytes moved, requests stay
//! within their op's rails and each rail's window, and rails are rebuilt only when idle.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

const STATUSES: [WcStatus; 6] = [
    WcStatus::Success,
    WcStatus::Success,
    WcStatus::Success,
    WcStatus::RetryExceeded,
    WcStatus::Flushed,
    WcStatus::RemoteAccess,
];

fn cfg(window: u32) -> DataPath {
    DataPath {
        slice_bytes: 1000,
        window,
        op_window: 3,
        max_retries: 6,
        backoff: Backoff { first: Duration::from_millis(5), max: Duration::from_millis(40) },
        strict_affinity: false,
    }
}

#[derive(Debug, Clone)]
enum Step {
    Submit { len: u64, allowed: u64, preferred: u64 },
    Complete { pick: usize, status: usize },
    Cancel { pick: usize },
    Tick { ms: u64 },
    Rebuilt { pick: usize, ok: bool },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u64..5000, 1u64..16, 0u64..16)
            .prop_map(|(len, allowed, preferred)| Step::Submit { len, allowed, preferred }),
        6 => (any::<usize>(), 0..STATUSES.len()).prop_map(|(pick, status)| Step::Complete { pick, status }),
        1 => any::<usize>().prop_map(|pick| Step::Cancel { pick }),
        1 => (0u64..60).prop_map(|ms| Step::Tick { ms }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, ok)| Step::Rebuilt { pick, ok }),
    ]
}

#[derive(Default)]
struct Model {
    /// wr id -> (op number, offset, len, rail)
    inflight: BTreeMap<u64, (u32, u64, u64, usize)>,
    keys: Vec<(u32, OpKey, u64, u64)>,
    ended: HashMap<u32, bool>,
    covered: HashMap<u32, Vec<(u64, u64)>>,
    rebuilding: Vec<usize>,
}

impl Model {
    fn apply(&mut self, d: &Dispatch<u32>, out: Vec<Action<u32>>, window: u32) {
        for a in out {
            match a {
                Action::Post { wr_id, rail, op, offset, len } => {
                    let n = *d.payload(op).expect("a post for a live op");
                    assert!(!self.ended.contains_key(&n), "post for ended op {n}");
                    let allowed = self.keys.iter().find(|k| k.0 == n).unwrap().2;
                    assert!(allowed & (1 << rail) != 0, "op {n} posted on rail {rail}");
                    self.inflight.insert(wr_id, (n, offset, len, rail));
                    let on_rail = self.inflight.values().filter(|x| x.3 == rail).count();
                    assert!(on_rail as u32 <= window, "rail {rail} over its window");
                }
                Action::Finish { payload, result } => {
                    self.end(payload, result.is_ok());
                }
                Action::FallBack { payload, .. } => self.end(payload, false),
                Action::Rebuild { rail } => {
                    assert!(self.inflight.values().all(|x| x.3 != rail), "rebuild of a busy rail");
                    self.rebuilding.push(rail);
                }
            }
        }
        assert_eq!(d.inflight(), self.inflight.len());
    }

    fn end(&mut self, n: u32, ok: bool) {
        assert!(self.ended.insert(n, ok).is_none(), "op {n} ended twice");
        assert!(self.inflight.values().all(|x| x.0 != n), "op {n} ended with requests in flight");
        if ok {
            let len = self.keys.iter().find(|k| k.0 == n).unwrap().3;
            let mut c = self.covered.remove(&n).unwrap_or_default();
            c.sort();
            let mut at = 0;
            for (o, l) in c {
                assert!(o <= at, "op {n}: bytes {at}..{o} never moved");
                at = at.max(o + l);
            }
            assert!(at >= len, "op {n}: moved {at} of {len}");
        }
    }
}

fn run(steps: Vec<Step>, rails: usize, window: u32) {
    let mut d: Dispatch<u32> = Dispatch::new(cfg(window), rails);
    let mut m = Model::default();
    let mut now = Instant::now();
    let mut next = 0u32;
    for s in steps {
        let mut out = Vec::new();
        match s {
            Step::Submit { len, allowed, preferred } => {
                let k = d.submit(next, len, allowed, preferred, now, &mut out);
                m.keys.push((next, k, allowed & mask_of(rails), len));
                next += 1;
            }
            Step::Complete { pick, status } => {
                if let Some((&id, &(n, o, l, _))) =
                    m.inflight.iter().nth(pick % m.inflight.len().max(1))
                {
                    m.inflight.remove(&id);
                    if STATUSES[status] == WcStatus::Success {
                        m.covered.entry(n).or_default().push((o, l));
                    }
                    d.completed(id, STATUSES[status], now, &mut out);
                }
            }
            Step::Cancel { pick } => {
                if let Some(&(_, k, _, _)) = m.keys.get(pick % m.keys.len().max(1)) {
                    d.cancel(k, &mut out);
                }
            }
            Step::Tick { ms } => {
                now += Duration::from_millis(ms);
                d.tick(now, &mut out);
            }
            Step::Rebuilt { pick, ok } => {
                if !m.rebuilding.is_empty() {
                    let rail = m.rebuilding.remove(pick % m.rebuilding.len());
                    d.rebuilt(rail, ok, now, &mut out);
                }
            }
        }
        m.apply(&d, out, window);
    }
    // Drain: everything in flight succeeds, rails come back, until every op has ended.
    for _ in 0..10_000 {
        if m.ended.len() == next as usize {
            break;
        }
        let mut out = Vec::new();
        if let Some((&id, &(n, o, l, _))) = m.inflight.iter().next() {
            m.inflight.remove(&id);
            m.covered.entry(n).or_default().push((o, l));
            d.completed(id, WcStatus::Success, now, &mut out);
        } else if let Some(rail) = m.rebuilding.pop() {
            d.rebuilt(rail, true, now, &mut out);
        } else {
            now += Duration::from_millis(50);
            d.tick(now, &mut out);
        }
        m.apply(&d, out, window);
    }
    assert_eq!(m.ended.len(), next as usize, "ops left: {}", d.ops());
    assert_eq!(d.ops(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn every_op_ends_once_with_nothing_in_flight(
        steps in proptest::collection::vec(step(), 1..120),
        rails in 1usize..5,
        window in 1u32..5,
    ) {
        run(steps, rails, window);
    }
}

#[test]
fn large_ops_are_sprayed_over_every_rail_least_loaded_first() {
    let mut d: Dispatch<u32> = Dispatch::new(DataPath { op_window: 64, ..cfg(64) }, 2);
    let mut out = Vec::new();
    d.submit(0, 8000, 0b11, 0b11, Instant::now(), &mut out);
    let rails: Vec<usize> = out
        .iter()
        .map(|a| match a {
            Action::Post { rail, .. } => *rail,
            _ => panic!("{a:?}"),
        })
        .collect();
    assert_eq!(rails.len(), 8);
    assert_eq!(rails.iter().filter(|&&r| r == 0).count(), 4, "{rails:?}");
}

#[test]
fn preferred_rails_first_others_only_when_they_are_full() {
    let mut d: Dispatch<u32> = Dispatch::new(DataPath { op_window: 64, ..cfg(2) }, 2);
    let mut out = Vec::new();
    d.submit(0, 3000, 0b11, 0b01, Instant::now(), &mut out);
    let rails: Vec<usize> = out
        .iter()
        .filter_map(|a| match a {
            Action::Post { rail, .. } => Some(*rail),
            _ => None,
        })
        .collect();
    assert_eq!(rails, [0, 0, 1], "two on the preferred rail (its window), the third elsewhere");
}

#[test]
fn a_path_failure_moves_slices_to_another_rail_and_pauses_the_rail() {
    let t0 = Instant::now();
    let mut d: Dispatch<u32> = Dispatch::new(cfg(8), 2);
    let mut out = Vec::new();
    d.submit(7, 2000, 0b11, 0b11, t0, &mut out);
    let posts: Vec<(u64, usize)> = out
        .drain(..)
        .filter_map(|a| match a {
            Action::Post { wr_id, rail, .. } => Some((wr_id, rail)),
            _ => None,
        })
        .collect();
    let (bad, bad_rail) = posts[0];
    d.completed(bad, WcStatus::RetryExceeded, t0, &mut out);
    assert!(d.health(bad_rail).is_paused());
    let again = std::mem::take(&mut out);
    assert!(
        matches!(again[..], [Action::Post { rail, .. }] if rail != bad_rail),
        "the slice goes to the other rail: {again:?}"
    );
    let Action::Post { wr_id: retry, .. } = again[0] else { unreachable!() };
    d.completed(posts[1].0, WcStatus::Success, t0, &mut out);
    d.completed(retry, WcStatus::Success, t0, &mut out);
    assert!(matches!(out[..], [Action::Finish { payload: 7, result: Ok(()) }]), "{out:?}");
    // The paused rail is rebuilt after its backoff.
    out.clear();
    assert!(d.tick(t0, &mut out).is_some());
    assert!(out.is_empty());
    d.tick(t0 + Duration::from_millis(5), &mut out);
    assert!(matches!(out[..], [Action::Rebuild { rail }] if rail == bad_rail));
}

#[test]
fn access_errors_fail_the_op_without_retry_and_no_rail_means_fallback() {
    let t0 = Instant::now();
    let mut d: Dispatch<u32> = Dispatch::new(cfg(8), 1);
    let mut out = Vec::new();
    d.submit(1, 500, 1, 1, t0, &mut out);
    let Action::Post { wr_id, .. } = out.remove(0) else { panic!() };
    d.completed(wr_id, WcStatus::RemoteAccess, t0, &mut out);
    assert!(
        matches!(&out[..], [Action::Finish { payload: 1, result: Err(Error::AccessDenied(_)) }]),
        "{out:?}"
    );
    out.clear();
    // The QP is rebuilt at once (no pause): the next op waits for it, then goes.
    d.submit(2, 500, 1, 1, t0, &mut out);
    assert!(out.is_empty());
    d.tick(t0, &mut out);
    assert!(matches!(out[..], [Action::Rebuild { rail: 0 }]));
    out.clear();
    d.rebuilt(0, true, t0, &mut out);
    let Action::Post { wr_id, .. } = out.remove(0) else { panic!("{out:?}") };
    // A path failure on the only rail: the op falls back once nothing is in flight.
    d.completed(wr_id, WcStatus::RetryExceeded, t0, &mut out);
    assert!(matches!(&out[..], [Action::FallBack { payload: 2, .. }]), "{out:?}");
    out.clear();
    d.submit(3, 10, 1, 1, t0, &mut out);
    assert!(matches!(&out[..], [Action::FallBack { payload: 3, .. }]), "no rail up: {out:?}");
}

#[test]
fn a_cancelled_op_ends_only_after_its_requests() {
    let t0 = Instant::now();
    let mut d: Dispatch<u32> = Dispatch::new(cfg(1), 1);
    let mut out = Vec::new();
    let k = d.submit(9, 3000, 1, 1, t0, &mut out);
    let Action::Post { wr_id, .. } = out.remove(0) else { panic!() };
    d.cancel(k, &mut out);
    assert!(out.is_empty(), "one request still in flight");
    assert_eq!(d.op_inflight(k), 1);
    d.completed(wr_id, WcStatus::Success, t0, &mut out);
    assert!(matches!(&out[..], [Action::Finish { payload: 9, result: Err(_) }]), "{out:?}");
    assert_eq!(d.inflight(), 0, "nothing more was posted for it");
}

#[test]
fn a_large_op_takes_turns_with_later_ops_up_to_its_own_window() {
    let t0 = Instant::now();
    let mut d: Dispatch<u32> = Dispatch::new(DataPath { op_window: 2, ..cfg(64) }, 1);
    let mut out = Vec::new();
    d.submit(0, 10_000, 1, 1, t0, &mut out);
    d.submit(1, 500, 1, 1, t0, &mut out);
    let ops: Vec<u32> = out
        .iter()
        .map(|a| match a {
            Action::Post { op, .. } => *d.payload(*op).unwrap(),
            _ => panic!("{a:?}"),
        })
        .collect();
    assert_eq!(ops, [0, 0, 1], "two slices of the large op (its window), then the small op");
    // Each completion of the large op lets one more of its slices go.
    let Action::Post { wr_id, .. } = out[0] else { unreachable!() };
    out.clear();
    d.completed(wr_id, WcStatus::Success, t0, &mut out);
    assert!(matches!(out[..], [Action::Post { offset: 2000, .. }]), "{out:?}");
}
