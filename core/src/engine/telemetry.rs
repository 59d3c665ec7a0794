//! What the engine records through the `metrics` facade (a no-op until the process installs a
//! recorder, e.g. `tensorwire_observe::install`). The families are listed, with their meaning,
//! in `tensorwire_observe::FAMILIES`.

use std::time::Duration;

use crate::error::Result;

/// An op in flight: counted from its submission until it ends or is dropped (cancelled).
pub(crate) struct InFlight(());

impl InFlight {
    pub(crate) fn start() -> InFlight {
        metrics::gauge!("tensorwire_transfers_in_flight").increment(1.0);
        InFlight(())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        metrics::gauge!("tensorwire_transfers_in_flight").decrement(1.0);
    }
}

/// An op ended: its bytes, count and time, or its error's kind (`dir`: "read" or "write").
pub(crate) fn op_ended(
    backend: &'static str,
    dir: &'static str,
    bytes: u64,
    took: Duration,
    res: &Result<()>,
) {
    match res {
        Ok(()) => {
            let labels = [("backend", backend), ("direction", dir)];
            metrics::counter!("tensorwire_transfer_ops_total", &labels).increment(1);
            metrics::counter!("tensorwire_transfer_bytes_total", &labels).increment(bytes);
            metrics::histogram!("tensorwire_transfer_seconds", &labels).record(took.as_secs_f64());
        }
        Err(e) => {
            metrics::counter!("tensorwire_transfer_errors_total", "backend" => backend, "kind" => e.kind())
                .increment(1);
        }
    }
}

/// A region was registered (`sign` 1) or deregistered (-1).
pub(crate) fn region(sign: f64, len: u64) {
    metrics::gauge!("tensorwire_registered_regions").increment(sign);
    metrics::gauge!("tensorwire_registered_bytes").increment(sign * len as f64);
}

/// A connection to a peer engine opened.
pub(crate) fn connected(backend: &'static str) {
    metrics::counter!("tensorwire_connections_total", "backend" => backend).increment(1);
}

/// An op went through a host staging buffer (`dir`: "read" or "write").
pub(crate) fn bounced(dir: &'static str) {
    metrics::counter!("tensorwire_staging_bounces_total", "direction" => dir).increment(1);
}
