"""Nested Python data with tensors inside, cut into raw byte buffers (the tensors) and a skeleton
(everything else, with a :class:`Slot` where each tensor was), which travels as data
(:mod:`tensorwire.omni.skeleton`: JSON, never a pickle).

A torch tensor or a numpy array travels as its bytes (a flat ``uint8`` view, no copy when it is
already contiguous host memory) plus a :class:`Slot` naming its framework, dtype, shape and
device, so :func:`restore` gives back the same framework, dtype (every dtype the framework has:
bfloat16, the float8 kinds, bool, complex, ...), shape and device. A non-contiguous tensor is
made contiguous here (one copy, at put). A CUDA tensor stays on its device where the process has
the CUDA driver (tensorwire moves device memory: the consumer's buffer is allocated on the slot's
device, see :func:`buffer_for`); without one it is copied to host memory, and back to its device
at :func:`restore` where that device exists. Empty
tensors and numpy arrays of Python objects stay in the skeleton (as their dtype and shape, and
the objects as data); tensors that cannot be viewed as bytes (sparse, quantized, sub-byte kinds)
are refused.
"""

import sys
from typing import Any, Callable, List, Optional, Tuple

from . import skeleton as _skeleton
from .skeleton import SkeletonError

__all__ = ["Slot", "buffer_for", "load", "pack", "restore", "slots", "unpack"]


class Slot:
    """Where a tensor was: its index among the buffers and what it was."""

    __slots__ = ("index", "framework", "dtype", "shape", "device")

    def __init__(self, index: int, framework: str, dtype: Any, shape: Tuple[int, ...], device: str):
        self.index = index
        self.framework = framework
        self.dtype = dtype
        self.shape = shape
        self.device = device

    def fields(self) -> list:
        """The slot as skeleton data (its dtype by name or ``.npy`` description)."""
        dtype = (_skeleton.torch_dtype_name(self.dtype) if self.framework == "torch"
                 else _skeleton.numpy_descr(self.dtype))
        return [self.index, self.framework, dtype, list(self.shape), self.device]

    @staticmethod
    def from_fields(f: Any) -> "Slot":
        """The slot of skeleton data ``f``, checked (a dtype that may view raw bytes)."""
        if not isinstance(f, list) or len(f) != 5:
            raise SkeletonError("bad slot")
        index, framework, dtype, shape, device = f
        if type(index) is not int or not 0 <= index < (1 << 20) or not isinstance(device, str):
            raise SkeletonError("bad slot")
        if framework == "torch":
            dt = _skeleton.torch_dtype(dtype)
        elif framework == "numpy":
            dt = _skeleton.numpy_dtype(dtype, raw=True)
        else:
            raise SkeletonError(f"bad slot framework {framework!r}")
        return Slot(index, framework, dt, _skeleton.shape_of(shape), device)

    def __repr__(self) -> str:
        return f"Slot({self.index}, {self.framework}, {self.dtype}, {self.shape}, {self.device})"


def _torch() -> Optional[Any]:
    return sys.modules.get("torch")


def _as_bytes(x: Any) -> Optional[Tuple[Any, str, Any, Tuple[int, ...], str]]:
    """(flat uint8 host view, framework, dtype, shape, device) of a tensor, or None when ``x`` is
    not one that moves as raw bytes."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.numel() == 0 and x.layout == torch.strided and not x.is_quantized:
            return None  # empty: its dtype and shape go in the skeleton
        if x.layout != torch.strided or x.is_quantized:
            raise SkeletonError(f"a {x.layout} / quantized torch tensor cannot move as bytes: make it "
                                "dense first")
        t = x.detach()
        device = str(t.device)
        if t.device.type != "cpu" and not (t.device.type == "cuda" and _moves_device_memory()):
            t = t.to("cpu")
        t = t.resolve_conj().resolve_neg().contiguous()
        try:
            flat = t.reshape(-1).view(torch.uint8)
        except RuntimeError:  # a dtype torch cannot view as bytes (sub-byte kinds)
            raise SkeletonError(f"a torch tensor of {x.dtype} cannot move as bytes") from None
        return flat, "torch", x.dtype, tuple(x.shape), device
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.ndarray):
        if x.dtype.hasobject or x.size == 0:
            return None
        a = x if (x.flags.c_contiguous and x.flags.writeable) else numpy.array(x, order="C")
        return a.reshape(-1).view(numpy.uint8), "numpy", x.dtype, tuple(x.shape), "cpu"
    return None


def _walk(data: Any, leaf: Callable[[Any], Any]) -> Any:
    """``data`` with each leaf ``x`` replaced by ``leaf(x)`` (which returns ``x`` itself for
    anything it does not replace), through dicts, lists and tuples."""
    out = leaf(data)
    if out is not data:
        return out
    kind = type(data)  # exactly these: subclasses (OrderedDict, named tuples) are refused whole
    if kind is dict:
        return {k: _walk(v, leaf) for k, v in data.items()}
    if kind is list:
        return [_walk(v, leaf) for v in data]
    if kind is tuple:
        return tuple(_walk(v, leaf) for v in data)
    return data


def pack(data: Any) -> Tuple[bytes, List[Any]]:
    """The skeleton of ``data`` (bytes, see :mod:`tensorwire.omni.skeleton`) and the byte buffers
    of its tensors, in slot order. Raises :class:`SkeletonError` for what cannot be carried."""
    buffers: List[Any] = []
    seen: dict = {}  # id(tensor) -> its slot: a tensor found twice moves once, and comes back once

    def take(x: Any) -> Any:
        if id(x) in seen:
            return seen[id(x)][0]
        found = _as_bytes(x)
        if found is None:
            return x
        flat, framework, dtype, shape, device = found
        buffers.append(flat)
        slot = Slot(len(buffers) - 1, framework, dtype, shape, device)
        seen[id(x)] = (slot, x)  # x kept so its id is not reused while packing
        return slot

    skeleton = _walk(data, take)
    return _skeleton.encode(skeleton, Slot, Slot.fields), buffers


def load(raw: bytes) -> Any:
    """The skeleton that ``raw`` holds (slots checked); :class:`SkeletonError` otherwise."""
    return _skeleton.decode(raw, Slot.from_fields)


def slots(skeleton: Any) -> List[Slot]:
    """The slots of a loaded skeleton, one per buffer, by index (each index once, from 0)."""
    found: dict = {}

    def see(x: Any) -> Any:
        if isinstance(x, Slot):
            found[x.index] = x
        return x

    _walk(skeleton, see)
    if sorted(found) != list(range(len(found))):
        raise SkeletonError("the skeleton's slots are not numbered 0..n")
    return [found[i] for i in sorted(found)]


def _moves_device_memory() -> bool:
    """Whether this process's engines move CUDA memory (they have the CUDA driver)."""
    from .._native import gpu_driver

    return gpu_driver()[0] == "cuda"


def buffer_for(slot: Slot, nbytes: int) -> Any:
    """A fresh ``uint8`` buffer of ``nbytes`` for ``slot``, of the slot's framework: on the slot's
    CUDA device where it exists here and the engines move device memory, else in host memory."""
    if slot.framework == "torch":
        import torch

        if slot.device != "cpu" and _moves_device_memory() and _skeleton.device_exists(torch, slot.device):
            return torch.empty(nbytes, dtype=torch.uint8, device=slot.device)
        return torch.empty(nbytes, dtype=torch.uint8)
    import numpy

    return numpy.empty(nbytes, dtype=numpy.uint8)


def restore(slot: Slot, buffer: Any) -> Any:
    """The tensor of ``slot`` over ``buffer`` (a view, no copy; on its device again where the
    slot's device exists here, else left in host memory; a buffer already there stays)."""
    if slot.framework == "torch":
        import torch

        t = buffer.view(slot.dtype).reshape(slot.shape)
        if slot.device != "cpu" and _skeleton.device_exists(torch, slot.device):
            t = t.to(slot.device)
        return t
    return buffer.view(slot.dtype).reshape(slot.shape)


def unpack(skeleton: Any, tensors: List[Any]) -> Any:
    """The data: ``skeleton`` with each slot replaced by its tensor."""
    return _walk(skeleton, lambda x: tensors[x.index] if isinstance(x, Slot) else x)
