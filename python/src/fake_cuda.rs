//! The fake CUDA device's memory, for tests without a GPU (`tensorwire.testing`): allocations of
//! the process's fake GPU (`crate::gpu::fake`, behind the testing switch), which the CPU cannot
//! touch, handed out as DLPack capsules of device type CUDA. Bytes go in and out only through the
//! fake GPU's copies, as they would through `cudaMemcpy`: a binding path that read device memory
//! with the CPU would crash the test, not pass it.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tensorwire_core::gpu::Gpu;

use crate::dlpack::{DlDevice, DlManagedTensor, DlTensor, DlType, Tensor};
use crate::errors::{Failure, Raise};

/// DLPack's device type of CUDA device memory.
const DL_CUDA: i32 = 2;

/// One fake device allocation, freed when the last capsule or buffer using it is gone.
struct Allocation {
    base: u64,
    len: u64,
    ordinal: u32,
    _owner: Box<dyn Any + Send + Sync>,
}

/// Fake CUDA device memory: `len` bytes on fake device `device` (0 or 1).
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct FakeCudaMemory {
    alloc: Arc<Allocation>,
}

/// What a capsule's tensor owns: the allocation and its shape and strides.
struct Context {
    _alloc: Arc<Allocation>,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

/// The deleter of the managed tensors made here: frees the context and the tensor.
unsafe extern "C" fn delete(m: *mut DlManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its context were made by `Box::into_raw` in `dlpack`, and a DLPack
    // deleter runs once (by the capsule's destructor or the consumer that took it).
    unsafe {
        let m = Box::from_raw(m);
        drop(Box::from_raw(m.manager_ctx.cast::<Context>()));
    }
}

/// The capsule's destructor: a capsule never consumed still owns its tensor.
unsafe extern "C" fn destruct(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule; a consumed capsule is renamed
    // "used_dltensor", so a name check tells whether the tensor is still ours.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, c"dltensor".as_ptr()) == 1 {
            let m = pyo3::ffi::PyCapsule_GetPointer(capsule, c"dltensor".as_ptr());
            delete(m.cast());
        }
    }
}

#[pymethods]
impl FakeCudaMemory {
    /// Allocates `length` bytes of fake device memory on device `device`; refused unless the
    /// testing switch chose the fake GPU for this process.
    #[new]
    #[pyo3(signature = (length, device = 0))]
    fn new(py: Python<'_>, length: u64, device: u32) -> PyResult<FakeCudaMemory> {
        let (gpu, _) = crate::gpu::fake().raise(py)?;
        let (base, owner) =
            gpu.alloc_device(device, length).map_err(|e| Failure::from(e).into_py(py))?;
        Ok(FakeCudaMemory {
            alloc: Arc::new(Allocation { base, len: length, ordinal: device, _owner: owner }),
        })
    }

    /// Its length in bytes.
    #[getter]
    fn length(&self) -> u64 {
        self.alloc.len
    }

    /// Its device ordinal.
    #[getter]
    fn device(&self) -> u32 {
        self.alloc.ordinal
    }

    /// Its device address.
    #[getter]
    fn address(&self) -> u64 {
        self.alloc.base
    }

    /// Copies the bytes of host tensor `src` (contiguous) to `offset`, through the fake GPU.
    fn write(&self, py: Python<'_>, offset: u64, src: &Bound<'_, PyAny>) -> PyResult<()> {
        let t = Tensor::import(src)?;
        if !t.meta.device.is_host() || !t.meta.is_contiguous() {
            return Err(Failure::invalid("write takes a contiguous host tensor").into_py(py));
        }
        let n = t.span();
        let dst = self.range(offset, n).raise(py)?;
        let (gpu, _) = crate::gpu::fake().raise(py)?;
        // SAFETY: the source is `n` bytes of the live host tensor `t`; the destination is inside
        // this allocation (checked by `range`), kept by `self`.
        unsafe { gpu.copy_raw(t.addr(), dst as usize, n as usize) };
        Ok(())
    }

    /// `len` bytes from `offset`, copied to host memory through the fake GPU.
    fn read<'py>(&self, py: Python<'py>, offset: u64, len: u64) -> PyResult<Bound<'py, PyBytes>> {
        let src = self.range(offset, len).raise(py)?;
        let (gpu, _) = crate::gpu::fake().raise(py)?;
        PyBytes::new_with(py, len as usize, |buf| {
            // SAFETY: `buf` is `len` writable bytes; the source is inside this allocation.
            unsafe { gpu.copy_raw(src as usize, buf.as_mut_ptr() as usize, buf.len()) };
            Ok(())
        })
    }

    /// A DLPack capsule ("dltensor") of a tensor in this memory: dtype (code, bits, lanes),
    /// shape and strides in elements, its first element `offset` bytes in.
    fn dlpack<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        dtype: (u8, u8, u16),
        shape: Vec<i64>,
        strides: Vec<i64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if shape.len() != strides.len() || shape.len() > 16 {
            return Err(Failure::invalid("shape and strides: one each per dimension, at most 16")
                .into_py(py));
        }
        if offset > self.alloc.len {
            return Err(Failure::invalid("offset past the allocation").into_py(py));
        }
        let mut ctx = Box::new(Context { _alloc: self.alloc.clone(), shape, strides });
        let (code, bits, lanes) = dtype;
        let managed = Box::new(DlManagedTensor {
            dl_tensor: DlTensor {
                data: self.alloc.base as *mut c_void,
                device: DlDevice { device_type: DL_CUDA, device_id: self.alloc.ordinal as i32 },
                ndim: ctx.shape.len() as i32,
                dtype: DlType { code, bits, lanes },
                shape: ctx.shape.as_mut_ptr(),
                strides: ctx.strides.as_mut_ptr(),
                byte_offset: offset,
            },
            manager_ctx: Box::into_raw(ctx).cast(),
            deleter: Some(delete),
        });
        let raw = Box::into_raw(managed);
        // SAFETY: a new capsule owning `raw` under the DLPack name; `destruct` frees it unless
        // a consumer took it (renaming the capsule).
        let capsule =
            unsafe { pyo3::ffi::PyCapsule_New(raw.cast(), c"dltensor".as_ptr(), Some(destruct)) };
        if capsule.is_null() {
            // SAFETY: the capsule was not made, so `raw` is still ours alone.
            unsafe { delete(raw) };
            return Err(PyErr::fetch(py));
        }
        // SAFETY: `capsule` is a new reference.
        Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
    }
}

impl FakeCudaMemory {
    /// The device address of `[offset, offset + n)`, checked to lie inside the allocation.
    fn range(&self, offset: u64, n: u64) -> Result<u64, Failure> {
        match offset.checked_add(n) {
            Some(end) if end <= self.alloc.len => Ok(self.alloc.base + offset),
            _ => Err(Failure::invalid(format!(
                "{n} bytes at {offset} do not fit the {}-byte allocation",
                self.alloc.len
            ))),
        }
    }
}

/// What the fake GPU and its IPC driver did: copies, IPC exports and openings, pinned ranges.
#[pyfunction]
pub(crate) fn fake_cuda_counts(
    py: Python<'_>,
) -> PyResult<std::collections::BTreeMap<&'static str, u64>> {
    let (gpu, ipc) = crate::gpu::fake().raise(py)?;
    let c = gpu.counts();
    Ok([
        ("copies", c.copies as u64),
        ("pins", c.pins as u64),
        ("live_allocations", c.live as u64),
        ("ipc_exported", ipc.exported() as u64),
        ("ipc_opened", ipc.opened() as u64),
        ("ipc_closed", ipc.closed() as u64),
    ]
    .into_iter()
    .collect())
}

/// A new fake stream: its id (what `stream=` takes, as a torch stream's `cuda_stream`).
#[pyfunction]
pub(crate) fn fake_cuda_stream(py: Python<'_>) -> PyResult<u64> {
    Ok(crate::gpu::fake().raise(py)?.0.stream())
}

/// Holds fake stream `id` back (`hold=True`: as if a kernel queued on it had not run yet) or
/// releases it (`hold=False`: the events recorded while it was held complete).
#[pyfunction]
pub(crate) fn fake_cuda_hold(py: Python<'_>, id: u64, hold: bool) -> PyResult<()> {
    let (gpu, _) = crate::gpu::fake().raise(py)?;
    let r = if hold { gpu.hold_stream(id) } else { gpu.release_stream(id) };
    r.map_err(|e| Failure::from(e).into_py(py))
}
