//! The connections' state, as the progress thread keeps it: a peer's connection to this backend
//! ([`InConn`], with the ranges it was granted) and this backend's to a peer ([`OutConn`], with
//! its leases and ops). The handlers that change them are `inbound` and `outbound`; the thread
//! (`progress`) holds them. Types below, handlers above, so imports point one way.

use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_core::MemSlice;
use tensorwire_core::backend::Op;
use tensorwire_core::{Error, RegionId, Result};
use tokio::sync::oneshot;

use crate::ffi::{Endpoint, MemHandle, RemoteKey};
use crate::gate::OpGate;
use crate::tokens::{Graveyard, Submitted};

/// A region range a peer was granted, held until its End.
#[derive(Debug)]
pub(crate) struct Hold {
    pub(crate) slice: MemSlice,
    pub(crate) memh: Option<Rc<MemHandle>>,
}

impl Hold {
    /// Keeps the range for puts the peer may still have queued (see [`Graveyard`]).
    pub(crate) fn bury(self, graveyard: &mut Graveyard) {
        graveyard.bury(self.slice, self.memh, None);
    }
}

/// A peer's connection to this backend.
#[derive(Debug)]
pub(crate) struct InConn {
    pub(crate) holds: HashMap<u64, Hold>,
    /// Whole regions leased, by (region, write access), until the peer's Released.
    pub(crate) leases: HashMap<(tensorwire_core::RegionId, bool), Hold>,
    pub(crate) ep: Endpoint,
}

/// Request id of the Hello.
pub(crate) const HELLO: u64 = 0;

/// One connection to a peer's backend.
#[derive(Debug)]
pub(crate) struct OutConn {
    /// Unpacked remote keys by region, with the blob they came from. Declared before `ep`: keys
    /// are destroyed before their endpoint.
    pub(crate) rkeys: HashMap<RegionId, (Bytes, Rc<RemoteKey>)>,
    pub(crate) ep: Endpoint,
    pub(crate) dead: Option<Error>,
    pub(crate) connecting: Option<oneshot::Sender<Result<u64>>>,
    pub(crate) grants: HashMap<u64, u64>,
    pub(crate) notifies: HashMap<u64, oneshot::Sender<Result<()>>>,
    pub(crate) deadlines: VecDeque<(Instant, u64)>,
    pub(crate) next_req: u64,
    pub(crate) ops: HashSet<u64>,
    pub(crate) closing: bool,
    /// Whole regions the peer leased to this connection, by (region, write access).
    pub(crate) leases: HashMap<(RegionId, bool), Lease>,
}

/// A region the peer holds for this connection until Released.
#[derive(Debug)]
pub(crate) struct Lease {
    /// The region's base address at the peer, and its length.
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) key: tensorwire_core::AccessKey,
    pub(crate) rkey: Rc<RemoteKey>,
    /// Ops running on it.
    pub(crate) users: u32,
    /// The peer asked for it back: no new ops.
    pub(crate) revoked: bool,
}

impl OutConn {
    /// Whether an answer from the peer is awaited.
    pub(crate) fn waiting(&self) -> bool {
        self.connecting.is_some() || !self.grants.is_empty() || !self.notifies.is_empty()
    }

    pub(crate) fn awaits(&self, req: u64) -> bool {
        if req == HELLO {
            self.connecting.is_some()
        } else {
            self.grants.contains_key(&req) || self.notifies.contains_key(&req)
        }
    }

    /// Whether an awaited answer is past its deadline (answered requests are skipped).
    pub(crate) fn overdue(&mut self, now: Instant) -> bool {
        while let Some(&(deadline, req)) = self.deadlines.front() {
            if self.dead.is_some() || !self.awaits(req) {
                self.deadlines.pop_front();
                continue;
            }
            return deadline <= now;
        }
        false
    }
}

/// One op in flight.
#[derive(Debug)]
pub(crate) struct OpState {
    pub(crate) conn: u64,
    pub(crate) req: u64,
    pub(crate) write: bool,
    /// The op: its local memory, kept (with the engine's notification fence) until it ends.
    pub(crate) work: Op,
    pub(crate) memh: Option<Rc<MemHandle>>,
    pub(crate) region: RegionId,
    pub(crate) blob: Option<Bytes>,
    pub(crate) rkey: Option<Rc<RemoteKey>>,
    pub(crate) addr: u64,
    pub(crate) next: u64,
    pub(crate) inflight: u32,
    pub(crate) granted: bool,
    pub(crate) flush_started: bool,
    pub(crate) flushing: bool,
    /// Requests were forgotten after a forced close (see `Progress::abandon`).
    pub(crate) abandoned: bool,
    /// It runs on a lease (no End; the lease counts it).
    pub(crate) leased: bool,
    pub(crate) error: Option<Error>,
    pub(crate) gate: Arc<OpGate>,
    pub(crate) done: oneshot::Sender<Result<()>>,
    pub(crate) last: Instant,
}

impl OpState {
    /// An op submitted on `conn` (request `req` of its Begin; 0 on a lease), not yet granted.
    pub(crate) fn new(
        conn: u64,
        req: u64,
        write: bool,
        memh: Option<Rc<MemHandle>>,
        s: Submitted,
        now: Instant,
    ) -> OpState {
        let blob = s.op.remote().blob.clone();
        OpState {
            conn,
            req,
            write,
            memh,
            region: s.op.remote().region,
            blob: (!blob.is_empty()).then_some(blob),
            rkey: None,
            addr: 0,
            next: 0,
            inflight: 0,
            granted: false,
            flush_started: false,
            flushing: false,
            abandoned: false,
            leased: false,
            error: None,
            gate: s.gate,
            done: s.done,
            work: s.op,
            last: now,
        }
    }

    /// Whether requests are outstanding with no progress for `bound`.
    pub(crate) fn stalled(&self, now: Instant, bound: Duration) -> bool {
        (self.inflight > 0 || self.flushing) && now.duration_since(self.last) > bound
    }

    /// Whether UCX is moving this op's bytes (requests in flight).
    pub(crate) fn moving(&self) -> bool {
        self.inflight > 0 || self.flushing
    }

    /// Resolves the op with `e` at once (the thread is shutting down); what its requests may
    /// still touch goes to `graveyard`.
    pub(crate) fn fail_now(self, e: Error, graveyard: &mut Graveyard) {
        let _ = self.done.send(Err(e));
        graveyard.bury(self.work.into_local(), self.memh, self.rkey);
    }
}
