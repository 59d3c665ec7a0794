//! The engine as its backends see it: inbound access checks and inbound notifications. Holds the
//! engine weakly, so a backend never keeps a dropped engine alive.

use std::sync::{Arc, Weak};

use bytes::Bytes;
use tokio::sync::mpsc::error::TrySendError;

use super::chunked::ChunkSignal;
use super::{EngineShared, Handled, Notification, lock};
use crate::backend::{BackendHost, RemoteRange};
use crate::error::{Error, Missing, Result};
use crate::region::{Access, MemSlice};
use crate::wire::envelope::{Envelope, Message};

#[derive(Debug)]
pub(crate) struct HostAdapter {
    engine: Weak<EngineShared>,
}

impl HostAdapter {
    pub(crate) fn new(engine: &Arc<EngineShared>) -> Self {
        Self { engine: Arc::downgrade(engine) }
    }

    fn engine(&self) -> Result<Arc<EngineShared>> {
        let e = self.engine.upgrade().ok_or_else(|| Error::PeerClosed("engine dropped".into()))?;
        e.ensure_open()?;
        Ok(e)
    }
}

impl BackendHost for HostAdapter {
    fn bounce(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<crate::bounce::Bounce>> + Send>>
    {
        let engine = self.engine();
        Box::pin(async move {
            let engine = engine?;
            if engine.gpu.is_none() {
                return Err(Error::Unsupported {
                    backend: "engine",
                    what: "staging device memory: this engine has no GPU driver".into(),
                });
            }
            super::telemetry::bounced("serve");
            engine.staging().take().await
        })
    }

    fn cluster_secret(&self) -> Option<crate::auth::ClusterSecret> {
        self.engine.upgrade().and_then(|e| e.config.cluster_secret.clone())
    }

    fn resolve(&self, range: RemoteRange, access: Access) -> Result<MemSlice> {
        // A peer's access: its next one, and the answer's send, find a worker awake.
        crate::linger::arm();
        self.engine()?.regions.resolve(range, access)
    }

    fn deliver(&self, msg: Bytes) -> Result<()> {
        let engine = self.engine()?;
        let env = Envelope::decode(&msg)?;
        match env.msg {
            Message::User(payload) => {
                let n = Notification { from: env.from, payload };
                let handler = engine.notif_handler.get();
                match handler.map_or(Handled::Pass, |h| h(&n)) {
                    Handled::Pass => {}
                    Handled::Taken => return Ok(()),
                    Handled::Refused(e) => return Err(e),
                }
                let cap = engine.config.notification_queue as u64;
                engine.notif_tx.try_send(n).map_err(|e| match e {
                    TrySendError::Full(_) => Error::Capacity {
                        what: format!("notification queue of {}", engine.id),
                        requested: cap + 1,
                        limit: cap,
                    },
                    TrySendError::Closed(_) => Error::PeerClosed("receiver gone".into()),
                })
            }
            Message::ChunkLanded { transfer, index } => {
                signal(&engine, transfer, ChunkSignal::Landed { from: env.from, index })
            }
            Message::ChunkAbort { transfer, reason } => {
                signal(&engine, transfer, ChunkSignal::Aborted { from: env.from, reason })
            }
        }
    }
}

fn signal(engine: &EngineShared, transfer: u64, sig: ChunkSignal) -> Result<()> {
    let tx = lock(&engine.chunk_streams).get(&transfer).cloned();
    let tx = tx.ok_or(Error::NotFound(Missing::Transfer(transfer)))?;
    tx.try_send(sig).map_err(|e| match e {
        TrySendError::Full(_) => {
            Error::protocol(format!("chunked transfer {transfer:#x}: more signals than chunks"))
        }
        TrySendError::Closed(_) => Error::NotFound(Missing::Transfer(transfer)),
    })
}
