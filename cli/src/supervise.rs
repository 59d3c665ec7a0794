//! A process manager for `demo --processes`: keeps one process running per worker slot (one that
//! exits, however it died, is started again after a backoff that doubles up to a cap and resets
//! once it has stayed up a while) and, with chaos on, kills a random live worker with SIGKILL at
//! random intervals. Each process's `@@` lines go to one channel.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tensorwire_sim::rng::Rng;
use tokio::sync::mpsc;

/// First restart delay; it doubles per quick death up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(3);
/// A process up this long has its backoff reset.
const HEALTHY: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(20);

/// Random kills: on average one per `every`, uniformly spread over [0.5, 1.5] of it.
#[derive(Debug, Clone)]
pub(crate) struct Chaos {
    pub(crate) every: Duration,
    pub(crate) seed: u64,
    /// With a gate, a kill that is due waits until every slot's process is up and the gate is
    /// open, and each kill closes it (its owner opens it again when the loss is made good: the
    /// store's repair, once its copies are back). Processes that hold state which `R` copies
    /// protect then lose one at a time, as those copies can take.
    pub(crate) gate: Option<Arc<AtomicBool>>,
}

/// What the supervisor did.
#[derive(Debug, Clone, Default)]
pub(crate) struct SupervisorReport {
    /// Kills per slot label.
    pub(crate) killed: Vec<(String, u32)>,
    /// Restarts after any exit.
    pub(crate) restarts: u32,
    /// Starts that failed (the binary could not be run).
    pub(crate) spawn_errors: u32,
}

/// One worker slot: how to start its process, and its state.
pub(crate) struct Slot {
    label: String,
    command: Box<dyn Fn() -> Command + Send>,
    child: Option<(Child, Instant)>,
    backoff: Duration,
    start_at: Option<Instant>,
    kills: u32,
}

impl Slot {
    /// A slot labelled `label` (its stage) started with `command`.
    pub(crate) fn new(label: &str, command: impl Fn() -> Command + Send + 'static) -> Slot {
        Slot {
            label: label.to_string(),
            command: Box::new(command),
            child: None,
            backoff: FIRST_BACKOFF,
            start_at: Some(Instant::now()),
            kills: 0,
        }
    }

    fn spawn(&mut self, lines: &mpsc::Sender<String>) -> std::io::Result<()> {
        let mut child = (self.command)().stdout(Stdio::piped()).spawn()?;
        if let Some(out) = child.stdout.take() {
            let tx = lines.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(out).lines().map_while(Result::ok) {
                    if let Some(at) = l.find("@@") {
                        let _ = tx.blocking_send(l[at + 2..].to_string());
                    }
                }
            });
        }
        self.child = Some((child, Instant::now()));
        Ok(())
    }

    /// Notices an exit and schedules the restart.
    fn reap(&mut self, now: Instant) -> bool {
        let Some((c, since)) = &mut self.child else { return false };
        if !matches!(c.try_wait(), Ok(Some(_))) {
            return false;
        }
        self.backoff = match now.duration_since(*since) >= HEALTHY {
            true => FIRST_BACKOFF,
            false => (self.backoff * 2).min(MAX_BACKOFF),
        };
        self.child = None;
        self.start_at = Some(now + self.backoff);
        true
    }

    fn kill(&mut self) {
        if let Some((c, _)) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Supervised worker processes; [`Supervisor::stop`] (or dropping it) kills them all.
pub(crate) struct Supervisor {
    stop: Arc<AtomicBool>,
    armed: Arc<AtomicBool>,
    pids: Arc<Mutex<Vec<u32>>>,
    thread: Option<JoinHandle<(Vec<Slot>, SupervisorReport)>>,
}

impl Supervisor {
    /// Starts every slot now and keeps them running.
    pub(crate) fn start(
        slots: Vec<Slot>,
        lines: mpsc::Sender<String>,
        chaos: Option<Chaos>,
    ) -> Supervisor {
        let stop = Arc::new(AtomicBool::new(false));
        let armed = Arc::new(AtomicBool::new(false));
        let pids = Arc::new(Mutex::new(Vec::new()));
        let shared = (stop.clone(), armed.clone(), pids.clone());
        let thread = std::thread::spawn(move || {
            supervise(slots, &lines, chaos, (&shared.0, &shared.1), &shared.2)
        });
        Supervisor { stop, armed, pids, thread: Some(thread) }
    }

    /// Process ids of the workers running now.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.pids.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Starts the chaos (if any): kills begin one interval from now.
    pub(crate) fn unleash(&self) {
        self.armed.store(true, Ordering::Relaxed);
    }

    /// Kills every process and says what happened.
    pub(crate) fn stop(mut self) -> SupervisorReport {
        self.finish()
    }

    fn finish(&mut self) -> SupervisorReport {
        self.stop.store(true, Ordering::Relaxed);
        let Some(t) = self.thread.take() else { return SupervisorReport::default() };
        let Ok((mut slots, mut report)) = t.join() else { return SupervisorReport::default() };
        for s in &mut slots {
            s.kill();
            if s.kills > 0 {
                report.killed.push((s.label.clone(), s.kills));
            }
        }
        report
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.finish();
    }
}

fn supervise(
    mut slots: Vec<Slot>,
    lines: &mpsc::Sender<String>,
    chaos: Option<Chaos>,
    (stop, armed): (&AtomicBool, &AtomicBool),
    pids: &Mutex<Vec<u32>>,
) -> (Vec<Slot>, SupervisorReport) {
    let mut report = SupervisorReport::default();
    let mut rng = Rng::new(chaos.as_ref().map_or(1, |c| c.seed));
    let next_gap = |rng: &mut Rng, every: Duration| every.mul_f64(0.5 + rng.next_f64());
    let mut next_kill = None;
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if next_kill.is_none() && armed.load(Ordering::Relaxed) {
            next_kill = chaos.as_ref().map(|c| now + next_gap(&mut rng, c.every));
        }
        for s in &mut slots {
            if s.reap(now) {
                report.restarts += 1;
            }
            if s.child.is_none() && s.start_at.is_some_and(|t| t <= now) {
                s.start_at = None;
                if let Err(e) = s.spawn(lines) {
                    eprintln!("supervisor: cannot start a {} worker: {e}", s.label);
                    report.spawn_errors += 1;
                    s.start_at = Some(now + MAX_BACKOFF);
                }
            }
        }
        if let (Some(c), Some(at)) = (&chaos, next_kill) {
            let live: Vec<usize> = (0..slots.len()).filter(|&i| slots[i].child.is_some()).collect();
            let held = c
                .gate
                .as_ref()
                .is_some_and(|g| live.len() < slots.len() || !g.load(Ordering::Acquire));
            if now >= at && !held {
                if let Some(g) = &c.gate {
                    g.store(false, Ordering::Release);
                }
                if !live.is_empty() {
                    let i = live[(rng.next_u64() % live.len() as u64) as usize];
                    if let Some((child, _)) = &mut slots[i].child {
                        let _ = child.kill(); // SIGKILL; reaped (and restarted) next round
                        slots[i].kills += 1;
                    }
                }
                next_kill = Some(now + next_gap(&mut rng, c.every));
            }
        }
        let live = slots.iter().filter_map(|s| s.child.as_ref().map(|(c, _)| c.id())).collect();
        *pids.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = live;
        std::thread::sleep(POLL);
    }
    (slots, report)
}
