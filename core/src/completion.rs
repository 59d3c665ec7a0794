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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Mutex as StdMutex;

    /// Jobs run one after another, in their order, each resolving its own completion.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_run_in_order_and_each_resolves_its_own_completion() {
        let seen = Arc::new(StdMutex::new(Vec::new()));
        let mut jobs = Vec::new();
        let mut done = Vec::new();
        for i in 0..5u32 {
            let (_gate, tx, completion) = gated();
            let seen = seen.clone();
            jobs.push((
                async move {
                    seen.lock().unwrap().push(i);
                    if i == 3 { Err(Error::protocol("job 3")) } else { Ok(()) }
                },
                tx,
            ));
            done.push(completion);
        }
        spawn_in_order(jobs);
        for (i, c) in done.into_iter().enumerate() {
            let r = c.await;
            assert_eq!(r.is_err(), i == 3, "job {i}: {r:?}");
        }
        assert_eq!(*seen.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    }

    /// Outside a runtime nothing runs, and every completion says why.
    #[test]
    fn outside_a_runtime_every_completion_is_unsupported() {
        let (_g1, tx1, c1) = gated();
        let (_g2, tx2, c2) = gated();
        spawn_in_order(vec![(std::future::ready(Ok(())), tx1), (std::future::ready(Ok(())), tx2)]);
        for c in [c1, c2] {
            let r = futures::executor::block_on(c);
            assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
        }
        let r = futures::executor::block_on(spawn_cancellable(|_| async { Ok(()) }));
        assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
    }
}
