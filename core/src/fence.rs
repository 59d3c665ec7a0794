//! `OpFence`: how the engine orders a notification after the data before it. The engine gives every
//! op it submits on a backend connection a [`FenceTicket`] (inside the [`crate::backend::Op`]);
//! the backend drops the op, and with it the ticket, when the op has ended. Before handing a
//! notification to the connection the engine waits for [`OpFence::wait_earlier`]: every ticket
//! issued before the call has been dropped. Backends never see the fence: the rule is enforced
//! once, here.
//!
//! Plain state behind a mutex plus wakers, so the loom model below checks it without tokio.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::sync::{Arc, Mutex, lock};

#[derive(Debug, Default)]
struct FenceState {
    next: u64,
    pending: BTreeSet<u64>,
    /// Waiters to wake when a ticket drops: (waiter id, its waker).
    waiters: Vec<(u64, Waker)>,
    next_waiter: u64,
}

impl FenceState {
    fn clear_below(&self, horizon: u64) -> bool {
        self.pending.first().is_none_or(|&s| s >= horizon)
    }
}

/// Tracks the outstanding ops of one connection in submission order. Cheap to clone (a handle).
#[derive(Debug, Clone, Default)]
pub(crate) struct OpFence {
    state: Arc<Mutex<FenceState>>,
}

/// One outstanding op; dropping it marks the op ended.
#[derive(Debug)]
pub(crate) struct FenceTicket {
    fence: OpFence,
    seq: u64,
}

impl Drop for FenceTicket {
    fn drop(&mut self) {
        let wake = {
            let mut st = lock(&self.fence.state);
            let was_first = st.pending.first() == Some(&self.seq);
            st.pending.remove(&self.seq);
            // Only the oldest ticket moves any waiter's horizon.
            if was_first { std::mem::take(&mut st.waiters) } else { Vec::new() }
        };
        for (_, w) in wake {
            w.wake();
        }
    }
}

impl OpFence {
    /// A fence with nothing outstanding.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Registers an op submitted now.
    pub(crate) fn ticket(&self) -> FenceTicket {
        let mut st = lock(&self.state);
        let seq = st.next;
        st.next += 1;
        st.pending.insert(seq);
        FenceTicket { fence: self.clone(), seq }
    }

    /// Ops outstanding.
    #[cfg(test)]
    pub(crate) fn outstanding(&self) -> usize {
        lock(&self.state).pending.len()
    }

    /// Resolves once every op registered before this call has ended. The horizon is taken now,
    /// not when the future is first polled. Callers bound it with a timeout.
    pub(crate) fn wait_earlier(&self) -> WaitEarlier {
        let mut st = lock(&self.state);
        let horizon = st.next;
        st.next_waiter += 1;
        WaitEarlier { fence: self.clone(), horizon, id: st.next_waiter }
    }
}

/// The future of [`OpFence::wait_earlier`].
#[derive(Debug)]
pub(crate) struct WaitEarlier {
    fence: OpFence,
    horizon: u64,
    id: u64,
}

impl Future for WaitEarlier {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut st = lock(&self.fence.state);
        if st.clear_below(self.horizon) {
            return Poll::Ready(());
        }
        // Registered under the same lock a dropping ticket takes, so no wake-up is lost.
        let id = self.id;
        match st.waiters.iter_mut().find(|(w, _)| *w == id) {
            Some((_, waker)) => waker.clone_from(cx.waker()),
            None => st.waiters.push((id, cx.waker().clone())),
        }
        Poll::Pending
    }
}

impl Drop for WaitEarlier {
    fn drop(&mut self) {
        let id = self.id;
        lock(&self.fence.state).waiters.retain(|(w, _)| *w != id);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn waits_only_for_earlier_tickets() {
        use futures::FutureExt;
        let fence = OpFence::new();
        let a = fence.ticket();
        let b = fence.ticket();
        let wait = fence.wait_earlier();
        tokio::pin!(wait);
        let _later = fence.ticket();
        assert!((&mut wait).now_or_never().is_none(), "returned with earlier ops outstanding");
        drop(b);
        assert!((&mut wait).now_or_never().is_none(), "returned with the oldest op outstanding");
        drop(a);
        tokio::time::timeout(Duration::from_secs(5), wait).await.expect("fence wait hung");
        assert_eq!(fence.outstanding(), 1);
    }

    #[test]
    fn dropped_waiters_leave_no_waker_behind() {
        use futures::FutureExt;
        let fence = OpFence::new();
        let _a = fence.ticket();
        for _ in 0..3 {
            let mut w = fence.wait_earlier();
            assert!((&mut w).now_or_never().is_none());
        }
        assert!(lock(&fence.state).waiters.is_empty());
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    /// Two ops end on another thread (the later one first) while a notification waits for
    /// them: the wait always completes (no lost wake-up), and never before both ended.
    #[test]
    fn loom_fence_orders_after_earlier_ops() {
        loom::model(|| {
            let fence = OpFence::new();
            let ended = Arc::new(crate::sync::AtomicUsize::new(0));
            let (a, b) = (fence.ticket(), fence.ticket());
            let wait = fence.wait_earlier();
            let _later = fence.ticket();
            let e = ended.clone();
            let t = loom::thread::spawn(move || {
                for ticket in [b, a] {
                    e.fetch_add(1, crate::sync::Ordering::SeqCst);
                    drop(ticket);
                }
            });
            loom::future::block_on(wait);
            assert_eq!(ended.load(crate::sync::Ordering::SeqCst), 2, "notified before an op ended");
            t.join().unwrap();
        });
    }
}
