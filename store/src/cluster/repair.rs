//! Repair and rebalance of a [`ClusterStore`]: list every live node, plan with
//! [`super::plan::plan`], copy and delete. A copy carries the object's retention, lease (the
//! consumers still expected, the TTL left) and pins; it reads from a live holder into a staging
//! region of the client's engine and writes from there (node to node through the client, one
//! copy in flight per object).
//!
//! Run one repairer per cluster (a second one only duplicates work: a copy that exists already
//! is skipped, and deletions only ever drop copies outside a complete placement).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::StreamExt;
use tensorwire_core::Permissions;

use super::client::ClusterStore;
use super::member::Node;
use super::placement::NodeId;
use super::plan::{Action, Holding, plan};
use crate::api::ObjectInfo;
use crate::error::{Result, StoreError};
use crate::rpc::MAX_LIST;

/// Copies in flight at once.
const PARALLEL: usize = 4;

/// What one repair round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Nodes listed (live ones that answered).
    pub nodes: usize,
    /// Distinct objects found.
    pub objects: usize,
    /// Copies made, and their bytes.
    pub copied: usize,
    /// Bytes copied.
    pub bytes: u64,
    /// Copies removed from nodes outside their object's placement.
    pub deleted: usize,
    /// Copies or deletions that failed (tried again next round).
    pub failed: usize,
    /// Copies left for a later round (the byte budget).
    pub deferred: usize,
    /// Replicas whose consumer count was lowered to their object's lowest (one that missed a
    /// report, or a copy made just before one).
    pub recounted: usize,
}

impl RepairReport {
    /// Nothing was left to do: no copy, deletion, recount, failure or deferred copy.
    pub fn idle(&self) -> bool {
        self.copied + self.deleted + self.recounted + self.failed + self.deferred == 0
    }
}

/// Every object on `node`, page by page.
async fn list_all(store: &ClusterStore, node: &Arc<Node>) -> Result<Vec<ObjectInfo>> {
    let mut all: Vec<ObjectInfo> = Vec::new();
    loop {
        let after = all.last().map(|o| o.key.clone()).unwrap_or_default();
        let after = &after;
        let page = store.on(node, |m| async move { m.list(after, MAX_LIST).await }).await?;
        let more = page.len() == MAX_LIST;
        all.extend(page);
        if !more {
            return Ok(all);
        }
    }
}

/// The TTL to set again on a replica: what `o` has left (at least a millisecond: a zero TTL
/// would mean none).
fn ttl_left(o: &ObjectInfo) -> Option<Duration> {
    o.ttl_left.map(|t| t.max(Duration::from_millis(1)))
}

impl ClusterStore {
    /// One round: lists the live nodes, then copies (within the byte budget) and deletes what
    /// brings each object back to its replicas on its placement.
    pub async fn repair(&self) -> Result<RepairReport> {
        let live = self.live();
        let lists = futures::future::join_all(live.iter().map(|n| list_all(self, n))).await;
        let mut listed = BTreeSet::new();
        let mut objects: BTreeMap<Vec<u8>, Holding> = BTreeMap::new();
        let mut infos: BTreeMap<(Vec<u8>, NodeId), ObjectInfo> = BTreeMap::new();
        for (n, l) in live.iter().zip(lists) {
            let Ok(l) = l else { continue }; // unreachable: not live for this round
            listed.insert(n.id.clone());
            for o in l {
                let h = objects
                    .entry(o.key.clone())
                    .or_insert_with(|| Holding { len: o.len, on: BTreeSet::new() });
                h.on.insert(n.id.clone());
                infos.insert((o.key.clone(), n.id.clone()), o);
            }
        }
        let p = plan(&listed, &objects, self.cfg.replicas, self.cfg.repair_budget);
        let mut report = RepairReport {
            nodes: listed.len(),
            objects: objects.len(),
            deferred: p.deferred,
            ..RepairReport::default()
        };
        report.recounted = self.recount(&live, &infos).await;
        let steps = p.actions.into_iter().map(|a| self.step(a, &live, &infos));
        let results: Vec<Result<Option<u64>>> =
            futures::stream::iter(steps).buffered(PARALLEL).collect().await;
        for r in results {
            match r {
                Ok(Some(bytes)) => {
                    report.copied += 1;
                    report.bytes += bytes;
                }
                Ok(None) => report.deleted += 1,
                Err(_) => report.failed += 1,
            }
        }
        Ok(report)
    }

    /// Brings every replica's consumer count down to its object's lowest. Each replica counts
    /// the reports it received, so none is below the true count and the lowest is the closest;
    /// a higher one (a copy made while a report was on its way, a replica a report missed)
    /// would keep its copy alive after the object is done.
    async fn recount(
        &self,
        live: &[Arc<Node>],
        infos: &BTreeMap<(Vec<u8>, NodeId), ObjectInfo>,
    ) -> usize {
        let mut lowest: BTreeMap<&[u8], u32> = BTreeMap::new();
        for ((key, _), o) in infos.iter().filter(|(_, o)| o.consumers > 0) {
            let l = lowest.entry(key.as_slice()).or_insert(o.consumers);
            *l = (*l).min(o.consumers);
        }
        let mut n = 0;
        for ((key, id), o) in infos {
            let Some(&low) = lowest.get(key.as_slice()) else { continue };
            let Some(node) = live.iter().find(|x| x.id == *id) else { continue };
            if o.consumers > low {
                let ttl = ttl_left(o);
                let set = self.on(node, |m| async move { m.set_lease(key, low, ttl).await }).await;
                n += usize::from(set.is_ok());
            }
        }
        n
    }

    /// Carries out one action: a copy's bytes, or `None` for a deletion.
    async fn step(
        &self,
        a: Action,
        live: &[Arc<Node>],
        infos: &BTreeMap<(Vec<u8>, NodeId), ObjectInfo>,
    ) -> Result<Option<u64>> {
        let node = |id: &NodeId| {
            let n = live.iter().find(|n| n.id == *id).cloned();
            n.ok_or_else(|| StoreError::Internal(format!("planned node {id} is not listed")))
        };
        let r = match &a {
            Action::Copy { key, from, to, len } => {
                let info = infos.get(&(key.clone(), from.clone())).ok_or_else(|| {
                    StoreError::Internal("a planned copy from a node that does not hold it".into())
                });
                match info {
                    Ok(info) => {
                        self.copy(info, &node(from)?, &node(to)?).await.map(|()| Some(*len))
                    }
                    Err(e) => Err(e),
                }
            }
            Action::Delete { key, node: id } => {
                let n = node(id)?;
                self.on(&n, |m| async move { m.remove(key).await }).await.map(|_| None)
            }
        };
        if let Err(e) = &r {
            tracing::debug!(error = %e, action = ?a, "cluster store: repair step failed");
        }
        r
    }

    /// Copies one object (as `info` describes it on `from`) to `to`.
    async fn copy(&self, info: &ObjectInfo, from: &Arc<Node>, to: &Arc<Node>) -> Result<()> {
        let key = info.key.as_slice();
        let staging = self.engine.alloc(info.len.max(1), Permissions::NONE).await?;
        let dst = &staging;
        let (meta, len) = self.on(from, |m| async move { m.get_into(key, dst, 0).await }).await?;
        let src = staging.slice(0, len)?;
        let (meta, src) = (&meta, &src);
        let put =
            self.on(to, |m| async move { m.put_from(key, meta, src, info.retention).await }).await;
        match put {
            Ok(()) => {}
            Err(StoreError::Exists { .. }) => return Ok(()), // another copy got there first
            Err(e) => return Err(e),
        }
        let lease = async {
            if info.consumers > 0 || info.ttl_left.is_some() {
                let (c, ttl) = (info.consumers, ttl_left(info));
                self.on(to, |m| async move { m.set_lease(key, c, ttl).await }).await?;
            }
            for _ in 0..info.pins {
                self.on(to, |m| async move { m.pin(key).await }).await?;
            }
            // Consumed or removed while it was copied: the copy must not outlive it.
            if !self.on(from, |m| async move { m.exists(key).await }).await? {
                return Err(StoreError::not_found(key));
            }
            Ok(())
        };
        if let Err(e) = lease.await {
            let _ = self.on(to, |m| async move { m.remove(key).await }).await;
            return Err(e);
        }
        Ok(())
    }
}

/// How often the background repair runs.
#[derive(Debug, Clone)]
pub struct RepairConfig {
    /// Time between rounds (a round that found work runs the next one at once).
    pub every: Duration,
}

impl Default for RepairConfig {
    fn default() -> Self {
        RepairConfig { every: Duration::from_secs(1) }
    }
}

/// Runs repair rounds in the background until the store is dropped (or the task aborted);
/// each round's report goes to `seen` (a test or a demo counts them).
pub fn spawn_repair(
    store: &Arc<ClusterStore>,
    cfg: RepairConfig,
    seen: impl Fn(&RepairReport) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    let weak: Weak<ClusterStore> = Arc::downgrade(store);
    tokio::spawn(async move {
        loop {
            let Some(s) = weak.upgrade() else { return };
            let busy = match s.repair().await {
                Ok(r) => {
                    seen(&r);
                    r.copied + r.deleted + r.deferred > 0
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cluster store: repair round failed");
                    false
                }
            };
            drop(s);
            if !busy {
                tokio::time::sleep(cfg.every).await;
            }
        }
    })
}
