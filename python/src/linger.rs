//! Lingering: while a call from Python runs and for a short while after it returns, runtime
//! workers stay awake (two tasks yield in turn, so the workers running them still run other
//! tasks and poll sockets), so that neither the call's own work nor the next call finds them
//! parked.
//!
//! Why: a Python caller is a thread outside the runtime. Between two calls it runs Python code
//! (tens of microseconds), long enough for the runtime's workers to run out of work and park;
//! the next call then waits for a parked worker to be woken, and on a virtual machine whose
//! idle CPUs halt that costs tens of microseconds per wake, several times per handoff. A Rust
//! caller on a runtime task does not pay it: its worker is running when the next call starts.
//! The same holds inside a call that waits for a transfer: between two readiness events of its
//! sockets a worker with nothing else to do parks, unless a lingering task keeps it awake.
//! Measured on the 2-vCPU host (`python/bench/linger.py`, variants taking turns in one process;
//! docs/performance.md, "Ninth part" and "Tenth part"): the linger after each call made
//! publish+consume from Python 1.3-1.6x as fast at 1 MiB and 1.1x at 4 MiB; arming it at each
//! call's start as well and for 1 ms instead of 300 us gave 1.09-1.29x at 4 MiB, and
//! 0.95-1.16x at 1 MiB and 0.97-1.05x at 64 MiB (within the noise; five runs). Two tasks did better than one (a handoff keeps a
//! worker busy on each side), and yielding the thread as well as the task better than the task
//! alone (on two cores the caller often waits for the CPU a lingering worker holds).
//!
//! The cost is bounded: at most two workers spin, for at most `span` past the start or the end
//! of the last call, and an idle process (no calls) spins not at all. `TENSORWIRE_LINGER_US`
//! sets the span at start (0 turns it off); `tensorwire.set_linger(seconds)` changes it.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// The span when `TENSORWIRE_LINGER_US` does not say.
pub(crate) const DEFAULT: Duration = Duration::from_millis(1);

/// The linger's state: how long, until when, and how many tasks are staying awake.
struct Linger {
    /// The span, in nanoseconds (0: off).
    span: AtomicU64,
    /// Until when workers stay awake, in nanoseconds since `now()`'s epoch.
    until: AtomicU64,
    /// Tasks staying awake now (`AWAKE` at most).
    awake: AtomicUsize,
}

/// How many tasks stay awake: a handoff keeps two workers busy (one on each side).
const AWAKE: usize = 2;

static LINGER: OnceLock<Linger> = OnceLock::new();

fn state() -> &'static Linger {
    LINGER.get_or_init(|| {
        // Unset, or not a number of microseconds up to `MAX`: the default.
        let span = std::env::var("TENSORWIRE_LINGER_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_micros)
            .filter(|d| *d <= MAX)
            .unwrap_or(DEFAULT);
        Linger { span: AtomicU64::new(nanos(span)), until: AtomicU64::new(0), awake: 0.into() }
    })
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Nanoseconds since the first call here (a process-wide monotonic clock).
fn now() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    nanos(EPOCH.get_or_init(Instant::now).elapsed())
}

/// The span now.
pub(crate) fn span() -> Duration {
    Duration::from_nanos(state().span.load(SeqCst))
}

/// Sets the span (zero: off). A task lingering now stops at its current deadline.
pub(crate) fn set_span(span: Duration) {
    state().span.store(nanos(span), SeqCst);
}

/// A call from Python starts or returned: keep workers awake until `span` from now (or later, if
/// an earlier call asked for later).
pub(crate) fn arm(rt: &tokio::runtime::Runtime) {
    let l = state();
    let span = l.span.load(SeqCst);
    if span == 0 {
        return;
    }
    l.until.fetch_max(now().saturating_add(span), SeqCst);
    while join(l) {
        rt.spawn(stay_awake(l));
    }
}

/// Counts one more task staying awake, if fewer than `AWAKE` are.
fn join(l: &Linger) -> bool {
    l.awake.fetch_update(SeqCst, SeqCst, |n| (n < AWAKE).then_some(n + 1)).is_ok()
}

/// Yields until the deadline has passed: the worker running it polls its sockets and queues at
/// every turn instead of parking, and gives its CPU to any thread waiting for one.
async fn stay_awake(l: &'static Linger) {
    loop {
        while now() < l.until.load(SeqCst) {
            // The thread first (another thread waiting for this CPU, often the caller's, runs),
            // then the task (the worker runs its other tasks and polls its sockets).
            std::thread::yield_now();
            tokio::task::yield_now().await;
        }
        l.awake.fetch_sub(1, SeqCst);
        // A call that moved the deadline after the check above either counted this task (and
        // started none) or did not (and started its own): go on only while there is room.
        if now() >= l.until.load(SeqCst) || !join(l) {
            return;
        }
    }
}

/// The longest span `set_linger` takes: longer, a worker would spin most of the time.
const MAX: Duration = Duration::from_secs(1);

/// Sets how long runtime workers stay awake after each call (seconds, 0 to 1; 0 turns it off)
/// and returns the span before.
#[pyo3::pyfunction]
pub(crate) fn set_linger(py: pyo3::Python<'_>, seconds: f64) -> pyo3::PyResult<f64> {
    let wanted = match Duration::try_from_secs_f64(seconds) {
        Ok(d) if d <= MAX => d,
        _ => {
            let e = crate::errors::Failure::invalid(format!(
                "linger must be from 0 to {} seconds, not {seconds}",
                MAX.as_secs_f64()
            ));
            return Err(e.into_py(py));
        }
    };
    let before = span();
    set_span(wanted);
    Ok(before.as_secs_f64())
}
