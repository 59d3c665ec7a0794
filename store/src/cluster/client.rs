//! [`ClusterStore`]: the [`Store`] API over several store nodes. Each object goes to the first
//! `replicas` live nodes of its rendezvous order (the next ones when a node fails), is read
//! from the first replica that answers (this host's first), and carries its lease, pins and
//! TTL on every replica.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::future::join_all;
use parking_lot::RwLock;
use tensorwire_core::{Engine, MemSlice, Region, TensorMeta};
use tensorwire_proto::discovery::Discovery;

use super::member::{Dial, Member, Node, node_failed};
use super::placement::{NodeId, rank};
use crate::api::{Retention, Store, StoreStats, check_key, check_meta, put_staged};
use crate::error::{Result, StoreError, StoreKey};

/// How a [`ClusterStore`] places and reaches objects.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Copies of each object (Mooncake's `ReplicateConfig.replica_num`); a put may ask for
    /// another count with [`ClusterStore::put_replicated`].
    pub replicas: usize,
    /// Copies a put must have written to succeed; `None`: all of them, or as many as there
    /// are nodes thought alive when fewer (the repair makes the rest once nodes come back).
    pub write_quorum: Option<usize>,
    /// Bound on dialling a node.
    pub dial_timeout: Duration,
    /// A node that could not be dialled is left out of placement this long.
    pub down_for: Duration,
    /// A read tries no further replica once this long has passed since it began (each try is
    /// bounded by the engine's transfer timeout; a try under way is never abandoned, since it
    /// may still write into the caller's region).
    pub read_deadline: Duration,
    /// Bytes one repair round may copy (the repair's bandwidth is this per
    /// [`super::RepairConfig::every`]).
    pub repair_budget: u64,
    /// A put that finds no node to write (every one thought down, or each failed as it was
    /// tried) tries again, as nodes come back, for this long before it fails: nodes that
    /// restart (a chaos test, a rolling restart) are back in a second or two, and a put that
    /// waits for them beats one that fails.
    pub wait_for_node: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            replicas: 2,
            write_quorum: None,
            dial_timeout: Duration::from_secs(5),
            down_for: Duration::from_secs(1),
            read_deadline: Duration::from_secs(60),
            repair_budget: 256 << 20,
            wait_for_node: Duration::from_secs(5),
        }
    }
}

/// A store spread over store nodes, with replicas. See the module documentation.
#[derive(Debug)]
pub struct ClusterStore {
    pub(crate) engine: Engine,
    pub(crate) dial: Arc<dyn Dial>,
    pub(crate) cfg: ClusterConfig,
    /// Shared with the views [`ClusterStore::with_replicas`] makes.
    nodes: Arc<RwLock<Vec<Arc<Node>>>>,
}

/// What became of one replica's call.
type Answer<T> = (Arc<Node>, Result<T>);

impl ClusterStore {
    /// A cluster store over `nodes`, reached through `dial`; staging buffers (for `put` and
    /// `get` of plain bytes, and repair copies) come from `engine`.
    pub fn new(
        engine: &Engine,
        dial: Arc<dyn Dial>,
        nodes: impl IntoIterator<Item = NodeId>,
        cfg: ClusterConfig,
    ) -> Result<ClusterStore> {
        if cfg.replicas == 0 || cfg.write_quorum.is_some_and(|q| q == 0 || q > cfg.replicas) {
            return Err(StoreError::InvalidArgument(format!(
                "cluster store: replicas {} and write quorum {:?} (need 1 <= quorum <= replicas)",
                cfg.replicas, cfg.write_quorum
            )));
        }
        let s = ClusterStore { engine: engine.clone(), dial, cfg, nodes: Arc::default() };
        s.set_nodes(nodes);
        Ok(s)
    }

    /// Store nodes at these RPC addresses, dialled from `engine` (a node's id is its address).
    pub fn remote(
        engine: &Engine,
        nodes: &[std::net::SocketAddr],
        cfg: ClusterConfig,
    ) -> Result<ClusterStore> {
        let dial = Arc::new(super::member::RemoteDial { engine: engine.clone() });
        ClusterStore::new(engine, dial, nodes.iter().map(|a| a.to_string()), cfg)
    }

    /// The same store (the same nodes, connections and membership) whose puts make `replicas`
    /// copies: Mooncake's per-put `ReplicateConfig.replica_num`, for callers that take the
    /// [`Store`] trait.
    pub fn with_replicas(&self, replicas: usize) -> Result<ClusterStore> {
        let quorum = self.cfg.write_quorum.map(|q| q.min(replicas));
        let cfg = ClusterConfig { replicas, write_quorum: quorum, ..self.cfg.clone() };
        if replicas == 0 {
            return Err(StoreError::InvalidArgument("a cluster store with 0 replicas".into()));
        }
        Ok(ClusterStore {
            engine: self.engine.clone(),
            dial: self.dial.clone(),
            cfg,
            nodes: self.nodes.clone(),
        })
    }

    /// Replaces the membership (nodes already known keep their connection).
    pub fn set_nodes(&self, ids: impl IntoIterator<Item = NodeId>) {
        let ids: BTreeSet<NodeId> = ids.into_iter().collect();
        let mut nodes = self.nodes.write();
        let mut next: Vec<Arc<Node>> =
            nodes.iter().filter(|n| ids.contains(&n.id)).cloned().collect();
        for id in ids {
            if !next.iter().any(|n| n.id == id) {
                next.push(Arc::new(Node::new(id)));
            }
        }
        *nodes = next;
    }

    /// Follows the store nodes registered in `discovery` (entries of kind "store", a node's id
    /// being its RPC address): the membership is read now and then every `every`, until the
    /// store is dropped. A registry that cannot be read keeps the last membership.
    pub async fn follow(
        self: &Arc<Self>,
        discovery: Arc<dyn Discovery>,
        every: Duration,
    ) -> Result<tokio::task::JoinHandle<()>> {
        let read = |d: Arc<dyn Discovery>| async move {
            let entries = d.list("store").await?;
            Ok::<_, StoreError>(entries.into_iter().map(|e| e.addr.to_string()).collect::<Vec<_>>())
        };
        self.set_nodes(read(discovery.clone()).await?);
        let weak = Arc::downgrade(self);
        Ok(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let listed = read(discovery.clone()).await;
                let Some(s) = weak.upgrade() else { return };
                match listed {
                    Ok(ids) => s.set_nodes(ids),
                    Err(e) => tracing::warn!(error = %e, "cluster store: reading the registry"),
                }
            }
        }))
    }

    /// The members now.
    pub fn nodes(&self) -> Vec<NodeId> {
        self.nodes.read().iter().map(|n| n.id.clone()).collect()
    }

    /// The copies a put makes by default.
    pub fn replicas(&self) -> usize {
        self.cfg.replicas
    }

    /// Members thought alive, in `key`'s order.
    pub(crate) fn ranked(&self, key: &[u8]) -> Vec<Arc<Node>> {
        let nodes = self.nodes.read();
        let up: Vec<&Arc<Node>> = nodes.iter().filter(|n| n.up()).collect();
        let order = rank(key, up.iter().map(|n| &n.id));
        order
            .into_iter()
            .filter_map(|id| up.iter().find(|n| n.id == *id).map(|n| (*n).clone()))
            .collect()
    }

    /// Members thought alive.
    pub(crate) fn live(&self) -> Vec<Arc<Node>> {
        self.nodes.read().iter().filter(|n| n.up()).cloned().collect()
    }

    /// `key`'s replicas as reads try them: its first `replicas` nodes, this host's first, then
    /// every other live node (an object put while a node was down sits further along), then the
    /// nodes thought down (one may be back, or was marked down for a slow answer, and hold it).
    fn read_order(&self, key: &[u8]) -> Vec<Arc<Node>> {
        let mut order = self.ranked(key);
        let n = order.len().min(self.cfg.replicas);
        order[..n].sort_by_key(|node| !self.dial.local(&node.id));
        let down: Vec<Arc<Node>> = self.nodes.read().iter().filter(|n| !n.up()).cloned().collect();
        order.extend(down);
        order
    }

    /// Runs `f` on `node`'s client. A node failure drops the connection; when the connection
    /// was an old one (its node may have restarted since), `f` runs once more on a new one.
    pub(crate) async fn on<T, F, Fut>(&self, node: &Arc<Node>, f: F) -> Result<T>
    where
        F: Fn(Arc<dyn Member>) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let (dial, cfg) = (&*self.dial, &self.cfg);
        let (m, fresh) = node.client(dial, cfg.dial_timeout, cfg.down_for).await?;
        let r = f(m.clone()).await;
        let e = match r {
            Err(e) if node_failed(&e) => e,
            r => return r,
        };
        node.failed(&m, &e).await;
        if fresh {
            return Err(e);
        }
        let (m, _) = node.client(dial, cfg.dial_timeout, cfg.down_for).await?;
        let r = f(m.clone()).await;
        if let Err(e) = &r {
            node.failed(&m, e).await;
        }
        r
    }

    /// Runs `f` on every live node at once.
    async fn everywhere<T, F, Fut>(&self, f: F) -> Vec<Answer<T>>
    where
        F: Fn(Arc<dyn Member>) -> Fut + Copy,
        Fut: Future<Output = Result<T>>,
    {
        let live = self.live();
        join_all(live.into_iter().map(|n| async move {
            let r = self.on(&n, f).await;
            (n, r)
        }))
        .await
    }

    /// Tries `key`'s replicas in read order until one has it: the first answer that is not
    /// "not found" and not a node failure ends it.
    async fn first<T, F, Fut>(&self, key: &[u8], f: F) -> Result<T>
    where
        F: Fn(Arc<dyn Member>) -> Fut + Copy,
        Fut: Future<Output = Result<T>>,
    {
        let mut failure = None;
        let mut missing = false;
        let began = tokio::time::Instant::now();
        for n in self.read_order(key) {
            if began.elapsed() >= self.cfg.read_deadline {
                let what = format!("reading {} from its replicas", StoreKey(key.to_vec()));
                failure =
                    Some(tensorwire_core::Error::timeout(what, self.cfg.read_deadline).into());
                missing = false;
                break;
            }
            match self.on(&n, f).await {
                Ok(t) => return Ok(t),
                Err(StoreError::NotFound { .. }) => missing = true,
                Err(e) if node_failed(&e) => failure = Some(e),
                Err(e) => return Err(e),
            }
        }
        match failure {
            Some(e) if !missing => Err(e),
            _ => Err(StoreError::not_found(key)),
        }
    }

    /// `put_from` with `replicas` copies (instead of the configured count).
    pub async fn put_replicated(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        src: &MemSlice,
        r: Retention,
        replicas: usize,
    ) -> Result<()> {
        check_key(key)?;
        check_meta(meta, src.len())?;
        if replicas == 0 {
            return Err(StoreError::InvalidArgument("a put with 0 replicas".into()));
        }
        let until = Instant::now() + self.cfg.wait_for_node;
        loop {
            let res = self.put_once(key, meta, src, r, replicas).await;
            match res {
                // Too few copies because nodes failed or none was thought alive (the copies
                // written were undone): wait for nodes to be back (a down mark ends after
                // `down_for`) and try again, while time is left.
                Err(e) if (node_failed(&e) || self.live().is_empty()) && Instant::now() < until => {
                    let wait = self.cfg.down_for.min(Duration::from_millis(100));
                    tracing::debug!(error = %e, "cluster store: no node took the put; trying again");
                    tokio::time::sleep(wait).await;
                }
                res => return res,
            }
        }
    }

    /// One try of [`ClusterStore::put_replicated`]: the placement's nodes, falling over to the
    /// next ones, until `replicas` copies or none left.
    async fn put_once(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        src: &MemSlice,
        r: Retention,
        replicas: usize,
    ) -> Result<()> {
        let order = self.ranked(key);
        let mut next = order.into_iter();
        let mut written: Vec<Arc<Node>> = Vec::new();
        let mut last: Option<StoreError> = None;
        let mut want = replicas;
        loop {
            let batch: Vec<Arc<Node>> = next.by_ref().take(want).collect();
            if batch.is_empty() {
                break;
            }
            let puts = batch.into_iter().map(|n| async move {
                let r = self.on(&n, |m| async move { m.put_from(key, meta, src, r).await }).await;
                (n, r)
            });
            // Every answer of the batch first: a copy written beside a refusal (the key exists
            // on another node, say) must be undone with the others.
            let mut refused = None;
            for (n, res) in join_all(puts).await {
                match res {
                    Ok(()) => written.push(n),
                    Err(e) if node_failed(&e) || matches!(e, StoreError::Capacity { .. }) => {
                        last = Some(e)
                    }
                    Err(e) => refused = Some(e),
                }
            }
            if let Some(e) = refused {
                self.undo(key, &written).await;
                return Err(e);
            }
            want = replicas - written.len();
            if want == 0 {
                break;
            }
        }
        // Without a set quorum: every replica the nodes still thought alive can hold (a node
        // that failed during this put is out of placement for a while; the repair adds the
        // missing copies once it is back).
        let quorum = match self.cfg.write_quorum {
            Some(q) => q.min(replicas),
            None => replicas.min(self.live().len()).max(1),
        };
        if written.len() >= quorum {
            return Ok(());
        }
        self.undo(key, &written).await;
        Err(last.unwrap_or_else(|| StoreError::Capacity {
            what: "cluster store: live store nodes".into(),
            requested: quorum as u64,
            limit: written.len() as u64,
        }))
    }

    /// Removes `key` from the nodes thought down, in the background: such a node may be back
    /// already (it is left out of placement a while after a failed dial) and hold a copy the
    /// repair made meanwhile, which would otherwise outlive the object.
    fn sweep(&self, key: &[u8]) {
        let down: Vec<Arc<Node>> = self.nodes.read().iter().filter(|n| !n.up()).cloned().collect();
        if down.is_empty() {
            return;
        }
        let (dial, cfg, key) = (self.dial.clone(), self.cfg.clone(), key.to_vec());
        tokio::spawn(async move {
            for n in down {
                if let Ok((m, _)) = n.client(&*dial, cfg.dial_timeout, cfg.down_for).await {
                    if let Err(e) = m.remove(&key).await {
                        n.failed(&m, &e).await;
                    }
                }
            }
        });
    }

    /// Removes the copies a failed put wrote.
    async fn undo(&self, key: &[u8], written: &[Arc<Node>]) {
        join_all(written.iter().map(|n| self.on(n, |m| async move { m.remove(key).await }))).await;
    }

    /// Counters of every live node, one entry each (a node that failed to answer is left out).
    pub async fn node_stats(&self) -> Vec<(NodeId, StoreStats)> {
        let all = self.everywhere(|m| async move { m.stats().await }).await;
        all.into_iter().filter_map(|(n, r)| r.ok().map(|s| (n.id.clone(), s))).collect()
    }
}

/// The combined answer of a call made on every node for one key: `Ok` values, and whether
/// any node had the key at all.
fn merge<T>(key: &[u8], all: Vec<Answer<T>>) -> Result<Vec<T>> {
    let mut oks = Vec::new();
    let mut failure = None;
    for (_, r) in all {
        match r {
            Ok(t) => oks.push(t),
            Err(StoreError::NotFound { .. }) => {}
            Err(e) if node_failed(&e) => failure = Some(e),
            Err(e) => return Err(e),
        }
    }
    match (oks.is_empty(), failure) {
        (false, _) => Ok(oks),
        (true, Some(e)) => Err(e),
        (true, None) => Err(StoreError::not_found(key)),
    }
}

#[async_trait]
impl Store for ClusterStore {
    async fn put(&self, key: &[u8], meta: &TensorMeta, bytes: &[u8], r: Retention) -> Result<()> {
        put_staged(self, &self.engine, (key, meta, bytes), r).await
    }

    async fn put_from(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        src: &MemSlice,
        r: Retention,
    ) -> Result<()> {
        self.put_replicated(key, meta, src, r, self.cfg.replicas).await
    }

    async fn get(&self, key: &[u8]) -> Result<(TensorMeta, Vec<u8>)> {
        check_key(key)?;
        self.first(key, |m| async move { m.get(key).await }).await
    }

    async fn get_into(&self, key: &[u8], dst: &Region, offset: u64) -> Result<(TensorMeta, u64)> {
        check_key(key)?;
        self.first(key, |m| async move { m.get_into(key, dst, offset).await }).await
    }

    async fn exists(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        let r = self
            .first(key, |m| async move {
                match m.exists(key).await? {
                    true => Ok(true),
                    false => Err(StoreError::not_found(key)),
                }
            })
            .await;
        match r {
            Err(StoreError::NotFound { .. }) => Ok(false),
            r => r,
        }
    }

    async fn meta(&self, key: &[u8]) -> Result<TensorMeta> {
        check_key(key)?;
        self.first(key, |m| async move { m.meta(key).await }).await
    }

    async fn remove(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        self.sweep(key);
        match merge(key, self.everywhere(|m| async move { m.remove(key).await }).await) {
            Ok(v) => Ok(v.into_iter().any(|b| b)),
            Err(StoreError::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn pin(&self, key: &[u8]) -> Result<()> {
        check_key(key)?;
        merge(key, self.everywhere(|m| async move { m.pin(key).await }).await).map(drop)
    }

    async fn unpin(&self, key: &[u8]) -> Result<()> {
        check_key(key)?;
        merge(key, self.everywhere(|m| async move { m.unpin(key).await }).await).map(drop)
    }

    /// The live nodes' counters added up (so `objects` counts copies: an object with two
    /// replicas counts twice; `largest_free` is the largest of any node).
    async fn stats(&self) -> Result<StoreStats> {
        let all = self.everywhere(|m| async move { m.stats().await }).await;
        let mut sum = StoreStats::default();
        let mut any = None;
        for (_, r) in all {
            match r {
                Ok(s) => {
                    sum.capacity += s.capacity;
                    sum.used += s.used;
                    sum.objects += s.objects;
                    sum.spilled_objects += s.spilled_objects;
                    sum.evictions += s.evictions;
                    sum.largest_free = sum.largest_free.max(s.largest_free);
                    any = Some(Ok(()));
                }
                Err(e) => {
                    any.get_or_insert(Err(e));
                }
            }
        }
        match any {
            Some(Ok(())) => Ok(sum),
            Some(Err(e)) => Err(e),
            None => Ok(sum),
        }
    }

    /// Sets the lease on every replica: each counts the consumers itself (every report goes to
    /// every replica), so any of them can tell when the last one is done.
    async fn set_lease(&self, key: &[u8], consumers: u32, ttl: Option<Duration>) -> Result<()> {
        check_key(key)?;
        let all = self.everywhere(|m| async move { m.set_lease(key, consumers, ttl).await }).await;
        merge(key, all).map(drop)
    }

    /// Reports one consumer to every replica (so each counts every report once, and any of
    /// them can stand in for a lost one); when a replica says it was the last, the object is
    /// gone and every other copy (one a repair made from an earlier count, say) is removed.
    async fn consumed(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        let answers = merge(key, self.everywhere(|m| async move { m.consumed(key).await }).await)?;
        let gone = answers.into_iter().any(|last| last);
        if gone {
            self.sweep(key);
            drop(self.everywhere(|m| async move { m.remove(key).await }).await);
        }
        Ok(gone)
    }
}
