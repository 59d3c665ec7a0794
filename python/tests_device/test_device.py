"""Device tensors through every Python face: device in, device out; the cuda backend moves device
memory of one host with no host copy (the engines' ``host_staged`` counter stays 0), tcp stages it
through pinned host buffers (counted). Run over the fake CUDA device in CI and over torch CUDA
tensors by scripts/gpu-check."""

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.diffusion import DiffusionConnector, StagePayload
from tensorwire.mooncake import TransferEngine


def pattern(n, dtype="float32"):
    raw = (np.arange(n, dtype=np.uint64) * 2654435761 % 251).astype(dtype)
    return raw


@pytest.fixture
def pair():
    made = []

    def make(backends=None):
        a, b = tw.Engine(backends=backends), tw.Engine(backends=backends)
        made.extend([a, b])
        return a, b

    yield make
    for e in made:
        e.shutdown()


def staged(*engines):
    return sum(e.stats()["host_staged"] for e in engines)


def test_default_backends_put_cuda_first(pair):
    a, _ = pair()
    assert a.backends == ["cuda", "tcp"]


def test_a_device_write_over_cuda_touches_no_host_memory(dev, pair):
    if not dev.whole_allocations:
        pytest.skip("torch's caching allocator hands out parts of allocations, which CUDA IPC does not "
                    "export; run with PYTORCH_NO_CUDA_MEMORY_CACHING=1 for the cuda path")
    a, b = pair()
    want = pattern(1 << 20)
    src, dst = dev.tensor(want), dev.empty(want.shape, want.dtype)
    ra, rb = a.register(src), b.register(dst)
    opened = dev.ipc_opened()
    assert a.connect(b.address).write(ra, 0, rb.descriptor(), 0, want.nbytes) == want.nbytes
    assert np.array_equal(dev.host(dst), want)
    assert a.stats()["by_backend"] == {"cuda": want.nbytes}
    assert staged(a, b) == 0
    if opened is not None:
        assert dev.ipc_opened() > opened


def test_a_device_read_over_tcp_is_staged_and_counted(dev, pair):
    a, b = pair(["tcp"])
    want = pattern(3 << 20)
    remote, local = dev.tensor(want), dev.empty(want.shape, want.dtype)
    rl, rr = a.register(local), b.register(remote)
    assert a.connect(b.address).read(rl, 0, rr.descriptor(), 0, want.nbytes) == want.nbytes
    assert np.array_equal(dev.host(local), want)
    assert a.stats()["by_backend"] == {"tcp": want.nbytes}
    # Both sides: the reader lands pieces in a bounce, the server sends them from one.
    assert a.stats()["host_staged"] >= 1 and b.stats()["host_staged"] >= 1


def test_host_and_device_mix(dev, pair):
    a, b = pair()
    want = pattern(1 << 16, "int32")
    host_src, dev_dst = want.copy(), dev.empty(want.shape, want.dtype)
    ra, rb = a.register(host_src), b.register(dev_dst)
    a.connect(b.address).write(ra, 0, rb.descriptor(), 0, want.nbytes)
    assert np.array_equal(dev.host(dev_dst), want)
    if dev.whole_allocations:
        # The peer's region is device memory: the cuda backend copies host -> device straight
        # into it (unified addressing), no staging buffer on either side.
        assert a.stats()["by_backend"] == {"cuda": want.nbytes}
        assert staged(a, b) == 0
    # And the other way: device -> host, read by the host side.
    back = np.zeros_like(want)
    rback = a.register(back)
    a.connect(b.address).read(rback, 0, rb.descriptor(), 0, want.nbytes)
    assert np.array_equal(back, want)


@pytest.mark.parametrize("backends", [None, ["tcp"]], ids=["default", "tcp"])
def test_connector_device_in_device_out_by_chunks(dev, backends):
    if backends is None and not dev.whole_allocations:
        pytest.skip("the cuda path needs whole allocations (PYTORCH_NO_CUDA_MEMORY_CACHING=1)")
    pe, ce = tw.Engine(backends=backends), tw.Engine(backends=backends)
    prod = DiffusionConnector(role="denoise", transfer_mode="p2p", engine=pe)
    cons = DiffusionConnector(role="decode", transfer_mode="p2p", engine=ce)
    try:
        want = pattern(4 * 256 * 512).reshape(4, 256, 512)
        src, dst = dev.tensor(want), dev.empty(want.shape, want.dtype)
        h = prod.publish(StagePayload(request_id=1, kind="latent", tensor=src, chunk_dim=0, num_chunks=4))
        for i in range(4):
            h.mark_ready(i)
        views = list(cons.consume(h.to_bytes(), dst=dst, timeout=30))
        assert len(views) == 4
        assert all(dev.is_device(v) and tuple(v.shape) == (1, 256, 512) for v in views)
        got = dev.host(dst)
        assert np.array_equal(got, want)
        for k, v in enumerate(views):  # each view is a part of dst holding one chunk
            assert any(np.array_equal(dev.host(v), want[i:i + 1]) for i in range(4)), k
        if backends is None:
            assert staged(pe, ce) == 0
            assert ce.stats()["by_backend"] == {"cuda": want.nbytes}
        else:
            assert staged(pe, ce) >= 2
            assert ce.stats()["by_backend"] == {"tcp": want.nbytes}
    finally:
        prod.close()
        cons.close()


def test_mooncake_engine_registers_a_device_address(dev):
    """Mooncake's register_memory takes a raw address and asks the driver what it is; a device
    address is registered as device memory and moves as such."""
    if dev.name != "fake":
        pytest.skip("raw device addresses come from the fake device here; scripts/gpu-check covers torch")
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("127.0.0.1:0", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1:0", "P2PHANDSHAKE", "tcp", "") == 0
        want = pattern(1 << 18, "uint8")
        src, dst = dev.tensor(want), dev.empty(want.shape, want.dtype)
        assert a.register_memory(src.memory.address, want.nbytes) == 0
        assert b.register_memory(dst.memory.address, want.nbytes) == 0
        peer = f"127.0.0.1:{b.get_rpc_port()}"
        assert a.transfer_sync_write(peer, src.memory.address, dst.memory.address, want.nbytes) == 0
        assert np.array_equal(dev.host(dst), want)
    finally:
        a.close()
        b.close()


def test_a_device_tensor_view_moves_through_staging(dev, pair):
    """A peer's tensor carved from a larger allocation is not exported over CUDA IPC (a handle
    would open its neighbours too): it is reached through tcp with staging, and arrives whole,
    its neighbours untouched."""
    a, b = pair()
    want = pattern(1 << 16)
    src = dev.tensor(want)
    whole = dev.empty((1024 + want.size,), want.dtype)
    dst = whole[1024:]
    ra, rb = a.register(src), b.register(dst)
    a.connect(b.address).write(ra, 0, rb.descriptor(), 0, want.nbytes)
    got = dev.host(whole)
    assert np.array_equal(got[1024:], want) and not got[:1024].any()
    assert a.stats()["by_backend"] == {"tcp": want.nbytes}
    assert a.stats()["host_staged"] >= 1 and b.stats()["host_staged"] >= 1


@pytest.mark.parametrize("where", ["embedded", "node"])
def test_store_put_from_and_get_into_device_tensors(dev, where):
    """The store's zero-copy faces take device tensors: the value is read from device memory
    into the store and written from the store into device memory (staged: the store holds host
    memory), and its dtype and shape travel with it."""
    e = tw.Engine()
    node_engine = None
    try:
        if where == "embedded":
            s = tw.Store.embedded(e, 16 << 20)
        else:
            node_engine = tw.Engine()
            shared = tw.Store.embedded(node_engine, 16 << 20, shared=True)
            node = tw.StoreNode(shared)
            s = tw.Store.connect(e, node.address, node_engine=node_engine.address)
        want = pattern(1 << 18).reshape(512, 512)
        s.put_from("latent/1", dev.tensor(want))
        out = dev.empty(want.shape, want.dtype)
        assert s.get_into("latent/1", out) == want.nbytes
        assert np.array_equal(dev.host(out), want)
    finally:
        e.shutdown()
        if node_engine is not None:
            node_engine.shutdown()


def test_omni_connector_puts_and_gets_cuda_tensors_on_their_device(dev, tmp_path):
    """vLLM-Omni's connector: a torch CUDA tensor in, a torch CUDA tensor out on the same device,
    moved as device memory (the bytes never staged on the cuda path)."""
    if dev.name != "cuda":
        pytest.skip("vLLM-Omni's connector takes torch tensors: the fake device has none (scripts/gpu-check)")
    import torch
    from tensorwire.omni import TensorwireConnector

    prod = TensorwireConnector({"registry_dir": str(tmp_path)})
    cons = TensorwireConnector({"registry_dir": str(tmp_path)})
    try:
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0").reshape(1024, 1024)
        ok, size, meta = prod.put("dit", "vae", "req-1", {"latent": t, "step": 3})
        assert ok and size > 0
        got, n = cons.get("dit", "vae", "req-1", meta)
        assert n == size and got["step"] == 3
        assert got["latent"].device == t.device and torch.equal(got["latent"], t)
        if dev.whole_allocations:
            assert cons._conn.engine.stats()["host_staged"] == 0
            assert prod._conn.engine.stats()["host_staged"] == 0
    finally:
        prod.close()
        cons.close()
