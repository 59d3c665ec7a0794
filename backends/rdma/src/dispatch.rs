//! One connection's data path as a plain state machine, with time passed in and no IO: ops are
//! cut into slices, slices are sprayed over the rails an op may use (its preferred ones first,
//! least bytes in flight first, within each rail's window), completions come back in, and out
//! come the requests to post, the ops that ended, the ops to hand to another backend and the
//! rails to rebuild.
//!
//! Failure rules:
//! - a path failure (retries exhausted, a flushed QP) pauses its rail with backoff and sends the
//!   slice to another rail; requests that were already on the failed QP come back flushed and
//!   are sent elsewhere too, without failing the rail again (the rail's epoch says which QP a
//!   request was on);
//! - a refused access (bad key, bounds, permission) fails its op, never retried; its rail's QP
//!   is rebuilt at once;
//! - when every rail an op may use is paused, the op falls back (to the engine's next backend)
//!   once none of its requests is in flight;
//! - an op ends only when none of its requests is in flight, so its memory is never released
//!   while a NIC may still touch it.

use std::collections::VecDeque;
use std::time::Instant;

use tensorwire_core::Error;

use crate::rails::{Backoff, RailHealth};
use crate::verbs::WcStatus;

/// Most rails a connection has (rail sets are bit masks).
pub const MAX_CONN_RAILS: usize = 64;

/// Settings of the data path (part of [`crate::RdmaConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataPath {
    /// Bytes per slice (one work request).
    pub slice_bytes: u64,
    /// Requests in flight per rail.
    pub window: u32,
    /// Requests in flight per op (so that a large op leaves room for its batchmates: ops take
    /// turns, one slice each).
    pub op_window: u32,
    /// Path failures one op may see before it gives up on this backend.
    pub max_retries: u32,
    /// Rail backoff.
    pub backoff: Backoff,
    /// Only an op's preferred rails carry it while one of them is usable (else other rails take
    /// slices when the preferred ones are full).
    pub strict_affinity: bool,
}

impl Default for DataPath {
    fn default() -> Self {
        DataPath {
            slice_bytes: 1 << 20,
            window: 32,
            op_window: 16,
            max_retries: 16,
            backoff: Backoff::default(),
            strict_affinity: false,
        }
    }
}

/// Names an op in the dispatcher (stale keys are ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpKey {
    idx: u32,
    generation: u32,
}

/// What the IO shell must do.
#[derive(Debug)]
pub enum Action<T> {
    /// Post one request: bytes `[offset, offset + len)` of op `op` on `rail`, with `wr_id`.
    Post {
        /// Work request id.
        wr_id: u64,
        /// Rail.
        rail: usize,
        /// The op.
        op: OpKey,
        /// Offset in the op.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// The op ended; nothing of it is in flight.
    Finish {
        /// What was submitted with it.
        payload: T,
        /// Its outcome (`Err` also for a cancelled op, whose result nobody waits for).
        result: Result<(), Error>,
    },
    /// Every rail the op may use is down: hand it to another backend (nothing is in flight).
    FallBack {
        /// What was submitted with it.
        payload: T,
        /// Why.
        error: Error,
    },
    /// Make a new QP for this rail (its old one has nothing in flight), then call
    /// [`Dispatch::rebuilt`].
    Rebuild {
        /// Rail.
        rail: usize,
    },
}

/// A rail's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RailCounters {
    /// Bytes moved.
    pub bytes: u64,
    /// Requests completed successfully.
    pub ops: u64,
    /// Requests that completed in error (flushes of an already failed QP excluded).
    pub errors: u64,
    /// Requests in flight.
    pub inflight: u32,
}

#[derive(Debug)]
struct Rail {
    health: RailHealth,
    /// Generation of the rail's QP (bumped when it fails or is rebuilt).
    epoch: u32,
    inflight_bytes: u64,
    counters: RailCounters,
}

#[derive(Debug)]
struct OpEntry<T> {
    payload: T,
    len: u64,
    done: u64,
    inflight: u32,
    allowed: u64,
    preferred: u64,
    error: Option<Error>,
    cancelled: bool,
    stranded: Option<Error>,
    retries: u32,
    /// Offset of the first byte not yet cut into a slice.
    next: u64,
    /// Slices to send again (a path failure), before new ones.
    again: VecDeque<(u64, u64)>,
    /// In the ready queue.
    queued: bool,
}

impl<T> OpEntry<T> {
    fn live(&self) -> bool {
        !self.cancelled && self.error.is_none() && self.stranded.is_none()
    }
    fn pending(&self) -> bool {
        self.live() && (!self.again.is_empty() || self.next < self.len)
    }
}

#[derive(Debug, Clone, Copy)]
struct Slice {
    op: OpKey,
    offset: u64,
    len: u64,
}

#[derive(Debug, Clone, Copy)]
struct WrEntry {
    slice: Slice,
    rail: u16,
    epoch: u32,
}

/// A slab with generations, so that a stale key finds nothing.
#[derive(Debug)]
struct Slab<V> {
    slots: Vec<(u32, Option<V>)>,
    free: Vec<u32>,
}

impl<V> Slab<V> {
    fn new() -> Self {
        Slab { slots: Vec::new(), free: Vec::new() }
    }
    fn insert(&mut self, v: V) -> OpKey {
        match self.free.pop() {
            Some(idx) => {
                let slot = &mut self.slots[idx as usize];
                slot.0 = slot.0.wrapping_add(1);
                slot.1 = Some(v);
                OpKey { idx, generation: slot.0 }
            }
            None => {
                self.slots.push((0, Some(v)));
                OpKey { idx: (self.slots.len() - 1) as u32, generation: 0 }
            }
        }
    }
    fn get(&self, k: OpKey) -> Option<&V> {
        match self.slots.get(k.idx as usize) {
            Some((g, Some(v))) if *g == k.generation => Some(v),
            _ => None,
        }
    }
    fn get_mut(&mut self, k: OpKey) -> Option<&mut V> {
        match self.slots.get_mut(k.idx as usize) {
            Some((g, Some(v))) if *g == k.generation => Some(v),
            _ => None,
        }
    }
    fn remove(&mut self, k: OpKey) -> Option<V> {
        match self.slots.get_mut(k.idx as usize) {
            Some((g, v @ Some(_))) if *g == k.generation => {
                self.free.push(k.idx);
                v.take()
            }
            _ => None,
        }
    }
    fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

fn wr_id(k: OpKey) -> u64 {
    (u64::from(k.generation) << 32) | u64::from(k.idx)
}

fn wr_key(id: u64) -> OpKey {
    OpKey { idx: id as u32, generation: (id >> 32) as u32 }
}

/// The data path of one connection (see the module docs).
#[derive(Debug)]
pub struct Dispatch<T> {
    cfg: DataPath,
    rails: Vec<Rail>,
    ops: Slab<OpEntry<T>>,
    wrs: Slab<WrEntry>,
    /// Ops with slices to post, taking turns.
    ready: VecDeque<OpKey>,
}

impl<T> Dispatch<T> {
    /// A dispatcher over `rails` rails (at most [`MAX_CONN_RAILS`]), all up.
    pub fn new(cfg: DataPath, rails: usize) -> Dispatch<T> {
        let rails = (0..rails.min(MAX_CONN_RAILS))
            .map(|_| Rail {
                health: RailHealth::new(cfg.backoff),
                epoch: 0,
                inflight_bytes: 0,
                counters: RailCounters::default(),
            })
            .collect();
        Dispatch { cfg, rails, ops: Slab::new(), wrs: Slab::new(), ready: VecDeque::new() }
    }

    /// Rails.
    pub fn rails(&self) -> usize {
        self.rails.len()
    }

    /// A rail's health.
    pub fn health(&self, rail: usize) -> &RailHealth {
        &self.rails[rail].health
    }

    /// A rail's counters.
    pub fn counters(&self, rail: usize) -> RailCounters {
        self.rails[rail].counters
    }

    /// Ops not yet ended.
    pub fn ops(&self) -> usize {
        self.ops.len()
    }

    /// Requests in flight.
    pub fn inflight(&self) -> usize {
        self.wrs.len()
    }

    /// What was submitted with op `k`, while it has not ended.
    pub fn payload(&self, k: OpKey) -> Option<&T> {
        self.ops.get(k).map(|o| &o.payload)
    }

    /// Requests of op `k` in flight (0 once it ended).
    pub fn op_inflight(&self, k: OpKey) -> u32 {
        self.ops.get(k).map_or(0, |o| o.inflight)
    }

    /// Rails of `mask` that are not paused (up or being rebuilt).
    fn alive(&self, mask: u64) -> bool {
        self.rails.iter().enumerate().any(|(i, r)| mask & (1 << i) != 0 && !r.health.is_paused())
    }

    /// Submits an op of `len` bytes that may use the rails in `allowed` (bit i: rail i),
    /// preferably those in `preferred`.
    pub fn submit(
        &mut self,
        payload: T,
        len: u64,
        allowed: u64,
        preferred: u64,
        now: Instant,
        out: &mut Vec<Action<T>>,
    ) -> OpKey {
        let allowed = allowed & mask_of(self.rails.len());
        let k = self.ops.insert(OpEntry {
            payload,
            len,
            done: 0,
            inflight: 0,
            allowed,
            preferred: preferred & allowed,
            error: None,
            cancelled: false,
            stranded: None,
            retries: 0,
            next: 0,
            again: VecDeque::new(),
            queued: false,
        });
        if len == 0 {
            self.settle(k, out);
            return k;
        }
        if !self.alive(allowed) {
            let why = Error::PeerClosed("rdma: no rail to the peer is up".into());
            if let Some(op) = self.ops.get_mut(k) {
                op.stranded = Some(why);
            }
            self.settle(k, out);
            return k;
        }
        self.enqueue(k);
        self.pump(now, out);
        k
    }

    /// Cancels op `k`: nothing more of it is posted; it ends once none of its requests is in
    /// flight (at once when none is).
    pub fn cancel(&mut self, k: OpKey, out: &mut Vec<Action<T>>) {
        if let Some(op) = self.ops.get_mut(k) {
            op.cancelled = true;
            self.settle(k, out);
        }
    }

    /// A request completed with `status`; returns its rail and bytes (`None` for a request
    /// this dispatcher does not know).
    pub fn completed(
        &mut self,
        wr: u64,
        status: WcStatus,
        now: Instant,
        out: &mut Vec<Action<T>>,
    ) -> Option<(usize, u64)> {
        let Some(w) = self.wrs.remove(wr_key(wr)) else {
            tracing::debug!(wr, "rdma: completion of an unknown request");
            return None;
        };
        let r = &mut self.rails[w.rail as usize];
        r.counters.inflight -= 1;
        r.inflight_bytes -= w.slice.len;
        let current = w.epoch == r.epoch;
        let k = w.slice.op;
        let max_retries = self.cfg.max_retries;
        let done = Some((w.rail as usize, w.slice.len));
        let Some(op) = self.ops.get_mut(k) else { return done };
        op.inflight -= 1;
        match status {
            WcStatus::Success => {
                r.counters.bytes += w.slice.len;
                r.counters.ops += 1;
                r.health.succeeded();
                op.done += w.slice.len;
            }
            s if s.is_path_failure() => {
                if current {
                    r.counters.errors += 1;
                    if r.health.usable() {
                        r.health.failed(now);
                    }
                    r.epoch = r.epoch.wrapping_add(1);
                }
                if op.error.is_none() && !op.cancelled && op.stranded.is_none() {
                    op.retries += 1;
                    if op.retries > max_retries {
                        op.stranded = Some(Error::PeerClosed(format!(
                            "rdma: a request failed {} times ({s:?}); last on rail {}",
                            op.retries, w.rail
                        )));
                    } else {
                        op.again.push_back((w.slice.offset, w.slice.len));
                    }
                }
            }
            s => {
                if current {
                    r.counters.errors += 1;
                    r.health.qp_lost();
                    r.epoch = r.epoch.wrapping_add(1);
                }
                op.error.get_or_insert_with(|| match s {
                    WcStatus::RemoteAccess | WcStatus::RemoteInvalidRequest => {
                        Error::AccessDenied(format!(
                            "rdma: the peer's NIC refused the access ({s:?}): bad key, bounds or \
                             permission, or the region was deregistered"
                        ))
                    }
                    _ => Error::Internal(format!("rdma: a request failed locally ({s:?})")),
                });
            }
        }
        self.settle(k, out);
        self.enqueue(k);
        self.pump(now, out);
        done
    }

    /// Puts op `k` in the ready queue if it has slices to post and room for them.
    fn enqueue(&mut self, k: OpKey) {
        let cap = self.cfg.op_window.max(1);
        if let Some(op) = self.ops.get_mut(k) {
            if !op.queued && op.pending() && op.inflight < cap {
                op.queued = true;
                self.ready.push_back(k);
            }
        }
    }

    /// Fails every op with `e` (the connection is over): nothing more is posted, and each op
    /// ends once none of its requests is in flight.
    pub fn fail_all(&mut self, e: &Error, out: &mut Vec<Action<T>>) {
        self.ready.clear();
        let keys: Vec<OpKey> = self
            .ops
            .slots
            .iter()
            .enumerate()
            .filter(|(_, (_, v))| v.is_some())
            .map(|(i, (g, _))| OpKey { idx: i as u32, generation: *g })
            .collect();
        for k in keys {
            if let Some(op) = self.ops.get_mut(k) {
                op.error.get_or_insert_with(|| e.clone());
            }
            self.settle(k, out);
        }
    }

    /// The rails (bit i: rail i) carrying requests of op `k` now.
    pub fn op_rails(&self, k: OpKey) -> u64 {
        self.wrs
            .slots
            .iter()
            .filter_map(|(_, w)| w.as_ref())
            .filter(|w| w.slice.op == k)
            .fold(0, |m, w| m | (1 << w.rail))
    }

    /// Time passed: rails whose pause is over (and whose old QP has nothing in flight) are to be
    /// rebuilt. Returns when it wants to be called again.
    pub fn tick(&mut self, now: Instant, out: &mut Vec<Action<T>>) -> Option<Instant> {
        for (i, r) in self.rails.iter_mut().enumerate() {
            if r.counters.inflight == 0 && r.health.due(now) {
                r.health.rebuilding();
                out.push(Action::Rebuild { rail: i });
            }
        }
        self.pump(now, out);
        self.rails.iter().filter_map(|r| r.health.wake_at()).min()
    }

    /// A rebuild of `rail` ended (a new QP, connected, or a failure).
    pub fn rebuilt(&mut self, rail: usize, ok: bool, now: Instant, out: &mut Vec<Action<T>>) {
        let r = &mut self.rails[rail];
        r.health.rebuilt(ok, now);
        r.epoch = r.epoch.wrapping_add(1);
        self.pump(now, out);
    }

    /// The rail failed outside a completion (its QP could not take a request): as a path
    /// failure of its current QP.
    pub fn rail_failed(&mut self, rail: usize, now: Instant) {
        let r = &mut self.rails[rail];
        if r.health.usable() {
            r.counters.errors += 1;
            r.health.failed(now);
            r.epoch = r.epoch.wrapping_add(1);
        }
    }

    /// Ends op `k` if nothing of it is in flight and it is done, failed, cancelled or stranded.
    fn settle(&mut self, k: OpKey, out: &mut Vec<Action<T>>) {
        let Some(op) = self.ops.get(k) else { return };
        if op.inflight > 0 {
            return;
        }
        let end = if op.cancelled {
            Some(Err(Error::PeerClosed("rdma: op cancelled".into())))
        } else if let Some(e) = &op.error {
            Some(Err(e.clone()))
        } else if op.stranded.is_some() {
            None
        } else if op.done >= op.len {
            Some(Ok(()))
        } else {
            return;
        };
        let Some(op) = self.ops.remove(k) else { return };
        match end {
            Some(result) => out.push(Action::Finish { payload: op.payload, result }),
            None => out.push(Action::FallBack {
                payload: op.payload,
                error: op.stranded.unwrap_or_else(|| Error::PeerClosed("rdma: stranded".into())),
            }),
        }
    }

    /// Posts slices while rails have room: ops take turns, one slice each, each up to its own
    /// window; an op with no room on its rails waits for a completion.
    fn pump(&mut self, _now: Instant, out: &mut Vec<Action<T>>) {
        let cap = self.cfg.op_window.max(1);
        let step = self.cfg.slice_bytes.max(1);
        let mut idle = 0;
        while idle < self.ready.len() {
            let Some(k) = self.ready.pop_front() else { return };
            let Some(op) = self.ops.get_mut(k) else { continue };
            op.queued = false;
            if !op.pending() || op.inflight >= cap {
                continue;
            }
            let (allowed, preferred) = (op.allowed, op.preferred);
            let Some(rail) = self.pick(allowed, preferred) else {
                if self.alive(allowed) {
                    // Its rails are full or being rebuilt: its turn comes again.
                    if let Some(op) = self.ops.get_mut(k) {
                        op.queued = true;
                    }
                    self.ready.push_back(k);
                    idle += 1;
                } else {
                    // Every rail this op may use is paused: it leaves this backend.
                    if let Some(op) = self.ops.get_mut(k) {
                        op.stranded.get_or_insert_with(|| {
                            Error::PeerClosed("rdma: every rail to the peer failed".into())
                        });
                    }
                    self.settle(k, out);
                }
                continue;
            };
            idle = 0;
            let Some(op) = self.ops.get_mut(k) else { continue };
            let (offset, len) = match op.again.pop_front() {
                Some(s) => s,
                None => {
                    let n = step.min(op.len - op.next);
                    op.next += n;
                    (op.next - n, n)
                }
            };
            op.inflight += 1;
            let r = &mut self.rails[rail];
            r.counters.inflight += 1;
            r.inflight_bytes += len;
            let slice = Slice { op: k, offset, len };
            let key = self.wrs.insert(WrEntry { slice, rail: rail as u16, epoch: r.epoch });
            out.push(Action::Post { wr_id: wr_id(key), rail, op: k, offset, len });
            self.enqueue(k);
        }
    }

    /// The usable rail with room and the least bytes in flight: of `preferred` if one qualifies,
    /// else of `allowed` (see [`DataPath::strict_affinity`]).
    fn pick(&self, allowed: u64, preferred: u64) -> Option<usize> {
        let best = |mask: u64| {
            self.rails
                .iter()
                .enumerate()
                .filter(|(i, r)| {
                    mask & (1 << i) != 0
                        && r.health.usable()
                        && r.counters.inflight < self.cfg.window
                })
                .min_by_key(|(_, r)| r.inflight_bytes)
                .map(|(i, _)| i)
        };
        best(preferred).or_else(|| {
            // With strict affinity, preferred rails that are merely busy are worth the wait;
            // others take a slice only when no preferred rail is usable at all.
            let busy = self.cfg.strict_affinity
                && self
                    .rails
                    .iter()
                    .enumerate()
                    .any(|(i, r)| preferred & (1 << i) != 0 && r.health.usable());
            if busy { None } else { best(allowed) }
        })
    }
}

/// Bits 0..n set.
pub fn mask_of(n: usize) -> u64 {
    if n >= 64 { u64::MAX } else { (1u64 << n) - 1 }
}

#[cfg(test)]
mod tests;
