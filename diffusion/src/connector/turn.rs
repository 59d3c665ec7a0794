//! Turns: the consumes and releases of one p2p payload in one connector go one after another,
//! each after the previous one's report has left.
//!
//! A consume's subscription and its report (`Done`) are keyed at the producer by (consumer
//! engine, payload), so two of them overlapping from one connector would mix: a consume
//! dropped before its end (its task aborted, its report sent in the background) and a retry
//! started right after it could see the retry's subscription ended by the first one's report.
//! A turn is taken when the consume is asked for (in the caller's call, before any task
//! runs), waits for the turn before it, and ends when its report has been sent, or when it
//! ends without owing one.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::EngineId;
use tokio::sync::watch;

use super::state::Inner;

/// One consume's or release's turn at a payload; ends when dropped.
pub(super) struct Turn {
    inner: Arc<Inner>,
    key: (EngineId, u64),
    /// Says the turn ended (true) to the turn after it.
    ended: watch::Sender<bool>,
    /// This turn's entry in `Inner::reporting`, to recognise it there.
    mine: watch::Receiver<bool>,
    /// The turn before, until waited for.
    before: Option<watch::Receiver<bool>>,
}

impl Turn {
    /// Takes the next turn at `payload` of `producer`: the one a later consume or release waits
    /// for.
    pub(super) fn take(inner: &Arc<Inner>, producer: EngineId, payload: u64) -> Turn {
        let key = (producer, payload);
        let (ended, mine) = watch::channel(false);
        let before = inner.reporting.lock().insert(key, mine.clone());
        Turn { inner: inner.clone(), key, ended, mine, before }
    }

    /// Waits (at most `wait`) for the turn before this one to end.
    pub(super) async fn wait_before(&mut self, wait: Duration) {
        if let Some(mut before) = self.before.take() {
            // Err: that turn's owner is gone without saying; it has ended all the same.
            let _ = tokio::time::timeout(wait, before.wait_for(|ended| *ended)).await;
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.ended.send_replace(true);
        let mut r = self.inner.reporting.lock();
        // A later turn may have taken the entry since: it is that one's now.
        if r.get(&self.key).is_some_and(|e| e.same_channel(&self.mine)) {
            r.remove(&self.key);
        }
    }
}
