//! `InflightGate`: counts operations using a region and lets deregistration close the gate and then
//! wait until the count drains. After `close`, `enter` always fails, so once the count is seen at zero
//! no operation can touch the memory again.

use crate::sync::{AtomicU64, Ordering};

const CLOSED: u64 = 1 << 63;

/// A counter of in-flight users with a one-way "closed" bit.
#[derive(Debug)]
pub(crate) struct InflightGate {
    state: AtomicU64,
}

impl InflightGate {
    pub(crate) fn new() -> Self {
        Self { state: AtomicU64::new(0) }
    }

    /// Registers one more user; false once the gate is closed.
    pub(crate) fn enter(&self) -> bool {
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            if cur & CLOSED != 0 {
                return false;
            }
            match self.state.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Registers one more user on behalf of one already inside (a narrower window of a held
    /// slice): it succeeds even on a closed gate, since the count cannot have drained while the
    /// caller is inside.
    pub(crate) fn join(&self) {
        let prev = self.state.fetch_add(1, Ordering::AcqRel);
        debug_assert!(prev & !CLOSED != 0, "join without a user inside");
    }

    /// Releases one user; returns true when this was the last user of a closed gate.
    pub(crate) fn exit(&self) -> bool {
        let prev = self.state.fetch_sub(1, Ordering::AcqRel);
        prev == CLOSED | 1
    }

    /// Closes the gate; returns true when no user is inside (already drained).
    pub(crate) fn close(&self) -> bool {
        let prev = self.state.fetch_or(CLOSED, Ordering::AcqRel);
        prev & !CLOSED == 0
    }

    /// True when closed and no user is inside.
    pub(crate) fn is_drained(&self) -> bool {
        self.state.load(Ordering::Acquire) == CLOSED
    }

    /// Users inside now.
    pub(crate) fn count(&self) -> u64 {
        self.state.load(Ordering::Acquire) & !CLOSED
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicBool;

    /// A user racing with close: either the user got in (and close sees it drain exactly once), or the
    /// user was refused; never both "drained" and a user inside.
    #[test]
    fn loom_inflight_gate_close_vs_enter() {
        loom::model(|| {
            let gate = Arc::new(InflightGate::new());
            let inside = Arc::new(AtomicBool::new(false));
            let g2 = gate.clone();
            let in2 = inside.clone();
            let user = loom::thread::spawn(move || {
                if g2.enter() {
                    in2.store(true, Ordering::SeqCst);
                    in2.store(false, Ordering::SeqCst);
                    g2.exit()
                } else {
                    false
                }
            });
            let drained_at_close = gate.close();
            if drained_at_close {
                // Nobody is inside after a drained close, and nobody can get in any more.
                assert!(!inside.load(Ordering::SeqCst));
            }
            let last_out = user.join().unwrap();
            assert!(gate.is_drained());
            // Exactly one party observes the drain: close (nobody inside) or the last exit.
            assert!(drained_at_close ^ last_out);
            assert!(!gate.enter());
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn enter_exit_close() {
        let g = InflightGate::new();
        assert!(g.enter());
        assert!(g.enter());
        assert!(!g.close());
        assert_eq!(g.count(), 2);
        assert!(!g.enter());
        assert!(!g.exit());
        assert!(g.exit());
        assert!(g.is_drained());
    }
}
