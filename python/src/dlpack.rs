//! Tensors in through DLPack, without a copy: anything with `__dlpack__` (numpy, torch, cupy,
//! jax) is read as a data pointer and a `TensorMeta`, and registered with the engine together
//! with the object and its capsule, which keep the memory alive until the engine lets go of the
//! region (the last transfer that used it included).

use std::ffi::c_void;

use pyo3::prelude::*;
use tensorwire_core::{DlDataType, DlTensorFields, Engine, Permissions, Region, TensorMeta};

use crate::errors::{Failure, Res};

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// The managed tensor's layout; only `dl_tensor` is read (the capsule owns the rest).
#[repr(C)]
#[allow(dead_code)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// A framework tensor seen through DLPack: where its bytes are and what they hold. `meta` has
/// byte offset 0: `addr` already points at the tensor's first byte.
pub(crate) struct Tensor {
    /// The object and its capsule: holding them keeps the memory valid.
    owner: (Py<PyAny>, Py<PyAny>),
    addr: usize,
    pub(crate) meta: TensorMeta,
}

impl Tensor {
    /// Reads `obj.__dlpack__()`.
    pub(crate) fn import(obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
        let py = obj.py();
        if !obj.hasattr("__dlpack__")? {
            let t = obj.get_type().name()?;
            return Err(Failure::invalid(format!(
                "expected a tensor with __dlpack__ (numpy, torch, cupy, jax), got {t}"
            ))
            .into_py(py));
        }
        let capsule = obj.call_method0("__dlpack__")?;
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
        Ok(Tensor { owner: (obj.clone().unbind(), capsule.unbind()), addr, meta })
    }

    /// Bytes from the first element to one past the last.
    pub(crate) fn span(&self) -> u64 {
        self.meta.end_bytes().unwrap_or(0)
    }

    /// Registers the tensor's bytes with `engine`; the region keeps the tensor alive.
    pub(crate) async fn register(self, engine: &Engine, perms: Permissions) -> Res<Region> {
        if !self.meta.device.is_host() {
            return Err(Failure::new(
                "UnsupportedError",
                format!(
                    "a {:?} tensor: only host memory moves without the GPU backend",
                    self.meta.device
                ),
            ));
        }
        let (len, kind) = (self.span(), self.meta.device);
        // SAFETY: `addr..addr+len` is the tensor's memory as its DLPack capsule describes it
        // (span checked against u64 by `TensorMeta::check`); the framework keeps it valid while
        // the tensor object and its capsule live, and the engine holds both (`owner`) until it
        // has let go of the region and of every transfer that used it.
        let r =
            unsafe { engine.register_owned(self.owner, self.addr as *mut u8, len, kind, perms) };
        Ok(r.await?)
    }
}

/// The DLPack fields of `t` and its data pointer; every pointer read is bounds-checked by ndim.
fn fields_of(t: &DlTensor) -> Res<(DlTensorFields, *mut c_void)> {
    let n = usize::try_from(t.ndim).ok().filter(|&n| n <= 16).ok_or_else(|| {
        Failure::new("InvalidTensorError", format!("ndim {} is not 0..=16", t.ndim))
    })?;
    let read = |p: *const i64| -> Vec<i64> {
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
