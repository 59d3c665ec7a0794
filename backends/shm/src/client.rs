//! The initiating side: one Unix stream to the peer's backend. The first op on a region (for an
//! access) asks the peer to hold the region (Begin), opens the granted export through the medium
//! (for shm: maps the memfd), and copies once between the local slice and the opening. The peer
//! grants a lease: the whole region stays held for this connection, so later ops with the same
//! key and access copy at once, with no message at all (a 4 KiB op is a memcpy and a
//! completion). Without a lease an op releases the region when its copy is over (End). A reader
//! task matches grants to ops, and on the peer's Forget (the region is being deregistered) drops
//! the mapping and ends the leases: once no copy of the region is in flight it answers Released,
//! which lets the deregistration finish. It fails everything when the peer goes away. An op
//! copied in `submit` first reads the peer's live page (see [`crate::live`]), where the peer's
//! shutdown says it no longer serves us before it returns.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tensorwire_core::backend::kit::{
    CancelGate, CompletionSender, Copied, by_segments, decode_error, gated, gated_copy_with,
    spawn_cancellable, spawn_in_order,
};
use tensorwire_core::backend::{Completion, Connection, Direction, Op, RemoteSlice};
use tensorwire_core::{Error, MemSlice, RegionId, Result};
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

use crate::live::LivePage;
use crate::mapping::Mapping;
use crate::medium::{Grant, Medium};
use crate::uds::{FrameReader, FrameWriter};
use crate::wire::{ACCESS_WRITE, Header, Kind, LEASE, WANT_SHARE, WRITABLE};

/// A peer's answer to a Begin (the mapping to copy through, and the lease the op runs on if
/// the peer granted one) or to a Notify (nothing).
#[derive(Debug, Default)]
struct Answer {
    map: Option<Arc<Mapping>>,
    lease: Option<Arc<Lease>>,
}

/// A request waiting for its answer; for a Begin, what it asked for.
#[derive(Debug)]
struct Pending {
    tx: oneshot::Sender<Result<Answer>>,
    begin: Option<Asked>,
}

/// What a Begin asked for.
#[derive(Debug, Clone, Copy)]
struct Asked {
    region: RegionId,
    key: tensorwire_core::AccessKey,
    write: bool,
    /// It asked for the region's export (no opening of it was cached).
    share: bool,
}

/// A region the peer holds for this connection until we release it.
#[derive(Debug)]
struct Lease {
    map: Arc<Mapping>,
    key: tensorwire_core::AccessKey,
    /// What it leases: (region, write access).
    of: (RegionId, bool),
    users: Mutex<Users>,
}

#[derive(Debug, Default)]
struct Users {
    /// Copies running on the lease.
    copying: usize,
    /// The peer asked for it back: no new copies.
    revoked: bool,
}

impl Lease {
    /// Starts a copy on the lease; false once it was revoked.
    fn enter(&self) -> bool {
        let mut u = self.users.lock();
        if !u.revoked {
            u.copying += 1;
        }
        !u.revoked
    }

    /// Ends a copy; true when this was the last one of a revoked lease (release it now).
    fn exit(&self) -> bool {
        let mut u = self.users.lock();
        u.copying -= 1;
        u.revoked && u.copying == 0
    }

    /// Revokes it; true when no copy runs (release it now).
    fn revoke(&self) -> bool {
        let mut u = self.users.lock();
        u.revoked = true;
        u.copying == 0
    }
}

#[derive(Debug, Default)]
struct State {
    pending: HashMap<u64, Pending>,
    maps: HashMap<RegionId, Arc<Mapping>>,
    /// Leases by (region, write access).
    leases: HashMap<(RegionId, bool), Arc<Lease>>,
    /// The peer's live page, from its first frame, until the connection dies.
    live: Option<LivePage>,
    dead: Option<Error>,
}

#[derive(Debug)]
pub(crate) struct ClientShared {
    writer: FrameWriter,
    medium: Arc<dyn Medium>,
    state: Mutex<State>,
    next_req: AtomicU64,
    answer_timeout: Duration,
}

impl ClientShared {
    /// Fails every waiting op and drops every mapping of the peer's memory; idempotent.
    pub(crate) fn kill(&self, e: Error) {
        let (pending, maps) = {
            let mut s = self.state.lock();
            if s.dead.is_none() {
                s.dead = Some(e.clone());
            }
            s.leases.clear();
            s.live = None;
            (std::mem::take(&mut s.pending), std::mem::take(&mut s.maps))
        };
        for (_, p) in pending {
            let _ = p.tx.send(Err(e.clone()));
        }
        drop(maps); // ops still copying hold their own Arc; the last one unmaps
    }

    /// Tells the peer our lease on `region` for (write) access is over.
    async fn released(&self, (region, write): (RegionId, bool)) {
        let mut h = Header::new(Kind::Released, 0);
        h.region = region;
        h.flags = if write { ACCESS_WRITE } else { 0 };
        if let Err(e) = self.writer.send(&h, &[], None).await {
            self.kill(e);
        }
    }

    fn alive(&self) -> Result<()> {
        match &self.state.lock().dead {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Sends `h` (+ body) and waits for the answer to its request id.
    async fn ask(&self, h: Header, body: &[u8]) -> Result<Answer> {
        let (tx, rx) = oneshot::channel();
        {
            let mut s = self.state.lock();
            if let Some(e) = &s.dead {
                return Err(e.clone());
            }
            let begin = (h.kind == Kind::Begin).then_some(Asked {
                region: h.region,
                key: h.key,
                write: h.flags & ACCESS_WRITE != 0,
                share: h.flags & WANT_SHARE != 0,
            });
            s.pending.insert(h.req, Pending { tx, begin });
        }
        if let Err(e) = self.writer.send(&h, body, None).await {
            self.state.lock().pending.remove(&h.req);
            self.kill(e.clone());
            return Err(e);
        }
        match tokio::time::timeout(self.answer_timeout, rx).await {
            Ok(r) => r.unwrap_or_else(|_| Err(Error::PeerClosed("shm connection closed".into()))),
            Err(_) => {
                // An unresponsive peer (stopped, hung) is as good as dead: fail everything now
                // rather than one op per timeout.
                let e = Error::timeout("shm: the peer did not answer", self.answer_timeout);
                self.kill(e.clone());
                Err(e)
            }
        }
    }
}

/// A connection to one peer's shm backend.
#[derive(Debug)]
pub(crate) struct ShmConnection {
    shared: Arc<ClientShared>,
    reader: AbortHandle,
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        self.shared.kill(Error::PeerClosed("shm connection dropped".into()));
        self.reader.abort();
    }
}

impl ShmConnection {
    pub(crate) fn new(
        sock: UnixStream,
        medium: Arc<dyn Medium>,
        answer_timeout: Duration,
    ) -> (ShmConnection, Arc<ClientShared>) {
        let sock = Arc::new(sock);
        let shared = Arc::new(ClientShared {
            writer: FrameWriter::new(sock.clone()),
            medium,
            state: Mutex::new(State::default()),
            next_req: AtomicU64::new(1),
            answer_timeout,
        });
        let r = shared.clone();
        let reader = tokio::spawn(read_loop(r, FrameReader::new(sock))).abort_handle();
        (ShmConnection { shared: shared.clone(), reader }, shared)
    }
}

async fn read_loop(c: Arc<ClientShared>, mut reader: FrameReader) {
    let err = loop {
        let f = match reader.next().await {
            Ok(Some(f)) => f,
            Ok(None) => break Error::PeerClosed("shm: the peer closed the connection".into()),
            Err(e) => break e,
        };
        match f.h.kind {
            Kind::Live => {
                let page =
                    f.fd.ok_or_else(|| Error::protocol("shm: a live page without its memfd"));
                let page = match page.and_then(LivePage::open) {
                    Ok(p) => p,
                    Err(e) => break e,
                };
                let mut s = c.state.lock();
                if s.live.is_some() {
                    break Error::protocol("shm: a second live page");
                }
                if s.dead.is_none() {
                    s.live = Some(page);
                }
            }
            Kind::Forget => {
                let region = f.h.region;
                let leases: Vec<Arc<Lease>> = {
                    let mut s = c.state.lock();
                    s.maps.remove(&region);
                    [false, true].iter().filter_map(|w| s.leases.remove(&(region, *w))).collect()
                };
                // Each is released once no copy runs on it; a copy still running releases it
                // when it ends.
                for l in leases {
                    if l.revoke() {
                        c.released(l.of).await;
                    }
                }
            }
            Kind::Granted | Kind::NotifyAck => {
                let Some(p) = c.state.lock().pending.remove(&f.h.req) else {
                    break Error::protocol(format!("shm: answer to unknown request {}", f.h.req));
                };
                let answer = match (f.h.ok, p.begin) {
                    (false, _) => Err(decode_error(&f.body).unwrap_or_else(|e| e)),
                    (true, None) => Ok(Answer::default()),
                    // Mapped and leased here, in frame order: a Forget that follows finds them.
                    (true, Some(asked)) => granted(&c, &f.h, f.body, f.fd, asked).await,
                };
                let _ = p.tx.send(answer);
            }
            k => break Error::protocol(format!("shm: the server sent a {k:?}")),
        }
    };
    c.kill(err);
}

/// A Begin was granted: the mapping (new from the export, or the one cached) and, when the
/// peer leased the region, the lease (with this op's copy entered on it).
async fn granted(
    c: &ClientShared,
    h: &Header,
    share: Vec<u8>,
    fd: Option<OwnedFd>,
    Asked { region, key, write, share: asked_share }: Asked,
) -> Result<Answer> {
    let leased = h.flags & LEASE != 0;
    // Opened before the state is locked (a driver's open can take a while); still here, in the
    // reader, so in frame order.
    let unasked = !asked_share && (fd.is_some() || !share.is_empty());
    let opened = asked_share.then(|| {
        let grant = Grant { share, fd, len: h.len, writable: h.flags & WRITABLE != 0 };
        Mapping::open(&*c.medium, grant).map(Arc::new)
    });
    let map = {
        let mut s = c.state.lock();
        let map = if let Some(opened) = opened {
            opened.inspect(|m| drop(s.maps.insert(region, m.clone())))
        } else if unasked {
            Err(Error::protocol("shm: an export nobody asked for came with a grant"))
        } else {
            s.maps.get(&region).cloned().ok_or_else(|| {
                Error::protocol("shm: granted without an export for a region not opened here")
            })
        };
        match (map, leased) {
            (Ok(map), true) => {
                let users = Mutex::new(Users { copying: 1, revoked: false });
                let l = Arc::new(Lease { map: map.clone(), key, of: (region, write), users });
                s.leases.insert((region, write), l.clone());
                return Ok(Answer { map: Some(map), lease: Some(l) });
            }
            (Ok(map), false) => return Ok(Answer { map: Some(map), lease: None }),
            (Err(e), _) => Err(e),
        }
    };
    if leased {
        c.released((region, write)).await; // it cannot be used: give it back at once
    }
    map
}

async fn run_op(c: Arc<ClientShared>, op: Op, gate: Arc<CancelGate>) -> Result<()> {
    let len = op.local().len();
    let region = op.remote().region;
    let write = op.dir() == Direction::Write;
    // Held for us already: copy now.
    if let Some(l) = entered(&c, &op) {
        let result = copy(&c, &op, &l.map, &gate).await;
        if l.exit() {
            c.released(l.of).await;
        }
        result?;
        return c.alive();
    }
    let cached = c.state.lock().maps.contains_key(&region);
    let mut h = Header::new(Kind::Begin, c.next_req.fetch_add(1, Ordering::Relaxed));
    h.region = region;
    h.key = op.remote().key;
    h.offset = op.remote().offset;
    h.len = len;
    h.flags = if write { ACCESS_WRITE } else { 0 } | if cached { 0 } else { WANT_SHARE } | LEASE;
    let answer = c.ask(h, &[]).await;
    // From here the peer holds the region for us (for this op, or leased): release it however
    // the copy ends. A leased region is released when its lease ends, not per op.
    let result = match answer {
        Ok(Answer { lease: Some(l), .. }) => {
            let r = copy(&c, &op, &l.map, &gate).await;
            if l.exit() {
                c.released(l.of).await;
            }
            return r.and_then(|()| c.alive());
        }
        Ok(Answer { map: Some(map), .. }) => copy(&c, &op, &map, &gate).await,
        Ok(Answer { map: None, .. }) => Err(Error::protocol("shm: granted without a mapping")),
        Err(e) => return Err(e),
    };
    let end = Header::new(Kind::End, h.req);
    c.writer.send(&end, &[], None).await?;
    result?;
    c.alive()
}

/// The lease `op` may run on (its region, access and key), with this op's copy entered on it;
/// `None` when there is none or it was revoked.
fn entered(c: &ClientShared, op: &Op) -> Option<Arc<Lease>> {
    let l = lease_for(&c.state.lock(), op)?;
    l.enter().then_some(l)
}

/// The lease held for `op`'s region, access and key, if any.
fn lease_for(s: &State, op: &Op) -> Option<Arc<Lease>> {
    lease_of(s, op.dir(), op.remote())
}

/// The lease held for `remote`'s region and key, for access `dir`, if any.
fn lease_of(s: &State, dir: Direction, remote: &RemoteSlice) -> Option<Arc<Lease>> {
    let l = s.leases.get(&(remote.region, dir == Direction::Write))?;
    (l.key == remote.key).then(|| l.clone())
}

/// Copies `op` now, in `submit`, if it fits in `budget` (the medium's inline bytes per call,
/// which it then uses up) and its region is leased for its access and key; `None` otherwise
/// (the op goes the usual way: larger ops, and the rest of a larger batch, run on the runtime's
/// workers).
fn inline(
    c: &Arc<ClientShared>,
    (dir, local, remote): (Direction, &MemSlice, &RemoteSlice),
    budget: &mut u64,
) -> Option<Result<()>> {
    let len = local.len();
    if len == 0 || len > *budget {
        return None;
    }
    let write = dir == Direction::Write;
    let l = {
        let s = c.state.lock();
        // The peer's shutdown marks its live page before it returns, and our reader may not
        // have seen the stream end yet: the op must not land in memory it no longer serves. (A
        // peer that dies without a shutdown is seen by the reader.) Without the page (not come
        // yet, or the connection is dead) the op goes the usual way.
        if s.live.as_ref()?.closed() {
            drop(s);
            c.kill(Error::PeerClosed("shm: the peer closed the connection".into()));
            return None;
        }
        lease_of(&s, dir, remote)?
    };
    if !l.enter() {
        return None;
    }
    *budget -= len;
    let copied = l.map.at(remote.offset, len, write).and_then(|remote| {
        let local = local.ptr() as usize;
        let (src, dst) = if write { (local, remote) } else { (remote, local) };
        // SAFETY: `local` is a live registered slice of `len` bytes the caller holds for this
        // call; `remote` is inside the lease's mapping (checked by `at`), which `l` keeps open;
        // the peer holds its region for the lease, which this copy entered.
        unsafe { c.medium.copy(src, dst, len as usize) }
    });
    if l.exit() {
        // Revoked meanwhile and this was its last copy: release it from a task (submit runs
        // inside the engine's runtime).
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let c = c.clone();
            rt.spawn(async move { c.released(l.of).await });
        }
    }
    Some(copied.and_then(|()| c.alive()))
}

async fn copy(c: &ClientShared, op: &Op, map: &Arc<Mapping>, gate: &Arc<CancelGate>) -> Result<()> {
    let len = op.local().len();
    let write = op.dir() == Direction::Write;
    let remote = map.at(op.remote().offset, len, write)?;
    let local = op.local().ptr() as usize;
    let (src, dst) = if write { (local, remote) } else { (remote, local) };
    if c.medium.blocking() {
        return offloaded(c, op, map, gate, (src, dst, len)).await;
    }
    let medium = &*c.medium;
    let segment = |s: usize, d: usize, n: usize| {
        // SAFETY: sub-ranges of the two ranges below, which stay valid for the copy.
        unsafe { medium.copy(s, d, n) }
    };
    // SAFETY: `op.local()` is a live registered slice of `len` bytes held by `op`; `remote` is
    // inside `map` (checked by `at`), which this function holds; the peer holds its region open
    // (in-flight gate) until our End.
    unsafe { gated_copy_with(src, dst, len, medium.segment(), gate, || c.alive(), segment) }
        .await?;
    Ok(())
}

/// A medium whose copy holds its thread until a DMA is over: each segment runs on a blocking
/// thread (so runtime workers keep serving other ops, and copies of different ops run side by
/// side), under the op's gate, holding both ends alive itself (a task dropped at shutdown
/// cannot free memory a segment still copies).
async fn offloaded(
    c: &ClientShared,
    op: &Op,
    map: &Arc<Mapping>,
    gate: &Arc<CancelGate>,
    (src, dst, len): (usize, usize, u64),
) -> Result<()> {
    let step = |at: usize, n: usize| {
        let (medium, gate, map) = (c.medium.clone(), gate.clone(), map.clone());
        let local = op.local().sub(0, len);
        async move {
            let alive = (map, local?);
            let name = medium.name();
            let piece = tokio::task::spawn_blocking(move || {
                let _alive = alive;
                // SAFETY: `[src, src+len)` and `[dst, dst+len)` are the op's local slice and a
                // range of the peer's opened region (checked by `at`), both kept alive by
                // `_alive`; the peer holds its region for the op or lease until this copy ends.
                gate.run(|| unsafe { medium.copy(src + at, dst + at, n) })
            })
            .await
            .map_err(|e| Error::Internal(format!("{name}: a copy thread failed: {e}")))?;
            match piece {
                None => Ok(Copied::Cancelled), // the completion is gone
                Some(r) => r.map(|()| Copied::All),
            }
        }
    };
    by_segments(len, c.medium.segment(), || c.alive(), step).await.map(drop)
}

/// One op the usual way: leased or begun, copied, ended.
async fn run_one(c: Arc<ClientShared>, op: Op, gate: Arc<CancelGate>) -> Result<()> {
    if op.local().is_empty() { c.alive() } else { run_op(c, op, gate).await }
}

/// Small ops that one task runs one after another.
#[derive(Default)]
struct Group {
    ops: Vec<(Op, Arc<CancelGate>, CompletionSender)>,
    bytes: u64,
}

impl Group {
    fn spawn(self, c: &Arc<ClientShared>) {
        if self.ops.is_empty() {
            return;
        }
        let jobs = self.ops.into_iter().map(|(op, gate, tx)| (run_one(c.clone(), op, gate), tx));
        spawn_in_order(jobs.collect());
    }
}

impl Connection for ShmConnection {
    fn broken(&self) -> Option<Error> {
        self.shared.alive().err()
    }

    /// Ops copied inline while the medium's inline budget lasts; then ops up to that size run
    /// in groups of at most that many bytes, one task per group (a task per small op costs more
    /// than its copy: a batch of 4 KiB ops ran at a third of the rate); larger ops one task each.
    fn submit(&self, ops: Vec<Op>) -> Vec<Completion> {
        let group_max = self.shared.medium.inline_bytes();
        let mut budget = group_max;
        let mut group = Group::default();
        let mut out = Vec::with_capacity(ops.len());
        for op in ops {
            if let Some(done) =
                inline(&self.shared, (op.dir(), op.local(), op.remote()), &mut budget)
            {
                out.push(tensorwire_core::backend::kit::ready(done));
                continue;
            }
            let len = op.local().len();
            if len > group_max {
                let c = self.shared.clone();
                out.push(spawn_cancellable(move |gate| run_one(c, op, gate)));
                continue;
            }
            if group.bytes + len > group_max {
                std::mem::take(&mut group).spawn(&self.shared);
            }
            let (gate, tx, completion) = gated();
            group.bytes += len;
            group.ops.push((op, gate, tx));
            out.push(completion);
        }
        group.spawn(&self.shared);
        out
    }

    /// An op within `budget` and the medium's inline bytes whose region this connection
    /// holds a lease on for its access and key: copied as [`Connection::submit`] copies it
    /// inline.
    fn run_now(
        &self,
        dir: Direction,
        local: &MemSlice,
        remote: &RemoteSlice,
        budget: &mut u64,
    ) -> Option<Result<()>> {
        if local.len() > self.shared.medium.inline_bytes() {
            return None;
        }
        inline(&self.shared, (dir, local, remote), budget)
    }

    fn notify(&self, msg: Bytes) -> Completion {
        let c = self.shared.clone();
        Box::pin(async move {
            let mut h = Header::new(Kind::Notify, c.next_req.fetch_add(1, Ordering::Relaxed));
            h.len = msg.len() as u64;
            c.ask(h, &msg).await.map(drop)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;
    use crate::memfd::Memfd;

    /// A connection whose peer is the returned writer (a server this test plays by hand).
    fn connection() -> (ShmConnection, FrameWriter) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (conn, _) = ShmConnection::new(ours, Arc::new(Memfd), Duration::from_secs(5));
        (conn, FrameWriter::new(Arc::new(theirs)))
    }

    /// Waits (bounded) until the connection is broken; its error.
    async fn broken(conn: &ShmConnection) -> Error {
        for _ in 0..500 {
            if let Some(e) = conn.broken() {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the connection still stands");
    }

    fn live() -> Header {
        let mut h = Header::new(Kind::Live, 0);
        h.flags = crate::wire::HAS_FD;
        h
    }

    #[tokio::test]
    async fn a_live_page_comes_once_and_with_its_memfd() {
        // No descriptor with it.
        let (conn, peer) = connection();
        peer.send(&Header::new(Kind::Live, 0), &[], None).await.unwrap();
        let e = broken(&conn).await;
        assert!(e.to_string().contains("without its memfd"), "{e}");

        // A second one.
        let (conn, peer) = connection();
        let (_page, fd) = LivePage::create().unwrap();
        peer.send(&live(), &[], Some(fd.as_raw_fd())).await.unwrap();
        peer.send(&live(), &[], Some(fd.as_raw_fd())).await.unwrap();
        let e = broken(&conn).await;
        assert!(e.to_string().contains("a second live page"), "{e}");

        // An unsealed one (a peer that could shrink it under our loads).
        let (conn, peer) = connection();
        let region = crate::live::unsealed_page();
        peer.send(&live(), &[], Some(region.as_raw_fd())).await.unwrap();
        let e = broken(&conn).await;
        assert!(e.to_string().contains("not sealed"), "{e}");
    }
}
