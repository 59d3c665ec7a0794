//! `CancelGate`: makes cancellation of a memory operation safe. A backend performs each piece of a
//! copy inside `run`; `cancel` takes the same lock, so once `cancel` returns no piece is running and
//! none will start: no byte lands in memory after the operation's handle is gone.

use crate::sync::{Mutex, lock};

/// A cancellation flag whose `cancel` waits for the piece of work in progress.
#[derive(Debug, Default)]
pub struct CancelGate {
    cancelled: Mutex<bool>,
}

impl CancelGate {
    /// A gate that is not cancelled.
    pub fn new() -> Self {
        Self { cancelled: Mutex::new(false) }
    }

    /// Runs `f` unless cancelled; `None` when cancelled. Keep `f` short (one bounded copy).
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        let g = lock(&self.cancelled);
        if *g { None } else { Some(f()) }
    }

    /// Cancels; returns after any piece of work in progress has finished.
    pub fn cancel(&self) {
        *lock(&self.cancelled) = true;
    }

    /// Whether `cancel` was called.
    pub fn is_cancelled(&self) -> bool {
        *lock(&self.cancelled)
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
}
