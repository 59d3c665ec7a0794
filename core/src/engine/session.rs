//! `Session`: this engine's view of one peer. It selects a backend per transfer, opens backend
//! connections lazily, splits ops larger than a backend's limit, and sends notifications.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock, Weak};

use bytes::Bytes;

use super::transfer::{TransferHandle, TransferOp, TransferReport};
use super::{EngineShared, control, lock};
use crate::backend::{
    Backend, Completion, Connection, Direction, Op, PeerBackendInfo, RemoteSlice, Reroute,
};
use crate::error::{Error, Missing, Result};
use crate::fence::OpFence;
use crate::ids::EngineId;
use crate::memory::MemoryKind;
use crate::region::{MemSlice, RemoteRegion};
use crate::sync::{read, write};
use crate::wire::descriptor::EngineDescriptor;
use crate::wire::envelope::{Envelope, Message};

/// A peer session. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Session {
    inner: Arc<SessionInner>,
}

#[derive(Debug)]
struct SessionInner {
    engine: Weak<EngineShared>,
    /// Shared, so an op reads it without copying every remote region the peer showed.
    peer: RwLock<Arc<EngineDescriptor>>,
    addr: RwLock<Option<SocketAddr>>,
    /// Open connections by backend name: every op looks its one up here.
    conns: std::sync::Mutex<HashMap<&'static str, Conn>>,
    /// Held while a connection is opened, so two ops do not open two.
    connecting: tokio::sync::Mutex<()>,
}

/// A backend connection and the fence that orders notifications after its ops.
#[derive(Debug, Clone)]
pub(super) struct Conn {
    pub(super) conn: Arc<dyn Connection>,
    fence: OpFence,
}

/// An op checked, with the backend chosen for it, before the engine cuts it into that
/// backend's ops.
pub(super) struct Routed<'a> {
    pub(super) backend: usize,
    /// The local memory is on a GPU and the backend moves host memory: the engine stages it.
    pub(super) staged: bool,
    pub(super) dir: Direction,
    pub(super) local: MemSlice,
    pub(super) region: &'a RemoteRegion,
    /// The region, shared, when the caller has it so (a fallback).
    shared: Option<Arc<RemoteRegion>>,
    pub(super) offset: u64,
}

impl Routed<'_> {
    /// The op's remote end as `backend` names it.
    pub(super) fn remote(&self, backend: &str) -> RemoteSlice {
        RemoteSlice {
            region: self.region.id,
            key: self.region.key,
            offset: self.offset,
            blob: self.region.blob(backend).cloned().unwrap_or_default(),
        }
    }

    /// Whether its connection may be asked to run the op within a call
    /// ([`Connection::run_now`]): not when the engine stages it through a GPU bounce, nor when
    /// its backend cuts it into several requests.
    pub(super) fn may_run_now(&self, engine: &EngineShared) -> bool {
        let max = engine.backends[self.backend].capabilities().max_request_bytes;
        !self.staged && self.local.len() <= max
    }
}

/// What an op needs to run on a later backend of the engine than the one it was given to (see
/// [`Op::fall_back`]): its session, its remote region (every backend's blob for it) and the
/// backend that gave it back.
#[derive(Debug)]
struct Fallback {
    session: Weak<SessionInner>,
    region: Arc<RemoteRegion>,
    after: usize,
}

impl Reroute for Fallback {
    fn run(
        self: Arc<Self>,
        dir: Direction,
        local: MemSlice,
        remote: RemoteSlice,
        ticket: crate::fence::FenceTicket,
        why: Error,
    ) -> Completion {
        Box::pin(async move {
            let _ticket = ticket;
            let f = self;
            let Some(inner) = f.session.upgrade() else { return Err(why) };
            let session = Session { inner };
            let engine = session.engine()?;
            let peer = session.shared_descriptor();
            let kinds = Some((local.kind(), f.region.kind, dir));
            let Ok(b) = f.next(&engine, &peer, kinds) else { return Err(why) };
            let backend = engine.backends[b].clone();
            tracing::warn!(
                from = engine.backends[f.after].name(),
                to = backend.name(),
                peer = %peer.engine,
                bytes = local.len(),
                reason = %why,
                "engine: an op falls back to another backend"
            );
            let c = session.connection(&engine, &backend).await?;
            let p = Routed {
                backend: b,
                staged: false,
                dir,
                local,
                region: &f.region,
                shared: Some(f.region.clone()),
                offset: remote.offset,
            };
            let mut ops = Vec::new();
            session.pieces(&engine, p, &c.fence, &mut ops)?;
            for done in c.conn.submit(ops) {
                done.await?;
            }
            Ok(())
        })
    }
}

impl Fallback {
    fn next(
        &self,
        engine: &EngineShared,
        peer: &EngineDescriptor,
        kinds: Option<(MemoryKind, MemoryKind, Direction)>,
    ) -> Result<usize> {
        Session::select_from(engine, peer, kinds, Some(&self.region), self.after + 1)
    }
}

impl Session {
    pub(crate) fn open(
        engine: &Arc<EngineShared>,
        desc: EngineDescriptor,
        addr: Option<SocketAddr>,
    ) -> Session {
        let mut sessions = lock(&engine.sessions);
        if let Some(s) = sessions.get(&desc.engine) {
            *write(&s.inner.peer) = Arc::new(desc);
            if addr.is_some() {
                *write(&s.inner.addr) = addr;
            }
            return s.clone();
        }
        let s = Session {
            inner: Arc::new(SessionInner {
                engine: Arc::downgrade(engine),
                peer: RwLock::new(Arc::new(desc)),
                addr: RwLock::new(addr),
                conns: std::sync::Mutex::new(HashMap::new()),
                connecting: tokio::sync::Mutex::new(()),
            }),
        };
        let id = s.peer();
        sessions.insert(id, s.clone());
        s
    }

    pub(super) fn engine(&self) -> Result<Arc<EngineShared>> {
        let e = self
            .inner
            .engine
            .upgrade()
            .ok_or_else(|| Error::PeerClosed("local engine dropped".into()))?;
        e.ensure_open()?;
        Ok(e)
    }

    /// Forgets the peer, for one known to be gone for good (a store node that restarted with a
    /// new engine, say): the engine drops this session (a later [`crate::Engine::connect`]
    /// opens a new one) and its backend connections close now rather than when the engine
    /// stops. Other holders of this session open new connections on their next transfer.
    pub async fn close(&self) {
        if let Some(e) = self.inner.engine.upgrade() {
            let mut sessions = lock(&e.sessions);
            let peer = self.peer();
            if sessions.get(&peer).is_some_and(|s| Arc::ptr_eq(&s.inner, &self.inner)) {
                sessions.remove(&peer);
                lock(&e.peers).remove(peer);
            }
        }
        let _connecting = self.inner.connecting.lock().await; // none opens behind the clear
        lock(&self.inner.conns).clear();
    }

    /// The peer's engine id.
    pub fn peer(&self) -> EngineId {
        self.shared_descriptor().engine
    }

    /// The peer's descriptor as of the last handshake.
    pub fn descriptor(&self) -> EngineDescriptor {
        (*self.shared_descriptor()).clone()
    }

    /// The peer's descriptor without a copy of it (what every op reads).
    pub(super) fn shared_descriptor(&self) -> Arc<EngineDescriptor> {
        read(&self.inner.peer).clone()
    }

    /// Regions the peer showed us in its last descriptor.
    pub fn remote_regions(&self) -> Vec<RemoteRegion> {
        self.shared_descriptor().regions.clone()
    }

    /// One region from the peer's last descriptor.
    pub fn remote_region(&self, id: crate::ids::RegionId) -> Result<RemoteRegion> {
        self.shared_descriptor()
            .regions
            .iter()
            .find(|r| r.id == id)
            .cloned()
            .ok_or(Error::NotFound(Missing::Region(id)))
    }

    /// Handshakes again to learn regions the peer registered since.
    pub async fn refresh(&self) -> Result<()> {
        let engine = self.engine()?;
        let addr = *read(&self.inner.addr);
        let addr = addr.ok_or_else(|| {
            Error::NotFound(Missing::Peer(format!("control address of {}", self.peer())))
        })?;
        let desc = control::handshake(addr, &engine).await?;
        *write(&self.inner.peer) = Arc::new(desc);
        Ok(())
    }

    /// Picks the first backend (in engine preference order) the peer also runs that can move
    /// `local` <-> `remote` memory in direction `dir` (or notify, when `dir` is None) and, for an
    /// op, registered the remote region (a backend that cannot reach it registered no blob).
    fn select(
        engine: &EngineShared,
        peer: &EngineDescriptor,
        kinds: Option<(MemoryKind, MemoryKind, Direction)>,
        remote: Option<&RemoteRegion>,
    ) -> Result<usize> {
        Self::select_from(engine, peer, kinds, remote, 0)
    }

    /// [`Session::select`] among the backends from index `first` on.
    fn select_from(
        engine: &EngineShared,
        peer: &EngineDescriptor,
        kinds: Option<(MemoryKind, MemoryKind, Direction)>,
        remote: Option<&RemoteRegion>,
        first: usize,
    ) -> Result<usize> {
        let same_host = peer.host == engine.host;
        engine
            .backends
            .iter()
            .enumerate()
            .skip(first)
            .find(|(_, b)| {
                let c = b.capabilities();
                let shared = peer.backends.iter().any(|(n, _)| n == b.name());
                let host_ok = same_host || !c.same_host_only;
                let op_ok = match kinds {
                    Some((l, r, d)) => {
                        c.local.contains(l)
                            && c.remote.contains(r)
                            && match d {
                                Direction::Read => c.read,
                                Direction::Write => c.write,
                            }
                    }
                    None => c.notify,
                };
                let reaches = remote.is_none_or(|r| r.blob(b.name()).is_some());
                shared && host_ok && op_ok && reaches
            })
            .map(|(i, _)| i)
            .ok_or_else(|| Error::Unsupported {
                backend: "engine",
                what: match kinds {
                    Some((l, r, d)) => format!(
                        "no backend shared with {} moves {d:?} between local {l:?} and remote {r:?}{}",
                        peer.engine,
                        if same_host { "" } else { " across hosts" }
                    ),
                    None => format!("no backend shared with {} carries notifications", peer.engine),
                },
            })
    }

    /// Cuts a routed op into ops of at most its backend's request size, each with a ticket of
    /// `fence` and, when a later backend could take it over, a [`Fallback`]; appends them to
    /// `out` and returns how many (none appended on an error).
    fn pieces(
        &self,
        engine: &EngineShared,
        p: Routed<'_>,
        fence: &OpFence,
        out: &mut Vec<Op>,
    ) -> Result<usize> {
        let b = &engine.backends[p.backend];
        let remote = p.remote(b.name());
        let Routed { backend, dir, local, region, shared, .. } = p;
        let max = b.capabilities().max_request_bytes.max(1);
        let fallback = (backend + 1 < engine.backends.len()).then(|| {
            let f = Fallback {
                session: Arc::downgrade(&self.inner),
                region: shared.unwrap_or_else(|| Arc::new(region.clone())),
                after: backend,
            };
            Arc::new(f) as Arc<dyn Reroute>
        });
        let op = |off: u64, local: MemSlice| Op {
            dir,
            local,
            remote: RemoteSlice { offset: remote.offset + off, ..remote.clone() },
            ticket: fence.ticket(),
            fallback: fallback.clone(),
        };
        let len = local.len();
        if len <= max {
            out.push(op(0, local));
            return Ok(1);
        }
        let first = out.len();
        let mut off = 0;
        while off < len {
            let n = max.min(len - off);
            match local.sub(off, n) {
                Ok(piece) => out.push(op(off, piece)),
                Err(e) => {
                    out.truncate(first);
                    return Err(e);
                }
            }
            off += n;
        }
        Ok(out.len() - first)
    }

    /// The open connection through `backend`, if one is open and not broken.
    fn open_connection(&self, backend: &Arc<dyn Backend>) -> Option<Conn> {
        let c = lock(&self.inner.conns).get(backend.name())?.clone();
        match c.conn.broken() {
            None => Some(c),
            Some(e) => {
                tracing::debug!(
                    backend = backend.name(),
                    peer = %self.peer(),
                    error = %e,
                    "engine: connection broken; opening a new one"
                );
                None
            }
        }
    }

    pub(super) async fn connection(
        &self,
        engine: &EngineShared,
        backend: &Arc<dyn Backend>,
    ) -> Result<Conn> {
        if let Some(c) = self.open_connection(backend) {
            return Ok(c);
        }
        let _connecting = self.inner.connecting.lock().await;
        if let Some(c) = self.open_connection(backend) {
            return Ok(c); // another op opened it meanwhile
        }
        let peer = self.shared_descriptor();
        let endpoint = peer
            .backends
            .iter()
            .find(|(n, _)| n == backend.name())
            .map(|(_, b)| b.clone())
            .unwrap_or_default();
        let info = PeerBackendInfo { engine: peer.engine, host: peer.host.clone(), endpoint };
        let limit = engine.config.handshake_timeout;
        let conn = tokio::time::timeout(limit, backend.connect(&info)).await.map_err(|_| {
            Error::timeout(format!("{} connect to {}", backend.name(), peer.engine), limit)
        })??;
        super::telemetry::connected(backend.name());
        let c = Conn { conn, fence: OpFence::new() };
        lock(&self.inner.conns).insert(backend.name(), c.clone());
        Ok(c)
    }

    pub(super) fn route<'a>(
        &self,
        engine: &EngineShared,
        peer: &EngineDescriptor,
        op: &'a TransferOp,
    ) -> Result<Routed<'a>> {
        if op.local.engine_id != engine.id {
            return Err(Error::InvalidArgument(format!(
                "local region {} belongs to {}, not this engine {}",
                op.local.id.0, op.local.engine_id, engine.id
            )));
        }
        if op.remote.engine != peer.engine {
            return Err(Error::InvalidArgument(format!(
                "remote region {} belongs to {}, but this session is with {}",
                op.remote.id.0, op.remote.engine, peer.engine
            )));
        }
        if op.remote_offset.checked_add(op.len).is_none_or(|end| end > op.remote.len) {
            return Err(Error::OutOfBounds {
                what: format!("remote region {}", op.remote.id.0),
                offset: op.remote_offset,
                len: op.len,
                limit: op.remote.len,
            });
        }
        let local = op.local.slice(op.local_offset, op.len, "local")?;
        let direct = Self::select(
            engine,
            peer,
            Some((op.local.kind, op.remote.kind, op.dir)),
            Some(&op.remote),
        );
        let (backend, staged) = match direct {
            Ok(b) => (b, false),
            // Local device memory over a backend that moves host memory: staged through pinned
            // bounces, when this engine has a GPU to copy with.
            Err(e) => match (op.local.kind, &engine.gpu) {
                (MemoryKind::Device { .. }, Some(_)) => {
                    let host = Some((MemoryKind::HostPinned, op.remote.kind, op.dir));
                    (Self::select(engine, peer, host, Some(&op.remote)).map_err(|_| e)?, true)
                }
                _ => return Err(e),
            },
        };
        Ok(Routed {
            backend,
            staged,
            dir: op.dir,
            local,
            region: &op.remote,
            shared: None,
            offset: op.remote_offset,
        })
    }

    /// Submits a batch. Every op gets its own handle that resolves on its own (an op rejected up front
    /// gets a handle that resolves to its error; its batchmates are unaffected). Ops progress whether
    /// or not their handles are polled.
    pub async fn submit(&self, ops: Vec<TransferOp>) -> Vec<TransferHandle> {
        self.submit_inner(ops, None).await
    }

    /// [`Session::submit`] with a notification (at most
    /// [`crate::wire::envelope::MAX_NOTIFY_BYTES`]) for the peer, which receives it as
    /// [`Session::notify_unordered`] sends it; the first op's handle resolves only once it was
    /// delivered, and fails with the peer's refusal (a [`crate::Handled::Refused`]) even when
    /// the op's bytes moved. A backend that can carry the notice in the op's request (tcp, for
    /// a READ) delivers it before serving that request (the op's first piece), with no message
    /// of its own; the others send it beside the op. Nothing is sent when the first op is
    /// refused before it starts.
    pub async fn submit_with_notice(
        &self,
        notice: Bytes,
        ops: Vec<TransferOp>,
    ) -> Vec<TransferHandle> {
        self.submit_inner(ops, Some(notice)).await
    }

    async fn submit_inner(
        &self,
        ops: Vec<TransferOp>,
        notice: Option<Bytes>,
    ) -> Vec<TransferHandle> {
        let engine = match self.engine() {
            Ok(e) => e,
            Err(e) => return ops.iter().map(|_| TransferHandle::failed(e.clone())).collect(),
        };
        let peer = self.shared_descriptor();
        let mut notice = match notice.map(|n| Envelope { from: engine.id, msg: Message::User(n) }) {
            Some(env) => match env.encode() {
                Ok(b) => Some(b),
                Err(e) => return ops.iter().map(|_| TransferHandle::failed(e.clone())).collect(),
            },
            None => None,
        };
        // A lone op is routed here, and run within the call when its connection can.
        let mut lone = None;
        if let ([op], None) = (&ops[..], &notice) {
            let routed = self.route(&engine, &peer, op);
            if let Some(h) = routed.as_ref().ok().and_then(|r| self.run_now(&engine, op, r)) {
                return vec![h];
            }
            lone = Some(routed);
        }
        // Ops that run in the background: their answers find a worker awake.
        crate::linger::arm();
        let mut handles: Vec<Option<TransferHandle>> = Vec::with_capacity(ops.len());
        // (backend index, its (op index, routed op)s), in the order the backends first
        // appear: an engine runs a handful of backends, so a scan beats hashing.
        let mut groups: Vec<(usize, Vec<(usize, Routed)>)> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            match lone.take().unwrap_or_else(|| self.route(&engine, &peer, op)) {
                Ok(p) => {
                    match groups.iter_mut().find(|(b, _)| *b == p.backend) {
                        Some((_, members)) => members.push((i, p)),
                        None => groups.push((p.backend, vec![(i, p)])),
                    }
                    handles.push(None);
                }
                Err(e) => handles.push(Some(TransferHandle::failed(e))),
            }
        }
        for (b, members) in groups {
            let backend = engine.backends[b].clone();
            let c = match self.connection(&engine, &backend).await {
                Ok(c) => c,
                Err(e) => {
                    for (i, _) in members {
                        handles[i] = Some(TransferHandle::failed(e.clone()));
                    }
                    continue;
                }
            };
            // Every op's time starts here: a backend may finish an op inside `submit`.
            let start = std::time::Instant::now();
            let mut counts: Vec<(usize, usize)> = Vec::with_capacity(members.len());
            let mut all: Vec<Op> = Vec::with_capacity(members.len());
            for (i, p) in members {
                if p.staged {
                    let blob = p.region.blob(backend.name()).cloned().unwrap_or_default();
                    let staged = super::staging::Staged {
                        pool: engine.staging(),
                        conn: c.conn.clone(),
                        fence: c.fence.clone(),
                        dir: p.dir,
                        local: p.local,
                        region: p.shared.unwrap_or_else(|| Arc::new(p.region.clone())),
                        blob,
                        offset: p.offset,
                        ticket: c.fence.ticket(),
                    };
                    let mut done =
                        crate::completion::spawn_cancellable(move |gate| staged.run(gate));
                    if let Some(n) = notice.take_if(|_| i == 0) {
                        done = crate::completion::after_notice(c.conn.notify(n), done);
                    }
                    handles[i] = Some(TransferHandle::running(
                        &engine,
                        backend.name(),
                        &ops[i],
                        vec![done],
                        (start, true),
                    ));
                    continue;
                }
                match self.pieces(&engine, p, &c.fence, &mut all) {
                    Ok(n) => counts.push((i, n)),
                    Err(e) => handles[i] = Some(TransferHandle::failed(e)),
                }
            }
            // The notice rides with the first op, when that op is in this batch.
            let first = counts.first().is_some_and(|&(i, n)| i == 0 && n > 0);
            let done = match notice.take_if(|_| first) {
                Some(n) => c.conn.submit_noticed(n, all),
                None => c.conn.submit(all),
            };
            let mut done: std::vec::IntoIter<Completion> = done.into_iter();
            for (i, n) in counts {
                let pieces: Vec<Completion> = done.by_ref().take(n).collect();
                if pieces.len() != n {
                    let e = Error::Internal(format!(
                        "{} returned fewer completions than ops",
                        backend.name()
                    ));
                    handles[i] = Some(TransferHandle::failed(e));
                    continue;
                }
                let how = (start, false);
                handles[i] =
                    Some(TransferHandle::running(&engine, backend.name(), &ops[i], pieces, how));
            }
        }
        handles
            .into_iter()
            .map(|h| {
                h.unwrap_or_else(|| {
                    TransferHandle::failed(Error::Internal("an op was lost in submit".into()))
                })
            })
            .collect()
    }

    /// `op`, routed as `r`, run within this call when its connection can (an shm copy into a
    /// region it holds a lease on; see [`Connection::run_now`]): its handle holds how it
    /// ended. `None` when it cannot, and nothing ran.
    fn run_now(
        &self,
        engine: &Arc<EngineShared>,
        op: &TransferOp,
        r: &Routed<'_>,
    ) -> Option<TransferHandle> {
        if !r.may_run_now(engine) {
            return None;
        }
        let backend = &engine.backends[r.backend];
        let c = self.open_connection(backend)?;
        let start = std::time::Instant::now();
        let mut budget = super::transfer::CALL_BYTES;
        let res = c.conn.run_now(r.dir, &r.local, &r.remote(backend.name()), &mut budget)?;
        let elapsed = start.elapsed();
        let name = backend.name();
        super::transfer::counted(Some(engine), name, (op.dir, op.len), elapsed, &res);
        Some(TransferHandle::ended(
            name,
            res.map(|()| TransferReport {
                backend: name,
                bytes: op.len,
                elapsed,
                host_staged: false,
            }),
        ))
    }

    /// Submits one op and waits for it.
    pub async fn transfer(&self, op: TransferOp) -> Result<TransferReport> {
        let mut hs = self.submit(vec![op]).await;
        match hs.pop() {
            Some(h) => h.await,
            None => Err(Error::Internal("submit returned no handle".into())),
        }
    }

    pub(crate) async fn send(&self, msg: Message) -> Result<()> {
        self.send_as(msg, true).await
    }

    /// Sends `msg`; with `ordered`, only once every op submitted before the call has ended.
    async fn send_as(&self, msg: Message, ordered: bool) -> Result<()> {
        let engine = self.engine()?;
        let peer = self.shared_descriptor();
        let bytes = Envelope { from: engine.id, msg }.encode()?;
        let b = engine.backends[Self::select(&engine, &peer, None, None)?].clone();
        let c = self.connection(&engine, &b).await?;
        let earlier = ordered.then(|| c.fence.wait_earlier());
        let limit = engine.config.transfer_timeout;
        let sent = async move {
            if let Some(earlier) = earlier {
                earlier.await; // every op submitted before this notification has ended
            }
            c.conn.notify(bytes).await
        };
        tokio::time::timeout(limit, sent)
            .await
            .map_err(|_| Error::timeout(format!("notification to {}", peer.engine), limit))?
    }

    /// Sends a small message (at most [`crate::wire::envelope::MAX_NOTIFY_BYTES`]) that the peer
    /// receives with [`crate::Engine::recv_notification`] after every transfer submitted before it on
    /// this session through the same backend (host-memory transfers and notifications share the
    /// engine's preferred backend, so for them the order is total).
    pub async fn notify(&self, payload: Bytes) -> Result<()> {
        self.send(Message::User(payload)).await
    }

    /// [`Session::notify`] without the wait for earlier transfers: the message leaves at once and
    /// may arrive before the bytes of ops submitted before it (and before an ordered
    /// notification still waiting for them). For control messages that describe no data, such
    /// as asking a producer for a payload while its read is already under way.
    pub async fn notify_unordered(&self, payload: Bytes) -> Result<()> {
        self.send_as(Message::User(payload), false).await
    }
}
