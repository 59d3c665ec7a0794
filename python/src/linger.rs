//! `tensorwire.set_linger`: how long runtime workers stay awake after activity
//! (`tensorwire_core::linger`, one setting for the whole process: the engine's transfers and the
//! binding's calls).
//!
//! The binding arms the linger when a call has to wait (its future not ready at its first poll) and
//! again when it returns (`runtime::wait`). A Python caller is a thread outside the runtime:
//! between two calls it runs Python code (tens of microseconds), long enough for the runtime's
//! workers to run out of work and park, and the next call then waits for a parked worker to be
//! woken (tens of microseconds where idle CPUs halt, several times per handoff); inside a call that
//! waits for a transfer a worker parks between its sockets' readiness events as well. A Rust caller
//! on a runtime task does not pay the first: its worker is running when the next call starts.
//! Measured on the 2-vCPU host (`python/bench/linger.py`, variants taking turns in one process;
//! docs/performance.md, "Ninth part" and "Tenth part"): a linger after each call made
//! publish+consume from Python 1.3-1.6x as fast at 1 MiB and 1.1x at 4 MiB; arming it at each
//! call's start as well and for 1 ms instead of 300 us gave 1.09-1.29x at 4 MiB, and 0.95-1.16x at
//! 1 MiB and 0.97-1.05x at 64 MiB (within the noise; five runs).

use std::time::Duration;

use tensorwire_core::linger;

/// Sets how long runtime workers stay awake after activity (seconds, 0 to 1; 0 turns it off)
/// and returns the span before.
#[pyo3::pyfunction]
pub(crate) fn set_linger(py: pyo3::Python<'_>, seconds: f64) -> pyo3::PyResult<f64> {
    match Duration::try_from_secs_f64(seconds) {
        Ok(d) if d <= linger::MAX => Ok(linger::set_span(d).as_secs_f64()),
        _ => {
            let e = crate::errors::Failure::invalid(format!(
                "linger must be from 0 to {} seconds, not {seconds}",
                linger::MAX.as_secs_f64()
            ));
            Err(e.into_py(py))
        }
    }
}
