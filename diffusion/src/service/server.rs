//! The orchestrator as a network service: one task owns the [`Scheduler`]; each connection is a
//! worker or a submitter, authenticated with the cluster secret (HMAC challenge both ways) when
//! one is configured. A worker whose connection closes (a killed process) leaves at once and its
//! items are re-queued; one that goes silent is declared dead after the heartbeat timeout.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_core::auth::{ClusterSecret, nonce};
use tensorwire_core::{Error, Result};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::wire::{Msg, Role, read_msg};
use crate::queue::Stage;
use crate::sched::{ItemKey, Outcome, RoutingPolicy, SchedConfig, Scheduler, Submit, WorkerId};

/// Service settings.
pub struct ServiceConfig {
    /// Scheduler settings.
    pub sched: SchedConfig,
    /// Routing policy.
    pub policy: Box<dyn RoutingPolicy>,
    /// Shared secret; without one any client is accepted (and a warning is logged).
    pub secret: Option<ClusterSecret>,
    /// Bound on a client's handshake.
    pub handshake_timeout: Duration,
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
    Result { worker: u64, request: u64, stage: Stage, ok: bool, reason: String, data: Vec<u8> },
    Submit { request: u64, priority: crate::queue::Priority, tx: mpsc::Sender<Msg> },
}

/// A running orchestrator service; dropping it stops it.
#[derive(Debug)]
pub struct OrchestratorService {
    addr: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for OrchestratorService {
    fn drop(&mut self) {
        self.tasks.iter().for_each(tokio::task::JoinHandle::abort);
    }
}

impl OrchestratorService {
    /// Listens on `listen` and serves.
    pub async fn serve(listen: SocketAddr, cfg: ServiceConfig) -> Result<OrchestratorService> {
        let l = TcpListener::bind(listen).await.map_err(|e| {
            Error::InvalidArgument(format!("orchestrator: cannot listen on {listen}: {e}"))
        })?;
        let addr = l.local_addr()?;
        if cfg.secret.is_none() {
            tracing::warn!("orchestrator service without a cluster secret: any client is accepted");
        }
        let (tx, rx) = mpsc::channel(4096);
        let core = tokio::spawn(run(Scheduler::new(cfg.sched, cfg.policy), rx));
        let secret = cfg.secret.clone().map(Arc::new);
        let hs = cfg.handshake_timeout;
        let acceptor = tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = l.accept().await else { continue };
                let _ = sock.set_nodelay(true);
                let (tx, secret) = (tx.clone(), secret.clone());
                tokio::spawn(async move {
                    if let Err(e) = connection(sock, tx, secret, hs).await {
                        tracing::debug!(error = %e, "orchestrator: connection ended");
                    }
                });
            }
        });
        Ok(OrchestratorService { addr, tasks: vec![core, acceptor] })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

async fn connection(
    sock: TcpStream,
    events: mpsc::Sender<Event>,
    secret: Option<Arc<ClusterSecret>>,
    hs: Duration,
) -> Result<()> {
    let (mut rd, mut wr) = sock.into_split();
    let role = tokio::time::timeout(hs, async {
        let Some(Msg::Open { nonce: client }) = read_msg(&mut rd).await? else {
            return Err(Error::protocol("orchestrator: expected Open"));
        };
        let server = nonce();
        let proof = secret.as_ref().map_or([0; 32], |s| s.server_proof(&client, &server));
        wr.write_all(&Msg::Challenge { nonce: server, proof }.encode()).await?;
        let Some(Msg::Hello { proof, role }) = read_msg(&mut rd).await? else {
            return Err(Error::protocol("orchestrator: expected Hello"));
        };
        if let Some(s) = &secret {
            if !s.verify_client(&server, &client, &proof) {
                let m = Msg::Reject { reason: "authentication failed (cluster secret)".into() };
                let _ = wr.write_all(&m.encode()).await;
                return Err(Error::AccessDenied(
                    "orchestrator client failed authentication".into(),
                ));
            }
        }
        Ok(role)
    })
    .await
    .map_err(|_| Error::timeout("orchestrator handshake", hs))??;
    let (out_tx, mut out_rx) = mpsc::channel::<Msg>(1024);
    let (reply, id) = tokio::sync::oneshot::channel();
    events
        .send(Event::Join { role: role.clone(), tx: out_tx.clone(), reply })
        .await
        .map_err(|_| Error::PeerClosed("orchestrator stopped".into()))?;
    let worker = id.await.map_err(|_| Error::PeerClosed("orchestrator stopped".into()))?;
    wr.write_all(&Msg::Welcome { worker }.encode()).await?;
    let writer = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            if wr.write_all(&m.encode()).await.is_err() {
                break;
            }
        }
    });
    let is_worker = matches!(role, Role::Worker { .. });
    let r = async {
        while let Some(m) = read_msg(&mut rd).await? {
            let ev = match m {
                Msg::Heartbeat if is_worker => Event::Heartbeat { worker },
                Msg::Credit { slots } if is_worker => Event::Credit { worker, slots },
                Msg::Result { request, stage, ok, reason, data } if is_worker => {
                    Event::Result { worker, request, stage, ok, reason, data }
                }
                Msg::Submit { request, priority, .. } if !is_worker => {
                    Event::Submit { request, priority, tx: out_tx.clone() }
                }
                other => {
                    return Err(Error::protocol(format!("orchestrator: unexpected {other:?}")));
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

async fn run(mut s: Scheduler, mut rx: mpsc::Receiver<Event>) {
    let start = Instant::now();
    let mut next = 0u64;
    let mut workers: HashMap<u64, mpsc::Sender<Msg>> = HashMap::new();
    let mut waiting: HashMap<u64, mpsc::Sender<Msg>> = HashMap::new();
    let mut outputs: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        let ev = tokio::select! {
            e = rx.recv() => match e { Some(e) => Some(e), None => return },
            _ = tick.tick() => None,
        };
        let now = start.elapsed();
        match ev {
            Some(Event::Join { role, tx, reply }) => {
                next += 1;
                if let Role::Worker { stage, slots, host, labels } = role {
                    s.join(WorkerId(next), stage, slots, &host, labels, now);
                    workers.insert(next, tx);
                }
                let _ = reply.send(next);
            }
            Some(Event::Gone { worker }) => {
                workers.remove(&worker);
                s.leave(WorkerId(worker), now);
            }
            Some(Event::Heartbeat { worker }) => s.heartbeat(WorkerId(worker), now),
            Some(Event::Credit { worker, slots }) => s.credit(WorkerId(worker), slots, now),
            Some(Event::Result { worker, request, stage, ok, reason, data }) => {
                let key = ItemKey { request, stage };
                if ok {
                    if s.finished(key, WorkerId(worker), now) {
                        outputs.insert(request, data); // the next stage's inputs
                    }
                } else {
                    s.failed(key, WorkerId(worker), &reason, now);
                }
            }
            Some(Event::Submit { request, priority, tx }) => {
                let sub = Submit { request, priority, deadline: None, host: None, labels: vec![] };
                if s.submit(sub, now) {
                    waiting.insert(request, tx);
                } else {
                    let m =
                        Msg::Outcome { request, ok: false, reason: "duplicate request id".into() };
                    let _ = tx.try_send(m);
                }
            }
            None => {}
        }
        for d in s.dispatch(now) {
            let data = outputs.get(&d.item.key.request).cloned().unwrap_or_default();
            let m = Msg::Assign {
                request: d.item.key.request,
                stage: d.item.key.stage,
                attempt: d.item.attempt,
                data,
            };
            let sent = workers.get(&d.worker.0).is_some_and(|tx| tx.try_send(m).is_ok());
            if !sent {
                // The worker cannot take messages (gone or flooded): take its items back.
                workers.remove(&d.worker.0);
                s.leave(d.worker, now);
            }
        }
        for o in s.take_outcomes() {
            let (request, ok, reason) = match o {
                Outcome::Completed { request } => (request, true, String::new()),
                Outcome::Failed { request, reason } => (request, false, reason),
            };
            outputs.remove(&request);
            if let Some(tx) = waiting.remove(&request) {
                let _ = tx.try_send(Msg::Outcome { request, ok, reason });
            }
        }
    }
}
