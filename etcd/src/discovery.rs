//! Discovery in etcd: `/tensorwire/<cluster>/reg/<kind>/<id>` holds an entry's address and meta,
//! attached to a lease of its registration.

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, EventType, GetOptions, PutOptions, WatchOptions};
use tensorwire_core::Result;
use tensorwire_proto::discovery::{Change, Discovery, Entry, Registration};
use tokio::sync::mpsc;

use crate::lease::Lease;
use crate::{cluster_prefix, err};

/// The registry of one cluster in etcd.
#[derive(Clone)]
pub struct EtcdDiscovery {
    client: Client,
    prefix: String,
    ttl: Duration,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("prefix", &self.prefix)
            .field("ttl", &self.ttl)
            .finish()
    }
}

#[derive(Debug)]
struct Registered {
    _lease: Lease,
}
impl Registration for Registered {}

impl EtcdDiscovery {
    /// The registry of `cluster`; registrations live on leases of `ttl` (an entry outlives its
    /// dead process by at most that).
    pub fn new(client: Client, cluster: &str, ttl: Duration) -> EtcdDiscovery {
        EtcdDiscovery { client, prefix: format!("{}reg/", cluster_prefix(cluster)), ttl }
    }

    fn kind_prefix(&self, kind: &str) -> String {
        format!("{}{kind}/", self.prefix)
    }

    /// The entry stored under `key`, if it is one.
    fn entry(&self, key: &[u8], value: &[u8]) -> Option<Entry> {
        let rest = std::str::from_utf8(key).ok()?.strip_prefix(&self.prefix)?;
        let (kind, id) = rest.split_once('/')?;
        match Entry::decode_value(kind, id, value) {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::warn!(key = rest, error = %e, "etcd discovery: ignoring a bad entry");
                None
            }
        }
    }
}

#[async_trait]
impl Discovery for EtcdDiscovery {
    async fn register(&self, e: Entry) -> Result<Box<dyn Registration>> {
        e.check()?;
        let lease = Lease::grant(&self.client, self.ttl).await?;
        let key = format!("{}{}", self.kind_prefix(&e.kind), e.id);
        let opts = PutOptions::new().with_lease(lease.id());
        self.client
            .clone()
            .put(key, e.encode_value(), Some(opts))
            .await
            .map_err(|x| err("put", x))?;
        Ok(Box::new(Registered { _lease: lease }))
    }

    async fn list(&self, kind: &str) -> Result<Vec<Entry>> {
        let r = self
            .client
            .clone()
            .get(self.kind_prefix(kind), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| err("get", e))?;
        Ok(r.kvs().iter().filter_map(|kv| self.entry(kv.key(), kv.value())).collect())
    }

    async fn watch(&self, kind: &str) -> Result<mpsc::Receiver<Change>> {
        let prefix = self.kind_prefix(kind);
        let mut c = self.client.clone();
        let now = c.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await;
        let now = now.map_err(|e| err("get", e))?;
        let rev = now.header().map_or(0, |h| h.revision());
        let opts = WatchOptions::new().with_prefix().with_start_revision(rev + 1);
        let mut stream = c.watch(prefix, Some(opts)).await.map_err(|e| err("watch", e))?;
        let (tx, rx) = mpsc::channel(256);
        for kv in now.kvs() {
            if let Some(e) = self.entry(kv.key(), kv.value()) {
                let _ = tx.send(Change::Joined(e)).await;
            }
        }
        let me = self.clone();
        tokio::spawn(async move {
            while let Ok(Some(resp)) = stream.message().await {
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let change = match ev.event_type() {
                        EventType::Put => me.entry(kv.key(), kv.value()).map(Change::Joined),
                        EventType::Delete => {
                            let rest = std::str::from_utf8(kv.key())
                                .ok()
                                .and_then(|k| k.strip_prefix(&me.prefix))
                                .and_then(|r| r.split_once('/'));
                            rest.map(|(k, i)| Change::Left { kind: k.into(), id: i.into() })
                        }
                    };
                    if let Some(c) = change {
                        if tx.send(c).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Ok(rx)
    }
}
