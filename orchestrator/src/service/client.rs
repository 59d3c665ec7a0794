//! Clients of the orchestrator service: a stage worker (receives assignments, reports results,
//! sends heartbeats on its own) and a submitter (sends requests, awaits outcomes).
//!
//! Both outlive a restart of the service (or a broken connection): when the connection breaks,
//! the client reconnects with backoff for up to [`RECONNECT_FOR`] and catches up before
//! anything else goes out. A worker says which items it still holds (running, or finished with
//! a result not yet acknowledged), announces again what it announced, and resends its
//! unacknowledged results; a submitter asks again for every request it waits for. Only when
//! reconnecting fails for that long (or the service refuses the client) does the worker's
//! assignment stream end, or the submitter's waits fail with [`OrchestratorError::Stopped`].

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::sched::ItemKey;
use crate::timeline::Timeline;
use crate::{Priority, Stage};
use parking_lot::Mutex;
use tensorwire_core::ClusterSecret;
use tensorwire_core::Error;
use tensorwire_proto::handshake::Handshake;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use super::wire::{Ending, FRAMING, MAX_DATA, Msg, Role, read_msg};
use crate::error::{OrchestratorError, Result};

/// Bound on connecting and the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client keeps trying to reconnect after its connection breaks.
pub const RECONNECT_FOR: Duration = Duration::from_secs(60);
/// First and longest pause between reconnection tries.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(2));

/// Connects, runs the authenticated handshake, says what this client is and reads its welcome.
async fn open(
    addr: SocketAddr,
    secret: Option<&ClusterSecret>,
    role: Role,
) -> Result<(OwnedReadHalf, OwnedWriteHalf, u64)> {
    let opened = async {
        let mut sock = TcpStream::connect(addr)
            .await
            .map_err(|e| Error::PeerClosed(format!("orchestrator at {addr}: {e}")))?;
        sock.set_nodelay(true)?;
        Handshake { framing: &FRAMING, secret, peer: addr }.client(&mut sock).await?;
        sock.write_all(&Msg::Hello { role }.encode()?).await?;
        match read_msg(&mut sock).await? {
            Some(Msg::Welcome { worker }) => {
                let (rd, wr) = sock.into_split();
                Ok((rd, wr, worker))
            }
            _ => Err(Error::protocol("orchestrator: expected Welcome")),
        }
    };
    let r: std::result::Result<_, Error> =
        tokio::time::timeout(HANDSHAKE_TIMEOUT, opened).await.map_err(|_| {
            Error::timeout(format!("orchestrator handshake with {addr}"), HANDSHAKE_TIMEOUT)
        })?;
    r.map_err(|e| match e {
        Error::AccessDenied(m) => OrchestratorError::Refused(m),
        e => e.into(),
    })
}

/// Asked for the service's address before every connection (e.g. the current leader of a
/// standby group, from discovery); `None`: none known now.
pub type Resolver = Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<SocketAddr>> + Send>>
        + Send
        + Sync,
>;

/// How a client finds the service.
#[derive(Clone)]
pub enum Target {
    /// Always this address.
    Addr(SocketAddr),
    /// Whatever the resolver says at each (re)connection.
    Resolve(Resolver),
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Addr(a) => write!(f, "{a}"),
            Target::Resolve(_) => f.write_str("(resolved at each connection)"),
        }
    }
}

impl From<SocketAddr> for Target {
    fn from(a: SocketAddr) -> Target {
        Target::Addr(a)
    }
}

impl Target {
    async fn addr(&self) -> Result<SocketAddr> {
        match self {
            Target::Addr(a) => Ok(*a),
            Target::Resolve(r) => r().await.ok_or_else(|| {
                OrchestratorError::from(Error::PeerClosed("no orchestrator is known now".into()))
            }),
        }
    }

    /// Resolves, then connects.
    async fn open(
        &self,
        secret: Option<&ClusterSecret>,
        role: Role,
    ) -> Result<(OwnedReadHalf, OwnedWriteHalf, u64)> {
        open(self.addr().await?, secret, role).await
    }
}

/// Where a client connects, as what.
#[derive(Debug, Clone)]
struct Link {
    target: Target,
    secret: Option<ClusterSecret>,
    role: Role,
}

impl Link {
    /// Opens a new connection, with backoff, for up to [`RECONNECT_FOR`]; `None` when that
    /// fails or the service refuses this client.
    async fn reopen(&self) -> Option<(OwnedReadHalf, OwnedWriteHalf, u64)> {
        let deadline = tokio::time::Instant::now() + RECONNECT_FOR;
        let mut pause = BACKOFF.0;
        loop {
            match self.target.open(self.secret.as_ref(), self.role.clone()).await {
                Ok(c) => return Some(c),
                Err(OrchestratorError::Refused(why)) => {
                    tracing::warn!(target = ?self.target, "orchestrator refused a reconnect: {why}");
                    return None;
                }
                Err(e) if tokio::time::Instant::now() + pause >= deadline => {
                    tracing::warn!(target = ?self.target, error = %e, "orchestrator: giving up");
                    return None;
                }
                Err(_) => {}
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(BACKOFF.1);
        }
    }
}

/// Writes `rx`'s messages to `wr` until `stop` fires or a write fails (false), or `rx` closes
/// (true); gives `rx` back.
async fn write_until(
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::Receiver<Msg>,
    mut stop: oneshot::Receiver<()>,
) -> (mpsc::Receiver<Msg>, bool) {
    loop {
        let m = tokio::select! {
            m = rx.recv() => m,
            _ = &mut stop => return (rx, false),
        };
        let Some(m) = m else {
            let _ = wr.shutdown().await;
            return (rx, true);
        };
        let Ok(frame) = m.encode() else { continue };
        if wr.write_all(&frame).await.is_err() {
            return (rx, false);
        }
    }
}

/// A client's connection for as long as its user keeps it: writes what comes on `out`, passes
/// what arrives to `inbox`, and after a break reconnects ([`Link::reopen`]) and writes
/// `catch_up(new id)` before anything else. What was queued on `out` meanwhile is dropped (the
/// catch-up covers it) but for the messages `keep` names. Ends when `out` closes, or
/// reconnecting fails (`inbox` then closes).
async fn session(
    link: Link,
    first: (OwnedReadHalf, OwnedWriteHalf),
    mut out: mpsc::Receiver<Msg>,
    inbox: mpsc::Sender<Msg>,
    catch_up: impl Fn(u64) -> Vec<Msg>,
    keep: fn(&Msg) -> bool,
) {
    let (mut rd, mut wr) = first;
    loop {
        let (stop, stopped) = oneshot::channel();
        let mut writer = tokio::spawn(write_until(wr, out, stopped));
        let to = inbox.clone();
        let mut reader = tokio::spawn(async move {
            while let Ok(Some(m)) = read_msg(&mut rd).await {
                if to.send(m).await.is_err() {
                    break;
                }
            }
        });
        let ended = tokio::select! {
            w = &mut writer => {
                reader.abort();
                w
            }
            _ = &mut reader => {
                let _ = stop.send(());
                writer.await
            }
        };
        let Ok((rx, closed)) = ended else { return };
        out = rx;
        if closed {
            return;
        }
        // Broken: reconnect, and catch up before anything queued meanwhile.
        loop {
            let Some((r, mut w, id)) = link.reopen().await else { return };
            // Drained before the catch-up is taken: whatever is queued after it is sent after
            // it, and is either covered by it or new.
            let mut kept = Vec::new();
            while let Ok(m) = out.try_recv() {
                if keep(&m) {
                    kept.push(m);
                }
            }
            let mut msgs = catch_up(id);
            msgs.extend(kept);
            let frames: Option<Vec<Vec<u8>>> = msgs.iter().map(|m| m.encode().ok()).collect();
            let mut sent = true;
            for f in frames.unwrap_or_default() {
                if w.write_all(&f).await.is_err() {
                    sent = false;
                    break;
                }
            }
            if sent {
                tracing::info!(target = ?link.target, id, "orchestrator: reconnected");
                (rd, wr) = (r, w);
                break;
            }
        }
    }
}

/// An item the orchestrator assigned to this worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// Request.
    pub request: u64,
    /// Stage.
    pub stage: Stage,
    /// The request's class (interactive for a release).
    pub priority: Priority,
    /// Try number.
    pub attempt: u32,
    /// What the previous stage reported (empty for encode).
    pub inputs: Vec<u8>,
    /// The item's last checkpoint, from a worker that ran it before (see
    /// [`WorkerClient::checkpoint`]): resume from this step with this saved state.
    pub resume: Option<(u32, Vec<u8>)>,
    /// With `release_only`: every output the request's stages reported.
    pub held: Vec<Vec<u8>>,
    /// Nothing to run: the request ended (completed or failed) and nothing will consume `held`.
    /// The worker releases them, then says so with [`WorkerClient::released`] (until then the
    /// orchestrator keeps them, and gives them to another worker should this one leave).
    pub release_only: bool,
}

impl Assignment {
    /// A `tracing` span for running this item: `stage` with the request id, the stage and the
    /// try as fields. The orchestrator's span of the request (`request`, with the same id) holds
    /// the events the service saw; a collector (e.g. a `tracing-opentelemetry` layer) joins
    /// the two on the request id.
    pub fn span(&self) -> tracing::Span {
        tracing::info_span!(
            "stage",
            request = self.request,
            stage = self.stage.name(),
            attempt = self.attempt
        )
    }
}

/// What a worker has not been told it may forget about one item.
#[derive(Debug, Default)]
struct Held {
    attempt: u32,
    announced: Vec<Vec<u8>>,
    checkpoint: Option<Msg>,
    /// Its result, or its yield, until acknowledged.
    result: Option<Msg>,
    /// The service asked for it back.
    yield_asked: bool,
}

/// A worker's state that outlives its connections.
#[derive(Debug)]
struct WorkerState {
    id: AtomicU64,
    /// Items assigned and not yet acknowledged.
    held: Mutex<BTreeMap<ItemKey, Held>>,
    /// It asked to be drained...
    draining: std::sync::atomic::AtomicBool,
    /// ...and the service said it is.
    drained: tokio::sync::watch::Sender<bool>,
    /// The stage the service told it to serve instead (elastic pools).
    switch_to: tokio::sync::watch::Sender<Option<Stage>>,
}

impl Default for WorkerState {
    fn default() -> Self {
        WorkerState {
            id: AtomicU64::new(0),
            held: Mutex::default(),
            draining: false.into(),
            drained: tokio::sync::watch::Sender::new(false),
            switch_to: tokio::sync::watch::Sender::new(None),
        }
    }
}

impl WorkerState {
    /// What a reconnected worker says first.
    fn catch_up(&self, id: u64) -> Vec<Msg> {
        self.id.store(id, Ordering::Relaxed);
        let mut v = Vec::new();
        for (k, h) in self.held.lock().iter() {
            let (request, stage) = (k.request, k.stage);
            v.push(Msg::Holding { request, stage, attempt: h.attempt });
            for data in &h.announced {
                v.push(Msg::Announce { request, stage, data: data.clone() });
            }
            v.extend(h.checkpoint.clone());
            v.extend(h.result.clone());
        }
        if self.draining.load(Ordering::Relaxed) {
            v.push(Msg::Drain);
        }
        v
    }
}

/// What a worker says of itself when it joins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// The stage it serves.
    pub stage: Stage,
    /// Concurrent items it takes.
    pub slots: u32,
    /// Its host.
    pub host: String,
    /// Labels (rail / NUMA; `metrics=HOST:PORT`).
    pub labels: Vec<String>,
    /// The other stages it can serve, each with the time to switch to it (elastic pools; empty:
    /// it stays where it is). A worker that says so must follow switch orders
    /// ([`WorkerClient::switch_order`]): the service drains it when it sends one, so one that
    /// ignores the order gets no more work.
    pub can: Vec<(Stage, Duration)>,
    /// It joins after a switch that took this long.
    pub switched: Option<Duration>,
}

impl WorkerSpec {
    /// A worker of `stage` with `slots` on `host`, no labels, serving nothing else.
    pub fn new(stage: Stage, slots: u32, host: &str) -> WorkerSpec {
        WorkerSpec {
            stage,
            slots,
            host: host.into(),
            labels: Vec::new(),
            can: Vec::new(),
            switched: None,
        }
    }
}

/// A stage worker connected to the service.
#[derive(Debug)]
pub struct WorkerClient {
    state: Arc<WorkerState>,
    out: mpsc::Sender<Msg>,
    /// Connection, reader and heartbeat tasks (aborted when the client drops).
    _tasks: JoinSet<()>,
}

impl WorkerClient {
    /// Joins as a worker of `stage` with `slots`; heartbeats go out every `heartbeat`.
    /// Assignments arrive on the returned receiver (closed when the service is gone for good:
    /// see the module documentation). The first connection is not retried: an error here says
    /// why it failed.
    pub async fn connect(
        addr: SocketAddr,
        secret: Option<&ClusterSecret>,
        stage: Stage,
        slots: u32,
        host: &str,
        heartbeat: Duration,
    ) -> Result<(WorkerClient, mpsc::Receiver<Assignment>)> {
        Self::connect_to(addr.into(), secret, stage, slots, (host, &[]), heartbeat).await
    }

    /// [`WorkerClient::connect`] to wherever `target` says, asked again at every reconnection
    /// (e.g. the leader of a standby group), with the worker's labels (routing policies read
    /// them; `metrics=HOST:PORT` says where its metrics endpoint is: see
    /// [`super::METRICS_LABEL`]).
    pub async fn connect_to(
        target: Target,
        secret: Option<&ClusterSecret>,
        stage: Stage,
        slots: u32,
        (host, labels): (&str, &[String]),
        heartbeat: Duration,
    ) -> Result<(WorkerClient, mpsc::Receiver<Assignment>)> {
        let spec = WorkerSpec { labels: labels.to_vec(), ..WorkerSpec::new(stage, slots, host) };
        Self::join(target, secret, spec, heartbeat).await
    }

    /// [`WorkerClient::connect_to`] with everything a worker can say of itself: for elastic
    /// pools, the other stages it can serve and what switching costs (the service may then
    /// send it a switch order: [`WorkerClient::switch_order`]), and, joining after a switch,
    /// how long the switch took.
    pub async fn join(
        target: Target,
        secret: Option<&ClusterSecret>,
        spec: WorkerSpec,
        heartbeat: Duration,
    ) -> Result<(WorkerClient, mpsc::Receiver<Assignment>)> {
        let WorkerSpec { stage, slots, host, labels, can, switched } = spec;
        let role = Role::Worker { stage, slots, host, labels, can, switched };
        let (rd, wr, id) = target.open(secret, role.clone()).await?;
        let state = Arc::new(WorkerState { id: AtomicU64::new(id), ..WorkerState::default() });
        let (out, out_rx) = mpsc::channel::<Msg>(1024);
        let (inbox, mut arrived) = mpsc::channel::<Msg>(1024);
        let (tx, rx) = mpsc::channel(1024);
        let mut tasks = JoinSet::new();
        // A reconnection is no new switch.
        let mut role = role;
        if let Role::Worker { switched, .. } = &mut role {
            *switched = None;
        }
        let link = Link { target, secret: secret.cloned(), role };
        let st = state.clone();
        // Results and announcements are in the catch-up; a release report is not.
        let keep = |m: &Msg| matches!(m, Msg::Released { .. } | Msg::Credit { .. });
        tasks.spawn(session(link, (rd, wr), out_rx, inbox, move |id| st.catch_up(id), keep));
        let st = state.clone();
        tasks.spawn(async move {
            while let Some(m) = arrived.recv().await {
                let a = match m {
                    Msg::Assign {
                        request,
                        stage,
                        priority,
                        attempt,
                        data,
                        resume_step,
                        resume,
                    } => {
                        let held = Held { attempt, ..Held::default() };
                        st.held.lock().insert(ItemKey { request, stage }, held);
                        Assignment {
                            request,
                            stage,
                            priority,
                            attempt,
                            inputs: data,
                            resume: (!resume.is_empty()).then_some((resume_step, resume)),
                            held: Vec::new(),
                            release_only: false,
                        }
                    }
                    Msg::Release { request, held } => Assignment {
                        request,
                        stage,
                        priority: Priority::Interactive,
                        attempt: 0,
                        inputs: Vec::new(),
                        resume: None,
                        held,
                        release_only: true,
                    },
                    Msg::Ack { request, stage } => {
                        let mut h = st.held.lock();
                        let key = ItemKey { request, stage };
                        if h.get(&key).is_some_and(|h| h.result.is_some()) {
                            h.remove(&key);
                        }
                        continue;
                    }
                    Msg::Yield { request, stage } => {
                        if let Some(h) = st.held.lock().get_mut(&ItemKey { request, stage }) {
                            h.yield_asked = true;
                        }
                        continue;
                    }
                    Msg::Drained => {
                        st.drained.send_replace(true);
                        continue;
                    }
                    Msg::Switch { stage } => {
                        st.switch_to.send_replace(Some(stage));
                        continue;
                    }
                    _ => continue,
                };
                if tx.send(a).await.is_err() {
                    break;
                }
            }
        });
        let beat = out.clone();
        tasks.spawn(async move {
            let mut t = tokio::time::interval(heartbeat);
            loop {
                t.tick().await;
                if beat.send(Msg::Heartbeat).await.is_err() {
                    break;
                }
            }
        });
        Ok((WorkerClient { state, out, _tasks: tasks }, rx))
    }

    /// The stage the service told this worker to serve instead, if it did (elastic pools). The
    /// service is draining it meanwhile; see [`WorkerClient::switch_order`].
    pub fn switch_requested(&self) -> Option<Stage> {
        *self.state.switch_to.borrow()
    }

    /// Waits for the service to tell this worker to serve another stage (elastic pools). What
    /// follows is the worker's: [`WorkerClient::drain`] (its denoise jobs give their
    /// checkpoints back at their next step), load that stage, then join again with
    /// [`WorkerClient::join`], saying in [`WorkerSpec::switched`] how long the switch took.
    pub async fn switch_order(&self) -> Stage {
        let mut rx = self.state.switch_to.subscribe();
        loop {
            if let Some(s) = *rx.borrow_and_update() {
                return s;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// The id the service gave this worker (a new one after each reconnect).
    pub fn id(&self) -> u64 {
        self.state.id.load(Ordering::Relaxed)
    }

    /// Results and yields this worker sent that the service has not yet acknowledged (an ack
    /// comes once the service's journal holds them; unacknowledged ones are sent again after a
    /// reconnect).
    pub fn unacknowledged(&self) -> usize {
        self.state.held.lock().values().filter(|h| h.result.is_some()).count()
    }

    /// Reports the end of an assignment (an error re-queues it; its text is the reason).
    pub async fn report<E: std::fmt::Display>(
        &self,
        a: &Assignment,
        result: std::result::Result<(), E>,
    ) -> Result<()> {
        self.report_with(a, result.map(|()| Vec::new())).await
    }

    /// Reports the end of an assignment with outputs for the next stage (at most
    /// [`MAX_DATA`] bytes).
    pub async fn report_with<E: std::fmt::Display>(
        &self,
        a: &Assignment,
        result: std::result::Result<Vec<u8>, E>,
    ) -> Result<()> {
        match result {
            Ok(d) => self.send_result(a, Ending::Done, String::new(), d).await,
            Err(e) => self.send_result(a, Ending::Failed, e.to_string(), Vec::new()).await,
        }
    }

    /// Says, before they exist, what outputs this assignment will report (e.g. the reference of
    /// a store put about to start): the orchestrator releases them when the request ends even
    /// if this worker dies before its result, so a put that completes just before a crash is
    /// not left behind. At most [`MAX_DATA`] bytes.
    pub async fn announce(&self, a: &Assignment, data: Vec<u8>) -> Result<()> {
        if data.len() > MAX_DATA {
            return Err(OrchestratorError::InvalidArgument(format!(
                "announced outputs of {} bytes; at most {MAX_DATA}",
                data.len()
            )));
        }
        let key = ItemKey { request: a.request, stage: a.stage };
        if let Some(h) = self.state.held.lock().get_mut(&key) {
            h.announced.push(data.clone());
        }
        let m = Msg::Announce { request: a.request, stage: a.stage, data };
        self.out.send(m).await.map_err(|_| OrchestratorError::Stopped)
    }

    /// Says the item reached `step` with its state saved as `data` (e.g. the reference of a step
    /// checkpoint in the store; at most [`MAX_DATA`] bytes, not empty): should this worker die,
    /// the item's next try gets it as [`Assignment::resume`]. `data` is released with the
    /// request's outputs when the request ends. Returns once the message is queued; it goes out
    /// in the background (a worker killed right after may lose it, and the next try then
    /// resumes from the checkpoint before).
    pub async fn checkpoint(&self, a: &Assignment, step: u32, data: Vec<u8>) -> Result<()> {
        if data.is_empty() || data.len() > MAX_DATA {
            return Err(OrchestratorError::InvalidArgument(format!(
                "a checkpoint of {} bytes; 1 to {MAX_DATA}",
                data.len()
            )));
        }
        let m = Msg::Checkpoint { request: a.request, stage: a.stage, step, data };
        let key = ItemKey { request: a.request, stage: a.stage };
        if let Some(h) = self.state.held.lock().get_mut(&key) {
            h.checkpoint = Some(m.clone());
        }
        self.out.send(m).await.map_err(|_| OrchestratorError::Stopped)
    }

    /// Whether the service asked for this assignment back (an interactive job waits for the
    /// slot, or this worker is draining). A worker that can checkpoint polls this at its step
    /// boundaries and, when true, saves its state and calls [`WorkerClient::yield_job`]; one
    /// that cannot simply runs the job to its end.
    pub fn yield_requested(&self, a: &Assignment) -> bool {
        let key = ItemKey { request: a.request, stage: a.stage };
        self.state.held.lock().get(&key).is_some_and(|h| h.yield_asked && h.result.is_none())
    }

    /// Gives the assignment back at `step` with its state saved as `data` (as
    /// [`WorkerClient::checkpoint`]; empty: the last checkpoint stands). The job waits in the
    /// queue again and its next worker gets the checkpoint as [`Assignment::resume`]. Like a
    /// result, it is resent after a reconnect until the service has it. The worker must not
    /// report a result for it afterwards.
    pub async fn yield_job(&self, a: &Assignment, step: u32, data: Vec<u8>) -> Result<()> {
        if data.len() > MAX_DATA {
            return Err(OrchestratorError::InvalidArgument(format!(
                "a checkpoint of {} bytes; at most {MAX_DATA}",
                data.len()
            )));
        }
        self.send_held(a, Msg::Yielded { request: a.request, stage: a.stage, step, data }).await
    }

    /// Scale-down: asks the service to give this worker nothing new and to ask back each
    /// denoise job it runs (see [`WorkerClient::yield_requested`]; encode and decode items
    /// finish), and waits up to `timeout` until the service says it holds nothing. The worker
    /// keeps serving its assignments meanwhile; once this returns, it may stop.
    pub async fn drain(&self, timeout: Duration) -> Result<()> {
        self.state.draining.store(true, Ordering::Relaxed);
        let mut drained = self.state.drained.subscribe();
        self.out.send(Msg::Drain).await.map_err(|_| OrchestratorError::Stopped)?;
        match tokio::time::timeout(timeout, drained.wait_for(|d| *d)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(OrchestratorError::Stopped),
            Err(_) => Err(Error::timeout("draining this worker", timeout).into()),
        }
    }

    /// Says the outputs of a `release_only` assignment are released.
    pub async fn released(&self, a: &Assignment) -> Result<()> {
        let m = Msg::Released { request: a.request };
        self.out.send(m).await.map_err(|_| OrchestratorError::Stopped)
    }

    /// Reports that the assignment's input is gone (its p2p producer died, the stored payload
    /// vanished): the orchestrator runs the stage before again instead of retrying this one.
    pub async fn report_lost_input(&self, a: &Assignment, reason: &str) -> Result<()> {
        self.send_result(a, Ending::LostInput, reason.to_string(), Vec::new()).await
    }

    async fn send_result(
        &self,
        a: &Assignment,
        ending: Ending,
        reason: String,
        data: Vec<u8>,
    ) -> Result<()> {
        if data.len() > MAX_DATA {
            return Err(OrchestratorError::InvalidArgument(format!(
                "stage outputs of {} bytes; a result carries at most {MAX_DATA}",
                data.len()
            )));
        }
        self.send_held(a, Msg::Result { request: a.request, stage: a.stage, ending, reason, data })
            .await
    }

    /// Says how `a`'s input payloads arrived: `bytes` in all, the last in hand `took` after
    /// the consume started (the orchestrator keeps it in the request's timeline). Best effort:
    /// not resent after a reconnect.
    pub async fn handoff(&self, a: &Assignment, bytes: u64, took: Duration) -> Result<()> {
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let m = Msg::Handoff { request: a.request, stage: a.stage, bytes, micros };
        self.out.send(m).await.map_err(|_| OrchestratorError::Stopped)
    }

    /// Sends the end of `a` (a result or a yield), kept until the service says it has it:
    /// resent after a reconnect.
    async fn send_held(&self, a: &Assignment, m: Msg) -> Result<()> {
        let key = ItemKey { request: a.request, stage: a.stage };
        self.state
            .held
            .lock()
            .entry(key)
            .or_insert_with(|| Held { attempt: a.attempt, ..Held::default() })
            .result = Some(m.clone());
        self.out.send(m).await.map_err(|_| OrchestratorError::Stopped)
    }
}

/// How a request was submitted (sent again as a `Resume` after a reconnect), and who waits.
#[derive(Debug)]
struct Waiting {
    priority: Priority,
    start: Stage,
    data: Vec<u8>,
    resume: (u32, Vec<u8>),
    tx: oneshot::Sender<Result<()>>,
}

/// Per request waited for.
type Waiters = Arc<Mutex<HashMap<u64, Waiting>>>;

/// Per request, the callers waiting for its timeline.
type Asked = Arc<Mutex<HashMap<u64, Vec<oneshot::Sender<Option<Timeline>>>>>>;

/// A client that submits requests.
#[derive(Debug)]
pub struct SubmitClient {
    out: mpsc::Sender<Msg>,
    waiting: Waiters,
    asked: Asked,
    /// Connection and reader tasks (aborted when the client drops).
    _tasks: JoinSet<()>,
}

impl SubmitClient {
    /// Connects as a submitter (the first connection is not retried).
    pub async fn connect(addr: SocketAddr, secret: Option<&ClusterSecret>) -> Result<SubmitClient> {
        Self::connect_to(addr.into(), secret).await
    }

    /// [`SubmitClient::connect`] to wherever `target` says, asked again at every reconnection.
    pub async fn connect_to(
        target: Target,
        secret: Option<&ClusterSecret>,
    ) -> Result<SubmitClient> {
        let (rd, wr, _) = target.open(secret, Role::Submitter).await?;
        let (out, out_rx) = mpsc::channel::<Msg>(1024);
        let (inbox, mut arrived) = mpsc::channel::<Msg>(1024);
        let mut tasks = JoinSet::new();
        let waiting: Waiters = Arc::default();
        let link = Link { target, secret: secret.cloned(), role: Role::Submitter };
        let w = waiting.clone();
        let catch_up = move |_| {
            let mut v: Vec<Msg> = w
                .lock()
                .iter()
                .map(|(&request, w)| Msg::Resume {
                    request,
                    priority: w.priority,
                    start: w.start,
                    data: w.data.clone(),
                    resume_step: w.resume.0,
                    resume: w.resume.1.clone(),
                })
                .collect();
            v.sort_by_key(|m| match m {
                Msg::Resume { request, .. } => *request,
                _ => 0,
            });
            v
        };
        tasks.spawn(session(link, (rd, wr), out_rx, inbox, catch_up, |_| false));
        let w = waiting.clone();
        let asked: Asked = Arc::default();
        let a = asked.clone();
        tasks.spawn(async move {
            while let Some(m) = arrived.recv().await {
                if let Msg::TimelineIs { request, timeline } = m {
                    for tx in a.lock().remove(&request).unwrap_or_default() {
                        let _ = tx.send(timeline.clone());
                    }
                    continue;
                }
                let Msg::Outcome { request, ok, reason } = m else { continue };
                if let Some(Waiting { tx, .. }) = w.lock().remove(&request) {
                    let r = if ok {
                        Ok(())
                    } else {
                        Err(OrchestratorError::Failed { request, reason })
                    };
                    let _ = tx.send(r);
                }
            }
            for (_, Waiting { tx, .. }) in w.lock().drain() {
                let _ = tx.send(Err(OrchestratorError::Stopped));
            }
        });
        Ok(SubmitClient { out, waiting, asked, _tasks: tasks })
    }

    /// The timeline of `request` (in flight, or among the last ended ones the service keeps):
    /// `None` when the service does not know it. Fails after `timeout` without an answer (a
    /// reconnection loses the question).
    pub async fn timeline(&self, request: u64, timeout: Duration) -> Result<Option<Timeline>> {
        let (tx, rx) = oneshot::channel();
        self.asked.lock().entry(request).or_default().push(tx);
        let sent = self.out.send(Msg::AskTimeline { request }).await;
        if sent.is_err() {
            self.asked.lock().remove(&request);
            return Err(OrchestratorError::Stopped);
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(_)) => Err(OrchestratorError::Stopped),
            Err(_) => {
                self.asked.lock().remove(&request);
                Err(Error::timeout("orchestrator timeline", timeout).into())
            }
        }
    }

    /// Submits a request; the receiver yields its outcome.
    pub async fn submit(
        &self,
        request: u64,
        priority: Priority,
    ) -> Result<oneshot::Receiver<Result<()>>> {
        self.submit_from(request, priority, Stage::ALL[0], Vec::new()).await
    }

    /// Submits a request that starts at `start` with `inputs` as that stage's inputs (what
    /// the stage before would have reported; at most [`MAX_DATA`] bytes), e.g. a cached
    /// embedding's reference: the stages before never run, and the inputs are not released
    /// when the request ends.
    pub async fn submit_from(
        &self,
        request: u64,
        priority: Priority,
        start: Stage,
        inputs: Vec<u8>,
    ) -> Result<oneshot::Receiver<Result<()>>> {
        self.submit_resuming(request, priority, start, inputs, None).await
    }

    /// [`SubmitClient::submit_from`] whose start stage resumes from `checkpoint` (step, saved
    /// state; at most [`MAX_DATA`] bytes, not empty), e.g. a step checkpoint an earlier
    /// request made (edit and resume: the same trajectory from that step with changed
    /// parameters). The checkpoint is not the request's own and is not released when it ends.
    pub async fn submit_resuming(
        &self,
        request: u64,
        priority: Priority,
        start: Stage,
        inputs: Vec<u8>,
        checkpoint: Option<(u32, Vec<u8>)>,
    ) -> Result<oneshot::Receiver<Result<()>>> {
        let resume = checkpoint.unwrap_or_default();
        let bad = |what: &str, n: usize| {
            Err(OrchestratorError::InvalidArgument(format!(
                "{what} of {n} bytes; at most {MAX_DATA}"
            )))
        };
        if inputs.len() > MAX_DATA {
            return bad("start inputs", inputs.len());
        }
        if resume.1.len() > MAX_DATA {
            return bad("a checkpoint", resume.1.len());
        }
        let (tx, rx) = oneshot::channel();
        let (resume_step, data) = (resume.0, inputs.clone());
        let w = Waiting { priority, start, data, resume: resume.clone(), tx };
        self.waiting.lock().insert(request, w);
        let m = Msg::Submit {
            request,
            priority,
            deadline_ms: 0,
            start,
            data: inputs,
            resume_step,
            resume: resume.1,
        };
        self.out.send(m).await.map_err(|_| OrchestratorError::Stopped)?;
        Ok(rx)
    }
}
