//! Transfer requests and their handles: a `TransferOp` names local and remote memory; a
//! `TransferHandle` resolves when that one op is done (or failed, or timed out). Dropping a handle
//! cancels the op safely.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::EngineShared;
use crate::backend::{Completion, Direction};
use crate::error::{Error, Result};
use crate::region::{MemSlice, Region, RegionInner, RemoteRegion};

/// The bytes a post (or a lone op) may run within its call, all its ops together (see
/// [`crate::backend::Connection::run_now`]): the ops past them are submitted (where a backend
/// may copy up to its own inline budget in `submit`, shm 1 MiB, and leaves the rest to the
/// runtime's workers), so a call holds its caller, often a runtime worker itself, for a few
/// 1 MiB copies at most (50-100 us each).
pub(super) const CALL_BYTES: u64 = 1 << 20;

/// One READ or WRITE between a local region and a peer's region.
#[derive(Debug, Clone)]
pub struct TransferOp {
    pub(crate) dir: Direction,
    pub(crate) local: Arc<RegionInner>,
    pub(crate) local_offset: u64,
    pub(crate) remote: RemoteRegion,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
}

/// `TransferOp::write` and `TransferOp::read`, written once.
macro_rules! constructors {
    ($($(#[$doc:meta])* $name:ident => $dir:expr;)*) => {$(
        $(#[$doc])*
        pub fn $name(
            local: &Region,
            local_offset: u64,
            remote: &RemoteRegion,
            remote_offset: u64,
            len: u64,
        ) -> Self {
            let (dir, local) = ($dir, local.inner.clone());
            TransferOp { dir, local, local_offset, remote: remote.clone(), remote_offset, len }
        }
    )*};
}

impl TransferOp {
    constructors! {
        /// WRITE `len` bytes from `local[local_offset..]` into `remote[remote_offset..]`.
        write => Direction::Write;
        /// READ `len` bytes from `remote[remote_offset..]` into `local[local_offset..]`.
        read => Direction::Read;
    }

    /// The op `dir` between `local` (its whole length) and `remote[remote_offset..]`.
    pub fn from_slice(
        dir: Direction,
        local: &MemSlice,
        remote: &RemoteRegion,
        remote_offset: u64,
    ) -> Self {
        let (region, local_offset, len) = local.parts();
        TransferOp { dir, local: region, local_offset, remote: remote.clone(), remote_offset, len }
    }

    /// Direction.
    pub fn direction(&self) -> Direction {
        self.dir
    }
    /// Bytes to move.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the op moves nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What a completed transfer did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferReport {
    /// The backend that moved the bytes.
    pub backend: &'static str,
    /// Bytes moved.
    pub bytes: u64,
    /// Time from submission to completion.
    pub elapsed: Duration,
    /// Whether this op's local memory went through a host staging buffer (device memory over a
    /// backend that moves host memory). A peer staging its own device region for the op counts
    /// it in its [`crate::EngineStats::host_staged`].
    pub host_staged: bool,
}

/// Resolves when one transfer is done. Dropping it cancels the transfer: no more bytes of it land in
/// local memory once the drop returns.
pub struct TransferHandle {
    backend: &'static str,
    state: State,
}

/// An op that ended before its handle was made (rejected up front, or run within the call that
/// made it) holds its outcome; a running one its future.
enum State {
    Ended(Option<Result<TransferReport>>),
    Running(Pin<Box<dyn Future<Output = Result<TransferReport>> + Send>>),
}

impl std::fmt::Debug for TransferHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferHandle").field("backend", &self.backend).finish_non_exhaustive()
    }
}

impl TransferHandle {
    /// The backend chosen for this transfer ("none" when it was rejected before a backend was chosen).
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    pub(crate) fn failed(e: Error) -> Self {
        TransferHandle::ended("none", Err(e))
    }

    /// The handle of ops that `backend` already ended.
    pub(crate) fn ended(backend: &'static str, res: Result<TransferReport>) -> Self {
        TransferHandle { backend, state: State::Ended(Some(res)) }
    }

    /// The handle of a transfer that `fut` runs.
    pub(crate) fn from_future(
        backend: &'static str,
        fut: impl Future<Output = Result<TransferReport>> + Send + 'static,
    ) -> Self {
        TransferHandle { backend, state: State::Running(Box::pin(fut)) }
    }

    /// The handle of `op`, which `backend` runs as `pieces` since `start` (read before the
    /// backend's `submit`, which may have copied the op already); `host_staged`: through a host
    /// staging buffer.
    pub(crate) fn running(
        engine: &Arc<EngineShared>,
        backend: &'static str,
        op: &TransferOp,
        pieces: Vec<Completion>,
        (start, host_staged): (Instant, bool),
    ) -> Self {
        let limit = engine.config.transfer_timeout;
        let engine: Weak<EngineShared> = Arc::downgrade(engine);
        let (dir, len, region) = (op.dir, op.len, op.remote.id.0);
        let in_flight = super::telemetry::InFlight::start();
        let fut = async move {
            let _in_flight = in_flight; // ends with the op, or with its handle when dropped
            let all = async {
                for p in pieces {
                    p.await?;
                }
                Ok(())
            };
            let res = within(limit, all).await.unwrap_or_else(|| {
                Err(Error::timeout(
                    format!("{dir:?} of {len} bytes with remote region {region} via {backend}"),
                    limit,
                ))
            });
            let elapsed = start.elapsed();
            counted(engine.upgrade().as_deref(), backend, (dir, len), elapsed, &res);
            res.map(|()| TransferReport { backend, bytes: len, elapsed, host_staged })
        };
        TransferHandle::from_future(backend, fut)
    }
}

/// Counts an ended op of `len` bytes in direction `dir`: in the engine's stats (while it
/// stands) and the metrics.
pub(super) fn counted(
    engine: Option<&EngineShared>,
    backend: &'static str,
    (dir, len): (Direction, u64),
    took: Duration,
    res: &Result<()>,
) {
    if let Some(e) = engine {
        e.record(backend, dir, len, res.is_ok());
    }
    super::telemetry::op_ended(backend, dir.name(), len, took, res);
}

/// `fut`'s output, or `None` when it has not ended within `limit`. A future done at its first
/// poll (an op its backend finished in `submit`, copied inline) starts no timer, which would
/// read the clock and clone the runtime's handle for nothing.
async fn within<T>(limit: Duration, fut: impl Future<Output = T>) -> Option<T> {
    let mut fut = std::pin::pin!(fut);
    match std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
        Poll::Ready(v) => Some(v),
        Poll::Pending => tokio::time::timeout(limit, fut).await.ok(),
    }
}

impl Future for TransferHandle {
    type Output = Result<TransferReport>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            State::Running(fut) => fut.as_mut().poll(cx),
            State::Ended(res) => Poll::Ready(res.take().unwrap_or_else(|| {
                Err(Error::InvalidArgument("a transfer handle polled after it ended".into()))
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_ended_handle_resolves_at_once_and_only_once() {
        use futures::FutureExt;
        let report = TransferReport {
            backend: "mem",
            bytes: 3,
            elapsed: Duration::ZERO,
            host_staged: false,
        };
        let mut h = TransferHandle::ended("mem", Ok(report.clone()));
        assert_eq!(h.backend(), "mem");
        assert_eq!((&mut h).now_or_never().map(|r| r.unwrap()), Some(report));
        let again = (&mut h).now_or_never().expect("ready").unwrap_err();
        assert!(matches!(again, Error::InvalidArgument(_)), "{again}");
    }

    #[tokio::test]
    async fn a_wait_ends_with_its_future_or_at_its_bound() {
        let bound = Duration::from_millis(20);
        assert_eq!(within(bound, async { 7 }).await, Some(7), "done at the first poll");
        let later = async {
            tokio::task::yield_now().await;
            8
        };
        assert_eq!(within(bound, later).await, Some(8), "done at a later poll");
        let started = Instant::now();
        assert_eq!(within(bound, std::future::pending::<u8>()).await, None, "never done");
        assert!(started.elapsed() >= bound, "gave up before its bound");
    }
}
