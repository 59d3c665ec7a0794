//! The orchestrator from Python: serve it, join a stage pool as a worker, submit requests and
//! wait for their outcomes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use tensorwire_observe::{Endpoint, Health, Target};
use tensorwire_orchestrator::rebalance::RebalanceConfig;
use tensorwire_orchestrator::service::{
    self, OrchestratorService, ServiceConfig, SubmitClient, WorkerClient, WorkerSpec,
};
use tensorwire_orchestrator::timeline::Mark;
use tensorwire_orchestrator::{OrchestratorError, Priority, Stage};
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::engine::{addr, secret};
use crate::errors::{Failure, Raise, Res};
use crate::runtime::{runtime, seconds, wait};

fn stage(s: &str) -> Res<Stage> {
    Stage::ALL
        .into_iter()
        .find(|st| st.name() == s)
        .ok_or_else(|| Failure::invalid(format!("stage {s:?}: expected encode, denoise or decode")))
}

fn priority(s: &str) -> Res<Priority> {
    match s {
        "interactive" => Ok(Priority::Interactive),
        "batch" => Ok(Priority::Batch),
        _ => Err(Failure::invalid(format!("priority {s:?}: expected interactive or batch"))),
    }
}

/// Starts this process's metrics endpoint on `listen`, when asked for.
async fn metrics_endpoint(
    listen: Option<SocketAddr>,
    expose: bool,
    process: &str,
    health: Health,
) -> tensorwire_core::Result<Option<Endpoint>> {
    let Some(listen) = listen else { return Ok(None) };
    let ep = Endpoint::start(process, listen, health, expose).await;
    Ok(Some(ep.map_err(tensorwire_core::Error::InvalidArgument)?))
}

fn optional_addr(a: Option<&str>) -> Res<Option<SocketAddr>> {
    a.map(addr).transpose()
}

/// A length of time in seconds, zero allowed (`name` for the error).
fn span(name: &str, x: f64) -> Res<Duration> {
    if x.is_finite() && (0.0..1e9).contains(&x) {
        Ok(Duration::from_secs_f64(x))
    } else {
        Err(Failure::invalid(format!("{name}: {x} is not a number of seconds >= 0")))
    }
}

/// The rebalancer's settings from `Service(elastic={...})`: seconds for `interval`, `dwell` and
/// `horizon`, a count for `max_moves`, a factor for `hysteresis`.
fn rebalance(d: &Bound<'_, PyDict>, headroom: u32) -> Res<RebalanceConfig> {
    let mut cfg = RebalanceConfig { decode_headroom: headroom, ..RebalanceConfig::default() };
    for (k, v) in d.iter() {
        let key: String = k.extract().map_err(|_| Failure::invalid("elastic: keys are names"))?;
        let x: f64 = v
            .extract()
            .map_err(|_| Failure::invalid(format!("elastic[{key:?}]: expected a number")))?;
        match key.as_str() {
            "interval" => cfg.interval = span("elastic interval", x)?,
            "dwell" => cfg.dwell = span("elastic dwell", x)?,
            "horizon" => cfg.horizon = span("elastic horizon", x)?,
            "hysteresis" => cfg.hysteresis = x,
            "max_moves" if x >= 0.0 && x.fract() == 0.0 && x <= 1e6 => cfg.max_moves = x as usize,
            "max_moves" => {
                return Err(Failure::invalid(format!("elastic max_moves {x}: a count")));
            }
            _ => {
                return Err(Failure::invalid(format!(
                    "elastic: unknown setting {key:?} (interval, dwell, horizon, max_moves, hysteresis)"
                )));
            }
        }
    }
    cfg.check().map_err(Failure::invalid)?;
    Ok(cfg)
}

/// The orchestrator service (scheduler, work queues, re-queue on worker loss).
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Service {
    inner: OrchestratorService,
    metrics: Option<Endpoint>,
}

#[pymethods]
impl Service {
    /// Serves on `listen`; on an address other hosts can reach it needs `secret_file` or
    /// `insecure=True`. With `journal` (a file path) a service started again on the same
    /// journal resumes every request the previous one had; workers and submitters reconnect by
    /// themselves.
    #[new]
    ///
    /// With `metrics_listen` (e.g. "127.0.0.1:9464"; port 0: any free port) this process
    /// serves Prometheus metrics at /metrics, /healthz, /readyz and, at /sd, the metrics
    /// endpoints of the workers that joined with one; `metrics_expose=True` allows an address
    /// other hosts can reach.
    ///
    /// With `elastic` (a dict, e.g. `{"interval": 10, "dwell": 60, "horizon": 300}`, seconds;
    /// also `max_moves`, `hysteresis`; `{}` for the defaults) the service moves workers that
    /// said they can serve other stages (`Worker(can=...)`) between pools as the load shifts.
    #[pyo3(signature = (listen = "127.0.0.1:0", *, secret_file = None, insecure = false, heartbeat_timeout = 10.0, max_attempts = 3, journal = None, timeout = 30.0, metrics_listen = None, metrics_expose = false, elastic = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        secret_file: Option<std::path::PathBuf>,
        insecure: bool,
        heartbeat_timeout: f64,
        max_attempts: u32,
        journal: Option<std::path::PathBuf>,
        timeout: f64,
        metrics_listen: Option<&str>,
        metrics_expose: bool,
        elastic: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Service> {
        let listen = addr(listen).raise(py)?;
        let metrics_listen = optional_addr(metrics_listen).raise(py)?;
        let headroom = ServiceConfig::default().sched.decode_headroom;
        let mut cfg = ServiceConfig {
            secret: secret(secret_file).raise(py)?,
            insecure,
            journal,
            rebalance: elastic.map(|d| rebalance(d, headroom)).transpose().raise(py)?,
            ..ServiceConfig::default()
        };
        cfg.sched.heartbeat_timeout = seconds(heartbeat_timeout).raise(py)?;
        cfg.sched.max_attempts = max_attempts;
        let (inner, metrics) =
            wait(py, seconds(timeout).raise(py)?, "starting the orchestrator", async move {
                let inner = OrchestratorService::serve(listen, cfg).await?;
                let health = Health::new();
                let list = inner.metrics_targets_fn();
                health.targets(move || {
                    list()
                        .into_iter()
                        .map(|t| Target { labels: t.labels(), addr: t.addr })
                        .collect()
                });
                let ep = metrics_endpoint(metrics_listen, metrics_expose, "orchestrator", health);
                let ep = ep.await?;
                // The orchestrator's families, from its start (at zero).
                tensorwire_observe::export_at_zero(&[tensorwire_observe::Layer::Orchestrator]);
                Ok((inner, ep))
            })?;
        Ok(Service { inner, metrics })
    }

    /// The address workers and submitters connect to.
    #[getter]
    fn address(&self) -> String {
        self.inner.addr().to_string()
    }

    /// The metrics endpoint's address (None without `metrics_listen`).
    #[getter]
    fn metrics_address(&self) -> Option<String> {
        self.metrics.as_ref().map(|e| e.addr().to_string())
    }
}

/// An item assigned to this worker.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Assignment {
    inner: service::Assignment,
}

#[pymethods]
impl Assignment {
    /// The request.
    #[getter]
    fn request(&self) -> u64 {
        self.inner.request
    }
    /// The stage ("encode", "denoise", "decode").
    #[getter]
    fn stage(&self) -> &'static str {
        self.inner.stage.name()
    }
    /// The request's class ("interactive" or "batch").
    #[getter]
    fn priority(&self) -> &'static str {
        self.inner.priority.name()
    }
    /// Try number (1 the first time; more after a worker was lost or an attempt failed).
    #[getter]
    fn attempt(&self) -> u32 {
        self.inner.attempt
    }
    /// What the previous stage reported (its outputs, e.g. payload handles); empty for encode.
    #[getter]
    fn inputs<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.inputs)
    }
    /// The item's last checkpoint, from a worker that ran it before: `(step, saved state)`, or
    /// None. Resume from that step instead of the first.
    #[getter]
    fn resume<'py>(&self, py: Python<'py>) -> Option<(u32, Bound<'py, PyBytes>)> {
        self.inner.resume.as_ref().map(|(step, d)| (*step, PyBytes::new(py, d)))
    }
    /// With `release_only`: every output the request's stages reported.
    #[getter]
    fn held<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        self.inner.held.iter().map(|h| PyBytes::new(py, h)).collect()
    }
    /// True when there is nothing to run: the request ended and nothing will consume `held`;
    /// release them, then call `Worker.released(assignment)`.
    #[getter]
    fn release_only(&self) -> bool {
        self.inner.release_only
    }
}

/// A stage worker joined to the orchestrator; heartbeats go out in the background.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Worker {
    client: WorkerClient,
    rx: Mutex<mpsc::Receiver<service::Assignment>>,
    metrics: Option<Endpoint>,
}

#[pymethods]
impl Worker {
    /// Joins the pool of `stage` at the orchestrator `address` with `slots` concurrent items.
    /// With `metrics_listen`, this process serves its metrics there (see `Service`; ready once
    /// joined) and tells the orchestrator where, so that its /sd lists this worker.
    ///
    /// Elastic pools: `can` maps the other stages this worker can serve to the seconds a
    /// switch there takes (loading that stage's weights), e.g. `{"decode": 12.0}`; a service
    /// with `elastic` may then tell it to switch (`switch_requested`, `wait_switch`). Joining
    /// again after a switch, pass `switched` (the seconds it took).
    #[new]
    #[pyo3(signature = (address, stage, *, slots = 1, secret_file = None, host = "localhost", heartbeat = 1.0, timeout = 30.0, metrics_listen = None, metrics_expose = false, can = None, switched = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        address: &str,
        stage: &str,
        slots: u32,
        secret_file: Option<std::path::PathBuf>,
        host: &str,
        heartbeat: f64,
        timeout: f64,
        metrics_listen: Option<&str>,
        metrics_expose: bool,
        can: Option<std::collections::BTreeMap<String, f64>>,
        switched: Option<f64>,
    ) -> PyResult<Worker> {
        let (a, st) = (addr(address).raise(py)?, self::stage(stage).raise(py)?);
        let mut others = Vec::new();
        for (name, secs) in can.unwrap_or_default() {
            let cost = span(&format!("can[{name:?}]"), secs).raise(py)?;
            others.push((self::stage(&name).raise(py)?, cost));
        }
        let switched = switched.map(|x| span("switched", x)).transpose().raise(py)?;
        let k = secret(secret_file).raise(py)?;
        let beat = seconds(heartbeat).raise(py)?;
        let metrics_listen = optional_addr(metrics_listen).raise(py)?;
        let host = host.to_string();
        let (client, rx, metrics) =
            wait(py, seconds(timeout).raise(py)?, "joining the orchestrator", async move {
                let joined = Arc::new(AtomicBool::new(false));
                let health = Health::new();
                let j = joined.clone();
                health.check("joined", move || j.load(Ordering::Acquire));
                let process = format!("worker-{}", st.name());
                let ep = metrics_endpoint(metrics_listen, metrics_expose, &process, health).await?;
                let labels: Vec<String> =
                    ep.iter().map(|e| service::metrics_label(e.addr())).collect();
                let spec = WorkerSpec {
                    labels,
                    can: others,
                    switched,
                    ..WorkerSpec::new(st, slots.max(1), &host)
                };
                let (client, rx) = WorkerClient::join(a.into(), k.as_ref(), spec, beat).await?;
                joined.store(true, Ordering::Release);
                Ok((client, rx, ep))
            })?;
        Ok(Worker { client, rx: Mutex::new(rx), metrics })
    }

    /// The metrics endpoint's address (None without `metrics_listen`).
    #[getter]
    fn metrics_address(&self) -> Option<String> {
        self.metrics.as_ref().map(|e| e.addr().to_string())
    }

    /// The id the orchestrator gave this worker.
    #[getter]
    fn id(&self) -> u64 {
        self.client.id()
    }

    /// The stage the orchestrator told this worker to serve instead (elastic pools), or None.
    /// It is draining meanwhile: finish or yield what it runs (`drain`), close it, load that
    /// stage and join again as a `Worker` of it with `switched=` the seconds the switch took.
    #[getter]
    fn switch_requested(&self) -> Option<&'static str> {
        self.client.switch_requested().map(|s| s.name())
    }

    /// Waits up to `timeout` seconds for a switch order; returns the stage, or None.
    #[pyo3(signature = (*, timeout = 30.0))]
    fn wait_switch(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<&'static str>> {
        let t = seconds(timeout).raise(py)?;
        let got = wait(py, t + Duration::from_secs(1), "a switch order", async {
            Ok(tokio::time::timeout(t, self.client.switch_order()).await.ok())
        })?;
        Ok(got.map(|s| s.name()))
    }

    /// The next assignment, or None when none came within `timeout` seconds. Raises
    /// `StoppedError` once the orchestrator is gone.
    #[pyo3(signature = (*, timeout = 30.0))]
    fn next(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Assignment>> {
        let t = seconds(timeout).raise(py)?;
        let got = wait(py, t + Duration::from_secs(1), "an assignment", async {
            let mut rx = self.rx.lock().await;
            match tokio::time::timeout(t, rx.recv()).await {
                Ok(Some(a)) => Ok(Some(a)),
                Ok(None) => Err(OrchestratorError::Stopped.into()),
                Err(_) => Ok(None),
            }
        })?;
        Ok(got.map(|inner| Assignment { inner }))
    }

    /// Says how this assignment's input payloads arrived: `nbytes` in all, the last byte in
    /// hand `seconds` after the consume started (kept in the request's timeline; best effort).
    #[pyo3(signature = (assignment, nbytes, seconds, *, timeout = 30.0))]
    fn handoff(
        &self,
        py: Python<'_>,
        assignment: &Assignment,
        nbytes: u64,
        seconds: f64,
        timeout: f64,
    ) -> PyResult<()> {
        let a = assignment.inner.clone();
        let took = self::seconds(seconds).raise(py)?;
        wait(py, self::seconds(timeout).raise(py)?, "a handoff report", async {
            Ok(self.client.handoff(&a, nbytes, took).await?)
        })
    }

    /// Says, before they exist, what `outputs` this assignment will report (e.g. the handle of a
    /// store-mode publish whose put is about to start): they are released when the request
    /// ends even if this worker dies before reporting.
    #[pyo3(signature = (assignment, outputs, *, timeout = 30.0))]
    fn announce(
        &self,
        py: Python<'_>,
        assignment: &Assignment,
        outputs: Vec<u8>,
        timeout: f64,
    ) -> PyResult<()> {
        let a = assignment.inner.clone();
        wait(py, seconds(timeout).raise(py)?, "an announcement", async {
            Ok(self.client.announce(&a, outputs).await?)
        })
    }

    /// Says the item reached `step` with its state saved as `state` (e.g. a step checkpoint's
    /// handle): should this worker die, the item's next try gets it as `assignment.resume`.
    /// It is handed out for release with the request's outputs when the request ends. Returns
    /// once queued; it goes out in the background.
    #[pyo3(signature = (assignment, step, state, *, timeout = 30.0))]
    fn checkpoint(
        &self,
        py: Python<'_>,
        assignment: &Assignment,
        step: u32,
        state: Vec<u8>,
        timeout: f64,
    ) -> PyResult<()> {
        let a = assignment.inner.clone();
        wait(py, seconds(timeout).raise(py)?, "a checkpoint", async {
            Ok(self.client.checkpoint(&a, step, state).await?)
        })
    }

    /// Whether the orchestrator asked for `assignment` back (an interactive job waits for the
    /// slot, or this worker is draining). Poll it at step boundaries; when true, save a
    /// checkpoint and call `yield_job`.
    fn yield_requested(&self, assignment: &Assignment) -> bool {
        self.client.yield_requested(&assignment.inner)
    }

    /// Gives `assignment` back at `step` with its state saved as `state` (empty: the last
    /// checkpoint stands): it waits in the queue again and its next worker gets
    /// `resume == (step, state)`. Do not report it afterwards.
    #[pyo3(signature = (assignment, step, state = None, *, timeout = 30.0))]
    fn yield_job(
        &self,
        py: Python<'_>,
        assignment: &Assignment,
        step: u32,
        state: Option<Vec<u8>>,
        timeout: f64,
    ) -> PyResult<()> {
        let a = assignment.inner.clone();
        wait(py, seconds(timeout).raise(py)?, "a yield", async {
            Ok(self.client.yield_job(&a, step, state.unwrap_or_default()).await?)
        })
    }

    /// Scale-down: this worker gets nothing new and its denoise jobs are asked back (see
    /// `yield_requested`; keep serving meanwhile, e.g. from another thread); returns once it
    /// holds nothing, or raises `TimeoutError` after `timeout` seconds.
    #[pyo3(signature = (*, timeout = 60.0))]
    fn drain(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = seconds(timeout).raise(py)?;
        wait(py, t + Duration::from_secs(1), "draining", async { Ok(self.client.drain(t).await?) })
    }

    /// Says the outputs of a `release_only` assignment are released (until then the
    /// orchestrator keeps them, and gives them to another worker should this one leave).
    #[pyo3(signature = (assignment, *, timeout = 30.0))]
    fn released(&self, py: Python<'_>, assignment: &Assignment, timeout: f64) -> PyResult<()> {
        let a = assignment.inner.clone();
        wait(py, seconds(timeout).raise(py)?, "a release report", async {
            Ok(self.client.released(&a).await?)
        })
    }

    /// Reports the end of `assignment`: its `outputs` go to the next stage, or `error` (a reason)
    /// re-queues it; with `input_lost`, the error says its input is gone for good (its producer
    /// died) and the stage before runs again instead.
    #[pyo3(signature = (assignment, outputs = None, *, error = None, input_lost = false, timeout = 30.0))]
    fn report(
        &self,
        py: Python<'_>,
        assignment: &Assignment,
        outputs: Option<Vec<u8>>,
        error: Option<String>,
        input_lost: bool,
        timeout: f64,
    ) -> PyResult<()> {
        let a = assignment.inner.clone();
        wait(py, seconds(timeout).raise(py)?, "a report", async {
            match (error, input_lost) {
                (Some(e), true) => self.client.report_lost_input(&a, &e).await?,
                (None, true) => self.client.report_lost_input(&a, "input lost").await?,
                (Some(e), false) => self.client.report_with(&a, Err::<Vec<u8>, _>(e)).await?,
                (None, false) => {
                    self.client
                        .report_with(&a, Ok::<_, String>(outputs.unwrap_or_default()))
                        .await?
                }
            }
            Ok(())
        })
    }
}

/// Submits requests to the orchestrator.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Submitter {
    inner: SubmitClient,
}

#[pymethods]
impl Submitter {
    /// Connects to the orchestrator at `address`.
    #[new]
    #[pyo3(signature = (address, *, secret_file = None, timeout = 30.0))]
    fn new(
        py: Python<'_>,
        address: &str,
        secret_file: Option<std::path::PathBuf>,
        timeout: f64,
    ) -> PyResult<Submitter> {
        let a = addr(address).raise(py)?;
        let k = secret(secret_file).raise(py)?;
        let inner =
            wait(py, seconds(timeout).raise(py)?, "connecting to the orchestrator", async move {
                Ok(SubmitClient::connect(a, k.as_ref()).await?)
            })?;
        Ok(Submitter { inner })
    }

    /// Submits `request` ("interactive" or "batch"); the returned `Outcome` waits for its end.
    /// With `start` (a stage after "encode") and `inputs`, the request starts there with those
    /// inputs (e.g. a cached embedding's reference) and the stages before never run. With
    /// `resume=(step, state)`, that stage resumes from an earlier request's checkpoint (edit
    /// and resume); it is not released when this request ends.
    #[pyo3(signature = (request, priority = "interactive", *, start = "encode", inputs = None, resume = None, timeout = 30.0))]
    fn submit(
        slf: &Bound<'_, Self>,
        request: u64,
        priority: &str,
        start: &str,
        inputs: Option<Vec<u8>>,
        resume: Option<(u32, Vec<u8>)>,
        timeout: f64,
    ) -> PyResult<Outcome> {
        let py = slf.py();
        let p = self::priority(priority).raise(py)?;
        let start = stage(start).raise(py)?;
        let this = slf.get();
        let inputs = inputs.unwrap_or_default();
        let rx = wait(py, seconds(timeout).raise(py)?, "a submission", async {
            Ok(this.inner.submit_resuming(request, p, start, inputs, resume).await?)
        })?;
        Ok(Outcome { request, rx: Mutex::new(Some(rx)), _client: slf.clone().unbind() })
    }

    /// The orchestrator's timeline of `request` (in flight, or among the last 4096 ended):
    /// `{"request", "priority", "events": [{"at", "stage", "mark", "worker", "bytes",
    /// "seconds"}]}` with `at` in seconds on the orchestrator's clock, `stage` None for the
    /// request's own events, `worker` set for a dispatch, `bytes` and `seconds` for a handoff
    /// (`Worker.handoff`); None when the orchestrator does not know the request.
    #[pyo3(signature = (request, *, timeout = 10.0))]
    fn timeline<'py>(
        &self,
        py: Python<'py>,
        request: u64,
        timeout: f64,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let t = seconds(timeout).raise(py)?;
        let got = wait(py, t + Duration::from_secs(1), "a timeline", async {
            Ok(self.inner.timeline(request, t).await?)
        })?;
        let Some(tl) = got else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("request", tl.request)?;
        d.set_item("priority", tl.priority.name())?;
        let events = PyList::empty(py);
        for e in &tl.events {
            let ev = PyDict::new(py);
            ev.set_item("at", e.at.as_secs_f64())?;
            ev.set_item("stage", e.stage.map(|s| s.name()))?;
            let (mark, worker, handoff) = match e.mark {
                Mark::Submitted => ("submitted", None, None),
                Mark::Restored => ("restored", None, None),
                Mark::Queued => ("queued", None, None),
                Mark::Dispatched { worker } => ("dispatched", Some(worker), None),
                Mark::Announced => ("announced", None, None),
                Mark::Handoff { bytes, micros } => ("handoff", None, Some((bytes, micros))),
                Mark::Done => ("done", None, None),
                Mark::Failed => ("failed", None, None),
                Mark::LostInput => ("lost_input", None, None),
                Mark::Yielded => ("yielded", None, None),
                Mark::Requeued => ("requeued", None, None),
                Mark::Ended { ok: true } => ("completed", None, None),
                Mark::Ended { ok: false } => ("request_failed", None, None),
            };
            ev.set_item("mark", mark)?;
            ev.set_item("worker", worker)?;
            ev.set_item("bytes", handoff.map(|h| h.0))?;
            ev.set_item("seconds", handoff.map(|h| h.1 as f64 / 1e6))?;
            events.append(ev)?;
        }
        d.set_item("events", events)?;
        Ok(Some(d))
    }
}

/// The end of a submitted request.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Outcome {
    request: u64,
    rx: Mutex<Option<oneshot::Receiver<tensorwire_orchestrator::Result<()>>>>,
    /// The outcome arrives on the submitter's connection: keep it open.
    _client: Py<Submitter>,
}

#[pymethods]
impl Outcome {
    /// The request.
    #[getter]
    fn request(&self) -> u64 {
        self.request
    }

    /// Waits for the request to complete; raises `RequestFailedError` (or another error) if it
    /// did not, `TimeoutError` if it did not end within `timeout`.
    #[pyo3(signature = (*, timeout = 60.0))]
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = seconds(timeout).raise(py)?;
        let _ = runtime().raise(py)?;
        wait(py, t, "the request's outcome", async {
            let mut g = self.rx.lock().await;
            let rx = g.as_mut().ok_or_else(|| Failure::invalid("the outcome was already taken"))?;
            let r = rx.await.map_err(|_| Failure::from(OrchestratorError::Stopped))?;
            *g = None;
            Ok(r?)
        })
    }
}
