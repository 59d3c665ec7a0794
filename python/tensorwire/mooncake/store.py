"""``MooncakeDistributedStore`` and ``ReplicateConfig``: Mooncake Store's Python API
(``mooncake.store``), its contract kept, over a tensorwire store.

The contract (Mooncake's ``store_py.cpp``, ``real_client.cpp`` and its Python API reference):
calls return codes and never raise for a missing key or a failed transfer; codes are Mooncake's
``ErrorCode`` values, the reason is logged (logger ``tensorwire.mooncake``).

================================  ===============================================================
call                              returns
================================  ===============================================================
``setup``, ``setup_dummy``        0, or -1 (the store node unreachable, a bad protocol, twice)
``put``, ``put_from``,            0; a key already stored stays as it was and ``put`` returns 0
``put_batch``                     (Mooncake's put keeps the first value: ``upsert`` replaces);
                                  -200 no room, -600 bad arguments, -800 a failed transfer
``upsert``, ``upsert_from``       0 (the value replaced or stored), or as ``put``
``get``                           the bytes, or ``b""`` (missing, or any failure)
``get_into``                      the object's length, or -704 missing, -600 the buffer too
                                  small or not registered
``get_size``                      the length, or -704
``is_exist``                      1, 0, or < 0 on error; ``batch_is_exist``: one per key
``remove``                        0, or -704 missing; ``batch_remove``: one per key
``batch_put_from``,               one code per key; lists of different lengths give
``batch_get_into``                ``[-600] * len(keys)`` and touch nothing
``register_buffer``,              0, or -600 (overlapping, unknown)
``unregister_buffer``
``health_check``                  0 healthy, 1 not set up or closed, 2 the store node unreachable
``close``                         0 (idempotent)
================================  ===============================================================

Where the objects live: with ``master_server_addr`` (or ``setup_dummy``'s ``server_address``)
they live on the tensorwire store node listening there (``tensorwire serve`` starts one; its
RPC address, port 7100 by default): any client of that node sees them, across hosts. With
several comma-separated addresses there, on a cluster store over those nodes: each object on
``ReplicateConfig.replica_num`` of them (placed by rendezvous hashing of the key), read from
any live copy, so a put with ``replica_num`` >= 2 survives the loss of a node. Without
(None or ""), in a ``global_segment_size``-byte store in this process, with
``enable_ssd_offload`` as its spill tier (in ``ssd_offload_path``). ``put_from``/``get_into``
move bytes between a registered buffer (``register_buffer``) or a tensor (``__dlpack__``) and
the store without a copy.

Accepted and not honoured (logged once each): ``replica_num`` > 1 with one store node (or
none: one copy is kept), ``nof_replica_num``, ``dfs_replica_num``, ``preferred_segment(s)``,
``prefer_alloc_in_same_node``, ``group_ids``, ``data_type``;
``soft_pin_ttl_ms`` (a soft pin lasts for the object's life: tensorwire cannot demote it later);
``local_buffer_size``, ``rdma_devices``, ``enable_client_http_server``, ``client_http_port``,
``enable_standalone``, and ``global_segment_size`` with a store node (the node owns its pool).
``tenant_id`` other than "default" prefixes every key.
"""

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .. import _native
from ..errors import (
    CapacityError,
    ChecksumError,
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    NotFoundError,
    OutOfBoundsError,
    PeerClosedError,
    TensorwireError,
    TimeoutError,
)
from .engine import PROTOCOLS, TransferEngine

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "ErrorCode"]

log = logging.getLogger("tensorwire.mooncake")


class ErrorCode:
    """Mooncake's error codes that these calls return."""

    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200
    INVALID_PARAMS = -600
    OBJECT_NOT_FOUND = -704
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    RPC_TIMEOUT = -901


def _code(e: BaseException) -> int:
    """The Mooncake code for a tensorwire error."""
    for cls, code in ((KeyNotFoundError, ErrorCode.OBJECT_NOT_FOUND), (CapacityError, ErrorCode.NO_AVAILABLE_HANDLE),
                      (OutOfBoundsError, ErrorCode.INVALID_PARAMS), (InvalidArgumentError, ErrorCode.INVALID_PARAMS),
                      (NotFoundError, ErrorCode.INVALID_PARAMS), (ChecksumError, ErrorCode.CHECKSUM_MISMATCH),
                      (TimeoutError, ErrorCode.RPC_TIMEOUT), (PeerClosedError, ErrorCode.RPC_FAIL)):
        if isinstance(e, cls):
            return code
    return ErrorCode.TRANSFER_FAIL if isinstance(e, TensorwireError) else ErrorCode.INTERNAL_ERROR


_logged: set = set()


def _once(what: str) -> None:
    if what not in _logged:
        _logged.add(what)
        log.info("tensorwire store: %s", what)


class SoftPinAction:
    """What a put does to the object's soft pin."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicateConfig:
    """How an object is kept (Mooncake's fields; see the module documentation for those
    tensorwire does not honour). ``with_hard_pin`` (or ``pinned``): never evicted;
    ``with_soft_pin`` or ``soft_pin_action = ENABLE``: evicted after every ordinary object;
    ``ttl`` (tensorwire's own, seconds): removed that long after the put."""

    def __init__(self, replica_num: int = 1, with_soft_pin: bool = False, pinned: bool = False,
                 ttl: Optional[float] = None):
        self.replica_num = replica_num
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms = 0
        self.with_soft_pin = with_soft_pin
        self.with_hard_pin = pinned
        self.preferred_segment = ""
        self.preferred_segments: List[str] = []
        self.prefer_alloc_in_same_node = False
        self.group_ids: Optional[List[str]] = None
        self.data_type = None
        self.ttl = ttl

    @property
    def pinned(self) -> bool:
        return self.with_hard_pin

    @pinned.setter
    def pinned(self, v: bool) -> None:
        self.with_hard_pin = v

    @property
    def retention(self) -> str:
        """The tensorwire retention ("pinned", "soft" or "normal"); logs what is not honoured."""
        for name in ("nof_replica_num", "dfs_replica_num", "preferred_segment", "preferred_segments",
                     "prefer_alloc_in_same_node", "group_ids", "data_type"):
            if getattr(self, name):
                _once(f"ReplicateConfig.{name} is accepted and not honoured")
        if self.soft_pin_ttl_ms:
            _once("ReplicateConfig.soft_pin_ttl_ms: the soft pin lasts for the object's life")
        if self.with_hard_pin:
            return "pinned"
        if self.with_soft_pin or self.soft_pin_action == SoftPinAction.ENABLE:
            return "soft"
        return "normal"

    def __repr__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, with_soft_pin={self.with_soft_pin}, "
                f"with_hard_pin={self.with_hard_pin}, ttl={self.ttl})")


_DEFAULT = ReplicateConfig()


class MooncakeDistributedStore:
    """Mooncake's store client (see the module documentation for the contract)."""

    def __init__(self) -> None:
        self._engine: Optional[Any] = None
        self._store: Optional[Any] = None
        self._own_engine = False
        self._remote = False
        self._prefix = b""
        self._buffers: Dict[int, Tuple[int, Any]] = {}
        self._views: Dict[int, Any] = {}
        self.timeout = 30.0

    # -- setup -------------------------------------------------------------------------------
    def setup(self, local_hostname: Any = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE",
              global_segment_size: int = 16 << 20, local_buffer_size: int = 16 << 20, protocol: str = "tcp",
              rdma_devices: str = "", master_server_addr: Optional[str] = None, engine: Any = None,
              enable_ssd_offload: bool = False, ssd_offload_path: str = "", tenant_id: str = "default",
              enable_client_http_server: bool = False, client_http_port: int = 9300,
              enable_standalone: bool = False, *, secret_file: Optional[str] = None, insecure: bool = False) -> int:
        """Mooncake's ``setup`` (positional, or one dict of the same keys); 0, or -1."""
        if isinstance(local_hostname, dict):
            cfg = dict(local_hostname)
            cfg.setdefault("local_hostname", "127.0.0.1")
            cfg.setdefault("master_server_addr", "127.0.0.1:50051")
            for k in ("global_segment_size", "local_buffer_size", "client_http_port"):
                if k in cfg:
                    cfg[k] = int(cfg[k])
            try:
                return self.setup(**cfg)
            except TypeError as e:
                log.warning("tensorwire store: setup: %s", e)
                return -1
        if self._store is not None:
            log.warning("tensorwire store: setup() was called already")
            return -1
        for name, value in (("local_buffer_size", local_buffer_size), ("rdma_devices", rdma_devices),
                            ("enable_client_http_server", enable_client_http_server),
                            ("enable_standalone", enable_standalone)):
            if value:
                _once(f"setup({name}=...) is accepted and not used")
        if tenant_id and tenant_id != "default":
            self._prefix = f"{tenant_id}\x00".encode()
        try:
            if isinstance(engine, TransferEngine):
                engine = engine.get_engine()
            if engine is None:
                backends = PROTOCOLS.get(protocol)
                if backends is None:
                    raise InvalidArgumentError(f"protocol {protocol!r}: tensorwire has {sorted(PROTOCOLS)}")
                engine = _native.Engine(local_hostname, secret_file=secret_file, insecure=insecure,
                                        backends=backends, timeout=self.timeout)
                self._own_engine = True
            self._engine = engine
            if master_server_addr:
                if global_segment_size:
                    _once("setup(global_segment_size=...) with a store node: the node owns its pool")
                nodes = [a.strip() for a in master_server_addr.split(",") if a.strip()]
                if len(nodes) > 1:
                    # Mooncake's default replica_num is 1: each put names its own count.
                    self._store = _native.Store.cluster(engine, nodes, replicas=1)
                else:
                    self._store = _native.Store.connect(engine, master_server_addr, timeout=self.timeout)
                self._remote = True
            else:
                spill = (ssd_offload_path or None) if enable_ssd_offload else None
                if enable_ssd_offload and spill is None:
                    raise InvalidArgumentError("enable_ssd_offload needs ssd_offload_path")
                self._store = _native.Store.embedded(engine, int(global_segment_size), spill_dir=spill,
                                                     shared=True, timeout=self.timeout)
        except TensorwireError as e:
            log.warning("tensorwire store: setup: %s", e)
            self._teardown()
            return -1
        return 0

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """A client of the store node at ``server_address`` (Mooncake's dummy client reaches a
        real client there; tensorwire's store node plays that part); 0, or -1."""
        return self.setup("127.0.0.1", "P2PHANDSHAKE", 0, local_buffer_size, "tcp", "", server_address)

    def close(self) -> int:
        """Stops this client (and its engine, when setup made one); 0. Idempotent."""
        self._teardown()
        return 0

    def _teardown(self) -> None:
        for ptr in list(self._buffers):
            self.unregister_buffer(ptr)
        engine, own = self._engine, self._own_engine
        self._store, self._engine, self._own_engine = None, None, False
        self._views = {}
        if engine is not None and own:
            try:
                engine.shutdown(timeout=self.timeout)
            except TensorwireError as e:
                log.debug("tensorwire store: shutdown: %s", e)

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 the store (node) does not answer."""
        if self._store is None:
            return 1
        try:
            self._store.stats(timeout=self.timeout)
        except TensorwireError:
            return 2
        return 0

    def get_hostname(self) -> str:
        """This client's engine address ("host:port"), or "" before ``setup``."""
        return self._engine.address if self._engine is not None else ""

    # -- buffers -----------------------------------------------------------------------------
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Registers ``size`` bytes at ``buffer_ptr`` for ``put_from``/``get_into`` by address
        (the memory must stay valid until ``unregister_buffer``); 0 or -600."""
        try:
            if self._engine is None:
                raise InvalidArgumentError("call setup() first")
            ptr, size = int(buffer_ptr), int(size)
            if size <= 0:
                raise InvalidArgumentError(f"size {size}")
            for base, (n, _) in self._buffers.items():
                if ptr < base + n and base < ptr + size:
                    raise InvalidArgumentError(f"{ptr:#x}+{size} overlaps the buffer at {base:#x}+{n}")
            region = self._engine.register(address=ptr, length=size, timeout=self.timeout)
        except TensorwireError as e:
            return self._fail("register_buffer", e)
        self._buffers[ptr] = (size, region)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Deregisters a buffer of ``register_buffer`` (waiting for its transfers); 0 or -600."""
        entry = self._buffers.pop(int(buffer_ptr), None)
        if entry is None:
            return self._fail("unregister_buffer", InvalidArgumentError(f"{int(buffer_ptr):#x} is not registered"))
        try:
            entry[1].close(timeout=self.timeout)
        except TensorwireError as e:
            return self._fail("unregister_buffer", e)
        return 0

    # -- objects -----------------------------------------------------------------------------
    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        """Stores a copy of ``value`` (bytes-like); a key already stored keeps its value. 0 or < 0."""
        return self._guard("put", self._put, key, bytes(value), config, False)

    def upsert(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        """``put`` that replaces the value of a key already stored."""
        return self._guard("upsert", self._put, key, bytes(value), config, True)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: Optional[ReplicateConfig] = None) -> int:
        """``put`` of each; 0, or the first failure's code (-600 for lists of different lengths)."""
        if len(keys) != len(values):
            return self._fail("put_batch", InvalidArgumentError("keys and values differ in length"))
        codes = [self.put(k, v, config) for k, v in zip(keys, values)]
        return next((c for c in codes if c != 0), 0)

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` when the key is not stored (or anything failed)."""
        try:
            return bytes(self._s().get(self._key(key), timeout=self.timeout))
        except TensorwireError as e:
            if not isinstance(e, KeyNotFoundError):
                self._fail("get", e)
            return b""

    def get_batch(self, keys: Sequence[str]) -> List[bytes]:
        return [self.get(k) for k in keys]

    def get_size(self, key: str) -> int:
        """The value's length, or -704 when the key is not stored."""
        return self._guard("get_size", lambda k: self._s().size(self._key(k), timeout=self.timeout), key)

    def put_from(self, key: str, buffer_ptr: Any, size: Optional[int] = None,
                 config: Optional[ReplicateConfig] = None) -> int:
        """Stores ``size`` bytes of a registered buffer (an address), or a tensor, without a
        copy; a key already stored keeps its value. 0 or < 0."""
        return self._guard("put_from", self._put_from, key, buffer_ptr, size, config, False)

    def upsert_from(self, key: str, buffer_ptr: Any, size: Optional[int] = None,
                    config: Optional[ReplicateConfig] = None) -> int:
        """``put_from`` that replaces the value of a key already stored."""
        return self._guard("upsert_from", self._put_from, key, buffer_ptr, size, config, True)

    def get_into(self, key: str, buffer_ptr: Any, size: Optional[int] = None) -> int:
        """Copies the value into a registered buffer of ``size`` bytes (an address), or a tensor,
        without a staging copy; its length, -704 when missing, -600 when it does not fit."""
        return self._guard("get_into", self._get_into, key, buffer_ptr, size)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[Any], sizes: Optional[Sequence[int]] = None,
                       config: Optional[ReplicateConfig] = None) -> List[int]:
        """``put_from`` of each: one code per key."""
        return self._batch("batch_put_from", keys, buffer_ptrs, sizes,
                           lambda k, b, n: self.put_from(k, b, n, config))

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[Any],
                       sizes: Optional[Sequence[int]] = None) -> List[int]:
        """``get_into`` of each: one length or code per key."""
        return self._batch("batch_get_into", keys, buffer_ptrs, sizes, self.get_into)

    def remove(self, key: str, force: bool = False) -> int:
        """0 when removed, -704 when it was not there."""
        def rm(k: str) -> int:
            if self._s().remove(self._key(k), timeout=self.timeout):
                return 0
            return ErrorCode.OBJECT_NOT_FOUND
        return self._guard("remove", rm, key)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> List[int]:
        return [self.remove(k, force) for k in keys]

    def is_exist(self, key: str) -> int:
        """1 if stored, 0 if not, < 0 on error."""
        return self._guard("is_exist", lambda k: int(self._s().exists(self._key(k), timeout=self.timeout)), key)

    def batch_is_exist(self, keys: Sequence[str]) -> List[int]:
        """``is_exist`` of each."""
        return [self.is_exist(k) for k in keys]

    # -- internals ---------------------------------------------------------------------------
    def _s(self) -> Any:
        if self._store is None:
            raise InvalidArgumentError("call setup() first")
        return self._store

    def _key(self, key: Any) -> bytes:
        k = key.encode() if isinstance(key, str) else bytes(key)
        return self._prefix + k

    def _fail(self, what: str, e: BaseException) -> int:
        log.warning("tensorwire store: %s: %s", what, e)
        return _code(e)

    def _guard(self, what: str, f: Callable[..., int], *args: Any) -> int:
        try:
            return f(*args)
        except KeyNotFoundError as e:
            return _code(e)
        except TensorwireError as e:
            return self._fail(what, e)

    def _stored(self, key: bytes, replace: bool, config: ReplicateConfig, store: Callable[[], None]) -> int:
        """Runs ``store`` (a put of ``key``), then sets the TTL of ``config``: 0. A key already
        stored is replaced first (``replace``), or kept as it was (lease included)."""
        if replace:
            self._s().remove(key, timeout=self.timeout)
        try:
            store()
        except KeyExistsError:
            return 0
        if config.ttl is not None:
            self._s().set_lease(key, ttl=config.ttl, timeout=self.timeout)
        return 0

    def _put(self, key: str, value: bytes, config: Optional[ReplicateConfig], replace: bool) -> int:
        cfg, k = config or _DEFAULT, self._key(key)
        s = self._copies(cfg)
        return self._stored(k, replace, cfg,
                            lambda: s.put(k, value, retention=cfg.retention, timeout=self.timeout))

    def _copies(self, cfg: ReplicateConfig) -> Any:
        """The store whose puts keep ``cfg.replica_num`` copies (a cluster store), or the store
        (one copy, said once when more were asked for)."""
        s, n = self._s(), max(1, int(cfg.replica_num))
        if n == 1:
            return s
        if not s.is_cluster:
            _once(f"ReplicateConfig.replica_num={n}: one copy is kept (one store node)")
            return s
        if n not in self._views:
            self._views[n] = s.with_replicas(n)
        return self._views[n]

    def _region(self, ptr: int, size: int) -> Tuple[Any, int, int]:
        """The registered buffer holding ``ptr..ptr+size``: (region, offset, bytes from there)."""
        for base, (n, region) in self._buffers.items():
            if base <= ptr and ptr + size <= base + n:
                return region, ptr - base, base + n - ptr
        raise InvalidArgumentError(f"buffer {ptr:#x}+{size} is not registered (register_buffer)")

    def _put_from(self, key: str, buffer: Any, size: Optional[int], config: Optional[ReplicateConfig],
                  replace: bool) -> int:
        cfg, k = config or _DEFAULT, self._key(key)
        s = self._copies(cfg)
        if isinstance(buffer, int):
            if size is None or size <= 0:
                raise InvalidArgumentError(f"put_from of an address needs a positive size, not {size}")
            region, off, _ = self._region(buffer, int(size))
            put = lambda: s.put_from_region(k, region, off, int(size), retention=cfg.retention, timeout=self.timeout)  # noqa: E731
        else:
            put = lambda: s.put_from(k, buffer, retention=cfg.retention, timeout=self.timeout)  # noqa: E731
        return self._stored(k, replace, cfg, put)

    def _get_into(self, key: str, buffer: Any, size: Optional[int]) -> int:
        k, s = self._key(key), self._s()
        if not isinstance(buffer, int):
            return int(s.get_into(k, buffer, timeout=self.timeout))
        if size is None or size <= 0:
            raise InvalidArgumentError(f"get_into an address needs a positive size, not {size}")
        region, off, room = self._region(buffer, int(size))
        if room > size:  # the registered buffer is larger: the object must fit in `size` bytes
            n = s.size(k, timeout=self.timeout)
            if n > size:
                raise InvalidArgumentError(f"{key!r} is {n} bytes; the buffer holds {size}")
        return int(s.get_into_region(k, region, off, timeout=self.timeout))

    def _batch(self, what: str, keys: Sequence[str], buffers: Sequence[Any], sizes: Optional[Sequence[int]],
               one: Callable[[str, Any, Optional[int]], int]) -> List[int]:
        sizes = list(sizes) if sizes is not None else [None] * len(buffers)
        if not (len(keys) == len(buffers) == len(sizes)):
            self._fail(what, InvalidArgumentError(
                f"{len(keys)} keys, {len(buffers)} buffers and {len(sizes)} sizes"))
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        return [one(k, b, n) for k, b, n in zip(keys, buffers, sizes)]
