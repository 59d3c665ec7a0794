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

/// One consume's or release's turn at a payload; ends when dropped (and the turn before it
/// has ended: a turn dropped before it waited, a consume aborted early, still comes after the
/// one before).
pub(super) struct Turn {
    end: Option<End>,
    /// The turn before, until waited for.
    before: Option<watch::Receiver<bool>>,
}

/// What ending a turn takes.
struct End {
    inner: Arc<Inner>,
    key: (EngineId, u64),
    /// Says the turn ended (true) to the turn after it.
    ended: watch::Sender<bool>,
    /// This turn's entry in `Inner::turns`, to recognise it there.
    mine: watch::Receiver<bool>,
}

impl End {
    fn now(self) {
        self.ended.send_replace(true);
        let mut r = self.inner.turns.lock();
        // A later turn may have taken the entry since: it is that one's now.
        if r.get(&self.key).is_some_and(|e| e.same_channel(&self.mine)) {
            r.remove(&self.key);
        }
    }
}

/// Waits (at most `wait`) for a turn to end.
async fn ended(mut turn: watch::Receiver<bool>, wait: Duration) {
    // Err: that turn's owner is gone without saying; it has ended all the same.
    let _ = tokio::time::timeout(wait, turn.wait_for(|ended| *ended)).await;
}

impl Turn {
    /// Takes the next turn at `payload` of `producer`: the one a later consume or release waits
    /// for.
    pub(super) fn take(inner: &Arc<Inner>, producer: EngineId, payload: u64) -> Turn {
        let key = (producer, payload);
        let (ended, mine) = watch::channel(false);
        let before = inner.turns.lock().insert(key, mine.clone());
        Turn { end: Some(End { inner: inner.clone(), key, ended, mine }), before }
    }

    /// Waits (at most the connector's wait bound) for the turn before this one to end. Until
    /// it has, the turn keeps `before` (a wait cut short leaves it for `drop` to wait on).
    pub(super) async fn wait_before(&mut self) {
        let Some(end) = &self.end else { return };
        if let Some(before) = self.before.clone() {
            ended(before, end.inner.cfg.wait_timeout).await;
            self.before = None;
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let Some(end) = self.end.take() else { return };
        match self.before.take() {
            None => end.now(),
            Some(before) => {
                let (rt, wait) = (end.inner.rt.clone(), end.inner.cfg.wait_timeout);
                rt.spawn(async move {
                    ended(before, wait).await;
                    end.now();
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConnectorConfig, DiffusionConnector};
    use tensorwire_core::Engine;
    use tensorwire_tcp::{TcpBackend, TcpConfig};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_turn_dropped_before_its_wait_still_comes_after_the_one_before() {
        let engine = Engine::builder()
            .backend(TcpBackend::new(TcpConfig::default()).unwrap())
            .start()
            .await
            .unwrap();
        let c = DiffusionConnector::new(engine, None, ConnectorConfig::default());
        let (inner, producer) = (&c.inner, c.engine().id());
        let first = Turn::take(inner, producer, 7);
        let dropped = Turn::take(inner, producer, 7);
        let mut third = Turn::take(inner, producer, 7);
        drop(dropped); // never waited: an aborted consume's
        let waiting = tokio::spawn(async move {
            third.wait_before().await;
            third
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "the third turn went before the first ended");
        drop(first);
        let third = tokio::time::timeout(Duration::from_secs(10), waiting).await.unwrap().unwrap();
        drop(third);
        // Every turn ended: the payload's entry is gone.
        tokio::time::timeout(Duration::from_secs(10), async {
            while inner.turns.lock().contains_key(&(producer, 7)) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap();
    }
}
