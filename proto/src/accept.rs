//! Accepting connections without spinning: when a process runs out of file descriptors
//! (`EMFILE`, `ENFILE`) or kernel memory (`ENOBUFS`, `ENOMEM`), `accept` fails at once for as long
//! as the shortage lasts, and a loop that retries at once burns a core doing nothing. Every
//! accept loop of tensorwire goes through [`accept`], which backs off on those errors (and
//! briefly on any other) and says so at most once a second.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};

/// The pause after an accept that failed for lack of descriptors or memory.
pub const EXHAUSTED_PAUSE: Duration = Duration::from_millis(100);
/// The pause after any other failed accept (a connection reset before it was accepted, say).
pub const OTHER_PAUSE: Duration = Duration::from_millis(5);

/// Whether `e` says the process or system is out of descriptors or memory.
pub fn is_exhaustion(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM))
}

/// How long to wait after `e` before accepting again.
pub fn pause_after(e: &io::Error) -> Duration {
    if is_exhaustion(e) { EXHAUSTED_PAUSE } else { OTHER_PAUSE }
}

/// The next connection of `l` (named `what` in log lines), retried after a pause when accepting
/// fails.
pub async fn accept(l: &TcpListener, what: &'static str) -> (TcpStream, SocketAddr) {
    retrying(|| l.accept(), what).await
}

/// The first success of `attempt`, pausing after each failure as [`pause_after`] says.
async fn retrying<T, F: std::future::Future<Output = io::Result<T>>>(
    mut attempt: impl FnMut() -> F,
    what: &'static str,
) -> T {
    static LAST_WARNING: AtomicU64 = AtomicU64::new(0);
    loop {
        match attempt().await {
            Ok(c) => return c,
            Err(e) => {
                let pause = pause_after(&e);
                if is_exhaustion(&e) && due(&LAST_WARNING, since_start_ms()) {
                    tracing::warn!(listener = what, error = %e, ?pause,
                        "accept failed: out of descriptors or memory; backing off");
                } else {
                    tracing::debug!(listener = what, error = %e, "accept failed");
                }
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// Milliseconds since this process first asked, plus one (so never 0).
fn since_start_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// Whether a warning is due at `now_ms` (never 0): the first time, then at most once a second
/// (`last` holds when the last one was, 0 for never).
fn due(last: &AtomicU64, now_ms: u64) -> bool {
    let before = last.load(Ordering::Relaxed);
    (before == 0 || now_ms >= before + 1000)
        && last.compare_exchange(before, now_ms, Ordering::Relaxed, Ordering::Relaxed).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhaustion_backs_off_longer_than_other_errors() {
        for code in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            let e = io::Error::from_raw_os_error(code);
            assert!(is_exhaustion(&e));
            assert_eq!(pause_after(&e), EXHAUSTED_PAUSE);
        }
        let reset = io::Error::from_raw_os_error(libc::ECONNABORTED);
        assert!(!is_exhaustion(&reset));
        assert_eq!(pause_after(&reset), OTHER_PAUSE);
        assert!(OTHER_PAUSE > Duration::ZERO);
    }

    #[test]
    fn the_warning_is_rate_limited() {
        let last = AtomicU64::new(0);
        assert!(due(&last, 5));
        assert!(!due(&last, 5));
        assert!(!due(&last, 1004));
        assert!(due(&last, 1005));
        assert!(!due(&last, 2004));
        assert!(due(&last, 2005));
        assert!(since_start_ms() >= 1);
    }

    /// Out of descriptors, the loop pauses between tries instead of spinning: 30 failures
    /// take 30 pauses of (virtual) time, and a reset only a short one.
    #[tokio::test(start_paused = true)]
    async fn out_of_descriptors_the_loop_pauses_between_tries() {
        let tries = std::cell::Cell::new(0u32);
        let t0 = tokio::time::Instant::now();
        let got = retrying(
            || {
                tries.set(tries.get() + 1);
                let n = tries.get();
                async move {
                    match n {
                        1..=30 => Err(io::Error::from_raw_os_error(libc::EMFILE)),
                        31 => Err(io::Error::from_raw_os_error(libc::ECONNABORTED)),
                        _ => Ok(n),
                    }
                }
            },
            "test",
        )
        .await;
        assert_eq!(got, 32);
        assert_eq!(t0.elapsed(), EXHAUSTED_PAUSE * 30 + OTHER_PAUSE);
    }
}
