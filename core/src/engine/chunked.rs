//! The chunk API over a session. The producer's `ChunkSender` WRITEs chunk i into the consumer's
//! region as soon as it is marked ready, then notifies "chunk i landed" (the notification follows the
//! data). The consumer's `ChunkStream` yields each landed chunk (index, element range, byte ranges)
//! in landing order, then end-of-tensor, or the error that stopped the transfer. Every wait is bounded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::session::Session;
use super::transfer::TransferOp;
use super::{EngineShared, lock};
use crate::backend::Direction;
use crate::chunk::ready::ReadySet;
use crate::chunk::{ChunkPlan, ChunkTracker, LandedChunk};
use crate::error::{Error, Result};
use crate::ids::EngineId;
use crate::region::{Region, RegionInner, RemoteRegion};
use crate::wire::envelope::Message;

/// Signals the engine routes to a chunk stream.
#[derive(Debug)]
pub(crate) enum ChunkSignal {
    Landed { from: EngineId, index: u32 },
    Aborted { from: EngineId, reason: String },
}

fn check_fits(what: &str, region_len: u64, base: u64, plan: &ChunkPlan) -> Result<()> {
    match base.checked_add(plan.extent()) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(Error::OutOfBounds {
            what: what.to_string(),
            offset: base,
            len: plan.extent(),
            limit: region_len,
        }),
    }
}

/// The consumer side of a chunked transfer.
#[derive(Debug)]
pub struct ChunkStream {
    id: u64,
    plan: ChunkPlan,
    base: u64,
    tracker: ChunkTracker,
    rx: mpsc::Receiver<ChunkSignal>,
    producer: Option<EngineId>,
    timeout: Duration,
    engine: Weak<EngineShared>,
}

impl ChunkStream {
    pub(crate) fn open(
        engine: &Arc<EngineShared>,
        plan: ChunkPlan,
        region: &Region,
        base: u64,
    ) -> Result<ChunkStream> {
        engine.ensure_open()?;
        if region.inner.engine_id != engine.id {
            return Err(Error::InvalidArgument(format!(
                "region {} belongs to another engine",
                region.id().0
            )));
        }
        check_fits(
            &format!("chunked tensor in region {}", region.id().0),
            region.len(),
            base,
            &plan,
        )?;
        let (tx, rx) = mpsc::channel(plan.len() as usize + 2);
        let id = {
            let mut streams = lock(&engine.chunk_streams);
            let id = loop {
                let id: u64 = rand::random();
                if id != 0 && !streams.contains_key(&id) {
                    break id;
                }
            };
            streams.insert(id, tx);
            id
        };
        Ok(ChunkStream {
            id,
            tracker: ChunkTracker::new(plan.len()),
            plan,
            base,
            rx,
            producer: None,
            timeout: engine.config.chunk_timeout,
            engine: Arc::downgrade(engine),
        })
    }

    /// The id the producer must use.
    pub fn transfer_id(&self) -> u64 {
        self.id
    }

    /// The plan.
    pub fn plan(&self) -> &ChunkPlan {
        &self.plan
    }

    /// Chunks still to land.
    pub fn remaining(&self) -> u32 {
        self.tracker.remaining()
    }

    fn fail(&mut self, e: Error) -> Error {
        self.tracker.fail(e.clone());
        e
    }

    /// The next landed chunk; `Ok(None)` once every chunk has landed (end-of-tensor). An abort by the
    /// producer, a stray signal, or no chunk within the engine's chunk timeout is an error, and every
    /// later call returns the same error.
    pub async fn next(&mut self) -> Result<Option<LandedChunk>> {
        if let Some(e) = self.tracker.failure() {
            return Err(e.clone());
        }
        if self.tracker.is_complete() {
            return Ok(None);
        }
        let sig = match tokio::time::timeout(self.timeout, self.rx.recv()).await {
            Err(_) => {
                let e = Error::timeout(
                    format!(
                        "chunked transfer {:#x}: {} of {} chunks still missing",
                        self.id,
                        self.tracker.remaining(),
                        self.plan.len()
                    ),
                    self.timeout,
                );
                return Err(self.fail(e));
            }
            Ok(None) => return Err(self.fail(Error::PeerClosed("local engine shut down".into()))),
            Ok(Some(s)) => s,
        };
        let from = match &sig {
            ChunkSignal::Landed { from, .. } | ChunkSignal::Aborted { from, .. } => *from,
        };
        if *self.producer.get_or_insert(from) != from {
            let e = Error::protocol(format!(
                "chunked transfer {:#x}: signal from {from}, but the producer is {}",
                self.id,
                self.producer.map(|p| p.to_string()).unwrap_or_default()
            ));
            return Err(self.fail(e));
        }
        match sig {
            ChunkSignal::Aborted { reason, .. } => Err(self.fail(Error::PeerClosed(format!(
                "producer {from} aborted chunked transfer {:#x}: {reason}",
                self.id
            )))),
            ChunkSignal::Landed { index, .. } => {
                self.tracker.on_landed(index)?;
                Ok(Some(self.plan.landed(index, self.base)?))
            }
        }
    }
}

impl Drop for ChunkStream {
    fn drop(&mut self) {
        if let Some(e) = self.engine.upgrade() {
            lock(&e.chunk_streams).remove(&self.id);
        }
    }
}

#[derive(Debug)]
struct SenderShared {
    session: Session,
    transfer: u64,
    plan: ChunkPlan,
    local: Arc<RegionInner>,
    local_base: u64,
    remote: RemoteRegion,
    remote_base: u64,
    ready: ReadySet,
    aborted: AtomicBool,
}

impl SenderShared {
    async fn abort(&self, reason: String) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            let _ =
                self.session.send(Message::ChunkAbort { transfer: self.transfer, reason }).await;
        }
    }

    async fn send_chunk(self: Arc<Self>, index: u32) -> Result<()> {
        let chunk = self.plan.chunk(index)?;
        let ops = chunk
            .ranges
            .iter()
            .map(|r| TransferOp {
                dir: Direction::Write,
                local: self.local.clone(),
                local_offset: self.local_base + r.offset,
                remote: self.remote.clone(),
                remote_offset: self.remote_base + r.offset,
                len: r.len,
            })
            .collect();
        let mut first_err = None;
        for h in self.session.submit(ops).await {
            if let Err(e) = h.await {
                first_err.get_or_insert(e);
            }
        }
        let sent = match first_err {
            None => {
                self.session.send(Message::ChunkLanded { transfer: self.transfer, index }).await
            }
            Some(e) => Err(e),
        };
        if let Err(e) = &sent {
            self.abort(format!("chunk {index}: {e}")).await;
        }
        sent
    }
}

/// The producer side of a chunked transfer. Mark chunks ready in any order, from any thread; each is
/// sent as soon as it is marked. Call [`ChunkSender::finish`] to wait for all of them; dropping the
/// sender before that aborts the transfer (the consumer sees an error, never a hang).
#[derive(Debug)]
pub struct ChunkSender {
    shared: Arc<SenderShared>,
    tasks: Mutex<JoinSet<Result<()>>>,
    finished: bool,
}

impl Session {
    /// Starts the producer side of a chunked transfer: chunks of `plan` are read from `local` (tensor
    /// storage at `local_base`) and written into `remote` (storage at `remote_base`) under the
    /// consumer's `transfer` id (from its [`crate::ChunkStream::transfer_id`]).
    pub fn chunk_sender(
        &self,
        transfer: u64,
        plan: ChunkPlan,
        local: &Region,
        local_base: u64,
        remote: &RemoteRegion,
        remote_base: u64,
    ) -> Result<ChunkSender> {
        let session = self.clone();
        check_fits(&format!("local region {}", local.id().0), local.len(), local_base, &plan)?;
        check_fits(&format!("remote region {}", remote.id.0), remote.len, remote_base, &plan)?;
        let ready = ReadySet::new(plan.len());
        Ok(ChunkSender {
            shared: Arc::new(SenderShared {
                session,
                transfer,
                plan,
                local: local.inner.clone(),
                local_base,
                remote: remote.clone(),
                remote_base,
                ready,
                aborted: AtomicBool::new(false),
            }),
            tasks: Mutex::new(JoinSet::new()),
            finished: false,
        })
    }
}

impl ChunkSender {
    /// The plan.
    pub fn plan(&self) -> &ChunkPlan {
        &self.shared.plan
    }

    /// Marks chunk `index` ready and starts sending it. Marking an index twice, or one past the plan,
    /// is an error.
    pub fn mark_ready(&self, index: u32) -> Result<()> {
        self.shared.ready.mark(index)?;
        let s = self.shared.clone();
        lock(&self.tasks).spawn(s.send_chunk(index));
        Ok(())
    }

    /// Waits until every chunk has been sent and notified; the first failure is returned (and the
    /// consumer was told). Finishing with unmarked chunks aborts the transfer.
    pub async fn finish(mut self) -> Result<()> {
        self.finished = true;
        let missing = self.shared.ready.remaining();
        if missing > 0 {
            let e = Error::InvalidArgument(format!(
                "finish with {missing} of {} chunks never marked ready",
                self.shared.plan.len()
            ));
            self.shared.abort(e.to_string()).await;
            return Err(e);
        }
        let mut set = std::mem::take(&mut *lock(&self.tasks));
        let mut first_err = None;
        while let Some(r) = set.join_next().await {
            let r = r.unwrap_or_else(|j| Err(Error::Internal(format!("chunk task failed: {j}"))));
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for ChunkSender {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // Stop sending (dropping the tasks cancels their transfers), then tell the consumer.
        lock(&self.tasks).abort_all();
        let s = self.shared.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { s.abort("producer dropped the chunk sender".into()).await });
        }
    }
}
