"""``TransferEngine``: Mooncake Transfer Engine's Python API (``mooncake.engine``), its contract
kept, over a tensorwire engine.

The contract (Mooncake's ``transfer_engine_py.cpp`` and its Python API reference): methods
return codes and never raise for a failed transfer, an unknown peer or bad addresses; the
reason is logged (logger ``tensorwire.mooncake``) and kept in ``last_error``.

===================================  ==========================================================
method                               returns
===================================  ==========================================================
``initialize``, ``initialize_ext``   0, or -1 (an unknown or unavailable protocol, the address
                                     in use, called twice)
``register_memory`` and the rest     0, or -1 (overlapping or unknown ranges, mismatched lists)
of the memory calls
``allocate_managed_buffer``          the buffer's address, or 0
``transfer_sync*``, ``batch_*sync*`` 0, or -1 (unreachable peer, unregistered addresses,
                                     mismatched lists, the transfer failed or timed out)
``transfer_submit_*``,               a batch id (> 0), or 0 when the transfer cannot start:
``batch_transfer_async*``            the peer and every address are resolved before it returns
``transfer_check_status``            1 done, 0 still moving, -1 failed (or an unknown or
                                     already reported id), -2 past its timeout
``get_batch_transfer_status``        waits; 0 if every batch succeeded, else -1
``read_bytes_from_buffer``           the bytes, or ``b""``
``get_first_buffer_address``         the peer's first registered address, or 0
===================================  ==========================================================

How the models map: Mooncake names memory by raw address on both sides, tensorwire by region
(id and 128-bit access key). ``register_memory(addr, length)`` registers the range as a region;
a transfer to ``peer_buffer_address`` on ``target_hostname`` (the peer engine's "host:port",
its ``get_rpc_port``) finds the region there in the peer's registrations, which engines send
each other on request over their authenticated session (an address book; keys never leave
that session, and a book goes only to the engine that asked). ``metadata_server`` is accepted
and unused: engines meet by the peer-to-peer handshake. The raw-address contract is
Mooncake's: registered memory must stay valid until ``unregister_memory`` returned.

Protocols: "tcp"; "shm" (same host; a managed buffer, ``allocate_managed_buffer``, moves by one
memcpy between processes, memory registered by address goes over tcp); "rdma" (a real device,
in a build with the ``verbs`` feature) and "ucx" (a build with the ``ucx`` feature); anything
else fails with -1. A transfer times out after ``MC_TRANSFER_TIMEOUT`` seconds (default 30,
at least 5) plus one second per GB, as Mooncake's.

Differences: ``write_bytes_to_buffer``/``read_bytes_from_buffer`` touch only memory this engine
registered or allocated (Mooncake copies to any address); ``get_local_topology`` describes this
engine's backends, not NICs; ``transport_hint`` and ``location`` are accepted and unused; the
CUDA-stream calls (``*_on_cuda``) are absent.
"""

import itertools
import json
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import _native
from ..errors import InvalidArgumentError, NotFoundError, TensorwireError, TimeoutError, UnsupportedError

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode", "PROTOCOLS"]

log = logging.getLogger("tensorwire.mooncake")

#: Mooncake protocol name -> tensorwire backends, in order of preference.
PROTOCOLS: Dict[str, List[str]] = {"tcp": ["tcp"], "shm": ["shm", "tcp"], "rdma": ["rdma"], "ucx": ["ucx"]}

_BOOK = b"TWAB"  # address-book notifications (request and reply)
_NOTE = b"TWNT"  # TransferNotify messages


class TransferOpcode:
    """Direction of a transfer."""

    READ = 0
    WRITE = 1
    Read = READ
    Write = WRITE


class TransferNotify:
    """A notification: a name and a message."""

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify({self.name!r}, {self.msg!r})"


def _timeout() -> float:
    """Mooncake's: ``MC_TRANSFER_TIMEOUT`` seconds (at least 5), default 30."""
    try:
        return max(5.0, float(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
    except ValueError:
        return 30.0


class _Local:
    __slots__ = ("length", "region", "managed")

    def __init__(self, length: int, region: Any, managed: bool):
        self.length = length
        self.region = region
        self.managed = managed


class _Batch:
    __slots__ = ("future", "deadline")

    def __init__(self, future: Future, deadline: float):
        self.future = future
        self.deadline = deadline


class _State:
    """What the engine, its notification thread, its workers and its finalizer share. None of
    them holds the ``TransferEngine``, so dropping it runs the finalizer."""

    def __init__(self, engine: Any, timeout: float):
        self.engine = engine
        self.timeout = timeout
        self.lock = threading.Lock()
        self.local: Dict[int, _Local] = {}
        self.books: Dict[str, List[Tuple[int, int, bytes]]] = {}
        self.sessions: Dict[str, Any] = {}
        self.waiting: Dict[int, Future] = {}
        self.notifies: List[TransferNotify] = []
        self.batches: Dict[int, _Batch] = {}
        self.ids = itertools.count(1)
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tensorwire-te")

    def session(self, target: str) -> Any:
        """The session with ``target`` (one handshake, then reused until a transfer fails)."""
        with self.lock:
            s = self.sessions.get(target)
        if s is None:
            s = self.engine.connect(target, timeout=self.timeout)
            with self.lock:
                self.sessions[target] = s
        return s

    def forget(self, target: str) -> None:
        """Drops what is known of ``target`` (after a failure: it may have restarted)."""
        with self.lock:
            self.sessions.pop(target, None)
            self.books.pop(target, None)

    def find_local(self, addr: int, length: int) -> Tuple[Any, int]:
        with self.lock:
            for base, e in self.local.items():
                if base <= addr and addr + length <= base + e.length:
                    return e.region, addr - base
        raise NotFoundError(f"local buffer {addr:#x}+{length} is not registered with this engine")

    def find_remote(self, target: str, addr: int, length: int) -> Tuple[bytes, int]:
        for refresh in (False, True):
            for base, cap, desc in book(self, target, refresh):
                if base <= addr and addr + length <= base + cap:
                    return desc, addr - base
        raise NotFoundError(f"{target} has no registered buffer at {addr:#x}+{length}")


def book(state: _State, target: str, refresh: bool) -> List[Tuple[int, int, bytes]]:
    """``target``'s registrations (asked for when not known or ``refresh``)."""
    with state.lock:
        if not refresh and target in state.books:
            return state.books[target]
    ident = next(state.ids)
    waiter: Future = Future()
    with state.lock:
        state.waiting[ident] = waiter
    try:
        ask = {"op": "ask", "id": ident, "reply": state.engine.address}
        state.session(target).notify(_BOOK + json.dumps(ask).encode(), timeout=state.timeout)
        entries = waiter.result(timeout=state.timeout)
    except FutureTimeout as e:
        raise TimeoutError(f"{target} did not send its registrations within {state.timeout} s") from e
    finally:
        with state.lock:
            state.waiting.pop(ident, None)
    found = [(int(a), int(n), bytes.fromhex(d)) for a, n, d in entries]
    with state.lock:
        state.books[target] = found
    return found


def pump(state: _State) -> None:
    """Receives notifications: answers address-book requests, keeps the rest for get_notifies."""
    while not state.stop.is_set():
        try:
            sender, payload = state.engine.recv_notification(timeout=0.2)
        except TimeoutError:
            continue
        except TensorwireError:
            return  # the engine stopped
        try:
            _handle(state, sender, payload)
        except Exception as e:  # a peer's malformed message must not stop the pump
            log.warning("tensorwire transfer engine: notification from %s: %s", sender, e)


def _handle(state: _State, sender: str, payload: bytes) -> None:
    if payload.startswith(_BOOK):
        m = json.loads(payload[len(_BOOK):])
        if m["op"] == "ask":
            session = state.engine.connect(str(m["reply"]), timeout=state.timeout)
            if session.peer != sender:  # a book goes only to the engine that asked for it
                log.warning("tensorwire transfer engine: %s asked for a book sent to %s (%s); refused",
                            sender, m["reply"], session.peer)
                return
            with state.lock:
                entries = [[a, e.length, e.region.descriptor().hex()] for a, e in state.local.items()]
            reply = {"op": "book", "id": m["id"], "entries": entries}
            session.notify(_BOOK + json.dumps(reply).encode(), timeout=state.timeout)
        elif m["op"] == "book":
            with state.lock:
                waiter = state.waiting.get(m["id"])
            if waiter is not None and not waiter.done():
                waiter.set_result(m["entries"])
        return
    if payload.startswith(_NOTE):
        m = json.loads(payload[len(_NOTE):])
        note = TransferNotify(str(m.get("name", sender)), str(m.get("msg", "")))
    else:
        note = TransferNotify(sender, payload.decode("utf-8", "replace"))
    with state.lock:
        state.notifies.append(note)


def _shutdown(state: _State) -> None:
    """The finalizer: stops the notification thread, the workers and the engine (its ports)."""
    state.stop.set()
    state.pool.shutdown(wait=False, cancel_futures=True)
    try:
        state.engine.shutdown(timeout=state.timeout)
    except Exception as e:
        log.debug("tensorwire transfer engine: shutdown: %s", e)


Op = Tuple[Any, int, bytes, int, int]


def prepare(state: _State, target: str, buffers: Sequence[int], peers: Sequence[int],
            lengths: Sequence[int]) -> Tuple[Any, List[Op]]:
    """The session with ``target`` and the ops: every address resolved, or an error."""
    if not (len(buffers) == len(peers) == len(lengths)):
        raise InvalidArgumentError(
            f"buffers ({len(buffers)}), peer addresses ({len(peers)}) and lengths ({len(lengths)}) differ in length")
    session = state.session(target)
    ops = []
    for local, peer, n in zip(buffers, peers, lengths):
        if n < 0:
            raise InvalidArgumentError(f"length {n}")
        region, lo = state.find_local(int(local), int(n))
        desc, ro = state.find_remote(target, int(peer), int(n))
        ops.append((region, lo, desc, ro, int(n)))
    return session, ops


def run(state: _State, target: str, session: Any, write: bool, ops: List[Op], timeout: float,
        notify: Optional[TransferNotify]) -> None:
    """Moves ``ops`` (then sends ``notify``, ordered after them); raises on failure, after
    which ``target`` is looked up afresh (it may have restarted)."""
    try:
        if ops:
            (session.batch_write if write else session.batch_read)(ops, timeout=timeout)
        if notify is not None:
            body = json.dumps({"name": notify.name, "msg": notify.msg}).encode()
            session.notify(_NOTE + body, timeout=state.timeout)
    except TensorwireError:
        state.forget(target)
        raise


class TransferEngine:
    """Mooncake's ``TransferEngine`` (see the module documentation for the contract)."""

    def __init__(self) -> None:
        self._state: Optional[_State] = None
        self._finalizer: Optional[weakref.finalize] = None
        self.last_error: Optional[BaseException] = None
        self.timeout = _timeout()

    # -- setup -------------------------------------------------------------------------------
    def initialize(self, local_hostname: str, metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp",
                   device_name: str = "", *, secret_file: Optional[str] = None, insecure: bool = False) -> int:
        """Starts the engine on ``local_hostname`` ("host" or "host:port"); 0, or -1."""
        if self._state is not None:
            return self._fail(InvalidArgumentError("initialize() was called already"))
        backends = PROTOCOLS.get(protocol)
        if backends is None:
            return self._fail(UnsupportedError(f"protocol {protocol!r}: tensorwire has {sorted(PROTOCOLS)}"))
        try:
            engine = _native.Engine(local_hostname, secret_file=secret_file, insecure=insecure, backends=backends,
                                    timeout=self.timeout)
        except TensorwireError as e:
            return self._fail(e)
        state = _State(engine, self.timeout)
        self._state = state
        self._finalizer = weakref.finalize(self, _shutdown, state)
        threading.Thread(target=pump, args=(state,), name="tensorwire-te-notify", daemon=True).start()
        return 0

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                       metadata_type: str = "p2p") -> int:
        """``initialize`` (``metadata_type`` is unused: there is no metadata service)."""
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def close(self) -> None:
        """Stops the engine and frees its ports and threads (also when the engine is dropped)."""
        if self._finalizer is not None:
            self._finalizer()

    def get_rpc_port(self) -> int:
        """The port of this engine's control endpoint (peers use "host:port" as target), or -1
        when it is not running."""
        s = self._state
        return -1 if s is None or s.stop.is_set() else int(s.engine.address.rsplit(":", 1)[1])

    def get_local_session_id(self) -> str:
        """This engine's "host:port", or "" when it is not running."""
        s = self._state
        return "" if s is None or s.stop.is_set() else s.engine.address

    def get_engine(self) -> Any:
        """The tensorwire engine underneath (``MooncakeDistributedStore.setup(engine=...)``), or
        None when it is not running."""
        s = self._state
        return None if s is None or s.stop.is_set() else s.engine

    def get_local_topology(self, device_name: Optional[str] = None) -> str:
        """JSON: this engine's address and its backends (tensorwire has no NIC matrix)."""
        s = self._state
        if s is None:
            return json.dumps({"backends": []})
        return json.dumps({"address": s.engine.address, "backends": s.engine.backends})

    def send_probe(self, peer_server_name: str) -> int:
        """0 if the engine at ``peer_server_name`` answers a handshake, else -1."""
        try:
            self._need().engine.connect(peer_server_name, timeout=self.timeout)
        except TensorwireError as e:
            return self._fail(e)
        return 0

    # -- memory ------------------------------------------------------------------------------
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers ``capacity`` bytes at ``buffer_addr`` for peers to read and write; 0 or -1."""
        try:
            s = self._need()
            self._check_free(s, int(buffer_addr), int(capacity))
            region = s.engine.register(address=int(buffer_addr), length=int(capacity), timeout=self.timeout)
        except TensorwireError as e:
            return self._fail(e)
        with s.lock:
            s.local[int(buffer_addr)] = _Local(int(capacity), region, False)
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        """Deregisters the range registered at ``buffer_addr`` (waits for transfers using it)."""
        return self._drop_local(int(buffer_addr), managed=False)

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        """Registers each range; 0, or -1 with none of them registered."""
        if len(buffer_addresses) != len(capacities):
            return self._fail(InvalidArgumentError("buffer_addresses and capacities differ in length"))
        done = []
        for a, c in zip(buffer_addresses, capacities):
            if self.register_memory(a, c) != 0:
                for d in done:
                    self.unregister_memory(d)
                return -1
            done.append(a)
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Deregisters each; 0, or -1 if any was not registered (the others are deregistered)."""
        return min([self.unregister_memory(a) for a in buffer_addresses] or [0])

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocates and registers ``length`` bytes of engine memory (shareable with same-host
        peers over "shm"); its address, or 0."""
        try:
            s = self._need()
            region = s.engine.alloc(int(length), timeout=self.timeout)
            addr = region.address
        except TensorwireError as e:
            self._fail(e)
            return 0
        with s.lock:
            s.local[addr] = _Local(int(length), region, True)
        return addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Frees a buffer of ``allocate_managed_buffer``; 0, or -1."""
        return self._drop_local(int(buffer_addr), managed=True)

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        """Copies ``length`` bytes of ``src_ptr`` to ``dest_address`` (memory this engine
        registered or allocated); 0, or -1."""
        try:
            data = bytes(src_ptr)
            if length < 0 or length > len(data):
                raise InvalidArgumentError(f"length {length} with {len(data)} source bytes")
            region, off = self._need().find_local(int(dest_address), int(length))
            region.write(off, data[:length])
        except TensorwireError as e:
            return self._fail(e)
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes at ``source_address`` (memory this engine registered or
        allocated), or ``b""``."""
        try:
            region, off = self._need().find_local(int(source_address), int(length))
            return bytes(region.read(off, int(length)))
        except TensorwireError as e:
            self._fail(e)
            return b""

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The first address ``segment_name`` (a peer engine) registered, or 0."""
        try:
            found = book(self._need(), segment_name, True)
        except TensorwireError as e:
            self._fail(e)
            return 0
        return found[0][0] if found else 0

    # -- transfers ---------------------------------------------------------------------------
    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        """WRITE ``length`` bytes at ``buffer`` to ``peer_buffer_address`` on the target; 0 or -1."""
        return self._sync(True, target_hostname, [buffer], [peer_buffer_address], [length], None)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        """READ ``length`` bytes at ``peer_buffer_address`` on the target into ``buffer``; 0 or -1."""
        return self._sync(False, target_hostname, [buffer], [peer_buffer_address], [length], None)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                      opcode: int, notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int:
        """A transfer in direction ``opcode``, then ``notify`` (delivered after it); 0 or -1."""
        write = opcode == TransferOpcode.WRITE
        return self._sync(write, target_hostname, [buffer], [peer_buffer_address], [length], notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self._sync(True, target_hostname, buffers, peer_buffer_addresses, lengths, None)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        return self._sync(False, target_hostname, buffers, peer_buffer_addresses, lengths, None)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                            lengths: Sequence[int], opcode: int, notify: Optional[TransferNotify] = None,
                            transport_hint: str = "") -> int:
        write = opcode == TransferOpcode.WRITE
        return self._sync(write, target_hostname, buffers, peer_buffer_addresses, lengths, notify)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """Starts a WRITE; a batch id for ``transfer_check_status``, or 0 if it cannot start."""
        return self._submit(True, target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_submit_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                             transport_hint: str = "") -> int:
        """Starts a READ; a batch id, or 0."""
        return self._submit(False, target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        return self._submit(True, target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self._submit(False, target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                             lengths: Sequence[int], opcode: int, transport_hint: str = "") -> int:
        write = opcode == TransferOpcode.WRITE
        return self._submit(write, target_hostname, buffers, peer_buffer_addresses, lengths)

    def transfer_check_status(self, batch_id: int) -> int:
        """1: done, 0: still moving, -1: failed or unknown (an id is reported done or failed
        once), -2: past its timeout."""
        s = self._state
        b = None if s is None else s.batches.get(batch_id)
        if b is None:
            return -1
        if b.future.done():
            del s.batches[batch_id]
            if b.future.cancelled():
                return self._fail(InvalidArgumentError(f"batch {batch_id}: cancelled (the engine was closed)"))
            e = b.future.exception()
            if e is None:
                return 1
            self._fail(e)
            return -2 if isinstance(e, TimeoutError) else -1
        return -2 if time.monotonic() > b.deadline else 0

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Waits for every batch (each until its timeout); 0 if all succeeded, else -1."""
        s = self._state
        if s is None:
            return -1
        ok = True
        for i in batch_ids:
            b = s.batches.pop(i, None)
            if b is None:
                ok = False
                continue
            try:
                b.future.result(timeout=max(b.deadline - time.monotonic(), 0.0))
            except FutureTimeout:
                self._fail(TimeoutError(f"batch {i}: not done within its timeout"))
                ok = False
            except Exception as e:
                self._fail(e)
                ok = False
        return 0 if ok else -1

    # -- notifications -----------------------------------------------------------------------
    def send_notify(self, target_hostname: str, notify: TransferNotify) -> int:
        """Sends ``notify`` to the target (after every earlier transfer to it); 0 or -1."""
        return self._sync(True, target_hostname, [], [], [], notify)

    def get_notifies(self) -> List[TransferNotify]:
        """The notifications received since the last call."""
        s = self._state
        if s is None:
            return []
        with s.lock:
            out, s.notifies = s.notifies, []
        return out

    # -- internals ---------------------------------------------------------------------------
    def _need(self) -> _State:
        if self._state is None or self._state.stop.is_set():
            raise InvalidArgumentError("the engine is not running: call initialize() first")
        return self._state

    def _fail(self, e: BaseException) -> int:
        self.last_error = e
        log.warning("tensorwire transfer engine: %s", e)
        return -1

    def _drop_local(self, addr: int, managed: bool) -> int:
        """Deregisters the memory registered (or, ``managed``, allocated) at ``addr``; 0 or -1."""
        try:
            s = self._need()
            with s.lock:
                e = s.local.get(addr)
                if e is None or e.managed != managed:
                    what = ("not a managed buffer" if managed else
                            "a managed buffer (free_managed_buffer frees it)" if e else "not registered")
                    raise NotFoundError(f"{addr:#x}: {what}")
                del s.local[addr]
            e.region.close(timeout=self.timeout)
        except TensorwireError as e:
            return self._fail(e)
        return 0

    def _budget(self, lengths: Sequence[int]) -> float:
        return self.timeout + sum(int(n) for n in lengths) / 1e9  # Mooncake's: plus 1 s per GB

    def _check_free(self, s: _State, addr: int, length: int) -> None:
        if length <= 0:
            raise InvalidArgumentError(f"capacity {length}: must be positive")
        with s.lock:
            for base, e in s.local.items():
                if addr < base + e.length and base < addr + length:
                    raise InvalidArgumentError(
                        f"{addr:#x}+{length} overlaps the buffer registered at {base:#x}+{e.length}")

    def _sync(self, write: bool, target: str, buffers: Sequence[int], peers: Sequence[int],
              lengths: Sequence[int], notify: Optional[TransferNotify]) -> int:
        try:
            s = self._need()
            session, ops = prepare(s, target, buffers, peers, lengths)
            run(s, target, session, write, ops, self._budget(lengths), notify)
        except TensorwireError as e:
            return self._fail(e)
        return 0

    def _submit(self, write: bool, target: str, buffers: Sequence[int], peers: Sequence[int],
                lengths: Sequence[int]) -> int:
        try:
            s = self._need()
            session, ops = prepare(s, target, buffers, peers, lengths)
            budget = self._budget(lengths)
            future = s.pool.submit(run, s, target, session, write, ops, budget, None)
        except (TensorwireError, RuntimeError) as e:  # RuntimeError: the pool was shut down
            self._fail(e)
            return 0
        batch = next(s.ids)
        s.batches[batch] = _Batch(future, time.monotonic() + budget)
        return batch
