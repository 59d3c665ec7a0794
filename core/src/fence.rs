//! `OpFence`: orders notifications after data. Each submitted operation holds a `FenceTicket`;
//! `wait_earlier` returns once every ticket issued before the call has been dropped (completed,
//! failed or cancelled). Backends use it so a notification is delivered after the ops before it.

use std::collections::BTreeSet;

use tokio::sync::Notify;

use crate::sync::{Mutex, lock};

#[derive(Debug, Default)]
struct FenceState {
    next: u64,
    pending: BTreeSet<u64>,
}

/// Tracks outstanding operations of one connection in submission order.
#[derive(Debug, Default)]
pub struct OpFence {
    state: Mutex<FenceState>,
    changed: Notify,
}

/// One outstanding operation; dropping it marks the operation done.
#[derive(Debug)]
pub struct FenceTicket {
    fence: std::sync::Arc<OpFence>,
    seq: u64,
}

impl Drop for FenceTicket {
    fn drop(&mut self) {
        lock(&self.fence.state).pending.remove(&self.seq);
        self.fence.changed.notify_waiters();
    }
}

impl OpFence {
    /// A fence with nothing outstanding.
    pub fn new() -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self::default())
    }

    /// Registers an operation submitted now.
    pub fn ticket(self: &std::sync::Arc<Self>) -> FenceTicket {
        let mut st = lock(&self.state);
        let seq = st.next;
        st.next += 1;
        st.pending.insert(seq);
        FenceTicket { fence: self.clone(), seq }
    }

    /// Number of operations outstanding.
    pub fn outstanding(&self) -> usize {
        lock(&self.state).pending.len()
    }

    /// Waits until every operation registered before this call is done. The horizon is taken when
    /// this is called, not when the future is first polled. Callers bound it with a timeout.
    pub fn wait_earlier(
        self: &std::sync::Arc<Self>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let horizon = lock(&self.state).next;
        let fence = self.clone();
        async move { fence.wait_until(horizon).await }
    }

    async fn wait_until(&self, horizon: u64) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let done = lock(&self.state).pending.first().is_none_or(|&s| s >= horizon);
            if done {
                return;
            }
            notified.await;
        }
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
        let wait = fence.wait_earlier();
        tokio::pin!(wait);
        let _later = fence.ticket();
        assert!((&mut wait).now_or_never().is_none(), "returned with an earlier op outstanding");
        drop(a);
        tokio::time::timeout(Duration::from_secs(5), wait).await.expect("fence wait hung");
        assert_eq!(fence.outstanding(), 1);
    }
}
