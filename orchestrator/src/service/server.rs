//! The orchestrator as a network service: one task owns the [`Driver`]; each connection is a
//! worker or a submitter, opened with the authenticated handshake (the cluster secret, when one
//! is configured). A worker whose connection closes (a killed process) leaves at once and its
//! items are re-queued; one that goes silent is declared dead after the heartbeat timeout.
//!
//! With a journal ([`ServiceConfig::journal`]) the service survives its own restart: every fact
//! that says where a request is (submitted, dispatched, result accepted, ended, released) is
//! written and synced to the journal before the service acts on it (one sync per loop turn for
//! everything that arrived meanwhile), and a result is acknowledged only once it is durable. A
//! restarted service replays the journal, parks the items that were running for a grace
//! period, and lets the reconnecting workers claim them ([`Msg::Holding`]) and resend results
//! not yet acknowledged; submitters ask for their requests again ([`Msg::Resume`]). If the
//! journal cannot be written, the service stops rather than run on without it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::Error;
use tensorwire_proto::admission::{Admission, Limits, Pending};
use tensorwire_proto::auth::{ClusterSecret, check_listener};
use tensorwire_proto::handshake::Handshake;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::elastic::Pools;
use super::logfile::{JournalFile, JournalStore};
use super::wire::{Ending, FRAMING, MAX_HELD, Msg, Role, read_msg, write_msgs};
use crate::clock::Ticker;
use crate::driver::{Driver, OrchestratorStats, StageResult, metrics_due};
use crate::error::{OrchestratorError, Result};
use crate::rebalance::RebalanceConfig;
use crate::sched::{ItemKey, Outcome, RoutingPolicy, SchedConfig, Submit, WorkerId};
use crate::timeline::Mark;

/// Service settings.
pub struct ServiceConfig {
    /// Scheduler settings.
    pub sched: SchedConfig,
    /// Routing policy.
    pub policy: Box<dyn RoutingPolicy>,
    /// Shared secret. Without one any client is accepted, so `serve` refuses an address other
    /// hosts can reach unless `insecure` is set.
    pub secret: Option<ClusterSecret>,
    /// Opts out of the rule above (warned at start and for every client from another host).
    pub insecure: bool,
    /// Bound on a client's handshake.
    pub handshake_timeout: Duration,
    /// The journal file (created if missing, replayed if present). Without one (and without
    /// `journal_store`), a restarted service knows nothing of the requests before it.
    pub journal: Option<PathBuf>,
    /// A journal opened elsewhere (e.g. in etcd, for a standby orchestrator); exclusive with
    /// `journal`.
    pub journal_store: Option<Box<dyn JournalStore>>,
    /// How long items rebuilt from the journal wait for their workers to reconnect and claim
    /// them before they are queued for anyone (default: the heartbeat timeout).
    pub recovery_grace: Option<Duration>,
    /// A journal past this size (and twice its last compacted size) is compacted.
    pub compact_bytes: u64,
    /// Elastic pools: move workers that can serve other stages between pools as the load
    /// shifts (see [`crate::rebalance`]); None: pools keep the workers that joined them.
    pub rebalance: Option<RebalanceConfig>,
}

impl Default for ServiceConfig {
    /// Default scheduler settings, max-free-credit routing, no secret (loopback only), a 10 s
    /// handshake bound.
    fn default() -> Self {
        ServiceConfig {
            sched: SchedConfig::default(),
            policy: Box::new(crate::sched::MaxFreeCredit),
            secret: None,
            insecure: false,
            handshake_timeout: Duration::from_secs(10),
            journal: None,
            journal_store: None,
            recovery_grace: None,
            compact_bytes: 8 << 20,
            rebalance: None,
        }
    }
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig").field("sched", &self.sched).finish_non_exhaustive()
    }
}

enum Event {
    Join { role: Role, tx: mpsc::Sender<Msg>, reply: tokio::sync::oneshot::Sender<u64> },
    Gone { worker: u64 },
    Heartbeat { worker: u64 },
    Credit { worker: u64, slots: u32 },
    Result { worker: u64, key: ItemKey, result: StageResult, ack: Option<mpsc::Sender<Msg>> },
    Holding { worker: u64, key: ItemKey, attempt: u32 },
    Checkpoint { worker: u64, key: ItemKey, step: u32, data: Vec<u8> },
    Yielded { worker: u64, key: ItemKey, step: u32, data: Vec<u8>, ack: Option<mpsc::Sender<Msg>> },
    Drain { worker: u64 },
    Submit { sub: Submit, inputs: Vec<u8>, tx: mpsc::Sender<Msg> },
    Resume { sub: Submit, inputs: Vec<u8>, tx: mpsc::Sender<Msg> },
    Stats { reply: tokio::sync::oneshot::Sender<OrchestratorStats> },
    Released { worker: u64, request: u64 },
    Announce { worker: u64, key: ItemKey, data: Vec<u8> },
    Timeline { request: u64, tx: mpsc::Sender<Msg> },
    Handoff { worker: u64, key: ItemKey, bytes: u64, micros: u64 },
}

/// The label a worker joins with to say where its metrics endpoint is: `metrics=HOST:PORT`.
pub const METRICS_LABEL: &str = "metrics=";

/// The label that says a worker's metrics endpoint is at `addr`; one on every interface
/// (`0.0.0.0:PORT`) is advertised under this host's name (`$HOSTNAME`, else "localhost").
pub fn metrics_label(addr: SocketAddr) -> String {
    if addr.ip().is_unspecified() {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        format!("{METRICS_LABEL}{host}:{}", addr.port())
    } else {
        format!("{METRICS_LABEL}{addr}")
    }
}

/// A joined worker's metrics endpoint (from its [`METRICS_LABEL`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsTarget {
    /// The worker's id.
    pub worker: u64,
    /// Its pool.
    pub stage: crate::Stage,
    /// The endpoint's address.
    pub addr: String,
}

impl MetricsTarget {
    /// The labels a scrape of it carries (service discovery): `stage` and `worker`.
    pub fn labels(&self) -> Vec<(String, String)> {
        vec![("stage".into(), self.stage.name().into()), ("worker".into(), self.worker.to_string())]
    }
}

type Targets = Arc<parking_lot::Mutex<Vec<MetricsTarget>>>;

/// A running orchestrator service; dropping it stops it.
#[derive(Debug)]
pub struct OrchestratorService {
    addr: SocketAddr,
    events: mpsc::Sender<Event>,
    targets: Targets,
    /// The driver and the acceptor (aborted when the service drops).
    _tasks: JoinSet<()>,
}

impl OrchestratorService {
    /// Listens on `listen` and serves.
    pub async fn serve(listen: SocketAddr, cfg: ServiceConfig) -> Result<OrchestratorService> {
        check_listener("orchestrator service", listen, cfg.secret.as_ref(), cfg.insecure)?;
        let l = TcpListener::bind(listen).await.map_err(|e| {
            Error::InvalidArgument(format!("orchestrator: cannot listen on {listen}: {e}"))
        })?;
        let addr = l.local_addr().map_err(Error::from)?;
        let grace = cfg.recovery_grace.unwrap_or(cfg.sched.heartbeat_timeout);
        if let Some(r) = &cfg.rebalance {
            r.check().map_err(OrchestratorError::InvalidArgument)?;
        }
        let pools = cfg.rebalance.map(Pools::new);
        let mut driver = Driver::new(cfg.sched, cfg.policy);
        let journal: Option<Box<dyn JournalStore>> = match (&cfg.journal, cfg.journal_store) {
            (Some(_), Some(_)) => {
                return Err(OrchestratorError::InvalidArgument(
                    "orchestrator: a journal file and a journal store are exclusive".into(),
                ));
            }
            (Some(path), None) => {
                let j = JournalFile::open(path, cfg.compact_bytes).map_err(|e| {
                    Error::InvalidArgument(format!("orchestrator journal {}: {e}", path.display()))
                })?;
                Some(Box::new(j))
            }
            (None, store) => store,
        };
        if let Some(j) = &journal {
            driver.restore(j.book(), Duration::ZERO, grace);
            driver.record_facts();
            let st = driver.stats(Duration::ZERO);
            tracing::info!(
                journal = ?j,
                in_flight = st.parked + st.queued.iter().sum::<usize>(),
                to_release = st.unreleased,
                "orchestrator: journal replayed"
            );
        }
        let (tx, rx) = mpsc::channel(4096);
        let mut tasks = JoinSet::new();
        let targets = Targets::default();
        tasks.spawn(run(driver, journal, rx, targets.clone(), pools));
        let secret = cfg.secret.clone().map(Arc::new);
        let hs = cfg.handshake_timeout;
        let events = tx.clone();
        tasks.spawn(async move {
            // The connections live in here: stopping the service closes every one of them.
            let mut conns = JoinSet::new();
            // Connections before their Hello are bounded in time and number (the oldest goes;
            // tensorwire_proto::admission); the accept loop backs off when out of descriptors.
            let admission = Admission::new("orchestrator service", Limits::handshake(hs));
            loop {
                while conns.try_join_next().is_some() {}
                let (sock, peer) = tensorwire_proto::accept::accept(&l, "orchestrator").await;
                let _ = sock.set_nodelay(true);
                let (tx, secret) = (tx.clone(), secret.clone());
                let pending = admission.admit(peer.ip());
                conns.spawn(async move {
                    if let Err(e) = connection(sock, peer, tx, secret, pending).await {
                        tracing::debug!(error = %e, "orchestrator: connection ended");
                    }
                });
            }
        });
        Ok(OrchestratorService { addr, events, targets, _tasks: tasks })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The metrics endpoints of the joined workers that said where theirs is (refreshed twice
    /// a second).
    pub fn metrics_targets(&self) -> Vec<MetricsTarget> {
        self.targets.lock().clone()
    }

    /// [`OrchestratorService::metrics_targets`] as a function that can outlive a borrow of the
    /// service (e.g. for a metrics endpoint's `/sd`); once the service stopped, it gives the
    /// last list the service published.
    pub fn metrics_targets_fn(&self) -> impl Fn() -> Vec<MetricsTarget> + Send + Sync + 'static {
        let t = self.targets.clone();
        move || t.lock().clone()
    }

    /// A snapshot of the scheduler's counters and queues.
    pub async fn stats(&self) -> Result<OrchestratorStats> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.events.send(Event::Stats { reply }).await.map_err(|_| OrchestratorError::Stopped)?;
        rx.await.map_err(|_| OrchestratorError::Stopped)
    }
}

async fn connection(
    mut sock: TcpStream,
    peer: SocketAddr,
    events: mpsc::Sender<Event>,
    secret: Option<Arc<ClusterSecret>>,
    mut pending: Pending,
) -> Result<()> {
    let hello = async {
        Handshake { framing: &FRAMING, secret: secret.as_deref(), peer }.server(&mut sock).await?;
        match read_msg(&mut sock).await? {
            Some(Msg::Hello { role }) => Ok(role),
            _ => Err(Error::protocol("orchestrator: expected Hello")),
        }
    };
    let role = pending
        .prove(hello)
        .await
        .map_err(|closed| closed.error("orchestrator handshake", pending.deadline()))??;
    pending.proved();
    let (mut rd, mut wr) = sock.into_split();
    let (out_tx, out_rx) = mpsc::channel::<Msg>(1024);
    let (reply, id) = tokio::sync::oneshot::channel();
    events
        .send(Event::Join { role: role.clone(), tx: out_tx.clone(), reply })
        .await
        .map_err(|_| OrchestratorError::Stopped)?;
    let worker = id.await.map_err(|_| OrchestratorError::Stopped)?;
    wr.write_all(&Msg::Welcome { worker }.encode()?).await.map_err(Error::from)?;
    let mut writer = tokio::spawn(write_msgs(wr, out_rx));
    let is_worker = matches!(role, Role::Worker { .. });
    // A worker's only sender is the driver's: when the driver drops it (the worker was declared
    // dead), the writer ends and so does this connection. Acknowledgements go through a weak
    // one.
    let weak = out_tx.downgrade();
    let out_tx = (!is_worker).then_some(out_tx);
    let r = async {
        loop {
            let m = tokio::select! {
                m = read_msg(&mut rd) => match m? {
                    Some(m) => m,
                    None => break,
                },
                _ = &mut writer => break,
            };
            let ev = match m {
                Msg::Heartbeat if is_worker => Event::Heartbeat { worker },
                Msg::Credit { slots } if is_worker => Event::Credit { worker, slots },
                Msg::Released { request } if is_worker => Event::Released { worker, request },
                Msg::Announce { request, stage, data } if is_worker => {
                    Event::Announce { worker, key: ItemKey { request, stage }, data }
                }
                Msg::Result { request, stage, ending, reason, data } if is_worker => {
                    let key = ItemKey { request, stage };
                    let result = match ending {
                        Ending::Done => StageResult::Done(data),
                        Ending::Failed => StageResult::Failed(reason),
                        Ending::LostInput => StageResult::LostInput(reason),
                    };
                    Event::Result { worker, key, result, ack: weak.upgrade() }
                }
                Msg::Holding { request, stage, attempt } if is_worker => {
                    Event::Holding { worker, key: ItemKey { request, stage }, attempt }
                }
                Msg::Checkpoint { request, stage, step, data } if is_worker => {
                    Event::Checkpoint { worker, key: ItemKey { request, stage }, step, data }
                }
                Msg::Yielded { request, stage, step, data } if is_worker => {
                    let key = ItemKey { request, stage };
                    Event::Yielded { worker, key, step, data, ack: weak.upgrade() }
                }
                Msg::Drain if is_worker => Event::Drain { worker },
                Msg::Handoff { request, stage, bytes, micros } if is_worker => {
                    Event::Handoff { worker, key: ItemKey { request, stage }, bytes, micros }
                }
                Msg::Submit { request, priority, start, data, resume_step, resume, .. }
                    if !is_worker =>
                {
                    let Some(tx) = out_tx.clone() else { break };
                    let sub = submit(request, priority, start, resume_step, resume);
                    Event::Submit { sub, inputs: data, tx }
                }
                Msg::Resume { request, priority, start, data, resume_step, resume }
                    if !is_worker =>
                {
                    let Some(tx) = out_tx.clone() else { break };
                    let sub = submit(request, priority, start, resume_step, resume);
                    Event::Resume { sub, inputs: data, tx }
                }
                Msg::AskTimeline { request } if !is_worker => {
                    let Some(tx) = out_tx.clone() else { break };
                    Event::Timeline { request, tx }
                }
                other => {
                    let e = Error::protocol(format!("orchestrator: unexpected {other:?}"));
                    return Err(OrchestratorError::from(e));
                }
            };
            if events.send(ev).await.is_err() {
                break;
            }
        }
        Ok(())
    }
    .await;
    if is_worker {
        let _ = events.send(Event::Gone { worker }).await; // its items are re-queued now
    }
    writer.abort();
    r
}

/// A request as a submitter described it (an empty checkpoint: none).
fn submit(
    request: u64,
    priority: crate::Priority,
    start: crate::Stage,
    resume_step: u32,
    resume: Vec<u8>,
) -> Submit {
    let resume = (!resume.is_empty()).then_some((resume_step, resume));
    Submit { start, resume, ..Submit::new(request, priority) }
}

type ServiceDriver = Driver<mpsc::Sender<Msg>, mpsc::Sender<Msg>>;

/// Messages to send once what they depend on is durable.
type Outbox = Vec<(mpsc::Sender<Msg>, Msg)>;

/// Most events taken in one loop turn (one journal sync covers them all).
const BATCH: usize = 256;

fn handle(
    d: &mut ServiceDriver,
    pools: &mut Option<Pools>,
    ev: Event,
    now: Duration,
    out: &mut Outbox,
) {
    match ev {
        Event::Join { role, tx, reply } => {
            let id = match role {
                Role::Worker { stage, slots, host, labels, can, switched } => {
                    let id = d.join(stage, slots, &host, labels, tx, now).0;
                    if let Some(p) = pools {
                        p.joined(id, (stage, slots), can, switched, now);
                    }
                    id
                }
                Role::Submitter => 0,
            };
            let _ = reply.send(id);
        }
        Event::Gone { worker } => {
            d.leave(WorkerId(worker), now);
            if let Some(p) = pools {
                p.gone(worker);
            }
        }
        Event::Heartbeat { worker } => d.heartbeat(WorkerId(worker), now),
        Event::Credit { worker, slots } => d.credit(WorkerId(worker), slots, now),
        Event::Result { worker, key, result, ack } => {
            if let Some(p) = pools {
                p.ended(key, now);
            }
            d.result(WorkerId(worker), key, result, now);
            // Accepted or not, the worker may forget it once this turn is durable.
            if let Some(tx) = ack {
                out.push((tx, Msg::Ack { request: key.request, stage: key.stage }));
            }
        }
        Event::Holding { worker, key, attempt } => {
            let kept = d.claim(WorkerId(worker), key, attempt, now);
            tracing::debug!(worker, request = key.request, ?key.stage, kept, "orchestrator: claim");
        }
        Event::Submit { sub, inputs, tx } => {
            // Sent before a reconnect and again after it (the catch-up's resume went first).
            if d.waiter(sub.request).is_some_and(|w| w.same_channel(&tx)) {
                return;
            }
            if let Err((tx, o)) = d.submit_with(sub, inputs, tx, now) {
                out.push((tx, outcome_msg(o)));
            }
        }
        Event::Resume { sub, inputs, tx } => {
            if let Err((tx, o)) = d.resume(sub, inputs, tx, now) {
                out.push((tx, outcome_msg(o)));
            }
        }
        Event::Stats { reply } => {
            let _ = reply.send(d.stats(now));
        }
        Event::Released { worker, request } => d.released(WorkerId(worker), request),
        Event::Announce { worker, key, data } => d.announce(WorkerId(worker), key, data, now),
        Event::Handoff { worker, key, bytes, micros } => {
            d.handoff(WorkerId(worker), key, Mark::Handoff { bytes, micros }, now);
        }
        Event::Timeline { request, tx } => {
            let timeline = d.timeline(request).cloned();
            let _ = tx.try_send(Msg::TimelineIs { request, timeline });
        }
        Event::Checkpoint { worker, key, step, data } => {
            d.checkpoint(WorkerId(worker), key, step, data);
        }
        Event::Yielded { worker, key, step, data, ack } => {
            if let Some(p) = pools {
                p.ended(key, now);
            }
            d.yielded(WorkerId(worker), key, step, data, now);
            if let Some(tx) = ack {
                out.push((tx, Msg::Ack { request: key.request, stage: key.stage }));
            }
        }
        Event::Drain { worker } => {
            d.drain(WorkerId(worker), now);
        }
    }
}

async fn run(
    mut d: ServiceDriver,
    mut journal: Option<Box<dyn JournalStore>>,
    mut rx: mpsc::Receiver<Event>,
    targets: Targets,
    mut pools: Option<Pools>,
) {
    let mut clock = Ticker::new(Duration::from_millis(100));
    let mut published = Duration::ZERO;
    while let Some((now, ev)) = clock.next(&mut rx).await {
        let mut out = Outbox::new();
        if let Some(ev) = ev {
            handle(&mut d, &mut pools, ev, now, &mut out);
        }
        for _ in 1..BATCH {
            let Ok(ev) = rx.try_recv() else { break };
            handle(&mut d, &mut pools, ev, now, &mut out);
        }
        let assigned: Vec<(WorkerId, mpsc::Sender<Msg>, Msg)> = d
            .dispatch(now)
            .into_iter()
            .map(|a| {
                let item = &a.dispatch.item;
                if let Some(p) = &mut pools {
                    p.dispatched(item.key, now);
                }
                let (resume_step, resume) =
                    a.resume.map_or((0, Vec::new()), |(s, d)| (s, d.to_vec()));
                let m = Msg::Assign {
                    request: item.key.request,
                    stage: item.key.stage,
                    priority: item.priority,
                    attempt: item.attempt,
                    data: a.inputs.to_vec(),
                    resume_step,
                    resume,
                };
                (a.dispatch.worker, a.worker.clone(), m)
            })
            .collect();
        for (id, endpoint) in d.take_dead() {
            tracing::warn!(worker = id.0, "orchestrator: worker missed its heartbeats; closing it");
            drop(endpoint); // its connection closes; the worker may rejoin
        }
        for e in d.take_outcomes() {
            if let Some(tx) = e.waiter {
                out.push((tx, outcome_msg(e.outcome)));
            }
        }
        // Nothing leaves before the facts it depends on are durable.
        if let Some(j) = &mut journal {
            for f in d.take_facts() {
                j.append(&f);
            }
            let t = std::time::Instant::now();
            let committed = j.commit().await;
            metrics::histogram!("tensorwire_journal_sync_seconds")
                .record(t.elapsed().as_secs_f64());
            if let Err(e) = committed {
                tracing::error!(error = %e, "orchestrator: cannot write the journal; stopping");
                return;
            }
        }
        for (tx, m) in out {
            let _ = tx.try_send(m);
        }
        // A worker that cannot take its assignment (gone or flooded) gives its items back.
        let refused: Vec<WorkerId> = assigned
            .into_iter()
            .filter_map(|(id, tx, m)| tx.try_send(m).is_err().then_some(id))
            .collect();
        for w in refused {
            d.leave(w, now);
        }
        // Workers moved between pools are drained (and told where to go) now, so that their
        // jobs' yield asks leave below.
        if let Some(p) = &mut pools {
            p.turn(&mut d, now);
        }
        // Jobs asked back (preemption, drains) and drained workers, after the assignments (an
        // ask may name a job assigned this turn).
        for (key, _, tx) in d.take_asks() {
            let _ = tx.try_send(Msg::Yield { request: key.request, stage: key.stage });
        }
        for (_, tx) in d.take_drained() {
            let _ = tx.try_send(Msg::Drained);
        }
        // Ended requests' outputs go to a live worker to release (again to another, should it
        // leave before it says it did).
        let mut unsent = Vec::new();
        for r in d.releases() {
            if r.outputs.len() > MAX_HELD {
                tracing::warn!(
                    request = r.request,
                    outputs = r.outputs.len(),
                    "orchestrator: more outputs than a release lists; the oldest stay unreleased"
                );
            }
            let skip = r.outputs.len().saturating_sub(MAX_HELD);
            let held = r.outputs[skip..].to_vec();
            if r.worker.try_send(Msg::Release { request: r.request, held }).is_err() {
                unsent.push(r.request); // flooded or gone: given out again next round
            }
        }
        for request in unsent {
            d.release_again(request);
        }
        if metrics_due(now, published) {
            d.publish_metrics();
            *targets.lock() = metrics_targets(&d);
            published = now;
        }
    }
}

fn metrics_targets(d: &ServiceDriver) -> Vec<MetricsTarget> {
    let mut v: Vec<MetricsTarget> = d
        .sched()
        .workers()
        .filter_map(|(id, stage, labels)| {
            let addr = labels.iter().find_map(|l| l.strip_prefix(METRICS_LABEL))?;
            Some(MetricsTarget { worker: id.0, stage, addr: addr.to_string() })
        })
        .collect();
    v.sort_by_key(|t| t.worker);
    v
}

fn outcome_msg(o: Outcome) -> Msg {
    match o {
        Outcome::Completed { request } => Msg::Outcome { request, ok: true, reason: String::new() },
        Outcome::Failed { request, reason } => Msg::Outcome { request, ok: false, reason },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metrics_label_names_a_reachable_address() {
        let at = |s: &str| metrics_label(s.parse().unwrap());
        assert_eq!(at("127.0.0.1:9464"), "metrics=127.0.0.1:9464");
        assert_eq!(at("[::1]:9464"), "metrics=[::1]:9464");
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        assert_eq!(at("0.0.0.0:9465"), format!("metrics={host}:9465"), "not 0.0.0.0");
    }
}
