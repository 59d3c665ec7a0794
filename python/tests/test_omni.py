"""``TensorwireConnector`` against vLLM-Omni's ``OmniConnectorBase`` contract (written from the
contract in ``tensorwire/omni/connector.py``, with numpy only): what each call returns on
success, on failure, and that put, get and cleanup never raise."""

import gc
import logging
import os
import signal
import threading
import time
import uuid

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.omni import TensorwireConnector as C
from tensorwire.omni.host_records import HostRecords


@pytest.fixture
def omni(tmp_path):
    """``omni(**config)``: connectors sharing a private per-test directory, closed afterwards."""
    made = []

    def make(**cfg):
        c = C({"registry_dir": str(tmp_path), **cfg})
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _key():
    return f"req-{uuid.uuid4().hex[:8]}"


# -- construction and teardown ---------------------------------------------------------------------

def test_built_from_an_empty_config_round_trips_on_one_host():
    key = _key()
    with C({}) as producer, C({}) as consumer:
        ok, size, meta = producer.put("a", "b", key, {"x": np.ones(4)})
        assert ok and size > 32 and meta is not None
        obj, got = consumer.get("a", "b", key)
        assert got == size and np.array_equal(obj["x"], np.ones(4))


def test_close_is_idempotent_and_later_calls_keep_the_contract(omni, caplog):
    c = omni()
    c.close()
    c.close()
    with caplog.at_level(logging.ERROR, logger="tensorwire.omni"):
        assert c.put("a", "b", _key(), {"x": np.ones(2)}) == (False, 0, None)
        assert c.get("a", "b", _key()) is None
    assert "closed" in caplog.text
    assert c.health()["status"] == "closed"
    assert c.cleanup(_key()) is False


def test_close_releases_what_the_connector_published(omni):
    producer, consumer = omni(), omni()
    key = _key()
    assert producer.put("a", "b", key, {"x": np.arange(10)})[0]
    producer.close()
    assert consumer.get("a", "b", key) is None


def test_the_context_manager_closes(omni):
    key = _key()
    with omni() as producer:
        producer.put("a", "b", key, np.zeros(3))
    assert producer.health()["status"] == "closed"
    assert omni().get("a", "b", key) is None


def test_a_dropped_connector_releases_its_payloads(omni, tmp_path):
    consumer = C({"registry_dir": str(tmp_path)})
    producer = C({"registry_dir": str(tmp_path)})
    key = _key()
    producer.put("a", "b", key, np.ones(5))
    del producer
    gc.collect()
    assert consumer.get("a", "b", key) is None
    consumer.close()


def test_a_half_built_connector_does_not_raise_when_collected():
    with pytest.raises(tw.InvalidArgumentError, match="needs a store"):
        C({"transfer_mode": "store"})
    gc.collect()  # its __del__ ran on an object whose __init__ failed


def test_invalid_configs_are_refused_at_construction():
    with pytest.raises(tw.InvalidArgumentError, match="consumers"):
        C({"consumers": 0})
    with pytest.raises(tw.InvalidArgumentError, match="transfer_mode"):
        C({"transfer_mode": "carrier pigeon"})


def test_vllm_omni_config_keys_are_ignored(omni):
    c = omni(stage_id=3, extra={"wakeup_scope": "x"})
    key = _key()
    assert c.put("0", "1", key, {"v": 1})[0]
    assert omni().get("0", "1", key)[0] == {"v": 1}


def test_class_attributes_of_the_base(omni):
    assert C.supports_raw_data is True
    assert C._make_key("r1", "0", "1") == "r1@0_1"
    assert omni()._make_key("r", "a", "b", separator="#") == "r#a_b"


# -- put -------------------------------------------------------------------------------------------

def test_put_of_unpicklable_data_returns_the_failure_value(omni, caplog):
    with caplog.at_level(logging.ERROR, logger="tensorwire.omni"):
        assert omni().put("a", "b", _key(), {"f": lambda: 1, "x": np.ones(3)}) == (False, 0, None)
    assert "put" in caplog.text and "failed" in caplog.text


def test_put_returns_the_size_get_returns(omni):
    producer, consumer = omni(), omni()
    key = _key()
    data = {"hidden": np.arange(1000, dtype=np.float32).reshape(10, 100), "ids": [1, 2, 3]}
    ok, size, meta = producer.put("thinker", "talker", key, data)
    assert ok and size >= 4000
    obj, got = consumer.get("thinker", "talker", key, meta)
    assert got == size
    assert np.array_equal(obj["hidden"], data["hidden"]) and obj["ids"] == [1, 2, 3]


def test_a_second_put_replaces_the_first_and_releases_it(omni):
    producer, consumer = omni(), omni()
    key = _key()
    producer.put("a", "b", key, {"v": np.zeros(4)})
    producer.put("a", "b", key, {"v": np.full(4, 7.0)})
    assert producer.health()["held_payloads"] == 1
    obj, _ = consumer.get("a", "b", key)
    assert np.array_equal(obj["v"], np.full(4, 7.0))
    assert consumer.get("a", "b", key) is None


def test_non_tensor_data_and_raw_bytes_round_trip(omni):
    producer, consumer = omni(), omni()
    for data in ("text", 42, None, b"\x00raw bytes" * 1000, [{"a": (1, 2)}, {"b": {3}}]):
        key = _key()
        assert producer.put("a", "b", key, data)[0]
        assert consumer.get("a", "b", key)[0] == data


def test_numpy_in_numpy_out_for_every_kind_of_array(omni):
    producer, consumer = omni(), omni()
    point = np.dtype([("x", "<f4"), ("n", "<i2")])
    arrays = {
        "f16": np.arange(12, dtype=np.float16).reshape(3, 4),
        "c64": (np.arange(6) + 1j).astype(np.complex64),
        "bool": np.array([True, False, True]),
        "u64": np.arange(5, dtype=np.uint64) << 40,
        "big_endian": np.arange(4, dtype=">i4"),
        "structured": np.array([(1.5, 2), (3.5, 4)], dtype=point),
        "transposed": np.arange(24, dtype=np.int32).reshape(4, 6).T,
        "strided": np.arange(100, dtype=np.float64)[::7],
        "read_only": np.frombuffer(bytes(range(16)), dtype=np.uint8),
        "scalar": np.array(3.25),
        "empty": np.zeros((0, 3)),
        "objects": np.array([{"k": 1}, "s"], dtype=object),
    }
    key = _key()
    assert producer.put("a", "b", key, arrays)[0]
    got, _ = consumer.get("a", "b", key)
    for name, a in arrays.items():
        g = got[name]
        assert isinstance(g, np.ndarray) and g.dtype == a.dtype and g.shape == a.shape, name
        if a.dtype.hasobject:
            assert list(g) == list(a)
        else:
            assert np.array_equal(g, a), name


def test_received_arrays_are_views_of_the_buffers_the_transfer_landed_in(omni):
    producer, consumer = omni(), omni()
    key = _key()
    producer.put("a", "b", key, {"x": np.arange(64, dtype=np.float32).reshape(8, 8)})
    x = consumer.get("a", "b", key)[0]["x"]
    assert x.base is not None and x.base.dtype == np.uint8 and np.shares_memory(x, x.base)
    assert x.flags.writeable


def test_a_tensor_found_twice_moves_once_and_comes_back_once(omni):
    producer, consumer = omni(), omni()
    key = _key()
    t = np.arange(1000, dtype=np.int64)
    ok, size, _ = producer.put("a", "b", key, {"first": t, "again": [t]})
    assert ok and size < 2 * t.nbytes
    got = consumer.get("a", "b", key)[0]
    assert got["first"] is got["again"][0]


# -- get -------------------------------------------------------------------------------------------

def test_get_of_a_key_never_put_is_none(omni):
    assert omni().get("a", "b", _key()) is None
    assert omni().get("a", "b", _key(), {"tensorwire": 1}) is None


def test_get_without_metadata_finds_the_payload_by_key(omni):
    producer, consumer = omni(), omni()
    key = _key()
    producer.put("dit", "vae", key, {"latent": np.ones((4, 4))})
    assert np.array_equal(consumer.get("dit", "vae", key)[0]["latent"], np.ones((4, 4)))


@pytest.mark.parametrize("metadata", ["not a dict", {}, {"handles": "x"}, {"shm": {"name": "x", "size": 3}},
                                      {"source_host": "10.0.0.1", "source_port": 12345}, 17])
def test_get_with_foreign_metadata_falls_back_to_the_key(omni, metadata):
    producer, consumer = omni(), omni()
    key = _key()
    producer.put("s0", "s1", key, {"x": np.arange(3)})
    obj, _ = consumer.get("s0", "s1", key, metadata)
    assert np.array_equal(obj["x"], np.arange(3))


def test_metadata_wrapped_by_request_id_is_unwrapped(omni):
    producer = omni()
    key = _key()
    _, _, meta = producer.put("s0", "s1", key, {"wrapped": True})
    other_scope = omni(scope="elsewhere")  # cannot find the key: only the metadata leads there
    assert other_scope.get("s0", "s1", key) is None
    assert other_scope.get("s0", "s1", key, {key: meta})[0] == {"wrapped": True}


def test_metadata_of_another_edge_is_not_used(omni):
    producer, consumer = omni(), omni()
    key = _key()
    _, _, meta_ab = producer.put("a", "b", key, {"edge": "ab"})
    producer.put("a", "c", key, {"edge": "ac"})
    assert consumer.get("a", "c", key, meta_ab)[0] == {"edge": "ac"}
    assert consumer.get("a", "b", key)[0] == {"edge": "ab"}


def test_a_payload_serves_its_consumers_then_is_gone(omni):
    producer = omni(consumers=3)
    key = _key()
    producer.put("a", "b", key, {"x": np.ones(2)})
    gets = [omni().get("a", "b", key) for _ in range(4)]
    assert all(g is not None for g in gets[:3]) and gets[3] is None
    producer.reap_consumed()
    assert producer.health()["held_payloads"] == 0


def test_a_ttl_payload_serves_every_get_until_it_expires(omni):
    producer = omni(ttl=0.6)
    key = _key()
    producer.put("a", "b", key, {"x": np.arange(5)})
    for _ in range(3):
        assert omni().get("a", "b", key) is not None
    time.sleep(0.8)
    assert omni().get("a", "b", key) is None


def test_get_with_deadline_in_the_past_is_none_and_consumes_nothing(omni):
    producer, consumer = omni(), omni()
    key = _key()
    producer.put("a", "b", key, {"x": np.ones(3)})
    assert consumer.get_with_deadline("a", "b", key, deadline=time.monotonic() - 1) is None
    got = consumer.get_with_deadline("a", "b", key, deadline=time.monotonic() + 10)
    assert np.array_equal(got[0]["x"], np.ones(3))


def test_get_nowait_returns_what_is_there_and_none_otherwise(omni):
    producer, consumer = omni(), omni()
    key = _key()
    assert consumer.get_nowait("a", "b", key) is None
    producer.put("a", "b", key, [1, 2])
    assert consumer.get_nowait("a", "b", key)[0] == [1, 2]


def test_a_get_of_a_dead_producer_is_none_and_its_record_is_swept(omni, child, tmp_path):
    key = _key()
    c = child(f"""
from tensorwire.omni import TensorwireConnector as C
import numpy as np
c = C({{"registry_dir": {str(tmp_path)!r}}})
print(">", c.put("a", "b", {key!r}, {{"x": np.ones(8)}})[0], flush=True)
input()
""")
    assert c.line() == " True"
    c.kill()
    consumer = omni()
    assert consumer.get("a", "b", key) is None
    assert HostRecords(str(tmp_path)).records_of(key) == []


def test_a_record_whose_payload_is_lost_is_removed_by_the_get_that_finds_out(omni, tmp_path):
    producer, consumer = omni(), omni()
    key = _key()
    producer.put("a", "b", key, {"x": np.ones(8)})
    for p in producer._published.values():  # the payload goes while its record stays (a
        for h in p.handles:                   # producer in another PID namespace that died)
            h.retire()
    assert consumer.get("a", "b", key) is None
    assert HostRecords(str(tmp_path)).records_of(key) == []


def test_abandon_get_stops_a_get_that_is_running_and_consumes_nothing(omni, child, tmp_path):
    key = _key()
    c = child(f"""
from tensorwire.omni import TensorwireConnector as C
import numpy as np
c = C({{"registry_dir": {str(tmp_path)!r}}})
print(">", c.put("a", "b", {key!r}, {{"x": np.ones(1 << 20)}})[0], flush=True)
input()
""")
    assert c.line() == " True"
    os.kill(c.proc.pid, signal.SIGSTOP)  # the producer stops answering: a get of it waits
    consumer = omni()
    out = []
    t = threading.Thread(target=lambda: out.append(consumer.get("a", "b", key)))
    t.start()
    time.sleep(0.5)
    assert t.is_alive(), "the get should be waiting for the stopped producer"
    started = time.monotonic()
    consumer.abandon_get(key)
    t.join(10)
    assert not t.is_alive() and out == [None]
    assert time.monotonic() - started < 5
    os.kill(c.proc.pid, signal.SIGCONT)
    got = consumer.get("a", "b", key)  # nothing was consumed: the payload is still there
    assert got is not None and np.array_equal(got[0]["x"], np.ones(1 << 20))


def test_abandon_get_of_a_key_nobody_reads_changes_nothing(omni):
    producer, consumer = omni(), omni()
    key = _key()
    consumer.abandon_get(key)
    producer.put("a", "b", key, {"v": 5})
    assert consumer.get("a", "b", key)[0] == {"v": 5}


# -- cleanup and reaping ---------------------------------------------------------------------------

def test_cleanup_releases_payloads_and_records_and_says_whether_it_did(omni):
    producer, consumer = omni(), omni()
    key = _key()
    producer.put("a", "b", key, {"x": np.ones(4)})
    assert producer.cleanup(key) is True
    assert producer.cleanup(key) is False
    assert consumer.get("a", "b", key) is None
    assert producer.health()["held_payloads"] == 0


def test_cleanup_after_the_payload_was_consumed_reclaims_nothing(omni):
    producer, consumer = omni(), omni()
    key = _key()
    producer.put("a", "b", key, {"x": np.ones(4)})
    assert consumer.get("a", "b", key) is not None
    assert producer.cleanup(key) is False


def test_cleanup_covers_every_edge_of_the_key_and_no_other_key(omni):
    producer, consumer = omni(), omni()
    key = _key()
    for k in (key, key + "0", key + "_1_2", "x" + key):
        producer.put("0", "1", k, {"k": k})
    producer.put("1", "2", key, {"k": "second edge"})
    assert producer.cleanup(key) is True
    assert consumer.get("0", "1", key) is None and consumer.get("1", "2", key) is None
    for k in (key + "0", key + "_1_2", "x" + key):
        assert consumer.get("0", "1", k)[0] == {"k": k}


def test_cleanup_from_another_connector_releases_the_producers_payload(omni):
    producer, other = omni(), omni()
    key = _key()
    producer.put("a", "b", key, {"x": np.ones(4)})
    assert other.cleanup(key) is True
    assert omni().get("a", "b", key) is None
    producer.reap_consumed()
    assert producer.health()["held_payloads"] == 0


def test_reap_consumed_releases_what_another_connector_took(omni):
    producer, consumer = omni(), omni()
    keys = [_key() for _ in range(10)]
    for k in keys:
        producer.put("a", "b", k, {"k": k})
    for k in keys[:6]:
        assert consumer.get("a", "b", k) is not None
    producer.reap_consumed()
    assert producer.health()["held_payloads"] == 4
    for k in keys[6:]:
        assert consumer.get("a", "b", k)[0] == {"k": k}


def test_reap_consumed_is_bounded_and_rotates(omni):
    producer, consumer = omni(), omni()
    keys = [_key() for _ in range(10)]
    for k in keys:
        producer.put("a", "b", k, k)
    for k in keys:
        consumer.get("a", "b", k)
    producer.reap_consumed(max_keys=3)
    assert producer.health()["held_payloads"] == 7
    producer.reap_consumed(max_keys=64)
    assert producer.health()["held_payloads"] == 0


def test_health_reports_counters(omni):
    producer, consumer = omni(), omni()
    key = _key()
    _, size, _ = producer.put("a", "b", key, {"x": np.ones(16)})
    consumer.get("a", "b", key)
    hp, hc = producer.health(), consumer.health()
    assert hp["status"] == "healthy" and hp["puts"] == 1 and hp["bytes_transferred"] == size and hp["engine"]
    assert hc["gets"] == 1 and hc["bytes_transferred"] == size and hc["errors"] == 0


# -- processes and hosts ---------------------------------------------------------------------------

def test_a_put_in_one_process_is_found_by_key_in_another_with_no_configuration(child):
    key = _key()
    c = child(f"""
from tensorwire.omni import TensorwireConnector as C
import numpy
c = C({{}})
print(">", c.put("a", "b", {key!r}, {{"x": numpy.ones(4)}})[0], flush=True)
input()
""")
    assert c.line() == " True"
    with C({}) as consumer:
        obj, _ = consumer.get("a", "b", key)
        assert np.array_equal(obj["x"], np.ones(4))
        assert consumer.get("a", "b", key) is None


def test_across_hosts_with_only_the_store_address(store_node, child):
    _, _, node = store_node
    key = _key()
    c = child(f"""
from tensorwire.omni import TensorwireConnector as C
import numpy
c = C({{"store_address": {node.address!r}}})
print(">", c.put("encode", "denoise", {key!r}, {{"emb": numpy.arange(4096, dtype=numpy.float32)}})[0], flush=True)
c.close()
""")
    assert c.line() == " True"
    c.proc.wait(timeout=30)  # the producer exited: the store holds the payload
    with C({"store_address": node.address}) as consumer:
        obj, _ = consumer.get("encode", "denoise", key)
        assert np.array_equal(obj["emb"], np.arange(4096, dtype=np.float32))
        assert consumer.get("encode", "denoise", key) is None
    assert store_node[1].stats()["objects"] == 0


def test_store_mode_cleanup_and_consumer_counts(store_node):
    _, store, node = store_node
    with C({"store_address": node.address, "consumers": 2}) as producer, \
            C({"store_address": node.address}) as consumer:
        key = _key()
        producer.put("a", "b", key, {"x": np.ones(8)})
        assert consumer.get("a", "b", key) is not None
        assert consumer.get("a", "b", key) is not None
        assert consumer.get("a", "b", key) is None
        assert store.stats()["objects"] == 0
        key = _key()
        producer.put("a", "b", key, {"x": np.ones(8)})
        assert producer.cleanup(key) is True and producer.cleanup(key) is False
        assert consumer.get("a", "b", key) is None
        assert store.stats()["objects"] == 0


def test_across_two_hosts_with_only_the_store_address(netns, child):
    """The store node and the consumer on one host (a network namespace), the producer on this
    one: only the node's RPC address in both configs."""
    node = child(f"""
import tensorwire as tw
e = tw.Engine("{netns.there}:0", insecure=True)
s = tw.Store.embedded(e, 64 << 20, shared=True)
n = tw.StoreNode(s, "{netns.there}:0")
print(">", n.address, flush=True)
input()
print(">", s.stats()["objects"], flush=True)
input()
""", netns)
    address = node.line().strip()
    key = _key()
    data = {"latent": np.arange(1 << 16, dtype=np.float32).reshape(64, 1024), "meta": {"step": 8}}
    with C({"store_address": address}) as producer:
        ok, size, _ = producer.put("denoise", "decode", key, data)
        assert ok
    consumer = child(f"""
import numpy as np
from tensorwire.omni import TensorwireConnector as C
with C({{"store_address": {address!r}}}) as c:
    obj, n = c.get("denoise", "decode", {key!r})
    print(">", n, float(obj["latent"].sum()), obj["meta"]["step"], c.get("denoise", "decode", {key!r}), flush=True)
""", netns)
    n, total, step, again = consumer.line().split()
    assert (int(n), float(total), int(step), again) == (size, float(data["latent"].sum()), 8, "None")
    node.send("")
    assert node.line().strip() == "0", "the consumed payload and its record left the store"
