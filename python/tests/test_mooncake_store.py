"""``tensorwire.MooncakeDistributedStore`` against Mooncake Store's contract (written from the
contract in ``tensorwire/mooncake/store.py``): each call's success and failure codes, that none
raises for a missing key or a bad buffer, and the store node shared by several clients."""

import logging
import time

import numpy as np
import pytest

import tensorwire as tw
from tensorwire import MooncakeDistributedStore, ReplicateConfig
from tensorwire.mooncake import ErrorCode, SoftPinAction, TransferEngine

NOT_FOUND, INVALID = ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_PARAMS


@pytest.fixture
def store():
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 0, "tcp", "", None) == 0
    yield s
    s.close()


@pytest.fixture
def node(store_node):
    """A tensorwire store node: its RPC address (what Mooncake calls the master) and its store."""
    _, s, n = store_node
    return n.address, s


# -- setup -----------------------------------------------------------------------------------------

def test_setup_takes_every_keyword_of_mooncakes(caplog):
    s = MooncakeDistributedStore()
    with caplog.at_level(logging.INFO, logger="tensorwire.mooncake"):
        code = s.setup(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", global_segment_size=16 << 20,
                       local_buffer_size=16 << 20, protocol="tcp", rdma_devices="", master_server_addr="",
                       engine=None, enable_ssd_offload=False, ssd_offload_path="", tenant_id="default",
                       enable_client_http_server=True, client_http_port=9300, enable_standalone=True)
    assert code == 0
    assert "enable_standalone" in caplog.text and "enable_client_http_server" in caplog.text
    s.close()


def test_setup_from_a_dict_and_twice(node):
    address, _ = node
    s = MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                    "master_server_addr": address, "global_segment_size": "0"}) == 0
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", None) == -1
    assert s.close() == 0 and s.close() == 0
    assert MooncakeDistributedStore().setup({"local_hostname": "127.0.0.1", "bogus": 1}) == -1


def test_setup_with_an_unreachable_master_or_a_bad_protocol_is_minus_1():
    assert MooncakeDistributedStore().setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", "127.0.0.1:9") == -1
    assert MooncakeDistributedStore().setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 0, "cxl", "", None) == -1


def test_setup_reuses_a_transfer_engine():
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", None, engine=te) == 0
    assert s.get_hostname() == te.get_local_session_id()
    assert s.put("k", b"v") == 0 and s.get("k") == b"v"
    s.close()
    assert te.send_probe(te.get_local_session_id()) == 0, "the store does not stop an engine it was given"
    te.close()


def test_calls_before_setup_and_after_close_return_codes():
    s = MooncakeDistributedStore()
    assert s.put("k", b"v") == INVALID and s.get("k") == b"" and s.is_exist("k") < 0
    assert s.health_check() == 1 and s.register_buffer(0x1000, 64) == INVALID
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", None) == 0
    assert s.health_check() == 0
    s.close()
    assert s.health_check() == 1 and s.get_size("k") == INVALID and s.remove("k") == INVALID


# -- put and get -----------------------------------------------------------------------------------

def test_put_of_a_key_already_stored_is_0_and_keeps_the_first_value(store):
    assert store.put("k", b"first") == 0
    assert store.put("k", b"second value") == 0
    assert store.get("k") == b"first"
    assert store.upsert("k", b"second value") == 0
    assert store.get("k") == b"second value" and store.get_size("k") == 12


def test_get_and_get_size_of_a_missing_key(store):
    assert store.get("missing") == b""
    assert store.get_size("missing") == NOT_FOUND
    assert store.put("empty-ish", bytearray(b"x")) == 0 and store.get_size("empty-ish") == 1


def test_is_exist_and_batch_is_exist(store):
    store.put("a", b"1")
    assert store.is_exist("a") == 1 and store.is_exist("b") == 0
    assert store.batch_is_exist(["a", "b", "a"]) == [1, 0, 1]


def test_remove_and_batch_remove(store):
    store.put("a", b"1")
    store.put("b", b"2")
    assert store.remove("a") == 0 and store.remove("a") == NOT_FOUND
    assert store.batch_remove(["a", "b"]) == [NOT_FOUND, 0]


def test_put_batch_and_get_batch(store):
    assert store.put_batch(["x", "y"], [b"1", b"22"]) == 0
    assert store.get_batch(["x", "y", "z"]) == [b"1", b"22", b""]
    assert store.put_batch(["x"], [b"1", b"2"]) == INVALID


def test_a_full_store_says_no_room(store):
    assert store.put("big", bytes(80 << 20)) == ErrorCode.NO_AVAILABLE_HANDLE


# -- zero-copy buffers -----------------------------------------------------------------------------

def test_put_from_and_get_into_registered_buffers(store):
    buf = (np.arange(1 << 16) % 253).astype(np.uint8)
    out = np.zeros(1 << 16, dtype=np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    assert store.register_buffer(out.ctypes.data, out.nbytes) == 0
    assert store.put_from("obj", buf.ctypes.data, 4096) == 0
    assert store.get_into("obj", out.ctypes.data + 100, 4096) == 4096
    assert np.array_equal(out[100:4196], buf[:4096])
    assert store.put_from("obj", buf.ctypes.data + 1, 4096) == 0, "a key already stored is kept"
    assert store.upsert_from("obj", buf.ctypes.data + 1, 4096) == 0
    assert store.get_into("obj", out.ctypes.data, 4096) == 4096 and np.array_equal(out[:4096], buf[1:4097])


def test_get_into_a_buffer_too_small_is_minus_600_and_writes_nothing(store):
    buf = np.zeros(8192, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    store.put("obj", bytes(range(256)) * 16)
    assert store.get_into("obj", buf.ctypes.data, 1024) == INVALID
    assert not buf.any()
    small = np.zeros(100, dtype=np.uint8)
    assert store.get_into("obj", small) == INVALID, "a tensor too small"
    assert store.get_into("missing", buf.ctypes.data, 8192) == NOT_FOUND


def test_unregistered_addresses_are_minus_600(store):
    assert store.put_from("k", 0xDEAD0000, 64) == INVALID
    assert store.get_into("k", 0xDEAD0000, 64) == INVALID
    buf = np.zeros(64, dtype=np.uint8)
    assert store.put_from("k", buf.ctypes.data, 64) == INVALID, "not registered"


def test_register_buffer_codes(store):
    buf = np.zeros(4096, dtype=np.uint8)
    assert store.register_buffer(buf.ctypes.data, 4096) == 0
    assert store.register_buffer(buf.ctypes.data + 100, 100) == INVALID, "overlaps"
    assert store.register_buffer(buf.ctypes.data, 0) == INVALID
    assert store.unregister_buffer(buf.ctypes.data) == 0
    assert store.unregister_buffer(buf.ctypes.data) == INVALID


def test_batches_of_tensors_and_of_addresses(store):
    tensors = [np.full(16, i, dtype=np.float32) for i in range(3)]
    assert store.batch_put_from(["t0", "t1", "t2"], tensors) == [0, 0, 0]
    outs = [np.zeros(16, dtype=np.float32) for _ in range(3)]
    assert store.batch_get_into(["t0", "missing", "t2"], outs) == [64, NOT_FOUND, 64]
    assert np.array_equal(outs[2], tensors[2])
    region = np.zeros(256, dtype=np.uint8)
    store.register_buffer(region.ctypes.data, 256)
    a = region.ctypes.data
    assert store.batch_get_into(["t0", "t1"], [a, a + 64], [64, 64]) == [64, 64]
    assert np.array_equal(region[64:128].view(np.float32), tensors[1])


def test_batches_of_lists_of_different_lengths_touch_nothing(store):
    bufs = [np.ones(8, dtype=np.uint8) for _ in range(2)]
    assert store.batch_put_from(["a", "b", "c"], bufs) == [INVALID] * 3
    assert store.batch_is_exist(["a", "b", "c"]) == [0, 0, 0]
    assert store.batch_get_into(["a"], bufs) == [INVALID]
    assert store.batch_put_from(["a", "b"], bufs, [8]) == [INVALID] * 2


# -- ReplicateConfig -------------------------------------------------------------------------------

def test_replicate_config_has_mooncakes_fields():
    c = ReplicateConfig()
    for name, default in (("replica_num", 1), ("nof_replica_num", 0), ("dfs_replica_num", 0),
                          ("soft_pin_action", SoftPinAction.PRESERVE), ("soft_pin_ttl_ms", 0),
                          ("with_hard_pin", False), ("with_soft_pin", False), ("preferred_segment", ""),
                          ("preferred_segments", []), ("prefer_alloc_in_same_node", False), ("group_ids", None)):
        assert getattr(c, name) == default, name


def test_retention_follows_the_pins():
    c = ReplicateConfig()
    assert c.retention == "normal"
    c.soft_pin_action = SoftPinAction.ENABLE
    assert c.retention == "soft"
    assert ReplicateConfig(with_soft_pin=True).retention == "soft"
    c.with_hard_pin = True
    assert c.retention == "pinned" and c.pinned
    assert ReplicateConfig(pinned=True).retention == "pinned"


def test_what_is_not_honoured_is_logged_once(store, caplog):
    c = ReplicateConfig()
    c.replica_num = 3
    c.preferred_segment = "localhost:12345"
    c.soft_pin_ttl_ms = 60_000
    with caplog.at_level(logging.INFO, logger="tensorwire.mooncake"):
        assert store.put("a", b"1", c) == 0
        assert store.put("b", b"1", c) == 0
    for what in ("replica_num=3", "preferred_segment", "soft_pin_ttl_ms"):
        assert caplog.text.count(what) <= 1, what


def test_a_ttl_removes_the_object(store):
    assert store.put("ttl", b"x", ReplicateConfig(ttl=0.05)) == 0
    time.sleep(0.4)
    assert store.is_exist("ttl") == 0


def test_a_pinned_object_survives_eviction(store):
    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    assert store.put("keep", bytes(8 << 20), pinned) == 0
    for i in range(12):
        store.put(f"filler-{i}", bytes(8 << 20))
    assert store.is_exist("keep") == 1


# -- a store node shared by several clients --------------------------------------------------------

def test_clients_of_one_node_see_each_others_objects(node):
    address, _ = node
    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert a.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", address) == 0
    assert b.setup_dummy(0, 0, address) == 0
    assert a.put("shared", b"across clients") == 0
    assert b.get("shared") == b"across clients" and b.get_size("shared") == 14
    assert b.remove("shared") == 0 and a.is_exist("shared") == 0
    a.close()
    b.close()


def test_tenants_do_not_see_each_other(node):
    address, _ = node
    x, y = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert x.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", address, tenant_id="x") == 0
    assert y.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", address, tenant_id="y") == 0
    x.put("k", b"x's")
    assert y.get("k") == b"" and x.get("k") == b"x's"
    x.close()
    y.close()


def test_health_check_says_when_the_node_is_gone(child):
    c = child("""
import tensorwire as tw
e = tw.Engine()
n = tw.StoreNode(tw.Store.embedded(e, 16 << 20, shared=True))
print(">", n.address, flush=True)
input()
""")
    address = c.line().strip()
    s = MooncakeDistributedStore()
    s.timeout = 2.0
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", address) == 0
    assert s.health_check() == 0
    c.kill()
    assert s.health_check() == 2
    assert s.put("k", b"v") < 0 and s.get("k") == b""
    s.close()


def test_ssd_offload_is_the_spill_tier(tmp_path):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 4 << 20, 0, "tcp", "", None, enable_ssd_offload=True,
                   ssd_offload_path=str(tmp_path)) == 0
    for i in range(6):
        assert s.put(f"o{i}", bytes([i]) * (1 << 20)) == 0
    assert all(s.get(f"o{i}") == bytes([i]) * (1 << 20) for i in range(6)), "evicted objects come back"
    assert any(tmp_path.iterdir())
    s.close()
    assert MooncakeDistributedStore().setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", None,
                                            enable_ssd_offload=True) == -1


# -- several store nodes: the cluster store ---------------------------------------------------------

@pytest.fixture
def three_nodes():
    """Three store nodes, each with its own engine: [(engine, store, node)]."""
    nodes = []
    for _ in range(3):
        e = tw.Engine()
        s = tw.Store.embedded(e, 32 << 20, shared=True)
        nodes.append((e, s, tw.StoreNode(s)))
    yield nodes
    for e, _, _ in nodes:
        e.shutdown()


def test_several_master_addresses_make_a_cluster_store_with_replica_num_copies(three_nodes):
    s = MooncakeDistributedStore()
    addrs = ",".join(n.address for _, _, n in three_nodes)
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", addrs) == 0
    try:
        copies = lambda k: sum(st.exists(k.encode()) for _, st, _ in three_nodes)  # noqa: E731
        assert s.put("one", b"a" * 100) == 0
        assert copies("one") == 1, "Mooncake's default replica_num is 1"
        assert s.put("two", b"b" * 100, ReplicateConfig(replica_num=2)) == 0
        assert copies("two") == 2
        t = np.arange(1000, dtype=np.float32)
        assert s.put_from("tensor", t, config=ReplicateConfig(replica_num=3)) == 0
        assert copies("tensor") == 3
        # The engine of the node holding a copy of "two" stops: the other copy is read.
        holder = next(i for i, (_, st, _) in enumerate(three_nodes) if st.exists(b"two"))
        three_nodes[holder][0].shutdown()
        assert s.get("two") == b"b" * 100
        out = np.zeros(1000, dtype=np.float32)
        assert s.get_into("tensor", out) == 4000
        assert (out == t).all()
        assert s.remove("two") == 0
        assert s.is_exist("two") == 0
    finally:
        s.close()
