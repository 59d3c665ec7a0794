//! The IO shell around the dispatcher: posting its requests, feeding it completions,
//! ending ops, closing, cancellation and the fallback of ops that lost every rail.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tensorwire_core::backend::Direction;
use tensorwire_core::{Error, RegionId};

use crate::dispatch::{Action, OpKey};
use crate::shared::lock;
use crate::verbs::{Cq, Sge, Wc, WcStatus, Wr, WrOp};
use crate::wire::Msg;

use super::state::{After, ConnShared, Handed, LeaseKey, OpCtx, Place, State};
use super::tasks::{ask_lease, handed, rebuild};

impl ConnShared {
    /// Carries out the dispatcher's actions under the lock; what must wait for the lock to be
    /// released goes into `after`.
    pub(super) fn run(
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
    pub(super) fn post(
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
    pub(super) fn finish(self: &Arc<Self>, after: After) {
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
    pub(super) fn progress(self: &Arc<Self>, cq: &Arc<dyn Cq>) {
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

    pub(super) fn progress_all(self: &Arc<Self>) {
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
    pub(super) fn forget(&self, region: RegionId) {
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
    pub(super) fn cancel(self: &Arc<Self>, id: u64, reads: bool) {
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
    pub(super) fn wait_out(self: &Arc<Self>, k: OpKey) {
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
