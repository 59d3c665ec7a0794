//! Lingering: after activity, up to two runtime workers stay awake for a short span instead of
//! parking, so that what comes next (a peer's answer, the next request, the caller's next call)
//! finds a worker running.
//!
//! Why: a transfer's every step is a wake-up (the answer lands on a socket, a request arrives,
//! a caller outside the runtime calls again), and a tokio worker with nothing to do parks in the
//! kernel. Waking a parked thread costs 5-90 us on a virtual machine whose idle CPUs halt, more
//! than a 64 KiB op's copies. Between two processes on the 2-vCPU host a 4-256 KiB tcp op took
//! 60-90 us, nearly all of it such wake-ups (docs/performance.md, "Small ops", the eleventh
//! part); a Python caller pays them between its calls too (the ninth and tenth parts).
//!
//! How: [`arm`] moves a process-wide deadline to `span` from now and starts lingering tasks on
//! the current runtime, at most [`AWAKE`] in the process. Each, until the deadline, yields its
//! thread (`sched_yield`: a thread waiting for that CPU runs) and then its worker (which runs its
//! other tasks and polls its sockets and timers instead of parking). The engine arms it when it
//! submits ops that run in the background and when it serves a peer's access; the Python
//! binding when a call has to wait and when it returns.
//!
//! The cost is bounded: at most two workers spin, for at most `span` after the last activity,
//! and an idle process spins not at all. `TENSORWIRE_LINGER_US` sets the span when the process
//! first arms it (0 turns it off; over 1 s, or not a number: the default); [`set_span`] changes
//! it.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// The span when `TENSORWIRE_LINGER_US` does not say.
pub const DEFAULT: Duration = Duration::from_millis(1);

/// The longest span: longer, a worker would spin most of the time.
pub const MAX: Duration = Duration::from_secs(1);

/// How many tasks linger at most, in the whole process: a transfer keeps a worker busy on each
/// side (two lingering tasks measured better than one, ninth part).
pub const AWAKE: usize = 2;

/// The linger's state: how long, until when, and how many tasks are awake.
struct Linger {
    /// The span, in nanoseconds (0: off).
    span: AtomicU64,
    /// Until when tasks stay awake, in nanoseconds since `now()`'s epoch.
    until: AtomicU64,
    /// Tasks lingering now (`AWAKE` at most).
    awake: AtomicUsize,
}

static LINGER: OnceLock<Linger> = OnceLock::new();

fn state() -> &'static Linger {
    LINGER.get_or_init(|| {
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

/// The span now (zero: off).
pub fn span() -> Duration {
    Duration::from_nanos(state().span.load(SeqCst))
}

/// Sets the span (zero turns lingering off; more than [`MAX`] is taken as `MAX`) and returns
/// the span before. A task lingering now stops at its current deadline.
pub fn set_span(span: Duration) -> Duration {
    let before = state().span.swap(nanos(span.min(MAX)), SeqCst);
    Duration::from_nanos(before)
}

/// Tasks lingering now, in the process.
pub fn awake() -> usize {
    state().awake.load(SeqCst)
}

/// Activity: keeps workers of the current runtime awake until `span` from now (or later, if
/// an earlier arm asked for later). Does nothing outside a runtime or when the span is zero.
pub fn arm() {
    if let Ok(h) = tokio::runtime::Handle::try_current() {
        arm_on(&h);
    }
}

/// [`arm`] on the runtime of `handle`.
pub fn arm_on(handle: &tokio::runtime::Handle) {
    let l = state();
    let span = l.span.load(SeqCst);
    if span == 0 {
        return;
    }
    l.until.fetch_max(now().saturating_add(span), SeqCst);
    while let Some(slot) = Slot::take(l) {
        handle.spawn(stay_awake(slot));
    }
}

/// One of the `AWAKE` places; given back when dropped (also when its task is dropped unfinished,
/// as when its runtime shuts down).
struct Slot(&'static Linger);

impl Slot {
    /// A place, if fewer than `AWAKE` are taken.
    fn take(l: &'static Linger) -> Option<Slot> {
        let ok = l.awake.fetch_update(SeqCst, SeqCst, |n| (n < AWAKE).then_some(n + 1)).is_ok();
        ok.then(|| Slot(l))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.awake.fetch_sub(1, SeqCst);
    }
}

/// Yields until the deadline has passed.
async fn stay_awake(slot: Slot) {
    let l = slot.0;
    let mut slot = Some(slot);
    while slot.is_some() {
        while now() < l.until.load(SeqCst) {
            // The thread first (another thread waiting for this CPU, often a caller's, runs),
            // then the task (the worker runs its other tasks and polls its sockets).
            std::thread::yield_now();
            tokio::task::yield_now().await;
        }
        drop(slot.take());
        // An arm that moved the deadline after the check above either found this place taken
        // (and started no task) or free (and started its own): go on only if a place is free.
        if now() < l.until.load(SeqCst) {
            slot = Slot::take(l);
        }
    }
}
