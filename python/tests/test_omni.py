"""The vLLM-Omni-shaped connector: nested data with tensors moves zero-copy (the rest pickled),
one producer serves several consumers, cleanup releases, health reports."""

import numpy as np
import pytest

from tensorwire.omni import TensorwireConnector


@pytest.fixture
def connectors(store_node):
    node_engine, _, node = store_node
    store = {"node_engine": node_engine.address, "node_rpc": node.address}
    producer = TensorwireConnector({"store_config": store, "consumers": 2})
    consumers = [TensorwireConnector({"store_config": store}) for _ in range(2)]
    yield producer, consumers


def test_nested_data_round_trips(connectors):
    producer, (consumer, _) = connectors
    data = {"hidden": np.arange(1000, dtype=np.float32).reshape(10, 100), "ids": [1, 2, 3],
            "extra": ("text", np.ones((2, 2), dtype=np.int64))}
    ok, size, meta = producer.put("thinker", "talker", "req-1", data)
    assert ok and size == 4000 + 32
    obj, got = consumer.get("thinker", "talker", "req-1", meta)
    assert got == size
    assert np.array_equal(obj["hidden"], data["hidden"]) and obj["ids"] == [1, 2, 3]
    assert obj["extra"][0] == "text" and np.array_equal(obj["extra"][1], data["extra"][1])


def test_one_producer_many_consumers_without_metadata(connectors):
    producer, consumers = connectors
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    producer.put("dit", "vae", 7, {"latent": x})
    for c in consumers:
        obj, _ = c.get("dit", "vae", 7)  # metadata found in the store
        assert np.array_equal(obj["latent"], x)


def test_a_missing_request_is_none_and_cleanup_releases(connectors):
    producer, (consumer, _) = connectors
    assert consumer.get("a", "b", "never") is None
    producer.put("a", "b", "r", {"x": np.zeros(8, dtype=np.uint8)})
    producer.cleanup("r")
    assert consumer.get("a", "b", "r") is None


def test_health(connectors):
    producer, _ = connectors
    h = producer.health()
    assert h["status"] == "healthy" and "store" in h and h["engine"]
