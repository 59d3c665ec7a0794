"""Mooncake-shaped APIs, so ports are mostly an import change: ``TransferEngine`` (like
``mooncake.engine.TransferEngine``) and ``MooncakeDistributedStore`` with ``ReplicateConfig``
(like ``mooncake.store``).

How Mooncake's model maps onto tensorwire's:

- Mooncake names memory by raw virtual address on both sides. tensorwire names it by region
  (id + 128-bit access key). ``register_memory(addr, length)`` registers the range as a region;
  a transfer to ``peer_buffer_address`` on ``target_hostname`` looks the address up in the peer's
  registrations, which the two engines exchange on demand (an "address book" sent as an engine
  notification over the authenticated session). Keys never leave that session.
- ``target_hostname`` is the peer engine's control address ("host:port", see ``get_rpc_port``);
  ``metadata_server`` is accepted and ignored (P2P handshake; there is no metadata service).
- Methods return 0 on success and a negative number on failure, like Mooncake's; the failure is
  kept in ``last_error``. The raw-address contract is Mooncake's too: registered memory must stay
  valid until ``unregister_memory`` returned.
- The store's ``ReplicateConfig`` has no replicas here (one store node); ``with_soft_pin`` and
  ``pinned`` map to retention, ``ttl`` to a lease.
"""

import itertools
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

from . import _native
from .errors import TensorwireError, TimeoutError

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "TransferEngine", "TransferNotify", "TransferOpcode"]

log = logging.getLogger("tensorwire.mooncake")

_BOOK = b"TWAB"  # address-book notifications (request and reply)


class TransferOpcode:
    """Direction of a transfer."""

    READ = 0
    WRITE = 1


class TransferNotify:
    """A notification: a name (the sender's engine id by default) and a message."""

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify({self.name!r}, {self.msg!r})"


class TransferEngine:
    """A transfer engine with Mooncake's Python method names (see the module docs for the mapping)."""

    def __init__(self) -> None:
        self._engine: Optional[_native.Engine] = None
        self._local: Dict[int, Tuple[int, _native.Region]] = {}  # addr -> (length, region)
        self._books: Dict[str, List[Tuple[int, int, bytes]]] = {}  # peer -> [(addr, len, descriptor)]
        self._waiting: Dict[int, Future] = {}
        self._notifies: List[TransferNotify] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tensorwire-submit")
        self._batches: Dict[int, Future] = {}
        self._stop = threading.Event()
        self.last_error: Optional[BaseException] = None
        self.timeout = 30.0

    # -- setup -------------------------------------------------------------------------------
    def initialize(self, local_hostname: str, metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp",
                   device_name: str = "", secret_file: Optional[str] = None, insecure: bool = False) -> int:
        """Starts the engine on ``local_hostname`` ("host" or "host:port"). ``protocol`` must be
        "tcp"; ``metadata_server`` and ``device_name`` are accepted for compatibility."""
        if protocol != "tcp":
            return self._fail(_native_error("UnsupportedError", f"protocol {protocol!r}: only tcp here"))
        try:
            self._engine = _native.Engine(local_hostname, secret_file=secret_file, insecure=insecure)
        except TensorwireError as e:
            return self._fail(e)
        threading.Thread(target=self._pump, name="tensorwire-notify", daemon=True).start()
        return 0

    def get_rpc_port(self) -> int:
        """The port of this engine's control endpoint (peers use "host:port" as target)."""
        return int(self._need().address.rsplit(":", 1)[1])

    def get_local_session_id(self) -> str:
        """This engine's "host:port"."""
        return self._need().address

    # -- memory ------------------------------------------------------------------------------
    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        """Registers ``capacity`` bytes at ``buffer_addr``; peers may read and write them."""
        try:
            region = self._need().register(address=buffer_addr, length=capacity, timeout=self.timeout)
        except TensorwireError as e:
            return self._fail(e)
        with self._lock:
            self._local[buffer_addr] = (capacity, region)
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        """Deregisters the range registered at ``buffer_addr`` (waits for transfers using it)."""
        with self._lock:
            entry = self._local.pop(buffer_addr, None)
        if entry is None:
            return self._fail(_native_error("NotFoundError", f"no memory registered at {buffer_addr:#x}"))
        try:
            entry[1].close(timeout=self.timeout)
        except TensorwireError as e:
            return self._fail(e)
        return 0

    def batch_register_memory(self, buffer_addrs: List[int], capacities: List[int]) -> int:
        return min([self.register_memory(a, c) for a, c in zip(buffer_addrs, capacities)] or [0])

    def batch_unregister_memory(self, buffer_addrs: List[int]) -> int:
        return min([self.unregister_memory(a) for a in buffer_addrs] or [0])

    # -- transfers ---------------------------------------------------------------------------
    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        """WRITE ``length`` bytes at local ``buffer`` to ``peer_buffer_address`` on the target."""
        return self.batch_transfer_sync_write(target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        """READ ``length`` bytes at ``peer_buffer_address`` on the target into local ``buffer``."""
        return self.batch_transfer_sync_read(target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                      opcode: int) -> int:
        if opcode == TransferOpcode.WRITE:
            return self.transfer_sync_write(target_hostname, buffer, peer_buffer_address, length)
        return self.transfer_sync_read(target_hostname, buffer, peer_buffer_address, length)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
                                  lengths: List[int]) -> int:
        return self._batch(True, target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
                                 lengths: List[int]) -> int:
        return self._batch(False, target_hostname, buffers, peer_buffer_addresses, lengths)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        """Starts a WRITE; returns a batch id for ``transfer_check_status``."""
        batch = next(self._ids)
        self._batches[batch] = self._pool.submit(self.transfer_sync_write, target_hostname, buffer,
                                                 peer_buffer_address, length)
        return batch

    def transfer_submit_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        batch = next(self._ids)
        self._batches[batch] = self._pool.submit(self.transfer_sync_read, target_hostname, buffer,
                                                 peer_buffer_address, length)
        return batch

    def transfer_check_status(self, batch_id: int) -> int:
        """1: done, 0: still moving, -1: failed (see ``last_error``) or unknown batch."""
        f = self._batches.get(batch_id)
        if f is None:
            return -1
        if not f.done():
            return 0
        del self._batches[batch_id]
        return 1 if f.result() == 0 else -1

    # -- notifications -----------------------------------------------------------------------
    def send_notify(self, target_hostname: str, notify: TransferNotify) -> int:
        """Sends ``notify`` to the target (after every earlier transfer to it)."""
        try:
            body = json.dumps({"name": notify.name, "msg": notify.msg}).encode()
            self._need().connect(target_hostname, timeout=self.timeout).notify(b"TWNT" + body, timeout=self.timeout)
        except TensorwireError as e:
            return self._fail(e)
        return 0

    def get_notifies(self) -> List[TransferNotify]:
        """The notifications received since the last call."""
        with self._lock:
            out, self._notifies = self._notifies, []
        return out

    def close(self) -> None:
        """Stops the engine."""
        self._stop.set()
        if self._engine is not None:
            self._engine.shutdown(timeout=self.timeout)
        self._pool.shutdown(wait=False)

    # -- internals ---------------------------------------------------------------------------
    def _need(self) -> _native.Engine:
        if self._engine is None:
            raise _native_error("InvalidArgumentError", "call initialize() first")
        return self._engine

    def _fail(self, e: BaseException) -> int:
        self.last_error = e
        log.warning("tensorwire transfer engine: %s", e)
        return -1

    def _find_local(self, addr: int, length: int) -> Tuple[_native.Region, int]:
        with self._lock:
            for base, (cap, region) in self._local.items():
                if base <= addr and addr + length <= base + cap:
                    return region, addr - base
        raise _native_error("NotFoundError", f"local buffer {addr:#x}+{length} is not registered")

    def _find_remote(self, target: str, addr: int, length: int) -> Tuple[bytes, int]:
        for refresh in (False, True):
            book = self._book(target, refresh)
            for base, cap, desc in book:
                if base <= addr and addr + length <= base + cap:
                    return desc, addr - base
        raise _native_error("NotFoundError", f"{target} has no registered buffer at {addr:#x}+{length}")

    def _batch(self, write: bool, target: str, buffers: List[int], peers: List[int], lengths: List[int]) -> int:
        try:
            if not (len(buffers) == len(peers) == len(lengths)):
                raise _native_error("InvalidArgumentError", "buffers, peer addresses and lengths differ in length")
            session = self._need().connect(target, timeout=self.timeout)
            ops = []
            for local, peer, n in zip(buffers, peers, lengths):
                region, lo = self._find_local(local, n)
                desc, ro = self._find_remote(target, peer, n)
                ops.append((region, lo, desc, ro, n))
            if write:
                session.batch_write(ops, timeout=self.timeout)
            else:
                session.batch_read(ops, timeout=self.timeout)
        except TensorwireError as e:
            return self._fail(e)
        return 0

    def _book(self, target: str, refresh: bool) -> List[Tuple[int, int, bytes]]:
        if not refresh and target in self._books:
            return self._books[target]
        ident = next(self._ids)
        waiter: Future = Future()
        self._waiting[ident] = waiter
        ask = {"op": "ask", "id": ident, "reply": self._need().address}
        self._need().connect(target, timeout=self.timeout).notify(_BOOK + json.dumps(ask).encode(),
                                                                   timeout=self.timeout)
        try:
            entries = waiter.result(timeout=self.timeout)
        except Exception as e:
            raise TimeoutError(f"{target} did not send its registrations within {self.timeout} s") from e
        finally:
            self._waiting.pop(ident, None)
        book = [(a, n, bytes.fromhex(d)) for a, n, d in entries]
        self._books[target] = book
        return book

    def _pump(self) -> None:
        """Receives notifications: answers address-book requests, keeps the rest for get_notifies."""
        while not self._stop.is_set():
            try:
                sender, payload = self._engine.recv_notification(timeout=0.2)
            except TimeoutError:
                continue
            except TensorwireError:
                return  # the engine stopped
            try:
                self._handle(sender, payload)
            except Exception as e:  # a peer's malformed message must not stop the pump
                log.warning("tensorwire transfer engine: notification from %s: %s", sender, e)

    def _handle(self, sender: str, payload: bytes) -> None:
        if payload.startswith(_BOOK):
            m = json.loads(payload[len(_BOOK):])
            if m["op"] == "ask":
                with self._lock:
                    entries = [[a, cap, r.descriptor().hex()] for a, (cap, r) in self._local.items()]
                reply = {"op": "book", "id": m["id"], "entries": entries}
                self._engine.connect(m["reply"], timeout=self.timeout).notify(
                    _BOOK + json.dumps(reply).encode(), timeout=self.timeout)
            elif m["op"] == "book" and m["id"] in self._waiting:
                self._waiting[m["id"]].set_result(m["entries"])
            return
        if payload.startswith(b"TWNT"):
            m = json.loads(payload[4:])
            note = TransferNotify(m.get("name", sender), m.get("msg", ""))
        else:
            note = TransferNotify(sender, payload.decode("utf-8", "replace"))
        with self._lock:
            self._notifies.append(note)


class ReplicateConfig:
    """How an object is kept: ``with_soft_pin`` (evicted after every normal object), ``pinned``
    (never evicted), ``ttl`` (seconds until it is removed). ``replica_num`` is accepted; there is
    one copy."""

    def __init__(self, replica_num: int = 1, with_soft_pin: bool = False, pinned: bool = False,
                 ttl: Optional[float] = None):
        self.replica_num = replica_num
        self.with_soft_pin = with_soft_pin
        self.pinned = pinned
        self.ttl = ttl

    @property
    def retention(self) -> str:
        return "pinned" if self.pinned else "soft" if self.with_soft_pin else "normal"


class MooncakeDistributedStore:
    """A store with Mooncake's Python method names over a tensorwire store (embedded in this
    process, or a client of a store node). ``put``/``get`` take bytes; ``put_from``/``get_into``
    take a buffer registered with ``register_buffer`` (address, size) or a tensor."""

    def __init__(self) -> None:
        self._engine: Optional[_native.Engine] = None
        self._store: Optional[_native.Store] = None
        self._buffers: Dict[int, Tuple[int, _native.Region]] = {}
        self.timeout = 30.0

    def setup(self, local_hostname: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE",
              global_segment_size: int = 512 << 20, local_buffer_size: int = 0, protocol: str = "tcp",
              rdma_devices: str = "", master_server_addr: Optional[str] = None,
              node_rpc: Optional[str] = None, secret_file: Optional[str] = None) -> int:
        """With ``master_server_addr`` (a store node's engine address) and ``node_rpc``, connects
        to that node; without, keeps a ``global_segment_size``-byte store in this process."""
        try:
            self._engine = _native.Engine(local_hostname, secret_file=secret_file)
            if master_server_addr and node_rpc:
                self._store = _native.Store.connect(self._engine, master_server_addr, node_rpc)
            else:
                self._store = _native.Store.embedded(self._engine, global_segment_size, shared=True)
        except TensorwireError as e:
            log.warning("tensorwire store: %s", e)
            return -1
        return 0

    def _s(self) -> _native.Store:
        if self._store is None:
            raise _native_error("InvalidArgumentError", "call setup() first")
        return self._store

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Registers a buffer for ``put_from``/``get_into`` by address (valid until unregistered)."""
        self._buffers[buffer_ptr] = (size, self._engine.register(address=buffer_ptr, length=size))
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        entry = self._buffers.pop(buffer_ptr, None)
        if entry is None:
            return -1
        entry[1].close(timeout=self.timeout)
        return 0

    def _region(self, ptr: int, size: int) -> Tuple[_native.Region, int]:
        for base, (cap, region) in self._buffers.items():
            if base <= ptr and ptr + size <= base + cap:
                return region, ptr - base
        raise _native_error("NotFoundError", f"buffer {ptr:#x}+{size} is not registered (register_buffer)")

    def put(self, key: str, value: bytes, config: Optional[ReplicateConfig] = None) -> int:
        cfg = config or ReplicateConfig()
        self._s().put(key, value, retention=cfg.retention, timeout=self.timeout)
        if cfg.ttl is not None:
            self._s().set_lease(key, ttl=cfg.ttl, timeout=self.timeout)
        return 0

    def get(self, key: str) -> bytes:
        """The value, or b"" when the key is not stored (as Mooncake)."""
        try:
            return self._s().get(key, timeout=self.timeout)
        except KeyError:
            return b""

    def put_from(self, key: str, buffer: Any, size: Optional[int] = None,
                 config: Optional[ReplicateConfig] = None) -> int:
        """Stores ``size`` bytes of a registered buffer (an address), or a tensor, without a copy."""
        cfg = config or ReplicateConfig()
        if isinstance(buffer, int):
            region, off = self._region(buffer, size or 0)
            self._s().put_from_region(key, region, off, size or 0, retention=cfg.retention, timeout=self.timeout)
        else:
            self._s().put_from(key, buffer, retention=cfg.retention, timeout=self.timeout)
        if cfg.ttl is not None:
            self._s().set_lease(key, ttl=cfg.ttl, timeout=self.timeout)
        return 0

    def get_into(self, key: str, buffer: Any, size: Optional[int] = None) -> int:
        """Copies the value into a registered buffer (an address) or a tensor; returns its length,
        or a negative number when the key is not stored."""
        try:
            if isinstance(buffer, int):
                region, off = self._region(buffer, size or 0)
                return self._s().get_into_region(key, region, off, timeout=self.timeout)
            return self._s().get_into(key, buffer, timeout=self.timeout)
        except KeyError:
            return -1

    def batch_put_from(self, keys: List[str], buffers: List[Any], sizes: Optional[List[int]] = None,
                       config: Optional[ReplicateConfig] = None) -> List[int]:
        sizes = sizes or [None] * len(keys)
        return [self._status(self.put_from, k, b, n, config) for k, b, n in zip(keys, buffers, sizes)]

    def batch_get_into(self, keys: List[str], buffers: List[Any], sizes: Optional[List[int]] = None) -> List[int]:
        sizes = sizes or [None] * len(keys)
        return [self._status(self.get_into, k, b, n) for k, b, n in zip(keys, buffers, sizes)]

    @staticmethod
    def _status(f: Any, *args: Any) -> int:
        try:
            return f(*args)
        except TensorwireError as e:
            log.warning("tensorwire store: %s", e)
            return -1

    def remove(self, key: str) -> int:
        """0 when removed, -1 when it was not there."""
        return 0 if self._s().remove(key, timeout=self.timeout) else -1

    def is_exist(self, key: str) -> int:
        """1 if stored, 0 if not, -1 on error (as Mooncake)."""
        try:
            return 1 if self._s().exists(key, timeout=self.timeout) else 0
        except TensorwireError:
            return -1

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown(timeout=self.timeout)


def _native_error(name: str, message: str) -> TensorwireError:
    from . import errors

    return getattr(errors, name)(message)
