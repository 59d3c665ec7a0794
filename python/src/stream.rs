//! The caller's CUDA stream (`stream=` of publish, mark_ready and consume): an event recorded on
//! it at the call marks the work the caller queued before, and the engine touches the tensor
//! only once that event has completed: a producer's bytes are read after the kernels that write
//! them, a consumer's destination is written after the kernels that still read it. Nothing
//! waits on the caller's thread: the event is polled by the runtime, under the call's timeout.
//!
//! A stream is a torch stream (its `cuda_stream` handle), a raw `cudaStream_t` as an int, or a
//! stream of the fake device (`tensorwire.testing.FakeCudaStream`, whose `cuda_stream` is its
//! id). A torch tensor's `__dlpack__(stream=...)` is called with the handle first, so torch
//! orders that stream after the tensor's own (the DLPack protocol).

use std::time::{Duration, Instant};

use pyo3::prelude::*;
use tensorwire_testkit::fake_gpu::FakeEvent;

use crate::errors::{Failure, Res};
use crate::gpu::Driver;

/// A point in a caller's stream.
pub(crate) enum Event {
    Cuda(tensorwire_cuda::CudaEvent),
    Fake(FakeEvent),
}

/// The stream handle of `obj`: an int, or an object with `cuda_stream` (torch, the fake).
pub(crate) fn handle(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let raw = if obj.hasattr("cuda_stream")? { obj.getattr("cuda_stream")? } else { obj.clone() };
    raw.extract::<u64>().map_err(|_| {
        let t = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        Failure::invalid(format!(
            "stream= takes a torch CUDA stream, a raw stream handle (int) or a fake device \
             stream, not {t}"
        ))
        .into_py(obj.py())
    })
}

/// Records an event on stream `handle` of device `ordinal`.
pub(crate) fn record(handle: u64, ordinal: u32) -> Res<Event> {
    let driver = crate::gpu::driver().map_err(|f| f.prefixed("stream="))?;
    Ok(match driver {
        Driver::Cuda(gpu) => Event::Cuda(gpu.record_event(ordinal, handle)?),
        Driver::Fake(gpu, _) => Event::Fake(gpu.record_event(handle)?),
    })
}

impl Event {
    fn done(&self) -> Res<bool> {
        match self {
            Event::Cuda(e) => Ok(e.done()?),
            Event::Fake(e) => Ok(e.done()),
        }
    }

    /// Returns once the event has completed, polling (first every 20 us, backing off to 1 ms);
    /// `TimeoutError` after `limit`.
    pub(crate) async fn reached(&self, limit: Duration, what: &str) -> Res<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        while !self.done()? {
            if start.elapsed() >= limit {
                return Err(Failure::new(
                    "TimeoutError",
                    format!(
                        "{what}: the stream's work queued before the call did not end within {limit:?}"
                    ),
                ));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        Ok(())
    }
}
