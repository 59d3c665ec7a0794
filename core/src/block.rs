//! Waiting on a future from a thread outside the runtime (every Python caller, a Rust caller
//! that is not async): the thread polls the future itself, and after each `Pending` spins for a
//! bounded span before it parks. The future's IO and timers are driven by the runtime's
//! workers, as with `Handle::block_on`.
//!
//! Why: a caller that parks pays, when the answer comes, for a worker's wake-up call and for
//! being scheduled again. Measured from Python on the 2-vCPU host (fine-grained turns in one
//! process; docs/performance.md, "Twelfth part"), a 4 KiB tcp write or read took 34-45 us
//! parked and 24-32 us spinning up to 100 us first (0.68-0.74 of it); 64 KiB 0.79-0.87;
//! 128-256 KiB 0.74-0.96 (one 256 KiB read 1.11); a publish+consume of 4-64 KiB 0.79-0.82. A
//! spinning caller holds a CPU the runtime's workers would copy on, so the spin only pays
//! where the answer comes soon: at 1 and 4 MiB the same spin made ops 1.17-1.40x as slow.
//! Hence [`spin_for`]: callers spin only for short ops, and not at all with the linger off.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// Ops of at most these many bytes are waited for spinning first ([`spin_for`]).
pub const SHORT_BYTES: u64 = 256 << 10;

/// The longest a caller spins for a short op before it parks: a 4-64 KiB tcp op answers within
/// 25-60 us on the 2-vCPU host.
pub const SPIN: Duration = Duration::from_micros(100);

/// How long a caller waiting for an op of `bytes` spins before it parks: [`SPIN`] for a short
/// op ([`SHORT_BYTES`]), bounded by the linger's span (so `TENSORWIRE_LINGER_US=0` turns every
/// busy wait off); zero for a longer one.
pub fn spin_for(bytes: u64) -> Duration {
    match bytes <= SHORT_BYTES {
        true => SPIN.min(crate::linger::span()),
        false => Duration::ZERO,
    }
}

/// Set by the future's waker; the waiting thread takes it before each poll.
struct Woken {
    flag: AtomicBool,
    thread: Thread,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.flag.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// Polls `fut` on this thread until it is ready or `deadline` has passed (then `None`; the
/// caller drops the future): after each `Pending`, spins (without a system call) until the
/// waker fires or `spin` has passed since the call, then parks until it fires or the deadline
/// comes. The deadline needs no timer of the runtime: the parked thread wakes at it itself.
/// Call it inside the runtime's context (`Handle::enter`) when the future uses tokio's IO or
/// timers: the runtime's workers drive them, this thread only polls. Not from a runtime worker
/// (it would hold the worker until the future is ready).
pub fn block_on<F: Future>(
    mut fut: Pin<&mut F>,
    spin: Duration,
    deadline: Instant,
) -> Option<F::Output> {
    let woken = Arc::new(Woken { flag: AtomicBool::new(false), thread: std::thread::current() });
    let waker = Waker::from(woken.clone());
    let mut cx = Context::from_waker(&waker);
    let spin_until = Instant::now() + spin;
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return Some(v);
        }
        // A wake during the poll has set the flag already: then this polls again at once.
        while !woken.flag.swap(false, Ordering::Acquire) {
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            if now < spin_until {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            } else {
                // Returns on an unpark (the waker's, or a stale one), at the deadline, or
                // spuriously: the flag and the clock say which.
                #[cfg(test)]
                tests::PARKS.with(|p| p.set(p.get() + 1));
                std::thread::park_timeout(deadline - now);
            }
        }
    }
}

/// Polls `fut` once with a waker that does nothing: its output if it is ready at once (a
/// publication, a chunk that has landed), else `Pending` (then wait with [`block_on`], which
/// polls it again with a waker that counts).
pub fn now<F: Future>(fut: Pin<&mut F>) -> Poll<F::Output> {
    fut.poll(&mut Context::from_waker(Waker::noop()))
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// How often `block_on` parked on this thread.
        pub(super) static PARKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    fn parks() -> u64 {
        PARKS.with(std::cell::Cell::get)
    }

    /// A future that is ready at its poll after the `n`th wake, each wake coming from another
    /// thread `delay` after a poll.
    fn woken_later(n: usize, delay: Duration) -> impl Future<Output = usize> {
        let mut polls = 0;
        std::future::poll_fn(move |cx| {
            if polls == n {
                return Poll::Ready(polls);
            }
            polls += 1;
            let w = cx.waker().clone();
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                w.wake();
            });
            Poll::Pending
        })
    }

    #[test]
    fn ready_at_once_and_after_wakes_spinning_or_parked() {
        let far = || Instant::now() + Duration::from_secs(30);
        for spin in [Duration::ZERO, Duration::from_millis(50)] {
            assert_eq!(block_on(std::pin::pin!(async { 7 }), spin, far()), Some(7));
            for delay in [Duration::ZERO, Duration::from_millis(5)] {
                let fut = std::pin::pin!(woken_later(3, delay));
                assert_eq!(block_on(fut, spin, far()), Some(3));
            }
        }
    }

    #[test]
    fn a_future_never_ready_ends_at_the_deadline_spinning_or_parked() {
        for spin in [Duration::ZERO, Duration::from_millis(5), Duration::from_secs(30)] {
            let start = Instant::now();
            let deadline = start + Duration::from_millis(20);
            let fut = std::pin::pin!(std::future::pending::<u8>());
            assert_eq!(block_on(fut, spin, deadline), None);
            assert!(Instant::now() >= deadline);
        }
        // Woken, but not ready, after the deadline: still `None`.
        let fut = std::pin::pin!(woken_later(1000, Duration::from_millis(2)));
        assert_eq!(block_on(fut, Duration::ZERO, Instant::now() + Duration::from_millis(20)), None);
    }

    #[test]
    fn short_ops_spin_long_ones_park() {
        // The linger's span is its default here (no test of this binary changes it).
        let spin = SPIN.min(crate::linger::span());
        assert!(spin > Duration::ZERO);
        for bytes in [0, 4096, SHORT_BYTES] {
            assert_eq!(spin_for(bytes), spin);
        }
        assert_eq!(spin_for(SHORT_BYTES + 1), Duration::ZERO);
        assert_eq!(SHORT_BYTES, 256 * 1024);
    }

    #[test]
    fn a_spinning_wait_does_not_park_and_one_without_spin_does() {
        let far = Instant::now() + Duration::from_secs(30);
        let before = parks();
        let fut = std::pin::pin!(woken_later(2, Duration::from_millis(2)));
        assert_eq!(block_on(fut, Duration::from_secs(30), far), Some(2));
        assert_eq!(parks(), before);
        // Woken 50 ms after each poll: the thread has parked by then.
        let fut = std::pin::pin!(woken_later(3, Duration::from_millis(50)));
        assert_eq!(block_on(fut, Duration::ZERO, far), Some(3));
        assert!(parks() > before);
    }

    #[test]
    fn now_tells_ready_from_pending() {
        assert_eq!(now(std::pin::pin!(async { 1 })), Poll::Ready(1));
        let mut pending = std::pin::pin!(std::future::pending::<u8>());
        assert_eq!(now(pending.as_mut()), Poll::Pending);
    }
}
