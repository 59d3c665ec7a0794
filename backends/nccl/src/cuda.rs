//! [`CudaNccl`]: the communicator seam over cudarc's NCCL and the CUDA driver, both loaded at run
//! time. Each communicator has its own CUDA stream and two threads: one posts the ops in order
//! (`ncclSend` / `ncclRecv`, then an event recorded after each), one waits the events in order
//! and reports each op's end. Built and type-checked everywhere; it runs only where libcuda,
//! libnccl and two GPUs (one per rank) exist.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tensorwire_core::backend::kit::lock;

use cudarc::driver::sys as cu;
use cudarc::nccl::sys as nc;
use tensorwire_core::{Error, MemoryKinds, Result};

use crate::NAME;
use crate::comm::{Comm, Done, Nccl, UniqueId};

fn backend_err(what: String) -> Error {
    Error::Backend { backend: NAME, source: Arc::new(std::io::Error::other(what)) }
}

fn cu_check(r: cu::CUresult, call: &str) -> Result<()> {
    r.result().map_err(|e| backend_err(format!("{call}: {e:?}")))
}

fn nc_check(r: nc::ncclResult_t, call: &str) -> Result<()> {
    r.result().map(drop).map_err(|e| backend_err(format!("{call}: {e:?}")))
}

/// NCCL over CUDA (see the module docs).
#[derive(Debug)]
pub struct CudaNccl {
    _private: (),
}

impl CudaNccl {
    /// Checks that libcuda and libnccl can be loaded (before anything is called through them).
    pub fn new() -> Result<Arc<CudaNccl>> {
        // SAFETY: only try to open the libraries.
        let (cuda, nccl) = unsafe { (cu::is_culib_present(), nc::is_culib_present()) };
        if !cuda || !nccl {
            return Err(Error::Unsupported {
                backend: NAME,
                what: format!(
                    "NCCL needs libcuda and libnccl (here: libcuda {}, libnccl {})",
                    if cuda { "found" } else { "missing" },
                    if nccl { "found" } else { "missing" }
                ),
            });
        }
        // SAFETY: the driver library is present; cuInit has no other precondition.
        cu_check(unsafe { cu::cuInit(0) }, "cuInit")?;
        Ok(Arc::new(CudaNccl { _private: () }))
    }
}

/// The posting side of one communicator: ops waiting to be posted.
#[derive(Default)]
struct Posts {
    ops: VecDeque<(bool, u64, u64, Done)>,
    closed: bool,
}

/// Ops posted, waiting for their events, in order.
#[derive(Default)]
struct Events {
    ops: VecDeque<(usize, Done)>,
    closed: bool,
}

/// A communicator with its stream (raw handles, used only on its own threads).
struct Handles {
    comm: nc::ncclComm_t,
    stream: cu::CUstream,
    ctx: cu::CUcontext,
    dev: cu::CUdevice,
}

impl Drop for Handles {
    fn drop(&mut self) {
        // SAFETY: the last holder of the handles (both threads have ended): the communicator was
        // aborted (which frees it), the stream is destroyed and the context released once.
        unsafe {
            let _ = cu::cuCtxSetCurrent(self.ctx);
            let _ = cu::cuStreamDestroy_v2(self.stream);
            let _ = cu::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

// SAFETY: NCCL communicators, CUDA streams and contexts are process-wide handles; each is used
// by the communicator's threads, which make the context current first.
unsafe impl Send for Handles {}
// SAFETY: as above.
unsafe impl Sync for Handles {}

struct CudaComm {
    handles: Arc<Handles>,
    posts: Arc<(Mutex<Posts>, Condvar)>,
    events: Arc<(Mutex<Events>, Condvar)>,
}

impl std::fmt::Debug for CudaComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaComm").finish_non_exhaustive()
    }
}

impl Nccl for CudaNccl {
    fn name(&self) -> &'static str {
        NAME
    }

    fn memory(&self) -> MemoryKinds {
        MemoryKinds::DEVICE
    }

    fn unique_id(&self) -> Result<UniqueId> {
        let mut id = nc::ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes one unique id into a local.
        nc_check(unsafe { nc::ncclGetUniqueId(&mut id) }, "ncclGetUniqueId")?;
        Ok(id.internal.map(|c| c as u8))
    }

    fn join(
        &self,
        id: &UniqueId,
        rank: u32,
        ordinal: u32,
        _timeout: Duration,
    ) -> Result<Arc<dyn Comm>> {
        let mut dev = 0;
        // SAFETY: writes one device handle.
        cu_check(unsafe { cu::cuDeviceGet(&mut dev, ordinal as i32) }, "cuDeviceGet")?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: retains the device's primary context (released with the communicator).
        let r = unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) };
        cu_check(r, "cuDevicePrimaryCtxRetain")?;
        // SAFETY: a context retained above.
        cu_check(unsafe { cu::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
        let mut stream = std::ptr::null_mut();
        let flags = cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: creates a stream in the current context.
        cu_check(unsafe { cu::cuStreamCreate(&mut stream, flags) }, "cuStreamCreate")?;
        let uid = nc::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let mut comm = std::ptr::null_mut();
        // SAFETY: joins a two-rank communicator on the current device; blocks until the other
        // rank joins (NCCL's own bootstrap timeout bounds it).
        let r = unsafe { nc::ncclCommInitRank(&mut comm, 2, uid, rank as i32) };
        nc_check(r, "ncclCommInitRank")?;
        let handles = Arc::new(Handles { comm, stream, ctx, dev });
        let c = CudaComm { handles, posts: Arc::default(), events: Arc::default() };
        c.start()?;
        Ok(Arc::new(c))
    }
}

impl CudaComm {
    fn start(&self) -> Result<()> {
        let (h, posts, events) = (self.handles.clone(), self.posts.clone(), self.events.clone());
        std::thread::Builder::new()
            .name("tw-nccl-post".into())
            .spawn(move || post_loop(h, posts, events))
            .map_err(|e| Error::Internal(format!("nccl: cannot start a thread: {e}")))?;
        let (h, events) = (self.handles.clone(), self.events.clone());
        std::thread::Builder::new()
            .name("tw-nccl-done".into())
            .spawn(move || event_loop(h, events))
            .map_err(|e| Error::Internal(format!("nccl: cannot start a thread: {e}")))?;
        Ok(())
    }

    fn post(&self, send: bool, addr: u64, len: u64, done: Done) {
        let (m, cv) = &*self.posts;
        let mut p = lock(m);
        if p.closed {
            drop(p);
            done(Err(Error::PeerClosed("nccl: communicator aborted".into())));
            return;
        }
        p.ops.push_back((send, addr, len, done));
        cv.notify_one();
    }
}

/// Posts ops in order, each followed by an event the event loop waits for.
fn post_loop(
    h: Arc<Handles>,
    posts: Arc<(Mutex<Posts>, Condvar)>,
    events: Arc<(Mutex<Events>, Condvar)>,
) {
    // SAFETY: the communicator's context, retained for its life.
    if unsafe { cu::cuCtxSetCurrent(h.ctx) }.result().is_err() {
        return;
    }
    let (m, cv) = &*posts;
    loop {
        let (send, addr, len, done) = {
            let mut p = lock(m);
            loop {
                if let Some(op) = p.ops.pop_front() {
                    break op;
                }
                if p.closed {
                    return;
                }
                p = cv.wait(p).unwrap_or_else(|e| e.into_inner());
            }
        };
        let ty = nc::ncclDataType_t::ncclUint8;
        // SAFETY: the poster keeps `[addr, addr + len)` valid device memory until `done` (the
        // seam's contract); the communicator and stream are live.
        let r = unsafe {
            if send {
                nc::ncclSend(
                    addr as *const _,
                    len as usize,
                    ty,
                    1 - rank_of(&h),
                    h.comm,
                    h.stream as _,
                )
            } else {
                nc::ncclRecv(
                    addr as *mut _,
                    len as usize,
                    ty,
                    1 - rank_of(&h),
                    h.comm,
                    h.stream as _,
                )
            }
        };
        if let Err(e) = nc_check(r, if send { "ncclSend" } else { "ncclRecv" }) {
            done(Err(e));
            continue;
        }
        let mut ev = std::ptr::null_mut();
        let flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: creates an event and records it on the communicator's stream.
        let recorded = unsafe {
            cu::cuEventCreate(&mut ev, flags)
                .result()
                .and_then(|()| cu::cuEventRecord(ev, h.stream).result())
        };
        if let Err(e) = recorded {
            done(Err(backend_err(format!("cuEventRecord: {e:?}"))));
            continue;
        }
        let (em, ecv) = &*events;
        lock(em).ops.push_back((ev as usize, done));
        ecv.notify_one();
    }
}

/// This rank (0 or 1), from the communicator.
fn rank_of(h: &Handles) -> i32 {
    let mut rank = 0;
    // SAFETY: writes one int for a live communicator.
    let _ = unsafe { nc::ncclCommUserRank(h.comm, &mut rank) };
    rank
}

/// Waits each op's event, in order, and reports its end.
fn event_loop(h: Arc<Handles>, events: Arc<(Mutex<Events>, Condvar)>) {
    // SAFETY: the communicator's context.
    if unsafe { cu::cuCtxSetCurrent(h.ctx) }.result().is_err() {
        return;
    }
    let (m, cv) = &*events;
    loop {
        let (ev, done) = {
            let mut e = lock(m);
            loop {
                if let Some(x) = e.ops.pop_front() {
                    break x;
                }
                if e.closed {
                    return;
                }
                e = cv.wait(e).unwrap_or_else(|p| p.into_inner());
            }
        };
        let ev = ev as cu::CUevent;
        // SAFETY: an event recorded by the post loop; destroyed once waited.
        let r = unsafe { cu::cuEventSynchronize(ev) };
        // SAFETY: as above.
        let _ = unsafe { cu::cuEventDestroy_v2(ev) };
        done(cu_check(r, "cuEventSynchronize"));
    }
}

impl Comm for CudaComm {
    unsafe fn send(&self, addr: u64, len: u64, done: Done) {
        self.post(true, addr, len, done);
    }

    unsafe fn recv(&self, addr: u64, len: u64, done: Done) {
        self.post(false, addr, len, done);
    }

    fn abort(&self) {
        let pending: Vec<(bool, u64, u64, Done)> = {
            let (m, cv) = &*self.posts;
            let mut p = lock(m);
            p.closed = true;
            cv.notify_all();
            p.ops.drain(..).collect()
        };
        for (_, _, _, done) in pending {
            done(Err(Error::PeerClosed("nccl: communicator aborted".into())));
        }
        // SAFETY: aborting a live communicator ends its pending operations (their events then
        // complete, so the event loop reports them).
        let _ = unsafe { nc::ncclCommAbort(self.handles.comm) };
        let (m, cv) = &*self.events;
        lock(m).closed = true;
        cv.notify_all();
    }
}

impl Drop for CudaComm {
    fn drop(&mut self) {
        self.abort();
    }
}
