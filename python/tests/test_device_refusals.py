"""What a device tensor gets where tensorwire cannot move it: a tensor of a device other than CPU
and CUDA (ROCm, Metal, ...) is refused naming the device; a CUDA tensor in a process without a
CUDA driver gets an error saying so, never a crash (the CPU never reads it). The tensors here are
DLPack capsules made with ctypes over host memory that claim another device."""

import ctypes

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.testing import gpu_driver


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Claimed:
    """Host float32 memory whose DLPack says it lives on device type ``device_type``."""

    def __init__(self, device_type, n=256, with_device_method=True):
        self.buf = np.arange(n, dtype=np.float32)
        self.shape = (ctypes.c_int64 * 1)(n)
        self.device_type = device_type
        self.managed = DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = self.buf.ctypes.data
        t.device = DLDevice(device_type, 0)
        t.ndim = 1
        t.dtype = DLDataType(2, 32, 1)
        t.shape = self.shape
        t.strides = None
        t.byte_offset = 0
        if with_device_method:
            self.__dlpack_device__ = lambda: (self.device_type, 0)

    def __dlpack__(self, stream=None):
        # No deleter: this object owns the memory and outlives the capsule in each test.
        return _new_capsule(ctypes.addressof(self.managed), b"dltensor", None)


@pytest.mark.parametrize("device_type,name", [(10, "ROCm"), (8, "Metal"), (7, "Vulkan"), (14, "oneAPI")])
@pytest.mark.parametrize("with_device_method", [True, False], ids=["dlpack_device", "capsule_only"])
def test_a_foreign_device_is_refused_by_name(engines, device_type, name, with_device_method):
    a, _ = engines
    t = Claimed(device_type, with_device_method=with_device_method)
    with pytest.raises(tw.UnsupportedError, match=rf"a {name} tensor \(DLPack device type {device_type}"):
        a.register(t)


def test_a_cuda_tensor_without_a_driver_gets_a_clear_error(engines):
    kind, why = gpu_driver()
    if kind is not None:
        pytest.skip(f"this process has a GPU driver ({kind}): the no-driver error cannot happen here")
    assert why
    a, _ = engines
    with pytest.raises(tw.UnsupportedError, match="a CUDA tensor on device 0: device memory needs the CUDA driver"):
        a.register(Claimed(2))
    # The engine is fine afterwards, and host memory still moves.
    assert a.register(np.zeros(16, np.uint8)).length == 16


def test_the_fake_device_needs_its_switch():
    if gpu_driver()[0] == "fake":
        pytest.skip("this process runs with the fake device switched on")
    from tensorwire.testing import fake_cuda_empty
    with pytest.raises(tw.InvalidArgumentError, match="TENSORWIRE_TESTING_FAKE_CUDA=1"):
        fake_cuda_empty((4,), np.float32)


def test_an_engine_without_a_driver_has_tcp_only():
    if gpu_driver()[0] is not None:
        pytest.skip("this process has a GPU driver")
    e = tw.Engine()
    try:
        assert e.backends == ["tcp"]
        with pytest.raises(tw.UnsupportedError, match="CUDA driver"):
            tw.Engine(backends=["cuda", "tcp"])
    finally:
        e.shutdown()
