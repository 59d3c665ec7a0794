"""A fake CUDA device, for testing code that hands tensorwire CUDA tensors on a machine without a
GPU.

Set ``TENSORWIRE_TESTING_FAKE_CUDA=1`` in the environment before the process makes its first
engine: every engine of the process then gets the fake GPU of tensorwire's Rust tests instead of
the CUDA driver, and the cuda backend runs over a fake CUDA IPC driver. A ``FakeCudaTensor``
carries DLPack device type CUDA (2) over fake device memory: host pages the CPU cannot touch
(mapped without access, opened only inside the fake GPU's own copies), so a path that read device
memory with the CPU instead of the GPU's copy would crash, not pass. Never set the switch when
serving: the fake moves bytes with the CPU.

.. code-block:: python

    # TENSORWIRE_TESTING_FAKE_CUDA=1 python ...
    from tensorwire.testing import fake_cuda_tensor, fake_cuda_empty
    src = fake_cuda_tensor(np.arange(1 << 20, dtype=np.float32))   # a "CUDA" tensor
    dst = fake_cuda_empty(src.shape, src.dtype)
    ...                                                          # publish src, consume into dst
    assert (dst.numpy() == np.arange(1 << 20, dtype=np.float32)).all()

``FakeCudaStream`` fakes a framework's stream: held back, it keeps the engine from reading a tensor
published on it (or writing a destination consumed on it) until it is released.

The fake is in-process: engines of one process share it, as processes of one host share a GPU
driver; a fake IPC handle does not open in another process.
"""

import math
from typing import Any, Dict, Optional, Sequence, Tuple

from . import _native

__all__ = ["FAKE_CUDA_SWITCH", "FakeCudaStream", "FakeCudaTensor", "fake_cuda_counts", "fake_cuda_empty",
           "fake_cuda_tensor", "gpu_driver"]

FAKE_CUDA_SWITCH = "TENSORWIRE_TESTING_FAKE_CUDA"

# DLPack's type codes by numpy's dtype kind.
_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


def gpu_driver() -> Tuple[Optional[str], Optional[str]]:
    """The process's GPU driver: ``("cuda", None)``, ``("fake", None)`` or ``(None, why)``."""
    return _native.gpu_driver()


def _np():
    import numpy
    return numpy


class FakeCudaTensor:
    """A tensor in fake CUDA device memory: ``shape``, ``dtype`` (numpy), ``device``, DLPack
    (device type CUDA), basic slicing (views, no copy) and ``numpy()`` (a host copy, through the
    fake GPU)."""

    def __init__(self, memory: "_native.FakeCudaMemory", shape: Sequence[int], dtype: Any, offset: int = 0,
                 strides: Optional[Sequence[int]] = None):
        self.memory = memory
        self.shape = tuple(int(s) for s in shape)
        self.dtype = _np().dtype(dtype)
        if self.dtype.kind not in _CODES:
            raise TypeError(f"a fake CUDA tensor of dtype {self.dtype} (no DLPack type code)")
        self.offset = int(offset)
        if strides is None:
            strides, step = [], 1
            for s in reversed(self.shape):
                strides.insert(0, step)
                step *= max(s, 1)
        self.strides = tuple(int(s) for s in strides)

    @property
    def device(self) -> int:
        return self.memory.device

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"FakeCudaTensor(shape={self.shape}, dtype={self.dtype}, device=cuda:{self.device})"

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (2, self.memory.device)

    def __dlpack__(self, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None):
        code = _CODES[self.dtype.kind]
        return self.memory.dlpack(self.offset, (code, self.dtype.itemsize * 8, 1), list(self.shape),
                                  list(self.strides))

    def __getitem__(self, index: Any) -> "FakeCudaTensor":
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > len(self.shape):
            raise IndexError(f"{len(index)} indices for {len(self.shape)} dimensions")
        offset, shape = self.offset, list(self.shape)
        for d, ix in enumerate(index):
            if not isinstance(ix, slice) or ix.step not in (None, 1):
                raise TypeError("a fake CUDA tensor takes basic slices with step 1 only")
            start, stop, _ = ix.indices(shape[d])
            stop = max(stop, start)
            offset += start * self.strides[d] * self.dtype.itemsize
            shape[d] = stop - start
        return FakeCudaTensor(self.memory, shape, self.dtype, offset, self.strides)

    def numpy(self):
        """A host copy, through the fake GPU's copy."""
        np = _np()
        if self.nbytes == 0:
            return np.zeros(self.shape, self.dtype)
        span = (sum((s - 1) * st for s, st in zip(self.shape, self.strides)) + 1) * self.dtype.itemsize
        raw = np.frombuffer(self.memory.read(self.offset, span), dtype=self.dtype)
        byte_strides = [st * self.dtype.itemsize for st in self.strides]
        return np.lib.stride_tricks.as_strided(raw, self.shape, byte_strides).copy()


def fake_cuda_empty(shape: Sequence[int], dtype: Any, device: int = 0) -> FakeCudaTensor:
    """A zeroed fake CUDA tensor of ``shape`` and ``dtype``, one allocation of its own."""
    n = math.prod(int(s) for s in shape) * _np().dtype(dtype).itemsize
    return FakeCudaTensor(_native.FakeCudaMemory(n, device), shape, dtype)


def fake_cuda_tensor(array: Any, device: int = 0) -> FakeCudaTensor:
    """A fake CUDA tensor holding a copy of the host array ``array`` (copied by the fake GPU)."""
    a = _np().array(array, order="C")  # a copy, keeping a 0-d array 0-d (ascontiguousarray does not)
    t = fake_cuda_empty(a.shape, a.dtype, device)
    if a.nbytes:
        t.memory.write(0, a.reshape(-1))
    return t


class FakeCudaStream:
    """A stream of the fake device, for ``stream=`` (like a torch stream, it has ``cuda_stream``).
    ``hold()`` holds it back, as if a kernel queued on it had not run yet: an event recorded on it
    meanwhile (by ``publish``, ``mark_ready`` or ``consume`` given this stream) completes only at
    ``release()``."""

    def __init__(self):
        self.cuda_stream = _native.fake_cuda_stream()

    def hold(self) -> None:
        _native.fake_cuda_hold(self.cuda_stream, True)

    def release(self) -> None:
        _native.fake_cuda_hold(self.cuda_stream, False)


def fake_cuda_counts() -> Dict[str, int]:
    """What the fake GPU did so far: ``copies`` (through it), ``pins``, ``live_allocations``,
    ``ipc_exported``, ``ipc_opened``, ``ipc_closed``."""
    return _native.fake_cuda_counts()
