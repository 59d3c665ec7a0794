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
        Ok(()) => OpKeys::with(backend, dir, |k| {
            metrics::with_recorder(|r| {
                r.register_counter(&k.ops, &META).increment(1);
                r.register_counter(&k.bytes, &META).increment(bytes);
                r.register_histogram(&k.seconds, &META).record(took.as_secs_f64());
            })
        }),
        Err(e) => {
            metrics::counter!("tensorwire_transfer_errors_total", "backend" => backend, "kind" => e.kind())
                .increment(1);
        }
    }
}

/// What the `metrics` macros would attach to the families recorded through [`OpKeys`].
static META: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// The keys of an ended op's families for one backend and direction, built once per thread:
/// building them per op (a label vector allocated, hashed and freed three times) cost about
/// 0.2 us, a twentieth of a 64 KiB shm op.
struct OpKeys {
    of: (&'static str, &'static str),
    ops: metrics::Key,
    bytes: metrics::Key,
    seconds: metrics::Key,
}

thread_local! {
    static OP_KEYS: std::cell::RefCell<Vec<OpKeys>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl OpKeys {
    fn new(backend: &'static str, dir: &'static str) -> OpKeys {
        let op_key = |name: &'static str| {
            let labels = vec![
                metrics::Label::from_static_parts("backend", backend),
                metrics::Label::from_static_parts("direction", dir),
            ];
            metrics::Key::from_parts(name, labels)
        };
        OpKeys {
            of: (backend, dir),
            ops: op_key("tensorwire_transfer_ops_total"),
            bytes: op_key("tensorwire_transfer_bytes_total"),
            seconds: op_key("tensorwire_transfer_seconds"),
        }
    }

    /// Runs `f` on this thread's keys for `backend` and `dir` (made on first use).
    fn with<T>(backend: &'static str, dir: &'static str, f: impl FnOnce(&OpKeys) -> T) -> T {
        OP_KEYS.with(|cell| {
            let mut keys = cell.borrow_mut();
            let at = match keys.iter().position(|k| k.of == (backend, dir)) {
                Some(at) => at,
                None => {
                    keys.push(OpKeys::new(backend, dir));
                    keys.len() - 1
                }
            };
            f(&keys[at])
        })
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

/// An op went through a host staging buffer: this engine's own (`dir`: "read" or "write"), or a
/// peer's op on this engine's device memory ("serve").
pub(crate) fn bounced(dir: &'static str) {
    metrics::counter!("tensorwire_staging_bounces_total", "direction" => dir).increment(1);
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use metrics::{
        Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
        SharedString, Unit,
    };
    use std::sync::Mutex;

    use super::*;

    /// Every counter and histogram recorded, by name and labels.
    #[derive(Default)]
    struct Seen(Mutex<BTreeMap<String, Arc<Cell>>>);

    #[derive(Default)]
    struct Cell(AtomicU64);

    impl CounterFn for Cell {
        fn increment(&self, v: u64) {
            self.0.fetch_add(v, Ordering::Relaxed);
        }
        fn absolute(&self, v: u64) {
            self.0.store(v, Ordering::Relaxed);
        }
    }

    impl HistogramFn for Cell {
        fn record(&self, _: f64) {
            self.0.fetch_add(1, Ordering::Relaxed); // samples
        }
    }

    impl Seen {
        fn cell(&self, key: &Key) -> Arc<Cell> {
            let labels: Vec<String> =
                key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
            let name = format!("{}{{{}}}", key.name(), labels.join(","));
            self.0.lock().unwrap().entry(name).or_default().clone()
        }
        fn get(&self, name: &str) -> u64 {
            self.0.lock().unwrap().get(name).map_or(0, |c| c.0.load(Ordering::Relaxed))
        }
    }

    impl Recorder for Seen {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(self.cell(key))
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(self.cell(key))
        }
    }

    /// The keys built once per thread name the same families and labels the macros would, for
    /// each backend and direction apart.
    #[test]
    fn an_ended_op_is_recorded_under_its_backend_and_direction() {
        let seen = Seen::default();
        metrics::with_local_recorder(&seen, || {
            let took = Duration::from_micros(3);
            for _ in 0..3 {
                op_ended("shm", "write", 100, took, &Ok(()));
            }
            op_ended("shm", "read", 7, took, &Ok(()));
            op_ended("tcp", "write", 5, took, &Ok(()));
            op_ended("tcp", "write", 5, took, &Err(crate::Error::PeerClosed("gone".into())));
        });
        let ops = "tensorwire_transfer_ops_total";
        assert_eq!(seen.get(&format!("{ops}{{backend=shm,direction=write}}")), 3);
        assert_eq!(seen.get(&format!("{ops}{{backend=shm,direction=read}}")), 1);
        assert_eq!(seen.get(&format!("{ops}{{backend=tcp,direction=write}}")), 1);
        let bytes = "tensorwire_transfer_bytes_total";
        assert_eq!(seen.get(&format!("{bytes}{{backend=shm,direction=write}}")), 300);
        assert_eq!(seen.get(&format!("{bytes}{{backend=shm,direction=read}}")), 7);
        let secs = "tensorwire_transfer_seconds";
        assert_eq!(seen.get(&format!("{secs}{{backend=shm,direction=write}}")), 3);
        let errors = "tensorwire_transfer_errors_total{backend=tcp,kind=peer_closed}";
        assert_eq!(seen.get(errors), 1, "{:?}", seen.0.lock().unwrap().keys().collect::<Vec<_>>());
    }
}
