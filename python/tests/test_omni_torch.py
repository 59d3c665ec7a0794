"""``TensorwireConnector`` with torch tensors, as vLLM-Omni's stages pass them: torch in, torch
out, every dtype torch has, any layout, no copy on the way in for contiguous host tensors and
none on the way out. Skipped where torch is not installed (its wheels are gigabytes)."""

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this venv")

from tensorwire.omni import TensorwireConnector as C  # noqa: E402
from tensorwire.omni import packing  # noqa: E402


@pytest.fixture
def pair(tmp_path):
    p, c = C({"registry_dir": str(tmp_path)}), C({"registry_dir": str(tmp_path)})
    yield p, c
    p.close()
    c.close()


def _round_trip(pair, data):
    producer, consumer = pair
    key = f"t-{uuid.uuid4().hex[:8]}"
    ok, size, meta = producer.put("0", "1", key, data)
    assert ok, "put failed"
    got, n = consumer.get("0", "1", key, meta)
    assert n == size
    return got


def _same(a, b):
    assert isinstance(b, torch.Tensor)
    assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
    # Compare bits: NaNs and the float8 kinds have no usable ==.
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


DTYPES = [getattr(torch, n) for n in (
    "float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu", "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
    "uint64", "complex64", "complex128") if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_as_itself(pair, dtype):
    raw = torch.randint(0, 255, (3, 5, 16), dtype=torch.uint8)
    t = raw.view(dtype) if raw.element_size() else raw  # any bit pattern, viewed as dtype
    _same(t, _round_trip(pair, {"t": t})["t"])


def test_a_transposed_tensor_round_trips_contiguous(pair):
    t = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6).t()
    assert not t.is_contiguous()
    got = _round_trip(pair, [t])[0]
    assert got.is_contiguous() and torch.equal(got, t)


def test_layouts_and_flags_round_trip(pair):
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    data = {
        "sliced": base[:, 1:3, ::2],
        "expanded": torch.ones(1, 4).expand(3, 4),
        "scalar": torch.tensor(2.5),
        "grad": torch.ones(3, requires_grad=True) * 2,
        "conj": (torch.arange(4) + 1j).to(torch.complex64).conj(),
        "empty": torch.zeros(0, 4),
        "int4ish": torch.tensor([1, 2, 3], dtype=torch.int8),
    }
    got = _round_trip(pair, data)
    for name, t in data.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(g, t.detach().resolve_conj()), name
        assert not g.requires_grad


def test_torch_and_numpy_side_by_side_each_come_back_as_themselves(pair):
    data = {"t": torch.arange(8, dtype=torch.bfloat16), "n": np.arange(8, dtype=np.float16), "s": "text"}
    got = _round_trip(pair, data)
    assert isinstance(got["t"], torch.Tensor) and isinstance(got["n"], np.ndarray) and got["s"] == "text"


def test_received_tensors_are_the_buffers_the_transfer_landed_in(pair, monkeypatch):
    landed = []

    def recording(slot, nbytes):
        b = torch.empty(nbytes, dtype=torch.uint8)
        landed.append(b)
        return b

    monkeypatch.setattr(packing, "buffer_for", recording)
    t = torch.randn(64, 64, dtype=torch.float16)
    got = _round_trip(pair, {"t": t})["t"]
    assert len(landed) == 1 and got.data_ptr() == landed[0].data_ptr()
    assert torch.equal(got, t)


def test_a_contiguous_tensor_is_published_without_a_copy():
    t = torch.randn(16, 16, dtype=torch.bfloat16)
    _, buffers = packing.pack({"t": t})
    assert buffers[0].data_ptr() == t.data_ptr()


def test_a_device_tensor_comes_back_on_its_device(pair):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here (the device path runs in python/tests_device on a GPU: scripts/gpu-check)")
    t = torch.arange(10, device="cuda", dtype=torch.float32)
    got = _round_trip(pair, {"t": t})["t"]
    assert got.device == t.device and torch.equal(got, t)
