//! Process exit versus progress threads.
//!
//! A progress thread is detached: a backend dropped (or shut down) just before `main` returns may
//! still be inside UCX while `exit` runs libucs's destructors, which tear down UCX's global state
//! (its async handler table) under it; UCX then aborts the process on an assertion. So a progress
//! thread calls into UCX only while it holds an [`InUcx`] pass, and an `atexit` handler (atexit
//! handlers run before shared libraries' destructors) closes the gate: it waits, bounded by
//! [`EXIT_WAIT`], for the threads inside to leave; a thread that asks for a pass after that parks
//! until the process is gone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, Once};
use std::time::Duration;

/// How long process exit waits for progress threads to leave UCX.
const EXIT_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug)]
struct State {
    /// Passes held.
    inside: usize,
    /// No new passes (the process is exiting).
    closed: bool,
}

/// Counts the threads inside UCX; closing it keeps new ones out.
#[derive(Debug)]
struct Gate {
    state: Mutex<State>,
    changed: Condvar,
}

impl Gate {
    const fn new() -> Gate {
        Gate { state: Mutex::new(State { inside: 0, closed: false }), changed: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits while the gate is closed (for ever, once it is), then counts one more inside.
    fn arrive(&self) {
        let mut s = self.lock();
        while s.closed {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.inside += 1;
    }

    fn leave(&self) {
        self.lock().inside -= 1;
        self.changed.notify_all();
    }

    /// Keeps new arrivals out and waits up to `bound` for those inside; whether they all left.
    fn close(&self, bound: Duration) -> bool {
        let mut s = self.lock();
        s.closed = true;
        let (s, _) = self
            .changed
            .wait_timeout_while(s, bound, |s| s.inside > 0)
            .unwrap_or_else(|p| p.into_inner());
        s.inside == 0
    }
}

static GATE: Gate = Gate::new();
static HOOK: Once = Once::new();
static CLOSING: AtomicBool = AtomicBool::new(false);

/// Whether the process is exiting: a thread inside UCX should finish quickly (cut waits short,
/// stop at its next [`InUcx::outside`]).
pub(crate) fn closing() -> bool {
    CLOSING.load(Ordering::Relaxed)
}

extern "C" fn close_at_exit() {
    CLOSING.store(true, Ordering::Relaxed);
    if !GATE.close(EXIT_WAIT) {
        // A thread stuck inside UCX: exit anyway rather than hang the process.
        eprintln!("tensorwire-ucx: a progress thread was still inside UCX at process exit");
    }
}

/// Permission to call into UCX; see the module docs. Not `Send`: it belongs to one thread.
#[derive(Debug)]
pub(crate) struct InUcx {
    gate: &'static Gate,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Takes a pass, installing the exit handler on first use. Once the process is exiting this never
/// returns (the thread parks until the process ends).
pub(crate) fn enter() -> InUcx {
    HOOK.call_once(|| {
        // SAFETY: `close_at_exit` is a plain `extern "C" fn()` that lives as long as the program;
        // atexit only records it. If it fails (no slot left), exit behaves as without it.
        unsafe { libc::atexit(close_at_exit) };
    });
    pass(&GATE)
}

fn pass(gate: &'static Gate) -> InUcx {
    gate.arrive();
    InUcx { gate, _not_send: std::marker::PhantomData }
}

impl InUcx {
    /// Runs `f`, which must not call UCX, without the pass (exit need not wait for it).
    pub(crate) fn outside<R>(&mut self, f: impl FnOnce() -> R) -> R {
        self.gate.leave();
        let r = f();
        self.gate.arrive();
        r
    }
}

impl Drop for InUcx {
    fn drop(&mut self) {
        self.gate.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closing_waits_for_passes_and_keeps_new_ones_out() {
        static G: Gate = Gate::new();
        let mut a = pass(&G);
        let b = pass(&G);
        a.outside(|| assert_eq!(G.lock().inside, 1));
        assert_eq!(G.lock().inside, 2);
        drop(b);
        // Still held: closing gives up after its bound.
        assert!(!G.close(Duration::from_millis(10)));
        // A thread arriving now parks.
        static ENTERED: AtomicBool = AtomicBool::new(false);
        std::thread::spawn(|| {
            let _p = pass(&G);
            ENTERED.store(true, Ordering::SeqCst);
        });
        drop(a);
        assert!(G.close(Duration::from_secs(5)), "the last pass was released");
        std::thread::sleep(Duration::from_millis(50));
        assert!(!ENTERED.load(Ordering::SeqCst), "no pass once closed");
    }
}
