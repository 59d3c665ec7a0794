//! Clients of the orchestrator service: a stage worker (receives assignments, reports results,
//! sends heartbeats on its own) and a submitter (sends requests, awaits outcomes).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tensorwire_core::auth::{ClusterSecret, nonce};
use tensorwire_core::sync::lock;
use tensorwire_core::{Error, Result};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

use super::wire::{Msg, Role, read_msg};
use crate::queue::{Priority, Stage};

async fn handshake(
    addr: SocketAddr,
    secret: Option<&ClusterSecret>,
    role: Role,
    timeout: Duration,
) -> Result<(OwnedReadHalf, OwnedWriteHalf, u64)> {
    tokio::time::timeout(timeout, async {
        let sock = TcpStream::connect(addr)
            .await
            .map_err(|e| Error::PeerClosed(format!("orchestrator at {addr}: {e}")))?;
        sock.set_nodelay(true)?;
        let (mut rd, mut wr) = sock.into_split();
        let client = nonce();
        wr.write_all(&Msg::Open { nonce: client }.encode()).await?;
        let Some(Msg::Challenge { nonce: server, proof }) = read_msg(&mut rd).await? else {
            return Err(Error::protocol("orchestrator: expected Challenge"));
        };
        if let Some(s) = secret {
            if !s.verify_server(&client, &server, &proof) {
                return Err(Error::AccessDenied("orchestrator failed authentication".into()));
            }
        }
        let proof = secret.map_or([0; 32], |s| s.client_proof(&server, &client));
        wr.write_all(&Msg::Hello { proof, role }.encode()).await?;
        match read_msg(&mut rd).await? {
            Some(Msg::Welcome { worker }) => Ok((rd, wr, worker)),
            Some(Msg::Reject { reason }) => {
                Err(Error::AccessDenied(format!("orchestrator: {reason}")))
            }
            _ => Err(Error::protocol("orchestrator: expected Welcome")),
        }
    })
    .await
    .map_err(|_| Error::timeout(format!("orchestrator handshake with {addr}"), timeout))?
}

/// An item the orchestrator assigned to this worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// Request.
    pub request: u64,
    /// Stage.
    pub stage: Stage,
    /// Try number.
    pub attempt: u32,
    /// What the previous stage reported (empty for encode).
    pub inputs: Vec<u8>,
}

/// A stage worker connected to the service.
#[derive(Debug)]
pub struct WorkerClient {
    id: u64,
    out: mpsc::Sender<Msg>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for WorkerClient {
    fn drop(&mut self) {
        self.tasks.iter().for_each(tokio::task::JoinHandle::abort);
    }
}

impl WorkerClient {
    /// Joins as a worker of `stage` with `slots`; heartbeats go out every `heartbeat`.
    /// Assignments arrive on the returned receiver (closed when the service goes away).
    pub async fn connect(
        addr: SocketAddr,
        secret: Option<&ClusterSecret>,
        stage: Stage,
        slots: u32,
        host: &str,
        heartbeat: Duration,
    ) -> Result<(WorkerClient, mpsc::Receiver<Assignment>)> {
        let role = Role::Worker { stage, slots, host: host.into(), labels: vec![] };
        let (mut rd, mut wr, id) = handshake(addr, secret, role, Duration::from_secs(10)).await?;
        let (out, mut out_rx) = mpsc::channel::<Msg>(1024);
        let (tx, rx) = mpsc::channel(1024);
        let writer = tokio::spawn(async move {
            while let Some(m) = out_rx.recv().await {
                if wr.write_all(&m.encode()).await.is_err() {
                    break;
                }
            }
        });
        let reader = tokio::spawn(async move {
            while let Ok(Some(Msg::Assign { request, stage, attempt, data })) =
                read_msg(&mut rd).await
            {
                if tx.send(Assignment { request, stage, attempt, inputs: data }).await.is_err() {
                    break;
                }
            }
        });
        let beat = out.clone();
        let beater = tokio::spawn(async move {
            let mut t = tokio::time::interval(heartbeat);
            loop {
                t.tick().await;
                if beat.send(Msg::Heartbeat).await.is_err() {
                    break;
                }
            }
        });
        Ok((WorkerClient { id, out, tasks: vec![writer, reader, beater] }, rx))
    }

    /// The id the service gave this worker.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Reports the end of an assignment.
    pub async fn report(&self, a: &Assignment, result: Result<()>) -> Result<()> {
        self.report_with(a, result.map(|()| Vec::new())).await
    }

    /// Reports the end of an assignment with outputs for the next stage (at most
    /// [`super::wire::MAX_DATA`] bytes).
    pub async fn report_with(&self, a: &Assignment, result: Result<Vec<u8>>) -> Result<()> {
        let (ok, reason, data) = match result {
            Ok(d) => (true, String::new(), d),
            Err(e) => (false, e.to_string(), Vec::new()),
        };
        if data.len() > super::wire::MAX_DATA {
            return Err(Error::Capacity {
                what: "stage outputs".into(),
                requested: data.len() as u64,
                limit: super::wire::MAX_DATA as u64,
            });
        }
        let m = Msg::Result { request: a.request, stage: a.stage, ok, reason, data };
        self.out
            .send(m)
            .await
            .map_err(|_| Error::PeerClosed("orchestrator connection closed".into()))
    }
}

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<()>>>>>;

/// A client that submits requests.
#[derive(Debug)]
pub struct SubmitClient {
    out: tokio::sync::Mutex<OwnedWriteHalf>,
    waiting: Waiters,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for SubmitClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl SubmitClient {
    /// Connects as a submitter.
    pub async fn connect(addr: SocketAddr, secret: Option<&ClusterSecret>) -> Result<SubmitClient> {
        let (mut rd, wr, _) =
            handshake(addr, secret, Role::Submitter, Duration::from_secs(10)).await?;
        let waiting: Waiters = Arc::default();
        let w = waiting.clone();
        let reader = tokio::spawn(async move {
            while let Ok(Some(Msg::Outcome { request, ok, reason })) = read_msg(&mut rd).await {
                if let Some(tx) = lock(&w).remove(&request) {
                    let _ = tx.send(if ok { Ok(()) } else { Err(Error::protocol(reason)) });
                }
            }
            for (_, tx) in lock(&w).drain() {
                let _ = tx.send(Err(Error::PeerClosed("orchestrator connection closed".into())));
            }
        });
        Ok(SubmitClient { out: tokio::sync::Mutex::new(wr), waiting, reader })
    }

    /// Submits a request; the receiver yields its outcome.
    pub async fn submit(
        &self,
        request: u64,
        priority: Priority,
    ) -> Result<oneshot::Receiver<Result<()>>> {
        let (tx, rx) = oneshot::channel();
        lock(&self.waiting).insert(request, tx);
        let m = Msg::Submit { request, priority, deadline_ms: 0 };
        self.out.lock().await.write_all(&m.encode()).await?;
        Ok(rx)
    }
}
