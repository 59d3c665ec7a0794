//! The initiator side of a connection: setup (NIC pairing, QPs, the Hello exchange), leases,
//! the IO shell around [`Dispatch`] (posting its requests, feeding it completions from each CQ's
//! completion channel, rebuilding rails, ending ops), cancellation, and the fallback of ops
//! that lost every rail.
//!
//! Every op is in one place at a time, recorded under the connection's lock: waiting for its
//! lease, in the dispatcher, or handed to another backend. A completion's drop looks there.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_core::backend::{Completion, Connection, Direction, Op, PeerBackendInfo};
use tensorwire_core::{Error, RegionId, Result};
use tokio::io::unix::AsyncFd;
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::{oneshot, watch};

use crate::NAME;
use crate::blob::{Endpoint, RegionKeys};
use crate::control::{self, Requests, Sender};
use crate::dispatch::{Action, Dispatch, OpKey};
use crate::region::{LocalRegion, unregistered};
use crate::shared::{Shared, lock};
use crate::verbs::{Cq, Qp, QpCaps, Sge, VerbsError, Wc, WcStatus, Wr, WrOp};
use crate::wire::{Msg, RailOffer};

fn verbs(e: VerbsError) -> Error {
    Error::Backend { backend: NAME, source: Arc::new(e) }
}

/// A lease: a region, with write access or not, under one access key (its bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct LeaseKey {
    region: RegionId,
    write: bool,
    key: u128,
}

/// What a granted lease says of the remote region, with the NIC keys of the blob it was asked
/// with (an op with another blob gets its own keys).
#[derive(Debug)]
struct LeaseData {
    len: u64,
    bases: Vec<(u8, u64)>,
    keys: RegionKeys,
    blob: Bytes,
}

impl LeaseData {
    fn base(&self, nic: u8) -> Option<u64> {
        self.bases.iter().find(|(n, _)| *n == nic).map(|&(_, b)| b)
    }
}

/// An op as the connection keeps it. Field order matters: the local registration (its MRs)
/// drops before the op, whose slice keeps the memory.
#[derive(Debug)]
pub(crate) struct OpCtx {
    local: Arc<LocalRegion>,
    lease: Option<Arc<LeaseData>>,
    op: Op,
    id: u64,
    key: LeaseKey,
    tx: oneshot::Sender<Result<()>>,
}

/// A rail's IO side.
#[derive(Debug)]
struct RailIo {
    local_nic: usize,
    remote_nic: u8,
    qp: Arc<dyn Qp>,
}

/// The completion slot of an op handed to another backend (dropped to cancel it).
#[derive(Clone)]
struct Handed(Arc<Mutex<Option<Completion>>>);

impl std::fmt::Debug for Handed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Handed(..)")
    }
}

/// Where an op is.
#[derive(Debug, Clone)]
enum Place {
    Waiting(LeaseKey),
    Dispatch(OpKey),
    Handed(Handed),
}

#[derive(Debug)]
struct State {
    dispatch: Dispatch<OpCtx>,
    rails: Vec<RailIo>,
    leases: HashMap<LeaseKey, (Arc<LeaseData>, u32)>,
    /// Leases the target asked back, with their ops still running.
    retiring: HashMap<LeaseKey, u32>,
    asked: HashSet<LeaseKey>,
    /// Leases asked for whose region the target asked back before its grant arrived (the
    /// target sends `Forget` as soon as it holds the lease, and the grant may come after it):
    /// the grant serves the ops that waited for it and then goes back, never cached.
    forgotten: HashSet<LeaseKey>,
    waiting: HashMap<LeaseKey, Vec<OpCtx>>,
    places: HashMap<u64, Place>,
    closed: Option<Error>,
    next_id: u64,
}

/// What is left to do once the lock is released.
#[derive(Debug, Default)]
struct After {
    done: Vec<(OpCtx, Result<()>)>,
    handed: Vec<(OpCtx, Error, Handed)>,
    rebuild: Vec<usize>,
    ask: Vec<(LeaseKey, Bytes)>,
    poke_timer: bool,
}

/// One connection's shared state.
#[derive(Debug)]
pub(crate) struct ConnShared {
    backend: Arc<Shared>,
    sender: Sender,
    requests: Arc<Requests>,
    /// One CQ per local NIC used (by NIC index).
    cqs: Vec<(usize, Arc<dyn Cq>)>,
    state: Mutex<State>,
    timer: Arc<tokio::sync::Notify>,
    /// Dropped with the connection: its tasks end.
    _stop: watch::Sender<()>,
    stop_rx: watch::Receiver<()>,
    caps: QpCaps,
}

/// NIC pairs: each local NIC with a reachable peer NIC (spread over the reachable ones).
fn pair(local: &[crate::verbs::NicInfo], remote: &Endpoint) -> Vec<(usize, u8)> {
    let mut pairs = Vec::new();
    for (i, l) in local.iter().enumerate() {
        let reach: Vec<u8> = remote
            .nics
            .iter()
            .enumerate()
            .filter(|(_, r)| r.reachable_from(l))
            .map(|(j, _)| j as u8)
            .collect();
        if !reach.is_empty() {
            pairs.push((i, reach[i % reach.len()]));
        }
    }
    pairs
}

/// Opens a connection to `peer` (see the module docs).
pub(crate) async fn connect(s: &Arc<Shared>, peer: &PeerBackendInfo) -> Result<Arc<ConnShared>> {
    let ep = Endpoint::decode(&peer.endpoint)?;
    let pairs = pair(&s.infos, &ep);
    if pairs.is_empty() {
        return Err(Error::Unsupported {
            backend: NAME,
            what: format!(
                "no NIC here reaches a NIC of {} (fabrics here {:x?}, there {:x?})",
                peer.engine,
                s.infos.iter().map(|n| n.address.fabric).collect::<Vec<_>>(),
                ep.nics.iter().map(|n| n.fabric).collect::<Vec<_>>()
            ),
        });
    }
    let host = s.host()?;
    let limit = s.cfg.answer_timeout;
    let sock = control::dial(ep.control, host.cluster_secret().as_ref(), limit).await?;
    let per_nic = s.cfg.qps_per_nic.clamp(1, crate::dispatch::MAX_CONN_RAILS / pairs.len().max(1));
    let window = s.cfg.data_path.window;
    let caps = QpCaps { max_send_wr: window + 4, max_sge: 1 };
    let mut cqs: Vec<(usize, Arc<dyn Cq>)> = Vec::new();
    for &(l, _) in &pairs {
        let depth = (per_nic as u32) * caps.max_send_wr * 2 + 64;
        cqs.push((l, s.nics[l].create_cq(depth).map_err(verbs)?));
    }
    let mut rails = Vec::new();
    let mut offers = Vec::new();
    for (&(l, r), (_, cq)) in pairs.iter().zip(&cqs) {
        for _ in 0..per_nic {
            let qp = s.nics[l].create_qp(cq, caps).map_err(verbs)?;
            qp.init().map_err(verbs)?;
            let psn = rand::random::<u32>() & 0x00ff_ffff;
            let addr = s.nics[l].info().address.qp(qp.qpn(), psn);
            offers.push(RailOffer { local_nic: l as u8, remote_nic: r, qp: addr });
            rails.push((l, r, qp, psn));
        }
    }
    let (mut rd, mut wr) = sock.into_split();
    let hello = async {
        control::write(&mut wr, &Msg::Hello { rails: offers }).await?;
        control::read::<Msg>(&mut rd).await
    };
    let answer = tokio::time::timeout(limit, hello)
        .await
        .map_err(|_| Error::timeout(format!("rdma: setup with {}", peer.engine), limit))??;
    let Some(Msg::HelloAck { rails: answers }) = answer else {
        return Err(Error::protocol("rdma: the peer did not answer Hello with HelloAck"));
    };
    if answers.len() != rails.len() {
        return Err(Error::protocol(format!(
            "rdma: {} rails offered, {} answered",
            rails.len(),
            answers.len()
        )));
    }
    let mut up = Vec::new();
    for ((l, r, qp, psn), a) in rails.into_iter().zip(answers) {
        let connected = a.and_then(|addr| qp.connect(psn, &addr, &s.cfg.timing).map_err(verbs));
        match connected {
            Ok(()) => up.push(RailIo { local_nic: l, remote_nic: r, qp }),
            Err(e) => {
                tracing::warn!(nic = %s.infos[l].address.name, error = %e, "rdma: a rail could not be set up")
            }
        }
    }
    if up.is_empty() {
        return Err(Error::Unsupported {
            backend: NAME,
            what: format!("no rail to {} could be set up", peer.engine),
        });
    }
    let cfg = s.cfg.data_path;
    let (stop, stop_rx) = watch::channel(());
    let conn = Arc::new(ConnShared {
        backend: s.clone(),
        sender: Sender::start(wr),
        requests: Arc::new(Requests::default()),
        cqs,
        state: Mutex::new(State {
            dispatch: Dispatch::new(cfg, up.len()),
            rails: up,
            leases: HashMap::new(),
            retiring: HashMap::new(),
            asked: HashSet::new(),
            forgotten: HashSet::new(),
            waiting: HashMap::new(),
            places: HashMap::new(),
            closed: None,
            next_id: 0,
        }),
        timer: Arc::new(tokio::sync::Notify::new()),
        _stop: stop,
        stop_rx,
        caps,
    });
    tokio::spawn(reader(Arc::downgrade(&conn), rd));
    for (_, cq) in &conn.cqs {
        tokio::spawn(poll_cq(Arc::downgrade(&conn), cq.clone(), conn.stop_rx.clone()));
    }
    tokio::spawn(timer(Arc::downgrade(&conn), conn.timer.clone(), conn.stop_rx.clone()));
    Ok(conn)
}

impl State {
    /// Starts a leased op in the dispatcher (or ends it at once: out of bounds, no rail).
    fn start(
        &mut self,
        mut ctx: OpCtx,
        lease: &Arc<LeaseData>,
        now: Instant,
        out: &mut Vec<Action<OpCtx>>,
        after: &mut After,
    ) {
        let (offset, len) = (ctx.op.remote().offset, ctx.op.local().len());
        if offset.checked_add(len).is_none_or(|end| end > lease.len) {
            let e = Error::OutOfBounds {
                what: format!("remote region {}", ctx.op.remote().region.0),
                offset,
                len,
                limit: lease.len,
            };
            self.places.remove(&ctx.id);
            after.done.push((ctx, Err(e)));
            return;
        }
        let lease = if ctx.op.remote().blob == lease.blob {
            lease.clone()
        } else {
            // Another blob for the same region and key: its own NIC keys, the lease's addresses.
            match RegionKeys::decode(&ctx.op.remote().blob) {
                Ok(keys) => Arc::new(LeaseData {
                    len: lease.len,
                    bases: lease.bases.clone(),
                    keys,
                    blob: ctx.op.remote().blob.clone(),
                }),
                Err(e) => {
                    self.places.remove(&ctx.id);
                    after.done.push((ctx, Err(e)));
                    return;
                }
            }
        };
        let local_nics = ctx.local.on();
        let (mut allowed, mut preferred) = (0u64, 0u64);
        for (i, r) in self.rails.iter().enumerate() {
            let here = local_nics & (1 << r.local_nic) != 0;
            let there = lease.keys.on(r.remote_nic).is_some() && lease.base(r.remote_nic).is_some();
            if here && there {
                allowed |= 1 << i;
                if ctx.local.preferred & (1 << r.local_nic) != 0 {
                    preferred |= 1 << i;
                }
            }
        }
        if let Some(e) = self.leases.get_mut(&ctx.key) {
            e.1 += 1;
        }
        ctx.lease = Some(lease.clone());
        let id = ctx.id;
        let k = self.dispatch.submit(ctx, len, allowed, preferred, now, out);
        self.places.insert(id, Place::Dispatch(k));
    }

    /// A lease the target asked back: given back now if no op uses it, else once the last ends.
    fn retire(&mut self, key: LeaseKey, users: u32, sender: &Sender) {
        if users == 0 {
            sender.send_later(Msg::Released { region: key.region, write: key.write });
        } else {
            self.retiring.insert(key, users);
        }
    }

    /// An op left: its lease has one user less (a retiring lease is given back at zero).
    fn release(&mut self, key: &LeaseKey, sender: &Sender) {
        if let Some(e) = self.leases.get_mut(key) {
            e.1 = e.1.saturating_sub(1);
        } else if let Some(n) = self.retiring.get_mut(key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.retiring.remove(key);
                sender.send_later(Msg::Released { region: key.region, write: key.write });
            }
        }
    }
}

impl ConnShared {
    /// Carries out the dispatcher's actions under the lock; what must wait for the lock to be
    /// released goes into `after`.
    fn run(
        &self,
        st: &mut State,
        mut actions: Vec<Action<OpCtx>>,
        now: Instant,
        after: &mut After,
    ) {
        while !actions.is_empty() {
            let mut more = Vec::new();
            let mut posts: Vec<(usize, u64, OpKey, u64, u64)> = Vec::new();
            for a in actions {
                match a {
                    Action::Post { wr_id, rail, op, offset, len } => {
                        posts.push((rail, wr_id, op, offset, len));
                    }
                    Action::Finish { payload, result } => {
                        st.places.remove(&payload.id);
                        st.release(&payload.key, &self.sender);
                        after.done.push((payload, result));
                    }
                    Action::FallBack { payload, error } => {
                        st.release(&payload.key, &self.sender);
                        let slot = Handed(Arc::new(Mutex::new(None)));
                        st.places.insert(payload.id, Place::Handed(slot.clone()));
                        after.handed.push((payload, error, slot));
                    }
                    Action::Rebuild { rail } => after.rebuild.push(rail),
                }
            }
            self.post(st, posts, now, &mut more, after);
            actions = more;
        }
    }

    /// Posts requests, per rail in order; a request a QP refuses completes as a path failure.
    fn post(
        &self,
        st: &mut State,
        mut posts: Vec<(usize, u64, OpKey, u64, u64)>,
        now: Instant,
        more: &mut Vec<Action<OpCtx>>,
        after: &mut After,
    ) {
        posts.sort_by_key(|p| p.0);
        let mut i = 0;
        while i < posts.len() {
            let rail = posts[i].0;
            let end = posts[i..].iter().position(|p| p.0 != rail).map_or(posts.len(), |n| i + n);
            let group = &posts[i..end];
            let io = &st.rails[rail];
            let nic = io.local_nic;
            let mut sges: Vec<Sge> = Vec::with_capacity(group.len());
            let mut wrs: Vec<(u64, WrOp, u64, u32)> = Vec::with_capacity(group.len());
            let mut bad: Vec<u64> = Vec::new();
            for &(_, wr_id, op, offset, len) in group {
                let built = st.dispatch.payload(op).and_then(|ctx| {
                    let mr = ctx.local.mrs.get(nic)?.as_ref()?;
                    let lease = ctx.lease.as_ref()?;
                    let remote = lease.base(io.remote_nic)? + ctx.op.remote().offset + offset;
                    let rkey = lease.keys.on(io.remote_nic)?;
                    let addr = mr.base() + ctx.op.local().offset() + offset;
                    let dir = match ctx.op.dir() {
                        Direction::Write => WrOp::Write,
                        Direction::Read => WrOp::Read,
                    };
                    Some((
                        Sge { addr, len: len as u32, lkey: mr.lkey() },
                        (wr_id, dir, remote, rkey),
                    ))
                });
                match built {
                    Some((sge, w)) => {
                        sges.push(sge);
                        wrs.push(w);
                    }
                    None => bad.push(wr_id),
                }
            }
            let list: Vec<Wr<'_>> = wrs
                .iter()
                .zip(&sges)
                .map(|(&(id, op, remote_addr, rkey), sge)| Wr {
                    id,
                    op,
                    sges: std::slice::from_ref(sge),
                    remote_addr,
                    rkey,
                })
                .collect();
            let counters = &self.backend.counters[nic];
            if let Err((n, e)) = io.qp.post(&list) {
                tracing::warn!(nic = %self.backend.infos[nic].address.name, error = %e, "rdma: post failed");
                counters.inflight.fetch_add(n as i64, Ordering::Relaxed);
                bad.extend(wrs[n..].iter().map(|w| w.0));
                st.dispatch.rail_failed(rail, now);
                after.poke_timer = true;
            } else {
                counters.inflight.fetch_add(list.len() as i64, Ordering::Relaxed);
            }
            drop(list);
            for id in bad {
                st.dispatch.completed(id, WcStatus::Other(u32::MAX), now, more);
            }
            i = end;
        }
    }

    /// Does what waited for the lock: ends ops, hands ops over, starts rebuilds and leases.
    fn finish(self: &Arc<Self>, after: After) {
        for (ctx, result) in after.done {
            let OpCtx { local, lease, op, tx, .. } = ctx;
            drop(local);
            drop(lease);
            drop(op);
            let _ = tx.send(result);
        }
        for (ctx, error, slot) in after.handed {
            let OpCtx { local, lease, op, tx, id, .. } = ctx;
            drop(local);
            drop(lease);
            *lock(&slot.0) = Some(op.fall_back(error));
            tokio::spawn(handed(Arc::downgrade(self), id, slot, tx));
        }
        for rail in after.rebuild {
            tokio::spawn(rebuild(Arc::downgrade(self), rail));
        }
        for (key, blob) in after.ask {
            tokio::spawn(ask_lease(Arc::downgrade(self), key, blob));
        }
        if after.poke_timer {
            self.timer.notify_one();
        }
    }

    /// Takes every completion `cq` has and feeds them to the dispatcher.
    fn progress(self: &Arc<Self>, cq: &Arc<dyn Cq>) {
        let mut wcs: Vec<Wc> = Vec::with_capacity(64);
        loop {
            wcs.clear();
            match cq.poll(&mut wcs, 64) {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(error = %e, "rdma: polling a completion queue failed");
                    return;
                }
            }
            let now = Instant::now();
            let mut after = After::default();
            let mut out = Vec::new();
            {
                let mut st = lock(&self.state);
                for wc in &wcs {
                    let done = st.dispatch.completed(wc.id, wc.status, now, &mut out);
                    if let Some((rail, bytes)) = done {
                        let c = &self.backend.counters[st.rails[rail].local_nic];
                        c.inflight.fetch_sub(1, Ordering::Relaxed);
                        if wc.status == WcStatus::Success {
                            c.bytes.fetch_add(bytes, Ordering::Relaxed);
                            c.ops.fetch_add(1, Ordering::Relaxed);
                        } else {
                            if wc.status != WcStatus::Flushed {
                                c.errors.fetch_add(1, Ordering::Relaxed);
                            }
                            after.poke_timer = true;
                        }
                    }
                }
                self.run(&mut st, std::mem::take(&mut out), now, &mut after);
            }
            self.finish(after);
        }
    }

    fn progress_all(self: &Arc<Self>) {
        for (_, cq) in &self.cqs {
            self.progress(cq);
        }
    }

    /// The connection is over: every op fails with `e` (once its requests are flushed).
    pub(crate) fn close(self: &Arc<Self>, e: Error) {
        self.requests.close(e.clone());
        let mut after = After::default();
        {
            let mut st = lock(&self.state);
            if st.closed.is_some() {
                return;
            }
            st.closed = Some(e.clone());
            for (_, ops) in st.waiting.drain() {
                for ctx in ops {
                    after.done.push((ctx, Err(e.clone())));
                }
            }
            for (ctx, _) in &after.done {
                st.places.remove(&ctx.id);
            }
            let mut out = Vec::new();
            st.dispatch.fail_all(&e, &mut out);
            for r in &st.rails {
                let _ = r.qp.to_error();
            }
            self.run(&mut st, out, Instant::now(), &mut after);
        }
        self.sender.send_later(Msg::Bye);
        self.finish(after);
    }

    /// The target asked `region` back: its leases retire, given back once their ops end, and
    /// so do the leases of it still being asked for, once granted.
    fn forget(&self, region: RegionId) {
        let mut st = lock(&self.state);
        let keys: Vec<LeaseKey> =
            st.leases.keys().filter(|k| k.region == region).copied().collect();
        for k in keys {
            if let Some((_, users)) = st.leases.remove(&k) {
                st.retire(k, users, &self.sender);
            }
        }
        let asked: Vec<LeaseKey> =
            st.asked.iter().filter(|k| k.region == region).copied().collect();
        st.forgotten.extend(asked);
    }

    /// Cancels op `id` (its completion was dropped); for a READ, returns only once none of its
    /// requests can write into local memory any more.
    fn cancel(self: &Arc<Self>, id: u64, reads: bool) {
        let mut after = After::default();
        let mut dropped = None;
        let mut handed = None;
        let mut key = None;
        {
            let mut st = lock(&self.state);
            match st.places.get(&id).cloned() {
                None => return,
                Some(Place::Waiting(k)) => {
                    st.places.remove(&id);
                    if let Some(list) = st.waiting.get_mut(&k) {
                        if let Some(i) = list.iter().position(|c| c.id == id) {
                            dropped = Some(list.swap_remove(i));
                        }
                    }
                }
                Some(Place::Dispatch(k)) => {
                    let mut out = Vec::new();
                    st.dispatch.cancel(k, &mut out);
                    self.run(&mut st, out, Instant::now(), &mut after);
                    key = Some(k);
                }
                Some(Place::Handed(slot)) => {
                    st.places.remove(&id);
                    handed = Some(slot);
                }
            }
        }
        self.finish(after);
        drop(dropped);
        if let Some(slot) = handed {
            // Dropping the other backend's completion cancels the op there, by its rules.
            let c = lock(&slot.0).take();
            drop(c);
        }
        if let (true, Some(k)) = (reads, key) {
            self.wait_out(k);
        }
    }

    /// Waits (helping progress) until op `k` has no request in flight; past the cancel timeout
    /// its QPs are moved to ERROR so the NIC flushes them.
    fn wait_out(self: &Arc<Self>, k: OpKey) {
        let bound = self.backend.cfg.cancel_timeout;
        let start = Instant::now();
        let mut errored = false;
        loop {
            let rails = {
                let st = lock(&self.state);
                if st.dispatch.op_inflight(k) == 0 {
                    return;
                }
                st.dispatch.op_rails(k)
            };
            self.progress_all();
            let waited = start.elapsed();
            if !errored && waited > bound {
                errored = true;
                let st = lock(&self.state);
                for (i, r) in st.rails.iter().enumerate() {
                    if rails & (1 << i) != 0 {
                        let _ = r.qp.to_error();
                    }
                }
            }
            if waited > bound * 3 {
                tracing::error!("rdma: a cancelled READ still has requests in flight");
                return;
            }
            std::thread::sleep(Duration::from_micros(if waited.as_millis() < 1 {
                10
            } else {
                200
            }));
        }
    }
}

/// The connection as the engine holds it; dropping it ends the connection.
#[derive(Debug)]
pub(crate) struct RdmaConnection {
    conn: Arc<ConnShared>,
}

impl RdmaConnection {
    pub(crate) fn new(conn: Arc<ConnShared>) -> RdmaConnection {
        RdmaConnection { conn }
    }
}

impl Drop for RdmaConnection {
    fn drop(&mut self) {
        self.conn.close(Error::PeerClosed("rdma: connection dropped".into()));
    }
}

impl Connection for RdmaConnection {
    fn submit(&self, ops: Vec<Op>) -> Vec<Completion> {
        let c = &self.conn;
        let now = Instant::now();
        let mut completions = Vec::with_capacity(ops.len());
        let mut after = After::default();
        let mut out = Vec::new();
        let mut early: Vec<(Op, oneshot::Sender<Result<()>>, Result<()>)> = Vec::new();
        {
            let mut st = lock(&c.state);
            for op in ops {
                let id = st.next_id;
                st.next_id += 1;
                let (tx, rx) = oneshot::channel();
                let reads = op.dir() == Direction::Read;
                completions.push(Box::pin(RdmaCompletion {
                    rx,
                    conn: c.clone(),
                    id,
                    reads,
                    finished: false,
                }) as Completion);
                if let Some(e) = &st.closed {
                    early.push((op, tx, Err(e.clone())));
                    continue;
                }
                if op.local().is_empty() {
                    early.push((op, tx, Ok(())));
                    continue;
                }
                let Some(local) = c.backend.region(op.local().region_id()) else {
                    let e = unregistered(op.local().region_id());
                    early.push((op, tx, Err(e)));
                    continue;
                };
                let r = op.remote();
                let key = LeaseKey {
                    region: r.region,
                    write: op.dir() == Direction::Write,
                    key: r.key.to_bits(),
                };
                let ctx = OpCtx { local, lease: None, op, id, key, tx };
                match st.leases.get(&key).map(|l| l.0.clone()) {
                    Some(lease) => st.start(ctx, &lease, now, &mut out, &mut after),
                    None => {
                        st.places.insert(id, Place::Waiting(key));
                        if st.asked.insert(key) {
                            after.ask.push((key, ctx.op.remote().blob.clone()));
                        }
                        st.waiting.entry(key).or_default().push(ctx);
                    }
                }
            }
            c.run(&mut st, out, now, &mut after);
        }
        for (op, tx, r) in early {
            drop(op);
            let _ = tx.send(r);
        }
        c.finish(after);
        completions
    }

    fn notify(&self, msg: Bytes) -> Completion {
        let c = self.conn.clone();
        Box::pin(async move {
            let limit = c.backend.cfg.answer_timeout;
            let m = control::ask(&c.sender, &c.requests, limit, "notification answer", |req| {
                Msg::Notify { req, msg }
            })
            .await?;
            match m {
                Msg::NotifyAck { error: None, .. } => Ok(()),
                Msg::NotifyAck { error: Some(e), .. } => Err(e),
                other => Err(Error::protocol(format!(
                    "rdma: notification answered with kind {}",
                    other.kind()
                ))),
            }
        })
    }

    fn broken(&self) -> Option<Error> {
        lock(&self.conn.state).closed.clone()
    }
}

/// One op's completion; dropping it before it resolves cancels the op (see the crate docs).
struct RdmaCompletion {
    rx: oneshot::Receiver<Result<()>>,
    conn: Arc<ConnShared>,
    id: u64,
    reads: bool,
    finished: bool,
}

impl Future for RdmaCompletion {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(r) => {
                self.finished = true;
                Poll::Ready(r.unwrap_or_else(|_| {
                    Err(Error::PeerClosed("rdma: the op was dropped unfinished".into()))
                }))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for RdmaCompletion {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.cancel(self.id, self.reads);
        }
    }
}

/// Drives an op another backend took over, and delivers its result.
async fn handed(conn: Weak<ConnShared>, id: u64, slot: Handed, tx: oneshot::Sender<Result<()>>) {
    let result = std::future::poll_fn(|cx| match lock(&slot.0).as_mut() {
        Some(c) => c.as_mut().poll(cx),
        None => Poll::Ready(Err(Error::PeerClosed("rdma: op cancelled".into()))),
    })
    .await;
    lock(&slot.0).take();
    if let Some(c) = conn.upgrade() {
        lock(&c.state).places.remove(&id);
    }
    let _ = tx.send(result);
}

/// Asks the target for a lease, then starts (or fails) the ops waiting for it.
async fn ask_lease(conn: Weak<ConnShared>, key: LeaseKey, blob: Bytes) {
    let Some(c) = conn.upgrade() else { return };
    let limit = c.backend.cfg.answer_timeout;
    let LeaseKey { region, write, key: bits } = key;
    let asked = control::ask(&c.sender, &c.requests, limit, "lease answer", |req| Msg::Lease {
        req,
        region,
        key: tensorwire_core::AccessKey::from_bits(bits),
        write,
    })
    .await;
    let granted = match asked {
        Ok(Msg::Granted { len, bases, .. }) => {
            RegionKeys::decode(&blob).map(|keys| LeaseData { len, bases, keys, blob })
        }
        Ok(Msg::Refused { error, .. }) => Err(error),
        Ok(other) => {
            Err(Error::protocol(format!("rdma: lease answered with kind {}", other.kind())))
        }
        Err(e) => Err(e),
    };
    let now = Instant::now();
    let mut after = After::default();
    {
        let mut st = lock(&c.state);
        st.asked.remove(&key);
        let forgotten = st.forgotten.remove(&key);
        let waiting = st.waiting.remove(&key).unwrap_or_default();
        let mut out = Vec::new();
        match granted {
            Ok(data) if st.closed.is_none() => {
                let lease = Arc::new(data);
                st.leases.insert(key, (lease.clone(), 0));
                for ctx in waiting {
                    st.start(ctx, &lease, now, &mut out, &mut after);
                }
                if forgotten {
                    if let Some((_, users)) = st.leases.remove(&key) {
                        st.retire(key, users, &c.sender);
                    }
                }
            }
            Ok(_) => {
                let e = st.closed.clone().unwrap_or_else(|| Error::PeerClosed("closed".into()));
                for ctx in waiting {
                    st.places.remove(&ctx.id);
                    after.done.push((ctx, Err(e.clone())));
                }
            }
            Err(e) => {
                for ctx in waiting {
                    st.places.remove(&ctx.id);
                    after.done.push((ctx, Err(e.clone())));
                }
            }
        }
        c.run(&mut st, out, now, &mut after);
    }
    c.finish(after);
}

/// Replaces a rail's QP: a new one here, the target's new one there, connected.
async fn rebuild(conn: Weak<ConnShared>, rail: usize) {
    let Some(c) = conn.upgrade() else { return };
    let made = async {
        let (nic, remote_nic) = {
            let st = lock(&c.state);
            (st.rails[rail].local_nic, st.rails[rail].remote_nic)
        };
        let cq = c
            .cqs
            .iter()
            .find(|(n, _)| *n == nic)
            .map(|(_, cq)| cq.clone())
            .ok_or_else(|| Error::Internal(format!("rdma: no CQ for NIC {nic}")))?;
        let n = &c.backend.nics[nic];
        let qp = n.create_qp(&cq, c.caps).map_err(verbs)?;
        qp.init().map_err(verbs)?;
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        let addr = n.info().address.qp(qp.qpn(), psn);
        let offer = RailOffer { local_nic: nic as u8, remote_nic, qp: addr };
        let limit = c.backend.cfg.answer_timeout;
        let m = control::ask(&c.sender, &c.requests, limit, "rail answer", |req| Msg::Rail {
            req,
            rail: rail as u16,
            offer,
        })
        .await?;
        match m {
            Msg::RailAck { answer: Ok(theirs), .. } => {
                qp.connect(psn, &theirs, &c.backend.cfg.timing).map_err(verbs)?;
                Ok(qp)
            }
            Msg::RailAck { answer: Err(e), .. } => Err(e),
            other => {
                Err(Error::protocol(format!("rdma: rail answered with kind {}", other.kind())))
            }
        }
    };
    let made: Result<Arc<dyn Qp>> = made.await;
    let now = Instant::now();
    let mut after = After { poke_timer: true, ..After::default() };
    {
        let mut st = lock(&c.state);
        let mut out = Vec::new();
        match made {
            Ok(qp) if st.closed.is_none() => {
                st.rails[rail].qp = qp;
                st.dispatch.rebuilt(rail, true, now, &mut out);
                tracing::debug!(rail, "rdma: rail rebuilt");
            }
            Ok(_) => st.dispatch.rebuilt(rail, false, now, &mut out),
            Err(e) => {
                tracing::debug!(rail, error = %e, "rdma: rail rebuild failed");
                st.dispatch.rebuilt(rail, false, now, &mut out);
            }
        }
        c.run(&mut st, out, now, &mut after);
    }
    c.finish(after);
}

/// Reads the target's messages: answers to requests, Forget, Bye.
async fn reader(conn: Weak<ConnShared>, mut rd: OwnedReadHalf) {
    loop {
        let m = control::read::<Msg>(&mut rd).await;
        let Some(c) = conn.upgrade() else { return };
        match m {
            Ok(Some(m)) => match m {
                Msg::Granted { req, .. }
                | Msg::Refused { req, .. }
                | Msg::NotifyAck { req, .. }
                | Msg::RailAck { req, .. } => {
                    c.requests.answer(req, m);
                }
                Msg::Forget { region } => c.forget(region),
                Msg::Bye => {
                    c.close(Error::PeerClosed("rdma: the peer ended the connection".into()));
                    return;
                }
                other => {
                    c.close(Error::protocol(format!(
                        "rdma: unexpected message kind {} from the target",
                        other.kind()
                    )));
                    return;
                }
            },
            Ok(None) => {
                c.close(Error::PeerClosed("rdma: the peer closed the control channel".into()));
                return;
            }
            Err(e) => {
                c.close(e);
                return;
            }
        }
    }
}

/// A CQ's completion channel as tokio sees it.
struct ChannelFd(Arc<dyn Cq>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.event_fd()
    }
}

/// Sleeps on a CQ's completion channel and feeds its completions to the connection.
async fn poll_cq(conn: Weak<ConnShared>, cq: Arc<dyn Cq>, mut stop: watch::Receiver<()>) {
    // SAFETY: the descriptor is the CQ's completion channel, open for as long as the CQ lives,
    // and `ChannelFd` holds the CQ for the whole life of the `AsyncFd`.
    let registered = unsafe {
        AsyncFd::register_with_interest(ChannelFd(cq.clone()), tokio::io::Interest::READABLE)
    };
    let fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            tracing::error!(error = %e, "rdma: cannot watch a completion channel");
            return;
        }
    };
    loop {
        {
            let Some(c) = conn.upgrade() else { return };
            if let Err(e) = cq.arm() {
                tracing::error!(error = %e, "rdma: cannot arm a completion queue");
            }
            c.progress(&cq);
        }
        tokio::select! {
            ready = fd.readable() => match ready {
                Ok(mut g) => {
                    g.clear_ready();
                    let _ = cq.take_events();
                }
                Err(e) => {
                    tracing::error!(error = %e, "rdma: completion channel failed");
                    return;
                }
            },
            _ = stop.changed() => return,
        }
    }
}

/// Ticks the dispatcher when a rail's pause ends (rebuilds rails).
async fn timer(
    conn: Weak<ConnShared>,
    poke: Arc<tokio::sync::Notify>,
    mut stop: watch::Receiver<()>,
) {
    loop {
        let wake = {
            let Some(c) = conn.upgrade() else { return };
            let now = Instant::now();
            let mut after = After::default();
            let wake = {
                let mut st = lock(&c.state);
                let mut out = Vec::new();
                let w = st.dispatch.tick(now, &mut out);
                c.run(&mut st, out, now, &mut after);
                w
            };
            c.finish(after);
            wake
        };
        let sleep = async {
            match wake {
                Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = sleep => {}
            _ = poke.notified() => {}
            _ = stop.changed() => return,
        }
    }
}
