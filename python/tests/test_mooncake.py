"""The Mooncake-shaped API: a port keeps its calls (initialize, register_memory, transfer_sync_*,
batch and async submits, notifications; the store's put/get/put_from/get_into/batch/remove/
is_exist with ReplicateConfig) and changes its import."""

import time

import numpy as np
import pytest

from tensorwire import MooncakeDistributedStore, ReplicateConfig, TransferEngine, TransferNotify


@pytest.fixture
def pair():
    server, client = TransferEngine(), TransferEngine()
    assert server.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert client.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield server, client
    server.close()
    client.close()


def test_writes_and_reads_by_address(pair):
    server, client = pair
    server_buf = np.zeros(1 << 20, dtype=np.uint8)
    client_buf = (np.arange(1 << 20) % 251).astype(np.uint8)
    assert server.register_memory(server_buf.ctypes.data, server_buf.nbytes) == 0
    assert client.register_memory(client_buf.ctypes.data, client_buf.nbytes) == 0
    target = f"127.0.0.1:{server.get_rpc_port()}"
    ptr = server_buf.ctypes.data  # handed over out of band, as with Mooncake
    assert client.transfer_sync_write(target, client_buf.ctypes.data, ptr, 1 << 20) == 0
    assert np.array_equal(server_buf, client_buf)
    back = np.zeros(4096, dtype=np.uint8)
    client.register_memory(back.ctypes.data, back.nbytes)
    assert client.transfer_sync_read(target, back.ctypes.data, ptr + 4096, 4096) == 0
    assert np.array_equal(back, client_buf[4096:8192])


def test_batches_and_async_submits(pair):
    server, client = pair
    sbuf, cbuf = np.zeros(8 * 4096, dtype=np.uint8), np.full(8 * 4096, 3, dtype=np.uint8)
    server.register_memory(sbuf.ctypes.data, sbuf.nbytes)
    client.register_memory(cbuf.ctypes.data, cbuf.nbytes)
    target = server.get_local_session_id()
    offs = [i * 4096 for i in range(8)]
    assert client.batch_transfer_sync_write(target, [cbuf.ctypes.data + o for o in offs],
                                            [sbuf.ctypes.data + o for o in offs], [4096] * 8) == 0
    assert (sbuf == 3).all()
    cbuf[:] = 5
    batch = client.transfer_submit_write(target, cbuf.ctypes.data, sbuf.ctypes.data, 4096)
    deadline = time.time() + 10
    while client.transfer_check_status(batch) == 0 and time.time() < deadline:
        time.sleep(0.01)
    assert (sbuf[:4096] == 5).all()


def test_unregistered_addresses_fail_with_a_reason(pair):
    server, client = pair
    buf = np.zeros(64, dtype=np.uint8)
    client.register_memory(buf.ctypes.data, 64)
    target = server.get_local_session_id()
    assert client.transfer_sync_write(target, buf.ctypes.data, 0xDEAD0000, 64) < 0
    assert "no registered buffer" in str(client.last_error)
    assert client.unregister_memory(buf.ctypes.data) == 0
    assert client.unregister_memory(buf.ctypes.data) < 0


def test_notifications(pair):
    server, client = pair
    assert client.send_notify(server.get_local_session_id(), TransferNotify("kv", "layer 3 done")) == 0
    deadline, got = time.time() + 5, []
    while not got and time.time() < deadline:
        got = server.get_notifies()
        time.sleep(0.01)
    assert [(n.name, n.msg) for n in got] == [("kv", "layer 3 done")]


def test_the_store_api():
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 0, "tcp", "", None) == 0
    assert store.put("a", b"value", ReplicateConfig(with_soft_pin=True)) == 0
    assert store.get("a") == b"value" and store.get("missing") == b""
    assert store.is_exist("a") == 1 and store.is_exist("missing") == 0
    buf = np.arange(256, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    assert store.put_from("b", buf.ctypes.data, 256, ReplicateConfig(pinned=True)) == 0
    out = np.zeros(256, dtype=np.uint8)
    assert store.get_into("b", out) == 256 and np.array_equal(out, buf)
    tensors = [np.full(16, i, dtype=np.float32) for i in range(3)]
    assert store.batch_put_from(["t0", "t1", "t2"], tensors) == [0, 0, 0]
    outs = [np.zeros(16, dtype=np.float32) for _ in range(3)]
    assert store.batch_get_into(["t0", "t1", "t2"], outs) == [64, 64, 64]
    assert store.get_into("missing", outs[0]) < 0
    assert store.remove("a") == 0 and store.remove("a") == -1
    store.put("ttl", b"x", ReplicateConfig(ttl=0.05))
    time.sleep(0.4)
    assert store.is_exist("ttl") == 0
    store.unregister_buffer(buf.ctypes.data)
    store.close()
