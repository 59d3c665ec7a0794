//! `TaskSet`: the background tasks a component owns (an accept loop, one task per served
//! connection). Each task removes itself when it ends, so the set stays bounded by what is
//! running; `abort_all` stops the rest at shutdown.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::task::AbortHandle;

use crate::sync::lock;

/// Tasks owned by one component.
#[derive(Debug, Default)]
pub struct TaskSet {
    next: AtomicU64,
    tasks: Mutex<HashMap<u64, AbortHandle>>,
}

impl TaskSet {
    /// An empty set.
    pub fn new() -> Arc<TaskSet> {
        Arc::default()
    }

    /// Spawns `fut` on the current runtime as a member of the set.
    pub fn spawn(self: &Arc<Self>, fut: impl Future<Output = ()> + Send + 'static) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let me = Arc::downgrade(self);
        // Held across the spawn so the task cannot remove itself before it is inserted.
        let mut tasks = lock(&self.tasks);
        let h = tokio::spawn(async move {
            fut.await;
            if let Some(me) = me.upgrade() {
                lock(&me.tasks).remove(&id);
            }
        });
        if !h.is_finished() {
            tasks.insert(id, h.abort_handle());
        }
    }

    /// Tasks still running.
    pub fn len(&self) -> usize {
        lock(&self.tasks).len()
    }

    /// Whether none is running.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Aborts every task in the set.
    pub fn abort_all(&self) {
        let tasks: Vec<AbortHandle> = lock(&self.tasks).drain().map(|(_, h)| h).collect();
        tasks.iter().for_each(AbortHandle::abort);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn finished_tasks_leave_and_abort_stops_the_rest() {
        let set = TaskSet::new();
        set.spawn(async {});
        set.spawn(async { tokio::time::sleep(Duration::from_secs(3600)).await });
        for _ in 0..100 {
            if set.len() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(set.len(), 1);
        set.abort_all();
        assert!(set.is_empty());
    }
}
