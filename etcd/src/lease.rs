//! A lease kept alive in the background: granted with a TTL, refreshed every third of it. When
//! a refresh fails or the server says the lease is gone, [`Lease::lost`] resolves; dropping the
//! lease stops the refreshes and revokes it (so its keys go at once, not after the TTL).

use std::time::Duration;

use etcd_client::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::err;

/// A live lease.
pub(crate) struct Lease {
    id: i64,
    client: Client,
    keeper: JoinHandle<()>,
    alive: watch::Receiver<bool>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("id", &self.id).finish()
    }
}

impl Lease {
    /// Grants a lease of `ttl` and starts keeping it alive.
    pub(crate) async fn grant(client: &Client, ttl: Duration) -> tensorwire_core::Result<Lease> {
        let mut c = client.clone();
        let secs = ttl.as_secs().max(1) as i64;
        let id = c.lease_grant(secs, None).await.map_err(|e| err("lease grant", e))?.id();
        let (mut keeper, mut stream) =
            c.lease_keep_alive(id).await.map_err(|e| err("lease keep-alive", e))?;
        let (tx, alive) = watch::channel(true);
        let every = Duration::from_millis((secs as u64 * 1000 / 3).max(200));
        let keeper = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let ok = keeper.keep_alive().await.is_ok()
                    && matches!(stream.message().await, Ok(Some(r)) if r.ttl() > 0);
                if !ok {
                    tracing::warn!(lease = id, "etcd: lease lost");
                    let _ = tx.send(false);
                    return;
                }
            }
        });
        Ok(Lease { id, client: c, keeper, alive })
    }

    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// Resolves once the lease is lost.
    pub(crate) async fn lost(&self) {
        let mut a = self.alive.clone();
        let _ = a.wait_for(|alive| !alive).await;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.keeper.abort();
        let (mut c, id) = (self.client.clone(), self.id);
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(async move {
                let _ = c.lease_revoke(id).await;
            });
        }
    }
}
