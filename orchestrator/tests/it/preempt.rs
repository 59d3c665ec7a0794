//! Mid-job movement of denoise jobs through step checkpoints, end to end through the service:
//! an interactive job preempts a batch job, which resumes on another worker from the step it
//! yielded at; a draining worker's job moves to another worker; a new request resumes an
//! earlier one's checkpoint (edit and resume). Each denoise run checks its latents: a resumed
//! run loads exactly the bytes the yielding run saved, and every job ends with the bytes an
//! uninterrupted run makes.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tensorwire_core::{DType, Engine, Permissions, TensorMeta, backend::MemBackend};
use tensorwire_diffusion::cache::{
    CheckpointOf, CheckpointRef, Checkpoints, Sampler, Shape, checkpoint_key, embedding_key,
};
use tensorwire_orchestrator::rebalance::RebalanceConfig;
use tensorwire_orchestrator::sched::SchedConfig;
use tensorwire_orchestrator::service::{
    Assignment, OrchestratorService, ServiceConfig, SubmitClient, WorkerClient, WorkerSpec,
};
use tensorwire_orchestrator::{Priority, Stage};
use tensorwire_store::{EmbeddedStore, Store, StoreConfig};
use tokio::sync::mpsc;

const N: u64 = 16 << 10;
const STEPS: u32 = 12;
const HB: Duration = Duration::from_millis(100);
const WAIT: Duration = Duration::from_secs(20);

/// The latents of request `r` after `step` steps (a deterministic trajectory).
fn latents(r: u64, step: u32) -> Vec<u8> {
    (0..N).map(|i| (i as u32).wrapping_mul(7).wrapping_add(step * 13 + r as u32) as u8).collect()
}

/// Who ran which step of which request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ran {
    worker: &'static str,
    request: u64,
    step: u32,
}

/// What was released when requests ended, by request.
type Released = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

struct Pipeline {
    svc: OrchestratorService,
    engine: Engine,
    store: Arc<dyn Store>,
    ck: Checkpoints,
    ran: mpsc::Sender<Ran>,
    /// Everything released when requests ended, by request.
    released: Released,
}

impl Pipeline {
    /// A service with trivial encode and decode workers; decode releases what it is handed
    /// (checkpoints from the store), except the requests `keep` names.
    async fn start(keep: &'static [u64]) -> (Pipeline, mpsc::Receiver<Ran>) {
        Self::start_with(keep, ServiceConfig::default(), (4, Duration::ZERO)).await
    }

    /// [`Pipeline::start`] with `cfg`, and a decode worker with `slots` taking `took` per item.
    async fn start_with(
        keep: &'static [u64],
        cfg: ServiceConfig,
        (slots, took): (u32, Duration),
    ) -> (Pipeline, mpsc::Receiver<Ran>) {
        let engine = Engine::builder().backend(MemBackend::new()).start().await.unwrap();
        let store_cfg = StoreConfig { capacity: 16 << 20, ..StoreConfig::default() };
        let store: Arc<dyn Store> = EmbeddedStore::new(&engine, store_cfg).await.unwrap();
        let ck = Checkpoints::new(store.clone(), Duration::from_secs(600));
        let svc = OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), cfg).await.unwrap();
        let released: Released = Arc::default();
        let (ran, rx) = mpsc::channel(256);
        let p = Pipeline { svc, engine, store, ck, ran, released };
        for (stage, slots, took) in
            [(Stage::Encode, 4, Duration::ZERO), (Stage::Decode, slots, took)]
        {
            let (w, rx) =
                WorkerClient::connect(p.svc.addr(), None, stage, slots, "h", HB).await.unwrap();
            tokio::spawn(p.serve_items(Arc::new(w), rx, keep, (took, "v")));
        }
        (p, rx)
    }

    /// Runs the encode or decode items `rx` brings (each taking `took`; a decode item is a
    /// `Ran` of step `STEPS` by `name`) and releases ended requests' outputs (checkpoints from
    /// the store, except those of the requests `keep` names).
    fn serve_items(
        &self,
        w: Arc<WorkerClient>,
        mut rx: mpsc::Receiver<Assignment>,
        keep: &'static [u64],
        (took, name): (Duration, &'static str),
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (ck, released, ran) = (self.ck.clone(), self.released.clone(), self.ran.clone());
        async move {
            while let Some(a) = rx.recv().await {
                if a.release_only {
                    for h in &a.held {
                        if CheckpointRef::is(h) && !keep.contains(&a.request) {
                            ck.release(&CheckpointRef::decode(h).unwrap()).await.unwrap();
                        }
                        released.lock().push((a.request, h.clone()));
                    }
                    w.released(&a).await.unwrap();
                    continue;
                }
                tokio::time::sleep(took).await;
                if a.stage == Stage::Decode {
                    let _ = ran.send(Ran { worker: name, request: a.request, step: STEPS }).await;
                }
                let out = format!("{:?} of {}", a.stage, a.request).into_bytes();
                w.report_with(&a, Ok::<_, String>(out)).await.unwrap();
            }
        }
    }

    /// A denoise worker named `name` with one slot: it runs each job step by step from its
    /// checkpoint, saves a checkpoint every 3 steps, and yields at the next step boundary when
    /// asked (saving one there).
    async fn denoiser(&self, name: &'static str) -> Arc<WorkerClient> {
        let spec = WorkerSpec::new(Stage::Denoise, 1, "h");
        self.denoiser_as(name, spec, Duration::from_millis(25)).await.0
    }

    /// [`Pipeline::denoiser`] joined as `spec` says, taking `step` a step; with the task
    /// running its jobs.
    async fn denoiser_as(
        &self,
        name: &'static str,
        spec: WorkerSpec,
        step: Duration,
    ) -> (Arc<WorkerClient>, tokio::task::JoinHandle<()>) {
        let (w, mut rx) = WorkerClient::join(self.svc.addr().into(), None, spec, HB).await.unwrap();
        let w = Arc::new(w);
        let (client, ck, engine, ran) =
            (w.clone(), self.ck.clone(), self.engine.clone(), self.ran.clone());
        let task = tokio::spawn(async move {
            while let Some(a) = rx.recv().await {
                if a.release_only {
                    client.released(&a).await.unwrap();
                    continue;
                }
                if let Some(out) = denoise(&client, &a, &ck, &engine, &ran, (name, step)).await {
                    client.report_with(&a, Ok::<_, String>(out)).await.unwrap();
                }
            }
        });
        (w, task)
    }
}

/// Saves the latents after `step` steps as a checkpoint of `a`; returns its reference.
async fn save(
    ck: &Checkpoints,
    a: &Assignment,
    latent: &tensorwire_core::Region,
    step: u32,
) -> Vec<u8> {
    let key = checkpoint_key(&CheckpointOf {
        model: "m",
        sampler: Sampler { name: "euler", state: &[] },
        step,
        seed: a.request,
        guidance_scale: 5.0,
        shape: Shape { width: 8, height: 8, frames: 1 },
        prompt: embedding_key("t5", "1", "p", false, &[]),
    });
    let meta = TensorMeta::contiguous(DType::U8, &[N]);
    let r = ck.save(&key, &meta, &latent.slice(0, N).unwrap(), step, b"sigmas").await.unwrap();
    r.encode()
}

/// Runs a denoise job; `None` when it yielded. The trajectory of a resumed job is checked
/// against the checkpoint it loads (request `r`'s latents at that step; for an edit, the
/// request it resumes), and its end against an uninterrupted run.
async fn denoise(
    w: &WorkerClient,
    a: &Assignment,
    ck: &Checkpoints,
    engine: &Engine,
    ran: &mpsc::Sender<Ran>,
    (name, took): (&'static str, Duration),
) -> Option<Vec<u8>> {
    let latent = engine.alloc(N, Permissions::NONE).await.unwrap();
    // An edit names the request whose trajectory it resumes in its inputs.
    let traj: u64 = std::str::from_utf8(&a.inputs)
        .ok()
        .and_then(|s| s.strip_prefix("edit of "))
        .map_or(a.request, |r| r.parse().unwrap());
    let mut from = 0;
    if let Some((step, data)) = &a.resume {
        let r = CheckpointRef::decode(data).unwrap();
        ck.load(&r, &latent, 0).await.unwrap();
        assert_eq!(latent.to_vec(0, N).unwrap(), latents(traj, *step), "checkpoint at {step}");
        from = *step;
    } else {
        latent.write_bytes(0, &latents(traj, 0)).unwrap();
    }
    for step in from..STEPS {
        if step > from && w.yield_requested(a) {
            let r = save(ck, a, &latent, step).await;
            w.yield_job(a, step, r).await.unwrap();
            return None;
        }
        tokio::time::sleep(took).await;
        latent.write_bytes(0, &latents(traj, step + 1)).unwrap();
        let _ = ran.send(Ran { worker: name, request: a.request, step }).await;
        let done = step + 1;
        if done % 3 == 0 && done < STEPS {
            let r = save(ck, a, &latent, done).await;
            w.checkpoint(a, done, r).await.unwrap();
        }
    }
    assert_eq!(latent.to_vec(0, N).unwrap(), latents(traj, STEPS));
    Some(b"latent".to_vec())
}

/// Waits for the step `step` of `request`, collecting every step seen on the way.
async fn until(rx: &mut mpsc::Receiver<Ran>, seen: &mut Vec<Ran>, request: u64, step: u32) {
    tokio::time::timeout(WAIT, async {
        while let Some(r) = rx.recv().await {
            seen.push(r);
            if r.request == request && r.step == step {
                return;
            }
        }
    })
    .await
    .expect("the step ran");
}

/// The denoise steps `request` ran, by worker, in order.
fn steps(seen: &[Ran], request: u64) -> Vec<(&'static str, u32)> {
    seen.iter()
        .filter(|r| r.request == request && r.step < STEPS)
        .map(|r| (r.worker, r.step))
        .collect()
}

/// The workers that decoded `request`.
fn decoded(seen: &[Ran], request: u64) -> Vec<&'static str> {
    seen.iter().filter(|r| r.request == request && r.step == STEPS).map(|r| r.worker).collect()
}

async fn outcome(
    rx: tokio::sync::oneshot::Receiver<tensorwire_orchestrator::Result<()>>,
    seen: &mut Vec<Ran>,
    ran: &mut mpsc::Receiver<Ran>,
) {
    let r = tokio::time::timeout(WAIT, rx).await.expect("the request ends").unwrap();
    assert!(r.is_ok(), "{r:?}");
    while let Ok(r) = ran.try_recv() {
        seen.push(r);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_job_preempts_a_batch_job_which_resumes_from_its_step_elsewhere() {
    let (p, mut ran) = Pipeline::start(&[]).await;
    let _a = p.denoiser("a").await;
    let sub = SubmitClient::connect(p.svc.addr(), None).await.unwrap();
    let batch = sub.submit(1, Priority::Batch).await.unwrap();
    let mut seen = Vec::new();
    until(&mut ran, &mut seen, 1, 1).await;
    let interactive = sub.submit(2, Priority::Interactive).await.unwrap();
    // The batch job yields at its next step; the interactive one runs on "a".
    until(&mut ran, &mut seen, 2, 0).await;
    let _b = p.denoiser("b").await;
    outcome(interactive, &mut seen, &mut ran).await;
    outcome(batch, &mut seen, &mut ran).await;
    let on_a: Vec<u32> = steps(&seen, 1).iter().filter(|s| s.0 == "a").map(|s| s.1).collect();
    let on_b: Vec<u32> = steps(&seen, 1).iter().filter(|s| s.0 == "b").map(|s| s.1).collect();
    let k = on_a.len() as u32;
    assert!((2..STEPS).contains(&k), "yielded mid-job: {on_a:?}");
    assert_eq!(on_a, (0..k).collect::<Vec<_>>());
    assert_eq!(on_b, (k..STEPS).collect::<Vec<_>>(), "resumed on b from step {k}, nothing twice");
    assert_eq!(steps(&seen, 2), (0..STEPS).map(|s| ("a", s)).collect::<Vec<_>>());
    let st = p.svc.stats().await.unwrap();
    assert_eq!((st.sched.preempt_asks, st.sched.yielded, st.duplicated), (1, 1, 0));
    assert_eq!(st.sched.requeued, 0, "a yield is not a failure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_moves_its_job_to_another_and_stops() {
    let (p, mut ran) = Pipeline::start(&[]).await;
    let a = p.denoiser("a").await;
    let sub = SubmitClient::connect(p.svc.addr(), None).await.unwrap();
    let job = sub.submit(1, Priority::Batch).await.unwrap();
    let mut seen = Vec::new();
    until(&mut ran, &mut seen, 1, 3).await;
    let _b = p.denoiser("b").await;
    tokio::time::timeout(WAIT, a.drain(WAIT)).await.unwrap().unwrap();
    outcome(job, &mut seen, &mut ran).await;
    let s = steps(&seen, 1);
    let k = s.iter().filter(|s| s.0 == "a").count() as u32;
    let want: Vec<(&str, u32)> = (0..STEPS).map(|i| (if i < k { "a" } else { "b" }, i)).collect();
    assert_eq!(s, want, "moved to b at step {k}");
    // A drained worker gets nothing more.
    let next = sub.submit(2, Priority::Batch).await.unwrap();
    outcome(next, &mut seen, &mut ran).await;
    assert!(steps(&seen, 2).iter().all(|s| s.0 == "b"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_resumes_from_an_earlier_requests_checkpoint() {
    // Request 1's checkpoints are kept when it ends (an edit session holds them).
    let (p, mut ran) = Pipeline::start(&[1]).await;
    let _a = p.denoiser("a").await;
    let sub = SubmitClient::connect(p.svc.addr(), None).await.unwrap();
    let mut seen = Vec::new();
    outcome(sub.submit(1, Priority::Interactive).await.unwrap(), &mut seen, &mut ran).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let step6 = p
        .released
        .lock()
        .iter()
        .filter(|(r, h)| *r == 1 && CheckpointRef::is(h))
        .map(|(_, h)| CheckpointRef::decode(h).unwrap())
        .find(|c| c.step == 6)
        .expect("request 1 checkpointed step 6");
    // The edit: request 2 starts at denoise from step 6 of request 1's trajectory.
    let edit = sub
        .submit_resuming(
            2,
            Priority::Interactive,
            Stage::Denoise,
            b"edit of 1".to_vec(),
            Some((6, step6.encode())),
        )
        .await
        .unwrap();
    outcome(edit, &mut seen, &mut ran).await;
    assert_eq!(steps(&seen, 2), (6..STEPS).map(|s| ("a", s)).collect::<Vec<_>>());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let of2: Vec<Vec<u8>> =
        p.released.lock().iter().filter(|(r, _)| *r == 2).map(|(_, h)| h.clone()).collect();
    assert!(!of2.contains(&step6.encode()), "the edit does not release what it resumed from");
    assert!(
        of2.iter().any(|h| CheckpointRef::is(h) && CheckpointRef::decode(h).unwrap().step == 9),
        "its own checkpoints are released"
    );
    assert!(p.store.exists(&step6.key).await.unwrap(), "request 1's checkpoint is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_yields_edits_and_drains_fail_with_their_reason() {
    use tensorwire_orchestrator::OrchestratorError;
    let (p, _ran) = Pipeline::start(&[]).await;
    let sub = SubmitClient::connect(p.svc.addr(), None).await.unwrap();
    let too_big = vec![0u8; tensorwire_orchestrator::service::wire::MAX_DATA + 1];
    let e = sub
        .submit_resuming(1, Priority::Batch, Stage::Denoise, vec![], Some((3, too_big.clone())))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, OrchestratorError::InvalidArgument(m) if m.starts_with("a checkpoint of")),
        "{e}"
    );
    // A worker that holds a job and never yields it: its drain times out.
    let (w, mut rx) =
        WorkerClient::connect(p.svc.addr(), None, Stage::Denoise, 1, "h", HB).await.unwrap();
    let _out = sub.submit(2, Priority::Batch).await.unwrap();
    let a = tokio::time::timeout(WAIT, rx.recv()).await.unwrap().unwrap();
    let e = w.yield_job(&a, 3, too_big).await.unwrap_err();
    assert!(
        matches!(&e, OrchestratorError::InvalidArgument(m) if m.starts_with("a checkpoint of")),
        "{e}"
    );
    let e = w.drain(Duration::from_millis(300)).await.unwrap_err();
    assert!(
        matches!(&e, OrchestratorError::Transport(tensorwire_core::Error::Timeout { what, .. })
            if what.contains("draining this worker")),
        "{e}"
    );
    assert!(w.yield_requested(&a), "the drain asked for the job back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_elastic_service_moves_a_denoise_worker_to_decode_and_its_job_resumes_elsewhere() {
    // Decode (one slot, 400 ms an item) cannot keep up with denoise; latents may pile up
    // before decode (a large headroom), so denoise stays busy. "a", the one denoiser that can
    // also decode (100 ms a step), takes the first job alone; the rebalancer may not empty the
    // denoise pool, so it moves "a" only once "b" and "c" joined, while "a" runs that job: the
    // job yields a checkpoint and resumes on "b" or "c", and "a" joins the decode pool after
    // its 50 ms switch.
    let headroom = 100;
    let cfg = ServiceConfig {
        sched: SchedConfig { decode_headroom: headroom, ..SchedConfig::default() },
        rebalance: Some(RebalanceConfig {
            interval: Duration::from_millis(200),
            dwell: Duration::ZERO,
            horizon: Duration::from_secs(30),
            decode_headroom: headroom,
            ..RebalanceConfig::default()
        }),
        ..ServiceConfig::default()
    };
    let (p, mut ran) = Pipeline::start_with(&[], cfg, (1, Duration::from_millis(400))).await;
    let switch = Duration::from_millis(50);
    let spec = WorkerSpec {
        can: vec![(Stage::Decode, switch)],
        ..WorkerSpec::new(Stage::Denoise, 1, "h")
    };
    let (a, a_jobs) = p.denoiser_as("a", spec, Duration::from_millis(100)).await;
    let sub = SubmitClient::connect(p.svc.addr(), None).await.unwrap();
    let mut waits = Vec::new();
    for r in 1..=12 {
        waits.push(sub.submit(r, Priority::Batch).await.unwrap());
    }
    let mut seen = Vec::new();
    let first = tokio::time::timeout(WAIT, ran.recv()).await.unwrap().unwrap();
    assert_eq!((first.worker, first.step), ("a", 0));
    seen.push(first);
    let _b = p.denoiser("b").await;
    let _c = p.denoiser("c").await;
    // The switch order, the drain, the switch, and "a" joins decode.
    let to = tokio::time::timeout(WAIT, a.switch_order()).await.expect("a switch order");
    assert_eq!(to, Stage::Decode);
    assert_eq!(a.switch_requested(), Some(Stage::Decode));
    tokio::time::timeout(WAIT, a.drain(WAIT)).await.unwrap().unwrap();
    a_jobs.abort();
    drop(a);
    tokio::time::sleep(switch).await;
    let spec = WorkerSpec { switched: Some(switch), ..WorkerSpec::new(Stage::Decode, 1, "h") };
    let (a2, rx) = WorkerClient::join(p.svc.addr().into(), None, spec, HB).await.unwrap();
    tokio::spawn(p.serve_items(Arc::new(a2), rx, &[], (Duration::from_millis(400), "a")));
    for w in waits {
        outcome(w, &mut seen, &mut ran).await;
    }
    // Every request denoised once, step by step, and decoded once.
    let mut moved = 0;
    for r in 1..=12 {
        let s = steps(&seen, r);
        assert_eq!(s.iter().map(|s| s.1).collect::<Vec<_>>(), (0..STEPS).collect::<Vec<_>>());
        let k = s.iter().take_while(|s| s.0 == "a").count();
        if k > 0 && k < s.len() {
            assert!(s[k..].iter().all(|x| x.0 == s[k].0), "resumed on one worker: {s:?}");
            moved += 1;
        }
        assert_eq!(decoded(&seen, r).len(), 1, "decoded once");
    }
    assert_eq!(moved, 1, "the job running on a moved on from its checkpoint: {seen:?}");
    assert!((1..=12).any(|r| decoded(&seen, r) == ["a"]), "a decoded after the switch");
    let st = p.svc.stats().await.unwrap();
    assert_eq!((st.sched.yielded, st.duplicated, st.sched.requeued), (1, 0, 0));
}
