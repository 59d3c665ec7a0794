//! Device staging, written once for every backend that moves host memory only: an op whose
//! local memory is on a GPU runs through a pool of pinned host buffers ("bounces", registered
//! with every backend like any region), in pieces, pipelined. A WRITE copies piece i+1 device ->
//! host while the backend sends piece i; a READ copies piece i host -> device while the backend
//! receives piece i+1. Copies go through the engine's GPU (its device copier) on blocking
//! threads, so the runtime keeps moving bytes meanwhile.
//!
//! The op keeps one ticket of its connection's notification fence until its last copy, so a
//! notification sent after it still arrives after its bytes. Dropping its completion cancels it:
//! copies into local device memory run inside the op's cancel gate, so none lands after the
//! drop returns; pieces in flight are dropped (cancelled by their backend's rules) before their
//! bounce goes back to the pool.
//!
//! Backends that receive into or send from a *peer's* device region stage on the target side
//! with the same bounces ([`crate::backend::BackendHost::bounce`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Semaphore;

use super::EngineShared;
use crate::backend::{Completion, Connection, Direction, Op, RemoteSlice};
use crate::bounce::{BOUNCE_BYTES, Bounce, copy_blocking};
use crate::cancel::CancelGate;
use crate::error::{Error, Result};
use crate::fence::{FenceTicket, OpFence};
use crate::region::{MemSlice, Permissions, Region, RemoteRegion};
use crate::sync::lock;

/// Bounce buffers per engine (pinned host memory: `BOUNCES * BOUNCE_BYTES`).
pub(crate) const BOUNCES: usize = 8;
/// Pieces of one staged op in flight at once: the halves of its one bounce (an op holds one
/// bounce, so ops waiting for bounces never hold one another's).
const DEPTH: u64 = 2;

/// The engine's bounce buffers: pinned host regions, made on first use, at most [`BOUNCES`].
#[derive(Debug)]
pub(crate) struct StagingPool {
    engine: Weak<EngineShared>,
    free: Arc<Mutex<Vec<Region>>>,
    permits: Arc<Semaphore>,
    /// Bounces made so far (each a registered region of the engine, kept until it drops).
    made: AtomicUsize,
}

impl StagingPool {
    pub(crate) fn new(engine: Weak<EngineShared>) -> StagingPool {
        StagingPool {
            engine,
            free: Arc::default(),
            permits: Arc::new(Semaphore::new(BOUNCES)),
            made: AtomicUsize::new(0),
        }
    }

    /// Bounces made so far.
    pub(crate) fn made(&self) -> usize {
        self.made.load(Ordering::Relaxed)
    }

    /// A bounce buffer (waits while all are in use).
    pub(crate) async fn take(self: &Arc<Self>) -> Result<Bounce> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Error::PeerClosed("staging pool closed".into()))?;
        if let Some(e) = self.engine.upgrade() {
            e.counters.host_staged.fetch_add(1, Ordering::Relaxed);
        }
        let reused = lock(&self.free).pop();
        let region = match reused {
            Some(r) => r,
            None => {
                let shared = self
                    .engine
                    .upgrade()
                    .ok_or_else(|| Error::PeerClosed("local engine dropped".into()))?;
                let r =
                    super::Engine { shared }.alloc_pinned(BOUNCE_BYTES, Permissions::NONE).await?;
                self.made.fetch_add(1, Ordering::Relaxed);
                r
            }
        };
        Ok(Bounce::new(region, Arc::downgrade(&self.free), permit))
    }
}

/// What a staged op needs.
pub(crate) struct Staged {
    pub(crate) pool: Arc<StagingPool>,
    pub(crate) conn: Arc<dyn Connection>,
    pub(crate) fence: OpFence,
    pub(crate) dir: Direction,
    pub(crate) local: MemSlice,
    pub(crate) region: Arc<RemoteRegion>,
    pub(crate) blob: bytes::Bytes,
    pub(crate) offset: u64,
    pub(crate) ticket: FenceTicket,
}

impl Staged {
    fn op(&self, local: MemSlice, at: u64) -> Op {
        Op {
            dir: self.dir,
            local,
            remote: RemoteSlice {
                region: self.region.id,
                key: self.region.key,
                offset: self.offset + at,
                blob: self.blob.clone(),
            },
            ticket: self.fence.ticket(),
            fallback: None,
        }
    }

    fn submit(&self, local: MemSlice, at: u64) -> Result<Completion> {
        let op = self.op(local, at);
        self.conn
            .submit(vec![op])
            .pop()
            .ok_or_else(|| Error::Internal("a backend returned no completion".into()))
    }

    /// Runs the op (see the module docs): pieces of half a bounce, one half in flight with the
    /// backend while the other is copied.
    pub(crate) async fn run(self, gate: Arc<CancelGate>) -> Result<()> {
        super::telemetry::bounced(self.dir.name());
        let len = self.local.len();
        let bounce = self.pool.take().await?;
        let half = bounce.len() / DEPTH;
        let pieces: Vec<(u64, u64)> =
            (0..len.div_ceil(half)).map(|k| (k * half, half.min(len - k * half))).collect();
        // Pieces in flight: (completion, offset in the op, length, half used). Completions are
        // dropped before the bounce (declared after it), so a cancelled READ lands nothing in it.
        let mut inflight: VecDeque<(Completion, u64, u64, u64)> = VecDeque::new();
        let mut next = pieces.into_iter().enumerate();
        let slot = |k: usize| (k as u64 % DEPTH) * half;
        match self.dir {
            Direction::Write => {
                for (k, (at, n)) in next.by_ref() {
                    if inflight.len() as u64 >= DEPTH {
                        if let Some((c, ..)) = inflight.pop_front() {
                            c.await?;
                        }
                    }
                    if gate.is_cancelled() {
                        return Ok(());
                    }
                    let b = slot(k);
                    copy_blocking(bounce.sub(b, n)?, self.local.sub(at, n)?, None).await?;
                    inflight.push_back((self.submit(bounce.sub(b, n)?, at)?, at, n, b));
                }
                while let Some((c, ..)) = inflight.pop_front() {
                    c.await?;
                }
            }
            Direction::Read => loop {
                while (inflight.len() as u64) < DEPTH {
                    let Some((k, (at, n))) = next.next() else { break };
                    let b = slot(k);
                    inflight.push_back((self.submit(bounce.sub(b, n)?, at)?, at, n, b));
                }
                let Some((c, at, n, b)) = inflight.pop_front() else { break };
                c.await?;
                let landed =
                    copy_blocking(self.local.sub(at, n)?, bounce.sub(b, n)?, Some(gate.clone()))
                        .await?;
                if !landed {
                    return Ok(()); // cancelled: nothing more lands
                }
            },
        }
        drop(inflight);
        drop(self.ticket);
        Ok(())
    }
}
