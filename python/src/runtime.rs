//! One tokio runtime per process for every binding object, and the one way Python waits on it:
//! with the GIL released and a bound on the wait.

use std::future::Future;
use std::sync::OnceLock;
use std::task::Poll;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use tensorwire_core::block;

use crate::errors::{Failure, Res};

static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();

/// The runtime (started on first use).
pub(crate) fn runtime() -> Res<&'static tokio::runtime::Runtime> {
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("tensorwire")
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Failure::new("InternalError", format!("cannot start the runtime: {e}")))
}

/// The longest wait: a larger timeout waits this long (a deadline the clock can hold).
const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A timeout in seconds from Python: positive and finite (at most a century is waited).
pub(crate) fn seconds(timeout: f64) -> Res<Duration> {
    if timeout.is_finite() && timeout > 0.0 {
        Ok(Duration::try_from_secs_f64(timeout).map_or(CENTURY, |d| d.min(CENTURY)))
    } else {
        Err(Failure::invalid(format!(
            "timeout must be a positive number of seconds, not {timeout}"
        )))
    }
}

/// Runs `fut` with the GIL released, for at most `timeout`: polled on the calling thread (in
/// the runtime's context; the runtime's workers drive its IO and timers), which parks while
/// it waits. A future ready at its first poll returns at once; else workers linger
/// (`tensorwire_core::linger`, see `linger`) from then and after its end.
pub(crate) fn wait<T, F>(py: Python<'_>, timeout: Duration, what: &str, fut: F) -> PyResult<T>
where
    T: Send,
    F: Future<Output = Res<T>> + Send,
{
    wait_spinning(py, timeout, what, Duration::ZERO, fut)
}

/// `wait` for a transfer of `bytes`: the caller spins before it parks when the transfer is
/// short (`tensorwire_core::block::spin_for`).
pub(crate) fn wait_sized<T, F>(
    py: Python<'_>,
    timeout: Duration,
    what: &str,
    bytes: u64,
    fut: F,
) -> PyResult<T>
where
    T: Send,
    F: Future<Output = Res<T>> + Send,
{
    wait_spinning(py, timeout, what, block::spin_for(bytes), fut)
}

fn wait_spinning<T, F>(
    py: Python<'_>,
    timeout: Duration,
    what: &str,
    spin: Duration,
    fut: F,
) -> PyResult<T>
where
    T: Send,
    F: Future<Output = Res<T>> + Send,
{
    let r = py.detach(|| {
        let deadline = Instant::now() + timeout;
        let rt = runtime()?;
        let _entered = rt.enter();
        let mut fut = std::pin::pin!(fut);
        if let Poll::Ready(r) = block::now(fut.as_mut()) {
            return r;
        }
        tensorwire_core::linger::arm_on(rt.handle());
        let r = match block::block_on(fut, spin, deadline) {
            Some(r) => r,
            None => Err(Failure::new(
                "TimeoutError",
                format!("{what}: no answer within {:.3} s", timeout.as_secs_f64()),
            )),
        };
        tensorwire_core::linger::arm_on(rt.handle());
        r
    });
    r.map_err(|f| f.into_py(py))
}
