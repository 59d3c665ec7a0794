//! `OpGate`: cancellation of an op whose bytes are moved by UCX requests, which complete
//! asynchronously. The progress thread enters the gate for each request it starts and leaves it
//! when the request completes; dropping the op's completion cancels the gate (no new request
//! starts) and waits until none is in flight, so no byte lands in local memory after the drop
//! returns.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
struct State {
    cancelled: bool,
    inflight: u32,
}

/// Cancellation flag plus a count of requests in flight.
#[derive(Debug, Default)]
pub struct OpGate {
    state: Mutex<State>,
    idle: Condvar,
}

impl OpGate {
    /// A gate that is not cancelled, with nothing in flight.
    pub fn new() -> OpGate {
        OpGate::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one request in flight; false (and nothing counted) once cancelled.
    pub fn enter(&self) -> bool {
        let mut s = self.state();
        if s.cancelled {
            return false;
        }
        s.inflight += 1;
        true
    }

    /// One request finished.
    pub fn exit(&self) {
        let mut s = self.state();
        s.inflight = s.inflight.saturating_sub(1);
        if s.inflight == 0 {
            self.idle.notify_all();
        }
    }

    /// Whether `cancel` was called.
    pub fn is_cancelled(&self) -> bool {
        self.state().cancelled
    }

    /// Cancels: no request starts after this returns.
    pub fn cancel(&self) {
        self.state().cancelled = true;
    }

    /// Waits until no request is in flight, at most `bound`; whether that happened.
    pub fn wait_idle(&self, bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        let mut s = self.state();
        while s.inflight > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            s = self.idle.wait_timeout(s, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn cancel_stops_new_requests_and_waits_for_running_ones() {
        let g = Arc::new(OpGate::new());
        assert!(g.enter());
        g.cancel();
        assert!(!g.enter(), "no request starts after cancel");
        assert!(!g.wait_idle(Duration::from_millis(10)), "one still in flight");
        let g2 = g.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            g2.exit();
        });
        assert!(g.wait_idle(Duration::from_secs(10)));
        t.join().unwrap();
    }
}
