//! The initiating side, on the progress thread. An op asks the target to check and hold the
//! region (Begin); once granted it moves its bytes with `ucp_put_nbx`/`ucp_get_nbx` in segments
//! (at most `window` in flight), a WRITE then flushes the endpoint so the bytes are in place at
//! the peer, and End releases the region; the op is dropped (releasing the engine's notification
//! fence) only then. A notification is acknowledged by the target.
//!
//! Every Begin asks for a lease. Once the target grants one, later ops on the region with the
//! same key and access start at once, with no Begin and no End (the op's range is checked here
//! against the leased region). On the target's Forget the lease takes no new ops; once those on
//! it finished (flushed), Released goes back.

use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_core::backend::Direction;
use tensorwire_core::backend::kit::{MAX_NOTIFY_WIRE, decode_error};
use tensorwire_core::{Error, Missing, RegionId, Result};
use tensorwire_ucx_sys as sys;
use tokio::sync::oneshot;

use crate::conns::{HELLO, Lease, OpState, OutConn};
use crate::ffi::{self, RemoteKey, Rma, Started};
use crate::mapped::Mapped;
use crate::progress::Progress;
use crate::tokens::{INBOUND, Submitted, Token};
use crate::wire::{Kind, LEASE, Msg, WRITE};

/// Remote keys cached per connection before the cache starts over.
const MAX_RKEYS: usize = 4096;
fn closed() -> Error {
    Error::PeerClosed("ucx connection closed".into())
}

impl Progress {
    pub(crate) fn connect(&mut self, address: &[u8], reply: oneshot::Sender<Result<u64>>) {
        if self.stopping.is_some() {
            let _ = reply.send(Err(Error::PeerClosed("local ucx backend shut down".into())));
            return;
        }
        let mut id = rand::random::<u64>() & !INBOUND;
        while id == 0 || self.out.contains_key(&id) {
            id = rand::random::<u64>() & !INBOUND;
        }
        let ep = match self.worker.connect(address, id, self.cfg.peer_failure_detection) {
            Ok(ep) => ep,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let hello = Msg { body: &self.address, ..Msg::new(Kind::Hello, id, HELLO) };
        if let Err(e) = self.tokens.send(&ep, id, &hello) {
            let _ = reply.send(Err(e));
            return;
        }
        let deadline = Instant::now() + self.cfg.answer_timeout;
        self.out.insert(
            id,
            OutConn {
                rkeys: HashMap::new(),
                ep,
                dead: None,
                connecting: Some(reply),
                grants: HashMap::new(),
                notifies: HashMap::new(),
                deadlines: VecDeque::from([(deadline, HELLO)]),
                next_req: HELLO + 1,
                ops: HashSet::new(),
                closing: false,
                leases: HashMap::new(),
            },
        );
    }

    pub(crate) fn hello_ack(&mut self, msg: &Msg<'_>) {
        let Some(c) = self.out.get_mut(&msg.conn) else { return };
        let Some(reply) = c.connecting.take() else { return };
        if msg.ok() {
            let _ = reply.send(Ok(msg.conn));
        } else {
            let e = decode_error(msg.body).unwrap_or_else(|e| e);
            let _ = reply.send(Err(e.clone()));
            self.kill(msg.conn, e);
        }
    }

    pub(crate) fn submit(&mut self, conn: u64, ops: Vec<Submitted>) {
        let now = Instant::now();
        for s in ops {
            let Some(c) = self.out.get_mut(&conn) else {
                let _ = s.done.send(Err(closed()));
                continue;
            };
            if let Some(e) = &c.dead {
                let _ = s.done.send(Err(e.clone()));
                continue;
            }
            if s.op.local().is_empty() {
                let _ = s.done.send(Ok(()));
                continue;
            }
            let write = s.op.dir() == Direction::Write;
            let region = s.op.remote().region;
            let memh = self.regions.get(&s.op.local().region_id()).cloned();
            // On a lease: start now, no Begin.
            let (off, len) = (s.op.remote().offset, s.op.local().len());
            if let Some(l) = c.leases.get_mut(&(region, write)).filter(|l| {
                !l.revoked
                    && l.key == s.op.remote().key
                    && off.checked_add(len).is_some_and(|end| end <= l.len)
            }) {
                l.users += 1;
                self.next_op += 1;
                let id = self.next_op;
                c.ops.insert(id);
                let mut op = OpState::new(conn, 0, write, memh, s, now);
                (op.granted, op.leased, op.addr, op.rkey) =
                    (true, true, l.base + off, Some(l.rkey.clone()));
                self.ops.insert(id, op);
                self.runnable.insert((len, id));
                continue;
            }
            let req = c.next_req;
            c.next_req += 1;
            let begin = Msg {
                flags: if write { WRITE | LEASE } else { LEASE },
                region: s.op.remote().region,
                key: s.op.remote().key,
                offset: s.op.remote().offset,
                len: s.op.local().len(),
                ..Msg::new(Kind::Begin, conn, req)
            };
            if let Err(e) = self.tokens.send(&c.ep, conn, &begin) {
                let _ = s.done.send(Err(e));
                continue;
            }
            self.next_op += 1;
            let id = self.next_op;
            c.grants.insert(req, id);
            c.deadlines.push_back((now + self.cfg.answer_timeout, req));
            c.ops.insert(id);
            self.ops.insert(id, OpState::new(conn, req, write, memh, s, now));
        }
    }

    /// The target is deregistering `msg.region`: its leases take no new ops and go back once
    /// their ops are over.
    pub(crate) fn forgotten(&mut self, msg: &Msg<'_>) {
        let Some(c) = self.out.get_mut(&msg.conn) else { return };
        c.rkeys.remove(&msg.region);
        let mut idle = Vec::new();
        for write in [false, true] {
            if let Some(l) = c.leases.get_mut(&(msg.region, write)) {
                // No new op copies into it from here on, and none still does.
                self.mapped.remove(msg.conn, (msg.region, write));
                l.revoked = true;
                if l.users == 0 {
                    idle.push(write);
                }
            }
        }
        for write in idle {
            release(&mut self.tokens, &self.mapped, c, msg.conn, (msg.region, write));
        }
    }

    pub(crate) fn granted(&mut self, msg: &Msg<'_>) {
        let Some(c) = self.out.get_mut(&msg.conn) else { return };
        let Some(id) = c.grants.remove(&msg.req) else {
            tracing::warn!(req = msg.req, "ucx: a grant for no waiting op");
            return;
        };
        let Some(op) = self.ops.get_mut(&id) else { return };
        op.last = Instant::now();
        if !msg.ok() {
            let e = decode_error(msg.body).unwrap_or_else(|e| e);
            if matches!(e, Error::NotFound(Missing::Region(_) | Missing::Deregistered(_))) {
                c.rkeys.remove(&op.region);
            }
            op.error = Some(e);
            self.finish(id);
            return;
        }
        op.granted = true;
        op.addr = msg.offset;
        let leased = msg.flags & LEASE != 0;
        let (off, len) = (op.work.remote().offset, op.work.local().len());
        let rkey = if leased {
            // The whole region: this op's range is inside it, at its offset.
            match off.checked_add(len).filter(|&end| end <= msg.len) {
                Some(_) => rkey_for(c, op.region, op.blob.as_ref()).inspect(|k| {
                    op.addr = msg.offset + off;
                    op.leased = true;
                    let lease = Lease {
                        base: msg.offset,
                        len: msg.len,
                        key: op.work.remote().key,
                        rkey: k.clone(),
                        users: 1,
                        revoked: false,
                    };
                    c.leases.insert((op.region, op.write), lease);
                    if let Some(base) = k.mapped(msg.offset, msg.len) {
                        let of = (op.region, op.write);
                        self.mapped.add(msg.conn, of, base, msg.len, op.work.remote().key);
                    }
                }),
                None => Err(Error::protocol("ucx: a lease that does not cover its op")),
            }
        } else if msg.len != op.work.local().len() {
            Err(Error::protocol(format!(
                "ucx: granted {} bytes of {}",
                msg.len,
                op.work.local().len()
            )))
        } else {
            rkey_for(c, op.region, op.blob.as_ref())
        };
        match rkey {
            Ok(k) => {
                // Started after every message of this batch is handled, smallest first: grants
                // that arrive together start small ops before a large one.
                op.rkey = Some(k);
                self.runnable.insert((op.work.local().len(), id));
            }
            Err(e) => {
                op.error = Some(e);
                if leased && !op.leased {
                    // Granted, yet unusable here: give the region back at once.
                    op.granted = false;
                    release(&mut self.tokens, &self.mapped, c, msg.conn, (op.region, op.write));
                }
                self.pump(id);
            }
        }
    }

    /// Starts what the op can start; finishes it when nothing is left in flight.
    fn pump(&mut self, id: u64) {
        let (seg, window) = (self.cfg.segment_bytes.max(1), self.cfg.window.max(1));
        let Some(op) = self.ops.get_mut(&id) else { return };
        let c = self.out.get(&op.conn);
        match c.map(|c| &c.dead) {
            None => {
                op.error.get_or_insert_with(closed);
            }
            Some(Some(e)) => {
                op.error.get_or_insert_with(|| e.clone());
            }
            Some(None) => {}
        }
        let len = op.work.local().len();
        // One segment per turn: the thread then handles new messages and gives every other
        // runnable op (smallest remainder first) its turn, so a small op never waits for a large
        // one to finish, even where requests complete inline (CMA copies in the call).
        let turn = op.error.is_none() && op.next < len && op.inflight < window;
        if let (true, Some(c), Some(rkey), true) = (turn, c, op.rkey.clone(), op.granted) {
            if op.gate.enter() {
                let n = (len - op.next).min(seg);
                let token = self.tokens.add(Token::Rma(id));
                // SAFETY: the local range is inside `op.work.local()`, a live registered slice that this
                // op holds until it finishes, and an op finishes only with no request in flight
                // (a cancelled op waits too: its completion's drop waits for the gate); `rkey` was
                // unpacked on `c.ep` for the region the peer granted, `addr + next` is inside the
                // granted range.
                let r = unsafe {
                    c.ep.rma(
                        Rma {
                            write: op.write,
                            local: op.work.local().ptr() as usize + op.next as usize,
                            len: n as usize,
                            remote: op.addr + op.next,
                        },
                        &rkey,
                        op.memh.as_deref(),
                        token,
                    )
                };
                match r {
                    Ok(Started::Done) => {
                        self.tokens.forget(token);
                        op.gate.exit();
                        op.next += n;
                        op.last = Instant::now();
                    }
                    Ok(Started::Pending) => {
                        op.inflight += 1;
                        op.next += n;
                    }
                    Err(e) => {
                        self.tokens.forget(token);
                        op.gate.exit();
                        op.error = Some(e);
                    }
                }
            } else {
                op.error = Some(Error::PeerClosed("ucx: op cancelled".into()));
            }
        }
        if op.granted && op.error.is_none() && op.next < len {
            if op.inflight < window {
                self.runnable.insert((len - op.next, id));
            }
            return;
        }
        let issued = op.granted && op.error.is_none() && op.next == op.work.local().len();
        if issued && op.write && !op.flush_started {
            // Put completion is local; a flush issued right after this op's last segment completes
            // once they (and what was issued before them) are at the peer, so the op completes
            // with its bytes in place (and before any notification after it), without waiting for
            // segments other ops issue later.
            op.flush_started = true;
            let token = self.tokens.add(Token::Flush(id));
            match c.map(|c| c.ep.flush(token)) {
                Some(Ok(Started::Pending)) => op.flushing = true,
                Some(Ok(Started::Done)) => self.tokens.forget(token),
                Some(Err(e)) => {
                    self.tokens.forget(token);
                    op.error = Some(e);
                }
                None => {
                    self.tokens.forget(token);
                    op.error = Some(closed());
                }
            }
        }
        if op.inflight > 0 || op.flushing {
            return;
        }
        if op.granted || op.error.is_some() {
            self.finish(id);
        }
    }

    pub(crate) fn rma_done(&mut self, id: u64, status: sys::ucs_status_t) {
        let Some(op) = self.ops.get_mut(&id) else { return };
        op.gate.exit();
        op.inflight = op.inflight.saturating_sub(1);
        op.last = Instant::now();
        if status != sys::UCS_OK {
            let what = if op.write { "put" } else { "get" };
            op.error.get_or_insert_with(|| ffi::status_error(what, status));
        }
        self.pump(id);
    }

    pub(crate) fn flush_done(&mut self, id: u64, status: sys::ucs_status_t) {
        let Some(op) = self.ops.get_mut(&id) else { return };
        op.flushing = false;
        if status != sys::UCS_OK {
            op.error.get_or_insert_with(|| ffi::status_error("flush", status));
        }
        self.pump(id);
    }

    /// Gives every runnable op one turn, smallest remainder first.
    pub(crate) fn run_turns(&mut self) {
        for (_, id) in std::mem::take(&mut self.runnable) {
            self.pump(id);
        }
    }

    /// Releases the peer's hold (End; for an op on a lease, the lease once revoked and
    /// unused), resolves the completion, drops the op's memory.
    fn finish(&mut self, id: u64) {
        let Some(op) = self.ops.remove(&id) else { return };
        if let Some(c) = self.out.get_mut(&op.conn) {
            c.ops.remove(&id);
            if op.leased {
                let of = (op.region, op.write);
                let done = c.leases.get_mut(&of).map(|l| {
                    l.users = l.users.saturating_sub(1);
                    l.revoked && l.users == 0
                });
                if done == Some(true) && c.dead.is_none() {
                    release(&mut self.tokens, &self.mapped, c, op.conn, of);
                }
            } else if op.granted && c.dead.is_none() {
                let end = Msg::new(Kind::End, op.conn, op.req);
                if let Err(e) = self.tokens.send(&c.ep, op.conn, &end) {
                    tracing::warn!(error = %e, "ucx: could not release a region at the peer");
                }
            }
            if c.closing && c.ops.is_empty() {
                self.out.remove(&op.conn);
            }
        }
        self.ended.push((op.done, op.error.map_or(Ok(()), Err)));
        if self.ended.len() >= crate::progress::WAKE_BATCH {
            self.deliver();
        }
        if op.abandoned {
            self.graveyard.bury(op.work.into_local(), op.memh, op.rkey);
        }
    }

    pub(crate) fn notify(&mut self, conn: u64, body: &[u8], reply: oneshot::Sender<Result<()>>) {
        let Some(c) = self.out.get_mut(&conn) else {
            let _ = reply.send(Err(closed()));
            return;
        };
        if let Some(e) = &c.dead {
            let _ = reply.send(Err(e.clone()));
            return;
        }
        if body.len() > MAX_NOTIFY_WIRE {
            let _ = reply.send(Err(Error::Capacity {
                what: "ucx notification".into(),
                requested: body.len() as u64,
                limit: MAX_NOTIFY_WIRE as u64,
            }));
            return;
        }
        let req = c.next_req;
        c.next_req += 1;
        let msg = Msg { body, ..Msg::new(Kind::Notify, conn, req) };
        if let Err(e) = self.tokens.send(&c.ep, conn, &msg) {
            let _ = reply.send(Err(e));
            return;
        }
        c.notifies.insert(req, reply);
        c.deadlines.push_back((Instant::now() + self.cfg.answer_timeout, req));
    }

    pub(crate) fn notify_ack(&mut self, msg: &Msg<'_>) {
        let Some(c) = self.out.get_mut(&msg.conn) else { return };
        let Some(reply) = c.notifies.remove(&msg.req) else { return };
        let r = if msg.ok() { Ok(()) } else { Err(decode_error(msg.body).unwrap_or_else(|e| e)) };
        let _ = reply.send(r);
    }

    /// Fails the connection: answers stop being awaited, the endpoint is force-closed (UCX
    /// cancels its requests, whose ops then finish with `error`), later ops fail with `error`.
    pub(crate) fn kill(&mut self, conn: u64, error: Error) {
        self.leave(conn, error, true);
    }

    /// The connection's handle was dropped: tell the peer, close after in-flight requests.
    pub(crate) fn close(&mut self, conn: u64) {
        self.leave(conn, closed(), false);
        if let Some(c) = self.out.get_mut(&conn) {
            c.closing = true;
            if c.ops.is_empty() {
                self.out.remove(&conn);
            }
        }
    }

    /// Tells the peer this connection is over (best effort).
    pub(crate) fn say_bye(&mut self, conn: u64) {
        if let Some(c) = self.out.get(&conn).filter(|c| c.dead.is_none()) {
            let _ = self.tokens.send(&c.ep, conn, &Msg::new(Kind::Bye, conn, 0));
        }
    }

    fn leave(&mut self, conn: u64, error: Error, force: bool) {
        if !force {
            self.say_bye(conn);
        }
        // Ops that follow go to this thread (and fail), none copies into a lease any more.
        self.mapped.remove_conn(conn);
        let Some(c) = self.out.get_mut(&conn) else { return };
        if c.dead.is_some() {
            return;
        }
        c.dead = Some(error.clone());
        if let Some(r) = c.connecting.take() {
            let _ = r.send(Err(error.clone()));
        }
        for (_, r) in c.notifies.drain() {
            let _ = r.send(Err(error.clone()));
        }
        c.grants.clear();
        c.deadlines.clear();
        c.ep.close(force, self.cfg.answer_timeout.min(Duration::from_secs(2)));
        c.rkeys.clear();
        let ids: HashSet<u64> = c.ops.iter().copied().collect();
        if force {
            // Requests the close completed (cancelled) are handled first: only those UCX still
            // holds are abandoned.
            self.drain_callbacks();
            self.abandon(conn, &ids);
        }
        for id in ids {
            if let Some(op) = self.ops.get_mut(&id) {
                op.error.get_or_insert_with(|| error.clone());
            }
            self.pump(id);
        }
    }

    /// After a forced close, UCX (1.13) does not always complete the requests that were queued on
    /// the endpoint (software put/get waiting for a stopped peer): forget them. Forgotten requests
    /// can still run later (the transport dispatches its pending queue, reading a WRITE's source
    /// or a control message's buffer), and a READ's reply could still come from a peer that
    /// resumes: what they touch goes to the graveyard when the op finishes, alive (its region
    /// stays registered) until the worker is destroyed, so UCX never touches freed memory.
    fn abandon(&mut self, conn: u64, ids: &HashSet<u64>) {
        let lost = self.tokens.take_if(|t| match t {
            Token::Rma(id) | Token::Flush(id) => ids.contains(id),
            Token::Send { conn: c, .. } => *c == conn,
        });
        for t in lost {
            self.graveyard.bury_send(t);
        }
        for id in ids {
            let Some(op) = self.ops.get_mut(id) else { continue };
            if op.inflight == 0 && !op.flushing {
                continue;
            }
            for _ in 0..op.inflight {
                op.gate.exit();
            }
            op.abandoned = true;
            op.inflight = 0;
            op.flushing = false;
        }
    }
}

/// The connection's unpacked key for `region`, unpacking `blob` the first time.
/// Gives a revoked, unused lease back to the peer.
fn release(
    tokens: &mut crate::tokens::Tokens,
    mapped: &Mapped,
    c: &mut OutConn,
    conn: u64,
    of: (RegionId, bool),
) {
    mapped.remove(conn, of);
    c.leases.remove(&of);
    let m = Msg {
        flags: if of.1 { WRITE } else { 0 },
        region: of.0,
        ..Msg::new(Kind::Released, conn, 0)
    };
    if let Err(e) = tokens.send(&c.ep, conn, &m) {
        tracing::warn!(error = %e, "ucx: could not give a lease back to the peer");
    }
}

fn rkey_for(c: &mut OutConn, region: RegionId, blob: Option<&Bytes>) -> Result<Rc<RemoteKey>> {
    let Some(blob) = blob else {
        return Err(Error::protocol(format!("ucx: region {} carries no ucx remote key", region.0)));
    };
    if let Some((b, k)) = c.rkeys.get(&region) {
        if b == blob {
            return Ok(k.clone());
        }
    }
    let k = Rc::new(c.ep.unpack(blob)?);
    if c.rkeys.len() >= MAX_RKEYS {
        c.rkeys.clear(); // ops in flight keep their own Rc
    }
    c.rkeys.insert(region, (blob.clone(), k.clone()));
    Ok(k)
}
