//! Running an op as a task with a cancellable completion: the shared piece every backend that copies
//! with the CPU uses, so "drop cancels, and no byte lands after the drop returns" is written once.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::cancel::CancelGate;
use crate::error::{Error, Result};

/// The completion of one op. Dropping it cancels the op (see the [`crate::backend`] contract).
pub type Completion = Pin<Box<dyn Future<Output = Result<()>> + Send + 'static>>;

struct GatedCompletion {
    rx: oneshot::Receiver<Result<()>>,
    gate: Arc<CancelGate>,
}

impl Future for GatedCompletion {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        Pin::new(&mut self.rx).poll(cx).map(|r| {
            r.unwrap_or_else(|_| Err(Error::PeerClosed("op task ended without a result".into())))
        })
    }
}

impl Drop for GatedCompletion {
    fn drop(&mut self) {
        self.gate.cancel();
    }
}

/// The sending half of a [`gated`] completion.
pub type CompletionSender = oneshot::Sender<Result<()>>;

/// A completion resolved through the returned sender, for backends that finish ops from their own
/// I/O tasks instead of one task per op. Dropping the completion cancels the gate (waiting out a
/// write in progress); a sender dropped unused resolves it with [`Error::PeerClosed`].
pub fn gated() -> (Arc<CancelGate>, CompletionSender, Completion) {
    let gate = Arc::new(CancelGate::new());
    let (tx, rx) = oneshot::channel();
    (gate.clone(), tx, Box::pin(GatedCompletion { rx, gate }))
}

/// Spawns `op` (given the op's cancel gate; it must do every memory write inside `gate.run`) and
/// returns its completion. Dropping the completion cancels the gate, waiting out a write in progress.
pub fn spawn_cancellable<F, Fut>(op: F) -> Completion
where
    F: FnOnce(Arc<CancelGate>) -> Fut,
    Fut: Future<Output = Result<()>> + Send + 'static,
{
    let (gate, tx, completion) = gated();
    spawn_in_order(vec![(op(gate), tx)]);
    completion
}

/// Spawns one task that runs `jobs` one after another, each resolving its [`gated`]
/// completion's sender with its result: for small ops whose own task each would cost more than
/// their work. Outside a tokio runtime every job's completion resolves to `Unsupported`.
pub fn spawn_in_order<Fut>(jobs: Vec<(Fut, CompletionSender)>)
where
    Fut: Future<Output = Result<()>> + Send + 'static,
{
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn(async move {
                for (fut, tx) in jobs {
                    let _ = tx.send(fut.await);
                }
            });
        }
        Err(_) => {
            for (_, tx) in jobs {
                let _ = tx.send(Err(Error::Unsupported {
                    backend: "engine",
                    what: "submitting ops outside a tokio runtime".into(),
                }));
            }
        }
    }
}

/// An op's completion that also waits for a notice sent beside it: the notice's failure (the
/// peer's refusal) wins over the op's result. Dropping it cancels both.
pub(crate) fn after_notice(notice: Completion, op: Completion) -> Completion {
    Box::pin(async move {
        let (notice, op) = tokio::join!(notice, op);
        notice.and(op)
    })
}

/// The completions of a batch whose notice went beside it (`sent`, the notice's completion): the
/// first op's also waits for the notice, as [`crate::backend::Connection::submit_noticed`] needs.
pub fn notice_beside(sent: Completion, mut done: Vec<Completion>) -> Vec<Completion> {
    if let Some(first) = done.first_mut() {
        *first = after_notice(sent, std::mem::replace(first, ready(Ok(()))));
    }
    done
}

/// A completion that is already resolved (an op rejected before it started).
pub fn ready(result: Result<()>) -> Completion {
    Box::pin(std::future::ready(result))
}
