//! The initiating side: a connection is N data streams to one peer. Ops are cut into pieces of at
//! most `piece_bytes`, and into at least one piece per stream when each is still at least
//! [`MIN_SHARE`] (see [`cut`]): a 1 MiB op uses two streams, a 1 GiB one every stream. Every stream's
//! writer takes the next piece from a shared queue (ops of one piece before pieces of larger
//! ops, so a small op never waits behind a large one), which stripes ops across the streams. Each stream's reader matches responses to its pieces in order
//! (the server answers a stream's requests in order) and lands READ payloads in local memory.
//!
//! A stream that fails kills the whole connection: every queued and pending op fails with the
//! stream's error, the sockets are shut down, and later submits fail at once.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::backend::kit::{
    CancelGate, CompletionSender, MAX_NOTIFY_WIRE, decode_error, gated, notice_beside, ready,
};
use tensorwire_core::backend::{Completion, Connection, Direction, Op};
use tensorwire_core::{AccessKey, Error, RegionId, Result};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use crate::io::{self, Landed, Watchdog};
use crate::wire::{DataHeader, HEADER_LEN, Kind, PREAMBLE, Ticket, check_preamble};

/// The smallest piece an op is cut into to use another stream: below it, a stream's header, its
/// wake-ups and its answer cost more than the copy it takes over. An op of one piece goes out
/// from the submitting task ([`ConnShared::send_now`]): on two cores, 256 and 512 KiB ops so
/// moved 9.5-10.3 GB/s where cut in two for two streams' writers they moved 2.4-5.0 GB/s
/// (`xfer --backend tcp`); 64 KiB shares cut 128 KiB-1 MiB ops in two.
pub(crate) const MIN_SHARE: u64 = 512 << 10;

/// Bytes a stream may have in flight and still take a small op's request from its submitter
/// ([`ConnShared::send_now`]): ahead of it there, only small pieces, each answered quickly.
const SMALL_AHEAD: u64 = 256 << 10;

/// How an op of `len` bytes is cut: (offset, length) of each piece, contiguous and in order.
/// As many pieces as `streams` (fewer when a piece would be under [`MIN_SHARE`]), or more when
/// that keeps each within `piece`; the pieces are as equal as bytes allow.
pub(crate) fn cut(len: u64, piece: u64, streams: usize) -> Vec<(u64, u64)> {
    let wide = (len / MIN_SHARE).clamp(1, streams.max(1) as u64);
    let n = len.div_ceil(piece.max(1)).max(wide);
    let (each, extra) = (len / n, len % n);
    let mut at = 0;
    (0..n)
        .map(|k| {
            let l = each + u64::from(k < extra);
            at += l;
            (at - l, l)
        })
        .collect()
}

/// The state of one op shared by its pieces.
#[derive(Debug)]
struct OpState {
    gate: Arc<CancelGate>,
    remaining: AtomicUsize,
    done: Mutex<Option<CompletionSender>>,
    /// Keeps the local memory registered and mapped while any piece is queued or in flight, and
    /// the op (with the engine's notification fence) alive until it has ended.
    _op: Option<Op>,
}

impl OpState {
    fn finish(&self, r: Result<()>) {
        let last = match &r {
            Ok(()) => self.remaining.fetch_sub(1, Ordering::AcqRel) == 1,
            Err(_) => true,
        };
        if last {
            if let Some(tx) = self.done.lock().take() {
                let _ = tx.send(r);
            }
        }
    }
}

#[derive(Debug)]
enum What {
    Write,
    /// With the notice the server delivers before serving it (the op's first piece only).
    Read(Option<Bytes>),
    Notify(Bytes),
}

impl What {
    /// A READ or WRITE (what the streams balance), not a notification.
    fn is_data(&self) -> bool {
        !matches!(self, What::Notify(_))
    }
}

/// One piece of an op: what goes in one request frame.
#[derive(Debug)]
struct Piece {
    what: What,
    op: Arc<OpState>,
    region: RegionId,
    key: AccessKey,
    offset: u64,
    /// Local address of the piece's bytes (WRITE source, READ destination).
    addr: usize,
    len: u64,
    /// The whole op (or a notification): queued before the pieces of larger ops.
    small: bool,
}

impl Piece {
    fn kind(&self) -> Kind {
        match self.what {
            What::Write => Kind::WriteReq,
            What::Read(_) => Kind::ReadReq,
            What::Notify(_) => Kind::Notify,
        }
    }
}

#[derive(Debug, Default)]
struct Queues {
    small: VecDeque<Piece>,
    bulk: VecDeque<Piece>,
    dead: Option<Error>,
}

#[derive(Debug, Default)]
struct Pending {
    q: VecDeque<(u64, Piece)>,
    dead: Option<Error>,
}

#[derive(Debug)]
struct StreamState {
    sock: TcpStream,
    pending: Mutex<Pending>,
    /// Bytes of this stream's pieces sent and not yet answered.
    inflight: AtomicU64,
    /// Data pieces (READ or WRITE) of this stream taken and not yet answered (a READ payload
    /// being received counts). Notifications do not: they are tiny, and a stream waiting for a
    /// notification's answer is free to move data.
    outstanding: AtomicUsize,
    /// Signalled when this stream's work drops, and when another stream's rises.
    room: Notify,
    /// Pieces taken by this stream, and their bytes (for the backend's stats).
    pieces: AtomicU64,
    bytes: AtomicU64,
    /// Who holds it owns the socket's sending side (see [`StreamState::acquire`]).
    sending: AtomicBool,
    /// Signalled when `sending` is released.
    free: Notify,
}

impl StreamState {
    /// Waits until this stream should take another piece: at once when it has none outstanding;
    /// with work outstanding, only while no other stream has fewer data pieces outstanding and
    /// fewer than `window` bytes are outstanding here. Pieces so go to the least loaded stream:
    /// without that the first writer to wake would take every piece of an op (READ requests are
    /// tiny), and an op of four pieces on two streams could run three on one stream and one on
    /// the other, which then idles for a third of the op.
    async fn wait_room(&self, window: u64, c: &ConnShared) {
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if c.is_dead().is_some() || self.may_take(window, c) {
                return;
            }
            notified.await;
        }
    }

    /// Whether this stream should take another piece now (see [`StreamState::wait_room`]).
    fn may_take(&self, window: u64, c: &ConnShared) -> bool {
        let mine = self.outstanding.load(Ordering::Acquire);
        mine == 0
            || self.others(c).all(|o| o.outstanding.load(Ordering::Acquire) >= mine)
                && self.inflight.load(Ordering::Acquire) < window
    }

    /// The connection's other streams.
    fn others<'a>(&'a self, c: &'a ConnShared) -> impl Iterator<Item = &'a StreamState> {
        c.streams.iter().filter(move |o| !std::ptr::eq(*o, self))
    }

    /// Counts a piece taken by this stream's writer (`data`: a READ or WRITE); a data piece makes
    /// the other streams' writers look again (they may have been waiting for this stream to be
    /// as loaded as they are).
    fn took(&self, len: u64, data: bool, c: &ConnShared) {
        self.inflight.fetch_add(len, Ordering::AcqRel);
        if !data {
            return;
        }
        self.pieces.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(len, Ordering::Relaxed);
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        self.others(c).for_each(|o| o.room.notify_waiters());
    }

    /// Takes the sending side if nobody holds it. Holders: the stream's writer task, a
    /// submitting task sending a request at once ([`ConnShared::send_now`], never across an
    /// await), and the task that finishes a request the socket took only part of.
    fn try_acquire(&self) -> bool {
        self.sending.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// Waits for the sending side (held, at most, for one request's send: a stalled one ends
    /// with the stream, by the watchdog).
    async fn acquire(&self) {
        loop {
            let free = self.free.notified();
            tokio::pin!(free);
            free.as_mut().enable();
            if self.try_acquire() {
                return;
            }
            free.await;
        }
    }

    fn release(&self) {
        self.sending.store(false, Ordering::Release);
        self.free.notify_one();
    }

    fn answered(&self, len: u64, data: bool) {
        self.inflight.fetch_sub(len, Ordering::AcqRel);
        if data {
            self.outstanding.fetch_sub(1, Ordering::AcqRel);
        }
        self.room.notify_one();
    }
}

/// Settings the client side needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientCfg {
    pub(crate) piece: u64,
    pub(crate) checksum: bool,
    pub(crate) stall: Duration,
}

#[derive(Debug)]
pub(crate) struct ConnShared {
    peer: SocketAddr,
    cfg: ClientCfg,
    queues: Mutex<Queues>,
    work: Notify,
    streams: Vec<StreamState>,
    next_id: AtomicU64,
}

impl ConnShared {
    /// Fails everything queued or pending and shuts the sockets; idempotent.
    pub(crate) fn kill(&self, e: Error) {
        let queued = {
            let mut q = self.queues.lock();
            if q.dead.is_none() {
                q.dead = Some(e.clone());
            }
            let mut all: Vec<Piece> = q.small.drain(..).collect();
            all.extend(q.bulk.drain(..));
            all
        };
        for p in queued {
            p.op.finish(Err(e.clone()));
        }
        for s in &self.streams {
            let pending: Vec<_> = {
                let mut p = s.pending.lock();
                if p.dead.is_none() {
                    p.dead = Some(e.clone());
                }
                p.q.drain(..).collect()
            };
            for (_, p) in pending {
                p.op.finish(Err(e.clone()));
            }
            use std::os::fd::AsRawFd;
            // SAFETY: shutting down the socket's fd, which `s.sock` keeps open; this only makes
            // blocked and later I/O on it fail or see end of stream.
            unsafe { libc::shutdown(s.sock.as_raw_fd(), libc::SHUT_RDWR) };
        }
        self.work.notify_waiters();
        self.streams.iter().for_each(|s| s.room.notify_waiters());
    }

    /// Pieces and bytes each stream took so far, by stream index.
    pub(crate) fn stream_counts(&self) -> Vec<(u64, u64)> {
        self.streams
            .iter()
            .map(|s| (s.pieces.load(Ordering::Relaxed), s.bytes.load(Ordering::Relaxed)))
            .collect()
    }

    fn is_dead(&self) -> Option<Error> {
        self.queues.lock().dead.clone()
    }

    fn enqueue(&self, pieces: Vec<Piece>) {
        let n = pieces.len();
        let refused = {
            let mut q = self.queues.lock();
            match &q.dead {
                Some(e) => Some((e.clone(), pieces)),
                None => {
                    for p in pieces {
                        if p.small { q.small.push_back(p) } else { q.bulk.push_back(p) }
                    }
                    None
                }
            }
        };
        match refused {
            Some((e, pieces)) => pieces.into_iter().for_each(|p| p.op.finish(Err(e.clone()))),
            None => (0..n.min(self.streams.len())).for_each(|_| self.work.notify_one()),
        }
    }

    /// Gives back a piece a writer took but should not send (its stream became busier than
    /// another meanwhile): first in its queue again, for another writer.
    fn requeue(&self, p: Piece) {
        let mut q = self.queues.lock();
        if let Some(e) = q.dead.clone() {
            drop(q);
            return p.op.finish(Err(e));
        }
        if p.small {
            q.small.push_front(p)
        } else {
            q.bulk.push_front(p)
        }
        drop(q);
        self.work.notify_one();
    }

    async fn next_piece(&self) -> Option<Piece> {
        loop {
            let notified = self.work.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut q = self.queues.lock();
                if q.dead.is_some() {
                    return None;
                }
                if let Some(p) = q.small.pop_front().or_else(|| q.bulk.pop_front()) {
                    return Some(p);
                }
            }
            notified.await;
        }
    }
}

/// A connection to one peer's tcp backend.
#[derive(Debug)]
pub(crate) struct TcpConnection {
    shared: Arc<ConnShared>,
    tasks: Vec<AbortHandle>,
}

impl Drop for TcpConnection {
    fn drop(&mut self) {
        self.shared.kill(Error::PeerClosed("tcp connection dropped".into()));
        self.tasks.iter().for_each(AbortHandle::abort);
    }
}

/// Tries to open a stream a few times (with short pauses) when the server closes it during its
/// setup: a listener whose bound of pending streams is full closes its oldest pending stream to
/// admit a new one, so under a flood of strangers' streams a peer's stream may go before its
/// ticket was read. Any other failure is returned at once.
async fn open_stream_retrying(
    addr: SocketAddr,
    ticket: &Ticket,
    stall: Duration,
) -> Result<TcpStream> {
    const TRIES: u32 = 4;
    let mut pause = Duration::from_millis(5);
    for _ in 1..TRIES {
        match open_stream(addr, ticket, stall).await {
            Err(Error::PeerClosed(why)) => {
                tracing::debug!(%addr, %why, "tcp: the stream closed at setup; trying again")
            }
            other => return other,
        }
        tokio::time::sleep(pause).await;
        pause *= 4;
    }
    open_stream(addr, ticket, stall).await
}

async fn open_stream(addr: SocketAddr, ticket: &Ticket, stall: Duration) -> Result<TcpStream> {
    let sock = TcpStream::connect(addr).await?;
    sock.set_nodelay(true)?;
    crate::keepalive(&sock);
    let mut dog = Watchdog::new(stall);
    let opening = [(PREAMBLE.as_ptr() as usize, 8), (ticket.0.as_ptr() as usize, ticket.0.len())];
    // SAFETY: PREAMBLE is a static and `ticket` a borrow that outlives the send, each readable
    // for its length.
    unsafe { io::send_parts(&sock, opening, &mut dog, "preamble") }.await?;
    let mut pre = [0u8; 8];
    if !io::recv_buf(&sock, &mut pre, &mut dog, &|| true, "preamble").await? {
        return Err(Error::PeerClosed(format!("tcp: {addr} closed the stream at setup")));
    }
    check_preamble(&pre)?;
    Ok(sock)
}

impl TcpConnection {
    /// Opens `streams` data streams to `addr`, each showing `ticket` (from the peer's endpoint).
    pub(crate) async fn open(
        addr: SocketAddr,
        ticket: Ticket,
        streams: usize,
        cfg: ClientCfg,
    ) -> Result<(Self, Arc<ConnShared>)> {
        let mut socks = Vec::with_capacity(streams);
        for _ in 0..streams.max(1) {
            socks.push(open_stream_retrying(addr, &ticket, cfg.stall).await?);
        }
        let shared = Arc::new(ConnShared {
            peer: addr,
            cfg,
            queues: Mutex::new(Queues::default()),
            work: Notify::new(),
            streams: socks
                .into_iter()
                .map(|sock| StreamState {
                    sock,
                    pending: Mutex::new(Pending::default()),
                    inflight: AtomicU64::new(0),
                    outstanding: AtomicUsize::new(0),
                    pieces: AtomicU64::new(0),
                    bytes: AtomicU64::new(0),
                    room: Notify::new(),
                    sending: AtomicBool::new(false),
                    free: Notify::new(),
                })
                .collect(),
            next_id: AtomicU64::new(1),
        });
        let mut tasks = Vec::new();
        for i in 0..shared.streams.len() {
            let (w, r) = (shared.clone(), shared.clone());
            tasks.push(tokio::spawn(async move { writer(w, i).await }).abort_handle());
            tasks.push(tokio::spawn(async move { reader(r, i).await }).abort_handle());
        }
        Ok((TcpConnection { shared: shared.clone(), tasks }, shared))
    }
}

/// A piece's request as it goes on the wire: the header and the body it gathers (a WRITE's
/// bytes, a notification, a READ's notice), kept alive until the frame is dropped.
struct Frame {
    header: [u8; HEADER_LEN],
    body: (usize, usize),
    /// A notification's or notice's bytes; the op, which holds a WRITE's source registered.
    _keep: (Option<Bytes>, Arc<OpState>),
}

impl Frame {
    fn new(p: &Piece, id: u64, checksum: bool) -> Frame {
        let mut h = DataHeader::request(p.kind(), id, p.region, p.key, p.offset, p.len);
        let mut body = (0usize, 0usize);
        let mut bytes = None;
        match &p.what {
            What::Write => {
                if checksum {
                    // SAFETY: the piece's source is `len` readable bytes of registered memory,
                    // held by the op's MemSlice.
                    let src =
                        unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.len as usize) };
                    h = h.with_crc(crc32c::crc32c(src));
                }
                body = (p.addr, p.len as usize);
            }
            What::Read(notice) => {
                if checksum {
                    h = h.with_crc(0); // asks the server for a checksum
                }
                if let Some(b) = notice {
                    // Bounded by MAX_NOTIFY_WIRE in `submit_noticed`.
                    h = h.with_notice(b.len() as u32);
                    body = (b.as_ptr() as usize, b.len());
                    bytes = Some(b.clone());
                }
            }
            What::Notify(b) => {
                body = (b.as_ptr() as usize, b.len());
                bytes = Some(b.clone());
            }
        }
        Frame { header: h.encode(), body, _keep: (bytes, p.op.clone()) }
    }

    /// The frame's parts past its first `sent` bytes.
    fn parts(&self, sent: usize) -> [(usize, usize); 2] {
        let h = sent.min(HEADER_LEN);
        let b = (sent - h).min(self.body.1);
        [(self.header.as_ptr() as usize + h, HEADER_LEN - h), (self.body.0 + b, self.body.1 - b)]
    }
}

impl ConnShared {
    /// Makes `p`'s request and puts `p` among stream `s`'s pending pieces, which the caller,
    /// holding `s`'s sending side, then sends; `None` when the stream is dead (`p` then failed).
    fn stage(&self, s: &StreamState, p: Piece) -> Option<Frame> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = Frame::new(&p, id, self.cfg.checksum);
        let mut pend = s.pending.lock();
        if let Some(e) = pend.dead.clone() {
            drop(pend);
            p.op.finish(Err(e));
            return None;
        }
        s.took(p.len, p.what.is_data(), self);
        pend.q.push_back((id, p));
        Some(frame)
    }

    /// Sends a one-piece op's request from the submitting task, when nothing is queued and a
    /// stream can take it: the first stream whose sending side is free and that has nothing
    /// outstanding or, with the piece, at most [`SMALL_AHEAD`] bytes in flight (only small
    /// pieces ahead of it there, each answered quickly). No writer task to wake (a thread
    /// wake-up on an idle runtime costs more than a small op's send). Small ops pack onto one
    /// stream rather than spread: each stream that answers wakes its reader, and on two cores
    /// a batch of 2-4 small ops spread over two streams took 2-3x the time of one op per op
    /// (`xfer --batch`); packed it takes less. What the socket does not take at once is
    /// finished by a task. Gives the piece back when it cannot (the caller queues it).
    fn send_now(self: &Arc<Self>, p: Piece) -> Option<Piece> {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return Some(p) };
        {
            let q = self.queues.lock();
            if q.dead.is_some() || !q.small.is_empty() || !q.bulk.is_empty() {
                return Some(p);
            }
        }
        let takes = |s: &StreamState| {
            s.outstanding.load(Ordering::Acquire) == 0
                || s.inflight.load(Ordering::Acquire) + p.len <= SMALL_AHEAD
        };
        let Some(i) = self.streams.iter().position(|s| takes(s) && s.try_acquire()) else {
            return Some(p);
        };
        let s = &self.streams[i];
        let Some(frame) = self.stage(s, p) else {
            s.release();
            return None;
        };
        let mut parts = frame.parts(0);
        let total: usize = parts.iter().map(|p| p.1).sum();
        let mut dog = Watchdog::new(self.cfg.stall);
        // SAFETY: `frame` holds its header and body alive for the call.
        match unsafe { io::try_send_parts(&s.sock, &mut parts, &mut dog) } {
            Ok(true) => s.release(),
            Ok(false) => {
                let sent = total - parts.iter().map(|p| p.1).sum::<usize>();
                let c = self.clone();
                rt.spawn(async move {
                    let s = &c.streams[i];
                    let mut dog = Watchdog::new(c.cfg.stall);
                    // SAFETY: `frame` holds its header and body alive until the send is over.
                    let r =
                        unsafe { io::send_parts(&s.sock, frame.parts(sent), &mut dog, "request") }
                            .await;
                    s.release();
                    drop(frame);
                    if let Err(e) = r {
                        c.kill(e);
                    }
                });
            }
            Err(e) => {
                s.release();
                self.kill(e);
            }
        }
        None
    }
}

async fn writer(c: Arc<ConnShared>, i: usize) {
    let s = &c.streams[i];
    let mut dog = Watchdog::new(c.cfg.stall);
    let window = 4 * c.cfg.piece;
    loop {
        s.wait_room(window, &c).await;
        let Some(p) = c.next_piece().await else { return };
        if p.op.gate.is_cancelled() {
            p.op.finish(Ok(())); // nobody waits; do not spend the wire on it
            continue;
        }
        if !s.may_take(window, &c) {
            // A submitter sent a piece on this stream while this writer waited for work: the
            // piece goes to a less busy stream (a notification behind a slow READ would wait
            // for its data: the peer serves a stream's requests in order).
            c.requeue(p);
            continue;
        }
        s.acquire().await;
        let Some(frame) = c.stage(s, p) else {
            s.release();
            continue;
        };
        // SAFETY: `frame` holds its header and body alive until the send is over.
        let sent = unsafe { io::send_parts(&s.sock, frame.parts(0), &mut dog, "request") }.await;
        s.release();
        drop(frame);
        if let Err(e) = sent {
            c.kill(e);
            return;
        }
    }
}

/// Returns a piece to its stream's window when the reader is done with it: before the op's
/// completion is sent (so the next op sees the stream idle), or at the latest when dropped.
struct Answered<'a> {
    stream: &'a StreamState,
    len: u64,
    data: bool,
    done: bool,
}

impl Answered<'_> {
    fn release(&mut self) {
        if !std::mem::replace(&mut self.done, true) {
            self.stream.answered(self.len, self.data);
        }
    }

    /// Releases the piece, then ends it with `r`.
    fn finish(&mut self, op: &OpState, r: Result<()>) {
        self.release();
        op.finish(r);
    }
}

impl Drop for Answered<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

fn matches(req: &What, resp: Kind) -> bool {
    matches!(
        (req, resp),
        (What::Write, Kind::WriteAck)
            | (What::Read(_), Kind::ReadResp)
            | (What::Notify(_), Kind::NotifyAck)
    )
}

async fn reader(c: Arc<ConnShared>, i: usize) {
    let s = &c.streams[i];
    let mut dog = Watchdog::new(c.cfg.stall);
    let busy = || !s.pending.lock().q.is_empty();
    let mut hbuf = [0u8; HEADER_LEN];
    loop {
        let r = io::recv_buf(&s.sock, &mut hbuf, &mut dog, &busy, "response header").await;
        let h = match r.and_then(|open| {
            if open {
                DataHeader::decode(&hbuf)
            } else {
                Err(Error::PeerClosed(format!("tcp: {} closed the stream", c.peer)))
            }
        }) {
            Ok(h) => h,
            Err(e) => return c.kill(e),
        };
        let Some((id, p)) = s.pending.lock().q.pop_front() else {
            return c
                .kill(Error::protocol(format!("tcp: unsolicited {:?} from {}", h.kind, c.peer)));
        };
        let mut ans = Answered { stream: s, len: p.len, data: p.what.is_data(), done: false };
        if h.id != id || !matches(&p.what, h.kind) {
            let e = Error::protocol(format!(
                "tcp: response {:?} #{} does not answer request #{id}",
                h.kind, h.id
            ));
            ans.finish(&p.op, Err(e.clone()));
            return c.kill(e);
        }
        if !h.ok {
            let mut body = vec![0u8; h.len as usize]; // bounded by MAX_ERROR_BYTES in decode
            match io::recv_buf(&s.sock, &mut body, &mut dog, &|| true, "error body").await {
                Ok(true) => {}
                Ok(false) => {
                    let e = Error::PeerClosed("tcp: stream ended inside an error".into());
                    ans.finish(&p.op, Err(e.clone()));
                    return c.kill(e);
                }
                Err(e) => {
                    ans.finish(&p.op, Err(e.clone()));
                    return c.kill(e);
                }
            }
            ans.finish(&p.op, Err(decode_error(&body).unwrap_or_else(|e| e)));
            continue;
        }
        if let What::Read(_) = p.what {
            if h.len != p.len {
                let e = Error::protocol(format!(
                    "tcp: READ answered with {} bytes, asked {}",
                    h.len, p.len
                ));
                ans.finish(&p.op, Err(e.clone()));
                return c.kill(e);
            }
            // SAFETY: the destination is `len` bytes of registered memory held by the op's
            // MemSlice; every recv runs inside the op's cancel gate, so nothing lands after the
            // op's completion is dropped.
            let landed = unsafe {
                io::recv_into(&s.sock, p.addr, p.len, Some(&p.op.gate), &mut dog, "READ payload")
            }
            .await;
            match landed {
                Ok(Landed::All) => ans.finish(&p.op, check_read(&p, &h, c.cfg.checksum)),
                Ok(Landed::Cancelled) => ans.finish(&p.op, Ok(())),
                Err(e) => {
                    ans.finish(&p.op, Err(e.clone()));
                    return c.kill(e);
                }
            }
            continue;
        }
        ans.finish(&p.op, Ok(()));
    }
}

fn check_read(p: &Piece, h: &DataHeader, want: bool) -> Result<()> {
    if !want {
        return Ok(());
    }
    let what = format!("tcp READ of region {} [{}, +{})", p.region.0, p.offset, p.len);
    let Some(expected) = h.crc() else {
        return Err(Error::protocol(format!("{what}: the peer sent no checksum")));
    };
    // SAFETY: the piece's destination is `len` bytes of registered memory held by the op's
    // MemSlice; it is only read here.
    let got = unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.len as usize) };
    let actual = crc32c::crc32c(got);
    if actual == expected { Ok(()) } else { Err(Error::Checksum { what, expected, actual }) }
}

impl TcpConnection {
    /// The ops' completions; with `notice`, the first op (a READ) carries it in its first piece.
    fn submit_with(&self, ops: Vec<Op>, mut notice: Option<Bytes>) -> Vec<Completion> {
        let c = &self.shared;
        ops.into_iter()
            .map(|op| {
                // Only the first op carries it; an op refused here sends none.
                let mut notice = notice.take();
                if let Some(e) = c.is_dead() {
                    return ready(Err(e));
                }
                if !op.local().kind().is_host() {
                    return ready(Err(Error::Unsupported {
                        backend: crate::NAME,
                        what: format!("{:?} memory", op.local().kind()),
                    }));
                }
                let len = op.local().len();
                let cuts = cut(len, c.cfg.piece, c.streams.len());
                let n = cuts.len() as u64;
                let (gate, tx, completion) = gated();
                let base = op.local().ptr() as usize;
                let (dir, remote) = (op.dir(), op.remote().clone());
                let state = Arc::new(OpState {
                    gate,
                    remaining: AtomicUsize::new(n as usize),
                    done: Mutex::new(Some(tx)),
                    _op: Some(op),
                });
                let mut what = || match dir {
                    Direction::Write => What::Write,
                    Direction::Read => What::Read(notice.take()),
                };
                let pieces = cuts
                    .into_iter()
                    .map(|(at, len)| Piece {
                        what: what(),
                        op: state.clone(),
                        region: remote.region,
                        key: remote.key,
                        offset: remote.offset + at,
                        addr: base + at as usize,
                        len,
                        small: n == 1,
                    })
                    .collect();
                let mut pieces: Vec<Piece> = pieces;
                // An op of one piece sends it at once when it can; the pieces of a larger
                // one go to the writers, which copy them into their sockets side by side.
                if n == 1 {
                    pieces = pieces.into_iter().filter_map(|p| c.send_now(p)).collect();
                }
                if !pieces.is_empty() {
                    c.enqueue(pieces);
                }
                completion
            })
            .collect()
    }
}

impl Connection for TcpConnection {
    fn broken(&self) -> Option<Error> {
        self.shared.is_dead()
    }

    fn submit(&self, ops: Vec<Op>) -> Vec<Completion> {
        self.submit_with(ops, None)
    }

    /// A notice rides in the first READ piece's request (the server delivers it before serving
    /// the READ, and answers a refusal as the READ's error); before a WRITE it goes beside.
    fn submit_noticed(&self, notice: Bytes, ops: Vec<Op>) -> Vec<Completion> {
        let rides = ops.first().is_some_and(|op| op.dir() == Direction::Read)
            && notice.len() <= MAX_NOTIFY_WIRE;
        if rides {
            return self.submit_with(ops, Some(notice));
        }
        notice_beside(self.notify(notice), self.submit(ops))
    }

    fn notify(&self, msg: Bytes) -> Completion {
        let c = self.shared.clone();
        Box::pin(async move {
            if let Some(e) = c.is_dead() {
                return Err(e);
            }
            let (gate, tx, completion) = gated();
            let state = Arc::new(OpState {
                gate,
                remaining: AtomicUsize::new(1),
                done: Mutex::new(Some(tx)),
                _op: None,
            });
            let len = msg.len() as u64;
            let piece = Piece {
                what: What::Notify(msg),
                op: state,
                region: RegionId(0),
                key: AccessKey::from_bits(0),
                offset: 0,
                addr: 0,
                len,
                small: true,
            };
            c.enqueue(vec![piece]);
            completion.await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_op_uses_every_stream_once_its_shares_are_big_enough() {
        let mib = 1 << 20;
        assert_eq!(cut(mib, 4 * mib, 2), vec![(0, mib / 2), (mib / 2, mib / 2)]);
        assert_eq!(cut(4 * mib, 4 * mib, 4).len(), 4);
        assert_eq!(cut(mib / 2, 4 * mib, 8), vec![(0, mib / 2)], "one share's worth");
        assert_eq!(cut(mib - 1, 4 * mib, 8).len(), 1, "under two shares");
        assert_eq!(cut(100, 4 * mib, 8), vec![(0, 100)]);
        assert_eq!(cut(0, 4 * mib, 8), vec![(0, 0)], "an empty op is one empty piece");
        assert_eq!(cut(64 * mib, 4 * mib, 2).len(), 16, "no piece over the piece size");
    }

    #[test]
    fn a_frame_resumes_where_its_send_stopped() {
        let (gate, tx, _completion) = tensorwire_core::backend::kit::gated();
        let op = Arc::new(OpState {
            gate,
            remaining: AtomicUsize::new(1),
            done: Mutex::new(Some(tx)),
            _op: None,
        });
        let body = [7u8; 100];
        let p = Piece {
            what: What::Write,
            op,
            region: RegionId(3),
            key: AccessKey::from_bits(9),
            offset: 0,
            addr: body.as_ptr() as usize,
            len: 100,
            small: true,
        };
        let f = Frame::new(&p, 1, false);
        let (h, b) = (f.header.as_ptr() as usize, body.as_ptr() as usize);
        assert_eq!(f.parts(0), [(h, HEADER_LEN), (b, 100)]);
        assert_eq!(f.parts(5), [(h + 5, HEADER_LEN - 5), (b, 100)]);
        assert_eq!(f.parts(HEADER_LEN), [(h + HEADER_LEN, 0), (b, 100)]);
        assert_eq!(f.parts(HEADER_LEN + 40), [(h + HEADER_LEN, 0), (b + 40, 60)]);
        assert_eq!(f.parts(HEADER_LEN + 100), [(h + HEADER_LEN, 0), (b + 100, 0)]);
        assert_eq!(f.parts(HEADER_LEN + 500), [(h + HEADER_LEN, 0), (b + 100, 0)], "past the end");
    }

    proptest! {
        #[test]
        fn pieces_cover_the_op_in_order_within_bounds(len in 0u64..(1 << 34), piece in 1u64..(1 << 24), streams in 1usize..9) {
            let v = cut(len, piece, streams);
            let mut at = 0;
            for &(o, l) in &v {
                prop_assert_eq!(o, at);
                prop_assert!(l <= piece.max(1) || v.len() == 1 && l == 0);
                at += l;
            }
            prop_assert_eq!(at, len);
            let (lo, hi) = (v.iter().map(|p| p.1).min().unwrap(), v.iter().map(|p| p.1).max().unwrap());
            prop_assert!(hi - lo <= 1, "as equal as bytes allow");
            prop_assert!(v.len() as u64 >= (len / MIN_SHARE).clamp(1, streams as u64));
        }
    }
}
