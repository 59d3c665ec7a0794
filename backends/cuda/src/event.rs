//! Points in a caller's CUDA stream ([`CudaEvent`]): a framework hands its stream (a torch
//! stream's handle), an event recorded on it now marks the work queued so far, and the engine
//! touches the tensor only once that event has completed. Polled, never waited for blocking, so
//! every wait on one stays under its caller's timeout.

use std::sync::Arc;

use cudarc::driver::sys;
use tensorwire_core::Result;

use crate::CudaGpu;
use crate::gpu::{Inner, check};

/// An event recorded on a caller's stream; destroyed when dropped.
#[derive(Debug)]
pub struct CudaEvent {
    inner: Arc<Inner>,
    ordinal: u32,
    event: sys::CUevent,
}

// SAFETY: a CUDA event handle is a process-wide handle, usable from any thread once its
// device's context is current there (every call here makes it so first).
unsafe impl Send for CudaEvent {}
// SAFETY: as above; `query` only reads the event's state.
unsafe impl Sync for CudaEvent {}

impl CudaGpu {
    /// Records an event on `stream` (a `CUstream`/`cudaStream_t` handle of device `ordinal`'s
    /// primary context, as torch's `Stream.cuda_stream` gives it; 0 is the legacy default
    /// stream): it completes once every piece of work queued on the stream before this call has.
    pub fn record_event(&self, ordinal: u32, stream: u64) -> Result<CudaEvent> {
        self.inner.enter(ordinal)?;
        let mut event = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: writes one event handle; the context is current.
        check(unsafe { sys::cuEventCreate(&mut event, flags) }, "cuEventCreate")?;
        let e = CudaEvent { inner: self.inner.clone(), ordinal, event };
        // SAFETY: a live event and the caller's stream handle of this context (the driver
        // returns an error for a handle it does not know).
        check(unsafe { sys::cuEventRecord(e.event, stream as sys::CUstream) }, "cuEventRecord")?;
        Ok(e)
    }
}

impl CudaEvent {
    /// Whether the work the event marks has completed (`cuEventQuery`).
    pub fn done(&self) -> Result<bool> {
        self.inner.enter(self.ordinal)?;
        // SAFETY: a live event of this context.
        let r = unsafe { sys::cuEventQuery(self.event) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(r, "cuEventQuery").map(|()| true)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if self.inner.enter(self.ordinal).is_ok() {
            // SAFETY: destroying the event made in `record_event`, once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
        }
    }
}
