//! The progress thread: the one thread that owns the UCP context, worker, endpoints, memory
//! handles and remote keys. Everything else talks to it through [`Handle`]: a bounded command
//! queue plus an eventfd that wakes it. When idle it sleeps in `poll(2)` on that eventfd and on the
//! worker's event fd (`ucp_worker_arm`), so an idle backend uses no CPU; while requests are
//! outstanding it wakes at least every [`BUSY_TICK`] to check its deadlines.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_core::backend::kit::MAX_BLOB_BYTES;
use tensorwire_core::backend::{BackendHost, RegionInfo};
use tensorwire_core::{Error, RegionId, Result};
use tokio::sync::oneshot;

use crate::UcxConfig;
use crate::conns::{InConn, OpState, OutConn};
use crate::exit::InUcx;
use crate::ffi::{self, Event, MemHandle, Worker};
use crate::mapped::Mapped;
use crate::tokens::{Graveyard, INBOUND, Submitted, Token, Tokens};
use crate::wire::Msg;

/// Bound on starting UCX (context, worker, address).
const STARTUP: Duration = Duration::from_secs(30);
/// Commands queued to the thread before it blocks the sender.
const QUEUE: usize = 1024;
/// Longest sleep while requests or answers are outstanding.
const BUSY_TICK: Duration = Duration::from_millis(50);
/// Longest sleep when idle (deadline checks only).
const IDLE_TICK: Duration = Duration::from_secs(1);
/// How long the thread keeps polling after UCX last did work while bytes are moving.
const SPIN: Duration = Duration::from_millis(2);
/// How long the thread keeps polling after its last work or command before it sleeps: a caller
/// that issues ops one after another finds it awake (a wake-up through `poll(2)` costs tens of
/// microseconds on a virtual machine), and an idle backend still sleeps.
const LINGER: Duration = Duration::from_micros(50);
/// Completions of ended ops are resolved in groups of up to this many, the rest at the end of the
/// thread's turn (see `Progress::deliver`).
pub(crate) const WAKE_BATCH: usize = 4;
/// Most `ucp_worker_progress` calls in a row before the thread looks at its deadlines.
const PROGRESS_ROUNDS: usize = 64;
/// What the backend and its connections ask of the thread.
#[derive(Debug)]
pub(crate) enum Cmd {
    Start(Arc<dyn BackendHost>),
    Register {
        info: RegionInfo,
        reply: oneshot::Sender<Result<Option<Bytes>>>,
    },
    Deregister(RegionId),
    /// Allocate memory through UCX; the reply is its address.
    Allocate {
        len: u64,
        reply: oneshot::Sender<Result<usize>>,
    },
    /// Free memory from `Allocate` (once no region uses it).
    Free {
        addr: usize,
    },
    Connect {
        address: Bytes,
        reply: oneshot::Sender<Result<u64>>,
    },
    Submit {
        conn: u64,
        ops: Vec<Submitted>,
    },
    Notify {
        conn: u64,
        msg: Bytes,
        reply: oneshot::Sender<Result<()>>,
    },
    /// Fail a connection now (force-closing its endpoint cancels its requests).
    Kill {
        conn: u64,
        error: Error,
    },
    /// The connection's handle was dropped.
    Close {
        conn: u64,
    },
    Shutdown {
        reply: Option<oneshot::Sender<()>>,
    },
}

/// The other threads' side: queue a command, wake the thread.
#[derive(Debug)]
pub(crate) struct Handle {
    tx: SyncSender<Cmd>,
    /// Shared with the thread, which keeps its own reference: the descriptor stays open until
    /// both are done with it (a closed number could be reused by another thread's socket).
    wake: Arc<OwnedFd>,
    closed: AtomicBool,
    /// The leases callers copy into themselves.
    pub(crate) mapped: Arc<Mapped>,
}

impl Handle {
    /// Queues `cmd`; gives it back when the thread is gone.
    pub(crate) fn send(&self, cmd: Cmd) -> std::result::Result<(), Cmd> {
        let r = match self.tx.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(cmd)) => {
                self.poke();
                self.tx.send(cmd).map_err(|e| e.0)
            }
            Err(TrySendError::Disconnected(cmd)) => Err(cmd),
        };
        if r.is_ok() {
            self.poke();
        }
        r
    }

    fn poke(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd; a full counter (EAGAIN) is
        // fine, the thread is awake anyway.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Whether shutdown began.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub(crate) fn mark_closed(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

fn eventfd() -> Result<OwnedFd> {
    // SAFETY: eventfd has no memory preconditions; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Starts the thread; returns its handle and the worker's address.
pub(crate) fn start(cfg: UcxConfig) -> Result<(Arc<Handle>, Vec<u8>)> {
    let wake = Arc::new(eventfd()?);
    let thread_wake = wake.clone();
    let (tx, rx) = sync_channel(QUEUE);
    let (ready_tx, ready_rx) = sync_channel(1);
    let mapped = Arc::new(Mapped::default());
    let thread_mapped = mapped.clone();
    // Detached: it ends after Shutdown (or when every handle is gone) and owns all it uses.
    let _thread = std::thread::Builder::new().name("tensorwire-ucx".into()).spawn(move || {
        // Held for every UCX call, from ucp_init to the context's destruction (see `exit`).
        let mut inside = crate::exit::enter();
        let p = match Progress::new(cfg, thread_mapped) {
            Ok(p) => p,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        let _ = ready_tx.send(Ok(p.address.clone()));
        let replies = p.run(rx, thread_wake.as_raw_fd(), &mut inside);
        drop(inside);
        // Only now is UCX torn down: a shutdown's caller may exit the process at once.
        for r in replies {
            let _ = r.send(());
        }
        drop(thread_wake);
    })?;
    let address = match ready_rx.recv_timeout(STARTUP) {
        Ok(r) => r?,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            return Err(Error::timeout("ucx: starting UCX (ucp_init, worker)", STARTUP));
        }
        Err(_) => return Err(Error::protocol("ucx: the progress thread ended during startup")),
    };
    let handle = Handle { tx, wake, closed: AtomicBool::new(false), mapped };
    Ok((Arc::new(handle), address))
}

/// The thread's state.
#[derive(Debug)]
pub(crate) struct Progress {
    pub(crate) cfg: UcxConfig,
    pub(crate) worker: Rc<Worker>,
    /// The worker's address, sent in every Hello.
    pub(crate) address: Vec<u8>,
    pub(crate) host: Option<Arc<dyn BackendHost>>,
    /// Leases whose region is mapped here, which callers copy into themselves (see `mapped`).
    pub(crate) mapped: Arc<Mapped>,
    /// Local registrations; ops and holds keep their own `Rc`, so unmapping waits for them.
    pub(crate) regions: HashMap<RegionId, Rc<MemHandle>>,
    /// Their lengths (a lease covers the whole region).
    pub(crate) lengths: HashMap<RegionId, u64>,
    pub(crate) out: HashMap<u64, OutConn>,
    pub(crate) inb: HashMap<u64, InConn>,
    pub(crate) ops: HashMap<u64, OpState>,
    pub(crate) tokens: Tokens,
    pub(crate) next_op: u64,
    /// Memory allocated through UCX, by address: (length, handle).
    pub(crate) allocations: HashMap<usize, (usize, Rc<MemHandle>)>,
    /// What abandoned requests may still touch (see `abandon`), kept until the worker is gone.
    pub(crate) graveyard: Graveyard,
    /// Ops with segments to start, by bytes left (see `pump`).
    pub(crate) runnable: std::collections::BTreeSet<(u64, u64)>,
    /// Completions of ops that ended during this turn of the thread and are not resolved yet
    /// (see `deliver`).
    pub(crate) ended: Vec<(oneshot::Sender<Result<()>>, Result<()>)>,
    /// Set by Shutdown: the deadline for peers to release what they hold.
    pub(crate) stopping: Option<Instant>,
    stop_replies: Vec<oneshot::Sender<()>>,
    last_scan: Instant,
}

impl Progress {
    fn new(cfg: UcxConfig, mapped: Arc<Mapped>) -> Result<Progress> {
        let ctx = ffi::Context::new(&cfg.options)?;
        let worker = Worker::new(&ctx)?;
        let address = worker.address()?;
        Ok(Progress {
            cfg,
            worker,
            address,
            host: None,
            mapped,
            regions: HashMap::new(),
            lengths: HashMap::new(),
            out: HashMap::new(),
            inb: HashMap::new(),
            ops: HashMap::new(),
            tokens: Tokens::default(),
            next_op: 0,
            runnable: Default::default(),
            ended: Vec::new(),
            graveyard: Graveyard::default(),
            allocations: HashMap::new(),
            stopping: None,
            stop_replies: Vec::new(),
            last_scan: Instant::now(),
        })
    }

    /// Runs until shut down; returns the shutdown requests to answer once UCX is torn down.
    fn run(
        mut self,
        rx: Receiver<Cmd>,
        wake: RawFd,
        inside: &mut InUcx,
    ) -> Vec<oneshot::Sender<()>> {
        let efd = match self.worker.event_fd() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(error = %e, "ucx: no worker event fd; polling every {BUSY_TICK:?}");
                None
            }
        };
        let mut senders_gone = false;
        let mut active = Instant::now();
        loop {
            if crate::exit::closing() {
                // The process is exiting: leave UCX (this parks the thread for good).
                inside.outside(|| ());
            }
            let mut handled = false;
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        handled = true;
                        self.command(cmd);
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        senders_gone = true;
                        break;
                    }
                }
            }
            if senders_gone && self.stopping.is_none() {
                self.begin_shutdown();
            }
            // Bounded: a transport that keeps reporting work must not starve deadlines and commands.
            for _ in 0..PROGRESS_ROUNDS {
                if self.worker.progress() == 0 {
                    break;
                }
                handled = true;
            }
            handled |= self.drain_callbacks();
            self.run_turns();
            self.check_deadlines();
            if self.stopping.is_some() && self.shutdown_done() {
                break;
            }
            handled |= self.drain_callbacks();
            self.deliver();
            if handled {
                active = Instant::now();
            }
            if handled || !self.runnable.is_empty() {
                continue;
            }
            // While bytes move (our ops, or a peer's inside a range it holds here) and UCX did
            // work recently, keep polling: some transports need this side's progress to move a
            // peer's data (UCX's software put/get over shared-memory messages), and a sleep per
            // message would throttle them. Quiet for SPIN, or nothing in flight: sleep.
            let moving = self.ops.values().any(OpState::moving)
                || self.inb.values().any(|c| !c.holds.is_empty());
            if (moving && active.elapsed() < SPIN) || active.elapsed() < LINGER {
                std::thread::yield_now();
                continue;
            }
            let busy = !self.ops.is_empty()
                || !self.tokens.is_empty()
                || self.out.values().any(OutConn::waiting);
            let tick = if busy || self.stopping.is_some() { BUSY_TICK } else { IDLE_TICK };
            let armed = match efd {
                Some(_) => match self.worker.arm() {
                    Ok(armed) => armed,
                    Err(e) => {
                        tracing::warn!(error = %e, "ucx: ucp_worker_arm");
                        true
                    }
                },
                None => true,
            };
            if armed {
                let tick = if efd.is_some() { tick } else { tick.min(Duration::from_millis(1)) };
                inside.outside(|| sleep(efd, wake, tick));
            }
        }
        self.finish_shutdown()
    }

    /// Resolves the completions of ended ops not resolved yet: when [`WAKE_BATCH`] have gathered,
    /// and at the end of every turn, rather than each between two copies. A completion wakes
    /// the runtime (an `eventfd` write and a thread switch when its workers sleep), and where
    /// copies run inline (UCX's shared-memory transports copy inside the call) one op after
    /// another ends on this thread, so a wake per op sat between every two copies (16 ops of
    /// 1 MiB per submit moved 0.43-0.51 of `ucx_perftest`; grouped by four, 0.60-0.70). Groups
    /// rather than one wake per turn keep the runtime's handling of the first completions
    /// overlapped with the later copies (one wake per turn: 64 KiB fell from 0.34 to
    /// 0.25-0.30). An op's completion waits until three more ops end or its turn does (every
    /// runnable op gets one segment per turn), never longer.
    pub(crate) fn deliver(&mut self) {
        for (done, r) in self.ended.drain(..) {
            let _ = done.send(r);
        }
    }

    /// Handles what the callbacks collected; whether there was anything.
    pub(crate) fn drain_callbacks(&mut self) -> bool {
        let mut any = false;
        loop {
            let (events, msgs) = ffi::take_callbacks();
            if events.is_empty() && msgs.is_empty() {
                return any;
            }
            any = true;
            for e in events {
                self.event(e);
            }
            for m in msgs {
                self.message(&m);
            }
        }
    }

    fn event(&mut self, e: Event) {
        match e {
            Event::Done(token, status) => match self.tokens.take(token) {
                Some(Token::Rma(op)) => self.rma_done(op, status),
                Some(Token::Flush(op)) => self.flush_done(op, status),
                Some(Token::Send { conn, .. }) if status != tensorwire_ucx_sys::UCS_OK => {
                    self.fail_conn(conn, ffi::status_error("sending a control message", status))
                }
                Some(Token::Send { .. }) | None => {}
            },
            Event::EpFailed(token, status) => {
                self.fail_conn(token, ffi::status_error("endpoint failed", status))
            }
        }
    }

    /// Fails the connection an endpoint token names: ours (outbound) or a peer's (inbound).
    fn fail_conn(&mut self, token: u64, err: Error) {
        if token & INBOUND == 0 {
            self.kill(token, err);
        } else {
            self.drop_inbound(token & !INBOUND, &err);
        }
    }

    fn message(&mut self, bytes: &[u8]) {
        let msg = match Msg::decode(bytes) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "ucx: dropped a malformed control message");
                return;
            }
        };
        use crate::wire::Kind;
        match msg.kind {
            Kind::Hello => self.hello(&msg),
            Kind::Begin => self.begin(&msg),
            Kind::End => self.end(&msg),
            Kind::Notify => self.notified(&msg),
            Kind::Bye if msg.flags & crate::wire::TARGET == 0 => {
                self.drop_inbound(msg.conn, &Error::PeerClosed("the initiator left".into()))
            }
            Kind::HelloAck => self.hello_ack(&msg),
            Kind::Granted => self.granted(&msg),
            Kind::NotifyAck => self.notify_ack(&msg),
            Kind::Bye => self.kill(msg.conn, Error::PeerClosed("ucx: the peer shut down".into())),
            Kind::Forget => self.forgotten(&msg),
            Kind::Released => self.released(&msg),
        }
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Start(host) => self.host = Some(host),
            Cmd::Register { info, reply } => {
                let _ = reply.send(self.register(&info));
            }
            Cmd::Deregister(id) => {
                self.regions.remove(&id);
                self.lengths.remove(&id);
                self.forget(id);
            }
            Cmd::Allocate { len, reply } => {
                let r = usize::try_from(len)
                    .map_err(|_| Error::InvalidArgument(format!("allocation of {len} bytes")))
                    .and_then(|n| self.worker.allocate(n).map(|(m, addr)| (m, addr, n)));
                let _ = reply.send(r.map(|(m, addr, n)| {
                    self.allocations.insert(addr, (n, Rc::new(m)));
                    addr
                }));
            }
            Cmd::Free { addr } => {
                // Regions still registered on it keep the handle (and the memory) alive.
                self.allocations.remove(&addr);
            }
            Cmd::Connect { address, reply } => self.connect(&address, reply),
            Cmd::Submit { conn, ops } => self.submit(conn, ops),
            Cmd::Notify { conn, msg, reply } => self.notify(conn, &msg, reply),
            Cmd::Kill { conn, error } => self.kill(conn, error),
            Cmd::Close { conn } => self.close(conn),
            Cmd::Shutdown { reply } => {
                self.stop_replies.extend(reply);
                if self.stopping.is_none() {
                    self.begin_shutdown();
                }
            }
        }
    }

    fn register(&mut self, info: &RegionInfo) -> Result<Option<Bytes>> {
        if self.stopping.is_some() {
            return Err(Error::PeerClosed("local ucx backend shut down".into()));
        }
        if !info.kind.is_host() {
            return Ok(None); // the capabilities say host memory only
        }
        if info.len == 0 {
            return Ok(Some(Bytes::new()));
        }
        let addr = info.base() as usize;
        let len = usize::try_from(info.len)
            .map_err(|_| Error::InvalidArgument(format!("region of {} bytes", info.len)))?;
        // Memory this backend allocated: its own handle (and remote key) reaches it with one copy.
        let own = self.allocations.iter().find_map(|(&base, (n, m))| {
            let end = base.checked_add(*n)?;
            (addr >= base && addr.checked_add(len)? <= end).then(|| m.clone())
        });
        let memh = match own {
            Some(m) => m,
            None => Rc::new(self.worker.map(addr, len, info.perms.read, info.perms.write)?),
        };
        // Peers get a key only for memory they may touch; private regions stay local.
        let blob = if info.perms.read || info.perms.write { memh.pack()? } else { Vec::new() };
        if blob.len() > MAX_BLOB_BYTES {
            return Err(Error::Capacity {
                what: "ucx packed remote key".into(),
                requested: blob.len() as u64,
                limit: MAX_BLOB_BYTES as u64,
            });
        }
        self.regions.insert(info.id, memh);
        self.lengths.insert(info.id, info.len);
        Ok(Some(Bytes::from(blob)))
    }

    fn begin_shutdown(&mut self) {
        self.stopping = Some(Instant::now() + self.cfg.answer_timeout);
        let conns: Vec<u64> = self.out.keys().copied().collect();
        for c in conns {
            self.say_bye(c);
            self.kill(c, Error::PeerClosed("local ucx backend shut down".into()));
        }
        // A peer holding leases is asked for them back first (Forget) and told Bye once it gave
        // them all back (see `released`): it may copy into leased regions without asking (see
        // `mapped`), and must have stopped before this shutdown returns.
        let unleased: Vec<u64> =
            self.inb.iter().filter(|(_, c)| c.leases.is_empty()).map(|(&id, _)| id).collect();
        for id in unleased {
            self.say_bye_as_target(id);
        }
        let leased: std::collections::BTreeSet<RegionId> =
            self.inb.values().flat_map(|c| c.leases.keys().map(|(r, _)| *r)).collect();
        for region in leased {
            self.forget(region); // each peer leasing it, once
        }
    }

    /// Tells a peer connected to this backend that it shuts down (best effort).
    pub(crate) fn say_bye_as_target(&mut self, id: u64) {
        let bye = Msg { flags: crate::wire::TARGET, ..Msg::new(crate::wire::Kind::Bye, id, 0) };
        if let Some(c) = self.inb.get(&id) {
            let _ = self.tokens.send(&c.ep, id | INBOUND, &bye);
        }
    }

    /// Shutdown waits (bounded) for peers to release the regions they hold, and for its own ops.
    fn shutdown_done(&self) -> bool {
        let held = self.inb.values().any(|c| !c.holds.is_empty() || !c.leases.is_empty());
        let past = self.stopping.is_some_and(|d| Instant::now() >= d);
        past || (!held && self.ops.is_empty())
    }

    /// Fails what is left and tears UCX down; returns the shutdown requests to answer.
    fn finish_shutdown(mut self) -> Vec<oneshot::Sender<()>> {
        self.deliver();
        for (_, op) in self.ops.drain() {
            let e = Error::PeerClosed("local ucx backend shut down".into());
            op.fail_now(e, &mut self.graveyard);
        }
        for (_, c) in self.inb.drain() {
            for hold in c.holds.into_values().chain(c.leases.into_values()) {
                hold.bury(&mut self.graveyard);
            }
        }
        self.mapped.clear();
        self.out.clear();
        self.regions.clear();
        self.lengths.clear();
        // Memory handed out by `Allocate` and not yet freed may still be in use by its owner:
        // leak it (and so the UCX context) rather than unmap it under them.
        for (_, (_, m)) in self.allocations.drain() {
            std::mem::forget(m);
        }
        let replies = std::mem::take(&mut self.stop_replies);
        let mut graveyard = std::mem::take(&mut self.graveyard);
        graveyard.drop_rkeys();
        // Worker and context go last of the UCX objects (endpoints and handles hold Rcs to them);
        // the memory abandoned requests might touch only after them.
        drop(self);
        drop(graveyard);
        replies
    }

    fn check_deadlines(&mut self) {
        let now = Instant::now();
        let bound = self.cfg.answer_timeout;
        let mut dead = Vec::new();
        for (id, c) in &mut self.out {
            if c.overdue(now) {
                dead.push(*id);
            }
        }
        if now.duration_since(self.last_scan) >= BUSY_TICK {
            self.last_scan = now;
            for op in self.ops.values() {
                if op.stalled(now, bound) {
                    dead.push(op.conn);
                }
            }
        }
        dead.sort_unstable();
        dead.dedup();
        for id in dead {
            self.kill(id, Error::timeout("ucx: the peer did not answer", bound));
        }
    }
}

/// Sleeps until the worker or the wake eventfd is readable, or `tick` passes; clears the eventfd.
fn sleep(efd: Option<RawFd>, wake: RawFd, tick: Duration) {
    let mut fds = [
        libc::pollfd { fd: wake, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: efd.unwrap_or(-1), events: libc::POLLIN, revents: 0 },
    ];
    let ms = tick.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `fds` is a live array of two pollfd entries (a negative fd is ignored by poll).
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if fds[0].revents & libc::POLLIN != 0 {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer from our nonblocking eventfd.
        unsafe { libc::read(wake, buf.as_mut_ptr().cast(), buf.len()) };
    }
}
