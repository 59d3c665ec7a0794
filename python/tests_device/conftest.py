"""The device tests' fixture: the device the tensors live on. Under the testing switch
(``TENSORWIRE_TESTING_FAKE_CUDA=1``, how ``python/test`` runs this folder) the fake CUDA device of
``tensorwire.testing``; on a machine with the CUDA driver and torch (``scripts/gpu-check``), torch
CUDA tensors; else every test skips, saying why."""

import os

import numpy as np
import pytest

from tensorwire.testing import fake_cuda_counts, fake_cuda_empty, fake_cuda_tensor, gpu_driver


class FakeDevice:
    """Tensors of the fake CUDA device; the fake's own counters show what its IPC driver did."""

    name = "fake"
    whole_allocations = True

    def tensor(self, a):
        return fake_cuda_tensor(a)

    def empty(self, shape, dtype):
        return fake_cuda_empty(shape, dtype)

    def host(self, t):
        return t.numpy()

    def is_device(self, t):
        return type(t).__name__ == "FakeCudaTensor" and t.__dlpack_device__()[0] == 2

    def ipc_opened(self):
        return fake_cuda_counts()["ipc_opened"]


class TorchCuda:
    """torch CUDA tensors on device 0. A tensor is a whole CUDA allocation (what CUDA IPC
    exports) only when torch's caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING=1)."""

    name = "cuda"

    def __init__(self):
        import torch
        self.torch = torch
        self.whole_allocations = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1"

    def tensor(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).to("cuda:0")

    def empty(self, shape, dtype):
        return self.torch.zeros(tuple(shape), dtype=getattr(self.torch, np.dtype(dtype).name), device="cuda:0")

    def host(self, t):
        return t.cpu().numpy()

    def is_device(self, t):
        return bool(getattr(t, "is_cuda", False))

    def ipc_opened(self):
        return None


@pytest.fixture(scope="session")
def dev():
    kind, why = gpu_driver()
    if kind == "fake":
        return FakeDevice()
    if kind == "cuda":
        try:
            import torch
        except ImportError:
            pytest.skip("the CUDA driver is here but torch is not: the device tests make torch CUDA tensors")
        if not torch.cuda.is_available():
            pytest.skip("the CUDA driver is here but torch sees no GPU")
        return TorchCuda()
    pytest.skip(f"no GPU driver ({why}) and no fake device: set TENSORWIRE_TESTING_FAKE_CUDA=1 "
                "(python/test does) or run on a GPU machine (scripts/gpu-check)")
