//! The producer's inbox: the connector's notifications from consumers (subscriptions, reports,
//! departures) dispatched to the publisher's state machine.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tensorwire_core::{Engine, Handled, Notification};
use tensorwire_store::Store;
use tokio::sync::mpsc;

use crate::control::Control;

use super::publish::act;
use super::state::{ConnectorConfig, DiffusionConnector, Inner, SWEEP};

/// The connector's notification handler: acts on each connector message as it arrives, on the
/// backend's task (no queue, no wake-up of another task), and answers a subscription with its
/// verdict: the subscriber's `notify` succeeds only if it is subscribed. Other notifications
/// go to the engine's queue, which the connector's loop drains.
pub(super) fn on_notification(inner: &Arc<Inner>, n: &Notification) -> Handled {
    let c = match Control::decode(&n.payload) {
        Ok(Some(c)) => c,
        Ok(None) => return Handled::Pass,
        Err(e) => {
            tracing::warn!(from = %n.from, error = %e, "connector: bad control message");
            return Handled::Refused(e);
        }
    };
    let mut out = Vec::new();
    let mut verdict = Handled::Taken;
    match c {
        Control::Subscribe { payload, hold_ms } => {
            let hold = Duration::from_millis(u64::from(hold_ms));
            let now = Instant::now();
            if !inner.publisher.lock().subscribe(n.from, payload, hold, now, &mut out) {
                verdict = refused(payload);
            }
        }
        Control::Done { payload, consumed } => {
            let now = Instant::now();
            if !inner.publisher.lock().done(n.from, payload, consumed, now, &mut out) {
                verdict = refused(payload);
            }
        }
        Control::Ready { payload, .. } | Control::Gone { payload, .. } => {
            let tx = inner.waiters.lock().get(&(n.from, payload)).cloned();
            if let Some(tx) = tx {
                if let Err(mpsc::error::TrySendError::Full(c)) = tx.try_send(Ok(c)) {
                    inner.rt.spawn(async move { tx.send(c).await });
                }
            }
        }
    }
    act(inner, out);
    verdict
}

/// The verdict on a message about a payload no longer served (a Gone message says why).
pub(super) fn refused(payload: u64) -> Handled {
    let why = format!("payload {payload} is not served here");
    Handled::Refused(tensorwire_core::Error::NotFound(tensorwire_core::Missing::Other(why)))
}

/// The connector's loop: ends expired leases and releases buffers whose holds ran out, and
/// drains notifications that are not the connector's.
pub(super) async fn dispatch(inner: Weak<Inner>) {
    let mut swept = Instant::now();
    loop {
        let Some(i) = inner.upgrade() else { return };
        if swept.elapsed() >= SWEEP {
            swept = Instant::now();
            let mut out = Vec::new();
            i.publisher.lock().sweep(swept, &mut out);
            act(&i, out);
        }
        match i.engine.recv_notification(SWEEP).await {
            Ok(n) => tracing::debug!(from = %n.from, "connector: not a connector message"),
            Err(tensorwire_core::Error::Timeout { .. }) => {}
            Err(_) => return, // engine shut down
        }
    }
}

impl DiffusionConnector {
    /// A connector over `engine` (and `store`, needed for store and auto modes).
    pub fn new(
        engine: Engine,
        store: Option<Arc<dyn Store>>,
        cfg: ConnectorConfig,
    ) -> DiffusionConnector {
        let inner = Arc::new(Inner {
            engine,
            store,
            cfg,
            publisher: Mutex::default(),
            waiters: Mutex::default(),
            rt: tokio::runtime::Handle::current(),
            turns: Mutex::default(),
            sessions: tokio::sync::Mutex::default(),
            next: AtomicU64::new(1),
        });
        let weak = Arc::downgrade(&inner);
        inner.engine.set_notification_handler(Some(Arc::new(move |n: &Notification| {
            match weak.upgrade() {
                Some(inner) => on_notification(&inner, n),
                None => Handled::Pass,
            }
        })));
        let dispatcher = tokio::spawn(dispatch(Arc::downgrade(&inner)));
        DiffusionConnector { inner, dispatcher }
    }
}
