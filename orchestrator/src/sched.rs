//! The orchestrator's scheduler core, sans-IO: plain structs, time passed in, events in, dispatch
//! decisions and request outcomes out. The library orchestrator and the simulator drive the same
//! code.
//!
//! - Encode and decode are work queues: any worker of the pool takes any item. Denoise is an
//!   admission queue: a dispatched job stays on its worker until it finishes or fails.
//! - Order within a queue: interactive before batch, then earliest deadline, then arrival. A batch
//!   item waiting longer than `aging` is ordered as interactive (starvation bound).
//! - Credits: a worker has `slots`; the scheduler dispatches only while `busy < slots`, so credit
//!   never goes negative. Denoise admission also needs room downstream: latents waiting for decode
//!   must stay below the decode pool's slots plus `decode_headroom`, so a slow decode pool stops
//!   new denoise admissions before latents pile up.
//! - Failures: a worker that misses heartbeats for `heartbeat_timeout` is declared dead and its
//!   items are re-queued with attempt + 1 (inputs are still in the store); after `max_attempts`
//!   the request fails with the reason. A result from a worker that no longer holds the item (it
//!   was declared dead, or the item was re-queued) is ignored, never delivered twice.
//! - Lost inputs: a worker that finds its input gone (the p2p producer died after its result was
//!   accepted) says so, and the stage before runs again: stages are idempotent given their
//!   inputs, and inputs are released only when the request ends (see the driver), so that
//!   stage's own inputs are still there. At most `max_attempts` such re-runs per request.
//! - Preemption: when an interactive item waits for denoise, no denoise worker has a free slot,
//!   and decode has room, the scheduler asks the holder of a running batch-class denoise job
//!   (the one dispatched last: the least work at stake; never one admitted past the aging
//!   bound) to checkpoint at its next step boundary and yield ([`Scheduler::take_asks`]); at most one ask stands per interactive item waiting.
//!   A yielded job ([`Scheduler::yielded`]) re-enters the denoise queue on the same try, and its
//!   next worker resumes it from the checkpoint (the driver keeps it). A worker that finishes,
//!   fails or dies before it yields settles the ask the same way as without one.
//! - Draining ([`Scheduler::drain`]): a worker being scaled down takes no new items, is asked to
//!   yield each denoise job it runs (the others finish), and is reported drained
//!   ([`Scheduler::take_drained`]) once it holds nothing.
//! - Recovery: requests rebuilt from the service's journal after a restart
//!   ([`Scheduler::restore`]) are parked for a grace period, so the worker still running an item
//!   when the orchestrator went down can claim it when it reconnects ([`Scheduler::claim`])
//!   instead of another worker running it a second time; what nobody claims is queued then.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::fasthash::FastMap;

use crate::{Priority, Stage};

/// A worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u64);

/// One unit of work: a request at a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ItemKey {
    /// Request.
    pub request: u64,
    /// Stage.
    pub stage: Stage,
}

/// Scheduler settings.
#[derive(Debug, Clone)]
pub struct SchedConfig {
    /// A batch item older than this is ordered as interactive.
    pub aging: Duration,
    /// A worker silent this long is declared dead.
    pub heartbeat_timeout: Duration,
    /// Tries per stage before the request fails.
    pub max_attempts: u32,
    /// Extra decode items allowed to queue beyond the decode pool's free slots.
    pub decode_headroom: u32,
    /// Ask batch denoise jobs to yield to waiting interactive ones (see the module docs).
    pub preempt: bool,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            aging: Duration::from_secs(30),
            heartbeat_timeout: Duration::from_secs(5),
            max_attempts: 3,
            decode_headroom: 0,
            preempt: true,
        }
    }
}

/// What a policy sees of a candidate worker.
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    /// Worker.
    pub id: WorkerId,
    /// Free slots.
    pub free: u32,
    /// Host.
    pub host: &'a str,
    /// Rail / NUMA labels.
    pub labels: &'a [String],
}

/// Where an item should go, among workers with free credit.
pub trait RoutingPolicy: Send {
    /// Index into `candidates` (never empty).
    fn pick(&mut self, item: &Item, candidates: &[Candidate<'_>]) -> usize;

    /// Whether `pick` would choose, for `item`, the candidate with the most free slots (the
    /// lowest id on ties). The scheduler then takes that worker from its index of workers by
    /// free slots instead of listing every candidate: a decision costs O(log workers), not
    /// O(workers).
    fn picks_most_free(&self, _item: &Item) -> bool {
        false
    }
}

/// Round robin over the workers with credit.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl RoutingPolicy for RoundRobin {
    fn pick(&mut self, _: &Item, c: &[Candidate<'_>]) -> usize {
        self.next = self.next.wrapping_add(1);
        self.next % c.len()
    }
}

/// The worker with the most free slots (lowest id on ties).
#[derive(Debug, Default)]
pub struct MaxFreeCredit;

impl RoutingPolicy for MaxFreeCredit {
    fn pick(&mut self, _: &Item, c: &[Candidate<'_>]) -> usize {
        let mut best = 0;
        for (i, w) in c.iter().enumerate() {
            if w.free > c[best].free {
                best = i;
            }
        }
        best
    }

    fn picks_most_free(&self, _: &Item) -> bool {
        true
    }
}

/// Prefer the producer's host, then a worker sharing a rail/NUMA label, then the most free slots.
#[derive(Debug, Default)]
pub struct AffinityFirst;

impl RoutingPolicy for AffinityFirst {
    fn pick(&mut self, item: &Item, c: &[Candidate<'_>]) -> usize {
        let score = |w: &Candidate<'_>| {
            let host = item.affinity_host.as_deref() == Some(w.host);
            let label = w.labels.iter().any(|l| item.affinity_labels.contains(l));
            (u8::from(host), u8::from(label), w.free)
        };
        let mut best = 0;
        for (i, w) in c.iter().enumerate() {
            if score(w) > score(&c[best]) {
                best = i;
            }
        }
        best
    }

    /// Without hints, every candidate scores only by its free slots.
    fn picks_most_free(&self, item: &Item) -> bool {
        item.affinity_host.is_none() && item.affinity_labels.is_empty()
    }
}

/// A queued or running item.
#[derive(Debug, Clone)]
pub struct Item {
    /// Request and stage.
    pub key: ItemKey,
    /// Class.
    pub priority: Priority,
    /// Deadline (time since the scheduler's epoch); `Duration::MAX` for none.
    pub deadline: Duration,
    /// Tries so far, starting at 1.
    pub attempt: u32,
    /// Producer host hint.
    pub affinity_host: Option<String>,
    /// Label hints.
    pub affinity_labels: Vec<String>,
    enqueued: Duration,
    seq: u64,
}

/// A request entering the pipeline.
#[derive(Debug, Clone)]
pub struct Submit {
    /// Request id (unique).
    pub request: u64,
    /// Class.
    pub priority: Priority,
    /// Deadline since the epoch, if any.
    pub deadline: Option<Duration>,
    /// Affinity hints.
    pub host: Option<String>,
    /// Label hints.
    pub labels: Vec<String>,
    /// The stage it starts at: [`Stage::Encode`], or a later one when the earlier stages'
    /// outputs are known already (e.g. a cached condition embedding: denoise starts at once).
    pub start: Stage,
    /// A checkpoint the start stage resumes from (step, saved state): edit and resume from a
    /// mid-trajectory checkpoint of an earlier request. Kept by the driver, not the scheduler.
    pub resume: Option<(u32, Vec<u8>)>,
}

impl Submit {
    /// A request of `priority` with no deadline and no affinity hints, from the first stage.
    pub fn new(request: u64, priority: Priority) -> Submit {
        Submit {
            request,
            priority,
            deadline: None,
            host: None,
            labels: vec![],
            start: Stage::Encode,
            resume: None,
        }
    }
}

/// A request rebuilt after a restart: where it was.
#[derive(Debug, Clone)]
pub struct Restore {
    /// Request id.
    pub request: u64,
    /// Class.
    pub priority: Priority,
    /// The stage it waits for (or runs).
    pub stage: Stage,
    /// That stage's try number.
    pub attempt: u32,
    /// Re-runs after lost inputs so far.
    pub reruns: u32,
}

/// A decision: run `item` on `worker`.
#[derive(Debug, Clone)]
pub struct Dispatch {
    /// The item.
    pub item: Item,
    /// The worker.
    pub worker: WorkerId,
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every stage finished.
    Completed {
        /// Request.
        request: u64,
    },
    /// It cannot finish.
    Failed {
        /// Request.
        request: u64,
        /// Why.
        reason: String,
    },
}

impl Outcome {
    /// The request it is about.
    pub fn request(&self) -> u64 {
        match self {
            Outcome::Completed { request } | Outcome::Failed { request, .. } => *request,
        }
    }
}

#[derive(Debug)]
struct Worker {
    stage: Stage,
    slots: u32,
    busy: u32,
    host: String,
    labels: Vec<String>,
    last_seen: Duration,
    items: Vec<ItemKey>,
    /// Free slots it is listed under in `by_free` (0: not listed).
    listed: u32,
}

/// Counters for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedStats {
    /// Dispatch decisions made.
    pub dispatched: u64,
    /// Items re-queued after a failure or a dead worker.
    pub requeued: u64,
    /// Results ignored (late, duplicate, or from a worker that lost the item).
    pub ignored: u64,
    /// Requests completed.
    pub completed: u64,
    /// Requests failed.
    pub failed: u64,
    /// Workers declared dead.
    pub dead_workers: u64,
    /// Stages run again because the next stage found their output gone.
    pub reran: u64,
    /// Yield asks sent to holders of batch jobs for waiting interactive ones.
    pub preempt_asks: u64,
    /// Jobs given back at a step boundary (preempted or drained) and queued again.
    pub yielded: u64,
}

type QKey = (u8, Duration, u64);

#[derive(Debug, Default)]
struct StageQueue {
    order: BTreeMap<QKey, Item>,
    /// The batch items queued (not yet aged), oldest first (for aging): (enqueued, sequence
    /// number) -> queue key. An item leaves it when it is dispatched or ages, so it holds at
    /// most the queue (it was a list of every batch item enqueued within the aging bound,
    /// dispatched or not: millions of entries on a busy service).
    batch: BTreeMap<(Duration, u64), QKey>,
}

/// The scheduler.
pub struct Scheduler {
    cfg: SchedConfig,
    policy: Box<dyn RoutingPolicy>,
    /// Per stage (indexed by [`Stage::index`]).
    queues: [StageQueue; 3],
    workers: FastMap<WorkerId, Worker>,
    running: FastMap<ItemKey, (WorkerId, Item)>,
    /// Requests not yet ended, with the re-runs each has had.
    live: FastMap<u64, u32>,
    outcomes: Vec<Outcome>,
    seq: u64,
    stats: SchedStats,
    /// Per stage: workers with a free slot (the only dispatch candidates).
    free: [std::collections::BTreeSet<WorkerId>; 3],
    /// The same workers by free slots, most first, then by id: what a policy that picks the
    /// most free slots would pick is the first.
    by_free: [std::collections::BTreeSet<(std::cmp::Reverse<u32>, WorkerId)>; 3],
    /// Per stage: total slots and running items.
    slots_by: [u32; 3],
    running_by: [usize; 3],
    /// When silent workers were last looked for.
    last_scan: Option<Duration>,
    /// Workers declared dead since [`Scheduler::take_dead`] was last called.
    dead: Vec<WorkerId>,
    /// Restored items waiting for their worker to claim them, until the deadline.
    parked: FastMap<ItemKey, (Item, Duration)>,
    /// Running batch denoise jobs not asked to yield, by dispatch order: preemption victims.
    preemptible: BTreeMap<u64, ItemKey>,
    /// Jobs asked to yield, and whether the ask was for an interactive item (else a drain).
    asked: FastMap<ItemKey, bool>,
    /// Asks standing for interactive items.
    preempting: usize,
    /// Interactive items queued per stage.
    interactive: [usize; 3],
    /// Asks made by the last [`Scheduler::dispatch`] or [`Scheduler::drain`].
    asks: Vec<(WorkerId, ItemKey)>,
    /// Draining workers, and those that hold nothing now (reported once).
    draining: std::collections::BTreeSet<WorkerId>,
    drained: Vec<WorkerId>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("workers", &self.workers.len())
            .field("stats", &self.stats)
            .finish()
    }
}

/// Whether a running `item` may be asked to yield for an interactive one: a batch denoise job,
/// with preemption on, unless it was admitted past the aging bound (`aged`): preempting it would
/// undo the starvation bound, and it would be asked back at once.
fn victim(cfg: &SchedConfig, item: &Item, aged: bool) -> bool {
    cfg.preempt && item.key.stage == Stage::Denoise && item.priority == Priority::Batch && !aged
}

fn class(p: Priority) -> u8 {
    match p {
        Priority::Interactive => 0,
        Priority::Batch => 1,
    }
}

impl Scheduler {
    /// A scheduler with `policy` for choosing among workers with credit.
    pub fn new(cfg: SchedConfig, policy: Box<dyn RoutingPolicy>) -> Scheduler {
        Scheduler {
            cfg,
            policy,
            queues: Default::default(),
            workers: FastMap::default(),
            running: FastMap::default(),
            live: FastMap::default(),
            outcomes: Vec::new(),
            seq: 0,
            stats: SchedStats::default(),
            free: Default::default(),
            by_free: Default::default(),
            slots_by: [0; 3],
            running_by: [0; 3],
            last_scan: None,
            dead: Vec::new(),
            parked: FastMap::default(),
            preemptible: BTreeMap::new(),
            asked: FastMap::default(),
            preempting: 0,
            interactive: [0; 3],
            asks: Vec::new(),
            draining: Default::default(),
            drained: Vec::new(),
        }
    }

    /// Keeps the free-worker index right for `id` after its busy count or slots changed.
    fn reindex(&mut self, id: WorkerId) {
        if let Some(w) = self.workers.get_mut(&id) {
            let st = w.stage.index();
            let free = w.slots.saturating_sub(w.busy);
            if w.listed > 0 {
                self.by_free[st].remove(&(std::cmp::Reverse(w.listed), id));
            }
            if free > 0 {
                self.free[st].insert(id);
                self.by_free[st].insert((std::cmp::Reverse(free), id));
            } else {
                self.free[st].remove(&id);
            }
            w.listed = free;
        }
    }

    /// Counters.
    pub fn stats(&self) -> SchedStats {
        self.stats
    }

    /// Items queued at `stage`.
    pub fn queued(&self, stage: Stage) -> usize {
        self.queues[stage.index()].order.len()
    }

    /// Items of class `p` queued at `stage` (counts the class's queue range: for metrics, not
    /// for every turn of a busy loop).
    pub fn queued_of(&self, stage: Stage, p: Priority) -> usize {
        let c = class(p);
        let lo = (c, Duration::ZERO, 0);
        let q = &self.queues[stage.index()].order;
        match c.checked_add(1) {
            Some(next) => q.range(lo..(next, Duration::ZERO, 0)).count(),
            None => q.range(lo..).count(),
        }
    }

    /// Every joined worker: its id, stage and labels.
    pub fn workers(&self) -> impl Iterator<Item = (WorkerId, Stage, &[String])> {
        self.workers.iter().map(|(id, w)| (*id, w.stage, w.labels.as_slice()))
    }

    /// Workers of `stage`: (live, draining).
    pub fn workers_of(&self, stage: Stage) -> (usize, usize) {
        let mut n = (0, 0);
        for (id, w) in &self.workers {
            if w.stage == stage {
                if self.draining.contains(id) { n.1 += 1 } else { n.0 += 1 }
            }
        }
        n
    }

    /// Items running at `stage`.
    pub fn running(&self, stage: Stage) -> usize {
        self.running_by[stage.index()]
    }

    /// Free slots of the live workers of `stage`.
    pub fn free_slots(&self, stage: Stage) -> u32 {
        self.free[stage.index()]
            .iter()
            .filter_map(|id| self.workers.get(id))
            .map(|w| w.slots.saturating_sub(w.busy))
            .sum()
    }

    /// Total slots of the live workers of `stage`.
    pub fn slots(&self, stage: Stage) -> u32 {
        self.slots_by[stage.index()]
    }

    /// Requests not yet ended.
    pub fn in_flight(&self) -> usize {
        self.live.len()
    }

    /// The worker running `key`, if any.
    pub fn holder(&self, key: ItemKey) -> Option<WorkerId> {
        self.running.get(&key).map(|(w, _)| *w)
    }

    /// The stage of a live worker.
    pub fn stage_of(&self, id: WorkerId) -> Option<Stage> {
        self.workers.get(&id).map(|w| w.stage)
    }

    /// Workers declared dead (silent past the heartbeat timeout) since the last call: their items
    /// are re-queued already; whoever holds their connections should close them, so a worker
    /// that was only slow learns it is out and can rejoin.
    pub fn take_dead(&mut self) -> Vec<WorkerId> {
        std::mem::take(&mut self.dead)
    }

    /// Whether `request` is in flight (submitted, not yet ended).
    pub fn in_flight_request(&self, request: u64) -> bool {
        self.live.contains_key(&request)
    }

    /// Whether `request` ended since [`Scheduler::take_outcomes`] was last called.
    pub fn ended_untaken(&self, request: u64) -> bool {
        self.outcomes.iter().any(|o| o.request() == request)
    }

    /// Drains the requests that ended since the last call.
    pub fn take_outcomes(&mut self) -> Vec<Outcome> {
        std::mem::take(&mut self.outcomes)
    }

    fn enqueue(&mut self, mut item: Item, now: Duration) {
        self.seq += 1;
        item.seq = self.seq;
        item.enqueued = now;
        self.queue(item);
    }

    /// Puts `item` in its stage's queue at its place (by its class, deadline and sequence
    /// number; a batch item ages from when it was enqueued).
    fn queue(&mut self, item: Item) {
        let now = item.enqueued;
        let key = (class(item.priority), item.deadline, item.seq);
        let q = &mut self.queues[item.key.stage.index()];
        match item.priority {
            Priority::Batch => {
                q.batch.insert((now, item.seq), key);
            }
            Priority::Interactive => self.interactive[item.key.stage.index()] += 1,
        }
        q.order.insert(key, item);
    }

    /// A new request; it starts at its `start` stage's queue. A duplicate id is refused (false).
    pub fn submit(&mut self, s: Submit, now: Duration) -> bool {
        if self.live.contains_key(&s.request) {
            return false;
        }
        self.live.insert(s.request, 0);
        let item = Item {
            key: ItemKey { request: s.request, stage: s.start },
            priority: s.priority,
            deadline: s.deadline.unwrap_or(Duration::MAX),
            attempt: 1,
            affinity_host: s.host,
            affinity_labels: s.labels,
            enqueued: now,
            seq: 0,
        };
        self.enqueue(item, now);
        true
    }

    /// A request rebuilt from a journal after a restart, at the stage it had reached. Its item
    /// is parked until `until` for [`Scheduler::claim`], then queued. A live id is refused
    /// (false).
    pub fn restore(&mut self, r: Restore, until: Duration, now: Duration) -> bool {
        if self.live.contains_key(&r.request) {
            return false;
        }
        self.live.insert(r.request, r.reruns);
        let key = ItemKey { request: r.request, stage: r.stage };
        let item = Item {
            key,
            priority: r.priority,
            deadline: Duration::MAX,
            attempt: r.attempt.max(1),
            affinity_host: None,
            affinity_labels: vec![],
            enqueued: now,
            seq: 0,
        };
        self.parked.insert(key, (item, until));
        true
    }

    /// `worker` says it runs `key` on `attempt` (it reconnected after a restart): if that item
    /// is parked with that attempt, it runs on `worker` from now on, and its result will be
    /// accepted. Returns false otherwise (the worker's eventual result is then ignored).
    pub fn claim(&mut self, key: ItemKey, worker: WorkerId, attempt: u32, now: Duration) -> bool {
        let fits = self.parked.get(&key).is_some_and(|(i, _)| i.attempt == attempt)
            && self.workers.get(&worker).is_some_and(|w| w.stage == key.stage);
        if !fits {
            return false;
        }
        let Some((mut item, _)) = self.parked.remove(&key) else { return false };
        self.seq += 1;
        item.seq = self.seq;
        let w = self.workers.get_mut(&worker).expect("checked above");
        w.busy += 1;
        w.last_seen = now;
        w.items.push(key);
        self.reindex(worker);
        self.running_by[key.stage.index()] += 1;
        self.started(&item);
        self.running.insert(key, (worker, item));
        true
    }

    /// Restored items not claimed yet.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// A worker joined (or rejoined: a known id is reset, holding nothing).
    pub fn join(
        &mut self,
        id: WorkerId,
        stage: Stage,
        slots: u32,
        host: &str,
        labels: Vec<String>,
        now: Duration,
    ) {
        if self.workers.contains_key(&id) {
            self.lose_worker(id, now, "worker rejoined");
        }
        self.workers.insert(
            id,
            Worker {
                stage,
                slots,
                busy: 0,
                host: host.to_string(),
                labels,
                last_seen: now,
                items: Vec::new(),
                listed: 0,
            },
        );
        self.slots_by[stage.index()] += slots;
        self.reindex(id);
    }

    /// A worker left; its items are re-queued.
    pub fn leave(&mut self, id: WorkerId, now: Duration) {
        self.lose_worker(id, now, "worker left");
    }

    /// A worker advertises its slot count (credit). A draining worker's stays 0.
    pub fn credit(&mut self, id: WorkerId, slots: u32, now: Duration) {
        let slots = if self.draining.contains(&id) { 0 } else { slots };
        if let Some(w) = self.workers.get_mut(&id) {
            let i = w.stage.index();
            self.slots_by[i] = self.slots_by[i] - w.slots + slots;
            w.slots = slots;
            w.last_seen = now;
        }
        self.reindex(id);
    }

    /// A worker is alive (renews the leases of the items it holds).
    pub fn heartbeat(&mut self, id: WorkerId, now: Duration) {
        if let Some(w) = self.workers.get_mut(&id) {
            w.last_seen = now;
        }
    }

    fn end(&mut self, request: u64, o: Outcome) {
        if self.live.remove(&request).is_some() {
            match o {
                Outcome::Completed { .. } => self.stats.completed += 1,
                Outcome::Failed { .. } => self.stats.failed += 1,
            }
            self.outcomes.push(o);
        }
    }

    /// A job started running: a batch denoise job may be preempted.
    fn started(&mut self, item: &Item) {
        if victim(&self.cfg, item, false) {
            self.preemptible.insert(item.seq, item.key);
        }
    }

    /// A job stopped running (ended, yielded, failed, or its worker is gone): it is no longer a
    /// victim, and an ask for it is settled.
    fn stopped(&mut self, item: &Item) {
        self.preemptible.remove(&item.seq);
        if self.asked.remove(&item.key) == Some(true) {
            self.preempting -= 1;
        }
    }

    /// Asks the holder of `key` to yield it.
    fn ask(&mut self, key: ItemKey, for_interactive: bool) {
        let Some((worker, item)) = self.running.get(&key) else { return };
        if self.asked.contains_key(&key) {
            return;
        }
        self.preemptible.remove(&item.seq);
        self.asked.insert(key, for_interactive);
        self.asks.push((*worker, key));
        if for_interactive {
            self.preempting += 1;
            self.stats.preempt_asks += 1;
        }
    }

    /// Asks made since the last call (by [`Scheduler::dispatch`] or [`Scheduler::drain`]):
    /// each worker should checkpoint the job at its next step boundary and yield it
    /// ([`Scheduler::yielded`]). Drivers that preempt must take them every turn.
    pub fn take_asks(&mut self) -> Vec<(WorkerId, ItemKey)> {
        std::mem::take(&mut self.asks)
    }

    /// Whether `key` was asked to yield and has not yet stopped running.
    pub fn is_asked(&self, key: ItemKey) -> bool {
        self.asked.contains_key(&key)
    }

    /// Scale-down of `id`: it takes no new items, each denoise job it runs is asked to yield
    /// (the others finish), and once it holds nothing it is reported by
    /// [`Scheduler::take_drained`] (at once if it holds nothing now). Returns false for an
    /// unknown worker.
    pub fn drain(&mut self, id: WorkerId, now: Duration) -> bool {
        if !self.workers.contains_key(&id) {
            return false;
        }
        if self.draining.insert(id) {
            self.credit(id, 0, now);
            let items = self.workers.get(&id).map(|w| w.items.clone()).unwrap_or_default();
            for key in items.into_iter().filter(|k| k.stage == Stage::Denoise) {
                match self.asked.get_mut(&key) {
                    // Asked for an interactive item already: now for the drain.
                    Some(f) if *f => {
                        *f = false;
                        self.preempting -= 1;
                    }
                    Some(_) => {}
                    None => self.ask(key, false),
                }
            }
            if self.workers.get(&id).is_some_and(|w| w.items.is_empty()) {
                self.drained.push(id);
            }
        }
        true
    }

    /// Whether `id` is draining (it takes no new items).
    pub fn is_draining(&self, id: WorkerId) -> bool {
        self.draining.contains(&id)
    }

    /// Draining workers that came to hold nothing since the last call (each reported once).
    pub fn take_drained(&mut self) -> Vec<WorkerId> {
        std::mem::take(&mut self.drained)
    }

    /// `worker` gave `key` back at a step boundary (asked to, or on its own): it is queued again
    /// on the same try. Returns false when ignored (the worker does not hold it).
    pub fn yielded(&mut self, key: ItemKey, worker: WorkerId, now: Duration) -> bool {
        let Some(item) = self.release(key, worker) else { return false };
        self.stats.yielded += 1;
        if let Some(w) = self.workers.get_mut(&worker) {
            w.last_seen = now;
        }
        // Back at the place it was admitted from: work that came after it stays after it.
        self.queue(item);
        true
    }

    /// Takes `key` away from `worker` if it holds it; None otherwise (a late or foreign result).
    fn release(&mut self, key: ItemKey, worker: WorkerId) -> Option<Item> {
        match self.running.get(&key) {
            Some((w, _)) if *w == worker => {}
            _ => {
                self.stats.ignored += 1;
                return None;
            }
        }
        let (_, item) = self.running.remove(&key)?;
        self.running_by[key.stage.index()] -= 1;
        self.stopped(&item);
        if let Some(w) = self.workers.get_mut(&worker) {
            w.busy = w.busy.saturating_sub(1);
            w.items.retain(|k| *k != key);
            if w.items.is_empty() && self.draining.contains(&worker) {
                self.drained.push(worker);
            }
        }
        self.reindex(worker);
        Some(item)
    }

    /// `worker` finished `key`; the request moves to its next stage (or completes). Returns
    /// false when the result was ignored.
    pub fn finished(&mut self, key: ItemKey, worker: WorkerId, now: Duration) -> bool {
        let Some(item) = self.release(key, worker) else { return false };
        if let Some(w) = self.workers.get_mut(&worker) {
            w.last_seen = now;
        }
        match key.stage.next() {
            Some(stage) => {
                let next =
                    Item { key: ItemKey { request: key.request, stage }, attempt: 1, ..item };
                self.enqueue(next, now);
            }
            None => self.end(key.request, Outcome::Completed { request: key.request }),
        }
        true
    }

    /// `worker` failed `key`: re-queued with attempt + 1, or the request fails.
    pub fn failed(&mut self, key: ItemKey, worker: WorkerId, reason: &str, now: Duration) -> bool {
        let Some(item) = self.release(key, worker) else { return false };
        self.retry(item, now, reason);
        true
    }

    /// `worker` could not run `key` because its input is gone (its producer died after its result
    /// was accepted): the stage before runs again, or, for the first stage or past
    /// `max_attempts` re-runs, this is a failure like [`Scheduler::failed`]. Returns false when
    /// the report was ignored.
    pub fn lost_input(
        &mut self,
        key: ItemKey,
        worker: WorkerId,
        reason: &str,
        now: Duration,
    ) -> bool {
        let Some(item) = self.release(key, worker) else { return false };
        let reruns = self.live.get(&key.request).copied().unwrap_or(0);
        match key.stage.prev() {
            Some(stage) if reruns < self.cfg.max_attempts => {
                self.live.insert(key.request, reruns + 1);
                self.stats.reran += 1;
                let again =
                    Item { key: ItemKey { request: key.request, stage }, attempt: 1, ..item };
                self.enqueue(again, now);
            }
            _ => self.retry(item, now, &format!("input lost: {reason}")),
        }
        true
    }

    fn retry(&mut self, mut item: Item, now: Duration, reason: &str) {
        if item.attempt >= self.cfg.max_attempts {
            let r = item.key.request;
            let reason =
                format!("{:?} failed {} times; last: {reason}", item.key.stage, item.attempt);
            self.end(r, Outcome::Failed { request: r, reason });
        } else {
            item.attempt += 1;
            self.stats.requeued += 1;
            self.enqueue(item, now);
        }
    }

    fn lose_worker(&mut self, id: WorkerId, now: Duration, reason: &str) {
        let Some(w) = self.workers.remove(&id) else { return };
        self.draining.remove(&id);
        self.drained.retain(|d| *d != id);
        self.free[w.stage.index()].remove(&id);
        self.by_free[w.stage.index()].remove(&(std::cmp::Reverse(w.listed), id));
        self.slots_by[w.stage.index()] -= w.slots;
        for key in w.items {
            if let Some((_, item)) = self.running.remove(&key) {
                self.running_by[key.stage.index()] -= 1;
                self.stopped(&item);
                self.retry(item, now, reason);
            }
        }
    }

    /// Declares silent workers dead (re-queueing their items) and ages batch items.
    pub fn tick(&mut self, now: Duration) {
        // Looking for silent workers scans them all: do it a few times per timeout, not per call.
        let every = self.cfg.heartbeat_timeout / 4;
        let due = self.last_scan.is_none_or(|t| now.saturating_sub(t) >= every);
        if due {
            self.last_scan = Some(now);
        }
        let mut dead: Vec<WorkerId> = if !due {
            Vec::new()
        } else {
            self.workers
                .iter()
                .filter(|(_, w)| now.saturating_sub(w.last_seen) >= self.cfg.heartbeat_timeout)
                .map(|(&id, _)| id)
                .collect()
        };
        dead.sort_unstable(); // the same order every run, whatever the map's
        if !self.parked.is_empty() {
            let mut due: Vec<ItemKey> =
                self.parked.iter().filter(|(_, (_, t))| *t <= now).map(|(k, _)| *k).collect();
            due.sort_unstable();
            for k in due {
                if let Some((item, _)) = self.parked.remove(&k) {
                    self.enqueue(item, now);
                }
            }
        }
        for id in dead {
            self.stats.dead_workers += 1;
            self.lose_worker(id, now, "worker missed its heartbeats");
            self.dead.push(id);
        }
        let aging = self.cfg.aging;
        for q in &mut self.queues {
            while let Some((&(t, _), &key)) = q.batch.first_key_value() {
                if now.saturating_sub(t) < aging {
                    break;
                }
                q.batch.pop_first();
                if let Some(item) = q.order.remove(&key) {
                    q.order.insert((0, key.1, key.2), item); // ordered as interactive from now on
                }
            }
        }
    }

    /// Room for one more denoise admission: latents already waiting for decode stay below the
    /// decode pool's slots plus the headroom (with no decode worker, nothing is admitted).
    fn downstream_room(&self) -> bool {
        (self.queued(Stage::Decode) as u32) < self.slots(Stage::Decode) + self.cfg.decode_headroom
    }

    /// Every dispatch decision possible now.
    pub fn dispatch(&mut self, now: Duration) -> Vec<Dispatch> {
        self.tick(now);
        let mut out = Vec::new();
        let mut picked: Vec<(WorkerId, ItemKey)> = Vec::new();
        for stage in [Stage::Decode, Stage::Denoise, Stage::Encode] {
            // For a policy that picks the most free slots, the worker is the first of the
            // stage's `by_free` index, taken and updated at once. Otherwise the stage's
            // candidates are listed (once, until a pick from the index changes the workers)
            // and kept current as items go (a worker leaves the list when its last free slot
            // is taken); the workers themselves are updated when the list is dropped.
            let mut candidates: Vec<Candidate<'_>> = Vec::new();
            let mut listed = false;
            loop {
                if stage == Stage::Denoise && !self.downstream_room() {
                    break;
                }
                let Some((&qk, item)) = self.queues[stage.index()].order.iter().next() else {
                    break;
                };
                let wid = if self.policy.picks_most_free(item) {
                    let key = item.key;
                    candidates = Vec::new();
                    if listed {
                        listed = false;
                        self.settle(&mut picked);
                    }
                    let Some(&(_, wid)) = self.by_free[stage.index()].first() else { break };
                    self.give(wid, key);
                    wid
                } else {
                    if !listed {
                        candidates = self.free[stage.index()]
                            .iter()
                            .filter_map(|id| self.workers.get(id).map(|w| (id, w)))
                            .filter(|(_, w)| w.busy < w.slots)
                            .map(|(&id, w)| Candidate {
                                id,
                                free: w.slots - w.busy,
                                host: &w.host,
                                labels: &w.labels,
                            })
                            .collect();
                        listed = true;
                    }
                    if candidates.is_empty() {
                        break;
                    }
                    let pick = self.policy.pick(item, &candidates).min(candidates.len() - 1);
                    let wid = candidates[pick].id;
                    candidates[pick].free -= 1;
                    if candidates[pick].free == 0 {
                        candidates.remove(pick);
                    }
                    wid
                };
                let q = &mut self.queues[stage.index()];
                let item = q.order.remove(&qk).expect("item exists");
                // What `queue` counted or indexed for the item leaves with it.
                match item.priority {
                    Priority::Batch => {
                        q.batch.remove(&(item.enqueued, item.seq)); // absent once it aged
                    }
                    Priority::Interactive => self.interactive[stage.index()] -= 1,
                }
                if listed {
                    picked.push((wid, item.key));
                }
                self.running_by[stage.index()] += 1;
                if victim(&self.cfg, &item, qk.0 != class(item.priority)) {
                    self.preemptible.insert(item.seq, item.key);
                }
                self.running.insert(item.key, (wid, item.clone()));
                self.stats.dispatched += 1;
                out.push(Dispatch { item, worker: wid });
            }
            drop(candidates);
            self.settle(&mut picked);
        }
        self.preempt();
        out
    }

    /// Gives each picked worker its item (a slot taken) and indexes it again.
    fn settle(&mut self, picked: &mut Vec<(WorkerId, ItemKey)>) {
        for (wid, key) in picked.drain(..) {
            self.give(wid, key);
        }
    }

    /// Worker `wid` takes a slot for item `key`.
    fn give(&mut self, wid: WorkerId, key: ItemKey) {
        if let Some(w) = self.workers.get_mut(&wid) {
            w.busy += 1;
            w.items.push(key);
        }
        self.reindex(wid);
    }

    /// Asks holders of batch denoise jobs to yield, one per interactive item that waits for
    /// denoise with no free slot while decode has room (see the module docs).
    fn preempt(&mut self) {
        let d = Stage::Denoise.index();
        if !self.cfg.preempt
            || self.interactive[d] <= self.preempting
            || !self.free[d].is_empty()
            || !self.downstream_room()
        {
            return;
        }
        while self.preempting < self.interactive[d] {
            let Some((_, key)) = self.preemptible.pop_last() else { break };
            self.ask(key, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn sched() -> Scheduler {
        Scheduler::new(SchedConfig::default(), Box::new(MaxFreeCredit))
    }

    fn submit(s: &mut Scheduler, r: u64, p: Priority, now: Duration) {
        assert!(s.submit(Submit::new(r, p), now));
    }

    #[test]
    fn interactive_overtakes_batch_and_batch_ages() {
        let mut s = Scheduler::new(
            SchedConfig { aging: ms(100), ..SchedConfig::default() },
            Box::new(MaxFreeCredit),
        );
        s.join(WorkerId(1), Stage::Encode, 1, "h", vec![], ms(0));
        for r in 0..3 {
            submit(&mut s, r, Priority::Batch, ms(0));
        }
        submit(&mut s, 10, Priority::Interactive, ms(1));
        let d = s.dispatch(ms(2));
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].item.key.request, 10, "interactive first");
        s.finished(d[0].item.key, WorkerId(1), ms(3));
        submit(&mut s, 11, Priority::Interactive, ms(150));
        let d = s.dispatch(ms(150));
        assert_eq!(
            d[0].item.key.request, 0,
            "a batch item past the aging bound goes before a new interactive one"
        );
    }

    /// The aging index holds the batch items queued and no others: an item dispatched before
    /// it aged leaves it (it used to stay until the aging bound passed, so the index grew with
    /// the batch items enqueued within `aging`, not with the queue), and one that aged leaves
    /// it then and is still dispatched.
    #[test]
    fn the_aging_index_holds_only_queued_batch_items() {
        let mut s = Scheduler::new(
            SchedConfig { aging: ms(100), ..SchedConfig::default() },
            Box::new(MaxFreeCredit),
        );
        for (id, st) in [(1, Stage::Encode), (2, Stage::Denoise), (3, Stage::Decode)] {
            s.join(WorkerId(id), st, 1, "h", vec![], ms(0));
        }
        let queued_batch = |s: &Scheduler| -> usize {
            s.queues.iter().map(|q| q.order.keys().filter(|k| k.0 == 1).count()).sum()
        };
        for r in 0..200 {
            let p = if r % 5 == 0 { Priority::Interactive } else { Priority::Batch };
            submit(&mut s, r, p, ms(0));
        }
        let (mut done, mut running) = (0, Vec::new());
        for step in 1..2000u64 {
            let now = Duration::from_micros(step); // far inside the aging bound
            running.extend(s.dispatch(now));
            let indexed: usize = s.queues.iter().map(|q| q.batch.len()).sum();
            assert_eq!(indexed, queued_batch(&s), "step {step}");
            if let Some(d) = running.pop() {
                s.finished(d.item.key, d.worker, now);
            }
            done += s.take_outcomes().len();
        }
        assert_eq!(done, 200);
        assert!(s.queues.iter().all(|q| q.batch.is_empty() && q.order.is_empty()));

        // Aged: the entry goes when the item is re-keyed, and the item is still served.
        submit(&mut s, 1000, Priority::Batch, ms(10));
        submit(&mut s, 1001, Priority::Batch, ms(10));
        s.tick(ms(200));
        assert!(s.queues.iter().all(|q| q.batch.is_empty()), "both aged");
        let d = s.dispatch(ms(200));
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].item.key.request, 1000);
        assert!(s.queues.iter().all(|q| q.batch.is_empty()));
        assert_eq!(s.queued(Stage::Encode), 1);
    }

    /// Runs `r` from encode to the denoise queue on encode worker 1.
    fn to_denoise(s: &mut Scheduler, r: u64, p: Priority, now: Duration) {
        let sub = Submit { start: Stage::Denoise, ..Submit::new(r, p) };
        assert!(s.submit(sub, now));
    }

    /// Attempts count per stage: a stage that needed a retry hands the next stage attempt 1,
    /// and a stage run again for a lost input starts at attempt 1 too.
    #[test]
    fn every_stage_starts_at_attempt_one() {
        let mut s = sched();
        s.join(WorkerId(1), Stage::Encode, 1, "h", vec![], ms(0));
        s.join(WorkerId(2), Stage::Denoise, 1, "h", vec![], ms(0));
        s.join(WorkerId(3), Stage::Decode, 1, "h", vec![], ms(0)); // room for denoise's output
        submit(&mut s, 1, Priority::Batch, ms(0));
        let d = s.dispatch(ms(1));
        let enc = d[0].item.key;
        assert!(s.failed(enc, WorkerId(1), "flaky", ms(2)));
        let d = s.dispatch(ms(3));
        assert_eq!((d[0].item.key, d[0].item.attempt), (enc, 2), "the retry");
        assert!(s.finished(enc, WorkerId(1), ms(4)));
        let d = s.dispatch(ms(5));
        let den = d[0].item.key;
        assert_eq!((den.stage, d[0].item.attempt), (Stage::Denoise, 1), "the next stage");
        // Denoise fails once, then finds its input gone on its second attempt: encode runs
        // again, from attempt 1 (not the encode's 2 before, nor the denoise's 2).
        assert!(s.failed(den, WorkerId(2), "flaky", ms(6)));
        let d = s.dispatch(ms(7));
        assert_eq!((d[0].item.key, d[0].item.attempt), (den, 2));
        assert!(s.lost_input(den, WorkerId(2), "producer died", ms(8)));
        let d = s.dispatch(ms(9));
        assert_eq!((d[0].item.key, d[0].item.attempt), (enc, 1), "the stage run again");
        assert_eq!(s.stats().dispatched, 5, "every dispatch counted");
    }

    /// After a restart, a parked item is claimed only by a worker of its stage that says the
    /// attempt the journal has; the claim takes one of that worker's slots and counts as running.
    #[test]
    fn a_parked_item_is_claimed_only_with_its_stage_and_attempt() {
        let mut s = sched();
        let r = Restore {
            request: 4,
            priority: Priority::Batch,
            stage: Stage::Denoise,
            attempt: 2,
            reruns: 0,
        };
        assert!(s.restore(r, ms(5000), ms(0)));
        s.join(WorkerId(1), Stage::Encode, 2, "h", vec![], ms(0));
        s.join(WorkerId(2), Stage::Denoise, 2, "h", vec![], ms(0));
        let key = ItemKey { request: 4, stage: Stage::Denoise };
        assert!(!s.claim(key, WorkerId(1), 2, ms(1)), "a worker of another stage");
        assert!(!s.claim(key, WorkerId(2), 1, ms(1)), "another attempt");
        assert!(!s.claim(key, WorkerId(9), 2, ms(1)), "an unknown worker");
        assert_eq!((s.parked(), s.running(Stage::Denoise)), (1, 0));
        assert!(s.claim(key, WorkerId(2), 2, ms(1)));
        assert_eq!((s.parked(), s.running(Stage::Denoise)), (0, 1));
        assert_eq!(s.holder(key), Some(WorkerId(2)));
        assert_eq!(s.free_slots(Stage::Denoise), 1, "the claim holds one of its two slots");
        assert!(!s.claim(key, WorkerId(2), 2, ms(2)), "claimed once");
    }

    /// A claimed job gets a sequence number of its own: as a preemption victim it stands beside
    /// the jobs dispatched before it (two interactive jobs waiting ask both batch jobs to yield,
    /// the claimed one first: it started last).
    #[test]
    fn a_claimed_job_is_a_victim_of_its_own() {
        let mut s = sched();
        let r = Restore {
            request: 1,
            priority: Priority::Batch,
            stage: Stage::Denoise,
            attempt: 1,
            reruns: 0,
        };
        assert!(s.restore(r, ms(5000), ms(0)));
        s.join(WorkerId(1), Stage::Denoise, 1, "h", vec![], ms(0));
        s.join(WorkerId(2), Stage::Denoise, 1, "h", vec![], ms(0));
        s.join(WorkerId(3), Stage::Decode, 4, "h", vec![], ms(0));
        to_denoise(&mut s, 2, Priority::Batch, ms(1));
        let d = s.dispatch(ms(2));
        assert_eq!((d.len(), d[0].worker), (1, WorkerId(1)));
        let claimed = ItemKey { request: 1, stage: Stage::Denoise };
        assert!(s.claim(claimed, WorkerId(2), 1, ms(3)));
        to_denoise(&mut s, 10, Priority::Interactive, ms(4));
        to_denoise(&mut s, 11, Priority::Interactive, ms(4));
        assert!(s.dispatch(ms(5)).is_empty());
        let asks = s.take_asks();
        let batch = ItemKey { request: 2, stage: Stage::Denoise };
        assert_eq!(asks, vec![(WorkerId(2), claimed), (WorkerId(1), batch)]);
    }

    /// A routing policy whose pick is out of range (a bug in someone's policy) gets the last
    /// candidate, and credit still holds: the scheduler never indexes past its candidates.
    #[test]
    fn an_out_of_range_pick_is_clamped() {
        struct Wild;
        impl RoutingPolicy for Wild {
            fn pick(&mut self, _: &Item, _: &[Candidate<'_>]) -> usize {
                usize::MAX
            }
        }
        let mut s = Scheduler::new(SchedConfig::default(), Box::new(Wild));
        s.join(WorkerId(1), Stage::Encode, 1, "h", vec![], ms(0));
        s.join(WorkerId(2), Stage::Encode, 2, "h", vec![], ms(0));
        for r in 0..4 {
            submit(&mut s, r, Priority::Batch, ms(0));
        }
        let d = s.dispatch(ms(1));
        assert_eq!(d.len(), 3, "three slots");
        let on = |w| d.iter().filter(|x| x.worker == WorkerId(w)).count();
        assert_eq!((on(1), on(2)), (1, 2), "within each worker's credit");
    }

    #[test]
    fn an_interactive_job_preempts_the_batch_job_dispatched_last() {
        let mut s = sched();
        s.join(WorkerId(1), Stage::Denoise, 1, "h", vec![], ms(0));
        s.join(WorkerId(2), Stage::Denoise, 1, "h", vec![], ms(0));
        s.join(WorkerId(3), Stage::Decode, 4, "h", vec![], ms(0));
        to_denoise(&mut s, 1, Priority::Batch, ms(0));
        let first = s.dispatch(ms(1))[0].worker;
        to_denoise(&mut s, 2, Priority::Batch, ms(2));
        let w = s.dispatch(ms(3))[0].worker;
        assert_ne!(w, first);
        assert!(s.take_asks().is_empty(), "nobody waits");
        to_denoise(&mut s, 3, Priority::Batch, ms(4));
        assert!(s.dispatch(ms(5)).is_empty());
        assert!(s.take_asks().is_empty(), "a batch job never preempts");
        to_denoise(&mut s, 10, Priority::Interactive, ms(6));
        assert!(s.dispatch(ms(7)).is_empty());
        let job2 = ItemKey { request: 2, stage: Stage::Denoise };
        assert_eq!(s.take_asks(), vec![(w, job2)], "the job dispatched last");
        assert!(s.dispatch(ms(8)).is_empty());
        assert!(s.take_asks().is_empty(), "one ask per interactive job waiting");
        // It yields at its next step: the interactive job takes the slot, the batch job waits
        // on the same try.
        assert!(!s.yielded(job2, first, ms(9)), "not its job");
        assert!(s.yielded(job2, w, ms(9)));
        let d = s.dispatch(ms(10));
        assert_eq!((d.len(), d[0].item.key.request, d[0].worker), (1, 10, w));
        assert_eq!(s.stats().preempt_asks, 1);
        assert_eq!(s.stats().yielded, 1);
        s.finished(d[0].item.key, w, ms(11));
        let d: Vec<_> =
            s.dispatch(ms(12)).into_iter().filter(|d| d.item.key.stage == Stage::Denoise).collect();
        assert_eq!((d[0].item.key, d[0].item.attempt), (job2, 1), "resumed before younger work");
        // An interactive job that arrives when the batch job finishes anyway: the ask is
        // settled by the result.
        to_denoise(&mut s, 11, Priority::Interactive, ms(13));
        s.dispatch(ms(13));
        let asks = s.take_asks();
        assert_eq!(asks.len(), 1);
        let (w, k) = asks[0];
        assert!(s.finished(k, w, ms(14)));
        assert_eq!(s.preempting, 0);
        let d = s.dispatch(ms(15));
        assert!(d.iter().any(|d| d.item.key == ItemKey { request: 11, stage: Stage::Denoise }));
    }

    #[test]
    fn a_credit_replaces_the_workers_slots_in_its_stages_total() {
        let mut s = sched();
        s.join(WorkerId(1), Stage::Denoise, 2, "h", vec![], ms(0));
        s.join(WorkerId(2), Stage::Denoise, 1, "h", vec![], ms(0));
        s.join(WorkerId(3), Stage::Decode, 5, "h", vec![], ms(0));
        assert_eq!(s.slots(Stage::Denoise), 3);
        s.credit(WorkerId(1), 4, ms(1));
        assert_eq!(s.slots(Stage::Denoise), 5, "2 replaced by 4");
        s.credit(WorkerId(1), 1, ms(2));
        assert_eq!(s.slots(Stage::Denoise), 2, "4 replaced by 1");
        assert_eq!(s.free_slots(Stage::Denoise), 2);
        assert_eq!(s.slots(Stage::Decode), 5, "another stage's total is untouched");
        s.credit(WorkerId(9), 7, ms(3));
        assert_eq!(s.slots(Stage::Denoise), 2, "an unknown worker's credit counts nowhere");
    }

    #[test]
    fn a_draining_worker_yields_its_jobs_and_takes_no_more() {
        let mut s = sched();
        s.join(WorkerId(1), Stage::Denoise, 2, "h", vec![], ms(0));
        s.join(WorkerId(3), Stage::Decode, 1, "h", vec![], ms(0));
        to_denoise(&mut s, 1, Priority::Batch, ms(0));
        to_denoise(&mut s, 2, Priority::Interactive, ms(0));
        assert_eq!(s.dispatch(ms(1)).len(), 2);
        assert!(s.drain(WorkerId(1), ms(2)));
        assert!(!s.drain(WorkerId(9), ms(2)), "unknown worker");
        let mut asks = s.take_asks();
        asks.sort();
        assert_eq!(asks.len(), 2, "every denoise job, whatever its class");
        s.credit(WorkerId(1), 4, ms(3));
        assert_eq!(s.slots(Stage::Denoise), 0, "a draining worker's credit stays 0");
        s.join(WorkerId(2), Stage::Denoise, 2, "h", vec![], ms(4));
        assert!(s.yielded(asks[0].1, WorkerId(1), ms(5)));
        assert!(s.take_drained().is_empty());
        let d = s.dispatch(ms(5));
        assert_eq!((d.len(), d[0].worker), (1, WorkerId(2)), "moved to another worker");
        assert!(s.finished(asks[1].1, WorkerId(1), ms(6)), "it may finish instead");
        assert_eq!(s.take_drained(), vec![WorkerId(1)]);
        assert!(s.take_drained().is_empty(), "reported once");
        // Encode or decode work is not asked to yield; an idle worker drains at once.
        s.join(WorkerId(4), Stage::Encode, 1, "h", vec![], ms(7));
        s.drain(WorkerId(4), ms(7));
        assert_eq!(s.take_drained(), vec![WorkerId(4)]);
    }

    #[test]
    fn slow_decode_pool_throttles_denoise_admission() {
        let mut s = sched();
        s.join(WorkerId(1), Stage::Encode, 16, "h", vec![], ms(0));
        s.join(WorkerId(2), Stage::Denoise, 8, "h", vec![], ms(0));
        s.join(WorkerId(3), Stage::Decode, 2, "h", vec![], ms(0));
        for r in 0..16 {
            submit(&mut s, r, Priority::Batch, ms(0));
        }
        for d in s.dispatch(ms(1)) {
            s.finished(d.item.key, d.worker, ms(1));
        }
        let d = s.dispatch(ms(2));
        assert_eq!(d.len(), 8, "no latent waits yet: every denoise slot is used");
        for x in &d {
            s.finished(x.item.key, x.worker, ms(3));
        }
        // Eight latents: decode takes two, six wait; denoise admits nothing while they do.
        let d = s.dispatch(ms(4));
        assert_eq!(d.len(), 2);
        assert!(d.iter().all(|x| x.item.key.stage == Stage::Decode), "{d:?}");
        assert_eq!(s.running(Stage::Denoise), 0);
        assert_eq!(s.queued(Stage::Denoise), 8);
        let mut decoding = d;
        // Drain decode until fewer than two latents wait: then denoise admits again.
        loop {
            let x = decoding.pop().unwrap();
            s.finished(x.item.key, x.worker, ms(5));
            let d = s.dispatch(ms(6));
            let den = d.iter().filter(|x| x.item.key.stage == Stage::Denoise).count();
            decoding.extend(d.into_iter().filter(|x| x.item.key.stage == Stage::Decode));
            if s.queued(Stage::Decode) < 2 {
                assert!(den > 0, "room downstream, yet no admission");
                break;
            }
            assert_eq!(den, 0, "admitted while {} latents wait", s.queued(Stage::Decode));
        }
    }

    #[test]
    fn dead_worker_requeues_and_late_result_is_ignored() {
        let mut s = Scheduler::new(
            SchedConfig { heartbeat_timeout: ms(100), max_attempts: 2, ..SchedConfig::default() },
            Box::new(RoundRobin::default()),
        );
        s.join(WorkerId(1), Stage::Encode, 1, "h", vec![], ms(0));
        submit(&mut s, 7, Priority::Interactive, ms(0));
        let d = s.dispatch(ms(0));
        assert_eq!(d[0].worker, WorkerId(1));
        s.join(WorkerId(2), Stage::Encode, 1, "h", vec![], ms(0));
        s.heartbeat(WorkerId(2), ms(150));
        let d = s.dispatch(ms(150)); // worker 1 is declared dead; the item goes to worker 2
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].worker, d[0].item.attempt), (WorkerId(2), 2));
        assert!(
            !s.finished(d[0].item.key, WorkerId(1), ms(160)),
            "late result from the dead worker"
        );
        assert!(s.finished(d[0].item.key, WorkerId(2), ms(170)));
        assert_eq!(s.stats().ignored, 1);
        // A worker rejoining after a partition starts empty: no duplicate work.
        s.join(WorkerId(1), Stage::Denoise, 1, "h", vec![], ms(171));
        s.heartbeat(WorkerId(2), ms(171));
        s.join(WorkerId(3), Stage::Decode, 1, "h", vec![], ms(171));
        let d = s.dispatch(ms(172));
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].worker, WorkerId(1));
    }

    #[test]
    fn max_attempts_fails_the_request() {
        let mut s = Scheduler::new(
            SchedConfig { max_attempts: 2, ..SchedConfig::default() },
            Box::new(MaxFreeCredit),
        );
        s.join(WorkerId(1), Stage::Encode, 1, "h", vec![], ms(0));
        submit(&mut s, 1, Priority::Batch, ms(0));
        for _ in 0..2 {
            let d = s.dispatch(ms(1));
            s.failed(d[0].item.key, WorkerId(1), "oom", ms(1));
        }
        let o = s.take_outcomes();
        assert!(
            matches!(&o[..], [Outcome::Failed { request: 1, reason }] if reason.contains("oom")),
            "{o:?}"
        );
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn a_lost_input_runs_the_stage_before_again() {
        let mut s = sched();
        for (id, st) in [(1, Stage::Encode), (2, Stage::Denoise), (3, Stage::Decode)] {
            s.join(WorkerId(id), st, 1, "h", vec![], ms(0));
        }
        submit(&mut s, 1, Priority::Batch, ms(0));
        for t in 1..3 {
            let d = s.dispatch(ms(t)).remove(0);
            assert!(s.finished(d.item.key, d.worker, ms(t)));
        }
        // The denoise worker's latent is gone: decode says so, and denoise runs again.
        let dec = s.dispatch(ms(3)).remove(0);
        assert_eq!(dec.item.key.stage, Stage::Decode);
        assert!(s.lost_input(dec.item.key, dec.worker, "producer gone", ms(3)));
        assert!(!s.lost_input(dec.item.key, dec.worker, "again", ms(3)), "reported once");
        let den = s.dispatch(ms(4)).remove(0);
        assert_eq!((den.item.key.stage, den.item.attempt), (Stage::Denoise, 1));
        assert_eq!(s.stats().reran, 1);
        assert!(s.finished(den.item.key, den.worker, ms(5)));
        let dec = s.dispatch(ms(6)).remove(0);
        assert!(s.finished(dec.item.key, dec.worker, ms(7)));
        assert_eq!(s.take_outcomes(), vec![Outcome::Completed { request: 1 }]);
        // Past max_attempts re-runs, a lost input counts as a failure of the stage itself.
        submit(&mut s, 2, Priority::Batch, ms(10));
        let mut t = 10;
        let reason = loop {
            t += 1;
            let Some(d) = s.dispatch(ms(t)).pop() else {
                break s.take_outcomes();
            };
            if d.item.key.stage == Stage::Decode {
                s.lost_input(d.item.key, d.worker, "producer gone", ms(t));
            } else {
                s.finished(d.item.key, d.worker, ms(t));
            }
        };
        assert!(
            matches!(&reason[..], [Outcome::Failed { request: 2, reason }] if reason.contains("input lost")),
            "{reason:?}"
        );
        assert_eq!(s.stats().reran, 1 + 3);
    }

    #[test]
    fn affinity_prefers_host_then_label() {
        let mut p = AffinityFirst;
        let item = Item {
            key: ItemKey { request: 1, stage: Stage::Decode },
            priority: Priority::Batch,
            deadline: Duration::MAX,
            attempt: 1,
            affinity_host: Some("b".into()),
            affinity_labels: vec!["rail1".into()],
            enqueued: ms(0),
            seq: 0,
        };
        let l0 = vec!["rail0".to_string()];
        let l1 = vec!["rail1".to_string()];
        let c = [
            Candidate { id: WorkerId(1), free: 9, host: "a", labels: &l0 },
            Candidate { id: WorkerId(2), free: 1, host: "c", labels: &l1 },
            Candidate { id: WorkerId(3), free: 1, host: "b", labels: &l0 },
        ];
        assert_eq!(p.pick(&item, &c), 2);
        assert_eq!(p.pick(&item, &c[..2]), 1);
    }

    /// [`MaxFreeCredit`]'s choice made by listing every candidate (what the index replaces).
    struct ListedMaxFree;

    impl RoutingPolicy for ListedMaxFree {
        fn pick(&mut self, item: &Item, c: &[Candidate<'_>]) -> usize {
            MaxFreeCredit.pick(item, c)
        }
    }

    /// A policy that takes the index for some items and lists candidates for the others.
    struct Mixed;

    impl RoutingPolicy for Mixed {
        fn pick(&mut self, item: &Item, c: &[Candidate<'_>]) -> usize {
            MaxFreeCredit.pick(item, c)
        }
        fn picks_most_free(&self, item: &Item) -> bool {
            item.key.request % 3 != 0
        }
    }

    proptest! {
        /// The index of workers by free slots picks what listing every candidate picks: the same
        /// dispatches, in the same order, under random joins, credit changes, leaves, results
        /// and submits, whether every item takes the index, none does, or some do.
        #[test]
        fn the_free_slot_index_picks_what_the_listing_picks(ops in proptest::collection::vec((0u8..6, 0u64..8, 0u64..40), 1..300)) {
            let cfg = SchedConfig { heartbeat_timeout: Duration::MAX, preempt: false, ..SchedConfig::default() };
            let mut runs: Vec<Scheduler> = vec![
                Scheduler::new(cfg.clone(), Box::new(MaxFreeCredit)),
                Scheduler::new(cfg.clone(), Box::new(ListedMaxFree)),
                Scheduler::new(cfg, Box::new(Mixed)),
            ];
            let stages = [Stage::Encode, Stage::Denoise, Stage::Decode];
            let mut running: Vec<Dispatch> = Vec::new();
            let mut next_req = 0u64;
            let now = ms(0);
            for (op, a, b) in ops {
                let mut outs = Vec::new();
                for s in &mut runs {
                    match op {
                        0 | 1 => submit(s, next_req, if a % 2 == 0 { Priority::Batch } else { Priority::Interactive }, now),
                        2 => s.join(WorkerId(a), stages[(a % 3) as usize], 1 + (b % 4) as u32, "h", vec![], now),
                        3 => s.credit(WorkerId(a), (b % 5) as u32, now),
                        4 => s.leave(WorkerId(a), now),
                        _ => {
                            if !running.is_empty() {
                                let d = &running[(b as usize) % running.len()];
                                s.finished(d.item.key, d.worker, now);
                            }
                        }
                    }
                    let d: Vec<(ItemKey, WorkerId)> = s.dispatch(now).into_iter().map(|d| (d.item.key, d.worker)).collect();
                    outs.push(d);
                }
                if op < 2 {
                    next_req += 1;
                }
                if op == 5 && !running.is_empty() {
                    running.swap_remove((b as usize) % running.len());
                }
                if op == 4 {
                    running.retain(|d| d.worker != WorkerId(a));
                }
                prop_assert_eq!(&outs[0], &outs[1], "the index and the listing differ");
                prop_assert_eq!(&outs[0], &outs[2], "a mix of both differs");
                for (key, worker) in &outs[0] {
                    let item = runs[0].running.get(key).map(|(_, i)| i.clone());
                    if let Some(item) = item {
                        running.push(Dispatch { item, worker: *worker });
                    }
                }
                for s in &runs {
                    for st in stages {
                        let by: Vec<WorkerId> = s.by_free[st.index()].iter().map(|&(_, id)| id).collect();
                        let mut by_sorted = by.clone();
                        by_sorted.sort();
                        let free: Vec<WorkerId> = s.free[st.index()].iter().copied().collect();
                        prop_assert_eq!(&by_sorted, &free, "the two indexes disagree");
                        for &(std::cmp::Reverse(n), id) in &s.by_free[st.index()] {
                            let w = &s.workers[&id];
                            prop_assert_eq!(n, w.slots.saturating_sub(w.busy), "{:?} listed under a stale count", id);
                        }
                    }
                }
            }
        }

        /// Random joins, deaths, heartbeats, credit changes, results, failures, lost inputs
        /// (which re-run the stage before), drains and yields (asked for or not, racing with
        /// results and deaths): a dispatch
        /// never takes a worker past its credit (busy <= slots, except for a worker whose credit
        /// was lowered below what it already runs), no item runs twice, nothing is lost, and
        /// every request ends exactly once.
        #[test]
        fn invariants(ops in proptest::collection::vec((0u8..12, 0u64..6, 0u64..40), 1..400)) {
            let mut s = Scheduler::new(SchedConfig { heartbeat_timeout: ms(50), max_attempts: 3, aging: ms(30), decode_headroom: 1, preempt: true }, Box::new(MaxFreeCredit));
            let stages = [Stage::Encode, Stage::Denoise, Stage::Decode];
            let mut now = ms(0);
            let mut next_req = 0u64;
            let mut running: Vec<Dispatch> = Vec::new();
            let mut ended: HashMap<u64, u32> = HashMap::new();
            // Workers whose credit was lowered below their running items.
            let mut over: std::collections::HashSet<WorkerId> = Default::default();
            for (op, a, b) in ops {
                now += ms(b % 20);
                match op {
                    0 | 1 => { submit(&mut s, next_req, if a % 2 == 0 { Priority::Batch } else { Priority::Interactive }, now); next_req += 1; }
                    2 => s.join(WorkerId(a), stages[(a % 3) as usize], 1 + (b % 3) as u32, "h", vec![], now),
                    3 => s.leave(WorkerId(a), now),
                    4 => { for id in 0..6 { if id != a { s.heartbeat(WorkerId(id), now); } } }
                    5 | 6 | 8 if !running.is_empty() => {
                        let d = running.swap_remove((b as usize) % running.len());
                        match op {
                            5 => { s.finished(d.item.key, d.worker, now); }
                            6 => { s.failed(d.item.key, d.worker, "x", now); }
                            _ => { s.lost_input(d.item.key, d.worker, "producer died", now); }
                        }
                    }
                    7 => s.credit(WorkerId(a), (b % 4) as u32, now),
                    9 | 10 if !running.is_empty() => {
                        // A yield: of a job asked to (op 9, when there is one) or of any.
                        let asked = running.iter().position(|d| s.is_asked(d.item.key));
                        let i = asked.filter(|_| op == 9).unwrap_or((b as usize) % running.len());
                        let d = running.swap_remove(i);
                        let (attempt, held) = (d.item.attempt, s.holder(d.item.key));
                        prop_assert_eq!(s.yielded(d.item.key, d.worker, now), held == Some(d.worker));
                        if held == Some(d.worker) {
                            let q = s.queues[d.item.key.stage.index()].order.values().find(|i| i.key == d.item.key);
                            prop_assert_eq!(q.map(|i| i.attempt), Some(attempt), "queued again on the same try");
                        }
                    }
                    11 => { s.drain(WorkerId(a), now); }
                    _ => {}
                }
                for (id, w) in &s.workers {
                    if w.busy > w.slots { over.insert(*id); } else { over.remove(id); }
                }
                let before: HashMap<WorkerId, u32> = s.workers.iter().map(|(&id, w)| (id, w.busy)).collect();
                let fresh = s.dispatch(now);
                for (id, w) in &s.workers {
                    if w.busy > before.get(id).copied().unwrap_or(0) {
                        prop_assert!(w.busy <= w.slots, "dispatched past the credit of {:?}: {} of {}", id, w.busy, w.slots);
                    }
                }
                // Forget dispatches the scheduler took back (dead, departed or rejoined workers).
                running.retain(|d| {
                    s.running.get(&d.item.key).is_some_and(|(w, it)| *w == d.worker && it.attempt == d.item.attempt)
                        && !fresh.iter().any(|f| f.item.key == d.item.key && f.item.attempt == d.item.attempt)
                });
                for d in fresh {
                    prop_assert!(!running.iter().any(|r| r.item.key == d.item.key), "dispatched twice concurrently");
                    prop_assert_eq!(s.running.get(&d.item.key).map(|(w, _)| *w), Some(d.worker));
                    running.push(d);
                }
                for (id, w) in &s.workers {
                    prop_assert!(w.busy <= w.slots || over.contains(id), "{:?} runs {} items on {} slots", id, w.busy, w.slots);
                    prop_assert_eq!(w.busy as usize, w.items.len());
                }
                // Every ask is for a running job; the interactive ones are counted right; a
                // draining worker takes nothing new and is reported once it holds nothing.
                let mut asks = 0;
                for (k, f) in &s.asked {
                    prop_assert!(s.running.contains_key(k), "ask for {:?}, not running", k);
                    asks += usize::from(*f);
                }
                prop_assert_eq!(asks, s.preempting);
                for k in s.preemptible.values() {
                    prop_assert!(s.running.get(k).is_some_and(|(_, i)| i.priority == Priority::Batch && k.stage == Stage::Denoise));
                }
                for st in stages {
                    let n = s.queues[st.index()].order.values().filter(|i| i.priority == Priority::Interactive).count();
                    prop_assert_eq!(n, s.interactive[st.index()]);
                }
                for (id, _) in s.take_asks() {
                    prop_assert!(s.workers.contains_key(&id));
                }
                for id in s.take_drained() {
                    prop_assert!(s.draining.contains(&id) && s.workers[&id].items.is_empty(), "drained {:?} holds items", id);
                }
                for id in &s.draining {
                    prop_assert_eq!(s.workers[id].slots, 0);
                }
                for st in stages {
                    let free: std::collections::BTreeSet<WorkerId> = s.workers.iter().filter(|(_, w)| w.stage == st && w.busy < w.slots).map(|(&id, _)| id).collect();
                    prop_assert_eq!(&free, &s.free[st.index()], "free index");
                    prop_assert_eq!(s.slots(st), s.workers.values().filter(|w| w.stage == st).map(|w| w.slots).sum::<u32>());
                    prop_assert_eq!(s.running(st), s.running.keys().filter(|k| k.stage == st).count());
                }
                for o in s.take_outcomes() {
                    let r = match o { Outcome::Completed { request } | Outcome::Failed { request, .. } => request };
                    *ended.entry(r).or_default() += 1;
                }
                // Nothing lost: every live request is queued or running somewhere.
                let accounted = s.queues.iter().map(|q| q.order.len()).sum::<usize>() + s.running.len();
                prop_assert_eq!(accounted, s.in_flight());
            }
            prop_assert!(ended.values().all(|&n| n == 1), "a request ended twice");
            prop_assert_eq!(ended.len() + s.in_flight(), next_req as usize);
        }
    }
}
