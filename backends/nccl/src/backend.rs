//! The `Backend`: a control listener (core's backend channel), one communicator per connection
//! (the initiator is rank 0), and the grant protocol of [`crate::wire`] on both sides.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Instant;
use tensorwire_core::backend::kit::lock;

use async_trait::async_trait;
use bytes::Bytes;
use tensorwire_core::backend::channel::{self, Message};
use tensorwire_core::backend::kit::{Framing, Reader, Serving, WeakList, Writer};
use tensorwire_core::backend::{
    Backend, BackendHost, Capabilities, Completion, Connection, Direction, Op, PeerBackendInfo,
    RegionInfo, RemoteRange,
};
use tensorwire_core::{Error, MemSlice, MemoryKind, RegionId, Result, backend::Access};
use tensorwire_proto::admission::Pending;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::oneshot;

use crate::comm::{Comm, Nccl};
use crate::wire::{FRAMING, Msg};
use crate::{NAME, NcclConfig};

impl Message for Msg {
    const FRAMING: Framing = FRAMING;
    fn kind(&self) -> u8 {
        Msg::kind(self)
    }
    fn encode(&self) -> Vec<u8> {
        Msg::encode(self)
    }
    fn decode(kind: u8, payload: &[u8]) -> Result<Self> {
        Msg::decode(kind, payload)
    }
    fn is_bye(&self) -> bool {
        matches!(self, Msg::Bye)
    }
}

type Sender = channel::Sender<Msg>;

#[derive(Debug)]
struct Shared {
    cfg: NcclConfig,
    nccl: Arc<dyn Nccl>,
    serving: Serving<std::net::TcpListener>,
    endpoint: Bytes,
    outbound: WeakList<ConnShared>,
    inbound: WeakList<InConn>,
}

impl Shared {
    fn host(&self) -> Result<Arc<dyn BackendHost>> {
        self.serving.ensure_open()?;
        self.serving.host().ok_or_else(|| Error::PeerClosed("nccl: backend not started".into()))
    }

    fn close(&self) {
        self.serving.close();
        for c in self.outbound.take() {
            c.close(self.serving.closed_error());
        }
        for c in self.inbound.take() {
            c.comm.abort();
            c.sender.send_later(Msg::Bye);
        }
    }
}

/// The NCCL backend (one per engine).
#[derive(Debug)]
pub struct NcclBackend {
    shared: Arc<Shared>,
}

impl NcclBackend {
    /// A backend over `nccl`'s communicators, with its control listener bound.
    pub fn new(cfg: NcclConfig, nccl: Arc<dyn Nccl>) -> Result<Arc<NcclBackend>> {
        let listener = std::net::TcpListener::bind(cfg.listen).map_err(|e| {
            Error::InvalidArgument(format!("nccl: cannot listen on {}: {e}", cfg.listen))
        })?;
        listener.set_nonblocking(true)?;
        let control = cfg.advertise.unwrap_or(listener.local_addr()?);
        let mut w = Writer::new();
        w.u8(1).str(&control.to_string());
        Ok(Arc::new(NcclBackend {
            shared: Arc::new(Shared {
                cfg,
                nccl,
                serving: Serving::new(NAME, listener),
                endpoint: Bytes::from(w.finish()),
                outbound: WeakList::default(),
                inbound: WeakList::default(),
            }),
        }))
    }
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        self.shared.close();
    }
}

fn decode_endpoint(b: &[u8]) -> Result<SocketAddr> {
    let mut r = Reader::new(b, "nccl endpoint");
    if r.u8()? != 1 {
        return Err(Error::protocol("nccl endpoint: unknown version"));
    }
    let s = r.str(128, "address")?;
    r.finish()?;
    s.parse().map_err(|_| Error::protocol(format!("nccl endpoint: bad address {s:?}")))
}

#[async_trait]
impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        let kinds = self.shared.nccl.memory();
        Capabilities {
            local: kinds,
            remote: kinds,
            read: true,
            write: true,
            notify: true,
            same_host_only: false,
            max_request_bytes: 1 << 40,
        }
    }

    async fn start(&self, host: Arc<dyn BackendHost>) -> Result<()> {
        let s = &self.shared;
        let listener = s.serving.start_tcp(host, "nccl control channel", s.cfg.insecure)?;
        s.serving.spawn(accept_loop(listener, Arc::downgrade(s)));
        Ok(())
    }

    fn endpoint(&self) -> Bytes {
        self.shared.endpoint.clone()
    }

    async fn register(&self, region: &RegionInfo) -> Result<Option<Bytes>> {
        let ok = self.shared.nccl.memory().contains(region.kind)
            && match region.kind {
                MemoryKind::Device { ordinal } => ordinal == self.shared.cfg.ordinal,
                _ => true,
            };
        // Reached through the target's check (BackendHost::resolve): nothing to publish.
        Ok(ok.then(Bytes::new))
    }

    async fn deregister(&self, _id: RegionId) -> Result<()> {
        Ok(())
    }

    async fn connect(&self, peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>> {
        let s = &self.shared;
        s.serving.ensure_open()?;
        let addr = decode_endpoint(&peer.endpoint)?;
        let c = connect(s, addr).await?;
        s.outbound.push(&c);
        Ok(Arc::new(NcclConnection { conn: c }))
    }

    async fn shutdown(&self) {
        self.shared.close();
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, shared: Weak<Shared>) {
    loop {
        let (sock, peer) = tensorwire_proto::accept::accept(&listener, "nccl control").await;
        let Some(s) = shared.upgrade() else { return };
        if s.serving.is_closed() {
            return;
        }
        let _ = sock.set_nodelay(true);
        let pending = s.serving.admit(peer.ip());
        s.serving.spawn(serve(Arc::downgrade(&s), sock, peer, pending));
    }
}

/// Joins the communicator on a blocking thread.
async fn join(
    nccl: &Arc<dyn Nccl>,
    id: crate::comm::UniqueId,
    rank: u32,
    cfg: &NcclConfig,
) -> Result<Arc<dyn Comm>> {
    let (nccl, ordinal, limit) = (nccl.clone(), cfg.ordinal, cfg.join_timeout);
    tokio::task::spawn_blocking(move || nccl.join(&id, rank, ordinal, limit))
        .await
        .map_err(|e| Error::Internal(format!("nccl: joining a communicator failed: {e}")))?
}

// ---- target side ----

/// A peer's connection to this backend.
#[derive(Debug)]
struct InConn {
    sender: Sender,
    comm: Arc<dyn Comm>,
}

async fn serve(shared: Weak<Shared>, sock: TcpStream, peer: SocketAddr, mut pending: Pending) {
    if let Err(e) = serve_inner(&shared, sock, peer, &mut pending).await {
        tracing::debug!(%peer, error = %e, "nccl: peer connection ended");
    }
}

async fn serve_inner(
    shared: &Weak<Shared>,
    mut sock: TcpStream,
    peer: SocketAddr,
    pending: &mut Pending,
) -> Result<()> {
    let up = || shared.upgrade().ok_or_else(|| Error::PeerClosed("nccl backend dropped".into()));
    let (secret, limit) = {
        let s = up()?;
        (s.host()?.cluster_secret(), s.cfg.answer_timeout)
    };
    channel::accept(&mut sock, &FRAMING, secret.as_ref(), peer, limit, pending).await?;
    let (mut rd, wr) = sock.into_split();
    let first = tokio::time::timeout(limit, channel::read::<Msg>(&mut rd))
        .await
        .map_err(|_| Error::timeout("nccl: waiting for Hello", limit))??;
    let Some(Msg::Hello { id }) = first else {
        return Err(Error::protocol("nccl: a connection must open with Hello"));
    };
    let sender = Sender::start(wr);
    let s = up()?;
    let comm = match join(&s.nccl, id, 1, &s.cfg).await {
        Ok(c) => c,
        Err(e) => {
            sender.send(Msg::HelloAck { error: Some(e.clone()) }).await?;
            return Err(e);
        }
    };
    let conn = Arc::new(InConn { sender: sender.clone(), comm: comm.clone() });
    s.inbound.push(&conn);
    drop(s);
    sender.send(Msg::HelloAck { error: None }).await?;
    let ended = loop {
        let m = match channel::read::<Msg>(&mut rd).await {
            Ok(Some(m)) => m,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        let s = up()?;
        match m {
            Msg::Request { req, write, region, key, offset, len } => {
                let range = RemoteRange { region, key, offset, len };
                let access = if write { Access::Write } else { Access::Read };
                match s.host().and_then(|h| h.resolve(range, access)) {
                    Ok(slice) => post_target(&conn, req, write, slice),
                    Err(error) => sender.send(Msg::Refused { req, error }).await?,
                }
            }
            Msg::Notify { req, msg } => {
                let error = s.host().and_then(|h| h.deliver(msg)).err();
                sender.send(Msg::NotifyAck { req, error }).await?;
            }
            Msg::Bye => break Ok(()),
            other => {
                break Err(Error::protocol(format!(
                    "nccl: unexpected message kind {} from the initiator",
                    other.kind()
                )));
            }
        }
    };
    // The peer is gone: whatever it left pending ends now.
    comm.abort();
    ended
}

/// Posts the target's half of a granted op and grants it (the slice is held until the half
/// ended; a WRITE's end is reported with `Done`).
fn post_target(conn: &Arc<InConn>, req: u64, write: bool, slice: MemSlice) {
    let (addr, len) = (slice.ptr() as u64, slice.len());
    let sender = conn.sender.clone();
    if write {
        let done: crate::comm::Done = Box::new(move |r| {
            drop(slice);
            sender.send_later(Msg::Done { req, error: r.err() });
        });
        // SAFETY: `slice` (moved into `done`) keeps the resolved, bounds-checked memory
        // registered and mapped until the receive ended.
        unsafe { conn.comm.recv(addr, len, done) };
    } else {
        let done: crate::comm::Done = Box::new(move |_| drop(slice));
        // SAFETY: as above, for the send.
        unsafe { conn.comm.send(addr, len, done) };
    }
    conn.sender.send_later(Msg::Grant { req });
}

// ---- initiator side ----

/// Pieces of one op requested at once: ops take turns, so a large op never gates a small one.
const OP_WINDOW: u32 = 2;

/// An op: cut into pieces of `piece_bytes`, each its own request and matched pair.
#[derive(Debug)]
struct OpEntry {
    op: Op,
    tx: Option<oneshot::Sender<Result<()>>>,
    write: bool,
    /// Offset (in the op) of the first piece not yet requested.
    next: u64,
    /// Pieces requested and not yet finished (granted or not).
    requested: u32,
    /// The first error; no piece is requested after it.
    error: Option<Error>,
}

/// One piece: its op, where it lies in it, and which halves ended.
#[derive(Debug)]
struct Piece {
    op: u64,
    offset: u64,
    len: u64,
    granted: bool,
    local_done: bool,
    remote_done: bool,
}

#[derive(Debug, Default)]
struct ConnState {
    ops: HashMap<u64, OpEntry>,
    pieces: HashMap<u64, Piece>,
    next_op: u64,
    next_req: u64,
    closed: Option<Error>,
}

/// An op that ended, to deliver once the lock is released.
type Ended = (Op, Option<oneshot::Sender<Result<()>>>, Result<()>);

#[derive(Debug)]
struct ConnShared {
    sender: Sender,
    requests: channel::Requests<Msg>,
    comm: Arc<dyn Comm>,
    state: Mutex<ConnState>,
    ended: Condvar,
    cfg: NcclConfig,
}

async fn connect(s: &Arc<Shared>, addr: SocketAddr) -> Result<Arc<ConnShared>> {
    let host = s.host()?;
    let limit = s.cfg.answer_timeout;
    let sock = channel::dial(addr, &FRAMING, host.cluster_secret().as_ref(), limit).await?;
    let id = s.nccl.unique_id()?;
    let (mut rd, mut wr) = sock.into_split();
    channel::write(&mut wr, &Msg::Hello { id }).await?;
    let joined = join(&s.nccl, id, 0, &s.cfg);
    let answer = async {
        tokio::time::timeout(limit + s.cfg.join_timeout, channel::read::<Msg>(&mut rd))
            .await
            .map_err(|_| Error::timeout("nccl: waiting for HelloAck", limit))?
    };
    let (comm, answer) = tokio::join!(joined, answer);
    match answer? {
        Some(Msg::HelloAck { error: None }) => {}
        Some(Msg::HelloAck { error: Some(e) }) => return Err(e),
        _ => return Err(Error::protocol("nccl: the peer did not answer Hello with HelloAck")),
    }
    let comm = comm?;
    let conn = Arc::new(ConnShared {
        sender: Sender::start(wr),
        requests: channel::Requests::default(),
        comm,
        state: Mutex::new(ConnState::default()),
        ended: Condvar::new(),
        cfg: s.cfg.clone(),
    });
    tokio::spawn(reader(Arc::downgrade(&conn), rd));
    Ok(conn)
}

impl ConnShared {
    /// Requests op `id`'s next pieces, up to its window (none after an error).
    fn request_more(&self, st: &mut ConnState, id: u64) {
        let piece = self.cfg.piece_bytes.max(1);
        loop {
            let Some(e) = st.ops.get_mut(&id) else { return };
            let len = e.op.local().len();
            if e.error.is_some() || e.requested >= OP_WINDOW || e.next >= len {
                return;
            }
            let (offset, n) = (e.next, piece.min(len - e.next));
            e.next += n;
            e.requested += 1;
            let r = e.op.range();
            let write = e.write;
            let req = st.next_req;
            st.next_req += 1;
            st.pieces.insert(
                req,
                Piece {
                    op: id,
                    offset,
                    len: n,
                    granted: false,
                    local_done: false,
                    remote_done: false,
                },
            );
            self.sender.send_later(Msg::Request {
                req,
                write,
                region: r.region,
                key: r.key,
                offset: r.offset + offset,
                len: n,
            });
        }
    }

    /// Ends op `id` if nothing of it is requested any more and it is done or failed.
    fn settle(&self, st: &mut ConnState, id: u64) -> Option<Ended> {
        let e = st.ops.get(&id)?;
        let over = e.requested == 0 && (e.error.is_some() || e.next >= e.op.local().len());
        if !over {
            return None;
        }
        let mut e = st.ops.remove(&id)?;
        self.ended.notify_all();
        let r = match e.error.take() {
            Some(err) => Err(err),
            None => Ok(()),
        };
        Some((e.op, e.tx.take(), r))
    }

    /// Piece `req` ended (with `r` for its op): the op may request more, or end.
    fn piece_over(&self, st: &mut ConnState, req: u64, r: Result<()>) -> Option<Ended> {
        let p = st.pieces.remove(&req)?;
        let e = st.ops.get_mut(&p.op)?;
        e.requested -= 1;
        if let Err(err) = r {
            e.error.get_or_insert(err);
        }
        self.request_more(st, p.op);
        self.settle(st, p.op)
    }

    fn deliver(ended: Option<Ended>) {
        if let Some((op, tx, r)) = ended {
            drop(op);
            if let Some(tx) = tx {
                let _ = tx.send(r);
            }
        }
    }

    /// The target granted piece `req`: our half is posted now (grant order), whatever became of
    /// its op meanwhile, so that the pairs keep matching.
    fn granted(self: &Arc<Self>, req: u64) {
        let (addr, len, write) = {
            let mut st = lock(&self.state);
            let Some(p) = st.pieces.get_mut(&req) else { return };
            p.granted = true;
            let (op, offset, len) = (p.op, p.offset, p.len);
            let Some(e) = st.ops.get(&op) else { return };
            (e.op.local().ptr() as u64 + offset, len, e.write)
        };
        let me = Arc::downgrade(self);
        let done: crate::comm::Done = Box::new(move |r| {
            let Some(c) = me.upgrade() else { return };
            let ended = {
                let mut st = lock(&c.state);
                let Some(p) = st.pieces.get_mut(&req) else { return };
                p.local_done = true;
                // A READ piece ends with its receive; a WRITE piece when the target reports too
                // (or at once when the send failed).
                if !write || p.remote_done || r.is_err() {
                    c.piece_over(&mut st, req, r)
                } else {
                    None
                }
            };
            Self::deliver(ended);
        });
        if write {
            // SAFETY: the piece lies inside its op's local slice, which the op entry keeps (it
            // ends only once no piece is requested, so after this send ended).
            unsafe { self.comm.send(addr, len, done) };
        } else {
            // SAFETY: as above, for the receive into local memory.
            unsafe { self.comm.recv(addr, len, done) };
        }
    }

    fn refused(&self, req: u64, error: Error) {
        let ended = {
            let mut st = lock(&self.state);
            self.piece_over(&mut st, req, Err(error))
        };
        Self::deliver(ended);
    }

    fn remote_done(&self, req: u64, error: Option<Error>) {
        let ended = {
            let mut st = lock(&self.state);
            let Some(p) = st.pieces.get_mut(&req) else { return };
            p.remote_done = true;
            let (op, local) = (p.op, p.local_done);
            if local {
                self.piece_over(&mut st, req, error.map_or(Ok(()), Err))
            } else {
                // The send's end ends the piece; the target's error is the op's meanwhile.
                if let (Some(err), Some(e)) = (error, st.ops.get_mut(&op)) {
                    e.error.get_or_insert(err);
                }
                None
            }
        };
        Self::deliver(ended);
    }

    /// The connection is over: pieces not yet granted end now; posted ones end when the aborted
    /// communicator ends them (a WRITE piece needs no report from the gone target).
    fn close(&self, e: Error) {
        self.requests.close(e.clone());
        let mut ended = Vec::new();
        {
            let mut st = lock(&self.state);
            if st.closed.is_some() {
                return;
            }
            st.closed = Some(e.clone());
            for en in st.ops.values_mut() {
                en.error.get_or_insert_with(|| e.clone());
            }
            let reqs: Vec<u64> = st.pieces.keys().copied().collect();
            for req in reqs {
                let Some(p) = st.pieces.get_mut(&req) else { continue };
                p.remote_done = true;
                if !p.granted || p.local_done {
                    ended.push(self.piece_over(&mut st, req, Err(e.clone())));
                }
            }
        }
        self.comm.abort();
        self.sender.send_later(Msg::Bye);
        for x in ended {
            Self::deliver(x);
        }
    }

    /// Waits until op `id` ended (a dropped READ: its receives are posted or about to be, and
    /// cannot be recalled); past the bound the communicator is aborted, which ends them.
    fn wait_out(&self, id: u64) {
        let bound = self.cfg.cancel_timeout;
        let deadline = Instant::now() + bound;
        let mut st = lock(&self.state);
        if let Some(e) = st.ops.get_mut(&id) {
            e.error.get_or_insert_with(|| Error::PeerClosed("nccl: op cancelled".into()));
        }
        let mut aborted = false;
        while st.ops.contains_key(&id) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                if aborted {
                    tracing::error!("nccl: a cancelled READ did not end after the abort");
                    return;
                }
                drop(st);
                tracing::warn!(
                    "nccl: a cancelled READ did not end in time; aborting the communicator"
                );
                self.close(Error::timeout("nccl: a cancelled READ", bound));
                aborted = true;
                st = lock(&self.state);
                continue;
            }
            st = self.ended.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

async fn reader(conn: Weak<ConnShared>, mut rd: OwnedReadHalf) {
    loop {
        let m = channel::read::<Msg>(&mut rd).await;
        let Some(c) = conn.upgrade() else { return };
        match m {
            Ok(Some(Msg::Grant { req })) => c.granted(req),
            Ok(Some(Msg::Refused { req, error })) => c.refused(req, error),
            Ok(Some(Msg::Done { req, error })) => c.remote_done(req, error),
            Ok(Some(m @ Msg::NotifyAck { .. })) => {
                if let Msg::NotifyAck { req, .. } = m {
                    c.requests.answer(req, m);
                }
            }
            Ok(Some(Msg::Bye)) | Ok(None) => {
                return c
                    .close(Error::PeerClosed("nccl: the peer closed the control channel".into()));
            }
            Ok(Some(other)) => {
                return c.close(Error::protocol(format!(
                    "nccl: unexpected message kind {} from the target",
                    other.kind()
                )));
            }
            Err(e) => return c.close(e),
        }
    }
}

/// The connection as the engine holds it.
#[derive(Debug)]
struct NcclConnection {
    conn: Arc<ConnShared>,
}

impl Drop for NcclConnection {
    fn drop(&mut self) {
        self.conn.close(Error::PeerClosed("nccl: connection dropped".into()));
    }
}

impl Connection for NcclConnection {
    fn submit(&self, ops: Vec<Op>) -> Vec<Completion> {
        let c = &self.conn;
        let mut out = Vec::with_capacity(ops.len());
        let mut ended = Vec::new();
        {
            let mut st = lock(&c.state);
            for op in ops {
                let (tx, rx) = oneshot::channel();
                let id = st.next_op;
                st.next_op += 1;
                let write = op.dir() == Direction::Write;
                let completion =
                    NcclCompletion { rx, conn: c.clone(), id, reads: !write, finished: false };
                out.push(Box::pin(completion) as Completion);
                if let Some(e) = st.closed.clone() {
                    ended.push(Some((op, Some(tx), Err(e))));
                    continue;
                }
                st.ops.insert(
                    id,
                    OpEntry { op, tx: Some(tx), write, next: 0, requested: 0, error: None },
                );
                c.request_more(&mut st, id);
                // A zero-length op has no piece: it ends at once.
                ended.push(c.settle(&mut st, id));
            }
        }
        for x in ended {
            ConnShared::deliver(x);
        }
        out
    }

    fn notify(&self, msg: Bytes) -> Completion {
        let c = self.conn.clone();
        Box::pin(async move {
            let limit = c.cfg.answer_timeout;
            match channel::ask(&c.sender, &c.requests, limit, "notification answer", |req| {
                Msg::Notify { req, msg }
            })
            .await?
            {
                Msg::NotifyAck { error: None, .. } => Ok(()),
                Msg::NotifyAck { error: Some(e), .. } => Err(e),
                other => Err(Error::protocol(format!(
                    "nccl: notification answered with kind {}",
                    other.kind()
                ))),
            }
        })
    }

    fn broken(&self) -> Option<Error> {
        lock(&self.conn.state).closed.clone()
    }
}

/// One op's completion; dropping a READ's before it resolved waits for its receive (bounded).
struct NcclCompletion {
    rx: oneshot::Receiver<Result<()>>,
    conn: Arc<ConnShared>,
    id: u64,
    reads: bool,
    finished: bool,
}

impl Future for NcclCompletion {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(r) => {
                self.finished = true;
                Poll::Ready(r.unwrap_or_else(|_| Err(Error::PeerClosed("nccl: op dropped".into()))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for NcclCompletion {
    fn drop(&mut self) {
        if !self.finished && self.reads {
            self.conn.wait_out(self.id);
        }
    }
}
