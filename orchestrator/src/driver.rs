//! The one driver of the scheduler core, shared by the library orchestrator, the network service
//! and the simulator. It owns the [`Scheduler`] and everything around it that all three need:
//! worker ids and their endpoints (`W`: a handler, a connection, nothing), who waits for each
//! request (`R`), the outputs a stage reported (the next stage's inputs), per-stage busy time,
//! and the metrics. Time is passed in; it does no IO. Each caller only moves events in and acts
//! on what comes out ([`Driver::dispatch`], [`Driver::take_outcomes`]).
//!
//! Inputs outlive failures: every output a request's stages reported is kept until the request
//! ends, completed or failed; then the driver hands them to a live worker to release
//! ([`Driver::releases`]) and keeps them until that worker says it did ([`Driver::released`]),
//! giving them to another if it leaves first. A worker that dies at any stage before that finds
//! its inputs where they were when the item is re-queued, and a stage whose p2p output died
//! with its producer can run again from its own inputs (see [`StageResult::LostInput`]).
//!
//! Durability: with [`Driver::record_facts`] on, every decision that says where a request is
//! comes out as a journal [`Fact`] ([`Driver::take_facts`]); the service writes them to disk
//! before it acts on them, and a restarted service rebuilds its driver from their fold
//! ([`Driver::restore`]). Workers that reconnect claim the items they still run
//! ([`Driver::claim`]); submitters ask for their requests again ([`Driver::resume`]).

use crate::fasthash::FastMap;
use std::time::Duration;

use crate::journal::{Book, Fact, RECENT, release_list};
use crate::sched::{
    Dispatch, ItemKey, Outcome, Restore, RoutingPolicy, SchedConfig, SchedStats, Scheduler, Submit,
    WorkerId,
};
use crate::timeline::{Mark, Timeline, Timelines};
use crate::{Priority, Stage};

/// The stages before `stage`, by [`Stage::index`]: their results stand for a request that is
/// at `stage` (it started or was restored there).
fn stages_before(stage: Stage) -> [bool; 3] {
    std::array::from_fn(|i| i < stage.index())
}

/// A snapshot of an orchestrator.
#[derive(Debug, Clone, Default)]
pub struct OrchestratorStats {
    /// Scheduler counters.
    pub sched: SchedStats,
    /// Queue depth per stage (indexed by [`Stage::index`]).
    pub queued: [usize; 3],
    /// Running items per stage.
    pub running: [usize; 3],
    /// Busy time per stage summed over its workers (utilisation numerator).
    pub busy: [Duration; 3],
    /// Slots per stage.
    pub slots: [u32; 3],
    /// Time since start.
    pub elapsed: Duration,
    /// Results accepted for a stage that had already been accepted for the same request, with
    /// no lost input since (a stage run twice): 0 unless something is wrong.
    pub duplicated: u64,
    /// Ended requests whose outputs no worker has said it released yet.
    pub unreleased: usize,
    /// Items rebuilt after a restart that wait for their worker to claim them.
    pub parked: usize,
}

/// How often a driver loop publishes its levels ([`Driver::publish_metrics`]).
const METRICS_EVERY: Duration = Duration::from_millis(500);

/// Whether a driver loop that last published its levels at `published` publishes them at `now`.
pub(crate) fn metrics_due(now: Duration, published: Duration) -> bool {
    now.saturating_sub(published) >= METRICS_EVERY
}

/// A dispatch decision with what the worker needs to act on it.
#[derive(Debug)]
pub struct Assignment<'a, W> {
    /// The decision.
    pub dispatch: Dispatch,
    /// The worker's endpoint.
    pub worker: &'a W,
    /// What the previous stage reported for this request (empty for the first stage).
    pub inputs: &'a [u8],
    /// The item's last checkpoint (step, saved state), if a worker that ran it before made one:
    /// resume from there.
    pub resume: Option<(u32, &'a [u8])>,
}

/// A request's outputs to release, given to a worker.
#[derive(Debug)]
pub struct Release<'a, W> {
    /// The request (it ended).
    pub request: u64,
    /// Every output its stages reported.
    pub outputs: &'a [Vec<u8>],
    /// The worker asked to release them...
    pub worker: &'a W,
    /// ...and its id.
    pub id: WorkerId,
}

/// Outputs waiting to be released, and the worker asked to.
#[derive(Debug)]
struct Pending {
    outputs: Vec<Vec<u8>>,
    by: Option<WorkerId>,
}

/// A request that ended.
#[derive(Debug)]
pub struct Ended<R> {
    /// How.
    pub outcome: Outcome,
    /// Who waits for it.
    pub waiter: Option<R>,
}

/// How a worker ended an item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageResult {
    /// It finished; its outputs (the next stage's inputs).
    Done(Vec<u8>),
    /// It failed; re-queued with the next attempt (up to the limit).
    Failed(String),
    /// Its input is gone (the producer of a p2p payload died after its result was accepted):
    /// the stage before runs again.
    LostInput(String),
}

/// The scheduler with its bookkeeping.
pub struct Driver<W, R> {
    sched: Scheduler,
    workers: FastMap<WorkerId, W>,
    waiting: FastMap<u64, R>,
    /// Per request, every output its stages reported, in order.
    outputs: FastMap<u64, Vec<(Stage, Vec<u8>)>>,
    started: FastMap<ItemKey, Duration>,
    /// Per request, the stages whose result stands (a lost input clears the stage before).
    accepted: FastMap<u64, [bool; 3]>,
    /// Ended requests' outputs not yet released.
    unreleased: std::collections::BTreeMap<u64, Pending>,
    /// Per request, outputs announced by workers before they existed.
    announced: FastMap<u64, Vec<Vec<u8>>>,
    /// Per request that started past the first stage: that stage and its given inputs (never
    /// released: they are not the request's own, e.g. a cache entry).
    given: FastMap<u64, (Stage, Vec<u8>)>,
    /// Per item: its last checkpoint (step, saved state).
    checkpoints: FastMap<ItemKey, (u32, Vec<u8>)>,
    duplicated: u64,
    busy: [Duration; 3],
    next_worker: u64,
    /// Journal facts not yet taken (`None`: not recording).
    facts: Option<Vec<Fact>>,
    /// The last [`RECENT`] outcomes, for a submitter asking again (oldest first).
    recent: std::collections::VecDeque<u64>,
    recent_by: FastMap<u64, Outcome>,
    timelines: Timelines,
    /// The latest time any call gave (the end time of outcomes taken without one).
    clock: Duration,
}

impl<W, R> std::fmt::Debug for Driver<W, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("sched", &self.sched)
            .field("workers", &self.workers.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

impl<W, R> Driver<W, R> {
    /// A driver over a fresh scheduler.
    pub fn new(cfg: SchedConfig, policy: Box<dyn RoutingPolicy>) -> Self {
        Driver {
            sched: Scheduler::new(cfg, policy),
            workers: FastMap::default(),
            waiting: FastMap::default(),
            outputs: FastMap::default(),
            started: FastMap::default(),
            accepted: FastMap::default(),
            unreleased: std::collections::BTreeMap::new(),
            announced: FastMap::default(),
            given: FastMap::default(),
            checkpoints: FastMap::default(),
            duplicated: 0,
            busy: [Duration::ZERO; 3],
            next_worker: 0,
            facts: None,
            recent: std::collections::VecDeque::new(),
            recent_by: FastMap::default(),
            timelines: Timelines::default(),
            clock: Duration::ZERO,
        }
    }

    /// From now on, keep the journal facts for [`Driver::take_facts`].
    pub fn record_facts(&mut self) {
        self.facts.get_or_insert_with(Vec::new);
    }

    /// The facts recorded since the last call.
    pub fn take_facts(&mut self) -> Vec<Fact> {
        self.facts.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Keeps the fact `f` makes, when recording (made only then: most drivers do not record).
    fn record(&mut self, f: impl FnOnce() -> Fact) {
        if let Some(v) = &mut self.facts {
            v.push(f());
        }
    }

    fn remember(&mut self, o: &Outcome) {
        if self.recent.len() >= RECENT {
            if let Some(old) = self.recent.pop_front() {
                self.recent_by.remove(&old);
            }
        }
        self.recent.push_back(o.request());
        self.recent_by.insert(o.request(), o.clone());
    }

    /// Rebuilds the state a journal replayed to, at `now`: requests in flight wait at the stage
    /// they had reached, those handed out parked until `now + grace` so the workers that ran
    /// them can claim them, the others queued; ended requests' outputs wait to be released; recent outcomes answer submitters
    /// that ask again. Call on a fresh driver, before any worker joins.
    pub fn restore(&mut self, book: &Book, now: Duration, grace: Duration) {
        for o in &book.recent {
            self.remember(o);
        }
        for (&request, e) in &book.entries {
            if let Some(o) = &e.ended {
                self.remember(o);
                let outputs = e.to_release();
                if !outputs.is_empty() {
                    self.unreleased.insert(request, Pending { outputs, by: None });
                }
                continue;
            }
            self.timelines.begin(request, e.priority, Mark::Restored, now);
            self.timelines.mark(request, e.stage, Mark::Queued, now);
            let r = Restore {
                request,
                priority: e.priority,
                stage: e.stage,
                attempt: e.attempt,
                reruns: e.reruns,
            };
            // Only a try handed out before the restart may have a worker to claim it.
            let until = if e.dispatched { now + grace } else { now };
            if !self.sched.restore(r, until, now) {
                continue;
            }
            if !e.outputs.is_empty() {
                self.outputs.insert(request, e.outputs.clone());
            }
            if !e.announced.is_empty() {
                self.announced.insert(request, e.announced.clone());
            }
            self.give(request, e.start.0, e.start.1.clone());
            if let Some(cp) = &e.checkpoint {
                self.checkpoints.insert(ItemKey { request, stage: e.stage }, cp.clone());
            }
            self.accepted.insert(request, stages_before(e.stage));
        }
    }

    /// `worker` (reconnected) says it runs `key` on `attempt`: see [`Scheduler::claim`].
    pub fn claim(&mut self, worker: WorkerId, key: ItemKey, attempt: u32, now: Duration) -> bool {
        let ok = self.sched.claim(key, worker, attempt, now);
        if ok {
            self.started.insert(key, now);
        }
        ok
    }

    /// A submitter asks for `s` again (it reconnected): `waiter` gets the outcome of the request
    /// in flight, or at once (as the error) the outcome of one that ended recently; a request
    /// never seen is submitted now.
    pub fn resume(
        &mut self,
        s: Submit,
        inputs: Vec<u8>,
        waiter: R,
        now: Duration,
    ) -> Result<(), (R, Outcome)> {
        // In flight, or ended in this very turn (its outcome not taken yet): the waiter gets
        // the outcome when it is.
        if self.sched.in_flight_request(s.request) || self.sched.ended_untaken(s.request) {
            self.waiting.insert(s.request, waiter);
            return Ok(());
        }
        if let Some(o) = self.recent_by.get(&s.request) {
            return Err((waiter, o.clone()));
        }
        self.submit_with(s, inputs, waiter, now)
    }

    /// The scheduler (read-only).
    pub fn sched(&self) -> &Scheduler {
        &self.sched
    }

    /// A new worker of `stage` reached through `endpoint`; returns its id.
    pub fn join(
        &mut self,
        stage: Stage,
        slots: u32,
        host: &str,
        labels: Vec<String>,
        endpoint: W,
        now: Duration,
    ) -> WorkerId {
        self.next_worker += 1;
        let id = WorkerId(self.next_worker);
        self.sched.join(id, stage, slots, host, labels, now);
        self.workers.insert(id, endpoint);
        id
    }

    /// A worker left (its connection closed, its process died): its items are re-queued now.
    pub fn leave(&mut self, id: WorkerId, now: Duration) {
        self.workers.remove(&id);
        self.sched.leave(id, now);
        self.unassign(id);
        self.mark_orphans(now);
    }

    /// Items that were running and are held by no worker now (their worker left or was
    /// declared dead, and the scheduler queued them again): marked in their timelines.
    fn mark_orphans(&mut self, now: Duration) {
        let orphans: Vec<ItemKey> =
            self.started.keys().filter(|k| self.sched.holder(**k).is_none()).copied().collect();
        for key in orphans {
            self.started.remove(&key); // not run to its end: no busy time
            self.timelines.mark(key.request, key.stage, Mark::Requeued, now);
            if self.sched.in_flight_request(key.request) {
                self.timelines.mark(key.request, key.stage, Mark::Queued, now);
            }
        }
    }

    /// Releases `id` was asked to do go to another worker.
    fn unassign(&mut self, id: WorkerId) {
        for p in self.unreleased.values_mut().filter(|p| p.by == Some(id)) {
            p.by = None;
        }
    }

    /// Workers the scheduler declared dead since the last call, with their endpoints (drop them
    /// to close the connections).
    pub fn take_dead(&mut self) -> Vec<(WorkerId, W)> {
        let dead = self.sched.take_dead();
        for &id in &dead {
            self.unassign(id);
        }
        if !dead.is_empty() {
            self.mark_orphans(self.clock);
        }
        dead.into_iter().filter_map(|id| Some((id, self.workers.remove(&id)?))).collect()
    }

    /// A worker is alive.
    pub fn heartbeat(&mut self, id: WorkerId, now: Duration) {
        self.sched.heartbeat(id, now);
    }

    /// Every worker is alive (in-process workers live as long as the driver).
    pub fn heartbeat_all(&mut self, now: Duration) {
        for &id in self.workers.keys() {
            self.sched.heartbeat(id, now);
        }
    }

    /// A worker advertises its free slots.
    pub fn credit(&mut self, id: WorkerId, slots: u32, now: Duration) {
        self.sched.credit(id, slots, now);
    }

    /// A new request; `waiter` gets its outcome. A duplicate id is refused: the waiter comes back
    /// with the failed outcome.
    pub fn submit(&mut self, s: Submit, waiter: R, now: Duration) -> Result<(), (R, Outcome)> {
        self.submit_with(s, Vec::new(), waiter, now)
    }

    /// [`Driver::submit`] with the inputs of its start stage (`s.start`), when it starts past
    /// the first: e.g. a cached embedding's reference, and denoise runs at once. The inputs are
    /// not the request's own outputs and are never handed out for release.
    ///
    /// With `s.resume`, its start stage resumes from that checkpoint (edit and resume from an
    /// earlier request's checkpoint, e.g. with changed parameters): the first try's assignment
    /// carries it, as a try after a failure would carry the request's own. It is not the
    /// request's either, and is never released.
    pub fn submit_with(
        &mut self,
        mut s: Submit,
        inputs: Vec<u8>,
        waiter: R,
        now: Duration,
    ) -> Result<(), (R, Outcome)> {
        let (request, priority, start) = (s.request, s.priority, s.start);
        let resume = s.resume.take();
        if !self.sched.submit(s, now) {
            let reason = format!("request id {request} is already in flight");
            return Err((waiter, Outcome::Failed { request, reason }));
        }
        self.record(|| Fact::Submitted { request, priority, start, inputs: inputs.clone() });
        self.clock = now;
        self.timelines.begin(request, priority, Mark::Submitted, now);
        self.timelines.mark(request, start, Mark::Queued, now);
        if let Some((step, data)) = resume {
            self.record(|| Fact::ResumeFrom { request, step, data: data.clone() });
            self.checkpoints.insert(ItemKey { request, stage: start }, (step, data));
        }
        if start != Stage::ALL[0] {
            self.accepted.insert(request, stages_before(start));
        }
        self.give(request, start, inputs);
        self.waiting.insert(request, waiter);
        Ok(())
    }

    /// Keeps the inputs a request was given for its start stage (none to keep for a plain
    /// request).
    fn give(&mut self, request: u64, start: Stage, inputs: Vec<u8>) {
        if start != Stage::ALL[0] || !inputs.is_empty() {
            self.given.insert(request, (start, inputs));
        }
    }

    /// Who waits for `request`.
    pub fn waiter(&self, request: u64) -> Option<&R> {
        self.waiting.get(&request)
    }

    /// A worker ended an item. Returns false when the result was ignored (a late or foreign
    /// result).
    pub fn result(
        &mut self,
        worker: WorkerId,
        key: ItemKey,
        result: StageResult,
        now: Duration,
    ) -> bool {
        self.clock = now;
        let mark = match &result {
            StageResult::Done(_) => Mark::Done,
            StageResult::Failed(_) => Mark::Failed,
            StageResult::LostInput(_) => Mark::LostInput,
        };
        let accepted = match result {
            StageResult::Done(outputs) => {
                let accepted = self.sched.finished(key, worker, now);
                if accepted {
                    self.record(|| Fact::Accepted { key, outputs: outputs.clone() });
                }
                if accepted && !outputs.is_empty() {
                    self.outputs.entry(key.request).or_default().push((key.stage, outputs));
                }
                if accepted && self.sched.in_flight_request(key.request) {
                    let done = self.accepted.entry(key.request).or_default();
                    self.duplicated += u64::from(done[key.stage.index()]);
                    done[key.stage.index()] = true;
                }
                accepted
            }
            StageResult::Failed(reason) => self.sched.failed(key, worker, &reason, now),
            StageResult::LostInput(reason) => {
                let accepted = self.sched.lost_input(key, worker, &reason, now);
                if let (true, Some(p)) = (accepted, key.stage.prev()) {
                    self.accepted.entry(key.request).or_default()[p.index()] = false;
                    self.record(|| Fact::LostInput { key });
                }
                accepted
            }
        };
        if accepted {
            self.checkpoints.remove(&key); // done, or it cannot run from here: not resumed
        }
        if accepted {
            self.stopped_running(key, now);
            self.timelines.mark(key.request, key.stage, mark, now);
            let next = match mark {
                Mark::Done => key.stage.next(),
                Mark::LostInput => key.stage.prev(),
                _ => Some(key.stage), // tried again, unless the request failed
            };
            if let Some(n) = next.filter(|_| self.sched.in_flight_request(key.request)) {
                self.timelines.mark(key.request, n, Mark::Queued, now);
            }
        }
        accepted
    }

    /// `worker`, which runs `key`, will output `data` (it says so before the outputs exist):
    /// released with the request's other outputs when it ends, even if `worker` dies first.
    /// Ignored from a worker that does not hold the item.
    pub fn announce(&mut self, worker: WorkerId, key: ItemKey, data: Vec<u8>, now: Duration) {
        if self.sched.holder(key) == Some(worker) && !data.is_empty() {
            self.timelines.mark(key.request, key.stage, Mark::Announced, now);
            let a = self.announced.entry(key.request).or_default();
            if !a.contains(&data) {
                a.push(data.clone());
                self.record(|| Fact::Announced { request: key.request, data });
            }
        }
    }

    /// `worker`, which runs `key`, says how its inputs arrived (a [`Mark::Handoff`]): kept in
    /// the request's timeline. Ignored from a worker that does not hold the item.
    pub fn handoff(&mut self, worker: WorkerId, key: ItemKey, mark: Mark, now: Duration) {
        if self.sched.holder(key) == Some(worker) {
            self.timelines.mark(key.request, key.stage, mark, now);
        }
    }

    /// `worker`, which runs `key`, saved its state at `step` as `data` (e.g. a step checkpoint's
    /// reference): the item's next try resumes there, and `data` is released with the request's
    /// outputs. Ignored from a worker that does not hold the item.
    pub fn checkpoint(&mut self, worker: WorkerId, key: ItemKey, step: u32, data: Vec<u8>) {
        if self.sched.holder(key) != Some(worker) {
            return;
        }
        if !data.is_empty() {
            let a = self.announced.entry(key.request).or_default();
            if !a.contains(&data) {
                a.push(data.clone());
            }
        }
        self.record(|| Fact::Checkpointed { key, step, data: data.clone() });
        self.checkpoints.insert(key, (step, data));
    }

    /// `worker` gave `key` back at a step boundary (asked to by [`Driver::take_asks`], or on its
    /// own), with its state saved at `step` as `data` (as [`Driver::checkpoint`]; empty data:
    /// no new checkpoint, the last one stands). The job waits in the queue again, and its next
    /// worker resumes it from the checkpoint. Returns false when ignored (not its job).
    pub fn yielded(
        &mut self,
        worker: WorkerId,
        key: ItemKey,
        step: u32,
        data: Vec<u8>,
        now: Duration,
    ) -> bool {
        if self.sched.holder(key) != Some(worker) {
            return false;
        }
        if !data.is_empty() {
            self.checkpoint(worker, key, step, data);
        }
        let ok = self.sched.yielded(key, worker, now);
        if ok {
            self.record(|| Fact::Yielded { key });
            self.stopped_running(key, now);
            self.timelines.mark(key.request, key.stage, Mark::Yielded, now);
            self.timelines.mark(key.request, key.stage, Mark::Queued, now);
        }
        ok
    }

    /// `key` stopped running at `now`: its run counts towards its stage's busy time.
    fn stopped_running(&mut self, key: ItemKey, now: Duration) {
        if let Some(t) = self.started.remove(&key) {
            self.busy[key.stage.index()] += now.saturating_sub(t);
        }
    }

    /// Jobs to yield, asked since the last call (preemption for a waiting interactive job, or
    /// a drain), each with its worker's endpoint: tell each worker to checkpoint the job at its
    /// next step boundary and give it back ([`Driver::yielded`]). A driver whose workers cannot
    /// yield may drop them (the jobs then run to their end).
    pub fn take_asks(&mut self) -> Vec<(ItemKey, WorkerId, &W)> {
        let asks = self.sched.take_asks();
        asks.into_iter().filter_map(|(id, key)| Some((key, id, self.workers.get(&id)?))).collect()
    }

    /// The endpoint `worker` joined with.
    pub fn endpoint(&self, worker: WorkerId) -> Option<&W> {
        self.workers.get(&worker)
    }

    /// Scale-down of `worker`: see [`Scheduler::drain`]. Returns false for an unknown worker.
    pub fn drain(&mut self, worker: WorkerId, now: Duration) -> bool {
        self.sched.drain(worker, now)
    }

    /// Draining workers that hold nothing now, with their endpoints (they may stop).
    pub fn take_drained(&mut self) -> Vec<(WorkerId, &W)> {
        let drained = self.sched.take_drained();
        drained.into_iter().filter_map(|id| Some((id, self.workers.get(&id)?))).collect()
    }

    /// Every dispatch decision possible now, each with its worker's endpoint and inputs.
    /// Decisions for a worker without an endpoint (it left) are dropped; the scheduler re-queues
    /// them when the worker is declared gone.
    pub fn dispatch(&mut self, now: Duration) -> Vec<Assignment<'_, W>> {
        self.clock = now;
        let decisions = self.sched.dispatch(now);
        for d in &decisions {
            let key = d.item.key;
            metrics::counter!("tensorwire_dispatched_total", "stage" => key.stage.name())
                .increment(1);
            self.timelines.mark(
                key.request,
                key.stage,
                Mark::Dispatched { worker: d.worker.0 },
                now,
            );
            self.started.insert(d.item.key, now);
            if let Some(v) = &mut self.facts {
                v.push(Fact::Dispatched { key: d.item.key, attempt: d.item.attempt });
            }
        }
        decisions
            .into_iter()
            .filter_map(|d| {
                let worker = self.workers.get(&d.worker)?;
                let key = d.item.key;
                let outs = self.outputs.get(&key.request).map_or(&[][..], Vec::as_slice);
                // The latest output of the stage before (a re-run replaces an earlier one), or
                // the inputs the request was given for this stage.
                let from = key.stage.prev().and_then(|p| outs.iter().rposition(|(s, _)| *s == p));
                let given = self.given.get(&key.request).filter(|(s, _)| *s == key.stage);
                let inputs = match (from, given) {
                    (Some(i), _) => outs[i].1.as_slice(),
                    (None, Some((_, g))) => g.as_slice(),
                    (None, None) => &[][..],
                };
                let resume = self.checkpoints.get(&key).map(|(s, d)| (*s, d.as_slice()));
                Some(Assignment { dispatch: d, worker, inputs, resume })
            })
            .collect()
    }

    /// Requests that ended since the last call, each with its waiter. Their outputs now wait
    /// to be released (see [`Driver::releases`]).
    pub fn take_outcomes(&mut self) -> Vec<Ended<R>> {
        self.sched
            .take_outcomes()
            .into_iter()
            .map(|outcome| {
                let r = outcome.request();
                let ok = matches!(outcome, Outcome::Completed { .. });
                if let Some(t) = self.timelines.end(r, ok, self.clock) {
                    observe_end(t, ok);
                }
                self.accepted.remove(&r);
                self.given.remove(&r);
                for stage in Stage::ALL {
                    self.checkpoints.remove(&ItemKey { request: r, stage });
                }
                self.record(|| Fact::Ended(outcome.clone()));
                let outputs: Vec<Vec<u8>> = self
                    .outputs
                    .remove(&r)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(_, o)| o)
                    .collect();
                let outputs = release_list(outputs, &self.announced.remove(&r).unwrap_or_default());
                self.remember(&outcome);
                if !outputs.is_empty() {
                    self.unreleased.insert(r, Pending { outputs, by: None });
                }
                Ended { outcome, waiter: self.waiting.remove(&r) }
            })
            .collect()
    }

    /// Ended requests whose outputs no worker has been asked to release yet, each given to a
    /// live worker now (preferring the last stage's, whose sessions reach the producers). The
    /// caller sends each to its worker; the worker answers with [`Driver::released`]. Nothing
    /// is given out while no worker is live.
    pub fn releases(&mut self) -> Vec<Release<'_, W>> {
        let last = Stage::ALL[Stage::ALL.len() - 1];
        let Some(id) = self
            .workers
            .keys()
            .find(|id| self.sched.stage_of(**id) == Some(last))
            .or_else(|| self.workers.keys().next())
            .copied()
        else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (&request, p) in self.unreleased.iter_mut().filter(|(_, p)| p.by.is_none()) {
            p.by = Some(id);
            if let Some(worker) = self.workers.get(&id) {
                out.push(Release { request, outputs: &p.outputs, worker, id });
            }
        }
        out
    }

    /// The release of `request` could not be handed to its worker: give it out again.
    pub fn release_again(&mut self, request: u64) {
        if let Some(p) = self.unreleased.get_mut(&request) {
            p.by = None;
        }
    }

    /// `worker` released the outputs of `request`.
    pub fn released(&mut self, worker: WorkerId, request: u64) {
        if self.unreleased.get(&request).is_some_and(|p| p.by == Some(worker)) {
            self.unreleased.remove(&request);
            self.record(|| Fact::Released { request });
        }
    }

    /// Ended requests whose outputs are not released yet.
    pub fn unreleased(&self) -> usize {
        self.unreleased.len()
    }

    /// The timeline of `request`, in flight or among the last ended ones.
    pub fn timeline(&self, request: u64) -> Option<&Timeline> {
        self.timelines.get(request)
    }

    /// Every kept timeline of an ended request, oldest first.
    pub fn ended_timelines(&self) -> impl Iterator<Item = &Timeline> {
        self.timelines.ended()
    }

    /// A snapshot at `now` (time since the driver's epoch).
    pub fn stats(&self, now: Duration) -> OrchestratorStats {
        let mut st = OrchestratorStats {
            sched: self.sched.stats(),
            busy: self.busy,
            elapsed: now,
            duplicated: self.duplicated,
            unreleased: self.unreleased.len(),
            parked: self.sched.parked(),
            ..OrchestratorStats::default()
        };
        for stage in Stage::ALL {
            let i = stage.index();
            st.queued[i] = self.sched.queued(stage);
            st.running[i] = self.sched.running(stage);
            st.slots[i] = self.sched.slots(stage);
        }
        st
    }

    /// Publishes the levels (queue depths per stage and class, slots, workers per pool and
    /// state) and the scheduler's counters through the `metrics` facade. It counts each
    /// stage's interactive queue: call it every so often, not on every event.
    pub fn publish_metrics(&self) {
        for stage in Stage::ALL {
            let name = stage.name();
            let interactive = self.sched.queued_of(stage, Priority::Interactive);
            let batch = self.sched.queued(stage).saturating_sub(interactive);
            for (class, n) in [(Priority::Interactive, interactive), (Priority::Batch, batch)] {
                metrics::gauge!("tensorwire_queue_depth", "stage" => name, "class" => class.name())
                    .set(n as f64);
            }
            metrics::gauge!("tensorwire_free_slots", "stage" => name)
                .set(f64::from(self.sched.free_slots(stage)));
            metrics::gauge!("tensorwire_credits_in_use", "stage" => name)
                .set(self.sched.running(stage) as f64);
            let (live, draining) = self.sched.workers_of(stage);
            for (state, n) in [("live", live), ("draining", draining)] {
                metrics::gauge!("tensorwire_workers", "stage" => name, "state" => state)
                    .set(n as f64);
            }
        }
        let st = self.sched.stats();
        metrics::counter!("tensorwire_requeued_total").absolute(st.requeued);
        metrics::counter!("tensorwire_preemptions_total").absolute(st.preempt_asks);
    }
}

/// The end of a request in the metrics: its count, its time, its time to first frame.
fn observe_end(t: &Timeline, ok: bool) {
    let class = t.priority.name();
    let outcome = if ok { "completed" } else { "failed" };
    metrics::counter!("tensorwire_requests_total", "class" => class, "outcome" => outcome)
        .increment(1);
    let restored = t.events.first().is_some_and(|e| e.mark == Mark::Restored);
    if restored {
        return; // its time before the restart is unknown: no latency sample
    }
    metrics::histogram!("tensorwire_request_seconds", "class" => class)
        .record(t.span().as_secs_f64());
    if let Some(ttff) = t.ttff() {
        metrics::histogram!("tensorwire_ttff_seconds", "class" => class).record(ttff.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Priority;
    use crate::sched::MaxFreeCredit;

    fn submit(r: u64) -> Submit {
        Submit::new(r, Priority::Batch)
    }

    #[test]
    fn outputs_flow_to_the_next_stage_and_waiters_get_outcomes() {
        let mut d: Driver<&str, u32> = Driver::new(SchedConfig::default(), Box::new(MaxFreeCredit));
        let t = Duration::from_millis;
        let enc = d.join(Stage::Encode, 1, "h", vec![], "enc", t(0));
        d.join(Stage::Denoise, 1, "h", vec![], "den", t(0));
        d.join(Stage::Decode, 1, "h", vec![], "dec", t(0));
        d.submit(submit(7), 70, t(0)).unwrap();
        let (_, o) = d.submit(submit(7), 71, t(0)).unwrap_err();
        assert!(matches!(o, Outcome::Failed { request: 7, .. }), "duplicate id refused");
        let a = d.dispatch(t(1));
        assert_eq!((a.len(), *a[0].worker, a[0].inputs), (1, "enc", &[][..]));
        let key = a[0].dispatch.item.key;
        assert!(
            !d.result(WorkerId(99), key, StageResult::Done(vec![]), t(2)),
            "a foreign result is ignored"
        );
        assert!(d.result(enc, key, StageResult::Done(b"embedding ref".to_vec()), t(5)));
        let a = d.dispatch(t(6));
        assert_eq!((*a[0].worker, a[0].inputs), ("den", &b"embedding ref"[..]));
        let (key, w) = (a[0].dispatch.item.key, a[0].dispatch.worker);
        d.result(w, key, StageResult::Failed("oom".into()), t(7));
        let a = d.dispatch(t(8));
        assert_eq!(a[0].dispatch.item.attempt, 2, "a failed item is re-queued");
        let (key, w) = (a[0].dispatch.item.key, a[0].dispatch.worker);
        d.result(w, key, StageResult::Done(b"latent ref".to_vec()), t(9));
        let a = d.dispatch(t(10));
        assert_eq!(a[0].inputs, &b"latent ref"[..]);
        let (key, w) = (a[0].dispatch.item.key, a[0].dispatch.worker);
        // The latent died with its producer: denoise runs again from the embedding.
        d.result(w, key, StageResult::LostInput("producer gone".into()), t(10));
        let a = d.dispatch(t(10));
        assert_eq!(
            (a[0].dispatch.item.key.stage, a[0].inputs),
            (Stage::Denoise, &b"embedding ref"[..])
        );
        let (key, w) = (a[0].dispatch.item.key, a[0].dispatch.worker);
        d.result(w, key, StageResult::Done(b"latent ref 2".to_vec()), t(10));
        let a = d.dispatch(t(10));
        assert_eq!(a[0].inputs, &b"latent ref 2"[..]);
        let (key, w) = (a[0].dispatch.item.key, a[0].dispatch.worker);
        assert!(d.releases().is_empty(), "nothing to release while the request runs");
        d.result(w, key, StageResult::Done(vec![]), t(12));
        let out = d.take_outcomes();
        assert_eq!(out.len(), 1);
        assert_eq!(
            (&out[0].outcome, out[0].waiter),
            (&Outcome::Completed { request: 7 }, Some(70))
        );
        // Every output, the replaced latent too, goes to the decode worker to release; if it
        // leaves before saying it did, they go to another worker.
        let all: Vec<Vec<u8>> =
            vec![b"embedding ref".to_vec(), b"latent ref".to_vec(), b"latent ref 2".to_vec()];
        let r = d.releases();
        assert_eq!((r.len(), r[0].request, r[0].outputs, *r[0].worker), (1, 7, &all[..], "dec"));
        assert!(d.releases().is_empty(), "given out once");
        d.leave(w, t(13));
        let r = d.releases();
        assert_eq!(r.len(), 1);
        assert!(["enc", "den"].contains(r[0].worker), "another worker takes them over");
        let other = r[0].id;
        d.released(w, 7);
        assert_eq!(d.unreleased(), 1, "a report from a worker not asked is ignored");
        d.released(other, 7);
        assert_eq!(d.unreleased(), 0);
        let _ = enc;
        let st = d.stats(t(12));
        assert_eq!(st.busy[Stage::Encode.index()], t(4));
        assert_eq!(st.sched.completed, 1);
    }

    #[test]
    fn the_timeline_says_when_an_item_went_back_to_the_queue() {
        let mut d: Driver<&str, ()> = Driver::new(SchedConfig::default(), Box::new(MaxFreeCredit));
        let t = Duration::from_millis;
        let w1 = d.join(Stage::Encode, 1, "h", vec![], "w1", t(0));
        d.submit(submit(1), (), t(0)).unwrap();
        assert_eq!(d.dispatch(t(1)).len(), 1);
        d.leave(w1, t(2)); // held the item
        let w2 = d.join(Stage::Encode, 1, "h", vec![], "w2", t(3));
        let key = d.dispatch(t(3))[0].dispatch.item.key;
        assert!(d.yielded(w2, key, 0, vec![], t(4)));
        let marks: Vec<(Option<Stage>, Mark)> =
            d.timeline(1).unwrap().events.iter().map(|e| (e.stage, e.mark)).collect();
        let enc = Some(Stage::Encode);
        assert_eq!(
            marks[1..],
            [
                (enc, Mark::Queued),
                (enc, Mark::Dispatched { worker: w1.0 }),
                (enc, Mark::Requeued),
                (enc, Mark::Queued),
                (enc, Mark::Dispatched { worker: w2.0 }),
                (enc, Mark::Yielded),
                (enc, Mark::Queued),
            ]
        );
    }

    #[test]
    fn announced_outputs_are_released_even_when_their_worker_dies() {
        let mut d: Driver<&str, ()> = Driver::new(SchedConfig::default(), Box::new(MaxFreeCredit));
        let t = Duration::from_millis;
        let enc = d.join(Stage::Encode, 1, "h", vec![], "enc", t(0));
        d.join(Stage::Decode, 1, "h", vec![], "dec", t(0));
        d.submit(submit(1), (), t(0)).unwrap();
        let a = d.dispatch(t(1));
        let key = a[0].dispatch.item.key;
        d.announce(WorkerId(99), key, b"foreign".to_vec(), t(1)); // not its item: ignored
        d.announce(enc, key, b"embedding 1".to_vec(), t(1)); // the put is about to start
        d.leave(enc, t(2)); // killed before its result
        let enc2 = d.join(Stage::Encode, 1, "h", vec![], "enc2", t(3));
        let a = d.dispatch(t(3));
        let key = a[0].dispatch.item.key;
        d.announce(enc2, key, b"embedding 2".to_vec(), t(3));
        assert!(d.result(enc2, key, StageResult::Failed("oom".into()), t(4)));
        let a = d.dispatch(t(5));
        let key = a[0].dispatch.item.key;
        d.announce(enc2, key, b"embedding 3".to_vec(), t(5));
        d.result(enc2, key, StageResult::Failed("oom".into()), t(6));
        assert_eq!(d.take_outcomes().len(), 1, "failed after 3 attempts");
        let r = d.releases();
        let want: Vec<Vec<u8>> =
            vec![b"embedding 1".to_vec(), b"embedding 2".to_vec(), b"embedding 3".to_vec()];
        assert_eq!((r.len(), r[0].outputs), (1, &want[..]));
    }

    #[test]
    fn a_request_started_past_the_first_stage_gets_its_inputs_and_never_releases_them() {
        let mut d: Driver<&str, ()> = Driver::new(SchedConfig::default(), Box::new(MaxFreeCredit));
        let t = Duration::from_millis;
        d.join(Stage::Encode, 1, "h", vec![], "enc", t(0));
        d.join(Stage::Denoise, 1, "h", vec![], "den", t(0));
        d.join(Stage::Decode, 1, "h", vec![], "dec", t(0));
        d.record_facts();
        let s = Submit { start: Stage::Denoise, ..submit(3) };
        d.submit_with(s, b"cached embedding".to_vec(), (), t(0)).unwrap();
        let a = d.dispatch(t(1));
        assert_eq!(a.len(), 1, "encode never runs");
        assert_eq!(
            (a[0].dispatch.item.key.stage, a[0].inputs),
            (Stage::Denoise, &b"cached embedding"[..])
        );
        let (key, w) = (a[0].dispatch.item.key, a[0].dispatch.worker);
        d.result(w, key, StageResult::Done(b"latent".to_vec()), t(2));
        let a = d.dispatch(t(3));
        let (key, w) = (a[0].dispatch.item.key, a[0].dispatch.worker);
        d.result(w, key, StageResult::Done(vec![]), t(4));
        assert_eq!(d.take_outcomes().len(), 1);
        let r = d.releases();
        assert_eq!(r[0].outputs, &[b"latent".to_vec()][..], "the given inputs are not released");
        // The journal says where it started: a restored driver would give denoise the same.
        let mut book = crate::journal::Book::default();
        let facts = d.take_facts();
        assert!(
            matches!(&facts[0], Fact::Submitted { start: Stage::Denoise, inputs, .. } if inputs == b"cached embedding")
        );
        facts.iter().for_each(|f| book.apply(f));
        assert_eq!(d.stats(t(5)).duplicated, 0);
    }

    #[test]
    fn a_resume_finds_a_request_in_flight_ended_this_turn_or_ended_before() {
        let mut d: Driver<(), u32> = Driver::new(SchedConfig::default(), Box::new(MaxFreeCredit));
        let t = Duration::from_millis;
        let w = d.join(Stage::Encode, 1, "h", vec![], (), t(0));
        d.join(Stage::Denoise, 1, "h", vec![], (), t(0));
        let dec = d.join(Stage::Decode, 1, "h", vec![], (), t(0));
        d.submit(submit(1), 10, t(0)).unwrap();
        d.resume(submit(1), vec![], 11, t(0)).unwrap(); // in flight: the new waiter takes over
        for stage in Stage::ALL {
            let a = d.dispatch(t(1));
            let (key, by) = (a[0].dispatch.item.key, a[0].dispatch.worker);
            assert_eq!(key.stage, stage);
            d.result(by, key, StageResult::Done(vec![]), t(2));
        }
        // Ended in this turn, outcome not yet taken: the resume must not submit it again.
        d.resume(submit(1), vec![], 12, t(2)).unwrap();
        assert_eq!(d.sched().in_flight(), 0);
        let out = d.take_outcomes();
        assert_eq!((out.len(), out[0].waiter), (1, Some(12)));
        // Ended before: answered at once.
        let (waiter, o) = d.resume(submit(1), vec![], 13, t(3)).unwrap_err();
        assert_eq!((waiter, o), (13, Outcome::Completed { request: 1 }));
        // Never seen: submitted.
        d.resume(submit(2), vec![], 14, t(3)).unwrap();
        assert_eq!(d.sched().in_flight(), 1);
        let _ = (w, dec);
    }

    proptest::proptest! {
        /// Random joins, departures, results, failures, lost inputs and release reports: every
        /// output a stage reported is handed out for release once its request ends, and stays
        /// outstanding until the worker it was last given to reports it; none is lost, none is
        /// handed out twice at once.
        #[test]
        fn every_output_is_released(ops in proptest::collection::vec((0u8..8, 0u64..5, 0u64..30), 1..300)) {
            use std::collections::{BTreeSet, HashMap};
            let cfg = SchedConfig { heartbeat_timeout: Duration::from_secs(3600), max_attempts: 3, ..SchedConfig::default() };
            let mut d: Driver<u64, ()> = Driver::new(cfg, Box::new(MaxFreeCredit));
            let t = Duration::from_millis;
            let (mut next_req, mut n_out) = (0u64, 0u64);
            let mut workers: Vec<WorkerId> = Vec::new();
            let mut running: Vec<(WorkerId, ItemKey)> = Vec::new();
            let mut reported: HashMap<u64, BTreeSet<Vec<u8>>> = HashMap::new();
            let mut released: HashMap<u64, BTreeSet<Vec<u8>>> = HashMap::new();
            let mut given: HashMap<u64, WorkerId> = HashMap::new();
            let mut ended: BTreeSet<u64> = BTreeSet::new();
            for (i, (op, a, b)) in ops.into_iter().enumerate() {
                let now = t(i as u64);
                match op {
                    0 => { let _ = d.submit(Submit::new(next_req, Priority::Batch), (), now); next_req += 1; }
                    1 => { let w = d.join(Stage::ALL[(a % 3) as usize], 1 + (b % 2) as u32, "h", vec![], a, now); workers.push(w); }
                    2 if !workers.is_empty() => {
                        let w = workers.swap_remove((b as usize) % workers.len());
                        d.leave(w, now);
                        running.retain(|(x, _)| *x != w);
                        given.retain(|_, x| *x != w);
                    }
                    3..=5 if !running.is_empty() => {
                        let (w, key) = running.swap_remove((b as usize) % running.len());
                        let r = match op {
                            3 => { n_out += 1; let o = format!("{}:{:?}:{n_out}", key.request, key.stage).into_bytes(); StageResult::Done(o) }
                            4 => StageResult::Failed("x".into()),
                            _ => StageResult::LostInput("gone".into()),
                        };
                        let out = match &r { StageResult::Done(o) => Some(o.clone()), _ => None };
                        if d.result(w, key, r, now) {
                            if let Some(o) = out { reported.entry(key.request).or_default().insert(o); }
                        }
                    }
                    6 if !given.is_empty() => {
                        let r = *given.keys().nth((b as usize) % given.len()).unwrap();
                        let w = given.remove(&r).unwrap();
                        d.released(w, r);
                    }
                    _ => {}
                }
                for asg in d.dispatch(now) {
                    running.push((asg.dispatch.worker, asg.dispatch.item.key));
                }
                for e in d.take_outcomes() {
                    proptest::prop_assert!(ended.insert(e.outcome.request()), "ended twice");
                }
                for rel in d.releases() {
                    proptest::prop_assert!(ended.contains(&rel.request), "released while running");
                    proptest::prop_assert!(!given.contains_key(&rel.request), "handed out twice at once");
                    given.insert(rel.request, rel.id);
                    released.entry(rel.request).or_default().extend(rel.outputs.iter().cloned());
                }
                proptest::prop_assert_eq!(d.unreleased(), d.unreleased.len());
            }
            // Every ended request's outputs were handed out, all of them.
            for r in &ended {
                let want = reported.get(r).cloned().unwrap_or_default();
                if want.is_empty() { continue; }
                let outstanding = d.unreleased.contains_key(r);
                let got = released.get(r).cloned().unwrap_or_default();
                // Only with no live worker may an ended request's outputs wait to be handed out.
                if !(outstanding && workers.is_empty()) {
                    proptest::prop_assert_eq!(&got, &want, "request {}", r);
                }
            }
        }

        /// Preemption and drains racing with results, failures and deaths. Denoise jobs run
        /// in steps and checkpoint at each; a job asked to yield does so at its next step
        /// unless it finishes, fails, or its worker dies or leaves first; drained workers
        /// leave. Every try of a denoise job resumes from the last checkpoint the driver took
        /// for it (no step before it runs twice), every request ends once, and every stage is
        /// accepted once.
        #[test]
        fn preemption_and_drains_lose_and_repeat_nothing(ops in proptest::collection::vec((0u8..8, 0u64..16), 1..300)) {
            use std::collections::{BTreeMap, BTreeSet};
            const STEPS: u32 = 4;
            let cfg = SchedConfig { heartbeat_timeout: Duration::from_secs(3600), max_attempts: 1000, ..SchedConfig::default() };
            let mut d: Driver<(), ()> = Driver::new(cfg, Box::new(MaxFreeCredit));
            let t = Duration::from_millis;
            let mut workers: Vec<(WorkerId, Stage)> = Vec::new();
            let mut draining: BTreeSet<WorkerId> = BTreeSet::new();
            for (s, n) in [(Stage::Encode, 2), (Stage::Denoise, 1), (Stage::Denoise, 1), (Stage::Decode, 4)] {
                workers.push((d.join(s, n, "h", vec![], (), t(0)), s));
            }
            // Running: worker, item, step reached.
            let mut running: Vec<(WorkerId, ItemKey, u32)> = Vec::new();
            let mut last_cp: BTreeMap<u64, u32> = BTreeMap::new();
            let mut asked: BTreeSet<ItemKey> = BTreeSet::new();
            let mut ended: BTreeMap<u64, u32> = BTreeMap::new();
            let mut accepted: BTreeMap<ItemKey, u32> = BTreeMap::new();
            let mut next_req = 0u64;
            let cp = |r: u64, step: u32| format!("cp{r}:{step}").into_bytes();
            // One step of the running item `i`: a yield if asked, else a checkpoint, and the
            // result at the last step.
            let step = |d: &mut Driver<(), ()>, running: &mut Vec<(WorkerId, ItemKey, u32)>, i: usize, now: Duration,
                            last_cp: &mut BTreeMap<u64, u32>, asked: &mut BTreeSet<ItemKey>, accepted: &mut BTreeMap<ItemKey, u32>| {
                let (w, key, s) = running[i];
                if key.stage == Stage::Denoise && s + 1 < STEPS {
                    if asked.remove(&key) {
                        running.swap_remove(i);
                        assert!(d.yielded(w, key, s + 1, cp(key.request, s + 1), now));
                        last_cp.insert(key.request, s + 1);
                        return;
                    }
                    d.checkpoint(w, key, s + 1, cp(key.request, s + 1));
                    last_cp.insert(key.request, s + 1);
                    running[i].2 = s + 1;
                    return;
                }
                running.swap_remove(i);
                asked.remove(&key);
                if d.result(w, key, StageResult::Done(vec![]), now) {
                    *accepted.entry(key).or_default() += 1;
                    last_cp.remove(&key.request);
                }
            };
            let mut now = t(0);
            let check = |d: &mut Driver<(), ()>, running: &mut Vec<(WorkerId, ItemKey, u32)>, now: Duration,
                             last_cp: &BTreeMap<u64, u32>, asked: &mut BTreeSet<ItemKey>, ended: &mut BTreeMap<u64, u32>,
                             workers: &mut Vec<(WorkerId, Stage)>, draining: &mut BTreeSet<WorkerId>| -> Result<(), proptest::test_runner::TestCaseError> {
                for a in d.dispatch(now) {
                    let key = a.dispatch.item.key;
                    let from = a.resume.map(|(s, data)| (s, data.to_vec()));
                    if key.stage == Stage::Denoise {
                        let want = last_cp.get(&key.request).map(|&s| (s, cp(key.request, s)));
                        proptest::prop_assert_eq!(&from, &want, "request {} resumes from its last checkpoint", key.request);
                    }
                    running.push((a.dispatch.worker, key, from.map_or(0, |f| f.0)));
                }
                for (key, w, _) in d.take_asks() {
                    proptest::prop_assert!(running.iter().any(|r| r.0 == w && r.1 == key), "ask for a job not running there");
                    proptest::prop_assert_eq!(key.stage, Stage::Denoise);
                    asked.insert(key);
                }
                let drained: Vec<WorkerId> = d.take_drained().into_iter().map(|(id, _)| id).collect();
                for id in drained {
                    proptest::prop_assert!(!running.iter().any(|r| r.0 == id), "drained while running");
                    d.leave(id, now);
                    workers.retain(|w| w.0 != id);
                    draining.remove(&id);
                }
                for e in d.take_outcomes() {
                    proptest::prop_assert!(matches!(e.outcome, Outcome::Completed { .. }), "{:?}", e.outcome);
                    *ended.entry(e.outcome.request()).or_default() += 1;
                }
                Ok(())
            };
            for (op, b) in ops {
                now += t(1);
                let pick = |n: usize| (b as usize) % n.max(1);
                match op {
                    0 | 1 => {
                        let p = if op == 0 { Priority::Batch } else { Priority::Interactive };
                        d.submit(Submit::new(next_req, p), (), now).unwrap();
                        next_req += 1;
                    }
                    2 | 3 if !running.is_empty() => {
                        let i = pick(running.len());
                        step(&mut d, &mut running, i, now, &mut last_cp, &mut asked, &mut accepted);
                    }
                    4 if !running.is_empty() => {
                        let (w, key, _) = running.swap_remove(pick(running.len()));
                        asked.remove(&key);
                        if d.result(w, key, StageResult::Failed("oom".into()), now) {
                            last_cp.remove(&key.request); // a failed try does not resume
                        }
                    }
                    5 if !workers.is_empty() => {
                        // A worker dies: its jobs resume from their checkpoints elsewhere.
                        let (w, stage) = workers.swap_remove(pick(workers.len()));
                        d.leave(w, now);
                        draining.remove(&w);
                        for r in running.iter().filter(|r| r.0 == w) { asked.remove(&r.1); }
                        running.retain(|r| r.0 != w);
                        workers.push((d.join(stage, 1, "h", vec![], (), now), stage));
                    }
                    6 if !workers.is_empty() => {
                        let (w, stage) = workers[pick(workers.len())];
                        if draining.insert(w) {
                            d.drain(w, now);
                            workers.push((d.join(stage, 1, "h", vec![], (), now), stage));
                        }
                    }
                    7 if b < 4 => {
                        workers.push((d.join(Stage::Denoise, 1, "h", vec![], (), now), Stage::Denoise));
                    }
                    _ => {}
                }
                check(&mut d, &mut running, now, &last_cp, &mut asked, &mut ended, &mut workers, &mut draining)?;
            }
            // Run everything to its end.
            for _ in 0..100_000 {
                if running.is_empty() && d.sched().in_flight() == 0 { break; }
                now += t(1);
                if !running.is_empty() {
                    step(&mut d, &mut running, 0, now, &mut last_cp, &mut asked, &mut accepted);
                }
                check(&mut d, &mut running, now, &last_cp, &mut asked, &mut ended, &mut workers, &mut draining)?;
            }
            for r in 0..next_req {
                proptest::prop_assert_eq!(ended.get(&r).copied(), Some(1), "request {} ends once", r);
                for stage in Stage::ALL {
                    proptest::prop_assert_eq!(accepted.get(&ItemKey { request: r, stage }).copied(), Some(1), "request {} at {:?}", r, stage);
                }
            }
            proptest::prop_assert_eq!(d.stats(now).duplicated, 0);
        }

        /// Random work with a crash at a random point: the facts recorded until then rebuild a
        /// fresh driver; some running items are claimed by their reconnecting workers (with
        /// their results, some finished while the service was down), the rest wait out the
        /// grace. Then everything runs to the end. Every request ends exactly once over both
        /// lives, no stage result is accepted twice, and every output reported is handed out
        /// for release.
        #[test]
        fn a_restart_from_the_journal_loses_and_repeats_nothing(
            before in proptest::collection::vec((0u8..6, 0u64..8), 1..120),
            claims in proptest::collection::vec(0u8..2, 0..40),
        ) {
            use std::collections::{BTreeMap, BTreeSet};
            use crate::journal::Book;
            let cfg = SchedConfig { heartbeat_timeout: Duration::from_secs(3600), max_attempts: 50, ..SchedConfig::default() };
            let t = Duration::from_millis;
            let mut d: Driver<(), ()> = Driver::new(cfg.clone(), Box::new(MaxFreeCredit));
            d.record_facts();
            let mut book = Book::default();
            let mut ended: BTreeMap<u64, u32> = BTreeMap::new();
            let mut reported: BTreeMap<u64, BTreeSet<Vec<u8>>> = BTreeMap::new();
            let mut accepted: BTreeMap<ItemKey, u32> = BTreeMap::new();
            let mut running: Vec<(WorkerId, ItemKey, u32)> = Vec::new();
            let mut next_req = 0u64;
            let mut n_out = 0u64;
            for s in Stage::ALL {
                d.join(s, 2, "h", vec![], (), t(0));
            }
            let done = |key: ItemKey, n: &mut u64| { *n += 1; format!("{}:{:?}:{n}", key.request, key.stage).into_bytes() };
            // Denoise jobs that yielded with a checkpoint, until their next dispatch.
            let mut yielded: BTreeMap<ItemKey, Vec<u8>> = BTreeMap::new();
            // Life one.
            for (i, (op, b)) in before.into_iter().enumerate() {
                let now = t(i as u64);
                match op {
                    0 | 1 => { let _ = d.submit(Submit::new(next_req, Priority::Batch), (), now); next_req += 1; }
                    2 | 3 if !running.is_empty() => {
                        let (w, key, _) = running.swap_remove((b as usize) % running.len());
                        let out = done(key, &mut n_out);
                        if d.result(w, key, StageResult::Done(out.clone()), now) {
                            reported.entry(key.request).or_default().insert(out);
                            *accepted.entry(key).or_default() += 1;
                        }
                    }
                    5 => {
                        // A denoise job yields at step 7 (preempted, or its worker drains).
                        if let Some(i) = running.iter().position(|r| r.1.stage == Stage::Denoise) {
                            let (w, key, _) = running.swap_remove(i);
                            let cp = format!("cp {}:{b}", key.request).into_bytes();
                            proptest::prop_assert!(d.yielded(w, key, 7, cp.clone(), now));
                            yielded.insert(key, cp);
                        }
                    }
                    _ if !running.is_empty() => {
                        let (w, key, _) = running.swap_remove((b as usize) % running.len());
                        d.result(w, key, StageResult::Failed("x".into()), now);
                        yielded.remove(&key); // a failed try does not resume
                    }
                    _ => {}
                }
                for a in d.dispatch(now) {
                    let key = a.dispatch.item.key;
                    if let Some(cp) = yielded.remove(&key) {
                        proptest::prop_assert_eq!(a.resume, Some((7, &cp[..])), "resumes from its yield");
                    }
                    running.push((a.dispatch.worker, key, a.dispatch.item.attempt));
                }
                for e in d.take_outcomes() { *ended.entry(e.outcome.request()).or_default() += 1; }
                // What the service syncs each turn.
                for f in d.take_facts() { book.apply(&f); }
            }
            // Crash. Life two, from the journal alone.
            let mut d: Driver<(), ()> = Driver::new(cfg, Box::new(MaxFreeCredit));
            d.record_facts();
            let grace = t(1000);
            let t0 = t(10_000);
            d.restore(&book, t0, grace);
            let mut live: Vec<WorkerId> = Stage::ALL.iter().map(|s| d.join(*s, 64, "h", vec![], (), t0)).collect();
            let mut again: Vec<(WorkerId, ItemKey)> = Vec::new();
            for (i, (_, key, attempt)) in running.iter().enumerate() {
                match claims.get(i).copied().unwrap_or(0) {
                    0 => {} // the worker died with the service
                    _ => {
                        let w = d.join(key.stage, 1, "h", vec![], (), t0);
                        live.push(w);
                        // It still runs the item, or finished it while the service was down
                        // and resends the result: either way it claims it first.
                        if d.claim(w, *key, *attempt, t0) {
                            again.push((w, *key));
                        }
                    }
                }
            }
            let mut now = t0;
            let mut running: Vec<(WorkerId, ItemKey)> = again;
            for _ in 0..10_000 {
                now += t(50);
                if let Some((w, key)) = running.pop() {
                    let out = done(key, &mut n_out);
                    if d.result(w, key, StageResult::Done(out.clone()), now) {
                        reported.entry(key.request).or_default().insert(out);
                        *accepted.entry(key).or_default() += 1;
                    }
                }
                for a in d.dispatch(now) {
                    let key = a.dispatch.item.key;
                    if let Some(cp) = yielded.remove(&key) {
                        // Queued at once after the restart (nobody runs it to claim it), with
                        // its checkpoint.
                        proptest::prop_assert!(now < t0 + grace, "a yielded job waited out the grace");
                        proptest::prop_assert_eq!(a.resume, Some((7, &cp[..])));
                    }
                    running.push((a.dispatch.worker, key));
                }
                for e in d.take_outcomes() { *ended.entry(e.outcome.request()).or_default() += 1; }
                for r in d.releases().into_iter().map(|r| (r.id, r.request, r.outputs.to_vec())).collect::<Vec<_>>() {
                    let want = reported.get(&r.1).cloned().unwrap_or_default();
                    let got: BTreeSet<Vec<u8>> = r.2.into_iter().collect();
                    proptest::prop_assert!(want.is_subset(&got), "request {}: {:?} not all in {:?}", r.1, want, got);
                    d.released(r.0, r.1);
                }
                if running.is_empty() && d.sched().in_flight() == 0 && d.unreleased() == 0 { break; }
            }
            for r in 0..next_req {
                proptest::prop_assert_eq!(ended.get(&r).copied(), Some(1), "request {} ends once", r);
                for stage in Stage::ALL {
                    let n = accepted.get(&ItemKey { request: r, stage }).copied().unwrap_or(0);
                    proptest::prop_assert_eq!(n, 1, "request {} at {:?}: each stage accepted once", r, stage);
                }
            }
            proptest::prop_assert_eq!(d.stats(now).duplicated, 0);
            proptest::prop_assert_eq!(d.unreleased(), 0);
        }
    }
}
