//! `CancelGate`: makes cancellation of a memory operation safe. A backend performs each piece of a
//! copy inside `run`; `cancel` takes the same lock exclusively, so once `cancel` returns no piece is
//! running and none will start: no byte lands in memory after the operation's handle is gone.
//! Pieces take the lock shared: the streams, lanes or threads of one op copy at the same time.

use std::sync::PoisonError;

#[cfg(loom)]
use loom::sync::RwLock;
#[cfg(not(loom))]
use std::sync::RwLock;

/// A cancellation flag whose `cancel` waits for the pieces of work in progress.
#[derive(Debug)]
pub struct CancelGate {
    cancelled: RwLock<bool>,
}

impl Default for CancelGate {
    fn default() -> Self {
        Self::new()
    }
}

impl CancelGate {
    /// A gate that is not cancelled.
    pub fn new() -> Self {
        Self { cancelled: RwLock::new(false) }
    }

    /// Runs `f` unless cancelled; `None` when cancelled. Keep `f` short (one bounded copy): a
    /// `cancel` waits for every `f` in progress. Several `run`s of one gate proceed together.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        let g = self.cancelled.read().unwrap_or_else(PoisonError::into_inner);
        if *g { None } else { Some(f()) }
    }

    /// Cancels; returns after every piece of work in progress has finished.
    pub fn cancel(&self) {
        *self.cancelled.write().unwrap_or_else(PoisonError::into_inner) = true;
    }

    /// Whether `cancel` was called.
    pub fn is_cancelled(&self) -> bool {
        *self.cancelled.read().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::sync::{AtomicUsize, Ordering};
    use loom::sync::Arc;

    /// After `cancel` returns, the worker writes nothing more.
    #[test]
    fn loom_cancel_gate_no_write_after_cancel() {
        loom::model(|| {
            let gate = Arc::new(CancelGate::new());
            let mem = Arc::new(AtomicUsize::new(0));
            let (g2, m2) = (gate.clone(), mem.clone());
            let worker = loom::thread::spawn(move || {
                for i in 1..=2 {
                    if g2.run(|| m2.store(i, Ordering::Relaxed)).is_none() {
                        break;
                    }
                }
            });
            gate.cancel();
            let seen = mem.load(Ordering::Relaxed);
            worker.join().unwrap();
            assert_eq!(mem.load(Ordering::Relaxed), seen, "a write landed after cancel returned");
        });
    }

    /// Two pieces of one op run under the gate at once; after `cancel` returns neither writes.
    #[test]
    fn loom_cancel_gate_two_workers() {
        loom::model(|| {
            let gate = Arc::new(CancelGate::new());
            let mem = Arc::new(AtomicUsize::new(0));
            let workers: Vec<_> = (0..2)
                .map(|w| {
                    let (g, m) = (gate.clone(), mem.clone());
                    loom::thread::spawn(move || {
                        g.run(|| m.fetch_add(1 << w, Ordering::Relaxed));
                    })
                })
                .collect();
            gate.cancel();
            let seen = mem.load(Ordering::Relaxed);
            workers.into_iter().for_each(|w| w.join().unwrap());
            assert_eq!(mem.load(Ordering::Relaxed), seen, "a write landed after cancel returned");
        });
    }
}
