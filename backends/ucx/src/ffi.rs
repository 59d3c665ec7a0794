//! Safe owners of UCP objects (context <- worker <- endpoint, memory handles, remote keys) and the
//! three C callbacks. Every parameter struct starts zeroed (`Default`, which bindgen derives as
//! all-zero bytes) with its field mask naming exactly the fields set.
//!
//! Threading: all of these live on the backend's progress thread and are `!Send` (raw pointers);
//! the worker runs in `UCS_THREAD_MODE_SINGLE`. Callbacks run only inside UCP calls made on that
//! thread, so they hand their events over through thread-locals, never through pointers to Rust
//! objects: a request's `user_data` is a plain token number.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_void};
use std::os::fd::RawFd;
use std::rc::Rc;

use tensorwire_core::{Error, Result};
use tensorwire_ucx_sys as sys;

use crate::NAME;

/// Serialises creating and destroying UCX contexts and workers in this process: UCX's global
/// state (its async thread, interface queries) is not safe to set up and tear down from several
/// threads at once, and two backends in one process (tests, benches) do exactly that.
static LIFECYCLE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn lifecycle() -> std::sync::MutexGuard<'static, ()> {
    LIFECYCLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The active-message id of the backend's control messages.
pub(crate) const AM_ID: u32 = 0x7457;

/// UCX's text for a status.
pub(crate) fn status_text(s: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string for any value.
    let p = unsafe { sys::ucs_status_string(s) };
    if p.is_null() {
        return format!("status {s}");
    }
    // SAFETY: non-null, static and NUL-terminated (above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A UCX failure as a tensorwire error: peer and endpoint failures are `PeerClosed`, a timeout is
/// `Timeout`, everything else names the call.
pub(crate) fn status_error(what: &str, s: sys::ucs_status_t) -> Error {
    let text = status_text(s);
    match s {
        sys::UCS_ERR_ENDPOINT_TIMEOUT | sys::UCS_ERR_TIMED_OUT => {
            Error::timeout(format!("ucx: {what}: {text}"), std::time::Duration::ZERO)
        }
        sys::UCS_ERR_CONNECTION_RESET
        | sys::UCS_ERR_UNREACHABLE
        | sys::UCS_ERR_CANCELED
        | sys::UCS_ERR_REJECTED
        | sys::UCS_ERR_NOT_CONNECTED => Error::PeerClosed(format!("ucx: {what}: {text}")),
        s if (sys::UCS_ERR_LAST_ENDPOINT_FAILURE..=sys::UCS_ERR_FIRST_ENDPOINT_FAILURE)
            .contains(&s)
            || (sys::UCS_ERR_LAST_LINK_FAILURE..=sys::UCS_ERR_FIRST_LINK_FAILURE).contains(&s) =>
        {
            Error::PeerClosed(format!("ucx: {what}: {text}"))
        }
        _ => Error::Backend {
            backend: NAME,
            source: std::sync::Arc::new(UcxError(format!("{what}: {text}"))),
        },
    }
}

/// A UCX call's failure, with the call and UCX's text.
#[derive(Debug)]
pub(crate) struct UcxError(String);

impl std::fmt::Display for UcxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UcxError {}

fn check(what: &str, s: sys::ucs_status_t) -> Result<()> {
    if s == sys::UCS_OK { Ok(()) } else { Err(status_error(what, s)) }
}

/// What one callback reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// A request with this token completed with this status.
    Done(u64, sys::ucs_status_t),
    /// The endpoint with this token failed.
    EpFailed(u64, sys::ucs_status_t),
}

thread_local! {
    static EVENTS: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
    static INBOX: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

fn push_event(e: Event) {
    EVENTS.with(|q| match q.try_borrow_mut() {
        Ok(mut q) => q.push(e),
        Err(_) => tracing::error!(?e, "ucx: event queue busy; event lost"),
    });
}

/// Takes the events and messages the callbacks collected on this thread.
pub(crate) fn take_callbacks() -> (Vec<Event>, Vec<Vec<u8>>) {
    let ev = EVENTS.with(|q| q.try_borrow_mut().map(|mut q| std::mem::take(&mut *q)));
    let msgs = INBOX.with(|q| q.try_borrow_mut().map(|mut q| std::mem::take(&mut *q)));
    (ev.unwrap_or_default(), msgs.unwrap_or_default())
}

unsafe extern "C" fn request_done(req: *mut c_void, status: sys::ucs_status_t, user: *mut c_void) {
    push_event(Event::Done(user as u64, status));
    // SAFETY: `req` is the completed request UCX passes to its callback; it is released once, here
    // (a request released earlier would get no callback).
    unsafe { sys::ucp_request_free(req) };
}

unsafe extern "C" fn ep_failed(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    push_event(Event::EpFailed(arg as u64, status));
}

unsafe extern "C" fn am_received(
    _arg: *mut c_void,
    _header: *const c_void,
    _header_len: usize,
    data: *mut c_void,
    len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: UCX passes a valid parameter struct for the duration of the callback.
    let attr = unsafe { (*param).recv_attr };
    if attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 || (data.is_null() && len > 0) {
        // Every control message is sent eager; a rendezvous one is not ours to fetch.
        tracing::warn!(len, "ucx: dropped a rendezvous active message");
        return sys::UCS_OK;
    }
    let bytes = if len == 0 {
        Vec::new()
    } else {
        // SAFETY: with the DATA flag (eager), `data` holds `len` readable bytes during the callback.
        unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec()
    };
    INBOX.with(|q| match q.try_borrow_mut() {
        Ok(mut q) => q.push(bytes),
        Err(_) => tracing::error!("ucx: inbox busy; message lost"),
    });
    sys::UCS_OK
}

/// How a non-blocking call started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Started {
    /// Finished at once (no callback will come).
    Done,
    /// In flight: its token's `Event::Done` will come.
    Pending,
}

/// Interprets a `ucs_status_ptr_t`: a request completes through its callback (which releases
/// it), an immediate status is returned.
fn started(what: &str, p: sys::ucs_status_ptr_t) -> Result<Started> {
    if sys::ucs_ptr_is_ptr(p) {
        return Ok(Started::Pending);
    }
    check(what, sys::ucs_ptr_status(p))?;
    Ok(Started::Done)
}

fn request_param(token: u64) -> sys::ucp_request_param_t {
    let mut p = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
        user_data: token as *mut c_void,
        ..Default::default()
    };
    p.cb.send = Some(request_done);
    p
}

/// A UCP context (`ucp_init`), with the RMA, AM and WAKEUP features.
#[derive(Debug)]
pub(crate) struct Context {
    h: sys::ucp_context_h,
}

impl Context {
    /// Reads UCX's configuration (its `UCX_*` environment variables), applies `options` (names
    /// without the `UCX_` prefix) on top, and initialises.
    pub(crate) fn new(options: &[(String, String)]) -> Result<Rc<Context>> {
        let _serial = lifecycle();
        let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
        // SAFETY: null prefix and file are allowed; `config` receives a new object.
        check("ucp_config_read", unsafe {
            sys::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config)
        })?;
        let mut result = Ok(());
        for (k, v) in options {
            let (Ok(k), Ok(v)) = (CString::new(k.as_str()), CString::new(v.as_str())) else {
                result = Err(Error::InvalidArgument(format!("ucx option {k}={v}: NUL byte")));
                break;
            };
            // SAFETY: `config` is live; both strings are NUL-terminated.
            let s = unsafe { sys::ucp_config_modify(config, k.as_ptr(), v.as_ptr()) };
            if s != sys::UCS_OK {
                result = Err(Error::InvalidArgument(format!(
                    "ucx option {}={}: {}",
                    k.to_string_lossy(),
                    v.to_string_lossy(),
                    status_text(s)
                )));
                break;
            }
        }
        let mut h: sys::ucp_context_h = std::ptr::null_mut();
        if result.is_ok() {
            let params = sys::ucp_params_t {
                field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES),
                features: u64::from(
                    sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP,
                ),
                ..Default::default()
            };
            // SAFETY: valid params and config; `h` receives the context.
            result = check("ucp_init", unsafe { sys::ucp_init(&params, config, &mut h) });
        }
        // SAFETY: `config` came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(config) };
        result.map(|()| Rc::new(Context { h }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let _serial = lifecycle();
        // SAFETY: every worker and memory handle holds an Rc to this context, so none is left.
        unsafe { sys::ucp_cleanup(self.h) };
    }
}

/// One put or get: direction, local address, length, remote address.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rma {
    pub(crate) write: bool,
    pub(crate) local: usize,
    pub(crate) len: usize,
    pub(crate) remote: u64,
}

/// A UCP worker in single-thread mode, with the control-message handler installed.
#[derive(Debug)]
pub(crate) struct Worker {
    h: sys::ucp_worker_h,
    ctx: Rc<Context>,
}

impl Worker {
    pub(crate) fn new(ctx: &Rc<Context>) -> Result<Rc<Worker>> {
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut h: sys::ucp_worker_h = std::ptr::null_mut();
        let serial = lifecycle();
        // SAFETY: live context, valid params; `h` receives the worker.
        check("ucp_worker_create", unsafe { sys::ucp_worker_create(ctx.h, &params, &mut h) })?;
        drop(serial);
        let w = Rc::new(Worker { h, ctx: ctx.clone() });
        let am = sys::ucp_am_handler_param_t {
            field_mask: u64::from(
                sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_CB,
            ),
            id: AM_ID,
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(am_received),
            ..Default::default()
        };
        // SAFETY: live worker; the callback is a plain function with no captured state.
        check("ucp_worker_set_am_recv_handler", unsafe {
            sys::ucp_worker_set_am_recv_handler(w.h, &am)
        })?;
        Ok(w)
    }

    /// The worker's address, as peers need it to create endpoints.
    pub(crate) fn address(&self) -> Result<Vec<u8>> {
        let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live worker; out-pointers are valid.
        check("ucp_worker_get_address", unsafe {
            sys::ucp_worker_get_address(self.h, &mut addr, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at `addr`.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: `addr` came from ucp_worker_get_address on this worker and is released once.
        unsafe { sys::ucp_worker_release_address(self.h, addr) };
        Ok(bytes)
    }

    /// The file descriptor that becomes readable when the worker has events (after `arm`).
    pub(crate) fn event_fd(&self) -> Result<RawFd> {
        let mut fd: std::os::raw::c_int = -1;
        // SAFETY: live worker created from a context with UCP_FEATURE_WAKEUP.
        check("ucp_worker_get_efd", unsafe { sys::ucp_worker_get_efd(self.h, &mut fd) })?;
        Ok(fd)
    }

    /// Arms the event fd; false when events are already pending (progress again instead).
    pub(crate) fn arm(&self) -> Result<bool> {
        // SAFETY: live worker with wakeup enabled.
        match unsafe { sys::ucp_worker_arm(self.h) } {
            sys::UCS_OK => Ok(true),
            sys::UCS_ERR_BUSY => Ok(false),
            s => Err(status_error("ucp_worker_arm", s)),
        }
    }

    /// Runs UCX's progress once; the number of events it handled.
    pub(crate) fn progress(&self) -> u32 {
        // SAFETY: live worker, called on its only thread.
        unsafe { sys::ucp_worker_progress(self.h) }
    }

    /// Creates an endpoint to a peer worker's address; failures of it are reported as
    /// `Event::EpFailed(token)`. `peer_errors` asks UCX to detect peer failure (keepalive).
    pub(crate) fn connect(
        self: &Rc<Self>,
        address: &[u8],
        token: u64,
        peer_errors: bool,
    ) -> Result<Endpoint> {
        let mut params = sys::ucp_ep_params_t {
            field_mask: u64::from(
                sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            ),
            address: address.as_ptr() as *const sys::ucp_address_t,
            err_handler: sys::ucp_err_handler_t { cb: Some(ep_failed), arg: token as *mut c_void },
            ..Default::default()
        };
        if peer_errors {
            params.field_mask |= u64::from(sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE);
            params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
        }
        let mut h: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: live worker; `address` is a worker address blob from the peer that UCX parses
        // (and validates) during the call only.
        check("ucp_ep_create", unsafe { sys::ucp_ep_create(self.h, &params, &mut h) })?;
        Ok(Endpoint { h: Some(h), worker: self.clone() })
    }

    /// Registers `[addr, addr+len)` for local and remote access.
    pub(crate) fn map(
        &self,
        addr: usize,
        len: usize,
        remote_read: bool,
        remote_write: bool,
    ) -> Result<MemHandle> {
        let mut prot = sys::UCP_MEM_MAP_PROT_LOCAL_READ | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE;
        if remote_read {
            prot |= sys::UCP_MEM_MAP_PROT_REMOTE_READ;
        }
        if remote_write {
            prot |= sys::UCP_MEM_MAP_PROT_REMOTE_WRITE;
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_PROT,
            ),
            address: addr as *mut c_void,
            length: len,
            prot,
            ..Default::default()
        };
        let mut h: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: live context; the engine keeps `[addr, addr+len)` mapped for as long as the
        // region is registered, and the handle is unmapped before (see MemHandle users).
        check("ucp_mem_map", unsafe { sys::ucp_mem_map(self.ctx.h, &params, &mut h) })?;
        Ok(MemHandle { h, ctx: self.ctx.clone() })
    }
}

impl Worker {
    /// Allocates `len` bytes through UCX (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`): with the
    /// shared-memory transports the memory lives in a segment peers map, so their put/get is one
    /// copy. Returns the handle and the memory's address.
    pub(crate) fn allocate(&self, len: usize) -> Result<(MemHandle, usize)> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            ),
            address: std::ptr::null_mut(),
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut h: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: live context, valid params (UCX chooses the address); `h` receives the handle.
        check("ucp_mem_map(ALLOCATE)", unsafe { sys::ucp_mem_map(self.ctx.h, &params, &mut h) })?;
        let memh = MemHandle { h, ctx: self.ctx.clone() };
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: u64::from(sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH),
            ..Default::default()
        };
        // SAFETY: live handle; `attr` is a valid out-struct with its field mask set.
        check("ucp_mem_query", unsafe { sys::ucp_mem_query(memh.h, &mut attr) })?;
        if attr.address.is_null() || attr.length < len {
            return Err(Error::protocol(format!("ucx allocated {} of {len} bytes", attr.length)));
        }
        Ok((memh, attr.address as usize))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _serial = lifecycle();
        // SAFETY: every endpoint holds an Rc to this worker, so none is left; single thread.
        unsafe { sys::ucp_worker_destroy(self.h) };
    }
}

/// An endpoint to one peer worker. Closed (forcibly, if still open) on drop.
#[derive(Debug)]
pub(crate) struct Endpoint {
    h: Option<sys::ucp_ep_h>,
    worker: Rc<Worker>,
}

impl Endpoint {
    fn h(&self) -> Result<sys::ucp_ep_h> {
        self.h.ok_or_else(|| Error::PeerClosed("ucx: endpoint closed".into()))
    }

    /// Sends one control message (eager). `buf` must stay untouched until `Pending` completes.
    pub(crate) fn send(&self, buf: &[u8], token: u64) -> Result<Started> {
        let mut p = request_param(token);
        p.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = sys::UCP_AM_SEND_FLAG_EAGER;
        // SAFETY: live endpoint; `buf` stays alive and unchanged until completion (the caller keeps
        // it in its pending table when `Pending`).
        let r = unsafe {
            sys::ucp_am_send_nbx(
                self.h()?,
                AM_ID,
                std::ptr::null(),
                0,
                buf.as_ptr().cast(),
                buf.len(),
                &p,
            )
        };
        started("ucp_am_send_nbx", r)
    }

    /// Starts a put (`write`) or get of `rma.len` bytes between local and remote memory.
    ///
    /// # Safety
    /// `[rma.local, rma.local+rma.len)` must stay valid (and, for a get, not otherwise written)
    /// until the request completes; `rkey` must be this endpoint's unpacked key for the remote
    /// range.
    pub(crate) unsafe fn rma(
        &self,
        rma: Rma,
        rkey: &RemoteKey,
        memh: Option<&MemHandle>,
        token: u64,
    ) -> Result<Started> {
        let Rma { write, local, len, remote } = rma;
        let mut p = request_param(token);
        if let Some(m) = memh {
            p.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
            p.memh = m.h;
        }
        let ep = self.h()?;
        let r = if write {
            // SAFETY: caller's contract.
            unsafe { sys::ucp_put_nbx(ep, local as *const c_void, len, remote, rkey.h, &p) }
        } else {
            // SAFETY: caller's contract.
            unsafe { sys::ucp_get_nbx(ep, local as *mut c_void, len, remote, rkey.h, &p) }
        };
        started(if write { "ucp_put_nbx" } else { "ucp_get_nbx" }, r)
    }

    /// Completes when every RMA issued on this endpoint has completed at the peer.
    pub(crate) fn flush(&self, token: u64) -> Result<Started> {
        let p = request_param(token);
        // SAFETY: live endpoint, valid params.
        started("ucp_ep_flush_nbx", unsafe { sys::ucp_ep_flush_nbx(self.h()?, &p) })
    }

    /// Unpacks a peer's packed remote key for use on this endpoint.
    pub(crate) fn unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        let mut h: sys::ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: live endpoint; UCX parses the packed buffer during the call only.
        check("ucp_ep_rkey_unpack", unsafe {
            sys::ucp_ep_rkey_unpack(self.h()?, packed.as_ptr().cast(), &mut h)
        })?;
        Ok(RemoteKey { h })
    }

    /// Closes the endpoint: `force` drops it at once (outstanding requests complete with
    /// `UCS_ERR_CANCELED`), else outstanding operations are flushed first. Progresses the worker
    /// until the close finishes, at most `bound`.
    pub(crate) fn close(&mut self, force: bool, bound: std::time::Duration) {
        let Some(h) = self.h.take() else { return };
        let mut p = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            ..Default::default()
        };
        if force {
            p.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: `h` is live and closed once (taken out of `self.h`).
        let r = unsafe { sys::ucp_ep_close_nbx(h, &p) };
        if !sys::ucs_ptr_is_ptr(r) {
            return;
        }
        let deadline = std::time::Instant::now() + bound;
        loop {
            self.worker.progress();
            // SAFETY: `r` is a request not yet freed.
            let s = unsafe { sys::ucp_request_check_status(r) };
            if s != sys::UCS_INPROGRESS {
                break;
            }
            if std::time::Instant::now() >= deadline {
                tracing::warn!("ucx: endpoint close did not finish within {bound:?}");
                break;
            }
            if crate::exit::closing() {
                break;
            }
            std::thread::yield_now();
        }
        // SAFETY: release the close request once (UCX frees it when it completes).
        unsafe { sys::ucp_request_free(r) };
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.close(true, std::time::Duration::from_secs(1));
    }
}

/// Registered memory (`ucp_mem_map`); unmapped on drop.
#[derive(Debug)]
pub(crate) struct MemHandle {
    h: sys::ucp_mem_h,
    ctx: Rc<Context>,
}

impl MemHandle {
    /// The packed remote key peers unpack to reach this memory.
    pub(crate) fn pack(&self) -> Result<Vec<u8>> {
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live context and handle; out-pointers are valid.
        check("ucp_rkey_pack", unsafe {
            sys::ucp_rkey_pack(self.ctx.h, self.h, &mut buf, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at `buf`.
        let out = unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec();
        // SAFETY: `buf` came from ucp_rkey_pack and is released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(out)
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: live context and handle; every operation using it has completed (ops hold an Rc).
        let s = unsafe { sys::ucp_mem_unmap(self.ctx.h, self.h) };
        if s != sys::UCS_OK {
            tracing::warn!(status = %status_text(s), "ucx: ucp_mem_unmap failed");
        }
    }
}

/// A peer's remote key unpacked on one endpoint; destroyed on drop.
#[derive(Debug)]
pub(crate) struct RemoteKey {
    h: sys::ucp_rkey_h,
}

impl RemoteKey {
    /// Where the peer's `[raddr, raddr+len)` is mapped in this process, when UCX reaches it
    /// through shared memory (`ucp_rkey_ptr`: memory the peer allocated through UCX, a
    /// shared-memory transport between the two) and maps it in one piece (its first and last
    /// byte `len - 1` apart); `None` otherwise. Valid while this key lives.
    pub(crate) fn mapped(&self, raddr: u64, len: u64) -> Option<usize> {
        let first = self.ptr(raddr)?;
        let last = self.ptr(raddr.checked_add(len.checked_sub(1)?)?)?;
        (last.checked_sub(first)? as u64 == len - 1).then_some(first)
    }

    fn ptr(&self, raddr: u64) -> Option<usize> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: live key; UCX only computes an address (or fails) into the out-pointer.
        let s = unsafe { sys::ucp_rkey_ptr(self.h, raddr, &mut p) };
        (s == sys::UCS_OK && !p.is_null()).then_some(p as usize)
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: `h` came from ucp_ep_rkey_unpack and is destroyed once; no request uses it
        // (ops hold an Rc to it until they complete).
        unsafe { sys::ucp_rkey_destroy(self.h) };
    }
}

/// UCX's version string.
pub(crate) fn version() -> String {
    // SAFETY: returns a static NUL-terminated string.
    let p = unsafe { sys::ucp_get_version_string() };
    if p.is_null() {
        return "unknown".into();
    }
    // SAFETY: non-null static string (above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
