//! Tensors in through DLPack, without a copy: anything with `__dlpack__` (numpy, torch, cupy,
//! jax) is read as a data pointer and a `TensorMeta`, and registered with the engine together
//! with the object and its capsule, which keep the memory alive until the engine lets go of the
//! region (the last transfer that used it included).
//!
//! Device types: CPU and CUDA-host (pinned) memory, and CUDA device memory, which the engine
//! checks with the process's GPU driver (`crate::gpu`) before registering it; any other device
//! (ROCm, Metal, Vulkan, ...) is refused with its name. A CUDA tensor handed with the caller's
//! stream goes through DLPack's `__dlpack__(stream=...)`; a torch CUDA tensor handed without one
//! has its device's current stream synchronized first (the engine's copies run on their own
//! streams).

use std::ffi::c_void;

use pyo3::prelude::*;
use tensorwire_core::{
    DlDataType, DlTensorFields, Engine, MemoryKind, Permissions, Region, TensorMeta,
};

use crate::errors::{Failure, Res};

#[repr(C)]
pub(crate) struct DlDevice {
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
}

#[repr(C)]
pub(crate) struct DlType {
    pub(crate) code: u8,
    pub(crate) bits: u8,
    pub(crate) lanes: u16,
}

#[repr(C)]
pub(crate) struct DlTensor {
    pub(crate) data: *mut c_void,
    pub(crate) device: DlDevice,
    pub(crate) ndim: i32,
    pub(crate) dtype: DlType,
    pub(crate) shape: *mut i64,
    pub(crate) strides: *mut i64,
    pub(crate) byte_offset: u64,
}

/// The managed tensor's layout; an imported one has only `dl_tensor` read (the capsule owns the
/// rest); the fake CUDA device makes its own (`crate::fake_cuda`).
#[repr(C)]
pub(crate) struct DlManagedTensor {
    pub(crate) dl_tensor: DlTensor,
    pub(crate) manager_ctx: *mut c_void,
    pub(crate) deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// A framework tensor seen through DLPack: where its bytes are and what they hold. `meta` has
/// byte offset 0: `addr` already points at the tensor's first byte.
pub(crate) struct Tensor {
    /// The object and its capsule: holding them keeps the memory valid.
    owner: (Py<PyAny>, Py<PyAny>),
    addr: usize,
    pub(crate) meta: TensorMeta,
    /// For a CUDA tensor handed without a stream by a framework other than torch: an event on
    /// the legacy default stream, which DLPack's `__dlpack__()` ordered after the tensor's
    /// work; registering waits for it.
    pending: Option<crate::stream::Event>,
}

impl Tensor {
    /// Reads `obj.__dlpack__()`.
    pub(crate) fn import(obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
        Tensor::import_on(obj, None)
    }

    /// Reads `obj.__dlpack__()`, for use on the caller's stream `stream` (a raw handle; see
    /// `crate::stream`): a CUDA tensor's `__dlpack__(stream=...)` is called with it, so the
    /// framework orders that stream after the tensor's own work. Without a stream, a torch CUDA
    /// tensor's device's current stream is synchronized instead.
    pub(crate) fn import_on(obj: &Bound<'_, PyAny>, stream: Option<u64>) -> PyResult<Tensor> {
        let py = obj.py();
        if !obj.hasattr("__dlpack__")? {
            let t = obj.get_type().name()?;
            return Err(Failure::invalid(format!(
                "expected a tensor with __dlpack__ (numpy, torch, cupy, jax), got {t}"
            ))
            .into_py(py));
        }
        let cuda = on_cuda(obj)?;
        let mut torch = false;
        let capsule = match (cuda, stream) {
            (true, Some(h)) => {
                // DLPack: 0 is not a stream; 1 names the legacy default stream (handle 0).
                let kw = pyo3::types::PyDict::new(py);
                kw.set_item("stream", if h == 0 { 1 } else { h })?;
                obj.call_method("__dlpack__", (), Some(&kw))?
            }
            (true, None) => {
                torch = synchronize_torch(obj)?;
                obj.call_method0("__dlpack__")?
            }
            (false, _) => obj.call_method0("__dlpack__")?,
        };
        // SAFETY: `capsule` is a live Python object; PyCapsule_GetPointer checks that it is a
        // capsule named "dltensor" (a legacy DLPack capsule not yet consumed) and returns null
        // with a Python error set otherwise.
        let raw = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr()) }
            as *const DlManagedTensor;
        if raw.is_null() {
            return Err(PyErr::take(py).unwrap_or_else(|| {
                Failure::invalid("__dlpack__ did not return a DLPack capsule").into_py(py)
            }));
        }
        // SAFETY: a "dltensor" capsule points at a DLManagedTensor that stays valid until its
        // deleter runs, which happens when the capsule is destroyed; `capsule` is alive here.
        let t = unsafe { &(*raw).dl_tensor };
        let (fields, data) = fields_of(t).map_err(|f| f.into_py(py))?;
        let meta = TensorMeta::from_dlpack(&fields).map_err(|e| Failure::from(e).into_py(py))?;
        let addr = (data as usize).checked_add(meta.byte_offset as usize).ok_or_else(|| {
            Failure::new("InvalidTensorError", "data pointer + byte_offset overflows").into_py(py)
        })?;
        let meta = TensorMeta { byte_offset: 0, ..meta };
        meta.check().map_err(|e| Failure::from(e).into_py(py))?;
        // DLPack: `__dlpack__()` without a stream orders the legacy default stream (handle 0)
        // after the tensor's work; an event there marks it. Without a driver there is none (the
        // registration says why).
        let pending = match (cuda, stream, torch, meta.device) {
            (true, None, false, MemoryKind::Device { ordinal }) if crate::gpu::present() => {
                Some(crate::stream::record(0, ordinal).map_err(|f| f.into_py(py))?)
            }
            _ => None,
        };
        Ok(Tensor { owner: (obj.clone().unbind(), capsule.unbind()), addr, meta, pending })
    }

    /// The address of the tensor's first byte.
    pub(crate) fn addr(&self) -> usize {
        self.addr
    }

    /// Bytes from the first element to one past the last.
    pub(crate) fn span(&self) -> u64 {
        self.meta.end_bytes().unwrap_or(0)
    }

    /// Registers the tensor's bytes with `engine`; the region keeps the tensor alive. Device
    /// memory is checked by the process's GPU driver first (an error without one).
    pub(crate) async fn register(mut self, engine: &Engine, perms: Permissions) -> Res<Region> {
        if let Some(e) = self.pending.take() {
            // The call's own timeout bounds the wait.
            e.reached(std::time::Duration::from_secs(3600), "a CUDA tensor's stream").await?;
        }
        let (len, kind) = (self.span(), self.meta.device);
        if let MemoryKind::Device { ordinal } = kind {
            crate::gpu::driver()
                .map_err(|f| f.prefixed(&format!("a CUDA tensor on device {ordinal}")))?;
            // SAFETY: `addr..addr+len` is the tensor's device memory as its DLPack capsule
            // describes it; the framework keeps it allocated while the tensor object and its
            // capsule live, and the engine holds both (`owner`) until it has let go of the region
            // and of every transfer that used it. The GPU driver checks it is device memory.
            let r = unsafe {
                engine.register_device_owned(self.addr as u64, len, ordinal, perms, self.owner)
            };
            return Ok(r.await?);
        }
        // SAFETY: `addr..addr+len` is the tensor's memory as its DLPack capsule describes it
        // (span checked against u64 by `TensorMeta::check`); the framework keeps it valid while
        // the tensor object and its capsule live, and the engine holds both (`owner`) until it
        // has let go of the region and of every transfer that used it.
        let r =
            unsafe { engine.register_owned(self.owner, self.addr as *mut u8, len, kind, perms) };
        Ok(r.await?)
    }
}

/// DLPack device types (`DLDeviceType`) by number, for errors.
fn device_type_name(t: i32) -> &'static str {
    match t {
        1 => "CPU",
        2 => "CUDA",
        3 => "CUDA-host",
        4 => "OpenCL",
        7 => "Vulkan",
        8 => "Metal",
        9 => "VPI",
        10 => "ROCm",
        11 => "ROCm-host",
        12 => "ext_dev",
        13 => "CUDA-managed",
        14 => "oneAPI",
        15 => "WebGPU",
        16 => "Hexagon",
        17 => "MAIA",
        _ => "unknown",
    }
}

/// Whether `obj` is a CUDA tensor by `__dlpack_device__`, when it has one; a tensor on a device
/// tensorwire cannot move is refused here, before `__dlpack__` (which may synchronize or fail on
/// such a device).
fn on_cuda(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    if !obj.hasattr("__dlpack_device__")? {
        return Ok(false);
    }
    let (t, id): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
    match t {
        1 | 3 => Ok(false),
        2 => Ok(true),
        _ => Err(foreign(t, id).into_py(obj.py())),
    }
}

/// For a torch CUDA tensor handed without a stream: waits for the work queued on its device's
/// current stream, so the engine's copies (on their own streams) see its bytes. Whether `obj`
/// was one.
fn synchronize_torch(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    if !(obj.hasattr("is_cuda")? && obj.getattr("is_cuda")?.is_truthy()?) {
        return Ok(false);
    }
    let torch = obj.py().import("torch")?;
    let cuda = torch.getattr("cuda")?;
    cuda.call_method1("current_stream", (obj.getattr("device")?,))?.call_method0("synchronize")?;
    Ok(true)
}

/// The error of a tensor on device type `t`.
fn foreign(t: i32, id: i32) -> Failure {
    Failure::new(
        "UnsupportedError",
        format!(
            "a {} tensor (DLPack device type {t}, id {id}): tensorwire moves host memory (CPU, \
             CUDA-host) and CUDA device memory only",
            device_type_name(t)
        ),
    )
}

/// The DLPack fields of `t` and its data pointer; every pointer read is bounds-checked by ndim.
fn fields_of(t: &DlTensor) -> Res<(DlTensorFields, *mut c_void)> {
    let n = usize::try_from(t.ndim).ok().filter(|&n| n <= 16).ok_or_else(|| {
        Failure::new("InvalidTensorError", format!("ndim {} is not 0..=16", t.ndim))
    })?;
    let read = |p: *mut i64| -> Vec<i64> {
        if p.is_null() || n == 0 {
            return Vec::new();
        }
        // SAFETY: DLPack guarantees `shape` (and `strides`, when not null) point at `ndim`
        // int64 values owned by the managed tensor, which outlives this call.
        unsafe { std::slice::from_raw_parts(p, n) }.to_vec()
    };
    if n > 0 && t.shape.is_null() {
        return Err(Failure::new("InvalidTensorError", "DLPack tensor without a shape"));
    }
    if !matches!(t.device.device_type, 1..=3) {
        return Err(foreign(t.device.device_type, t.device.device_id));
    }
    let strides = (!t.strides.is_null()).then(|| read(t.strides));
    let fields = DlTensorFields {
        dtype: DlDataType { code: t.dtype.code, bits: t.dtype.bits, lanes: t.dtype.lanes },
        device_type: t.device.device_type,
        device_id: t.device.device_id,
        shape: read(t.shape),
        strides,
        byte_offset: t.byte_offset,
    };
    Ok((fields, t.data))
}

/// What peers may do with a region: read, write, both or neither.
pub(crate) fn perms(read: bool, write: bool) -> Permissions {
    Permissions { read, write }
}
