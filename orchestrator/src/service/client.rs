//! Clients of the orchestrator service: a stage worker (receives assignments, reports results,
//! sends heartbeats on its own) and a submitter (sends requests, awaits outcomes).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::{Priority, Stage};
use parking_lot::Mutex;
use tensorwire_core::Error;
use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::handshake::Handshake;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use super::wire::{Ending, FRAMING, MAX_DATA, Msg, Role, read_msg, write_msgs};
use crate::error::{OrchestratorError, Result};

/// Bound on connecting and the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// With `release_only`: every output the request's stages reported.
    pub held: Vec<Vec<u8>>,
    /// Nothing to run: the request ended (completed or failed) and nothing will consume `held`.
    /// The worker releases them, then says so with [`WorkerClient::released`] (until then the
    /// orchestrator keeps them, and gives them to another worker should this one leave).
    pub release_only: bool,
}

/// A stage worker connected to the service.
#[derive(Debug)]
pub struct WorkerClient {
    id: u64,
    out: mpsc::Sender<Msg>,
    /// Writer, reader and heartbeat tasks (aborted when the client drops).
    _tasks: JoinSet<()>,
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
        let (mut rd, wr, id) = open(addr, secret, role).await?;
        let (out, out_rx) = mpsc::channel::<Msg>(1024);
        let (tx, rx) = mpsc::channel(1024);
        let mut tasks = JoinSet::new();
        tasks.spawn(write_msgs(wr, out_rx));
        tasks.spawn(async move {
            loop {
                let a = match read_msg(&mut rd).await {
                    Ok(Some(Msg::Assign { request, stage, attempt, data })) => Assignment {
                        request,
                        stage,
                        attempt,
                        inputs: data,
                        held: Vec::new(),
                        release_only: false,
                    },
                    Ok(Some(Msg::Release { request, held })) => Assignment {
                        request,
                        stage,
                        attempt: 0,
                        inputs: Vec::new(),
                        held,
                        release_only: true,
                    },
                    _ => break,
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
        Ok((WorkerClient { id, out, _tasks: tasks }, rx))
    }

    /// The id the service gave this worker.
    pub fn id(&self) -> u64 {
        self.id
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
        let m = Msg::Announce { request: a.request, stage: a.stage, data };
        self.out.send(m).await.map_err(|_| OrchestratorError::Stopped)
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
        let m = Msg::Result { request: a.request, stage: a.stage, ending, reason, data };
        self.out.send(m).await.map_err(|_| OrchestratorError::Stopped)
    }
}

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<()>>>>>;

/// A client that submits requests.
#[derive(Debug)]
pub struct SubmitClient {
    out: mpsc::Sender<Msg>,
    waiting: Waiters,
    /// Writer and reader tasks (aborted when the client drops).
    _tasks: JoinSet<()>,
}

impl SubmitClient {
    /// Connects as a submitter.
    pub async fn connect(addr: SocketAddr, secret: Option<&ClusterSecret>) -> Result<SubmitClient> {
        let (mut rd, wr, _) = open(addr, secret, Role::Submitter).await?;
        let (out, out_rx) = mpsc::channel::<Msg>(1024);
        let mut tasks = JoinSet::new();
        tasks.spawn(write_msgs(wr, out_rx));
        let waiting: Waiters = Arc::default();
        let w = waiting.clone();
        tasks.spawn(async move {
            while let Ok(Some(Msg::Outcome { request, ok, reason })) = read_msg(&mut rd).await {
                if let Some(tx) = w.lock().remove(&request) {
                    let r = if ok {
                        Ok(())
                    } else {
                        Err(OrchestratorError::Failed { request, reason })
                    };
                    let _ = tx.send(r);
                }
            }
            for (_, tx) in w.lock().drain() {
                let _ = tx.send(Err(OrchestratorError::Stopped));
            }
        });
        Ok(SubmitClient { out, waiting, _tasks: tasks })
    }

    /// Submits a request; the receiver yields its outcome.
    pub async fn submit(
        &self,
        request: u64,
        priority: Priority,
    ) -> Result<oneshot::Receiver<Result<()>>> {
        let (tx, rx) = oneshot::channel();
        self.waiting.lock().insert(request, tx);
        let m = Msg::Submit { request, priority, deadline_ms: 0 };
        self.out.send(m).await.map_err(|_| OrchestratorError::Stopped)?;
        Ok(rx)
    }
}
