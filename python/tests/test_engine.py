"""The transfer engine from Python: tensors registered through DLPack (no copy), transfers both
ways, batches, notifications, and clear errors for bad input."""

import time

import numpy as np
import pytest

import tensorwire as tw

DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
          "float32", "float64"]


def pattern(shape, dtype):
    n = int(np.prod(shape))
    raw = (np.arange(n, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
    if dtype == "bool":
        return (raw % 2 == 0).reshape(shape)
    return raw.astype(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_write_moves_every_dtype_exactly(engines, dtype):
    a, b = engines
    src = pattern((3, 5, 7), dtype)
    dst = np.zeros_like(src)
    ra, rb = a.register(src), b.register(dst)
    s = a.connect(b.address)
    assert s.write(ra, 0, rb.descriptor(), 0, src.nbytes) == src.nbytes
    assert np.array_equal(src, dst)


def test_reads_and_offsets(engines):
    a, b = engines
    remote = pattern((4096,), "uint8")
    local = np.zeros(1000, dtype=np.uint8)
    ra, rb = a.register(local), b.register(remote)
    a.connect(b.address).read(ra, 10, rb.descriptor(), 100, 500)
    assert np.array_equal(local[10:510], remote[100:600])
    assert not local[:10].any() and not local[510:].any()


def test_registration_is_zero_copy(engines):
    a, b = engines
    src = np.full(64, 7, dtype=np.uint8)
    ra = a.register(src)
    src[:] = 9  # the region is the array's memory: a later write sees the new bytes
    dst = np.zeros(64, dtype=np.uint8)
    rb = b.register(dst)
    a.connect(b.address).write(ra, 0, rb.descriptor(), 0, 64)
    assert (dst == 9).all()


def test_batches_move_all_ops(engines):
    a, b = engines
    src = pattern((8, 1024), "uint8")
    dst = np.zeros_like(src)
    ra, rb = a.register(src), b.register(dst)
    d = rb.descriptor()
    ops = [(ra, i * 1024, d, i * 1024, 1024) for i in range(8)]
    assert a.connect(b.address).batch_write(ops) == src.nbytes
    assert np.array_equal(src, dst)


def test_engine_memory_and_region_bytes(engines):
    a, b = engines
    buf = b.alloc(4096)
    buf.write(0, b"hello")
    local = a.alloc(4096)
    a.connect(b.address).read(local, 0, buf.descriptor(), 0, 5)
    assert local.read(0, 5) == b"hello"
    assert buf.length == 4096


def test_notifications_arrive_after_transfers(engines):
    a, b = engines
    s = a.connect(b.address)
    s.notify(b"step 3 done")
    sender, payload = b.recv_notification(timeout=5)
    assert payload == b"step 3 done" and sender == a.id


def test_a_closed_region_refuses_use(engines):
    a, _ = engines
    r = a.alloc(64)
    r.close()
    r.close()  # idempotent
    with pytest.raises(tw.InvalidArgumentError):
        r.descriptor()


def test_a_wrong_permission_is_access_denied(engines):
    a, b = engines
    ro = b.register(np.zeros(64, dtype=np.uint8), writable=False)
    src = a.register(np.ones(64, dtype=np.uint8))
    with pytest.raises(tw.AccessDeniedError):
        a.connect(b.address).write(src, 0, ro.descriptor(), 0, 64)


def test_out_of_bounds_is_an_error(engines):
    a, b = engines
    rb = b.register(np.zeros(64, dtype=np.uint8))
    ra = a.register(np.zeros(128, dtype=np.uint8))
    with pytest.raises(tw.OutOfBoundsError):
        a.connect(b.address).write(ra, 0, rb.descriptor(), 0, 128)


def test_bad_input_has_its_own_exception(engines):
    a, _ = engines
    with pytest.raises(tw.InvalidArgumentError):
        a.register([1, 2, 3])  # not a tensor
    with pytest.raises(tw.InvalidArgumentError):
        a.connect("not an address")
    with pytest.raises(tw.InvalidArgumentError):
        a.recv_notification(timeout=-1)
    with pytest.raises(tw.TimeoutError):
        a.recv_notification(timeout=0.05)
    with pytest.raises(tw.PeerClosedError):
        a.connect("127.0.0.1:1", timeout=5)


def test_a_reachable_engine_needs_a_secret(tmp_path):
    with pytest.raises(tw.InvalidArgumentError, match="cluster secret"):
        tw.Engine("0.0.0.0:0")
    e = tw.Engine("0.0.0.0:0", insecure=True)
    e.shutdown()
    bad = tmp_path / "secret"
    bad.write_text("00112233445566778899aabbccddeeff")
    bad.chmod(0o644)
    with pytest.raises(tw.InvalidArgumentError, match="readable by group or others"):
        tw.Engine(secret_file=str(bad))


def test_raw_addresses_register_like_mooncake(engines):
    a, b = engines
    buf = np.arange(256, dtype=np.uint8)
    r = a.register(address=buf.ctypes.data, length=buf.nbytes)
    dst = b.register(np.zeros(256, dtype=np.uint8))
    a.connect(b.address).write(r, 0, dst.descriptor(), 0, 256)
    assert dst.read(0, 4) == bytes([0, 1, 2, 3])
    r.close()
    with pytest.raises(tw.InvalidArgumentError):
        a.register(buf, address=buf.ctypes.data, length=16)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_prepared_transfer_posts_again_and_again(backend):
    a, b = tw.Engine(backends=[backend]), tw.Engine(backends=[backend])
    try:
        src = np.zeros(4096, dtype=np.uint8)
        ra = a.register(src)
        rb = b.alloc(8192)  # engine memory: a same-host peer (shm) maps it
        s = a.connect(b.address)
        p = s.prepare_write([(ra, 0, rb.descriptor(), 4096, 4096)])
        assert len(p) == 1
        for i in range(1, 4):
            src[:] = i  # each post moves the bytes the source holds then
            assert p.post() == 4096
            assert rb.read(4096, 4096) == bytes([i]) * 4096 and rb.read(0, 4096) == bytes(4096)
        back = np.zeros(4096, dtype=np.uint8)
        rback = a.register(back)
        r = s.prepare_read([(rback, 0, rb.descriptor(), 4096, 4096)])
        assert r.post() == 4096 and (back == 3).all()
        assert a.moved()[backend] == 4 * 4096
        with pytest.raises(tw.OutOfBoundsError):
            s.prepare_write([(ra, 0, rb.descriptor(), 8000, 4096)])
        rb.close()
        with pytest.raises(tw.NotFoundError):
            p.post()
    finally:
        a.shutdown()
        b.shutdown()


def test_a_huge_timeout_waits_as_long_as_it_takes(engines):
    # A timeout past what a clock can hold is a wait without end in practice (a century), not
    # an error or a crash.
    a, b = engines
    src, dst = pattern((256,), "uint8"), np.zeros(256, dtype=np.uint8)
    ra, rb = a.register(src), b.register(dst)
    s = a.connect(b.address, timeout=1e300)
    assert s.write(ra, 0, rb.descriptor(), 0, 256, timeout=1e300) == 256
    assert np.array_equal(src, dst)


def test_the_linger_ends_and_can_be_turned_off(engines):
    # After a call, runtime workers stay awake for the linger (a moment), then cost nothing.
    a, b = engines
    src, dst = pattern((256,), "uint8"), np.zeros(256, dtype=np.uint8)
    ra, rb = a.register(src), b.register(dst)
    s = a.connect(b.address)
    before = tw.set_linger(0.001)
    try:
        assert s.write(ra, 0, rb.descriptor(), 0, 256) == 256
        start = time.process_time()  # every thread of this process
        time.sleep(0.5)
        # A linger that never ended would spin a core the whole half second.
        assert time.process_time() - start < 0.25
        for bad in (-1.0, float("nan"), float("inf"), 1e300, 1.5):
            with pytest.raises(tw.InvalidArgumentError, match="linger"):
                tw.set_linger(bad)
        assert tw.set_linger(0) == pytest.approx(0.001)
        dst[:] = 0
        assert s.write(ra, 0, rb.descriptor(), 0, 256) == 256 and np.array_equal(src, dst)
    finally:
        tw.set_linger(before)
