"""``tensorwire.TransferEngine`` against Mooncake's Transfer Engine contract (written from the
contract in ``tensorwire/mooncake/engine.py``): each method's success value, its failure value,
and that none raises for a failed transfer, an unknown peer or a bad address."""

import gc
import json
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from tensorwire import TransferEngine, TransferNotify
from tensorwire.mooncake import TransferOpcode


def _engine(protocol="tcp", host="127.0.0.1"):
    e = TransferEngine()
    assert e.initialize(host, "P2PHANDSHAKE", protocol, "") == 0
    return e


@pytest.fixture
def pair():
    server, client = _engine(), _engine()
    yield server, client
    server.close()
    client.close()


def _buffers(server, client, n=1 << 16):
    sbuf, cbuf = np.zeros(n, dtype=np.uint8), (np.arange(n) % 251).astype(np.uint8)
    assert server.register_memory(sbuf.ctypes.data, sbuf.nbytes) == 0
    assert client.register_memory(cbuf.ctypes.data, cbuf.nbytes) == 0
    return sbuf, cbuf


def _wait_status(e, batch, timeout=10.0):
    end = time.monotonic() + timeout
    while (s := e.transfer_check_status(batch)) == 0 and time.monotonic() < end:
        time.sleep(0.005)
    return s


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- initialize ------------------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_initialize_with_a_protocol_tensorwire_has_is_0(protocol):
    e = _engine(protocol)
    topology = json.loads(e.get_local_topology())
    assert topology["backends"][0] == protocol
    e.close()


def test_initialize_with_rdma_without_a_device_is_minus_1():
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has an RDMA device")
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == -1
    assert "RDMA device" in str(e.last_error)


def test_initialize_with_ucx_in_a_build_without_it_is_minus_1():
    e = TransferEngine()
    code = e.initialize("127.0.0.1", "P2PHANDSHAKE", "ucx", "")
    if code == 0:
        e.close()
        pytest.skip("this package was built with the ucx feature")
    assert code == -1 and "ucx" in str(e.last_error)


@pytest.mark.parametrize("protocol", ["nvlink", "efa", "", "TCP"])
def test_initialize_with_a_protocol_tensorwire_lacks_is_minus_1(protocol):
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == -1
    assert "protocol" in str(e.last_error)


def test_initialize_twice_and_a_port_in_use_are_minus_1():
    e = _engine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    taken = TransferEngine()
    assert taken.initialize(f"127.0.0.1:{e.get_rpc_port()}", "P2PHANDSHAKE", "tcp", "") == -1
    e.close()


def test_calls_before_initialize_return_their_failure_values():
    e = TransferEngine()
    assert e.register_memory(0x1000, 64) == -1
    assert e.transfer_sync_write("127.0.0.1:9", 0x1000, 0x2000, 64) == -1
    assert e.transfer_submit_write("127.0.0.1:9", 0x1000, 0x2000, 64) == 0
    assert e.allocate_managed_buffer(64) == 0
    assert e.read_bytes_from_buffer(0x1000, 4) == b""
    assert e.transfer_check_status(1) == -1
    assert e.get_notifies() == []
    e.close()


# -- teardown --------------------------------------------------------------------------------------

def test_a_dropped_engine_frees_its_port_and_threads():
    port = _free_port()
    e = TransferEngine()
    assert e.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") == 0
    del e
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.name.startswith("tensorwire-te") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tensorwire-te")]
    again = TransferEngine()
    assert again.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") == 0
    again.close()


def test_close_frees_the_port_and_is_idempotent():
    e = _engine()
    port = e.get_rpc_port()
    e.close()
    e.close()
    again = TransferEngine()
    assert again.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.transfer_sync_write(again.get_local_session_id(), 1, 2, 3) == -1
    assert (e.get_rpc_port(), e.get_local_session_id(), e.get_engine()) == (-1, "", None)
    again.close()


# -- memory ----------------------------------------------------------------------------------------

def test_register_and_unregister_codes(pair):
    _, client = pair
    buf = np.zeros(4096, dtype=np.uint8)
    a = buf.ctypes.data
    assert client.register_memory(a, 4096) == 0
    assert client.register_memory(a + 1024, 1024) == -1, "overlapping"
    assert client.register_memory(a + 8192, 0) == -1, "empty"
    assert client.unregister_memory(a + 1) == -1, "not a registered start"
    assert client.unregister_memory(a) == 0
    assert client.unregister_memory(a) == -1


def test_batch_register_is_all_or_nothing(pair):
    _, client = pair
    bufs = [np.zeros(1024, dtype=np.uint8) for _ in range(3)]
    addrs = [b.ctypes.data for b in bufs]
    assert client.batch_register_memory(addrs, [1024, 1024]) == -1, "lists of different lengths"
    assert client.register_memory(addrs[2], 1024) == 0
    assert client.batch_register_memory(addrs, [1024] * 3) == -1, "the third overlaps"
    assert client.register_memory(addrs[0], 1024) == 0, "the first was rolled back"
    assert client.batch_unregister_memory([addrs[0], addrs[2]]) == 0
    assert client.batch_unregister_memory([addrs[0]]) == -1


def test_managed_buffers_and_their_bytes(pair):
    server, client = pair
    addr = client.allocate_managed_buffer(1 << 20)
    assert addr != 0
    assert client.write_bytes_to_buffer(addr + 100, b"managed bytes", 13) == 0
    assert client.read_bytes_from_buffer(addr + 100, 13) == b"managed bytes"
    assert client.write_bytes_to_buffer(addr, b"abc", 4) == -1, "longer than the source"
    assert client.write_bytes_to_buffer(addr + (1 << 20) - 2, b"abcd", 4) == -1, "past the end"
    assert client.read_bytes_from_buffer(0x10, 4) == b"", "memory this engine does not know"
    assert client.unregister_memory(addr) == -1, "a managed buffer is freed, not unregistered"
    assert client.free_managed_buffer(addr, 1 << 20) == 0
    assert client.free_managed_buffer(addr, 1 << 20) == -1


def test_get_first_buffer_address_names_the_peers_first_registration(pair):
    server, client = pair
    first, second = np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    server.register_memory(first.ctypes.data, 64)
    server.register_memory(second.ctypes.data, 64)
    assert client.get_first_buffer_address(server.get_local_session_id()) == first.ctypes.data
    assert client.get_first_buffer_address("127.0.0.1:9") == 0


# -- transfers -------------------------------------------------------------------------------------

def test_sync_writes_and_reads_by_address(pair):
    server, client = pair
    sbuf, cbuf = _buffers(server, client)
    target = f"127.0.0.1:{server.get_rpc_port()}"
    assert client.transfer_sync_write(target, cbuf.ctypes.data, sbuf.ctypes.data, cbuf.nbytes) == 0
    assert np.array_equal(sbuf, cbuf)
    back = np.zeros(4096, dtype=np.uint8)
    client.register_memory(back.ctypes.data, back.nbytes)
    assert client.transfer_sync_read(target, back.ctypes.data, sbuf.ctypes.data + 4096, 4096) == 0
    assert np.array_equal(back, cbuf[4096:8192])
    assert client.transfer_sync(target, cbuf.ctypes.data, sbuf.ctypes.data, 16, TransferOpcode.READ) == 0


def test_sync_failures_are_minus_1_with_a_reason(pair):
    server, client = pair
    sbuf, cbuf = _buffers(server, client)
    target = server.get_local_session_id()
    assert client.transfer_sync_write(target, cbuf.ctypes.data, 0xDEAD0000, 64) == -1
    assert "no registered buffer" in str(client.last_error)
    assert client.transfer_sync_write(target, 0xBEEF0000, sbuf.ctypes.data, 64) == -1
    assert "not registered" in str(client.last_error)
    assert client.transfer_sync_write("127.0.0.1:9", cbuf.ctypes.data, sbuf.ctypes.data, 64) == -1
    assert client.transfer_sync_write(target, cbuf.ctypes.data, sbuf.ctypes.data + sbuf.nbytes - 8, 64) == -1
    assert client.batch_transfer_sync_write(target, [cbuf.ctypes.data], [sbuf.ctypes.data] * 2, [64]) == -1


def test_batches_sync(pair):
    server, client = pair
    sbuf, cbuf = _buffers(server, client)
    target = server.get_local_session_id()
    offs = [i * 4096 for i in range(8)]
    assert client.batch_transfer_sync_write(target, [cbuf.ctypes.data + o for o in offs],
                                            [sbuf.ctypes.data + o for o in offs], [4096] * 8) == 0
    assert np.array_equal(sbuf[:8 * 4096], cbuf[:8 * 4096])
    cbuf[:] = 0
    assert client.batch_transfer_sync(target, [cbuf.ctypes.data], [sbuf.ctypes.data], [4096],
                                      TransferOpcode.READ) == 0
    assert np.array_equal(cbuf[:4096], sbuf[:4096])


def test_submit_to_an_unreachable_peer_is_0(pair):
    server, client = pair
    _, cbuf = _buffers(server, client)
    assert client.transfer_submit_write("127.0.0.1:9", cbuf.ctypes.data, 0x1000, 64) == 0
    assert client.batch_transfer_async_write("127.0.0.1:9", [cbuf.ctypes.data], [0x1000], [64]) == 0


def test_submit_with_an_unknown_address_or_mismatched_lists_is_0(pair):
    server, client = pair
    sbuf, cbuf = _buffers(server, client)
    target = server.get_local_session_id()
    assert client.transfer_submit_write(target, cbuf.ctypes.data, 0xDEAD0000, 64) == 0
    assert client.batch_transfer_async_read(target, [cbuf.ctypes.data], [sbuf.ctypes.data, 0], [64]) == 0


def test_submit_then_check_status(pair):
    server, client = pair
    sbuf, cbuf = _buffers(server, client)
    target = server.get_local_session_id()
    batch = client.transfer_submit_write(target, cbuf.ctypes.data, sbuf.ctypes.data, 4096)
    assert batch > 0
    assert _wait_status(client, batch) == 1
    assert np.array_equal(sbuf[:4096], cbuf[:4096])
    assert client.transfer_check_status(batch) == -1, "reported once"
    assert client.transfer_check_status(987654) == -1, "unknown"
    read = client.transfer_submit_read(target, cbuf.ctypes.data + 8192, sbuf.ctypes.data, 16)
    assert _wait_status(client, read) == 1


def test_async_batches_and_get_batch_transfer_status(pair):
    server, client = pair
    sbuf, cbuf = _buffers(server, client)
    target = server.get_local_session_id()
    ids = [client.batch_transfer_async_write(target, [cbuf.ctypes.data + i * 1024], [sbuf.ctypes.data + i * 1024],
                                             [1024]) for i in range(4)]
    ids.append(client.batch_transfer_async(target, [cbuf.ctypes.data], [sbuf.ctypes.data], [16],
                                           TransferOpcode.WRITE))
    assert all(i > 0 for i in ids)
    assert client.get_batch_transfer_status(ids) == 0
    assert np.array_equal(sbuf[:4096], cbuf[:4096])
    assert client.get_batch_transfer_status([ids[0]]) == -1, "already waited for"


def test_a_stalled_transfer_reports_minus_2_past_its_timeout(child):
    c = child("""
import numpy as np
from tensorwire import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = np.zeros(1 << 24, dtype=np.uint8)
e.register_memory(buf.ctypes.data, buf.nbytes)
print(">", e.get_local_session_id(), buf.ctypes.data, flush=True)
input()
""")
    target, peer_addr = c.line().split()
    client = _engine()
    cbuf = np.ones(1 << 24, dtype=np.uint8)
    client.register_memory(cbuf.ctypes.data, cbuf.nbytes)
    assert client.transfer_sync_write(target, cbuf.ctypes.data, int(peer_addr), 4096) == 0  # book fetched
    os.kill(c.proc.pid, signal.SIGSTOP)
    client.timeout = 0.3
    batch = client.transfer_submit_write(target, cbuf.ctypes.data, int(peer_addr), cbuf.nbytes)
    assert batch > 0
    assert client.transfer_check_status(batch) == 0
    time.sleep(0.6)
    assert client.transfer_check_status(batch) == -2
    os.kill(c.proc.pid, signal.SIGCONT)
    client.close()


def test_a_notify_arrives_after_the_transfer_it_follows(pair):
    server, client = pair
    sbuf, cbuf = _buffers(server, client)
    target = server.get_local_session_id()
    assert client.transfer_sync(target, cbuf.ctypes.data, sbuf.ctypes.data, 4096, TransferOpcode.WRITE,
                                TransferNotify("kv", "layer 3 done")) == 0
    deadline, got = time.time() + 5, []
    while not got and time.time() < deadline:
        got = server.get_notifies()
        time.sleep(0.01)
    assert [(n.name, n.msg) for n in got] == [("kv", "layer 3 done")]
    assert np.array_equal(sbuf[:4096], cbuf[:4096])
    assert client.send_notify(target, TransferNotify("a", "b")) == 0
    assert client.send_notify("127.0.0.1:9", TransferNotify("a", "b")) == -1


def test_send_probe(pair):
    server, client = pair
    assert client.send_probe(server.get_local_session_id()) == 0
    assert client.send_probe("127.0.0.1:9") == -1


def test_two_processes_over_shm(child):
    c = child("""
from tensorwire import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "shm", "") == 0
addr = e.allocate_managed_buffer(1 << 20)
print(">", e.get_local_session_id(), addr, flush=True)
n = int(input())
print(">", e.read_bytes_from_buffer(addr, n).hex(), flush=True)
""")
    target, peer_addr = c.line().split()
    e = _engine("shm")
    local = e.allocate_managed_buffer(1 << 20)
    data = bytes(range(256)) * 16
    assert e.write_bytes_to_buffer(local, data, len(data)) == 0
    assert e.transfer_sync_write(target, local, int(peer_addr), len(data)) == 0
    c.send(str(len(data)))
    assert bytes.fromhex(c.line().strip()) == data
    assert e.get_engine().moved() == {"shm": len(data)}, "a managed buffer moves over shm, not tcp"
    e.close()
