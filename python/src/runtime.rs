//! One tokio runtime per process for every binding object, and the one way Python waits on it:
//! with the GIL released and a bound on the wait.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;

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

/// A timeout in seconds from Python: positive and finite.
pub(crate) fn seconds(timeout: f64) -> Res<Duration> {
    if timeout.is_finite() && timeout > 0.0 {
        Ok(Duration::from_secs_f64(timeout))
    } else {
        Err(Failure::invalid(format!(
            "timeout must be a positive number of seconds, not {timeout}"
        )))
    }
}

/// Runs `fut` on the runtime with the GIL released, for at most `timeout`; workers linger
/// (`tensorwire_core::linger`, see `linger`) from its start and after its end.
pub(crate) fn wait<T, F>(py: Python<'_>, timeout: Duration, what: &str, fut: F) -> PyResult<T>
where
    T: Send,
    F: Future<Output = Res<T>> + Send,
{
    let r = py.detach(|| {
        let rt = runtime()?;
        tensorwire_core::linger::arm_on(rt.handle());
        let r = rt.block_on(async {
            match tokio::time::timeout(timeout, fut).await {
                Ok(r) => r,
                Err(_) => Err(Failure::new(
                    "TimeoutError",
                    format!("{what}: no answer within {:.3} s", timeout.as_secs_f64()),
                )),
            }
        });
        tensorwire_core::linger::arm_on(rt.handle());
        r
    });
    r.map_err(|f| f.into_py(py))
}
