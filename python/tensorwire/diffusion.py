"""The RFC's diffusion API: publish a stage's output, hand its small handle to the next stage in a
queue message, consume it chunk by chunk into a destination tensor.

.. code-block:: python

    from tensorwire.diffusion import DiffusionConnector, StagePayload

    producer = DiffusionConnector(role="denoise", transfer_mode="p2p")
    handle = producer.publish(StagePayload(request_id=7, kind="latent", tensor=latents,
                                           chunk_dim=2, num_chunks=8, lease="delete_on_consume"))
    handle.mark_ready(0)                       # as each temporal chunk is produced
    ...
    consumer = DiffusionConnector(role="decode", transfer_mode="p2p")
    for chunk in consumer.consume(handle.to_bytes(), dst=dst):
        vae.decode_chunk(chunk)                # a view of dst, not a copy

Tensors are anything with ``__dlpack__`` (numpy, torch, ...): host memory, or CUDA device memory where
the process has the CUDA driver (device in, device out; see the book's "GPU tensors"). Nothing is
copied on either side: the producer's tensor is read where it is (do not change it until the
payload is consumed; in store mode, until ``handle.wait_stored()`` returned), and the consumer's
chunks land straight in ``dst``. Every wait takes a ``timeout`` in seconds and releases the GIL;
``consume_async`` is the asyncio form.
"""

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Optional, Tuple, Union

from . import _native

__all__ = ["DiffusionConnector", "PayloadHandle", "StagePayload", "chunk_view"]


@dataclass
class StagePayload:
    """A stage's output to hand to the next stage.

    ``kind``: ``"condition_embedding"``, ``"latent"``, ``"step_latent"`` (with ``step``) or
    ``"feature"``. ``chunk_dim`` / ``num_chunks``: hand it over in pieces along that dimension
    (``mark_ready(i)`` releases piece ``i``). ``lease``: ``"delete_on_consume"`` (gone once
    ``consumers`` consumers finished), ``"ttl"`` (gone ``ttl`` seconds after publishing),
    ``"soft_pin"`` or ``"pinned"``.
    """

    request_id: int
    kind: str
    tensor: Any
    chunk_dim: Optional[int] = None
    num_chunks: Optional[int] = None
    lease: str = "delete_on_consume"
    consumers: int = 1
    ttl: Optional[float] = None
    step: int = 0


def chunk_view(dst: Any, dim: Optional[int], start: int, end: int) -> Any:
    """The part ``[start, end)`` of ``dst`` along ``dim``, as a view (basic slicing of numpy,
    torch, cupy and jax arrays does not copy); ``dst`` itself when ``dim`` is None."""
    if dim is None:
        return dst
    index = [slice(None)] * len(dst.shape)
    index[dim] = slice(start, end)
    return dst[tuple(index)]


class PayloadHandle:
    """What ``publish`` returns: the payload's handle (``to_bytes()`` / ``to_str()`` travel in a
    queue message) and, on the producer, the controls of the publication."""

    def __init__(self, data: bytes, publication: Optional["_native.Publication"] = None):
        self._data = bytes(data)
        self._publication = publication
        # A handle from elsewhere is checked now (``from_bytes`` raises on one that is not a
        # handle); the one a publish just made is decoded when a field is first read (7 us
        # of a 1 MiB handoff's publish, for fields a producer seldom reads).
        self._described: Optional[dict] = None if publication is not None else _native.describe_handle(self._data)

    @property
    def _info(self) -> dict:
        if self._described is None:
            self._described = _native.describe_handle(self._data)
        return self._described

    @classmethod
    def from_bytes(cls, data: bytes) -> "PayloadHandle":
        """A handle received from a producer (raises ``InvalidArgumentError`` if it is not one)."""
        return cls(data)

    @classmethod
    def from_str(cls, text: str) -> "PayloadHandle":
        """The inverse of ``to_str``."""
        return cls(bytes.fromhex(text))

    def to_bytes(self) -> bytes:
        return self._data

    def to_str(self) -> str:
        """The handle as text (hex), for queues that carry strings."""
        return self._data.hex()

    def __bytes__(self) -> bytes:
        return self._data

    request_id = property(lambda self: self._info["request"])
    kind = property(lambda self: self._info["kind"])
    dtype = property(lambda self: self._info["dtype"], doc="numpy-style dtype name")
    shape = property(lambda self: tuple(self._info["shape"]))
    nbytes = property(lambda self: self._info["nbytes"])
    chunk_dim = property(lambda self: self._info["chunk_dim"])
    num_chunks = property(lambda self: self._info["num_chunks"])
    source = property(lambda self: self._info["source"], doc='"p2p" or "store"')
    store_key = property(lambda self: self._info["store_key"], doc="the store key of a store payload")

    def _controls(self) -> "_native.Publication":
        if self._publication is None:
            raise _errors().InvalidArgumentError("only the producer's handle controls its payload")
        return self._publication

    def mark_ready(self, index: int, stream: Any = None) -> None:
        """Chunk ``index`` is produced: consumers may fetch it now. With a CUDA ``stream`` (this
        call's, else the one given to ``publish``): once the work queued on it so far has ended
        (the call returns at once)."""
        self._controls().mark_ready(index, stream=stream)

    def mark_all_ready(self) -> None:
        """Every chunk is produced."""
        self._controls().mark_all_ready()

    def wait_stored(self, timeout: float = 30.0) -> None:
        """Store mode: returns once the payload is in the store (the tensor may change after)."""
        self._controls().wait_stored(timeout=timeout)

    def retire(self) -> bool:
        """Stop serving the payload now (its consumers see the producer gone); True if it was
        still served (not consumed, expired or retired before)."""
        return self._controls().retire()

    def __repr__(self) -> str:
        return (f"PayloadHandle(request_id={self.request_id}, kind={self.kind!r}, dtype={self.dtype!r}, "
                f"shape={self.shape}, num_chunks={self.num_chunks}, source={self.source!r})")


def _errors():
    from . import errors

    return errors


Handle = Union[PayloadHandle, bytes, str]


def _handle_bytes(handle: Handle) -> bytes:
    if isinstance(handle, PayloadHandle):
        return handle.to_bytes()
    if isinstance(handle, str):
        return bytes.fromhex(handle)
    return bytes(handle)


class DiffusionConnector:
    """Publishes and consumes stage payloads for one stage worker.

    ``role``: the stage ("encode", "denoise", "decode", or anything else; informational).
    ``transfer_mode``: ``"p2p"`` (the consumer reads the producer's tensor), ``"store"`` (the
    payload goes through a store, the producer's tensor is free once stored) or ``"auto"`` (p2p
    when ``publish`` is told a consumer has credit, else the store).
    ``store_config``: ``{"capacity": bytes}`` for a store in this process, or
    ``{"address": "host:port"}`` for a store node (its RPC address; ``node_engine`` may name its
    engine's address where the node's own answer would not reach it), or several addresses
    (comma-separated, or a list) for a cluster store over those nodes, with ``"replicas"``
    copies of each payload (2 by default).
    ``te_config``: the engine's settings: ``listen`` ("host:port"), ``secret_file``,
    ``insecure``, ``checksum``. ``checksum`` (here) verifies every chunk's crc32c.
    """

    def __init__(self, role: str = "any", transfer_mode: str = "auto", store_config: Optional[dict] = None,
                 te_config: Optional[dict] = None, checksum: bool = False, wait_timeout: float = 30.0,
                 engine: Optional["_native.Engine"] = None):
        te = dict(te_config or {})
        self.role = role
        self.engine = engine or _native.Engine(te.pop("listen", "127.0.0.1:0"), **te)
        self.store = _make_store(self.engine, store_config)
        self._conn = _native.Connector(self.engine, self.store, mode=transfer_mode, checksum=checksum,
                                       wait_timeout=wait_timeout)

    @property
    def address(self) -> str:
        """This connector's engine control address."""
        return self.engine.address

    @property
    def held(self) -> int:
        """Payloads this connector still serves to consumers."""
        return self._conn.held

    def publish(self, payload: StagePayload, consumer_credit: Optional[int] = None,
                timeout: float = 30.0, stream: Any = None) -> PayloadHandle:
        """Publishes ``payload`` and returns its handle at once. An unchunked payload is ready
        immediately; a chunked one waits for ``handle.mark_ready(i)`` per chunk. ``stream``: the
        producer's CUDA stream (a torch stream or a raw handle): the tensor is read only after the
        work queued on it before this call (an unchunked payload is then one chunk along
        dimension 0, ready when that work has ended; nothing waits on this thread)."""
        p = self._conn.publish(payload.request_id, payload.kind, payload.tensor, chunk_dim=payload.chunk_dim,
                               num_chunks=payload.num_chunks, lease=payload.lease,
                               consumers=payload.consumers, ttl=payload.ttl, step=payload.step,
                               consumer_credit=consumer_credit, timeout=timeout, stream=stream)
        return PayloadHandle(p.handle, p)

    def consume(self, handle: Handle, dst: Any, timeout: float = 30.0, hold: bool = False,
                stream: Any = None) -> Iterator[Any]:
        """Fetches the payload into ``dst`` (contiguous, the payload's dtype and shape) and yields
        each chunk as it lands (in any order), as a view of ``dst``; the payload is consumed when the iteration
        ends. ``timeout`` bounds each wait for a chunk. With ``hold``, the payload is not reported
        consumed: it stays (for a retry of this stage, should this worker die) until
        ``release(handle)``, called once the work that used it is committed. ``stream``: the
        consumer's CUDA stream: nothing lands in ``dst`` before the work queued on it before this
        call has ended, and a chunk is yielded once its bytes are in ``dst``, so what is queued
        on the stream after that sees them."""
        c = self._conn.consume(_handle_bytes(handle), dst, hold=hold, timeout=timeout, stream=stream)
        return _chunks(c, dst, timeout)

    def consume_ranges(self, handle: Handle, dst: Any, timeout: float = 30.0,
                       hold: bool = False, stream: Any = None) -> Iterator[Tuple[int, int, Any]]:
        """``consume``, yielding ``(start, end, view)`` per chunk: chunks land in any order, and
        ``[start, end)`` says where along the chunk dimension this one is."""
        c = self._conn.consume(_handle_bytes(handle), dst, hold=hold, timeout=timeout, stream=stream)
        return _ranges(c, dst, timeout)

    def release(self, handle: Handle, timeout: float = 30.0, wait: bool = True) -> None:
        """Reports the payload consumed: the end of a ``hold`` consume. A producer that is gone
        is not an error. ``wait=False`` sends the report in the background and returns at once
        (a report that fails is dropped: the payload's lease ends it then)."""
        self._conn.release(_handle_bytes(handle), wait=wait, timeout=timeout)

    async def consume_async(self, handle: Handle, dst: Any, timeout: float = 30.0,
                            stream: Any = None) -> AsyncIterator[Any]:
        """``consume`` for asyncio: each wait runs in a worker thread (the GIL is released)."""
        c = await asyncio.to_thread(self._conn.consume, _handle_bytes(handle), dst, timeout=timeout,
                                    stream=stream)
        dim = c.chunk_dim
        while True:
            landed = await asyncio.to_thread(c.next, timeout=timeout)
            if landed is None:
                return
            _, start, end = landed
            yield chunk_view(dst, dim, start, end)

    def close(self, timeout: float = 30.0) -> None:
        """Stops this connector's engine (pending transfers fail)."""
        self.engine.shutdown(timeout=timeout)


def _ranges(c: "_native.Consumption", dst: Any, timeout: float) -> Iterator[Tuple[int, int, Any]]:
    dim = c.chunk_dim
    while True:
        landed = c.next(timeout=timeout)
        if landed is None:
            return
        _, start, end = landed
        yield start, end, chunk_view(dst, dim, start, end)


def _chunks(c: "_native.Consumption", dst: Any, timeout: float) -> Iterator[Any]:
    for _, _, view in _ranges(c, dst, timeout):
        yield view


def _make_store(engine: "_native.Engine", cfg: Optional[dict]) -> Optional["_native.Store"]:
    if not cfg:
        return None
    cfg = dict(cfg)
    address, rpc = cfg.pop("address", None), cfg.pop("node_rpc", None)
    rpc = address or rpc
    nodes = rpc.split(",") if isinstance(rpc, str) else rpc
    if nodes is not None and len(nodes) > 1:
        return _native.Store.cluster(engine, [n.strip() for n in nodes], replicas=int(cfg.pop("replicas", 2)))
    if rpc is not None:
        rpc = nodes[0].strip() if nodes else rpc
        return _native.Store.connect(engine, rpc, node_engine=cfg.pop("node_engine", None), **cfg)
    if "capacity" in cfg:
        return _native.Store.embedded(engine, cfg.pop("capacity"), **cfg)
    raise _errors().InvalidArgumentError(
        "store_config needs {'capacity': bytes} or {'address': the store node's RPC address}")
