"""Stream order: a publish (or mark_ready) on the producer's stream reads nothing before the work
queued on that stream has run, and a consume on the consumer's stream writes nothing into its
destination before the work queued there has run; the chunk is yielded once its bytes are in. Over
the fake device, whose streams a test holds back (as if a kernel queued on them had not run) and
releases. scripts/gpu-check runs the torch version at the end (a real kernel on a side stream)."""

import threading
import time

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.diffusion import DiffusionConnector, StagePayload


@pytest.fixture
def fake(dev):
    if dev.name != "fake":
        pytest.skip("holding a stream back needs the fake device")
    from tensorwire.testing import FakeCudaStream
    return FakeCudaStream


@pytest.fixture
def conns():
    prod = DiffusionConnector(role="denoise", transfer_mode="p2p")
    cons = DiffusionConnector(role="decode", transfer_mode="p2p")
    yield prod, cons
    prod.close()
    cons.close()


def values(n, v):
    return np.full(n, v, dtype=np.float32)


def test_nothing_is_read_before_the_producers_stream_event(dev, fake, conns):
    prod, cons = conns
    s = fake()
    src = dev.tensor(values(1 << 16, 1.0))   # stale: the "kernel" has not written it yet
    s.hold()
    h = prod.publish(StagePayload(request_id=1, kind="latent", tensor=src), stream=s)
    dst = dev.empty((1 << 16,), np.float32)
    c = cons._conn.consume(h.to_bytes(), dst, timeout=10)
    with pytest.raises(tw.TimeoutError):
        c.next(timeout=0.3)                # not ready: the producer's work has not run
    assert not dev.host(dst).any()          # and nothing of it was read into dst
    src.memory.write(0, values(1 << 16, 2.0))   # the kernel runs ...
    s.release()                                  # ... and its stream moves on
    assert c.next(timeout=10) is not None
    assert (dev.host(dst) == 2.0).all(), "the payload was read before the producer's stream event"
    assert c.next(timeout=10) is None


def test_a_chunk_marked_on_a_stream_waits_for_it(dev, fake, conns):
    prod, cons = conns
    s = fake()
    want = np.arange(4 * 1024, dtype=np.float32).reshape(4, 1024)
    src = dev.tensor(want)
    h = prod.publish(StagePayload(request_id=2, kind="latent", tensor=src, chunk_dim=0, num_chunks=4))
    for i in range(3):
        h.mark_ready(i)
    s.hold()
    h.mark_ready(3, stream=s)               # chunk 3's kernel is still queued
    dst = dev.empty(want.shape, want.dtype)
    c = cons._conn.consume(h.to_bytes(), dst, timeout=10)
    got = [c.next(timeout=10) for _ in range(3)]
    assert sorted(g[0] for g in got) == [0, 1, 2]
    with pytest.raises(tw.TimeoutError):
        c.next(timeout=0.3)
    s.release()
    assert c.next(timeout=10)[0] == 3
    assert np.array_equal(dev.host(dst), want)


def test_nothing_lands_before_the_consumers_stream_event(dev, fake, conns):
    prod, cons = conns
    want = values(1 << 16, 3.0)
    h = prod.publish(StagePayload(request_id=3, kind="latent", tensor=dev.tensor(want)))
    s = fake()
    dst = dev.tensor(values(1 << 16, 9.0))  # a kernel queued on s still reads the old values
    s.hold()
    chunks = cons.consume(h.to_bytes(), dst, timeout=10, stream=s)
    got = []
    t = threading.Thread(target=lambda: got.extend(chunks))
    t.start()
    time.sleep(0.3)
    assert not got, "a chunk was yielded before the consumer's stream event"
    assert (dev.host(dst) == 9.0).all(), "the destination was written before the consumer's stream event"
    s.release()
    t.join(10)
    assert len(got) == 1 and (dev.host(dst) == 3.0).all()


def test_a_stream_event_that_never_comes_times_out(dev, fake, conns):
    prod, cons = conns
    h = prod.publish(StagePayload(request_id=4, kind="latent", tensor=dev.tensor(values(64, 1.0))))
    s = fake()
    s.hold()
    c = cons._conn.consume(h.to_bytes(), dev.empty((64,), np.float32), timeout=0.5, stream=s)
    with pytest.raises(tw.TimeoutError, match="stream"):
        c.next(timeout=5)
    s.release()


def test_a_stream_that_is_not_one_is_refused(dev, conns):
    prod, _ = conns
    with pytest.raises(tw.InvalidArgumentError, match="stream= takes"):
        prod.publish(StagePayload(request_id=5, kind="latent", tensor=dev.tensor(values(8, 1.0))), stream="s")


@pytest.fixture
def torch_cuda(dev):
    if dev.name != "cuda":
        pytest.skip("a real kernel on a side stream needs a GPU (scripts/gpu-check)")
    import torch
    return torch


def test_torch_the_producers_kernel_runs_before_the_read(dev, torch_cuda, conns):
    torch = torch_cuda
    prod, cons = conns
    src = torch.ones(1 << 22, device="cuda:0")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)   # about 0.1 s of spinning before the write
        src.fill_(2.0)
    h = prod.publish(StagePayload(request_id=6, kind="latent", tensor=src), stream=s)
    dst = torch.zeros_like(src)
    for _ in cons.consume(h.to_bytes(), dst, timeout=30):
        pass
    assert bool((dst == 2.0).all()), "the payload was read before the producer's kernel wrote it"


def test_torch_the_consumers_earlier_kernel_reads_the_old_bytes(dev, torch_cuda, conns):
    torch = torch_cuda
    prod, cons = conns
    src = torch.full((1 << 22,), 3.0, device="cuda:0")
    dst = torch.full((1 << 22,), 9.0, device="cuda:0")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        before = dst.clone()             # a kernel that still reads dst's old bytes
    h = prod.publish(StagePayload(request_id=7, kind="latent", tensor=src))
    for _ in cons.consume(h.to_bytes(), dst, timeout=30, stream=s):
        pass
    with torch.cuda.stream(s):
        after = dst.clone()              # queued after the chunk was yielded: sees the new bytes
    s.synchronize()
    assert bool((before == 9.0).all()), "dst was written before the consumer's earlier kernel read it"
    assert bool((after == 3.0).all())

