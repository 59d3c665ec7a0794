"""The store from Python: bytes and tensors in and out (no staging copy for tensors), batches,
retention and leases, a store node and its remote clients, and the errors of each."""

import numpy as np
import pytest

import tensorwire as tw


@pytest.fixture
def stores(store_node):
    """The embedded store and a remote client of it."""
    node_engine, embedded, node = store_node
    client = tw.Engine()
    remote = tw.Store.connect(client, node.address)
    yield embedded, remote
    client.shutdown()


def test_bytes_round_trip(stores):
    for s in stores:
        s.put("k-bytes", b"hello world")
        assert s.get("k-bytes") == b"hello world"
        assert s.exists("k-bytes")
        assert s.remove("k-bytes")
        assert not s.exists("k-bytes") and not s.remove("k-bytes")


def test_tensors_round_trip_without_staging(stores):
    for i, s in enumerate(stores):
        x = np.random.default_rng(i).standard_normal((64, 33)).astype(np.float32)
        s.put_from(f"t{i}", x)
        y = np.zeros_like(x)
        assert s.get_into(f"t{i}", y) == x.nbytes
        assert np.array_equal(x, y)


def test_batches(stores):
    _, remote = stores
    xs = [np.full((128,), i, dtype=np.int32) for i in range(5)]
    keys = [f"b{i}" for i in range(5)]
    assert remote.batch_put_from(keys, xs) == [None] * 5
    ys = [np.zeros_like(x) for x in xs]
    assert remote.batch_get_into(keys, ys) == [x.nbytes for x in xs]
    assert all(np.array_equal(x, y) for x, y in zip(xs, ys))
    out = remote.batch_get_into(["missing"], [np.zeros(4, dtype=np.int32)])
    assert isinstance(out[0], tw.KeyNotFoundError)


def test_a_missing_key_is_key_not_found(stores):
    for s in stores:
        with pytest.raises(tw.KeyNotFoundError) as e:
            s.get("nope")
        assert isinstance(e.value, KeyError) and "nope" in str(e.value)


def test_a_second_put_is_key_exists(stores):
    embedded, _ = stores
    embedded.put("dup", b"1")
    with pytest.raises(tw.KeyExistsError):
        embedded.put("dup", b"2")


def test_retention_pins_and_stats(stores):
    embedded, remote = stores
    remote.put("p", b"x" * 100, retention="pinned")
    remote.pin("p")
    remote.unpin("p")
    with pytest.raises(tw.InvalidArgumentError):
        remote.put("q", b"x", retention="forever")
    st = embedded.stats()
    assert st["objects"] >= 1 and st["capacity"] >= 64 << 20


def test_a_lease_removes_after_its_consumers():
    e = tw.Engine()
    s = tw.Store.embedded(e, 1 << 20)
    s.put("l", b"abc")
    s.set_lease("l", ttl=0.05)
    import time

    time.sleep(0.4)
    assert not s.exists("l")
    e.shutdown()


def test_a_store_node_needs_an_embedded_store(stores):
    _, remote = stores
    with pytest.raises(tw.InvalidArgumentError):
        tw.StoreNode(remote)
