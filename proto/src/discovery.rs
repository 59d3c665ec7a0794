//! Discovery: how the processes of a cluster (engines, store nodes, the orchestrator) find each
//! other. [`StaticDiscovery`] is today's behaviour and the default: a fixed list of addresses, the
//! peer-to-peer handshake doing the rest. A shared registry (the `tensorwire-etcd` crate) keeps
//! entries under a lease, so an entry vanishes when its process dies, and watchers see joins and
//! departures.
//!
//! What an entry publishes is what a peer needs to dial: a kind, an id, an address and an opaque,
//! bounded `meta` blob (e.g. a data endpoint). Never a region key or a secret: those travel only
//! in the authenticated handshake.

use std::net::SocketAddr;

use async_trait::async_trait;
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::wire::codec::{Reader, Writer};

/// Longest kind or id.
pub const MAX_NAME: usize = 128;
/// Largest `meta` blob.
pub const MAX_META: usize = 4096;
const MAGIC: &[u8; 3] = b"TD1";

/// One process (or one of its services) in the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// What it is, e.g. "engine", "store", "orchestrator".
    pub kind: String,
    /// Unique within its kind (e.g. the engine id).
    pub id: String,
    /// Where to dial it.
    pub addr: SocketAddr,
    /// Anything else a peer needs to dial it (bounded by [`MAX_META`]); never a secret.
    pub meta: Vec<u8>,
}

impl Entry {
    /// Checks the bounds a registry relies on.
    pub fn check(&self) -> Result<()> {
        let name_ok = |s: &str| !s.is_empty() && s.len() <= MAX_NAME && !s.contains('/');
        if !name_ok(&self.kind) || !name_ok(&self.id) {
            return Err(Error::InvalidArgument(format!(
                "discovery entry {}/{}: kind and id must be 1 to {MAX_NAME} bytes without '/'",
                self.kind, self.id
            )));
        }
        if self.meta.len() > MAX_META {
            return Err(Error::InvalidArgument(format!(
                "discovery entry {}/{}: meta of {} bytes; at most {MAX_META}",
                self.kind,
                self.id,
                self.meta.len()
            )));
        }
        Ok(())
    }

    /// The stored value: the address and `meta` (kind and id are the key's).
    pub fn encode_value(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.raw(MAGIC).str(&self.addr.to_string()).bytes(&self.meta[..self.meta.len().min(MAX_META)]);
        w.finish()
    }

    /// An entry from its kind, id and stored value. Never panics.
    pub fn decode_value(kind: &str, id: &str, v: &[u8]) -> Result<Entry> {
        let mut r = Reader::new(v, "discovery entry");
        if r.raw(MAGIC.len())? != MAGIC {
            return Err(Error::protocol("discovery entry: bad magic"));
        }
        let addr = r.str(64, "address")?;
        let addr = addr
            .parse()
            .map_err(|_| Error::protocol(format!("discovery entry: bad address {addr:?}")))?;
        let meta = r.bytes(MAX_META, "meta")?.to_vec();
        r.finish()?;
        let e = Entry { kind: kind.into(), id: id.into(), addr, meta };
        e.check()?;
        Ok(e)
    }
}

/// A change a watcher sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// An entry appeared (or was replaced).
    Joined(Entry),
    /// An entry went away (its process stopped or died and its lease ran out).
    Left {
        /// Its kind.
        kind: String,
        /// Its id.
        id: String,
    },
}

/// Keeps an entry registered while it lives; dropping it takes the entry out.
pub trait Registration: Send + Sync + std::fmt::Debug {}

/// A registry of the cluster's processes.
#[async_trait]
pub trait Discovery: Send + Sync + std::fmt::Debug {
    /// Publishes `e` for as long as the returned registration lives (and this process does).
    async fn register(&self, e: Entry) -> Result<Box<dyn Registration>>;
    /// Every entry of `kind` now.
    async fn list(&self, kind: &str) -> Result<Vec<Entry>>;
    /// The entries of `kind` now (as `Joined`), then every change, until the receiver drops.
    async fn watch(&self, kind: &str) -> Result<mpsc::Receiver<Change>>;
}

/// A fixed list of entries (the default: addresses given on the command line or in config).
/// Registering is accepted and publishes nothing; watchers see the list and no change.
#[derive(Debug, Clone, Default)]
pub struct StaticDiscovery {
    entries: Vec<Entry>,
}

#[derive(Debug)]
struct Nothing;
impl Registration for Nothing {}

impl StaticDiscovery {
    /// A registry that always answers `entries`.
    pub fn new(entries: Vec<Entry>) -> StaticDiscovery {
        StaticDiscovery { entries }
    }
}

#[async_trait]
impl Discovery for StaticDiscovery {
    async fn register(&self, e: Entry) -> Result<Box<dyn Registration>> {
        e.check()?;
        Ok(Box::new(Nothing))
    }

    async fn list(&self, kind: &str) -> Result<Vec<Entry>> {
        Ok(self.entries.iter().filter(|e| e.kind == kind).cloned().collect())
    }

    async fn watch(&self, kind: &str) -> Result<mpsc::Receiver<Change>> {
        let now = self.list(kind).await?;
        let (tx, rx) = mpsc::channel(now.len().max(1));
        for e in now {
            let _ = tx.try_send(Change::Joined(e));
        }
        // The sender stays open (a static list never changes) until the receiver drops.
        tokio::spawn(async move { tx.closed().await });
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[tokio::test]
    async fn static_discovery_lists_and_watches_its_entries() {
        let e = Entry {
            kind: "store".into(),
            id: "a".into(),
            addr: ([127, 0, 0, 1], 7100).into(),
            meta: vec![1],
        };
        let d = StaticDiscovery::new(vec![e.clone()]);
        assert_eq!(d.list("store").await.unwrap(), vec![e.clone()]);
        assert!(d.list("engine").await.unwrap().is_empty());
        let mut w = d.watch("store").await.unwrap();
        assert_eq!(w.recv().await, Some(Change::Joined(e.clone())));
        let bad = Entry { id: "a/b".into(), ..e.clone() };
        assert!(d.register(bad).await.is_err(), "a '/' in an id is refused");
        let v = e.encode_value();
        assert_eq!(Entry::decode_value("store", "a", &v).unwrap(), e);
    }

    proptest! {
        #[test]
        fn value_decoder_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Entry::decode_value("k", "i", &bytes);
        }
    }
}
